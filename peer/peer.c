/* peer: the I/O thread of fusion-peer (see peer.h): broker session, heartbeats, sealed data links,
 * relaying, backpressure towards the compute thread, and the graceful leave. */
#include "peer.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>
#include <zmq.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "kern_backend.h"
#include "peer_cache.h"
#include "peer_internal.h"
#include "peer_profile.h"
#include "peer_verify.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_seal.h"
#include "wire_socket.h"
#include "wire_tensor.h"

#define IO_POLL_MS        100   /* longest poll: signals and timers are checked at least this often */
#define IO_MONITOR_EP     "inproc://fusion-peer-monitor"
#define IO_CONNECT_WAIT_MS 5000 /* how long the start waits for the broker's handshake */
#define IO_ENROL_WAIT_MS  10000
#define IO_MAX_TENSOR     ((size_t)1 << 31) /* largest activation/gradient accepted */
#define PEER_PROBE_BYTES  (4u << 20) /* LinkProbe payload asked for after joining */
#define PEER_SEND_WAIT_MS 60000u    /* longest one chunk of a tensor waits for room at a neighbour */
#define PEER_HELD         16        /* data-plane messages held while a send waits */
#define PEER_PROBE_EVERY_MS 600000u  /* a rejoin measures the link again after this long */

enum { LINK_UP_IDX = 0, LINK_DOWN_IDX = 1 };
enum { SRC_ROUTER = 0, SRC_DOWN = 1, SRC_RELAY = 2, SRC_COUNT };

typedef struct {
    bool active;                   /* part of the current assignment */
    bool up;                       /* sealed both ways */
    bool relay;                    /* frames go through the broker */
    uint8_t pk[WIRE_KEY_BYTES];    /* the neighbour's long-term key, as the broker introduced it */
    char pk_z85[WIRE_KEY_Z85_LEN + 1];
    char endpoint[256];            /* where to connect (downstream, direct) */
    uint32_t stage_index;          /* the neighbour's stage */
    wire_seal_eph_t *eph;          /* our pending ephemeral pair (an opening of ours awaits its reply) */
    bool hello_sent;               /* our opening SealHello with eph went out */
    uint64_t open_seq;             /* Envelope.sequence of that opening (the reply echoes it) */
    wire_seal_t *seal;             /* the session, once up */
    uint8_t rid[WIRE_MAX_ROUTING_ID]; /* upstream over our ROUTER: its routing id */
    size_t rid_len;
    wire_tensor_asm_t *asm_;       /* incoming tensors of this link */
} link_t;

struct peer {
    peer_cfg cfg;                  /* strings borrowed from the caller (main's argv) */
    char *cache_dir;               /* resolved cache directory */
    uint64_t cache_max_bytes;      /* --cache-max-gb in bytes (0: no limit) */
    char name[128];                /* resolved peer name */
    void *ctx;                     /* ZeroMQ context */
    wire_keypair_t *kp;            /* our long-term key pair */
    uint8_t broker_pk[WIRE_KEY_BYTES];
    const kern_backend_t *be;
    peer_profile prof;
    char prof_line[512];
    void *broker;                  /* DEALER, CURVE client */
    void *router;                  /* data-plane ROUTER, or NULL (--no-listen) */
    void *down;                    /* DEALER to the downstream stage, or NULL */
    void *pipe;                    /* PAIR to the compute thread */
    void *mon;                     /* monitor of the broker socket while starting */
    char data_endpoint[256];       /* advertised in PeerHello; "" with --no-listen */
    pthread_t compute;
    bool compute_started;
    peer_shared shared;            /* compute -> io state */
    peer_compute_cfg ccfg;

    bool welcomed;                 /* PeerWelcome seen since the last PeerHello */
    uint32_t hb_ms, dead_ms;       /* from PeerWelcome */
    uint64_t last_broker_ms;       /* last message from the broker */
    uint64_t last_hb_ms;           /* last Heartbeat sent */
    uint64_t hello_ms;             /* last PeerHello sent */
    uint64_t probe_t0_ns;          /* LinkProbeRequest in flight since (0: none) */
    uint64_t probe_done_ms;        /* last LinkProbe answered or refused (0: never) */
    uint64_t seq;                  /* envelope sequence towards the broker */

    link_t links[2];               /* upstream, downstream */
    uint64_t job_id;               /* the assignment's job (0: none) */
    uint64_t gen;                  /* number of the current assignment (links_open) */
    uint64_t open_counter;         /* numbers our SealHello openings */
    uint32_t stage_index;
    bool ready_pending;            /* compute is loaded; StageReady once the links are up */
    uint64_t assign_ms;            /* when the links were asked to open */
    wire_msg_t *early[SRC_COUNT];  /* SealHellos that came before their assignment */
    uint8_t early_rid[WIRE_MAX_ROUTING_ID];
    size_t early_rid_len;

    peer_cmd *stash[PEER_STASH];   /* for the compute thread, when its pipe is full */
    size_t stash_head, stash_n;
    wire_counters counters;        /* data and control messages refused */
    peer_vin_asm_t *vin;           /* verification inputs delivered to this peer (as a verifier) */
    bool leaving;                  /* Leave sent */
    uint64_t leave_ms;
    bool fatal;                    /* the compute thread failed */
    fu_err fatal_err;

    wire_msg_t *held[PEER_HELD];   /* read while a send waited and not a tensor chunk (a SealHello):
                                      handled by the loop next */
    int held_src[PEER_HELD];
    size_t n_held;
    bool send_waited;              /* the last tensor send found a full queue */
    peer_guest_t *guest;           /* priority, duty cycle, pauses */
    unsigned pause_mask;           /* the pause last reported (PEER_PAUSE_*) */
    char pause_text[200];          /* its reason, for heartbeats */
};

static volatile sig_atomic_t g_stop = 0;
static volatile sig_atomic_t g_pause_req = 0; /* 1: the owner pauses, 2: resumes (taken by the loop) */

void peer_request_stop(void)
{
    g_stop = 1;
}

void peer_request_pause(bool on)
{
    g_pause_req = on ? 1 : 2;
}

const char *peer_profile_line(const peer_t *p)
{
    return p ? p->prof_line : "";
}

/* ---- small helpers ------------------------------------------------------------------------- */

static void free_cb(void *data, void *hint)
{
    (void)hint;
    free(data);
}

static fu_err to_broker(peer_t *p, Fusion__MsgType type, uint64_t job, uint64_t step, uint32_t stage,
                        const ProtobufCMessage *body)
{
    wire_hdr h = {.type = type, .job_id = job, .step = step, .stage = stage, .sequence = ++p->seq};
    fu_err rc = wire_send(p->broker, NULL, 0, &h, body);
    if (rc != FU_OK)
        FU_WARN("peer", "cannot send %s to the broker: %s", wire_type_name(type), fu_strerror(rc));
    return rc;
}

static void link_reset(link_t *l)
{
    wire_seal_eph_destroy(&l->eph);
    wire_seal_destroy(&l->seal);
    wire_tensor_asm_destroy(&l->asm_);
    memset(l, 0, sizeof *l);
}

static void links_close(peer_t *p)
{
    link_reset(&p->links[0]);
    link_reset(&p->links[1]);
    wire_socket_close(&p->down);
    p->ready_pending = false;
    p->job_id = 0;
}

/* Largest activation/gradient a neighbour may send: what this peer offers, at most IO_MAX_TENSOR. */
static size_t max_tensor(const peer_t *p)
{
    uint64_t m = p->prof.free_memory_bytes / 2;
    return m && m < IO_MAX_TENSOR ? (size_t)m : IO_MAX_TENSOR;
}

/* Hands a command to the compute thread, or holds it in the stash (bounded: callers stop reading
 * input when the stash is nearly full). */
static void deliver(peer_t *p, peer_cmd *c)
{
    if (p->stash_n == 0 && peer_cmd_send(p->pipe, &c, ZMQ_DONTWAIT) == FU_OK)
        return;
    if (p->stash_n == PEER_STASH) {
        FU_ERROR("peer", "compute queue full: dropping a message (this is a bug: input should have paused)");
        peer_cmd_destroy(&c);
        return;
    }
    p->stash[(p->stash_head + p->stash_n) % PEER_STASH] = c;
    p->stash_n++;
}

static void flush_stash(peer_t *p)
{
    while (p->stash_n) {
        peer_cmd **c = &p->stash[p->stash_head];
        if (peer_cmd_send(p->pipe, c, ZMQ_DONTWAIT) != FU_OK)
            return;
        p->stash_head = (p->stash_head + 1) % PEER_STASH;
        p->stash_n--;
    }
}

static bool input_paused(const peer_t *p)
{
    return p->stash_n + 2 > PEER_STASH;
}

/* ---- broker session ------------------------------------------------------------------------ */

static void send_hello(peer_t *p)
{
    Fusion__DtypeSpeed sp[PEER_PROFILE_MAX_DTYPES], *spp[PEER_PROFILE_MAX_DTYPES];
    for (uint32_t i = 0; i < p->prof.n_speeds; i++) {
        fusion__dtype_speed__init(&sp[i]);
        sp[i].dtype = p->prof.dtypes[i] == KERN_F16    ? FUSION__DTYPE__DTYPE_F16
                      : p->prof.dtypes[i] == KERN_BF16 ? FUSION__DTYPE__DTYPE_BF16
                                                       : FUSION__DTYPE__DTYPE_F32;
        sp[i].gemm_gflops = p->prof.gflops[i];
        spp[i] = &sp[i];
    }
    Fusion__PeerProfile pr = FUSION__PEER_PROFILE__INIT;
    pr.n_speeds = p->prof.n_speeds;
    pr.speeds = spp;
    pr.free_memory_bytes = p->prof.free_memory_bytes;
    pr.backend = p->prof.cuda ? FUSION__BACKEND__BACKEND_CUDA : FUSION__BACKEND__BACKEND_CPU;
    pr.device_name = p->prof.device_name;
    pr.link_bandwidth_bps = p->prof.link_bandwidth_bps;
    pr.link_latency_ms = p->prof.link_latency_ms;
    pr.threads = p->prof.threads;
    Fusion__PeerHello h = FUSION__PEER_HELLO__INIT;
    h.name = p->name;
    h.software = (char *)PEER_SOFTWARE;
    h.profile = &pr;
    h.data_endpoint = p->data_endpoint;
    h.needs_relay = p->router == NULL;
    if (to_broker(p, FUSION__MSG_TYPE__MSG_PEER_HELLO, 0, 0, 0, &h.base) == FU_OK)
        FU_INFO("peer", "PeerHello sent (%s)", p->router ? p->data_endpoint : "relayed");
    p->welcomed = false;
    p->hello_ms = fu_clock_ms();
}

/* A Heartbeat now. on_time: the timer's beat (the schedule moves on); else an extra one (a pause
 * began or ended) that leaves the schedule alone. */
static void send_heartbeat(peer_t *p, bool on_time)
{
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    hb.time_ms = fu_wallclock_ms();
    hb.state = p->leaving      ? FUSION__PEER_STATE__PEER_STATE_DRAINING
               : p->pause_mask ? FUSION__PEER_STATE__PEER_STATE_PAUSED
                               : (Fusion__PeerState)atomic_load(&p->shared.state);
    if (hb.state == FUSION__PEER_STATE__PEER_STATE_PAUSED)
        hb.pause_reason = p->pause_text;
    hb.free_memory_bytes = p->prof.free_memory_bytes;
    hb.link_bandwidth_bps = p->prof.link_bandwidth_bps;
    if (atomic_load(&p->shared.stage_active)) {
        uint64_t pr = atomic_load(&p->shared.progress);
        hb.step = pr >> 32;
        hb.forward_done = (uint32_t)(pr >> 16) & 0xffffu;
        hb.backward_done = (uint32_t)pr & 0xffffu;
    }
    (void)to_broker(p, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, 0, 0, &hb.base);
    if (!on_time)
        return;
    /* Fixed rate: a beat sent late does not push the next ones back (on a loaded machine the
     * lateness of every wake-up used to add up); more than an interval behind, start afresh. */
    uint64_t now = fu_clock_ms();
    p->last_hb_ms = now - p->last_hb_ms < 2 * (uint64_t)p->hb_ms ? p->last_hb_ms + p->hb_ms : now;
}

static void send_leave(peer_t *p, const char *reason)
{
    Fusion__Leave lv = FUSION__LEAVE__INIT;
    lv.reason = (char *)reason;
    if (to_broker(p, FUSION__MSG_TYPE__MSG_LEAVE, 0, 0, 0, &lv.base) == FU_OK)
        FU_INFO("peer", "Leave sent (%s)", reason);
}

/* ---- data links ---------------------------------------------------------------------------- */

/* SealHello handshake. An *opening* (Envelope.step 0, Envelope.sequence = our opening number) carries
 * our pending ephemeral key; a *reply* (Envelope.step 1, Envelope.sequence = the opening it answers)
 * carries the key we derived with. Every opening is answered; a reply is used only when it answers
 * our latest opening; a reply never triggers a message, so two sides never ping-pong. Openings that
 * cross (both sides relayed) are each answered and both sides derive from the same pair. */
static fu_err send_seal_hello(peer_t *p, link_t *l, bool reply, uint64_t seq, const uint8_t eph_pub[WIRE_KEY_BYTES])
{
    Fusion__SealHello h = FUSION__SEAL_HELLO__INIT;
    h.long_term_key.data = (uint8_t *)wire_keypair_public(p->kp);
    h.long_term_key.len = WIRE_KEY_BYTES;
    h.ephemeral_key.data = (uint8_t *)eph_pub;
    h.ephemeral_key.len = WIRE_KEY_BYTES;
    h.job_id = p->job_id;
    h.stage_index = p->stage_index;
    wire_hdr hdr = {.type = FUSION__MSG_TYPE__MSG_SEAL_HELLO, .job_id = p->job_id, .stage = p->stage_index,
                    .step = reply ? 1 : 0, .sequence = seq, .relay_to = l->relay ? l->pk_z85 : NULL};
    fu_err rc;
    if (l->relay)
        rc = wire_send(p->broker, NULL, 0, &hdr, &h.base);
    else if (l == &p->links[LINK_DOWN_IDX])
        rc = wire_send(p->down, NULL, 0, &hdr, &h.base);
    else
        rc = wire_send(p->router, l->rid, l->rid_len, &hdr, &h.base);
    if (rc != FU_OK)
        FU_WARN("peer", "SealHello to stage %u failed: %s", l->stage_index, fu_strerror(rc));
    return rc;
}

/* Sends an opening with a fresh pending ephemeral key. */
static fu_err send_opening(peer_t *p, link_t *l)
{
    wire_seal_eph_destroy(&l->eph);
    if (!(l->eph = wire_seal_eph_new()))
        return FU_ENOMEM;
    l->open_seq = ++p->open_counter;
    fu_err rc = send_seal_hello(p, l, false, l->open_seq, wire_seal_eph_public(l->eph));
    l->hello_sent = rc == FU_OK;
    return rc;
}

static void check_ready(peer_t *p)
{
    if (!p->ready_pending)
        return;
    for (int i = 0; i < 2; i++)
        if (p->links[i].active && !p->links[i].up)
            return;
    if (peer_test_stall_ready()) /* test hook (PEER_STALL_ENV): retried at every heartbeat */
        return;
    Fusion__StageReady r = FUSION__STAGE_READY__INIT;
    r.job_id = p->job_id;
    r.stage_index = p->stage_index;
    if (to_broker(p, FUSION__MSG_TYPE__MSG_STAGE_READY, p->job_id, 0, p->stage_index, &r.base) == FU_OK)
        FU_INFO("peer", "job %016" PRIx64 " stage %u: StageReady", p->job_id, p->stage_index);
    p->ready_pending = false;
}

static void on_seal_hello(peer_t *p, int src, wire_msg_t *m);

/* Opens the links of a new (non-backup) assignment; SealHellos that came early are taken now. */
static void links_open(peer_t *p, const Fusion__StageAssign *a)
{
    /* A sealed upstream link to the same neighbour for the same job (its opening for this
     * assignment came before the assignment did, e.g. after a broker restart) is kept. */
    link_t kept;
    bool keep = false;
    link_t *ou = &p->links[LINK_UP_IDX];
    for (size_t i = 0; i < a->n_neighbours && ou->active && ou->up && !ou->relay && ou->rid_len; i++) {
        const Fusion__Neighbour *nb = a->neighbours[i];
        if (nb->role == FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM && !nb->relay && !a->relay && a->job_id == p->job_id &&
            nb->public_key.len == WIRE_KEY_BYTES && sodium_memcmp(nb->public_key.data, ou->pk, WIRE_KEY_BYTES) == 0) {
            kept = *ou;
            memset(ou, 0, sizeof *ou); /* ownership moves to kept */
            keep = true;
        }
    }
    links_close(p);
    p->gen++;
    p->job_id = a->job_id;
    p->stage_index = a->stage_index;
    p->assign_ms = fu_clock_ms();
    for (size_t i = 0; i < a->n_neighbours && i < 2; i++) {
        const Fusion__Neighbour *nb = a->neighbours[i];
        int idx = nb->role == FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM     ? LINK_UP_IDX
                  : nb->role == FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM ? LINK_DOWN_IDX
                                                                         : -1;
        if (idx < 0 || nb->public_key.len != WIRE_KEY_BYTES || p->links[idx].active) {
            FU_WARN("peer", "StageAssign: ignoring a malformed neighbour");
            continue;
        }
        link_t *l = &p->links[idx];
        if (idx == LINK_UP_IDX && keep) {
            *l = kept;
            keep = false;
            l->stage_index = nb->stage_index;
            FU_INFO("peer", "job %016" PRIx64 ": sealed link to upstream stage %u kept", a->job_id, l->stage_index);
            continue;
        }
        l->active = true;
        memcpy(l->pk, nb->public_key.data, WIRE_KEY_BYTES);
        wire_key_to_z85(l->pk, l->pk_z85);
        l->stage_index = nb->stage_index;
        snprintf(l->endpoint, sizeof l->endpoint, "%s", nb->data_endpoint ? nb->data_endpoint : "");
        l->relay = nb->relay || a->relay || (idx == LINK_UP_IDX && !p->router) ||
                   (idx == LINK_DOWN_IDX && !l->endpoint[0]);
        l->asm_ = wire_tensor_asm_new(max_tensor(p));
        if (idx == LINK_DOWN_IDX && !l->relay) {
            fu_err err;
            p->down = wire_socket_new(p->ctx, ZMQ_DEALER, &err);
            if (!p->down || zmq_connect(p->down, l->endpoint) != 0) {
                FU_ERROR("peer", "cannot connect to the downstream stage at '%s'", l->endpoint);
                wire_socket_close(&p->down);
                continue;
            }
        }
        if ((l->relay || idx == LINK_DOWN_IDX) && send_opening(p, l) == FU_ENOMEM) {
            FU_ERROR("peer", "no secure memory for a link key");
            l->active = false;
            continue;
        }
        FU_INFO("peer", "job %016" PRIx64 ": link to %s stage %u %s%s", a->job_id, idx ? "downstream" : "upstream",
                l->stage_index, l->relay ? "relayed by the broker" : "direct ", l->relay ? "" : l->endpoint);
    }
    if (keep)
        link_reset(&kept); /* the assignment has no such upstream any more */
    for (int s = 0; s < SRC_COUNT; s++) {
        wire_msg_t *m = p->early[s];
        p->early[s] = NULL;
        if (m) {
            if (s == SRC_ROUTER) {
                memcpy(p->links[LINK_UP_IDX].rid, p->early_rid, p->early_rid_len);
                p->links[LINK_UP_IDX].rid_len = p->early_rid_len;
            }
            on_seal_hello(p, s, m); /* takes m */
        }
    }
}

static link_t *link_for(peer_t *p, int src, const wire_msg_t *m)
{
    if (src == SRC_ROUTER)
        return p->links[LINK_UP_IDX].active && !p->links[LINK_UP_IDX].relay ? &p->links[LINK_UP_IDX] : NULL;
    if (src == SRC_DOWN)
        return p->links[LINK_DOWN_IDX].active && !p->links[LINK_DOWN_IDX].relay ? &p->links[LINK_DOWN_IDX] : NULL;
    const char *sender = wire_msg_hdr(m)->sender;
    for (int i = 0; i < 2; i++)
        if (p->links[i].active && p->links[i].relay && sender && strcmp(sender, p->links[i].pk_z85) == 0)
            return &p->links[i];
    return NULL;
}

/* Takes m. */
static void on_seal_hello(peer_t *p, int src, wire_msg_t *m)
{
    const Fusion__SealHello *h = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_SEAL_HELLO);
    if (!h) {
        wire_msg_destroy(&m);
        return;
    }
    link_t *l = link_for(p, src, m);
    if (!l || h->job_id != p->job_id) {
        /* Before our assignment (or between a release and the next): keep the newest per source. */
        wire_msg_destroy(&p->early[src]);
        p->early[src] = m;
        if (src == SRC_ROUTER) {
            size_t n;
            const uint8_t *rid = wire_msg_routing_id(m, &n);
            memcpy(p->early_rid, rid, n);
            p->early_rid_len = n;
        }
        return;
    }
    if (h->long_term_key.len != WIRE_KEY_BYTES || h->ephemeral_key.len != WIRE_KEY_BYTES ||
        sodium_memcmp(h->long_term_key.data, l->pk, WIRE_KEY_BYTES) != 0) {
        FU_WARN("peer", "SealHello from stage %u refused: its key is not the one the broker introduced",
                h->stage_index);
        wire_msg_destroy(&m);
        return;
    }
    if (src == SRC_ROUTER) {
        size_t n;
        const uint8_t *rid = wire_msg_routing_id(m, &n);
        memcpy(l->rid, rid, n);
        l->rid_len = n;
    }
    const wire_hdr *hd = wire_msg_hdr(m);
    bool reply = hd->step == 1;
    uint64_t their_seq = hd->sequence;
    if (reply && !(l->eph && l->hello_sent && their_seq == l->open_seq)) {
        FU_DEBUG("peer", "SealHello reply from stage %u to an opening we no longer wait for: ignored", l->stage_index);
        wire_msg_destroy(&m);
        return;
    }
    if (!reply) {
        /* An opening: answer it, with our pending key when our own opening crossed it, else a new one. */
        if (!(l->eph && l->hello_sent)) {
            wire_seal_eph_destroy(&l->eph);
            if (!(l->eph = wire_seal_eph_new())) {
                wire_msg_destroy(&m);
                return;
            }
        }
        uint8_t pub[WIRE_KEY_BYTES];
        memcpy(pub, wire_seal_eph_public(l->eph), WIRE_KEY_BYTES);
        if (send_seal_hello(p, l, true, their_seq, pub) != FU_OK) {
            wire_msg_destroy(&m);
            return;
        }
    }
    fu_err err = FU_OK;
    wire_seal_destroy(&l->seal);
    l->seal = wire_seal_new(p->kp, l->pk, &l->eph, h->ephemeral_key.data, &err);
    l->hello_sent = false;
    wire_msg_destroy(&m);
    if (!l->seal) {
        FU_WARN("peer", "link to stage %u: cannot derive keys: %s", l->stage_index, fu_strerror(err));
        l->up = false;
        return;
    }
    wire_tensor_asm_destroy(&l->asm_);
    l->asm_ = wire_tensor_asm_new(max_tensor(p));
    l->up = true;
    FU_INFO("peer", "job %016" PRIx64 ": sealed link to stage %u up", p->job_id, l->stage_index);
    check_ready(p);
}

/* A data-plane message (takes m). */
static void on_data(peer_t *p, int src, wire_msg_t *m)
{
    Fusion__MsgType t = wire_msg_type(m);
    if (t == FUSION__MSG_TYPE__MSG_SEAL_HELLO) {
        on_seal_hello(p, src, m); /* takes m */
        return;
    }
    if (t != FUSION__MSG_TYPE__MSG_ACTIVATION && t != FUSION__MSG_TYPE__MSG_GRADIENT) {
        FU_DEBUG("peer", "data plane: %s ignored", wire_type_name(t));
        wire_msg_destroy(&m);
        return;
    }
    link_t *l = link_for(p, src, m);
    /* Activations come from upstream, gradients from downstream. */
    if (!l || !l->up || (t == FUSION__MSG_TYPE__MSG_ACTIVATION) != (l == &p->links[LINK_UP_IDX])) {
        p->counters.dropped_malformed++;
        wire_msg_destroy(&m);
        return;
    }
    bool done = false;
    /* Takes m: a sealed chunk is opened on the assembler's workers while the next one arrives. */
    fu_err rc = wire_tensor_asm_feed_msg(l->asm_, l->seal, &m, &done);
    if (rc != FU_OK) {
        FU_WARN("peer", "%s chunk from stage %u refused: %s", wire_type_name(t), l->stage_index, fu_strerror(rc));
        return;
    }
    if (!done)
        return;
    peer_cmd *c = peer_cmd_new(PEER_CMD_TENSOR);
    if (wire_tensor_asm_take(l->asm_, &c->tensor) != FU_OK) {
        peer_cmd_destroy(&c);
        return;
    }
    deliver(p, c);
}

/* Reads up to 64 data-plane messages from sock (NULL: none) while the compute thread keeps up. With
 * hold, only tensor chunks are handled now; anything else is held for the loop (see send_wait). */
static void read_data(peer_t *p, void *sock, int src, bool hold)
{
    for (int k = 0; sock && k < 64 && !input_paused(p) && !(hold && p->n_held == PEER_HELD); k++) {
        wire_msg_t *m = NULL;
        fu_err rc = wire_recv(sock, WIRE_DONTWAIT, &p->counters, &m);
        if (rc == FU_EAGAIN)
            break;
        if (rc != FU_OK)
            continue;
        Fusion__MsgType t = wire_msg_type(m);
        if (hold && t != FUSION__MSG_TYPE__MSG_ACTIVATION && t != FUSION__MSG_TYPE__MSG_GRADIENT) {
            p->held[p->n_held] = m;
            p->held_src[p->n_held++] = src;
        } else {
            on_data(p, src, m); /* takes m */
        }
    }
}

/* While a tensor waits for room in a neighbour's queue (wire_tensor_send_waiting): heartbeats go
 * out on time (blocking here used to silence them for up to the 10 s send timeout, long enough to
 * be declared dead), and tensor chunks coming the other way are taken, so that two neighbours
 * sending to each other with full queues do not wait on each other. Anything else read meanwhile is
 * held for the loop: it may change the links a send is using. Gives up on stop or a failed compute
 * thread. */
static bool send_wait(void *arg)
{
    peer_t *p = arg;
    p->send_waited = true;
    if (p->welcomed && fu_clock_ms() - p->last_hb_ms >= p->hb_ms)
        send_heartbeat(p, true);
    flush_stash(p);
    read_data(p, p->router, SRC_ROUTER, true);
    read_data(p, p->down, SRC_DOWN, true);
    return !g_stop && !p->fatal;
}

static void handle_held(peer_t *p)
{
    size_t n = p->n_held;
    p->n_held = 0;
    for (size_t i = 0; i < n; i++)
        on_data(p, p->held_src[i], p->held[i]); /* takes it */
}

static void send_tensor(peer_t *p, peer_cmd *c)
{
    link_t *l = &p->links[c->role == FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM ? LINK_DOWN_IDX : LINK_UP_IDX];
    if (!l->active || !l->up || c->job_id != p->job_id || c->gen != p->gen) {
        FU_WARN("peer", "no open link to send %s (%" PRIu64 ", %u): dropped", wire_type_name(c->meta.type),
                c->meta.step, c->meta.micro_batch);
        return;
    }
    void *sock = l->relay ? p->broker : l == &p->links[LINK_DOWN_IDX] ? p->down : p->router;
    c->meta.relay_to = l->relay ? fu_strdup(l->pk_z85) : NULL;
    uint64_t seq = 0;
    wire_send_wait w = {.wait = send_wait, .arg = p, .timeout_ms = PEER_SEND_WAIT_MS};
    p->send_waited = false;
    fu_err rc = wire_tensor_send_waiting(sock, l->relay || l == &p->links[LINK_DOWN_IDX] ? NULL : l->rid,
                                         l->relay || l == &p->links[LINK_DOWN_IDX] ? 0 : l->rid_len, l->seal,
                                         &c->meta, c->data, c->len, 0, &seq, &w);
    if (p->send_waited) /* the broker's messages queued unread meanwhile: not its silence */
        p->last_broker_ms = fu_clock_ms();
    if (rc != FU_OK)
        FU_WARN("peer", "sending %s (%" PRIu64 ", %u) to stage %u failed: %s", wire_type_name(c->meta.type),
                c->meta.step, c->meta.micro_batch, l->stage_index, fu_strerror(rc));
}

/* ---- verification inputs (docs/PROTOCOL.md "Verification inputs") ------------------------- */

/* As the upstream of a stage being verified: seal the output the compute thread handed over to the
 * verifier's key, chunk by chunk, and send the chunks to the broker, which forwards them. */
static void send_verify_input(peer_t *p, const peer_cmd *c)
{
    peer_vin_id id = {.job_id = c->job_id, .stage = c->stage, .step = c->step, .micro_batch = c->micro_batch,
                      .seed = c->seed};
    uint64_t n = peer_vin_chunks(c->len);
    for (uint64_t i = 0; i < n; i++) {
        uint8_t *sealed = NULL;
        size_t sealed_len = 0;
        fu_err rc = peer_vin_seal(&id, c->key, c->data, c->len, i, &sealed, &sealed_len);
        if (rc != FU_OK) {
            FU_WARN("peer", "job %016" PRIx64 ": cannot seal the input of stage %u step %" PRIu64 " mb %u for its "
                    "verifier: %s", c->job_id, c->stage, c->step, c->micro_batch, fu_strerror(rc));
            return;
        }
        Fusion__VerifyInput vi = FUSION__VERIFY_INPUT__INIT;
        vi.job_id = c->job_id;
        vi.stage_index = c->stage;
        vi.step = c->step;
        vi.micro_batch = c->micro_batch;
        vi.seed = c->seed;
        vi.verifier_key.data = (uint8_t *)c->key;
        vi.verifier_key.len = WIRE_KEY_BYTES;
        vi.total_bytes = c->len;
        vi.offset = i * WIRE_VERIFY_INPUT_CHUNK;
        vi.chunk_index = (uint32_t)i;
        vi.chunk_count = (uint32_t)n;
        vi.payload.data = sealed;
        vi.payload.len = sealed_len;
        rc = to_broker(p, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, c->job_id, c->step, c->stage - 1, &vi.base);
        free(sealed);
        if (rc != FU_OK)
            return;
    }
    FU_DEBUG("peer", "job %016" PRIx64 ": input of stage %u step %" PRIu64 " mb %u sent to its verifier (%zu bytes)",
             c->job_id, c->stage, c->step, c->micro_batch, c->len);
}

/* A chunk of a stage input delivered to this peer as a verifier (or the news that none comes),
 * forwarded by the broker: open, assemble, hand the whole input to the compute thread. Takes m. */
static void on_verify_input(peer_t *p, wire_msg_t *m)
{
    const Fusion__VerifyInput *vi = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_VERIFY_INPUT);
    if (!vi || vi->verifier_key.len != WIRE_KEY_BYTES ||
        sodium_memcmp(vi->verifier_key.data, wire_keypair_public(p->kp), WIRE_KEY_BYTES) != 0) {
        FU_WARN("peer", "a verification input sealed for another key: dropped");
        wire_msg_destroy(&m);
        return;
    }
    peer_cmd *c = peer_cmd_new(PEER_CMD_VERIFY_INPUT);
    c->job_id = vi->job_id;
    c->stage = vi->stage_index;
    c->step = vi->step;
    c->micro_batch = vi->micro_batch;
    c->seed = vi->seed;
    if (vi->unavailable && vi->unavailable[0]) {
        c->text = fu_strdup(vi->unavailable);
        wire_msg_destroy(&m);
        deliver(p, c);
        return;
    }
    bool done = false;
    char why[256] = "";
    fu_err rc = peer_vin_asm_feed(p->vin, vi, wire_keypair_public(p->kp), wire_keypair_secret(p->kp), &done, why,
                                  sizeof why);
    wire_msg_destroy(&m);
    if (rc != FU_OK) {
        FU_WARN("peer", "job %016" PRIx64 ": verification input of stage %u step %" PRIu64 " mb %u refused: %s",
                c->job_id, c->stage, c->step, c->micro_batch, why);
        peer_cmd_destroy(&c);
        return;
    }
    peer_vin_id id;
    if (!done || peer_vin_asm_take(p->vin, &id, &c->data, &c->len) != FU_OK) {
        peer_cmd_destroy(&c);
        return;
    }
    deliver(p, c);
}

/* ---- messages from the broker and the compute thread --------------------------------------- */

static void on_broker(peer_t *p, wire_msg_t *m)
{
    p->last_broker_ms = fu_clock_ms();
    Fusion__MsgType t = wire_msg_type(m);
    const wire_hdr *h = wire_msg_hdr(m);
    if (h->sender && *h->sender && (t == FUSION__MSG_TYPE__MSG_SEAL_HELLO || t == FUSION__MSG_TYPE__MSG_ACTIVATION ||
                                    t == FUSION__MSG_TYPE__MSG_GRADIENT)) {
        on_data(p, SRC_RELAY, m);
        return;
    }
    if (h->sender && *h->sender && t != FUSION__MSG_TYPE__MSG_VERIFY_INPUT) {
        /* Envelope.sender is set only on what the broker forwards from another peer: data frames and
         * verification inputs. Anything else claiming to come from a peer is not the broker's word. */
        FU_WARN("peer", "%s forwarded from peer %.12s... ignored: only data frames come that way", wire_type_name(t),
                h->sender);
        wire_msg_destroy(&m);
        return;
    }
    switch (t) {
    case FUSION__MSG_TYPE__MSG_PEER_WELCOME: {
        const Fusion__PeerWelcome *w = wire_msg_body_as(m, t);
        p->hb_ms = w->heartbeat_ms >= 50 && w->heartbeat_ms <= 60000 ? w->heartbeat_ms : PEER_HEARTBEAT_MS;
        p->dead_ms = w->dead_after_ms >= 2 * p->hb_ms && w->dead_after_ms <= 600000 ? w->dead_after_ms
                                                                                   : 3 * p->hb_ms;
        if (!p->welcomed)
            FU_INFO("peer", "welcomed by the broker as %s (heartbeat %u ms)", w->peer_id, p->hb_ms);
        p->welcomed = true;
        if (p->cfg.link_mbps <= 0 && !p->probe_t0_ns &&
            (!p->probe_done_ms || fu_clock_ms() - p->probe_done_ms >= PEER_PROBE_EVERY_MS)) {
            Fusion__LinkProbeRequest rq = FUSION__LINK_PROBE_REQUEST__INIT;
            rq.bytes = PEER_PROBE_BYTES;
            if (to_broker(p, FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ, 0, 0, 0, &rq.base) == FU_OK)
                p->probe_t0_ns = fu_clock_ns();
        }
        break;
    }
    case FUSION__MSG_TYPE__MSG_LINK_PROBE: {
        /* Request to last byte: one round trip plus the payload's transfer, a lower bound of the
         * link's bandwidth. Heartbeats carry it to the broker's scheduler. */
        const Fusion__LinkProbe *lp = wire_msg_body_as(m, t);
        uint64_t el_ns = p->probe_t0_ns ? fu_clock_ns() - p->probe_t0_ns : 0;
        if (el_ns && lp->data.len >= PEER_PROBE_BYTES / 4) {
            p->prof.link_bandwidth_bps = (double)lp->data.len * 1e9 / (double)el_ns;
            FU_INFO("peer", "link from the broker: %.1f MB/s (%zu bytes in %.1f ms)", p->prof.link_bandwidth_bps / 1e6,
                    lp->data.len, (double)el_ns / 1e6);
        }
        p->probe_t0_ns = 0;
        p->probe_done_ms = fu_clock_ms();
        break;
    }
    case FUSION__MSG_TYPE__MSG_HEARTBEAT:
    case FUSION__MSG_TYPE__MSG_ENROL_ACK:
        break;
    case FUSION__MSG_TYPE__MSG_ERROR: {
        const Fusion__Error *e = wire_msg_body_as(m, t);
        FU_WARN("peer", "the broker refused our %s: %s", wire_type_name(e->in_reply_to), e->message);
        if (e->in_reply_to == FUSION__MSG_TYPE__MSG_HEARTBEAT && fu_clock_ms() - p->hello_ms >= p->hb_ms) {
            /* It does not know us (a restarted broker, or we were declared dead): register again. */
            send_hello(p);
            break;
        }
        if (e->in_reply_to == FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ) { /* too soon: keep what we have */
            p->probe_t0_ns = 0;
            p->probe_done_ms = fu_clock_ms();
            break;
        }
        if (e->in_reply_to == FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST) { /* the fetch must stop waiting */
            peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
            c->msg = m;
            deliver(p, c);
            return;
        }
        break;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_ASSIGN: {
        const Fusion__StageAssign *a = wire_msg_body_as(m, t);
        if (p->leaving) {
            FU_INFO("peer", "leaving: StageAssign for job %016" PRIx64 " not taken", a->job_id);
            break;
        }
        if (!a->backup)
            links_open(p, a);
        peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
        c->msg = m;
        c->gen = a->backup ? 0 : p->gen;
        deliver(p, c);
        return;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_RELEASE: {
        const Fusion__StageRelease *r = wire_msg_body_as(m, t);
        if (r->job_id == p->job_id || r->job_id == 0)
            links_close(p);
        peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
        c->msg = m;
        deliver(p, c);
        return;
    }
    case FUSION__MSG_TYPE__MSG_VERIFY_INPUT:
        on_verify_input(p, m); /* takes m */
        return;
    case FUSION__MSG_TYPE__MSG_STAGE_START:
    case FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK:
    case FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK:
    case FUSION__MSG_TYPE__MSG_INFER_TOKEN:
    case FUSION__MSG_TYPE__MSG_VERIFY_REQUEST:
    case FUSION__MSG_TYPE__MSG_VERIFY_DELIVER: {
        peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
        c->msg = m;
        deliver(p, c);
        return;
    }
    default:
        FU_DEBUG("peer", "broker: %s ignored", wire_type_name(t));
        break;
    }
    wire_msg_destroy(&m);
}

static void on_compute(peer_t *p, peer_cmd *c)
{
    switch (c->kind) {
    case PEER_CMD_SEND: {
        wire_hdr h = {.type = c->type, .job_id = c->job_id, .step = c->step, .stage = c->stage,
                      .sequence = ++p->seq};
        void *body = c->body;
        c->body = NULL;
        fu_err rc = wire_send_packed(p->broker, NULL, 0, &h, body, body ? c->body_len : 0, body ? free_cb : NULL,
                                     NULL);
        if (rc != FU_OK)
            FU_WARN("peer", "cannot send %s to the broker: %s", wire_type_name(c->type), fu_strerror(rc));
        break;
    }
    case PEER_CMD_SEND_TENSOR:
        send_tensor(p, c);
        break;
    case PEER_CMD_VERIFY_SEND:
        send_verify_input(p, c);
        break;
    case PEER_CMD_READY:
        if (c->backup) {
            Fusion__StageReady r = FUSION__STAGE_READY__INIT;
            r.job_id = c->job_id;
            r.stage_index = c->stage;
            if (to_broker(p, FUSION__MSG_TYPE__MSG_STAGE_READY, c->job_id, 0, c->stage, &r.base) == FU_OK)
                FU_INFO("peer", "job %016" PRIx64 " stage %u: warm backup ready", c->job_id, c->stage);
        } else if (c->gen == p->gen && c->job_id == p->job_id) {
            p->ready_pending = true;
            check_ready(p);
        }
        break;
    case PEER_CMD_STAGE_GONE:
        if (c->gen == p->gen && c->job_id == p->job_id)
            links_close(p); /* a newer assignment's links stay */
        break;
    case PEER_CMD_FATAL:
        p->fatal = true;
        p->fatal_err = c->err;
        break;
    default:
        break;
    }
    peer_cmd_destroy(&c);
}

/* ---- start --------------------------------------------------------------------------------- */

/* Waits for the broker socket's TCP connection and CURVE handshake (monitor events): the TCP
 * connect time is the link latency sample (one round trip). FU_EAUTH when the broker refused our
 * key; FU_ETIMEDOUT when it did not answer in time (the peer goes on: the hello is queued). */
static fu_err wait_handshake(peer_t *p, uint64_t t0_ns)
{
    uint64_t deadline = fu_clock_ms() + IO_CONNECT_WAIT_MS;
    while (fu_clock_ms() < deadline) {
        zmq_pollitem_t it = {p->mon, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0)
            continue;
        zmq_msg_t f1, f2;
        zmq_msg_init(&f1);
        zmq_msg_init(&f2);
        if (zmq_msg_recv(&f1, p->mon, 0) < 0 || zmq_msg_recv(&f2, p->mon, 0) < 0) {
            zmq_msg_close(&f1);
            zmq_msg_close(&f2);
            return FU_EIO;
        }
        uint16_t ev = 0;
        if (zmq_msg_size(&f1) >= 2)
            memcpy(&ev, zmq_msg_data(&f1), 2);
        zmq_msg_close(&f1);
        zmq_msg_close(&f2);
        if (ev == ZMQ_EVENT_CONNECTED) {
            p->prof.link_latency_ms = (double)(fu_clock_ns() - t0_ns) / 1e6;
        } else if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            return FU_OK;
        } else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            return FU_EAUTH;
        }
    }
    return FU_ETIMEDOUT;
}

static fu_err broker_connect(peer_t *p, char *why, size_t cap)
{
    fu_err err = FU_OK;
    wire_socket_close(&p->broker);
    p->broker = wire_socket_new(p->ctx, ZMQ_DEALER, &err);
    if (!p->broker) {
        snprintf(why, cap, "cannot make the broker socket: %s", fu_strerror(err));
        return err;
    }
    if ((err = wire_socket_curve_client(p->broker, p->kp, p->broker_pk)) != FU_OK) {
        snprintf(why, cap, "this libzmq cannot be a CURVE client: %s", fu_strerror(err));
        return err;
    }
    if (p->mon) {
        zmq_close(p->mon);
        p->mon = NULL;
    }
    if (zmq_socket_monitor(p->broker, IO_MONITOR_EP,
                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) ==
        0) {
        p->mon = zmq_socket(p->ctx, ZMQ_PAIR);
        int linger = 0;
        if (p->mon && (zmq_setsockopt(p->mon, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
                       zmq_connect(p->mon, IO_MONITOR_EP) != 0)) {
            zmq_close(p->mon);
            p->mon = NULL;
        }
    }
    uint64_t t0 = fu_clock_ns();
    if (zmq_connect(p->broker, p->cfg.broker) != 0) {
        snprintf(why, cap, "bad --broker endpoint '%s': %s", p->cfg.broker, zmq_strerror(zmq_errno()));
        return FU_EINVAL;
    }
    if (p->mon) {
        fu_err rc = wait_handshake(p, t0);
        zmq_socket_monitor(p->broker, NULL, 0);
        zmq_close(p->mon);
        p->mon = NULL;
        if (rc == FU_EAUTH) {
            snprintf(why, cap, "the broker at %s refused this peer's key %s (add it to the broker's allow-list, or "
                     "pass --enrol-token)", p->cfg.broker, wire_keypair_public_z85(p->kp));
            return FU_EAUTH;
        }
        if (rc == FU_ETIMEDOUT)
            FU_WARN("peer", "the broker at %s does not answer yet; PeerHello waits in the queue", p->cfg.broker);
    }
    return FU_OK;
}

static fu_err enrol(peer_t *p, char *why, size_t cap)
{
    Fusion__Enrol e = FUSION__ENROL__INIT;
    e.token = (char *)p->cfg.enrol_token;
    e.name = p->name;
    FU_TRY(to_broker(p, FUSION__MSG_TYPE__MSG_ENROL, 0, 0, 0, &e.base));
    uint64_t deadline = fu_clock_ms() + IO_ENROL_WAIT_MS;
    while (fu_clock_ms() < deadline && !g_stop) {
        zmq_pollitem_t it = {p->broker, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0)
            continue;
        wire_msg_t *m = NULL;
        if (wire_recv(p->broker, WIRE_DONTWAIT, &p->counters, &m) != FU_OK)
            continue;
        Fusion__MsgType t = wire_msg_type(m);
        if (t == FUSION__MSG_TYPE__MSG_ENROL_ACK) {
            FU_INFO("peer", "enrolled with the broker");
            wire_msg_destroy(&m);
            return broker_connect(p, why, cap); /* a fresh connection, admitted as a member */
        }
        if (t == FUSION__MSG_TYPE__MSG_ERROR) {
            const Fusion__Error *er = wire_msg_body_as(m, t);
            snprintf(why, cap, "the broker refused the enrolment: %s", er->message);
            wire_msg_destroy(&m);
            return FU_EAUTH;
        }
        wire_msg_destroy(&m);
    }
    snprintf(why, cap, "the broker did not answer the enrolment within %d s", IO_ENROL_WAIT_MS / 1000);
    return FU_ETIMEDOUT;
}

peer_t *peer_new(const peer_cfg *cfg, fu_err *err_out, char *why, size_t cap)
{
    fu_err err = FU_OK;
    fu_errmsg em = {{0}};
    if (why && cap)
        why[0] = '\0';
    char dummy[8];
    if (!why) {
        why = dummy;
        cap = sizeof dummy;
    }
    peer_t *p = fu_calloc(1, sizeof *p);
    p->cfg = *cfg;
    p->hb_ms = PEER_HEARTBEAT_MS;
    p->dead_ms = PEER_DEAD_AFTER_MS;
    if (!cfg->broker || !cfg->broker_key_file || !cfg->keys_dir) {
        snprintf(why, cap, "--broker, --broker-key and --keys are required");
        err = FU_EINVAL;
        goto fail;
    }
    if ((err = wire_keypair_load(cfg->keys_dir, &p->kp, why, cap)) != FU_OK ||
        (err = wire_key_load_public(cfg->broker_key_file, p->broker_pk, why, cap)) != FU_OK)
        goto fail;
    if (cfg->name && *cfg->name) {
        snprintf(p->name, sizeof p->name, "%s", cfg->name);
    } else if (gethostname(p->name, sizeof p->name - 1) != 0) {
        snprintf(p->name, sizeof p->name, "peer");
    }
    if (cfg->cache_dir && *cfg->cache_dir) {
        p->cache_dir = fu_strdup(cfg->cache_dir);
    } else {
        const char *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
        char buf[4096];
        snprintf(buf, sizeof buf, "%s%s/fusion", x && *x ? x : home ? home : "/tmp", x && *x ? "" : "/.cache");
        p->cache_dir = fu_strdup(buf);
    }
    if ((err = fu_mkdir_p(p->cache_dir, 0700, &em)) != FU_OK) {
        snprintf(why, cap, "cannot make the cache directory '%s': %s", p->cache_dir, fu_errmsg_text(&em, err));
        goto fail;
    }
    p->cache_max_bytes = cfg->cache_max_gb > 0 ? (uint64_t)(cfg->cache_max_gb * 1024.0 * 1024.0 * 1024.0) : 0;
    uint64_t freed;
    if (peer_cache_trim(p->cache_dir, p->cache_max_bytes, NULL, &freed, &em) != FU_OK) /* a lowered limit */
        FU_WARN("peer", "cannot trim the cache to --cache-max-gb: %s", em.msg);
    if (cfg->threads > 0) {
        if ((err = kern_cpu_set_threads(cfg->threads)) != FU_OK) {
            snprintf(why, cap, "bad --threads %d", cfg->threads);
            goto fail;
        }
    }
    const char *dev = cfg->device && *cfg->device ? cfg->device : "cpu";
    if ((err = kern_backend_get(dev, &p->be)) != FU_OK) {
        snprintf(why, cap, "--device '%s': %s", dev,
                 err == FU_ENOSYS      ? "this build has no CUDA backend"
                 : err == FU_ENOTFOUND ? "no such CUDA device"
                                       : "expected cpu, cuda or cuda:N");
        goto fail;
    }
    uint64_t cap_bytes = cfg->max_memory_gb > 0 ? (uint64_t)(cfg->max_memory_gb * 1024.0 * 1024.0 * 1024.0) : 0;
    if ((err = peer_profile_measure(p->be, cap_bytes, PEER_PROFILE_BUDGET_S, &p->prof, &em)) != FU_OK) {
        snprintf(why, cap, "measuring this peer failed: %s", fu_errmsg_text(&em, err));
        goto fail;
    }
    if (p->cfg.link_mbps > 0) /* stated: in the first PeerHello, and no probe */
        p->prof.link_bandwidth_bps = p->cfg.link_mbps * 1e6;
    peer_profile_format(&p->prof, p->prof_line, sizeof p->prof_line);

    /* A guest on its owner's machine (peer_guest.h). The threads that exist now are compute
     * threads (OpenBLAS's pool, the profile's OpenMP team): they take the compute priority before
     * ZeroMQ starts its I/O threads, which keep the process's own, as this thread does. */
    if (!(p->guest = peer_guest_new(&cfg->guest, cfg->threads))) {
        snprintf(why, cap, "bad --max-cpu, --busy-percent or --hours");
        err = FU_EINVAL;
        goto fail;
    }
    kern_priority got = KERN_PRIORITY_NORMAL;
    if (kern_priority_set_others(cfg->guest.priority, &got) != FU_OK || got != cfg->guest.priority)
        FU_WARN("peer", "compute threads: priority %s wanted, %s obtained", kern_priority_name(cfg->guest.priority),
                kern_priority_name(got));

    p->ctx = zmq_ctx_new();
    if (!p->ctx) {
        snprintf(why, cap, "cannot make a ZeroMQ context");
        err = FU_EIO;
        goto fail;
    }
    if (!cfg->no_listen) {
        const char *bind = cfg->data_bind && *cfg->data_bind ? cfg->data_bind : "tcp://*:7701";
        p->router = wire_socket_new(p->ctx, ZMQ_ROUTER, &err);
        if (!p->router || zmq_bind(p->router, bind) != 0) {
            snprintf(why, cap, "cannot listen on --data-bind '%s': %s (or pass --no-listen to relay through the "
                     "broker)", bind, zmq_strerror(zmq_errno()));
            err = FU_EIO;
            goto fail;
        }
        char ep[256];
        if ((err = wire_socket_endpoint(p->router, ep, sizeof ep)) != FU_OK) {
            snprintf(why, cap, "cannot read the bound data endpoint");
            goto fail;
        }
        if (cfg->data_advertise && *cfg->data_advertise) {
            snprintf(p->data_endpoint, sizeof p->data_endpoint, "%s", cfg->data_advertise);
        } else if (strncmp(ep, "tcp://0.0.0.0:", 14) == 0) {
            char host[200] = "localhost";
            (void)gethostname(host, sizeof host - 1);
            snprintf(p->data_endpoint, sizeof p->data_endpoint, "tcp://%s:%s", host, ep + 14);
        } else {
            snprintf(p->data_endpoint, sizeof p->data_endpoint, "%s", ep);
        }
    }
    p->pipe = zmq_socket(p->ctx, ZMQ_PAIR);
    int hwm = PEER_PAIR_HWM, linger = 0;
    if (!p->pipe || zmq_setsockopt(p->pipe, ZMQ_SNDHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(p->pipe, ZMQ_RCVHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(p->pipe, ZMQ_LINGER, &linger, sizeof linger) != 0 || zmq_bind(p->pipe, PEER_PIPE_ENDPOINT) != 0) {
        snprintf(why, cap, "cannot make the compute pipe: %s", zmq_strerror(zmq_errno()));
        err = FU_EIO;
        goto fail;
    }
    if ((err = broker_connect(p, why, cap)) != FU_OK)
        goto fail;
    if (cfg->enrol_token && *cfg->enrol_token && (err = enrol(p, why, cap)) != FU_OK)
        goto fail;
    atomic_store(&p->shared.state, FUSION__PEER_STATE__PEER_STATE_IDLE);
    p->ccfg = (peer_compute_cfg){.ctx = p->ctx, .be = p->be, .cache_dir = p->cache_dir,
                                 .cache_max_bytes = p->cache_max_bytes,
                                 .mem_budget = p->prof.free_memory_bytes ? p->prof.free_memory_bytes : ((uint64_t)1 << 32),
                                 .shared = &p->shared, .self_pk = wire_keypair_public(p->kp),
                                 .guest = p->guest, .priority = cfg->guest.priority};
    /* The compute thread must not take the signals meant for the I/O thread's loop. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int prc = pthread_create(&p->compute, NULL, peer_compute_main, &p->ccfg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (prc != 0) {
        snprintf(why, cap, "cannot start the compute thread");
        err = FU_EIO;
        goto fail;
    }
    p->compute_started = true;
    p->vin = peer_vin_asm_new(max_tensor(p));
    FU_INFO("peer", "profile: %s | link RTT %.3f ms", p->prof_line, p->prof.link_latency_ms);
    if (err_out)
        *err_out = FU_OK;
    return p;
fail:
    if (err_out)
        *err_out = err ? err : FU_EIO;
    peer_destroy(&p);
    return NULL;
}

/* ---- the loop ------------------------------------------------------------------------------ */

/* The owner's pause requests, the machine's load and the hours: a change of the pause is logged and
 * told to the broker at once (a heartbeat). A leaving peer pauses no more: its stage must drain. */
static void guest_tick(peer_t *p, uint64_t now)
{
    sig_atomic_t req = g_pause_req;
    if (req) {
        g_pause_req = 0;
        peer_guest_owner_pause(p->guest, req == 1);
    }
    if (p->leaving)
        peer_guest_release(p->guest);
    unsigned mask = peer_guest_tick(p->guest, now);
    if (mask == p->pause_mask)
        return;
    if (mask)
        peer_guest_describe(p->guest, mask, p->pause_text, sizeof p->pause_text);
    if (mask)
        FU_INFO("peer", "compute paused: %s", p->pause_text);
    else
        FU_INFO("peer", "compute resumed");
    p->pause_mask = mask;
    if (p->welcomed)
        send_heartbeat(p, false);
}

fu_err peer_run(peer_t *p)
{
    if (!p)
        return FU_EINVAL;
    send_hello(p);
    p->last_broker_ms = fu_clock_ms();
    uint32_t drain = p->cfg.drain_ms ? p->cfg.drain_ms : PEER_DRAIN_MS;
    fu_err result = FU_OK;
    for (;;) {
        uint64_t now = fu_clock_ms();
        if (g_stop && !p->leaving) {
            p->leaving = true;
            p->leave_ms = now;
            send_leave(p, "the operator stopped the peer");
        }
        if (p->fatal && !p->leaving) {
            p->leaving = true;
            p->leave_ms = now;
            send_leave(p, "backend failure");
        }
        guest_tick(p, now);
        if (p->leaving) {
            bool active = atomic_load(&p->shared.stage_active) != 0;
            if (!active || p->fatal) {
                FU_INFO("peer", "no stage held: leaving now");
                break;
            }
            if (now - p->leave_ms >= drain) {
                FU_WARN("peer", "no StageRelease within %u ms of Leave: leaving anyway", drain);
                break;
            }
        }
        if (p->welcomed && now - p->last_hb_ms >= p->hb_ms) {
            send_heartbeat(p, true);
            check_ready(p); /* a StageReady the stall test hook held back */
        }
        if (input_paused(p))
            p->last_broker_ms = now; /* not reading the broker is not the broker's silence */
        if (now - p->last_broker_ms >= p->dead_ms && now - p->hello_ms >= p->dead_ms) {
            if (p->welcomed)
                FU_WARN("peer", "no word from the broker for %u ms: saying PeerHello again", p->dead_ms);
            send_hello(p);
        }
        if (p->job_id && p->ready_pending && now - p->assign_ms > PEER_MAX_ASSIGN_WAIT_MS) {
            FU_WARN("peer", "job %016" PRIx64 ": links not up after %d s", p->job_id, PEER_MAX_ASSIGN_WAIT_MS / 1000);
            p->assign_ms = now;
        }
        flush_stash(p);
        handle_held(p);
        zmq_pollitem_t items[4];
        int n = 0, i_pipe = -1, i_broker = -1, i_router = -1, i_down = -1;
        items[n] = (zmq_pollitem_t){p->pipe, 0, ZMQ_POLLIN, 0};
        i_pipe = n++;
        if (!input_paused(p)) {
            items[n] = (zmq_pollitem_t){p->broker, 0, ZMQ_POLLIN, 0};
            i_broker = n++;
            if (p->router) {
                items[n] = (zmq_pollitem_t){p->router, 0, ZMQ_POLLIN, 0};
                i_router = n++;
            }
            if (p->down) {
                items[n] = (zmq_pollitem_t){p->down, 0, ZMQ_POLLIN, 0};
                i_down = n++;
            }
        }
        long tmo = p->stash_n ? 5 : IO_POLL_MS;
        if (p->welcomed) {
            uint64_t next_hb = p->last_hb_ms + p->hb_ms;
            long until = next_hb > now ? (long)(next_hb - now) : 0;
            if (until < tmo)
                tmo = until;
        }
        int r = zmq_poll(items, n, tmo);
        if (r < 0) {
            if (zmq_errno() == EINTR)
                continue;
            FU_ERROR("peer", "poll failed: %s", zmq_strerror(zmq_errno()));
            result = FU_EIO;
            break;
        }
        /* Commands from the compute thread first (they free memory and open the way forward). */
        if (items[i_pipe].revents & ZMQ_POLLIN) {
            for (int k = 0; k < 64; k++) {
                peer_cmd *c = NULL;
                if (peer_cmd_recv(p->pipe, ZMQ_DONTWAIT, &c) != FU_OK)
                    break;
                on_compute(p, c);
            }
        }
        if (i_broker >= 0 && (items[i_broker].revents & ZMQ_POLLIN)) {
            for (int k = 0; k < 64 && !input_paused(p); k++) {
                wire_msg_t *m = NULL;
                fu_err rc = wire_recv(p->broker, WIRE_DONTWAIT, &p->counters, &m);
                if (rc == FU_EAGAIN)
                    break;
                if (rc != FU_OK) {
                    if (rc == FU_ECANCELED || rc == FU_EIO)
                        break;
                    continue;
                }
                on_broker(p, m);
            }
        }
        if (i_router >= 0 && (items[i_router].revents & ZMQ_POLLIN))
            read_data(p, p->router, SRC_ROUTER, false);
        if (i_down >= 0 && (items[i_down].revents & ZMQ_POLLIN))
            read_data(p, p->down, SRC_DOWN, false);
    }
    if (p->fatal)
        result = p->fatal_err ? p->fatal_err : FU_EIO;
    return result;
}

void peer_destroy(peer_t **p_p)
{
    if (!p_p || !*p_p)
        return;
    peer_t *p = *p_p;
    if (p->compute_started) {
        peer_guest_release(p->guest); /* a paused compute thread must come to its STOP */
        peer_cmd *stop = peer_cmd_new(PEER_CMD_STOP);
        /* Drain what the compute thread sends while it finishes its command, until it has the STOP. */
        while (p->pipe) {
            fu_err rc = peer_cmd_send(p->pipe, &stop, ZMQ_DONTWAIT);
            if (rc == FU_OK)
                break;
            peer_cmd *c = NULL;
            if (peer_cmd_recv(p->pipe, ZMQ_DONTWAIT, &c) == FU_OK)
                peer_cmd_destroy(&c);
            else
                fu_sleep_ms(5);
            if (rc != FU_EAGAIN)
                break;
        }
        peer_cmd_destroy(&stop);
        /* The compute thread may still block sending to us: keep draining until it exits. */
        for (;;) {
            peer_cmd *c = NULL;
            while (peer_cmd_recv(p->pipe, ZMQ_DONTWAIT, &c) == FU_OK)
                peer_cmd_destroy(&c);
            if (atomic_load(&p->shared.exited))
                break;
            fu_sleep_ms(5);
        }
        pthread_join(p->compute, NULL);
    }
    for (size_t i = 0; i < p->stash_n; i++)
        peer_cmd_destroy(&p->stash[(p->stash_head + i) % PEER_STASH]);
    for (int s = 0; s < SRC_COUNT; s++)
        wire_msg_destroy(&p->early[s]);
    for (size_t i = 0; i < p->n_held; i++)
        wire_msg_destroy(&p->held[i]);
    link_reset(&p->links[0]);
    link_reset(&p->links[1]);
    peer_vin_asm_destroy(&p->vin);
    peer_guest_destroy(&p->guest);
    wire_socket_close(&p->down);
    wire_socket_close(&p->router);
    wire_socket_close(&p->broker);
    if (p->mon)
        zmq_close(p->mon);
    if (p->pipe)
        zmq_close(p->pipe);
    if (p->ctx)
        zmq_ctx_term(p->ctx);
    wire_keypair_destroy(&p->kp);
    free(p->cache_dir);
    free(p);
    *p_p = NULL;
}
