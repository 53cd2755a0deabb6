#include "dag_graph.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_log.h"

struct dag_graph {
    dag_node *nodes;     /* n nodes in topological order */
    size_t n;            /* nodes used */
    size_t cap;          /* nodes allocated */
    dag_model_dims dims; /* dimensions of the model the graph came from */
};

dag_graph_t *dag_graph_new(void)
{
    dag_graph_t *g = fu_calloc(1, sizeof *g);
    return g;
}

void dag_graph_destroy(dag_graph_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    free((*self_p)->nodes);
    free(*self_p);
    *self_p = NULL;
}

fu_err dag_graph_add_node(dag_graph_t *self, const dag_node *node, uint32_t *id_out)
{
    if (!self || !node)
        return FU_EINVAL;
    if (self->n >= DAG_MAX_NODES)
        return FU_EINVAL;
    if (self->n == self->cap) {
        self->cap = self->cap ? self->cap * 2 : 64;
        self->nodes = fu_realloc(self->nodes, self->cap * sizeof *self->nodes);
    }
    self->nodes[self->n] = *node;
    self->nodes[self->n].id = (uint32_t)self->n;
    if (id_out)
        *id_out = (uint32_t)self->n;
    self->n++;
    return FU_OK;
}

size_t dag_graph_size(const dag_graph_t *self)
{
    return self ? self->n : 0;
}

const dag_node *dag_graph_node(const dag_graph_t *self, size_t i)
{
    return self && i < self->n ? &self->nodes[i] : NULL;
}

dag_node *dag_graph_node_mut(dag_graph_t *self, size_t i)
{
    return self && i < self->n ? &self->nodes[i] : NULL;
}

const dag_model_dims *dag_graph_dims(const dag_graph_t *self)
{
    return &self->dims;
}

void dag_graph_set_dims(dag_graph_t *self, const dag_model_dims *dims)
{
    self->dims = *dims;
}

uint64_t dag_graph_width(const dag_graph_t *self, uint32_t i)
{
    return self && i < self->n ? self->nodes[i].out_width : 0;
}

kern_rope_params dag_rope_params(const dag_node *n)
{
    return (kern_rope_params){.theta = n->theta, .factor = n->rope_factor, .low_freq_factor = n->rope_low_freq,
                              .high_freq_factor = n->rope_high_freq, .original_max_pos = n->rope_orig_max};
}

/* ---- names ---------------------------------------------------------------------------------- */

static const char *const op_names[DAG_OP_COUNT_] = {
    [DAG_OP_EMBEDDING] = "embedding", [DAG_OP_RMSNORM] = "rmsnorm",
    [DAG_OP_LINEAR] = "linear",       [DAG_OP_ROPE] = "rope",
    [DAG_OP_ATTENTION] = "attention", [DAG_OP_SILU_MUL] = "silu_mul",
    [DAG_OP_ADD] = "add",             [DAG_OP_LM_HEAD] = "lm_head",
    [DAG_OP_CROSS_ENTROPY] = "cross_entropy", [DAG_OP_SAMPLE] = "sample",
    [DAG_OP_HEAD_NORM] = "head_norm",
};
static const char *const adapter_names[DAG_ADAPTER_COUNT_] = {"none", "lora", "lora_fa", "salr"};
static const char *const target_names[DAG_TARGET_COUNT_] = {
    "none", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

const char *dag_op_name(dag_op op)
{
    return op > 0 && op < DAG_OP_COUNT_ && op_names[op] ? op_names[op] : "?";
}

const char *dag_adapter_name(dag_adapter_method m)
{
    return (unsigned)m < DAG_ADAPTER_COUNT_ ? adapter_names[m] : "?";
}

const char *dag_target_name(dag_target t)
{
    return (unsigned)t < DAG_TARGET_COUNT_ ? target_names[t] : "?";
}

fu_err dag_adapter_parse(const char *s, dag_adapter_method *out)
{
    if (!s || !out)
        return FU_EINVAL;
    if (strcmp(s, "none") == 0)
        *out = DAG_ADAPTER_NONE;
    else if (strcmp(s, "lora") == 0)
        *out = DAG_ADAPTER_LORA;
    else if (strcmp(s, "lora-fa") == 0 || strcmp(s, "lora_fa") == 0 || strcmp(s, "lorafa") == 0)
        *out = DAG_ADAPTER_LORA_FA;
    else if (strcmp(s, "salr") == 0)
        *out = DAG_ADAPTER_SALR;
    else
        return FU_EINVAL;
    return FU_OK;
}

fu_err dag_targets_parse(const char *s, uint32_t *mask_out)
{
    if (!s || !mask_out)
        return FU_EINVAL;
    uint32_t mask = 0;
    const char *p = s;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        char tok[32];
        if (len == 0 || len >= sizeof tok)
            return FU_EINVAL;
        memcpy(tok, p, len);
        tok[len] = '\0';
        if (strcmp(tok, "all") == 0) {
            mask |= DAG_TARGETS_ALL;
        } else {
            bool found = false;
            for (int t = 1; t < DAG_TARGET_COUNT_; t++) {
                size_t short_len = strlen(target_names[t]) - 5; /* without "_proj" */
                if (strcmp(tok, target_names[t]) == 0 ||
                    (len == short_len && strncmp(tok, target_names[t], short_len) == 0)) {
                    mask |= DAG_TARGET_BIT(t);
                    found = true;
                }
            }
            if (!found)
                return FU_EINVAL;
        }
        p += len;
        if (*p == ',')
            p++;
    }
    if (!mask)
        return FU_EINVAL;
    *mask_out = mask;
    return FU_OK;
}

/* ---- builder -------------------------------------------------------------------------------- */

typedef struct {
    dag_graph_t *g;
    const dag_model_dims *d;
    const dag_build_opts *o;
    double T; /* seq_len for attention costs */
    fu_err err;
} builder;

static void set_param(dag_node *n, uint32_t k, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_param(dag_node *n, uint32_t k, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(n->params[k], DAG_NAME_MAX, fmt, ap);
    va_end(ap);
    if (n->n_params < k + 1)
        n->n_params = k + 1;
}

static uint32_t push(builder *b, dag_node *n)
{
    uint32_t id = 0;
    if (b->err == FU_OK)
        b->err = dag_graph_add_node(b->g, n, &id);
    return id;
}

static dag_node blank(dag_op op, int32_t layer)
{
    dag_node n;
    memset(&n, 0, sizeof n);
    n.op = op;
    n.layer = layer;
    return n;
}

/* Fills the cost fields of a linear node from its shape and adapter. */
static void linear_costs(dag_node *n, bool train)
{
    double in = n->dim_in, out = n->dim_out;
    double r = n->adapter.rank, r2 = n->adapter.res_rank;
    double base = 2.0 * in * out;
    double pb = 4.0 * in * out;
    double fwd = base, bwd = train ? base : 0.0;
    uint64_t act = 0;
    switch (n->adapter.method) {
    case DAG_ADAPTER_NONE:
        break;
    case DAG_ADAPTER_LORA:
        fwd += 2.0 * r * (in + out);
        bwd += 2.0 * r * (in + out) + 2.0 * r * (in + out); /* dX through B,A + dA, dB */
        act = (uint64_t)(4.0 * (in + r));                   /* X and X·Aᵀ */
        pb += 4.0 * r * (in + out) * 4.0;                   /* A, B, their grads and moments */
        break;
    case DAG_ADAPTER_LORA_FA:
        fwd += 2.0 * r * (in + out);
        bwd += 2.0 * r * (in + out) + 2.0 * r * out; /* dX through B,A + dB */
        act = (uint64_t)(4.0 * r);                   /* X·Aᵀ only */
        pb += 4.0 * r * in + 4.0 * r * out * 4.0;    /* A; B, grad, moments */
        break;
    case DAG_ADAPTER_SALR:
        /* Sparse base at 50%: bitmap (1 bit) + packed non-zeros; one concatenated adapter pair. */
        pb = in * out / 8.0 + 4.0 * in * out * 0.5;
        fwd = base * 0.5 + 2.0 * (r + r2) * (in + out);
        bwd = train ? base * 0.5 + 2.0 * (r + r2) * (in + out) + 2.0 * r * out : 0.0;
        act = (uint64_t)(4.0 * (r + r2));
        pb += 4.0 * (r + r2) * in + 4.0 * r2 * out + 4.0 * r * out * 4.0;
        break;
    default:
        break;
    }
    n->flops_fwd = fwd;
    n->flops_bwd = train ? bwd : 0.0;
    n->param_bytes = (uint64_t)pb;
    n->act_bytes = train ? act : 0;
}

/* Fills the cost fields of the lm_head node: dense, or (SALR) the sparse base at 50% (bitmap + packed
 * values, half the multiply-adds) plus the frozen residual pair; the backward computes dX only. */
static void lm_head_costs(dag_node *n, bool train, bool tied)
{
    double in = n->dim_in, out = n->dim_out, base = 2.0 * in * out;
    if (n->adapter.method == DAG_ADAPTER_SALR) {
        double r2 = n->adapter.res_rank;
        n->flops_fwd = base * 0.5 + 2.0 * r2 * (in + out);
        n->flops_bwd = train ? n->flops_fwd : 0.0;
        n->param_bytes = (uint64_t)(in * out / 8.0 + 4.0 * in * out * 0.5 + 4.0 * r2 * (in + out));
        n->act_bytes = train ? (uint64_t)(4.0 * r2) : 0; /* h = X·A₂ᵀ, read by backward */
        return;
    }
    n->flops_fwd = base;
    n->flops_bwd = train ? base : 0.0;
    n->param_bytes = tied ? 0 : (uint64_t)(4.0 * in * out); /* tied: the embedding's table */
}

static uint32_t add_linear(builder *b, int32_t layer, uint32_t in, dag_target tgt, const char *path,
                           uint32_t din, uint32_t dout)
{
    dag_node n = blank(DAG_OP_LINEAR, layer);
    n.n_inputs = 1;
    n.inputs[0] = in;
    n.target = tgt;
    n.dim_in = din;
    n.dim_out = dout;
    n.out_width = dout;
    const char *tname = dag_target_name(tgt);
    set_param(&n, 0, "model.layers.%d.%s.%s.weight", layer, path, tname);
    uint32_t mask = b->o->targets ? b->o->targets : DAG_TARGETS_ALL;
    bool targeted = (mask & DAG_TARGET_BIT(tgt)) != 0;
    if (b->o->method == DAG_ADAPTER_SALR) {
        /* Every linear of a pruned model has its residual adapter; the trained one only on targets. */
        n.adapter.method = DAG_ADAPTER_SALR;
        n.adapter.res_rank = b->o->res_rank;
        n.adapter.rank = targeted ? b->o->rank : 0;
        n.adapter.alpha = targeted ? b->o->alpha : 0.0f;
        set_param(&n, 1, "model.layers.%d.%s.%s.salr_A.weight", layer, path, tname);
        set_param(&n, 2, "model.layers.%d.%s.%s.salr_B.weight", layer, path, tname);
    } else if (targeted && b->o->method != DAG_ADAPTER_NONE) {
        n.adapter.method = b->o->method;
        n.adapter.rank = b->o->rank;
        n.adapter.alpha = b->o->alpha;
    }
    bool qkv = tgt == DAG_TARGET_Q || tgt == DAG_TARGET_K || tgt == DAG_TARGET_V;
    if ((qkv && b->d->qkv_bias) || (tgt == DAG_TARGET_O && b->d->o_bias)) {
        n.flags |= DAG_NODE_BIAS;
        set_param(&n, n.n_params, "model.layers.%d.%s.%s.bias", layer, path, tname);
    }
    linear_costs(&n, b->o->head == DAG_HEAD_LOSS);
    if (n.flags & DAG_NODE_BIAS)
        n.param_bytes += 4ull * dout;
    if (b->d->int8_weights && n.adapter.method != DAG_ADAPTER_SALR) { /* a byte a weight, and the row scales */
        n.flags |= DAG_NODE_INT8;
        n.param_bytes -= 3ull * din * dout;
        n.param_bytes += 4ull * dout;
    }
    return push(b, &n);
}

/* Qwen3's RMSNorm of each head of in (heads x head_dim wide), weight
 * model.layers.<layer>.self_attn.<what>.weight [head_dim]. Backward recomputes it from its input. */
static uint32_t add_head_norm(builder *b, int32_t layer, uint32_t in, uint32_t heads, const char *what)
{
    const uint32_t w = heads * b->d->head_dim;
    const bool train = b->o->head == DAG_HEAD_LOSS;
    dag_node n = blank(DAG_OP_HEAD_NORM, layer);
    n.n_inputs = 1;
    n.inputs[0] = in;
    n.n_heads = heads;
    n.head_dim = b->d->head_dim;
    n.dim_in = n.dim_out = w;
    n.out_width = w;
    n.eps = b->d->rms_eps;
    set_param(&n, 0, "model.layers.%d.self_attn.%s.weight", layer, what);
    n.flops_fwd = 4.0 * w;
    n.flops_bwd = train ? 8.0 * w : 0;
    n.param_bytes = 4ull * b->d->head_dim;
    n.act_bytes = train ? 4ull * w : 0;
    return push(b, &n);
}

/* An RMSNorm of the hidden state in, weight model.layers.<layer>.<what>.weight (model.<what>.weight
 * outside the layers). Backward recomputes the norm: only its input is kept. */
static uint32_t add_rmsnorm(builder *b, int32_t layer, uint32_t in, const char *what)
{
    const uint32_t H = b->d->hidden_size;
    const bool train = b->o->head == DAG_HEAD_LOSS;
    dag_node n = blank(DAG_OP_RMSNORM, layer);
    n.n_inputs = 1;
    n.inputs[0] = in;
    n.dim_in = n.dim_out = H;
    n.out_width = H;
    n.eps = b->d->rms_eps;
    if (layer == DAG_NO_LAYER)
        set_param(&n, 0, "model.%s.weight", what);
    else
        set_param(&n, 0, "model.layers.%d.%s.weight", layer, what);
    n.flops_fwd = 4.0 * H;
    n.flops_bwd = train ? 8.0 * H : 0;
    n.param_bytes = 4ull * H;
    n.act_bytes = train ? 4ull * H : 0;
    return push(b, &n);
}

/* RoPE over the `heads` heads of in (width heads x head_dim). */
static uint32_t add_rope(builder *b, int32_t layer, uint32_t in, uint32_t heads)
{
    const uint32_t w = heads * b->d->head_dim;
    const bool train = b->o->head == DAG_HEAD_LOSS;
    dag_node n = blank(DAG_OP_ROPE, layer);
    n.n_inputs = 1;
    n.inputs[0] = in;
    n.n_heads = heads;
    n.head_dim = b->d->head_dim;
    n.theta = b->d->rope_theta;
    n.rope_factor = b->d->rope_factor;
    n.rope_low_freq = b->d->rope_low_freq;
    n.rope_high_freq = b->d->rope_high_freq;
    n.rope_orig_max = b->d->rope_orig_max;
    n.dim_in = n.dim_out = w;
    n.out_width = w;
    n.flops_fwd = 3.0 * w;
    n.flops_bwd = train ? 3.0 * w : 0;
    return push(b, &n);
}

/* The residual sum x + y of two hidden states. */
static uint32_t add_residual(builder *b, int32_t layer, uint32_t x, uint32_t y)
{
    const uint32_t H = b->d->hidden_size;
    dag_node n = blank(DAG_OP_ADD, layer);
    n.n_inputs = 2;
    n.inputs[0] = x;
    n.inputs[1] = y;
    n.dim_in = n.dim_out = H;
    n.out_width = H;
    n.flops_fwd = H;
    return push(b, &n);
}

fu_err dag_build_llama(const dag_model_dims *d, const dag_build_opts *o, dag_graph_t **out)
{
    if (!d || !o || !out)
        return FU_EINVAL;
    *out = NULL;
    if (!d->vocab_size || !d->hidden_size || !d->intermediate_size || !d->n_layers || !d->n_heads ||
        !d->n_kv_heads || !d->head_dim || d->n_heads % d->n_kv_heads != 0 || d->vocab_size > DAG_MAX_DIM ||
        d->hidden_size > DAG_MAX_DIM || d->intermediate_size > DAG_MAX_DIM || d->n_layers > 4096 ||
        (uint64_t)d->n_heads * d->head_dim > DAG_MAX_DIM || d->head_dim % 2 != 0 || !(d->rms_eps > 0.0f)) {
        FU_ERROR("dag", "model dimensions are inconsistent (vocab %u, hidden %u, ffn %u, layers %u, heads %u/%u, head_dim %u)",
                 d->vocab_size, d->hidden_size, d->intermediate_size, d->n_layers, d->n_heads, d->n_kv_heads,
                 d->head_dim);
        return FU_EINVAL;
    }
    if (o->method >= DAG_ADAPTER_COUNT_ ||
        ((o->method == DAG_ADAPTER_LORA || o->method == DAG_ADAPTER_LORA_FA) &&
         (o->rank == 0 || o->rank > DAG_MAX_RANK || !(o->alpha > 0.0f))) ||
        (o->method == DAG_ADAPTER_SALR && (o->rank > DAG_MAX_RANK || (o->rank > 0 && !(o->alpha > 0.0f)))) ||
        (o->method == DAG_ADAPTER_SALR && (o->res_rank == 0 || o->res_rank > DAG_MAX_RANK)) ||
        (o->targets & ~DAG_TARGETS_ALL) != 0) {
        FU_ERROR("dag", "adapter options are invalid (method %d, rank %u, alpha %g, residual rank %u)",
                 (int)o->method, o->rank, (double)o->alpha, o->res_rank);
        return FU_EINVAL;
    }
    if (o->salr_lm_head && (o->method != DAG_ADAPTER_SALR || d->tie_word_embeddings ||
                            o->res_rank > (d->hidden_size < d->vocab_size ? d->hidden_size : d->vocab_size))) {
        FU_ERROR("dag", "a SALR-pruned lm_head needs method salr, untied embeddings (a tied lm_head is the dense "
                 "embedding table) and a residual rank of at most %u", d->hidden_size < d->vocab_size ? d->hidden_size
                                                                                                  : d->vocab_size);
        return FU_EINVAL;
    }
    builder b = {.g = dag_graph_new(), .d = d, .o = o, .T = o->seq_len ? o->seq_len : 128, .err = FU_OK};
    dag_graph_set_dims(b.g, d);
    bool train = o->head == DAG_HEAD_LOSS;
    const uint32_t H = d->hidden_size, F = d->intermediate_size;
    const uint32_t qw = d->n_heads * d->head_dim, kw = d->n_kv_heads * d->head_dim;

    dag_node n = blank(DAG_OP_EMBEDDING, DAG_NO_LAYER);
    n.dim_in = d->vocab_size;
    n.dim_out = H;
    n.out_width = H;
    set_param(&n, 0, "model.embed_tokens.weight");
    n.param_bytes = 4ull * d->vocab_size * H;
    uint32_t x = push(&b, &n);

    for (uint32_t l = 0; l < d->n_layers && b.err == FU_OK; l++) {
        int32_t L = (int32_t)l;
        uint32_t h = add_rmsnorm(&b, L, x, "input_layernorm");

        uint32_t q = add_linear(&b, L, h, DAG_TARGET_Q, "self_attn", H, qw);
        uint32_t k = add_linear(&b, L, h, DAG_TARGET_K, "self_attn", H, kw);
        uint32_t v = add_linear(&b, L, h, DAG_TARGET_V, "self_attn", H, kw);

        if (d->qk_norm) {
            q = add_head_norm(&b, L, q, d->n_heads, "q_norm");
            k = add_head_norm(&b, L, k, d->n_kv_heads, "k_norm");
        }
        uint32_t qr = add_rope(&b, L, q, d->n_heads);
        uint32_t kr = add_rope(&b, L, k, d->n_kv_heads);

        n = blank(DAG_OP_ATTENTION, L);
        n.n_inputs = 3;
        n.inputs[0] = qr;
        n.inputs[1] = kr;
        n.inputs[2] = v;
        n.n_heads = d->n_heads;
        n.n_kv_heads = d->n_kv_heads;
        n.head_dim = d->head_dim;
        n.window = d->sliding_window;
        n.dim_in = qw;
        n.dim_out = qw;
        n.out_width = qw;
        /* Causal: on average T/2 keys per query (at most the window); QKᵀ and P·V, 2 FLOPs per
         * multiply-add. */
        double keys = d->sliding_window && d->sliding_window < b.T / 2.0 ? (double)d->sliding_window : b.T / 2.0;
        n.flops_fwd = 2.0 * 2.0 * keys * qw + 5.0 * d->n_heads * keys;
        n.flops_bwd = train ? 2.0 * n.flops_fwd : 0;
        /* q, k, v are kept for backward (the kernel recomputes the probabilities). */
        n.act_bytes = train ? 4ull * (qw + 2ull * kw) : 0;
        uint32_t a = push(&b, &n);

        uint32_t ao = add_linear(&b, L, a, DAG_TARGET_O, "self_attn", qw, H);

        uint32_t x1 = add_residual(&b, L, x, ao);
        uint32_t h2 = add_rmsnorm(&b, L, x1, "post_attention_layernorm");

        uint32_t gt = add_linear(&b, L, h2, DAG_TARGET_GATE, "mlp", H, F);
        uint32_t up = add_linear(&b, L, h2, DAG_TARGET_UP, "mlp", H, F);

        n = blank(DAG_OP_SILU_MUL, L);
        n.n_inputs = 2;
        n.inputs[0] = gt;
        n.inputs[1] = up;
        n.dim_in = n.dim_out = F;
        n.out_width = F;
        n.flops_fwd = 5.0 * F;
        n.flops_bwd = train ? 8.0 * F : 0;
        n.act_bytes = train ? 8ull * F : 0;
        uint32_t m = push(&b, &n);

        uint32_t dn = add_linear(&b, L, m, DAG_TARGET_DOWN, "mlp", F, H);

        x = add_residual(&b, L, x1, dn);
    }

    uint32_t hn = add_rmsnorm(&b, DAG_NO_LAYER, x, "norm");

    n = blank(DAG_OP_LM_HEAD, DAG_NO_LAYER);
    n.n_inputs = 1;
    n.inputs[0] = hn;
    n.dim_in = H;
    n.dim_out = d->vocab_size;
    n.out_width = d->vocab_size;
    set_param(&n, 0, "%s", d->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
    if (o->salr_lm_head) {
        /* A pruned head: sparse base and its frozen residual, no trained adapter. */
        n.adapter.method = DAG_ADAPTER_SALR;
        n.adapter.res_rank = o->res_rank;
        set_param(&n, 1, "lm_head.salr_A.weight");
        set_param(&n, 2, "lm_head.salr_B.weight");
    }
    lm_head_costs(&n, train, d->tie_word_embeddings);
    uint32_t lg = push(&b, &n);

    if (o->head != DAG_HEAD_LOGITS) {
        n = blank(o->head == DAG_HEAD_LOSS ? DAG_OP_CROSS_ENTROPY : DAG_OP_SAMPLE, DAG_NO_LAYER);
        n.n_inputs = 1;
        n.inputs[0] = lg;
        n.dim_in = d->vocab_size;
        n.out_width = 1;
        n.flops_fwd = 4.0 * d->vocab_size;
        n.flops_bwd = train ? 2.0 * d->vocab_size : 0;
        /* The logits' gradient is written in place of the logits: one vocab row per token. */
        n.act_bytes = train ? 4ull * d->vocab_size : 0;
        (void)push(&b, &n);
    }
    if (b.err == FU_OK && train) {
        /* Plain LoRA keeps each adapted linear's input X, but linears reading the same tensor (q/k/v,
         * gate/up) share one copy: charge it to the first of them only. */
        size_t nn = dag_graph_size(b.g);
        for (size_t i = 0; i < nn; i++) {
            dag_node *a = dag_graph_node_mut(b.g, i);
            if (a->op != DAG_OP_LINEAR || a->adapter.method != DAG_ADAPTER_LORA)
                continue;
            for (size_t j = 0; j < i; j++) {
                const dag_node *p = dag_graph_node(b.g, j);
                if (p->op == DAG_OP_LINEAR && p->adapter.method == DAG_ADAPTER_LORA && p->inputs[0] == a->inputs[0]) {
                    a->act_bytes -= 4ull * a->dim_in;
                    break;
                }
            }
        }
    }
    if (b.err != FU_OK) {
        dag_graph_destroy(&b.g);
        return b.err;
    }
    *out = b.g;
    return FU_OK;
}

/* ---- validation ----------------------------------------------------------------------------- */

static fu_err bad(fu_errmsg *em, const dag_node *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static fu_err bad(fu_errmsg *em, const dag_node *n, const char *fmt, ...)
{
    if (!em)
        return FU_EPROTO;
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (n)
        return fu_errmsg_set(em, FU_EPROTO, "node %u (%s): %s", n->id, dag_op_name(n->op), why);
    return fu_errmsg_set(em, FU_EPROTO, "graph: %s", why);
}

static bool name_ok(const char *s)
{
    size_t len = strnlen(s, DAG_NAME_MAX);
    if (len == 0 || len >= DAG_NAME_MAX)
        return false;
    if (s[0] == '.' || s[len - 1] == '.' || strstr(s, ".."))
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

static const uint32_t arity[DAG_OP_COUNT_] = {
    [DAG_OP_EMBEDDING] = 0, [DAG_OP_RMSNORM] = 1,  [DAG_OP_LINEAR] = 1,        [DAG_OP_ROPE] = 1,
    [DAG_OP_ATTENTION] = 3, [DAG_OP_SILU_MUL] = 2, [DAG_OP_ADD] = 2,           [DAG_OP_LM_HEAD] = 1,
    [DAG_OP_CROSS_ENTROPY] = 1, [DAG_OP_SAMPLE] = 1, [DAG_OP_HEAD_NORM] = 1,
};

fu_err dag_graph_validate(const dag_graph_t *g, fu_errmsg *em)
{
    if (!g)
        return bad(em, NULL, "no graph");
    if (g->n == 0)
        return bad(em, NULL, "no nodes");
    if (g->n > DAG_MAX_NODES)
        return bad(em, NULL, "%zu nodes (at most %d)", g->n, DAG_MAX_NODES);
    for (size_t i = 0; i < g->n; i++) {
        const dag_node *n = &g->nodes[i];
        if (n->id != i)
            return bad(em, n, "id %u at position %zu (ids must equal positions)", n->id, i);
        if (n->op <= 0 || n->op >= DAG_OP_COUNT_)
            return bad(em, n, "unknown op %d", (int)n->op);
        if (n->n_inputs != arity[n->op])
            return bad(em, n, "%u inputs, %s takes %u", n->n_inputs, dag_op_name(n->op), arity[n->op]);
        for (uint32_t k = 0; k < n->n_inputs; k++)
            if (n->inputs[k] >= n->id)
                return bad(em, n, "input %u is node %u, not an earlier node (graph not topological)", k,
                           n->inputs[k]);
        if (n->layer < DAG_NO_LAYER || n->layer > 65535)
            return bad(em, n, "layer index %d out of range", n->layer);
        if (n->dim_in > DAG_MAX_DIM || n->dim_out > DAG_MAX_DIM || n->n_heads > DAG_MAX_DIM ||
            n->n_kv_heads > DAG_MAX_DIM || n->head_dim > DAG_MAX_DIM || n->out_width > DAG_MAX_DIM)
            return bad(em, n, "a dimension exceeds %u", DAG_MAX_DIM);
        if (n->out_width == 0)
            return bad(em, n, "output width is 0");
        if (!isfinite(n->flops_fwd) || !isfinite(n->flops_bwd) || n->flops_fwd < 0 || n->flops_bwd < 0)
            return bad(em, n, "cost estimates are not finite non-negative numbers");
        if (n->n_params > DAG_MAX_PARAMS)
            return bad(em, n, "%u parameter names (at most %d)", n->n_params, DAG_MAX_PARAMS);
        for (uint32_t k = 0; k < n->n_params; k++)
            if (!name_ok(n->params[k]))
                return bad(em, n,
                           "parameter name %u is empty, too long or has characters outside [A-Za-z0-9._-]",
                           k);
        if ((unsigned)n->target >= DAG_TARGET_COUNT_)
            return bad(em, n, "unknown adapter target %d", (int)n->target);
        if ((unsigned)n->adapter.method >= DAG_ADAPTER_COUNT_)
            return bad(em, n, "unknown adapter method %d", (int)n->adapter.method);
        if (n->op != DAG_OP_LINEAR && n->target != DAG_TARGET_NONE)
            return bad(em, n, "only linear nodes have an adapter target");
        if (n->op != DAG_OP_LINEAR && n->op != DAG_OP_LM_HEAD && n->adapter.method != DAG_ADAPTER_NONE)
            return bad(em, n, "only linear and lm_head nodes carry adapters");
        if (n->flags & ~(DAG_NODE_BIAS | DAG_NODE_INT8) || (n->flags && n->op != DAG_OP_LINEAR))
            return bad(em, n, "flags %#x: only linear nodes may have a bias or int8 weights", n->flags);
        if ((n->flags & DAG_NODE_INT8) && n->adapter.method == DAG_ADAPTER_SALR)
            return bad(em, n, "a SALR linear's weight is bitmap-encoded, not int8");

        uint64_t w[DAG_MAX_INPUTS] = {0};
        for (uint32_t k = 0; k < n->n_inputs; k++)
            w[k] = g->nodes[n->inputs[k]].out_width;
        uint32_t want_params = 0;
        switch (n->op) {
        case DAG_OP_EMBEDDING:
            want_params = 1;
            if (!n->dim_in || n->out_width != n->dim_out || !n->dim_out)
                return bad(em, n, "vocabulary %u and width %u/%" PRIu64 " inconsistent", n->dim_in,
                           n->dim_out, n->out_width);
            break;
        case DAG_OP_RMSNORM:
            want_params = 1;
            if (w[0] != n->dim_in || n->out_width != n->dim_in || n->dim_out != n->dim_in)
                return bad(em, n, "input width %" PRIu64 " but the norm is %u wide", w[0], n->dim_in);
            if (!(n->eps > 0.0f) || !isfinite(n->eps) || n->eps > 1.0f)
                return bad(em, n, "epsilon %g out of (0, 1]", (double)n->eps);
            break;
        case DAG_OP_LINEAR:
        case DAG_OP_LM_HEAD:
            want_params = 1;
            if (!n->dim_in || !n->dim_out || w[0] != n->dim_in || n->out_width != n->dim_out)
                return bad(em, n,
                           "input width %" PRIu64 " vs in features %u, output %" PRIu64 " vs out features %u",
                           w[0], n->dim_in, n->out_width, n->dim_out);
            if (n->op == DAG_OP_LINEAR) {
                const dag_adapter *a = &n->adapter;
                uint32_t mn = n->dim_in < n->dim_out ? n->dim_in : n->dim_out;
                if (a->method == DAG_ADAPTER_SALR)
                    want_params = 3;
                if (n->flags & DAG_NODE_BIAS)
                    want_params++;
                if ((a->method == DAG_ADAPTER_LORA || a->method == DAG_ADAPTER_LORA_FA) &&
                    (a->rank == 0 || a->rank > mn || a->rank > DAG_MAX_RANK))
                    return bad(em, n, "adapter rank %u out of [1, %u]", a->rank, mn);
                if (a->method == DAG_ADAPTER_SALR &&
                    (a->res_rank == 0 || a->res_rank > mn || a->rank > mn || a->res_rank > DAG_MAX_RANK))
                    return bad(em, n, "salr ranks %u/%u out of range (at most %u)", a->rank, a->res_rank, mn);
                if (a->method != DAG_ADAPTER_NONE && a->rank > 0 && (!(a->alpha > 0.0f) || !isfinite(a->alpha)))
                    return bad(em, n, "adapter alpha %g is not a positive number", (double)a->alpha);
                if (a->method == DAG_ADAPTER_NONE && (a->rank || a->res_rank))
                    return bad(em, n, "rank given without an adapter method");
                if (n->target == DAG_TARGET_NONE && a->method != DAG_ADAPTER_NONE)
                    return bad(em, n, "adapter without a target module");
            } else {
                /* lm_head: dense, or SALR-pruned (sparse weight + frozen residual, nothing trained). */
                const dag_adapter *a = &n->adapter;
                uint32_t mn = n->dim_in < n->dim_out ? n->dim_in : n->dim_out;
                if (a->method == DAG_ADAPTER_NONE) {
                    if (a->rank || a->res_rank)
                        return bad(em, n, "rank given without an adapter method");
                } else if (a->method != DAG_ADAPTER_SALR || a->rank != 0 || a->alpha != 0.0f) {
                    return bad(em, n,
                               "lm_head takes no trained adapter (only a SALR-pruned base with its "
                               "frozen residual)");
                } else if (a->res_rank == 0 || a->res_rank > mn || a->res_rank > DAG_MAX_RANK) {
                    return bad(em, n, "salr residual rank %u out of [1, %u]", a->res_rank, mn);
                } else {
                    want_params = 3;
                    if (strcmp(n->params[0], "model.embed_tokens.weight") == 0)
                        return bad(em, n, "a tied lm_head (the embedding table) cannot be SALR-pruned");
                }
            }
            break;
        case DAG_OP_ROPE:
            if (!n->n_heads || !n->head_dim || n->head_dim % 2 || (uint64_t)n->n_heads * n->head_dim != w[0] ||
                n->out_width != w[0])
                return bad(em, n, "%u heads × %u does not match width %" PRIu64, n->n_heads, n->head_dim,
                           w[0]);
            kern_rope_params rp = dag_rope_params(n);
            if (!kern_rope_params_ok(&rp, (int)n->head_dim))
                return bad(em, n, "rope theta %g, head dim %u or llama3 scaling (factor %g, low %g, high %g, original "
                           "%g) out of range", (double)n->theta, n->head_dim, (double)n->rope_factor,
                           (double)n->rope_low_freq, (double)n->rope_high_freq, (double)n->rope_orig_max);
            break;
        case DAG_OP_HEAD_NORM:
            want_params = 1;
            if (!n->n_heads || !n->head_dim || (uint64_t)n->n_heads * n->head_dim != w[0] || n->out_width != w[0] ||
                n->dim_in != w[0] || n->dim_out != w[0])
                return bad(em, n, "%u heads × %u does not match width %" PRIu64, n->n_heads, n->head_dim, w[0]);
            if (!(n->eps > 0.0f) || !isfinite(n->eps) || n->eps > 1.0f)
                return bad(em, n, "epsilon %g out of (0, 1]", (double)n->eps);
            break;
        case DAG_OP_ATTENTION:
            if (!n->n_heads || !n->n_kv_heads || !n->head_dim || n->n_heads % n->n_kv_heads)
                return bad(em, n, "heads %u / kv heads %u / head dim %u invalid", n->n_heads, n->n_kv_heads,
                           n->head_dim);
            if (w[0] != (uint64_t)n->n_heads * n->head_dim || w[1] != (uint64_t)n->n_kv_heads * n->head_dim ||
                w[2] != w[1] || n->out_width != w[0])
                return bad(em, n, "q/k/v widths %" PRIu64 "/%" PRIu64 "/%" PRIu64 " do not match the heads",
                           w[0], w[1], w[2]);
            break;
        case DAG_OP_SILU_MUL:
        case DAG_OP_ADD:
            if (w[0] != w[1] || n->out_width != w[0])
                return bad(em, n, "input widths %" PRIu64 " and %" PRIu64 " differ", w[0], w[1]);
            break;
        case DAG_OP_CROSS_ENTROPY:
        case DAG_OP_SAMPLE:
            if (g->nodes[n->inputs[0]].op != DAG_OP_LM_HEAD || n->out_width != 1 || n->dim_in != w[0])
                return bad(em, n, "must read an lm_head node, with dim_in its width, and output width 1");
            break;
        default:
            break;
        }
        if (n->n_params != want_params)
            return bad(em, n, "%u parameter names, %s needs %u", n->n_params, dag_op_name(n->op),
                       want_params);
    }
    return FU_OK;
}

/* ---- costs ---------------------------------------------------------------------------------- */

dag_cost dag_graph_cost(const dag_graph_t *g, size_t first, size_t last)
{
    dag_cost c = {0};
    if (!g)
        return c;
    if (last > g->n)
        last = g->n;
    for (size_t i = first; i < last; i++) {
        c.flops_fwd += g->nodes[i].flops_fwd;
        c.flops_bwd += g->nodes[i].flops_bwd;
        c.param_bytes += g->nodes[i].param_bytes;
        c.act_bytes += g->nodes[i].act_bytes;
        c.kv_bytes += dag_node_kv_bytes(&g->nodes[i]);
    }
    return c;
}

uint64_t dag_node_kv_bytes(const dag_node *n)
{
    return n->op == DAG_OP_ATTENTION ? 2ull * n->n_kv_heads * n->head_dim * sizeof(float) : 0;
}

uint64_t dag_graph_cut_width(const dag_graph_t *g, size_t at)
{
    if (!g || at == 0 || at >= g->n)
        return 0;
    uint64_t w = 0;
    /* A node < at is counted once if any node ≥ at reads it. */
    uint8_t *seen = fu_calloc(at, 1);
    for (size_t i = at; i < g->n; i++) {
        const dag_node *n = &g->nodes[i];
        for (uint32_t k = 0; k < n->n_inputs && k < DAG_MAX_INPUTS; k++) {
            uint32_t src = n->inputs[k];
            if (src < at && !seen[src]) {
                seen[src] = 1;
                w += g->nodes[src].out_width;
            }
        }
    }
    free(seen);
    return w;
}

fu_err dag_graph_check_range(const dag_graph_t *g, size_t first, size_t last, fu_errmsg *em)
{
    size_t n = dag_graph_size(g);
    for (size_t j = last; j < n; j++) {
        const dag_node *nd = dag_graph_node(g, j);
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            if (nd->inputs[k] < first)
                return fu_errmsg_set(em, FU_EINVAL,
                                     "node %zu reads node %u across the stage %zu..%zu: skip connections over a "
                                     "whole stage are not supported",
                                     j, nd->inputs[k], first, last);
    }
    return FU_OK;
}

/* Which half of its layer node n is in: "attn" up to and with the layer's first residual add, "mlp"
 * after it. */
static const char *layer_part(const dag_graph_t *g, size_t n)
{
    int32_t l = dag_graph_node(g, n)->layer;
    size_t i = n;
    while (i > 0 && dag_graph_node(g, i - 1)->layer == l)
        i--;
    for (; i < n; i++)
        if (dag_graph_node(g, i)->op == DAG_OP_ADD)
            return "mlp";
    return "attn";
}

void dag_graph_range_label(const dag_graph_t *self, size_t first, size_t last, char *buf, size_t cap)
{
    size_t n = dag_graph_size(self), lo_n = SIZE_MAX, hi_n = SIZE_MAX;
    for (size_t i = first; i < last && i < n; i++)
        if (dag_graph_node(self, i)->layer != DAG_NO_LAYER) {
            if (lo_n == SIZE_MAX)
                lo_n = i;
            hi_n = i;
        }
    if (lo_n == SIZE_MAX) {
        snprintf(buf, cap, "no decoder layers");
        return;
    }
    int32_t lo = dag_graph_node(self, lo_n)->layer, hi = dag_graph_node(self, hi_n)->layer;
    char a[24], b[24];
    bool lo_cut = lo_n > 0 && dag_graph_node(self, lo_n - 1)->layer == lo; /* starts inside layer lo */
    bool hi_cut = hi_n + 1 < n && dag_graph_node(self, hi_n + 1)->layer == hi; /* ends inside layer hi */
    snprintf(a, sizeof a, "%d%s%s", (int)lo, lo_cut ? "." : "", lo_cut ? layer_part(self, lo_n) : "");
    snprintf(b, sizeof b, "%d%s%s", (int)hi, hi_cut ? "." : "", hi_cut ? layer_part(self, hi_n) : "");
    if (lo == hi && !(lo_cut && hi_cut)) /* one layer, or the half of one */
        snprintf(buf, cap, "layer %s", lo_cut ? a : b);
    else if (strcmp(a, b) == 0)
        snprintf(buf, cap, "layer %s", a);
    else
        snprintf(buf, cap, "layers %s-%s", a, b);
}
