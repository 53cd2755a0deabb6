/* broker_prep: making a job from what a client sent: its spec checked, its model opened by content
 * (broker_models.h), its DAG built, its data tokenized. This runs on the worker thread
 * (broker_worker.h) for a submission, so no tenant's model or data delays the loop's heartbeats; it
 * touches only the job being made and the model cache. At a restart the loop runs the same
 * preparation for each stored job before it serves anyone. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "dag_dataset.h"
#include "dag_model.h"
#include "dag_serial.h"
#include "fu_alloc.h"
#include "fu_log.h"
#include "fu_modelcfg.h"

#define LOG "jobs"

fu_err broker_spec_parse(const char *json, size_t len, db_job_kind kind, dag_spec *s, fu_errmsg *em)
{
    dag_job_kind dk = kind == DB_JOB_INFER ? DAG_JOB_INFER : kind == DB_JOB_EVAL ? DAG_JOB_EVAL : DAG_JOB_FINETUNE;
    fu_err rc = dag_spec_parse(json, len, dk, s, em);
    if (rc == FU_OK && !s->model[0]) {
        dag_spec_clear(s);
        rc = fu_errmsg_set(em, FU_EINVAL, "spec: \"model\" (a model under the broker's --model-root) is required");
    }
    return rc == FU_OK ? FU_OK : FU_EINVAL;
}

uint8_t *broker_stored_spec(const char *spec, size_t spec_len, const int32_t *tok, size_t n, size_t *len)
{
    *len = spec_len + 1 + n * sizeof *tok;
    uint8_t *buf = fu_malloc(*len);
    memcpy(buf, spec, spec_len);
    buf[spec_len] = 0;
    if (n) /* a serving job has no tokens (and memcpy from NULL is undefined even for 0 bytes) */
        memcpy(buf + spec_len + 1, tok, n * sizeof *tok);
    return buf;
}

fu_err broker_job_prepare(broker_models *models, broker_job *j, const char *adapter_spec, fu_errmsg *em)
{
    fu_errmsg sub = {{0}};
    fu_err rc = broker_models_open(models, j->spec.model, &j->model, &sub);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc == FU_ENOTFOUND || rc == FU_EVERSION ? rc : FU_EINVAL, "spec: %s", sub.msg);
    const broker_model *m = j->model;
    fu_modelcfg cfg;
    if ((rc = fu_modelcfg_parse(m->config, m->config_len, FU_MODELCFG_FILE, &cfg, &sub)) != FU_OK)
        return fu_errmsg_set(em, rc == FU_EVERSION ? rc : FU_EINVAL, "spec: model: %s", fu_errmsg_text(&sub, rc));
    dag_salr_info si = {0};
    bool salr = m->salr != NULL;
    if (salr && (rc = dag_salr_info_parse(m->salr, m->salr_len, &si, &sub)) != FU_OK)
        return fu_errmsg_set(em, FU_EINVAL, "spec: model: %s", fu_errmsg_text(&sub, rc));
    dag_spec as = j->spec; /* the adapter's fields only (prompt_tokens stays j's) */
    if (j->kind == DB_JOB_INFER || j->kind == DB_JOB_EVAL) {
        as.method = DAG_ADAPTER_NONE;
        if (adapter_spec) {
            dag_spec ft;
            if (broker_spec_parse(adapter_spec, strlen(adapter_spec), DB_JOB_FINETUNE, &ft, &sub) != FU_OK)
                return fu_errmsg_set(em, FU_EINVAL, "adapter_job: its spec no longer parses: %s", sub.msg);
            as.method = ft.method;
            as.rank = ft.rank;
            as.alpha = ft.alpha;
            as.targets = ft.targets;
            dag_spec_clear(&ft);
        } else if (salr) {
            as.method = DAG_ADAPTER_SALR;
        }
    }
    if (as.method == DAG_ADAPTER_SALR && !salr)
        return fu_errmsg_set(em, FU_EINVAL,
                             "spec: method salr needs a SALR-pruned model (make one with `fusion model prune`)");
    if (salr && as.method != DAG_ADAPTER_SALR && as.method != DAG_ADAPTER_NONE)
        return fu_errmsg_set(em, FU_EINVAL, "spec: '%s' is a SALR-pruned model: use \"method\": \"salr\"",
                             j->spec.model);
    dag_model_dims dims;
    dag_dims_from_cfg(&cfg, &dims);
    dag_build_opts bo = {.method = as.method, .rank = as.rank, .alpha = (float)as.alpha, .targets = as.targets,
                         .res_rank = si.residual_rank, .salr_lm_head = si.lm_head,
                         .head = j->kind == DB_JOB_INFER ? DAG_HEAD_SAMPLE : DAG_HEAD_LOSS,
                         .seq_len = j->kind == DB_JOB_INFER ? 256 : j->spec.seq_len};
    if ((rc = dag_build_llama(&dims, &bo, &j->graph)) != FU_OK)
        return fu_errmsg_set(em, FU_EINVAL, "the job's DAG cannot be built for this model: %s", fu_strerror(rc));
    if ((rc = dag_graph_encode(j->graph, &j->dag_bytes, &j->dag_len)) != FU_OK)
        return fu_errmsg_set(em, FU_EINVAL, "the job's DAG cannot be encoded: %s", fu_strerror(rc));
    if ((rc = fu_tokenizer_for_model(m->tokenizer, m->tokenizer_len, cfg.vocab_size, cfg.byte_tokens || j->spec.byte_tokens,
                                     &j->tok, &sub)) != FU_OK)
        return fu_errmsg_set(em, FU_EINVAL, "spec: model tokenizer: %s", fu_errmsg_text(&sub, rc));
    if ((rc = fu_tokenizer_apply_config(j->tok, m->tok_config, m->tok_config_len, &sub)) != FU_OK)
        return fu_errmsg_set(em, FU_EINVAL, "spec: model tokenizer: %s", fu_errmsg_text(&sub, rc));
    /* the ids that end a generation: config.json's (Llama 3 lists several), else the tokenizer's */
    j->n_eos = 0;
    for (size_t i = 0; i < cfg.n_eos && i < FU_MODELCFG_MAX_EOS; i++)
        j->eos[j->n_eos++] = cfg.eos_token_ids[i];
    if (j->n_eos == 0 && fu_tokenizer_eos_id(j->tok) >= 0)
        j->eos[j->n_eos++] = fu_tokenizer_eos_id(j->tok);
    broker_job_canon(j);
    return FU_OK;
}

void broker_job_canon(broker_job *j)
{
    /* Peers get the canonical spec (every field, the same defaults), without the broker's paths. */
    dag_spec pub = j->spec;
    pub.model[0] = '\0';
    free(j->spec_canon);
    j->spec_canon = dag_spec_to_json(&pub);
}

/* An eval's data: the held-out part of the dataset (all of it when heldout is 0), cut to whole
 * windows and padded with masked windows to whole batches (they count no target), so that step s
 * micro-batch m reads windows (s·B + m·B/M ..) once each in the pipeline's data order. Sets
 * j->spec.steps. *ids is the caller's. */
static fu_err eval_stream(broker_job *j, dag_dataset *ds, int32_t **ids, size_t *n_ids, fu_errmsg *em)
{
    const int32_t *src = ds->n_heldout ? ds->heldout : ds->train;
    size_t n = ds->n_heldout ? ds->n_heldout : ds->n_train, win = (size_t)j->spec.seq_len + 1, w = n / win;
    if (w == 0)
        return fu_errmsg_set(em, FU_EINVAL, "the %s data has %zu tokens: no whole window of seq_len + 1 = %zu",
                             ds->n_heldout ? "held-out" : "", n, win);
    uint64_t steps = (w + j->spec.batch - 1) / j->spec.batch;
    size_t total = (size_t)steps * j->spec.batch * win;
    *ids = fu_malloc(total * sizeof **ids);
    memcpy(*ids, src, w * win * sizeof **ids);
    for (size_t i = w * win; i < total; i++)
        (*ids)[i] = -1; /* token 0, masked */
    *n_ids = total;
    j->spec.steps = steps;
    return FU_OK;
}

/* ---------- a submission, on the worker ---------- */

static fu_err submit_fail(broker_submit_task *t, Fusion__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static fu_err submit_fail(broker_submit_task *t, Fusion__ErrorCode code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->em.msg, sizeof t->em.msg, fmt, ap);
    va_end(ap);
    t->code = code;
    return FU_EINVAL;
}

/* The job t asks for, checked and tokenized, with its stored form. */
static fu_err submit_prepare(broker_submit_task *t)
{
    fu_errmsg em = {{0}};
    broker_job *j = t->job = broker_job_new(t->kind);
    fu_err rc = broker_spec_parse(t->spec_json, t->spec_len, t->kind, &j->spec, &em);
    if (rc == FU_OK)
        rc = broker_job_prepare(t->models, j, t->adapter_spec, &em);
    if (rc != FU_OK) /* a missing model is not found, an unsupported feature is ERR_VERSION (exit 2) */
        return submit_fail(t, rc == FU_ENOTFOUND   ? FUSION__ERROR_CODE__ERR_NOT_FOUND
                              : rc == FU_EVERSION ? FUSION__ERROR_CODE__ERR_VERSION
                                                  : FUSION__ERROR_CODE__ERR_INVALID,
                           "%s", em.msg);
    size_t vocab = dag_graph_dims(j->graph)->vocab_size;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (t->kind == DB_JOB_INFER && j->spec.prompt_tokens) {
        for (size_t i = 0; i < j->spec.n_prompt_tokens; i++)
            if ((size_t)j->spec.prompt_tokens[i] >= vocab)
                return submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID,
                                   "spec: \"prompt_tokens\" must hold ids between 0 and %zu", vocab - 1);
        n_ids = j->spec.n_prompt_tokens;
        ids = fu_malloc((n_ids ? n_ids : 1) * sizeof *ids);
        memcpy(ids, j->spec.prompt_tokens, n_ids * sizeof *ids);
    } else if (t->kind == DB_JOB_EVAL) { /* the held-out part, whole batches */
        dag_dataset_opts dopt = {.seq_len = j->spec.seq_len, .heldout = j->spec.heldout};
        dag_dataset ds;
        if ((rc = dag_chat_format_from_config(j->model->tok_config, j->model->tok_config_len, &dopt.chat, &em)) !=
                FU_OK ||
            (rc = dag_dataset_make(j->tok, (const char *)t->data, t->data_len, &dopt, &ds, &em)) != FU_OK)
            return submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID, "data: %s", fu_errmsg_text(&em, rc));
        rc = eval_stream(j, &ds, &ids, &n_ids, &em);
        dag_dataset_free(&ds);
        if (rc != FU_OK)
            return submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID, "data: %s", em.msg);
        /* the stored spec holds the steps the data makes (a restart reads them back) */
        free(t->spec_json);
        t->spec_json = dag_spec_to_json(&j->spec);
        t->spec_len = strlen(t->spec_json);
        broker_job_canon(j);
    } else if (t->kind == DB_JOB_FINETUNE) { /* plain text or JSON Lines (dag_dataset.h) */
        dag_dataset_opts dopt = {.seq_len = j->spec.seq_len, .heldout = j->spec.heldout};
        dag_dataset ds;
        if ((rc = dag_chat_format_from_config(j->model->tok_config, j->model->tok_config_len, &dopt.chat, &em)) !=
                FU_OK ||
            (rc = dag_dataset_make(j->tok, (const char *)t->data, t->data_len, &dopt, &ds, &em)) != FU_OK)
            return submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID, "data: %s", fu_errmsg_text(&em, rc));
        ids = ds.train;
        n_ids = ds.n_train;
        ds.train = NULL;
        dag_dataset_free(&ds);
    } else if (j->spec.sessions) { /* a serving job: its prompts come per session */
        if (t->data_len)
            return submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID,
                               "a serving job (\"sessions\") takes no prompt: open sessions in it (`fusion ask`)");
    } else if (fu_tokenizer_encode(j->tok, (const char *)t->data, t->data_len, &ids, &n_ids, &em) != FU_OK) {
        return submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID, "data: %s", fu_errmsg_text(&em, FU_EINVAL));
    }
    rc = FU_OK;
    if (t->kind == DB_JOB_FINETUNE) {
        size_t win = (size_t)j->spec.seq_len + 1, n_win = n_ids / win;
        if (n_win < j->spec.batch)
            rc = submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID,
                             "data has %zu tokens: that makes %zu windows of %zu tokens, fewer than batch %u (send "
                             "more data, or use a shorter seq_len or a smaller batch)",
                             n_ids, n_win, win, j->spec.batch);
    } else if (n_ids == 0 && !j->spec.sessions) {
        rc = submit_fail(t, FUSION__ERROR_CODE__ERR_INVALID,
                         "an inference job needs a prompt: JobSubmit.data or \"prompt_tokens\"");
    }
    if (rc == FU_OK) {
        t->blob = broker_stored_spec(t->spec_json, t->spec_len, ids, n_ids, &t->blob_len);
        t->n_ids = n_ids;
        if (t->blob_len > DB_SPEC_MAX)
            rc = submit_fail(t, FUSION__ERROR_CODE__ERR_TOO_LARGE, "the job's data makes %zu tokens; too many", n_ids);
    }
    free(ids);
    return rc;
}

static void submit_run(broker_task *bt)
{
    broker_submit_task *t = (broker_submit_task *)bt;
    if (submit_prepare(t) != FU_OK)
        broker_job_free(&t->job);
    free(t->data); /* tokenized: the text is not needed any more */
    t->data = NULL;
    if (t->job && broker_adapter_model_check(t->job, t->adapter_model, &t->em) != FU_OK) {
        broker_job_free(&t->job);
        t->code = FUSION__ERROR_CODE__ERR_INVALID;
    }
    /* Stored here, with the worker's connection: the stored form holds every token (megabytes), and
     * its durable write would keep the loop's heartbeats waiting. */
    if (t->job && !t->check_only)
        t->store_rc = db_job_submit(t->db, t->owner, t->idem, t->kind, t->blob, t->blob_len, t->job->model->id,
                                    broker_wall(), t->id, &t->created);
}

void broker_submit_task_free(broker_submit_task **tp)
{
    if (!tp || !*tp)
        return;
    broker_submit_task *t = *tp;
    broker_job_free(&t->job);
    free(t->idem);
    free(t->spec_json);
    free(t->data);
    free(t->adapter_spec);
    free(t->blob);
    free(t);
    *tp = NULL;
}

static void submit_drop(broker_task *bt)
{
    broker_submit_task *t = (broker_submit_task *)bt;
    broker_submit_task_free(&t);
}

broker_submit_task *broker_submit_task_new(broker_models *models, const wire_msg_t *msg, db_job_kind kind,
                                           const Fusion__JobSubmit *js, const char *adapter_spec)
{
    broker_submit_task *t = fu_calloc(1, sizeof *t);
    t->base.run = submit_run;
    t->base.drop = submit_drop;
    t->models = models;
    broker_ret_of(msg, &t->ret);
    t->kind = kind;
    snprintf(t->owner, sizeof t->owner, "%s", wire_msg_user_id(msg));
    t->idem = js->idempotency_key && js->idempotency_key[0] ? fu_strdup(js->idempotency_key) : NULL;
    t->check_only = js->check_only;
    t->spec_len = js->spec_json ? strlen(js->spec_json) : 0;
    t->spec_json = fu_strdup(js->spec_json ? js->spec_json : "");
    t->data_len = js->data.len;
    t->data = fu_malloc(t->data_len ? t->data_len : 1);
    if (t->data_len)
        memcpy(t->data, js->data.data, t->data_len);
    t->adapter_spec = adapter_spec ? fu_strdup(adapter_spec) : NULL;
    return t;
}
