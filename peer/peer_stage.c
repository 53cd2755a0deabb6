/* peer_stage: the compute thread. Owns the stage of the current assignment: blob fetches, the
 * dag_exec executor for the node range, forward/backward per micro-batch, AdamW at the end of each
 * step, StepDone, checkpoints and inference sessions. Talks only to the I/O thread, over the PAIR
 * (peer_internal.h). Implements docs/PIPELINE.md; deviations are listed in docs/PEER.md. */
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
#include "peer_internal.h"
#include "peer_verify.h"

#define ST_MAX_CUTS   16 /* cut tensors one stage boundary may carry */
#define ST_MAX_DEFER  (2 * DAG_EXEC_MAX_SLOTS) /* frames of the next step held back */
#define ST_POLL_MS    200
#define ST_VERIFY_KEEP  3  /* steps of outputs (and input hashes) kept for the broker's verification */
#define ST_VERIFY_QUEUE 64 /* verification requests a verifier holds (more are answered "unavailable") */
#define ST_VERIFY_INPUT_WAIT_MS 60000 /* a verifier gives up on an input that has not come by then */

typedef enum { FETCH_WEIGHT, FETCH_TOKENS, FETCH_CKPT, FETCH_ADAPTER, FETCH_VERIFY_CKPT } fetch_kind;

/* A verification request a verifier (warm backup) has yet to answer. */
typedef struct {
    uint64_t step;      /* training step */
    uint32_t mb;        /* micro-batch */
    uint64_t seed;      /* the broker's seed */
    uint8_t *input;     /* stage > 0: the upstream's output of (step, mb), delivered through the broker
                           (malloc); NULL until it has come */
    size_t n_input;     /* its bytes */
    uint64_t since_ms;  /* when the request came (inputs that do not come are given up on) */
} verify_req;

typedef struct {
    peer_blob_t *blob;  /* the fetch */
    fetch_kind kind;    /* what it is for */
} fetch_item;

typedef struct {
    peer_compute_cfg cfg;     /* from the I/O thread */
    void *pipe;               /* our end of the PAIR */
    bool stop;                /* STOP received */

    /* the assignment */
    bool active;              /* a stage is held */
    bool backup;              /* warm backup: fetch only */
    bool loaded;              /* weights loaded, READY sent */
    bool running;             /* StageStart received */
    bool finished;            /* every step done (waiting for StageRelease) */
    bool stalling;            /* the stall test hook (PEER_STALL_ENV) holds this assignment at a step */
    uint64_t job_id;
    uint64_t gen;             /* the I/O thread's number for this assignment */
    uint32_t stage_index, stage_count;
    uint32_t first, last;     /* node range */
    uint64_t resume_step;
    char *model_id;
    dag_spec spec;
    uint32_t M, rows_mb;      /* micro-batches, sequences per micro-batch */
    dag_graph_t *g;
    dag_exec_t *x;
    fu_safetensors *st;       /* the stage's weights (kept open: the executor may use them in place) */
    fetch_item *fetch;        /* blobs to fetch, in order */
    size_t n_fetch, cur_fetch;
    int32_t *ids;             /* the job's tokens (first and last stage) */
    size_t n_ids;
    uint32_t cut_in[ST_MAX_CUTS], n_cut_in;
    uint32_t cut_out[ST_MAX_CUTS], n_cut_out;
    uint64_t w_in_total, w_out_total; /* floats per row over the cut inputs / outputs */

    /* training progress */
    uint64_t step;            /* the step being run */
    uint32_t fwd_done, bwd_done;
    double loss_sum;          /* sum over micro-batches of their mean loss */
    int64_t tokens_sum;
    peer_cmd *defer[ST_MAX_DEFER]; /* frames of a later step, in arrival order */
    size_t n_defer;
    int32_t *tok, *tgt;       /* one micro-batch of tokens / targets */

    /* inference */
    dag_session_t *sess;
    uint32_t lm_node;         /* lm_head node in range, or UINT32_MAX */
    int32_t *prompt;          /* stage 0: prompt tokens */
    size_t n_prompt;
    uint64_t prompt_len;      /* prompt length (stage 0: n_prompt; others: from position 0 frames) */
    bool pending_fwd;         /* stage 0: the current step's forwards are due */

    /* verification (docs/PIPELINE.md "Verification") */
    double verify;            /* StageAssign.verify: > 0 makes the stage keep its recent outputs and input hashes */
    float *kept[ST_VERIFY_KEEP][DAG_EXEC_MAX_SLOTS]; /* outputs as sent (activations; the last stage: the
                                                        gradients it sends up) of recent steps, by step % KEEP */
    uint8_t kept_in[ST_VERIFY_KEEP][DAG_EXEC_MAX_SLOTS][WIRE_VERIFY_HASH_BYTES]; /* stage > 0: BLAKE2b-256 of
                                                        each input received */
    bool kept_in_ok[ST_VERIFY_KEEP][DAG_EXEC_MAX_SLOTS]; /* that hash is set */
    uint64_t kept_step[ST_VERIFY_KEEP]; /* the step each row of kept / kept_in holds */
    size_t kept_n;            /* floats of one output */
    verify_req vq[ST_VERIFY_QUEUE]; /* verifier: requests to answer, in arrival order */
    size_t n_vq;
    int64_t vstate_step;      /* verifier: step whose adapter state the executor holds, -1: none */
    bool vfetching;           /* verifier: the checkpoint of step vfetch_step is being fetched */
    uint64_t vfetch_step;     /* verifier: which */
} stage_t;

/* ---- pipe helpers -------------------------------------------------------------------------- */

peer_cmd *peer_cmd_new(peer_cmd_kind kind)
{
    peer_cmd *c = fu_calloc(1, sizeof *c);
    c->kind = kind;
    return c;
}

void peer_cmd_destroy(peer_cmd **c_p)
{
    if (!c_p || !*c_p)
        return;
    peer_cmd *c = *c_p;
    wire_msg_destroy(&c->msg);
    wire_tensor_clear(&c->tensor);
    free(c->body);
    free(c->data);
    free((char *)c->meta.relay_to);
    free(c->text);
    free(c);
    *c_p = NULL;
}

fu_err peer_cmd_send(void *pipe, peer_cmd **c_p, int flags)
{
    if (!pipe || !c_p || !*c_p)
        return FU_EINVAL;
    peer_cmd *c = *c_p;
    if (zmq_send(pipe, &c, sizeof c, flags) != (int)sizeof c) {
        int e = zmq_errno();
        if (e == EAGAIN)
            return FU_EAGAIN;
        return e == ETERM ? FU_ECANCELED : FU_EIO;
    }
    *c_p = NULL;
    return FU_OK;
}

fu_err peer_cmd_recv(void *pipe, int flags, peer_cmd **out)
{
    peer_cmd *c = NULL;
    int n = zmq_recv(pipe, &c, sizeof c, flags);
    if (n < 0) {
        int e = zmq_errno();
        if (e == EAGAIN)
            return (flags & ZMQ_DONTWAIT) ? FU_EAGAIN : FU_ETIMEDOUT;
        return e == ETERM ? FU_ECANCELED : FU_EIO;
    }
    if (n != (int)sizeof c || !c)
        return FU_EPROTO;
    *out = c;
    return FU_OK;
}

peer_cmd *peer_cmd_send_new(Fusion__MsgType type, uint64_t job_id, uint64_t step, uint32_t stage,
                            const ProtobufCMessage *body)
{
    peer_cmd *c = peer_cmd_new(PEER_CMD_SEND);
    c->type = type;
    c->job_id = job_id;
    c->step = step;
    c->stage = stage;
    if (body) {
        c->body_len = protobuf_c_message_get_packed_size(body);
        c->body = fu_malloc(c->body_len ? c->body_len : 1);
        protobuf_c_message_pack(body, c->body);
    }
    return c;
}

static void to_io(stage_t *s, peer_cmd *c)
{
    if (peer_cmd_send(s->pipe, &c, 0) != FU_OK) {
        FU_WARN("peer", "compute: the I/O thread's pipe failed; dropping a %d command", (int)c->kind);
        peer_cmd_destroy(&c);
    }
}

static void send_msg(stage_t *s, Fusion__MsgType type, uint64_t step, const ProtobufCMessage *body)
{
    to_io(s, peer_cmd_send_new(type, s->job_id, step, s->stage_index, body));
}

static void send_error(stage_t *s, Fusion__ErrorCode code, Fusion__MsgType about, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void send_error(stage_t *s, Fusion__ErrorCode code, Fusion__MsgType about, const char *fmt, ...)
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
    send_msg(s, FUSION__MSG_TYPE__MSG_ERROR, 0, &e.base);
}

/* ---- stage lifecycle ----------------------------------------------------------------------- */

static void stage_clear(stage_t *s)
{
    dag_exec_session_destroy(&s->sess);
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
    for (size_t r = 0; r < ST_VERIFY_KEEP; r++)
        for (size_t m = 0; m < DAG_EXEC_MAX_SLOTS; m++)
            free(s->kept[r][m]);
    for (size_t i = 0; i < s->n_vq; i++)
        free(s->vq[i].input);
    dag_spec_clear(&s->spec);
    peer_compute_cfg cfg = s->cfg;
    void *pipe = s->pipe;
    bool stop = s->stop;
    memset(s, 0, sizeof *s);
    s->cfg = cfg;
    s->pipe = pipe;
    s->stop = stop;
    s->lm_node = UINT32_MAX;
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
    to_io(s, c);
}

/* A backend failure: report, tell the I/O thread to leave. */
static void fatal(stage_t *s, fu_err rc, const char *what)
{
    send_error(s, FUSION__ERROR_CODE__ERR_INTERNAL, FUSION__MSG_TYPE__MSG_UNSPECIFIED, "%s failed on %s: %s", what,
               s->cfg.be->name, fu_strerror(rc));
    stage_end(s, "backend failure");
    peer_cmd *c = peer_cmd_new(PEER_CMD_FATAL);
    c->err = rc;
    to_io(s, c);
}

/* An executor error: the backend's own (CUDA) errors are fatal; others are this stage's. */
static void exec_failed(stage_t *s, fu_err rc, const char *what)
{
    if (rc == FU_ECUDA) {
        fatal(s, rc, what);
        return;
    }
    send_error(s, FUSION__ERROR_CODE__ERR_INTERNAL, FUSION__MSG_TYPE__MSG_UNSPECIFIED, "%s: %s", what,
               fu_strerror(rc));
    stage_end(s, "executor error");
}

static bool is_infer(const stage_t *s)
{
    return s->spec.kind == DAG_JOB_INFER;
}

/* The rows of micro-batch mb of step `step` in the pipeline's data order (docs/PIPELINE.md). */
static fu_err spec_rows(const stage_t *s, const int32_t *ids, size_t n_ids, uint64_t step, uint32_t mb, int32_t *tokens,
                        int32_t *targets)
{
    dag_data_order o = dag_spec_data_order(&s->spec);
    return dag_data_rows(&o, ids, n_ids, step, mb, tokens, targets);
}

static bool is_first(const stage_t *s)
{
    return s->stage_index == 0;
}

static bool is_last(const stage_t *s)
{
    return s->stage_index + 1 == s->stage_count;
}

static void add_fetch(stage_t *s, const char *model_id, const char *name, fetch_kind kind, bool cached)
{
    s->fetch = fu_realloc(s->fetch, (s->n_fetch + 1) * sizeof *s->fetch);
    s->fetch[s->n_fetch].blob = peer_blob_new(model_id, name, cached ? s->cfg.cache_dir : NULL, s->cfg.mem_budget);
    peer_blob_set_cache_max(s->fetch[s->n_fetch].blob, s->cfg.cache_max_bytes);
    s->fetch[s->n_fetch].kind = kind;
    s->n_fetch++;
}

static void ask_next(stage_t *s)
{
    while (s->cur_fetch < s->n_fetch) {
        Fusion__WeightRequest req;
        if (peer_blob_request(s->fetch[s->cur_fetch].blob, fu_clock_ms(), &req))
            send_msg(s, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST, 0, &req.base);
        return;
    }
}

/* Cut tensors of the range; the stage boundary must carry exactly the nodes both sides expect. */
static fu_err setup_cuts(stage_t *s, char *why, size_t cap)
{
    size_t ni = dag_exec_cut_inputs(s->x, s->cut_in, ST_MAX_CUTS);
    size_t no = dag_exec_cut_outputs(s->x, s->cut_out, ST_MAX_CUTS);
    if (ni > ST_MAX_CUTS || no > ST_MAX_CUTS) {
        snprintf(why, cap, "the stage boundary carries more than %d tensors", ST_MAX_CUTS);
        return FU_EINVAL;
    }
    s->n_cut_in = (uint32_t)ni;
    s->n_cut_out = (uint32_t)no;
    /* Every node before `first` read at or after `first` must be read inside this range (a cut
     * tensor that skips a stage cannot be forwarded by dag_exec). */
    size_t n = dag_graph_size(s->g);
    for (size_t j = s->last; j < n; j++) {
        const dag_node *nd = dag_graph_node(s->g, j);
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            if (nd->inputs[k] < s->first) {
                snprintf(why, cap, "node %zu reads node %u across this stage (%u..%u): skip connections over a "
                         "whole stage are not supported", j, nd->inputs[k], s->first, s->last);
                return FU_EINVAL;
            }
    }
    s->w_in_total = s->w_out_total = 0;
    for (uint32_t i = 0; i < s->n_cut_in; i++)
        s->w_in_total += dag_graph_width(s->g, s->cut_in[i]);
    for (uint32_t i = 0; i < s->n_cut_out; i++)
        s->w_out_total += dag_graph_width(s->g, s->cut_out[i]);
    if ((!is_first(s) && s->n_cut_in == 0) || (!is_last(s) && s->n_cut_out == 0)) {
        snprintf(why, cap, "the range %u..%u has no cut tensor towards a neighbour", s->first, s->last);
        return FU_EINVAL;
    }
    return FU_OK;
}

static void on_assign(stage_t *s, const Fusion__StageAssign *a, uint64_t gen)
{
    if (s->active) {
        /* A new assignment replaces the old one (recovery after StageRelease, or a backup promoted). */
        stage_end(s, "replaced by a new assignment");
    }
    char why[512] = "";
    fu_errmsg em = {{0}};
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
        snprintf(why, sizeof why, "bad stage %u of %u or node range %u..%u", a->stage_index, a->stage_count,
                 a->node_begin, a->node_end);
        goto invalid;
    }
    if ((rc = dag_spec_parse(a->spec_json ? a->spec_json : "", a->spec_json ? strlen(a->spec_json) : 0, DAG_JOB_ANY,
                             &s->spec, &em)) != FU_OK) {
        snprintf(why, sizeof why, "%s", fu_errmsg_text(&em, rc));
        goto invalid;
    }
    if ((rc = dag_graph_decode(a->dag.data, a->dag.len, &s->g, why, sizeof why)) != FU_OK)
        goto invalid;
    if (a->node_end > dag_graph_size(s->g)) {
        snprintf(why, sizeof why, "node range %u..%u outside the DAG's %zu nodes", a->node_begin, a->node_end,
                 dag_graph_size(s->g));
        goto invalid;
    }
    s->M = is_infer(s) ? 1 : (a->micro_batches ? a->micro_batches : s->spec.micro_batches);
    if (!is_infer(s) && (s->M == 0 || s->M > DAG_EXEC_MAX_SLOTS || s->spec.batch % s->M != 0)) {
        snprintf(why, sizeof why, "micro_batches %u must divide batch %u and be at most %d", s->M, s->spec.batch,
                 DAG_EXEC_MAX_SLOTS);
        goto invalid;
    }
    s->spec.micro_batches = s->M;
    if (is_infer(s)) {
        if (is_first(s) && s->spec.prompt_tokens) {
            s->n_prompt = s->spec.n_prompt_tokens;
            s->prompt = fu_malloc((s->n_prompt ? s->n_prompt : 1) * sizeof *s->prompt);
            memcpy(s->prompt, s->spec.prompt_tokens, s->n_prompt * sizeof *s->prompt);
        }
    } else {
        s->rows_mb = s->spec.batch / s->M;
    }
    /* The executor. Inference sizes its rows from the prompt, which stage 0 may only know after
     * fetching the job's tokens: the executor is made after the fetches (make_exec). */
    s->lm_node = UINT32_MAX;
    for (uint32_t i = s->first; i < s->last; i++)
        if (dag_graph_node(s->g, i)->op == DAG_OP_LM_HEAD)
            s->lm_node = i;

    /* What to fetch: every parameter of the range, then the job's data (stage 0 and the last stage),
     * then the checkpoint to resume from, then a finished job's adapter for inference. */
    for (uint32_t i = s->first; i < s->last; i++) {
        const dag_node *nd = dag_graph_node(s->g, i);
        for (uint32_t k = 0; k < nd->n_params; k++) {
            /* A SALR linear's (or pruned lm_head's) base weight is stored bitmap-encoded in a pruned
             * model (dag_model.h). */
            bool salr = (nd->op == DAG_OP_LINEAR || nd->op == DAG_OP_LM_HEAD) &&
                        nd->adapter.method == DAG_ADAPTER_SALR && k == 0;
            static const char *const sfx[3] = {".bitmap", ".values", ".offsets"};
            for (int v = 0; v < (salr ? 3 : 1); v++) {
                char pn[DAG_NAME_MAX + 16];
                snprintf(pn, sizeof pn, "%s%s", nd->params[k], salr ? sfx[v] : "");
                bool dup = false;
                for (size_t f = 0; f < s->n_fetch && !dup; f++)
                    dup = strcmp(peer_blob_name(s->fetch[f].blob), pn) == 0;
                if (!dup)
                    add_fetch(s, a->model_id, pn, FETCH_WEIGHT, true);
            }
        }
    }
    char jid[64], name[96];
    snprintf(jid, sizeof jid, "job:%016" PRIx64, a->job_id);
    /* Inference: every stage reads the prompt's length from the tokens (it sizes the executor). */
    bool need_tokens = is_infer(s) ? !s->spec.prompt_tokens : (is_first(s) || is_last(s));
    if (need_tokens)
        add_fetch(s, jid, "tokens", FETCH_TOKENS, false);
    if (!is_infer(s) && a->resume_step > 0 && !a->backup) {
        snprintf(name, sizeof name, "ckpt:%u:%" PRIu64, a->stage_index, a->resume_step);
        add_fetch(s, jid, name, FETCH_CKPT, false);
    }
    if (is_infer(s)) {
        if (s->spec.adapter_job[0]) { /* checked by dag_spec: 16 hex characters */
            snprintf(jid, sizeof jid, "job:%s", s->spec.adapter_job);
            add_fetch(s, jid, "adapter", FETCH_ADAPTER, false);
        }
    }
    FU_INFO("peer", "job %016" PRIx64 ": assigned stage %u of %u (nodes %u..%u)%s, %zu blobs to fetch", a->job_id,
            a->stage_index, a->stage_count, a->node_begin, a->node_end, a->backup ? " as a warm backup" : "",
            s->n_fetch);
    ask_next(s);
    return;
invalid:
    send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, "refused the assignment: %s",
               why);
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
    default: *ok = false; return FU_ST_F32;
    }
}

static char *scratch_path(const stage_t *s, const char *what)
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
    char *path = scratch_path(s, "stage");
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

/* The contract's checkpoint names (<name>.adam_m / .adam_v, metadata step and adam_t) from the
 * executor's (<name>.exp_avg / .exp_avg_sq, metadata fusion.step), or back (to_contract false). */
static fu_err ckpt_translate(const fu_safetensors *src, const char *dst, bool to_contract, uint64_t step,
                             fu_errmsg *em)
{
    static const char *const dag_sfx[2] = {".exp_avg_sq", ".exp_avg"};
    static const char *const pipe_sfx[2] = {".adam_v", ".adam_m"};
    size_t n = fu_safetensors_count(src);
    fu_st_tensor *t = fu_calloc(n ? n : 1, sizeof *t);
    char **names = fu_calloc(n ? n : 1, sizeof *names);
    for (size_t i = 0; i < n; i++) {
        t[i] = *fu_safetensors_at(src, i);
        const char *nm = t[i].name;
        size_t L = strlen(nm);
        for (int k = 0; k < 2; k++) {
            const char *from = to_contract ? dag_sfx[k] : pipe_sfx[k];
            const char *to = to_contract ? pipe_sfx[k] : dag_sfx[k];
            size_t fl = strlen(from);
            if (L > fl && strcmp(nm + L - fl, from) == 0) {
                names[i] = fu_malloc(L - fl + strlen(to) + 1);
                memcpy(names[i], nm, L - fl);
                strcpy(names[i] + L - fl, to);
                t[i].name = names[i];
                break;
            }
        }
    }
    char a[32], b[32];
    const char *meta[4];
    size_t n_meta;
    fu_err rc = FU_OK;
    if (to_contract) {
        const char *adam_t = fu_safetensors_metadata(src, "fusion.step");
        snprintf(a, sizeof a, "%" PRIu64, step);
        snprintf(b, sizeof b, "%s", adam_t ? adam_t : "0");
        meta[0] = "step", meta[1] = a, meta[2] = "adam_t", meta[3] = b;
        n_meta = 2;
    } else {
        const char *adam_t = fu_safetensors_metadata(src, "adam_t");
        if (!adam_t)
            rc = fu_errmsg_set(em, FU_EPROTO, "checkpoint has no adam_t metadata");
        snprintf(b, sizeof b, "%s", adam_t ? adam_t : "0");
        meta[0] = "fusion.step", meta[1] = b;
        n_meta = 1;
    }
    if (rc == FU_OK)
        rc = fu_safetensors_write(dst, t, n, meta, n_meta, NULL, NULL, em);
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    free(t);
    return rc;
}

/* Restores the executor from a checkpoint blob (contract names). */
static fu_err restore_ckpt(stage_t *s, const uint8_t *data, size_t len, fu_errmsg *em)
{
    fu_safetensors *src = NULL, *st = NULL;
    FU_TRY(fu_safetensors_parse_header(data, len, "checkpoint", &src, em));
    const char *stp = fu_safetensors_metadata(src, "step");
    char *path = scratch_path(s, "restore");
    fu_err rc = ckpt_translate(src, path, false, 0, em);
    if (rc == FU_OK)
        rc = fu_safetensors_open_file(path, &st, em);
    if (rc == FU_OK)
        rc = dag_exec_load_state(s->x, st, em);
    if (rc == FU_OK && stp && strtoull(stp, NULL, 10) != s->resume_step)
        rc = fu_errmsg_set(em, FU_EPROTO, "checkpoint says step %s, expected %" PRIu64, stp, s->resume_step);
    fu_safetensors_close(&st);
    fu_safetensors_close(&src);
    unlink(path);
    free(path);
    return rc;
}

static fu_err make_exec(stage_t *s, fu_errmsg *em)
{
    dag_exec_opts o = {.be = s->cfg.be, .first = s->first, .last = s->last, .seed = s->spec.seed,
                       .yield = peer_guest_yield, .yield_arg = s->cfg.guest};
    if (is_infer(s)) {
        /* Rows of one forward: the prompt (plus the tokens generated before a failover) at once. */
        uint64_t prompt = s->spec.prompt_tokens ? s->spec.n_prompt_tokens : s->n_ids;
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
        o.training = true;
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
            send_error(s, FUSION__ERROR_CODE__ERR_PROTO, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK,
                       "the job's tokens are not an I32 blob");
            stage_end(s, "bad tokens");
            return;
        }
        free(s->ids);
        s->n_ids = len / sizeof(int32_t);
        s->ids = fu_malloc(len ? len : 1);
        memcpy(s->ids, d, len);
        if (is_infer(s) && is_first(s)) {
            free(s->prompt);
            s->n_prompt = s->n_ids;
            s->prompt = fu_malloc(len ? len : 1);
            memcpy(s->prompt, d, len);
        }
    }
    if (is_infer(s) && is_first(s) && s->n_prompt == 0) {
        send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, "the prompt is empty");
        stage_end(s, "empty prompt");
        return;
    }
    if (!is_infer(s) && (is_first(s) || is_last(s)) && s->n_ids / ((size_t)s->spec.seq_len + 1) == 0) {
        send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN,
                   "the job's %zu tokens make no window of seq_len+1 = %u tokens", s->n_ids, s->spec.seq_len + 1);
        stage_end(s, "no data");
        return;
    }
    if ((rc = open_weights(s, &em)) != FU_OK || (rc = make_exec(s, &em)) != FU_OK) {
        if (rc == FU_ECUDA) {
            fatal(s, rc, "loading the stage");
            return;
        }
        send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, "cannot load the stage: %s",
                   fu_errmsg_text(&em, rc));
        stage_end(s, "load failed");
        return;
    }
    char why[256] = "";
    if ((rc = setup_cuts(s, why, sizeof why)) != FU_OK) {
        send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, "%s", why);
        stage_end(s, "bad cut");
        return;
    }
    for (size_t i = 0; i < s->n_fetch; i++) {
        peer_blob_t *b = s->fetch[i].blob;
        size_t len;
        const uint8_t *d = peer_blob_data(b, &len);
        if (s->fetch[i].kind == FETCH_CKPT) {
            rc = restore_ckpt(s, d, len, &em);
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
            send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, "cannot use blob %s: %s",
                       peer_blob_name(b), fu_errmsg_text(&em, rc));
            stage_end(s, "restore failed");
            return;
        }
    }
    if (is_infer(s) && (rc = dag_exec_session_new(s->x, &s->sess)) == FU_OK)
        dag_exec_session_use(s->x, s->sess);
    if (rc != FU_OK) {
        exec_failed(s, rc, "session");
        return;
    }
    s->tok = fu_malloc(((size_t)(is_infer(s) ? 1 : s->rows_mb * s->spec.seq_len)) * sizeof *s->tok);
    s->tgt = fu_malloc(((size_t)(is_infer(s) ? 1 : s->rows_mb * s->spec.seq_len)) * sizeof *s->tgt);
    s->step = s->resume_step;
    s->loaded = true;
    FU_INFO("peer", "job %016" PRIx64 " stage %u: loaded (%zu trainable parameters)%s", s->job_id, s->stage_index,
            dag_exec_trainable_params(s->x), s->resume_step ? ", restored" : "");
    peer_cmd *c = peer_cmd_new(PEER_CMD_READY);
    c->job_id = s->job_id;
    c->stage = s->stage_index;
    c->gen = s->gen;
    c->backup = s->backup; /* a warm backup says StageReady too (the broker marks it warm) */
    to_io(s, c);
}

static void verify_fetched(stage_t *s, bool ok, const char *why);

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
        s->cur_fetch++; /* verify_fetched drops it */
        verify_fetched(s, false, rc == FU_EAUTH ? "its hash did not match 3 times" : "over this peer's memory");
        return;
    }
    if (rc == FU_EAUTH || rc == FU_ENOMEM) {
        send_error(s, rc == FU_EAUTH ? FUSION__ERROR_CODE__ERR_PROTO : FUSION__ERROR_CODE__ERR_TOO_LARGE,
                   FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK, "blob %s/%s refused: %s", c->model_id, c->tensor_name,
                   rc == FU_EAUTH ? "its hash did not match 3 times" : "over this peer's memory");
        stage_end(s, "blob refused");
        return;
    }
    if (done) {
        s->cur_fetch++;
        if (s->cur_fetch == s->n_fetch) {
            if (s->vfetching && s->loaded)
                verify_fetched(s, true, NULL);
            else
                fetched_all(s);
            return;
        }
    }
    ask_next(s);
}

/* ---- training ------------------------------------------------------------------------------ */

/* The cut outputs of slot m after a forward: rows × w_out_total floats (one block per cut node in id
 * order), total floats in all, into out. */
static fu_err collect_outputs(stage_t *s, uint32_t slot, size_t total, float *out)
{
    size_t off = 0;
    for (uint32_t i = 0; i < s->n_cut_out; i++) {
        const float *p;
        size_t n;
        fu_err rc = dag_exec_get_output(s->x, slot, s->cut_out[i], &p, &n);
        if (rc != FU_OK || off + n > total)
            return rc != FU_OK ? rc : FU_EINVAL;
        memcpy(out + off, p, n * sizeof(float));
        off += n;
    }
    return FU_OK;
}

/* The gradient w.r.t. the cut inputs after a backward: rows × w_in_total floats, zeros where no
 * gradient reaches, into out (total floats, zeroed by the caller). */
static fu_err collect_input_grads(stage_t *s, uint64_t rows, size_t total, float *out)
{
    size_t off = 0;
    for (uint32_t i = 0; i < s->n_cut_in; i++) {
        const float *p = NULL;
        size_t n = 0, want = (size_t)(rows * dag_graph_width(s->g, s->cut_in[i]));
        fu_err rc = dag_exec_get_input_grad(s->x, s->cut_in[i], &p, &n);
        if (rc != FU_OK || (p && n != want) || off + want > total)
            return rc != FU_OK ? rc : FU_EINVAL;
        if (p)
            memcpy(out + off, p, n * sizeof(float));
        off += want;
    }
    return FU_OK;
}

/* Row of the verification ring for `step`, emptied first when it held another step. */
static size_t kept_row(stage_t *s, uint64_t step)
{
    size_t r = (size_t)(step % ST_VERIFY_KEEP);
    if (s->kept_step[r] != step) {
        for (uint32_t k = 0; k < DAG_EXEC_MAX_SLOTS; k++) {
            free(s->kept[r][k]);
            s->kept[r][k] = NULL;
            s->kept_in_ok[r][k] = false;
        }
        s->kept_step[r] = step;
    }
    return r;
}

static bool keeps_for_verify(const stage_t *s, uint32_t mb)
{
    return s->verify > 0 && !s->backup && !is_infer(s) && mb < DAG_EXEC_MAX_SLOTS;
}

/* Keeps a copy of the output of (step, mb) in the verification ring. */
static void keep_output(stage_t *s, uint64_t step, uint32_t mb, const float *f, size_t total)
{
    if (s->kept_n != total) { /* the output's size changed (never within a job): forget what is held */
        for (size_t r = 0; r < ST_VERIFY_KEEP; r++)
            for (uint32_t k = 0; k < DAG_EXEC_MAX_SLOTS; k++) {
                free(s->kept[r][k]);
                s->kept[r][k] = NULL;
            }
        s->kept_n = total;
    }
    size_t r = kept_row(s, step);
    if (!s->kept[r][mb])
        s->kept[r][mb] = fu_malloc(total * sizeof(float) + 1);
    memcpy(s->kept[r][mb], f, total * sizeof(float));
}

/* The output a stage produces for the pipeline (activations down; the last stage: gradients up) is
 * about to be sent: with verification on a copy of what is sent is kept, so that a VerifyRequest or
 * VerifyDeliver is answered from the output actually produced. The fault hook (tests only) may
 * corrupt it first ("scale"), or keep the honest copy and corrupt what is sent ("lie"). */
static void output_produced(stage_t *s, uint64_t step, uint32_t mb, float *f, size_t total)
{
    /* FAULT INJECTION FOR TESTS ONLY (peer_verify.h): a dishonest peer */
    peer_corrupt_mode cheat = peer_verify_corrupt_now();
    if (cheat == PEER_CORRUPT_SEND)
        for (size_t i = 0; i < total; i++)
            f[i] *= PEER_CORRUPT_SCALE;
    if (keeps_for_verify(s, mb))
        keep_output(s, step, mb, f, total);
    if (cheat == PEER_CORRUPT_LIE) /* keeps the honest output, sends a scaled one */
        for (size_t i = 0; i < total; i++)
            f[i] *= PEER_CORRUPT_SCALE;
}

/* Sends the cut outputs of slot m (rows × w_out_total floats, one block per cut node in id order). */
static fu_err send_outputs(stage_t *s, uint32_t slot, uint64_t step, uint32_t mb, uint64_t rows)
{
    size_t total = (size_t)(rows * s->w_out_total);
    uint8_t *data = fu_malloc(total * sizeof(float) + 1);
    fu_err rc = collect_outputs(s, slot, total, (float *)data);
    if (rc != FU_OK) {
        free(data);
        return rc;
    }
    if (!is_infer(s))
        output_produced(s, step, mb, (float *)data, total);
    peer_cmd *c = peer_cmd_new(PEER_CMD_SEND_TENSOR);
    c->gen = s->gen;
    c->role = FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM;
    c->job_id = s->job_id;
    c->meta.type = FUSION__MSG_TYPE__MSG_ACTIVATION;
    c->meta.job_id = s->job_id;
    c->meta.step = step;
    c->meta.micro_batch = mb;
    c->meta.stage = s->stage_index;
    c->meta.dtype = FUSION__DTYPE__DTYPE_F32;
    c->meta.ndim = 2;
    c->meta.shape[0] = (int64_t)rows;
    c->meta.shape[1] = (int64_t)s->w_out_total;
    c->data = data;
    c->len = total * sizeof(float);
    to_io(s, c);
    return FU_OK;
}

/* Sends the gradient w.r.t. the cut inputs after a backward (zeros where none reaches). */
static fu_err send_input_grads(stage_t *s, uint64_t step, uint32_t mb, uint64_t rows)
{
    size_t total = (size_t)(rows * s->w_in_total);
    uint8_t *data = fu_calloc(total * sizeof(float) + 1, 1);
    fu_err rc = collect_input_grads(s, rows, total, (float *)data);
    if (rc != FU_OK) {
        free(data);
        return rc;
    }
    if (is_last(s)) /* the last stage's verified output (PROTOCOL.md "Verification sketch") */
        output_produced(s, step, mb, (float *)data, total);
    peer_cmd *c = peer_cmd_new(PEER_CMD_SEND_TENSOR);
    c->gen = s->gen;
    c->role = FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM;
    c->job_id = s->job_id;
    c->meta.type = FUSION__MSG_TYPE__MSG_GRADIENT;
    c->meta.job_id = s->job_id;
    c->meta.step = step;
    c->meta.micro_batch = mb;
    c->meta.stage = s->stage_index;
    c->meta.dtype = FUSION__DTYPE__DTYPE_F32;
    c->meta.ndim = 2;
    c->meta.shape[0] = (int64_t)rows;
    c->meta.shape[1] = (int64_t)s->w_in_total;
    c->data = data;
    c->len = total * sizeof(float);
    to_io(s, c);
    return FU_OK;
}

static void send_checkpoint(stage_t *s, uint64_t at)
{
    fu_errmsg em = {{0}};
    char *raw = scratch_path(s, "ckpt-raw"), *out = scratch_path(s, "ckpt");
    fu_safetensors *st = NULL;
    char *blob = NULL;
    size_t len = 0;
    fu_err rc = dag_exec_save_state(s->x, raw, &em);
    if (rc == FU_OK)
        rc = fu_safetensors_open_file(raw, &st, &em);
    if (rc == FU_OK)
        rc = ckpt_translate(st, out, true, at, &em);
    fu_safetensors_close(&st);
    if (rc == FU_OK)
        rc = fu_file_read_all(out, (size_t)1 << 31, &blob, &len, &em);
    unlink(raw);
    unlink(out);
    free(raw);
    free(out);
    if (rc != FU_OK) {
        send_error(s, FUSION__ERROR_CODE__ERR_INTERNAL, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT,
                   "cannot write the checkpoint of step %" PRIu64 ": %s", at, fu_errmsg_text(&em, rc));
        free(blob);
        return;
    }
    uint8_t hash[PEER_BLOB_HASH_BYTES];
    peer_blob_hash(hash, blob, len);
    size_t off = 0;
    do {
        size_t n = len - off < PEER_CKPT_CHUNK ? len - off : PEER_CKPT_CHUNK;
        Fusion__CheckpointPut cp = FUSION__CHECKPOINT_PUT__INIT;
        cp.job_id = s->job_id;
        cp.stage_index = s->stage_index;
        cp.step = at;
        cp.offset = off;
        cp.total = len;
        cp.content_hash.data = hash;
        cp.content_hash.len = sizeof hash;
        cp.data.data = (uint8_t *)blob + off;
        cp.data.len = n;
        send_msg(s, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, at, &cp.base);
        off += n;
    } while (off < len);
    FU_INFO("peer", "job %016" PRIx64 " stage %u: checkpoint of step %" PRIu64 " sent (%zu bytes)", s->job_id,
            s->stage_index, at, len);
    free(blob);
}

static void replay_deferred(stage_t *s);

/* Publishes where a fine-tuning stage is (peer_shared.prog_*, carried by heartbeats). */
static void publish_progress(const stage_t *s)
{
    if (s->backup || is_infer(s))
        return;
    uint64_t step = s->step + 1 < 0xffffffffu ? s->step + 1 : 0xffffffffu;
    uint64_t f = s->fwd_done < 0xffffu ? s->fwd_done : 0xffffu, b = s->bwd_done < 0xffffu ? s->bwd_done : 0xffffu;
    atomic_store(&s->cfg.shared->progress, step << 32 | f << 16 | b);
}

/* AdamW after the M-th backward, StepDone, checkpoint, next step. */
static void finish_step(stage_t *s)
{
    kern_adamw_params ap = dag_spec_adamw(&s->spec);
    fu_err rc = dag_exec_step(s->x, &ap);
    if (rc != FU_OK) {
        exec_failed(s, rc, "AdamW");
        return;
    }
    uint64_t done = s->step;
    if (is_last(s)) {
        Fusion__StepDone sd = FUSION__STEP_DONE__INIT;
        sd.job_id = s->job_id;
        sd.step = done;
        sd.loss = s->loss_sum / s->M;
        sd.tokens = (uint64_t)s->spec.batch * s->spec.seq_len;
        FU_INFO("peer", "job %016" PRIx64 ": step %" PRIu64 " loss %.6f", s->job_id, done, sd.loss);
        send_msg(s, FUSION__MSG_TYPE__MSG_STEP_DONE, done, &sd.base);
    }
    uint64_t K = s->spec.checkpoint_every;
    if ((K && (done + 1) % K == 0) || done + 1 == s->spec.steps)
        send_checkpoint(s, done + 1);
    s->step++;
    s->fwd_done = s->bwd_done = 0;
    publish_progress(s);
    s->loss_sum = 0;
    s->tokens_sum = 0;
    if (s->step >= s->spec.steps) {
        s->finished = true;
        FU_INFO("peer", "job %016" PRIx64 " stage %u: all %" PRIu64 " steps done; waiting for StageRelease", s->job_id,
                s->stage_index, s->spec.steps);
        return;
    }
    if (is_first(s))
        s->pending_fwd = true; /* run from the loop, after the commands already queued */
    replay_deferred(s);
}

/* Loss and backward of slot m at the last stage, then the gradient up. */
static void last_backward(stage_t *s, uint32_t m)
{
    float loss = 0;
    int64_t nv = 0;
    fu_err rc = dag_exec_loss(s->x, m, &loss, &nv);
    if (rc == FU_OK)
        rc = dag_exec_backward(s->x, m, 1.0f / (float)s->M);
    if (rc == FU_OK && !is_first(s))
        rc = send_input_grads(s, s->step, m, (uint64_t)s->rows_mb * s->spec.seq_len);
    if (rc != FU_OK) {
        exec_failed(s, rc, "backward");
        return;
    }
    s->loss_sum += loss;
    s->tokens_sum += nv;
    ++s->bwd_done;
    publish_progress(s);
    if (s->bwd_done == s->M)
        finish_step(s);
}

/* The stall test hook (PEER_STALL_ENV "step:N:PATH"): true when this assignment must drop the work of
 * `step`. The hook fires once per process (the compute thread alone calls this). */
static bool stall_at(stage_t *s, uint64_t step)
{
    static bool spent;
    if (s->stalling || spent || s->backup)
        return s->stalling;
    int64_t n = peer_test_stall_step();
    if (n < 0 || (uint64_t)n != step)
        return false;
    spent = s->stalling = true;
    FU_WARN("peer", "job %016" PRIx64 " stage %u: test hook %s: stalling at step %" PRIu64 " (heartbeats go on)",
            s->job_id, s->stage_index, PEER_STALL_ENV, step);
    return true;
}

/* Stage 0: forward every micro-batch of the current step. */
static void run_forwards(stage_t *s)
{
    uint64_t step = s->step;
    if (stall_at(s, step))
        return;
    for (uint32_t m = 0; m < s->M && s->active && s->step == step; m++) {
        fu_err rc = spec_rows(s, s->ids, s->n_ids, step, m, s->tok, s->tgt);
        if (rc == FU_OK)
            rc = dag_exec_set_tokens(s->x, m, s->tok, is_last(s) ? s->tgt : NULL, s->rows_mb, s->spec.seq_len);
        if (rc == FU_OK)
            rc = dag_exec_forward(s->x, m);
        if (rc != FU_OK) {
            exec_failed(s, rc, "forward");
            return;
        }
        s->fwd_done++;
        publish_progress(s);
        if (is_last(s)) {
            last_backward(s, m);
            continue;
        }
        if ((rc = send_outputs(s, m, step, m, (uint64_t)s->rows_mb * s->spec.seq_len)) != FU_OK) {
            exec_failed(s, rc, "reading the stage output");
            return;
        }
    }
}

static void on_activation_train(stage_t *s, const wire_tensor *t)
{
    uint32_t m = t->meta.micro_batch;
    uint64_t rows = (uint64_t)s->rows_mb * s->spec.seq_len;
    if (m >= s->M || t->meta.dtype != FUSION__DTYPE__DTYPE_F32 || t->meta.ndim != 2 ||
        (uint64_t)t->meta.shape[0] != rows || (uint64_t)t->meta.shape[1] != s->w_in_total) {
        send_error(s, FUSION__ERROR_CODE__ERR_PROTO, FUSION__MSG_TYPE__MSG_ACTIVATION,
                   "activation (%" PRIu64 ", %u) has the wrong shape or micro-batch", t->meta.step, m);
        return;
    }
    if (keeps_for_verify(s, m)) { /* the input hash a VerifySketch of this (step, m) reports */
        size_t r = kept_row(s, s->step);
        peer_verify_hash(t->data, t->len, s->kept_in[r][m]);
        s->kept_in_ok[r][m] = true;
    }
    fu_err rc = FU_OK;
    if (is_last(s)) {
        rc = spec_rows(s, s->ids, s->n_ids, s->step, m, s->tok, s->tgt);
        if (rc == FU_OK)
            rc = dag_exec_set_tokens(s->x, m, NULL, s->tgt, s->rows_mb, s->spec.seq_len);
    } else {
        rc = dag_exec_set_tokens(s->x, m, NULL, NULL, s->rows_mb, s->spec.seq_len);
    }
    const float *f = (const float *)t->data;
    size_t off = 0;
    for (uint32_t i = 0; i < s->n_cut_in && rc == FU_OK; i++) {
        size_t n = (size_t)(rows * dag_graph_width(s->g, s->cut_in[i]));
        rc = dag_exec_set_input(s->x, m, s->cut_in[i], f + off, n);
        off += n;
    }
    if (rc == FU_OK)
        rc = dag_exec_forward(s->x, m);
    if (rc != FU_OK) {
        exec_failed(s, rc, "forward");
        return;
    }
    s->fwd_done++;
    publish_progress(s);
    if (is_last(s)) {
        last_backward(s, m);
        return;
    }
    if ((rc = send_outputs(s, m, s->step, m, rows)) != FU_OK)
        exec_failed(s, rc, "reading the stage output");
}

static void on_gradient_train(stage_t *s, const wire_tensor *t)
{
    uint32_t m = t->meta.micro_batch;
    uint64_t rows = (uint64_t)s->rows_mb * s->spec.seq_len;
    if (is_last(s) || m >= s->M || t->meta.dtype != FUSION__DTYPE__DTYPE_F32 || t->meta.ndim != 2 ||
        (uint64_t)t->meta.shape[0] != rows || (uint64_t)t->meta.shape[1] != s->w_out_total) {
        send_error(s, FUSION__ERROR_CODE__ERR_PROTO, FUSION__MSG_TYPE__MSG_GRADIENT,
                   "gradient (%" PRIu64 ", %u) has the wrong shape or micro-batch", t->meta.step, m);
        return;
    }
    const float *f = (const float *)t->data;
    size_t off = 0;
    fu_err rc = FU_OK;
    for (uint32_t i = 0; i < s->n_cut_out && rc == FU_OK; i++) {
        size_t n = (size_t)(rows * dag_graph_width(s->g, s->cut_out[i]));
        rc = dag_exec_set_output_grad(s->x, m, s->cut_out[i], f + off, n);
        off += n;
    }
    if (rc == FU_OK)
        rc = dag_exec_backward(s->x, m, 1.0f / (float)s->M);
    if (rc == FU_OK && !is_first(s))
        rc = send_input_grads(s, s->step, m, rows);
    if (rc != FU_OK) {
        exec_failed(s, rc, "backward");
        return;
    }
    ++s->bwd_done;
    publish_progress(s);
    if (s->bwd_done == s->M)
        finish_step(s);
}

/* ---- inference ----------------------------------------------------------------------------- */

static void set_sampling(stage_t *s, uint64_t counter)
{
    kern_sample_params sp = {.temperature = (float)s->spec.temperature, .top_k = (int)s->spec.top_k,
                             .top_p = (float)s->spec.top_p, .seed = s->spec.seed};
    dag_exec_set_sampling(s->x, &sp, counter);
}

/* After a forward that consumed positions [p, p+rows): the last stage samples and reports. */
static void infer_emit(stage_t *s, uint64_t p, uint64_t rows)
{
    fu_err rc;
    if (!is_last(s)) {
        rc = send_outputs(s, 0, p, 0, rows);
        if (rc != FU_OK)
            exec_failed(s, rc, "reading the stage output");
        return;
    }
    int32_t tok = 0;
    if ((rc = dag_exec_sampled(s->x, 0, &tok)) != FU_OK) {
        exec_failed(s, rc, "sampling");
        return;
    }
    Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
    it.job_id = s->job_id;
    it.position = p + rows;
    it.token = tok;
    const float *lg = NULL;
    size_t nf = 0;
    if (s->spec.dump_logits && s->lm_node != UINT32_MAX &&
        dag_exec_get_output(s->x, 0, s->lm_node, &lg, &nf) == FU_OK && lg) {
        it.logits.data = (uint8_t *)lg;
        it.logits.len = nf * sizeof(float);
    }
    send_msg(s, FUSION__MSG_TYPE__MSG_INFER_TOKEN, p + rows, &it.base);
}

/* Runs rows new positions starting at p (tokens for stage 0, else the upstream's activation). */
static void infer_forward(stage_t *s, uint64_t p, const int32_t *tokens, const float *act, uint64_t rows)
{
    int64_t have = dag_session_len(s->sess);
    if ((uint64_t)have > p) {
        fu_err rc = dag_session_truncate(s->sess, (int64_t)p); /* a replay after a failover */
        if (rc != FU_OK) {
            exec_failed(s, rc, "session truncate");
            return;
        }
    } else if ((uint64_t)have < p) {
        send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_INFER_TOKEN,
                   "position %" PRIu64 " comes before this stage has positions %" PRId64 "..%" PRIu64
                   " (replay from 0 to rebuild the cache)", p, have, p);
        return;
    }
    if (p == 0 && !is_first(s))
        s->prompt_len = rows > s->resume_step ? rows - s->resume_step : 0; /* see on_start */
    if (is_last(s))
        set_sampling(s, p + rows >= s->prompt_len ? p + rows - s->prompt_len : 0);
    fu_err rc = dag_exec_set_tokens(s->x, 0, tokens, NULL, 1, (uint32_t)rows);
    size_t off = 0;
    for (uint32_t i = 0; i < s->n_cut_in && rc == FU_OK && act; i++) {
        size_t n = (size_t)(rows * dag_graph_width(s->g, s->cut_in[i]));
        rc = dag_exec_set_input(s->x, 0, s->cut_in[i], act + off, n);
        off += n;
    }
    if (rc == FU_OK)
        rc = dag_exec_forward(s->x, 0);
    if (rc != FU_OK) {
        if (rc == FU_ECUDA)
            fatal(s, rc, "inference forward");
        else
            send_error(s, FUSION__ERROR_CODE__ERR_INVALID, FUSION__MSG_TYPE__MSG_INFER_TOKEN,
                       "inference forward at position %" PRIu64 " failed: %s", p, fu_strerror(rc));
        return;
    }
    infer_emit(s, p, rows);
}

/* ---- dispatch ------------------------------------------------------------------------------ */

static void on_start(stage_t *s, const Fusion__StageStart *st)
{
    if (!s->active || st->job_id != s->job_id || !s->loaded || s->backup)
        return;
    s->running = true;
    if (is_infer(s)) {
        if (is_first(s)) {
            /* After a failover the tokens blob is the prompt followed by the tokens generated so far;
             * resume_step (when the broker sets it for inference) counts the latter, so that the
             * sampler's counter (generated-token index) continues where it was. */
            s->prompt_len = s->n_prompt > s->resume_step ? s->n_prompt - s->resume_step : 0;
            infer_forward(s, 0, s->prompt, NULL, s->n_prompt);
        }
        return;
    }
    if (st->step != s->step) {
        FU_WARN("peer", "job %016" PRIx64 ": StageStart at step %" PRIu64 " while this stage is at %" PRIu64, s->job_id,
                st->step, s->step);
        s->step = st->step;
    }
    FU_INFO("peer", "job %016" PRIx64 " stage %u: running from step %" PRIu64, s->job_id, s->stage_index, s->step);
    publish_progress(s);
    if (s->step >= s->spec.steps) {
        s->finished = true;
        return;
    }
    if (is_first(s))
        s->pending_fwd = true;
    replay_deferred(s);
}

static void on_tensor(stage_t *s, peer_cmd *c)
{
    const wire_tensor *t = &c->tensor;
    if (!s->active || !s->loaded || t->meta.job_id != s->job_id) {
        peer_cmd_destroy(&c);
        return;
    }
    if (is_infer(s)) {
        if (t->meta.type == FUSION__MSG_TYPE__MSG_ACTIVATION && !is_first(s) && t->meta.ndim == 2 &&
            t->meta.shape[0] > 0 && (uint64_t)t->meta.shape[1] == s->w_in_total)
            infer_forward(s, t->meta.step, NULL, (const float *)t->data, (uint64_t)t->meta.shape[0]);
        peer_cmd_destroy(&c);
        return;
    }
    if (!s->running || t->meta.step > s->step) {
        /* A frame of a later step (or before StageStart): hold it, bounded. */
        if (s->n_defer < ST_MAX_DEFER) {
            s->defer[s->n_defer++] = c;
        } else {
            send_error(s, FUSION__ERROR_CODE__ERR_BUSY, t->meta.type, "too many frames ahead of step %" PRIu64,
                       s->step);
            peer_cmd_destroy(&c);
        }
        return;
    }
    if (t->meta.step < s->step || s->finished || stall_at(s, s->step)) {
        peer_cmd_destroy(&c); /* stale (a step already taken), or the stall hook */
        return;
    }
    if (t->meta.type == FUSION__MSG_TYPE__MSG_ACTIVATION && !is_first(s))
        on_activation_train(s, t);
    else if (t->meta.type == FUSION__MSG_TYPE__MSG_GRADIENT)
        on_gradient_train(s, t);
    peer_cmd_destroy(&c);
}

static void replay_deferred(stage_t *s)
{
    /* Take the held frames of the current step, in arrival order; keep the rest. */
    bool again = true;
    while (again && s->active && s->running) {
        again = false;
        for (size_t i = 0; i < s->n_defer; i++) {
            if (s->defer[i]->tensor.meta.step <= s->step) {
                peer_cmd *c = s->defer[i];
                memmove(&s->defer[i], &s->defer[i + 1], (s->n_defer - i - 1) * sizeof *s->defer);
                s->n_defer--;
                on_tensor(s, c);
                again = true;
                break;
            }
        }
    }
}

/* ---- verification (docs/PIPELINE.md "Verification") ------------------------------------------ */

/* Answers the broker with the sketch of x (n floats) and the hash of the input it came from, or
 * with `unavailable` when x is NULL. */
static void verify_answer(stage_t *s, uint64_t step, uint32_t mb, uint64_t seed, const float *x, size_t n,
                          const uint8_t *input_hash, const char *unavailable)
{
    Fusion__VerifySketch v = FUSION__VERIFY_SKETCH__INIT;
    double sk[WIRE_VERIFY_SKETCH_K], norm = 0;
    v.job_id = s->job_id;
    v.stage_index = s->stage_index;
    v.step = step;
    v.micro_batch = mb;
    v.seed = seed;
    if (x && input_hash) {
        peer_verify_sketch(x, n, seed, sk, &norm);
        v.n_sketch = WIRE_VERIFY_SKETCH_K;
        v.sketch = sk;
        v.norm = norm;
        v.input_hash.data = (uint8_t *)input_hash;
        v.input_hash.len = WIRE_VERIFY_HASH_BYTES;
    } else {
        v.unavailable = (char *)unavailable;
        FU_INFO("peer", "job %016" PRIx64 " stage %u: cannot sketch step %" PRIu64 " mb %u: %s", s->job_id,
                s->stage_index, step, mb, unavailable);
    }
    send_msg(s, FUSION__MSG_TYPE__MSG_VERIFY_SKETCH, step, &v.base);
}

/* Stage 0's input hash for (step, mb): the micro-batch's token ids (I32, PIPELINE.md data order). */
static fu_err token_hash(stage_t *s, uint64_t step, uint32_t mb, uint8_t out[WIRE_VERIFY_HASH_BYTES])
{
    FU_TRY(spec_rows(s, s->ids, s->n_ids, step, mb, s->tok, s->tgt));
    peer_verify_hash(s->tok, (size_t)s->rows_mb * s->spec.seq_len * sizeof(int32_t), out);
    return FU_OK;
}

/* Restores the checkpoint of `step` (contract names) into the verifier's executor. */
static fu_err verify_restore(stage_t *s, const uint8_t *d, size_t len, uint64_t step, fu_errmsg *em)
{
    uint64_t keep = s->resume_step;
    s->resume_step = step; /* restore_ckpt checks the blob's step against it */
    fu_err rc = restore_ckpt(s, d, len, em);
    s->resume_step = keep;
    return rc;
}

/* The verifier re-runs stage's computation of (step, mb) from the state it holds -- forward from
 * the tokens (stage 0) or from the delivered input (stage k > 0); at the last stage also the
 * backward, whose input gradient is the stage's output -- and sketches the output. */
static void verify_compute(stage_t *s, const verify_req *q)
{
    uint64_t rows = (uint64_t)s->rows_mb * s->spec.seq_len;
    bool last = is_last(s);
    size_t total = (size_t)(rows * (last ? s->w_in_total : s->w_out_total));
    uint8_t ih[WIRE_VERIFY_HASH_BYTES];
    fu_err rc = FU_OK;
    if (is_first(s)) {
        rc = token_hash(s, q->step, q->mb, ih);
        if (rc == FU_OK)
            rc = dag_exec_set_tokens(s->x, q->mb, s->tok, last ? s->tgt : NULL, s->rows_mb, s->spec.seq_len);
    } else {
        uint64_t want = rows * s->w_in_total * sizeof(float);
        if (!q->input || q->n_input != want) {
            char text[200];
            snprintf(text, sizeof text, "the delivered input has %zu bytes; stage %u takes %" PRIu64, q->n_input,
                     s->stage_index, want);
            verify_answer(s, q->step, q->mb, q->seed, NULL, 0, NULL, text);
            return;
        }
        peer_verify_hash(q->input, q->n_input, ih);
        if (last)
            rc = spec_rows(s, s->ids, s->n_ids, q->step, q->mb, s->tok, s->tgt);
        if (rc == FU_OK)
            rc = dag_exec_set_tokens(s->x, q->mb, NULL, last ? s->tgt : NULL, s->rows_mb, s->spec.seq_len);
        const float *f = (const float *)q->input;
        size_t off = 0;
        for (uint32_t i = 0; i < s->n_cut_in && rc == FU_OK; i++) {
            size_t n = (size_t)(rows * dag_graph_width(s->g, s->cut_in[i]));
            rc = dag_exec_set_input(s->x, q->mb, s->cut_in[i], f + off, n);
            off += n;
        }
    }
    if (rc == FU_OK)
        rc = dag_exec_forward(s->x, q->mb);
    /* The backward accumulates adapter gradients in the verifier's executor: harmless, a backup
     * never steps, and an assignment that promotes it makes a new executor. */
    if (rc == FU_OK && last)
        rc = dag_exec_backward(s->x, q->mb, 1.0f / (float)s->M);
    if (rc == FU_ECUDA) {
        fatal(s, rc, "verification forward");
        return;
    }
    float *out = rc == FU_OK ? fu_calloc(total + 1, sizeof(float)) : NULL;
    if (rc == FU_OK)
        rc = last ? collect_input_grads(s, rows, total, out) : collect_outputs(s, q->mb, total, out);
    if (rc == FU_OK)
        verify_answer(s, q->step, q->mb, q->seed, out, total, ih, NULL);
    else
        verify_answer(s, q->step, q->mb, q->seed, NULL, 0, NULL, "the verification forward failed");
    free(out);
}

/* Removes request i from the queue; its input (if any) goes with the copy the caller took. */
static void verify_remove(stage_t *s, size_t i)
{
    memmove(s->vq + i, s->vq + i + 1, (s->n_vq - i - 1) * sizeof *s->vq);
    s->n_vq--;
}

/* A request can be computed once its input is there (stage 0 makes its own from the tokens). */
static bool verify_ready(const stage_t *s, const verify_req *q)
{
    return is_first(s) || q->input != NULL;
}

/* Answers the ready requests whose state is loaded; starts the checkpoint fetch for the next one. */
static void verify_pump(stage_t *s)
{
    while (s->active && !s->vfetching) {
        size_t i = 0;
        while (i < s->n_vq && !verify_ready(s, &s->vq[i]))
            i++;
        if (i == s->n_vq)
            return;
        verify_req q = s->vq[i];
        if ((int64_t)q.step == s->vstate_step) {
            verify_remove(s, i);
            verify_compute(s, &q);
            free(q.input);
            continue;
        }
        if (q.step == 0) {
            verify_remove(s, i);
            verify_answer(s, q.step, q.mb, q.seed, NULL, 0, NULL, "the initial adapter state is no longer loaded");
            free(q.input);
            continue;
        }
        char jid[64], name[96];
        snprintf(jid, sizeof jid, "job:%016" PRIx64, s->job_id);
        snprintf(name, sizeof name, "ckpt:%u:%" PRIu64, s->stage_index, q.step);
        add_fetch(s, jid, name, FETCH_VERIFY_CKPT, false);
        s->vfetching = true;
        s->vfetch_step = q.step;
        ask_next(s);
    }
}

/* Gives up on requests whose input has not come in ST_VERIFY_INPUT_WAIT_MS (the broker has dropped
 * the sample by then). */
static void verify_expire(stage_t *s)
{
    uint64_t now = fu_clock_ms();
    for (size_t i = 0; i < s->n_vq;) {
        verify_req *q = &s->vq[i];
        if (verify_ready(s, q) || now - q->since_ms < ST_VERIFY_INPUT_WAIT_MS) {
            i++;
            continue;
        }
        verify_req c = *q;
        verify_remove(s, i);
        char text[160];
        snprintf(text, sizeof text, "the input from stage %u did not come within %d s", s->stage_index - 1,
                 ST_VERIFY_INPUT_WAIT_MS / 1000);
        verify_answer(s, c.step, c.mb, c.seed, NULL, 0, NULL, text);
    }
}

/* The checkpoint of vfetch_step arrived (ok) or cannot be had: restore it, or answer every request
 * of that step as unavailable; then go on with the queue. */
static void verify_fetched(stage_t *s, bool ok, const char *why)
{
    if (!s->vfetching || s->n_fetch == 0)
        return;
    uint64_t step = s->vfetch_step;
    fetch_item *f = &s->fetch[s->n_fetch - 1];
    fu_err rc = FU_EPROTO;
    fu_errmsg em = {{0}};
    if (ok) {
        size_t len;
        const uint8_t *d = peer_blob_data(f->blob, &len);
        s->vstate_step = -1; /* a failed restore may leave the state half-written */
        rc = verify_restore(s, d, len, step, &em);
        if (rc == FU_OK)
            s->vstate_step = (int64_t)step;
    }
    peer_blob_destroy(&f->blob);
    s->n_fetch--;
    if (s->cur_fetch > s->n_fetch)
        s->cur_fetch = s->n_fetch;
    s->vfetching = false;
    if (rc != FU_OK) {
        char text[300];
        snprintf(text, sizeof text, "checkpoint of step %" PRIu64 " unavailable: %s", step,
                 ok ? fu_errmsg_text(&em, rc) : why);
        for (size_t i = 0; i < s->n_vq;) {
            if (s->vq[i].step != step) {
                i++;
                continue;
            }
            verify_req q = s->vq[i];
            verify_remove(s, i);
            free(q.input);
            verify_answer(s, q.step, q.mb, q.seed, NULL, 0, NULL, text);
        }
    }
    verify_pump(s);
}

static void on_verify_request(stage_t *s, const Fusion__VerifyRequest *r)
{
    uint64_t jid = s->job_id;
    if (!s->active || r->job_id != s->job_id || r->stage_index != s->stage_index || !s->loaded || is_infer(s) ||
        s->stage_count < 2 || r->step >= s->spec.steps || r->micro_batch >= s->M) {
        s->job_id = r->job_id; /* the answer names the request's job */
        uint32_t keep = s->stage_index;
        s->stage_index = r->stage_index;
        verify_answer(s, r->step, r->micro_batch, r->seed, NULL, 0, NULL,
                      "this peer holds no loaded stage of this fine-tune job for that stage, step and micro-batch");
        s->job_id = jid;
        s->stage_index = keep;
        return;
    }
    if (!s->backup) {
        /* The stage's own peer: the sketch of the output it already sent, and the hash of the input
         * it received (stage 0: of its tokens). */
        size_t k = (size_t)(r->step % ST_VERIFY_KEEP);
        bool held = s->kept_step[k] == r->step;
        const float *x = held ? s->kept[k][r->micro_batch] : NULL;
        uint8_t ih[WIRE_VERIFY_HASH_BYTES];
        bool have_ih = false;
        if (is_first(s))
            have_ih = token_hash(s, r->step, r->micro_batch, ih) == FU_OK;
        else if (held && s->kept_in_ok[k][r->micro_batch]) {
            memcpy(ih, s->kept_in[k][r->micro_batch], sizeof ih);
            have_ih = true;
        }
        verify_answer(s, r->step, r->micro_batch, r->seed, x, s->kept_n, have_ih ? ih : NULL,
                      "that output is no longer held (this peer keeps the last 3 steps)");
        return;
    }
    if (s->n_vq == ST_VERIFY_QUEUE) {
        verify_answer(s, r->step, r->micro_batch, r->seed, NULL, 0, NULL, "too many verification requests queued");
        return;
    }
    s->vq[s->n_vq++] = (verify_req){.step = r->step, .mb = r->micro_batch, .seed = r->seed, .since_ms = fu_clock_ms()};
    verify_pump(s);
}

/* Tells the broker that the output of (step, mb) asked for by d cannot be delivered. */
static void deliver_unavailable(stage_t *s, const Fusion__VerifyDeliver *d, const char *why)
{
    Fusion__VerifyInput vi = FUSION__VERIFY_INPUT__INIT;
    vi.job_id = d->job_id;
    vi.stage_index = d->stage_index;
    vi.step = d->step;
    vi.micro_batch = d->micro_batch;
    vi.seed = d->seed;
    vi.verifier_key = d->verifier_key;
    vi.unavailable = (char *)why;
    FU_INFO("peer", "job %016" PRIx64 ": cannot deliver the input of stage %u step %" PRIu64 " mb %u to a verifier: %s",
            d->job_id, d->stage_index, d->step, d->micro_batch, why);
    send_msg(s, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, d->step, &vi.base);
}

/* As the upstream of a stage being verified: hand the output this peer sent for (step, mb) to the
 * I/O thread, which seals it to the verifier's key and sends it through the broker. */
static void on_verify_deliver(stage_t *s, const Fusion__VerifyDeliver *d)
{
    char why[200];
    if (!s->active || d->job_id != s->job_id || !s->loaded || s->backup || is_infer(s)) {
        deliver_unavailable(s, d, "this peer runs no stage of that fine-tune job");
        return;
    }
    if (is_last(s) || d->stage_index != s->stage_index + 1) {
        snprintf(why, sizeof why, "this peer runs stage %u of %u, not the upstream of stage %u", s->stage_index,
                 s->stage_count, d->stage_index);
        deliver_unavailable(s, d, why);
        return;
    }
    if (d->verifier_key.len != WIRE_KEY_BYTES || d->micro_batch >= s->M) {
        deliver_unavailable(s, d, "the request has no 32-byte verifier key or a micro-batch out of range");
        return;
    }
    size_t k = (size_t)(d->step % ST_VERIFY_KEEP);
    const float *x = s->kept_step[k] == d->step ? s->kept[k][d->micro_batch] : NULL;
    if (!x || s->kept_n == 0) {
        deliver_unavailable(s, d, "that output is no longer held (this peer keeps the last 3 steps)");
        return;
    }
    peer_cmd *c = peer_cmd_new(PEER_CMD_VERIFY_SEND);
    c->job_id = d->job_id;
    c->stage = d->stage_index;
    c->step = d->step;
    c->micro_batch = d->micro_batch;
    c->seed = d->seed;
    memcpy(c->key, d->verifier_key.data, WIRE_KEY_BYTES);
    c->len = s->kept_n * sizeof(float);
    c->data = fu_malloc(c->len);
    memcpy(c->data, x, c->len);
    to_io(s, c);
}

/* A delivered input (or the news that none comes) for a queued request of this verifier. Takes c. */
static void on_verify_input(stage_t *s, peer_cmd *c)
{
    verify_req *q = NULL;
    size_t qi = 0;
    if (s->active && s->backup && s->loaded && c->job_id == s->job_id && c->stage == s->stage_index)
        for (size_t i = 0; i < s->n_vq && !q; i++)
            if (s->vq[i].step == c->step && s->vq[i].mb == c->micro_batch && s->vq[i].seed == c->seed &&
                !s->vq[i].input) {
                q = &s->vq[i];
                qi = i;
            }
    if (!q) {
        FU_DEBUG("peer", "job %016" PRIx64 ": a verification input for stage %u step %" PRIu64 " mb %u that nothing "
                 "waits for: dropped", c->job_id, c->stage, c->step, c->micro_batch);
        peer_cmd_destroy(&c);
        return;
    }
    if (!c->data) {
        FU_INFO("peer", "job %016" PRIx64 " stage %u: verification of step %" PRIu64 " mb %u dropped: the upstream "
                "could not deliver its input (%s)", s->job_id, s->stage_index, c->step, c->micro_batch,
                c->text ? c->text : "no reason");
        verify_remove(s, qi);
        peer_cmd_destroy(&c);
        return;
    }
    q->input = c->data;
    q->n_input = c->len;
    c->data = NULL;
    peer_cmd_destroy(&c);
    verify_pump(s);
}

static void on_infer_token(stage_t *s, const Fusion__InferToken *it)
{
    if (!s->active || !s->loaded || !is_infer(s) || !is_first(s) || it->job_id != s->job_id)
        return;
    int32_t tok = it->token;
    /* The token at `position` is the input of that position. */
    infer_forward(s, it->position, &tok, NULL, 1);
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
            to_io(s, c);
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
        on_infer_token(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_INFER_TOKEN));
        break;
    case FUSION__MSG_TYPE__MSG_VERIFY_REQUEST:
        on_verify_request(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_VERIFY_REQUEST));
        break;
    case FUSION__MSG_TYPE__MSG_VERIFY_DELIVER:
        on_verify_deliver(s, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_VERIFY_DELIVER));
        break;
    case FUSION__MSG_TYPE__MSG_ERROR: {
        /* The broker refused a WeightRequest: the blob being fetched cannot be had. */
        const Fusion__Error *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        if (s->active && s->vfetching && e->in_reply_to == FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST) {
            verify_fetched(s, false, e->message); /* a verification checkpoint the broker no longer has */
            break;
        }
        if (s->active && e->in_reply_to == FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST && s->cur_fetch < s->n_fetch) {
            peer_blob_t *b = s->fetch[s->cur_fetch].blob;
            send_error(s, FUSION__ERROR_CODE__ERR_NOT_FOUND, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST,
                       "cannot load the stage: the broker has no blob %s/%s (%s)", peer_blob_model_id(b),
                       peer_blob_name(b), e->message);
            stage_end(s, "blob not found");
        }
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
    s->lm_node = UINT32_MAX;
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
            if (s->active && s->running)
                run_forwards(s);
            continue;
        }
        if (rc == FU_ETIMEDOUT) {
            if (s->active && s->cur_fetch < s->n_fetch)
                ask_next(s); /* resend a window nobody answered */
            if (s->active && s->n_vq)
                verify_expire(s);
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
            on_tensor(s, c); /* takes c */
            break;
        case PEER_CMD_VERIFY_INPUT:
            on_verify_input(s, c); /* takes c */
            break;
        default:
            peer_cmd_destroy(&c);
            break;
        }
    }
    stage_clear(s);
    zmq_close(s->pipe);
    atomic_store(&s->cfg.shared->exited, 1);
    free(s);
    return NULL;
}
