/* broker_verify: verification of untrusted peers (docs/PIPELINE.md "Verification"). After a step
 * of a fine-tune job, the broker samples some of its micro-batches (keyed hash of job, job seed,
 * step, micro-batch, stage: deterministic for this broker, unpredictable to peers), and asks the
 * stage's peer and a warm backup of that stage (the verifier) for a sketch of the stage's forward
 * output: WIRE_VERIFY_SKETCH_K dot products with +-1 vectors drawn from a fresh random seed, plus
 * the L2 norm. The broker never sees activations. Sketches that differ by more than
 * BROKER_VERIFY_RTOL x norm are a disagreement: a third warm backup settles it when there is one
 * (the minority loses BROKER_VERIFY_PENALTY); otherwise the stage's peer loses BROKER_VERIFY_PENALTY
 * and the verifier BROKER_VERIFY_SOLO_PENALTY. A peer that falls below the reputation threshold
 * gets no more work and its stage fails over.
 *
 * This version verifies stage 0 only: its input (the job's tokens, PIPELINE.md "Data order") and its
 * state at step s (checkpoint ckpt:0:s, or the seeded initial adapter at s = 0) are reproducible
 * by a backup; so steps that are multiples of checkpoint_every are eligible. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "broker_internal.h"
#include "fu_log.h"

#define LOG "verify"

double broker_job_verify_fraction(const broker_t *b, const broker_job *j)
{
    if (j->kind != DB_JOB_FINETUNE)
        return 0;
    return j->spec.verify >= 0 ? j->spec.verify : b->cfg.verify;
}

bool broker_peer_trusted(const broker_t *b, const broker_peer *p)
{
    return p->live && !p->draining && p->reputation >= b->cfg.min_reputation;
}

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

/* A warm backup of stage `stage` of j that is trusted and none of the keys in `not` (n of them). */
static broker_peer *pick_verifier(broker_t *b, const broker_job *j, uint32_t stage, char skip[][DB_KEY_LEN + 1],
                                  size_t n)
{
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (!broker_peer_trusted(b, p) || !p->backup || !p->warm || p->stage != stage || strcmp(p->job, j->id) != 0)
            continue;
        bool excluded = false;
        for (size_t k = 0; k < n && !excluded; k++)
            excluded = strcmp(skip[k], p->key) == 0;
        if (!excluded)
            return p;
    }
    return NULL;
}

static fu_err ask(broker_t *b, const broker_vsample *v, broker_peer *p)
{
    Fusion__VerifyRequest r = FUSION__VERIFY_REQUEST__INIT;
    r.job_id = v->job64;
    r.stage_index = v->stage;
    r.step = v->step;
    r.micro_batch = v->mb;
    r.seed = v->seed;
    return broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_VERIFY_REQUEST, v->job64, &r.base);
}

void broker_verify_step(broker_t *b, broker_job *j, uint64_t step)
{
    double frac = broker_job_verify_fraction(b, j);
    const uint32_t stage = 0; /* the one stage whose input a backup can reproduce (see the top) */
    if (frac <= 0 || j->phase != BJ_RUNNING || j->n_stages < 2 || j->spec.checkpoint_every == 0 ||
        step % j->spec.checkpoint_every != 0)
        return;
    broker_peer *primary = broker_peer_find(b, j->stages[stage].peer);
    if (!primary || !primary->live)
        return;
    for (uint32_t m = 0; m < j->spec.micro_batches; m++) {
        if (!sampled(b, j, step, m, stage, frac))
            continue;
        char skip[1][DB_KEY_LEN + 1];
        snprintf(skip[0], sizeof skip[0], "%s", primary->key);
        broker_peer *ver = pick_verifier(b, j, stage, skip, 1);
        if (!ver) {
            j->v_skipped++;
            FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: no warm backup of stage %u to verify "
                    "with", j->id, stage, step, m, stage);
            continue;
        }
        broker_vsample *v = NULL;
        for (size_t i = 0; i < BROKER_VERIFY_MAX && !v; i++)
            if (!b->vs[i].used)
                v = &b->vs[i];
        if (!v) {
            j->v_skipped++;
            FU_WARN(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: %d samples already in flight", j->id,
                    stage, step, m, BROKER_VERIFY_MAX);
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
        v->deadline_ms = broker_now() + BROKER_VERIFY_TIMEOUT_MS;
        if (ask(b, v, primary) != FU_OK || ask(b, v, ver) != FU_OK) {
            v->used = false;
            j->v_skipped++;
            continue;
        }
        FU_DEBUG(LOG, "job %s stage %u step %" PRIu64 " mb %u: asked %.8s and verifier %.8s", j->id, stage, step, m,
                 primary->key, ver->key);
    }
}

/* Largest |a - b| over the sketch entries and the norm, and the scale the tolerance applies to. */
static bool agree(const broker_vsample *v, int x, int y, double *diff)
{
    double scale = fmax(v->norm[x], v->norm[y]);
    double d = fabs(v->norm[x] - v->norm[y]);
    for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++)
        d = fmax(d, fabs(v->sk[x][i] - v->sk[y][i]));
    *diff = scale > 0 ? d / scale : d;
    return d <= BROKER_VERIFY_RTOL * scale;
}

/* Lowers key's reputation; below the threshold it loses its work for j (a stage fails over). */
static void penalise(broker_t *b, broker_job *j, const char *key, double delta, const char *why)
{
    broker_peer *p = broker_peer_find(b, key);
    if (!p)
        return;
    double rep = p->reputation;
    if (db_peer_reputation_adjust(b->db, p->key, -delta, broker_wall(), &rep) == FU_OK)
        p->reputation = rep;
    else
        p->reputation = fmax(0, p->reputation - delta);
    FU_WARN(LOG, "job %s: peer %.8s (%s) loses %.2f reputation (now %.2f): %s", j->id, p->key, p->name, delta,
            p->reputation, why);
    if (p->reputation >= b->cfg.min_reputation)
        return;
    FU_WARN(LOG, "job %s: peer %.8s (%s) is below the reputation threshold %.2f after %u disagreeing samples of %u "
            "verified: it gets no more work", j->id, p->key, p->name, b->cfg.min_reputation, p->v_failed,
            p->v_checked);
    char detail[200];
    snprintf(detail, sizeof detail, "below threshold %.2f after %u of %u samples disagreed", b->cfg.min_reputation,
             p->v_failed, p->v_checked);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, p->key, "untrusted", detail));
    if (j->dead || strcmp(p->job, j->id) != 0)
        return;
    uint32_t s = p->stage;
    bool backup = p->backup;
    if (p->live) {
        Fusion__StageRelease r = FUSION__STAGE_RELEASE__INIT;
        r.job_id = j->id64;
        r.stage_index = s;
        r.reason = (char *)"your outputs failed verification: reputation below the broker's threshold";
        (void)broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, j->id64, &r.base);
        BROKER_IGNORE(db_peer_set_state(b->db, p->key, DB_PEER_BACKUP, broker_wall()));
    }
    p->job[0] = '\0';
    p->backup = p->warm = false;
    b->sched_dirty = true;
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

/* Every sketch asked for is in: compare and judge. */
static void judge(broker_t *b, broker_vsample *v)
{
    broker_job *j = broker_job_find(b, v->job);
    if (!j || j->dead) {
        v->used = false;
        return;
    }
    double d01 = 0;
    char ev[240];
    if (!v->who[2][0]) {
        if (agree(v, 0, 1, &d01)) {
            j->v_agree++;
            count(b, v->who[0], false);
            count(b, v->who[1], false);
            snprintf(ev, sizeof ev, "stage %u step %" PRIu64 " mb %u: agree (norm %.6g, rel diff %.3g, verifier %.8s)",
                     v->stage, v->step, v->mb, v->norm[0], d01, v->who[1]);
            FU_INFO(LOG, "job %s %s", j->id, ev);
            BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, v->who[0], "verified", ev));
            v->used = false;
            return;
        }
        FU_WARN(LOG, "job %s stage %u step %" PRIu64 " mb %u: peer %.8s and verifier %.8s disagree (norms %.6g / %.6g, "
                "rel diff %.3g)", j->id, v->stage, v->step, v->mb, v->who[0], v->who[1], v->norm[0], v->norm[1], d01);
        /* A third opinion when another warm backup of the stage is there. */
        broker_peer *third = pick_verifier(b, j, v->stage, v->who, 2);
        if (third) {
            snprintf(v->who[2], sizeof v->who[2], "%s", third->key);
            v->deadline_ms = broker_now() + BROKER_VERIFY_TIMEOUT_MS;
            if (ask(b, v, third) == FU_OK) {
                FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: asking %.8s for a third opinion", j->id, v->stage,
                        v->step, v->mb, third->key);
                return;
            }
            v->who[2][0] = '\0';
        }
        j->v_disagree++;
        count(b, v->who[0], true);
        count(b, v->who[1], false);
        snprintf(ev, sizeof ev, "stage %u step %" PRIu64 " mb %u: DISAGREE (norms %.6g / %.6g, rel diff %.3g, verifier "
                 "%.8s, no third opinion)", v->stage, v->step, v->mb, v->norm[0], v->norm[1], d01, v->who[1]);
        BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, v->who[0], "verified", ev));
        char primary[DB_KEY_LEN + 1], ver[DB_KEY_LEN + 1];
        snprintf(primary, sizeof primary, "%s", v->who[0]);
        snprintf(ver, sizeof ver, "%s", v->who[1]);
        v->used = false; /* before penalising: a failover may start new samples */
        penalise(b, j, primary, BROKER_VERIFY_PENALTY, "its stage output disagreed with a verifier");
        if (!j->dead)
            penalise(b, j, ver, BROKER_VERIFY_SOLO_PENALTY, "it disagreed with a stage's output and no third peer "
                                                           "could settle it");
        return;
    }
    double d02 = 0, d12 = 0;
    bool a02 = agree(v, 0, 2, &d02), a12 = agree(v, 1, 2, &d12);
    char keys[3][DB_KEY_LEN + 1];
    memcpy(keys, v->who, sizeof keys);
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
    if (s->unavailable && s->unavailable[0]) {
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample skipped: peer %.8s cannot sketch it: %.200s", v->job,
                v->stage, v->step, v->mb, p->key, s->unavailable);
        if (j)
            j->v_skipped++;
        v->used = false;
        return;
    }
    bool ok = s->n_sketch == WIRE_VERIFY_SKETCH_K && isfinite(s->norm) && s->norm >= 0;
    for (size_t i = 0; ok && i < s->n_sketch; i++)
        ok = isfinite(s->sketch[i]);
    if (!ok) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "VerifySketch needs %d finite sketch entries and a finite norm >= 0 (or `unavailable`)",
                           WIRE_VERIFY_SKETCH_K);
        /* A malformed answer counts as a wrong one: fill it in so that it disagrees. */
        for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++)
            v->sk[who][i] = 0;
        v->norm[who] = -1;
    } else {
        memcpy(v->sk[who], s->sketch, sizeof v->sk[who]);
        v->norm[who] = s->norm;
    }
    v->have[who] = true;
    for (int k = 0; k < 3; k++)
        if (v->who[k][0] && !v->have[k])
            return;
    judge(b, v);
}

void broker_verify_sweep(broker_t *b)
{
    uint64_t now = broker_now();
    for (size_t i = 0; i < BROKER_VERIFY_MAX; i++) {
        broker_vsample *v = &b->vs[i];
        if (!v->used || now < v->deadline_ms)
            continue;
        FU_INFO(LOG, "job %s stage %u step %" PRIu64 " mb %u: sample dropped: not every sketch came back in %d s",
                v->job, v->stage, v->step, v->mb, BROKER_VERIFY_TIMEOUT_MS / 1000);
        broker_job *j = broker_job_find(b, v->job);
        if (j)
            j->v_skipped++;
        v->used = false;
    }
}
