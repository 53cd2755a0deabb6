/* CUDA backend: the fused LoRA-FA layer and the SALR bitmap-sparse kernels against the CPU
 * implementations (kern_lora.h, kern_bitmap.h / kern_sparse_linear_*). Exits 77 without a device. */
#include "kern_bitmap.h"
#include "kern_lora.h"
#include "test_kern_cuda_util.h"

/* ---------------------------------------------------------------------------------------------- */
/* LoRA-FA */

static void lorafa_case(kern_dtype dt, int64_t n, int64_t in, int64_t out, int64_t r)
{
    const float s = 2.0f;
    float *x = tc_rand_dt(dt, (size_t)(n * in), 201, -1, 1);
    float *w = tc_rand_dt(dt, (size_t)(out * in), 202, -0.2f, 0.2f);
    float *a = tc_rand_dt(dt, (size_t)(r * in), 203, -0.3f, 0.3f);
    float *b = tc_rand_dt(dt, (size_t)(out * r), 204, -0.3f, 0.3f);
    float *dy = tc_rand_dt(dt, (size_t)(n * out), 205, -1, 1);
    float *db = tc_rand_dt(dt, (size_t)(out * r), 206, -0.1f, 0.1f);
    float *y = malloc((size_t)(n * out) * 4), *h = malloc((size_t)(n * r) * 4), *dx = malloc((size_t)(n * in) * 4);
    kern_tensor_t cx = tc_cpu_t(x, 2, n, in), cw = tc_cpu_t(w, 2, out, in), ca = tc_cpu_t(a, 2, r, in),
                  cb = tc_cpu_t(b, 2, out, r), cy = tc_cpu_t(y, 2, n, out), ch = tc_cpu_t(h, 2, n, r),
                  cdy = tc_cpu_t(dy, 2, n, out), cdx = tc_cpu_t(dx, 2, n, in), cdb = tc_cpu_t(db, 2, out, r);
    kern_tensor_t *gx = tc_up(tc_gpu, dt, x, 2, n, in), *gw = tc_up(tc_gpu, dt, w, 2, out, in);
    kern_tensor_t *ga = tc_up(tc_gpu, dt, a, 2, r, in), *gb = tc_up(tc_gpu, dt, b, 2, out, r);
    kern_tensor_t *gy = tc_zeros(tc_gpu, dt, 2, n, out), *gh = tc_zeros(tc_gpu, dt, 2, n, r);
    kern_tensor_t *gdy = tc_up(tc_gpu, dt, dy, 2, n, out), *gdx = tc_zeros(tc_gpu, dt, 2, n, in);
    kern_tensor_t *gdb = tc_up(tc_gpu, dt, db, 2, out, r), *gdb2 = tc_up(tc_gpu, dt, db, 2, out, r);

    assert_int_equal(kern_lora_forward(tc_cpu, &cx, &cw, &ca, &cb, s, &ch, &cy), FU_OK);
    assert_int_equal(kern_lorafa_backward(tc_cpu, &cdy, &ch, &cw, &ca, &cb, s, &cdx, &cdb, NULL), FU_OK);

    tc_tol tol = tc_tol_scaled(dt, dt == KERN_F32 ? 2.0 : 2.0);
    assert_int_equal(kern_cuda_lorafa_forward(tc_gpu, gx, gw, ga, gb, s, gh, gy), FU_OK);
    tc_expect("lorafa h", gh, h, tol);
    tc_expect("lorafa y", gy, y, tol);
    assert_int_equal(kern_cuda_lorafa_backward(tc_gpu, gdy, gh, gw, ga, gb, s, gdx, gdb), FU_OK);
    tc_expect("lorafa dx", gdx, dx, tol);
    tc_expect("lorafa db", gdb, db, tol);
    /* the generic composition through the backend table agrees too */
    assert_int_equal(kern_tensor_zero(tc_gpu, gy), FU_OK);
    assert_int_equal(kern_lora_forward(tc_gpu, gx, gw, ga, gb, s, gh, gy), FU_OK);
    tc_expect("lora_forward on cuda", gy, y, tol);
    assert_int_equal(kern_lorafa_backward(tc_gpu, gdy, gh, gw, ga, gb, s, gdx, gdb2, NULL), FU_OK);
    tc_expect("lorafa_backward on cuda dx", gdx, dx, tol);
    tc_expect("lorafa_backward on cuda db", gdb2, db, tol);
    /* bad shapes */
    assert_int_equal(kern_cuda_lorafa_forward(tc_gpu, gx, gw, gb, ga, s, gh, gy), FU_EINVAL);
    assert_int_equal(kern_cuda_lorafa_backward(tc_gpu, gdy, gh, gw, ga, gb, s, gdb, gdx), FU_EINVAL);

    TC_DESTROY_ALL(&gx, &gw, &ga, &gb, &gy, &gh, &gdy, &gdx, &gdb, &gdb2);
    TK_FREE_ALL(x, w, a, b, dy, db, y, h, dx);
}

static void test_kern_cuda_lorafa_matches_cpu(void **state)
{
    (void)state;
    for (int d = 0; d < 3; d++) {
        lorafa_case(tc_float_dtypes[d], 33, 96, 80, 8);
        lorafa_case(tc_float_dtypes[d], 1, 128, 64, 16);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* SALR */

/* A [rows, cols] matrix with about half its elements zero (the pruned pattern). */
static float *sparse_matrix(size_t rows, size_t cols, uint64_t seed)
{
    float *w = tk_rand(rows * cols, seed, -1, 1);
    kern_rng r;
    kern_rng_seed(&r, seed ^ 0x5a5a);
    for (size_t i = 0; i < rows * cols; i++)
        if (kern_rng_uniform(&r) < 0.5f)
            w[i] = 0.0f;
    return w;
}

static void spmm_case(kern_bitmap_dtype bdt, kern_dtype dt, size_t rows, size_t cols, int64_t n, float beta)
{
    float *w = sparse_matrix(rows, cols, 301 + rows);
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, rows, cols, cols, bdt, &bm), FU_OK);
    kern_cuda_bitmap_t *gw = NULL;
    assert_int_equal(kern_cuda_bitmap_upload(tc_gpu, bm, &gw), FU_OK);
    assert_int_equal(kern_cuda_bitmap_rows(gw), rows);
    assert_int_equal(kern_cuda_bitmap_cols(gw), cols);

    float *x = tc_rand_dt(dt, (size_t)n * cols, 302, -1, 1);
    float *y = tc_rand_dt(dt, (size_t)n * rows, 303, -1, 1);
    kern_tensor_t *gx = tc_up(tc_gpu, dt, x, 2, n, (int64_t)cols), *gy = tc_up(tc_gpu, dt, y, 2, n, (int64_t)rows);
    kern_tensor_t cx = tc_cpu_t(x, 2, n, (int64_t)cols), cy = tc_cpu_t(y, 2, n, (int64_t)rows);
    kern_sparse_weight cs = {bm, (int64_t)rows, (int64_t)cols}, gs = {gw, (int64_t)rows, (int64_t)cols};
    assert_int_equal(kern_sparse_linear_forward(tc_cpu, &cx, &cs, beta, &cy), FU_OK);
    assert_int_equal(kern_sparse_linear_forward(tc_gpu, gx, &gs, beta, gy), FU_OK);
    char what[96];
    snprintf(what, sizeof what, "spmm %s x %s %zux%zu n=%lld", bdt == KERN_BITMAP_F16 ? "f16" : "f32",
             kern_dtype_name(dt), rows, cols, (long long)n);
    tc_expect(what, gy, y, tc_tol_scaled(dt, 3.0));
    /* the fused kernels alone (the tensor-core kernel where the automatic choice is the dense path) */
    if (dt != KERN_F32 && cols % 8 == 0) {
        float *y0 = tc_rand_dt(dt, (size_t)n * rows, 303, -1, 1), *yf = malloc((size_t)n * rows * 4);
        kern_tensor_t *gyf = tc_up(tc_gpu, dt, y0, 2, n, (int64_t)rows), cyf = tc_cpu_t(yf, 2, n, (int64_t)rows);
        memcpy(yf, y0, (size_t)n * rows * 4);
        assert_int_equal(kern_sparse_linear_forward(tc_cpu, &cx, &cs, beta, &cyf), FU_OK);
        assert_int_equal(kern_cuda_bitmap_matmul_fused(tc_gpu, gx, gw, beta, gyf), FU_OK);
        tc_expect("spmm fused", gyf, yf, tc_tol_scaled(dt, 3.0));
        kern_tensor_destroy(&gyf);
        free(y0);
        free(yf);
    }

    /* dX = dY·W */
    float *dy = tc_rand_dt(dt, (size_t)n * rows, 304, -1, 1), *dx = malloc((size_t)n * cols * 4);
    kern_tensor_t *gdy = tc_up(tc_gpu, dt, dy, 2, n, (int64_t)rows), *gdx = tc_zeros(tc_gpu, dt, 2, n, (int64_t)cols);
    kern_tensor_t cdy = tc_cpu_t(dy, 2, n, (int64_t)rows), cdx = tc_cpu_t(dx, 2, n, (int64_t)cols);
    assert_int_equal(kern_sparse_linear_backward(tc_cpu, &cdy, &cs, &cdx), FU_OK);
    assert_int_equal(kern_sparse_linear_backward(tc_gpu, gdy, &gs, gdx), FU_OK);
    tc_expect("spmm dx", gdx, dx, tc_tol_scaled(dt, 3.0));

    /* the decoded matrix is the encoded one, exactly (after the storage rounding) */
    float *dense = malloc(rows * cols * 4);
    assert_int_equal(kern_bitmap_decode(bm, dense, cols), FU_OK);
    kern_tensor_t *gd = tc_zeros(tc_gpu, KERN_F32, 2, (int64_t)rows, (int64_t)cols);
    assert_int_equal(kern_cuda_bitmap_decode(tc_gpu, gw, gd), FU_OK);
    tc_expect("bitmap decode", gd, dense, (tc_tol){0, 0});

    /* a handle whose dimensions disagree is refused */
    kern_sparse_weight wrong = {gw, (int64_t)rows + 1, (int64_t)cols};
    kern_tensor_t *gy2 = tc_zeros(tc_gpu, dt, 2, n, (int64_t)rows + 1);
    assert_int_equal(kern_sparse_linear_forward(tc_gpu, gx, &wrong, 0.0f, gy2), FU_EINVAL);

    TC_DESTROY_ALL(&gy2, &gd, &gx, &gy, &gdy, &gdx);
    kern_cuda_bitmap_destroy(&gw);
    assert_null(gw);
    kern_bitmap_destroy(&bm);
    TK_FREE_ALL(w, x, y, dy, dx, dense);
}

static void test_kern_cuda_spmm_matches_cpu(void **state)
{
    (void)state;
    /* 200 rows: a partial 64-row block and a partial tile row is impossible (200 = 25*8), so also
     * 203 rows; 328 cols: a partial tile column. Batches cover the GEMV kernel (1, 3, 16) and the
     * tensor-core kernel (17, 100) and the dense path (300). */
    const size_t shapes[][2] = {{200, 328}, {203, 512}, {64, 64}};
    const int64_t batches[] = {1, 3, 16, 17, 100, 300};
    for (int b = 0; b < 2; b++)
        for (int d = 0; d < 3; d++)
            for (size_t s = 0; s < 3; s++)
                for (size_t i = 0; i < sizeof batches / sizeof batches[0]; i++)
                    spmm_case(b ? KERN_BITMAP_F16 : KERN_BITMAP_F32, tc_float_dtypes[d], shapes[s][0], shapes[s][1],
                              batches[i], i % 2 ? 1.0f : 0.0f);
}

static void test_kern_cuda_salr_layer(void **state)
{
    (void)state;
    const size_t rows = 96, cols = 128;
    const int64_t n = 20, r1 = 8, r2 = 4, rt = r1 + r2;
    const float s1 = 2.0f;
    for (int d = 0; d < 3; d++) {
        kern_dtype dt = tc_float_dtypes[d];
        float *w = sparse_matrix(rows, cols, 401);
        kern_bitmap_t *bm = NULL;
        assert_int_equal(kern_bitmap_encode(w, rows, cols, cols, KERN_BITMAP_F16, &bm), FU_OK);
        kern_cuda_bitmap_t *gw = NULL;
        assert_int_equal(kern_cuda_bitmap_upload(tc_gpu, bm, &gw), FU_OK);
        float *x = tc_rand_dt(dt, (size_t)n * cols, 402, -1, 1);
        float *ac = tc_rand_dt(dt, (size_t)rt * cols, 403, -0.3f, 0.3f);
        float *bc = tc_rand_dt(dt, rows * (size_t)rt, 404, -0.3f, 0.3f);
        float *dy = tc_rand_dt(dt, (size_t)n * rows, 405, -1, 1);
        float *y = calloc((size_t)n * rows, 4), *h = malloc((size_t)(n * rt) * 4), *dx = calloc((size_t)n * cols, 4);
        float *db1 = calloc(rows * (size_t)r1, 4);
        /* CPU reference: sparse product, then the concatenated adapters through kern_lora (w = NULL). */
        kern_tensor_t cx = tc_cpu_t(x, 2, n, (int64_t)cols), cac = tc_cpu_t(ac, 2, rt, (int64_t)cols),
                      cbc = tc_cpu_t(bc, 2, (int64_t)rows, rt), cy = tc_cpu_t(y, 2, n, (int64_t)rows),
                      ch = tc_cpu_t(h, 2, n, rt), cdy = tc_cpu_t(dy, 2, n, (int64_t)rows),
                      cdx = tc_cpu_t(dx, 2, n, (int64_t)cols), cdb1 = tc_cpu_t(db1, 2, (int64_t)rows, r1);
        kern_sparse_weight cs = {bm, (int64_t)rows, (int64_t)cols};
        assert_int_equal(kern_sparse_linear_forward(tc_cpu, &cx, &cs, 0.0f, &cy), FU_OK);
        assert_int_equal(kern_lora_forward(tc_cpu, &cx, NULL, &cac, &cbc, 1.0f, &ch, &cy), FU_OK);
        assert_int_equal(kern_sparse_linear_backward(tc_cpu, &cdy, &cs, &cdx), FU_OK);
        assert_int_equal(kern_lorafa_backward(tc_cpu, &cdy, &ch, NULL, &cac, &cbc, 1.0f, &cdx, NULL, NULL), FU_OK);
        kern_tensor_t hslice;
        assert_int_equal(kern_tensor_slice(&ch, 1, 0, r1, &hslice), FU_OK);
        assert_int_equal(kern_gemm(tc_cpu, true, false, s1, &cdy, &hslice, 1.0f, &cdb1), FU_OK);

        kern_tensor_t *gx = tc_up(tc_gpu, dt, x, 2, n, (int64_t)cols), *gac = tc_up(tc_gpu, dt, ac, 2, rt, (int64_t)cols);
        kern_tensor_t *gbc = tc_up(tc_gpu, dt, bc, 2, (int64_t)rows, rt), *gy = tc_zeros(tc_gpu, dt, 2, n, (int64_t)rows);
        kern_tensor_t *gh = tc_zeros(tc_gpu, dt, 2, n, rt), *gdy = tc_up(tc_gpu, dt, dy, 2, n, (int64_t)rows);
        kern_tensor_t *gdx = tc_zeros(tc_gpu, dt, 2, n, (int64_t)cols), *gdb1 = tc_zeros(tc_gpu, dt, 2, (int64_t)rows, r1);
        assert_int_equal(kern_cuda_salr_forward(tc_gpu, gx, gw, gac, gbc, gh, gy), FU_OK);
        tc_tol tol = tc_tol_scaled(dt, 3.0);
        tc_expect("salr h", gh, h, tol);
        tc_expect("salr y", gy, y, tol);
        assert_int_equal(kern_cuda_salr_backward(tc_gpu, gdy, gh, gw, gac, gbc, s1, gdb1, gdx), FU_OK);
        tc_expect("salr dx", gdx, dx, tol);
        tc_expect("salr db1", gdb1, db1, tol);
        /* no adapters: the sparse product alone */
        assert_int_equal(kern_cuda_salr_forward(tc_gpu, gx, gw, NULL, NULL, NULL, gy), FU_OK);
        /* half an adapter spec is an error */
        assert_int_equal(kern_cuda_salr_forward(tc_gpu, gx, gw, gac, NULL, gh, gy), FU_EINVAL);

        TC_DESTROY_ALL(&gx, &gac, &gbc, &gy, &gh, &gdy, &gdx, &gdb1);
        kern_cuda_bitmap_destroy(&gw);
        kern_bitmap_destroy(&bm);
        TK_FREE_ALL(w, x, ac, bc, dy, y, h, dx, db1);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_cuda_lorafa_matches_cpu),
        cmocka_unit_test(test_kern_cuda_spmm_matches_cpu),
        cmocka_unit_test(test_kern_cuda_salr_layer),
    };
    return TC_RUN_GROUP("test_kern_cuda_salr", tests);
}
