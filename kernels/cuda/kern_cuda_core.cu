/* CUDA backend core: device probe, backend instances (stream, cuBLAS handle, flag), the caching
 * cudaMalloc pool, host<->device copies, pinned host buffers, error mapping, and the elementwise
 * ops (convert, add, axpy). The op table is assembled here from the functions of the other .cu
 * files. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern_cuda_internal.cuh"

/* ------------------------------------------------------------------------------------------------
 * Errors */

extern "C" fu_err kc_cuda_err(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess)
        return FU_OK;
    fu_log(FU_LOG_ERROR, KC_LOG_COMPONENT, "%s failed: %s (%s) at %s:%d", what, cudaGetErrorName(e),
           cudaGetErrorString(e), file, line);
    (void)cudaGetLastError(); /* clear a non-sticky error so later calls are not poisoned */
    return e == cudaErrorMemoryAllocation ? FU_ENOMEM : FU_ECUDA;
}

extern "C" fu_err kc_blas_err(cublasStatus_t s, const char *what, const char *file, int line)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return FU_OK;
    const kc_blas_api *api = NULL;
    (void)kc_blas_load(&api); /* loaded: s came from it */
    fu_log(FU_LOG_ERROR, KC_LOG_COMPONENT, "%s failed: %s (%s) at %s:%d", what, api ? api->status_name(s) : "?",
           api ? api->status_string(s) : "?", file, line);
    (void)cudaGetLastError();
    return s == CUBLAS_STATUS_ALLOC_FAILED ? FU_ENOMEM : FU_ECUDA;
}

extern "C" fu_err kc_enter(kc_ctx *ctx)
{
    int cur = -1;
    KC_CUDA(cudaGetDevice(&cur));
    if (cur != ctx->device)
        KC_CUDA(cudaSetDevice(ctx->device));
    return FU_OK;
}

/* ------------------------------------------------------------------------------------------------
 * Probe */

extern "C" int kern_cuda_device_count(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        fu_log(FU_LOG_DEBUG, KC_LOG_COMPONENT, "no CUDA device: %s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return 0;
    }
    return n < 0 ? 0 : n;
}

extern "C" fu_err kern_cuda_device_info(int device, kern_cuda_info *out)
{
    if (!out)
        return FU_EINVAL;
    memset(out, 0, sizeof *out);
    int count = kern_cuda_device_count();
    if (device < 0 || device >= count)
        return FU_ENOTFOUND;
    int prev = -1;
    KC_CUDA(cudaGetDevice(&prev));
    cudaDeviceProp prop;
    KC_CUDA(cudaGetDeviceProperties(&prop, device));
    KC_CUDA(cudaSetDevice(device));
    size_t free_b = 0, total_b = 0;
    cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
    (void)cudaSetDevice(prev);
    if (e != cudaSuccess)
        return kc_cuda_err(e, "cudaMemGetInfo", __FILE__, __LINE__);
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->cc_major = prop.major;
    out->cc_minor = prop.minor;
    out->sm_count = prop.multiProcessorCount;
    out->total_bytes = total_b;
    out->free_bytes = free_b;
    out->smem_per_block = prop.sharedMemPerBlockOptin;
    return FU_OK;
}

/* ------------------------------------------------------------------------------------------------
 * Pool. Blocks are cached per rounded size; a request first takes a cached block of the same
 * rounded size (or, for large sizes, one at most 25% bigger), then asks cudaMalloc, and on
 * failure returns every cached block to the driver and asks once more. Frees are stream-ordered
 * safe because an instance has one stream: a reused block's next user is queued after its last. */

static size_t pool_round(size_t bytes)
{
    if (bytes < KC_POOL_MIN_BLOCK)
        return KC_POOL_MIN_BLOCK;
    if (bytes <= KC_POOL_SMALL_MAX) {
        size_t r = KC_POOL_MIN_BLOCK;
        while (r < bytes)
            r <<= 1;
        return r;
    }
    if (bytes > SIZE_MAX - KC_POOL_LARGE_STEP)
        return 0;
    return (bytes + KC_POOL_LARGE_STEP - 1) / KC_POOL_LARGE_STEP * KC_POOL_LARGE_STEP;
}

/* Returns every cached block to the driver. Caller holds ctx->lock. */
static fu_err pool_release_cached(kc_ctx *ctx)
{
    fu_err rc = FU_OK;
    kc_block *b = ctx->pool.free_list;
    ctx->pool.free_list = NULL;
    while (b) {
        kc_block *next = b->next;
        cudaError_t e = cudaFree(b->ptr);
        if (e != cudaSuccess && rc == FU_OK)
            rc = kc_cuda_err(e, "cudaFree", __FILE__, __LINE__);
        ctx->pool.cached_bytes -= b->bytes;
        free(b);
        b = next;
    }
    return rc;
}

static fu_err pool_alloc(kc_ctx *ctx, size_t bytes, void **out)
{
    *out = NULL;
    size_t want = pool_round(bytes);
    if (want == 0) {
        fu_log(FU_LOG_ERROR, KC_LOG_COMPONENT, "%s: allocation of %zu bytes is too large", ctx->name, bytes);
        return FU_ENOMEM;
    }
    pthread_mutex_lock(&ctx->lock);
    kc_block **pp = &ctx->pool.free_list, *hit = NULL;
    for (; *pp; pp = &(*pp)->next) {
        size_t have = (*pp)->bytes;
        bool fits = want <= KC_POOL_SMALL_MAX ? have == want : (have >= want && have - want <= want / 4);
        if (fits) {
            hit = *pp;
            *pp = hit->next;
            ctx->pool.cached_bytes -= hit->bytes;
            break;
        }
    }
    fu_err rc = FU_OK;
    if (!hit) {
        void *p = NULL;
        cudaError_t e = cudaMalloc(&p, want);
        if (e == cudaErrorMemoryAllocation && ctx->pool.free_list) {
            (void)cudaGetLastError();
            (void)pool_release_cached(ctx);
            e = cudaMalloc(&p, want);
        }
        if (e != cudaSuccess) {
            if (e == cudaErrorMemoryAllocation)
                fu_log(FU_LOG_ERROR, KC_LOG_COMPONENT, "%s: out of device memory allocating %zu bytes (%zu live)",
                       ctx->name, want, ctx->pool.live_bytes);
            rc = kc_cuda_err(e, "cudaMalloc", __FILE__, __LINE__);
            pthread_mutex_unlock(&ctx->lock);
            return rc;
        }
        hit = (kc_block *)malloc(sizeof *hit);
        if (!hit) {
            (void)cudaFree(p);
            pthread_mutex_unlock(&ctx->lock);
            return FU_ENOMEM;
        }
        hit->ptr = p;
        hit->bytes = want;
    }
    hit->next = ctx->pool.live;
    ctx->pool.live = hit;
    ctx->pool.live_bytes += hit->bytes;
    if (ctx->pool.live_bytes > ctx->pool.peak_bytes)
        ctx->pool.peak_bytes = ctx->pool.live_bytes;
    *out = hit->ptr;
    pthread_mutex_unlock(&ctx->lock);
    return FU_OK;
}

static void pool_free(kc_ctx *ctx, void *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&ctx->lock);
    kc_block **pp = &ctx->pool.live;
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->ptr == p) {
            kc_block *b = *pp;
            *pp = b->next;
            ctx->pool.live_bytes -= b->bytes;
            b->next = ctx->pool.free_list;
            ctx->pool.free_list = b;
            ctx->pool.cached_bytes += b->bytes;
            pthread_mutex_unlock(&ctx->lock);
            return;
        }
    }
    pthread_mutex_unlock(&ctx->lock);
    fu_log(FU_LOG_ERROR, KC_LOG_COMPONENT, "%s: free of a pointer this backend did not allocate (%p); ignored",
           ctx->name, p);
}

extern "C" fu_err kc_scratch(kc_ctx *ctx, size_t bytes, void **out)
{
    FU_TRY(kc_enter(ctx)); /* cudaMalloc allocates on the calling thread's current device */
    return pool_alloc(ctx, bytes, out);
}

extern "C" void kc_scratch_free(kc_ctx *ctx, void *p)
{
    pool_free(ctx, p);
}

extern "C" fu_err kern_cuda_pool_stats(const kern_backend_t *be, size_t *live, size_t *cached, size_t *peak)
{
    if (!be || be->device.kind != KERN_DEV_CUDA || !be->impl)
        return FU_EINVAL;
    kc_ctx *ctx = kc_of(be);
    pthread_mutex_lock(&ctx->lock);
    if (live)
        *live = ctx->pool.live_bytes;
    if (cached)
        *cached = ctx->pool.cached_bytes;
    if (peak)
        *peak = ctx->pool.peak_bytes;
    pthread_mutex_unlock(&ctx->lock);
    return FU_OK;
}

extern "C" fu_err kern_cuda_pool_trim(const kern_backend_t *be)
{
    if (!be || be->device.kind != KERN_DEV_CUDA || !be->impl)
        return FU_EINVAL;
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    KC_CUDA(cudaStreamSynchronize(ctx->stream));
    pthread_mutex_lock(&ctx->lock);
    fu_err rc = pool_release_cached(ctx);
    pthread_mutex_unlock(&ctx->lock);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Memory table functions */

extern "C" fu_err kc_alloc(const kern_backend_t *be, size_t bytes, void **out)
{
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    return pool_alloc(ctx, bytes, out);
}

extern "C" void kc_free(const kern_backend_t *be, void *p)
{
    kc_ctx *ctx = kc_of(be);
    pool_free(ctx, p);
}

/* Queues a copy of `bytes` on the stream; with `wait`, returns once it is done. */
static fu_err copy_on_stream(const kern_backend_t *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                             bool wait)
{
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    KC_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, ctx->stream));
    if (wait)
        KC_CUDA(cudaStreamSynchronize(ctx->stream));
    return FU_OK;
}

extern "C" fu_err kc_copy_in(const kern_backend_t *be, void *dst, const void *host_src, size_t bytes)
{
    /* The caller may reuse host_src on return. */
    return copy_on_stream(be, dst, host_src, bytes, cudaMemcpyHostToDevice, true);
}

extern "C" fu_err kc_copy_out(const kern_backend_t *be, void *host_dst, const void *src, size_t bytes)
{
    return copy_on_stream(be, host_dst, src, bytes, cudaMemcpyDeviceToHost, true);
}

extern "C" fu_err kc_copy(const kern_backend_t *be, void *dst, const void *src, size_t bytes)
{
    return copy_on_stream(be, dst, src, bytes, cudaMemcpyDeviceToDevice, false);
}

extern "C" fu_err kc_fill_zero(const kern_backend_t *be, void *dst, size_t bytes)
{
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    KC_CUDA(cudaMemsetAsync(dst, 0, bytes, ctx->stream));
    return FU_OK;
}

extern "C" fu_err kc_synchronize(const kern_backend_t *be)
{
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    KC_CUDA(cudaStreamSynchronize(ctx->stream));
    return FU_OK;
}

extern "C" void kc_flag_begin(kc_ctx *ctx)
{
    pthread_mutex_lock(&ctx->flag_lock);
}

/* Reads and clears the flag; the lock taken by kc_flag_begin is released whatever happens. */
static fu_err flag_read(kc_ctx *ctx, int *f)
{
    KC_CUDA(cudaMemcpyAsync(ctx->h_flag, ctx->d_flag, sizeof(int), cudaMemcpyDeviceToHost, ctx->stream));
    KC_CUDA(cudaMemsetAsync(ctx->d_flag, 0, sizeof(int), ctx->stream));
    KC_CUDA(cudaStreamSynchronize(ctx->stream));
    *f = *ctx->h_flag;
    *ctx->h_flag = 0;
    return FU_OK;
}

extern "C" fu_err kc_flag_end(kc_ctx *ctx, fu_err launched, const char *op)
{
    int f = 0;
    fu_err rc = launched == FU_OK ? flag_read(ctx, &f) : launched;
    pthread_mutex_unlock(&ctx->flag_lock);
    if (rc != FU_OK)
        return rc;
    if (f & KC_FLAG_BAD_INDEX) {
        fu_log(FU_LOG_WARN, KC_LOG_COMPONENT, "%s: %s: an index was outside its range", ctx->name, op);
        return FU_EINVAL;
    }
    return FU_OK;
}

extern "C" fu_err kern_cuda_host_alloc(size_t bytes, void **out)
{
    if (!out)
        return FU_EINVAL;
    *out = NULL;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        fu_err rc = kc_cuda_err(e, "cudaHostAlloc", __FILE__, __LINE__);
        return rc == FU_ECUDA ? FU_ENOMEM : rc;
    }
    *out = p;
    return FU_OK;
}

extern "C" void kern_cuda_host_free(void *p)
{
    if (!p)
        return;
    cudaError_t e = cudaFreeHost(p);
    if (e != cudaSuccess)
        (void)kc_cuda_err(e, "cudaFreeHost", __FILE__, __LINE__);
}

/* ------------------------------------------------------------------------------------------------
 * Elementwise ops */

template <typename TS, typename TD>
__global__ void k_convert(const TS *__restrict__ src, TD *__restrict__ dst, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = kc_st<TD>(kc_ld(src[i]));
}

template <typename T>
__global__ void k_add(const T *a, const T *b, T *y, int64_t n)
{
    /* y may alias a or b: each element is read then written by one thread. */
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = kc_st<T>(kc_ld(a[i]) + kc_ld(b[i]));
}

template <typename T>
__global__ void k_axpy(float alpha, const T *__restrict__ x, T *__restrict__ y, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = kc_st<T>(kc_ld(y[i]) + alpha * kc_ld(x[i]));
}

extern "C" fu_err kc_convert(const kern_backend_t *be, const kern_tensor_t *src, kern_tensor_t *dst)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = kern_tensor_numel(src);
    if (n != kern_tensor_numel(dst) || !kc_is_float(src->dtype) || !kc_is_float(dst->dtype))
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    if (src->dtype == dst->dtype) {
        KC_CUDA(cudaMemcpyAsync(dst->data, src->data, kern_tensor_nbytes(src), cudaMemcpyDeviceToDevice,
                                ctx->stream));
        return FU_OK;
    }
    KC_DISPATCH_FLOAT(src->dtype, TS, KC_DISPATCH_FLOAT(dst->dtype, TD, {
        k_convert<TS, TD><<<kc_blocks(n, 256), 256, 0, ctx->stream>>>((const TS *)src->data, (TD *)dst->data, n);
    }));
    KC_LAUNCHED();
    return FU_OK;
}

extern "C" fu_err kc_add(const kern_backend_t *be, const kern_tensor_t *a, const kern_tensor_t *b, kern_tensor_t *y)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = kern_tensor_numel(y);
    if (a->dtype != y->dtype || b->dtype != y->dtype || kern_tensor_numel(a) != n || kern_tensor_numel(b) != n)
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    KC_DISPATCH_FLOAT(y->dtype, T, {
        k_add<T><<<kc_blocks(n, 256), 256, 0, ctx->stream>>>((const T *)a->data, (const T *)b->data, (T *)y->data, n);
    });
    KC_LAUNCHED();
    return FU_OK;
}

extern "C" fu_err kc_axpy(const kern_backend_t *be, float alpha, const kern_tensor_t *x, kern_tensor_t *y)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = kern_tensor_numel(y);
    if (x->dtype != y->dtype || kern_tensor_numel(x) != n)
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    KC_DISPATCH_FLOAT(y->dtype, T, {
        k_axpy<T><<<kc_blocks(n, 256), 256, 0, ctx->stream>>>(alpha, (const T *)x->data, (T *)y->data, n);
    });
    KC_LAUNCHED();
    return FU_OK;
}

/* ------------------------------------------------------------------------------------------------
 * Instances */

static void ctx_teardown(kc_ctx *ctx)
{
    if (!ctx)
        return;
    if (cudaSetDevice(ctx->device) == cudaSuccess) {
        if (ctx->stream)
            (void)cudaStreamSynchronize(ctx->stream);
        if (ctx->blas)
            (void)ctx->blas_api->destroy(ctx->blas);
        pthread_mutex_lock(&ctx->lock);
        (void)pool_release_cached(ctx);
        kc_block *b = ctx->pool.live;
        if (b)
            fu_log(FU_LOG_WARN, KC_LOG_COMPONENT, "%s: closing with %zu bytes still allocated", ctx->name,
                   ctx->pool.live_bytes);
        while (b) {
            kc_block *next = b->next;
            (void)cudaFree(b->ptr);
            free(b);
            b = next;
        }
        ctx->pool.live = NULL;
        pthread_mutex_unlock(&ctx->lock);
        if (ctx->blas_ws)
            (void)cudaFree(ctx->blas_ws);
        if (ctx->d_flag)
            (void)cudaFree(ctx->d_flag);
        if (ctx->h_flag)
            (void)cudaFreeHost(ctx->h_flag);
        if (ctx->stream)
            (void)cudaStreamDestroy(ctx->stream);
    }
    (void)cudaGetLastError();
    pthread_mutex_destroy(&ctx->lock);
    pthread_mutex_destroy(&ctx->flag_lock);
    free(ctx);
}

static fu_err ctx_create(int device, kc_ctx **out)
{
    *out = NULL;
    int count = kern_cuda_device_count();
    if (device < 0 || device >= count) {
        fu_log(FU_LOG_WARN, KC_LOG_COMPONENT, "cuda:%d: no such device (%d found)", device, count);
        return FU_ENOTFOUND;
    }
    kc_ctx *ctx = (kc_ctx *)calloc(1, sizeof *ctx);
    if (!ctx)
        return FU_ENOMEM;
    ctx->device = device;
    snprintf(ctx->name, sizeof ctx->name, "cuda:%d", device);
    pthread_mutex_init(&ctx->lock, NULL);
    pthread_mutex_init(&ctx->flag_lock, NULL);
    fu_err rc = FU_OK;
    cudaDeviceProp prop;
#define CTX_CUDA(call)                                                   \
    do {                                                                 \
        cudaError_t e_ = (call);                                         \
        if (e_ != cudaSuccess) {                                         \
            rc = kc_cuda_err(e_, #call, __FILE__, __LINE__);             \
            goto fail;                                                   \
        }                                                                \
    } while (0)
    CTX_CUDA(cudaSetDevice(device));
    CTX_CUDA(cudaGetDeviceProperties(&prop, device));
    ctx->sm_count = prop.multiProcessorCount;
    ctx->cc_major = prop.major;
    ctx->cc_minor = prop.minor;
    ctx->smem_optin = prop.sharedMemPerBlockOptin;
    CTX_CUDA(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
    CTX_CUDA(cudaMalloc((void **)&ctx->d_flag, sizeof(int)));
    CTX_CUDA(cudaMemsetAsync(ctx->d_flag, 0, sizeof(int), ctx->stream)); /* a non-blocking stream is not */
    CTX_CUDA(cudaStreamSynchronize(ctx->stream));                          /* ordered after the legacy one */
    CTX_CUDA(cudaHostAlloc((void **)&ctx->h_flag, sizeof(int), cudaHostAllocDefault));
    *ctx->h_flag = 0;
    CTX_CUDA(cudaMalloc(&ctx->blas_ws, KC_BLAS_WS_BYTES));
#undef CTX_CUDA
    if ((rc = kc_blas_load(&ctx->blas_api)) != FU_OK)
        goto fail;
    {
        const kc_blas_api *api = ctx->blas_api;
        cublasStatus_t s = api->create(&ctx->blas);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = api->set_stream(ctx->blas, ctx->stream);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = api->set_workspace(ctx->blas, ctx->blas_ws, KC_BLAS_WS_BYTES);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = api->set_pointer_mode(ctx->blas, CUBLAS_POINTER_MODE_HOST);
        if (s != CUBLAS_STATUS_SUCCESS) {
            rc = kc_blas_err(s, "cublas setup", __FILE__, __LINE__);
            goto fail;
        }
    }
    ctx->be.name = ctx->name;
    ctx->be.device.kind = KERN_DEV_CUDA;
    ctx->be.device.index = device;
    ctx->be.impl = ctx;
    ctx->be.float_dtypes = (1u << KERN_F32) | (1u << KERN_F16) | (1u << KERN_BF16);
    ctx->be.alloc = kc_alloc;
    ctx->be.free = kc_free;
    ctx->be.copy_in = kc_copy_in;
    ctx->be.copy_out = kc_copy_out;
    ctx->be.copy = kc_copy;
    ctx->be.fill_zero = kc_fill_zero;
    ctx->be.synchronize = kc_synchronize;
    ctx->be.convert = kc_convert;
    ctx->be.gemm = kc_gemm;
    ctx->be.add = kc_add;
    ctx->be.axpy = kc_axpy;
    ctx->be.embedding_fwd = kc_embedding_fwd;
    ctx->be.embedding_bwd = kc_embedding_bwd;
    ctx->be.rmsnorm_fwd = kc_rmsnorm_fwd;
    ctx->be.rmsnorm_bwd = kc_rmsnorm_bwd;
    ctx->be.rope = kc_rope;
    ctx->be.silu_mul_fwd = kc_silu_mul_fwd;
    ctx->be.silu_mul_bwd = kc_silu_mul_bwd;
    ctx->be.attn_ws_bytes = kc_attn_ws_bytes;
    ctx->be.attn_fwd = kc_attn_fwd;
    ctx->be.attn_bwd = kc_attn_bwd;
    ctx->be.xent_fwd = kc_xent_fwd;
    ctx->be.xent_bwd = kc_xent_bwd;
    ctx->be.xent_fused = kc_xent_fused;
    ctx->be.adamw = kc_adamw;
    ctx->be.sample = kc_sample;
    ctx->be.sparse_matmul = kc_sparse_matmul;
    ctx->be.sparse_matmul_dx = kc_sparse_matmul_dx;
    fu_log(FU_LOG_INFO, KC_LOG_COMPONENT, "%s: %s, sm_%d%d, %d SMs, %.1f GiB", ctx->name, prop.name, prop.major,
           prop.minor, prop.multiProcessorCount, (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0));
    *out = ctx;
    return FU_OK;
fail:
    ctx_teardown(ctx);
    return rc;
}

extern "C" fu_err kern_backend_cuda_open(int device, kern_backend_t **out)
{
    if (!out)
        return FU_EINVAL;
    *out = NULL;
    kc_ctx *ctx = NULL;
    FU_TRY(ctx_create(device, &ctx));
    *out = &ctx->be;
    return FU_OK;
}

extern "C" void kern_backend_cuda_close(kern_backend_t **be_p)
{
    if (!be_p || !*be_p)
        return;
    kern_backend_t *be = *be_p;
    *be_p = NULL;
    if (be->device.kind != KERN_DEV_CUDA || !be->impl)
        return;
    ctx_teardown(kc_of(be));
}

static pthread_mutex_t g_shared_lock = PTHREAD_MUTEX_INITIALIZER;
static kc_ctx *g_shared[KERN_CUDA_MAX_DEVICES];

extern "C" fu_err kern_backend_cuda(int ordinal, const kern_backend_t **out)
{
    if (!out)
        return FU_EINVAL;
    *out = NULL;
    if (ordinal < 0 || ordinal >= KERN_CUDA_MAX_DEVICES)
        return FU_ENOTFOUND;
    pthread_mutex_lock(&g_shared_lock);
    fu_err rc = FU_OK;
    if (!g_shared[ordinal])
        rc = ctx_create(ordinal, &g_shared[ordinal]);
    if (rc == FU_OK)
        *out = &g_shared[ordinal]->be;
    pthread_mutex_unlock(&g_shared_lock);
    return rc;
}
