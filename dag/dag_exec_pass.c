/* dag_exec_pass: the executor's forward and backward passes over its node range: activation and
 * gradient references, the kernel workspace, one forward and one backward per op, the outputs, loss
 * and sampled token of a forward, output gradients in and cut-input gradients out. */
#include "dag_exec.h"
#include "dag_exec_internal.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_kvcache.h"
#include "kern_lora.h"

#define DAG_WS_SLACK          (256u << 10) /* workspace bytes beyond the computed needs */
#define DAG_GEMV_MAX_ROWS     2            /* rows up to which CPU linears use sgemv */

/* ---- buffer references ---------------------------------------------------------------------- */

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
    /* Inference without logits_all: only the last row of each session (or of the single sequence)
     * reaches lm_head. */
    if (!x->o.training && !x->o.logits_all && (s->n_sess || s->n_seq == 1))
        return s->n_sess ? s->n_sess : 1;
    return s->rows;
}

/* lm_head's input in a batch of sessions: the last row of each, gathered into a pool buffer (*held,
 * released by the caller) unless every session has one row. */
static fu_err head_input(dag_exec_t *x, const eslot *s, const dag_node *nd, const ebuf *in, ebuf **held,
                         kern_tensor_t *a)
{
    kern_device dev = x->be->device;
    *held = NULL;
    if (s->n_sess <= 1 || head_rows(x, s) == s->rows) {
        *a = s->rows == head_rows(x, s) ? bview(x, in, s->rows, nd->dim_in)
                                        : tv2((float *)in->t->data + (size_t)(s->rows - 1) * nd->dim_in, 1,
                                              nd->dim_in, dev);
        return FU_OK;
    }
    FU_TRY(dagx_pool_get(x, (size_t)s->n_sess * nd->dim_in, held));
    size_t end = 0;
    for (uint32_t k = 0; k < s->n_sess; k++) {
        end += s->sess_rows[k];
        kern_tensor_t src = tv2((float *)in->t->data + (end - 1) * nd->dim_in, 1, nd->dim_in, dev);
        kern_tensor_t dst = tv2((float *)(*held)->t->data + (size_t)k * nd->dim_in, 1, nd->dim_in, dev);
        FU_TRY(kern_tensor_copy(x->be, &src, &dst));
    }
    *a = bview(x, *held, s->n_sess, nd->dim_in);
    return FU_OK;
}

/* The sample node in a batch: each session draws from its row of the logits (its last row with
 * logits_all) with its own parameters and counter. */
static fu_err sample_batch(dag_exec_t *x, const eslot *s, const dag_node *nd, const ebuf *lg, uint32_t lg_rows)
{
    size_t end = 0;
    for (uint32_t k = 0; k < s->n_sess; k++) {
        end += s->sess_rows[k];
        size_t row = lg_rows == s->rows ? end - 1 : k;
        kern_tensor_t l = tv2((float *)lg->t->data + row * nd->dim_in, 1, nd->dim_in, x->be->device);
        FU_TRY(kern_sample(x->be, &l, &s->sess[k]->sp, s->sess[k]->counter, &s->sess[k]->sampled));
    }
    return FU_OK;
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
    if (!x->cpu || w->dtype != KERN_F32 || rows > DAG_GEMV_MAX_ROWS || w->ndim != 2 || in->shape[1] != w->shape[1] ||
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
    FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * (size_t)rt, &h));
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
    FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * (size_t)e->r, &h));
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
        FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * w, &ob));
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
        if (rc == FU_OK && e->bias) { /* out += 1·biasᵀ, row by row: one rank-1 product */
            kern_tensor_t ones = tv2(x->ones->data, rows, 1, dev), b = tv2(e->bias->data, 1, nd->dim_out, dev);
            rc = kern_gemm(x->be, false, false, 1.0f, &ones, &b, 1.0f, &out);
        }
        break;
    }
    case DAG_OP_HEAD_NORM: { /* every head a row of head_dim */
        kern_tensor_t a = tv2(in[0]->t->data, (int64_t)rows * nd->n_heads, nd->head_dim, dev);
        kern_tensor_t o = tv2(out.data, (int64_t)rows * nd->n_heads, nd->head_dim, dev);
        rc = kern_rmsnorm_forward(x->be, &a, e->w, nd->eps, &o);
        break;
    }
    case DAG_OP_ROPE: {
        kern_tensor_t a = bview(x, in[0], rows, (int64_t)w);
        kern_tensor_t pos = tv1(s->pos->data, KERN_I32, rows, dev);
        kern_rope_params rp = dag_rope_params(nd);
        rc = kern_rope_forward(x->be, &a, &pos, (int)nd->head_dim, &rp, &out);
        break;
    }
    case DAG_OP_ATTENTION: {
        int64_t kw = (int64_t)nd->n_kv_heads * nd->head_dim;
        kern_tensor_t q = bview(x, in[0], rows, (int64_t)w);
        kern_tensor_t k = bview(x, in[1], rows, kw);
        kern_tensor_t v = bview(x, in[2], rows, kw);
        kern_attn_params p = {.n_head = (int)nd->n_heads, .n_kv_head = (int)nd->n_kv_heads,
                              .head_dim = (int)nd->head_dim, .n_seq = (int)s->n_seq, .q_offset = 0, .scale = 0.0f,
                              .window = (int64_t)nd->window};
        if (s->n_sess) { /* each session's rows attend to its own cache */
            p.n_seq = 1;
            size_t r0 = 0;
            for (uint32_t b = 0; b < s->n_sess && rc == FU_OK; b++) {
                int64_t nr = s->sess_rows[b];
                kern_kvcache_t *c = s->sess[b]->caches[i];
                kern_tensor_t qb = tv2((float *)q.data + r0 * w, nr, (int64_t)w, dev);
                kern_tensor_t kb = tv2((float *)k.data + r0 * kw, nr, kw, dev);
                kern_tensor_t vb = tv2((float *)v.data + r0 * kw, nr, kw, dev);
                kern_tensor_t ob2 = tv2((float *)out.data + r0 * w, nr, (int64_t)w, dev);
                FU_TRY(ensure_ws_attn(x, &p, nr, kern_kvcache_len(c) + nr, false));
                rc = kern_kvcache_attend(c, &p, &qb, &kb, &vb, &ob2, x->ws);
                r0 += (size_t)nr;
            }
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
    case DAG_OP_LM_HEAD: { /* every row, or the last of each session */
        kern_tensor_t a;
        ebuf *held = NULL;
        rc = head_input(x, s, nd, in[0], &held, &a);
        if (rc == FU_OK)
            rc = nd->adapter.method == DAG_ADAPTER_SALR ? fwd_salr(x, slot, i, &a, &out)
                                                        : base_linear(x, &a, e->w, &out);
        if (held)
            held->refs = 0;
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
        if (s->batch) {
            rc = sample_batch(x, s, nd, in[0], lr);
            break;
        }
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
        /* Layers before the failure appended to their caches: rewind them to the sessions' lengths. */
        for (uint32_t b = 0; b < s->n_sess; b++) {
            dag_session_t *ss = s->sess[b];
            for (size_t i = x->first; i < x->last; i++)
                if (ss->caches[i] && kern_kvcache_len(ss->caches[i]) > ss->len) {
                    fu_err trc = kern_kvcache_truncate(ss->caches[i], ss->len);
                    (void)trc; /* cannot fail: len is below the cache's length */
                }
        }
        return rc;
    }
    for (uint32_t b = 0; b < s->n_sess; b++)
        s->sess[b]->len += s->sess_rows[b];
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
    FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * node_width(x, node), &b));
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
        FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * w, &x->grad[src]));
        *dst = bview(x, x->grad[src], rows, (int64_t)w);
        return FU_OK;
    }
    FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * w, tmp));
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
    FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * w, &c));
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

/* The gradient of one input in a node's backward: written into the input's gradient (grad_target)
 * when it needs one, else into a scratch buffer dropped afterwards (for kernels that write every
 * input's gradient). */
typedef struct {
    kern_tensor_t d; /* where the kernel writes */
    ebuf *tmp;       /* grad_target's temporary, added to the gradient by grad_finish */
    ebuf *scratch;   /* for an input that needs no gradient */
} input_grad;

static fu_err input_grad_begin(dag_exec_t *x, uint32_t src, uint32_t rows, input_grad *g)
{
    if (x->need_grad[src])
        return grad_target(x, src, rows, &g->d, &g->tmp);
    FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * node_width(x, src), &g->scratch));
    g->d = bview(x, g->scratch, rows, (int64_t)node_width(x, src));
    return FU_OK;
}

/* After the kernel (rc its result): adds the gradient written when it needs adding, and releases
 * the buffers. Returns rc, or grad_finish's error. */
static fu_err input_grad_end(dag_exec_t *x, uint32_t src, uint32_t rows, fu_err rc, input_grad *g)
{
    if (rc == FU_OK && x->need_grad[src])
        rc = grad_finish(x, src, rows, &g->tmp, &g->d);
    if (g->tmp)
        g->tmp->refs = 0;
    if (g->scratch)
        g->scratch->refs = 0;
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
        input_grad dx = {.tmp = NULL};
        FU_TRY(input_grad_begin(x, src, s->rows, &dx));
        if (nd->adapter.method == DAG_ADAPTER_SALR)
            rc = bwd_salr_dx(x, slot, j, &dy, &dx.d);
        else
            rc = kern_linear_backward(x->be, &dy, NULL, e->w, &dx.d, NULL);
        rc = input_grad_end(x, src, s->rows, rc, &dx);
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
        kern_tensor_t xv = bview(x, in[0], rows, nd->dim_in);
        input_grad dx = {.tmp = NULL};
        FU_TRY(input_grad_begin(x, src, rows, &dx));
        rc = kern_rmsnorm_backward(x->be, &dy, &xv, e->w, nd->eps, &dx.d, NULL);
        rc = input_grad_end(x, src, rows, rc, &dx);
        break;
    }
    case DAG_OP_HEAD_NORM: {
        uint32_t src = nd->inputs[0];
        if (!x->need_grad[src])
            break;
        if (!in[0])
            return FU_EINVAL;
        const int64_t hr = (int64_t)rows * nd->n_heads;
        kern_tensor_t xv = tv2(in[0]->t->data, hr, nd->head_dim, dev), dyv = tv2(dy.data, hr, nd->head_dim, dev);
        input_grad dx = {.tmp = NULL};
        FU_TRY(input_grad_begin(x, src, rows, &dx));
        kern_tensor_t dxv = tv2(dx.d.data, hr, nd->head_dim, dev);
        rc = kern_rmsnorm_backward(x->be, &dyv, &xv, e->w, nd->eps, &dxv, NULL);
        rc = input_grad_end(x, src, rows, rc, &dx);
        break;
    }
    case DAG_OP_ROPE: {
        uint32_t src = nd->inputs[0];
        if (!x->need_grad[src])
            break;
        kern_tensor_t pos = tv1(s->pos->data, KERN_I32, rows, dev);
        input_grad dx = {.tmp = NULL};
        FU_TRY(input_grad_begin(x, src, rows, &dx));
        kern_rope_params rp = dag_rope_params(nd);
        rc = kern_rope_backward(x->be, &dy, &pos, (int)nd->head_dim, &rp, &dx.d);
        rc = input_grad_end(x, src, rows, rc, &dx);
        break;
    }
    case DAG_OP_ATTENTION: {
        if (!in[0] || !in[1] || !in[2])
            return FU_EINVAL;
        int64_t kw = (int64_t)nd->n_kv_heads * nd->head_dim;
        kern_tensor_t q = bview(x, in[0], rows, (int64_t)w), k = bview(x, in[1], rows, kw),
                      v = bview(x, in[2], rows, kw);
        input_grad d[3] = {{.tmp = NULL}, {.tmp = NULL}, {.tmp = NULL}};
        for (uint32_t a = 0; a < 3 && rc == FU_OK; a++)
            rc = input_grad_begin(x, nd->inputs[a], rows, &d[a]);
        kern_attn_params p = {.n_head = (int)nd->n_heads, .n_kv_head = (int)nd->n_kv_heads,
                              .head_dim = (int)nd->head_dim, .n_seq = (int)s->n_seq, .q_offset = 0, .scale = 0.0f,
                              .window = (int64_t)nd->window};
        if (rc == FU_OK)
            rc = ensure_ws_attn(x, &p, s->seq_len, s->seq_len, true);
        if (rc == FU_OK)
            rc = kern_attn_backward(x->be, &p, &q, &k, &v, &dy, &d[0].d, &d[1].d, &d[2].d, x->ws);
        for (uint32_t a = 0; a < 3; a++)
            rc = input_grad_end(x, nd->inputs[a], rows, rc, &d[a]);
        break;
    }
    case DAG_OP_SILU_MUL: {
        if (!in[0] || !in[1])
            return FU_EINVAL;
        kern_tensor_t g = bview(x, in[0], rows, (int64_t)w), u = bview(x, in[1], rows, (int64_t)w);
        input_grad d[2] = {{.tmp = NULL}, {.tmp = NULL}};
        for (uint32_t a = 0; a < 2 && rc == FU_OK; a++)
            rc = input_grad_begin(x, nd->inputs[a], rows, &d[a]);
        if (rc == FU_OK)
            rc = kern_silu_mul_backward(x->be, &dy, &g, &u, &d[0].d, &d[1].d);
        for (uint32_t a = 0; a < 2; a++)
            rc = input_grad_end(x, nd->inputs[a], rows, rc, &d[a]);
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

fu_err dag_exec_gather_outputs(dag_exec_t *x, uint32_t slot, const uint32_t *ids, size_t n, float *out, size_t cap)
{
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const float *p;
        size_t k;
        FU_TRY(dag_exec_get_output(x, slot, ids[i], &p, &k));
        if (off + k > cap)
            return FU_EINVAL;
        memcpy(out + off, p, k * sizeof(float));
        off += k;
    }
    return off == cap ? FU_OK : FU_EINVAL;
}

fu_err dag_exec_gather_input_grads(dag_exec_t *x, const uint32_t *ids, size_t n, uint64_t rows, float *out, size_t cap)
{
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const float *p = NULL;
        size_t k = 0, want = (size_t)(rows * dag_graph_width(x->g, ids[i]));
        FU_TRY(dag_exec_get_input_grad(x, ids[i], &p, &k));
        if ((p && k != want) || off + want > cap)
            return FU_EINVAL;
        if (p)
            memcpy(out + off, p, want * sizeof(float));
        else
            memset(out + off, 0, want * sizeof(float));
        off += want;
    }
    return off == cap ? FU_OK : FU_EINVAL;
}
