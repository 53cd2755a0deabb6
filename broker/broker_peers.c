/* broker_peers: the messages of a peer's life, as thin handlers over the registry (broker_registry.c):
 * it joins (PeerHello → PeerWelcome), beats (Heartbeat, answered), probes its link, leaves (Leave:
 * drained) or dies (silent for dead_after_ms, even when its socket stays open, or its lease ran out).
 * A peer that goes takes its stage to failover; one that comes back may let a restarted job recover. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_log.h"

#define LOG "registry"
#define BROKER_PROBE_MAX_BYTES (4u << 20) /* largest LinkProbe payload */
#define BROKER_PROBE_INTERVAL_MS 60000u   /* one LinkProbe per peer per minute */
#define BROKER_PEER_LIST_MAX   2000 /* peers in one PeerList (about 300 bytes each; 1 MiB cap) */

/* Frees whatever work p holds: a stage goes to failover, a backup slot is just forgotten. */
static void drop_work(broker_t *b, broker_peer *p, const char *why)
{
    if (!p->job[0])
        return;
    broker_job *j = broker_job_find(b, p->job);
    uint32_t stage = p->stage;
    bool was_backup = p->backup;
    broker_peer_forget_work(p);
    if (!j || j->dead || was_backup)
        return;
    if (stage < j->n_stages && strcmp(j->stages[stage].peer, p->key) == 0)
        broker_failover(b, j, stage, why);
}

void broker_peer_gone(broker_t *b, broker_peer *p, bool left, const char *why)
{
    if (!p->live)
        return;
    char job[DB_JOB_ID_LEN + 1];
    snprintf(job, sizeof job, "%s", p->job);
    drop_work(b, p, why); /* while it is live: failover's StageRelease reaches it too */
    broker_peer_set_gone(b, p, left, job, why);
}

static void welcome(broker_t *b, const wire_msg_t *msg, const broker_peer *p)
{
    Fusion__PeerWelcome w = FUSION__PEER_WELCOME__INIT;
    w.peer_id = (char *)p->key;
    w.heartbeat_ms = b->cfg.heartbeat_ms;
    w.dead_after_ms = b->dead_after_ms;
    w.broker_time_ms = broker_wall();
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_PEER_WELCOME, &w.base);
}

void broker_on_hello(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__PeerHello *h = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_PEER_HELLO);
    char key[DB_KEY_LEN + 1];
    fu_errmsg em = {{0}};
    if (!broker_msg_peer_id(msg, key)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "PeerHello: slot %u is out of range (a peer process "
                           "runs at most %d slots)", wire_msg_hdr(msg)->slot, BROKER_MAX_SLOTS);
        return;
    }
    if (broker_peer_hello_check(h, &em) != FU_OK) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "%s", em.msg);
        return;
    }
    broker_peer *p = broker_peer_find(b, key);
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    if (p && p->live && h->session && h->session == p->session) {
        /* The same process again: a backlog of hellos queued while we were away, or a lost welcome.
         * It keeps its work; it is answered where it listens now. */
        p->rid_len = rl <= sizeof p->rid ? rl : sizeof p->rid;
        memcpy(p->rid, rid, p->rid_len);
        p->last_heard_ms = broker_now();
        FU_DEBUG(LOG, "peer %.8s (%s) said hello again (same session): keeps its work", p->key, p->name);
        welcome(b, msg, p);
        return;
    }
    if (p && p->live) /* a new session of a known peer: whatever it ran is gone */
        drop_work(b, p, "the peer registered again (new session)");
    fu_err rc = broker_peer_admit(b, wire_msg_user_id(msg), wire_msg_hdr(msg)->slot, h, rid, rl, &p, &em);
    if (rc != FU_OK) {
        broker_reply_error(b, msg, rc == FU_EAGAIN ? FUSION__ERROR_CODE__ERR_BUSY : FUSION__ERROR_CODE__ERR_INTERNAL,
                           "%s", em.msg);
        return;
    }
    welcome(b, msg, p);
    broker_challenge_start(b, p); /* no work before its speed is verified */
    broker_recover_ready(b);
    b->sched_dirty = true;
}

void broker_on_heartbeat(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__Heartbeat *hb = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_HEARTBEAT);
    b->tot.heartbeats++;
    if (hb)
        broker_peer_heartbeat(b, p, hb);
    if (hb && hb->quiet)
        return; /* heard; an answer would only cost both sides a message */
    Fusion__Heartbeat r = FUSION__HEARTBEAT__INIT;
    r.time_ms = broker_wall();
    r.state = broker_peer_wire_state(p);
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_HEARTBEAT, &r.base);
}

/* LinkProbeRequest: up to BROKER_PROBE_MAX_BYTES of zeros, so that the peer can time its link from
 * the broker. Once per BROKER_PROBE_INTERVAL_MS per peer: a peer cannot turn the broker into a firehose. */
void broker_on_link_probe(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__LinkProbeRequest *rq = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ);
    uint64_t now = broker_now();
    if (!rq) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_PROTO, "LinkProbeRequest: malformed");
        return;
    }
    if (p->probe_ms && now - p->probe_ms < BROKER_PROBE_INTERVAL_MS) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY, "one link probe per %u s", BROKER_PROBE_INTERVAL_MS / 1000);
        return;
    }
    if (!b->probe_zeros)
        b->probe_zeros = fu_calloc(1, BROKER_PROBE_MAX_BYTES);
    p->probe_ms = now;
    Fusion__LinkProbe r = FUSION__LINK_PROBE__INIT;
    r.data.len = rq->bytes < BROKER_PROBE_MAX_BYTES ? rq->bytes : BROKER_PROBE_MAX_BYTES;
    r.data.data = b->probe_zeros;
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_LINK_PROBE, &r.base);
}

void broker_on_leave(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__Leave *l = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_LEAVE);
    char why[300];
    snprintf(why, sizeof why, "left: %s", l && l->reason && l->reason[0] ? l->reason : "no reason given");
    /* Drained: the peer stops taking frames now; its job goes on from the newest checkpoint on a
     * backup (broker_peer_gone → failover sends StageRelease to every stage, this peer included). */
    p->draining = true;
    broker_peer_gone(b, p, true, why);
    if (p->rid_len) { /* tell it we heard: it may exit now */
        Fusion__StageRelease rel = FUSION__STAGE_RELEASE__INIT;
        rel.reason = (char *)"leave acknowledged";
        (void)broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, 0, &rel.base);
    }
}

void broker_peers_sweep(broker_t *b)
{
    broker_peer_leases_flush(b); /* the beats heard since the last sweep, in one commit */
    uint64_t now = broker_now();
    /* Silence is measured up to the last turn that read the socket empty, not up to now: while the
     * loop is behind (a join storm, a burst, a long plan) the beats of live peers wait unread, and
     * declaring them dead would make them register again and deepen the storm (docs/SCALE.md). */
    uint64_t heard_by = b->drained_ms;
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (p->live && heard_by > p->last_heard_ms && heard_by - p->last_heard_ms > b->dead_after_ms) {
            char why[128];
            snprintf(why, sizeof why, "silent for %llu ms (dead after %u ms)",
                     (unsigned long long)(now - p->last_heard_ms), b->dead_after_ms);
            broker_peer_gone(b, p, false, why);
        }
    }
    /* Leases that ran out although the holder still looks alive (a stalled peer that still answers
     * ZMTP pings, or a clock jump): treat as a death of that stage. */
    db_stage *st = NULL;
    size_t n = 0;
    /* ... judged, like silence, as of the last turn that read everything: a lease is renewed by
     * heartbeats, and those may be waiting unread behind a long plan or a storm */
    int64_t heard_wall = broker_wall() - (int64_t)(now - (heard_by < now ? heard_by : now));
    if (db_stage_expired(b->db, heard_wall, &st, &n) != FU_OK)
        return;
    for (size_t k = 0; k < n; k++) {
        broker_job *j = broker_job_find(b, st[k].job);
        if (!j || j->dead || j->phase == BJ_RECOVER_WAIT || st[k].index >= j->n_stages)
            continue;
        if (strcmp(j->stages[st[k].index].peer, st[k].peer) != 0)
            continue;
        broker_peer *p = broker_peer_find(b, st[k].peer);
        if (p && p->job[0] && strcmp(p->job, j->id) == 0)
            broker_peer_forget_work(p);
        broker_failover(b, j, st[k].index, "its lease ran out");
    }
    db_stage_array_free(&st, n);
}

/* Whether the PeerList requester may see which job p works for: its own jobs, or everything for
 * an operator; another tenant's work shows as "busy" without a job or stage (docs/SECURITY.md). */
static bool job_visible(broker_t *b, const broker_peer *p, const char *requester, uint32_t roles)
{
    if (!p->job[0] || (roles & WIRE_ROLE_OPERATOR))
        return true;
    const broker_job *j = broker_job_find(b, p->job);
    return j && strcmp(j->owner, requester) == 0;
}

void broker_on_peer_list(broker_t *b, const wire_msg_t *msg)
{
    const char *requester = wire_msg_user_id(msg);
    uint32_t roles = wire_zap_msg_roles(b->zap, msg);
    /* live peers first, then the gone ones, at most BROKER_PEER_LIST_MAX (the reply's size cap) */
    size_t n = 0;
    broker_peer **order = fu_calloc(b->n_peers ? b->n_peers : 1, sizeof *order);
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < b->n_peers && n < BROKER_PEER_LIST_MAX; i++)
            if (b->peers[i].live == (pass == 0))
                order[n++] = &b->peers[i];
    Fusion__PeerInfo *infos = fu_calloc(n ? n : 1, sizeof *infos);
    Fusion__PeerInfo **ptrs = fu_calloc(n ? n : 1, sizeof *ptrs);
    Fusion__PeerProfile *profs = fu_calloc(n ? n : 1, sizeof *profs);
    Fusion__DtypeSpeed *spd = fu_calloc(n ? n : 1, sizeof *spd);
    Fusion__DtypeSpeed **spp = fu_calloc(n ? n : 1, sizeof *spp);
    uint64_t now = broker_now();
    int64_t wall = broker_wall();
    db_peer *stored = NULL;
    size_t n_stored = 0;
    if (db_peer_list(b->db, 0, &stored, &n_stored) != FU_OK)
        n_stored = 0;
    for (size_t i = 0; i < n; i++) {
        broker_peer *p = order[i];
        infos[i].reputation = DB_REPUTATION_INIT;
        for (size_t k = 0; k < n_stored; k++)
            if (strcmp(stored[k].key, p->key) == 0)
                infos[i].reputation = stored[k].reputation;
        fusion__dtype_speed__init(&spd[i]);
        spd[i].dtype = FUSION__DTYPE__DTYPE_F32;
        spd[i].gemm_gflops = p->gflops;
        spp[i] = &spd[i];
        fusion__peer_profile__init(&profs[i]);
        profs[i].n_speeds = 1;
        profs[i].speeds = &spp[i];
        profs[i].free_memory_bytes = p->mem_bytes;
        profs[i].backend = p->backend ? p->backend : FUSION__BACKEND__BACKEND_CPU;
        profs[i].device_name = p->device;
        profs[i].numeric_class = p->numeric_class;
        profs[i].link_bandwidth_bps = p->link_bw;
        profs[i].link_latency_ms = p->link_latency_ms;
        profs[i].threads = p->threads;
        double rep = infos[i].reputation;
        fusion__peer_info__init(&infos[i]);
        infos[i].reputation = rep;
        infos[i].peer_id = p->key;
        infos[i].name = p->name;
        infos[i].profile = &profs[i];
        infos[i].state = !p->live      ? FUSION__PEER_STATE__PEER_STATE_DEAD
                         : p->draining ? FUSION__PEER_STATE__PEER_STATE_DRAINING
                         : p->paused   ? FUSION__PEER_STATE__PEER_STATE_PAUSED
                                       : broker_peer_wire_state(p);
        if (job_visible(b, p, requester, roles)) {
            infos[i].job_id = p->job[0] ? strtoull(p->job, NULL, 16) : 0;
            infos[i].stage_index = p->stage;
        } else if (infos[i].state == FUSION__PEER_STATE__PEER_STATE_WARM) {
            infos[i].state = FUSION__PEER_STATE__PEER_STATE_BUSY; /* a backup is busy too, for all they know */
        }
        infos[i].last_seen_ms = wall - (int64_t)(now - p->last_heard_ms);
        infos[i].gflops_claimed = p->claimed_gflops;
        infos[i].gflops_verified = p->verified_gflops;
        infos[i].profile_check = (char *)(!b->cfg.challenge_ms   ? "off"
                                          : p->ch == BCH_PASSED ? "verified"
                                          : p->ch == BCH_FAILED ? "failed"
                                                                : "pending");
        if (p->paused) {
            infos[i].pause_reason = p->pause_reason;
            infos[i].paused_ms = (int64_t)(now - p->paused_since_ms);
        }
        ptrs[i] = &infos[i];
    }
    Fusion__PeerList pl = FUSION__PEER_LIST__INIT;
    pl.n_peers = n;
    pl.peers = ptrs;
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_PEER_LIST, &pl.base);
    db_peer_array_free(&stored, n_stored);
    free(order);
    free(infos);
    free(ptrs);
    free(profs);
    free(spd);
    free(spp);
}
