/* cli_runmodel: what `fusion run` (cli_run.c) and its batched generation (cli_run_batch.c) share: a
 * model directory opened for the DAG executor (config, weights, tokenizer, chat format, SALR facts),
 * the graph and executor built on it, and the commands' error and thread handling. */
#ifndef FU_CLI_RUNMODEL_H
#define FU_CLI_RUNMODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "dag_dataset.h"
#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_model.h"
#include "fu_err.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "fu_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The model directory: config, weights, tokenizer, and whether it is SALR-pruned. */
typedef struct {
    fu_modelcfg cfg;
    dag_model_dims dims;
    fu_safetensors *st;
    fu_tokenizer *tok;
    dag_chat_format chat; /* tokenizer_config.json's chat_template (JSON Lines "messages") */
    bool salr;
    uint32_t res_rank;
    bool salr_lm_head; /* the SALR model's lm_head is pruned too */
} cli_runmodel;

/* Opens dir into m (zeroed first; close it whatever this returns). byte_tokens: --byte-tokens (a
 * model of more than 256 ids without tokenizer.json takes byte ids). */
FU_MUST_CHECK fu_err cli_runmodel_open(const char *dir, bool byte_tokens, cli_runmodel *m, fu_errmsg *em);
void cli_runmodel_close(cli_runmodel *m);
/* The model's graph with options bo, validated (*g: caller destroys). */
FU_MUST_CHECK fu_err cli_runmodel_graph(const cli_runmodel *m, const dag_build_opts *bo, dag_graph_t **g,
                                        fu_errmsg *em);
/* The graph and an executor eo over it with the model's weights loaded (caller destroys both). */
FU_MUST_CHECK fu_err cli_runmodel_exec(const cli_runmodel *m, const dag_build_opts *bo, const dag_exec_opts *eo,
                                       dag_graph_t **g, dag_exec_t **x, fu_errmsg *em);

/* Prints "prog: message" for rc and returns the exit code that goes with it. */
int cli_run_fail(const char *prog, fu_err rc, const fu_errmsg *em);
/* --threads: BLAS and kernel threads (0 leaves the libraries' defaults); false (said on stderr) when
 * out of range. */
bool cli_run_threads(const char *prog, long long n);

#ifdef __cplusplus
}
#endif
#endif
