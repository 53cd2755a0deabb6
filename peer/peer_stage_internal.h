/* peer_stage_internal: what the compute thread's files share (peer_stage.c: the loop and the stage's
 * lifecycle; peer_train.c: fine-tuning; peer_infer.c: inference; peer_stage_verify.c: verification).
 * stage_t is the one state of the thread: only the compute thread touches it, so nothing here locks.
 * Private to those files; the I/O thread sees none of it. */
#ifndef FU_PEER_STAGE_INTERNAL_H
#define FU_PEER_STAGE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_infer.h"
#include "dag_spec.h"
#include "dag_train.h"
#include "fu_err.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "fusion.pb-c.h"
#include "peer_blob.h"
#include "peer_challenge.h"
#include "peer_internal.h"
#include "wire_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ST_MAX_CUTS DAG_TRAIN_MAX_CUTS /* cut tensors one stage boundary may carry */
#define ST_MAX_DEFER  (2 * DAG_EXEC_MAX_SLOTS) /* frames of the next step held back */
#define ST_VERIFY_KEEP  WIRE_VERIFY_KEEP_STEPS /* steps of outputs (and input hashes) kept for the broker's verification */
#define ST_VERIFY_QUEUE 64 /* verification requests a verifier holds (more are answered "unavailable") */

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
    peer_challenge_t *challenge; /* the profile challenge under way, NULL before the first */

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
    dag_train_stage train;    /* the fine-tuning step (dag_train): shared with `fusion run finetune` */
    float *rx;                /* a received cut tensor decoded from its wire codec (rx_cap floats) */
    size_t rx_cap;
    uint32_t fwd_done, bwd_done;
    double loss_sum;          /* sum over micro-batches of their mean loss */
    double eval_sum;          /* eval: sum of the counted targets' losses of the step */
    int64_t tokens_sum;
    peer_cmd *defer[ST_MAX_DEFER]; /* frames of a later step, in arrival order */
    size_t n_defer;
    int32_t *tok, *tgt;       /* one micro-batch of tokens / targets */

    /* inference */
    dag_session_t *sess;
    dag_infer_stage infer;    /* the generation step (dag_infer), shared with `fusion run infer` */
    int32_t *prompt;          /* stage 0: prompt tokens */
    size_t n_prompt;
    bool pending_fwd;         /* stage 0: the current step's forwards are due (inference, one stage:
                                 the token just sampled, next_pos and next_tok, is its next input) */
    bool ring_in, ring_out;   /* the ring (fusion.proto LinkRole) closed: stage 0 takes tokens from the
                                 last stage straight (ring_in); the last stage sends them there (ring_out) */
    int32_t eos[FU_MODELCFG_MAX_EOS]; /* StageAssign.eos_ids: the last stage feeds no token after one */
    size_t n_eos;
    int32_t *hist;            /* stage 0: the token at each position of the session, [0, session length) */
    size_t hist_cap;
    uint64_t next_pos;        /* one stage: the position of the token to feed back (pending_fwd) */
    int32_t next_tok;
    uint64_t ring_taken;      /* stage 0: tokens taken from the ring before the broker's copy came */

    /* a serving job (spec.sessions > 0; peer_serve.c) */
    struct st_session *ss;    /* its sessions */
    size_t n_ss, cap_ss;
    uint64_t ctx_rows;        /* positions of one session (the job's context) */
    size_t ss_widest;         /* the most sessions one forward ran so far (logged as it grows) */

    /* verification (docs/PIPELINE.md "Verification") */
    double verify;            /* StageAssign.verify: > 0 makes the stage keep its recent outputs and input hashes */
    float *kept[ST_VERIFY_KEEP][DAG_EXEC_MAX_SLOTS]; /* outputs as sent (activations; the last stage: the
                                                        gradients it sends up) of recent steps, by step % KEEP */
    uint8_t kept_in[ST_VERIFY_KEEP][DAG_EXEC_MAX_SLOTS][WIRE_VERIFY_HASH_BYTES]; /* stage > 0: BLAKE2b-256 of
                                                        each input received */
    bool kept_in_ok[ST_VERIFY_KEEP][DAG_EXEC_MAX_SLOTS]; /* that hash is set */
    uint64_t kept_step[ST_VERIFY_KEEP]; /* the step each row of kept / kept_in holds */
    /* Snapshots of the stage's state at the start of each recent step that has no checkpoint (a
     * verifier restores one: VerifyRequest.snapshot), the serialized executor state. */
    uint8_t *snap[ST_VERIFY_KEEP];
    size_t snap_len[ST_VERIFY_KEEP];
    uint64_t snap_step[ST_VERIFY_KEEP]; /* the step each holds (valid when snap[r] != NULL) */
    bool snap_sent[ST_VERIFY_KEEP];     /* uploaded already (one upload serves every micro-batch) */
    size_t kept_n;            /* floats of one output */
    verify_req vq[ST_VERIFY_QUEUE]; /* verifier: requests to answer, in arrival order */
    size_t n_vq;
    Fusion__VerifyRequest late[ST_VERIFY_QUEUE]; /* FOR TESTS ONLY (peer_faults.h, PEER_VERIFY_LATE_ENV): the
                                                    stage's requests held until it moved past their step */
    size_t n_late;            /* how many */
    int64_t vstate_step;      /* verifier: step whose adapter state the executor holds, -1: none */
    bool vfetching;           /* verifier: the checkpoint of step vfetch_step is being fetched */
    uint64_t vfetch_step;     /* verifier: which */
} stage_t;

/* ---- peer_stage.c: the pipe to the I/O thread, errors, blob fetches -------------------------- */

/* Hands c to the I/O thread (takes it; a pipe that fails drops it with a warning). */
void stage_to_io(stage_t *s, peer_cmd *c);
/* Sends body to the broker as a message of `type` for this stage's job, envelope step `step`. */
void stage_send_msg(stage_t *s, Fusion__MsgType type, uint64_t step, const ProtobufCMessage *body);
/* Logs the formatted text and sends it to the broker as an Error{code} answering `about`. */
void stage_send_error(stage_t *s, Fusion__ErrorCode code, Fusion__MsgType about, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A backend failure: reports it, ends the stage and tells the I/O thread that the peer must leave. */
void stage_fatal(stage_t *s, fu_err rc, const char *what);
/* An executor error: the backend's own (FU_ECUDA) is fatal; any other ends this stage with an Error. */
void stage_exec_failed(stage_t *s, fu_err rc, const char *what);
/* Appends a blob to fetch (from the weight cache when cached). */
void stage_add_fetch(stage_t *s, const char *model_id, const char *name, fetch_kind kind, bool cached);
/* Asks the broker for the next window of the blob being fetched, if one is due. */
void stage_ask_next(stage_t *s);
/* A scratch file name in the cache directory for this process, job and stage (the caller frees). */
char *stage_scratch_path(const stage_t *s, const char *what);

static inline bool stage_is_infer(const stage_t *s)
{
    return s->spec.kind == DAG_JOB_INFER;
}

/* An eval runs the fine-tune's data order and flow forward only: the last stage adds up the loss,
 * and a one-float acknowledgement goes up the pipeline instead of the gradient (the same pacing). */
static inline bool stage_is_eval(const stage_t *s)
{
    return s->spec.kind == DAG_JOB_EVAL;
}

/* A serving job: sessions opened and closed while it runs (peer_serve.c). */
static inline bool stage_is_serve(const stage_t *s)
{
    return s->spec.kind == DAG_JOB_INFER && s->spec.sessions > 0;
}

static inline bool stage_is_first(const stage_t *s)
{
    return s->stage_index == 0;
}

static inline bool stage_is_last(const stage_t *s)
{
    return s->stage_index + 1 == s->stage_count;
}

/* ---- peer_train.c: fine-tuning ----------------------------------------------------------------- */

/* The rows of micro-batch mb of step `step` in the pipeline's data order (docs/PIPELINE.md). */
FU_MUST_CHECK fu_err stage_spec_rows(const stage_t *s, const int32_t *ids, size_t n_ids, uint64_t step, uint32_t mb,
                                     int32_t *tokens, int32_t *targets);
/* Whether step `step` of the job has a checkpoint (its state is ckpt:<stage>:<step>; step 0: the
 * seeded initial adapter), else a verifier needs the stage's snapshot of it. */
bool stage_step_has_ckpt(const stage_t *s, uint64_t step);
/* Sends blob (the serialized state at the start of step `at`) to the broker in CheckpointPut chunks,
 * as a checkpoint or as a verification snapshot. */
void stage_send_state(stage_t *s, uint64_t at, const uint8_t *blob, size_t len, bool snapshot);
/* With verification on, keeps the state at the start of step `at` (no checkpoint there) for the
 * verifier: the ring snap. */
void stage_keep_snapshot(stage_t *s, uint64_t at);

/* Restores the executor from a checkpoint blob (contract names) whose step must be s->resume_step. */
FU_MUST_CHECK fu_err stage_restore_ckpt(stage_t *s, const uint8_t *data, size_t len, fu_errmsg *em);
/* The cut outputs of slot m after a forward (total floats) into out. */
FU_MUST_CHECK fu_err stage_collect_outputs(stage_t *s, uint32_t slot, size_t total, float *out);
/* The gradient w.r.t. the cut inputs after a backward (total floats, zeroed by the caller) into out. */
FU_MUST_CHECK fu_err stage_collect_input_grads(stage_t *s, uint64_t rows, size_t total, float *out);
/* Sends the cut outputs of slot m downstream as the activation of (step, mb). */
FU_MUST_CHECK fu_err stage_send_outputs(stage_t *s, uint32_t slot, uint64_t step, uint32_t mb, uint64_t rows);
/* Publishes where a fine-tuning stage is (peer_shared.progress). */
void stage_publish_progress(const stage_t *s);
/* Stage 0: forward every micro-batch of the current step. */
void stage_run_forwards(stage_t *s);
/* A rows x dim1 tensor of dtype (len bytes of data, taken) to the neighbour `role`, as message `type`
 * of (step, mb), through the I/O thread. */
void stage_send_tensor(stage_t *s, Fusion__LinkRole role, Fusion__MsgType type, uint64_t step, uint32_t mb,
                       Fusion__Dtype dtype, uint64_t rows, uint64_t dim1, uint8_t *data, size_t len);
/* A frame from a neighbour (takes c): run now, held for a later step, or dropped. */
void stage_on_tensor(stage_t *s, peer_cmd *c);
/* Runs the held frames of the current step, in arrival order. */
void stage_replay_deferred(stage_t *s);

/* ---- peer_serve.c: a serving job's sessions ---------------------------------------------------- */

typedef struct st_session st_session;
/* SessionStart or SessionEnd from the broker. */
void stage_serve_on_msg(stage_t *s, const wire_msg_t *m);
/* Stage 0: a session's token from the broker. */
void stage_serve_on_token(stage_t *s, const Fusion__InferToken *it);
/* A frame of a session (Envelope.micro_batch) from a neighbour. */
void stage_serve_on_tensor(stage_t *s, const wire_tensor *t);
/* Runs every queued session input in one batched forward, and sends what it made. */
void stage_serve_run(stage_t *s);
/* Frees every session. */
void stage_serve_clear(stage_t *s);

/* ---- peer_infer.c: inference ------------------------------------------------------------------- */

/* Runs rows new positions starting at p (tokens for stage 0, else the upstream's activation act). */
void stage_infer_forward(stage_t *s, uint64_t p, const int32_t *tokens, const float *act, uint64_t rows);
/* Stage 0: the broker's InferToken, the input of the next position (or the confirmation of a token
 * the ring brought first). */
void stage_on_infer_token(stage_t *s, const Fusion__InferToken *it);
/* A frame from a neighbour of an inference stage (the upstream's activations; at stage 0 the last
 * stage's token over the ring). */
void stage_infer_on_tensor(stage_t *s, const wire_tensor *t);
/* One stage: feeds back the token it sampled last (pending_fwd), unless something came meanwhile. */
void stage_infer_next(stage_t *s);

/* ---- peer_stage_verify.c: verification ---------------------------------------------------------- */

/* Row of the verification ring for `step`, emptied first when it held another step. */
size_t stage_kept_row(stage_t *s, uint64_t step);
/* Whether this stage keeps its outputs and input hashes of micro-batch mb for verification. */
bool stage_keeps_for_verify(const stage_t *s, uint32_t mb);
/* The output of (step, mb) (total floats) is about to be sent: keeps a copy when verifying (and
 * applies the test-only fault hook, peer_verify.h). */
bool stage_output_produced(stage_t *s, uint64_t step, uint32_t mb, float *f, size_t total);
/* A fine-tune's or eval's cut floats x of one side (out: the cut outputs, else the cut inputs) of
 * (step, mb) as the neighbour decodes them in codec c (dag_train_wire_send): x is replaced by that,
 * and *wire (NULL for f32: x goes as it is; caller frees) receives the bytes to send, *len their size. */
FU_MUST_CHECK fu_err stage_wire_encode(stage_t *s, kern_codec c, bool out, uint64_t step, uint32_t mb, float *x,
                                       uint8_t **wire, size_t *len);
/* Gives up on queued requests whose input has not come in time. */
void stage_verify_expire(stage_t *s);
/* The verifier's checkpoint fetch ended: ok, or not (why); answers or goes on with the queue. */
void stage_verify_fetched(stage_t *s, bool ok, const char *why);
/* The broker's VerifyRequest: answered from the kept outputs, or queued for the verifier. */
void stage_on_verify_request(stage_t *s, const Fusion__VerifyRequest *r);
/* The test-only late-verification hook (peer_faults.h): answers the held requests the stage has moved
 * WIRE_VERIFY_KEEP_STEPS steps past (all of them once it finished); a no-op without held ones. */
void stage_verify_late_replay(stage_t *s);
/* The broker's VerifyDeliver: hands the kept output to the I/O thread for the verifier. */
void stage_on_verify_deliver(stage_t *s, const Fusion__VerifyDeliver *d);
/* A delivered input for a queued request (takes c). */
void stage_on_verify_input(stage_t *s, peer_cmd *c);

#ifdef __cplusplus
}
#endif
#endif
