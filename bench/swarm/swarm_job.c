/* The simulated jobs: the plan as the broker assigns it to our peers, the pipeline's steps as timers
 * from the DAG's cost model and the stage peers' drawn hardware, StepDone from the last stage,
 * checkpoints from every stage (real safetensors of the stage's adapter tensors, which the broker
 * checks against the graph), and the clients that submit the jobs and poll their status. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "dag_peft.h"
#include "dag_serial.h"
#include "fu_file.h"
#include "fu_safetensors.h"
#include "swarm_internal.h"

#define SWARM_READY_MS      300  /* a stage's simulated load (weights cached or fetched), plus up to as much */
#define SWARM_POLL_EVERY_MS 1000 /* a client asks for each unfinished job's status this often */
#define SWARM_PREP_MAX      6    /* submissions of one client waiting for their answer at once */

int swarm_job_by_id(const swarm *s, uint64_t id)
{
    for (int k = 0; k < s->n_jobs; k++)
        if (s->jobs[k].id == id)
            return k;
    return -1;
}

/* The job an assignment names: by id, after reading the clients' answers when it is not known yet
 * (the broker answers the submission before it plans, but the two sockets are read in any order). */
static int job_of(swarm *s, uint64_t id)
{
    int k = swarm_job_by_id(s, id);
    for (int c = 0; k < 0 && c < s->cfg.n_clients; c++) {
        swarm_drain(s, -1 - c);
        k = swarm_job_by_id(s, id);
    }
    return k;
}

static uint64_t spec_u64(const cJSON *o, const char *key, uint64_t dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) && v->valuedouble >= 1 ? (uint64_t)v->valuedouble : dflt;
}

/* Forgets that peer i runs a stage of its job (it departed, or the stage moved). */
static void unmap(swarm *s, int i, uint64_t now, bool departed)
{
    swarm_peer *p = &s->peers[i];
    if (p->job < 0)
        return;
    swarm_job *j = &s->jobs[p->job];
    if (!p->backup && p->stage < j->n_stages && j->stage_peer[p->stage] == i) {
        j->stage_peer[p->stage] = -1;
        if (departed && j->st == SJ_ACKED) {
            s->stage_losses++;
            j->lost_ms[p->stage] = now;
            if (!j->any_lost_ms)
                j->any_lost_ms = now;
        }
        j->running = false; /* the pipeline stalls until the broker starts it again */
    }
    p->job = -1;
    p->backup = false;
    p->ready_ms = 0;
}

void swarm_job_peer_gone(swarm *s, int i)
{
    unmap(s, i, swarm_now(), true);
}

void swarm_job_on_assign(swarm *s, int i, const Fusion__StageAssign *a)
{
    swarm_peer *p = &s->peers[i];
    int k = job_of(s, a->job_id);
    if (k < 0 || a->stage_count == 0 || a->stage_count > SWARM_MAX_STAGES || a->stage_index >= a->stage_count)
        return;
    swarm_job *j = &s->jobs[k];
    uint64_t now = swarm_now();
    unmap(s, i, now, false);
    if (!j->g) {
        if (dag_graph_decode(a->dag.data, a->dag.len, &j->g, NULL) != FU_OK)
            return;
        cJSON *sp = cJSON_Parse(a->spec_json ? a->spec_json : "");
        j->steps = spec_u64(sp, "steps", 1);
        j->every = spec_u64(sp, "checkpoint_every", j->steps);
        j->batch = spec_u64(sp, "batch", 1);
        j->seq_len = spec_u64(sp, "seq_len", 1);
        j->micro = spec_u64(sp, "micro_batches", 1);
        cJSON_Delete(sp);
    }
    p->job = k;
    p->stage = a->stage_index;
    p->backup = a->backup;
    p->ready_ms = now + SWARM_READY_MS + (uint64_t)(swarm_uniform(&s->rng) * SWARM_READY_MS);
    if (a->backup)
        return;
    if (j->n_stages != a->stage_count) { /* a new plan: the old mapping is void */
        j->n_stages = a->stage_count;
        for (uint32_t t = 0; t < SWARM_MAX_STAGES; t++)
            j->stage_peer[t] = -1;
    }
    int old = j->stage_peer[a->stage_index];
    if (old >= 0 && old != i && s->peers[old].job == k && !s->peers[old].backup)
        s->peers[old].job = -1; /* the stage moved: the broker released it */
    j->stage_peer[a->stage_index] = i;
    j->first[a->stage_index] = a->node_begin;
    j->last[a->stage_index] = a->node_end;
    j->running = false;
    if (j->lost_ms[a->stage_index]) {
        swarm_samples_add(&s->replace_ms, (double)(now - j->lost_ms[a->stage_index]));
        j->lost_ms[a->stage_index] = 0;
    }
    if (!j->planned) {
        uint32_t have = 0;
        for (uint32_t t = 0; t < j->n_stages; t++)
            have += j->stage_peer[t] >= 0;
        if (have == j->n_stages && j->ack_ms) {
            j->planned = true;
            swarm_samples_add(&s->plan_ms, (double)(now - j->ack_ms));
        }
    }
}

/* Seconds of one step of j's pipeline on its stage peers: every stage computes its share of the
 * model's FLOPs, times work_scale (the small model stands in for a large one), at its peer's speed,
 * and sends its cut forward and the gradient back over its upload link with the link's round trip,
 * not scaled (what the broker's own plan predicts for them); M micro-batches through S stages take
 * (M + S - 1) micro-batch slots of the slowest stage. Negative when a stage has no peer. */
static double step_seconds(const swarm *s, const swarm_job *j)
{
    double tokens = (double)(j->batch * j->seq_len), worst = 0;
    for (uint32_t t = 0; t < j->n_stages; t++) {
        int pi = j->stage_peer[t];
        if (pi < 0 || s->peers[pi].st != SP_ONLINE)
            return -1;
        const swarm_peer *p = &s->peers[pi];
        dag_cost c = dag_graph_cost(j->g, j->first[t], j->last[t]);
        double sec = tokens * (c.flops_fwd + c.flops_bwd) * s->cfg.work_scale / (p->gflops * 1e9);
        if (t + 1 < j->n_stages)
            sec += tokens * 4.0 * (double)dag_graph_cut_width(j->g, j->last[t]) * 2.0 / (p->link->up_mbit * 125000.0) +
                   p->link->rtt_ms / 1000.0;
        if (sec > worst)
            worst = sec;
    }
    double m = (double)(j->micro ? j->micro : 1);
    return (m + (double)j->n_stages - 1) * worst / m;
}

void swarm_job_on_start(swarm *s, int i, const Fusion__StageStart *st)
{
    (void)i;
    int k = swarm_job_by_id(s, st->job_id);
    if (k < 0)
        return;
    swarm_job *j = &s->jobs[k];
    if (j->running && st->step >= j->step)
        return; /* the same start, told to another stage */
    double sec = step_seconds(s, j);
    if (sec < 0)
        return; /* a stage's peer is gone already: the broker will notice */
    uint64_t now = swarm_now();
    j->running = true;
    j->gen++;
    if (!j->start_ms) {
        j->start_ms = now;
        j->step_s_first = sec;
    }
    j->step_s_last = sec;
    j->step = st->step;
    j->step_due_ms = now + (uint64_t)(sec * 1000.0) + 1;
    if (j->any_lost_ms) {
        swarm_samples_add(&s->resume_ms, (double)(now - j->any_lost_ms));
        j->any_lost_ms = 0;
    }
}

void swarm_job_on_release(swarm *s, int i, uint64_t job_id, uint32_t stage)
{
    swarm_peer *p = &s->peers[i];
    if (p->job >= 0 && s->jobs[p->job].id == job_id && p->stage == stage)
        unmap(s, i, swarm_now(), false);
}

/* The checkpoint of stage t of j at `step`: every adapter tensor and moment of its node range. Caller
 * frees *data. */
static bool ckpt_blob(const swarm *s, const swarm_job *j, uint32_t t, uint64_t step, char **data, size_t *len)
{
    size_t cap = 16, n = 0;
    fu_st_tensor *ts = calloc(cap, sizeof *ts);
    dag_peft_tensor *names = calloc(cap, sizeof *names);
    bool ok = ts && names;
    for (uint32_t i = j->first[t]; ok && i < j->last[t]; i++) {
        dag_peft_tensor pt[DAG_PEFT_PER_NODE];
        size_t c = dag_peft_node_tensors(dag_graph_node(j->g, i), true, pt);
        for (size_t q = 0; q < c && ok; q++) {
            if (n == cap) {
                cap *= 2;
                fu_st_tensor *nt = realloc(ts, cap * sizeof *ts);
                dag_peft_tensor *nn = realloc(names, cap * sizeof *names);
                ts = nt ? nt : ts;
                names = nn ? nn : names;
                ok = nt && nn;
                if (!ok)
                    break;
            }
            names[n] = pt[q];
            size_t cnt = (size_t)(pt[q].shape[0] * pt[q].shape[1]);
            float *v = calloc(cnt ? cnt : 1, sizeof *v);
            ok = v != NULL;
            ts[n] = (fu_st_tensor){.dtype = FU_ST_F32, .ndim = 2, .shape = {pt[q].shape[0], pt[q].shape[1]},
                                   .data = v, .nbytes = cnt * sizeof *v};
            n++;
        }
    }
    for (size_t q = 0; q < n; q++)
        ts[q].name = names[q].name;
    char path[4300], stepv[32];
    snprintf(path, sizeof path, "%s/ckpt.tmp", s->dir);
    snprintf(stepv, sizeof stepv, "%" PRIu64, step);
    const char *meta[] = {"step", stepv, "adam_t", stepv};
    ok = ok && fu_safetensors_write(path, ts, n, meta, 2, NULL, NULL, NULL) == FU_OK &&
         fu_file_read_all(path, 256u << 20, data, len, NULL) == FU_OK;
    for (size_t q = 0; q < n; q++)
        free((void *)ts[q].data);
    free(ts);
    free(names);
    return ok;
}

static void send_ckpt(swarm *s, swarm_job *j, uint32_t t, uint64_t step)
{
    char *data = NULL;
    size_t len = 0;
    int pi = j->stage_peer[t];
    if (pi < 0 || !ckpt_blob(s, j, t, step, &data, &len))
        return;
    uint8_t hash[32];
    crypto_generichash(hash, sizeof hash, (const uint8_t *)data, len, NULL, 0);
    Fusion__CheckpointPut c = FUSION__CHECKPOINT_PUT__INIT;
    c.job_id = j->id;
    c.stage_index = t;
    c.step = step;
    c.offset = 0;
    c.total = len;
    c.content_hash.data = hash;
    c.content_hash.len = sizeof hash;
    c.data.data = (uint8_t *)data;
    c.data.len = len;
    (void)swarm_peer_send(s, pi, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, j->id, &c.base);
    free(data);
}

/* Step j->step of j is done: StepDone from the last stage, checkpoints when due, the next step. */
static void step_done(swarm *s, swarm_job *j, uint64_t now)
{
    double sec = step_seconds(s, j);
    if (sec < 0) { /* a stage's peer went: the pipeline stalls */
        j->running = false;
        return;
    }
    Fusion__StepDone d = FUSION__STEP_DONE__INIT;
    d.job_id = j->id;
    d.step = j->step;
    d.loss = 5.0 / (1.0 + (double)j->step);
    d.tokens = j->batch * j->seq_len;
    (void)swarm_peer_send(s, j->stage_peer[j->n_stages - 1], FUSION__MSG_TYPE__MSG_STEP_DONE, j->id, &d.base);
    if (j->step >= j->steps_done) {
        s->steps_new++;
        j->steps_done = j->step + 1;
    } else {
        s->steps_replayed++;
    }
    uint64_t next = j->step + 1;
    if (next % j->every == 0 || next == j->steps)
        for (uint32_t t = 0; t < j->n_stages; t++)
            send_ckpt(s, j, t, next);
    j->step = next;
    if (next >= j->steps) {
        j->running = false;
        return;
    }
    j->step_due_ms = now + (uint64_t)(sec * 1000.0) + 1;
}

void swarm_job_timers(swarm *s, uint64_t now)
{
    for (int k = 0; k < s->n_jobs; k++) {
        swarm_job *j = &s->jobs[k];
        if (j->running && now >= j->step_due_ms)
            step_done(s, j, now);
    }
}

/* ---- clients ---- */

static fu_err client_send(swarm *s, int k, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body)
{
    swarm_client *c = &s->clients[k];
    wire_hdr h = {.type = t, .job_id = job, .sequence = ++c->seq};
    fu_err rc = wire_send(c->sock, NULL, 0, &h, body);
    swarm_mark(s, -1 - k);
    return rc;
}

static void submit(swarm *s, swarm_job *j, uint64_t now)
{
    char spec[8192];
    snprintf(spec, sizeof spec,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, \"steps\": %d, "
             "\"batch\": 8, \"seq_len\": 32, \"micro_batches\": 4, \"checkpoint_every\": %d}",
             s->model, s->cfg.job_steps, s->cfg.ckpt_every);
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.idempotency_key = j->idem;
    js.kind = FUSION__JOB_KIND__JOB_KIND_FINETUNE;
    js.spec_json = spec;
    js.data.data = (uint8_t *)s->data;
    js.data.len = s->data_len;
    if (!j->submit_ms)
        j->submit_ms = now;
    j->st = SJ_SUBMITTED;
    j->retry_ms = now + 30000; /* no answer by then: submit again (same key, same job) */
    (void)client_send(s, j->client, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base);
}

void swarm_client_timers(swarm *s, uint64_t now)
{
    int waiting[SWARM_MAX_CLIENTS] = {0};
    for (int k = 0; k < s->n_jobs; k++)
        waiting[s->jobs[k].client] += s->jobs[k].st == SJ_SUBMITTED;
    for (int k = 0; k < s->n_jobs; k++) {
        swarm_job *j = &s->jobs[k];
        if ((j->st == SJ_NEW && now >= j->retry_ms && waiting[j->client] < SWARM_PREP_MAX) ||
            (j->st == SJ_SUBMITTED && now >= j->retry_ms)) {
            waiting[j->client] += j->st == SJ_NEW;
            submit(s, j, now);
        } else if (j->st == SJ_ACKED && now >= j->poll_ms) {
            j->poll_ms = now + SWARM_POLL_EVERY_MS;
            Fusion__JobRef r = FUSION__JOB_REF__INIT;
            r.job_id = j->id;
            (void)client_send(s, j->client, FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ, j->id, &r.base);
        }
    }
}

void swarm_client_on_message(swarm *s, int c, const wire_msg_t *m)
{
    uint64_t now = swarm_now();
    if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR) {
        const Fusion__Error *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        s->errors++;
        if (!e)
            return;
        if (e->in_reply_to == FUSION__MSG_TYPE__MSG_JOB_SUBMIT) {
            /* refused for now (ERR_BUSY: the preparation queue or the client's rate): the oldest
             * submission of this client waiting for an answer goes back to the queue */
            for (int k = 0; k < s->n_jobs; k++)
                if (s->jobs[k].client == c && s->jobs[k].st == SJ_SUBMITTED) {
                    s->jobs[k].st = SJ_NEW;
                    s->jobs[k].retry_ms = now + 1000;
                    break;
                }
            if (e->code != FUSION__ERROR_CODE__ERR_BUSY && !s->cfg.quiet)
                fprintf(stderr, "bench-swarm: submission refused: %s\n", e->message);
            return;
        }
        int k = swarm_job_by_id(s, wire_msg_hdr(m)->job_id);
        if (k >= 0 && e->code == FUSION__ERROR_CODE__ERR_NOT_FOUND)
            s->jobs[k].st = SJ_LOST;
        return;
    }
    const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
    if (!st)
        return;
    swarm_job *j = NULL;
    for (int k = 0; k < s->n_jobs && !j; k++)
        if (s->jobs[k].client == c && st->idempotency_key && strcmp(s->jobs[k].idem, st->idempotency_key) == 0)
            j = &s->jobs[k];
    if (!j) {
        int k = swarm_job_by_id(s, st->job_id);
        j = k >= 0 ? &s->jobs[k] : NULL;
    }
    if (!j)
        return;
    if (j->st == SJ_SUBMITTED || j->st == SJ_NEW) {
        j->id = st->job_id;
        j->st = SJ_ACKED;
        j->ack_ms = now;
        j->poll_ms = now + SWARM_POLL_EVERY_MS;
    }
    bool was_final = j->st >= SJ_DONE;
    switch (st->state) {
    case FUSION__JOB_STATE__JOB_STATE_DONE:
        j->st = SJ_DONE;
        break;
    case FUSION__JOB_STATE__JOB_STATE_FAILED:
        if (j->st != SJ_FAILED && !s->cfg.quiet)
            fprintf(stderr, "bench-swarm: job %016" PRIx64 " failed: %s\n", j->id, st->message);
        j->st = SJ_FAILED;
        break;
    case FUSION__JOB_STATE__JOB_STATE_CANCELED:
        j->st = SJ_CANCELLED;
        break;
    default:
        break;
    }
    if (!was_final && j->st >= SJ_DONE)
        j->final_ms = now;
}
