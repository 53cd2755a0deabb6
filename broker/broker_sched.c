/* broker_sched: planning queued jobs over the idle live peers (dag_partition), and growth. Assigning
 * and starting the planned stages is broker_assign's, the backup pool broker_backups'. Phases change only through
 * the job state machine (broker_job.c). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "dag_exec.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"

#define LOG "sched"

#define peer_idle(p) broker_peer_idle(b, (p))

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

static uint32_t backups_of(broker_t *b, const broker_job *j)
{
    uint32_t n = 0;
    for (size_t i = 0; i < b->n_peers; i++)
        if (b->peers[i].live && b->peers[i].backup && strcmp(b->peers[i].job, j->id) == 0)
            n++;
    return n;
}

/* Whether a plan of j made now keeps its ends on trusted peers: the spec says so, or it leaves it to
 * the broker and a trusted peer is registered. */
static bool ends_trusted_now(const broker_t *b, const broker_job *j)
{
    bool any_trusted = false;
    for (size_t i = 0; i < b->n_peers && !any_trusted; i++)
        any_trusted = b->peers[i].live && b->peers[i].trusted;
    return j->spec.trusted_ends == 1 || (j->spec.trusted_ends < 0 && any_trusted);
}

/* ---- the search (the planner thread runs it, for a queued job and for growth) ------------------ */

/* What a search knows of one candidate: copied from the registry on the loop, so that the planner
 * thread reads nothing the loop owns; the loop checks the chosen ones against the registry when the
 * search is back (still_fits). */
typedef struct {
    dag_peer_profile prof;             /* what the partitioner sees (profile_of) */
    bool trusted;                      /* may take an end stage */
    size_t at;                         /* its index in b->peers */
    char key[DB_KEY_LEN + 1];          /* ... and its key there */
    double gflops, link_bw, link_latency_ms; /* what the search saw of it */
    uint64_t mem_bytes;
    uint32_t n_slots;
} plan_cand;

/* What one search needs besides its candidates: the job (a copy of its header on the planner
 * thread: the graph, immutable while the job lives, kept while the search runs; its kind, spec
 * numbers and rules; no other pointer in it is followed) and the broker's numbers. */
typedef struct {
    broker_job *j;
    uint32_t backups;                  /* cfg.backups */
    double grow_margin;                /* cfg.grow_margin */
    dag_partition_ws *ws;              /* the searching thread's memory (NULL: each search maps its own) */
} plan_ctx;

static void cand_of(const broker_t *b, const broker_peer *p, plan_cand *c)
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
static fu_err partition_once(const plan_ctx *x, const plan_cand *who, size_t n, uint32_t max_stages,
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
static fu_err partition_each(const plan_ctx *x, const plan_cand *who, size_t n, uint32_t max_stages,
                             bool ends_trusted, dag_plan *plans, size_t cap, fu_errmsg *em)
{
    if (n <= BROKER_PLAN_CANDIDATES)
        return partition_once(x, who, n, max_stages, ends_trusted, plans, cap, em);
    plan_pick *pk = fu_calloc(n, sizeof *pk);
    for (size_t k = 0; k < n; k++)
        pk[k] = (plan_pick){.key = who[k].gflops + (ends_trusted && who[k].trusted ? 1e12 : 0), .at = k};
    qsort(pk, n, sizeof *pk, pick_cmp);
    plan_cand *sub = fu_calloc(BROKER_PLAN_CANDIDATES, sizeof *sub);
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
static fu_err partition_over(const plan_ctx *x, const plan_cand *who, size_t n, uint32_t max_stages,
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
static void fewest_stages(const plan_ctx *x, const plan_cand *who, size_t n, dag_plan *best)
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
static fu_err plan_over(const plan_ctx *x, const plan_cand *who, size_t n_first, size_t n_idle, size_t n_spare,
                        dag_plan *plan, size_t *n_used, fu_errmsg *em)
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
        if ((rc = partition_over(x, who, n, max, x->j->ends_trusted, plan, em)) == FU_OK) {
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
 * *n_used, as plan_over), its predicted step to *best_s, M = 1's to *one_s (0: it did not fit), the
 * count to x->j->spec.micro_batches. False (the count left 0, *plan empty) when nothing fits. */
static bool choose_micro_batches(const plan_ctx *x, const plan_cand *who, size_t n_first, size_t n_idle,
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
        if (plan_over(x, who, n_first, n_idle, n_spare, &p, &used, &em) == FU_OK) {
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

/* Env var of the test hook, FOR TESTS ONLY (compiled in with FUSION_TEST_HOOKS): the planner thread
 * sleeps this many milliseconds before each search, so a test can show that the loop answers
 * heartbeats while a search runs (tests/test_broker_jobs.c). */
#define BROKER_PLAN_DELAY_ENV "FUSION_TEST_PLAN_DELAY_MS"

/* A queued job's search on the planner thread (broker_worker.h): the loop's snapshot in, the plan
 * (or why none) out. */
typedef struct {
    broker_task base;
    broker_job *j;                     /* the loop's job (only the loop reads it; kept while this runs) */
    broker_job view;                   /* the copy the search reads (plan_ctx) */
    plan_ctx x;                        /* x.j = &view */
    plan_cand *who;                    /* the candidates: n_idle idle ones (n_first first), n_spare spares */
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
    const plan_ctx *x = &t->x;
    t->chosen = t->choose && choose_micro_batches(x, t->who, t->n_first, t->n_idle, t->n_spare, &t->plan, &t->n_used,
                                                  &t->chose_s, &t->one_s);
    if (t->choose && !t->chosen)
        t->view.spec.micro_batches = 1; /* nothing fits: plan once more for the message */
    t->rc = t->chosen ? FU_OK
                      : plan_over(x, t->who, t->n_first, t->n_idle, t->n_spare, &t->plan, &t->n_used, &t->em);
    if (t->rc == FU_OK)
        fewest_stages(x, t->who, t->n_used, &t->plan);
    t->search_s = (double)(fu_clock_ns() - t0) / 1e9;
}

/* The registry's peer for candidate c when it may still take stage work of j as the search saw it:
 * the same key at the same place, live, idle (or a spare j may take), and its profile, memory, link
 * and trust unchanged. NULL otherwise. */
static broker_peer *still_fits(broker_t *b, const broker_job *j, const plan_cand *c)
{
    if (c->at >= b->n_peers)
        return NULL;
    broker_peer *p = &b->peers[c->at];
    if (strcmp(p->key, c->key) != 0 || !p->live)
        return NULL;
    if (!((peer_idle(p) && !broker_job_excludes(j, p->key)) || lendable(b, j, p)))
        return NULL;
    if (p->gflops != c->gflops || p->mem_bytes != c->mem_bytes || p->link_bw != c->link_bw ||
        p->link_latency_ms != c->link_latency_ms || p->trusted != c->trusted || p->n_slots != c->n_slots)
        return NULL;
    return p;
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
    const plan_cand *stale = NULL;
    for (size_t s = 0; s < plan->n_stages && !stale; s++) {
        const plan_cand *c = &t->who[plan->stages[s].peer];
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
    j->ends_trusted = ends_trusted_now(b, j); /* this plan's rule, kept while it runs (broker_peer_fits) */
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
    t->x = (plan_ctx){.j = &t->view, .backups = b->cfg.backups, .grow_margin = b->cfg.grow_margin, .ws = b->plan_ws};
    t->who = fu_calloc(n_idle + n_spare, sizeof *t->who);
    for (size_t k = 0; k < n_idle + n_spare; k++)
        cand_of(b, who[k], &t->who[k]);
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

/* ---- growth (docs/PIPELINE.md "Growth") --------------------------------------------------------- */

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
    plan_ctx x;
    plan_cand *cand;                   /* the job's peers and the idle ones */
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
    t->better = partition_over(&t->x, t->cand, t->n, 0, t->ends_trusted, &t->plan, &em) == FU_OK &&
                t->plan.step_s <= (1.0 - t->x.grow_margin) * t->now_s;
    t->search_s = (double)(fu_clock_ns() - t0) / 1e9;
}

/* The registry's peer for candidate c when it may still be part of j's next plan as the search saw
 * it: the same key at the same place, live, j's own or idle (and not barred from j), its profile
 * unchanged. */
static bool grow_still_fits(broker_t *b, const broker_job *j, const plan_cand *c)
{
    if (c->at >= b->n_peers)
        return false;
    const broker_peer *p = &b->peers[c->at];
    return strcmp(p->key, c->key) == 0 && p->live &&
           (strcmp(p->job, j->id) == 0 || (peer_idle(p) && !broker_job_excludes(j, p->key))) &&
           p->gflops == c->gflops && p->mem_bytes == c->mem_bytes && p->link_bw == c->link_bw &&
           p->link_latency_ms == c->link_latency_ms && p->trusted == c->trusted && p->n_slots == c->n_slots;
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
            cand_of(b, p, &t->cand[t->n++]);
    }
    t->j = j;
    t->view = *j; /* the header, as a queued job's search reads it */
    t->x = (plan_ctx){.j = &t->view, .backups = b->cfg.backups, .grow_margin = b->cfg.grow_margin, .ws = b->plan_ws};
    t->n_new = n_new;
    t->ends_trusted = ends_trusted_now(b, j);
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

