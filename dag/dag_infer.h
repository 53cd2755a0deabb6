/* dag_infer: a generation step of one pipeline stage (docs/PEER.md "Inference"): the stage's session
 * (KV cache) takes the positions in order; a run from position p truncates the session to p first (a
 * replay rebuilds the cache) and one past its end is refused (a gap); the new positions come from
 * tokens at the first stage, from the upstream's cut tensors elsewhere; after the forward the last
 * stage holds the sampled token (and lm_head's logits). The sampler's counter is the index of the
 * token being drawn: positions - prompt length, the prompt length being that of the run at position
 * 0 less the tokens generated before a failover (`resume`).
 *
 * A peer's stage drives this from its messages (peer_infer.c); `fusion run infer` is the one-stage
 * pipeline (first and last at once): the prompt at position 0, then each sampled token fed back at
 * the next position, as the broker feeds stage 0. One generation step in the code base, so the two
 * draw the same tokens.
 *
 * Threads: a dag_infer_stage is used by the thread that owns its executor. */
#ifndef FU_DAG_INFER_H
#define FU_DAG_INFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_spec.h"
#include "dag_train.h"
#include "fu_err.h"
#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_INFER_MAX_BATCH 256 /* generations one batched forward runs */

/* One stage's view of a generation. Holds no memory of its own: dag_infer_stage_init fills it, and
 * nothing needs freeing. */
typedef struct {
    dag_exec_t *x;                       /* the stage's executor (training false, slot 0 used) */
    const dag_graph_t *g;                /* its graph */
    dag_session_t *sess;                 /* the generation's session of x (borrowed) */
    bool first, last;                    /* the pipeline's first / last stage (both: one stage) */
    kern_sample_params sp;               /* the spec's temperature, top-k, top-p and seed */
    uint64_t resume;                     /* tokens generated before a failover, at the end of the
                                            position-0 run (0 on a first run) */
    uint64_t prompt_len;                 /* the prompt's positions: the sampler counter's origin (set
                                            by the run at position 0) */
    uint32_t lm_node;                    /* the graph's lm_head node, or UINT32_MAX */
    uint32_t cut_in[DAG_TRAIN_MAX_CUTS]; /* the cut inputs in ascending node id (not the first stage) */
    uint32_t n_cut_in;
    uint64_t w_in;                       /* floats per row over the cut inputs */
} dag_infer_stage;

/* Fills t for executor x of graph g (inference, its cut inputs from the executor) with session sess
 * of x (a session exists only for an inference executor). x, g and sess are borrowed and must outlive
 * t; spec is read here only. FU_EINVAL on a NULL argument, more than DAG_TRAIN_MAX_CUTS cut inputs,
 * or a stage after the first with none. */
FU_MUST_CHECK fu_err dag_infer_stage_init(dag_infer_stage *t, dag_exec_t *x, const dag_graph_t *g, dag_session_t *sess,
                                          const dag_spec *spec, bool first, bool last, uint64_t resume);

/* Makes p the session's next position: a p before the session's end truncates the session to p (a
 * replay); a p past it is a gap: FU_EPROTO with em saying so, and nothing changes. Any other error
 * is the truncation's. */
FU_MUST_CHECK fu_err dag_infer_seek(dag_infer_stage *t, uint64_t p, fu_errmsg *em);

/* Runs rows new positions at the session's end (after dag_infer_seek): tokens (rows ids) at the
 * first stage, else in, the cut inputs one after the other (rows x width each, n floats); the
 * position-0 run sets the prompt length; at the last stage the sampler draws with the counter of
 * the token at position end + rows. FU_EINVAL: no tokens at the first stage, the wrong number of
 * floats elsewhere, an id outside the vocabulary, no rows or more than the executor takes; FU_ENOMEM:
 * past the session's context; FU_ECUDA: the backend's. em then says "inference forward at position
 * P failed: ..."; the session keeps its length. */
FU_MUST_CHECK fu_err dag_infer_forward(dag_infer_stage *t, const int32_t *tokens, const float *in, size_t n,
                                       uint64_t rows, fu_errmsg *em);

/* Several generations of one stage in one forward (a batch; docs/DAG.md "Batched sessions"): ts[k]
 * (n of them, at most DAG_INFER_MAX_BATCH, all on one executor with distinct sessions) runs rows[k]
 * new positions at its session's end, as dag_infer_forward would; tokens holds their Σ rows ids
 * one generation after another at the first stage, else in holds the cut inputs one after the
 * other, Σ rows x width each (the upstream's outputs of the same batch). At the last stage each
 * draws its own token with its own sampling. The linear products run over the whole batch, so a
 * generation's bits depend on its batch (a batch of one is dag_infer_forward). Errors as
 * dag_infer_forward's; on one no session changes. */
FU_MUST_CHECK fu_err dag_infer_forward_batch(dag_infer_stage *const *ts, size_t n, const int32_t *tokens,
                                             const float *in, size_t n_floats, const uint64_t *rows, fu_errmsg *em);

/* The last stage, after dag_infer_forward: the token drawn for the position after the run. */
FU_MUST_CHECK fu_err dag_infer_sampled(const dag_infer_stage *t, int32_t *token);

/* The last forward's lm_head logits (every row with dag_exec_opts.logits_all, else the last; rows x
 * vocab floats), borrowed until the next call on the executor. FU_ENOTFOUND when the stage does not
 * run lm_head. */
FU_MUST_CHECK fu_err dag_infer_logits(const dag_infer_stage *t, const float **logits, size_t *n_floats);

#ifdef __cplusplus
}
#endif
#endif
