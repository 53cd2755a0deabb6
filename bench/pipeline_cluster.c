/* bench-pipeline: the distributed fine-tune against the single process, with the real programs.
 *
 * Spawns fusion-broker, fusion-peer and fusion from the directory this executable lives in
 * (/proc/self/exe), on loopback, one compute thread per peer, and prints JSON lines:
 *   - finetune_run: `fusion run finetune --threads 1` tokens/s (its own count over the training loop);
 *   - finetune_peers (peers = 1, 2, 3): tokens/s of the same job through the broker, measured from the
 *     broker's log between "every stage is ready; started" and "done" (planning and weight fetches
 *     excluded; checkpoints included), the stages the broker planned, the speed-up over the single
 *     process, the wall time from submit to done, and the share of step time spent sealing and sending
 *     the activations and gradients (see below);
 *   - recovery: a peer holding the middle stage of a three-stage job is SIGKILLed (broker --backups 1,
 *     default 1 s heartbeat): the time until the broker moved the stage, until every stage was
 *     running again, and until the job was past the step it had reached.
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
 * own overhead is not in it (a lower bound). */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "bench.h"
#include "fu_clock.h"
#include "fu_file.h"

#ifndef FU_SOURCE_DIR
#define FU_SOURCE_DIR "."
#endif

#define PB_MAX_PEERS  4
#define PB_CHUNK      (1u << 20) /* seal chunk, as WIRE_TENSOR_CHUNK */
#define PB_OVERHEAD_MIB 32.0     /* the partitioner's fixed memory per stage (DAG_STAGE_OVERHEAD_BYTES) */

typedef struct {
    char bin[1024];      /* directory of the programs */
    char dir[1024];      /* scratch */
    char data[1200];     /* training text */
    char model[1100];    /* model directory */
    char train[256];     /* fine-tune options shared by run and submit */
    int hidden, batch, seq, steps;
    double need_mib;     /* the broker's estimate of the whole job's memory on one peer */
    bool ready;
} pb_env;

static pb_env env;

typedef struct {
    char endpoint[128];
    char conf[1100];
    char log[1100];
    pid_t broker;
    pid_t peers[PB_MAX_PEERS];
    int n;
} pb_cluster;

/* ---- processes and files --------------------------------------------------------------------- */

static pid_t pb_spawn(const char *log, char *const argv[])
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static void pb_reap(pid_t pid, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        if (waitpid(pid, NULL, WNOHANG) == pid)
            return;
        fu_sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* Runs a shell command; stdout (and stderr) in *out when out is given; the exit code. */
static int pb_sh(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int pb_sh(char **out, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t cap = 4096, len = 0, n;
    char *buf = malloc(cap);
    while ((n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (cap - len < 1024)
            buf = realloc(buf, cap *= 2);
    }
    buf[len] = '\0';
    int st = pclose(p);
    if (out)
        *out = buf;
    else
        free(buf);
    return st == -1 ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static char *pb_slurp(const char *path)
{
    char *d = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    if (fu_file_read_all(path, (size_t)256 << 20, &d, &n, &em) != FU_OK)
        return strdup("");
    return d;
}

static bool pb_wait_file(const char *path, const char *needle, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        char *d = pb_slurp(path);
        bool ok = strstr(d, needle) != NULL;
        free(d);
        if (ok)
            return true;
        if (fu_clock_ms() >= end)
            return false;
        fu_sleep_ms(20);
    }
}

/* Wall-clock ms (Unix epoch) of the log line that holds needle (-1 if none): the line starts with
 * the logger's "YYYY-MM-DDTHH:MM:SS.mmmZ". from: search after this offset; *next: after the line. */
static int64_t pb_log_ms(const char *log, size_t from, const char *needle, size_t *next)
{
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
    if (env.ready)
        return true;
    char exe[1024];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return false;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    *slash = '\0';
    snprintf(env.bin, sizeof env.bin, "%s", exe);
    const char *src = getenv("FUSION_SOURCE_DIR");
    snprintf(env.data, sizeof env.data, "%s/deploy/data/shakespeare.txt", src ? src : FU_SOURCE_DIR);
    if (!fu_path_exists(env.data)) {
        fprintf(stderr, "bench-pipeline: no training text at %s (set FUSION_SOURCE_DIR)\n", env.data);
        return false;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(env.dir, sizeof env.dir, "%s/fusion-bench-pipeline-XXXXXX", tmp ? tmp : "/tmp");
    if (!mkdtemp(env.dir))
        return false;
    const char *margs;
    if (bench_quick()) {
        margs = "--layers 6 --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 256 --seed 3";
        env.hidden = 256, env.batch = 4, env.seq = 16, env.steps = 30;
    } else {
        margs = "--layers 8 --hidden 512 --heads 8 --kv-heads 4 --ffn 1376 --vocab 512 --seed 3";
        env.hidden = 512, env.batch = 4, env.seq = 64, env.steps = 24;
    }
    snprintf(env.model, sizeof env.model, "%s/model", env.dir);
    snprintf(env.train, sizeof env.train, "--rank 8 --alpha 16 --lr 0.01 --seed 7 --batch %d --seq-len %d --steps %d",
             env.batch, env.seq, env.steps);
    char *out = NULL;
    if (pb_sh(&out, "cd '%s' && for k in broker client p0 p1 p2 p3; do '%s/fusion' keygen -o $k >/dev/null || exit 1; "
                    "done && for k in client p0 p1 p2 p3; do grep -v '^#' $k/public.key; done > allow && "
                    "'%s/fusion' model init -o model %s 2>&1", env.dir, env.bin, env.bin, margs) != 0) {
        fprintf(stderr, "bench-pipeline: setup failed: %s\n", out);
        free(out);
        return false;
    }
    free(out);
    env.ready = true;
    return true;
}

__attribute__((destructor)) static void pb_cleanup(void)
{
    if (env.ready && !getenv("FUSION_BENCH_KEEP"))
        (void)pb_sh(NULL, "rm -rf '%s'", env.dir);
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

static bool pb_start(pb_cluster *c, const char *tag, int n_peers, int backups, double cap_gb)
{
    memset(c, 0, sizeof *c);
    c->n = n_peers;
    snprintf(c->log, sizeof c->log, "%s/%s-broker.log", env.dir, tag);
    snprintf(c->conf, sizeof c->conf, "%s/%s-client.conf", env.dir, tag);
    char keys[1100], db[1100], allow[1100], bk[16];
    snprintf(keys, sizeof keys, "%s/broker", env.dir);
    snprintf(db, sizeof db, "%s/%s.db", env.dir, tag);
    snprintf(allow, sizeof allow, "%s/allow", env.dir);
    snprintf(bk, sizeof bk, "%d", backups);
    char prog[1100];
    snprintf(prog, sizeof prog, "%s/fusion-broker", env.bin);
    char *bargv[] = {prog, "--bind", "tcp://127.0.0.1:*", "--keys", keys, "--db", db, "--allow", allow,
                     "--backups", bk, NULL};
    c->broker = pb_spawn(c->log, bargv);
    if (!pb_wait_file(c->log, "listening on ", 15000))
        return false;
    char *bl = pb_slurp(c->log);
    const char *at = strstr(bl, "listening on ");
    sscanf(at + 13, "%127s", c->endpoint);
    free(bl);
    FILE *f = fopen(c->conf, "w");
    if (!f)
        return false;
    fprintf(f, "broker = %s\nbroker-key = %s/broker/public.key\nkeys = %s/client\n", c->endpoint, env.dir, env.dir);
    fclose(f);
    for (int i = 0; i < n_peers; i++) {
        char log[1100], pk[1100], cache[1100], bkey[1100], name[16], cap[32];
        snprintf(log, sizeof log, "%s/%s-p%d.log", env.dir, tag, i);
        snprintf(pk, sizeof pk, "%s/p%d", env.dir, i);
        snprintf(cache, sizeof cache, "%s/cache%d", env.dir, i);
        snprintf(bkey, sizeof bkey, "%s/broker/public.key", env.dir);
        snprintf(name, sizeof name, "p%d", i);
        snprintf(cap, sizeof cap, "%.5f", cap_gb);
        snprintf(prog, sizeof prog, "%s/fusion-peer", env.bin);
        char *pargv[] = {prog, "--broker", c->endpoint, "--broker-key", bkey, "--keys", pk, "--data-bind",
                         "tcp://127.0.0.1:*", "--cache", cache, "--threads", "1", "--name", name,
                         "--drain-timeout", "10", cap_gb > 0 ? "--max-memory" : NULL, cap, NULL};
        c->peers[i] = pb_spawn(log, pargv);
    }
    for (int i = 0; i < n_peers; i++) {
        char needle[32];
        snprintf(needle, sizeof needle, "(p%d) joined", i);
        if (!pb_wait_file(c->log, needle, 30000))
            return false;
    }
    return true;
}

static void pb_stop(pb_cluster *c)
{
    for (int i = 0; i < c->n; i++)
        if (c->peers[i] > 0)
            kill(c->peers[i], SIGTERM);
    for (int i = 0; i < c->n; i++)
        if (c->peers[i] > 0)
            pb_reap(c->peers[i], 15000);
    if (c->broker > 0) {
        kill(c->broker, SIGTERM);
        pb_reap(c->broker, 10000);
    }
    memset(c, 0, sizeof *c);
}

static int pb_fusion(const pb_cluster *c, char **out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool pb_submit(const pb_cluster *c, char id[17], const char *train, const char *extra);

/* Asks the broker what the whole job needs: one peer offering 30 MiB (less than any stage) leaves the
 * job queued with "all of it needs about N MiB" in the log. */
static bool pb_probe_need(void)
{
    if (env.need_mib > 0)
        return true;
    pb_cluster c;
    bool ok = pb_start(&c, "probe", 1, 0, 30.0 / 1024.0);
    char id[17];
    ok = ok && pb_submit(&c, id, env.train, "");
    ok = ok && pb_wait_file(c.log, "all of it needs about ", 20000);
    if (ok) {
        char *bl = pb_slurp(c.log);
        const char *at = strstr(bl, "all of it needs about ");
        env.need_mib = strtod(at + 22, NULL);
        free(bl);
        (void)pb_fusion(&c, NULL, "cancel %s >/dev/null 2>&1", id);
    }
    pb_stop(&c);
    if (!(env.need_mib > PB_OVERHEAD_MIB)) {
        fprintf(stderr, "bench-pipeline: could not read the job's memory estimate from the broker (logs in %s)\n",
                env.dir);
        return false;
    }
    return true;
}
static int pb_fusion(const pb_cluster *c, char **out, const char *fmt, ...)
{
    char args[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    return pb_sh(out, "cd '%s' && FUSION_CONFIG='%s' '%s/fusion' %s", env.dir, c->conf, env.bin, args);
}

/* Submits the fine-tune (with extra options); the id in id[17]. */
static bool pb_submit(const pb_cluster *c, char id[17], const char *train, const char *extra)
{
    char *out = NULL;
    int rc = pb_fusion(c, &out, "submit finetune --model '%s' --data '%s' %s %s -q 2>/dev/null", env.model, env.data,
                       train, extra);
    bool ok = rc == 0 && sscanf(out, "%16s", id) == 1 && strlen(id) == 16;
    free(out);
    return ok;
}

/* Steps done and state of a job, from `fusion status --json`. */
static long pb_step(const pb_cluster *c, const char *id, char *state, size_t cap)
{
    char *out = NULL;
    long step = -1;
    state[0] = '\0';
    if (pb_fusion(c, &out, "status %s --json 2>/dev/null", id) == 0) {
        cJSON *j = cJSON_Parse(out);
        const cJSON *s = cJSON_GetObjectItem(j, "step"), *t = cJSON_GetObjectItem(j, "state");
        if (cJSON_IsNumber(s))
            step = (long)s->valuedouble;
        if (cJSON_IsString(t))
            snprintf(state, cap, "%s", t->valuestring);
        cJSON_Delete(j);
    }
    free(out);
    return step;
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
    int rc = pb_sh(&out, "cd '%s' && '%s/fusion' run finetune --threads 1 --model '%s' --data '%s' %s -o run-adapter 2>&1",
                   env.dir, env.bin, env.model, env.data, env.train);
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
    pb_cluster c;
    char tag[16];
    snprintf(tag, sizeof tag, "ft%d", n);
    if (!pb_start(&c, tag, n, 0, pb_cap_gb(n))) {
        fprintf(stderr, "bench-pipeline: the %d-peer cluster did not start (logs in %s)\n", n, env.dir);
        pb_stop(&c);
        return;
    }
    char id[17];
    double t0 = fu_clock_sec();
    if (!pb_submit(&c, id, env.train, "--checkpoint-every 1000")) {
        fprintf(stderr, "bench-pipeline: submit failed\n");
        pb_stop(&c);
        return;
    }
    char *out = NULL;
    int rc = pb_fusion(&c, &out, "wait %s -q --wait-timeout 600 >/dev/null 2>&1", id);
    double wall = fu_clock_sec() - t0;
    free(out);
    char *bl = pb_slurp(c.log);
    char needle[96];
    snprintf(needle, sizeof needle, "job %s: every stage is ready; started at step 0", id);
    size_t after = 0;
    int64_t t_start = pb_log_ms(bl, 0, needle, &after);
    snprintf(needle, sizeof needle, "job %s done", id);
    int64_t t_done = pb_log_ms(bl, after, needle, NULL);
    int stages = 0;
    for (int s = 1; s <= PB_MAX_PEERS; s++) {
        snprintf(needle, sizeof needle, "job %s stage 0/%d on", id, s);
        if (strstr(bl, needle))
            stages = s;
    }
    free(bl);
    if (rc != 0 || t_start < 0 || t_done < t_start) {
        fprintf(stderr, "bench-pipeline: the %d-peer job did not finish (logs in %s)\n", n, env.dir);
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

/* A three-stage job (a longer one, to kill mid-way) on four peers, one backup, the default
 * heartbeat; the job is cancelled once the measurement is taken. */
BENCH_CASE(pipeline_recovery)
{
    if (!pb_setup() || !pb_probe_need())
        return;
    pb_cluster c;
    if (!pb_start(&c, "rec", 4, 1, pb_cap_gb(3))) {
        fprintf(stderr, "bench-pipeline: the recovery cluster did not start (logs in %s)\n", env.dir);
        pb_stop(&c);
        return;
    }
    char id[17], train[256];
    long kill_at = bench_quick() ? 12 : 7; /* past the checkpoint at 10 (5) */
    snprintf(train, sizeof train, "--rank 8 --alpha 16 --lr 0.01 --seed 7 --batch %d --seq-len %d --steps %d", env.batch,
             env.seq, bench_quick() ? 400 : 60);
    if (!pb_submit(&c, id, train, bench_quick() ? "--checkpoint-every 10" : "--checkpoint-every 5")) {
        pb_stop(&c);
        return;
    }
    /* wait until a checkpoint is behind the job, then kill stage 1's peer */
    char state[16], needle[96];
    long step = -1;
    uint64_t end = fu_clock_ms() + 600000;
    while ((step = pb_step(&c, id, state, sizeof state)) < kill_at && fu_clock_ms() < end && strcmp(state, "done") != 0)
        fu_sleep_ms(20);
    char *bl = pb_slurp(c.log);
    snprintf(needle, sizeof needle, "job %s stage 1/3 on ", id);
    const char *at = strstr(bl, needle);
    const char *pn = at ? strstr(at, "(p") : NULL;
    int victim = pn ? pn[2] - '0' : -1;
    free(bl);
    if (victim < 0 || victim >= 4 || strcmp(state, "running") != 0) {
        fprintf(stderr, "bench-pipeline: recovery: no three-stage running job to interrupt (%s, step %ld)\n", state,
                step);
        pb_stop(&c);
        return;
    }
    int64_t t_kill = fu_wallclock_ms();
    kill(c.peers[victim], SIGKILL);
    waitpid(c.peers[victim], NULL, 0);
    c.peers[victim] = 0;
    long at_kill = step;
    uint64_t t0 = fu_clock_ms();
    double t_past = -1;
    end = t0 + 300000;
    while (fu_clock_ms() < end) {
        long s = pb_step(&c, id, state, sizeof state);
        if (strcmp(state, "done") == 0 || s > at_kill + 1) {
            t_past = (double)(fu_clock_ms() - t0);
            break;
        }
        fu_sleep_ms(20);
    }
    bl = pb_slurp(c.log);
    snprintf(needle, sizeof needle, "job %s: stage 1 moved from", id);
    size_t after = 0;
    int64_t t_moved = pb_log_ms(bl, 0, needle, &after);
    snprintf(needle, sizeof needle, "job %s: every stage is ready; started at step", id);
    int64_t t_ready = t_moved > 0 ? pb_log_ms(bl, after, needle, NULL) : -1;
    long resumed_from = -1;
    const char *r = t_moved > 0 ? strstr(bl + after, "resuming from step ") : NULL;
    if (r)
        resumed_from = strtol(r + 19, NULL, 10);
    free(bl);
    bench_emit("pipeline", "recovery",
               "\"signal\":\"SIGKILL\",\"stage\":1,\"stages\":3,\"heartbeat_ms\":1000,\"step_at_kill\":%ld,"
               "\"resumed_from\":%ld,\"moved_ms\":%lld,\"all_ready_ms\":%lld,\"past_kill_step_ms\":%.0f",
               at_kill, resumed_from, t_moved > 0 ? (long long)(t_moved - t_kill) : -1LL,
               t_ready > 0 ? (long long)(t_ready - t_kill) : -1LL, t_past);
    (void)pb_fusion(&c, NULL, "cancel %s >/dev/null 2>&1", id);
    pb_stop(&c);
}
