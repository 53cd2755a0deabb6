/* dag_chain: a fine-tuning pipeline in one process. `fusion run finetune` trains through it: one
 * stage (the whole graph) by default, or the stages a broker would run, cut at given nodes
 * (`--cuts`), with each micro-batch's cut tensors handed down and their gradients up through the
 * job's wire codecs, encoded and decoded exactly as peers do (dag_train_wire_*). Every stage is a
 * dag_train_stage, the code a peer runs, and micro-batches go in the pipeline's order (each one's
 * forward through every stage, then its backward back up; AdamW on every stage after the M-th), so
 * with a pipeline's cuts and codecs the adapter has the pipeline's bits.
 *
 * Threads: a dag_chain is used by one thread. */
#ifndef FU_DAG_CHAIN_H
#define FU_DAG_CHAIN_H

#include <stddef.h>
#include <stdint.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_spec.h"
#include "dag_train.h"
#include "fu_err.h"
#include "fu_safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_CHAIN_MAX_STAGES 64

typedef struct {
    size_t n;                               /* stages */
    dag_exec_t *x[DAG_CHAIN_MAX_STAGES];    /* stage k runs nodes [cuts[k-1], cuts[k]) */
    dag_train_stage t[DAG_CHAIN_MAX_STAGES];
    float *act, *grad;                      /* scratch: the largest cut tensor, decoded */
    uint8_t *wire;                          /* scratch: the same, encoded */
} dag_chain;

/* Makes the chain of g (valid, and outliving the chain) cut before nodes cuts[0..n_cuts) (strictly
 * increasing, inside the graph; none: one stage), each stage an executor with opts o (first and last
 * set here) loading its weights from st (borrowed: it must stay open), training as spec says on ids
 * (borrowed). FU_EINVAL with em saying why when a cut is out of order or out of range, when a stage
 * would have no cut tensor towards a neighbour, when a node reads across a whole stage, or when the
 * stages disagree on what crosses a cut. */
FU_MUST_CHECK fu_err dag_chain_new(dag_chain *c, const dag_graph_t *g, const dag_exec_opts *o, const fu_safetensors *st,
                                   const size_t *cuts, size_t n_cuts, const dag_spec *spec, const int32_t *ids,
                                   size_t n_ids, fu_errmsg *em);
/* Frees what c holds. NULL-safe and idempotent. */
void dag_chain_clear(dag_chain *c);

/* One optimizer step: every micro-batch forward and back through the stages, then AdamW on each.
 * *loss receives the mean over micro-batches of their mean loss. em says which stage failed. */
FU_MUST_CHECK fu_err dag_chain_step(dag_chain *c, uint64_t step, double *loss, fu_errmsg *em);

/* Trainable parameters of every stage. */
size_t dag_chain_trainable_params(const dag_chain *c);

/* Writes the stages' adapters as one PEFT adapter into dir (dag_exec_save_adapters). */
FU_MUST_CHECK fu_err dag_chain_save_adapter(const dag_chain *c, const char *dir, const char *base_model, fu_errmsg *em);

#ifdef __cplusplus
}
#endif
#endif
