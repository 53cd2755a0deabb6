/* Causal grouped-query attention: forward against a plain loop (both CPU paths), backward against
 * finite differences, and KV-cache decoding against full causal attention. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "kern_backend.h"
#include "kern_internal.h"
#include "kern_kvcache.h"
#include "test_kern_util.h"

#define CPU kern_backend_cpu()

/* Plain loop: per sequence, head, query; causal over keys 0..q_offset+i (with a sliding window, the
 * last `window` of them); GQA head mapping. */
static void ref_attn(const kern_attn_params *p, int64_t tq, int64_t tk, const float *q, const float *k, const float *v,
                     double *o)
{
    int64_t D = p->head_dim, Hq = p->n_head, Hkv = p->n_kv_head, group = Hq / Hkv;
    double scale = p->scale != 0.0f ? p->scale : 1.0 / sqrt((double)D);
    double *sc = malloc((size_t)tk * sizeof(double));
    for (int64_t s = 0; s < p->n_seq; s++)
        for (int64_t h = 0; h < Hq; h++) {
            int64_t g = h / group;
            for (int64_t i = 0; i < tq; i++) {
                const float *qi = q + (s * tq + i) * Hq * D + h * D;
                int64_t lim = p->q_offset + i + 1, lo = p->window && lim > p->window ? lim - p->window : 0;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j < lo; j++)
                    sc[j] = 0;
                for (int64_t j = lo; j < lim; j++) {
                    const float *kj = k + (s * tk + j) * Hkv * D + g * D;
                    double d = 0;
                    for (int64_t c = 0; c < D; c++)
                        d += (double)qi[c] * kj[c];
                    sc[j] = d * scale;
                    mx = fmax(mx, sc[j]);
                }
                for (int64_t j = lo; j < lim; j++)
                    sum += (sc[j] = exp(sc[j] - mx));
                double *oi = o + (s * tq + i) * Hq * D + h * D;
                for (int64_t c = 0; c < D; c++) {
                    double acc = 0;
                    for (int64_t j = 0; j < lim; j++)
                        acc += sc[j] * v[(s * tk + j) * Hkv * D + g * D + c];
                    oi[c] = acc / sum;
                }
            }
        }
    free(sc);
}

static void test_kern_attn_backward_blocked_matches_fd(void **state);

static void check_forward_w(int n_seq, int64_t tq, int64_t tk, int64_t q_offset, int hq, int hkv, int d, uint64_t seed,
                            int64_t window)
{
    kern_attn_params p = {.n_head = hq, .n_kv_head = hkv, .head_dim = d, .n_seq = n_seq, .q_offset = q_offset,
                          .window = window};
    size_t nq = (size_t)(n_seq * tq * hq * d), nk = (size_t)(n_seq * tk * hkv * d);
    float *q = tk_rand(nq, seed, -1, 1), *k = tk_rand(nk, seed + 1, -1, 1), *v = tk_rand(nk, seed + 2, -1, 1);
    float *o = tk_zeros(nq);
    double *ref = malloc(nq * sizeof(double));
    kern_tensor_t Q = tk_f2(q, n_seq * tq, hq * d), K = tk_f2(k, n_seq * tk, hkv * d), Vt = tk_f2(v, n_seq * tk, hkv * d);
    kern_tensor_t O = tk_f2(o, n_seq * tq, hq * d);
    /* with and without an explicit workspace */
    size_t bytes = 0;
    assert_int_equal(kern_attn_workspace_bytes(CPU, &p, tq, tk, false, &bytes), FU_OK);
    kern_workspace_t *ws = kern_workspace_new(CPU, bytes);
    assert_non_null(ws);
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &K, &Vt, &O, ws), FU_OK);
    assert_int_equal(kern_workspace_used(ws), 0);
    ref_attn(&p, tq, tk, q, k, v, ref);
    assert_true(tk_close_ratio(o, ref, nq, 1e-5, 1e-4) <= 1.0);
    memset(o, 0, nq * sizeof(float));
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &K, &Vt, &O, NULL), FU_OK);
    assert_true(tk_close_ratio(o, ref, nq, 1e-5, 1e-4) <= 1.0);
    /* a workspace that is too small is refused, not overrun */
    kern_workspace_t *tiny = kern_workspace_new(CPU, 8);
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &K, &Vt, &O, tiny), FU_ENOMEM);
    kern_workspace_destroy(&tiny);
    kern_workspace_destroy(&ws);
    free(q), free(k), free(v), free(o), free(ref);
}

static void check_forward(int n_seq, int64_t tq, int64_t tk, int64_t q_offset, int hq, int hkv, int d, uint64_t seed)
{
    check_forward_w(n_seq, tq, tk, q_offset, hq, hkv, d, seed, 0);
}

static void test_kern_attn_gqa_matches_plain_loop(void **state)
{
    (void)state;
    check_forward(1, 12, 12, 0, 4, 2, 8, 100); /* GEMM path, GQA 2:1 */
    check_forward(2, 16, 16, 0, 6, 2, 4, 110); /* two sequences, GQA 3:1 */
    check_forward(1, 20, 20, 0, 2, 2, 8, 120); /* plain MHA */
    check_forward(1, 4, 10, 6, 4, 1, 8, 130);  /* few queries at an offset: hand-written path, MQA */
    check_forward(2, 3, 3, 0, 4, 2, 8, 140);   /* hand-written path, two sequences */
    check_forward(1, 12, 20, 8, 4, 2, 8, 150); /* GEMM path with an offset (chunked prefill) */
    check_forward(1, 1, 9, 8, 4, 4, 8, 190);     /* decode, MHA: gemv */
    check_forward(3, 1, 9, 8, 6, 2, 8, 191);     /* decode, GQA 3:1, three sequences */
    check_forward(1, 1, 30, 20, 4, 1, 8, 192);   /* decode at an earlier position (keys beyond ignored) */
    check_forward(1, 300, 300, 0, 2, 1, 8, 160); /* several query blocks */
    check_forward(2, 140, 200, 60, 4, 2, 8, 170); /* blocks with an offset, two sequences */
}

/* The same checks with three threads and every OpenMP region forced to split. */
static void test_kern_attn_threaded_paths(void **state)
{
    (void)state;
    int64_t par0 = kern_cpu_par_min();
    assert_int_equal(kern_cpu_set_threads(3), FU_OK);
    kern_cpu_set_par_min(0);
    check_forward(1, 12, 12, 0, 4, 2, 8, 100);
    check_forward(1, 4, 10, 6, 4, 1, 8, 130);
    check_forward(2, 3, 3, 0, 4, 2, 8, 140);
    check_forward(1, 1, 40, 39, 8, 2, 16, 180); /* decode: heads split over threads */
    check_forward(2, 140, 200, 60, 4, 2, 8, 170);
    test_kern_attn_backward_blocked_matches_fd(state);
    kern_cpu_set_par_min(par0);
    assert_int_equal(kern_cpu_set_threads(0), FU_OK);
}

typedef struct {
    kern_attn_params p;
    kern_tensor_t q, k, v, o;
} attn_ctx;

static void attn_fwd(void *c)
{
    attn_ctx *a = c;
    assert_int_equal(kern_attn_forward(CPU, &a->p, &a->q, &a->k, &a->v, &a->o, NULL), FU_OK);
}

/* Mistral's sliding window: a query sees itself and the window - 1 keys before it, on every path
 * (GEMM blocks, the hand-written rows, decode with a KV cache offset), and backward agrees with
 * finite differences. */
static void test_kern_attn_sliding_window(void **state)
{
    (void)state;
    check_forward_w(1, 12, 12, 0, 4, 2, 8, 500, 4);   /* GEMM path */
    check_forward_w(2, 3, 3, 0, 4, 2, 8, 510, 2);     /* hand-written rows */
    check_forward_w(1, 4, 10, 6, 4, 1, 8, 520, 3);    /* few queries at an offset */
    check_forward_w(1, 1, 30, 20, 4, 1, 8, 530, 5);   /* decode, MQA (gemv) */
    check_forward_w(3, 1, 9, 8, 6, 2, 8, 540, 4);     /* decode, GQA */
    check_forward_w(1, 300, 300, 0, 2, 1, 8, 550, 37); /* several query blocks */
    check_forward_w(1, 12, 12, 0, 4, 2, 8, 560, 100); /* a window longer than the sequence: causal */
    const int hq = 4, hkv = 2, d = 4;
    const int64_t t = 9;
    size_t nq = (size_t)(t * hq * d), nk = (size_t)(t * hkv * d);
    float *q = tk_rand(nq, 570, -1, 1), *k = tk_rand(nk, 571, -1, 1), *v = tk_rand(nk, 572, -1, 1);
    float *o = tk_zeros(nq), *R = tk_rand(nq, 573, -1, 1);
    float *dq = tk_zeros(nq), *dk = tk_zeros(nk), *dv = tk_zeros(nk);
    attn_ctx c = {{.n_head = hq, .n_kv_head = hkv, .head_dim = d, .n_seq = 1, .q_offset = 0, .window = 3},
                  tk_f2(q, t, hq * d), tk_f2(k, t, hkv * d), tk_f2(v, t, hkv * d), tk_f2(o, t, hq * d)};
    kern_tensor_t dO = tk_f2(R, t, hq * d), dQ = tk_f2(dq, t, hq * d);
    kern_tensor_t dK = tk_f2(dk, t, hkv * d), dV = tk_f2(dv, t, hkv * d);
    assert_int_equal(kern_attn_backward(CPU, &c.p, &c.q, &c.k, &c.v, &dO, &dQ, &dK, &dV, NULL), FU_OK);
    assert_true(tk_grad_check(attn_fwd, &c, q, nq, dq, o, R, nq, 1e-2f, 2e-3, 2e-2, 80) <= 1.0);
    assert_true(tk_grad_check(attn_fwd, &c, k, nk, dk, o, R, nq, 1e-2f, 2e-3, 2e-2, 80) <= 1.0);
    assert_true(tk_grad_check(attn_fwd, &c, v, nk, dv, o, R, nq, 1e-2f, 2e-3, 2e-2, 80) <= 1.0);
    c.p.window = -1; /* refused */
    assert_int_equal(kern_attn_forward(CPU, &c.p, &c.q, &c.k, &c.v, &c.o, NULL), FU_EINVAL);
    free(q), free(k), free(v), free(o), free(R), free(dq), free(dk), free(dv);
}

static void test_kern_attn_backward_matches_fd(void **state)
{
    (void)state;
    const int n_seq = 2, hq = 4, hkv = 2, d = 4;
    const int64_t t = 5;
    size_t nq = (size_t)(n_seq * t * hq * d), nk = (size_t)(n_seq * t * hkv * d);
    float *q = tk_rand(nq, 200, -1, 1), *k = tk_rand(nk, 201, -1, 1), *v = tk_rand(nk, 202, -1, 1);
    float *o = tk_zeros(nq), *R = tk_rand(nq, 203, -1, 1);
    float *dq = tk_zeros(nq), *dk = tk_zeros(nk), *dv = tk_zeros(nk);
    attn_ctx c = {{.n_head = hq, .n_kv_head = hkv, .head_dim = d, .n_seq = n_seq, .q_offset = 0},
                  tk_f2(q, n_seq * t, hq * d), tk_f2(k, n_seq * t, hkv * d), tk_f2(v, n_seq * t, hkv * d),
                  tk_f2(o, n_seq * t, hq * d)};
    kern_tensor_t dO = tk_f2(R, n_seq * t, hq * d), dQ = tk_f2(dq, n_seq * t, hq * d);
    kern_tensor_t dK = tk_f2(dk, n_seq * t, hkv * d), dV = tk_f2(dv, n_seq * t, hkv * d);
    size_t bytes = 0;
    assert_int_equal(kern_attn_workspace_bytes(CPU, &c.p, t, t, true, &bytes), FU_OK);
    kern_workspace_t *ws = kern_workspace_new(CPU, bytes);
    assert_int_equal(kern_attn_backward(CPU, &c.p, &c.q, &c.k, &c.v, &dO, &dQ, &dK, &dV, ws), FU_OK);
    kern_workspace_destroy(&ws);
    assert_true(tk_grad_check(attn_fwd, &c, q, nq, dq, o, R, nq, 1e-2f, 2e-3, 2e-2, 160) <= 1.0);
    assert_true(tk_grad_check(attn_fwd, &c, k, nk, dk, o, R, nq, 1e-2f, 2e-3, 2e-2, 80) <= 1.0);
    assert_true(tk_grad_check(attn_fwd, &c, v, nk, dv, o, R, nq, 1e-2f, 2e-3, 2e-2, 80) <= 1.0);
    /* the last key of each sequence is seen only by the last query: check causality of dK */
    float *dk2 = tk_zeros(nk), *R2 = tk_zeros(nq);
    memcpy(R2, R, (size_t)((t - 1) * hq * d) * sizeof(float)); /* dO = 0 for the last query of seq 0 */
    kern_tensor_t dO2 = tk_f2(R2, n_seq * t, hq * d), dK2 = tk_f2(dk2, n_seq * t, hkv * d);
    assert_int_equal(kern_attn_backward(CPU, &c.p, &c.q, &c.k, &c.v, &dO2, &dQ, &dK2, &dV, NULL), FU_OK);
    for (int64_t j = 0; j < hkv * d; j++)
        assert_float_equal(dk2[(t - 1) * hkv * d + j], 0.0f, 0);
    free(q), free(k), free(v), free(o), free(R), free(dq), free(dk), free(dv), free(dk2), free(R2);
}

/* Backward over several query blocks, with an offset (chunked prefill: more keys than queries). */
static void test_kern_attn_backward_blocked_matches_fd(void **state)
{
    (void)state;
    static const int64_t cfg[][3] = {{300, 300, 0}, {200, 260, 60}}; /* tq, tk, q_offset */
    for (int ci = 0; ci < 2; ci++) {
        const int hq = 2, hkv = 1, d = 4;
        const int64_t tq = cfg[ci][0], tk = cfg[ci][1];
        size_t nq = (size_t)(tq * hq * d), nk = (size_t)(tk * hkv * d);
        float *q = tk_rand(nq, 400, -1, 1), *k = tk_rand(nk, 401, -1, 1), *v = tk_rand(nk, 402, -1, 1);
        float *o = tk_zeros(nq), *R = tk_rand(nq, 403, -1, 1);
        float *dq = tk_zeros(nq), *dk = tk_zeros(nk), *dv = tk_zeros(nk);
        attn_ctx c = {{.n_head = hq, .n_kv_head = hkv, .head_dim = d, .n_seq = 1, .q_offset = cfg[ci][2]},
                      tk_f2(q, tq, hq * d), tk_f2(k, tk, hkv * d), tk_f2(v, tk, hkv * d), tk_f2(o, tq, hq * d)};
        kern_tensor_t dO = tk_f2(R, tq, hq * d), dQ = tk_f2(dq, tq, hq * d);
        kern_tensor_t dK = tk_f2(dk, tk, hkv * d), dV = tk_f2(dv, tk, hkv * d);
        assert_int_equal(kern_attn_backward(CPU, &c.p, &c.q, &c.k, &c.v, &dO, &dQ, &dK, &dV, NULL), FU_OK);
        assert_true(tk_grad_check(attn_fwd, &c, q, nq, dq, o, R, nq, 1e-2f, 2e-3, 2e-2, 24) <= 1.0);
        assert_true(tk_grad_check(attn_fwd, &c, k, nk, dk, o, R, nq, 1e-2f, 2e-3, 2e-2, 24) <= 1.0);
        assert_true(tk_grad_check(attn_fwd, &c, v, nk, dv, o, R, nq, 1e-2f, 2e-3, 2e-2, 24) <= 1.0);
        free(q), free(k), free(v), free(o), free(R), free(dq), free(dk), free(dv);
    }
}

static void test_kern_attn_kvcache_decode_equals_full(void **state)
{
    (void)state;
    const int hq = 4, hkv = 2, d = 8;
    const int64_t T = 9, prefill = 5;
    size_t nq = (size_t)(T * hq * d), nk = (size_t)(T * hkv * d);
    float *q = tk_rand(nq, 300, -1, 1), *k = tk_rand(nk, 301, -1, 1), *v = tk_rand(nk, 302, -1, 1);
    float *full = tk_zeros(nq), *step = tk_zeros(nq);
    kern_attn_params p = {.n_head = hq, .n_kv_head = hkv, .head_dim = d, .n_seq = 1, .q_offset = 0};
    kern_tensor_t Q = tk_f2(q, T, hq * d), K = tk_f2(k, T, hkv * d), V = tk_f2(v, T, hkv * d), F = tk_f2(full, T, hq * d);
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &K, &V, &F, NULL), FU_OK);

    kern_kvcache_t *cache = NULL;
    assert_int_equal(kern_kvcache_new(CPU, KERN_F32, hkv, d, 16, &cache), FU_OK);
    /* prefill the first positions in one call, then decode one token at a time */
    kern_tensor_t q0, k0, v0, o0;
    kern_tensor_t S = tk_f2(step, T, hq * d);
    assert_int_equal(kern_tensor_slice(&Q, 0, 0, prefill, &q0), FU_OK);
    assert_int_equal(kern_tensor_slice(&K, 0, 0, prefill, &k0), FU_OK);
    assert_int_equal(kern_tensor_slice(&V, 0, 0, prefill, &v0), FU_OK);
    assert_int_equal(kern_tensor_slice(&S, 0, 0, prefill, &o0), FU_OK);
    assert_int_equal(kern_kvcache_attend(cache, &p, &q0, &k0, &v0, &o0, NULL), FU_OK);
    assert_int_equal(kern_kvcache_len(cache), prefill);
    for (int64_t t = prefill; t < T; t++) {
        kern_tensor_t qt, kt, vt, ot;
        assert_int_equal(kern_tensor_slice(&Q, 0, t, 1, &qt), FU_OK);
        assert_int_equal(kern_tensor_slice(&K, 0, t, 1, &kt), FU_OK);
        assert_int_equal(kern_tensor_slice(&V, 0, t, 1, &vt), FU_OK);
        assert_int_equal(kern_tensor_slice(&S, 0, t, 1, &ot), FU_OK);
        assert_int_equal(kern_kvcache_attend(cache, &p, &qt, &kt, &vt, &ot, NULL), FU_OK);
    }
    assert_int_equal(kern_kvcache_len(cache), T);
    assert_true(tk_close_ratio_f(step, full, nq, 1e-5, 1e-4) <= 1.0);
    /* the cache holds exactly what was appended */
    kern_tensor_t ck, cv;
    assert_int_equal(kern_kvcache_view(cache, &ck, &cv), FU_OK);
    assert_int_equal(ck.shape[0], T);
    assert_memory_equal(ck.data, k, nk * sizeof(float));
    assert_memory_equal(cv.data, v, nk * sizeof(float));
    /* rollback and replay of the last token reproduces the last row */
    assert_int_equal(kern_kvcache_truncate(cache, T - 1), FU_OK);
    float last[32];
    kern_tensor_t qt, kt, vt, lt = tk_f2(last, 1, hq * d);
    assert_int_equal(kern_tensor_slice(&Q, 0, T - 1, 1, &qt), FU_OK);
    assert_int_equal(kern_tensor_slice(&K, 0, T - 1, 1, &kt), FU_OK);
    assert_int_equal(kern_tensor_slice(&V, 0, T - 1, 1, &vt), FU_OK);
    assert_int_equal(kern_kvcache_attend(cache, &p, &qt, &kt, &vt, &lt, NULL), FU_OK);
    assert_memory_equal(last, step + (T - 1) * hq * d, sizeof last);
    /* misuse */
    assert_int_equal(kern_kvcache_truncate(cache, T + 1), FU_EINVAL);
    kern_attn_params bad = p;
    bad.n_kv_head = 1;
    assert_int_equal(kern_kvcache_attend(cache, &bad, &qt, &kt, &vt, &lt, NULL), FU_EINVAL);
    kern_tensor_t k9;
    assert_int_equal(kern_tensor_slice(&K, 0, 0, 8, &k9), FU_OK);
    assert_int_equal(kern_kvcache_append(cache, &k9, &k9), FU_ENOMEM); /* 9 + 8 > 16 */
    assert_int_equal(kern_kvcache_len(cache), T);
    kern_kvcache_destroy(&cache);
    assert_null(cache);
    assert_int_equal(kern_kvcache_new(CPU, KERN_F32, 0, d, 16, &cache), FU_EINVAL);
    assert_int_equal(kern_kvcache_new(CPU, KERN_F16, hkv, d, 16, &cache), FU_EINVAL); /* CPU computes in f32 */
    assert_int_equal(kern_kvcache_new(CPU, KERN_I32, hkv, d, 16, &cache), FU_EINVAL);
    free(q), free(k), free(v), free(full), free(step);
}

static void test_kern_attn_bad_arguments_return_einval(void **state)
{
    (void)state;
    float q[64] = {0}, k[64] = {0}, v[64] = {0}, o[64] = {0};
    kern_attn_params p = {.n_head = 2, .n_kv_head = 1, .head_dim = 4, .n_seq = 1, .q_offset = 0};
    kern_tensor_t Q = tk_f2(q, 4, 8), K = tk_f2(k, 4, 4), V = tk_f2(v, 4, 4), O = tk_f2(o, 4, 8);
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &K, &V, &O, NULL), FU_OK);
    kern_attn_params b = p;
    b.n_kv_head = 3; /* does not divide */
    assert_int_equal(kern_attn_forward(CPU, &b, &Q, &K, &V, &O, NULL), FU_EINVAL);
    b = p;
    b.head_dim = 0;
    assert_int_equal(kern_attn_forward(CPU, &b, &Q, &K, &V, &O, NULL), FU_EINVAL);
    b = p;
    b.q_offset = 1; /* 1 + 4 queries > 4 keys */
    assert_int_equal(kern_attn_forward(CPU, &b, &Q, &K, &V, &O, NULL), FU_EINVAL);
    b = p;
    b.q_offset = -1;
    assert_int_equal(kern_attn_forward(CPU, &b, &Q, &K, &V, &O, NULL), FU_EINVAL);
    b = p;
    b.n_seq = 3; /* 4 rows do not split into 3 sequences */
    assert_int_equal(kern_attn_forward(CPU, &b, &Q, &K, &V, &O, NULL), FU_EINVAL);
    b = p;
    b.scale = NAN;
    assert_int_equal(kern_attn_forward(CPU, &b, &Q, &K, &V, &O, NULL), FU_EINVAL);
    kern_tensor_t K8 = tk_f2(k, 4, 8);
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &K8, &V, &O, NULL), FU_EINVAL);
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &K, &V, &Q, NULL), FU_EINVAL); /* o aliases q */
    assert_int_equal(kern_attn_forward(CPU, NULL, &Q, &K, &V, &O, NULL), FU_EINVAL);
    kern_tensor_t Kh = tk_t(k, KERN_BF16, 2, 4, 4, 1);
    assert_int_equal(kern_attn_forward(CPU, &p, &Q, &Kh, &V, &O, NULL), FU_EINVAL);
    assert_int_equal(kern_attn_backward(CPU, &p, &Q, &K, &V, &O, &Q, &K, &V, NULL), FU_EINVAL); /* aliasing */
    float dq[64], dk[64], dv[64];
    kern_tensor_t dQ = tk_f2(dq, 4, 8), dK = tk_f2(dk, 4, 4), dV = tk_f2(dv, 4, 8);
    assert_int_equal(kern_attn_backward(CPU, &p, &Q, &K, &V, &O, &dQ, &dK, &dV, NULL), FU_EINVAL);
    size_t bytes;
    assert_int_equal(kern_attn_workspace_bytes(CPU, &p, -1, 4, false, &bytes), FU_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_attn_gqa_matches_plain_loop),
        cmocka_unit_test(test_kern_attn_sliding_window),
        cmocka_unit_test(test_kern_attn_backward_matches_fd),
        cmocka_unit_test(test_kern_attn_backward_blocked_matches_fd),
        cmocka_unit_test(test_kern_attn_kvcache_decode_equals_full),
        cmocka_unit_test(test_kern_attn_threaded_paths),
        cmocka_unit_test(test_kern_attn_bad_arguments_return_einval),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
