/* Public op wrappers: validate descriptors, then dispatch to the backend table. Nothing here reads
 * tensor data, so these work unchanged for device backends. */
#include <math.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"

/* Checks a workspace belongs to be's device (NULL is allowed). */
static fu_err chk_ws(const kern_backend_t *be, const kern_workspace_t *ws)
{
    if (!ws)
        return FU_OK;
    const kern_backend_t *wb = kern_workspace_backend(ws);
    if (!wb || wb->device.kind != be->device.kind || wb->device.index != be->device.index)
        return FU_EINVAL;
    return FU_OK;
}

static bool same2(const kern_tensor_t *t, int64_t r, int64_t c)
{
    return t->ndim == 2 && t->shape[0] == r && t->shape[1] == c;
}

fu_err kern_gemm(const kern_backend_t *be, bool trans_a, bool trans_b, float alpha, const kern_tensor_t *a,
                 const kern_tensor_t *b, float beta, kern_tensor_t *c)
{
    FU_TRY(kern_chk_mat(be, a));
    const bool mixed = kern_weight_mixed(be, a, b); /* a 16-bit frozen weight as B */
    FU_TRY(mixed ? kern_chk_weight(be, b) : kern_chk_mat(be, b));
    FU_TRY(kern_chk_mat(be, c));
    int64_t m = trans_a ? a->shape[1] : a->shape[0];
    int64_t ka = trans_a ? a->shape[0] : a->shape[1];
    int64_t kb = trans_b ? b->shape[1] : b->shape[0];
    int64_t n = trans_b ? b->shape[0] : b->shape[1];
    if (ka != kb || c->shape[0] != m || c->shape[1] != n)
        return FU_EINVAL;
    if ((!mixed && !kern_same_dtype(a, b)) || !kern_same_dtype(a, c))
        return FU_EINVAL;
    if (!isfinite(alpha) || !isfinite(beta))
        return FU_EINVAL;
    if (c->data && (c->data == a->data || c->data == b->data) && m * n > 0)
        return FU_EINVAL; /* output aliasing an input */
    return be->gemm(be, trans_a, trans_b, alpha, a, b, beta, c);
}

fu_err kern_linear_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w, kern_tensor_t *y)
{
    return kern_gemm(be, false, true, 1.0f, x, w, 0.0f, y);
}

fu_err kern_linear_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                            const kern_tensor_t *w, kern_tensor_t *dx, kern_tensor_t *dw)
{
    FU_TRY(kern_chk_mat(be, dy));
    FU_TRY(kern_chk_weight(be, w));
    if (dy->shape[1] != w->shape[0] || (dw && kern_weight_mixed(be, dy, w)))
        return FU_EINVAL; /* a 16-bit weight is frozen: no gradient */
    if (dw) {
        FU_TRY(kern_chk_mat(be, x));
        if (x->shape[0] != dy->shape[0] || x->shape[1] != w->shape[1] || !kern_tensor_same_shape(dw, w))
            return FU_EINVAL;
    }
    if (dx && (!same2(dx, dy->shape[0], w->shape[1])))
        return FU_EINVAL;
    if (dx)
        FU_TRY(kern_gemm(be, false, false, 1.0f, dy, w, 0.0f, dx));
    if (dw)
        FU_TRY(kern_gemm(be, true, false, 1.0f, dy, x, 1.0f, dw));
    return FU_OK;
}

fu_err kern_add_forward(const kern_backend_t *be, const kern_tensor_t *a, const kern_tensor_t *b, kern_tensor_t *y)
{
    FU_TRY(kern_chk_float(be, a, 0));
    FU_TRY(kern_chk_float(be, b, 0));
    FU_TRY(kern_chk_float(be, y, 0));
    if (!kern_tensor_same_shape(a, b) || !kern_tensor_same_shape(a, y))
        return FU_EINVAL;
    if (!kern_same_dtype(a, b) || !kern_same_dtype(a, y))
        return FU_EINVAL;
    if (!be->add)
        return FU_ENOSYS;
    return be->add(be, a, b, y);
}

fu_err kern_axpy(const kern_backend_t *be, float alpha, const kern_tensor_t *x, kern_tensor_t *y)
{
    FU_TRY(kern_chk_float(be, x, 0));
    FU_TRY(kern_chk_float(be, y, 0));
    if (kern_tensor_numel(x) != kern_tensor_numel(y) || !isfinite(alpha) || !kern_same_dtype(x, y))
        return FU_EINVAL;
    if (!be->axpy)
        return FU_ENOSYS;
    return be->axpy(be, alpha, x, y);
}

static fu_err chk_ids(const kern_backend_t *be, const kern_tensor_t *ids, int64_t n)
{
    FU_TRY(kern_chk_contig(be, ids));
    if (ids->dtype != KERN_I32 || kern_tensor_numel(ids) != n || ids->ndim > 2)
        return FU_EINVAL;
    return FU_OK;
}

/* An embedding op's tensors: table [vocab, d] and rows [n, d] (out or dout) of one float dtype, ids
 * i32 [n]. */
static fu_err chk_embedding(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *table,
                            const kern_tensor_t *rows)
{
    FU_TRY(kern_weight_mixed(be, rows, table) ? kern_chk_weight(be, table) : kern_chk_float(be, table, 2));
    FU_TRY(kern_chk_float(be, rows, 2));
    if (rows->shape[1] != table->shape[1] || (!kern_same_dtype(table, rows) && !kern_weight_mixed(be, rows, table)))
        return FU_EINVAL;
    return chk_ids(be, ids, rows->shape[0]);
}

fu_err kern_embedding_forward(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *table,
                              kern_tensor_t *out)
{
    FU_TRY(chk_embedding(be, ids, table, out));
    if (!be->embedding_fwd)
        return FU_ENOSYS;
    return be->embedding_fwd(be, ids, table, out);
}

fu_err kern_embedding_backward(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *dout,
                               kern_tensor_t *dtable)
{
    FU_TRY(chk_embedding(be, ids, dtable, dout));
    if (!be->embedding_bwd)
        return FU_ENOSYS;
    return be->embedding_bwd(be, ids, dout, dtable);
}

static fu_err chk_norm(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w, float eps)
{
    FU_TRY(kern_chk_float(be, x, 2));
    FU_TRY(kern_chk_float(be, w, 1));
    if (w->shape[0] != x->shape[1] || !(eps > 0.0f) || !isfinite(eps) || !kern_same_dtype(x, w))
        return FU_EINVAL;
    return FU_OK;
}

fu_err kern_rmsnorm_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w, float eps,
                            kern_tensor_t *y)
{
    FU_TRY(chk_norm(be, x, w, eps));
    FU_TRY(kern_chk_float(be, y, 2));
    if (!kern_tensor_same_shape(x, y) || !kern_same_dtype(x, y))
        return FU_EINVAL;
    if (!be->rmsnorm_fwd)
        return FU_ENOSYS;
    return be->rmsnorm_fwd(be, x, w, eps, y);
}

fu_err kern_rmsnorm_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                             const kern_tensor_t *w, float eps, kern_tensor_t *dx, kern_tensor_t *dw)
{
    FU_TRY(chk_norm(be, x, w, eps));
    FU_TRY(kern_chk_float(be, dy, 2));
    FU_TRY(kern_chk_float(be, dx, 2));
    if (!kern_tensor_same_shape(x, dy) || !kern_tensor_same_shape(x, dx) || dx->data == x->data ||
        dx->data == dy->data || !kern_same_dtype(x, dy) || !kern_same_dtype(x, dx) || !kern_same_dtype(x, dw))
        return FU_EINVAL;
    if (dw) {
        FU_TRY(kern_chk_float(be, dw, 1));
        if (!kern_tensor_same_shape(dw, w))
            return FU_EINVAL;
    }
    if (!be->rmsnorm_bwd)
        return FU_ENOSYS;
    return be->rmsnorm_bwd(be, dy, x, w, eps, dx, dw);
}

bool kern_rope_params_ok(const kern_rope_params *rp, int head_dim)
{
    if (!rp || head_dim <= 0 || head_dim % 2 != 0 || head_dim > KERN_ROPE_MAX_HEAD_DIM || !(rp->theta > 0.0f) ||
        !isfinite(rp->theta))
        return false;
    if (rp->factor == 0.0f)
        return true;
    return rp->factor >= 1.0f && isfinite(rp->factor) && rp->low_freq_factor > 0.0f &&
           rp->high_freq_factor > rp->low_freq_factor && isfinite(rp->high_freq_factor) &&
           rp->original_max_pos > 0.0f && isfinite(rp->original_max_pos);
}

fu_err kern_rope_inv_freq(const kern_rope_params *rp, int head_dim, float *inv_freq)
{
    if (!inv_freq || !kern_rope_params_ok(rp, head_dim))
        return FU_EINVAL;
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) /* Hugging Face: 1 / theta^(arange(0, d, 2) / d) in float32 */
        inv_freq[i] = (float)(1.0 / pow((double)rp->theta, (double)(2 * i) / (double)head_dim));
    if (rp->factor == 0.0f)
        return FU_OK;
    const float lo = rp->low_freq_factor, hi = rp->high_freq_factor, old = rp->original_max_pos;
    /* transformers' _compute_llama3_parameters, in float32 as torch does it */
    const float low_wavelen = old / lo, high_wavelen = old / hi;
    for (int i = 0; i < half; i++) {
        float f = inv_freq[i], wavelen = (float)6.283185307179586 / f; /* 2π in float32, as torch */
        float scaled = wavelen > low_wavelen ? f / rp->factor : f;
        if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) { /* medium: blended */
            float smooth = (old / wavelen - lo) / (hi - lo);
            scaled = (1.0f - smooth) * scaled / rp->factor + smooth * scaled;
        }
        inv_freq[i] = scaled;
    }
    return FU_OK;
}

static fu_err rope(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos, int head_dim,
                   const kern_rope_params *rp, bool inverse, kern_tensor_t *y)
{
    FU_TRY(kern_chk_float(be, x, 2));
    FU_TRY(kern_chk_float(be, y, 2));
    if (!kern_tensor_same_shape(x, y) || !kern_same_dtype(x, y) || head_dim <= 0 || head_dim % 2 != 0 || x->shape[1] % head_dim != 0)
        return FU_EINVAL;
    if (!kern_rope_params_ok(rp, head_dim))
        return FU_EINVAL;
    FU_TRY(chk_ids(be, pos, x->shape[0]));
    if (!be->rope)
        return FU_ENOSYS;
    return be->rope(be, x, pos, head_dim, rp, inverse, y);
}

fu_err kern_rope_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos, int head_dim,
                         const kern_rope_params *rp, kern_tensor_t *y)
{
    return rope(be, x, pos, head_dim, rp, false, y);
}

fu_err kern_rope_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *pos, int head_dim,
                          const kern_rope_params *rp, kern_tensor_t *dx)
{
    return rope(be, dy, pos, head_dim, rp, true, dx);
}

fu_err kern_silu_mul_forward(const kern_backend_t *be, const kern_tensor_t *gate, const kern_tensor_t *up,
                             kern_tensor_t *out)
{
    FU_TRY(kern_chk_float(be, gate, 0));
    FU_TRY(kern_chk_float(be, up, 0));
    FU_TRY(kern_chk_float(be, out, 0));
    if (!kern_tensor_same_shape(gate, up) || !kern_tensor_same_shape(gate, out) || !kern_same_dtype(gate, up) ||
        !kern_same_dtype(gate, out))
        return FU_EINVAL;
    if (!be->silu_mul_fwd)
        return FU_ENOSYS;
    return be->silu_mul_fwd(be, gate, up, out);
}

fu_err kern_silu_mul_backward(const kern_backend_t *be, const kern_tensor_t *dout, const kern_tensor_t *gate,
                              const kern_tensor_t *up, kern_tensor_t *dgate, kern_tensor_t *dup)
{
    FU_TRY(kern_chk_float(be, dout, 0));
    FU_TRY(kern_chk_float(be, gate, 0));
    FU_TRY(kern_chk_float(be, up, 0));
    FU_TRY(kern_chk_float(be, dgate, 0));
    FU_TRY(kern_chk_float(be, dup, 0));
    if (!kern_tensor_same_shape(gate, up) || !kern_tensor_same_shape(gate, dout) ||
        !kern_tensor_same_shape(gate, dgate) || !kern_tensor_same_shape(gate, dup))
        return FU_EINVAL;
    if (dgate->data == dup->data && kern_tensor_numel(dgate) > 0)
        return FU_EINVAL;
    if (!kern_same_dtype(gate, up) || !kern_same_dtype(gate, dout) || !kern_same_dtype(gate, dgate) ||
        !kern_same_dtype(gate, dup))
        return FU_EINVAL;
    if (!be->silu_mul_bwd)
        return FU_ENOSYS;
    return be->silu_mul_bwd(be, dout, gate, up, dgate, dup);
}

/* Validates attention parameters against q, k, v; returns tq, tk per sequence. */
static fu_err chk_attn(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                       const kern_tensor_t *k, const kern_tensor_t *v, int64_t *tq, int64_t *tk)
{
    if (!p)
        return FU_EINVAL;
    FU_TRY(kern_chk_float(be, q, 2));
    FU_TRY(kern_chk_float(be, k, 2));
    FU_TRY(kern_chk_float(be, v, 2));
    if (p->n_head <= 0 || p->n_kv_head <= 0 || p->head_dim <= 0 || p->n_seq <= 0)
        return FU_EINVAL;
    if (p->n_head % p->n_kv_head != 0 || !isfinite(p->scale) || p->scale < 0.0f || p->window < 0)
        return FU_EINVAL;
    int64_t fq = (int64_t)p->n_head * p->head_dim, fk = (int64_t)p->n_kv_head * p->head_dim;
    if (q->shape[1] != fq || k->shape[1] != fk || !kern_tensor_same_shape(k, v))
        return FU_EINVAL;
    if (!kern_same_dtype(q, k) || !kern_same_dtype(q, v))
        return FU_EINVAL;
    if (q->shape[0] % p->n_seq != 0 || k->shape[0] % p->n_seq != 0)
        return FU_EINVAL;
    int64_t a = q->shape[0] / p->n_seq, b = k->shape[0] / p->n_seq;
    if (p->q_offset < 0 || p->q_offset > b || a > b - p->q_offset)
        return FU_EINVAL;
    if (fq > KERN_INT_LIMIT || fk > KERN_INT_LIMIT || a > KERN_INT_LIMIT || b > KERN_INT_LIMIT)
        return FU_EINVAL;
    size_t scores;
    if (!fu_size_mul((size_t)a, (size_t)b, &scores) || scores > (size_t)KERN_INT_LIMIT * 8)
        return FU_EINVAL;
    *tq = a;
    *tk = b;
    return FU_OK;
}

fu_err kern_attn_workspace_bytes(const kern_backend_t *be, const kern_attn_params *p, int64_t tq, int64_t tk,
                                 bool backward, size_t *bytes)
{
    if (!be || !p || !bytes || tq < 0 || tk < 0 || tq > KERN_INT_LIMIT || tk > KERN_INT_LIMIT)
        return FU_EINVAL;
    if (!be->attn_ws_bytes)
        return FU_ENOSYS;
    return be->attn_ws_bytes(be, p, tq, tk, backward, bytes);
}

fu_err kern_attn_forward(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                         const kern_tensor_t *k, const kern_tensor_t *v, kern_tensor_t *o, kern_workspace_t *ws)
{
    int64_t tq, tk;
    FU_TRY(chk_attn(be, p, q, k, v, &tq, &tk));
    FU_TRY(kern_chk_float(be, o, 2));
    FU_TRY(chk_ws(be, ws));
    if (!kern_tensor_same_shape(o, q) || !kern_same_dtype(o, q) || o->data == q->data || o->data == k->data || o->data == v->data)
        return FU_EINVAL;
    if (!be->attn_fwd)
        return FU_ENOSYS;
    return be->attn_fwd(be, p, q, k, v, o, ws);
}

fu_err kern_attn_backward(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                          const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *dout,
                          kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv, kern_workspace_t *ws)
{
    int64_t tq, tk;
    FU_TRY(chk_attn(be, p, q, k, v, &tq, &tk));
    FU_TRY(kern_chk_float(be, dout, 2));
    FU_TRY(kern_chk_float(be, dq, 2));
    FU_TRY(kern_chk_float(be, dk, 2));
    FU_TRY(kern_chk_float(be, dv, 2));
    FU_TRY(chk_ws(be, ws));
    if (!kern_tensor_same_shape(dout, q) || !kern_tensor_same_shape(dq, q) || !kern_tensor_same_shape(dk, k) ||
        !kern_tensor_same_shape(dv, v))
        return FU_EINVAL;
    if (!kern_same_dtype(q, dout) || !kern_same_dtype(q, dq) || !kern_same_dtype(q, dk) || !kern_same_dtype(q, dv))
        return FU_EINVAL;
    const void *outs[3] = {dq->data, dk->data, dv->data};
    const void *ins[4] = {q->data, k->data, v->data, dout->data};
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 4; j++)
            if (outs[i] == ins[j])
                return FU_EINVAL;
        for (int j = i + 1; j < 3; j++)
            if (outs[i] == outs[j])
                return FU_EINVAL;
    }
    if (!be->attn_bwd)
        return FU_ENOSYS;
    return be->attn_bwd(be, p, q, k, v, dout, dq, dk, dv, ws);
}

static fu_err chk_xent(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets)
{
    FU_TRY(kern_chk_float(be, logits, 2));
    if (logits->shape[1] < 1 || logits->shape[1] > KERN_INT_LIMIT)
        return FU_EINVAL;
    return chk_ids(be, targets, logits->shape[0]);
}

fu_err kern_xent_forward(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                         int32_t ignore_index, float *loss, int64_t *n_valid)
{
    FU_TRY(chk_xent(be, logits, targets));
    if (!loss || !n_valid)
        return FU_EINVAL;
    if (!be->xent_fwd)
        return FU_ENOSYS;
    return be->xent_fwd(be, logits, targets, ignore_index, loss, n_valid);
}

fu_err kern_xent_backward(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                          int32_t ignore_index, float grad_scale, kern_tensor_t *dlogits)
{
    FU_TRY(chk_xent(be, logits, targets));
    FU_TRY(kern_chk_float(be, dlogits, 2));
    if (!kern_tensor_same_shape(logits, dlogits) || !kern_same_dtype(logits, dlogits) || !isfinite(grad_scale))
        return FU_EINVAL;
    if (!be->xent_bwd)
        return FU_ENOSYS;
    return be->xent_bwd(be, logits, targets, ignore_index, grad_scale, dlogits);
}

fu_err kern_xent_forward_backward(const kern_backend_t *be, const kern_tensor_t *logits,
                                  const kern_tensor_t *targets, int32_t ignore_index, float grad_scale, float *loss,
                                  int64_t *n_valid, kern_tensor_t *dlogits)
{
    FU_TRY(chk_xent(be, logits, targets));
    FU_TRY(kern_chk_float(be, dlogits, 2));
    if (!loss || !n_valid || !kern_tensor_same_shape(logits, dlogits) || !kern_same_dtype(logits, dlogits) ||
        !isfinite(grad_scale))
        return FU_EINVAL;
    if (be->xent_fused)
        return be->xent_fused(be, logits, targets, ignore_index, grad_scale, loss, n_valid, dlogits);
    if (!be->xent_fwd || !be->xent_bwd)
        return FU_ENOSYS;
    FU_TRY(be->xent_fwd(be, logits, targets, ignore_index, loss, n_valid));
    return be->xent_bwd(be, logits, targets, ignore_index, grad_scale, dlogits);
}

fu_err kern_adamw_step(const kern_backend_t *be, kern_tensor_t *param, const kern_tensor_t *grad, kern_tensor_t *m,
                       kern_tensor_t *v, const kern_adamw_params *p, int64_t step)
{
    if (!p || step < 1)
        return FU_EINVAL;
    FU_TRY(kern_chk_float(be, param, 0));
    FU_TRY(kern_chk_float(be, grad, 0));
    FU_TRY(kern_chk_float(be, m, 0));
    FU_TRY(kern_chk_float(be, v, 0));
    if (!kern_tensor_same_shape(param, grad) || !kern_tensor_same_shape(param, m) ||
        !kern_tensor_same_shape(param, v))
        return FU_EINVAL;
    if (!kern_same_dtype(param, grad) || !kern_same_dtype(param, m) || !kern_same_dtype(param, v))
        return FU_EINVAL;
    if (!isfinite(p->lr) || p->lr < 0.0f || !(p->beta1 >= 0.0f && p->beta1 < 1.0f) ||
        !(p->beta2 >= 0.0f && p->beta2 < 1.0f) || !(p->eps > 0.0f) || !isfinite(p->eps) ||
        !(p->weight_decay >= 0.0f) || !isfinite(p->weight_decay))
        return FU_EINVAL;
    if (m->data == v->data || m->data == param->data || v->data == param->data)
        return FU_EINVAL;
    if (!be->adamw)
        return FU_ENOSYS;
    return be->adamw(be, param, grad, m, v, p, step);
}

fu_err kern_sample(const kern_backend_t *be, const kern_tensor_t *logits, const kern_sample_params *p,
                   uint64_t counter, int32_t *out_tokens)
{
    if (!p || !out_tokens)
        return FU_EINVAL;
    FU_TRY(kern_chk_float(be, logits, 0));
    if (logits->ndim > 2)
        return FU_EINVAL;
    int64_t V = logits->ndim == 1 ? logits->shape[0] : logits->shape[1];
    if (V < 1 || V > KERN_INT_LIMIT || isnan(p->temperature) || isnan(p->top_p) || p->top_k < 0)
        return FU_EINVAL;
    if (!be->sample)
        return FU_ENOSYS;
    return be->sample(be, logits, p, counter, out_tokens);
}

static fu_err chk_sparse(const kern_backend_t *be, const kern_sparse_weight *w)
{
    if (!be || !w || !w->handle || w->rows <= 0 || w->cols <= 0)
        return FU_EINVAL;
    if (w->rows > KERN_INT_LIMIT || w->cols > KERN_INT_LIMIT)
        return FU_EINVAL;
    return FU_OK;
}

fu_err kern_sparse_linear_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_sparse_weight *w,
                                  float beta, kern_tensor_t *y)
{
    FU_TRY(chk_sparse(be, w));
    FU_TRY(kern_chk_float(be, x, 2));
    FU_TRY(kern_chk_float(be, y, 2));
    if (x->shape[1] != w->cols || y->shape[0] != x->shape[0] || y->shape[1] != w->rows || !kern_same_dtype(x, y))
        return FU_EINVAL;
    if (!(beta == 0.0f || beta == 1.0f) || x->data == y->data)
        return FU_EINVAL;
    if (!be->sparse_matmul)
        return FU_ENOSYS;
    return be->sparse_matmul(be, x, w, beta, y);
}

fu_err kern_sparse_linear_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_sparse_weight *w,
                                   kern_tensor_t *dx)
{
    FU_TRY(chk_sparse(be, w));
    FU_TRY(kern_chk_float(be, dy, 2));
    FU_TRY(kern_chk_float(be, dx, 2));
    if (dy->shape[1] != w->rows || dx->shape[0] != dy->shape[0] || dx->shape[1] != w->cols ||
        !kern_same_dtype(dy, dx) || dx->data == dy->data)
        return FU_EINVAL;
    if (!be->sparse_matmul_dx)
        return FU_ENOSYS;
    return be->sparse_matmul_dx(be, dy, w, dx);
}
