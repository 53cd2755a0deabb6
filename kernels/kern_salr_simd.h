/* Internal to kernels/: the raw view of a bitmap matrix and the SIMD decode / fused multiply loops
 * shared by kern_bitmap.c and kern_salr.c. Not a public header. */
#ifndef FU_KERN_SALR_SIMD_H
#define FU_KERN_SALR_SIMD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kern_bitmap.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Zero bytes after the packed values, so SIMD loops may load a full vector at any value position. */
#define KERN_BITMAP_VALUES_PAD 64

/* Borrowed, read-only view of a kern_bitmap_t's arrays (validated at construction). */
typedef struct {
    size_t            rows, cols;       /* matrix shape */
    size_t            tiles_r, tiles_c; /* tile grid */
    kern_bitmap_dtype dtype;            /* value storage */
    const uint64_t   *bitmap;           /* n_tiles * 8 words */
    const int32_t    *offsets;          /* n_tiles + 1 */
    const void       *values;           /* nnz values + KERN_BITMAP_VALUES_PAD zero bytes */
} kern_bitmap_view;

void kern_bitmap_view_of(const kern_bitmap_t *self, kern_bitmap_view *v);

/* Decodes rows [row0, row0+nrows) into dst (leading dimension ld) with the given ISA (already
 * checked against the CPU). Arguments are trusted (checked by the caller). */
void kern_bitmap_decode_view(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst, size_t ld,
                             kern_simd_isa isa);
void kern_bitmap_decode_rows_scalar(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst,
                                    size_t ld);
void kern_bitmap_decode_rows_avx512(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst,
                                    size_t ld);
void kern_bitmap_decode_rows_avx2(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst,
                                  size_t ld);

/* Fused decode-and-multiply for a small batch: for tile rows [tr0, tr1) and every batch row
 * b < n (n <= KERN_SALR_FUSED_MAX_BATCH), y[b*ldy + r] = (accumulate ? y[b*ldy + r] : 0) +
 * sum_c W[r, c] * x[b*ldx + c]. */
void kern_salr_spmv_scalar(const kern_bitmap_view *v, size_t tr0, size_t tr1, const float *x, size_t ldx,
                           size_t n, float *y, size_t ldy, bool accumulate);
void kern_salr_spmv_avx2(const kern_bitmap_view *v, size_t tr0, size_t tr1, const float *x, size_t ldx,
                         size_t n, float *y, size_t ldy, bool accumulate);
void kern_salr_spmv_avx512(const kern_bitmap_view *v, size_t tr0, size_t tr1, const float *x, size_t ldx,
                           size_t n, float *y, size_t ldy, bool accumulate);

#ifdef __cplusplus
}
#endif
#endif
