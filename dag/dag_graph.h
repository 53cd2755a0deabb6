/* dag_graph: the IR plane. A job is a flat list of nodes in topological order (node i may read only
 * nodes < i); each node is one operator of a LLaMA-family decoder with its parameter names (into
 * the model's safetensors), adapter spec, attributes, layer index, per-token output width and cost
 * estimates. Builders make the graph from model dimensions (config.json) and job options; graphs
 * received from the network are checked with dag_graph_validate before anything uses them.
 *
 * Tensors between nodes are row-major [tokens × width] float32; "tokens" is the symbolic dimension
 * (batch × sequence for training, the new tokens of a step for inference). */
#ifndef FU_DAG_GRAPH_H
#define FU_DAG_GRAPH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_MAX_INPUTS   3       /* most node inputs of any op (attention: q, k, v) */
#define DAG_MAX_PARAMS   4       /* most parameter names (salr linear: weight, residual A, B, bias) */
#define DAG_NODE_BIAS    1u      /* dag_node.flags: a linear adds a bias [dim_out], its last parameter */
#define DAG_NODE_INT8    2u      /* ... a linear's weight is int8 with row scales <params[0]>_scale */
#define DAG_NAME_MAX     160     /* longest parameter name, including the NUL */
#define DAG_MAX_NODES    65536   /* most nodes a graph may hold (checked on decode) */
#define DAG_MAX_DIM      (1u << 20) /* largest width, vocabulary or feature count accepted */
#define DAG_MAX_RANK     4096    /* largest adapter rank accepted */
#define DAG_NO_LAYER     (-1)    /* layer index of nodes outside the decoder layers */

/* Operators. Values are stable: they travel on the wire (proto/dag.proto mirrors them). */
typedef enum {
    DAG_OP_EMBEDDING = 1,     /* 0 inputs: gathers rows of the embedding for the step's tokens */
    DAG_OP_RMSNORM = 2,       /* 1 input */
    DAG_OP_LINEAR = 3,        /* 1 input; y = x·Wᵀ (+ adapter) */
    DAG_OP_ROPE = 4,          /* 1 input; rotate-half rotary embedding per head */
    DAG_OP_ATTENTION = 5,     /* 3 inputs q, k, v; causal, grouped-query, KV cache in inference */
    DAG_OP_SILU_MUL = 6,      /* 2 inputs gate, up: silu(gate)·up */
    DAG_OP_ADD = 7,           /* 2 inputs */
    DAG_OP_LM_HEAD = 8,       /* 1 input; logits = x·Wᵀ (SALR-pruned: x·W_sparseᵀ + (x·A₂ᵀ)·B₂ᵀ) */
    DAG_OP_CROSS_ENTROPY = 9, /* 1 input (logits); mean next-token loss against the step's targets */
    DAG_OP_SAMPLE = 10,       /* 1 input (logits); picks the next token of the last position */
    DAG_OP_HEAD_NORM = 11,    /* 1 input; RMSNorm of each head_dim-wide head (Qwen3's q_norm, k_norm) */
    DAG_OP_COUNT_
} dag_op;

/* Adapter methods on a linear node. Stable wire values. */
typedef enum {
    DAG_ADAPTER_NONE = 0,    /* frozen base weight only */
    DAG_ADAPTER_LORA = 1,    /* y += s·(x·Aᵀ)·Bᵀ, A and B trained */
    DAG_ADAPTER_LORA_FA = 2, /* the same, A frozen: only x·Aᵀ is kept for backward */
    DAG_ADAPTER_SALR = 3,    /* sparse base + frozen SVD residual adapter + trained LoRA-FA adapter */
    DAG_ADAPTER_COUNT_
} dag_adapter_method;

/* The seven linear layers of a decoder layer (adapter targets). Stable wire values. */
typedef enum {
    DAG_TARGET_NONE = 0,
    DAG_TARGET_Q = 1,
    DAG_TARGET_K = 2,
    DAG_TARGET_V = 3,
    DAG_TARGET_O = 4,
    DAG_TARGET_GATE = 5,
    DAG_TARGET_UP = 6,
    DAG_TARGET_DOWN = 7,
    DAG_TARGET_COUNT_
} dag_target;

#define DAG_TARGET_BIT(t) (1u << (unsigned)(t))
#define DAG_TARGETS_ALL                                                                            \
    (DAG_TARGET_BIT(DAG_TARGET_Q) | DAG_TARGET_BIT(DAG_TARGET_K) | DAG_TARGET_BIT(DAG_TARGET_V) |  \
     DAG_TARGET_BIT(DAG_TARGET_O) | DAG_TARGET_BIT(DAG_TARGET_GATE) |                              \
     DAG_TARGET_BIT(DAG_TARGET_UP) | DAG_TARGET_BIT(DAG_TARGET_DOWN))

/* Adapter of a linear node. */
typedef struct {
    dag_adapter_method method; /* NONE for a frozen linear */
    uint32_t rank;             /* r of the trained adapter */
    float alpha;               /* scale s = alpha / rank */
    uint32_t res_rank;         /* salr: rank of the frozen SVD residual adapter (0 otherwise) */
} dag_adapter;

/* One operator. Plain data: the graph owns its copy. */
typedef struct {
    uint32_t id;                       /* equals the node's position in the list */
    dag_op op;                         /* the operator */
    uint32_t n_inputs;                 /* number of used entries in inputs */
    uint32_t inputs[DAG_MAX_INPUTS];   /* ids of earlier nodes */
    uint32_t n_params;                 /* number of used entries in params */
    char params[DAG_MAX_PARAMS][DAG_NAME_MAX]; /* HF safetensors names (weight first) */
    dag_target target;                 /* which of the seven linears this is (linear only) */
    dag_adapter adapter;               /* linear; lm_head: NONE, or SALR with rank 0 (a pruned head:
                                          sparse weight + frozen residual of res_rank, 3 params) */
    int32_t layer;                     /* decoder layer index, or DAG_NO_LAYER */
    uint32_t dim_in;                   /* input width (linear, rmsnorm, lm_head, embedding dim) */
    uint32_t dim_out;                  /* output width (linear: out features, lm_head: vocab) */
    uint32_t n_heads;                  /* rope/attention: heads of this tensor (q heads for attn) */
    uint32_t n_kv_heads;               /* attention: key/value heads */
    uint32_t head_dim;                 /* rope/attention */
    float eps;                         /* rmsnorm epsilon */
    float theta;                       /* rope base */
    float rope_factor;                 /* rope: Llama 3 rescaling factor (0: plain RoPE; kern_rope_params) */
    float rope_low_freq, rope_high_freq; /* rope: its low_freq_factor and high_freq_factor */
    float rope_orig_max;               /* rope: its original_max_position_embeddings */
    uint32_t window;                   /* attention: sliding window (Mistral), 0 = none */
    uint32_t flags;                    /* DAG_NODE_BIAS, DAG_NODE_INT8 */
    uint64_t out_width;                /* floats per token of the output (1 for loss/sample) */
    double flops_fwd;                  /* estimated forward FLOPs per token */
    double flops_bwd;                  /* estimated backward FLOPs per token (0 for inference) */
    uint64_t param_bytes;              /* bytes of parameters the node needs resident */
    uint64_t act_bytes;                /* bytes per token saved for backward */
} dag_node;

/* Model dimensions: the parts of a Hugging Face LLaMA config.json the builders need. */
typedef struct {
    uint32_t vocab_size;
    uint32_t hidden_size;
    uint32_t intermediate_size;
    uint32_t n_layers;
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t head_dim;          /* hidden_size / n_heads unless the config says otherwise */
    float rms_eps;
    float rope_theta;
    bool tie_word_embeddings;   /* lm_head reuses model.embed_tokens.weight */
    float rope_factor;          /* rope_scaling "llama3": factor (0: plain RoPE) */
    float rope_low_freq;        /* ... low_freq_factor */
    float rope_high_freq;       /* ... high_freq_factor */
    float rope_orig_max;        /* ... original_max_position_embeddings */
    uint32_t sliding_window;    /* attention window (Mistral), 0 = none */
    bool qkv_bias;              /* q/k/v projections have biases (Qwen2, attention_bias) */
    bool o_bias;                /* o_proj has a bias (attention_bias) */
    bool qk_norm;               /* per-head RMSNorm of q and k before RoPE (Qwen3) */
    bool int8_weights;          /* decoder linears are int8 with row scales (fusion model quantize) */
} dag_model_dims;

/* What the graph ends in. */
typedef enum {
    DAG_HEAD_LOSS = 0,   /* lm_head then cross_entropy (fine-tuning) */
    DAG_HEAD_SAMPLE = 1, /* lm_head then sample (inference) */
    DAG_HEAD_LOGITS = 2, /* ends at lm_head (logits are the output) */
} dag_head;

/* Job options of a builder. */
typedef struct {
    dag_adapter_method method; /* adapter on targeted linears */
    uint32_t rank;             /* adapter rank (ignored for NONE) */
    float alpha;               /* adapter alpha */
    uint32_t targets;          /* bitmask of DAG_TARGET_BIT(); 0 means all seven */
    uint32_t res_rank;         /* salr: rank of the model's residual adapters */
    bool salr_lm_head;         /* salr: the model's lm_head is pruned too (bitmap-encoded weight plus
                                  its own frozen residual of rank res_rank, no trained adapter);
                                  needs method SALR and untied embeddings */
    dag_head head;             /* loss, sample or logits */
    uint32_t seq_len;          /* context length used for attention cost estimates */
} dag_build_opts;

typedef struct dag_graph dag_graph_t;

/* An empty graph. NULL only if allocation fails. */
dag_graph_t *dag_graph_new(void);
/* Frees the graph; idempotent, sets *self_p to NULL. */
void dag_graph_destroy(dag_graph_t **self_p);

/* Appends a copy of *node (its id is set to the next position). No validation: call
 * dag_graph_validate when the whole graph is there. FU_EINVAL when full. */
FU_MUST_CHECK fu_err dag_graph_add_node(dag_graph_t *self, const dag_node *node, uint32_t *id_out);

size_t dag_graph_size(const dag_graph_t *self);
/* Borrowed node i (NULL when out of range). */
const dag_node *dag_graph_node(const dag_graph_t *self, size_t i);
/* Mutable node i, for builders and decoders. */
dag_node *dag_graph_node_mut(dag_graph_t *self, size_t i);

/* The decoder layers of nodes [first, last) for people: "layers 0-3", or, where a cut falls inside a
 * layer, which half of it: "layers 0-1.attn" then "layers 1.mlp-3" (attn: up to the layer's attention
 * residual, mlp: after it); "layer 2.mlp" for one; "no decoder layers". At most cap bytes with the NUL. */
void dag_graph_range_label(const dag_graph_t *self, size_t first, size_t last, char *buf, size_t cap);

/* Model dimensions the graph was built from (copied by builders and the decoder). */
const dag_model_dims *dag_graph_dims(const dag_graph_t *self);
void dag_graph_set_dims(dag_graph_t *self, const dag_model_dims *dims);

/* Builds a LLaMA decoder graph: embedding, n_layers × (rmsnorm, q/k/v linears (with biases when the
 * dims say so), head_norm q/k (Qwen3), rope q/k, attention,
 * o linear, add, rmsnorm, gate/up linears, silu_mul, down linear, add), final rmsnorm, lm_head and
 * the head chosen in opts. Parameter names are Hugging Face's. With opts->salr_lm_head the lm_head
 * node is SALR too (params lm_head.weight, lm_head.salr_A.weight, lm_head.salr_B.weight). FU_EINVAL
 * (with a log line) on impossible dimensions or options (salr_lm_head without method SALR or with
 * tied embeddings among them). *out is a new graph the caller destroys. */
FU_MUST_CHECK fu_err dag_build_llama(const dag_model_dims *dims, const dag_build_opts *opts, dag_graph_t **out);

/* Checks everything a graph from the network could get wrong: node count, ids equal positions,
 * inputs earlier than the node, op and enum ranges, arity per op, widths consistent between
 * producers and consumers, attributes in range, parameter names present and sane, adapters only on
 * linears with sane rank/alpha. Returns FU_OK or FU_EPROTO and writes a message naming the node to
 * em (may be NULL). Pure; thread-safe. */
FU_MUST_CHECK fu_err dag_graph_validate(const dag_graph_t *self, fu_errmsg *em);
/* Whether nodes [first, last) can be a pipeline stage: no node at or after `last` reads a node before
 * `first` (a tensor that skips a whole stage cannot be forwarded). FU_EINVAL naming the node. */
FU_MUST_CHECK fu_err dag_graph_check_range(const dag_graph_t *self, size_t first, size_t last, fu_errmsg *em);

/* The rotary parameters of a rope node (its theta and Llama 3's rescaling) as the kernels take them. */
kern_rope_params dag_rope_params(const dag_node *n);

/* Stable lower-case names ("linear", "lora_fa", "q_proj"); "?" when out of range. */
const char *dag_op_name(dag_op op);
const char *dag_adapter_name(dag_adapter_method m);
const char *dag_target_name(dag_target t);
/* Parses "lora", "lora-fa"/"lora_fa", "salr", "none". FU_EINVAL otherwise. */
FU_MUST_CHECK fu_err dag_adapter_parse(const char *s, dag_adapter_method *out);
/* Parses a comma list of targets ("q_proj,v_proj" or "q,v", "all") into a bitmask. FU_EINVAL on
 * an unknown name. */
FU_MUST_CHECK fu_err dag_targets_parse(const char *s, uint32_t *mask_out);

/* Width in floats per token of node i's output (0 when i is out of range). */
uint64_t dag_graph_width(const dag_graph_t *self, uint32_t i);

/* Sums of the cost estimates over nodes [first, last). */
typedef struct {
    double flops_fwd;     /* per token */
    double flops_bwd;     /* per token */
    uint64_t param_bytes; /* resident parameters */
    uint64_t act_bytes;   /* saved for backward, per token */
    uint64_t kv_bytes;    /* inference: the KV cache of one position (dag_node_kv_bytes) */
} dag_cost;
dag_cost dag_graph_cost(const dag_graph_t *self, size_t first, size_t last);
/* The bytes one position of an inference session keeps for node n: an attention's keys and values
 * (f32), 0 for any other node. */
uint64_t dag_node_kv_bytes(const dag_node *n);

/* Floats per token that cross the cut between [0, at) and [at, n): the widths of every node < at
 * read by a node ≥ at, each counted once. */
uint64_t dag_graph_cut_width(const dag_graph_t *self, size_t at);

#ifdef __cplusplus
}
#endif
#endif
