/* `fusion ask JOB --prompt TEXT`: one generation in a serving job (docs/SERVE.md "Serving jobs").
 * Opens a session with the prompt and its sampling, streams the text as the pipeline makes it (long
 * polls of SessionRef, half a second each), and prints the end: the text and a newline, or with
 * --json the session's last status. Ctrl-C closes the session (the job goes on serving others).
 * Exit: 0 when it finished ("length" or "stop"), 1 when it failed or was closed.
 *
 * `fusion ask JOB --prompts FILE`: every prompt of a JSON Lines file ({"prompt": TEXT} or
 * {"prompt_tokens": [IDS]} per line) at once, as many sessions open as the job holds (a refusal
 * "busy" waits for one to end), prompt i sampled with seed --seed + i as `fusion run infer --prompts`
 * does; one JSON line per prompt in the file's order: {"index","text","prompt_tokens",
 * "completion_tokens","finish_reason"}. */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cli_conn.h"
#include "cli_jobs.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "fu_opts.h"
#include "wire.h"

#define ASK_POLL_MS 500u

static volatile sig_atomic_t g_stop;

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

static void print_json(const Fusion__SessionStatus *st)
{
    char id[17];
    cli_job_id_format(st->job_id, id);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "job", id);
    cJSON_AddNumberToObject(o, "session", st->session);
    cJSON_AddStringToObject(o, "state", cli_job_state_name(st->state));
    cJSON_AddStringToObject(o, "text", st->output ? st->output : "");
    cJSON_AddNumberToObject(o, "tokens", st->tokens);
    cJSON_AddNumberToObject(o, "prompt_tokens", st->prompt_tokens);
    if (st->finish_reason && st->finish_reason[0])
        cJSON_AddStringToObject(o, "finish_reason", st->finish_reason);
    if (st->reason && st->reason[0])
        cJSON_AddStringToObject(o, "reason", st->reason);
    char *s = cJSON_PrintUnformatted(o);
    printf("%s\n", s);
    free(s);
    cJSON_Delete(o);
}

static fu_err session_call(cli_conn_t *conn, Fusion__MsgType type, uint64_t job, uint32_t session, uint32_t wait_ms,
                           uint64_t known, wire_msg_t **m, int *code)
{
    Fusion__SessionRef ref = FUSION__SESSION_REF__INIT;
    ref.job_id = job;
    ref.session = session;
    ref.wait_ms = wait_ms;
    ref.known_output_len = known;
    wire_hdr h = {.type = type, .job_id = job};
    return cli_conn_call(conn, &h, &ref.base, FUSION__MSG_TYPE__MSG_SESSION_STATUS, m, code);
}

/* ---- --prompts FILE ---- */

#define ASK_FILE_MAX  (64u << 20) /* bytes of a prompts file */
#define ASK_ROUND_MS  20u         /* between two rounds of status requests */

typedef struct {
    char *text;                   /* the prompt as text, or NULL */
    int32_t *ids;                 /* ... or as ids */
    size_t n_ids;
    uint32_t session;             /* 0: not open yet */
    bool done;
} ask_item;

/* The prompts of the JSON Lines text (len bytes) into *items. */
static fu_err read_items(char *data, size_t len, ask_item **items, size_t *n_items, fu_errmsg *em)
{
    size_t cap = 16, n = 0, lineno = 0;
    ask_item *it = fu_calloc(cap, sizeof *it);
    fu_err rc = FU_OK;
    for (char *line = data, *end = data + len; line < end && rc == FU_OK;) {
        char *nl = memchr(line, '\n', (size_t)(end - line));
        size_t ll = nl ? (size_t)(nl - line) : (size_t)(end - line);
        lineno++;
        char *next = nl ? nl + 1 : end;
        bool blank = true;
        for (size_t i = 0; i < ll && blank; i++)
            blank = line[i] == ' ' || line[i] == '\t' || line[i] == '\r';
        if (blank) {
            line = next;
            continue;
        }
        cJSON *o = cJSON_ParseWithLength(line, ll);
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "prompt");
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "prompt_tokens");
        if (!cJSON_IsObject(o) || cJSON_IsString(p) == cJSON_IsArray(t)) {
            rc = fu_errmsg_set(em, FU_EINVAL, "line %zu: give one of \"prompt\" (text) or \"prompt_tokens\" (ids)",
                               lineno);
        } else {
            if (n == cap)
                it = fu_realloc(it, (cap *= 2) * sizeof *it);
            ask_item *a = &it[n++];
            memset(a, 0, sizeof *a);
            if (cJSON_IsString(p)) {
                a->text = fu_strdup(p->valuestring);
                if (!a->text[0])
                    rc = fu_errmsg_set(em, FU_EINVAL, "line %zu: the prompt is empty", lineno);
            } else {
                a->ids = fu_malloc(((size_t)cJSON_GetArraySize(t) + 1) * sizeof *a->ids);
                const cJSON *id;
                cJSON_ArrayForEach(id, t) {
                    if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble > INT32_MAX ||
                        id->valuedouble != (double)(int32_t)id->valuedouble) {
                        rc = fu_errmsg_set(em, FU_EINVAL, "line %zu: prompt_tokens must be token ids", lineno);
                        break;
                    }
                    a->ids[a->n_ids++] = (int32_t)id->valuedouble;
                }
                if (rc == FU_OK && a->n_ids == 0)
                    rc = fu_errmsg_set(em, FU_EINVAL, "line %zu: the prompt is empty", lineno);
            }
        }
        cJSON_Delete(o);
        line = next;
    }
    if (rc == FU_OK && n == 0)
        rc = fu_errmsg_set(em, FU_EINVAL, "no prompt in the file");
    *items = it;
    *n_items = n;
    return rc;
}

static void items_free(ask_item *it, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(it[i].text);
        free(it[i].ids);
    }
    free(it);
}

static void print_line(size_t index, const Fusion__SessionStatus *st)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", (double)index);
    cJSON_AddStringToObject(o, "text", st->output ? st->output : "");
    cJSON_AddNumberToObject(o, "prompt_tokens", st->prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", st->tokens);
    cJSON_AddStringToObject(o, "finish_reason", st->state == FUSION__JOB_STATE__JOB_STATE_DONE ? st->finish_reason
                                                                                            : cli_job_state_name(st->state));
    if (st->reason && st->reason[0])
        cJSON_AddStringToObject(o, "reason", st->reason);
    char *s = cJSON_PrintUnformatted(o);
    printf("%s\n", s);
    fflush(stdout);
    free(s);
    cJSON_Delete(o);
}

/* Runs every item on conn with o's sampling (seed + index); prints each as it ends, in order. */
static int ask_file(const char *prog, cli_conn_t *conn, Fusion__SessionOpen *o, ask_item *it, size_t n)
{
    uint64_t seed = o->seed;
    size_t next = 0, printed = 0, open = 0;
    int code = FU_EXIT_OK, failed = FU_EXIT_OK;
    Fusion__SessionStatus **last = fu_calloc(n, sizeof *last);
    wire_msg_t **msgs = fu_calloc(n, sizeof *msgs);
    while (printed < n && !g_stop) {
        /* open what the job takes */
        bool busy = false;
        while (next < n && !busy) {
            o->prompt.data = (uint8_t *)it[next].text;
            o->prompt.len = it[next].text ? strlen(it[next].text) : 0;
            o->n_prompt_tokens = it[next].n_ids;
            o->prompt_tokens = it[next].ids;
            o->seed = seed + next;
            wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_SESSION_OPEN, .job_id = o->job_id};
            wire_msg_t *m = NULL;
            cli_conn_set_quiet(conn, true);
            fu_err rc = cli_conn_call(conn, &h, &o->base, FUSION__MSG_TYPE__MSG_SESSION_STATUS, &m, &code);
            cli_conn_set_quiet(conn, false);
            int ecode = -1;
            const char *why = rc == FU_OK ? "" : cli_conn_last_error(conn, &ecode);
            if (rc != FU_OK && ecode == FUSION__ERROR_CODE__ERR_BUSY && open > 0) {
                busy = true; /* the job holds as many as it can: wait for one to end */
                break;
            }
            if (rc != FU_OK) {
                fprintf(stderr, "%s: prompt %zu: %s\n", prog, next, why);
                failed = code;
                goto out;
            }
            it[next].session = ((const Fusion__SessionStatus *)wire_msg_body(m))->session;
            msgs[next] = m;
            next++;
            open++;
        }
        /* one status of every open session */
        for (size_t i = 0; i < next; i++) {
            if (it[i].done)
                continue;
            wire_msg_t *m = NULL;
            if (session_call(conn, FUSION__MSG_TYPE__MSG_SESSION_STATUS_REQ, o->job_id, it[i].session, 0, 0, &m,
                             &code) != FU_OK) {
                failed = code;
                goto out;
            }
            wire_msg_destroy(&msgs[i]);
            msgs[i] = m;
            last[i] = (Fusion__SessionStatus *)wire_msg_body(m);
            if (last[i]->state != FUSION__JOB_STATE__JOB_STATE_RUNNING) {
                it[i].done = true;
                open--;
                if (last[i]->state != FUSION__JOB_STATE__JOB_STATE_DONE)
                    failed = FU_EXIT_FAIL;
            }
        }
        while (printed < n && it[printed].done)
            print_line(printed, last[printed]), printed++;
        if (printed < n)
            fu_sleep_ms(ASK_ROUND_MS);
    }
out:
    for (size_t i = 0; i < next; i++) /* Ctrl-C or a failure: close what is still open */
        if (!it[i].done) {
            wire_msg_t *m = NULL;
            if (session_call(conn, FUSION__MSG_TYPE__MSG_SESSION_CLOSE, o->job_id, it[i].session, 0, 0, &m, &code) ==
                FU_OK)
                wire_msg_destroy(&m);
            failed = failed ? failed : FU_EXIT_FAIL;
        }
    for (size_t i = 0; i < n; i++)
        wire_msg_destroy(&msgs[i]);
    free(msgs);
    free(last);
    return failed;
}

int cli_ask_main(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const char *prompt = NULL, *prompts = NULL, *stop[4] = {0};
    long long max_tokens = 0, top_k = 0, seed = 0;
    double temperature = 0, top_p = 1;
    bool json = false, quiet = false;
    const fu_opt opts[] = {
        {"prompt", 0, FU_OPT_STR, &prompt, "TEXT", "the prompt"},
        {"prompts", 0, FU_OPT_STR, &prompts, "FILE", "every prompt of a JSON Lines file at once, one JSON line each"},
        {"max-tokens", 0, FU_OPT_INT, &max_tokens, "N", "tokens to generate at most (default: the job's max_tokens)"},
        {"temperature", 0, FU_OPT_DOUBLE, &temperature, "T", "sampling temperature; 0 = greedy (default 0)"},
        {"top-k", 0, FU_OPT_INT, &top_k, "K", "sample among the K most likely tokens (default 0: all)"},
        {"top-p", 0, FU_OPT_DOUBLE, &top_p, "P", "nucleus sampling threshold (default 1: off)"},
        {"seed", 0, FU_OPT_INT, &seed, "S", "the sampler's seed (default 0)"},
        {"stop", 0, FU_OPT_STR, &stop[0], "TEXT", "the text ends before TEXT"},
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print the text only when it is complete"},
        {"json", 0, FU_OPT_FLAG, &json, NULL, "print the session's last status as JSON instead of the text"},
        CLI_CONN_OPTS(&co),
    };
    const fu_cmd cmd = {.prog = "fusion ask", .usage = "JOB (--prompt TEXT | --prompts FILE) [options]",
                        .summary = "Opens a generation in serving job JOB (`fusion submit infer --sessions N`) and "
                                   "prints its text as the pipeline makes it. Ctrl-C closes the generation; the job "
                                   "goes on serving others.",
                        FU_OPTS_TABLE(opts), .min_pos = 1, .max_pos = 1};
    uint64_t job;
    int code;
    if (cli_job_cmd_parse(&cmd, argc, argv, &job, NULL, &code) != FU_OK)
        return code;
    if ((!prompt || !prompt[0]) == !prompts) {
        fprintf(stderr, "%s: needs one of --prompt TEXT and --prompts FILE\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    if (max_tokens < 0 || max_tokens > UINT32_MAX || top_k < 0 || top_k > (1 << 22) || seed < 0 ||
        !(temperature >= 0 && temperature <= 100) || !(top_p > 0 && top_p <= 1)) {
        fprintf(stderr, "%s: --max-tokens, --top-k and --seed take 0 or more, --temperature 0..100 and --top-p "
                        "(0, 1]\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    ask_item *items = NULL;
    size_t n_items = 0;
    if (prompts) {
        char *data = NULL;
        size_t len = 0;
        fu_errmsg em = {{0}};
        fu_err rc = fu_file_read_all(prompts, ASK_FILE_MAX, &data, &len, &em);
        if (rc == FU_OK)
            rc = read_items(data, len, &items, &n_items, &em);
        free(data);
        if (rc != FU_OK) {
            fprintf(stderr, "%s: %s: %s\n", cmd.prog, prompts, fu_errmsg_text(&em, rc));
            items_free(items, n_items);
            return rc == FU_ENOTFOUND ? FU_EXIT_NOTFOUND : FU_EXIT_FAIL;
        }
    }
    cli_conn_t *conn = NULL;
    if (cli_conn_open(cmd.prog, &co, &conn, &code) != FU_OK) {
        items_free(items, n_items);
        return code;
    }
    Fusion__SessionOpen o = FUSION__SESSION_OPEN__INIT;
    o.job_id = job;
    o.prompt.data = (uint8_t *)prompt;
    o.prompt.len = prompt ? strlen(prompt) : 0;
    o.max_tokens = (uint32_t)max_tokens;
    o.temperature = temperature;
    o.top_k = (uint32_t)top_k;
    o.top_p = top_p;
    o.seed = (uint64_t)seed;
    o.n_stop = stop[0] ? 1 : 0;
    o.stop = (char **)stop;
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    if (prompts) {
        code = ask_file(cmd.prog, conn, &o, items, n_items);
        items_free(items, n_items);
        cli_conn_close(&conn);
        return code;
    }
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_SESSION_OPEN, .job_id = job};
    wire_msg_t *m = NULL;
    if (cli_conn_call(conn, &h, &o.base, FUSION__MSG_TYPE__MSG_SESSION_STATUS, &m, &code) != FU_OK) {
        cli_conn_close(&conn);
        return code;
    }
    const Fusion__SessionStatus *st = (const Fusion__SessionStatus *)wire_msg_body(m);
    uint32_t session = st->session;
    size_t shown = 0;
    while (st->state == FUSION__JOB_STATE__JOB_STATE_RUNNING) {
        size_t len = st->output ? strlen(st->output) : 0;
        if (!quiet && !json && len > shown) {
            fwrite(st->output + shown, 1, len - shown, stdout);
            fflush(stdout);
            shown = len;
        }
        bool close = g_stop;
        wire_msg_t *next = NULL;
        fu_err rc = session_call(conn, close ? FUSION__MSG_TYPE__MSG_SESSION_CLOSE : FUSION__MSG_TYPE__MSG_SESSION_STATUS_REQ,
                                 job, session, close ? 0 : ASK_POLL_MS, len, &next, &code);
        if (rc != FU_OK) {
            wire_msg_destroy(&m);
            cli_conn_close(&conn);
            return code;
        }
        wire_msg_destroy(&m);
        m = next;
        st = (const Fusion__SessionStatus *)wire_msg_body(m);
        if (close)
            break;
    }
    if (json) {
        print_json(st);
    } else {
        size_t len = st->output ? strlen(st->output) : 0;
        if (len > shown)
            fwrite(st->output + shown, 1, len - shown, stdout);
        printf("\n");
    }
    code = st->state == FUSION__JOB_STATE__JOB_STATE_DONE ? FU_EXIT_OK : FU_EXIT_FAIL;
    if (g_stop && st->state == FUSION__JOB_STATE__JOB_STATE_CANCELED) {
        code = 130; /* as after Ctrl-C on any command; the job itself goes on */
        if (!json)
            fprintf(stderr, "%s: interrupted: session %u closed; job %016" PRIx64 " goes on serving\n", cmd.prog,
                    session, job);
    } else if (code != FU_EXIT_OK && !json)
        fprintf(stderr, "%s: session %u of job %016" PRIx64 " %s%s%s\n", cmd.prog, session, job, cli_job_state_name(st->state),
                st->reason && st->reason[0] ? ": " : "", st->reason ? st->reason : "");
    wire_msg_destroy(&m);
    cli_conn_close(&conn);
    return code;
}
