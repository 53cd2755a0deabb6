/* CUDA backend: the row-wise layer ops of a LLaMA block and of training. All accumulate in f32
 * whatever the storage dtype; each matches the CPU op's formula (kern_cpu_ops.c) step by step so
 * that f32 results agree to rounding.
 *   embedding fwd (gather rows) / bwd (scatter-add with atomics)
 *   rmsnorm fwd (one block per row) / bwd (one block per row for dx; a column pass for dw that sums
 *     fixed row chunks then the chunks in order, so dw is deterministic)
 *   rope (rotate-half; one thread per (token, pair), angles as the CPU computes them)
 *   silu·mul fwd / bwd (elementwise)
 *   cross-entropy fwd (one block per row: max, sum, lse; a one-block reduction in double) / bwd
 *     (fused softmax - onehot, scaled by grad_scale / n_valid read on the device; in place allowed)
 *     / fused fwd+bwd (one lse per row gives both the row loss and the gradient row)
 *   AdamW (elementwise, the CPU backend's PyTorch formulation, bias corrections in double). */
#include <math.h>

#include "kern_cuda_internal.cuh"

#define NN_THREADS 256

/* ---------------------------------------------------------------------------------------------- */
/* Embedding */

template <typename T>
__global__ void k_embed_fwd(const int32_t *__restrict__ ids, const T *__restrict__ table, T *__restrict__ out,
                            int64_t vocab, int64_t d, int *flag)
{
    const int64_t i = blockIdx.x;
    const int32_t id = ids[i];
    T *o = out + i * d;
    if (id < 0 || (int64_t)id >= vocab) {
        if (threadIdx.x == 0)
            atomicOr(flag, KC_FLAG_BAD_INDEX);
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
            o[j] = kc_st<T>(0.0f);
        return;
    }
    const T *src = table + (int64_t)id * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
        o[j] = src[j];
}

__device__ __forceinline__ void kc_atomic_add(float *p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void kc_atomic_add(__half *p, float v) { atomicAdd(p, __float2half_rn(v)); }
__device__ __forceinline__ void kc_atomic_add(__nv_bfloat16 *p, float v) { atomicAdd(p, __float2bfloat16_rn(v)); }

template <typename T>
__global__ void k_embed_bwd(const int32_t *__restrict__ ids, const T *__restrict__ dout, T *__restrict__ dtable,
                            int64_t vocab, int64_t d, int *flag)
{
    const int64_t i = blockIdx.x;
    const int32_t id = ids[i];
    if (id < 0 || (int64_t)id >= vocab) {
        if (threadIdx.x == 0)
            atomicOr(flag, KC_FLAG_BAD_INDEX);
        return;
    }
    const T *g = dout + i * d;
    T *dst = dtable + (int64_t)id * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
        kc_atomic_add(&dst[j], kc_ld(g[j]));
}

/* Both embedding ops: src [n, d] rows are read and dst rows written through the ids i32 [n], one
 * block per id. Forward: src is the table [vocab, d], dst the output; backward: src is dout, dst the
 * table gradient (scatter-add). */
static fu_err embed_run(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *src, kern_tensor_t *dst,
                        bool backward)
{
    kc_ctx *ctx = kc_of(be);
    const kern_tensor_t *table = backward ? dst : src, *rows = backward ? src : dst;
    if (ids->dtype != KERN_I32 || table->ndim != 2 || src->dtype != dst->dtype)
        return FU_EINVAL;
    int64_t n = kern_tensor_numel(ids), vocab = table->shape[0], d = table->shape[1];
    if (kern_tensor_numel(rows) != n * d)
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    if (n > INT32_MAX)
        return FU_EINVAL;
    if (!kc_is_float(dst->dtype))
        return FU_EINVAL;
    FU_TRY(kc_enter(ctx));
    kc_flag_begin(ctx);
    KC_DISPATCH_KNOWN_FLOAT(dst->dtype, T, {
        const int32_t *id = (const int32_t *)ids->data;
        if (backward)
            k_embed_bwd<T><<<(unsigned)n, NN_THREADS, 0, ctx->stream>>>(id, (const T *)src->data, (T *)dst->data,
                                                                        vocab, d, ctx->d_flag);
        else
            k_embed_fwd<T><<<(unsigned)n, NN_THREADS, 0, ctx->stream>>>(id, (const T *)src->data, (T *)dst->data,
                                                                        vocab, d, ctx->d_flag);
    });
    cudaError_t e = cudaGetLastError();
    const char *what = backward ? "embedding backward" : "embedding forward";
    return kc_flag_end(ctx, e == cudaSuccess ? FU_OK : kc_cuda_err(e, what, __FILE__, __LINE__), what);
}

extern "C" fu_err kc_embedding_fwd(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *table,
                                   kern_tensor_t *out)
{
    return embed_run(be, ids, table, out, false);
}

extern "C" fu_err kc_embedding_bwd(const kern_backend_t *be, const kern_tensor_t *ids, const kern_tensor_t *dout,
                                   kern_tensor_t *dtable)
{
    return embed_run(be, ids, dout, dtable, true);
}

/* ---------------------------------------------------------------------------------------------- */
/* RMSNorm */

template <typename T>
__global__ void k_rmsnorm_fwd(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y, int64_t d,
                              float eps)
{
    __shared__ float red[32];
    const T *xr = x + (int64_t)blockIdx.x * d;
    T *yr = y + (int64_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
        float v = kc_ld(xr[j]);
        ss += v * v;
    }
    ss = kc_block_sum(ss, red);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
        yr[j] = kc_st<T>(kc_ld(xr[j]) * r * kc_ld(w[j]));
}

/* dx row and r (the row's 1/rms) for the dw pass. */
template <typename T>
__global__ void k_rmsnorm_bwd_rows(const T *__restrict__ dy, const T *__restrict__ x, const T *__restrict__ w,
                                   T *__restrict__ dx, float *__restrict__ rrow, int64_t d, float eps)
{
    __shared__ float red[32];
    const int64_t row = blockIdx.x;
    const T *xr = x + row * d, *gr = dy + row * d;
    float ss = 0.0f, dot = 0.0f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
        float xv = kc_ld(xr[j]);
        ss += xv * xv;
        dot += kc_ld(gr[j]) * kc_ld(w[j]) * xv;
    }
    ss = kc_block_sum(ss, red);
    dot = kc_block_sum(dot, red);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    const float c = r * r * r * dot / (float)d;
    if (threadIdx.x == 0)
        rrow[row] = r;
    if (dx) {
        T *dr = dx + row * d;
        for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
            dr[j] = kc_st<T>(r * kc_ld(w[j]) * kc_ld(gr[j]) - c * kc_ld(xr[j]));
    }
}

/* partial[c, j] = sum over rows [c*chunk, (c+1)*chunk) of dy[i,j]*x[i,j]*r[i]. */
template <typename T>
__global__ void k_rmsnorm_bwd_dw_partial(const T *__restrict__ dy, const T *__restrict__ x,
                                         const float *__restrict__ rrow, float *__restrict__ partial, int64_t n,
                                         int64_t d, int64_t chunk)
{
    const int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; /* chunks on x: 2^31-1 of them */
    if (j >= d)
        return;
    const int64_t c = blockIdx.x;
    int64_t i0 = c * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;
    float acc = 0.0f;
    for (int64_t i = i0; i < i1; i++)
        acc += kc_ld(dy[i * d + j]) * kc_ld(x[i * d + j]) * rrow[i];
    partial[c * d + j] = acc;
}

template <typename T>
__global__ void k_rmsnorm_bwd_dw_final(const float *__restrict__ partial, T *__restrict__ dw, int64_t d,
                                       int64_t chunks)
{
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d)
        return;
    float acc = 0.0f;
    for (int64_t c = 0; c < chunks; c++)
        acc += partial[c * d + j];
    dw[j] = kc_st<T>(kc_ld(dw[j]) + acc);
}

/* The rows of an RMSNorm: x [..., d] with w [d] (one block per row, so n must fit a grid) gives
 * *n rows of *d. */
static fu_err rmsnorm_rows(const kern_tensor_t *x, const kern_tensor_t *w, int64_t *n, int64_t *d)
{
    *d = kern_tensor_numel(w);
    if (*d <= 0 || x->shape[x->ndim - 1] != *d)
        return FU_EINVAL;
    *n = kern_tensor_numel(x) / *d;
    return *n > INT32_MAX ? FU_EINVAL : FU_OK;
}

extern "C" fu_err kc_rmsnorm_fwd(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w, float eps,
                                 kern_tensor_t *y)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = 0, d = 0;
    FU_TRY(rmsnorm_rows(x, w, &n, &d));
    if (x->dtype != y->dtype || w->dtype != x->dtype || kern_tensor_numel(y) != kern_tensor_numel(x))
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    KC_DISPATCH_FLOAT(x->dtype, T, {
        k_rmsnorm_fwd<T><<<(unsigned)n, NN_THREADS, 0, ctx->stream>>>((const T *)x->data, (const T *)w->data,
                                                                      (T *)y->data, d, eps);
    });
    KC_LAUNCHED();
    return FU_OK;
}

extern "C" fu_err kc_rmsnorm_bwd(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                                 const kern_tensor_t *w, float eps, kern_tensor_t *dx, kern_tensor_t *dw)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = 0, d = 0;
    FU_TRY(rmsnorm_rows(x, w, &n, &d));
    kern_dtype dt = x->dtype;
    if (dy->dtype != dt || w->dtype != dt || (dx && dx->dtype != dt) || (dw && dw->dtype != dt) ||
        kern_tensor_numel(dy) != kern_tensor_numel(x) || (dx && kern_tensor_numel(dx) != kern_tensor_numel(x)) ||
        (dw && kern_tensor_numel(dw) != d))
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    if (!kc_is_float(dt))
        return FU_EINVAL;
    FU_TRY(kc_enter(ctx));
    const int64_t chunk = 64;
    const int64_t chunks = (n + chunk - 1) / chunk, col_blocks = (d + NN_THREADS - 1) / NN_THREADS;
    if (col_blocks > 65535 || chunks > INT32_MAX) /* grid y, x */
        return FU_EINVAL;
    float *scr = NULL;
    size_t bytes = (size_t)n * sizeof(float) + (dw ? (size_t)(chunks * d) * sizeof(float) : 0);
    FU_TRY(kc_scratch(ctx, bytes, (void **)&scr));
    float *rrow = scr, *partial = scr + n;
    fu_err rc = FU_OK;
    KC_DISPATCH_KNOWN_FLOAT(dt, T, { /* scratch is held: no early return */
        k_rmsnorm_bwd_rows<T><<<(unsigned)n, NN_THREADS, 0, ctx->stream>>>(
            (const T *)dy->data, (const T *)x->data, (const T *)w->data, dx ? (T *)dx->data : (T *)NULL, rrow, d, eps);
        if (dw) {
            dim3 grid((unsigned)chunks, (unsigned)col_blocks);
            k_rmsnorm_bwd_dw_partial<T><<<grid, NN_THREADS, 0, ctx->stream>>>((const T *)dy->data, (const T *)x->data,
                                                                              rrow, partial, n, d, chunk);
            k_rmsnorm_bwd_dw_final<T><<<(unsigned)col_blocks, NN_THREADS, 0, ctx->stream>>>(partial, (T *)dw->data, d,
                                                                                            chunks);
        }
    });
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        rc = kc_cuda_err(e, "rmsnorm backward launch", __FILE__, __LINE__);
    kc_scratch_free(ctx, scr);
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* RoPE (rotate-half). One thread per (token, i < half); it rotates pair i of every head. The angle
 * is computed exactly as the CPU does: inv_freq = float(1/theta^(2i/hd)) in double, a = float(pos) *
 * inv_freq in float, cos/sin in double of that float. y may be x. */

struct kc_rope_freq {
    float inv[KERN_ROPE_MAX_HEAD_DIM / 2]; /* kern_rope_inv_freq's table, passed by value (1 KiB) */
};

template <typename T>
__global__ void k_rope(const T *x, const int32_t *__restrict__ pos, T *y, int64_t n, int64_t f, int half, int heads,
                       kc_rope_freq fr, float sgn)
{
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n * half;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t t = idx / half;
        const int i = (int)(idx % half);
        const float inv_freq = fr.inv[i];
        const float a = (float)pos[t] * inv_freq;
        const float cs = (float)cos((double)a), sn = sgn * (float)sin((double)a);
        for (int h = 0; h < heads; h++) {
            const int64_t base = t * f + (int64_t)h * 2 * half;
            float x1 = kc_ld(x[base + i]), x2 = kc_ld(x[base + i + half]);
            y[base + i] = kc_st<T>(x1 * cs - x2 * sn);
            y[base + i + half] = kc_st<T>(x2 * cs + x1 * sn);
        }
    }
}

extern "C" fu_err kc_rope(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos, int head_dim,
                          const kern_rope_params *rp, bool inverse, kern_tensor_t *y)
{
    kc_ctx *ctx = kc_of(be);
    kc_rope_freq fr;
    if (pos->dtype != KERN_I32 || x->dtype != y->dtype || kern_rope_inv_freq(rp, head_dim, fr.inv) != FU_OK)
        return FU_EINVAL;
    int64_t n = kern_tensor_numel(pos);
    if (n == 0)
        return FU_OK;
    int64_t total = kern_tensor_numel(x);
    if (total % n || kern_tensor_numel(y) != total)
        return FU_EINVAL;
    int64_t f = total / n;
    if (f % head_dim)
        return FU_EINVAL;
    FU_TRY(kc_enter(ctx));
    const int half = head_dim / 2;
    const int heads = (int)(f / head_dim);
    const int64_t items = n * half;
    KC_DISPATCH_FLOAT(x->dtype, T, {
        k_rope<T><<<kc_blocks(items, NN_THREADS), NN_THREADS, 0, ctx->stream>>>(
            (const T *)x->data, (const int32_t *)pos->data, (T *)y->data, n, f, half, heads, fr,
            inverse ? -1.0f : 1.0f);
    });
    KC_LAUNCHED();
    return FU_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* SwiGLU */

__device__ __forceinline__ float kc_sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <typename T>
__global__ void k_silu_mul_fwd(const T *__restrict__ gate, const T *__restrict__ up, T *__restrict__ out, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = kc_ld(gate[i]);
        out[i] = kc_st<T>(g * kc_sigmoid(g) * kc_ld(up[i]));
    }
}

template <typename T>
__global__ void k_silu_mul_bwd(const T *__restrict__ dout, const T *__restrict__ gate, const T *__restrict__ up,
                               T *__restrict__ dgate, T *__restrict__ dup, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = kc_ld(gate[i]), u = kc_ld(up[i]), d = kc_ld(dout[i]);
        float s = kc_sigmoid(g);
        float silu = g * s;
        float dsilu = s * (1.0f + g * (1.0f - s));
        dgate[i] = kc_st<T>(d * u * dsilu);
        dup[i] = kc_st<T>(d * silu);
    }
}

extern "C" fu_err kc_silu_mul_fwd(const kern_backend_t *be, const kern_tensor_t *gate, const kern_tensor_t *up,
                                  kern_tensor_t *out)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = kern_tensor_numel(out);
    if (gate->dtype != out->dtype || up->dtype != out->dtype || kern_tensor_numel(gate) != n ||
        kern_tensor_numel(up) != n)
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    KC_DISPATCH_FLOAT(out->dtype, T, {
        k_silu_mul_fwd<T><<<kc_blocks(n, NN_THREADS), NN_THREADS, 0, ctx->stream>>>(
            (const T *)gate->data, (const T *)up->data, (T *)out->data, n);
    });
    KC_LAUNCHED();
    return FU_OK;
}

extern "C" fu_err kc_silu_mul_bwd(const kern_backend_t *be, const kern_tensor_t *dout, const kern_tensor_t *gate,
                                  const kern_tensor_t *up, kern_tensor_t *dgate, kern_tensor_t *dup)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = kern_tensor_numel(dout);
    kern_dtype dt = dout->dtype;
    if (gate->dtype != dt || up->dtype != dt || dgate->dtype != dt || dup->dtype != dt ||
        kern_tensor_numel(gate) != n || kern_tensor_numel(up) != n || kern_tensor_numel(dgate) != n ||
        kern_tensor_numel(dup) != n)
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    KC_DISPATCH_FLOAT(dt, T, {
        k_silu_mul_bwd<T><<<kc_blocks(n, NN_THREADS), NN_THREADS, 0, ctx->stream>>>(
            (const T *)dout->data, (const T *)gate->data, (const T *)up->data, (T *)dgate->data, (T *)dup->data, n);
    });
    KC_LAUNCHED();
    return FU_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Cross-entropy */

#define XENT_THREADS 1024

/* Row max and log-sum-exp over V columns; call from every thread of the block. */
template <typename T>
__device__ __forceinline__ float xent_row_lse(const T *row, int64_t V, float *red)
{
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        mx = fmaxf(mx, kc_ld(row[j]));
    mx = kc_block_max(mx, red);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        s += expf(kc_ld(row[j]) - mx);
    s = kc_block_sum(s, red);
    return mx + logf(s);
}

/* Row i does not count (its target t is ignore or out of range): thread 0 records loss 0 and
 * valid 0, and raises the flag for an out-of-range target. */
__device__ __forceinline__ void xent_skip_row(int64_t i, int32_t t, int32_t ignore, float *loss_row, int *valid,
                                              int *flag)
{
    if (threadIdx.x == 0) {
        loss_row[i] = 0.0f;
        valid[i] = 0;
        if (t != ignore)
            atomicOr(flag, KC_FLAG_BAD_INDEX);
    }
}

/* loss_row[i] = lse - row[t] for counted rows, 0 otherwise; valid[i] = 1 for counted rows. */
template <typename T>
__global__ void __launch_bounds__(XENT_THREADS) k_xent_rows(const T *__restrict__ logits, const int32_t *__restrict__ tg, float *__restrict__ loss_row,
                            int *__restrict__ valid, int64_t V, int32_t ignore, int *flag)
{
    __shared__ float red[32];
    const int64_t i = blockIdx.x;
    const int32_t t = tg[i];
    if (t == ignore || t < 0 || (int64_t)t >= V) {
        xent_skip_row(i, t, ignore, loss_row, valid, flag);
        return;
    }
    const T *row = logits + i * V;
    float lse = xent_row_lse(row, V, red);
    if (threadIdx.x == 0) {
        loss_row[i] = lse - kc_ld(row[t]);
        valid[i] = 1;
    }
}

/* One block: sum (double) and count over n rows in a fixed order. out_sum[0], out_cnt[0]. */
__global__ void __launch_bounds__(XENT_THREADS) k_xent_reduce(const float *__restrict__ loss_row, const int *__restrict__ valid, int64_t n,
                              double *out_sum, long long *out_cnt)
{
    __shared__ double ssum[XENT_THREADS];
    __shared__ long long scnt[XENT_THREADS];
    double s = 0.0;
    long long c = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        s += (double)loss_row[i];
        c += valid[i];
    }
    ssum[threadIdx.x] = s;
    scnt[threadIdx.x] = c;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            ssum[threadIdx.x] += ssum[threadIdx.x + w];
            scnt[threadIdx.x] += scnt[threadIdx.x + w];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        *out_sum = ssum[0];
        *out_cnt = scnt[0];
    }
}

/* Counts the counted rows (flags bad targets) into *cnt. One block. */
__global__ void __launch_bounds__(XENT_THREADS) k_xent_count(const int32_t *__restrict__ tg, int64_t n, int64_t V, int32_t ignore, int *cnt, int *flag)
{
    __shared__ int scnt[XENT_THREADS];
    int c = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        int32_t t = tg[i];
        if (t == ignore)
            continue;
        if (t < 0 || (int64_t)t >= V)
            atomicOr(flag, KC_FLAG_BAD_INDEX);
        else
            c++;
    }
    scnt[threadIdx.x] = c;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w)
            scnt[threadIdx.x] += scnt[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        *cnt = scnt[0];
}

/* dlogits row = scale*(softmax - onehot), scale = grad_scale / n_valid; may run in place. */
template <typename T>
__global__ void __launch_bounds__(XENT_THREADS) k_xent_bwd_rows(const T *logits, const int32_t *__restrict__ tg, T *dlogits, int64_t V, int32_t ignore,
                                float grad_scale, const int *cnt)
{
    __shared__ float red[32];
    const int64_t i = blockIdx.x;
    const int32_t t = tg[i];
    const T *row = logits + i * V;
    T *drow = dlogits + i * V;
    const int nv = *cnt;
    if (t == ignore || t < 0 || (int64_t)t >= V || nv == 0) {
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
            drow[j] = kc_st<T>(0.0f);
        return;
    }
    const float scale = grad_scale / (float)nv;
    const float lse = xent_row_lse(row, V, red); /* every read of row ends before the first write */
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        float v = expf(kc_ld(row[j]) - lse) * scale;
        if (j == (int64_t)t)
            v -= scale;
        drow[j] = kc_st<T>(v);
    }
}

/* Fused forward+backward for one row: loss_row/valid as k_xent_rows, and the gradient row as
 * k_xent_bwd_rows, from one log-sum-exp. In place allowed: the target logit is read by every
 * thread before the reductions' barriers, and every write comes after them. */
template <typename T>
__global__ void __launch_bounds__(XENT_THREADS) k_xent_fused_rows(const T *logits, const int32_t *__restrict__ tg, T *dlogits,
                                  float *__restrict__ loss_row, int *__restrict__ valid, int64_t V, int32_t ignore,
                                  float grad_scale, const int *cnt, int *flag)
{
    __shared__ float red[32];
    const int64_t i = blockIdx.x;
    const int32_t t = tg[i];
    const T *row = logits + i * V;
    T *drow = dlogits + i * V;
    if (t == ignore || t < 0 || (int64_t)t >= V) {
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
            drow[j] = kc_st<T>(0.0f);
        xent_skip_row(i, t, ignore, loss_row, valid, flag);
        return;
    }
    const float xt = kc_ld(row[t]);
    const float lse = xent_row_lse(row, V, red);
    const int nv = *cnt;
    const float scale = nv ? grad_scale / (float)nv : 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        float v = expf(kc_ld(row[j]) - lse) * scale;
        if (j == (int64_t)t)
            v -= scale;
        drow[j] = kc_st<T>(v);
    }
    if (threadIdx.x == 0) {
        loss_row[i] = lse - xt;
        valid[i] = 1;
    }
}

/* n and V of logits [n, V] (a float dtype) with targets i32 [n], and dlogits (when not NULL) of
 * logits' dtype and size. */
static fu_err xent_shape(const kern_tensor_t *logits, const kern_tensor_t *targets, const kern_tensor_t *dlogits,
                         int64_t *n, int64_t *V)
{
    if (logits->ndim != 2 || targets->dtype != KERN_I32 || !kc_is_float(logits->dtype))
        return FU_EINVAL;
    *n = logits->shape[0];
    *V = logits->shape[1];
    if (kern_tensor_numel(targets) != *n || *n > INT32_MAX || *V <= 0)
        return FU_EINVAL;
    if (dlogits && (dlogits->dtype != logits->dtype || kern_tensor_numel(dlogits) != *n * *V))
        return FU_EINVAL;
    return FU_OK;
}

/* The forward (dlogits NULL) or the fused forward+backward: per-row losses (and gradient rows),
 * then their mean over the counted rows, summed in double in a fixed order. */
static fu_err xent_loss(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                        int32_t ignore_index, float grad_scale, kern_tensor_t *dlogits, float *loss, int64_t *n_valid)
{
    kc_ctx *ctx = kc_of(be);
    const char *what = dlogits ? "cross-entropy fused" : "cross-entropy forward";
    int64_t n = 0, V = 0;
    FU_TRY(xent_shape(logits, targets, dlogits, &n, &V));
    *loss = 0.0f;
    *n_valid = 0;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    /* scratch: loss_row[n] f32 | valid[n] i32 | sum f64 | cnt i64 | count i32 (fused only) */
    size_t off_valid = (size_t)n * sizeof(float);
    size_t off_sum = (off_valid + (size_t)n * sizeof(int) + 15) & ~(size_t)15;
    size_t bytes = off_sum + (dlogits ? 32 : 16);
    char *scr = NULL;
    FU_TRY(kc_scratch(ctx, bytes, (void **)&scr));
    float *loss_row = (float *)scr;
    int *valid = (int *)(scr + off_valid);
    double *d_sum = (double *)(scr + off_sum);
    long long *d_cnt = (long long *)(scr + off_sum + 8);
    int *d_count = (int *)(scr + off_sum + 16);
    const int32_t *tg = (const int32_t *)targets->data;
    struct {
        double sum;
        long long cnt;
    } host = {0.0, 0};
    kc_flag_begin(ctx);
    if (dlogits)
        k_xent_count<<<1, XENT_THREADS, 0, ctx->stream>>>(tg, n, V, ignore_index, d_count, ctx->d_flag);
    KC_DISPATCH_KNOWN_FLOAT(logits->dtype, T, {
        if (dlogits)
            k_xent_fused_rows<T><<<(unsigned)n, XENT_THREADS, 0, ctx->stream>>>(
                (const T *)logits->data, tg, (T *)dlogits->data, loss_row, valid, V, ignore_index, grad_scale, d_count,
                ctx->d_flag);
        else
            k_xent_rows<T><<<(unsigned)n, XENT_THREADS, 0, ctx->stream>>>((const T *)logits->data, tg, loss_row, valid,
                                                                          V, ignore_index, ctx->d_flag);
    });
    k_xent_reduce<<<1, XENT_THREADS, 0, ctx->stream>>>(loss_row, valid, n, d_sum, d_cnt);
    fu_err rc = FU_OK;
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(&host, d_sum, 16, cudaMemcpyDeviceToHost, ctx->stream);
    if (e != cudaSuccess)
        rc = kc_cuda_err(e, what, __FILE__, __LINE__);
    rc = kc_flag_end(ctx, rc, what); /* also waits for the copy */
    kc_scratch_free(ctx, scr);
    if (rc != FU_OK)
        return rc;
    *n_valid = host.cnt;
    *loss = host.cnt ? (float)(host.sum / (double)host.cnt) : 0.0f;
    return FU_OK;
}

extern "C" fu_err kc_xent_fwd(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                              int32_t ignore_index, float *loss, int64_t *n_valid)
{
    return xent_loss(be, logits, targets, ignore_index, 0.0f, NULL, loss, n_valid);
}

extern "C" fu_err kc_xent_fused(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                                int32_t ignore_index, float grad_scale, float *loss, int64_t *n_valid,
                                kern_tensor_t *dlogits)
{
    return xent_loss(be, logits, targets, ignore_index, grad_scale, dlogits, loss, n_valid);
}

extern "C" fu_err kc_xent_bwd(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                              int32_t ignore_index, float grad_scale, kern_tensor_t *dlogits)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = 0, V = 0;
    FU_TRY(xent_shape(logits, targets, dlogits, &n, &V));
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    int *d_cnt = NULL;
    FU_TRY(kc_scratch(ctx, sizeof(int), (void **)&d_cnt));
    fu_err rc = FU_OK;
    kc_flag_begin(ctx);
    k_xent_count<<<1, XENT_THREADS, 0, ctx->stream>>>((const int32_t *)targets->data, n, V, ignore_index, d_cnt,
                                                      ctx->d_flag);
    KC_DISPATCH_KNOWN_FLOAT(logits->dtype, T, {
        k_xent_bwd_rows<T><<<(unsigned)n, XENT_THREADS, 0, ctx->stream>>>(
            (const T *)logits->data, (const int32_t *)targets->data, (T *)dlogits->data, V, ignore_index, grad_scale,
            d_cnt);
    });
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        rc = kc_cuda_err(e, "cross-entropy backward", __FILE__, __LINE__);
    rc = kc_flag_end(ctx, rc, "cross-entropy backward");
    kc_scratch_free(ctx, d_cnt);
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* AdamW */

/* The CPU backend's formulation (PyTorch's): w = w*(1 - lr*wd) - step_size*m / (sqrt(v)/sqrt(bc2) + eps)
 * with step_size = lr/bc1. All four tensors share one dtype; arithmetic is f32. */
template <typename T>
__global__ void k_adamw(T *__restrict__ p, const T *__restrict__ g, T *__restrict__ m, T *__restrict__ v, int64_t n,
                        float b1, float b2, float eps, float decay, float step_size, float inv_sqrt_bc2)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float gi = kc_ld(g[i]);
        float mi = b1 * kc_ld(m[i]) + (1.0f - b1) * gi;
        float vi = b2 * kc_ld(v[i]) + (1.0f - b2) * gi * gi;
        m[i] = kc_st<T>(mi);
        v[i] = kc_st<T>(vi);
        float denom = sqrtf(vi) * inv_sqrt_bc2 + eps;
        p[i] = kc_st<T>(kc_ld(p[i]) * decay - step_size * mi / denom);
    }
}

extern "C" fu_err kc_adamw(const kern_backend_t *be, kern_tensor_t *param, const kern_tensor_t *grad, kern_tensor_t *m,
                           kern_tensor_t *v, const kern_adamw_params *p, int64_t step)
{
    kc_ctx *ctx = kc_of(be);
    int64_t n = kern_tensor_numel(param);
    const kern_dtype dt = param->dtype;
    if (!kc_is_float(dt) || m->dtype != dt || v->dtype != dt || grad->dtype != dt ||
        kern_tensor_numel(grad) != n || kern_tensor_numel(m) != n || kern_tensor_numel(v) != n || step < 1)
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    const double bc1 = 1.0 - pow((double)p->beta1, (double)step);
    const double bc2 = 1.0 - pow((double)p->beta2, (double)step);
    const float decay = 1.0f - p->lr * p->weight_decay;
    const float step_size = (float)((double)p->lr / bc1);
    const float inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    KC_DISPATCH_FLOAT(dt, T, {
        k_adamw<T><<<kc_blocks(n, NN_THREADS), NN_THREADS, 0, ctx->stream>>>(
            (T *)param->data, (const T *)grad->data, (T *)m->data, (T *)v->data, n, p->beta1, p->beta2, p->eps, decay,
            step_size, inv_sqrt_bc2);
    });
    KC_LAUNCHED();
    return FU_OK;
}
