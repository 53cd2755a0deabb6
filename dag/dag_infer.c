/* dag_infer: one pipeline stage's generation step (see dag_infer.h). */
#include "dag_infer.h"

#include <inttypes.h>
#include <string.h>

fu_err dag_infer_stage_init(dag_infer_stage *t, dag_exec_t *x, const dag_graph_t *g, dag_session_t *sess,
                            const dag_spec *spec, bool first, bool last, uint64_t resume)
{
    memset(t, 0, sizeof *t);
    if (!x || !g || !sess || !spec)
        return FU_EINVAL;
    *t = (dag_infer_stage){.x = x, .g = g, .sess = sess, .first = first, .last = last, .resume = resume,
                           .lm_node = UINT32_MAX,
                           .sp = {.temperature = (float)spec->temperature, .top_k = (int)spec->top_k,
                                  .top_p = (float)spec->top_p, .seed = spec->seed}};
    size_t ni = first ? 0 : dag_exec_cut_inputs(x, t->cut_in, DAG_TRAIN_MAX_CUTS);
    if (ni > DAG_TRAIN_MAX_CUTS || (!first && !ni))
        return FU_EINVAL;
    t->n_cut_in = (uint32_t)ni;
    for (uint32_t i = 0; i < t->n_cut_in; i++)
        t->w_in += dag_graph_width(g, t->cut_in[i]);
    for (size_t i = 0; i < dag_graph_size(g); i++)
        if (dag_graph_node(g, i)->op == DAG_OP_LM_HEAD)
            t->lm_node = (uint32_t)i;
    dag_exec_session_use(x, sess);
    return FU_OK;
}

fu_err dag_infer_seek(dag_infer_stage *t, uint64_t p, fu_errmsg *em)
{
    int64_t have = dag_session_len(t->sess);
    if ((uint64_t)have > p)
        return dag_session_truncate(t->sess, (int64_t)p); /* a replay after a failover */
    if ((uint64_t)have < p)
        return fu_errmsg_set(em, FU_EPROTO,
                             "position %" PRIu64 " comes before this stage has positions %" PRId64 "..%" PRIu64
                             " (replay from 0 to rebuild the cache)", p, have, p);
    return FU_OK;
}

/* The inputs of the run and its forward. */
static fu_err run(dag_infer_stage *t, uint64_t p, const int32_t *tokens, const float *in, size_t n, uint64_t rows)
{
    if (rows == 0 || rows > UINT32_MAX || (t->first && !tokens) || (!t->first && (!in || n != rows * t->w_in)))
        return FU_EINVAL;
    if (p == 0)
        t->prompt_len = rows > t->resume ? rows - t->resume : 0;
    if (t->last)
        dag_exec_set_sampling(t->x, &t->sp, p + rows >= t->prompt_len ? p + rows - t->prompt_len : 0);
    FU_TRY(dag_exec_set_tokens(t->x, 0, t->first ? tokens : NULL, NULL, 1, (uint32_t)rows));
    size_t off = 0;
    for (uint32_t i = 0; i < t->n_cut_in; i++) {
        size_t k = (size_t)(rows * dag_graph_width(t->g, t->cut_in[i]));
        FU_TRY(dag_exec_set_input(t->x, 0, t->cut_in[i], in + off, k));
        off += k;
    }
    return dag_exec_forward(t->x, 0);
}

fu_err dag_infer_forward(dag_infer_stage *t, const int32_t *tokens, const float *in, size_t n, uint64_t rows,
                         fu_errmsg *em)
{
    uint64_t p = (uint64_t)dag_session_len(t->sess);
    fu_err rc = run(t, p, tokens, in, n, rows);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "inference forward at position %" PRIu64 " failed: %s", p, fu_strerror(rc));
    return FU_OK;
}

fu_err dag_infer_sampled(const dag_infer_stage *t, int32_t *token)
{
    if (!t->last)
        return FU_EINVAL;
    return dag_exec_sampled(t->x, 0, token);
}

fu_err dag_infer_logits(const dag_infer_stage *t, const float **logits, size_t *n_floats)
{
    if (t->lm_node == UINT32_MAX)
        return FU_ENOTFOUND;
    fu_err rc = dag_exec_get_output(t->x, 0, t->lm_node, logits, n_floats);
    return rc == FU_EINVAL ? FU_ENOTFOUND : rc; /* lm_head outside this stage's range */
}
