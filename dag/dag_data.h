/* dag_data: the training data order of docs/PIPELINE.md ("Data order"), shared by `fusion run
 * finetune` and every pipeline stage so that both see the same windows in the same order.
 *
 * The tokenized text is cut into W = floor(n_tokens / (seq_len+1)) non-overlapping windows of
 * seq_len+1 tokens. Row j of micro-batch m of step s (0-based) uses window order[k mod W] with
 * k = s·B + m·(B/M) + j, where order is the identity, or with shuffle a Fisher-Yates permutation of
 * 0..W-1 drawn from fu_rng seeded with seed + epoch, epoch = k div W (a fresh order every pass).
 * A row's inputs are the window's first seq_len tokens, its targets the last seq_len.
 *
 * A token the loss must not count (a prompt, a padding: dag_dataset.h) is stored as -(id + 1)
 * (DAG_DATA_MASKED): it is an input like any other, and as a target it becomes DAG_DATA_IGNORE,
 * which the cross-entropy skips. */
#ifndef FU_DAG_DATA_H
#define FU_DAG_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_DATA_IGNORE (-100)               /* a target the loss skips (Hugging Face's ignore_index) */
#define DAG_DATA_MASKED(id) (-(int32_t)(id)-1) /* id as input only: its target does not count */
#define DAG_DATA_ID(v) ((v) < 0 ? -((v) + 1) : (v)) /* the token id of a stored value */

typedef struct {
    uint32_t batch;         /* B: sequences per step */
    uint32_t micro_batches; /* M: divides B */
    uint32_t seq_len;       /* tokens per sequence */
    bool shuffle;           /* a seeded permutation per pass instead of file order */
    uint64_t seed;          /* the shuffle's seed */
} dag_data_order;

/* Windows in n_ids tokens for o's seq_len. */
size_t dag_data_windows(const dag_data_order *o, size_t n_ids);

/* Writes the B/M rows of micro-batch mb of step `step`: inputs into tokens and targets into
 * targets (either may be NULL), each (B/M)·seq_len long. FU_EINVAL when there is no whole window
 * or the sizes are inconsistent (M = 0, M not dividing B, mb ≥ M, seq_len 0). Pure: the same
 * arguments always give the same rows. */
FU_MUST_CHECK fu_err dag_data_rows(const dag_data_order *o, const int32_t *ids, size_t n_ids, uint64_t step,
                                   uint32_t mb, int32_t *tokens, int32_t *targets);

#ifdef __cplusplus
}
#endif
#endif
