/* dag_peft: Hugging Face PEFT's adapter format, as far as fusion writes it. The tensors
 * (adapter_model.safetensors, names base_model.model.<module>.lora_A/lora_B.weight) come from the
 * executor; this module writes the adapter_config.json that goes with them, for the single-process
 * path (dag_exec_save_adapter) and the broker's assembled result alike. */
#ifndef FU_DAG_PEFT_H
#define FU_DAG_PEFT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_graph.h"
#include "fu_err.h"
#include "fu_safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_PEFT_CONFIG_FILE  "adapter_config.json"
#define DAG_PEFT_WEIGHTS_FILE "adapter_model.safetensors"
#define DAG_PEFT_PREFIX       "base_model.model."
#define DAG_PEFT_NAME_MAX     (DAG_NAME_MAX + 96)
#define DAG_PEFT_PER_NODE     6 /* lora_A, lora_B and AdamW's two moments of each */

/* One adapter tensor (float32, 2-D) as adapter files and checkpoints name it. */
typedef struct {
    char name[DAG_PEFT_NAME_MAX];      /* DAG_PEFT_PREFIX "<module>.lora_A.weight", ... */
    uint64_t shape[2];
} dag_peft_tensor;

/* r, lora_alpha and target_modules (DAG_TARGET_BIT mask) of dir's adapter_config.json. FU_ENOTFOUND
 * when dir has none (saying it expected a PEFT adapter), FU_EPROTO for one that is not peft_type LORA
 * with r (1..DAG_MAX_RANK), lora_alpha > 0 and known target modules. */
FU_MUST_CHECK fu_err dag_peft_config_load(const char *dir, uint32_t *r, float *alpha, uint32_t *targets,
                                          fu_errmsg *em);

/* The adapter tensors of node nd: none unless it is a linear with an adapter of rank r > 0; then
 * lora_A [r, in] and lora_B [out, r] and, with_state, AdamW's moments of the trained ones
 * (<name>.adam_m, <name>.adam_v: lora_B's, and lora_A's for LoRA; LoRA-FA and SALR freeze A), in
 * that order: A, B, A's moments, B's moments. Returns how many were written to out. */
size_t dag_peft_node_tensors(const dag_node *nd, bool with_state, dag_peft_tensor out[DAG_PEFT_PER_NODE]);

/* Checks that st holds exactly the adapter tensors of nodes [first, last) of g: every one, as
 * float32 of its shape, and no other tensor; with_state (a checkpoint) the moments too and a valid
 * "adam_t". FU_EPROTO naming the first difference: what a peer sends is checked against the job's
 * graph before it is stored or assembled. */
FU_MUST_CHECK fu_err dag_peft_check(const dag_graph_t *g, size_t first, size_t last, bool with_state,
                                    const fu_safetensors *st, fu_errmsg *em);

/* adapter_config.json for a LoRA adapter of rank r and lora_alpha alpha on the linears in
 * `targets` (a mask of DAG_TARGET_BIT; 0 means all seven) of the model at base_model (may be NULL).
 * Strings are JSON-escaped. Returns a NUL-terminated text the caller frees; never NULL. */
char *dag_peft_config_json(const char *base_model, uint32_t r, double alpha, uint32_t targets);

#ifdef __cplusplus
}
#endif
#endif
