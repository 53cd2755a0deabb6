/* CUDA backend: a whole LLaMA decoder block, forward and backward, run through the public op API
 * on the CUDA backend and on the CPU backend from the same inputs; the output, the input gradient
 * and the weight gradients must agree (f32 tightly, f16/bf16 within storage-rounding bounds).
 *
 *   h1 = rmsnorm(x) ; q,k,v = h1·Wq/k/vᵀ ; q,k = rope(q,k) ; a = attn(q,k,v) ; x2 = x + a·Woᵀ
 *   h2 = rmsnorm(x2) ; y = x2 + (silu(h2·Wgᵀ) ⊙ h2·Wuᵀ)·Wdᵀ
 * Exits 77 without a device. */
#include "test_kern_cuda_util.h"

enum { N_SEQ = 2, T = 24, D = 128, H = 4, HKV = 2, HD = 32, F = 256, NTOK = N_SEQ * T };

enum { P_WN1, P_WQ, P_WK, P_WV, P_WO, P_WN2, P_WG, P_WU, P_WD, P_COUNT };
static const int64_t p_shape[P_COUNT][2] = {
    {D, 1}, {H * HD, D}, {HKV * HD, D}, {HKV * HD, D}, {D, H * HD}, {D, 1}, {F, D}, {F, D}, {D, F},
};
static const char *const p_name[P_COUNT] = {"wn1", "wq", "wk", "wv", "wo", "wn2", "wg", "wu", "wd"};

typedef struct {
    const kern_backend_t *be;
    kern_dtype dt;
    kern_tensor_t *p[P_COUNT], *dp[P_COUNT];
    kern_tensor_t *x, *pos, *dy;
    kern_tensor_t *h1, *q, *k, *v, *qr, *kr, *a, *o, *x2, *h2, *g, *u, *m, *d, *y;
    kern_tensor_t *dm, *dg, *du, *dh2, *dh2b, *dx2, *da, *dqr, *dkr, *dv, *dq, *dk, *dh1, *dh1b, *dx1, *dx;
} block;

/* The activations and their gradients (the block's other tensors): NTOK rows each, of these widths. */
#define ACT(name, cols) {offsetof(block, name), cols}
static const struct {
    size_t  off;  /* offset of the kern_tensor_t * member */
    int64_t cols; /* row width */
} acts[] = {
    /* forward */
    ACT(h1, D), ACT(q, H * HD), ACT(k, HKV * HD), ACT(v, HKV * HD), ACT(qr, H * HD), ACT(kr, HKV * HD),
    ACT(a, H * HD), ACT(o, D), ACT(x2, D), ACT(h2, D), ACT(g, F), ACT(u, F), ACT(m, F), ACT(d, D), ACT(y, D),
    /* backward */
    ACT(dm, F), ACT(dg, F), ACT(du, F), ACT(dh2, D), ACT(dh2b, D), ACT(dx2, D), ACT(da, H * HD),
    ACT(dqr, H * HD), ACT(dkr, HKV * HD), ACT(dv, HKV * HD), ACT(dq, H * HD), ACT(dk, HKV * HD),
    ACT(dh1, D), ACT(dh1b, D), ACT(dx1, D), ACT(dx, D),
};

static kern_tensor_t **act(block *b, size_t i)
{
    return (kern_tensor_t **)(void *)((char *)b + acts[i].off);
}

static void block_init(block *b, const kern_backend_t *be, kern_dtype dt, float *host_p[P_COUNT], const float *x,
                       const int32_t *pos, const float *dy)
{
    memset(b, 0, sizeof *b);
    b->be = be;
    b->dt = dt;
    for (int i = 0; i < P_COUNT; i++) {
        int nd = p_shape[i][1] == 1 ? 1 : 2;
        b->p[i] = tc_up(be, dt, host_p[i], nd, p_shape[i][0], p_shape[i][1]);
        b->dp[i] = tc_zeros(be, dt, nd, p_shape[i][0], p_shape[i][1]);
    }
    b->x = tc_up(be, dt, x, 2, NTOK, D);
    b->dy = tc_up(be, dt, dy, 2, NTOK, D);
    b->pos = tc_up_i32(be, pos, NTOK);
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++)
        *act(b, i) = tc_zeros(be, dt, 2, NTOK, acts[i].cols);
}

static void block_free(block *b)
{
    for (int i = 0; i < P_COUNT; i++) {
        kern_tensor_destroy(&b->p[i]);
        kern_tensor_destroy(&b->dp[i]);
    }
    TC_DESTROY_ALL(&b->x, &b->dy, &b->pos);
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++)
        kern_tensor_destroy(act(b, i));
}

static void block_run(block *b)
{
    const kern_backend_t *be = b->be;
    const float eps = 1e-5f;
    const kern_rope_params theta = {.theta = 10000.0f};
    kern_attn_params ap = {.n_head = H, .n_kv_head = HKV, .head_dim = HD, .n_seq = N_SEQ, .q_offset = 0};
    /* forward */
    assert_int_equal(kern_rmsnorm_forward(be, b->x, b->p[P_WN1], eps, b->h1), FU_OK);
    assert_int_equal(kern_linear_forward(be, b->h1, b->p[P_WQ], b->q), FU_OK);
    assert_int_equal(kern_linear_forward(be, b->h1, b->p[P_WK], b->k), FU_OK);
    assert_int_equal(kern_linear_forward(be, b->h1, b->p[P_WV], b->v), FU_OK);
    assert_int_equal(kern_rope_forward(be, b->q, b->pos, HD, &theta, b->qr), FU_OK);
    assert_int_equal(kern_rope_forward(be, b->k, b->pos, HD, &theta, b->kr), FU_OK);
    assert_int_equal(kern_attn_forward(be, &ap, b->qr, b->kr, b->v, b->a, NULL), FU_OK);
    assert_int_equal(kern_linear_forward(be, b->a, b->p[P_WO], b->o), FU_OK);
    assert_int_equal(kern_add_forward(be, b->x, b->o, b->x2), FU_OK);
    assert_int_equal(kern_rmsnorm_forward(be, b->x2, b->p[P_WN2], eps, b->h2), FU_OK);
    assert_int_equal(kern_linear_forward(be, b->h2, b->p[P_WG], b->g), FU_OK);
    assert_int_equal(kern_linear_forward(be, b->h2, b->p[P_WU], b->u), FU_OK);
    assert_int_equal(kern_silu_mul_forward(be, b->g, b->u, b->m), FU_OK);
    assert_int_equal(kern_linear_forward(be, b->m, b->p[P_WD], b->d), FU_OK);
    assert_int_equal(kern_add_forward(be, b->x2, b->d, b->y), FU_OK);
    /* backward (dy flows into both branches of each residual add) */
    assert_int_equal(kern_linear_backward(be, b->dy, b->m, b->p[P_WD], b->dm, b->dp[P_WD]), FU_OK);
    assert_int_equal(kern_silu_mul_backward(be, b->dm, b->g, b->u, b->dg, b->du), FU_OK);
    assert_int_equal(kern_linear_backward(be, b->dg, b->h2, b->p[P_WG], b->dh2, b->dp[P_WG]), FU_OK);
    assert_int_equal(kern_linear_backward(be, b->du, b->h2, b->p[P_WU], b->dh2b, b->dp[P_WU]), FU_OK);
    assert_int_equal(kern_add_forward(be, b->dh2, b->dh2b, b->dh2), FU_OK);
    assert_int_equal(kern_rmsnorm_backward(be, b->dh2, b->x2, b->p[P_WN2], eps, b->dx2, b->dp[P_WN2]), FU_OK);
    assert_int_equal(kern_add_forward(be, b->dx2, b->dy, b->dx2), FU_OK);
    assert_int_equal(kern_linear_backward(be, b->dx2, b->a, b->p[P_WO], b->da, b->dp[P_WO]), FU_OK);
    assert_int_equal(kern_attn_backward(be, &ap, b->qr, b->kr, b->v, b->da, b->dqr, b->dkr, b->dv, NULL), FU_OK);
    assert_int_equal(kern_rope_backward(be, b->dqr, b->pos, HD, &theta, b->dq), FU_OK);
    assert_int_equal(kern_rope_backward(be, b->dkr, b->pos, HD, &theta, b->dk), FU_OK);
    assert_int_equal(kern_linear_backward(be, b->dq, b->h1, b->p[P_WQ], b->dh1, b->dp[P_WQ]), FU_OK);
    assert_int_equal(kern_linear_backward(be, b->dk, b->h1, b->p[P_WK], b->dh1b, b->dp[P_WK]), FU_OK);
    assert_int_equal(kern_add_forward(be, b->dh1, b->dh1b, b->dh1), FU_OK);
    assert_int_equal(kern_linear_backward(be, b->dv, b->h1, b->p[P_WV], b->dh1b, b->dp[P_WV]), FU_OK);
    assert_int_equal(kern_add_forward(be, b->dh1, b->dh1b, b->dh1), FU_OK);
    assert_int_equal(kern_rmsnorm_backward(be, b->dh1, b->x, b->p[P_WN1], eps, b->dx1, b->dp[P_WN1]), FU_OK);
    assert_int_equal(kern_add_forward(be, b->dx1, b->dx2, b->dx), FU_OK);
    assert_int_equal(kern_backend_sync(be), FU_OK);
}

static void block_case(kern_dtype dt, double tol_scale)
{
    float *hp[P_COUNT];
    for (int i = 0; i < P_COUNT; i++) {
        size_t n = (size_t)(p_shape[i][0] * p_shape[i][1]);
        bool norm = p_shape[i][1] == 1;
        hp[i] = tc_rand_dt(dt, n, 500 + (uint64_t)i, norm ? 0.8f : -0.1f, norm ? 1.2f : 0.1f);
    }
    float *x = tc_rand_dt(dt, (size_t)NTOK * D, 601, -1, 1);
    float *dy = tc_rand_dt(dt, (size_t)NTOK * D, 602, -1, 1);
    int32_t pos[NTOK];
    for (int s = 0; s < N_SEQ; s++)
        for (int t = 0; t < T; t++)
            pos[s * T + t] = t;

    block cpu, gpu;
    block_init(&cpu, tc_cpu, KERN_F32, hp, x, pos, dy);
    block_init(&gpu, tc_gpu, dt, hp, x, pos, dy);
    block_run(&cpu);
    block_run(&gpu);

    tc_tol tol = tc_tol_scaled(dt, tol_scale);
    tc_expect_cpu("block y", gpu.y, cpu.y, tol);
    tc_expect_cpu("block dx", gpu.dx, cpu.dx, tol);
    for (int i = 0; i < P_COUNT; i++) {
        char what[64];
        snprintf(what, sizeof what, "block d%s", p_name[i]);
        tc_expect_cpu(what, gpu.dp[i], cpu.dp[i], tol);
    }
    block_free(&cpu);
    block_free(&gpu);
    for (int i = 0; i < P_COUNT; i++)
        free(hp[i]);
    free(x);
    free(dy);
}

static void test_kern_cuda_block_f32(void **state)
{
    (void)state;
    block_case(KERN_F32, 10.0); /* 1e-3 relative after ~30 chained ops */
}

static void test_kern_cuda_block_f16(void **state)
{
    (void)state;
    block_case(KERN_F16, 3.0);
}

static void test_kern_cuda_block_bf16(void **state)
{
    (void)state;
    block_case(KERN_BF16, 3.0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_cuda_block_f32),
        cmocka_unit_test(test_kern_cuda_block_f16),
        cmocka_unit_test(test_kern_cuda_block_bf16),
    };
    return TC_RUN_GROUP("test_kern_cuda_block", tests);
}
