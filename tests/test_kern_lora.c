/* LoRA and LoRA-FA: initialisation, forward against a plain loop, LoRA-FA's X-free backward equal to
 * LoRA's, gradients against finite differences, saved-activation bytes, the hooks for a sparse base
 * and concatenated frozen adapters, the optional PEFT correction, and FU_EINVAL on bad shapes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "kern_bitmap.h"
#include "kern_lora.h"
#include "test_kern_util.h"

#define CPU kern_backend_cpu()

enum { N = 6, IN = 10, OUT = 7, R = 3 };

typedef struct {
    float *x, *w, *a, *b, *h, *y;
    kern_tensor_t X, W, A, B, H, Y;
    float s;
} layer;

static void layer_init(layer *l, uint64_t seed)
{
    l->x = tk_rand(N * IN, seed, -1, 1);
    l->w = tk_rand(OUT * IN, seed + 1, -0.5f, 0.5f);
    l->a = tk_zeros(R * IN);
    l->b = tk_zeros(OUT * R);
    l->h = tk_zeros(N * R);
    l->y = tk_zeros(N * OUT);
    l->X = tk_f2(l->x, N, IN);
    l->W = tk_f2(l->w, OUT, IN);
    l->A = tk_f2(l->a, R, IN);
    l->B = tk_f2(l->b, OUT, R);
    l->H = tk_f2(l->h, N, R);
    l->Y = tk_f2(l->y, N, OUT);
    l->s = kern_lora_scale(16.0f, R);
    assert_int_equal(kern_lora_init(CPU, &l->A, &l->B, seed + 2), FU_OK);
    /* B = 0 after init; give it values so the adapter path is exercised */
    float *bb = tk_rand(OUT * R, seed + 3, -0.5f, 0.5f);
    memcpy(l->b, bb, sizeof(float) * OUT * R);
    free(bb);
}

static void layer_free(layer *l)
{
    free(l->x), free(l->w), free(l->a), free(l->b), free(l->h), free(l->y);
}

static void layer_fwd(void *c)
{
    layer *l = c;
    assert_int_equal(kern_lora_forward(CPU, &l->X, &l->W, &l->A, &l->B, l->s, &l->H, &l->Y), FU_OK);
}

static void test_kern_lora_init_kaiming_uniform(void **state)
{
    (void)state;
    float a1[R * IN], a2[R * IN], a3[R * IN], b[OUT * R];
    for (int i = 0; i < OUT * R; i++)
        b[i] = 1.0f;
    kern_tensor_t A1 = tk_f2(a1, R, IN), A2 = tk_f2(a2, R, IN), A3 = tk_f2(a3, R, IN), B = tk_f2(b, OUT, R);
    assert_int_equal(kern_lora_init(CPU, &A1, &B, 7), FU_OK);
    assert_int_equal(kern_lora_init(CPU, &A2, &B, 7), FU_OK);
    assert_int_equal(kern_lora_init(CPU, &A3, &B, 8), FU_OK);
    assert_memory_equal(a1, a2, sizeof a1);
    assert_memory_not_equal(a1, a3, sizeof a1);
    float bound = 1.0f / sqrtf((float)IN), mx = 0;
    for (int i = 0; i < R * IN; i++) {
        assert_true(fabsf(a1[i]) <= bound);
        mx = fmaxf(mx, fabsf(a1[i]));
    }
    assert_true(mx > 0.5f * bound);
    for (int i = 0; i < OUT * R; i++)
        assert_float_equal(b[i], 0.0f, 0);
    assert_float_equal(kern_lora_scale(16.0f, 8), 2.0f, 0);
    assert_float_equal(kern_lora_scale(16.0f, 0), 0.0f, 0);
    kern_tensor_t Bbad = tk_f2(b, OUT, R + 1);
    assert_int_equal(kern_lora_init(CPU, &A1, &Bbad, 1), FU_EINVAL);
}

static void test_kern_lora_forward_matches_reference(void **state)
{
    (void)state;
    layer l;
    layer_init(&l, 10);
    layer_fwd(&l);
    double href[N * R], yref[N * OUT];
    for (int i = 0; i < N; i++) {
        for (int k = 0; k < R; k++) {
            double s = 0;
            for (int c = 0; c < IN; c++)
                s += (double)l.x[i * IN + c] * l.a[k * IN + c];
            href[i * R + k] = s;
        }
        for (int o = 0; o < OUT; o++) {
            double s = 0, t = 0;
            for (int c = 0; c < IN; c++)
                s += (double)l.x[i * IN + c] * l.w[o * IN + c];
            for (int k = 0; k < R; k++)
                t += href[i * R + k] * l.b[o * R + k];
            yref[i * OUT + o] = s + l.s * t;
        }
    }
    assert_true(tk_close_ratio(l.h, href, N * R, 1e-6, 1e-5) <= 1.0);
    assert_true(tk_close_ratio(l.y, yref, N * OUT, 1e-6, 1e-5) <= 1.0);
    /* sparse-base hook: with w == NULL the adapter term is added to what Y holds */
    float y2[N * OUT];
    kern_tensor_t Y2 = tk_f2(y2, N, OUT);
    assert_int_equal(kern_linear_forward(CPU, &l.X, &l.W, &Y2), FU_OK);
    assert_int_equal(kern_lora_forward(CPU, &l.X, NULL, &l.A, &l.B, l.s, &l.H, &Y2), FU_OK);
    assert_true(tk_close_ratio(y2, yref, N * OUT, 1e-6, 1e-5) <= 1.0);
    layer_free(&l);
}

static void test_kern_lora_fa_backward_equals_lora_and_fd(void **state)
{
    (void)state;
    layer l;
    layer_init(&l, 20);
    layer_fwd(&l);
    float *dy = tk_rand(N * OUT, 21, -1, 1);
    float dx_fa[N * IN], dx_lo[N * IN], db_fa[OUT * R] = {0}, db_lo[OUT * R] = {0}, da_lo[R * IN] = {0};
    kern_tensor_t dY = tk_f2(dy, N, OUT), dXfa = tk_f2(dx_fa, N, IN), dXlo = tk_f2(dx_lo, N, IN);
    kern_tensor_t dBfa = tk_f2(db_fa, OUT, R), dBlo = tk_f2(db_lo, OUT, R), dAlo = tk_f2(da_lo, R, IN);
    kern_workspace_t *ws = kern_workspace_new(CPU, 4096);
    /* LoRA-FA gets no X at all: only H */
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &l.H, &l.W, &l.A, &l.B, l.s, &dXfa, &dBfa, ws), FU_OK);
    assert_int_equal(kern_workspace_used(ws), 0);
    assert_int_equal(kern_lora_backward(CPU, &dY, &l.X, &l.H, &l.W, &l.A, &l.B, l.s, &dXlo, &dAlo, &dBlo, NULL),
                     FU_OK);
    assert_true(tk_close_ratio_f(db_fa, db_lo, OUT * R, 1e-6, 1e-6) <= 1.0);
    assert_true(tk_close_ratio_f(dx_fa, dx_lo, N * IN, 1e-6, 1e-6) <= 1.0);
    /* finite differences of L = Σ Y·dY */
    assert_true(tk_grad_check(layer_fwd, &l, l.b, OUT * R, db_fa, l.y, dy, N * OUT, 1e-2f, 2e-3, 2e-2, 64) <= 1.0);
    assert_true(tk_grad_check(layer_fwd, &l, l.x, N * IN, dx_fa, l.y, dy, N * OUT, 1e-2f, 2e-3, 2e-2, 64) <= 1.0);
    assert_true(tk_grad_check(layer_fwd, &l, l.a, R * IN, da_lo, l.y, dy, N * OUT, 1e-2f, 2e-3, 2e-2, 64) <= 1.0);
    /* dB accumulates over micro-batches */
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &l.H, &l.W, &l.A, &l.B, l.s, NULL, &dBfa, ws), FU_OK);
    for (int i = 0; i < OUT * R; i++)
        assert_float_equal(db_fa[i], 2 * db_lo[i], 1e-5);
    /* w == NULL adds the adapter term to a dX that already holds dY·W */
    float dx2[N * IN];
    kern_tensor_t dX2 = tk_f2(dx2, N, IN);
    assert_int_equal(kern_linear_backward(CPU, &dY, NULL, &l.W, &dX2, NULL), FU_OK);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &l.H, NULL, &l.A, &l.B, l.s, &dX2, NULL, ws), FU_OK);
    assert_true(tk_close_ratio_f(dx2, dx_fa, N * IN, 1e-6, 1e-5) <= 1.0);
    /* a workspace too small for dY·B is refused */
    kern_workspace_t *tiny = kern_workspace_new(CPU, 16);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &l.H, &l.W, &l.A, &l.B, l.s, &dXfa, NULL, tiny), FU_ENOMEM);
    kern_workspace_destroy(&tiny);
    kern_workspace_destroy(&ws);
    free(dy);
    layer_free(&l);
}

static void test_kern_lora_saved_bytes(void **state)
{
    (void)state;
    size_t fa = 0, lo = 0;
    assert_int_equal(kern_lora_saved_bytes(KERN_ADAPTER_LORA_FA, 512, 768, 8, KERN_F32, &fa), FU_OK);
    assert_int_equal(kern_lora_saved_bytes(KERN_ADAPTER_LORA, 512, 768, 8, KERN_F32, &lo), FU_OK);
    assert_int_equal(fa, (size_t)512 * 8 * 4);
    assert_int_equal(lo, ((size_t)512 * 768 + (size_t)512 * 8) * 4);
    assert_int_equal(kern_lora_saved_bytes(KERN_ADAPTER_LORA_FA, 512, 768, 8, KERN_BF16, &fa), FU_OK);
    assert_int_equal(fa, (size_t)512 * 8 * 2);
    assert_int_equal(kern_lora_saved_bytes(KERN_ADAPTER_LORA, -1, 768, 8, KERN_F32, &lo), FU_EINVAL);
    assert_int_equal(kern_lora_saved_bytes((kern_adapter_kind)9, 1, 1, 1, KERN_F32, &lo), FU_EINVAL);
    assert_int_equal(kern_lora_saved_bytes(KERN_ADAPTER_LORA, INT64_MAX, INT64_MAX, 1, KERN_F32, &lo), FU_EINVAL);
    assert_int_equal(kern_lora_saved_bytes(KERN_ADAPTER_LORA, 1, 1, 1, (kern_dtype)77, &lo), FU_EINVAL);
}

/* SALR-style concatenation through views: A = [A1; A2], B = [s1·B1 | s2·B2], scale 1. */
static void test_kern_lora_concatenated_frozen_adapter(void **state)
{
    (void)state;
    enum { R1 = 2, R2 = 3, RT = R1 + R2 };
    float *x = tk_rand(N * IN, 30, -1, 1), *w = tk_rand(OUT * IN, 31, -1, 1);
    float *a1 = tk_rand(R1 * IN, 32, -1, 1), *b1 = tk_rand(OUT * R1, 33, -1, 1);
    float *a2 = tk_rand(R2 * IN, 34, -1, 1), *b2 = tk_rand(OUT * R2, 35, -1, 1);
    const float s1 = 2.0f, s2 = 1.0f;
    float acat[RT * IN], bcat[OUT * RT], hcat[N * RT], ycat[N * OUT], h1[N * R1], y1[N * OUT], h2[N * R2];
    memcpy(acat, a1, sizeof(float) * R1 * IN);
    memcpy(acat + R1 * IN, a2, sizeof(float) * R2 * IN);
    for (int o = 0; o < OUT; o++) {
        for (int k = 0; k < R1; k++)
            bcat[o * RT + k] = s1 * b1[o * R1 + k];
        for (int k = 0; k < R2; k++)
            bcat[o * RT + R1 + k] = s2 * b2[o * R2 + k];
    }
    kern_tensor_t X = tk_f2(x, N, IN), W = tk_f2(w, OUT, IN), Ac = tk_f2(acat, RT, IN), Bc = tk_f2(bcat, OUT, RT);
    kern_tensor_t Hc = tk_f2(hcat, N, RT), Yc = tk_f2(ycat, N, OUT);
    assert_int_equal(kern_lora_forward(CPU, &X, &W, &Ac, &Bc, 1.0f, &Hc, &Yc), FU_OK);
    /* the same as the trainable adapter plus the frozen one, applied separately */
    kern_tensor_t A1 = tk_f2(a1, R1, IN), B1 = tk_f2(b1, OUT, R1), H1 = tk_f2(h1, N, R1), Y1 = tk_f2(y1, N, OUT);
    kern_tensor_t A2 = tk_f2(a2, R2, IN), B2 = tk_f2(b2, OUT, R2), H2 = tk_f2(h2, N, R2);
    assert_int_equal(kern_lora_forward(CPU, &X, &W, &A1, &B1, s1, &H1, &Y1), FU_OK);
    assert_int_equal(kern_lora_forward(CPU, &X, NULL, &A2, &B2, s2, &H2, &Y1), FU_OK);
    assert_true(tk_close_ratio_f(ycat, y1, N * OUT, 1e-5, 1e-5) <= 1.0);
    /* dB1 from column views of H and B, equal to the trainable adapter's own LoRA-FA gradient */
    float *dy = tk_rand(N * OUT, 36, -1, 1), dbv[OUT * R1] = {0}, dbr[OUT * R1] = {0};
    kern_tensor_t dY = tk_f2(dy, N, OUT), dBv = tk_f2(dbv, OUT, R1), dBr = tk_f2(dbr, OUT, R1);
    kern_tensor_t Hv, Bv, Av;
    assert_int_equal(kern_tensor_slice(&Hc, 1, 0, R1, &Hv), FU_OK);
    assert_int_equal(kern_tensor_slice(&Bc, 1, 0, R1, &Bv), FU_OK);
    assert_int_equal(kern_tensor_slice(&Ac, 0, 0, R1, &Av), FU_OK);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &Hv, NULL, &Av, &Bv, s1, NULL, &dBv, NULL), FU_OK);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &H1, &W, &A1, &B1, s1, NULL, &dBr, NULL), FU_OK);
    assert_true(tk_close_ratio_f(dbv, dbr, OUT * R1, 1e-6, 1e-5) <= 1.0);
    free(x), free(w), free(a1), free(b1), free(a2), free(b2), free(dy);
}

/* A bitmap-sparse base weight through the backend's sparse slot, plus the adapter via w == NULL,
 * equals the dense layer with the pruned weight. */
static void test_kern_lora_sparse_base_weight(void **state)
{
    (void)state;
    enum { SO = 20, SI = 70, SN = 5 };
    float *w = tk_rand(SO * SI, 50, -1, 1), *x = tk_rand(SN * SI, 51, -1, 1);
    for (int i = 0; i < SO * SI; i++)
        if (fabsf(w[i]) < 0.5f)
            w[i] = 0.0f; /* about 50% sparse */
    kern_bitmap_t *bm = NULL;
    assert_int_equal(kern_bitmap_encode(w, SO, SI, SI, KERN_BITMAP_F32, &bm), FU_OK);
    kern_sparse_weight sw = {bm, SO, SI};
    float ys[SN * SO], yd[SN * SO];
    kern_tensor_t X = tk_f2(x, SN, SI), W = tk_f2(w, SO, SI), Ys = tk_f2(ys, SN, SO), Yd = tk_f2(yd, SN, SO);
    assert_int_equal(kern_sparse_linear_forward(CPU, &X, &sw, 0.0f, &Ys), FU_OK);
    assert_int_equal(kern_linear_forward(CPU, &X, &W, &Yd), FU_OK);
    assert_true(tk_close_ratio_f(ys, yd, SN * SO, 1e-5, 1e-5) <= 1.0);
    /* + LoRA-FA adapter */
    float *a = tk_rand(R * SI, 52, -0.1f, 0.1f), *b = tk_rand(SO * R, 53, -0.1f, 0.1f), h[SN * R], hd[SN * R];
    kern_tensor_t A = tk_f2(a, R, SI), B = tk_f2(b, SO, R), H = tk_f2(h, SN, R), Hd = tk_f2(hd, SN, R);
    assert_int_equal(kern_lora_forward(CPU, &X, NULL, &A, &B, 2.0f, &H, &Ys), FU_OK);
    assert_int_equal(kern_lora_forward(CPU, &X, &W, &A, &B, 2.0f, &Hd, &Yd), FU_OK);
    assert_true(tk_close_ratio_f(ys, yd, SN * SO, 1e-5, 1e-5) <= 1.0);
    /* input gradient through the sparse weight, then the adapter's term */
    float *dy = tk_rand(SN * SO, 54, -1, 1), dxs[SN * SI], dxd[SN * SI];
    kern_tensor_t dY = tk_f2(dy, SN, SO), dXs = tk_f2(dxs, SN, SI), dXd = tk_f2(dxd, SN, SI);
    assert_int_equal(kern_sparse_linear_backward(CPU, &dY, &sw, &dXs), FU_OK);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &H, NULL, &A, &B, 2.0f, &dXs, NULL, NULL), FU_OK);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &Hd, &W, &A, &B, 2.0f, &dXd, NULL, NULL), FU_OK);
    assert_true(tk_close_ratio_f(dxs, dxd, SN * SI, 1e-5, 1e-5) <= 1.0);
    /* mismatched descriptors are refused */
    kern_sparse_weight lie = {bm, SO, SI + 1};
    float yb[SN * SO];
    kern_tensor_t Yb = tk_f2(yb, SN, SO);
    assert_int_equal(kern_sparse_linear_forward(CPU, &X, &lie, 0.0f, &Yb), FU_EINVAL);
    kern_sparse_weight lie2 = {bm, SO + 1, SI};
    kern_tensor_t Yc = tk_f2(yb, 1, SO + 1);
    kern_tensor_t X1 = tk_f2(x, 1, SI);
    assert_int_equal(kern_sparse_linear_forward(CPU, &X1, &lie2, 0.0f, &Yc), FU_EINVAL);
    assert_int_equal(kern_sparse_linear_forward(CPU, &X, &sw, 0.5f, &Ys), FU_EINVAL);
    kern_sparse_weight none = {NULL, SO, SI};
    assert_int_equal(kern_sparse_linear_forward(CPU, &X, &none, 0.0f, &Ys), FU_EINVAL);
    kern_bitmap_destroy(&bm);
    free(w), free(x), free(a), free(b), free(dy);
}

static void test_kern_lora_fa_correction_option(void **state)
{
    (void)state;
    /* A = [[1,0,1],[0,2,0]] -> A·Aᵀ = diag(2, 4); s = 2: db ← db·diag(1/2, 1/4)/4 */
    float a[6] = {1, 0, 1, 0, 2, 0}, db[4] = {8, 16, -4, 32};
    kern_tensor_t A = tk_f2(a, 2, 3), DB = tk_f2(db, 2, 2);
    assert_int_equal(kern_lorafa_correct_grad(CPU, &A, 2.0f, &DB), FU_OK);
    assert_float_equal(db[0], 1.0f, 1e-6);
    assert_float_equal(db[1], 1.0f, 1e-6);
    assert_float_equal(db[2], -0.5f, 1e-6);
    assert_float_equal(db[3], 2.0f, 1e-6);
    float sing[6] = {1, 0, 0, 2, 0, 0}; /* rows parallel: A·Aᵀ singular */
    kern_tensor_t S = tk_f2(sing, 2, 3);
    assert_int_equal(kern_lorafa_correct_grad(CPU, &S, 2.0f, &DB), FU_EINVAL);
    assert_int_equal(kern_lorafa_correct_grad(CPU, &A, 0.0f, &DB), FU_EINVAL);
}

static void test_kern_lora_bad_shapes_return_einval(void **state)
{
    (void)state;
    layer l;
    layer_init(&l, 40);
    float buf[256] = {0};
    kern_tensor_t Hbad = tk_f2(buf, N, R + 1), Ybad = tk_f2(buf, N, OUT + 1), Abad = tk_f2(buf, R, IN + 1);
    kern_tensor_t Wbad = tk_f2(buf, OUT, IN - 1);
    assert_int_equal(kern_lora_forward(CPU, &l.X, &l.W, &l.A, &l.B, l.s, &Hbad, &l.Y), FU_EINVAL);
    assert_int_equal(kern_lora_forward(CPU, &l.X, &l.W, &l.A, &l.B, l.s, &l.H, &Ybad), FU_EINVAL);
    assert_int_equal(kern_lora_forward(CPU, &l.X, &l.W, &Abad, &l.B, l.s, &l.H, &l.Y), FU_EINVAL);
    assert_int_equal(kern_lora_forward(CPU, &l.X, &Wbad, &l.A, &l.B, l.s, &l.H, &l.Y), FU_EINVAL);
    assert_int_equal(kern_lora_forward(CPU, &l.X, &l.W, &l.A, &l.B, NAN, &l.H, &l.Y), FU_EINVAL);
    assert_int_equal(kern_lora_forward(CPU, NULL, &l.W, &l.A, &l.B, l.s, &l.H, &l.Y), FU_EINVAL);
    kern_tensor_t dY = tk_f2(buf, N, OUT), dX = tk_f2(buf + 100, N, IN - 1);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &l.H, &l.W, &l.A, &l.B, l.s, &dX, NULL, NULL), FU_EINVAL);
    kern_tensor_t dB = tk_f2(buf, OUT + 1, R);
    assert_int_equal(kern_lorafa_backward(CPU, &dY, &l.H, &l.W, &l.A, &l.B, l.s, NULL, &dB, NULL), FU_EINVAL);
    kern_tensor_t dA = tk_f2(buf, R, IN);
    assert_int_equal(kern_lora_backward(CPU, &dY, NULL, &l.H, &l.W, &l.A, &l.B, l.s, NULL, &dA, NULL, NULL),
                     FU_EINVAL); /* plain LoRA's dA needs X */
    kern_tensor_t Xh = tk_t(l.x, KERN_F16, 2, N, IN, 1);
    assert_int_equal(kern_lora_forward(CPU, &Xh, &l.W, &l.A, &l.B, l.s, &l.H, &l.Y), FU_EINVAL);
    layer_free(&l);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_lora_init_kaiming_uniform),
        cmocka_unit_test(test_kern_lora_forward_matches_reference),
        cmocka_unit_test(test_kern_lora_fa_backward_equals_lora_and_fd),
        cmocka_unit_test(test_kern_lora_saved_bytes),
        cmocka_unit_test(test_kern_lora_concatenated_frozen_adapter),
        cmocka_unit_test(test_kern_lora_sparse_base_weight),
        cmocka_unit_test(test_kern_lora_fa_correction_option),
        cmocka_unit_test(test_kern_lora_bad_shapes_return_einval),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
