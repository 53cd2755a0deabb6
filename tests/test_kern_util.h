/* Helpers shared by the kernels tests: CPU tensors over test-owned arrays, seeded random fills,
 * closeness checks and a central finite-difference gradient checker. Header-only. */
#ifndef FU_TEST_KERN_UTIL_H
#define FU_TEST_KERN_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern_backend.h"
#include "kern_rng.h"
#include "kern_tensor.h"

static const kern_device TK_CPU = {KERN_DEV_CPU, 0};

/* A CPU tensor over caller memory (asserting success: shapes here are the test's own). */
static inline kern_tensor_t tk_t(void *data, kern_dtype dt, int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    int64_t shape[3] = {d0, d1, d2};
    kern_tensor_t t;
    fu_err rc = kern_tensor_wrap(&t, data, dt, ndim, shape, TK_CPU);
    if (rc != FU_OK) {
        fprintf(stderr, "tk_t: wrap failed\n");
        abort();
    }
    return t;
}
static inline kern_tensor_t tk_f2(float *p, int64_t r, int64_t c)
{
    return tk_t(p, KERN_F32, 2, r, c, 1);
}
static inline kern_tensor_t tk_f1(float *p, int64_t n)
{
    return tk_t(p, KERN_F32, 1, n, 1, 1);
}
static inline kern_tensor_t tk_i1(int32_t *p, int64_t n)
{
    return tk_t(p, KERN_I32, 1, n, 1, 1);
}

/* n floats uniform in [lo, hi) from a seeded stream; caller frees. */
static inline float *tk_rand(size_t n, uint64_t seed, float lo, float hi)
{
    float *p = malloc((n ? n : 1) * sizeof(float));
    kern_rng r;
    kern_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++)
        p[i] = lo + (hi - lo) * kern_rng_uniform(&r);
    return p;
}

/* xorshift64 step: a tiny seeded stream for tests that want raw random bits (mutations, sparsity
 * patterns); *state must not be 0. */
static inline uint64_t tk_xorshift(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* Uniform in [-1, 1) from the top 53 bits of tk_xorshift. */
static inline float tk_xorshift_unit(uint64_t *state)
{
    return (float)((double)(tk_xorshift(state) >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static inline float *tk_zeros(size_t n)
{
    return calloc(n ? n : 1, sizeof(float));
}

static inline float *tk_dup(const float *p, size_t n)
{
    float *q = malloc((n ? n : 1) * sizeof(float));
    memcpy(q, p, n * sizeof(float));
    return q;
}

/* Frees each pointer of the list: a test case's host buffers in one line. */
#define TK_FREE_ALL(...)                                                                \
    do {                                                                                \
        void *tk_all_[] = {__VA_ARGS__};                                                \
        for (size_t tk_i_ = 0; tk_i_ < sizeof tk_all_ / sizeof tk_all_[0]; tk_i_++)      \
            free(tk_all_[tk_i_]);                                                       \
    } while (0)

/* Largest |a-b| / (atol + rtol*|b|) over n elements; <= 1 means close. */
static inline double tk_close_ratio(const float *a, const double *b, size_t n, double atol, double rtol)
{
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs((double)a[i] - b[i]) / (atol + rtol * fabs(b[i]));
        if (!(r <= worst))
            worst = r; /* NaN propagates as a failure */
    }
    return worst;
}

static inline double tk_close_ratio_f(const float *a, const float *b, size_t n, double atol, double rtol)
{
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double r = fabs((double)a[i] - (double)b[i]) / (atol + rtol * fabs((double)b[i]));
        if (!(r <= worst))
            worst = r;
    }
    return worst;
}

/* Scalar loss L = Σ out·R in double, after running the op's forward. */
typedef void (*tk_fwd_fn)(void *ctx);
static inline double tk_loss(tk_fwd_fn f, void *ctx, const float *out, const float *R, size_t n)
{
    f(ctx);
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)out[i] * (double)R[i];
    return s;
}

/* Compares the analytic gradient `ana` of L w.r.t. param[0..np) with central differences (eps) at
 * up to max_checks evenly spread indices. Returns the worst |num−ana|/(atol + rtol·|num|). */
static inline double tk_grad_check(tk_fwd_fn f, void *ctx, float *param, size_t np, const float *ana, const float *out,
                                   const float *R, size_t nout, float eps, double atol, double rtol, size_t max_checks)
{
    double worst = 0.0;
    size_t step = np > max_checks ? np / max_checks : 1;
    for (size_t i = 0; i < np; i += step) {
        float save = param[i];
        param[i] = save + eps;
        double lp = tk_loss(f, ctx, out, R, nout);
        param[i] = save - eps;
        double lm = tk_loss(f, ctx, out, R, nout);
        param[i] = save;
        double num = (lp - lm) / (2.0 * (double)eps);
        double r = fabs(num - (double)ana[i]) / (atol + rtol * fabs(num));
        if (!(r <= worst)) {
            worst = r;
            if (r > 1.0)
                fprintf(stderr, "  grad[%zu]: numeric %.6g analytic %.6g\n", i, num, (double)ana[i]);
        }
    }
    f(ctx);
    return worst;
}

#endif
