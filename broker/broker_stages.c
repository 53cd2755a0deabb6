/* broker_stages: the messages of a running job's stages, as handlers over the job state machine
 * (broker_job.c): StageReady (every stage ready → StageStart), StepDone progress, checkpoints
 * (committed before they are acknowledged), inference tokens, a stage's error (→ failover), and the
 * finish (adapter assembled, job done in one commit). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "dag_peft.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_file.h"
#include "fu_log.h"

#define LOG "sched"

/* The job j and stage the sender claims to run, or NULL after an Error reply. */
static broker_job *stage_job(broker_t *b, broker_peer *p, const wire_msg_t *msg, uint64_t job_id, uint32_t stage,
                             bool allow_backup)
{
    broker_job *j = broker_job_find64(b, job_id);
    if (!j || strcmp(p->job, j->id) != 0 || p->stage != stage || (p->backup && !allow_backup)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "you do not hold stage %u of job %016" PRIx64 " (it was released or reassigned)", stage,
                           job_id);
        return NULL;
    }
    return j;
}

static void maybe_finish_finetune(broker_t *b, broker_job *j);

void broker_on_stage_ready(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__StageReady *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_STAGE_READY);
    broker_job *j = r ? stage_job(b, p, msg, r->job_id, r->stage_index, true) : NULL;
    if (!j)
        return;
    if (p->backup) {
        p->warm = true;
        FU_INFO(LOG, "job %s: backup %.8s is warm for stage %u", j->id, p->key, p->stage);
        return;
    }
    j->stages[r->stage_index].ready = true;
    if (j->phase != BJ_STARTING)
        return;
    for (uint32_t s = 0; s < j->n_stages; s++)
        if (!j->stages[s].ready)
            return;
    broker_job_running(b, j);
    Fusion__StageStart st = FUSION__STAGE_START__INIT;
    st.job_id = j->id64;
    st.step = j->start_step;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_peer *sp = broker_peer_find(b, j->stages[s].peer);
        if (sp && sp->live)
            (void)broker_send_peer(b, sp, FUSION__MSG_TYPE__MSG_STAGE_START, j->id64, &st.base);
    }
    broker_serve_started(b, j);
    if (j->kind == DB_JOB_FINETUNE && j->start_step >= j->spec.steps) {
        /* resumed from its last checkpoints (the broker restarted while the job finished): every
         * stage restored one committed at the last step, so the job is done; nothing runs again */
        for (uint32_t s = 0; s < j->n_stages; s++)
            j->stages[s].final_ckpt_step = (int64_t)j->spec.steps;
        maybe_finish_finetune(b, j);
    }
}

/* A step of j took dt seconds: a stage whose work needs longer than that at BROKER_PACE_FACTOR x its
 * peer's verified speed cannot have done it (the step waits for every stage). Such a stage is flagged
 * (logged, an event) and verified at every micro-batch while that peer holds it. Verification, not
 * the clock, then decides: an honest peer loses nothing. */
static void check_pace(broker_t *b, broker_job *j, double dt)
{
    double tokens = (double)j->spec.batch * j->spec.seq_len;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_jstage *st = &j->stages[s];
        broker_peer *sp = broker_peer_find(b, st->peer);
        if (!sp || sp->verified_gflops <= 0 || strcmp(st->too_fast, sp->key) == 0)
            continue;
        dag_cost c = dag_graph_cost(j->graph, st->first, st->last);
        double need = tokens * (c.flops_fwd + c.flops_bwd) / (BROKER_PACE_FACTOR * sp->verified_gflops * 1e9);
        if (dt >= need)
            continue;
        snprintf(st->too_fast, sizeof st->too_fast, "%s", sp->key);
        char text[200];
        snprintf(text, sizeof text, "stage %u reported a step in %.3f s; at %.1f GFLOP/s (verified) its work takes "
                 "%.3f s: every micro-batch of it is verified from now on", s, dt, sp->verified_gflops,
                 need * BROKER_PACE_FACTOR);
        FU_WARN(LOG, "job %s: peer %s (%.8s): %s", j->id, sp->name, sp->key, text);
        BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, sp->key, "stage-too-fast", text));
    }
}

static void finish(broker_t *b, broker_job *j, const uint8_t *result, size_t len);

/* An eval's step, reported in order since its run began: its sums added; the result after the last. */
static void eval_step(broker_t *b, broker_job *j, const wire_msg_t *msg, const Fusion__StepDone *d)
{
    uint64_t most = (uint64_t)j->spec.batch * j->spec.seq_len;
    if (d->step != j->steps_done || !isfinite(d->loss_sum) || d->loss_sum < 0 || d->targets > most) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "eval StepDone: step %" PRIu64 " (expected %" PRIu64 "), loss_sum a finite sum of losses, "
                           "at most %" PRIu64 " targets", d->step, j->steps_done, most);
        return;
    }
    j->eval_sum += d->loss_sum;
    j->eval_targets += d->targets;
    j->steps_done = d->step + 1;
    j->retries = 0;
    j->loss = j->eval_targets ? j->eval_sum / (double)j->eval_targets : NAN;
    uint64_t now = broker_now();
    double dt = (double)(now - j->last_step_ms) / 1000.0;
    j->last_step_ms = j->progress_ms = now;
    j->stepped = true;
    j->after_restart = false;
    if (db_job_progress(b->db, j->id, (int64_t)j->steps_done, (int64_t)j->spec.steps, j->loss,
                        dt > 0 ? (double)d->tokens / dt : 0, broker_wall()) != FU_OK)
        FU_WARN(LOG, "job %s: progress not stored", j->id);
    if (j->steps_done < j->spec.steps)
        return;
    if (j->eval_targets == 0) {
        broker_job_fail(b, j, "the data counted no target (every one masked)");
        return;
    }
    char res[512];
    int n = snprintf(res, sizeof res,
                     "{\"data\":\"%s\",\"targets\":%" PRIu64 ",\"loss\":%.9g,\"perplexity\":%.9g,\"adapter_job\":\"%s\"}\n",
                     j->spec.heldout > 0 ? "held-out" : "all", j->eval_targets, j->loss, exp(j->loss),
                     j->spec.adapter_job);
    FU_INFO(LOG, "job %s: eval over %" PRIu64 " targets: loss %.6f, perplexity %.4f", j->id, j->eval_targets, j->loss,
            exp(j->loss));
    finish(b, j, (const uint8_t *)res, (size_t)n);
}

void broker_on_step_done(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__StepDone *d = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_STEP_DONE);
    broker_job *j = d ? broker_job_find64(b, d->job_id) : NULL;
    if (!j || (j->kind != DB_JOB_FINETUNE && j->kind != DB_JOB_EVAL) || j->n_stages == 0 ||
        strcmp(p->job, j->id) != 0 || p->backup || p->stage != j->n_stages - 1) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "StepDone comes from the last stage of a running "
                                                                    "fine-tune or eval job only");
        return;
    }
    if (d->step >= j->spec.steps) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "step %" PRIu64 " is past the job's %" PRIu64
                           " steps", d->step, j->spec.steps);
        return;
    }
    if (j->kind == DB_JOB_EVAL) {
        eval_step(b, j, msg, d);
        return;
    }
    uint64_t now = broker_now();
    double dt = (double)(now - j->last_step_ms) / 1000.0;
    double tps = dt > 0 ? (double)d->tokens / dt : 0;
    j->last_step_ms = j->progress_ms = now;
    if (dt > j->slowest_s)
        j->slowest_s = dt;
    if (j->stepped) /* the first step of a run is timed from StageStart, not from a step */
        check_pace(b, j, dt);
    j->stepped = true;
    j->after_restart = false;
    if (d->step + 1 > j->steps_done) { /* a new step (not one replayed after a recovery) */
        b->tot.steps++;
        b->tot.step_s_sum += dt;
        b->tot.trained_tokens += d->tokens;
        j->steps_done = d->step + 1;
        j->retries = 0; /* progress */
    }
    j->loss = d->loss;
    broker_losses_add(b->losses, j->id, d->step + 1, d->loss); /* a replayed step rewinds the curve */
    fu_err rc = db_job_progress(b->db, j->id, (int64_t)j->steps_done, (int64_t)j->spec.steps,
                                isfinite(d->loss) ? d->loss : NAN, tps, broker_wall());
    if (rc != FU_OK)
        FU_WARN(LOG, "job %s: progress not stored: %s", j->id, fu_strerror(rc));
    FU_DEBUG(LOG, "job %s step %" PRIu64 " loss %.4f", j->id, d->step, d->loss);
    broker_verify_step(b, j, d->step); /* also after a rewind: the replayed step is checked again */
}

static void finish(broker_t *b, broker_job *j, const uint8_t *result, size_t len)
{
    char hash[DB_HASH_HEX_LEN + 1];
    db_hash_hex(hash, result, len);
    /* An inference job's prompt logits go to a file beside the store, written (and synced) before
     * the commit that names it, so a done job's result is whole. */
    char *logits_path = NULL;
    if (j->logits) {
        char name[64];
        snprintf(name, sizeof name, "results/%s.logits.f32", j->id);
        logits_path = fu_path_join(b->data_dir, name);
        char *dir = fu_path_join(b->data_dir, "results");
        fu_errmsg em = {{0}};
        fu_err wrc = fu_mkdir_p(dir, 0700, &em);
        if (wrc == FU_OK)
            wrc = fu_file_write_atomic(logits_path, j->logits, j->logits_len, 0600, &em);
        free(dir);
        if (wrc != FU_OK) {
            FU_ERROR(LOG, "job %s: the prompt logits could not be kept: %s", j->id, fu_errmsg_text(&em, wrc));
            free(logits_path);
            broker_job_fail(b, j, "the broker could not store the prompt logits (disk full?)");
            return;
        }
    }
    fu_err rc = broker_job_done(b, j, result, len, logits_path, hash);
    free(logits_path);
    if (rc != FU_OK) {
        FU_ERROR(LOG, "job %s: the result could not be stored: %s", j->id, fu_strerror(rc));
        broker_job_fail(b, j, "the broker could not store the result");
    }
}

/* A fine-tune's end: its adapter assembled from every stage's last checkpoint (8 of them, 6.4 MB for
 * the 80-layer model, parsed and gathered by tensor name) and committed as its result, on the writer
 * thread (on the loop it took 104-140 ms a job) while it has room, else on the loop. The job is kept
 * and left alone meanwhile (broker_job.finishing); its stages are released when it is back. */
typedef struct {
    broker_task base;
    db_t *db;                          /* the writer's connection, or the loop's */
    broker_job *j;                     /* kept while it finishes (not followed on the writer) */
    char job[DB_JOB_ID_LEN + 1];
    const dag_graph_t *graph;          /* the job's */
    uint32_t first[BROKER_MAX_STAGES], last[BROKER_MAX_STAGES], n;
    int64_t step;
    /* out */
    fu_err rc;
    bool assembled;                    /* rc is the commit's (else the assembly's) */
    fu_errmsg em;
    size_t len;
    char hash[DB_HASH_HEX_LEN + 1];
    double assemble_s, store_s;
} finish_task;

#define BROKER_FINISH_DELAY_ENV "FUSION_TEST_FINISH_DELAY_MS" /* tests: the finish sleeps this long first */

static void finish_run(broker_task *bt)
{
    finish_task *t = (finish_task *)bt;
    broker_task_test_delay(BROKER_FINISH_DELAY_ENV);
    uint64_t t0 = fu_clock_ns();
    uint8_t *blob = NULL;
    t->rc = broker_adapter_assemble_at(t->db, t->job, t->graph, t->first, t->last, t->n, t->step, &blob, &t->len,
                                       &t->em);
    uint64_t t1 = fu_clock_ns();
    t->assemble_s = (double)(t1 - t0) / 1e9;
    if (t->rc != FU_OK)
        return;
    t->assembled = true;
    db_hash_hex(t->hash, blob, t->len);
    t->rc = db_job_complete(t->db, t->job, blob, t->len, NULL, t->hash, broker_wall());
    t->store_s = (double)(fu_clock_ns() - t1) / 1e9;
    free(blob);
}

static void finish_done(broker_task *bt, void *loop)
{
    broker_t *b = loop;
    finish_task *t = (finish_task *)bt;
    broker_job *j = t->j;
    j->finishing = false;
    if (j->dead) { /* cancelled meanwhile: the store refused the result (FU_EPERM), the cancel stands */
        FU_INFO(LOG, "job %s: its adapter was assembled after it ended; not kept", j->id);
    } else if (t->rc == FU_OK) {
        FU_DEBUG(LOG, "job %s: adapter assembled in %.1f ms, committed in %.1f ms", j->id, t->assemble_s * 1e3,
                 t->store_s * 1e3);
        broker_job_ended_done(b, j, t->len, t->hash);
    } else {
        char r[DB_REASON_MAX];
        if (t->assembled)
            snprintf(r, sizeof r, "the broker could not store the result (%s)", fu_strerror(t->rc));
        else
            snprintf(r, sizeof r, "the adapter could not be assembled: %.900s", t->em.msg);
        FU_ERROR(LOG, "job %s: %s", j->id, r);
        broker_job_fail(b, j, r);
    }
    free(t);
}

static void finish_drop(broker_task *bt)
{
    free(bt);
}

static void maybe_finish_finetune(broker_t *b, broker_job *j)
{
    if (j->finishing)
        return;
    for (uint32_t s = 0; s < j->n_stages; s++)
        if (j->stages[s].final_ckpt_step != (int64_t)j->spec.steps)
            return;
    finish_task *t = fu_calloc(1, sizeof *t);
    t->base = (broker_task){.run = finish_run, .done = finish_done, .drop = finish_drop};
    t->j = j;
    snprintf(t->job, sizeof t->job, "%s", j->id);
    t->graph = j->graph;
    for (uint32_t s = 0; s < j->n_stages && s < BROKER_MAX_STAGES; s++) {
        t->first[s] = j->stages[s].first;
        t->last[s] = j->stages[s].last;
    }
    t->n = j->n_stages;
    t->step = (int64_t)j->spec.steps;
    j->finishing = true;
    FU_INFO(LOG, "job %s: every stage is done; its adapter is assembled and stored", j->id);
    t->db = b->writer_db;
    if (broker_worker_post(b->writer, &t->base))
        return;
    t->db = b->db;
    finish_run(&t->base);
    finish_done(&t->base, b);
}

/* Takes the stage that p runs off it for a fault of p's own (an error it reported, a checkpoint that
 * does not fit): reputation lost, the stage fails over. With `own` false the fault is the broker's (it
 * could not serve a blob p's assignment named): the stage fails over and p loses nothing. */
static void stage_peer_fault(broker_t *b, broker_job *j, broker_peer *p, const char *why, bool own)
{
    uint32_t s = p->stage;
    bool backup = p->backup;
    broker_peer_forget_work(p);
    if (backup || s >= j->n_stages || strcmp(j->stages[s].peer, p->key) != 0)
        return;
    if (own && !j->after_restart) /* right after a broker restart, a stage's trouble is the outage's */
        broker_peer_reputation_adjust(b, p, -BROKER_ERROR_PENALTY);
    broker_failover(b, j, s, why);
}

/* A stage's checkpoint, checked, on its way into the store: committed on the writer thread while it
 * has room (a durable write of up to megabytes per stage and step: on the loop, the checkpoints of
 * many stages kept heartbeats waiting for hundreds of milliseconds), else on the loop. Its answer
 * and what follows (progress, growth, the job's end) come once it is committed (ckpt_stored). The
 * writer runs tasks in the order posted, so a re-plan's cut, posted later, replaces it. */
typedef struct {
    broker_task base;
    db_t *db;                          /* the writer's connection, or the loop's */
    bool posted;                       /* counted in b->writer_bytes */
    char job[DB_JOB_ID_LEN + 1];
    uint64_t job64;                    /* as the peer named it */
    uint32_t stage, first, last;       /* the stage and its node range when it came */
    uint64_t step, total;
    uint8_t *blob;                     /* owned until stored */
    uint8_t hash[DB_HASH_LEN];
    int64_t keep;                      /* a step pruning keeps (a starting run's), or -1 */
    broker_ret ret;                    /* who to answer */
    fu_err rc;
} ckpt_put;

static void put_run(broker_task *bt)
{
    ckpt_put *t = (ckpt_put *)bt;
    char hex[DB_HASH_HEX_LEN + 1];
    fu_hex_encode(hex, t->hash, DB_HASH_LEN);
    t->rc = db_ckpt_put(t->db, t->job, t->stage, (int64_t)t->step, t->blob, (size_t)t->total, hex, t->keep,
                        broker_wall());
    free(t->blob);
    t->blob = NULL;
}

static void put_drop(broker_task *bt)
{
    ckpt_put *t = (ckpt_put *)bt;
    free(t->blob);
    free(t);
}

/* t's commit is back: answered; when it is still a checkpoint of the job's stage as planned now
 * (the same node range), the stage's progress, and growth or the finish. */
static void ckpt_stored(broker_t *b, const ckpt_put *t)
{
    if (t->rc == FU_EAUTH) {
        broker_answer_error(b, &t->ret, FUSION__ERROR_CODE__ERR_INVALID,
                            "checkpoint of stage %u step %" PRIu64 ": the data does not match its hash; send it again",
                            t->stage, t->step);
        return;
    }
    if (t->rc != FU_OK) {
        broker_answer_error(b, &t->ret, FUSION__ERROR_CODE__ERR_INTERNAL,
                            "checkpoint of stage %u step %" PRIu64 " not stored (%s); send it again", t->stage,
                            t->step, fu_strerror(t->rc));
        return;
    }
    Fusion__CheckpointAck ack = FUSION__CHECKPOINT_ACK__INIT;
    ack.job_id = t->job64;
    ack.stage_index = t->stage;
    ack.step = t->step;
    ack.content_hash.data = (uint8_t *)t->hash;
    ack.content_hash.len = DB_HASH_LEN;
    (void)broker_answer(b, &t->ret, FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK, &ack.base);
    broker_job *j = broker_job_find(b, t->job);
    if (!j || j->dead || t->stage >= j->n_stages || j->stages[t->stage].first != t->first ||
        j->stages[t->stage].last != t->last) {
        FU_INFO(LOG, "job %s: checkpoint of stage %u at step %" PRIu64 " committed (%" PRIu64 " bytes) after the "
                "job ended or its plan changed", t->job, t->stage, t->step, t->total);
        return;
    }
    broker_jstage *st = &j->stages[t->stage];
    if ((int64_t)t->step > st->final_ckpt_step)
        st->final_ckpt_step = (int64_t)t->step;
    j->progress_ms = broker_now(); /* the last steps' checkpoints count as progress (step deadline) */
    FU_INFO(LOG, "job %s: checkpoint of stage %u at step %" PRIu64 " committed (%" PRIu64 " bytes)", j->id, t->stage,
            t->step, t->total);
    if (t->step == j->spec.steps)
        maybe_finish_finetune(b, j);
    else
        broker_grow(b, j, (int64_t)t->step);
}

static void put_done(broker_task *bt, void *loop)
{
    broker_t *b = loop;
    ckpt_put *t = (ckpt_put *)bt;
    if (t->posted)
        b->writer_bytes -= t->total;
    ckpt_stored(b, t);
    free(t);
}

void broker_on_checkpoint(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__CheckpointPut *c = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT);
    broker_job *j = c ? stage_job(b, p, msg, c->job_id, c->stage_index, false) : NULL;
    if (!j)
        return;
    if (c->snapshot) {
        broker_verify_on_snapshot(b, p, j, msg, c);
        return;
    }
    broker_jstage *st = &j->stages[c->stage_index];
    if (c->total == 0 || c->total > BROKER_MAX_CKPT_BYTES || c->content_hash.len != DB_HASH_LEN ||
        c->step > j->spec.steps || c->offset > c->total || c->data.len > c->total - c->offset) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "CheckpointPut: bad sizes (total 1..%u bytes, a 32-byte hash, chunk inside the blob, step "
                           "at most the job's steps)", BROKER_MAX_CKPT_BYTES);
        return;
    }
    if (c->offset == 0) {
        free(st->ck_buf);
        st->ck_buf = malloc((size_t)c->total); /* a size from the network: no aborting allocator */
        if (!st->ck_buf) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                               "the broker has no memory for a %" PRIu64 "-byte checkpoint now; send it again later",
                               c->total);
            return;
        }
        st->ck_total = c->total;
        st->ck_got = 0;
        st->ck_step = c->step;
        memcpy(st->ck_hash, c->content_hash.data, DB_HASH_LEN);
    } else if (!st->ck_buf || c->offset != st->ck_got || c->total != st->ck_total || c->step != st->ck_step ||
               memcmp(st->ck_hash, c->content_hash.data, DB_HASH_LEN) != 0) {
        free(st->ck_buf);
        st->ck_buf = NULL;
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "CheckpointPut: chunk at %" PRIu64 " does not continue the checkpoint in progress; "
                           "send it again from offset 0", c->offset);
        return;
    }
    memcpy(st->ck_buf + c->offset, c->data.data, c->data.len);
    st->ck_got += c->data.len;
    if (st->ck_got < st->ck_total)
        return;
    fu_errmsg em = {{0}};
    if (broker_ckpt_check(j, c->stage_index, st->ck_buf, (size_t)st->ck_total, st->ck_step, &em) != FU_OK) {
        /* not the tensors this stage trains: a peer's fault, never stored, never assembled */
        free(st->ck_buf);
        st->ck_buf = NULL;
        char why[DB_REASON_MAX];
        snprintf(why, sizeof why, "its peer sent a checkpoint of step %" PRIu64 " that does not fit the job: %.300s",
                 c->step, em.msg);
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "checkpoint refused: %s", em.msg);
        BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, p->key, "bad-checkpoint", em.msg));
        stage_peer_fault(b, j, p, why, true);
        return;
    }
    /* A run that is starting loads its stages' checkpoints of start_step: the stages of the run
     * before (still at work after a broker restart) may bring newer ones meanwhile, which must not
     * prune those away. */
    ckpt_put *t = fu_calloc(1, sizeof *t);
    t->base = (broker_task){.run = put_run, .done = put_done, .drop = put_drop};
    snprintf(t->job, sizeof t->job, "%s", j->id);
    t->job64 = c->job_id;
    t->stage = c->stage_index;
    t->first = st->first;
    t->last = st->last;
    t->step = st->ck_step;
    t->total = st->ck_total;
    t->blob = st->ck_buf;
    st->ck_buf = NULL;
    memcpy(t->hash, st->ck_hash, DB_HASH_LEN);
    t->keep = j->phase == BJ_STARTING ? (int64_t)j->start_step : -1;
    broker_ret_of(msg, &t->ret);
    /* Committed (on the writer thread, with its own connection, while it has room), then acknowledged. */
    if (b->writer_bytes + t->total <= BROKER_WRITER_BYTES) {
        t->db = b->writer_db;
        t->posted = true;
        if (broker_worker_post(b->writer, &t->base)) {
            b->writer_bytes += t->total;
            return;
        }
    }
    t->db = b->db;
    t->posted = false;
    put_run(&t->base);
    put_done(&t->base, b);
}

void broker_on_infer_token(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__InferToken *t = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_INFER_TOKEN);
    broker_job *j = t ? broker_job_find64(b, t->job_id) : NULL;
    if (!j || j->kind != DB_JOB_INFER || j->n_stages == 0 || strcmp(p->job, j->id) != 0 || p->backup ||
        p->stage != j->n_stages - 1) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "InferToken comes from the last stage of a running inference job only");
        return;
    }
    if (j->spec.sessions || t->session) {
        if (!j->spec.sessions)
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "InferToken: job %s has no sessions", j->id);
        else
            broker_serve_on_token(b, j, msg, t);
        return;
    }
    size_t vocab = dag_graph_dims(j->graph)->vocab_size;
    uint64_t expect = j->n_tokens + j->n_gen;
    if (t->token < 0 || (size_t)t->token >= vocab || t->position > expect) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "InferToken: token %d outside the vocabulary or position %" PRIu64 " not the next (%" PRIu64
                           ")", t->token, t->position, expect);
        return;
    }
    uint64_t now = broker_now(); /* a token, even a replayed one, is progress (step deadline) */
    double gap = (double)(now - j->progress_ms) / 1000.0;
    if (j->phase == BJ_RUNNING && gap > j->slowest_s)
        j->slowest_s = gap;
    j->progress_ms = now;
    j->stepped = true;
    j->after_restart = false;
    if (t->position < expect)
        return; /* a replay after a recovery: we have it already */
    /* The first token carries the prompt's logits when the job asked for them: positions × vocab
     * float32, checked against both before they are kept. */
    if (j->spec.dump_logits && j->n_gen == 0 && t->logits.len > 0 && !j->logits) {
        if (t->logits.len != j->n_tokens * vocab * sizeof(float)) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                               "InferToken: %zu bytes of logits, expected %zu prompt positions x %zu vocabulary "
                               "x 4", t->logits.len, j->n_tokens, vocab);
            return;
        }
        j->logits = fu_malloc(t->logits.len);
        memcpy(j->logits, t->logits.data, t->logits.len);
        j->logits_len = t->logits.len;
    }
    if (j->n_gen == j->cap_gen) {
        j->cap_gen = j->cap_gen ? 2 * j->cap_gen : 64;
        j->gen = fu_realloc(j->gen, j->cap_gen * sizeof *j->gen);
    }
    j->gen[j->n_gen++] = t->token;
    b->tot.generated_tokens++;
    j->retries = 0;
    /* The text: without the end-of-sequence token, and ending before the first stop string */
    char *text = NULL;
    size_t tl = 0;
    bool ends = false;
    if (broker_gen_text(j, &j->spec, j->gen, j->n_gen, &ends, &text, &tl) != FU_OK) {
        broker_job_fail(b, j, "the generated tokens cannot be decoded");
        return;
    }
    BROKER_IGNORE(db_job_progress(b->db, j->id, (int64_t)j->n_gen, j->spec.max_tokens, NAN, 0, broker_wall()));
    if (ends) {
        finish(b, j, (const uint8_t *)text, tl);
        free(text);
        return;
    }
    wire_utf8_clean(text, tl); /* JobStatus.output is a string: bytes that are no text show as '?' */
    free(j->output);
    j->output = text;
    broker_job_wake(b, j, false); /* the long polls of its text */
    broker_token_to_first(b, j, 0, t->position, t->token);
}

/* Stage 0 of inference job j says the last stage sent it, over the ring, another token for position
 * pos than the broker's. The broker's copy is what the last stage reported and what stage 0 goes on
 * with; anything generated after pos came from the other history and is dropped. Only stage 0 of a
 * job whose ring is closed can say so, once: from then on the tokens go through the broker. */
static void on_ring_conflict(broker_t *b, broker_job *j, broker_peer *p, uint64_t pos)
{
    if (j->spec.sessions && j->n_stages >= 2 && !p->backup && p->stage == 0 &&
        strcmp(j->stages[0].peer, p->key) == 0) { /* a serving job: its sessions start again without it */
        broker_peer *last = broker_peer_find(b, j->stages[j->n_stages - 1].peer);
        if (last)
            stage_peer_fault(b, j, last, "it sent stage 0 another token than the one it reported", true);
        return;
    }
    if (j->kind != DB_JOB_INFER || j->no_ring || j->n_stages < 2 || p->backup || p->stage != 0 ||
        strcmp(j->stages[0].peer, p->key) != 0 || pos < j->n_tokens || pos >= j->n_tokens + j->n_gen)
        return;
    j->no_ring = true;
    size_t keep = (size_t)(pos - j->n_tokens) + 1;
    FU_WARN(LOG, "job %s: stage 0 (%.8s) got another token for position %" PRIu64 " from the last stage than the "
            "one reported to the broker: %zu later tokens dropped, tokens go through the broker from now on",
            j->id, p->key, pos, j->n_gen - keep);
    j->n_gen = keep;
    broker_peer *last = broker_peer_find(b, j->stages[j->n_stages - 1].peer);
    if (last)
        stage_peer_fault(b, j, last, "it sent stage 0 another token than the one it reported", true);
}

void broker_on_peer_error(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__Error *e = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_ERROR);
    uint64_t jid = wire_msg_hdr(msg)->job_id;
    FU_WARN(LOG, "peer %.8s (%s) reports: %s (job %016" PRIx64 ")", p->key, p->name,
            e && e->message ? e->message : "?", jid);
    broker_job *j = jid ? broker_job_find64(b, jid) : NULL;
    if (!j || strcmp(p->job, j->id) != 0)
        return;
    if (e && e->code == FUSION__ERROR_CODE__ERR_CONFLICT) {
        on_ring_conflict(b, j, p, wire_msg_hdr(msg)->step);
        return;
    }
    /* A stage that could not load because the broker refused it a blob its assignment named (the
     * broker's own record, broker_blobs.c; never the peer's word) is not at fault. */
    bool brokers = e && e->in_reply_to == FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST && strcmp(p->lacked, j->id) == 0;
    p->lacked[0] = '\0';
    char why[300];
    snprintf(why, sizeof why, "its peer reported an error: %s", e && e->message ? e->message : "?");
    if (brokers)
        FU_WARN(LOG, "job %s: peer %.8s (%s) could not load its stage because the broker could not serve a blob its "
                "assignment named: the broker's fault, no reputation lost", j->id, p->key, p->name);
    stage_peer_fault(b, j, p, why, !brokers);
}
