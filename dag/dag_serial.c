#include "dag_serial.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <protobuf-c/protobuf-c.h>

#include "dag.pb-c.h"
#include "fu_alloc.h"
#include "wire.h"

/* The fields the IR and the protobuf messages share by name, copied as they are both ways (a field
 * added to both is listed here once): dag_model_dims and fusion.dag.Graph, dag_node and
 * fusion.dag.Node. */
#define DAG_SERIAL_DIMS_FIELDS(X)                                                                           \
    X(vocab_size) X(hidden_size) X(intermediate_size) X(n_layers) X(n_heads) X(n_kv_heads) X(head_dim)     \
    X(rms_eps) X(rope_theta) X(tie_word_embeddings) X(rope_factor) X(rope_low_freq) X(rope_high_freq)         \
    X(rope_orig_max) X(sliding_window) X(qkv_bias) X(o_bias) X(qk_norm)
#define DAG_SERIAL_PLAIN_FIELDS(X)                                                                          \
    X(layer) X(dim_in) X(dim_out) X(n_heads) X(n_kv_heads) X(head_dim) X(eps) X(theta) X(out_width)        \
    X(flops_fwd) X(flops_bwd) X(param_bytes) X(act_bytes) X(rope_factor) X(rope_low_freq) X(rope_high_freq)   \
    X(rope_orig_max) X(window) X(flags)

/* ---- encode --------------------------------------------------------------------------------- */

fu_err dag_graph_encode(const dag_graph_t *g, uint8_t **buf, size_t *len)
{
    if (!g || !buf || !len)
        return FU_EINVAL;
    *buf = NULL;
    *len = 0;
    if (dag_graph_validate(g, NULL) != FU_OK)
        return FU_EINVAL;
    size_t n = dag_graph_size(g);
    const dag_model_dims *d = dag_graph_dims(g);
    Fusion__Dag__Graph pg = FUSION__DAG__GRAPH__INIT;
    pg.version = DAG_SCHEMA_VERSION;
#define COPY(f) pg.f = d->f;
    DAG_SERIAL_DIMS_FIELDS(COPY)
#undef COPY
    Fusion__Dag__Node *pn = fu_calloc(n, sizeof *pn);
    Fusion__Dag__Node **pp = fu_calloc(n, sizeof *pp);
    /* params point into the graph's own node copies (cast away const: protobuf-c's char *). */
    char **names = fu_calloc(n * DAG_MAX_PARAMS + 1, sizeof *names);
    uint32_t *ins = fu_calloc(n * DAG_MAX_INPUTS + 1, sizeof *ins);
    for (size_t i = 0; i < n; i++) {
        const dag_node *s = dag_graph_node(g, i);
        Fusion__Dag__Node *t = &pn[i];
        fusion__dag__node__init(t);
        t->id = s->id;
        t->op = (Fusion__Dag__Op)s->op;
        t->n_inputs = s->n_inputs;
        t->inputs = &ins[i * DAG_MAX_INPUTS];
        memcpy(t->inputs, s->inputs, s->n_inputs * sizeof(uint32_t));
        t->n_params = s->n_params;
        t->params = &names[i * DAG_MAX_PARAMS];
        for (uint32_t k = 0; k < s->n_params; k++)
            t->params[k] = (char *)s->params[k];
        t->target = (Fusion__Dag__Target)s->target;
        t->adapter_method = (Fusion__Dag__AdapterMethod)s->adapter.method;
        t->adapter_rank = s->adapter.rank;
        t->adapter_alpha = s->adapter.alpha;
        t->adapter_res_rank = s->adapter.res_rank;
#define COPY(f) t->f = s->f;
        DAG_SERIAL_PLAIN_FIELDS(COPY)
#undef COPY
        pp[i] = t;
    }
    pg.n_nodes = n;
    pg.nodes = pp;
    size_t sz = fusion__dag__graph__get_packed_size(&pg);
    uint8_t *out = fu_malloc(sz ? sz : 1);
    size_t got = fusion__dag__graph__pack(&pg, out);
    free(ins);
    free(names);
    free(pp);
    free(pn);
    if (got != sz) {
        free(out);
        return FU_EINVAL;
    }
    *buf = out;
    *len = sz;
    return FU_OK;
}

/* ---- decode --------------------------------------------------------------------------------- */

fu_err dag_graph_decode(const uint8_t *buf, size_t len, dag_graph_t **out, fu_errmsg *em)
{
    if (!out)
        return FU_EINVAL;
    *out = NULL;
    if (!buf && len)
        return FU_EINVAL;
    if (len > DAG_MAX_ENCODED)
        return fu_errmsg_set(em, FU_ENOMEM, "graph: %zu bytes encoded, at most %u accepted", len,
                             DAG_MAX_ENCODED);
    ProtobufCMessage *m = NULL;
    fu_err urc = wire_unpack_unvalidated(&fusion__dag__graph__descriptor, buf ? buf : (const uint8_t *)"",
                                         len, DAG_DECODE_BUDGET, &m);
    if (urc == FU_ENOMEM)
        return fu_errmsg_set(em, FU_ENOMEM, "graph: unpacking needs more than %u bytes of memory",
                             DAG_DECODE_BUDGET);
    if (urc != FU_OK)
        return fu_errmsg_set(em, FU_EPROTO, "graph: not a valid fusion.dag.Graph protobuf message");
    Fusion__Dag__Graph *pg = (Fusion__Dag__Graph *)m;
    fu_err rc = FU_OK;
    dag_graph_t *g = NULL;
    if (pg->version != DAG_SCHEMA_VERSION) {
        rc = fu_errmsg_set(em, FU_EVERSION, "graph: schema version %u, this build reads %u", pg->version,
                           DAG_SCHEMA_VERSION);
        goto done;
    }
    if (pg->n_nodes == 0 || pg->n_nodes > DAG_MAX_NODES) {
        rc = fu_errmsg_set(em, FU_EPROTO, "graph: %zu nodes (1 to %d accepted)", pg->n_nodes, DAG_MAX_NODES);
        goto done;
    }
    dag_model_dims d;
    memset(&d, 0, sizeof d);
#define COPY(f) d.f = pg->f;
    DAG_SERIAL_DIMS_FIELDS(COPY)
#undef COPY
    if (d.vocab_size > DAG_MAX_DIM || d.hidden_size > DAG_MAX_DIM || d.intermediate_size > DAG_MAX_DIM ||
        d.n_layers > DAG_MAX_NODES || d.n_heads > DAG_MAX_DIM || d.n_kv_heads > DAG_MAX_DIM ||
        d.head_dim > DAG_MAX_DIM || !isfinite(d.rms_eps) || !isfinite(d.rope_theta) || !isfinite(d.rope_factor) ||
        !isfinite(d.rope_low_freq) || !isfinite(d.rope_high_freq) || !isfinite(d.rope_orig_max)) {
        rc = fu_errmsg_set(em, FU_EPROTO, "graph: model dimensions out of range");
        goto done;
    }
    g = dag_graph_new();
    dag_graph_set_dims(g, &d);
    for (size_t i = 0; i < pg->n_nodes; i++) {
        const Fusion__Dag__Node *s = pg->nodes[i];
        if (!s) {
            rc = fu_errmsg_set(em, FU_EPROTO, "node %zu: missing", i);
            goto done;
        }
        if (s->n_inputs > DAG_MAX_INPUTS || s->n_params > DAG_MAX_PARAMS) {
            rc = fu_errmsg_set(em, FU_EPROTO, "node %zu: %zu inputs / %zu parameter names (at most %d / %d)",
                               i, s->n_inputs, s->n_params, DAG_MAX_INPUTS, DAG_MAX_PARAMS);
            goto done;
        }
        if ((int)s->op <= 0 || (int)s->op >= DAG_OP_COUNT_ || (unsigned)s->target >= DAG_TARGET_COUNT_ ||
            (unsigned)s->adapter_method >= DAG_ADAPTER_COUNT_) {
            rc = fu_errmsg_set(em, FU_EPROTO, "node %zu: op %d, target %d or adapter %d out of range", i,
                               (int)s->op, (int)s->target, (int)s->adapter_method);
            goto done;
        }
        dag_node n;
        memset(&n, 0, sizeof n);
        n.id = s->id;
        n.op = (dag_op)s->op;
        n.n_inputs = (uint32_t)s->n_inputs;
        for (size_t k = 0; k < s->n_inputs; k++)
            n.inputs[k] = s->inputs[k];
        n.n_params = (uint32_t)s->n_params;
        for (size_t k = 0; k < s->n_params; k++) {
            const char *p = s->params[k] ? s->params[k] : "";
            size_t pl = strlen(p);
            if (pl == 0 || pl >= DAG_NAME_MAX) {
                rc = fu_errmsg_set(em, FU_EPROTO,
                                   "node %zu (%s): parameter name %zu is empty or longer than %d bytes", i,
                                   dag_op_name(n.op), k, DAG_NAME_MAX - 1);
                goto done;
            }
            memcpy(n.params[k], p, pl + 1);
        }
        n.target = (dag_target)s->target;
        n.adapter.method = (dag_adapter_method)s->adapter_method;
        n.adapter.rank = s->adapter_rank;
        n.adapter.alpha = s->adapter_alpha;
        n.adapter.res_rank = s->adapter_res_rank;
#define COPY(f) n.f = s->f;
        DAG_SERIAL_PLAIN_FIELDS(COPY)
#undef COPY
        uint32_t id;
        if (dag_graph_add_node(g, &n, &id) != FU_OK) {
            rc = fu_errmsg_set(em, FU_EPROTO, "node %zu: graph full", i);
            goto done;
        }
        /* dag_graph_add_node renumbers; a wrong id on the wire is an error, not something to fix. */
        dag_graph_node_mut(g, id)->id = s->id;
    }
    rc = dag_graph_validate(g, em);
done:
    wire_unpacked_free(m);
    if (rc != FU_OK) {
        dag_graph_destroy(&g);
        return rc;
    }
    *out = g;
    return FU_OK;
}
