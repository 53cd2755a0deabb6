/* fu_modelcfg: the config.json of a Hugging Face LLaMA-family model (LlamaForCausalLM and
 * MistralForCausalLM layouts): read, validate, write, and the list of weight tensors such a model
 * has, with their Hugging Face names and shapes. See docs/FORMATS.md. */
#ifndef FU_MODELCFG_H
#define FU_MODELCFG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"
#include "fu_safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FU_MODELCFG_FILE "config.json"
#define FU_MODELCFG_INT8_METHOD "fusion-int8" /* quantization_config.quant_method of fusion model quantize */
/* Largest config.json read. */
#define FU_MODELCFG_MAX_BYTES ((size_t)1 << 20)

/* Sanity bounds of validation (far above any real model, low enough that products of them fit). */
#define FU_MODELCFG_MAX_HIDDEN   65536
#define FU_MODELCFG_MAX_FFN      (1 << 20)
#define FU_MODELCFG_MAX_LAYERS   1024
#define FU_MODELCFG_MAX_HEADS    1024
#define FU_MODELCFG_MAX_HEAD_DIM 1024
#define FU_MODELCFG_MAX_VOCAB    (1 << 22)
#define FU_MODELCFG_MAX_POS      (1 << 24)

/* Defaults when config.json leaves a field out (the transformers LlamaConfig defaults). */
#define FU_MODELCFG_DEFAULT_ROPE_THETA 10000.0
#define FU_MODELCFG_DEFAULT_RMS_EPS    1e-6
#define FU_MODELCFG_DEFAULT_MAX_POS    2048

#define FU_MODELCFG_MAX_EOS 8 /* end-of-sequence ids kept from an eos_token_id list */

typedef struct {
    char   model_type[32];           /* "llama", "mistral", "qwen2" or "qwen3" */
    char   architecture[64];         /* architectures[0]: "LlamaForCausalLM" */
    char   torch_dtype[16];          /* "float32", "float16", "bfloat16" ("" when absent) */
    size_t hidden_size;              /* d_model */
    size_t intermediate_size;        /* SwiGLU inner size */
    size_t num_hidden_layers;        /* decoder layers */
    size_t num_attention_heads;      /* query heads */
    size_t num_key_value_heads;      /* key/value heads (GQA); defaults to num_attention_heads */
    size_t head_dim;                 /* per-head size; defaults to hidden_size / num_attention_heads */
    size_t vocab_size;               /* embedding rows */
    size_t max_position_embeddings;  /* longest sequence for RoPE */
    double rms_norm_eps;             /* RMSNorm epsilon */
    double rope_theta;               /* RoPE base; default 10000 */
    bool   tie_word_embeddings;      /* lm_head shares model.embed_tokens.weight; default false */
    int64_t bos_token_id;            /* -1 when absent */
    int64_t eos_token_id;            /* -1 when absent (the first one when a list) */
    int64_t eos_token_ids[FU_MODELCFG_MAX_EOS]; /* every end-of-sequence id (Llama 3 lists several) */
    size_t n_eos;                    /* how many; 0 when absent */
    /* rope_scaling {"rope_type": "llama3", ...} (Llama 3.1/3.2); rope_factor 0: plain RoPE */
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    size_t rope_original_max_pos;    /* original_max_position_embeddings */
    bool   attn_qkv_bias;            /* q/k/v projections have biases (Qwen2; attention_bias: true) */
    bool   attn_o_bias;              /* o_proj has a bias (attention_bias: true; not Qwen2) */
    bool   qk_norm;                  /* per-head RMSNorm of queries and keys before RoPE (Qwen3) */
    bool   byte_tokens;              /* "fusion_byte_tokens": its ids are bytes, no tokenizer.json needed
                                        (fusion model init writes it) */
    bool   int8_weights;             /* quantization_config {"quant_method": "fusion-int8"} (fusion model
                                        quantize): 2-D weights may be I8 with per-row scales */
    size_t sliding_window;           /* Mistral's attention window (a query sees itself and the window - 1
                                        keys before it); 0 = none (full causal attention) */
} fu_modelcfg;

/* Whether id ends a sequence: one of eos_token_ids, else fallback (the tokenizer's; -1: none). */
bool fu_modelcfg_is_eos(const fu_modelcfg *cfg, int64_t fallback, int64_t id);

/* A small valid configuration (2 layers, hidden 64, 4 heads, 2 kv heads, ffn 128, vocab 256),
 * architecture LlamaForCausalLM, float32. */
void fu_modelcfg_defaults(fu_modelcfg *cfg);

/* Parses config.json text (len bytes) into *out and validates it. label names the text in messages
 * ("config.json"). FU_EPROTO for malformed JSON or wrong field types, FU_EVERSION for a model type or
 * feature fusion does not run (with the reason), FU_EINVAL for values that fail validation. */
FU_MUST_CHECK fu_err fu_modelcfg_parse(const char *json, size_t len, const char *label, fu_modelcfg *out,
                                       fu_errmsg *em);

/* Reads dir/config.json. FU_ENOTFOUND with "model dir 'x' has no config.json (expected a Hugging
 * Face model directory)" when it is missing; otherwise as fu_modelcfg_parse. */
FU_MUST_CHECK fu_err fu_modelcfg_load(const char *dir, fu_modelcfg *out, fu_errmsg *em);

/* Checks sizes are positive and within the bounds above, hidden_size divisible by the head count
 * (when head_dim is not given), heads divisible by kv heads, head_dim even (rotate-half RoPE),
 * eps in (0, 1), rope_theta > 0. FU_EINVAL with the field and the rule in the message. */
FU_MUST_CHECK fu_err fu_modelcfg_validate(const fu_modelcfg *cfg, fu_errmsg *em);

/* config.json text for cfg (transformers' field names, "architectures", "model_type",
 * "hidden_act":"silu", ...). Caller frees. Never NULL. */
char *fu_modelcfg_to_json(const fu_modelcfg *cfg);

/* Validates cfg and writes dir/config.json atomically. */
FU_MUST_CHECK fu_err fu_modelcfg_save(const char *dir, const fu_modelcfg *cfg, fu_errmsg *em);

/* Which weight a tensor is. */
typedef enum {
    FU_W_EMBED = 0,   /* model.embed_tokens.weight         [vocab, hidden] */
    FU_W_ATTN_NORM,   /* model.layers.N.input_layernorm.weight          [hidden] */
    FU_W_Q,           /* model.layers.N.self_attn.q_proj.weight [heads*head_dim, hidden] */
    FU_W_K,           /* model.layers.N.self_attn.k_proj.weight [kv*head_dim, hidden] */
    FU_W_V,           /* model.layers.N.self_attn.v_proj.weight [kv*head_dim, hidden] */
    FU_W_O,           /* model.layers.N.self_attn.o_proj.weight [hidden, heads*head_dim] */
    FU_W_FFN_NORM,    /* model.layers.N.post_attention_layernorm.weight [hidden] */
    FU_W_GATE,        /* model.layers.N.mlp.gate_proj.weight    [ffn, hidden] */
    FU_W_UP,          /* model.layers.N.mlp.up_proj.weight      [ffn, hidden] */
    FU_W_DOWN,        /* model.layers.N.mlp.down_proj.weight    [hidden, ffn] */
    FU_W_FINAL_NORM,  /* model.norm.weight                               [hidden] */
    FU_W_LM_HEAD,     /* lm_head.weight                   [vocab, hidden] (absent when tied) */
    FU_W_Q_BIAS,      /* model.layers.N.self_attn.q_proj.bias   [heads*head_dim] (attn_qkv_bias) */
    FU_W_K_BIAS,      /* model.layers.N.self_attn.k_proj.bias   [kv*head_dim] */
    FU_W_V_BIAS,      /* model.layers.N.self_attn.v_proj.bias   [kv*head_dim] */
    FU_W_O_BIAS,      /* model.layers.N.self_attn.o_proj.bias   [hidden] (attn_o_bias) */
    FU_W_Q_NORM,      /* model.layers.N.self_attn.q_norm.weight [head_dim] (qk_norm) */
    FU_W_K_NORM,      /* model.layers.N.self_attn.k_norm.weight [head_dim] */
    FU_W_KIND_COUNT_
} fu_weight_kind;

/* Most per-layer weight kinds (fu_modelcfg_layer_kinds lists a configuration's). */
#define FU_W_PER_LAYER_MAX 15

/* The weight kinds of one decoder layer of cfg, in the order fu_modelcfg_weight lists them: the
 * nine of every LLaMA layer, then the biases and the q/k norms the configuration has. Returns
 * how many (at most FU_W_PER_LAYER_MAX). */
size_t fu_modelcfg_layer_kinds(const fu_modelcfg *cfg, fu_weight_kind kinds[FU_W_PER_LAYER_MAX]);

/* One expected weight. Shapes are PyTorch's: a linear layer's weight is [out_features, in_features]. */
typedef struct {
    char           name[96];   /* Hugging Face tensor name */
    fu_weight_kind kind;       /* which weight */
    int            layer;      /* decoder layer, -1 for embed, final norm and lm_head */
    size_t         ndim;       /* 1 (norms) or 2 */
    uint64_t       shape[2];   /* sizes */
    bool           is_norm;    /* an RMSNorm gain (initialised to 1) */
} fu_weight_info;

/* Number of weight tensors the model has: 1 + 9·layers + 1 (+1 for lm_head when not tied). */
size_t fu_modelcfg_weight_count(const fu_modelcfg *cfg);

/* The i-th weight (0 <= i < count) in the order embed, layer 0 (input_layernorm, q, k, v, o,
 * post_attention_layernorm, gate, up, down), layer 1, ..., model.norm, lm_head. FU_EINVAL when i is
 * out of range. */
FU_MUST_CHECK fu_err fu_modelcfg_weight(const fu_modelcfg *cfg, size_t i, fu_weight_info *out);

/* The weight of kind in layer (layer ignored for the whole-model kinds). FU_EINVAL when layer is
 * out of range, FU_ENOTFOUND for FU_W_LM_HEAD of a tied model. */
FU_MUST_CHECK fu_err fu_modelcfg_weight_of(const fu_modelcfg *cfg, fu_weight_kind kind, int layer,
                                           fu_weight_info *out);

/* Checks that st holds every weight cfg needs (fu_modelcfg_weight) with exactly its shape and a
 * float dtype (F32, F16, BF16; I8 with valid row scales in an int8_weights model, 2-D only).
 * FU_ENOTFOUND for a missing tensor, FU_EINVAL for a wrong shape or
 * dtype, with a message naming the file and the tensor. An lm_head.weight beside tied embeddings
 * is allowed. */
FU_MUST_CHECK fu_err fu_modelcfg_check_weights(const fu_modelcfg *cfg, const fu_safetensors *st, fu_errmsg *em);

/* Total parameters (elements of every weight). */
uint64_t fu_modelcfg_param_count(const fu_modelcfg *cfg);

#ifdef __cplusplus
}
#endif
#endif
