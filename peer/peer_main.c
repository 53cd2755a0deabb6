/* fusion-peer: a volunteer compute peer that runs pipeline stages for the broker (docs/PEER.md).
 * Exit codes: 0 after a graceful leave, 1 on a failure (a backend or socket error, or a second
 * signal that cut the drain short), 2 bad command line, 3 the broker refused this peer's key.
 * With --slots N it runs N slots, each a child process with its own peer_t (docs/PEER.md "Slots"):
 * the parent starts them one after another, passes its signals on, and exits with the first
 * failure's code once every slot has ended. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fu_log.h"
#include "fu_opts.h"
#include "wire_keys.h"
#include "peer.h"
#include "peer_cache.h"

#define PEER_MAX_SLOTS 8 /* the broker's BROKER_MAX_SLOTS */

static volatile sig_atomic_t g_signals = 0;
static pid_t g_slots[PEER_MAX_SLOTS]; /* the parent of --slots: its children (0: none) */
static volatile sig_atomic_t g_n_slots = 0;

/* The parent of --slots: every signal is its slots' (each leaves, pauses or resumes itself). */
static void on_parent_signal(int sig)
{
    for (int i = 0; i < g_n_slots; i++)
        if (g_slots[i] > 0)
            kill(g_slots[i], sig);
}

static void on_signal(int sig)
{
    if (sig == SIGUSR1 || sig == SIGUSR2) { /* the owner's pause and resume */
        peer_request_pause(sig == SIGUSR1);
        return;
    }
    if (g_signals++ == 0) {
        peer_request_stop(); /* leave gracefully: Leave, drain, exit 0 */
        return;
    }
    static const char msg[] = "fusion-peer: second signal: exiting at once\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(FU_EXIT_FAIL);
}

/* Runs one peer (a slot, or the only one) until it leaves; writes a byte to ready_fd (>= 0) once it
 * is up. Returns the exit code. */
static int run_peer(const peer_cfg *cfg, int ready_fd)
{
    fu_errmsg em = {{0}};
    fu_err err;
    peer_t *p = peer_new(cfg, &err, &em);
    if (!p) {
        fprintf(stderr, "fusion-peer: %s\n", fu_errmsg_text(&em, err));
        return err == FU_EAUTH || err == FU_EPERM ? FU_EXIT_AUTH : err == FU_EINVAL ? FU_EXIT_USAGE : FU_EXIT_FAIL;
    }
    if (cfg->n_slots > 1)
        printf("fusion-peer: slot %u of %u: profile: %s\n", cfg->slot, cfg->n_slots, peer_profile_line(p));
    else
        printf("fusion-peer: profile: %s\n", peer_profile_line(p));
    fflush(stdout);
    if (ready_fd >= 0) {
        ssize_t w = write(ready_fd, "", 1);
        (void)w;
        close(ready_fd);
    }
    fu_err rc = peer_run(p);
    peer_destroy(&p);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion-peer: stopped: %s\n", fu_strerror(rc));
        return FU_EXIT_FAIL;
    }
    printf("fusion-peer: left cleanly\n");
    return FU_EXIT_OK;
}

/* endpoint with its TCP port moved up by `by` (port 7701 + 1 = 7702); a wildcard port
 * ("tcp://127.0.0.1:*") or no port stays as it is. */
static void shift_port(const char *endpoint, unsigned by, char *out, size_t cap)
{
    const char *colon = strrchr(endpoint, ':');
    char *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    if (!colon || !end || *end || end == colon + 1 || port <= 0 || port + (long)by > 65535)
        snprintf(out, cap, "%s", endpoint);
    else
        snprintf(out, cap, "%.*s:%ld", (int)(colon - endpoint), endpoint, port + (long)by);
}

/* --slots N: N children, each a peer of its own slot, started one after another (so that each
 * measures the machine alone, and only the first enrols the key). */
static int run_slots(const peer_cfg *base, unsigned n, const char *bind, const char *advertise, int threads)
{
    static const int signals[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_parent_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof signals / sizeof *signals; i++)
        sigaction(signals[i], &sa, NULL);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int per = (threads > 0 ? threads : (int)(cores > 0 ? cores : 1)) / (int)n;
    int code = FU_EXIT_OK;
    for (unsigned i = 0; i < n && code == FU_EXIT_OK && !g_signals; i++) {
        char b[256], a[256], name[160];
        peer_cfg cfg = *base;
        cfg.slot = i;
        cfg.n_slots = n;
        cfg.threads = per > 0 ? per : 1;
        if (i > 0)
            cfg.enrol_token = NULL; /* the first slot enrolled the key */
        if (bind) {
            shift_port(bind, i, b, sizeof b);
            cfg.data_bind = b;
        } else if (!cfg.no_listen) {
            shift_port("tcp://*:7701", i, b, sizeof b);
            cfg.data_bind = b;
        }
        if (advertise) {
            shift_port(advertise, i, a, sizeof a);
            cfg.data_advertise = a;
        }
        char host[128] = "peer";
        if (!base->name || !*base->name)
            (void)gethostname(host, sizeof host - 1);
        snprintf(name, sizeof name, "%s#%u", base->name && *base->name ? base->name : host, i);
        cfg.name = name;
        int fds[2];
        if (pipe(fds) != 0) {
            fprintf(stderr, "fusion-peer: cannot make a pipe: %s\n", strerror(errno));
            code = FU_EXIT_FAIL;
            break;
        }
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "fusion-peer: cannot start slot %u: %s\n", i, strerror(errno));
            code = FU_EXIT_FAIL;
            close(fds[0]);
            close(fds[1]);
            break;
        }
        if (pid == 0) { /* the slot: dies with its parent, takes signals as a single peer does */
            close(fds[0]);
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            char tag[16];
            snprintf(tag, sizeof tag, "slot%u", i);
            fu_log_set_tag(tag);
            if (getppid() == 1)
                _exit(FU_EXIT_FAIL);
            struct sigaction ca;
            memset(&ca, 0, sizeof ca);
            ca.sa_handler = on_signal;
            sigemptyset(&ca.sa_mask);
            for (size_t k = 0; k < sizeof signals / sizeof *signals; k++)
                sigaction(signals[k], &ca, NULL);
            int rc = run_peer(&cfg, fds[1]);
            fflush(NULL);
            _exit(rc);
        }
        g_slots[i] = pid;
        g_n_slots = (int)i + 1;
        close(fds[1]);
        char byte;
        ssize_t r;
        while ((r = read(fds[0], &byte, 1)) < 0 && errno == EINTR)
            ;
        close(fds[0]);
        if (r != 1) { /* it ended before it was up: its own message said why */
            int st = 0;
            while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
                ;
            g_slots[i] = 0;
            code = WIFEXITED(st) && WEXITSTATUS(st) ? WEXITSTATUS(st) : FU_EXIT_FAIL;
        }
    }
    if (code != FU_EXIT_OK) /* a slot could not start: the others leave */
        on_parent_signal(SIGTERM);
    for (int i = 0; i < g_n_slots; i++) {
        int st = 0;
        if (g_slots[i] <= 0)
            continue;
        while (waitpid(g_slots[i], &st, 0) < 0 && errno == EINTR)
            ;
        int c = WIFEXITED(st) ? WEXITSTATUS(st) : FU_EXIT_FAIL;
        if (code == FU_EXIT_OK && c != FU_EXIT_OK)
            code = c;
    }
    return code;
}

int main(int argc, char **argv)
{
    const char *broker = NULL, *broker_key = NULL, *keys = NULL, *device = "cpu", *data_bind = NULL;
    const char *cache = NULL, *name = NULL, *enrol_token = NULL, *advertise = NULL, *token_file = NULL;
    long long threads = 0, drain_s = PEER_DRAIN_MS / 1000;
    double max_memory = 0, cache_max = PEER_CACHE_DEFAULT_GB, link_mbps = 0, gflops = 0;
    bool no_listen = false, pause_busy = false, pause_gpu = false, no_pause_gpu = false;
    const char *priority = "idle", *hours = NULL, *config = NULL;
    long long max_cpu = 100, busy_pct = PEER_GUEST_BUSY_DEFAULT, slots = 1;
    const fu_opt opts[] = {
        {"config", 0, FU_OPT_STR, &config, "FILE", "read options from FILE (`option = value` lines); the command line wins"},
        {"broker", 0, FU_OPT_STR, &broker, "ENDPOINT[,...]",
         "the broker's control endpoint (tcp://HOST:7700), or several (the broker's and its gateways'), used one "
         "at a time: the next when the current one is lost"},
        {"broker-key", 0, FU_OPT_STR, &broker_key, "FILE[,...]",
         "the broker's public key file; with several endpoints one for all, or one each, in their order"},
        {"keys", 0, FU_OPT_STR, &keys, "DIR", "this peer's key directory (from `fusion keygen`)"},
        {"device", 0, FU_OPT_STR, &device, "DEV", "cpu or cuda:N (default cpu)"},
        {"threads", 0, FU_OPT_INT, &threads, "N", "compute threads (default: all cores)"},
        {"data-bind", 0, FU_OPT_STR, &data_bind, "ENDPOINT", "where neighbours connect for activations (default tcp://*:7701)"},
        {"data-advertise", 0, FU_OPT_STR, &advertise, "ENDPOINT", "the data endpoint told to others (default: from --data-bind)"},
        {"no-listen", 0, FU_OPT_FLAG, &no_listen, NULL, "accept no connections; relay through the broker"},
        {"cache", 0, FU_OPT_STR, &cache, "DIR", "weight cache directory (default ~/.cache/fusion)"},
        {"cache-max-gb", 0, FU_OPT_DOUBLE, &cache_max, "GB",
         "most GiB the cache may hold, least recently used blobs evicted first (default 20; 0: no limit)"},
        {"max-memory", 0, FU_OPT_DOUBLE, &max_memory, "GB", "most memory to offer"},
        {"slots", 0, FU_OPT_INT, &slots, "N",
         "hold stages of up to N jobs at once (default 1; at most 8): N peers of one key, each with 1/N of the "
         "memory, threads and stated speed, listening on --data-bind's port + 0..N-1"},
        {"gflops", 0, FU_OPT_DOUBLE, &gflops, "G",
         "the GEMM speed to claim instead of the measured one, e.g. a share of a machine others use too (the "
         "broker's profile challenge still caps what plans use)"},
        {"link-mbps", 0, FU_OPT_DOUBLE, &link_mbps, "MB/S",
         "this link's speed in MB/s, told to the broker instead of measuring it (default 0: measure)"},
        {"name", 0, FU_OPT_STR, &name, "NAME", "a name shown by `fusion peers`"},
        {"enrol-token-file", 0, FU_OPT_STR, &token_file, "FILE",
         "enrol this peer's key with the broker's token in FILE first (mode 0600; or set FUSION_ENROL_TOKEN)"},
        {"enrol-token", 0, FU_OPT_STR, &enrol_token, "TOKEN", "the same with the token itself (visible in ps)"},
        {"drain-timeout", 0, FU_OPT_INT, &drain_s, "S", "after a signal, wait this long for StageRelease (default 30)"},
        {"priority", 0, FU_OPT_STR, &priority, "P",
         "compute threads' priority: idle (default: only time nothing else wants), low (nice 19) or normal"},
        {"max-cpu", 0, FU_OPT_INT, &max_cpu, "PERCENT", "compute runs at most PERCENT of the time (default 100)"},
        {"pause-when-busy", 0, FU_OPT_FLAG, &pause_busy, NULL,
         "pause compute while other programs use more than --busy-percent of the CPU"},
        {"busy-percent", 0, FU_OPT_INT, &busy_pct, "PERCENT",
         "the other programs' share of all CPUs that counts as busy (default 25)"},
        {"pause-when-gpu-busy", 0, FU_OPT_FLAG, &pause_gpu, NULL,
         "pause compute while other programs run on the GPU (the default with --device cuda; a CPU peer then "
         "watches every GPU)"},
        {"no-pause-when-gpu-busy", 0, FU_OPT_FLAG, &no_pause_gpu, NULL,
         "never pause for other programs' GPU work"},
        {"hours", 0, FU_OPT_STR, &hours, "FROM-TO", "compute only in this daily window, local time (22-08, 22:30-07:00)"},
    };
    const fu_cmd cmd = {
        .prog = "fusion-peer",
        .usage = "--broker ENDPOINT --broker-key FILE --keys DIR [options]",
        .summary =
            "Joins a fusion broker as a compute peer: measures this machine, runs the pipeline\n"
            "stages it is given, and leaves cleanly on SIGINT or SIGTERM (a second signal exits at once).\n"
            "A guest on its owner's machine: compute runs at idle priority; SIGUSR1 pauses it, SIGUSR2\n"
            "resumes it (the stage is kept).",
        FU_OPTS_TABLE(opts),
    };
    int code;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!broker || !broker_key || !keys)
        return fu_opts_usage_error(&cmd, "--broker, --broker-key and --keys are required");
    if (slots < 1 || slots > PEER_MAX_SLOTS) {
        fprintf(stderr, "fusion-peer: --slots must be 1..%d\n", PEER_MAX_SLOTS);
        return FU_EXIT_USAGE;
    }
    if (threads < 0 || threads > 4096 || max_memory < 0 || drain_s < 0 || drain_s > 86400) {
        fprintf(stderr, "fusion-peer: --threads, --max-memory and --drain-timeout must not be negative\n");
        return FU_EXIT_USAGE;
    }
    if (!(cache_max >= 0) || cache_max > 1e9) { /* also NaN */
        fprintf(stderr, "fusion-peer: --cache-max-gb must be a number of GiB, 0 or more (0: no limit)\n");
        return FU_EXIT_USAGE;
    }
    if (!(gflops >= 0) || gflops > 1e6) {
        fprintf(stderr, "fusion-peer: --gflops must be a number of GFLOP/s, 0 to 1000000 (0: measure)\n");
        return FU_EXIT_USAGE;
    }
    if (!(link_mbps >= 0) || link_mbps > 1e6) {
        fprintf(stderr, "fusion-peer: --link-mbps must be a number of MB/s, 0 to 1000000 (0: measure)\n");
        return FU_EXIT_USAGE;
    }
    if (pause_gpu && no_pause_gpu) {
        fprintf(stderr, "fusion-peer: --pause-when-gpu-busy and --no-pause-when-gpu-busy exclude each other\n");
        return FU_EXIT_USAGE;
    }
    /* The GPU the guest watches: --device cuda:N's N (peer_new refuses a malformed --device; here a
     * bad one only leaves the GPU unwatched). A CUDA peer watches by default: its kernels compete with
     * the owner's on the GPU, where the CPU priority does nothing. */
    int gpu = -1;
    if (strcmp(device, "cuda") == 0) {
        gpu = 0;
    } else if (strncmp(device, "cuda:", 5) == 0) {
        char *end = NULL;
        long n = strtol(device + 5, &end, 10);
        gpu = end != device + 5 && !*end && n >= 0 && n <= 1024 ? (int)n : -1;
    }
    peer_guest_cfg guest = {.max_cpu = (int)max_cpu, .pause_when_busy = pause_busy, .busy_percent = (int)busy_pct,
                            .pause_when_gpu_busy = !no_pause_gpu && (pause_gpu || gpu >= 0), .gpu = gpu,
                            .gpu_own = gpu >= 0 ? (int)slots : 0};
    if (kern_priority_parse(priority, &guest.priority) != FU_OK) {
        fprintf(stderr, "fusion-peer: --priority must be idle, low or normal\n");
        return FU_EXIT_USAGE;
    }
    if (max_cpu < 1 || max_cpu > 100 || busy_pct < 1 || busy_pct > 100) {
        fprintf(stderr, "fusion-peer: --max-cpu and --busy-percent must be 1..100\n");
        return FU_EXIT_USAGE;
    }
    fu_errmsg hem = {{0}};
    if (hours && peer_guest_hours_parse(hours, &guest.hours_from, &guest.hours_to, &hem) != FU_OK) {
        fprintf(stderr, "fusion-peer: %s\n", hem.msg);
        return FU_EXIT_USAGE;
    }
    if (no_listen && data_bind) {
        fprintf(stderr, "fusion-peer: --no-listen and --data-bind exclude each other\n");
        return FU_EXIT_USAGE;
    }
    char token_buf[WIRE_TOKEN_Z85_LEN + 1];
    if (wire_token_choose(token_file, enrol_token, "FUSION_ENROL_TOKEN", token_buf, &enrol_token, &hem) != FU_OK) {
        fprintf(stderr, "fusion-peer: %s\n", hem.msg);
        return FU_EXIT_USAGE;
    }
    static const int signals[] = {SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    code = fu_opts_daemon_start(cmd.prog, on_signal, signals, sizeof signals / sizeof *signals);
    if (code != FU_EXIT_OK)
        return code;

    peer_cfg cfg = {.broker = broker, .broker_key_file = broker_key, .keys_dir = keys, .device = device,
                    .threads = (int)threads, .data_bind = data_bind, .data_advertise = advertise,
                    .no_listen = no_listen, .cache_dir = cache, .max_memory_gb = max_memory,
                    .cache_max_gb = cache_max, .link_mbps = link_mbps, .gflops = gflops, .name = name,
                    .enrol_token = enrol_token, .drain_ms = (uint32_t)(drain_s * 1000), .guest = guest};
    if (slots > 1)
        return run_slots(&cfg, (unsigned)slots, data_bind, advertise, (int)threads);
    return run_peer(&cfg, -1);
}
