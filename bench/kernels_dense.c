/* Dense kernel benchmarks on the CPU backend: GEMM through the backend table (thread-independent
 * tiles) against OpenBLAS's own threads on the same shapes, a LoRA-FA layer against a LoRA layer (forward + backward, time
 * and saved-activation bytes), and RMSNorm / attention / softmax cross-entropy throughput.
 * Each row: op, shape, dtype, backend, time_s (median) and gflops or gbps. --quick shrinks shapes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "fu_alloc.h"
#include "kern_backend.h"
#include "kern_kvcache.h"
#include "kern_lora.h"
#include "kern_rng.h"

#define CPU kern_backend_cpu()

static float *rand_buf(size_t n, uint64_t seed, float scale)
{
    float *p = fu_malloc_aligned(n * sizeof(float));
    kern_rng r;
    kern_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++)
        p[i] = scale * (2.0f * kern_rng_uniform(&r) - 1.0f);
    return p;
}

static kern_tensor_t mat(float *p, int64_t r, int64_t c)
{
    kern_tensor_t t;
    int64_t shape[2] = {r, c};
    if (kern_tensor_wrap(&t, p, KERN_F32, 2, shape, (kern_device){KERN_DEV_CPU, 0}) != FU_OK)
        abort();
    return t;
}

static void must(fu_err rc, const char *what)
{
    if (rc != FU_OK) {
        fprintf(stderr, "bench-kernels: %s failed: %s\n", what, fu_strerror(rc));
        exit(1);
    }
}

static int reps(int full)
{
    return bench_quick() ? 2 : full;
}

/* ---- GEMM: Y[m,n] = X[m,k]·W[n,k]ᵀ ---- */

typedef struct {
    kern_tensor_t x, w, y;
    int           m, n, k;
} gemm_arg;

static void run_backend_linear(void *p)
{
    gemm_arg *g = p;
    must(kern_linear_forward(CPU, &g->x, &g->w, &g->y), "linear");
}

/* The backend's linear with OpenBLAS splitting each call between its own threads (today's
 * OpenBLAS, what the backend did before its products were made thread-independent). */
static void run_blas_threads(void *p)
{
    kern_cpu_gemm_set_mode(KERN_CPU_GEMM_BLAS_THREADS);
    run_backend_linear(p);
    kern_cpu_gemm_set_mode(KERN_CPU_GEMM_DETERMINISTIC);
}

/* The backend's linear (fixed tiles, the same bits for any thread count) against the same call with
 * OpenBLAS's own threads (bits that depend on the thread count): "cost" is the time ratio, both
 * with kern_cpu_threads() threads. Shapes: a 768-wide layer, its FFN, a 32000-word lm_head, one
 * decode row, and LoRA's two thin products (X·Aᵀ at rank 8, H·Bᵀ). */
BENCH_CASE(kernels_gemm)
{
    static const int full[][3] = {{512, 768, 768}, {512, 2048, 768}, {512, 32000, 768}, {1, 4096, 4096},
                                  {512, 8, 768},   {512, 768, 8}};
    static const int quick[][3] = {{128, 768, 768}, {1, 4096, 4096}, {512, 8, 768}};
    int ncase = bench_quick() ? 3 : 6;
    for (int c = 0; c < ncase; c++) {
        const int *s = bench_quick() ? quick[c] : full[c];
        int m = s[0], n = s[1], k = s[2];
        float *x = rand_buf((size_t)m * k, 1, 1.0f), *w = rand_buf((size_t)n * k, 2, 0.05f);
        float *y = fu_malloc_aligned((size_t)m * n * sizeof(float));
        gemm_arg g = {mat(x, m, k), mat(w, n, k), mat(y, m, n), m, n, k};
        double flop = 2.0 * m * n * k;
        int r = reps(m * (double)n * k > 1e10 ? 3 : m * (double)n * k < 1e7 ? 41 : 7);
        double tb = bench_median(run_backend_linear, &g, r);
        double tc = bench_median(run_blas_threads, &g, r);
        bench_emit("kernels", "gemm",
                   "\"op\":\"linear\",\"shape\":\"%dx%dx%d\",\"dtype\":\"f32\",\"backend\":\"cpu\",\"threads\":%d,"
                   "\"time_s\":%.6g,\"gflops\":%.2f,\"blas_threads_time_s\":%.6g,\"blas_threads_gflops\":%.2f,"
                   "\"determinism_cost\":%.3f",
                   m, n, k, kern_cpu_threads(), tb, flop / tb * 1e-9, tc, flop / tc * 1e-9, tb / tc);
        fu_free_aligned(x);
        fu_free_aligned(w);
        fu_free_aligned(y);
    }
}

/* ---- LoRA vs LoRA-FA layer ---- */

typedef struct {
    kern_tensor_t x, w, a, b, h, y, dy, dx, da, db;
    float         s;
    bool          fa;
    kern_workspace_t *ws;
} lora_arg;

static void run_lora_step(void *p)
{
    lora_arg *l = p;
    must(kern_lora_forward(CPU, &l->x, &l->w, &l->a, &l->b, l->s, &l->h, &l->y), "lora forward");
    if (l->fa)
        must(kern_lorafa_backward(CPU, &l->dy, &l->h, &l->w, &l->a, &l->b, l->s, &l->dx, &l->db, l->ws),
             "lorafa backward");
    else
        must(kern_lora_backward(CPU, &l->dy, &l->x, &l->h, &l->w, &l->a, &l->b, l->s, &l->dx, &l->da, &l->db, l->ws),
             "lora backward");
}

BENCH_CASE(kernels_lora_vs_lorafa)
{
    int n = bench_quick() ? 128 : 512, in = 768, out = 768, r = 8;
    if (!bench_quick()) {
        in = 4096;
        out = 4096;
    }
    float *x = rand_buf((size_t)n * in, 3, 1.0f), *w = rand_buf((size_t)out * in, 4, 0.02f);
    float *a = rand_buf((size_t)r * in, 5, 0.02f), *b = rand_buf((size_t)out * r, 6, 0.02f);
    float *h = fu_malloc_aligned((size_t)n * r * 4), *y = fu_malloc_aligned((size_t)n * out * 4);
    float *dy = rand_buf((size_t)n * out, 7, 1.0f), *dx = fu_malloc_aligned((size_t)n * in * 4);
    float *da = rand_buf((size_t)r * in, 8, 0.0f), *db = rand_buf((size_t)out * r, 9, 0.0f);
    kern_workspace_t *ws = kern_workspace_new(CPU, (size_t)n * r * 4 + 256);
    for (int fa = 1; fa >= 0; fa--) {
        lora_arg l = {mat(x, n, in), mat(w, out, in), mat(a, r, in), mat(b, out, r), mat(h, n, r), mat(y, n, out),
                      mat(dy, n, out), mat(dx, n, in), mat(da, r, in), mat(db, out, r), 2.0f, fa != 0, ws};
        double t = bench_median(run_lora_step, &l, reps(5));
        size_t saved = 0;
        must(kern_lora_saved_bytes(fa ? KERN_ADAPTER_LORA_FA : KERN_ADAPTER_LORA, n, in, r, KERN_F32, &saved),
             "saved bytes");
        /* forward: 2 GEMMs of n·in·out-ish work; backward: dX (n·out·in) plus the rank-r terms */
        double flop = 2.0 * n * in * out * 2 + 2.0 * n * r * (in + out) * (fa ? 3 : 4);
        bench_emit("kernels", "lora_layer",
                   "\"op\":\"%s\",\"shape\":\"n%d_in%d_out%d_r%d\",\"dtype\":\"f32\",\"backend\":\"cpu\","
                   "\"time_s\":%.6g,\"gflops\":%.2f,\"saved_activation_bytes\":%zu",
                   fa ? "lora_fa_fwd_bwd" : "lora_fwd_bwd", n, in, out, r, t, flop / t * 1e-9, saved);
    }
    kern_workspace_destroy(&ws);
    float *bufs[] = {x, w, a, b, h, y, dy, dx, da, db};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        fu_free_aligned(bufs[i]);
}

/* ---- RMSNorm ---- */

typedef struct {
    kern_tensor_t x, w, y, dy, dx, dw;
} norm_arg;

static void run_norm_fwd(void *p)
{
    norm_arg *a = p;
    must(kern_rmsnorm_forward(CPU, &a->x, &a->w, 1e-5f, &a->y), "rmsnorm");
}

static void run_norm_bwd(void *p)
{
    norm_arg *a = p;
    must(kern_rmsnorm_backward(CPU, &a->dy, &a->x, &a->w, 1e-5f, &a->dx, &a->dw), "rmsnorm backward");
}

BENCH_CASE(kernels_rmsnorm)
{
    int n = bench_quick() ? 128 : 512, d = bench_quick() ? 768 : 4096;
    float *x = rand_buf((size_t)n * d, 10, 1.0f), *w = rand_buf((size_t)d, 11, 1.0f);
    float *y = fu_malloc_aligned((size_t)n * d * 4), *dy = rand_buf((size_t)n * d, 12, 1.0f);
    float *dx = fu_malloc_aligned((size_t)n * d * 4), *dw = rand_buf((size_t)d, 13, 0.0f);
    norm_arg a = {mat(x, n, d), mat(w, 1, d), mat(y, n, d), mat(dy, n, d), mat(dx, n, d), mat(dw, 1, d)};
    int64_t dd = d;
    must(kern_tensor_reshape(&a.w, 1, &dd, &a.w), "reshape");
    must(kern_tensor_reshape(&a.dw, 1, &dd, &a.dw), "reshape");
    double tf = bench_median(run_norm_fwd, &a, reps(20));
    double tb = bench_median(run_norm_bwd, &a, reps(20));
    double bytes = (double)n * d * 4;
    bench_emit("kernels", "rmsnorm",
               "\"op\":\"rmsnorm_fwd\",\"shape\":\"%dx%d\",\"dtype\":\"f32\",\"backend\":\"cpu\",\"time_s\":%.6g,"
               "\"gbps\":%.2f",
               n, d, tf, 2 * bytes / tf * 1e-9);
    bench_emit("kernels", "rmsnorm",
               "\"op\":\"rmsnorm_bwd\",\"shape\":\"%dx%d\",\"dtype\":\"f32\",\"backend\":\"cpu\",\"time_s\":%.6g,"
               "\"gbps\":%.2f",
               n, d, tb, 5 * bytes / tb * 1e-9);
    float *bufs[] = {x, w, y, dy, dx, dw};
    for (size_t i = 0; i < 6; i++)
        fu_free_aligned(bufs[i]);
}

/* ---- attention ---- */

typedef struct {
    kern_attn_params p;
    kern_tensor_t    q, k, v, o, dq, dk, dv;
    kern_workspace_t *ws;
} attn_arg;

static void run_attn_fwd(void *p)
{
    attn_arg *a = p;
    must(kern_attn_forward(CPU, &a->p, &a->q, &a->k, &a->v, &a->o, a->ws), "attention");
}

static void run_attn_bwd(void *p)
{
    attn_arg *a = p;
    must(kern_attn_backward(CPU, &a->p, &a->q, &a->k, &a->v, &a->o, &a->dq, &a->dk, &a->dv, a->ws),
         "attention backward");
}

BENCH_CASE(kernels_attention)
{
    /* training / prefill: T tokens, 12 query heads over 4 KV heads, head_dim 64 */
    int T = bench_quick() ? 128 : 512, hq = 12, hkv = 4, d = 64;
    size_t nq = (size_t)T * hq * d, nk = (size_t)T * hkv * d;
    float *q = rand_buf(nq, 14, 1.0f), *k = rand_buf(nk, 15, 1.0f), *v = rand_buf(nk, 16, 1.0f);
    float *o = rand_buf(nq, 17, 1.0f), *dq = fu_malloc_aligned(nq * 4), *dk = fu_malloc_aligned(nk * 4),
          *dv = fu_malloc_aligned(nk * 4);
    attn_arg a = {{.n_head = hq, .n_kv_head = hkv, .head_dim = d, .n_seq = 1, .q_offset = 0},
                  mat(q, T, hq * d), mat(k, T, hkv * d), mat(v, T, hkv * d), mat(o, T, hq * d),
                  mat(dq, T, hq * d), mat(dk, T, hkv * d), mat(dv, T, hkv * d), NULL};
    size_t wsb = 0;
    must(kern_attn_workspace_bytes(CPU, &a.p, T, T, true, &wsb), "ws bytes");
    a.ws = kern_workspace_new(CPU, wsb);
    double flop = 4.0 * T * T * hq * d; /* QKᵀ and PV, dense-equivalent */
    double tf = bench_median(run_attn_fwd, &a, reps(7));
    double tb = bench_median(run_attn_bwd, &a, reps(5));
    bench_emit("kernels", "attention",
               "\"op\":\"attn_fwd\",\"shape\":\"T%d_hq%d_hkv%d_d%d\",\"dtype\":\"f32\",\"backend\":\"cpu\","
               "\"time_s\":%.6g,\"gflops\":%.2f",
               T, hq, hkv, d, tf, flop / tf * 1e-9);
    bench_emit("kernels", "attention",
               "\"op\":\"attn_bwd\",\"shape\":\"T%d_hq%d_hkv%d_d%d\",\"dtype\":\"f32\",\"backend\":\"cpu\","
               "\"time_s\":%.6g,\"gflops\":%.2f",
               T, hq, hkv, d, tb, 2.5 * flop / tb * 1e-9);
    kern_workspace_destroy(&a.ws);

    /* decode: one new token against a cache of L positions (GQA 32:8, head_dim 128) */
    int L = bench_quick() ? 256 : 2048, dh = 128, Hq = 32, Hkv = 8;
    size_t ck = (size_t)L * Hkv * dh;
    float *kc = rand_buf(ck, 18, 1.0f), *vc = rand_buf(ck, 19, 1.0f), *q1 = rand_buf((size_t)Hq * dh, 20, 1.0f);
    float *o1 = fu_malloc_aligned((size_t)Hq * dh * 4);
    attn_arg dcd = {{.n_head = Hq, .n_kv_head = Hkv, .head_dim = dh, .n_seq = 1, .q_offset = L - 1},
                    mat(q1, 1, Hq * dh), mat(kc, L, Hkv * dh), mat(vc, L, Hkv * dh), mat(o1, 1, Hq * dh),
                    mat(q1, 1, Hq * dh), mat(kc, L, Hkv * dh), mat(vc, L, Hkv * dh), NULL};
    double td = bench_median(run_attn_fwd, &dcd, reps(50));
    double cache_bytes = 2.0 * (double)ck * 4;
    bench_emit("kernels", "attention",
               "\"op\":\"attn_decode\",\"shape\":\"L%d_hq%d_hkv%d_d%d\",\"dtype\":\"f32\",\"backend\":\"cpu\","
               "\"time_s\":%.6g,\"gbps\":%.2f",
               L, Hq, Hkv, dh, td, cache_bytes / td * 1e-9);
    float *bufs[] = {q, k, v, o, dq, dk, dv, kc, vc, q1, o1};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        fu_free_aligned(bufs[i]);
}

/* ---- softmax cross-entropy ---- */

typedef struct {
    kern_tensor_t logits, targets, dlogits;
} xent_arg;

static void run_xent(void *p)
{
    xent_arg *a = p;
    float loss;
    int64_t nv;
    must(kern_xent_forward(CPU, &a->logits, &a->targets, KERN_XENT_IGNORE_DEFAULT, &loss, &nv), "xent");
    must(kern_xent_backward(CPU, &a->logits, &a->targets, KERN_XENT_IGNORE_DEFAULT, 1.0f, &a->dlogits), "xent bwd");
}

static void run_xent_fused(void *p)
{
    xent_arg *a = p;
    float loss;
    int64_t nv;
    must(kern_xent_forward_backward(CPU, &a->logits, &a->targets, KERN_XENT_IGNORE_DEFAULT, 1.0f, &loss, &nv,
                                    &a->dlogits),
         "xent fused");
}

BENCH_CASE(kernels_xent)
{
    int n = bench_quick() ? 64 : 512, V = 32000;
    float *l = rand_buf((size_t)n * V, 21, 4.0f), *dl = fu_malloc_aligned((size_t)n * V * 4);
    int32_t *t = fu_malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++)
        t[i] = (int32_t)((i * 7919) % V);
    xent_arg a = {mat(l, n, V), {0}, mat(dl, n, V)};
    int64_t nn = n;
    must(kern_tensor_wrap(&a.targets, t, KERN_I32, 1, &nn, (kern_device){KERN_DEV_CPU, 0}), "wrap");
    double ts = bench_median(run_xent, &a, reps(7));
    double tf = bench_median(run_xent_fused, &a, reps(7));
    double bytes = (double)n * V * 4 * 2; /* logits read, gradient written (minimum traffic) */
    bench_emit("kernels", "xent",
               "\"op\":\"softmax_xent_fwd_then_bwd\",\"shape\":\"%dx%d\",\"dtype\":\"f32\",\"backend\":\"cpu\","
               "\"time_s\":%.6g,\"gbps\":%.2f",
               n, V, ts, bytes / ts * 1e-9);
    bench_emit("kernels", "xent",
               "\"op\":\"softmax_xent_fused\",\"shape\":\"%dx%d\",\"dtype\":\"f32\",\"backend\":\"cpu\","
               "\"time_s\":%.6g,\"gbps\":%.2f",
               n, V, tf, bytes / tf * 1e-9);
    fu_free_aligned(l);
    fu_free_aligned(dl);
    free(t);
}
