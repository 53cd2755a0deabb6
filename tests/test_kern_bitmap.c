/* Tests of kern_bitmap: encode/decode round trips on odd shapes under every instruction set, f16
 * storage, and validation of untrusted buffers (corrupt offsets, truncated arrays, wrong popcount,
 * random mutations) which must return an error, never crash. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kern_bitmap.h"
#include "test_kern_util.h"

static const kern_simd_isa all_isas[] = {KERN_SIMD_SCALAR, KERN_SIMD_AVX2, KERN_SIMD_AVX512};

static uint64_t rng = 0x1234567ULL; /* tk_xorshift state */

/* A rows x cols matrix (leading dimension ld) where each element is non-zero with probability
 * density; row 0 is all dense and the last row all zero when there are at least 3 rows. Padding
 * between cols and ld holds garbage that must never be encoded. */
static float *make_matrix(size_t rows, size_t cols, size_t ld, double density)
{
    float *w = malloc(rows * ld * sizeof(float));
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < ld; j++) {
            float v = tk_xorshift_unit(&rng);
            if (j >= cols)
                v = 1e30f;
            else if (rows >= 3 && i == rows - 1)
                v = 0.0f;
            else if (rows >= 3 && i == 0)
                v = v == 0.0f ? 0.5f : v;
            else if ((double)(tk_xorshift(&rng) >> 11) * 0x1p-53 >= density)
                v = 0.0f;
            w[i * ld + j] = v;
        }
    if (rows * cols > 3)
        w[1] = -0.0f; /* -0.0 must round-trip bit-exactly */
    return w;
}

static void check_round_trip(size_t rows, size_t cols, size_t ld, double density)
{
    float         *w = make_matrix(rows, cols, ld, density);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, rows, cols, ld, KERN_BITMAP_F32, &bm), FU_OK);
    assert_non_null(bm);
    assert_int_equal(kern_bitmap_rows(bm), rows);
    assert_int_equal(kern_bitmap_cols(bm), cols);
    size_t nz = 0;
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < cols; j++) {
            uint32_t bits;
            memcpy(&bits, &w[i * ld + j], 4);
            nz += bits != 0;
        }
    assert_int_equal(kern_bitmap_nnz(bm), nz);
    float *d = malloc(rows * cols * sizeof(float));
    for (size_t k = 0; k < sizeof all_isas / sizeof all_isas[0]; k++) {
        kern_simd_set(all_isas[k]);
        memset(d, 0xA5, rows * cols * sizeof(float));
        assert_int_equal(kern_bitmap_decode(bm, d, cols), FU_OK);
        for (size_t i = 0; i < rows; i++)
            assert_memory_equal(d + i * cols, w + i * ld, cols * sizeof(float));
        /* partial row ranges, not aligned to the tile height */
        if (rows > 3) {
            size_t r0 = 3, nr = rows - 4;
            memset(d, 0xA5, rows * cols * sizeof(float));
            assert_int_equal(kern_bitmap_decode_rows(bm, r0, nr, d, cols), FU_OK);
            for (size_t i = 0; i < nr; i++)
                assert_memory_equal(d + i * cols, w + (r0 + i) * ld, cols * sizeof(float));
        }
    }
    kern_simd_set(KERN_SIMD_AUTO);
    free(d);
    free(w);
    kern_bitmap_destroy(&bm);
    assert_null(bm);
    kern_bitmap_destroy(&bm);
}

static void test_kern_bitmap_round_trip_odd_shapes(void **state)
{
    (void)state;
    static const size_t shapes[][3] = {{1, 1, 1},   {1, 64, 64},   {3, 5, 7},     {8, 64, 64},
                                       {9, 65, 65}, {17, 130, 131}, {16, 128, 128}, {5, 200, 201},
                                       {33, 1, 1},  {2, 63, 63},    {24, 129, 129}};
    static const double dens[] = {0.0, 0.05, 0.5, 0.95, 1.0};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t k = 0; k < sizeof dens / sizeof dens[0]; k++)
            check_round_trip(shapes[s][0], shapes[s][1], shapes[s][2], dens[k]);
}

static void test_kern_bitmap_all_zero_and_all_dense(void **state)
{
    (void)state;
    size_t rows = 13, cols = 100;
    float *z = calloc(rows * cols, sizeof(float));
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(z, rows, cols, cols, KERN_BITMAP_F32, &bm), FU_OK);
    assert_int_equal(kern_bitmap_nnz(bm), 0);
    float *d = malloc(rows * cols * sizeof(float));
    memset(d, 0xFF, rows * cols * sizeof(float));
    assert_int_equal(kern_bitmap_decode(bm, d, cols), FU_OK);
    assert_memory_equal(d, z, rows * cols * sizeof(float));
    kern_bitmap_destroy(&bm);

    for (size_t i = 0; i < rows * cols; i++)
        z[i] = (float)i + 1.0f;
    assert_int_equal(kern_bitmap_encode(z, rows, cols, cols, KERN_BITMAP_F32, &bm), FU_OK);
    assert_int_equal(kern_bitmap_nnz(bm), rows * cols);
    assert_int_equal(kern_bitmap_decode(bm, d, cols), FU_OK);
    assert_memory_equal(d, z, rows * cols * sizeof(float));
    kern_bitmap_destroy(&bm);
    free(z);
    free(d);
}

static void test_kern_bitmap_f16_storage(void **state)
{
    (void)state;
    /* conversions: exact values, rounding to nearest even, limits */
    assert_int_equal(kern_bitmap_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(kern_bitmap_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(kern_bitmap_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(kern_bitmap_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(kern_bitmap_f32_to_f16(0x1p-24f), 0x0001);
    assert_int_equal(kern_bitmap_f32_to_f16(0x1p-25f), 0x0000);
    assert_int_equal(kern_bitmap_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie to even */
    assert_int_equal(kern_bitmap_f32_to_f16(1.0f + 0x1p-10f + 0x1p-11f), 0x3c02);
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) /* NaN payloads: only NaN-ness survives */
            continue;
        assert_int_equal(kern_bitmap_f32_to_f16(kern_bitmap_f16_to_f32((uint16_t)h)), h);
    }
    /* f16 matrices decode to the f16-rounded values under every ISA */
    size_t rows = 19, cols = 150;
    float *w = make_matrix(rows, cols, cols, 0.5);
    float *want = malloc(rows * cols * sizeof(float));
    for (size_t i = 0; i < rows * cols; i++)
        want[i] = kern_bitmap_f16_to_f32(kern_bitmap_f32_to_f16(w[i]));
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, rows, cols, cols, KERN_BITMAP_F16, &bm), FU_OK);
    assert_int_equal(kern_bitmap_dtype_of(bm), KERN_BITMAP_F16);
    size_t vlen;
    kern_bitmap_values(bm, &vlen);
    assert_int_equal(vlen, kern_bitmap_nnz(bm) * 2);
    float *d = malloc(rows * cols * sizeof(float));
    for (size_t k = 0; k < sizeof all_isas / sizeof all_isas[0]; k++) {
        kern_simd_set(all_isas[k]);
        assert_int_equal(kern_bitmap_decode(bm, d, cols), FU_OK);
        assert_memory_equal(d, want, rows * cols * sizeof(float));
    }
    kern_simd_set(KERN_SIMD_AUTO);
    kern_bitmap_destroy(&bm);
    TK_FREE_ALL(w, want, d);
}

static void test_kern_bitmap_sizes(void **state)
{
    (void)state;
    size_t rows = 256, cols = 512;
    float *w = make_matrix(rows, cols, cols, 0.5);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, rows, cols, cols, KERN_BITMAP_F32, &bm), FU_OK);
    size_t nt = kern_bitmap_n_tiles(bm), bl, vl, ol;
    assert_int_equal(nt, (256 / 8) * (512 / 64));
    kern_bitmap_bitmap(bm, &bl);
    kern_bitmap_values(bm, &vl);
    kern_bitmap_offsets(bm, &ol);
    assert_int_equal(bl, nt * 64);
    assert_int_equal(ol, (nt + 1) * 4);
    assert_int_equal(vl, kern_bitmap_nnz(bm) * 4);
    assert_int_equal(kern_bitmap_encoded_bytes(bm), bl + vl + ol);
    double ratio = (double)kern_bitmap_encoded_bytes(bm) / (double)(rows * cols * 4);
    assert_true(ratio < 0.56 && ratio > 0.5);
    assert_int_equal(kern_bitmap_tiles_for(0, 5), 0);
    assert_int_equal(kern_bitmap_tiles_for(9, 65), 4);
    assert_int_equal(kern_bitmap_tiles_for(SIZE_MAX, SIZE_MAX), 0);
    kern_bitmap_destroy(&bm);
    free(w);
}

static void test_kern_bitmap_bad_args(void **state)
{
    (void)state;
    float          w[16] = {1};
    kern_bitmap_t *bm = (kern_bitmap_t *)1;
    assert_int_equal(kern_bitmap_encode(NULL, 2, 2, 2, KERN_BITMAP_F32, &bm), FU_EINVAL);
    assert_null(bm);
    assert_int_equal(kern_bitmap_encode(w, 0, 2, 2, KERN_BITMAP_F32, &bm), FU_EINVAL);
    assert_int_equal(kern_bitmap_encode(w, 2, 0, 2, KERN_BITMAP_F32, &bm), FU_EINVAL);
    assert_int_equal(kern_bitmap_encode(w, 2, 4, 3, KERN_BITMAP_F32, &bm), FU_EINVAL);
    assert_int_equal(kern_bitmap_encode(w, 2, 2, 2, (kern_bitmap_dtype)7, &bm), FU_EINVAL);
    assert_int_equal(kern_bitmap_encode(w, 2, 2, 2, KERN_BITMAP_F32, NULL), FU_EINVAL);
    assert_int_equal(kern_bitmap_encode(w, 4, 4, 4, KERN_BITMAP_F32, &bm), FU_OK);
    float d[16];
    assert_int_equal(kern_bitmap_decode(bm, NULL, 4), FU_EINVAL);
    assert_int_equal(kern_bitmap_decode(bm, d, 3), FU_EINVAL);
    assert_int_equal(kern_bitmap_decode(NULL, d, 4), FU_EINVAL);
    assert_int_equal(kern_bitmap_decode_rows(bm, 3, 2, d, 4), FU_EINVAL);
    assert_int_equal(kern_bitmap_decode_rows(bm, 5, 0, d, 4), FU_EINVAL);
    assert_int_equal(kern_bitmap_decode_rows(bm, 4, 0, d, 4), FU_OK);
    assert_int_equal(kern_bitmap_decode_rows(bm, 1, SIZE_MAX, d, 4), FU_EINVAL);
    kern_bitmap_destroy(&bm);
    kern_bitmap_destroy(NULL);
}

/* Copies of the three arrays of an encoded matrix, to corrupt. */
typedef struct {
    size_t   rows, cols;
    uint8_t *bitmap;
    size_t   bl;
    uint8_t *values;
    size_t   vl;
    int32_t *offsets;
    size_t   ol;
} bufs;

static void bufs_make(bufs *b, size_t rows, size_t cols, double density)
{
    float         *w = make_matrix(rows, cols, cols, density);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, rows, cols, cols, KERN_BITMAP_F32, &bm), FU_OK);
    b->rows = rows;
    b->cols = cols;
    const void *p = kern_bitmap_bitmap(bm, &b->bl);
    b->bitmap = malloc(b->bl);
    memcpy(b->bitmap, p, b->bl);
    p = kern_bitmap_values(bm, &b->vl);
    b->values = malloc(b->vl ? b->vl : 1);
    memcpy(b->values, p, b->vl);
    p = kern_bitmap_offsets(bm, &b->ol);
    b->offsets = malloc(b->ol);
    memcpy(b->offsets, p, b->ol);
    kern_bitmap_destroy(&bm);
    free(w);
}

static void bufs_free(bufs *b)
{
    TK_FREE_ALL(b->bitmap, b->values, b->offsets);
}

static fu_err bufs_load(const bufs *b, kern_bitmap_t **out)
{
    return kern_bitmap_from_buffers(b->rows, b->cols, KERN_BITMAP_F32, b->bitmap, b->bl, b->values, b->vl,
                                    b->offsets, b->ol, out);
}

static void test_kern_bitmap_from_buffers_round_trip(void **state)
{
    (void)state;
    bufs b;
    bufs_make(&b, 21, 77, 0.5);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(bufs_load(&b, &bm), FU_OK);
    assert_int_equal(kern_bitmap_rows(bm), 21);
    assert_int_equal(kern_bitmap_cols(bm), 77);
    /* decode, re-encode: the arrays come back byte for byte */
    float *d1 = malloc(21 * 77 * sizeof(float));
    assert_int_equal(kern_bitmap_decode(bm, d1, 77), FU_OK);
    kern_bitmap_t *again = NULL;
    assert_int_equal(kern_bitmap_encode(d1, 21, 77, 77, KERN_BITMAP_F32, &again), FU_OK);
    size_t l1, l2;
    assert_memory_equal(kern_bitmap_bitmap(again, &l1), b.bitmap, b.bl);
    assert_memory_equal(kern_bitmap_values(again, &l2), b.values, b.vl);
    assert_memory_equal(kern_bitmap_offsets(again, &l1), b.offsets, b.ol);
    kern_bitmap_destroy(&again);
    kern_bitmap_destroy(&bm);
    free(d1);
    bufs_free(&b);
}

static void test_kern_bitmap_corrupt_buffers(void **state)
{
    (void)state;
    bufs b;
    bufs_make(&b, 21, 77, 0.5);
    kern_bitmap_t *bm = NULL;
    size_t nt = b.ol / 4 - 1;

    /* truncated or oversized arrays */
    assert_int_equal(kern_bitmap_from_buffers(21, 77, KERN_BITMAP_F32, b.bitmap, b.bl - 1, b.values, b.vl,
                                              b.offsets, b.ol, &bm),
                     FU_EPROTO);
    assert_int_equal(kern_bitmap_from_buffers(21, 77, KERN_BITMAP_F32, b.bitmap, b.bl, b.values, b.vl - 4,
                                              b.offsets, b.ol, &bm),
                     FU_EPROTO);
    assert_int_equal(kern_bitmap_from_buffers(21, 77, KERN_BITMAP_F32, b.bitmap, b.bl, b.values, b.vl - 1,
                                              b.offsets, b.ol, &bm),
                     FU_EPROTO);
    assert_int_equal(kern_bitmap_from_buffers(21, 77, KERN_BITMAP_F32, b.bitmap, b.bl, b.values, b.vl,
                                              b.offsets, b.ol - 4, &bm),
                     FU_EPROTO);
    /* the same buffers read as f16 have twice too many value bytes */
    assert_int_equal(kern_bitmap_from_buffers(21, 77, KERN_BITMAP_F16, b.bitmap, b.bl, b.values, b.vl,
                                              b.offsets, b.ol, &bm),
                     FU_EPROTO);
    /* shape that does not match the arrays */
    assert_int_equal(kern_bitmap_from_buffers(22 + 8, 77, KERN_BITMAP_F32, b.bitmap, b.bl, b.values, b.vl,
                                              b.offsets, b.ol, &bm),
                     FU_EPROTO);
    assert_null(bm);

    /* bad offsets: first not 0, decreasing, off by one, last beyond values, negative */
    int32_t saved;
    saved = b.offsets[0];
    b.offsets[0] = 1;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.offsets[0] = saved;
    saved = b.offsets[2];
    b.offsets[2] = b.offsets[1] - 1;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.offsets[2] = saved + 1;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.offsets[2] = saved;
    saved = b.offsets[nt];
    b.offsets[nt] = INT32_MAX;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.offsets[nt] = -5;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.offsets[nt] = saved;

    /* wrong popcount: one bit flipped inside the matrix */
    b.bitmap[3] ^= 0x10;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.bitmap[3] ^= 0x10;
    /* a padding bit set (column 77 of the second tile column is beyond the matrix) */
    b.bitmap[64 + 7] ^= 0x80;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.bitmap[64 + 7] ^= 0x80;
    /* a bit in a padding row (rows 21..23 of the last tile row) */
    b.bitmap[b.bl - 8] ^= 0x01;
    assert_int_equal(bufs_load(&b, &bm), FU_EPROTO);
    b.bitmap[b.bl - 8] ^= 0x01;

    /* NULL pointers, zero or absurd dimensions, unknown dtype */
    assert_int_equal(kern_bitmap_from_buffers(21, 77, KERN_BITMAP_F32, NULL, b.bl, b.values, b.vl, b.offsets,
                                              b.ol, &bm),
                     FU_EINVAL);
    assert_int_equal(kern_bitmap_from_buffers(0, 77, KERN_BITMAP_F32, b.bitmap, b.bl, b.values, b.vl,
                                              b.offsets, b.ol, &bm),
                     FU_EINVAL);
    assert_int_equal(kern_bitmap_from_buffers(SIZE_MAX, SIZE_MAX, KERN_BITMAP_F32, b.bitmap, b.bl, b.values,
                                              b.vl, b.offsets, b.ol, &bm),
                     FU_EINVAL);
    assert_int_equal(kern_bitmap_from_buffers(21, 77, (kern_bitmap_dtype)3, b.bitmap, b.bl, b.values, b.vl,
                                              b.offsets, b.ol, &bm),
                     FU_EINVAL);
    assert_int_equal(kern_bitmap_from_buffers(21, 77, KERN_BITMAP_F32, b.bitmap, b.bl, b.values, b.vl,
                                              b.offsets, b.ol, NULL),
                     FU_EINVAL);

    /* still intact after all that */
    assert_int_equal(bufs_load(&b, &bm), FU_OK);
    kern_bitmap_destroy(&bm);
    bufs_free(&b);
}

/* Random mutations of valid buffers: every call either succeeds (and then decodes) or reports
 * FU_EPROTO; none may crash or read outside the buffers (checked under ASan). */
static void test_kern_bitmap_mutations_never_crash(void **state)
{
    (void)state;
    bufs b;
    bufs_make(&b, 11, 70, 0.4);
    float *d = malloc(11 * 70 * sizeof(float));
    int    ok = 0, bad = 0;
    for (int it = 0; it < 3000; it++) {
        uint8_t *bm_copy = malloc(b.bl);
        int32_t *of_copy = malloc(b.ol);
        memcpy(bm_copy, b.bitmap, b.bl);
        memcpy(of_copy, b.offsets, b.ol);
        size_t vl = b.vl;
        switch (tk_xorshift(&rng) % 4) {
        case 0:
            bm_copy[tk_xorshift(&rng) % b.bl] ^= (uint8_t)(1u << (tk_xorshift(&rng) % 8));
            break;
        case 1:
            of_copy[tk_xorshift(&rng) % (b.ol / 4)] += (int32_t)(tk_xorshift(&rng) % 5) - 2;
            break;
        case 2:
            of_copy[tk_xorshift(&rng) % (b.ol / 4)] = (int32_t)tk_xorshift(&rng);
            break;
        default:
            vl = tk_xorshift(&rng) % (b.vl + 8);
            if (vl > b.vl)
                vl = b.vl; /* never claim more bytes than exist */
            break;
        }
        kern_bitmap_t *bm = NULL;
        fu_err rc = kern_bitmap_from_buffers(11, 70, KERN_BITMAP_F32, bm_copy, b.bl, b.values, vl, of_copy,
                                             b.ol, &bm);
        if (rc == FU_OK) {
            ok++;
            assert_int_equal(kern_bitmap_decode(bm, d, 70), FU_OK);
        } else {
            bad++;
            assert_int_equal(rc, FU_EPROTO);
            assert_null(bm);
        }
        kern_bitmap_destroy(&bm);
        free(bm_copy);
        free(of_copy);
    }
    assert_true(bad > 2000); /* almost every mutation breaks an invariant */
    (void)ok;
    free(d);
    bufs_free(&b);
}

static void test_kern_bitmap_parse_shape(void **state)
{
    (void)state;
    size_t r = 0, c = 0;
    assert_int_equal(kern_bitmap_parse_shape("11008,4096", &r, &c), FU_OK);
    assert_int_equal(r, 11008);
    assert_int_equal(c, 4096);
    assert_int_equal(kern_bitmap_parse_shape("1,1", &r, &c), FU_OK);
    static const char *bad[] = {"", ",", "1,", ",1", "1,2,3", "0,5", "5,0", " 1,2", "1 ,2", "1,2 ", "-1,2",
                                "1;2", "a,b", "99999999999999999999999,1", "1,2x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(kern_bitmap_parse_shape(bad[i], &r, &c), FU_EPROTO);
    assert_int_equal(kern_bitmap_parse_shape(NULL, &r, &c), FU_EINVAL);
    assert_int_equal(kern_bitmap_parse_shape("1,2", NULL, &c), FU_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_bitmap_round_trip_odd_shapes),
        cmocka_unit_test(test_kern_bitmap_all_zero_and_all_dense),
        cmocka_unit_test(test_kern_bitmap_f16_storage),
        cmocka_unit_test(test_kern_bitmap_sizes),
        cmocka_unit_test(test_kern_bitmap_bad_args),
        cmocka_unit_test(test_kern_bitmap_from_buffers_round_trip),
        cmocka_unit_test(test_kern_bitmap_corrupt_buffers),
        cmocka_unit_test(test_kern_bitmap_mutations_never_crash),
        cmocka_unit_test(test_kern_bitmap_parse_shape),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
