/* Helpers for the CUDA backend tests: device probing (exit 77 without a GPU), moving f32 host data
 * to and from device tensors of any float dtype, rounding host data to a dtype so that the CPU
 * reference sees exactly the values the GPU sees, and per-dtype error bounds. Header-only; builds
 * on test_kern_util.h (tk_rand). */
#ifndef FU_TEST_KERN_CUDA_UTIL_H
#define FU_TEST_KERN_CUDA_UTIL_H

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <setjmp.h>
#include <cmocka.h>

#include "kern_backend.h"
#include "kern_tensor.h"
#include "test_kern_util.h"
#ifdef FUSION_KERN_HAVE_CUDA
#include "kern_cuda.h"
#endif

#define TC_SKIP 77 /* ctest SKIP_RETURN_CODE */

/* The CUDA backend under test and the CPU reference (set by tc_probe). */
static const kern_backend_t *tc_gpu;
static const kern_backend_t *tc_cpu;

/* Returns 0 when a CUDA device is usable (tc_gpu set), TC_SKIP otherwise (after saying why). */
static inline int tc_probe(const char *prog)
{
#ifdef FUSION_KERN_HAVE_CUDA
    int n = kern_cuda_device_count();
    if (n <= 0) {
        printf("%s: no CUDA device; skipping\n", prog);
        return TC_SKIP;
    }
    if (kern_backend_get("cuda:0", &tc_gpu) != FU_OK || !tc_gpu) {
        printf("%s: CUDA device 0 could not be opened; skipping\n", prog);
        return TC_SKIP;
    }
    tc_cpu = kern_backend_cpu();
    return 0;
#else
    printf("%s: built without CUDA; skipping\n", prog);
    return TC_SKIP;
#endif
}

/* main()'s result: the group's when a CUDA device is usable, else TC_SKIP (after tc_probe says why). */
#define TC_RUN_GROUP(prog, tests) (tc_probe(prog) ? TC_SKIP : cmocka_run_group_tests(tests, NULL, NULL))

static const kern_dtype tc_float_dtypes[3] = {KERN_F32, KERN_F16, KERN_BF16};

/* Error bounds: |gpu - ref| <= atol + rtol*|ref|. */
typedef struct {
    double atol, rtol;
} tc_tol;

static inline tc_tol tc_tol_of(kern_dtype dt)
{
    switch (dt) {
    case KERN_F16:
        return (tc_tol){3e-3, 2e-2};
    case KERN_BF16:
        return (tc_tol){2e-2, 6e-2};
    default:
        return (tc_tol){1e-5, 1e-4};
    }
}

static inline tc_tol tc_tol_scaled(kern_dtype dt, double f)
{
    tc_tol t = tc_tol_of(dt);
    t.atol *= f;
    t.rtol *= f;
    return t;
}

/* Rounds h[0..n) to dt in place (f32: unchanged). */
static inline void tc_round(kern_dtype dt, float *h, size_t n)
{
    if (dt == KERN_F32 || n == 0)
        return;
    uint16_t *tmp = malloc(n * sizeof(uint16_t));
    assert_int_equal(kern_convert_host(tmp, dt, h, KERN_F32, n), FU_OK);
    assert_int_equal(kern_convert_host(h, KERN_F32, tmp, dt, n), FU_OK);
    free(tmp);
}

/* n floats uniform in [lo, hi) (tk_rand) rounded to dt: the values a dt tensor of them holds, so the
 * CPU reference sees what the GPU sees. Caller frees. */
static inline float *tc_rand_dt(kern_dtype dt, size_t n, uint64_t seed, float lo, float hi)
{
    float *p = tk_rand(n, seed, lo, hi);
    tc_round(dt, p, n);
    return p;
}

/* New tensor on be of dtype dt holding h (f32 host data converted). Caller destroys. */
static inline kern_tensor_t *tc_up(const kern_backend_t *be, kern_dtype dt, const float *h, int ndim, int64_t d0,
                                   int64_t d1)
{
    int64_t shape[2] = {d0, d1};
    kern_tensor_t *t = NULL;
    assert_int_equal(kern_tensor_new(be, dt, ndim, shape, &t), FU_OK);
    size_t n = (size_t)kern_tensor_numel(t);
    if (n == 0)
        return t;
    if (dt == KERN_F32) {
        assert_int_equal(kern_tensor_copy_in(be, t, h, n * sizeof(float)), FU_OK);
    } else {
        uint16_t *tmp = malloc(n * sizeof(uint16_t));
        assert_int_equal(kern_convert_host(tmp, dt, h, KERN_F32, n), FU_OK);
        assert_int_equal(kern_tensor_copy_in(be, t, tmp, n * sizeof(uint16_t)), FU_OK);
        free(tmp);
    }
    return t;
}

/* Zero-filled tensor on be. */
static inline kern_tensor_t *tc_zeros(const kern_backend_t *be, kern_dtype dt, int ndim, int64_t d0, int64_t d1)
{
    int64_t shape[2] = {d0, d1};
    kern_tensor_t *t = NULL;
    assert_int_equal(kern_tensor_new_zeros(be, dt, ndim, shape, &t), FU_OK);
    return t;
}

/* i32 tensor on be holding ids. */
static inline kern_tensor_t *tc_up_i32(const kern_backend_t *be, const int32_t *ids, int64_t n)
{
    kern_tensor_t *t = NULL;
    assert_int_equal(kern_tensor_new(be, KERN_I32, 1, &n, &t), FU_OK);
    if (n)
        assert_int_equal(kern_tensor_copy_in(be, t, ids, (size_t)n * sizeof(int32_t)), FU_OK);
    return t;
}

/* The tensor's contents as f32 host data; caller frees. */
static inline float *tc_down(const kern_backend_t *be, const kern_tensor_t *t)
{
    size_t n = (size_t)kern_tensor_numel(t);
    float *h = malloc((n ? n : 1) * sizeof(float));
    if (n == 0)
        return h;
    if (t->dtype == KERN_F32) {
        assert_int_equal(kern_tensor_copy_out(be, t, h, n * sizeof(float)), FU_OK);
    } else {
        uint16_t *tmp = malloc(n * sizeof(uint16_t));
        assert_int_equal(kern_tensor_copy_out(be, t, tmp, n * sizeof(uint16_t)), FU_OK);
        assert_int_equal(kern_convert_host(h, KERN_F32, tmp, t->dtype, n), FU_OK);
        free(tmp);
    }
    return h;
}

/* Worst |a-b|/(atol + rtol|b|) over n; <= 1 is within bounds. Prints the first offender. */
static inline double tc_ratio(const char *what, const float *a, const float *b, size_t n, tc_tol tol)
{
    double worst = 0.0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs((double)a[i] - (double)b[i]) / (tol.atol + tol.rtol * fabs((double)b[i]));
        if (!(r <= worst)) {
            worst = r;
            at = i;
        }
    }
    if (!(worst <= 1.0))
        printf("  %s: worst at [%zu]: gpu %.8g ref %.8g (ratio %.3g)\n", what, at, (double)a[at], (double)b[at],
               worst);
    return worst;
}

/* Compares a device tensor with host reference data. */
static inline void tc_expect(const char *what, const kern_tensor_t *t, const float *ref, tc_tol tol)
{
    float *g = tc_down(tc_gpu, t);
    double r = tc_ratio(what, g, ref, (size_t)kern_tensor_numel(t), tol);
    free(g);
    if (!(r <= 1.0))
        fail_msg("%s (%s): gpu and cpu differ beyond the bound (ratio %.3g)", what, kern_dtype_name(t->dtype), r);
}

/* Compares a device tensor with the same tensor of the CPU reference run (a tc_cpu tensor). */
static inline void tc_expect_cpu(const char *what, const kern_tensor_t *t, const kern_tensor_t *ref_t, tc_tol tol)
{
    float *ref = tc_down(tc_cpu, ref_t);
    tc_expect(what, t, ref, tol);
    free(ref);
}

/* Destroys each tensor of the list (pointers to kern_tensor_t *, set to NULL). */
#define TC_DESTROY_ALL(...)                                                             \
    do {                                                                                \
        kern_tensor_t **tc_all_[] = {__VA_ARGS__};                                      \
        for (size_t tc_i_ = 0; tc_i_ < sizeof tc_all_ / sizeof tc_all_[0]; tc_i_++)      \
            kern_tensor_destroy(tc_all_[tc_i_]);                                        \
    } while (0)

/* A CPU tensor wrapping host floats (borrowed). */
static inline kern_tensor_t tc_cpu_t(float *h, int ndim, int64_t d0, int64_t d1)
{
    return tk_t(h, KERN_F32, ndim, d0, d1, 1);
}

static inline kern_tensor_t tc_cpu_i32(int32_t *h, int64_t n)
{
    return tk_i1(h, n);
}

#endif
