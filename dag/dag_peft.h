/* dag_peft: Hugging Face PEFT's adapter format, as far as fusion writes it. The tensors
 * (adapter_model.safetensors, names base_model.model.<module>.lora_A/lora_B.weight) come from the
 * executor; this module writes the adapter_config.json that goes with them, for the single-process
 * path (dag_exec_save_adapter) and the broker's assembled result alike. */
#ifndef FU_DAG_PEFT_H
#define FU_DAG_PEFT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_PEFT_CONFIG_FILE  "adapter_config.json"
#define DAG_PEFT_WEIGHTS_FILE "adapter_model.safetensors"

/* adapter_config.json for a LoRA adapter of rank r and lora_alpha alpha on the linears in
 * `targets` (a mask of DAG_TARGET_BIT; 0 means all seven) of the model at base_model (may be NULL).
 * Strings are JSON-escaped. Returns a NUL-terminated text the caller frees; never NULL. */
char *dag_peft_config_json(const char *base_model, uint32_t r, double alpha, uint32_t targets);

#ifdef __cplusplus
}
#endif
#endif
