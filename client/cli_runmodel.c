/* cli_runmodel: the model, graph and executor of `fusion run` (see cli_runmodel.h). */
#include "cli_runmodel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_file.h"
#include "kern_backend.h"
#include "fu_opts.h"

int cli_run_fail(const char *prog, fu_err rc, const fu_errmsg *em)
{
    fprintf(stderr, "%s: %s\n", prog, fu_errmsg_text(em, rc));
    return fu_exit_for(rc);
}

/* --threads: BLAS and kernel threads (0 leaves the libraries' defaults). */
bool cli_run_threads(const char *prog, long long n)
{
    if (n < 0 || n > 1024) {
        fprintf(stderr, "%s: --threads must be 0 (automatic) to 1024\n", prog);
        return false;
    }
    if (n > 0) {
        if (kern_cpu_set_threads((int)n) != FU_OK)
            return false;
    }
    return true;
}

/* byte_tokens: --byte-tokens (a model of more than 256 ids without tokenizer.json takes byte ids). */
fu_err cli_runmodel_open(const char *dir, bool byte_tokens, cli_runmodel *m, fu_errmsg *em)
{
    memset(m, 0, sizeof *m);
    FU_TRY(fu_modelcfg_load(dir, &m->cfg, em));
    dag_dims_from_cfg(&m->cfg, &m->dims);
    FU_TRY(fu_safetensors_open_dir(dir, &m->st, em));
    FU_TRY(fu_tokenizer_open_dir(dir, m->cfg.vocab_size, m->cfg.byte_tokens || byte_tokens, &m->tok, em));
    char *tc = fu_path_join(dir, FU_TOKENIZER_CONFIG_FILE), *txt = NULL;
    size_t tl = 0;
    fu_err rc = fu_path_exists(tc) ? fu_file_read_all(tc, FU_TOKENIZER_MAX_BYTES, &txt, &tl, em) : FU_OK;
    if (rc == FU_OK && txt)
        rc = dag_chat_format_from_config(txt, tl, &m->chat, em);
    free(txt);
    free(tc);
    FU_TRY(rc);
    char *sc = fu_path_join(dir, DAG_SALR_CONFIG_FILE);
    bool has = fu_path_exists(sc);
    free(sc);
    if (has) {
        dag_salr_info info;
        FU_TRY(dag_salr_info_load(dir, &info, em));
        m->salr = true;
        m->res_rank = info.residual_rank;
        m->salr_lm_head = info.lm_head;
    }
    return FU_OK;
}

void cli_runmodel_close(cli_runmodel *m)
{
    fu_safetensors_close(&m->st);
    fu_tokenizer_destroy(&m->tok);
}

fu_err cli_runmodel_graph(const cli_runmodel *m, const dag_build_opts *bo, dag_graph_t **g, fu_errmsg *em)
{
    fu_err rc = dag_build_llama(&m->dims, bo, g);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "cannot build the model's graph (rank larger than a layer?)");
    return dag_graph_validate(*g, em) != FU_OK ? FU_EINVAL : FU_OK;
}

fu_err cli_runmodel_exec(const cli_runmodel *m, const dag_build_opts *bo, const dag_exec_opts *eo, dag_graph_t **g,
                         dag_exec_t **x, fu_errmsg *em)
{
    FU_TRY(cli_runmodel_graph(m, bo, g, em));
    FU_TRY(dag_exec_new(*g, eo, x, em));
    return dag_exec_load_weights(*x, m->st, em);
}

