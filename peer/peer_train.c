/* peer_train: a fine-tuning stage's work on the compute thread (peer_stage.c holds the lifecycle):
 * the pipeline's data order, the frames of a step (held while they are early, taken in order), forward
 * and backward per micro-batch, the cut tensors sent to the neighbours, AdamW at the end of each step,
 * StepDone, the progress published for heartbeats, the stall test hook, and the checkpoints (written
 * in the contract's format, and restored from it). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_spec.h"
#include "fu_alloc.h"
#include "fu_log.h"
#include "fu_safetensors.h"
#include "peer.h"
#include "peer_blob.h"
#include "peer_stage_internal.h"
#include "peer_faults.h"
#include "peer_verify.h"

/* The rows of micro-batch mb of step `step` in the pipeline's data order (docs/PIPELINE.md). */
fu_err stage_spec_rows(const stage_t *s, const int32_t *ids, size_t n_ids, uint64_t step, uint32_t mb, int32_t *tokens,
                       int32_t *targets)
{
    dag_data_order o = dag_spec_data_order(&s->spec);
    return dag_data_rows(&o, ids, n_ids, step, mb, tokens, targets);
}

/* Restores the executor from a checkpoint blob (contract names). */
fu_err stage_restore_ckpt(stage_t *s, const uint8_t *data, size_t len, fu_errmsg *em)
{
    fu_safetensors *src = NULL;
    FU_TRY(fu_safetensors_parse_header(data, len, "checkpoint", &src, em));
    const char *stp = fu_safetensors_metadata(src, "step");
    fu_err rc = dag_exec_load_state(s->x, src, em);
    if (rc == FU_OK && stp && strtoull(stp, NULL, 10) != s->resume_step)
        rc = fu_errmsg_set(em, FU_EPROTO, "checkpoint says step %s, expected %" PRIu64, stp, s->resume_step);
    fu_safetensors_close(&src);
    return rc;
}

/* The cut outputs of slot m after a forward: rows × w_out_total floats (one block per cut node in id
 * order), total floats in all, into out. */
fu_err stage_collect_outputs(stage_t *s, uint32_t slot, size_t total, float *out)
{
    return dag_exec_gather_outputs(s->x, slot, s->cut_out, s->n_cut_out, out, total);
}

/* The gradient w.r.t. the cut inputs after a backward: rows × w_in_total floats, zeros where no
 * gradient reaches, into out (total floats). */
fu_err stage_collect_input_grads(stage_t *s, uint64_t rows, size_t total, float *out)
{
    return dag_exec_gather_input_grads(s->x, s->cut_in, s->n_cut_in, rows, out, total);
}

/* How a cut tensor of `rows` rows and `bytes` bytes travels in codec c: its dtype and its second
 * dimension (width floats for f32, f16 and bf16; int8 rows are bytes, scales included). */
static Fusion__Dtype wire_dtype(kern_codec c, uint64_t rows, uint64_t width, size_t bytes, uint64_t *dim1)
{
    *dim1 = c == KERN_CODEC_INT8 || c == KERN_CODEC_INT8_EF ? (rows ? bytes / rows : 0) : width;
    return c == KERN_CODEC_F16                               ? FUSION__DTYPE__DTYPE_F16
           : c == KERN_CODEC_BF16                            ? FUSION__DTYPE__DTYPE_BF16
           : c == KERN_CODEC_INT8 || c == KERN_CODEC_INT8_EF ? FUSION__DTYPE__DTYPE_U8
                                                             : FUSION__DTYPE__DTYPE_F32;
}

/* Hands a cut tensor of rows x width values in codec c (data, len bytes, which the command owns from
 * here) of micro-batch mb to the I/O thread, for the neighbour in role as a message of type. */
void stage_send_tensor(stage_t *s, Fusion__LinkRole role, Fusion__MsgType type, uint64_t step, uint32_t mb,
                       Fusion__Dtype dtype, uint64_t rows, uint64_t dim1, uint8_t *data, size_t len)
{
    peer_cmd *cmd = peer_cmd_new(PEER_CMD_SEND_TENSOR);
    cmd->gen = s->gen;
    cmd->role = role;
    cmd->job_id = s->job_id;
    cmd->meta.type = type;
    cmd->meta.job_id = s->job_id;
    cmd->meta.step = step;
    cmd->meta.micro_batch = mb;
    cmd->meta.stage = s->stage_index;
    cmd->meta.dtype = dtype;
    cmd->meta.ndim = 2;
    cmd->meta.shape[0] = (int64_t)rows;
    cmd->meta.shape[1] = (int64_t)dim1;
    cmd->data = data;
    cmd->len = len;
    stage_to_io(s, cmd);
}

/* rows x width values in codec c (len bytes of data, taken) to the neighbour `role`. */
static void send_tensor(stage_t *s, Fusion__LinkRole role, Fusion__MsgType type, uint64_t step, uint32_t mb,
                        uint64_t rows, uint64_t width, kern_codec c, uint8_t *data, size_t len)
{
    uint64_t dim1;
    Fusion__Dtype dt = wire_dtype(c, rows, width, len, &dim1);
    stage_send_tensor(s, role, type, step, mb, dt, rows, dim1, data, len);
}

fu_err stage_wire_encode(stage_t *s, kern_codec c, bool out, uint64_t step, uint32_t mb, float *x, uint8_t **wire,
                         size_t *len)
{
    *wire = NULL;
    *len = dag_train_cut_floats(&s->train, out) * sizeof(float);
    if (c == KERN_CODEC_F32)
        return FU_OK;
    *len = dag_train_wire_bytes(&s->train, c, out);
    *wire = fu_malloc(*len + 1);
    fu_err rc = dag_train_wire_send(&s->train, c, out, step, mb, x, *wire);
    if (rc != FU_OK) { /* a value the codec cannot carry (a NaN, an infinity): the step has diverged */
        free(*wire);
        *wire = NULL;
    }
    return rc;
}

/* A fine-tune's output (total floats in f, which this takes) of (step, mb) on its way out in codec c:
 * kept for verification as the neighbour decodes it (int8-ef: as computed, since the residual added
 * to it is the sender's), then sent. */
static fu_err send_produced(stage_t *s, Fusion__LinkRole role, Fusion__MsgType type, uint64_t step, uint32_t mb,
                            uint64_t rows, uint64_t width, kern_codec c, bool verified, float *f, size_t total)
{
    bool down = role == FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM;
    uint8_t *wire = NULL;
    size_t len = 0;
    bool ef = c == KERN_CODEC_INT8_EF;
    if (verified && ef)
        (void)stage_output_produced(s, step, mb, f, total);
    fu_err rc = stage_wire_encode(s, c, down, step, mb, f, &wire, &len);
    if (rc != FU_OK) {
        free(f);
        return rc;
    }
    if (verified && !ef && stage_output_produced(s, step, mb, f, total) && wire)
        dag_train_wire_encode(&s->train, c, down, f, wire); /* a test's cheat */
    if (wire)
        free(f);
    send_tensor(s, role, type, step, mb, rows, width, c, wire ? wire : (uint8_t *)f, len);
    return FU_OK;
}

/* Sends the cut outputs of slot m (rows × w_out_total floats, one block per cut node in id order);
 * a fine-tune's and an eval's in the job's activation codec. */
fu_err stage_send_outputs(stage_t *s, uint32_t slot, uint64_t step, uint32_t mb, uint64_t rows)
{
    size_t total = (size_t)(rows * s->w_out_total);
    float *data = fu_malloc(total * sizeof(float) + 1);
    fu_err rc = stage_collect_outputs(s, slot, total, data);
    if (rc != FU_OK) {
        free(data);
        return rc;
    }
    if (stage_is_infer(s)) {
        send_tensor(s, FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM, FUSION__MSG_TYPE__MSG_ACTIVATION, step, mb, rows,
                    s->w_out_total, KERN_CODEC_F32, (uint8_t *)data, total * sizeof(float));
        return FU_OK;
    }
    return send_produced(s, FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM, FUSION__MSG_TYPE__MSG_ACTIVATION, step, mb, rows,
                         s->w_out_total, s->spec.act_codec, true, data, total);
}

/* Sends the gradient w.r.t. the cut inputs after a backward (zeros where none reaches), in the job's
 * gradient codec. */
static fu_err send_input_grads(stage_t *s, uint64_t step, uint32_t mb, uint64_t rows)
{
    size_t total = (size_t)(rows * s->w_in_total);
    float *data = fu_calloc(total + 1, sizeof(float));
    fu_err rc = stage_collect_input_grads(s, rows, total, data);
    if (rc != FU_OK) {
        free(data);
        return rc;
    }
    /* the last stage's verified output (PROTOCOL.md "Verification sketch") */
    return send_produced(s, FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM, FUSION__MSG_TYPE__MSG_GRADIENT, step, mb, rows,
                         s->w_in_total, s->spec.grad_codec, stage_is_last(s), data, total);
}

/* The floats of a received cut tensor t of micro-batch rows (out: gradients of the cut outputs; else
 * activations for the cut inputs) in codec c: t's own data for f32, else decoded into s->rx. NULL
 * when its dtype, shape or contents are not what the job's codec makes. */
static const float *wire_floats(stage_t *s, const wire_tensor *t, kern_codec c, bool out, size_t *n)
{
    uint64_t rows = (uint64_t)s->rows_mb * s->spec.seq_len, width = out ? s->w_out_total : s->w_in_total, dim1;
    size_t bytes = c == KERN_CODEC_F32 ? (size_t)(rows * width) * sizeof(float) : dag_train_wire_bytes(&s->train, c, out);
    Fusion__Dtype dt = wire_dtype(c, rows, width, bytes, &dim1);
    if (t->meta.dtype != dt || t->meta.ndim != 2 || (uint64_t)t->meta.shape[0] != rows ||
        (uint64_t)t->meta.shape[1] != dim1 || t->len != bytes)
        return NULL;
    *n = (size_t)(rows * width);
    if (c == KERN_CODEC_F32)
        return (const float *)t->data;
    if (s->rx_cap < *n) {
        free(s->rx);
        s->rx = fu_malloc(*n * sizeof(float) + 1);
        s->rx_cap = *n;
    }
    return dag_train_wire_decode(&s->train, c, out, t->data, t->len, s->rx) == FU_OK ? s->rx : NULL;
}

bool stage_step_has_ckpt(const stage_t *s, uint64_t step)
{
    uint64_t K = s->spec.checkpoint_every;
    return step == 0 || (K && step % K == 0) || step == s->spec.steps;
}

void stage_send_state(stage_t *s, uint64_t at, const uint8_t *blob, size_t len, bool snapshot)
{
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
        cp.snapshot = snapshot;
        stage_send_msg(s, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, at, &cp.base);
        off += n;
    } while (off < len);
    FU_INFO("peer", "job %016" PRIx64 " stage %u: %s of step %" PRIu64 " sent (%zu bytes)", s->job_id,
            s->stage_index, snapshot ? "verification snapshot" : "checkpoint", at, len);
}

static void send_checkpoint(stage_t *s, uint64_t at)
{
    fu_errmsg em = {{0}};
    uint8_t *blob = NULL;
    size_t len = 0;
    fu_err rc = dag_exec_state_serialize(s->x, at, &blob, &len, &em); /* in memory: no temp file */
    if (rc != FU_OK) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_INTERNAL, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT,
                         "cannot write the checkpoint of step %" PRIu64 ": %s", at, fu_errmsg_text(&em, rc));
        free(blob);
        return;
    }
    stage_send_state(s, at, blob, len, false);
    free(blob);
}

void stage_keep_snapshot(stage_t *s, uint64_t at)
{
    size_t r = (size_t)(at % ST_VERIFY_KEEP);
    free(s->snap[r]);
    s->snap[r] = NULL;
    fu_errmsg em = {{0}};
    if (dag_exec_state_serialize(s->x, at, &s->snap[r], &s->snap_len[r], &em) != FU_OK) {
        FU_WARN("peer", "job %016" PRIx64 " stage %u: no verification snapshot of step %" PRIu64 ": %s", s->job_id,
                s->stage_index, at, em.msg);
        free(s->snap[r]);
        s->snap[r] = NULL;
        return;
    }
    s->snap_step[r] = at;
    s->snap_sent[r] = false;
}

/* Publishes where a fine-tuning stage is (peer_shared.prog_*, carried by heartbeats). */
void stage_publish_progress(const stage_t *s)
{
    if (s->backup || stage_is_infer(s))
        return;
    uint64_t step = s->step + 1 < 0xffffffffu ? s->step + 1 : 0xffffffffu;
    uint64_t f = s->fwd_done < 0xffffu ? s->fwd_done : 0xffffu, b = s->bwd_done < 0xffffu ? s->bwd_done : 0xffffu;
    atomic_store(&s->cfg.shared->progress, step << 32 | f << 16 | b);
}

/* AdamW after the M-th backward, StepDone, checkpoint, next step (an eval: StepDone with its sums,
 * next step). */
static void finish_step(stage_t *s)
{
    fu_err rc = stage_is_eval(s) ? FU_OK : dag_train_step(&s->train);
    if (rc != FU_OK) {
        stage_exec_failed(s, rc, "AdamW");
        return;
    }
    uint64_t done = s->step;
    if (stage_is_last(s) && stage_is_eval(s)) {
        Fusion__StepDone sd = FUSION__STEP_DONE__INIT;
        sd.job_id = s->job_id;
        sd.step = done;
        sd.loss_sum = s->eval_sum;
        sd.targets = s->tokens_sum > 0 ? (uint64_t)s->tokens_sum : 0;
        sd.loss = sd.targets ? s->eval_sum / (double)sd.targets : 0;
        sd.tokens = (uint64_t)s->spec.batch * s->spec.seq_len;
        FU_DEBUG("peer", "job %016" PRIx64 ": eval step %" PRIu64 " loss %.6f over %" PRIu64 " targets", s->job_id, done,
                 sd.loss, sd.targets);
        stage_send_msg(s, FUSION__MSG_TYPE__MSG_STEP_DONE, done, &sd.base);
    } else if (stage_is_last(s)) {
        Fusion__StepDone sd = FUSION__STEP_DONE__INIT;
        sd.job_id = s->job_id;
        sd.step = done;
        sd.loss = s->loss_sum / s->M;
        sd.tokens = (uint64_t)s->spec.batch * s->spec.seq_len;
        FU_INFO("peer", "job %016" PRIx64 ": step %" PRIu64 " loss %.6f", s->job_id, done, sd.loss);
        stage_send_msg(s, FUSION__MSG_TYPE__MSG_STEP_DONE, done, &sd.base);
    }
    if (stage_is_eval(s))
        ; /* nothing trained: no checkpoint */
    else if (stage_step_has_ckpt(s, done + 1))
        send_checkpoint(s, done + 1);
    else if (stage_keeps_for_verify(s, 0))
        stage_keep_snapshot(s, done + 1); /* a verifier may need the state of a step without a checkpoint */
    s->step++;
    s->fwd_done = s->bwd_done = 0;
    stage_publish_progress(s);
    stage_verify_late_replay(s); /* the test-only late-verification hook (peer_faults.h) */
    s->loss_sum = 0;
    s->eval_sum = 0;
    s->tokens_sum = 0;
    if (s->step >= s->spec.steps) {
        s->finished = true;
        FU_INFO("peer", "job %016" PRIx64 " stage %u: all %" PRIu64 " steps done; waiting for StageRelease", s->job_id,
                s->stage_index, s->spec.steps);
        stage_verify_late_replay(s);
        return;
    }
    if (stage_is_first(s))
        s->pending_fwd = true; /* run from the loop, after the commands already queued */
    stage_replay_deferred(s);
}

/* An eval's acknowledgement of micro-batch m up the pipeline: one float where a gradient would go. */
static void send_ack(stage_t *s, uint32_t m)
{
    send_tensor(s, FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM, FUSION__MSG_TYPE__MSG_GRADIENT, s->step, m, 1, 1,
                KERN_CODEC_F32, fu_calloc(1, sizeof(float)), sizeof(float));
}

/* One micro-batch of an eval done here (the last stage counted its loss, or an acknowledgement came
 * from below): the acknowledgement up, the step finished after the M-th. */
static void eval_done(stage_t *s, uint32_t m)
{
    if (!stage_is_first(s))
        send_ack(s, m);
    ++s->bwd_done;
    stage_publish_progress(s);
    if (s->bwd_done == s->M)
        finish_step(s);
}

/* The loss of slot m at the last stage of an eval: its counted targets' sum. */
static void last_eval(stage_t *s, uint32_t m)
{
    float loss = 0;
    int64_t nv = 0;
    fu_err rc = dag_exec_loss(s->x, m % s->M, &loss, &nv);
    if (rc != FU_OK) {
        stage_exec_failed(s, rc, "loss");
        return;
    }
    s->eval_sum += (double)loss * (double)nv;
    s->tokens_sum += nv;
    eval_done(s, m);
}

/* Loss and backward of slot m at the last stage, then the gradient up. */
static void last_backward(stage_t *s, uint32_t m)
{
    float loss = 0;
    int64_t nv = 0;
    fu_err rc = dag_train_backward(&s->train, m, NULL, 0, &loss, &nv);
    if (rc == FU_OK && !stage_is_first(s))
        rc = send_input_grads(s, s->step, m, (uint64_t)s->rows_mb * s->spec.seq_len);
    if (rc == FU_OK && stage_is_first(s)) /* a single stage sends nothing: its verified output is the loss */
        stage_output_produced(s, s->step, m, &loss, 1);
    if (rc != FU_OK) {
        stage_exec_failed(s, rc, "backward");
        return;
    }
    s->loss_sum += loss;
    s->tokens_sum += nv;
    ++s->bwd_done;
    stage_publish_progress(s);
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
    int64_t n = peer_fault_stall_step();
    if (n < 0 || (uint64_t)n != step)
        return false;
    spent = s->stalling = true;
    FU_WARN("peer", "job %016" PRIx64 " stage %u: test hook %s: stalling at step %" PRIu64 " (heartbeats go on)",
            s->job_id, s->stage_index, PEER_STALL_ENV, step);
    return true;
}

/* After the forward of micro-batch m (rc its result): the last stage runs the backward, the others
 * send their outputs on. Returns false when the stage failed. */
static bool forward_done(stage_t *s, fu_err rc, uint64_t step, uint32_t m)
{
    if (rc != FU_OK) {
        stage_exec_failed(s, rc, "forward");
        return false;
    }
    s->fwd_done++;
    stage_publish_progress(s);
    if (stage_is_last(s)) {
        if (stage_is_eval(s))
            last_eval(s, m);
        else
            last_backward(s, m);
        return true;
    }
    if ((rc = stage_send_outputs(s, m, step, m, (uint64_t)s->rows_mb * s->spec.seq_len)) != FU_OK) {
        stage_exec_failed(s, rc, "reading the stage output");
        return false;
    }
    return true;
}

/* Stage 0: forward every micro-batch of the current step. */
void stage_run_forwards(stage_t *s)
{
    uint64_t step = s->step;
    if (stall_at(s, step))
        return;
    for (uint32_t m = 0; m < s->M && s->active && s->step == step; m++) {
        fu_err rc = dag_train_forward(&s->train, step, m, NULL, 0);
        if (!forward_done(s, rc, step, m))
            return;
    }
}

static void on_activation_train(stage_t *s, const wire_tensor *t)
{
    uint32_t m = t->meta.micro_batch;
    size_t n = 0;
    const float *in = m < s->M ? wire_floats(s, t, s->spec.act_codec, false, &n) : NULL;
    if (!in) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_PROTO, FUSION__MSG_TYPE__MSG_ACTIVATION,
                         "activation (%" PRIu64 ", %u) has the wrong shape, micro-batch or encoding (%s expected)",
                         t->meta.step, m, kern_codec_name(s->spec.act_codec));
        return;
    }
    if (stage_keeps_for_verify(s, m)) { /* the input hash a VerifySketch of this (step, m) reports */
        size_t r = stage_kept_row(s, s->step);
        peer_verify_hash(in, n * sizeof(float), s->kept_in[r][m]);
        s->kept_in_ok[r][m] = true;
    }
    fu_err rc = dag_train_forward(&s->train, s->step, m, in, n);
    (void)forward_done(s, rc, s->step, m);
}

static void on_gradient_train(stage_t *s, const wire_tensor *t)
{
    uint32_t m = t->meta.micro_batch;
    uint64_t rows = (uint64_t)s->rows_mb * s->spec.seq_len;
    if (stage_is_eval(s)) { /* an acknowledgement: [1, 1] */
        if (stage_is_last(s) || m >= s->M || t->meta.dtype != FUSION__DTYPE__DTYPE_F32 || t->meta.ndim != 2 ||
            t->meta.shape[0] != 1 || t->meta.shape[1] != 1) {
            stage_send_error(s, FUSION__ERROR_CODE__ERR_PROTO, FUSION__MSG_TYPE__MSG_GRADIENT,
                             "eval acknowledgement (%" PRIu64 ", %u) is not one float of a micro-batch", t->meta.step, m);
            return;
        }
        eval_done(s, m);
        return;
    }
    size_t n = 0;
    const float *g = stage_is_last(s) || m >= s->M ? NULL : wire_floats(s, t, s->spec.grad_codec, true, &n);
    if (!g) {
        stage_send_error(s, FUSION__ERROR_CODE__ERR_PROTO, FUSION__MSG_TYPE__MSG_GRADIENT,
                         "gradient (%" PRIu64 ", %u) has the wrong shape, micro-batch or encoding (%s expected)",
                         t->meta.step, m, kern_codec_name(s->spec.grad_codec));
        return;
    }
    fu_err rc = dag_train_backward(&s->train, m, g, n, NULL, NULL);
    if (rc == FU_OK && !stage_is_first(s))
        rc = send_input_grads(s, s->step, m, rows);
    if (rc != FU_OK) {
        stage_exec_failed(s, rc, "backward");
        return;
    }
    ++s->bwd_done;
    stage_publish_progress(s);
    if (s->bwd_done == s->M)
        finish_step(s);
}

void stage_on_tensor(stage_t *s, peer_cmd *c)
{
    const wire_tensor *t = &c->tensor;
    if (!s->active || !s->loaded || t->meta.job_id != s->job_id) {
        peer_cmd_destroy(&c);
        return;
    }
    if (stage_is_serve(s)) {
        stage_serve_on_tensor(s, t);
        peer_cmd_destroy(&c);
        return;
    }
    if (stage_is_infer(s)) {
        stage_infer_on_tensor(s, t);
        peer_cmd_destroy(&c);
        return;
    }
    if (!s->running || t->meta.step > s->step) {
        /* A frame of a later step (or before StageStart): hold it, bounded. */
        if (s->n_defer < ST_MAX_DEFER) {
            s->defer[s->n_defer++] = c;
        } else {
            stage_send_error(s, FUSION__ERROR_CODE__ERR_BUSY, t->meta.type, "too many frames ahead of step %" PRIu64,
                             s->step);
            peer_cmd_destroy(&c);
        }
        return;
    }
    if (t->meta.step < s->step || s->finished || stall_at(s, s->step)) {
        peer_cmd_destroy(&c); /* stale (a step already taken), or the stall hook */
        return;
    }
    if (t->meta.type == FUSION__MSG_TYPE__MSG_ACTIVATION && !stage_is_first(s))
        on_activation_train(s, t);
    else if (t->meta.type == FUSION__MSG_TYPE__MSG_GRADIENT)
        on_gradient_train(s, t);
    peer_cmd_destroy(&c);
}

void stage_replay_deferred(stage_t *s)
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
                stage_on_tensor(s, c);
                again = true;
                break;
            }
        }
    }
}
