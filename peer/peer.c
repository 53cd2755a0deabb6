/* peer: the I/O thread of fusion-peer (see peer.h): its lifecycle (peer_new, the poll loop of
 * peer_run, peer_destroy), the broker connection and enrolment, PeerHello, heartbeats, the guest's
 * pauses, the stash towards the compute thread, and the graceful leave. The sealed data links are
 * peer_link.c; the broker's and the compute thread's messages are peer_session.c. */
#include "peer.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
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
#include "peer_io_internal.h"
#include "peer_profile.h"
#include "peer_verify.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_socket.h"

static volatile sig_atomic_t g_stop = 0;
static _Atomic int g_pause_req = 0; /* 1: the owner pauses, 2: resumes (taken by the loop; lock-free) */

void peer_request_stop(void)
{
    g_stop = 1;
}

void peer_request_pause(bool on)
{
    atomic_store(&g_pause_req, on ? 1 : 2);
}

const char *peer_profile_line(const peer_t *p)
{
    return p ? p->prof_line : "";
}

bool peer_io_stop_requested(void)
{
    return g_stop != 0;
}

/* ---- small helpers ------------------------------------------------------------------------- */

fu_err peer_io_to_broker(peer_t *p, Fusion__MsgType type, uint64_t job, uint64_t step, uint32_t stage,
                         const ProtobufCMessage *body)
{
    wire_hdr h = {.type = type, .job_id = job, .step = step, .stage = stage, .sequence = ++p->seq,
                  .slot = p->cfg.slot};
    fu_err rc = wire_send(p->broker, NULL, 0, &h, body);
    if (rc != FU_OK)
        FU_WARN("peer", "cannot send %s to the broker: %s", wire_type_name(type), fu_strerror(rc));
    return rc;
}

/* Hands a command to the compute thread, or holds it in the stash (bounded: callers stop reading
 * input when the stash is nearly full). */
void peer_io_deliver(peer_t *p, peer_cmd *c)
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

void peer_io_flush_stash(peer_t *p)
{
    while (p->stash_n) {
        peer_cmd **c = &p->stash[p->stash_head];
        if (peer_cmd_send(p->pipe, c, ZMQ_DONTWAIT) != FU_OK)
            return;
        p->stash_head = (p->stash_head + 1) % PEER_STASH;
        p->stash_n--;
    }
}

bool peer_io_input_paused(const peer_t *p)
{
    return p->stash_n + 2 > PEER_STASH;
}

/* ---- broker session ------------------------------------------------------------------------ */

void peer_io_send_hello(peer_t *p)
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
    pr.numeric_class = p->prof.numeric_class;
    pr.link_bandwidth_bps = p->prof.link_bandwidth_bps;
    pr.link_latency_ms = p->prof.link_latency_ms;
    pr.threads = p->prof.threads;
    Fusion__PeerHello h = FUSION__PEER_HELLO__INIT;
    h.name = p->name;
    h.software = (char *)PEER_SOFTWARE;
    h.profile = &pr;
    h.data_endpoint = p->data_endpoint;
    h.needs_relay = p->router == NULL;
    h.session = p->session;
    h.slots = p->cfg.n_slots > 1 ? p->cfg.n_slots : 1;
    if (peer_io_to_broker(p, FUSION__MSG_TYPE__MSG_PEER_HELLO, 0, 0, 0, &h.base) == FU_OK)
        FU_INFO("peer", "PeerHello sent (%s)", p->router ? p->data_endpoint : "relayed");
    p->welcomed = false;
    p->hello_ms = fu_clock_ms();
}

/* A Heartbeat now. on_time: the timer's beat (the schedule moves on); else an extra one (a pause
 * began or ended) that leaves the schedule alone. */
void peer_io_send_heartbeat(peer_t *p, bool on_time)
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
    /* Quiet (the broker answers only to say it does not know us), except one beat in
     * PEER_HB_ASK_EVERY and one sent out of turn (a new connection, a pause): their answers tell that
     * the broker still hears us, at a fifth of the messages an answer to every beat cost it. */
    hb.quiet = on_time && p->hb_n++ % PEER_HB_ASK_EVERY != 0;
    if (atomic_load(&p->shared.stage_active)) {
        uint64_t pr = atomic_load(&p->shared.progress);
        hb.step = pr >> 32;
        hb.forward_done = (uint32_t)(pr >> 16) & 0xffffu;
        hb.backward_done = (uint32_t)pr & 0xffffu;
    }
    (void)peer_io_to_broker(p, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, 0, 0, &hb.base);
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
    if (peer_io_to_broker(p, FUSION__MSG_TYPE__MSG_LEAVE, 0, 0, 0, &lv.base) == FU_OK)
        FU_INFO("peer", "Leave sent (%s)", reason);
}

/* ---- start --------------------------------------------------------------------------------- */

/* Reads one event of the broker socket's monitor, if one waits, into *ev: FU_EAGAIN when none waits,
 * FU_EIO when the monitor failed. An event is two frames, delivered together. */
static fu_err mon_read(peer_t *p, uint16_t *ev)
{
    zmq_msg_t f1, f2;
    zmq_msg_init(&f1);
    zmq_msg_init(&f2);
    fu_err rc = FU_OK;
    *ev = 0;
    if (zmq_msg_recv(&f1, p->mon, ZMQ_DONTWAIT) < 0)
        rc = zmq_errno() == EAGAIN ? FU_EAGAIN : FU_EIO;
    else if (zmq_msg_recv(&f2, p->mon, ZMQ_DONTWAIT) < 0)
        rc = FU_EIO;
    else if (zmq_msg_size(&f1) >= sizeof *ev)
        memcpy(ev, zmq_msg_data(&f1), sizeof *ev);
    zmq_msg_close(&f1);
    zmq_msg_close(&f2);
    return rc;
}

/* Stops watching the broker socket's connection. */
static void mon_stop(peer_t *p)
{
    if (!p->mon)
        return;
    if (p->broker)
        (void)zmq_socket_monitor(p->broker, NULL, 0);
    zmq_close(p->mon);
    p->mon = NULL;
}

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
        uint16_t ev;
        fu_err rc = mon_read(p, &ev);
        if (rc == FU_EAGAIN)
            continue;
        if (rc != FU_OK)
            return rc;
        if (ev == ZMQ_EVENT_CONNECTED) {
            p->prof.link_latency_ms = (double)(fu_clock_ns() - t0_ns) / 1e6;
        } else if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            p->handshakes++;
            return FU_OK;
        } else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            return FU_EAUTH;
        }
    }
    return FU_ETIMEDOUT;
}

/* The broker connection's events, read from the monitor, which watches the broker socket for the
 * peer's whole life. A dropped connection (a NAT rebinding, a middlebox restarting, the broker's side
 * closing it) is connected again by libzmq itself after WIRE_RECONNECT_MS, but the broker declares a
 * peer whose connection closed dead unless it hears from it within a grace of a quarter heartbeat
 * (broker_conn.c): our next heartbeat may be a whole interval away. So every handshake after the
 * first says at once that we are alive: a Heartbeat (an extra one, the schedule stays), or PeerHello
 * again while we are not welcomed (the one outstanding may have gone with the old connection; the
 * same session keeps its work). The first handshake needs nothing: our PeerHello goes out on it. */
static void broker_conn_events(peer_t *p)
{
    uint16_t ev;
    fu_err rc;
    while (p->mon && (rc = mon_read(p, &ev)) != FU_EAGAIN) {
        if (rc != FU_OK) {
            FU_WARN("peer", "the broker connection's monitor failed: a dropped connection is told by the heartbeats");
            mon_stop(p);
            p->lost_ms = 0; /* unknown from now on: the silence decides */
            return;
        }
        if (ev == ZMQ_EVENT_DISCONNECTED) {
            FU_INFO("peer", "the connection to the broker at %s closed; connecting again", p->eps.ep[p->ep_cur]);
            if (!p->lost_ms)
                p->lost_ms = fu_clock_ms();
        } else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
            FU_WARN("peer", "the broker at %s refused this peer's key %s on a new connection", p->eps.ep[p->ep_cur],
                    wire_keypair_public_z85(p->kp));
        } else if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            p->lost_ms = 0;
            if (p->handshakes++ == 0)
                continue;
            if (p->welcomed) {
                FU_INFO("peer", "connected to the broker again: a heartbeat at once");
                peer_io_send_heartbeat(p, false);
            } else {
                FU_INFO("peer", "connected to the broker again: PeerHello at once");
                peer_io_send_hello(p);
            }
        }
    }
}

/* A fresh broker socket connected to ep[ep_cur]. wait: until its handshake (the start), which
 * measures the link's latency; else the loop's monitor tells (a move to another endpoint). */
static fu_err broker_connect(peer_t *p, bool wait, fu_errmsg *em)
{
    fu_err err = FU_OK;
    const char *ep = p->eps.ep[p->ep_cur];
    mon_stop(p);
    p->handshakes = 0;
    p->lost_ms = fu_clock_ms();
    wire_socket_close(&p->broker);
    p->broker = wire_socket_new(p->ctx, ZMQ_DEALER, &err);
    if (!p->broker)
        return fu_errmsg_set(em, err, "cannot make the broker socket: %s", fu_strerror(err));
    if ((err = wire_socket_curve_client(p->broker, p->kp, p->eps.pk[p->ep_cur])) != FU_OK)
        return fu_errmsg_set(em, err, "this libzmq cannot be a CURVE client: %s", fu_strerror(err));
    /* no ZMTP pings to the broker, which serves thousands: the heartbeats say we are alive, and the
     * kernel notices a broker that vanished (wire_socket_quiet); so does the heartbeats' silence */
    if (wire_socket_quiet(p->broker) != FU_OK)
        FU_WARN("peer", "the broker socket still pings the broker");
    int ivl = IO_BROKER_RECONNECT_MS; /* back within the broker's grace after a drop (broker_conn_events) */
    if (zmq_setsockopt(p->broker, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl) != 0)
        FU_WARN("peer", "the broker socket reconnects after %d ms, not %d", WIRE_RECONNECT_MS, ivl);
    /* ... and after an outage of the broker at most IO_BROKER_RECONNECT_MAX_MS after it is back: a
     * restarted broker waits for its peers only a few heartbeats (BJ_RECOVER_WAIT), and libzmq's
     * back-off (doubling up to WIRE_RECONNECT_MAX_MS, 5 s) could miss that. */
    int ivl_max = IO_BROKER_RECONNECT_MAX_MS;
    if (zmq_setsockopt(p->broker, ZMQ_RECONNECT_IVL_MAX, &ivl_max, sizeof ivl_max) != 0)
        FU_WARN("peer", "the broker socket's reconnect back-off is not capped at %d ms", ivl_max);
    /* a monitor endpoint of its own per socket: a closed socket's may not be released yet */
    char mon_ep[64];
    snprintf(mon_ep, sizeof mon_ep, IO_MONITOR_EP "-%u", ++p->mon_n);
    if (zmq_socket_monitor(p->broker, mon_ep,
                           ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) == 0) {
        p->mon = zmq_socket(p->ctx, ZMQ_PAIR);
        int linger = 0;
        if (p->mon && (zmq_setsockopt(p->mon, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
                       zmq_connect(p->mon, mon_ep) != 0))
            mon_stop(p);
        else if (!p->mon)
            (void)zmq_socket_monitor(p->broker, NULL, 0);
    }
    if (!p->mon) {
        FU_WARN("peer", "cannot watch the broker connection: a dropped connection is told by the heartbeats");
        p->lost_ms = 0; /* unknown: the silence decides (a move needs the monitor's word) */
    }
    uint64_t t0 = fu_clock_ns();
    if (zmq_connect(p->broker, ep) != 0)
        return fu_errmsg_set(em, FU_EINVAL, "bad --broker endpoint '%s': %s", ep, zmq_strerror(zmq_errno()));
    if (p->mon && wait) {
        fu_err rc = wait_handshake(p, t0);
        if (rc == FU_OK)
            p->lost_ms = 0;
        if (rc == FU_EAUTH)
            return fu_errmsg_set(
                em, FU_EAUTH,
                "the broker at %s refused this peer's key %s (add it to the broker's allow-list, or "
                "pass --enrol-token)",
                ep, wire_keypair_public_z85(p->kp));
        if (rc == FU_ETIMEDOUT)
            return FU_ETIMEDOUT;
        if (rc == FU_EIO) {
            FU_WARN("peer", "the broker connection's monitor failed: a dropped connection is told by the heartbeats");
            mon_stop(p);
            p->lost_ms = 0;
        }
    }
    return FU_OK;
}

/* The first connection: each endpoint in turn until one answers (a gateway may be down while the
 * peer starts); none answering, the first one, where PeerHello waits in the queue. */
static fu_err broker_connect_first(peer_t *p, fu_errmsg *em)
{
    for (uint32_t i = 0; i < p->eps.n; i++) {
        p->ep_cur = i;
        fu_err rc = broker_connect(p, true, em);
        if (rc != FU_ETIMEDOUT)
            return rc;
        FU_WARN("peer", "the broker at %s does not answer yet%s", p->eps.ep[i],
                i + 1 < p->eps.n ? ": trying the next endpoint" : "; PeerHello waits in the queue");
    }
    if (p->eps.n == 1)
        return FU_OK; /* that socket keeps trying */
    p->ep_cur = 0; /* none answers: the first again, where the loop goes on round the list */
    return broker_connect(p, false, em);
}

/* Moves the broker socket to the next endpoint (only with several): the session stays, and its
 * first handshake there says at once that the peer is alive (broker_conn_events). */
static void broker_move(peer_t *p, const char *why)
{
    uint32_t from = p->ep_cur;
    p->ep_cur = (p->ep_cur + 1) % p->eps.n;
    FU_WARN("peer", "%s at %s: moving to %s (endpoint %u of %u)", why, p->eps.ep[from], p->eps.ep[p->ep_cur],
            p->ep_cur + 1, p->eps.n);
    fu_errmsg em = {{0}};
    fu_err rc = broker_connect(p, false, &em);
    if (rc != FU_OK) {
        FU_ERROR("peer", "cannot connect to %s: %s", p->eps.ep[p->ep_cur], fu_errmsg_text(&em, rc));
        return;
    }
    p->handshakes = 1; /* its first handshake is a new connection of this session */
}

static fu_err enrol(peer_t *p, fu_errmsg *em)
{
    Fusion__Enrol e = FUSION__ENROL__INIT;
    e.token = (char *)p->cfg.enrol_token;
    e.name = p->name;
    FU_TRY(peer_io_to_broker(p, FUSION__MSG_TYPE__MSG_ENROL, 0, 0, 0, &e.base));
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
            return broker_connect(p, true, em); /* a fresh connection, admitted as a member */
        }
        if (t == FUSION__MSG_TYPE__MSG_ERROR) {
            const Fusion__Error *er = wire_msg_body_as(m, t);
            fu_errmsg_set(em, FU_EAUTH, "the broker refused the enrolment: %s", er->message);
            wire_msg_destroy(&m);
            return FU_EAUTH;
        }
        wire_msg_destroy(&m);
    }
    return fu_errmsg_set(em, FU_ETIMEDOUT, "the broker did not answer the enrolment within %d s",
                         IO_ENROL_WAIT_MS / 1000);
}

peer_t *peer_new(const peer_cfg *cfg, fu_err *err_out, fu_errmsg *em)
{
    fu_err err = FU_OK;
    fu_errmsg inner = {{0}}; /* a callee's message, quoted in em */
    peer_t *p = fu_calloc(1, sizeof *p);
    randombytes_buf(&p->session, sizeof p->session);
    p->cfg = *cfg;
    p->hb_ms = PEER_HEARTBEAT_MS;
    p->dead_ms = PEER_DEAD_AFTER_MS;
    if (!cfg->broker || !cfg->broker_key_file || !cfg->keys_dir) {
        err = fu_errmsg_set(em, FU_EINVAL, "--broker, --broker-key and --keys are required");
        goto fail;
    }
    if ((err = wire_endpoints_load(cfg->broker, cfg->broker_key_file, &p->eps, em)) != FU_OK ||
        (err = wire_keypair_load(cfg->keys_dir, &p->kp, em)) != FU_OK)
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
    if ((err = fu_mkdir_p(p->cache_dir, 0700, &inner)) != FU_OK) {
        fu_errmsg_set(em, err, "cannot make the cache directory '%s': %s", p->cache_dir,
                      fu_errmsg_text(&inner, err));
        goto fail;
    }
    p->cache_max_bytes = cfg->cache_max_gb > 0 ? (uint64_t)(cfg->cache_max_gb * 1024.0 * 1024.0 * 1024.0) : 0;
    uint64_t freed;
    /* A lowered limit applies at once. */
    if (peer_cache_trim(p->cache_dir, p->cache_max_bytes, NULL, &freed, &inner) != FU_OK)
        FU_WARN("peer", "cannot trim the cache to --cache-max-gb: %s", inner.msg);
    if (cfg->threads > 0) {
        if ((err = kern_cpu_set_threads(cfg->threads)) != FU_OK) {
            fu_errmsg_set(em, err, "bad --threads %d", cfg->threads);
            goto fail;
        }
    }
    const char *dev = cfg->device && *cfg->device ? cfg->device : "cpu";
    if ((err = kern_backend_get(dev, &p->be)) != FU_OK) {
        fu_errmsg_set(em, err, "--device '%s': %s", dev,
                      err == FU_ENOSYS      ? "this build has no CUDA backend"
                      : err == FU_ENOTFOUND ? "no such CUDA device"
                                            : "expected cpu, cuda or cuda:N");
        goto fail;
    }
    uint64_t cap_bytes = cfg->max_memory_gb > 0 ? (uint64_t)(cfg->max_memory_gb * 1024.0 * 1024.0 * 1024.0) : 0;
    if ((err = peer_profile_measure(p->be, cap_bytes, PEER_PROFILE_BUDGET_S, &p->prof, &inner)) != FU_OK) {
        fu_errmsg_set(em, err, "measuring this peer failed: %s", fu_errmsg_text(&inner, err));
        goto fail;
    }
    if (p->cfg.link_mbps > 0) { /* stated: in the first PeerHello, and no probe */
        p->prof.link_bandwidth_bps = p->cfg.link_mbps * 1e6;
        atomic_store(&p->shared.link_bytes_per_s, (uint64_t)p->prof.link_bandwidth_bps);
    }
    uint32_t n_slots = cfg->n_slots > 1 ? cfg->n_slots : 1;
    for (uint32_t i = 0; p->cfg.gflops > 0 && i < p->prof.n_speeds; i++) /* stated: a claim like any other */
        p->prof.gflops[i] = p->cfg.gflops / n_slots;
    p->prof.free_memory_bytes /= n_slots; /* the machine's memory (or its cap) is shared by the slots */
    peer_profile_format(&p->prof, p->prof_line, sizeof p->prof_line);

    /* A guest on its owner's machine (peer_guest.h). The threads that exist now are compute
     * threads (OpenBLAS's pool, the profile's OpenMP team): they take the compute priority before
     * ZeroMQ starts its I/O threads, which keep the process's own, as this thread does. */
    if (!(p->guest = peer_guest_new(&cfg->guest, cfg->threads))) {
        err = fu_errmsg_set(em, FU_EINVAL, "bad --max-cpu, --busy-percent or --hours");
        goto fail;
    }
    kern_priority got = KERN_PRIORITY_NORMAL;
    if (kern_priority_set_others(cfg->guest.priority, &got) != FU_OK || got != cfg->guest.priority)
        FU_WARN("peer", "compute threads: priority %s wanted, %s obtained", kern_priority_name(cfg->guest.priority),
                kern_priority_name(got));

    p->ctx = zmq_ctx_new();
    if (!p->ctx) {
        err = fu_errmsg_set(em, FU_EIO, "cannot make a ZeroMQ context");
        goto fail;
    }
    if (!cfg->no_listen) {
        const char *bind = cfg->data_bind && *cfg->data_bind ? cfg->data_bind : "tcp://*:7701";
        p->router = wire_socket_new(p->ctx, ZMQ_ROUTER, &err);
        if (!p->router || zmq_bind(p->router, bind) != 0) {
            err = fu_errmsg_set(
                em, FU_EIO,
                "cannot listen on --data-bind '%s': %s (or pass --no-listen to relay through the "
                "broker)",
                bind, zmq_strerror(zmq_errno()));
            goto fail;
        }
        char ep[256];
        if ((err = wire_socket_endpoint(p->router, ep, sizeof ep)) != FU_OK) {
            fu_errmsg_set(em, err, "cannot read the bound data endpoint");
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
        err = fu_errmsg_set(em, FU_EIO, "cannot make the compute pipe: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    if ((err = broker_connect_first(p, em)) != FU_OK)
        goto fail;
    if (cfg->enrol_token && *cfg->enrol_token && (err = enrol(p, em)) != FU_OK)
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
        err = fu_errmsg_set(em, FU_EIO, "cannot start the compute thread");
        goto fail;
    }
    p->compute_started = true;
    p->vin = peer_vin_asm_new(peer_link_max_tensor(p));
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
    int req = atomic_exchange(&g_pause_req, 0);
    if (req)
        peer_guest_owner_pause(p->guest, req == 1);
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
        peer_io_send_heartbeat(p, false);
}

fu_err peer_run(peer_t *p)
{
    if (!p)
        return FU_EINVAL;
    peer_io_send_hello(p);
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
        if (p->known && now - p->last_hb_ms >= p->hb_ms) {
            peer_io_send_heartbeat(p, true);
            peer_link_check_ready(p); /* a StageReady the stall test hook held back */
        }
        if (peer_io_input_paused(p))
            p->last_broker_ms = now; /* not reading the broker is not the broker's silence */
        uint64_t silent = (uint64_t)(PEER_HB_ASK_EVERY + 2) * p->hb_ms; /* an asking beat unanswered */
        if (silent < p->dead_ms)
            silent = p->dead_ms;
        if (now - p->last_broker_ms >= silent && now - p->hello_ms >= p->dead_ms) {
            if (p->welcomed)
                FU_WARN("peer", "no word from the broker for %" PRIu64 " ms: saying PeerHello again", silent);
            if (p->eps.n > 1)
                broker_move(p, "no word from the broker");
            peer_io_send_hello(p);
        }
        /* Several endpoints: one that lost its connection and did not get it back within half a
         * heartbeat (a gateway died) gives way to the next, well before the broker's silence. */
        uint64_t switch_ms = p->hb_ms / 2 > IO_SWITCH_MIN_MS ? p->hb_ms / 2 : IO_SWITCH_MIN_MS;
        if (p->eps.n > 1 && p->lost_ms && now - p->lost_ms >= switch_ms) {
            char why[64];
            snprintf(why, sizeof why, "no connection for %" PRIu64 " ms", now - p->lost_ms);
            broker_move(p, why);
        }
        if (p->job_id && p->ready_pending && now - p->assign_ms > PEER_MAX_ASSIGN_WAIT_MS) {
            FU_WARN("peer", "job %016" PRIx64 ": links not up after %d s", p->job_id, PEER_MAX_ASSIGN_WAIT_MS / 1000);
            p->assign_ms = now;
        }
        peer_io_flush_stash(p);
        peer_link_handle_held(p);
        zmq_pollitem_t items[5];
        int n = 0, i_pipe = -1, i_broker = -1, i_router = -1, i_down = -1, i_mon = -1;
        items[n] = (zmq_pollitem_t){p->pipe, 0, ZMQ_POLLIN, 0};
        i_pipe = n++;
        if (p->mon) {
            items[n] = (zmq_pollitem_t){p->mon, 0, ZMQ_POLLIN, 0};
            i_mon = n++;
        }
        if (!peer_io_input_paused(p)) {
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
        if (i_mon >= 0 && (items[i_mon].revents & ZMQ_POLLIN))
            broker_conn_events(p);
        /* Commands from the compute thread first (they free memory and open the way forward). */
        if (items[i_pipe].revents & ZMQ_POLLIN) {
            for (int k = 0; k < 64; k++) {
                peer_cmd *c = NULL;
                if (peer_cmd_recv(p->pipe, ZMQ_DONTWAIT, &c) != FU_OK)
                    break;
                peer_io_on_compute(p, c);
            }
        }
        if (i_broker >= 0 && (items[i_broker].revents & ZMQ_POLLIN)) {
            for (int k = 0; k < 64 && !peer_io_input_paused(p); k++) {
                wire_msg_t *m = NULL;
                fu_err rc = wire_recv(p->broker, WIRE_DONTWAIT, &p->counters, &m);
                if (rc == FU_EAGAIN)
                    break;
                if (rc != FU_OK) {
                    if (rc == FU_ECANCELED || rc == FU_EIO)
                        break;
                    continue;
                }
                peer_io_on_broker(p, m);
            }
        }
        if (i_router >= 0 && (items[i_router].revents & ZMQ_POLLIN))
            peer_link_read_data(p, p->router, SRC_ROUTER, false);
        if (i_down >= 0 && (items[i_down].revents & ZMQ_POLLIN))
            peer_link_read_data(p, p->down, SRC_DOWN, false);
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
    peer_link_reset(&p->links[0]);
    peer_link_reset(&p->links[1]);
    peer_vin_asm_destroy(&p->vin);
    peer_guest_destroy(&p->guest);
    wire_socket_close(&p->down);
    wire_socket_close(&p->router);
    mon_stop(p);
    wire_socket_close(&p->broker);
    if (p->pipe)
        zmq_close(p->pipe);
    if (p->ctx)
        zmq_ctx_term(p->ctx);
    wire_keypair_destroy(&p->kp);
    wire_endpoints_free(&p->eps);
    free(p->cache_dir);
    free(p);
    *p_p = NULL;
}
