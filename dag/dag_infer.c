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

/* The batch's inputs and its forward. */
static fu_err run(dag_infer_stage *const *ts, size_t n, const int32_t *tokens, const float *in, size_t n_floats,
                  const uint64_t *rows)
{
    if (!ts || n == 0 || n > DAG_INFER_MAX_BATCH || !rows)
        return FU_EINVAL;
    dag_infer_stage *t0 = ts[0];
    dag_session_t *sess[DAG_INFER_MAX_BATCH];
    uint32_t r[DAG_INFER_MAX_BATCH];
    uint64_t total = 0;
    for (size_t k = 0; k < n; k++) {
        const dag_infer_stage *t = ts[k];
        if (!t || t->x != t0->x || t->first != t0->first || t->last != t0->last || rows[k] == 0 ||
            rows[k] > UINT32_MAX)
            return FU_EINVAL;
        sess[k] = t->sess;
        r[k] = (uint32_t)rows[k];
        total += rows[k];
    }
    if ((t0->first && !tokens) || (!t0->first && (!in || n_floats != total * t0->w_in)))
        return FU_EINVAL;
    for (size_t k = 0; k < n; k++) {
        dag_infer_stage *t = ts[k];
        uint64_t p = (uint64_t)dag_session_len(t->sess);
        if (p == 0)
            t->prompt_len = rows[k] > t->resume ? rows[k] - t->resume : 0;
        if (t->last)
            dag_session_set_sampling(t->sess, &t->sp,
                                     p + rows[k] >= t->prompt_len ? p + rows[k] - t->prompt_len : 0);
    }
    FU_TRY(dag_exec_set_batch(t0->x, 0, sess, r, (uint32_t)n, t0->first ? tokens : NULL));
    size_t off = 0;
    for (uint32_t i = 0; i < t0->n_cut_in; i++) {
        size_t k = (size_t)(total * dag_graph_width(t0->g, t0->cut_in[i]));
        FU_TRY(dag_exec_set_input(t0->x, 0, t0->cut_in[i], in + off, k));
        off += k;
    }
    return dag_exec_forward(t0->x, 0);
}

fu_err dag_infer_forward(dag_infer_stage *t, const int32_t *tokens, const float *in, size_t n, uint64_t rows,
                         fu_errmsg *em)
{
    return dag_infer_forward_batch(&t, 1, tokens, in, n, &rows, em);
}

fu_err dag_infer_forward_batch(dag_infer_stage *const *ts, size_t n, const int32_t *tokens, const float *in,
                               size_t n_floats, const uint64_t *rows, fu_errmsg *em)
{
    fu_err rc = run(ts, n, tokens, in, n_floats, rows);
    if (rc == FU_OK)
        return FU_OK;
    uint64_t p = ts && n && ts[0] ? (uint64_t)dag_session_len(ts[0]->sess) : 0;
    if (n == 1)
        return fu_errmsg_set(em, rc, "inference forward at position %" PRIu64 " failed: %s", p, fu_strerror(rc));
    return fu_errmsg_set(em, rc, "batched inference forward of %zu sessions failed: %s", n, fu_strerror(rc));
}

fu_err dag_infer_sampled(const dag_infer_stage *t, int32_t *token)
{
    if (!t->last)
        return FU_EINVAL;
    return dag_session_sampled(t->sess, token);
}

fu_err dag_infer_logits(const dag_infer_stage *t, const float **logits, size_t *n_floats)
{
    if (t->lm_node == UINT32_MAX)
        return FU_ENOTFOUND;
    fu_err rc = dag_exec_get_output(t->x, 0, t->lm_node, logits, n_floats);
    return rc == FU_EINVAL ? FU_ENOTFOUND : rc; /* lm_head outside this stage's range */
}
