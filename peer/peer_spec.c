/* peer_spec: job spec keys and the pipeline data order (see peer_spec.h). */
#include "peer_spec.h"

#include "dag_data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_rng.h"

#define SPEC_MAX_DEPTH 8

typedef struct {
    const char *p;   /* next character */
    const char *end; /* one past the last */
} scan;

static void ws(scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

/* A JSON string into buf (cap bytes, truncation refused); escapes other than \uXXXX decoded. */
static fu_err str(scan *s, char *buf, size_t cap)
{
    ws(s);
    if (s->p >= s->end || *s->p != '"')
        return FU_EPROTO;
    s->p++;
    size_t n = 0;
    while (s->p < s->end && *s->p != '"') {
        char c = *s->p++;
        if ((unsigned char)c < 0x20)
            return FU_EPROTO;
        if (c == '\\') {
            if (s->p >= s->end)
                return FU_EPROTO;
            char e = *s->p++;
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case '"': case '\\': case '/': c = e; break;
            case 'u':
                if (s->end - s->p < 4)
                    return FU_EPROTO;
                s->p += 4; /* keys and values the peer reads are ASCII; keep a placeholder */
                c = '?';
                break;
            default: return FU_EPROTO;
            }
        }
        if (buf) {
            if (n + 1 >= cap)
                return FU_EINVAL;
            buf[n++] = c;
        }
    }
    if (s->p >= s->end)
        return FU_EPROTO;
    s->p++;
    if (buf)
        buf[n] = '\0';
    return FU_OK;
}

static fu_err num(scan *s, double *out)
{
    ws(s);
    const char *q = s->p;
    if (q < s->end && (*q == '-' || *q == '+'))
        q++;
    while (q < s->end && ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e' || *q == 'E' || *q == '-' || *q == '+'))
        q++;
    size_t n = (size_t)(q - s->p);
    if (n == 0 || n > 63)
        return FU_EPROTO;
    char tmp[64];
    memcpy(tmp, s->p, n);
    tmp[n] = '\0';
    char *e = NULL;
    double v = strtod(tmp, &e);
    if (!e || *e || !isfinite(v))
        return FU_EPROTO;
    s->p = q;
    *out = v;
    return FU_OK;
}

static bool lit(scan *s, const char *w)
{
    ws(s);
    size_t n = strlen(w);
    if ((size_t)(s->end - s->p) >= n && memcmp(s->p, w, n) == 0) {
        s->p += n;
        return true;
    }
    return false;
}

static fu_err skip_value(scan *s, int depth)
{
    if (depth > SPEC_MAX_DEPTH)
        return FU_EPROTO;
    ws(s);
    if (s->p >= s->end)
        return FU_EPROTO;
    char c = *s->p;
    if (c == '"')
        return str(s, NULL, 0);
    if (c == '{' || c == '[') {
        char close = c == '{' ? '}' : ']';
        s->p++;
        ws(s);
        if (s->p < s->end && *s->p == close) {
            s->p++;
            return FU_OK;
        }
        for (;;) {
            if (c == '{') {
                FU_TRY(str(s, NULL, 0));
                ws(s);
                if (s->p >= s->end || *s->p != ':')
                    return FU_EPROTO;
                s->p++;
            }
            FU_TRY(skip_value(s, depth + 1));
            ws(s);
            if (s->p < s->end && *s->p == ',') {
                s->p++;
                continue;
            }
            if (s->p < s->end && *s->p == close) {
                s->p++;
                return FU_OK;
            }
            return FU_EPROTO;
        }
    }
    if (lit(s, "true") || lit(s, "false") || lit(s, "null"))
        return FU_OK;
    double d;
    return num(s, &d);
}

static fu_err get_bool(scan *s, bool *out)
{
    if (lit(s, "true"))
        *out = true;
    else if (lit(s, "false"))
        *out = false;
    else
        return FU_EINVAL;
    return FU_OK;
}

static fu_err get_uint(scan *s, uint64_t max, uint64_t *out)
{
    double d;
    if (num(s, &d) != FU_OK || d < 0 || d > (double)max || floor(d) != d)
        return FU_EINVAL;
    *out = (uint64_t)d;
    return FU_OK;
}

static fu_err get_tokens(scan *s, peer_spec *o)
{
    ws(s);
    if (s->p >= s->end || *s->p != '[')
        return FU_EINVAL;
    s->p++;
    size_t cap = 16;
    o->prompt_tokens = fu_malloc(cap * sizeof *o->prompt_tokens);
    o->n_prompt_tokens = 0;
    ws(s);
    if (s->p < s->end && *s->p == ']') {
        s->p++;
        return FU_OK;
    }
    for (;;) {
        uint64_t v;
        if (get_uint(s, INT32_MAX, &v) != FU_OK || o->n_prompt_tokens >= PEER_SPEC_MAX_PROMPT)
            return FU_EINVAL;
        if (o->n_prompt_tokens == cap) {
            cap *= 2;
            o->prompt_tokens = fu_realloc(o->prompt_tokens, cap * sizeof *o->prompt_tokens);
        }
        o->prompt_tokens[o->n_prompt_tokens++] = (int32_t)v;
        ws(s);
        if (s->p < s->end && *s->p == ',') {
            s->p++;
            continue;
        }
        if (s->p < s->end && *s->p == ']') {
            s->p++;
            return FU_OK;
        }
        return FU_EPROTO;
    }
}

void peer_spec_clear(peer_spec *s)
{
    if (!s)
        return;
    free(s->prompt_tokens);
    memset(s, 0, sizeof *s);
}

fu_err peer_spec_parse(const char *json, size_t len, peer_spec *o, fu_errmsg *em)
{
    if (!o)
        return FU_EINVAL;
    memset(o, 0, sizeof *o);
    o->lr = 1e-3;
    o->steps = 100;
    o->batch = 4;
    o->seq_len = 128;
    o->micro_batches = 1;
    o->max_tokens = 0;
    o->top_p = 1.0;
    if (!json || len > PEER_SPEC_MAX_BYTES)
        return fu_errmsg_set(em, FU_EINVAL, "job spec missing or over %u bytes", PEER_SPEC_MAX_BYTES);
    scan s = {json, json + len};
    ws(&s);
    if (s.p >= s.end || *s.p != '{')
        return fu_errmsg_set(em, FU_EPROTO, "job spec is not a JSON object");
    s.p++;
    ws(&s);
    bool empty = s.p < s.end && *s.p == '}';
    if (empty)
        s.p++;
    while (!empty) {
        char key[64];
        fu_err rc = str(&s, key, sizeof key);
        if (rc == FU_EINVAL)
            return fu_errmsg_set(em, FU_EINVAL, "job spec has a key longer than %zu bytes", sizeof key - 1);
        if (rc != FU_OK)
            goto malformed;
        ws(&s);
        if (s.p >= s.end || *s.p != ':')
            goto malformed;
        s.p++;
        uint64_t u = 0;
        double d = 0;
        rc = FU_OK;
        if (!strcmp(key, "lr")) {
            rc = num(&s, &d) == FU_OK && d > 0 ? FU_OK : FU_EINVAL;
            o->lr = d;
        } else if (!strcmp(key, "weight_decay")) {
            rc = num(&s, &d) == FU_OK && d >= 0 ? FU_OK : FU_EINVAL;
            o->weight_decay = d;
        } else if (!strcmp(key, "steps")) {
            rc = get_uint(&s, PEER_SPEC_MAX_STEPS, &u);
            o->steps = u;
        } else if (!strcmp(key, "batch")) {
            rc = get_uint(&s, PEER_SPEC_MAX_ROWS, &u);
            o->batch = (uint32_t)u;
        } else if (!strcmp(key, "seq_len")) {
            rc = get_uint(&s, PEER_SPEC_MAX_ROWS, &u);
            o->seq_len = (uint32_t)u;
        } else if (!strcmp(key, "micro_batches")) {
            rc = get_uint(&s, PEER_SPEC_MAX_ROWS, &u);
            o->micro_batches = (uint32_t)u;
        } else if (!strcmp(key, "shuffle")) {
            rc = get_bool(&s, &o->shuffle);
        } else if (!strcmp(key, "seed")) {
            rc = get_uint(&s, (uint64_t)1 << 53, &u);
            o->seed = u;
        } else if (!strcmp(key, "checkpoint_every")) {
            rc = get_uint(&s, PEER_SPEC_MAX_STEPS, &u);
            o->checkpoint_every = u;
        } else if (!strcmp(key, "max_tokens")) {
            rc = get_uint(&s, PEER_SPEC_MAX_PROMPT, &u);
            o->max_tokens = (uint32_t)u;
            o->infer = true;
        } else if (!strcmp(key, "temperature")) {
            rc = num(&s, &d);
            o->temperature = d;
        } else if (!strcmp(key, "top_k")) {
            rc = get_uint(&s, INT32_MAX, &u);
            o->top_k = (int32_t)u;
        } else if (!strcmp(key, "top_p")) {
            rc = num(&s, &d) == FU_OK && d > 0 ? FU_OK : FU_EINVAL;
            o->top_p = d;
        } else if (!strcmp(key, "dump_logits")) {
            rc = get_bool(&s, &o->dump_logits);
        } else if (!strcmp(key, "prompt_tokens")) {
            free(o->prompt_tokens);
            o->prompt_tokens = NULL;
            rc = get_tokens(&s, o);
        } else if (!strcmp(key, "adapter_job")) {
            o->infer = true;
            rc = skip_value(&s, 1);
        } else {
            rc = skip_value(&s, 1);
        }
        if (rc == FU_EPROTO)
            goto malformed;
        if (rc != FU_OK) {
            peer_spec_clear(o);
            return fu_errmsg_set(em, FU_EINVAL, "job spec key '%s' has a wrong type or an out-of-range value", key);
        }
        ws(&s);
        if (s.p < s.end && *s.p == ',') {
            s.p++;
            continue;
        }
        if (s.p < s.end && *s.p == '}') {
            s.p++;
            break;
        }
        goto malformed;
    }
    ws(&s);
    if (s.p != s.end)
        goto malformed;
    if (!o->infer) {
        if (o->steps == 0 || o->batch == 0 || o->seq_len == 0 || o->micro_batches == 0 ||
            o->batch % o->micro_batches != 0 || (uint64_t)o->batch * o->seq_len > PEER_SPEC_MAX_ROWS) {
            peer_spec_clear(o);
            return fu_errmsg_set(em, FU_EINVAL,
                                 "job spec: steps, batch, seq_len and micro_batches must be positive, "
                                 "micro_batches must divide batch, batch*seq_len at most %u", PEER_SPEC_MAX_ROWS);
        }
    }
    return FU_OK;
malformed:
    peer_spec_clear(o);
    return fu_errmsg_set(em, FU_EPROTO, "job spec is not valid JSON near byte %td", s.p - json);
}

fu_err peer_data_rows(const peer_spec *sp, const int32_t *ids, size_t n_ids, uint64_t step, uint32_t mb,
                      int32_t *tokens, int32_t *targets)
{
    if (!sp)
        return FU_EINVAL;
    dag_data_order o = {.batch = sp->batch, .micro_batches = sp->micro_batches, .seq_len = sp->seq_len,
                        .shuffle = sp->shuffle, .seed = sp->seed};
    return dag_data_rows(&o, ids, n_ids, step, mb, tokens, targets);
}
