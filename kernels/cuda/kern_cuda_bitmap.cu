/* CUDA backend: SALR bitmap-sparse weights (kern_bitmap.h layout, uploaded unchanged).
 *
 * Layout recap: W [rows, cols] in 8x64 tiles numbered tile-row-major; per tile 8 uint64 words
 * (word rr bit b = element (8*tr + rr, 64*tc + b) stored), the tile's values packed row by row, and
 * offsets[t] = values before tile t. Inside a tile a lane finds its values with popcounts: the
 * values of row rr, columns [16q, 16q+16) start at offsets[t] + popc(words 0..rr-1) +
 * popc(word rr below bit 16q).
 *
 * Kernels:
 *   k_bitmap_gemv    n <= 16 (decode): Y = X·Wᵀ. A warp owns one tile row (8 outputs) over a K range
 *                    of 8 tiles; lane (rr, q) = (lane/4, lane%4) owns 16 columns of row rr. Each tile's
 *                    bitmap and values are staged into the warp's shared buffer with cp.async, double
 *                    buffered (tile t+1 in flight while tile t is decoded and multiplied). X's chunk
 *                    [n, 512] is in shared memory as f32. Partial sums go through f32 atomics into a
 *                    scratch Y, and a finishing pass applies beta and the output dtype.
 *   k_bitmap_mma     16 < n < 256, f16/bf16 activations (prefill): a block computes a 64x64 tile of Y over
 *                    K in steps of one tile column (64). Stage s holds the raw tiles (8 tile rows) and
 *                    the X slab, loaded with cp.async; the tiles of step k+1 are decoded into a dense
 *                    shared slab while step k's slab multiplies on tensor cores (WMMA 16x16x16, f32
 *                    accumulators): two shared slabs, two raw stages.
 *   k_bitmap_decode  whole matrix to a dense tensor, followed by cuBLAS: dX = dY·W, f32 activations
 *                    above the GEMV batch, and every batch >= 256, where one decode pass is cheaper
 *                    than this WMMA kernel's deficit against cuBLAS (Hopper's cuBLAS uses wgmma).
 * Values are stored as f32 or f16 (kern_bitmap_dtype); activations are f32, f16 or bf16. */
#include <mma.h>
#include <stdlib.h>

#include "kern_cuda_internal.cuh"

#define BM_TILE_R    8
#define BM_TILE_C    64
#define BM_GEMV_WARPS 8  /* tile rows per block (they share the X chunk) */
#define BM_GEMV_KT   8   /* tile columns per block (512 columns of X in shared memory) */
#define BM_PAD       32  /* bytes of slack after the values (aligned-up cp.async reads) */

struct kern_cuda_bitmap {
    const kern_backend_t *be;
    size_t rows, cols, nnz, n_tiles, tiles_per_row, tile_rows;
    kern_bitmap_dtype dtype;
    size_t vsize;         /* bytes per stored value */
    void *block;          /* one pool allocation holding the three arrays */
    const uint64_t *bits; /* n_tiles * 8 words */
    const int32_t *offs;  /* n_tiles + 1 */
    const unsigned char *vals; /* nnz * vsize (+ BM_PAD), 16-byte aligned */
};

/* ---------------------------------------------------------------------------------------------- */
/* cp.async helpers (sm_80+; plain copies before) */

__device__ __forceinline__ void bm_cp16(void *smem_dst, const void *gsrc, bool valid)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned s = (unsigned)__cvta_generic_to_shared(smem_dst);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gsrc), "r"(n));
#else
    *reinterpret_cast<uint4 *>(smem_dst) = valid ? *reinterpret_cast<const uint4 *>(gsrc) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void bm_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void bm_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

__device__ __forceinline__ float bm_val(const void *p, int i, int vsize)
{
    return vsize == 2 ? __half2float(reinterpret_cast<const __half *>(p)[i]) : reinterpret_cast<const float *>(p)[i];
}

/* Stages tile t with the threads [tid, tid+stride) of the caller: its 64 bytes of bitmap words into
 * wdst, its values (aligned out to 16 bytes) into vdst; the first value's place inside vdst is
 * offs[t] * vsize & 15. */
__device__ __forceinline__ void bm_stage_tile_split(unsigned char *wdst, unsigned char *vdst, const uint64_t *bits,
                                                    const int32_t *offs, const unsigned char *vals, int64_t t,
                                                    int vsize, int tid, int stride)
{
    const unsigned char *wsrc = reinterpret_cast<const unsigned char *>(bits + t * 8);
    const int64_t vb0 = (int64_t)offs[t] * vsize, vb1 = (int64_t)offs[t + 1] * vsize;
    const int64_t a0 = vb0 & ~(int64_t)15, a1 = (vb1 + 15) & ~(int64_t)15;
    const int nchunks = 4 + (int)((a1 - a0) / 16);
    for (int c = tid; c < nchunks; c += stride) {
        if (c < 4)
            bm_cp16(wdst + c * 16, wsrc + c * 16, true);
        else
            bm_cp16(vdst + (c - 4) * 16, vals + a0 + (int64_t)(c - 4) * 16, true);
    }
}

/* Stages tile t (bitmap words + its values, aligned out to 16 bytes) into buf with the threads
 * [tid, tid+stride) of the caller. buf: 64 bytes of words, then the values; returns nothing, the
 * value base inside buf is recomputed by bm_tile_vals. */
__device__ __forceinline__ void bm_stage_tile(unsigned char *buf, const uint64_t *bits, const int32_t *offs,
                                              const unsigned char *vals, int64_t t, int vsize, int tid, int stride)
{
    bm_stage_tile_split(buf, buf + 64, bits, offs, vals, t, vsize, tid, stride);
}

/* Pointer to tile t's first value inside a staged buffer. */
__device__ __forceinline__ const unsigned char *bm_tile_vals(const unsigned char *buf, const int32_t *offs, int64_t t,
                                                             int vsize)
{
    const int64_t vb0 = (int64_t)offs[t] * vsize;
    return buf + 64 + (vb0 & 15);
}

/* Lane (rr, q)'s 16 bits of a staged tile and the index of its first value in the tile. */
__device__ __forceinline__ unsigned bm_lane_bits(const uint64_t *w, int rr, int q, int *first)
{
    int before = 0;
#pragma unroll
    for (int r = 0; r < BM_TILE_R; r++)
        if (r < rr)
            before += __popcll(w[r]);
    const uint64_t word = w[rr];
    const uint64_t below = q == 0 ? 0ull : (word & ((1ull << (16 * q)) - 1ull));
    *first = before + __popcll(below);
    return (unsigned)((word >> (16 * q)) & 0xFFFFull);
}

/* Column c of a lane's 16 (0 where mbits has no bit c) from the tile values tv; *idx is the index of
 * the lane's next stored value and advances when one is used. Call for c = 0, 1, ... 15 in order. */
__device__ __forceinline__ float bm_lane_val(unsigned mbits, int c, const unsigned char *tv, int *idx, int vsize)
{
    return (mbits & (1u << c)) ? bm_val(tv, (*idx)++, vsize) : 0.0f;
}

/* ---------------------------------------------------------------------------------------------- */
/* GEMV (n <= 16) */

static size_t gemv_slot(int vsize)
{
    return 64 + (size_t)BM_TILE_R * BM_TILE_C * vsize + BM_PAD;
}

template <typename TX, int NB>
__global__ void __launch_bounds__(32 * BM_GEMV_WARPS)
    k_bitmap_gemv(const uint64_t *__restrict__ bits, const int32_t *__restrict__ offs,
                  const unsigned char *__restrict__ vals, int vsize, int64_t rows, int64_t cols, int64_t tiles_per_row,
                  int64_t tile_rows, const TX *__restrict__ x, int64_t ldx, int nb, float *__restrict__ yacc)
{
    extern __shared__ __align__(128) unsigned char smem_gemv[];
    unsigned char *smem = smem_gemv;
    float *xs = reinterpret_cast<float *>(smem); /* [512][NB]: a column's NB values are one vector read */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t slot = 64 + (size_t)BM_TILE_R * BM_TILE_C * vsize + BM_PAD;
    unsigned char *wbuf = smem + (size_t)NB * BM_GEMV_KT * BM_TILE_C * 4 + (size_t)warp * 2 * slot;

    const int64_t tc0 = (int64_t)blockIdx.y * BM_GEMV_KT;
    const int64_t k0 = tc0 * BM_TILE_C;
    for (int idx = threadIdx.x; idx < NB * BM_GEMV_KT * BM_TILE_C; idx += blockDim.x) {
        const int b = idx / (BM_GEMV_KT * BM_TILE_C), c = idx % (BM_GEMV_KT * BM_TILE_C);
        const int64_t kk = k0 + c;
        xs[c * NB + b] = (b < nb && kk < cols) ? kc_ld(x[(int64_t)b * ldx + kk]) : 0.0f;
    }
    __syncthreads();

    const int64_t tr = (int64_t)blockIdx.x * BM_GEMV_WARPS + warp;
    if (tr >= tile_rows)
        return; /* no block-wide barrier follows */
    int64_t tc1 = tc0 + BM_GEMV_KT;
    if (tc1 > tiles_per_row)
        tc1 = tiles_per_row;
    const int cnt = (int)(tc1 - tc0);
    const int rr = lane >> 2, q = lane & 3;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; b++)
        acc[b] = 0.0f;

    bm_stage_tile(wbuf, bits, offs, vals, tr * tiles_per_row + tc0, vsize, lane, 32);
    bm_commit();
    for (int it = 0; it < cnt; it++) {
        if (it + 1 < cnt)
            bm_stage_tile(wbuf + ((it + 1) & 1) * slot, bits, offs, vals, tr * tiles_per_row + tc0 + it + 1, vsize,
                          lane, 32);
        bm_commit(); /* possibly empty: keeps one group per iteration */
        bm_wait<1>();
        __syncwarp();
        const unsigned char *buf = wbuf + (it & 1) * slot;
        const int64_t t = tr * tiles_per_row + tc0 + it;
        int first = 0;
        unsigned mbits = bm_lane_bits(reinterpret_cast<const uint64_t *>(buf), rr, q, &first);
        const unsigned char *tv = bm_tile_vals(buf, offs, t, vsize);
        const float *xcol = xs + (it * BM_TILE_C + 16 * q) * NB;
        int idx = first;
        while (mbits) {
            const int c = __ffs(mbits) - 1;
            mbits &= mbits - 1;
            const float w = bm_val(tv, idx++, vsize);
            if constexpr (NB % 4 == 0) {
                const float4 *xv = reinterpret_cast<const float4 *>(xcol + c * NB);
#pragma unroll
                for (int b4 = 0; b4 < NB / 4; b4++) {
                    const float4 v4 = xv[b4];
                    acc[4 * b4 + 0] += w * v4.x;
                    acc[4 * b4 + 1] += w * v4.y;
                    acc[4 * b4 + 2] += w * v4.z;
                    acc[4 * b4 + 3] += w * v4.w;
                }
            } else {
#pragma unroll
                for (int b = 0; b < NB; b++)
                    acc[b] += w * xcol[c * NB + b];
            }
        }
        __syncwarp(); /* every lane is done with this buffer before the next iteration restages it */
    }
#pragma unroll
    for (int b = 0; b < NB; b++) {
        acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], 1);
        acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], 2);
    }
    const int64_t row = tr * BM_TILE_R + rr;
    if (q == 0 && row < rows) {
#pragma unroll
        for (int b = 0; b < NB; b++)
            if (b < nb)
                atomicAdd(&yacc[(int64_t)b * rows + row], acc[b]);
    }
}

/* Y[b, j] = acc[b, j] + beta·Y[b, j] in Y's dtype. */
template <typename TY>
__global__ void k_bitmap_finish(const float *__restrict__ yacc, TY *__restrict__ y, int64_t ldy, int64_t nb,
                                int64_t rows, float beta)
{
    const int64_t total = nb * rows;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t b = i / rows, j = i % rows;
        TY *p = y + b * ldy + j;
        float v = yacc[i];
        if (beta != 0.0f)
            v += beta * kc_ld(*p);
        *p = kc_st<TY>(v);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Dense decode: one warp per tile. */

template <typename TD>
__global__ void k_bitmap_decode(const uint64_t *__restrict__ bits, const int32_t *__restrict__ offs,
                                const unsigned char *__restrict__ vals, int vsize, int64_t rows, int64_t cols,
                                int64_t tiles_per_row, int64_t n_tiles, TD *__restrict__ dst, int64_t ldd)
{
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= n_tiles)
        return;
    const int rr = lane >> 2, q = lane & 3;
    int first = 0;
    unsigned mbits = bm_lane_bits(bits + t * 8, rr, q, &first);
    const int64_t tr = t / tiles_per_row, tc = t % tiles_per_row;
    const int64_t row = tr * BM_TILE_R + rr;
    if (row >= rows)
        return;
    const unsigned char *tv = vals + (int64_t)offs[t] * vsize;
    TD *out = dst + row * ldd + tc * BM_TILE_C + 16 * q;
    const int64_t c0 = tc * BM_TILE_C + 16 * q;
    int idx = first;
#pragma unroll
    for (int c = 0; c < 16; c++) {
        const float v = bm_lane_val(mbits, c, tv, &idx, vsize);
        if (c0 + c < cols)
            out[c] = kc_st<TD>(v);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Pipelined decode + tensor-core GEMM (n > 16, 16-bit activations). */

#define MMA_BM   64 /* rows of X (tokens) per block */
#define MMA_BN   64 /* output features per block = 8 tile rows */
#define MMA_LDX  (BM_TILE_C + 8)
#define MMA_LDW  (BM_TILE_C + 8)
#define MMA_LDE  (32 + 4)

static size_t mma_raw_bytes(int vsize)
{
    size_t b = (size_t)8 * 64 + (size_t)8 * (BM_TILE_R * BM_TILE_C * (size_t)vsize + BM_PAD);
    return (b + 127) / 128 * 128;
}
static size_t mma_x_bytes(void)
{
    return ((size_t)MMA_BM * MMA_LDX * 2 + 127) / 128 * 128;
}
static size_t mma_w_bytes(void)
{
    return ((size_t)MMA_BN * MMA_LDW * 2 + 127) / 128 * 128;
}
static size_t mma_smem_bytes(int vsize)
{
    size_t s = 2 * (mma_raw_bytes(vsize) + mma_x_bytes()) + 2 * mma_w_bytes();
    size_t epi = (size_t)4 * 32 * MMA_LDE * 4;
    return s > epi ? s : epi;
}

template <typename T>
__global__ void __launch_bounds__(128)
    k_bitmap_mma(const uint64_t *__restrict__ bits, const int32_t *__restrict__ offs,
                 const unsigned char *__restrict__ vals, int vsize, int64_t rows, int64_t cols, int64_t tiles_per_row,
                 int64_t tile_rows, const T *__restrict__ x, int64_t ldx, int64_t m_total, T *__restrict__ y,
                 int64_t ldy, float beta, size_t raw_bytes, size_t x_bytes, size_t w_bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    using namespace nvcuda;
    extern __shared__ __align__(128) unsigned char smem_mma[];
    unsigned char *smem = smem_mma;
    /* Stage and slab addresses computed (not kept in arrays indexed at run time: no stack frame). */
    auto RAW = [&](int s) { return smem + (size_t)s * raw_bytes; };
    auto XS = [&](int s) { return reinterpret_cast<T *>(smem + 2 * raw_bytes + (size_t)s * x_bytes); };
    auto WD = [&](int s) { return reinterpret_cast<T *>(smem + 2 * raw_bytes + 2 * x_bytes + (size_t)s * w_bytes); };
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n0 = (int64_t)blockIdx.x * MMA_BN, m0 = (int64_t)blockIdx.y * MMA_BM;
    const int64_t tr0 = n0 / BM_TILE_R;
    const int64_t KT = tiles_per_row;
    const size_t slot = (size_t)BM_TILE_R * BM_TILE_C * vsize + BM_PAD;

    /* Stage step kt into stage s: warp w stages tiles (tile rows) 2w, 2w+1, and 16 rows of X. */
    auto stage = [&](int64_t kt, int s) {
        for (int i = 0; i < 2; i++) {
            const int tl = 2 * warp + i;
            const int64_t tr = tr0 + tl;
            if (tr >= tile_rows)
                continue;
            bm_stage_tile_split(RAW(s) + tl * 64, RAW(s) + 8 * 64 + (size_t)tl * slot, bits, offs, vals,
                                tr * tiles_per_row + kt, vsize, lane, 32);
        }
        /* X slab: rows m0 + 16w .. +16, columns kt*64 .. +64 (8 chunks of 8 elements per row). */
        for (int idx = lane; idx < 16 * 8; idx += 32) {
            const int r = 16 * warp + idx / 8, c = idx % 8;
            const int64_t m = m0 + r, kk = kt * BM_TILE_C + c * 8;
            const bool ok = m < m_total && kk < cols;
            const T *src = ok ? x + m * ldx + kk : x;
            bm_cp16(XS(s) + r * MMA_LDX + c * 8, src, ok);
        }
    };
    /* Decode step kt's raw stage s into dense slab WD(d) ([64 n][64 k]). Warp w: tiles 2w, 2w+1. */
    auto decode = [&](int64_t kt, int s, int d) {
        const int rr = lane >> 2, q = lane & 3;
        for (int i = 0; i < 2; i++) {
            const int tl = 2 * warp + i;
            const int64_t tr = tr0 + tl;
            T *out = WD(d) + (tl * BM_TILE_R + rr) * MMA_LDW + 16 * q;
            if (tr >= tile_rows) {
#pragma unroll
                for (int c = 0; c < 16; c++)
                    out[c] = kc_st<T>(0.0f);
                continue;
            }
            const int64_t t = tr * tiles_per_row + kt;
            int first = 0;
            unsigned mbits = bm_lane_bits(reinterpret_cast<const uint64_t *>(RAW(s) + tl * 64), rr, q, &first);
            const int64_t vb0 = (int64_t)offs[t] * vsize;
            const unsigned char *tv = RAW(s) + 8 * 64 + (size_t)tl * slot + (vb0 & 15);
            int idx = first;
#pragma unroll
            for (int c = 0; c < 16; c++)
                out[c] = kc_st<T>(bm_lane_val(mbits, c, tv, &idx, vsize));
        }
    };

    const int wm = warp >> 1, wn = warp & 1; /* warp's 32x32 quadrant of the 64x64 block */
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);

    stage(0, 0);
    bm_commit();
    if (KT > 1)
        stage(1, 1);
    bm_commit();
    bm_wait<1>();
    __syncthreads();
    decode(0, 0, 0);
    for (int64_t kt = 0; kt < KT; kt++) {
        const int s = (int)(kt & 1);
        bm_wait<0>();    /* step kt+1's raw tiles and X slab have landed */
        __syncthreads(); /* and slab WD(s) (decoded last iteration) is visible */
        if (kt + 1 < KT)
            decode(kt + 1, s ^ 1, s ^ 1); /* overlaps with the MMAs below */
#pragma unroll
        for (int kk = 0; kk < BM_TILE_C / 16; kk++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                wmma::load_matrix_sync(fa[i], XS(s) + (wm * 32 + i * 16) * MMA_LDX + kk * 16, MMA_LDX);
#pragma unroll
            for (int j = 0; j < 2; j++)
                wmma::load_matrix_sync(fb[j], WD(s) + (wn * 32 + j * 16) * MMA_LDW + kk * 16, MMA_LDW);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads(); /* stage s (raw + X) and slab WD(s) are free again */
        if (kt + 2 < KT)
            stage(kt + 2, s);
        bm_commit();
    }
    bm_wait<0>();
    __syncthreads();
    /* Epilogue through shared memory: Y = acc + beta·Y. */
    float *ep = reinterpret_cast<float *>(smem) + warp * 32 * MMA_LDE;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(ep + (i * 16) * MMA_LDE + j * 16, acc[i][j], MMA_LDE, wmma::mem_row_major);
    __syncwarp();
    for (int idx = lane; idx < 32 * 32; idx += 32) {
        const int r = idx / 32, c = idx % 32;
        const int64_t m = m0 + wm * 32 + r, n = n0 + wn * 32 + c;
        if (m < m_total && n < rows) {
            T *p = y + m * ldy + n;
            float v = ep[r * MMA_LDE + c];
            if (beta != 0.0f)
                v += beta * kc_ld(*p);
            *p = kc_st<T>(v);
        }
    }
#endif
}

/* ---------------------------------------------------------------------------------------------- */
/* Host side */

extern "C" fu_err kern_cuda_bitmap_upload(const kern_backend_t *be, const kern_bitmap_t *bm, kern_cuda_bitmap_t **out)
{
    if (!be || !bm || !out || be->device.kind != KERN_DEV_CUDA || !be->impl)
        return FU_EINVAL;
    *out = NULL;
    kc_ctx *ctx = kc_of(be);
    size_t blen = 0, vlen = 0, olen = 0;
    const uint8_t *hb = kern_bitmap_bitmap(bm, &blen);
    const void *hv = kern_bitmap_values(bm, &vlen);
    const int32_t *ho = kern_bitmap_offsets(bm, &olen);
    if (!hb || !ho)
        return FU_EINVAL;
    const size_t o_bits = 0, o_offs = (blen + 255) / 256 * 256;
    const size_t o_vals = (o_offs + olen + 255) / 256 * 256;
    const size_t total = o_vals + vlen + BM_PAD;
    kern_cuda_bitmap_t *w = (kern_cuda_bitmap_t *)calloc(1, sizeof *w);
    if (!w)
        return FU_ENOMEM;
    fu_err rc = kc_enter(ctx);
    if (rc == FU_OK)
        rc = kc_scratch(ctx, total, &w->block);
    if (rc != FU_OK) {
        free(w);
        return rc;
    }
    unsigned char *base = (unsigned char *)w->block;
    cudaError_t e = cudaMemcpyAsync(base + o_bits, hb, blen, cudaMemcpyHostToDevice, ctx->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(base + o_offs, ho, olen, cudaMemcpyHostToDevice, ctx->stream);
    if (e == cudaSuccess && vlen)
        e = cudaMemcpyAsync(base + o_vals, hv, vlen, cudaMemcpyHostToDevice, ctx->stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(base + o_vals + vlen, 0, BM_PAD, ctx->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(ctx->stream);
    if (e != cudaSuccess) {
        rc = kc_cuda_err(e, "bitmap upload", __FILE__, __LINE__);
        kc_scratch_free(ctx, w->block);
        free(w);
        return rc;
    }
    w->be = be;
    w->rows = kern_bitmap_rows(bm);
    w->cols = kern_bitmap_cols(bm);
    w->nnz = kern_bitmap_nnz(bm);
    w->n_tiles = kern_bitmap_n_tiles(bm);
    w->tiles_per_row = (w->cols + BM_TILE_C - 1) / BM_TILE_C;
    w->tile_rows = (w->rows + BM_TILE_R - 1) / BM_TILE_R;
    w->dtype = kern_bitmap_dtype_of(bm);
    w->vsize = w->dtype == KERN_BITMAP_F16 ? 2 : 4;
    w->bits = (const uint64_t *)(base + o_bits);
    w->offs = (const int32_t *)(base + o_offs);
    w->vals = base + o_vals;
    *out = w;
    return FU_OK;
}

extern "C" void kern_cuda_bitmap_destroy(kern_cuda_bitmap_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kern_cuda_bitmap_t *w = *self_p;
    *self_p = NULL;
    kc_scratch_free(kc_of(w->be), w->block);
    free(w);
}

extern "C" size_t kern_cuda_bitmap_rows(const kern_cuda_bitmap_t *self)
{
    return self ? self->rows : 0;
}

extern "C" size_t kern_cuda_bitmap_cols(const kern_cuda_bitmap_t *self)
{
    return self ? self->cols : 0;
}

static bool bm_mat(const kern_backend_t *be, const kern_tensor_t *t)
{
    return t && t->ndim == 2 && kc_is_float(t->dtype) && (t->shape[1] <= 1 || t->stride[1] == 1) &&
           t->device.kind == KERN_DEV_CUDA && t->device.index == be->device.index &&
           (t->data || kern_tensor_numel(t) == 0) && t->stride[0] >= t->shape[1];
}

static int64_t bm_ld(const kern_tensor_t *t)
{
    return t->stride[0] < 1 ? 1 : t->stride[0];
}

static fu_err bm_check(const kern_backend_t *be, const kern_cuda_bitmap_t *w)
{
    if (!be || !w || be->device.kind != KERN_DEV_CUDA || !be->impl || w->be->device.index != be->device.index)
        return FU_EINVAL;
    return FU_OK;
}

template <typename TD>
static fu_err bm_decode_t(kc_ctx *ctx, const kern_cuda_bitmap_t *w, TD *dst, int64_t ldd)
{
    const unsigned blocks = (unsigned)((w->n_tiles + 3) / 4);
    k_bitmap_decode<TD><<<blocks, 128, 0, ctx->stream>>>(w->bits, w->offs, w->vals, (int)w->vsize, (int64_t)w->rows,
                                                         (int64_t)w->cols, (int64_t)w->tiles_per_row,
                                                         (int64_t)w->n_tiles, dst, ldd);
    KC_LAUNCHED();
    return FU_OK;
}

static fu_err bm_decode_any(kc_ctx *ctx, const kern_cuda_bitmap_t *w, kern_dtype dt, void *dst, int64_t ldd)
{
    switch (dt) {
    case KERN_F32:
        return bm_decode_t<float>(ctx, w, (float *)dst, ldd);
    case KERN_F16:
        return bm_decode_t<__half>(ctx, w, (__half *)dst, ldd);
    case KERN_BF16:
        return bm_decode_t<__nv_bfloat16>(ctx, w, (__nv_bfloat16 *)dst, ldd);
    default:
        return FU_EINVAL;
    }
}

extern "C" fu_err kern_cuda_bitmap_decode(const kern_backend_t *be, const kern_cuda_bitmap_t *w, kern_tensor_t *dst)
{
    FU_TRY(bm_check(be, w));
    if (!bm_mat(be, dst) || dst->shape[0] != (int64_t)w->rows || dst->shape[1] != (int64_t)w->cols)
        return FU_EINVAL;
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    return bm_decode_any(ctx, w, dst->dtype, dst->data, bm_ld(dst));
}

template <typename TX, int NB>
static fu_err gemv_launch(kc_ctx *ctx, const kern_cuda_bitmap_t *w, const TX *x, int64_t ldx, int nb, float *yacc)
{
    const size_t smem = (size_t)NB * BM_GEMV_KT * BM_TILE_C * 4 + (size_t)BM_GEMV_WARPS * 2 * gemv_slot((int)w->vsize);
    if (smem > ctx->smem_optin)
        return FU_EINVAL;
    KC_CUDA(cudaFuncSetAttribute(k_bitmap_gemv<TX, NB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned)((w->tile_rows + BM_GEMV_WARPS - 1) / BM_GEMV_WARPS),
              (unsigned)((w->tiles_per_row + BM_GEMV_KT - 1) / BM_GEMV_KT));
    k_bitmap_gemv<TX, NB><<<grid, 32 * BM_GEMV_WARPS, smem, ctx->stream>>>(
        w->bits, w->offs, w->vals, (int)w->vsize, (int64_t)w->rows, (int64_t)w->cols, (int64_t)w->tiles_per_row,
        (int64_t)w->tile_rows, x, ldx, nb, yacc);
    KC_LAUNCHED();
    return FU_OK;
}

template <typename TX>
static fu_err gemv_t(kc_ctx *ctx, const kern_cuda_bitmap_t *w, const TX *x, int64_t ldx, int64_t n, TX *y, int64_t ldy,
                     float beta)
{
    if (w->tiles_per_row > 65535LL * BM_GEMV_KT)
        return FU_EINVAL;
    float *yacc = NULL;
    FU_TRY(kc_scratch(ctx, (size_t)n * w->rows * sizeof(float), (void **)&yacc));
    fu_err rc = FU_OK;
    cudaError_t e = cudaMemsetAsync(yacc, 0, (size_t)n * w->rows * sizeof(float), ctx->stream);
    if (e != cudaSuccess)
        rc = kc_cuda_err(e, "cudaMemsetAsync", __FILE__, __LINE__);
    if (rc == FU_OK) {
        if (n == 1)
            rc = gemv_launch<TX, 1>(ctx, w, x, ldx, 1, yacc);
        else if (n <= 4)
            rc = gemv_launch<TX, 4>(ctx, w, x, ldx, (int)n, yacc);
        else
            rc = gemv_launch<TX, 16>(ctx, w, x, ldx, (int)n, yacc);
    }
    if (rc == FU_OK) {
        k_bitmap_finish<TX><<<kc_blocks(n * (int64_t)w->rows, 256), 256, 0, ctx->stream>>>(yacc, y, ldy, n,
                                                                                         (int64_t)w->rows, beta);
        e = cudaGetLastError();
        if (e != cudaSuccess)
            rc = kc_cuda_err(e, "bitmap finish", __FILE__, __LINE__);
    }
    kc_scratch_free(ctx, yacc);
    return rc;
}

template <typename T>
static fu_err mma_t(kc_ctx *ctx, const kern_cuda_bitmap_t *w, const T *x, int64_t ldx, int64_t n, T *y, int64_t ldy,
                    float beta)
{
    const size_t smem = mma_smem_bytes((int)w->vsize);
    KC_CUDA(cudaFuncSetAttribute(k_bitmap_mma<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned)((w->rows + MMA_BN - 1) / MMA_BN), (unsigned)((n + MMA_BM - 1) / MMA_BM));
    k_bitmap_mma<T><<<grid, 128, smem, ctx->stream>>>(w->bits, w->offs, w->vals, (int)w->vsize, (int64_t)w->rows,
                                                      (int64_t)w->cols, (int64_t)w->tiles_per_row,
                                                      (int64_t)w->tile_rows, x, ldx, n, y, ldy, beta,
                                                      mma_raw_bytes((int)w->vsize), mma_x_bytes(), mma_w_bytes());
    KC_LAUNCHED();
    return FU_OK;
}

/* Decode to a dense scratch of dtype dt, then one cuBLAS GEMM: Y = X·Wᵀ + beta·Y. */
static fu_err dense_path(kc_ctx *ctx, const kern_cuda_bitmap_t *w, const kern_tensor_t *x, float beta,
                         kern_tensor_t *y)
{
    void *dense = NULL;
    const kern_dtype dt = x->dtype;
    FU_TRY(kc_scratch(ctx, w->rows * w->cols * kern_dtype_size(dt), &dense));
    fu_err rc = bm_decode_any(ctx, w, dt, dense, (int64_t)w->cols);
    if (rc == FU_OK)
        rc = kc_gemm_raw(ctx, dt, false, true, (int)x->shape[0], (int)w->rows, (int)w->cols, 1.0f, x->data, bm_ld(x),
                         dense, (int64_t)w->cols, beta, y->data, bm_ld(y));
    kc_scratch_free(ctx, dense);
    return rc;
}

static fu_err bitmap_matmul(const kern_backend_t *be, const kern_tensor_t *x, const kern_cuda_bitmap_t *w, float beta,
                            kern_tensor_t *y, bool fused_only)
{
    FU_TRY(bm_check(be, w));
    if (!bm_mat(be, x) || !bm_mat(be, y) || x->dtype != y->dtype || x->shape[1] != (int64_t)w->cols ||
        y->shape[0] != x->shape[0] || y->shape[1] != (int64_t)w->rows || (beta != 0.0f && beta != 1.0f))
        return FU_EINVAL;
    if (w->rows > INT32_MAX || w->cols > INT32_MAX || x->shape[0] > INT32_MAX)
        return FU_EINVAL;
    const int64_t n = x->shape[0];
    if (n == 0)
        return FU_OK;
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    const int64_t ldx = bm_ld(x), ldy = bm_ld(y);
    if (n <= KERN_CUDA_BITMAP_GEMV_MAX_BATCH) {
        switch (x->dtype) {
        case KERN_F32:
            return gemv_t<float>(ctx, w, (const float *)x->data, ldx, n, (float *)y->data, ldy, beta);
        case KERN_F16:
            return gemv_t<__half>(ctx, w, (const __half *)x->data, ldx, n, (__half *)y->data, ldy, beta);
        default:
            return gemv_t<__nv_bfloat16>(ctx, w, (const __nv_bfloat16 *)x->data, ldx, n, (__nv_bfloat16 *)y->data,
                                         ldy, beta);
        }
    }
    const bool aligned = ((uintptr_t)x->data & 15) == 0 && ldx % 8 == 0 && w->cols % 8 == 0;
    const bool mma_ok = x->dtype != KERN_F32 && ctx->cc_major >= 8 && aligned &&
                        mma_smem_bytes((int)w->vsize) <= ctx->smem_optin && n <= 65535LL * MMA_BM &&
                        w->rows <= 65535ull * MMA_BN;
    if (mma_ok && (fused_only || n < KERN_CUDA_BITMAP_DENSE_MIN_BATCH)) {
        if (x->dtype == KERN_F16)
            return mma_t<__half>(ctx, w, (const __half *)x->data, ldx, n, (__half *)y->data, ldy, beta);
        return mma_t<__nv_bfloat16>(ctx, w, (const __nv_bfloat16 *)x->data, ldx, n, (__nv_bfloat16 *)y->data, ldy,
                                    beta);
    }
    if (fused_only)
        return FU_EINVAL;
    return dense_path(ctx, w, x, beta, y);
}

extern "C" fu_err kern_cuda_bitmap_matmul(const kern_backend_t *be, const kern_tensor_t *x, const kern_cuda_bitmap_t *w,
                                          float beta, kern_tensor_t *y)
{
    return bitmap_matmul(be, x, w, beta, y, false);
}

extern "C" fu_err kern_cuda_bitmap_matmul_fused(const kern_backend_t *be, const kern_tensor_t *x,
                                                const kern_cuda_bitmap_t *w, float beta, kern_tensor_t *y)
{
    return bitmap_matmul(be, x, w, beta, y, true);
}

extern "C" fu_err kern_cuda_bitmap_matmul_dx(const kern_backend_t *be, const kern_tensor_t *dy,
                                             const kern_cuda_bitmap_t *w, kern_tensor_t *dx)
{
    FU_TRY(bm_check(be, w));
    if (!bm_mat(be, dy) || !bm_mat(be, dx) || dy->dtype != dx->dtype || dy->shape[1] != (int64_t)w->rows ||
        dx->shape[0] != dy->shape[0] || dx->shape[1] != (int64_t)w->cols)
        return FU_EINVAL;
    if (w->rows > INT32_MAX || w->cols > INT32_MAX || dy->shape[0] > INT32_MAX)
        return FU_EINVAL;
    kc_ctx *ctx = kc_of(be);
    FU_TRY(kc_enter(ctx));
    const kern_dtype dt = dy->dtype;
    void *dense = NULL;
    FU_TRY(kc_scratch(ctx, w->rows * w->cols * kern_dtype_size(dt), &dense));
    fu_err rc = bm_decode_any(ctx, w, dt, dense, (int64_t)w->cols);
    if (rc == FU_OK)
        rc = kc_gemm_raw(ctx, dt, false, false, (int)dy->shape[0], (int)w->cols, (int)w->rows, 1.0f, dy->data,
                         bm_ld(dy), dense, (int64_t)w->cols, 0.0f, dx->data, bm_ld(dx));
    kc_scratch_free(ctx, dense);
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* SALR layer */

extern "C" fu_err kern_cuda_salr_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_cuda_bitmap_t *w,
                                         const kern_tensor_t *a_cat, const kern_tensor_t *b_cat, kern_tensor_t *h,
                                         kern_tensor_t *y)
{
    FU_TRY(bm_check(be, w));
    const bool adapters = a_cat || b_cat || h;
    if (!adapters)
        return kern_cuda_bitmap_matmul(be, x, w, 0.0f, y);
    if (!a_cat || !b_cat || !h || !bm_mat(be, a_cat) || !bm_mat(be, b_cat) || !bm_mat(be, h) || !bm_mat(be, x) ||
        !bm_mat(be, y))
        return FU_EINVAL;
    const kern_dtype dt = x->dtype;
    const int64_t n = x->shape[0], in = (int64_t)w->cols, out = (int64_t)w->rows, rt = a_cat->shape[0];
    if (a_cat->dtype != dt || b_cat->dtype != dt || h->dtype != dt || y->dtype != dt || a_cat->shape[1] != in ||
        b_cat->shape[0] != out || b_cat->shape[1] != rt || h->shape[0] != n || h->shape[1] != rt || rt < 1 ||
        x->shape[1] != in || y->shape[0] != n || y->shape[1] != out)
        return FU_EINVAL;
    kc_ctx *ctx = kc_of(be);
    /* The GEMM pair: h = X·a_catᵀ, Y = h·b_catᵀ; then the sparse product accumulates (beta = 1). */
    FU_TRY(kc_gemm_raw(ctx, dt, false, true, (int)n, (int)rt, (int)in, 1.0f, x->data, bm_ld(x), a_cat->data,
                       bm_ld(a_cat), 0.0f, h->data, bm_ld(h)));
    FU_TRY(kc_gemm_raw(ctx, dt, false, true, (int)n, (int)out, (int)rt, 1.0f, h->data, bm_ld(h), b_cat->data,
                       bm_ld(b_cat), 0.0f, y->data, bm_ld(y)));
    return kern_cuda_bitmap_matmul(be, x, w, 1.0f, y);
}

extern "C" fu_err kern_cuda_salr_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *h,
                                          const kern_cuda_bitmap_t *w, const kern_tensor_t *a_cat,
                                          const kern_tensor_t *b_cat, float s1, kern_tensor_t *db1, kern_tensor_t *dx)
{
    FU_TRY(bm_check(be, w));
    if (!bm_mat(be, dy))
        return FU_EINVAL;
    const kern_dtype dt = dy->dtype;
    const int64_t n = dy->shape[0], in = (int64_t)w->cols, out = (int64_t)w->rows;
    if (dy->shape[1] != out)
        return FU_EINVAL;
    const bool adapters = a_cat || b_cat || h;
    int64_t rt = 0;
    if (adapters) {
        if (!a_cat || !b_cat || !h || !bm_mat(be, a_cat) || !bm_mat(be, b_cat) || !bm_mat(be, h))
            return FU_EINVAL;
        rt = a_cat->shape[0];
        if (a_cat->dtype != dt || b_cat->dtype != dt || h->dtype != dt || a_cat->shape[1] != in ||
            b_cat->shape[0] != out || b_cat->shape[1] != rt || h->shape[0] != n || h->shape[1] != rt)
            return FU_EINVAL;
    }
    if (db1 && (!adapters || !bm_mat(be, db1) || db1->dtype != dt || db1->shape[0] != out || db1->shape[1] < 1 ||
                db1->shape[1] > rt))
        return FU_EINVAL;
    if (dx && (!bm_mat(be, dx) || dx->dtype != dt || dx->shape[0] != n || dx->shape[1] != in))
        return FU_EINVAL;
    kc_ctx *ctx = kc_of(be);
    /* db1 += s1·dYᵀ·h[:, :r1] (a column slice of h: same leading dimension) */
    if (db1)
        FU_TRY(kc_gemm_raw(ctx, dt, true, false, (int)out, (int)db1->shape[1], (int)n, s1, dy->data, bm_ld(dy), h->data,
                           bm_ld(h), 1.0f, db1->data, bm_ld(db1)));
    if (!dx)
        return FU_OK;
    FU_TRY(kern_cuda_bitmap_matmul_dx(be, dy, w, dx));
    if (!adapters)
        return FU_OK;
    void *g = NULL;
    FU_TRY(kc_scratch(ctx, (size_t)n * (size_t)rt * kern_dtype_size(dt), &g));
    fu_err rc = kc_gemm_raw(ctx, dt, false, false, (int)n, (int)rt, (int)out, 1.0f, dy->data, bm_ld(dy), b_cat->data,
                            bm_ld(b_cat), 0.0f, g, rt);
    if (rc == FU_OK)
        rc = kc_gemm_raw(ctx, dt, false, false, (int)n, (int)in, (int)rt, 1.0f, g, rt, a_cat->data, bm_ld(a_cat), 1.0f,
                         dx->data, bm_ld(dx));
    kc_scratch_free(ctx, g);
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* Table entries (kern_sparse_weight.handle is a const kern_cuda_bitmap_t *) */

static fu_err sparse_handle(const kern_backend_t *be, const kern_sparse_weight *sw, const kern_cuda_bitmap_t **out)
{
    if (!sw || !sw->handle)
        return FU_EINVAL;
    const kern_cuda_bitmap_t *w = (const kern_cuda_bitmap_t *)sw->handle;
    FU_TRY(bm_check(be, w));
    if ((int64_t)w->rows != sw->rows || (int64_t)w->cols != sw->cols)
        return FU_EINVAL;
    *out = w;
    return FU_OK;
}

extern "C" fu_err kc_sparse_matmul(const kern_backend_t *be, const kern_tensor_t *x, const kern_sparse_weight *sw,
                                   float beta, kern_tensor_t *y)
{
    const kern_cuda_bitmap_t *w = NULL;
    FU_TRY(sparse_handle(be, sw, &w));
    return kern_cuda_bitmap_matmul(be, x, w, beta, y);
}

extern "C" fu_err kc_sparse_matmul_dx(const kern_backend_t *be, const kern_tensor_t *dy, const kern_sparse_weight *sw,
                                      kern_tensor_t *dx)
{
    const kern_cuda_bitmap_t *w = NULL;
    FU_TRY(sparse_handle(be, sw, &w));
    return kern_cuda_bitmap_matmul_dx(be, dy, w, dx);
}
