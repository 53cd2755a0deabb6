/* dag_train: a fine-tuning step of one pipeline stage, in the pipeline's order (docs/PIPELINE.md):
 * the inputs of micro-batch m (its token windows in the data order at the first stage, its targets
 * at the last, the upstream cut tensors elsewhere), forward; at the last stage the loss with its
 * gradient scaled by 1/M, elsewhere the downstream gradient, backward; AdamW after the M-th
 * backward. The peer's stages drive these from their messages; `fusion run finetune` is the
 * one-stage pipeline (first and last at once) and drives them with dag_train_run_step. One training
 * step in the code base, so the two give the same bits.
 *
 * Threads: a dag_train_stage is used by the thread that owns its executor. */
#ifndef FU_DAG_TRAIN_H
#define FU_DAG_TRAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_exec.h"
#include "dag_spec.h"
#include "fu_err.h"
#include "kern_codec.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_TRAIN_MAX_CUTS 16 /* most cut tensors on one side of a stage (the peer's ST_MAX_CUTS) */

/* One stage's view of a fine-tune. */
typedef struct {
    dag_exec_t *x;                       /* the stage's executor (training, n_slots >= 1) */
    const dag_graph_t *g;                /* its graph */
    const dag_spec *spec;                /* the job's spec (batch, M, seq_len, data order, optimizer) */
    const int32_t *ids;                  /* the job's tokens (needed at the first and the last stage) */
    size_t n_ids;
    bool first, last;                    /* the pipeline's first / last stage (both: one stage) */
    uint32_t n_slots;                    /* executor slots: micro-batch m uses slot m % n_slots */
    uint32_t cut_in[DAG_TRAIN_MAX_CUTS]; /* the cut inputs in ascending node id (not the first stage) */
    uint32_t n_cut_in;
    uint32_t cut_out[DAG_TRAIN_MAX_CUTS]; /* the cut outputs (not the last stage) */
    uint32_t n_cut_out;
    int32_t *tok, *tgt;                  /* scratch: B/M x seq_len each (owned) */
    float *ef;                           /* int8-ef: each micro-batch's gradient residual, one block of
                                            dag_train_cut_floats(t, false) each (owned; NULL until used) */
    uint64_t *ef_from;                   /* per micro-batch: the checkpoint step its residual counts from */
} dag_train_stage;

/* Fills t for executor x of graph g (its cut tensors from the executor). spec, ids and g are
 * borrowed and must outlive t. FU_EINVAL when a side has more than DAG_TRAIN_MAX_CUTS cut tensors,
 * when a middle or last stage has no cut input or a first or middle stage no cut output. */
FU_MUST_CHECK fu_err dag_train_stage_init(dag_train_stage *t, dag_exec_t *x, const dag_graph_t *g, const dag_spec *spec,
                                          const int32_t *ids, size_t n_ids, bool first, bool last, uint32_t n_slots);
/* Frees the scratch. NULL-safe. */
void dag_train_stage_clear(dag_train_stage *t);

/* Rows (tokens) of one micro-batch: B/M sequences of seq_len. */
uint64_t dag_train_rows(const dag_train_stage *t);

/* Micro-batch m of step `step`: its inputs, then forward. in holds the cut inputs one after the
 * other (rows x width each), n floats; NULL at the first stage. */
FU_MUST_CHECK fu_err dag_train_forward(dag_train_stage *t, uint64_t step, uint32_t m, const float *in, size_t n);

/* Backward of micro-batch m (after its forward). At the last stage the loss is the gradient's source
 * (*loss and *n_valid receive the micro-batch's mean loss and its counted targets; grad NULL);
 * elsewhere grad holds the gradients of the cut outputs one after the other, n floats. */
FU_MUST_CHECK fu_err dag_train_backward(dag_train_stage *t, uint32_t m, const float *grad, size_t n, float *loss,
                                        int64_t *n_valid);

/* ---- the wire: one micro-batch's cut tensors of one side (out: the cut outputs, which go down as
 * activations and come back as their gradients; else the cut inputs), one after the other, rows x
 * width each, each block in codec c (kern_codec.h: an int8 row is a row of its block). ---- */

/* Floats of one micro-batch's cut tensors of the side. */
size_t dag_train_cut_floats(const dag_train_stage *t, bool out);
/* Bytes of the same in codec c (0 for an unknown codec). */
size_t dag_train_wire_bytes(const dag_train_stage *t, kern_codec c, bool out);
/* Writes x (dag_train_cut_floats(t, out) floats) in codec c to bytes (dag_train_wire_bytes). */
void dag_train_wire_encode(const dag_train_stage *t, kern_codec c, bool out, const float *x, uint8_t *bytes);
/* Reads len bytes in codec c into x. FU_EPROTO when len is not dag_train_wire_bytes or a value is
 * malformed (kern_codec_decode). */
FU_MUST_CHECK fu_err dag_train_wire_decode(const dag_train_stage *t, kern_codec c, bool out, const uint8_t *bytes,
                                           size_t len, float *x);

/* One micro-batch's cut floats x of one side (out: activations going down; else gradients going up)
 * of micro-batch m of step `step` on their way to the neighbour in codec c: written to wire
 * (dag_train_wire_bytes(t, c, out) bytes; nothing for f32) and x replaced by what the receiver
 * decodes. int8-ef (gradients only) adds the micro-batch's residual (what its last encoding lost)
 * before encoding and keeps what this one loses; every residual starts at zero at each checkpoint
 * step (0 and the multiples of checkpoint_every), so a run resumed from a checkpoint sends the same
 * bits. FU_EPROTO when a value cannot be carried (a NaN or an infinity in int8). */
FU_MUST_CHECK fu_err dag_train_wire_send(dag_train_stage *t, kern_codec c, bool out, uint64_t step, uint32_t m,
                                         float *x, uint8_t *wire);

/* The optimizer step after the M-th backward. */
FU_MUST_CHECK fu_err dag_train_step(dag_train_stage *t);

/* A whole step of a one-stage pipeline (first and last): M micro-batches in order, each forward and
 * backward, then AdamW. *loss receives the mean over micro-batches of their mean loss. */
FU_MUST_CHECK fu_err dag_train_run_step(dag_train_stage *t, uint64_t step, double *loss);

#ifdef __cplusplus
}
#endif
#endif
