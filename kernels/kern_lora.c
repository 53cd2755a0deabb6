/* LoRA and LoRA-FA on top of the backend's GEMM, so they run unchanged on every backend. */
#include "kern_lora.h"

#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"
#include "kern_rng.h"

float kern_lora_scale(float alpha, int64_t rank)
{
    return rank > 0 ? alpha / (float)rank : 0.0f;
}

fu_err kern_lora_init(const kern_backend_t *be, kern_tensor_t *a, kern_tensor_t *b, uint64_t seed)
{
    FU_TRY(kern_chk_float(be, a, 2));
    FU_TRY(kern_chk_float(be, b, 2));
    int64_t r = a->shape[0], in = a->shape[1];
    if (b->shape[1] != r || in <= 0 || r <= 0 || !kern_same_dtype(a, b))
        return FU_EINVAL;
    size_t n = (size_t)(r * in);
    float *host = fu_malloc(n * sizeof(float));
    kern_rng rng;
    kern_rng_seed(&rng, seed);
    const double bound = 1.0 / sqrt((double)in);
    for (size_t i = 0; i < n; i++)
        host[i] = (float)((2.0 * kern_rng_uniform_d(&rng) - 1.0) * bound);
    void *conv = host;
    fu_err rc = FU_OK;
    if (a->dtype != KERN_F32) { /* f16/bf16 storage on a device backend */
        conv = fu_malloc(n * kern_dtype_size(a->dtype));
        rc = kern_convert_host(conv, a->dtype, host, KERN_F32, n);
    }
    if (rc == FU_OK)
        rc = kern_tensor_copy_in(be, a, conv, n * kern_dtype_size(a->dtype));
    if (conv != host)
        free(conv);
    free(host);
    FU_TRY(rc);
    return kern_tensor_zero(be, b);
}

fu_err kern_lora_saved_bytes(kern_adapter_kind kind, int64_t n, int64_t in, int64_t rank, kern_dtype dt,
                             size_t *bytes)
{
    size_t es = kern_dtype_size(dt);
    if (!bytes || n < 0 || in < 0 || rank < 0 || es == 0)
        return FU_EINVAL;
    if (kind != KERN_ADAPTER_LORA && kind != KERN_ADAPTER_LORA_FA)
        return FU_EINVAL;
    size_t hr, xr = 0, total;
    if (!fu_size_mul((size_t)n, (size_t)rank, &hr))
        return FU_EINVAL;
    if (kind == KERN_ADAPTER_LORA && !fu_size_mul((size_t)n, (size_t)in, &xr))
        return FU_EINVAL;
    if (!fu_size_add(hr, xr, &total) || !fu_size_mul(total, es, &total))
        return FU_EINVAL;
    *bytes = total;
    return FU_OK;
}

/* Checks the shapes shared by forward and backward: a [r,in], b [out,r], w [out,in] or NULL. */
static fu_err chk_adapter(const kern_backend_t *be, const kern_tensor_t *w, const kern_tensor_t *a,
                          const kern_tensor_t *b, float scale, int64_t *in, int64_t *out, int64_t *r)
{
    FU_TRY(kern_chk_mat(be, a));
    FU_TRY(kern_chk_mat(be, b));
    *r = a->shape[0];
    *in = a->shape[1];
    *out = b->shape[0];
    if (b->shape[1] != *r || !isfinite(scale) || !kern_same_dtype(a, b) ||
        (!kern_same_dtype(a, w) && !kern_weight_mixed(be, a, w)))
        return FU_EINVAL;
    if (w) {
        FU_TRY(kern_chk_weight(be, w)); /* the frozen base may keep 16 bits */
        if (w->shape[0] != *out || w->shape[1] != *in)
            return FU_EINVAL;
    }
    return FU_OK;
}

static bool is2(const kern_tensor_t *t, int64_t r, int64_t c)
{
    return t && t->ndim == 2 && t->shape[0] == r && t->shape[1] == c;
}

fu_err kern_lora_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w,
                         const kern_tensor_t *a, const kern_tensor_t *b, float scale, kern_tensor_t *h,
                         kern_tensor_t *y)
{
    int64_t in, out, r;
    FU_TRY(chk_adapter(be, w, a, b, scale, &in, &out, &r));
    FU_TRY(kern_chk_mat(be, x));
    FU_TRY(kern_chk_mat(be, h));
    FU_TRY(kern_chk_mat(be, y));
    int64_t n = x->shape[0];
    if (x->shape[1] != in || !is2(h, n, r) || !is2(y, n, out))
        return FU_EINVAL;
    if (!kern_same_dtype(a, x) || !kern_same_dtype(a, h) || !kern_same_dtype(a, y))
        return FU_EINVAL;
    FU_TRY(kern_gemm(be, false, true, 1.0f, x, a, 0.0f, h));
    if (w)
        FU_TRY(kern_gemm(be, false, true, 1.0f, x, w, 0.0f, y));
    return kern_gemm(be, false, true, scale, h, b, 1.0f, y);
}

/* The shared part of both backwards: db, and dx with G = dY·B kept in *g for LoRA's dA. */
static fu_err backward_common(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                              const kern_tensor_t *h, const kern_tensor_t *w, const kern_tensor_t *a,
                              const kern_tensor_t *b, float scale, kern_tensor_t *dx, kern_tensor_t *da,
                              kern_tensor_t *db, kern_workspace_t *ws)
{
    int64_t in, out, r;
    FU_TRY(chk_adapter(be, w, a, b, scale, &in, &out, &r));
    FU_TRY(kern_chk_mat(be, dy));
    FU_TRY(kern_chk_mat(be, h));
    int64_t n = dy->shape[0];
    if (dy->shape[1] != out || !is2(h, n, r))
        return FU_EINVAL;
    if (!kern_same_dtype(a, dy) || !kern_same_dtype(a, h) || !kern_same_dtype(a, dx) || !kern_same_dtype(a, da) ||
        !kern_same_dtype(a, db) || !kern_same_dtype(a, x))
        return FU_EINVAL;
    if (db) {
        FU_TRY(kern_chk_mat(be, db));
        if (!is2(db, out, r))
            return FU_EINVAL;
    }
    if (dx) {
        FU_TRY(kern_chk_mat(be, dx));
        if (!is2(dx, n, in))
            return FU_EINVAL;
    }
    if (da) {
        FU_TRY(kern_chk_mat(be, da));
        FU_TRY(kern_chk_mat(be, x));
        if (!is2(da, r, in) || !is2(x, n, in))
            return FU_EINVAL;
    }
    if (ws) {
        const kern_backend_t *wb = kern_workspace_backend(ws);
        if (wb->device.kind != be->device.kind || wb->device.index != be->device.index)
            return FU_EINVAL;
    }
    if (db)
        FU_TRY(kern_gemm(be, true, false, scale, dy, h, 1.0f, db));
    if (!dx && !da)
        return FU_OK;
    /* G = dY·B [n,r] */
    int64_t gshape[2] = {n, r};
    kern_tensor_t g;
    kern_tensor_t *owned = NULL;
    size_t mark = kern_workspace_mark(ws);
    if (ws) {
        FU_TRY(kern_workspace_tensor(ws, dy->dtype, 2, gshape, &g));
    } else {
        FU_TRY(kern_tensor_new(be, dy->dtype, 2, gshape, &owned));
        g = *owned;
    }
    fu_err rc = kern_gemm(be, false, false, 1.0f, dy, b, 0.0f, &g);
    if (rc == FU_OK && dx) {
        if (w)
            rc = kern_gemm(be, false, false, 1.0f, dy, w, 0.0f, dx);
        if (rc == FU_OK)
            rc = kern_gemm(be, false, false, scale, &g, a, 1.0f, dx);
    }
    if (rc == FU_OK && da)
        rc = kern_gemm(be, true, false, scale, &g, x, 1.0f, da);
    kern_tensor_destroy(&owned);
    kern_workspace_rewind(ws, mark);
    return rc;
}

fu_err kern_lorafa_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *h,
                            const kern_tensor_t *w, const kern_tensor_t *a, const kern_tensor_t *b, float scale,
                            kern_tensor_t *dx, kern_tensor_t *db, kern_workspace_t *ws)
{
    return backward_common(be, dy, NULL, h, w, a, b, scale, dx, NULL, db, ws);
}

fu_err kern_lora_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                          const kern_tensor_t *h, const kern_tensor_t *w, const kern_tensor_t *a,
                          const kern_tensor_t *b, float scale, kern_tensor_t *dx, kern_tensor_t *da,
                          kern_tensor_t *db, kern_workspace_t *ws)
{
    if (da && !x)
        return FU_EINVAL;
    return backward_common(be, dy, x, h, w, a, b, scale, dx, da, db, ws);
}

fu_err kern_lorafa_correct_grad(const kern_backend_t *be, const kern_tensor_t *a, float scale, kern_tensor_t *db)
{
    FU_TRY(kern_chk_float(be, a, 2));
    FU_TRY(kern_chk_float(be, db, 2));
    if (a->dtype != KERN_F32 || db->dtype != KERN_F32)
        return FU_EINVAL;
    int64_t r = a->shape[0], in = a->shape[1], out = db->shape[0];
    if (db->shape[1] != r || r <= 0 || in <= 0 || !isfinite(scale) || scale == 0.0f)
        return FU_EINVAL;
    if (r > 4096)
        return FU_EINVAL; /* the r×r inverse is meant for adapter ranks */
    size_t na = (size_t)(r * in), nb = (size_t)(out * r);
    float *ha = fu_malloc(na * sizeof(float));
    float *hb = fu_malloc((nb ? nb : 1) * sizeof(float));
    double *m = fu_calloc((size_t)(r * r), sizeof(double));
    double *tmp = fu_malloc((size_t)r * sizeof(double));
    fu_err rc = kern_tensor_copy_out(be, a, ha, na * sizeof(float));
    if (rc == FU_OK)
        rc = kern_tensor_copy_out(be, db, hb, nb * sizeof(float));
    if (rc != FU_OK)
        goto done;
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j <= i; j++) {
            double s = 0.0;
            for (int64_t c = 0; c < in; c++)
                s += (double)ha[i * in + c] * (double)ha[j * in + c];
            m[i * r + j] = m[j * r + i] = s;
        }
    if (LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'L', (lapack_int)r, m, (lapack_int)r) != 0 ||
        LAPACKE_dpotri(LAPACK_ROW_MAJOR, 'L', (lapack_int)r, m, (lapack_int)r) != 0) {
        rc = FU_EINVAL;
        goto done;
    }
    for (int64_t i = 0; i < r; i++) /* potri fills the lower triangle: mirror it */
        for (int64_t j = i + 1; j < r; j++)
            m[i * r + j] = m[j * r + i];
    const double inv_s2 = 1.0 / ((double)scale * (double)scale);
    for (int64_t o = 0; o < out; o++) {
        float *row = hb + o * r;
        for (int64_t j = 0; j < r; j++) {
            double s = 0.0;
            for (int64_t c = 0; c < r; c++)
                s += (double)row[c] * m[c * r + j];
            tmp[j] = s * inv_s2;
        }
        for (int64_t j = 0; j < r; j++)
            row[j] = (float)tmp[j];
    }
    rc = kern_tensor_copy_in(be, db, hb, nb * sizeof(float));
done:
    free(ha);
    free(hb);
    free(m);
    free(tmp);
    return rc;
}
