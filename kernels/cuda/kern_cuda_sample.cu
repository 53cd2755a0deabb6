/* CUDA backend: token sampling with the CPU backend's semantics (kern_sample.c), on the device.
 *
 *   greedy            k_argmax: one block per row, (value, id) reduction, lowest id on ties, NaN as -inf.
 *   temperature only  k_sample_plain: probabilities in id order, block-wide double prefix sums (CUB
 *                     BlockScan) to find the first id whose cumulative mass exceeds u·total.
 *   top-k / top-p     the scaled logits of each row are sorted descending with their ids by CUB's
 *                     segmented radix sort (stable, so ties keep ascending ids: the CPU's order), then
 *                     k_sample_sorted applies top-k (a prefix), top-p (prefix sums of p/total) and
 *                     draws from the kept prefix.
 * The uniform u of row r is kern_rng_hash_uniform(seed, counter, r), computed on the host with the
 * CPU backend's own function and copied to the device, so a draw is a pure function of
 * (seed, counter, row) on both backends. Sums run in double as on the CPU but in a different order,
 * so a draw that falls within rounding of a boundary may pick the neighbouring token. */
#include <cub/cub.cuh>
#include <math.h>
#include <stdlib.h>

#include "kern_cuda_internal.cuh"
#include "kern_rng.h"

#define SMP_THREADS 1024

__device__ __forceinline__ float smp_clean(float x)
{
    return isnan(x) ? -INFINITY : x;
}

__device__ __forceinline__ bool smp_better(float v, int id, float bv, int bid)
{
    return v > bv || (v == bv && id < bid);
}

/* Warp-wide (value, id) maximum under smp_better; every lane ends with the warp's best pair. */
__device__ __forceinline__ void smp_warp_best(float *bv, int *bid)
{
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, *bv, o);
        int oid = __shfl_xor_sync(0xffffffffu, *bid, o);
        if (smp_better(ov, oid, *bv, *bid)) {
            *bv = ov;
            *bid = oid;
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(SMP_THREADS) k_argmax(const T *__restrict__ logits, int64_t V, int32_t *out)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    const T *row = logits + (int64_t)blockIdx.x * V;
    float bv = -INFINITY;
    int bid = INT32_MAX;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        float v = smp_clean(kc_ld(row[j]));
        if (smp_better(v, (int)j, bv, bid)) {
            bv = v;
            bid = (int)j;
        }
    }
    smp_warp_best(&bv, &bid);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = bv;
        si[warp] = bid;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : -INFINITY;
        bid = lane < nw ? si[lane] : INT32_MAX;
        smp_warp_best(&bv, &bid);
        if (lane == 0)
            out[blockIdx.x] = bid == INT32_MAX ? 0 : bid;
    }
}

/* Block sum of doubles (all threads get it). */
__device__ double smp_block_sum(double v, double *red)
{
    return kc_block_reduce(v, red, 0.0, kc_sum_op());
}

typedef cub::BlockScan<double, SMP_THREADS> smp_scan;

/* First index i < n (in order) with base + prefix(vals) > target (strict) or >= target (!strict);
 * n when none. val(i) is evaluated by every thread for its i. */
template <typename F>
__device__ int64_t smp_find_first(int64_t n, double target, bool strict, F val, typename smp_scan::TempStorage &ts,
                                  int *found)
{
    if (threadIdx.x == 0)
        *found = INT32_MAX;
    __syncthreads();
    double run = 0.0;
    int64_t res = n;
    for (int64_t base = 0; base < n; base += blockDim.x) {
        const int64_t i = base + threadIdx.x;
        const double e = i < n ? val(i) : 0.0;
        double incl = 0.0, agg = 0.0;
        smp_scan(ts).InclusiveSum(e, incl, agg);
        const double acc = run + incl;
        if (i < n && (strict ? acc > target : acc >= target))
            atomicMin(found, (int)(i - base));
        __syncthreads();
        const int f = *found;
        if (f != INT32_MAX) {
            res = base + f;
            break;
        }
        run += agg;
    }
    __syncthreads();
    return res;
}

/* Temperature only. out[row] holds the greedy token already (the fallback the CPU uses). The
 * scaled logit is a separately rounded product (__fmul_rn): contracting it into an FMA with the
 * subtraction would round differently from the CPU. */
template <typename T>
__global__ void __launch_bounds__(SMP_THREADS) k_sample_plain(const T *__restrict__ logits, int64_t V, float invt,
                                                              const double *__restrict__ u, int32_t *out)
{
    __shared__ typename smp_scan::TempStorage ts;
    __shared__ float red[32];
    __shared__ double dred[32];
    __shared__ int found;
    const T *row = logits + (int64_t)blockIdx.x * V;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        mx = fmaxf(mx, __fmul_rn(smp_clean(kc_ld(row[j])), invt));
    mx = kc_block_max(mx, red);
    if (isinf(mx))
        return;
    double tot = 0.0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
        tot += exp((double)(__fmul_rn(smp_clean(kc_ld(row[j])), invt) - mx));
    tot = smp_block_sum(tot, dred);
    const double target = u[blockIdx.x] * tot;
    int64_t j = smp_find_first(
        V, target, true, [&](int64_t i) { return exp((double)(__fmul_rn(smp_clean(kc_ld(row[i])), invt) - mx)); }, ts, &found);
    if (threadIdx.x == 0 && j < V)
        out[blockIdx.x] = (int32_t)j;
}

/* Sort keys: clean(x)*invt with -0 folded into +0 (the CPU compares values, not bits). */
template <typename T>
__global__ void k_sample_keys(const T *__restrict__ logits, int64_t total, int64_t V, float invt, float *keys,
                              int32_t *ids)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        float x = __fmul_rn(smp_clean(kc_ld(logits[i])), invt);
        keys[i] = x == 0.0f ? 0.0f : x;
        ids[i] = (int32_t)(i % V);
    }
}

__global__ void k_sample_offsets(int *off, int n, int V)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i <= n; i += gridDim.x * blockDim.x)
        off[i] = i * V;
}

__global__ void __launch_bounds__(SMP_THREADS) k_sample_sorted(const float *__restrict__ keys,
                                                               const int32_t *__restrict__ ids, int64_t V,
                                                               int64_t n_cand, bool use_p, float top_p,
                                                               const double *__restrict__ u, int32_t *out)
{
    __shared__ typename smp_scan::TempStorage ts;
    __shared__ double dred[32];
    __shared__ int found;
    const float *kv = keys + (int64_t)blockIdx.x * V;
    const int32_t *iv = ids + (int64_t)blockIdx.x * V;
    const float mx = kv[0];
    if (isinf(mx)) {
        if (threadIdx.x == 0)
            out[blockIdx.x] = iv[0];
        return;
    }
    double tot = 0.0;
    for (int64_t i = threadIdx.x; i < n_cand; i += blockDim.x)
        tot += exp((double)(kv[i] - mx));
    tot = smp_block_sum(tot, dred);
    int64_t keep = n_cand;
    if (use_p) {
        int64_t i = smp_find_first(
            n_cand, (double)top_p, false, [&](int64_t x) { return exp((double)(kv[x] - mx)) / tot; }, ts, &found);
        if (i < n_cand)
            keep = i + 1;
    }
    double kept = 0.0;
    for (int64_t i = threadIdx.x; i < keep; i += blockDim.x)
        kept += exp((double)(kv[i] - mx));
    kept = smp_block_sum(kept, dred);
    const double target = u[blockIdx.x] * kept;
    int64_t i = smp_find_first(
        keep, target, true, [&](int64_t x) { return exp((double)(kv[x] - mx)); }, ts, &found);
    if (threadIdx.x == 0)
        out[blockIdx.x] = iv[i < keep ? i : keep - 1];
}

extern "C" fu_err kc_sample(const kern_backend_t *be, const kern_tensor_t *logits, const kern_sample_params *p,
                            uint64_t counter, int32_t *out_tokens)
{
    kc_ctx *ctx = kc_of(be);
    if (!p || !out_tokens || !kc_is_float(logits->dtype) || logits->ndim < 1 || logits->ndim > 2)
        return FU_EINVAL;
    const int64_t n = logits->ndim == 1 ? 1 : logits->shape[0];
    const int64_t V = logits->ndim == 1 ? logits->shape[0] : logits->shape[1];
    if (n == 0)
        return FU_OK;
    if (V < 1 || V > INT32_MAX || n > INT32_MAX)
        return FU_EINVAL;
    FU_TRY(kc_enter(ctx));
    const bool sampling = p->temperature > 0.0f;
    const bool use_k = sampling && p->top_k > 0 && (int64_t)p->top_k < V;
    const bool use_p = sampling && p->top_p > 0.0f && p->top_p < 1.0f;
    const bool sorted = use_k || use_p;
    /* Rows per sort batch: keep batch*V within CUB's int item count. */
    int64_t batch = sorted ? (INT32_MAX / 2) / V : n;
    if (batch < 1)
        batch = 1;
    if (batch > n)
        batch = n;

    /* scratch: out[n] i32 | u[n] f64 | (sorted) keys_in, keys_out [batch*V] f32, ids_in, ids_out
     * [batch*V] i32, offsets [batch+1] i32, CUB temp */
    size_t cub_bytes = 0;
    const int64_t items = batch * V;
    if (sorted) {
        cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairsDescending(
            (void *)NULL, cub_bytes, (const float *)NULL, (float *)NULL, (const int32_t *)NULL, (int32_t *)NULL,
            (int)items, (int)batch, (const int *)NULL, (const int *)NULL, 0, 32, ctx->stream);
        if (e != cudaSuccess)
            return kc_cuda_err(e, "cub segmented sort (size query)", __FILE__, __LINE__);
    }
    size_t off = 0;
    const size_t o_out = off;
    off += ((size_t)n * 4 + 15) & ~(size_t)15;
    const size_t o_u = off;
    off += (size_t)n * 8;
    const size_t o_kin = off;
    off += sorted ? (size_t)items * 4 : 0;
    const size_t o_kout = off;
    off += sorted ? (size_t)items * 4 : 0;
    const size_t o_iin = off;
    off += sorted ? (size_t)items * 4 : 0;
    const size_t o_iout = off;
    off += sorted ? (size_t)items * 4 : 0;
    const size_t o_offs = off;
    off += sorted ? (((size_t)batch + 1) * 4 + 255) / 256 * 256 : 0;
    const size_t o_cub = off;
    off += sorted ? cub_bytes : 0;
    char *scr = NULL;
    FU_TRY(kc_scratch(ctx, off, (void **)&scr));

    double *hu = (double *)malloc((size_t)n * sizeof(double));
    if (!hu) {
        kc_scratch_free(ctx, scr);
        return FU_ENOMEM;
    }
    for (int64_t r = 0; r < n; r++)
        hu[r] = kern_rng_hash_uniform(p->seed, counter, (uint64_t)r);

    int32_t *d_out = (int32_t *)(scr + o_out);
    double *d_u = (double *)(scr + o_u);
    fu_err rc = FU_OK;
    cudaError_t e = cudaMemcpyAsync(d_u, hu, (size_t)n * sizeof(double), cudaMemcpyHostToDevice, ctx->stream);
    const float invt = sampling ? 1.0f / p->temperature : 1.0f;
    if (e == cudaSuccess) {
        switch (logits->dtype) {
        case KERN_F32:
            k_argmax<float><<<(unsigned)n, SMP_THREADS, 0, ctx->stream>>>((const float *)logits->data, V, d_out);
            break;
        case KERN_F16:
            k_argmax<__half><<<(unsigned)n, SMP_THREADS, 0, ctx->stream>>>((const __half *)logits->data, V, d_out);
            break;
        default:
            k_argmax<__nv_bfloat16><<<(unsigned)n, SMP_THREADS, 0, ctx->stream>>>(
                (const __nv_bfloat16 *)logits->data, V, d_out);
            break;
        }
        e = cudaGetLastError();
    }
    if (e == cudaSuccess && sampling && !sorted) {
        switch (logits->dtype) {
        case KERN_F32:
            k_sample_plain<float><<<(unsigned)n, SMP_THREADS, 0, ctx->stream>>>((const float *)logits->data, V, invt,
                                                                                d_u, d_out);
            break;
        case KERN_F16:
            k_sample_plain<__half><<<(unsigned)n, SMP_THREADS, 0, ctx->stream>>>((const __half *)logits->data, V,
                                                                                 invt, d_u, d_out);
            break;
        default:
            k_sample_plain<__nv_bfloat16><<<(unsigned)n, SMP_THREADS, 0, ctx->stream>>>(
                (const __nv_bfloat16 *)logits->data, V, invt, d_u, d_out);
            break;
        }
        e = cudaGetLastError();
    }
    if (sorted) {
        float *kin = (float *)(scr + o_kin), *kout = (float *)(scr + o_kout);
        int32_t *iin = (int32_t *)(scr + o_iin), *iout = (int32_t *)(scr + o_iout);
        int *offs = (int *)(scr + o_offs);
        const int64_t n_cand = use_k ? p->top_k : V;
        for (int64_t r0 = 0; r0 < n && e == cudaSuccess; r0 += batch) {
            const int64_t nb = n - r0 < batch ? n - r0 : batch;
            const int64_t tot = nb * V;
            const size_t esz = kern_dtype_size(logits->dtype);
            const void *src = (const char *)logits->data + (size_t)(r0 * V) * esz;
            switch (logits->dtype) {
            case KERN_F32:
                k_sample_keys<float><<<kc_blocks(tot, 256), 256, 0, ctx->stream>>>((const float *)src, tot, V, invt,
                                                                                   kin, iin);
                break;
            case KERN_F16:
                k_sample_keys<__half><<<kc_blocks(tot, 256), 256, 0, ctx->stream>>>((const __half *)src, tot, V, invt,
                                                                                    kin, iin);
                break;
            default:
                k_sample_keys<__nv_bfloat16><<<kc_blocks(tot, 256), 256, 0, ctx->stream>>>(
                    (const __nv_bfloat16 *)src, tot, V, invt, kin, iin);
                break;
            }
            k_sample_offsets<<<1, 256, 0, ctx->stream>>>(offs, (int)nb, (int)V);
            e = cudaGetLastError();
            if (e != cudaSuccess)
                break;
            size_t cb = cub_bytes;
            e = cub::DeviceSegmentedRadixSort::SortPairsDescending((void *)(scr + o_cub), cb, kin, kout, iin, iout,
                                                                   (int)tot, (int)nb, offs, offs + 1, 0, 32,
                                                                   ctx->stream);
            if (e != cudaSuccess)
                break;
            k_sample_sorted<<<(unsigned)nb, SMP_THREADS, 0, ctx->stream>>>(kout, iout, V, n_cand, use_p, p->top_p,
                                                                           d_u + r0, d_out + r0);
            e = cudaGetLastError();
        }
    }
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(out_tokens, d_out, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost, ctx->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(ctx->stream); /* also keeps hu alive until the copy ran */
    if (e != cudaSuccess)
        rc = kc_cuda_err(e, "sample", __FILE__, __LINE__);
    free(hu);
    kc_scratch_free(ctx, scr);
    return rc;
}
