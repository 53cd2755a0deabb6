/* CPU ops through the public wrappers: forward values against plain loops, backward against
 * central finite differences, AdamW against a hand computation, sampling rules, and FU_EINVAL for
 * bad shapes, dtypes, devices and values. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "kern_backend.h"
#include "kern_internal.h"
#include "test_kern_util.h"

#define CPU kern_backend_cpu()
#define FD_EPS 1e-2f
#define FD_ATOL 2e-3
#define FD_RTOL 2e-2

/* ---- GEMM and linear ---- */

static void ref_gemm(bool ta, bool tb, float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                     float beta, double *c, int64_t m, int64_t n, int64_t k)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0.0;
            for (int64_t p = 0; p < k; p++) {
                double x = ta ? a[p * lda + i] : a[i * lda + p];
                double y = tb ? b[j * ldb + p] : b[p * ldb + j];
                s += x * y;
            }
            c[i * n + j] = alpha * s + beta * c[i * n + j];
        }
}

static void test_kern_ops_gemm_matches_reference(void **state)
{
    (void)state;
    const int64_t m = 7, n = 5, k = 9;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            float *a = tk_rand((size_t)(m * k), 1, -1, 1), *b = tk_rand((size_t)(k * n), 2, -1, 1);
            float *c = tk_rand((size_t)(m * n), 3, -1, 1);
            double ref[35];
            for (int i = 0; i < 35; i++)
                ref[i] = c[i];
            kern_tensor_t A = ta ? tk_f2(a, k, m) : tk_f2(a, m, k);
            kern_tensor_t B = tb ? tk_f2(b, n, k) : tk_f2(b, k, n);
            kern_tensor_t C = tk_f2(c, m, n);
            assert_int_equal(kern_gemm(CPU, ta, tb, 0.5f, &A, &B, 2.0f, &C), FU_OK);
            ref_gemm(ta, tb, 0.5f, a, ta ? m : k, b, tb ? k : n, 2.0f, ref, m, n, k);
            assert_true(tk_close_ratio(c, ref, 35, 1e-5, 1e-5) <= 1.0);
            free(a);
            free(b);
            free(c);
        }
    /* vector shapes take the GEMV path: every transpose, beta 0 clearing NaN, beta accumulating */
    static const int64_t vs[][3] = {{1, 5, 9}, {7, 1, 9}, {1, 1, 9}, {1, 6, 1}};
    for (size_t si = 0; si < 4; si++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                for (int bz = 0; bz < 2; bz++) {
                    int64_t vm = vs[si][0], vn = vs[si][1], vk = vs[si][2];
                    float *a = tk_rand((size_t)(vm * vk), 5, -1, 1), *b = tk_rand((size_t)(vk * vn), 6, -1, 1);
                    float *c = tk_rand((size_t)(vm * vn), 7, -1, 1);
                    double ref[64];
                    for (int64_t i = 0; i < vm * vn; i++) {
                        ref[i] = bz ? 0.0 : c[i];
                        if (bz)
                            c[i] = NAN;
                    }
                    kern_tensor_t A = ta ? tk_f2(a, vk, vm) : tk_f2(a, vm, vk);
                    kern_tensor_t B = tb ? tk_f2(b, vn, vk) : tk_f2(b, vk, vn);
                    kern_tensor_t C = tk_f2(c, vm, vn);
                    float beta = bz ? 0.0f : 0.5f;
                    assert_int_equal(kern_gemm(CPU, ta, tb, 1.5f, &A, &B, beta, &C), FU_OK);
                    ref_gemm(ta, tb, 1.5f, a, ta ? vm : vk, b, tb ? vk : vn, beta, ref, vm, vn, vk);
                    assert_true(tk_close_ratio(c, ref, (size_t)(vm * vn), 1e-5, 1e-5) <= 1.0);
                    free(a);
                    free(b);
                    free(c);
                }
    /* a strided single row and a strided single column (views into a bigger matrix) */
    {
        float *big = tk_rand(6 * 10, 8, -1, 1), *w = tk_rand(4 * 3, 9, -1, 1), out[4 * 10];
        for (int i = 0; i < 40; i++)
            out[i] = 100.0f;
        kern_tensor_t Big = tk_f2(big, 6, 10), Row, W = tk_f2(w, 4, 3), Out = tk_f2(out, 4, 10), Orow, Ocol, Bcol;
        assert_int_equal(kern_tensor_slice(&Big, 0, 2, 1, &Row), FU_OK); /* [1,10] */
        assert_int_equal(kern_tensor_slice(&Row, 1, 4, 3, &Row), FU_OK); /* [1,3] at col 4 */
        assert_int_equal(kern_tensor_slice(&Out, 0, 1, 1, &Orow), FU_OK);
        assert_int_equal(kern_tensor_slice(&Orow, 1, 2, 4, &Orow), FU_OK); /* [1,4] */
        assert_int_equal(kern_linear_forward(CPU, &Row, &W, &Orow), FU_OK);
        double r1[4] = {0};
        ref_gemm(false, true, 1.0f, big + 2 * 10 + 4, 10, w, 3, 0.0f, r1, 1, 4, 3);
        assert_true(tk_close_ratio(out + 10 + 2, r1, 4, 1e-5, 1e-5) <= 1.0);
        assert_float_equal(out[10 + 1], 100.0f, 0); /* neighbours untouched */
        assert_float_equal(out[10 + 6], 100.0f, 0);
        /* C[:,col 7] (4x1, stride 10) = W[4,3] · Big[0:3, col 1] (3x1, stride 10) */
        assert_int_equal(kern_tensor_slice(&Out, 1, 7, 1, &Ocol), FU_OK);
        assert_int_equal(kern_tensor_slice(&Big, 0, 0, 3, &Bcol), FU_OK);
        assert_int_equal(kern_tensor_slice(&Bcol, 1, 1, 1, &Bcol), FU_OK);
        assert_int_equal(kern_gemm(CPU, false, false, 1.0f, &W, &Bcol, 0.0f, &Ocol), FU_OK);
        double r2[4] = {0};
        ref_gemm(false, false, 1.0f, w, 3, big + 1, 10, 0.0f, r2, 4, 1, 3);
        for (int i = 0; i < 4; i++)
            assert_float_equal(out[i * 10 + 7], (float)r2[i], 1e-5);
        assert_float_equal(out[0 * 10 + 8], 100.0f, 0);
        free(big);
        free(w);
    }
    /* column views (row stride > width) work as BLAS leading dimensions */
    float *big = tk_rand(8 * 12, 4, -1, 1), *w = tk_rand(3 * 4, 5, -1, 1), y[8 * 3];
    kern_tensor_t X = tk_f2(big, 8, 12), Xc, W = tk_f2(w, 3, 4), Y = tk_f2(y, 8, 3);
    assert_int_equal(kern_tensor_slice(&X, 1, 4, 4, &Xc), FU_OK);
    assert_int_equal(kern_linear_forward(CPU, &Xc, &W, &Y), FU_OK);
    double ref[24] = {0};
    ref_gemm(false, true, 1.0f, big + 4, 12, w, 4, 0.0f, ref, 8, 3, 4);
    assert_true(tk_close_ratio(y, ref, 24, 1e-5, 1e-5) <= 1.0);
    free(big);
    free(w);
}

typedef struct {
    kern_tensor_t x, w, y;
} lin_ctx;

static void lin_fwd(void *c)
{
    lin_ctx *l = c;
    assert_int_equal(kern_linear_forward(CPU, &l->x, &l->w, &l->y), FU_OK);
}

static void test_kern_ops_linear_backward_matches_fd(void **state)
{
    (void)state;
    const int64_t n = 4, in = 6, out = 5;
    float *x = tk_rand((size_t)(n * in), 10, -1, 1), *w = tk_rand((size_t)(out * in), 11, -1, 1);
    float *y = tk_zeros((size_t)(n * out)), *R = tk_rand((size_t)(n * out), 12, -1, 1);
    float *dx = tk_zeros((size_t)(n * in)), *dw = tk_rand((size_t)(out * in), 13, -1, 1);
    float *dw0 = tk_dup(dw, (size_t)(out * in));
    lin_ctx c = {tk_f2(x, n, in), tk_f2(w, out, in), tk_f2(y, n, out)};
    kern_tensor_t dY = tk_f2(R, n, out), dX = tk_f2(dx, n, in), dW = tk_f2(dw, out, in);
    assert_int_equal(kern_linear_backward(CPU, &dY, &c.x, &c.w, &dX, &dW), FU_OK);
    for (int64_t i = 0; i < out * in; i++)
        dw[i] -= dw0[i]; /* dW accumulates: remove what was there */
    assert_true(tk_grad_check(lin_fwd, &c, x, (size_t)(n * in), dx, y, R, (size_t)(n * out), FD_EPS, FD_ATOL,
                              FD_RTOL, 64) <= 1.0);
    assert_true(tk_grad_check(lin_fwd, &c, w, (size_t)(out * in), dw, y, R, (size_t)(n * out), FD_EPS, FD_ATOL,
                              FD_RTOL, 64) <= 1.0);
    /* dx only, without x */
    assert_int_equal(kern_linear_backward(CPU, &dY, NULL, &c.w, &dX, NULL), FU_OK);
    assert_int_equal(kern_linear_backward(CPU, &dY, NULL, &c.w, &dX, &dW), FU_EINVAL);
    free(x), free(w), free(y), free(R), free(dx), free(dw), free(dw0);
}

/* ---- embedding ---- */

static void test_kern_ops_embedding_gather_and_scatter_add(void **state)
{
    (void)state;
    const int64_t vocab = 6, d = 4, n = 5;
    float *tab = tk_rand((size_t)(vocab * d), 20, -1, 1), out[20], dt[24] = {0};
    int32_t ids[5] = {3, 0, 3, 5, 1};
    kern_tensor_t T = tk_f2(tab, vocab, d), O = tk_f2(out, n, d), I = tk_i1(ids, n), DT = tk_f2(dt, vocab, d);
    assert_int_equal(kern_embedding_forward(CPU, &I, &T, &O), FU_OK);
    for (int64_t i = 0; i < n; i++)
        assert_memory_equal(out + i * d, tab + ids[i] * d, (size_t)d * sizeof(float));
    float g[20];
    for (int i = 0; i < 20; i++)
        g[i] = (float)(i + 1);
    kern_tensor_t G = tk_f2(g, n, d);
    assert_int_equal(kern_embedding_backward(CPU, &I, &G, &DT), FU_OK);
    assert_int_equal(kern_embedding_backward(CPU, &I, &G, &DT), FU_OK); /* accumulates */
    for (int64_t j = 0; j < d; j++) {
        assert_float_equal(dt[3 * d + j], 2 * (g[0 * d + j] + g[2 * d + j]), 1e-6);
        assert_float_equal(dt[0 * d + j], 2 * g[1 * d + j], 1e-6);
        assert_float_equal(dt[2 * d + j], 0.0f, 0);
        assert_float_equal(dt[4 * d + j], 0.0f, 0);
    }
    int32_t bad[5] = {0, 1, 6, 2, 3}, neg[5] = {0, -1, 0, 0, 0};
    kern_tensor_t B = tk_i1(bad, n), N = tk_i1(neg, n);
    assert_int_equal(kern_embedding_forward(CPU, &B, &T, &O), FU_EINVAL);
    assert_int_equal(kern_embedding_forward(CPU, &N, &T, &O), FU_EINVAL);
    assert_int_equal(kern_embedding_backward(CPU, &B, &G, &DT), FU_EINVAL);
    kern_tensor_t If = tk_t(ids, KERN_F32, 1, n, 1, 1);
    assert_int_equal(kern_embedding_forward(CPU, &If, &T, &O), FU_EINVAL);
    kern_tensor_t I4 = tk_i1(ids, 4);
    assert_int_equal(kern_embedding_forward(CPU, &I4, &T, &O), FU_EINVAL);
    free(tab);
}

/* ---- RMSNorm ---- */

typedef struct {
    kern_tensor_t x, w, y;
    float eps;
} norm_ctx;

static void norm_fwd(void *c)
{
    norm_ctx *k = c;
    assert_int_equal(kern_rmsnorm_forward(CPU, &k->x, &k->w, k->eps, &k->y), FU_OK);
}

static void test_kern_ops_rmsnorm_forward_and_backward(void **state)
{
    (void)state;
    const int64_t n = 3, d = 8;
    const float eps = 1e-5f;
    float *x = tk_rand((size_t)(n * d), 30, -2, 2), *w = tk_rand((size_t)d, 31, 0.5f, 1.5f);
    float *y = tk_zeros((size_t)(n * d)), *R = tk_rand((size_t)(n * d), 32, -1, 1);
    norm_ctx c = {tk_f2(x, n, d), tk_f1(w, d), tk_f2(y, n, d), eps};
    norm_fwd(&c);
    double ref[24];
    for (int64_t i = 0; i < n; i++) {
        double ss = 0;
        for (int64_t j = 0; j < d; j++)
            ss += (double)x[i * d + j] * x[i * d + j];
        double r = 1.0 / sqrt(ss / (double)d + eps);
        for (int64_t j = 0; j < d; j++)
            ref[i * d + j] = x[i * d + j] * r * w[j];
    }
    assert_true(tk_close_ratio(y, ref, (size_t)(n * d), 1e-6, 1e-5) <= 1.0);
    float *dx = tk_zeros((size_t)(n * d)), dw[8] = {0};
    kern_tensor_t dY = tk_f2(R, n, d), dX = tk_f2(dx, n, d), dW = tk_f1(dw, d);
    assert_int_equal(kern_rmsnorm_backward(CPU, &dY, &c.x, &c.w, eps, &dX, &dW), FU_OK);
    assert_true(tk_grad_check(norm_fwd, &c, x, (size_t)(n * d), dx, y, R, (size_t)(n * d), 1e-3f, FD_ATOL,
                              FD_RTOL, 64) <= 1.0);
    assert_true(tk_grad_check(norm_fwd, &c, w, (size_t)d, dw, y, R, (size_t)(n * d), 1e-3f, FD_ATOL, FD_RTOL, 64) <=
                1.0);
    assert_int_equal(kern_rmsnorm_forward(CPU, &c.x, &c.w, 0.0f, &c.y), FU_EINVAL);
    assert_int_equal(kern_rmsnorm_forward(CPU, &c.x, &dW, NAN, &c.y), FU_EINVAL);
    kern_tensor_t w7 = tk_f1(w, 7);
    assert_int_equal(kern_rmsnorm_forward(CPU, &c.x, &w7, eps, &c.y), FU_EINVAL);
    assert_int_equal(kern_rmsnorm_backward(CPU, &dY, &c.x, &c.w, eps, &dY, &dW), FU_EINVAL); /* dx aliases dy */
    free(x), free(w), free(y), free(R), free(dx);
}

/* ---- RoPE ---- */

/* Plain loop of Hugging Face's apply_rotary_pos_emb with rotate_half, in double. */
static void ref_rope(const float *x, const int32_t *pos, int64_t n, int64_t heads, int64_t hd, double theta, double *y)
{
    int64_t half = hd / 2;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + (t * heads + h) * hd;
            double *yr = y + (t * heads + h) * hd;
            for (int64_t j = 0; j < hd; j++) {
                int64_t i = j % half;
                double inv = 1.0 / pow(theta, (double)(2 * i) / (double)hd);
                double a = pos[t] * inv;
                double rot = j < half ? -(double)xr[j + half] : (double)xr[j - half]; /* rotate_half */
                yr[j] = xr[j] * cos(a) + rot * sin(a);
            }
        }
}

static const kern_rope_params RP10K = {.theta = 10000.0f}; /* plain RoPE, LLaMA's base */

typedef struct {
    kern_tensor_t x, pos, y;
    int hd;
} rope_ctx;

static void rope_fwd(void *c)
{
    rope_ctx *r = c;
    assert_int_equal(kern_rope_forward(CPU, &r->x, &r->pos, r->hd, &RP10K, &r->y), FU_OK);
}

/* Llama 3's rescaling (rope_scaling "llama3"): wavelengths shorter than original / high_freq_factor
 * keep their frequency, those longer than original / low_freq_factor are divided by factor, and
 * those between lie between the two; parameters out of range are refused. */
static void test_kern_ops_rope_llama3_frequencies(void **state)
{
    (void)state;
    const int hd = 128;
    const kern_rope_params plain = {.theta = 500000.0f},
                           l3 = {.theta = 500000.0f, .factor = 8.0f, .low_freq_factor = 1.0f, .high_freq_factor = 4.0f,
                                 .original_max_pos = 8192.0f};
    float f0[64], f3[64];
    assert_int_equal(kern_rope_inv_freq(&plain, hd, f0), FU_OK);
    assert_int_equal(kern_rope_inv_freq(&l3, hd, f3), FU_OK);
    int kept = 0, divided = 0, blended = 0;
    for (int i = 0; i < hd / 2; i++) {
        double wavelen = 2 * 3.141592653589793 / f0[i];
        if (wavelen < 8192.0 / 4.0) {
            assert_true(f3[i] == f0[i]);
            kept++;
        } else if (wavelen > 8192.0 / 1.0) {
            assert_float_equal(f3[i], f0[i] / 8.0f, 1e-12);
            divided++;
        } else {
            assert_true(f3[i] < f0[i] && f3[i] > f0[i] / 8.0f);
            blended++;
        }
    }
    printf("llama3 frequencies: %d kept, %d blended, %d divided by 8\n", kept, blended, divided);
    assert_true(kept > 0 && blended > 0 && divided > 0);
    kern_rope_params bad = l3;
    bad.high_freq_factor = 0.5f; /* not above low_freq_factor */
    assert_int_equal(kern_rope_inv_freq(&bad, hd, f3), FU_EINVAL);
    bad = l3;
    bad.factor = 0.5f;
    assert_int_equal(kern_rope_inv_freq(&bad, hd, f3), FU_EINVAL);
    assert_int_equal(kern_rope_inv_freq(&l3, 7, f3), FU_EINVAL);
}

static void test_kern_ops_rope_matches_hf_formula(void **state)
{
    (void)state;
    const int64_t n = 5, heads = 3, hd = 8;
    float *x = tk_rand((size_t)(n * heads * hd), 40, -1, 1), *y = tk_zeros((size_t)(n * heads * hd));
    int32_t pos[5] = {0, 1, 7, 100, 513}; /* arbitrary absolute positions (KV-cache offsets) */
    rope_ctx c = {tk_f2(x, n, heads * hd), tk_i1(pos, n), tk_f2(y, n, heads * hd), (int)hd};
    rope_fwd(&c);
    double ref[120];
    ref_rope(x, pos, n, heads, hd, 10000.0, ref);
    assert_true(tk_close_ratio(y, ref, (size_t)(n * heads * hd), 1e-4, 1e-4) <= 1.0);
    /* position 0 is the identity */
    for (int64_t j = 0; j < heads * hd; j++)
        assert_float_equal(y[j], x[j], 1e-7);
    /* in place gives the same */
    float *xi = tk_dup(x, (size_t)(n * heads * hd));
    kern_tensor_t Xi = tk_f2(xi, n, heads * hd);
    assert_int_equal(kern_rope_forward(CPU, &Xi, &c.pos, (int)hd, &RP10K, &Xi), FU_OK);
    assert_memory_equal(xi, y, (size_t)(n * heads * hd) * sizeof(float));
    /* backward is the inverse rotation; check against finite differences */
    float *R = tk_rand((size_t)(n * heads * hd), 41, -1, 1), *dx = tk_zeros((size_t)(n * heads * hd));
    kern_tensor_t dY = tk_f2(R, n, heads * hd), dX = tk_f2(dx, n, heads * hd);
    assert_int_equal(kern_rope_backward(CPU, &dY, &c.pos, (int)hd, &RP10K, &dX), FU_OK);
    assert_true(tk_grad_check(rope_fwd, &c, x, (size_t)(n * heads * hd), dx, y, R, (size_t)(n * heads * hd), FD_EPS,
                              FD_ATOL, FD_RTOL, 120) <= 1.0);
    assert_int_equal(kern_rope_forward(CPU, &c.x, &c.pos, 7, &RP10K, &c.y), FU_EINVAL);  /* odd */
    assert_int_equal(kern_rope_forward(CPU, &c.x, &c.pos, 16, &RP10K, &c.y), FU_EINVAL); /* 24 % 16 */
    const kern_rope_params negative = {.theta = -1.0f};
    assert_int_equal(kern_rope_forward(CPU, &c.x, &c.pos, 8, &negative, &c.y), FU_EINVAL);
    kern_tensor_t p4 = tk_i1(pos, 4);
    assert_int_equal(kern_rope_forward(CPU, &c.x, &p4, 8, &RP10K, &c.y), FU_EINVAL);
    free(x), free(y), free(xi), free(R), free(dx);
}

/* ---- SwiGLU, add, axpy ---- */

typedef struct {
    kern_tensor_t g, u, o;
} swi_ctx;

static void swi_fwd(void *c)
{
    swi_ctx *s = c;
    assert_int_equal(kern_silu_mul_forward(CPU, &s->g, &s->u, &s->o), FU_OK);
}

static void test_kern_ops_silu_mul_and_add(void **state)
{
    (void)state;
    const int64_t n = 3, f = 7;
    const size_t N = (size_t)(n * f);
    float *g = tk_rand(N, 50, -4, 4), *u = tk_rand(N, 51, -2, 2), *o = tk_zeros(N), *R = tk_rand(N, 52, -1, 1);
    swi_ctx c = {tk_f2(g, n, f), tk_f2(u, n, f), tk_f2(o, n, f)};
    swi_fwd(&c);
    double ref[21];
    for (size_t i = 0; i < N; i++)
        ref[i] = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
    assert_true(tk_close_ratio(o, ref, N, 1e-6, 1e-5) <= 1.0);
    float *dg = tk_zeros(N), *du = tk_zeros(N);
    kern_tensor_t dO = tk_f2(R, n, f), dG = tk_f2(dg, n, f), dU = tk_f2(du, n, f);
    assert_int_equal(kern_silu_mul_backward(CPU, &dO, &c.g, &c.u, &dG, &dU), FU_OK);
    assert_true(tk_grad_check(swi_fwd, &c, g, N, dg, o, R, N, 1e-3f, FD_ATOL, FD_RTOL, 64) <= 1.0);
    assert_true(tk_grad_check(swi_fwd, &c, u, N, du, o, R, N, 1e-3f, FD_ATOL, FD_RTOL, 64) <= 1.0);
    assert_int_equal(kern_silu_mul_backward(CPU, &dO, &c.g, &c.u, &dG, &dG), FU_EINVAL);
    /* residual add (in place) and axpy */
    float *a = tk_dup(g, N);
    kern_tensor_t A = tk_f2(a, n, f);
    assert_int_equal(kern_add_forward(CPU, &A, &c.u, &A), FU_OK);
    for (size_t i = 0; i < N; i++)
        assert_float_equal(a[i], g[i] + u[i], 1e-6);
    assert_int_equal(kern_axpy(CPU, -1.0f, &c.u, &A), FU_OK);
    for (size_t i = 0; i < N; i++)
        assert_float_equal(a[i], g[i], 1e-5);
    kern_tensor_t short_t = tk_f2(u, n, f - 1);
    assert_int_equal(kern_add_forward(CPU, &A, &short_t, &A), FU_EINVAL);
    assert_int_equal(kern_silu_mul_forward(CPU, &c.g, &short_t, &c.o), FU_EINVAL);
    free(g), free(u), free(o), free(R), free(dg), free(du), free(a);
}

/* ---- cross-entropy ---- */

typedef struct {
    kern_tensor_t logits, targets;
    float loss;
} xent_ctx;

static void xent_fwd(void *c)
{
    xent_ctx *x = c;
    int64_t nv;
    assert_int_equal(kern_xent_forward(CPU, &x->logits, &x->targets, -100, &x->loss, &nv), FU_OK);
}

static void test_kern_ops_xent_value_grad_and_ignore(void **state)
{
    (void)state;
    const int64_t n = 4, V = 6;
    float *l = tk_rand((size_t)(n * V), 60, -3, 3);
    int32_t t[4] = {2, -100, 5, 0};
    xent_ctx c = {tk_f2(l, n, V), tk_i1(t, n), 0};
    int64_t nv = 0;
    assert_int_equal(kern_xent_forward(CPU, &c.logits, &c.targets, -100, &c.loss, &nv), FU_OK);
    assert_int_equal(nv, 3);
    double ref = 0;
    for (int64_t i = 0; i < n; i++) {
        if (t[i] == -100)
            continue;
        double s = 0;
        for (int64_t j = 0; j < V; j++)
            s += exp((double)l[i * V + j]);
        ref += log(s) - l[i * V + t[i]];
    }
    ref /= 3;
    assert_float_equal(c.loss, ref, 1e-5);
    float *dl = tk_zeros((size_t)(n * V));
    kern_tensor_t DL = tk_f2(dl, n, V);
    assert_int_equal(kern_xent_backward(CPU, &c.logits, &c.targets, -100, 1.0f, &DL), FU_OK);
    for (int64_t j = 0; j < V; j++)
        assert_float_equal(dl[1 * V + j], 0.0f, 0); /* ignored row */
    /* FD on the scalar loss: out = &loss, R = {1} */
    float one = 1.0f;
    assert_true(tk_grad_check(xent_fwd, &c, l, (size_t)(n * V), dl, &c.loss, &one, 1, 1e-2f, 1e-3, 1e-2, 64) <= 1.0);
    /* in place with a grad scale */
    float *lp = tk_dup(l, (size_t)(n * V));
    kern_tensor_t LP = tk_f2(lp, n, V);
    assert_int_equal(kern_xent_backward(CPU, &LP, &c.targets, -100, 0.5f, &LP), FU_OK);
    for (int64_t i = 0; i < n * V; i++)
        assert_float_equal(lp[i], 0.5f * dl[i], 1e-6);
    /* fused forward+backward: same loss and gradient, in place too, and through the fallback */
    {
        float fl = 0, fl2 = 0, fl3 = 0;
        int64_t fn = 0;
        float *fg = tk_zeros((size_t)(n * V)), *li = tk_dup(l, (size_t)(n * V)), *fg3 = tk_zeros((size_t)(n * V));
        kern_tensor_t FG = tk_f2(fg, n, V), LI = tk_f2(li, n, V), FG3 = tk_f2(fg3, n, V);
        assert_int_equal(kern_xent_forward_backward(CPU, &c.logits, &c.targets, -100, 1.0f, &fl, &fn, &FG), FU_OK);
        assert_int_equal(fn, 3);
        assert_float_equal(fl, c.loss, 1e-6);
        assert_memory_equal(fg, dl, (size_t)(n * V) * sizeof(float));
        assert_int_equal(kern_xent_forward_backward(CPU, &LI, &c.targets, -100, 1.0f, &fl2, &fn, &LI), FU_OK);
        assert_float_equal(fl2, c.loss, 1e-6);
        assert_memory_equal(li, dl, (size_t)(n * V) * sizeof(float));
        kern_backend_t nofuse = *CPU;
        nofuse.xent_fused = NULL;
        assert_int_equal(kern_xent_forward_backward(&nofuse, &c.logits, &c.targets, -100, 1.0f, &fl3, &fn, &FG3), FU_OK);
        assert_float_equal(fl3, c.loss, 1e-6);
        assert_memory_equal(fg3, dl, (size_t)(n * V) * sizeof(float));
        assert_int_equal(kern_xent_forward_backward(CPU, &c.logits, &c.targets, -100, 1.0f, NULL, &fn, &FG), FU_EINVAL);
        kern_tensor_t FGs = tk_f2(fg, n, V - 1);
        assert_int_equal(kern_xent_forward_backward(CPU, &c.logits, &c.targets, -100, 1.0f, &fl, &fn, &FGs), FU_EINVAL);
        free(fg), free(li), free(fg3);
    }
    /* everything ignored: loss 0, no division by zero */
    int32_t all_ign[4] = {-100, -100, -100, -100};
    kern_tensor_t TI = tk_i1(all_ign, n);
    float loss = -1;
    assert_int_equal(kern_xent_forward(CPU, &c.logits, &TI, -100, &loss, &nv), FU_OK);
    assert_int_equal(nv, 0);
    assert_float_equal(loss, 0.0f, 0);
    assert_int_equal(kern_xent_backward(CPU, &c.logits, &TI, -100, 1.0f, &DL), FU_OK);
    for (int64_t i = 0; i < n * V; i++)
        assert_float_equal(dl[i], 0.0f, 0);
    /* bad targets, shapes, dtypes */
    int32_t bad[4] = {0, 6, 0, 0};
    kern_tensor_t TB = tk_i1(bad, n);
    assert_int_equal(kern_xent_forward(CPU, &c.logits, &TB, -100, &loss, &nv), FU_EINVAL);
    assert_int_equal(kern_xent_backward(CPU, &c.logits, &TB, -100, 1.0f, &DL), FU_EINVAL);
    kern_tensor_t T3 = tk_i1(t, 3);
    assert_int_equal(kern_xent_forward(CPU, &c.logits, &T3, -100, &loss, &nv), FU_EINVAL);
    assert_int_equal(kern_xent_forward(CPU, &c.logits, &c.targets, -100, NULL, &nv), FU_EINVAL);
    kern_tensor_t Lh = tk_t(l, KERN_F16, 2, n, V, 1);
    assert_int_equal(kern_xent_forward(CPU, &Lh, &c.targets, -100, &loss, &nv), FU_EINVAL);
    free(l), free(dl), free(lp);
}

/* ---- AdamW ---- */

static void test_kern_ops_adamw_matches_hand_computation(void **state)
{
    (void)state;
    float p[3] = {1.0f, -2.0f, 0.5f}, g[3] = {0.1f, -0.3f, 0.0f}, m[3] = {0}, v[3] = {0};
    double P[3] = {1.0, -2.0, 0.5}, M[3] = {0}, Vv[3] = {0};
    const kern_adamw_params hp = {.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f};
    kern_tensor_t Pt = tk_f1(p, 3), Gt = tk_f1(g, 3), Mt = tk_f1(m, 3), Vt = tk_f1(v, 3);
    for (int64_t step = 1; step <= 3; step++) {
        assert_int_equal(kern_adamw_step(CPU, &Pt, &Gt, &Mt, &Vt, &hp, step), FU_OK);
        for (int i = 0; i < 3; i++) {
            P[i] *= 1.0 - 0.01 * 0.1;
            M[i] = 0.9 * M[i] + 0.1 * g[i];
            Vv[i] = 0.999 * Vv[i] + 0.001 * (double)g[i] * g[i];
            double mh = M[i] / (1 - pow(0.9, (double)step)), vh = Vv[i] / (1 - pow(0.999, (double)step));
            P[i] -= 0.01 * mh / (sqrt(vh) + 1e-8);
        }
    }
    assert_true(tk_close_ratio(p, P, 3, 1e-6, 1e-5) <= 1.0);
    /* the first step moves each parameter with a non-zero gradient by about lr (plus decay) */
    assert_float_equal(p[2], (float)(0.5 * pow(1 - 0.001, 3)), 1e-6);
    assert_int_equal(kern_adamw_step(CPU, &Pt, &Gt, &Mt, &Vt, &hp, 0), FU_EINVAL);
    kern_adamw_params bad = hp;
    bad.beta1 = 1.0f;
    assert_int_equal(kern_adamw_step(CPU, &Pt, &Gt, &Mt, &Vt, &bad, 1), FU_EINVAL);
    bad = hp;
    bad.eps = 0.0f;
    assert_int_equal(kern_adamw_step(CPU, &Pt, &Gt, &Mt, &Vt, &bad, 1), FU_EINVAL);
    kern_tensor_t G2 = tk_f1(g, 2);
    assert_int_equal(kern_adamw_step(CPU, &Pt, &G2, &Mt, &Vt, &hp, 1), FU_EINVAL);
    assert_int_equal(kern_adamw_step(CPU, &Pt, &Gt, &Mt, &Mt, &hp, 1), FU_EINVAL); /* m aliases v */
    assert_int_equal(kern_adamw_step(CPU, &Pt, &Gt, &Mt, &Vt, NULL, 1), FU_EINVAL);
}

/* ---- sampling ---- */

static void test_kern_ops_sampling_rules(void **state)
{
    (void)state;
    const int64_t V = 10;
    float l[2 * 10];
    for (int i = 0; i < 20; i++)
        l[i] = (float)((i * 7) % 10) * 0.3f; /* row 0 argmax at 7 (7*7%10=9) */
    kern_tensor_t L = tk_f2(l, 2, V), L1 = tk_f1(l, V);
    int32_t out[2];
    kern_sample_params greedy = {.temperature = 0.0f};
    assert_int_equal(kern_sample(CPU, &L, &greedy, 0, out), FU_OK);
    assert_int_equal(out[0], 7);
    assert_int_equal(out[1], 7);
    /* top_k = 1 is greedy whatever the temperature */
    kern_sample_params k1 = {.temperature = 5.0f, .top_k = 1, .top_p = 1.0f, .seed = 9};
    for (uint64_t ctr = 0; ctr < 50; ctr++) {
        assert_int_equal(kern_sample(CPU, &L1, &k1, ctr, out), FU_OK);
        assert_int_equal(out[0], 7);
    }
    /* same seed and counter, same token; different seeds differ somewhere */
    kern_sample_params t1 = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 42};
    kern_sample_params t2 = t1;
    t2.seed = 43;
    int diff = 0, seen[10] = {0};
    for (uint64_t ctr = 0; ctr < 200; ctr++) {
        int32_t a, b, c;
        assert_int_equal(kern_sample(CPU, &L1, &t1, ctr, &a), FU_OK);
        assert_int_equal(kern_sample(CPU, &L1, &t1, ctr, &b), FU_OK);
        assert_int_equal(kern_sample(CPU, &L1, &t2, ctr, &c), FU_OK);
        assert_int_equal(a, b);
        assert_true(a >= 0 && a < V);
        diff += a != c;
        seen[a]++;
    }
    assert_true(diff > 20);
    assert_true(seen[7] > seen[0]); /* logit 2.7 vs 0: far more likely */
    /* top-k = 3 keeps only the 3 largest logits (ids 7, 4, 1: values 2.7, 2.4, 2.1) */
    kern_sample_params k3 = {.temperature = 1.0f, .top_k = 3, .top_p = 1.0f, .seed = 1};
    int hits[10] = {0};
    for (uint64_t ctr = 0; ctr < 300; ctr++) {
        assert_int_equal(kern_sample(CPU, &L1, &k3, ctr, out), FU_OK);
        hits[out[0]]++;
    }
    assert_true(hits[7] > 0 && hits[4] > 0 && hits[1] > 0);
    assert_int_equal(hits[7] + hits[4] + hits[1], 300);
    /* top-p: probabilities 0.5, 0.3, 0.15, 0.05 -> top_p 0.7 keeps the first two only */
    float lp[4] = {logf(0.15f), logf(0.5f), logf(0.05f), logf(0.3f)};
    kern_tensor_t LP = tk_f1(lp, 4);
    kern_sample_params pp = {.temperature = 1.0f, .top_k = 0, .top_p = 0.7f, .seed = 3};
    int ph[4] = {0};
    for (uint64_t ctr = 0; ctr < 400; ctr++) {
        assert_int_equal(kern_sample(CPU, &LP, &pp, ctr, out), FU_OK);
        ph[out[0]]++;
    }
    assert_int_equal(ph[0] + ph[2], 0);
    assert_true(ph[1] > ph[3] && ph[3] > 50);
    /* top_p tiny keeps the best one */
    pp.top_p = 0.01f;
    assert_int_equal(kern_sample(CPU, &LP, &pp, 5, out), FU_OK);
    assert_int_equal(out[0], 1);
    /* invalid */
    kern_sample_params badk = {.temperature = 1.0f, .top_k = -1};
    assert_int_equal(kern_sample(CPU, &L1, &badk, 0, out), FU_EINVAL);
    assert_int_equal(kern_sample(CPU, &L1, &greedy, 0, NULL), FU_EINVAL);
    kern_tensor_t Li = tk_t(l, KERN_I32, 1, V, 1, 1);
    assert_int_equal(kern_sample(CPU, &Li, &greedy, 0, out), FU_EINVAL);
}

/* ---- threaded paths agree with the serial ones ----
 * Every op runs once on one thread and once on three threads with the split threshold at 0, so
 * each OpenMP region really splits even these small inputs. */

enum { TH_NR = 37, TH_D = 300, TH_V = 1000, TH_VOC = 16, TH_HD = 10 };

typedef struct { /* outputs of one run */
    float *norm, *ndx, *ndw, *dt, *emb, *xg, *xg2, *sm, *sgd, *sud, *rope, *add, *p, *m, *v;
    float loss, loss2;
} th_run;

static void th_alloc(th_run *r)
{
    size_t nd = (size_t)TH_NR * TH_D, nv = (size_t)TH_NR * TH_V;
    r->norm = tk_zeros(nd), r->ndx = tk_zeros(nd), r->ndw = tk_zeros(TH_D), r->dt = tk_zeros((size_t)TH_VOC * TH_D);
    r->emb = tk_zeros(nd), r->xg = tk_zeros(nv), r->xg2 = tk_zeros(nv), r->sm = tk_zeros(nd), r->sgd = tk_zeros(nd);
    r->sud = tk_zeros(nd), r->rope = tk_zeros(nd), r->add = tk_zeros(nd), r->p = tk_zeros(nd), r->m = tk_zeros(nd);
    r->v = tk_zeros(nd);
}

static void th_ops(th_run *r, const float *x, const float *w, const float *g, const float *u, const float *logits,
                   const int32_t *ids, const float *tab)
{
    kern_tensor_t X = tk_f2((float *)x, TH_NR, TH_D), W = tk_f1((float *)w, TH_D);
    kern_tensor_t G = tk_f2((float *)g, TH_NR, TH_D), U = tk_f2((float *)u, TH_NR, TH_D);
    kern_tensor_t I = tk_i1((int32_t *)ids, TH_NR), T = tk_f2((float *)tab, TH_VOC, TH_D);
    kern_tensor_t Y = tk_f2(r->norm, TH_NR, TH_D), DX = tk_f2(r->ndx, TH_NR, TH_D), DW = tk_f1(r->ndw, TH_D);
    assert_int_equal(kern_rmsnorm_forward(CPU, &X, &W, 1e-6f, &Y), FU_OK);
    assert_int_equal(kern_rmsnorm_backward(CPU, &G, &X, &W, 1e-6f, &DX, &DW), FU_OK);
    kern_tensor_t E = tk_f2(r->emb, TH_NR, TH_D), DT = tk_f2(r->dt, TH_VOC, TH_D);
    assert_int_equal(kern_embedding_forward(CPU, &I, &T, &E), FU_OK);
    assert_int_equal(kern_embedding_backward(CPU, &I, &G, &DT), FU_OK);
    kern_tensor_t L = tk_f2((float *)logits, TH_NR, TH_V), LG = tk_f2(r->xg, TH_NR, TH_V), LG2 = tk_f2(r->xg2, TH_NR, TH_V);
    int64_t nv;
    assert_int_equal(kern_xent_forward(CPU, &L, &I, 3, &r->loss, &nv), FU_OK);
    assert_int_equal(kern_xent_backward(CPU, &L, &I, 3, 1.0f, &LG), FU_OK);
    assert_int_equal(kern_xent_forward_backward(CPU, &L, &I, 3, 1.0f, &r->loss2, &nv, &LG2), FU_OK);
    kern_tensor_t SM = tk_f2(r->sm, TH_NR, TH_D), SG = tk_f2(r->sgd, TH_NR, TH_D), SU = tk_f2(r->sud, TH_NR, TH_D);
    assert_int_equal(kern_silu_mul_forward(CPU, &G, &U, &SM), FU_OK);
    assert_int_equal(kern_silu_mul_backward(CPU, &X, &G, &U, &SG, &SU), FU_OK);
    kern_tensor_t RO = tk_f2(r->rope, TH_NR, TH_D);
    assert_int_equal(kern_rope_forward(CPU, &X, &I, TH_HD, &RP10K, &RO), FU_OK);
    kern_tensor_t AD = tk_f2(r->add, TH_NR, TH_D);
    assert_int_equal(kern_add_forward(CPU, &X, &G, &AD), FU_OK);
    assert_int_equal(kern_axpy(CPU, 0.5f, &U, &AD), FU_OK);
    memcpy(r->p, x, sizeof(float) * TH_NR * TH_D);
    kern_tensor_t P = tk_f2(r->p, TH_NR, TH_D), M = tk_f2(r->m, TH_NR, TH_D), V = tk_f2(r->v, TH_NR, TH_D);
    kern_adamw_params hp = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};
    assert_int_equal(kern_adamw_step(CPU, &P, &G, &M, &V, &hp, 1), FU_OK);
    assert_int_equal(kern_adamw_step(CPU, &P, &U, &M, &V, &hp, 2), FU_OK);
}

static void test_kern_ops_threads_match_serial(void **state)
{
    (void)state;
    size_t nd = (size_t)TH_NR * TH_D;
    float *x = tk_rand(nd, 70, -1, 1), *w = tk_rand(TH_D, 71, 0.5f, 1.5f), *g = tk_rand(nd, 72, -3, 3);
    float *u = tk_rand(nd, 73, -1, 1), *logits = tk_rand((size_t)TH_NR * TH_V, 74, -5, 5);
    float *tab = tk_rand((size_t)TH_VOC * TH_D, 75, -1, 1);
    int32_t ids[TH_NR];
    for (int i = 0; i < TH_NR; i++)
        ids[i] = (i * 7) % TH_VOC; /* repeated ids: scatter-add races would show; id 3 is also ignored by xent */
    th_run a, b;
    th_alloc(&a);
    th_alloc(&b);
    int64_t par0 = kern_cpu_par_min();
    assert_int_equal(kern_cpu_set_threads(1), FU_OK);
    assert_int_equal(kern_cpu_threads(), 1);
    th_ops(&a, x, w, g, u, logits, ids, tab);
    assert_int_equal(kern_cpu_set_threads(3), FU_OK);
    kern_cpu_set_par_min(0);
    th_ops(&b, x, w, g, u, logits, ids, tab);
    kern_cpu_set_par_min(par0);
    assert_int_equal(kern_cpu_set_threads(0), FU_OK);
    assert_int_equal(kern_cpu_set_threads(-1), FU_EINVAL);
    float *pa[] = {a.norm, a.ndx, a.ndw, a.dt, a.emb, a.xg, a.xg2, a.sm, a.sgd, a.sud, a.rope, a.add, a.p, a.m, a.v};
    float *pb[] = {b.norm, b.ndx, b.ndw, b.dt, b.emb, b.xg, b.xg2, b.sm, b.sgd, b.sud, b.rope, b.add, b.p, b.m, b.v};
    size_t sz[] = {nd, nd, TH_D, (size_t)TH_VOC * TH_D, nd, (size_t)TH_NR * TH_V, (size_t)TH_NR * TH_V,
                   nd, nd, nd, nd, nd, nd, nd, nd};
    /* per-row (or per-column) work is identical whatever the split */
    for (size_t i = 0; i < sizeof sz / sizeof sz[0]; i++) {
        assert_memory_equal(pa[i], pb[i], sz[i] * sizeof(float));
        free(pa[i]);
        free(pb[i]);
    }
    /* the loss sums too: rows are added in order, not per thread */
    assert_memory_equal(&a.loss, &b.loss, sizeof a.loss);
    assert_memory_equal(&a.loss2, &b.loss2, sizeof a.loss2);
    assert_float_equal(a.loss, a.loss2, 1e-6 * fabsf(a.loss));
    free(x), free(w), free(g), free(u), free(logits), free(tab);
}

/* A frozen narrow weight as B (bf16, f16 and per-row int8, the CPU's weight_dtypes): the product
 * has exactly the bits of the same product on B widened to f32 first, on every path kern_cpu_sgemm
 * takes (decode gemv over several blocks, tiles shared by rows or by columns, B transposed or not), on
 * 1 and 3 threads. An int8 weight without row scales, and a gradient for a narrow weight, are
 * refused. */
static void test_kern_ops_gemm_narrow_weight_equals_widened(void **state)
{
    (void)state;
    static const struct {
        int m, n, k;
        bool tb;
    } shapes[] = {{1, 1100, 300, true},  {300, 600, 70, true},   {5, 3, 40, false},     {1, 700, 130, false},
                  {260, 520, 33, false}, {200, 1100, 300, true}, {600, 768, 200, false}};
    static const kern_dtype dts[] = {KERN_BF16, KERN_F16, KERN_I8};
    for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const kern_dtype dt = dts[di];
            int m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
            bool tb = shapes[si].tb;
            int64_t br = tb ? n : k, bc = tb ? k : n;
            float *a = tk_rand((size_t)m * k, 300 + si, -1, 1), *bw = tk_rand((size_t)k * n, 310 + si, -1, 1);
            float *scale = tk_rand((size_t)br, 330 + si, 0.001f, 0.02f);
            uint16_t *b16 = malloc((size_t)k * n * sizeof *b16);
            int8_t *b8 = malloc((size_t)k * n);
            for (size_t q = 0; q < (size_t)k * n; q++) { /* the narrow values, and bw their exact widening */
                if (dt == KERN_I8) {
                    b8[q] = (int8_t)lrintf(bw[q] * 127.0f);
                    bw[q] = (float)b8[q] * scale[q / (size_t)bc];
                } else {
                    b16[q] = dt == KERN_BF16 ? kern_f32_to_bf16(bw[q]) : kern_f32_to_f16(bw[q]);
                    bw[q] = dt == KERN_BF16 ? kern_bf16_to_f32(b16[q]) : kern_f16_to_f32(b16[q]);
                }
            }
            kern_tensor_t A = tk_f2(a, m, k), B32 = tk_f2(bw, br, bc);
            kern_tensor_t BN = tk_t(dt == KERN_I8 ? (void *)b8 : (void *)b16, dt, 2, br, bc, 1);
            if (dt == KERN_I8) {
                float *c = tk_zeros((size_t)m * n);
                kern_tensor_t C = tk_f2(c, m, n);
                assert_int_equal(kern_gemm(CPU, false, tb, 1.0f, &A, &BN, 0.0f, &C), FU_EINVAL); /* no scales */
                BN.qscale = scale;
                free(c);
            }
            for (int th = 1; th <= 3; th += 2) {
                assert_int_equal(kern_cpu_set_threads(th), FU_OK);
                float *c32 = tk_zeros((size_t)m * n), *cn = tk_zeros((size_t)m * n);
                kern_tensor_t C32 = tk_f2(c32, m, n), CN = tk_f2(cn, m, n);
                assert_int_equal(kern_gemm(CPU, false, tb, 1.0f, &A, &B32, 0.0f, &C32), FU_OK);
                assert_int_equal(kern_gemm(CPU, false, tb, 1.0f, &A, &BN, 0.0f, &CN), FU_OK);
                if (memcmp(c32, cn, (size_t)m * n * sizeof(float)) != 0)
                    fail_msg("%s, %dx%dx%d tb %d, %d threads: bits differ", kern_dtype_name(dt), m, n, k, tb, th);
                free(c32), free(cn);
            }
            kern_tensor_t dW = tk_f2(bw, br, bc);
            if (tb) { /* y = x·Wᵀ: a narrow W takes no gradient */
                float *dy = tk_rand((size_t)m * n, 320, -1, 1), *dx = tk_zeros((size_t)m * k);
                kern_tensor_t DY = tk_f2(dy, m, n), DX = tk_f2(dx, m, k);
                assert_int_equal(kern_linear_backward(CPU, &DY, &A, &BN, &DX, NULL), FU_OK);
                assert_int_equal(kern_linear_backward(CPU, &DY, &A, &BN, &DX, &dW), FU_EINVAL);
                free(dy), free(dx);
            }
            if (dt == KERN_I8) { /* an int8 embedding table: each row widened with its scale */
                int32_t ids[3] = {0, (int32_t)br - 1, (int32_t)(br / 2)};
                float *rows = tk_zeros((size_t)3 * bc);
                kern_tensor_t IDS = tk_t(ids, KERN_I32, 1, 3, 1, 1), R = tk_f2(rows, 3, bc);
                assert_int_equal(kern_embedding_forward(CPU, &IDS, &BN, &R), FU_OK);
                for (int i = 0; i < 3; i++)
                    assert_memory_equal(rows + (size_t)i * bc, bw + (size_t)ids[i] * bc, (size_t)bc * sizeof(float));
                kern_tensor_t half;
                assert_int_equal(kern_tensor_slice(&BN, 0, 1, br - 1, &half), FU_OK); /* scales follow rows */
                assert_ptr_equal(half.qscale, scale + 1);
                free(rows);
            }
            free(a), free(bw), free(b16), free(b8), free(scale);
        }
    assert_int_equal(kern_cpu_set_threads(0), FU_OK);
}

/* GEMMs give the same bits for 1, 2, 3 and 5 threads (OpenBLAS alone does not: PITFALLS), on
 * shapes with partial tiles on both sides, every transpose, beta 0 and 1, and both vector cases
 * (each past the size where the work is split). */
static void test_kern_ops_gemm_same_bits_any_threads(void **state)
{
    (void)state;
    static const struct {
        int m, n, k;
    } shapes[] = {{300, 520, 700}, {8, 1030, 512}, {777, 9, 4096}, {1, 4100, 1024}, {3000, 1, 1024}, {129, 257, 64}};
    static const int threads[] = {2, 3, 5};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int m = shapes[si].m, n = shapes[si].n, k = shapes[si].k;
        float *a = tk_rand((size_t)m * k, 80 + si, -1, 1), *b = tk_rand((size_t)k * n, 90 + si, -1, 1);
        float *c0 = tk_rand((size_t)m * n, 100 + si, -1, 1);
        float *ref = malloc(sizeof(float) * (size_t)m * n), *got = malloc(sizeof(float) * (size_t)m * n);
        for (int v = 0; v < 8; v++) {
            bool ta = v & 1, tb = v & 2;
            float beta = (v & 4) ? 1.0f : 0.0f;
            kern_tensor_t A = ta ? tk_f2(a, k, m) : tk_f2(a, m, k), B = tb ? tk_f2(b, n, k) : tk_f2(b, k, n);
            kern_tensor_t R = tk_f2(ref, m, n), G = tk_f2(got, m, n);
            memcpy(ref, c0, sizeof(float) * (size_t)m * n);
            assert_int_equal(kern_cpu_set_threads(1), FU_OK);
            assert_int_equal(kern_gemm(CPU, ta, tb, 0.75f, &A, &B, beta, &R), FU_OK);
            for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++) {
                memcpy(got, c0, sizeof(float) * (size_t)m * n);
                assert_int_equal(kern_cpu_set_threads(threads[ti]), FU_OK);
                assert_int_equal(kern_gemm(CPU, ta, tb, 0.75f, &A, &B, beta, &G), FU_OK);
                if (memcmp(ref, got, sizeof(float) * (size_t)m * n) != 0)
                    fail_msg("gemm %dx%dx%d ta=%d tb=%d beta=%g: %d threads differ from 1", m, n, k, ta, tb,
                             (double)beta, threads[ti]);
            }
            /* and the product is right: one entry against a double-precision dot product */
            int i = m / 2, j = n - 1;
            double d = beta * c0[(size_t)i * n + j];
            for (int p = 0; p < k; p++)
                d += 0.75 * (ta ? a[(size_t)p * m + i] : a[(size_t)i * k + p]) *
                     (tb ? b[(size_t)j * k + p] : b[(size_t)p * n + j]);
            assert_true(fabs((double)ref[(size_t)i * n + j] - d) <= 1e-4 * (1 + fabs(d)));
        }
        free(a), free(b), free(c0), free(ref), free(got);
    }
    assert_int_equal(kern_cpu_set_threads(0), FU_OK);
}

/* ---- bad arguments never crash ---- */

static void test_kern_ops_bad_arguments_return_einval(void **state)
{
    (void)state;
    float a[16] = {0}, b[16] = {0}, c[16] = {0};
    kern_tensor_t A = tk_f2(a, 2, 3), B = tk_f2(b, 4, 3), C = tk_f2(c, 2, 4);
    assert_int_equal(kern_gemm(CPU, false, true, 1, &A, &B, 0, &C), FU_OK);
    assert_int_equal(kern_gemm(CPU, false, false, 1, &A, &B, 0, &C), FU_EINVAL); /* inner dims */
    assert_int_equal(kern_gemm(CPU, false, true, 1, &A, &B, 0, &A), FU_EINVAL);  /* out shape */
    assert_int_equal(kern_gemm(CPU, false, true, NAN, &A, &B, 0, &C), FU_EINVAL);
    assert_int_equal(kern_gemm(CPU, false, true, 1, NULL, &B, 0, &C), FU_EINVAL);
    assert_int_equal(kern_gemm(NULL, false, true, 1, &A, &B, 0, &C), FU_EINVAL);
    kern_tensor_t Ai = tk_t(a, KERN_I32, 2, 2, 3, 1);
    assert_int_equal(kern_gemm(CPU, false, true, 1, &Ai, &B, 0, &C), FU_EINVAL);
    kern_tensor_t A3 = tk_t(a, KERN_F32, 3, 2, 3, 1);
    assert_int_equal(kern_gemm(CPU, false, true, 1, &A3, &B, 0, &C), FU_EINVAL);
    kern_tensor_t Ag = A;
    Ag.device.kind = KERN_DEV_CUDA;
    assert_int_equal(kern_gemm(CPU, false, true, 1, &Ag, &B, 0, &C), FU_EINVAL);
    kern_tensor_t An = A;
    An.data = NULL;
    assert_int_equal(kern_gemm(CPU, false, true, 1, &An, &B, 0, &C), FU_EINVAL);
    kern_tensor_t Ax = A; /* corrupt descriptor */
    Ax.ndim = 9;
    assert_int_equal(kern_gemm(CPU, false, true, 1, &Ax, &B, 0, &C), FU_EINVAL);
    kern_tensor_t Ab = A;
    Ab.shape[0] = -4;
    assert_int_equal(kern_gemm(CPU, false, true, 1, &Ab, &B, 0, &C), FU_EINVAL);
    kern_tensor_t Ah = A; /* sizes whose byte count overflows */
    Ah.shape[0] = INT64_MAX / 2;
    Ah.shape[1] = 3;
    assert_int_equal(kern_gemm(CPU, false, true, 1, &Ah, &B, 0, &C), FU_EINVAL);
    assert_int_equal(kern_axpy(CPU, 1.0f, &Ah, &Ah), FU_EINVAL);
    kern_tensor_t At; /* transposed strides are not row-major */
    At = tk_f2(a, 3, 2);
    At.stride[0] = 1;
    At.stride[1] = 3;
    assert_int_equal(kern_gemm(CPU, true, true, 1, &At, &B, 0, &C), FU_EINVAL);
    assert_int_equal(kern_linear_forward(CPU, &A, &B, &B), FU_EINVAL);
    assert_int_equal(kern_add_forward(CPU, &A, &B, &C), FU_EINVAL);
    assert_int_equal(kern_axpy(CPU, 1.0f, &A, &C), FU_EINVAL);
    /* zero-sized tensors are fine */
    kern_tensor_t E0 = tk_t(NULL, KERN_F32, 2, 0, 3, 1), Y0 = tk_t(NULL, KERN_F32, 2, 0, 4, 1);
    assert_int_equal(kern_linear_forward(CPU, &E0, &B, &Y0), FU_OK);
}

/* The CPU backend's device: a name and the machine's memory. */
static void test_kern_ops_device_info(void **state)
{
    (void)state;
    kern_device_info di;
    assert_int_equal(kern_backend_device_info(kern_backend_cpu(), &di), FU_OK);
    assert_true(strncmp(di.name, "cpu", 3) == 0);
    assert_true(di.free_bytes > 0 && di.total_bytes >= di.free_bytes);
    assert_int_equal(kern_backend_device_info(NULL, &di), FU_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_ops_device_info),
        cmocka_unit_test(test_kern_ops_gemm_matches_reference),
        cmocka_unit_test(test_kern_ops_linear_backward_matches_fd),
        cmocka_unit_test(test_kern_ops_embedding_gather_and_scatter_add),
        cmocka_unit_test(test_kern_ops_rmsnorm_forward_and_backward),
        cmocka_unit_test(test_kern_ops_rope_matches_hf_formula),
        cmocka_unit_test(test_kern_ops_rope_llama3_frequencies),
        cmocka_unit_test(test_kern_ops_silu_mul_and_add),
        cmocka_unit_test(test_kern_ops_xent_value_grad_and_ignore),
        cmocka_unit_test(test_kern_ops_adamw_matches_hand_computation),
        cmocka_unit_test(test_kern_ops_sampling_rules),
        cmocka_unit_test(test_kern_ops_threads_match_serial),
        cmocka_unit_test(test_kern_ops_gemm_same_bits_any_threads),
        cmocka_unit_test(test_kern_ops_gemm_narrow_weight_equals_widened),
        cmocka_unit_test(test_kern_ops_bad_arguments_return_einval),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
