/* cli_run_batch: `fusion run infer --prompts FILE`, the generations of a file batched in this process
 * (cli_run_batch.c; docs/DAG.md "Batched sessions"). */
#ifndef FU_CLI_RUN_BATCH_H
#define FU_CLI_RUN_BATCH_H

#include <stdbool.h>
#include <stdint.h>

#include "cli_runmodel.h"
#include "dag_spec.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CLI_RUN_BATCH_MAX_PROMPT 65536 /* longest prompt in tokens */

/* Generates for every prompt of the JSON Lines file at path ({"prompt": TEXT} or
 * {"prompt_tokens": [IDS]} per line) with model m, graph options bo (and adapter ast), up to batch
 * generations at a time. Generation i samples as spec says with seed spec->seed + i, so `--batch 1`
 * gives each the text of `fusion run infer` with that seed. Each ends with one JSON line on stdout:
 * {"index","text","prompt_tokens","completion_tokens","finish_reason"}. Statistics on stderr unless
 * quiet. Returns the exit code. */
int cli_run_infer_batch(const char *prog, const cli_runmodel *m, const dag_spec *spec, const dag_build_opts *bo,
                        const fu_safetensors *ast, const char *path, uint32_t batch, bool quiet);

#ifdef __cplusplus
}
#endif
#endif
