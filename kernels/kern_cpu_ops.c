/* CPU backend: embedding, RMSNorm, RoPE, SwiGLU and softmax cross-entropy (forward and backward).
 * Arguments arrive validated by the wrappers in kern_ops.c; data-dependent checks (ids, targets)
 * happen here. Rows are independent and run on OpenMP threads. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"


/* ---- embedding ---- */

/* Every id of an embedding op (one per row of rows: out or dout) inside table's vocabulary. */
static fu_err check_ids(const kern_tensor_t *ids, const kern_tensor_t *rows, const kern_tensor_t *table)
{
    const int32_t *id = ids->data;
    for (int64_t i = 0; i < rows->shape[0]; i++)
        if (id[i] < 0 || (int64_t)id[i] >= table->shape[0])
            return FU_EINVAL;
    return FU_OK;
}

fu_err kern_cpu_embedding_fwd(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *table,
                              kern_tensor_t *out)
{
    (void)be;
    FU_TRY(check_ids(ids, out, table));
    const int32_t *id = ids->data;
    int64_t n = out->shape[0], d = out->shape[1];
    float *o = out->data;
    if (table->dtype != KERN_F32) { /* a narrow table kept in its precision: rows widened as read */
        kern_cpu_wmat w = {.data = table->data, .dtype = table->dtype, .scale = table->qscale, .ld = (int)d};
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n * d > kern_cpu_par_min()) schedule(static)
        for (int64_t i = 0; i < n; i++)
            kern_cpu_widen_row(w, id[i], 0, d, o + i * d);
        return FU_OK;
    }
    const float *tab = table->data;
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n * d > kern_cpu_par_min()) schedule(static)
    for (int64_t i = 0; i < n; i++)
        memcpy(o + i * d, tab + (int64_t)id[i] * d, (size_t)d * sizeof(float));
    return FU_OK;
}

fu_err kern_cpu_embedding_bwd(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *dout,
                              kern_tensor_t *dtable)
{
    (void)be;
    FU_TRY(check_ids(ids, dout, dtable));
    const int32_t *id = ids->data;
    int64_t n = dout->shape[0], d = dout->shape[1];
    const float *g = dout->data;
    float *dt = dtable->data;
    /* Threads own disjoint column ranges, so repeated ids never race. */
#pragma omp parallel num_threads(kern_cpu_threads()) if (n * d > kern_cpu_par_min())
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t c0 = d * t / nt, c1 = d * (t + 1) / nt;
        for (int64_t i = 0; i < n; i++) {
            float *dst = dt + (int64_t)id[i] * d;
            const float *src = g + i * d;
#pragma omp simd
            for (int64_t j = c0; j < c1; j++)
                dst[j] += src[j];
        }
    }
    return FU_OK;
}

/* ---- RMSNorm ---- */

static inline float row_rstd(const float *x, int64_t d, float eps)
{
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < d; j++)
        ss += x[j] * x[j];
    return 1.0f / sqrtf(ss / (float)d + eps);
}

KERN_HOT static void rmsnorm_fwd_row(const float *xr, const float *pw, int64_t d, float eps, float *yr)
{
    float r = row_rstd(xr, d, eps);
#pragma omp simd
    for (int64_t j = 0; j < d; j++)
        yr[j] = (xr[j] * r) * pw[j];
}

fu_err kern_cpu_rmsnorm_fwd(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w, float eps,
                            kern_tensor_t *y)
{
    (void)be;
    int64_t n = x->shape[0], d = x->shape[1];
    const float *px = x->data, *pw = w->data;
    float *py = y->data;
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n * d > kern_cpu_par_min()) schedule(static)
    for (int64_t i = 0; i < n; i++)
        rmsnorm_fwd_row(px + i * d, pw, d, eps, py + i * d);
    return FU_OK;
}

/* dx row of RMSNorm's backward; adds the row's dw term when dw is not NULL. Returns 1/rms. */
KERN_HOT static float rmsnorm_bwd_row(const float *xr, const float *gr, const float *pw, int64_t d, float eps,
                                      float *dr, float *dw)
{
    float r = row_rstd(xr, d, eps);
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < d; j++)
        dot += gr[j] * pw[j] * xr[j];
    float c = r * r * r * dot / (float)d;
#pragma omp simd
    for (int64_t j = 0; j < d; j++)
        dr[j] = r * gr[j] * pw[j] - c * xr[j];
    if (dw) {
#pragma omp simd
        for (int64_t j = 0; j < d; j++)
            dw[j] += gr[j] * xr[j] * r;
    }
    return r;
}

fu_err kern_cpu_rmsnorm_bwd(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                            const kern_tensor_t *w, float eps, kern_tensor_t *dx, kern_tensor_t *dw)
{
    (void)be;
    int64_t n = x->shape[0], d = x->shape[1];
    const float *px = x->data, *pw = w->data, *pdy = dy->data;
    float *pdx = dx->data;
    const bool par = n * d > kern_cpu_par_min() && kern_cpu_threads() > 1;
    if (!par) { /* one pass: dx and dw row by row (dw in the same order as the split path) */
        for (int64_t i = 0; i < n; i++)
            rmsnorm_bwd_row(px + i * d, pdy + i * d, pw, d, eps, pdx + i * d, dw ? (float *)dw->data : NULL);
        return FU_OK;
    }
    float *rs = fu_malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
#pragma omp parallel for num_threads(kern_cpu_threads()) schedule(static)
    for (int64_t i = 0; i < n; i++)
        rs[i] = rmsnorm_bwd_row(px + i * d, pdy + i * d, pw, d, eps, pdx + i * d, NULL);
    if (dw) {
        float *pdw = dw->data;
#pragma omp parallel num_threads(kern_cpu_threads()) if (n * d > kern_cpu_par_min())
        {
            int nt = omp_get_num_threads(), t = omp_get_thread_num();
            int64_t c0 = d * t / nt, c1 = d * (t + 1) / nt;
            for (int64_t i = 0; i < n; i++) {
                const float *xr = px + i * d, *gr = pdy + i * d;
                float r = rs[i];
#pragma omp simd
                for (int64_t j = c0; j < c1; j++)
                    pdw[j] += gr[j] * xr[j] * r;
            }
        }
    }
    free(rs);
    return FU_OK;
}

/* ---- RoPE (Hugging Face rotate-half) ---- */

fu_err kern_cpu_rope(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos, int head_dim,
                     const kern_rope_params *rp, bool inverse, kern_tensor_t *y)
{
    (void)be;
    int64_t n = x->shape[0], f = x->shape[1];
    int64_t half = head_dim / 2, heads = f / head_dim;
    const float *px = x->data;
    const int32_t *pp = pos->data;
    float *py = y->data;
    /* inv_freq as Hugging Face computes it (float32; Llama 3's rescaling when asked) */
    float *inv_freq = fu_malloc((size_t)half * sizeof(float));
    fu_err rc = kern_rope_inv_freq(rp, head_dim, inv_freq);
    if (rc != FU_OK) {
        free(inv_freq);
        return rc;
    }
    const float sgn = inverse ? -1.0f : 1.0f;
#pragma omp parallel num_threads(kern_cpu_threads()) if (n * f > kern_cpu_par_min())
    {
        float *cs = fu_malloc((size_t)half * 2 * sizeof(float));
        float *sn = cs + half;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) {
            float p = (float)pp[t];
            for (int64_t i = 0; i < half; i++) {
                float a = p * inv_freq[i];
                cs[i] = (float)cos((double)a);
                sn[i] = sgn * (float)sin((double)a);
            }
            for (int64_t h = 0; h < heads; h++) {
                const float *xr = px + t * f + h * head_dim;
                float *yr = py + t * f + h * head_dim;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    float x1 = xr[i], x2 = xr[i + half];
                    yr[i] = x1 * cs[i] - x2 * sn[i];
                    yr[i + half] = x2 * cs[i] + x1 * sn[i];
                }
            }
        }
        free(cs);
    }
    free(inv_freq);
    return FU_OK;
}

/* ---- SwiGLU ---- */

KERN_HOT static void silu_mul_chunk(const float *g, const float *u, float *o, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float s = 1.0f / (1.0f + kern_expf(-g[i]));
        o[i] = g[i] * s * u[i];
    }
}

KERN_HOT static void silu_mul_bwd_chunk(const float *d, const float *g, const float *u, float *dg, float *du, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i], di = d[i], ui = u[i];
        float s = 1.0f / (1.0f + kern_expf(-gi));
        dg[i] = di * ui * s * (1.0f + gi * (1.0f - s));
        du[i] = di * gi * s;
    }
}

fu_err kern_cpu_silu_mul_fwd(const kern_backend_t *be, const kern_tensor_t *gate, const kern_tensor_t *up,
                             kern_tensor_t *out)
{
    (void)be;
    const float *g = gate->data, *u = up->data;
    float *o = out->data;
    int64_t n = kern_tensor_numel(out);
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n > kern_cpu_par_min()) schedule(static)
    for (int64_t c = 0; c < n; c += KERN_CHUNK)
        silu_mul_chunk(g + c, u + c, o + c, n - c < KERN_CHUNK ? n - c : KERN_CHUNK);
    return FU_OK;
}

fu_err kern_cpu_silu_mul_bwd(const kern_backend_t *be, const kern_tensor_t *dout, const kern_tensor_t *gate,
                             const kern_tensor_t *up, kern_tensor_t *dgate, kern_tensor_t *dup)
{
    (void)be;
    const float *d = dout->data, *g = gate->data, *u = up->data;
    float *dg = dgate->data, *du = dup->data;
    int64_t n = kern_tensor_numel(dout);
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n > kern_cpu_par_min()) schedule(static)
    for (int64_t c = 0; c < n; c += KERN_CHUNK)
        silu_mul_bwd_chunk(d + c, g + c, u + c, dg + c, du + c, n - c < KERN_CHUNK ? n - c : KERN_CHUNK);
    return FU_OK;
}

/* ---- softmax cross-entropy ---- */

/* Counts the rows whose target is not ignore_index into *n_valid; FU_EINVAL for a target outside
 * logits' vocabulary. */
static fu_err check_targets(const kern_tensor_t *logits, const kern_tensor_t *targets, int32_t ignore,
                            int64_t *n_valid)
{
    const int32_t *t = targets->data;
    int64_t c = 0;
    for (int64_t i = 0; i < logits->shape[0]; i++) {
        if (t[i] == ignore)
            continue;
        if (t[i] < 0 || (int64_t)t[i] >= logits->shape[1])
            return FU_EINVAL;
        c++;
    }
    *n_valid = c;
    return FU_OK;
}

/* log(sum(exp(row))) computed stably (-inf for a row of -inf). */
KERN_HOT static float row_lse(const float *row, int64_t V)
{
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < V; j++)
        mx = row[j] > mx ? row[j] : mx;
    if (mx == -INFINITY)
        return mx;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < V; j++)
        s += kern_expf(row[j] - mx);
    return mx + logf(s);
}

/* drow = scale·softmax(row) (drow may be row). */
KERN_HOT static void row_softmax_scaled(const float *row, float *drow, int64_t V, float lse, float scale)
{
#pragma omp simd
    for (int64_t j = 0; j < V; j++)
        drow[j] = kern_expf(row[j] - lse) * scale;
}

/* The sum of the rows' losses in row order: the same bits for any thread count (an OpenMP
 * reduction would add per-thread partial sums). */
static double rows_sum(const double *rl, int64_t n)
{
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++)
        sum += rl[i];
    return sum;
}

fu_err kern_cpu_xent_fwd(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                         int32_t ignore_index, float *loss, int64_t *n_valid)
{
    (void)be;
    int64_t n = logits->shape[0], V = logits->shape[1];
    const float *pl = logits->data;
    const int32_t *pt = targets->data;
    int64_t nv = 0;
    FU_TRY(check_targets(logits, targets, ignore_index, &nv));
    double *rl = fu_malloc((size_t)(n > 0 ? n : 1) * sizeof(double)); /* each row's loss, summed in order */
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n * V > kern_cpu_par_min()) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *row = pl + i * V;
        rl[i] = pt[i] == ignore_index ? 0.0 : (double)(row_lse(row, V) - row[pt[i]]);
    }
    double sum = rows_sum(rl, n);
    free(rl);
    *loss = nv ? (float)(sum / (double)nv) : 0.0f;
    *n_valid = nv;
    return FU_OK;
}

/* The gradient rows scale·(softmax(row) − onehot(target)), zero for ignored rows (dlogits may be
 * logits), and, when loss_sum is not NULL, the sum of the counted rows' losses. Targets checked. */
static void xent_grad_rows(const kern_tensor_t *logits, const kern_tensor_t *targets, int32_t ignore_index,
                           float scale, kern_tensor_t *dlogits, double *loss_sum)
{
    int64_t n = logits->shape[0], V = logits->shape[1];
    const float *pl = logits->data;
    const int32_t *pt = targets->data;
    float *pd = dlogits->data;
    double *rl = fu_malloc((size_t)(n > 0 ? n : 1) * sizeof(double)); /* each row's loss, summed in order */
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n * V > kern_cpu_par_min()) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *row = pl + i * V;
        float *drow = pd + i * V;
        rl[i] = 0.0;
        if (pt[i] == ignore_index) {
            memset(drow, 0, (size_t)V * sizeof(float));
            continue;
        }
        float lse = row_lse(row, V);
        rl[i] = (double)(lse - row[pt[i]]); /* read before an in-place gradient overwrites it */
        row_softmax_scaled(row, drow, V, lse, scale);
        drow[pt[i]] -= scale;
    }
    if (loss_sum)
        *loss_sum = rows_sum(rl, n);
    free(rl);
}

fu_err kern_cpu_xent_bwd(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                         int32_t ignore_index, float grad_scale, kern_tensor_t *dlogits)
{
    (void)be;
    int64_t nv = 0;
    FU_TRY(check_targets(logits, targets, ignore_index, &nv));
    xent_grad_rows(logits, targets, ignore_index, nv ? grad_scale / (float)nv : 0.0f, dlogits, NULL);
    return FU_OK;
}

fu_err kern_cpu_xent_fused(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                           int32_t ignore_index, float grad_scale, float *loss, int64_t *n_valid,
                           kern_tensor_t *dlogits)
{
    (void)be;
    int64_t nv = 0;
    FU_TRY(check_targets(logits, targets, ignore_index, &nv));
    double sum = 0.0;
    xent_grad_rows(logits, targets, ignore_index, nv ? grad_scale / (float)nv : 0.0f, dlogits, &sum);
    *loss = nv ? (float)(sum / (double)nv) : 0.0f;
    *n_valid = nv;
    return FU_OK;
}
