/* Internal to kernels/: validation helpers shared by the wrappers, and the CPU backend's op
 * functions (defined across kern_cpu*.c, collected into the table in kern_cpu.c). Not installed;
 * the CUDA backend may use the validation helpers and kern_sample_host. */
#ifndef FU_KERN_INTERNAL_H
#define FU_KERN_INTERNAL_H

#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERN_INT_LIMIT 2147483647LL /* BLAS dimensions and leading dimensions are int */
/* Work (elements) below which a CPU loop stays on the calling thread. A fork-join costs a
 * scheduling latency whenever the cores are busy: OpenBLAS's pthread workers keep spinning for a
 * while after each GEMM, and volunteer machines run other things. Measured on a loaded 2-core
 * machine: 10 RMSNorms of 512x768 took 74 ms with 2 threads right after a GEMM and 1.2 ms with one;
 * RMSNorm 512x4096 took 10 ms with 2 threads and 1 ms with one; softmax cross-entropy 512x32000
 * (16M elements, exp-bound) was no faster with 2. So only work of ~10 ms and more is split. */
#define KERN_CPU_PAR_MIN (1 << 23)
/* The threshold in force (KERN_CPU_PAR_MIN unless changed). Tests set it to 0 to run every threaded
 * path on small inputs; not for production use. Thread-safe (relaxed atomic). */
int64_t kern_cpu_par_min(void);
void    kern_cpu_set_par_min(int64_t elements);

/* The CPU GEMM's fixed cuts (kern_cpu_gemm.c): C's tiles are KERN_GEMM_TILE_M x KERN_GEMM_TILE_N
 * (each tile packs its own panels of A and B: 128 x 256 tiles cost 14% against OpenBLAS's own split
 * on a 512 x 2048 x 768 product, 256 x 512 tiles 3-8%; bench-kernels), matrix-vector products go
 * in blocks of KERN_GEMV_BLOCK rows, and products of fewer than KERN_GEMM_PAR_MIN multiply-adds
 * stay on the calling thread. Changing any of them changes results' last bits (never their
 * independence from the thread count). */
#define KERN_GEMM_TILE_M  256
#define KERN_GEMM_TILE_N  512
#define KERN_GEMV_BLOCK   512
#define KERN_GEMM_PAR_MIN (1 << 21)

/* C = alpha·op(A)·op(B) + beta·C on row-major f32 with BLAS's conventions (op(A) m x k, op(B)
 * k x n, leading dimensions in elements), on up to kern_cpu_threads() threads, with the same bits
 * for any thread count (fixed tiles, each one single-threaded OpenBLAS call). m, n or k may be 0.
 * Every CPU product in kernels/ goes through it. Thread-safe. */
void kern_cpu_sgemm(bool ta, bool tb, int m, int n, int k, float alpha, const float *A, int lda, const float *B,
                    int ldb, float beta, float *C, int ldc);

/* A frozen weight kept narrow on the CPU: bf16, f16, or int8 with one f32 scale per stored row. */
typedef struct {
    const void  *data;  /* rows x cols as stored, row stride ld */
    kern_dtype   dtype; /* KERN_BF16, KERN_F16 or KERN_I8 */
    const float *scale; /* KERN_I8: one per stored row */
    int          ld;
} kern_cpu_wmat;

/* kern_cpu_sgemm with a narrow B: each tile (and each gemv block) of B is widened to f32 (an int8
 * element times its row's scale, rounded once) and given to the same BLAS call kern_cpu_sgemm
 * makes, so the result has the bits of kern_cpu_sgemm on B widened whole. */
void kern_cpu_sgemm_wn(bool ta, bool tb, int m, int n, int k, float alpha, const float *A, int lda, kern_cpu_wmat B,
                       float beta, float *C, int ldc);

/* n elements of stored row r of w, from column c0, widened into dst. */
void kern_cpu_widen_row(kern_cpu_wmat w, int64_t r, int64_t c0, int64_t n, float *dst);

/* t is non-NULL, well formed, on be's device, with data when it has elements. */
fu_err kern_chk_dev(const kern_backend_t *be, const kern_tensor_t *t);
/* kern_chk_dev and contiguous. */
fu_err kern_chk_contig(const kern_backend_t *be, const kern_tensor_t *t);
/* Hot leaf loops (exp-heavy rows, element-wise chunks) get an AVX2 clone picked at load time by
 * GCC function multi-versioning; the default clone is baseline x86-64 (SSE2). Off under the
 * sanitizers. OpenMP regions stay in plain functions that call these leaves. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define KERN_HOT __attribute__((target_clones("avx2", "default")))
#else
#define KERN_HOT
#endif
#define KERN_CHUNK 16384 /* elements per element-wise work item */

/* exp(x) for f32 without a libm call, so loops that use it vectorise (glibc's vector expf is
 * only declared under -ffast-math). Cephes' expf: Cody-Waite reduction by ln 2 and a degree-6
 * polynomial, about 2 ulp on [-87, 88]; clamps below to ~2^-126 and above to ~2^127 (callers use
 * it for softmax and sigmoid, where both ends are harmless); NaN propagates. */
static inline float kern_expf(float x)
{
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504088896341f;
    float fi = (t + 12582912.0f) - 12582912.0f; /* round to nearest (|t| < 2^22) */
    float r = x - fi * 0.693359375f;
    r = r - fi * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        uint32_t u;
        float    f;
    } sc;
    sc.u = (uint32_t)((int32_t)fi + 127) << 23;
    return p * sc.f;
}

/* Float dtypes be's ops accept (bitmask of 1u << dtype); a table that leaves float_dtypes 0
 * accepts f32 only. */
static inline unsigned kern_float_mask(const kern_backend_t *be)
{
    return be->float_dtypes ? be->float_dtypes : (1u << KERN_F32);
}
/* kern_chk_contig, a float dtype be accepts, and ndim dims (ndim 0: any). */
fu_err kern_chk_float(const kern_backend_t *be, const kern_tensor_t *t, int ndim);
/* A 2-D float matrix (dtype be accepts) with contiguous rows whose sizes fit BLAS ints. */
fu_err kern_chk_mat(const kern_backend_t *be, const kern_tensor_t *t);
/* A 2-D frozen weight: a matrix of a dtype be keeps weights in (float_dtypes or weight_dtypes). */
fu_err kern_chk_weight(const kern_backend_t *be, const kern_tensor_t *t);
/* Whether w is a 16-bit weight be multiplies with f32 a (a mixed product). */
static inline bool kern_weight_mixed(const kern_backend_t *be, const kern_tensor_t *a, const kern_tensor_t *w)
{
    return a && w && w->dtype != a->dtype && a->dtype == KERN_F32 && ((be->weight_dtypes >> w->dtype) & 1u);
}
/* True when b is NULL or has a's dtype. */
static inline bool kern_same_dtype(const kern_tensor_t *a, const kern_tensor_t *b)
{
    return !b || a->dtype == b->dtype;
}

/* Host sampling over n rows of V logits (row stride ld); used by the CPU backend and usable by
 * device backends after copying logits out. Arguments are assumed validated. */
fu_err kern_sample_host(const float *logits, int64_t n, int64_t V, int64_t ld,
                        const kern_sample_params *p, uint64_t counter, int32_t *out_tokens);

/* CPU backend op functions. */
fu_err kern_cpu_embedding_fwd(const kern_backend_t *be, const kern_tensor_t *ids,
                              const kern_tensor_t *table, kern_tensor_t *out);
fu_err kern_cpu_embedding_bwd(const kern_backend_t *be, const kern_tensor_t *ids,
                              const kern_tensor_t *dout, kern_tensor_t *dtable);
fu_err kern_cpu_rmsnorm_fwd(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w,
                            float eps, kern_tensor_t *y);
fu_err kern_cpu_rmsnorm_bwd(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                            const kern_tensor_t *w, float eps, kern_tensor_t *dx, kern_tensor_t *dw);
fu_err kern_cpu_rope(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos,
                     int head_dim, const kern_rope_params *rp, bool inverse, kern_tensor_t *y);
fu_err kern_cpu_silu_mul_fwd(const kern_backend_t *be, const kern_tensor_t *gate,
                             const kern_tensor_t *up, kern_tensor_t *out);
fu_err kern_cpu_silu_mul_bwd(const kern_backend_t *be, const kern_tensor_t *dout,
                             const kern_tensor_t *gate, const kern_tensor_t *up, kern_tensor_t *dgate,
                             kern_tensor_t *dup);
fu_err kern_cpu_xent_fwd(const kern_backend_t *be, const kern_tensor_t *logits,
                         const kern_tensor_t *targets, int32_t ignore_index, float *loss,
                         int64_t *n_valid);
fu_err kern_cpu_xent_bwd(const kern_backend_t *be, const kern_tensor_t *logits,
                         const kern_tensor_t *targets, int32_t ignore_index, float grad_scale,
                         kern_tensor_t *dlogits);
fu_err kern_cpu_xent_fused(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                           int32_t ignore_index, float grad_scale, float *loss, int64_t *n_valid,
                           kern_tensor_t *dlogits);
fu_err kern_cpu_attn_ws_bytes(const kern_backend_t *be, const kern_attn_params *p, int64_t tq,
                              int64_t tk, bool backward, size_t *bytes);
fu_err kern_cpu_attn_fwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                         const kern_tensor_t *k, const kern_tensor_t *v, kern_tensor_t *o,
                         kern_workspace_t *ws);
fu_err kern_cpu_attn_bwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                         const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *dout,
                         kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv,
                         kern_workspace_t *ws);
fu_err kern_cpu_sparse_matmul(const kern_backend_t *be, const kern_tensor_t *x, const kern_sparse_weight *w,
                              float beta, kern_tensor_t *y);
fu_err kern_cpu_sparse_matmul_dx(const kern_backend_t *be, const kern_tensor_t *dy, const kern_sparse_weight *w,
                                 kern_tensor_t *dx);
fu_err kern_cpu_sample(const kern_backend_t *be, const kern_tensor_t *logits,
                       const kern_sample_params *p, uint64_t counter, int32_t *out_tokens);

#ifdef __cplusplus
}
#endif
#endif
