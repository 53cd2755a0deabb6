/* Internal to kernels/cuda/: the CUDA backend's private state, error mapping, dtype helpers and the
 * op functions that kern_cuda_backend.cu collects into the kern_backend_t table.
 *
 * One kc_ctx per backend instance: a device ordinal, ONE stream (every op of the instance is queued
 * on it in call order), a cuBLAS handle bound to that stream, a caching cudaMalloc pool, and a
 * device flag that kernels raise when they meet bad data (token ids, targets) so the op can return
 * FU_EINVAL instead of writing out of bounds. Nothing here aborts: every CUDA/cuBLAS status goes
 * through kc_cuda_err / kc_blas_err, which log the library's message and return FU_ECUDA (FU_ENOMEM
 * for an allocation failure). */
#ifndef FU_KERN_CUDA_INTERNAL_CUH
#define FU_KERN_CUDA_INTERNAL_CUH

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_log.h"
#include "kern_backend.h"
#include "kern_cuda.h"

#define KC_LOG_COMPONENT "cuda"
#define KC_POOL_SMALL_MAX  (1u << 20)  /* requests up to this are rounded to a power of two */
#define KC_POOL_LARGE_STEP (2u << 20)  /* larger requests are rounded to a multiple of this */
#define KC_POOL_MIN_BLOCK  512u        /* smallest block handed out (also for 0-byte requests) */
#define KC_BLAS_WS_BYTES   (32u << 20) /* cuBLAS workspace bound to the handle */
#define KC_FLAG_BAD_INDEX  1           /* a kernel met an id/target outside its range */

/* ---- the caching allocator ---- */
typedef struct kc_block {
    void            *ptr;   /* device pointer from cudaMalloc */
    size_t           bytes; /* rounded size */
    struct kc_block *next;  /* free-list / live-list link */
} kc_block;

typedef struct {
    kc_block *free_list; /* cached blocks ready for reuse */
    kc_block *live;      /* blocks handed out */
    size_t    cached_bytes;
    size_t    live_bytes;
    size_t    peak_bytes;
} kc_pool;

/* The cuBLAS functions the backend calls, from the library loaded on first use (kern_cuda_blas.cu). */
typedef struct {
    cublasStatus_t (*create)(cublasHandle_t *);
    cublasStatus_t (*destroy)(cublasHandle_t);
    cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t);
    cublasStatus_t (*set_workspace)(cublasHandle_t, void *, size_t);
    cublasStatus_t (*set_pointer_mode)(cublasHandle_t, cublasPointerMode_t);
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                              const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
    const char *(*status_name)(cublasStatus_t);
    const char *(*status_string)(cublasStatus_t);
} kc_blas_api;

typedef struct kc_ctx {
    int              device;       /* CUDA ordinal */
    cudaStream_t     stream;       /* the one stream of this instance */
    cublasHandle_t   blas;         /* bound to stream */
    const kc_blas_api *blas_api;   /* the loaded library's functions (kc_blas_load) */
    void            *blas_ws;      /* cuBLAS workspace (device) */
    pthread_mutex_t  lock;         /* guards pool and cuBLAS calls */
    pthread_mutex_t  flag_lock;    /* held by one op from its first flag-raising launch to its check */
    kc_pool          pool;         /* device memory cache */
    int             *d_flag;       /* device error flag (KC_FLAG_*); one op at a time (flag_lock) */
    int             *h_flag;       /* pinned host mirror of d_flag */
    int              sm_count;     /* multiprocessors */
    int              cc_major;     /* compute capability */
    int              cc_minor;
    size_t           smem_optin;   /* max dynamic shared memory per block after opt-in */
    char             name[16];     /* "cuda:N" */
    kern_backend_t   be;           /* the table handed out (impl points back here) */
} kc_ctx;

static inline kc_ctx *kc_of(const kern_backend_t *be)
{
    return (kc_ctx *)be->impl;
}

#ifdef __cplusplus
extern "C" {
#endif

/* Logs a failed CUDA call and maps it: cudaErrorMemoryAllocation -> FU_ENOMEM, others FU_ECUDA.
 * Clears the non-sticky error state so the device stays usable. FU_OK for cudaSuccess. */
fu_err kc_cuda_err(cudaError_t e, const char *what, const char *file, int line);
/* Same for a cuBLAS status (FU_ENOMEM for CUBLAS_STATUS_ALLOC_FAILED). */
fu_err kc_blas_err(cublasStatus_t s, const char *what, const char *file, int line);


/* Loads libcublas once per process (thread-safe): *out is its functions, or NULL with FU_ECUDA (and
 * a log line) when it cannot be loaded. */
fu_err kc_blas_load(const kc_blas_api **out);

/* Makes ctx's device current on this thread (cheap when it already is). */
fu_err kc_enter(kc_ctx *ctx);
/* Device scratch from the pool; release with kc_scratch_free (stream-ordered: safe to free as soon
 * as the last kernel using it is queued). */
fu_err kc_scratch(kc_ctx *ctx, size_t bytes, void **out);
void   kc_scratch_free(kc_ctx *ctx, void *p);
/* Waits for the stream, reads and clears the device flag: FU_EINVAL (with a log line naming `op`)
 * when a kernel raised it, FU_ECUDA when the stream failed. */
/* The error flag of an op whose kernels may raise it: kc_flag_begin before its first launch (takes
 * flag_lock: ops of other threads would otherwise read or clear each other's flag), kc_flag_end
 * after its last with the launches' outcome (FU_OK, or their error), on every path. kc_flag_end
 * waits for the stream, reads and clears the flag, releases the lock, and returns launched's error,
 * FU_EINVAL when an index was out of range (logged with op), else FU_OK. */
void kc_flag_begin(kc_ctx *ctx);
fu_err kc_flag_end(kc_ctx *ctx, fu_err launched, const char *op);

/* Table functions (kern_backend.h contracts). Float tensors may be f32, f16 or bf16 (same dtype
 * within an op unless stated); the public wrappers only pass f32 today. */
fu_err kc_alloc(const kern_backend_t *be, size_t bytes, void **out);
void   kc_free(const kern_backend_t *be, void *p);
fu_err kc_copy_in(const kern_backend_t *be, void *dst, const void *host_src, size_t bytes);
fu_err kc_copy_out(const kern_backend_t *be, void *host_dst, const void *src, size_t bytes);
fu_err kc_copy(const kern_backend_t *be, void *dst, const void *src, size_t bytes);
fu_err kc_fill_zero(const kern_backend_t *be, void *dst, size_t bytes);
fu_err kc_synchronize(const kern_backend_t *be);

fu_err kc_convert(const kern_backend_t *be, const kern_tensor_t *src, kern_tensor_t *dst);
fu_err kc_gemm(const kern_backend_t *be, bool trans_a, bool trans_b, float alpha, const kern_tensor_t *a,
               const kern_tensor_t *b, float beta, kern_tensor_t *c);
fu_err kc_add(const kern_backend_t *be, const kern_tensor_t *a, const kern_tensor_t *b, kern_tensor_t *y);
fu_err kc_axpy(const kern_backend_t *be, float alpha, const kern_tensor_t *x, kern_tensor_t *y);
fu_err kc_embedding_fwd(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *table,
                        kern_tensor_t *out);
fu_err kc_embedding_bwd(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *dout,
                        kern_tensor_t *dtable);
fu_err kc_rmsnorm_fwd(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w, float eps,
                      kern_tensor_t *y);
fu_err kc_rmsnorm_bwd(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                      const kern_tensor_t *w, float eps, kern_tensor_t *dx, kern_tensor_t *dw);
fu_err kc_rope(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos, int head_dim,
               const kern_rope_params *rp, bool inverse, kern_tensor_t *y);
fu_err kc_silu_mul_fwd(const kern_backend_t *be, const kern_tensor_t *gate, const kern_tensor_t *up,
                       kern_tensor_t *out);
fu_err kc_silu_mul_bwd(const kern_backend_t *be, const kern_tensor_t *dout, const kern_tensor_t *gate,
                       const kern_tensor_t *up, kern_tensor_t *dgate, kern_tensor_t *dup);
fu_err kc_attn_ws_bytes(const kern_backend_t *be, const kern_attn_params *p, int64_t tq, int64_t tk,
                        bool backward, size_t *bytes);
fu_err kc_attn_fwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                   const kern_tensor_t *k, const kern_tensor_t *v, kern_tensor_t *o, kern_workspace_t *ws);
fu_err kc_attn_bwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                   const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *dout,
                   kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv, kern_workspace_t *ws);
fu_err kc_xent_fwd(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                   int32_t ignore_index, float *loss, int64_t *n_valid);
fu_err kc_xent_bwd(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                   int32_t ignore_index, float grad_scale, kern_tensor_t *dlogits);
fu_err kc_xent_fused(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                     int32_t ignore_index, float grad_scale, float *loss, int64_t *n_valid, kern_tensor_t *dlogits);
fu_err kc_adamw(const kern_backend_t *be, kern_tensor_t *param, const kern_tensor_t *grad, kern_tensor_t *m,
                kern_tensor_t *v, const kern_adamw_params *p, int64_t step);
fu_err kc_sample(const kern_backend_t *be, const kern_tensor_t *logits, const kern_sample_params *p,
                 uint64_t counter, int32_t *out_tokens);
fu_err kc_sparse_matmul(const kern_backend_t *be, const kern_tensor_t *x, const kern_sparse_weight *w, float beta,
                        kern_tensor_t *y);
fu_err kc_sparse_matmul_dx(const kern_backend_t *be, const kern_tensor_t *dy, const kern_sparse_weight *w,
                           kern_tensor_t *dx);

/* Row-major GEMM on raw device pointers: C[m,n] = alpha·op(A)·op(B) + beta·C with leading
 * dimensions lda/ldb/ldc in elements; all three of dtype dt (f32 runs true f32, f16/bf16 run on
 * tensor cores with f32 accumulation). */
fu_err kc_gemm_raw(kc_ctx *ctx, kern_dtype dt, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                   const void *a, int64_t lda, const void *b, int64_t ldb, float beta, void *c, int64_t ldc);

#ifdef __cplusplus
}
#endif

#define KC_CUDA(call)                                                           \
    do {                                                                        \
        cudaError_t kc_e_ = (call);                                             \
        if (kc_e_ != cudaSuccess)                                               \
            return kc_cuda_err(kc_e_, #call, __FILE__, __LINE__);               \
    } while (0)
/* After a kernel launch: reports launch-configuration errors. */
#define KC_LAUNCHED() KC_CUDA(cudaGetLastError())
#define KC_BLAS(call)                                                           \
    do {                                                                        \
        cublasStatus_t kc_s_ = (call);                                          \
        if (kc_s_ != CUBLAS_STATUS_SUCCESS)                                     \
            return kc_blas_err(kc_s_, #call, __FILE__, __LINE__);               \
    } while (0)

/* ---- dtype helpers (device) ---- */
__device__ __forceinline__ float kc_ld(float x) { return x; }
__device__ __forceinline__ float kc_ld(__half x) { return __half2float(x); }
__device__ __forceinline__ float kc_ld(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T kc_st(float x);
template <> __device__ __forceinline__ float kc_st<float>(float x) { return x; }
template <> __device__ __forceinline__ __half kc_st<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 kc_st<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* Dispatches a float dtype already checked with kc_is_float (bf16 is the remaining case) to a type
 * alias T inside the statement list. Never returns from the enclosing function, so it may run
 * while scratch is held. */
#define KC_DISPATCH_KNOWN_FLOAT(dt, T, ...)             \
    switch (dt) {                                       \
    case KERN_F32: {                                    \
        typedef float T;                                \
        __VA_ARGS__;                                    \
    } break;                                            \
    case KERN_F16: {                                    \
        typedef __half T;                               \
        __VA_ARGS__;                                    \
    } break;                                            \
    default: {                                          \
        typedef __nv_bfloat16 T;                        \
        __VA_ARGS__;                                    \
    } break;                                            \
    }

/* Dispatches a float dtype to a type alias T inside the statement list; other dtypes return
 * FU_EINVAL from the enclosing function. Expands to two statements: use it in a statement list. */
#define KC_DISPATCH_FLOAT(dt, T, ...)                   \
    if (!kc_is_float(dt))                               \
        return FU_EINVAL;                               \
    KC_DISPATCH_KNOWN_FLOAT(dt, T, __VA_ARGS__)

static inline bool kc_is_float(kern_dtype dt)
{
    return dt == KERN_F32 || dt == KERN_F16 || dt == KERN_BF16;
}

/* Blocks for a grid-stride loop over n items. */
static inline unsigned kc_blocks(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    if (b > 65535LL * 32)
        b = 65535LL * 32;
    return (unsigned)b;
}

/* ---- warp / block reductions (device) ---- */
struct kc_sum_op {
    template <typename V> __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
};
struct kc_max_op {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/* op over the warp's 32 lanes (butterfly); every lane gets the result. */
template <typename V, typename Op>
__device__ __forceinline__ V kc_warp_reduce(V v, Op op)
{
    for (int o = 16; o > 0; o >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float kc_warp_sum(float v) { return kc_warp_reduce(v, kc_sum_op()); }
__device__ __forceinline__ float kc_warp_max(float v) { return kc_warp_reduce(v, kc_max_op()); }

/* op over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
 * `red` is __shared__ V[32]; `none` is op's identity. Contains __syncthreads: call from all threads. */
template <typename V, typename Op>
__device__ __forceinline__ V kc_block_reduce(V v, V *red, V none, Op op)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = kc_warp_reduce(v, op);
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    V t = lane < nw ? red[lane] : none;
    return kc_warp_reduce(t, op);
}
/* Sum / max over the block; `red` is __shared__ float[32]. */
__device__ __forceinline__ float kc_block_sum(float v, float *red) { return kc_block_reduce(v, red, 0.0f, kc_sum_op()); }
__device__ __forceinline__ float kc_block_max(float v, float *red)
{
    return kc_block_reduce(v, red, -INFINITY, kc_max_op());
}

#endif
