#include "dag_partition.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"

/* Fixed memory beside parameters and activations: workspaces, cut buffers, allocator slack. */
#define DAG_STAGE_OVERHEAD_BYTES (32ull << 20)

static double stage_flops(const dag_graph_t *g, size_t first, size_t last, const dag_partition_opts *o)
{
    dag_cost c = dag_graph_cost(g, first, last);
    return c.flops_fwd + (o->training ? c.flops_bwd : 0.0);
}

/* Seconds of link latency a micro-batch of nodes [first, last) waits for on p's link, and through
 * *bytes_out the bytes it sends (activations down, gradients back up). */
static double stage_latency(const dag_graph_t *g, size_t first, size_t last, const dag_peer_profile *p,
                            const dag_partition_opts *o, double *bytes_out)
{
    double tokens = o->tokens_per_micro ? o->tokens_per_micro : 1;
    double act = o->act_wire_bytes > 0 ? o->act_wire_bytes : 4.0, grad = o->grad_wire_bytes > 0 ? o->grad_wire_bytes : 4.0;
    double bytes = act * tokens * (double)dag_graph_cut_width(g, last);
    if (o->training)
        bytes += grad * tokens * (double)dag_graph_cut_width(g, first); /* gradients sent back */
    *bytes_out = bytes;
    return bytes > 0.0 ? p->link_latency_s * (o->training && first > 0 && last < dag_graph_size(g) ? 2 : 1) : 0.0;
}

double dag_cost_stage_time(const dag_graph_t *g, size_t first, size_t last, const dag_peer_profile *p,
                           const dag_partition_opts *o, double *compute_s, double *comm_s)
{
    double tokens = o->tokens_per_micro ? o->tokens_per_micro : 1;
    double comp = tokens * stage_flops(g, first, last, o) / (p->gflops * 1e9);
    double bytes = 0.0, lat = stage_latency(g, first, last, p, o, &bytes);
    double comm = bytes > 0.0 ? bytes / p->link_bw + lat : 0.0;
    if (compute_s)
        *compute_s = comp;
    if (comm_s)
        *comm_s = comm;
    return comp + comm;
}

uint64_t dag_cost_stage_memory(const dag_graph_t *g, size_t first, size_t last, const dag_partition_opts *o)
{
    dag_cost c = dag_graph_cost(g, first, last);
    uint64_t tokens = o->tokens_per_micro ? o->tokens_per_micro : 1;
    uint64_t m = o->training ? (o->micro_batches ? o->micro_batches : 1) : 0;
    /* Widest output among the nodes: the working buffers of one micro-batch. */
    uint64_t wmax = 0;
    for (size_t i = first; i < last; i++) {
        const dag_node *n = dag_graph_node(g, i);
        if (n->out_width > wmax)
            wmax = n->out_width;
    }
    uint64_t cut = dag_graph_cut_width(g, first) + dag_graph_cut_width(g, last);
    return c.param_bytes + m * tokens * c.act_bytes + 4ull * tokens * (3 * wmax + 2 * cut) + DAG_STAGE_OVERHEAD_BYTES;
}

double dag_plan_pipeline_time(const dag_plan *plan, uint32_t M)
{
    double way = 0.0, slowest = 0.0;
    for (size_t k = 0; k < plan->n_stages; k++) {
        const dag_stage *s = &plan->stages[k];
        double t = s->time_s + DAG_MICRO_OVERHEAD_S;
        way += t;
        if (t - s->latency_s > slowest)
            slowest = t - s->latency_s;
    }
    return way + (double)(M > 1 ? M - 1 : 0) * slowest;
}

void dag_plan_free(dag_plan *plan)
{
    if (!plan)
        return;
    free(plan->stages);
    plan->stages = NULL;
    plan->n_stages = 0;
}

static void layer_span(const dag_graph_t *g, size_t first, size_t last, int32_t *lo, int32_t *hi)
{
    *lo = DAG_NO_LAYER;
    *hi = DAG_NO_LAYER;
    for (size_t i = first; i < last; i++) {
        int32_t l = dag_graph_node(g, i)->layer;
        if (l == DAG_NO_LAYER)
            continue;
        if (*lo == DAG_NO_LAYER || l < *lo)
            *lo = l;
        if (l > *hi)
            *hi = l;
    }
}

static void fill_stage(const dag_graph_t *g, const dag_peer_profile *peers, const dag_partition_opts *o,
                       dag_stage *s, size_t first, size_t last, size_t peer)
{
    memset(s, 0, sizeof *s);
    s->first = first;
    s->last = last;
    s->peer = peer;
    layer_span(g, first, last, &s->first_layer, &s->last_layer);
    s->time_s = dag_cost_stage_time(g, first, last, &peers[peer], o, &s->compute_s, &s->comm_s);
    double bytes;
    s->latency_s = stage_latency(g, first, last, &peers[peer], o, &bytes);
    s->mem_bytes = dag_cost_stage_memory(g, first, last, o);
    s->cut_bytes = (uint64_t)((o->act_wire_bytes > 0 ? o->act_wire_bytes : 4.0) *
                              (double)(o->tokens_per_micro ? o->tokens_per_micro : 1) * (double)dag_graph_cut_width(g, last));
}

static void explain(const dag_graph_t *g, const dag_peer_profile *peers, const dag_partition_opts *o,
                    dag_plan *plan)
{
    size_t bi = 0;
    for (size_t i = 0; i < plan->n_stages; i++)
        if (plan->stages[i].time_s > plan->stages[bi].time_s)
            bi = i;
    for (size_t i = 0; i < plan->n_stages; i++) {
        dag_stage *s = &plan->stages[i];
        const dag_peer_profile *p = &peers[s->peer];
        char layers[48];
        dag_graph_range_label(g, s->first, s->last, layers, sizeof layers);
        double gf = (o->tokens_per_micro ? o->tokens_per_micro : 1) * stage_flops(g, s->first, s->last, o) / 1e9;
        int wl = snprintf(s->why, sizeof s->why,
                 "stage %zu: nodes %zu-%zu (%s%s%s) on '%s': %.2f GFLOP at %.1f GFLOP/s = %.1f ms + "
                 "%.2f MB over the link at %.1f MB/s = %.1f ms; %.0f MiB of %.0f MiB; %s",
                 i, s->first, s->last ? s->last - 1 : 0, layers, s->first == 0 ? ", embedding" : "",
                 s->last == dag_graph_size(g) ? ", head" : "", p->name, gf, p->gflops, s->compute_s * 1e3,
                 (double)s->cut_bytes / 1e6, p->link_bw / 1e6, s->comm_s * 1e3, (double)s->mem_bytes / 1048576.0,
                 (double)p->mem_bytes / 1048576.0,
                 i == bi ? (s->comm_s > s->compute_s ? "the bottleneck, bound by its link"
                                                      : "the bottleneck, bound by compute")
                         : "sized so it does not exceed the bottleneck stage");
        if (wl < 0)
            s->why[0] = '\0';
    }
}

static fu_err check_args(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                         const dag_partition_opts *o)
{
    if (!g || !peers || !o || n_peers == 0 || dag_graph_size(g) == 0)
        return FU_EINVAL;
    for (size_t i = 0; i < n_peers; i++)
        if (!(peers[i].gflops > 0.0) || !(peers[i].link_bw > 0.0) || !(peers[i].link_latency_s >= 0.0) ||
            !isfinite(peers[i].gflops) || !isfinite(peers[i].link_bw))
            return FU_EINVAL;
    return FU_OK;
}

/* Candidate cut points: every node boundary 0..n. */
typedef struct {
    double best;  /* bottleneck */
    double sum;   /* sum of stage times (tie-break) */
    uint32_t k;   /* stages */
    int32_t prev_i;
    int32_t prev_peer;
    uint32_t prev_mask;
} cell;

static bool better(double b1, double s1, uint32_t k1, double b2, double s2, uint32_t k2)
{
    const double rel = 1e-9;
    if (b1 < b2 * (1 - rel))
        return true;
    if (b1 > b2 * (1 + rel))
        return false;
    if (s1 < s2 * (1 - rel))
        return true;
    if (s1 > s2 * (1 + rel))
        return false;
    return k1 < k2;
}

fu_err dag_partition(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                     const dag_partition_opts *o, dag_plan *plan, fu_errmsg *em)
{
    FU_TRY(check_args(g, peers, n_peers, o));
    if (!plan)
        return FU_EINVAL;
    memset(plan, 0, sizeof *plan);
    const size_t n = dag_graph_size(g);
    size_t P = n_peers;
    size_t *order = fu_malloc(n_peers * sizeof *order);
    for (size_t i = 0; i < n_peers; i++)
        order[i] = i;
    if (P > DAG_PARTITION_EXACT) {
        /* Fastest first; the DAG_PARTITION_EXACT fastest are searched exactly, the rest are backups. */
        for (size_t i = 1; i < n_peers; i++)
            for (size_t j = i; j > 0 && peers[order[j]].gflops > peers[order[j - 1]].gflops; j--) {
                size_t t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        P = DAG_PARTITION_EXACT;
        /* with the ends reserved for trusted peers, the two fastest trusted ones are searched too:
         * each takes the place of the slowest untrusted peer among those searched */
        for (size_t slot = P; o->ends_ok && slot > 0;) {
            size_t in = 0, far = n_peers;
            for (size_t i = 0; i < n_peers; i++) {
                if (!o->ends_ok[order[i]])
                    continue;
                if (i < P)
                    in++;
                else if (far == n_peers)
                    far = i;
            }
            while (slot > 0 && o->ends_ok[order[slot - 1]])
                slot--;
            if (in >= 2 || far == n_peers || slot == 0)
                break;
            size_t t = order[slot - 1];
            order[slot - 1] = order[far];
            order[far] = t;
        }
    }
    size_t max_k = o->max_stages && o->max_stages < P ? o->max_stages : P;

    /* Cut candidates: 0, n, and every boundary no wider than the residual stream (for a decoder:
     * between layers, between a layer's attention and MLP halves, and before the loss, where the
     * logits cross). Boundaries inside attention or the MLP carry several tensors and are skipped.
     * The bound is the residual width, not the narrowest cut: with a vocabulary smaller than the
     * hidden size the logits boundary is the narrowest, and the layers must stay cuttable. */
    uint64_t residual = dag_graph_dims(g)->hidden_size;
    size_t *cand = fu_malloc((n + 1) * sizeof *cand);
    size_t m = 0;
    cand[m++] = 0;
    for (size_t i = 1; i < n; i++) {
        uint64_t w = dag_graph_cut_width(g, i);
        if (w && w <= residual)
            cand[m++] = i;
    }
    cand[m++] = n;

    /* Stage time per (candidate a, candidate b, peer q) and memory per (a, b). */
    double *tt = fu_malloc(m * m * P * sizeof *tt);
    uint64_t *mm = fu_malloc(m * m * sizeof *mm);
    for (size_t a = 0; a < m; a++)
        for (size_t b = a + 1; b < m; b++) {
            mm[a * m + b] = dag_cost_stage_memory(g, cand[a], cand[b], o);
            for (size_t q = 0; q < P; q++)
                tt[(a * m + b) * P + q] = dag_cost_stage_time(g, cand[a], cand[b], &peers[order[q]], o, NULL, NULL);
        }
    size_t n_masks = (size_t)1 << P;
    cell *dp = fu_malloc(n_masks * m * sizeof *dp);
    for (size_t z = 0; z < n_masks * m; z++)
        dp[z] = (cell){DBL_MAX, DBL_MAX, 0, -1, -1, 0};
    dp[0].best = 0.0;
    dp[0].sum = 0.0;
    for (size_t mask = 0; mask < n_masks; mask++) {
        for (size_t a = 0; a + 1 < m; a++) {
            cell c = dp[mask * m + a];
            if (c.best == DBL_MAX || c.k >= max_k)
                continue;
            for (size_t b = a + 1; b < m; b++) {
                uint64_t mem = mm[a * m + b];
                for (size_t q = 0; q < P; q++) {
                    if ((mask & ((size_t)1 << q)) || mem > peers[order[q]].mem_bytes)
                        continue;
                    if (o->ends_ok && (a == 0 || b == m - 1) && !o->ends_ok[order[q]])
                        continue; /* an end stage on a peer not trusted with tokens */
                    double t = tt[(a * m + b) * P + q];
                    double bt = c.best > t ? c.best : t;
                    double st = c.sum + t;
                    cell *d = &dp[(mask | ((size_t)1 << q)) * m + b];
                    if (better(bt, st, c.k + 1, d->best, d->sum, d->k))
                        *d = (cell){bt, st, c.k + 1, (int32_t)a, (int32_t)q, (uint32_t)mask};
                }
            }
        }
    }
    size_t best_mask = 0;
    const cell *bc = NULL;
    for (size_t mask = 1; mask < n_masks; mask++) {
        const cell *c = &dp[mask * m + (m - 1)];
        if (c->best == DBL_MAX)
            continue;
        if (!bc || better(c->best, c->sum, c->k, bc->best, bc->sum, bc->k)) {
            bc = c;
            best_mask = mask;
        }
    }
    fu_err rc = FU_OK;
    if (!bc && o->ends_ok) {
        size_t n_ok = 0;
        for (size_t q = 0; q < n_peers; q++)
            n_ok += o->ends_ok[q];
        rc = fu_errmsg_set(em, FU_ENOMEM,
                           "no plan puts the first and last stages (they see the tokens) on trusted peers: %zu of "
                           "the %zu free peers are trusted, and they do not have the memory for both ends",
                           n_ok, n_peers);
        goto done;
    }
    if (!bc) {
        if (em) {
            uint64_t total = 0, largest = 0, smallest_stage = UINT64_MAX;
            for (size_t q = 0; q < n_peers; q++) {
                total += peers[q].mem_bytes;
                if (peers[q].mem_bytes > largest)
                    largest = peers[q].mem_bytes;
            }
            for (size_t a = 0; a + 1 < m; a++)
                if (mm[a * m + a + 1] < smallest_stage)
                    smallest_stage = mm[a * m + a + 1];
            fu_errmsg_set(em, FU_ENOMEM,
                          "the model does not fit in the peers' memory: all of it needs about %.0f MiB, the "
                          "peers offer %.0f MiB together (largest %.0f MiB) and the smallest possible stage "
                          "needs %.0f MiB; add peers or memory, or use fewer micro-batches",
                          (double)mm[m - 1] / 1048576.0, (double)total / 1048576.0,
                          (double)largest / 1048576.0, (double)smallest_stage / 1048576.0);
        }
        rc = FU_ENOMEM;
        goto done;
    }
    plan->n_stages = bc->k;
    plan->stages = fu_calloc(bc->k, sizeof *plan->stages);
    size_t mask = best_mask, b = m - 1;
    for (size_t s = bc->k; s-- > 0;) {
        const cell *c = &dp[mask * m + b];
        size_t a = (size_t)c->prev_i;
        fill_stage(g, peers, o, &plan->stages[s], cand[a], cand[b], order[c->prev_peer]);
        mask = c->prev_mask;
        b = a;
    }
    plan->bottleneck_s = bc->best;
    plan->step_s = bc->best * (double)((o->training ? (o->micro_batches ? o->micro_batches : 1) : 1) + bc->k - 1);
    explain(g, peers, o, plan);
done:
    free(dp);
    free(tt);
    free(mm);
    free(cand);
    free(order);
    return rc;
}

fu_err dag_partition_even(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                          const dag_partition_opts *o, dag_plan *plan)
{
    FU_TRY(check_args(g, peers, n_peers, o));
    if (!plan)
        return FU_EINVAL;
    memset(plan, 0, sizeof *plan);
    const size_t n = dag_graph_size(g);
    uint32_t L = dag_graph_dims(g)->n_layers;
    if (L == 0 || n_peers > L)
        return FU_EINVAL;
    plan->n_stages = n_peers;
    plan->stages = fu_calloc(n_peers, sizeof *plan->stages);
    size_t first = 0;
    double worst = 0.0;
    for (size_t s = 0; s < n_peers; s++) {
        size_t last = n;
        if (s + 1 < n_peers) {
            int32_t end_layer = (int32_t)(((s + 1) * L) / n_peers); /* first layer of the next stage */
            last = first;
            while (last < n && (dag_graph_node(g, last)->layer < end_layer))
                last++;
        }
        fill_stage(g, peers, o, &plan->stages[s], first, last, s);
        if (plan->stages[s].time_s > worst)
            worst = plan->stages[s].time_s;
        first = last;
    }
    plan->bottleneck_s = worst;
    plan->step_s = worst * (double)((o->training ? (o->micro_batches ? o->micro_batches : 1) : 1) + n_peers - 1);
    explain(g, peers, o, plan);
    return FU_OK;
}
