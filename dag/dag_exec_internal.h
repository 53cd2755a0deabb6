/* dag_exec_internal: the executor's state shared by its files: dag_exec.c (lifecycle, buffer pool,
 * inputs, optimizer, sessions), dag_exec_pass.c (forward and backward passes) and dag_exec_io.c
 * (weights, adapters, checkpoints). Not for other modules: they use dag_exec.h. */
#ifndef FU_DAG_EXEC_INTERNAL_H
#define FU_DAG_EXEC_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "dag_exec.h"
#include "kern_bitmap.h"
#include "kern_kvcache.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_IGNORE_INDEX      KERN_XENT_IGNORE_DEFAULT

/* One pooled device buffer. */
typedef struct {
    kern_tensor_t *t; /* owned allocation, 1-D f32 */
    size_t cap;       /* floats */
    int refs;         /* holders; 0 = free */
} ebuf;

/* Per-node state of the range. */
typedef struct {
    kern_tensor_t *w;    /* weight (embedding table, norm gain, linear/lm_head weight) */
    kern_tensor_t *bias; /* linear with DAG_NODE_BIAS: its bias [dim_out] (frozen) */
    bool w_shared;       /* w belongs to another node (tied embeddings) */
    float *qscale;       /* an int8 w's row scales (owned; w->qscale borrows them) */
    kern_bitmap_t *bm;   /* salr: bitmap-encoded sparse weight (host) */
    void *dev_bm;        /* salr on CUDA: the device copy (kern_cuda_bitmap_t) */
    kern_sparse_weight sw; /* salr: the sparse weight as the backend sees it */
    /* adapter */
    int64_t r;           /* trained rank (0: none) */
    int64_t r2;          /* salr residual rank */
    float scale;         /* alpha / r */
    bool train_a;        /* plain LoRA: A is trained */
    kern_tensor_t *A, *B;               /* trained adapter (PEFT layout) */
    kern_tensor_t *dA, *dB, *mA, *vA, *mB, *vB; /* grads and AdamW moments */
    kern_tensor_t *A2, *B2;             /* salr frozen residual adapter */
    kern_tensor_t *a_cat, *b_cat;       /* salr: [A1; A2] [r1+r2, in] and [s1·B1 | B2] [out, r1+r2] */
    kern_tensor_t *eye;                 /* salr: I [r1, r1], to refresh b_cat's trained columns */
    /* graph facts */
    int n_cons;          /* consumers inside the range */
    bool cut_out;        /* read by a node at or after `last` */
    bool run_bwd;        /* its backward runs */
    uint8_t save_mask;   /* bit k: its backward reads input k */
} enode;

/* One micro-batch slot: its inputs and what its last forward produced. */
typedef struct {
    kern_tensor_t *tokens;  /* i32 [max_tokens] */
    kern_tensor_t *targets; /* i32 [max_tokens] */
    kern_tensor_t *pos;     /* i32 [max_tokens] */
    uint32_t n_seq, seq_len, rows; /* sequences, tokens per sequence, n_seq × seq_len */
    bool has_tokens, has_targets;  /* set_tokens was given tokens / targets */
    int64_t pos0;           /* session position of the first row */
    float loss;             /* mean cross-entropy of the last forward */
    int64_t n_valid;        /* target tokens that loss covers */
    int32_t sampled;        /* token the sample node drew in the last forward */
    bool forwarded;         /* forward ran and backward has not */
    /* Inference: the sessions whose new positions the slot's rows are, in order (set_tokens with a
     * session attached: that one; dag_exec_set_batch: several). A destroyed session is cleared here. */
    dag_session_t **sess;   /* n_sess entries (cap_sess allocated) */
    uint32_t *sess_rows;    /* rows of each, summing to rows */
    uint32_t n_sess, cap_sess;
    bool batch;             /* set by dag_exec_set_batch: each session samples with its own parameters */
} eslot;

/* An inference session: the KV caches of one sequence. */
struct dag_session {
    dag_exec_t *x;            /* owner executor */
    kern_kvcache_t **caches;  /* per node of the graph (NULL except attention in range) */
    int64_t len;              /* positions cached */
    kern_sample_params sp;    /* a batch's sampling of this session (dag_session_set_sampling) */
    uint64_t counter;         /* its draw counter for the next forward */
    int32_t sampled;          /* the token a batched forward drew for it (-1: none yet) */
};

/* The executor (opaque in dag_exec.h). */
struct dag_exec {
    const dag_graph_t *g;    /* the graph (borrowed) */
    dag_exec_opts o;         /* options with defaults filled in (o.last set) */
    const kern_backend_t *be; /* backend every tensor lives on */
    size_t n;                /* nodes in the graph */
    size_t first, last;      /* the range [first, last) this executor runs */
    bool cpu;                /* backend memory is host memory */
    enode *nodes;            /* n entries (only the range is used) */
    bool *need_grad;         /* n: a gradient must flow into this node's output */
    ebuf **bufs;             /* pool */
    size_t n_bufs, cap_bufs; /* entries of bufs used and allocated */
    ebuf **act;              /* n_slots × n: output buffers */
    ebuf **hsave;            /* n_slots × n: adapter X·Aᵀ kept for backward */
    ebuf **grad;             /* n: gradient w.r.t. node outputs during backward */
    eslot *slots;            /* n_slots micro-batch slots */
    kern_workspace_t *ws;    /* kernel scratch, grown on demand */
    kern_sample_params sp;   /* sampling parameters of the sample node */
    uint64_t sample_counter; /* draw counter of the sample node */
    dag_session_t *session;  /* session in use (NULL: none; borrowed) */
    int64_t step;            /* optimizer steps done */
    size_t saved_now, saved_peak; /* bytes the last forward saved for backward, and the most */
    float *staging;          /* host copies for non-CPU backends */
    size_t staging_cap;      /* floats staging holds */
    uint32_t bwd_rows;       /* rows of the last backward (cut-input gradients) */
    kern_tensor_t *ones;     /* [max_tokens, 1] of 1: a bias is added as ones·biasᵀ (NULL: no bias) */
};

/* ---- small helpers -------------------------------------------------------------------------- */

/* A contiguous, borrowed view of data: rows x cols (ndim 2), or rows elements (ndim 1, cols 1).
 * Unchecked, unlike kern_tensor_wrap: the executor's shapes are validated with the graph. */
static inline kern_tensor_t tview(void *data, kern_dtype dt, int ndim, int64_t rows, int64_t cols,
                                  kern_device dev)
{
    kern_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dt;
    t.ndim = ndim;
    t.shape[0] = rows;
    t.shape[1] = cols;
    t.shape[2] = t.shape[3] = 1;
    t.stride[0] = ndim == 2 ? cols : 1;
    t.stride[1] = ndim == 2 ? 1 : 0;
    t.device = dev;
    return t;
}

static inline kern_tensor_t tv2(void *data, int64_t rows, int64_t cols, kern_device dev)
{
    return tview(data, KERN_F32, 2, rows, cols, dev);
}

static inline kern_tensor_t tv1(void *data, kern_dtype dt, int64_t n, kern_device dev)
{
    return tview(data, dt, 1, n, 1, dev);
}

static inline kern_tensor_t bview(const dag_exec_t *x, const ebuf *b, int64_t rows, int64_t cols)
{
    return tv2(b->t->data, rows, cols, x->be->device);
}

static inline const dag_node *N(const dag_exec_t *x, size_t i)
{
    return dag_graph_node(x->g, i);
}

static inline bool in_range(const dag_exec_t *x, size_t i)
{
    return i >= x->first && i < x->last;
}

static inline fu_err new_tensor(const dag_exec_t *x, int ndim, int64_t d0, int64_t d1, bool zero,
                                kern_tensor_t **out)
{
    int64_t shape[2] = {d0, d1};
    return zero ? kern_tensor_new_zeros(x->be, KERN_F32, ndim, shape, out)
                : kern_tensor_new(x->be, KERN_F32, ndim, shape, out);
}

static inline size_t node_width(const dag_exec_t *x, size_t i)
{
    return (size_t)N(x, i)->out_width;
}

/* ---- across files --------------------------------------------------------------------------- */

/* dag_exec.c: a free pool buffer of at least nfloats (the smallest that fits, else a new one),
 * returned with one reference. */
FU_MUST_CHECK fu_err dagx_pool_get(dag_exec_t *x, size_t nfloats, ebuf **out);
/* dag_exec.c: frees a node's weight (unless shared), sparse weight, adapter and optimizer state. */
void dagx_free_node(enode *e);

/* dag_exec_io.c: (re)builds a salr node's concatenated adapters from A, B, A2, B2. */
FU_MUST_CHECK fu_err dagx_salr_rebuild(dag_exec_t *x, const dag_node *nd, enode *e);

#ifdef __cplusplus
}
#endif

#endif
