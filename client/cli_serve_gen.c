/* `fusion serve`: one generation request (see cli_serve.h). Its prompt is tokenized here (a chat in
 * the model's chat format), its job submitted with a fresh idempotency key, and its text read back from
 * the job's status every SERVE_POLL_MS: answered whole, or passed on as server-sent events as it
 * grows, never past a stop string or the end-of-sequence token's text. The job is cancelled when the
 * client goes away, a stop string comes, the request times out or the gateway stops. */
#define _GNU_SOURCE /* POLLRDHUP */
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>

#include "cli_jobs.h"
#include "cli_serve.h"
#include "fu_alloc.h"
#include "fu_clock.h"

#define SERVE_POLL_MS            50  /* how often a request asks a broker that does not hold requests */
#define SERVE_LONG_POLL_MS       500 /* how long the broker may hold a request's question about its text
                                        (a client that hung up is noticed within this) */
#define SERVE_COMPLETION_DEFAULT 16 /* /v1/completions' max_tokens when absent (OpenAI's) */

typedef struct {
    serve_t *s;
    cli_conn_t *conn;
    cli_oai_req req;
    uint64_t job;        /* the request's job, or with --sessions the serving job it is a session of */
    uint32_t session;    /* with --sessions: its session in job (0: a job of its own) */
    bool submitted, over, conn_broken;
    char id[48];
    int64_t created;
    double started, deadline;
    bool gone;           /* the client went away before the end */
    bool queued;         /* at the last look its job was still in the broker's queue */
    char why[256];       /* what the broker said it waits for */
    const char *stops[CLI_OAI_MAX_STOP + FU_MODELCFG_MAX_EOS]; /* the request's, then the EOS texts */
    size_t n_stops;
    cli_oai_usage usage;
    char *text;          /* the text generated so far (the broker's JobStatus.output) */
    size_t known;        /* the length of the output the broker's last answer had (the long poll's) */
    bool pause;          /* the last look came back at once with nothing new: wait before the next */
    size_t len, sent;    /* its bytes, and how many were passed on */
    size_t avail;        /* how many may be passed on (cli_oai_release) */
    const char *finish;  /* "stop" or "length" once ended */
    unsigned err_status; /* an error ended it: the HTTP status, type and message */
    const char *err_type;
    char err[512];
    /* streaming */
    struct MHD_Connection *mc;
    char *out;           /* server-sent events not yet taken by libmicrohttpd */
    size_t out_len, out_off;
    bool first_sent, end_sent;
} gen_t;

static void gen_fail(gen_t *g, unsigned status, const char *type, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
static void gen_fail(gen_t *g, unsigned status, const char *type, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->err, sizeof g->err, fmt, ap);
    va_end(ap);
    g->err_status = status;
    g->err_type = type;
    g->over = true;
}

/* The broker's refusal of the last call on g's connection, as g's error. */
static void gen_fail_broker(gen_t *g)
{
    int bc;
    const char *type, *why = cli_conn_last_error(g->conn, &bc);
    unsigned st = serve_status_of(bc, &type);
    g->conn_broken = bc < 0;
    gen_fail(g, st, type, "%s", why[0] ? why : "the broker did not answer");
}

/* The prompt's ids for g's request, or an error set on g. */
static bool gen_prompt(gen_t *g, int32_t **ids, size_t *n)
{
    const serve_t *s = g->s;
    const cli_oai_req *r = &g->req;
    fu_errmsg em = {{0}};
    fu_err rc;
    if (r->prompt_ids) {
        size_t vocab = fu_tokenizer_vocab_size(s->tok);
        for (size_t i = 0; i < r->n_prompt_ids; i++)
            if ((size_t)r->prompt_ids[i] >= vocab) {
                gen_fail(g, MHD_HTTP_BAD_REQUEST, "invalid_request_error",
                         "prompt: token %d is outside the model's vocabulary of %zu", r->prompt_ids[i], vocab);
                return false;
            }
        *ids = fu_malloc(r->n_prompt_ids * sizeof **ids);
        memcpy(*ids, r->prompt_ids, r->n_prompt_ids * sizeof **ids);
        *n = r->n_prompt_ids;
        return true;
    }
    if (r->chat) {
        if (s->chat == DAG_CHAT_NONE) {
            gen_fail(g, MHD_HTTP_BAD_REQUEST, "invalid_request_error", "%s", s->chat_err);
            return false;
        }
        if ((rc = dag_chat_prompt(s->tok, s->chat, (int32_t)s->cfg.bos_token_id, (int32_t)s->cfg.eos_token_id, r->msgs,
                                  r->n_msgs, ids, n, &em)) != FU_OK) {
            gen_fail(g, MHD_HTTP_BAD_REQUEST, "invalid_request_error", "messages: %s", fu_errmsg_text(&em, rc));
            return false;
        }
        return true;
    }
    rc = fu_tokenizer_encode(s->tok, r->prompt, strlen(r->prompt), ids, n, &em);
    if (rc != FU_OK || *n == 0) {
        free(*ids);
        *ids = NULL;
        gen_fail(g, MHD_HTTP_BAD_REQUEST, "invalid_request_error", "prompt: %s",
                 rc != FU_OK ? fu_errmsg_text(&em, rc) : "it is empty");
        return false;
    }
    return true;
}

/* Opens g's session in the serving job of its model name (submitted by the first request that names
 * it). A job holding all its sessions makes the request wait for one, up to the queue timeout; a job
 * that ended is replaced. False with g's error set. */
static bool gen_open(gen_t *g)
{
    serve_t *s = g->s;
    char adapter[DAG_SPEC_JOB_ID_LEN + 1];
    if (!serve_model_adapter(s, g->req.model, adapter)) {
        gen_fail(g, MHD_HTTP_NOT_FOUND, "invalid_request_error", "model '%s' is not served here (GET /v1/models)",
                 g->req.model);
        return false;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (!gen_prompt(g, &ids, &n))
        return false;
    g->usage.prompt_tokens = n;
    Fusion__SessionOpen o = FUSION__SESSION_OPEN__INIT;
    o.prompt_tokens = ids;
    o.n_prompt_tokens = n;
    o.max_tokens = g->req.max_tokens;
    o.temperature = g->req.temperature;
    o.top_p = g->req.top_p;
    o.top_k = g->req.top_k;
    o.seed = g->req.has_seed ? g->req.seed : randombytes_uniform(1u << 31); /* as gen_submit */
    o.stop = (char **)g->req.stop;
    o.n_stop = g->req.n_stop;
    bool ok = false;
    for (int renewed = 0; !ok;) {
        int bc = -1;
        char err[512] = "";
        uint64_t job = serve_job_for(s, g->conn, adapter, &bc, err, sizeof err);
        if (!job) {
            const char *type;
            unsigned st = serve_status_of(bc, &type);
            g->conn_broken = bc < 0;
            gen_fail(g, st, type, "no serving job for '%s': %s", g->req.model, err);
            break;
        }
        o.job_id = job;
        wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_SESSION_OPEN, .job_id = job};
        wire_msg_t *m = NULL;
        int code;
        cli_conn_set_quiet(g->conn, true);
        fu_err rc = cli_conn_call(g->conn, &h, &o.base, FUSION__MSG_TYPE__MSG_SESSION_STATUS, &m, &code);
        cli_conn_set_quiet(g->conn, false);
        if (rc == FU_OK) {
            g->job = job;
            g->session = ((const Fusion__SessionStatus *)wire_msg_body(m))->session;
            wire_msg_destroy(&m);
            ok = true;
            break;
        }
        (void)cli_conn_last_error(g->conn, &bc);
        if (bc == FUSION__ERROR_CODE__ERR_NOT_FOUND && renewed++ < 2) {
            serve_job_gone(s, job); /* it ended (cancelled elsewhere, failed): another one */
            continue;
        }
        if (bc == FUSION__ERROR_CODE__ERR_BUSY && !serve_stopping() &&
            fu_clock_sec() < g->started + s->queue_timeout_s) {
            fu_sleep_ms(SERVE_POLL_MS); /* every session is taken: wait for one to end */
            continue;
        }
        gen_fail_broker(g);
        if (bc == FUSION__ERROR_CODE__ERR_BUSY) {
            g->err_status = MHD_HTTP_SERVICE_UNAVAILABLE;
            g->err_type = "api_error";
        }
        break;
    }
    free(ids);
    if (!ok)
        return false;
    g->submitted = true;
    char jid[17];
    cli_job_id_format(g->job, jid);
    snprintf(g->id, sizeof g->id, "%s%s-%u", g->req.chat ? "chatcmpl-" : "cmpl-", jid, g->session);
    return true;
}

/* Submits g's job; false with g's error set. */
static bool gen_submit(gen_t *g)
{
    serve_t *s = g->s;
    if (s->sessions)
        return gen_open(g);
    dag_spec sp;
    dag_spec_init(&sp, DAG_JOB_INFER);
    snprintf(sp.model, sizeof sp.model, "%s", s->spec_model);
    if (!serve_model_adapter(s, g->req.model, sp.adapter_job)) {
        gen_fail(g, MHD_HTTP_NOT_FOUND, "invalid_request_error", "model '%s' is not served here (GET /v1/models)",
                 g->req.model);
        return false;
    }
    if (!gen_prompt(g, &sp.prompt_tokens, &sp.n_prompt_tokens))
        return false;
    g->usage.prompt_tokens = sp.n_prompt_tokens;
    sp.max_tokens = g->req.max_tokens;
    sp.temperature = g->req.temperature;
    sp.top_p = g->req.top_p;
    sp.top_k = g->req.top_k;
    for (size_t i = 0; i < g->req.n_stop; i++) /* the job ends at them itself (done, not cancelled) */
        snprintf(sp.stop[sp.n_stop++], sizeof sp.stop[0], "%s", g->req.stop[i]);
    /* no seed: a new draw each time, as OpenAI's API behaves; a seed repeats its text */
    sp.seed = g->req.has_seed ? g->req.seed : randombytes_uniform(1u << 31);
    fu_errmsg em = {{0}};
    fu_err rc = dag_spec_check(&sp, &em);
    if (rc != FU_OK) {
        gen_fail(g, MHD_HTTP_BAD_REQUEST, "invalid_request_error", "%s", fu_errmsg_text(&em, rc));
        dag_spec_clear(&sp);
        return false;
    }
    char *spec = dag_spec_to_json(&sp);
    dag_spec_clear(&sp);
    char idem[SERVE_IDEM_LEN];
    serve_idem_new(idem);
    wire_msg_t *m = NULL;
    int code;
    rc = cli_job_submit(g->conn, FUSION__JOB_KIND__JOB_KIND_INFER, spec, NULL, 0, idem, &m, &code);
    free(spec);
    if (rc != FU_OK) {
        gen_fail_broker(g);
        return false;
    }
    g->job = ((const Fusion__JobStatus *)wire_msg_body(m))->job_id;
    wire_msg_destroy(&m);
    g->submitted = true;
    char jid[17];
    cli_job_id_format(g->job, jid);
    snprintf(g->id, sizeof g->id, "%s%s", g->req.chat ? "chatcmpl-" : "cmpl-", jid);
    return true;
}

/* One call about g's session: its status (a long poll: wait_ms, the text's length known) or close. */
static fu_err session_call(gen_t *g, Fusion__MsgType type, uint32_t wait_ms, wire_msg_t **m)
{
    Fusion__SessionRef ref = FUSION__SESSION_REF__INIT;
    ref.job_id = g->job;
    ref.session = g->session;
    ref.wait_ms = wait_ms;
    ref.known_output_len = g->known;
    wire_hdr h = {.type = type, .job_id = g->job};
    int code;
    return cli_conn_call(g->conn, &h, &ref.base, FUSION__MSG_TYPE__MSG_SESSION_STATUS, m, &code);
}

/* Cancels g's job (closes its session) unless it is over (the client went, a stop string came, the
 * gateway stops). */
static void gen_cancel(gen_t *g)
{
    int code;
    wire_msg_t *m = NULL;
    if (g->submitted && !g->over && g->conn) {
        fu_err rc = g->session ? session_call(g, FUSION__MSG_TYPE__MSG_SESSION_CLOSE, 0, &m)
                               : cli_job_cancel(g->conn, g->job, &code);
        if (rc != FU_OK)
            g->conn_broken = true;
        wire_msg_destroy(&m);
    }
    g->over = true;
}

/* What g has so far: out (NULL: none), the broker's text in the answer to a long poll made at
 * asked_ms; the text only grows (a shorter one: tokens the broker dropped; keep ours). */
static void gen_text(gen_t *g, const char *out, uint64_t asked_ms)
{
    out = out ? out : "";
    size_t ol = strlen(out);
    g->pause = ol == g->known && cli_job_poll_pause(asked_ms, SERVE_LONG_POLL_MS);
    g->known = ol;
    if (ol >= g->len) {
        free(g->text);
        g->text = fu_strdup(out);
        g->len = ol;
    }
}

/* Where a session ended or not: done (finish as the broker says), failed, or on; then what may be
 * passed on (cli_oai_release). */
static void gen_release(gen_t *g, bool done, const char *finish)
{
    bool stopped;
    size_t rel = cli_oai_release(g->text ? g->text : "", g->len, g->stops, g->n_stops, done, g->sent, &stopped);
    if (stopped) {
        g->finish = "stop";
        if (done)
            g->over = true;
        else
            gen_cancel(g); /* it would generate on past the stop string */
    } else if (done) {
        g->finish = finish;
        g->over = true;
    }
    g->avail = rel;
}

/* One look at g's session (a long poll). */
static void gen_poll_session(gen_t *g)
{
    wire_msg_t *m = NULL;
    uint64_t asked = fu_clock_ms();
    if (session_call(g, FUSION__MSG_TYPE__MSG_SESSION_STATUS_REQ, SERVE_LONG_POLL_MS, &m) != FU_OK) {
        int bc;
        (void)cli_conn_last_error(g->conn, &bc);
        gen_fail_broker(g);
        if (bc == FUSION__ERROR_CODE__ERR_NOT_FOUND) { /* the session is gone: and its job? (a broker that
                                                          restarted keeps the job but not its sessions) */
            wire_msg_t *jm = NULL;
            int code;
            if (cli_job_watch_status(g->conn, g->job, 0, 0, &jm, &code) != FU_OK ||
                ((const Fusion__JobStatus *)wire_msg_body(jm))->state > FUSION__JOB_STATE__JOB_STATE_RUNNING)
                serve_job_gone(g->s, g->job);
            wire_msg_destroy(&jm);
            g->submitted = false; /* nothing left to close */
        }
        return;
    }
    const Fusion__SessionStatus *st = (const Fusion__SessionStatus *)wire_msg_body(m);
    gen_text(g, st->output, asked);
    g->usage.completion_tokens = st->tokens;
    g->queued = st->waiting && st->waiting[0];
    if (g->queued)
        snprintf(g->why, sizeof g->why, "%s", st->waiting);
    if (st->state == FUSION__JOB_STATE__JOB_STATE_FAILED || st->state == FUSION__JOB_STATE__JOB_STATE_CANCELED) {
        gen_fail(g, MHD_HTTP_BAD_GATEWAY, "api_error", "session %u of serving job %016" PRIx64 " %s: %s", g->session,
                 g->job, st->state == FUSION__JOB_STATE__JOB_STATE_FAILED ? "failed" : "was closed",
                 st->reason && st->reason[0] ? st->reason : "no reason given");
        g->submitted = false; /* nothing left to close */
        wire_msg_destroy(&m);
        return;
    }
    bool done = st->state == FUSION__JOB_STATE__JOB_STATE_DONE;
    const char *finish = st->finish_reason && strcmp(st->finish_reason, "length") == 0 ? "length" : "stop";
    wire_msg_destroy(&m);
    gen_release(g, done, finish);
}

/* One look at the job: the text so far, and whether (and how) it ended. */
static void gen_poll(gen_t *g)
{
    if (g->session) {
        gen_poll_session(g);
        return;
    }
    wire_msg_t *m = NULL;
    int code;
    uint64_t asked = fu_clock_ms();
    if (cli_job_watch_status(g->conn, g->job, SERVE_LONG_POLL_MS, g->known, &m, &code) != FU_OK) {
        gen_fail_broker(g);
        return;
    }
    const Fusion__JobStatus *st = (const Fusion__JobStatus *)wire_msg_body(m);
    gen_text(g, st->output, asked);
    g->usage.completion_tokens = st->step;
    g->queued = st->state == FUSION__JOB_STATE__JOB_STATE_QUEUED;
    if (g->queued)
        snprintf(g->why, sizeof g->why, "%s", st->message && st->message[0] ? st->message : "no reason given");
    bool done = st->state == FUSION__JOB_STATE__JOB_STATE_DONE;
    if (st->state == FUSION__JOB_STATE__JOB_STATE_FAILED || st->state == FUSION__JOB_STATE__JOB_STATE_CANCELED) {
        gen_fail(g, MHD_HTTP_BAD_GATEWAY, "api_error", "the job %s: %s", cli_job_state_name(st->state),
                 st->message && st->message[0] ? st->message : "no reason given");
        wire_msg_destroy(&m);
        return;
    }
    uint64_t max = st->total_steps;
    wire_msg_destroy(&m);
    gen_release(g, done, g->usage.completion_tokens >= max ? "length" : "stop");
}

/* Waits for the next look: SERVE_POLL_MS, shorter when the gateway is stopping. Ends g on its
 * deadline or when the gateway stops. */
static void gen_wait(gen_t *g)
{
    if (g->pause)
        fu_sleep_ms(SERVE_POLL_MS);
    if (serve_stopping()) {
        gen_cancel(g);
        gen_fail(g, MHD_HTTP_SERVICE_UNAVAILABLE, "api_error", "the gateway is stopping");
    } else if (g->queued && fu_clock_sec() > g->started + g->s->queue_timeout_s) {
        gen_cancel(g);
        gen_fail(g, MHD_HTTP_SERVICE_UNAVAILABLE, "api_error",
                 "the swarm did not start this request within %.0f s (the broker says: %s); it was cancelled: "
                 "try again later", g->s->queue_timeout_s, g->why);
    } else if (fu_clock_sec() > g->deadline) {
        gen_cancel(g);
        gen_fail(g, MHD_HTTP_GATEWAY_TIMEOUT, "api_error", "no answer within %.0f s (the request was cancelled)",
                 g->s->timeout_s);
    }
}

static gen_t *gen_new(serve_t *s, cli_oai_req *req, struct MHD_Connection *mc)
{
    gen_t *g = fu_calloc(1, sizeof *g);
    g->s = s;
    g->req = *req;
    memset(req, 0, sizeof *req);
    g->mc = mc;
    g->created = (int64_t)time(NULL);
    g->started = fu_clock_sec();
    g->deadline = g->started + s->timeout_s;
    for (size_t i = 0; i < g->req.n_stop; i++)
        g->stops[g->n_stops++] = g->req.stop[i];
    for (size_t i = 0; i < s->n_eos_text; i++) /* the text ends at the end-of-sequence token's text */
        g->stops[g->n_stops++] = s->eos_text[i];
    atomic_fetch_add(&s->in_flight, 1);
    return g;
}

/* One line per request on the gateway's log: its kind, its job, the tokens, how it ended, how long. */
static void gen_log(const gen_t *g)
{
    char jid[17] = "-";
    if (g->submitted)
        cli_job_id_format(g->job, jid);
    const char *how = g->err_status ? g->err
                      : g->gone     ? (g->session ? "the client went away; its session was closed"
                                                  : "the client went away; its job was cancelled")
                      : g->finish                  ? g->finish
                                                   : "ended";
    fprintf(stderr, "%s: %s%s %s: job %s, %" PRIu64 " prompt + %" PRIu64 " generated tokens, %.2f s: %u %s\n",
            g->s->prog, g->req.chat ? "chat" : "completion", g->req.stream ? " (stream)" : "", g->req.model, jid,
            g->usage.prompt_tokens, g->usage.completion_tokens, fu_clock_sec() - g->started,
            g->err_status ? g->err_status : g->gone ? 499u : 200u, how);
}

static void gen_free(gen_t *g)
{
    if (!g)
        return;
    gen_log(g);
    gen_cancel(g);
    serve_conn_put(g->s, g->conn, g->conn_broken);
    atomic_fetch_sub(&g->s->in_flight, 1);
    cli_oai_req_free(&g->req);
    free(g->text);
    free(g->out);
    free(g);
}

/* Connects and submits; false with g's error set. */
static bool gen_start(gen_t *g)
{
    if (!(g->conn = serve_conn_get(g->s))) {
        gen_fail(g, MHD_HTTP_BAD_GATEWAY, "api_error", "the broker cannot be reached (the gateway's log says why)");
        return false;
    }
    return gen_submit(g);
}

/* Whether the HTTP client of mc has gone away. */
static bool client_gone(struct MHD_Connection *mc)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static enum MHD_Result reply_gen_error(struct MHD_Connection *mc, gen_t *g)
{
    enum MHD_Result r = serve_reply_error(mc, g->err_status, g->err_type, NULL, NULL, g->err);
    gen_free(g);
    return r;
}

/* A request that does not stream: waits for the whole text. */
static enum MHD_Result answer_whole(struct MHD_Connection *mc, gen_t *g)
{
    if (!gen_start(g))
        return reply_gen_error(mc, g);
    while (!g->over) {
        gen_poll(g);
        if (g->over)
            break;
        if (client_gone(mc)) {
            g->gone = true;
            gen_free(g); /* cancels the job */
            return MHD_NO;
        }
        gen_wait(g);
    }
    if (g->err_status)
        return reply_gen_error(mc, g);
    const char *text = g->text ? g->text : "";
    char *whole = NULL;
    size_t wl = g->avail;
    if (g->req.echo) { /* the prompt's text first */
        size_t pl = strlen(g->req.prompt);
        whole = fu_malloc(pl + wl + 1);
        memcpy(whole, g->req.prompt, pl);
        memcpy(whole + pl, text, wl);
        wl += pl;
        text = whole;
    }
    char *json = cli_oai_answer_json(&g->req, g->id, g->created, text, wl, g->finish, &g->usage);
    free(whole);
    gen_free(g);
    return serve_reply_json(mc, MHD_HTTP_OK, json);
}

/* Appends one server-sent event ("data: TEXT\n\n") to g's output; takes text. */
static void sse(gen_t *g, char *text)
{
    size_t tl = strlen(text), need = g->out_len + tl + sizeof "data: \n\n";
    g->out = fu_realloc(g->out, need);
    g->out_len += (size_t)snprintf(g->out + g->out_len, need - g->out_len, "data: %s\n\n", text);
    free(text);
}

/* The events of what g has now: new text, the end (finish chunk, usage, [DONE]) or an error. */
static void gen_events(gen_t *g)
{
    if (!g->first_sent) { /* the assistant's role (chat) or the echoed prompt, at once */
        const char *lead = g->req.echo ? g->req.prompt : "";
        if (g->req.chat || lead[0])
            sse(g, cli_oai_chunk_json(&g->req, g->id, g->created, lead, strlen(lead), true, NULL, NULL));
        g->first_sent = true;
    }
    if (g->avail > g->sent) {
        sse(g, cli_oai_chunk_json(&g->req, g->id, g->created, g->text + g->sent, g->avail - g->sent, false, NULL,
                                  NULL));
        g->sent = g->avail;
    }
    if (!g->over || g->end_sent)
        return;
    if (g->err_status)
        sse(g, cli_oai_error_json(g->err, g->err_type, NULL, NULL));
    else
        sse(g, cli_oai_chunk_json(&g->req, g->id, g->created, "", 0, false, g->finish, NULL));
    if (!g->err_status && g->req.include_usage)
        sse(g, cli_oai_chunk_json(&g->req, g->id, g->created, NULL, 0, false, NULL, &g->usage));
    g->out = fu_realloc(g->out, g->out_len + 16);
    g->out_len += (size_t)snprintf(g->out + g->out_len, 16, "data: [DONE]\n\n");
    g->end_sent = true;
}

/* libmicrohttpd asks for more of the stream: blocks (this connection's own thread) until there is some. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    gen_t *g = cls;
    while (g->out_off == g->out_len) {
        g->out_off = g->out_len = 0;
        if (g->end_sent)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (!g->over) {
            if (g->first_sent)
                gen_wait(g);
            if (!g->over)
                gen_poll(g);
        }
        if (!g->over && client_gone(g->mc))
            return MHD_CONTENT_READER_END_WITH_ERROR; /* gen_free cancels the job */
        gen_events(g);
    }
    size_t n = g->out_len - g->out_off < max ? g->out_len - g->out_off : max;
    memcpy(buf, g->out + g->out_off, n);
    g->out_off += n;
    return (ssize_t)n;
}

static void stream_free(void *cls)
{
    gen_t *g = cls;
    g->gone = !g->end_sent && !g->err_status;
    gen_free(g);
}

static enum MHD_Result answer_stream(struct MHD_Connection *mc, gen_t *g)
{
    if (!gen_start(g))
        return reply_gen_error(mc, g); /* refused before anything was sent: a plain HTTP error */
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, g, stream_free);
    if (!r)
        gen_free(g);
    return serve_queue(mc, MHD_HTTP_OK, r, "text/event-stream"); /* g is the response's from here */
}

enum MHD_Result serve_generate(serve_t *s, struct MHD_Connection *mc, bool chat, const char *body, size_t len)
{
    cli_oai_req req;
    char param[32];
    fu_errmsg em = {{0}};
    uint32_t def = chat ? s->max_tokens : (s->max_tokens < SERVE_COMPLETION_DEFAULT ? s->max_tokens : SERVE_COMPLETION_DEFAULT);
    fu_err rc = cli_oai_parse(body, len, chat, def, s->max_tokens, &req, param, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s: 400 %s\n", s->prog, chat ? "chat" : "completion", fu_errmsg_text(&em, rc));
        return serve_reply_error(mc, MHD_HTTP_BAD_REQUEST, "invalid_request_error", param, NULL, fu_errmsg_text(&em, rc));
    }
    if (atomic_load(&s->in_flight) >= s->max_requests) {
        cli_oai_req_free(&req);
        return serve_reply_error(mc, MHD_HTTP_TOO_MANY_REQUESTS, "rate_limit_error", NULL, NULL,
                           "this gateway has as many requests in flight as --max-requests allows; retry shortly");
    }
    gen_t *g = gen_new(s, &req, mc);
    return g->req.stream ? answer_stream(mc, g) : answer_whole(mc, g);
}
