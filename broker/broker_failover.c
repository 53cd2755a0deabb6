/* broker_failover: stage assignment messages, a lost stage handed to a backup (warm first) with
 * every stage rewound to the newest common checkpoint, the retry cap, and the recovery of running
 * jobs after a broker restart. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_log.h"

#define LOG "failover"

fu_err broker_send_assign(broker_t *b, broker_job *j, uint32_t s, broker_peer *p, bool backup)
{
    Fusion__StageAssign a = FUSION__STAGE_ASSIGN__INIT;
    Fusion__Neighbour nb[2];
    Fusion__Neighbour *nbp[2];
    uint8_t keys[2][WIRE_KEY_BYTES];
    size_t nn = 0;
    for (int d = -1; d <= 1; d += 2) {
        int64_t o = (int64_t)s + d;
        if (o < 0 || o >= (int64_t)j->n_stages)
            continue;
        broker_peer *q = broker_peer_find(b, j->stages[o].peer);
        fusion__neighbour__init(&nb[nn]);
        nb[nn].role = d < 0 ? FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM : FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM;
        nb[nn].stage_index = (uint32_t)o;
        if (q && wire_key_from_z85(q->key, keys[nn]) == FU_OK) {
            nb[nn].public_key.data = keys[nn];
            nb[nn].public_key.len = WIRE_KEY_BYTES;
            nb[nn].data_endpoint = q->endpoint;
            nb[nn].relay = q->relay || p->relay;
        } else {
            nb[nn].data_endpoint = (char *)"";
        }
        nbp[nn] = &nb[nn];
        nn++;
    }
    a.job_id = j->id64;
    a.stage_index = s;
    a.stage_count = j->n_stages;
    a.node_begin = j->stages[s].first;
    a.node_end = j->stages[s].last;
    a.n_neighbours = nn;
    a.neighbours = nbp;
    a.relay = p->relay;
    a.dag.data = j->dag_bytes;
    a.dag.len = j->dag_len;
    a.model_id = j->model_id;
    a.resume_step = j->start_step;
    a.backup = backup;
    a.micro_batches = j->kind == DB_JOB_FINETUNE ? j->spec.micro_batches : 1;
    a.spec_json = j->spec_json;
    a.verify = broker_job_verify_fraction(b, j);
    return broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, j->id64, &a.base);
}

void broker_start_stages(broker_t *b, broker_job *j, uint64_t resume_step)
{
    j->start_step = resume_step;
    j->phase = BJ_STARTING;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        j->stages[s].ready = false;
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (p && p->live)
            (void)broker_send_assign(b, j, s, p, false);
    }
}

/* A peer to take stage s of j: its warm backup, another backup of j, then any idle peer. */
static broker_peer *pick_backup(broker_t *b, broker_job *j, uint32_t s, const char *exclude)
{
    broker_peer *best = NULL;
    int best_rank = 99;
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (!broker_peer_trusted(b, p) ||
            (exclude && strcmp(p->key, exclude) == 0) || !broker_peer_fits(j, s, p))
            continue;
        int rank;
        if (p->backup && strcmp(p->job, j->id) == 0)
            rank = p->stage == s ? (p->warm ? 0 : 1) : 2;
        else if (!p->job[0])
            rank = 3;
        else
            continue;
        if (rank < best_rank) {
            best_rank = rank;
            best = p;
        }
    }
    return best;
}

void broker_failover(broker_t *b, broker_job *j, uint32_t stage, const char *why)
{
    if (j->dead || j->phase == BJ_QUEUED || stage >= j->n_stages)
        return;
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
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        if (!p || !p->live)
            continue;
        Fusion__StageRelease r = FUSION__STAGE_RELEASE__INIT;
        r.job_id = j->id64;
        r.stage_index = s;
        snprintf(text, sizeof text, "stage %u lost its peer (%.300s): resuming from step %" PRId64, stage, why, c);
        r.reason = text;
        (void)broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, j->id64, &r.base);
    }
    bool was_warm = nb->warm;
    snprintf(j->stages[stage].peer, sizeof j->stages[stage].peer, "%s", nb->key);
    snprintf(nb->job, sizeof nb->job, "%s", j->id);
    nb->stage = stage;
    nb->backup = nb->warm = false;
    BROKER_IGNORE(db_peer_set_state(b->db, nb->key, DB_PEER_ACTIVE, broker_wall()));
    snprintf(text, sizeof text, "stage %u moved from %.8s to %s backup %.8s (%.300s); resuming from step %" PRId64, stage,
             lost, was_warm ? "warm" : "cold", nb->key, why, c);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, nb->key, "failover", text));
    FU_INFO(LOG, "job %s: %s", j->id, text);
    snprintf(j->reason, sizeof j->reason, "recovering: %.900s", text);
    broker_start_stages(b, j, j->kind == DB_JOB_FINETUNE ? (uint64_t)c : j->n_gen);
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
            snprintf(p->job, sizeof p->job, "%s", j->id);
            p->stage = s;
            p->backup = false;
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
        snprintf(nb->job, sizeof nb->job, "%s", j->id);
        nb->stage = s;
        nb->backup = false;
    }
    int64_t lease = broker_wall() + (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        if (db_stage_reassign(b->db, j->id, s, j->stages[s].peer, lease, broker_wall()) != FU_OK) {
            broker_job_requeue(b, j, "broker restarted: the stored plan could not be renewed; planning again");
            return;
        }
        BROKER_IGNORE(db_peer_set_state(b->db, j->stages[s].peer, DB_PEER_ACTIVE, broker_wall()));
    }
    int64_t c = 0;
    if (j->kind == DB_JOB_FINETUNE && db_ckpt_common_step(b->db, j->id, &c) != FU_OK)
        c = 0;
    snprintf(text, sizeof text, "recovering after a broker restart: resuming from step %" PRId64, c);
    snprintf(j->reason, sizeof j->reason, "%s", text);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), j->id, NULL, "recovered", text));
    FU_INFO(LOG, "job %s: %s", j->id, text);
    broker_start_stages(b, j, j->kind == DB_JOB_FINETUNE ? (uint64_t)c : j->n_gen);
    b->sched_dirty = true;
}
