#include "dag_exec.h"
#include "dag_peft.h"

#include <cblas.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fu_alloc.h"
#include "kern_bitmap.h"
#include "kern_kvcache.h"
#include "kern_lora.h"
#include "kern_salr.h"
#ifdef FUSION_KERN_HAVE_CUDA
#include "kern_cuda.h"
#endif

#define DAG_IGNORE_INDEX      KERN_XENT_IGNORE_DEFAULT
#define DAG_WS_SLACK          (256u << 10) /* workspace bytes beyond the computed needs */
#define DAG_PEFT_PREFIX       "base_model.model."
#define DAG_GEMV_MAX_ROWS     2            /* rows up to which CPU linears use sgemv */

/* One pooled device buffer. */
typedef struct {
    kern_tensor_t *t; /* owned allocation, 1-D f32 */
    size_t cap;       /* floats */
    int refs;         /* holders; 0 = free */
} ebuf;

/* Per-node state of the range. */
typedef struct {
    kern_tensor_t *w;    /* weight (embedding table, norm gain, linear/lm_head weight) */
    bool w_shared;       /* w belongs to another node (tied embeddings) */
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

typedef struct {
    kern_tensor_t *tokens;  /* i32 [max_tokens] */
    kern_tensor_t *targets; /* i32 [max_tokens] */
    kern_tensor_t *pos;     /* i32 [max_tokens] */
    uint32_t n_seq, seq_len, rows;
    bool has_tokens, has_targets;
    int64_t pos0;           /* session position of the first row */
    float loss;
    int64_t n_valid;
    int32_t sampled;
    bool forwarded;         /* forward ran and backward has not */
} eslot;

struct dag_session {
    dag_exec_t *x;            /* owner executor */
    kern_kvcache_t **caches;  /* per node of the graph (NULL except attention in range) */
    int64_t len;              /* positions cached */
};

struct dag_exec {
    const dag_graph_t *g;
    dag_exec_opts o;
    const kern_backend_t *be;
    size_t n;                /* nodes in the graph */
    size_t first, last;
    bool cpu;                /* backend memory is host memory */
    enode *nodes;            /* n entries (only the range is used) */
    bool *need_grad;         /* n: a gradient must flow into this node's output */
    ebuf **bufs;             /* pool */
    size_t n_bufs, cap_bufs;
    ebuf **act;              /* n_slots × n: output buffers */
    ebuf **hsave;            /* n_slots × n: adapter X·Aᵀ kept for backward */
    ebuf **grad;             /* n: gradient w.r.t. node outputs during backward */
    eslot *slots;
    kern_workspace_t *ws;
    kern_sample_params sp;
    uint64_t sample_counter;
    dag_session_t *session;
    int64_t step;
    size_t saved_now, saved_peak;
    float *staging;          /* host copies for non-CPU backends */
    size_t staging_cap;
    uint32_t bwd_rows;       /* rows of the last backward (cut-input gradients) */
};

/* ---- small helpers -------------------------------------------------------------------------- */

static kern_tensor_t tv2(void *data, int64_t rows, int64_t cols, kern_device dev)
{
    kern_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = KERN_F32;
    t.ndim = 2;
    t.shape[0] = rows;
    t.shape[1] = cols;
    t.shape[2] = t.shape[3] = 1;
    t.stride[0] = cols;
    t.stride[1] = 1;
    t.device = dev;
    return t;
}

static kern_tensor_t tv1(void *data, kern_dtype dt, int64_t n, kern_device dev)
{
    kern_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dt;
    t.ndim = 1;
    t.shape[0] = n;
    t.shape[1] = t.shape[2] = t.shape[3] = 1;
    t.stride[0] = 1;
    t.device = dev;
    return t;
}

static kern_tensor_t bview(const dag_exec_t *x, const ebuf *b, int64_t rows, int64_t cols)
{
    return tv2(b->t->data, rows, cols, x->be->device);
}

static const dag_node *N(const dag_exec_t *x, size_t i)
{
    return dag_graph_node(x->g, i);
}

static bool in_range(const dag_exec_t *x, size_t i)
{
    return i >= x->first && i < x->last;
}

static fu_err new_tensor(const dag_exec_t *x, int ndim, int64_t d0, int64_t d1, bool zero, kern_tensor_t **out)
{
    int64_t shape[2] = {d0, d1};
    return zero ? kern_tensor_new_zeros(x->be, KERN_F32, ndim, shape, out)
                : kern_tensor_new(x->be, KERN_F32, ndim, shape, out);
}

/* ---- buffer pool ---------------------------------------------------------------------------- */

static fu_err pool_get(dag_exec_t *x, size_t nfloats, ebuf **out)
{
    ebuf *best = NULL;
    for (size_t i = 0; i < x->n_bufs; i++) {
        ebuf *b = x->bufs[i];
        if (b->refs == 0 && b->cap >= nfloats && (!best || b->cap < best->cap))
            best = b;
    }
    if (!best) {
        best = fu_calloc(1, sizeof *best);
        int64_t shape[1] = {(int64_t)(nfloats ? nfloats : 1)};
        fu_err rc = kern_tensor_new(x->be, KERN_F32, 1, shape, &best->t);
        if (rc != FU_OK) {
            free(best);
            return rc;
        }
        best->cap = nfloats ? nfloats : 1;
        if (x->n_bufs == x->cap_bufs) {
            x->cap_bufs = x->cap_bufs ? x->cap_bufs * 2 : 64;
            x->bufs = fu_realloc(x->bufs, x->cap_bufs * sizeof *x->bufs);
        }
        x->bufs[x->n_bufs++] = best;
    }
    best->refs = 1;
    *out = best;
    return FU_OK;
}

static void buf_unref(ebuf **b_p)
{
    if (*b_p) {
        if ((*b_p)->refs > 0)
            (*b_p)->refs--;
        *b_p = NULL;
    }
}

/* Drops one reference of a slot's activation of node i; the slot's pointer stays until the buffer
 * is free (other holders may still read it). */
static void act_unref(dag_exec_t *x, uint32_t slot, size_t i)
{
    ebuf **p = &x->act[(size_t)slot * x->n + i];
    if (!*p)
        return;
    (*p)->refs--;
    if ((*p)->refs <= 0) {
        (*p)->refs = 0;
        *p = NULL;
    }
}

static void slot_release(dag_exec_t *x, uint32_t slot, bool keep_inputs)
{
    for (size_t i = 0; i < x->n; i++) {
        ebuf **p = &x->act[(size_t)slot * x->n + i];
        if (*p && !(keep_inputs && i < x->first)) {
            (*p)->refs = 0;
            *p = NULL;
        }
        ebuf **h = &x->hsave[(size_t)slot * x->n + i];
        if (*h) {
            (*h)->refs = 0;
            *h = NULL;
        }
    }
}

static size_t node_width(const dag_exec_t *x, size_t i)
{
    return (size_t)N(x, i)->out_width;
}

/* ---- creation ------------------------------------------------------------------------------- */

static bool trainable(const dag_exec_t *x, const dag_node *nd)
{
    return x->o.training && nd->op == DAG_OP_LINEAR && nd->adapter.method != DAG_ADAPTER_NONE && nd->adapter.rank > 0;
}

fu_err dag_exec_new(const dag_graph_t *g, const dag_exec_opts *o, dag_exec_t **out, fu_errmsg *em)
{
    if (!g || !o || !out)
        return FU_EINVAL;
    *out = NULL;
    size_t n = dag_graph_size(g);
    size_t last = o->last ? o->last : n;
    if (o->first >= last || last > n)
        return fu_errmsg_set(em, FU_EINVAL, "node range [%zu, %zu) is empty or outside the graph's %zu nodes",
                             o->first, last, n);
    if (o->max_tokens == 0)
        return fu_errmsg_set(em, FU_EINVAL, "max_tokens must be at least 1");
    if (o->n_slots > DAG_EXEC_MAX_SLOTS)
        return fu_errmsg_set(em, FU_EINVAL, "at most %d slots", DAG_EXEC_MAX_SLOTS);
    char vmsg[256];
    if (dag_graph_validate(g, vmsg, sizeof vmsg) != FU_OK)
        return fu_errmsg_set(em, FU_EPROTO, "%s", vmsg);
    const kern_backend_t *be = o->be ? o->be : kern_backend_cpu();
    bool cpu = be->device.kind == KERN_DEV_CPU;
    bool sparse_ok = cpu;
#ifdef FUSION_KERN_HAVE_CUDA
    sparse_ok = sparse_ok || be->device.kind == KERN_DEV_CUDA;
#endif
    for (size_t i = o->first; i < last; i++)
        if (dag_graph_node(g, i)->adapter.method == DAG_ADAPTER_SALR && (!sparse_ok || !be->sparse_matmul))
            return fu_errmsg_set(em, FU_ENOSYS, "node %zu: backend %s has no sparse (SALR) kernels", i, be->name);

    dag_exec_t *x = fu_calloc(1, sizeof *x);
    x->g = g;
    x->o = *o;
    x->o.last = last;
    if (!x->o.n_slots)
        x->o.n_slots = 1;
    if (!x->o.max_context)
        x->o.max_context = x->o.max_tokens;
    x->be = be;
    x->cpu = cpu;
    x->n = n;
    x->first = o->first;
    x->last = last;
    x->nodes = fu_calloc(n, sizeof *x->nodes);
    x->need_grad = fu_calloc(n, sizeof *x->need_grad);
    x->act = fu_calloc((size_t)x->o.n_slots * n, sizeof *x->act);
    x->hsave = fu_calloc((size_t)x->o.n_slots * n, sizeof *x->hsave);
    x->grad = fu_calloc(n, sizeof *x->grad);
    x->slots = fu_calloc(x->o.n_slots, sizeof *x->slots);
    x->sp.temperature = 0.0f;
    x->sp.top_k = 0;
    x->sp.top_p = 1.0f;
    x->sp.seed = 0;
    fu_err rc = FU_OK;

    /* Which outputs need a gradient: a trained adapter at or before them (over the whole graph so
     * every stage agrees on its cut tensors). */
    for (size_t i = 0; i < n; i++) {
        const dag_node *nd = dag_graph_node(g, i);
        bool ng = trainable(x, nd);
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            ng = ng || x->need_grad[nd->inputs[k]];
        x->need_grad[i] = ng;
    }
    for (size_t j = x->first; j < n; j++) {
        const dag_node *nd = dag_graph_node(g, j);
        for (uint32_t k = 0; k < nd->n_inputs; k++) {
            uint32_t src = nd->inputs[k];
            if (j < last && in_range(x, src))
                x->nodes[src].n_cons++;
            if (j >= last && in_range(x, src))
                x->nodes[src].cut_out = true;
        }
    }
    for (size_t j = x->first; j < last; j++) {
        const dag_node *nd = dag_graph_node(g, j);
        enode *e = &x->nodes[j];
        bool any_in = false;
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            any_in = any_in || x->need_grad[nd->inputs[k]];
        e->run_bwd = x->o.training && (trainable(x, nd) || any_in || nd->op == DAG_OP_CROSS_ENTROPY);
        if (nd->op == DAG_OP_CROSS_ENTROPY && !x->need_grad[nd->inputs[0]])
            e->run_bwd = false;
        if (!e->run_bwd)
            continue;
        switch (nd->op) {
        case DAG_OP_RMSNORM:
            e->save_mask = 1;
            break;
        case DAG_OP_LINEAR:
            if (nd->adapter.method == DAG_ADAPTER_LORA && nd->adapter.rank > 0)
                e->save_mask = 1;
            break;
        case DAG_OP_ATTENTION:
            e->save_mask = 7;
            break;
        case DAG_OP_SILU_MUL:
            e->save_mask = 3;
            break;
        case DAG_OP_CROSS_ENTROPY:
            e->save_mask = 1;
            break;
        default:
            break;
        }
    }
    for (uint32_t s = 0; s < x->o.n_slots; s++) {
        int64_t shape[1] = {x->o.max_tokens};
        if ((rc = kern_tensor_new_zeros(be, KERN_I32, 1, shape, &x->slots[s].tokens)) != FU_OK ||
            (rc = kern_tensor_new_zeros(be, KERN_I32, 1, shape, &x->slots[s].targets)) != FU_OK ||
            (rc = kern_tensor_new_zeros(be, KERN_I32, 1, shape, &x->slots[s].pos)) != FU_OK) {
            fu_errmsg_set(em, rc, "cannot allocate the token buffers");
            goto fail;
        }
    }
    *out = x;
    return FU_OK;
fail:
    dag_exec_destroy(&x);
    return rc;
}

static void free_node(enode *e)
{
    if (!e->w_shared)
        kern_tensor_destroy(&e->w);
    e->w = NULL;
    kern_bitmap_destroy(&e->bm);
#ifdef FUSION_KERN_HAVE_CUDA
    kern_cuda_bitmap_t *cb = e->dev_bm;
    kern_cuda_bitmap_destroy(&cb);
#endif
    e->dev_bm = NULL;
    memset(&e->sw, 0, sizeof e->sw);
    kern_tensor_t **ts[] = {&e->A,  &e->B,  &e->dA,    &e->dB,    &e->mA, &e->vA,
                            &e->mB, &e->vB, &e->A2, &e->B2, &e->a_cat, &e->b_cat, &e->eye};
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++)
        kern_tensor_destroy(ts[k]);
}

void dag_exec_destroy(dag_exec_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    dag_exec_t *x = *self_p;
    if (x->nodes)
        for (size_t i = 0; i < x->n; i++)
            free_node(&x->nodes[i]);
    free(x->nodes);
    free(x->need_grad);
    for (size_t i = 0; i < x->n_bufs; i++) {
        kern_tensor_destroy(&x->bufs[i]->t);
        free(x->bufs[i]);
    }
    free(x->bufs);
    free(x->act);
    free(x->hsave);
    free(x->grad);
    if (x->slots)
        for (uint32_t s = 0; s < x->o.n_slots; s++) {
            kern_tensor_destroy(&x->slots[s].tokens);
            kern_tensor_destroy(&x->slots[s].targets);
            kern_tensor_destroy(&x->slots[s].pos);
        }
    free(x->slots);
    kern_workspace_destroy(&x->ws);
    free(x->staging);
    free(x);
    *self_p = NULL;
}

/* ---- weights -------------------------------------------------------------------------------- */

/* Gives resident pages of a consumed file range back (the f32 copy replaces them). */
static void drop_pages(const void *p, size_t len)
{
    long pg = sysconf(_SC_PAGESIZE);
    if (pg <= 0 || !p || len == 0)
        return;
    uintptr_t a = (uintptr_t)p, e = a + len;
    uintptr_t lo = (a + (uintptr_t)pg - 1) & ~((uintptr_t)pg - 1);
    uintptr_t hi = e & ~((uintptr_t)pg - 1);
    if (hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* Loads tensor `name` of the given shape as f32 on the backend. Zero-copy for aligned F32 on CPU. */
static fu_err load_f32(dag_exec_t *x, const fu_safetensors *st, const char *name, size_t ndim, uint64_t d0,
                       uint64_t d1, kern_tensor_t **out, fu_errmsg *em)
{
    uint64_t shape[2] = {d0, d1};
    const fu_st_tensor *t = NULL;
    FU_TRY(fu_safetensors_expect(st, name, ndim, shape, &t, em));
    if (!fu_st_dtype_is_float(t->dtype))
        return fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' is %s, expected a float type", t->file, name,
                             fu_st_dtype_name(t->dtype));
    if (x->cpu && t->dtype == FU_ST_F32 && ((uintptr_t)t->data % sizeof(float)) == 0) {
        int64_t s[2] = {(int64_t)d0, (int64_t)d1};
        kern_tensor_t *k = fu_calloc(1, sizeof *k);
        fu_err rc = kern_tensor_wrap(k, (void *)t->data, KERN_F32, (int)ndim, s, x->be->device);
        if (rc != FU_OK) {
            free(k);
            return rc;
        }
        *out = k;
        return FU_OK;
    }
    kern_tensor_t *k = NULL;
    FU_TRY(new_tensor(x, (int)ndim, (int64_t)d0, (int64_t)d1, false, &k));
    fu_err rc;
    if (x->cpu) {
        rc = fu_st_tensor_to_f32(t, k->data, t->nelem, em);
    } else {
        float *host = fu_malloc(t->nelem * sizeof(float));
        rc = fu_st_tensor_to_f32(t, host, t->nelem, em);
        if (rc == FU_OK)
            rc = kern_tensor_copy_in(x->be, k, host, t->nelem * sizeof(float));
        free(host);
    }
    drop_pages(t->data, t->nbytes);
    if (rc != FU_OK) {
        kern_tensor_destroy(&k);
        return rc;
    }
    *out = k;
    return FU_OK;
}

static uint64_t name_seed(uint64_t seed, const char *name)
{
    uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);
    for (const char *p = name; *p; p++) {
        h ^= (uint8_t)*p;
        h *= 1099511628211ull;
    }
    return h;
}

static kern_salr_dims salr_dims(const dag_node *nd, const enode *e)
{
    kern_salr_dims d = {.in = nd->dim_in, .out = nd->dim_out, .r1 = (size_t)e->r, .r2 = (size_t)e->r2};
    return d;
}

static fu_err copy_into(dag_exec_t *x, kern_tensor_t *t, const float *host)
{
    return kern_tensor_copy_in(x->be, t, host, kern_tensor_nbytes(t));
}

/* Host copy of a tensor (a borrowed pointer on the CPU, a new buffer in *own otherwise). */
static fu_err host_copy(const dag_exec_t *x, const kern_tensor_t *t, const float **out, float **own)
{
    *own = NULL;
    if (!t) {
        *out = NULL;
        return FU_OK;
    }
    if (x->cpu) {
        *out = t->data;
        return FU_OK;
    }
    size_t nb = kern_tensor_nbytes(t);
    *own = fu_malloc(nb ? nb : 1);
    fu_err rc = kern_tensor_copy_out(x->be, t, *own, nb);
    if (rc != FU_OK) {
        free(*own);
        *own = NULL;
        return rc;
    }
    *out = *own;
    return FU_OK;
}

/* (Re)builds a salr node's concatenated adapters from A, B, A2, B2 (kern_salr_concat_build on the
 * host, then copied to the backend). */
static fu_err salr_rebuild(dag_exec_t *x, const dag_node *nd, enode *e)
{
    kern_salr_dims d = salr_dims(nd, e);
    int64_t rt = (int64_t)(d.r1 + d.r2);
    if (!e->a_cat) {
        FU_TRY(new_tensor(x, 2, rt, (int64_t)d.in, false, &e->a_cat));
        FU_TRY(new_tensor(x, 2, (int64_t)d.out, rt, false, &e->b_cat));
        if (d.r1 > 0) {
            float *id = fu_calloc(d.r1 * d.r1, sizeof *id);
            for (size_t k = 0; k < d.r1; k++)
                id[k * d.r1 + k] = 1.0f;
            fu_err rc = new_tensor(x, 2, (int64_t)d.r1, (int64_t)d.r1, false, &e->eye);
            if (rc == FU_OK)
                rc = copy_into(x, e->eye, id);
            free(id);
            FU_TRY(rc);
        }
    }
    const float *a1, *b1, *a2, *b2;
    float *o1 = NULL, *o2 = NULL, *o3 = NULL, *o4 = NULL;
    float *ac = fu_malloc(kern_tensor_nbytes(e->a_cat)), *bc = fu_malloc(kern_tensor_nbytes(e->b_cat));
    fu_err rc = host_copy(x, e->A, &a1, &o1);
    if (rc == FU_OK)
        rc = host_copy(x, e->B, &b1, &o2);
    if (rc == FU_OK)
        rc = host_copy(x, e->A2, &a2, &o3);
    if (rc == FU_OK)
        rc = host_copy(x, e->B2, &b2, &o4);
    if (rc == FU_OK)
        rc = kern_salr_concat_build(&d, a1, b1, e->scale, a2, b2, 1.0f, ac, bc);
    if (rc == FU_OK)
        rc = copy_into(x, e->a_cat, ac);
    if (rc == FU_OK)
        rc = copy_into(x, e->b_cat, bc);
    free(o1);
    free(o2);
    free(o3);
    free(o4);
    free(ac);
    free(bc);
    return rc;
}

/* b_cat[:, :r1] = s1·B1 after an optimizer step, on the backend (a GEMM with the identity writes
 * the strided column block). */
static fu_err salr_refresh_b1(dag_exec_t *x, enode *e)
{
    if (e->r == 0)
        return FU_OK;
    kern_tensor_t cols = *e->b_cat;
    cols.shape[1] = e->r;
    return kern_gemm(x->be, false, false, e->scale, e->B, e->eye, 0.0f, &cols);
}

/* Allocates the trained adapter of a linear (A Kaiming-uniform, B zero) and its optimizer state. */
static fu_err make_adapter(dag_exec_t *x, const dag_node *nd, enode *e)
{
    int64_t r = nd->adapter.rank, in = nd->dim_in, outf = nd->dim_out;
    e->r = r;
    e->scale = r > 0 ? nd->adapter.alpha / (float)r : 0.0f;
    e->train_a = nd->adapter.method == DAG_ADAPTER_LORA;
    if (r == 0)
        return FU_OK;
    FU_TRY(new_tensor(x, 2, r, in, false, &e->A));
    FU_TRY(new_tensor(x, 2, outf, r, true, &e->B));
    FU_TRY(kern_lora_init(x->be, e->A, e->B, name_seed(x->o.seed, nd->params[0])));
    if (x->o.training) {
        FU_TRY(new_tensor(x, 2, outf, r, true, &e->dB));
        FU_TRY(new_tensor(x, 2, outf, r, true, &e->mB));
        FU_TRY(new_tensor(x, 2, outf, r, true, &e->vB));
        if (e->train_a) {
            FU_TRY(new_tensor(x, 2, r, in, true, &e->dA));
            FU_TRY(new_tensor(x, 2, r, in, true, &e->mA));
            FU_TRY(new_tensor(x, 2, r, in, true, &e->vA));
        }
    }
    return FU_OK;
}

static fu_err load_salr_weight(dag_exec_t *x, const fu_safetensors *st, const dag_node *nd, enode *e, fu_errmsg *em)
{
    const char *name = nd->params[0];
    char bn[DAG_NAME_MAX + 16], vn[DAG_NAME_MAX + 16], on[DAG_NAME_MAX + 16];
    snprintf(bn, sizeof bn, "%s.bitmap", name);
    snprintf(vn, sizeof vn, "%s.values", name);
    snprintf(on, sizeof on, "%s.offsets", name);
    const fu_st_tensor *tb = fu_safetensors_get(st, bn), *tvv = fu_safetensors_get(st, vn),
                       *to = fu_safetensors_get(st, on);
    if ((tb || tvv || to) && !(tb && tvv && to))
        return fu_errmsg_set(em, FU_EPROTO,
                             "the bitmap-encoded weight '%s' is incomplete: '%s' is missing (a SALR weight is stored "
                             "as .bitmap, .values and .offsets; prune the model again)",
                             name, !tb ? bn : !tvv ? vn : on);
    if (!tb && !fu_safetensors_get(st, name))
        return fu_errmsg_set(em, FU_ENOTFOUND,
                             "the model has neither '%s' nor a dense '%s': the graph expects a SALR-pruned %s%s", bn,
                             name, nd->op == DAG_OP_LM_HEAD ? "lm_head" : "linear",
                             nd->op == DAG_OP_LM_HEAD ? " (`fusion model prune` writes one)"
                                                      : " (make one with `fusion model prune`)");
    if (tb && tvv && to) {
        if (tb->dtype != FU_ST_U8 || to->dtype != FU_ST_I32 || (tvv->dtype != FU_ST_F32 && tvv->dtype != FU_ST_F16))
            return fu_errmsg_set(em, FU_EPROTO, "%s: bitmap tensors of '%s' have the wrong dtypes (U8, F32/F16, I32)",
                                 tb->file, name);
        fu_err rc = kern_bitmap_from_buffers(nd->dim_out, nd->dim_in,
                                             tvv->dtype == FU_ST_F16 ? KERN_BITMAP_F16 : KERN_BITMAP_F32, tb->data,
                                             tb->nbytes, tvv->data, tvv->nbytes, to->data, to->nbytes, &e->bm);
        if (rc != FU_OK)
            return fu_errmsg_set(em, FU_EPROTO, "%s: bitmap-encoded weight '%s' is inconsistent (%s)", tb->file,
                                 name, fu_strerror(rc));
        drop_pages(tb->data, tb->nbytes);
        drop_pages(tvv->data, tvv->nbytes);
        drop_pages(to->data, to->nbytes);
    } else {
        /* A dense (already pruned) weight: encode it here. */
        uint64_t shape[2] = {nd->dim_out, nd->dim_in};
        size_t ne = (size_t)nd->dim_out * nd->dim_in;
        float *w = fu_malloc(ne * sizeof *w);
        fu_err rc = fu_safetensors_read_f32(st, name, 2, shape, w, ne, em);
        if (rc == FU_OK && (rc = kern_bitmap_encode(w, nd->dim_out, nd->dim_in, nd->dim_in, KERN_BITMAP_F32, &e->bm)) !=
                               FU_OK)
            fu_errmsg_set(em, rc, "cannot bitmap-encode '%s'", name);
        free(w);
        FU_TRY(rc);
    }
    e->sw.rows = nd->dim_out;
    e->sw.cols = nd->dim_in;
    e->sw.handle = e->bm;
#ifdef FUSION_KERN_HAVE_CUDA
    if (x->be->device.kind == KERN_DEV_CUDA) {
        kern_cuda_bitmap_t *cb = NULL;
        fu_err rc = kern_cuda_bitmap_upload(x->be, e->bm, &cb);
        if (rc != FU_OK)
            return fu_errmsg_set(em, rc, "cannot upload the sparse weight '%s' to %s", name, x->be->name);
        e->dev_bm = cb;
        e->sw.handle = cb;
        kern_bitmap_destroy(&e->bm); /* the device copy is the one used */
    }
#endif
    e->r2 = nd->adapter.res_rank;
    FU_TRY(load_f32(x, st, nd->params[1], 2, nd->adapter.res_rank, nd->dim_in, &e->A2, em));
    FU_TRY(load_f32(x, st, nd->params[2], 2, nd->dim_out, nd->adapter.res_rank, &e->B2, em));
    return FU_OK;
}

fu_err dag_exec_load_weights(dag_exec_t *x, const fu_safetensors *st, fu_errmsg *em)
{
    if (!x || !st)
        return FU_EINVAL;
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        enode *e = &x->nodes[i];
        free_node(e);
        memset(&e->w, 0, sizeof e->w);
        e->w_shared = false;
        switch (nd->op) {
        case DAG_OP_EMBEDDING:
            FU_TRY(load_f32(x, st, nd->params[0], 2, nd->dim_in, nd->dim_out, &e->w, em));
            break;
        case DAG_OP_RMSNORM:
            FU_TRY(load_f32(x, st, nd->params[0], 1, nd->dim_in, 1, &e->w, em));
            break;
        case DAG_OP_LM_HEAD: {
            if (nd->adapter.method == DAG_ADAPTER_SALR) {
                /* A pruned head: sparse weight and frozen residual as one SALR product, nothing trained. */
                FU_TRY(load_salr_weight(x, st, nd, e, em));
                e->r = 0;
                e->scale = 0.0f;
                FU_TRY(salr_rebuild(x, nd, e));
                break;
            }
            if (!fu_safetensors_get(st, nd->params[0])) {
                char bn[DAG_NAME_MAX + 16];
                snprintf(bn, sizeof bn, "%s.bitmap", nd->params[0]);
                if (fu_safetensors_get(st, bn))
                    return fu_errmsg_set(em, FU_EINVAL,
                                         "'%s' is stored SALR-pruned (bitmap-encoded) in this model, but the graph "
                                         "has a dense lm_head: build it with salr_lm_head (dag_salr_info_load reads "
                                         "salr_config.json)",
                                         nd->params[0]);
            }
            /* Tied embeddings: share the table when this range holds it. */
            for (size_t k = x->first; k < i; k++)
                if (N(x, k)->op == DAG_OP_EMBEDDING && strcmp(N(x, k)->params[0], nd->params[0]) == 0 &&
                    x->nodes[k].w) {
                    e->w = x->nodes[k].w;
                    e->w_shared = true;
                }
            if (!e->w)
                FU_TRY(load_f32(x, st, nd->params[0], 2, nd->dim_out, nd->dim_in, &e->w, em));
            break;
        }
        case DAG_OP_LINEAR:
            if (nd->adapter.method == DAG_ADAPTER_SALR)
                FU_TRY(load_salr_weight(x, st, nd, e, em));
            else
                FU_TRY(load_f32(x, st, nd->params[0], 2, nd->dim_out, nd->dim_in, &e->w, em));
            if (nd->adapter.method != DAG_ADAPTER_NONE) {
                fu_err rc = make_adapter(x, nd, e);
                if (rc != FU_OK)
                    return fu_errmsg_set(em, rc, "cannot allocate the adapter of node %zu", i);
            }
            if (nd->adapter.method == DAG_ADAPTER_SALR)
                FU_TRY(salr_rebuild(x, nd, e));
            break;
        default:
            break;
        }
    }
    return FU_OK;
}

/* "model.layers.0.self_attn.q_proj.weight" -> "model.layers.0.self_attn.q_proj" */
static void module_of(const char *param, char *out, size_t cap)
{
    snprintf(out, cap, "%s", param);
    size_t l = strlen(out);
    if (l > 7 && strcmp(out + l - 7, ".weight") == 0)
        out[l - 7] = '\0';
}

static fu_err read_into(dag_exec_t *x, const fu_safetensors *st, const char *name, kern_tensor_t *t, fu_errmsg *em)
{
    uint64_t shape[2] = {(uint64_t)t->shape[0], (uint64_t)t->shape[1]};
    size_t n = (size_t)kern_tensor_numel(t);
    if (x->cpu)
        return fu_safetensors_read_f32(st, name, (size_t)t->ndim, shape, t->data, n, em);
    float *host = fu_malloc(n * sizeof(float));
    fu_err rc = fu_safetensors_read_f32(st, name, (size_t)t->ndim, shape, host, n, em);
    if (rc == FU_OK)
        rc = copy_into(x, t, host);
    free(host);
    return rc;
}

static fu_err zero_opt_state(dag_exec_t *x, enode *e)
{
    kern_tensor_t *ts[] = {e->dA, e->dB, e->mA, e->vA, e->mB, e->vB};
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++)
        if (ts[k])
            FU_TRY(kern_tensor_zero(x->be, ts[k]));
    return FU_OK;
}

fu_err dag_exec_load_adapter(dag_exec_t *x, const fu_safetensors *st, fu_errmsg *em)
{
    if (!x || !st)
        return FU_EINVAL;
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        enode *e = &x->nodes[i];
        if (!e->A)
            continue;
        char mod[DAG_NAME_MAX], name[DAG_NAME_MAX + 64];
        module_of(nd->params[0], mod, sizeof mod);
        snprintf(name, sizeof name, DAG_PEFT_PREFIX "%s.lora_A.weight", mod);
        FU_TRY(read_into(x, st, name, e->A, em));
        snprintf(name, sizeof name, DAG_PEFT_PREFIX "%s.lora_B.weight", mod);
        FU_TRY(read_into(x, st, name, e->B, em));
        FU_TRY(zero_opt_state(x, e));
        if (nd->adapter.method == DAG_ADAPTER_SALR)
            FU_TRY(salr_rebuild(x, nd, e));
    }
    x->step = 0;
    return FU_OK;
}

/* ---- saving --------------------------------------------------------------------------------- */

typedef struct {
    fu_st_tensor *t; /* tensors to write */
    float **host;    /* host copies to free */
    char **names;
    size_t n, cap;
} tlist;

static fu_err tlist_add(const dag_exec_t *x, tlist *l, const char *name, const kern_tensor_t *t)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 32;
        l->t = fu_realloc(l->t, l->cap * sizeof *l->t);
        l->host = fu_realloc(l->host, l->cap * sizeof *l->host);
        l->names = fu_realloc(l->names, l->cap * sizeof *l->names);
    }
    size_t nb = kern_tensor_nbytes(t);
    float *h = fu_malloc(nb ? nb : 1);
    fu_err rc = kern_tensor_copy_out(x->be, t, h, nb);
    if (rc != FU_OK) {
        free(h);
        return rc;
    }
    fu_st_tensor *s = &l->t[l->n];
    memset(s, 0, sizeof *s);
    l->names[l->n] = fu_strdup(name);
    s->name = l->names[l->n];
    s->dtype = FU_ST_F32;
    s->ndim = (size_t)t->ndim;
    for (int d = 0; d < t->ndim; d++)
        s->shape[d] = (uint64_t)t->shape[d];
    s->data = h;
    s->nbytes = nb;
    l->host[l->n] = h;
    l->n++;
    return FU_OK;
}

static void tlist_free(tlist *l)
{
    for (size_t i = 0; i < l->n; i++) {
        free(l->host[i]);
        free(l->names[i]);
    }
    free(l->t);
    free(l->host);
    free(l->names);
    memset(l, 0, sizeof *l);
}

static fu_err collect(const dag_exec_t *x, tlist *l, bool with_state)
{
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        const enode *e = &x->nodes[i];
        if (!e->A)
            continue;
        char mod[DAG_NAME_MAX], name[DAG_NAME_MAX + 96];
        module_of(nd->params[0], mod, sizeof mod);
        struct {
            const char *suffix;
            const kern_tensor_t *t;
        } items[] = {
            {"lora_A.weight", e->A},
            {"lora_B.weight", e->B},
            {"lora_A.weight.exp_avg", with_state ? e->mA : NULL},
            {"lora_A.weight.exp_avg_sq", with_state ? e->vA : NULL},
            {"lora_B.weight.exp_avg", with_state ? e->mB : NULL},
            {"lora_B.weight.exp_avg_sq", with_state ? e->vB : NULL},
        };
        for (size_t k = 0; k < sizeof items / sizeof items[0]; k++) {
            if (!items[k].t)
                continue;
            snprintf(name, sizeof name, DAG_PEFT_PREFIX "%s.%s", mod, items[k].suffix);
            FU_TRY(tlist_add(x, l, name, items[k].t));
        }
    }
    return FU_OK;
}

fu_err dag_exec_save_adapter(const dag_exec_t *x, const char *dir, const char *base_model, fu_errmsg *em)
{
    if (!x || !dir)
        return FU_EINVAL;
    FU_TRY(fu_mkdir_p(dir, 0755, em));
    tlist l = {0};
    fu_err rc = collect(x, &l, false);
    if (rc == FU_OK && l.n == 0)
        rc = fu_errmsg_set(em, FU_EINVAL, "the graph has no adapters to save");
    char *path = fu_path_join(dir, "adapter_model.safetensors");
    if (rc == FU_OK)
        rc = fu_safetensors_write(path, l.t, l.n, NULL, 0, NULL, NULL, em);
    free(path);
    tlist_free(&l);
    FU_TRY(rc);

    /* adapter_config.json */
    uint32_t targets = 0;
    uint32_t r = 0;
    float alpha = 0;
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        if (x->nodes[i].A) {
            targets |= DAG_TARGET_BIT(nd->target);
            r = nd->adapter.rank;
            alpha = nd->adapter.alpha;
        }
    }
    char *js = dag_peft_config_json(base_model, r, (double)alpha, targets);
    char *cpath = fu_path_join(dir, DAG_PEFT_CONFIG_FILE);
    rc = fu_file_write_atomic(cpath, js, strlen(js), 0644, em);
    free(cpath);
    free(js);
    return rc;
}

fu_err dag_exec_save_state(const dag_exec_t *x, const char *path, fu_errmsg *em)
{
    if (!x || !path)
        return FU_EINVAL;
    tlist l = {0};
    fu_err rc = collect(x, &l, true);
    char step[32];
    snprintf(step, sizeof step, "%" PRId64, x->step);
    const char *meta[] = {"fusion.step", step};
    if (rc == FU_OK)
        rc = fu_safetensors_write(path, l.t, l.n, meta, 1, NULL, NULL, em);
    tlist_free(&l);
    return rc;
}

fu_err dag_exec_load_state(dag_exec_t *x, const fu_safetensors *st, fu_errmsg *em)
{
    if (!x || !st)
        return FU_EINVAL;
    const char *step = fu_safetensors_metadata(st, "fusion.step");
    char *end = NULL;
    long long sv = step ? strtoll(step, &end, 10) : -1;
    if (!step || !end || *end || sv < 0)
        return fu_errmsg_set(em, FU_EPROTO, "checkpoint has no valid fusion.step metadata");
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        enode *e = &x->nodes[i];
        if (!e->A)
            continue;
        char mod[DAG_NAME_MAX], name[DAG_NAME_MAX + 96];
        module_of(nd->params[0], mod, sizeof mod);
        struct {
            const char *suffix;
            kern_tensor_t *t;
        } items[] = {
            {"lora_A.weight", e->A},
            {"lora_B.weight", e->B},
            {"lora_A.weight.exp_avg", e->mA},
            {"lora_A.weight.exp_avg_sq", e->vA},
            {"lora_B.weight.exp_avg", e->mB},
            {"lora_B.weight.exp_avg_sq", e->vB},
        };
        for (size_t k = 0; k < sizeof items / sizeof items[0]; k++) {
            if (!items[k].t)
                continue;
            snprintf(name, sizeof name, DAG_PEFT_PREFIX "%s.%s", mod, items[k].suffix);
            FU_TRY(read_into(x, st, name, items[k].t, em));
        }
        if (e->dA)
            FU_TRY(kern_tensor_zero(x->be, e->dA));
        if (e->dB)
            FU_TRY(kern_tensor_zero(x->be, e->dB));
        if (nd->adapter.method == DAG_ADAPTER_SALR)
            FU_TRY(salr_rebuild(x, nd, e));
    }
    x->step = sv;
    return FU_OK;
}

/* ---- cut tensors ---------------------------------------------------------------------------- */

size_t dag_exec_cut_inputs(const dag_exec_t *x, uint32_t *ids, size_t cap)
{
    size_t c = 0;
    for (size_t i = 0; i < x->first; i++) {
        bool used = false;
        for (size_t j = x->first; j < x->last && !used; j++) {
            const dag_node *nd = N(x, j);
            for (uint32_t k = 0; k < nd->n_inputs; k++)
                used = used || nd->inputs[k] == i;
        }
        if (used) {
            if (ids && c < cap)
                ids[c] = (uint32_t)i;
            c++;
        }
    }
    return c;
}

size_t dag_exec_cut_outputs(const dag_exec_t *x, uint32_t *ids, size_t cap)
{
    size_t c = 0;
    for (size_t i = x->first; i < x->last; i++)
        if (x->nodes[i].cut_out) {
            if (ids && c < cap)
                ids[c] = (uint32_t)i;
            c++;
        }
    return c;
}

static bool is_cut_input(const dag_exec_t *x, uint32_t node)
{
    if (node >= x->first)
        return false;
    for (size_t j = x->first; j < x->last; j++) {
        const dag_node *nd = N(x, j);
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            if (nd->inputs[k] == node)
                return true;
    }
    return false;
}

/* ---- batch ---------------------------------------------------------------------------------- */

fu_err dag_exec_set_tokens(dag_exec_t *x, uint32_t slot, const int32_t *tokens, const int32_t *targets,
                           uint32_t n_seq, uint32_t seq_len)
{
    if (!x || slot >= x->o.n_slots || n_seq == 0 || seq_len == 0)
        return FU_EINVAL;
    uint64_t rows = (uint64_t)n_seq * seq_len;
    if (rows > x->o.max_tokens)
        return FU_EINVAL;
    if (x->session && n_seq != 1)
        return FU_EINVAL;
    const dag_model_dims *d = dag_graph_dims(x->g);
    eslot *s = &x->slots[slot];
    s->n_seq = n_seq;
    s->seq_len = seq_len;
    s->rows = (uint32_t)rows;
    s->has_tokens = tokens != NULL;
    s->has_targets = targets != NULL;
    s->pos0 = x->session ? x->session->len : 0;
    if (x->session && (uint64_t)s->pos0 + rows > x->o.max_context)
        return FU_ENOMEM;
    int32_t *pos = fu_malloc(rows * sizeof *pos);
    for (uint64_t i = 0; i < rows; i++)
        pos[i] = (int32_t)(x->session ? s->pos0 + (int64_t)i : (int64_t)(i % seq_len));
    kern_tensor_t pv = tv1(s->pos->data, KERN_I32, (int64_t)rows, x->be->device);
    fu_err rc = kern_tensor_copy_in(x->be, &pv, pos, rows * sizeof *pos);
    free(pos);
    FU_TRY(rc);
    if (tokens) {
        for (uint64_t i = 0; i < rows; i++)
            if (tokens[i] < 0 || (uint32_t)tokens[i] >= d->vocab_size)
                return FU_EINVAL;
        kern_tensor_t t = tv1(s->tokens->data, KERN_I32, (int64_t)rows, x->be->device);
        FU_TRY(kern_tensor_copy_in(x->be, &t, tokens, rows * sizeof *tokens));
    }
    if (targets) {
        for (uint64_t i = 0; i < rows; i++)
            if (targets[i] != DAG_IGNORE_INDEX && (targets[i] < 0 || (uint32_t)targets[i] >= d->vocab_size))
                return FU_EINVAL;
        kern_tensor_t t = tv1(s->targets->data, KERN_I32, (int64_t)rows, x->be->device);
        FU_TRY(kern_tensor_copy_in(x->be, &t, targets, rows * sizeof *targets));
    }
    return FU_OK;
}

fu_err dag_exec_set_input(dag_exec_t *x, uint32_t slot, uint32_t node, const float *data, size_t n_floats)
{
    if (!x || slot >= x->o.n_slots || !data || !is_cut_input(x, node))
        return FU_EINVAL;
    eslot *s = &x->slots[slot];
    size_t w = node_width(x, node);
    if (s->rows == 0 || n_floats != (size_t)s->rows * w)
        return FU_EINVAL;
    ebuf **p = &x->act[(size_t)slot * x->n + node];
    if (*p) {
        (*p)->refs = 0;
        *p = NULL;
    }
    ebuf *b = NULL;
    FU_TRY(pool_get(x, (size_t)x->o.max_tokens * w, &b));
    kern_tensor_t t = tv1(b->t->data, KERN_F32, (int64_t)n_floats, x->be->device);
    fu_err rc = kern_tensor_copy_in(x->be, &t, data, n_floats * sizeof(float));
    if (rc != FU_OK) {
        b->refs = 0;
        return rc;
    }
    /* Held by its consumers and by the backward readers; released at the slot's end anyway. */
    *p = b;
    b->refs = 1;
    return FU_OK;
}

/* ---- workspace ------------------------------------------------------------------------------ */

static fu_err ensure_ws(dag_exec_t *x, size_t bytes)
{
    bytes += DAG_WS_SLACK;
    if (x->ws && kern_workspace_capacity(x->ws) >= bytes)
        return FU_OK;
    kern_workspace_destroy(&x->ws);
    x->ws = kern_workspace_new(x->be, bytes + bytes / 4);
    return x->ws ? FU_OK : FU_ENOMEM;
}

static fu_err ensure_ws_attn(dag_exec_t *x, const kern_attn_params *p, int64_t tq, int64_t tk, bool bwd)
{
    size_t need = 0;
    FU_TRY(kern_attn_workspace_bytes(x->be, p, tq, tk, bwd, &need));
    return ensure_ws(x, need);
}

static fu_err ensure_ws_rank(dag_exec_t *x, uint32_t rows, int64_t r)
{
    return ensure_ws(x, (size_t)rows * (size_t)r * sizeof(float) + KERN_ALIGN * 4);
}

/* ---- forward -------------------------------------------------------------------------------- */

static uint32_t head_rows(const dag_exec_t *x, const eslot *s)
{
    /* Inference without logits_all: only the last row of the (single) sequence reaches lm_head. */
    if (!x->o.training && !x->o.logits_all && s->n_seq == 1)
        return 1;
    return s->rows;
}

static uint32_t rows_of(const dag_exec_t *x, const eslot *s, size_t i)
{
    dag_op op = N(x, i)->op;
    if (op == DAG_OP_LM_HEAD || op == DAG_OP_CROSS_ENTROPY || op == DAG_OP_SAMPLE)
        return head_rows(x, s);
    return s->rows;
}

static int refs_for(const dag_exec_t *x, size_t i)
{
    const enode *e = &x->nodes[i];
    int r = e->n_cons + (e->cut_out ? 1 : 0);
    const dag_node *nd = N(x, i);
    if (nd->op == DAG_OP_LM_HEAD || e->n_cons == 0)
        r++; /* held for get_output until the slot is reused */
    for (size_t j = i + 1; j < x->last; j++) {
        const dag_node *c = N(x, j);
        for (uint32_t k = 0; k < c->n_inputs; k++)
            if (c->inputs[k] == i && (x->nodes[j].save_mask & (1u << k)))
                r++;
    }
    return r;
}

static int input_refs_for(const dag_exec_t *x, uint32_t src)
{
    int r = 0;
    for (size_t j = x->first; j < x->last; j++) {
        const dag_node *c = N(x, j);
        for (uint32_t k = 0; k < c->n_inputs; k++)
            if (c->inputs[k] == src)
                r += 1 + ((x->nodes[j].save_mask & (1u << k)) ? 1 : 0);
    }
    return r + 1; /* released at the end of the slot */
}

/* Y = X·Wᵀ. A decode step has one row: OpenBLAS's sgemm then packs all of W for a single row (twice
 * the memory traffic), so on the CPU a few rows go through sgemv instead. */
static fu_err base_linear(const dag_exec_t *x, const kern_tensor_t *in, const kern_tensor_t *w, kern_tensor_t *out)
{
    int64_t rows = in->shape[0];
    if (!x->cpu || rows > DAG_GEMV_MAX_ROWS || w->ndim != 2 || in->shape[1] != w->shape[1] ||
        out->shape[1] != w->shape[0] || out->shape[0] != rows || !kern_tensor_is_contiguous(w))
        return kern_linear_forward(x->be, in, w, out);
    for (int64_t r = 0; r < rows; r++)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)w->shape[0], (int)w->shape[1], 1.0f, w->data, (int)w->shape[1],
                    (const float *)in->data + r * in->stride[0], 1, 0.0f, (float *)out->data + r * out->stride[0], 1);
    return FU_OK;
}

/* A SALR product (linear or lm_head) over in's rows: the sparse base, then every adapter as one GEMM
 * pair: h = X·[A1; A2]ᵀ, Y += h·[s1B1 | B2]ᵀ. h is kept for backward when the node runs one. */
static fu_err fwd_salr(dag_exec_t *x, uint32_t slot, size_t i, const kern_tensor_t *in, kern_tensor_t *out)
{
    enode *e = &x->nodes[i];
    int64_t rt = e->r + e->r2;
    ebuf *h = NULL;
    FU_TRY(pool_get(x, (size_t)x->o.max_tokens * (size_t)rt, &h));
    kern_tensor_t hv = bview(x, h, in->shape[0], rt);
    fu_err rc = kern_sparse_linear_forward(x->be, in, &e->sw, 0.0f, out);
    if (rc == FU_OK)
        rc = kern_lora_forward(x->be, in, NULL, e->a_cat, e->b_cat, 1.0f, &hv, out);
    if (rc == FU_OK && e->run_bwd) /* backward needs h even for the frozen part */
        x->hsave[(size_t)slot * x->n + i] = h;
    else
        h->refs = 0;
    return rc;
}

/* dX = dY·W_sparse + (dY·b_cat)·a_cat (overwritten) of a SALR product, from the h its forward kept. */
static fu_err bwd_salr_dx(dag_exec_t *x, uint32_t slot, size_t j, const kern_tensor_t *dy, kern_tensor_t *dx)
{
    enode *e = &x->nodes[j];
    ebuf *h = x->hsave[(size_t)slot * x->n + j];
    int64_t rt = e->r + e->r2;
    if (!h)
        return FU_EINVAL;
    kern_tensor_t hv = bview(x, h, dy->shape[0], rt);
    FU_TRY(kern_sparse_linear_backward(x->be, dy, &e->sw, dx));
    FU_TRY(ensure_ws_rank(x, (uint32_t)dy->shape[0], rt));
    return kern_lorafa_backward(x->be, dy, &hv, NULL, e->a_cat, e->b_cat, 1.0f, dx, NULL, x->ws);
}

static fu_err fwd_linear(dag_exec_t *x, uint32_t slot, size_t i, const kern_tensor_t *in, kern_tensor_t *out)
{
    const dag_node *nd = N(x, i);
    enode *e = &x->nodes[i];
    eslot *s = &x->slots[slot];
    if (nd->adapter.method == DAG_ADAPTER_SALR)
        return fwd_salr(x, slot, i, in, out);
    if (!e->A)
        return base_linear(x, in, e->w, out);
    ebuf *h = NULL;
    FU_TRY(pool_get(x, (size_t)x->o.max_tokens * (size_t)e->r, &h));
    kern_tensor_t hv = bview(x, h, s->rows, e->r);
    bool gemv = x->cpu && s->rows <= DAG_GEMV_MAX_ROWS;
    fu_err rc = gemv ? base_linear(x, in, e->w, out) : FU_OK;
    if (rc == FU_OK)
        rc = kern_lora_forward(x->be, in, gemv ? NULL : e->w, e->A, e->B, e->scale, &hv, out);
    if (rc == FU_OK && x->nodes[i].run_bwd)
        x->hsave[(size_t)slot * x->n + i] = h;
    else
        h->refs = 0;
    return rc;
}

static fu_err fwd_node(dag_exec_t *x, uint32_t slot, size_t i)
{
    const dag_node *nd = N(x, i);
    enode *e = &x->nodes[i];
    eslot *s = &x->slots[slot];
    kern_device dev = x->be->device;
    ebuf *in[DAG_MAX_INPUTS] = {0};
    for (uint32_t k = 0; k < nd->n_inputs; k++) {
        in[k] = x->act[(size_t)slot * x->n + nd->inputs[k]];
        if (!in[k])
            return FU_EINVAL; /* a cut input was not given */
    }
    uint32_t rows = rows_of(x, s, i);
    size_t w = node_width(x, i);
    ebuf *ob = NULL;
    if (nd->op != DAG_OP_CROSS_ENTROPY && nd->op != DAG_OP_SAMPLE) {
        FU_TRY(pool_get(x, (size_t)x->o.max_tokens * w, &ob));
        ob->refs = refs_for(x, i);
        if (ob->refs <= 0)
            ob->refs = 1;
        x->act[(size_t)slot * x->n + i] = ob;
    }
    kern_tensor_t out = ob ? bview(x, ob, rows, (int64_t)w) : tv2(NULL, 0, 0, dev);
    fu_err rc = FU_OK;
    switch (nd->op) {
    case DAG_OP_EMBEDDING: {
        if (!s->has_tokens)
            return FU_EINVAL;
        kern_tensor_t ids = tv1(s->tokens->data, KERN_I32, rows, dev);
        rc = kern_embedding_forward(x->be, &ids, e->w, &out);
        break;
    }
    case DAG_OP_RMSNORM: {
        kern_tensor_t a = bview(x, in[0], rows, nd->dim_in);
        rc = kern_rmsnorm_forward(x->be, &a, e->w, nd->eps, &out);
        break;
    }
    case DAG_OP_LINEAR: {
        kern_tensor_t a = bview(x, in[0], rows, nd->dim_in);
        rc = fwd_linear(x, slot, i, &a, &out);
        break;
    }
    case DAG_OP_ROPE: {
        kern_tensor_t a = bview(x, in[0], rows, (int64_t)w);
        kern_tensor_t pos = tv1(s->pos->data, KERN_I32, rows, dev);
        rc = kern_rope_forward(x->be, &a, &pos, (int)nd->head_dim, nd->theta, &out);
        break;
    }
    case DAG_OP_ATTENTION: {
        int64_t kw = (int64_t)nd->n_kv_heads * nd->head_dim;
        kern_tensor_t q = bview(x, in[0], rows, (int64_t)w);
        kern_tensor_t k = bview(x, in[1], rows, kw);
        kern_tensor_t v = bview(x, in[2], rows, kw);
        kern_attn_params p = {.n_head = (int)nd->n_heads, .n_kv_head = (int)nd->n_kv_heads,
                              .head_dim = (int)nd->head_dim, .n_seq = (int)s->n_seq, .q_offset = 0, .scale = 0.0f};
        if (x->session) {
            kern_kvcache_t *c = x->session->caches[i];
            FU_TRY(ensure_ws_attn(x, &p, rows, kern_kvcache_len(c) + rows, false));
            rc = kern_kvcache_attend(c, &p, &q, &k, &v, &out, x->ws);
        } else {
            FU_TRY(ensure_ws_attn(x, &p, s->seq_len, s->seq_len, false));
            rc = kern_attn_forward(x->be, &p, &q, &k, &v, &out, x->ws);
        }
        break;
    }
    case DAG_OP_SILU_MUL: {
        kern_tensor_t a = bview(x, in[0], rows, (int64_t)w), b = bview(x, in[1], rows, (int64_t)w);
        rc = kern_silu_mul_forward(x->be, &a, &b, &out);
        break;
    }
    case DAG_OP_ADD: {
        kern_tensor_t a = bview(x, in[0], rows, (int64_t)w), b = bview(x, in[1], rows, (int64_t)w);
        rc = kern_add_forward(x->be, &a, &b, &out);
        break;
    }
    case DAG_OP_LM_HEAD: {
        uint32_t in_rows = s->rows;
        kern_tensor_t a = bview(x, in[0], in_rows, nd->dim_in);
        if (rows != in_rows) /* last row only */
            a = tv2((float *)in[0]->t->data + (size_t)(in_rows - 1) * nd->dim_in, 1, nd->dim_in, dev);
        rc = nd->adapter.method == DAG_ADAPTER_SALR ? fwd_salr(x, slot, i, &a, &out) : base_linear(x, &a, e->w, &out);
        break;
    }
    case DAG_OP_CROSS_ENTROPY: {
        if (!s->has_targets)
            return FU_EINVAL;
        kern_tensor_t lg = bview(x, in[0], rows, nd->dim_in);
        kern_tensor_t tg = tv1(s->targets->data, KERN_I32, rows, dev);
        rc = kern_xent_forward(x->be, &lg, &tg, DAG_IGNORE_INDEX, &s->loss, &s->n_valid);
        break;
    }
    case DAG_OP_SAMPLE: {
        uint32_t lr = rows_of(x, s, nd->inputs[0]);
        kern_tensor_t lg = tv2((float *)in[0]->t->data + (size_t)(lr - 1) * nd->dim_in, 1, nd->dim_in, dev);
        rc = kern_sample(x->be, &lg, &x->sp, x->sample_counter, &s->sampled);
        break;
    }
    default:
        rc = FU_EINVAL;
        break;
    }
    /* This node no longer needs its inputs (backward readers hold their own references). */
    for (uint32_t k = 0; k < nd->n_inputs; k++)
        act_unref(x, slot, nd->inputs[k]);
    return rc;
}

static size_t slot_saved_bytes(const dag_exec_t *x, uint32_t slot)
{
    const eslot *s = &x->slots[slot];
    size_t b = 0;
    for (size_t i = x->first; i < x->last; i++) {
        if (x->act[(size_t)slot * x->n + i])
            b += (size_t)rows_of(x, s, i) * node_width(x, i) * sizeof(float);
        if (x->hsave[(size_t)slot * x->n + i]) {
            const dag_node *nd = N(x, i);
            size_t rk = (size_t)(x->nodes[i].r + (nd->adapter.method == DAG_ADAPTER_SALR ? x->nodes[i].r2 : 0));
            b += (size_t)s->rows * rk * sizeof(float);
        }
    }
    return b;
}

fu_err dag_exec_forward(dag_exec_t *x, uint32_t slot)
{
    if (!x || slot >= x->o.n_slots)
        return FU_EINVAL;
    eslot *s = &x->slots[slot];
    if (s->rows == 0)
        return FU_EINVAL;
    slot_release(x, slot, true);
    /* Cut inputs: one reference per reader plus one for the slot. */
    for (size_t i = 0; i < x->first; i++) {
        ebuf *b = x->act[(size_t)slot * x->n + i];
        if (b)
            b->refs = input_refs_for(x, (uint32_t)i);
    }
    fu_err rc = FU_OK;
    for (size_t i = x->first; i < x->last && rc == FU_OK; i++) {
        if (x->o.yield)
            x->o.yield(x->o.yield_arg);
        rc = fwd_node(x, slot, i);
    }
    if (rc != FU_OK) {
        slot_release(x, slot, false);
        s->forwarded = false;
        /* Layers before the failure appended to their caches: rewind them to the session's length. */
        if (x->session)
            for (size_t i = x->first; i < x->last; i++)
                if (x->session->caches[i] && kern_kvcache_len(x->session->caches[i]) > x->session->len) {
                    fu_err trc = kern_kvcache_truncate(x->session->caches[i], x->session->len);
                    (void)trc; /* cannot fail: len is below the cache's length */
                }
        return rc;
    }
    if (x->session)
        x->session->len += s->rows;
    s->forwarded = true;
    if (x->o.training) {
        x->saved_now = slot_saved_bytes(x, slot);
        if (x->saved_now > x->saved_peak)
            x->saved_peak = x->saved_now;
    }
    return FU_OK;
}

static fu_err host_view(dag_exec_t *x, const ebuf *b, size_t n, const float **data)
{
    if (x->cpu) {
        *data = b->t->data;
        return FU_OK;
    }
    if (x->staging_cap < n) {
        x->staging = fu_realloc(x->staging, n * sizeof(float));
        x->staging_cap = n;
    }
    kern_tensor_t t = tv1(b->t->data, KERN_F32, (int64_t)n, x->be->device);
    FU_TRY(kern_tensor_copy_out(x->be, &t, x->staging, n * sizeof(float)));
    *data = x->staging;
    return FU_OK;
}

fu_err dag_exec_get_output(dag_exec_t *x, uint32_t slot, uint32_t node, const float **data, size_t *n_floats)
{
    if (!x || slot >= x->o.n_slots || !data || !n_floats || !in_range(x, node))
        return FU_EINVAL;
    ebuf *b = x->act[(size_t)slot * x->n + node];
    if (!b)
        return FU_ENOTFOUND;
    size_t n = (size_t)rows_of(x, &x->slots[slot], node) * node_width(x, node);
    FU_TRY(host_view(x, b, n, data));
    *n_floats = n;
    return FU_OK;
}

fu_err dag_exec_loss(const dag_exec_t *x, uint32_t slot, float *loss, int64_t *n_valid)
{
    if (!x || slot >= x->o.n_slots || !loss)
        return FU_EINVAL;
    bool has = false;
    for (size_t i = x->first; i < x->last; i++)
        has = has || N(x, i)->op == DAG_OP_CROSS_ENTROPY;
    if (!has)
        return FU_ENOTFOUND;
    *loss = x->slots[slot].loss;
    if (n_valid)
        *n_valid = x->slots[slot].n_valid;
    return FU_OK;
}

fu_err dag_exec_sampled(const dag_exec_t *x, uint32_t slot, int32_t *token)
{
    if (!x || slot >= x->o.n_slots || !token)
        return FU_EINVAL;
    *token = x->slots[slot].sampled;
    return FU_OK;
}

void dag_exec_set_sampling(dag_exec_t *x, const kern_sample_params *p, uint64_t counter)
{
    if (p)
        x->sp = *p;
    x->sample_counter = counter;
}

/* ---- backward ------------------------------------------------------------------------------- */

fu_err dag_exec_set_output_grad(dag_exec_t *x, uint32_t slot, uint32_t node, const float *data, size_t n_floats)
{
    if (!x || slot >= x->o.n_slots || !data || !in_range(x, node) || !x->nodes[node].cut_out)
        return FU_EINVAL;
    eslot *s = &x->slots[slot];
    size_t want = (size_t)s->rows * node_width(x, node);
    if (n_floats != want || !s->forwarded)
        return FU_EINVAL;
    buf_unref(&x->grad[node]);
    ebuf *b = NULL;
    FU_TRY(pool_get(x, (size_t)x->o.max_tokens * node_width(x, node), &b));
    kern_tensor_t t = tv1(b->t->data, KERN_F32, (int64_t)n_floats, x->be->device);
    fu_err rc = kern_tensor_copy_in(x->be, &t, data, n_floats * sizeof(float));
    if (rc != FU_OK) {
        b->refs = 0;
        return rc;
    }
    x->grad[node] = b;
    return FU_OK;
}

/* Where to write an overwriting dX for input `src`: straight into its gradient when it has none
 * yet, else into a temporary that grad_finish adds. */
static fu_err grad_target(dag_exec_t *x, uint32_t src, uint32_t rows, kern_tensor_t *dst, ebuf **tmp)
{
    size_t w = node_width(x, src);
    *tmp = NULL;
    if (!x->grad[src]) {
        FU_TRY(pool_get(x, (size_t)x->o.max_tokens * w, &x->grad[src]));
        *dst = bview(x, x->grad[src], rows, (int64_t)w);
        return FU_OK;
    }
    FU_TRY(pool_get(x, (size_t)x->o.max_tokens * w, tmp));
    *dst = bview(x, *tmp, rows, (int64_t)w);
    return FU_OK;
}

/* Makes src's gradient buffer private before it is added to (it may be shared after an add). */
static fu_err grad_own(dag_exec_t *x, uint32_t src, uint32_t rows)
{
    ebuf *g = x->grad[src];
    if (g->refs <= 1)
        return FU_OK;
    size_t w = node_width(x, src);
    ebuf *c = NULL;
    FU_TRY(pool_get(x, (size_t)x->o.max_tokens * w, &c));
    kern_tensor_t a = bview(x, g, rows, (int64_t)w), b = bview(x, c, rows, (int64_t)w);
    fu_err rc = kern_tensor_copy(x->be, &a, &b);
    if (rc != FU_OK) {
        c->refs = 0;
        return rc;
    }
    g->refs--;
    x->grad[src] = c;
    return FU_OK;
}

static fu_err grad_add(dag_exec_t *x, uint32_t src, uint32_t rows, const kern_tensor_t *d)
{
    FU_TRY(grad_own(x, src, rows));
    kern_tensor_t g = bview(x, x->grad[src], rows, (int64_t)node_width(x, src));
    return kern_axpy(x->be, 1.0f, d, &g);
}

static fu_err grad_finish(dag_exec_t *x, uint32_t src, uint32_t rows, ebuf **tmp, const kern_tensor_t *dst)
{
    if (!*tmp)
        return FU_OK;
    fu_err rc = grad_add(x, src, rows, dst);
    (*tmp)->refs = 0;
    *tmp = NULL;
    return rc;
}

static fu_err bwd_linear(dag_exec_t *x, uint32_t slot, size_t j, const kern_tensor_t *dy)
{
    const dag_node *nd = N(x, j);
    enode *e = &x->nodes[j];
    eslot *s = &x->slots[slot];
    uint32_t src = nd->inputs[0];
    bool want_dx = x->need_grad[src];
    kern_tensor_t dx;
    ebuf *tmp = NULL;
    if (want_dx)
        FU_TRY(grad_target(x, src, s->rows, &dx, &tmp));
    fu_err rc = FU_OK;
    ebuf *h = x->hsave[(size_t)slot * x->n + j];
    if (nd->adapter.method == DAG_ADAPTER_SALR) {
        int64_t rt = e->r + e->r2;
        if (!h)
            return FU_EINVAL;
        kern_tensor_t hv = bview(x, h, s->rows, rt);
        if (want_dx) /* dX = dY·W_sparse, then + (dY·b_cat)·a_cat through both adapters. */
            rc = bwd_salr_dx(x, slot, j, dy, &dx);
        if (rc == FU_OK && e->r > 0 && e->dB) {
            /* dB1 += s1·dYᵀ·h[:, :r1] (the trained adapter's columns of h). */
            kern_tensor_t h1 = hv;
            h1.shape[1] = e->r;
            rc = kern_gemm(x->be, true, false, e->scale, dy, &h1, 1.0f, e->dB);
        }
    } else if (!e->A) {
        if (want_dx)
            rc = kern_linear_backward(x->be, dy, NULL, e->w, &dx, NULL);
    } else {
        if (!h)
            return FU_EINVAL;
        kern_tensor_t hv = bview(x, h, s->rows, e->r);
        FU_TRY(ensure_ws_rank(x, s->rows, e->r));
        if (e->train_a) {
            ebuf *xb = x->act[(size_t)slot * x->n + src];
            if (!xb)
                return FU_EINVAL;
            kern_tensor_t xv = bview(x, xb, s->rows, nd->dim_in);
            rc = kern_lora_backward(x->be, dy, &xv, &hv, e->w, e->A, e->B, e->scale, want_dx ? &dx : NULL, e->dA,
                                    e->dB, x->ws);
        } else {
            rc = kern_lorafa_backward(x->be, dy, &hv, e->w, e->A, e->B, e->scale, want_dx ? &dx : NULL, e->dB, x->ws);
        }
    }
    if (rc == FU_OK && want_dx)
        rc = grad_finish(x, src, s->rows, &tmp, &dx);
    if (tmp)
        tmp->refs = 0;
    return rc;
}

static fu_err bwd_node(dag_exec_t *x, uint32_t slot, size_t j, float loss_scale)
{
    const dag_node *nd = N(x, j);
    enode *e = &x->nodes[j];
    eslot *s = &x->slots[slot];
    kern_device dev = x->be->device;
    ebuf *gb = x->grad[j];
    if (nd->op != DAG_OP_CROSS_ENTROPY && !gb)
        return FU_OK; /* no gradient reached this node */
    uint32_t rows = rows_of(x, s, j);
    size_t w = node_width(x, j);
    kern_tensor_t dy = gb ? bview(x, gb, rows, (int64_t)w) : tv2(NULL, 0, 0, dev);
    ebuf *in[DAG_MAX_INPUTS] = {0};
    for (uint32_t k = 0; k < nd->n_inputs; k++)
        in[k] = x->act[(size_t)slot * x->n + nd->inputs[k]];
    fu_err rc = FU_OK;
    switch (nd->op) {
    case DAG_OP_CROSS_ENTROPY: {
        uint32_t src = nd->inputs[0];
        if (!in[0] || !s->has_targets)
            return FU_EINVAL;
        kern_tensor_t lg = bview(x, in[0], rows, nd->dim_in);
        kern_tensor_t tg = tv1(s->targets->data, KERN_I32, rows, dev);
        rc = kern_xent_backward(x->be, &lg, &tg, DAG_IGNORE_INDEX, loss_scale, &lg);
        if (rc == FU_OK) {
            if (x->grad[src] || !in_range(x, src)) {
                kern_tensor_t dx;
                ebuf *tmp = NULL;
                rc = grad_target(x, src, rows, &dx, &tmp);
                if (rc == FU_OK && !tmp)
                    rc = kern_tensor_copy(x->be, &lg, &dx);
                else if (rc == FU_OK)
                    rc = grad_finish(x, src, rows, &tmp, &lg);
                if (tmp)
                    tmp->refs = 0;
            } else {
                /* The logits' buffer now holds their gradient (no [n, vocab] copy). */
                in[0]->refs++;
                x->grad[src] = in[0];
            }
        }
        break;
    }
    case DAG_OP_LM_HEAD: {
        uint32_t src = nd->inputs[0];
        if (!x->need_grad[src])
            break;
        kern_tensor_t dx;
        ebuf *tmp = NULL;
        FU_TRY(grad_target(x, src, s->rows, &dx, &tmp));
        if (nd->adapter.method == DAG_ADAPTER_SALR)
            rc = bwd_salr_dx(x, slot, j, &dy, &dx);
        else
            rc = kern_linear_backward(x->be, &dy, NULL, e->w, &dx, NULL);
        if (rc == FU_OK)
            rc = grad_finish(x, src, s->rows, &tmp, &dx);
        if (tmp)
            tmp->refs = 0;
        break;
    }
    case DAG_OP_LINEAR:
        rc = bwd_linear(x, slot, j, &dy);
        break;
    case DAG_OP_RMSNORM: {
        uint32_t src = nd->inputs[0];
        if (!x->need_grad[src])
            break;
        if (!in[0])
            return FU_EINVAL;
        kern_tensor_t xv = bview(x, in[0], rows, nd->dim_in), dx;
        ebuf *tmp = NULL;
        FU_TRY(grad_target(x, src, rows, &dx, &tmp));
        rc = kern_rmsnorm_backward(x->be, &dy, &xv, e->w, nd->eps, &dx, NULL);
        if (rc == FU_OK)
            rc = grad_finish(x, src, rows, &tmp, &dx);
        if (tmp)
            tmp->refs = 0;
        break;
    }
    case DAG_OP_ROPE: {
        uint32_t src = nd->inputs[0];
        if (!x->need_grad[src])
            break;
        kern_tensor_t pos = tv1(s->pos->data, KERN_I32, rows, dev), dx;
        ebuf *tmp = NULL;
        FU_TRY(grad_target(x, src, rows, &dx, &tmp));
        rc = kern_rope_backward(x->be, &dy, &pos, (int)nd->head_dim, nd->theta, &dx);
        if (rc == FU_OK)
            rc = grad_finish(x, src, rows, &tmp, &dx);
        if (tmp)
            tmp->refs = 0;
        break;
    }
    case DAG_OP_ATTENTION: {
        if (!in[0] || !in[1] || !in[2])
            return FU_EINVAL;
        int64_t kw = (int64_t)nd->n_kv_heads * nd->head_dim;
        kern_tensor_t q = bview(x, in[0], rows, (int64_t)w), k = bview(x, in[1], rows, kw),
                      v = bview(x, in[2], rows, kw);
        kern_tensor_t d[3];
        ebuf *tmp[3] = {NULL, NULL, NULL};
        ebuf *scratch[3] = {NULL, NULL, NULL};
        for (uint32_t a = 0; a < 3 && rc == FU_OK; a++) {
            uint32_t src = nd->inputs[a];
            if (x->need_grad[src]) {
                rc = grad_target(x, src, rows, &d[a], &tmp[a]);
            } else {
                rc = pool_get(x, (size_t)x->o.max_tokens * node_width(x, src), &scratch[a]);
                if (rc == FU_OK)
                    d[a] = bview(x, scratch[a], rows, (int64_t)node_width(x, src));
            }
        }
        kern_attn_params p = {.n_head = (int)nd->n_heads, .n_kv_head = (int)nd->n_kv_heads,
                              .head_dim = (int)nd->head_dim, .n_seq = (int)s->n_seq, .q_offset = 0, .scale = 0.0f};
        if (rc == FU_OK)
            rc = ensure_ws_attn(x, &p, s->seq_len, s->seq_len, true);
        if (rc == FU_OK)
            rc = kern_attn_backward(x->be, &p, &q, &k, &v, &dy, &d[0], &d[1], &d[2], x->ws);
        for (uint32_t a = 0; a < 3; a++) {
            if (rc == FU_OK && x->need_grad[nd->inputs[a]])
                rc = grad_finish(x, nd->inputs[a], rows, &tmp[a], &d[a]);
            if (tmp[a])
                tmp[a]->refs = 0;
            if (scratch[a])
                scratch[a]->refs = 0;
        }
        break;
    }
    case DAG_OP_SILU_MUL: {
        if (!in[0] || !in[1])
            return FU_EINVAL;
        kern_tensor_t g = bview(x, in[0], rows, (int64_t)w), u = bview(x, in[1], rows, (int64_t)w);
        kern_tensor_t d[2];
        ebuf *tmp[2] = {NULL, NULL};
        ebuf *scratch[2] = {NULL, NULL};
        for (uint32_t a = 0; a < 2 && rc == FU_OK; a++) {
            uint32_t src = nd->inputs[a];
            if (x->need_grad[src]) {
                rc = grad_target(x, src, rows, &d[a], &tmp[a]);
            } else {
                rc = pool_get(x, (size_t)x->o.max_tokens * w, &scratch[a]);
                if (rc == FU_OK)
                    d[a] = bview(x, scratch[a], rows, (int64_t)w);
            }
        }
        if (rc == FU_OK)
            rc = kern_silu_mul_backward(x->be, &dy, &g, &u, &d[0], &d[1]);
        for (uint32_t a = 0; a < 2; a++) {
            if (rc == FU_OK && x->need_grad[nd->inputs[a]])
                rc = grad_finish(x, nd->inputs[a], rows, &tmp[a], &d[a]);
            if (tmp[a])
                tmp[a]->refs = 0;
            if (scratch[a])
                scratch[a]->refs = 0;
        }
        break;
    }
    case DAG_OP_ADD:
        for (uint32_t a = 0; a < 2 && rc == FU_OK; a++) {
            uint32_t src = nd->inputs[a];
            if (!x->need_grad[src])
                continue;
            if (!x->grad[src]) {
                x->grad[src] = gb; /* the identity: share the buffer */
                gb->refs++;
            } else {
                rc = grad_add(x, src, rows, &dy);
            }
        }
        break;
    case DAG_OP_EMBEDDING:
    case DAG_OP_SAMPLE:
    default:
        break;
    }
    /* Done with this node: its gradient and the activations its backward read. */
    buf_unref(&x->grad[j]);
    for (uint32_t k = 0; k < nd->n_inputs; k++)
        if (e->save_mask & (1u << k))
            act_unref(x, slot, nd->inputs[k]);
    ebuf **h = &x->hsave[(size_t)slot * x->n + j];
    if (*h) {
        (*h)->refs = 0;
        *h = NULL;
    }
    return rc;
}

fu_err dag_exec_backward(dag_exec_t *x, uint32_t slot, float loss_scale)
{
    if (!x || slot >= x->o.n_slots || !x->o.training)
        return FU_EINVAL;
    eslot *s = &x->slots[slot];
    if (!s->forwarded)
        return FU_EINVAL;
    /* Gradients of cut inputs from an earlier backward are dropped now. */
    for (size_t i = 0; i < x->first; i++)
        buf_unref(&x->grad[i]);
    x->bwd_rows = s->rows;
    fu_err rc = FU_OK;
    for (size_t j = x->last; j-- > x->first && rc == FU_OK;) {
        if (!x->nodes[j].run_bwd) {
            buf_unref(&x->grad[j]);
            continue;
        }
        if (x->o.yield)
            x->o.yield(x->o.yield_arg);
        rc = bwd_node(x, slot, j, loss_scale);
    }
    for (size_t j = x->first; j < x->last; j++)
        buf_unref(&x->grad[j]);
    slot_release(x, slot, false);
    s->forwarded = false;
    if (rc != FU_OK)
        for (size_t i = 0; i < x->first; i++)
            buf_unref(&x->grad[i]);
    return rc;
}

fu_err dag_exec_get_input_grad(dag_exec_t *x, uint32_t node, const float **data, size_t *n_floats)
{
    if (!x || !data || !n_floats || node >= x->first)
        return FU_EINVAL;
    *data = NULL;
    *n_floats = 0;
    ebuf *b = x->grad[node];
    if (!b)
        return FU_OK;
    size_t n = (size_t)x->bwd_rows * node_width(x, node);
    FU_TRY(host_view(x, b, n, data));
    *n_floats = n;
    return FU_OK;
}

/* ---- optimizer ------------------------------------------------------------------------------ */

fu_err dag_exec_step(dag_exec_t *x, const kern_adamw_params *p)
{
    if (!x || !p || !x->o.training)
        return FU_EINVAL;
    x->step++;
    for (size_t i = x->first; i < x->last; i++) {
        enode *e = &x->nodes[i];
        if (!e->dB)
            continue;
        if (x->o.lorafa_correction && !e->train_a && N(x, i)->adapter.method == DAG_ADAPTER_LORA_FA)
            FU_TRY(kern_lorafa_correct_grad(x->be, e->A, e->scale, e->dB));
        FU_TRY(kern_adamw_step(x->be, e->B, e->dB, e->mB, e->vB, p, x->step));
        FU_TRY(kern_tensor_zero(x->be, e->dB));
        if (e->dA) {
            FU_TRY(kern_adamw_step(x->be, e->A, e->dA, e->mA, e->vA, p, x->step));
            FU_TRY(kern_tensor_zero(x->be, e->dA));
        }
        const dag_node *nd = N(x, i);
        if (nd->adapter.method == DAG_ADAPTER_SALR)
            FU_TRY(salr_refresh_b1(x, e));
    }
    return FU_OK;
}

fu_err dag_exec_adapter(dag_exec_t *x, uint32_t node, kern_tensor_t **A, kern_tensor_t **B, kern_tensor_t **dA,
                        kern_tensor_t **dB)
{
    if (!x || !in_range(x, node) || !x->nodes[node].A)
        return FU_EINVAL;
    enode *e = &x->nodes[node];
    if (A)
        *A = e->A;
    if (B)
        *B = e->B;
    if (dA)
        *dA = e->dA;
    if (dB)
        *dB = e->dB;
    return FU_OK;
}

fu_err dag_exec_adapter_changed(dag_exec_t *x, uint32_t node)
{
    if (!x || !in_range(x, node) || !x->nodes[node].A)
        return FU_EINVAL;
    if (N(x, node)->adapter.method == DAG_ADAPTER_SALR)
        return salr_rebuild(x, N(x, node), &x->nodes[node]);
    return FU_OK;
}

int64_t dag_exec_steps_done(const dag_exec_t *x)
{
    return x ? x->step : 0;
}

size_t dag_exec_saved_bytes(const dag_exec_t *x)
{
    return x ? x->saved_now : 0;
}

size_t dag_exec_saved_bytes_peak(const dag_exec_t *x)
{
    return x ? x->saved_peak : 0;
}

size_t dag_exec_trainable_params(const dag_exec_t *x)
{
    size_t n = 0;
    for (size_t i = x->first; i < x->last; i++) {
        const enode *e = &x->nodes[i];
        if (e->dB)
            n += (size_t)kern_tensor_numel(e->B);
        if (e->dA)
            n += (size_t)kern_tensor_numel(e->A);
    }
    return n;
}

/* ---- sessions ------------------------------------------------------------------------------- */

fu_err dag_exec_session_new(dag_exec_t *x, dag_session_t **out)
{
    if (!x || !out || x->o.training)
        return FU_EINVAL;
    dag_session_t *s = fu_calloc(1, sizeof *s);
    s->x = x;
    s->caches = fu_calloc(x->n, sizeof *s->caches);
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        if (nd->op != DAG_OP_ATTENTION)
            continue;
        fu_err rc = kern_kvcache_new(x->be, KERN_F32, (int)nd->n_kv_heads, (int)nd->head_dim, x->o.max_context, &s->caches[i]);
        if (rc != FU_OK) {
            dag_exec_session_destroy(&s);
            return rc;
        }
    }
    *out = s;
    return FU_OK;
}

void dag_exec_session_destroy(dag_session_t **s_p)
{
    if (!s_p || !*s_p)
        return;
    dag_session_t *s = *s_p;
    if (s->x && s->x->session == s)
        s->x->session = NULL;
    for (size_t i = 0; s->x && i < s->x->n; i++)
        kern_kvcache_destroy(&s->caches[i]);
    free(s->caches);
    free(s);
    *s_p = NULL;
}

void dag_exec_session_use(dag_exec_t *x, dag_session_t *s)
{
    if (x)
        x->session = s;
}

int64_t dag_session_len(const dag_session_t *s)
{
    return s ? s->len : 0;
}

fu_err dag_session_truncate(dag_session_t *s, int64_t len)
{
    if (!s || len < 0 || len > s->len)
        return FU_EINVAL;
    for (size_t i = 0; i < s->x->n; i++)
        if (s->caches[i])
            FU_TRY(kern_kvcache_truncate(s->caches[i], len));
    s->len = len;
    return FU_OK;
}
