/* broker_job: the owner of the broker's jobs in memory: the table of unfinished jobs, and the state
 * machine of a job's phase. Every transition is a function here; each sets the phase and the reason
 * together and stores them in one commit, so the store and the loop never disagree for longer than
 * a transition (docs/BROKER.md "Job phases"). Also what a job remembers across transitions: the
 * peers taken off it. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_log.h"

#define LOG "jobs"

/* ---- the table ---------------------------------------------------------------------------------- */

broker_job *broker_job_new(db_job_kind kind)
{
    broker_job *j = fu_calloc(1, sizeof *j);
    j->kind = kind;
    j->loss = NAN;
    for (uint32_t s = 0; s < BROKER_MAX_STAGES; s++)
        j->stages[s].final_ckpt_step = -1;
    return j;
}

void broker_job_add(broker_t *b, broker_job *j)
{
    if (b->n_jobs == b->cap_jobs) {
        b->cap_jobs = b->cap_jobs ? 2 * b->cap_jobs : 16;
        b->jobs = fu_realloc(b->jobs, b->cap_jobs * sizeof *b->jobs);
    }
    b->jobs[b->n_jobs++] = j;
}

broker_job *broker_job_find(broker_t *b, const char *id)
{
    for (size_t i = 0; i < b->n_jobs; i++)
        if (!b->jobs[i]->dead && strcmp(b->jobs[i]->id, id) == 0)
            return b->jobs[i];
    return NULL;
}

broker_job *broker_job_find64(broker_t *b, uint64_t id)
{
    for (size_t i = 0; i < b->n_jobs; i++)
        if (!b->jobs[i]->dead && b->jobs[i]->id64 == id)
            return b->jobs[i];
    return NULL;
}

void broker_job_free(broker_job **j_p)
{
    if (!j_p || !*j_p)
        return;
    broker_job *j = *j_p;
    for (uint32_t s = 0; s < BROKER_MAX_STAGES; s++)
        free(j->stages[s].ck_buf);
    broker_model_release(&j->model);
    free(j->spec_json);
    free(j->spec_canon);
    dag_spec_clear(&j->spec);
    free(j->tokens);
    dag_graph_destroy(&j->graph);
    free(j->dag_bytes);
    free(j->gen);
    free(j->output);
    free(j->logits);
    fu_tokenizer_destroy(&j->tok);
    broker_serve_free(&j->serve);
    free(j);
    *j_p = NULL;
}

void broker_jobs_reap(broker_t *b)
{
    size_t w = 0;
    for (size_t i = 0; i < b->n_jobs; i++) {
        /* a search, a cut or a finish reads its graph: freed after */
        if (b->jobs[i]->dead && b->jobs[i] != b->planning && !b->jobs[i]->cutting && !b->jobs[i]->finishing &&
            !b->jobs[i]->growing) {
            broker_job *j = b->jobs[i]; /* its verification counts stay in the broker's totals */
            b->tot.v_agree += j->v_agree;
            b->tot.v_disagree += j->v_disagree;
            b->tot.v_mismatch += j->v_mismatch;
            b->tot.v_skipped += j->v_skipped;
            broker_losses_ended(b->losses, j->id); /* its loss curve stays a while (/api) */
            broker_job_wake(b, j, false);          /* its held status requests: it ended */
            broker_serve_ended(b, j, j->reason[0] ? j->reason : "the serving job ended");
            broker_job_free(&b->jobs[i]);
        }
        else
            b->jobs[w++] = b->jobs[i];
    }
    b->n_jobs = w;
}

/* ---- the state machine ---------------------------------------------------------------------------- */

const char *broker_phase_name(broker_phase p)
{
    static const char *const names[] = {"queued", "starting", "running", "recover-wait"};
    return (unsigned)p < sizeof names / sizeof names[0] ? names[p] : "?";
}

/* The phases a job may go to from each phase (a bit per target). A job leaves the table (dead) from
 * any phase: done, failed or cancelled. */
static const unsigned phase_next[] = {
    [BJ_QUEUED] = 1u << BJ_STARTING,
    [BJ_STARTING] = 1u << BJ_QUEUED | 1u << BJ_STARTING | 1u << BJ_RUNNING,
    [BJ_RUNNING] = 1u << BJ_QUEUED | 1u << BJ_STARTING,
    [BJ_RECOVER_WAIT] = 1u << BJ_QUEUED | 1u << BJ_STARTING,
};

/* Moves j to phase `to`; an unexpected move is logged (a bug in the caller), and made. */
static void enter(broker_job *j, broker_phase to)
{
    if (!(phase_next[j->phase] & 1u << to))
        FU_ERROR(LOG, "job %s: unexpected phase change %s -> %s", j->id, broker_phase_name(j->phase),
                 broker_phase_name(to));
    j->phase = to;
}

/* Stores j's state with reason (one commit); logs when the store refuses. */
static void store(broker_t *b, broker_job *j, db_job_state state, const char *reason)
{
    fu_err rc = db_job_set_state(b->db, j->id, state, reason, broker_wall());
    if (rc != FU_OK)
        FU_ERROR(LOG, "job %s: could not store its state (%s, %s): %s", j->id, db_job_state_name(state), reason,
                 fu_strerror(rc));
}

void broker_job_show(broker_job *j, const char *reason)
{
    snprintf(j->reason, sizeof j->reason, "%s", reason);
}

void broker_job_note(broker_t *b, broker_job *j, const char *reason)
{
    if (strcmp(j->reason, reason) == 0)
        return;
    broker_job_show(j, reason);
    if (!j->cutting) /* the writer stores its plan and state (running) meanwhile */
        store(b, j, j->phase == BJ_QUEUED ? DB_JOB_QUEUED : DB_JOB_RUNNING, reason);
    FU_INFO(LOG, "job %s: %s", j->id, reason);
}

void broker_job_enqueue(broker_t *b, broker_job *j)
{
    j->phase = BJ_QUEUED;
    broker_job_add(b, j);
    broker_job_show(j, "waiting for the scheduler"); /* not stored: db_job_submit stored it queued, and an
                                                       update rewrites the row with its spec, megabytes of
                                                       token ids for a large submission */
    b->sched_dirty = true;
}

void broker_job_recover_wait(broker_t *b, broker_job *j, uint64_t at_ms)
{
    j->phase = BJ_RECOVER_WAIT; /* a job just read back from the store */
    j->recover_at_ms = at_ms;
    broker_job_note(b, j, "broker restarted: waiting for its peers to reconnect");
}

fu_err broker_job_planned(broker_t *b, broker_job *j, const db_stage_plan *plan, size_t n)
{
    fu_err rc = db_stage_assign(b->db, j->id, plan, n, BROKER_PLANNED_REASON, broker_wall());
    if (rc == FU_OK)
        broker_job_plan_stored(j, plan, n);
    return rc;
}

void broker_job_plan_stored(broker_job *j, const db_stage_plan *plan, size_t n)
{
    broker_job_show(j, BROKER_PLANNED_REASON); /* stored with the plan */
    j->n_stages = (uint32_t)n;
    uint64_t now = broker_now();
    for (size_t s = 0; s < n; s++) {
        j->stages[s].first = plan[s].first;
        j->stages[s].last = plan[s].end;
        j->stages[s].ready = false;
        j->stages[s].assigned_ms = now;
        j->stages[s].final_ckpt_step = -1; /* this plan's stage has committed nothing yet */
        snprintf(j->stages[s].peer, sizeof j->stages[s].peer, "%s", plan[s].peer);
    }
}

void broker_job_starting(broker_t *b, broker_job *j, uint64_t resume_step, const char *reason)
{
    enter(j, BJ_STARTING);
    j->runs++;
    broker_verify_job_restarted(b, j);
    j->start_step = resume_step;
    j->stepped = false;
    if (j->kind == DB_JOB_EVAL) { /* a run counts every step again */
        j->eval_sum = 0;
        j->eval_targets = 0;
        j->steps_done = 0;
    }
    uint64_t now = broker_now();
    for (uint32_t s = 0; s < j->n_stages; s++) {
        j->stages[s].ready = false;
        j->stages[s].assigned_ms = now;
    }
    if (reason)
        broker_job_note(b, j, reason);
}

void broker_job_running(broker_t *b, broker_job *j)
{
    enter(j, BJ_RUNNING);
    j->last_step_ms = j->progress_ms = broker_now();
    char note[DB_REASON_MAX];
    if (strncmp(j->reason, "recovering: ", 12) == 0) /* keep why it recovered in view (fusion status) */
        snprintf(note, sizeof note, "recovered: %s", j->reason + 12);
    else
        snprintf(note, sizeof note, "running");
    broker_job_note(b, j, note);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "started", NULL));
    FU_INFO(LOG, "job %s: every stage is ready; started at step %" PRIu64, j->id, j->start_step);
}

void broker_job_release(broker_t *b, broker_job *j, const char *reason)
{
    for (size_t i = 0; i < b->n_peers; i++)
        if (strcmp(b->peers[i].job, j->id) == 0)
            broker_peer_release(b, j, &b->peers[i], reason);
    for (uint32_t s = 0; s < j->n_stages; s++) {
        j->stages[s].ready = false;
        free(j->stages[s].ck_buf);
        j->stages[s].ck_buf = NULL;
    }
    b->sched_dirty = true;
}

void broker_job_requeue(broker_t *b, broker_job *j, const char *reason)
{
    broker_job_release(b, j, reason);
    enter(j, BJ_QUEUED);
    j->n_stages = 0;
    broker_job_show(j, reason);
    store(b, j, DB_JOB_QUEUED, reason);
    FU_INFO(LOG, "job %s back in the queue: %s", j->id, reason);
}

/* A fine-tune that ended without finishing (failed, cancelled) keeps the adapter of its stages'
 * newest common checkpoint as its result, for `fusion result`; its reason says which step. */
static void keep_partial(broker_t *b, broker_job *j)
{
    int64_t step = 0;
    if (j->kind != DB_JOB_FINETUNE || j->n_stages == 0 || db_ckpt_common_step(b->db, j->id, &step) != FU_OK ||
        step <= 0)
        return;
    uint8_t *blob = NULL;
    size_t len = 0;
    fu_errmsg em = {{0}};
    if (broker_adapter_assemble(b, j, step, &blob, &len, &em) != FU_OK) {
        FU_WARN(LOG, "job %s: the adapter of its checkpoint at step %" PRId64 " cannot be kept: %s", j->id, step,
                em.msg);
        return;
    }
    char note[160];
    snprintf(note, sizeof note, "; `fusion result` gives the adapter of step %" PRId64 " of %" PRIu64
             " (its last checkpoint)", step, j->spec.steps);
    if (db_job_keep_partial(b->db, j->id, blob, len, note) == FU_OK)
        FU_INFO(LOG, "job %s: the adapter of its checkpoint at step %" PRId64 " is kept as its result", j->id, step);
    free(blob);
}

void broker_job_fail(broker_t *b, broker_job *j, const char *reason)
{
    broker_job_release(b, j, reason);
    broker_job_show(j, reason);
    store(b, j, DB_JOB_FAILED, reason);
    keep_partial(b, j);
    FU_WARN(LOG, "job %s failed: %s", j->id, reason);
    j->dead = true;
}

void broker_job_refuse(broker_t *b, const char *id, const char *reason)
{
    FU_WARN(LOG, "job %s cannot run: %s", id, reason);
    BROKER_IGNORE(db_job_set_state(b->db, id, DB_JOB_FAILED, reason, broker_wall()));
}

fu_err broker_job_done(broker_t *b, broker_job *j, const uint8_t *result, size_t len, const char *file,
                       const char *hash)
{
    fu_err rc = db_job_complete(b->db, j->id, result, len, file, hash, broker_wall());
    if (rc != FU_OK)
        return rc;
    broker_job_ended_done(b, j, len, hash);
    return FU_OK;
}

void broker_job_ended_done(broker_t *b, broker_job *j, size_t len, const char *hash)
{
    broker_job_release(b, j, "the job is done");
    broker_job_show(j, "done");
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "done", hash));
    FU_INFO(LOG, "job %s done: %zu bytes of result (%.16s...)", j->id, len, hash);
    j->dead = true;
}

fu_err broker_gen_text(const broker_job *j, const dag_spec *sp, const int32_t *gen, size_t n, bool *ends,
                       char **text, size_t *len)
{
    bool eos = false;
    for (size_t i = 0; n && i < j->n_eos && i < FU_MODELCFG_MAX_EOS; i++)
        eos = eos || gen[n - 1] == j->eos[i];
    FU_TRY(fu_tokenizer_decode(j->tok, gen, n - (eos ? 1 : 0), text, len, NULL));
    bool stopped = false;
    if (sp->n_stop) {
        size_t cut = dag_spec_stop_at(sp, *text, *len);
        stopped = cut < *len;
        *len = cut;
        (*text)[cut] = '\0';
    }
    *ends = eos || stopped || n >= sp->max_tokens;
    return FU_OK;
}

void broker_token_to_first(broker_t *b, const broker_job *j, uint32_t session, uint64_t pos, int32_t tok)
{
    broker_peer *first = broker_peer_find(b, j->stages[0].peer);
    if (!first || !first->live)
        return; /* failover is under way */
    Fusion__InferToken next = FUSION__INFER_TOKEN__INIT;
    next.job_id = j->id64;
    next.session = session;
    next.position = pos;
    next.token = tok;
    (void)broker_send_peer(b, first, FUSION__MSG_TYPE__MSG_INFER_TOKEN, j->id64, &next.base);
}

void broker_job_retire(broker_t *b, broker_job *j, const char *reason)
{
    broker_job_release(b, j, reason);
    broker_job_show(j, reason);
    store(b, j, DB_JOB_CANCELLED, reason);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "retired", reason));
    FU_INFO(LOG, "job %s cancelled by the broker: %s", j->id, reason);
    j->dead = true;
}

fu_err broker_job_cancel(broker_t *b, const char *id, const char *owner)
{
    FU_TRY(db_job_cancel(b->db, id, owner, broker_wall()));
    broker_job *j = broker_job_find(b, id);
    if (j) {
        broker_job_release(b, j, "the job was cancelled by its owner");
        broker_job_show(j, "cancelled");
        keep_partial(b, j);
        j->dead = true;
    }
    FU_INFO(LOG, "job %s cancelled by its owner", id);
    return FU_OK;
}

/* ---- what a job remembers: the peers taken off it -------------------------------------------------- */

bool broker_job_excludes(const broker_job *j, const char *key)
{
    for (uint32_t i = 0; i < j->n_excluded; i++)
        if (strcmp(j->excluded[i], key) == 0)
            return true;
    return false;
}

/* Takes key off j for good (the oldest entry makes room when the list is full). */
static void exclude_in_memory(broker_job *j, const char *key)
{
    if (broker_job_excludes(j, key))
        return;
    if (j->n_excluded == BROKER_JOB_EXCLUDE_MAX) {
        memmove(j->excluded[0], j->excluded[1], (BROKER_JOB_EXCLUDE_MAX - 1) * sizeof j->excluded[0]);
        j->n_excluded--;
    }
    snprintf(j->excluded[j->n_excluded++], sizeof j->excluded[0], "%s", key);
}

void broker_job_exclude(broker_t *b, broker_job *j, const char *key, const char *why)
{
    if (broker_job_excludes(j, key))
        return;
    exclude_in_memory(j, key);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, key, "excluded", why));
}

void broker_job_exclusions_load(broker_t *b, broker_job *j)
{
    int64_t after = 0;
    for (;;) {
        db_event *ev = NULL;
        size_t n = 0;
        if (db_event_list(b->db, j->id, after, 0, &ev, &n) != FU_OK)
            return;
        for (size_t i = 0; i < n; i++)
            if (strcmp(ev[i].kind, "excluded") == 0 && db_key_valid(ev[i].peer))
                exclude_in_memory(j, ev[i].peer);
        if (n)
            after = ev[n - 1].id;
        db_event_array_free(&ev, n);
        if (n < DB_EVENT_LIST_MAX)
            return;
    }
}

/* ---- derived from the spec ---------------------------------------------------------------------- */

double broker_job_verify_fraction(const broker_t *b, const broker_job *j)
{
    if (j->kind != DB_JOB_FINETUNE)
        return 0;
    return j->spec.verify >= 0 ? j->spec.verify : b->cfg.verify;
}

uint64_t broker_job_resume_step(const broker_job *j, int64_t ckpt)
{
    return j->kind == DB_JOB_FINETUNE ? (uint64_t)(ckpt > 0 ? ckpt : 0) : j->kind == DB_JOB_EVAL ? 0 : j->n_gen;
}

dag_partition_opts broker_job_popts(const broker_job *j)
{
    dag_partition_opts o = {.micro_batches = 1, .training = j->kind == DB_JOB_FINETUNE};
    if (j->kind == DB_JOB_FINETUNE || j->kind == DB_JOB_EVAL) { /* eval: forward only, nothing kept */
        uint32_t M = j->spec.micro_batches ? j->spec.micro_batches : 1; /* 0: not chosen yet */
        o.micro_batches = M;
        o.tokens_per_micro = j->spec.batch / M * j->spec.seq_len;
        /* what the job's wire codecs make of a value (an int8 row's scale is left out) */
        o.act_wire_bytes = (double)kern_codec_bytes(j->spec.act_codec, 1, 1024) / 1024.0;
        o.grad_wire_bytes = (double)kern_codec_bytes(j->spec.grad_codec, 1, 1024) / 1024.0;
    } else if (j->spec.sessions) { /* a serving job: one forward of a prompt and a position of every other
                                       session, and the KV cache of every session at once */
        uint64_t ctx = j->spec.context ? j->spec.context : DAG_SPEC_CONTEXT;
        o.tokens_per_micro = (uint32_t)(ctx + j->spec.sessions);
        o.kv_positions = j->spec.sessions * ctx;
    } else {
        uint64_t t = j->n_tokens + j->spec.max_tokens;
        o.tokens_per_micro = t > (1u << 20) ? (1u << 20) : (uint32_t)t;
    }
    return o;
}
