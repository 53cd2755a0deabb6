#include "kern_kvcache.h"

#include <stdlib.h>

#include "fu_alloc.h"
#include "kern_internal.h"

struct kern_kvcache {
    const kern_backend_t *be;   /* where k and v live */
    kern_tensor_t        *k;    /* [max_tokens, n_kv_head*head_dim] */
    kern_tensor_t        *v;    /* same shape as k */
    int                   n_kv_head; /* key/value heads */
    int                   head_dim;  /* features per head */
    int64_t               len;  /* positions filled */
};

fu_err kern_kvcache_new(const kern_backend_t *be, kern_dtype dtype, int n_kv_head, int head_dim, int64_t max_tokens,
                        kern_kvcache_t **out)
{
    if (!out)
        return FU_EINVAL;
    *out = NULL;
    if (!be || n_kv_head <= 0 || head_dim <= 0 || max_tokens <= 0)
        return FU_EINVAL;
    if ((unsigned)dtype >= (unsigned)KERN_DTYPE_COUNT_ || !((kern_float_mask(be) >> dtype) & 1u))
        return FU_EINVAL;
    int64_t shape[2] = {max_tokens, (int64_t)n_kv_head * head_dim};
    kern_kvcache_t *c = fu_calloc(1, sizeof *c);
    c->be = be;
    c->n_kv_head = n_kv_head;
    c->head_dim = head_dim;
    fu_err rc = kern_tensor_new(be, dtype, 2, shape, &c->k);
    if (rc == FU_OK)
        rc = kern_tensor_new(be, dtype, 2, shape, &c->v);
    if (rc != FU_OK) {
        kern_kvcache_destroy(&c);
        return rc;
    }
    *out = c;
    return FU_OK;
}

void kern_kvcache_destroy(kern_kvcache_t **c_p)
{
    if (!c_p || !*c_p)
        return;
    kern_kvcache_t *c = *c_p;
    kern_tensor_destroy(&c->k);
    kern_tensor_destroy(&c->v);
    free(c);
    *c_p = NULL;
}

int64_t kern_kvcache_len(const kern_kvcache_t *c)
{
    return c ? c->len : 0;
}

int64_t kern_kvcache_capacity(const kern_kvcache_t *c)
{
    return c ? c->k->shape[0] : 0;
}

fu_err kern_kvcache_append(kern_kvcache_t *c, const kern_tensor_t *k_new, const kern_tensor_t *v_new)
{
    if (!c)
        return FU_EINVAL;
    FU_TRY(kern_chk_float(c->be, k_new, 2));
    FU_TRY(kern_chk_float(c->be, v_new, 2));
    if (!kern_tensor_same_shape(k_new, v_new) || k_new->shape[1] != c->k->shape[1] ||
        !kern_same_dtype(c->k, k_new) || !kern_same_dtype(c->k, v_new))
        return FU_EINVAL;
    int64_t t = k_new->shape[0];
    if (t > c->k->shape[0] - c->len)
        return FU_ENOMEM;
    kern_tensor_t kd, vd;
    FU_TRY(kern_tensor_slice(c->k, 0, c->len, t, &kd));
    FU_TRY(kern_tensor_slice(c->v, 0, c->len, t, &vd));
    FU_TRY(kern_tensor_copy(c->be, k_new, &kd));
    FU_TRY(kern_tensor_copy(c->be, v_new, &vd));
    c->len += t;
    return FU_OK;
}

fu_err kern_kvcache_truncate(kern_kvcache_t *c, int64_t len)
{
    if (!c || len < 0 || len > c->len)
        return FU_EINVAL;
    c->len = len;
    return FU_OK;
}

fu_err kern_kvcache_view(const kern_kvcache_t *c, kern_tensor_t *k, kern_tensor_t *v)
{
    if (!c || !k || !v)
        return FU_EINVAL;
    FU_TRY(kern_tensor_slice(c->k, 0, 0, c->len, k));
    return kern_tensor_slice(c->v, 0, 0, c->len, v);
}

fu_err kern_kvcache_attend(kern_kvcache_t *c, const kern_attn_params *p, const kern_tensor_t *q,
                           const kern_tensor_t *k_new, const kern_tensor_t *v_new, kern_tensor_t *o,
                           kern_workspace_t *ws)
{
    if (!c || !p || !q || !k_new)
        return FU_EINVAL;
    if (p->n_seq != 1 || p->n_kv_head != c->n_kv_head || p->head_dim != c->head_dim)
        return FU_EINVAL;
    if (q->ndim != 2 || k_new->ndim != 2 || q->shape[0] != k_new->shape[0])
        return FU_EINVAL;
    int64_t before = c->len;
    FU_TRY(kern_kvcache_append(c, k_new, v_new));
    kern_attn_params pp = *p;
    pp.q_offset = before;
    kern_tensor_t k, v;
    fu_err rc = kern_kvcache_view(c, &k, &v);
    if (rc == FU_OK)
        rc = kern_attn_forward(c->be, &pp, q, &k, &v, o, ws);
    if (rc != FU_OK)
        c->len = before;
    return rc;
}
