/* broker_failover: a lost stage handed to a backup (warm first) with every stage rewound to the
 * newest common checkpoint, the retry cap, the deadlines on the work itself (ready, step, pause),
 * and the recovery of running jobs after a broker restart. Assigning and starting stages is
 * broker_sched's (broker_send_assign, broker_start_stages): failover only decides what to replace. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_log.h"

#define LOG "failover"

/* StageRelease{reason} to every live stage peer of j, which stays on the job (a StageAssign
 * restarting it follows); with drop_uploads, checkpoint uploads in progress are dropped too. */
static void stop_stages(broker_t *b, broker_job *j, const char *reason, bool drop_uploads)
{
    for (uint32_t s = 0; s < j->n_stages; s++) {
        if (drop_uploads) {
            free(j->stages[s].ck_buf);
            j->stages[s].ck_buf = NULL;
        }
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (!p || !p->live)
            continue;
        Fusion__StageRelease r = FUSION__STAGE_RELEASE__INIT;
        r.job_id = j->id64;
        r.stage_index = s;
        r.reason = (char *)reason;
        (void)broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, j->id64, &r.base);
    }
}
/* A peer to take stage s of j: its warm backup, another backup of j, then the idle peer that would run
 * the stage fastest (the cost model: speed and link). The replacement sets the whole pipeline's pace
 * from then on, and the registry's order is no measure of speed; idle peers within
 * BROKER_BACKUP_SPEED_TIE of each other count as equals (the registry's order decides). */
static broker_peer *pick_backup(broker_t *b, broker_job *j, uint32_t s, const char *exclude)
{
    broker_peer *best = NULL;
    int best_rank = 99;
    double best_s = 0;
    for (size_t i = 0; i < b->n_peers && best_rank > 0; i++) {
        broker_peer *p = &b->peers[i];
        if (!broker_peer_trusted(b, p) || p->paused || (exclude && strcmp(p->key, exclude) == 0) ||
            broker_job_excludes(j, p->key) || !broker_peer_fits(j, s, p))
            continue;
        int rank;
        if (p->backup && strcmp(p->job, j->id) == 0)
            rank = p->stage == s ? (p->warm ? 0 : 1) : 2;
        else if (!p->job[0])
            rank = 3;
        else
            continue;
        if (rank > best_rank)
            continue;
        double t = rank == 3 ? broker_peer_stage_s(j, s, p) : 0;
        if (rank < best_rank || t * (1.0 + BROKER_BACKUP_SPEED_TIE) < best_s) {
            best_rank = rank;
            best = p;
            best_s = t;
        }
    }
    return best;
}

void broker_failover(broker_t *b, broker_job *j, uint32_t stage, const char *why)
{
    if (j->dead || j->finishing || j->phase == BJ_QUEUED || stage >= j->n_stages)
        return; /* a finishing job's stages are done: it needs none of them */
    b->tot.failovers++;
    char text[DB_REASON_MAX];
    char lost[DB_KEY_LEN + 1];
    snprintf(lost, sizeof lost, "%s", j->stages[stage].peer);
    j->stages[stage].peer[0] = '\0';
    j->retries++;
    if (j->retries > BROKER_MAX_RETRIES) {
        snprintf(text, sizeof text, "failed after %u recoveries without progress; the last: stage %u lost its peer (%.300s)",
                 BROKER_MAX_RETRIES, stage, why);
        broker_job_fail(b, j, text);
        return;
    }
    if (j->phase == BJ_RECOVER_WAIT)
        return; /* broker_recover will find a peer for it */
    broker_peer *nb = pick_backup(b, j, stage, lost);
    if (!nb) {
        snprintf(text, sizeof text, "waiting for peers: stage %u lost its peer (%.300s) and no backup is free", stage, why);
        broker_job_requeue(b, j, text);
        return;
    }
    int64_t c = 0;
    if (j->kind == DB_JOB_FINETUNE && db_ckpt_common_step(b->db, j->id, &c) != FU_OK)
        c = 0;
    fu_err rc = db_stage_reassign(b->db, j->id, stage, nb->key,
                                  broker_wall() + (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms, broker_wall());
    if (rc != FU_OK) {
        snprintf(text, sizeof text, "waiting for peers: stage %u could not be handed to a backup (%s)", stage,
                 fu_strerror(rc));
        broker_job_requeue(b, j, text);
        return;
    }
    /* Every stage stops, then all restart from checkpoint c with the backup in place. */
    snprintf(text, sizeof text, "stage %u lost its peer (%.300s): resuming from step %" PRId64, stage, why, c);
    stop_stages(b, j, text, false);
    bool was_warm = nb->warm;
    snprintf(j->stages[stage].peer, sizeof j->stages[stage].peer, "%s", nb->key);
    broker_peer_take(b, nb, j, stage, false);
    snprintf(text, sizeof text, "stage %u moved from %.8s to %s backup %.8s (%.300s); resuming from step %" PRId64, stage,
             lost, was_warm ? "warm" : "cold", nb->key, why, c);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, nb->key, "failover", text));
    FU_INFO(LOG, "job %s: %s", j->id, text);
    char reason[DB_REASON_MAX];
    snprintf(reason, sizeof reason, "recovering: %.900s", text);
    broker_start_stages(b, j, broker_job_resume_step(j, c), reason);
    b->sched_dirty = true; /* top up the backups */
}

void broker_recover(broker_t *b, broker_job *j)
{
    char text[DB_REASON_MAX];
    if (j->n_stages == 0) {
        broker_job_requeue(b, j, "broker restarted: planning again");
        return;
    }
    /* Peers of the stored plan that came back take their stages again; others go to idle peers. */
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (p && p->live && !p->draining && !p->job[0]) {
            broker_peer_take(b, p, j, s, false);
            continue;
        }
        j->stages[s].peer[0] = '\0';
    }
    for (uint32_t s = 0; s < j->n_stages; s++) {
        if (j->stages[s].peer[0])
            continue;
        broker_peer *nb = pick_backup(b, j, s, NULL);
        if (!nb) {
            snprintf(text, sizeof text, "waiting for peers: after a broker restart stage %u's peer did not come back "
                                        "and no idle peer is free", s);
            broker_job_requeue(b, j, text);
            return;
        }
        snprintf(j->stages[s].peer, sizeof j->stages[s].peer, "%s", nb->key);
        broker_peer_take(b, nb, j, s, false);
    }
    int64_t lease = broker_wall() + (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        if (db_stage_reassign(b->db, j->id, s, j->stages[s].peer, lease, broker_wall()) != FU_OK) {
            broker_job_requeue(b, j, "broker restarted: the stored plan could not be renewed; planning again");
            return;
        }
    }
    int64_t c = 0;
    if (j->kind == DB_JOB_FINETUNE && db_ckpt_common_step(b->db, j->id, &c) != FU_OK)
        c = 0;
    snprintf(text, sizeof text, "recovering after a broker restart: resuming from step %" PRId64, c);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "recovered", text));
    broker_start_stages(b, j, broker_job_resume_step(j, c), text);
    b->sched_dirty = true;
}

/* ---- deadlines on the work (docs/PIPELINE.md "Failures") ---------------------------------------- */

uint64_t broker_step_timeout_ms(const broker_t *b, const broker_job *j)
{
    if (b->cfg.step_timeout_s)
        return (uint64_t)b->cfg.step_timeout_s * 1000u;
    double t = (double)BROKER_STEP_TIMEOUT_FACTOR * j->slowest_s;
    if (t < BROKER_STEP_TIMEOUT_MIN_S)
        t = BROKER_STEP_TIMEOUT_MIN_S;
    if (!j->stepped && t < (double)b->cfg.ready_timeout_s) /* the first step of a run includes its warm-up */
        t = (double)b->cfg.ready_timeout_s;
    if (t > BROKER_TIMEOUT_MAX_S)
        t = BROKER_TIMEOUT_MAX_S;
    return (uint64_t)(t * 1000.0);
}

/* Stage s of j sent no StageReady in time: its peer is released and taken off the job, and the stage
 * fails over like a lost one. */
static void ready_missed(broker_t *b, broker_job *j, uint32_t s)
{
    char key[DB_KEY_LEN + 1], why[300];
    snprintf(key, sizeof key, "%s", j->stages[s].peer);
    broker_peer *p = broker_peer_find(b, key);
    snprintf(why, sizeof why, "peer %.8s (%s) missed its ready deadline: no StageReady %u s after StageAssign", key,
             p ? p->name : "?", b->cfg.ready_timeout_s);
    FU_WARN(LOG, "job %s: stage %u: %s; it is taken off the job", j->id, s, why);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, key, "ready-timeout", why));
    broker_job_exclude(b, j, key, why);
    if (p && strcmp(p->job, j->id) == 0)
        broker_peer_release(b, j, p, why);
    broker_failover(b, j, s, why);
}

/* The stage of fine-tuning job j that stalled, from its peers' last heartbeats, or -1 when they do
 * not say (a report missing or older than 3 heartbeats, an inference job, or every stage done).
 * Within the oldest step any stage is on (later steps count as done): the first stage whose forward
 * is not through all M micro-batches, although every stage before it is (so it has its inputs);
 * else the last stage whose backward is not, although every stage after it is. */
static int stalled_stage(broker_t *b, const broker_job *j)
{
    if (j->kind != DB_JOB_FINETUNE || j->n_stages == 0 || j->n_stages > BROKER_MAX_STAGES)
        return -1;
    uint64_t now = broker_now(), fresh = 3ull * b->cfg.heartbeat_ms, smin = UINT64_MAX;
    const broker_peer *ps[BROKER_MAX_STAGES];
    for (uint32_t s = 0; s < j->n_stages; s++) {
        const broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (!p || !p->live || strcmp(p->prog_job, j->id) != 0 || now - p->prog_ms > fresh)
            return -1;
        ps[s] = p;
        smin = p->prog_step < smin ? p->prog_step : smin;
    }
    uint32_t M = j->spec.micro_batches ? j->spec.micro_batches : 1;
    for (uint32_t s = 0; s < j->n_stages; s++)
        if (ps[s]->prog_step == smin && ps[s]->prog_fwd < M)
            return (int)s;
    for (uint32_t s = j->n_stages; s-- > 0;)
        if (ps[s]->prog_step == smin && ps[s]->prog_bwd < M)
            return (int)s;
    return -1;
}

/* j made no progress within its step deadline. When the peers' heartbeats show which stage stalled
 * (stalled_stage) and a backup is free, that stage's peer is taken off the job and its stage fails
 * over, as for a missed ready deadline. Otherwise every stage is released and restarted from the
 * newest common checkpoint on the same peers. Either way a retry is counted; BROKER_MAX_RETRIES
 * recoveries without progress fail the job. */
static void step_missed(broker_t *b, broker_job *j, uint64_t idle_ms, uint64_t limit_ms)
{
    char why[300], text[DB_REASON_MAX];
    bool ft = j->kind == DB_JOB_FINETUNE;
    int stalled = stalled_stage(b, j);
    const broker_peer *sp = stalled >= 0 ? broker_peer_find(b, j->stages[stalled].peer) : NULL;
    char stage_says[160] = "";
    if (sp)
        snprintf(stage_says, sizeof stage_says, "; stage %d (peer %.8s, %s) is behind: %u/%u forward, %u/%u backward",
                 stalled, sp->key, sp->name, sp->prog_fwd, j->spec.micro_batches, sp->prog_bwd, j->spec.micro_batches);
    const bool steps = j->kind != DB_JOB_INFER; /* a fine-tune or an eval counts steps, an inference tokens */
    snprintf(why, sizeof why, "no progress past %s %" PRIu64 " for %" PRIu64 " s (step deadline %" PRIu64 " s)%s",
             steps ? "step" : "token", steps ? j->steps_done : (uint64_t)j->n_gen, idle_ms / 1000, limit_ms / 1000,
             stage_says);
    FU_WARN(LOG, "job %s: %s", j->id, why);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, sp ? sp->key : NULL, "step-timeout", why));
    if (sp && pick_backup(b, j, (uint32_t)stalled, sp->key)) {
        char key[DB_KEY_LEN + 1];
        snprintf(key, sizeof key, "%s", sp->key);
        FU_WARN(LOG, "job %s: stage %d: peer %.8s is taken off the job", j->id, stalled, key);
        broker_job_exclude(b, j, key, why);
        broker_peer *p = broker_peer_find(b, key);
        if (p && strcmp(p->job, j->id) == 0)
            broker_peer_release(b, j, p, why);
        broker_failover(b, j, (uint32_t)stalled, why); /* counts the retry */
        return;
    }
    j->retries++;
    if (j->retries > BROKER_MAX_RETRIES) {
        snprintf(text, sizeof text, "failed after %u recoveries without progress; the last: %s", BROKER_MAX_RETRIES,
                 why);
        broker_job_fail(b, j, text);
        return;
    }
    int64_t c = 0;
    if (ft && db_ckpt_common_step(b->db, j->id, &c) != FU_OK)
        c = 0;
    snprintf(text, sizeof text, "%s: restarting every stage from %s %" PRIu64, why, steps ? "step" : "token",
             broker_job_resume_step(j, c));
    stop_stages(b, j, text, true);
    FU_INFO(LOG, "job %s: %s", j->id, text);
    char reason[DB_REASON_MAX];
    snprintf(reason, sizeof reason, "recovering: %.900s", text);
    broker_start_stages(b, j, broker_job_resume_step(j, c), reason);
}

/* A stage of running job j whose peer is paused (its owner's machine is busy, or outside its hours):
 * the time it holds j does not count against j's step deadline, up to the grace period in all since
 * j last made progress (pauses that stop and start again share one allowance: a peer cannot hold a
 * job by toggling). When the allowance is spent, the stage moves to a free peer as for a lost one,
 * and its peer is kept off this job (no reputation lost: a pause is no fault); with no free peer,
 * the step deadline applies again, blame included. Returns whether j is held by a pause now. */
static bool pause_hold(broker_t *b, broker_job *j, uint64_t now)
{
    if (j->pause_progress_ms != j->progress_ms) { /* progress since: a fresh allowance */
        j->pause_progress_ms = j->progress_ms;
        j->pause_held_ms = 0;
    }
    uint64_t grace = (uint64_t)b->cfg.pause_grace_s * 1000u;
    broker_peer *p = NULL;
    uint32_t s = 0;
    for (uint32_t k = 0; k < j->n_stages && !p; k++) {
        broker_peer *q = broker_peer_find(b, j->stages[k].peer);
        if (q && q->live && q->paused && strcmp(q->job, j->id) == 0) {
            p = q;
            s = k;
        }
    }
    if (!p) {
        j->pause_last_ms = 0;
        if (strncmp(j->reason, "paused: ", 8) == 0)
            broker_job_show(j, "running");
        return false;
    }
    if (j->pause_last_ms && now > j->pause_last_ms)
        j->pause_held_ms += now - j->pause_last_ms;
    j->pause_last_ms = now;
    char why[DB_REASON_MAX];
    if (j->pause_held_ms < grace) {
        snprintf(why, sizeof why, "stage %u's peer %.8s (%s) is paused (%.300s) for %" PRIu64 " s; it keeps its stage "
                 "during the grace period", s, p->key, p->name, p->pause_reason, (now - p->paused_since_ms) / 1000);
        if (strncmp(j->reason, "paused: ", 8) != 0)
            FU_INFO(LOG, "job %s: %s", j->id, why);
        char shown[DB_REASON_MAX];
        snprintf(shown, sizeof shown, "paused: %.900s", why);
        broker_job_show(j, shown);
        return true;
    }
    j->pause_last_ms = 0;
    if (!pick_backup(b, j, s, p->key)) {
        snprintf(why, sizeof why, "stage %u's peer %.8s (%s) used up the pause grace of %u s (%.300s) and no free peer "
                 "can take the stage: the step deadline applies", s, p->key, p->name, b->cfg.pause_grace_s,
                 p->pause_reason);
        if (strncmp(j->reason, "paused: ", 8) == 0)
            FU_WARN(LOG, "job %s: %s", j->id, why);
        broker_job_show(j, why);
        return false;
    }
    char key[DB_KEY_LEN + 1];
    snprintf(key, sizeof key, "%s", p->key);
    snprintf(why, sizeof why, "peer %.8s (%s) stayed paused past the grace period of %u s (%.300s)", key, p->name,
             b->cfg.pause_grace_s, p->pause_reason);
    FU_WARN(LOG, "job %s: stage %u: %s; the stage moves and the peer is kept off this job, its reputation unchanged",
            j->id, s, why);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, key, "pause-timeout", why));
    broker_job_exclude(b, j, key, why);
    broker_peer_release(b, j, p, why);
    broker_failover(b, j, s, why);
    return true;
}

void broker_deadlines_sweep(broker_t *b)
{
    uint64_t now = broker_now();
    for (size_t i = 0; i < b->n_jobs; i++) {
        broker_job *j = b->jobs[i];
        if (j->dead || j->finishing)
            continue;
        if (j->phase == BJ_STARTING) {
            uint64_t limit = (uint64_t)b->cfg.ready_timeout_s * 1000u;
            for (uint32_t s = 0; s < j->n_stages; s++) {
                if (!j->stages[s].ready && j->stages[s].peer[0] && now - j->stages[s].assigned_ms > limit) {
                    ready_missed(b, j, s); /* restarts every stage (new deadlines) or requeues j */
                    break;
                }
            }
        } else if (j->phase == BJ_RUNNING && j->spec.sessions && !broker_serve_open_count(j)) {
            continue; /* a serving job without sessions has nothing to do: no stall */
        } else if (j->phase == BJ_RUNNING && !pause_hold(b, j, now)) {
            uint64_t limit = broker_step_timeout_ms(b, j), idle = now - j->progress_ms;
            idle = idle > j->pause_held_ms ? idle - j->pause_held_ms : 0; /* time a pause held j is no stall */
            if (idle > limit)
                step_missed(b, j, idle, limit);
        }
    }
}

void broker_recover_ready(broker_t *b)
{
    for (size_t i = 0; i < b->n_jobs; i++) {
        broker_job *j = b->jobs[i];
        if (j->dead || j->phase != BJ_RECOVER_WAIT || j->n_stages == 0)
            continue;
        bool all = true;
        for (uint32_t s = 0; s < j->n_stages && all; s++) {
            broker_peer *p = broker_peer_find(b, j->stages[s].peer);
            all = p && broker_peer_free(b, p);
        }
        if (all) /* every peer of the stored plan is back: no need to wait out the grace period */
            broker_recover(b, j);
    }
}
