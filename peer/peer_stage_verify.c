/* peer_stage_verify: the compute thread's part in verification (docs/PIPELINE.md "Verification"):
 * a stage keeps its recent outputs and input hashes and answers VerifyRequest with their sketch, hands
 * an output to the I/O thread for a verifier (VerifyDeliver), and a warm backup acting as verifier
 * queues requests, fetches the checkpoint of their step, re-runs the sample and answers with its own
 * sketch. The sketch, the hash and the sealed delivery are peer_verify.c's. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dag_exec.h"
#include "dag_graph.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "peer_blob.h"
#include "peer_stage_internal.h"
#include "peer_faults.h"
#include "peer_verify.h"

#define ST_VERIFY_INPUT_WAIT_MS 60000 /* a verifier gives up on an input that has not come by then */

/* Row of the verification ring for `step`, emptied first when it held another step. */
size_t stage_kept_row(stage_t *s, uint64_t step)
{
    size_t r = (size_t)(step % ST_VERIFY_KEEP);
    if (s->kept_step[r] != step) {
        for (uint32_t k = 0; k < DAG_EXEC_MAX_SLOTS; k++) {
            free(s->kept[r][k]);
            s->kept[r][k] = NULL;
            s->kept_in_ok[r][k] = false;
        }
        s->kept_step[r] = step;
    }
    return r;
}

bool stage_keeps_for_verify(const stage_t *s, uint32_t mb)
{
    return s->verify > 0 && !s->backup && !stage_is_infer(s) && mb < DAG_EXEC_MAX_SLOTS;
}

/* Keeps a copy of the output of (step, mb) in the verification ring. */
static void keep_output(stage_t *s, uint64_t step, uint32_t mb, const float *f, size_t total)
{
    if (s->kept_n != total) { /* the output's size changed (never within a job): forget what is held */
        for (size_t r = 0; r < ST_VERIFY_KEEP; r++)
            for (uint32_t k = 0; k < DAG_EXEC_MAX_SLOTS; k++) {
                free(s->kept[r][k]);
                s->kept[r][k] = NULL;
            }
        s->kept_n = total;
    }
    size_t r = stage_kept_row(s, step);
    if (!s->kept[r][mb])
        s->kept[r][mb] = fu_malloc(total * sizeof(float) + 1);
    memcpy(s->kept[r][mb], f, total * sizeof(float));
}

/* The output a stage produces for the pipeline (activations down; the last stage: gradients up, both
 * as the neighbour decodes them) is about to be sent: with verification on a copy of what is sent is
 * kept, so that a VerifyRequest or VerifyDeliver is answered from the output actually produced. The
 * fault hook (tests only) may corrupt it first ("scale", "nudge"), or keep the honest copy and corrupt
 * what is sent ("lie"). Returns whether f was changed (then it must be encoded again). */
bool stage_output_produced(stage_t *s, uint64_t step, uint32_t mb, float *f, size_t total)
{
    /* FAULT INJECTION FOR TESTS ONLY (peer_verify.h): a dishonest peer */
    peer_corrupt_mode cheat = peer_fault_corrupt_now();
    if (cheat == PEER_CORRUPT_SEND)
        for (size_t i = 0; i < total; i++)
            f[i] *= PEER_CORRUPT_SCALE;
    if (cheat == PEER_CORRUPT_NUDGE && total > 0)
        f[0] = nextafterf(f[0], INFINITY);
    if (stage_keeps_for_verify(s, mb))
        keep_output(s, step, mb, f, total);
    if (cheat == PEER_CORRUPT_LIE) /* keeps the honest output, sends a scaled one */
        for (size_t i = 0; i < total; i++)
            f[i] *= PEER_CORRUPT_SCALE;
    return cheat == PEER_CORRUPT_SEND || cheat == PEER_CORRUPT_NUDGE || cheat == PEER_CORRUPT_LIE;
}

/* Answers the broker with the sketch of x (n floats), the hash of its bytes and the hash of the
 * input it came from, or with `unavailable` when x is NULL. */
static void verify_answer(stage_t *s, uint64_t step, uint32_t mb, uint64_t seed, const float *x, size_t n,
                          const uint8_t *input_hash, const char *unavailable)
{
    Fusion__VerifySketch v = FUSION__VERIFY_SKETCH__INIT;
    double sk[WIRE_VERIFY_SKETCH_K], norm = 0;
    uint8_t oh[WIRE_VERIFY_HASH_BYTES];
    v.job_id = s->job_id;
    v.stage_index = s->stage_index;
    v.step = step;
    v.micro_batch = mb;
    v.seed = seed;
    if (x && input_hash) {
        peer_verify_sketch(x, n, seed, sk, &norm);
        v.n_sketch = WIRE_VERIFY_SKETCH_K;
        v.sketch = sk;
        v.norm = norm;
        v.input_hash.data = (uint8_t *)input_hash;
        v.input_hash.len = WIRE_VERIFY_HASH_BYTES;
        peer_verify_hash(x, n * sizeof(float), oh);
        v.output_hash.data = oh;
        v.output_hash.len = sizeof oh;
    } else {
        v.unavailable = (char *)unavailable;
        FU_INFO("peer", "job %016" PRIx64 " stage %u: cannot sketch step %" PRIu64 " mb %u: %s", s->job_id,
                s->stage_index, step, mb, unavailable);
    }
    stage_send_msg(s, FUSION__MSG_TYPE__MSG_VERIFY_SKETCH, step, &v.base);
}

/* Stage 0's input hash for (step, mb): the micro-batch's token ids (I32, PIPELINE.md data order). */
static fu_err token_hash(stage_t *s, uint64_t step, uint32_t mb, uint8_t out[WIRE_VERIFY_HASH_BYTES])
{
    FU_TRY(stage_spec_rows(s, s->ids, s->n_ids, step, mb, s->tok, s->tgt));
    peer_verify_hash(s->tok, (size_t)s->rows_mb * s->spec.seq_len * sizeof(int32_t), out);
    return FU_OK;
}

/* Restores the checkpoint of `step` (contract names) into the verifier's executor. */
static fu_err verify_restore(stage_t *s, const uint8_t *d, size_t len, uint64_t step, fu_errmsg *em)
{
    uint64_t keep = s->resume_step;
    s->resume_step = step; /* stage_restore_ckpt checks the blob's step against it */
    fu_err rc = stage_restore_ckpt(s, d, len, em);
    s->resume_step = keep;
    return rc;
}

/* The verifier re-runs stage's computation of (step, mb) from the state it holds -- forward from
 * the tokens (stage 0) or from the delivered input (stage k > 0); at the last stage also the
 * backward, whose input gradient is the stage's output -- and sketches the output. */
static void verify_compute(stage_t *s, const verify_req *q)
{
    uint64_t rows = (uint64_t)s->rows_mb * s->spec.seq_len;
    bool last = stage_is_last(s), solo = last && stage_is_first(s); /* solo: the output is the loss */
    size_t total = solo ? 1 : (size_t)(rows * (last ? s->w_in_total : s->w_out_total));
    uint8_t ih[WIRE_VERIFY_HASH_BYTES];
    fu_err rc = FU_OK;
    if (stage_is_first(s)) {
        rc = token_hash(s, q->step, q->mb, ih);
        if (rc == FU_OK)
            rc = dag_exec_set_tokens(s->x, q->mb, s->tok, last ? s->tgt : NULL, s->rows_mb, s->spec.seq_len);
    } else {
        uint64_t want = rows * s->w_in_total * sizeof(float);
        if (!q->input || q->n_input != want) {
            char text[200];
            snprintf(text, sizeof text, "the delivered input has %zu bytes; stage %u takes %" PRIu64, q->n_input,
                     s->stage_index, want);
            verify_answer(s, q->step, q->mb, q->seed, NULL, 0, NULL, text);
            return;
        }
        peer_verify_hash(q->input, q->n_input, ih);
        if (last)
            rc = stage_spec_rows(s, s->ids, s->n_ids, q->step, q->mb, s->tok, s->tgt);
        if (rc == FU_OK)
            rc = dag_exec_set_tokens(s->x, q->mb, NULL, last ? s->tgt : NULL, s->rows_mb, s->spec.seq_len);
        const float *f = (const float *)q->input;
        size_t off = 0;
        for (uint32_t i = 0; i < s->n_cut_in && rc == FU_OK; i++) {
            size_t n = (size_t)(rows * dag_graph_width(s->g, s->cut_in[i]));
            rc = dag_exec_set_input(s->x, q->mb, s->cut_in[i], f + off, n);
            off += n;
        }
    }
    if (rc == FU_OK)
        rc = dag_exec_forward(s->x, q->mb);
    /* The backward accumulates adapter gradients in the verifier's executor: harmless, a backup
     * never steps, and an assignment that promotes it makes a new executor. */
    if (rc == FU_OK && last && !solo)
        rc = dag_exec_backward(s->x, q->mb, 1.0f / (float)s->M);
    if (rc == FU_ECUDA) {
        stage_fatal(s, rc, "verification forward");
        return;
    }
    float *out = rc == FU_OK ? fu_calloc(total + 1, sizeof(float)) : NULL;
    int64_t n_valid = 0;
    if (rc == FU_OK && solo)
        rc = dag_exec_loss(s->x, q->mb, out, &n_valid);
    else if (rc == FU_OK)
        rc = last ? stage_collect_input_grads(s, rows, total, out) : stage_collect_outputs(s, q->mb, total, out);
    uint8_t *wire = NULL; /* the output as the stage's neighbour decodes it */
    size_t wire_len = 0;
    kern_codec codec = last ? s->spec.grad_codec : s->spec.act_codec;
    if (rc == FU_OK && !solo && codec != KERN_CODEC_INT8_EF) /* int8-ef: the stage keeps its gradient as computed */
        rc = stage_wire_encode(s, codec, !last, q->step, q->mb, out, &wire, &wire_len);
    free(wire);
    if (rc == FU_OK)
        verify_answer(s, q->step, q->mb, q->seed, out, total, ih, NULL);
    else
        verify_answer(s, q->step, q->mb, q->seed, NULL, 0, NULL, "the verification forward failed");
    free(out);
}

/* Removes request i from the queue; its input (if any) goes with the copy the caller took. */
static void verify_remove(stage_t *s, size_t i)
{
    memmove(s->vq + i, s->vq + i + 1, (s->n_vq - i - 1) * sizeof *s->vq);
    s->n_vq--;
}

/* A request can be computed once its input is there (stage 0 makes its own from the tokens). */
static bool verify_ready(const stage_t *s, const verify_req *q)
{
    return stage_is_first(s) || q->input != NULL;
}

/* Answers the ready requests whose state is loaded; starts the checkpoint fetch for the next one. */
static void verify_pump(stage_t *s)
{
    while (s->active && !s->vfetching) {
        size_t i = 0;
        while (i < s->n_vq && !verify_ready(s, &s->vq[i]))
            i++;
        if (i == s->n_vq)
            return;
        verify_req q = s->vq[i];
        if ((int64_t)q.step == s->vstate_step) {
            verify_remove(s, i);
            verify_compute(s, &q);
            free(q.input);
            continue;
        }
        if (q.step == 0) {
            verify_remove(s, i);
            verify_answer(s, q.step, q.mb, q.seed, NULL, 0, NULL, "the initial adapter state is no longer loaded");
            free(q.input);
            continue;
        }
        char jid[64], name[96];
        snprintf(jid, sizeof jid, "job:%016" PRIx64, s->job_id);
        snprintf(name, sizeof name, "%s:%u:%" PRIu64, stage_step_has_ckpt(s, q.step) ? "ckpt" : "vsnap",
                 s->stage_index, q.step);
        stage_add_fetch(s, jid, name, FETCH_VERIFY_CKPT, false);
        s->vfetching = true;
        s->vfetch_step = q.step;
        stage_ask_next(s);
    }
}

/* Gives up on requests whose input has not come in ST_VERIFY_INPUT_WAIT_MS (the broker has dropped
 * the sample by then). */
void stage_verify_expire(stage_t *s)
{
    uint64_t now = fu_clock_ms();
    for (size_t i = 0; i < s->n_vq;) {
        verify_req *q = &s->vq[i];
        if (verify_ready(s, q) || now - q->since_ms < ST_VERIFY_INPUT_WAIT_MS) {
            i++;
            continue;
        }
        verify_req c = *q;
        verify_remove(s, i);
        char text[160];
        snprintf(text, sizeof text, "the input from stage %u did not come within %d s", s->stage_index - 1,
                 ST_VERIFY_INPUT_WAIT_MS / 1000);
        verify_answer(s, c.step, c.mb, c.seed, NULL, 0, NULL, text);
    }
}

/* The checkpoint of vfetch_step arrived (ok) or cannot be had: restore it, or answer every request
 * of that step as unavailable; then go on with the queue. */
void stage_verify_fetched(stage_t *s, bool ok, const char *why)
{
    if (!s->vfetching || s->n_fetch == 0)
        return;
    uint64_t step = s->vfetch_step;
    fetch_item *f = &s->fetch[s->n_fetch - 1];
    fu_err rc = FU_EPROTO;
    fu_errmsg em = {{0}};
    if (ok) {
        size_t len;
        const uint8_t *d = peer_blob_data(f->blob, &len);
        s->vstate_step = -1; /* a failed restore may leave the state half-written */
        rc = verify_restore(s, d, len, step, &em);
        if (rc == FU_OK)
            s->vstate_step = (int64_t)step;
    }
    peer_blob_destroy(&f->blob);
    s->n_fetch--;
    if (s->cur_fetch > s->n_fetch)
        s->cur_fetch = s->n_fetch;
    s->vfetching = false;
    if (rc != FU_OK) {
        char text[300];
        snprintf(text, sizeof text, "checkpoint of step %" PRIu64 " unavailable: %s", step,
                 ok ? fu_errmsg_text(&em, rc) : why);
        for (size_t i = 0; i < s->n_vq;) {
            if (s->vq[i].step != step) {
                i++;
                continue;
            }
            verify_req q = s->vq[i];
            verify_remove(s, i);
            free(q.input);
            verify_answer(s, q.step, q.mb, q.seed, NULL, 0, NULL, text);
        }
    }
    verify_pump(s);
}

void stage_on_verify_request(stage_t *s, const Fusion__VerifyRequest *r)
{
    uint64_t jid = s->job_id;
    if (!s->active || r->job_id != s->job_id || r->stage_index != s->stage_index || !s->loaded || stage_is_infer(s) ||
        r->step >= s->spec.steps || r->micro_batch >= s->M) {
        s->job_id = r->job_id; /* the answer names the request's job */
        uint32_t keep = s->stage_index;
        s->stage_index = r->stage_index;
        verify_answer(s, r->step, r->micro_batch, r->seed, NULL, 0, NULL,
                      "this peer holds no loaded stage of this fine-tune job for that stage, step and micro-batch");
        s->job_id = jid;
        s->stage_index = keep;
        return;
    }
    /* FAULT INJECTION FOR TESTS ONLY (peer_faults.h): an honest peer that reads the request late */
    if (!s->backup && peer_fault_verify_late() && !s->finished && s->step < r->step + ST_VERIFY_KEEP &&
        s->n_late < ST_VERIFY_QUEUE) {
        s->late[s->n_late++] = *r;
        return;
    }
    if (!s->backup) {
        /* The stage's own peer: the sketch of the output it already sent, and the hash of the input
         * it received (stage 0: of its tokens); for a step without a checkpoint also the snapshot of
         * the state it computed that step from, for the verifier (once per step). */
        size_t k = (size_t)(r->step % ST_VERIFY_KEEP);
        if (r->snapshot) {
            if (!s->snap[k] || s->snap_step[k] != r->step) {
                verify_answer(s, r->step, r->micro_batch, r->seed, NULL, 0, NULL,
                              "the state of that step is no longer held (this peer keeps the last 3 steps)");
                return;
            }
            if (!s->snap_sent[k])
                stage_send_state(s, r->step, s->snap[k], s->snap_len[k], true);
            s->snap_sent[k] = true;
        }
        bool held = s->kept_step[k] == r->step;
        const float *x = held ? s->kept[k][r->micro_batch] : NULL;
        uint8_t ih[WIRE_VERIFY_HASH_BYTES];
        bool have_ih = false;
        if (stage_is_first(s))
            have_ih = token_hash(s, r->step, r->micro_batch, ih) == FU_OK;
        else if (held && s->kept_in_ok[k][r->micro_batch]) {
            memcpy(ih, s->kept_in[k][r->micro_batch], sizeof ih);
            have_ih = true;
        }
        verify_answer(s, r->step, r->micro_batch, r->seed, x, s->kept_n, have_ih ? ih : NULL,
                      "that output is no longer held (this peer keeps the last 3 steps)");
        return;
    }
    if (s->n_vq == ST_VERIFY_QUEUE) {
        verify_answer(s, r->step, r->micro_batch, r->seed, NULL, 0, NULL, "too many verification requests queued");
        return;
    }
    s->vq[s->n_vq++] = (verify_req){.step = r->step, .mb = r->micro_batch, .seed = r->seed, .since_ms = fu_clock_ms()};
    verify_pump(s);
}

void stage_verify_late_replay(stage_t *s)
{
    for (size_t i = 0; i < s->n_late;) {
        Fusion__VerifyRequest r = s->late[i];
        if (!s->finished && s->step < r.step + ST_VERIFY_KEEP) {
            i++;
            continue;
        }
        memmove(s->late + i, s->late + i + 1, (s->n_late - i - 1) * sizeof *s->late);
        s->n_late--;
        /* (the hook's variable is not named here: a release peer names no test hook, test_peer_release_has_no_hooks) */
        FU_INFO("peer", "job %016" PRIx64 " stage %u: test hook (late verification): reading the request for step %" PRIu64
                " mb %u at step %" PRIu64, s->job_id, s->stage_index, r.step, r.micro_batch, s->step);
        stage_on_verify_request(s, &r);
    }
}

/* Tells the broker that the output of (step, mb) asked for by d cannot be delivered. */
static void deliver_unavailable(stage_t *s, const Fusion__VerifyDeliver *d, const char *why)
{
    const peer_vin_id id = {.job_id = d->job_id, .stage = d->stage_index, .step = d->step,
                            .micro_batch = d->micro_batch, .seed = d->seed};
    Fusion__VerifyInput vi = FUSION__VERIFY_INPUT__INIT;
    peer_vin_id_to_msg(&id, &vi);
    vi.verifier_key = d->verifier_key;
    vi.unavailable = (char *)why;
    FU_INFO("peer", "job %016" PRIx64 ": cannot deliver the input of stage %u step %" PRIu64 " mb %u to a verifier: %s",
            d->job_id, d->stage_index, d->step, d->micro_batch, why);
    stage_send_msg(s, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, d->step, &vi.base);
}

/* As the upstream of a stage being verified: hand the output this peer sent for (step, mb) to the
 * I/O thread, which seals it to the verifier's key and sends it through the broker. */
void stage_on_verify_deliver(stage_t *s, const Fusion__VerifyDeliver *d)
{
    char why[200];
    if (!s->active || d->job_id != s->job_id || !s->loaded || s->backup || stage_is_infer(s)) {
        deliver_unavailable(s, d, "this peer runs no stage of that fine-tune job");
        return;
    }
    if (stage_is_last(s) || d->stage_index != s->stage_index + 1) {
        snprintf(why, sizeof why, "this peer runs stage %u of %u, not the upstream of stage %u", s->stage_index,
                 s->stage_count, d->stage_index);
        deliver_unavailable(s, d, why);
        return;
    }
    if (d->verifier_key.len != WIRE_KEY_BYTES || d->micro_batch >= s->M) {
        deliver_unavailable(s, d, "the request has no 32-byte verifier key or a micro-batch out of range");
        return;
    }
    size_t k = (size_t)(d->step % ST_VERIFY_KEEP);
    const float *x = s->kept_step[k] == d->step ? s->kept[k][d->micro_batch] : NULL;
    if (!x || s->kept_n == 0) {
        deliver_unavailable(s, d, "that output is no longer held (this peer keeps the last 3 steps)");
        return;
    }
    peer_cmd *c = peer_cmd_new(PEER_CMD_VERIFY_SEND);
    c->job_id = d->job_id;
    c->stage = d->stage_index;
    c->step = d->step;
    c->micro_batch = d->micro_batch;
    c->seed = d->seed;
    memcpy(c->key, d->verifier_key.data, WIRE_KEY_BYTES);
    c->len = s->kept_n * sizeof(float);
    c->data = fu_malloc(c->len);
    memcpy(c->data, x, c->len);
    stage_to_io(s, c);
}

/* A delivered input (or the news that none comes) for a queued request of this verifier. Takes c. */
void stage_on_verify_input(stage_t *s, peer_cmd *c)
{
    verify_req *q = NULL;
    size_t qi = 0;
    if (s->active && s->backup && s->loaded && c->job_id == s->job_id && c->stage == s->stage_index)
        for (size_t i = 0; i < s->n_vq && !q; i++)
            if (s->vq[i].step == c->step && s->vq[i].mb == c->micro_batch && s->vq[i].seed == c->seed &&
                !s->vq[i].input) {
                q = &s->vq[i];
                qi = i;
            }
    if (!q) {
        FU_DEBUG("peer", "job %016" PRIx64 ": a verification input for stage %u step %" PRIu64 " mb %u that nothing "
                 "waits for: dropped", c->job_id, c->stage, c->step, c->micro_batch);
        peer_cmd_destroy(&c);
        return;
    }
    if (!c->data) {
        FU_INFO("peer", "job %016" PRIx64 " stage %u: verification of step %" PRIu64 " mb %u dropped: the upstream "
                "could not deliver its input (%s)", s->job_id, s->stage_index, c->step, c->micro_batch,
                c->text ? c->text : "no reason");
        verify_remove(s, qi);
        peer_cmd_destroy(&c);
        return;
    }
    q->input = c->data;
    q->n_input = c->len;
    c->data = NULL;
    peer_cmd_destroy(&c);
    verify_pump(s);
}
