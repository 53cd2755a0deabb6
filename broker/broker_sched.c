/* broker_sched: planning queued jobs over the idle live peers (the search is broker_search's, growth
 * broker_grow's). Assigning and starting the planned stages is broker_assign's, the backup pool
 * broker_backups'. Phases change only through the job state machine (broker_job.c). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "broker_search.h"
#include "dag_exec.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"

#define LOG "sched"

#define peer_idle(p) broker_peer_idle(b, (p))

static uint32_t backups_of(broker_t *b, const broker_job *j)
{
    uint32_t n = 0;
    for (size_t i = 0; i < b->n_peers; i++)
        if (b->peers[i].live && b->peers[i].backup && strcmp(b->peers[i].job, j->id) == 0)
            n++;
    return n;
}

/* ---- a queued job's plan: candidates on the loop, the search on the planner thread --------------- */

/* The stored plan of j took its checkpoint at step c; when the new plan sp[0..n) cuts the graph
 * elsewhere, each of its stages gets that state cut for its own range (broker_ckpt_recut), stored
 * with the plan: *cut is then set to the writer's task, with the stored plan's ranges and the new
 * plan (its peers' keys copied). NULL when the stages are the same ones. An error when the stored
 * plan cannot be read (the job stays queued). */
static fu_err plan_cut(broker_t *b, const broker_job *j, int64_t c, const db_stage_plan *sp, size_t n,
                       broker_cut **cut)
{
    db_stage *old = NULL;
    size_t n_old = 0;
    *cut = NULL;
    fu_err rc = db_stage_list(b->db, j->id, &old, &n_old);
    if (rc != FU_OK)
        return rc;
    bool same = n_old == n;
    for (size_t s = 0; same && s < n; s++)
        same = old[s].first == sp[s].first && old[s].end == sp[s].end;
    if (!same && (n_old > BROKER_MAX_STAGES || n > BROKER_MAX_STAGES))
        rc = FU_EINVAL;
    if (!same && rc == FU_OK) {
        broker_cut *x = fu_calloc(1, sizeof *x);
        snprintf(x->job, sizeof x->job, "%s", j->id);
        x->graph = j->graph;
        x->step = c;
        memcpy(x->old, old, n_old * sizeof *old);
        x->n_old = n_old;
        for (size_t s = 0; s < n; s++) {
            x->plan[s] = sp[s];
            snprintf(x->keys[s], sizeof x->keys[s], "%s", sp[s].peer);
        }
        x->n = n;
        *cut = x;
    }
    db_stage_array_free(&old, n_old);
    return rc;
}

/* Whether who[0..n) holds p, or with same_key, any slot of p's peer process. */
static bool listed(broker_peer *const *who, size_t n, const broker_peer *p, bool same_key)
{
    for (size_t m = 0; m < n; m++)
        if (who[m] == p || (same_key && broker_peer_same_key(who[m], p)))
            return true;
    return false;
}

/* The idle peers j may use into who (room for all of them): one slot of each peer process first
 * (the first idle one), then their other idle slots. Returns how many come first. Only peers of
 * several slots are looked up in the list. */
static size_t candidates(broker_t *b, const broker_job *j, broker_peer **who)
{
    size_t k = 0;
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (peer_idle(p) && !broker_job_excludes(j, p->key) && (p->n_slots <= 1 || !listed(who, k, p, true)))
            who[k++] = p;
    }
    size_t n_first = k;
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (p->n_slots > 1 && peer_idle(p) && !broker_job_excludes(j, p->key) && !listed(who, n_first, p, false))
            who[k++] = p;
    }
    return n_first;
}

/* A backup of another job that j may take: spares give way to a queued job (the other job gets
 * backups again from the peers that come free, broker_give_backups), except those a job that verifies
 * keeps as its verifiers, one per stage. */
static bool lendable(broker_t *b, const broker_job *j, const broker_peer *p)
{
    if (!p->live || !p->backup || !p->job[0] || strcmp(p->job, j->id) == 0 || !broker_peer_trusted(b, p) ||
        p->paused || p->draining || broker_peer_reserved(b, p) || broker_job_excludes(j, p->key))
        return false;
    const broker_job *d = broker_job_find(b, p->job);
    if (!d)
        return true;
    uint32_t keep = broker_job_verify_fraction(b, d) > 0 ? d->n_stages : 0, total = backups_of(b, d), before = 0;
    for (const broker_peer *q = b->peers; q < p; q++) /* the first total - keep of its backups may go */
        before += q->live && q->backup && strcmp(q->job, d->id) == 0;
    return total > keep && before < total - keep;
}

static uint64_t mix(uint64_t h, const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ c[i]) * 1099511628211ull; /* FNV-1a */
    return h;
}

/* A digest of everything a plan of j over who[] depends on: each candidate's profile, trust and
 * slots in order, the counts of each kind, and the job's rules. Equal digests give equal outcomes,
 * so a job that could not be planned is not searched again (up to a full search without bounds,
 * tenths of a second for a large model) until one of them changes. Never 0. */
static uint64_t plan_inputs(const broker_job *j, broker_peer *const *who, size_t n_first, size_t n_idle,
                            size_t n_spare)
{
    uint64_t h = 14695981039346656037ull;
    size_t counts[3] = {n_first, n_idle, n_spare};
    h = mix(h, counts, sizeof counts);
    h = mix(h, &j->ends_trusted, sizeof j->ends_trusted);
    h = mix(h, &j->spec.micro_batches, sizeof j->spec.micro_batches);
    for (size_t k = 0; k < n_idle + n_spare; k++) {
        const broker_peer *p = who[k];
        h = mix(h, &p->gflops, sizeof p->gflops);
        h = mix(h, &p->mem_bytes, sizeof p->mem_bytes);
        h = mix(h, &p->link_bw, sizeof p->link_bw);
        h = mix(h, &p->link_latency_ms, sizeof p->link_latency_ms);
        h = mix(h, &p->trusted, sizeof p->trusted);
        h = mix(h, &p->n_slots, sizeof p->n_slots);
    }
    return h ? h : 1;
}

/* A queued job's search on the planner thread (broker_worker.h): the loop's snapshot in, the plan
 * (or why none) out. */
typedef struct {
    broker_task base;
    broker_job *j;                     /* the loop's job (only the loop reads it; kept while this runs) */
    broker_job view;                   /* the copy the search reads (broker_search_ctx) */
    broker_search_ctx x;                        /* x.j = &view */
    broker_cand *who;                    /* the candidates: n_idle idle ones (n_first first), n_spare spares */
    size_t n_first, n_idle, n_spare;
    bool choose;                       /* it chooses the micro-batch count */
    uint64_t inputs;                   /* plan_inputs of the snapshot (the failed-search memo) */
    double loop_s;                     /* the loop's time on it so far (the snapshot), seconds */
    /* out */
    fu_err rc;                         /* FU_OK: plan found */
    fu_errmsg em;                      /* why not */
    dag_plan plan;                     /* peers index who */
    size_t n_used;                     /* candidates the plan used */
    bool chosen;                       /* choose: a count was found (view.spec.micro_batches) */
    double chose_s, one_s;             /* choose: the predicted step with it, and with one micro-batch */
    double search_s;                   /* the search's time on the planner thread, seconds */
} plan_task;

static void plan_task_free(plan_task *t)
{
    dag_plan_free(&t->plan);
    free(t->who);
    free(t);
}

static void plan_drop(broker_task *bt)
{
    plan_task_free((plan_task *)bt);
}

/* On the planner thread: what plan_job did in the loop before, over the snapshot. */
static void plan_run(broker_task *bt)
{
    plan_task *t = (plan_task *)bt;
    broker_task_test_delay(BROKER_PLAN_DELAY_ENV);
    uint64_t t0 = fu_clock_ns();
    const broker_search_ctx *x = &t->x;
    t->chosen = t->choose && broker_search_micro_batches(x, t->who, t->n_first, t->n_idle, t->n_spare, &t->plan,
                                                         &t->n_used, &t->chose_s, &t->one_s);
    if (t->choose && !t->chosen)
        t->view.spec.micro_batches = 1; /* nothing fits: plan once more for the message */
    t->rc = t->chosen ? FU_OK
                      : broker_search_plan(x, t->who, t->n_first, t->n_idle, t->n_spare, &t->plan, &t->n_used,
                                           &t->em);
    if (t->rc == FU_OK)
        broker_search_fewest(x, t->who, t->n_used, &t->plan);
    t->search_s = (double)(fu_clock_ns() - t0) / 1e9;
}

/* The registry's peer for candidate c when it is as the search saw it (broker_cand_peer) and may
 * still take stage work of j: idle, or a spare j may take. NULL otherwise. */
static broker_peer *still_fits(broker_t *b, const broker_job *j, const broker_cand *c)
{
    broker_peer *p = broker_cand_peer(b, c);
    return p && ((peer_idle(p) && !broker_job_excludes(j, p->key)) || lendable(b, j, p)) ? p : NULL;
}

/* j's plan (t's) is stored and its peers taken: the stages start from the checkpoint of step c. */
static void plan_started(broker_t *b, broker_job *j, const plan_task *t, int64_t c)
{
    for (uint32_t s = 0; s < j->n_stages; s++) {
        const broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        FU_INFO(LOG, "job %s stage %u/%u on %.8s (%s): %s", j->id, s, j->n_stages, j->stages[s].peer,
                p ? p->name : "?", s < t->plan.n_stages ? t->plan.stages[s].why : "");
    }
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "planned", t->plan.stages[0].why));
    broker_start_stages(b, j, broker_job_resume_step(j, c), NULL);
    broker_give_backups(b, j);
}

static void plan_task_free_arg(void *t)
{
    plan_task_free(t);
}

/* The writer is back with j's plan (t's): stored with its cut checkpoint, the stages start; not
 * stored (the cut or the commit failed, the job ended or a peer it chose left meanwhile), the peers
 * it took are let go and it stays queued, saying why; stored but a peer it took is gone since, it is
 * planned again from the checkpoint just cut. */
static void plan_cut_done(broker_t *b, broker_cut *cut)
{
    plan_task *t = cut->arg;
    broker_job *j = t->j;
    j->cutting = false;
    b->sched_dirty = true;
    if (j->dead) {
        FU_INFO(LOG, "job %s ended while its checkpoint was cut for its plan (%s)", j->id,
                cut->rc == FU_OK ? "stored before it ended" : "not stored");
        plan_task_free(t);
        return;
    }
    if (cut->rc != FU_OK) {
        char reason[DB_REASON_MAX];
        if (cut->cut_failed) {
            snprintf(reason, sizeof reason, "waiting: the checkpoint at step %" PRId64 " cannot be cut for a plan of "
                     "%zu stages: %.600s", cut->step, cut->n, fu_errmsg_text(&cut->em, cut->rc));
            j->plan_failed_on = t->inputs; /* the same candidates make the same plan: not again */
        } else {
            snprintf(reason, sizeof reason, "waiting for peers: %.600s", fu_errmsg_text(&cut->em, cut->rc));
        }
        FU_WARN(LOG, "job %s: %s", j->id, reason);
        broker_job_release(b, j, "the plan could not be stored");
        broker_job_note(b, j, reason);
        plan_task_free(t);
        return;
    }
    broker_job_plan_stored(j, cut->plan, cut->n);
    b->tot.cuts++;
    b->tot.cut_s_sum += cut->cut_s + cut->store_s;
    if (cut->cut_s + cut->store_s > b->tot.cut_s_max)
        b->tot.cut_s_max = cut->cut_s + cut->store_s;
    FU_INFO(LOG, "job %s: its checkpoint at step %" PRId64 " (%zu stages) is cut again for %zu stages and stored with "
            "the plan off the loop in %.2f ms (the cut %.2f ms, the commit %.2f ms, %.2f MiB)", j->id, cut->step,
            cut->n_old, cut->n, (cut->cut_s + cut->store_s) * 1e3, cut->cut_s * 1e3, cut->store_s * 1e3,
            (double)cut->bytes / (1 << 20));
    for (uint32_t s = 0; s < j->n_stages; s++) {
        const broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (!p || !p->live || p->backup || p->stage != s || strcmp(p->job, j->id) != 0) {
            char reason[DB_REASON_MAX];
            snprintf(reason, sizeof reason, "planning again: peer %.8s, which its plan chose for stage %u, left while "
                     "its checkpoint was cut", j->stages[s].peer, s);
            broker_job_requeue(b, j, reason);
            plan_task_free(t);
            return;
        }
    }
    plan_started(b, j, t, cut->step);
    plan_task_free(t);
}

/* The search of t is back: on the loop, the plan is stored and assigned as before, unless the job
 * went meanwhile (the result is dropped) or a peer it chose changed (planned again, bounded by
 * BROKER_PLAN_STALE_MAX in a row; each search is over a fresh snapshot). */
static void plan_done(broker_task *bt, void *loop)
{
    plan_task *t = (plan_task *)bt;
    broker_t *b = loop;
    broker_job *j = t->j;
    uint64_t t0_ns = fu_clock_ns();
    b->planning = NULL;
    b->sched_dirty = true; /* the rest of the round (or a new one if something changed meanwhile) */
    b->sched_resume = !b->sched_changed;
    b->sched_changed = false;
    if (j->dead || j->phase != BJ_QUEUED) {
        FU_DEBUG(LOG, "job %s: its plan is dropped (the job is %s)", j->id,
                 j->dead ? "gone" : broker_phase_name(j->phase));
        plan_task_free(t);
        return;
    }
    char reason[DB_REASON_MAX];
    fu_err rc = t->rc;
    j->plan_failed_on = rc == FU_ENOMEM ? t->inputs : 0; /* no plan fits these candidates */
    b->tot.plans_failed += rc == FU_ENOMEM;
    if (rc != FU_OK) {
        j->plan_stale = 0;
        snprintf(reason, sizeof reason, "waiting for peers: %s", fu_errmsg_text(&t->em, rc));
        broker_job_note(b, j, reason);
        plan_task_free(t);
        return;
    }
    dag_plan *plan = &t->plan;
    broker_peer **who = fu_calloc(t->n_idle + t->n_spare, sizeof *who); /* the chosen ones, resolved */
    const broker_cand *stale = NULL;
    for (size_t s = 0; s < plan->n_stages && !stale; s++) {
        const broker_cand *c = &t->who[plan->stages[s].peer];
        if (!(who[plan->stages[s].peer] = still_fits(b, j, c)))
            stale = c;
    }
    if (stale) {
        b->tot.plans_stale++;
        bool again = ++j->plan_stale < BROKER_PLAN_STALE_MAX;
        FU_INFO(LOG, "job %s: peer %.8s, which its plan chose, changed while the plan was searched: %s", j->id,
                stale->key, again ? "it is planned again" : "planned again at the next change");
        if (again)
            j->sched_tried = 0; /* again in this round */
        else
            j->plan_stale = 0;
        free(who);
        plan_task_free(t);
        return;
    }
    j->plan_stale = 0;
    if (t->choose) {
        j->spec.micro_batches = t->view.spec.micro_batches;
        if ((rc = db_job_set_micro_batches(b->db, j->id, j->spec.micro_batches)) != FU_OK) {
            j->spec.micro_batches = 0; /* chosen again with the peers of the next try */
            snprintf(reason, sizeof reason, "waiting for peers: %s",
                     "the chosen micro-batch count could not be stored");
            broker_job_note(b, j, reason);
            goto done;
        }
        broker_job_canon(j); /* the peers get the count */
        char one[64] = "one does not fit";
        if (t->one_s > 0)
            snprintf(one, sizeof one, "%.3g s in one", t->one_s);
        FU_INFO(LOG, "job %s: %u micro-batches of %u tokens (left to the broker: predicted step %.3g s, against %s)",
                j->id, j->spec.micro_batches, j->spec.batch / j->spec.micro_batches * j->spec.seq_len, t->chose_s, one);
    }
    db_stage_plan *sp = fu_calloc(plan->n_stages, sizeof *sp);
    int64_t lease = broker_wall() + (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms;
    for (size_t s = 0; s < plan->n_stages; s++) {
        sp[s].first = (uint32_t)plan->stages[s].first;
        sp[s].end = (uint32_t)plan->stages[s].last;
        sp[s].peer = who[plan->stages[s].peer]->key;
        sp[s].lease_deadline_ms = lease;
    }
    /* A fine-tune resumes from its newest common checkpoint, cut again for this plan when its stages
     * are not the ones that took it (docs/PIPELINE.md "Re-planning"). */
    int64_t c = 0;
    if (j->kind == DB_JOB_FINETUNE && db_ckpt_common_step(b->db, j->id, &c) != FU_OK)
        c = 0;
    broker_cut *cut = NULL;
    if (c > 0 && (rc = plan_cut(b, j, c, sp, plan->n_stages, &cut)) != FU_OK) {
        FU_ERROR(LOG, "job %s: its stored plan could not be read (%s); it stays queued", j->id, fu_strerror(rc));
        free(sp);
        goto done;
    }
    for (size_t s = 0; s < plan->n_stages; s++) {
        broker_peer *p = who[plan->stages[s].peer];
        broker_job *donor = p->backup && p->job[0] ? broker_job_find(b, p->job) : NULL;
        if (donor) { /* a spare of another job gives way */
            FU_INFO(LOG, "job %s: takes peer %.8s (%s), a backup of job %s (spares give way to queued jobs)", j->id,
                    p->key, p->name, donor->id);
            broker_peer_release(b, donor, p, "a queued job needs this peer: backups give way");
        }
        broker_peer_take(b, p, j, (uint32_t)s, false);
    }
    /* The plan (and its checkpoints) and the job's move to running are one commit, made before any
     * assignment is sent: here, or by the writer when the checkpoint is cut for it. */
    if (!cut) {
        rc = broker_job_planned(b, j, sp, plan->n_stages);
        if (rc != FU_OK) {
            FU_ERROR(LOG, "job %s: the plan could not be stored (%s); it stays queued", j->id, fu_strerror(rc));
            broker_job_release(b, j, "the plan could not be stored");
        }
    }
    free(sp);
    if (rc != FU_OK)
        goto done;
    double loop_s = t->loop_s + (double)(fu_clock_ns() - t0_ns) / 1e9, plan_s = t->search_s + loop_s;
    b->tot.plans++;
    b->tot.plan_s_sum += plan_s;
    if (plan_s > b->tot.plan_s_max)
        b->tot.plan_s_max = plan_s;
    FU_INFO(LOG, "job %s planned over %zu candidates in %.2f ms (%zu stages; the search %.2f ms on the planner "
            "thread, the loop %.2f ms: the candidates, %s)", j->id, t->n_idle + t->n_spare, plan_s * 1e3,
            plan->n_stages, t->search_s * 1e3, loop_s * 1e3,
            cut ? "taking the peers; its checkpoint is cut for the new stages and stored with the plan off the loop"
                : "storing the plan");
    if (cut) {
        char note[DB_REASON_MAX];
        snprintf(note, sizeof note, "starting: its checkpoint of step %" PRId64 " is cut for the new stages", c);
        broker_job_show(j, note); /* the writer stores the plan's reason with it */
        j->cutting = true;
        cut->lease_ms = (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms;
        cut->then = plan_cut_done;
        cut->arg = t;
        cut->free_arg = plan_task_free_arg;
        free(who);
        if (!broker_cut_post(b, cut)) { /* the writer is full: here */
            cut->base.run(&cut->base);
            cut->base.done(&cut->base, b);
        }
        return; /* plan_cut_done frees t */
    }
    plan_started(b, j, t, c);
done:
    free(who);
    plan_task_free(t);
}

/* Plans queued job j: says why it waits when no peer could take it, skips the search when its
 * candidates are those of its last failed one, else posts the search to the planner thread
 * (plan_done takes it from there). True when a search was posted. */
static bool plan_job(broker_t *b, broker_job *j)
{
    uint64_t t0_ns = fu_clock_ns();
    size_t n_idle = 0, n_live = 0, n_barred = 0, n_spare = 0;
    for (size_t i = 0; i < b->n_peers; i++) {
        n_live += b->peers[i].live;
        n_spare += lendable(b, j, &b->peers[i]);
        if (peer_idle(&b->peers[i])) {
            bool barred = broker_job_excludes(j, b->peers[i].key); /* it missed a deadline of this job */
            n_barred += barred;
            n_idle += !barred;
        }
    }
    char reason[DB_REASON_MAX];
    if (n_idle + n_spare == 0) {
        const char *why_now = n_barred ? "every idle peer was taken off this job for missing a deadline"
                              : n_live ? "every live peer is busy with other jobs"
                                       : "no peer is registered";
        if (strncmp(j->reason, "waiting for peers: stage", 24) == 0) { /* keep the lost stage in view */
            const char *ctx = j->reason + 19, *end = strstr(ctx, " (now:");
            int n = (int)(end ? (size_t)(end - ctx) : strlen(ctx));
            snprintf(reason, sizeof reason, "waiting for peers: %.*s (now: %s)", n > 600 ? 600 : n, ctx, why_now);
        } else {
            snprintf(reason, sizeof reason, "waiting for peers: %s", why_now);
        }
        broker_job_note(b, j, reason);
        return false;
    }
    broker_peer **who = fu_calloc(n_idle + n_spare, sizeof *who);
    size_t n_first = candidates(b, j, who);
    for (size_t i = 0, k = n_idle; i < b->n_peers; i++)
        if (lendable(b, j, &b->peers[i]))
            who[k++] = &b->peers[i];
    j->ends_trusted = broker_ends_trusted_now(b, j); /* this plan's rule, kept while it runs (broker_peer_fits) */
    uint64_t inputs = plan_inputs(j, who, n_first, n_idle, n_spare);
    if (inputs == j->plan_failed_on) { /* nothing changed since it found no plan: its reason stands */
        b->tot.plans_skipped++;
        free(who);
        return false;
    }
    plan_task *t = fu_calloc(1, sizeof *t);
    t->base = (broker_task){.run = plan_run, .done = plan_done, .drop = plan_drop};
    t->j = j;
    t->view = *j; /* the header: graph, kind, spec numbers, rules; its other pointers are not followed */
    t->x = broker_search_ctx_of(b, &t->view);
    t->who = fu_calloc(n_idle + n_spare, sizeof *t->who);
    for (size_t k = 0; k < n_idle + n_spare; k++)
        broker_cand_of(b, who[k], &t->who[k]);
    free(who);
    t->n_first = n_first;
    t->n_idle = n_idle;
    t->n_spare = n_spare;
    t->choose = j->kind == DB_JOB_FINETUNE && j->spec.micro_batches == 0;
    t->inputs = inputs;
    t->loop_s = (double)(fu_clock_ns() - t0_ns) / 1e9;
    b->planning = j;
    if (!broker_worker_post(b->planner, &t->base)) { /* cannot happen (one at a time): search here */
        t->x.ws = b->loop_ws;
        plan_run(&t->base);
        plan_done(&t->base, b);
    }
    return true;
}

/* Fair queueing across clients: the next queued job to plan is one of the client with the fewest
 * jobs holding peers now (starting, running or recovering), the oldest of that client first; so a
 * client with many queued jobs cannot keep another's first job waiting. Returns NULL when every
 * queued job was tried in this round (its index in b->jobs otherwise). owner_of[i] indexes distinct
 * owners, busy[] counts theirs. */
static broker_job *next_fair(broker_t *b, const size_t *owner_of, const uint32_t *busy, size_t *at)
{
    broker_job *best = NULL;
    uint32_t best_busy = UINT32_MAX;
    for (size_t i = 0; i < b->n_jobs; i++) {
        broker_job *j = b->jobs[i];
        if (j->dead || j->phase != BJ_QUEUED || j->cutting || j->sched_tried == b->sched_round)
            continue;
        if (busy[owner_of[i]] < best_busy) {
            best = j;
            best_busy = busy[owner_of[i]];
            *at = i;
        }
    }
    return best;
}

void broker_schedule(broker_t *b)
{
    /* One search at a time, on the planner thread: the jobs of a round are planned in turn, each over
     * the peers the ones before it left, as if the loop planned them (the same plans). A pass asked
     * for meanwhile comes when the search is back (plan_done), as a new round. */
    if (b->planning) {
        b->sched_changed = true;
        return;
    }
    /* A pass keeps short (the snapshots, the skipped searches) so heartbeats are answered, and goes
     * on with the rest of the round at the next turn of the loop. */
    uint64_t t0 = broker_now();
    if (!b->sched_resume)
        b->sched_round++;
    b->sched_resume = false;
    size_t n = b->n_jobs, n_owners = 0;
    size_t *owner_of = fu_calloc(n ? n : 1, sizeof *owner_of), *first = fu_calloc(n ? n : 1, sizeof *first);
    uint32_t *busy = fu_calloc(n ? n : 1, sizeof *busy);
    for (size_t i = 0; i < n; i++) { /* owners are few: a linear search per job */
        size_t o = 0;
        while (o < n_owners && strcmp(b->jobs[first[o]]->owner, b->jobs[i]->owner) != 0)
            o++;
        if (o == n_owners)
            first[n_owners++] = i;
        owner_of[i] = o;
        broker_phase ph = b->jobs[i]->phase;
        if (!b->jobs[i]->dead && (ph != BJ_QUEUED || b->jobs[i]->cutting))
            busy[o]++;
    }
    broker_job *j;
    size_t at = 0;
    while ((j = next_fair(b, owner_of, busy, &at)) != NULL) {
        if (broker_now() - t0 > BROKER_SCHED_SLICE_MS) {
            b->sched_dirty = true;
            b->sched_resume = true; /* the next pass goes on with this round */
            break;
        }
        j->sched_tried = b->sched_round;
        if (plan_job(b, j) && b->planning)
            break; /* its search runs: the round goes on when it is back */
        if (j->phase != BJ_QUEUED)
            busy[owner_of[at]]++;
    }
    free(owner_of);
    free(first);
    free(busy);
    if (b->planning)
        return; /* backups after the round's plans, which may take these peers */
    for (size_t i = 0; i < b->n_jobs; i++) {
        broker_job *r = b->jobs[i];
        if (!r->dead && (r->phase == BJ_STARTING || r->phase == BJ_RUNNING))
            broker_give_backups(b, r);
    }
}
