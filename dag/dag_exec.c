/* dag_exec: the executor object. Owns its lifecycle (dag_exec_new / dag_exec_destroy), the buffer
 * pool, the cut-tensor queries, a slot's inputs (set_tokens / set_input), the AdamW step and the
 * adapter accessors, and inference sessions. The passes live in dag_exec_pass.c, weight, adapter and
 * checkpoint I/O in dag_exec_io.c; the state they share in dag_exec_internal.h. */
#include "dag_exec.h"
#include "dag_exec_internal.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_bitmap.h"
#include "kern_kvcache.h"
#include "kern_lora.h"
/* ---- buffer pool ---------------------------------------------------------------------------- */

fu_err dagx_pool_get(dag_exec_t *x, size_t nfloats, ebuf **out)
{
    ebuf *best = NULL;
    for (size_t i = 0; i < x->n_bufs; i++) {
        ebuf *b = x->bufs[i];
        if (b->refs == 0 && b->cap >= nfloats && (!best || b->cap < best->cap))
            best = b;
    }
    if (!best) {
        best = fu_calloc(1, sizeof *best);
        int64_t shape[1] = {(int64_t)(nfloats ? nfloats : 1)};
        fu_err rc = kern_tensor_new(x->be, KERN_F32, 1, shape, &best->t);
        if (rc != FU_OK) {
            free(best);
            return rc;
        }
        best->cap = nfloats ? nfloats : 1;
        if (x->n_bufs == x->cap_bufs) {
            x->cap_bufs = x->cap_bufs ? x->cap_bufs * 2 : 64;
            x->bufs = fu_realloc(x->bufs, x->cap_bufs * sizeof *x->bufs);
        }
        x->bufs[x->n_bufs++] = best;
    }
    best->refs = 1;
    *out = best;
    return FU_OK;
}

/* ---- creation ------------------------------------------------------------------------------- */

static bool trainable(const dag_exec_t *x, const dag_node *nd)
{
    return x->o.training && nd->op == DAG_OP_LINEAR && nd->adapter.method != DAG_ADAPTER_NONE && nd->adapter.rank > 0;
}

fu_err dag_exec_new(const dag_graph_t *g, const dag_exec_opts *o, dag_exec_t **out, fu_errmsg *em)
{
    if (!g || !o || !out)
        return FU_EINVAL;
    *out = NULL;
    size_t n = dag_graph_size(g);
    size_t last = o->last ? o->last : n;
    if (o->first >= last || last > n)
        return fu_errmsg_set(em, FU_EINVAL, "node range [%zu, %zu) is empty or outside the graph's %zu nodes",
                             o->first, last, n);
    if (o->max_tokens == 0)
        return fu_errmsg_set(em, FU_EINVAL, "max_tokens must be at least 1");
    if (o->n_slots > DAG_EXEC_MAX_SLOTS)
        return fu_errmsg_set(em, FU_EINVAL, "at most %d slots", DAG_EXEC_MAX_SLOTS);
    FU_TRY(dag_graph_validate(g, em));
    const kern_backend_t *be = o->be ? o->be : kern_backend_cpu();
    bool cpu = be->device.kind == KERN_DEV_CPU;
    for (size_t i = o->first; i < last; i++)
        if (dag_graph_node(g, i)->adapter.method == DAG_ADAPTER_SALR && !kern_backend_has_sparse(be))
            return fu_errmsg_set(em, FU_ENOSYS, "node %zu: backend %s has no sparse (SALR) kernels", i, be->name);

    dag_exec_t *x = fu_calloc(1, sizeof *x);
    x->g = g;
    x->o = *o;
    x->o.last = last;
    if (!x->o.n_slots)
        x->o.n_slots = 1;
    if (!x->o.max_context)
        x->o.max_context = x->o.max_tokens;
    x->be = be;
    x->cpu = cpu;
    x->n = n;
    x->first = o->first;
    x->last = last;
    x->nodes = fu_calloc(n, sizeof *x->nodes);
    x->need_grad = fu_calloc(n, sizeof *x->need_grad);
    x->act = fu_calloc((size_t)x->o.n_slots * n, sizeof *x->act);
    x->hsave = fu_calloc((size_t)x->o.n_slots * n, sizeof *x->hsave);
    x->grad = fu_calloc(n, sizeof *x->grad);
    x->slots = fu_calloc(x->o.n_slots, sizeof *x->slots);
    x->sp.temperature = 0.0f;
    x->sp.top_k = 0;
    x->sp.top_p = 1.0f;
    x->sp.seed = 0;
    fu_err rc = FU_OK;

    /* Which outputs need a gradient: a trained adapter at or before them (over the whole graph so
     * every stage agrees on its cut tensors). */
    for (size_t i = 0; i < n; i++) {
        const dag_node *nd = dag_graph_node(g, i);
        bool ng = trainable(x, nd);
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            ng = ng || x->need_grad[nd->inputs[k]];
        x->need_grad[i] = ng;
    }
    for (size_t j = x->first; j < n; j++) {
        const dag_node *nd = dag_graph_node(g, j);
        for (uint32_t k = 0; k < nd->n_inputs; k++) {
            uint32_t src = nd->inputs[k];
            if (j < last && in_range(x, src))
                x->nodes[src].n_cons++;
            if (j >= last && in_range(x, src))
                x->nodes[src].cut_out = true;
        }
    }
    for (size_t j = x->first; j < last; j++) {
        const dag_node *nd = dag_graph_node(g, j);
        enode *e = &x->nodes[j];
        bool any_in = false;
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            any_in = any_in || x->need_grad[nd->inputs[k]];
        e->run_bwd = x->o.training && (trainable(x, nd) || any_in || nd->op == DAG_OP_CROSS_ENTROPY);
        if (nd->op == DAG_OP_CROSS_ENTROPY && !x->need_grad[nd->inputs[0]])
            e->run_bwd = false;
        if (!e->run_bwd)
            continue;
        switch (nd->op) {
        case DAG_OP_RMSNORM:
        case DAG_OP_HEAD_NORM:
            e->save_mask = 1;
            break;
        case DAG_OP_LINEAR:
            if (nd->adapter.method == DAG_ADAPTER_LORA && nd->adapter.rank > 0)
                e->save_mask = 1;
            break;
        case DAG_OP_ATTENTION:
            e->save_mask = 7;
            break;
        case DAG_OP_SILU_MUL:
            e->save_mask = 3;
            break;
        case DAG_OP_CROSS_ENTROPY:
            e->save_mask = 1;
            break;
        default:
            break;
        }
    }
    for (uint32_t s = 0; s < x->o.n_slots; s++) {
        int64_t shape[1] = {x->o.max_tokens};
        if ((rc = kern_tensor_new_zeros(be, KERN_I32, 1, shape, &x->slots[s].tokens)) != FU_OK ||
            (rc = kern_tensor_new_zeros(be, KERN_I32, 1, shape, &x->slots[s].targets)) != FU_OK ||
            (rc = kern_tensor_new_zeros(be, KERN_I32, 1, shape, &x->slots[s].pos)) != FU_OK) {
            fu_errmsg_set(em, rc, "cannot allocate the token buffers");
            goto fail;
        }
    }
    *out = x;
    return FU_OK;
fail:
    dag_exec_destroy(&x);
    return rc;
}

void dagx_free_node(enode *e)
{
    if (!e->w_shared)
        kern_tensor_destroy(&e->w);
    e->w = NULL;
    free(e->qscale);
    e->qscale = NULL;
    kern_bitmap_destroy(&e->bm);
    kern_sparse_weight_release(NULL, &e->dev_bm);
    memset(&e->sw, 0, sizeof e->sw);
    kern_tensor_t **ts[] = {&e->A,  &e->B,  &e->dA,    &e->dB,    &e->mA, &e->vA,  &e->mB,
                            &e->vB, &e->A2, &e->B2, &e->a_cat, &e->b_cat, &e->eye, &e->bias};
    for (size_t k = 0; k < sizeof ts / sizeof ts[0]; k++)
        kern_tensor_destroy(ts[k]);
}

void dag_exec_destroy(dag_exec_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    dag_exec_t *x = *self_p;
    if (x->nodes)
        for (size_t i = 0; i < x->n; i++)
            dagx_free_node(&x->nodes[i]);
    kern_tensor_destroy(&x->ones);
    free(x->nodes);
    free(x->need_grad);
    for (size_t i = 0; i < x->n_bufs; i++) {
        kern_tensor_destroy(&x->bufs[i]->t);
        free(x->bufs[i]);
    }
    free(x->bufs);
    free(x->act);
    free(x->hsave);
    free(x->grad);
    if (x->slots)
        for (uint32_t s = 0; s < x->o.n_slots; s++) {
            kern_tensor_destroy(&x->slots[s].tokens);
            kern_tensor_destroy(&x->slots[s].targets);
            kern_tensor_destroy(&x->slots[s].pos);
            free(x->slots[s].sess);
            free(x->slots[s].sess_rows);
        }
    free(x->slots);
    kern_workspace_destroy(&x->ws);
    free(x->staging);
    free(x);
    *self_p = NULL;
}

/* ---- cut tensors ---------------------------------------------------------------------------- */

size_t dag_exec_cut_inputs(const dag_exec_t *x, uint32_t *ids, size_t cap)
{
    size_t c = 0;
    for (size_t i = 0; i < x->first; i++) {
        bool used = false;
        for (size_t j = x->first; j < x->last && !used; j++) {
            const dag_node *nd = N(x, j);
            for (uint32_t k = 0; k < nd->n_inputs; k++)
                used = used || nd->inputs[k] == i;
        }
        if (used) {
            if (ids && c < cap)
                ids[c] = (uint32_t)i;
            c++;
        }
    }
    return c;
}

size_t dag_exec_cut_outputs(const dag_exec_t *x, uint32_t *ids, size_t cap)
{
    size_t c = 0;
    for (size_t i = x->first; i < x->last; i++)
        if (x->nodes[i].cut_out) {
            if (ids && c < cap)
                ids[c] = (uint32_t)i;
            c++;
        }
    return c;
}

static bool is_cut_input(const dag_exec_t *x, uint32_t node)
{
    if (node >= x->first)
        return false;
    for (size_t j = x->first; j < x->last; j++) {
        const dag_node *nd = N(x, j);
        for (uint32_t k = 0; k < nd->n_inputs; k++)
            if (nd->inputs[k] == node)
                return true;
    }
    return false;
}

/* ---- batch ---------------------------------------------------------------------------------- */

/* Makes room for n sessions in slot s's list. */
static void slot_sess_reserve(eslot *s, uint32_t n)
{
    if (n <= s->cap_sess)
        return;
    s->sess = fu_realloc(s->sess, (size_t)n * sizeof *s->sess);
    s->sess_rows = fu_realloc(s->sess_rows, (size_t)n * sizeof *s->sess_rows);
    s->cap_sess = n;
}

/* The slot's positions (each session's continue its cache; without sessions every sequence starts
 * at 0) and tokens, checked against the vocabulary and copied to the backend. */
static fu_err slot_fill(dag_exec_t *x, eslot *s, const int32_t *tokens, const int32_t *targets)
{
    const dag_model_dims *d = dag_graph_dims(x->g);
    uint64_t rows = s->rows;
    if (tokens)
        for (uint64_t i = 0; i < rows; i++)
            if (tokens[i] < 0 || (uint32_t)tokens[i] >= d->vocab_size)
                return FU_EINVAL;
    if (targets)
        for (uint64_t i = 0; i < rows; i++)
            if (targets[i] != DAG_IGNORE_INDEX && (targets[i] < 0 || (uint32_t)targets[i] >= d->vocab_size))
                return FU_EINVAL;
    int32_t *pos = fu_malloc(rows * sizeof *pos);
    if (s->n_sess) {
        uint64_t r = 0;
        for (uint32_t k = 0; k < s->n_sess; k++)
            for (uint32_t j = 0; j < s->sess_rows[k]; j++)
                pos[r++] = (int32_t)(s->sess[k]->len + j);
    } else {
        for (uint64_t i = 0; i < rows; i++)
            pos[i] = (int32_t)(i % s->seq_len);
    }
    kern_tensor_t pv = tv1(s->pos->data, KERN_I32, (int64_t)rows, x->be->device);
    fu_err rc = kern_tensor_copy_in(x->be, &pv, pos, rows * sizeof *pos);
    free(pos);
    FU_TRY(rc);
    if (tokens) {
        kern_tensor_t t = tv1(s->tokens->data, KERN_I32, (int64_t)rows, x->be->device);
        FU_TRY(kern_tensor_copy_in(x->be, &t, tokens, rows * sizeof *tokens));
    }
    if (targets) {
        kern_tensor_t t = tv1(s->targets->data, KERN_I32, (int64_t)rows, x->be->device);
        FU_TRY(kern_tensor_copy_in(x->be, &t, targets, rows * sizeof *targets));
    }
    return FU_OK;
}

fu_err dag_exec_set_tokens(dag_exec_t *x, uint32_t slot, const int32_t *tokens, const int32_t *targets,
                           uint32_t n_seq, uint32_t seq_len)
{
    if (!x || slot >= x->o.n_slots || n_seq == 0 || seq_len == 0)
        return FU_EINVAL;
    uint64_t rows = (uint64_t)n_seq * seq_len;
    if (rows > x->o.max_tokens)
        return FU_EINVAL;
    if (x->session && n_seq != 1)
        return FU_EINVAL;
    eslot *s = &x->slots[slot];
    s->n_seq = n_seq;
    s->seq_len = seq_len;
    s->rows = (uint32_t)rows;
    s->has_tokens = tokens != NULL;
    s->has_targets = targets != NULL;
    s->batch = false;
    s->n_sess = 0;
    s->pos0 = x->session ? x->session->len : 0;
    if (x->session) {
        if ((uint64_t)s->pos0 + rows > x->o.max_context)
            return FU_ENOMEM;
        slot_sess_reserve(s, 1);
        s->sess[0] = x->session;
        s->sess_rows[0] = (uint32_t)rows;
        s->n_sess = 1;
    }
    return slot_fill(x, s, tokens, targets);
}

fu_err dag_exec_set_batch(dag_exec_t *x, uint32_t slot, dag_session_t *const *sess, const uint32_t *rows,
                          uint32_t n, const int32_t *tokens)
{
    if (!x || slot >= x->o.n_slots || !sess || !rows || n == 0 || x->o.training)
        return FU_EINVAL;
    uint64_t total = 0;
    for (uint32_t k = 0; k < n; k++) {
        if (!sess[k] || sess[k]->x != x || rows[k] == 0)
            return FU_EINVAL;
        for (uint32_t j = 0; j < k; j++)
            if (sess[j] == sess[k])
                return FU_EINVAL; /* one session's rows must be one run of its positions */
        total += rows[k];
    }
    if (total > x->o.max_tokens)
        return FU_EINVAL;
    for (uint32_t k = 0; k < n; k++)
        if ((uint64_t)sess[k]->len + rows[k] > x->o.max_context)
            return FU_ENOMEM;
    eslot *s = &x->slots[slot];
    slot_sess_reserve(s, n);
    memcpy(s->sess, sess, (size_t)n * sizeof *sess);
    memcpy(s->sess_rows, rows, (size_t)n * sizeof *rows);
    s->n_sess = n;
    s->batch = true;
    s->n_seq = n;
    s->seq_len = 0; /* sessions attend through their caches: no fixed sequence length */
    s->rows = (uint32_t)total;
    s->has_tokens = tokens != NULL;
    s->has_targets = false;
    s->pos0 = sess[0]->len;
    fu_err rc = slot_fill(x, s, tokens, NULL);
    if (rc != FU_OK)
        s->n_sess = 0;
    return rc;
}

fu_err dag_exec_set_input(dag_exec_t *x, uint32_t slot, uint32_t node, const float *data, size_t n_floats)
{
    if (!x || slot >= x->o.n_slots || !data || !is_cut_input(x, node))
        return FU_EINVAL;
    eslot *s = &x->slots[slot];
    size_t w = node_width(x, node);
    if (s->rows == 0 || n_floats != (size_t)s->rows * w)
        return FU_EINVAL;
    ebuf **p = &x->act[(size_t)slot * x->n + node];
    if (*p) {
        (*p)->refs = 0;
        *p = NULL;
    }
    ebuf *b = NULL;
    FU_TRY(dagx_pool_get(x, (size_t)x->o.max_tokens * w, &b));
    kern_tensor_t t = tv1(b->t->data, KERN_F32, (int64_t)n_floats, x->be->device);
    fu_err rc = kern_tensor_copy_in(x->be, &t, data, n_floats * sizeof(float));
    if (rc != FU_OK) {
        b->refs = 0;
        return rc;
    }
    /* Held by its consumers and by the backward readers; released at the slot's end anyway. */
    *p = b;
    b->refs = 1;
    return FU_OK;
}

/* ---- optimizer ------------------------------------------------------------------------------ */

/* b_cat[:, :r1] = s1·B1 after an optimizer step, on the backend (a GEMM with the identity writes
 * the strided column block). */
static fu_err salr_refresh_b1(dag_exec_t *x, enode *e)
{
    if (e->r == 0)
        return FU_OK;
    kern_tensor_t cols = *e->b_cat;
    cols.shape[1] = e->r;
    return kern_gemm(x->be, false, false, e->scale, e->B, e->eye, 0.0f, &cols);
}

fu_err dag_exec_step(dag_exec_t *x, const kern_adamw_params *p)
{
    if (!x || !p || !x->o.training)
        return FU_EINVAL;
    x->step++;
    for (size_t i = x->first; i < x->last; i++) {
        enode *e = &x->nodes[i];
        if (!e->dB)
            continue;
        if (x->o.lorafa_correction && !e->train_a && N(x, i)->adapter.method == DAG_ADAPTER_LORA_FA)
            FU_TRY(kern_lorafa_correct_grad(x->be, e->A, e->scale, e->dB));
        FU_TRY(kern_adamw_step(x->be, e->B, e->dB, e->mB, e->vB, p, x->step));
        FU_TRY(kern_tensor_zero(x->be, e->dB));
        if (e->dA) {
            FU_TRY(kern_adamw_step(x->be, e->A, e->dA, e->mA, e->vA, p, x->step));
            FU_TRY(kern_tensor_zero(x->be, e->dA));
        }
        const dag_node *nd = N(x, i);
        if (nd->adapter.method == DAG_ADAPTER_SALR)
            FU_TRY(salr_refresh_b1(x, e));
    }
    return FU_OK;
}

fu_err dag_exec_adapter(dag_exec_t *x, uint32_t node, kern_tensor_t **A, kern_tensor_t **B, kern_tensor_t **dA,
                        kern_tensor_t **dB)
{
    if (!x || !in_range(x, node) || !x->nodes[node].A)
        return FU_EINVAL;
    enode *e = &x->nodes[node];
    if (A)
        *A = e->A;
    if (B)
        *B = e->B;
    if (dA)
        *dA = e->dA;
    if (dB)
        *dB = e->dB;
    return FU_OK;
}

fu_err dag_exec_adapter_changed(dag_exec_t *x, uint32_t node)
{
    if (!x || !in_range(x, node) || !x->nodes[node].A)
        return FU_EINVAL;
    if (N(x, node)->adapter.method == DAG_ADAPTER_SALR)
        return dagx_salr_rebuild(x, N(x, node), &x->nodes[node]);
    return FU_OK;
}

int64_t dag_exec_steps_done(const dag_exec_t *x)
{
    return x ? x->step : 0;
}

size_t dag_exec_saved_bytes(const dag_exec_t *x)
{
    return x ? x->saved_now : 0;
}

size_t dag_exec_saved_bytes_peak(const dag_exec_t *x)
{
    return x ? x->saved_peak : 0;
}

size_t dag_exec_trainable_params(const dag_exec_t *x)
{
    size_t n = 0;
    for (size_t i = x->first; i < x->last; i++) {
        const enode *e = &x->nodes[i];
        if (e->dB)
            n += (size_t)kern_tensor_numel(e->B);
        if (e->dA)
            n += (size_t)kern_tensor_numel(e->A);
    }
    return n;
}

/* ---- sessions ------------------------------------------------------------------------------- */

fu_err dag_exec_session_new(dag_exec_t *x, dag_session_t **out)
{
    if (!x || !out || x->o.training)
        return FU_EINVAL;
    dag_session_t *s = fu_calloc(1, sizeof *s);
    s->x = x;
    s->sampled = -1;
    s->caches = fu_calloc(x->n, sizeof *s->caches);
    for (size_t i = x->first; i < x->last; i++) {
        const dag_node *nd = N(x, i);
        if (nd->op != DAG_OP_ATTENTION)
            continue;
        fu_err rc = kern_kvcache_new(x->be, KERN_F32, (int)nd->n_kv_heads, (int)nd->head_dim, x->o.max_context, &s->caches[i]);
        if (rc != FU_OK) {
            dag_exec_session_destroy(&s);
            return rc;
        }
    }
    *out = s;
    return FU_OK;
}

void dag_exec_session_destroy(dag_session_t **s_p)
{
    if (!s_p || !*s_p)
        return;
    dag_session_t *s = *s_p;
    if (s->x && s->x->session == s)
        s->x->session = NULL;
    for (uint32_t k = 0; s->x && k < s->x->o.n_slots; k++) { /* no slot keeps a dangling session */
        eslot *sl = &s->x->slots[k];
        for (uint32_t j = 0; j < sl->n_sess; j++)
            if (sl->sess[j] == s)
                sl->n_sess = sl->rows = 0; /* its forward is refused until the slot is set again */
    }
    for (size_t i = 0; s->x && i < s->x->n; i++)
        kern_kvcache_destroy(&s->caches[i]);
    free(s->caches);
    free(s);
    *s_p = NULL;
}

void dag_exec_session_use(dag_exec_t *x, dag_session_t *s)
{
    if (x)
        x->session = s;
}

int64_t dag_session_len(const dag_session_t *s)
{
    return s ? s->len : 0;
}

void dag_session_set_sampling(dag_session_t *s, const kern_sample_params *p, uint64_t counter)
{
    if (!s)
        return;
    if (p)
        s->sp = *p;
    s->counter = counter;
}

fu_err dag_session_sampled(const dag_session_t *s, int32_t *token)
{
    if (!s || !token || s->sampled < 0)
        return FU_EINVAL;
    *token = s->sampled;
    return FU_OK;
}

fu_err dag_session_truncate(dag_session_t *s, int64_t len)
{
    if (!s || len < 0 || len > s->len)
        return FU_EINVAL;
    for (size_t i = 0; i < s->x->n; i++)
        if (s->caches[i])
            FU_TRY(kern_kvcache_truncate(s->caches[i], len));
    s->len = len;
    return FU_OK;
}
