/* kern_bitmap: encode, validate and decode the SALR bitmap sparse format (see kern_bitmap.h and
 * docs/SALR.md). Decode has a scalar path and AVX2 / AVX-512 paths compiled with function-level
 * target attributes and chosen at run time, so the library runs on any x86-64. */
#include "kern_bitmap.h"
#include "kern_salr_simd.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"

struct kern_bitmap {
    size_t            rows;    /* matrix rows (output features) */
    size_t            cols;    /* matrix columns (input features) */
    size_t            tiles_r; /* tile rows: ceil(rows / 8) */
    size_t            tiles_c; /* tiles per tile row: ceil(cols / 64) */
    size_t            n_tiles; /* tiles_r * tiles_c */
    size_t            nnz;     /* stored values */
    kern_bitmap_dtype dtype;   /* storage dtype of values */
    uint64_t         *bitmap;  /* n_tiles * 8 words */
    int32_t          *offsets; /* n_tiles + 1 */
    void             *values;  /* nnz elements + KERN_BITMAP_VALUES_PAD zero bytes */
};

/* ---- instruction-set selection ---------------------------------------------------------------- */

static kern_simd_isa g_isa_request = KERN_SIMD_AUTO;

static bool cpu_avx512(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("popcnt");
}

static bool cpu_avx2(void)
{
    __builtin_cpu_init();
    /* No F16C check: every x86 CPU with AVX2 has it (Intel since Ivy Bridge, AMD since
     * Piledriver), and clang's __builtin_cpu_supports does not know the name. */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("popcnt");
}

void kern_simd_set(kern_simd_isa isa)
{
    g_isa_request = isa;
}

kern_simd_isa kern_simd_active(void)
{
    switch (g_isa_request) {
    case KERN_SIMD_SCALAR:
        return KERN_SIMD_SCALAR;
    case KERN_SIMD_AVX2:
        return cpu_avx2() ? KERN_SIMD_AVX2 : KERN_SIMD_SCALAR;
    case KERN_SIMD_AVX512:
        return cpu_avx512() ? KERN_SIMD_AVX512 : KERN_SIMD_SCALAR;
    case KERN_SIMD_AUTO:
    default:
        if (cpu_avx512())
            return KERN_SIMD_AVX512;
        if (cpu_avx2())
            return KERN_SIMD_AVX2;
        return KERN_SIMD_SCALAR;
    }
}

/* ---- f16 ---------------------------------------------------------------------------------------- */

uint16_t kern_bitmap_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) { /* inf or NaN (NaN stays a quiet NaN) */
        if (a > 0x7f800000u)
            return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
        return (uint16_t)(sign | 0x7c00u);
    }
    if (a >= 0x477ff000u) /* rounds to beyond 65504 */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* half subnormal or zero */
        if (a < 0x33000000u)
            return sign;
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u)))
            h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = (a >> 13) - (112u << 10), rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

float kern_bitmap_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) {
        float v = (float)m * 0x1p-24f;
        memcpy(&x, &v, sizeof x);
        x |= sign;
    } else if (e == 31) {
        x = sign | 0x7f800000u | (m << 13);
    } else {
        x = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* ---- sizes and accessors ------------------------------------------------------------------------ */

size_t kern_bitmap_tiles_for(size_t rows, size_t cols)
{
    if (rows == 0 || cols == 0)
        return 0;
    size_t tr = rows / KERN_BITMAP_TILE_ROWS + (rows % KERN_BITMAP_TILE_ROWS != 0);
    size_t tc = cols / KERN_BITMAP_TILE_COLS + (cols % KERN_BITMAP_TILE_COLS != 0);
    size_t n, bytes;
    if (!fu_size_mul(tr, tc, &n) || !fu_size_mul(n, KERN_BITMAP_TILE_BYTES, &bytes) ||
        n >= SIZE_MAX / 8)
        return 0;
    return n;
}

static size_t dtype_size(kern_bitmap_dtype d)
{
    return d == KERN_BITMAP_F16 ? 2 : 4;
}

size_t kern_bitmap_rows(const kern_bitmap_t *self)
{
    return self ? self->rows : 0;
}
size_t kern_bitmap_cols(const kern_bitmap_t *self)
{
    return self ? self->cols : 0;
}
size_t kern_bitmap_nnz(const kern_bitmap_t *self)
{
    return self ? self->nnz : 0;
}
size_t kern_bitmap_n_tiles(const kern_bitmap_t *self)
{
    return self ? self->n_tiles : 0;
}
kern_bitmap_dtype kern_bitmap_dtype_of(const kern_bitmap_t *self)
{
    return self ? self->dtype : KERN_BITMAP_F32;
}

const uint8_t *kern_bitmap_bitmap(const kern_bitmap_t *self, size_t *len)
{
    if (len)
        *len = self ? self->n_tiles * KERN_BITMAP_TILE_BYTES : 0;
    return self ? (const uint8_t *)self->bitmap : NULL;
}

const void *kern_bitmap_values(const kern_bitmap_t *self, size_t *len)
{
    if (len)
        *len = self ? self->nnz * dtype_size(self->dtype) : 0;
    return self ? self->values : NULL;
}

const int32_t *kern_bitmap_offsets(const kern_bitmap_t *self, size_t *len)
{
    if (len)
        *len = self ? (self->n_tiles + 1) * sizeof(int32_t) : 0;
    return self ? self->offsets : NULL;
}

size_t kern_bitmap_encoded_bytes(const kern_bitmap_t *self)
{
    if (!self)
        return 0;
    return self->n_tiles * KERN_BITMAP_TILE_BYTES + self->nnz * dtype_size(self->dtype) +
           (self->n_tiles + 1) * sizeof(int32_t);
}

void kern_bitmap_view_of(const kern_bitmap_t *self, kern_bitmap_view *v)
{
    v->rows = self->rows;
    v->cols = self->cols;
    v->tiles_r = self->tiles_r;
    v->tiles_c = self->tiles_c;
    v->dtype = self->dtype;
    v->bitmap = self->bitmap;
    v->offsets = self->offsets;
    v->values = self->values;
}

/* ---- construction ------------------------------------------------------------------------------- */

static void *try_alloc_aligned(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 1) != 0)
        return NULL;
    return p;
}

void kern_bitmap_destroy(kern_bitmap_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kern_bitmap_t *self = *self_p;
    fu_free_aligned(self->bitmap);
    fu_free_aligned(self->offsets);
    fu_free_aligned(self->values);
    free(self);
    *self_p = NULL;
}

/* A new object with bitmap and offsets allocated (uninitialised) and no values; NULL on failure. */
static kern_bitmap_t *bitmap_alloc(size_t rows, size_t cols, kern_bitmap_dtype dtype)
{
    size_t n_tiles = kern_bitmap_tiles_for(rows, cols);
    if (n_tiles == 0)
        return NULL;
    kern_bitmap_t *self = calloc(1, sizeof *self);
    if (!self)
        return NULL;
    self->rows = rows;
    self->cols = cols;
    self->tiles_r = (rows + KERN_BITMAP_TILE_ROWS - 1) / KERN_BITMAP_TILE_ROWS;
    self->tiles_c = (cols + KERN_BITMAP_TILE_COLS - 1) / KERN_BITMAP_TILE_COLS;
    self->n_tiles = n_tiles;
    self->dtype = dtype;
    self->bitmap = try_alloc_aligned(n_tiles * KERN_BITMAP_TILE_BYTES);
    self->offsets = try_alloc_aligned((n_tiles + 1) * sizeof(int32_t));
    if (!self->bitmap || !self->offsets)
        kern_bitmap_destroy(&self);
    return self;
}

static fu_err alloc_values(kern_bitmap_t *self)
{
    size_t bytes = self->nnz * dtype_size(self->dtype) + KERN_BITMAP_VALUES_PAD;
    self->values = try_alloc_aligned(bytes);
    if (!self->values)
        return FU_ENOMEM;
    memset((char *)self->values + bytes - KERN_BITMAP_VALUES_PAD, 0, KERN_BITMAP_VALUES_PAD);
    return FU_OK;
}

static inline uint32_t f32_bits(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

fu_err kern_bitmap_encode(const float *w, size_t rows, size_t cols, size_t ld, kern_bitmap_dtype dtype,
                          kern_bitmap_t **out)
{
    if (!out)
        return FU_EINVAL;
    *out = NULL;
    if (!w || rows == 0 || cols == 0 || ld < cols ||
        (dtype != KERN_BITMAP_F32 && dtype != KERN_BITMAP_F16))
        return FU_EINVAL;
    size_t span;
    if (!fu_size_mul(rows - 1, ld, &span) || !fu_size_add(span, cols, &span))
        return FU_EINVAL;
    kern_bitmap_t *self = bitmap_alloc(rows, cols, dtype);
    if (!self)
        return kern_bitmap_tiles_for(rows, cols) ? FU_ENOMEM : FU_EINVAL;

    /* Pass 1: bitmap words and per-tile counts. */
    size_t nnz = 0;
    for (size_t ti = 0; ti < self->tiles_r; ti++) {
        for (size_t tj = 0; tj < self->tiles_c; tj++) {
            size_t t = ti * self->tiles_c + tj;
            if (nnz > KERN_BITMAP_MAX_NNZ) {
                kern_bitmap_destroy(&self);
                return FU_EINVAL;
            }
            self->offsets[t] = (int32_t)nnz;
            size_t c0 = tj * KERN_BITMAP_TILE_COLS;
            size_t width = cols - c0 < KERN_BITMAP_TILE_COLS ? cols - c0 : KERN_BITMAP_TILE_COLS;
            for (size_t rr = 0; rr < KERN_BITMAP_TILE_ROWS; rr++) {
                size_t r = ti * KERN_BITMAP_TILE_ROWS + rr;
                uint64_t word = 0;
                if (r < rows) {
                    const float *src = w + r * ld + c0;
                    for (size_t b = 0; b < width; b++)
                        word |= (uint64_t)(f32_bits(src[b]) != 0) << b;
                }
                self->bitmap[t * KERN_BITMAP_TILE_ROWS + rr] = word;
                nnz += (size_t)__builtin_popcountll(word);
            }
        }
    }
    if (nnz > KERN_BITMAP_MAX_NNZ) {
        kern_bitmap_destroy(&self);
        return FU_EINVAL;
    }
    self->offsets[self->n_tiles] = (int32_t)nnz;
    self->nnz = nnz;
    if (alloc_values(self) != FU_OK) {
        kern_bitmap_destroy(&self);
        return FU_ENOMEM;
    }

    /* Pass 2: pack the values. */
    float    *v32 = self->values;
    uint16_t *v16 = self->values;
    size_t    k = 0;
    for (size_t ti = 0; ti < self->tiles_r; ti++) {
        for (size_t tj = 0; tj < self->tiles_c; tj++) {
            size_t t = ti * self->tiles_c + tj;
            size_t c0 = tj * KERN_BITMAP_TILE_COLS;
            for (size_t rr = 0; rr < KERN_BITMAP_TILE_ROWS; rr++) {
                uint64_t word = self->bitmap[t * KERN_BITMAP_TILE_ROWS + rr];
                if (!word)
                    continue;
                const float *src = w + (ti * KERN_BITMAP_TILE_ROWS + rr) * ld + c0;
                while (word) {
                    unsigned b = (unsigned)__builtin_ctzll(word);
                    word &= word - 1;
                    if (dtype == KERN_BITMAP_F32)
                        v32[k++] = src[b];
                    else
                        v16[k++] = kern_bitmap_f32_to_f16(src[b]);
                }
            }
        }
    }
    *out = self;
    return FU_OK;
}

fu_err kern_bitmap_from_buffers(size_t rows, size_t cols, kern_bitmap_dtype dtype, const void *bitmap,
                                size_t bitmap_len, const void *values, size_t values_len,
                                const void *offsets, size_t offsets_len, kern_bitmap_t **out)
{
    if (!out)
        return FU_EINVAL;
    *out = NULL;
    if (!bitmap || !offsets || (!values && values_len) || rows == 0 || cols == 0 ||
        (dtype != KERN_BITMAP_F32 && dtype != KERN_BITMAP_F16))
        return FU_EINVAL;
    size_t n_tiles = kern_bitmap_tiles_for(rows, cols);
    if (n_tiles == 0 || n_tiles > (size_t)INT32_MAX)
        return FU_EINVAL;
    if (bitmap_len != n_tiles * KERN_BITMAP_TILE_BYTES ||
        offsets_len != (n_tiles + 1) * sizeof(int32_t))
        return FU_EPROTO;
    kern_bitmap_t *self = bitmap_alloc(rows, cols, dtype);
    if (!self)
        return FU_ENOMEM;
    memcpy(self->bitmap, bitmap, bitmap_len); /* little-endian host assumed (x86-64, aarch64) */
    memcpy(self->offsets, offsets, offsets_len);

    fu_err rc = FU_EPROTO;
    if (self->offsets[0] != 0)
        goto fail;
    for (size_t ti = 0; ti < self->tiles_r; ti++) {
        for (size_t tj = 0; tj < self->tiles_c; tj++) {
            size_t   t = ti * self->tiles_c + tj;
            size_t   c0 = tj * KERN_BITMAP_TILE_COLS;
            size_t   width = cols - c0 < KERN_BITMAP_TILE_COLS ? cols - c0 : KERN_BITMAP_TILE_COLS;
            uint64_t colmask = width == 64 ? ~(uint64_t)0 : (((uint64_t)1 << width) - 1);
            int64_t  count = 0;
            for (size_t rr = 0; rr < KERN_BITMAP_TILE_ROWS; rr++) {
                uint64_t word = self->bitmap[t * KERN_BITMAP_TILE_ROWS + rr];
                bool     row_in = ti * KERN_BITMAP_TILE_ROWS + rr < rows;
                if ((word & ~(row_in ? colmask : 0)) != 0)
                    goto fail; /* a bit outside the matrix */
                count += __builtin_popcountll(word);
            }
            int64_t lo = self->offsets[t], hi = self->offsets[t + 1];
            if (hi < lo || hi - lo != count)
                goto fail;
        }
    }
    int64_t total = self->offsets[n_tiles];
    self->nnz = (size_t)total;
    size_t want;
    if (!fu_size_mul(self->nnz, dtype_size(dtype), &want) || want != values_len)
        goto fail;
    if (alloc_values(self) != FU_OK) {
        rc = FU_ENOMEM;
        goto fail;
    }
    if (values_len)
        memcpy(self->values, values, values_len);
    *out = self;
    return FU_OK;
fail:
    kern_bitmap_destroy(&self);
    return rc;
}

static const char *parse_dim(const char *s, size_t *out)
{
    size_t v = 0;
    if (*s < '0' || *s > '9')
        return NULL;
    while (*s >= '0' && *s <= '9') {
        if (!fu_size_mul(v, 10, &v) || !fu_size_add(v, (size_t)(*s - '0'), &v))
            return NULL;
        s++;
    }
    *out = v;
    return v ? s : NULL;
}

fu_err kern_bitmap_parse_shape(const char *s, size_t *rows, size_t *cols)
{
    if (!s || !rows || !cols)
        return FU_EINVAL;
    size_t r, c;
    const char *p = parse_dim(s, &r);
    if (!p || *p != ',')
        return FU_EPROTO;
    p = parse_dim(p + 1, &c);
    if (!p || *p != '\0')
        return FU_EPROTO;
    *rows = r;
    *cols = c;
    return FU_OK;
}

/* ---- decode ------------------------------------------------------------------------------------- */

void kern_bitmap_decode_view(const kern_bitmap_view *v, size_t row0, size_t nrows, float *dst, size_t ld,
                             kern_simd_isa isa)
{
    if (isa == KERN_SIMD_AVX512)
        kern_bitmap_decode_rows_avx512(v, row0, nrows, dst, ld);
    else if (isa == KERN_SIMD_AVX2)
        kern_bitmap_decode_rows_avx2(v, row0, nrows, dst, ld);
    else
        kern_bitmap_decode_rows_scalar(v, row0, nrows, dst, ld);
}

fu_err kern_bitmap_decode_rows(const kern_bitmap_t *self, size_t row0, size_t nrows, float *dst, size_t ld)
{
    if (!self || !dst || ld < self->cols || row0 > self->rows || nrows > self->rows - row0)
        return FU_EINVAL;
    if (nrows == 0)
        return FU_OK;
    kern_bitmap_view v;
    kern_bitmap_view_of(self, &v);
    kern_bitmap_decode_view(&v, row0, nrows, dst, ld, kern_simd_active());
    return FU_OK;
}

fu_err kern_bitmap_decode(const kern_bitmap_t *self, float *dst, size_t ld)
{
    if (!self)
        return FU_EINVAL;
    return kern_bitmap_decode_rows(self, 0, self->rows, dst, ld);
}
