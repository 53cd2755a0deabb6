/* dag_train: one pipeline stage's fine-tuning step (see dag_train.h). */
#include "dag_train.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"

fu_err dag_train_stage_init(dag_train_stage *t, dag_exec_t *x, const dag_graph_t *g, const dag_spec *spec,
                            const int32_t *ids, size_t n_ids, bool first, bool last, uint32_t n_slots)
{
    memset(t, 0, sizeof *t);
    if (!x || !g || !spec || !n_slots || !spec->micro_batches || spec->batch % spec->micro_batches)
        return FU_EINVAL;
    *t = (dag_train_stage){.x = x, .g = g, .spec = spec, .ids = ids, .n_ids = n_ids, .first = first, .last = last,
                           .n_slots = n_slots};
    size_t ni = first ? 0 : dag_exec_cut_inputs(x, t->cut_in, DAG_TRAIN_MAX_CUTS);
    size_t no = last ? 0 : dag_exec_cut_outputs(x, t->cut_out, DAG_TRAIN_MAX_CUTS);
    if (ni > DAG_TRAIN_MAX_CUTS || no > DAG_TRAIN_MAX_CUTS || (!first && !ni) || (!last && !no))
        return FU_EINVAL;
    t->n_cut_in = (uint32_t)ni;
    t->n_cut_out = (uint32_t)no;
    size_t rows = (size_t)dag_train_rows(t);
    t->tok = fu_malloc((rows ? rows : 1) * sizeof *t->tok);
    t->tgt = fu_malloc((rows ? rows : 1) * sizeof *t->tgt);
    return FU_OK;
}

void dag_train_stage_clear(dag_train_stage *t)
{
    if (!t)
        return;
    free(t->tok);
    free(t->tgt);
    free(t->ef);
    free(t->ef_from);
    t->tok = t->tgt = NULL;
    t->ef = NULL;
    t->ef_from = NULL;
}

uint64_t dag_train_rows(const dag_train_stage *t)
{
    return (uint64_t)(t->spec->batch / t->spec->micro_batches) * t->spec->seq_len;
}

/* The cut tensors of one side from a buffer laid out one after the other (rows x width each). */
static fu_err set_cuts(dag_train_stage *t, uint32_t slot, const uint32_t *ids, uint32_t n_ids, bool grads,
                       const float *buf, size_t n)
{
    uint64_t rows = dag_train_rows(t);
    size_t off = 0;
    for (uint32_t i = 0; i < n_ids; i++) {
        size_t k = (size_t)(rows * dag_graph_width(t->g, ids[i]));
        if (!buf || off + k > n)
            return FU_EINVAL;
        FU_TRY(grads ? dag_exec_set_output_grad(t->x, slot, ids[i], buf + off, k)
                     : dag_exec_set_input(t->x, slot, ids[i], buf + off, k));
        off += k;
    }
    return off == n ? FU_OK : FU_EINVAL;
}

fu_err dag_train_forward(dag_train_stage *t, uint64_t step, uint32_t m, const float *in, size_t n)
{
    if (m >= t->spec->micro_batches)
        return FU_EINVAL;
    uint32_t slot = m % t->n_slots, seqs = t->spec->batch / t->spec->micro_batches;
    if (t->first || t->last) { /* the data order: inputs at the first stage, targets at the last */
        dag_data_order o = dag_spec_data_order(t->spec);
        FU_TRY(dag_data_rows(&o, t->ids, t->n_ids, step, m, t->tok, t->tgt));
    }
    FU_TRY(dag_exec_set_tokens(t->x, slot, t->first ? t->tok : NULL, t->last ? t->tgt : NULL, seqs, t->spec->seq_len));
    if (!t->first)
        FU_TRY(set_cuts(t, slot, t->cut_in, t->n_cut_in, false, in, n));
    return dag_exec_forward(t->x, slot);
}

fu_err dag_train_backward(dag_train_stage *t, uint32_t m, const float *grad, size_t n, float *loss, int64_t *n_valid)
{
    if (m >= t->spec->micro_batches)
        return FU_EINVAL;
    uint32_t slot = m % t->n_slots;
    if (t->last)
        FU_TRY(dag_exec_loss(t->x, slot, loss, n_valid));
    else
        FU_TRY(set_cuts(t, slot, t->cut_out, t->n_cut_out, true, grad, n));
    return dag_exec_backward(t->x, slot, 1.0f / (float)t->spec->micro_batches);
}

/* The side's cut node ids and their count. */
static const uint32_t *side(const dag_train_stage *t, bool out, uint32_t *n)
{
    *n = out ? t->n_cut_out : t->n_cut_in;
    return out ? t->cut_out : t->cut_in;
}

size_t dag_train_cut_floats(const dag_train_stage *t, bool out)
{
    uint32_t n;
    const uint32_t *ids = side(t, out, &n);
    size_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        total += (size_t)(dag_train_rows(t) * dag_graph_width(t->g, ids[i]));
    return total;
}

size_t dag_train_wire_bytes(const dag_train_stage *t, kern_codec c, bool out)
{
    uint32_t n;
    const uint32_t *ids = side(t, out, &n);
    size_t total = 0, rows = (size_t)dag_train_rows(t);
    for (uint32_t i = 0; i < n; i++) {
        size_t b = kern_codec_bytes(c, rows, (size_t)dag_graph_width(t->g, ids[i]));
        if (!b && rows)
            return 0;
        total += b;
    }
    return total;
}

void dag_train_wire_encode(const dag_train_stage *t, kern_codec c, bool out, const float *x, uint8_t *bytes)
{
    uint32_t n;
    const uint32_t *ids = side(t, out, &n);
    size_t rows = (size_t)dag_train_rows(t);
    for (uint32_t i = 0; i < n; i++) {
        size_t w = (size_t)dag_graph_width(t->g, ids[i]);
        kern_codec_encode(c, x, rows, w, bytes);
        x += rows * w;
        bytes += kern_codec_bytes(c, rows, w);
    }
}

fu_err dag_train_wire_decode(const dag_train_stage *t, kern_codec c, bool out, const uint8_t *bytes, size_t len,
                             float *x)
{
    if (len != dag_train_wire_bytes(t, c, out))
        return FU_EPROTO;
    uint32_t n;
    const uint32_t *ids = side(t, out, &n);
    size_t rows = (size_t)dag_train_rows(t);
    for (uint32_t i = 0; i < n; i++) {
        size_t w = (size_t)dag_graph_width(t->g, ids[i]), b = kern_codec_bytes(c, rows, w);
        FU_TRY(kern_codec_decode(c, bytes, b, rows, w, x));
        x += rows * w;
        bytes += b;
    }
    return FU_OK;
}

fu_err dag_train_wire_send(dag_train_stage *t, kern_codec c, bool out, uint64_t step, uint32_t m, float *g,
                           uint8_t *wire)
{
    if (c == KERN_CODEC_F32)
        return FU_OK;
    size_t n = dag_train_cut_floats(t, out), len = dag_train_wire_bytes(t, c, out);
    if (c != KERN_CODEC_INT8_EF) {
        dag_train_wire_encode(t, c, out, g, wire);
        return dag_train_wire_decode(t, c, out, wire, len, g);
    }
    uint32_t M = t->spec->micro_batches;
    if (out || m >= M)
        return FU_EINVAL;
    if (!t->ef) {
        t->ef = fu_calloc((size_t)M * n + 1, sizeof *t->ef);
        t->ef_from = fu_malloc(M * sizeof *t->ef_from);
        for (uint32_t k = 0; k < M; k++)
            t->ef_from[k] = UINT64_MAX;
    }
    uint64_t K = t->spec->checkpoint_every, from = K ? step / K * K : 0;
    float *e = t->ef + (size_t)m * n;
    if (t->ef_from[m] != from) { /* a new checkpoint interval: what a resumed run starts from too */
        memset(e, 0, n * sizeof *e);
        t->ef_from[m] = from;
    }
    for (size_t i = 0; i < n; i++) {
        g[i] += e[i];
        e[i] = g[i];
    }
    dag_train_wire_encode(t, c, false, g, wire);
    FU_TRY(dag_train_wire_decode(t, c, false, wire, len, g));
    for (size_t i = 0; i < n; i++)
        e[i] -= g[i];
    return FU_OK;
}

fu_err dag_train_step(dag_train_stage *t)
{
    kern_adamw_params ap = dag_spec_adamw(t->spec);
    return dag_exec_step(t->x, &ap);
}

fu_err dag_train_run_step(dag_train_stage *t, uint64_t step, double *loss)
{
    if (!t->first || !t->last)
        return FU_EINVAL;
    double sum = 0;
    for (uint32_t m = 0; m < t->spec->micro_batches; m++) {
        float l = 0;
        int64_t nv = 0;
        FU_TRY(dag_train_forward(t, step, m, NULL, 0));
        FU_TRY(dag_train_backward(t, m, NULL, 0, &l, &nv));
        sum += l;
    }
    FU_TRY(dag_train_step(t));
    if (loss)
        *loss = sum / t->spec->micro_batches;
    return FU_OK;
}
