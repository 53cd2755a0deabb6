/* broker_jobs: the client API (submit, status, list, cancel, result download), and making a job
 * from its stored row (its spec, tokens, graph and model) for the job table (broker_job.c). A job is
 * acknowledged only after db_job_submit committed; the client's
 * identity is the ZAP User-Id of its connection, and another owner's job is "not found". */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "broker_internal.h"
#include "dag_peft.h"
#include "dag_model.h"
#include "dag_serial.h"
#include "dag_spec.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_file.h"
#include "fu_log.h"
#include "fu_modelcfg.h"

#define LOG "jobs"
#define BROKER_LIST_MAX 1000 /* JobList.jobs cap (fusion.proto) */

/* ---------- the job table ---------- */

static void id_hex(uint64_t id, char out[DB_JOB_ID_LEN + 1])
{
    snprintf(out, DB_JOB_ID_LEN + 1, "%016" PRIx64, id);
}

/* The stored row's part of j: its ids, owner, spec text and tokens (the spec is parsed by the
 * caller). FU_EPROTO when the stored form is malformed. */
static fu_err job_row(broker_job *j, const char *id, const char *owner, const uint8_t *spec, size_t spec_len,
                      fu_errmsg *em)
{
    snprintf(j->id, sizeof j->id, "%s", id);
    j->id64 = strtoull(id, NULL, 16);
    snprintf(j->owner, sizeof j->owner, "%s", owner);
    size_t sl = spec ? strnlen((const char *)spec, spec_len) : 0;
    if (!spec || sl == spec_len || (spec_len - sl - 1) % sizeof(int32_t) != 0) {
        return fu_errmsg_set(em, FU_EPROTO, "stored spec is malformed");
    }
    free(j->spec_json);
    j->spec_json = fu_malloc(sl + 1);
    memcpy(j->spec_json, spec, sl + 1);
    free(j->tokens);
    j->n_tokens = (spec_len - sl - 1) / sizeof(int32_t);
    j->tokens = fu_malloc((j->n_tokens ? j->n_tokens : 1) * sizeof *j->tokens);
    memcpy(j->tokens, spec + sl + 1, j->n_tokens * sizeof *j->tokens);
    crypto_generichash(j->tokens_hash, sizeof j->tokens_hash, (const uint8_t *)j->tokens,
                       j->n_tokens * sizeof *j->tokens, NULL, 0);
    return FU_OK;
}

fu_err broker_job_load(broker_t *b, const db_job *dj, broker_job **out, fu_errmsg *em)
{
    broker_job *j = broker_job_new(dj->kind);
    fu_err rc = job_row(j, dj->id, dj->owner, dj->spec, dj->spec_len, em);
    if (rc != FU_OK)
        goto fail;
    if ((rc = broker_spec_parse(j->spec_json, strlen(j->spec_json), dj->kind, &j->spec, em)) != FU_OK)
        goto fail;
    db_job *aj = NULL;
    if ((dj->kind == DB_JOB_INFER || dj->kind == DB_JOB_EVAL) && j->spec.adapter_job[0] &&
        (rc = db_job_get(b->db, j->spec.adapter_job, NULL, &aj)) != FU_OK) {
        fu_errmsg_set(em, rc, "adapter_job %s is not in the store", j->spec.adapter_job);
        goto fail;
    }
    rc = broker_job_prepare(b->models, j, aj ? (const char *)aj->spec : NULL, em);
    if (rc == FU_OK && aj)
        rc = broker_adapter_model_check(j, aj->model_id, em);
    db_job_free(&aj);
    if (rc != FU_OK)
        goto fail;
    if (dj->model_id[0] && strcmp(dj->model_id, j->model->id) != 0) { /* pinned at submit */
        rc = fu_errmsg_set(em, FU_EPROTO,
                           "its model '%s' changed since it was submitted (it was %.18s..., it is now %.18s...): "
                           "submit it again to train on the model as it is now",
                           j->spec.model, dj->model_id, j->model->id);
        goto fail;
    }
    if (j->kind == DB_JOB_FINETUNE && j->spec.micro_batches == 0 && dj->micro_batches &&
        j->spec.batch % dj->micro_batches == 0) { /* the count this broker chose before its restart */
        j->spec.micro_batches = dj->micro_batches;
        broker_job_canon(j);
    }
    broker_job_exclusions_load(b, j);
    j->steps_done = dj->step > 0 ? (uint64_t)dj->step : 0;
    j->loss = dj->loss;
    broker_job_show(j, dj->reason ? dj->reason : "");
    /* The stored plan (a restarted broker recovers a running job from it). */
    db_stage *st = NULL;
    size_t n = 0;
    if (db_stage_list(b->db, j->id, &st, &n) == FU_OK && n <= BROKER_MAX_STAGES) {
        j->n_stages = (uint32_t)n;
        for (size_t s = 0; s < n; s++) {
            j->stages[s].first = st[s].first;
            j->stages[s].last = st[s].end;
            snprintf(j->stages[s].peer, sizeof j->stages[s].peer, "%s", st[s].peer);
        }
    }
    db_stage_array_free(&st, n);
    if (dj->state == DB_JOB_QUEUED)
        j->n_stages = 0; /* planned afresh */
    broker_job_add(b, j);
    *out = j;
    return FU_OK;
fail:
    broker_job_free(&j);
    return rc == FU_OK ? FU_EPROTO : rc;
}

/* ---------- status ---------- */

static Fusion__JobState wire_state(db_job_state s)
{
    switch (s) {
    case DB_JOB_QUEUED: return FUSION__JOB_STATE__JOB_STATE_QUEUED;
    case DB_JOB_RUNNING: return FUSION__JOB_STATE__JOB_STATE_RUNNING;
    case DB_JOB_DONE: return FUSION__JOB_STATE__JOB_STATE_DONE;
    case DB_JOB_FAILED: return FUSION__JOB_STATE__JOB_STATE_FAILED;
    case DB_JOB_CANCELLED: return FUSION__JOB_STATE__JOB_STATE_CANCELED;
    }
    return FUSION__JOB_STATE__JOB_STATE_UNSPECIFIED;
}

/* Fills st from the stored job and, when it is in memory, the live details. Strings point into
 * dj, j or buf (msg_buf of cap bytes). */
static void fill_status(broker_t *b, const db_job *dj, Fusion__JobStatus *st, char *msg_buf, size_t cap)
{
    fusion__job_status__init(st);
    broker_job *j = broker_job_find(b, dj->id);
    st->job_id = strtoull(dj->id, NULL, 16);
    st->kind = dj->kind == DB_JOB_FINETUNE ? FUSION__JOB_KIND__JOB_KIND_FINETUNE
               : dj->kind == DB_JOB_EVAL   ? FUSION__JOB_KIND__JOB_KIND_EVAL
                                           : FUSION__JOB_KIND__JOB_KIND_INFER;
    st->state = wire_state(dj->state);
    st->step = dj->step > 0 ? (uint64_t)dj->step : 0;
    st->total_steps = dj->total_steps > 0 ? (uint64_t)dj->total_steps : 0;
    st->loss = dj->loss;
    st->created_ms = dj->created_ms;
    st->updated_ms = dj->updated_ms;
    st->idempotency_key = dj->idem_key ? dj->idem_key : (char *)"";
    st->output = (char *)"";
    st->tokens_per_s = dj->tokens_per_s;
    st->micro_batches = dj->micro_batches;
    st->model_id = (char *)dj->model_id;
    st->verify = j ? broker_job_verify_fraction(b, j) : -1;
    if (j) {
        if (j->kind != DB_JOB_INFER)
            st->micro_batches = j->spec.micro_batches;
        st->stages = j->n_stages;
        if (j->kind == DB_JOB_INFER && j->output)
            st->output = j->output;
        if (!st->total_steps)
            st->total_steps = j->kind == DB_JOB_INFER ? j->spec.max_tokens : j->spec.steps;
    }
    const char *reason = j && j->reason[0] ? j->reason : dj->reason;
    if (reason && strcmp(reason, "running") == 0)
        reason = NULL;
    if (dj->state == DB_JOB_RUNNING && j && j->phase == BJ_RUNNING && j->kind != DB_JOB_INFER) {
        char ver[160] = "";
        if (broker_job_verify_fraction(b, j) > 0)
            snprintf(ver, sizeof ver, "; verified samples: %u agreed, %u disagreed, %u input mismatches, %u skipped",
                     j->v_agree, j->v_disagree, j->v_mismatch, j->v_skipped);
        snprintf(msg_buf, cap, "running on %u stage%s, %u micro-batch%s a step: step %" PRIu64 "/%" PRIu64 "%s%s%s",
                 j->n_stages, j->n_stages == 1 ? "" : "s", j->spec.micro_batches, j->spec.micro_batches == 1 ? "" : "es",
                 j->steps_done, j->spec.steps, ver, reason && reason[0] ? "; " : "", reason ? reason : "");
    } else
        snprintf(msg_buf, cap, "%s", reason ? reason : "");
    broker_utf8_trim(msg_buf);
    st->message = msg_buf;
}

static void answer_status(broker_t *b, const broker_ret *r, const db_job *dj)
{
    char buf[DB_REASON_MAX + 128];
    Fusion__JobStatus st;
    fill_status(b, dj, &st, buf, sizeof buf);
    /* each stage and its peer, while the job runs */
    broker_job *j = broker_job_find(b, dj->id);
    Fusion__JobStage stg[BROKER_MAX_STAGES], *stp[BROKER_MAX_STAGES];
    char layers[BROKER_MAX_STAGES][48];
    uint32_t ns = j && j->phase != BJ_QUEUED ? j->n_stages : 0;
    for (uint32_t s = 0; s < ns; s++) {
        fusion__job_stage__init(&stg[s]);
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        stg[s].index = s;
        stg[s].peer_id = j->stages[s].peer;
        stg[s].peer_name = p ? p->name : (char *)"";
        stg[s].node_begin = j->stages[s].first;
        stg[s].node_end = j->stages[s].last;
        dag_graph_range_label(j->graph, j->stages[s].first, j->stages[s].last, layers[s], sizeof layers[s]);
        stg[s].layers = layers[s];
        stp[s] = &stg[s];
    }
    st.n_stage_info = ns;
    st.stage_info = stp;
    char *out = NULL;
    db_job *full = NULL; /* a brief row has no result: a finished inference job's text is read now */
    const bool text = dj->kind == DB_JOB_INFER || dj->kind == DB_JOB_EVAL; /* the result is text */
    if (text && dj->state == DB_JOB_DONE && !dj->result && dj->result_len &&
        db_job_get(b->db, dj->id, NULL, &full) == FU_OK)
        dj = full;
    if (text && dj->state == DB_JOB_DONE && dj->result) {
        size_t n = dj->result_len < (WIRE_MAX_CONTROL_BYTES / 2) ? dj->result_len : WIRE_MAX_CONTROL_BYTES / 2;
        out = fu_malloc(n + 1);
        memcpy(out, dj->result, n);
        out[n] = 0;
        wire_utf8_clean(out, n);
        st.output = out;
    }
    (void)broker_answer(b, r, FUSION__MSG_TYPE__MSG_JOB_STATUS, &st.base);
    free(out);
    db_job_free(&full);
}

static void reply_status(broker_t *b, const wire_msg_t *msg, const db_job *dj)
{
    broker_ret r;
    broker_ret_of(msg, &r);
    answer_status(b, &r, dj);
}

/* Looks up the job named by a JobRef of the sender; answers Error when it cannot. */
/* blobs: with the spec and result (a download); without, what a status needs. */
static db_job *own_job(broker_t *b, const wire_msg_t *msg, uint64_t id64, bool blobs)
{
    char id[DB_JOB_ID_LEN + 1];
    id_hex(id64, id);
    db_job *dj = NULL;
    fu_err rc = blobs ? db_job_get(b->db, id, wire_msg_user_id(msg), &dj)
                      : db_job_get_brief(b->db, id, wire_msg_user_id(msg), &dj);
    if (rc == FU_ENOTFOUND)
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "no job %s among your jobs (list them with `fusion status`)", id);
    else if (rc != FU_OK)
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker's store failed (%s); try again",
                           fu_strerror(rc));
    return rc == FU_OK ? dj : NULL;
}

/* ---------- handlers ---------- */

/* A client's limits (docs/SECURITY.md "Isolation and quotas"): unfinished jobs and bytes in the
 * store, then submissions per minute and preparations in flight (charged when it passes; the caller
 * gives the preparation back with broker_quota_done). False: refused with the limit named. */
static bool within_quota(broker_t *b, const wire_msg_t *msg, const Fusion__JobSubmit *js)
{
    const char *owner = wire_msg_user_id(msg);
    int64_t unfinished = 0, bytes = 0;
    if (db_owner_usage(b->db, owner, &unfinished, &bytes) != FU_OK) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker's store failed; try again");
        return false;
    }
    if (unfinished >= (int64_t)b->cfg.client_jobs) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                           "you have %lld unfinished jobs, the most this broker takes from one client: wait for one "
                           "to finish or cancel one (`fusion cancel ID`)", (long long)unfinished);
        return false;
    }
    /* a token is at most 4 bytes per byte of text (byte-level), and the spec is stored too */
    int64_t adds = 4 * (int64_t)js->data.len + (js->spec_json ? (int64_t)strlen(js->spec_json) : 0);
    if (bytes + adds > (int64_t)b->cfg.client_mib << 20) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_TOO_LARGE,
                           "your jobs hold %.1f MiB in the broker's store and this one may add %.1f MiB: at most %u "
                           "MiB per client (download your results and ask the operator to prune, or send less data)",
                           (double)bytes / (1 << 20), (double)adds / (1 << 20), b->cfg.client_mib);
        return false;
    }
    uint32_t retry = 0;
    if (!broker_quota_take(b->quota, owner, broker_now(), &retry)) {
        if (retry)
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                               "you submitted %u jobs in the last minute, the most this broker takes: submit again in "
                               "%u s", b->cfg.client_per_min, retry);
        else
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                               "%d of your submissions are being prepared: submit again when one is answered",
                               BROKER_PREP_PER_CLIENT);
        return false;
    }
    return true;
}

/* Checks what can be checked at once, then hands the submission to the worker (broker_prep.c):
 * the answer comes when the loop takes the task back (submit_done). */
static void submit_done(broker_task *bt, void *loop);

void broker_on_submit(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__JobSubmit *js = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_JOB_SUBMIT);
    const char *owner = wire_msg_user_id(msg);
    if (!js || (js->kind != FUSION__JOB_KIND__JOB_KIND_FINETUNE && js->kind != FUSION__JOB_KIND__JOB_KIND_INFER &&
                js->kind != FUSION__JOB_KIND__JOB_KIND_EVAL)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "JobSubmit.kind must be finetune, infer or eval");
        return;
    }
    db_job_kind kind = js->kind == FUSION__JOB_KIND__JOB_KIND_FINETUNE ? DB_JOB_FINETUNE
                       : js->kind == FUSION__JOB_KIND__JOB_KIND_EVAL   ? DB_JOB_EVAL
                                                                       : DB_JOB_INFER;
    if (js->idempotency_key && strlen(js->idempotency_key) > DB_IDEM_KEY_MAX) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "idempotency_key is longer than %d bytes",
                           DB_IDEM_KEY_MAX);
        return;
    }
    if (js->data.len > BROKER_MAX_DATA_BYTES) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_TOO_LARGE,
                           "JobSubmit.data is %zu bytes; at most %u are accepted", js->data.len, BROKER_MAX_DATA_BYTES);
        return;
    }
    if (!within_quota(b, msg, js))
        return;
    /* the adapter of an inference job must be a finished fine-tune of the same owner (the store says) */
    dag_spec peek;
    db_job *aj = NULL;
    fu_errmsg em = {{0}};
    const char *sj = js->spec_json ? js->spec_json : "";
    if ((kind == DB_JOB_INFER || kind == DB_JOB_EVAL) && broker_spec_parse(sj, strlen(sj), kind, &peek, &em) == FU_OK) {
        bool bad = peek.adapter_job[0] && (db_job_get(b->db, peek.adapter_job, owner, &aj) != FU_OK ||
                                           aj->kind != DB_JOB_FINETUNE || aj->state != DB_JOB_DONE || !aj->result);
        if (bad && aj && aj->purged_ms)
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                               "adapter_job %s: its adapter was deleted with its other artifacts after the broker's "
                               "retention (--keep-jobs-days); fine-tune it again", peek.adapter_job);
        else if (bad)
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                               "adapter_job %s is not a finished fine-tune job of yours", peek.adapter_job);
        dag_spec_clear(&peek);
        if (bad) {
            db_job_free(&aj);
            broker_quota_done(b->quota, owner);
            return;
        }
    }
    broker_submit_task *t = broker_submit_task_new(b->models, msg, kind, js, aj ? (const char *)aj->spec : NULL);
    if (aj)
        snprintf(t->adapter_model, sizeof t->adapter_model, "%s", aj->model_id);
    t->base.done = submit_done;
    t->db = b->worker_db;
    db_job_free(&aj);
    if (!broker_worker_post(b->worker, &t->base)) {
        broker_quota_done(b->quota, owner);
        broker_submit_task_free(&t);
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                           "the broker is preparing %d jobs already; submit again in a moment", BROKER_PREP_DEPTH);
    }
}

/* Keeps m's hashes in the store, so that a restart need not hash it again (best effort). */
static void remember_model(broker_t *b, const broker_model *m)
{
    db_model_hashes mh = {.dir = m->dir, .hashes = (uint8_t *)m->hashes, .n_tensors = fu_safetensors_count(m->st)};
    memcpy(mh.sig, m->sig, sizeof mh.sig);
    snprintf(mh.model_id, sizeof mh.model_id, "%s", m->id);
    fu_err rc = db_model_hashes_put(b->db, &mh, broker_wall());
    if (rc != FU_OK)
        FU_WARN(LOG, "the hashes of model %s were not stored (%s): a restart will hash it again", m->dir,
                fu_strerror(rc));
}

fu_err broker_adapter_model_check(const broker_job *j, const char *adapter_model, fu_errmsg *em)
{
    if (!j->spec.adapter_job[0] || !adapter_model || !adapter_model[0] || strcmp(adapter_model, j->model->id) == 0)
        return FU_OK;
    return fu_errmsg_set(em, FU_EINVAL,
                         "adapter_job %s was fine-tuned on another model (%.18s...) than '%s' (%.18s...): an adapter "
                         "only fits the weights it was trained on",
                         j->spec.adapter_job, adapter_model, j->spec.model, j->model->id);
}

/* Stores a prepared submission and answers it. */
static void submit_finish(broker_t *b, broker_submit_task *t)
{
    const broker_ret *r = &t->ret;
    broker_quota_done(b->quota, t->owner);
    if (!t->job) { /* not prepared, or its adapter_job's model is another (submit_run) */
        broker_answer_error(b, r, t->code, "%s", t->em.msg);
        return;
    }
    if (t->check_only) { /* the job would be taken: say its model's content id, store nothing */
        Fusion__JobStatus st = FUSION__JOB_STATUS__INIT;
        st.kind = t->kind == DB_JOB_FINETUNE ? FUSION__JOB_KIND__JOB_KIND_FINETUNE
                  : t->kind == DB_JOB_EVAL   ? FUSION__JOB_KIND__JOB_KIND_EVAL
                                             : FUSION__JOB_KIND__JOB_KIND_INFER;
        st.model_id = t->job->model->id;
        remember_model(b, t->job->model); /* its hashes, for the jobs that follow (and a restart) */
        (void)broker_answer(b, r, FUSION__MSG_TYPE__MSG_JOB_STATUS, &st.base);
        broker_job_free(&t->job);
        return;
    }
    const char *id = t->id; /* stored by the worker (submit_run) */
    fu_errmsg em = {{0}};
    db_job *dj = NULL;
    fu_err rc = t->store_rc;
    if (rc == FU_EEXIST) {
        broker_answer_error(b, r, FUSION__ERROR_CODE__ERR_INVALID,
                            "idempotency_key '%s' was used before for a different job: use a new key", t->idem);
        return;
    }
    if (rc != FU_OK) {
        broker_answer_error(b, r, FUSION__ERROR_CODE__ERR_INTERNAL,
                            "the broker could not store the job (%s); nothing was queued, try again", fu_strerror(rc));
        return;
    }
    if (t->created) {
        /* The job checked above is the one that runs: its graph, tokenizer and model are not made twice,
         * and its stored form is the one in hand (not read back). */
        broker_job *j = t->job;
        if (job_row(j, id, t->owner, t->blob, t->blob_len, &em) != FU_OK) {
            broker_job_refuse(b, id, em.msg);
        } else {
            t->job = NULL;
            remember_model(b, j->model);
            broker_job_enqueue(b, j);
            FU_INFO(LOG, "job %s (%s) submitted by %.8s: %zu tokens, model %.18s...", id, db_job_kind_name(t->kind),
                    t->owner, t->n_ids, j->model->id);
        }
    } else {
        FU_INFO(LOG, "job %s resubmitted by %.8s (same idempotency key)", id, t->owner);
    }
    if ((rc = db_job_get_brief(b->db, id, t->owner, &dj)) != FU_OK) {
        broker_answer_error(b, r, FUSION__ERROR_CODE__ERR_INTERNAL, "the job was stored as %s but cannot be read back",
                            id);
        return;
    }
    answer_status(b, r, dj);
    db_job_free(&dj);
}

static void submit_done(broker_task *bt, void *loop)
{
    broker_submit_task *t = (broker_submit_task *)bt;
    submit_finish(loop, t);
    broker_submit_task_free(&t);
}

/* A long poll (JobRef.wait_ms) of a job that has nothing new yet: held by the job instead of
 * answered, when it is a live one with room for it. */
static bool status_held(broker_t *b, const wire_msg_t *msg, const Fusion__JobRef *r, const db_job *dj)
{
    if (r->wait_ms == 0 || db_job_state_final(dj->state))
        return false;
    broker_job *j = broker_job_find(b, dj->id);
    if (!j || j->dead || j->n_waiters == BROKER_JOB_WAITERS)
        return false;
    if ((j->output ? strlen(j->output) : 0) != r->known_output_len)
        return false; /* news already */
    broker_waiter *w = &j->waiters[j->n_waiters++];
    broker_ret_of(msg, &w->ret);
    w->deadline_ms = broker_now() + (r->wait_ms < BROKER_WAIT_MAX_MS ? r->wait_ms : BROKER_WAIT_MAX_MS);
    return true;
}

void broker_on_status(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__JobRef *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ);
    db_job *dj = r ? own_job(b, msg, r->job_id, false) : NULL;
    if (dj && !status_held(b, msg, r, dj))
        reply_status(b, msg, dj);
    db_job_free(&dj);
}

void broker_job_wake(broker_t *b, broker_job *j, bool due_only)
{
    if (!j->n_waiters)
        return;
    uint64_t now = broker_now();
    db_job *dj = NULL;
    uint32_t kept = 0;
    for (uint32_t i = 0; i < j->n_waiters; i++) {
        broker_waiter *w = &j->waiters[i];
        if (due_only && now < w->deadline_ms) {
            j->waiters[kept++] = *w;
            continue;
        }
        if (!dj && db_job_get_brief(b->db, j->id, NULL, &dj) != FU_OK) {
            broker_answer_error(b, &w->ret, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker's store failed; try again");
            continue;
        }
        answer_status(b, &w->ret, dj);
    }
    j->n_waiters = kept;
    db_job_free(&dj);
}

void broker_on_list(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__JobListRequest *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ);
    db_job *arr = NULL;
    size_t n = 0;
    if (db_job_list(b->db, wire_msg_user_id(msg), &arr, &n) != FU_OK) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker's store failed; try again");
        return;
    }
    Fusion__JobStatus *sts = fu_calloc(n ? n : 1, sizeof *sts);
    Fusion__JobStatus **ptrs = fu_calloc(n ? n : 1, sizeof *ptrs);
    char (*bufs)[256] = fu_calloc(n ? n : 1, sizeof *bufs);
    size_t k = 0;
    for (size_t i = n; i-- > 0 && k < BROKER_LIST_MAX;) { /* newest first */
        if (!(r && r->include_done) && db_job_state_final(arr[i].state))
            continue;
        fill_status(b, &arr[i], &sts[k], bufs[k], sizeof bufs[k]);
        ptrs[k] = &sts[k];
        k++;
    }
    Fusion__JobList jl = FUSION__JOB_LIST__INIT;
    jl.n_jobs = k;
    jl.jobs = ptrs;
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_JOB_LIST, &jl.base);
    free(sts);
    free(ptrs);
    free(bufs);
    db_job_array_free(&arr, n);
}

void broker_on_cancel(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__JobRef *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_JOB_CANCEL);
    if (!r)
        return;
    char id[DB_JOB_ID_LEN + 1];
    id_hex(r->job_id, id);
    fu_err rc = broker_job_cancel(b, id, wire_msg_user_id(msg));
    if (rc == FU_ENOTFOUND) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "no job %s among your jobs (list them with `fusion status`)", id);
        return;
    }
    if (rc == FU_EPERM) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "job %s already finished; nothing to cancel", id);
        return;
    }
    if (rc != FU_OK) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker's store failed (%s); try again",
                           fu_strerror(rc));
        return;
    }
    db_job *dj = own_job(b, msg, r->job_id, false);
    if (dj)
        reply_status(b, msg, dj);
    db_job_free(&dj);
}

/* ---------- result download ---------- */

char *broker_adapter_config(const dag_spec *spec)
{
    return dag_peft_config_json(spec->model, spec->rank, spec->alpha, spec->targets);
}

void broker_on_result(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__JobResultRequest *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ);
    db_job *dj = r ? own_job(b, msg, r->job_id, true) : NULL;
    if (!dj)
        return;
    char *cfg = NULL, *logits = NULL;
    size_t logits_len = 0;
    /* A fine-tune that failed or was cancelled may have kept its last checkpoint's adapter. */
    bool partial = (dj->state == DB_JOB_FAILED || dj->state == DB_JOB_CANCELLED) && dj->kind == DB_JOB_FINETUNE &&
                   dj->result;
    if (dj->purged_ms) { /* docs/STORE.md "Compaction" */
        double s = (double)(dj->purged_ms - dj->updated_ms) / 1e3;
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "job %s is %s, but its result was deleted %.3g %s after it ended (the broker's "
                           "--keep-jobs-days); its BLAKE2b-256 was %s", dj->id, db_job_state_name(dj->state),
                           s >= 86400 ? s / 86400 : s >= 3600 ? s / 3600 : s,
                           s >= 86400 ? "days" : s >= 3600 ? "hours" : "seconds",
                           dj->result_hash[0] ? dj->result_hash : "(none)");
        goto done;
    }
    if (dj->state != DB_JOB_DONE && !partial) {
        if (dj->state == DB_JOB_QUEUED || dj->state == DB_JOB_RUNNING)
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                               "job %s is %s: a result exists only once it is done (wait with `fusion wait`)", dj->id,
                               db_job_state_name(dj->state));
        else
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                               "job %s is %s and has no result%s", dj->id, db_job_state_name(dj->state),
                               dj->kind == DB_JOB_FINETUNE ? " (it ended before its first checkpoint; "
                                                             "--checkpoint-every sets how often one is made)"
                                                           : "");
        goto done;
    }
    struct {
        const char *name;
        const uint8_t *data;
        size_t len;
    } files[3];
    size_t nf = 0;
    if (dj->kind == DB_JOB_FINETUNE) {
        dag_spec spec;
        fu_errmsg em = {{0}};
        size_t sl = strnlen((const char *)dj->spec, dj->spec_len);
        if (broker_spec_parse((const char *)dj->spec, sl, DB_JOB_FINETUNE, &spec, &em) != FU_OK) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "job %s: stored spec: %s", dj->id, em.msg);
            goto done;
        }
        cfg = broker_adapter_config(&spec);
        dag_spec_clear(&spec);
        files[nf++] = (typeof(files[0])){"adapter_model.safetensors", dj->result, dj->result_len};
        files[nf++] = (typeof(files[0])){"adapter_config.json", (const uint8_t *)cfg, strlen(cfg)};
    } else if (dj->kind == DB_JOB_EVAL) {
        files[nf++] = (typeof(files[0])){"eval.json", dj->result, dj->result_len};
    } else {
        files[nf++] = (typeof(files[0])){"output.txt", dj->result, dj->result_len};
        /* The prompt's logits (dump_logits), kept beside the store by the job's completion. */
        if (dj->result_path && fu_file_read_all(dj->result_path, BROKER_MAX_LOGITS_BYTES, &logits, &logits_len,
                                                NULL) == FU_OK && logits_len > 0)
            files[nf++] = (typeof(files[0])){BROKER_LOGITS_FILE, (const uint8_t *)logits, logits_len};
    }
    uint64_t total = 0;
    for (size_t f = 0; f < nf; f++)
        total += files[f].len;
    if (r->offset > total) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "offset %" PRIu64 " is past the result's %" PRIu64
                           " bytes", r->offset, total);
        goto done;
    }
    /* Chunks from the global offset (over the files in order), at most BROKER_BLOB_WINDOW bytes. */
    uint64_t pos = r->offset, end = total - r->offset > BROKER_BLOB_WINDOW ? r->offset + BROKER_BLOB_WINDOW : total;
    uint64_t base = 0;
    bool sent_any = false;
    for (size_t f = 0; f < nf; f++) {
        uint8_t hash[DB_HASH_LEN];
        /* the stored result's hash was committed with it; others are small and hashed here */
        bool hashed = f == 0 && dj->result_hash[0] && fu_hex_decode(hash, sizeof hash, dj->result_hash) == FU_OK;
        while (pos < end && pos >= base && pos < base + files[f].len) {
            uint64_t in = pos - base, n = files[f].len - in;
            if (n > BROKER_BLOB_CHUNK)
                n = BROKER_BLOB_CHUNK;
            if (pos + n > end)
                n = end - pos;
            if (!hashed) {
                crypto_generichash(hash, sizeof hash, files[f].data, files[f].len, NULL, 0);
                hashed = true;
            }
            Fusion__JobResultChunk c = FUSION__JOB_RESULT_CHUNK__INIT;
            c.job_id = r->job_id;
            c.file_name = (char *)files[f].name;
            c.offset = in;
            c.total = files[f].len;
            c.content_hash.data = hash;
            c.content_hash.len = sizeof hash;
            c.data.data = (uint8_t *)files[f].data + in;
            c.data.len = (size_t)n;
            c.last = pos + n == total;
            if (broker_reply(b, msg, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, &c.base) != FU_OK)
                goto done;
            pos += n;
            sent_any = true;
        }
        base += files[f].len;
    }
    if (!sent_any) { /* offset == total: say so with an empty last chunk */
        Fusion__JobResultChunk c = FUSION__JOB_RESULT_CHUNK__INIT;
        c.job_id = r->job_id;
        c.file_name = (char *)files[nf - 1].name;
        c.offset = files[nf - 1].len;
        c.total = files[nf - 1].len;
        c.last = true;
        (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, &c.base);
    }
done:
    free(logits);
    free(cfg);
    db_job_free(&dj);
}
