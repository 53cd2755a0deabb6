/* `fusion serve`: an OpenAI-compatible gateway in front of a broker (docs/SERVE.md). It holds the
 * user's keys and one model; each request to /v1/completions or /v1/chat/completions becomes an
 * inference job of that model (with a finished fine-tune's adapter when the model name says
 * "NAME:JOB"), its prompt tokenized here, its text streamed back as server-sent events or answered
 * whole. libmicrohttpd runs a thread per connection; each request borrows a broker connection from a
 * small pool. A client that goes away cancels its job: nobody's GPU works for nothing. */
#include <arpa/inet.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "cli.h"
#include "cli_jobs.h"
#include "cli_serve.h"
#include "cli_upload.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_file.h"
#include "fu_net.h"
#define SERVE_MAX_BODY (4u << 20) /* bytes of one request's body */

static atomic_int g_stop; /* the gateway is stopping: requests in flight cancel their jobs */

bool serve_stopping(void)
{
    return atomic_load(&g_stop) != 0;
}

void serve_idem_new(char out[SERVE_IDEM_LEN])
{
    uint8_t raw[(SERVE_IDEM_LEN - 1) / 2];
    randombytes_buf(raw, sizeof raw);
    fu_hex_encode(out, raw, sizeof raw);
}

/* ---- broker connections --------------------------------------------------------------------- */

cli_conn_t *serve_conn_get(serve_t *s)
{
    cli_conn_t *c = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->n_idle)
        c = s->idle[--s->n_idle];
    pthread_mutex_unlock(&s->mu);
    int code;
    if (!c && cli_conn_open(s->prog, &s->co, &c, &code) != FU_OK)
        return NULL;
    return c;
}

void serve_conn_put(serve_t *s, cli_conn_t *c, bool broken)
{
    if (!c)
        return;
    pthread_mutex_lock(&s->mu);
    if (!broken && s->n_idle < SERVE_POOL) {
        s->idle[s->n_idle++] = c;
        c = NULL;
    }
    pthread_mutex_unlock(&s->mu);
    cli_conn_close(&c);
}

/* ---- replies ---------------------------------------------------------------------------------- */

enum MHD_Result serve_queue(struct MHD_Connection *mc, unsigned status, struct MHD_Response *r, const char *type)
{
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result ok = MHD_queue_response(mc, status, r);
    MHD_destroy_response(r);
    return ok;
}

enum MHD_Result serve_reply_json(struct MHD_Connection *mc, unsigned status, char *json)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(json), json, MHD_RESPMEM_MUST_FREE);
    if (!r)
        free(json);
    return serve_queue(mc, status, r, "application/json");
}

enum MHD_Result serve_reply_error(struct MHD_Connection *mc, unsigned status, const char *type, const char *param,
                                   const char *code, const char *message)
{
    return serve_reply_json(mc, status, cli_oai_error_json(message, type, param, code));
}

unsigned serve_status_of(int code, const char **type)
{
    switch (code) {
    case FUSION__ERROR_CODE__ERR_INVALID:
    case FUSION__ERROR_CODE__ERR_VERSION:
    case FUSION__ERROR_CODE__ERR_TOO_LARGE:
    case FUSION__ERROR_CODE__ERR_PROTO:
        *type = "invalid_request_error";
        return MHD_HTTP_BAD_REQUEST;
    case FUSION__ERROR_CODE__ERR_NOT_FOUND:
        *type = "invalid_request_error";
        return MHD_HTTP_NOT_FOUND;
    case FUSION__ERROR_CODE__ERR_AUTH:
        *type = "permission_error";
        return MHD_HTTP_FORBIDDEN;
    case FUSION__ERROR_CODE__ERR_BUSY:
        *type = "rate_limit_error";
        return MHD_HTTP_TOO_MANY_REQUESTS;
    default:
        *type = "api_error";
        return MHD_HTTP_BAD_GATEWAY;
    }
}

/* ---- models ----------------------------------------------------------------------------------- */

static cJSON *model_obj(const char *id, int64_t created)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)created);
    cJSON_AddStringToObject(m, "owned_by", "fusion");
    return m;
}

/* GET /v1/models (want NULL) or /v1/models/ID: the model, and the model with each finished fine-tune
 * of this key's of the same model (the same content id: an adapter fits only the weights it was
 * trained on, and the broker refuses any other) as "NAME:JOB". */
static enum MHD_Result get_models(serve_t *s, struct MHD_Connection *mc, const char *want)
{
    cli_conn_t *c = serve_conn_get(s);
    if (!c)
        return serve_reply_error(mc, MHD_HTTP_BAD_GATEWAY, "api_error", NULL, NULL, "the broker cannot be reached");
    Fusion__JobListRequest q = FUSION__JOB_LIST_REQUEST__INIT;
    q.include_done = true;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_LIST_REQ};
    wire_msg_t *m = NULL;
    int code;
    fu_err rc = cli_conn_call(c, &h, &q.base, FUSION__MSG_TYPE__MSG_JOB_LIST, &m, &code);
    if (rc != FU_OK) {
        int bc;
        const char *type, *why = cli_conn_last_error(c, &bc);
        unsigned st = serve_status_of(bc, &type);
        enum MHD_Result r = serve_reply_error(mc, st, type, NULL, NULL, why);
        serve_conn_put(s, c, true);
        return r;
    }
    serve_conn_put(s, c, false);
    const Fusion__JobList *l = (const Fusion__JobList *)wire_msg_body(m);
    cJSON *o = cJSON_CreateObject(), *data = cJSON_AddArrayToObject(o, "data"), *found = NULL;
    cJSON_AddStringToObject(o, "object", "list");
    cJSON_AddItemToArray(data, model_obj(s->name, s->started));
    for (size_t i = 0; i < l->n_jobs; i++) {
        const Fusion__JobStatus *j = l->jobs[i];
        if (j->kind != FUSION__JOB_KIND__JOB_KIND_FINETUNE || j->state != FUSION__JOB_STATE__JOB_STATE_DONE)
            continue;
        if (s->model_id[0] && strcmp(j->model_id ? j->model_id : "", s->model_id) != 0)
            continue; /* a fine-tune of another model (or of one the broker did not pin) */
        char id[CLI_OAI_MAX_MODEL + 20], jid[17];
        cli_job_id_format(j->job_id, jid);
        snprintf(id, sizeof id, "%s:%s", s->name, jid);
        cJSON_AddItemToArray(data, model_obj(id, j->updated_ms / 1000));
    }
    wire_msg_destroy(&m);
    if (want) {
        cJSON *e;
        cJSON_ArrayForEach(e, data)
        {
            if (strcmp(cJSON_GetObjectItemCaseSensitive(e, "id")->valuestring, want) == 0)
                found = e;
        }
        if (!found) {
            cJSON_Delete(o);
            return serve_reply_error(mc, MHD_HTTP_NOT_FOUND, "invalid_request_error", "model", "model_not_found",
                               "no such model here: GET /v1/models lists them");
        }
    }
    char *txt = cJSON_PrintUnformatted(found ? found : o);
    cJSON_Delete(o);
    return serve_reply_json(mc, MHD_HTTP_OK, txt ? txt : fu_strdup("{}"));
}

bool serve_model_adapter(const serve_t *s, const char *model, char adapter[DAG_SPEC_JOB_ID_LEN + 1])
{
    adapter[0] = '\0';
    size_t nl = strlen(s->name);
    if (strcmp(model, s->name) == 0)
        return true;
    uint64_t id;
    if (strncmp(model, s->name, nl) != 0 || model[nl] != ':' || cli_job_id_parse(model + nl + 1, &id) != FU_OK)
        return false;
    cli_job_id_format(id, adapter);
    return true;
}

/* ---- the HTTP server ---------------------------------------------------------------------------- */

typedef struct { /* one request's body, as it arrives */
    char *body;
    size_t len;
    bool too_big;
} req_body;

static bool authorized(const serve_t *s, struct MHD_Connection *mc)
{
    if (!s->key[0])
        return true;
    const char *a = MHD_lookup_connection_value(mc, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    size_t kl = strlen(s->key);
    return a && strncmp(a, "Bearer ", 7) == 0 && strlen(a + 7) == kl && sodium_memcmp(a + 7, s->key, kl) == 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *mc, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    (void)version;
    serve_t *s = cls;
    req_body *b = *con_cls;
    if (!b) { /* the headers: the body follows */
        *con_cls = fu_calloc(1, sizeof *b);
        return MHD_YES;
    }
    if (*upload_size) {
        if (b->len + *upload_size > SERVE_MAX_BODY) {
            b->too_big = true;
        } else {
            b->body = fu_realloc(b->body, b->len + *upload_size + 1);
            memcpy(b->body + b->len, upload, *upload_size);
            b->len += *upload_size;
            b->body[b->len] = '\0';
        }
        *upload_size = 0;
        return MHD_YES;
    }
    if (!authorized(s, mc))
        return serve_reply_error(mc, MHD_HTTP_UNAUTHORIZED, "invalid_request_error", NULL, "invalid_api_key",
                           "this gateway wants its API key: Authorization: Bearer KEY");
    bool get = strcmp(method, MHD_HTTP_METHOD_GET) == 0, post = strcmp(method, MHD_HTTP_METHOD_POST) == 0;
    if (get && strcmp(url, "/v1/models") == 0)
        return get_models(s, mc, NULL);
    if (get && strncmp(url, "/v1/models/", 11) == 0)
        return get_models(s, mc, url + 11);
    if (get && strcmp(url, "/health") == 0)
        return serve_reply_json(mc, MHD_HTTP_OK, fu_strdup("{\"status\":\"ok\"}"));
    bool chat = strcmp(url, "/v1/chat/completions") == 0;
    if (chat || strcmp(url, "/v1/completions") == 0) {
        if (!post)
            return serve_reply_error(mc, MHD_HTTP_METHOD_NOT_ALLOWED, "invalid_request_error", NULL, NULL,
                               "generation is POST");
        if (b->too_big)
            return serve_reply_error(mc, MHD_HTTP_CONTENT_TOO_LARGE, "invalid_request_error", NULL, NULL,
                               "the request's body is over 4 MiB");
        return serve_generate(s, mc, chat, b->body ? b->body : "", b->len);
    }
    return serve_reply_error(mc, MHD_HTTP_NOT_FOUND, "invalid_request_error", NULL, "unknown_url",
                       "fusion serve answers GET /v1/models, POST /v1/completions and POST /v1/chat/completions");
}

static void on_done(void *cls, struct MHD_Connection *mc, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)mc;
    (void)toe;
    req_body *b = *con_cls;
    if (b)
        free(b->body);
    free(b);
    *con_cls = NULL;
}

/* ---- setting up --------------------------------------------------------------------------------- */

/* The model here: its config, tokenizer, chat format and end-of-sequence texts. */
static int serve_load_model(serve_t *s, const char *dir, bool byte_tokens)
{
    fu_errmsg em = {{0}};
    fu_err rc = fu_modelcfg_load(dir, &s->cfg, &em);
    if (rc == FU_OK)
        rc = fu_tokenizer_open_dir(dir, s->cfg.vocab_size, s->cfg.byte_tokens || byte_tokens, &s->tok, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s: %s\n", s->prog, dir, fu_errmsg_text(&em, rc));
        return fu_exit_for(rc);
    }
    snprintf(s->chat_err, sizeof s->chat_err, "the model has no chat format (its tokenizer_config.json has no "
             "chat_template): use /v1/completions");
    if ((rc = dag_chat_format_from_dir(dir, &s->chat, &em)) != FU_OK) {
        s->chat = DAG_CHAT_NONE;
        snprintf(s->chat_err, sizeof s->chat_err, "%s", fu_errmsg_text(&em, rc));
        fprintf(stderr, "%s: chats are refused: %s\n", s->prog, s->chat_err);
    }
    for (size_t i = 0; i < s->cfg.n_eos && s->n_eos_text < FU_MODELCFG_MAX_EOS; i++) {
        const char *t = fu_tokenizer_token(s->tok, (int32_t)s->cfg.eos_token_ids[i]);
        if (t && t[0])
            s->eos_text[s->n_eos_text++] = t;
    }
    int32_t eos = fu_tokenizer_eos_id(s->tok);
    const char *t = eos >= 0 && s->cfg.n_eos == 0 ? fu_tokenizer_token(s->tok, eos) : NULL;
    if (t && t[0])
        s->eos_text[s->n_eos_text++] = t;
    return FU_EXIT_OK;
}

/* The model as the broker will name it: uploaded by content, or this directory's absolute path. */
static int serve_broker_model(serve_t *s, const char *dir, bool upload)
{
    if (!upload) {
        char abs[PATH_MAX];
        const char *path = realpath(dir, abs) ? abs : dir;
        if (strlen(path) >= sizeof s->spec_model) {
            fprintf(stderr, "%s: the model's path is longer than %zu bytes\n", s->prog, sizeof s->spec_model - 1);
            return FU_EXIT_USAGE;
        }
        memcpy(s->spec_model, path, strlen(path) + 1);
        return FU_EXIT_OK;
    }
    int code;
    cli_conn_t *c = serve_conn_get(s);
    if (!c)
        return FU_EXIT_FAIL;
    char name[CLI_UPLOAD_NAME_MAX] = "";
    cli_upload_report rep;
    fu_err rc = cli_upload_model(c, s->prog, dir, false, name, &rep, &code);
    serve_conn_put(s, c, rc != FU_OK);
    if (rc != FU_OK)
        return code;
    snprintf(s->spec_model, sizeof s->spec_model, "%s", name);
    return FU_EXIT_OK;
}

/* Is the broker there, does it take this key, and which content id has the model? A check-only
 * submission of a one-token generation: the broker opens the model as it would for a job (hashing it
 * once; the jobs that follow find it hashed), answers its id and stores nothing. A broker from before
 * check_only would store the job: it is cancelled at once, and every fine-tune is listed, as then. */
static int serve_model_id(serve_t *s)
{
    dag_spec sp;
    dag_spec_init(&sp, DAG_JOB_INFER);
    snprintf(sp.model, sizeof sp.model, "%s", s->spec_model);
    int32_t tok = 0;
    sp.prompt_tokens = &tok;
    sp.n_prompt_tokens = 1;
    sp.max_tokens = 1;
    char *spec = dag_spec_to_json(&sp);
    sp.prompt_tokens = NULL; /* ours, not the spec's */
    sp.n_prompt_tokens = 0;
    dag_spec_clear(&sp);
    Fusion__JobSubmit sub = FUSION__JOB_SUBMIT__INIT;
    sub.kind = FUSION__JOB_KIND__JOB_KIND_INFER;
    sub.spec_json = spec;
    sub.check_only = true;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_SUBMIT};
    wire_msg_t *m = NULL;
    int code = 0;
    cli_conn_t *c = serve_conn_get(s);
    fu_err rc = c ? FU_ETIMEDOUT : FU_EIO;
    for (int t = 0; t < CLI_SUBMIT_TRIES && rc == FU_ETIMEDOUT; t++) /* the first open hashes the model */
        rc = cli_conn_call(c, &h, &sub.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, &m, &code);
    free(spec);
    if (rc != FU_OK) {
        serve_conn_put(s, c, true);
        return code ? code : FU_EXIT_FAIL;
    }
    const Fusion__JobStatus *st = (const Fusion__JobStatus *)wire_msg_body(m);
    if (st->job_id) { /* an older broker stored it */
        int cc;
        if (cli_job_cancel(c, st->job_id, &cc) != FU_OK)
            fprintf(stderr, "%s: the broker stored the model check as a job; cancel it with `fusion cancel`\n",
                    s->prog);
    }
    snprintf(s->model_id, sizeof s->model_id, "%s", st->job_id == 0 && st->model_id ? st->model_id : "");
    wire_msg_destroy(&m);
    serve_conn_put(s, c, false);
    if (!s->model_id[0])
        fprintf(stderr, "%s: the broker does not say the model's content id: GET /v1/models lists the fine-tunes "
                "of every model\n", s->prog);
    return FU_EXIT_OK;
}

/* The API key from --api-key-file or $FUSION_SERVE_API_KEY ("" when neither). */
static int serve_key(serve_t *s, const char *file)
{
    const char *env = getenv("FUSION_SERVE_API_KEY");
    if (!file) {
        snprintf(s->key, sizeof s->key, "%s", env ? env : "");
        return FU_EXIT_OK;
    }
    char *txt = NULL;
    size_t len = 0;
    fu_errmsg em = {{0}};
    fu_err rc = fu_file_read_all(file, SERVE_KEY_MAX, &txt, &len, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: --api-key-file: %s\n", s->prog, fu_errmsg_text(&em, rc));
        return fu_exit_for(rc);
    }
    while (len && (txt[len - 1] == '\n' || txt[len - 1] == '\r' || txt[len - 1] == ' '))
        txt[--len] = '\0';
    if (len < 16 || len >= SERVE_KEY_MAX || strpbrk(txt, " \t\r\n")) {
        free(txt);
        fprintf(stderr, "%s: --api-key-file: the key is one word of 16 to 255 characters\n", s->prog);
        return FU_EXIT_USAGE;
    }
    snprintf(s->key, sizeof s->key, "%s", txt);
    free(txt);
    return FU_EXIT_OK;
}

int cli_serve_main(int argc, char **argv)
{
    serve_t s = {.prog = argv[0], .max_tokens = 1024, .timeout_s = 600, .queue_timeout_s = 60, .max_requests = 16,
                 .sessions = 8, .idle_s = 600};
    const char *model = NULL, *name = NULL, *listen = "127.0.0.1:8080", *key_file = NULL;
    bool upload = false, byte_tokens = false;
    long long max_tokens = s.max_tokens, max_requests = s.max_requests, sessions = s.sessions, context = 0,
              idle_s = s.idle_s;
    double timeout = s.timeout_s, queue_timeout = s.queue_timeout_s;
    const fu_opt opts[] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "the Hugging Face model directory (here: its tokenizer is used here)"},
        {"upload", 0, FU_OPT_FLAG, &upload, NULL, "send the model to the broker first, by content (else the broker "
                                                  "reads DIR at the same path)"},
        {"name", 0, FU_OPT_STR, &name, "NAME", "the model's name for clients (default: DIR's last component)"},
        {"listen", 'l', FU_OPT_STR, &listen, "IPV4:PORT", "where to listen (default 127.0.0.1:8080; port 0: any)"},
        {"api-key-file", 0, FU_OPT_STR, &key_file, "FILE",
         "clients must send this key (Authorization: Bearer); else $FUSION_SERVE_API_KEY; needed off loopback"},
        {"max-tokens", 0, FU_OPT_INT, &max_tokens, "N", "most tokens one request generates; chat's default (1024)"},
        {"max-requests", 0, FU_OPT_INT, &max_requests, "N", "requests in flight at once; more get 429 (16)"},
        {"request-timeout", 0, FU_OPT_DOUBLE, &timeout, "S", "a request not done by then is cancelled (600)"},
        {"queue-timeout", 0, FU_OPT_DOUBLE, &queue_timeout, "S",
         "a request whose job has not started by then (no peers free, or none with the memory) is cancelled and "
         "answered 503 with the broker's reason (60)"},
        {"sessions", 0, FU_OPT_INT, &sessions, "N",
         "requests share a serving job per model name holding N generations at once, batched through its stages "
         "(8; 0: a job per request)"},
        {"context", 0, FU_OPT_INT, &context, "N",
         "positions of one request in a serving job, prompt and generated (default: 2048, or 2 x --max-tokens)"},
        {"job-idle-s", 0, FU_OPT_INT, &idle_s, "S",
         "the broker cancels a serving job after S seconds without a request (600; 0: never): a gateway that "
         "dies leaves no job holding the peers"},
        {"byte-tokens", 0, FU_OPT_FLAG, &byte_tokens, NULL, "a model of more ids without tokenizer.json: bytes"},
        CLI_CONN_OPTS(&s.co),
    };
    const fu_cmd cmd = {
        .prog = argv[0],
        .usage = "--model DIR [--listen 127.0.0.1:8080] [options]",
        .summary = "An OpenAI-compatible endpoint for the swarm: /v1/models, /v1/completions and "
                   "/v1/chat/completions (stream or not) run on the broker with your keys, as sessions of a "
                   "serving job per model name (concurrent requests share its pipeline), or with --sessions 0 as "
                   "a job each. The model name NAME:JOB uses a finished fine-tune's adapter. Ctrl-C stops it "
                   "and cancels its serving jobs.",
        FU_OPTS_TABLE(opts),
    };
    int code = FU_EXIT_OK;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!model) {
        fprintf(stderr, "%s: needs --model DIR\n", s.prog);
        return FU_EXIT_USAGE;
    }
    if (max_tokens < 1 || max_tokens > DAG_SPEC_MAX_TOKENS || max_requests < 1 || max_requests > 1024 ||
        !(timeout > 0) || !(queue_timeout > 0) || sessions < 0 || sessions > DAG_SPEC_MAX_SESSIONS || context < 0 ||
        context > DAG_SPEC_MAX_PROMPT + DAG_SPEC_MAX_TOKENS || (context && context <= max_tokens) || idle_s < 0 ||
        idle_s > 10000000) {
        fprintf(stderr, "%s: --max-tokens is 1..%u, --max-requests 1..1024, --request-timeout and --queue-timeout "
                "more than 0, --sessions 0..%u, --context more than --max-tokens and at most %u\n",
                s.prog, DAG_SPEC_MAX_TOKENS, DAG_SPEC_MAX_SESSIONS, DAG_SPEC_MAX_PROMPT + DAG_SPEC_MAX_TOKENS);
        return FU_EXIT_USAGE;
    }
    s.sessions = (uint32_t)sessions;
    s.idle_s = (uint32_t)idle_s;
    s.context = context ? (uint32_t)context
                        : max_tokens * 2 > DAG_SPEC_CONTEXT ? (uint32_t)max_tokens * 2 : DAG_SPEC_CONTEXT;
    s.max_tokens = (uint32_t)max_tokens;
    s.max_requests = (unsigned)max_requests;
    s.timeout_s = timeout;
    s.queue_timeout_s = queue_timeout;
    struct sockaddr_in sa;
    fu_errmsg em = {{0}};
    if (fu_net_parse_ipv4(listen, "--listen", &sa, &em) != FU_OK) {
        fprintf(stderr, "%s: %s\n", s.prog, em.msg);
        return FU_EXIT_USAGE;
    }
    if ((code = serve_key(&s, key_file)) != FU_EXIT_OK)
        return code;
    if (!s.key[0] && !fu_net_is_loopback(&sa)) { /* anyone who reaches it would spend this key's jobs */
        fprintf(stderr, "%s: --listen %s is reachable from other machines: give an API key (--api-key-file or "
                "$FUSION_SERVE_API_KEY), or listen on 127.0.0.1\n", s.prog, listen);
        return FU_EXIT_USAGE;
    }
    if (!fu_path_is_dir(model)) {
        fprintf(stderr, "%s: --model %s is not a model directory here (fusion serve tokenizes here)\n", s.prog, model);
        return FU_EXIT_NOTFOUND;
    }
    const char *base = strrchr(model, '/');
    while (base && !base[1] && base > model) { /* "dir/" */
        const char *p = base - 1;
        while (p > model && *p != '/')
            p--;
        base = p;
    }
    snprintf(s.name, sizeof s.name, "%s", name ? name : base && base[1] ? base + 1 : model);
    s.name[strcspn(s.name, "/:")] = '\0';
    if (!s.name[0]) {
        fprintf(stderr, "%s: --name must not be empty or contain '/' or ':'\n", s.prog);
        return FU_EXIT_USAGE;
    }
    pthread_mutex_init(&s.mu, NULL);
    pthread_mutex_init(&s.jobs_mu, NULL);
    s.started = (int64_t)time(NULL);
    struct MHD_Daemon *d = NULL;
    if ((code = serve_load_model(&s, model, byte_tokens)) != FU_EXIT_OK ||
        (code = serve_broker_model(&s, model, upload)) != FU_EXIT_OK)
        goto out;
    if ((code = serve_model_id(&s)) != FU_EXIT_OK)
        goto out;

    sigset_t stop_set; /* blocked in every thread (libmicrohttpd's inherit it); this one waits for them */
    sigemptyset(&stop_set);
    sigaddset(&stop_set, SIGINT);
    sigaddset(&stop_set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_set, NULL);
    signal(SIGPIPE, SIG_IGN);
    d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD, ntohs(sa.sin_port), NULL,
                         NULL, on_request, &s, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                         MHD_OPTION_CONNECTION_LIMIT, (unsigned)(s.max_requests + 16), MHD_OPTION_NOTIFY_COMPLETED,
                         on_done, NULL, MHD_OPTION_END);
    const union MHD_DaemonInfo *pi = d ? MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT) : NULL;
    if (!pi) {
        fprintf(stderr, "%s: cannot listen on %s (in use, or not an address of this host?)\n", s.prog, listen);
        code = FU_EXIT_FAIL;
        goto out;
    }
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
    printf("http://%s:%u/v1\n", ip, (unsigned)pi->port);
    fflush(stdout);
    fprintf(stderr, "%s: serving %s (%s, %.18s..., chat format %s%s) at http://%s:%u/v1; Ctrl-C stops\n", s.prog,
            s.name, s.spec_model, s.model_id[0] ? s.model_id : "content id unknown", dag_chat_format_name(s.chat),
            s.key[0] ? ", API key required" : "", ip, (unsigned)pi->port);
    int sig = 0;
    sigwait(&stop_set, &sig);
    atomic_store(&g_stop, 1);
    fprintf(stderr, "%s: stopping: requests in flight are cancelled\n", s.prog);
    code = FU_EXIT_OK;
out:
    if (d)
        MHD_stop_daemon(d); /* waits for the connections' threads; they see g_stop and cancel their jobs */
    serve_jobs_cancel_all(&s);
    for (size_t i = 0; i < s.n_idle; i++)
        cli_conn_close(&s.idle[i]);
    fu_tokenizer_destroy(&s.tok);
    pthread_mutex_destroy(&s.mu);
    pthread_mutex_destroy(&s.jobs_mu);
    return code;
}
