/* bench-swarm --plan-only: the broker's partitioner on its own, over the swarm's drawn hardware. Each
 * repeat draws n_peers peers as a run does (swarm_hw.c), keeps the BROKER_PLAN_CANDIDATES fastest as
 * the broker does, and plans the jobs' model (a fine-tune of cfg.layers layers, 4 micro-batches of 64
 * tokens) as plan_job does: the best plan, then the plan of the fewest stages within 10% of it
 * (dag_partition_each). Prints one "plan" JSON line: milliseconds p50 / p99 / max of the whole, and
 * the plans' stage counts and bottlenecks (the same seed gives the same plans). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dag_partition.h"
#include "fu_clock.h"
#include "swarm_internal.h"

#define PLAN_CANDIDATES 128 /* broker.h BROKER_PLAN_CANDIDATES */
#define PLAN_MARGIN     0.2 /* fusion-broker --grow-margin's default (BROKER_GROW_MARGIN) */
#define BROKER_PLAN_MAX_STAGES 64 /* broker.h BROKER_MAX_STAGES */

static int by_speed(const void *a, const void *b)
{
    const dag_peer_profile *x = a, *y = b;
    return x->gflops > y->gflops ? -1 : x->gflops < y->gflops;
}

static dag_graph_t *swarm_graph(int layers)
{
    dag_model_dims d = {.vocab_size = 256, .hidden_size = 128, .intermediate_size = 384, .n_layers = (uint32_t)layers,
                        .n_heads = 4, .n_kv_heads = 2, .head_dim = 32, .rms_eps = 1e-5f, .rope_theta = 10000.0f};
    dag_build_opts bo = {.method = DAG_ADAPTER_LORA_FA, .rank = 4, .alpha = 8, .head = DAG_HEAD_LOSS, .seq_len = 32};
    dag_graph_t *g = NULL;
    return dag_build_llama(&d, &bo, &g) == FU_OK ? g : NULL;
}

static int plan_bench(const swarm_cfg *cfg, int repeats, bool measured)
{
    dag_graph_t *g = swarm_graph(cfg->layers);
    if (!g || cfg->n_peers < 1 || repeats < 1)
        return 1;
    size_t n = (size_t)cfg->n_peers;
    dag_peer_profile *pp = calloc(n, sizeof *pp);
    dag_plan *each = calloc(BROKER_PLAN_MAX_STAGES, sizeof *each);
    swarm_samples ms = {0};
    uint64_t rng = cfg->seed;
    dag_partition_ws *ws = dag_partition_ws_new(); /* kept between searches, as the broker's planner keeps one */
    double bott_sum = 0;
    size_t stages_sum = 0, failed = 0;
    for (int r = 0; r < repeats; r++) {
        for (size_t i = 0; i < n; i++) {
            const swarm_gpu *gpu = swarm_gpu_draw(&rng);
            const swarm_link *ln = swarm_link_draw(&rng);
            snprintf(pp[i].name, sizeof pp[i].name, "sim%zu", i);
            pp[i].gflops = gpu->tflops * 1000.0 * 0.6;
            pp[i].mem_bytes = (32ull << 20) + (uint64_t)(gpu->gib * cfg->mem_per_gib);
            pp[i].link_bw = ln->up_mbit * 125000.0;
            pp[i].link_latency_s = ln->rtt_ms / 2000.0;
            if (measured) {
                pp[i].gflops *= 0.95 + 0.1 * swarm_uniform(&rng);
                pp[i].link_bw *= 0.95 + 0.1 * swarm_uniform(&rng);
            }
        }
        qsort(pp, n, sizeof *pp, by_speed);
        size_t cand = n < PLAN_CANDIDATES ? n : PLAN_CANDIDATES;
        dag_partition_opts o = {.tokens_per_micro = 64, .micro_batches = 4, .training = true,
                                .max_stages = (uint32_t)(cand > (size_t)cfg->backups ? cand - (size_t)cfg->backups : cand),
                                .ws = ws};
        if (o.max_stages > BROKER_PLAN_MAX_STAGES)
            o.max_stages = BROKER_PLAN_MAX_STAGES;
        uint64_t t0 = fu_clock_ns();
        fu_errmsg em = {{0}};
        fu_err rc = dag_partition_each(g, pp, cand, &o, each, o.max_stages, &em);
        const dag_plan *best = NULL;
        for (size_t k = o.max_stages; rc == FU_OK && k-- > 0;)
            if (each[k].n_stages) {
                best = &each[k];
                break;
            }
        for (size_t k = 0; best && k < best->n_stages; k++)
            if (each[k].n_stages && best->step_s > (1.0 - PLAN_MARGIN) * each[k].step_s) {
                best = &each[k];
                break;
            }
        swarm_samples_add(&ms, (double)(fu_clock_ns() - t0) / 1e6);
        if (best) {
            bott_sum += best->bottleneck_s;
            stages_sum += best->n_stages;
        } else {
            failed++;
        }
        for (size_t k = 0; k < BROKER_PLAN_MAX_STAGES; k++)
            dag_plan_free(&each[k]);
    }
    swarm_dist d = swarm_samples_dist(&ms);
    printf("{\"bench\":\"swarm\",\"case\":\"%s\",\"peers\":%d,\"candidates\":%d,\"layers\":%d,\"nodes\":%zu,"
           "\"repeats\":%d,\"plan_ms_p50\":%.3f,\"plan_ms_p99\":%.3f,\"plan_ms_max\":%.3f,\"stages_mean\":%.2f,"
           "\"bottleneck_ms_mean\":%.4f,\"unplanned\":%zu}\n",
           measured ? "plan_measured" : "plan", cfg->n_peers, cfg->n_peers < PLAN_CANDIDATES ? cfg->n_peers : PLAN_CANDIDATES, cfg->layers, dag_graph_size(g),
           repeats, d.p50, d.p99, d.max, repeats > (int)failed ? (double)stages_sum / (double)(repeats - (int)failed) : 0,
           repeats > (int)failed ? 1e3 * bott_sum / (double)(repeats - (int)failed) : 0, failed);
    swarm_samples_free(&ms);
    dag_partition_ws_free(&ws);
    free(each);
    free(pp);
    dag_graph_destroy(&g);
    return 0;
}

int swarm_plan_bench(const swarm_cfg *cfg, int repeats)
{
    return plan_bench(cfg, repeats, false) || plan_bench(cfg, repeats, true);
}
