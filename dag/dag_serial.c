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

/* ---- byte-budgeted allocator for protobuf-c -------------------------------------------------- */

typedef struct {
    fu_budget budget; /* bytes outstanding */
    bool over;        /* an allocation was refused */
} dag_pb_budget;

/* Each block carries its size in a header so that free can give the bytes back. */
typedef union {
    size_t n;
    max_align_t align_;
} dag_pb_hdr;

static void *pb_alloc(void *ctx, size_t size)
{
    dag_pb_budget *b = ctx;
    size_t total;
    if (!fu_size_add(size, sizeof(dag_pb_hdr), &total) || fu_budget_take(&b->budget, total) != FU_OK) {
        b->over = true;
        return NULL;
    }
    dag_pb_hdr *h = malloc(total);
    if (!h) {
        fu_budget_give(&b->budget, total);
        b->over = true;
        return NULL;
    }
    h->n = total;
    return h + 1;
}

static void pb_free(void *ctx, void *p)
{
    dag_pb_budget *b = ctx;
    if (!p)
        return;
    dag_pb_hdr *h = (dag_pb_hdr *)p - 1;
    fu_budget_give(&b->budget, h->n);
    free(h);
}

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
    pg.vocab_size = d->vocab_size;
    pg.hidden_size = d->hidden_size;
    pg.intermediate_size = d->intermediate_size;
    pg.n_layers = d->n_layers;
    pg.n_heads = d->n_heads;
    pg.n_kv_heads = d->n_kv_heads;
    pg.head_dim = d->head_dim;
    pg.rms_eps = d->rms_eps;
    pg.rope_theta = d->rope_theta;
    pg.tie_word_embeddings = d->tie_word_embeddings;
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
        t->layer = s->layer;
        t->dim_in = s->dim_in;
        t->dim_out = s->dim_out;
        t->n_heads = s->n_heads;
        t->n_kv_heads = s->n_kv_heads;
        t->head_dim = s->head_dim;
        t->eps = s->eps;
        t->theta = s->theta;
        t->out_width = s->out_width;
        t->flops_fwd = s->flops_fwd;
        t->flops_bwd = s->flops_bwd;
        t->param_bytes = s->param_bytes;
        t->act_bytes = s->act_bytes;
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
    dag_pb_budget bud = {.budget = {.limit = DAG_DECODE_BUDGET, .used = 0}, .over = false};
    ProtobufCAllocator alloc = {.alloc = pb_alloc, .free = pb_free, .allocator_data = &bud};
    Fusion__Dag__Graph *pg = fusion__dag__graph__unpack(&alloc, len, buf ? buf : (const uint8_t *)"");
    if (!pg) {
        if (bud.over)
            return fu_errmsg_set(em, FU_ENOMEM, "graph: unpacking needs more than %u bytes of memory",
                                 DAG_DECODE_BUDGET);
        return fu_errmsg_set(em, FU_EPROTO, "graph: not a valid fusion.dag.Graph protobuf message");
    }
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
    dag_model_dims d = {
        .vocab_size = pg->vocab_size,
        .hidden_size = pg->hidden_size,
        .intermediate_size = pg->intermediate_size,
        .n_layers = pg->n_layers,
        .n_heads = pg->n_heads,
        .n_kv_heads = pg->n_kv_heads,
        .head_dim = pg->head_dim,
        .rms_eps = pg->rms_eps,
        .rope_theta = pg->rope_theta,
        .tie_word_embeddings = pg->tie_word_embeddings,
    };
    if (d.vocab_size > DAG_MAX_DIM || d.hidden_size > DAG_MAX_DIM || d.intermediate_size > DAG_MAX_DIM ||
        d.n_layers > DAG_MAX_NODES || d.n_heads > DAG_MAX_DIM || d.n_kv_heads > DAG_MAX_DIM ||
        d.head_dim > DAG_MAX_DIM || !isfinite(d.rms_eps) || !isfinite(d.rope_theta)) {
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
        n.layer = s->layer;
        n.dim_in = s->dim_in;
        n.dim_out = s->dim_out;
        n.n_heads = s->n_heads;
        n.n_kv_heads = s->n_kv_heads;
        n.head_dim = s->head_dim;
        n.eps = s->eps;
        n.theta = s->theta;
        n.out_width = s->out_width;
        n.flops_fwd = s->flops_fwd;
        n.flops_bwd = s->flops_bwd;
        n.param_bytes = s->param_bytes;
        n.act_bytes = s->act_bytes;
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
    fusion__dag__graph__free_unpacked(pg, &alloc);
    if (rc != FU_OK) {
        dag_graph_destroy(&g);
        return rc;
    }
    *out = g;
    return FU_OK;
}
