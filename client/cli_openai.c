#include "cli_openai.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "dag_spec.h"
#include "fu_alloc.h"
#include "wire.h"

/* ---- parsing ---------------------------------------------------------------------------------- */

static fu_err bad(char *param, const char *name, fu_errmsg *em, const char *why)
{
    snprintf(param, 32, "%s", name);
    return fu_errmsg_set(em, FU_EINVAL, "'%s' %s", name, why);
}

static const cJSON *field(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsNull(v) ? NULL : v; /* null is the same as absent, as OpenAI takes it */
}

/* A number field in [lo, hi]; absent leaves *out. */
static fu_err num(const cJSON *o, const char *name, double lo, double hi, double *out, char *param, fu_errmsg *em)
{
    const cJSON *v = field(o, name);
    if (!v)
        return FU_OK;
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi)) {
        char why[96];
        snprintf(why, sizeof why, "must be a number from %g to %g", lo, hi);
        return bad(param, name, em, why);
    }
    *out = v->valuedouble;
    return FU_OK;
}

/* An integer field in [lo, hi]; absent leaves *out and *given. */
static fu_err whole(const cJSON *o, const char *name, double lo, double hi, double *out, bool *given, char *param,
                    fu_errmsg *em)
{
    const cJSON *v = field(o, name);
    if (!v)
        return FU_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo || v->valuedouble > hi) {
        char why[96];
        snprintf(why, sizeof why, "must be a whole number from %.0f to %.0f", lo, hi);
        return bad(param, name, em, why);
    }
    *out = v->valuedouble;
    if (given)
        *given = true;
    return FU_OK;
}

static fu_err flag(const cJSON *o, const char *name, bool *out, char *param, fu_errmsg *em)
{
    const cJSON *v = field(o, name);
    if (!v)
        return FU_OK;
    if (!cJSON_IsBool(v))
        return bad(param, name, em, "must be true or false");
    *out = cJSON_IsTrue(v);
    return FU_OK;
}

/* Fields fusion does not do: accepted only at the value that means "off". */
static fu_err refuse_unless_off(const cJSON *o, char *param, fu_errmsg *em)
{
    static const char *const zero[] = {"presence_penalty", "frequency_penalty"};
    for (size_t i = 0; i < 2; i++) {
        const cJSON *v = field(o, zero[i]);
        if (v && !(cJSON_IsNumber(v) && v->valuedouble == 0))
            return bad(param, zero[i], em, "is not supported by fusion (only 0)");
    }
    const cJSON *v = field(o, "n");
    if (v && !(cJSON_IsNumber(v) && v->valuedouble == 1))
        return bad(param, "n", em, "must be 1: fusion generates one choice per request");
    v = field(o, "best_of");
    if (v && !(cJSON_IsNumber(v) && v->valuedouble == 1))
        return bad(param, "best_of", em, "must be 1");
    v = field(o, "logprobs");
    if (v && !cJSON_IsFalse(v) && !(cJSON_IsNumber(v) && v->valuedouble == 0))
        return bad(param, "logprobs", em, "are not supported by fusion");
    v = field(o, "top_logprobs");
    if (v && !(cJSON_IsNumber(v) && v->valuedouble == 0))
        return bad(param, "top_logprobs", em, "are not supported by fusion");
    v = field(o, "logit_bias");
    if (v && !(cJSON_IsObject(v) && !v->child))
        return bad(param, "logit_bias", em, "is not supported by fusion");
    v = field(o, "suffix");
    if (v && !(cJSON_IsString(v) && !v->valuestring[0]))
        return bad(param, "suffix", em, "is not supported by fusion");
    static const char *const absent[] = {"tools", "tool_choice", "functions", "function_call"};
    for (size_t i = 0; i < 4; i++)
        if (field(o, absent[i]))
            return bad(param, absent[i], em, "is not supported by fusion: it generates text only");
    v = field(o, "response_format");
    if (v) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") != 0)
            return bad(param, "response_format", em, "must be {\"type\": \"text\"}: fusion does not constrain output");
    }
    return FU_OK;
}

static fu_err parse_stop(const cJSON *o, cli_oai_req *r, char *param, fu_errmsg *em)
{
    const cJSON *v = field(o, "stop");
    if (!v)
        return FU_OK;
    const cJSON *one = cJSON_IsString(v) ? v : NULL, *e;
    if (!one && !cJSON_IsArray(v))
        return bad(param, "stop", em, "must be a string or an array of strings");
    if (!one && cJSON_GetArraySize(v) > CLI_OAI_MAX_STOP)
        return bad(param, "stop", em, "holds at most 4 strings");
    for (e = one ? one : v->child; e; e = one ? NULL : e->next) {
        if (!cJSON_IsString(e) || !e->valuestring[0] || strlen(e->valuestring) > CLI_OAI_MAX_STOP_LEN ||
            !wire_utf8_valid(e->valuestring, strlen(e->valuestring)))
            return bad(param, "stop", em, "strings must be text of 1 to 256 bytes");
        r->stop[r->n_stop++] = e->valuestring;
    }
    return FU_OK;
}

/* One message's content: a string, or an array of {"type": "text", "text"} parts (joined). */
static fu_err parse_content(const cJSON *c, size_t i, cli_oai_req *r, const char **out, char *param, fu_errmsg *em)
{
    if (cJSON_IsString(c)) {
        *out = c->valuestring;
        return FU_OK;
    }
    if (!cJSON_IsArray(c)) {
        snprintf(param, 32, "messages");
        return fu_errmsg_set(em, FU_EINVAL, "messages[%zu]: 'content' must be a string or an array of text parts", i);
    }
    size_t total = 1;
    const cJSON *p;
    cJSON_ArrayForEach(p, c)
    {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(p, "type"), *x = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") != 0 || !cJSON_IsString(x)) {
            snprintf(param, 32, "messages");
            return fu_errmsg_set(em, FU_EINVAL, "messages[%zu]: only parts of type \"text\" are supported", i);
        }
        total += strlen(x->valuestring);
    }
    char *s = fu_malloc(total), *w = s;
    cJSON_ArrayForEach(p, c)
    {
        const char *x = cJSON_GetObjectItemCaseSensitive(p, "text")->valuestring;
        size_t n = strlen(x);
        memcpy(w, x, n);
        w += n;
    }
    *w = '\0';
    r->joined = fu_realloc(r->joined, (r->n_joined + 1) * sizeof *r->joined);
    r->joined[r->n_joined++] = s;
    *out = s;
    return FU_OK;
}

static fu_err parse_messages(const cJSON *o, cli_oai_req *r, char *param, fu_errmsg *em)
{
    const cJSON *ms = field(o, "messages"), *m;
    if (!cJSON_IsArray(ms) || cJSON_GetArraySize(ms) < 1 || cJSON_GetArraySize(ms) > DAG_CHAT_MAX_MSGS)
        return bad(param, "messages", em, "must be an array of 1 to 4096 messages");
    r->msgs = fu_calloc((size_t)cJSON_GetArraySize(ms), sizeof *r->msgs);
    cJSON_ArrayForEach(m, ms)
    {
        size_t i = r->n_msgs;
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        const char *rs = cJSON_IsString(role) ? role->valuestring : "";
        if (strcmp(rs, "developer") == 0) /* OpenAI's newer name for the system message */
            rs = "system";
        if (strcmp(rs, "system") != 0 && strcmp(rs, "user") != 0 && strcmp(rs, "assistant") != 0) {
            snprintf(param, 32, "messages");
            return fu_errmsg_set(em, FU_EINVAL, "messages[%zu]: role '%.40s' is not system, developer, user or "
                                 "assistant", i, rs);
        }
        r->msgs[i].role = rs;
        FU_TRY(parse_content(cJSON_GetObjectItemCaseSensitive(m, "content"), i, r, &r->msgs[i].content, param, em));
        r->n_msgs++;
    }
    return FU_OK;
}

/* An array of token ids into r->prompt_ids. */
static fu_err parse_ids(const cJSON *a, cli_oai_req *r, char *param, fu_errmsg *em)
{
    size_t n = (size_t)cJSON_GetArraySize(a);
    if (n == 0 || n > DAG_SPEC_MAX_PROMPT)
        return bad(param, "prompt", em, "as token ids holds 1 to 65536 of them");
    r->prompt_ids = fu_malloc(n * sizeof *r->prompt_ids);
    const cJSON *e;
    cJSON_ArrayForEach(e, a)
    {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > 2147483647.0 ||
            e->valuedouble != floor(e->valuedouble))
            return bad(param, "prompt", em, "holds something that is not a token id");
        r->prompt_ids[r->n_prompt_ids++] = (int32_t)e->valuedouble;
    }
    return FU_OK;
}

static fu_err parse_prompt(const cJSON *o, cli_oai_req *r, char *param, fu_errmsg *em)
{
    const cJSON *p = field(o, "prompt");
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && !cJSON_IsNumber(p->child))
        p = p->child; /* one prompt in a batch of one */
    if (cJSON_IsString(p)) {
        r->prompt = p->valuestring;
        return FU_OK;
    }
    if (cJSON_IsArray(p) && cJSON_IsNumber(p->child))
        return parse_ids(p, r, param, em);
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) > 1)
        return bad(param, "prompt", em, "holds several prompts: send one per request");
    return bad(param, "prompt", em, "must be a string or an array of token ids");
}

fu_err cli_oai_parse(const char *body, size_t len, bool chat, uint32_t def_max_tokens, uint32_t cap_max_tokens,
                     cli_oai_req *r, char *param, fu_errmsg *em)
{
    memset(r, 0, sizeof *r);
    param[0] = '\0';
    r->chat = chat;
    r->max_tokens = def_max_tokens;
    r->temperature = 1.0; /* OpenAI's defaults */
    r->top_p = 1.0;
    cJSON *o = cJSON_ParseWithLength(body, len);
    r->doc = o;
    fu_err rc = FU_OK;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
    if (!cJSON_IsObject(o)) {
        rc = fu_errmsg_set(em, FU_EINVAL, "the body is not a JSON object");
    } else if (!cJSON_IsString(model) || !model->valuestring[0] || strlen(model->valuestring) >= CLI_OAI_MAX_MODEL) {
        rc = bad(param, "model", em, "must name a model (GET /v1/models lists them)");
    } else {
        snprintf(r->model, sizeof r->model, "%s", model->valuestring);
        double mt = def_max_tokens, topk = 0, seed = 0;
        const char *mt_name = chat && field(o, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
        const cJSON *so = field(o, "stream_options");
        if ((rc = refuse_unless_off(o, param, em)) == FU_OK &&
            (rc = chat ? parse_messages(o, r, param, em) : parse_prompt(o, r, param, em)) == FU_OK &&
            (rc = whole(o, mt_name, 1, cap_max_tokens, &mt, NULL, param, em)) == FU_OK &&
            (rc = num(o, "temperature", 0, 2, &r->temperature, param, em)) == FU_OK &&
            (rc = num(o, "top_p", 0, 1, &r->top_p, param, em)) == FU_OK &&
            (rc = whole(o, "top_k", 0, 1e6, &topk, NULL, param, em)) == FU_OK &&
            (rc = whole(o, "seed", -DAG_SPEC_MAX_SEED, DAG_SPEC_MAX_SEED, &seed, &r->has_seed, param, em)) == FU_OK &&
            (rc = parse_stop(o, r, param, em)) == FU_OK && (rc = flag(o, "stream", &r->stream, param, em)) == FU_OK &&
            (rc = chat ? FU_OK : flag(o, "echo", &r->echo, param, em)) == FU_OK && so)
            rc = cJSON_IsObject(so) ? flag(so, "include_usage", &r->include_usage, param, em)
                                    : bad(param, "stream_options", em, "must be an object");
        if (rc == FU_OK && r->top_p == 0)
            rc = bad(param, "top_p", em, "must be more than 0");
        if (rc == FU_OK && r->echo && !r->prompt)
            rc = bad(param, "echo", em, "needs the prompt as text");
        r->max_tokens = (uint32_t)mt;
        r->top_k = (uint32_t)topk;
        r->seed = seed < 0 ? (uint64_t)(int64_t)seed : (uint64_t)seed; /* a negative seed is as good as any */
    }
    if (rc != FU_OK)
        cli_oai_req_free(r);
    return rc;
}

fu_err cli_oai_parse_messages(const char *json, size_t len, cli_oai_req *r, fu_errmsg *em)
{
    memset(r, 0, sizeof *r);
    r->chat = true;
    cJSON *o = cJSON_ParseWithLength(json, len);
    r->doc = o;
    char param[32];
    fu_err rc = cJSON_IsObject(o) ? parse_messages(o, r, param, em)
                                  : fu_errmsg_set(em, FU_EINVAL, "not a JSON object with \"messages\"");
    if (rc != FU_OK)
        cli_oai_req_free(r);
    return rc;
}

void cli_oai_req_free(cli_oai_req *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->n_joined; i++)
        free(r->joined[i]);
    free(r->joined);
    free(r->msgs);
    free(r->prompt_ids);
    cJSON_Delete(r->doc);
    memset(r, 0, sizeof *r);
}

/* ---- answers ---------------------------------------------------------------------------------- */

static char *print(cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s ? s : fu_strdup("{}");
}

char *cli_oai_error_json(const char *message, const char *type, const char *param, const char *code)
{
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "message", message);
    cJSON_AddStringToObject(e, "type", type);
    if (param && param[0])
        cJSON_AddStringToObject(e, "param", param);
    else
        cJSON_AddNullToObject(e, "param");
    if (code)
        cJSON_AddStringToObject(e, "code", code);
    else
        cJSON_AddNullToObject(e, "code");
    return print(o);
}

/* The fields every answer and chunk begins with. */
static cJSON *head(const cli_oai_req *r, const char *id, int64_t created, bool chunk)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "object", r->chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)created);
    cJSON_AddStringToObject(o, "model", r->model);
    cJSON_AddStringToObject(o, "system_fingerprint", "fusion-" FUSION_VERSION);
    return o;
}

/* text[0..len) as a JSON string (len bytes, not up to a NUL). */
static cJSON *string_n(const char *text, size_t len)
{
    char *z = fu_malloc(len + 1);
    memcpy(z, text, len);
    z[len] = '\0';
    cJSON *s = cJSON_CreateString(z);
    free(z);
    return s;
}

static void add_usage(cJSON *o, const cli_oai_usage *u)
{
    cJSON *us = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(us, "prompt_tokens", (double)u->prompt_tokens);
    cJSON_AddNumberToObject(us, "completion_tokens", (double)u->completion_tokens);
    cJSON_AddNumberToObject(us, "total_tokens", (double)(u->prompt_tokens + u->completion_tokens));
}

/* A choice: the text (or message / delta for chat) and its finish reason (NULL: null). */
static cJSON *choice(const cli_oai_req *r, const char *text, size_t len, bool chunk, bool first, const char *finish)
{
    cJSON *c = cJSON_CreateObject();
    cJSON_AddNumberToObject(c, "index", 0);
    if (!r->chat) {
        cJSON_AddItemToObject(c, "text", string_n(text, len));
    } else {
        cJSON *m = cJSON_AddObjectToObject(c, chunk ? "delta" : "message");
        if (!chunk || first)
            cJSON_AddStringToObject(m, "role", "assistant");
        if (!chunk || len || first)
            cJSON_AddItemToObject(m, "content", string_n(text, len));
    }
    cJSON_AddNullToObject(c, "logprobs");
    if (finish)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
    return c;
}

char *cli_oai_answer_json(const cli_oai_req *r, const char *id, int64_t created, const char *text, size_t len,
                          const char *finish, const cli_oai_usage *u)
{
    cJSON *o = head(r, id, created, false);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "choices"), choice(r, text, len, false, true, finish));
    add_usage(o, u);
    return print(o);
}

char *cli_oai_chunk_json(const cli_oai_req *r, const char *id, int64_t created, const char *delta, size_t len,
                         bool first, const char *finish, const cli_oai_usage *usage)
{
    cJSON *o = head(r, id, created, true), *cs = cJSON_AddArrayToObject(o, "choices");
    if (usage)
        add_usage(o, usage);
    else
        cJSON_AddItemToArray(cs, choice(r, delta, len, true, first, finish));
    return print(o);
}

/* ---- what a stream may pass on ------------------------------------------------------------------ */

size_t cli_oai_release(const char *text, size_t len, const char *const *stop, size_t n, bool final, size_t sent,
                       bool *stopped)
{
    *stopped = false;
    size_t cut = len;
    for (size_t i = 0; i < n; i++) { /* the first stop string wins */
        size_t sl = strlen(stop[i]);
        for (size_t p = 0; sl && p + sl <= cut; p++)
            if (memcmp(text + p, stop[i], sl) == 0) {
                cut = p;
                *stopped = true;
                break;
            }
    }
    if (!*stopped && !final) {
        size_t q = 0; /* the broker shows the bytes of a character still to come as '?' */
        while (q < 3 && q < cut && text[cut - 1 - q] == '?')
            q++;
        cut -= q;
        size_t c = cut; /* and never stops inside a character */
        while (c > 0 && ((unsigned char)text[c - 1] & 0xc0) == 0x80)
            c--;
        if (c > 0 && (unsigned char)text[c - 1] >= 0xc0) {
            unsigned char lead = (unsigned char)text[c - 1];
            size_t need = (lead & 0xe0) == 0xc0 ? 2 : (lead & 0xf0) == 0xe0 ? 3 : 4;
            if (c - 1 + need > cut)
                cut = c - 1;
        }
        size_t hold = 0; /* the longest tail that begins a stop string */
        for (size_t i = 0; i < n; i++) {
            size_t sl = strlen(stop[i]);
            for (size_t k = sl - 1; k > hold && k >= 1; k--)
                if (k <= cut && memcmp(text + cut - k, stop[i], k) == 0) {
                    hold = k;
                    break;
                }
        }
        cut -= hold;
    }
    return cut < sent ? sent : cut;
}
