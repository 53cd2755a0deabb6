/* dag_exec: the autograd executor. Runs a contiguous node range [first, last) of a DAG on a kern
 * backend: forward in topological order, backward in reverse with one backward per op, keeping
 * only what backward needs (LoRA-FA keeps X·Aᵀ, never X; attention keeps q, k, v; rmsnorm its
 * input; nothing at all for nodes whose backward cannot reach a trained adapter).
 *
 * A range's inputs and outputs are its cut tensors: outputs of nodes before `first` that nodes in
 * the range read (cut inputs), and outputs of nodes in the range that nodes at or after `last` read
 * (cut outputs). One executor therefore runs the whole DAG or one pipeline stage:
 *
 *   set_tokens / set_input  →  forward  →  get_output / loss
 *   set_output_grad         →  backward →  get_input_grad      (repeat per micro-batch)
 *   step                                                       (AdamW on the stage's adapters)
 *
 * Micro-batches in flight use slots: a slot holds one micro-batch's saved activations from its
 * forward until its backward. Adapter gradients accumulate over micro-batches until step.
 * Inference runs through sessions, each with its own KV cache per attention node.
 *
 * Buffers come from a pool that is filled during the first step and reused afterwards: a steady
 * state step allocates nothing. One executor is used by one thread at a time. */
#ifndef FU_DAG_EXEC_H
#define FU_DAG_EXEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_graph.h"
#include "fu_err.h"
#include "fu_file.h"
#include "fu_safetensors.h"
#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_EXEC_MAX_SLOTS 64 /* most micro-batches in flight per executor */

typedef struct {
    const kern_backend_t *be; /* backend (NULL: the CPU backend) */
    size_t first;             /* first node of the range */
    size_t last;              /* one past the last node (0: the end of the graph) */
    uint32_t max_tokens;      /* most rows (tokens) one forward processes */
    uint32_t n_slots;         /* micro-batches whose saved activations may be held at once (0: 1) */
    bool training;            /* keep activations for backward; adapters trainable */
    bool logits_all;          /* inference: logits for every row (else only the last row) */
    bool widen_weights;       /* widen bf16/f16 weights to f32 at load; by default a backend that multiplies
                                 16-bit weights (kern_backend_t.weight_dtypes: the CPU) keeps the embedding,
                                 dense linears and lm_head in their precision, mapped from the file */
    uint32_t max_context;     /* inference: KV cache positions per session (0: max_tokens) */
    uint64_t seed;            /* adapter initialisation (Kaiming-uniform A, zero B) */
    bool lorafa_correction;   /* LoRA-FA: precondition B's gradient with (A·Aᵀ)⁻¹/s² before each
                                 step (PEFT's LoRA-FA optimizer; the published method does not) */
    void (*yield)(void *arg); /* called before each node's forward and backward (NULL: none): where
                                 the caller may pause or throttle the computation; it must not use
                                 the executor */
    void *yield_arg;          /* its argument */
} dag_exec_opts;

typedef struct dag_exec dag_exec_t;
typedef struct dag_session dag_session_t;

/* Makes an executor for g's nodes [first, last). g must be valid (dag_graph_validate) and outlive
 * the executor. FU_EINVAL on bad options (empty range, max_tokens 0), FU_ENOSYS for SALR on a
 * backend without sparse kernels. em (may be NULL) says why. */
FU_MUST_CHECK fu_err dag_exec_new(const dag_graph_t *g, const dag_exec_opts *o, dag_exec_t **out, fu_errmsg *em);
/* Frees everything (sessions must be destroyed first); idempotent; sets *self_p NULL. */
void dag_exec_destroy(dag_exec_t **self_p);

/* Loads the range's parameters from a model's tensors (f16/bf16/f32 converted to f32 once) and
 * initialises its adapters from opts.seed. On the CPU, aligned F32 tensors are used in place: st
 * must then stay open as long as the executor lives. SALR linears read the bitmap-encoded sparse
 * weight (<name>.bitmap/.values/.offsets) or a dense one (encoded here), and the frozen residual
 * adapter. FU_ENOTFOUND / FU_EINVAL / FU_EPROTO with a message naming the tensor. */
FU_MUST_CHECK fu_err dag_exec_load_weights(dag_exec_t *self, const fu_safetensors *st, fu_errmsg *em);

/* Replaces the adapters of the range with a PEFT adapter's tensors
 * (base_model.model.<module>.lora_A.weight [r, in] / lora_B.weight [out, r]). Every adapter of the
 * range must be present with the graph's rank. Optimizer state is reset. */
FU_MUST_CHECK fu_err dag_exec_load_adapter(dag_exec_t *self, const fu_safetensors *st, fu_errmsg *em);

/* Writes the range's adapters in PEFT format into dir (made if needed): adapter_model.safetensors
 * (A saved even when frozen) and adapter_config.json (peft_type LORA, r, lora_alpha,
 * target_modules, task_type CAUSAL_LM, base_model_name_or_path = base_model). */
FU_MUST_CHECK fu_err dag_exec_save_adapter(const dag_exec_t *self, const char *dir, const char *base_model,
                                           fu_errmsg *em);
/* The same for the ranges of n executors of one graph (a pipeline's stages in one process), written
 * as one adapter. */
FU_MUST_CHECK fu_err dag_exec_save_adapters(const dag_exec_t *const *xs, size_t n, const char *dir,
                                            const char *base_model, fu_errmsg *em);

/* Checkpoint, in the pipeline's one format (docs/FORMATS.md): the adapters under their PEFT names,
 * each AdamW moment beside its tensor (<name>.adam_m, <name>.adam_v) and the optimizer's step
 * count (metadata "adam_t"). save_state writes one atomically to path; state_serialize makes the
 * same bytes in memory (*out, caller frees) with metadata "step" = step, the job's step it
 * follows; load_state reads one back (the same graph range) from an open or parsed file. */
FU_MUST_CHECK fu_err dag_exec_save_state(const dag_exec_t *self, const char *path, fu_errmsg *em);
FU_MUST_CHECK fu_err dag_exec_state_serialize(const dag_exec_t *self, uint64_t step, uint8_t **out, size_t *len,
                                              fu_errmsg *em);
FU_MUST_CHECK fu_err dag_exec_load_state(dag_exec_t *self, const fu_safetensors *st, fu_errmsg *em);

/* Cut tensors of the range: node ids (ascending) written to ids[0..cap), count returned. */
size_t dag_exec_cut_inputs(const dag_exec_t *self, uint32_t *ids, size_t cap);
size_t dag_exec_cut_outputs(const dag_exec_t *self, uint32_t *ids, size_t cap);

/* The micro-batch of a slot: n_seq sequences of seq_len tokens (rows n_seq·seq_len ≤ max_tokens).
 * targets may be NULL when the range has no cross_entropy. Needed by ranges with embedding, rope,
 * attention or cross_entropy nodes (call it for every stage). In a session (dag_exec_session_use),
 * n_seq must be 1 and positions continue the session's cache. Token and target ids are checked
 * against the vocabulary (targets may be -100: ignored). */
FU_MUST_CHECK fu_err dag_exec_set_tokens(dag_exec_t *self, uint32_t slot, const int32_t *tokens,
                                         const int32_t *targets, uint32_t n_seq, uint32_t seq_len);
/* A batched inference forward (docs/DAG.md "Batched sessions"): the slot's rows are the new
 * positions of n distinct sessions of this executor, rows[k] of sess[k], one session after another
 * (Σ rows ≤ max_tokens); tokens (Σ rows ids, may be NULL where the range has no embedding) as in
 * set_tokens, cut inputs through set_input. Each session's positions continue its own cache and its
 * rows attend to it alone; lm_head sees the last row of each session (every row with logits_all),
 * and the sample node draws for each with the session's own parameters (dag_session_set_sampling),
 * read back with dag_session_sampled. Linear products run over all the rows at once, so a session's
 * bits depend on the batch it ran in (one session alone: those of set_tokens with it attached).
 * The sessions must outlive the forward. FU_EINVAL: a NULL or foreign session, one given twice,
 * a zero row count, too many rows, a token outside the vocabulary, a training executor; FU_ENOMEM:
 * a session past max_context. */
FU_MUST_CHECK fu_err dag_exec_set_batch(dag_exec_t *self, uint32_t slot, dag_session_t *const *sess,
                                        const uint32_t *rows, uint32_t n, const int32_t *tokens);
/* Gives cut input `node` of a slot: rows × width floats (host memory, copied), rows being those of
 * the slot's dag_exec_set_tokens (call that first). FU_EINVAL when node is not a cut input. */
FU_MUST_CHECK fu_err dag_exec_set_input(dag_exec_t *self, uint32_t slot, uint32_t node, const float *data,
                                        size_t n_floats);
/* Runs the range forward for a slot. */
FU_MUST_CHECK fu_err dag_exec_forward(dag_exec_t *self, uint32_t slot);
/* Output of node `node` (a cut output, or any node of the range still held, such as lm_head's
 * logits) after forward: host pointer valid until the next call on the executor, and its size. */
FU_MUST_CHECK fu_err dag_exec_get_output(dag_exec_t *self, uint32_t slot, uint32_t node, const float **data,
                                         size_t *n_floats);
/* The outputs of cut nodes ids[0..n) of a slot after its forward, one after the other, into out:
 * exactly cap floats, else FU_EINVAL. */
FU_MUST_CHECK fu_err dag_exec_gather_outputs(dag_exec_t *self, uint32_t slot, const uint32_t *ids, size_t n,
                                             float *out, size_t cap);
/* Mean cross-entropy of the slot's last forward and the number of target tokens it covered. */
FU_MUST_CHECK fu_err dag_exec_loss(const dag_exec_t *self, uint32_t slot, float *loss, int64_t *n_valid);
/* The token the sample node drew in the slot's last forward. */
FU_MUST_CHECK fu_err dag_exec_sampled(const dag_exec_t *self, uint32_t slot, int32_t *token);
/* Sampling parameters and draw counter of the sample node (defaults: greedy, counter 0). */
void dag_exec_set_sampling(dag_exec_t *self, const kern_sample_params *p, uint64_t counter);

/* Gradient of the loss w.r.t. cut output `node` (rows × width host floats, copied). A cut output
 * with no gradient given counts as zero. */
FU_MUST_CHECK fu_err dag_exec_set_output_grad(dag_exec_t *self, uint32_t slot, uint32_t node, const float *data,
                                              size_t n_floats);
/* Backward of the slot's forward. loss_scale multiplies the cross-entropy gradient (1/M to average
 * M micro-batches). Accumulates adapter gradients; releases the slot's saved activations. */
FU_MUST_CHECK fu_err dag_exec_backward(dag_exec_t *self, uint32_t slot, float loss_scale);
/* Gradient w.r.t. cut input `node` after backward (host pointer valid until the next call); NULL
 * with n 0 when no gradient reaches it (nothing trainable before it). */
FU_MUST_CHECK fu_err dag_exec_get_input_grad(dag_exec_t *self, uint32_t node, const float **data,
                                             size_t *n_floats);
/* The gradients of cut inputs ids[0..n) after a backward, rows x width each, one after the other,
 * zeros where none reaches, into out: exactly cap floats, else FU_EINVAL. */
FU_MUST_CHECK fu_err dag_exec_gather_input_grads(dag_exec_t *self, const uint32_t *ids, size_t n, uint64_t rows,
                                                 float *out, size_t cap);
/* AdamW step on every trained adapter tensor of the range with the accumulated gradients, which are
 * then zeroed. The step count starts at 1. */
FU_MUST_CHECK fu_err dag_exec_step(dag_exec_t *self, const kern_adamw_params *p);
int64_t dag_exec_steps_done(const dag_exec_t *self);

/* Borrowed adapter tensors of linear node `node` (NULL where absent): the trained A [r, in] and
 * B [out, r] and their accumulated gradients. For tests and tools; after changing A or B of a SALR
 * node call dag_exec_adapter_changed. FU_EINVAL when the node has no adapter in this range. */
FU_MUST_CHECK fu_err dag_exec_adapter(dag_exec_t *self, uint32_t node, kern_tensor_t **A, kern_tensor_t **B,
                                      kern_tensor_t **dA, kern_tensor_t **dB);
FU_MUST_CHECK fu_err dag_exec_adapter_changed(dag_exec_t *self, uint32_t node);

/* Bytes of activations held for backward: now, and the most seen since creation. */
size_t dag_exec_saved_bytes(const dag_exec_t *self);
size_t dag_exec_saved_bytes_peak(const dag_exec_t *self);
/* Trainable parameters (elements) of the range. */
size_t dag_exec_trainable_params(const dag_exec_t *self);

/* Inference sessions: each has its own KV cache for every attention node of the range. A session
 * is attached with session_use; forwards then append to its cache. FU_EINVAL in training mode. */
FU_MUST_CHECK fu_err dag_exec_session_new(dag_exec_t *self, dag_session_t **out);
void dag_exec_session_destroy(dag_session_t **s_p);
/* Attaches s (NULL detaches) to the executor. */
void dag_exec_session_use(dag_exec_t *self, dag_session_t *s);
/* Positions cached by the session. */
int64_t dag_session_len(const dag_session_t *s);
/* A batched forward's sampling for session s: parameters (NULL keeps them) and the draw counter. */
void dag_session_set_sampling(dag_session_t *s, const kern_sample_params *p, uint64_t counter);
/* The token the last batched forward drew for s; FU_EINVAL before any. */
FU_MUST_CHECK fu_err dag_session_sampled(const dag_session_t *s, int32_t *token);
/* Forgets cached positions ≥ len (replay from a point). */
FU_MUST_CHECK fu_err dag_session_truncate(dag_session_t *s, int64_t len);

#ifdef __cplusplus
}
#endif
#endif
