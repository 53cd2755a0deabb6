/* fusion-peer: a volunteer compute peer that runs pipeline stages for the broker (docs/PEER.md).
 * Exit codes: 0 after a graceful leave, 1 on a failure (a backend or socket error, or a second
 * signal that cut the drain short), 2 bad command line, 3 the broker refused this peer's key. */
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include "fu_log.h"
#include "fu_opts.h"
#include "wire_keys.h"
#include "peer.h"
#include "peer_cache.h"

static volatile sig_atomic_t g_signals = 0;

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

int main(int argc, char **argv)
{
    const char *broker = NULL, *broker_key = NULL, *keys = NULL, *device = "cpu", *data_bind = NULL;
    const char *cache = NULL, *name = NULL, *enrol_token = NULL, *advertise = NULL, *token_file = NULL;
    long long threads = 0, drain_s = PEER_DRAIN_MS / 1000;
    double max_memory = 0, cache_max = PEER_CACHE_DEFAULT_GB, link_mbps = 0, gflops = 0;
    bool no_listen = false, pause_busy = false;
    const char *priority = "idle", *hours = NULL, *config = NULL;
    long long max_cpu = 100, busy_pct = PEER_GUEST_BUSY_DEFAULT;
    const fu_opt opts[] = {
        {"config", 0, FU_OPT_STR, &config, "FILE", "read options from FILE (`option = value` lines); the command line wins"},
        {"broker", 0, FU_OPT_STR, &broker, "ENDPOINT", "the broker's control endpoint (tcp://HOST:7700)"},
        {"broker-key", 0, FU_OPT_STR, &broker_key, "FILE", "the broker's public key file"},
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
    peer_guest_cfg guest = {.max_cpu = (int)max_cpu, .pause_when_busy = pause_busy, .busy_percent = (int)busy_pct};
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
    fu_errmsg em = {{0}};
    fu_err err;
    peer_t *p = peer_new(&cfg, &err, &em);
    if (!p) {
        fprintf(stderr, "fusion-peer: %s\n", fu_errmsg_text(&em, err));
        return err == FU_EAUTH || err == FU_EPERM ? FU_EXIT_AUTH : err == FU_EINVAL ? FU_EXIT_USAGE : FU_EXIT_FAIL;
    }
    printf("fusion-peer: profile: %s\n", peer_profile_line(p));
    fflush(stdout);
    fu_err rc = peer_run(p);
    peer_destroy(&p);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion-peer: stopped: %s\n", fu_strerror(rc));
        return FU_EXIT_FAIL;
    }
    printf("fusion-peer: left cleanly\n");
    return FU_EXIT_OK;
}
