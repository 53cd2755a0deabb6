/* End-to-end test helpers: a whole fusion cluster of real processes on loopback.
 *
 * e2e_cluster_start makes keys with `fusion keygen` (broker, client, one per peer), an allow-list,
 * a tiny model with `fusion model init`, a client configuration file (FUSION_CONFIG: broker,
 * broker-key, keys, the format of deploy/fusion.conf.example), then starts `fusion-broker` on a free
 * port of 127.0.0.1 and N `fusion-peer`s whose data sockets also take free ports. The model, the
 * training text, the peers' memory, the broker's backups and heartbeat, and the test-only fault hook
 * of the peers are the cluster's settings (e2e_cluster fields). Every child gets
 * prctl(PR_SET_PDEATHSIG, SIGKILL) right after fork, so nothing outlives a crashed test; every child
 * is reaped by e2e_cluster_stop (graceful: SIGTERM, exit codes checked) or e2e_teardown (after a
 * failed assertion: SIGCONT, SIGKILL, logs kept and their tails printed).
 *
 * Header-only, like testutil.h, so each e2e executable stays one file. Links fu_common only (the
 * adapters are compared with common/fu_safetensors.h; the client's JSON is read with cJSON). */
#ifndef FU_E2E_UTIL_H
#define FU_E2E_UTIL_H

#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "fu_clock.h"
#include "fu_file.h"
#include "fu_safetensors.h"
#include "testutil.h"

#define E2E_MAX_PEERS 6
#define E2E_PATH      4096

/* The model every e2e cluster uses unless told otherwise: 6 decoder layers, hidden 256 (3.7 M
 * parameters). With E2E_PEER_MEMORY_GB per peer the partitioner's memory estimate (32 MiB fixed per
 * stage + weights + activations) fits two layers per peer and not three, so three peers always run a
 * three-stage pipeline, whatever their measured speeds. */
#define E2E_MODEL_ARGS      "--layers 6 --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 256 --seed 3"
#define E2E_PEER_MEMORY_GB  "0.039"
#define E2E_LINK_MBPS       "1000" /* the broker's own default: the plans the tests were written for */
/* The fine-tune options shared by `fusion submit finetune` and `fusion run finetune`. */
#define E2E_TRAIN_ARGS      "--rank 4 --alpha 8 --batch 4 --seq-len 16 --lr 0.01 --seed 7"

typedef struct {
    char dir[1024];               /* scratch directory: keys, model, store, logs */
    char data[E2E_PATH];         /* training text (deploy/data/shakespeare.txt) */
    char conf[E2E_PATH];         /* client configuration file */
    char endpoint[128];          /* the broker's control endpoint (tcp://127.0.0.1:PORT) */
    pid_t broker;                /* 0 when not running */
    int broker_starts;           /* broker logs are broker.log, broker-2.log, ... */
    int n_peers;                 /* peers made (keys p0..pN-1) */
    pid_t peers[E2E_MAX_PEERS];  /* 0 when not running */
    bool stopped[E2E_MAX_PEERS]; /* SIGSTOPped (needs SIGCONT before it can die) */
    int backups;                 /* --backups of the broker */
    int heartbeat_ms;            /* --heartbeat-ms of the broker (0: its default) */
    const char *peer_memory_gb;  /* --max-memory of every peer (NULL: none) */
    const char *link_mbps;       /* --link-mbps of every peer (E2E_LINK_MBPS: plans that do not depend
                                    on how fast a loaded machine times its probe; NULL: measure) */
    const char *model_args;      /* `fusion model init` options (NULL: E2E_MODEL_ARGS) */
    bool word_data;              /* train on E2E_WORDS words of a seeded stream (DIR/data.txt), not Shakespeare */
    const char *corrupt_mode;    /* "scale" or "lie": peer pI runs with FUSION_TEST_CORRUPT_OUTPUT=
                                    MODE:DIR/corrupt.pI and cheats while that file exists
                                    (peer/peer_verify.h; tests only); NULL: honest peers */
    const char *stall;           /* "ready" or "step:N": peer pI runs with FUSION_TEST_STALL=STALL:DIR/stall.pI
                                    and stalls while that file exists (peer/peer_verify.h; tests only);
                                    NULL: none (takes the place of corrupt_mode) */
    int ready_timeout_s;         /* --ready-timeout of the broker (0: its default) */
    int step_timeout_s;          /* --step-timeout of the broker (0: its default) */
    int pause_grace_s;           /* --pause-grace of the broker (0: its default) */
    const char *priority;        /* --priority of every peer (NULL: "normal": a test cluster is not a
                                    guest, and other tests share the machine) */
    const char *peer_extra[8];   /* more fusion-peer arguments (NULL-terminated) */
} e2e_cluster;

#define E2E_WORDS 6000 /* words of the seeded training stream (word_data) */

/* The two-stage cluster of the peer tests (test_peer_broker.c, test_verify.c): an 8-layer model;
 * each peer offers 60 MiB, and the broker's plan needs about 71 MiB in one stage and about 52 MiB per
 * stage in two, so every job runs as a two-stage pipeline whatever speeds the peers measured on a
 * loaded machine; heartbeat 300 ms; the seeded word stream as training text. */
#define E2E_TWO_STAGE_MODEL_ARGS "--layers 8 --hidden 256 --ffn 1024 --seed 2"
#define E2E_TWO_STAGE_MEMORY_GB  "0.0586"

static e2e_cluster *e2e_live; /* the running cluster (NULL once stopped) */
/* What the teardown after a failed assertion needs, kept in static memory: a cluster usually lives on
 * the test function's stack, which is gone (and may be overwritten) by the time cmocka runs the
 * teardown. A pid read from there could be 0 (kill(0) signals the whole process group: ctest
 * included) or someone else's. */
#define E2E_MAX_CHILDREN 64
static pid_t e2e_kids[E2E_MAX_CHILDREN]; /* children spawned and not reaped yet (0: free slot) */
static char e2e_live_dir[1024];          /* the running cluster's directory, "" when none */

static inline void e2e_kid_add(pid_t pid)
{
    for (int i = 0; i < E2E_MAX_CHILDREN; i++)
        if (e2e_kids[i] == 0) {
            e2e_kids[i] = pid;
            return;
        }
}

static inline void e2e_kid_gone(pid_t pid)
{
    for (int i = 0; i < E2E_MAX_CHILDREN; i++)
        if (e2e_kids[i] == pid)
            e2e_kids[i] = 0;
}

/* ---- processes ------------------------------------------------------------------------------- */

/* fork + exec argv[0] with stdout and stderr appended to log, and the environment variable
 * env_name=env_value when env_name is not NULL; the child dies with the test. */
static inline pid_t e2e_spawn_env(const char *log, char *const argv[], const char *env_name, const char *env_value)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) /* the test died before prctl took effect */
            _exit(127);
        if (env_name)
            setenv(env_name, env_value, 1);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    e2e_kid_add(pid);
    return pid;
}

static inline pid_t e2e_spawn(const char *log, char *const argv[])
{
    return e2e_spawn_env(log, argv, NULL, NULL);
}

/* Waits for pid to exit within timeout_ms: its exit code (128+signal when killed); on timeout it is
 * killed, reaped, and -1 returned. */
static inline int e2e_reap(pid_t pid, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            e2e_kid_gone(pid);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        if (r < 0) {
            e2e_kid_gone(pid);
            return -2; /* not our child (already reaped) */
        }
        if (fu_clock_ms() >= end)
            break;
        fu_sleep_ms(10);
    }
    kill(pid, SIGCONT);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    e2e_kid_gone(pid);
    return -1;
}

/* ---- files and logs -------------------------------------------------------------------------- */

static inline char *e2e_slurp(const char *path)
{
    char *d = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    if (fu_file_read_all(path, (size_t)64 << 20, &d, &n, &em) != FU_OK)
        return strdup("");
    return d;
}

static inline void e2e_path(const e2e_cluster *c, char *out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline void e2e_path(const e2e_cluster *c, char *out, const char *fmt, ...)
{
    char rel[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rel, sizeof rel, fmt, ap);
    va_end(ap);
    snprintf(out, E2E_PATH, "%s/%s", c->dir, rel);
}

/* The current broker's log. */
static inline void e2e_broker_log(const e2e_cluster *c, char *out)
{
    if (c->broker_starts <= 1)
        e2e_path(c, out, "broker.log");
    else
        e2e_path(c, out, "broker-%d.log", c->broker_starts);
}

/* Polls until the file holds needle (true) or timeout_ms passes (false). */
static inline bool e2e_wait_file(const char *path, const char *needle, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        char *d = e2e_slurp(path);
        bool ok = strstr(d, needle) != NULL;
        free(d);
        if (ok)
            return true;
        if (fu_clock_ms() >= end)
            return false;
        fu_sleep_ms(20);
    }
}

static inline void e2e_show(const char *path, int lines)
{
    char *out = NULL;
    (void)tu_sh(&out, "tail -n %d '%s'", lines, path);
    printf("---- %s ----\n%s\n", path, out ? out : "");
    fflush(stdout);
    free(out);
}

static inline void e2e_show_all(const e2e_cluster *c)
{
    char p[E2E_PATH];
    e2e_broker_log(c, p);
    e2e_show(p, 40);
    for (int i = 0; i < c->n_peers; i++) {
        e2e_path(c, p, "p%d.log", i);
        e2e_show(p, 15);
    }
}

/* ---- the client ------------------------------------------------------------------------------ */

/* Runs `fusion ARGS` in the cluster directory with the cluster's client configuration; stdout and
 * stderr together in *out (may be NULL); returns the exit code. */
static inline int e2e_fusion(const e2e_cluster *c, char **out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline int e2e_fusion(const e2e_cluster *c, char **out, const char *fmt, ...)
{
    char args[6000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    return tu_sh(out, "cd '%s' && FUSION_CONFIG='%s' '%s' %s", c->dir, c->conf, tu_bin("fusion"), args);
}

/* `fusion submit KIND ARGS -q`: the job id (16 hex digits) in id[17]; fails the test otherwise. */
static inline void e2e_submit(const e2e_cluster *c, char id[17], const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline void e2e_submit(const e2e_cluster *c, char id[17], const char *fmt, ...)
{
    char args[6000];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "submit %s -q 2>>client.err", args);
    id[0] = '\0';
    if (rc != 0 || sscanf(out ? out : "", "%16s", id) != 1 || strlen(id) != 16) {
        char p[E2E_PATH];
        e2e_path(c, p, "client.err");
        e2e_show(p, 10);
        fail_msg("fusion submit %s: exit %d: %s", args, rc, out ? out : "");
    }
    free(out);
}

/* `fusion wait ID` within the test's own deadline; fails the test (with the logs) if the job does not
 * end done. */
static inline void e2e_wait_done(const e2e_cluster *c, const char *id, int timeout_s)
{
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "wait %s --wait-timeout %d", id, timeout_s);
    if (rc != 0) {
        e2e_show_all(c);
        fail_msg("fusion wait %s: exit %d: %s", id, rc, out ? out : "");
    }
    free(out);
}

/* What `fusion status ID --json` says: state, steps done, and the name of each stage's peer. */
typedef struct {
    char state[16];
    long step;
    int n_stages;
    char stage_peer[8][32];
    char message[512]; /* the broker's reason (why queued, what recovery does) */
} e2e_status;

static inline bool e2e_get_status(const e2e_cluster *c, const char *id, e2e_status *st)
{
    memset(st, 0, sizeof *st);
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "status %s --json 2>/dev/null", id);
    cJSON *j = rc == 0 && out ? cJSON_Parse(out) : NULL;
    free(out);
    if (!j)
        return false;
    const cJSON *s = cJSON_GetObjectItem(j, "state"), *n = cJSON_GetObjectItem(j, "step"),
                *sp = cJSON_GetObjectItem(j, "stage_peers");
    if (cJSON_IsString(s))
        snprintf(st->state, sizeof st->state, "%s", s->valuestring);
    if (cJSON_IsNumber(n))
        st->step = (long)n->valuedouble;
    const cJSON *msg = cJSON_GetObjectItem(j, "message");
    if (cJSON_IsString(msg))
        snprintf(st->message, sizeof st->message, "%s", msg->valuestring);
    const cJSON *e;
    cJSON_ArrayForEach(e, sp)
    {
        const cJSON *idx = cJSON_GetObjectItem(e, "index"), *nm = cJSON_GetObjectItem(e, "name");
        if (cJSON_IsNumber(idx) && cJSON_IsString(nm) && idx->valuedouble >= 0 && idx->valuedouble < 8) {
            int k = (int)idx->valuedouble;
            snprintf(st->stage_peer[k], sizeof st->stage_peer[k], "%s", nm->valuestring);
            if (k + 1 > st->n_stages)
                st->n_stages = k + 1;
        }
    }
    cJSON_Delete(j);
    return true;
}

/* Polls the job until it has done at least `step` steps while running; fails the test when it ends
 * first or the deadline passes. Returns the step seen. */
static inline long e2e_wait_step(const e2e_cluster *c, const char *id, long step, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    e2e_status st;
    for (;;) {
        if (e2e_get_status(c, id, &st)) {
            if (strcmp(st.state, "running") == 0 && st.step >= step)
                return st.step;
            if (strcmp(st.state, "done") == 0 || strcmp(st.state, "failed") == 0 || strcmp(st.state, "cancelled") == 0)
                fail_msg("job %s ended (%s at step %ld) before step %ld: make it longer", id, st.state, st.step, step);
        }
        if (fu_clock_ms() >= end) {
            e2e_show_all(c);
            fail_msg("job %s did not reach step %ld in %d ms (at %ld, %s)", id, step, timeout_ms, st.step, st.state);
        }
        fu_sleep_ms(20);
    }
}

/* Index of the peer that the current broker's log says runs stage `stage` of job id ("job ID stage
 * K/N on KEY (pI)"), waiting up to timeout_ms for the plan; fails the test when there is none. */
static inline int e2e_planned_peer(const e2e_cluster *c, const char *id, int stage, int timeout_ms)
{
    char log[E2E_PATH], needle[96];
    e2e_broker_log(c, log);
    snprintf(needle, sizeof needle, "job %s stage %d/", id, stage);
    if (!e2e_wait_file(log, needle, timeout_ms)) {
        e2e_show(log, 40);
        fail_msg("job %s: no stage %d in the broker's plan", id, stage);
    }
    char *bl = e2e_slurp(log);
    const char *at = strstr(bl, needle);
    const char *eol = at ? strchr(at, '\n') : NULL;
    const char *pn = at ? strstr(at, " (p") : NULL;
    int i = pn && (!eol || pn < eol) && pn[3] >= '0' && pn[3] <= '9' ? pn[3] - '0' : -1;
    free(bl);
    if (i < 0 || i >= c->n_peers)
        fail_msg("job %s: cannot read stage %d's peer from the broker's log", id, stage);
    return i;
}

/* Index of the peer named "pK" in the cluster (-1 if none). */
static inline int e2e_peer_index(const char *name)
{
    if (!name || name[0] != 'p' || name[1] < '0' || name[1] > '9' || name[2])
        return -1;
    return name[1] - '0';
}

/* ---- adapters -------------------------------------------------------------------------------- */

/* Max |a - b| over every tensor of two adapter_model.safetensors files; fails the test when their
 * tensor names or sizes differ. */
static inline double e2e_adapter_diff(const char *path_a, const char *path_b, size_t *n_tensors)
{
    fu_errmsg em = {{0}};
    fu_safetensors *x = NULL, *y = NULL;
    if (fu_safetensors_open_file(path_a, &x, &em) != FU_OK)
        fail_msg("%s: %s", path_a, fu_errmsg_text(&em, FU_EIO));
    if (fu_safetensors_open_file(path_b, &y, &em) != FU_OK)
        fail_msg("%s: %s", path_b, fu_errmsg_text(&em, FU_EIO));
    assert_int_equal(fu_safetensors_count(x), fu_safetensors_count(y));
    assert_true(fu_safetensors_count(y) > 0);
    double worst = 0;
    for (size_t i = 0; i < fu_safetensors_count(y); i++) {
        const fu_st_tensor *ty = fu_safetensors_at(y, i), *tx = fu_safetensors_get(x, ty->name);
        if (!tx)
            fail_msg("%s lacks %s", path_a, ty->name);
        assert_int_equal(tx->nelem, ty->nelem);
        float *u = malloc(tx->nelem * sizeof *u), *v = malloc(ty->nelem * sizeof *v);
        assert_non_null(u);
        assert_non_null(v);
        assert_int_equal(fu_st_tensor_to_f32(tx, u, tx->nelem, &em), FU_OK);
        assert_int_equal(fu_st_tensor_to_f32(ty, v, ty->nelem, &em), FU_OK);
        for (size_t k = 0; k < tx->nelem; k++) {
            double d = fabs((double)u[k] - (double)v[k]);
            if (d > worst || isnan(d))
                worst = isnan(d) ? INFINITY : d;
        }
        free(u);
        free(v);
    }
    *n_tensors = fu_safetensors_count(y);
    fu_safetensors_close(&x);
    fu_safetensors_close(&y);
    return worst;
}

/* `fusion run finetune` on model_dir with train_args into DIR/out_name (the reference adapter). */
static inline void e2e_reference(const e2e_cluster *c, const char *model_dir, const char *train_args, const char *out_name)
{
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "run finetune --model '%s' --data '%s' --threads 1 %s -o '%s'", model_dir, c->data,
                        train_args, out_name);
    if (rc != 0)
        fail_msg("fusion run finetune: exit %d: %s", rc, out ? out : "");
    free(out);
}

/* Downloads job id's adapter with `fusion result`, makes the reference with `fusion run finetune`
 * (same model and options) and returns the max abs difference over every tensor. */
static inline double e2e_job_vs_reference(const e2e_cluster *c, const char *id, const char *model_dir, const char *train_args)
{
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "result %s -o 'res-%s'", id, id);
    if (rc != 0)
        fail_msg("fusion result %s: exit %d: %s", id, rc, out ? out : "");
    free(out);
    char ref[64];
    snprintf(ref, sizeof ref, "ref-%s", id);
    e2e_reference(c, model_dir, train_args, ref);
    char a[E2E_PATH], b[E2E_PATH];
    e2e_path(c, a, "res-%s/adapter_model.safetensors", id);
    e2e_path(c, b, "ref-%s/adapter_model.safetensors", id);
    size_t nt = 0;
    double d = e2e_adapter_diff(a, b, &nt);
    printf("job %s: %zu adapter tensors, max |pipeline - fusion run| = %.3g\n", id, nt, d);
    fflush(stdout);
    return d;
}

/* ---- the cluster ----------------------------------------------------------------------------- */

/* Starts (or restarts, on the same port and SQLite file) the broker and waits until it listens. */
static inline void e2e_broker_start(e2e_cluster *c)
{
    char log[E2E_PATH], keys[E2E_PATH], db[E2E_PATH], allow[E2E_PATH], backups[16], hb[16];
    c->broker_starts++;
    e2e_broker_log(c, log);
    e2e_path(c, keys, "broker");
    e2e_path(c, db, "store.db");
    e2e_path(c, allow, "allow");
    snprintf(backups, sizeof backups, "%d", c->backups);
    snprintf(hb, sizeof hb, "%d", c->heartbeat_ms > 0 ? c->heartbeat_ms : 1000);
    char bind[128];
    snprintf(bind, sizeof bind, "%s", c->endpoint[0] ? c->endpoint : "tcp://127.0.0.1:*");
    char rt[16], stt[16], pg[16];
    snprintf(rt, sizeof rt, "%d", c->ready_timeout_s);
    snprintf(stt, sizeof stt, "%d", c->step_timeout_s);
    snprintf(pg, sizeof pg, "%d", c->pause_grace_s);
    char *argv[20] = {strdup(tu_bin("fusion-broker")), "--bind", bind, "--keys", keys, "--db", db, "--allow", allow,
                      "--backups", backups, "--heartbeat-ms", hb, NULL};
    int n = 13;
    if (c->ready_timeout_s > 0) {
        argv[n++] = "--ready-timeout";
        argv[n++] = rt;
    }
    if (c->step_timeout_s > 0) {
        argv[n++] = "--step-timeout";
        argv[n++] = stt;
    }
    if (c->pause_grace_s > 0) {
        argv[n++] = "--pause-grace";
        argv[n++] = pg;
    }
    argv[n] = NULL;
    c->broker = e2e_spawn(log, argv);
    free(argv[0]);
    if (!e2e_wait_file(log, "listening on ", 15000)) {
        e2e_show(log, 30);
        fail_msg("the broker did not start");
    }
    if (!c->endpoint[0]) {
        char *bl = e2e_slurp(log);
        const char *at = strstr(bl, "listening on ");
        assert_non_null(at);
        assert_int_equal(sscanf(at + 13, "%127s", c->endpoint), 1);
        free(bl);
    }
}

/* Starts peer i (keys pI, name pI) with extra arguments (NULL-terminated list, may be empty). */
static inline void e2e_peer_start(e2e_cluster *c, int i)
{
    char log[E2E_PATH], keys[E2E_PATH], cache[E2E_PATH], bkey[E2E_PATH], name[16];
    e2e_path(c, log, "p%d.log", i);
    e2e_path(c, keys, "p%d", i);
    e2e_path(c, cache, "cache%d", i);
    e2e_path(c, bkey, "broker/public.key");
    snprintf(name, sizeof name, "p%d", i);
    char *argv[32] = {strdup(tu_bin("fusion-peer")), "--broker", c->endpoint, "--broker-key", bkey, "--keys", keys,
                      "--data-bind", "tcp://127.0.0.1:*", "--cache", cache, "--threads", "1", "--name", name,
                      "--drain-timeout", "15", "--priority", (char *)(c->priority ? c->priority : "normal")};
    int n = 19;
    for (int k = 0; k < 8 && c->peer_extra[k]; k++)
        argv[n++] = (char *)c->peer_extra[k];
    if (c->peer_memory_gb) {
        argv[n++] = "--max-memory";
        argv[n++] = (char *)c->peer_memory_gb;
    }
    if (c->link_mbps) {
        argv[n++] = "--link-mbps";
        argv[n++] = (char *)c->link_mbps;
    }
    argv[n] = NULL;
    char corrupt[E2E_PATH + 32];
    if (c->stall)
        snprintf(corrupt, sizeof corrupt, "%s:%s/stall.p%d", c->stall, c->dir, i);
    else if (c->corrupt_mode)
        snprintf(corrupt, sizeof corrupt, "%s:%s/corrupt.p%d", c->corrupt_mode, c->dir, i);
    c->peers[i] = e2e_spawn_env(log, argv,
                                c->stall ? "FUSION_TEST_STALL" : c->corrupt_mode ? "FUSION_TEST_CORRUPT_OUTPUT" : NULL,
                                corrupt);
    c->stopped[i] = false;
    free(argv[0]);
}

/* Waits until the current broker's log says peer pI joined. */
static inline void e2e_peer_wait_joined(e2e_cluster *c, int i, int timeout_ms)
{
    char log[E2E_PATH], needle[32];
    e2e_broker_log(c, log);
    snprintf(needle, sizeof needle, "(p%d) joined", i);
    if (!e2e_wait_file(log, needle, timeout_ms)) {
        e2e_show_all(c);
        fail_msg("peer p%d did not join", i);
    }
}

/* Makes the keys, allow-list, model (c->model_args, default E2E_MODEL_ARGS, in DIR/model), training
 * text and client configuration, starts the broker and n_peers peers, and waits until every peer has
 * joined. Set c->backups, c->heartbeat_ms, c->peer_memory_gb, c->model_args, c->word_data and
 * c->corrupt_mode before e2e_cluster_start (memset + defaults are done by e2e_cluster_init). */
static inline void e2e_cluster_init(e2e_cluster *c, const char *tag, int n_peers)
{
    memset(c, 0, sizeof *c);
    assert_true(n_peers >= 1 && n_peers <= E2E_MAX_PEERS);
    c->n_peers = n_peers;
    c->peer_memory_gb = E2E_PEER_MEMORY_GB;
    c->link_mbps = E2E_LINK_MBPS;
    char *d = tu_tmpdir(tag);
    assert_non_null(d);
    snprintf(c->dir, sizeof c->dir, "%s", d);
    free(d);
    const char *src = getenv("FUSION_SOURCE_DIR");
    snprintf(c->data, sizeof c->data, "%s/deploy/data/shakespeare.txt", src ? src : "..");
    assert_true(fu_path_exists(c->data));
    e2e_path(c, c->conf, "client.conf");
    e2e_live = c;
    snprintf(e2e_live_dir, sizeof e2e_live_dir, "%s", c->dir);
}

/* e2e_cluster_init for the two-stage cluster above, with `backups` warm backups. */
static inline void e2e_two_stage_init(e2e_cluster *c, const char *tag, int n_peers, int backups)
{
    e2e_cluster_init(c, tag, n_peers);
    c->backups = backups;
    c->heartbeat_ms = 300;
    c->peer_memory_gb = E2E_TWO_STAGE_MEMORY_GB;
    c->model_args = E2E_TWO_STAGE_MODEL_ARGS;
    c->word_data = true;
}

static inline void e2e_cluster_start(e2e_cluster *c)
{
#ifndef FUSION_TEST_HOOKS
    if (c->stall || c->corrupt_mode)
        skip(); /* a Release build has no fault hooks (peer/peer_faults.h) */
#endif
    char *out = NULL;
    char keys[256] = "broker client";
    for (int i = 0; i < c->n_peers; i++) {
        size_t l = strlen(keys);
        snprintf(keys + l, sizeof keys - l, " p%d", i);
    }
    int rc = tu_sh(&out,
                   "cd '%s' && for k in %s; do '%s' keygen -o $k >/dev/null || exit 1; done && "
                   "for k in client %s; do grep -v '^#' $k/public.key; done > allow && "
                   "'%s' model init -o model %s >/dev/null",
                   c->dir, keys, tu_bin("fusion"), keys + strlen("broker client "), tu_bin("fusion"),
                   c->model_args ? c->model_args : E2E_MODEL_ARGS);
    if (rc != 0)
        fail_msg("cluster setup failed: %s", out ? out : "");
    free(out);
    if (c->word_data) { /* a deterministic word stream */
        e2e_path(c, c->data, "data.txt");
        FILE *df = fopen(c->data, "w");
        assert_non_null(df);
        static const char *words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs",
                                      "far", "away", "into", "forest", "river", "stone"};
        uint32_t x = 12345;
        for (int i = 0; i < E2E_WORDS; i++) {
            x = x * 1103515245u + 12345u;
            fprintf(df, "%s%c", words[(x >> 16) % 16], i % 13 == 12 ? '\n' : ' ');
        }
        fclose(df);
    }
    e2e_broker_start(c);
    FILE *f = fopen(c->conf, "w");
    assert_non_null(f);
    fprintf(f, "# fusion client configuration (see deploy/fusion.conf.example)\nbroker = %s\n"
               "broker-key = %s/broker/public.key\nkeys = %s/client\n", c->endpoint, c->dir, c->dir);
    fclose(f);
    for (int i = 0; i < c->n_peers; i++)
        e2e_peer_start(c, i);
    for (int i = 0; i < c->n_peers; i++)
        e2e_peer_wait_joined(c, i, 30000);
}

/* Kills one peer with sig and reaps it when the signal ends it (SIGKILL). */
static inline void e2e_peer_kill9(e2e_cluster *c, int i)
{
    assert_true(c->peers[i] > 0);
    kill(c->peers[i], SIGKILL);
    waitpid(c->peers[i], NULL, 0);
    e2e_kid_gone(c->peers[i]);
    c->peers[i] = 0;
}

/* Graceful stop: SIGCONT the stopped, SIGTERM every peer, then the broker; each must exit 0 (a
 * clean leave). Removes the directory when everything went well (and FUSION_TEST_KEEP is not set). */
static inline void e2e_cluster_stop(e2e_cluster *c)
{
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i] > 0) {
            if (c->stopped[i])
                kill(c->peers[i], SIGCONT);
            kill(c->peers[i], SIGTERM);
        }
    int bad = 0;
    for (int i = 0; i < c->n_peers; i++)
        if (c->peers[i] > 0) {
            int code = e2e_reap(c->peers[i], 20000);
            c->peers[i] = 0;
            if (code != 0) {
                char p[E2E_PATH];
                e2e_path(c, p, "p%d.log", i);
                e2e_show(p, 20);
                printf("peer p%d exited %d after SIGTERM\n", i, code);
                bad++;
            }
        }
    if (c->broker > 0) {
        kill(c->broker, SIGTERM);
        int code = e2e_reap(c->broker, 15000);
        c->broker = 0;
        if (code != 0) {
            char p[E2E_PATH];
            e2e_broker_log(c, p);
            e2e_show(p, 20);
            printf("the broker exited %d after SIGTERM\n", code);
            bad++;
        }
    }
    e2e_live = NULL;
    e2e_live_dir[0] = '\0';
    if (bad == 0 && !getenv("FUSION_TEST_KEEP")) { /* FUSION_TEST_KEEP=1 keeps the logs of a passing test */
        char *out = NULL;
        (void)tu_sh(&out, "rm -rf '%s'", c->dir);
        free(out);
    } else {
        printf("logs kept in %s\n", c->dir);
    }
    assert_int_equal(bad, 0);
}

/* cmocka teardown: after a failed assertion kill and reap what is left of the cluster: every child
 * spawned and not reaped yet that is still this process's child (read from static memory only). */
static inline int e2e_teardown(void **state)
{
    (void)state;
    tu_load_stop();
    for (int i = 0; i < E2E_MAX_CHILDREN; i++) {
        pid_t pid = e2e_kids[i];
        siginfo_t info;
        e2e_kids[i] = 0;
        if (pid <= 0 || waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0)
            continue; /* not (or no longer) our child */
        kill(pid, SIGCONT);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    if (e2e_live_dir[0])
        printf("logs kept in %s\n", e2e_live_dir);
    e2e_live = NULL;
    e2e_live_dir[0] = '\0';
    return 0;
}

/* Runs the one test named argv[1] (ctest registers each as its own entry, each with its own
 * timeout), or all of them without an argument. */
static inline int e2e_main(int argc, char **argv, const struct CMUnitTest *tests, size_t n, const char *group)
{
    signal(SIGPIPE, SIG_IGN);
    if (argc > 1) {
        for (size_t i = 0; i < n; i++)
            if (strcmp(tests[i].name, argv[1]) == 0)
                return _cmocka_run_group_tests(group, &tests[i], 1, NULL, NULL);
        fprintf(stderr, "%s: no test named %s\n", argv[0], argv[1]);
        return 2;
    }
    return _cmocka_run_group_tests(group, tests, n, NULL, NULL);
}

#endif
