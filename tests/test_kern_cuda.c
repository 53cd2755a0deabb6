/* CUDA backend: every op against the CPU op on the same inputs (f32, f16, bf16 with per-dtype
 * bounds), plus the failure paths (absurd allocations, bad shapes, bad ids/targets, unknown
 * devices). Exits 77 (skipped) without a CUDA device. */
#include <pthread.h>

#include "test_kern_cuda_util.h"

/* ---------------------------------------------------------------------------------------------- */
/* Backends, memory, failure paths */

static void test_kern_cuda_lookup(void **state)
{
    (void)state;
    const kern_backend_t *be = NULL;
    assert_int_equal(kern_backend_get("cuda", &be), FU_OK);
    assert_ptr_equal(be, tc_gpu);
    assert_string_equal(be->name, "cuda:0");
    assert_int_equal(be->device.kind, KERN_DEV_CUDA);
    assert_int_equal(kern_backend_get("cuda:1000", &be), FU_ENOTFOUND);
    assert_int_equal(kern_backend_get("cuda:x", &be), FU_EINVAL);
    kern_backend_t *own = NULL;
    assert_int_equal(kern_backend_cuda_open(kern_cuda_device_count(), &own), FU_ENOTFOUND);
    assert_null(own);
    assert_int_equal(kern_backend_cuda_open(0, &own), FU_OK);
    assert_non_null(own);
    kern_backend_cuda_close(&own);
    assert_null(own);
    kern_backend_cuda_close(&own); /* idempotent */
    kern_cuda_info info;
    assert_int_equal(kern_cuda_device_info(0, &info), FU_OK);
    assert_true(info.sm_count > 0 && info.total_bytes > 0 && info.free_bytes <= info.total_bytes);
    assert_true(info.name[0] != '\0');
    assert_int_equal(kern_cuda_device_info(-1, &info), FU_ENOTFOUND);
}

static void test_kern_cuda_oom_is_an_error(void **state)
{
    (void)state;
    void *p = NULL;
    /* 1 PiB: no device has it; must be FU_ENOMEM, not an abort, and leave the device usable. */
    assert_int_equal(tc_gpu->alloc(tc_gpu, (size_t)1 << 50, &p), FU_ENOMEM);
    assert_null(p);
    assert_int_equal(tc_gpu->alloc(tc_gpu, SIZE_MAX - 16, &p), FU_ENOMEM);
    int64_t shape[2] = {(int64_t)1 << 24, (int64_t)1 << 24};
    kern_tensor_t *t = NULL;
    fu_err rc = kern_tensor_new(tc_gpu, KERN_F32, 2, shape, &t);
    assert_true(rc == FU_ENOMEM || rc == FU_EINVAL);
    assert_null(t);
    float h[4] = {1, 2, 3, 4};
    kern_tensor_t *ok = tc_up(tc_gpu, KERN_F32, h, 1, 4, 1);
    float *back = tc_down(tc_gpu, ok);
    assert_memory_equal(back, h, sizeof h);
    free(back);
    kern_tensor_destroy(&ok);
    assert_int_equal(kern_backend_sync(tc_gpu), FU_OK);
}

static void test_kern_cuda_pool_reuses_blocks(void **state)
{
    (void)state;
    kern_backend_t *be = NULL;
    assert_int_equal(kern_backend_cuda_open(0, &be), FU_OK);
    void *a = NULL, *b = NULL;
    assert_int_equal(be->alloc(be, 1000, &a), FU_OK);
    be->free(be, a);
    assert_int_equal(be->alloc(be, 900, &b), FU_OK);
    assert_ptr_equal(a, b); /* same size class, served from the cache */
    size_t live = 0, cached = 0, peak = 0;
    assert_int_equal(kern_cuda_pool_stats(be, &live, &cached, &peak), FU_OK);
    assert_true(live >= 900 && peak >= live);
    be->free(be, b);
    be->free(be, (void *)0x1234); /* unknown pointer: logged and ignored */
    assert_int_equal(kern_cuda_pool_trim(be), FU_OK);
    assert_int_equal(kern_cuda_pool_stats(be, &live, &cached, &peak), FU_OK);
    assert_int_equal(live, 0);
    assert_int_equal(cached, 0);
    kern_backend_cuda_close(&be);
}

static void test_kern_cuda_pinned_host(void **state)
{
    (void)state;
    float *p = NULL;
    assert_int_equal(kern_cuda_host_alloc(4096 * sizeof(float), (void **)&p), FU_OK);
    for (int i = 0; i < 4096; i++)
        p[i] = (float)i;
    kern_tensor_t *t = tc_up(tc_gpu, KERN_F32, p, 1, 4096, 1);
    memset(p, 0, 4096 * sizeof(float));
    assert_int_equal(kern_tensor_copy_out(tc_gpu, t, p, 4096 * sizeof(float)), FU_OK);
    for (int i = 0; i < 4096; i++)
        assert_true(p[i] == (float)i);
    kern_tensor_destroy(&t);
    kern_cuda_host_free(p);
    kern_cuda_host_free(NULL);
}

static void test_kern_cuda_convert_copy_zero(void **state)
{
    (void)state;
    const size_t n = 1000;
    float *h = tk_rand(n, 1, -4, 4);
    for (int s = 0; s < 3; s++)
        for (int d = 0; d < 3; d++) {
            kern_dtype ds = tc_float_dtypes[s], dd = tc_float_dtypes[d];
            float *ref = malloc(n * sizeof(float));
            memcpy(ref, h, n * sizeof(float));
            tc_round(ds, ref, n);
            tc_round(dd, ref, n);
            kern_tensor_t *a = tc_up(tc_gpu, ds, h, 1, (int64_t)n, 1);
            kern_tensor_t *b = tc_zeros(tc_gpu, dd, 1, (int64_t)n, 1);
            assert_int_equal(kern_tensor_convert(tc_gpu, a, b), FU_OK);
            tc_expect("convert", b, ref, (tc_tol){0, 0});
            kern_tensor_t *c = tc_zeros(tc_gpu, dd, 1, (int64_t)n, 1);
            assert_int_equal(kern_tensor_copy(tc_gpu, b, c), FU_OK);
            tc_expect("copy", c, ref, (tc_tol){0, 0});
            assert_int_equal(kern_tensor_zero(tc_gpu, c), FU_OK);
            float *z = tc_down(tc_gpu, c);
            for (size_t i = 0; i < n; i++)
                assert_true(z[i] == 0.0f);
            free(z);
            TC_DESTROY_ALL(&a, &b, &c);
            free(ref);
        }
    free(h);
}

/* ---------------------------------------------------------------------------------------------- */
/* GEMM */

static void gemm_case(kern_dtype dt, bool ta, bool tb, int m, int n, int k, float alpha, float beta)
{
    int ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    float *a = tc_rand_dt(dt, (size_t)ar * ac, 11, -1, 1), *b = tc_rand_dt(dt, (size_t)br * bc, 12, -1, 1);
    float *c = tc_rand_dt(dt, (size_t)m * n, 13, -1, 1);
    kern_tensor_t *ga = tc_up(tc_gpu, dt, a, 2, ar, ac), *gb = tc_up(tc_gpu, dt, b, 2, br, bc);
    kern_tensor_t *gc = tc_up(tc_gpu, dt, c, 2, m, n);
    assert_int_equal(kern_gemm(tc_gpu, ta, tb, alpha, ga, gb, beta, gc), FU_OK);
    kern_tensor_t ca = tc_cpu_t(a, 2, ar, ac), cb = tc_cpu_t(b, 2, br, bc), cc = tc_cpu_t(c, 2, m, n);
    assert_int_equal(kern_gemm(tc_cpu, ta, tb, alpha, &ca, &cb, beta, &cc), FU_OK);
    tc_expect("gemm", gc, c, tc_tol_scaled(dt, dt == KERN_F32 ? 1.0 : 2.0));
    TC_DESTROY_ALL(&ga, &gb, &gc);
    TK_FREE_ALL(a, b, c);
}

static void test_kern_cuda_gemm_matches_cpu(void **state)
{
    (void)state;
    for (int d = 0; d < 3; d++)
        for (int t = 0; t < 4; t++) {
            gemm_case(tc_float_dtypes[d], t & 1, t & 2, 37, 45, 70, 1.0f, 0.0f);
            gemm_case(tc_float_dtypes[d], t & 1, t & 2, 64, 32, 128, 0.5f, 1.0f);
        }
    gemm_case(KERN_F32, false, true, 5, 7, 0, 1.0f, 0.5f); /* k == 0: C = beta·C */
}

static void test_kern_cuda_gemm_column_slice(void **state)
{
    (void)state;
    /* C[:, 8:24] = A · B[:, 8:24] with a strided view of B and C (row strides, as LoRA uses). */
    const int m = 9, k = 13, n = 32;
    float *a = tk_rand((size_t)m * k, 21, -1, 1), *b = tk_rand((size_t)k * n, 22, -1, 1);
    float *c = tk_rand((size_t)m * n, 23, -1, 1);
    kern_tensor_t *ga = tc_up(tc_gpu, KERN_F32, a, 2, m, k), *gb = tc_up(tc_gpu, KERN_F32, b, 2, k, n);
    kern_tensor_t *gc = tc_up(tc_gpu, KERN_F32, c, 2, m, n);
    kern_tensor_t bs, cs, cbs, ccs;
    assert_int_equal(kern_tensor_slice(gb, 1, 8, 16, &bs), FU_OK);
    assert_int_equal(kern_tensor_slice(gc, 1, 8, 16, &cs), FU_OK);
    assert_int_equal(kern_gemm(tc_gpu, false, false, 1.0f, ga, &bs, 0.0f, &cs), FU_OK);
    kern_tensor_t ca = tc_cpu_t(a, 2, m, k), cb = tc_cpu_t(b, 2, k, n), cc = tc_cpu_t(c, 2, m, n);
    assert_int_equal(kern_tensor_slice(&cb, 1, 8, 16, &cbs), FU_OK);
    assert_int_equal(kern_tensor_slice(&cc, 1, 8, 16, &ccs), FU_OK);
    assert_int_equal(kern_gemm(tc_cpu, false, false, 1.0f, &ca, &cbs, 0.0f, &ccs), FU_OK);
    tc_expect("gemm slice", gc, c, tc_tol_of(KERN_F32));
    TC_DESTROY_ALL(&ga, &gb, &gc);
    TK_FREE_ALL(a, b, c);
}

static void test_kern_cuda_bad_shapes(void **state)
{
    (void)state;
    float h[64] = {0};
    kern_tensor_t *a = tc_up(tc_gpu, KERN_F32, h, 2, 4, 4), *b = tc_up(tc_gpu, KERN_F32, h, 2, 3, 4);
    kern_tensor_t *c = tc_up(tc_gpu, KERN_F32, h, 2, 4, 4), *hf = tc_up(tc_gpu, KERN_F16, h, 2, 4, 4);
    assert_int_equal(kern_gemm(tc_gpu, false, false, 1.0f, a, b, 0.0f, c), FU_EINVAL);
    assert_int_equal(kern_gemm(tc_gpu, false, false, 1.0f, a, hf, 0.0f, c), FU_EINVAL); /* mixed dtypes */
    assert_int_equal(kern_add_forward(tc_gpu, a, b, c), FU_EINVAL);
    /* a CPU tensor handed to the CUDA backend */
    kern_tensor_t cpu = tc_cpu_t(h, 2, 4, 4);
    assert_int_equal(kern_add_forward(tc_gpu, a, &cpu, c), FU_EINVAL);
    /* attention: q_offset + tq > tk */
    kern_attn_params p = {.n_head = 2, .n_kv_head = 1, .head_dim = 2, .n_seq = 1, .q_offset = 1};
    assert_int_equal(kern_attn_forward(tc_gpu, &p, a, b, b, c, NULL), FU_EINVAL);
    /* direct table calls check what the backend relies on */
    assert_int_equal(tc_gpu->gemm(tc_gpu, false, false, 1.0f, a, b, 0.0f, c), FU_EINVAL);
    TC_DESTROY_ALL(&a, &b, &c, &hf);
}

/* ---------------------------------------------------------------------------------------------- */
/* Elementwise and row ops */

static void test_kern_cuda_add_axpy(void **state)
{
    (void)state;
    const size_t n = 3000;
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *a = tc_rand_dt(dt, n, 31, -2, 2), *b = tc_rand_dt(dt, n, 32, -2, 2);
        float *y = malloc(n * sizeof(float));
        kern_tensor_t *ga = tc_up(tc_gpu, dt, a, 1, (int64_t)n, 1), *gb = tc_up(tc_gpu, dt, b, 1, (int64_t)n, 1);
        kern_tensor_t *gy = tc_zeros(tc_gpu, dt, 1, (int64_t)n, 1);
        assert_int_equal(kern_add_forward(tc_gpu, ga, gb, gy), FU_OK);
        kern_tensor_t ca = tc_cpu_t(a, 1, (int64_t)n, 1), cb = tc_cpu_t(b, 1, (int64_t)n, 1),
                      cy = tc_cpu_t(y, 1, (int64_t)n, 1);
        assert_int_equal(kern_add_forward(tc_cpu, &ca, &cb, &cy), FU_OK);
        tc_expect("add", gy, y, tc_tol_of(dt));
        assert_int_equal(kern_add_forward(tc_gpu, ga, gb, ga), FU_OK); /* in place */
        tc_expect("add in place", ga, y, tc_tol_of(dt));
        assert_int_equal(kern_axpy(tc_gpu, -0.5f, gb, gy), FU_OK);
        assert_int_equal(kern_axpy(tc_cpu, -0.5f, &cb, &cy), FU_OK);
        tc_expect("axpy", gy, y, tc_tol_scaled(dt, 2.0));
        TC_DESTROY_ALL(&ga, &gb, &gy);
        TK_FREE_ALL(a, b, y);
    }
}

static void test_kern_cuda_embedding(void **state)
{
    (void)state;
    const int64_t V = 50, D = 72, n = 19;
    int32_t ids[19];
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)((i * 7) % V);
    ids[5] = ids[3]; /* repeated id: scatter-add must sum */
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *table = tc_rand_dt(dt, (size_t)(V * D), 41, -1, 1);
        float *dout = tc_rand_dt(dt, (size_t)(n * D), 42, -1, 1);
        float *out = malloc((size_t)(n * D) * sizeof(float)), *dtab = calloc((size_t)(V * D), sizeof(float));
        kern_tensor_t *gids = tc_up_i32(tc_gpu, ids, n), *gt = tc_up(tc_gpu, dt, table, 2, V, D);
        kern_tensor_t *go = tc_zeros(tc_gpu, dt, 2, n, D), *gd = tc_up(tc_gpu, dt, dout, 2, n, D);
        kern_tensor_t *gdt = tc_zeros(tc_gpu, dt, 2, V, D);
        kern_tensor_t cids = tc_cpu_i32(ids, n), ct = tc_cpu_t(table, 2, V, D), co = tc_cpu_t(out, 2, n, D),
                      cd = tc_cpu_t(dout, 2, n, D), cdt = tc_cpu_t(dtab, 2, V, D);
        assert_int_equal(kern_embedding_forward(tc_gpu, gids, gt, go), FU_OK);
        assert_int_equal(kern_embedding_forward(tc_cpu, &cids, &ct, &co), FU_OK);
        tc_expect("embedding fwd", go, out, (tc_tol){0, 0});
        assert_int_equal(kern_embedding_backward(tc_gpu, gids, gd, gdt), FU_OK);
        assert_int_equal(kern_embedding_backward(tc_cpu, &cids, &cd, &cdt), FU_OK);
        tc_expect("embedding bwd", gdt, dtab, tc_tol_of(dt));
        /* an id outside the vocabulary is an error, not a wild write */
        int32_t bad[19];
        memcpy(bad, ids, sizeof bad);
        bad[7] = (int32_t)V;
        kern_tensor_t *gbad = tc_up_i32(tc_gpu, bad, n);
        assert_int_equal(kern_embedding_forward(tc_gpu, gbad, gt, go), FU_EINVAL);
        assert_int_equal(kern_embedding_backward(tc_gpu, gbad, gd, gdt), FU_EINVAL);
        assert_int_equal(kern_embedding_forward(tc_gpu, gids, gt, go), FU_OK); /* flag was cleared */
        TC_DESTROY_ALL(&gbad, &gids, &gt, &go, &gd, &gdt);
        TK_FREE_ALL(table, dout, out, dtab);
    }
}

/* One embedding lookup, over and over from its own thread: each call must get its own verdict. */
typedef struct {
    const kern_tensor_t *ids, *table;
    kern_tensor_t *out;
    fu_err want;
    int wrong; /* calls whose verdict was another's */
} flag_job;

static void *flag_worker(void *arg)
{
    flag_job *j = arg;
    for (int i = 0; i < 200; i++)
        if (kern_embedding_forward(tc_gpu, j->ids, j->table, j->out) != j->want)
            j->wrong++;
    return NULL;
}

/* The bad-index flag is one per instance: an op with bad ids and one with good ids, each from its
 * own thread on the shared instance, must not read each other's verdict (kc_flag_begin/end). */
static void test_kern_cuda_flag_per_op(void **state)
{
    (void)state;
    const int64_t V = 50, D = 64, n = 32;
    int32_t good[32], bad[32];
    for (int i = 0; i < n; i++)
        good[i] = bad[i] = (int32_t)(i % V);
    bad[9] = (int32_t)V;
    float *table = tc_rand_dt(KERN_F32, (size_t)(V * D), 71, -1, 1);
    kern_tensor_t *gt = tc_up(tc_gpu, KERN_F32, table, 2, V, D);
    kern_tensor_t *gg = tc_up_i32(tc_gpu, good, n), *gb = tc_up_i32(tc_gpu, bad, n);
    kern_tensor_t *o1 = tc_zeros(tc_gpu, KERN_F32, 2, n, D), *o2 = tc_zeros(tc_gpu, KERN_F32, 2, n, D);
    flag_job jobs[2] = {{gg, gt, o1, FU_OK, 0}, {gb, gt, o2, FU_EINVAL, 0}};
    pthread_t th[2];
    for (int k = 0; k < 2; k++)
        assert_int_equal(pthread_create(&th[k], NULL, flag_worker, &jobs[k]), 0);
    for (int k = 0; k < 2; k++)
        pthread_join(th[k], NULL);
    printf("  good ids: %d of 200 calls wrong; bad ids: %d of 200 wrong\n", jobs[0].wrong, jobs[1].wrong);
    assert_int_equal(jobs[0].wrong, 0);
    assert_int_equal(jobs[1].wrong, 0);
    TC_DESTROY_ALL(&gt, &gg, &gb, &o1, &o2);
    TK_FREE_ALL(table);
}

static void test_kern_cuda_rmsnorm(void **state)
{
    (void)state;
    const int64_t n = 150, D = 320; /* 150 rows: three dw row chunks */
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *x = tc_rand_dt(dt, (size_t)(n * D), 51, -2, 2), *w = tc_rand_dt(dt, (size_t)D, 52, 0.5f, 1.5f);
        float *dy = tc_rand_dt(dt, (size_t)(n * D), 53, -1, 1), *dw = tc_rand_dt(dt, (size_t)D, 54, -1, 1);
        float *y = malloc((size_t)(n * D) * sizeof(float)), *dx = malloc((size_t)(n * D) * sizeof(float));
        kern_tensor_t *gx = tc_up(tc_gpu, dt, x, 2, n, D), *gw = tc_up(tc_gpu, dt, w, 1, D, 1);
        kern_tensor_t *gy = tc_zeros(tc_gpu, dt, 2, n, D), *gdy = tc_up(tc_gpu, dt, dy, 2, n, D);
        kern_tensor_t *gdx = tc_zeros(tc_gpu, dt, 2, n, D), *gdw = tc_up(tc_gpu, dt, dw, 1, D, 1);
        kern_tensor_t cx = tc_cpu_t(x, 2, n, D), cw = tc_cpu_t(w, 1, D, 1), cy = tc_cpu_t(y, 2, n, D),
                      cdy = tc_cpu_t(dy, 2, n, D), cdx = tc_cpu_t(dx, 2, n, D), cdw = tc_cpu_t(dw, 1, D, 1);
        assert_int_equal(kern_rmsnorm_forward(tc_gpu, gx, gw, 1e-5f, gy), FU_OK);
        assert_int_equal(kern_rmsnorm_forward(tc_cpu, &cx, &cw, 1e-5f, &cy), FU_OK);
        tc_expect("rmsnorm fwd", gy, y, tc_tol_of(dt));
        assert_int_equal(kern_rmsnorm_backward(tc_gpu, gdy, gx, gw, 1e-5f, gdx, gdw), FU_OK);
        assert_int_equal(kern_rmsnorm_backward(tc_cpu, &cdy, &cx, &cw, 1e-5f, &cdx, &cdw), FU_OK);
        tc_expect("rmsnorm dx", gdx, dx, tc_tol_scaled(dt, 2.0));
        tc_expect("rmsnorm dw", gdw, dw, tc_tol_scaled(dt, dt == KERN_F32 ? 10.0 : 4.0));
        TC_DESTROY_ALL(&gx, &gw, &gy, &gdy, &gdx, &gdw);
        TK_FREE_ALL(x, w, dy, dw, y, dx);
    }
}

/* More rows than a grid's y dimension holds of 64-row chunks (65,535 x 64 = 4,194,240): RMSNorm
 * backward puts its chunks on x, so it takes them as the CPU does (the DAG's head norm runs
 * rows x heads rows through it). dw sums 4.2 M rows, in another order than the CPU's. */
static void test_kern_cuda_rmsnorm_many_rows(void **state)
{
    (void)state;
    const int64_t n = 65535 * 64 + 100, D = 4;
    const size_t nd = (size_t)(n * D);
    float *x = tc_rand_dt(KERN_F32, nd, 61, -2, 2), *w = tc_rand_dt(KERN_F32, (size_t)D, 62, 0.5f, 1.5f);
    float *dy = tc_rand_dt(KERN_F32, nd, 63, -1, 1), *dw = calloc((size_t)D, sizeof(float));
    float *dx = malloc(nd * sizeof(float));
    assert_non_null(dw);
    assert_non_null(dx);
    kern_tensor_t *gx = tc_up(tc_gpu, KERN_F32, x, 2, n, D), *gw = tc_up(tc_gpu, KERN_F32, w, 1, D, 1);
    kern_tensor_t *gdy = tc_up(tc_gpu, KERN_F32, dy, 2, n, D), *gdx = tc_zeros(tc_gpu, KERN_F32, 2, n, D);
    kern_tensor_t *gdw = tc_zeros(tc_gpu, KERN_F32, 1, D, 1);
    kern_tensor_t cx = tc_cpu_t(x, 2, n, D), cw = tc_cpu_t(w, 1, D, 1), cdy = tc_cpu_t(dy, 2, n, D),
                  cdx = tc_cpu_t(dx, 2, n, D), cdw = tc_cpu_t(dw, 1, D, 1);
    assert_int_equal(kern_rmsnorm_backward(tc_gpu, gdy, gx, gw, 1e-5f, gdx, gdw), FU_OK);
    assert_int_equal(kern_rmsnorm_backward(tc_cpu, &cdy, &cx, &cw, 1e-5f, &cdx, &cdw), FU_OK);
    tc_expect("rmsnorm dx, 4.2 M rows", gdx, dx, tc_tol_scaled(KERN_F32, 2.0));
    tc_expect("rmsnorm dw, 4.2 M rows", gdw, dw, (tc_tol){1e-2, 1e-3});
    TC_DESTROY_ALL(&gx, &gw, &gdy, &gdx, &gdw);
    TK_FREE_ALL(x, w, dy, dw, dx);
}

static void test_kern_cuda_rope(void **state)
{
    (void)state;
    const int64_t n = 23, heads = 3, hd = 64, f = heads * hd;
    int32_t pos[23];
    for (int i = 0; i < n; i++)
        pos[i] = 100 + 3 * i; /* absolute positions, as with a KV-cache offset */
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *x = tc_rand_dt(dt, (size_t)(n * f), 61, -1, 1), *y = malloc((size_t)(n * f) * sizeof(float));
        float *dx = malloc((size_t)(n * f) * sizeof(float));
        kern_tensor_t *gx = tc_up(tc_gpu, dt, x, 2, n, f), *gy = tc_zeros(tc_gpu, dt, 2, n, f);
        kern_tensor_t *gp = tc_up_i32(tc_gpu, pos, n), *gdx = tc_zeros(tc_gpu, dt, 2, n, f);
        kern_tensor_t cx = tc_cpu_t(x, 2, n, f), cy = tc_cpu_t(y, 2, n, f), cp = tc_cpu_i32(pos, n),
                      cdx = tc_cpu_t(dx, 2, n, f);
        /* Llama 3's rescaled frequencies (rope_scaling "llama3"): the CPU and the GPU share the table */
        const kern_rope_params rp = {.theta = 500000.0f, .factor = 8.0f, .low_freq_factor = 1.0f,
                                     .high_freq_factor = 4.0f, .original_max_pos = 8192.0f};
        assert_int_equal(kern_rope_forward(tc_gpu, gx, gp, (int)hd, &rp, gy), FU_OK);
        assert_int_equal(kern_rope_forward(tc_cpu, &cx, &cp, (int)hd, &rp, &cy), FU_OK);
        tc_expect("rope fwd", gy, y, tc_tol_of(dt));
        assert_int_equal(kern_rope_backward(tc_gpu, gx, gp, (int)hd, &rp, gdx), FU_OK);
        assert_int_equal(kern_rope_backward(tc_cpu, &cx, &cp, (int)hd, &rp, &cdx), FU_OK);
        tc_expect("rope bwd", gdx, dx, tc_tol_of(dt));
        assert_int_equal(kern_rope_forward(tc_gpu, gx, gp, (int)hd, &rp, gx), FU_OK); /* in place */
        tc_expect("rope in place", gx, y, tc_tol_of(dt));
        TC_DESTROY_ALL(&gx, &gy, &gp, &gdx);
        TK_FREE_ALL(x, y, dx);
    }
}

static void test_kern_cuda_silu_mul(void **state)
{
    (void)state;
    const int64_t n = 17, f = 300;
    const size_t N = (size_t)(n * f);
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *g = tc_rand_dt(dt, N, 71, -6, 6), *u = tc_rand_dt(dt, N, 72, -2, 2);
        float *dout = tc_rand_dt(dt, N, 73, -1, 1);
        float *o = malloc(N * 4), *dg = malloc(N * 4), *du = malloc(N * 4);
        kern_tensor_t *gg = tc_up(tc_gpu, dt, g, 2, n, f), *gu = tc_up(tc_gpu, dt, u, 2, n, f);
        kern_tensor_t *gd = tc_up(tc_gpu, dt, dout, 2, n, f), *go = tc_zeros(tc_gpu, dt, 2, n, f);
        kern_tensor_t *gdg = tc_zeros(tc_gpu, dt, 2, n, f), *gdu = tc_zeros(tc_gpu, dt, 2, n, f);
        kern_tensor_t cg = tc_cpu_t(g, 2, n, f), cu = tc_cpu_t(u, 2, n, f), cd = tc_cpu_t(dout, 2, n, f),
                      co = tc_cpu_t(o, 2, n, f), cdg = tc_cpu_t(dg, 2, n, f), cdu = tc_cpu_t(du, 2, n, f);
        assert_int_equal(kern_silu_mul_forward(tc_gpu, gg, gu, go), FU_OK);
        assert_int_equal(kern_silu_mul_forward(tc_cpu, &cg, &cu, &co), FU_OK);
        tc_expect("silu_mul fwd", go, o, tc_tol_of(dt));
        assert_int_equal(kern_silu_mul_backward(tc_gpu, gd, gg, gu, gdg, gdu), FU_OK);
        assert_int_equal(kern_silu_mul_backward(tc_cpu, &cd, &cg, &cu, &cdg, &cdu), FU_OK);
        tc_expect("silu_mul dgate", gdg, dg, tc_tol_of(dt));
        tc_expect("silu_mul dup", gdu, du, tc_tol_of(dt));
        TC_DESTROY_ALL(&gg, &gu, &gd, &go, &gdg, &gdu);
        TK_FREE_ALL(g, u, dout, o, dg, du);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Attention */

typedef struct {
    int n_seq, tq, tk, hq, hkv, hd;
    bool backward;
} attn_case;

static void attn_run(kern_dtype dt, attn_case c)
{
    kern_attn_params p = {.n_head = c.hq, .n_kv_head = c.hkv, .head_dim = c.hd, .n_seq = c.n_seq,
                          .q_offset = c.tk - c.tq, .scale = 0.0f};
    const int64_t qr = (int64_t)c.n_seq * c.tq, kr = (int64_t)c.n_seq * c.tk;
    const int64_t qf = (int64_t)c.hq * c.hd, kf = (int64_t)c.hkv * c.hd;
    const size_t nq = (size_t)(qr * qf), nk = (size_t)(kr * kf);
    float *q = tc_rand_dt(dt, nq, 81, -1, 1), *k = tc_rand_dt(dt, nk, 82, -1, 1);
    float *v = tc_rand_dt(dt, nk, 83, -1, 1);
    float *dout = tc_rand_dt(dt, nq, 84, -1, 1);
    float *o = malloc(nq * 4), *dq = malloc(nq * 4), *dk = malloc(nk * 4), *dv = malloc(nk * 4);
    kern_tensor_t *gq = tc_up(tc_gpu, dt, q, 2, qr, qf), *gk = tc_up(tc_gpu, dt, k, 2, kr, kf);
    kern_tensor_t *gv = tc_up(tc_gpu, dt, v, 2, kr, kf), *go = tc_zeros(tc_gpu, dt, 2, qr, qf);
    kern_tensor_t cq = tc_cpu_t(q, 2, qr, qf), ck = tc_cpu_t(k, 2, kr, kf), cv = tc_cpu_t(v, 2, kr, kf),
                  co = tc_cpu_t(o, 2, qr, qf);
    assert_int_equal(kern_attn_forward(tc_gpu, &p, gq, gk, gv, go, NULL), FU_OK);
    assert_int_equal(kern_attn_forward(tc_cpu, &p, &cq, &ck, &cv, &co, NULL), FU_OK);
    char what[96];
    snprintf(what, sizeof what, "attn fwd seq=%d tq=%d tk=%d hq=%d hkv=%d hd=%d", c.n_seq, c.tq, c.tk, c.hq, c.hkv,
             c.hd);
    tc_expect(what, go, o, tc_tol_of(dt));
    /* the same with a caller workspace */
    size_t wsb = 0;
    assert_int_equal(kern_attn_workspace_bytes(tc_gpu, &p, c.tq, c.tk, c.backward, &wsb), FU_OK);
    kern_workspace_t *ws = kern_workspace_new(tc_gpu, wsb);
    assert_non_null(ws);
    assert_int_equal(kern_tensor_zero(tc_gpu, go), FU_OK);
    assert_int_equal(kern_attn_forward(tc_gpu, &p, gq, gk, gv, go, ws), FU_OK);
    assert_int_equal(kern_workspace_used(ws), 0);
    tc_expect(what, go, o, tc_tol_of(dt));
    if (c.backward) {
        kern_tensor_t *gd = tc_up(tc_gpu, dt, dout, 2, qr, qf), *gdq = tc_zeros(tc_gpu, dt, 2, qr, qf);
        kern_tensor_t *gdk = tc_zeros(tc_gpu, dt, 2, kr, kf), *gdv = tc_zeros(tc_gpu, dt, 2, kr, kf);
        kern_tensor_t cd = tc_cpu_t(dout, 2, qr, qf), cdq = tc_cpu_t(dq, 2, qr, qf), cdk = tc_cpu_t(dk, 2, kr, kf),
                      cdv = tc_cpu_t(dv, 2, kr, kf);
        assert_int_equal(kern_attn_backward(tc_gpu, &p, gq, gk, gv, gd, gdq, gdk, gdv, ws), FU_OK);
        assert_int_equal(kern_attn_backward(tc_cpu, &p, &cq, &ck, &cv, &cd, &cdq, &cdk, &cdv, NULL), FU_OK);
        tc_tol bt = tc_tol_scaled(dt, dt == KERN_F32 ? 5.0 : 2.0);
        tc_expect("attn dq", gdq, dq, bt);
        tc_expect("attn dk", gdk, dk, bt);
        tc_expect("attn dv", gdv, dv, bt);
        TC_DESTROY_ALL(&gd, &gdq, &gdk, &gdv);
    }
    kern_workspace_destroy(&ws);
    TC_DESTROY_ALL(&gq, &gk, &gv, &go);
    TK_FREE_ALL(q, k, v, dout, o, dq, dk, dv);
}

static void test_kern_cuda_attention(void **state)
{
    (void)state;
    const attn_case cases[] = {
        {2, 37, 37, 4, 2, 64, true},    /* training, GQA, flash path for 16-bit, ragged tile */
        {1, 70, 70, 2, 2, 128, true},   /* head_dim 128 */
        {1, 20, 50, 4, 1, 64, false},   /* prefill after a cache: q_offset 30 */
        {2, 1, 300, 8, 2, 64, false},   /* decode: split keys across blocks */
        {1, 3, 1000, 4, 4, 128, false}, /* few queries, long cache */
        {1, 12, 12, 3, 1, 80, true},    /* head_dim not a multiple of 32 */
        {1, 9, 9, 2, 1, 256, true},     /* largest head_dim */
    };
    for (int d = 0; d < 3; d++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            attn_run(tc_float_dtypes[d], cases[i]);
}

/* ---------------------------------------------------------------------------------------------- */
/* Cross-entropy, AdamW, sampling */

static void test_kern_cuda_xent(void **state)
{
    (void)state;
    const int64_t n = 13, V = 1500;
    int32_t tg[13];
    for (int i = 0; i < n; i++)
        tg[i] = (int32_t)((i * 131) % V);
    tg[4] = KERN_XENT_IGNORE_DEFAULT;
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *lg = tc_rand_dt(dt, (size_t)(n * V), 91, -8, 8), *dl = malloc((size_t)(n * V) * 4);
        kern_tensor_t *gl = tc_up(tc_gpu, dt, lg, 2, n, V), *gt = tc_up_i32(tc_gpu, tg, n);
        kern_tensor_t *gd = tc_zeros(tc_gpu, dt, 2, n, V);
        kern_tensor_t cl = tc_cpu_t(lg, 2, n, V), ct = tc_cpu_i32(tg, n), cd = tc_cpu_t(dl, 2, n, V);
        float lg_gpu = 0, lg_cpu = 0;
        int64_t nv_gpu = 0, nv_cpu = 0;
        assert_int_equal(kern_xent_forward(tc_gpu, gl, gt, KERN_XENT_IGNORE_DEFAULT, &lg_gpu, &nv_gpu), FU_OK);
        assert_int_equal(kern_xent_forward(tc_cpu, &cl, &ct, KERN_XENT_IGNORE_DEFAULT, &lg_cpu, &nv_cpu), FU_OK);
        assert_int_equal(nv_gpu, nv_cpu);
        assert_int_equal(nv_gpu, n - 1);
        tc_tol t = tc_tol_of(KERN_F32);
        assert_true(fabs((double)lg_gpu - (double)lg_cpu) <= t.atol + t.rtol * fabs((double)lg_cpu));
        assert_int_equal(kern_xent_backward(tc_gpu, gl, gt, KERN_XENT_IGNORE_DEFAULT, 0.5f, gd), FU_OK);
        assert_int_equal(kern_xent_backward(tc_cpu, &cl, &ct, KERN_XENT_IGNORE_DEFAULT, 0.5f, &cd), FU_OK);
        tc_tol gt_tol = tc_tol_of(dt);
        gt_tol.atol = dt == KERN_F32 ? 1e-7 : 1e-5; /* gradients are ~1/(n·V) */
        tc_expect("xent bwd", gd, dl, gt_tol);
        /* fused forward+backward, out of place then in place */
        kern_tensor_t *gd2 = tc_zeros(tc_gpu, dt, 2, n, V);
        float lf = 0;
        int64_t nvf = 0;
        assert_int_equal(kern_xent_forward_backward(tc_gpu, gl, gt, KERN_XENT_IGNORE_DEFAULT, 0.5f, &lf, &nvf, gd2),
                         FU_OK);
        assert_int_equal(nvf, nv_cpu);
        assert_true(fabs((double)lf - (double)lg_cpu) <= t.atol + t.rtol * fabs((double)lg_cpu));
        tc_expect("xent fused", gd2, dl, gt_tol);
        kern_tensor_destroy(&gd2);
        kern_tensor_t *gl2 = tc_up(tc_gpu, dt, lg, 2, n, V);
        assert_int_equal(kern_xent_forward_backward(tc_gpu, gl2, gt, KERN_XENT_IGNORE_DEFAULT, 0.5f, &lf, &nvf, gl2),
                         FU_OK);
        assert_true(fabs((double)lf - (double)lg_cpu) <= t.atol + t.rtol * fabs((double)lg_cpu));
        tc_expect("xent fused in place", gl2, dl, gt_tol);
        kern_tensor_destroy(&gl2);
        assert_int_equal(kern_xent_backward(tc_gpu, gl, gt, KERN_XENT_IGNORE_DEFAULT, 0.5f, gl), FU_OK); /* in place */
        tc_expect("xent bwd in place", gl, dl, gt_tol);
        int32_t bad[13];
        memcpy(bad, tg, sizeof bad);
        bad[2] = (int32_t)V;
        kern_tensor_t *gb = tc_up_i32(tc_gpu, bad, n);
        assert_int_equal(kern_xent_forward(tc_gpu, gd, gb, KERN_XENT_IGNORE_DEFAULT, &lg_gpu, &nv_gpu), FU_EINVAL);
        assert_int_equal(kern_xent_backward(tc_gpu, gd, gb, KERN_XENT_IGNORE_DEFAULT, 1.0f, gd), FU_EINVAL);
        assert_int_equal(kern_xent_forward_backward(tc_gpu, gd, gb, KERN_XENT_IGNORE_DEFAULT, 1.0f, &lg_gpu, &nv_gpu, gd),
                         FU_EINVAL);
        TC_DESTROY_ALL(&gb, &gl, &gt, &gd);
        free(lg);
        free(dl);
    }
}

static void test_kern_cuda_adamw(void **state)
{
    (void)state;
    const size_t n = 5000;
    kern_adamw_params ap = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *p = tc_rand_dt(dt, n, 101, -1, 1), *g = tc_rand_dt(dt, n, 102, -1, 1);
        float *m = tc_rand_dt(dt, n, 103, -0.1f, 0.1f);
        float *v = tc_rand_dt(dt, n, 104, 0, 0.01f);
        kern_tensor_t *gp = tc_up(tc_gpu, dt, p, 1, (int64_t)n, 1), *gg = tc_up(tc_gpu, dt, g, 1, (int64_t)n, 1);
        kern_tensor_t *gm = tc_up(tc_gpu, dt, m, 1, (int64_t)n, 1), *gv = tc_up(tc_gpu, dt, v, 1, (int64_t)n, 1);
        kern_tensor_t cp = tc_cpu_t(p, 1, (int64_t)n, 1), cg = tc_cpu_t(g, 1, (int64_t)n, 1),
                      cm = tc_cpu_t(m, 1, (int64_t)n, 1), cv = tc_cpu_t(v, 1, (int64_t)n, 1);
        for (int64_t step = 1; step <= 3; step++) {
            assert_int_equal(kern_adamw_step(tc_gpu, gp, gg, gm, gv, &ap, step), FU_OK);
            assert_int_equal(kern_adamw_step(tc_cpu, &cp, &cg, &cm, &cv, &ap, step), FU_OK);
            if (dt != KERN_F32) { /* the GPU state is rounded each step: follow it on the CPU */
                tc_round(dt, p, n);
                tc_round(dt, m, n);
                tc_round(dt, v, n);
            }
        }
        tc_expect("adamw param", gp, p, tc_tol_of(dt));
        tc_expect("adamw m", gm, m, tc_tol_of(dt));
        tc_expect("adamw v", gv, v, tc_tol_of(dt));
        TC_DESTROY_ALL(&gp, &gg, &gm, &gv);
        TK_FREE_ALL(p, g, m, v);
    }
}

static void test_kern_cuda_sample(void **state)
{
    (void)state;
    const int64_t n = 16, V = 3001;
    float *lg = tk_rand((size_t)(n * V), 111, -5, 5);
    lg[3 * V + 17] = 9.0f; /* clear winners in some rows, and a tie (lowest id wins) */
    lg[3 * V + 5] = 9.0f;
    lg[6 * V + 9] = NAN; /* NaN counts as -inf */
    const kern_sample_params ps[] = {
        {.temperature = 0.0f},
        {.temperature = 1.0f},
        {.temperature = 0.7f, .top_k = 40},
        {.temperature = 1.3f, .top_p = 0.9f},
        {.temperature = 1.0f, .top_k = 1},
        {.temperature = 0.8f, .top_k = 100, .top_p = 0.5f, .seed = 99},
    };
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *r = malloc((size_t)(n * V) * 4);
        memcpy(r, lg, (size_t)(n * V) * 4);
        tc_round(dt, r, (size_t)(n * V));
        kern_tensor_t *gl = tc_up(tc_gpu, dt, r, 2, n, V);
        kern_tensor_t cl = tc_cpu_t(r, 2, n, V);
        for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
            for (uint64_t counter = 0; counter < 3; counter++) {
                int32_t tg[16], tcp[16], tg2[16];
                assert_int_equal(kern_sample(tc_gpu, gl, &ps[i], counter, tg), FU_OK);
                assert_int_equal(kern_sample(tc_gpu, gl, &ps[i], counter, tg2), FU_OK);
                assert_memory_equal(tg, tg2, sizeof tg); /* a pure function of (seed, counter, row) */
                assert_int_equal(kern_sample(tc_cpu, &cl, &ps[i], counter, tcp), FU_OK);
                for (int row = 0; row < n; row++) {
                    if (tg[row] != tcp[row])
                        fail_msg("sample %s params %zu counter %llu row %d: gpu %d cpu %d", kern_dtype_name(dt), i,
                                 (unsigned long long)counter, row, tg[row], tcp[row]);
                }
            }
        }
        int32_t one[16];
        assert_int_equal(kern_sample(tc_gpu, gl, &ps[0], 0, one), FU_OK);
        assert_int_equal(one[3], 5);
        kern_tensor_destroy(&gl);
        free(r);
    }
    free(lg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_cuda_lookup),
        cmocka_unit_test(test_kern_cuda_oom_is_an_error),
        cmocka_unit_test(test_kern_cuda_pool_reuses_blocks),
        cmocka_unit_test(test_kern_cuda_pinned_host),
        cmocka_unit_test(test_kern_cuda_convert_copy_zero),
        cmocka_unit_test(test_kern_cuda_gemm_matches_cpu),
        cmocka_unit_test(test_kern_cuda_gemm_column_slice),
        cmocka_unit_test(test_kern_cuda_bad_shapes),
        cmocka_unit_test(test_kern_cuda_add_axpy),
        cmocka_unit_test(test_kern_cuda_embedding),
        cmocka_unit_test(test_kern_cuda_flag_per_op),
        cmocka_unit_test(test_kern_cuda_rmsnorm),
        cmocka_unit_test(test_kern_cuda_rmsnorm_many_rows),
        cmocka_unit_test(test_kern_cuda_rope),
        cmocka_unit_test(test_kern_cuda_silu_mul),
        cmocka_unit_test(test_kern_cuda_attention),
        cmocka_unit_test(test_kern_cuda_xent),
        cmocka_unit_test(test_kern_cuda_adamw),
        cmocka_unit_test(test_kern_cuda_sample),
    };
    return TC_RUN_GROUP("test_kern_cuda", tests);
}
