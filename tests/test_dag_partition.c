/* The partitioner (dag_partition) against an exhaustive search: every stage count, every set of cuts
 * among the candidates and every order of distinct peers, on graphs small enough to try them all. The
 * fast search (tables, greedy bounds, twins) must find the same slowest stage, and its plan of at most
 * k stages for every k at once (dag_partition_each) must be the plan dag_partition makes when limited
 * to k stages. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "dag_graph.h"
#include "dag_partition.h"

#define MAX_PEERS 5

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

static dag_graph_t *graph(uint32_t layers, dag_head head)
{
    dag_model_dims d = {.vocab_size = 512, .hidden_size = 64, .intermediate_size = 192, .n_layers = layers,
                        .n_heads = 4, .n_kv_heads = 2, .head_dim = 16, .rms_eps = 1e-5f, .rope_theta = 10000.0f};
    dag_build_opts bo = {.method = DAG_ADAPTER_LORA_FA, .rank = 4, .alpha = 8, .head = head, .seq_len = 32};
    dag_graph_t *g = NULL;
    assert_int_equal(dag_build_llama(&d, &bo, &g), FU_OK);
    return g;
}

/* A case: peers drawn from a few speeds, memories and links (so that twins happen), the memory scaled
 * to the model so that it binds in some cases and not in others. */
typedef struct {
    dag_peer_profile peers[MAX_PEERS];
    bool ends_ok[MAX_PEERS];
    size_t n;
    dag_partition_opts o;
} pcase;

static void draw(uint64_t *rng, const dag_graph_t *g, pcase *c)
{
    static const double speeds[] = {50, 120, 300}, links[] = {2e6, 2e7, 1e9}, lats[] = {0, 0.005, 0.03};
    memset(c, 0, sizeof *c);
    bool training = uniform(rng) < 0.7;
    c->o = (dag_partition_opts){.tokens_per_micro = 64, .micro_batches = training ? 1 + (uint32_t)(uniform(rng) * 4) : 1,
                                .training = training};
    uint64_t whole = dag_cost_stage_memory(g, 0, dag_graph_size(g), &c->o);
    c->n = 1 + (size_t)(uniform(rng) * MAX_PEERS);
    for (size_t i = 0; i < c->n; i++) {
        dag_peer_profile *p = &c->peers[i];
        snprintf(p->name, sizeof p->name, "p%zu", i);
        p->gflops = uniform(rng) < 0.6 ? speeds[(int)(uniform(rng) * 3)] : 20 + uniform(rng) * 400;
        p->mem_bytes = (uint64_t)((double)whole * (uniform(rng) < 0.5 ? 0.6 : 0.2 + uniform(rng) * 1.2));
        p->link_bw = links[(int)(uniform(rng) * 3)];
        p->link_latency_s = lats[(int)(uniform(rng) * 3)];
        c->ends_ok[i] = uniform(rng) < 0.6;
    }
    c->o.max_stages = uniform(rng) < 0.5 ? 0 : 1 + (uint32_t)(uniform(rng) * 4);
    c->o.ends_ok = uniform(rng) < 0.3 ? c->ends_ok : NULL;
}

/* ---- the exhaustive search ------------------------------------------------------------------------ */

typedef struct {
    const dag_graph_t *g;
    const pcase *c;
    size_t cand[256], m;
    size_t cuts[MAX_PEERS + 1], peer[MAX_PEERS];
    bool used[MAX_PEERS];
    double best; /* the smallest slowest stage found */
} brute;

/* Stage s begins at candidate ai; every way to end it and place the rest. */
static void brute_stage(brute *b, size_t s, size_t ai, double worst, size_t max_k)
{
    const pcase *c = b->c;
    for (size_t bi = ai + 1; bi < b->m; bi++) {
        bool last = bi == b->m - 1;
        if (!last && s + 1 >= max_k)
            continue; /* no stage left for the rest */
        size_t first = b->cand[ai], end = b->cand[bi];
        uint64_t mem = dag_cost_stage_memory(b->g, first, end, &c->o);
        for (size_t q = 0; q < c->n; q++) {
            if (b->used[q] || mem > c->peers[q].mem_bytes)
                continue;
            if (c->o.ends_ok && (ai == 0 || last) && !c->o.ends_ok[q])
                continue;
            double t = dag_cost_stage_time(b->g, first, end, &c->peers[q], &c->o, NULL, NULL);
            double w = t > worst ? t : worst;
            if (last) {
                if (w < b->best)
                    b->best = w;
                continue;
            }
            b->used[q] = true;
            brute_stage(b, s + 1, bi, w, max_k);
            b->used[q] = false;
        }
    }
}

/* The smallest slowest stage of any plan of at most max_k stages (DBL_MAX: none fits). Candidates as
 * dag_partition's: every boundary no wider than the residual stream. */
static double brute_best(const dag_graph_t *g, const pcase *c, size_t max_k)
{
    brute b = {.g = g, .c = c, .best = DBL_MAX};
    size_t n = dag_graph_size(g);
    b.cand[b.m++] = 0;
    for (size_t i = 1; i < n; i++) {
        uint64_t w = dag_graph_cut_width(g, i);
        if (w && w <= dag_graph_dims(g)->hidden_size)
            b.cand[b.m++] = i;
    }
    b.cand[b.m++] = n;
    assert_true(b.m <= 256);
    brute_stage(&b, 0, 0, 0.0, max_k);
    return b.best;
}

/* A plan must cover the graph in order, put each stage on its own peer within its memory, keep the
 * ends where they may go, and report its slowest stage. */
static void check_plan(const dag_graph_t *g, const pcase *c, const dag_plan *p, size_t max_k)
{
    assert_true(p->n_stages >= 1 && p->n_stages <= max_k);
    double worst = 0;
    for (size_t s = 0; s < p->n_stages; s++) {
        const dag_stage *st = &p->stages[s];
        assert_int_equal(st->first, s == 0 ? 0 : p->stages[s - 1].last);
        assert_true(st->last > st->first);
        assert_true(st->peer < c->n);
        for (size_t r = 0; r < s; r++)
            assert_int_not_equal(p->stages[r].peer, st->peer);
        assert_true(st->mem_bytes <= c->peers[st->peer].mem_bytes);
        if (c->o.ends_ok && (s == 0 || s + 1 == p->n_stages))
            assert_true(c->o.ends_ok[st->peer]);
        worst = st->time_s > worst ? st->time_s : worst;
    }
    assert_int_equal(p->stages[p->n_stages - 1].last, dag_graph_size(g));
    assert_true(fabs(worst - p->bottleneck_s) <= 1e-12 * worst);
}

static size_t stage_limit(const pcase *c)
{
    size_t k = c->n < DAG_PARTITION_EXACT ? c->n : DAG_PARTITION_EXACT;
    return c->o.max_stages && c->o.max_stages < k ? c->o.max_stages : k;
}

static void test_dag_partition_equals_exhaustive_search(void **state)
{
    (void)state;
    uint64_t rng = 11;
    size_t planned = 0, refused = 0;
    for (int layers = 1; layers <= 3; layers++) {
        for (int head = 0; head < 2; head++) {
            dag_graph_t *g = graph((uint32_t)layers, head ? DAG_HEAD_SAMPLE : DAG_HEAD_LOSS);
            for (int r = 0; r < 60; r++) {
                pcase c;
                draw(&rng, g, &c);
                if (head)
                    c.o.training = false; /* a sampling head is inference */
                size_t k = stage_limit(&c);
                double want = brute_best(g, &c, k);
                dag_plan plan = {0};
                fu_errmsg em = {{0}};
                fu_err rc = dag_partition(g, c.peers, c.n, &c.o, &plan, &em);
                if (want == DBL_MAX) {
                    assert_int_equal(rc, FU_ENOMEM);
                    assert_true(em.msg[0] != '\0');
                    refused++;
                    continue;
                }
                if (rc != FU_OK)
                    fail_msg("layers %d case %d: %s (the exhaustive search found %.6g s)", layers, r, em.msg, want);
                check_plan(g, &c, &plan, k);
                if (fabs(plan.bottleneck_s - want) > 1e-9 * want)
                    fail_msg("layers %d case %d: slowest stage %.9g s, the exhaustive search %.9g s", layers, r,
                             plan.bottleneck_s, want);
                planned++;
                dag_plan_free(&plan);
            }
            dag_graph_destroy(&g);
        }
    }
    assert_true(planned > 100 && refused > 10); /* both outcomes were played */
}

static void test_dag_partition_each_is_every_stage_limit(void **state)
{
    (void)state;
    uint64_t rng = 29;
    dag_graph_t *g = graph(6, DAG_HEAD_LOSS);
    size_t compared = 0;
    for (int r = 0; r < 60; r++) {
        pcase c;
        draw(&rng, g, &c);
        c.o.max_stages = 0;
        dag_plan each[MAX_PEERS + 2];
        fu_errmsg em = {{0}};
        fu_err rc = dag_partition_each(g, c.peers, c.n, &c.o, each, MAX_PEERS + 2, &em);
        for (size_t k = 1; k <= MAX_PEERS + 2; k++) {
            dag_partition_opts o = c.o;
            o.max_stages = (uint32_t)k;
            dag_plan one = {0};
            fu_err r1 = dag_partition(g, c.peers, c.n, &o, &one, NULL);
            const dag_plan *e = rc == FU_OK ? &each[k - 1] : NULL;
            if (k > c.n) { /* past the peers: left empty */
                assert_true(!e || e->n_stages == 0);
                dag_plan_free(&one);
                continue;
            }
            assert_int_equal(r1 == FU_OK, e && e->n_stages > 0);
            if (r1 == FU_OK) {
                assert_int_equal(one.n_stages, e->n_stages);
                assert_true(one.bottleneck_s == e->bottleneck_s && one.step_s == e->step_s);
                for (size_t s = 0; s < one.n_stages; s++) {
                    assert_int_equal(one.stages[s].first, e->stages[s].first);
                    assert_int_equal(one.stages[s].peer, e->stages[s].peer);
                    assert_string_equal(one.stages[s].why, e->stages[s].why);
                }
                compared++;
            }
            dag_plan_free(&one);
        }
        for (size_t k = 0; rc == FU_OK && k < MAX_PEERS + 2; k++)
            dag_plan_free(&each[k]);
    }
    assert_true(compared > 60);
    dag_graph_destroy(&g);
}

/* Ten equal peers are twins: the search uses them in their order and still finds what ten peers
 * that differ by a hair find. Sixteen take the exact search's ten fastest. */
static void test_dag_partition_twins_lose_nothing(void **state)
{
    (void)state;
    dag_graph_t *g = graph(12, DAG_HEAD_LOSS);
    dag_partition_opts o = {.tokens_per_micro = 64, .micro_batches = 4, .training = true};
    uint64_t fixed = dag_cost_stage_memory(g, 0, 1, &o), whole = dag_cost_stage_memory(g, 0, dag_graph_size(g), &o);
    dag_peer_profile twins[16], apart[16]; /* each holds about a third of the model */
    for (size_t i = 0; i < 16; i++) {
        twins[i] = (dag_peer_profile){.gflops = i % 2 ? 100 : 250, .mem_bytes = fixed + (whole - fixed) * 2 / 5, .link_bw = 2e7,
                                      .link_latency_s = 0.01};
        snprintf(twins[i].name, sizeof twins[i].name, "t%zu", i);
        apart[i] = twins[i];
        apart[i].gflops *= 1.0 + 1e-12 * (double)i;
    }
    for (size_t n = 4; n <= 16; n += 6) {
        dag_plan a = {0}, b = {0};
        assert_int_equal(dag_partition(g, twins, n, &o, &a, NULL), FU_OK);
        assert_int_equal(dag_partition(g, apart, n, &o, &b, NULL), FU_OK);
        assert_true(a.n_stages >= 3);
        assert_true(fabs(a.bottleneck_s - b.bottleneck_s) <= 1e-9 * b.bottleneck_s);
        /* twins in their order: of the peers of one speed, the plan uses the first ones */
        for (size_t s = 0; s < a.n_stages; s++)
            for (size_t q = 0; q < a.stages[s].peer; q++)
                if (twins[q].gflops == twins[a.stages[s].peer].gflops && n <= DAG_PARTITION_EXACT) {
                    bool used = false;
                    for (size_t r = 0; r < a.n_stages; r++)
                        used |= a.stages[r].peer == q;
                    assert_true(used);
                }
        dag_plan_free(&a);
        dag_plan_free(&b);
    }
    dag_graph_destroy(&g);
}

/* A workspace kept across searches (the broker keeps one per searching thread) gives the plans a
 * search without one gives, bit for bit, over graphs and peer counts that grow and shrink: it grows to
 * the largest search, never shrinks, and what an earlier, larger search left in it does not leak. */
static void test_dag_partition_ws_changes_nothing(void **state)
{
    (void)state;
    uint64_t rng = 41;
    dag_graph_t *gs[3] = {graph(2, DAG_HEAD_LOSS), graph(12, DAG_HEAD_LOSS), graph(6, DAG_HEAD_LOGITS)};
    dag_partition_ws *ws = dag_partition_ws_new();
    assert_non_null(ws);
    assert_int_equal(dag_partition_ws_bytes(ws), 0);
    size_t grown = 0, last = 0, compared = 0;
    for (int r = 0; r < 45; r++) {
        const dag_graph_t *g = gs[(r * 7 + r / 3) % 3];
        pcase c;
        draw(&rng, g, &c);
        dag_plan own[MAX_PEERS], kept[MAX_PEERS];
        fu_errmsg e1 = {{0}}, e2 = {{0}};
        fu_err r1 = dag_partition_each(g, c.peers, c.n, &c.o, own, MAX_PEERS, &e1);
        c.o.ws = ws;
        fu_err r2 = dag_partition_each(g, c.peers, c.n, &c.o, kept, MAX_PEERS, &e2);
        assert_int_equal(r1, r2);
        assert_string_equal(e1.msg, e2.msg);
        size_t now = dag_partition_ws_bytes(ws);
        assert_true(now >= last); /* never shrinks */
        grown += now > last;
        last = now;
        for (size_t k = 0; r1 == FU_OK && k < MAX_PEERS; k++) {
            assert_int_equal(own[k].n_stages, kept[k].n_stages);
            assert_memory_equal(&own[k].bottleneck_s, &kept[k].bottleneck_s, sizeof(double));
            assert_memory_equal(&own[k].step_s, &kept[k].step_s, sizeof(double));
            for (size_t s = 0; s < own[k].n_stages; s++) {
                assert_int_equal(own[k].stages[s].first, kept[k].stages[s].first);
                assert_int_equal(own[k].stages[s].last, kept[k].stages[s].last);
                assert_int_equal(own[k].stages[s].peer, kept[k].stages[s].peer);
                assert_memory_equal(&own[k].stages[s].time_s, &kept[k].stages[s].time_s, sizeof(double));
                assert_int_equal(own[k].stages[s].mem_bytes, kept[k].stages[s].mem_bytes);
            }
            compared += own[k].n_stages > 0;
            dag_plan_free(&own[k]);
            dag_plan_free(&kept[k]);
        }
    }
    assert_true(grown >= 2 && compared > 45);
    dag_partition_ws_free(&ws);
    assert_null(ws);
    dag_partition_ws_free(&ws); /* NULL-safe */
    for (size_t i = 0; i < 3; i++)
        dag_graph_destroy(&gs[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_partition_equals_exhaustive_search),
        cmocka_unit_test(test_dag_partition_each_is_every_stage_limit),
        cmocka_unit_test(test_dag_partition_twins_lose_nothing),
        cmocka_unit_test(test_dag_partition_ws_changes_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
