#include "dag_dataset.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "dag_data.h"
#include "fu_alloc.h"
#include "fu_file.h"

/* ---- chat formats ---------------------------------------------------------------------------- */

#define DAG_CHAT_CONFIG_MAX (16u << 20) /* the longest tokenizer_config.json read */
#define DAG_CHAT_MAX_TURNS  64          /* assistant turns of one training chat (each renders its prefix again) */

const char *dag_chat_format_name(dag_chat_format f)
{
    switch (f) {
    case DAG_CHAT_LLAMA3: return "llama3";
    case DAG_CHAT_CHATML: return "chatml";
    case DAG_CHAT_INST: return "inst";
    default: return "none";
    }
}

fu_err dag_chat_format_of(const char *t, dag_chat_format *out, fu_errmsg *em)
{
    *out = DAG_CHAT_NONE;
    if (!t || !*t)
        return FU_OK;
    if (strstr(t, "<|start_header_id|>") && strstr(t, "<|eot_id|>"))
        *out = DAG_CHAT_LLAMA3;
    else if (strstr(t, "<|im_start|>") && strstr(t, "<|im_end|>"))
        *out = DAG_CHAT_CHATML;
    else if (strstr(t, "[INST]") && strstr(t, "[/INST]"))
        *out = DAG_CHAT_INST;
    else
        return fu_errmsg_set(em, FU_EVERSION,
                             "the model's chat_template is not one fusion knows (Llama 3's <|start_header_id|>, "
                             "ChatML's <|im_start|>, or [INST] ... [/INST])");
    return FU_OK;
}

fu_err dag_chat_format_from_config(const char *json, size_t len, dag_chat_format *out, fu_errmsg *em)
{
    *out = DAG_CHAT_NONE;
    if (!json)
        return FU_OK;
    cJSON *c = cJSON_ParseWithLength(json, len);
    if (!cJSON_IsObject(c)) {
        cJSON_Delete(c);
        return fu_errmsg_set(em, FU_EPROTO, "tokenizer_config.json: not a JSON object");
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(c, "chat_template");
    fu_err rc = FU_OK;
    if (cJSON_IsString(t)) {
        rc = dag_chat_format_of(t->valuestring, out, em);
    } else if (cJSON_IsArray(t)) { /* [{"name": "default", "template": ...}, ...] */
        const cJSON *e;
        cJSON_ArrayForEach(e, t)
        {
            const cJSON *n = cJSON_GetObjectItemCaseSensitive(e, "name"), *tt = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (cJSON_IsString(n) && strcmp(n->valuestring, "default") == 0 && cJSON_IsString(tt))
                rc = dag_chat_format_of(tt->valuestring, out, em);
        }
    }
    cJSON_Delete(c);
    return rc;
}

/* content without the whitespace at its ends (Jinja's trim, Python's strip): *len bytes from the return. */
static const char *trimmed(const char *s, size_t *len)
{
    size_t n = strlen(s);
    while (n && isspace((unsigned char)*s))
        s++, n--;
    while (n && isspace((unsigned char)s[n - 1]))
        n--;
    *len = n;
    return s;
}

static bool chat_role_ok(const char *role)
{
    return role && (strcmp(role, "system") == 0 || strcmp(role, "user") == 0 || strcmp(role, "assistant") == 0);
}

fu_err dag_chat_text(dag_chat_format fmt, const dag_chat_msg *msgs, size_t n, const char *bos, const char *eos,
                     bool gen_prompt, char **out, fu_errmsg *em)
{
    *out = NULL;
    if (fmt == DAG_CHAT_NONE)
        return fu_errmsg_set(em, FU_EINVAL, "the model has no chat format: its tokenizer_config.json has no chat_template");
    if (n == 0 || n > DAG_CHAT_MAX_MSGS)
        return fu_errmsg_set(em, FU_EINVAL, "a chat has 1 to %d messages, not %zu", DAG_CHAT_MAX_MSGS, n);
    for (size_t i = 0; i < n; i++)
        if (!chat_role_ok(msgs[i].role) || !msgs[i].content)
            return fu_errmsg_set(em, FU_EINVAL, "message %zu: role '%.40s' is not system, user or assistant, or it has "
                                 "no content", i, msgs[i].role ? msgs[i].role : "");
    bos = bos ? bos : "";
    eos = eos ? eos : "";
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return fu_errmsg_set(em, FU_ENOMEM, "out of memory");
    fu_err rc = FU_OK;
    size_t first = 0, tl;
    const char *sys = NULL, *t;
    switch (fmt) {
    case DAG_CHAT_LLAMA3: /* bos, then <|start_header_id|>role<|end_header_id|>\n\n content|trim <|eot_id|> */
        fputs(bos, f);
        for (size_t i = 0; i < n; i++) {
            t = trimmed(msgs[i].content, &tl);
            fprintf(f, "<|start_header_id|>%s<|end_header_id|>\n\n%.*s<|eot_id|>", msgs[i].role, (int)tl, t);
        }
        if (gen_prompt)
            fputs("<|start_header_id|>assistant<|end_header_id|>\n\n", f);
        break;
    case DAG_CHAT_CHATML:
        for (size_t i = 0; i < n; i++)
            fprintf(f, "<|im_start|>%s\n%s<|im_end|>\n", msgs[i].role, msgs[i].content);
        if (gen_prompt)
            fputs("<|im_start|>assistant\n", f);
        break;
    case DAG_CHAT_INST: /* Llama 2's template: [system,] user, assistant, user, ... */
        if (strcmp(msgs[0].role, "system") == 0)
            sys = msgs[first++].content;
        for (size_t i = first; i < n && rc == FU_OK; i++) {
            bool user = strcmp(msgs[i].role, "user") == 0;
            if (user != ((i - first) % 2 == 0)) {
                rc = fu_errmsg_set(em, FU_EINVAL, "message %zu: [INST] chats alternate user and assistant turns "
                                   "(after one optional system message)", i);
                break;
            }
            char *joined = NULL; /* the template strips the first turn with the system text before it */
            if (user && i == first && sys) {
                size_t jl = strlen(sys) + strlen(msgs[i].content) + 32;
                joined = fu_malloc(jl);
                snprintf(joined, jl, "<<SYS>>\n%s\n<</SYS>>\n\n%s", sys, msgs[i].content);
            }
            t = trimmed(joined ? joined : msgs[i].content, &tl);
            if (user)
                fprintf(f, "%s[INST] %.*s [/INST]", bos, (int)tl, t);
            else
                fprintf(f, " %.*s %s", (int)tl, t, eos);
            free(joined);
        }
        if (rc == FU_OK && first == n)
            rc = fu_errmsg_set(em, FU_EINVAL, "an [INST] chat needs a user message after its system message");
        break;
    default:
        rc = fu_errmsg_set(em, FU_EINVAL, "unknown chat format");
    }
    if (fclose(f) != 0 && rc == FU_OK)
        rc = fu_errmsg_set(em, FU_ENOMEM, "out of memory");
    if (rc != FU_OK) {
        free(buf);
        return rc;
    }
    *out = buf;
    return FU_OK;
}

fu_err dag_chat_format_from_dir(const char *dir, dag_chat_format *out, fu_errmsg *em)
{
    *out = DAG_CHAT_NONE;
    char *path = fu_path_join(dir, "tokenizer_config.json"), *txt = NULL;
    size_t len = 0;
    fu_err rc = FU_OK;
    if (fu_path_exists(path) && (rc = fu_file_read_all(path, DAG_CHAT_CONFIG_MAX, &txt, &len, em)) == FU_OK)
        rc = dag_chat_format_from_config(txt, len, out, em);
    free(txt);
    free(path);
    return rc;
}

fu_err dag_chat_prompt(const fu_tokenizer *tok, dag_chat_format fmt, int32_t bos, int32_t eos, const dag_chat_msg *msgs,
                       size_t n, int32_t **ids, size_t *n_ids, fu_errmsg *em)
{
    *ids = NULL;
    *n_ids = 0;
    if (bos < 0)
        bos = fu_tokenizer_bos_id(tok);
    if (eos < 0)
        eos = fu_tokenizer_eos_id(tok);
    char *text = NULL;
    FU_TRY(dag_chat_text(fmt, msgs, n, bos >= 0 ? fu_tokenizer_token(tok, bos) : NULL,
                         eos >= 0 ? fu_tokenizer_token(tok, eos) : NULL, true, &text, em));
    fu_err rc = fu_tokenizer_encode(tok, text, strlen(text), ids, n_ids, em);
    free(text);
    return rc;
}

/* ---- the token stream ------------------------------------------------------------------------ */

typedef struct {
    int32_t *v;
    size_t n, cap;
} ivec;

static void put(ivec *a, int32_t x)
{
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 1024;
        a->v = fu_realloc(a->v, a->cap * sizeof *a->v);
    }
    a->v[a->n++] = x;
}

/* Appends the tokens of text, counted or masked. */
static fu_err piece(const fu_tokenizer *tok, ivec *a, const char *text, size_t len, bool counted, fu_errmsg *em)
{
    int32_t *ids = NULL;
    size_t n = 0;
    FU_TRY(fu_tokenizer_encode(tok, text, len, &ids, &n, em));
    for (size_t i = 0; i < n; i++)
        put(a, counted ? ids[i] : DAG_DATA_MASKED(ids[i]));
    free(ids);
    return FU_OK;
}

static fu_err text_piece(const fu_tokenizer *tok, ivec *a, const char *text, bool counted, fu_errmsg *em)
{
    return piece(tok, a, text, strlen(text), counted, em);
}

/* Appends a special token by id (when the tokenizer has one), counted or masked. */
static void special(ivec *a, int32_t id, bool counted)
{
    if (id >= 0)
        put(a, counted ? id : DAG_DATA_MASKED(id));
}

/* How many of the ids of msgs[0..upto) rendered (with the generation prompt when gen; for ChatML
 * without the newline after a turn's <|im_end|>, which the assistant does not say) begin full's ids:
 * the token index where that text ends in the whole chat's encoding. */
static fu_err chat_boundary(const fu_tokenizer *tok, dag_chat_format fmt, const dag_chat_msg *m, size_t upto, bool gen,
                            const char *bos, const char *eos, const int32_t *full, size_t n_full, size_t *at,
                            fu_errmsg *em)
{
    char *text = NULL;
    *at = 0;
    if (upto == 0) /* an assistant turn first: counted from the chat's start */
        return FU_OK;
    FU_TRY(dag_chat_text(fmt, m, upto, bos, eos, gen, &text, em));
    size_t len = strlen(text);
    if (fmt == DAG_CHAT_CHATML && !gen && len && text[len - 1] == '\n')
        len--;
    int32_t *ids = NULL;
    size_t n = 0;
    fu_err rc = fu_tokenizer_encode(tok, text, len, &ids, &n, em);
    free(text);
    if (rc != FU_OK)
        return rc;
    size_t k = 0; /* the tokens that agree: where the text ends inside a token, the boundary moves back */
    while (k < n && k < n_full && ids[k] == full[k])
        k++;
    free(ids);
    *at = k;
    return FU_OK;
}

/* One chat: rendered whole as the model's chat_template renders it (dag_chat_text, the text
 * `fusion serve` prompts with, encoded once), and each assistant turn counted: the tokens between
 * the prompt that asks for that turn (the messages before it with the generation prompt) and the end
 * of the turn (its end-of-turn token; for [INST] its EOS). */
static fu_err render_chat(const fu_tokenizer *tok, dag_chat_format fmt, const cJSON *msgs, ivec *a, size_t line,
                          fu_errmsg *em)
{
    if (fmt == DAG_CHAT_NONE)
        return fu_errmsg_set(em, FU_EINVAL,
                             "data line %zu: \"messages\" need the model's chat format, and its tokenizer_config.json "
                             "has no chat_template", line);
    size_t n = (size_t)cJSON_GetArraySize(msgs), turns = 0;
    if (n > DAG_CHAT_MAX_MSGS)
        return fu_errmsg_set(em, FU_EINVAL, "data line %zu: a chat has at most %d messages", line, DAG_CHAT_MAX_MSGS);
    dag_chat_msg *m = fu_calloc(n, sizeof *m);
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, msgs)
    {
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(e, "role"), *c = cJSON_GetObjectItemCaseSensitive(e, "content");
        m[i].role = cJSON_IsString(r) ? r->valuestring : NULL;
        m[i].content = cJSON_IsString(c) ? c->valuestring : NULL;
        if (!m[i].role || !m[i].content) {
            free(m);
            return fu_errmsg_set(em, FU_EINVAL, "data line %zu: every message needs a \"role\" and a \"content\" string",
                                 line);
        }
        turns += strcmp(m[i].role, "assistant") == 0;
        i++;
    }
    if (turns > DAG_CHAT_MAX_TURNS) {
        free(m);
        return fu_errmsg_set(em, FU_EINVAL, "data line %zu: more than %d assistant turns in one chat (split it)", line,
                             DAG_CHAT_MAX_TURNS);
    }
    int32_t bos_id = fu_tokenizer_bos_id(tok), eos_id = fu_tokenizer_eos_id(tok);
    const char *bos = bos_id >= 0 ? fu_tokenizer_token(tok, bos_id) : NULL,
               *eos = eos_id >= 0 ? fu_tokenizer_token(tok, eos_id) : NULL;
    char *text = NULL;
    int32_t *full = NULL;
    size_t n_full = 0;
    fu_err rc = dag_chat_text(fmt, m, n, bos, eos, false, &text, em);
    if (rc == FU_OK)
        rc = fu_tokenizer_encode(tok, text, strlen(text), &full, &n_full, em);
    free(text);
    bool *counted = rc == FU_OK ? fu_calloc(n_full ? n_full : 1, sizeof *counted) : NULL;
    for (i = 0; i < n && rc == FU_OK; i++) {
        if (strcmp(m[i].role, "assistant") != 0)
            continue;
        size_t from = 0, to = 0;
        if ((rc = chat_boundary(tok, fmt, m, i, true, bos, eos, full, n_full, &from, em)) == FU_OK &&
            (rc = chat_boundary(tok, fmt, m, i + 1, false, bos, eos, full, n_full, &to, em)) == FU_OK)
            for (size_t k = from; k < to; k++)
                counted[k] = true;
    }
    if (rc == FU_OK)
        for (size_t k = 0; k < n_full; k++)
            put(a, counted[k] ? full[k] : DAG_DATA_MASKED(full[k]));
    else if (rc == FU_EINVAL && strncmp(em->msg, "data line", 9) != 0) {
        char why[sizeof em->msg];
        snprintf(why, sizeof why, "%s", em->msg);
        fu_errmsg_set(em, FU_EINVAL, "data line %zu: %s", line, why);
    }
    free(counted);
    free(full);
    free(m);
    return rc;
}

/* Pads a to a whole number of windows of win tokens with masked pads. */
static void pad_to(ivec *a, size_t from, size_t win, int32_t pad)
{
    size_t len = a->n - from;
    size_t want = (len + win - 1) / win * win;
    while (a->n - from < want)
        put(a, DAG_DATA_MASKED(pad));
}

/* The targets of the whole windows of win tokens in a (each window's tokens after its first). */
static void count(const ivec *a, size_t win, size_t *counted, size_t *masked)
{
    *counted = *masked = 0;
    for (size_t i = 0; i < a->n / win * win; i++)
        if (i % win)
            (*(a->v[i] < 0 ? masked : counted))++;
}

static bool is_jsonl(const char *data, size_t len)
{
    size_t i = 0;
    while (i < len && (data[i] == ' ' || data[i] == '\t' || data[i] == '\r' || data[i] == '\n'))
        i++;
    if (i == len || data[i] != '{')
        return false;
    const char *nl = memchr(data + i, '\n', len - i);
    cJSON *o = cJSON_ParseWithLength(data + i, nl ? (size_t)(nl - (data + i)) : len - i);
    bool ok = cJSON_IsObject(o);
    cJSON_Delete(o);
    return ok;
}

fu_err dag_dataset_make(const fu_tokenizer *tok, const char *data, size_t len, const dag_dataset_opts *o,
                        dag_dataset *out, fu_errmsg *em)
{
    memset(out, 0, sizeof *out);
    if (!tok || (!data && len) || !o || o->seq_len == 0 || !(o->heldout >= 0 && o->heldout <= DAG_DATASET_MAX_HELDOUT))
        return fu_errmsg_set(em, FU_EINVAL, "dataset: bad options (seq_len 1.., held out 0..%g)", DAG_DATASET_MAX_HELDOUT);
    const size_t win = (size_t)o->seq_len + 1;
    ivec all = {0};
    fu_err rc = FU_OK;
    if (!is_jsonl(data, len)) { /* plain text: every token counted; the held-out part is the end */
        out->format = "text";
        if ((rc = piece(tok, &all, data, len, true, em)) != FU_OK)
            goto fail;
        size_t keep = all.n;
        if (o->heldout > 0) {
            size_t w = all.n / win, hw = (size_t)ceil(o->heldout * (double)w);
            keep = (w - (hw < w ? hw : w)) * win;
        }
        out->n_train = keep;
        out->train = all.v;
        if (keep < all.n) {
            out->n_heldout = all.n - keep;
            out->heldout = fu_malloc(out->n_heldout * sizeof *out->heldout);
            memcpy(out->heldout, all.v + keep, out->n_heldout * sizeof *out->heldout);
        }
        ivec t = {.v = out->train, .n = out->n_train};
        count(&t, win, &out->counted, &out->masked);
        return FU_OK;
    }
    /* JSON Lines: the examples first, then the split */
    size_t *starts = NULL, n_ex = 0, cap_ex = 0;
    const int32_t bos = fu_tokenizer_bos_id(tok), eos = fu_tokenizer_eos_id(tok), pad = eos >= 0 ? eos : 0;
    int kinds = 0; /* bit 0 text, 1 prompt/completion, 2 chat */
    size_t line = 0;
    for (size_t i = 0; i < len && rc == FU_OK;) {
        const char *nl = memchr(data + i, '\n', len - i);
        size_t ll = nl ? (size_t)(nl - (data + i)) : len - i;
        line++;
        const char *s = data + i;
        i += ll + 1;
        size_t k = 0;
        while (k < ll && (s[k] == ' ' || s[k] == '\t' || s[k] == '\r'))
            k++;
        if (k == ll)
            continue; /* a blank line */
        cJSON *ex = cJSON_ParseWithLength(s, ll);
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(ex, "text"),
                    *prompt = cJSON_GetObjectItemCaseSensitive(ex, "prompt"),
                    *comp = cJSON_GetObjectItemCaseSensitive(ex, "completion"),
                    *msgs = cJSON_GetObjectItemCaseSensitive(ex, "messages");
        if (n_ex == cap_ex) {
            cap_ex = cap_ex ? 2 * cap_ex : 256;
            starts = fu_realloc(starts, (cap_ex + 1) * sizeof *starts);
        }
        starts[n_ex] = all.n;
        size_t from = all.n;
        if (cJSON_IsString(text) && !prompt && !msgs) {
            kinds |= 1;
            if ((rc = text_piece(tok, &all, text->valuestring, true, em)) == FU_OK)
                special(&all, eos, true);
        } else if (cJSON_IsString(prompt) && cJSON_IsString(comp) && !msgs) {
            kinds |= 2;
            special(&all, bos, false);
            if ((rc = text_piece(tok, &all, prompt->valuestring, false, em)) == FU_OK &&
                (rc = text_piece(tok, &all, comp->valuestring, true, em)) == FU_OK)
                special(&all, eos, true);
            pad_to(&all, from, win, pad);
        } else if (cJSON_IsArray(msgs) && cJSON_GetArraySize(msgs) > 0) {
            kinds |= 4;
            rc = render_chat(tok, o->chat, msgs, &all, line, em); /* its BOS is the template's */
            pad_to(&all, from, win, pad);
        } else {
            rc = fu_errmsg_set(em, FU_EINVAL,
                               "data line %zu is not {\"text\"}, {\"prompt\", \"completion\"} or {\"messages\": [...]}",
                               line);
        }
        cJSON_Delete(ex);
        n_ex++;
    }
    if (rc != FU_OK) {
        free(starts);
        goto fail;
    }
    out->format = kinds == 1 ? "jsonl" : kinds == 2 ? "prompt-completion" : kinds == 4 ? "chat" : "mixed jsonl";
    out->examples = n_ex;
    size_t h = o->heldout > 0 ? (size_t)ceil(o->heldout * (double)n_ex) : 0;
    if (h >= n_ex && n_ex > 0)
        h = n_ex - 1; /* something stays to train on */
    out->heldout_examples = h;
    size_t cut = h ? starts[n_ex - h] : all.n;
    free(starts);
    out->train = all.v;
    out->n_train = cut;
    if (cut < all.n) {
        out->n_heldout = all.n - cut;
        out->heldout = fu_malloc(out->n_heldout * sizeof *out->heldout);
        memcpy(out->heldout, all.v + cut, out->n_heldout * sizeof *out->heldout);
    }
    ivec t = {.v = out->train, .n = out->n_train};
    count(&t, win, &out->counted, &out->masked);
    return FU_OK;
fail:
    free(all.v);
    memset(out, 0, sizeof *out);
    return rc;
}

void dag_dataset_free(dag_dataset *d)
{
    if (!d)
        return;
    free(d->train);
    free(d->heldout);
    memset(d, 0, sizeof *d);
}
