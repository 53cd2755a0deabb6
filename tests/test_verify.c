/* Verification of untrusted peers (docs/PIPELINE.md "Verification"), with the real fusion-broker,
 * three real fusion-peer processes and the real client on loopback:
 *   - the sketch itself: deterministic, linear, seed-dependent, norm exact;
 *   - verify = 1.0 over honest peers: every sampled micro-batch of stage 0 agrees, the broker logs
 *     and records (events "verified") them, and the adapter equals `fusion run finetune`'s;
 *   - a dishonest stage-0 peer (the test-only hook FUSION_TEST_CORRUPT_OUTPUT=scale:FILE, armed by
 *     creating FILE once the plan is known) is caught: its reputation falls below the threshold,
 *     its stage fails over to the backup, it gets no more work, and the job still finishes. The test
 *     prints how many verified samples it took. */
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <sodium.h>

#include "db.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "fu_safetensors.h"
#include "peer_verify.h"
#include "testutil.h"

#define N_PEERS 4 /* at most; the tests run 3 (one backup) or 4 (two backups: a third opinion) */
/* Each peer offers 60 MiB: the broker's plan for the 8-layer model needs about 71 MiB in one stage and
 * about 52 MiB per stage in two, so every job runs as a two-stage pipeline whatever speeds the peers
 * measured on a loaded machine. */
#define PEER_MEM_GB "0.0586"

typedef struct {
    char *dir;
    pid_t broker;
    pid_t peers[N_PEERS];
    int n_peers; /* started */
    char endpoint[128];
    char conn[1024]; /* --broker ... --broker-key ... --keys ... for the client */
} cluster;

static cluster *g_live; /* the running cluster, for the teardown after a failed assertion */

static pid_t spawn(const char *log, char *const argv[], const char *corrupt)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* no orphans when ctest kills a test on its timeout */
        if (corrupt) /* the fault-injection hook (peer_verify.h): corrupt outputs while the file exists */
            setenv("FUSION_TEST_CORRUPT_OUTPUT", corrupt, 1);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static char *slurp(const char *path)
{
    char *d = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    if (fu_file_read_all(path, (size_t)64 << 20, &d, &n, &em) != FU_OK)
        return strdup("");
    return d;
}

/* Waits until the file holds `needle`; true when it does. */
static bool wait_for(const char *path, const char *needle, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        char *d = slurp(path);
        bool ok = strstr(d, needle) != NULL;
        free(d);
        if (ok)
            return true;
        fu_sleep_ms(20);
    }
    return false;
}

static void show(const char *path)
{
    char *out = NULL;
    (void)tu_sh(&out, "tail -n 30 '%s'", path);
    printf("---- %s ----\n%s\n", path, out ? out : "");
    free(out);
}

static int wait_pid(pid_t pid, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        fu_sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

static void cluster_start(cluster *c, const char *tag, int n_peers)
{
    memset(c, 0, sizeof *c);
    c->n_peers = n_peers;
    g_live = c;
    c->dir = tu_tmpdir(tag);
    assert_non_null(c->dir);
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && for k in broker p0 p1 p2 p3 client; do '%s' keygen -o $k >/dev/null || exit 1; done && "
                   "grep -hv '^#' p0/public.key p1/public.key p2/public.key p3/public.key client/public.key > allow && "
                   "'%s' model init -o model --layers 8 --hidden 256 --ffn 1024 --seed 2 >/dev/null",
                   c->dir, tu_bin("fusion"), tu_bin("fusion"));
    if (rc != 0)
        fail_msg("setup failed: %s", out);
    free(out);
    /* Training text: a deterministic word stream. */
    char path[4096];
    snprintf(path, sizeof path, "%s/data.txt", c->dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    static const char *words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs",
                                  "far", "away", "into", "forest", "river", "stone"};
    uint32_t x = 12345;
    for (int i = 0; i < 6000; i++) {
        x = x * 1103515245u + 12345u;
        fprintf(f, "%s%c", words[(x >> 16) % 16], i % 13 == 12 ? '\n' : ' ');
    }
    fclose(f);

    char blog[4096], keys[4096], db[4096], allow[4096];
    snprintf(blog, sizeof blog, "%s/broker.log", c->dir);
    snprintf(keys, sizeof keys, "%s/broker", c->dir);
    snprintf(db, sizeof db, "%s/store.db", c->dir);
    snprintf(allow, sizeof allow, "%s/allow", c->dir);
    char *bargv[] = {(char *)tu_bin("fusion-broker"), "--bind", "tcp://127.0.0.1:*", "--keys", keys, "--db", db,
                     "--allow", allow, "--backups", n_peers > 3 ? "2" : "1", "--heartbeat-ms", "300", NULL};
    bargv[0] = strdup(tu_bin("fusion-broker"));
    c->broker = spawn(blog, bargv, NULL);
    free(bargv[0]);
    if (!wait_for(blog, "listening on ", 10000)) {
        show(blog);
        fail_msg("the broker did not start (a build without the broker daemon?)");
    }
    char *bl = slurp(blog);
    const char *at = strstr(bl, "listening on ");
    assert_non_null(at);
    sscanf(at + 13, "%127s", c->endpoint);
    free(bl);
    snprintf(c->conn, sizeof c->conn, "--broker %s --broker-key '%s/broker/public.key' --keys '%s/client'",
             c->endpoint, c->dir, c->dir);
    for (int i = 0; i < c->n_peers; i++) {
        char plog[4096], pkeys[4096], cache[4096], name[16], bkey[4096];
        snprintf(plog, sizeof plog, "%s/p%d.log", c->dir, i);
        snprintf(pkeys, sizeof pkeys, "%s/p%d", c->dir, i);
        snprintf(cache, sizeof cache, "%s/cache%d", c->dir, i);
        snprintf(bkey, sizeof bkey, "%s/broker/public.key", c->dir);
        snprintf(name, sizeof name, "p%d", i);
        char *pargv[] = {strdup(tu_bin("fusion-peer")), "--broker", c->endpoint, "--broker-key", bkey, "--keys", pkeys,
                         "--data-bind", "tcp://127.0.0.1:*", "--cache", cache, "--threads", "1", "--name", name,
                         "--drain-timeout", "10", "--max-memory", PEER_MEM_GB, NULL};
        char corrupt[4200];
        snprintf(corrupt, sizeof corrupt, "scale:%s/corrupt.p%d", c->dir, i);
        c->peers[i] = spawn(plog, pargv, corrupt);
        free(pargv[0]);
    }
    for (int i = 0; i < c->n_peers; i++) {
        char needle[64];
        snprintf(needle, sizeof needle, "(p%d) joined", i);
        if (!wait_for(blog, needle, 20000)) {
            show(blog);
            fail_msg("peer p%d did not join", i);
        }
    }
}

static void cluster_stop(cluster *c)
{
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i] > 0) {
            kill(c->peers[i], SIGTERM);
            int code = wait_pid(c->peers[i], 15000);
            if (code != 0) {
                char p[4096];
                snprintf(p, sizeof p, "%s/p%d.log", c->dir, i);
                show(p);
            }
            assert_int_equal(code, 0); /* a graceful leave */
        }
    if (c->broker > 0) {
        kill(c->broker, SIGTERM);
        (void)wait_pid(c->broker, 10000);
    }
    char *out = NULL;
    (void)tu_sh(&out, "rm -rf '%s'", c->dir);
    free(out);
    free(c->dir);
    g_live = NULL;
}

/* After a failed assertion: kill what is left of the cluster (no orphans), keep its logs. */
static int teardown(void **state)
{
    (void)state;
    cluster *c = g_live;
    if (!c)
        return 0;
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i] > 0) {
            kill(c->peers[i], SIGKILL);
            waitpid(c->peers[i], NULL, 0);
        }
    if (c->broker > 0) {
        kill(c->broker, SIGKILL);
        waitpid(c->broker, NULL, 0);
    }
    printf("logs kept in %s\n", c->dir);
    free(c->dir);
    g_live = NULL;
    return 0;
}

/* Submits and waits; returns the job id (static buffer). */
static const char *submit(cluster *c, const char *opts)
{
    static char id[64];
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && '%s' submit finetune %s --model '%s/model' --data data.txt --wait -q %s 2>&1",
                   c->dir, tu_bin("fusion"), c->conn, c->dir, opts);
    if (rc != 0) {
        char p[4096];
        snprintf(p, sizeof p, "%s/broker.log", c->dir);
        show(p);
        fail_msg("fusion submit failed (%d): %s", rc, out);
    }
    id[0] = '\0';
    sscanf(out, "%63s", id);
    free(out);
    assert_int_equal(strlen(id), 16);
    return id;
}

/* Max |a - b| over the PEFT tensors of two safetensors images; fails when the names differ. */
static double adapter_diff(const uint8_t *a, size_t na, const char *ref_path, size_t *n_tensors)
{
    fu_errmsg em = {{0}};
    fu_safetensors *x = NULL, *y = NULL;
    assert_int_equal(fu_safetensors_parse_header(a, na, "result", &x, &em), FU_OK);
    assert_int_equal(fu_safetensors_open_file(ref_path, &y, &em), FU_OK);
    assert_int_equal(fu_safetensors_count(x), fu_safetensors_count(y));
    double worst = 0;
    for (size_t i = 0; i < fu_safetensors_count(y); i++) {
        const fu_st_tensor *ty = fu_safetensors_at(y, i), *tx = fu_safetensors_get(x, ty->name);
        if (!tx)
            fail_msg("the pipeline's adapter lacks %s", ty->name);
        assert_int_equal(tx->nelem, ty->nelem);
        float *u = malloc(tx->nelem * sizeof *u), *v = malloc(ty->nelem * sizeof *v);
        assert_int_equal(fu_st_tensor_to_f32(tx, u, tx->nelem, &em), FU_OK);
        assert_int_equal(fu_st_tensor_to_f32(ty, v, ty->nelem, &em), FU_OK);
        for (size_t k = 0; k < tx->nelem; k++)
            if (fabs((double)u[k] - (double)v[k]) > worst)
                worst = fabs((double)u[k] - (double)v[k]);
        free(u);
        free(v);
    }
    *n_tensors = fu_safetensors_count(y);
    fu_safetensors_close(&x);
    fu_safetensors_close(&y);
    return worst;
}

static void check_result(cluster *c, const char *id, const char *run_opts)
{
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && '%s' run finetune --model model --data data.txt -o ref-%s %s", c->dir,
                   tu_bin("fusion"), id, run_opts);
    if (rc != 0)
        fail_msg("fusion run finetune failed: %s", out);
    free(out);
    char dbp[4096], ref[4096];
    snprintf(dbp, sizeof dbp, "%s/store.db", c->dir);
    snprintf(ref, sizeof ref, "%s/ref-%s/adapter_model.safetensors", c->dir, id);
    db_t *db = NULL;
    assert_int_equal(db_open(dbp, &db), FU_OK);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_DONE);
    assert_non_null(j->result);
    size_t nt = 0;
    double d = adapter_diff(j->result, j->result_len, ref, &nt);
    printf("job %s: %zu adapter tensors, max |pipeline - fusion run| = %.3g\n", id, nt, d);
    assert_true(d <= 1e-5);
    db_job_free(&j);
    db_close(&db);
}

static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static void test_verify_sketch_properties(void **state)
{
    (void)state;
    enum { N = 1000 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    double sq = 0;
    for (int i = 0; i < N; i++) {
        x[i] = (float)sin(0.37 * i) * 3.0f;
        y[i] = 1.5f * x[i];
        sq += (double)x[i] * x[i];
    }
    double a[WIRE_VERIFY_SKETCH_K], b[WIRE_VERIFY_SKETCH_K], c[WIRE_VERIFY_SKETCH_K], d[WIRE_VERIFY_SKETCH_K];
    double na, nb, nc, nd;
    peer_verify_sketch(x, N, 77, a, &na);
    peer_verify_sketch(x, N, 77, b, &nb);
    peer_verify_sketch(y, N, 77, c, &nc);
    peer_verify_sketch(x, N, 78, d, &nd);
    assert_true(fabs(na - sqrt(sq)) <= 1e-9 * na);
    assert_true(fabs(nc - 1.5 * na) <= 1e-6 * nc);
    int differ = 0;
    for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++) {
        assert_true(a[i] == b[i]);                                  /* deterministic */
        assert_true(fabs(c[i] - 1.5 * a[i]) <= 1e-5 * na);         /* linear */
        assert_true(fabs(a[i]) <= na * sqrt((double)N) + 1e-9);     /* |<x, r>| <= |x| |r| */
        differ += fabs(a[i] - d[i]) > 1e-3 * na;                    /* the seed matters */
    }
    assert_true(differ >= WIRE_VERIFY_SKETCH_K / 2);
    /* A small relative change stays far inside the broker's tolerance only when it is tiny. */
    x[3] += 1e-6f;
    peer_verify_sketch(x, N, 77, b, &nb);
    for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++)
        assert_true(fabs(a[i] - b[i]) <= 1e-3 * na);
    free(x);
    free(y);
}

static void test_verify_honest_peers_agree(void **state)
{
    (void)state;
    cluster c;
    cluster_start(&c, "verify-honest", 3);
    const char *common = "--rank 4 --steps 12 --batch 4 --seq-len 16 --lr 0.01 --micro-batches 2";
    char opts[512];
    snprintf(opts, sizeof opts, "%s --checkpoint-every 2 --verify 1.0", common);
    const char *id = submit(&c, opts);
    char jid[32];
    snprintf(jid, sizeof jid, "%s", id);
    char blog[4096], needle[160];
    snprintf(blog, sizeof blog, "%s/broker.log", c.dir);
    char *bl = slurp(blog);
    snprintf(needle, sizeof needle, "job %s stage 0/2 on", jid);
    assert_non_null(strstr(bl, needle)); /* a two-stage pipeline */
    snprintf(needle, sizeof needle, "job %s stage 0 step", jid);
    int agree = 0, disagree = count_of(bl, "DISAGREE"), skipped = count_of(bl, "sample skipped");
    for (const char *p = strstr(bl, needle); p; p = strstr(p + 1, needle)) {
        const char *eol = strchr(p, '\n');
        const char *ag = strstr(p, ": agree (");
        if (ag && (!eol || ag < eol))
            agree++;
    }
    printf("job %s: %d samples of stage 0 agreed, %d disagreed, %d skipped (12 steps x 2 micro-batches, "
           "eligible every 2nd step: 12 possible)\n", jid, agree, disagree, skipped);
    if (agree == 0 || disagree != 0)
        show(blog);
    free(bl);
    assert_int_equal(disagree, 0);
    assert_true(agree >= 6); /* most samples ran (a few may find the backup still warming up) */
    /* The store records them. */
    char dbp[4096];
    snprintf(dbp, sizeof dbp, "%s/store.db", c.dir);
    db_t *db = NULL;
    assert_int_equal(db_open(dbp, &db), FU_OK);
    db_event *ev = NULL;
    size_t n = 0;
    assert_int_equal(db_event_list(db, jid, 0, 0, &ev, &n), FU_OK);
    int recorded = 0;
    for (size_t i = 0; i < n; i++)
        recorded += strcmp(ev[i].kind, "verified") == 0;
    db_event_array_free(&ev, n);
    db_close(&db);
    assert_int_equal(recorded, agree);
    /* Verification changed nothing in the result. */
    check_result(&c, jid, common);
    cluster_stop(&c);
}

/* Reputation of peer p<i> in the store of c. */
static double reputation_of(cluster *c, db_t *db, int i)
{
    char key[128] = "", kp[4200];
    snprintf(kp, sizeof kp, "%s/p%d/public.key", c->dir, i);
    char *kt = slurp(kp);
    for (char *line = strtok(kt, "\n"); line; line = strtok(NULL, "\n"))
        if (line[0] != '#' && strlen(line) == DB_KEY_LEN)
            snprintf(key, sizeof key, "%s", line);
    free(kt);
    assert_int_equal(strlen(key), DB_KEY_LEN);
    db_peer *dp = NULL;
    assert_int_equal(db_peer_get(db, key, &dp), FU_OK);
    double r = dp->reputation;
    db_peer_free(&dp);
    return r;
}

/* n_peers = 3: one backup, no third opinion (the verifier loses a little too); 4: two backups of
 * stage 0, the second settles each disagreement (the honest verifier keeps its reputation). */
static void dishonest(int n_peers)
{
    cluster c;
    cluster_start(&c, n_peers > 3 ? "verify-cheat3" : "verify-cheat", n_peers);
    const char *common = "--rank 4 --steps 60 --batch 4 --seq-len 16 --lr 0.01 --micro-batches 2";
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && '%s' submit finetune %s --model '%s/model' --data data.txt -q %s "
                   "--checkpoint-every 2 --verify 1.0", c.dir, tu_bin("fusion"), c.conn, c.dir, common);
    assert_int_equal(rc, 0);
    char id[32] = "";
    sscanf(out, "%31s", id);
    free(out);
    char blog[4096], needle[160];
    snprintf(blog, sizeof blog, "%s/broker.log", c.dir);
    snprintf(needle, sizeof needle, "job %s stage 0/2 on ", id);
    if (!wait_for(blog, needle, 30000)) {
        show(blog);
        fail_msg("no plan");
    }
    char *bl = slurp(blog);
    const char *pn = strstr(strstr(bl, needle), "(p");
    assert_non_null(pn);
    int cheat = pn[2] - '0';
    free(bl);
    assert_true(cheat >= 0 && cheat < n_peers);
    /* Once the job runs, stage 0's peer starts to cheat (its outputs x 1.5). */
    snprintf(needle, sizeof needle, "job %s: every stage is ready", id);
    assert_true(wait_for(blog, needle, 30000));
    char flag[4200];
    snprintf(flag, sizeof flag, "%s/corrupt.p%d", c.dir, cheat);
    FILE *f = fopen(flag, "w");
    assert_non_null(f);
    fclose(f);
    printf("p%d (stage 0) now scales its outputs by %.1f\n", cheat, (double)PEER_CORRUPT_SCALE);
    rc = tu_sh(&out, "cd '%s' && '%s' wait %s %s", c.dir, tu_bin("fusion"), c.conn, id);
    if (rc != 0) {
        show(blog);
        fail_msg("the job did not finish after the dishonest peer was caught: %s", out);
    }
    free(out);
    bl = slurp(blog);
    snprintf(needle, sizeof needle, "(p%d) is below the reputation threshold", cheat);
    const char *det = strstr(bl, needle);
    if (!det)
        show(blog);
    assert_non_null(det);
    unsigned failed = 0, checked = 0;
    const char *after = strstr(det, "after ");
    assert_non_null(after);
    assert_int_equal(sscanf(after, "after %u disagreeing samples of %u verified", &failed, &checked), 2);
    printf("p%d was caught after %u disagreeing samples (%u of its samples verified in all)\n", cheat, failed,
           checked);
    assert_true(failed >= 1 && failed <= 4);
    snprintf(needle, sizeof needle, "job %s: stage 0 moved from", id);
    assert_non_null(strstr(bl, needle)); /* its stage failed over to the backup */
    /* It got no more work after the detection: its own log shows the one assignment it cheated in. */
    snprintf(needle, sizeof needle, "(p%d) is a warm backup", cheat);
    assert_null(strstr(det, needle));
    char plog[4200];
    snprintf(plog, sizeof plog, "%s/p%d.log", c.dir, cheat);
    char *pl = slurp(plog);
    int assigned = count_of(pl, ": assigned stage ");
    free(pl);
    printf("p%d was assigned %d stage(s) in all\n", cheat, assigned);
    assert_int_equal(assigned, 1);
    int thirds = count_of(bl, "for a third opinion"), sided = count_of(bl, "sides with the verifier");
    free(bl);
    printf("%d peers: %d disagreements went to a third opinion, %d sided with the verifier\n", n_peers, thirds,
           sided);
    if (n_peers > 3)
        assert_true(thirds >= 1 && sided >= 1);
    else
        assert_int_equal(thirds, 0);
    /* Its reputation in the store is below the threshold; the honest peers': see above. */
    char dbp[4096];
    snprintf(dbp, sizeof dbp, "%s/store.db", c.dir);
    db_t *db = NULL;
    assert_int_equal(db_open(dbp, &db), FU_OK);
    double worst_honest = 1;
    for (int i = 0; i < n_peers; i++) {
        double r = reputation_of(&c, db, i);
        printf("p%d: reputation %.2f in the store%s\n", i, r, i == cheat ? " (the dishonest one)" : "");
        if (i == cheat)
            assert_true(r < 0.2);
        else if (r < worst_honest)
            worst_honest = r;
    }
    if (n_peers > 3)
        assert_true(worst_honest >= 0.999); /* the third opinion sided with the honest verifier */
    else
        assert_true(worst_honest >= 0.7 && worst_honest < 1); /* no third opinion: the verifier paid a little */
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_DONE);
    db_job_free(&j);
    db_close(&db);
    cluster_stop(&c);
}

static void test_verify_dishonest_peer_is_caught(void **state)
{
    (void)state;
    dishonest(3);
}

static void test_verify_dishonest_peer_third_opinion(void **state)
{
    (void)state;
    dishonest(4);
}

int main(int argc, char **argv)
{
    if (sodium_init() < 0)
        return 1;
    if (argc > 1)
        cmocka_set_test_filter(argv[1]); /* one ctest entry per test (tests/peer.cmake) */
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_verify_sketch_properties),
        cmocka_unit_test_teardown(test_verify_honest_peers_agree, teardown),
        cmocka_unit_test_teardown(test_verify_dishonest_peer_is_caught, teardown),
        cmocka_unit_test_teardown(test_verify_dishonest_peer_third_opinion, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
