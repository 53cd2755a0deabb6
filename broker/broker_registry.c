/* broker_registry: peers join (PeerHello → PeerWelcome), beat (Heartbeat, answered), leave
 * (Leave: drained) or die (silent for dead_after_ms, even when their socket stays open). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_log.h"

#define LOG "registry"
#define BROKER_DEFAULT_LINK_BW 1e9  /* bytes/s assumed when a peer did not measure its link */
#define BROKER_MAX_LINK_BW     1e12 /* bytes/s above which a reported link is not believed */
#define BROKER_PROBE_MAX_BYTES (4u << 20) /* largest LinkProbe payload */
#define BROKER_PROBE_INTERVAL_MS 60000u   /* one LinkProbe per peer per minute */
#define BROKER_PEER_LIST_MAX   2000 /* peers in one PeerList (about 300 bytes each; 1 MiB cap) */

broker_peer *broker_peer_find(broker_t *b, const char *key)
{
    if (!key)
        return NULL;
    for (size_t i = 0; i < b->n_peers; i++)
        if (strcmp(b->peers[i].key, key) == 0)
            return &b->peers[i];
    return NULL;
}

static bool text_ok(const char *s, size_t max)
{
    size_t n = s ? strnlen(s, max + 1) : 0;
    if (n > max)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return false;
    return true;
}

static char *profile_json(const broker_peer *p)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "gflops_f32", p->gflops);
    cJSON_AddNumberToObject(o, "free_memory_bytes", (double)p->mem_bytes);
    cJSON_AddStringToObject(o, "backend", p->backend == FUSION__BACKEND__BACKEND_CUDA ? "cuda" : "cpu");
    cJSON_AddStringToObject(o, "device", p->device);
    cJSON_AddNumberToObject(o, "link_bandwidth_bps", p->link_bw);
    cJSON_AddNumberToObject(o, "link_latency_ms", p->link_latency_ms);
    cJSON_AddNumberToObject(o, "threads", p->threads);
    cJSON_AddStringToObject(o, "data_endpoint", p->endpoint);
    cJSON_AddBoolToObject(o, "needs_relay", p->relay);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* Frees whatever work p holds: a stage goes to failover, a backup slot is just forgotten. */
static void drop_work(broker_t *b, broker_peer *p, const char *why)
{
    if (!p->job[0])
        return;
    broker_job *j = broker_job_find(b, p->job);
    uint32_t stage = p->stage;
    bool was_backup = p->backup;
    p->job[0] = '\0';
    p->backup = p->warm = false;
    if (!j || j->dead || was_backup)
        return;
    if (stage < j->n_stages && strcmp(j->stages[stage].peer, p->key) == 0)
        broker_failover(b, j, stage, why);
}

void broker_peer_gone(broker_t *b, broker_peer *p, bool left, const char *why)
{
    if (!p->live)
        return;
    int64_t now = broker_wall();
    FU_INFO(LOG, "peer %.8s (%s) %s: %s", p->key, p->name, left ? "left" : "is dead", why);
    fu_err rc = db_peer_set_state(b->db, p->key, left ? DB_PEER_LEFT : DB_PEER_DEAD, now);
    if (rc != FU_OK)
        FU_WARN(LOG, "could not store the state of peer %.8s: %s", p->key, fu_strerror(rc));
    BROKER_IGNORE(db_event_add(b->db, now, p->job[0] ? p->job : NULL, p->key, left ? "peer-left" : "peer-dead", why));
    drop_work(b, p, why);
    p->live = false;
    p->draining = false;
    b->sched_dirty = true;
}

void broker_on_hello(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__PeerHello *h = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_PEER_HELLO);
    const char *key = wire_msg_user_id(msg);
    const Fusion__PeerProfile *pr = h ? h->profile : NULL;
    if (!h || !pr) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "PeerHello needs a profile (measured speed and memory)");
        return;
    }
    if (!text_ok(h->name, DB_NAME_MAX) || !text_ok(h->data_endpoint, BROKER_ENDPOINT_MAX - 1) ||
        !text_ok(pr->device_name, 127)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "PeerHello: name (at most %d bytes), device name (127) or data endpoint (%d) too long or "
                           "holds control characters", DB_NAME_MAX, BROKER_ENDPOINT_MAX - 1);
        return;
    }
    double gflops = 0;
    for (size_t i = 0; i < pr->n_speeds; i++)
        if (pr->speeds[i] && isfinite(pr->speeds[i]->gemm_gflops) && pr->speeds[i]->gemm_gflops > gflops &&
            (pr->speeds[i]->dtype == FUSION__DTYPE__DTYPE_F32 || gflops == 0))
            gflops = pr->speeds[i]->gemm_gflops;
    if (!(gflops > 0) || pr->free_memory_bytes == 0) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "PeerHello: the profile must report a GEMM speed above 0 GFLOP/s and free memory above 0 "
                           "(run the peer's benchmark)");
        return;
    }
    if (!h->needs_relay && !(h->data_endpoint && h->data_endpoint[0])) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "PeerHello: give a data_endpoint other stages can connect to, or set needs_relay");
        return;
    }
    broker_peer *p = broker_peer_find(b, key);
    if (p && p->live) { /* a new session of a known peer: whatever it ran is gone */
        drop_work(b, p, "the peer registered again (new session)");
    } else if (!p) {
        if (b->n_peers >= BROKER_MAX_PEERS) { /* reuse the entry of a peer that is gone */
            for (size_t i = 0; i < b->n_peers && !p; i++)
                if (!b->peers[i].live && !b->peers[i].job[0])
                    p = &b->peers[i];
            if (!p) {
                broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY,
                                   "the broker's registry is full (%d live peers); try again later", BROKER_MAX_PEERS);
                return;
            }
            memset(p, 0, sizeof *p);
            snprintf(p->key, sizeof p->key, "%s", key);
        }
    }
    if (!p) {
        if (b->n_peers == b->cap_peers) {
            b->cap_peers = b->cap_peers ? 2 * b->cap_peers : 16;
            b->peers = fu_realloc(b->peers, b->cap_peers * sizeof *b->peers);
        }
        p = &b->peers[b->n_peers++];
        memset(p, 0, sizeof *p);
        snprintf(p->key, sizeof p->key, "%s", key);
    }
    snprintf(p->name, sizeof p->name, "%s", h->name && h->name[0] ? h->name : "peer");
    snprintf(p->device, sizeof p->device, "%s", pr->device_name ? pr->device_name : "");
    snprintf(p->endpoint, sizeof p->endpoint, "%s", h->needs_relay ? "" : h->data_endpoint);
    p->relay = h->needs_relay;
    p->backend = pr->backend;
    p->gflops = gflops;
    p->mem_bytes = pr->free_memory_bytes;
    p->link_measured = isfinite(pr->link_bandwidth_bps) && pr->link_bandwidth_bps > 0 &&
                       pr->link_bandwidth_bps <= BROKER_MAX_LINK_BW;
    p->link_bw = p->link_measured ? pr->link_bandwidth_bps : BROKER_DEFAULT_LINK_BW;
    p->link_latency_ms = isfinite(pr->link_latency_ms) && pr->link_latency_ms >= 0 ? pr->link_latency_ms : 0;
    p->threads = pr->threads;
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    memcpy(p->rid, rid, rl <= sizeof p->rid ? rl : sizeof p->rid);
    p->rid_len = rl <= sizeof p->rid ? rl : sizeof p->rid;
    p->job[0] = '\0';
    p->backup = p->warm = p->draining = false;
    p->last_heard_ms = broker_now();
    p->joined_ms = broker_wall();

    char *pj = profile_json(p);
    bool created = false;
    fu_err rc = db_peer_upsert(b->db, p->key, p->name, pj, DB_PEER_BACKUP, p->joined_ms, &created);
    free(pj);
    if (rc != FU_OK) {
        p->live = false;
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker could not store the registration: %s",
                           fu_strerror(rc));
        return;
    }
    p->live = true;
    db_peer *dp = NULL;
    p->reputation = db_peer_get(b->db, p->key, &dp) == FU_OK ? dp->reputation : DB_REPUTATION_INIT;
    db_peer_free(&dp);
    BROKER_IGNORE(db_event_add(b->db, p->joined_ms, NULL, p->key, "peer-join", p->name));
    FU_INFO(LOG, "peer %.8s (%s) %s: %.1f GFLOP/s, %.2f GiB, %s%s", p->key, p->name,
            created ? "joined" : "re-registered", p->gflops, (double)p->mem_bytes / (1u << 30),
            p->relay ? "relayed" : "endpoint ", p->endpoint);
    Fusion__PeerWelcome w = FUSION__PEER_WELCOME__INIT;
    w.peer_id = p->key;
    w.heartbeat_ms = b->cfg.heartbeat_ms;
    w.dead_after_ms = b->dead_after_ms;
    w.broker_time_ms = broker_wall();
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_PEER_WELCOME, &w.base);
    broker_recover_ready(b);
    b->sched_dirty = true;
}

/* Printable ASCII only (the reason is shown to other users' terminals). */
static bool ascii_ok(const char *s, size_t max)
{
    size_t n = s ? strnlen(s, max + 1) : 0;
    if (n > max)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] >= 0x7f)
            return false;
    return true;
}

/* A heartbeat's PEER_STATE_PAUSED (or its end): kept on p and logged; stored as events at most once
 * per BROKER_PAUSE_EVENT_MS per peer (a peer that toggles cannot make the store commit per beat). The
 * reason is the peer's own text: kept only when it is short printable ASCII. */
static void note_pause(broker_t *b, broker_peer *p, const Fusion__Heartbeat *hb)
{
    bool paused = hb->state == FUSION__PEER_STATE__PEER_STATE_PAUSED;
    uint64_t now = broker_now();
    bool store = !p->pause_event_ms || now - p->pause_event_ms >= BROKER_PAUSE_EVENT_MS;
    if (paused) {
        const char *r = ascii_ok(hb->pause_reason, BROKER_PAUSE_REASON_MAX) && hb->pause_reason[0] ? hb->pause_reason
                                                                                                   : "no reason given";
        if (!p->paused) {
            snprintf(p->pause_reason, sizeof p->pause_reason, "%s", r);
            FU_INFO(LOG, "peer %s (%.8s) paused: %s", p->name, p->key, r);
            if (store) {
                p->pause_event_ms = now;
                BROKER_IGNORE(db_event_add(b->db, broker_wall(), p->job[0] ? p->job : NULL, p->key, "peer-paused", r));
            }
        } else if (strcmp(p->pause_reason, r) != 0) {
            snprintf(p->pause_reason, sizeof p->pause_reason, "%s", r);
            FU_DEBUG(LOG, "peer %s (%.8s) is still paused: %s", p->name, p->key, r);
        }
        if (!p->paused)
            p->paused_since_ms = broker_now();
        p->paused = true;
    } else if (p->paused) {
        char text[64];
        snprintf(text, sizeof text, "after %" PRIu64 " s", (broker_now() - p->paused_since_ms) / 1000);
        FU_INFO(LOG, "peer %s (%.8s) resumed %s", p->name, p->key, text);
        if (store) {
            p->pause_event_ms = now;
            BROKER_IGNORE(db_event_add(b->db, broker_wall(), p->job[0] ? p->job : NULL, p->key, "peer-resumed", text));
        }
        p->paused = false;
        p->pause_reason[0] = '\0';
        b->sched_dirty = true; /* it may take work again */
    }
}

void broker_on_heartbeat(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__Heartbeat *hb = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_HEARTBEAT);
    if (hb && hb->free_memory_bytes)
        p->mem_bytes = hb->free_memory_bytes;
    /* Where its stage is, for the step deadline (only a running stage's report counts). */
    if (hb && hb->step && p->job[0] && !p->backup) {
        snprintf(p->prog_job, sizeof p->prog_job, "%s", p->job);
        p->prog_step = hb->step;
        p->prog_fwd = hb->forward_done;
        p->prog_bwd = hb->backward_done;
        p->prog_ms = broker_now();
    }
    if (hb)
        note_pause(b, p, hb);
    /* The link as measured by the peer's LinkProbe: the scheduler's next plans use it. */
    if (hb && isfinite(hb->link_bandwidth_bps) && hb->link_bandwidth_bps > 0 &&
        hb->link_bandwidth_bps <= BROKER_MAX_LINK_BW && hb->link_bandwidth_bps != p->link_bw) {
        if (!p->link_measured)
            FU_INFO(LOG, "peer %s (%.8s): link measured at %.1f MB/s", p->name, p->key,
                    hb->link_bandwidth_bps / 1e6);
        p->link_bw = hb->link_bandwidth_bps;
        p->link_measured = true;
    }
    int64_t now = broker_wall();
    if (p->job[0] && !p->backup) {
        fu_err rc = db_stage_lease_extend(b->db, p->job, p->stage, p->key,
                                          now + (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms, now);
        if (rc != FU_OK && rc != FU_EPERM)
            FU_DEBUG(LOG, "lease of %s stage %u for %.8s not extended: %s", p->job, p->stage, p->key,
                     fu_strerror(rc));
    }
    Fusion__Heartbeat r = FUSION__HEARTBEAT__INIT;
    r.time_ms = now;
    r.state = !p->job[0] ? FUSION__PEER_STATE__PEER_STATE_IDLE
              : p->backup ? (p->warm ? FUSION__PEER_STATE__PEER_STATE_WARM : FUSION__PEER_STATE__PEER_STATE_IDLE)
                          : FUSION__PEER_STATE__PEER_STATE_BUSY;
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

void broker_registry_sweep(broker_t *b)
{
    uint64_t now = broker_now();
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (p->live && now - p->last_heard_ms > b->dead_after_ms) {
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
    if (db_stage_expired(b->db, broker_wall(), &st, &n) != FU_OK)
        return;
    for (size_t k = 0; k < n; k++) {
        broker_job *j = broker_job_find(b, st[k].job);
        if (!j || j->dead || j->phase == BJ_RECOVER_WAIT || st[k].index >= j->n_stages)
            continue;
        if (strcmp(j->stages[st[k].index].peer, st[k].peer) != 0)
            continue;
        broker_peer *p = broker_peer_find(b, st[k].peer);
        if (p && p->job[0] && strcmp(p->job, j->id) == 0) {
            p->job[0] = '\0';
            p->backup = false;
        }
        broker_failover(b, j, st[k].index, "its lease ran out");
    }
    db_stage_array_free(&st, n);
}

void broker_on_peer_list(broker_t *b, const wire_msg_t *msg)
{
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
        profs[i].link_bandwidth_bps = p->link_bw;
        profs[i].link_latency_ms = p->link_latency_ms;
        profs[i].threads = p->threads;
        double rep = infos[i].reputation;
        fusion__peer_info__init(&infos[i]);
        infos[i].reputation = rep;
        infos[i].peer_id = p->key;
        infos[i].name = p->name;
        infos[i].profile = &profs[i];
        infos[i].state = !p->live        ? FUSION__PEER_STATE__PEER_STATE_DEAD
                         : p->draining   ? FUSION__PEER_STATE__PEER_STATE_DRAINING
                         : p->paused     ? FUSION__PEER_STATE__PEER_STATE_PAUSED
                         : !p->job[0]    ? FUSION__PEER_STATE__PEER_STATE_IDLE
                         : p->backup     ? (p->warm ? FUSION__PEER_STATE__PEER_STATE_WARM
                                                    : FUSION__PEER_STATE__PEER_STATE_IDLE)
                                         : FUSION__PEER_STATE__PEER_STATE_BUSY;
        infos[i].job_id = p->job[0] ? strtoull(p->job, NULL, 16) : 0;
        infos[i].stage_index = p->stage;
        infos[i].last_seen_ms = wall - (int64_t)(now - p->last_heard_ms);
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
