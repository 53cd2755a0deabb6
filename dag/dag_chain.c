/* dag_chain: a fine-tuning pipeline in one process (see dag_chain.h). */
#include "dag_chain.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"

static size_t max3(size_t a, size_t b, size_t c)
{
    return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

fu_err dag_chain_new(dag_chain *c, const dag_graph_t *g, const dag_exec_opts *o, const fu_safetensors *st,
                     const size_t *cuts, size_t n_cuts, const dag_spec *spec, const int32_t *ids, size_t n_ids,
                     fu_errmsg *em)
{
    memset(c, 0, sizeof *c);
    size_t n_nodes = dag_graph_size(g);
    if (n_cuts + 1 > DAG_CHAIN_MAX_STAGES)
        return fu_errmsg_set(em, FU_EINVAL, "at most %d stages (%zu cuts given)", DAG_CHAIN_MAX_STAGES, n_cuts);
    for (size_t i = 0; i < n_cuts; i++)
        if (cuts[i] == 0 || cuts[i] >= n_nodes || (i && cuts[i] <= cuts[i - 1]))
            return fu_errmsg_set(em, FU_EINVAL, "cuts must be increasing node ids from 1 to %zu (the graph's last)",
                                 n_nodes - 1);
    c->n = n_cuts + 1;
    size_t floats = 0, bytes = 0;
    fu_err rc = FU_OK;
    for (size_t k = 0; k < c->n && rc == FU_OK; k++) {
        size_t first = k ? cuts[k - 1] : 0, last = k < n_cuts ? cuts[k] : n_nodes;
        dag_exec_opts eo = *o;
        eo.first = first;
        eo.last = last;
        if ((rc = dag_graph_check_range(g, first, last, em)) != FU_OK || (rc = dag_exec_new(g, &eo, &c->x[k], em)) != FU_OK ||
            (rc = dag_exec_load_weights(c->x[k], st, em)) != FU_OK)
            break;
        dag_train_stage *t = &c->t[k];
        if ((rc = dag_train_stage_init(t, c->x[k], g, spec, ids, n_ids, k == 0, k + 1 == c->n,
                                       eo.n_slots ? eo.n_slots : 1)) != FU_OK) {
            rc = fu_errmsg_set(em, rc, "stage %zu (nodes %zu-%zu) has no cut tensor towards a neighbour, or more "
                                       "than %d", k, first, last - 1, DAG_TRAIN_MAX_CUTS);
            break;
        }
        if (k && (t->n_cut_in != c->t[k - 1].n_cut_out ||
                  memcmp(t->cut_in, c->t[k - 1].cut_out, t->n_cut_in * sizeof *t->cut_in) != 0)) {
            rc = fu_errmsg_set(em, FU_EINVAL, "the stages disagree on what crosses the cut at node %zu", first);
            break;
        }
        floats = max3(floats, dag_train_cut_floats(t, true), dag_train_cut_floats(t, false));
        bytes = max3(bytes, dag_train_wire_bytes(t, spec->act_codec, true), dag_train_wire_bytes(t, spec->act_codec, false));
        bytes = max3(bytes, dag_train_wire_bytes(t, spec->grad_codec, true), dag_train_wire_bytes(t, spec->grad_codec, false));
    }
    if (rc != FU_OK) {
        dag_chain_clear(c);
        return rc;
    }
    c->act = fu_malloc(floats * sizeof(float) + 1);
    c->grad = fu_malloc(floats * sizeof(float) + 1);
    c->wire = fu_malloc(bytes + 1);
    return FU_OK;
}

void dag_chain_clear(dag_chain *c)
{
    if (!c)
        return;
    for (size_t k = 0; k < c->n; k++) {
        dag_train_stage_clear(&c->t[k]);
        dag_exec_destroy(&c->x[k]);
    }
    free(c->act);
    free(c->grad);
    free(c->wire);
    memset(c, 0, sizeof *c);
}

/* Micro-batch m of step: forward through every stage, the loss, backward up to stage 0. */
static fu_err micro_batch(dag_chain *c, uint64_t step, uint32_t m, float *loss, fu_errmsg *em)
{
    const dag_spec *spec = c->t[0].spec;
    size_t n_in = 0;
    int64_t nv = 0;
    for (size_t k = 0; k < c->n; k++) {
        dag_train_stage *t = &c->t[k];
        fu_err rc = dag_train_forward(t, step, m, k ? c->act : NULL, n_in);
        if (rc == FU_OK && k + 1 < c->n) {
            n_in = dag_train_cut_floats(t, true);
            rc = dag_exec_gather_outputs(t->x, m % t->n_slots, t->cut_out, t->n_cut_out, c->act, n_in);
            if (rc == FU_OK)
                rc = dag_train_wire_send(t, spec->act_codec, true, step, m, c->act, c->wire);
        }
        if (rc != FU_OK)
            return fu_errmsg_set(em, rc, "stage %zu: forward of micro-batch %u failed", k, m);
    }
    for (size_t k = c->n; k-- > 0;) {
        dag_train_stage *t = &c->t[k];
        size_t n_out = k + 1 < c->n ? dag_train_cut_floats(t, true) : 0;
        fu_err rc = k + 1 == c->n ? dag_train_backward(t, m, NULL, 0, loss, &nv)
                                  : dag_train_backward(t, m, c->grad, n_out, NULL, NULL);
        if (rc == FU_OK && k > 0) {
            size_t n_g = dag_train_cut_floats(t, false);
            rc = dag_exec_gather_input_grads(t->x, t->cut_in, t->n_cut_in, dag_train_rows(t), c->grad, n_g);
            if (rc == FU_OK)
                rc = dag_train_wire_send(t, spec->grad_codec, false, step, m, c->grad, c->wire);
        }
        if (rc != FU_OK)
            return fu_errmsg_set(em, rc, "stage %zu: backward of micro-batch %u failed", k, m);
    }
    return FU_OK;
}

fu_err dag_chain_step(dag_chain *c, uint64_t step, double *loss, fu_errmsg *em)
{
    double sum = 0;
    uint32_t M = c->t[0].spec->micro_batches;
    for (uint32_t m = 0; m < M; m++) {
        float l = 0;
        FU_TRY(micro_batch(c, step, m, &l, em));
        sum += l;
    }
    for (size_t k = 0; k < c->n; k++) {
        fu_err rc = dag_train_step(&c->t[k]);
        if (rc != FU_OK)
            return fu_errmsg_set(em, rc, "stage %zu: AdamW failed", k);
    }
    if (loss)
        *loss = sum / M;
    return FU_OK;
}

size_t dag_chain_trainable_params(const dag_chain *c)
{
    size_t n = 0;
    for (size_t k = 0; k < c->n; k++)
        n += dag_exec_trainable_params(c->x[k]);
    return n;
}

fu_err dag_chain_save_adapter(const dag_chain *c, const char *dir, const char *base_model, fu_errmsg *em)
{
    return dag_exec_save_adapters((const dag_exec_t *const *)c->x, c->n, dir, base_model, em);
}
