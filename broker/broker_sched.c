/* broker_sched: planning queued jobs over the idle live peers (dag_partition), assigning and
 * starting their stages (StageAssign, also for failover and recovery), the backup pool, and a
 * job's run: StageReady → StageStart, StepDone progress, checkpoints (committed before they
 * are acknowledged), inference tokens, and the finish (adapter assembled, job done in one commit). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_log.h"

#define LOG "sched"

static void set_reason(broker_t *b, broker_job *j, const char *reason)
{
    if (strcmp(j->reason, reason) == 0)
        return;
    snprintf(j->reason, sizeof j->reason, "%s", reason);
    db_job *dj = NULL;
    if (db_job_get(b->db, j->id, NULL, &dj) == FU_OK) {
        if (db_job_set_state(b->db, j->id, dj->state, reason, broker_wall()) != FU_OK)
            FU_WARN(LOG, "job %s: could not store its reason", j->id);
    }
    db_job_free(&dj);
    FU_INFO(LOG, "job %s: %s", j->id, reason);
}

/* True when p is named in the stored plan of a job a restarted broker is about to recover. */
static bool reserved(broker_t *b, const broker_peer *p)
{
    for (size_t i = 0; i < b->n_jobs; i++) {
        const broker_job *j = b->jobs[i];
        if (j->dead || j->phase != BJ_RECOVER_WAIT)
            continue;
        for (uint32_t s = 0; s < j->n_stages; s++)
            if (strcmp(j->stages[s].peer, p->key) == 0)
                return true;
    }
    return false;
}

static bool peer_free(const broker_t *b, const broker_peer *p)
{
    return broker_peer_trusted(b, p) && !p->job[0] && !p->paused;
}

#define peer_idle(p) (peer_free(b, p) && !reserved(b, (p)))

void broker_recover_ready(broker_t *b)
{
    for (size_t i = 0; i < b->n_jobs; i++) {
        broker_job *j = b->jobs[i];
        if (j->dead || j->phase != BJ_RECOVER_WAIT || j->n_stages == 0)
            continue;
        bool all = true;
        for (uint32_t s = 0; s < j->n_stages && all; s++) {
            broker_peer *p = broker_peer_find(b, j->stages[s].peer);
            all = p && peer_free(b, p);
        }
        if (all) /* every peer of the stored plan is back: no need to wait out the grace period */
            broker_recover(b, j);
    }
}

dag_partition_opts broker_job_popts(const broker_job *j)
{
    dag_partition_opts o = {.micro_batches = 1, .training = j->kind == DB_JOB_FINETUNE};
    if (j->kind == DB_JOB_FINETUNE) {
        o.micro_batches = j->spec.micro_batches;
        o.tokens_per_micro = j->spec.batch / j->spec.micro_batches * j->spec.seq_len;
    } else {
        uint64_t t = j->n_tokens + j->spec.max_tokens;
        o.tokens_per_micro = t > (1u << 20) ? (1u << 20) : (uint32_t)t;
    }
    return o;
}

bool broker_peer_fits(const broker_job *j, uint32_t s, const broker_peer *p)
{
    if (s >= j->n_stages)
        return false;
    dag_partition_opts o = broker_job_popts(j);
    return dag_cost_stage_memory(j->graph, j->stages[s].first, j->stages[s].last, &o) <= p->mem_bytes;
}

/* Stage whose peer is most likely to be lost: the one heard from longest ago. */
static uint32_t likely_loss(broker_t *b, const broker_job *j)
{
    uint32_t best = 0;
    uint64_t oldest = UINT64_MAX;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        uint64_t t = p ? p->last_heard_ms : 0;
        if (t < oldest) {
            oldest = t;
            best = s;
        }
    }
    return best;
}

static uint32_t backups_of(broker_t *b, const broker_job *j)
{
    uint32_t n = 0;
    for (size_t i = 0; i < b->n_peers; i++)
        if (b->peers[i].live && b->peers[i].backup && strcmp(b->peers[i].job, j->id) == 0)
            n++;
    return n;
}

/* Live backups of j that hold stage s. */
static uint32_t backups_for(broker_t *b, const broker_job *j, uint32_t s)
{
    uint32_t n = 0;
    for (size_t i = 0; i < b->n_peers; i++)
        if (b->peers[i].live && b->peers[i].backup && b->peers[i].stage == s && strcmp(b->peers[i].job, j->id) == 0)
            n++;
    return n;
}

/* Tops up j's warm backups from the idle peers. */
static void give_backups(broker_t *b, broker_job *j)
{
    uint32_t have = backups_of(b, j);
    for (size_t i = 0; i < b->n_peers && have < b->cfg.backups; i++) {
        broker_peer *p = &b->peers[i];
        if (!peer_idle(p) || broker_job_excludes(j, p->key))
            continue;
        uint32_t s = likely_loss(b, j);
        if (broker_job_verify_fraction(b, j) > 0) {
            /* Verification wants a warm backup of every stage (a verifier), then a second of each (a
             * third opinion): the stage with the fewest backups gets the next one (ties: the lowest
             * index). Any backup still takes over any stage on a failover (broker_failover). */
            uint32_t fewest = UINT32_MAX;
            for (uint32_t k = 0; k < j->n_stages; k++) {
                uint32_t n = backups_for(b, j, k);
                if (n < fewest && broker_peer_fits(j, k, p)) {
                    fewest = n;
                    s = k;
                }
            }
        }
        if (!broker_peer_fits(j, s, p)) { /* a backup for a stage it can hold, or none */
            uint32_t k = 0;
            while (k < j->n_stages && !broker_peer_fits(j, k, p))
                k++;
            if (k == j->n_stages)
                continue;
            s = k;
        }
        snprintf(p->job, sizeof p->job, "%s", j->id);
        p->stage = s;
        p->backup = true;
        p->warm = false;
        BROKER_IGNORE(db_peer_set_state(b->db, p->key, DB_PEER_BACKUP, broker_wall()));
        if (broker_send_assign(b, j, s, p, true) != FU_OK) {
            p->job[0] = '\0';
            p->backup = false;
            continue;
        }
        FU_INFO(LOG, "job %s: peer %.8s (%s) is a warm backup for stage %u", j->id, p->key, p->name, s);
        have++;
    }
}

static void plan_job(broker_t *b, broker_job *j)
{
    size_t n_idle = 0, n_live = 0, n_barred = 0;
    for (size_t i = 0; i < b->n_peers; i++) {
        n_live += b->peers[i].live;
        if (peer_idle(&b->peers[i])) {
            bool barred = broker_job_excludes(j, b->peers[i].key); /* it missed a deadline of this job */
            n_barred += barred;
            n_idle += !barred;
        }
    }
    char reason[DB_REASON_MAX];
    if (n_idle == 0) {
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
        set_reason(b, j, reason);
        return;
    }
    dag_peer_profile *prof = fu_calloc(n_idle, sizeof *prof);
    broker_peer **who = fu_calloc(n_idle, sizeof *who);
    size_t k = 0;
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (!peer_idle(p) || broker_job_excludes(j, p->key))
            continue;
        snprintf(prof[k].name, sizeof prof[k].name, "%.40s(%.8s)", p->name, p->key);
        prof[k].gflops = p->gflops;
        prof[k].mem_bytes = p->mem_bytes;
        prof[k].link_bw = p->link_bw;
        prof[k].link_latency_s = p->link_latency_ms / 2000.0;
        who[k++] = p;
    }
    size_t n_plan = n_idle > b->cfg.backups ? n_idle - b->cfg.backups : n_idle;
    if (n_plan > BROKER_MAX_STAGES)
        n_plan = BROKER_MAX_STAGES;
    dag_partition_opts o = broker_job_popts(j);
    o.max_stages = (uint32_t)n_plan;
    dag_plan plan = {0};
    char msg[512] = "";
    fu_err rc = dag_partition(j->graph, prof, n_idle, &o, &plan, msg, sizeof msg);
    if (rc != FU_OK) {
        snprintf(reason, sizeof reason, "waiting for peers: %s", msg[0] ? msg : fu_strerror(rc));
        set_reason(b, j, reason);
        goto done;
    }
    db_stage_plan *sp = fu_calloc(plan.n_stages, sizeof *sp);
    int64_t lease = broker_wall() + (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms;
    for (size_t s = 0; s < plan.n_stages; s++) {
        sp[s].first = (uint32_t)plan.stages[s].first;
        sp[s].end = (uint32_t)plan.stages[s].last;
        sp[s].peer = who[plan.stages[s].peer]->key;
        sp[s].lease_deadline_ms = lease;
    }
    /* The plan is durable before any assignment is sent. */
    rc = db_stage_assign(b->db, j->id, sp, plan.n_stages, broker_wall());
    free(sp);
    if (rc == FU_OK)
        rc = db_job_set_state(b->db, j->id, DB_JOB_RUNNING, "starting: stages assigned", broker_wall());
    if (rc != FU_OK) {
        FU_ERROR(LOG, "job %s: the plan could not be stored (%s); it stays queued", j->id, fu_strerror(rc));
        goto done;
    }
    snprintf(j->reason, sizeof j->reason, "starting: stages assigned");
    j->n_stages = (uint32_t)plan.n_stages;
    for (size_t s = 0; s < plan.n_stages; s++) {
        broker_peer *p = who[plan.stages[s].peer];
        j->stages[s].ready = false;
        j->stages[s].first = (uint32_t)plan.stages[s].first;
        j->stages[s].last = (uint32_t)plan.stages[s].last;
        snprintf(j->stages[s].peer, sizeof j->stages[s].peer, "%s", p->key);
        snprintf(p->job, sizeof p->job, "%s", j->id);
        p->stage = (uint32_t)s;
        p->backup = p->warm = false;
        BROKER_IGNORE(db_peer_set_state(b->db, p->key, DB_PEER_ACTIVE, broker_wall()));
        FU_INFO(LOG, "job %s stage %zu/%zu on %.8s (%s): %s", j->id, s, plan.n_stages, p->key, p->name,
                plan.stages[s].why);
    }
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "planned", plan.stages[0].why));
    int64_t c = 0;
    if (j->kind == DB_JOB_FINETUNE && db_ckpt_common_step(b->db, j->id, &c) != FU_OK)
        c = 0;
    broker_start_stages(b, j, j->kind == DB_JOB_FINETUNE ? (uint64_t)c : j->n_gen);
    give_backups(b, j);
done:
    dag_plan_free(&plan);
    free(prof);
    free(who);
}

void broker_schedule(broker_t *b)
{
    /* A plan costs up to ~0.1 s with 10+ peers: keep one pass short so heartbeats are answered,
     * and go on with the rest of the queue at the next turn of the loop. */
    uint64_t t0 = broker_now();
    size_t start = b->sched_cursor < b->n_jobs ? b->sched_cursor : 0;
    b->sched_cursor = 0;
    for (size_t k = 0; k < b->n_jobs; k++) {
        size_t i = (start + k) % b->n_jobs;
        broker_job *j = b->jobs[i];
        if (j->dead || j->phase != BJ_QUEUED)
            continue;
        if (broker_now() - t0 > BROKER_SCHED_SLICE_MS) {
            b->sched_dirty = true;
            b->sched_cursor = i; /* the next pass starts here */
            break;
        }
        plan_job(b, j);
    }
    for (size_t i = 0; i < b->n_jobs; i++) {
        broker_job *j = b->jobs[i];
        if (!j->dead && (j->phase == BJ_STARTING || j->phase == BJ_RUNNING))
            give_backups(b, j);
    }
}

void broker_peer_release(broker_t *b, broker_job *j, broker_peer *p, const char *reason)
{
    if (p->live) {
        Fusion__StageRelease r = FUSION__STAGE_RELEASE__INIT;
        r.job_id = j->id64;
        r.stage_index = p->stage;
        r.reason = (char *)reason;
        (void)broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, j->id64, &r.base);
        BROKER_IGNORE(db_peer_set_state(b->db, p->key, DB_PEER_BACKUP, broker_wall()));
    }
    p->job[0] = '\0';
    p->backup = p->warm = false;
    b->sched_dirty = true;
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

void broker_job_fail(broker_t *b, broker_job *j, const char *reason)
{
    broker_job_release(b, j, reason);
    if (db_job_set_state(b->db, j->id, DB_JOB_FAILED, reason, broker_wall()) != FU_OK)
        FU_ERROR(LOG, "job %s: could not store its failure", j->id);
    FU_WARN(LOG, "job %s failed: %s", j->id, reason);
    j->dead = true;
}

void broker_job_requeue(broker_t *b, broker_job *j, const char *reason)
{
    broker_job_release(b, j, reason);
    fu_err rc = db_job_set_state(b->db, j->id, DB_JOB_QUEUED, reason, broker_wall());
    if (rc != FU_OK)
        FU_ERROR(LOG, "job %s: could not store its return to the queue: %s", j->id, fu_strerror(rc));
    snprintf(j->reason, sizeof j->reason, "%s", reason);
    j->phase = BJ_QUEUED;
    j->n_stages = 0;
    FU_INFO(LOG, "job %s back in the queue: %s", j->id, reason);
}

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
    j->phase = BJ_RUNNING;
    j->last_step_ms = j->progress_ms = broker_now();
    if (strncmp(j->reason, "recovering: ", 12) == 0) { /* keep why it recovered in view (fusion status) */
        char note[DB_REASON_MAX];
        snprintf(note, sizeof note, "recovered: %s", j->reason + 12);
        snprintf(j->reason, sizeof j->reason, "%s", note);
    } else {
        snprintf(j->reason, sizeof j->reason, "running");
    }
    Fusion__StageStart st = FUSION__STAGE_START__INIT;
    st.job_id = j->id64;
    st.step = j->start_step;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_peer *sp = broker_peer_find(b, j->stages[s].peer);
        if (sp && sp->live)
            (void)broker_send_peer(b, sp, FUSION__MSG_TYPE__MSG_STAGE_START, j->id64, &st.base);
    }
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "started", NULL));
    FU_INFO(LOG, "job %s: every stage is ready; started at step %" PRIu64, j->id, j->start_step);
}

void broker_on_step_done(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__StepDone *d = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_STEP_DONE);
    broker_job *j = d ? broker_job_find64(b, d->job_id) : NULL;
    if (!j || j->kind != DB_JOB_FINETUNE || j->n_stages == 0 || strcmp(p->job, j->id) != 0 || p->backup ||
        p->stage != j->n_stages - 1) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "StepDone comes from the last stage of a running "
                                                                    "fine-tune job only");
        return;
    }
    if (d->step >= j->spec.steps) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "step %" PRIu64 " is past the job's %" PRIu64
                           " steps", d->step, j->spec.steps);
        return;
    }
    uint64_t now = broker_now();
    double dt = (double)(now - j->last_step_ms) / 1000.0;
    double tps = dt > 0 ? (double)d->tokens / dt : 0;
    j->last_step_ms = j->progress_ms = now;
    if (dt > j->slowest_s)
        j->slowest_s = dt;
    j->stepped = true;
    if (d->step + 1 > j->steps_done) {
        j->steps_done = d->step + 1;
        j->retries = 0; /* progress */
    }
    j->loss = d->loss;
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
    fu_err rc = db_job_complete(b->db, j->id, result, len, logits_path, hash, broker_wall());
    free(logits_path);
    if (rc != FU_OK) {
        FU_ERROR(LOG, "job %s: the result could not be stored: %s", j->id, fu_strerror(rc));
        broker_job_fail(b, j, "the broker could not store the result");
        return;
    }
    broker_job_release(b, j, "the job is done");
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "done", hash));
    FU_INFO(LOG, "job %s done: %zu bytes of result (%.16s...)", j->id, len, hash);
    j->dead = true;
}

static void maybe_finish_finetune(broker_t *b, broker_job *j)
{
    for (uint32_t s = 0; s < j->n_stages; s++)
        if (j->stages[s].final_ckpt_step != (int64_t)j->spec.steps)
            return;
    uint8_t *blob = NULL;
    size_t len = 0;
    char why[512] = "";
    if (broker_adapter_assemble(b, j, (int64_t)j->spec.steps, &blob, &len, why, sizeof why) != FU_OK) {
        char r[600];
        snprintf(r, sizeof r, "the adapter could not be assembled: %s", why);
        broker_job_fail(b, j, r);
        return;
    }
    finish(b, j, blob, len);
    free(blob);
}

void broker_on_checkpoint(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__CheckpointPut *c = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT);
    broker_job *j = c ? stage_job(b, p, msg, c->job_id, c->stage_index, false) : NULL;
    if (!j)
        return;
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
    char hex[DB_HASH_HEX_LEN + 1];
    fu_hex_encode(hex, st->ck_hash, DB_HASH_LEN);
    fu_err rc = db_ckpt_put(b->db, j->id, c->stage_index, (int64_t)st->ck_step, st->ck_buf, (size_t)st->ck_total, hex,
                            broker_wall());
    free(st->ck_buf);
    st->ck_buf = NULL;
    if (rc == FU_EAUTH) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "checkpoint of stage %u step %" PRIu64 ": the data does not match its hash; send it again",
                           c->stage_index, c->step);
        return;
    }
    if (rc != FU_OK) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL,
                           "checkpoint of stage %u step %" PRIu64 " not stored (%s); send it again", c->stage_index,
                           c->step, fu_strerror(rc));
        return;
    }
    /* Committed: only now acknowledge. */
    Fusion__CheckpointAck ack = FUSION__CHECKPOINT_ACK__INIT;
    ack.job_id = c->job_id;
    ack.stage_index = c->stage_index;
    ack.step = st->ck_step;
    ack.content_hash.data = st->ck_hash;
    ack.content_hash.len = DB_HASH_LEN;
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK, &ack.base);
    if ((int64_t)st->ck_step > st->final_ckpt_step)
        st->final_ckpt_step = (int64_t)st->ck_step;
    j->progress_ms = broker_now(); /* the last steps' checkpoints count as progress (step deadline) */
    FU_INFO(LOG, "job %s: checkpoint of stage %u at step %" PRIu64 " committed (%" PRIu64 " bytes)", j->id,
            c->stage_index, st->ck_step, st->ck_total);
    if (st->ck_step == j->spec.steps)
        maybe_finish_finetune(b, j);
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
    j->retries = 0;
    char *text = NULL;
    size_t tl = 0;
    if (fu_tokenizer_decode(j->tok, j->gen, j->n_gen, &text, &tl, NULL) == FU_OK) {
        broker_utf8_clean(text, tl); /* JobStatus.output is a string: bytes that are no text show as '?' */
        free(j->output);
        j->output = text;
    }
    BROKER_IGNORE(db_job_progress(b->db, j->id, (int64_t)j->n_gen, j->spec.max_tokens, NAN, 0, broker_wall()));
    if (j->n_gen >= j->spec.max_tokens || (j->eos >= 0 && t->token == j->eos)) {
        char *full = NULL;
        size_t fl = 0;
        if (fu_tokenizer_decode(j->tok, j->gen, j->n_gen, &full, &fl, NULL) != FU_OK) {
            broker_job_fail(b, j, "the generated tokens cannot be decoded");
            return;
        }
        finish(b, j, (const uint8_t *)full, fl);
        free(full);
        return;
    }
    broker_peer *first = broker_peer_find(b, j->stages[0].peer);
    if (!first || !first->live)
        return; /* failover is under way */
    Fusion__InferToken next = FUSION__INFER_TOKEN__INIT;
    next.job_id = j->id64;
    next.position = t->position;
    next.token = t->token;
    (void)broker_send_peer(b, first, FUSION__MSG_TYPE__MSG_INFER_TOKEN, j->id64, &next.base);
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
    uint32_t s = p->stage;
    bool backup = p->backup;
    p->job[0] = '\0';
    p->backup = p->warm = false;
    if (backup || s >= j->n_stages || strcmp(j->stages[s].peer, p->key) != 0)
        return;
    char why[300];
    snprintf(why, sizeof why, "its peer reported an error: %s", e && e->message ? e->message : "?");
    double rep = p->reputation;
    if (db_peer_reputation_adjust(b->db, p->key, -BROKER_ERROR_PENALTY, broker_wall(), &rep) == FU_OK)
        p->reputation = rep;
    broker_failover(b, j, s, why);
}

/* ---- assign and start (the normal path; failover and recovery call these too) ------------------- */

fu_err broker_send_assign(broker_t *b, broker_job *j, uint32_t s, broker_peer *p, bool backup)
{
    Fusion__StageAssign a = FUSION__STAGE_ASSIGN__INIT;
    Fusion__Neighbour nb[2];
    Fusion__Neighbour *nbp[2];
    uint8_t keys[2][WIRE_KEY_BYTES];
    size_t nn = 0;
    for (int d = -1; d <= 1; d += 2) {
        int64_t o = (int64_t)s + d;
        if (o < 0 || o >= (int64_t)j->n_stages)
            continue;
        broker_peer *q = broker_peer_find(b, j->stages[o].peer);
        fusion__neighbour__init(&nb[nn]);
        nb[nn].role = d < 0 ? FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM : FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM;
        nb[nn].stage_index = (uint32_t)o;
        if (q && wire_key_from_z85(q->key, keys[nn]) == FU_OK) {
            nb[nn].public_key.data = keys[nn];
            nb[nn].public_key.len = WIRE_KEY_BYTES;
            nb[nn].data_endpoint = q->endpoint;
            nb[nn].relay = q->relay || p->relay;
        } else {
            nb[nn].data_endpoint = (char *)"";
        }
        nbp[nn] = &nb[nn];
        nn++;
    }
    a.job_id = j->id64;
    a.stage_index = s;
    a.stage_count = j->n_stages;
    a.node_begin = j->stages[s].first;
    a.node_end = j->stages[s].last;
    a.n_neighbours = nn;
    a.neighbours = nbp;
    a.relay = p->relay;
    a.dag.data = j->dag_bytes;
    a.dag.len = j->dag_len;
    a.model_id = j->model_id;
    a.resume_step = j->start_step;
    a.backup = backup;
    a.spec_json = j->spec_canon;
    a.verify = broker_job_verify_fraction(b, j);
    return broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, j->id64, &a.base);
}

void broker_start_stages(broker_t *b, broker_job *j, uint64_t resume_step)
{
    j->start_step = resume_step;
    j->phase = BJ_STARTING;
    j->stepped = false;
    uint64_t now = broker_now();
    for (uint32_t s = 0; s < j->n_stages; s++) {
        j->stages[s].ready = false;
        j->stages[s].assigned_ms = now;
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (p && p->live)
            (void)broker_send_assign(b, j, s, p, false);
    }
}
