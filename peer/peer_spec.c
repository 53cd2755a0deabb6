/* peer_spec: job spec keys and the pipeline data order (see peer_spec.h). The spec is parsed with
 * cJSON (bounded in size; cJSON bounds nesting), then each key the stage uses is type- and
 * range-checked. */
#include "peer_spec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "dag_data.h"
#include "fu_alloc.h"

/* A whole number in [0, max] at key k, or FU_EINVAL. Absent keys leave *out alone. */
static fu_err get_uint(const cJSON *o, const char *k, uint64_t max, uint64_t *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!v)
        return FU_OK;
    double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
    if (!(d >= 0 && d <= (double)max && floor(d) == d))
        return FU_EINVAL;
    *out = (uint64_t)d;
    return FU_OK;
}

/* A finite number above `above` (or at least it, when inclusive) at key k. */
static fu_err get_num(const cJSON *o, const char *k, double above, bool inclusive, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!v)
        return FU_OK;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
        (inclusive ? v->valuedouble < above : v->valuedouble <= above))
        return FU_EINVAL;
    *out = v->valuedouble;
    return FU_OK;
}

static fu_err get_bool(const cJSON *o, const char *k, bool *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!v)
        return FU_OK;
    if (!cJSON_IsBool(v))
        return FU_EINVAL;
    *out = cJSON_IsTrue(v);
    return FU_OK;
}

static fu_err get_tokens(const cJSON *o, peer_spec *sp)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(o, "prompt_tokens");
    if (!arr)
        return FU_OK;
    int n = cJSON_GetArraySize(arr);
    if (!cJSON_IsArray(arr) || n < 0 || (size_t)n > PEER_SPEC_MAX_PROMPT)
        return FU_EINVAL;
    sp->prompt_tokens = fu_malloc((size_t)(n ? n : 1) * sizeof *sp->prompt_tokens);
    sp->n_prompt_tokens = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr)
    {
        double d = cJSON_IsNumber(e) ? e->valuedouble : -1;
        if (!(d >= 0 && d <= INT32_MAX && floor(d) == d))
            return FU_EINVAL;
        sp->prompt_tokens[sp->n_prompt_tokens++] = (int32_t)d;
    }
    return FU_OK;
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
    o->top_p = 1.0;
    if (!json || len > PEER_SPEC_MAX_BYTES)
        return fu_errmsg_set(em, FU_EINVAL, "job spec missing or over %u bytes", PEER_SPEC_MAX_BYTES);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fu_errmsg_set(em, FU_EPROTO, "job spec is not a JSON object");
    }
    uint64_t steps = o->steps, batch = o->batch, seq_len = o->seq_len, micro = o->micro_batches, max_tokens = 0,
             top_k = 0;
    const char *bad = NULL;
#define SPEC_CHECK(key, call)  \
    if (!bad && (call) != FU_OK) \
    bad = key
    SPEC_CHECK("lr", get_num(root, "lr", 0, false, &o->lr));
    SPEC_CHECK("weight_decay", get_num(root, "weight_decay", 0, true, &o->weight_decay));
    SPEC_CHECK("steps", get_uint(root, "steps", PEER_SPEC_MAX_STEPS, &steps));
    SPEC_CHECK("batch", get_uint(root, "batch", PEER_SPEC_MAX_ROWS, &batch));
    SPEC_CHECK("seq_len", get_uint(root, "seq_len", PEER_SPEC_MAX_ROWS, &seq_len));
    SPEC_CHECK("micro_batches", get_uint(root, "micro_batches", PEER_SPEC_MAX_ROWS, &micro));
    SPEC_CHECK("shuffle", get_bool(root, "shuffle", &o->shuffle));
    SPEC_CHECK("seed", get_uint(root, "seed", (uint64_t)1 << 53, &o->seed));
    SPEC_CHECK("checkpoint_every", get_uint(root, "checkpoint_every", PEER_SPEC_MAX_STEPS, &o->checkpoint_every));
    SPEC_CHECK("max_tokens", get_uint(root, "max_tokens", PEER_SPEC_MAX_PROMPT, &max_tokens));
    SPEC_CHECK("temperature", get_num(root, "temperature", -INFINITY, false, &o->temperature));
    SPEC_CHECK("top_k", get_uint(root, "top_k", INT32_MAX, &top_k));
    SPEC_CHECK("top_p", get_num(root, "top_p", 0, false, &o->top_p));
    SPEC_CHECK("dump_logits", get_bool(root, "dump_logits", &o->dump_logits));
    SPEC_CHECK("prompt_tokens", get_tokens(root, o));
#undef SPEC_CHECK
    o->infer = cJSON_HasObjectItem(root, "max_tokens") || cJSON_HasObjectItem(root, "adapter_job");
    cJSON_Delete(root);
    if (bad) {
        peer_spec_clear(o);
        return fu_errmsg_set(em, FU_EINVAL, "job spec key '%s' has a wrong type or an out-of-range value", bad);
    }
    o->steps = steps;
    o->batch = (uint32_t)batch;
    o->seq_len = (uint32_t)seq_len;
    o->micro_batches = (uint32_t)micro;
    o->max_tokens = (uint32_t)max_tokens;
    o->top_k = (int32_t)top_k;
    if (!o->infer && (o->steps == 0 || o->batch == 0 || o->seq_len == 0 || o->micro_batches == 0 ||
                      o->batch % o->micro_batches != 0 || (uint64_t)o->batch * o->seq_len > PEER_SPEC_MAX_ROWS)) {
        peer_spec_clear(o);
        return fu_errmsg_set(em, FU_EINVAL,
                             "job spec: steps, batch, seq_len and micro_batches must be positive, micro_batches must "
                             "divide batch, batch*seq_len at most %u", PEER_SPEC_MAX_ROWS);
    }
    return FU_OK;
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
