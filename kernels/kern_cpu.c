/* The CPU backend: memory, GEMM (kern_cpu_gemm.c), element-wise ops, AdamW, and the table that collects
 * the ops defined in kern_cpu_ops.c, kern_cpu_attn.c and kern_sample.c. Loops use OpenMP. */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"

static fu_err cpu_alloc(const kern_backend_t *be, size_t bytes, void **out)
{
    (void)be;
    void *p = NULL;
    size_t n = bytes ? bytes : 1;
    if (posix_memalign(&p, KERN_ALIGN, n) != 0)
        return FU_ENOMEM;
    *out = p;
    return FU_OK;
}

static void cpu_free(const kern_backend_t *be, void *p)
{
    (void)be;
    free(p);
}

static fu_err cpu_copy(const kern_backend_t *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    memmove(dst, src, bytes);
    return FU_OK;
}

static fu_err cpu_fill_zero(const kern_backend_t *be, void *dst, size_t bytes)
{
    (void)be;
    memset(dst, 0, bytes);
    return FU_OK;
}

static fu_err cpu_sync(const kern_backend_t *be)
{
    (void)be;
    return FU_OK;
}

static fu_err cpu_convert(const kern_backend_t *be, const kern_tensor_t *src, kern_tensor_t *dst)
{
    (void)be;
    return kern_convert_host(dst->data, dst->dtype, src->data, src->dtype, (size_t)kern_tensor_numel(src));
}

static int ld_of(const kern_tensor_t *t)
{
    int64_t ld = t->stride[0];
    if (ld < t->shape[1])
        ld = t->shape[1];
    if (ld < 1)
        ld = 1;
    return (int)ld;
}

static fu_err cpu_gemm(const kern_backend_t *be, bool ta, bool tb, float alpha, const kern_tensor_t *a,
                       const kern_tensor_t *b, float beta, kern_tensor_t *c)
{
    (void)be;
    if (b->dtype != KERN_F32) { /* a narrow frozen weight (kern_gemm checked it) */
        kern_cpu_wmat w = {.data = b->data, .dtype = b->dtype, .scale = b->qscale, .ld = ld_of(b)};
        kern_cpu_sgemm_wn(ta, tb, (int)c->shape[0], (int)c->shape[1], (int)(ta ? a->shape[0] : a->shape[1]), alpha,
                          a->data, ld_of(a), w, beta, c->data, ld_of(c));
        return FU_OK;
    }
    kern_cpu_sgemm(ta, tb, (int)c->shape[0], (int)c->shape[1], (int)(ta ? a->shape[0] : a->shape[1]), alpha, a->data,
                   ld_of(a), b->data, ld_of(b), beta, c->data, ld_of(c));
    return FU_OK;
}

static fu_err cpu_add(const kern_backend_t *be, const kern_tensor_t *a, const kern_tensor_t *b, kern_tensor_t *y)
{
    (void)be;
    const float *pa = a->data, *pb = b->data;
    float *py = y->data;
    int64_t n = kern_tensor_numel(y);
#pragma omp parallel for simd num_threads(kern_cpu_threads()) if (n > kern_cpu_par_min()) schedule(static)
    for (int64_t i = 0; i < n; i++)
        py[i] = pa[i] + pb[i];
    return FU_OK;
}

static fu_err cpu_axpy(const kern_backend_t *be, float alpha, const kern_tensor_t *x, kern_tensor_t *y)
{
    (void)be;
    const float *px = x->data;
    float *py = y->data;
    int64_t n = kern_tensor_numel(y);
#pragma omp parallel for simd num_threads(kern_cpu_threads()) if (n > kern_cpu_par_min()) schedule(static)
    for (int64_t i = 0; i < n; i++)
        py[i] += alpha * px[i];
    return FU_OK;
}

KERN_HOT static void adamw_chunk(float *w, const float *g, float *pm, float *pv, int64_t n, float b1, float b2,
                                 float eps, float decay, float step_size, float inv_sqrt_bc2)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float mi = b1 * pm[i] + (1.0f - b1) * gi;
        float vi = b2 * pv[i] + (1.0f - b2) * gi * gi;
        pm[i] = mi;
        pv[i] = vi;
        float denom = sqrtf(vi) * inv_sqrt_bc2 + eps;
        w[i] = w[i] * decay - step_size * mi / denom;
    }
}

static fu_err cpu_adamw(const kern_backend_t *be, kern_tensor_t *param, const kern_tensor_t *grad,
                        kern_tensor_t *m, kern_tensor_t *v, const kern_adamw_params *p, int64_t step)
{
    (void)be;
    float *w = param->data, *pm = m->data, *pv = v->data;
    const float *g = grad->data;
    int64_t n = kern_tensor_numel(param);
    const float decay = 1.0f - p->lr * p->weight_decay;
    const double bc1 = 1.0 - pow((double)p->beta1, (double)step);
    const double bc2 = 1.0 - pow((double)p->beta2, (double)step);
    const float step_size = (float)((double)p->lr / bc1);
    const float inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
#pragma omp parallel for num_threads(kern_cpu_threads()) if (n > kern_cpu_par_min()) schedule(static)
    for (int64_t c = 0; c < n; c += KERN_CHUNK)
        adamw_chunk(w + c, g + c, pm + c, pv + c, n - c < KERN_CHUNK ? n - c : KERN_CHUNK, p->beta1, p->beta2, p->eps,
                    decay, step_size, inv_sqrt_bc2);
    return FU_OK;
}

static const kern_backend_t cpu_backend = {
    .name = "cpu",
    .device = {KERN_DEV_CPU, 0},
    .impl = NULL,
    .float_dtypes = 1u << KERN_F32,
    .weight_dtypes = 1u << KERN_F16 | 1u << KERN_BF16 | 1u << KERN_I8,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .copy = cpu_copy,
    .fill_zero = cpu_fill_zero,
    .synchronize = cpu_sync,
    .convert = cpu_convert,
    .gemm = cpu_gemm,
    .add = cpu_add,
    .axpy = cpu_axpy,
    .embedding_fwd = kern_cpu_embedding_fwd,
    .embedding_bwd = kern_cpu_embedding_bwd,
    .rmsnorm_fwd = kern_cpu_rmsnorm_fwd,
    .rmsnorm_bwd = kern_cpu_rmsnorm_bwd,
    .rope = kern_cpu_rope,
    .silu_mul_fwd = kern_cpu_silu_mul_fwd,
    .silu_mul_bwd = kern_cpu_silu_mul_bwd,
    .attn_ws_bytes = kern_cpu_attn_ws_bytes,
    .attn_fwd = kern_cpu_attn_fwd,
    .attn_bwd = kern_cpu_attn_bwd,
    .xent_fwd = kern_cpu_xent_fwd,
    .xent_bwd = kern_cpu_xent_bwd,
    .xent_fused = kern_cpu_xent_fused,
    .adamw = cpu_adamw,
    .sample = kern_cpu_sample,
    .sparse_matmul = kern_cpu_sparse_matmul,
    .sparse_matmul_dx = kern_cpu_sparse_matmul_dx,
};

const kern_backend_t *kern_backend_cpu(void)
{
    return &cpu_backend;
}

static _Atomic int64_t cpu_par_min = KERN_CPU_PAR_MIN;

int64_t kern_cpu_par_min(void)
{
    return atomic_load_explicit(&cpu_par_min, memory_order_relaxed);
}

void kern_cpu_set_par_min(int64_t elements)
{
    atomic_store_explicit(&cpu_par_min, elements < 0 ? 0 : elements, memory_order_relaxed);
}

/* 0: automatic (OpenMP's default, normally one per core, or OMP_NUM_THREADS). */
static _Atomic int cpu_threads_override;

int kern_cpu_threads(void)
{
    int n = atomic_load_explicit(&cpu_threads_override, memory_order_relaxed);
    return n > 0 ? n : omp_get_max_threads();
}

fu_err kern_cpu_set_threads(int n)
{
    if (n < 0 || n > 4096)
        return FU_EINVAL;
    atomic_store_explicit(&cpu_threads_override, n, memory_order_relaxed);
    return FU_OK;
}
