#include "dag_partition.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fu_alloc.h"

/* Fixed memory beside parameters and activations: workspaces, cut buffers, allocator slack. */
#define DAG_STAGE_OVERHEAD_BYTES (32ull << 20)

static double tokens_of(const dag_partition_opts *o)
{
    return o->tokens_per_micro ? o->tokens_per_micro : 1;
}

static double stage_flops(const dag_cost *c, const dag_partition_opts *o)
{
    return c->flops_fwd + (o->training ? c->flops_bwd : 0.0);
}

/* A stage's time on p from its sums: FLOPs per token, the widths of the cut it reads (cut_in; 0 for
 * the first stage) and of the cut it writes (cut_out; 0 for the last), interior when it is neither.
 * The compute and link seconds go to *comp and *comm, the part of *comm that is link latency to *lat.
 * The public cost functions and the partitioner's tables both come here, so both give the same bits. */
static double time_of(double flops, uint64_t cut_in, uint64_t cut_out, bool interior, const dag_peer_profile *p,
                      const dag_partition_opts *o, double *comp, double *comm, double *lat)
{
    double tokens = tokens_of(o);
    double act = o->act_wire_bytes > 0 ? o->act_wire_bytes : 4.0, grad = o->grad_wire_bytes > 0 ? o->grad_wire_bytes : 4.0;
    double bytes = act * tokens * (double)cut_out;
    if (o->training)
        bytes += grad * tokens * (double)cut_in; /* gradients sent back */
    *lat = bytes > 0.0 ? p->link_latency_s * (o->training && interior ? 2 : 1) : 0.0;
    *comp = tokens * flops / (p->gflops * 1e9);
    *comm = bytes > 0.0 ? bytes / p->link_bw + *lat : 0.0;
    return *comp + *comm;
}

/* A stage's peak memory from its sums and the widest output among its nodes (the working buffers of
 * one micro-batch). Less its cut terms, it only grows as the stage takes more nodes. */
static uint64_t memory_of(const dag_cost *c, uint64_t wmax, uint64_t cut_in, uint64_t cut_out, const dag_partition_opts *o)
{
    uint64_t tokens = o->tokens_per_micro ? o->tokens_per_micro : 1;
    uint64_t m = o->training ? (o->micro_batches ? o->micro_batches : 1) : 0;
    return c->param_bytes + m * tokens * c->act_bytes + 4ull * tokens * (3 * wmax + 2 * (cut_in + cut_out)) +
           o->kv_positions * c->kv_bytes + DAG_STAGE_OVERHEAD_BYTES;
}

static uint64_t widest(const dag_graph_t *g, size_t first, size_t last)
{
    uint64_t w = 0;
    for (size_t i = first; i < last; i++)
        if (dag_graph_node(g, i)->out_width > w)
            w = dag_graph_node(g, i)->out_width;
    return w;
}

/* time_of for nodes [first, last), its latency to *lat. */
static double stage_time(const dag_graph_t *g, size_t first, size_t last, const dag_peer_profile *p,
                         const dag_partition_opts *o, double *comp, double *comm, double *lat)
{
    dag_cost c = dag_graph_cost(g, first, last);
    return time_of(stage_flops(&c, o), dag_graph_cut_width(g, first), dag_graph_cut_width(g, last),
                   first > 0 && last < dag_graph_size(g), p, o, comp, comm, lat);
}

double dag_cost_stage_time(const dag_graph_t *g, size_t first, size_t last, const dag_peer_profile *p,
                           const dag_partition_opts *o, double *compute_s, double *comm_s)
{
    double comp, comm, lat;
    double t = stage_time(g, first, last, p, o, &comp, &comm, &lat);
    if (compute_s)
        *compute_s = comp;
    if (comm_s)
        *comm_s = comm;
    return t;
}

uint64_t dag_cost_stage_memory(const dag_graph_t *g, size_t first, size_t last, const dag_partition_opts *o)
{
    dag_cost c = dag_graph_cost(g, first, last);
    return memory_of(&c, widest(g, first, last), dag_graph_cut_width(g, first), dag_graph_cut_width(g, last), o);
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
    s->time_s = stage_time(g, first, last, &peers[peer], o, &s->compute_s, &s->comm_s, &s->latency_s);
    s->mem_bytes = dag_cost_stage_memory(g, first, last, o);
    s->cut_bytes = (uint64_t)((o->act_wire_bytes > 0 ? o->act_wire_bytes : 4.0) * tokens_of(o) *
                              (double)dag_graph_cut_width(g, last));
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
        dag_cost c = dag_graph_cost(g, s->first, s->last);
        double gf = tokens_of(o) * stage_flops(&c, o) / 1e9;
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

/* ---- the partitioner ------------------------------------------------------------------------------
 *
 * A dynamic program over (the set of peers used so far, the cut where the next stage begins): the
 * stages are contiguous, so a plan is a path of cuts 0 = c0 < c1 < ... < ck = n, each hop a stage on
 * a peer not used before. Its cost is (the slowest stage, then the sum of stage times, then the
 * stages). Three things keep it fast without changing what it finds (test_dag_partition checks it
 * against an exhaustive search):
 *   - tables: every stage's time and memory, one pass over the nodes per first cut;
 *   - bounds: a greedy plan of at most k stages bounds the slowest stage of the best such plan, so a
 *     stage whose compute alone exceeds it ends the look further along the graph (compute only grows
 *     with the stage, as does its memory less the cut buffers); and memory alone says how many
 *     stages the rest of the graph needs at least, so a path that leaves more than its stages left
 *     can hold is dropped;
 *   - twins: peers with equal profiles are used in their order, one plan standing for all the
 *     orders that only swap twins. */

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

/* The search space and its tables. Peer q (0..P) is peers[order[q]]. */
typedef struct {
    const dag_graph_t *g;
    const dag_peer_profile *peers;
    const dag_partition_opts *o;
    const size_t *order;
    size_t P, m;        /* peers searched, cut candidates */
    size_t *cand;       /* cut candidates (node boundaries), cand[0] = 0, cand[m - 1] = n */
    uint64_t *width;    /* the width of each candidate cut (0 at both ends) */
    double *flops;      /* [a·m + b]: FLOPs per token of the stage cand[a]..cand[b] */
    uint64_t *mem;      /* [a·m + b]: its memory */
    uint64_t *mem_grow; /* [a·m + b]: its memory less the cut buffers (grows with b) */
    double *tt;         /* [(a·m + b)·P + q]: its time on peer q */
} ptab;

/* Whether peer q may take an end stage (the first and the last see the tokens). */
static bool end_ok(const ptab *t, size_t q)
{
    return !t->o->ends_ok || t->o->ends_ok[t->order[q]];
}

static void ptab_free(ptab *t)
{
    free(t->cand);
    free(t->width);
}

/* ---- the search's scratch memory ----------------------------------------------------------------- */

struct dag_partition_ws {
    void *base; /* mapped and populated: cap bytes */
    size_t cap;
};

dag_partition_ws *dag_partition_ws_new(void)
{
    return fu_calloc(1, sizeof(dag_partition_ws));
}

static void ws_unmap(dag_partition_ws *ws)
{
    if (ws->base)
        munmap(ws->base, ws->cap);
    ws->base = NULL;
    ws->cap = 0;
}

void dag_partition_ws_free(dag_partition_ws **ws)
{
    if (!ws || !*ws)
        return;
    ws_unmap(*ws);
    free(*ws);
    *ws = NULL;
}

size_t dag_partition_ws_bytes(const dag_partition_ws *ws)
{
    return ws ? ws->cap : 0;
}

/* At least n bytes of ws, touched when it grows so that no search faults pages in; NULL when they
 * cannot be mapped. The old contents are not kept. Growing to 8 MiB costs 6-7 ms with huge pages,
 * 22-29 ms without (measured on the 2-core dev VM). */
static void *ws_take(dag_partition_ws *ws, size_t n)
{
    if (ws->cap >= n)
        return ws->base;
    ws_unmap(ws);
    long page = sysconf(_SC_PAGESIZE);
    size_t pg = page > 0 ? (size_t)page : 4096;
    size_t cap = (n + pg - 1) / pg * pg;
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    /* Huge pages where the kernel gives them on request (THP "madvise"): 8 MiB is then four faults,
     * not 2,000. Advice only: a kernel without THP ignores it and the memset faults small pages. */
    (void)madvise(p, cap, MADV_HUGEPAGE);
    memset(p, 0, cap);
    ws->base = p;
    ws->cap = cap;
    return p;
}

/* The bytes of the tables (flops, mem, mem_grow, tt) and the DP of t's search. */
static size_t tables_bytes(size_t m, size_t P)
{
    return m * m * (sizeof(double) + 2 * sizeof(uint64_t) + P * sizeof(double));
}

static size_t search_bytes(size_t m, size_t P)
{
    return tables_bytes(m, P) + ((size_t)1 << P) * m * sizeof(cell);
}

/* Cut candidates: 0, n, and every boundary no wider than the residual stream (for a decoder: between
 * layers, between a layer's attention and MLP halves, and before the loss, where the logits cross).
 * Boundaries inside attention or the MLP carry several tensors and are skipped. The bound is the
 * residual width, not the narrowest cut: with a vocabulary smaller than the hidden size the logits
 * boundary is the narrowest, and the layers must stay cuttable. Then the tables, each stage's sums
 * added up node by node in the order dag_graph_cost adds them. */
static void ptab_cands(ptab *t)
{
    const dag_graph_t *g = t->g;
    size_t n = dag_graph_size(g);
    uint64_t residual = dag_graph_dims(g)->hidden_size;
    t->width = fu_malloc((n + 1) * sizeof *t->width);
    t->cand = fu_malloc((n + 1) * sizeof *t->cand);
    size_t m = 0;
    t->cand[m] = 0;
    t->width[m++] = 0;
    for (size_t i = 1; i < n; i++) {
        uint64_t w = dag_graph_cut_width(g, i);
        if (w && w <= residual) {
            t->cand[m] = i;
            t->width[m++] = w;
        }
    }
    t->cand[m] = n;
    t->width[m++] = 0;
    t->m = m;
}

/* The tables, in mem (tables_bytes of it, zeroed here). */
static void ptab_build(ptab *t, void *mem)
{
    const dag_graph_t *g = t->g;
    const dag_partition_opts *o = t->o;
    const size_t m = t->m, P = t->P;
    const uint64_t *width = t->width;
    memset(mem, 0, tables_bytes(m, P));
    t->flops = mem;
    t->mem = (uint64_t *)(t->flops + m * m);
    t->mem_grow = t->mem + m * m;
    t->tt = (double *)(t->mem_grow + m * m);
    for (size_t a = 0; a + 1 < m; a++) {
        dag_cost c = {0};
        uint64_t wmax = 0;
        for (size_t b = a + 1; b < m; b++) {
            for (size_t i = t->cand[b - 1]; i < t->cand[b]; i++) {
                const dag_node *nd = dag_graph_node(g, i);
                c.flops_fwd += nd->flops_fwd;
                c.flops_bwd += nd->flops_bwd;
                c.param_bytes += nd->param_bytes;
                c.act_bytes += nd->act_bytes;
                c.kv_bytes += dag_node_kv_bytes(nd);
                if (nd->out_width > wmax)
                    wmax = nd->out_width;
            }
            size_t ab = a * m + b;
            t->flops[ab] = stage_flops(&c, o);
            t->mem[ab] = memory_of(&c, wmax, width[a], width[b], o);
            t->mem_grow[ab] = memory_of(&c, wmax, 0, 0, o);
            for (size_t q = 0; q < P; q++) {
                double comp, comm, lat;
                t->tt[ab * P + q] = time_of(t->flops[ab], width[a], width[b], a > 0 && b + 1 < m,
                                            &t->peers[t->order[q]], o, &comp, &comm, &lat);
            }
        }
    }
}

/* Whether stage a..b fits peer q with a time of at most T, its time to *time. */
static bool ptab_fits(const ptab *t, size_t a, size_t b, size_t q, double T, double *time)
{
    *time = t->tt[(a * t->m + b) * t->P + q];
    return t->mem[a * t->m + b] <= t->peers[t->order[q]].mem_bytes && *time <= T;
}

/* The farthest b < m - 1 that stage a..b can reach on q within T (0: none). */
static size_t ptab_reach(const ptab *t, size_t a, size_t q, double T)
{
    const dag_peer_profile *p = &t->peers[t->order[q]];
    size_t far = 0;
    for (size_t b = a + 1; b + 1 < t->m; b++) {
        size_t ab = a * t->m + b;
        if (tokens_of(t->o) * t->flops[ab] / (p->gflops * 1e9) > T || t->mem_grow[ab] > p->mem_bytes)
            break;
        double time;
        if (ptab_fits(t, a, b, q, T, &time))
            far = b;
    }
    return far;
}

/* A plan of at most k stages whose stages all take at most T, found greedily: each stage goes to the
 * unused peer that can take the most of the graph within T (keeping a peer that may take the last
 * stage), until one peer can take the rest. Its slowest stage, or DBL_MAX when it finds none. */
static double greedy(const ptab *t, size_t k, double T)
{
    bool used[DAG_PARTITION_EXACT] = {false};
    size_t ends_left = 0; /* unused peers that may take an end */
    for (size_t q = 0; q < t->P; q++)
        ends_left += end_ok(t, q);
    double worst = 0.0, time;
    size_t a = 0;
    for (size_t stages = 0; stages < k; stages++) {
        for (size_t q = 0; q < t->P; q++) /* the rest on one peer: the last stage */
            if (!used[q] && end_ok(t, q) && ptab_fits(t, a, t->m - 1, q, T, &time))
                return time > worst ? time : worst;
        if (stages + 2 > k)
            return DBL_MAX;
        size_t best_q = t->P, best_b = 0;
        for (size_t q = 0; q < t->P; q++) {
            if (used[q] || (stages == 0 && !end_ok(t, q)) || ends_left - end_ok(t, q) == 0)
                continue; /* used, an untrusted first stage, or the last peer left for the last stage */
            size_t b = ptab_reach(t, a, q, T);
            if (b > best_b) {
                best_b = b;
                best_q = q;
            }
        }
        if (best_q == t->P)
            return DBL_MAX;
        (void)ptab_fits(t, a, best_b, best_q, T, &time);
        worst = time > worst ? time : worst;
        used[best_q] = true;
        ends_left -= end_ok(t, best_q);
        a = best_b;
    }
    return DBL_MAX;
}

/* bound[k] for k = 1..max_k: the slowest stage of a plan of at most k stages (DBL_MAX: none found),
 * the smallest the greedy plans reach over a bisection of their limit. Never more than bound[k-1]. */
static void bounds(const ptab *t, size_t max_k, double *bound)
{
    bound[0] = DBL_MAX;
    for (size_t k = 1; k <= max_k; k++) {
        double best = greedy(t, k, DBL_MAX);
        if (best < DBL_MAX) {
            double lo = 0.0, hi = best;
            for (int it = 0; it < 40 && hi - lo > 1e-6 * hi; it++) {
                double mid = 0.5 * (lo + hi), got = greedy(t, k, mid);
                if (got < DBL_MAX) {
                    hi = got < mid ? got : mid;
                    best = got < best ? got : best;
                } else {
                    lo = mid;
                }
            }
        }
        bound[k] = best < bound[k - 1] ? best : bound[k - 1];
    }
}

/* rest[a]: the fewest stages that can cover the graph from cut a on, for memory alone: stages that
 * each fit the largest memory among the peers searched (a shortest path over the cut candidates;
 * SIZE_MAX where none can). rest[0] is the fewest stages of any plan. */
static void fewest_for_memory(const ptab *t, size_t *rest)
{
    const size_t m = t->m;
    uint64_t most = 0;
    for (size_t q = 0; q < t->P; q++)
        if (t->peers[t->order[q]].mem_bytes > most)
            most = t->peers[t->order[q]].mem_bytes;
    rest[m - 1] = 0;
    for (size_t a = m - 1; a-- > 0;) {
        rest[a] = SIZE_MAX;
        for (size_t b = a + 1; b < m && t->mem_grow[a * m + b] <= most; b++)
            if (rest[b] != SIZE_MAX && t->mem[a * m + b] <= most && rest[b] + 1 < rest[a])
                rest[a] = rest[b] + 1;
    }
}

/* For each peer q, the twin before it (an earlier peer of the same profile and end rule), or -1. */
static void twins(const ptab *t, int32_t *twin)
{
    for (size_t q = 0; q < t->P; q++) {
        const dag_peer_profile *p = &t->peers[t->order[q]];
        twin[q] = -1;
        for (size_t r = q; r-- > 0;) {
            const dag_peer_profile *x = &t->peers[t->order[r]];
            if (x->gflops == p->gflops && x->mem_bytes == p->mem_bytes && x->link_bw == p->link_bw &&
                x->link_latency_s == p->link_latency_s && end_ok(t, r) == end_ok(t, q)) {
                twin[q] = (int32_t)r;
                break;
            }
        }
    }
}

/* The dynamic program: dp[mask·m + a] is the best way to cover the nodes before cand[a] with the
 * peers in mask. */
static void search(const ptab *t, size_t max_k, cell *dp)
{
    const size_t m = t->m, P = t->P, n_masks = (size_t)1 << P;
    size_t mask_end = n_masks;
    double *bound = fu_malloc((max_k + 1) * sizeof *bound);
    int32_t *twin = fu_malloc(P * sizeof *twin);
    bounds(t, max_k, bound);
    twins(t, twin);
    size_t *rest = fu_malloc(m * sizeof *rest);
    fewest_for_memory(t, rest);
    size_t at_least = rest[0]; /* every plan has at least this many stages */
    if (at_least > max_k) /* none fits: no search needed to say so */
        mask_end = 0;
    for (size_t z = 0; z < n_masks * m; z++)
        dp[z] = (cell){DBL_MAX, DBL_MAX, 0, -1, -1, 0};
    dp[0].best = 0.0;
    dp[0].sum = 0.0;
    for (size_t mask = 0; mask < mask_end; mask++) {
        for (size_t a = 0; a + 1 < m; a++) {
            cell c = dp[mask * m + a];
            if (c.best == DBL_MAX || c.k >= max_k)
                continue;
            /* a stage slower than this cannot be part of the best plan of j stages, for any j this
             * path can end with: at least c.k + 1, and at least what memory needs */
            size_t j = c.k + 1 > at_least ? c.k + 1 : at_least;
            double limit = j <= max_k && bound[j] < DBL_MAX ? bound[j] * (1 + 1e-6) : DBL_MAX;
            if (c.best > limit)
                continue; /* nor can what came before, then */
            for (size_t q = 0; q < P; q++) {
                if ((mask & ((size_t)1 << q)) || (twin[q] >= 0 && !(mask & ((size_t)1 << twin[q]))))
                    continue; /* used, or a twin comes first */
                const dag_peer_profile *p = &t->peers[t->order[q]];
                if (a == 0 && !end_ok(t, q))
                    continue; /* the first stage on a peer not trusted with tokens */
                cell *row = &dp[(mask | ((size_t)1 << q)) * m];
                double flops_max = limit < DBL_MAX ? limit * (p->gflops * 1e9) / tokens_of(t->o) * (1 + 1e-9) : DBL_MAX;
                for (size_t b = a + 1; b < m; b++) {
                    size_t ab = a * m + b;
                    if (t->flops[ab] > flops_max || t->mem_grow[ab] > p->mem_bytes)
                        break;
                    if (t->mem[ab] > p->mem_bytes || (b == m - 1 && !end_ok(t, q)) || rest[b] > max_k - c.k - 1)
                        continue; /* it does not fit, takes an end it may not, or leaves more than the
                                     stages left can hold */
                    double tq = t->tt[ab * P + q];
                    double bt = c.best > tq ? c.best : tq;
                    double st = c.sum + tq;
                    cell *d = &row[b];
                    if (better(bt, st, c.k + 1, d->best, d->sum, d->k))
                        *d = (cell){bt, st, c.k + 1, (int32_t)a, (int32_t)q, (uint32_t)mask};
                }
            }
        }
    }
    free(rest);
    free(twin);
    free(bound);
}

/* The peers searched, in order: all of them up to DAG_PARTITION_EXACT; beyond, the fastest, with
 * the two fastest that may take the ends among them when the ends are reserved. Returns P. */
static size_t searched(const dag_peer_profile *peers, size_t n_peers, const dag_partition_opts *o, size_t *order)
{
    for (size_t i = 0; i < n_peers; i++)
        order[i] = i;
    if (n_peers <= DAG_PARTITION_EXACT)
        return n_peers;
    for (size_t i = 1; i < n_peers; i++)
        for (size_t j = i; j > 0 && peers[order[j]].gflops > peers[order[j - 1]].gflops; j--) {
            size_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    size_t P = DAG_PARTITION_EXACT;
    /* with the ends reserved for trusted peers, the two fastest trusted ones are searched too: each
     * takes the place of the slowest untrusted peer among those searched */
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
    return P;
}

static fu_err no_plan(const ptab *t, size_t n_peers, fu_errmsg *em)
{
    const dag_partition_opts *o = t->o;
    if (o->ends_ok) {
        size_t n_ok = 0;
        for (size_t q = 0; q < n_peers; q++)
            n_ok += o->ends_ok[q];
        return fu_errmsg_set(em, FU_ENOMEM,
                             "no plan puts the first and last stages (they see the tokens) on trusted peers: %zu of "
                             "the %zu free peers are trusted, and they do not have the memory for both ends",
                             n_ok, n_peers);
    }
    if (em) {
        size_t m = t->m;
        uint64_t total = 0, largest = 0, smallest_stage = UINT64_MAX;
        for (size_t q = 0; q < n_peers; q++) {
            total += t->peers[q].mem_bytes;
            if (t->peers[q].mem_bytes > largest)
                largest = t->peers[q].mem_bytes;
        }
        for (size_t a = 0; a + 1 < m; a++)
            if (t->mem[a * m + a + 1] < smallest_stage)
                smallest_stage = t->mem[a * m + a + 1];
        fu_errmsg_set(em, FU_ENOMEM,
                      "the model does not fit in the peers' memory: all of it needs about %.0f MiB, the "
                      "peers offer %.0f MiB together (largest %.0f MiB) and the smallest possible stage "
                      "needs %.0f MiB; add peers or memory, or use fewer micro-batches",
                      (double)t->mem[m - 1] / 1048576.0, (double)total / 1048576.0, (double)largest / 1048576.0,
                      (double)smallest_stage / 1048576.0);
    }
    return FU_ENOMEM;
}

/* The plan that ends in dp's cell at (mask, the last cut). */
static void trace(const ptab *t, const cell *dp, size_t mask, dag_plan *plan)
{
    const size_t m = t->m;
    const cell *end = &dp[mask * m + (m - 1)];
    plan->n_stages = end->k;
    plan->stages = fu_calloc(end->k, sizeof *plan->stages);
    size_t b = m - 1;
    for (size_t s = end->k; s-- > 0;) {
        const cell *c = &dp[mask * m + b];
        size_t a = (size_t)c->prev_i;
        fill_stage(t->g, t->peers, t->o, &plan->stages[s], t->cand[a], t->cand[b], t->order[c->prev_peer]);
        mask = c->prev_mask;
        b = a;
    }
    uint32_t M = t->o->training ? (t->o->micro_batches ? t->o->micro_batches : 1) : 1;
    plan->bottleneck_s = end->best;
    plan->step_s = end->best * (double)(M + end->k - 1);
    explain(t->g, t->peers, t->o, plan);
}

fu_err dag_partition_each(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                          const dag_partition_opts *o, dag_plan *plans, size_t cap, fu_errmsg *em)
{
    FU_TRY(check_args(g, peers, n_peers, o));
    if (!plans || cap == 0)
        return FU_EINVAL;
    memset(plans, 0, cap * sizeof *plans);
    size_t *order = fu_malloc(n_peers * sizeof *order);
    ptab t = {.g = g, .peers = peers, .o = o, .order = order, .P = searched(peers, n_peers, o, order)};
    size_t max_k = o->max_stages && o->max_stages < t.P ? o->max_stages : t.P;
    if (cap < max_k)
        max_k = cap;
    ptab_cands(&t);
    const size_t m = t.m, n_masks = (size_t)1 << t.P;
    dag_partition_ws own = {0}, *ws = o->ws ? o->ws : &own;
    char *mem = ws_take(ws, search_bytes(m, t.P));
    if (!mem) {
        ptab_free(&t);
        free(order);
        return fu_errmsg_set(em, FU_ENOMEM, "the planner cannot map %.1f MiB for its search (%zu cuts, %zu peers)",
                             (double)search_bytes(m, t.P) / 1048576.0, m, t.P);
    }
    ptab_build(&t, mem);
    cell *dp = (cell *)(mem + tables_bytes(m, t.P));
    search(&t, max_k, dp);
    /* The best plan of at most k stages: the best final cell over the masks of at most k peers. */
    size_t found = 0;
    for (size_t k = 1; k <= max_k; k++) {
        size_t best_mask = 0;
        const cell *bc = NULL;
        for (size_t mask = 1; mask < n_masks; mask++) {
            const cell *c = &dp[mask * m + (m - 1)];
            if (c->best == DBL_MAX || c->k > k)
                continue;
            if (!bc || better(c->best, c->sum, c->k, bc->best, bc->sum, bc->k)) {
                bc = c;
                best_mask = mask;
            }
        }
        if (bc) {
            trace(&t, dp, best_mask, &plans[k - 1]);
            found++;
        }
    }
    fu_err rc = found ? FU_OK : no_plan(&t, n_peers, em);
    ws_unmap(&own);
    ptab_free(&t);
    free(order);
    return rc;
}

fu_err dag_partition(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                     const dag_partition_opts *o, dag_plan *plan, fu_errmsg *em)
{
    FU_TRY(check_args(g, peers, n_peers, o));
    if (!plan)
        return FU_EINVAL;
    memset(plan, 0, sizeof *plan);
    size_t P = n_peers < DAG_PARTITION_EXACT ? n_peers : DAG_PARTITION_EXACT;
    size_t k = o->max_stages && o->max_stages < P ? o->max_stages : P;
    dag_plan *each = fu_calloc(k, sizeof *each);
    fu_err rc = dag_partition_each(g, peers, n_peers, o, each, k, em);
    if (rc == FU_OK) {
        *plan = each[k - 1];
        each[k - 1] = (dag_plan){0};
    }
    for (size_t i = 0; i < k; i++)
        dag_plan_free(&each[i]);
    free(each);
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
