/* kern_tensor and kern_backend basics: descriptors, views, half conversions, workspaces, backend
 * lookup and memory movement. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "kern_backend.h"
#include "kern_tensor.h"
#include "test_kern_util.h"

static void test_kern_tensor_dtypes(void **state)
{
    (void)state;
    assert_int_equal(kern_dtype_size(KERN_F32), 4);
    assert_int_equal(kern_dtype_size(KERN_F16), 2);
    assert_int_equal(kern_dtype_size(KERN_BF16), 2);
    assert_int_equal(kern_dtype_size(KERN_I32), 4);
    assert_int_equal(kern_dtype_size(KERN_U8), 1);
    assert_int_equal(kern_dtype_size((kern_dtype)99), 0);
    assert_string_equal(kern_dtype_name(KERN_BF16), "bf16");
    assert_string_equal(kern_dtype_name((kern_dtype)-1), "?");
}

static void test_kern_tensor_wrap_validates(void **state)
{
    (void)state;
    float buf[24];
    kern_tensor_t t;
    int64_t shape[3] = {2, 3, 4};
    assert_int_equal(kern_tensor_wrap(&t, buf, KERN_F32, 3, shape, TK_CPU), FU_OK);
    assert_int_equal(kern_tensor_numel(&t), 24);
    assert_int_equal(kern_tensor_nbytes(&t), 96);
    assert_int_equal(t.stride[0], 12);
    assert_int_equal(t.stride[1], 4);
    assert_int_equal(t.stride[2], 1);
    assert_true(kern_tensor_is_contiguous(&t));
    assert_null(t.owner);

    assert_int_equal(kern_tensor_wrap(&t, buf, KERN_F32, 0, shape, TK_CPU), FU_EINVAL);
    assert_int_equal(kern_tensor_wrap(&t, buf, KERN_F32, 5, shape, TK_CPU), FU_EINVAL);
    assert_int_equal(kern_tensor_wrap(&t, buf, (kern_dtype)42, 3, shape, TK_CPU), FU_EINVAL);
    assert_int_equal(kern_tensor_wrap(&t, NULL, KERN_F32, 3, shape, TK_CPU), FU_EINVAL);
    int64_t neg[2] = {2, -1};
    assert_int_equal(kern_tensor_wrap(&t, buf, KERN_F32, 2, neg, TK_CPU), FU_EINVAL);
    int64_t huge[4] = {INT64_MAX / 2, 4, 4, 4};
    assert_int_equal(kern_tensor_wrap(&t, buf, KERN_F32, 4, huge, TK_CPU), FU_EINVAL);
    int64_t empty[2] = {0, 5};
    assert_int_equal(kern_tensor_wrap(&t, NULL, KERN_F32, 2, empty, TK_CPU), FU_OK);
    kern_device bad = {(kern_device_kind)7, 0};
    assert_int_equal(kern_tensor_wrap(&t, buf, KERN_F32, 3, shape, bad), FU_EINVAL);
}

static void test_kern_tensor_views_share_memory(void **state)
{
    (void)state;
    float buf[24];
    for (int i = 0; i < 24; i++)
        buf[i] = (float)i;
    kern_tensor_t t = tk_f2(buf, 4, 6), s, r, c;
    /* rows 1..2 */
    assert_int_equal(kern_tensor_slice(&t, 0, 1, 2, &s), FU_OK);
    assert_ptr_equal(s.data, buf + 6);
    assert_true(kern_tensor_is_contiguous(&s));
    assert_float_equal(*(float *)kern_tensor_at(&s, 1, 2, 0, 0), 14.0f, 0);
    /* columns 2..4: a strided view that BLAS accepts with a leading dimension */
    assert_int_equal(kern_tensor_slice(&t, 1, 2, 3, &c), FU_OK);
    assert_false(kern_tensor_is_contiguous(&c));
    assert_true(kern_tensor_is_rowmajor_2d(&c));
    assert_float_equal(*(float *)kern_tensor_at(&c, 3, 0, 0, 0), 20.0f, 0);
    assert_null(kern_tensor_at(&c, 4, 0, 0, 0));
    /* reshape: [4,6] -> [2,-1,3] */
    int64_t shp[3] = {2, -1, 3};
    assert_int_equal(kern_tensor_reshape(&t, 3, shp, &r), FU_OK);
    assert_int_equal(r.shape[1], 4);
    assert_ptr_equal(r.data, buf);
    assert_float_equal(*(float *)kern_tensor_at(&r, 1, 1, 2, 0), 17.0f, 0);
    /* invalid */
    assert_int_equal(kern_tensor_reshape(&c, 1, (int64_t[]){12}, &r), FU_EINVAL); /* not contiguous */
    assert_int_equal(kern_tensor_reshape(&t, 2, (int64_t[]){5, 5}, &r), FU_EINVAL);
    assert_int_equal(kern_tensor_reshape(&t, 2, (int64_t[]){-1, -1}, &r), FU_EINVAL);
    assert_int_equal(kern_tensor_reshape(&t, 2, (int64_t[]){-1, 7}, &r), FU_EINVAL);
    assert_int_equal(kern_tensor_slice(&t, 0, 3, 2, &s), FU_EINVAL);
    assert_int_equal(kern_tensor_slice(&t, 2, 0, 1, &s), FU_EINVAL);
    assert_int_equal(kern_tensor_slice(&t, 0, -1, 1, &s), FU_EINVAL);
}

static void test_kern_tensor_half_conversions(void **state)
{
    (void)state;
    assert_int_equal(kern_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(kern_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(kern_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(kern_f32_to_f16(65520.0f), 0x7c00);     /* rounds up to inf */
    assert_int_equal(kern_f32_to_f16(1e-10f), 0x0000);       /* underflow */
    assert_int_equal(kern_f32_to_f16(5.9604645e-8f), 0x0001); /* smallest subnormal */
    assert_int_equal(kern_f32_to_f16(1.0f + 1.0f / 2048.0f), 0x3c00); /* tie -> even */
    assert_int_equal(kern_f32_to_f16(1.0f + 3.0f / 2048.0f), 0x3c02); /* tie -> even (up) */
    assert_int_equal(kern_f32_to_f16(INFINITY), 0x7c00);
    assert_true((kern_f32_to_f16(NAN) & 0x7c00) == 0x7c00 && (kern_f32_to_f16(NAN) & 0x3ff));
    /* every f16 value survives f16 -> f32 -> f16 */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kern_f16_to_f32((uint16_t)h);
        if (isnan(f))
            continue;
        assert_int_equal(kern_f32_to_f16(f), h);
    }
    assert_float_equal(kern_f16_to_f32(0x0001), 5.9604645e-8f, 1e-14);
    assert_int_equal(kern_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(kern_f32_to_bf16(-3.0f), 0xc040);
    assert_int_equal(kern_f32_to_bf16(1.00390625f), 0x3f80); /* halfway: even */
    assert_int_equal(kern_f32_to_bf16(1.01171875f), 0x3f82); /* halfway: to even (up) */
    assert_true(isnan(kern_bf16_to_f32(kern_f32_to_bf16(NAN))));
    assert_float_equal(kern_bf16_to_f32(0x4049), 3.140625f, 0);

    float src[5] = {0.5f, -1.25f, 3.0f, 1024.0f, -0.0f}, back[5];
    uint16_t h16[5];
    assert_int_equal(kern_convert_host(h16, KERN_F16, src, KERN_F32, 5), FU_OK);
    assert_int_equal(kern_convert_host(back, KERN_F32, h16, KERN_F16, 5), FU_OK);
    assert_memory_equal(back, src, sizeof src);
    assert_int_equal(kern_convert_host(h16, KERN_BF16, src, KERN_F32, 5), FU_OK);
    assert_int_equal(kern_convert_host(back, KERN_F32, h16, KERN_BF16, 5), FU_OK);
    assert_memory_equal(back, src, sizeof src);
    /* the vectorised bf16 paths agree with the scalar conversions on many bit patterns */
    {
        enum { NB = 4096 };
        float fs[NB], fb[NB];
        uint16_t hb[NB];
        uint32_t x = 12345;
        for (int i = 0; i < NB; i++) {
            x = x * 1664525u + 1013904223u;
            uint32_t bits = x;
            memcpy(&fs[i], &bits, 4);
        }
        fs[0] = NAN;
        fs[1] = -INFINITY;
        fs[2] = 3.4028235e38f; /* rounds to inf */
        assert_int_equal(kern_convert_host(hb, KERN_BF16, fs, KERN_F32, NB), FU_OK);
        assert_int_equal(kern_convert_host(fb, KERN_F32, hb, KERN_BF16, NB), FU_OK);
        for (int i = 0; i < NB; i++) {
            assert_int_equal(hb[i], kern_f32_to_bf16(fs[i]));
            float want = kern_bf16_to_f32(hb[i]);
            assert_memory_equal(&fb[i], &want, 4);
        }
    }
    assert_int_equal(kern_convert_host(back, KERN_I32, src, KERN_F32, 5), FU_EINVAL);
    assert_int_equal(kern_convert_host(NULL, KERN_F32, src, KERN_F32, 5), FU_EINVAL);
}

static void test_kern_tensor_workspace_bumps_and_rewinds(void **state)
{
    (void)state;
    const kern_backend_t *cpu = kern_backend_cpu();
    kern_workspace_t *ws = kern_workspace_new(cpu, 1024);
    assert_non_null(ws);
    assert_int_equal(kern_workspace_capacity(ws), 1024);
    void *a = NULL, *b = NULL;
    assert_int_equal(kern_workspace_take(ws, 10, &a), FU_OK);
    assert_int_equal(kern_workspace_used(ws), KERN_ALIGN);
    size_t mark = kern_workspace_mark(ws);
    kern_tensor_t t;
    assert_int_equal(kern_workspace_tensor(ws, KERN_F32, 2, (int64_t[]){4, 8}, &t), FU_OK);
    assert_int_equal((uintptr_t)t.data % KERN_ALIGN, 0);
    assert_int_equal(kern_workspace_take(ws, 2048, &b), FU_ENOMEM);
    assert_int_equal(kern_workspace_take(ws, SIZE_MAX, &b), FU_ENOMEM);
    kern_workspace_rewind(ws, mark);
    assert_int_equal(kern_workspace_used(ws), KERN_ALIGN);
    kern_workspace_destroy(&ws);
    assert_null(ws);
    kern_workspace_destroy(&ws);
}

static void test_kern_tensor_backend_lookup(void **state)
{
    (void)state;
    const kern_backend_t *be = NULL;
    assert_int_equal(kern_backend_get("cpu", &be), FU_OK);
    assert_ptr_equal(be, kern_backend_cpu());
    assert_string_equal(be->name, "cpu");
    assert_int_equal(be->device.kind, KERN_DEV_CPU);
#ifndef FUSION_KERN_HAVE_CUDA
    assert_int_equal(kern_backend_get("cuda:0", &be), FU_ENOSYS);
    assert_int_equal(kern_backend_get("cuda", &be), FU_ENOSYS);
#else
    fu_err rc = kern_backend_get("cuda:0", &be);
    assert_true(rc == FU_OK || rc == FU_ENOTFOUND || rc == FU_ECUDA);
#endif
    assert_int_equal(kern_backend_get("cuda:", &be), FU_EINVAL);
    assert_int_equal(kern_backend_get("cuda:x", &be), FU_EINVAL);
    assert_int_equal(kern_backend_get("cuda:0junk", &be), FU_EINVAL);
    assert_int_equal(kern_backend_get("tpu", &be), FU_EINVAL);
    assert_int_equal(kern_backend_get(NULL, &be), FU_EINVAL);
    assert_true(kern_cpu_threads() >= 1);
}

static void test_kern_tensor_alloc_copy_convert(void **state)
{
    (void)state;
    const kern_backend_t *cpu = kern_backend_cpu();
    kern_tensor_t *t = NULL, *h = NULL, *z = NULL;
    int64_t shape[2] = {3, 5};
    assert_int_equal(kern_tensor_new(cpu, KERN_F32, 2, shape, &t), FU_OK);
    assert_ptr_equal(t->owner, cpu);
    assert_int_equal((uintptr_t)t->data % KERN_ALIGN, 0);
    float src[15], dst[15];
    for (int i = 0; i < 15; i++)
        src[i] = (float)i * 0.25f - 1.0f;
    assert_int_equal(kern_tensor_copy_in(cpu, t, src, sizeof src), FU_OK);
    assert_int_equal(kern_tensor_copy_in(cpu, t, src, sizeof src - 4), FU_EINVAL);
    assert_int_equal(kern_tensor_new(cpu, KERN_BF16, 2, shape, &h), FU_OK);
    assert_int_equal(kern_tensor_convert(cpu, t, h), FU_OK);
    assert_int_equal(kern_tensor_new_zeros(cpu, KERN_F32, 2, shape, &z), FU_OK);
    for (int i = 0; i < 15; i++)
        assert_float_equal(((float *)z->data)[i], 0.0f, 0);
    assert_int_equal(kern_tensor_convert(cpu, h, z), FU_OK);
    assert_int_equal(kern_tensor_copy_out(cpu, z, dst, sizeof dst), FU_OK);
    assert_memory_equal(dst, src, sizeof src); /* quarter steps are exact in bf16 */
    assert_int_equal(kern_tensor_copy(cpu, t, z), FU_OK);
    assert_int_equal(kern_tensor_copy(cpu, t, h), FU_EINVAL); /* dtype differs */
    assert_int_equal(kern_tensor_zero(cpu, z), FU_OK);
    /* a tensor claiming to live on a GPU is refused by the CPU backend, never touched */
    kern_tensor_t fake = *t;
    fake.device.kind = KERN_DEV_CUDA;
    assert_int_equal(kern_tensor_copy_out(cpu, &fake, dst, sizeof dst), FU_EINVAL);
    kern_tensor_t *bad = NULL;
    assert_int_equal(kern_tensor_new(cpu, KERN_F32, 2, (int64_t[]){-1, 2}, &bad), FU_EINVAL);
    assert_null(bad);
    assert_int_equal(kern_backend_sync(cpu), FU_OK);
    kern_tensor_destroy(&t);
    kern_tensor_destroy(&h);
    kern_tensor_destroy(&z);
    assert_null(t);
    kern_tensor_destroy(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_tensor_dtypes),
        cmocka_unit_test(test_kern_tensor_wrap_validates),
        cmocka_unit_test(test_kern_tensor_views_share_memory),
        cmocka_unit_test(test_kern_tensor_half_conversions),
        cmocka_unit_test(test_kern_tensor_workspace_bumps_and_rewinds),
        cmocka_unit_test(test_kern_tensor_backend_lookup),
        cmocka_unit_test(test_kern_tensor_alloc_copy_convert),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
