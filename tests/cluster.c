/* The test cluster (cluster.h): real fusion processes on loopback for the process tests and
 * bench-pipeline. */
#include "cluster.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <math.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <sodium.h>

#include "fu_clock.h"
#include "fu_file.h"
#include "fu_safetensors.h"
#include "testutil.h"
#include "wire_keys.h"

#define TU_MAX_CHILDREN   64    /* processes started and not reaped yet */
#define TU_MAX_LIVE       4     /* clusters made and not stopped yet */
#define TU_JOIN_MS        30000 /* tu_cluster_start: how long each peer may take to join */
#define TU_LISTEN_MS      15000 /* tu_broker_start: how long the broker may take to listen */
#define TU_PEER_STOP_MS   20000 /* tu_cluster_stop: a peer's drain and clean leave */
#define TU_BROKER_STOP_MS 5000  /* tu_cluster_stop: the broker's clean stop */
#define TU_SIGNAL_STOP_MS 15000 /* tu_broker_stop */
#define TU_MAX_LOG        ((size_t)256 << 20)

struct tu_cluster {
    tu_opts o;                    /* as given (its strings borrowed: they must outlive the cluster's starts) */
    char dir[1024];               /* scratch directory: keys, model, store, logs */
    char data[TU_PATH];           /* training text */
    char conf[TU_PATH];           /* client configuration file */
    char endpoint[128];           /* the broker's control endpoint, "" before its first start */
    char broker_log[TU_PATH];     /* the current broker's log */
    pid_t broker;                 /* 0 when not running */
    int broker_starts;            /* broker logs are broker.log, broker-2.log, ... */
    char broker_args[512];        /* more fusion-broker arguments, space-separated (tu_broker_args) */
    char gw_bind[128];            /* the broker's gateway endpoint, "" before its first start */
    struct {
        char endpoint[128];       /* where its peers connect, "" before its first start */
        char log[TU_PATH];        /* its current log */
        pid_t pid;                /* 0 when not running */
        int starts;               /* its logs are gwK.log, gwK-2.log, ... */
    } gw[TU_MAX_GATEWAYS];
    pid_t peers[TU_MAX_PEERS];    /* 0 when not running */
    bool stopped[TU_MAX_PEERS];   /* SIGSTOPped (needs SIGCONT before it can die) */
};

/* What tu_teardown needs, in static memory: a failed test's own frame is gone by then. */
static pid_t tu_children[TU_MAX_CHILDREN]; /* started and not reaped (0: free slot) */
static tu_cluster *tu_live[TU_MAX_LIVE];   /* made and not stopped (NULL: free slot) */
static bool tu_exits;                      /* tu_fail_exits was called */

/* ---- failures ---------------------------------------------------------------------------------- */

void tu_fail_exits(void)
{
    tu_exits = true;
}

void tu_fail(const char *fmt, ...)
{
    char msg[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fflush(stdout);
    if (tu_exits) {
        fprintf(stderr, "%s\n", msg);
        exit(1);
    }
    fail_msg("%s", msg);
    abort(); /* not reached: fail_msg leaves the test */
}

/* ---- processes ----------------------------------------------------------------------------------- */

static void child_add(pid_t pid)
{
    for (int i = 0; i < TU_MAX_CHILDREN; i++)
        if (tu_children[i] == 0) {
            tu_children[i] = pid;
            return;
        }
}

static void child_gone(pid_t pid)
{
    for (int i = 0; i < TU_MAX_CHILDREN; i++)
        if (tu_children[i] == pid)
            tu_children[i] = 0;
}

/* tu_spawn, with stdout on out_fd when it is not -1. */
static pid_t spawn(const char *log, int out_fd, char *const argv[], const char *env)
{
    pid_t parent = getpid();
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        tu_fail("fork for %s failed", argv[0]);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) /* the test died before prctl took effect */
            _exit(127);
        if (env)
            putenv((char *)env);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(out_fd >= 0 ? out_fd : fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    child_add(pid);
    return pid;
}

pid_t tu_spawn(const char *log, char *const argv[], const char *env)
{
    return spawn(log, -1, argv, env);
}

pid_t tu_spawn_piped(const char *log, char *const argv[], int out_fd)
{
    return spawn(log, out_fd, argv, NULL);
}

int tu_reap(pid_t pid, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            child_gone(pid);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        if (r < 0) {
            child_gone(pid);
            return -2;
        }
        if (fu_clock_ms() >= end)
            break;
        fu_sleep_ms(10);
    }
    kill(pid, SIGCONT);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    child_gone(pid);
    return -1;
}

/* ---- files and directories ------------------------------------------------------------------------ */

char *tu_dir_new(const char *tag)
{
    char *d = tu_tmpdir(tag);
    if (!d)
        tu_fail("cannot make a scratch directory for %s under $TMPDIR", tag);
    return d;
}

void tu_dir_remove(const char *dir)
{
    char *out = NULL;
    (void)tu_sh(&out, "rm -rf '%s'", dir);
    free(out);
}

char *tu_file_text(const char *path)
{
    char *d = NULL;
    size_t n = 0;
    if (fu_file_read_all(path, TU_MAX_LOG, &d, &n, NULL) != FU_OK)
        return strdup("");
    return d;
}

bool tu_file_wait(const char *path, const char *needle, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        char *d = tu_file_text(path);
        bool ok = strstr(d, needle) != NULL;
        free(d);
        if (ok)
            return true;
        if (fu_clock_ms() >= end)
            return false;
        fu_sleep_ms(20);
    }
}

void tu_file_write_private(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        tu_fail("cannot create %s: %s", path, strerror(errno));
    size_t len = strlen(text);
    bool ok = write(fd, text, len) == (ssize_t)len && write(fd, "\n", 1) == 1;
    close(fd);
    if (!ok)
        tu_fail("cannot write %s", path);
}

void tu_file_show(const char *path, int lines)
{
    char *out = NULL;
    (void)tu_sh(&out, "tail -n %d '%s'", lines, path);
    printf("---- %s ----\n%s\n", path, out ? out : "");
    fflush(stdout);
    free(out);
}

static void vformat(char *out, size_t cap, const char *fmt, va_list ap) __attribute__((format(printf, 3, 0)));
static void vformat(char *out, size_t cap, const char *fmt, va_list ap)
{
    if (vsnprintf(out, cap, fmt, ap) >= (int)cap)
        tu_fail("text too long for the test harness: %.80s...", out);
}

/* The array out = the calling function's fmt, ... (fmt its last named parameter). */
#define FORMAT_ARGS(out, fmt)                  \
    do {                                       \
        va_list ap_;                           \
        va_start(ap_, fmt);                    \
        vformat(out, sizeof(out), fmt, ap_);   \
        va_end(ap_);                           \
    } while (0)

void tu_path(const tu_cluster *c, char out[TU_PATH], const char *fmt, ...)
{
    char rel[2048];
    FORMAT_ARGS(rel, fmt);
    snprintf(out, TU_PATH, "%s/%s", c->dir, rel);
}

tu_opts *tu_cluster_opts(tu_cluster *c)
{
    return &c->o;
}

const char *tu_cluster_dir(const tu_cluster *c)
{
    return c->dir;
}

const char *tu_cluster_data(const tu_cluster *c)
{
    return c->data;
}

int tu_cluster_n_peers(const tu_cluster *c)
{
    return c->o.n_peers;
}

void tu_cluster_show_logs(const tu_cluster *c)
{
    tu_file_show(c->broker_log, 40);
    for (int i = 0; i < c->o.n_peers; i++) {
        char p[TU_PATH];
        tu_path(c, p, "p%d.log", i);
        tu_file_show(p, 15);
    }
}

/* ---- keys ---------------------------------------------------------------------------------------- */

void tu_keygen(tu_cluster *c, const char *name, bool allowed)
{
    char path[TU_PATH];
    tu_path(c, path, "%s", name);
    fu_errmsg em = {{0}};
    wire_keypair_t *kp = wire_keypair_generate();
    if (!kp || wire_keypair_save(kp, path, false, &em) != FU_OK)
        tu_fail("key pair %s: %s", path, fu_errmsg_text(&em, FU_ENOMEM));
    if (allowed) {
        char allow[TU_PATH];
        tu_path(c, allow, "allow");
        FILE *f = fopen(allow, "a");
        if (!f)
            tu_fail("cannot append to %s", allow);
        fprintf(f, "%s\n", wire_keypair_public_z85(kp));
        fclose(f);
    }
    wire_keypair_destroy(&kp);
}

void tu_key_public(const tu_cluster *c, const char *name, char z85[41])
{
    char path[TU_PATH];
    tu_path(c, path, "%s/" WIRE_PUBLIC_KEY_FILE, name);
    uint8_t key[WIRE_KEY_BYTES];
    fu_errmsg em = {{0}};
    if (wire_key_load_public(path, key, &em) != FU_OK)
        tu_fail("%s: %s", path, fu_errmsg_text(&em, FU_EIO));
    wire_key_to_z85(key, z85);
}

void tu_allow_roles(tu_cluster *c, const char *name, const char *roles)
{
    char allow[TU_PATH], key[41];
    tu_path(c, allow, "allow");
    tu_key_public(c, name, key);
    char *text = tu_file_text(allow);
    FILE *f = fopen(allow, "w");
    if (!f)
        tu_fail("cannot write %s", allow);
    bool found = false;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        bool mine = strncmp(line, key, 40) == 0 && (line[40] == '\0' || line[40] == ' ');
        fprintf(f, "%s%s%s\n", mine ? key : line, mine ? " " : "", mine ? roles : "");
        found = found || mine;
    }
    fclose(f);
    free(text);
    if (!found)
        tu_fail("key %s is not on the allow-list %s", name, allow);
}

/* ---- the cluster's options ------------------------------------------------------------------------- */

tu_opts tu_opts_default(int n_peers)
{
    tu_opts o = {
        .n_peers = n_peers,
        .model_args = TU_MODEL_ARGS,
        .peer_memory_gb = TU_PEER_MEMORY_GB,
        .link_mbps = TU_LINK_MBPS,
        .priority = "normal",
    };
    return o;
}

tu_opts tu_opts_two_stage(int n_peers, int backups)
{
    tu_opts o = tu_opts_default(n_peers);
    o.backups = backups;
    o.heartbeat_ms = 300;
    o.peer_memory_gb = TU_TWO_STAGE_MEMORY_GB;
    o.model_args = TU_TWO_STAGE_MODEL_ARGS;
    o.word_data = true;
    return o;
}

tu_opts tu_opts_broker_alone(void)
{
    tu_opts o = tu_opts_default(0);
    o.backups = 1;
    o.log_level = "debug";
    o.model_args = TU_SMALL_MODEL_ARGS;
    /* The tests' own peers run their steps on their own clock and expect the plan they were given:
     * no growth (a peer that passes its challenge late would be taken in at the first checkpoint),
     * and every peer that lowers the slowest stage, as these tests were written for. */
    o.grow_margin = "0";
    return o;
}

/* ---- making a cluster ------------------------------------------------------------------------------ */

static void live_add(tu_cluster *c)
{
    for (int i = 0; i < TU_MAX_LIVE; i++)
        if (!tu_live[i]) {
            tu_live[i] = c;
            return;
        }
    tu_fail("more than %d test clusters at once", TU_MAX_LIVE);
}

static void live_remove(const tu_cluster *c)
{
    for (int i = 0; i < TU_MAX_LIVE; i++)
        if (tu_live[i] == c)
            tu_live[i] = NULL;
}

/* DIR/data.txt: TU_WORDS words of a deterministic stream. */
static void write_word_data(tu_cluster *c)
{
    static const char *words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs",
                                  "far", "away", "into", "forest", "river", "stone"};
    tu_path(c, c->data, "data.txt");
    FILE *f = fopen(c->data, "w");
    if (!f)
        tu_fail("cannot write %s", c->data);
    uint32_t x = 12345;
    for (int i = 0; i < TU_WORDS; i++) {
        x = x * 1103515245u + 12345u;
        fprintf(f, "%s%c", words[(x >> 16) % 16], i % 13 == 12 ? '\n' : ' ');
    }
    fclose(f);
}

tu_cluster *tu_cluster_new(const char *tag, const tu_opts *opts)
{
#ifndef FUSION_TEST_HOOKS
    if (opts->stall || opts->corrupt_mode || opts->verify_late)
        skip(); /* a build without test hooks has no fault hooks (peer/peer_faults.h) */
#endif
    if (opts->n_peers < 0 || opts->n_peers > TU_MAX_PEERS)
        tu_fail("a test cluster has 0 to %d peers, not %d", TU_MAX_PEERS, opts->n_peers);
    if (sodium_init() < 0)
        tu_fail("libsodium did not initialise");
    char *d = tu_dir_new(tag);
    tu_cluster *c = calloc(1, sizeof *c);
    if (!c)
        tu_fail("out of memory");
    c->o = *opts;
    snprintf(c->dir, sizeof c->dir, "%s", d);
    free(d);
    live_add(c);
    tu_path(c, c->conf, "client.conf");
    if (c->o.word_data) {
        write_word_data(c);
    } else {
        const char *src = getenv("FUSION_SOURCE_DIR");
        snprintf(c->data, sizeof c->data, "%s/deploy/data/shakespeare.txt", src ? src : "..");
        if (!fu_path_exists(c->data))
            tu_fail("no training text at %s (set FUSION_SOURCE_DIR)", c->data);
    }
    char allow[TU_PATH];
    tu_path(c, allow, "allow");
    FILE *f = fopen(allow, "w");
    if (!f)
        tu_fail("cannot write %s", allow);
    fclose(f);
    tu_keygen(c, "broker", false);
    tu_keygen(c, "client", true);
    if (c->o.gateways < 0 || c->o.gateways > TU_MAX_GATEWAYS)
        tu_fail("tu_cluster_new: %d gateways (at most %d)", c->o.gateways, TU_MAX_GATEWAYS);
    for (int k = 0; k < c->o.gateways; k++) {
        char name[16];
        snprintf(name, sizeof name, "gw%d", k);
        tu_keygen(c, name, true);
        tu_allow_roles(c, name, "gateway");
    }
    for (int i = 0; i < c->o.n_peers; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        tu_keygen(c, name, !c->o.peers_unlisted);
    }
    if (c->o.model_args) {
        char *out = NULL;
        int rc = tu_sh(&out, "cd '%s' && '%s' model init -o model %s", c->dir, tu_bin("fusion"), c->o.model_args);
        if (rc != 0)
            tu_fail("fusion model init %s: exit %d: %s", c->o.model_args, rc, out ? out : "");
        free(out);
    }
    return c;
}

/* Whether the broker's log says peer pI's profile challenge ended ("peer pI (KEY): claimed ...
 * plans use ...", or "... failed its profile challenge") within timeout_ms. */
bool tu_peer_profile_checked(const tu_cluster *c, const char *name, int timeout_ms)
{
    char needle[96];
    snprintf(needle, sizeof needle, "peer %s (", name);
    for (uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;; fu_sleep_ms(20)) {
        char *log = tu_broker_log_text(c);
        bool done = false;
        for (const char *at = log; !done && (at = strstr(at, needle)) != NULL; at++) {
            const char *nl = strchr(at, '\n');
            const char *a = strstr(at, "plans use"), *b = strstr(at, "failed its profile challenge");
            done = (a && (!nl || a < nl)) || (b && (!nl || b < nl));
        }
        free(log);
        if (done)
            return true;
        if (fu_clock_ms() >= end)
            return false;
    }
}

void tu_cluster_start(tu_cluster *c)
{
    tu_broker_start(c);
    for (int k = 0; k < c->o.gateways; k++)
        tu_gateway_start(c, k);
    for (int i = 0; i < c->o.n_peers; i++)
        tu_peer_start(c, i, NULL);
    for (int i = 0; i < c->o.n_peers; i++)
        tu_peer_wait_joined(c, i, TU_JOIN_MS);
    /* and until each has its profile checked ("peer pI (KEY): claimed ... plans use ..."): a job
     * submitted before is planned over the peers checked so far (seen under CI load: two of three) */
    for (int i = 0; i < c->o.n_peers; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        if (!tu_peer_profile_checked(c, name, TU_JOIN_MS)) {
            tu_cluster_show_logs(c);
            tu_fail("peer p%d's profile was not checked within %d ms", i, TU_JOIN_MS);
        }
    }
}

/* Whether one of the broker's logs holds a sanitizer report or a bug the broker noticed in itself
 * (an unexpected job phase change, broker_job.c), printed from there. */
static bool broker_log_alarm(const tu_cluster *c)
{
    static const char *const alarms[] = {"Sanitizer", "runtime error", "unexpected phase change"};
    for (int k = 1; k <= c->broker_starts; k++) {
        char log[TU_PATH];
        if (k == 1)
            tu_path(c, log, "broker.log");
        else
            tu_path(c, log, "broker-%d.log", k);
        char *text = tu_file_text(log);
        const char *at = NULL;
        for (size_t a = 0; a < sizeof alarms / sizeof alarms[0]; a++) {
            const char *hit = strstr(text, alarms[a]);
            if (hit && (!at || hit < at))
                at = hit;
        }
        if (at)
            printf("---- alarm in %s ----\n%.6000s\n", log, at);
        free(text);
        if (at)
            return true;
    }
    return false;
}

fu_err tu_cluster_stop(tu_cluster **c_p)
{
    tu_cluster *c = *c_p;
    if (!c)
        return FU_OK;
    for (int i = 0; i < c->o.n_peers; i++)
        if (c->peers[i] > 0) {
            if (c->stopped[i])
                kill(c->peers[i], SIGCONT);
            kill(c->peers[i], SIGTERM);
        }
    int bad = 0;
    for (int i = 0; i < c->o.n_peers; i++)
        if (c->peers[i] > 0) {
            int code = tu_reap(c->peers[i], TU_PEER_STOP_MS);
            c->peers[i] = 0;
            if (code != 0) {
                char p[TU_PATH];
                tu_path(c, p, "p%d.log", i);
                tu_file_show(p, 20);
                printf("peer p%d exited %d after SIGTERM\n", i, code);
                bad++;
            }
        }
    for (int k = 0; k < c->o.gateways; k++)
        if (c->gw[k].pid > 0) {
            kill(c->gw[k].pid, SIGTERM);
            int code = tu_reap(c->gw[k].pid, TU_BROKER_STOP_MS);
            c->gw[k].pid = 0;
            if (code != 0) {
                tu_file_show(c->gw[k].log, 20);
                printf("gateway gw%d exited %d after SIGTERM\n", k, code);
                bad++;
            }
        }
    if (c->broker > 0) {
        kill(c->broker, SIGTERM);
        int code = tu_reap(c->broker, TU_BROKER_STOP_MS);
        c->broker = 0;
        if (code != 0) {
            tu_file_show(c->broker_log, 20);
            printf("the broker exited %d after SIGTERM (%s)\n", code,
                   code == -1 ? "still running 5 s after it" : "a clean stop exits 0");
            bad++;
        }
    }
    bad += broker_log_alarm(c);
    if (bad == 0 && !getenv("FUSION_TEST_KEEP")) /* FUSION_TEST_KEEP=1 keeps the logs of a passing test */
        tu_dir_remove(c->dir);
    else
        printf("logs kept in %s\n", c->dir);
    fflush(stdout);
    live_remove(c);
    free(c);
    *c_p = NULL;
    return bad == 0 ? FU_OK : FU_EIO;
}

/* ---- the broker ------------------------------------------------------------------------------------ */

/* DIR/client.conf: the client's broker, broker key and keys. */
static void write_client_conf(const tu_cluster *c)
{
    FILE *f = fopen(c->conf, "w");
    if (!f)
        tu_fail("cannot write %s", c->conf);
    bool gw = c->gw[0].endpoint[0];
    fprintf(f, "# fusion client configuration (see deploy/fusion.conf.example)\nbroker = %s\n"
               "broker-key = %s/%s/public.key\nkeys = %s/client\n", gw ? c->gw[0].endpoint : c->endpoint, c->dir,
            gw ? "gw0" : "broker", c->dir);
    fclose(f);
}

/* Appends "name value" to argv (n entries so far) when value is not NULL. */
static void add_option(char **argv, int *n, const char *name, const char *value)
{
    if (value) {
        argv[(*n)++] = (char *)name;
        argv[(*n)++] = (char *)value;
    }
}

/* The text of a number option, or NULL (the program's default) when it is 0. */
static const char *number_option(char buf[16], int value)
{
    snprintf(buf, 16, "%d", value);
    return value ? buf : NULL;
}

void tu_broker_start(tu_cluster *c)
{
    char keys[TU_PATH], db[TU_PATH], allow[TU_PATH], bind[128], backups[16], hb[16], rt[16], st[16], pg[16];
    c->broker_starts++;
    if (c->broker_starts == 1)
        tu_path(c, c->broker_log, "broker.log");
    else
        tu_path(c, c->broker_log, "broker-%d.log", c->broker_starts);
    tu_path(c, keys, "broker");
    tu_path(c, db, "store.db");
    tu_path(c, allow, "allow");
    snprintf(bind, sizeof bind, "%s", c->endpoint[0] ? c->endpoint : "tcp://127.0.0.1:*");
    snprintf(backups, sizeof backups, "%d", c->o.backups);
    snprintf(hb, sizeof hb, "%d", c->o.heartbeat_ms > 0 ? c->o.heartbeat_ms : 1000);
    char prog[TU_PATH];
    snprintf(prog, sizeof prog, "%s", tu_bin("fusion-broker"));
    char *argv[48] = {prog, "--bind", bind, "--keys", keys, "--db", db, "--allow", allow, "--backups", backups,
                      "--heartbeat-ms", hb};
    int n = 13;
    add_option(argv, &n, "--ready-timeout", number_option(rt, c->o.ready_timeout_s));
    add_option(argv, &n, "--step-timeout", number_option(st, c->o.step_timeout_s));
    add_option(argv, &n, "--pause-grace", number_option(pg, c->o.pause_grace_s));
    char chm[24]; /* a short challenge: the tests' peers claim tens of GFLOP/s */
    snprintf(chm, sizeof chm, "%d", c->o.challenge_ms > 0 ? c->o.challenge_ms : c->o.challenge_ms < 0 ? 0 : 20);
    add_option(argv, &n, "--challenge-ms", chm);
    char roots[2 * TU_PATH + 2];
    snprintf(roots, sizeof roots, "%s%s%s", c->dir, c->o.model_root ? ":" : "", c->o.model_root ? c->o.model_root : "");
    add_option(argv, &n, "--model-root", roots);
    char token_file[TU_PATH]; /* the token in a 0600 file, not on the command line (ps shows that) */
    if (c->o.enrol_token) {
        tu_path(c, token_file, "enrol.token");
        tu_file_write_private(token_file, c->o.enrol_token);
        add_option(argv, &n, "--enrol-token-file", token_file);
    }
    add_option(argv, &n, "--log-level", c->o.log_level);
    add_option(argv, &n, "--grow-margin", c->o.grow_margin);
    char gw_bind[128];
    snprintf(gw_bind, sizeof gw_bind, "%s", c->gw_bind[0] ? c->gw_bind : "tcp://127.0.0.1:*");
    add_option(argv, &n, "--gateway-bind", c->o.gateways ? gw_bind : NULL);
    char extra[sizeof c->broker_args];
    snprintf(extra, sizeof extra, "%s", c->broker_args);
    for (char *save = NULL, *a = strtok_r(extra, " ", &save); a && n < 46; a = strtok_r(NULL, " ", &save))
        argv[n++] = a;
    argv[n] = NULL;
    c->broker = tu_spawn(c->broker_log, argv, NULL);
    if (!tu_file_wait(c->broker_log, "listening on ", TU_LISTEN_MS)) {
        tu_file_show(c->broker_log, 30);
        tu_fail("the broker did not start (no \"listening on\" in %s within %d ms)", c->broker_log, TU_LISTEN_MS);
    }
    if (!c->endpoint[0]) {
        char *bl = tu_file_text(c->broker_log);
        const char *at = strstr(bl, "listening on ");
        if (!at || sscanf(at + 13, "%127s", c->endpoint) != 1)
            tu_fail("cannot read the broker's endpoint from %s", c->broker_log);
        free(bl);
        write_client_conf(c);
    }
    if (c->o.gateways && !c->gw_bind[0]) {
        char *bl = tu_file_text(c->broker_log);
        const char *at = strstr(bl, "listening for gateways on ");
        if (!at || sscanf(at + 26, "%127s", c->gw_bind) != 1)
            tu_fail("cannot read the broker's gateway endpoint from %s", c->broker_log);
        free(bl);
    }
}

static void check_gateway(const tu_cluster *c, int k)
{
    if (k < 0 || k >= c->o.gateways || !c->gw_bind[0])
        tu_fail("no gateway gw%d in a cluster of %d (or its broker never started)", k, c->o.gateways);
}

void tu_gateway_start(tu_cluster *c, int k)
{
    check_gateway(c, k);
    if (++c->gw[k].starts == 1)
        tu_path(c, c->gw[k].log, "gw%d.log", k);
    else
        tu_path(c, c->gw[k].log, "gw%d-%d.log", k, c->gw[k].starts);
    char prog[TU_PATH], keys[TU_PATH], bkey[TU_PATH], listen[128];
    snprintf(prog, sizeof prog, "%s", tu_bin("fusion-gateway"));
    tu_path(c, keys, "gw%d", k);
    tu_path(c, bkey, "broker/" WIRE_PUBLIC_KEY_FILE);
    snprintf(listen, sizeof listen, "%s", c->gw[k].endpoint[0] ? c->gw[k].endpoint : "tcp://127.0.0.1:*");
    char *argv[] = {prog, "--listen", listen, "--broker", c->gw_bind, "--broker-key", bkey, "--keys", keys, NULL};
    c->gw[k].pid = tu_spawn(c->gw[k].log, argv, NULL);
    if (!tu_file_wait(c->gw[k].log, "carrying peers from ", TU_LISTEN_MS)) {
        tu_file_show(c->gw[k].log, 30);
        tu_fail("gateway gw%d did not start (no \"carrying peers from\" in %s)", k, c->gw[k].log);
    }
    if (!c->gw[k].endpoint[0]) {
        char *gl = tu_file_text(c->gw[k].log);
        const char *at = strstr(gl, "carrying peers from ");
        if (!at || sscanf(at + 20, "%127s", c->gw[k].endpoint) != 1)
            tu_fail("cannot read gateway gw%d's endpoint from %s", k, c->gw[k].log);
        free(gl);
        if (k == 0)
            write_client_conf(c);
    }
}

int tu_gateway_stop(tu_cluster *c, int k, int sig)
{
    check_gateway(c, k);
    if (c->gw[k].pid <= 0)
        return -2;
    kill(c->gw[k].pid, sig);
    int code = tu_reap(c->gw[k].pid, TU_SIGNAL_STOP_MS);
    c->gw[k].pid = 0;
    return code;
}

pid_t tu_gateway_pid(const tu_cluster *c, int k) { return k >= 0 && k < c->o.gateways ? c->gw[k].pid : 0; }

const char *tu_gateway_endpoint(const tu_cluster *c, int k)
{
    return k >= 0 && k < c->o.gateways ? c->gw[k].endpoint : "";
}

const char *tu_gateway_log(const tu_cluster *c, int k)
{
    return k >= 0 && k < c->o.gateways ? c->gw[k].log : "";
}

void tu_broker_args(tu_cluster *c, const char *args)
{
    if (strlen(args) >= sizeof c->broker_args)
        tu_fail("tu_broker_args: '%s' is too long", args);
    snprintf(c->broker_args, sizeof c->broker_args, "%s", args);
}

pid_t tu_broker_pid(const tu_cluster *c)
{
    return c->broker > 0 ? c->broker : 0;
}

pid_t tu_peer_pid(const tu_cluster *c, int i)
{
    return i >= 0 && i < TU_MAX_PEERS && c->peers[i] > 0 ? c->peers[i] : 0;
}

int tu_broker_stop(tu_cluster *c, int sig)
{
    if (c->broker <= 0)
        return -2;
    kill(c->broker, sig);
    int code = tu_reap(c->broker, TU_SIGNAL_STOP_MS);
    c->broker = 0;
    return code;
}

int tu_broker_connect_raw(const tu_cluster *c)
{
    const char *colon = strrchr(c->endpoint, ':');
    int port = colon ? atoi(colon + 1) : 0;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (port <= 0 || s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) != 0)
        tu_fail("cannot connect to the broker's port (%s)", c->endpoint);
    return s;
}

bool tu_broker_alive(const tu_cluster *c)
{
    return c->broker > 0 && kill(c->broker, 0) == 0;
}

const char *tu_broker_endpoint(const tu_cluster *c)
{
    return c->endpoint;
}

const char *tu_broker_log(const tu_cluster *c)
{
    return c->broker_log;
}

char *tu_broker_log_text(const tu_cluster *c)
{
    return tu_file_text(c->broker_log);
}

bool tu_broker_logged(const tu_cluster *c, const char *fmt, ...)
{
    char needle[1024];
    FORMAT_ARGS(needle, fmt);
    char *bl = tu_broker_log_text(c);
    bool at = strstr(bl, needle) != NULL;
    free(bl);
    return at;
}

bool tu_broker_wait_log(const tu_cluster *c, int timeout_ms, const char *fmt, ...)
{
    char needle[1024];
    FORMAT_ARGS(needle, fmt);
    return tu_file_wait(c->broker_log, needle, timeout_ms);
}

/* ---- the peers ------------------------------------------------------------------------------------- */

static void check_peer(const tu_cluster *c, int i)
{
    if (i < 0 || i >= c->o.n_peers)
        tu_fail("no peer p%d in a cluster of %d", i, c->o.n_peers);
}

void tu_peer_start(tu_cluster *c, int i, ...)
{
    check_peer(c, i);
    char log[TU_PATH], keys[TU_PATH], cache[TU_PATH], bkey[TU_PATH], name[16], prog[TU_PATH];
    tu_path(c, log, "p%d.log", i);
    tu_path(c, keys, "p%d", i);
    tu_path(c, cache, "cache%d", i);
    int gw = c->o.gateways ? i % c->o.gateways : -1; /* the gateway it goes through, -1: none */
    char eps[TU_MAX_GATEWAYS * 128];
    snprintf(eps, sizeof eps, "%s", gw >= 0 ? c->gw[gw].endpoint : c->endpoint);
    if (gw >= 0)
        tu_path(c, bkey, "gw%d/" WIRE_PUBLIC_KEY_FILE, gw);
    else
        tu_path(c, bkey, "broker/" WIRE_PUBLIC_KEY_FILE);
    for (int k = 1; gw >= 0 && c->o.gateway_failover && k < c->o.gateways; k++) { /* the others after it */
        int g = (gw + k) % c->o.gateways;
        char key[TU_PATH];
        tu_path(c, key, "gw%d/" WIRE_PUBLIC_KEY_FILE, g);
        size_t el = strlen(eps), kl = strlen(bkey), en = strlen(c->gw[g].endpoint), kn = strlen(key);
        if (el + 1 + en >= sizeof eps || kl + 1 + kn >= sizeof bkey)
            tu_fail("peer p%d: its gateways' endpoints or keys do not fit a command line", i);
        eps[el] = bkey[kl] = ',';
        memcpy(eps + el + 1, c->gw[g].endpoint, en + 1);
        memcpy(bkey + kl + 1, key, kn + 1);
    }
    snprintf(name, sizeof name, "p%d", i);
    snprintf(prog, sizeof prog, "%s", tu_bin("fusion-peer"));
    char *argv[48] = {prog, "--broker", eps, "--broker-key", bkey, "--keys", keys, "--data-bind",
                      "tcp://127.0.0.1:*", "--cache", cache, "--threads",
                      (char *)(i < 8 && c->o.peer_threads[i] ? c->o.peer_threads[i] : "1"), "--name", name,
                      "--drain-timeout", "15"};
    int n = 17;
    add_option(argv, &n, "--priority", c->o.priority);
    for (int k = 0; k < 8 && c->o.peer_extra[k]; k++)
        argv[n++] = (char *)c->o.peer_extra[k];
    const char *mem = i < 8 && c->o.peer_memory[i] ? c->o.peer_memory[i] : c->o.peer_memory_gb;
    add_option(argv, &n, "--max-memory", mem && mem[0] ? mem : NULL);
    add_option(argv, &n, "--link-mbps", i < 8 && c->o.peer_link[i] ? c->o.peer_link[i] : c->o.link_mbps);
    add_option(argv, &n, "--gflops", i < 8 ? c->o.peer_gflops[i] : NULL);
    va_list ap;
    va_start(ap, i);
    for (const char *a; (a = va_arg(ap, const char *)) != NULL;) {
        if (n >= 46)
            tu_fail("too many arguments for peer p%d", i);
        argv[n++] = (char *)a;
    }
    va_end(ap);
    argv[n] = NULL;
    char env[TU_PATH + 64];
    const char *envp = NULL;
    if (c->o.stall) {
        snprintf(env, sizeof env, "FUSION_TEST_STALL=%s:%s/stall.p%d", c->o.stall, c->dir, i);
        envp = env;
    } else if (c->o.corrupt_mode) {
        snprintf(env, sizeof env, "FUSION_TEST_CORRUPT_OUTPUT=%s:%s/corrupt.p%d", c->o.corrupt_mode, c->dir, i);
        envp = env;
    } else if (c->o.verify_late) {
        snprintf(env, sizeof env, "FUSION_TEST_VERIFY_LATE=1");
        envp = env;
    }
    c->peers[i] = tu_spawn(log, argv, envp);
    c->stopped[i] = false;
}

void tu_peer_wait_joined(const tu_cluster *c, int i, int timeout_ms)
{
    if (!tu_broker_wait_log(c, timeout_ms, "(p%d) joined", i)) {
        tu_cluster_show_logs(c);
        tu_fail("peer p%d did not join within %d ms", i, timeout_ms);
    }
}

void tu_peer_signal(tu_cluster *c, int i, int sig)
{
    check_peer(c, i);
    if (c->peers[i] <= 0 || kill(c->peers[i], sig) != 0)
        tu_fail("cannot send signal %d to peer p%d (not running)", sig, i);
    if (sig == SIGSTOP)
        c->stopped[i] = true;
    else if (sig == SIGCONT)
        c->stopped[i] = false;
}

int tu_peer_stop(tu_cluster *c, int i, int sig, int timeout_ms)
{
    check_peer(c, i);
    if (c->peers[i] <= 0)
        return -2;
    kill(c->peers[i], sig);
    int code = tu_reap(c->peers[i], timeout_ms);
    c->peers[i] = 0;
    c->stopped[i] = false;
    return code;
}

int tu_plan_line_peer(const char *line)
{
    const char *eol = strchr(line, '\n'), *on = strstr(line, " on ");
    if (!on || (eol && on > eol))
        return -1;
    const char *pn = on + 4; /* the key's first 8 characters, then " (pI)": skipped by count, as Z85 */
    for (int k = 0; k < 8; k++) /* has '(' and 'p' too ("(p:aLRMU (p0)" once made this read -1) */
        if (!*pn++ || (eol && pn > eol))
            return -1;
    if (strncmp(pn, " (p", 3) != 0 || pn[3] < '0' || pn[3] > '9')
        return -1;
    char *end = NULL;
    long i = strtol(pn + 3, &end, 10);
    return *end == ')' && i < TU_MAX_PEERS ? (int)i : -1;
}

int tu_stage_peer(const tu_cluster *c, const char *id, int stage, int timeout_ms)
{
    char needle[96];
    snprintf(needle, sizeof needle, "job %s stage %d/", id, stage);
    if (!tu_file_wait(c->broker_log, needle, timeout_ms)) {
        tu_file_show(c->broker_log, 40);
        tu_fail("job %s: no stage %d in the broker's plan", id, stage);
    }
    char *bl = tu_broker_log_text(c);
    const char *at = strstr(bl, needle);
    int i = at ? tu_plan_line_peer(at) : -1;
    free(bl);
    if (i < 0 || i >= c->o.n_peers)
        tu_fail("job %s: cannot read stage %d's peer from the broker's log", id, stage);
    return i;
}

int tu_peer_index(const char *name)
{
    if (!name || name[0] != 'p' || name[1] < '0' || name[1] > '9' || name[2])
        return -1;
    return name[1] - '0';
}

int tu_peers_list(const tu_cluster *c, tu_peer_seen *seen, int cap)
{
    char *out = NULL;
    int rc = tu_fusion(c, &out, "peers --json 2>/dev/null");
    cJSON *arr = rc == 0 && out ? cJSON_Parse(out) : NULL;
    free(out);
    if (!cJSON_IsArray(arr)) {
        cJSON_Delete(arr);
        return -1;
    }
    int n = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr)
    {
        if (n >= cap)
            break;
        tu_peer_seen *s = &seen[n++];
        memset(s, 0, sizeof *s);
        const cJSON *nm = cJSON_GetObjectItem(e, "name"), *st = cJSON_GetObjectItem(e, "state"),
                    *r = cJSON_GetObjectItem(e, "pause_reason"), *rep = cJSON_GetObjectItem(e, "reputation"),
                    *bw = cJSON_GetObjectItem(e, "link_bandwidth_bps");
        if (cJSON_IsString(nm))
            snprintf(s->name, sizeof s->name, "%s", nm->valuestring);
        if (cJSON_IsString(st))
            snprintf(s->state, sizeof s->state, "%s", st->valuestring);
        if (cJSON_IsString(r))
            snprintf(s->pause_reason, sizeof s->pause_reason, "%s", r->valuestring);
        if (cJSON_IsNumber(rep))
            s->reputation = rep->valuedouble;
        if (cJSON_IsNumber(bw))
            s->link_bps = bw->valuedouble;
    }
    cJSON_Delete(arr);
    return n;
}

bool tu_peer_seen_get(const tu_cluster *c, int i, tu_peer_seen *seen)
{
    tu_peer_seen all[32];
    char name[16];
    snprintf(name, sizeof name, "p%d", i);
    memset(seen, 0, sizeof *seen);
    int n = tu_peers_list(c, all, 32);
    for (int k = 0; k < n; k++)
        if (strcmp(all[k].name, name) == 0) {
            *seen = all[k];
            return true;
        }
    return false;
}

/* ---- the client ------------------------------------------------------------------------------------ */

int tu_fusion(const tu_cluster *c, char **out, const char *fmt, ...)
{
    char args[6000];
    FORMAT_ARGS(args, fmt);
    return tu_sh(out, "cd '%s' && FUSION_CONFIG='%s' '%s' %s", c->dir, c->conf, tu_bin("fusion"), args);
}

void tu_submit(const tu_cluster *c, char id[TU_ID_LEN], const char *fmt, ...)
{
    char args[5000];
    FORMAT_ARGS(args, fmt);
    char *out = NULL;
    int rc = tu_fusion(c, &out, "submit %s -q 2>>client.err", args);
    id[0] = '\0';
    if (rc != 0 || sscanf(out ? out : "", "%16s", id) != 1 || strlen(id) != 16) {
        char p[TU_PATH];
        tu_path(c, p, "client.err");
        tu_file_show(p, 10);
        tu_fail("fusion submit %s: exit %d: %s", args, rc, out ? out : "");
    }
    free(out);
}

void tu_submit_finetune(const tu_cluster *c, char id[TU_ID_LEN], const char *model, const char *fmt, ...)
{
    char opts[4000];
    FORMAT_ARGS(opts, fmt);
    tu_submit(c, id, "finetune --model '%s' --data '%s' %s", model, c->data, opts);
}

void tu_wait_done(const tu_cluster *c, const char *id, int timeout_s)
{
    char *out = NULL;
    int rc = tu_fusion(c, &out, "wait %s --wait-timeout %d", id, timeout_s);
    if (rc != 0) {
        tu_cluster_show_logs(c);
        tu_fail("fusion wait %s: exit %d: %s", id, rc, out ? out : "");
    }
    free(out);
}

void tu_result(const tu_cluster *c, const char *id)
{
    char *out = NULL;
    int rc = tu_fusion(c, &out, "result %s -o 'res-%s'", id, id);
    if (rc != 0)
        tu_fail("fusion result %s: exit %d: %s", id, rc, out ? out : "");
    free(out);
}

bool tu_status_get(const tu_cluster *c, const char *id, tu_status *st)
{
    memset(st, 0, sizeof *st);
    char *out = NULL;
    int rc = tu_fusion(c, &out, "status %s --json 2>/dev/null", id);
    cJSON *j = rc == 0 && out ? cJSON_Parse(out) : NULL;
    free(out);
    if (!j)
        return false;
    const cJSON *s = cJSON_GetObjectItem(j, "state"), *n = cJSON_GetObjectItem(j, "step"),
                *msg = cJSON_GetObjectItem(j, "message"), *sp = cJSON_GetObjectItem(j, "stage_peers");
    if (cJSON_IsString(s))
        snprintf(st->state, sizeof st->state, "%s", s->valuestring);
    if (cJSON_IsNumber(n))
        st->step = (long)n->valuedouble;
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

long tu_wait_step(const tu_cluster *c, const char *id, long step, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    tu_status st;
    for (;;) {
        if (tu_status_get(c, id, &st)) {
            if (strcmp(st.state, "running") == 0 && st.step >= step)
                return st.step;
            if (strcmp(st.state, "done") == 0 || strcmp(st.state, "failed") == 0 || strcmp(st.state, "cancelled") == 0)
                tu_fail("job %s ended (%s at step %ld) before step %ld: make it longer", id, st.state, st.step, step);
        }
        if (fu_clock_ms() >= end) {
            tu_cluster_show_logs(c);
            tu_fail("job %s did not reach step %ld in %d ms (at %ld, %s)", id, step, timeout_ms, st.step, st.state);
        }
        fu_sleep_ms(20);
    }
}

/* ---- adapters ---------------------------------------------------------------------------------------- */

double tu_adapter_diff(const char *path_a, const char *path_b, size_t *n_tensors)
{
    fu_errmsg em = {{0}};
    fu_safetensors *x = NULL, *y = NULL;
    if (fu_safetensors_open_file(path_a, &x, &em) != FU_OK)
        tu_fail("%s: %s", path_a, fu_errmsg_text(&em, FU_EIO));
    if (fu_safetensors_open_file(path_b, &y, &em) != FU_OK)
        tu_fail("%s: %s", path_b, fu_errmsg_text(&em, FU_EIO));
    size_t n = fu_safetensors_count(y);
    if (fu_safetensors_count(x) != n || n == 0)
        tu_fail("%s has %zu tensors, %s has %zu", path_a, fu_safetensors_count(x), path_b, n);
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const fu_st_tensor *ty = fu_safetensors_at(y, i), *tx = fu_safetensors_get(x, ty->name);
        if (!tx)
            tu_fail("%s lacks %s", path_a, ty->name);
        if (tx->nelem != ty->nelem)
            tu_fail("%s: %zu elements in %s, %zu in %s", ty->name, tx->nelem, path_a, ty->nelem, path_b);
        float *u = malloc(tx->nelem * sizeof *u), *v = malloc(ty->nelem * sizeof *v);
        if (!u || !v || fu_st_tensor_to_f32(tx, u, tx->nelem, &em) != FU_OK ||
            fu_st_tensor_to_f32(ty, v, ty->nelem, &em) != FU_OK)
            tu_fail("%s: cannot read it as float32: %s", ty->name, fu_errmsg_text(&em, FU_ENOMEM));
        for (size_t k = 0; k < tx->nelem; k++) {
            double d = fabs((double)u[k] - (double)v[k]);
            if (d > worst || isnan(d))
                worst = isnan(d) ? INFINITY : d;
        }
        free(u);
        free(v);
    }
    *n_tensors = n;
    fu_safetensors_close(&x);
    fu_safetensors_close(&y);
    return worst;
}

static double vs_reference(const tu_cluster *c, const char *id, const char *model_dir, const char *train_args,
                           int threads)
{
    char res[TU_PATH], *out = NULL;
    tu_path(c, res, "res-%s", id);
    if (!fu_path_exists(res)) /* downloaded once: a second reference compares the same file */
        tu_result(c, id);
    int rc = tu_fusion(c, &out, "run finetune --model '%s' --data '%s' --threads %d %s -o 'ref-%s-t%d' --force", model_dir,
                       c->data, threads, train_args, id, threads);
    if (rc != 0)
        tu_fail("fusion run finetune: exit %d: %s", rc, out ? out : "");
    free(out);
    char a[TU_PATH], b[TU_PATH];
    tu_path(c, a, "res-%s/adapter_model.safetensors", id);
    tu_path(c, b, "ref-%s-t%d/adapter_model.safetensors", id, threads);
    size_t nt = 0;
    double d = tu_adapter_diff(a, b, &nt);
    printf("job %s: %zu adapter tensors, max |pipeline - fusion run --threads %d| = %.3g\n", id, nt, threads, d);
    fflush(stdout);
    return d;
}

void tu_job_cuts(const tu_cluster *c, const char *id, char *out, size_t cap)
{
    char *log = tu_broker_log_text(c), needle[64];
    snprintf(needle, sizeof needle, "job %s stage ", id);
    long first[64] = {0};
    int n = 0;
    for (const char *at = log; (at = strstr(at, needle)) != NULL; at++) {
        const char *nl = strchr(at, '\n'), *nodes = strstr(at, ": nodes ");
        int s, of;
        long a;
        if (sscanf(at + strlen(needle), "%d/%d", &s, &of) != 2 || !nodes || (nl && nodes > nl) ||
            sscanf(nodes, ": nodes %ld-", &a) != 1 || s < 0 || s >= 64 || of < 1 || of > 64)
            continue;
        first[s] = a;
        n = of;
    }
    free(log);
    if (n < 2)
        tu_fail("job %s: the broker's log names no plan of more than one stage", id);
    size_t off = 0;
    out[0] = '\0';
    for (int s = 1; s < n && off < cap; s++)
        off += (size_t)snprintf(out + off, cap - off, "%s%ld", s > 1 ? "," : "", first[s]);
    printf("job %s: the plan's cuts are %s\n", id, out);
}

double tu_job_vs_reference(const tu_cluster *c, const char *id, const char *model_dir, const char *train_args)
{
    return vs_reference(c, id, model_dir, train_args, 1);
}

void tu_assert_identical_adapter(const tu_cluster *c, const char *id, const char *model_dir, const char *train_args,
                                 int threads)
{
    (void)vs_reference(c, id, model_dir, train_args, threads);
    char a[TU_PATH], b[TU_PATH];
    tu_path(c, a, "res-%s/adapter_model.safetensors", id);
    tu_path(c, b, "ref-%s-t%d/adapter_model.safetensors", id, threads);
    char *ta = NULL, *tb = NULL;
    size_t na = 0, nb = 0;
    if (fu_file_read_all(a, 64u << 20, &ta, &na, NULL) != FU_OK || fu_file_read_all(b, 64u << 20, &tb, &nb, NULL) != FU_OK)
        tu_fail("job %s: cannot read the two adapters", id);
    bool same = na == nb && memcmp(ta, tb, na) == 0;
    free(ta);
    free(tb);
    if (!same)
        tu_fail("job %s: its adapter file is not bit-identical to fusion run finetune --threads %d's", id, threads);
}

void tu_assert_same_adapter(const tu_cluster *c, const char *id, const char *model_dir, const char *train_args)
{
    double d = tu_job_vs_reference(c, id, model_dir, train_args);
    if (!(d <= TU_ADAPTER_TOL))
        tu_fail("job %s: its adapter differs from fusion run finetune's by %.3g (more than %g)", id, d, TU_ADAPTER_TOL);
}

/* ---- running the tests --------------------------------------------------------------------------------- */

int tu_teardown(void **state)
{
    (void)state;
    tu_load_stop();
    for (int i = 0; i < TU_MAX_CHILDREN; i++) {
        pid_t pid = tu_children[i];
        siginfo_t info;
        tu_children[i] = 0;
        if (pid <= 0 || waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) != 0)
            continue; /* not (or no longer) our child */
        kill(pid, SIGCONT);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    for (int i = 0; i < TU_MAX_LIVE; i++)
        if (tu_live[i]) {
            printf("logs kept in %s\n", tu_live[i]->dir);
            free(tu_live[i]);
            tu_live[i] = NULL;
        }
    fflush(stdout);
    return 0;
}

int tu_main(int argc, char **argv, const char *group, const struct CMUnitTest *tests, size_t n,
            int (*setup)(void **), int (*teardown)(void **))
{
    signal(SIGPIPE, SIG_IGN);
    if (sodium_init() < 0)
        return 1;
    if (argc > 1) {
        size_t hits = 0;
        for (size_t i = 0; i < n; i++)
            hits += fnmatch(argv[1], tests[i].name, 0) == 0;
        if (hits == 0) {
            fprintf(stderr, "%s: no test named %s\n", argv[0], argv[1]);
            return 2;
        }
        cmocka_set_test_filter(argv[1]);
    }
    return _cmocka_run_group_tests(group, tests, n, setup, teardown);
}

int tu_metrics_port(const tu_cluster *c)
{
    static const char at[] = "serving metrics on http://127.0.0.1:";
    char *log = tu_broker_log_text(c);
    const char *p = strstr(log, at);
    int port = p ? atoi(p + strlen(at)) : 0;
    free(log);
    if (port <= 0)
        tu_fail("the broker's log names no metrics port (started with --http 127.0.0.1:0?)");
    return port;
}

char *tu_metrics_scrape(const tu_cluster *c)
{
    return tu_sh_expect_out(0, "# TYPE fusion_peers gauge", "curl -sf --max-time 10 http://127.0.0.1:%d/metrics",
                            tu_metrics_port(c));
}

double tu_metric(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; (p = strstr(p, name)) != NULL; p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}
