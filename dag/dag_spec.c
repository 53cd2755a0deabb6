/* dag_spec: the job spec's one table of numeric fields (defaults, limits, JSON keys, options), the
 * few fields of other types beside it, the JSON codec and the command-line conversion. */
#include "dag_spec.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "dag_exec.h"
#include "fu_alloc.h"

typedef enum { F_U32, F_U64, F_DBL } ftype;

#define KF (1u << DAG_JOB_FINETUNE) /* a field of fine-tuning specs */
#define KI (1u << DAG_JOB_INFER)    /* a field of inference specs */
#define KE (1u << DAG_JOB_EVAL)     /* a field of eval specs */
#define PL (1u << 8)                /* its option only with DAG_SPEC_CLI_PIPELINE */

/* Every numeric field: key, option, type, place, limits, default, kinds, --help. */
typedef struct {
    const char *key;     /* JSON key */
    const char *opt;     /* long option */
    ftype type;          /* storage */
    size_t off;          /* offset in dag_spec */
    double lo, hi;       /* inclusive limits */
    double def;          /* default */
    unsigned kinds;      /* KF, KI (and PL) */
    const char *metavar; /* for --help */
    const char *help;    /* for --help */
} field;

#define OFF(f) offsetof(dag_spec, f)
static const field FIELDS[] = {
    {"rank", "rank", F_U32, OFF(rank), 1, DAG_MAX_RANK, 8, KF, "R", "adapter rank (default 8)"},
    {"alpha", "alpha", F_DBL, OFF(alpha), 0, 1e6, 0, KF, "A", "adapter alpha; scale = alpha/rank (default 2·rank)"},
    {"lr", "lr", F_DBL, OFF(lr), 1e-12, 10, 1e-3, KF, "LR", "AdamW learning rate (default 1e-3)"},
    {"weight_decay", "weight-decay", F_DBL, OFF(weight_decay), 0, 10, 0, KF, "W",
     "AdamW decoupled weight decay (default 0)"},
    {"steps", "steps", F_U64, OFF(steps), 1, 1e9, 100, KF | KE, "N", "optimizer steps (default 100)"},
    {"batch", "batch", F_U32, OFF(batch), 1, 65536, 4, KF | KE, "B", "sequences per step (default 4)"},
    {"seq_len", "seq-len", F_U32, OFF(seq_len), 1, DAG_SPEC_MAX_ROWS, 128, KF | KE, "T",
     "tokens per sequence (default 128)"},
    {"micro_batches", "micro-batches", F_U32, OFF(micro_batches), 0, DAG_EXEC_MAX_SLOTS, 1, KF | KE, "M",
     "micro-batches per step, dividing B (default 1; fusion submit: 0 lets the broker choose for the links)"},
    {"checkpoint_every", "checkpoint-every", F_U64, OFF(checkpoint_every), 1, 1e9, 10, KF | PL, "K",
     "checkpoint every K steps (default 10; int8-ef gradients restart their error feedback there)"},
    {"heldout", "heldout", F_DBL, OFF(heldout), 0, 0.5, 0, KF | KE, "F",
     "fraction of the data kept out of training for `fusion eval` (the last examples; default 0)"},
    {"verify", "verify", F_DBL, OFF(verify), 0, 1, -1, KF | PL, "F",
     "fraction 0..1 of micro-batches the broker re-runs on a second peer (default: the broker's --verify)"},
    {"seed", "seed", F_U64, OFF(seed), 0, DAG_SPEC_MAX_SEED, 0, KF | KI, "S",
     "seed of the shuffle and the adapter initialisation, or of the sampler (default 0)"},
    {"max_tokens", "max-tokens", F_U32, OFF(max_tokens), 1, DAG_SPEC_MAX_TOKENS, 64, KI, "N",
     "tokens to generate (default 64)"},
    {"temperature", "temperature", F_DBL, OFF(temperature), 0, 100, 0, KI, "T",
     "sampling temperature; 0 = greedy (default 0)"},
    {"top_k", "top-k", F_U32, OFF(top_k), 0, 1 << 22, 0, KI, "K", "sample among the K most likely tokens (default 0: all)"},
    {"top_p", "top-p", F_DBL, OFF(top_p), 0, 1, 1, KI, "P", "nucleus sampling threshold (default 1: off)"},
    {"sessions", "sessions", F_U32, OFF(sessions), 0, DAG_SPEC_MAX_SESSIONS, 0, KI | PL, "S",
     "a serving job of up to S generations at once, opened with `fusion ask` (default 0: one generation)"},
    {"context", "context", F_U32, OFF(context), 0, DAG_SPEC_MAX_PROMPT + DAG_SPEC_MAX_TOKENS, 0, KI | PL, "N",
     "serving job: positions of one session, prompt and generated (default 2048)"},
    {"idle_s", "idle-s", F_U32, OFF(idle_s), 0, 1e7, 0, KI | PL, "S",
     "serving job: cancelled after S seconds without a session (default 0: never)"},
};
#define N_FIELDS (sizeof FIELDS / sizeof FIELDS[0])

/* The other keys, by kind. */
static const char *const FT_KEYS[] = {"kind",         "model",       "method",    "targets",   "shuffle",
                                      "trusted_ends", "byte_tokens", "act_codec", "grad_codec"};
static const char *const IN_KEYS[] = {"kind",          "model",        "adapter_job", "dump_logits",
                                      "prompt_tokens", "trusted_ends", "byte_tokens", "stop"};

static const char *const EV_KEYS[] = {"kind", "model", "adapter_job", "trusted_ends", "byte_tokens", "act_codec"};

static const char *const KIND_NAMES[] = {"finetune", "infer", "eval"};

#define CODECS      "f32, f16, bf16 or int8"
#define GRAD_CODECS "f32, f16, bf16, int8 or int8-ef"

static double get(const dag_spec *s, const field *f)
{
    const char *p = (const char *)s + f->off;
    switch (f->type) {
    case F_U32:
        return (double)*(const uint32_t *)p;
    case F_U64:
        return (double)*(const uint64_t *)p;
    default:
        return *(const double *)p;
    }
}

static void set(dag_spec *s, const field *f, double v)
{
    char *p = (char *)s + f->off;
    switch (f->type) {
    case F_U32:
        *(uint32_t *)p = (uint32_t)v;
        break;
    case F_U64:
        *(uint64_t *)p = (uint64_t)v;
        break;
    default:
        *(double *)p = v;
    }
}

void dag_spec_init(dag_spec *s, dag_job_kind kind)
{
    memset(s, 0, sizeof *s);
    s->kind = kind == DAG_JOB_INFER || kind == DAG_JOB_EVAL ? kind : DAG_JOB_FINETUNE;
    s->method = DAG_ADAPTER_LORA_FA;
    s->trusted_ends = -1;
    for (size_t i = 0; i < N_FIELDS; i++)
        set(s, &FIELDS[i], FIELDS[i].def);
}

void dag_spec_clear(dag_spec *s)
{
    if (!s)
        return;
    free(s->prompt_tokens);
    dag_spec_init(s, s->kind);
}

void dag_spec_copy(dag_spec *dst, const dag_spec *src)
{
    *dst = *src;
    if (src->prompt_tokens) {
        dst->prompt_tokens = fu_malloc((src->n_prompt_tokens ? src->n_prompt_tokens : 1) * sizeof *dst->prompt_tokens);
        memcpy(dst->prompt_tokens, src->prompt_tokens, src->n_prompt_tokens * sizeof *dst->prompt_tokens);
    }
}

/* A value v for field f: in range, whole for integer fields. name is how the user wrote it
 * ("spec: \"rank\"" in JSON, "--rank" on the command line). */
static fu_err check_value(const field *f, double v, const char *name, fu_errmsg *em)
{
    if (!isfinite(v) || v < f->lo || v > f->hi)
        return fu_errmsg_set(em, FU_EINVAL, "%s must be a number between %g and %g", name, f->lo, f->hi);
    if (f->type != F_DBL && v != floor(v))
        return fu_errmsg_set(em, FU_EINVAL, "%s must be a whole number", name);
    return FU_OK;
}

static bool job_id_ok(const char *id)
{
    if (!*id)
        return true;
    if (strlen(id) != DAG_SPEC_JOB_ID_LEN)
        return false;
    for (const char *p = id; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return false;
    return true;
}

fu_err dag_spec_check(const dag_spec *s, fu_errmsg *em)
{
    if (!s || (s->kind != DAG_JOB_FINETUNE && s->kind != DAG_JOB_INFER && s->kind != DAG_JOB_EVAL))
        return fu_errmsg_set(em, FU_EINVAL, "spec: \"kind\" must be \"finetune\", \"infer\" or \"eval\"");
    unsigned k = 1u << s->kind;
    for (size_t i = 0; i < N_FIELDS; i++) {
        const field *f = &FIELDS[i];
        char name[48];
        snprintf(name, sizeof name, "spec: \"%s\"", f->key);
        double v = get(s, f);
        if ((f->kinds & k) && !(f->def < 0 && v == f->def)) /* a negative default means "unset" */
            FU_TRY(check_value(f, v, name, em));
    }
    if (s->kind != DAG_JOB_FINETUNE && !job_id_ok(s->adapter_job))
        return fu_errmsg_set(em, FU_EINVAL, "spec: \"adapter_job\" must be a job id (16 hex characters) or \"\"");
    if (s->kind == DAG_JOB_FINETUNE) {
        if (s->method == DAG_ADAPTER_NONE || (unsigned)s->method > DAG_ADAPTER_SALR)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"method\" must be \"lora-fa\", \"lora\" or \"salr\"");
        if (s->targets & ~(uint32_t)DAG_TARGETS_ALL)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"targets\" names an unknown linear");
    }
    if (s->kind != DAG_JOB_INFER) { /* batches of windows: a fine-tune's or an eval's */
        if (s->micro_batches == 0 && s->kind != DAG_JOB_FINETUNE)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"micro_batches\" must be 1 or more (0, the broker's choice, "
                                                "is for fine-tunes)");
        if (s->micro_batches && s->batch % s->micro_batches != 0)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"micro_batches\" (%u) must divide \"batch\" (%u)",
                                 s->micro_batches, s->batch);
        if ((uint64_t)s->batch * s->seq_len > DAG_SPEC_MAX_ROWS)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"batch\" x \"seq_len\" must be at most %u tokens",
                                 DAG_SPEC_MAX_ROWS);
    } else {
        if (s->n_prompt_tokens > DAG_SPEC_MAX_PROMPT || (s->n_prompt_tokens && !s->prompt_tokens))
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"prompt_tokens\" holds at most %u ids", DAG_SPEC_MAX_PROMPT);
        for (size_t i = 0; i < s->n_prompt_tokens; i++)
            if (s->prompt_tokens[i] < 0)
                return fu_errmsg_set(em, FU_EINVAL, "spec: \"prompt_tokens\" must hold token ids (0 or more)");
        if (s->sessions && (s->n_prompt_tokens || s->dump_logits))
            return fu_errmsg_set(em, FU_EINVAL, "spec: a serving job (\"sessions\") takes its prompts per session "
                                                "(SessionOpen): no \"prompt_tokens\" or \"dump_logits\"");
        if (s->n_stop > DAG_SPEC_MAX_STOP)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"stop\" holds at most %d strings", DAG_SPEC_MAX_STOP);
        for (size_t i = 0; i < s->n_stop; i++)
            if (!s->stop[i][0] || memchr(s->stop[i], '\0', sizeof s->stop[i]) == NULL)
                return fu_errmsg_set(em, FU_EINVAL, "spec: \"stop\" strings are 1 to %d bytes", DAG_SPEC_STOP_LEN);
    }
    if (memchr(s->model, '\0', sizeof s->model) == NULL)
        return fu_errmsg_set(em, FU_EINVAL, "spec: \"model\" is too long");
    if ((unsigned)s->act_codec >= KERN_CODEC_COUNT_ || s->act_codec == KERN_CODEC_INT8_EF)
        return fu_errmsg_set(em, FU_EINVAL, "spec: \"act_codec\" must be " CODECS " (error feedback is for gradients)");
    if ((unsigned)s->grad_codec >= KERN_CODEC_COUNT_)
        return fu_errmsg_set(em, FU_EINVAL, "spec: \"grad_codec\" must be " GRAD_CODECS);
    if ((s->kind == DAG_JOB_INFER && (s->act_codec || s->grad_codec)) || (s->kind == DAG_JOB_EVAL && s->grad_codec))
        return fu_errmsg_set(em, FU_EINVAL, "spec: wire codecs are for fine-tunes (\"act_codec\", \"grad_codec\") "
                                            "and evals (\"act_codec\")");
    return FU_OK;
}

/* ---- JSON ---------------------------------------------------------------------------------------- */

/* A codec key's value (absent: left as it is). */
static fu_err parse_codec(const cJSON *o, const char *key, kern_codec *out, fu_errmsg *em)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    bool grad = strcmp(key, "grad_codec") == 0;
    if (v && (!cJSON_IsString(v) || kern_codec_parse(v->valuestring, out) != FU_OK ||
              (!grad && *out == KERN_CODEC_INT8_EF)))
        return fu_errmsg_set(em, FU_EINVAL, "spec: \"%s\" must be %s", key, grad ? GRAD_CODECS : CODECS);
    return FU_OK;
}

static bool in(const char *k, const char *const *keys, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(k, keys[i]) == 0)
            return true;
    return false;
}

static const field *field_of(const char *key, unsigned kinds)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        if ((FIELDS[i].kinds & kinds) && strcmp(FIELDS[i].key, key) == 0)
            return &FIELDS[i];
    return NULL;
}

/* Whether the text's keys make it an inference spec (no "kind" in it). */
static dag_job_kind kind_of_keys(const cJSON *o)
{
    for (const cJSON *it = o->child; it; it = it->next)
        if (it->string && (in(it->string, IN_KEYS + 2, 3) ||
                           (field_of(it->string, KI) && !field_of(it->string, KF))))
            return DAG_JOB_INFER;
    return DAG_JOB_FINETUNE;
}

static fu_err parse_string_keys(const cJSON *o, dag_spec *s, fu_errmsg *em)
{
    const cJSON *v;
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "model"))) {
        if (!cJSON_IsString(v) || strlen(v->valuestring) >= sizeof s->model)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"model\" must be a model directory (at most %d bytes)",
                                 DAG_SPEC_MODEL_MAX - 1);
        snprintf(s->model, sizeof s->model, "%s", v->valuestring);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "trusted_ends"))) {
        if (!cJSON_IsBool(v))
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"trusted_ends\" must be true or false");
        s->trusted_ends = cJSON_IsTrue(v) ? 1 : 0;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "byte_tokens"))) {
        if (!cJSON_IsBool(v))
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"byte_tokens\" must be true or false");
        s->byte_tokens = cJSON_IsTrue(v);
    }
    if (s->kind != DAG_JOB_INFER)
        FU_TRY(parse_codec(o, "act_codec", &s->act_codec, em));
    if (s->kind == DAG_JOB_FINETUNE)
        FU_TRY(parse_codec(o, "grad_codec", &s->grad_codec, em));
    if (s->kind == DAG_JOB_FINETUNE) {
        if ((v = cJSON_GetObjectItemCaseSensitive(o, "method")) &&
            (!cJSON_IsString(v) || dag_adapter_parse(v->valuestring, &s->method) != FU_OK ||
             s->method == DAG_ADAPTER_NONE))
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"method\" must be \"lora-fa\", \"lora\" or \"salr\"");
        if ((v = cJSON_GetObjectItemCaseSensitive(o, "targets"))) {
            bool ok = cJSON_IsArray(v) && cJSON_GetArraySize(v) > 0;
            s->targets = 0;
            for (const cJSON *t = ok ? v->child : NULL; t && ok; t = t->next) {
                uint32_t one = 0;
                ok = cJSON_IsString(t) && strchr(t->valuestring, ',') == NULL &&
                     dag_targets_parse(t->valuestring, &one) == FU_OK;
                s->targets |= one;
            }
            if (!ok)
                return fu_errmsg_set(em, FU_EINVAL, "spec: \"targets\" must be a list of q_proj, k_proj, v_proj, "
                                                    "o_proj, gate_proj, up_proj, down_proj");
            if (s->targets == DAG_TARGETS_ALL)
                s->targets = 0;
        }
        if ((v = cJSON_GetObjectItemCaseSensitive(o, "shuffle"))) {
            if (!cJSON_IsBool(v))
                return fu_errmsg_set(em, FU_EINVAL, "spec: \"shuffle\" must be true or false");
            s->shuffle = cJSON_IsTrue(v);
        }
        return FU_OK;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "adapter_job"))) {
        if (!cJSON_IsString(v) || !job_id_ok(v->valuestring))
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"adapter_job\" must be a job id (16 hex characters) or \"\"");
        snprintf(s->adapter_job, sizeof s->adapter_job, "%s", v->valuestring);
    }
    if (s->kind == DAG_JOB_EVAL)
        return FU_OK;
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "adapter_job"))) {
        if (!cJSON_IsString(v) || !job_id_ok(v->valuestring))
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"adapter_job\" must be a job id (16 hex characters) or \"\"");
        snprintf(s->adapter_job, sizeof s->adapter_job, "%s", v->valuestring);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "dump_logits"))) {
        if (!cJSON_IsBool(v))
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"dump_logits\" must be true or false");
        s->dump_logits = cJSON_IsTrue(v);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "stop"))) {
        const cJSON *t;
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) > DAG_SPEC_MAX_STOP)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"stop\" must be a list of at most %d strings", DAG_SPEC_MAX_STOP);
        cJSON_ArrayForEach(t, v)
        {
            size_t n = cJSON_IsString(t) ? strlen(t->valuestring) : 0;
            if (n == 0 || n > DAG_SPEC_STOP_LEN)
                return fu_errmsg_set(em, FU_EINVAL, "spec: \"stop\" strings are 1 to %d bytes", DAG_SPEC_STOP_LEN);
            memcpy(s->stop[s->n_stop++], t->valuestring, n + 1);
        }
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(o, "prompt_tokens"))) {
        int n = cJSON_GetArraySize(v);
        if (!cJSON_IsArray(v) || n < 0 || (size_t)n > DAG_SPEC_MAX_PROMPT)
            return fu_errmsg_set(em, FU_EINVAL, "spec: \"prompt_tokens\" must be a list of at most %u token ids",
                                 DAG_SPEC_MAX_PROMPT);
        s->prompt_tokens = fu_malloc((size_t)(n ? n : 1) * sizeof *s->prompt_tokens);
        s->n_prompt_tokens = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, v)
        {
            double d = cJSON_IsNumber(t) ? t->valuedouble : -1;
            if (!(d >= 0 && d <= INT32_MAX && d == floor(d)))
                return fu_errmsg_set(em, FU_EINVAL, "spec: \"prompt_tokens\" must hold token ids (0 or more)");
            s->prompt_tokens[s->n_prompt_tokens++] = (int32_t)d;
        }
    }
    return FU_OK;
}

fu_err dag_spec_parse(const char *json, size_t len, dag_job_kind kind, dag_spec *out, fu_errmsg *em)
{
    if (!out)
        return FU_EINVAL;
    dag_spec_init(out, kind);
    if (!json || len > DAG_SPEC_MAX_BYTES)
        return fu_errmsg_set(em, FU_EINVAL, "spec: missing or over %u bytes", DAG_SPEC_MAX_BYTES);
    cJSON *o = cJSON_ParseWithLength(json, len);
    fu_err rc = FU_OK;
    if (!o || !cJSON_IsObject(o)) {
        rc = fu_errmsg_set(em, FU_EPROTO, "spec: not a JSON object");
        goto done;
    }
    const cJSON *k = cJSON_GetObjectItemCaseSensitive(o, "kind");
    dag_job_kind said = DAG_JOB_ANY;
    if (k) {
        if (!cJSON_IsString(k) || !in(k->valuestring, KIND_NAMES, 3)) {
            rc = fu_errmsg_set(em, FU_EINVAL, "spec: \"kind\" must be \"finetune\", \"infer\" or \"eval\"");
            goto done;
        }
        said = strcmp(k->valuestring, "infer") == 0  ? DAG_JOB_INFER
               : strcmp(k->valuestring, "eval") == 0 ? DAG_JOB_EVAL
                                                     : DAG_JOB_FINETUNE;
        if (kind != DAG_JOB_ANY && said != kind) {
            rc = fu_errmsg_set(em, FU_EINVAL, "spec: \"kind\" is \"%s\" in a %s job", k->valuestring, KIND_NAMES[kind]);
            goto done;
        }
    }
    dag_spec_init(out, kind != DAG_JOB_ANY ? kind : said != DAG_JOB_ANY ? said : kind_of_keys(o));
    unsigned kb = 1u << out->kind;
    const char *const *keys = out->kind == DAG_JOB_FINETUNE ? FT_KEYS : out->kind == DAG_JOB_EVAL ? EV_KEYS : IN_KEYS;
    const size_t n_keys = out->kind == DAG_JOB_FINETUNE ? sizeof FT_KEYS / sizeof *FT_KEYS
                          : out->kind == DAG_JOB_EVAL   ? sizeof EV_KEYS / sizeof *EV_KEYS
                                                        : sizeof IN_KEYS / sizeof *IN_KEYS;
    for (const cJSON *it = o->child; it; it = it->next) {
        const field *f = it->string ? field_of(it->string, kb) : NULL;
        if (!f && !(it->string && in(it->string, keys, n_keys))) {
            rc = fu_errmsg_set(em, FU_EINVAL, "spec: unknown key \"%s\" for a %s job", it->string ? it->string : "?",
                               KIND_NAMES[out->kind]);
            goto done;
        }
        if (!f)
            continue;
        char name[48];
        snprintf(name, sizeof name, "spec: \"%s\"", f->key);
        if (!cJSON_IsNumber(it)) {
            rc = fu_errmsg_set(em, FU_EINVAL, "%s must be a number between %g and %g", name, f->lo, f->hi);
            goto done;
        }
        if ((rc = check_value(f, it->valuedouble, name, em)) != FU_OK)
            goto done;
        set(out, f, it->valuedouble);
    }
    if ((rc = parse_string_keys(o, out, em)) != FU_OK)
        goto done;
    if (out->kind == DAG_JOB_FINETUNE && !(out->alpha > 0))
        out->alpha = 2.0 * out->rank;
    rc = dag_spec_check(out, em);
done:
    cJSON_Delete(o);
    if (rc != FU_OK)
        dag_spec_clear(out);
    return rc;
}

char *dag_spec_to_json(const dag_spec *s)
{
    cJSON *o = cJSON_CreateObject();
    unsigned kb = 1u << s->kind;
    cJSON_AddStringToObject(o, "kind", KIND_NAMES[s->kind <= DAG_JOB_EVAL ? s->kind : 0]);
    if (s->model[0])
        cJSON_AddStringToObject(o, "model", s->model);
    for (size_t i = 0; i < N_FIELDS; i++) {
        const field *f = &FIELDS[i];
        double v = get(s, f);
        /* a serving job's fields only when it is one: the canonical text of every other spec stays */
        bool serve_only = f->off == OFF(sessions) || f->off == OFF(context) || f->off == OFF(idle_s);
        if ((f->kinds & kb) && !(f->def < 0 && v == f->def) && !(serve_only && !s->sessions))
            cJSON_AddNumberToObject(o, f->key, v);
    }
    if (s->kind == DAG_JOB_FINETUNE) {
        cJSON_AddStringToObject(o, "method", dag_adapter_name(s->method));
        if (s->targets) {
            cJSON *arr = cJSON_AddArrayToObject(o, "targets");
            for (int t = 1; t < DAG_TARGET_COUNT_; t++)
                if (s->targets & DAG_TARGET_BIT(t))
                    cJSON_AddItemToArray(arr, cJSON_CreateString(dag_target_name((dag_target)t)));
        }
        cJSON_AddBoolToObject(o, "shuffle", s->shuffle);
        cJSON_AddStringToObject(o, "act_codec", kern_codec_name(s->act_codec));
        cJSON_AddStringToObject(o, "grad_codec", kern_codec_name(s->grad_codec));
        if (s->trusted_ends >= 0)
            cJSON_AddBoolToObject(o, "trusted_ends", s->trusted_ends);
        if (s->byte_tokens)
            cJSON_AddBoolToObject(o, "byte_tokens", true);
    } else if (s->kind == DAG_JOB_EVAL) {
        cJSON_AddStringToObject(o, "adapter_job", s->adapter_job);
        cJSON_AddStringToObject(o, "act_codec", kern_codec_name(s->act_codec));
        if (s->trusted_ends >= 0)
            cJSON_AddBoolToObject(o, "trusted_ends", s->trusted_ends);
        if (s->byte_tokens)
            cJSON_AddBoolToObject(o, "byte_tokens", true);
    } else {
        if (s->byte_tokens)
            cJSON_AddBoolToObject(o, "byte_tokens", true);
        cJSON_AddStringToObject(o, "adapter_job", s->adapter_job);
        cJSON_AddBoolToObject(o, "dump_logits", s->dump_logits);
        if (s->trusted_ends >= 0)
            cJSON_AddBoolToObject(o, "trusted_ends", s->trusted_ends);
        if (s->n_stop) { /* only when given: the canonical text of every other spec stays as it was */
            cJSON *arr = cJSON_AddArrayToObject(o, "stop");
            for (size_t i = 0; i < s->n_stop; i++)
                cJSON_AddItemToArray(arr, cJSON_CreateString(s->stop[i]));
        }
        if (s->prompt_tokens) {
            cJSON *arr = cJSON_AddArrayToObject(o, "prompt_tokens");
            for (size_t i = 0; i < s->n_prompt_tokens; i++)
                cJSON_AddItemToArray(arr, cJSON_CreateNumber(s->prompt_tokens[i]));
        }
    }
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!txt)
        abort(); /* allocation failure (as fu_malloc) */
    return txt;
}

size_t dag_spec_stop_at(const dag_spec *s, const char *text, size_t len)
{
    size_t cut = len;
    for (uint32_t i = 0; i < s->n_stop && i < DAG_SPEC_MAX_STOP; i++) {
        size_t sl = strnlen(s->stop[i], DAG_SPEC_STOP_LEN);
        for (size_t p = 0; sl && p + sl <= cut; p++)
            if (memcmp(text + p, s->stop[i], sl) == 0) {
                cut = p;
                break;
            }
    }
    return cut;
}

dag_data_order dag_spec_data_order(const dag_spec *s)
{
    return (dag_data_order){.batch = s->batch, .micro_batches = s->micro_batches, .seq_len = s->seq_len,
                            .shuffle = s->shuffle, .seed = s->seed};
}

kern_adamw_params dag_spec_adamw(const dag_spec *s)
{
    return (kern_adamw_params){.lr = (float)s->lr, .beta1 = DAG_SPEC_ADAM_BETA1, .beta2 = DAG_SPEC_ADAM_BETA2,
                               .eps = DAG_SPEC_ADAM_EPS, .weight_decay = (float)s->weight_decay};
}

/* ---- command-line options ------------------------------------------------------------------------ */

void dag_spec_cli_opts(dag_spec_cli *c, dag_job_kind kind, unsigned flags, fu_opt *opts, size_t cap, size_t *n)
{
    memset(c, 0, sizeof *c);
    unsigned kb = 1u << kind;
    if (kind == DAG_JOB_FINETUNE) {
        c->method = "lora-fa";
        if (*n < cap)
            opts[(*n)++] = (fu_opt){"method", 0, FU_OPT_STR, &c->method, "M",
                                    "lora-fa (default), lora, or salr (needs a pruned model)"};
        if (*n < cap)
            opts[(*n)++] = (fu_opt){"targets", 0, FU_OPT_STR, &c->targets, "LIST",
                                    "linears to adapt: q,k,v,o,gate,up,down (default all)"};
        if (*n < cap)
            opts[(*n)++] = (fu_opt){"shuffle", 0, FU_OPT_FLAG, &c->shuffle, NULL,
                                    "visit the windows in a seeded random order"};
    } else if (*n + 1 < cap) {
        opts[(*n)++] = (fu_opt){"prompt-tokens", 0, FU_OPT_STR, &c->prompt_tokens, "IDS",
                                "prompt as comma-separated token ids"};
        opts[(*n)++] = (fu_opt){"stop", 0, FU_OPT_STR, &c->stop, "TEXT",
                                "the text ends before TEXT; the generation stops there"};
    }
    if (*n < cap)
        opts[(*n)++] = (fu_opt){"byte-tokens", 0, FU_OPT_FLAG, &c->byte_tokens, NULL,
                                "tokenize as bytes (ids 0..255) a model of more ids that has no tokenizer.json"};
    for (size_t i = 0; i < N_FIELDS && i < sizeof c->ival / sizeof c->ival[0]; i++) {
        const field *f = &FIELDS[i];
        c->ival[i] = (long long)f->def;
        c->dval[i] = f->def;
        bool ckpt = (flags & DAG_SPEC_CLI_CHECKPOINTS) && strcmp(f->key, "checkpoint_every") == 0;
        if (!(f->kinds & kb) || ((f->kinds & PL) && !(flags & DAG_SPEC_CLI_PIPELINE) && !ckpt) || *n >= cap)
            continue;
        bool dbl = f->type == F_DBL;
        opts[(*n)++] = (fu_opt){f->opt, 0, dbl ? FU_OPT_DOUBLE : FU_OPT_INT, dbl ? (void *)&c->dval[i] : (void *)&c->ival[i],
                                f->metavar, f->help};
    }
    if (kind != DAG_JOB_INFER && *n < cap)
        opts[(*n)++] = (fu_opt){"wire-codec", 0, FU_OPT_STR, &c->wire_codec, "ACT[,GRAD]",
                                kind == DAG_JOB_EVAL ? "activations between stages as f32 (default), f16, bf16 or int8"
                                                     : "activations and gradients between stages: f32 (default), f16, bf16 or int8 "
                                                       "(per-row scales; its gradients with error feedback, int8-ef); "
                                                       "ACT,GRAD to choose apart"};
    if ((flags & DAG_SPEC_CLI_PIPELINE) && *n < cap)
        opts[(*n)++] = (fu_opt){"trusted-ends", 0, FU_OPT_STR, &c->trusted_ends, "on|off",
                                "keep the first and last stages (they see the tokens) on peers the broker trusts "
                                "(default: on when it has a trusted peer)"};
}

fu_err dag_spec_cli_parse(dag_spec_cli *c, dag_job_kind kind, unsigned flags, fu_cmd *cmd, fu_opt *opts,
                          size_t cap, int argc, char **argv, int *exit_code)
{
    size_t n = 0;
    while (n < cap && opts[n].name)
        n++;
    dag_spec_cli_opts(c, kind, flags, opts, cap, &n);
    cmd->opts = opts;
    cmd->n_opts = n;
    return fu_opts_parse(cmd, argc, argv, NULL, exit_code);
}

fu_err dag_spec_from_cmd(const dag_spec_cli *c, const fu_cmd *cmd, dag_job_kind kind, const char *model,
                         dag_spec *out, int *exit_code)
{
    fu_errmsg em = {{0}};
    fu_err rc = dag_spec_from_cli(c, kind, model, out, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", cmd->prog, em.msg);
        *exit_code = FU_EXIT_USAGE;
    }
    return rc;
}

fu_err dag_spec_from_cli(const dag_spec_cli *c, dag_job_kind kind, const char *model, dag_spec *out, fu_errmsg *em)
{
    dag_spec_init(out, kind);
    unsigned kb = 1u << out->kind;
    if (model && strlen(model) >= sizeof out->model)
        return fu_errmsg_set(em, FU_EINVAL, "--model is longer than %d bytes", DAG_SPEC_MODEL_MAX - 1);
    if (model)
        snprintf(out->model, sizeof out->model, "%s", model);
    for (size_t i = 0; i < N_FIELDS; i++) {
        const field *f = &FIELDS[i];
        if (!(f->kinds & kb))
            continue;
        double v = f->type == F_DBL ? c->dval[i] : (double)c->ival[i];
        if (f->def < 0 && v == f->def) /* left unset */
            continue;
        char name[48];
        snprintf(name, sizeof name, "--%s", f->opt);
        FU_TRY(check_value(f, v, name, em));
        set(out, f, v);
    }
    if (c->trusted_ends) {
        if (strcmp(c->trusted_ends, "on") != 0 && strcmp(c->trusted_ends, "off") != 0)
            return fu_errmsg_set(em, FU_EINVAL, "--trusted-ends must be on or off, not '%s'", c->trusted_ends);
        out->trusted_ends = strcmp(c->trusted_ends, "on") == 0;
    }
    out->byte_tokens = c->byte_tokens;
    if (c->wire_codec && out->kind != DAG_JOB_INFER) {
        char act[16] = "", grad[16] = "";
        const char *comma = strchr(c->wire_codec, ',');
        size_t la = comma ? (size_t)(comma - c->wire_codec) : strlen(c->wire_codec);
        if (la < sizeof act)
            memcpy(act, c->wire_codec, la);
        snprintf(grad, sizeof grad, "%s", comma ? comma + 1 : act);
        if (la >= sizeof act || kern_codec_parse(act, &out->act_codec) != FU_OK ||
            kern_codec_parse(grad, &out->grad_codec) != FU_OK || (comma && out->kind == DAG_JOB_EVAL) ||
            out->act_codec == KERN_CODEC_INT8_EF)
            return fu_errmsg_set(em, FU_EINVAL, "--wire-codec must be %s, not '%.40s'",
                                 out->kind == DAG_JOB_EVAL ? CODECS
                                                           : CODECS " (or ACT,GRAD with GRAD " GRAD_CODECS ": int8,int8-ef)",
                                 c->wire_codec);
        if (out->kind == DAG_JOB_EVAL)
            out->grad_codec = KERN_CODEC_F32;
        else if (!comma && out->act_codec == KERN_CODEC_INT8)
            out->grad_codec = KERN_CODEC_INT8_EF; /* plain int8 gradients cost accuracy (docs/PIPELINE.md) */
    }
    if (out->kind == DAG_JOB_FINETUNE) {
        if (dag_adapter_parse(c->method ? c->method : "lora-fa", &out->method) != FU_OK ||
            out->method == DAG_ADAPTER_NONE)
            return fu_errmsg_set(em, FU_EINVAL, "unknown --method '%s' (lora-fa, lora or salr)", c->method);
        if (c->targets && dag_targets_parse(c->targets, &out->targets) != FU_OK)
            return fu_errmsg_set(em, FU_EINVAL, "bad --targets '%s' (a comma list of q,k,v,o,gate,up,down)", c->targets);
        if (out->targets == DAG_TARGETS_ALL)
            out->targets = 0;
        out->shuffle = c->shuffle;
        if (!(out->alpha > 0))
            out->alpha = 2.0 * out->rank;
        if (out->micro_batches && out->batch % out->micro_batches != 0)
            return fu_errmsg_set(em, FU_EINVAL, "--micro-batches (%u) must divide --batch (%u)", out->micro_batches,
                                 out->batch);
        if ((uint64_t)out->batch * out->seq_len > DAG_SPEC_MAX_ROWS)
            return fu_errmsg_set(em, FU_EINVAL, "--batch x --seq-len must be at most %u tokens", DAG_SPEC_MAX_ROWS);
    } else if (c->stop && (!c->stop[0] || strlen(c->stop) > DAG_SPEC_STOP_LEN)) {
        return fu_errmsg_set(em, FU_EINVAL, "--stop is 1 to %d bytes", DAG_SPEC_STOP_LEN);
    }
    if (out->kind == DAG_JOB_INFER && c->stop)
        memcpy(out->stop[out->n_stop++], c->stop, strlen(c->stop) + 1);
    if (out->kind == DAG_JOB_INFER && c->prompt_tokens) {
        size_t cap = 16;
        out->prompt_tokens = fu_malloc(cap * sizeof *out->prompt_tokens);
        for (const char *p = c->prompt_tokens; *p;) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p || v < 0 || v > INT32_MAX || (*end && *end != ',') ||
                out->n_prompt_tokens >= DAG_SPEC_MAX_PROMPT) {
                dag_spec_clear(out);
                return fu_errmsg_set(em, FU_EINVAL, "--prompt-tokens wants at most %u comma-separated token ids, got "
                                                    "'%.100s'", DAG_SPEC_MAX_PROMPT, c->prompt_tokens);
            }
            if (out->n_prompt_tokens == cap)
                out->prompt_tokens = fu_realloc(out->prompt_tokens, (cap *= 2) * sizeof *out->prompt_tokens);
            out->prompt_tokens[out->n_prompt_tokens++] = (int32_t)v;
            p = *end ? end + 1 : end;
        }
        if (!out->n_prompt_tokens) {
            dag_spec_clear(out);
            return fu_errmsg_set(em, FU_EINVAL, "--prompt-tokens is empty");
        }
    }
    fu_err rc = dag_spec_check(out, em);
    if (rc != FU_OK)
        dag_spec_clear(out);
    return rc;
}
