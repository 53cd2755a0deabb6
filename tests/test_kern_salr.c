/* Tests of kern_salr: exact pruning with deterministic ties, the SVD residual bound, the sparse
 * product against a dense reference (every ISA, batches 1..64, threads 1 and 2, accumulate, the
 * caller on each CPU in turn),
 * concatenated adapters against separate ones (forward and backward), and bad arguments. */
#define _GNU_SOURCE /* sched_setaffinity, sched_getcpu */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kern_bitmap.h"
#include "kern_salr.h"
#include "test_kern_util.h"

static const kern_simd_isa all_isas[] = {KERN_SIMD_SCALAR, KERN_SIMD_AVX2, KERN_SIMD_AVX512};

static uint64_t rng = 0x9e3779b97f4a7c15ULL; /* tk_xorshift state */
static float *rand_mat(size_t n)
{
    float *a = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        a[i] = tk_xorshift_unit(&rng);
    return a;
}

/* max |a - b| / max |b| (b the reference) */
static double rel_err(const float *a, const double *b, size_t n)
{
    double md = 0.0, mb = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        md = d > md ? d : md;
        mb = fabs(b[i]) > mb ? fabs(b[i]) : mb;
    }
    return mb > 0.0 ? md / mb : md;
}

/* ---- pruning ---------------------------------------------------------------------------------- */

static const float *cmp_base;
static int cmp_mag_index(const void *pa, const void *pb)
{
    size_t a = *(const size_t *)pa, b = *(const size_t *)pb;
    float  fa = fabsf(cmp_base[a]), fb = fabsf(cmp_base[b]);
    if (fa != fb)
        return fa > fb ? -1 : 1;
    return a < b ? -1 : (a > b);
}

/* Reference: sort indices by (|w| descending, index ascending), keep the first n_keep. */
static void check_prune(const float *w, size_t rows, size_t cols, double sparsity)
{
    size_t total = rows * cols;
    size_t *idx = malloc(total * sizeof(size_t));
    for (size_t i = 0; i < total; i++)
        idx[i] = i;
    cmp_base = w;
    qsort(idx, total, sizeof(size_t), cmp_mag_index);
    size_t n_keep = total - (size_t)floor(sparsity * (double)total + 0.5);
    char  *keep = calloc(total, 1);
    for (size_t i = 0; i < n_keep; i++)
        keep[idx[i]] = 1;

    float *ws = malloc(total * sizeof(float)), *res = malloc(total * sizeof(float));
    size_t kept = 0;
    assert_int_equal(kern_salr_prune(w, rows, cols, sparsity, ws, res, &kept), FU_OK);
    assert_int_equal(kept, n_keep);
    for (size_t i = 0; i < total; i++) {
        assert_true(ws[i] == (keep[i] ? w[i] : 0.0f));
        assert_true(res[i] == (keep[i] ? 0.0f : w[i]));
        assert_true(ws[i] + res[i] == w[i]);
    }
    /* in place gives the same */
    float *inplace = malloc(total * sizeof(float));
    memcpy(inplace, w, total * sizeof(float));
    assert_int_equal(kern_salr_prune(inplace, rows, cols, sparsity, inplace, NULL, NULL), FU_OK);
    assert_memory_equal(inplace, ws, total * sizeof(float));
    TK_FREE_ALL(inplace, ws, res, keep, idx);
}

static void test_kern_salr_prune_exact_sparsity_and_ties(void **state)
{
    (void)state;
    /* many ties: magnitudes from a small set, both signs */
    size_t rows = 37, cols = 53;
    float *w = malloc(rows * cols * sizeof(float));
    for (size_t i = 0; i < rows * cols; i++)
        w[i] = (float)(int)(tk_xorshift(&rng) % 7) * ((tk_xorshift(&rng) & 1) ? 1.0f : -1.0f);
    static const double sp[] = {0.0, 0.5, 0.3, 0.77, 1.0, 0.999, 0.001};
    for (size_t k = 0; k < sizeof sp / sizeof sp[0]; k++)
        check_prune(w, rows, cols, sp[k]);
    /* all equal: the lower indices win */
    for (size_t i = 0; i < rows * cols; i++)
        w[i] = (i & 1) ? -2.5f : 2.5f;
    check_prune(w, rows, cols, 0.5);
    float *ws = malloc(rows * cols * sizeof(float));
    assert_int_equal(kern_salr_prune(w, rows, cols, 0.5, ws, NULL, NULL), FU_OK);
    size_t n_keep = rows * cols - (size_t)floor(0.5 * (double)(rows * cols) + 0.5);
    for (size_t i = 0; i < rows * cols; i++)
        assert_true((ws[i] != 0.0f) == (i < n_keep));
    /* continuous values, odd total, infinities and signed zeros */
    free(w);
    w = rand_mat(rows * cols);
    w[5] = INFINITY;
    w[6] = -INFINITY;
    w[7] = -0.0f;
    w[8] = 0.0f;
    check_prune(w, rows, cols, 0.5);
    check_prune(w, 1, 1, 0.5);
    free(ws);
    free(w);
}

static void test_kern_salr_prune_bad_args(void **state)
{
    (void)state;
    float w[6] = {1, 2, 3, 4, 5, 6}, o[6], r[6];
    assert_int_equal(kern_salr_prune(NULL, 2, 3, 0.5, o, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, 2, 3, 0.5, NULL, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, 0, 3, 0.5, o, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, 2, 0, 0.5, o, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, 2, 3, -0.1, o, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, 2, 3, 1.5, o, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, 2, 3, NAN, o, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, SIZE_MAX, 3, 0.5, o, r, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_prune(w, 2, 3, 0.5, o, w, NULL), FU_EINVAL);
    w[4] = NAN;
    assert_int_equal(kern_salr_prune(w, 2, 3, 0.5, o, r, NULL), FU_EINVAL);
}

/* ---- SVD residual ------------------------------------------------------------------------------- */

/* ||R - B*A||_F^2 / ||R||_F^2 computed directly in double. */
static double direct_err(const float *r, size_t rows, size_t cols, size_t rank, const float *a, const float *b)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < rows; i++)
        for (size_t j = 0; j < cols; j++) {
            double s = 0.0;
            for (size_t k = 0; k < rank; k++)
                s += (double)b[i * rank + k] * (double)a[k * cols + j];
            double e = (double)r[i * cols + j] - s;
            num += e * e;
            den += (double)r[i * cols + j] * (double)r[i * cols + j];
        }
    return den > 0.0 ? num / den : 0.0;
}

static void check_svd(const float *r, size_t rows, size_t cols, size_t rank, kern_salr_svd_method m)
{
    float *a = malloc(rank * cols * sizeof(float)), *b = malloc(rows * rank * sizeof(float));
    double ratio = -1.0;
    assert_int_equal(kern_salr_svd(r, rows, cols, rank, m, 42, a, b, &ratio), FU_OK);
    double direct = direct_err(r, rows, cols, rank, a, b);
    double mn = (double)(rows < cols ? rows : cols);
    double bound = 1.0 - (double)rank / mn;
    assert_true(fabs(direct - ratio) < 1e-4);
    assert_true(direct <= bound * (1.0 + 1e-5) + 1e-9); /* the SALR invariant (float slack only) */
    free(a);
    free(b);
}

static void test_kern_salr_svd_bound(void **state)
{
    (void)state;
    /* the residual of a pruned random matrix, like SALR's R */
    size_t rows = 96, cols = 70;
    float *w = rand_mat(rows * cols), *ws = malloc(rows * cols * sizeof(float));
    float *res = malloc(rows * cols * sizeof(float));
    assert_int_equal(kern_salr_prune(w, rows, cols, 0.5, ws, res, NULL), FU_OK);
    static const size_t ranks[] = {1, 8, 16, 70};
    for (size_t k = 0; k < 4; k++) {
        check_svd(res, rows, cols, ranks[k], KERN_SALR_SVD_EXACT);
        check_svd(res, rows, cols, ranks[k], KERN_SALR_SVD_AUTO);
    }
    check_svd(res, cols, rows, 8, KERN_SALR_SVD_EXACT); /* wide as well as tall (reuse the data) */
    /* full rank reconstructs exactly */
    float *a = malloc(70 * cols * sizeof(float)), *b = malloc(rows * 70 * sizeof(float));
    double ratio;
    assert_int_equal(kern_salr_svd(res, rows, cols, 70, KERN_SALR_SVD_EXACT, 1, a, b, &ratio), FU_OK);
    assert_true(direct_err(res, rows, cols, 70, a, b) < 1e-9);
    /* all-zero residual */
    memset(res, 0, rows * cols * sizeof(float));
    assert_int_equal(kern_salr_svd(res, rows, cols, 4, KERN_SALR_SVD_AUTO, 1, a, b, &ratio), FU_OK);
    assert_true(ratio == 0.0);
    TK_FREE_ALL(a, b, w, ws, res);
}

static void test_kern_salr_svd_randomized(void **state)
{
    (void)state;
    /* decaying spectrum: R = sum_k 0.7^k u_k v_k^T + noise */
    size_t rows = 300, cols = 200, rank = 10;
    float *r = calloc(rows * cols, sizeof(float));
    for (int k = 0; k < 40; k++) {
        float *u = rand_mat(rows), *v = rand_mat(cols);
        float  s = powf(0.7f, (float)k);
        for (size_t i = 0; i < rows; i++)
            for (size_t j = 0; j < cols; j++)
                r[i * cols + j] += s * u[i] * v[j];
        free(u);
        free(v);
    }
    for (size_t i = 0; i < rows * cols; i++)
        r[i] += 0.001f * tk_xorshift_unit(&rng);
    check_svd(r, rows, cols, rank, KERN_SALR_SVD_RANDOMIZED);
    /* close to the exact optimum on a decaying spectrum */
    float *a = malloc(rank * cols * sizeof(float)), *b = malloc(rows * rank * sizeof(float));
    double re, ex;
    assert_int_equal(kern_salr_svd(r, rows, cols, rank, KERN_SALR_SVD_RANDOMIZED, 7, a, b, &re), FU_OK);
    assert_int_equal(kern_salr_svd(r, rows, cols, rank, KERN_SALR_SVD_EXACT, 7, a, b, &ex), FU_OK);
    assert_true(re <= ex * 1.05 + 1e-7);
    TK_FREE_ALL(a, b, r);

    /* AUTO on a big flat spectrum (a scaled permutation: all singular values equal) must still meet
     * the bound: the sketch cannot, so AUTO falls back to the exact SVD. */
    size_t n = KERN_SALR_SVD_EXACT_MAX_DIM + 16;
    float *p = calloc(n * n, sizeof(float));
    for (size_t i = 0; i < n; i++)
        p[i * n + (i * 7 + 3) % n] = 0.5f; /* 7 is coprime with 1040 */
    a = malloc(4 * n * sizeof(float));
    b = malloc(n * 4 * sizeof(float));
    double ratio;
    assert_int_equal(kern_salr_svd(p, n, n, 4, KERN_SALR_SVD_AUTO, 3, a, b, &ratio), FU_OK);
    assert_true(ratio <= (1.0 - 4.0 / (double)n) * (1.0 + 1e-5));
    TK_FREE_ALL(a, b, p);
}

static void test_kern_salr_svd_bad_args(void **state)
{
    (void)state;
    float r[12] = {1}, a[12], b[12];
    assert_int_equal(kern_salr_svd(NULL, 3, 4, 1, KERN_SALR_SVD_AUTO, 0, a, b, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_svd(r, 3, 4, 0, KERN_SALR_SVD_AUTO, 0, a, b, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_svd(r, 3, 4, 4, KERN_SALR_SVD_AUTO, 0, a, b, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_svd(r, 0, 4, 1, KERN_SALR_SVD_AUTO, 0, a, b, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_svd(r, 3, 4, 1, (kern_salr_svd_method)9, 0, a, b, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_svd(r, 3, 4, 1, KERN_SALR_SVD_AUTO, 0, NULL, b, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_svd(r, (size_t)1 << 40, 4, 1, KERN_SALR_SVD_AUTO, 0, a, b, NULL), FU_EINVAL);
}

/* ---- sparse x dense ------------------------------------------------------------------------------ */

static void check_spmm(size_t out, size_t in, size_t n, kern_bitmap_dtype dt)
{
    float *w = rand_mat(out * in), *ws = malloc(out * in * sizeof(float));
    assert_int_equal(kern_salr_prune(w, out, in, 0.5, ws, NULL, NULL), FU_OK);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(ws, out, in, in, dt, &bm), FU_OK);
    assert_int_equal(kern_bitmap_decode(bm, ws, in), FU_OK); /* the stored (maybe f16) values */
    float  *x = rand_mat(n * in), *y = malloc(n * out * sizeof(float)), *y0 = rand_mat(n * out);
    double *ref = malloc(n * out * sizeof(double)), *refacc = malloc(n * out * sizeof(double));
    for (size_t b = 0; b < n; b++)
        for (size_t o = 0; o < out; o++) {
            double s = 0.0;
            for (size_t i = 0; i < in; i++)
                s += (double)x[b * in + i] * (double)ws[o * in + i];
            ref[b * out + o] = s;
            refacc[b * out + o] = s + (double)y0[b * out + o];
        }
    static const kern_salr_strategy strategies[] = {KERN_SALR_STRATEGY_AUTO, KERN_SALR_STRATEGY_BLOCKED,
                                                    KERN_SALR_STRATEGY_PIPELINED};
    size_t n_strategies = n > KERN_SALR_FUSED_BATCH_LIMIT ? 3 : 1; /* small batches ignore it */
    for (size_t st = 0; st < n_strategies; st++) {
        kern_salr_set_strategy(strategies[st]);
        for (size_t k = 0; k < sizeof all_isas / sizeof all_isas[0]; k++) {
            kern_simd_set(all_isas[k]);
            for (int nt = 1; nt <= 3; nt++) {
                memset(y, 0xFF, n * out * sizeof(float)); /* NaN garbage must be overwritten */
                assert_int_equal(kern_salr_spmm(bm, x, n, y, false, nt), FU_OK);
                assert_true(rel_err(y, ref, n * out) < 1e-5);
                memcpy(y, y0, n * out * sizeof(float));
                assert_int_equal(kern_salr_spmm(bm, x, n, y, true, nt), FU_OK);
                assert_true(rel_err(y, refacc, n * out) < 1e-5);
            }
        }
    }
    kern_salr_set_strategy(KERN_SALR_STRATEGY_AUTO);
    kern_simd_set(KERN_SIMD_AUTO);
    kern_bitmap_destroy(&bm);
    TK_FREE_ALL(w, ws, x, y, y0, ref, refacc);
}

static void test_kern_salr_spmm_matches_dense(void **state)
{
    (void)state;
    static const size_t batches[] = {1, 2, 3, 4, 5, 8, 9, 16, 17, 64};
    for (size_t k = 0; k < sizeof batches / sizeof batches[0]; k++) {
        check_spmm(67, 193, batches[k], KERN_BITMAP_F32);  /* odd shape, partial tiles */
        check_spmm(256, 128, batches[k], KERN_BITMAP_F32); /* whole tiles, several pipeline blocks */
    }
    check_spmm(3, 5, 1, KERN_BITMAP_F32);
    check_spmm(3, 5, 64, KERN_BITMAP_F32);
    check_spmm(41, 150, 1, KERN_BITMAP_F16);
    check_spmm(41, 150, 3, KERN_BITMAP_F16);
    check_spmm(41, 150, 64, KERN_BITMAP_F16);
}

static void test_kern_salr_spmm_large_pipeline(void **state)
{
    (void)state;
    /* more rows than one dense block (KERN_SALR_BLOCK_BYTES / (cols*4) rows), rows not a
     * multiple of the tile height */
    size_t cols = 2048 + 7, rows = KERN_SALR_BLOCK_BYTES / (cols * sizeof(float)) + 8 * 7 + 3;
    check_spmm(rows, cols, 24, KERN_BITMAP_F32);
}

/* The helper is kept off its caller's CPU (kern_salr.c, helper_place): the product stays right when
 * the caller moves from CPU to CPU (the helper is placed again each time) and when the caller may
 * run on one CPU only (nothing to place it on; the helper stays wherever it is). */
static void test_kern_salr_spmm_follows_caller_cpu(void **state)
{
    (void)state;
    cpu_set_t all;
    CPU_ZERO(&all);
    assert_int_equal(sched_getaffinity(0, sizeof all, &all), 0);
    int moved = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && moved < 4; cpu++) {
        if (!CPU_ISSET(cpu, &all))
            continue;
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        assert_int_equal(sched_setaffinity(0, sizeof one, &one), 0);
        assert_int_equal(sched_getcpu(), cpu);
        check_spmm(67, 193, 1, KERN_BITMAP_F32); /* the caller pinned to one CPU */
        check_spmm(67, 193, 4, KERN_BITMAP_F32);
        assert_int_equal(sched_setaffinity(0, sizeof all, &all), 0);
        check_spmm(256, 128, 1, KERN_BITMAP_F32); /* free again, maybe elsewhere */
        moved++;
    }
    assert_true(moved >= 1);
}

/* Several threads calling the product at once (the helper thread is busy for all but one). */
typedef struct {
    const kern_bitmap_t *bm;
    const float         *x;
    const double        *ref;
    size_t               n, out;
    int                  ok;
} conc_arg;

static void *conc_main(void *p)
{
    conc_arg *a = p;
    float    *y = malloc(a->n * a->out * sizeof(float));
    a->ok = 1;
    for (int it = 0; it < 50; it++) {
        if (kern_salr_spmm(a->bm, a->x, a->n, y, false, 2) != FU_OK || rel_err(y, a->ref, a->n * a->out) > 1e-5)
            a->ok = 0;
    }
    free(y);
    return NULL;
}

static void test_kern_salr_spmm_concurrent_callers(void **state)
{
    (void)state;
    size_t out = 120, in = 200, n = 2;
    float *w = rand_mat(out * in);
    assert_int_equal(kern_salr_prune(w, out, in, 0.5, w, NULL, NULL), FU_OK);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, out, in, in, KERN_BITMAP_F32, &bm), FU_OK);
    float  *x = rand_mat(n * in);
    double *ref = malloc(n * out * sizeof(double));
    for (size_t b = 0; b < n; b++)
        for (size_t o = 0; o < out; o++) {
            double t = 0;
            for (size_t i = 0; i < in; i++)
                t += (double)x[b * in + i] * w[o * in + i];
            ref[b * out + o] = t;
        }
    enum { NT = 4 };
    pthread_t th[NT];
    conc_arg  args[NT];
    for (int i = 0; i < NT; i++) {
        args[i] = (conc_arg){bm, x, ref, n, out, 0};
        assert_int_equal(pthread_create(&th[i], NULL, conc_main, &args[i]), 0);
    }
    for (int i = 0; i < NT; i++) {
        pthread_join(th[i], NULL);
        assert_true(args[i].ok);
    }
    kern_bitmap_destroy(&bm);
    TK_FREE_ALL(w, x, ref);
}

static void test_kern_salr_spmm_bad_args(void **state)
{
    (void)state;
    float          w[64] = {1, 0, 2}, x[64] = {0}, y[64];
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, 8, 8, 8, KERN_BITMAP_F32, &bm), FU_OK);
    assert_int_equal(kern_salr_spmm(NULL, x, 1, y, false, 0), FU_EINVAL);
    assert_int_equal(kern_salr_spmm(bm, NULL, 1, y, false, 0), FU_EINVAL);
    assert_int_equal(kern_salr_spmm(bm, x, 1, NULL, false, 0), FU_EINVAL);
    assert_int_equal(kern_salr_spmm(bm, x, 0, y, false, 0), FU_EINVAL);
    kern_salr_dims d = {.in = 7, .out = 8, .r1 = 1, .r2 = 0};
    float          a[8] = {0}, b[8] = {0}, h[8];
    assert_int_equal(kern_salr_linear_forward(bm, &d, a, b, x, 1, h, y), FU_EINVAL); /* in mismatch */
    d.in = 8;
    assert_int_equal(kern_salr_linear_forward(bm, &d, a, b, x, 1, h, y), FU_OK);
    assert_int_equal(kern_salr_linear_forward(NULL, &d, a, b, x, 1, h, y), FU_EINVAL);
    kern_bitmap_destroy(&bm);
}

/* ---- concatenated adapters ---------------------------------------------------------------------- */

static void test_kern_salr_concat_equals_separate(void **state)
{
    (void)state;
    kern_salr_dims d = {.in = 50, .out = 37, .r1 = 4, .r2 = 6};
    size_t         n = 5, rt = d.r1 + d.r2;
    float          s1 = 2.0f, s2 = 1.0f;
    float *a1 = rand_mat(d.r1 * d.in), *b1 = rand_mat(d.out * d.r1);
    float *a2 = rand_mat(d.r2 * d.in), *b2 = rand_mat(d.out * d.r2);
    float *x = rand_mat(n * d.in), *dy = rand_mat(n * d.out);
    float *a_cat = malloc(rt * d.in * sizeof(float)), *b_cat = malloc(d.out * rt * sizeof(float));
    assert_int_equal(kern_salr_concat_build(&d, a1, b1, s1, a2, b2, s2, a_cat, b_cat), FU_OK);

    /* separate adapters, in double: Y = y0 + s1 (X A1^T) B1^T + s2 (X A2^T) B2^T */
    float  *y0 = rand_mat(n * d.out), *y = malloc(n * d.out * sizeof(float));
    double *ref = malloc(n * d.out * sizeof(double));
    double *h1 = malloc(n * d.r1 * sizeof(double)), *h2 = malloc(n * d.r2 * sizeof(double));
    for (size_t b = 0; b < n; b++) {
        for (size_t k = 0; k < d.r1; k++) {
            double s = 0;
            for (size_t i = 0; i < d.in; i++)
                s += (double)x[b * d.in + i] * a1[k * d.in + i];
            h1[b * d.r1 + k] = s;
        }
        for (size_t k = 0; k < d.r2; k++) {
            double s = 0;
            for (size_t i = 0; i < d.in; i++)
                s += (double)x[b * d.in + i] * a2[k * d.in + i];
            h2[b * d.r2 + k] = s;
        }
        for (size_t o = 0; o < d.out; o++) {
            double s = y0[b * d.out + o];
            for (size_t k = 0; k < d.r1; k++)
                s += s1 * h1[b * d.r1 + k] * b1[o * d.r1 + k];
            for (size_t k = 0; k < d.r2; k++)
                s += s2 * h2[b * d.r2 + k] * b2[o * d.r2 + k];
            ref[b * d.out + o] = s;
        }
    }
    float *h = malloc(n * rt * sizeof(float));
    memcpy(y, y0, n * d.out * sizeof(float));
    assert_int_equal(kern_salr_concat_forward(&d, a_cat, b_cat, x, n, h, y), FU_OK);
    assert_true(rel_err(y, ref, n * d.out) < 1e-5);

    /* backward: dB1 = s1 dY^T H1, dA1 = s1 (dY B1)^T X, dX = s1 dY B1 A1 + s2 dY B2 A2 */
    float *db1 = malloc(d.out * d.r1 * sizeof(float)), *da1 = malloc(d.r1 * d.in * sizeof(float));
    float *dx = calloc(n * d.in, sizeof(float));
    assert_int_equal(kern_salr_concat_backward(&d, a_cat, b_cat, s1, h, dy, n, db1, x, da1, dx), FU_OK);
    double *rdb1 = calloc(d.out * d.r1, sizeof(double)), *rda1 = calloc(d.r1 * d.in, sizeof(double));
    double *rdx = calloc(n * d.in, sizeof(double));
    for (size_t b = 0; b < n; b++) {
        for (size_t o = 0; o < d.out; o++)
            for (size_t k = 0; k < d.r1; k++)
                rdb1[o * d.r1 + k] += s1 * (double)dy[b * d.out + o] * h1[b * d.r1 + k];
        for (size_t k = 0; k < d.r1; k++) {
            double g = 0;
            for (size_t o = 0; o < d.out; o++)
                g += s1 * (double)dy[b * d.out + o] * b1[o * d.r1 + k];
            for (size_t i = 0; i < d.in; i++) {
                rda1[k * d.in + i] += g * x[b * d.in + i];
                rdx[b * d.in + i] += g * a1[k * d.in + i];
            }
        }
        for (size_t k = 0; k < d.r2; k++) {
            double g = 0;
            for (size_t o = 0; o < d.out; o++)
                g += s2 * (double)dy[b * d.out + o] * b2[o * d.r2 + k];
            for (size_t i = 0; i < d.in; i++)
                rdx[b * d.in + i] += g * a2[k * d.in + i];
        }
    }
    assert_true(rel_err(db1, rdb1, d.out * d.r1) < 1e-5);
    assert_true(rel_err(da1, rda1, d.r1 * d.in) < 1e-5);
    assert_true(rel_err(dx, rdx, n * d.in) < 1e-5);

    /* after an optimizer step only B1's columns change */
    for (size_t i = 0; i < d.out * d.r1; i++)
        b1[i] += 0.25f;
    float *b_cat2 = malloc(d.out * rt * sizeof(float)), *a_tmp = malloc(rt * d.in * sizeof(float));
    assert_int_equal(kern_salr_concat_build(&d, a1, b1, s1, a2, b2, s2, a_tmp, b_cat2), FU_OK);
    assert_int_equal(kern_salr_concat_set_b1(&d, b1, s1, b_cat), FU_OK);
    assert_memory_equal(b_cat, b_cat2, d.out * rt * sizeof(float));

    free(a1); free(b1); free(a2); free(b2); free(x); free(dy); free(a_cat); free(b_cat); free(y0);
    free(y); free(ref); free(h1); free(h2); free(h); free(db1); free(da1); free(dx); free(rdb1);
    free(rda1); free(rdx); free(b_cat2); free(a_tmp);
}

static void test_kern_salr_concat_bad_args(void **state)
{
    (void)state;
    float          m[64] = {0}, h[64], y[64];
    kern_salr_dims d = {.in = 4, .out = 4, .r1 = 2, .r2 = 2};
    kern_salr_dims z = {.in = 0, .out = 4, .r1 = 2, .r2 = 2};
    kern_salr_dims r0 = {.in = 4, .out = 4, .r1 = 0, .r2 = 0};
    kern_salr_dims only2 = {.in = 4, .out = 4, .r1 = 0, .r2 = 2};
    assert_int_equal(kern_salr_concat_build(&z, m, m, 1, m, m, 1, h, y), FU_EINVAL);
    assert_int_equal(kern_salr_concat_build(&r0, m, m, 1, m, m, 1, h, y), FU_EINVAL);
    assert_int_equal(kern_salr_concat_build(NULL, m, m, 1, m, m, 1, h, y), FU_EINVAL);
    assert_int_equal(kern_salr_concat_build(&d, NULL, m, 1, m, m, 1, h, y), FU_EINVAL);
    assert_int_equal(kern_salr_concat_build(&only2, NULL, NULL, 1, m, m, 1, h, y), FU_OK);
    assert_int_equal(kern_salr_concat_set_b1(&only2, m, 1, y), FU_EINVAL);
    assert_int_equal(kern_salr_concat_forward(&d, m, m, m, 0, h, y), FU_EINVAL);
    assert_int_equal(kern_salr_concat_forward(&d, m, m, NULL, 1, h, y), FU_EINVAL);
    assert_int_equal(kern_salr_concat_backward(&d, m, m, 1, h, m, 1, h, NULL, y, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_concat_backward(&only2, m, m, 1, h, m, 1, h, NULL, NULL, NULL), FU_EINVAL);
    assert_int_equal(kern_salr_concat_backward(&d, m, m, 1, NULL, m, 1, h, NULL, NULL, NULL), FU_EINVAL);
}

/* SALR end to end: pruned weight + SVD residual adapter is closer to W than the pruned weight. */
static void test_kern_salr_residual_recovers_error(void **state)
{
    (void)state;
    size_t out = 64, in = 96, rank = 16, n = 3;
    float *w = rand_mat(out * in), *ws = malloc(out * in * sizeof(float)), *res = malloc(out * in * 4);
    assert_int_equal(kern_salr_prune(w, out, in, 0.5, ws, res, NULL), FU_OK);
    float *a2 = malloc(rank * in * 4), *b2 = malloc(out * rank * 4);
    assert_int_equal(kern_salr_svd(res, out, in, rank, KERN_SALR_SVD_AUTO, 5, a2, b2, NULL), FU_OK);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(ws, out, in, in, KERN_BITMAP_F32, &bm), FU_OK);
    kern_salr_dims d = {.in = in, .out = out, .r1 = 0, .r2 = rank};
    float *a_cat = malloc(rank * in * 4), *b_cat = malloc(out * rank * 4);
    assert_int_equal(kern_salr_concat_build(&d, NULL, NULL, 0, a2, b2, 1.0f, a_cat, b_cat), FU_OK);
    float *x = rand_mat(n * in), *y = malloc(n * out * 4), *ys = malloc(n * out * 4), *h = malloc(n * rank * 4);
    assert_int_equal(kern_salr_linear_forward(bm, &d, a_cat, b_cat, x, n, h, y), FU_OK);
    assert_int_equal(kern_salr_linear_forward(bm, NULL, NULL, NULL, x, n, NULL, ys), FU_OK);
    double e_adapt = 0, e_sparse = 0;
    for (size_t b = 0; b < n; b++)
        for (size_t o = 0; o < out; o++) {
            double t = 0;
            for (size_t i = 0; i < in; i++)
                t += (double)x[b * in + i] * w[o * in + i];
            e_adapt += (y[b * out + o] - t) * (y[b * out + o] - t);
            e_sparse += (ys[b * out + o] - t) * (ys[b * out + o] - t);
        }
    assert_true(e_adapt < e_sparse);
    kern_bitmap_destroy(&bm);
    free(w); free(ws); free(res); free(a2); free(b2); free(a_cat); free(b_cat); free(x); free(y);
    free(ys); free(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_salr_prune_exact_sparsity_and_ties),
        cmocka_unit_test(test_kern_salr_prune_bad_args),
        cmocka_unit_test(test_kern_salr_svd_bound),
        cmocka_unit_test(test_kern_salr_svd_randomized),
        cmocka_unit_test(test_kern_salr_svd_bad_args),
        cmocka_unit_test(test_kern_salr_spmm_matches_dense),
        cmocka_unit_test(test_kern_salr_spmm_large_pipeline),
        cmocka_unit_test(test_kern_salr_spmm_follows_caller_cpu),
        cmocka_unit_test(test_kern_salr_spmm_concurrent_callers),
        cmocka_unit_test(test_kern_salr_spmm_bad_args),
        cmocka_unit_test(test_kern_salr_concat_equals_separate),
        cmocka_unit_test(test_kern_salr_concat_bad_args),
        cmocka_unit_test(test_kern_salr_residual_recovers_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
