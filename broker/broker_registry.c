/* broker_registry: the owner of the broker's peers: the table, what a peer is believed to be (its
 * checked profile, its link, its pause, its reputation), what it works on, and their persistence.
 * broker_peers.c turns messages into calls here; nothing here decides about jobs. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_log.h"

#define LOG "registry"
#define BROKER_DEFAULT_LINK_BW 1e9  /* bytes/s assumed when a peer did not measure its link */
#define BROKER_MAX_LINK_BW     1e12 /* bytes/s above which a reported link is not believed */

/* ---- the index of the table by key: every message names its peer, so finding it must not cost a
 * scan of every peer (docs/SCALE.md). Open addressing with linear probing over FNV-1a of the key;
 * entries are never deleted one by one: an entry of the table that changes key (a gone peer's,
 * reused when the table is full) rebuilds the index. */

static uint64_t key_hash(const char *key)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *c = (const unsigned char *)key; *c; c++)
        h = (h ^ *c) * 0x100000001b3ull;
    return h;
}

static void index_put(broker_t *b, size_t i)
{
    size_t mask = b->peer_index_cap - 1;
    for (size_t at = (size_t)key_hash(b->peers[i].key) & mask;; at = (at + 1) & mask)
        if (!b->peer_index[at]) {
            b->peer_index[at] = (uint32_t)(i + 1);
            return;
        }
}

/* Makes the index again for the n_peers entries, at least twice as large as they are many. */
static void index_rebuild(broker_t *b)
{
    size_t cap = 64;
    while (cap < 2 * b->n_peers)
        cap *= 2;
    if (cap != b->peer_index_cap) {
        free(b->peer_index);
        b->peer_index = fu_calloc(cap, sizeof *b->peer_index);
        b->peer_index_cap = cap;
    } else {
        memset(b->peer_index, 0, cap * sizeof *b->peer_index);
    }
    for (size_t i = 0; i < b->n_peers; i++)
        index_put(b, i);
}

broker_peer *broker_peer_find(broker_t *b, const char *key)
{
    if (!key || !b->peer_index_cap)
        return NULL;
    size_t mask = b->peer_index_cap - 1;
    for (size_t at = (size_t)key_hash(key) & mask; b->peer_index[at]; at = (at + 1) & mask) {
        broker_peer *p = &b->peers[b->peer_index[at] - 1];
        if (strcmp(p->key, key) == 0)
            return p;
    }
    return NULL;
}

void broker_peer_id(const char *pk, uint32_t slot, char out[DB_KEY_LEN + 1])
{
    uint8_t raw[WIRE_KEY_BYTES], h[WIRE_KEY_BYTES], le[4] = {(uint8_t)slot, (uint8_t)(slot >> 8),
                                                            (uint8_t)(slot >> 16), (uint8_t)(slot >> 24)};
    if (slot == 0 || wire_key_from_z85(pk, raw) != FU_OK) {
        snprintf(out, DB_KEY_LEN + 1, "%s", pk);
        return;
    }
    static const char tag[] = "fusion slot";
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, sizeof h);
    crypto_generichash_update(&st, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&st, raw, sizeof raw);
    crypto_generichash_update(&st, le, sizeof le);
    crypto_generichash_final(&st, h, sizeof h);
    wire_key_to_z85(h, out);
}

bool broker_msg_peer_id(const wire_msg_t *msg, char out[DB_KEY_LEN + 1])
{
    const char *uid = wire_msg_user_id(msg);
    uint32_t slot = wire_msg_hdr(msg)->slot;
    if (!db_key_valid(uid) || slot >= BROKER_MAX_SLOTS)
        return false;
    broker_peer_id(uid, slot, out);
    return true;
}

bool broker_peer_same_key(const broker_peer *a, const broker_peer *b)
{
    return a && b && strcmp(a->pk, b->pk) == 0;
}

static void reputation_adjust_one(broker_t *b, broker_peer *p, double delta)
{
    double rep = p->reputation;
    if (db_peer_reputation_adjust(b->db, p->key, delta, broker_wall(), &rep) == FU_OK)
        p->reputation = rep;
    else /* the store failed (logged): the loop still acts on the change */
        p->reputation = fmin(1, fmax(0, p->reputation + delta));
}

/* s (NULL counts as "") is at most max bytes and holds no control characters; with ascii_only, only
 * printable ASCII (a pause reason is shown to other users' terminals). */
static bool text_ok(const char *s, size_t max, bool ascii_only)
{
    size_t n = s ? strnlen(s, max + 1) : 0;
    if (n > max)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f || (ascii_only && c > 0x7f))
            return false;
    }
    return true;
}

static char *profile_json(const broker_peer *p)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "gflops_f32", p->gflops);
    cJSON_AddNumberToObject(o, "gflops_claimed", p->claimed_gflops);
    cJSON_AddNumberToObject(o, "gflops_verified", p->verified_gflops);
    char session[17];
    snprintf(session, sizeof session, "%016" PRIx64, p->session);
    cJSON_AddStringToObject(o, "session", session);
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

/* The best f32 (else any) GEMM speed a profile reports, 0 when none is believable. */
static double profile_gflops(const Fusion__PeerProfile *pr)
{
    double gflops = 0;
    for (size_t i = 0; i < pr->n_speeds; i++)
        if (pr->speeds[i] && isfinite(pr->speeds[i]->gemm_gflops) && pr->speeds[i]->gemm_gflops > gflops &&
            (pr->speeds[i]->dtype == FUSION__DTYPE__DTYPE_F32 || gflops == 0))
            gflops = pr->speeds[i]->gemm_gflops;
    return gflops;
}

fu_err broker_peer_hello_check(const Fusion__PeerHello *h, fu_errmsg *em)
{
    const Fusion__PeerProfile *pr = h ? h->profile : NULL;
    if (!h || !pr)
        return fu_errmsg_set(em, FU_EINVAL, "PeerHello needs a profile (measured speed and memory)");
    if (!text_ok(h->name, DB_NAME_MAX, false) || !text_ok(h->data_endpoint, BROKER_ENDPOINT_MAX - 1, false) ||
        !text_ok(pr->device_name, 127, false) || !text_ok(pr->numeric_class, BROKER_NUMERIC_CLASS_MAX, false))
        return fu_errmsg_set(em, FU_EINVAL,
                             "PeerHello: name (at most %d bytes), device name (127), numeric class (%d) or data endpoint "
                             "(%d) too long or holds control characters", DB_NAME_MAX, BROKER_NUMERIC_CLASS_MAX,
                             BROKER_ENDPOINT_MAX - 1);
    if (!(profile_gflops(pr) > 0) || pr->free_memory_bytes == 0)
        return fu_errmsg_set(em, FU_EINVAL,
                             "PeerHello: the profile must report a GEMM speed above 0 GFLOP/s and free memory above 0 "
                             "(run the peer's benchmark)");
    if (profile_gflops(pr) > BROKER_MAX_PEER_GFLOPS || pr->free_memory_bytes > BROKER_MAX_PEER_MEMORY)
        return fu_errmsg_set(em, FU_EINVAL,
                             "PeerHello: %.3g GFLOP/s and %.3g GiB are not believable for one peer (at most %.0f GFLOP/s "
                             "and %.0f GiB)", profile_gflops(pr), (double)pr->free_memory_bytes / (1ull << 30),
                             BROKER_MAX_PEER_GFLOPS, (double)BROKER_MAX_PEER_MEMORY / (1ull << 30));
    if (!h->needs_relay && !(h->data_endpoint && h->data_endpoint[0]))
        return fu_errmsg_set(em, FU_EINVAL,
                             "PeerHello: give a data_endpoint other stages can connect to, or set needs_relay");
    return FU_OK;
}

/* The table entry for key: its own, a gone peer's when the table is full, or a new one; NULL when
 * the table is full of live peers. */
static broker_peer *slot_for(broker_t *b, const char *key)
{
    broker_peer *p = broker_peer_find(b, key);
    if (p)
        return p;
    bool reused = false;
    if (b->n_peers >= BROKER_MAX_PEERS) { /* reuse the entry of a peer that is gone */
        for (size_t i = 0; i < b->n_peers && !p; i++)
            if (!b->peers[i].live && !b->peers[i].job[0])
                p = &b->peers[i];
        if (!p)
            return NULL;
        reused = true;
    } else {
        if (b->n_peers == b->cap_peers) {
            b->cap_peers = b->cap_peers ? 2 * b->cap_peers : 16;
            b->peers = fu_realloc(b->peers, b->cap_peers * sizeof *b->peers);
        }
        p = &b->peers[b->n_peers++];
    }
    memset(p, 0, sizeof *p);
    snprintf(p->key, sizeof p->key, "%s", key);
    if (reused || b->peer_index_cap < 2 * b->n_peers)
        index_rebuild(b); /* the old key's entry goes, or the index grows */
    else
        index_put(b, (size_t)(p - b->peers));
    return p;
}

/* The verified speed the store keeps for key's registration of `session` (a broker restart meets the
 * same peer process again), 0 when none. */
static double remembered_gflops(broker_t *b, const char *key, uint64_t session)
{
    db_peer *dp = NULL;
    double v = 0;
    if (!session || db_peer_get(b->db, key, &dp) != FU_OK)
        return 0;
    cJSON *o = dp->profile ? cJSON_Parse(dp->profile) : NULL;
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "session");
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(o, "gflops_verified");
    char want[17];
    snprintf(want, sizeof want, "%016" PRIx64, session);
    if (cJSON_IsString(s) && strcmp(s->valuestring, want) == 0 && cJSON_IsNumber(g) && isfinite(g->valuedouble) &&
        g->valuedouble > 0 && g->valuedouble <= BROKER_MAX_PEER_GFLOPS)
        v = g->valuedouble;
    cJSON_Delete(o);
    db_peer_free(&dp);
    return v;
}

void broker_peer_store_profile(broker_t *b, const broker_peer *p)
{
    char *pj = profile_json(p);
    fu_err rc = db_peer_set_profile(b->db, p->key, pj);
    if (rc != FU_OK)
        FU_WARN(LOG, "could not store the profile of peer %.8s: %s", p->key, fu_strerror(rc));
    free(pj);
}

fu_err broker_peer_admit(broker_t *b, const char *pk, uint32_t slot, const Fusion__PeerHello *h, const uint8_t *rid,
                         size_t rl, broker_peer **out, fu_errmsg *em)
{
    const Fusion__PeerProfile *pr = h->profile;
    char key[DB_KEY_LEN + 1];
    broker_peer_id(pk, slot, key);
    broker_peer *p = slot_for(b, key);
    if (!p)
        return fu_errmsg_set(em, FU_EAGAIN, "the broker's registry is full (%d live peers); try again later",
                             BROKER_MAX_PEERS);
    snprintf(p->pk, sizeof p->pk, "%s", pk);
    p->slot = slot;
    p->n_slots = h->slots > 1 && h->slots <= BROKER_MAX_SLOTS ? h->slots : 1;
    if (p->n_slots <= slot)
        p->n_slots = slot + 1;
    snprintf(p->name, sizeof p->name, "%s", h->name && h->name[0] ? h->name : "peer");
    snprintf(p->device, sizeof p->device, "%s", pr->device_name ? pr->device_name : "");
    snprintf(p->numeric_class, sizeof p->numeric_class, "%s", pr->numeric_class ? pr->numeric_class : "");
    memset(p->class_id, 0, sizeof p->class_id);
    if (p->numeric_class[0])
        crypto_generichash(p->class_id, sizeof p->class_id, (const uint8_t *)p->numeric_class,
                           strlen(p->numeric_class), NULL, 0);
    snprintf(p->endpoint, sizeof p->endpoint, "%s", h->needs_relay ? "" : h->data_endpoint);
    p->relay = h->needs_relay;
    p->backend = pr->backend;
    p->claimed_gflops = p->gflops = profile_gflops(pr);
    p->verified_gflops = remembered_gflops(b, key, h->session);
    p->ch = BCH_NONE;
    p->ch_retry_ms = 0;
    p->mem_bytes = pr->free_memory_bytes;
    p->link_measured = isfinite(pr->link_bandwidth_bps) && pr->link_bandwidth_bps > 0 &&
                       pr->link_bandwidth_bps <= BROKER_MAX_LINK_BW;
    p->link_bw = p->link_measured ? pr->link_bandwidth_bps : BROKER_DEFAULT_LINK_BW;
    p->link_latency_ms = isfinite(pr->link_latency_ms) && pr->link_latency_ms >= 0 ? pr->link_latency_ms : 0;
    p->threads = pr->threads;
    p->rid_len = rl <= sizeof p->rid ? rl : sizeof p->rid;
    memcpy(p->rid, rid, p->rid_len);
    p->session = h->session;
    p->trusted = (wire_zap_roles(b->zap, pk) & WIRE_ROLE_TRUSTED) != 0;
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
        return fu_errmsg_set(em, rc, "the broker could not store the registration: %s", fu_strerror(rc));
    }
    p->live = true;
    db_peer *dp = NULL;
    p->reputation = db_peer_get(b->db, p->key, &dp) == FU_OK ? dp->reputation : DB_REPUTATION_INIT;
    db_peer_free(&dp);
    for (size_t i = 0; i < b->n_peers; i++) /* a new slot starts no better than its key's others */
        if (&b->peers[i] != p && broker_peer_same_key(&b->peers[i], p) && b->peers[i].reputation < p->reputation)
            reputation_adjust_one(b, p, b->peers[i].reputation - p->reputation);
    /* db_peer_upsert stored the peer-join (or peer-rejoin) event with the registration: one commit */
    FU_INFO(LOG, "peer %.8s (%s) %s: %.1f GFLOP/s, %.2f GiB, %s%s", p->key, p->name,
            created ? "joined" : "re-registered", p->gflops, (double)p->mem_bytes / (1u << 30),
            p->relay ? "relayed" : "endpoint ", p->endpoint);
    *out = p;
    return FU_OK;
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
        const char *r = text_ok(hb->pause_reason, BROKER_PAUSE_REASON_MAX, true) && hb->pause_reason[0] ? hb->pause_reason
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

void broker_peer_heartbeat(broker_t *b, broker_peer *p, const Fusion__Heartbeat *hb)
{
    if (hb->free_memory_bytes)
        p->mem_bytes = hb->free_memory_bytes;
    /* Where its stage is, for the step deadline (only a running stage's report counts). */
    if (hb->step && p->job[0] && !p->backup) {
        snprintf(p->prog_job, sizeof p->prog_job, "%s", p->job);
        p->prog_step = hb->step;
        p->prog_fwd = hb->forward_done;
        p->prog_bwd = hb->backward_done;
        p->prog_ms = broker_now();
    }
    note_pause(b, p, hb);
    /* The link as measured by the peer's LinkProbe: the scheduler's next plans use it. */
    if (isfinite(hb->link_bandwidth_bps) && hb->link_bandwidth_bps > 0 &&
        hb->link_bandwidth_bps <= BROKER_MAX_LINK_BW && hb->link_bandwidth_bps != p->link_bw) {
        if (!p->link_measured)
            FU_INFO(LOG, "peer %s (%.8s): link measured at %.1f MB/s", p->name, p->key,
                    hb->link_bandwidth_bps / 1e6);
        p->link_bw = hb->link_bandwidth_bps;
        p->link_measured = true;
    }
    if (p->job[0] && !p->backup) { /* its lease is extended at the next sweep (broker_peer_leases_flush) */
        p->lease_due = true;
        b->leases_due = true;
    }
}

void broker_peer_leases_flush(broker_t *b)
{
    if (!b->leases_due)
        return;
    b->leases_due = false;
    size_t n = 0;
    for (size_t i = 0; i < b->n_peers; i++)
        n += b->peers[i].lease_due;
    db_lease *ls = fu_calloc(n ? n : 1, sizeof *ls);
    int64_t now = broker_wall();
    size_t k = 0;
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (!p->lease_due)
            continue;
        p->lease_due = false;
        if (p->live && p->job[0] && !p->backup)
            ls[k++] = (db_lease){.job = p->job, .index = p->stage, .peer = p->key,
                                 .deadline_ms = now + (int64_t)BROKER_LEASE_FACTOR * b->cfg.heartbeat_ms};
    }
    fu_err rc = db_stage_leases_extend(b->db, ls, k, now);
    if (rc != FU_OK)
        FU_WARN(LOG, "%zu stage leases not extended: %s", k, fu_strerror(rc));
    for (size_t i = 0; rc == FU_OK && i < k; i++)
        if (ls[i].result != FU_OK && ls[i].result != FU_EPERM)
            FU_DEBUG(LOG, "lease of %s stage %u for %.8s not extended: %s", ls[i].job, ls[i].index, ls[i].peer,
                     fu_strerror(ls[i].result));
    free(ls);
}

Fusion__PeerState broker_peer_wire_state(const broker_peer *p)
{
    if (!p->job[0])
        return FUSION__PEER_STATE__PEER_STATE_IDLE;
    if (p->backup)
        return p->warm ? FUSION__PEER_STATE__PEER_STATE_WARM : FUSION__PEER_STATE__PEER_STATE_IDLE;
    return FUSION__PEER_STATE__PEER_STATE_BUSY;
}

void broker_peer_set_gone(broker_t *b, broker_peer *p, bool left, const char *job, const char *why)
{
    int64_t now = broker_wall();
    FU_INFO(LOG, "peer %.8s (%s) %s: %s", p->key, p->name, left ? "left" : "is dead", why);
    fu_err rc = db_peer_gone(b->db, p->key, left, now, job && job[0] ? job : NULL, why); /* one commit, one event */
    if (rc != FU_OK)
        FU_WARN(LOG, "could not store the state of peer %.8s: %s", p->key, fu_strerror(rc));
    broker_peer_forget_work(p);
    p->live = false;
    p->draining = false;
    b->sched_dirty = true;
}

bool broker_peer_trusted(const broker_t *b, const broker_peer *p)
{
    return p->live && !p->draining && p->ch == BCH_PASSED &&
           p->reputation >= b->cfg.min_reputation - BROKER_REPUTATION_EPS;
}

void broker_peer_take(broker_t *b, broker_peer *p, const broker_job *j, uint32_t stage, bool backup)
{
    snprintf(p->job, sizeof p->job, "%s", j->id);
    p->stage = stage;
    p->backup = backup;
    p->warm = false;
    BROKER_IGNORE(db_peer_set_state(b->db, p->key, backup ? DB_PEER_BACKUP : DB_PEER_ACTIVE, broker_wall()));
}

void broker_peer_forget_work(broker_peer *p)
{
    p->job[0] = '\0';
    p->backup = p->warm = false;
}

void broker_peer_release(broker_t *b, broker_job *j, broker_peer *p, const char *reason)
{
    if (p->live) {
        Fusion__StageRelease r = FUSION__STAGE_RELEASE__INIT;
        r.job_id = j->id64;
        r.stage_index = p->stage;
        r.reason = (char *)reason;
        (void)broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, j->id64, &r.base);
        BROKER_IGNORE(db_peer_set_state(b->db, p->key, DB_PEER_BACKUP, broker_wall()));
    }
    broker_peer_forget_work(p);
    b->sched_dirty = true;
}

/* A loss of reputation is the key's: every slot of the peer process loses it (one owner, one
 * machine); a gain is the slot's own. */
void broker_peer_reputation_adjust(broker_t *b, broker_peer *p, double delta)
{
    reputation_adjust_one(b, p, delta);
    for (size_t i = 0; delta < 0 && i < b->n_peers; i++)
        if (&b->peers[i] != p && broker_peer_same_key(&b->peers[i], p))
            reputation_adjust_one(b, &b->peers[i], delta);
}

bool broker_peer_free(const broker_t *b, const broker_peer *p)
{
    return broker_peer_trusted(b, p) && !p->job[0] && !p->paused;
}

bool broker_peer_reserved(const broker_t *b, const broker_peer *p)
{
    for (size_t i = 0; i < b->n_jobs; i++) {
        const broker_job *j = b->jobs[i];
        if (j->dead || j->phase != BJ_RECOVER_WAIT)
            continue;
        for (uint32_t s = 0; s < j->n_stages; s++)
            if (strcmp(j->stages[s].peer, p->key) == 0)
                return true;
    }
    return false;
}

bool broker_peer_idle(const broker_t *b, const broker_peer *p)
{
    return broker_peer_free(b, p) && !broker_peer_reserved(b, p);
}
