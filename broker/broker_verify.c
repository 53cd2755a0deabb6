/* broker_verify: verification of untrusted peers (docs/PIPELINE.md "Verification"). After a step
 * of a fine-tune job, the broker samples some micro-batches of every stage (keyed hash of job, job
 * seed, step, micro-batch, stage: deterministic for this broker, unpredictable to peers) and asks
 * the stage's peer and a warm backup of that stage (the verifier) for a sketch of the stage's
 * output: WIRE_VERIFY_SKETCH_K dot products with +-1 vectors drawn from a fresh random seed, plus
 * the L2 norm, plus the BLAKE2b-256 of the input the output was computed from. The output is the
 * activation frame a stage sends down; for the last stage, the gradient frame it sends up.
 *
 * Every step is eligible. At a step with a checkpoint the verifier restores the stage's state from it
 * (ckpt:k:s, or the seeded initial adapter at s = 0); at any other step the stage's peer, asked with
 * VerifyRequest.snapshot, uploads its state at the start of that step (it keeps the last 3: a
 * snapshot, CheckpointPut.snapshot), the broker checks it is the stage's tensors and nothing else,
 * and only then asks the verifier, which restores it (job blob vsnap:k:s). The snapshot comes from
 * the peer being checked, as a checkpoint does: what is verified is that the output follows from the
 * state and the input, which no made-up output does. Stage 0's input is
 * the job's tokens, which the verifier reads itself. A stage k > 0's input is the activation stage
 * k-1 sent it: the broker asks the peer of stage k-1 (VerifyDeliver) to seal its copy of that
 * output to the verifier's public key (crypto_box_seal) and send it back in chunks (VerifyInput),
 * which the broker checks against the sample and forwards unread. The broker never sees
 * activations.
 *
 * Judging: when the two input hashes differ the sample is inconclusive ("input-mismatch" event):
 * honest peers cannot produce that (the upstream keeps exactly what it sent over an authenticated
 * link, the stage hashes exactly what it received), so one of the two accounts is a lie the broker
 * cannot attribute; both peers lose BROKER_VERIFY_INPUT_PENALTY, so a peer that misreports its input
 * to dodge verification still sinks. When they match, sketches that differ by more than
 * BROKER_VERIFY_RTOL x norm are a disagreement: a third warm backup of the stage settles it when
 * there is one (the minority loses BROKER_VERIFY_PENALTY); otherwise the stage's peer loses
 * BROKER_VERIFY_PENALTY and the verifier BROKER_VERIFY_SOLO_PENALTY. A peer that falls below the
 * reputation threshold gets no more work and its stage fails over.
 *
 * Evicted or withheld: the stage's peer keeps its last WIRE_VERIFY_KEEP_STEPS (K) steps. It drops step
 * s's output when it starts step s + K (its snapshot when it finishes s + K - 1), and no stage can
 * finish step s + K - 1 before the last stage has finished that step's backward: the last stage sends
 * StepDone{s + K - 1} before it drops anything of s itself, and shortly after it sent the gradients
 * that let a stage k < last move on. Stages are not held back by verification, so on a loaded machine
 * a request can reach an honest peer after that. The broker therefore judges an `unavailable` answer
 * of the stage's peer about a step of the current run by its own records, never by the peer's word:
 * `done`, the most steps the last stage has reported done since the sample was taken. When done >=
 * s + K the pipeline can have moved past the sample and it is skipped (no one loses anything). When
 * not, the last stage (whose StepDones come on the connection of its answer, in order) has withheld
 * it; a stage k < last gets until max(BROKER_VERIFY_EVICT_GRACE_MS, half the time it took to answer)
 * after its answer for the StepDone that shows it (the last stage's optimizer step and a message on
 * another connection; the pipeline took K - 1 steps to get there), else it has withheld it. Claiming
 * to be ahead gains a dishonest peer no more than not answering at all (a sample nobody answers is
 * dropped after BROKER_VERIFY_TIMEOUT_MS): either way it must wait until the pipeline really moved
 * K steps on. A stage assigned again since the sample (a new run) may have dropped it: skipped. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "broker_internal.h"
#include "fu_log.h"

#define LOG "verify"

static void put64(uint8_t *o, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        o[i] = (uint8_t)(v >> (8 * i));
}

/* Whether (step, mb, stage) of j is in the sample: keyed BLAKE2b of (job, job seed, step, mb,
 * stage) read as a uniform number in [0, 1), below the fraction. */
static bool sampled(const broker_t *b, const broker_job *j, uint64_t step, uint32_t mb, uint32_t stage, double frac)
{
    if (frac <= 0)
        return false;
    if (frac >= 1)
        return true;
    uint8_t in[40], out[8];
    put64(in, j->id64);
    put64(in + 8, j->spec.seed);
    put64(in + 16, step);
    put64(in + 24, mb);
    put64(in + 32, stage);
    crypto_generichash(out, sizeof out, in, sizeof in, b->verify_key, sizeof b->verify_key);
    uint64_t u = 0;
    for (int i = 0; i < 8; i++)
        u |= (uint64_t)out[i] << (8 * i);
    return (double)(u >> 11) * 0x1.0p-53 < frac;
}

/* A warm backup of stage `stage` of j that is trusted and neither one of the peers in `skip` (n
 * of them, "" ignored) nor another slot of one of their peer processes: an opinion from the same
 * key is the same owner's. */
static broker_peer *pick_verifier(broker_t *b, const broker_job *j, uint32_t stage, char skip[][DB_KEY_LEN + 1],
                                  size_t n)
{
    const broker_peer *sk[4] = {0};
    for (size_t k = 0; k < n && k < 4; k++)
        sk[k] = skip[k][0] ? broker_peer_find(b, skip[k]) : NULL;
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (!broker_peer_trusted(b, p) || !p->backup || !p->warm || p->stage != stage || strcmp(p->job, j->id) != 0)
            continue;
        bool excluded = false;
        for (size_t k = 0; k < n && !excluded; k++)
            excluded = strcmp(skip[k], p->key) == 0 || (k < 4 && broker_peer_same_key(sk[k], p));
        if (!excluded)
            return p;
    }
    return NULL;
}

static fu_err ask(broker_t *b, const broker_vsample *v, broker_peer *p, bool snapshot)
{
    Fusion__VerifyRequest r = FUSION__VERIFY_REQUEST__INIT;
    r.snapshot = snapshot;
    r.job_id = v->job64;
    r.stage_index = v->stage;
    r.step = v->step;
    r.micro_batch = v->mb;
    r.seed = v->seed;
    return broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_VERIFY_REQUEST, v->job64, &r.base);
}

/* Asks a verifier (slot 1 or 2) for its sketch; for a stage k > 0 also asks the upstream peer to
 * deliver it the stage's input. */
static fu_err ask_verifier(broker_t *b, const broker_vsample *v, broker_peer *p)
{
    fu_err rc = ask(b, v, p, false);
    if (rc != FU_OK || v->stage == 0)
        return rc;
    broker_peer *up = broker_peer_find(b, v->up);
    uint8_t key[WIRE_KEY_BYTES];
    if (!up || !up->live)
        return FU_ENOTFOUND;
    if ((rc = wire_key_from_z85(p->pk, key)) != FU_OK)
        return rc;
    Fusion__VerifyDeliver d = FUSION__VERIFY_DELIVER__INIT;
    d.job_id = v->job64;
    d.stage_index = v->stage;
    d.step = v->step;
    d.micro_batch = v->mb;
    d.seed = v->seed;
    d.verifier_key.data = key;
    d.verifier_key.len = sizeof key;
    return broker_send_peer(b, up, FUSION__MSG_TYPE__MSG_VERIFY_DELIVER, v->job64, &d.base);
}

/* Whether the state of j's stages at the start of `step` is a checkpoint (the peer's rule:
 * stage_step_has_ckpt). */
static bool has_ckpt(const broker_job *j, uint64_t step)
{
    uint64_t K = j->spec.checkpoint_every;
    return step == 0 || (K && step % K == 0) || step == j->spec.steps;
}

/* The snapshot slot of (j, stage, step) from `peer`, taken now when there is none; -1 when every slot
 * is held by samples in flight. */
static int snap_slot(broker_t *b, const broker_job *j, uint32_t stage, uint64_t step, const char *peer)
{
    int free_slot = -1;
    for (int i = 0; i < BROKER_VERIFY_SNAPS; i++) {
        broker_snap *sn = &b->snaps[i];
        if (sn->used && sn->job64 == j->id64 && sn->stage == stage && sn->step == step && strcmp(sn->peer, peer) == 0)
            return i;
        if (!sn->used && free_slot < 0)
            free_slot = i;
    }
    if (free_slot >= 0) {
        broker_snap *sn = &b->snaps[free_slot];
        memset(sn, 0, sizeof *sn);
        sn->used = true;
        sn->job64 = j->id64;
        sn->stage = stage;
        sn->step = step;
        snprintf(sn->peer, sizeof sn->peer, "%s", peer);
    }
    return free_slot;
}

static void snap_drop(broker_snap *sn)
{
    free(sn->buf);
    memset(sn, 0, sizeof *sn);
}

/* Drops the snapshots no sample in flight refers to. */
static void snaps_collect(broker_t *b)
{
    for (int i = 0; i < BROKER_VERIFY_SNAPS; i++) {
        if (!b->snaps[i].used)
            continue;
        bool needed = false;
        for (size_t k = 0; k < BROKER_VERIFY_MAX && !needed; k++)
            needed = b->vs[k].used && b->vs[k].snap == i + 1;
        if (!needed)
            snap_drop(&b->snaps[i]);
    }
}

static void judge_evicted(broker_t *b, broker_vsample *v);

void broker_verify_job_restarted(broker_t *b, broker_job *j)
{
    uint32_t n = 0;
    for (size_t i = 0; i < BROKER_VERIFY_MAX; i++) {
        broker_vsample *v = &b->vs[i];
        if (v->used && strcmp(v->job, j->id) == 0) {
            v->used = false;
            j->v_skipped++;
            n++;
        }
    }
    for (int i = 0; i < BROKER_VERIFY_SNAPS; i++)
        if (b->snaps[i].used && b->snaps[i].job64 == j->id64)
            snap_drop(&b->snaps[i]);
    if (n)
        FU_INFO(LOG, "job %s: %u verification sample%s of the run that ended dropped", j->id, n, n == 1 ? "" : "s");
}

void broker_verify_step(broker_t *b, broker_job *j, uint64_t step)
{
    /* what the broker knows of how far the pipeline moved past each sample in flight */
    for (size_t i = 0; i < BROKER_VERIFY_MAX; i++) {
        broker_vsample *v = &b->vs[i];
        if (!v->used || v->job64 != j->id64)
            continue;
        if (step + 1 > v->done)
            v->done = step + 1;
        if (v->evict_by_ms && v->done >= v->step + WIRE_VERIFY_KEEP_STEPS)
            judge_evicted(b, v);
    }
    double frac = broker_job_verify_fraction(b, j);
    if (j->phase != BJ_RUNNING || j->n_stages < 1)
        return;
    bool need_snap = !has_ckpt(j, step);
    snaps_collect(b);
    for (uint32_t stage = 0; stage < j->n_stages; stage++) {
        broker_peer *primary = broker_peer_find(b, j->stages[stage].peer);
        broker_peer *up = stage > 0 ? broker_peer_find(b, j->stages[stage - 1].peer) : NULL;
        if (!primary || !primary->live || (stage > 0 && (!up || !up->live)))
            continue;
        /* a stage flagged too fast (broker_stages.c) is verified whole while its peer holds it */
        double f = strcmp(j->stages[stage].too_fast, primary->key) == 0 ? 1.0 : frac;
        for (uint32_t m = 0; m < j->spec.micro_batches; m++) {
            if (!sampled(b, j, step, m, stage, f))
                continue;
            char skip[2][DB_KEY_LEN + 1];
            snprintf(skip[0], sizeof skip[0], "%s", primary->key);
            snprintf(skip[1], sizeof skip[1], "%s", up ? up->key : "");
            broker_peer *ver = pick_verifier(b, j, stage, skip, 2);
            if (!ver) { /* said once per stage (a job run with fewer backups than stages meets it every step) */
                j->v_skipped++;
                uint64_t bit = 1ull << (stage % 64);
                if (j->v_no_verifier & bit)
                    FU_DEBUG(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: no warm backup", j->id,
                             stage, step, m);
                else
                    FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: no warm backup of stage %u "
                            "to verify with (said once; the job's status counts the samples skipped)", j->id, stage,
                            step, m, stage);
                j->v_no_verifier |= bit;
                continue;
            }
            broker_vsample *v = NULL;
            for (size_t i = 0; i < BROKER_VERIFY_MAX && !v; i++)
                if (!b->vs[i].used)
                    v = &b->vs[i];
            if (!v) {
                j->v_skipped++;
                FU_WARN(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: %d samples already in flight",
                        j->id, stage, step, m, BROKER_VERIFY_MAX);
                continue;
            }
            int slot = need_snap ? snap_slot(b, j, stage, step, primary->key) : -1;
            if (need_snap && slot < 0) {
                j->v_skipped++;
                FU_WARN(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: %d verification snapshots "
                        "already held", j->id, stage, step, m, BROKER_VERIFY_SNAPS);
                continue;
            }
            memset(v, 0, sizeof *v);
            v->used = true;
            snprintf(v->job, sizeof v->job, "%s", j->id);
            v->job64 = j->id64;
            v->stage = stage;
            v->step = step;
            v->mb = m;
            randombytes_buf(&v->seed, sizeof v->seed);
            snprintf(v->who[0], sizeof v->who[0], "%s", primary->key);
            snprintf(v->who[1], sizeof v->who[1], "%s", ver->key);
            if (up)
                snprintf(v->up, sizeof v->up, "%s", up->key);
            v->asked_ms = broker_now();
            v->deadline_ms = v->asked_ms + BROKER_VERIFY_TIMEOUT_MS;
            v->done = step + 1;
            v->snap = slot + 1;
            /* with a snapshot to wait for, the verifier is asked once it is in (broker_verify_on_snapshot) */
            bool ask_now = !need_snap || b->snaps[slot].complete;
            if (ask(b, v, primary, need_snap) != FU_OK || (ask_now && ask_verifier(b, v, ver) != FU_OK)) {
                v->used = false;
                j->v_skipped++;
                continue;
            }
            FU_DEBUG(LOG, "job %s stage %u step %" PRIu64 " mb %u: asked %.8s and verifier %.8s%s%.8s", j->id, stage,
                     step, m, primary->key, ver->key, up ? ", input from " : "", up ? up->key : "");
        }
    }
}

/* Largest |a - b| over the sketch entries and the norm, and the scale the tolerance applies to. */
/* Whether answers x and y come from peers of one numeric class: the same bits are promised, and
 * they are compared by their output hashes (docs/DAG.md "Determinism"). */
static bool exact(const broker_vsample *v, int x, int y)
{
    return v->has_cls[x] && v->has_cls[y] && sodium_memcmp(v->cls[x], v->cls[y], sizeof v->cls[x]) == 0;
}

/* Whether answers x and y agree: the same output hash where bits are promised (exact), else sketches
 * and norms within BROKER_VERIFY_RTOL of the norm. *diff: the sketches' relative difference (logged
 * in both cases). */
static bool agree(const broker_vsample *v, int x, int y, double *diff)
{
    double scale = fmax(v->norm[x], v->norm[y]);
    double d = fabs(v->norm[x] - v->norm[y]);
    for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++)
        d = fmax(d, fabs(v->sk[x][i] - v->sk[y][i]));
    *diff = scale > 0 ? d / scale : d;
    if (v->bad[x] || v->bad[y])
        return false;
    if (exact(v, x, y))
        return v->has_oh[x] && v->has_oh[y] && sodium_memcmp(v->oh[x], v->oh[y], WIRE_VERIFY_HASH_BYTES) == 0;
    return d <= BROKER_VERIFY_RTOL * scale;
}

/* Both answers are well-formed and computed from the same input. */
static bool same_input(const broker_vsample *v, int x, int y)
{
    return !v->bad[x] && !v->bad[y] && sodium_memcmp(v->ih[x], v->ih[y], WIRE_VERIFY_HASH_BYTES) == 0;
}

/* Lowers key's reputation; below the threshold it loses its work for j (a stage fails over). */
static void penalise(broker_t *b, broker_job *j, const char *key, double delta, const char *why)
{
    broker_peer *p = broker_peer_find(b, key);
    if (!p)
        return;
    broker_peer_reputation_adjust(b, p, -delta);
    FU_WARN(LOG, "job %s: peer %.8s (%s) loses %.2f reputation (now %.2f): %s", j->id, p->key, p->name, delta,
            p->reputation, why);
    if (p->reputation >= b->cfg.min_reputation - BROKER_REPUTATION_EPS)
        return;
    FU_WARN(LOG, "job %s: peer %.8s (%s) is below the reputation threshold %.2f after %u disagreeing samples of %u "
            "verified (and %u input mismatches): it gets no more work", j->id, p->key, p->name, b->cfg.min_reputation,
            p->v_failed, p->v_checked, p->v_mismatch);
    char detail[200];
    snprintf(detail, sizeof detail, "below threshold %.2f after %u of %u samples disagreed, %u input mismatches",
             b->cfg.min_reputation, p->v_failed, p->v_checked, p->v_mismatch);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, p->key, "untrusted", detail));
    if (j->dead || strcmp(p->job, j->id) != 0)
        return;
    uint32_t s = p->stage;
    bool backup = p->backup;
    broker_peer_release(b, j, p, "your outputs failed verification: reputation below the broker's threshold");
    if (!backup && s < j->n_stages && strcmp(j->stages[s].peer, p->key) == 0) {
        char text[160];
        snprintf(text, sizeof text, "peer %.8s failed verification (reputation %.2f)", p->key, p->reputation);
        broker_failover(b, j, s, text);
    }
}

static void count(broker_t *b, const char *key, bool failed)
{
    broker_peer *p = broker_peer_find(b, key);
    if (p) {
        p->v_checked++;
        p->v_failed += failed;
    }
}

/* The stage's peer of v said it no longer holds the sampled output (the top of this file, "Evicted or
 * withheld"): skipped when the pipeline can have moved K steps past the sample by the broker's records
 * (within the grace, for a stage k < last), else withheld: a wrong answer. A stage that changed hands
 * or runs since is not judged. */
static void judge_evicted(broker_t *b, broker_vsample *v)
{
    broker_job *j = broker_job_find(b, v->job);
    uint64_t now = broker_now();
    v->used = false;
    if (!j || j->dead || v->stage >= j->n_stages || strcmp(j->stages[v->stage].peer, v->who[0]) != 0 ||
        j->stages[v->stage].assigned_ms >= v->asked_ms) {
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: its stage changed hands or runs while "
                "waiting to tell whether %.8s could still hold it", v->job, v->stage, v->step, v->mb, v->who[0]);
        if (j)
            j->v_skipped++;
        return;
    }
    if (v->done >= v->step + WIRE_VERIFY_KEEP_STEPS && (!v->evict_by_ms || now <= v->evict_by_ms)) {
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: peer %.8s no longer holds it, and the "
                "pipeline can have moved on (the last stage reported step %" PRIu64 " done; a peer keeps its last %d "
                "steps)", j->id, v->stage, v->step, v->mb, v->who[0], v->done - 1, WIRE_VERIFY_KEEP_STEPS);
        j->v_skipped++;
        return;
    }
    char ev[400];
    snprintf(ev, sizeof ev, "stage %u step %" PRIu64 " mb %u: WITHHELD: the stage's peer would not show its own "
             "output of this run, which it keeps %d steps (the last stage had reported %" PRIu64 " steps done%s)",
             v->stage, v->step, v->mb, WIRE_VERIFY_KEEP_STEPS, v->done,
             v->evict_by_ms ? " by the end of the grace" : "");
    FU_WARN(LOG, "job %s %s", j->id, ev);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, v->who[0], "withheld", ev));
    j->v_disagree++;
    count(b, v->who[0], true);
    char key[DB_KEY_LEN + 1];
    snprintf(key, sizeof key, "%s", v->who[0]);
    penalise(b, j, key, BROKER_VERIFY_PENALTY, "it would not show its own output of a step it ran");
}

/* The first 4 bytes of an input hash in hex, for logs and events. */
static const char *ih_hex(const uint8_t *h, char out[9])
{
    snprintf(out, 9, "%02x%02x%02x%02x", h[0], h[1], h[2], h[3]);
    return out;
}

/* The stage's peer and the verifier computed from different inputs: inconclusive. One of the two
 * accounts of the input is false (stage k > 0: the stage's hash of what it received, or the
 * upstream's delivery of what it sent; stage 0: the stage's or the verifier's hash of the tokens);
 * both sources lose a little (see the top of this file). */
static void input_mismatch(broker_t *b, broker_job *j, broker_vsample *v)
{
    char ev[300], h0[9], h1[9];
    j->v_mismatch++;
    char src[2][DB_KEY_LEN + 1];
    snprintf(src[0], sizeof src[0], "%s", v->who[0]);
    snprintf(src[1], sizeof src[1], "%s", v->stage > 0 ? v->up : v->who[1]);
    snprintf(ev, sizeof ev, "stage %u step %" PRIu64 " mb %u: INPUT MISMATCH: the stage's peer %.8s used input %s, "
             "verifier %.8s used %s (%s %.8s): inconclusive", v->stage, v->step, v->mb, v->who[0], ih_hex(v->ih[0], h0),
             v->who[1], ih_hex(v->ih[1], h1), v->stage > 0 ? "delivered by the upstream" : "its own tokens",
             v->stage > 0 ? v->up : v->who[1]);
    FU_WARN(LOG, "job %s %s", j->id, ev);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, v->who[0], "input-mismatch", ev));
    for (int k = 0; k < 2; k++) {
        broker_peer *p = broker_peer_find(b, src[k]);
        if (p)
            p->v_mismatch++;
    }
    v->used = false; /* before penalising: a failover may start new samples */
    penalise(b, j, src[0], BROKER_VERIFY_INPUT_PENALTY,
             v->stage > 0 ? "the input it says it received differs from what its upstream delivered to a verifier"
                          : "its hash of the micro-batch's tokens differs from the verifier's");
    if (!j->dead)
        penalise(b, j, src[1], BROKER_VERIFY_INPUT_PENALTY,
                 v->stage > 0 ? "what it delivered to a verifier differs from what the next stage says it received"
                              : "its hash of the micro-batch's tokens differs from the stage's");
}

/* A disagreement between the stage's peer and the verifier that no third opinion settles (`why`):
 * the stage's peer loses BROKER_VERIFY_PENALTY, the verifier BROKER_VERIFY_SOLO_PENALTY. */
static void judge_two(broker_t *b, broker_job *j, broker_vsample *v, const char *why)
{
    double d01 = 0;
    (void)agree(v, 0, 1, &d01);
    j->v_disagree++;
    count(b, v->who[0], true);
    count(b, v->who[1], false);
    char ev[300];
    snprintf(ev, sizeof ev, "stage %u step %" PRIu64 " mb %u: DISAGREE (%s, norms %.6g / %.6g, rel diff %.3g, "
             "verifier %.8s, %s)", v->stage, v->step, v->mb, exact(v, 0, 1) ? "other bits" : "beyond tolerance",
             v->norm[0], v->norm[1], d01, v->who[1], why);
    FU_WARN(LOG, "job %s %s", j->id, ev);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, v->who[0], "verified", ev));
    char primary[DB_KEY_LEN + 1], ver[DB_KEY_LEN + 1];
    snprintf(primary, sizeof primary, "%s", v->who[0]);
    snprintf(ver, sizeof ver, "%s", v->who[1]);
    v->used = false; /* before penalising: a failover may start new samples */
    penalise(b, j, primary, BROKER_VERIFY_PENALTY, "its stage output disagreed with a verifier");
    if (!j->dead)
        penalise(b, j, ver, BROKER_VERIFY_SOLO_PENALTY, "it disagreed with a stage's output and no third peer "
                                                       "could settle it");
}

/* Three opinions from the same input: the minority loses. */
static void judge_three(broker_t *b, broker_job *j, broker_vsample *v)
{
    double d02 = 0, d12 = 0;
    bool a02 = agree(v, 0, 2, &d02), a12 = agree(v, 1, 2, &d12);
    char keys[3][DB_KEY_LEN + 1];
    memcpy(keys, v->who, sizeof keys);
    char ev[240];
    snprintf(ev, sizeof ev, "stage %u step %" PRIu64 " mb %u: DISAGREE, third opinion %.8s sides with %s", v->stage,
             v->step, v->mb, v->who[2], a02 && !a12 ? "the stage" : a12 && !a02 ? "the verifier" : "neither");
    FU_WARN(LOG, "job %s %s (rel diffs %.3g / %.3g)", j->id, ev, d02, d12);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, v->who[0], "verified", ev));
    v->used = false;
    j->v_disagree++;
    if (a02 && !a12) {
        count(b, keys[0], false);
        count(b, keys[1], true);
        count(b, keys[2], false);
        penalise(b, j, keys[1], BROKER_VERIFY_PENALTY, "its verification sketch was the minority of three");
    } else if (a12 && !a02) {
        count(b, keys[0], true);
        count(b, keys[1], false);
        count(b, keys[2], false);
        penalise(b, j, keys[0], BROKER_VERIFY_PENALTY, "its stage output was the minority of three");
    } else {
        for (int k = 0; k < 3 && !j->dead; k++) {
            count(b, keys[k], true);
            penalise(b, j, keys[k], BROKER_VERIFY_SOLO_PENALTY, "three peers gave three different sketches");
        }
    }
}

/* Every answer asked for is in: compare and judge. */
static void judge(broker_t *b, broker_vsample *v)
{
    broker_job *j = broker_job_find(b, v->job);
    if (!j || j->dead) {
        v->used = false;
        return;
    }
    if (v->who[2][0]) {
        if (!same_input(v, 0, 2)) {
            FU_WARN(LOG, "job %s stage %u step %" PRIu64 " mb %u: the third opinion %.8s %s: judged without it",
                    j->id, v->stage, v->step, v->mb, v->who[2],
                    v->bad[2] ? "was malformed" : "was computed from another input than the stage's");
            judge_two(b, j, v, "third opinion unusable");
            return;
        }
        judge_three(b, j, v);
        return;
    }
    if (v->bad[0]) {
        judge_two(b, j, v, "the stage's answer was malformed");
        return;
    }
    if (!v->bad[1] && !same_input(v, 0, 1)) {
        input_mismatch(b, j, v);
        return;
    }
    double d01 = 0;
    char ev[300], h[9];
    if (agree(v, 0, 1, &d01)) {
        j->v_agree++;
        count(b, v->who[0], false);
        count(b, v->who[1], false);
        snprintf(ev, sizeof ev, "stage %u step %" PRIu64 " mb %u: agree (%s, norm %.6g, rel diff %.3g, verifier "
                 "%.8s, input %s)", v->stage, v->step, v->mb, exact(v, 0, 1) ? "same bits" : "within tolerance",
                 v->norm[0], d01, v->who[1], ih_hex(v->ih[0], h));
        FU_INFO(LOG, "job %s %s", j->id, ev);
        BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, v->who[0], "verified", ev));
        v->used = false;
        return;
    }
    FU_WARN(LOG, "job %s stage %u step %" PRIu64 " mb %u: peer %.8s and verifier %.8s disagree (norms %.6g / %.6g, "
            "rel diff %.3g)", j->id, v->stage, v->step, v->mb, v->who[0], v->who[1], v->norm[0], v->norm[1], d01);
    /* A third opinion when another warm backup of the stage is there. */
    char skip[3][DB_KEY_LEN + 1];
    snprintf(skip[0], sizeof skip[0], "%s", v->who[0]);
    snprintf(skip[1], sizeof skip[1], "%s", v->who[1]);
    snprintf(skip[2], sizeof skip[2], "%s", v->up);
    broker_peer *third = pick_verifier(b, j, v->stage, skip, 3);
    if (third) {
        snprintf(v->who[2], sizeof v->who[2], "%s", third->key);
        v->deadline_ms = broker_now() + BROKER_VERIFY_TIMEOUT_MS;
        if (ask_verifier(b, v, third) == FU_OK) {
            FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: asking %.8s for a third opinion", j->id, v->stage,
                    v->step, v->mb, third->key);
            return;
        }
        v->who[2][0] = '\0';
    }
    judge_two(b, j, v, "no third opinion");
}

void broker_on_verify_sketch(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__VerifySketch *s = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_VERIFY_SKETCH);
    if (!s)
        return;
    broker_vsample *v = NULL;
    int who = -1;
    for (size_t i = 0; i < BROKER_VERIFY_MAX && !v; i++) {
        broker_vsample *c = &b->vs[i];
        if (!c->used || c->job64 != s->job_id || c->stage != s->stage_index || c->step != s->step ||
            c->mb != s->micro_batch || c->seed != s->seed)
            continue;
        for (int k = 0; k < 3; k++)
            if (c->who[k][0] && strcmp(c->who[k], p->key) == 0 && !c->have[k]) {
                v = c;
                who = k;
            }
    }
    if (!v) {
        FU_DEBUG(LOG, "peer %.8s: VerifySketch for a sample not in flight (job %016" PRIx64 " step %" PRIu64 " mb %u)",
                 p->key, s->job_id, s->step, s->micro_batch);
        return;
    }
    broker_job *j = broker_job_find(b, v->job);
    if (who == 0 && v->evict_by_ms) {
        if (s->unavailable && s->unavailable[0])
            return; /* said again: the first answer's wait stands */
        v->evict_by_ms = 0; /* a sketch after all: judged as any */
    }
    if (s->unavailable && s->unavailable[0] && who == 0 && j && !j->dead && v->step >= j->start_step &&
        v->stage < j->n_stages && strcmp(j->stages[v->stage].peer, p->key) == 0 &&
        j->stages[v->stage].assigned_ms < v->asked_ms && broker_job_verify_fraction(b, j) > 0) {
        /* The stage's peer ran this step in this run and keeps its last K steps: evicted or withheld,
         * by the broker's records (the top of this file). */
        if (v->done >= v->step + WIRE_VERIFY_KEEP_STEPS || v->stage + 1 == j->n_stages) {
            judge_evicted(b, v);
            return;
        }
        uint64_t now = broker_now(), grace = (now - v->asked_ms) / 2;
        v->evict_by_ms = now + (grace > BROKER_VERIFY_EVICT_GRACE_MS ? grace : BROKER_VERIFY_EVICT_GRACE_MS);
        FU_DEBUG(LOG, "job %s stage %u step %" PRIu64 " mb %u: peer %.8s no longer holds it (%.200s); the last stage "
                 "has reported %" PRIu64 " steps done: waiting %" PRIu64 " ms for the StepDone that shows it could",
                 j->id, v->stage, v->step, v->mb, p->key, s->unavailable, v->done, v->evict_by_ms - now);
        return;
    }
    if (s->unavailable && s->unavailable[0]) {
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: %s: peer %.8s cannot sketch it: %.200s", v->job, v->stage,
                v->step, v->mb, who == 2 ? "no third opinion" : "sample skipped", p->key, s->unavailable);
        if (who == 2 && j && !j->dead) {
            judge_two(b, j, v, "the third opinion could not be computed");
            return;
        }
        if (j)
            j->v_skipped++;
        v->used = false;
        return;
    }
    bool ok = s->n_sketch == WIRE_VERIFY_SKETCH_K && isfinite(s->norm) && s->norm >= 0 &&
              s->input_hash.len == WIRE_VERIFY_HASH_BYTES &&
              (s->output_hash.len == 0 || s->output_hash.len == WIRE_VERIFY_HASH_BYTES);
    for (size_t i = 0; ok && i < s->n_sketch; i++)
        ok = isfinite(s->sketch[i]);
    if (!ok) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "VerifySketch needs %d finite sketch entries, a finite norm >= 0, a %u-byte input hash and "
                           "no or a %u-byte output hash (or `unavailable`)", WIRE_VERIFY_SKETCH_K,
                           WIRE_VERIFY_HASH_BYTES, WIRE_VERIFY_HASH_BYTES);
        /* A malformed answer counts as a wrong one. */
        for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++)
            v->sk[who][i] = 0;
        v->norm[who] = -1;
        v->bad[who] = true;
    } else {
        memcpy(v->sk[who], s->sketch, sizeof v->sk[who]);
        v->norm[who] = s->norm;
        memcpy(v->ih[who], s->input_hash.data, WIRE_VERIFY_HASH_BYTES);
        v->has_oh[who] = s->output_hash.len == WIRE_VERIFY_HASH_BYTES;
        if (v->has_oh[who])
            memcpy(v->oh[who], s->output_hash.data, WIRE_VERIFY_HASH_BYTES);
    }
    v->has_cls[who] = p->numeric_class[0] != '\0';
    memcpy(v->cls[who], p->class_id, sizeof v->cls[who]);
    v->have[who] = true;
    for (int k = 0; k < 3; k++)
        if (v->who[k][0] && !v->have[k])
            return;
    judge(b, v);
}

/* The upstream could not deliver the input to slot k: skip the sample, or judge without the third. */
static void input_lost(broker_t *b, broker_vsample *v, int k)
{
    broker_job *j = broker_job_find(b, v->job);
    if (k == 2 && j && !j->dead && v->have[0] && v->have[1]) {
        judge_two(b, j, v, "the third opinion got no input");
        return;
    }
    if (j)
        j->v_skipped++;
    v->used = false;
}

void broker_on_verify_input(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__VerifyInput *vi = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_VERIFY_INPUT);
    if (!vi)
        return;
    if (vi->stage_index == 0 || vi->stage_index >= BROKER_MAX_STAGES || vi->verifier_key.len != WIRE_KEY_BYTES) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "VerifyInput needs the verified stage's index (1..%d) and the verifier's %u-byte key",
                           BROKER_MAX_STAGES - 1, WIRE_KEY_BYTES);
        return;
    }
    char to[WIRE_KEY_Z85_LEN + 1];
    wire_key_to_z85(vi->verifier_key.data, to);
    broker_vsample *v = NULL;
    int k = -1;
    for (size_t i = 0; i < BROKER_VERIFY_MAX && !v; i++) {
        broker_vsample *c = &b->vs[i];
        if (!c->used || c->job64 != vi->job_id || c->stage != vi->stage_index || c->step != vi->step ||
            c->mb != vi->micro_batch || c->seed != vi->seed || strcmp(c->up, p->key) != 0)
            continue;
        for (int s = 1; s < 3; s++) { /* a sample's verifiers are of unlike keys (pick_verifier) */
            broker_peer *w = c->who[s][0] ? broker_peer_find(b, c->who[s]) : NULL;
            if (w && strcmp(w->pk, to) == 0) {
                v = c;
                k = s;
            }
        }
    }
    if (!v) {
        /* A delivery that comes after its sample ended (skipped, judged, timed out): dropped. */
        FU_DEBUG(LOG, "peer %.8s: VerifyInput for no sample in flight that asks it (job %016" PRIx64 " stage %u step %"
                 PRIu64 " mb %u, for %.8s): dropped", p->key, vi->job_id, vi->stage_index, vi->step, vi->micro_batch,
                 to);
        return;
    }
    broker_peer *dst = broker_peer_find(b, v->who[k]);
    if (vi->unavailable && vi->unavailable[0]) {
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: %s: upstream %.8s cannot deliver the input: %.200s",
                v->job, v->stage, v->step, v->mb, k == 2 ? "no third opinion" : "sample skipped", p->key,
                vi->unavailable);
        if (dst && dst->live) /* so that the verifier stops waiting for it */
            BROKER_IGNORE(wire_forward(broker_sock_for(b, dst->rid, dst->rid_len), dst->rid, dst->rid_len, msg, p->key));
        input_lost(b, v, k);
        return;
    }
    uint64_t total = vi->total_bytes;
    uint64_t nch = total / WIRE_VERIFY_INPUT_CHUNK + (total % WIRE_VERIFY_INPUT_CHUNK != 0);
    uint64_t off = (uint64_t)vi->chunk_index * WIRE_VERIFY_INPUT_CHUNK;
    uint64_t n = total > off ? (total - off < WIRE_VERIFY_INPUT_CHUNK ? total - off : WIRE_VERIFY_INPUT_CHUNK) : 0;
    if (total == 0 || total % sizeof(float) != 0 || total > BROKER_VERIFY_MAX_INPUT || vi->chunk_count != nch ||
        vi->chunk_index >= nch || vi->offset != off || vi->payload.len != n + WIRE_VERIFY_INPUT_OVERHEAD) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "VerifyInput chunk %u of %u (offset %" PRIu64 ", %zu sealed bytes) does not cut a %" PRIu64
                           "-byte F32 input (at most %llu) into %u-byte chunks sealed with %u bytes of overhead",
                           vi->chunk_index, vi->chunk_count, vi->offset, vi->payload.len, total,
                           (unsigned long long)BROKER_VERIFY_MAX_INPUT, WIRE_VERIFY_INPUT_CHUNK,
                           WIRE_VERIFY_INPUT_OVERHEAD);
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: upstream %.8s sent a malformed input "
                "chunk", v->job, v->stage, v->step, v->mb, p->key);
        input_lost(b, v, k);
        return;
    }
    if (!dst || !dst->live) {
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: the verifier %.8s is gone", v->job,
                v->stage, v->step, v->mb, to);
        input_lost(b, v, k);
        return;
    }
    fu_err rc = wire_forward(broker_sock_for(b, dst->rid, dst->rid_len), dst->rid, dst->rid_len, msg, p->key);
    if (rc != FU_OK) {
        FU_WARN(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: forwarding the input to %.8s failed: %s",
                v->job, v->stage, v->step, v->mb, to, fu_strerror(rc));
        input_lost(b, v, k);
        return;
    }
    if (vi->chunk_index + 1 == nch)
        v->fed[k] = true;
}

void broker_verify_sweep(broker_t *b)
{
    uint64_t now = broker_now();
    snaps_collect(b);
    for (size_t i = 0; i < BROKER_VERIFY_MAX; i++) {
        broker_vsample *v = &b->vs[i];
        if (v->used && v->evict_by_ms && now > v->evict_by_ms) {
            judge_evicted(b, v); /* no StepDone showed the pipeline far enough in time */
            continue;
        }
        if (!v->used || now < v->deadline_ms)
            continue;
        broker_job *j = broker_job_find(b, v->job);
        if (v->who[2][0] && v->have[0] && v->have[1] && !v->have[2] && j && !j->dead) {
            FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: the third opinion %.8s did not answer in %d s",
                    v->job, v->stage, v->step, v->mb, v->who[2], BROKER_VERIFY_TIMEOUT_MS / 1000);
            judge_two(b, j, v, "the third opinion did not answer");
            continue;
        }
        char missing[200] = "";
        size_t l = 0;
        static const char *const role[3] = {"the stage's peer", "the verifier", "the third opinion"};
        for (int k = 0; k < 3; k++) {
            if (!v->who[k][0] || v->have[k])
                continue;
            l += (size_t)snprintf(missing + l, sizeof missing - l, "%s%s %.8s%s", l ? ", " : "", role[k], v->who[k],
                                  k > 0 && v->stage > 0 && !v->fed[k] ? " (its input never came in full)" : "");
            if (l >= sizeof missing)
                break;
        }
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample dropped: no answer in %d s from %s", v->job,
                v->stage, v->step, v->mb, BROKER_VERIFY_TIMEOUT_MS / 1000, missing);
        if (j)
            j->v_skipped++;
        v->used = false;
    }
}

const broker_snap *broker_verify_snapshot(const broker_t *b, uint64_t job64, uint32_t stage, uint64_t step)
{
    for (int i = 0; i < BROKER_VERIFY_SNAPS; i++) {
        const broker_snap *sn = &b->snaps[i];
        if (sn->used && sn->complete && sn->job64 == job64 && sn->stage == stage && sn->step == step)
            return sn;
    }
    return NULL;
}

/* The samples that wait for snapshot slot i: skipped (the snapshot cannot be had). */
static void snap_failed(broker_t *b, broker_job *j, int i)
{
    for (size_t k = 0; k < BROKER_VERIFY_MAX; k++)
        if (b->vs[k].used && b->vs[k].snap == i + 1) {
            b->vs[k].used = false;
            j->v_skipped++;
        }
    snap_drop(&b->snaps[i]);
}

void broker_verify_on_snapshot(broker_t *b, broker_peer *p, broker_job *j, const wire_msg_t *msg,
                               const Fusion__CheckpointPut *c)
{
    int i = 0;
    broker_snap *sn = NULL;
    for (; i < BROKER_VERIFY_SNAPS && !sn; i++)
        if (b->snaps[i].used && !b->snaps[i].complete && b->snaps[i].job64 == j->id64 &&
            b->snaps[i].stage == c->stage_index && b->snaps[i].step == c->step && strcmp(b->snaps[i].peer, p->key) == 0)
            sn = &b->snaps[i];
    i--;
    if (!sn) {
        FU_DEBUG(LOG, "job %s: a snapshot of stage %u step %" PRIu64 " from %.8s that no sample waits for: dropped",
                 j->id, c->stage_index, c->step, p->key);
        return;
    }
    if (c->total == 0 || c->total > BROKER_MAX_CKPT_BYTES || c->content_hash.len != DB_HASH_LEN ||
        c->offset != sn->got || c->data.len > c->total - c->offset || (sn->buf && c->total != sn->total) ||
        (!sn->buf && c->offset != 0)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "CheckpointPut (snapshot): chunks must come in order, 1..%u bytes in all, with a 32-byte "
                           "hash", BROKER_MAX_CKPT_BYTES);
        snap_failed(b, j, i);
        return;
    }
    if (!sn->buf) {
        sn->buf = malloc((size_t)c->total); /* a size from the network: no aborting allocator */
        if (!sn->buf) {
            FU_WARN(LOG, "job %s: no memory for a %" PRIu64 "-byte verification snapshot: samples skipped", j->id,
                    c->total);
            snap_failed(b, j, i);
            return;
        }
        sn->total = c->total;
        memcpy(sn->hash, c->content_hash.data, DB_HASH_LEN);
    }
    memcpy(sn->buf + c->offset, c->data.data, c->data.len);
    sn->got += c->data.len;
    if (sn->got < sn->total)
        return;
    uint8_t h[DB_HASH_LEN];
    crypto_generichash(h, sizeof h, sn->buf, (size_t)sn->total, NULL, 0);
    fu_errmsg em = {{0}};
    fu_err rc = sodium_memcmp(h, sn->hash, sizeof h) == 0
                    ? broker_ckpt_check(j, sn->stage, sn->buf, (size_t)sn->total, sn->step, &em)
                    : fu_errmsg_set(&em, FU_EPROTO, "its bytes do not hash to the hash it announced");
    if (rc != FU_OK) {
        /* the peer under verification sent something that is not its stage's state: its own fault */
        char why[400];
        snprintf(why, sizeof why, "stage %u step %" PRIu64 ": its verification snapshot is refused: %.300s",
                 sn->stage, sn->step, em.msg);
        BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, p->key, "bad-snapshot", why));
        snap_failed(b, j, i);
        penalise(b, j, p->key, BROKER_VERIFY_PENALTY, why);
        return;
    }
    sn->complete = true;
    FU_DEBUG(LOG, "job %s stage %u step %" PRIu64 ": verification snapshot in (%" PRIu64 " bytes)", j->id, sn->stage,
             sn->step, sn->total);
    for (size_t k = 0; k < BROKER_VERIFY_MAX; k++) {
        broker_vsample *v = &b->vs[k];
        if (!v->used || v->snap != i + 1 || v->have[1])
            continue;
        broker_peer *ver = broker_peer_find(b, v->who[1]);
        if (!ver || !ver->live || ask_verifier(b, v, ver) != FU_OK) {
            v->used = false;
            j->v_skipped++;
        }
    }
}
