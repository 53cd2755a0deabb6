/* dag_merge: an adapter written into its base model's weights (`fusion model merge`), as a plain
 * Hugging Face model directory any tool loads: every targeted linear W becomes W + (alpha/r)·B·A;
 * a SALR-pruned model becomes dense (its bitmap-encoded sparse weight decoded, its frozen residual
 * salr_B·salr_A added, then the trained adapter). Everything else is copied; the weights are
 * written as float32 (torch_dtype "float32"), with config.json, tokenizer.json and
 * tokenizer_config.json beside them. Generation from the merged model equals generation from base
 * plus adapter up to the order of float sums (test_dag_cli_merge). */
#ifndef FU_DAG_MERGE_H
#define FU_DAG_MERGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    size_t merged;     /* linears that had an adapter */
    size_t densified;  /* SALR linears made dense */
    size_t tensors;    /* tensors written */
    uint64_t bytes;    /* of weights written */
} dag_merge_report;

/* Merges adapter_dir (PEFT: adapter_config.json, adapter_model.safetensors; NULL: none, which only
 * a SALR-pruned model may take: it is then just made dense) into model_dir and writes out_dir
 * (created; an existing model there is refused unless force). FU_EINVAL naming what does not fit:
 * an adapter tensor of the wrong shape, an adapter for another model, a rank in the config that its
 * tensors do not have. */
FU_MUST_CHECK fu_err dag_model_merge(const char *model_dir, const char *adapter_dir, const char *out_dir, bool force,
                                     dag_merge_report *rep, fu_errmsg *em);

#ifdef __cplusplus
}
#endif
#endif
