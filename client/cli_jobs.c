/* `fusion status`, `jobs`, `wait`, `cancel`, `peers`: reading and steering jobs on a broker. */
#include "cli_jobs.h"

#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cli_progress.h"
#include "fu_alloc.h"
#include "fu_clock.h"

const char *cli_job_state_name(Fusion__JobState s)
{
    switch (s) {
    case FUSION__JOB_STATE__JOB_STATE_QUEUED:
        return "queued";
    case FUSION__JOB_STATE__JOB_STATE_RUNNING:
        return "running";
    case FUSION__JOB_STATE__JOB_STATE_DONE:
        return "done";
    case FUSION__JOB_STATE__JOB_STATE_FAILED:
        return "failed";
    case FUSION__JOB_STATE__JOB_STATE_CANCELED:
        return "cancelled";
    default:
        return "unknown";
    }
}

static const char *kind_name(Fusion__JobKind k)
{
    return k == FUSION__JOB_KIND__JOB_KIND_FINETUNE ? "finetune"
           : k == FUSION__JOB_KIND__JOB_KIND_INFER  ? "infer"
           : k == FUSION__JOB_KIND__JOB_KIND_EVAL   ? "eval"
                                                    : "?";
}

static cJSON *status_json(const Fusion__JobStatus *s)
{
    char id[17];
    cli_job_id_format(s->job_id, id);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "job", id);
    cJSON_AddStringToObject(o, "kind", kind_name(s->kind));
    cJSON_AddStringToObject(o, "state", cli_job_state_name(s->state));
    cJSON_AddNumberToObject(o, "step", (double)s->step);
    cJSON_AddNumberToObject(o, "total_steps", (double)s->total_steps);
    cJSON_AddNumberToObject(o, "loss", s->loss);
    cJSON_AddStringToObject(o, "message", s->message ? s->message : "");
    cJSON_AddNumberToObject(o, "stages", s->stages);
    cJSON_AddNumberToObject(o, "created_ms", (double)s->created_ms);
    cJSON_AddNumberToObject(o, "updated_ms", (double)s->updated_ms);
    cJSON_AddNumberToObject(o, "tokens_per_s", s->tokens_per_s);
    if (s->micro_batches)
        cJSON_AddNumberToObject(o, "micro_batches", s->micro_batches);
    if (s->kind == FUSION__JOB_KIND__JOB_KIND_FINETUNE && s->verify >= 0)
        cJSON_AddNumberToObject(o, "verify", s->verify);
    cJSON *stages = cJSON_AddArrayToObject(o, "stage_peers");
    for (size_t i = 0; i < s->n_stage_info; i++) {
        const Fusion__JobStage *st = s->stage_info[i];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "index", st->index);
        cJSON_AddStringToObject(e, "peer", st->peer_id ? st->peer_id : "");
        cJSON_AddStringToObject(e, "name", st->peer_name ? st->peer_name : "");
        cJSON_AddStringToObject(e, "layers", st->layers ? st->layers : "");
        cJSON_AddNumberToObject(e, "node_begin", st->node_begin);
        cJSON_AddNumberToObject(e, "node_end", st->node_end);
        cJSON_AddItemToArray(stages, e);
    }
    if (s->n_stage_info > 1) { /* what `fusion run finetune --cuts` takes to run the same stages */
        char cuts[256] = "";
        size_t n = 0;
        for (size_t i = 1; i < s->n_stage_info && n < sizeof cuts; i++)
            n += (size_t)snprintf(cuts + n, sizeof cuts - n, "%s%u", i > 1 ? "," : "", s->stage_info[i]->node_begin);
        cJSON_AddStringToObject(o, "cuts", cuts);
    }
    if (s->output && s->output[0])
        cJSON_AddStringToObject(o, "output", s->output);
    return o;
}

static void print_json(cJSON *o)
{
    char *txt = cJSON_PrintUnformatted(o);
    printf("%s\n", txt ? txt : "null");
    free(txt);
    cJSON_Delete(o);
}

static void print_status_row(const Fusion__JobStatus *s)
{
    char id[17];
    cli_job_id_format(s->job_id, id);
    char step[48] = "-";
    if (s->total_steps)
        snprintf(step, sizeof step, "%" PRIu64 "/%" PRIu64, s->step, s->total_steps);
    char loss[32] = "-";
    if (s->step && s->kind != FUSION__JOB_KIND__JOB_KIND_INFER)
        snprintf(loss, sizeof loss, "%.4f", s->loss);
    printf("%-16s  %-8s  %-9s  %-11s  %-8s  %s\n", id, kind_name(s->kind), cli_job_state_name(s->state), step, loss,
           s->message ? s->message : "");
}

const char *cli_job_verify_text(const Fusion__JobStatus *s, char *buf, size_t cap)
{
    buf[0] = '\0';
    if (s->kind != FUSION__JOB_KIND__JOB_KIND_FINETUNE || s->verify < 0)
        return buf;
    if (s->verify == 0)
        snprintf(buf, cap, "verification off (no micro-batch is re-run on a second peer)");
    else
        snprintf(buf, cap, "%g%% of micro-batches verified on a second peer", 100.0 * s->verify);
    return buf;
}

/* Asks for one job's status. */
fu_err cli_job_fetch_status(cli_conn_t *conn, uint64_t id, wire_msg_t **m, int *code)
{
    Fusion__JobRef ref = FUSION__JOB_REF__INIT;
    ref.job_id = id;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ, .job_id = id};
    return cli_conn_call(conn, &h, &ref.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, m, code);
}

fu_err cli_job_watch_status(cli_conn_t *conn, uint64_t id, uint32_t wait_ms, uint64_t known_len, wire_msg_t **m,
                            int *code)
{
    Fusion__JobRef ref = FUSION__JOB_REF__INIT;
    ref.job_id = id;
    ref.wait_ms = wait_ms;
    ref.known_output_len = known_len;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ, .job_id = id};
    return cli_conn_call(conn, &h, &ref.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, m, code);
}

bool cli_job_poll_pause(uint64_t started_ms, uint32_t wait_ms)
{
    return fu_clock_ms() - started_ms < wait_ms / 8;
}

/* Options every job-reading command shares. */
typedef struct {
    cli_conn_opts conn;
    bool json;
} read_opts;

/* The fu_opt entries of read_opts, bound to *o. */
#define READ_OPTS(o) CLI_CONN_OPTS(&(o)->conn), {"json", 0, FU_OPT_FLAG, &(o)->json, NULL, "print JSON"}

fu_err cli_job_submit(cli_conn_t *conn, Fusion__JobKind kind, const char *spec_json, const uint8_t *data, size_t len,
                      const char *idem, wire_msg_t **m, int *code)
{
    Fusion__JobSubmit sub = FUSION__JOB_SUBMIT__INIT;
    sub.idempotency_key = (char *)idem;
    sub.kind = kind;
    sub.spec_json = (char *)spec_json;
    sub.data.data = (uint8_t *)data;
    sub.data.len = len;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_SUBMIT};
    fu_err rc = FU_ETIMEDOUT;
    for (int t = 0; t < CLI_SUBMIT_TRIES && rc == FU_ETIMEDOUT; t++)
        rc = cli_conn_call(conn, &h, &sub.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, m, code);
    return rc;
}

fu_err cli_job_cancel(cli_conn_t *conn, uint64_t id, int *code)
{
    Fusion__JobRef ref = FUSION__JOB_REF__INIT;
    ref.job_id = id;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_CANCEL, .job_id = id};
    wire_msg_t *m = NULL;
    fu_err rc = cli_conn_call(conn, &h, &ref.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, &m, code);
    wire_msg_destroy(&m);
    return rc;
}

void cli_print_status_json(const Fusion__JobStatus *s)
{
    print_json(status_json(s));
}

/* Prints one job (one; a JSON object) or a list of them (l when one is NULL; a JSON array), as a
 * table or, with --json, as JSON. */
static void print_jobs(const read_opts *o, const Fusion__JobStatus *one, const Fusion__JobList *l)
{
    cJSON *arr = o->json && !one ? cJSON_CreateArray() : NULL;
    if (!o->json)
        printf("%-16s  %-8s  %-9s  %-11s  %-8s  %s\n", "JOB", "KIND", "STATE", "STEP", "LOSS", "MESSAGE");
    for (size_t i = 0; i < (one ? 1 : l->n_jobs); i++) {
        const Fusion__JobStatus *s = one ? one : l->jobs[i];
        if (arr)
            cJSON_AddItemToArray(arr, status_json(s));
        else if (o->json)
            print_json(status_json(s));
        else
            print_status_row(s);
    }
    char ver[96];
    if (one && !o->json && cli_job_verify_text(one, ver, sizeof ver)[0])
        printf("%s\n", ver);
    if (arr)
        print_json(arr);
}

/* Lists the caller's jobs (unfinished only when active): the body of `fusion jobs` and of
 * `fusion status` without a JOB. */
static int list_jobs(const char *prog, const read_opts *o, bool active)
{
    Fusion__JobListRequest req = FUSION__JOB_LIST_REQUEST__INIT;
    req.include_done = !active;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_LIST_REQ};
    wire_msg_t *m = NULL;
    int code;
    if (cli_conn_request(prog, &o->conn, &h, &req.base, FUSION__MSG_TYPE__MSG_JOB_LIST, &m, &code) != FU_OK)
        return code;
    print_jobs(o, NULL, (const Fusion__JobList *)wire_msg_body(m));
    wire_msg_destroy(&m);
    return FU_EXIT_OK;
}

int cli_status_main(int argc, char **argv)
{
    read_opts o = {0};
    const fu_opt opts[] = {READ_OPTS(&o)};
    const fu_cmd cmd = {.prog = argv[0], .usage = "[JOB] [options]",
                        .summary = "Shows one job (or, without JOB, all of yours): state, step, loss, and why a "
                                   "queued job waits.",
                        FU_OPTS_TABLE(opts), .min_pos = 0, .max_pos = 1};
    uint64_t id;
    size_t npos;
    int code;
    if (cli_job_cmd_parse(&cmd, argc, argv, &id, &npos, &code) != FU_OK)
        return code;
    if (npos == 0) /* argv has been consumed by the parse: list from the parsed options */
        return list_jobs(argv[0], &o, false);
    Fusion__JobRef ref = FUSION__JOB_REF__INIT;
    ref.job_id = id;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ, .job_id = id};
    wire_msg_t *m = NULL;
    if (cli_conn_request(argv[0], &o.conn, &h, &ref.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, &m, &code) !=
        FU_OK)
        return code;
    print_jobs(&o, (const Fusion__JobStatus *)wire_msg_body(m), NULL);
    wire_msg_destroy(&m);
    return FU_EXIT_OK;
}

int cli_jobs_main(int argc, char **argv)
{
    read_opts o = {0};
    bool active = false;
    const fu_opt opts[] = {READ_OPTS(&o),
                           {"active", 0, FU_OPT_FLAG, &active, NULL, "only queued and running jobs"}};
    const fu_cmd cmd = {.prog = argv[0], .usage = "[options]",
                        .summary = "Lists your jobs on the broker (jobs of other keys are never shown).",
                        FU_OPTS_TABLE(opts), .min_pos = 0, .max_pos = 0};
    int code;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    return list_jobs(argv[0], &o, active);
}

/* Draws the progress line of a running job on a terminal (cli_progress.h): step of steps, loss,
 * tokens/s, and the broker's message when it says more than that the job runs. Without a terminal,
 * a line per new step. */
static void show_progress(const Fusion__JobStatus *s, bool tty, cli_progress *pc)
{
    if (!s->total_steps || !s->step)
        return;
    if (!tty) {
        fprintf(stderr, "step %" PRIu64 "/%" PRIu64 " loss %.4f %.0f tok/s\n", s->step, s->total_steps, s->loss,
                s->tokens_per_s);
        return;
    }
    const char *msg = s->message ? s->message : "";
    if (strncmp(msg, "running on ", 11) == 0)
        msg = ""; /* the step and the stages are shown already */
    char count[48], detail[64];
    snprintf(count, sizeof count, "%" PRIu64 "/%" PRIu64, s->step, s->total_steps);
    snprintf(detail, sizeof detail, "loss %.4f %.0f tok/s", s->loss, s->tokens_per_s);
    cli_progress_draw(pc, (double)s->step, (double)s->total_steps, count, detail, msg);
}

/* Prints the job's stages and their peers when they differ from what was printed last (a new plan,
 * or a stage that moved to a backup). seen holds the last printed list. */
static void show_stages(const Fusion__JobStatus *s, char *seen, size_t seen_cap)
{
    char now[1024] = "";
    size_t n = 0;
    for (size_t i = 0; i < s->n_stage_info && n < sizeof now; i++) {
        const Fusion__JobStage *st = s->stage_info[i];
        n += (size_t)snprintf(now + n, sizeof now - n, "%s%u: %s (%s)", i ? ", " : "", st->index,
                              st->peer_name && st->peer_name[0] ? st->peer_name : st->peer_id,
                              st->layers ? st->layers : "");
    }
    if (!now[0] || strcmp(now, seen) == 0)
        return;
    cli_progress_clear(); /* printed over the progress line, which the next redraw puts back */
    fprintf(stderr, "stages: %s\n", now);
    snprintf(seen, seen_cap, "%s", now);
}

/* Ctrl-C on `fusion wait`: the job is the broker's and goes on; say so, and how to come back. */
static char g_wait_note[256];

static void on_wait_interrupt(int sig)
{
    (void)sig;
    ssize_t w = write(STDERR_FILENO, g_wait_note, strlen(g_wait_note));
    (void)w;
    _exit(130);
}

static void wait_note_install(const char *prog, uint64_t id)
{
    char idt[17];
    cli_job_id_format(id, idt);
    snprintf(g_wait_note, sizeof g_wait_note,
             "\n%s: stopped following job %s; it goes on on the broker (`fusion wait %s` follows it again, "
             "`fusion cancel %s` stops it)\n", prog, idt, idt, idt);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_wait_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

int cli_wait_job(cli_conn_t *conn, const char *prog, uint64_t id, double timeout_s, bool quiet, bool json)
{
    quiet = quiet || json; /* stdout is the final status alone */
    char stages_seen[1024] = "";
    bool tty = isatty(STDERR_FILENO) && !quiet;
    uint64_t last_step = UINT64_MAX;
    size_t printed = 0; /* bytes of generated text already written */
    double start = fu_clock_sec();
    cli_progress pc;
    cli_progress_init(&pc);
    wait_note_install(prog, id);
    char last_msg[256] = "";
    bool infer = false; /* an inference's text is long-polled: each token shows as it comes */
    size_t known = 0;   /* the length of the text the last answer had */
    for (;;) {
        wire_msg_t *m = NULL;
        int code;
        uint64_t asked = fu_clock_ms();
        if ((infer ? cli_job_watch_status(conn, id, CLI_WAIT_LONG_POLL_MS, known, &m, &code)
                   : cli_job_fetch_status(conn, id, &m, &code)) != FU_OK)
            return code;
        const Fusion__JobStatus *s = (const Fusion__JobStatus *)wire_msg_body(m);
        size_t out_len = s->output ? strlen(s->output) : 0;
        bool news = out_len != known;
        known = out_len;
        infer = s->kind == FUSION__JOB_KIND__JOB_KIND_INFER;
        if (out_len > printed && !json) {
            fwrite(s->output + printed, 1, out_len - printed, stdout);
            fflush(stdout);
            printed = out_len;
        }
        const char *msg = s->message ? s->message : "";
        if (!quiet && s->state == FUSION__JOB_STATE__JOB_STATE_QUEUED && strcmp(msg, last_msg) != 0) {
            cli_progress_clear();
            fprintf(stderr, "queued: %s\n", msg);
            snprintf(last_msg, sizeof last_msg, "%s", msg);
        }
        if (!quiet)
            show_stages(s, stages_seen, sizeof stages_seen);
        if (!quiet && s->kind != FUSION__JOB_KIND__JOB_KIND_INFER && s->step != last_step) {
            show_progress(s, tty, &pc);
            last_step = s->step;
        }
        Fusion__JobState st = s->state;
        char final_msg[512];
        snprintf(final_msg, sizeof final_msg, "%s", msg);
        uint64_t step = s->step;
        bool over = st == FUSION__JOB_STATE__JOB_STATE_DONE || st == FUSION__JOB_STATE__JOB_STATE_FAILED ||
                    st == FUSION__JOB_STATE__JOB_STATE_CANCELED;
        bool timed_out = !over && timeout_s > 0 && fu_clock_sec() - start > timeout_s;
        if (json && (over || timed_out))
            print_json(status_json(s));
        wire_msg_destroy(&m);

        if (over) {
            cli_progress_break();
            if (printed)
                putchar('\n');
            char idt[17];
            cli_job_id_format(id, idt);
            if (st == FUSION__JOB_STATE__JOB_STATE_DONE) {
                if (!quiet)
                    fprintf(stderr, "job %s done\n", idt);
                return FU_EXIT_OK;
            }
            fprintf(stderr, "%s: job %s %s%s%s\n", prog, idt, cli_job_state_name(st), final_msg[0] ? ": " : "",
                    final_msg);
            return FU_EXIT_FAIL;
        }
        if (timed_out) {
            cli_progress_break();
            fprintf(stderr, "%s: still %s after %.0f s (step %" PRIu64 "); run `fusion wait` again to follow it\n",
                    prog, cli_job_state_name(st), timeout_s, step);
            return FU_EXIT_TIMEOUT;
        }
        if (!infer || (!news && cli_job_poll_pause(asked, CLI_WAIT_LONG_POLL_MS)))
            fu_sleep_ms(CLI_WAIT_POLL_MS);
    }
}

fu_err cli_job_output(cli_conn_t *conn, const char *prog, uint64_t id, char **output, int *code)
{
    for (;;) {
        wire_msg_t *m = NULL;
        if (cli_job_fetch_status(conn, id, &m, code) != FU_OK)
            return FU_EIO;
        const Fusion__JobStatus *s = (const Fusion__JobStatus *)wire_msg_body(m);
        Fusion__JobState st = s->state;
        if (st == FUSION__JOB_STATE__JOB_STATE_DONE) {
            *output = fu_strdup(s->output ? s->output : "");
            wire_msg_destroy(&m);
            return FU_OK;
        }
        if (st == FUSION__JOB_STATE__JOB_STATE_FAILED || st == FUSION__JOB_STATE__JOB_STATE_CANCELED) {
            char idt[17];
            cli_job_id_format(id, idt);
            fprintf(stderr, "%s: job %s %s%s%s\n", prog, idt, cli_job_state_name(st), s->message && s->message[0] ? ": " : "",
                    s->message ? s->message : "");
            wire_msg_destroy(&m);
            *code = FU_EXIT_FAIL;
            return FU_EINVAL;
        }
        wire_msg_destroy(&m);
        fu_sleep_ms(CLI_WAIT_POLL_MS);
    }
}

int cli_wait_main(int argc, char **argv)
{
    cli_conn_opts co = {0};
    double timeout = 0;
    bool quiet = false, json = false;
    const fu_opt opts[] = {CLI_CONN_OPTS(&co),
                           {"wait-timeout", 0, FU_OPT_DOUBLE, &timeout, "S", "give up after S seconds (exit 5)"},
                           {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "no progress bar"},
                           {"json", 0, FU_OPT_FLAG, &json, NULL,
                            "print the job's last status as JSON (as `fusion status --json`), nothing else"}};
    const fu_cmd cmd = {.prog = argv[0], .usage = "JOB [options]",
                        .summary = "Follows a job until it ends, with a progress bar (step of steps, loss, "
                                   "tokens/s); an inference job's text is printed as it is generated.",
                        FU_OPTS_TABLE(opts), .min_pos = 1, .max_pos = 1};
    uint64_t id;
    int code;
    if (cli_job_cmd_parse(&cmd, argc, argv, &id, NULL, &code) != FU_OK)
        return code;
    cli_conn_t *conn = NULL;
    if (cli_conn_open(argv[0], &co, &conn, &code) != FU_OK)
        return code;
    code = cli_wait_job(conn, argv[0], id, timeout, quiet, json);
    cli_conn_close(&conn);
    return code;
}

int cli_cancel_main(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const fu_opt opts[] = {CLI_CONN_OPTS(&co)};
    const fu_cmd cmd = {.prog = argv[0], .usage = "JOB [options]",
                        .summary = "Cancels one of your jobs; its stages are released. A finished job cannot be "
                                   "cancelled, and another key's job is not found.",
                        FU_OPTS_TABLE(opts), .min_pos = 1, .max_pos = 1};
    uint64_t id;
    int code;
    if (cli_job_cmd_parse(&cmd, argc, argv, &id, NULL, &code) != FU_OK)
        return code;
    Fusion__JobRef ref = FUSION__JOB_REF__INIT;
    ref.job_id = id;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_CANCEL, .job_id = id};
    wire_msg_t *m = NULL;
    if (cli_conn_request(argv[0], &co, &h, &ref.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, &m, &code) != FU_OK)
        return code;
    const Fusion__JobStatus *s = (const Fusion__JobStatus *)wire_msg_body(m);
    printf("job %s: %s\n", argv[1], cli_job_state_name(s->state));
    wire_msg_destroy(&m);
    return FU_EXIT_OK;
}

static const char *peer_state_name(Fusion__PeerState s)
{
    switch (s) {
    case FUSION__PEER_STATE__PEER_STATE_IDLE:
        return "idle";
    case FUSION__PEER_STATE__PEER_STATE_WARM:
        return "backup";
    case FUSION__PEER_STATE__PEER_STATE_BUSY:
        return "busy";
    case FUSION__PEER_STATE__PEER_STATE_DRAINING:
        return "leaving";
    case FUSION__PEER_STATE__PEER_STATE_DEAD:
        return "dead";
    case FUSION__PEER_STATE__PEER_STATE_PAUSED:
        return "paused";
    default:
        return "unknown";
    }
}

static double best_gflops(const Fusion__PeerProfile *p)
{
    double best = 0;
    for (size_t i = 0; p && i < p->n_speeds; i++)
        if (p->speeds[i]->gemm_gflops > best)
            best = p->speeds[i]->gemm_gflops;
    return best;
}

/* One peer as `fusion peers --json` prints it; stage is the job/stage it runs, or "-". */
static cJSON *peer_json(const Fusion__PeerInfo *p, const char *stage)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "peer", p->peer_id ? p->peer_id : "");
    cJSON_AddStringToObject(e, "name", p->name ? p->name : "");
    cJSON_AddStringToObject(e, "device",
                            p->profile && p->profile->device_name ? p->profile->device_name : "");
    cJSON_AddStringToObject(e, "numeric_class",
                            p->profile && p->profile->numeric_class ? p->profile->numeric_class : "");
    cJSON_AddNumberToObject(e, "gflops", best_gflops(p->profile));
    cJSON_AddNumberToObject(e, "gflops_claimed", p->gflops_claimed);
    cJSON_AddNumberToObject(e, "gflops_verified", p->gflops_verified);
    cJSON_AddStringToObject(e, "profile_check", p->profile_check ? p->profile_check : "");
    cJSON_AddNumberToObject(e, "memory_bytes", p->profile ? (double)p->profile->free_memory_bytes : 0);
    cJSON_AddNumberToObject(e, "link_bandwidth_bps", p->profile ? p->profile->link_bandwidth_bps : 0);
    cJSON_AddNumberToObject(e, "link_latency_ms", p->profile ? p->profile->link_latency_ms : 0);
    cJSON_AddStringToObject(e, "state", peer_state_name(p->state));
    cJSON_AddStringToObject(e, "stage", stage);
    cJSON_AddNumberToObject(e, "reputation", p->reputation);
    cJSON_AddNumberToObject(e, "last_seen_ms", (double)p->last_seen_ms);
    if (p->state == FUSION__PEER_STATE__PEER_STATE_PAUSED) {
        cJSON_AddStringToObject(e, "pause_reason", p->pause_reason ? p->pause_reason : "");
        cJSON_AddNumberToObject(e, "paused_ms", (double)p->paused_ms);
    }
    return e;
}

int cli_peers_main(int argc, char **argv)
{
    read_opts o = {0};
    const fu_opt opts[] = {READ_OPTS(&o)};
    const fu_cmd cmd = {.prog = argv[0], .usage = "[options]",
                        .summary = "Lists the broker's peers: name, device, the GEMM GFLOP/s plans use and whether its "
                                   "profile challenge verified it, memory, state, the job stage each runs, and "
                                   "reputation.",
                        FU_OPTS_TABLE(opts), .min_pos = 0, .max_pos = 0};
    int code;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_PEER_LIST_REQ};
    wire_msg_t *m = NULL;
    if (cli_conn_request(argv[0], &o.conn, &h, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, &m, &code) != FU_OK)
        return code;
    const Fusion__PeerList *l = (const Fusion__PeerList *)wire_msg_body(m);
    cJSON *arr = o.json ? cJSON_CreateArray() : NULL;
    if (!o.json)
        printf("%-14s  %-28s  %8s  %-8s  %8s  %-7s  %-20s  %s\n", "NAME", "DEVICE", "GFLOP/s", "CHECKED", "MEM GiB",
               "STATE", "STAGE", "REPUTATION");
    for (size_t i = 0; i < l->n_peers; i++) {
        const Fusion__PeerInfo *p = l->peers[i];
        char stage[48] = "-";
        if (p->job_id) {
            char jid[17];
            cli_job_id_format(p->job_id, jid);
            snprintf(stage, sizeof stage, "%s/%u", jid, p->stage_index);
        }
        if (arr) {
            cJSON_AddItemToArray(arr, peer_json(p, stage));
            continue;
        }
        double mem = p->profile ? (double)p->profile->free_memory_bytes / (double)(1ull << 30) : 0;
        printf("%-14.14s  %-28.28s  %8.1f  %-8.8s  %8.2f  %-7s  %-20s  %.2f\n", p->name ? p->name : "",
               p->profile && p->profile->device_name ? p->profile->device_name : "", best_gflops(p->profile),
               p->profile_check && *p->profile_check ? p->profile_check : "-", mem, peer_state_name(p->state), stage,
               p->reputation);
        if (p->state == FUSION__PEER_STATE__PEER_STATE_PAUSED) /* the reason on a line of its own */
            printf("%-14s  paused %llds: %s\n", "", (long long)(p->paused_ms / 1000),
                   p->pause_reason && *p->pause_reason ? p->pause_reason : "no reason given");
    }
    if (arr)
        print_json(arr);
    wire_msg_destroy(&m);
    return FU_EXIT_OK;
}
