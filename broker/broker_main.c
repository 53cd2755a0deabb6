/* fusion-broker: the registry, scheduler, backup pool and job store daemon. Runs in the foreground
 * and logs to stderr; SIGTERM or SIGINT stop it cleanly (socket closed, store closed). */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "broker.h"
#include "broker_http.h"
#include "fu_alloc.h"
#include "fu_file.h"
#include "fu_log.h"
#include "fu_opts.h"
#include "wire_keys.h"

static void on_signal(int sig)
{
    (void)sig;
    broker_request_stop();
}

/* --allow FILE must name a list that exists, or, with an enrolment token, one the broker can create
 * (enrolment appends to it): a mistyped path is an error, not an empty list that admits nobody. */
static int allow_file_usable(const char *allow, bool enrols)
{
    if (fu_path_exists(allow)) {
        if (fu_path_is_dir(allow)) {
            fprintf(stderr, "fusion-broker: --allow '%s' is a directory, not an allow-list file\n", allow);
            return FU_EXIT_USAGE;
        }
        return FU_EXIT_OK;
    }
    if (!enrols) {
        fprintf(stderr, "fusion-broker: --allow '%s' does not exist: no key would be admitted (list public keys in "
                        "it, one per line, or give an enrolment token so that enrolled keys are added to it)\n",
                allow);
        return FU_EXIT_NOTFOUND;
    }
    char *dir = fu_strdup(allow);
    char *slash = strrchr(dir, '/');
    if (slash)
        *(slash == dir ? slash + 1 : slash) = '\0';
    bool ok = access(slash ? dir : ".", W_OK | X_OK) == 0;
    if (!ok)
        fprintf(stderr, "fusion-broker: --allow '%s' does not exist and cannot be made in '%s': %s\n", allow,
                slash ? dir : ".", strerror(errno));
    free(dir);
    return ok ? FU_EXIT_OK : FU_EXIT_NOTFOUND;
}

int main(int argc, char **argv)
{
    const char *bind = "tcp://*:7700", *keys = NULL, *db = NULL, *allow = NULL, *http = NULL, *token = NULL, *data_dir = NULL;
    const char *token_file = NULL, *model_roots = NULL, *gateway_bind = NULL;
    const char *peer_token_file = NULL, *client_token_file = NULL;
    long long backups = BROKER_BACKUPS, heartbeat_ms = BROKER_HEARTBEAT_MS;
    long long ready_timeout = BROKER_READY_TIMEOUT_S, step_timeout = 0, pause_grace = BROKER_PAUSE_GRACE_S;
    long long challenge_ms = BROKER_CHALLENGE_MS;
    long long upload_gib = BROKER_UPLOAD_GIB, client_jobs = BROKER_CLIENT_JOBS, client_mib = BROKER_CLIENT_MIB, client_per_min = BROKER_CLIENT_PER_MIN,
              sessions_per_min = BROKER_SESSIONS_PER_MIN;
    double verify = BROKER_VERIFY_DEFAULT, min_rep = BROKER_MIN_REPUTATION, grow = BROKER_GROW_MARGIN;
    long long keep_events = BROKER_KEEP_EVENTS;
    double keep_events_days = BROKER_KEEP_EVENTS_DAYS, keep_jobs_days = BROKER_KEEP_JOBS_DAYS, forget_days = 0;
    bool init_store = false, check_store = false;
    const fu_opt opts[] = {
        {"bind", 0, FU_OPT_STR, &bind, "ENDPOINT", "control-plane endpoint (default tcp://*:7700)"},
        {"gateway-bind", 0, FU_OPT_STR, &gateway_bind, "ENDPOINT",
         "also listen there for fusion-gateway processes, each carrying many peers (keys with the gateway "
         "role in --allow only)"},
        {"keys", 0, FU_OPT_STR, &keys, "DIR", "the broker's key directory (from `fusion keygen`)"},
        {"db", 0, FU_OPT_STR, &db, "FILE", "SQLite job store (created if missing; checked at every start)"},
        {"init", 0, FU_OPT_FLAG, &init_store, NULL, "let an existing empty --db file become a new store"},
        {"check-store", 0, FU_OPT_FLAG, &check_store, NULL,
         "full integrity check of the store at start (slower than the default quick check)"},
        {"allow", 0, FU_OPT_STR, &allow, "FILE", "admit only the public keys listed in FILE"},
        {"http", 0, FU_OPT_STR, &http, "IPV4:PORT",
         "serve GET /metrics (Prometheus text) there, e.g. 127.0.0.1:9090 (off by default)"},
        {"enrol-token-file", 0, FU_OPT_STR, &token_file, "FILE",
         "admit any key that presents the token in FILE (mode 0600; or set FUSION_ENROL_TOKEN)"},
        {"enrol-token", 0, FU_OPT_STR, &token, "TOKEN", "the same with the token itself (visible in ps)"},
        {"peer-token-file", 0, FU_OPT_STR, &peer_token_file, "FILE",
         "admit any key that presents the token in FILE as a peer only (mode 0600; or set FUSION_PEER_TOKEN)"},
        {"client-token-file", 0, FU_OPT_STR, &client_token_file, "FILE",
         "admit any key that presents the token in FILE as a client only (mode 0600; or set FUSION_CLIENT_TOKEN)"},
        {"model-root", 0, FU_OPT_STR, &model_roots, "DIR[:DIR...]",
         "serve the models under these directories (clients name a model by its path inside one)"},
        {"upload-gib", 0, FU_OPT_INT, &upload_gib, "GIB",
         "room for models clients upload (fusion submit --upload), kept under the data directory (default 64; 0: "
         "no uploads)"},
        {"backups", 0, FU_OPT_INT, &backups, "N", "spare peers to keep warm per job (default 1)"},
        {"heartbeat-ms", 0, FU_OPT_INT, &heartbeat_ms, "MS", "heartbeat interval (default 1000)"},
        {"data-dir", 0, FU_OPT_STR, &data_dir, "DIR", "scratch files (default: the store's directory)"},
        {"verify", 0, FU_OPT_DOUBLE, &verify, "F",
         "fraction 0..1 of micro-batches re-run on a second peer, for jobs whose spec has no \"verify\" (default "
         "0.25; 0: off)"},
        {"challenge-ms", 0, FU_OPT_INT, &challenge_ms, "MS",
         "a joining peer's claimed speed is capped by a checked computation this long at that speed (default 300; "
         "0: believe every profile, for a cluster of your own machines)"},
        {"grow-margin", 0, FU_OPT_DOUBLE, &grow, "F",
         "a job takes another stage (when planned, or later from peers that join) only when that shortens its "
         "predicted step by at least F (0..0.9; default 0.2; 0: every peer that lowers its slowest stage, and no "
         "growth)"},
        {"reputation-threshold", 0, FU_OPT_DOUBLE, &min_rep, "T",
         "peers whose reputation falls below T (0 < T <= 1) get no work (default 0.2)"},
        {"ready-timeout", 0, FU_OPT_INT, &ready_timeout, "SEC",
         "a stage not ready SEC after its assignment fails over to a backup (default 600)"},
        {"step-timeout", 0, FU_OPT_INT, &step_timeout, "SEC",
         "a job with no progress for SEC is recovered (default 0: max(120, 20 x slowest step))"},
        {"pause-grace", 0, FU_OPT_INT, &pause_grace, "SEC",
         "a stage whose peer is paused by its owner's machine keeps that peer SEC before it moves (default 300)"},
        {"max-jobs-per-client", 0, FU_OPT_INT, &client_jobs, "N", "unfinished jobs one client may have (default 64)"},
        {"max-mib-per-client", 0, FU_OPT_INT, &client_mib, "MIB",
         "MiB of specs, tokens and results one client's jobs may hold in the store (default 4096)"},
        {"max-submits-per-minute", 0, FU_OPT_INT, &client_per_min, "N",
         "submissions one client may make per minute (default 60)"},
        {"max-sessions-per-minute", 0, FU_OPT_INT, &sessions_per_min, "N",
         "generations one client may open in its serving jobs per minute (default 1200)"},
        {"keep-events", 0, FU_OPT_INT, &keep_events, "N",
         "events kept in the store; older ones are rolled into its audit archive (counts per day and kind, "
         "hash-chained) (default 100000; 0: no count limit)"},
        {"keep-events-days", 0, FU_OPT_DOUBLE, &keep_events_days, "DAYS",
         "events older than DAYS are rolled into the archive too (default 30; 0: no age limit)"},
        {"keep-jobs-days", 0, FU_OPT_DOUBLE, &keep_jobs_days, "DAYS",
         "a job that ended DAYS ago loses its result, tokens and result file; its row, spec, result hash and "
         "events stay (default 30; 0: kept for ever). Checkpoints go a minute after a job ends"},
        {"forget-days", 0, FU_OPT_DOUBLE, &forget_days, "DAYS",
         "a job whose artifacts were deleted DAYS ago (--keep-jobs-days) is forgotten: its row, spec text, stages "
         "and idempotency key go (a `forgotten` event keeps its result hash in the log); so is a peer that left or "
         "died DAYS ago at full reputation and that no stored stage names (default 0: kept for ever)"},
    };
    const fu_cmd cmd = {
        .prog = "fusion-broker",
        .usage = "--keys DIR --db FILE [options]",
        .summary = "Runs the fusion broker: keeps the registry of peers, schedules jobs onto them as\n"
                   "pipeline stages, keeps a backup pool, and stores jobs durably in SQLite.\n"
                   "Runs in the foreground; SIGTERM or SIGINT stop it.",
        FU_OPTS_TABLE(opts),
    };
    int code;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!keys || !db)
        return fu_opts_usage_error(&cmd, "--keys and --db are required");
    if (backups < 0 || backups > 64 || heartbeat_ms < 50 || heartbeat_ms > 60000) {
        fprintf(stderr, "fusion-broker: --backups must be 0..64 and --heartbeat-ms 50..60000\n");
        return FU_EXIT_USAGE;
    }
    if (!(verify >= 0 && verify <= 1) || !(min_rep > 0 && min_rep <= 1)) {
        fprintf(stderr, "fusion-broker: --verify must be 0..1 and --reputation-threshold in (0, 1]\n");
        return FU_EXIT_USAGE;
    }
    if (!(grow >= 0 && grow <= 0.9)) {
        fprintf(stderr, "fusion-broker: --grow-margin must be 0..0.9\n");
        return FU_EXIT_USAGE;
    }
    if (challenge_ms < 0 || challenge_ms > 10000) {
        fprintf(stderr, "fusion-broker: --challenge-ms must be 0..10000\n");
        return FU_EXIT_USAGE;
    }
    if (ready_timeout < 1 || ready_timeout > BROKER_TIMEOUT_MAX_S || step_timeout < 0 ||
        step_timeout > BROKER_TIMEOUT_MAX_S || pause_grace < 1 || pause_grace > BROKER_TIMEOUT_MAX_S) {
        fprintf(stderr, "fusion-broker: --ready-timeout and --pause-grace must be 1..%d seconds and --step-timeout "
                        "0..%d (0: derived)\n", BROKER_TIMEOUT_MAX_S, BROKER_TIMEOUT_MAX_S);
        return FU_EXIT_USAGE;
    }
    if (upload_gib < 0 || upload_gib > (1 << 20)) {
        fprintf(stderr, "fusion-broker: --upload-gib must be 0..1048576\n");
        return FU_EXIT_USAGE;
    }
    if (client_jobs < 1 || client_jobs > 1000000 || client_mib < 1 || client_mib > (1 << 24) || client_per_min < 1 ||
        client_per_min > 1000000 || sessions_per_min < 1 || sessions_per_min > 1000000) {
        fprintf(stderr, "fusion-broker: --max-jobs-per-client, --max-submits-per-minute and --max-sessions-per-minute "
                        "must be 1..1000000, "
                        "--max-mib-per-client 1..16777216\n");
        return FU_EXIT_USAGE;
    }
    if (keep_events < 0 || !(keep_events_days >= 0 && keep_events_days <= 36500) ||
        !(keep_jobs_days >= 0 && keep_jobs_days <= 36500) || !(forget_days >= 0 && forget_days <= 36500)) {
        fprintf(stderr, "fusion-broker: --keep-events must be >= 0, --keep-events-days, --keep-jobs-days and "
                        "--forget-days 0..36500 (0: no limit)\n");
        return FU_EXIT_USAGE;
    }
    char token_buf[WIRE_TOKEN_Z85_LEN + 1];
    fu_errmsg tem = {{0}};
    char peer_buf[WIRE_TOKEN_Z85_LEN + 1], client_buf[WIRE_TOKEN_Z85_LEN + 1];
    const char *peer_token = NULL, *client_token = NULL;
    if (wire_token_choose(token_file, token, "FUSION_ENROL_TOKEN", token_buf, &token, &tem) != FU_OK ||
        wire_token_choose(peer_token_file, NULL, "FUSION_PEER_TOKEN", peer_buf, &peer_token, &tem) != FU_OK ||
        wire_token_choose(client_token_file, NULL, "FUSION_CLIENT_TOKEN", client_buf, &client_token, &tem) != FU_OK) {
        fprintf(stderr, "fusion-broker: %s\n", tem.msg);
        return FU_EXIT_USAGE;
    }
    if (!allow && !token && !peer_token && !client_token)
        fprintf(stderr, "fusion-broker: neither --allow nor an enrolment token given: no key will be admitted\n");
    if (allow && (code = allow_file_usable(allow, token || peer_token || client_token)) != FU_EXIT_OK)
        return code;
    struct sockaddr_in http_sa;
    fu_errmsg hem = {{0}};
    if (http && broker_http_parse_addr(http, &http_sa, &hem) != FU_OK) {
        fprintf(stderr, "fusion-broker: %s\n", hem.msg);
        return FU_EXIT_USAGE;
    }
    static const int stop_signals[] = {SIGTERM, SIGINT};
    code =
        fu_opts_daemon_start(cmd.prog, on_signal, stop_signals, sizeof stop_signals / sizeof *stop_signals);
    if (code != FU_EXIT_OK)
        return code;

    broker_cfg cfg = {.bind = bind, .gateway_bind = gateway_bind, .keys_dir = keys, .db_path = db, .init_store = init_store,
                      .check_store = check_store, .allow_file = allow, .http = http, .enrol_token = token,
                      .peer_token = peer_token, .client_token = client_token,
                      .data_dir = data_dir, .model_roots = model_roots, .backups = (uint32_t)backups, .heartbeat_ms = (uint32_t)heartbeat_ms,
                      .verify = verify, .min_reputation = min_rep,
                      .ready_timeout_s = (uint32_t)ready_timeout, .step_timeout_s = (uint32_t)step_timeout,
                      .pause_grace_s = (uint32_t)pause_grace, .client_jobs = (uint32_t)client_jobs,
                      .client_mib = (uint32_t)client_mib, .client_per_min = (uint32_t)client_per_min,
                      .sessions_per_min = (uint32_t)sessions_per_min,
                      .challenge_ms = (uint32_t)challenge_ms, .grow_margin = grow,
                      .upload_gib = (uint32_t)upload_gib,
                      /* 0 on the command line is "no limit", which the configuration says with -1 */
                      .keep_events = keep_events ? keep_events : -1,
                      .keep_events_days = keep_events_days > 0 ? keep_events_days : -1,
                      .keep_jobs_days = keep_jobs_days > 0 ? keep_jobs_days : -1, .forget_days = forget_days};
    fu_err err = FU_OK;
    fu_errmsg em = {{0}};
    broker_t *b = broker_new(&cfg, &err, &em);
    if (!b) {
        fprintf(stderr, "fusion-broker: %s\n", fu_errmsg_text(&em, err));
        return err == FU_EAUTH || err == FU_EPERM ? FU_EXIT_AUTH : FU_EXIT_FAIL;
    }
    fu_err rc = broker_run(b);
    broker_destroy(&b);
    FU_INFO("broker", "stopped");
    return rc == FU_OK ? FU_EXIT_OK : FU_EXIT_FAIL;
}
