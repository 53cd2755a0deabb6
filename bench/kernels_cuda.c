/* CUDA backend benchmarks (bench-kernels; cases cuda_*). Without a CUDA build or device each case
 * prints one {"skipped":"no cuda"} row.
 *   cuda_gemm    cuBLAS GEMM TFLOP/s (f32, f16, bf16; square shapes)
 *   cuda_lorafa  a LoRA-FA layer (fused forward; forward+backward) against its frozen linear alone;
 *                target: ratio <= 1.10
 *   cuda_salr    SALR f16 bitmap weight at 50% sparsity (4096x4096 and 11008x4096) against cuBLAS
 *                dense f16 at batch 1, 4, 16, 512; targets: speedup >= 1.3 (batch <= 16), >= 0.9 (512).
 *                sparse_s is kern_cuda_bitmap_matmul's own choice, fused_s the fused kernels alone
 *                (GEMV / tensor-core decode+MMA), decode_gemm_s decode-to-dense + cuBLAS
 * Times are medians of wall time around a batch of launches followed by a stream synchronize. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

#if defined(FUSION_KERN_HAVE_CUDA) || defined(FUSION_HAVE_CUDA)
#include "kern_backend.h"
#include "kern_bitmap.h"
#include "kern_cuda.h"
#include "kern_rng.h"
#include "kern_tensor.h"

#define CB_LAUNCHES 10 /* launches per timed call */

static const kern_backend_t *cb_gpu(const char *name)
{
    const kern_backend_t *be = NULL;
    if (kern_cuda_device_count() <= 0 || kern_backend_get("cuda:0", &be) != FU_OK) {
        bench_emit("kernels", name, "\"skipped\":\"no cuda\"");
        return NULL;
    }
    return be;
}

static int cb_reps(void)
{
    return bench_quick() ? 3 : 15;
}

/* A device tensor of dtype dt with uniform values in [lo, hi); NULL on failure (reported). */
static kern_tensor_t *cb_rand(const kern_backend_t *be, kern_dtype dt, int64_t r, int64_t c, uint64_t seed, float lo,
                              float hi)
{
    int64_t shape[2] = {r, c};
    kern_tensor_t *t = NULL;
    if (kern_tensor_new(be, dt, 2, shape, &t) != FU_OK)
        return NULL;
    size_t n = (size_t)(r * c);
    float *h = malloc(n * sizeof(float));
    void *conv = malloc(n * kern_dtype_size(dt));
    kern_rng rng;
    kern_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++)
        h[i] = lo + (hi - lo) * kern_rng_uniform(&rng);
    fu_err rc = h && conv ? kern_convert_host(conv, dt, h, KERN_F32, n) : FU_ENOMEM;
    if (rc == FU_OK)
        rc = kern_tensor_copy_in(be, t, conv, n * kern_dtype_size(dt));
    free(h);
    free(conv);
    if (rc != FU_OK)
        kern_tensor_destroy(&t);
    return t;
}

/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    const kern_backend_t *be;
    kern_tensor_t *a, *b, *c;
    bool ok;
} gemm_arg;

static void run_gemm(void *p)
{
    gemm_arg *g = p;
    for (int i = 0; i < CB_LAUNCHES; i++)
        g->ok &= kern_gemm(g->be, false, true, 1.0f, g->a, g->b, 0.0f, g->c) == FU_OK;
    g->ok &= kern_backend_sync(g->be) == FU_OK;
}

BENCH_CASE(cuda_gemm)
{
    const kern_backend_t *be = cb_gpu("cuda_gemm");
    if (!be)
        return;
    const kern_dtype dts[3] = {KERN_F32, KERN_F16, KERN_BF16};
    const int64_t sizes[2] = {1024, 4096};
    for (int s = bench_quick() ? 0 : 1; s < 2; s++)
        for (int d = 0; d < 3; d++) {
            int64_t n = sizes[s];
            gemm_arg g = {be, cb_rand(be, dts[d], n, n, 1, -1, 1), cb_rand(be, dts[d], n, n, 2, -1, 1),
                          cb_rand(be, dts[d], n, n, 3, 0, 0), true};
            if (!g.a || !g.b || !g.c) {
                bench_emit("kernels", "cuda_gemm", "\"dtype\":\"%s\",\"n\":%lld,\"error\":\"alloc\"",
                           kern_dtype_name(dts[d]), (long long)n);
            } else {
                double t = bench_median(run_gemm, &g, cb_reps()) / CB_LAUNCHES;
                double tf = 2.0 * (double)n * (double)n * (double)n / t / 1e12;
                bench_emit("kernels", "cuda_gemm", "\"dtype\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"time_s\":%.6g,"
                           "\"tflops\":%.2f,\"ok\":%s",
                           kern_dtype_name(dts[d]), (long long)n, (long long)n, (long long)n, t, tf,
                           g.ok ? "true" : "false");
            }
            kern_tensor_destroy(&g.a);
            kern_tensor_destroy(&g.b);
            kern_tensor_destroy(&g.c);
        }
}

/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    const kern_backend_t *be;
    kern_tensor_t *x, *w, *a, *b, *h, *y, *dy, *dx, *db;
    bool ok;
} lora_arg;

static void run_frozen_fwd(void *p)
{
    lora_arg *l = p;
    for (int i = 0; i < CB_LAUNCHES; i++)
        l->ok &= kern_linear_forward(l->be, l->x, l->w, l->y) == FU_OK;
    l->ok &= kern_backend_sync(l->be) == FU_OK;
}

static void run_lorafa_fwd(void *p)
{
    lora_arg *l = p;
    for (int i = 0; i < CB_LAUNCHES; i++)
        l->ok &= kern_cuda_lorafa_forward(l->be, l->x, l->w, l->a, l->b, 2.0f, l->h, l->y) == FU_OK;
    l->ok &= kern_backend_sync(l->be) == FU_OK;
}

static void run_frozen_fwdbwd(void *p)
{
    lora_arg *l = p;
    for (int i = 0; i < CB_LAUNCHES; i++) {
        l->ok &= kern_linear_forward(l->be, l->x, l->w, l->y) == FU_OK;
        l->ok &= kern_linear_backward(l->be, l->dy, NULL, l->w, l->dx, NULL) == FU_OK;
    }
    l->ok &= kern_backend_sync(l->be) == FU_OK;
}

static void run_lorafa_fwdbwd(void *p)
{
    lora_arg *l = p;
    for (int i = 0; i < CB_LAUNCHES; i++) {
        l->ok &= kern_cuda_lorafa_forward(l->be, l->x, l->w, l->a, l->b, 2.0f, l->h, l->y) == FU_OK;
        l->ok &= kern_cuda_lorafa_backward(l->be, l->dy, l->h, l->w, l->a, l->b, 2.0f, l->dx, l->db) == FU_OK;
    }
    l->ok &= kern_backend_sync(l->be) == FU_OK;
}

BENCH_CASE(cuda_lorafa)
{
    const kern_backend_t *be = cb_gpu("cuda_lorafa");
    if (!be)
        return;
    const int64_t n = bench_quick() ? 128 : 512, d = 4096, r = 16;
    const kern_dtype dt = KERN_F16;
    lora_arg l = {be,
                  cb_rand(be, dt, n, d, 11, -1, 1),
                  cb_rand(be, dt, d, d, 12, -0.02f, 0.02f),
                  cb_rand(be, dt, r, d, 13, -0.02f, 0.02f),
                  cb_rand(be, dt, d, r, 14, -0.02f, 0.02f),
                  cb_rand(be, dt, n, r, 15, 0, 0),
                  cb_rand(be, dt, n, d, 16, 0, 0),
                  cb_rand(be, dt, n, d, 17, -1, 1),
                  cb_rand(be, dt, n, d, 18, 0, 0),
                  cb_rand(be, dt, d, r, 19, 0, 0),
                  true};
    kern_tensor_t **all[] = {&l.x, &l.w, &l.a, &l.b, &l.h, &l.y, &l.dy, &l.dx, &l.db};
    bool have = true;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        have &= *all[i] != NULL;
    if (have) {
        double tf = bench_median(run_frozen_fwd, &l, cb_reps()) / CB_LAUNCHES;
        double tl = bench_median(run_lorafa_fwd, &l, cb_reps()) / CB_LAUNCHES;
        double tfb = bench_median(run_frozen_fwdbwd, &l, cb_reps()) / CB_LAUNCHES;
        double tlb = bench_median(run_lorafa_fwdbwd, &l, cb_reps()) / CB_LAUNCHES;
        bench_emit("kernels", "cuda_lorafa",
                   "\"dtype\":\"f16\",\"n\":%lld,\"in\":%lld,\"out\":%lld,\"rank\":%lld,\"frozen_fwd_s\":%.6g,"
                   "\"lorafa_fwd_s\":%.6g,\"fwd_ratio\":%.3f,\"frozen_fwdbwd_s\":%.6g,\"lorafa_fwdbwd_s\":%.6g,"
                   "\"fwdbwd_ratio\":%.3f,\"target_ratio\":1.10,\"ok\":%s",
                   (long long)n, (long long)d, (long long)d, (long long)r, tf, tl, tl / tf, tfb, tlb, tlb / tfb,
                   l.ok ? "true" : "false");
    } else {
        bench_emit("kernels", "cuda_lorafa", "\"error\":\"alloc\"");
    }
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        kern_tensor_destroy(all[i]);
}

/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    const kern_backend_t *be;
    kern_cuda_bitmap_t *sw;
    kern_tensor_t *dense, *x, *y, *scratch;
    bool ok;
} salr_arg;

static void run_sparse(void *p)
{
    salr_arg *s = p;
    for (int i = 0; i < CB_LAUNCHES; i++)
        s->ok &= kern_cuda_bitmap_matmul(s->be, s->x, s->sw, 0.0f, s->y) == FU_OK;
    s->ok &= kern_backend_sync(s->be) == FU_OK;
}

static void run_dense(void *p)
{
    salr_arg *s = p;
    for (int i = 0; i < CB_LAUNCHES; i++)
        s->ok &= kern_linear_forward(s->be, s->x, s->dense, s->y) == FU_OK;
    s->ok &= kern_backend_sync(s->be) == FU_OK;
}

static void run_fused(void *p)
{
    salr_arg *s = p;
    for (int i = 0; i < CB_LAUNCHES; i++)
        s->ok &= kern_cuda_bitmap_matmul_fused(s->be, s->x, s->sw, 0.0f, s->y) == FU_OK;
    s->ok &= kern_backend_sync(s->be) == FU_OK;
}

static void run_decode_gemm(void *p)
{
    salr_arg *s = p;
    for (int i = 0; i < CB_LAUNCHES; i++) {
        s->ok &= kern_cuda_bitmap_decode(s->be, s->sw, s->scratch) == FU_OK;
        s->ok &= kern_linear_forward(s->be, s->x, s->scratch, s->y) == FU_OK;
    }
    s->ok &= kern_backend_sync(s->be) == FU_OK;
}

BENCH_CASE(cuda_salr)
{
    const kern_backend_t *be = cb_gpu("cuda_salr");
    if (!be)
        return;
    const size_t shapes[2][2] = {{4096, 4096}, {11008, 4096}}; /* [out, in] */
    const int64_t batches[4] = {1, 4, 16, 512};
    for (int si = 0; si < (bench_quick() ? 1 : 2); si++) {
        const size_t out = shapes[si][0], in = shapes[si][1];
        /* W with 50% of its elements zeroed at random (the pattern magnitude pruning leaves). */
        float *w = malloc(out * in * sizeof(float));
        if (!w)
            return;
        kern_rng rng;
        kern_rng_seed(&rng, 21 + si);
        for (size_t i = 0; i < out * in; i++) {
            float v = kern_rng_uniform(&rng) * 0.04f - 0.02f;
            w[i] = kern_rng_uniform(&rng) < 0.5f ? 0.0f : v;
        }
        kern_bitmap_t *bm = NULL;
        salr_arg s = {be, NULL, NULL, NULL, NULL, NULL, true};
        int64_t shape[2] = {(int64_t)out, (int64_t)in};
        fu_err rc = kern_bitmap_encode(w, out, in, in, KERN_BITMAP_F16, &bm);
        if (rc == FU_OK)
            rc = kern_cuda_bitmap_upload(be, bm, &s.sw);
        if (rc == FU_OK)
            rc = kern_tensor_new(be, KERN_F16, 2, shape, &s.dense);
        if (rc == FU_OK)
            rc = kern_cuda_bitmap_decode(be, s.sw, s.dense);
        if (rc == FU_OK)
            rc = kern_tensor_new(be, KERN_F16, 2, shape, &s.scratch);
        double ratio = bm ? (double)kern_bitmap_encoded_bytes(bm) / (double)(out * in * 2) : 0.0;
        for (int b = 0; b < 4 && rc == FU_OK; b++) {
            const int64_t n = batches[b];
            s.x = cb_rand(be, KERN_F16, n, (int64_t)in, 31, -1, 1);
            s.y = cb_rand(be, KERN_F16, n, (int64_t)out, 32, 0, 0);
            if (!s.x || !s.y) {
                rc = FU_ENOMEM;
            } else {
                double ts = bench_median(run_sparse, &s, cb_reps()) / CB_LAUNCHES;
                double td = bench_median(run_dense, &s, cb_reps()) / CB_LAUNCHES;
                double tf = bench_median(run_fused, &s, cb_reps()) / CB_LAUNCHES;
                double tdg = n > 16 ? bench_median(run_decode_gemm, &s, cb_reps()) / CB_LAUNCHES : 0.0;
                double target = n <= 16 ? 1.3 : 0.9;
                bench_emit("kernels", "cuda_salr",
                           "\"dtype\":\"f16\",\"out\":%zu,\"in\":%zu,\"batch\":%lld,\"sparse_s\":%.6g,\"dense_s\":%.6g,"
                           "\"speedup\":%.3f,\"target\":%.1f,\"fused_s\":%.6g,\"fused_speedup\":%.3f,"
                           "\"decode_gemm_s\":%.6g,\"bytes_ratio\":%.3f,\"ok\":%s",
                           out, in, (long long)n, ts, td, td / ts, target, tf, td / tf, tdg, ratio,
                           s.ok ? "true" : "false");
            }
            kern_tensor_destroy(&s.x);
            kern_tensor_destroy(&s.y);
        }
        if (rc != FU_OK)
            bench_emit("kernels", "cuda_salr", "\"out\":%zu,\"in\":%zu,\"error\":\"%s\"", out, in, fu_strerror(rc));
        kern_tensor_destroy(&s.dense);
        kern_tensor_destroy(&s.scratch);
        kern_cuda_bitmap_destroy(&s.sw);
        kern_bitmap_destroy(&bm);
        free(w);
    }
}

#else /* no CUDA in this build */

BENCH_CASE(cuda_gemm)
{
    bench_emit("kernels", "cuda_gemm", "\"skipped\":\"no cuda\"");
}

BENCH_CASE(cuda_lorafa)
{
    bench_emit("kernels", "cuda_lorafa", "\"skipped\":\"no cuda\"");
}

BENCH_CASE(cuda_salr)
{
    bench_emit("kernels", "cuda_salr", "\"skipped\":\"no cuda\"");
}

#endif
