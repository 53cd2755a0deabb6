/* The generation step (dag_infer) on a tiny model: the one-stage pipeline (`fusion run infer`) draws
 * the tokens of the executor driven by hand, a two-stage split the same tokens and logits, a replay
 * truncates the session, a restarted stage that prefills the generated tokens continues the sampler
 * where it was, and gaps, bad inputs and calls at the wrong stage are refused. */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_infer_two_stages_equal_one_stage),
        cmocka_unit_test(test_dag_infer_replay_truncates),
        cmocka_unit_test(test_dag_infer_refuses_gaps_and_bad_inputs),
    };
    return tu_unit_main(tests, NULL, env_setup, env_teardown);
}
