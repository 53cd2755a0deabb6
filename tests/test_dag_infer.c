/* The generation step (dag_infer) on a tiny model: the one-stage pipeline (`fusion run infer`) draws
 * the tokens of the executor driven by hand, a two-stage split the same tokens and logits, a replay
 * truncates the session, a restarted stage that prefills the generated tokens continues the sampler
 * where it was, and gaps, bad inputs and calls at the wrong stage are refused. Batches: several
 * generations in one forward (joining and leaving as they go) draw the tokens they draw alone, with
 * logits within rounding of their solo runs, and bit for bit the same through a two-stage split. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_infer.h"
#include "dag_model.h"
#include "dag_spec.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "testutil.h"

#define TI_PROMPT   5  /* prompt tokens */
#define TI_GENERATE 12 /* generated tokens */
#define TI_CONTEXT  (TI_PROMPT + TI_GENERATE + 1)

static const int32_t ti_prompt[TI_PROMPT] = {17, 3, 200, 45, 9};

/* A tiny model (2 layers, hidden 64, vocab 256), its generation graph and a sampling spec. */
typedef struct {
    char *dir;
    fu_safetensors *st;
    dag_graph_t *g;
    dag_spec spec;
} ti_env;

static void env_open(ti_env *e, const char *tag)
{
    e->dir = tu_tmpdir(tag);
    assert_non_null(e->dir);
    fu_modelcfg cfg;
    fu_modelcfg_defaults(&cfg);
    fu_errmsg em = {{0}};
    assert_int_equal(dag_model_init_random(e->dir, &cfg, 5, 0.08f, &em), FU_OK);
    assert_int_equal(fu_safetensors_open_dir(e->dir, &e->st, &em), FU_OK);
    dag_model_dims d;
    dag_dims_from_cfg(&cfg, &d);
    dag_build_opts bo = {.method = DAG_ADAPTER_NONE, .head = DAG_HEAD_SAMPLE, .seq_len = TI_PROMPT};
    assert_int_equal(dag_build_llama(&d, &bo, &e->g), FU_OK);
    dag_spec_init(&e->spec, DAG_JOB_INFER);
    e->spec.temperature = 0.9; /* sampled, so that a wrong counter draws other tokens */
    e->spec.top_k = 50;
    e->spec.top_p = 0.95;
    e->spec.seed = 11;
}

static void env_close(ti_env *e)
{
    dag_spec_clear(&e->spec);
    dag_graph_destroy(&e->g);
    fu_safetensors_close(&e->st);
    tu_tmpdir_remove(&e->dir);
}

/* cmocka fixture of every test: *state is an open ti_env, closed after the test, also when it failed. */
static int env_setup(void **state)
{
    ti_env *e = calloc(1, sizeof *e);
    if (!e)
        return -1;
    env_open(e, "infer");
    *state = e;
    return 0;
}

static int env_teardown(void **state)
{
    ti_env *e = *state;
    env_close(e);
    free(e);
    return 0;
}

/* One stage: nodes [first, last) with its executor, session and step. */
typedef struct {
    dag_exec_t *x;
    dag_session_t *sess;
    dag_infer_stage is;
} ti_stage;

static void stage_open(ti_stage *s, const ti_env *e, size_t first, size_t last, uint32_t max_tokens, uint64_t resume)
{
    dag_exec_opts o = {.first = first, .last = last, .max_tokens = max_tokens, .n_slots = 1, .logits_all = true,
                       .max_context = TI_CONTEXT};
    fu_errmsg em = {{0}};
    assert_int_equal(dag_exec_new(e->g, &o, &s->x, &em), FU_OK);
    assert_int_equal(dag_exec_load_weights(s->x, e->st, &em), FU_OK);
    assert_int_equal(dag_exec_session_new(s->x, &s->sess), FU_OK);
    bool is_last = last == 0 || last == dag_graph_size(e->g);
    assert_int_equal(dag_infer_stage_init(&s->is, s->x, e->g, s->sess, &e->spec, first == 0, is_last, resume), FU_OK);
}

static void stage_close(ti_stage *s)
{
    dag_exec_session_destroy(&s->sess);
    dag_exec_destroy(&s->x);
}

/* The one-stage pipeline, as `fusion run infer`: the prompt, then each token fed back. tokens gets
 * TI_GENERATE tokens; logits (when not NULL) the prompt pass's, copied (caller frees). */
static void run_one(const ti_env *e, int32_t *tokens, float **logits, size_t *n_logits)
{
    ti_stage s;
    stage_open(&s, e, 0, 0, TI_PROMPT, 0);
    fu_errmsg em = {{0}};
    assert_int_equal(dag_infer_seek(&s.is, 0, &em), FU_OK);
    assert_int_equal(dag_infer_forward(&s.is, ti_prompt, NULL, 0, TI_PROMPT, &em), FU_OK);
    if (logits) {
        const float *lg = NULL;
        assert_int_equal(dag_infer_logits(&s.is, &lg, n_logits), FU_OK);
        *logits = malloc(*n_logits * sizeof(float));
        memcpy(*logits, lg, *n_logits * sizeof(float));
    }
    for (int k = 0; k < TI_GENERATE; k++) {
        if (k > 0) {
            /* The token drawn for position P is that position's input. */
            assert_int_equal(dag_infer_seek(&s.is, TI_PROMPT + (uint64_t)k - 1, &em), FU_OK);
            assert_int_equal(dag_infer_forward(&s.is, &tokens[k - 1], NULL, 0, 1, &em), FU_OK);
        }
        assert_int_equal(dag_infer_sampled(&s.is, &tokens[k]), FU_OK);
    }
    stage_close(&s);
}

/* The same generation straight on the executor, the sampler's counter being the index of the token
 * drawn (as `fusion run infer` drove it before dag_infer). */
static void run_ref(const ti_env *e, int32_t *tokens)
{
    dag_exec_opts o = {.max_tokens = TI_PROMPT, .n_slots = 1, .max_context = TI_CONTEXT};
    dag_exec_t *x = NULL;
    dag_session_t *sess = NULL;
    assert_int_equal(dag_exec_new(e->g, &o, &x, NULL), FU_OK);
    assert_int_equal(dag_exec_load_weights(x, e->st, NULL), FU_OK);
    assert_int_equal(dag_exec_session_new(x, &sess), FU_OK);
    dag_exec_session_use(x, sess);
    kern_sample_params sp = {.temperature = (float)e->spec.temperature, .top_k = (int)e->spec.top_k,
                             .top_p = (float)e->spec.top_p, .seed = e->spec.seed};
    for (int k = 0; k < TI_GENERATE; k++) {
        dag_exec_set_sampling(x, &sp, (uint64_t)k);
        if (k == 0)
            assert_int_equal(dag_exec_set_tokens(x, 0, ti_prompt, NULL, 1, TI_PROMPT), FU_OK);
        else
            assert_int_equal(dag_exec_set_tokens(x, 0, &tokens[k - 1], NULL, 1, 1), FU_OK);
        assert_int_equal(dag_exec_forward(x, 0), FU_OK);
        assert_int_equal(dag_exec_sampled(x, 0, &tokens[k]), FU_OK);
    }
    dag_exec_session_destroy(&sess);
    dag_exec_destroy(&x);
}

/* Stage a's cut outputs after its forward, one after the other, as a peer sends them (caller frees). */
static float *cut_outputs(ti_stage *a, size_t *n)
{
    uint32_t ids[DAG_TRAIN_MAX_CUTS];
    size_t k = dag_exec_cut_outputs(a->x, ids, DAG_TRAIN_MAX_CUTS);
    assert_true(k >= 1 && k <= DAG_TRAIN_MAX_CUTS);
    float *buf = NULL;
    *n = 0;
    for (size_t i = 0; i < k; i++) {
        const float *d = NULL;
        size_t nf = 0;
        assert_int_equal(dag_exec_get_output(a->x, 0, ids[i], &d, &nf), FU_OK);
        buf = realloc(buf, (*n + nf) * sizeof *buf);
        memcpy(buf + *n, d, nf * sizeof *buf);
        *n += nf;
    }
    return buf;
}

/* Positions [p, p+rows) through both stages (tokens into stage 0, its cut outputs into stage 1). */
static void run_two(ti_stage *s0, ti_stage *s1, uint64_t p, const int32_t *tokens, uint64_t rows)
{
    fu_errmsg em = {{0}};
    assert_int_equal(dag_infer_seek(&s0->is, p, &em), FU_OK);
    assert_int_equal(dag_infer_forward(&s0->is, tokens, NULL, 0, rows, &em), FU_OK);
    size_t n = 0;
    float *act = cut_outputs(s0, &n);
    assert_int_equal(dag_infer_seek(&s1->is, p, &em), FU_OK);
    fu_err rc = dag_infer_forward(&s1->is, NULL, act, n, rows, &em);
    if (rc != FU_OK)
        fail_msg("stage 1: %s", fu_errmsg_text(&em, rc));
    free(act);
}

static void test_dag_infer_two_stages_equal_one_stage(void **state)
{
    ti_env *e = *state;
    int32_t one[TI_GENERATE];
    float *lg1 = NULL;
    size_t n1 = 0;
    run_one(e, one, &lg1, &n1);
    assert_int_equal(n1, (size_t)TI_PROMPT * 256); /* logits_all: every prompt position */
    /* The sampler is not greedy here, and its counter is the generated token's index. */
    bool varied = false;
    for (int k = 1; k < TI_GENERATE; k++)
        varied = varied || one[k] != one[0];
    assert_true(varied);
    int32_t ref[TI_GENERATE];
    run_ref(e, ref);
    assert_memory_equal(one, ref, sizeof one);

    /* A mid-graph cut (possibly several cut tensors). */
    size_t cut = dag_graph_size(e->g) / 2;
    ti_stage s0, s1;
    stage_open(&s0, e, 0, cut, TI_PROMPT, 0);
    stage_open(&s1, e, cut, 0, TI_PROMPT, 0);
    int32_t two[TI_GENERATE];
    run_two(&s0, &s1, 0, ti_prompt, TI_PROMPT);
    const float *lg2 = NULL;
    size_t n2 = 0;
    assert_int_equal(dag_infer_logits(&s0.is, &lg2, &n2), FU_ENOTFOUND); /* lm_head is stage 1's */
    assert_int_equal(dag_infer_logits(&s1.is, &lg2, &n2), FU_OK);
    assert_int_equal(n2, n1);
    assert_memory_equal(lg1, lg2, n1 * sizeof(float));
    int32_t tok = 0;
    assert_int_equal(dag_infer_sampled(&s0.is, &tok), FU_EINVAL); /* only the last stage samples */
    for (int k = 0; k < TI_GENERATE; k++) {
        if (k > 0)
            run_two(&s0, &s1, TI_PROMPT + (uint64_t)k - 1, &two[k - 1], 1);
        assert_int_equal(dag_infer_sampled(&s1.is, &two[k]), FU_OK);
    }
    assert_memory_equal(one, two, sizeof one);
    stage_close(&s1);
    stage_close(&s0);
    free(lg1);
}

static void test_dag_infer_replay_truncates(void **state)
{
    ti_env *e = *state;
    int32_t ref[TI_GENERATE];
    run_one(e, ref, NULL, NULL);

    /* Generate 6 tokens, then replay from the position after the prompt: the session is cut back and
     * the same tokens come again. */
    ti_stage s;
    stage_open(&s, e, 0, 0, TI_PROMPT, 0);
    fu_errmsg em = {{0}};
    assert_int_equal(dag_infer_forward(&s.is, ti_prompt, NULL, 0, TI_PROMPT, &em), FU_OK);
    int32_t got[TI_GENERATE];
    assert_int_equal(dag_infer_sampled(&s.is, &got[0]), FU_OK);
    for (int k = 1; k < 6; k++) {
        assert_int_equal(dag_infer_forward(&s.is, &got[k - 1], NULL, 0, 1, &em), FU_OK);
        assert_int_equal(dag_infer_sampled(&s.is, &got[k]), FU_OK);
    }
    assert_int_equal(dag_session_len(s.sess), TI_PROMPT + 5);
    assert_int_equal(dag_infer_seek(&s.is, TI_PROMPT + 1, &em), FU_OK);
    assert_int_equal(dag_session_len(s.sess), TI_PROMPT + 1);
    for (int k = 2; k < TI_GENERATE; k++) {
        assert_int_equal(dag_infer_seek(&s.is, TI_PROMPT + (uint64_t)k - 1, &em), FU_OK);
        assert_int_equal(dag_infer_forward(&s.is, &got[k - 1], NULL, 0, 1, &em), FU_OK);
        assert_int_equal(dag_infer_sampled(&s.is, &got[k]), FU_OK);
    }
    assert_memory_equal(ref, got, sizeof ref);
    stage_close(&s);

    /* A stage restarted after a failover: position 0 carries the prompt and the 4 tokens generated so
     * far (resume 4); it draws the 5th token with the sampler's counter where it was. */
    enum { DONE = 4 };
    int32_t all[TI_PROMPT + DONE];
    memcpy(all, ti_prompt, sizeof ti_prompt);
    memcpy(all + TI_PROMPT, ref, DONE * sizeof *ref);
    stage_open(&s, e, 0, 0, TI_PROMPT + DONE, DONE);
    assert_int_equal(dag_infer_forward(&s.is, all, NULL, 0, TI_PROMPT + DONE, &em), FU_OK);
    assert_int_equal(s.is.prompt_len, TI_PROMPT);
    int32_t next = 0;
    assert_int_equal(dag_infer_sampled(&s.is, &next), FU_OK);
    assert_int_equal(next, ref[DONE]);
    stage_close(&s);
}

static void test_dag_infer_refuses_gaps_and_bad_inputs(void **state)
{
    ti_env *e = *state;
    ti_stage s;
    stage_open(&s, e, 0, 0, TI_PROMPT, 0);
    fu_errmsg em = {{0}};
    /* Nothing cached yet: position 1 is a gap. */
    assert_int_equal(dag_infer_seek(&s.is, 1, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "position 1 comes before this stage has positions 0..1"));
    assert_int_equal(dag_infer_forward(&s.is, ti_prompt, NULL, 0, TI_PROMPT, &em), FU_OK);
    memset(&em, 0, sizeof em);
    assert_int_equal(dag_infer_seek(&s.is, TI_PROMPT + 2, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "replay from 0"));
    assert_int_equal(dag_session_len(s.sess), TI_PROMPT); /* unchanged */
    /* A token outside the vocabulary, no tokens, no rows, more rows than the executor takes: refused,
     * the session keeps its length. */
    int32_t bad = 256;
    memset(&em, 0, sizeof em);
    assert_int_equal(dag_infer_forward(&s.is, &bad, NULL, 0, 1, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "inference forward at position 5 failed"));
    assert_int_equal(dag_infer_forward(&s.is, NULL, NULL, 0, 1, &em), FU_EINVAL);
    assert_int_equal(dag_infer_forward(&s.is, ti_prompt, NULL, 0, 0, &em), FU_EINVAL);
    int32_t many[TI_PROMPT + 1] = {0};
    assert_int_equal(dag_infer_forward(&s.is, many, NULL, 0, TI_PROMPT + 1, &em), FU_EINVAL);
    assert_int_equal(dag_session_len(s.sess), TI_PROMPT);
    /* Past the session's context. */
    for (int k = 0; k < TI_CONTEXT - TI_PROMPT; k++)
        assert_int_equal(dag_infer_forward(&s.is, &ti_prompt[0], NULL, 0, 1, &em), FU_OK);
    assert_int_equal(dag_infer_forward(&s.is, &ti_prompt[0], NULL, 0, 1, &em), FU_ENOMEM);
    assert_int_equal(dag_session_len(s.sess), TI_CONTEXT);
    stage_close(&s);

    /* A later stage: the cut inputs must come, of the right size. */
    size_t cut = dag_graph_size(e->g) / 2;
    ti_stage s1;
    stage_open(&s1, e, cut, 0, TI_PROMPT, 0);
    size_t w = (size_t)s1.is.w_in;
    assert_true(w > 0);
    float *act = calloc(TI_PROMPT * w + 1, sizeof *act);
    assert_int_equal(dag_infer_forward(&s1.is, NULL, NULL, 0, TI_PROMPT, &em), FU_EINVAL);
    assert_int_equal(dag_infer_forward(&s1.is, NULL, act, TI_PROMPT * w + 1, TI_PROMPT, &em), FU_EINVAL);
    assert_int_equal(dag_infer_forward(&s1.is, NULL, act, TI_PROMPT * w, TI_PROMPT, &em), FU_OK);
    free(act);
    stage_close(&s1);

    /* No session. */
    dag_infer_stage is;
    assert_int_equal(dag_infer_stage_init(&is, NULL, e->g, NULL, &e->spec, true, true, 0), FU_EINVAL);
}


/* ---- batches --------------------------------------------------------------------------------- */

#define TB_GENS 3
#define TB_TOL  1e-4f /* a batch's linear products round otherwise than one row's */

/* The generations of the batch tests: their prompts, their sampling (two greedy, one sampled with
 * its own seed) and the batched step at which each joins. */
static const int32_t tb_p0[] = {17, 3, 200, 45, 9}, tb_p1[] = {99, 1, 7}, tb_p2[] = {5, 250, 31, 8, 64, 2, 77};
static const int32_t *const tb_prompt[TB_GENS] = {tb_p0, tb_p1, tb_p2};
static const uint32_t tb_prompt_len[TB_GENS] = {5, 3, 7};
static const uint32_t tb_join[TB_GENS] = {0, 0, 1};

static void tb_spec(const ti_env *e, int g, dag_spec *sp)
{
    *sp = e->spec;
    sp->temperature = g == 2 ? 0.8 : 0.0;
    sp->seed = 100 + (uint64_t)g;
}

/* Generation g alone, one stage: its TI_GENERATE tokens and the logits of each forward (the last
 * position's, TI_GENERATE x 256, into lg). */
static void tb_solo(const ti_env *e, int g, int32_t *tokens, float *lg)
{
    dag_spec sp;
    tb_spec(e, g, &sp);
    dag_exec_opts o = {.max_tokens = 8, .n_slots = 1, .max_context = TI_CONTEXT + 4};
    dag_exec_t *x = NULL;
    dag_session_t *sess = NULL;
    dag_infer_stage is;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_exec_new(e->g, &o, &x, &em), FU_OK);
    assert_int_equal(dag_exec_load_weights(x, e->st, &em), FU_OK);
    assert_int_equal(dag_exec_session_new(x, &sess), FU_OK);
    assert_int_equal(dag_infer_stage_init(&is, x, e->g, sess, &sp, true, true, 0), FU_OK);
    for (int k = 0; k < TI_GENERATE; k++) {
        if (k == 0)
            assert_int_equal(dag_infer_forward(&is, tb_prompt[g], NULL, 0, tb_prompt_len[g], &em), FU_OK);
        else
            assert_int_equal(dag_infer_forward(&is, &tokens[k - 1], NULL, 0, 1, &em), FU_OK);
        const float *l = NULL;
        size_t n = 0;
        assert_int_equal(dag_infer_logits(&is, &l, &n), FU_OK);
        assert_int_equal(n, 256);
        memcpy(lg + (size_t)k * 256, l, 256 * sizeof *l);
        assert_int_equal(dag_infer_sampled(&is, &tokens[k]), FU_OK);
    }
    dag_exec_session_destroy(&sess);
    dag_exec_destroy(&x);
}

/* The generations batched, through one stage (cut 0) or two (stages split at cut): each batched step
 * runs every generation that has joined and is not done, the joining ones with their prompts. The
 * tokens fed are those of the solo runs (teacher forcing, so that a near tie cannot make the
 * batches drift apart); tokens and logits get what the batch drew and computed. */
static void tb_batched(const ti_env *e, size_t cut, int32_t solo[TB_GENS][TI_GENERATE],
                       int32_t out[TB_GENS][TI_GENERATE], float *lg)
{
    dag_spec sp[TB_GENS];
    dag_exec_t *x[2] = {NULL, NULL};
    dag_session_t *sess[2][TB_GENS] = {{NULL}};
    dag_infer_stage is[2][TB_GENS];
    size_t n_st = cut ? 2 : 1;
    fu_errmsg em = {{0}};
    for (size_t st = 0; st < n_st; st++) {
        dag_exec_opts o = {.first = st ? cut : 0, .last = cut && !st ? cut : 0, .max_tokens = 16, .n_slots = 1,
                           .max_context = TI_CONTEXT + 4};
        assert_int_equal(dag_exec_new(e->g, &o, &x[st], &em), FU_OK);
        assert_int_equal(dag_exec_load_weights(x[st], e->st, &em), FU_OK);
        for (int g = 0; g < TB_GENS; g++) {
            tb_spec(e, g, &sp[g]);
            assert_int_equal(dag_exec_session_new(x[st], &sess[st][g]), FU_OK);
            assert_int_equal(dag_infer_stage_init(&is[st][g], x[st], e->g, sess[st][g], &sp[g], st == 0,
                                                  st + 1 == n_st, 0), FU_OK);
        }
    }
    uint32_t done[TB_GENS] = {0}; /* tokens drawn */
    for (uint32_t step = 0;; step++) {
        dag_infer_stage *b[2][TB_GENS];
        uint64_t rows[TB_GENS];
        int32_t toks[32];
        size_t n = 0, nt = 0;
        int who[TB_GENS];
        for (int g = 0; g < TB_GENS; g++) {
            if (tb_join[g] > step || done[g] == TI_GENERATE)
                continue;
            for (size_t st = 0; st < n_st; st++)
                b[st][n] = &is[st][g];
            if (done[g] == 0) {
                memcpy(toks + nt, tb_prompt[g], tb_prompt_len[g] * sizeof *toks);
                nt += tb_prompt_len[g];
                rows[n] = tb_prompt_len[g];
            } else {
                toks[nt++] = solo[g][done[g] - 1];
                rows[n] = 1;
            }
            who[n++] = g;
        }
        if (n == 0)
            break;
        assert_int_equal(dag_infer_forward_batch(b[0], n, toks, NULL, 0, rows, &em), FU_OK);
        if (n_st == 2) {
            ti_stage first = {.x = x[0]};
            size_t na = 0;
            float *act = cut_outputs(&first, &na);
            assert_int_equal(na, nt * is[1][0].w_in);
            fu_err rc = dag_infer_forward_batch(b[1], n, NULL, act, na, rows, &em);
            if (rc != FU_OK)
                fail_msg("stage 1: %s", fu_errmsg_text(&em, rc));
            free(act);
        }
        const float *l = NULL;
        size_t nl = 0;
        assert_int_equal(dag_infer_logits(&is[n_st - 1][0], &l, &nl), FU_OK);
        assert_int_equal(nl, n * 256); /* the last row of each generation */
        for (size_t k = 0; k < n; k++) {
            int g = who[k];
            memcpy(lg + ((size_t)g * TI_GENERATE + done[g]) * 256, l + k * 256, 256 * sizeof *l);
            assert_int_equal(dag_infer_sampled(b[n_st - 1][k], &out[g][done[g]]), FU_OK);
            done[g]++;
        }
    }
    for (size_t st = 0; st < n_st; st++) {
        for (int g = 0; g < TB_GENS; g++) {
            assert_int_equal(dag_session_len(sess[st][g]), tb_prompt_len[g] + TI_GENERATE - 1);
            dag_exec_session_destroy(&sess[st][g]);
        }
        dag_exec_destroy(&x[st]);
    }
}

static void test_dag_infer_batch_draws_the_solo_tokens(void **state)
{
    ti_env *e = *state;
    int32_t solo[TB_GENS][TI_GENERATE];
    float *lg_solo = malloc((size_t)TB_GENS * TI_GENERATE * 256 * sizeof(float));
    float *lg_one = malloc((size_t)TB_GENS * TI_GENERATE * 256 * sizeof(float));
    float *lg_two = malloc((size_t)TB_GENS * TI_GENERATE * 256 * sizeof(float));
    for (int g = 0; g < TB_GENS; g++)
        tb_solo(e, g, solo[g], lg_solo + (size_t)g * TI_GENERATE * 256);
    bool differ = false;
    for (int k = 0; k < TI_GENERATE; k++)
        differ = differ || solo[0][k] != solo[1][k];
    assert_true(differ);

    int32_t one[TB_GENS][TI_GENERATE], two[TB_GENS][TI_GENERATE];
    tb_batched(e, 0, solo, one, lg_one);
    /* Each generation draws its solo tokens, the sampled one with its own seed and counter; its
     * logits are its solo run's within rounding, and not all bit for bit (the products ran over
     * several rows: the test would not see a batch that degenerated into solo runs). */
    assert_memory_equal(one, solo, sizeof one);
    float worst = 0;
    size_t same = 0, total = (size_t)TB_GENS * TI_GENERATE * 256;
    for (size_t i = 0; i < total; i++) {
        float d = lg_one[i] - lg_solo[i];
        d = d < 0 ? -d : d;
        worst = d > worst ? d : worst;
        same += lg_one[i] == lg_solo[i];
    }
    if (worst > TB_TOL)
        fail_msg("batched logits differ from the solo runs' by %g", (double)worst);
    assert_true(same < total);
    fprintf(stderr, "batched logits: %zu of %zu bit for bit, the rest within %g\n", same, total, (double)worst);

    /* Split in two stages, the batch passes its activations as one tensor: the same bits. */
    size_t cut = dag_graph_size(e->g) / 2;
    tb_batched(e, cut, solo, two, lg_two);
    assert_memory_equal(two, one, sizeof two);
    assert_memory_equal(lg_two, lg_one, total * sizeof(float));
    free(lg_solo);
    free(lg_one);
    free(lg_two);
}

static void test_dag_infer_batch_refuses_bad_batches(void **state)
{
    ti_env *e = *state;
    ti_stage a, b, other;
    stage_open(&a, e, 0, 0, 8, 0);
    b = a;
    assert_int_equal(dag_exec_session_new(a.x, &b.sess), FU_OK);
    assert_int_equal(dag_infer_stage_init(&b.is, a.x, e->g, b.sess, &e->spec, true, true, 0), FU_OK);
    stage_open(&other, e, 0, 0, 8, 0);
    fu_errmsg em = {{0}};
    int32_t toks[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    dag_infer_stage *twice[2] = {&a.is, &a.is}, *foreign[2] = {&a.is, &other.is}, *ok[2] = {&a.is, &b.is};
    uint64_t r11[2] = {1, 1}, r10[2] = {1, 0}, r45[2] = {4, 5};
    assert_int_equal(dag_infer_forward_batch(twice, 2, toks, NULL, 0, r11, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "batched inference forward of 2 sessions failed"));
    assert_int_equal(dag_infer_forward_batch(foreign, 2, toks, NULL, 0, r11, &em), FU_EINVAL);
    assert_int_equal(dag_infer_forward_batch(ok, 2, toks, NULL, 0, r10, &em), FU_EINVAL);
    assert_int_equal(dag_infer_forward_batch(ok, 2, toks, NULL, 0, r45, &em), FU_EINVAL); /* 9 rows > 8 */
    assert_int_equal(dag_infer_forward_batch(ok, 0, toks, NULL, 0, r11, &em), FU_EINVAL);
    toks[1] = 256;
    assert_int_equal(dag_infer_forward_batch(ok, 2, toks, NULL, 0, r11, &em), FU_EINVAL);
    assert_int_equal(dag_session_len(a.sess), 0);
    assert_int_equal(dag_session_len(b.sess), 0);
    toks[1] = 2;
    assert_int_equal(dag_infer_forward_batch(ok, 2, toks, NULL, 0, r11, &em), FU_OK);
    assert_int_equal(dag_session_len(a.sess), 1);
    assert_int_equal(dag_session_len(b.sess), 1);
    /* One generation past its context: the batch is refused and neither session moves. */
    for (int k = 1; k < TI_CONTEXT; k++)
        assert_int_equal(dag_infer_forward(&a.is, toks, NULL, 0, 1, &em), FU_OK);
    assert_int_equal(dag_infer_forward_batch(ok, 2, toks, NULL, 0, r11, &em), FU_ENOMEM);
    assert_int_equal(dag_session_len(a.sess), TI_CONTEXT);
    assert_int_equal(dag_session_len(b.sess), 1);
    /* A session destroyed after its batch was set: the slot's forward is refused, not run on it. */
    dag_session_t *s3 = NULL, *s4 = NULL;
    assert_int_equal(dag_exec_session_new(other.x, &s3), FU_OK);
    assert_int_equal(dag_exec_session_new(other.x, &s4), FU_OK);
    dag_session_t *pair[2] = {s3, s4};
    uint32_t rr[2] = {1, 1};
    assert_int_equal(dag_exec_set_batch(other.x, 0, pair, rr, 2, toks), FU_OK);
    dag_exec_session_destroy(&s4);
    assert_int_equal(dag_exec_forward(other.x, 0), FU_EINVAL);
    assert_int_equal(dag_session_len(s3), 0);
    dag_exec_session_destroy(&s3);
    dag_exec_session_destroy(&b.sess);
    stage_close(&other);
    stage_close(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_infer_two_stages_equal_one_stage),
        cmocka_unit_test(test_dag_infer_replay_truncates),
        cmocka_unit_test(test_dag_infer_refuses_gaps_and_bad_inputs),
        cmocka_unit_test(test_dag_infer_batch_draws_the_solo_tokens),
        cmocka_unit_test(test_dag_infer_batch_refuses_bad_batches),
    };
    return tu_unit_main(tests, NULL, env_setup, env_teardown);
}
