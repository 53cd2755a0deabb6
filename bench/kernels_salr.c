/* SALR kernel benchmarks: the bitmap sparse product at 50% sparsity against dense OpenBLAS
 * (sgemv at batch 1, sgemm otherwise), and the one-off preparation costs (pruning, SVD residual).
 * Each row: op, shape, batch, time_s (median), gflops (dense-equivalent 2*n*out*in / time),
 * speedup (dense time / this time) and bytes_ratio (encoded bytes / dense f32 bytes). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "kern_backend.h"
#include "kern_bitmap.h"
#include "kern_salr.h"

static uint64_t bench_rng = 0x2545F4914F6CDD1DULL;
static float    rnd_uniform(void)
{
    bench_rng ^= bench_rng << 13;
    bench_rng ^= bench_rng >> 7;
    bench_rng ^= bench_rng << 17;
    return (float)((double)(bench_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static float *rand_buf(size_t n)
{
    float *a = fu_malloc_aligned(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        a[i] = rnd_uniform();
    return a;
}

typedef struct {
    const kern_bitmap_t *bm;    /* sparse weight */
    const float         *dense; /* the same weight, dense (W_sparse with zeros) */
    const float         *x;
    float               *y;
    size_t               out, in, n;
} mm_arg;

static void run_sparse(void *p)
{
    mm_arg *a = p;
    if (kern_salr_spmm(a->bm, a->x, a->n, a->y, false, 0) != FU_OK)
        abort();
}

static kern_tensor_t mat2(float *p, size_t r, size_t c)
{
    kern_tensor_t t;
    int64_t shape[2] = {(int64_t)r, (int64_t)c};
    if (kern_tensor_wrap(&t, p, KERN_F32, 2, shape, (kern_device){KERN_DEV_CPU, 0}) != FU_OK)
        abort();
    return t;
}

/* The dense product fusion would run instead: the CPU backend's GEMM (its tiles split between
 * kern_cpu_threads() threads; sgemv blocks for one row). */
static void run_dense(void *p)
{
    mm_arg *a = p;
    kern_tensor_t x = mat2((float *)a->x, a->n, a->in), w = mat2((float *)a->dense, a->out, a->in);
    kern_tensor_t y = mat2(a->y, a->n, a->out);
    if (kern_gemm(kern_backend_cpu(), false, true, 1.0f, &x, &w, 0.0f, &y) != FU_OK)
        abort();
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median times of fa and fb measured in alternating rounds (after one warm-up each), so that load
 * from other processes on the machine hits both alike; the fastest rounds go to *ma, *mb (on a
 * shared machine they show what the code does when it gets the cores). */
static double last_min_a, last_min_b;
static void median_pair(void (*fa)(void *), void (*fb)(void *), void *arg, int rounds, double *ta, double *tb)
{
    double *a = malloc(sizeof(double) * (size_t)rounds), *b = malloc(sizeof(double) * (size_t)rounds);
    fa(arg);
    fb(arg);
    for (int r = 0; r < rounds; r++) {
        double t0 = fu_clock_sec();
        fa(arg);
        double t1 = fu_clock_sec();
        fb(arg);
        double t2 = fu_clock_sec();
        a[r] = t1 - t0;
        b[r] = t2 - t1;
    }
    qsort(a, (size_t)rounds, sizeof(double), cmp_dbl);
    qsort(b, (size_t)rounds, sizeof(double), cmp_dbl);
    *ta = a[rounds / 2];
    *tb = b[rounds / 2];
    last_min_a = a[0];
    last_min_b = b[0];
    free(a);
    free(b);
}

static int repeats_for(size_t n)
{
    if (bench_quick())
        return 3;
    return n >= 256 ? 7 : 41;
}

static void spmm_shape(size_t out, size_t in, const size_t *batches, size_t nb)
{
    float *w = rand_buf(out * in);
    float *ws = fu_malloc_aligned(out * in * sizeof(float));
    if (kern_salr_prune(w, out, in, KERN_SALR_DEFAULT_SPARSITY, ws, NULL, NULL) != FU_OK)
        abort();
    fu_free_aligned(w);
    kern_bitmap_t *bm = NULL;
    if (kern_bitmap_encode(ws, out, in, in, KERN_BITMAP_F32, &bm) != FU_OK)
        abort();
    double bytes_ratio = (double)kern_bitmap_encoded_bytes(bm) / ((double)out * (double)in * 4.0);
    size_t nmax = 0;
    for (size_t k = 0; k < nb; k++)
        nmax = batches[k] > nmax ? batches[k] : nmax;
    float *x = rand_buf(nmax * in);
    float *y = fu_malloc_aligned(nmax * out * sizeof(float));
    const char *isa_name[] = {"auto", "scalar", "avx2", "avx512"};
    for (size_t k = 0; k < nb; k++) {
        mm_arg a = {bm, ws, x, y, out, in, batches[k]};
        double td, ts;
        median_pair(run_dense, run_sparse, &a, repeats_for(a.n), &td, &ts);
        double flops = 2.0 * (double)a.n * (double)out * (double)in;
        if (a.n > KERN_SALR_FUSED_BATCH_LIMIT) {
            /* the two large-batch strategies side by side (AUTO picks one of them) */
            int    reps = bench_quick() ? 2 : 3;
            kern_salr_set_strategy(KERN_SALR_STRATEGY_BLOCKED);
            double tb = bench_median(run_sparse, &a, reps);
            kern_salr_set_strategy(KERN_SALR_STRATEGY_PIPELINED);
            double tp = bench_median(run_sparse, &a, reps);
            kern_salr_set_strategy(KERN_SALR_STRATEGY_AUTO);
            bench_emit("kernels", "salr_spmm_strategies",
                       "\"op\":\"salr_spmm\",\"shape\":\"%zux%zu\",\"batch\":%zu,\"blocked_time_s\":%.6g,"
                       "\"pipelined_time_s\":%.6g,\"pipeline_gain\":%.3f,\"threads\":%d",
                       out, in, a.n, tb, tp, tb / tp, kern_cpu_threads());
        }
        bench_emit("kernels", "salr_spmm",
                   "\"op\":\"salr_spmm\",\"shape\":\"%zux%zu\",\"batch\":%zu,\"sparsity\":0.5,\"dtype\":\"f32\","
                   "\"isa\":\"%s\",\"time_s\":%.6g,\"gflops\":%.2f,\"dense_op\":\"%s\",\"dense_time_s\":%.6g,"
                   "\"dense_gflops\":%.2f,\"speedup\":%.3f,\"bytes_ratio\":%.4f,\"time_min_s\":%.6g,"
                   "\"dense_time_min_s\":%.6g,\"speedup_min\":%.3f",
                   out, in, a.n, isa_name[kern_simd_active()], ts, flops / ts * 1e-9,
                   a.n == 1 ? "cpu_gemv" : "cpu_gemm", td, flops / td * 1e-9, td / ts, bytes_ratio,
                   last_min_b, last_min_a, last_min_a / last_min_b);
    }
    /* f16 storage at batch 1: half the value bytes */
    kern_bitmap_t *bm16 = NULL;
    if (kern_bitmap_encode(ws, out, in, in, KERN_BITMAP_F16, &bm16) != FU_OK)
        abort();
    mm_arg a16 = {bm16, ws, x, y, out, in, 1};
    double td, ts;
    median_pair(run_dense, run_sparse, &a16, repeats_for(1), &td, &ts);
    bench_emit("kernels", "salr_spmm",
               "\"op\":\"salr_spmm\",\"shape\":\"%zux%zu\",\"batch\":1,\"sparsity\":0.5,\"dtype\":\"f16\","
               "\"isa\":\"%s\",\"time_s\":%.6g,\"gflops\":%.2f,\"dense_op\":\"cpu_gemv\",\"dense_time_s\":%.6g,"
               "\"speedup\":%.3f,\"bytes_ratio\":%.4f,\"speedup_min\":%.3f",
               out, in, isa_name[kern_simd_active()], ts, 2.0 * (double)out * (double)in / ts * 1e-9, td,
               td / ts, (double)kern_bitmap_encoded_bytes(bm16) / ((double)out * (double)in * 4.0),
               last_min_a / last_min_b);
    kern_bitmap_destroy(&bm16);
    kern_bitmap_destroy(&bm);
    fu_free_aligned(ws);
    fu_free_aligned(x);
    fu_free_aligned(y);
}

BENCH_CASE(salr_spmm)
{
    static const size_t batches[] = {1, 4, 16, 512};
    if (bench_quick()) {
        spmm_shape(1024, 1024, batches, 3);
        return;
    }
    spmm_shape(4096, 4096, batches, 4);
    spmm_shape(11008, 4096, batches, 4);
}

/* Batch-1 product under each instruction set, to show what the fallbacks cost. */
BENCH_CASE(salr_spmv_isa)
{
    size_t out = bench_quick() ? 1024 : 4096, in = out;
    float *w = rand_buf(out * in);
    if (kern_salr_prune(w, out, in, 0.5, w, NULL, NULL) != FU_OK)
        abort();
    kern_bitmap_t *bm = NULL;
    if (kern_bitmap_encode(w, out, in, in, KERN_BITMAP_F32, &bm) != FU_OK)
        abort();
    float *x = rand_buf(in), *y = fu_malloc_aligned(out * sizeof(float));
    mm_arg a = {bm, w, x, y, out, in, 1};
    static const kern_simd_isa isas[] = {KERN_SIMD_SCALAR, KERN_SIMD_AVX2, KERN_SIMD_AVX512};
    static const char *names[] = {"scalar", "avx2", "avx512"};
    for (size_t k = 0; k < 3; k++) {
        kern_simd_set(isas[k]);
        if (kern_simd_active() != isas[k])
            continue;
        double td, ts;
        median_pair(run_dense, run_sparse, &a, repeats_for(1), &td, &ts);
        bench_emit("kernels", "salr_spmv_isa",
                   "\"op\":\"salr_spmm\",\"shape\":\"%zux%zu\",\"batch\":1,\"isa\":\"%s\",\"time_s\":%.6g,"
                   "\"gflops\":%.2f,\"speedup\":%.3f,\"speedup_min\":%.3f",
                   out, in, names[k], ts, 2.0 * (double)out * (double)in / ts * 1e-9, td / ts,
                   last_min_a / last_min_b);
    }
    kern_simd_set(KERN_SIMD_AUTO);
    /* decode throughput into a dense buffer */
    float *d = fu_malloc_aligned(out * in * sizeof(float));
    double t0 = fu_clock_sec();
    int    reps = bench_quick() ? 2 : 5;
    for (int r = 0; r < reps; r++)
        if (kern_bitmap_decode(bm, d, in) != FU_OK)
            abort();
    double tdec = (fu_clock_sec() - t0) / reps;
    bench_emit("kernels", "salr_decode", "\"op\":\"bitmap_decode\",\"shape\":\"%zux%zu\",\"time_s\":%.6g,"
               "\"gelem_per_s\":%.2f", out, in, tdec, (double)out * (double)in / tdec * 1e-9);
    fu_free_aligned(d);
    kern_bitmap_destroy(&bm);
    fu_free_aligned(w);
    fu_free_aligned(x);
    fu_free_aligned(y);
}

/* One-off preparation of a layer: prune a frozen weight, then the rank-r SVD of the residual. */
BENCH_CASE(salr_prepare)
{
    size_t out = bench_quick() ? 1024 : 4096, in = out, rank = 16;
    float *w = rand_buf(out * in);
    float *ws = fu_malloc_aligned(out * in * sizeof(float)), *res = fu_malloc_aligned(out * in * sizeof(float));
    double t0 = fu_clock_sec();
    if (kern_salr_prune(w, out, in, 0.5, ws, res, NULL) != FU_OK)
        abort();
    double tprune = fu_clock_sec() - t0;
    bench_emit("kernels", "salr_prune", "\"op\":\"salr_prune\",\"shape\":\"%zux%zu\",\"sparsity\":0.5,"
               "\"time_s\":%.6g,\"gelem_per_s\":%.3f", out, in, tprune, (double)out * (double)in / tprune * 1e-9);
    t0 = fu_clock_sec();
    kern_bitmap_t *bm = NULL;
    if (kern_bitmap_encode(ws, out, in, in, KERN_BITMAP_F32, &bm) != FU_OK)
        abort();
    double tenc = fu_clock_sec() - t0;
    bench_emit("kernels", "salr_encode", "\"op\":\"bitmap_encode\",\"shape\":\"%zux%zu\",\"time_s\":%.6g",
               out, in, tenc);
    kern_bitmap_destroy(&bm);
    float *a = fu_malloc_aligned(rank * in * sizeof(float)), *b = fu_malloc_aligned(out * rank * sizeof(float));
    static const kern_salr_svd_method methods[] = {KERN_SALR_SVD_AUTO, KERN_SALR_SVD_EXACT};
    static const char *names[] = {"auto", "exact"};
    for (size_t k = 0; k < 2; k++) {
        if (k == 1 && !bench_quick() && !getenv("FUSION_BENCH_EXACT_SVD"))
            continue; /* the full sgesdd of 4096x4096 takes minutes on 2 cores: opt in */
        double ratio = -1.0;
        t0 = fu_clock_sec();
        if (kern_salr_svd(res, out, in, rank, methods[k], 1, a, b, &ratio) != FU_OK)
            abort();
        double tsvd = fu_clock_sec() - t0;
        bench_emit("kernels", "salr_svd",
                   "\"op\":\"salr_svd\",\"shape\":\"%zux%zu\",\"rank\":%zu,\"method\":\"%s\",\"time_s\":%.6g,"
                   "\"err_ratio\":%.6f,\"bound\":%.6f",
                   out, in, rank, names[k], tsvd, ratio, 1.0 - (double)rank / (double)out);
    }
    fu_free_aligned(a);
    fu_free_aligned(b);
    fu_free_aligned(w);
    fu_free_aligned(ws);
    fu_free_aligned(res);
}
