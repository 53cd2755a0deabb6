#include "fu_modelcfg.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fu_alloc.h"

void fu_modelcfg_defaults(fu_modelcfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->model_type, sizeof cfg->model_type, "llama");
    snprintf(cfg->architecture, sizeof cfg->architecture, "LlamaForCausalLM");
    snprintf(cfg->torch_dtype, sizeof cfg->torch_dtype, "float32");
    cfg->hidden_size = 64;
    cfg->intermediate_size = 128;
    cfg->num_hidden_layers = 2;
    cfg->num_attention_heads = 4;
    cfg->num_key_value_heads = 2;
    cfg->head_dim = 16;
    cfg->vocab_size = 256;
    cfg->max_position_embeddings = FU_MODELCFG_DEFAULT_MAX_POS;
    cfg->rms_norm_eps = FU_MODELCFG_DEFAULT_RMS_EPS;
    cfg->rope_theta = FU_MODELCFG_DEFAULT_ROPE_THETA;
    cfg->tie_word_embeddings = false;
    cfg->bos_token_id = -1;
    cfg->eos_token_id = -1;
}

/* root's member key, or NULL when it is absent or null (the field keeps its default). */
static const cJSON *member(const cJSON *root, const char *key)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    return it && !cJSON_IsNull(it) ? it : NULL;
}

/* Reads key as a non-negative integer. *present tells whether it was there (and not null). */
static fu_err get_uint(const cJSON *root, const char *key, const char *lab, uint64_t *out, bool *present,
                       fu_errmsg *em)
{
    const cJSON *it = member(root, key);
    *present = false;
    if (!it)
        return FU_OK;
    double d = it->valuedouble;
    if (!cJSON_IsNumber(it) || !(d >= 0.0) || d > 9007199254740992.0 || d != floor(d))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"%s\" must be a non-negative integer", lab, key);
    *out = (uint64_t)d;
    *present = true;
    return FU_OK;
}

static fu_err get_size(const cJSON *root, const char *key, const char *lab, bool required, size_t *out,
                       fu_errmsg *em)
{
    uint64_t v = 0;
    bool present;
    FU_TRY(get_uint(root, key, lab, &v, &present, em));
    if (!present) {
        if (required)
            return fu_errmsg_set(em, FU_EPROTO, "%s: \"%s\" is missing", lab, key);
        return FU_OK;
    }
    if (v > SIZE_MAX)
        return fu_errmsg_set(em, FU_EINVAL, "%s: \"%s\" is too large", lab, key);
    *out = (size_t)v;
    return FU_OK;
}

static fu_err get_double(const cJSON *root, const char *key, const char *lab, double *out, fu_errmsg *em)
{
    const cJSON *it = member(root, key);
    if (!it)
        return FU_OK;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"%s\" must be a number", lab, key);
    *out = it->valuedouble;
    return FU_OK;
}

static fu_err get_bool(const cJSON *root, const char *key, const char *lab, bool *out, fu_errmsg *em)
{
    const cJSON *it = member(root, key);
    if (!it)
        return FU_OK;
    if (!cJSON_IsBool(it))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"%s\" must be true or false", lab, key);
    *out = cJSON_IsTrue(it);
    return FU_OK;
}

/* A token id field: an integer, or a list of integers (the first is taken), or absent (-1). */
static fu_err get_token_id(const cJSON *root, const char *key, const char *lab, int64_t *out, fu_errmsg *em)
{
    const cJSON *it = member(root, key);
    *out = -1;
    if (!it)
        return FU_OK;
    if (cJSON_IsArray(it))
        it = it->child;
    if (!it)
        return FU_OK;
    double d = it->valuedouble;
    if (!cJSON_IsNumber(it) || !(d >= 0.0) || d > (double)FU_MODELCFG_MAX_VOCAB || d != floor(d))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"%s\" must be a token id", lab, key);
    *out = (int64_t)d;
    return FU_OK;
}

/* eos_token_id: one id or a list of them (Llama 3: [128001, 128008, 128009]). */
static fu_err get_token_ids(const cJSON *root, const char *key, const char *lab, fu_modelcfg *c, fu_errmsg *em)
{
    const cJSON *it = member(root, key);
    c->n_eos = 0;
    c->eos_token_id = -1;
    if (!it || cJSON_IsNull(it))
        return FU_OK;
    const cJSON *e = cJSON_IsArray(it) ? it->child : it;
    for (; e; e = cJSON_IsArray(it) ? e->next : NULL) {
        double d = e->valuedouble;
        if (!cJSON_IsNumber(e) || !(d >= 0.0) || d > (double)FU_MODELCFG_MAX_VOCAB || d != floor(d))
            return fu_errmsg_set(em, FU_EPROTO, "%s: \"%s\" must be a token id or a list of them", lab, key);
        if (c->n_eos == FU_MODELCFG_MAX_EOS)
            return fu_errmsg_set(em, FU_EINVAL, "%s: \"%s\" lists more than %d ids", lab, key, FU_MODELCFG_MAX_EOS);
        c->eos_token_ids[c->n_eos++] = (int64_t)d;
    }
    if (c->n_eos)
        c->eos_token_id = c->eos_token_ids[0];
    return FU_OK;
}

bool fu_modelcfg_is_eos(const fu_modelcfg *c, int64_t fallback, int64_t id)
{
    if (!c || c->n_eos == 0) { /* a configuration made in memory: its one id, else the fallback */
        int64_t e = c && c->eos_token_id >= 0 ? c->eos_token_id : fallback;
        return e >= 0 && id == e;
    }
    for (size_t i = 0; i < c->n_eos && i < FU_MODELCFG_MAX_EOS; i++)
        if (c->eos_token_ids[i] == id)
            return true;
    return false;
}

/* rope_scaling: absent, null or type "default" is plain RoPE; "llama3" (Llama 3.1/3.2) is taken
 * with its four numbers; any other type is refused, naming it. */
static fu_err parse_rope_scaling(const cJSON *root, const char *lab, fu_modelcfg *c, fu_errmsg *em)
{
    const cJSON *rs = member(root, "rope_scaling");
    c->rope_factor = c->rope_low_freq_factor = c->rope_high_freq_factor = 0.0;
    c->rope_original_max_pos = 0;
    if (!rs || cJSON_IsNull(rs))
        return FU_OK;
    if (!cJSON_IsObject(rs))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"rope_scaling\" must be an object", lab);
    const cJSON *t = member(rs, "rope_type");
    if (!t)
        t = member(rs, "type"); /* the older name */
    if (!cJSON_IsString(t))
        return fu_errmsg_set(em, FU_EPROTO, "%s: rope_scaling needs a \"rope_type\"", lab);
    if (strcmp(t->valuestring, "default") == 0)
        return FU_OK;
    if (strcmp(t->valuestring, "llama3") != 0)
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: rope_scaling.rope_type '%.40s' is not supported (fusion takes \"llama3\" and \"default\")",
                             lab, t->valuestring);
    FU_TRY(get_double(rs, "factor", lab, &c->rope_factor, em));
    FU_TRY(get_double(rs, "low_freq_factor", lab, &c->rope_low_freq_factor, em));
    FU_TRY(get_double(rs, "high_freq_factor", lab, &c->rope_high_freq_factor, em));
    FU_TRY(get_size(rs, "original_max_position_embeddings", lab, true, &c->rope_original_max_pos, em));
    if (!(c->rope_factor >= 1.0 && c->rope_factor <= 1e6) || !(c->rope_low_freq_factor > 0.0) ||
        !(c->rope_high_freq_factor > c->rope_low_freq_factor) || !(c->rope_high_freq_factor <= 1e6) ||
        c->rope_original_max_pos > (size_t)FU_MODELCFG_MAX_POS)
        return fu_errmsg_set(em, FU_EINVAL,
                             "%s: rope_scaling llama3 needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
                             "original_max_position_embeddings (got %g, %g, %g, %zu)",
                             lab, c->rope_factor, c->rope_low_freq_factor, c->rope_high_freq_factor,
                             c->rope_original_max_pos);
    return FU_OK;
}

/* The families fusion runs: model_type and its architecture. */
static const struct {
    const char *type, *arch;
} families[] = {
    {"llama", "LlamaForCausalLM"},
    {"mistral", "MistralForCausalLM"},
    {"qwen2", "Qwen2ForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},
};
#define N_FAMILIES (sizeof families / sizeof *families)

static bool known_model_type(const char *t)
{
    for (size_t i = 0; i < N_FAMILIES; i++)
        if (strcmp(t, families[i].type) == 0)
            return true;
    return false;
}

static bool known_architecture(const char *a)
{
    for (size_t i = 0; i < N_FAMILIES; i++)
        if (strcmp(a, families[i].arch) == 0)
            return true;
    return false;
}

static fu_err parse_root(const cJSON *root, const char *lab, fu_modelcfg *c, fu_errmsg *em)
{
    if (!cJSON_IsObject(root))
        return fu_errmsg_set(em, FU_EPROTO, "%s: not a JSON object", lab);

    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    const cJSON *ar = member(root, "architectures");
    if (mt && !cJSON_IsString(mt))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"model_type\" must be a string", lab);
    if (ar && (!cJSON_IsArray(ar) || (ar->child && !cJSON_IsString(ar->child))))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"architectures\" must be a list of strings", lab);
    const char *arch = (ar && cJSON_IsArray(ar) && ar->child) ? ar->child->valuestring : NULL;
    if (!mt && !arch)
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: has neither \"model_type\" nor \"architectures\" (expected a LLaMA-family model)", lab);
    if (mt && !known_model_type(mt->valuestring))
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: model_type '%.40s' is not supported (fusion runs llama, mistral, qwen2 and qwen3)", lab,
                             mt->valuestring);
    if (arch && !known_architecture(arch))
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: architecture '%.60s' is not supported (fusion runs LlamaForCausalLM, "
                             "MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM)",
                             lab, arch);
    size_t fam = 0; /* the family: from model_type, else from the architecture */
    while (fam + 1 < N_FAMILIES && strcmp(mt ? mt->valuestring : arch, mt ? families[fam].type : families[fam].arch))
        fam++;
    snprintf(c->model_type, sizeof c->model_type, "%s", families[fam].type);
    snprintf(c->architecture, sizeof c->architecture, "%s", arch ? arch : families[fam].arch);
    bool qwen2 = strcmp(c->model_type, "qwen2") == 0, qwen3 = strcmp(c->model_type, "qwen3") == 0;

    const cJSON *act = member(root, "hidden_act");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0))
        return fu_errmsg_set(em, FU_EVERSION, "%s: hidden_act must be \"silu\" (SwiGLU); other activations are not supported",
                             lab);
    /* Biases: Qwen2's q/k/v always have them (and its o_proj none); elsewhere attention_bias: true
     * gives all four projections one. Qwen3 normalises each head of q and k. */
    bool flag = false;
    FU_TRY(get_bool(root, "attention_bias", lab, &flag, em));
    c->attn_qkv_bias = qwen2 || flag;
    c->attn_o_bias = !qwen2 && flag;
    c->qk_norm = qwen3;
    c->byte_tokens = false;
    FU_TRY(get_bool(root, "fusion_byte_tokens", lab, &c->byte_tokens, em));
    flag = false;
    FU_TRY(get_bool(root, "use_sliding_window", lab, &flag, em));
    if (flag && (qwen2 || qwen3))
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: use_sliding_window=true is not supported for %s (windows that depend on the layer, "
                             "max_window_layers)", lab, c->model_type);
    flag = false;
    FU_TRY(get_bool(root, "mlp_bias", lab, &flag, em));
    if (flag)
        return fu_errmsg_set(em, FU_EVERSION, "%s: mlp_bias=true is not supported", lab);
    FU_TRY(parse_rope_scaling(root, lab, c, em));

    FU_TRY(get_size(root, "hidden_size", lab, true, &c->hidden_size, em));
    FU_TRY(get_size(root, "intermediate_size", lab, true, &c->intermediate_size, em));
    FU_TRY(get_size(root, "num_hidden_layers", lab, true, &c->num_hidden_layers, em));
    FU_TRY(get_size(root, "num_attention_heads", lab, true, &c->num_attention_heads, em));
    FU_TRY(get_size(root, "vocab_size", lab, true, &c->vocab_size, em));
    c->num_key_value_heads = c->num_attention_heads;
    FU_TRY(get_size(root, "num_key_value_heads", lab, false, &c->num_key_value_heads, em));
    c->max_position_embeddings = FU_MODELCFG_DEFAULT_MAX_POS;
    FU_TRY(get_size(root, "max_position_embeddings", lab, false, &c->max_position_embeddings, em));
    c->head_dim = 0;
    FU_TRY(get_size(root, "head_dim", lab, false, &c->head_dim, em));
    if (c->head_dim == 0) {
        if (c->num_attention_heads == 0)
            return fu_errmsg_set(em, FU_EINVAL, "%s: num_attention_heads must be positive", lab);
        if (c->hidden_size % c->num_attention_heads != 0)
            return fu_errmsg_set(em, FU_EINVAL, "%s: hidden_size %zu is not divisible by num_attention_heads %zu", lab,
                                 c->hidden_size, c->num_attention_heads);
        c->head_dim = c->hidden_size / c->num_attention_heads;
    }
    c->rms_norm_eps = FU_MODELCFG_DEFAULT_RMS_EPS;
    FU_TRY(get_double(root, "rms_norm_eps", lab, &c->rms_norm_eps, em));
    c->rope_theta = FU_MODELCFG_DEFAULT_ROPE_THETA;
    FU_TRY(get_double(root, "rope_theta", lab, &c->rope_theta, em));
    c->tie_word_embeddings = false;
    FU_TRY(get_bool(root, "tie_word_embeddings", lab, &c->tie_word_embeddings, em));
    c->sliding_window = 0;
    if (!cJSON_IsNull(member(root, "sliding_window"))) /* null: none (Mistral v0.2 on) */
        FU_TRY(get_size(root, "sliding_window", lab, false, &c->sliding_window, em));
    if (qwen2 || qwen3) /* Qwen's sliding_window applies only with use_sliding_window, refused above */
        c->sliding_window = 0;
    FU_TRY(get_token_id(root, "bos_token_id", lab, &c->bos_token_id, em));
    FU_TRY(get_token_ids(root, "eos_token_id", lab, c, em));
    const cJSON *qc = member(root, "quantization_config");
    if (qc && !cJSON_IsNull(qc)) {
        const cJSON *qm = cJSON_IsObject(qc) ? member(qc, "quant_method") : NULL;
        if (!cJSON_IsString(qm))
            return fu_errmsg_set(em, FU_EPROTO, "%s: \"quantization_config\" must be an object with a \"quant_method\"",
                                 lab);
        if (strcmp(qm->valuestring, FU_MODELCFG_INT8_METHOD) != 0)
            return fu_errmsg_set(em, FU_EVERSION,
                                 "%s: quantization_config.quant_method '%.40s' is not supported (fusion reads its own "
                                 "\"" FU_MODELCFG_INT8_METHOD "\" from fusion model quantize; give the unquantized model)",
                                 lab, qm->valuestring);
        c->int8_weights = true;
    }
    const cJSON *td = member(root, "torch_dtype");
    if (td) {
        if (!cJSON_IsString(td))
            return fu_errmsg_set(em, FU_EPROTO, "%s: \"torch_dtype\" must be a string", lab);
        snprintf(c->torch_dtype, sizeof c->torch_dtype, "%.15s", td->valuestring);
    }
    return FU_OK;
}

fu_err fu_modelcfg_parse(const char *json, size_t len, const char *label, fu_modelcfg *out, fu_errmsg *em)
{
    const char *lab = label ? label : FU_MODELCFG_FILE;
    if (!json || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_modelcfg_parse: NULL argument");
    fu_modelcfg c;
    fu_modelcfg_defaults(&c);
    c.torch_dtype[0] = '\0';
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        return fu_errmsg_set(em, FU_EPROTO, "%s: not valid JSON", lab);
    fu_err rc = parse_root(root, lab, &c, em);
    cJSON_Delete(root);
    if (rc != FU_OK)
        return rc;
    fu_errmsg sub = {{0}};
    rc = fu_modelcfg_validate(&c, &sub);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "%s: %s", lab, sub.msg);
    *out = c;
    return FU_OK;
}

fu_err fu_modelcfg_load(const char *dir, fu_modelcfg *out, fu_errmsg *em)
{
    if (!dir || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_modelcfg_load: NULL argument");
    if (!fu_path_is_dir(dir))
        return fu_errmsg_set(em, FU_ENOTFOUND, "model dir '%s' does not exist or is not a directory", dir);
    char *path = fu_path_join(dir, FU_MODELCFG_FILE);
    char *txt = NULL;
    size_t len = 0;
    fu_errmsg sub = {{0}};
    fu_err rc = fu_file_read_all(path, FU_MODELCFG_MAX_BYTES, &txt, &len, &sub);
    free(path);
    if (rc == FU_ENOTFOUND)
        return fu_errmsg_set(em, rc, "model dir '%s' has no %s (expected a Hugging Face model directory)", dir,
                             FU_MODELCFG_FILE);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "model dir '%s': %s", dir, sub.msg);
    rc = fu_modelcfg_parse(txt, len, FU_MODELCFG_FILE, out, em);
    free(txt);
    return rc;
}

static fu_err check_range(const char *field, size_t v, size_t max, fu_errmsg *em)
{
    if (v == 0)
        return fu_errmsg_set(em, FU_EINVAL, "%s must be positive", field);
    if (v > max)
        return fu_errmsg_set(em, FU_EINVAL, "%s %zu is over the limit of %zu", field, v, max);
    return FU_OK;
}

fu_err fu_modelcfg_validate(const fu_modelcfg *c, fu_errmsg *em)
{
    if (!c)
        return fu_errmsg_set(em, FU_EINVAL, "no configuration");
    FU_TRY(check_range("hidden_size", c->hidden_size, FU_MODELCFG_MAX_HIDDEN, em));
    FU_TRY(check_range("intermediate_size", c->intermediate_size, FU_MODELCFG_MAX_FFN, em));
    FU_TRY(check_range("num_hidden_layers", c->num_hidden_layers, FU_MODELCFG_MAX_LAYERS, em));
    FU_TRY(check_range("num_attention_heads", c->num_attention_heads, FU_MODELCFG_MAX_HEADS, em));
    FU_TRY(check_range("num_key_value_heads", c->num_key_value_heads, FU_MODELCFG_MAX_HEADS, em));
    FU_TRY(check_range("head_dim", c->head_dim, FU_MODELCFG_MAX_HEAD_DIM, em));
    FU_TRY(check_range("vocab_size", c->vocab_size, FU_MODELCFG_MAX_VOCAB, em));
    FU_TRY(check_range("max_position_embeddings", c->max_position_embeddings, FU_MODELCFG_MAX_POS, em));
    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return fu_errmsg_set(em, FU_EINVAL, "num_attention_heads %zu is not divisible by num_key_value_heads %zu",
                             c->num_attention_heads, c->num_key_value_heads);
    if (c->head_dim % 2 != 0)
        return fu_errmsg_set(em, FU_EINVAL, "head_dim %zu must be even (rotary embeddings rotate half of each head)",
                             c->head_dim);
    if (c->num_attention_heads * c->head_dim > 4 * (size_t)FU_MODELCFG_MAX_HIDDEN)
        return fu_errmsg_set(em, FU_EINVAL, "num_attention_heads * head_dim = %zu is over the limit",
                             c->num_attention_heads * c->head_dim);
    if (!(c->rms_norm_eps > 0.0 && c->rms_norm_eps < 1.0))
        return fu_errmsg_set(em, FU_EINVAL, "rms_norm_eps %g must be in (0, 1)", c->rms_norm_eps);
    if (!(c->rope_theta > 0.0) || !isfinite(c->rope_theta))
        return fu_errmsg_set(em, FU_EINVAL, "rope_theta %g must be positive", c->rope_theta);
    if (c->bos_token_id >= (int64_t)c->vocab_size || c->eos_token_id >= (int64_t)c->vocab_size)
        return fu_errmsg_set(em, FU_EINVAL, "bos_token_id/eos_token_id must be below vocab_size %zu", c->vocab_size);
    for (size_t i = 0; i < c->n_eos && i < FU_MODELCFG_MAX_EOS; i++)
        if (c->eos_token_ids[i] < 0 || c->eos_token_ids[i] >= (int64_t)c->vocab_size)
            return fu_errmsg_set(em, FU_EINVAL, "eos_token_id %" PRId64 " must be below vocab_size %zu",
                                 c->eos_token_ids[i], c->vocab_size);
    if (c->n_eos > FU_MODELCFG_MAX_EOS)
        return fu_errmsg_set(em, FU_EINVAL, "more than %d eos_token_id", FU_MODELCFG_MAX_EOS);
    if (!known_model_type(c->model_type))
        return fu_errmsg_set(em, FU_EVERSION, "model_type '%s' is not supported", c->model_type);
    if (c->architecture[0] && !known_architecture(c->architecture))
        return fu_errmsg_set(em, FU_EVERSION, "architecture '%s' is not supported", c->architecture);
    return FU_OK;
}

char *fu_modelcfg_to_json(const fu_modelcfg *c)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *ar = cJSON_AddArrayToObject(o, "architectures");
    cJSON_AddItemToArray(ar, cJSON_CreateString(c->architecture[0] ? c->architecture : "LlamaForCausalLM"));
    cJSON_AddStringToObject(o, "model_type", c->model_type[0] ? c->model_type : "llama");
    cJSON_AddStringToObject(o, "hidden_act", "silu");
    cJSON_AddNumberToObject(o, "hidden_size", (double)c->hidden_size);
    cJSON_AddNumberToObject(o, "intermediate_size", (double)c->intermediate_size);
    cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "num_attention_heads", (double)c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_key_value_heads", (double)c->num_key_value_heads);
    cJSON_AddNumberToObject(o, "head_dim", (double)c->head_dim);
    cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
    cJSON_AddNumberToObject(o, "max_position_embeddings", (double)c->max_position_embeddings);
    cJSON_AddNumberToObject(o, "rms_norm_eps", c->rms_norm_eps);
    cJSON_AddNumberToObject(o, "rope_theta", c->rope_theta);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    if (strcmp(c->model_type, "qwen2") != 0) /* Qwen2's q/k/v biases come with the family */
        cJSON_AddBoolToObject(o, "attention_bias", c->attn_o_bias);
    cJSON_AddBoolToObject(o, "mlp_bias", 0);
    cJSON_AddNumberToObject(o, "initializer_range", 0.02);
    if (c->byte_tokens)
        cJSON_AddBoolToObject(o, "fusion_byte_tokens", true);
    cJSON_AddBoolToObject(o, "use_cache", 1);
    if (c->bos_token_id >= 0)
        cJSON_AddNumberToObject(o, "bos_token_id", (double)c->bos_token_id);
    if (c->n_eos > 1) {
        cJSON *el = cJSON_AddArrayToObject(o, "eos_token_id");
        for (size_t i = 0; i < c->n_eos && i < FU_MODELCFG_MAX_EOS; i++)
            cJSON_AddItemToArray(el, cJSON_CreateNumber((double)c->eos_token_ids[i]));
    } else if (c->eos_token_id >= 0) {
        cJSON_AddNumberToObject(o, "eos_token_id", (double)c->eos_token_id);
    }
    if (c->rope_factor > 0.0) {
        cJSON *rs = cJSON_AddObjectToObject(o, "rope_scaling");
        cJSON_AddStringToObject(rs, "rope_type", "llama3");
        cJSON_AddNumberToObject(rs, "factor", c->rope_factor);
        cJSON_AddNumberToObject(rs, "low_freq_factor", c->rope_low_freq_factor);
        cJSON_AddNumberToObject(rs, "high_freq_factor", c->rope_high_freq_factor);
        cJSON_AddNumberToObject(rs, "original_max_position_embeddings", (double)c->rope_original_max_pos);
    }
    if (c->sliding_window > 0)
        cJSON_AddNumberToObject(o, "sliding_window", (double)c->sliding_window);
    cJSON_AddStringToObject(o, "torch_dtype", c->torch_dtype[0] ? c->torch_dtype : "float32");
    if (c->int8_weights) {
        cJSON *qc = cJSON_AddObjectToObject(o, "quantization_config");
        cJSON_AddStringToObject(qc, "quant_method", FU_MODELCFG_INT8_METHOD);
        cJSON_AddNumberToObject(qc, "bits", 8);
        cJSON_AddStringToObject(qc, "granularity", "per output channel, symmetric");
        cJSON_AddStringToObject(qc, "scale_suffix", FU_ST_QSCALE_SUFFIX);
    }
    return fu_file_json_text(o, "fu_modelcfg_to_json: out of memory");
}

fu_err fu_modelcfg_save(const char *dir, const fu_modelcfg *cfg, fu_errmsg *em)
{
    if (!dir || !cfg)
        return fu_errmsg_set(em, FU_EINVAL, "fu_modelcfg_save: NULL argument");
    fu_errmsg sub = {{0}};
    fu_err rc = fu_modelcfg_validate(cfg, &sub);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "invalid model configuration: %s", sub.msg);
    char *txt = fu_modelcfg_to_json(cfg);
    char *path = fu_path_join(dir, FU_MODELCFG_FILE);
    rc = fu_file_write_atomic(path, txt, strlen(txt), 0644, em);
    free(path);
    free(txt);
    return rc;
}

size_t fu_modelcfg_layer_kinds(const fu_modelcfg *c, fu_weight_kind kinds[FU_W_PER_LAYER_MAX])
{
    static const fu_weight_kind base[] = {FU_W_ATTN_NORM, FU_W_Q,    FU_W_K,  FU_W_V,   FU_W_O,
                                          FU_W_FFN_NORM,  FU_W_GATE, FU_W_UP, FU_W_DOWN};
    size_t n = 0;
    for (size_t i = 0; i < sizeof base / sizeof *base; i++)
        kinds[n++] = base[i];
    if (c->attn_qkv_bias) {
        kinds[n++] = FU_W_Q_BIAS;
        kinds[n++] = FU_W_K_BIAS;
        kinds[n++] = FU_W_V_BIAS;
    }
    if (c->attn_o_bias)
        kinds[n++] = FU_W_O_BIAS;
    if (c->qk_norm) {
        kinds[n++] = FU_W_Q_NORM;
        kinds[n++] = FU_W_K_NORM;
    }
    return n;
}

size_t fu_modelcfg_weight_count(const fu_modelcfg *c)
{
    fu_weight_kind k[FU_W_PER_LAYER_MAX];
    return 2 + fu_modelcfg_layer_kinds(c, k) * c->num_hidden_layers + (c->tie_word_embeddings ? 0 : 1);
}

/* The name of a layer weight after "model.layers.N.". */
static const char *layer_suffix(fu_weight_kind k)
{
    switch (k) {
    case FU_W_ATTN_NORM: return "input_layernorm.weight";
    case FU_W_Q: return "self_attn.q_proj.weight";
    case FU_W_K: return "self_attn.k_proj.weight";
    case FU_W_V: return "self_attn.v_proj.weight";
    case FU_W_O: return "self_attn.o_proj.weight";
    case FU_W_FFN_NORM: return "post_attention_layernorm.weight";
    case FU_W_GATE: return "mlp.gate_proj.weight";
    case FU_W_UP: return "mlp.up_proj.weight";
    case FU_W_DOWN: return "mlp.down_proj.weight";
    case FU_W_Q_BIAS: return "self_attn.q_proj.bias";
    case FU_W_K_BIAS: return "self_attn.k_proj.bias";
    case FU_W_V_BIAS: return "self_attn.v_proj.bias";
    case FU_W_O_BIAS: return "self_attn.o_proj.bias";
    case FU_W_Q_NORM: return "self_attn.q_norm.weight";
    case FU_W_K_NORM: return "self_attn.k_norm.weight";
    default: return NULL;
    }
}

fu_err fu_modelcfg_weight_of(const fu_modelcfg *c, fu_weight_kind kind, int layer, fu_weight_info *w)
{
    if (!c || !w || (unsigned)kind >= FU_W_KIND_COUNT_)
        return FU_EINVAL;
    memset(w, 0, sizeof *w);
    w->kind = kind;
    w->layer = -1;
    uint64_t d = c->hidden_size, f = c->intermediate_size, v = c->vocab_size;
    uint64_t q = (uint64_t)c->num_attention_heads * c->head_dim, kv = (uint64_t)c->num_key_value_heads * c->head_dim;
    switch (kind) {
    case FU_W_EMBED:
        snprintf(w->name, sizeof w->name, "model.embed_tokens.weight");
        w->ndim = 2, w->shape[0] = v, w->shape[1] = d;
        return FU_OK;
    case FU_W_FINAL_NORM:
        snprintf(w->name, sizeof w->name, "model.norm.weight");
        w->ndim = 1, w->shape[0] = d, w->is_norm = true;
        return FU_OK;
    case FU_W_LM_HEAD:
        if (c->tie_word_embeddings)
            return FU_ENOTFOUND;
        snprintf(w->name, sizeof w->name, "lm_head.weight");
        w->ndim = 2, w->shape[0] = v, w->shape[1] = d;
        return FU_OK;
    default:
        break;
    }
    if (layer < 0 || (size_t)layer >= c->num_hidden_layers)
        return FU_EINVAL;
    w->layer = layer;
    const char *suffix = layer_suffix(kind);
    if (!suffix)
        return FU_EINVAL;
    snprintf(w->name, sizeof w->name, "model.layers.%d.%s", layer, suffix);
    w->ndim = 2;
    switch (kind) {
    case FU_W_ATTN_NORM:
    case FU_W_FFN_NORM:
        w->ndim = 1, w->shape[0] = d, w->is_norm = true;
        break;
    case FU_W_Q: w->shape[0] = q, w->shape[1] = d; break;
    case FU_W_K:
    case FU_W_V: w->shape[0] = kv, w->shape[1] = d; break;
    case FU_W_O: w->shape[0] = d, w->shape[1] = q; break;
    case FU_W_GATE:
    case FU_W_UP: w->shape[0] = f, w->shape[1] = d; break;
    case FU_W_DOWN: w->shape[0] = d, w->shape[1] = f; break;
    case FU_W_Q_BIAS: w->ndim = 1, w->shape[0] = q; break;
    case FU_W_K_BIAS:
    case FU_W_V_BIAS: w->ndim = 1, w->shape[0] = kv; break;
    case FU_W_O_BIAS: w->ndim = 1, w->shape[0] = d; break;
    case FU_W_Q_NORM:
    case FU_W_K_NORM: w->ndim = 1, w->shape[0] = c->head_dim, w->is_norm = true; break;
    default: break;
    }
    return FU_OK;
}

fu_err fu_modelcfg_weight(const fu_modelcfg *c, size_t i, fu_weight_info *w)
{
    if (!c || !w || i >= fu_modelcfg_weight_count(c))
        return FU_EINVAL;
    if (i == 0)
        return fu_modelcfg_weight_of(c, FU_W_EMBED, -1, w);
    i--;
    fu_weight_kind kinds[FU_W_PER_LAYER_MAX];
    size_t per = fu_modelcfg_layer_kinds(c, kinds);
    if (i < per * c->num_hidden_layers)
        return fu_modelcfg_weight_of(c, kinds[i % per], (int)(i / per), w);
    i -= per * c->num_hidden_layers;
    return fu_modelcfg_weight_of(c, i == 0 ? FU_W_FINAL_NORM : FU_W_LM_HEAD, -1, w);
}

uint64_t fu_modelcfg_param_count(const fu_modelcfg *c)
{
    uint64_t total = 0;
    size_t n = fu_modelcfg_weight_count(c);
    for (size_t i = 0; i < n; i++) {
        fu_weight_info w;
        if (fu_modelcfg_weight(c, i, &w) != FU_OK)
            continue;
        uint64_t e = 1;
        for (size_t k = 0; k < w.ndim; k++)
            e *= w.shape[k];
        total += e;
    }
    return total;
}

fu_err fu_modelcfg_check_weights(const fu_modelcfg *c, const fu_safetensors *st, fu_errmsg *em)
{
    if (!c || !st)
        return fu_errmsg_set(em, FU_EINVAL, "fu_modelcfg_check_weights: NULL argument");
    size_t n = fu_modelcfg_weight_count(c);
    for (size_t i = 0; i < n; i++) {
        fu_weight_info w;
        const fu_st_tensor *t = NULL;
        FU_TRY(fu_modelcfg_weight(c, i, &w));
        FU_TRY(fu_safetensors_expect(st, w.name, w.ndim, w.shape, &t, em));
        if (t->dtype == FU_ST_I8 && c->int8_weights && w.ndim == 2) {
            float *scale = fu_malloc((size_t)w.shape[0] * sizeof *scale);
            fu_err rc = fu_safetensors_qscale(st, t, scale, em);
            free(scale);
            FU_TRY(rc);
            continue;
        }
        if (t->dtype == FU_ST_I8)
            return fu_errmsg_set(em, FU_EINVAL,
                                 "%s: tensor '%s' is int8, but config.json has no quantization_config \"%s\" for it",
                                 t->file, t->name, FU_MODELCFG_INT8_METHOD);
        if (!fu_st_dtype_is_float(t->dtype) || t->dtype == FU_ST_F64)
            return fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' has dtype %s, expected F32, F16 or BF16", t->file,
                                 t->name, fu_st_dtype_name(t->dtype));
    }
    return FU_OK;
}
