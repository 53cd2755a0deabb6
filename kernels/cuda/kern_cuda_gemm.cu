/* CUDA backend: GEMMs through cuBLAS (cublasGemmEx, CUBLAS_COMPUTE_32F: true f32 for f32 tensors,
 * tensor cores with f32 accumulation for f16/bf16), and the fused LoRA-FA layer.
 *
 * Row-major to cuBLAS's column-major: a row-major M[r,c] with leading dimension ld is the
 * column-major Mᵀ [c,r] with the same ld, so row-major C = op(A)·op(B) is column-major
 * Cᵀ = op(B)ᵀ·op(A)ᵀ: call cuBLAS with the operands swapped, (n, m, k), and the transposes kept. */
#include "kern_cuda_internal.cuh"

static cudaDataType_t kc_cuda_type(kern_dtype dt)
{
    switch (dt) {
    case KERN_F16:
        return CUDA_R_16F;
    case KERN_BF16:
        return CUDA_R_16BF;
    default:
        return CUDA_R_32F;
    }
}

template <typename T>
__global__ void k_scale2d(T *c, int64_t m, int64_t n, int64_t ldc, float beta)
{
    const int64_t total = m * n;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = idx / n, j = idx % n;
        T *p = c + i * ldc + j;
        *p = kc_st<T>(beta == 0.0f ? 0.0f : beta * kc_ld(*p));
    }
}

extern "C" fu_err kc_gemm_raw(kc_ctx *ctx, kern_dtype dt, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                              const void *a, int64_t lda, const void *b, int64_t ldb, float beta, void *c, int64_t ldc)
{
    if (!kc_is_float(dt) || m < 0 || n < 0 || k < 0 || lda > INT32_MAX || ldb > INT32_MAX || ldc > INT32_MAX)
        return FU_EINVAL;
    if (m == 0 || n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    if (k == 0) { /* C = beta·C, done here so no library's k == 0 shortcut matters */
        KC_DISPATCH_FLOAT(dt, T, {
            k_scale2d<T><<<kc_blocks((int64_t)m * n, 256), 256, 0, ctx->stream>>>((T *)c, m, n, ldc, beta);
        });
        KC_LAUNCHED();
        return FU_OK;
    }
    const cudaDataType_t ty = kc_cuda_type(dt);
    pthread_mutex_lock(&ctx->lock);
    cublasStatus_t s = ctx->blas_api->gemm_ex(ctx->blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                              n, m, k, &alpha, b, ty, (int)ldb, a, ty, (int)lda, &beta, c, ty,
                                              (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    pthread_mutex_unlock(&ctx->lock);
    if (s != CUBLAS_STATUS_SUCCESS)
        return kc_blas_err(s, "cublasGemmEx", __FILE__, __LINE__);
    return FU_OK;
}

/* Leading dimension of a 2-D tensor with contiguous rows (as the CPU backend computes it). */
static int64_t ld_of(const kern_tensor_t *t)
{
    int64_t ld = t->stride[0];
    if (ld < t->shape[1])
        ld = t->shape[1];
    return ld < 1 ? 1 : ld;
}

static bool is_mat(const kern_tensor_t *t)
{
    return t && t->ndim == 2 && kc_is_float(t->dtype) && (t->shape[1] <= 1 || t->stride[1] == 1) &&
           t->shape[0] <= INT32_MAX && t->shape[1] <= INT32_MAX && t->stride[0] <= INT32_MAX;
}

extern "C" fu_err kc_gemm(const kern_backend_t *be, bool trans_a, bool trans_b, float alpha, const kern_tensor_t *a,
                          const kern_tensor_t *b, float beta, kern_tensor_t *c)
{
    if (!is_mat(a) || !is_mat(b) || !is_mat(c) || a->dtype != c->dtype || b->dtype != c->dtype)
        return FU_EINVAL;
    int64_t m = c->shape[0], n = c->shape[1];
    int64_t am = trans_a ? a->shape[1] : a->shape[0], k = trans_a ? a->shape[0] : a->shape[1];
    int64_t bk = trans_b ? b->shape[1] : b->shape[0], bn = trans_b ? b->shape[0] : b->shape[1];
    if (am != m || bk != k || bn != n)
        return FU_EINVAL;
    return kc_gemm_raw(kc_of(be), c->dtype, trans_a, trans_b, (int)m, (int)n, (int)k, alpha, a->data, ld_of(a),
                       b->data, ld_of(b), beta, c->data, ld_of(c));
}

/* ---------------------------------------------------------------------------------------------- */
/* LoRA-FA */

static bool on_be(const kern_backend_t *be, const kern_tensor_t *t)
{
    return t && t->device.kind == KERN_DEV_CUDA && t->device.index == be->device.index && (t->data || !kern_tensor_numel(t));
}

static fu_err lorafa_check(const kern_backend_t *be, const kern_tensor_t *x_or_dy, const kern_tensor_t *w,
                           const kern_tensor_t *a, const kern_tensor_t *b, const kern_tensor_t *h)
{
    if (!be || be->device.kind != KERN_DEV_CUDA || !be->impl || !w)
        return FU_EINVAL;
    const kern_tensor_t *all[5] = {x_or_dy, w, a, b, h};
    for (int i = 0; i < 5; i++)
        if (!is_mat(all[i]) || !on_be(be, all[i]) || all[i]->dtype != w->dtype)
            return FU_EINVAL;
    int64_t out = w->shape[0], in = w->shape[1], r = a->shape[0];
    if (a->shape[1] != in || b->shape[0] != out || b->shape[1] != r || h->shape[1] != r || r < 1)
        return FU_EINVAL;
    return FU_OK;
}

extern "C" fu_err kern_cuda_lorafa_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w,
                                           const kern_tensor_t *a, const kern_tensor_t *b, float s, kern_tensor_t *h,
                                           kern_tensor_t *y)
{
    FU_TRY(lorafa_check(be, x, w, a, b, h));
    if (!is_mat(y) || !on_be(be, y) || y->dtype != w->dtype)
        return FU_EINVAL;
    kc_ctx *ctx = kc_of(be);
    int64_t n = x->shape[0], in = w->shape[1], out = w->shape[0], r = a->shape[0];
    if (x->shape[1] != in || h->shape[0] != n || y->shape[0] != n || y->shape[1] != out)
        return FU_EINVAL;
    const kern_dtype dt = w->dtype;
    /* h = X·Aᵀ  [n,r] */
    FU_TRY(kc_gemm_raw(ctx, dt, false, true, (int)n, (int)r, (int)in, 1.0f, x->data, ld_of(x), a->data, ld_of(a), 0.0f,
                       h->data, ld_of(h)));
    /* Y = s·h·Bᵀ  [n,out] (K = r: a thin GEMM that only writes Y) */
    FU_TRY(kc_gemm_raw(ctx, dt, false, true, (int)n, (int)out, (int)r, s, h->data, ld_of(h), b->data, ld_of(b), 0.0f,
                       y->data, ld_of(y)));
    /* Y = X·Wᵀ + Y: the frozen GEMM reads Y in its epilogue */
    return kc_gemm_raw(ctx, dt, false, true, (int)n, (int)out, (int)in, 1.0f, x->data, ld_of(x), w->data, ld_of(w),
                       1.0f, y->data, ld_of(y));
}

extern "C" fu_err kern_cuda_lorafa_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *h,
                                            const kern_tensor_t *w, const kern_tensor_t *a, const kern_tensor_t *b,
                                            float s, kern_tensor_t *dx, kern_tensor_t *db)
{
    FU_TRY(lorafa_check(be, dy, w, a, b, h));
    kc_ctx *ctx = kc_of(be);
    int64_t n = dy->shape[0], in = w->shape[1], out = w->shape[0], r = a->shape[0];
    const kern_dtype dt = w->dtype;
    if (dy->shape[1] != out || h->shape[0] != n)
        return FU_EINVAL;
    if (db && (!is_mat(db) || !on_be(be, db) || db->dtype != dt || db->shape[0] != out || db->shape[1] != r))
        return FU_EINVAL;
    if (dx && (!is_mat(dx) || !on_be(be, dx) || dx->dtype != dt || dx->shape[0] != n || dx->shape[1] != in))
        return FU_EINVAL;
    /* dB += s·dYᵀ·h  [out,r] */
    if (db)
        FU_TRY(kc_gemm_raw(ctx, dt, true, false, (int)out, (int)r, (int)n, s, dy->data, ld_of(dy), h->data, ld_of(h),
                           1.0f, db->data, ld_of(db)));
    if (!dx)
        return FU_OK;
    /* g = dY·B [n,r]; dX = s·g·A; dX = dY·W + dX */
    void *g = NULL;
    size_t esz = kern_dtype_size(dt);
    FU_TRY(kc_scratch(ctx, (size_t)n * (size_t)r * esz, &g));
    fu_err rc = kc_gemm_raw(ctx, dt, false, false, (int)n, (int)r, (int)out, 1.0f, dy->data, ld_of(dy), b->data,
                            ld_of(b), 0.0f, g, r);
    if (rc == FU_OK)
        rc = kc_gemm_raw(ctx, dt, false, false, (int)n, (int)in, (int)r, s, g, r, a->data, ld_of(a), 0.0f, dx->data,
                         ld_of(dx));
    if (rc == FU_OK)
        rc = kc_gemm_raw(ctx, dt, false, false, (int)n, (int)in, (int)out, 1.0f, dy->data, ld_of(dy), w->data,
                         ld_of(w), 1.0f, dx->data, ld_of(dx));
    kc_scratch_free(ctx, g);
    return rc;
}
