/* SIMD loops of the SALR bitmap format: decode into dense rows and the fused decode-and-multiply
 * for small batches, in scalar, AVX2 (pdep-built permutes) and AVX-512 (expand) versions. The SIMD
 * functions carry function-level target attributes; callers choose one with kern_simd_active(). */
#include "kern_salr_simd.h"

#include <immintrin.h>
#include <string.h>

#include "kern_salr.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,popcnt,bmi,bmi2")))
#define T256 __attribute__((target("avx2,fma,f16c,popcnt,bmi,bmi2")))
#define INLINE static inline __attribute__((always_inline))

/* Software prefetch distance of the fused product, in tiles (a tile holds ~256 values at 50%). */
#ifndef KERN_SALR_PREFETCH_TILES
#define KERN_SALR_PREFETCH_TILES 4
#endif

#define TR KERN_BITMAP_TILE_ROWS
#define TC KERN_BITMAP_TILE_COLS

static inline size_t tile_width(const kern_bitmap_view *v, size_t tj)
{
    size_t c0 = tj * TC;
    return v->cols - c0 < TC ? v->cols - c0 : TC;
}

/* The body of kern_bitmap_decode_rows_<isa> (its parameters v, row0, nrows, dst, ld): the tile
 * walk is the same for every ISA, only DECODE_WORD differs. Each stored word of the rows
 * [row0, row0 + nrows) goes to DECODE_WORD(word, v, k, out, width): k is the index of the word's
 * first value, out the destination row at the tile's first column, width the tile's column count. */
#define DECODE_ROWS(DECODE_WORD)                                                                    \
    size_t row_end = row0 + nrows;                                                                  \
    for (size_t ti = row0 / TR; ti * TR < row_end; ti++) {                                          \
        for (size_t tj = 0; tj < v->tiles_c; tj++) {                                                \
            size_t t = ti * v->tiles_c + tj;                                                        \
            size_t k = (size_t)v->offsets[t];                                                       \
            size_t c0 = tj * TC, width = tile_width(v, tj);                                         \
            for (size_t rr = 0; rr < TR; rr++) {                                                    \
                size_t   r = ti * TR + rr;                                                          \
                uint64_t word = v->bitmap[t * TR + rr];                                             \
                if (r >= row0 && r < row_end)                                                       \
                    DECODE_WORD(word, v, k, dst + (r - row0) * ld + c0, width);                     \
                k += (size_t)__builtin_popcountll(word);                                            \
            }                                                                                       \
        }                                                                                           \
    }

/* The body of kern_salr_spmv_<isa> (its parameters v, tr0, tr1, x, ldx, n, y, ldy, accumulate):
 * batches of 1 to 4 rows run TILEROW with the batch size and the value type as constants, so its
 * loops unroll fully; larger batches run the scalar loop. */
#define SPMV_CASE(TILEROW, NB)                                                                      \
    case NB:                                                                                        \
        for (size_t ti = tr0; ti < tr1; ti++) {                                                     \
            if (f16)                                                                                \
                TILEROW(v, ti, x, ldx, NB, 1, y, ldy, accumulate);                                  \
            else                                                                                    \
                TILEROW(v, ti, x, ldx, NB, 0, y, ldy, accumulate);                                  \
        }                                                                                           \
        break;
#define SPMV_DISPATCH(TILEROW)                                                                      \
    int f16 = v->dtype == KERN_BITMAP_F16;                                                          \
    switch (n) {                                                                                    \
        SPMV_CASE(TILEROW, 1)                                                                       \
        SPMV_CASE(TILEROW, 2)                                                                       \
        SPMV_CASE(TILEROW, 3)                                                                       \
        SPMV_CASE(TILEROW, 4)                                                                       \
    default:                                                                                        \
        kern_salr_spmv_scalar(v, tr0, tr1, x, ldx, n, y, ldy, accumulate);                          \
        break;                                                                                      \
    }

/* ---- scalar ------------------------------------------------------------------------------------- */

/* Writes the width floats of one row word at dst (zeros where no value is stored). */
static void decode_word_scalar(uint64_t word, const kern_bitmap_view *v, size_t k, float *dst, size_t width)
{
    memset(dst, 0, width * sizeof(float));
    const float    *v32 = v->values;
    const uint16_t *v16 = v->values;
    size_t          n = 0;
    while (word) {
        unsigned b = (unsigned)__builtin_ctzll(word);
        word &= word - 1;
        dst[b] = v->dtype == KERN_BITMAP_F32 ? v32[k + n] : kern_bitmap_f16_to_f32(v16[k + n]);
        n++;
    }
}

void kern_bitmap_decode_rows_scalar(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst, size_t ld)
{
    DECODE_ROWS(decode_word_scalar)
}

void kern_salr_spmv_scalar(const kern_bitmap_view *v, size_t tr0, size_t tr1, const float *x, size_t ldx,
                           size_t n, float *y, size_t ldy, bool accumulate)
{
    const float    *v32 = v->values;
    const uint16_t *v16 = v->values;
    for (size_t ti = tr0; ti < tr1; ti++) {
        float sum[KERN_SALR_FUSED_MAX_BATCH][TR];
        memset(sum, 0, sizeof sum);
        for (size_t tj = 0; tj < v->tiles_c; tj++) {
            size_t t = ti * v->tiles_c + tj;
            size_t k = (size_t)v->offsets[t];
            size_t c0 = tj * TC;
            for (size_t rr = 0; rr < TR; rr++) {
                uint64_t word = v->bitmap[t * TR + rr];
                while (word) {
                    unsigned bit = (unsigned)__builtin_ctzll(word);
                    word &= word - 1;
                    float val = v->dtype == KERN_BITMAP_F32 ? v32[k] : kern_bitmap_f16_to_f32(v16[k]);
                    k++;
                    for (size_t b = 0; b < n; b++)
                        sum[b][rr] += val * x[b * ldx + c0 + bit];
                }
            }
        }
        for (size_t rr = 0; rr < TR && ti * TR + rr < v->rows; rr++)
            for (size_t b = 0; b < n; b++) {
                float *yp = y + b * ldy + ti * TR + rr;
                *yp = accumulate ? *yp + sum[b][rr] : sum[b][rr];
            }
    }
}

/* ---- AVX-512 ------------------------------------------------------------------------------------ */

/* 16 values expanded into the lanes set in m, zeros elsewhere; *pp advances by popcount(m).
 * vexpandps with a memory operand measured as fast as (often faster than) a plain load followed by
 * a register expand on Zen 4; it reads only popcount(m) values. */
T512 INLINE __m512 expand16_f32(__mmask16 m, const float **pp)
{
    __m512 val = _mm512_maskz_expandloadu_ps(m, *pp);
    *pp += __builtin_popcount((unsigned)m);
    return val;
}

T512 INLINE __m512 expand16_f16(__mmask16 m, const uint16_t **pp)
{
    __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)*pp));
    *pp += __builtin_popcount((unsigned)m);
    return _mm512_maskz_expand_ps(m, f);
}

T512 INLINE void decode_word_512(uint64_t word, const kern_bitmap_view *v, size_t k, float *dst, size_t width)
{
    const float    *p32 = (const float *)v->values + k;
    const uint16_t *p16 = (const uint16_t *)v->values + k;
    for (unsigned q = 0; q < 4 && 16u * q < width; q++) {
        __mmask16 m = (__mmask16)(word >> (16u * q));
        __m512    val = v->dtype == KERN_BITMAP_F32 ? expand16_f32(m, &p32) : expand16_f16(m, &p16);
        size_t    lanes = width - 16u * q;
        if (lanes >= 16)
            _mm512_storeu_ps(dst + 16u * q, val);
        else
            _mm512_mask_storeu_ps(dst + 16u * q, (__mmask16)((1u << lanes) - 1u), val);
    }
}

T512 void kern_bitmap_decode_rows_avx512(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst,
                                         size_t ld)
{
    DECODE_ROWS(decode_word_512)
}

/* One tile row (8 output rows) times NB batch rows, values stored as f32 (F16 = 0) or f16. */
T512 INLINE void spmv512_tilerow(const kern_bitmap_view *v, size_t ti, const float *x, size_t ldx,
                                 const size_t NB, const int F16, float *y, size_t ldy, bool accumulate)
{
    __m512 acc[TR][KERN_SALR_FUSED_MAX_BATCH];
#pragma GCC unroll 8
    for (size_t rr = 0; rr < TR; rr++)
#pragma GCC unroll 4
        for (size_t b = 0; b < NB; b++)
            acc[rr][b] = _mm512_setzero_ps();

    for (size_t tj = 0; tj < v->tiles_c; tj++) {
        size_t          t = ti * v->tiles_c + tj;
        const uint64_t *bm = v->bitmap + t * TR;
        const float    *p32 = (const float *)v->values + v->offsets[t];
        const uint16_t *p16 = (const uint16_t *)v->values + v->offsets[t];
        size_t          c0 = tj * TC, width = tile_width(v, tj);
        __m512          xv[KERN_SALR_FUSED_MAX_BATCH][4];
        if (width == TC) {
#pragma GCC unroll 4
            for (size_t b = 0; b < NB; b++)
#pragma GCC unroll 4
                for (unsigned q = 0; q < 4; q++)
                    xv[b][q] = _mm512_loadu_ps(x + b * ldx + c0 + 16u * q);
        } else {
#pragma GCC unroll 4
            for (size_t b = 0; b < NB; b++)
#pragma GCC unroll 4
                for (unsigned q = 0; q < 4; q++) {
                    size_t    lanes = width > 16u * q ? width - 16u * q : 0;
                    __mmask16 lm = (__mmask16)(lanes >= 16 ? 0xffffu : (1u << lanes) - 1u);
                    xv[b][q] = lanes ? _mm512_maskz_loadu_ps(lm, x + b * ldx + c0 + 16u * q)
                                     : _mm512_setzero_ps();
                }
        }
        _mm_prefetch((const char *)(bm + KERN_SALR_PREFETCH_TILES * TR), _MM_HINT_T0);
#pragma GCC unroll 8
        for (size_t rr = 0; rr < TR; rr++) {
            uint64_t word = bm[rr];
            if (F16) {
                _mm_prefetch((const char *)(p16 + KERN_SALR_PREFETCH_TILES * 256), _MM_HINT_T0);
            } else {
                _mm_prefetch((const char *)(p32 + KERN_SALR_PREFETCH_TILES * 256), _MM_HINT_T0);
                _mm_prefetch((const char *)(p32 + KERN_SALR_PREFETCH_TILES * 256 + 16), _MM_HINT_T0);
            }
#pragma GCC unroll 4
            for (unsigned q = 0; q < 4; q++) {
                __mmask16 m = (__mmask16)(word >> (16u * q));
                __m512    w = F16 ? expand16_f16(m, &p16) : expand16_f32(m, &p32);
#pragma GCC unroll 4
                for (size_t b = 0; b < NB; b++)
                    acc[rr][b] = _mm512_fmadd_ps(w, xv[b][q], acc[rr][b]);
            }
        }
    }
    for (size_t rr = 0; rr < TR && ti * TR + rr < v->rows; rr++)
        for (size_t b = 0; b < NB; b++) {
            float  s = _mm512_reduce_add_ps(acc[rr][b]);
            float *yp = y + b * ldy + ti * TR + rr;
            *yp = accumulate ? *yp + s : s;
        }
}

T512 void kern_salr_spmv_avx512(const kern_bitmap_view *v, size_t tr0, size_t tr1, const float *x,
                                size_t ldx, size_t n, float *y, size_t ldy, bool accumulate)
{
    SPMV_DISPATCH(spmv512_tilerow)
}

/* ---- AVX2 --------------------------------------------------------------------------------------- */

/* The lanes of m8 set get consecutive values (from *pp), the others zero; built with pdep. */
T256 INLINE __m256 expand8_perm(unsigned m8, __m256 src)
{
    uint64_t bytes = _pdep_u64(m8, 0x0101010101010101ULL) * 0xFFu;
    uint64_t idx = _pdep_u64(0x0706050403020100ULL, bytes);
    __m256i  vidx = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)idx));
    __m256i  vmsk = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128((long long)bytes));
    return _mm256_and_ps(_mm256_permutevar8x32_ps(src, vidx), _mm256_castsi256_ps(vmsk));
}

T256 INLINE __m256 expand8_f32(unsigned m8, const float **pp)
{
    __m256 val = expand8_perm(m8, _mm256_loadu_ps(*pp));
    *pp += __builtin_popcount(m8);
    return val;
}

T256 INLINE __m256 expand8_f16(unsigned m8, const uint16_t **pp)
{
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)*pp));
    *pp += __builtin_popcount(m8);
    return expand8_perm(m8, f);
}

/* As decode_word_512, eight lanes at a time; a partial last group goes through a stack buffer. */
T256 INLINE void decode_word_256(uint64_t word, const kern_bitmap_view *v, size_t k, float *dst, size_t width)
{
    const float    *p32 = (const float *)v->values + k;
    const uint16_t *p16 = (const uint16_t *)v->values + k;
    for (unsigned q = 0; q < 8 && 8u * q < width; q++) {
        unsigned m8 = (unsigned)(word >> (8u * q)) & 0xffu;
        __m256   val = v->dtype == KERN_BITMAP_F16 ? expand8_f16(m8, &p16) : expand8_f32(m8, &p32);
        if (width - 8u * q >= 8) {
            _mm256_storeu_ps(dst + 8u * q, val);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, val);
            memcpy(dst + 8u * q, tmp, (width - 8u * q) * sizeof(float));
        }
    }
}

T256 void kern_bitmap_decode_rows_avx2(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst,
                                       size_t ld)
{
    DECODE_ROWS(decode_word_256)
}

T256 INLINE void spmv256_tilerow(const kern_bitmap_view *v, size_t ti, const float *x, size_t ldx,
                                 const size_t NB, const int F16, float *y, size_t ldy, bool accumulate)
{
    __m256 acc[TR][KERN_SALR_FUSED_MAX_BATCH];
    float  xtail[KERN_SALR_FUSED_MAX_BATCH][TC];
    for (size_t rr = 0; rr < TR; rr++)
        for (size_t b = 0; b < NB; b++)
            acc[rr][b] = _mm256_setzero_ps();
    for (size_t tj = 0; tj < v->tiles_c; tj++) {
        size_t          t = ti * v->tiles_c + tj;
        const uint64_t *bm = v->bitmap + t * TR;
        const float    *p32 = (const float *)v->values + v->offsets[t];
        const uint16_t *p16 = (const uint16_t *)v->values + v->offsets[t];
        size_t          c0 = tj * TC, width = tile_width(v, tj);
        const float    *xs[KERN_SALR_FUSED_MAX_BATCH];
        for (size_t b = 0; b < NB; b++) {
            if (width == TC) {
                xs[b] = x + b * ldx + c0;
            } else {
                memset(xtail[b], 0, sizeof xtail[b]);
                memcpy(xtail[b], x + b * ldx + c0, width * sizeof(float));
                xs[b] = xtail[b];
            }
        }
#pragma GCC unroll 8
        for (size_t rr = 0; rr < TR; rr++) {
            uint64_t word = bm[rr];
#pragma GCC unroll 8
            for (unsigned q = 0; q < 8; q++) {
                unsigned m8 = (unsigned)(word >> (8u * q)) & 0xffu;
                __m256   w = F16 ? expand8_f16(m8, &p16) : expand8_f32(m8, &p32);
#pragma GCC unroll 4
                for (size_t b = 0; b < NB; b++)
                    acc[rr][b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[b] + 8u * q), acc[rr][b]);
            }
        }
    }
    for (size_t rr = 0; rr < TR && ti * TR + rr < v->rows; rr++)
        for (size_t b = 0; b < NB; b++) {
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[rr][b]), _mm256_extractf128_ps(acc[rr][b], 1));
            s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
            float  s = _mm_cvtss_f32(s4);
            float *yp = y + b * ldy + ti * TR + rr;
            *yp = accumulate ? *yp + s : s;
        }
}

T256 void kern_salr_spmv_avx2(const kern_bitmap_view *v, size_t tr0, size_t tr1, const float *x,
                              size_t ldx, size_t n, float *y, size_t ldy, bool accumulate)
{
    SPMV_DISPATCH(spmv256_tilerow)
}
