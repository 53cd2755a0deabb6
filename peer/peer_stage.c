/* peer_stage: the compute thread. Owns its loop over the pipe from the I/O thread (peer_pipe.h), the
 * dispatch of broker messages, and the stage's lifecycle: StageAssign, the blob fetches, loading the
 * weights and the executor, StageReady, StageStart, StageRelease, and how errors end a stage. The
 * work itself lives beside it: fine-tuning in peer_train.c, inference in peer_infer.c, the stage's
 * part in verification in peer_stage_verify.c; they share stage_t (peer_stage_internal.h).
 * Implements docs/PIPELINE.md; deviations are listed in docs/PEER.md. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_serial.h"
#include "dag_spec.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "fu_safetensors.h"
#include "peer.h"
#include "peer_blob.h"
#include "peer_stage_internal.h"

#define ST_POLL_MS    200

void stage_to_io(stage_t *s, peer_cmd *c)
{
    if (peer_cmd_send(s->pipe, &c, 0) != FU_OK) {
        FU_WARN("peer", "compute: the I/O thread's pipe failed; dropping a %d command", (int)c->kind);
        peer_cmd_destroy(&c);
    }
}

void stage_send_msg(stage_t *s, Fusion__MsgType type, uint64_t step, const ProtobufCMessage *body)
{
    stage_to_io(s, peer_cmd_send_new(type, s->job_id, step, s->stage_index, body));
}

void stage_send_error(stage_t *s, Fusion__ErrorCode code, Fusion__MsgType about, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    FU_ERROR("peer", "job %016" PRIx64 " stage %u: %s", s->job_id, s->stage_index, text);
    Fusion__Error e = FUSION__ERROR__INIT;
    e.code = code;
    e.message = text;
    e.in_reply_to = about;
    stage_send_msg(s, FUSION__MSG_TYPE__MSG_ERROR, 0, &e.base);
}

static void stage_clear(stage_t *s)
{
    stage_serve_clear(s); /* its sessions before their executor */
    dag_exec_session_destroy(&s->sess);
    dag_train_stage_clear(&s->train);
    free(s->rx);
    dag_exec_destroy(&s->x);
    dag_graph_destroy(&s->g);
    fu_safetensors_close(&s->st);
    for (size_t i = 0; i < s->n_fetch; i++)
        peer_blob_destroy(&s->fetch[i].blob);
    free(s->fetch);
    for (size_t i = 0; i < s->n_defer; i++)
        peer_cmd_destroy(&s->defer[i]);
    free(s->model_id);
    free(s->ids);
    free(s->tok);
    free(s->tgt);
    free(s->prompt);
    free(s->hist);
    for (size_t r = 0; r < ST_VERIFY_KEEP; r++)
        for (size_t m = 0; m < DAG_EXEC_MAX_SLOTS; m++)
            free(s->kept[r][m]);
    for (size_t i = 0; i < s->n_vq; i++)
        free(s->vq[i].input);
    for (size_t r = 0; r < ST_VERIFY_KEEP; r++)
        free(s->snap[r]);
    dag_spec_clear(&s->spec);
    peer_compute_cfg cfg = s->cfg;
    void *pipe = s->pipe;
    bool stop = s->stop;
    peer_challenge_t *challenge = s->challenge; /* not the stage's: the peer's, for its whole life */
    memset(s, 0, sizeof *s);
    s->cfg = cfg;
    s->pipe = pipe;
    s->stop = stop;
    s->challenge = challenge;
    atomic_store(&s->cfg.shared->state, FUSION__PEER_STATE__PEER_STATE_IDLE);
    atomic_store(&s->cfg.shared->stage_active, 0);
    atomic_store(&s->cfg.shared->progress, 0);
}

/* Ends the stage and tells the I/O thread its links may close. */
static void stage_end(stage_t *s, const char *why)
{
    if (!s->active)
        return;
    FU_INFO("peer", "job %016" PRIx64 " stage %u: ended (%s)", s->job_id, s->stage_index, why);
    peer_cmd *c = peer_cmd_new(PEER_CMD_STAGE_GONE);
    c->job_id = s->job_id;
    c->stage = s->stage_index;
    c->gen = s->gen;
    stage_clear(s);
    stage_to_io(s, c);
}

/* A backend failure: report, tell the I/O thread to leave. */
void stage_fatal(stage_t *s, fu_err rc, const char *what)
{
    stage_send_error(s, FUSION__ERROR_CODE__ERR_INTERNAL, FUSION__MSG_TYPE__MSG_UNSPECIFIED, "%s failed on %s: %s",
                     what, s->cfg.be->name, fu_strerror(rc));
    stage_end(s, "backend failure");
    peer_cmd *c = peer_cmd_new(PEER_CMD_FATAL);
    c->err = rc;
    stage_to_io(s, c);
}

/* An executor error: the backend's own (CUDA) errors are fatal; others are this stage's. */
void stage_exec_failed(stage_t *s, fu_err rc, const char *what)
{
    if (rc == FU_ECUDA) {
        stage_fatal(s, rc, what);
        return;
    }
    stage_send_error(s, FUSION__ERROR_CODE__ERR_INTERNAL, FUSION__MSG_TYPE__MSG_UNSPECIFIED, "%s: %s", what,
                     fu_strerror(rc));
    stage_end(s, "executor error");
}

void stage_add_fetch(stage_t *s, const char *model_id, const char *name, fetch_kind kind, bool cached)
{
    s->fetch = fu_realloc(s->fetch, (s->n_fetch + 1) * sizeof *s->fetch);
    s->fetch[s->n_fetch].blob = peer_blob_new(model_id, name, cached ? s->cfg.cache_dir : NULL, s->cfg.mem_budget);
    peer_blob_set_cache_max(s->fetch[s->n_fetch].blob, s->cfg.cache_max_bytes);
    peer_blob_set_window(s->fetch[s->n_fetch].blob,
                         peer_blob_window_for(atomic_load(&s->cfg.shared->link_bytes_per_s)));
    s->fetch[s->n_fetch].kind = kind;
    s->n_fetch++;
}

void stage_ask_next(stage_t *s)
{
    while (s->cur_fetch < s->n_fetch) {
        Fusion__WeightRequest req;
        if (peer_blob_request(s->fetch[s->cur_fetch].blob, fu_clock_ms(), &req))
            stage_send_msg(s, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST, 0, &req.base);
        return;
    }
}

/* Cut tensors of the range; the stage boundary must carry exactly the nodes both sides expect. */
static fu_err setup_cuts(stage_t *s, fu_errmsg *em)
{
    size_t ni = dag_exec_cut_inputs(s->x, s->cut_in, ST_MAX_CUTS);
    size_t no = dag_exec_cut_outputs(s->x, s->cut_out, ST_MAX_CUTS);
    if (ni > ST_MAX_CUTS || no > ST_MAX_CUTS)
        return fu_errmsg_set(em, FU_EINVAL, "the stage boundary carries more than %d tensors", ST_MAX_CUTS);
    s->n_cut_in = (uint32_t)ni;
    s->n_cut_out = (uint32_t)no;
    FU_TRY(dag_graph_check_range(s->g, s->first, s->last, em));
    s->w_in_total = s->w_out_total = 0;
    for (uint32_t i = 0; i < s->n_cut_in; i++)
        s->w_in_total += dag_graph_width(s->g, s->cut_in[i]);
    for (uint32_t i = 0; i < s->n_cut_out; i++)
        s->w_out_total += dag_graph_width(s->g, s->cut_out[i]);
    if ((!stage_is_first(s) && s->n_cut_in == 0) || (!stage_is_last(s) && s->n_cut_out == 0))
        return fu_errmsg_set(em, FU_EINVAL, "the range %u..%u has no cut tensor towards a neighbour",
                             s->first, s->last);
    return FU_OK;
}

static void on_assign(stage_t *s, const Fusion__StageAssign *a, uint64_t gen)
{
    if (s->active) {
        /* A new assignment replaces the old one (recovery after StageRelease, or a backup promoted). */
        stage_end(s, "replaced by a new assignment");
    }
    fu_errmsg em = {{0}}; /* why the assignment is refused */
    fu_err rc;
    s->active = true;
    s->stalling = false;
    s->gen = gen;
    s->job_id = a->job_id;
    s->stage_index = a->stage_index;
    s->stage_count = a->stage_count;
    s->first = a->node_begin;
    s->last = a->node_end;
    s->backup = a->backup;
    s->resume_step = a->resume_step;
    s->model_id = fu_strdup(a->model_id);
    s->verify = isfinite(a->verify) && a->verify > 0 && a->verify <= 1 ? a->verify : 0;
    s->vstate_step = a->backup ? 0 : -1; /* a backup restores nothing: it holds the seeded initial state */
    atomic_store(&s->cfg.shared->stage_active, a->backup ? 0 : 1);
    atomic_store(&s->cfg.shared->state, a->backup ? FUSION__PEER_STATE__PEER_STATE_WARM : FUSION__PEER_STATE__PEER_STATE_BUSY);
    if (a->stage_count == 0 || a->stage_index >= a->stage_count || a->node_begin >= a->node_end) {
        fu_errmsg_set(&em, FU_EINVAL, "bad stage %u of %u or node range %u..%u", a->stage_index,
                      a->stage_count, a->node_begin, a->node_end);
        goto invalid;
    }
    if ((rc = dag_spec_parse(a->spec_json ? a->spec_json : "", a->spec_json ? strlen(a->spec_json) : 0,
                             DAG_JOB_ANY, &s->spec, &em)) != FU_OK)
        goto invalid;
    if ((rc = dag_graph_decode(a->dag.data, a->dag.len, &s->g, &em)) != FU_OK)
        goto invalid;
    if (a->node_end > dag_graph_size(s->g)) {
        fu_errmsg_set(&em, FU_EINVAL, "node range %u..%u outside the DAG's %zu nodes", a->node_begin,
                      a->node_end, dag_graph_size(s->g));
        goto invalid;
    }
    s->M = stage_is_infer(s) ? 1 : s->spec.micro_batches; /* the spec's: it travels once */
    if (!stage_is_infer(s) && (s->M == 0 || s->M > DAG_EXEC_MAX_SLOTS || s->spec.batch % s->M != 0)) {
        fu_errmsg_set(&em, FU_EINVAL, "micro_batches %u must divide batch %u and be at most %d", s->M,
                      s->spec.batch, DAG_EXEC_MAX_SLOTS);
        goto invalid;
    }
    s->spec.micro_batches = s->M;
    if (stage_is_infer(s)) {
        /* The ring (fusion.proto LinkRole): stage 0's upstream and the last stage's downstream. */
        for (size_t i = 0; i < a->n_neighbours && a->stage_count > 1; i++) {
            const Fusion__Neighbour *nb = a->neighbours[i];
            s->ring_in |= stage_is_first(s) && nb->role == FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM &&
                          nb->stage_index + 1 == a->stage_count;
            s->ring_out |= stage_is_last(s) && nb->role == FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM &&
                           nb->stage_index == 0;
        }
        for (size_t i = 0; i < a->n_eos_ids && s->n_eos < FU_MODELCFG_MAX_EOS; i++)
            s->eos[s->n_eos++] = a->eos_ids[i];
        if (stage_is_first(s) && s->spec.prompt_tokens) {
            s->n_prompt = s->spec.n_prompt_tokens;
            s->prompt = fu_malloc((s->n_prompt ? s->n_prompt : 1) * sizeof *s->prompt);
            memcpy(s->prompt, s->spec.prompt_tokens, s->n_prompt * sizeof *s->prompt);
        }
    } else {
        s->rows_mb = s->spec.batch / s->M;
    }
    /* The executor. Inference sizes its rows from the prompt, which stage 0 may only know after
     * fetching the job's tokens: the executor is made after the fetches (make_exec). */
    /* What to fetch: every parameter of the range, then the job's data (stage 0 and the last stage),
     * then the checkpoint to resume from, then a finished job's adapter for inference. */
    for (uint32_t i = s->first; i < s->last; i++) {
        const dag_node *nd = dag_graph_node(s->g, i);
        for (uint32_t k = 0; k < nd->n_params; k++) {
            /* A SALR linear's (or pruned lm_head's) base weight is stored bitmap-encoded in a pruned
             * model (dag_model.h). */
            bool salr = (nd->op == DAG_OP_LINEAR || nd->op == DAG_OP_LM_HEAD) &&
                        nd->adapter.method == DAG_ADAPTER_SALR && k == 0;
            bool int8 = (nd->flags & DAG_NODE_INT8) && k == 0; /* and its row scales */
            static const char *const sfx[3] = {".bitmap", ".values", ".offsets"};
            for (int v = 0; v < (salr ? 3 : int8 ? 2 : 1); v++) {
                char pn[DAG_NAME_MAX + 16];
                snprintf(pn, sizeof pn, "%s%s", nd->params[k], salr ? sfx[v] : v ? FU_ST_QSCALE_SUFFIX : "");
                bool dup = false;
                for (size_t f = 0; f < s->n_fetch && !dup; f++)
                    dup = strcmp(peer_blob_name(s->fetch[f].blob), pn) == 0;
                if (!dup)
                    stage_add_fetch(s, a->model_id, pn, FETCH_WEIGHT, true);
            }
        }
    }
    char jid[64], name[96];
    snprintf(jid, sizeof jid, "job:%016" PRIx64, a->job_id);
    /* Inference: every stage reads the prompt's length from the tokens (it sizes the executor); a
     * prompt given in the spec is the tokens unless tokens were generated before a failover (the
     * tokens are then the prompt followed by those, and stage 0 runs them all again). */
    bool need_tokens = stage_is_serve(s)  ? false /* its sessions bring their own (SessionStart) */
                       : stage_is_infer(s) ? !s->spec.prompt_tokens || a->resume_step > 0
                                         : (stage_is_first(s) || stage_is_last(s));
    if (need_tokens)
        stage_add_fetch(s, jid, "tokens", FETCH_TOKENS, false);
    if (!stage_is_infer(s) && a->resume_step > 0 && !a->backup) {
        snprintf(name, sizeof name, "ckpt:%u:%" PRIu64, a->stage_index, a->resume_step);
        stage_add_fetch(s, jid, name, FETCH_CKPT, false);
    }
    if (stage_is_infer(s) || stage_is_eval(s)) {
        if (s->spec.adapter_job[0]) { /* checked by dag_spec: 16 hex characters */
            snprintf(jid, sizeof jid, "job:%s", s->spec.adapter_job);
            stage_add_fetch(s, jid, "adapter", FETCH_ADAPTER, false);
        }
    }
    FU_INFO("peer", "job %016" PRIx64 ": assigned stage %u of %u (nodes %u..%u)%s, %zu blobs to fetch", a->job_id,
            a->stage_index, a->stage_count, a->node_begin, a->node_end, a->backup ? " as a warm backup" : "",
            s->n_fetch);
    stage_ask_next(s);
    return;
invalid:
    stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN,
                     "refused the assignment: %s", fu_errmsg_text(&em, FU_EINVAL));
    stage_end(s, "invalid assignment");
}

static fu_st_dtype st_dtype(Fusion__Dtype d, bool *ok)
{
    *ok = true;
    switch (d) {
    case FUSION__DTYPE__DTYPE_F32: return FU_ST_F32;
    case FUSION__DTYPE__DTYPE_F16: return FU_ST_F16;
    case FUSION__DTYPE__DTYPE_BF16: return FU_ST_BF16;
    case FUSION__DTYPE__DTYPE_I32: return FU_ST_I32;
    case FUSION__DTYPE__DTYPE_I64: return FU_ST_I64;
    case FUSION__DTYPE__DTYPE_U8: return FU_ST_U8;
    case FUSION__DTYPE__DTYPE_I8: return FU_ST_I8;
    default: *ok = false; return FU_ST_F32;
    }
}

char *stage_scratch_path(const stage_t *s, const char *what)
{
    char name[160];
    snprintf(name, sizeof name, ".%s-%ld-%016" PRIx64 "-%u.safetensors", what, (long)getpid(), s->job_id,
             s->stage_index);
    return fu_path_join(s->cfg.cache_dir, name);
}

/* Writes the fetched weight blobs as one safetensors file and opens it (then removes the name:
 * the mapping stays valid). */
static fu_err open_weights(stage_t *s, fu_errmsg *em)
{
    size_t n = 0;
    fu_err rc;
    fu_st_tensor *t = fu_calloc(s->n_fetch ? s->n_fetch : 1, sizeof *t);
    for (size_t i = 0; i < s->n_fetch; i++) {
        if (s->fetch[i].kind != FETCH_WEIGHT)
            continue;
        peer_blob_t *b = s->fetch[i].blob;
        bool ok;
        fu_st_tensor *e = &t[n++];
        e->name = peer_blob_name(b);
        e->dtype = st_dtype(peer_blob_dtype(b), &ok);
        int64_t shape[PEER_BLOB_MAX_DIMS];
        size_t nd = peer_blob_shape(b, shape, PEER_BLOB_MAX_DIMS);
        e->ndim = nd;
        uint64_t ne = 1;
        for (size_t k = 0; k < nd; k++) {
            if (shape[k] < 0)
                ok = false;
            e->shape[k] = (uint64_t)(shape[k] < 0 ? 0 : shape[k]);
            ne *= e->shape[k];
        }
        e->data = peer_blob_data(b, &e->nbytes);
        if (!ok || ne * fu_st_dtype_size(e->dtype) != e->nbytes) {
            rc = fu_errmsg_set(em, FU_EPROTO, "weight '%s' came with a dtype/shape that does not fit its %zu bytes",
                               e->name, e->nbytes);
            free(t);
            return rc;
        }
    }
    char *path = stage_scratch_path(s, "stage");
    rc = fu_mkdir_p(s->cfg.cache_dir, 0700, em);
    if (rc == FU_OK)
        rc = fu_safetensors_write(path, t, n, NULL, 0, NULL, NULL, em);
    free(t);
    if (rc == FU_OK)
        rc = fu_safetensors_open_file(path, &s->st, em);
    unlink(path);
    free(path);
    /* The blobs' memory is no longer needed: the file maps the same bytes. */
    for (size_t i = 0; i < s->n_fetch; i++)
        if (s->fetch[i].kind == FETCH_WEIGHT)
            peer_blob_destroy(&s->fetch[i].blob);
    return rc;
}

static fu_err make_exec(stage_t *s, fu_errmsg *em)
{
    dag_exec_opts o = {.be = s->cfg.be, .first = s->first, .last = s->last, .seed = s->spec.seed,
                       .yield = peer_guest_yield, .yield_arg = s->cfg.guest};
    if (stage_is_serve(s)) {
        /* A serving job: each session's KV cache holds the job's context; one forward runs a prompt
         * and a position of every other session. */
        s->ctx_rows = s->spec.context ? s->spec.context : DAG_SPEC_CONTEXT;
        o.max_tokens = (uint32_t)(s->ctx_rows + s->spec.sessions);
        o.max_context = (uint32_t)s->ctx_rows;
        o.n_slots = 1;
        o.training = false;
    } else if (stage_is_infer(s)) {
        /* Rows of one forward: the prompt (plus the tokens generated before a failover) at once. */
        uint64_t prompt = s->n_ids ? s->n_ids : s->spec.n_prompt_tokens;
        if (prompt == 0)
            prompt = 1;
        uint32_t maxtok = s->spec.max_tokens ? s->spec.max_tokens : 1;
        if (prompt + maxtok + 1 > UINT32_MAX / 2)
            return fu_errmsg_set(em, FU_EINVAL, "prompt of %" PRIu64 " tokens plus %u to generate is too long",
                                 prompt, maxtok);
        o.max_tokens = (uint32_t)prompt;
        o.max_context = o.max_tokens + maxtok + 1;
        o.n_slots = 1;
        o.training = false;
        o.logits_all = s->spec.dump_logits;
    } else {
        o.max_tokens = s->rows_mb * s->spec.seq_len;
        o.n_slots = s->M;
        o.training = !stage_is_eval(s); /* an eval keeps nothing for a backward */
    }
    FU_TRY(dag_exec_new(s->g, &o, &s->x, em));
    FU_TRY(dag_exec_load_weights(s->x, s->st, em));
    return FU_OK;
}

/* Every blob is in: load the stage and say so. */
static void fetched_all(stage_t *s)
{
    fu_errmsg em = {{0}};
    fu_err rc = FU_OK;
    for (size_t i = 0; i < s->n_fetch; i++) {
        if (s->fetch[i].kind != FETCH_TOKENS)
            continue;
        size_t len;
        const uint8_t *d = peer_blob_data(s->fetch[i].blob, &len);
        if (peer_blob_dtype(s->fetch[i].blob) != FUSION__DTYPE__DTYPE_I32 || len % sizeof(int32_t)) {
            stage_send_error(s, FUSION__ERROR_CODE__ERR_PROTO, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK,
                             "the job's tokens are not an I32 blob");
            stage_end(s, "bad tokens");
            return;
        }
        free(s->ids);
        s->n_ids = len / sizeof(int32_t);
        s->ids = fu_malloc(len ? len : 1);
        memcpy(s->ids, d, len);
        if (stage_is_infer(s) && stage_is_first(s)) {
            free(s->prompt);
            s->n_prompt = s->n_ids;
            s->prompt = fu_malloc(len ? len : 1);
            memcpy(s->prompt, d, len);
        }
    }
    if (stage_is_infer(s) && !stage_is_serve(s) && stage_is_first(s) && s->n_prompt == 0) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, "the prompt is empty");
        stage_end(s, "empty prompt");
        return;
    }
    if (!stage_is_infer(s) && (stage_is_first(s) || stage_is_last(s)) &&
        s->n_ids / ((size_t)s->spec.seq_len + 1) == 0) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN,
                         "the job's %zu tokens make no window of seq_len+1 = %u tokens", s->n_ids, s->spec.seq_len + 1);
        stage_end(s, "no data");
        return;
    }
    if ((rc = open_weights(s, &em)) != FU_OK || (rc = make_exec(s, &em)) != FU_OK) {
        if (rc == FU_ECUDA) {
            stage_fatal(s, rc, "loading the stage");
            return;
        }
        stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN,
                         "cannot load the stage: %s", fu_errmsg_text(&em, rc));
        stage_end(s, "load failed");
        return;
    }
    if ((rc = setup_cuts(s, &em)) != FU_OK) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, "%s",
                         fu_errmsg_text(&em, rc));
        stage_end(s, "bad cut");
        return;
    }
    for (size_t i = 0; i < s->n_fetch; i++) {
        peer_blob_t *b = s->fetch[i].blob;
        size_t len;
        const uint8_t *d = peer_blob_data(b, &len);
        if (s->fetch[i].kind == FETCH_CKPT) {
            rc = stage_restore_ckpt(s, d, len, &em);
        } else if (s->fetch[i].kind == FETCH_ADAPTER) {
            fu_safetensors *ast = NULL;
            rc = fu_safetensors_parse_header(d, len, "adapter", &ast, &em);
            if (rc == FU_OK)
                rc = dag_exec_load_adapter(s->x, ast, &em);
            fu_safetensors_close(&ast);
        } else {
            continue;
        }
        if (rc != FU_OK) {
            stage_send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN,
                             "cannot use blob %s: %s", peer_blob_name(b), fu_errmsg_text(&em, rc));
            stage_end(s, "restore failed");
            return;
        }
    }
    if (stage_is_infer(s) && !stage_is_serve(s) && (rc = dag_exec_session_new(s->x, &s->sess)) == FU_OK)
        rc = dag_infer_stage_init(&s->infer, s->x, s->g, s->sess, &s->spec, stage_is_first(s), stage_is_last(s),
                                  s->resume_step);
    if (!stage_is_infer(s) && rc == FU_OK)
        rc = dag_train_stage_init(&s->train, s->x, s->g, &s->spec, s->ids, s->n_ids, stage_is_first(s),
                                  stage_is_last(s), s->M);
    if (rc != FU_OK) {
        stage_exec_failed(s, rc, "session");
        return;
    }
    s->tok = fu_malloc(((size_t)(stage_is_infer(s) ? 1 : s->rows_mb * s->spec.seq_len)) * sizeof *s->tok);
    s->tgt = fu_malloc(((size_t)(stage_is_infer(s) ? 1 : s->rows_mb * s->spec.seq_len)) * sizeof *s->tgt);
    s->step = s->resume_step;
    s->loaded = true;
    FU_INFO("peer", "job %016" PRIx64 " stage %u: loaded (%zu trainable parameters)%s", s->job_id, s->stage_index,
            dag_exec_trainable_params(s->x), s->resume_step ? ", restored" : "");
    peer_cmd *c = peer_cmd_new(PEER_CMD_READY);
    c->job_id = s->job_id;
    c->stage = s->stage_index;
    c->gen = s->gen;
    c->backup = s->backup; /* a warm backup says StageReady too (the broker marks it warm) */
    stage_to_io(s, c);
}

static void on_chunk(stage_t *s, const Fusion__WeightChunk *c)
{
    if (!s->active || s->cur_fetch >= s->n_fetch)
        return;
    peer_blob_t *b = s->fetch[s->cur_fetch].blob;
    if (strcmp(c->model_id, peer_blob_model_id(b)) != 0 || strcmp(c->tensor_name, peer_blob_name(b)) != 0)
        return; /* late chunk of an earlier fetch */
    bool done = false;
    fu_err rc = peer_blob_feed(b, c, fu_clock_ms(), &done);
    if ((rc == FU_EAUTH || rc == FU_ENOMEM) && s->vfetching && s->loaded) {
        s->cur_fetch++; /* stage_verify_fetched drops it */
        stage_verify_fetched(s, false, rc == FU_EAUTH ? "its hash did not match 3 times" : "over this peer's memory");
        return;
    }
    if (rc == FU_EAUTH || rc == FU_ENOMEM) {
        stage_send_error(s, rc == FU_EAUTH ? FUSION__ERROR_CODE__ERR_PROTO : FUSION__ERROR_CODE__ERR_TOO_LARGE,
                         FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK, "blob %s/%s refused: %s", c->model_id, c->tensor_name,
                         rc == FU_EAUTH ? "its hash did not match 3 times" : "over this peer's memory");
        stage_end(s, "blob refused");
        return;
    }
    if (done) {
        s->cur_fetch++;
        if (s->cur_fetch == s->n_fetch) {
            if (s->vfetching && s->loaded)
                stage_verify_fetched(s, true, NULL);
            else
                fetched_all(s);
            return;
        }
    }
    stage_ask_next(s);
}

static void on_start(stage_t *s, const Fusion__StageStart *st)
{
    if (!s->active || st->job_id != s->job_id || !s->loaded || s->backup)
        return;
    s->running = true;
    if (stage_is_serve(s))
        return; /* its sessions come with SessionStart */
    if (stage_is_infer(s)) {
        if (stage_is_first(s)) {
            /* After a failover the tokens blob is the prompt followed by the tokens generated so far;
             * resume_step counts the latter (dag_infer: the sampler's counter continues). */
            stage_infer_forward(s, 0, s->prompt, NULL, s->n_prompt);
        }
        return;
    }
    if (st->step != s->step) {
        FU_WARN("peer", "job %016" PRIx64 ": StageStart at step %" PRIu64 " while this stage is at %" PRIu64, s->job_id,
                st->step, s->step);
        s->step = st->step;
    }
    FU_INFO("peer", "job %016" PRIx64 " stage %u: running from step %" PRIu64, s->job_id, s->stage_index, s->step);
    stage_publish_progress(s);
    if (s->step >= s->spec.steps) {
        s->finished = true;
        return;
    }
    if (stage_is_first(s))
        s->pending_fwd = true;
    stage_replay_deferred(s);
}

static void on_msg(stage_t *s, const wire_msg_t *m, uint64_t gen)
{
    switch (wire_msg_type(m)) {
    case FUSION__MSG_TYPE__MSG_STAGE_ASSIGN:
        on_assign(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN), gen);
        break;
    case FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK:
        on_chunk(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK));
        break;
    case FUSION__MSG_TYPE__MSG_STAGE_START:
        on_start(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_START));
        break;
    case FUSION__MSG_TYPE__MSG_STAGE_RELEASE: {
        const Fusion__StageRelease *r = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_RELEASE);
        /* job 0: everything this peer holds (the broker's answer to Leave). */
        if (s->active && (r->job_id == s->job_id || r->job_id == 0))
            stage_end(s, r->reason && *r->reason ? r->reason : "released");
        else {
            peer_cmd *c = peer_cmd_new(PEER_CMD_STAGE_GONE); /* nothing held: the I/O side may go on */
            c->job_id = r->job_id;
            c->gen = UINT64_MAX; /* closes nothing */
            stage_to_io(s, c);
        }
        break;
    }
    case FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK: {
        const Fusion__CheckpointAck *a = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK);
        FU_INFO("peer", "job %016" PRIx64 " stage %u: checkpoint of step %" PRIu64 " committed by the broker",
                a->job_id, a->stage_index, a->step);
        break;
    }
    case FUSION__MSG_TYPE__MSG_INFER_TOKEN:
        if (s->active && stage_is_serve(s))
            stage_serve_on_token(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_INFER_TOKEN));
        else
            stage_on_infer_token(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_INFER_TOKEN));
        break;
    case FUSION__MSG_TYPE__MSG_SESSION_START:
    case FUSION__MSG_TYPE__MSG_SESSION_END:
        if (s->active && stage_is_serve(s))
            stage_serve_on_msg(s, m);
        break;
    case FUSION__MSG_TYPE__MSG_VERIFY_REQUEST:
        stage_on_verify_request(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_VERIFY_REQUEST));
        break;
    case FUSION__MSG_TYPE__MSG_VERIFY_DELIVER:
        stage_on_verify_deliver(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_VERIFY_DELIVER));
        break;
    case FUSION__MSG_TYPE__MSG_CHALLENGE: {
        if (!s->challenge)
            s->challenge = peer_challenge_new(s->cfg.be);
        Fusion__ChallengeReply r;
        peer_challenge_answer(s->challenge, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_CHALLENGE), &r);
        stage_to_io(s, peer_cmd_send_new(FUSION__MSG_TYPE__MSG_CHALLENGE_REPLY, 0, 0, 0, &r.base));
        break;
    }
    case FUSION__MSG_TYPE__MSG_ERROR: {
        /* The broker refused a WeightRequest: the blob being fetched cannot be had. A refusal that
         * names another blob answers an earlier fetch (a verifier's, before it was promoted; an
         * earlier assignment's) and is not this one's. */
        const Fusion__Error *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        if (!s->active || e->in_reply_to != FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST || s->cur_fetch >= s->n_fetch)
            break;
        peer_blob_t *b = s->fetch[s->cur_fetch].blob;
        if (strcmp(e->model_id, peer_blob_model_id(b)) != 0 || strcmp(e->tensor_name, peer_blob_name(b)) != 0) {
            FU_INFO("peer", "job %016" PRIx64 " stage %u: ignored a late refusal of %.80s/%.80s (fetching %s)",
                    s->job_id, s->stage_index, e->model_id, e->tensor_name, peer_blob_name(b));
            break;
        }
        if (s->vfetching) {
            stage_verify_fetched(s, false, e->message); /* a verification checkpoint the broker no longer has */
            break;
        }
        stage_send_error(s, FUSION__ERROR_CODE__ERR_NOT_FOUND, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST,
                         "cannot load the stage: the broker has no blob %s/%s (%s)", peer_blob_model_id(b),
                         peer_blob_name(b), e->message);
        stage_end(s, "blob not found");
        break;
    }
    default:
        break;
    }
}

void *peer_compute_main(void *arg)
{
    stage_t *s = fu_calloc(1, sizeof *s);
    s->cfg = *(peer_compute_cfg *)arg;
    /* A guest: this thread and the threads it starts (OpenMP team, SALR helper) at the owner's chosen
     * priority; the I/O thread keeps the process's own. */
    kern_priority got = KERN_PRIORITY_NORMAL;
    if (kern_priority_set_self(s->cfg.priority, &got) != FU_OK || got != s->cfg.priority)
        FU_WARN("peer", "compute: priority %s wanted, %s obtained", kern_priority_name(s->cfg.priority),
                kern_priority_name(got));
    s->pipe = zmq_socket(s->cfg.ctx, ZMQ_PAIR);
    int hwm = PEER_PAIR_HWM, tmo = ST_POLL_MS, linger = 0;
    if (!s->pipe || zmq_setsockopt(s->pipe, ZMQ_SNDHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(s->pipe, ZMQ_RCVHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(s->pipe, ZMQ_RCVTIMEO, &tmo, sizeof tmo) != 0 ||
        zmq_setsockopt(s->pipe, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(s->pipe, PEER_PIPE_ENDPOINT) != 0) {
        FU_ERROR("peer", "compute: cannot open the pipe to the I/O thread: %s", zmq_strerror(zmq_errno()));
        if (s->pipe)
            zmq_close(s->pipe);
        free(s);
        return NULL;
    }
    while (!s->stop) {
        peer_cmd *c = NULL;
        fu_err rc = peer_cmd_recv(s->pipe, s->pending_fwd ? ZMQ_DONTWAIT : 0, &c);
        if (rc == FU_EAGAIN) {
            s->pending_fwd = false;
            if (s->active && s->running && stage_is_serve(s))
                stage_serve_run(s);
            else if (s->active && s->running && stage_is_infer(s))
                stage_infer_next(s);
            else if (s->active && s->running)
                stage_run_forwards(s);
            continue;
        }
        if (rc == FU_ETIMEDOUT) {
            if (s->active && s->cur_fetch < s->n_fetch)
                stage_ask_next(s); /* resend a window nobody answered */
            if (s->active && s->n_vq)
                stage_verify_expire(s);
            continue;
        }
        if (rc != FU_OK)
            break;
        switch (c->kind) {
        case PEER_CMD_STOP:
            s->stop = true;
            peer_cmd_destroy(&c);
            break;
        case PEER_CMD_MSG:
            on_msg(s, c->msg, c->gen);
            peer_cmd_destroy(&c);
            break;
        case PEER_CMD_TENSOR:
            stage_on_tensor(s, c); /* takes c */
            break;
        case PEER_CMD_VERIFY_INPUT:
            stage_on_verify_input(s, c); /* takes c */
            break;
        default:
            peer_cmd_destroy(&c);
            break;
        }
    }
    stage_clear(s);
    peer_challenge_destroy(&s->challenge);
    zmq_close(s->pipe);
    atomic_store(&s->cfg.shared->exited, 1);
    free(s);
    return NULL;
}
