/* broker_ckpt: what the broker makes of stage checkpoints, by tensor name against the job's graph:
 * the check of one blob, the finished adapter assembled from every stage's, and a job's newest
 * common checkpoint cut again for a plan with other stages (docs/PIPELINE.md "Re-planning").
 * A stage's checkpoint holds exactly the adapter tensors and AdamW moments of its graph range
 * (dag_peft_check), so the tensors of any range can be found in the blobs of any plan that covers
 * the graph. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "dag_peft.h"
#include "fu_alloc.h"
#include "fu_clock.h"

/* The checkpoints of every stage of a stored plan at one step, parsed and checked. */
typedef struct {
    db_ckpt *ck[BROKER_MAX_STAGES];
    fu_safetensors *st[BROKER_MAX_STAGES];
    uint32_t n;
} ckpt_set;

static void ckpt_set_free(ckpt_set *cs)
{
    for (uint32_t s = 0; s < BROKER_MAX_STAGES; s++) {
        fu_safetensors_close(&cs->st[s]);
        db_ckpt_free(&cs->ck[s]);
    }
    cs->n = 0;
}

/* Loads stage s's checkpoint at `step` for s < n, each checked to hold exactly the tensors of
 * [first[s], last[s]) of j's graph (checked again: the store may be older than this code). */
static fu_err ckpt_set_load(db_t *db, const char *id, const dag_graph_t *g, const uint32_t *first, const uint32_t *last,
                            uint32_t n, int64_t step, ckpt_set *cs, fu_errmsg *em)
{
    memset(cs, 0, sizeof *cs);
    if (n == 0 || n > BROKER_MAX_STAGES)
        return fu_errmsg_set(em, FU_EINVAL, "a plan of %u stages", n);
    fu_errmsg sub = {{0}};
    for (uint32_t s = 0; s < n; s++) {
        fu_err rc = db_ckpt_get(db, id, s, step, &cs->ck[s]);
        if (rc != FU_OK) {
            ckpt_set_free(cs);
            return fu_errmsg_set(em, rc, "stage %u has no checkpoint at step %" PRId64, s, step);
        }
        cs->n = s + 1;
        if ((rc = fu_safetensors_parse_header(cs->ck[s]->data, cs->ck[s]->len, "checkpoint", &cs->st[s], &sub)) !=
                FU_OK ||
            (rc = dag_peft_check(g, first[s], last[s], true, cs->st[s], &sub)) != FU_OK) {
            ckpt_set_free(cs);
            return fu_errmsg_set(em, rc, "checkpoint of stage %u at step %" PRId64 ": %s", s, step,
                                 fu_errmsg_text(&sub, rc));
        }
    }
    return FU_OK;
}

/* Tensor `name` from whichever checkpoint of cs holds it; NULL when none does. */
static const fu_st_tensor *ckpt_set_find(const ckpt_set *cs, const char *name)
{
    for (uint32_t s = 0; s < cs->n; s++) {
        const fu_st_tensor *t = fu_safetensors_get(cs->st[s], name);
        if (t)
            return t;
    }
    return NULL;
}

/* Appends the adapter tensors (with_state: and their moments) of nodes [first, last) of graph g,
 * found by name in cs, to *list. FU_EPROTO naming a tensor no checkpoint holds. */
static fu_err gather(const dag_graph_t *g, const ckpt_set *cs, uint32_t first, uint32_t last, bool with_state,
                     fu_st_tensor **list, size_t *n, size_t *cap, fu_errmsg *em)
{
    for (uint32_t i = first; i < last; i++) {
        dag_peft_tensor pt[DAG_PEFT_PER_NODE];
        size_t c = dag_peft_node_tensors(dag_graph_node(g, i), with_state, pt);
        for (size_t k = 0; k < c; k++) {
            const fu_st_tensor *t = ckpt_set_find(cs, pt[k].name);
            if (!t)
                return fu_errmsg_set(em, FU_EPROTO, "no checkpoint holds tensor '%s'", pt[k].name);
            if (*n == *cap) {
                *cap = *cap ? 2 * *cap : 64;
                *list = fu_realloc(*list, *cap * sizeof **list);
            }
            (*list)[(*n)++] = *t;
        }
    }
    return FU_OK;
}

fu_err broker_ckpt_check(const broker_job *j, uint32_t stage, const uint8_t *data, size_t len, uint64_t step,
                         fu_errmsg *em)
{
    fu_safetensors *st = NULL;
    fu_errmsg sub = {{0}};
    fu_err rc = fu_safetensors_parse_header(data, len, "checkpoint", &st, &sub);
    if (rc == FU_OK)
        rc = dag_peft_check(j->graph, j->stages[stage].first, j->stages[stage].last, true, st, &sub);
    const char *s = rc == FU_OK ? fu_safetensors_metadata(st, "step") : NULL;
    if (rc == FU_OK && (!s || strtoull(s, NULL, 10) != step))
        rc = fu_errmsg_set(&sub, FU_EPROTO, "its metadata says step %s, not %" PRIu64, s ? s : "(none)", step);
    fu_safetensors_close(&st);
    if (rc != FU_OK)
        fu_errmsg_set(em, FU_EPROTO, "%s", fu_errmsg_text(&sub, rc));
    return rc;
}

fu_err broker_adapter_assemble(broker_t *b, broker_job *j, int64_t step, uint8_t **out, size_t *len, fu_errmsg *em)
{
    uint32_t first[BROKER_MAX_STAGES], last[BROKER_MAX_STAGES];
    for (uint32_t s = 0; s < j->n_stages && s < BROKER_MAX_STAGES; s++) {
        first[s] = j->stages[s].first;
        last[s] = j->stages[s].last;
    }
    return broker_adapter_assemble_at(b->db, j->id, j->graph, first, last, j->n_stages, step, out, len, em);
}

fu_err broker_adapter_assemble_at(db_t *db, const char *id, const dag_graph_t *g, const uint32_t *first,
                                  const uint32_t *last, uint32_t n_stages, int64_t step, uint8_t **out, size_t *len,
                                  fu_errmsg *em)
{
    ckpt_set cs;
    FU_TRY(ckpt_set_load(db, id, g, first, last, n_stages, step, &cs, em));
    fu_st_tensor *list = NULL;
    size_t n = 0, cap = 0;
    fu_err rc = gather(g, &cs, 0, (uint32_t)dag_graph_size(g), false, &list, &n, &cap, em);
    if (rc == FU_OK && n == 0)
        rc = fu_errmsg_set(em, FU_EPROTO,
                           "the stages' checkpoints hold no adapter tensors (*.lora_A.weight / *.lora_B.weight)");
    fu_errmsg sub = {{0}};
    if (rc == FU_OK && (rc = fu_safetensors_serialize(list, n, NULL, 0, NULL, NULL, out, len, &sub)) != FU_OK)
        fu_errmsg_set(em, rc, "%s", fu_errmsg_text(&sub, rc));
    free(list);
    ckpt_set_free(&cs);
    return rc;
}

fu_err broker_ckpt_recut(db_t *db, const char *id, const dag_graph_t *g, const db_stage *old, size_t n_old,
                         int64_t step, db_stage_plan *plan, size_t n, fu_errmsg *em)
{
    uint32_t first[BROKER_MAX_STAGES], last[BROKER_MAX_STAGES];
    for (size_t s = 0; s < n_old && s < BROKER_MAX_STAGES; s++) {
        first[s] = old[s].first;
        last[s] = old[s].end;
    }
    ckpt_set cs;
    FU_TRY(ckpt_set_load(db, id, g, first, last, (uint32_t)n_old, step, &cs, em));
    /* every stage of the old plan is at the same optimizer step (the common checkpoint) */
    const char *adam_t = fu_safetensors_metadata(cs.st[0], "adam_t");
    fu_err rc = FU_OK;
    for (uint32_t s = 1; s < cs.n && rc == FU_OK; s++) {
        const char *t = fu_safetensors_metadata(cs.st[s], "adam_t");
        if (!adam_t || !t || strcmp(adam_t, t) != 0)
            rc = fu_errmsg_set(em, FU_EPROTO, "the checkpoints at step %" PRId64 " disagree on the optimizer's step",
                               step);
    }
    char step_s[24];
    snprintf(step_s, sizeof step_s, "%" PRId64, step);
    const char *meta[] = {"adam_t", adam_t, "step", step_s};
    fu_st_tensor *list = NULL;
    size_t cap = 0;
    for (size_t s = 0; s < n && rc == FU_OK; s++) {
        size_t k = 0;
        uint8_t *blob = NULL;
        size_t len = 0;
        fu_errmsg sub = {{0}};
        if ((rc = gather(g, &cs, plan[s].first, plan[s].end, true, &list, &k, &cap, em)) != FU_OK)
            break;
        if ((rc = fu_safetensors_serialize(list, k, meta, 2, NULL, NULL, &blob, &len, &sub)) != FU_OK) {
            fu_errmsg_set(em, rc, "stage %zu's checkpoint: %s", s, fu_errmsg_text(&sub, rc));
            break;
        }
        plan[s].ckpt = blob;
        plan[s].ckpt_len = len;
        plan[s].ckpt_step = step;
    }
    free(list);
    ckpt_set_free(&cs);
    if (rc != FU_OK)
        broker_ckpt_recut_free(plan, n);
    return rc;
}

void broker_ckpt_recut_free(db_stage_plan *plan, size_t n)
{
    for (size_t s = 0; s < n; s++) {
        free((void *)plan[s].ckpt);
        plan[s].ckpt = NULL;
        plan[s].ckpt_len = 0;
    }
}

/* ---- the writer: a re-plan's cut and commit off the loop ------------------------------------------ */

#define BROKER_CUT_DELAY_ENV "FUSION_TEST_CUT_DELAY_MS" /* tests: the writer sleeps this long first */

/* On the writer thread (or the loop when it was busy): touches c and c->db only. */
static void cut_run(broker_task *bt)
{
    broker_cut *c = (broker_cut *)bt;
    broker_task_test_delay(BROKER_CUT_DELAY_ENV);
    uint64_t t0 = fu_clock_ns();
    c->rc = broker_ckpt_recut(c->db, c->job, c->graph, c->old, c->n_old, c->step, c->plan, c->n, &c->em);
    uint64_t t1 = fu_clock_ns();
    c->cut_s = (double)(t1 - t0) / 1e9;
    if (c->rc != FU_OK) {
        c->cut_failed = true;
        return;
    }
    for (size_t s = 0; s < c->n; s++)
        c->bytes += c->plan[s].ckpt_len;
    /* the plan, its checkpoints and the job's move to running: one commit, before any assignment */
    int64_t now = broker_wall();
    for (size_t s = 0; s < c->n; s++)
        c->plan[s].lease_deadline_ms = now + c->lease_ms;
    c->rc = db_stage_assign(c->db, c->job, c->plan, c->n, BROKER_PLANNED_REASON, now);
    c->store_s = (double)(fu_clock_ns() - t1) / 1e9;
    if (c->rc != FU_OK)
        fu_errmsg_set(&c->em, c->rc, "the plan and its checkpoints could not be stored: %s",
                      c->rc == FU_EPERM ? "the job ended, or a peer it chose left, meanwhile" : fu_strerror(c->rc));
    broker_ckpt_recut_free(c->plan, c->n);
}

static void cut_done(broker_task *bt, void *loop)
{
    broker_cut *c = (broker_cut *)bt;
    c->then(loop, c);
    free(c);
}

static void cut_drop(broker_task *bt)
{
    broker_cut *c = (broker_cut *)bt;
    broker_ckpt_recut_free(c->plan, c->n);
    if (c->free_arg)
        c->free_arg(c->arg);
    free(c);
}

bool broker_cut_post(broker_t *b, broker_cut *c)
{
    c->base = (broker_task){.run = cut_run, .done = cut_done, .drop = cut_drop};
    for (size_t s = 0; s < c->n; s++)
        c->plan[s].peer = c->keys[s];
    c->db = b->writer_db;
    if (broker_worker_post(b->writer, &c->base))
        return true;
    c->db = b->db;
    return false;
}
