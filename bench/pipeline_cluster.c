/* bench-pipeline: the distributed fine-tune against the single process, with the real programs.
 *
 * Starts fusion-broker, fusion-peer and fusion from the directory this executable lives in
 * (/proc/self/exe) with the test cluster harness (tests/cluster.h), on loopback, one compute thread per
 * peer, and prints JSON lines:
 *   - finetune_run: `fusion run finetune --threads 1` tokens/s (its own count over the training loop);
 *   - finetune_peers (peers = 1, 2, 3): tokens/s of the same job through the broker, measured from the
 *     broker's log between "every stage is ready; started" and "done" (planning and weight fetches
 *     excluded; checkpoints included), the stages the broker planned, the speed-up over the single
 *     process, the wall time from submit to done, and the share of step time spent sealing and sending
 *     the activations and gradients (see below);
 *   - recovery: a peer holding the middle stage of a three-stage job is SIGKILLed (broker --backups 1,
 *     default 1 s heartbeat): the time until the broker moved the stage, until every stage was
 *     running again, and until the job was past the step it had reached;
 *   - replan: the same with no backup: the job is planned again over the two survivors;
 *   - verify_run, verify_cost: what verification at the default fraction costs (below);
 *   - jobs: three jobs at once on six peers against one alone (below);
 *   - serve: a serving job with 1, 4 and 8 generations at once (below).
 * --quick: the e2e tests' model (6 layers, hidden 256), batch 4 x 16 tokens; default: 8 layers,
 * hidden 512, ffn 1376, vocab 512 (23 M parameters), batch 4 x 64 tokens. (The vocabulary is not the
 * byte-level 256: with hidden > vocab the partitioner cannot cut between layers — docs/TESTING.md.)
 *
 * Sealing and sending share. fusion-peer reports no per-frame timings (no stats message, no log line
 * per frame), so the share is computed: each step moves, across each of the S-1 stage boundaries,
 * one activation tensor down and one gradient tensor up, each rows x hidden float32 (M = 1); each is
 * sealed (XChaCha20-Poly1305 in 1 MiB chunks), written through a loopback TCP socket and opened. This
 * program measures those three rates here with libsodium and a TCP socket pair, and divides
 * (S-1) * 2 * bytes * (1/seal + 1/send + 1/open) by the measured step time. The steps are serial with
 * one micro-batch, so nothing overlaps the transfers: this is the share of the critical path. ZeroMQ's
 * own overhead is not in it (a lower bound).
 *
 * A cluster that cannot start, or a step of the harness that fails, ends the benchmark with a message
 * (tu_fail_exits). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "bench.h"
#include "cluster.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "testutil.h"

#ifndef FU_SOURCE_DIR
#define FU_SOURCE_DIR "."
#endif

#define PB_MAX_PEERS    4
#define PB_CHUNK        (1u << 20) /* seal chunk, as WIRE_TENSOR_CHUNK */
#define PB_OVERHEAD_MIB 32.0       /* the partitioner's fixed memory per stage (DAG_STAGE_OVERHEAD_BYTES) */

typedef struct {
    char *dir;           /* scratch: the model and the single-process run */
    char data[TU_PATH];  /* training text */
    char model[TU_PATH]; /* model directory */
    char train[256];     /* fine-tune options shared by run and submit */
    int hidden, batch, seq, steps;
    double need_mib;     /* the broker's estimate of the whole job's memory on one peer */
} pb_env;

static pb_env env;

/* Wall-clock ms (Unix epoch) of the log line that holds "job ID<what>" (-1 if none): the line starts
 * with the logger's "YYYY-MM-DDTHH:MM:SS.mmmZ". from: search after this offset; *next: after it. */
static int64_t pb_log_ms(const char *log, size_t from, const char *id, const char *what, size_t *next)
{
    char needle[160];
    snprintf(needle, sizeof needle, "job %s%s", id, what);
    const char *at = strstr(log + from, needle);
    if (!at)
        return -1;
    const char *line = at;
    while (line > log && line[-1] != '\n')
        line--;
    struct tm tm = {0};
    int ms = 0;
    if (sscanf(line, "%d-%d-%dT%d:%d:%d.%dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min,
               &tm.tm_sec, &ms) != 7)
        return -1;
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    if (next)
        *next = (size_t)(at - log) + strlen(needle);
    return (int64_t)timegm(&tm) * 1000 + ms;
}

/* ---- the environment --------------------------------------------------------------------------- */

static bool pb_setup(void)
{
    if (env.dir)
        return true;
    tu_fail_exits();
    char exe[1024];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return false;
    exe[n] = '\0';
    *strrchr(exe, '/') = '\0';
    setenv("FUSION_BIN_DIR", exe, 1);             /* the programs next to this one */
    setenv("FUSION_SOURCE_DIR", FU_SOURCE_DIR, 0); /* the training text, unless told otherwise */
    if (getenv("FUSION_BENCH_KEEP"))
        setenv("FUSION_TEST_KEEP", "1", 1);
    snprintf(env.data, sizeof env.data, "%s/deploy/data/shakespeare.txt", getenv("FUSION_SOURCE_DIR"));
    if (!fu_path_exists(env.data)) {
        fprintf(stderr, "bench-pipeline: no training text at %s (set FUSION_SOURCE_DIR)\n", env.data);
        return false;
    }
    const char *margs;
    if (bench_quick()) {
        margs = TU_MODEL_ARGS;
        env.hidden = 256, env.batch = 4, env.seq = 16, env.steps = 30;
    } else {
        margs = "--layers 8 --hidden 512 --heads 8 --kv-heads 4 --ffn 1376 --vocab 512 --seed 3";
        env.hidden = 512, env.batch = 4, env.seq = 64, env.steps = 24;
    }
    env.dir = tu_dir_new("bench-pipeline");
    snprintf(env.model, sizeof env.model, "%s/model", env.dir);
    snprintf(env.train, sizeof env.train, "--rank 8 --alpha 16 --lr 0.01 --seed 7 --batch %d --seq-len %d --steps %d",
             env.batch, env.seq, env.steps);
    char *out = NULL;
    if (tu_sh(&out, "'%s' model init -o '%s' %s", tu_bin("fusion"), env.model, margs) != 0) {
        fprintf(stderr, "bench-pipeline: fusion model init failed: %s\n", out);
        free(out);
        return false;
    }
    free(out);
    return true;
}

__attribute__((destructor)) static void pb_cleanup(void)
{
    if (env.dir && !getenv("FUSION_BENCH_KEEP"))
        tu_dir_remove(env.dir);
    free(env.dir);
}

/* --max-memory (GiB) that makes the partitioner cut the job into `stages` stages: halfway between
 * what a stage of 1/stages and one of 1/(stages-1) of the job needs (weights and activations split
 * with the layers, the fixed overhead does not). 0 (no cap) for one stage. */
static double pb_cap_gb(int stages)
{
    if (stages <= 1)
        return 0;
    double share = (1.0 / stages + 1.0 / (stages - 1)) / 2;
    return (PB_OVERHEAD_MIB + (env.need_mib - PB_OVERHEAD_MIB) * share) / 1024.0;
}

/* Starts a cluster of n_peers (one compute thread each, the peers' own priority and link probe) with
 * `backups` and every peer offering cap_gb GiB (0: no cap), on the benchmark's model. */
static tu_cluster *pb_start_args(const char *tag, int n_peers, int backups, double cap_gb, const char *broker_args)
{
    static char cap[32]; /* read by each start of the cluster: one cluster at a time */
    snprintf(cap, sizeof cap, "%.5f", cap_gb);
    tu_opts o = tu_opts_default(n_peers);
    o.model_args = NULL;
    o.model_root = env.dir; /* the benchmark's model lives there */
    o.backups = backups;
    o.peer_memory_gb = cap_gb > 0 ? cap : NULL;
    o.link_mbps = NULL;
    o.priority = NULL;
    tu_cluster *c = tu_cluster_new(tag, &o);
    if (broker_args)
        tu_broker_args(c, broker_args);
    tu_cluster_start(c);
    return c;
}

static tu_cluster *pb_start(const char *tag, int n_peers, int backups, double cap_gb)
{
    return pb_start_args(tag, n_peers, backups, cap_gb, NULL);
}

static void pb_stop(tu_cluster **c_p)
{
    if (tu_cluster_stop(c_p) != FU_OK)
        fprintf(stderr, "bench-pipeline: a process of the cluster did not stop cleanly (see above)\n");
}

/* Submits the fine-tune on the benchmark's model (with extra options); the id in id[17]. */
static void pb_submit(const tu_cluster *c, char id[17], const char *train, const char *extra)
{
    tu_submit_finetune(c, id, env.model, "%s %s", train, extra);
}

/* Asks the broker what the whole job needs: one peer offering 30 MiB (less than any stage) leaves the
 * job queued with "all of it needs about N MiB" in the log. */
static bool pb_probe_need(void)
{
    if (env.need_mib > 0)
        return true;
    tu_cluster *c = pb_start("bench-probe", 1, 0, 30.0 / 1024.0);
    char id[17];
    pb_submit(c, id, env.train, "");
    if (tu_broker_wait_log(c, 20000, "all of it needs about ")) {
        char *bl = tu_broker_log_text(c);
        env.need_mib = strtod(strstr(bl, "all of it needs about ") + 22, NULL);
        free(bl);
    }
    (void)tu_fusion(c, NULL, "cancel %s >/dev/null 2>&1", id);
    pb_stop(&c);
    if (!(env.need_mib > PB_OVERHEAD_MIB)) {
        fprintf(stderr, "bench-pipeline: could not read the job's memory estimate from the broker\n");
        return false;
    }
    return true;
}

/* ---- sealing and sending rates ----------------------------------------------------------------- */

typedef struct {
    int fd;
    size_t total;
} pb_reader;

static void *pb_read_all(void *arg)
{
    pb_reader *r = arg;
    static uint8_t buf[1 << 16];
    size_t got = 0;
    while (got < r->total) {
        ssize_t n = read(r->fd, buf, sizeof buf);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    return NULL;
}

/* Bytes/s of sealing, opening and sending over loopback TCP, measured once. */
static void pb_rates(double *seal_bps, double *open_bps, double *send_bps)
{
    static double s = 0, o = 0, t = 0;
    if (s == 0) {
        size_t n = 16u << 20;
        uint8_t *pt = malloc(n), *ct = malloc(PB_CHUNK + crypto_aead_xchacha20poly1305_ietf_ABYTES), *back = malloc(PB_CHUNK);
        randombytes_buf(pt, n);
        uint8_t key[crypto_aead_xchacha20poly1305_ietf_KEYBYTES], nonce[crypto_aead_xchacha20poly1305_ietf_NPUBBYTES];
        randombytes_buf(key, sizeof key);
        randombytes_buf(nonce, sizeof nonce);
        uint8_t ad[32] = {0};
        unsigned long long cl = 0, ml = 0;
        double ts = 0, to = 0;
        for (size_t off = 0; off < n; off += PB_CHUNK) {
            double t0 = fu_clock_sec();
            crypto_aead_xchacha20poly1305_ietf_encrypt(ct, &cl, pt + off, PB_CHUNK, ad, sizeof ad, NULL, nonce, key);
            double t1 = fu_clock_sec();
            if (crypto_aead_xchacha20poly1305_ietf_decrypt(back, &ml, NULL, ct, cl, ad, sizeof ad, nonce, key) != 0)
                abort();
            to += fu_clock_sec() - t1;
            ts += t1 - t0;
        }
        s = (double)n / ts;
        o = (double)n / to;
        /* loopback TCP */
        int ls = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t al = sizeof a;
        if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) != 0 || listen(ls, 1) != 0 ||
            getsockname(ls, (struct sockaddr *)&a, &al) != 0)
            abort();
        int cs = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(cs, (struct sockaddr *)&a, sizeof a) != 0)
            abort();
        int ss = accept(ls, NULL, NULL);
        pb_reader r = {.fd = ss, .total = n};
        pthread_t th;
        double t0 = fu_clock_sec();
        pthread_create(&th, NULL, pb_read_all, &r);
        for (size_t off = 0; off < n;) {
            ssize_t w = write(cs, pt + off, n - off < PB_CHUNK ? n - off : PB_CHUNK);
            if (w <= 0)
                abort();
            off += (size_t)w;
        }
        pthread_join(th, NULL);
        t = (double)n / (fu_clock_sec() - t0);
        close(cs);
        close(ss);
        close(ls);
        free(pt);
        free(ct);
        free(back);
        bench_emit("pipeline", "link_rates", "\"seal_MBps\":%.0f,\"open_MBps\":%.0f,\"loopback_tcp_MBps\":%.0f", s / 1e6,
                   o / 1e6, t / 1e6);
    }
    *seal_bps = s;
    *open_bps = o;
    *send_bps = t;
}

/* ---- cases ------------------------------------------------------------------------------------- */

static double run_tps; /* fusion run finetune tokens/s, for the speed-ups */

static void pb_finetune_run(void)
{
    char *out = NULL;
    double t0 = fu_clock_sec();
    int rc = tu_sh(&out, "cd '%s' && '%s' run finetune --threads 1 --model '%s' --data '%s' %s -o run-adapter", env.dir,
                   tu_bin("fusion"), env.model, env.data, env.train);
    double wall = fu_clock_sec() - t0;
    const char *last = NULL, *at = out;
    while ((at = strstr(at, "tokens/s ")) != NULL)
        last = at++;
    if (rc != 0 || !last) {
        fprintf(stderr, "bench-pipeline: fusion run finetune failed: %s\n", out);
        free(out);
        return;
    }
    run_tps = strtod(last + 9, NULL);
    bench_emit("pipeline", "finetune_run", "\"threads\":1,\"layers_hidden\":\"%s\",\"tokens\":%d,\"tokens_per_s\":%.1f,"
               "\"wall_s\":%.2f", bench_quick() ? "6x256" : "8x512", env.steps * env.batch * env.seq, run_tps, wall);
    free(out);
}

static void pb_finetune_peers(int n)
{
    char tag[32];
    snprintf(tag, sizeof tag, "bench-ft%d", n);
    tu_cluster *c = pb_start(tag, n, 0, pb_cap_gb(n));
    char id[17];
    double t0 = fu_clock_sec();
    pb_submit(c, id, env.train, "--checkpoint-every 1000");
    int rc = tu_fusion(c, NULL, "wait %s -q --wait-timeout 600 >/dev/null 2>&1", id);
    double wall = fu_clock_sec() - t0;
    char *bl = tu_broker_log_text(c);
    size_t after = 0;
    int64_t t_start = pb_log_ms(bl, 0, id, ": every stage is ready; started at step 0", &after);
    int64_t t_done = pb_log_ms(bl, after, id, " done", NULL);
    char needle[96];
    int stages = 0;
    for (int s = 1; s <= PB_MAX_PEERS; s++) {
        snprintf(needle, sizeof needle, "job %s stage 0/%d on", id, s);
        if (strstr(bl, needle))
            stages = s;
    }
    free(bl);
    if (rc != 0 || t_start < 0 || t_done < t_start) {
        fprintf(stderr, "bench-pipeline: the %d-peer job did not finish (logs in %s)\n", n, tu_cluster_dir(c));
        pb_stop(&c);
        return;
    }
    double train_s = (double)(t_done - t_start) / 1e3, tokens = (double)env.steps * env.batch * env.seq;
    double tps = tokens / train_s, step_s = train_s / env.steps;
    double seal, opn, send;
    pb_rates(&seal, &opn, &send);
    double frame = (double)env.batch * env.seq * env.hidden * 4.0;
    double comm_s = (stages - 1) * 2.0 * frame * (1 / seal + 1 / opn + 1 / send);
    bench_emit("pipeline", "finetune_peers",
               "\"peers\":%d,\"stages\":%d,\"tokens_per_s\":%.1f,\"vs_run\":%.2f,\"step_ms\":%.1f,\"wall_s\":%.2f,"
               "\"frame_bytes\":%.0f,\"seal_send_ms_per_step\":%.3f,\"seal_send_share\":%.4f",
               n, stages, tps, run_tps > 0 ? tps / run_tps : 0, step_s * 1e3, wall, frame, comm_s * 1e3,
               comm_s / step_s);
    pb_stop(&c);
}

BENCH_CASE(pipeline_finetune)
{
    if (!pb_setup() || !pb_probe_need())
        return;
    pb_finetune_run();
    for (int n = 1; n <= 3; n++)
        pb_finetune_peers(n);
}

/* A three-stage job (a longer one, to kill mid-way); once a checkpoint is behind it, stage 1's peer
 * is SIGKILLed (default heartbeat) and the time until the broker replaced the stage, until every
 * stage ran again and until the job was past the step it had reached is measured; the job is then
 * cancelled. recovery: four peers, one warm backup takes the stage. replan: three peers, no
 * backup (each offers room for half of the job): the job is planned again over the two survivors and
 * its checkpoint cut for two stages (docs/PIPELINE.md "Re-planning"). */
static void pb_kill_stage1(bool replan)
{
    const char *name = replan ? "replan" : "recovery";
    /* replan: --grow-margin 0, the job takes all three peers (with one micro-batch two stages would do) */
    tu_cluster *c = replan ? pb_start_args("bench-replan", 3, 0, pb_cap_gb(2), "--grow-margin 0")
                           : pb_start("bench-rec", 4, 1, pb_cap_gb(3));
    char id[17], train[256];
    long kill_at = bench_quick() ? 12 : 7; /* past the checkpoint at 10 (5) */
    snprintf(train, sizeof train, "--rank 8 --alpha 16 --lr 0.01 --seed 7 --batch %d --seq-len %d --steps %d", env.batch,
             env.seq, bench_quick() ? 400 : 60);
    pb_submit(c, id, train, bench_quick() ? "--checkpoint-every 10" : "--checkpoint-every 5");
    /* wait until a checkpoint is behind the job, then kill stage 1's peer */
    tu_status st;
    uint64_t end = fu_clock_ms() + 600000;
    while (fu_clock_ms() < end) {
        if (tu_status_get(c, id, &st) && (st.step >= kill_at || strcmp(st.state, "done") == 0))
            break;
        fu_sleep_ms(20);
    }
    if (strcmp(st.state, "running") != 0 || !tu_broker_logged(c, "job %s stage 1/3 on ", id)) {
        fprintf(stderr, "bench-pipeline: %s: no three-stage running job to interrupt (%s, step %ld)\n", name, st.state,
                st.step);
        pb_stop(&c);
        return;
    }
    int victim = tu_stage_peer(c, id, 1, 1000);
    int64_t t_kill = fu_wallclock_ms();
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    long at_kill = st.step;
    uint64_t t0 = fu_clock_ms();
    double t_past = -1;
    end = t0 + 300000;
    while (fu_clock_ms() < end) {
        if (tu_status_get(c, id, &st) && (strcmp(st.state, "done") == 0 || st.step > at_kill + 1)) {
            t_past = (double)(fu_clock_ms() - t0);
            break;
        }
        fu_sleep_ms(20);
    }
    char *bl = tu_broker_log_text(c);
    size_t after = 0;
    const char *moved = replan ? ": its checkpoint at step " : ": stage 1 moved from";
    int64_t t_moved = pb_log_ms(bl, 0, id, moved, &after);
    int64_t t_ready = t_moved > 0 ? pb_log_ms(bl, after, id, ": every stage is ready; started at step", NULL) : -1;
    long resumed_from = -1;
    const char *r = t_moved <= 0 ? NULL : replan ? bl + after : strstr(bl + after, "resuming from step ");
    if (r)
        resumed_from = strtol(replan ? r : r + 19, NULL, 10);
    free(bl);
    bench_emit("pipeline", name,
               "\"signal\":\"SIGKILL\",\"stage\":1,\"stages\":3,\"stages_after\":%d,\"heartbeat_ms\":1000,"
               "\"step_at_kill\":%ld,\"resumed_from\":%ld,\"moved_ms\":%lld,\"all_ready_ms\":%lld,"
               "\"past_kill_step_ms\":%.0f",
               replan ? 2 : 3, at_kill, resumed_from, t_moved > 0 ? (long long)(t_moved - t_kill) : -1LL,
               t_ready > 0 ? (long long)(t_ready - t_kill) : -1LL, t_past);
    (void)tu_fusion(c, NULL, "cancel %s >/dev/null 2>&1", id);
    pb_stop(&c);
}

BENCH_CASE(pipeline_recovery)
{
    if (pb_setup() && pb_probe_need())
        pb_kill_stage1(false);
}

BENCH_CASE(pipeline_replan)
{
    if (pb_setup() && pb_probe_need())
        pb_kill_stage1(true);
}

/* ---- the cost of verification ------------------------------------------------------------------ */

/* CPU seconds (user + system) process pid has used so far; -1 when /proc does not say. */
static double pb_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the name may hold spaces: fields count from its end */
    unsigned long long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Counts the lines of the broker's log that hold needle. */
static int pb_log_count(const char *log, const char *needle)
{
    int n = 0;
    for (const char *at = log; (at = strstr(at, needle)) != NULL; at++)
        n++;
    return n;
}

typedef struct {
    double tps, step_ms, stage_cpu, backup_cpu; /* backup_cpu: the two backups (the verifiers) */
    int samples, disagree, skipped;
} pb_verify_run;

/* The two-stage job with M = 4 micro-batches on four peers (two stages, --backups 2: a verifier for
 * each), --verify frac; false when it did not finish. */
static bool pb_verify_once(double frac, pb_verify_run *r)
{
    char tag[32], extra[96];
    snprintf(tag, sizeof tag, "bench-verify%.0f", frac * 100);
    tu_cluster *c = pb_start(tag, 4, 2, pb_cap_gb(2));
    double cpu0[4];
    for (int i = 0; i < 4; i++)
        cpu0[i] = pb_cpu_s(tu_peer_pid(c, i));
    char id[17];
    snprintf(extra, sizeof extra, "--micro-batches 4 --verify %.2f --checkpoint-every 1000", frac);
    pb_submit(c, id, env.train, extra);
    int rc = tu_fusion(c, NULL, "wait %s -q --wait-timeout 900 >/dev/null 2>&1", id);
    double cpu1[4];
    for (int i = 0; i < 4; i++)
        cpu1[i] = pb_cpu_s(tu_peer_pid(c, i));
    char *bl = tu_broker_log_text(c);
    size_t after = 0;
    int64_t t_start = pb_log_ms(bl, 0, id, ": every stage is ready; started at step 0", &after);
    int64_t t_done = pb_log_ms(bl, after, id, " done", NULL);
    bool two = strstr(bl, "/2 on") != NULL && strstr(bl, "/3 on") == NULL;
    r->samples = pb_log_count(bl, ": agree (");
    r->disagree = pb_log_count(bl, " disagree (");
    r->skipped = pb_log_count(bl, "sample skipped");
    free(bl);
    if (rc != 0 || t_start < 0 || t_done < t_start || !two) {
        fprintf(stderr, "bench-pipeline: verify %.2f: the two-stage job did not finish (logs in %s)\n", frac,
                tu_cluster_dir(c));
        pb_stop(&c);
        return false;
    }
    int s0 = tu_stage_peer(c, id, 0, 1000), s1 = tu_stage_peer(c, id, 1, 1000);
    r->stage_cpu = r->backup_cpu = 0;
    for (int i = 0; i < 4; i++) {
        double used = cpu1[i] - cpu0[i];
        if (i == s0 || i == s1)
            r->stage_cpu += used;
        else
            r->backup_cpu += used;
    }
    double train_s = (double)(t_done - t_start) / 1e3;
    r->tps = (double)env.steps * env.batch * env.seq / train_s;
    r->step_ms = train_s * 1e3 / env.steps;
    bench_emit("pipeline", "verify_run",
               "\"verify\":%.2f,\"stages\":2,\"micro_batches\":4,\"steps\":%d,\"tokens_per_s\":%.1f,\"step_ms\":%.1f,"
               "\"stage_peers_cpu_s\":%.2f,\"verifiers_cpu_s\":%.2f,\"samples_agreed\":%d,\"disagreed\":%d,"
               "\"skipped\":%d",
               frac, env.steps, r->tps, r->step_ms, r->stage_cpu, r->backup_cpu, r->samples, r->disagree, r->skipped);
    pb_stop(&c);
    return true;
}

/* What verification at the broker's default fraction costs: the same job at --verify 0 and 0.25.
 * The figures are CPU seconds of the peer processes over the job (not wall time: on a small machine
 * the verifiers share its cores with the stages): the verifiers' extra CPU against the stages' own
 * (the extra compute per step), and the stages' own extra (their snapshots of state for steps
 * without a checkpoint). Expected share: 0.25 x a forward (about a third of a forward and backward)
 * at the first stage, 0.25 x a forward and backward at the last (its verified output is the
 * gradient it sends up). */
BENCH_CASE(pipeline_verify)
{
    if (!pb_setup() || !pb_probe_need())
        return;
    pb_verify_run off, on;
    if (!pb_verify_once(0.0, &off) || !pb_verify_once(0.25, &on))
        return;
    double base = off.stage_cpu > 0 ? off.stage_cpu : 1;
    bench_emit("pipeline", "verify_cost",
               "\"verify\":0.25,\"samples_per_step\":%.2f,\"sampled_share\":%.3f,\"extra_compute\":%.3f,"
               "\"stage_overhead\":%.3f,\"step_time_ratio\":%.3f",
               (double)on.samples / env.steps, (double)on.samples / (env.steps * 4.0 * 2.0),
               (on.backup_cpu - off.backup_cpu) / base, (on.stage_cpu - off.stage_cpu) / base,
               off.step_ms > 0 ? on.step_ms / off.step_ms : 0);
}

/* ---- several jobs at once ---------------------------------------------------------------------- */

/* Three jobs on six peers, each peer offering room for a third of a job (every job needs three
 * stages), against one job alone on the same cluster: the one job's tokens/s (its start to its
 * end) and the three jobs' together (all their tokens over the first start to the last end). A job
 * takes only the stages it needs (docs/PIPELINE.md "Growth"), so two run at once and the third
 * follows. Where the machine has fewer cores than busy peers, the jobs share the cores: the gain is
 * what the cores allow (on 2 cores, none). */
BENCH_CASE(pipeline_jobs)
{
    if (!pb_setup() || !pb_probe_need())
        return;
    tu_cluster *c = pb_start("bench-jobs", 6, 0, pb_cap_gb(3));
    char ids[4][17];
    for (int k = 0; k < 4; k++) {
        pb_submit(c, ids[k], env.train, "--checkpoint-every 1000");
        if (k > 0 && k < 3)
            continue; /* the three after the first go together */
        for (int w = k == 0 ? 0 : 1; w <= k; w++)
            if (tu_fusion(c, NULL, "wait %s -q --wait-timeout 900 >/dev/null 2>&1", ids[w]) != 0) {
                fprintf(stderr, "bench-pipeline: jobs: job %s did not finish (logs in %s)\n", ids[w],
                        tu_cluster_dir(c));
                pb_stop(&c);
                return;
            }
    }
    char *bl = tu_broker_log_text(c);
    int64_t start[4], end[4];
    for (int k = 0; k < 4; k++) {
        size_t after = 0;
        start[k] = pb_log_ms(bl, 0, ids[k], ": every stage is ready; started at step 0", &after);
        end[k] = pb_log_ms(bl, after, ids[k], " done", NULL);
    }
    free(bl);
    int64_t first = start[1], last = end[1];
    bool overlap = false;
    for (int k = 1; k < 4; k++) {
        first = start[k] < first ? start[k] : first;
        last = end[k] > last ? end[k] : last;
        for (int m = 1; m < 4; m++)
            overlap = overlap || (m != k && start[m] < end[k] && start[k] < end[m]);
    }
    double tokens = (double)env.steps * env.batch * env.seq;
    double one = start[0] > 0 && end[0] > start[0] ? tokens / ((double)(end[0] - start[0]) / 1e3) : 0;
    double three = first > 0 && last > first ? 3 * tokens / ((double)(last - first) / 1e3) : 0;
    bench_emit("pipeline", "jobs",
               "\"peers\":6,\"stages_per_job\":3,\"one_job_tokens_per_s\":%.1f,\"three_jobs_tokens_per_s\":%.1f,"
               "\"ratio\":%.2f,\"ran_at_once\":%s",
               one, three, one > 0 ? three / one : 0, overlap ? "true" : "false");
    pb_stop(&c);
}


/* ---- uploading a model ------------------------------------------------------------------------- */

/* `fusion upload` of the benchmark's model to a broker on loopback: the first upload (every chunk
 * sent, four in flight), the same directory again (nothing sent), and a copy whose config.json
 * changed (one chunk sent, the broker copies the rest from the first). */
typedef struct {
    double seconds, mib, mib_sent;
    unsigned sent, chunks, copied;
} pb_upload;

static bool pb_upload_once(const tu_cluster *c, const char *dir, pb_upload *u)
{
    char *out = NULL;
    double t0 = fu_clock_sec();
    int rc = tu_fusion(c, &out, "upload '%s' 2>&1", dir);
    u->seconds = fu_clock_sec() - t0;
    const char *p = out ? strstr(out, ": sent ") : NULL;
    bool ok = rc == 0 && p &&
              sscanf(p, ": sent %u of %u chunks (%lf of %lf MiB), %u copied", &u->sent, &u->chunks, &u->mib_sent,
                     &u->mib, &u->copied) == 5;
    if (!ok)
        fprintf(stderr, "bench-pipeline: fusion upload %s: exit %d: %s\n", dir, rc, out ? out : "");
    free(out);
    return ok;
}

BENCH_CASE(pipeline_upload)
{
    if (!pb_setup())
        return;
    tu_cluster *c = pb_start("bench-upload", 1, 0, 0);
    char copy[TU_PATH + 16];
    snprintf(copy, sizeof copy, "%s/model-copy", env.dir);
    char *out = NULL;
    pb_upload first, again, changed;
    bool ok = pb_upload_once(c, env.model, &first) && pb_upload_once(c, env.model, &again) &&
              tu_sh(&out, "rm -rf '%s' && cp -r '%s' '%s' && sed -i 's/\"rms_norm_eps\"/\"rms_norm_eps\" /' '%s/config.json'",
                    copy, env.model, copy, copy) == 0 &&
              pb_upload_once(c, copy, &changed);
    free(out);
    pb_stop(&c);
    if (!ok)
        return;
    bench_emit("pipeline", "pipeline_upload",
               "\"model_mib\":%.1f,\"chunks\":%u,\"first_s\":%.2f,\"first_mib_per_s\":%.1f,\"again_s\":%.2f,"
               "\"again_chunks_sent\":%u,\"changed_config_s\":%.2f,\"changed_config_chunks_sent\":%u,"
               "\"changed_config_chunks_copied\":%u",
               first.mib, first.chunks, first.seconds, first.seconds > 0 ? first.mib_sent / first.seconds : 0,
               again.seconds, again.sent, changed.seconds, changed.sent, changed.copied);
}

/* ---- a serving job: many generations in one pipeline ------------------------------------------- */

/* The generated tokens/s of a serving job (docs/SERVE.md "Serving jobs") on three peers when 1, 4 and
 * 8 generations run at once (`fusion ask --prompts`, greedy, PS_TOKENS each), measured from the
 * client's start to its end: the stages run the sessions' positions in batched forwards, so the
 * aggregate grows with the sessions while each one's own rate falls less. Also the stages the
 * broker planned and the widest batch a peer logged. */
#define PS_TOKENS 64
BENCH_CASE(pipeline_serve)
{
    if (!pb_setup() || !pb_probe_need())
        return;
    tu_cluster *c = pb_start("bench-serve", 3, 0, pb_cap_gb(3));
    char id[17];
    tu_submit(c, id, "infer --model '%s' --sessions 8 --context %d --max-tokens %d", env.model, 32 + PS_TOKENS,
              PS_TOKENS);
    if (!tu_broker_wait_log(c, 120000, "job %s: every stage is ready", id)) {
        fprintf(stderr, "bench-pipeline: serve: the serving job did not start (logs in %s)\n", tu_cluster_dir(c));
        pb_stop(&c);
        return;
    }
    int stages = 0;
    for (int s = 0; s < 8; s++)
        stages += tu_broker_logged(c, "job %s stage %d/", id, s);
    static const int ns[] = {1, 4, 8};
    double one = 0;
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        char path[TU_PATH];
        snprintf(path, sizeof path, "%s/prompts%d.jsonl", tu_cluster_dir(c), ns[k]);
        FILE *f = fopen(path, "w");
        if (!f)
            break;
        for (int i = 0; i < ns[k]; i++)
            fprintf(f, "{\"prompt\": \"Generation %d of %d begins here:\"}\n", i, ns[k]);
        fclose(f);
        double t0 = fu_clock_sec();
        char *out = NULL;
        int rc = tu_fusion(c, &out, "ask %s --prompts '%s' --max-tokens %d 2>&1", id, path, PS_TOKENS);
        double dt = fu_clock_sec() - t0;
        int lines = 0;
        for (const char *q = out ? out : ""; (q = strstr(q, "\"completion_tokens\":" )) != NULL; q++)
            lines += atoi(q + strlen("\"completion_tokens\":")) == PS_TOKENS;
        free(out);
        if (rc != 0 || lines != ns[k]) {
            fprintf(stderr, "bench-pipeline: serve: %d generations: exit %d, %d of them complete\n", ns[k], rc, lines);
            break;
        }
        double tps = ns[k] * PS_TOKENS / dt;
        if (ns[k] == 1)
            one = tps;
        int widest = 0;
        for (int p = 0; p < 3; p++) {
            char log[TU_PATH];
            snprintf(log, sizeof log, "%s/p%d.log", tu_cluster_dir(c), p);
            char *t = tu_file_text(log);
            for (const char *q = t ? t : ""; (q = strstr(q, " sessions in one forward")) != NULL; q++) {
                const char *d = q;
                while (d > t && d[-1] >= '0' && d[-1] <= '9')
                    d--;
                int w = atoi(d);
                widest = w > widest ? w : widest;
            }
            free(t);
        }
        bench_emit("pipeline", "serve",
                   "\"stages\":%d,\"sessions\":%d,\"tokens_each\":%d,\"seconds\":%.2f,\"tokens_per_s\":%.1f,"
                   "\"per_session_tokens_per_s\":%.1f,\"vs_one\":%.2f,\"widest_batch_so_far\":%d",
                   stages, ns[k], PS_TOKENS, dt, tps, tps / ns[k], one > 0 ? tps / one : 0, widest);
    }
    (void)tu_fusion(c, NULL, "cancel %s", id);
    pb_stop(&c);
}
