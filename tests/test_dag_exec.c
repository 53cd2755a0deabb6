/* The executor on tiny models: logits against a plain-loops reference, KV-cache decoding, gradients
 * against finite differences, stages equal to the whole DAG, LoRA-FA's saved activations, training
 * lowers the loss, checkpoints, SALR, and failure paths. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_model.h"
#include "dag_partition.h"
#include "dag_quant.h"
#include "dag_spec.h"
#include "dag_train.h"
#include "kern_codec.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "kern_bitmap.h"
#include "testutil.h"

/* ---- a tiny model on disk --------------------------------------------------------------------- */

typedef struct {
    char *dir;          /* model directory */
    fu_modelcfg cfg;
    dag_model_dims dims;
    fu_safetensors *st; /* its weights */
} tiny;

/* The default model (tied: with tied embeddings, no lm_head) in a scratch directory. */
static void tiny_open_with(tiny *t, const char *tag, uint64_t seed, bool tied)
{
    t->dir = tu_tmpdir(tag);
    assert_non_null(t->dir);
    fu_modelcfg_defaults(&t->cfg); /* 2 layers, hidden 64, 4/2 heads, ffn 128, vocab 256 */
    t->cfg.tie_word_embeddings = tied;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_model_init_random(t->dir, &t->cfg, seed, 0.08f, &em), FU_OK);
    dag_dims_from_cfg(&t->cfg, &t->dims);
    assert_int_equal(fu_safetensors_open_dir(t->dir, &t->st, &em), FU_OK);
}

static void tiny_open(tiny *t, const char *tag, uint64_t seed)
{
    tiny_open_with(t, tag, seed, false);
}

static void tiny_close(tiny *t)
{
    fu_safetensors_close(&t->st);
    tu_tmpdir_remove(&t->dir);
}

/* cmocka fixture of every test: *state is a tiny the test opens with tiny_start and that is closed
 * after it, also when it failed. */
static int tiny_setup(void **state)
{
    *state = calloc(1, sizeof(tiny));
    return *state ? 0 : -1;
}

static int tiny_teardown(void **state)
{
    tiny *t = *state;
    tiny_close(t);
    free(t);
    return 0;
}

/* Opens the test's tiny model (tag: its scratch directory's name, seed: its weights') in the
 * fixture's state and returns it. */
static tiny *tiny_start(void **state, const char *tag, uint64_t seed)
{
    tiny *t = *state;
    tiny_open(t, tag, seed);
    return t;
}

static dag_graph_t *graph(const tiny *t, dag_adapter_method m, uint32_t rank, dag_head head, uint32_t res_rank)
{
    dag_build_opts o = {.method = m, .rank = rank, .alpha = 2.0f * (float)rank, .targets = 0, .res_rank = res_rank,
                        .head = head, .seq_len = 16};
    dag_graph_t *g = NULL;
    assert_int_equal(dag_build_llama(&t->dims, &o, &g), FU_OK);
    return g;
}

static dag_exec_t *exec_for(const dag_graph_t *g, const fu_safetensors *st, bool training, size_t first, size_t last,
                            uint32_t max_tokens, bool logits_all)
{
    dag_exec_opts o = {.be = NULL, .first = first, .last = last, .max_tokens = max_tokens, .n_slots = 1,
                       .training = training, .logits_all = logits_all, .max_context = 64, .seed = 7};
    dag_exec_t *x = NULL;
    fu_errmsg em = {{0}};
    fu_err rc = dag_exec_new(g, &o, &x, &em);
    if (rc != FU_OK)
        fail_msg("dag_exec_new: %s", fu_errmsg_text(&em, rc));
    rc = dag_exec_load_weights(x, st, &em);
    if (rc != FU_OK)
        fail_msg("load_weights: %s", fu_errmsg_text(&em, rc));
    return x;
}

/* ---- the plain-loops reference ------------------------------------------------------------------ */

static float *rd(const fu_safetensors *st, const char *name, size_t n0, size_t n1)
{
    uint64_t shape[2] = {n0, n1};
    size_t n = n1 ? n0 * n1 : n0;
    float *f = malloc(n * sizeof *f);
    assert_int_equal(fu_safetensors_read_f32(st, name, n1 ? 2 : 1, shape, f, n, NULL), FU_OK);
    return f;
}

/* w [out, in] += s · b [out, r] · a [r, in]. */
static void add_product(float *w, const float *b, const float *a, size_t out, size_t r, size_t in, double s)
{
    for (size_t o = 0; o < out; o++)
        for (size_t i = 0; i < in; i++) {
            double acc = 0;
            for (size_t k = 0; k < r; k++)
                acc += (double)b[o * r + k] * a[k * in + i];
            w[o * in + i] += (float)(s * acc);
        }
}

/* W_eff of a linear: the dense weight, or (SALR) decode(bitmap) + salr_B·salr_A; plus an optional
 * LoRA delta s·B·A from a PEFT adapter. */
static float *weight_eff(const fu_safetensors *st, const fu_safetensors *peft, const char *mod, size_t out, size_t in,
                         double s)
{
    char name[256];
    float *w = malloc(out * in * sizeof *w);
    snprintf(name, sizeof name, "%s.weight.bitmap", mod);
    const fu_st_tensor *tb = fu_safetensors_get(st, name);
    if (tb) {
        char vn[256], on[256];
        snprintf(vn, sizeof vn, "%s.weight.values", mod);
        snprintf(on, sizeof on, "%s.weight.offsets", mod);
        const fu_st_tensor *tv = fu_safetensors_get(st, vn), *to = fu_safetensors_get(st, on);
        kern_bitmap_t *bm = NULL;
        assert_int_equal(kern_bitmap_from_buffers(out, in, KERN_BITMAP_F32, tb->data, tb->nbytes, tv->data, tv->nbytes,
                                                  to->data, to->nbytes, &bm),
                         FU_OK);
        assert_int_equal(kern_bitmap_decode(bm, w, in), FU_OK);
        kern_bitmap_destroy(&bm);
        snprintf(name, sizeof name, "%s.salr_A.weight", mod);
        const fu_st_tensor *ta = fu_safetensors_get(st, name);
        size_t r = (size_t)ta->shape[0];
        float *a2 = rd(st, name, r, in);
        snprintf(name, sizeof name, "%s.salr_B.weight", mod);
        float *b2 = rd(st, name, out, r);
        add_product(w, b2, a2, out, r, in, 1.0);
        free(a2);
        free(b2);
    } else {
        snprintf(name, sizeof name, "%s.weight", mod);
        free(w);
        w = rd(st, name, out, in);
    }
    if (peft) {
        snprintf(name, sizeof name, "base_model.model.%s.lora_A.weight", mod);
        const fu_st_tensor *ta = fu_safetensors_get(peft, name);
        assert_non_null(ta);
        size_t r = (size_t)ta->shape[0];
        float *a = rd(peft, name, r, in);
        snprintf(name, sizeof name, "base_model.model.%s.lora_B.weight", mod);
        float *b = rd(peft, name, out, r);
        add_product(w, b, a, out, r, in, s);
        free(a);
        free(b);
    }
    return w;
}

static void ref_linear(const double *x, size_t n, size_t in, size_t out, const float *w, double *y)
{
    for (size_t t = 0; t < n; t++)
        for (size_t o = 0; o < out; o++) {
            double acc = 0;
            for (size_t i = 0; i < in; i++)
                acc += x[t * in + i] * w[o * in + i];
            y[t * out + o] = acc;
        }
}

static void ref_rmsnorm(const double *x, size_t n, size_t d, const float *w, double eps, double *y)
{
    for (size_t t = 0; t < n; t++) {
        double ss = 0;
        for (size_t i = 0; i < d; i++)
            ss += x[t * d + i] * x[t * d + i];
        double r = 1.0 / sqrt(ss / (double)d + eps);
        for (size_t i = 0; i < d; i++)
            y[t * d + i] = x[t * d + i] * r * w[i];
    }
}

static void ref_rope(double *x, size_t n, size_t heads, size_t hd, size_t T, double theta)
{
    for (size_t t = 0; t < n; t++) {
        double pos = (double)(t % T);
        for (size_t h = 0; h < heads; h++) {
            double *v = &x[t * heads * hd + h * hd];
            for (size_t i = 0; i < hd / 2; i++) {
                double a = pos * pow(theta, -2.0 * (double)i / (double)hd);
                double x0 = v[i], x1 = v[i + hd / 2];
                v[i] = x0 * cos(a) - x1 * sin(a);
                v[i + hd / 2] = x1 * cos(a) + x0 * sin(a);
            }
        }
    }
}

/* y [n, out] = x [n, in] · W_effᵀ of layer l's linear `mod` ("mlp.up_proj"). */
static void ref_proj(const fu_safetensors *st, const fu_safetensors *peft, double s, size_t l,
                     const char *mod, const double *x, size_t n, size_t in, size_t out, double *y)
{
    char name[256];
    snprintf(name, sizeof name, "model.layers.%zu.%s", l, mod);
    float *w = weight_eff(st, peft, name, out, in, s);
    ref_linear(x, n, in, out, w, y);
    free(w);
}

/* y = RMSNorm(x) with the gain `norm` ("model.norm.weight", or of layer l: "input_layernorm"). */
static void ref_norm(const fu_safetensors *st, const fu_modelcfg *c, long l, const char *norm,
                     const double *x, size_t n, double *y)
{
    char name[256];
    if (l < 0)
        snprintf(name, sizeof name, "%s", norm);
    else
        snprintf(name, sizeof name, "model.layers.%ld.%s.weight", l, norm);
    float *w = rd(st, name, c->hidden_size, 0);
    ref_rmsnorm(x, n, c->hidden_size, w, c->rms_norm_eps, y);
    free(w);
}

/* logits [n_seq*T, vocab] of the model (with a PEFT adapter's delta when peft is given). */
static double *ref_logits(const tiny *t, const fu_safetensors *st, const fu_safetensors *peft, double s,
                          const int32_t *tok, size_t n_seq, size_t T)
{
    const fu_modelcfg *c = &t->cfg;
    size_t H = c->hidden_size, F = c->intermediate_size, V = c->vocab_size, nh = c->num_attention_heads,
           nkv = c->num_key_value_heads, hd = c->head_dim, n = n_seq * T;
    size_t qw = nh * hd, kw = nkv * hd;
    float *emb = rd(st, "model.embed_tokens.weight", V, H);
    double *x = calloc(n * H, sizeof *x), *h = calloc(n * H, sizeof *h), *q = calloc(n * qw, sizeof *q),
           *k = calloc(n * kw, sizeof *k), *v = calloc(n * kw, sizeof *v), *o = calloc(n * qw, sizeof *o),
           *y = calloc(n * H, sizeof *y), *g = calloc(n * F, sizeof *g), *u = calloc(n * F, sizeof *u);
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; j < H; j++)
            x[i * H + j] = emb[(size_t)tok[i] * H + j];
    for (size_t l = 0; l < c->num_hidden_layers; l++) {
        ref_norm(st, c, (long)l, "input_layernorm", x, n, h);
        ref_proj(st, peft, s, l, "self_attn.q_proj", h, n, H, qw, q);
        ref_proj(st, peft, s, l, "self_attn.k_proj", h, n, H, kw, k);
        ref_proj(st, peft, s, l, "self_attn.v_proj", h, n, H, kw, v);
        ref_rope(q, n, nh, hd, T, c->rope_theta);
        ref_rope(k, n, nkv, hd, T, c->rope_theta);
        for (size_t sq = 0; sq < n_seq; sq++)
            for (size_t hh = 0; hh < nh; hh++) {
                size_t kh = hh / (nh / nkv);
                for (size_t i = 0; i < T; i++) {
                    double sc[64], mx = -1e300, sum = 0;
                    for (size_t j = 0; j <= i; j++) {
                        double d = 0;
                        for (size_t e = 0; e < hd; e++)
                            d += q[(sq * T + i) * qw + hh * hd + e] * k[(sq * T + j) * kw + kh * hd + e];
                        sc[j] = d / sqrt((double)hd);
                        if (sc[j] > mx)
                            mx = sc[j];
                    }
                    for (size_t j = 0; j <= i; j++)
                        sum += (sc[j] = exp(sc[j] - mx));
                    for (size_t e = 0; e < hd; e++) {
                        double acc = 0;
                        for (size_t j = 0; j <= i; j++)
                            acc += sc[j] / sum * v[(sq * T + j) * kw + kh * hd + e];
                        o[(sq * T + i) * qw + hh * hd + e] = acc;
                    }
                }
            }
        ref_proj(st, peft, s, l, "self_attn.o_proj", o, n, qw, H, y);
        for (size_t i = 0; i < n * H; i++)
            x[i] += y[i];
        ref_norm(st, c, (long)l, "post_attention_layernorm", x, n, h);
        ref_proj(st, peft, s, l, "mlp.gate_proj", h, n, H, F, g);
        ref_proj(st, peft, s, l, "mlp.up_proj", h, n, H, F, u);
        for (size_t i = 0; i < n * F; i++)
            g[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
        ref_proj(st, peft, s, l, "mlp.down_proj", g, n, F, H, y);
        for (size_t i = 0; i < n * H; i++)
            x[i] += y[i];
    }
    ref_norm(st, c, -1, "model.norm.weight", x, n, h);
    /* The head: the embedding table when tied, else lm_head (decode(bitmap) + residual when pruned). */
    float *lm = c->tie_word_embeddings ? rd(st, "model.embed_tokens.weight", V, H) : weight_eff(st, NULL, "lm_head", V, H, 0);
    double *logits = calloc(n * V, sizeof *logits);
    ref_linear(h, n, H, V, lm, logits);
    free(lm);
    free(emb);
    free(x);
    free(h);
    free(q);
    free(k);
    free(v);
    free(o);
    free(y);
    free(g);
    free(u);
    return logits;
}

static void tokens_for(int32_t *tok, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        tok[i] = (int32_t)((i * 37u + seed * 11u + (i * i) % 7u) % 256u);
}

static size_t find_op(const dag_graph_t *g, dag_op op)
{
    for (size_t i = 0; i < dag_graph_size(g); i++)
        if (dag_graph_node(g, i)->op == op)
            return i;
    fail();
    return 0;
}

static double max_abs_diff(const float *a, const double *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > m)
            m = d;
    }
    return m;
}

/* Targets for tok: (tok·mul + add) mod 256. */
static void targets_for(const int32_t *tok, int32_t *tgt, size_t n, int32_t mul, int32_t add)
{
    for (size_t i = 0; i < n; i++)
        tgt[i] = (tok[i] * mul + add) % 256;
}

/* Runs x forward on n_seq sequences of T tokens and returns the logits of g's head (*nf of them). */
static const float *forward_logits(dag_exec_t *x, const dag_graph_t *g, const int32_t *tok, uint32_t n_seq,
                                   uint32_t T, size_t *nf)
{
    assert_int_equal(dag_exec_set_tokens(x, 0, tok, NULL, n_seq, T), FU_OK);
    assert_int_equal(dag_exec_forward(x, 0), FU_OK);
    const float *lg = NULL;
    assert_int_equal(dag_exec_get_output(x, 0, (uint32_t)find_op(g, DAG_OP_LM_HEAD), &lg, nf), FU_OK);
    return lg;
}

/* Fails unless the n logits are within 1e-5 of the reference's; `what` names them in the message. */
static void expect_logits(const float *lg, const double *ref, size_t n, const char *what)
{
    double d = max_abs_diff(lg, ref, n);
    if (d > 1e-5)
        fail_msg("%s differ from the reference by %g", what, d);
}

/* Runs g on the weights st over n_seq sequences of 8 tokens (tokens_for(.., tseed)) and checks the
 * logits against the reference computed from the same weights; `what` names them in the message. */
static void expect_reference_logits(const tiny *t, const dag_graph_t *g, const fu_safetensors *st,
                                    uint32_t n_seq, uint32_t tseed, const char *what)
{
    dag_exec_t *x = exec_for(g, st, false, 0, 0, 16, true);
    int32_t tok[16];
    tokens_for(tok, n_seq * 8, tseed);
    size_t nf;
    const float *lg = forward_logits(x, g, tok, n_seq, 8, &nf);
    double *ref = ref_logits(t, st, NULL, 0, tok, n_seq, 8);
    expect_logits(lg, ref, nf, what);
    free(ref);
    dag_exec_destroy(&x);
}

/* Decodes tok[0..T) in a new KV-cache session of x: a prefill of 5 tokens, then one at a time; the
 * logits of each step are the reference's row of its last position (ref: [T, V]). Returns the session
 * (caller destroys). */
static dag_session_t *decode_matches(dag_exec_t *x, const dag_graph_t *g, const int32_t *tok, size_t T,
                                     const double *ref, size_t V)
{
    dag_session_t *s = NULL;
    assert_int_equal(dag_exec_session_new(x, &s), FU_OK);
    dag_exec_session_use(x, s);
    for (size_t at = 0; at < T;) {
        uint32_t step = at == 0 ? 5 : 1;
        size_t nf = 0;
        const float *lg = forward_logits(x, g, tok + at, 1, step, &nf);
        at += step;
        assert_int_equal(nf, V);
        double d = max_abs_diff(lg, ref + (at - 1) * V, V);
        if (d > 1e-5)
            fail_msg("decode logits at position %zu differ by %g", at - 1, d);
    }
    return s;
}

/* Hands tensors over the cut between stage `up` and the next stage `down` for micro-batch mb:
 * forward, what up computed to down's inputs; backward, down's input gradients to up's output
 * gradients. Returns how many tensors crossed. */
static size_t pass_cut(dag_exec_t *up, dag_exec_t *down, uint32_t mb, bool backward)
{
    uint32_t ids[8];
    size_t n = backward ? dag_exec_cut_outputs(up, ids, 8) : dag_exec_cut_inputs(down, ids, 8);
    for (size_t k = 0; k < n; k++) {
        const float *data;
        size_t nf;
        if (backward) {
            assert_int_equal(dag_exec_get_input_grad(down, ids[k], &data, &nf), FU_OK);
            assert_non_null(data);
            assert_int_equal(dag_exec_set_output_grad(up, mb, ids[k], data, nf), FU_OK);
        } else {
            assert_int_equal(dag_exec_get_output(up, mb, ids[k], &data, &nf), FU_OK);
            assert_int_equal(dag_exec_set_input(down, mb, ids[k], data, nf), FU_OK);
        }
    }
    return n;
}

/* Node i's adapter B in x (grad: its gradient dB); NULL when node i has no adapter there. */
static kern_tensor_t *adapter_b(dag_exec_t *x, size_t i, bool grad)
{
    kern_tensor_t *t = NULL;
    if (dag_exec_adapter(x, (uint32_t)i, NULL, grad ? NULL : &t, NULL, grad ? &t : NULL) != FU_OK)
        return NULL;
    return t;
}

/* When node i has an adapter in a, b has it too with a bit-identical B (grad: dB). Returns whether
 * node i has one. */
static bool same_b(dag_exec_t *a, dag_exec_t *b, size_t i, bool grad)
{
    kern_tensor_t *ta = adapter_b(a, i, grad);
    if (!ta)
        return false;
    kern_tensor_t *tb = adapter_b(b, i, grad);
    if (!tb)
        fail_msg("node %zu has an adapter in one executor only", i);
    assert_memory_equal(ta->data, tb->data, kern_tensor_nbytes(ta));
    return true;
}

/* ---- tests -------------------------------------------------------------------------------------- */

static void test_dag_exec_logits_match_reference(void **state)
{
    tiny *t = tiny_start(state, "exec-ref", 1);
    dag_graph_t *g = graph(t, DAG_ADAPTER_NONE, 0, DAG_HEAD_LOGITS, 0);
    const size_t n_seq = 2, T = 8, V = t->cfg.vocab_size;
    int32_t tok[16];
    tokens_for(tok, n_seq * T, 3);
    double *ref = ref_logits(t, t->st, NULL, 0, tok, n_seq, T);

    dag_exec_t *x = exec_for(g, t->st, false, 0, 0, 16, true);
    size_t nf = 0;
    const float *lg = forward_logits(x, g, tok, (uint32_t)n_seq, (uint32_t)T, &nf);
    assert_int_equal(nf, n_seq * T * V);
    expect_logits(lg, ref, nf, "whole-sequence logits");
    dag_exec_destroy(&x);

    /* Incremental decoding with a KV cache: prefill 5 tokens, then one at a time. */
    x = exec_for(g, t->st, false, 0, 0, 8, false);
    dag_session_t *s = decode_matches(x, g, tok, T, ref, V);
    assert_int_equal(dag_session_len(s), (int64_t)T);
    /* Replay: truncate and decode the last token again. */
    assert_int_equal(dag_session_truncate(s, (int64_t)T - 1), FU_OK);
    lg = forward_logits(x, g, tok + T - 1, 1, 1, &nf);
    expect_logits(lg, ref + (T - 1) * V, V, "replayed logits");
    dag_exec_session_destroy(&s);
    dag_exec_destroy(&x);
    free(ref);
    dag_graph_destroy(&g);
}

static float loss_of(dag_exec_t *x, const int32_t *tok, const int32_t *tgt, uint32_t n_seq, uint32_t T)
{
    assert_int_equal(dag_exec_set_tokens(x, 0, tok, tgt, n_seq, T), FU_OK);
    assert_int_equal(dag_exec_forward(x, 0), FU_OK);
    float l = 0;
    assert_int_equal(dag_exec_loss(x, 0, &l, NULL), FU_OK);
    return l;
}

static void check_fd(dag_exec_t *x, const dag_graph_t *g, bool check_a, const int32_t *tok, const int32_t *tgt)
{
    /* Non-zero B so that every path (and A's gradient) matters. */
    for (size_t i = 0; i < dag_graph_size(g); i++) {
        kern_tensor_t *A, *B;
        if (dag_exec_adapter(x, (uint32_t)i, &A, &B, NULL, NULL) != FU_OK)
            continue;
        float *b = B->data;
        for (int64_t k = 0; k < kern_tensor_numel(B); k++)
            b[k] = 0.05f * (float)sin((double)(k + 3 * (int64_t)i));
        assert_int_equal(dag_exec_adapter_changed(x, (uint32_t)i), FU_OK); /* SALR: rebuild b_cat */
    }
    (void)loss_of(x, tok, tgt, 2, 8);
    assert_int_equal(dag_exec_backward(x, 0, 1.0f), FU_OK);
    int checked = 0;
    for (size_t i = 0; i < dag_graph_size(g); i++) {
        kern_tensor_t *A, *B, *dA, *dB;
        if (dag_exec_adapter(x, (uint32_t)i, &A, &B, &dA, &dB) != FU_OK)
            continue;
        for (int which = 0; which < (check_a ? 2 : 1); which++) {
            kern_tensor_t *P = which ? A : B, *D = which ? dA : dB;
            assert_non_null(D);
            float *p = P->data, *d = D->data;
            /* The entry with the largest analytic gradient. */
            int64_t best = 0;
            for (int64_t k = 1; k < kern_tensor_numel(D); k++)
                if (fabsf(d[k]) > fabsf(d[best]))
                    best = k;
            float keep = p[best], h = 1e-2f;
            p[best] = keep + h;
            assert_int_equal(dag_exec_adapter_changed(x, (uint32_t)i), FU_OK);
            double lp = loss_of(x, tok, tgt, 2, 8);
            p[best] = keep - h;
            assert_int_equal(dag_exec_adapter_changed(x, (uint32_t)i), FU_OK);
            double lm = loss_of(x, tok, tgt, 2, 8);
            p[best] = keep;
            assert_int_equal(dag_exec_adapter_changed(x, (uint32_t)i), FU_OK);
            double fd = (lp - lm) / (2.0 * h), an = d[best];
            if (fabs(fd - an) > 5e-4 + 0.03 * fabs(an))
                fail_msg("node %zu %s[%lld]: analytic %g, finite difference %g", i, which ? "A" : "B",
                         (long long)best, an, fd);
            checked++;
        }
    }
    assert_true(checked >= 14);
}

static void test_dag_exec_gradients_match_finite_differences(void **state)
{
    tiny *t = tiny_start(state, "exec-fd", 2);
    int32_t tok[16], tgt[16];
    tokens_for(tok, 16, 5);
    targets_for(tok, tgt, 16, 7, 1);
    tgt[3] = -100; /* ignored position */
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA_FA, 4, DAG_HEAD_LOSS, 0);
    dag_exec_t *x = exec_for(g, t->st, true, 0, 0, 16, false);
    check_fd(x, g, false, tok, tgt);
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
    g = graph(t, DAG_ADAPTER_LORA, 4, DAG_HEAD_LOSS, 0);
    x = exec_for(g, t->st, true, 0, 0, 16, false);
    check_fd(x, g, true, tok, tgt);
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
}

/* The same on a Qwen3-shaped model with every new piece at once: per-head q/k RMSNorm, biases on
 * q/k/v/o (attention_bias) and a sliding window of 5 over sequences of 8. */
static void test_dag_exec_qwen_gradients_match_finite_differences(void **state)
{
    tiny *t = *state;
    t->dir = tu_tmpdir("exec-qwen");
    assert_non_null(t->dir);
    fu_modelcfg_defaults(&t->cfg);
    snprintf(t->cfg.model_type, sizeof t->cfg.model_type, "qwen3");
    snprintf(t->cfg.architecture, sizeof t->cfg.architecture, "Qwen3ForCausalLM");
    t->cfg.qk_norm = t->cfg.attn_qkv_bias = t->cfg.attn_o_bias = true;
    t->cfg.sliding_window = 5;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_model_init_random(t->dir, &t->cfg, 11, 0.08f, &em), FU_OK);
    dag_dims_from_cfg(&t->cfg, &t->dims);
    assert_int_equal(fu_safetensors_open_dir(t->dir, &t->st, &em), FU_OK);
    int32_t tok[16], tgt[16];
    tokens_for(tok, 16, 5);
    targets_for(tok, tgt, 16, 7, 1);
    for (int m = 0; m < 2; m++) {
        dag_graph_t *g = graph(t, m ? DAG_ADAPTER_LORA : DAG_ADAPTER_LORA_FA, 4, DAG_HEAD_LOSS, 0);
        size_t norms = 0, biased = 0;
        for (size_t i = 0; i < dag_graph_size(g); i++) {
            norms += dag_graph_node(g, i)->op == DAG_OP_HEAD_NORM;
            biased += (dag_graph_node(g, i)->flags & DAG_NODE_BIAS) != 0;
        }
        assert_int_equal(norms, 2 * t->cfg.num_hidden_layers);
        assert_int_equal(biased, 4 * t->cfg.num_hidden_layers);
        dag_exec_t *x = exec_for(g, t->st, true, 0, 0, 16, false);
        check_fd(x, g, m == 1, tok, tgt);
        dag_exec_destroy(&x);
        dag_graph_destroy(&g);
    }
}

static void test_dag_exec_stages_equal_whole_dag(void **state)
{
    tiny *t = tiny_start(state, "exec-stages", 3);
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA_FA, 4, DAG_HEAD_LOSS, 0);
    int32_t tok[32], tgt[32];
    tokens_for(tok, 32, 9);
    targets_for(tok, tgt, 32, 1, 1);
    kern_adamw_params ap = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
    dag_exec_t *whole = exec_for(g, t->st, true, 0, 0, 32, false);
    /* Three stages: embedding + layer 0 | layer 1's attention half | the rest (a mid-layer cut). */
    size_t cuts[4] = {0, 16, 25, dag_graph_size(g)};
    dag_exec_t *st[3];
    for (int s = 0; s < 3; s++)
        st[s] = exec_for(g, t->st, true, cuts[s], cuts[s + 1], 32, false);
    for (int step = 0; step < 3; step++) {
        float lw = loss_of(whole, tok, tgt, 2, 16);
        assert_int_equal(dag_exec_backward(whole, 0, 1.0f), FU_OK);
        assert_int_equal(dag_exec_step(whole, &ap), FU_OK);

        for (int s = 0; s < 3; s++) {
            assert_int_equal(dag_exec_set_tokens(st[s], 0, tok, tgt, 2, 16), FU_OK);
            if (s > 0)
                assert_int_equal(pass_cut(st[s - 1], st[s], 0, false), 1);
            assert_int_equal(dag_exec_forward(st[s], 0), FU_OK);
        }
        float ls = 0;
        assert_int_equal(dag_exec_loss(st[2], 0, &ls, NULL), FU_OK);
        assert_true(ls == lw);
        for (int s = 2; s >= 0; s--) {
            if (s < 2)
                assert_int_equal(pass_cut(st[s], st[s + 1], 0, true), 1);
            assert_int_equal(dag_exec_backward(st[s], 0, 1.0f), FU_OK);
            assert_int_equal(dag_exec_step(st[s], &ap), FU_OK);
        }
        /* Every adapter is bit-identical to the whole DAG's. */
        for (size_t i = 0; i < dag_graph_size(g); i++)
            (void)same_b(whole, st[i < cuts[1] ? 0 : i < cuts[2] ? 1 : 2], i, false);
    }
    for (int s = 0; s < 3; s++)
        dag_exec_destroy(&st[s]);
    dag_exec_destroy(&whole);
    dag_graph_destroy(&g);
}

static void test_dag_exec_lorafa_saves_less_than_lora(void **state)
{
    tiny *t = tiny_start(state, "exec-mem", 4);
    int32_t tok[64], tgt[64];
    tokens_for(tok, 64, 1);
    for (int i = 0; i < 64; i++)
        tgt[i] = tok[(i + 1) % 64];
    size_t saved[2];
    dag_adapter_method m[2] = {DAG_ADAPTER_LORA, DAG_ADAPTER_LORA_FA};
    for (int k = 0; k < 2; k++) {
        dag_graph_t *g = graph(t, m[k], 8, DAG_HEAD_LOSS, 0);
        dag_exec_t *x = exec_for(g, t->st, true, 0, 0, 64, false);
        (void)loss_of(x, tok, tgt, 4, 16);
        saved[k] = dag_exec_saved_bytes(x);
        /* The cost model's estimate (what the partitioner plans with) is close to what is kept:
         * above it by at most layer 0's first norm input, which needs no gradient here. */
        dag_cost c = dag_graph_cost(g, 0, dag_graph_size(g));
        double est = (double)c.act_bytes * 64.0;
        print_message("%s: saved %zu B, estimated %.0f B\n", dag_adapter_name(m[k]), saved[k], est);
        assert_true(est >= (double)saved[k] && est <= 1.1 * (double)saved[k]);
        assert_int_equal(dag_exec_backward(x, 0, 1.0f), FU_OK);
        assert_int_equal(dag_exec_saved_bytes_peak(x), saved[k]);
        dag_exec_destroy(&x);
        dag_graph_destroy(&g);
    }
    /* LoRA keeps each adapted linear's input X (n × in); LoRA-FA only X·Aᵀ (n × r). Per layer the
     * extra inputs are h (q/k/v share it), the attention output, h2 (gate/up) and the SwiGLU output. */
    const fu_modelcfg *c = &t->cfg;
    size_t extra = 64ull * 4 * (c->hidden_size * 2 + c->num_attention_heads * c->head_dim + c->intermediate_size) *
                   c->num_hidden_layers;
    print_message("saved activations: lora %zu B, lora-fa %zu B (%.2fx)\n", saved[0], saved[1],
                  (double)saved[0] / (double)saved[1]);
    assert_int_equal(saved[0] - saved[1], extra);
}

static void train(dag_exec_t *x, const int32_t *text, size_t n_text, int steps, float lr, float *first, float *last)
{
    kern_adamw_params ap = {.lr = lr, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
    const uint32_t B = 2, T = 16;
    int32_t tok[32], tgt[32];
    size_t windows = n_text / (T + 1), w = 0;
    double head = 0, tail = 0;
    for (int s = 0; s < steps; s++) {
        for (uint32_t b = 0; b < B; b++, w = (w + 1) % windows) {
            memcpy(tok + b * T, text + w * (T + 1), T * sizeof *tok);
            memcpy(tgt + b * T, text + w * (T + 1) + 1, T * sizeof *tgt);
        }
        float l = loss_of(x, tok, tgt, B, T);
        assert_int_equal(dag_exec_backward(x, 0, 1.0f), FU_OK);
        assert_int_equal(dag_exec_step(x, &ap), FU_OK);
        if (s < 5)
            head += l / 5.0;
        if (s >= steps - 5)
            tail += l / 5.0;
    }
    *first = (float)head;
    *last = (float)tail;
}

static int32_t *pattern_text(size_t n)
{
    const char *s = "the quick brown fox jumps over the lazy dog. ";
    int32_t *t = malloc(n * sizeof *t);
    for (size_t i = 0; i < n; i++)
        t[i] = (unsigned char)s[i % strlen(s)];
    return t;
}

/* Fine-tunes x for `steps` steps on a repeated sentence at learning rate lr: the mean loss of the last
 * five steps must end below `ratio` times the first five's; `what` names the run in the printout. */
static void expect_learns(dag_exec_t *x, int steps, float lr, float ratio, const char *what)
{
    int32_t *text = pattern_text(17 * 40);
    float first, last;
    train(x, text, 17 * 40, steps, lr, &first, &last);
    free(text);
    print_message("%s: loss %.3f -> %.3f over %d steps\n", what, first, last, steps);
    if (!(last < ratio * first))
        fail_msg("%s: the loss went from %.3f to %.3f, not below %.2f of it", what, first, last, ratio);
    assert_int_equal(dag_exec_steps_done(x), steps);
}

/* expect_learns for a training executor of g on the weights st (rate 2e-2, below 0.7 of the start). */
static void expect_graph_learns(const dag_graph_t *g, const fu_safetensors *st, int steps, const char *what)
{
    dag_exec_t *x = exec_for(g, st, true, 0, 0, 32, false);
    expect_learns(x, steps, 2e-2f, 0.7f, what);
    dag_exec_destroy(&x);
}

static void test_dag_exec_finetune_lowers_loss(void **state)
{
    tiny *t = tiny_start(state, "exec-train", 5);
    dag_adapter_method m[2] = {DAG_ADAPTER_LORA_FA, DAG_ADAPTER_LORA};
    for (int k = 0; k < 2; k++) {
        dag_graph_t *g = graph(t, m[k], 8, DAG_HEAD_LOSS, 0);
        expect_graph_learns(g, t->st, 50, dag_adapter_name(m[k]));
        dag_graph_destroy(&g);
    }
    /* LoRA-FA with PEFT's gradient correction also learns. */
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA_FA, 8, DAG_HEAD_LOSS, 0);
    dag_exec_opts o = {.max_tokens = 32, .training = true, .seed = 7, .lorafa_correction = true};
    dag_exec_t *x = NULL;
    assert_int_equal(dag_exec_new(g, &o, &x, NULL), FU_OK);
    assert_int_equal(dag_exec_load_weights(x, t->st, NULL), FU_OK);
    expect_learns(x, 30, 1e-2f, 0.8f, "lora_fa with correction");
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
}

static void test_dag_exec_checkpoint_round_trip_and_peft(void **state)
{
    tiny *t = tiny_start(state, "exec-ckpt", 6);
    int32_t *text = pattern_text(17 * 10);
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA_FA, 4, DAG_HEAD_LOSS, 0);
    dag_exec_t *x = exec_for(g, t->st, true, 0, 0, 32, false);
    float a, b;
    train(x, text, 170, 6, 1e-2f, &a, &b);
    char *ck = fu_path_join(t->dir, "ckpt.safetensors");
    fu_errmsg em = {{0}};
    assert_int_equal(dag_exec_save_state(x, ck, &em), FU_OK);
    dag_exec_t *y = exec_for(g, t->st, true, 0, 0, 32, false);
    fu_safetensors *cs = NULL;
    assert_int_equal(fu_safetensors_open_file(ck, &cs, &em), FU_OK);
    assert_int_equal(dag_exec_load_state(y, cs, &em), FU_OK);
    assert_int_equal(dag_exec_steps_done(y), 6);
    train(x, text, 170, 2, 1e-2f, &a, &b);
    train(y, text, 170, 2, 1e-2f, &a, &b);
    for (size_t i = 0; i < dag_graph_size(g); i++)
        (void)same_b(x, y, i, false);
    fu_safetensors_close(&cs);

    /* PEFT export: names, shapes, config; the reference with merged weights gives the same logits as
     * the executor with the adapter loaded. */
    char *ad = fu_path_join(t->dir, "adapter");
    assert_int_equal(dag_exec_save_adapter(x, ad, "tiny", &em), FU_OK);
    fu_safetensors *ps = NULL;
    char *pp = fu_path_join(ad, "adapter_model.safetensors");
    assert_int_equal(fu_safetensors_open_file(pp, &ps, &em), FU_OK);
    assert_non_null(fu_safetensors_get(ps, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
    assert_non_null(fu_safetensors_get(ps, "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
    assert_int_equal(fu_safetensors_count(ps), 2 * 7 * 2);
    char *cj = NULL;
    size_t cl = 0;
    char *cp = fu_path_join(ad, "adapter_config.json");
    assert_int_equal(fu_file_read_all(cp, 1 << 16, &cj, &cl, &em), FU_OK);
    cJSON *cfg = cJSON_Parse(cj);
    assert_non_null(cfg);
    assert_string_equal(cJSON_GetObjectItem(cfg, "peft_type")->valuestring, "LORA");
    assert_string_equal(cJSON_GetObjectItem(cfg, "task_type")->valuestring, "CAUSAL_LM");
    assert_string_equal(cJSON_GetObjectItem(cfg, "base_model_name_or_path")->valuestring, "tiny");
    assert_int_equal(cJSON_GetObjectItem(cfg, "r")->valueint, 4);
    cJSON *tm = cJSON_GetObjectItem(cfg, "target_modules");
    assert_int_equal(cJSON_GetArraySize(tm), 7);
    assert_string_equal(cJSON_GetArrayItem(tm, 6)->valuestring, "down_proj");
    cJSON_Delete(cfg);
    free(cj);

    dag_graph_t *gi = graph(t, DAG_ADAPTER_LORA, 4, DAG_HEAD_LOGITS, 0);
    dag_exec_t *inf = exec_for(gi, t->st, false, 0, 0, 16, true);
    assert_int_equal(dag_exec_load_adapter(inf, ps, &em), FU_OK);
    int32_t tok[16];
    tokens_for(tok, 16, 2);
    size_t nf;
    const float *lg = forward_logits(inf, gi, tok, 2, 8, &nf);
    double *ref = ref_logits(t, t->st, ps, 2.0 * 4 / 4.0, tok, 2, 8);
    double *ref0 = ref_logits(t, t->st, NULL, 0, tok, 2, 8);
    expect_logits(lg, ref, nf, "logits with the adapter (reference: merged weights)");
    assert_true(max_abs_diff(lg, ref0, nf) > 1e-3); /* the adapter changes the output */
    free(ref);
    free(ref0);
    dag_exec_destroy(&inf);
    dag_graph_destroy(&gi);
    fu_safetensors_close(&ps);
    free(cp);
    free(pp);
    free(ad);
    free(ck);
    dag_exec_destroy(&y);
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
    free(text);
}

/* Opens the SALR model in pd after checking its salr_config.json: sparsity 0.5, residual rank 8,
 * lm_head pruned or not. */
static fu_safetensors *open_pruned(const char *pd, bool lm_head)
{
    fu_errmsg em = {{0}};
    dag_salr_info info;
    assert_int_equal(dag_salr_info_load(pd, &info, &em), FU_OK);
    assert_true(fabs(info.sparsity - 0.5) < 1e-9);
    assert_int_equal(info.residual_rank, 8);
    assert_int_equal(info.lm_head, lm_head);
    fu_safetensors *ps = NULL;
    assert_int_equal(fu_safetensors_open_dir(pd, &ps, &em), FU_OK);
    return ps;
}

static void test_dag_exec_salr_pruned_model(void **state)
{
    tiny *t = tiny_start(state, "exec-salr", 8);
    char *pd = fu_path_join(t->dir, "pruned");
    fu_errmsg em = {{0}};
    fu_err rc = dag_salr_prune_model(t->dir, pd, 0.5, 8, 1, &em);
    if (rc != FU_OK)
        fail_msg("prune: %s", fu_errmsg_text(&em, rc));
    fu_safetensors *ps = open_pruned(pd, false);
    assert_null(fu_safetensors_get(ps, "model.layers.0.self_attn.q_proj.weight"));
    assert_non_null(fu_safetensors_get(ps, "model.layers.0.self_attn.q_proj.weight.bitmap"));

    /* Forward equals the reference on decode(bitmap) + residual, with the trained adapter at 0. */
    dag_graph_t *g = graph(t, DAG_ADAPTER_SALR, 4, DAG_HEAD_LOGITS, 8);
    expect_reference_logits(t, g, ps, 2, 4, "SALR logits");
    dag_graph_destroy(&g);

    /* Training the SALR adapter lowers the loss. */
    g = graph(t, DAG_ADAPTER_SALR, 8, DAG_HEAD_LOSS, 8);
    expect_graph_learns(g, ps, 40, "salr");
    dag_graph_destroy(&g);
    fu_safetensors_close(&ps);
    free(pd);
}

/* ---- a SALR-pruned lm_head ------------------------------------------------------------------ */

static char *prune_tiny(const tiny *t, const char *sub, bool lm_head, dag_salr_prune_report *rep)
{
    char *pd = fu_path_join(t->dir, sub);
    fu_errmsg em = {{0}};
    dag_salr_prune_opts po = {.sparsity = 0.5, .rank = 8, .seed = 1, .prune_lm_head = lm_head};
    fu_err rc = dag_salr_prune(t->dir, pd, &po, rep, &em);
    if (rc != FU_OK)
        fail_msg("prune: %s", fu_errmsg_text(&em, rc));
    return pd;
}

static dag_graph_t *salr_graph(const tiny *t, uint32_t rank, dag_head head, bool salr_head)
{
    dag_build_opts o = {.method = DAG_ADAPTER_SALR, .rank = rank, .alpha = 2.0f * (float)rank, .res_rank = 8,
                        .salr_lm_head = salr_head, .head = head, .seq_len = 16};
    dag_graph_t *g = NULL;
    assert_int_equal(dag_build_llama(&t->dims, &o, &g), FU_OK);
    return g;
}

/* Loads g's weights from st and returns the error (with the message in em). */
static fu_err load_err(const dag_graph_t *g, const fu_safetensors *st, fu_errmsg *em)
{
    dag_exec_opts o = {.max_tokens = 16, .training = false, .logits_all = true};
    dag_exec_t *x = NULL;
    assert_int_equal(dag_exec_new(g, &o, &x, em), FU_OK);
    fu_err rc = dag_exec_load_weights(x, st, em);
    dag_exec_destroy(&x);
    return rc;
}

/* The pruned head computes with W_sparse + salr_B·salr_A: the logits (every row, and the last row of
 * KV-cache decode steps) equal a reference whose lm_head weight is that sum; the file has no dense
 * lm_head; a blocks-only graph on it fails with a message saying what to build. */
static void test_dag_exec_salr_lm_head_matches_reference(void **state)
{
    tiny *t = tiny_start(state, "exec-salr-head", 21);
    dag_salr_prune_report rep;
    char *pd = prune_tiny(t, "pruned", true, &rep);
    assert_true(rep.lm_head_pruned);
    assert_false(rep.lm_head_tied);
    assert_int_equal(rep.n_blocks, 2 * 7);
    assert_true(rep.lm_head_err > 0.0 && rep.lm_head_err < 0.5);
    assert_true(rep.lm_head_svd_ratio > 0.0 && rep.lm_head_svd_ratio <= 1.0 - 8.0 / 64.0 + 1e-6);
    assert_true(rep.bytes_out < rep.bytes_in);
    fu_errmsg em = {{0}};
    fu_safetensors *ps = open_pruned(pd, true);
    assert_null(fu_safetensors_get(ps, "lm_head.weight"));
    assert_non_null(fu_safetensors_get(ps, "lm_head.weight.bitmap"));
    assert_non_null(fu_safetensors_get(ps, "lm_head.weight.values"));
    assert_non_null(fu_safetensors_get(ps, "lm_head.weight.offsets"));
    const fu_st_tensor *ta = fu_safetensors_get(ps, "lm_head.salr_A.weight"),
                       *tb = fu_safetensors_get(ps, "lm_head.salr_B.weight");
    assert_non_null(ta);
    assert_non_null(tb);
    assert_true(ta->shape[0] == 8 && ta->shape[1] == 64 && tb->shape[0] == 256 && tb->shape[1] == 8);
    assert_non_null(fu_safetensors_metadata(ps, "lm_head.weight.format"));

    const size_t V = t->cfg.vocab_size;
    int32_t tok[16];
    tokens_for(tok, 16, 4);
    double *ref = ref_logits(t, ps, NULL, 0, tok, 2, 8);
    double *dense = ref_logits(t, t->st, NULL, 0, tok, 2, 8);
    dag_graph_t *g = salr_graph(t, 0, DAG_HEAD_LOGITS, true);
    uint32_t lm = (uint32_t)find_op(g, DAG_OP_LM_HEAD);
    assert_int_equal(dag_graph_node(g, lm)->adapter.method, DAG_ADAPTER_SALR);
    dag_exec_t *x = exec_for(g, ps, false, 0, 0, 16, true);
    size_t nf;
    const float *lg = forward_logits(x, g, tok, 2, 8, &nf);
    assert_int_equal(nf, 16 * V);
    expect_logits(lg, ref, nf, "pruned-head logits (reference: W_sparse + B·A)");
    assert_true(max_abs_diff(lg, dense, nf) > 1e-3); /* and the head really is not the dense one */
    dag_exec_destroy(&x);

    /* Generation: only the last row goes through the sparse head. */
    x = exec_for(g, ps, false, 0, 0, 8, false);
    dag_session_t *s = decode_matches(x, g, tok, 8, ref, V);
    dag_exec_session_destroy(&s);
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);

    /* A graph with a dense head on this model: refused, naming the fix. */
    g = salr_graph(t, 0, DAG_HEAD_LOGITS, false);
    assert_int_equal(load_err(g, ps, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "lm_head.weight"));
    assert_non_null(strstr(em.msg, "salr_lm_head"));
    dag_graph_destroy(&g);
    free(ref);
    free(dense);
    fu_safetensors_close(&ps);
    free(pd);
}

/* Fine-tuning through the pruned head: gradients reaching every adapter through its backward
 * (dX = dY·W_sparse + (dY·B₂)·A₂) match finite differences, a pipeline split before the head gives
 * the whole DAG's loss and input gradient, and a few dozen steps lower the loss. */
static void test_dag_exec_salr_lm_head_trains(void **state)
{
    tiny *t = tiny_start(state, "exec-salr-head-train", 22);
    char *pd = prune_tiny(t, "pruned", true, NULL);
    fu_safetensors *ps = open_pruned(pd, true);
    int32_t tok[16], tgt[16];
    tokens_for(tok, 16, 5);
    targets_for(tok, tgt, 16, 7, 1);
    dag_graph_t *g = salr_graph(t, 4, DAG_HEAD_LOSS, true);
    dag_exec_t *x = exec_for(g, ps, true, 0, 0, 16, false);
    check_fd(x, g, false, tok, tgt);

    dag_exec_destroy(&x);

    /* Two stages cut before the final norm (the head in the second): the whole DAG's loss and
     * adapter gradients, bit for bit, with the head's dX crossing the cut. */
    dag_exec_t *w = exec_for(g, ps, true, 0, 0, 16, false);
    size_t cut = find_op(g, DAG_OP_LM_HEAD) - 1; /* the final rmsnorm */
    dag_exec_t *sa = exec_for(g, ps, true, 0, cut, 16, false), *sb = exec_for(g, ps, true, cut, 0, 16, false);
    float lw = loss_of(w, tok, tgt, 2, 8);
    assert_int_equal(dag_exec_backward(w, 0, 1.0f), FU_OK);
    assert_int_equal(dag_exec_set_tokens(sa, 0, tok, tgt, 2, 8), FU_OK);
    assert_int_equal(dag_exec_forward(sa, 0), FU_OK);
    assert_int_equal(dag_exec_set_tokens(sb, 0, tok, tgt, 2, 8), FU_OK);
    assert_int_equal(pass_cut(sa, sb, 0, false), 1);
    assert_int_equal(dag_exec_forward(sb, 0), FU_OK);
    float lb = 0;
    assert_int_equal(dag_exec_loss(sb, 0, &lb, NULL), FU_OK);
    assert_true(lb == lw);
    assert_int_equal(dag_exec_backward(sb, 0, 1.0f), FU_OK);
    assert_int_equal(pass_cut(sa, sb, 0, true), 1);
    assert_int_equal(dag_exec_backward(sa, 0, 1.0f), FU_OK);
    int compared = 0;
    for (size_t i = 0; i < cut; i++)
        compared += same_b(w, sa, i, true);
    assert_int_equal(compared, 14);
    dag_exec_destroy(&sa);
    dag_exec_destroy(&sb);
    dag_exec_destroy(&w);
    dag_graph_destroy(&g);

    /* Training lowers the loss. */
    g = salr_graph(t, 8, DAG_HEAD_LOSS, true);
    expect_graph_learns(g, ps, 40, "salr with a pruned lm_head");
    dag_graph_destroy(&g);
    fu_safetensors_close(&ps);
    free(pd);
}

/* Writes a copy of st into path without the tensors whose names start with `drop` (NULL: none), with bit 0 of byte `flip_at` of
 * tensor `flip` (NULL: none) inverted, and returns it opened. */
static fu_safetensors *copy_model(const fu_safetensors *st, const char *path, const char *drop, const char *flip,
                                  size_t flip_at)
{
    size_t n = fu_safetensors_count(st), k = 0;
    fu_st_tensor *ts = calloc(n, sizeof *ts);
    void *own = NULL;
    for (size_t i = 0; i < n; i++) {
        const fu_st_tensor *src = fu_safetensors_at(st, i);
        if (drop && strncmp(src->name, drop, strlen(drop)) == 0)
            continue;
        ts[k] = *src;
        if (flip && strcmp(src->name, flip) == 0) {
            own = malloc(src->nbytes);
            memcpy(own, src->data, src->nbytes);
            ((uint8_t *)own)[flip_at] ^= 1u;
            ts[k].data = own;
        }
        k++;
    }
    assert_int_equal(fu_safetensors_write(path, ts, k, NULL, 0, NULL, NULL, NULL), FU_OK);
    free(own);
    free(ts);
    fu_safetensors *out = NULL;
    assert_int_equal(fu_safetensors_open_file(path, &out, NULL), FU_OK);
    return out;
}

/* Pruning with prune_lm_head false (--keep-lm-head) keeps lm_head dense (blocks-only graphs load
 * it); tied embeddings keep it dense even when asked; a pruned head whose files are missing a piece or are corrupt fails to load with a
 * message naming the tensor. */
static void test_dag_exec_salr_lm_head_files(void **state)
{
    tiny *t = tiny_start(state, "exec-salr-head-files", 23);
    fu_errmsg em = {{0}};

    /* --keep-lm-head: lm_head.weight dense, salr_config.json says so. */
    dag_salr_prune_report rep;
    char *kd = prune_tiny(t, "kept", false, &rep);
    assert_false(rep.lm_head_pruned);
    assert_false(rep.lm_head_tied);
    assert_true(rep.lm_head_err == 0.0);
    assert_true(rep.blocks_err_mean > 0.0 && rep.blocks_err_max >= rep.blocks_err_mean);
    fu_safetensors *ks = open_pruned(kd, false);
    assert_non_null(fu_safetensors_get(ks, "lm_head.weight"));
    assert_null(fu_safetensors_get(ks, "lm_head.weight.bitmap"));
    dag_graph_t *g = salr_graph(t, 0, DAG_HEAD_LOGITS, false);
    assert_int_equal(load_err(g, ks, &em), FU_OK);
    dag_graph_destroy(&g);
    /* A pruned-head graph on it: the dense head would be accepted (encoded at load, as a linear's
     * is), but its residual adapter is missing. */
    g = salr_graph(t, 0, DAG_HEAD_LOGITS, true);
    assert_int_equal(load_err(g, ks, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "lm_head.salr_A.weight"));
    dag_graph_destroy(&g);
    fu_safetensors_close(&ks);

    /* A salr_config.json with a bad "lm_head" value. */
    char *cp = fu_path_join(kd, DAG_SALR_CONFIG_FILE);
    const char *bad = "{\"method\": \"salr\", \"sparsity\": 0.5, \"residual_rank\": 8, \"lm_head\": \"half\"}";
    assert_int_equal(fu_file_write_atomic(cp, bad, strlen(bad), 0644, &em), FU_OK);
    dag_salr_info info;
    assert_int_equal(dag_salr_info_load(kd, &info, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "lm_head"));
    free(cp);

    /* Pruned head: the bitmap missing, the values missing, a corrupt bitmap, both missing. */
    char *pd = prune_tiny(t, "pruned", true, NULL);
    fu_safetensors *ps = open_pruned(pd, true);
    g = salr_graph(t, 0, DAG_HEAD_LOGITS, true);
    char *path = fu_path_join(t->dir, "broken.safetensors");
    fu_safetensors *bs = copy_model(ps, path, "lm_head.weight.bitmap", NULL, 0);
    assert_int_equal(load_err(g, bs, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "'lm_head.weight.bitmap' is missing"));
    fu_safetensors_close(&bs);
    bs = copy_model(ps, path, "lm_head.weight.values", NULL, 0);
    assert_int_equal(load_err(g, bs, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "'lm_head.weight.values' is missing"));
    fu_safetensors_close(&bs);
    bs = copy_model(ps, path, NULL, "lm_head.weight.bitmap", 64 * 3 + 8);
    assert_int_equal(load_err(g, bs, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "'lm_head.weight' is inconsistent"));
    fu_safetensors_close(&bs);
    bs = copy_model(ps, path, NULL, "lm_head.weight.offsets", 4 * 7);
    assert_int_equal(load_err(g, bs, &em), FU_EPROTO);
    fu_safetensors_close(&bs);
    /* Neither the bitmap form nor a dense weight. */
    bs = copy_model(ps, path, "lm_head.weight", NULL, 0);
    assert_int_equal(load_err(g, bs, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "`fusion model prune` writes one"));
    fu_safetensors_close(&bs);
    dag_graph_destroy(&g);
    fu_safetensors_close(&ps);
    free(path);

    /* Tied embeddings: asked to prune the head, the tool leaves it dense and says so. */
    tiny tt;
    tiny_open_with(&tt, "exec-salr-tied", 24, true);
    char *td = prune_tiny(&tt, "pruned", true, &rep);
    assert_false(rep.lm_head_pruned);
    assert_true(rep.lm_head_tied);
    fu_safetensors *ts = open_pruned(td, false);
    assert_null(fu_safetensors_get(ts, "lm_head.weight.bitmap"));
    assert_non_null(fu_safetensors_get(ts, "model.embed_tokens.weight"));
    dag_build_opts o = {.method = DAG_ADAPTER_SALR, .res_rank = 8, .salr_lm_head = true, .head = DAG_HEAD_LOGITS};
    assert_int_equal(dag_build_llama(&tt.dims, &o, &g), FU_EINVAL);
    /* The blocks-only graph runs, its head being the embedding table. */
    o.salr_lm_head = false;
    assert_int_equal(dag_build_llama(&tt.dims, &o, &g), FU_OK);
    expect_reference_logits(&tt, g, ts, 1, 2, "logits with tied embeddings");
    dag_graph_destroy(&g);
    fu_safetensors_close(&ts);
    free(td);
    tiny_close(&tt);
    free(pd);
    free(kd);
}

static void test_dag_exec_rejects_bad_input(void **state)
{
    tiny *t = tiny_start(state, "exec-bad", 9);
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA_FA, 4, DAG_HEAD_LOSS, 0);
    dag_exec_opts o = {.max_tokens = 16, .training = true};
    dag_exec_t *x = NULL;
    fu_errmsg em = {{0}};
    /* A model without the tensor the graph names. */
    dag_model_dims d2 = t->dims;
    d2.tie_word_embeddings = true;
    dag_build_opts bo = {.method = DAG_ADAPTER_NONE, .head = DAG_HEAD_LOGITS};
    dag_graph_t *g2 = NULL;
    assert_int_equal(dag_build_llama(&d2, &bo, &g2), FU_OK);
    d2.intermediate_size = 100;
    dag_graph_t *g3 = NULL;
    assert_int_equal(dag_build_llama(&d2, &bo, &g3), FU_OK);
    assert_int_equal(dag_exec_new(g3, &o, &x, &em), FU_OK);
    fu_err rc = dag_exec_load_weights(x, t->st, &em);
    assert_int_equal(rc, FU_EINVAL);
    assert_non_null(strstr(em.msg, "gate_proj"));
    dag_exec_destroy(&x);
    dag_graph_destroy(&g3);
    dag_graph_destroy(&g2);

    o.last = 1000;
    assert_int_equal(dag_exec_new(g, &o, &x, &em), FU_EINVAL);
    o.last = 0;
    o.max_tokens = 0;
    assert_int_equal(dag_exec_new(g, &o, &x, &em), FU_EINVAL);

    x = exec_for(g, t->st, true, 0, 0, 16, false);
    int32_t tok[16] = {0}, tgt[16] = {0};
    tok[3] = 256; /* outside the vocabulary */
    assert_int_equal(dag_exec_set_tokens(x, 0, tok, tgt, 1, 16), FU_EINVAL);
    tok[3] = 1;
    tgt[2] = -5;
    assert_int_equal(dag_exec_set_tokens(x, 0, tok, tgt, 1, 16), FU_EINVAL);
    assert_int_equal(dag_exec_set_tokens(x, 0, tok, NULL, 2, 16), FU_EINVAL); /* too many rows */
    assert_int_equal(dag_exec_backward(x, 0, 1.0f), FU_EINVAL);                /* no forward */
    dag_exec_destroy(&x);

    /* A stage whose cut input was not given. */
    x = exec_for(g, t->st, true, 16, 0, 16, false);
    assert_int_equal(dag_exec_set_tokens(x, 0, tok, NULL, 1, 16), FU_OK);
    assert_int_equal(dag_exec_forward(x, 0), FU_EINVAL);
    float junk[4] = {0};
    assert_int_equal(dag_exec_set_input(x, 0, 3, junk, 4), FU_EINVAL); /* not a cut input */
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
}

/* A training step (LoRA, rank 4) over the weights bs kept in their precision (bf16, int8: mapped,
 * widened per GEMM tile) gives exactly the loss and gradient of the same weights widened to f32 at
 * load. */
static void step_kept_equals_widened(const tiny *t, const fu_safetensors *bs, const char *what)
{
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA, 4, DAG_HEAD_LOSS, 0);
    int32_t tok[16], tgt[16];
    tokens_for(tok, 16, 5);
    targets_for(tok, tgt, 16, 7, 1);
    float loss[2];
    kern_tensor_t *db[2] = {0};
    float *dbv[2] = {0};
    dag_exec_t *xs[2] = {0};
    for (int k = 0; k < 2; k++) {
        dag_exec_opts o = {.max_tokens = 16, .n_slots = 1, .training = true, .seed = 7, .widen_weights = k == 1};
        fu_errmsg em = {{0}};
        assert_int_equal(dag_exec_new(g, &o, &xs[k], &em), FU_OK);
        assert_int_equal(dag_exec_load_weights(xs[k], bs, &em), FU_OK);
        loss[k] = loss_of(xs[k], tok, tgt, 2, 8);
        assert_int_equal(dag_exec_backward(xs[k], 0, 1.0f), FU_OK);
        for (size_t i = 0; i < dag_graph_size(g) && !db[k]; i++) {
            kern_tensor_t *A, *B, *dA, *dB;
            if (dag_exec_adapter(xs[k], (uint32_t)i, &A, &B, &dA, &dB) == FU_OK)
                db[k] = dA; /* A's gradient flows back through every frozen weight after it */
        }
        assert_non_null(db[k]);
        dbv[k] = db[k]->data;
    }
    printf("%s kept: loss %.9g, widened: %.9g\n", what, loss[0], loss[1]);
    assert_memory_equal(&loss[0], &loss[1], sizeof loss[0]);
    assert_memory_equal(dbv[0], dbv[1], (size_t)kern_tensor_numel(db[0]) * sizeof(float));
    for (int k = 0; k < 2; k++)
        dag_exec_destroy(&xs[k]);
    dag_graph_destroy(&g);
}

/* A bf16 copy of the model: weights are widened to f32 once at load and match the reference read
 * from the same file. */
static void test_dag_exec_loads_bf16_weights(void **state)
{
    tiny *t = tiny_start(state, "exec-bf16", 10);
    size_t n = fu_safetensors_count(t->st);
    fu_st_tensor *ts = calloc(n, sizeof *ts);
    void **bufs = calloc(n, sizeof *bufs);
    for (size_t i = 0; i < n; i++) {
        const fu_st_tensor *src = fu_safetensors_at(t->st, i);
        float *f = malloc(src->nelem * sizeof *f);
        assert_int_equal(fu_st_tensor_to_f32(src, f, src->nelem, NULL), FU_OK);
        bufs[i] = malloc(src->nelem * 2);
        assert_int_equal(fu_st_from_f32(FU_ST_BF16, f, src->nelem, bufs[i]), FU_OK);
        free(f);
        ts[i] = *src;
        ts[i].dtype = FU_ST_BF16;
        ts[i].data = bufs[i];
        ts[i].nbytes = src->nelem * 2;
    }
    char *path = fu_path_join(t->dir, "bf16.safetensors");
    assert_int_equal(fu_safetensors_write(path, ts, n, NULL, 0, NULL, NULL, NULL), FU_OK);
    for (size_t i = 0; i < n; i++)
        free(bufs[i]);
    free(bufs);
    free(ts);
    fu_safetensors *bs = NULL;
    assert_int_equal(fu_safetensors_open_file(path, &bs, NULL), FU_OK);
    dag_graph_t *g = graph(t, DAG_ADAPTER_NONE, 0, DAG_HEAD_LOGITS, 0);
    expect_reference_logits(t, g, bs, 1, 6, "bf16 logits");
    dag_graph_destroy(&g);
    /* The CPU keeps those weights bf16 in memory (mapped, widened per GEMM tile). */
    step_kept_equals_widened(t, bs, "bf16");
    fu_safetensors_close(&bs);
    free(path);
}

/* fusion model quantize's int8 model: its logits are those of its dequantized weights (the
 * reference reads them so), a LoRA-FA training step over the int8 weights kept in memory has the
 * bits of the same weights dequantized at load, and the logits stay within the stated bound of the
 * f32 model's (docs/DAG.md "Int8 weights": the RMS difference ≤ 2% of the f32 logits' RMS). */
static void test_dag_exec_int8_weights(void **state)
{
    tiny *t = tiny_start(state, "exec-int8", 12);
    char *qdir = fu_path_join(t->dir, "q8");
    dag_quant_report rep;
    fu_errmsg em = {{0}};
    fu_err rc = dag_model_quantize(t->dir, qdir, false, &rep, &em);
    if (rc != FU_OK)
        fail_msg("quantize: %s", fu_errmsg_text(&em, rc));
    assert_int_equal(rep.quantized, 7 * t->cfg.num_hidden_layers);
    assert_true(rep.max_rel_err > 0.0 && rep.max_rel_err <= 0.5 / 127.0 + 1e-7);
    assert_int_equal(dag_model_quantize(t->dir, qdir, false, NULL, &em), FU_EEXIST);
    assert_int_equal(dag_model_quantize(qdir, qdir, true, NULL, &em), FU_EINVAL); /* already int8 */
    fu_safetensors *qs = NULL;
    assert_int_equal(fu_safetensors_open_dir(qdir, &qs, &em), FU_OK);
    const fu_st_tensor *q0 = fu_safetensors_get(qs, "model.layers.0.self_attn.q_proj.weight");
    assert_non_null(q0);
    assert_int_equal(q0->dtype, FU_ST_I8);
    assert_int_equal(fu_safetensors_get(qs, "model.embed_tokens.weight")->dtype, FU_ST_F32);
    fu_modelcfg qc;
    assert_int_equal(fu_modelcfg_load(qdir, &qc, &em), FU_OK);
    assert_true(qc.int8_weights);
    assert_int_equal(fu_modelcfg_check_weights(&qc, qs, &em), FU_OK);

    dag_graph_t *g = graph(t, DAG_ADAPTER_NONE, 0, DAG_HEAD_LOGITS, 0);
    expect_reference_logits(t, g, qs, 2, 6, "int8 logits");
    dag_exec_t *x8 = exec_for(g, qs, false, 0, 0, 16, true), *x32 = exec_for(g, t->st, false, 0, 0, 16, true);
    int32_t tok[16];
    tokens_for(tok, 16, 9);
    size_t nf = 0;
    const float *l8 = forward_logits(x8, g, tok, 2, 8, &nf), *l32 = forward_logits(x32, g, tok, 2, 8, &nf);
    double rms = 0.0, err = 0.0, worst = 0.0;
    for (size_t i = 0; i < nf; i++) {
        rms += (double)l32[i] * l32[i];
        err += ((double)l8[i] - l32[i]) * ((double)l8[i] - l32[i]);
        worst = fmax(worst, fabs((double)l8[i] - l32[i]));
    }
    rms = sqrt(rms / (double)nf), err = sqrt(err / (double)nf);
    printf("int8 against f32: RMS difference %.3g (%.2f%% of the logits' RMS %.3g), max %.3g\n", err,
           100.0 * err / rms, rms, worst);
    assert_true(err > 0.0);          /* the weights did change */
    assert_true(err <= 0.02 * rms);  /* ... within the bound */
    dag_exec_destroy(&x8);
    dag_exec_destroy(&x32);
    dag_graph_destroy(&g);
    step_kept_equals_widened(t, qs, "int8");

    /* An int8 weight without quantization_config, or with scales that are missing, of the wrong
     * shape or not finite, is refused by name. */
    qc.int8_weights = false;
    assert_int_equal(fu_modelcfg_check_weights(&qc, qs, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "is int8"));
    int8_t qv[6] = {1, -2, 3, 127, -127, 0};
    float sv[5] = {0.5f, NAN, 1.0f, 2.0f, 0.25f};
    for (int c = 0; c < 3; c++) {
        fu_st_tensor ts[2] = {{.name = "w", .dtype = FU_ST_I8, .ndim = 2, .shape = {2, 3}, .data = qv, .nbytes = 6},
                              {.name = "w_scale", .dtype = FU_ST_F32, .ndim = 1, .shape = {c == 1 ? 3 : 2},
                               .data = sv + (c == 2 ? 0 : 2), .nbytes = (c == 1 ? 3 : 2) * sizeof(float)}};
        uint8_t *img = NULL;
        size_t len = 0;
        assert_int_equal(fu_safetensors_serialize(ts, c == 0 ? 1 : 2, NULL, 0, NULL, NULL, &img, &len, &em), FU_OK);
        fu_safetensors *bad = NULL;
        assert_int_equal(fu_safetensors_parse_header(img, len, "bad.safetensors", &bad, &em), FU_OK);
        float w[6];
        uint64_t shape[2] = {2, 3};
        assert_int_equal(fu_safetensors_read_f32(bad, "w", 2, shape, w, 6, &em), c == 0 ? FU_ENOTFOUND : FU_EINVAL);
        assert_non_null(strstr(em.msg, c == 0 ? "w_scale" : c == 1 ? "must be F32 [2]" : "not finite"));
        fu_safetensors_close(&bad);
        free(img);
    }
    fu_safetensors_close(&qs);
    free(qdir);
}

/* A pipeline as a peer runs it: stages from the partitioner, two micro-batches in flight (slots),
 * both forwards before both backwards, gradients averaged with loss_scale 1/2. The adapters after
 * one step match one executor that saw the two micro-batches as one batch. */
static void test_dag_exec_planned_pipeline_with_micro_batches(void **state)
{
    tiny *t = tiny_start(state, "exec-pipe", 11);
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA_FA, 4, DAG_HEAD_LOSS, 0);
    dag_peer_profile peers[3] = {{"a", 1.0, 1ull << 30, 1e9, 1e-4}, {"b", 2.0, 1ull << 30, 1e9, 1e-4},
                                 {"c", 4.0, 1ull << 30, 1e9, 1e-4}};
    dag_partition_opts po = {.tokens_per_micro = 32, .micro_batches = 2, .training = true, .max_stages = 3};
    dag_plan plan;
    fu_errmsg pem = {{0}};
    assert_int_equal(dag_partition(g, peers, 3, &po, &plan, &pem), FU_OK);
    assert_true(plan.n_stages >= 2);
    int32_t tok[64], tgt[64];
    tokens_for(tok, 64, 12);
    targets_for(tok, tgt, 64, 3, 1);
    kern_adamw_params ap = {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};

    dag_exec_t *whole = exec_for(g, t->st, true, 0, 0, 64, false);
    float lw = loss_of(whole, tok, tgt, 4, 16);
    assert_int_equal(dag_exec_backward(whole, 0, 1.0f), FU_OK);

    size_t S = plan.n_stages;
    dag_exec_t **st = calloc(S, sizeof *st);
    for (size_t s = 0; s < S; s++) {
        dag_exec_opts o = {.first = plan.stages[s].first, .last = plan.stages[s].last, .max_tokens = 32,
                           .n_slots = 2, .training = true, .seed = 7};
        fu_errmsg em = {{0}};
        assert_int_equal(dag_exec_new(g, &o, &st[s], &em), FU_OK);
        assert_int_equal(dag_exec_load_weights(st[s], t->st, &em), FU_OK);
    }
    double lsum = 0;
    for (uint32_t mb = 0; mb < 2; mb++)
        for (size_t s = 0; s < S; s++) {
            assert_int_equal(dag_exec_set_tokens(st[s], mb, tok + 32 * mb, tgt + 32 * mb, 2, 16), FU_OK);
            if (s > 0)
                (void)pass_cut(st[s - 1], st[s], mb, false);
            assert_int_equal(dag_exec_forward(st[s], mb), FU_OK);
            if (s == S - 1) {
                float l;
                assert_int_equal(dag_exec_loss(st[s], mb, &l, NULL), FU_OK);
                lsum += l;
            }
        }
    assert_true(fabs(lsum / 2 - lw) < 1e-5);
    for (uint32_t mb = 0; mb < 2; mb++)
        for (size_t s = S; s-- > 0;) {
            if (s < S - 1)
                (void)pass_cut(st[s], st[s + 1], mb, true);
            assert_int_equal(dag_exec_backward(st[s], mb, 0.5f), FU_OK);
        }
    double worst = 0, scale = 0;
    for (size_t i = 0; i < dag_graph_size(g); i++) {
        kern_tensor_t *Bw = adapter_b(whole, i, true);
        if (!Bw)
            continue;
        size_t s = 0;
        while (i >= plan.stages[s].last)
            s++;
        kern_tensor_t *Bs = adapter_b(st[s], i, true);
        assert_non_null(Bs);
        const float *a = Bw->data, *b = Bs->data;
        for (int64_t k = 0; k < kern_tensor_numel(Bw); k++) {
            if (fabs((double)a[k] - b[k]) > worst)
                worst = fabs((double)a[k] - b[k]);
            if (fabs((double)a[k]) > scale)
                scale = fabs((double)a[k]);
        }
    }
    /* The accumulated dB of two half micro-batches (scaled 1/2) equals one whole batch's. */
    assert_true(scale > 0);
    if (worst > 1e-4 * scale)
        fail_msg("pipelined adapter gradients differ from the whole DAG's by %g (largest %g)", worst, scale);
    for (size_t s = 0; s < S; s++)
        assert_int_equal(dag_exec_step(st[s], &ap), FU_OK);
    for (size_t s = 0; s < S; s++)
        dag_exec_destroy(&st[s]);
    free(st);
    dag_plan_free(&plan);
    dag_exec_destroy(&whole);
    dag_graph_destroy(&g);
}

/* int8 gradients with error feedback (dag_train_wire_send): within a checkpoint interval what the
 * receiver decoded adds up to what was computed, short only by the last residual (at most half a step
 * of the last scale per value), where plain int8's errors add up; at a checkpoint step the residual
 * starts from zero again, so that step's encoding is plain int8's. */
static void test_dag_exec_int8_error_feedback(void **state)
{
    tiny *t = tiny_start(state, "exec-ef", 3);
    dag_graph_t *g = graph(t, DAG_ADAPTER_LORA_FA, 4, DAG_HEAD_LOSS, 0);
    dag_spec spec;
    dag_spec_init(&spec, DAG_JOB_FINETUNE);
    spec.batch = 2;
    spec.micro_batches = 1;
    spec.seq_len = 8;
    spec.checkpoint_every = 4;
    dag_train_stage ts = {.g = g, .spec = &spec, .n_cut_in = 1, .cut_in = {16}, .n_slots = 1};
    size_t n = dag_train_cut_floats(&ts, false), bytes = dag_train_wire_bytes(&ts, KERN_CODEC_INT8_EF, false);
    size_t width = (size_t)dag_graph_width(g, 16), rows = n / width;
    assert_true(n > 0 && bytes == rows * (width + 4));
    float *gk = malloc(n * sizeof *gk), *sum_g = calloc(n, sizeof *sum_g), *sum_ef = calloc(n, sizeof *sum_ef);
    float *sum_plain = calloc(n, sizeof *sum_plain), *plain = malloc(n * sizeof *plain);
    uint8_t *wire = malloc(bytes), *wire2 = malloc(bytes);
    double worst_ef = 0, worst_plain = 0;
    for (uint64_t step = 0; step < 6; step++) {
        srand((unsigned)step + 1);
        for (size_t i = 0; i < n; i++)
            gk[i] = 1e-3f * ((float)rand() / (float)RAND_MAX - 0.5f) + 1e-5f; /* a small bias int8 loses */
        memcpy(plain, gk, n * sizeof *gk);
        kern_codec_encode(KERN_CODEC_INT8, plain, rows, width, wire2);
        assert_int_equal(kern_codec_decode(KERN_CODEC_INT8, wire2, bytes, rows, width, plain), FU_OK);
        if (step == 4) /* a checkpoint step: no residual yet */
            for (size_t i = 0; i < n; i++)
                sum_g[i] = sum_ef[i] = sum_plain[i] = 0;
        for (size_t i = 0; i < n; i++)
            sum_g[i] += gk[i];
        assert_int_equal(dag_train_wire_send(&ts, KERN_CODEC_INT8_EF, false, step, 0, gk, wire), FU_OK);
        if (step == 0 || step == 4)
            assert_memory_equal(wire, wire2, bytes);
        double amax = 0;
        for (size_t i = 0; i < n; i++) {
            sum_ef[i] += gk[i];
            sum_plain[i] += plain[i];
            amax = fmax(amax, fabs(gk[i]));
        }
        if (step == 3) { /* the end of the first interval: four steps of error */
            for (size_t i = 0; i < n; i++) {
                worst_ef = fmax(worst_ef, fabs(sum_ef[i] - sum_g[i]));
                worst_plain = fmax(worst_plain, fabs(sum_plain[i] - sum_g[i]));
            }
            assert_true(worst_ef <= 0.5 * amax / 127.0 * 1.1);
        }
    }
    printf("after 4 steps: max |sum decoded - sum computed| %.3g with error feedback, %.3g without\n", worst_ef,
           worst_plain);
    assert_true(worst_ef < worst_plain);
    dag_train_stage_clear(&ts);
    free(gk);
    free(sum_g);
    free(sum_ef);
    free(sum_plain);
    free(plain);
    free(wire);
    free(wire2);
    dag_graph_destroy(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_exec_logits_match_reference),
        cmocka_unit_test(test_dag_exec_gradients_match_finite_differences),
        cmocka_unit_test(test_dag_exec_qwen_gradients_match_finite_differences),
        cmocka_unit_test(test_dag_exec_stages_equal_whole_dag),
        cmocka_unit_test(test_dag_exec_int8_error_feedback),
        cmocka_unit_test(test_dag_exec_lorafa_saves_less_than_lora),
        cmocka_unit_test(test_dag_exec_finetune_lowers_loss),
        cmocka_unit_test(test_dag_exec_checkpoint_round_trip_and_peft),
        cmocka_unit_test(test_dag_exec_salr_pruned_model),
        cmocka_unit_test(test_dag_exec_salr_lm_head_matches_reference),
        cmocka_unit_test(test_dag_exec_salr_lm_head_trains),
        cmocka_unit_test(test_dag_exec_salr_lm_head_files),
        cmocka_unit_test(test_dag_exec_rejects_bad_input),
        cmocka_unit_test(test_dag_exec_loads_bf16_weights),
        cmocka_unit_test(test_dag_exec_int8_weights),
        cmocka_unit_test(test_dag_exec_planned_pipeline_with_micro_batches),
    };
    return tu_unit_main(tests, NULL, tiny_setup, tiny_teardown);
}
