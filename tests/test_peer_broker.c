/* fusion-peer with the real fusion-broker and the real client, as processes on loopback:
 *   - a fine-tune through a two-stage pipeline gives the adapter `fusion run finetune` gives in one
 *     process (same data order, same arithmetic);
 *   - SIGKILL of the last stage's peer mid-job: the broker moves the stage to the warm backup, every
 *     stage rewinds to the newest common checkpoint, and the final adapter is still the same;
 *   - the peers leave on SIGTERM with exit 0.
 * The result is read from the broker's store (fu_broker's db) once the job is done. */
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
#include "testutil.h"

#define N_PEERS 3
/* Each peer offers 60 MiB: the broker's plan for the 8-layer model needs about 71 MiB in one stage and
 * about 52 MiB per stage in two, so every job runs as a two-stage pipeline whatever speeds the peers
 * measured on a loaded machine. */
#define PEER_MEM_GB "0.0586"

typedef struct {
    char *dir;
    pid_t broker;
    pid_t peers[N_PEERS];
    char endpoint[128];
    char conn[1024]; /* --broker ... --broker-key ... --keys ... for the client */
} cluster;

static cluster *g_live; /* the running cluster, for the teardown after a failed assertion */

static pid_t spawn(const char *log, char *const argv[])
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* no orphans when ctest kills a test on its timeout */
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

static void cluster_start(cluster *c, const char *tag)
{
    memset(c, 0, sizeof *c);
    g_live = c;
    c->dir = tu_tmpdir(tag);
    assert_non_null(c->dir);
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && for k in broker p0 p1 p2 client; do '%s' keygen -o $k >/dev/null || exit 1; done && "
                   "grep -hv '^#' p0/public.key p1/public.key p2/public.key client/public.key > allow && "
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
                     "--allow", allow, "--backups", "1", "--heartbeat-ms", "300", NULL};
    bargv[0] = strdup(tu_bin("fusion-broker"));
    c->broker = spawn(blog, bargv);
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
    for (int i = 0; i < N_PEERS; i++) {
        char plog[4096], pkeys[4096], cache[4096], name[16], bkey[4096];
        snprintf(plog, sizeof plog, "%s/p%d.log", c->dir, i);
        snprintf(pkeys, sizeof pkeys, "%s/p%d", c->dir, i);
        snprintf(cache, sizeof cache, "%s/cache%d", c->dir, i);
        snprintf(bkey, sizeof bkey, "%s/broker/public.key", c->dir);
        snprintf(name, sizeof name, "p%d", i);
        char *pargv[] = {strdup(tu_bin("fusion-peer")), "--broker", c->endpoint, "--broker-key", bkey, "--keys", pkeys,
                         "--data-bind", "tcp://127.0.0.1:*", "--cache", cache, "--threads", "1", "--name", name,
                         "--drain-timeout", "10", "--max-memory", PEER_MEM_GB, NULL};
        c->peers[i] = spawn(plog, pargv);
        free(pargv[0]);
    }
    for (int i = 0; i < N_PEERS; i++) {
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
    for (int i = 0; i < N_PEERS; i++)
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
    for (int i = 0; i < N_PEERS; i++)
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

static void test_peer_broker_pipeline_equals_single_process(void **state)
{
    (void)state;
    cluster c;
    cluster_start(&c, "peer-broker");
    const char *common = "--rank 4 --steps 12 --batch 4 --seq-len 16 --lr 0.01";
    char opts[512];
    snprintf(opts, sizeof opts, "%s --micro-batches 1 --checkpoint-every 4", common);
    const char *id = submit(&c, opts);
    char blog[4096], needle[128];
    snprintf(blog, sizeof blog, "%s/broker.log", c.dir);
    snprintf(needle, sizeof needle, "job %s stage 1/2", id);
    char *bl = slurp(blog);
    bool two = strstr(bl, needle) != NULL;
    if (!two)
        printf("the broker's plan:\n%s\n", bl);
    free(bl);
    assert_true(two); /* the job really ran as a two-stage pipeline */
    char jid[32];
    snprintf(jid, sizeof jid, "%s", id);
    check_result(&c, jid, common);
    cluster_stop(&c);
}

/* The last stage's peer goes away mid-job: SIGKILL (dead after the heartbeat timeout) or SIGTERM
 * (Leave: it drains and exits 0). Either way the job ends with the uninterrupted run's adapter. */
static void lose_stage(int sig)
{
    cluster c;
    cluster_start(&c, sig == SIGKILL ? "peer-failover" : "peer-leave");
    const char *common = "--rank 4 --steps 100 --batch 4 --seq-len 16 --lr 0.01";
    /* Submit without waiting, kill the last stage's peer after a checkpoint, then wait. */
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && '%s' submit finetune %s --model '%s/model' --data data.txt -q %s "
                   "--checkpoint-every 20", c.dir, tu_bin("fusion"), c.conn, c.dir, common);
    assert_int_equal(rc, 0);
    char id[32] = "";
    sscanf(out, "%31s", id);
    free(out);
    char blog[4096], needle[160];
    snprintf(blog, sizeof blog, "%s/broker.log", c.dir);
    snprintf(needle, sizeof needle, "job %s: checkpoint of stage 1 at step 40 committed", id);
    if (!wait_for(blog, needle, 60000)) {
        show(blog);
        fail_msg("no checkpoint at step 40");
    }
    snprintf(needle, sizeof needle, "job %s stage 1/2 on ", id);
    char *bl = slurp(blog);
    const char *at = strstr(bl, needle);
    assert_non_null(at);
    const char *pn = strstr(at, "(p");
    assert_non_null(pn);
    int victim = pn[2] - '0';
    free(bl);
    assert_true(victim >= 0 && victim < N_PEERS);
    printf("%s p%d (stage 1)\n", sig == SIGKILL ? "SIGKILL to" : "SIGTERM to", victim);
    kill(c.peers[victim], sig);
    int vcode = wait_pid(c.peers[victim], 15000);
    c.peers[victim] = 0;
    if (sig == SIGTERM)
        assert_int_equal(vcode, 0); /* Leave, StageRelease, exit 0 */
    rc = tu_sh(&out, "cd '%s' && '%s' wait %s %s", c.dir, tu_bin("fusion"), c.conn, id);
    if (rc != 0) {
        show(blog);
        fail_msg("the job did not finish after the failover: %s", out);
    }
    free(out);
    snprintf(needle, sizeof needle, "job %s: stage 1 moved from", id);
    bl = slurp(blog);
    assert_non_null(strstr(bl, needle));
    free(bl);
    check_result(&c, id, common);
    cluster_stop(&c);
}

static void test_peer_broker_failover_keeps_the_adapter(void **state)
{
    (void)state;
    lose_stage(SIGKILL);
}

static void test_peer_broker_leave_keeps_the_adapter(void **state)
{
    (void)state;
    lose_stage(SIGTERM);
}

/* The broker is SIGKILLed mid-job and started again on the same endpoint and store: the peers
 * notice its silence, say PeerHello again, the broker resumes the job from the newest common
 * checkpoint, and the adapter is still the uninterrupted run's. */
static void test_peer_broker_restart_keeps_the_adapter(void **state)
{
    (void)state;
    cluster c;
    cluster_start(&c, "peer-brestart");
    const char *common = "--rank 4 --steps 100 --batch 4 --seq-len 16 --lr 0.01";
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && '%s' submit finetune %s --model '%s/model' --data data.txt -q %s "
                   "--checkpoint-every 20", c.dir, tu_bin("fusion"), c.conn, c.dir, common);
    assert_int_equal(rc, 0);
    char id[32] = "";
    sscanf(out, "%31s", id);
    free(out);
    char blog[4096], needle[160];
    snprintf(blog, sizeof blog, "%s/broker.log", c.dir);
    snprintf(needle, sizeof needle, "job %s: checkpoint of stage 1 at step 40 committed", id);
    if (!wait_for(blog, needle, 60000)) {
        show(blog);
        fail_msg("no checkpoint at step 40");
    }
    printf("SIGKILL to the broker, then a restart on %s\n", c.endpoint);
    kill(c.broker, SIGKILL);
    waitpid(c.broker, NULL, 0);
    char keys[4096], db[4096], allow[4096], blog2[4096];
    snprintf(keys, sizeof keys, "%s/broker", c.dir);
    snprintf(db, sizeof db, "%s/store.db", c.dir);
    snprintf(allow, sizeof allow, "%s/allow", c.dir);
    snprintf(blog2, sizeof blog2, "%s/broker2.log", c.dir);
    char *bargv[] = {strdup(tu_bin("fusion-broker")), "--bind", c.endpoint, "--keys", keys, "--db", db,
                     "--allow", allow, "--backups", "1", "--heartbeat-ms", "300", NULL};
    c.broker = spawn(blog2, bargv);
    free(bargv[0]);
    rc = tu_sh(&out, "cd '%s' && '%s' wait %s %s", c.dir, tu_bin("fusion"), c.conn, id);
    if (rc != 0) {
        show(blog2);
        fail_msg("the job did not finish after the broker's restart: %s", out);
    }
    free(out);
    int rejoined = 0;
    char *bl = slurp(blog2);
    for (const char *q = bl; (q = strstr(q, "registered: ")) != NULL; q++) /* "re-registered: " */
        rejoined++;
    for (const char *q = bl; (q = strstr(q, ") joined: ")) != NULL; q++)
        rejoined++;
    free(bl);
    printf("%d peers registered again with the restarted broker\n", rejoined);
    assert_true(rejoined >= 2);
    check_result(&c, id, common);
    cluster_stop(&c);
}

/* The generated bytes of an inference job (the job's result), read from the store. */
static char *infer_result(cluster *c, const char *id, size_t *len)
{
    char dbp[4096];
    snprintf(dbp, sizeof dbp, "%s/store.db", c->dir);
    db_t *db = NULL;
    assert_int_equal(db_open(dbp, &db), FU_OK);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_DONE);
    char *r = malloc(j->result_len + 1);
    memcpy(r, j->result, j->result_len);
    r[j->result_len] = '\0';
    *len = j->result_len;
    db_job_free(&j);
    db_close(&db);
    return r;
}

static char *run_infer(cluster *c, const char *opts, size_t *len)
{
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && '%s' run infer --model model %s 2>/dev/null", c->dir, tu_bin("fusion"), opts);
    if (rc != 0)
        fail_msg("fusion run infer failed: %s", out);
    *len = strlen(out);
    if (*len && out[*len - 1] == '\n')
        out[--(*len)] = '\0';
    return out;
}

/* Generation through the pipeline gives the tokens `fusion run infer` gives (greedy and seeded
 * sampling); killing the last stage mid-generation: the backup rebuilds its KV cache by replaying
 * the prompt and the tokens so far, and the text is unchanged (greedy). */
static void test_peer_broker_inference_equals_single_process(void **state)
{
    (void)state;
    cluster c;
    cluster_start(&c, "peer-infer");
    const char *runs[] = {"--prompt 'the quick brown fox' --max-tokens 24",
                          "--prompt 'over the lazy dog' --max-tokens 24 --temperature 0.9 --top-k 40 --seed 5"};
    for (size_t k = 0; k < 2; k++) {
        char *out = NULL;
        int rc = tu_sh(&out, "cd '%s' && '%s' submit infer %s --model '%s/model' %s -q 2>/dev/null", c.dir,
                       tu_bin("fusion"), c.conn, c.dir, runs[k]);
        char id[32] = "";
        assert_int_equal(rc, 0);
        assert_int_equal(sscanf(out, "%31s", id), 1);
        assert_int_equal(strlen(id), 16);
        free(out);
        rc = tu_sh(&out, "cd '%s' && '%s' wait %s %s", c.dir, tu_bin("fusion"), c.conn, id);
        if (rc != 0)
            fail_msg("fusion wait %s: %s", id, out);
        free(out);
        size_t n1, n2;
        char *got = infer_result(&c, id, &n1), *want = run_infer(&c, runs[k], &n2);
        printf("infer %s: pipeline %zu bytes, fusion run %zu bytes, %s\n", id, n1, n2,
               n1 == n2 && memcmp(got, want, n1) == 0 ? "identical" : "DIFFERENT");
        assert_int_equal(n1, n2);
        assert_memory_equal(got, want, n1);
        free(got);
        free(want);
    }

    /* Failover mid-generation (greedy): kill the last stage's peer once 100 tokens are out. */
    const char *lng = "--prompt 'the river and the stone' --max-tokens 600";
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && '%s' submit infer %s --model '%s/model' %s -q 2>/dev/null", c.dir,
                   tu_bin("fusion"), c.conn, c.dir, lng);
    char id[32] = "";
    assert_int_equal(rc, 0);
    assert_int_equal(sscanf(out, "%31s", id), 1);
    free(out);
    uint64_t end = fu_clock_ms() + 60000;
    long done = 0;
    while (done < 100 && fu_clock_ms() < end) {
        rc = tu_sh(&out, "'%s' status %s %s", tu_bin("fusion"), c.conn, id);
        const char *at = out ? strstr(out, id) : NULL;
        const char *sl = at ? strchr(at, '/') : NULL;
        if (sl) {
            const char *q = sl;
            while (q > at && q[-1] >= '0' && q[-1] <= '9')
                q--;
            done = strtol(q, NULL, 10);
        }
        if (out && strstr(out, "done"))
            fail_msg("the generation ended before the kill: %s", out);
        free(out);
        fu_sleep_ms(10);
    }
    assert_true(done >= 100);
    char blog[4096], needle[160];
    snprintf(blog, sizeof blog, "%s/broker.log", c.dir);
    snprintf(needle, sizeof needle, "job %s stage 1/2 on ", id);
    char *bl = slurp(blog);
    const char *at = strstr(bl, needle);
    assert_non_null(at);
    int victim = strstr(at, "(p")[2] - '0';
    free(bl);
    printf("killing p%d (stage 1 of the generation) at token %ld\n", victim, done);
    kill(c.peers[victim], SIGKILL);
    waitpid(c.peers[victim], NULL, 0);
    c.peers[victim] = 0;
    rc = tu_sh(&out, "cd '%s' && '%s' wait %s %s", c.dir, tu_bin("fusion"), c.conn, id);
    if (rc != 0) {
        show(blog);
        fail_msg("fusion wait %s: %s", id, out);
    }
    free(out);
    snprintf(needle, sizeof needle, "job %s: stage 1 moved from", id);
    bl = slurp(blog);
    bool moved = strstr(bl, needle) != NULL;
    free(bl);
    if (!moved)
        show(blog);
    assert_true(moved);
    size_t n1, n2;
    char *got = infer_result(&c, id, &n1), *want = run_infer(&c, lng, &n2);
    printf("infer %s after failover: pipeline %zu bytes, fusion run %zu bytes, %s\n", id, n1, n2,
           n1 == n2 && memcmp(got, want, n1) == 0 ? "identical" : "DIFFERENT");
    assert_int_equal(n1, n2);
    assert_memory_equal(got, want, n1);
    free(got);
    free(want);
    cluster_stop(&c);
}

/* --enrol-token: a key not on the allow-list enrols with the broker's token, reconnects as a member
 * and joins; a wrong token is refused and the peer exits 3 with a sentence. */
static void test_peer_broker_enrolment(void **state)
{
    (void)state;
    char *dir = tu_tmpdir("peer-enrol");
    assert_non_null(dir);
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && for k in broker p0 p1 tok; do '%s' keygen -o $k >/dev/null || exit 1; done && "
                   ": > allow", dir, tu_bin("fusion"));
    assert_int_equal(rc, 0);
    free(out);
    char tokfile[4096], token[64] = "";
    snprintf(tokfile, sizeof tokfile, "%s/tok/public.key", dir);
    char *tk = slurp(tokfile); /* any 40-char Z85 string is a token; a public key file has one */
    for (char *line = strtok(tk, "\n"); line; line = strtok(NULL, "\n"))
        if (line[0] != '#' && strlen(line) == 40)
            snprintf(token, sizeof token, "%s", line);
    free(tk);
    assert_int_equal(strlen(token), 40);
    char blog[4096], keys[4096], db[4096], allow[4096], bkey[4096];
    snprintf(blog, sizeof blog, "%s/broker.log", dir);
    snprintf(keys, sizeof keys, "%s/broker", dir);
    snprintf(db, sizeof db, "%s/store.db", dir);
    snprintf(allow, sizeof allow, "%s/allow", dir);
    snprintf(bkey, sizeof bkey, "%s/broker/public.key", dir);
    char *bargv[] = {strdup(tu_bin("fusion-broker")), "--bind", "tcp://127.0.0.1:*", "--keys", keys, "--db", db,
                     "--allow", allow, "--enrol-token", token, "--heartbeat-ms", "300", NULL};
    pid_t broker = spawn(blog, bargv);
    free(bargv[0]);
    assert_true(wait_for(blog, "listening on ", 10000));
    char ep[128] = "";
    char *bl = slurp(blog);
    sscanf(strstr(bl, "listening on ") + 13, "%127s", ep);
    free(bl);
    pid_t peers[2];
    for (int i = 0; i < 2; i++) {
        char plog[4096], pkeys[4096], cache[4096], name[16];
        snprintf(plog, sizeof plog, "%s/p%d.log", dir, i);
        snprintf(pkeys, sizeof pkeys, "%s/p%d", dir, i);
        snprintf(cache, sizeof cache, "%s/cache%d", dir, i);
        snprintf(name, sizeof name, "e%d", i);
        char *pargv[] = {strdup(tu_bin("fusion-peer")), "--broker", ep, "--broker-key", bkey, "--keys", pkeys,
                         "--data-bind", "tcp://127.0.0.1:*", "--cache", cache, "--threads", "1", "--name", name,
                         "--enrol-token", i == 0 ? token : "0000000000000000000000000000000000000000", NULL};
        peers[i] = spawn(plog, pargv);
        free(pargv[0]);
    }
    bool joined = wait_for(blog, "(e0) joined", 20000);
    int bad = wait_pid(peers[1], 20000);
    char plog1[4096];
    snprintf(plog1, sizeof plog1, "%s/p1.log", dir);
    char *l1 = slurp(plog1);
    printf("wrong token: exit %d: %s", bad, l1);
    bool said = strstr(l1, "enrolment") != NULL;
    free(l1);
    if (!joined)
        show(blog);
    assert_true(joined);
    assert_int_equal(bad, 3);
    assert_true(said);
    kill(peers[0], SIGTERM);
    assert_int_equal(wait_pid(peers[0], 15000), 0);
    kill(broker, SIGTERM);
    (void)wait_pid(broker, 10000);
    rc = tu_sh(&out, "rm -rf '%s'", dir);
    free(out);
    free(dir);
}

int main(int argc, char **argv)
{
    if (sodium_init() < 0)
        return 1;
    if (argc > 1)
        cmocka_set_test_filter(argv[1]); /* one ctest entry per test (tests/peer.cmake) */
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_peer_broker_pipeline_equals_single_process, teardown),
        cmocka_unit_test_teardown(test_peer_broker_failover_keeps_the_adapter, teardown),
        cmocka_unit_test_teardown(test_peer_broker_leave_keeps_the_adapter, teardown),
        cmocka_unit_test_teardown(test_peer_broker_restart_keeps_the_adapter, teardown),
        cmocka_unit_test_teardown(test_peer_broker_inference_equals_single_process, teardown),
        cmocka_unit_test(test_peer_broker_enrolment),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
