/* broker_search: the partitioner's search over a snapshot of candidates (broker_search.h), and what
 * the partitioner knows of a peer (broker_peer_fits, broker_peer_stage_s). */
#include "broker_search.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dag_exec.h"
#include "fu_alloc.h"
#include "fu_log.h"

#define LOG "sched"

/* What the partitioner knows of p. */
static void profile_of(const broker_peer *p, dag_peer_profile *out)
{
    snprintf(out->name, sizeof out->name, "%.40s(%.8s)", p->name, p->key);
    out->gflops = p->gflops;
    out->mem_bytes = p->mem_bytes;
    out->link_bw = p->link_bw;
    out->link_latency_s = p->link_latency_ms / 2000.0;
}

bool broker_peer_fits(const broker_job *j, uint32_t s, const broker_peer *p)
{
    if (s >= j->n_stages)
        return false;
    if (j->ends_trusted && (s == 0 || s + 1 == j->n_stages) && !p->trusted)
        return false; /* an end stage (it sees tokens), or a backup of one, only on a trusted peer */
    dag_partition_opts o = broker_job_popts(j);
    return dag_cost_stage_memory(j->graph, j->stages[s].first, j->stages[s].last, &o) <= p->mem_bytes;
}

double broker_peer_stage_s(const broker_job *j, uint32_t s, const broker_peer *p)
{
    dag_partition_opts o = broker_job_popts(j);
    dag_peer_profile prof;
    profile_of(p, &prof);
    return dag_cost_stage_time(j->graph, j->stages[s].first, j->stages[s].last, &prof, &o, NULL, NULL);
}

/* Whether a plan of j made now keeps its ends on trusted peers: the spec says so, or it leaves it to
 * the broker and a trusted peer is registered. */
bool broker_ends_trusted_now(const broker_t *b, const broker_job *j)
{
    bool any_trusted = false;
    for (size_t i = 0; i < b->n_peers && !any_trusted; i++)
        any_trusted = b->peers[i].live && b->peers[i].trusted;
    return j->spec.trusted_ends == 1 || (j->spec.trusted_ends < 0 && any_trusted);
}


broker_search_ctx broker_search_ctx_of(const broker_t *b, broker_job *view)
{
    return (broker_search_ctx){.j = view, .backups = b->cfg.backups, .grow_margin = b->cfg.grow_margin,
                               .ws = b->plan_ws};
}

void broker_cand_of(const broker_t *b, const broker_peer *p, broker_cand *c)
{
    profile_of(p, &c->prof);
    c->trusted = p->trusted;
    c->at = (size_t)(p - b->peers);
    snprintf(c->key, sizeof c->key, "%s", p->key);
    c->gflops = p->gflops;
    c->link_bw = p->link_bw;
    c->link_latency_ms = p->link_latency_ms;
    c->mem_bytes = p->mem_bytes;
    c->n_slots = p->n_slots;
}

broker_peer *broker_cand_peer(broker_t *b, const broker_cand *c)
{
    if (c->at >= b->n_peers)
        return NULL;
    broker_peer *p = &b->peers[c->at];
    if (strcmp(p->key, c->key) != 0 || !p->live || p->gflops != c->gflops || p->mem_bytes != c->mem_bytes ||
        p->link_bw != c->link_bw || p->link_latency_ms != c->link_latency_ms || p->trusted != c->trusted ||
        p->n_slots != c->n_slots)
        return NULL;
    return p;
}

/* A candidate of a capped planning pass: its rank key and its index in the caller's list. */
typedef struct {
    double key;
    size_t at;
} plan_pick;

static int pick_cmp(const void *a, const void *b)
{
    const plan_pick *x = a, *y = b;
    if (x->key != y->key)
        return x->key > y->key ? -1 : 1;
    return x->at < y->at ? -1 : x->at > y->at; /* stable: the caller's order among equals */
}

/* The best plans of j over the candidates who[0..n) (dag_partition_each): plans[k - 1] the best of
 * at most k stages, for k up to cap and max_stages (0: n minus the backups the broker keeps, so that
 * the job has them), the ends on trusted peers when ends_trusted. */
static fu_err partition_once(const broker_search_ctx *x, const broker_cand *who, size_t n, uint32_t max_stages,
                             bool ends_trusted, dag_plan *plans, size_t cap, fu_errmsg *em)
{
    dag_peer_profile *prof = fu_calloc(n, sizeof *prof);
    for (size_t k = 0; k < n; k++)
        prof[k] = who[k].prof;
    size_t n_plan = max_stages ? max_stages : n > x->backups ? n - x->backups : n;
    if (n_plan > n)
        n_plan = n;
    if (n_plan > BROKER_MAX_STAGES)
        n_plan = BROKER_MAX_STAGES;
    dag_partition_opts o = broker_job_popts(x->j);
    o.max_stages = (uint32_t)n_plan;
    o.ws = x->ws;
    /* the stages that see tokens (first: the data; last: the logits) stay on trusted peers */
    bool *ends_ok = ends_trusted ? fu_calloc(n, sizeof *ends_ok) : NULL;
    for (size_t k = 0; ends_ok && k < n; k++)
        ends_ok[k] = who[k].trusted;
    o.ends_ok = ends_ok;
    fu_err rc = dag_partition_each(x->j->graph, prof, n, &o, plans, cap, em);
    free(ends_ok);
    free(prof);
    return rc;
}

/* partition_once over who[0..n), but over at most BROKER_PLAN_CANDIDATES of them: the fastest (the
 * trusted ones first when the ends must stay trusted). A plan's stages come from the fastest peers
 * anyway, and the partitioner's sort of its candidates grows with their square. The plans' peer
 * indices are into who, as without the cap. */
static fu_err partition_each(const broker_search_ctx *x, const broker_cand *who, size_t n, uint32_t max_stages,
                             bool ends_trusted, dag_plan *plans, size_t cap, fu_errmsg *em)
{
    if (n <= BROKER_PLAN_CANDIDATES)
        return partition_once(x, who, n, max_stages, ends_trusted, plans, cap, em);
    plan_pick *pk = fu_calloc(n, sizeof *pk);
    for (size_t k = 0; k < n; k++)
        pk[k] = (plan_pick){.key = who[k].gflops + (ends_trusted && who[k].trusted ? 1e12 : 0), .at = k};
    qsort(pk, n, sizeof *pk, pick_cmp);
    broker_cand *sub = fu_calloc(BROKER_PLAN_CANDIDATES, sizeof *sub);
    for (size_t k = 0; k < BROKER_PLAN_CANDIDATES; k++)
        sub[k] = who[pk[k].at];
    fu_err rc = partition_once(x, sub, BROKER_PLAN_CANDIDATES, max_stages, ends_trusted, plans, cap, em);
    for (size_t k = 0; rc == FU_OK && k < cap; k++)
        for (size_t s = 0; s < plans[k].n_stages; s++)
            plans[k].stages[s].peer = pk[plans[k].stages[s].peer].at;
    free(sub);
    free(pk);
    return rc;
}

/* The best plan of at most max_stages stages (as partition_once) into *plan. */
fu_err broker_search_over(const broker_search_ctx *x, const broker_cand *who, size_t n, uint32_t max_stages,
                          bool ends_trusted, dag_plan *plan, fu_errmsg *em)
{
    dag_plan each[DAG_PARTITION_EXACT];
    memset(plan, 0, sizeof *plan);
    fu_err rc = partition_each(x, who, n, max_stages, ends_trusted, each, DAG_PARTITION_EXACT, em);
    for (size_t k = DAG_PARTITION_EXACT; rc == FU_OK && k-- > 0;) { /* the most stages: the best */
        if (each[k].n_stages && !plan->n_stages)
            *plan = each[k];
        else
            dag_plan_free(&each[k]);
    }
    return rc;
}

/* A job takes no more stages than pay for themselves, so that the rest of the pool is left to other
 * jobs: *best (the plan over every peer it may use) gives way to the plan with the fewest stages
 * that best does not beat by cfg.grow_margin of its predicted step time. Growth applies the same
 * margin later (broker_grow), so a job does not shrink at planning what it would grow back. One
 * search gives the plans of every stage count. */
void broker_search_fewest(const broker_search_ctx *x, const broker_cand *who, size_t n, dag_plan *best)
{
    if (x->grow_margin <= 0 || best->n_stages < 2)
        return;
    dag_plan each[DAG_PARTITION_EXACT];
    if (partition_each(x, who, n, (uint32_t)best->n_stages - 1, x->j->ends_trusted, each, DAG_PARTITION_EXACT,
                       NULL) != FU_OK)
        return;
    for (size_t s = 0; s < DAG_PARTITION_EXACT; s++) {
        dag_plan *p = &each[s];
        if (p->n_stages && best->n_stages > p->n_stages && best->step_s > (1.0 - x->grow_margin) * p->step_s) {
            FU_INFO(LOG, "job %s: %zu stages predict %.3g s a step, %zu stages %.3g s: it takes %zu (more pay only "
                    "from %.0f%% shorter)", x->j->id, p->n_stages, p->step_s, best->n_stages, best->step_s,
                    p->n_stages, 100 * x->grow_margin);
            dag_plan_free(best);
            *best = *p;
            *p = (dag_plan){0};
            break;
        }
    }
    for (size_t s = 0; s < DAG_PARTITION_EXACT; s++)
        dag_plan_free(&each[s]);
}

/* The plan of j over who[0..n_idle) (idle peers, the first n_first of distinct processes) and then
 * the n_spare spares after them, the first of these that works: distinct processes first (two slots
 * of one machine serve two jobs rather than one), then every idle peer, each leaving room for the
 * job's backups; then every idle peer with no room left for backups; then the spares too.
 * *n_used: the candidates it used. */
fu_err broker_search_plan(const broker_search_ctx *x, const broker_cand *who, size_t n_first, size_t n_idle,
                          size_t n_spare, dag_plan *plan, size_t *n_used, fu_errmsg *em)
{
    const struct {
        size_t n;
        bool all; /* no room kept for backups */
    } tries[4] = {{n_first < n_idle ? n_first : 0, false}, {n_idle, false}, {n_idle, true}, {n_spare ? n_idle + n_spare : 0, true}};
    fu_err rc = FU_EINVAL;
    for (int t = 0; t < 4; t++) {
        size_t n = tries[t].n;
        if (n == 0 || (t == 2 && x->backups == 0)) /* the same as the try before */
            continue;
        dag_plan_free(plan);
        uint32_t max = tries[t].all ? (uint32_t)(n < BROKER_MAX_STAGES ? n : BROKER_MAX_STAGES) : 0;
        if ((rc = broker_search_over(x, who, n, max, x->j->ends_trusted, plan, em)) == FU_OK) {
            *n_used = n;
            return FU_OK;
        }
    }
    return rc;
}

/* Least tokens in a micro-batch the broker splits a step into when the spec leaves the count to it. */
#define BROKER_MICRO_MIN_TOKENS 32

/* A fine-tune whose spec leaves its micro-batch count to the broker (0) gets the divisor M of its
 * batch whose plan over these peers predicts the shortest step (dag_plan_pipeline_time: over slow
 * links more micro-batches hide the latency, each costs a little), no micro-batch under
 * BROKER_MICRO_MIN_TOKENS tokens, a larger M only when it is 2% faster. That plan goes to *plan (and
 * *n_used, as broker_search_plan), its predicted step to *best_s, M = 1's to *one_s (0: it did not fit), the
 * count to x->j->spec.micro_batches. False (the count left 0, *plan empty) when nothing fits. */
bool broker_search_micro_batches(const broker_search_ctx *x, const broker_cand *who, size_t n_first, size_t n_idle,
                                 size_t n_spare, dag_plan *plan, size_t *n_used, double *best_s, double *one_s)
{
    broker_job *j = x->j;
    uint32_t best = 0, B = j->spec.batch;
    *best_s = *one_s = 0;
    for (uint32_t m = 1; m <= B && m <= DAG_EXEC_MAX_SLOTS; m++) {
        if (B % m != 0)
            continue;
        if (m > 1 && (uint64_t)(B / m) * j->spec.seq_len < BROKER_MICRO_MIN_TOKENS)
            break;
        j->spec.micro_batches = m;
        dag_plan p = {0};
        size_t used = 0;
        fu_errmsg em = {{0}};
        if (broker_search_plan(x, who, n_first, n_idle, n_spare, &p, &used, &em) == FU_OK) {
            double t = dag_plan_pipeline_time(&p, m);
            if (m == 1)
                *one_s = t;
            if (!best || t < 0.98 * *best_s) {
                best = m;
                *best_s = t;
                *n_used = used;
                dag_plan_free(plan);
                *plan = p;
                continue;
            }
        }
        dag_plan_free(&p);
    }
    j->spec.micro_batches = best;
    return best != 0;
}
