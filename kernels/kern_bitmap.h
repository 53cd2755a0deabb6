/* kern_bitmap: a bitmap-encoded sparse matrix (SALR's storage for pruned frozen weights).
 *
 * A matrix W [rows, cols] (row-major, Hugging Face layout: rows = output features) is cut into tiles
 * of KERN_BITMAP_TILE_ROWS x KERN_BITMAP_TILE_COLS (8 x 64) elements, numbered tile-row-major
 * (t = tile_row * tiles_per_row + tile_col). Three arrays hold it:
 *
 *   bitmap  : n_tiles * 8 little-endian uint64 words; word (t, rr) bit b (LSB first) is 1 when the
 *             element (8*tile_row + rr, 64*tile_col + b) is stored. Bits outside the matrix are 0.
 *   values  : the stored elements, f32 or f16, tile by tile, inside a tile row by row, inside a row
 *             by ascending column.
 *   offsets : n_tiles + 1 int32; offsets[t] = number of values before tile t, offsets[0] = 0,
 *             offsets[n_tiles] = nnz, offsets[t+1] - offsets[t] = popcount of tile t.
 *
 * An element is stored when its bit pattern is non-zero (so -0.0f and NaN round-trip exactly).
 * docs/SALR.md documents the format and its form inside safetensors files.
 *
 * Objects are immutable after construction and may be read from any number of threads. */
#ifndef FU_KERN_BITMAP_H
#define FU_KERN_BITMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERN_BITMAP_TILE_ROWS   8                         /* rows of a tile (one uint64 word per row) */
#define KERN_BITMAP_TILE_COLS   64                        /* columns of a tile (bits per word) */
#define KERN_BITMAP_TILE_BYTES  (KERN_BITMAP_TILE_ROWS * KERN_BITMAP_TILE_COLS / 8) /* 64 */
#define KERN_BITMAP_MAX_NNZ     ((size_t)INT32_MAX)       /* offsets are int32 (safetensors I32) */
#define KERN_BITMAP_FORMAT_NAME "salr-bitmap-v1"           /* value of the <name>.format metadata */

/* Storage dtype of the packed values. */
typedef enum {
    KERN_BITMAP_F32 = 0, /* IEEE binary32 */
    KERN_BITMAP_F16 = 1, /* IEEE binary16, rounded to nearest even on encode */
} kern_bitmap_dtype;

typedef struct kern_bitmap kern_bitmap_t;

/* Encodes the dense row-major matrix w [rows, cols] (leading dimension ld >= cols) into a new
 * bitmap matrix stored as dtype. With KERN_BITMAP_F32 the round trip is bit-exact; with
 * KERN_BITMAP_F16 values are rounded to f16 (elements that round to +0 are still stored).
 * Returns FU_EINVAL for a NULL pointer, a zero dimension, ld < cols, an unknown dtype or more than
 * KERN_BITMAP_MAX_NNZ stored elements. The caller owns *out (kern_bitmap_destroy). Thread-safe. */
FU_MUST_CHECK fu_err kern_bitmap_encode(const float *w, size_t rows, size_t cols, size_t ld,
                                        kern_bitmap_dtype dtype, kern_bitmap_t **out);

/* Builds a bitmap matrix from untrusted byte buffers (for example the three safetensors tensors),
 * copying them. bitmap_len must be n_tiles * 64, offsets_len (n_tiles + 1) * 4 (little-endian
 * int32), values_len nnz * element size. Every structural property is checked: lengths, offsets[0]
 * = 0, offsets monotone, each tile's offset delta equal to its popcount, offsets[n_tiles] = nnz,
 * padding bits zero. Returns FU_EINVAL for NULL pointers, zero or overflowing dimensions or an
 * unknown dtype, FU_EPROTO for any inconsistency of the buffers; never reads outside the given
 * lengths. The caller owns *out. Thread-safe. */
FU_MUST_CHECK fu_err kern_bitmap_from_buffers(size_t rows, size_t cols, kern_bitmap_dtype dtype,
                                              const void *bitmap, size_t bitmap_len,
                                              const void *values, size_t values_len,
                                              const void *offsets, size_t offsets_len,
                                              kern_bitmap_t **out);

/* Parses the "<rows>,<cols>" shape string of the safetensors metadata entry <name>.shape (two
 * positive decimal integers, one comma, nothing else; docs/SALR.md). Returns FU_EINVAL for NULL
 * pointers, FU_EPROTO for anything else than that form, zeros, or values beyond SIZE_MAX. */
FU_MUST_CHECK fu_err kern_bitmap_parse_shape(const char *s, size_t *rows, size_t *cols);

/* Frees *self_p and sets it to NULL; NULL or *NULL is a no-op. */
void kern_bitmap_destroy(kern_bitmap_t **self_p);

/* Decodes rows [row0, row0 + nrows) into the dense row-major dst (leading dimension ld >= cols);
 * zeros are written where no value is stored. row0 need not be a multiple of the tile height.
 * Returns FU_EINVAL for NULL pointers, ld < cols or a row range outside the matrix. Thread-safe
 * (distinct dst). */
FU_MUST_CHECK fu_err kern_bitmap_decode_rows(const kern_bitmap_t *self, size_t row0, size_t nrows,
                                             float *dst, size_t ld);

/* Decodes the whole matrix into dst [rows, ld]. Same contract as kern_bitmap_decode_rows. */
FU_MUST_CHECK fu_err kern_bitmap_decode(const kern_bitmap_t *self, float *dst, size_t ld);

/* Accessors (borrowed pointers, valid until destroy). Sizes are in bytes unless named otherwise. */
size_t            kern_bitmap_rows(const kern_bitmap_t *self);
size_t            kern_bitmap_cols(const kern_bitmap_t *self);
size_t            kern_bitmap_nnz(const kern_bitmap_t *self);       /* stored values */
size_t            kern_bitmap_n_tiles(const kern_bitmap_t *self);
kern_bitmap_dtype kern_bitmap_dtype_of(const kern_bitmap_t *self);
const uint8_t    *kern_bitmap_bitmap(const kern_bitmap_t *self, size_t *len);  /* <name>.bitmap */
const void       *kern_bitmap_values(const kern_bitmap_t *self, size_t *len);  /* <name>.values */
const int32_t    *kern_bitmap_offsets(const kern_bitmap_t *self, size_t *len); /* <name>.offsets */
/* Encoded bytes (bitmap + values + offsets), the figure compared with rows*cols*4 dense bytes. */
size_t            kern_bitmap_encoded_bytes(const kern_bitmap_t *self);

/* Number of tiles of a rows x cols matrix, or 0 when a dimension is 0 or the count overflows. */
size_t kern_bitmap_tiles_for(size_t rows, size_t cols);

/* Instruction set used by the decode and multiply loops. KERN_SIMD_AUTO picks the best one the
 * running CPU supports (checked with __builtin_cpu_supports); the others force a path, for tests
 * and benchmarks (a forced path the CPU lacks falls back to scalar). */
typedef enum {
    KERN_SIMD_AUTO = 0,
    KERN_SIMD_SCALAR,
    KERN_SIMD_AVX2,   /* AVX2 + FMA + F16C */
    KERN_SIMD_AVX512, /* AVX-512 F/BW/VL + F16C: expand loads */
} kern_simd_isa;

/* Selects the instruction set for later calls (process-wide; not synchronised: call it before
 * starting work, typically once in a test or benchmark). */
void          kern_simd_set(kern_simd_isa isa);
/* The instruction set that will actually run (never KERN_SIMD_AUTO). */
kern_simd_isa kern_simd_active(void);

/* IEEE binary16 <-> binary32 conversions used by the f16 storage (round to nearest even). */
uint16_t kern_bitmap_f32_to_f16(float f);
float    kern_bitmap_f16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif
#endif
