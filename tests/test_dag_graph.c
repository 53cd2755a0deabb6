/* The IR plane without execution: the builder, validation of hostile graphs, the protobuf round
 * trip, and the partitioner. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "dag_graph.h"
#include "dag_partition.h"
#include "dag_serial.h"

static dag_model_dims tiny_dims(void)
{
    dag_model_dims d = {.vocab_size = 64, .hidden_size = 32, .intermediate_size = 48, .n_layers = 2,
                        .n_heads = 4, .n_kv_heads = 2, .head_dim = 8, .rms_eps = 1e-5f,
                        .rope_theta = 10000.0f, .tie_word_embeddings = false};
    return d;
}

static dag_model_dims base_dims(void)
{
    dag_model_dims d = {.vocab_size = 32000, .hidden_size = 768, .intermediate_size = 2048, .n_layers = 12,
                        .n_heads = 12, .n_kv_heads = 12, .head_dim = 64, .rms_eps = 1e-5f,
                        .rope_theta = 10000.0f, .tie_word_embeddings = false};
    return d;
}

static dag_graph_t *build(const dag_model_dims *d, dag_adapter_method m, dag_head head)
{
    dag_build_opts o = {.method = m, .rank = 4, .alpha = 8.0f, .targets = 0, .res_rank = 4, .head = head,
                        .seq_len = 16};
    dag_graph_t *g = NULL;
    assert_int_equal(dag_build_llama(d, &o, &g), FU_OK);
    return g;
}

static void test_dag_graph_builder_shapes_and_names(void **state)
{
    (void)state;
    dag_model_dims d = tiny_dims();
    dag_graph_t *g = build(&d, DAG_ADAPTER_LORA_FA, DAG_HEAD_LOSS);
    /* embedding + 15 per layer + norm + lm_head + loss */
    assert_int_equal(dag_graph_size(g), 1 + 15 * 2 + 3);
    fu_errmsg em = {{0}};
    assert_int_equal(dag_graph_validate(g, &em), FU_OK);
    int adapters = 0;
    for (size_t i = 0; i < dag_graph_size(g); i++) {
        const dag_node *n = dag_graph_node(g, i);
        assert_int_equal(n->id, i);
        if (n->op == DAG_OP_LINEAR) {
            assert_int_equal(n->adapter.method, DAG_ADAPTER_LORA_FA);
            adapters++;
        }
    }
    assert_int_equal(adapters, 14);
    const dag_node *q = dag_graph_node(g, 2);
    assert_int_equal(q->op, DAG_OP_LINEAR);
    assert_string_equal(q->params[0], "model.layers.0.self_attn.q_proj.weight");
    const dag_node *k = dag_graph_node(g, 3);
    assert_int_equal(k->out_width, 16); /* 2 kv heads × 8 */
    assert_int_equal(dag_graph_node(g, dag_graph_size(g) - 1)->op, DAG_OP_CROSS_ENTROPY);
    /* Only the residual crosses between layers. */
    assert_int_equal(dag_graph_cut_width(g, 16), 32);
    dag_graph_destroy(&g);
    assert_null(g);
    dag_graph_destroy(&g);

    /* targets */
    uint32_t mask = 0;
    assert_int_equal(dag_targets_parse("q_proj,v", &mask), FU_OK);
    assert_int_equal(mask, DAG_TARGET_BIT(DAG_TARGET_Q) | DAG_TARGET_BIT(DAG_TARGET_V));
    assert_int_equal(dag_targets_parse("q_proj,bogus", &mask), FU_EINVAL);
    dag_build_opts o = {.method = DAG_ADAPTER_LORA, .rank = 2, .alpha = 4, .targets = mask, .head = DAG_HEAD_SAMPLE};
    assert_int_equal(dag_build_llama(&d, &o, &g), FU_OK);
    adapters = 0;
    for (size_t i = 0; i < dag_graph_size(g); i++)
        adapters += dag_graph_node(g, i)->adapter.method != DAG_ADAPTER_NONE;
    assert_int_equal(adapters, 4);
    dag_graph_destroy(&g);

    /* impossible dims */
    d.n_kv_heads = 3;
    assert_int_equal(dag_build_llama(&d, &o, &g), FU_EINVAL);
    assert_null(g);
}

/* Corrupts one field of a valid graph and expects FU_EPROTO naming the node. */
static void expect_bad(void (*corrupt)(dag_node *), size_t at, const char *want)
{
    dag_model_dims d = tiny_dims();
    dag_graph_t *g = build(&d, DAG_ADAPTER_LORA, DAG_HEAD_LOSS);
    corrupt(dag_graph_node_mut(g, at));
    fu_errmsg em = {{0}};
    assert_int_equal(dag_graph_validate(g, &em), FU_EPROTO);
    if (!strstr(em.msg, want))
        fail_msg("message '%s' lacks '%s'", em.msg, want);
    /* The encoder refuses it too. */
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(dag_graph_encode(g, &buf, &len), FU_EINVAL);
    dag_graph_destroy(&g);
}

static void c_forward_ref(dag_node *n) { n->inputs[0] = n->id + 1; }
static void c_self_ref(dag_node *n) { n->inputs[0] = n->id; }
static void c_arity(dag_node *n) { n->n_inputs = 2; }
static void c_op(dag_node *n) { n->op = (dag_op)77; }
static void c_width(dag_node *n) { n->dim_in = 31; }
static void c_name(dag_node *n) { strcpy(n->params[0], "../../etc/passwd"); }
static void c_noname(dag_node *n) { n->n_params = 0; }
static void c_rank(dag_node *n) { n->adapter.rank = 100000; }
static void c_alpha(dag_node *n) { n->adapter.alpha = -1.0f; }
static void c_heads(dag_node *n) { n->n_kv_heads = 3; }
static void c_id(dag_node *n) { n->id = 5; }
static void c_adapter_on_norm(dag_node *n) { n->adapter.method = DAG_ADAPTER_LORA; }
static void c_eps(dag_node *n) { n->eps = 0.0f; }
static void c_loss_width(dag_node *n) { n->dim_in = 1u << 19; }

/* Stage labels (issue "Operate and serve": "layers 0-1", "1-2", "2-3" overlapped): a cut inside a layer
 * names the half each side holds. */
static void test_dag_graph_range_label_names_the_cut(void **state)
{
    (void)state;
    dag_model_dims d = tiny_dims();
    d.n_layers = 4;
    dag_graph_t *g = build(&d, DAG_ADAPTER_LORA_FA, DAG_HEAD_LOSS);
    size_t n = dag_graph_size(g), l1 = SIZE_MAX, l2 = SIZE_MAX, mid1 = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        const dag_node *nd = dag_graph_node(g, i);
        if (nd->layer == 1 && l1 == SIZE_MAX)
            l1 = i;
        if (nd->layer == 2 && l2 == SIZE_MAX)
            l2 = i;
        if (nd->layer == 1 && nd->op == DAG_OP_ADD && mid1 == SIZE_MAX)
            mid1 = i + 1; /* the first node after layer 1's attention residual */
    }
    char a[48], b[48], c[48];
    dag_graph_range_label(g, 0, n, a, sizeof a);
    assert_string_equal(a, "layers 0-3");
    dag_graph_range_label(g, 0, l1, a, sizeof a); /* a cut between layers */
    dag_graph_range_label(g, l1, n, b, sizeof b);
    assert_string_equal(a, "layer 0");
    assert_string_equal(b, "layers 1-3");
    dag_graph_range_label(g, 0, mid1, a, sizeof a); /* cuts inside layer 1 */
    dag_graph_range_label(g, mid1, l2, b, sizeof b);
    dag_graph_range_label(g, l2, n, c, sizeof c);
    printf("three stages cut inside layer 1: %s | %s | %s\n", a, b, c);
    assert_string_equal(a, "layers 0-1.attn");
    assert_string_equal(b, "layer 1.mlp");
    assert_string_equal(c, "layers 2-3");
    dag_graph_range_label(g, n - 1, n, a, sizeof a); /* the head alone */
    assert_string_equal(a, "no decoder layers");
    dag_graph_destroy(&g);
}

static void test_dag_graph_validation_rejects_malformed(void **state)
{
    (void)state;
    expect_bad(c_forward_ref, 2, "node 2 (linear)");
    expect_bad(c_self_ref, 5, "not topological");
    expect_bad(c_arity, 1, "inputs");
    expect_bad(c_op, 4, "unknown op");
    expect_bad(c_width, 2, "node 2 (linear)");
    expect_bad(c_name, 2, "parameter name");
    expect_bad(c_noname, 1, "parameter names");
    expect_bad(c_rank, 3, "rank");
    expect_bad(c_alpha, 3, "alpha");
    expect_bad(c_heads, 7, "node 7 (attention)");
    expect_bad(c_id, 3, "id 5");
    expect_bad(c_adapter_on_norm, 1, "only linear and lm_head");
    expect_bad(c_eps, 1, "epsilon");
    expect_bad(c_loss_width, 33, "node 33 (cross_entropy)");
}

static void test_dag_graph_protobuf_round_trip(void **state)
{
    (void)state;
    dag_model_dims d = tiny_dims();
    for (int m = 0; m < DAG_ADAPTER_COUNT_; m++) {
        dag_graph_t *g = build(&d, (dag_adapter_method)m, m == 0 ? DAG_HEAD_SAMPLE : DAG_HEAD_LOSS);
        uint8_t *buf = NULL;
        size_t len = 0;
        assert_int_equal(dag_graph_encode(g, &buf, &len), FU_OK);
        assert_true(len > 100);
        dag_graph_t *h = NULL;
        fu_errmsg em = {{0}};
        assert_int_equal(dag_graph_decode(buf, len, &h, &em), FU_OK);
        assert_int_equal(dag_graph_size(h), dag_graph_size(g));
        const dag_model_dims *da = dag_graph_dims(h), *db = dag_graph_dims(g);
        assert_int_equal(da->vocab_size, db->vocab_size);
        assert_int_equal(da->hidden_size, db->hidden_size);
        assert_int_equal(da->intermediate_size, db->intermediate_size);
        assert_int_equal(da->n_layers, db->n_layers);
        assert_int_equal(da->n_heads, db->n_heads);
        assert_int_equal(da->n_kv_heads, db->n_kv_heads);
        assert_int_equal(da->head_dim, db->head_dim);
        assert_true(da->rms_eps == db->rms_eps && da->rope_theta == db->rope_theta);
        assert_int_equal(da->tie_word_embeddings, db->tie_word_embeddings);
        for (size_t i = 0; i < dag_graph_size(g); i++)
            assert_memory_equal(dag_graph_node(h, i), dag_graph_node(g, i), sizeof(dag_node));
        /* Every truncation is rejected or decodes to a valid graph; never crashes. */
        for (size_t cut = 0; cut < len; cut += 7) {
            dag_graph_t *t = NULL;
            fu_err e = dag_graph_decode(buf, cut, &t, &em);
            if (e == FU_OK)
                assert_int_equal(dag_graph_validate(t, NULL), FU_OK);
            else
                assert_null(t);
            dag_graph_destroy(&t);
        }
        /* Bit flips: same rule. */
        for (size_t i = 0; i < len; i += 3) {
            uint8_t save = buf[i];
            buf[i] ^= (uint8_t)(1u << (i % 8));
            dag_graph_t *t = NULL;
            if (dag_graph_decode(buf, len, &t, &em) == FU_OK)
                assert_int_equal(dag_graph_validate(t, NULL), FU_OK);
            dag_graph_destroy(&t);
            buf[i] = save;
        }
        free(buf);
        dag_graph_destroy(&h);
        dag_graph_destroy(&g);
    }
    dag_graph_t *t = NULL;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_graph_decode((const uint8_t *)"\xff\xff\xff", 3, &t, &em), FU_EPROTO);
    assert_int_equal(dag_graph_decode((const uint8_t *)"", 0, &t, &em), FU_EVERSION);
    assert_null(t);
}

static void test_dag_graph_decode_rejects_wrong_ids(void **state)
{
    (void)state;
    dag_model_dims d = tiny_dims();
    dag_graph_t *g = build(&d, DAG_ADAPTER_LORA_FA, DAG_HEAD_LOSS);
    /* A graph whose node 3 reads node 9 cannot be encoded by us; craft it by swapping two nodes'
     * contents after encoding is impossible, so check the decoder path with a forged id. */
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(dag_graph_encode(g, &buf, &len), FU_OK);
    dag_graph_t *h = NULL;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_graph_decode(buf, len, &h, &em), FU_OK);
    dag_graph_node_mut(h, 4)->inputs[0] = 30;
    assert_int_equal(dag_graph_validate(h, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "node 4"));
    free(buf);
    dag_graph_destroy(&h);
    dag_graph_destroy(&g);
}

/* A SALR graph whose lm_head is pruned too: the node carries the sparse weight and its residual, the
 * cost model counts the smaller bytes, the wire form keeps it, and validation holds it to its rules. */
static dag_graph_t *build_salr_head(const dag_model_dims *d, bool salr_head, dag_head head)
{
    dag_build_opts o = {.method = DAG_ADAPTER_SALR, .rank = 4, .alpha = 8.0f, .res_rank = 4, .salr_lm_head = salr_head,
                        .head = head, .seq_len = 16};
    dag_graph_t *g = NULL;
    assert_int_equal(dag_build_llama(d, &o, &g), FU_OK);
    return g;
}

static size_t lm_head_of(const dag_graph_t *g)
{
    for (size_t i = 0; i < dag_graph_size(g); i++)
        if (dag_graph_node(g, i)->op == DAG_OP_LM_HEAD)
            return i;
    fail();
    return 0;
}

static void expect_bad_head(void (*corrupt)(dag_node *), const char *want)
{
    dag_model_dims d = tiny_dims();
    dag_graph_t *g = build_salr_head(&d, true, DAG_HEAD_LOSS);
    corrupt(dag_graph_node_mut(g, lm_head_of(g)));
    fu_errmsg em = {{0}};
    assert_int_equal(dag_graph_validate(g, &em), FU_EPROTO);
    if (!strstr(em.msg, want))
        fail_msg("message '%s' lacks '%s'", em.msg, want);
    dag_graph_destroy(&g);
}

static void c_head_rank(dag_node *n) { n->adapter.rank = 2; n->adapter.alpha = 4.0f; }
static void c_head_lora(dag_node *n) { n->adapter.method = DAG_ADAPTER_LORA; }
static void c_head_res0(dag_node *n) { n->adapter.res_rank = 0; }
static void c_head_params(dag_node *n) { n->n_params = 1; }
static void c_head_tied(dag_node *n) { strcpy(n->params[0], "model.embed_tokens.weight"); }
static void c_head_target(dag_node *n) { n->target = DAG_TARGET_Q; }
static void c_head_dense_res(dag_node *n) { n->adapter.method = DAG_ADAPTER_NONE; n->n_params = 1; }

static void test_dag_graph_salr_lm_head(void **state)
{
    (void)state;
    dag_model_dims d = base_dims();
    dag_graph_t *dense = build_salr_head(&d, false, DAG_HEAD_SAMPLE), *g = build_salr_head(&d, true, DAG_HEAD_SAMPLE);
    const dag_node *hd = dag_graph_node(dense, lm_head_of(dense)), *hs = dag_graph_node(g, lm_head_of(g));
    assert_int_equal(hd->adapter.method, DAG_ADAPTER_NONE);
    assert_int_equal(hd->n_params, 1);
    assert_int_equal(hs->adapter.method, DAG_ADAPTER_SALR);
    assert_int_equal(hs->adapter.rank, 0);
    assert_int_equal(hs->adapter.res_rank, 4);
    assert_int_equal(hs->n_params, 3);
    assert_string_equal(hs->params[0], "lm_head.weight");
    assert_string_equal(hs->params[1], "lm_head.salr_A.weight");
    assert_string_equal(hs->params[2], "lm_head.salr_B.weight");
    /* 32000 × 768: bitmap (1/32) + half the values (1/2) + the rank-4 residual, against 4 bytes each. */
    assert_true(hs->param_bytes < 0.56 * (double)hd->param_bytes);
    assert_true(hs->param_bytes > 0.5 * (double)hd->param_bytes);
    assert_true(hs->flops_fwd < 0.55 * hd->flops_fwd);
    dag_cost cd = dag_graph_cost(dense, 0, dag_graph_size(dense)), cs = dag_graph_cost(g, 0, dag_graph_size(g));
    assert_true(cd.param_bytes - cs.param_bytes > 45u * 1000 * 1000); /* ~46 MB fewer bytes to read */
    dag_partition_opts po = {.tokens_per_micro = 1, .micro_batches = 1, .training = false, .max_stages = 1};
    assert_true(dag_cost_stage_memory(g, 0, dag_graph_size(g), &po) <
                dag_cost_stage_memory(dense, 0, dag_graph_size(dense), &po));
    fu_errmsg em = {{0}};
    assert_int_equal(dag_graph_validate(g, &em), FU_OK);
    /* The wire form carries it. */
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(dag_graph_encode(g, &buf, &len), FU_OK);
    dag_graph_t *h = NULL;
    assert_int_equal(dag_graph_decode(buf, len, &h, &em), FU_OK);
    for (size_t i = 0; i < dag_graph_size(g); i++)
        assert_memory_equal(dag_graph_node(h, i), dag_graph_node(g, i), sizeof(dag_node));
    free(buf);
    dag_graph_destroy(&h);
    /* Training costs: the backward computes dX through the sparse head and keeps h (rank floats). */
    dag_graph_t *gt = build_salr_head(&d, true, DAG_HEAD_LOSS);
    hs = dag_graph_node(gt, lm_head_of(gt));
    assert_true(hs->flops_bwd > 0 && hs->act_bytes == 16);
    dag_graph_destroy(&gt);
    dag_graph_destroy(&g);
    dag_graph_destroy(&dense);

    /* Builder refusals: without method salr, with tied embeddings, a residual rank above hidden. */
    d = tiny_dims();
    dag_build_opts o = {.method = DAG_ADAPTER_LORA_FA, .rank = 4, .alpha = 8.0f, .res_rank = 4, .salr_lm_head = true,
                        .head = DAG_HEAD_LOSS};
    assert_int_equal(dag_build_llama(&d, &o, &g), FU_EINVAL);
    o.method = DAG_ADAPTER_SALR;
    d.tie_word_embeddings = true;
    assert_int_equal(dag_build_llama(&d, &o, &g), FU_EINVAL);
    d.tie_word_embeddings = false;
    o.res_rank = 33;
    assert_int_equal(dag_build_llama(&d, &o, &g), FU_EINVAL);
    assert_null(g);

    /* Validation of hostile lm_head nodes. */
    expect_bad_head(c_head_rank, "no trained adapter");
    expect_bad_head(c_head_lora, "no trained adapter");
    expect_bad_head(c_head_res0, "residual rank 0");
    expect_bad_head(c_head_params, "parameter names");
    expect_bad_head(c_head_tied, "tied lm_head");
    expect_bad_head(c_head_target, "adapter target");
    expect_bad_head(c_head_dense_res, "rank given without");
}

static dag_partition_opts train_opts(void)
{
    dag_partition_opts o = {.tokens_per_micro = 512, .micro_batches = 4, .training = true, .max_stages = 0};
    return o;
}

/* The base model's graph for LoRA-FA training, with a vocabulary of `vocab` (0: the base 32000). */
static dag_graph_t *train_graph(uint32_t vocab)
{
    dag_model_dims d = base_dims();
    if (vocab)
        d.vocab_size = vocab;
    return build(&d, DAG_ADAPTER_LORA_FA, DAG_HEAD_LOSS);
}

/* Partitions g over the n peers, which must succeed; the plan, for dag_plan_free. */
static dag_plan plan_ok(const dag_graph_t *g, const dag_peer_profile *peers, size_t n,
                        const dag_partition_opts *o)
{
    dag_plan plan;
    fu_errmsg em = {{0}};
    fu_err rc = dag_partition(g, peers, n, o, &plan, &em);
    if (rc != FU_OK)
        fail_msg("dag_partition: %s", fu_errmsg_text(&em, rc));
    return plan;
}

static void test_dag_graph_partition_beats_even_split(void **state)
{
    (void)state;
    dag_graph_t *g = train_graph(0);
    dag_peer_profile peers[3] = {
        {"slow", 100.0, 8ull << 30, 1e9, 1e-4},
        {"mid", 200.0, 8ull << 30, 1e9, 1e-4},
        {"fast", 400.0, 8ull << 30, 1e9, 1e-4},
    };
    dag_partition_opts o = train_opts();
    o.max_stages = 3;
    dag_plan plan = plan_ok(g, peers, 3, &o), even;
    assert_int_equal(dag_partition_even(g, peers, 3, &o, &even), FU_OK);
    assert_true(plan.bottleneck_s < 0.8 * even.bottleneck_s);
    /* Stages are contiguous and cover the graph. */
    size_t at = 0;
    for (size_t s = 0; s < plan.n_stages; s++) {
        assert_int_equal(plan.stages[s].first, at);
        assert_true(plan.stages[s].last > at);
        at = plan.stages[s].last;
        assert_true(plan.stages[s].mem_bytes <= peers[plan.stages[s].peer].mem_bytes);
        assert_non_null(strstr(plan.stages[s].why, peers[plan.stages[s].peer].name));
    }
    assert_int_equal(at, dag_graph_size(g));
    /* The fast peer carries more work than the slow one. */
    double work[3] = {0};
    for (size_t s = 0; s < plan.n_stages; s++) {
        dag_cost c = dag_graph_cost(g, plan.stages[s].first, plan.stages[s].last);
        work[plan.stages[s].peer] = c.flops_fwd + c.flops_bwd;
    }
    assert_true(work[2] > work[0]);
    dag_plan_free(&plan);
    dag_plan_free(&even);
    dag_plan_free(&even);
    dag_graph_destroy(&g);
}

/* A vocabulary smaller than the hidden size makes the logits the narrowest cut; the layers must
 * still be cuttable, so two equal peers split the layers between them. */
static void test_dag_graph_partition_cuts_layers_when_vocab_is_small(void **state)
{
    (void)state;
    dag_graph_t *g = train_graph(256);
    dag_peer_profile peers[2] = {{"a", 100.0, 8ull << 30, 1e9, 1e-4}, {"b", 100.0, 8ull << 30, 1e9, 1e-4}};
    dag_partition_opts o = train_opts();
    o.max_stages = 2;
    dag_plan plan = plan_ok(g, peers, 2, &o);
    assert_int_equal(plan.n_stages, 2);
    /* Each stage holds some of the twelve layers: the cut is between layers, not before the loss. */
    int32_t last_layer_0 = -1, first_layer_1 = INT32_MAX;
    for (size_t i = plan.stages[0].first; i < plan.stages[0].last; i++)
        if (dag_graph_node(g, i)->layer != DAG_NO_LAYER && dag_graph_node(g, i)->layer > last_layer_0)
            last_layer_0 = dag_graph_node(g, i)->layer;
    for (size_t i = plan.stages[1].first; i < plan.stages[1].last; i++)
        if (dag_graph_node(g, i)->layer != DAG_NO_LAYER && dag_graph_node(g, i)->layer < first_layer_1)
            first_layer_1 = dag_graph_node(g, i)->layer;
    assert_true(last_layer_0 >= 3 && last_layer_0 <= 8);
    assert_true(first_layer_1 >= last_layer_0 && first_layer_1 <= 8);
    dag_plan_free(&plan);
    dag_graph_destroy(&g);
}

static void test_dag_graph_partition_respects_memory(void **state)
{
    (void)state;
    dag_graph_t *g = train_graph(0);
    dag_partition_opts o = train_opts();
    uint64_t whole = dag_cost_stage_memory(g, 0, dag_graph_size(g), &o);
    /* The fast peer is small: it cannot take everything, so the plan must use the others too. */
    dag_peer_profile peers[3] = {
        {"small-fast", 1000.0, whole / 3, 1e9, 1e-4},
        {"a", 100.0, whole, 1e9, 1e-4},
        {"b", 100.0, whole, 1e9, 1e-4},
    };
    dag_plan plan = plan_ok(g, peers, 3, &o);
    for (size_t s = 0; s < plan.n_stages; s++)
        assert_true(plan.stages[s].mem_bytes <= peers[plan.stages[s].peer].mem_bytes);
    dag_plan_free(&plan);

    /* Nothing fits: a clear error. */
    dag_peer_profile tiny[2] = {{"t1", 100.0, whole / 10, 1e9, 1e-4}, {"t2", 100.0, whole / 10, 1e9, 1e-4}};
    fu_errmsg em = {{0}};
    assert_int_equal(dag_partition(g, tiny, 2, &o, &plan, &em), FU_ENOMEM);
    assert_non_null(strstr(em.msg, "does not fit"));
    assert_int_equal(plan.n_stages, 0);
    /* Bad profiles. */
    dag_peer_profile zero[1] = {{"z", 0.0, whole, 1e9, 0}};
    assert_int_equal(dag_partition(g, zero, 1, &o, &plan, &em), FU_EINVAL);
    dag_graph_destroy(&g);
}

/* Trusted ends: the first and last stages (they see the tokens) go only to peers marked ends_ok,
 * even when the fastest peers are not, and beyond the exact search's 10 peers; with no such peer
 * the plan is refused saying so. */
static void test_dag_graph_partition_trusted_ends(void **state)
{
    (void)state;
    dag_graph_t *g = train_graph(0);
    dag_partition_opts o = train_opts();
    dag_peer_profile peers[12];
    bool ok[12];
    for (size_t i = 0; i < 12; i++) {
        snprintf(peers[i].name, sizeof peers[i].name, "p%zu", i);
        peers[i].gflops = 1000.0 - 50.0 * (double)i; /* p0 fastest */
        peers[i].mem_bytes = 8ull << 30;
        peers[i].link_bw = 1e9;
        peers[i].link_latency_s = 1e-4;
        ok[i] = i >= 2; /* the two fastest are strangers */
    }
    for (size_t n = 4; n <= 12; n += 8) {
        dag_plan plain = plan_ok(g, peers, n, &o);
        bool stranger_end = !ok[plain.stages[0].peer] || !ok[plain.stages[plain.n_stages - 1].peer];
        dag_plan_free(&plain);
        o.ends_ok = ok;
        for (size_t i = 0; i < n; i++) /* n = 12: only the two slowest are trusted */
            ok[i] = n == 4 ? i >= 2 : i >= 10;
        dag_plan plan = plan_ok(g, peers, n, &o);
        print_message("%zu peers: %zu stages, the ends on %s and %s (a plan without the rule put a stranger at an "
                      "end: %s)\n", n, plan.n_stages, peers[plan.stages[0].peer].name,
                      peers[plan.stages[plan.n_stages - 1].peer].name, stranger_end ? "yes" : "no");
        assert_true(ok[plan.stages[0].peer]);
        assert_true(ok[plan.stages[plan.n_stages - 1].peer]);
        dag_plan_free(&plan);
        o.ends_ok = NULL;
    }
    bool none[4] = {false, false, false, false};
    o.ends_ok = none;
    dag_plan plan;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_partition(g, peers, 4, &o, &plan, &em), FU_ENOMEM);
    assert_non_null(strstr(em.msg, "trusted"));
    dag_graph_destroy(&g);
}

static void test_dag_graph_partition_link_bound(void **state)
{
    (void)state;
    dag_graph_t *g = train_graph(0);
    dag_partition_opts o = train_opts();
    /* A very slow link makes splitting pointless: one fast-enough peer takes it all. */
    dag_peer_profile peers[2] = {{"p1", 100.0, 64ull << 30, 1e5, 0.01}, {"p2", 100.0, 64ull << 30, 1e5, 0.01}};
    dag_plan plan = plan_ok(g, peers, 2, &o);
    assert_int_equal(plan.n_stages, 1);
    dag_plan_free(&plan);
    dag_graph_destroy(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_graph_builder_shapes_and_names),
        cmocka_unit_test(test_dag_graph_range_label_names_the_cut),
        cmocka_unit_test(test_dag_graph_validation_rejects_malformed),
        cmocka_unit_test(test_dag_graph_protobuf_round_trip),
        cmocka_unit_test(test_dag_graph_decode_rejects_wrong_ids),
        cmocka_unit_test(test_dag_graph_partition_beats_even_split),
        cmocka_unit_test(test_dag_graph_partition_trusted_ends),
        cmocka_unit_test(test_dag_graph_partition_cuts_layers_when_vocab_is_small),
        cmocka_unit_test(test_dag_graph_partition_respects_memory),
        cmocka_unit_test(test_dag_graph_partition_link_bound),
        cmocka_unit_test(test_dag_graph_salr_lm_head),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
