/* kern_codec: the wire codecs of cut tensors. Sizes; f16/bf16 equal the tensor converters; int8 keeps
 * each value within half a step of its row's scale, keeps zeros, signs and the row's extreme exactly;
 * encoding is a pure function (same bytes twice, a row's bytes independent of the other rows);
 * decoding refuses a wrong length and a negative, NaN or infinite scale. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kern_codec.h"
#include "kern_tensor.h"
#include "testutil.h"

#define ROWS  7
#define WIDTH 33

static void fill(float *x, size_t n, unsigned seed)
{
    srand(seed);
    for (size_t i = 0; i < n; i++)
        x[i] = ((float)rand() / (float)RAND_MAX - 0.5f) * (float)(1 + i % 5) * 3.0f;
}

static void test_kern_codec_names_and_sizes(void **state)
{
    (void)state;
    for (int c = 0; c < KERN_CODEC_COUNT_; c++) {
        kern_codec back;
        assert_int_equal(kern_codec_parse(kern_codec_name((kern_codec)c), &back), FU_OK);
        assert_int_equal(back, c);
    }
    kern_codec c;
    assert_int_equal(kern_codec_parse("int4", &c), FU_EINVAL);
    assert_int_equal(kern_codec_parse(NULL, &c), FU_EINVAL);
    assert_int_equal(kern_codec_bytes(KERN_CODEC_F32, ROWS, WIDTH), ROWS * WIDTH * 4);
    assert_int_equal(kern_codec_bytes(KERN_CODEC_F16, ROWS, WIDTH), ROWS * WIDTH * 2);
    assert_int_equal(kern_codec_bytes(KERN_CODEC_BF16, ROWS, WIDTH), ROWS * WIDTH * 2);
    assert_int_equal(kern_codec_bytes(KERN_CODEC_INT8, ROWS, WIDTH), ROWS * (WIDTH + 4));
    assert_int_equal(kern_codec_bytes(KERN_CODEC_INT8, SIZE_MAX / 2, 64), 0); /* overflow */
    assert_int_equal(kern_codec_bytes((kern_codec)9, 1, 1), 0);
}

static void test_kern_codec_half_types_match_converters(void **state)
{
    (void)state;
    float x[ROWS * WIDTH], y[ROWS * WIDTH];
    fill(x, ROWS * WIDTH, 1);
    x[0] = 1e6f; /* past f16's range */
    x[1] = -0.0f;
    uint8_t buf[ROWS * WIDTH * 4];
    for (int c = KERN_CODEC_F32; c <= KERN_CODEC_BF16; c++) {
        kern_codec k = (kern_codec)c;
        kern_codec_encode(k, x, ROWS, WIDTH, buf);
        assert_int_equal(kern_codec_decode(k, buf, kern_codec_bytes(k, ROWS, WIDTH), ROWS, WIDTH, y), FU_OK);
        for (size_t i = 0; i < ROWS * WIDTH; i++) {
            float want = k == KERN_CODEC_F32   ? x[i]
                         : k == KERN_CODEC_F16 ? kern_f16_to_f32(kern_f32_to_f16(x[i]))
                                               : kern_bf16_to_f32(kern_f32_to_bf16(x[i]));
            assert_memory_equal(&y[i], &want, sizeof want);
        }
    }
    assert_true(isinf(kern_f16_to_f32(kern_f32_to_f16(1e6f)))); /* f16 overflows: documented */
}

static void test_kern_codec_int8_error_bound(void **state)
{
    (void)state;
    float x[ROWS * WIDTH], y[ROWS * WIDTH];
    fill(x, ROWS * WIDTH, 2);
    for (size_t i = 0; i < WIDTH; i++)
        x[2 * WIDTH + i] = 0; /* a zero row */
    x[3 * WIDTH + 5] = -40.0f; /* a row whose extreme is negative */
    uint8_t buf[ROWS * (WIDTH + 4)];
    kern_codec_encode(KERN_CODEC_INT8, x, ROWS, WIDTH, buf);
    assert_int_equal(kern_codec_decode(KERN_CODEC_INT8, buf, sizeof buf, ROWS, WIDTH, y), FU_OK);
    for (size_t r = 0; r < ROWS; r++) {
        float amax = 0;
        for (size_t i = 0; i < WIDTH; i++)
            amax = fmaxf(amax, fabsf(x[r * WIDTH + i]));
        float s = amax / 127.0f;
        for (size_t i = 0; i < WIDTH; i++) {
            float a = x[r * WIDTH + i], b = y[r * WIDTH + i];
            assert_true(fabsf(a - b) <= 0.5f * s * 1.0001f);
            assert_true(a == 0 ? b == 0 : a > 0 ? b >= 0 : b <= 0); /* no sign flips */
            if (fabsf(a) == amax)
                assert_true(fabsf(b - a) <= amax * 1e-6f); /* the extreme is 127 steps */
        }
    }
    assert_true(y[3 * WIDTH + 5] == -40.0f);
    for (size_t i = 0; i < WIDTH; i++)
        assert_true(y[2 * WIDTH + i] == 0);
}

static void test_kern_codec_int8_is_pure(void **state)
{
    (void)state;
    float x[ROWS * WIDTH];
    fill(x, ROWS * WIDTH, 3);
    uint8_t a[ROWS * (WIDTH + 4)], b[ROWS * (WIDTH + 4)], one[WIDTH + 4];
    kern_codec_encode(KERN_CODEC_INT8, x, ROWS, WIDTH, a);
    kern_codec_encode(KERN_CODEC_INT8, x, ROWS, WIDTH, b);
    assert_memory_equal(a, b, sizeof a);
    for (size_t r = 0; r < ROWS; r++) { /* a row alone encodes to the same bytes */
        kern_codec_encode(KERN_CODEC_INT8, x + r * WIDTH, 1, WIDTH, one);
        assert_memory_equal(one, a + r * (WIDTH + 4), sizeof one);
    }
}

static void test_kern_codec_decode_refuses_bad_input(void **state)
{
    (void)state;
    float x[2 * WIDTH], y[2 * WIDTH];
    fill(x, 2 * WIDTH, 4);
    uint8_t buf[2 * (WIDTH + 4)];
    kern_codec_encode(KERN_CODEC_INT8, x, 2, WIDTH, buf);
    assert_int_equal(kern_codec_decode(KERN_CODEC_INT8, buf, sizeof buf - 1, 2, WIDTH, y), FU_EPROTO);
    assert_int_equal(kern_codec_decode(KERN_CODEC_F16, buf, sizeof buf, 2, WIDTH, y), FU_EPROTO);
    assert_int_equal(kern_codec_decode((kern_codec)7, buf, sizeof buf, 2, WIDTH, y), FU_EINVAL);
    const float bad[] = {-1.0f, NAN, INFINITY};
    for (size_t k = 0; k < 3; k++) {
        uint8_t evil[sizeof buf];
        memcpy(evil, buf, sizeof buf);
        memcpy(evil + WIDTH + 4, &bad[k], 4); /* the second row's scale */
        assert_int_equal(kern_codec_decode(KERN_CODEC_INT8, evil, sizeof evil, 2, WIDTH, y), FU_EPROTO);
    }
    /* a row that holds a NaN is sent with a NaN scale, so the receiver refuses it */
    x[WIDTH + 3] = NAN;
    kern_codec_encode(KERN_CODEC_INT8, x, 2, WIDTH, buf);
    assert_int_equal(kern_codec_decode(KERN_CODEC_INT8, buf, sizeof buf, 2, WIDTH, y), FU_EPROTO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_codec_names_and_sizes),
        cmocka_unit_test(test_kern_codec_half_types_match_converters),
        cmocka_unit_test(test_kern_codec_int8_error_bound),
        cmocka_unit_test(test_kern_codec_int8_is_pure),
        cmocka_unit_test(test_kern_codec_decode_refuses_bad_input),
    };
    return tu_unit_main(tests, NULL, NULL, NULL);
}
