/* dag_exec_io: the executor's weights, adapters and checkpoints: loading base weights (dense,
 * tied, and SALR bitmap-encoded with their residual adapters), creating and rebuilding adapters,
 * and reading and writing PEFT adapters and training state (adapter, AdamW moments, step). */
#include "dag_exec.h"
#include "dag_exec_internal.h"
#include "dag_peft.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fu_alloc.h"
#include "kern_bitmap.h"
#include "kern_lora.h"
#include "kern_salr.h"

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
                       uint64_t d1, kern_tensor_t **out, fu_errmsg *em);

/* A 2-D frozen weight into e->w: kept bf16/f16, or int8 with its row scales (e->qscale), as the file
 * has it (zero-copy over the mapping) when the backend multiplies such weights and the executor was
 * not asked to widen them; else as load_f32 (an int8 weight dequantized). */
static fu_err load_weight(dag_exec_t *x, const fu_safetensors *st, const char *name, uint64_t d0, uint64_t d1,
                          enode *e, fu_errmsg *em)
{
    const fu_st_tensor *t = fu_safetensors_get(st, name);
    kern_dtype kd = !t                       ? KERN_F32
                    : t->dtype == FU_ST_BF16 ? KERN_BF16
                    : t->dtype == FU_ST_F16  ? KERN_F16
                    : t->dtype == FU_ST_I8   ? KERN_I8
                                             : KERN_F32;
    if (kd == KERN_F32 || x->o.widen_weights || !x->cpu || !((x->be->weight_dtypes >> kd) & 1u) ||
        (uintptr_t)t->data % kern_dtype_size(kd) != 0 || t->ndim != 2 || t->shape[0] != d0 || t->shape[1] != d1)
        return load_f32(x, st, name, 2, d0, d1, &e->w, em);
    if (kd == KERN_I8) {
        e->qscale = fu_malloc((size_t)(d0 ? d0 : 1) * sizeof *e->qscale);
        FU_TRY(fu_safetensors_qscale(st, t, e->qscale, em));
    }
    int64_t s[2] = {(int64_t)d0, (int64_t)d1};
    kern_tensor_t *k = fu_calloc(1, sizeof *k);
    fu_err rc = kern_tensor_wrap(k, (void *)t->data, kd, 2, s, x->be->device);
    if (rc != FU_OK) {
        free(k);
        return fu_errmsg_set(em, rc, "cannot use the %s weight '%s'", fu_st_dtype_name(t->dtype), name);
    }
    k->qscale = e->qscale;
    e->w = k;
    return FU_OK;
}

static fu_err load_f32(dag_exec_t *x, const fu_safetensors *st, const char *name, size_t ndim, uint64_t d0,
                       uint64_t d1, kern_tensor_t **out, fu_errmsg *em)
{
    uint64_t shape[2] = {d0, d1};
    const fu_st_tensor *t = NULL;
    FU_TRY(fu_safetensors_expect(st, name, ndim, shape, &t, em));
    if (!fu_st_dtype_is_float(t->dtype) && !(t->dtype == FU_ST_I8 && ndim == 2))
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
        rc = fu_safetensors_read_f32(st, name, ndim, shape, k->data, t->nelem, em);
    } else {
        float *host = fu_malloc(t->nelem * sizeof(float));
        rc = fu_safetensors_read_f32(st, name, ndim, shape, host, t->nelem, em);
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
fu_err dagx_salr_rebuild(dag_exec_t *x, const dag_node *nd, enode *e)
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
    fu_err rc = kern_sparse_weight_make(x->be, &e->bm, nd->dim_out, nd->dim_in, &e->sw, &e->dev_bm);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "cannot make the sparse weight '%s' on %s", name, x->be->name);
    e->r2 = nd->adapter.res_rank;
    FU_TRY(load_f32(x, st, nd->params[1], 2, nd->adapter.res_rank, nd->dim_in, &e->A2, em));
    FU_TRY(load_f32(x, st, nd->params[2], 2, nd->dim_out, nd->adapter.res_rank, &e->B2, em));
    return FU_OK;
}

/* x->ones: max_tokens rows of 1, the left factor of the rank-1 product that adds a bias to every row. */
static fu_err make_ones(dag_exec_t *x)
{
    if (x->ones)
        return FU_OK;
    const int64_t n = x->o.max_tokens;
    FU_TRY(new_tensor(x, 2, n, 1, false, &x->ones));
    float *host = x->cpu ? x->ones->data : fu_malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        host[i] = 1.0f;
    fu_err rc = x->cpu ? FU_OK : kern_tensor_copy_in(x->be, x->ones, host, (size_t)n * sizeof(float));
    if (!x->cpu)
        free(host);
    return rc;
}

fu_err dag_exec_load_weights(dag_exec_t *x, const fu_safetensors *st, fu_errmsg *em)
{
    if (!x || !st)
        return FU_EINVAL;
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        enode *e = &x->nodes[i];
        dagx_free_node(e);
        memset(&e->w, 0, sizeof e->w);
        e->w_shared = false;
        switch (nd->op) {
        case DAG_OP_EMBEDDING:
            FU_TRY(load_weight(x, st, nd->params[0], nd->dim_in, nd->dim_out, e, em));
            break;
        case DAG_OP_RMSNORM:
            FU_TRY(load_f32(x, st, nd->params[0], 1, nd->dim_in, 1, &e->w, em));
            break;
        case DAG_OP_HEAD_NORM:
            FU_TRY(load_f32(x, st, nd->params[0], 1, nd->head_dim, 1, &e->w, em));
            break;
        case DAG_OP_LM_HEAD: {
            if (nd->adapter.method == DAG_ADAPTER_SALR) {
                /* A pruned head: sparse weight and frozen residual as one SALR product, nothing trained. */
                FU_TRY(load_salr_weight(x, st, nd, e, em));
                e->r = 0;
                e->scale = 0.0f;
                FU_TRY(dagx_salr_rebuild(x, nd, e));
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
                FU_TRY(load_weight(x, st, nd->params[0], nd->dim_out, nd->dim_in, e, em));
            break;
        }
        case DAG_OP_LINEAR:
            if (nd->adapter.method == DAG_ADAPTER_SALR)
                FU_TRY(load_salr_weight(x, st, nd, e, em));
            else
                FU_TRY(load_weight(x, st, nd->params[0], nd->dim_out, nd->dim_in, e, em));
            if (nd->adapter.method != DAG_ADAPTER_NONE) {
                fu_err rc = make_adapter(x, nd, e);
                if (rc != FU_OK)
                    return fu_errmsg_set(em, rc, "cannot allocate the adapter of node %zu", i);
            }
            if (nd->adapter.method == DAG_ADAPTER_SALR)
                FU_TRY(dagx_salr_rebuild(x, nd, e));
            if (nd->flags & DAG_NODE_BIAS) {
                FU_TRY(load_f32(x, st, nd->params[nd->n_params - 1], 1, nd->dim_out, 1, &e->bias, em));
                FU_TRY(make_ones(x));
            }
            break;
        default:
            break;
        }
    }
    return FU_OK;
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

/* One adapter tensor of a node, as adapter and checkpoint files name it. */
typedef struct {
    char name[DAG_PEFT_NAME_MAX];
    kern_tensor_t *t;
} adapter_tensor;

/* The adapter tensors of node nd (e->A set) with their names (dag_peft_node_tensors): lora_A and
 * lora_B, then with_state AdamW's moments (those e has). Returns how many were put in out. */
static size_t adapter_tensors(const dag_node *nd, const enode *e, bool with_state,
                              adapter_tensor out[DAG_PEFT_PER_NODE])
{
    dag_peft_tensor pt[DAG_PEFT_PER_NODE];
    size_t n = dag_peft_node_tensors(nd, with_state && e->mB, pt);
    kern_tensor_t *ts[DAG_PEFT_PER_NODE] = {e->A, e->B};
    size_t k = 2;
    if (n > 2 && e->mA) {
        ts[k++] = e->mA;
        ts[k++] = e->vA;
    }
    if (n > 2) {
        ts[k++] = e->mB;
        ts[k++] = e->vB;
    }
    for (size_t i = 0; i < n && i < k; i++) {
        memcpy(out[i].name, pt[i].name, sizeof out[i].name);
        out[i].t = ts[i];
    }
    return n < k ? n : k;
}

/* Reads the range's adapters from st, with_state also AdamW's moments, and zeroes the optimizer
 * state not read (the gradients; the moments without with_state). */
static fu_err read_adapters(dag_exec_t *x, const fu_safetensors *st, bool with_state, fu_errmsg *em)
{
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        enode *e = &x->nodes[i];
        if (!e->A)
            continue;
        adapter_tensor at[DAG_PEFT_PER_NODE];
        size_t n = adapter_tensors(nd, e, with_state, at);
        for (size_t k = 0; k < n; k++)
            FU_TRY(read_into(x, st, at[k].name, at[k].t, em));
        kern_tensor_t *zero[] = {e->dA, e->dB, with_state ? NULL : e->mA, with_state ? NULL : e->vA,
                                 with_state ? NULL : e->mB, with_state ? NULL : e->vB};
        for (size_t k = 0; k < sizeof zero / sizeof zero[0]; k++)
            if (zero[k])
                FU_TRY(kern_tensor_zero(x->be, zero[k]));
        if (nd->adapter.method == DAG_ADAPTER_SALR)
            FU_TRY(dagx_salr_rebuild(x, nd, e));
    }
    return FU_OK;
}

fu_err dag_exec_load_adapter(dag_exec_t *x, const fu_safetensors *st, fu_errmsg *em)
{
    if (!x || !st)
        return FU_EINVAL;
    FU_TRY(read_adapters(x, st, false, em));
    x->step = 0;
    return FU_OK;
}

/* ---- saving --------------------------------------------------------------------------------- */

typedef struct {
    fu_st_tensor *t; /* tensors to write */
    float **host;    /* host copies to free */
    char **names;    /* owned copies of the names */
    size_t n, cap;   /* entries used and allocated */
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
        adapter_tensor at[DAG_PEFT_PER_NODE];
        size_t n = adapter_tensors(nd, e, with_state, at);
        for (size_t k = 0; k < n; k++)
            FU_TRY(tlist_add(x, l, at[k].name, at[k].t));
    }
    return FU_OK;
}

fu_err dag_exec_save_adapter(const dag_exec_t *x, const char *dir, const char *base_model, fu_errmsg *em)
{
    return dag_exec_save_adapters(&x, 1, dir, base_model, em);
}

fu_err dag_exec_save_adapters(const dag_exec_t *const *xs, size_t n, const char *dir, const char *base_model,
                              fu_errmsg *em)
{
    if (!xs || !n || !dir)
        return FU_EINVAL;
    for (size_t k = 0; k < n; k++)
        if (!xs[k] || xs[k]->g != xs[0]->g)
            return FU_EINVAL;
    FU_TRY(fu_mkdir_p(dir, 0755, em));
    tlist l = {0};
    fu_err rc = FU_OK;
    for (size_t k = 0; k < n && rc == FU_OK; k++)
        rc = collect(xs[k], &l, false);
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
    for (size_t k = 0; k < n; k++)
        for (size_t i = xs[k]->first; i < xs[k]->last; i++) {
            const dag_node *nd = N(xs[k], i);
            if (xs[k]->nodes[i].A) {
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

/* The checkpoint's tensors and metadata: "adam_t" the optimizer's step count, "step" the job's step
 * after which it was taken (when step >= 0). */
static fu_err save_state(const dag_exec_t *x, const char *path, int64_t step, uint8_t **out, size_t *len,
                         fu_errmsg *em)
{
    tlist l = {0};
    fu_err rc = collect(x, &l, true);
    char t[32], st[32];
    snprintf(t, sizeof t, "%" PRId64, x->step);
    snprintf(st, sizeof st, "%" PRId64, step);
    const char *meta[] = {"adam_t", t, "step", st};
    size_t n_meta = step >= 0 ? 2 : 1;
    if (rc == FU_OK)
        rc = path ? fu_safetensors_write(path, l.t, l.n, meta, n_meta, NULL, NULL, em)
                  : fu_safetensors_serialize(l.t, l.n, meta, n_meta, NULL, NULL, out, len, em);
    tlist_free(&l);
    return rc;
}

fu_err dag_exec_save_state(const dag_exec_t *x, const char *path, fu_errmsg *em)
{
    if (!x || !path)
        return FU_EINVAL;
    return save_state(x, path, -1, NULL, NULL, em);
}

fu_err dag_exec_state_serialize(const dag_exec_t *x, uint64_t step, uint8_t **out, size_t *len, fu_errmsg *em)
{
    if (!x || !out || !len || step > INT64_MAX)
        return FU_EINVAL;
    return save_state(x, NULL, (int64_t)step, out, len, em);
}

fu_err dag_exec_load_state(dag_exec_t *x, const fu_safetensors *st, fu_errmsg *em)
{
    if (!x || !st)
        return FU_EINVAL;
    const char *step = fu_safetensors_metadata(st, "adam_t");
    char *end = NULL;
    long long sv = step ? strtoll(step, &end, 10) : -1;
    if (!step || !end || *end || sv < 0)
        return fu_errmsg_set(em, FU_EPROTO, "checkpoint has no valid adam_t metadata");
    FU_TRY(read_adapters(x, st, true, em));
    x->step = sv;
    return FU_OK;
}
