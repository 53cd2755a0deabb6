/* CUDA backend: causal grouped-query attention (kern_attn_params), forward and backward.
 *
 * Forward, two kernels:
 *   k_attn_flash  prefill with f16/bf16 and head_dim 64 or 128 (sm_80+): flash-style. A block owns
 *                 64 query rows of one (sequence, head); 4 warps own 16 rows each. Key/value tiles
 *                 of 32 rows stream through shared memory; S = Q·Kᵀ and O += P·V run on tensor cores
 *                 (WMMA 16x16x16, f32 accumulators), the online softmax (running max m, sum l, O
 *                 rescaled by exp(m_old - m_new)) runs on the S tile in shared memory, two lanes per
 *                 row. O stays in shared memory in f32 (WMMA fragment layouts are opaque, so the
 *                 per-row rescale is done there). Tiles past the causal limit are never loaded.
 *   k_attn_rows   everything else (f32, decode against a KV cache, other head sizes up to 256): one
 *                 block of 4 warps per (query row, head); each warp takes chunks of 32 keys, a lane
 *                 scores one key (full dot product), the chunk updates the warp's online softmax,
 *                 then the 32 probabilities are broadcast to accumulate V rows (lanes split the head
 *                 dimension). Warps merge through shared memory. When there are few rows (decode),
 *                 the keys are also split across blocks (flash-decoding) and k_attn_combine merges
 *                 the partial (m, l, acc) triples.
 * Backward (the straightforward recompute path): recompute O and the row log-sum-exp with
 * k_attn_rows, Dsum = rowsum(dO ⊙ O), then dQ per (query row, head) over keys and dK/dV per
 * (key row, kv head) over the queries of its head group, each recomputing P = exp(s - lse).
 * No atomics: every output row has one owner block, so results are deterministic. */
#include <mma.h>

#include "kern_cuda_internal.cuh"

#define ATTN_WARPS        4
#define ATTN_THREADS      (32 * ATTN_WARPS)
#define ATTN_MAX_HEAD_DIM 256
#define FLASH_BR          64 /* query rows per block */
#define FLASH_BC          32 /* key rows per tile */
#define FLASH_MIN_TQ      16 /* fewer query rows per sequence: the row kernel */

typedef struct {
    int     Hq, Hkv, D, group, n_seq;
    int64_t tq, tk, q_offset;
    float   scale;
} attn_dims;

/* The two 16-bit halves (low first) or the one f32 of a 32-bit word, as floats; no address is
 * taken, so the vector stays in registers. */
__device__ __forceinline__ float attn_word_lo(unsigned w, const __half *) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu))); }
__device__ __forceinline__ float attn_word_hi(unsigned w, const __half *) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }
__device__ __forceinline__ float attn_word_lo(unsigned w, const __nv_bfloat16 *) { return __bfloat162float(__ushort_as_bfloat16((unsigned short)(w & 0xffffu))); }
__device__ __forceinline__ float attn_word_hi(unsigned w, const __nv_bfloat16 *) { return __bfloat162float(__ushort_as_bfloat16((unsigned short)(w >> 16))); }

/* acc += xs[0..per word)·word, in element order. */
template <typename T>
__device__ __forceinline__ float attn_dot_word(float acc, const float *xs, unsigned w)
{
    if constexpr (sizeof(T) == 4) {
        return acc + xs[0] * __uint_as_float(w);
    } else {
        acc += xs[0] * attn_word_lo(w, (const T *)nullptr);
        return acc + xs[1] * attn_word_hi(w, (const T *)nullptr);
    }
}

/* sum_d xs[d]·row[d] over D elements, in order d = 0..D-1 (the same rounding as a scalar loop), with
 * 16-byte loads when the row allows them. xs is f32 in shared memory. */
template <typename T>
__device__ __forceinline__ float attn_dot(const float *__restrict__ xs, const T *__restrict__ row, int D)
{
    float acc = 0.0f;
    constexpr int VEC = 16 / (int)sizeof(T); /* elements per 16 bytes */
    constexpr int PER = VEC / 4;              /* elements per 32-bit word */
    if (D % VEC == 0 && ((uintptr_t)row & 15) == 0) {
        for (int d = 0; d < D; d += VEC) {
            const uint4 raw = *reinterpret_cast<const uint4 *>(row + d);
            acc = attn_dot_word<T>(acc, xs + d, raw.x);
            acc = attn_dot_word<T>(acc, xs + d + PER, raw.y);
            acc = attn_dot_word<T>(acc, xs + d + 2 * PER, raw.z);
            acc = attn_dot_word<T>(acc, xs + d + 3 * PER, raw.w);
        }
        return acc;
    }
    for (int d = 0; d < D; d++)
        acc += xs[d] * kc_ld(row[d]);
    return acc;
}

/* What block rowhead = qrow·Hq + h of the row kernels works on. */
struct attn_row_at {
    int64_t qrow, s, i; /* query row; its sequence and position in it */
    int     h, g;       /* query head; the kv head it reads */
};

__device__ __forceinline__ attn_row_at attn_row_of(const attn_dims &a, int64_t rowhead)
{
    attn_row_at r;
    r.h = (int)(rowhead % a.Hq);
    r.qrow = rowhead / a.Hq;
    r.s = r.qrow / a.tq;
    r.i = r.qrow % a.tq;
    r.g = r.h / a.group;
    return r;
}

/* The second half of a warp's chunk of 32 keys c0.. (those below end): lane jj holds the weight of
 * key c0 + jj, and acc[e] += weight · row[lane + 32e] for each key's row (base + key·ld), in key
 * order; the lanes split the head dimension D. */
template <typename T, int NPL>
__device__ __forceinline__ void attn_warp_accumulate(float (&acc)[NPL], float w, const T *base, int64_t c0, int64_t end,
                                                     int64_t ld, int lane, int D)
{
    const int nvalid = (int)(end - c0 < 32 ? end - c0 : 32);
    for (int jj = 0; jj < nvalid; jj++) {
        const float wj = __shfl_sync(0xffffffffu, w, jj);
        const T *rp = base + (c0 + jj) * ld;
#pragma unroll
        for (int e = 0; e < NPL; e++) {
            const int d = lane + 32 * e;
            if (d < D)
                acc[e] += wj * kc_ld(rp[d]);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Row kernel (forward). grid.x = rowhead = qrow*Hq + h, grid.y = split. With splits == 1 it writes
 * o (and lse when non-NULL); otherwise the partial triple part[(rowhead*splits + z)*(D+2) ...]. */

template <typename T, int NPL>
__global__ void __launch_bounds__(ATTN_THREADS) k_attn_rows(const T *__restrict__ q, const T *__restrict__ k,
                                                            const T *__restrict__ v, T *__restrict__ o,
                                                            float *__restrict__ lse, float *__restrict__ part,
                                                            attn_dims a, int splits)
{
    __shared__ float qs[32 * NPL];
    __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
    __shared__ float wacc[ATTN_WARPS][32 * NPL];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t rowhead = blockIdx.x;
    const auto [qrow, s, i, h, g] = attn_row_of(a, rowhead);
    const int D = a.D;
    const int64_t ldq = (int64_t)a.Hq * D, ldk = (int64_t)a.Hkv * D;
    const T *qp = q + qrow * ldq + (int64_t)h * D;
    int64_t kend = a.q_offset + i + 1;
    if (kend > a.tk)
        kend = a.tk;
    const int64_t span = (kend + splits - 1) / splits;
    const int64_t k0 = (int64_t)blockIdx.y * span;
    const int64_t k1 = k0 + span < kend ? k0 + span : kend;

    for (int d = threadIdx.x; d < 32 * NPL; d += blockDim.x)
        qs[d] = d < D ? kc_ld(qp[d]) : 0.0f;
    __syncthreads();

    const T *kbase = k + s * a.tk * ldk + (int64_t)g * D;
    const T *vbase = v + s * a.tk * ldk + (int64_t)g * D;
    float m = -INFINITY, l = 0.0f, acc[NPL];
#pragma unroll
    for (int e = 0; e < NPL; e++)
        acc[e] = 0.0f;
    for (int64_t c0 = k0 + (int64_t)warp * 32; c0 < k1; c0 += 32 * ATTN_WARPS) {
        const int64_t j = c0 + lane;
        float sc = -INFINITY;
        if (j < k1) {
            sc = attn_dot(qs, kbase + j * ldk, D) * a.scale;
        }
        const float mnew = fmaxf(m, kc_warp_max(sc)); /* finite: key c0 < k1 is valid */
        const float corr = expf(m - mnew);
        const float p = j < k1 ? expf(sc - mnew) : 0.0f;
        l = l * corr + kc_warp_sum(p);
#pragma unroll
        for (int e = 0; e < NPL; e++)
            acc[e] *= corr;
        attn_warp_accumulate<T, NPL>(acc, p, vbase, c0, k1, ldk, lane, D);
        m = mnew;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < NPL; e++)
        wacc[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; w++)
        M = fmaxf(M, wm[w]);
    float L = 0.0f, f[ATTN_WARPS];
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; w++) {
        f[w] = M == -INFINITY ? 0.0f : expf(wm[w] - M);
        L += wl[w] * f[w];
    }
    if (splits == 1) {
        T *op = o + qrow * ldq + (int64_t)h * D;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float x = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; w++)
                x += wacc[w][d] * f[w];
            op[d] = kc_st<T>(x / L);
        }
        if (lse && threadIdx.x == 0)
            lse[rowhead] = M + logf(L);
    } else {
        float *pp = part + (rowhead * splits + blockIdx.y) * (int64_t)(D + 2);
        if (threadIdx.x == 0) {
            pp[0] = M;
            pp[1] = L;
        }
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float x = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; w++)
                x += wacc[w][d] * f[w];
            pp[2 + d] = x;
        }
    }
}

/* Merges the split partials of one rowhead (grid.x = rowhead). */
template <typename T>
__global__ void k_attn_combine(const float *__restrict__ part, T *__restrict__ o, float *__restrict__ lse, attn_dims a,
                               int splits)
{
    const int64_t rowhead = blockIdx.x;
    const int h = (int)(rowhead % a.Hq);
    const int64_t qrow = rowhead / a.Hq;
    const int D = a.D;
    const float *pp = part + rowhead * splits * (int64_t)(D + 2);
    float M = -INFINITY;
    for (int z = 0; z < splits; z++)
        M = fmaxf(M, pp[z * (D + 2)]);
    float L = 0.0f;
    for (int z = 0; z < splits; z++) {
        float mz = pp[z * (D + 2)];
        if (mz != -INFINITY)
            L += pp[z * (D + 2) + 1] * expf(mz - M);
    }
    T *op = o + qrow * (int64_t)a.Hq * D + (int64_t)h * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float x = 0.0f;
        for (int z = 0; z < splits; z++) {
            float mz = pp[z * (D + 2)];
            if (mz != -INFINITY)
                x += pp[z * (D + 2) + 2 + d] * expf(mz - M);
        }
        op[d] = kc_st<T>(x / L);
    }
    if (lse && threadIdx.x == 0)
        lse[rowhead] = M + logf(L);
}

/* ---------------------------------------------------------------------------------------------- */
/* Flash kernel (forward, f16/bf16, HD 64/128). grid (ceil(tq/64), Hq, n_seq), 128 threads. */

template <int HD>
struct flash_layout {
    static constexpr int LDQ = HD + 8;  /* 16-bit elements; pads rows off a common bank */
    static constexpr int LDS = FLASH_BC + 4;
    static constexpr int LDP = FLASH_BC + 8;
    static constexpr int LDO = HD + 4;  /* floats */
    static constexpr size_t q_off = 0;
    static constexpr size_t k_off = q_off + (size_t)FLASH_BR * LDQ * 2;
    static constexpr size_t v_off = k_off + (size_t)FLASH_BC * LDQ * 2;
    static constexpr size_t s_off = v_off + (size_t)FLASH_BC * LDQ * 2;
    static constexpr size_t p_off = s_off + (size_t)ATTN_WARPS * 16 * LDS * 4;
    static constexpr size_t o_off = p_off + (size_t)ATTN_WARPS * 16 * LDP * 2;
    static constexpr size_t bytes = o_off + (size_t)ATTN_WARPS * 16 * LDO * 4;
    static_assert(k_off % 128 == 0 && v_off % 128 == 0 && s_off % 128 == 0 && p_off % 128 == 0 &&
                      o_off % 128 == 0,
                  "shared-memory regions must stay 128-byte aligned for WMMA");
};

/* Copies `rows` rows of HD 16-bit elements (global row stride ld elements) into shared memory
 * (row stride LD), zero-filling rows >= valid. 16-byte vectors; all threads of the block. */
template <int HD, int LD>
__device__ __forceinline__ void flash_load_rows(uint16_t *dst, const uint16_t *src, int64_t ld, int rows, int valid)
{
    constexpr int VPR = HD / 8; /* uint4 per row */
    for (int idx = threadIdx.x; idx < rows * VPR; idx += blockDim.x) {
        const int r = idx / VPR, c = idx % VPR;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r < valid)
            val = *reinterpret_cast<const uint4 *>(src + (int64_t)r * ld + c * 8);
        *reinterpret_cast<uint4 *>(dst + r * LD + c * 8) = val;
    }
}

template <typename T, int HD>
__global__ void __launch_bounds__(ATTN_THREADS) k_attn_flash(const T *__restrict__ q, const T *__restrict__ k,
                                                             const T *__restrict__ v, T *__restrict__ o, attn_dims a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using namespace nvcuda;
    typedef flash_layout<HD> L;
    extern __shared__ __align__(128) unsigned char smem_flash[];
    unsigned char *smem = smem_flash;
    T *Qs = reinterpret_cast<T *>(smem + L::q_off);
    T *Ks = reinterpret_cast<T *>(smem + L::k_off);
    T *Vs = reinterpret_cast<T *>(smem + L::v_off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *Sw = reinterpret_cast<float *>(smem + L::s_off) + warp * 16 * L::LDS;
    T *Pw = reinterpret_cast<T *>(smem + L::p_off) + warp * 16 * L::LDP;
    float *Ow = reinterpret_cast<float *>(smem + L::o_off) + warp * 16 * L::LDO;

    const int h = blockIdx.y, g = h / a.group;
    const int64_t s = blockIdx.z;
    const int64_t q0 = (int64_t)blockIdx.x * FLASH_BR;
    const int64_t ldq = (int64_t)a.Hq * HD, ldk = (int64_t)a.Hkv * HD;
    const int64_t qvalid = a.tq - q0 < FLASH_BR ? a.tq - q0 : FLASH_BR;
    const T *qsrc = q + (s * a.tq + q0) * ldq + (int64_t)h * HD;
    const T *ksrc = k + s * a.tk * ldk + (int64_t)g * HD;
    const T *vsrc = v + s * a.tk * ldk + (int64_t)g * HD;

    flash_load_rows<HD, L::LDQ>(reinterpret_cast<uint16_t *>(Qs), reinterpret_cast<const uint16_t *>(qsrc), ldq,
                                FLASH_BR, (int)qvalid);
    for (int idx = lane; idx < 16 * L::LDO; idx += 32)
        Ow[idx] = 0.0f;

    /* Two lanes per row: row r = lane/2 of this warp's 16, columns half*16.. of S. */
    const int r = lane >> 1, half = lane & 1;
    const int64_t irow = q0 + warp * 16 + r;
    const bool row_ok = irow < a.tq;
    const int64_t qpos = a.q_offset + irow; /* keys j <= qpos are visible */
    float m_r = -INFINITY, l_r = 0.0f;

    int64_t last_q = q0 + qvalid - 1;
    int64_t kv_end = a.q_offset + last_q + 1;
    if (kv_end > a.tk)
        kv_end = a.tk;
    const int64_t n_kt = (kv_end + FLASH_BC - 1) / FLASH_BC;

    for (int64_t kt = 0; kt < n_kt; kt++) {
        const int64_t j0 = kt * FLASH_BC;
        const int kvalid = (int)(a.tk - j0 < FLASH_BC ? a.tk - j0 : FLASH_BC);
        __syncthreads(); /* previous tile's K/V reads are done (and Q/O init on the first pass) */
        flash_load_rows<HD, L::LDQ>(reinterpret_cast<uint16_t *>(Ks),
                                    reinterpret_cast<const uint16_t *>(ksrc + j0 * ldk), ldk, FLASH_BC, kvalid);
        flash_load_rows<HD, L::LDQ>(reinterpret_cast<uint16_t *>(Vs),
                                    reinterpret_cast<const uint16_t *>(vsrc + j0 * ldk), ldk, FLASH_BC, kvalid);
        __syncthreads();

        /* S_w[16 x 32] = Q_w · K_tileᵀ */
#pragma unroll
        for (int jf = 0; jf < FLASH_BC / 16; jf++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sacc;
            wmma::fill_fragment(sacc, 0.0f);
#pragma unroll
            for (int d0 = 0; d0 < HD / 16; d0++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
                wmma::load_matrix_sync(fa, Qs + (warp * 16) * L::LDQ + d0 * 16, L::LDQ);
                wmma::load_matrix_sync(fb, Ks + (jf * 16) * L::LDQ + d0 * 16, L::LDQ);
                wmma::mma_sync(sacc, fa, fb, sacc);
            }
            wmma::store_matrix_sync(Sw + jf * 16, sacc, L::LDS, wmma::mem_row_major);
        }
        __syncwarp();

        /* Online softmax on row r, 16 columns per lane. */
        float sv[16];
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < 16; c++) {
            const int col = half * 16 + c;
            const int64_t j = j0 + col;
            float x = Sw[r * L::LDS + col] * a.scale;
            if (!row_ok || j > qpos || j >= a.tk)
                x = -INFINITY;
            sv[c] = x;
            mx = fmaxf(mx, x);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float mnew = fmaxf(m_r, mx);
        float corr = 1.0f, rs = 0.0f;
        if (mnew != -INFINITY) {
            corr = expf(m_r - mnew);
#pragma unroll
            for (int c = 0; c < 16; c++) {
                float pv = expf(sv[c] - mnew);
                sv[c] = pv;
                rs += pv;
            }
        } else {
#pragma unroll
            for (int c = 0; c < 16; c++)
                sv[c] = 0.0f;
        }
        rs += __shfl_xor_sync(0xffffffffu, rs, 1);
        l_r = l_r * corr + rs;
        m_r = mnew;
#pragma unroll
        for (int c = 0; c < 16; c++)
            Pw[r * L::LDP + half * 16 + c] = kc_st<T>(sv[c]);
#pragma unroll 8
        for (int c = 0; c < HD / 2; c++)
            Ow[r * L::LDO + half * (HD / 2) + c] *= corr;
        __syncwarp();

        /* O_w[16 x HD] += P_w[16 x 32] · V_tile[32 x HD] */
#pragma unroll
        for (int nf = 0; nf < HD / 16; nf++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> oacc;
            wmma::load_matrix_sync(oacc, Ow + nf * 16, L::LDO, wmma::mem_row_major);
#pragma unroll
            for (int kf = 0; kf < FLASH_BC / 16; kf++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fp;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fv;
                wmma::load_matrix_sync(fp, Pw + kf * 16, L::LDP);
                wmma::load_matrix_sync(fv, Vs + (kf * 16) * L::LDQ + nf * 16, L::LDQ);
                wmma::mma_sync(oacc, fp, fv, oacc);
            }
            wmma::store_matrix_sync(Ow + nf * 16, oacc, L::LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }
    __syncwarp();
    if (row_ok) {
        T *op = o + (s * a.tq + irow) * ldq + (int64_t)h * HD;
        const float inv = 1.0f / l_r;
        for (int c = 0; c < HD / 2; c++) {
            const int col = half * (HD / 2) + c;
            op[col] = kc_st<T>(Ow[r * L::LDO + col] * inv);
        }
    }
#endif
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward kernels */

/* dsum[rowhead] = sum_d dO·O; one warp per rowhead. */
template <typename T>
__global__ void k_attn_dsum(const T *__restrict__ dout, const T *__restrict__ o, float *__restrict__ dsum,
                            int64_t n_rowheads, int D)
{
    const int lane = threadIdx.x & 31;
    const int64_t rh = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (rh >= n_rowheads)
        return;
    const T *a = dout + rh * D, *b = o + rh * D; /* [qrow, Hq*D] rows are rowhead-major */
    float acc = 0.0f;
    for (int d = lane; d < D; d += 32)
        acc += kc_ld(a[d]) * kc_ld(b[d]);
    acc = kc_warp_sum(acc);
    if (lane == 0)
        dsum[rh] = acc;
}

/* dQ for one (query row, head) per block. */
template <typename T, int NPL>
__global__ void __launch_bounds__(ATTN_THREADS) k_attn_bwd_dq(const T *__restrict__ q, const T *__restrict__ k,
                                                              const T *__restrict__ v, const T *__restrict__ dout,
                                                              const float *__restrict__ lse,
                                                              const float *__restrict__ dsum, T *__restrict__ dq,
                                                              attn_dims a)
{
    __shared__ float qs[32 * NPL], dos[32 * NPL];
    __shared__ float wacc[ATTN_WARPS][32 * NPL];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t rowhead = blockIdx.x;
    const auto [qrow, s, i, h, g] = attn_row_of(a, rowhead);
    const int D = a.D;
    const int64_t ldq = (int64_t)a.Hq * D, ldk = (int64_t)a.Hkv * D;
    for (int d = threadIdx.x; d < 32 * NPL; d += blockDim.x) {
        qs[d] = d < D ? kc_ld(q[qrow * ldq + (int64_t)h * D + d]) : 0.0f;
        dos[d] = d < D ? kc_ld(dout[qrow * ldq + (int64_t)h * D + d]) : 0.0f;
    }
    __syncthreads();
    int64_t kend = a.q_offset + i + 1;
    if (kend > a.tk)
        kend = a.tk;
    const float L = lse[rowhead], Dr = dsum[rowhead];
    const T *kbase = k + s * a.tk * ldk + (int64_t)g * D;
    const T *vbase = v + s * a.tk * ldk + (int64_t)g * D;
    float acc[NPL];
#pragma unroll
    for (int e = 0; e < NPL; e++)
        acc[e] = 0.0f;
    for (int64_t c0 = (int64_t)warp * 32; c0 < kend; c0 += 32 * ATTN_WARPS) {
        const int64_t j = c0 + lane;
        float ds = 0.0f;
        if (j < kend) {
            const float dot = attn_dot(qs, kbase + j * ldk, D);
            const float dp = attn_dot(dos, vbase + j * ldk, D);
            const float p = expf(dot * a.scale - L);
            ds = p * (dp - Dr);
        }
        attn_warp_accumulate<T, NPL>(acc, ds, kbase, c0, kend, ldk, lane, D);
    }
#pragma unroll
    for (int e = 0; e < NPL; e++)
        wacc[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    T *out = dq + qrow * ldq + (int64_t)h * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float x = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++)
            x += wacc[w][d];
        out[d] = kc_st<T>(x * a.scale);
    }
}

/* dK, dV for one (key row, kv head) per block: sums over the group's query heads and the queries
 * that see this key. grid.x = krow*Hkv + g with krow = s*tk + j. */
template <typename T, int NPL>
__global__ void __launch_bounds__(ATTN_THREADS) k_attn_bwd_dkv(const T *__restrict__ q, const T *__restrict__ k,
                                                               const T *__restrict__ v, const T *__restrict__ dout,
                                                               const float *__restrict__ lse,
                                                               const float *__restrict__ dsum, T *__restrict__ dk,
                                                               T *__restrict__ dv, attn_dims a)
{
    __shared__ float ks[32 * NPL], vs[32 * NPL];
    __shared__ float wk[ATTN_WARPS][32 * NPL], wv[ATTN_WARPS][32 * NPL];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t kh = blockIdx.x;
    const int g = (int)(kh % a.Hkv);
    const int64_t krow = kh / a.Hkv;
    const int64_t s = krow / a.tk, j = krow % a.tk;
    const int D = a.D;
    const int64_t ldq = (int64_t)a.Hq * D, ldk = (int64_t)a.Hkv * D;
    for (int d = threadIdx.x; d < 32 * NPL; d += blockDim.x) {
        ks[d] = d < D ? kc_ld(k[krow * ldk + (int64_t)g * D + d]) : 0.0f;
        vs[d] = d < D ? kc_ld(v[krow * ldk + (int64_t)g * D + d]) : 0.0f;
    }
    __syncthreads();
    int64_t i0 = j - a.q_offset; /* first query that sees key j */
    if (i0 < 0)
        i0 = 0;
    const int64_t cnt = i0 < a.tq ? a.tq - i0 : 0;
    const int64_t total = cnt * a.group;
    float ak[NPL], av[NPL];
#pragma unroll
    for (int e = 0; e < NPL; e++) {
        ak[e] = 0.0f;
        av[e] = 0.0f;
    }
    for (int64_t c0 = (int64_t)warp * 32; c0 < total; c0 += 32 * ATTN_WARPS) {
        const int64_t idx = c0 + lane;
        float p = 0.0f, ds = 0.0f;
        if (idx < total) {
            const int hh = (int)(idx / cnt);
            const int64_t i = i0 + idx % cnt;
            const int h = g * a.group + hh;
            const int64_t qrow = s * a.tq + i, rowhead = qrow * a.Hq + h;
            const float dot = attn_dot(ks, q + qrow * ldq + (int64_t)h * D, D);
            const float dp = attn_dot(vs, dout + qrow * ldq + (int64_t)h * D, D);
            p = expf(dot * a.scale - lse[rowhead]);
            ds = p * (dp - dsum[rowhead]);
        }
        const int nvalid = (int)(total - c0 < 32 ? total - c0 : 32);
        for (int jj = 0; jj < nvalid; jj++) {
            const float pj = __shfl_sync(0xffffffffu, p, jj);
            const float dsj = __shfl_sync(0xffffffffu, ds, jj);
            const int64_t id2 = c0 + jj;
            const int hh = (int)(id2 / cnt);
            const int64_t i = i0 + id2 % cnt;
            const int h = g * a.group + hh;
            const int64_t qrow = s * a.tq + i;
            const T *qp = q + qrow * ldq + (int64_t)h * D, *dp_ = dout + qrow * ldq + (int64_t)h * D;
#pragma unroll
            for (int e = 0; e < NPL; e++) {
                const int d = lane + 32 * e;
                if (d < D) {
                    ak[e] += dsj * kc_ld(qp[d]);
                    av[e] += pj * kc_ld(dp_[d]);
                }
            }
        }
    }
#pragma unroll
    for (int e = 0; e < NPL; e++) {
        wk[warp][lane + 32 * e] = ak[e];
        wv[warp][lane + 32 * e] = av[e];
    }
    __syncthreads();
    T *ok = dk + krow * ldk + (int64_t)g * D, *ov = dv + krow * ldk + (int64_t)g * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float xk = 0.0f, xv = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) {
            xk += wk[w][d];
            xv += wv[w][d];
        }
        ok[d] = kc_st<T>(xk * a.scale);
        ov[d] = kc_st<T>(xv);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Host side */

/* Runs the statement list (kernel launches) with NPL, the head-dim elements per lane of the row and
 * backward kernels, the compile-time constant head dim D needs: 2 up to 64, 4 up to 128, else 8. */
#define ATTN_DISPATCH_NPL(D, NPL, ...) \
    if ((D) <= 64) {                   \
        constexpr int NPL = 2;         \
        __VA_ARGS__;                   \
    } else if ((D) <= 128) {           \
        constexpr int NPL = 4;         \
        __VA_ARGS__;                   \
    } else {                           \
        constexpr int NPL = 8;         \
        __VA_ARGS__;                   \
    }

static fu_err attn_dims_of(const kern_attn_params *p, const kern_tensor_t *q, const kern_tensor_t *k,
                           const kern_tensor_t *v, attn_dims *a)
{
    if (!p || p->n_head < 1 || p->n_kv_head < 1 || p->n_head % p->n_kv_head || p->head_dim < 1 ||
        p->head_dim > ATTN_MAX_HEAD_DIM || p->n_seq < 1 || p->q_offset < 0)
        return FU_EINVAL;
    if (p->window > 0) { /* sliding windows (Mistral) run on the CPU backend only so far (docs/CUDA.md) */
        FU_ERROR("cuda", "attention with a sliding window is not implemented on CUDA yet");
        return FU_ENOSYS;
    }
    if (q->ndim != 2 || k->ndim != 2 || v->ndim != 2 || !kc_is_float(q->dtype) || k->dtype != q->dtype ||
        v->dtype != q->dtype)
        return FU_EINVAL;
    if (q->shape[1] != (int64_t)p->n_head * p->head_dim || k->shape[1] != (int64_t)p->n_kv_head * p->head_dim ||
        !kern_tensor_same_shape(k, v) || q->shape[0] % p->n_seq || k->shape[0] % p->n_seq)
        return FU_EINVAL;
    a->Hq = p->n_head;
    a->Hkv = p->n_kv_head;
    a->D = p->head_dim;
    a->group = p->n_head / p->n_kv_head;
    a->n_seq = p->n_seq;
    a->tq = q->shape[0] / p->n_seq;
    a->tk = k->shape[0] / p->n_seq;
    a->q_offset = p->q_offset;
    a->scale = p->scale != 0.0f ? p->scale : 1.0f / sqrtf((float)p->head_dim);
    if (a->q_offset + a->tq > a->tk)
        return FU_EINVAL;
    if ((int64_t)p->n_seq * a->tq * a->Hq > INT32_MAX || (int64_t)p->n_seq * a->tk * a->Hkv > INT32_MAX)
        return FU_EINVAL;
    return FU_OK;
}

/* Key splits for the row kernel: enough blocks to fill the device twice when rows are few. */
static int attn_splits(const kc_ctx *ctx, const attn_dims *a)
{
    int64_t blocks = (int64_t)a->n_seq * a->tq * a->Hq;
    int64_t want = 2 * (int64_t)ctx->sm_count;
    if (blocks >= want || a->tk < 256)
        return 1;
    int64_t sp = (want + blocks - 1) / blocks;
    int64_t by_len = a->tk / 128;
    if (sp > by_len)
        sp = by_len;
    if (sp > 32)
        sp = 32;
    return sp < 1 ? 1 : (int)sp;
}

static bool flash_ok(const kc_ctx *ctx, const attn_dims *a, kern_dtype dt, const kern_tensor_t *q,
                     const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *o)
{
    if (dt == KERN_F32 || ctx->cc_major < 8 || a->tq < FLASH_MIN_TQ || (a->D != 64 && a->D != 128) ||
        a->n_seq > 65535 || a->Hq > 65535)
        return false;
    size_t need = a->D == 64 ? flash_layout<64>::bytes : flash_layout<128>::bytes;
    if (need > ctx->smem_optin)
        return false;
    uintptr_t al = (uintptr_t)q->data | (uintptr_t)k->data | (uintptr_t)v->data | (uintptr_t)o->data;
    return (al & 15) == 0;
}

static size_t align_up(size_t x)
{
    return (x + KERN_ALIGN - 1) / KERN_ALIGN * KERN_ALIGN;
}

/* Bytes of scratch: forward = split partials (0 without splits); backward = O, lse, dsum. */
static size_t attn_scratch_bytes(const kc_ctx *ctx, const attn_dims *a, bool backward)
{
    const size_t rowheads = (size_t)a->n_seq * (size_t)a->tq * (size_t)a->Hq;
    if (backward)
        return align_up(rowheads * (size_t)a->D * 4) + 2 * align_up(rowheads * 4);
    int splits = attn_splits(ctx, a);
    return splits > 1 ? align_up(rowheads * (size_t)splits * (size_t)(a->D + 2) * 4) : 0;
}

extern "C" fu_err kc_attn_ws_bytes(const kern_backend_t *be, const kern_attn_params *p, int64_t tq, int64_t tk,
                                   bool backward, size_t *bytes)
{
    if (!p || !bytes || tq < 0 || tk < 0 || p->n_head < 1 || p->head_dim < 1 || p->n_seq < 1)
        return FU_EINVAL;
    attn_dims a;
    a.Hq = p->n_head;
    a.Hkv = p->n_kv_head;
    a.D = p->head_dim;
    a.group = p->n_kv_head > 0 ? p->n_head / p->n_kv_head : 1;
    a.n_seq = p->n_seq;
    a.tq = tq;
    a.tk = tk;
    a.q_offset = p->q_offset;
    a.scale = 1.0f;
    *bytes = attn_scratch_bytes(kc_of(be), &a, backward) + KERN_ALIGN;
    return FU_OK;
}

/* Scratch from ws (the caller rewinds it) or from the pool (*owned is then set: free it). */
static fu_err attn_scratch(kc_ctx *ctx, kern_workspace_t *ws, size_t bytes, void **out, void **owned)
{
    *owned = NULL;
    *out = NULL;
    if (bytes == 0)
        return FU_OK;
    if (ws)
        return kern_workspace_take(ws, bytes, out);
    FU_TRY(kc_scratch(ctx, bytes, out));
    *owned = *out;
    return FU_OK;
}

template <typename T>
static fu_err launch_rows(kc_ctx *ctx, const attn_dims *a, const T *q, const T *k, const T *v, T *o, float *lse,
                          float *part, int splits)
{
    const unsigned rowheads = (unsigned)((int64_t)a->n_seq * a->tq * a->Hq);
    dim3 grid(rowheads, (unsigned)splits);
    ATTN_DISPATCH_NPL(a->D, NPL, {
        k_attn_rows<T, NPL><<<grid, ATTN_THREADS, 0, ctx->stream>>>(q, k, v, o, lse, part, *a, splits);
    });
    KC_LAUNCHED();
    if (splits > 1) {
        k_attn_combine<T><<<rowheads, a->D < 256 ? ((a->D + 31) / 32) * 32 : 256, 0, ctx->stream>>>(part, o, lse, *a,
                                                                                                    splits);
        KC_LAUNCHED();
    }
    return FU_OK;
}

template <typename T, int HD>
static fu_err launch_flash(kc_ctx *ctx, const attn_dims *a, const T *q, const T *k, const T *v, T *o)
{
    const size_t smem = flash_layout<HD>::bytes;
    KC_CUDA(cudaFuncSetAttribute(k_attn_flash<T, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned)((a->tq + FLASH_BR - 1) / FLASH_BR), (unsigned)a->Hq, (unsigned)a->n_seq);
    k_attn_flash<T, HD><<<grid, ATTN_THREADS, smem, ctx->stream>>>(q, k, v, o, *a);
    KC_LAUNCHED();
    return FU_OK;
}

template <typename T>
static fu_err attn_forward_t(kc_ctx *ctx, const attn_dims *a, bool use_flash, const T *q, const T *k, const T *v, T *o,
                             float *lse, float *part, int splits)
{
    if constexpr (sizeof(T) == 2) { /* tensor-core kernel: 16-bit storage only */
        if (use_flash && lse == NULL) {
            if (a->D == 64)
                return launch_flash<T, 64>(ctx, a, q, k, v, o);
            return launch_flash<T, 128>(ctx, a, q, k, v, o);
        }
    }
    return launch_rows<T>(ctx, a, q, k, v, o, lse, part, splits);
}

extern "C" fu_err kc_attn_fwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                              const kern_tensor_t *k, const kern_tensor_t *v, kern_tensor_t *o, kern_workspace_t *ws)
{
    kc_ctx *ctx = kc_of(be);
    attn_dims a;
    FU_TRY(attn_dims_of(p, q, k, v, &a));
    if (!kern_tensor_same_shape(q, o) || o->dtype != q->dtype)
        return FU_EINVAL;
    if (a.tq == 0)
        return FU_OK;
    FU_TRY(kc_enter(ctx));
    const bool fl = flash_ok(ctx, &a, q->dtype, q, k, v, o);
    const int splits = fl ? 1 : attn_splits(ctx, &a);
    void *scr = NULL, *owned = NULL;
    size_t mark = ws ? kern_workspace_mark(ws) : 0;
    if (splits > 1)
        FU_TRY(attn_scratch(ctx, ws, attn_scratch_bytes(ctx, &a, false), &scr, &owned));
    fu_err rc = FU_OK;
    /* fl is false for f32 (flash_ok), and attn_forward_t uses the flash kernel for 16-bit types only */
    KC_DISPATCH_KNOWN_FLOAT(q->dtype, T, {
        rc = attn_forward_t<T>(ctx, &a, fl, (const T *)q->data, (const T *)k->data, (const T *)v->data, (T *)o->data,
                               NULL, (float *)scr, splits);
    });
    if (owned)
        kc_scratch_free(ctx, owned);
    if (ws)
        kern_workspace_rewind(ws, mark);
    return rc;
}

template <typename T>
static fu_err attn_backward_t(kc_ctx *ctx, const attn_dims *a, const T *q, const T *k, const T *v, const T *dout,
                              T *dq, T *dk, T *dv, char *scr)
{
    const size_t rowheads = (size_t)a->n_seq * (size_t)a->tq * (size_t)a->Hq;
    T *o = (T *)scr;
    float *lse = (float *)(scr + align_up(rowheads * (size_t)a->D * 4));
    float *dsum = lse + align_up(rowheads * 4) / 4;
    FU_TRY(launch_rows<T>(ctx, a, q, k, v, o, lse, NULL, 1));
    k_attn_dsum<T><<<(unsigned)((rowheads + ATTN_WARPS - 1) / ATTN_WARPS), ATTN_THREADS, 0, ctx->stream>>>(
        dout, o, dsum, (int64_t)rowheads, a->D);
    KC_LAUNCHED();
    const unsigned khs = (unsigned)((int64_t)a->n_seq * a->tk * a->Hkv);
    ATTN_DISPATCH_NPL(a->D, NPL, {
        k_attn_bwd_dq<T, NPL><<<(unsigned)rowheads, ATTN_THREADS, 0, ctx->stream>>>(q, k, v, dout, lse, dsum, dq, *a);
        k_attn_bwd_dkv<T, NPL><<<khs, ATTN_THREADS, 0, ctx->stream>>>(q, k, v, dout, lse, dsum, dk, dv, *a);
    });
    KC_LAUNCHED();
    return FU_OK;
}

extern "C" fu_err kc_attn_bwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                              const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *dout,
                              kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv, kern_workspace_t *ws)
{
    kc_ctx *ctx = kc_of(be);
    attn_dims a;
    FU_TRY(attn_dims_of(p, q, k, v, &a));
    const kern_dtype dt = q->dtype;
    if (!kern_tensor_same_shape(dout, q) || !kern_tensor_same_shape(dq, q) || !kern_tensor_same_shape(dk, k) ||
        !kern_tensor_same_shape(dv, v) || dout->dtype != dt || dq->dtype != dt || dk->dtype != dt || dv->dtype != dt)
        return FU_EINVAL;
    FU_TRY(kc_enter(ctx));
    if (a.tq == 0) { /* no queries: every key gets a zero gradient */
        if (a.tk > 0) {
            KC_CUDA(cudaMemsetAsync(dk->data, 0, kern_tensor_nbytes(dk), ctx->stream));
            KC_CUDA(cudaMemsetAsync(dv->data, 0, kern_tensor_nbytes(dv), ctx->stream));
        }
        return FU_OK;
    }
    void *scr = NULL, *owned = NULL;
    size_t mark = ws ? kern_workspace_mark(ws) : 0;
    FU_TRY(attn_scratch(ctx, ws, attn_scratch_bytes(ctx, &a, true), &scr, &owned));
    fu_err rc = FU_OK;
    KC_DISPATCH_KNOWN_FLOAT(dt, T, {
        rc = attn_backward_t<T>(ctx, &a, (const T *)q->data, (const T *)k->data, (const T *)v->data,
                                (const T *)dout->data, (T *)dq->data, (T *)dk->data, (T *)dv->data, (char *)scr);
    });
    if (owned)
        kc_scratch_free(ctx, owned);
    if (ws)
        kern_workspace_rewind(ws, mark);
    return rc;
}
