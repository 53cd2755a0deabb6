/* broker_grow: growth (docs/PIPELINE.md "Growth"). When every stage of a running fine-tune has a
 * checkpoint and idle peers exist, a plan over its peers and the idle ones is searched on the
 * planner thread (broker_search); one that beats the current plan by the grow margin sends the job
 * back to the queue, which plans it again from that checkpoint. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "broker_search.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"

#define LOG "sched"

#define peer_idle(p) broker_peer_idle(b, (p))

/* The predicted step time of j's current plan on its current peers (the cost model's (M + S - 1) x
 * the slowest stage), 0 when a stage has no live peer. */
static double current_step_s(broker_t *b, const broker_job *j)
{
    double worst = 0;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        const broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (!p || !p->live)
            return 0;
        double t = broker_peer_stage_s(j, s, p);
        if (t > worst)
            worst = t;
    }
    return (double)(broker_job_popts(j).micro_batches + j->n_stages - 1) * worst;
}

/* Growth's search on the planner thread (after a queued job's, in the order posted): the loop's
 * snapshot in, whether a plan over the job's peers and the idle ones beats the current one by the
 * margin out. The loop then re-queues the job, which plans it again from its checkpoint. */
typedef struct {
    broker_task base;
    broker_job *j;                     /* the loop's job (kept while this runs: j->growing) */
    broker_job view;                   /* the copy the search reads */
    broker_search_ctx x;
    broker_cand *cand;                   /* the job's peers and the idle ones */
    size_t n, n_new;                   /* how many; of them idle */
    bool ends_trusted;
    int64_t step;                      /* the checkpoint it would resume from */
    double now_s;                      /* the current plan's predicted step */
    uint32_t runs;                     /* j->runs when posted: a run started since makes it stale */
    /* out */
    bool better;
    dag_plan plan;
    double search_s;
} grow_task;

static void grow_free(grow_task *t)
{
    dag_plan_free(&t->plan);
    free(t->cand);
    free(t);
}

static void grow_drop(broker_task *bt)
{
    grow_free((grow_task *)bt);
}

static void grow_run(broker_task *bt)
{
    grow_task *t = (grow_task *)bt;
    broker_task_test_delay(BROKER_PLAN_DELAY_ENV);
    uint64_t t0 = fu_clock_ns();
    fu_errmsg em = {{0}};
    t->better = broker_search_over(&t->x, t->cand, t->n, 0, t->ends_trusted, &t->plan, &em) == FU_OK &&
                t->plan.step_s <= (1.0 - t->x.grow_margin) * t->now_s;
    t->search_s = (double)(fu_clock_ns() - t0) / 1e9;
}

/* The registry's peer for candidate c when it is as the search saw it (broker_cand_peer) and may
 * still be part of j's next plan: j's own, or idle and not barred from j. */
static bool grow_still_fits(broker_t *b, const broker_job *j, const broker_cand *c)
{
    const broker_peer *p = broker_cand_peer(b, c);
    return p && (strcmp(p->job, j->id) == 0 || (peer_idle(p) && !broker_job_excludes(j, p->key)));
}

static void grow_done(broker_task *bt, void *loop)
{
    grow_task *t = (grow_task *)bt;
    broker_t *b = loop;
    broker_job *j = t->j;
    j->growing = false;
    b->n_growing--;
    if (j->dead || j->phase != BJ_RUNNING || j->runs != t->runs) {
        FU_DEBUG(LOG, "job %s: its growth search is dropped (the job %s since)", j->id,
                 j->dead ? "ended" : "started another run");
        grow_free(t);
        return;
    }
    const dag_plan *plan = &t->plan;
    if (!t->better) {
        FU_DEBUG(LOG, "job %s: with %zu idle peer%s a plan would have %zu stages and %.3g s a step against %.3g s now "
                 "(searched in %.1f ms): it stays as it is", j->id, t->n_new, t->n_new == 1 ? "" : "s",
                 plan->n_stages, plan->step_s, t->now_s, t->search_s * 1e3);
        grow_free(t);
        return;
    }
    for (size_t s = 0; s < plan->n_stages; s++)
        if (!grow_still_fits(b, j, &t->cand[plan->stages[s].peer])) {
            FU_INFO(LOG, "job %s: peer %.8s, which it would grow onto, changed while the search ran: checked again "
                    "at the next checkpoint", j->id, t->cand[plan->stages[s].peer].key);
            grow_free(t);
            return;
        }
    char reason[DB_REASON_MAX];
    if (plan->n_stages > j->n_stages)
        snprintf(reason, sizeof reason, "growing: %zu idle peer%s can join; a plan of %zu stages (now %u) predicts "
                 "%.3g s a step against %.3g s now (at least %.0f%% faster); resuming from step %" PRId64, t->n_new,
                 t->n_new == 1 ? "" : "s", plan->n_stages, j->n_stages, plan->step_s, t->now_s,
                 100 * b->cfg.grow_margin, t->step);
    else /* as many stages or fewer, on faster peers */
        snprintf(reason, sizeof reason, "moving to faster peers: with %zu idle peer%s a plan of %zu stages (now %u) "
                 "predicts %.3g s a step against %.3g s now (at least %.0f%% faster); resuming from step %" PRId64,
                 t->n_new, t->n_new == 1 ? "" : "s", plan->n_stages, j->n_stages, plan->step_s, t->now_s,
                 100 * b->cfg.grow_margin, t->step);
    FU_INFO(LOG, "job %s: %s", j->id, reason);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "grow", reason));
    broker_job_requeue(b, j, reason); /* planned again at once, its checkpoint cut for the new plan */
    b->sched_dirty = true;
    grow_free(t);
}

void broker_grow(broker_t *b, broker_job *j, int64_t step)
{
    if (b->cfg.grow_margin <= 0 || j->dead || j->phase != BJ_RUNNING || j->kind != DB_JOB_FINETUNE ||
        j->n_stages == 0 || step <= 0 || (uint64_t)step >= j->spec.steps || j->growing)
        return;
    for (uint32_t s = 0; s < j->n_stages; s++)
        if (j->stages[s].final_ckpt_step < step)
            return; /* not every stage has this checkpoint yet */
    size_t n_new = 0;
    for (size_t i = 0; i < b->n_peers; i++)
        n_new += peer_idle(&b->peers[i]) && !broker_job_excludes(j, b->peers[i].key);
    double now_s = n_new ? current_step_s(b, j) : 0;
    if (now_s <= 0)
        return; /* no idle peer to take in (the common case), or a stage without its peer */
    if (b->n_growing >= BROKER_GROWS_MAX) {
        FU_DEBUG(LOG, "job %s: %u growth searches wait already: this one is left to the next checkpoint", j->id,
                 b->n_growing);
        return;
    }
    /* the peers a new plan could use: this job's (stages and backups, released by the re-plan) and
     * the idle ones */
    grow_task *t = fu_calloc(1, sizeof *t);
    t->base = (broker_task){.run = grow_run, .done = grow_done, .drop = grow_drop};
    t->cand = fu_calloc(b->n_peers ? b->n_peers : 1, sizeof *t->cand);
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if ((p->live && strcmp(p->job, j->id) == 0) || (peer_idle(p) && !broker_job_excludes(j, p->key)))
            broker_cand_of(b, p, &t->cand[t->n++]);
    }
    t->j = j;
    t->view = *j; /* the header, as a queued job's search reads it */
    t->x = broker_search_ctx_of(b, &t->view);
    t->n_new = n_new;
    t->ends_trusted = broker_ends_trusted_now(b, j);
    t->step = step;
    t->now_s = now_s;
    t->runs = j->runs;
    j->growing = true;
    b->n_growing++;
    if (!broker_worker_post(b->planner, &t->base)) { /* cannot happen (the planner's depth): search here */
        t->x.ws = b->loop_ws;
        grow_run(&t->base);
        grow_done(&t->base, b);
    }
}

