/* A simulated peer: its socket (a CURVE DEALER with its own key pair), PeerHello, heartbeats, the
 * broker's messages, StageReady when its simulated weight load is done, and its departures (a Leave,
 * or a crash: the socket just closes) and returns. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>

#include <zmq.h>

#include "swarm_internal.h"
#include "wire_socket.h"

/* epoll's tag of a handle: peer i is i, client k is SWARM_MAX_PEERS + k. */
static uint32_t tag_of(int handle)
{
    return handle >= 0 ? (uint32_t)handle : (uint32_t)(SWARM_MAX_PEERS + (-1 - handle));
}

static void **sock_of(swarm *s, int handle)
{
    return handle >= 0 ? &s->peers[handle].sock : &s->clients[-1 - handle].sock;
}

/* A CURVE DEALER to the broker (a peer's through its gateway, with --gateways) with key pair (pk, sk),
 * its ZMQ_FD added to the epoll set under handle. */
static fu_err open_socket(swarm *s, int handle, const uint8_t *pk, const uint8_t *sk, int *fd_out)
{
    fu_err rc = FU_OK;
    void *sock = wire_socket_new(s->ctx, ZMQ_DEALER, &rc);
    if (!sock)
        return rc;
    if (!s->cfg.zmtp_ping && wire_socket_quiet(sock) != FU_OK) { /* as fusion-peer's: swarm_cfg.zmtp_ping */
        wire_socket_close(&sock);
        return FU_EIO;
    }
    int gw = handle >= 0 && s->n_gw ? handle % s->n_gw : -1; /* peers through a gateway, clients direct */
    const uint8_t *server_pk = gw >= 0 ? s->gw_pk[gw] : s->broker_pk;
    const char *endpoint = gw >= 0 ? s->gw_endpoint[gw] : s->endpoint;
    wire_keypair_t *kp = wire_keypair_from_bytes(pk, sk);
    if (!kp || wire_socket_curve_client(sock, kp, server_pk) != FU_OK || zmq_connect(sock, endpoint) != 0) {
        wire_keypair_destroy(&kp);
        wire_socket_close(&sock);
        return FU_EIO;
    }
    wire_keypair_destroy(&kp);
    int fd = -1;
    size_t fl = sizeof fd;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = tag_of(handle)};
    if (zmq_getsockopt(sock, ZMQ_FD, &fd, &fl) != 0 || epoll_ctl(s->ep, EPOLL_CTL_ADD, fd, &ev) != 0) {
        fprintf(stderr, "bench-swarm: cannot watch a socket: %s\n", zmq_strerror(zmq_errno()));
        wire_socket_close(&sock);
        return FU_EIO;
    }
    *sock_of(s, handle) = sock;
    *fd_out = fd;
    return FU_OK;
}

static void close_socket(swarm *s, int handle, int fd)
{
    void **sock = sock_of(s, handle);
    if (!*sock)
        return;
    (void)epoll_ctl(s->ep, EPOLL_CTL_DEL, fd, NULL);
    wire_socket_close(sock);
}

fu_err swarm_peer_send(swarm *s, int i, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body)
{
    swarm_peer *p = &s->peers[i];
    if (!p->sock)
        return FU_EINVAL;
    wire_hdr h = {.type = t, .job_id = job, .sequence = ++p->seq};
    fu_err rc = wire_send(p->sock, NULL, 0, &h, body);
    swarm_mark(s, i); /* a send may have taken the socket's read signal: look again after this turn */
    return rc;
}

static void send_hello(swarm *s, int i)
{
    swarm_peer *p = &s->peers[i];
    Fusion__DtypeSpeed sp = FUSION__DTYPE_SPEED__INIT;
    sp.dtype = FUSION__DTYPE__DTYPE_F32;
    sp.gemm_gflops = p->gflops;
    Fusion__DtypeSpeed *spp = &sp;
    Fusion__PeerProfile pr = FUSION__PEER_PROFILE__INIT;
    pr.n_speeds = 1;
    pr.speeds = &spp;
    pr.free_memory_bytes = p->mem;
    pr.backend = FUSION__BACKEND__BACKEND_CUDA;
    pr.device_name = (char *)p->gpu->name;
    pr.link_bandwidth_bps = p->link->up_mbit * 125000.0;
    pr.link_latency_ms = p->link->rtt_ms;
    pr.threads = 1;
    Fusion__PeerHello h = FUSION__PEER_HELLO__INIT;
    h.session = p->session;
    h.name = p->name;
    h.software = (char *)"fusion bench-swarm";
    h.profile = &pr;
    h.needs_relay = true; /* no data plane in the simulation: nobody connects to it */
    p->hello_ms = swarm_now();
    (void)swarm_peer_send(s, i, FUSION__MSG_TYPE__MSG_PEER_HELLO, 0, &h.base);
}

fu_err swarm_peer_connect(swarm *s, int i)
{
    swarm_peer *p = &s->peers[i];
    fu_err rc = open_socket(s, i, p->pk, p->sk, &p->fd);
    if (rc != FU_OK)
        return rc;
    p->st = SP_JOINING;
    p->session = (uint64_t)(swarm_uniform(&s->rng) * 1.8e19) | 1u;
    p->seq = 0;
    p->job = -1;
    p->ready_ms = 0;
    uint64_t now = swarm_now();
    p->hb_ms = (uint32_t)s->cfg.heartbeat_ms;
    p->next_hb_ms = now + (uint64_t)(swarm_uniform(&s->rng) * p->hb_ms); /* spread the beats */
    p->session_end_ms = s->cfg.session_mean_s > 0 ? now + (uint64_t)(1000 * swarm_exp(&s->rng, s->cfg.session_mean_s))
                                                   : 0;
    p->rejoin_ms = 0;
    send_hello(s, i);
    return FU_OK;
}

void swarm_peer_disconnect(swarm *s, int i)
{
    swarm_peer *p = &s->peers[i];
    swarm_job_peer_gone(s, i);
    close_socket(s, i, p->fd);
    p->st = SP_OFFLINE;
    p->job = -1;
    p->ready_ms = 0;
}

/* The peer goes away now: Leave first when clean, then its socket closes; it comes back later. */
static void depart(swarm *s, int i, uint64_t now)
{
    swarm_peer *p = &s->peers[i];
    bool clean = swarm_uniform(&s->rng) < s->cfg.clean_leave;
    s->departures++;
    s->crashes += !clean;
    if (clean && p->st == SP_ONLINE) {
        Fusion__Leave l = FUSION__LEAVE__INIT;
        l.reason = (char *)"session over";
        (void)swarm_peer_send(s, i, FUSION__MSG_TYPE__MSG_LEAVE, 0, &l.base);
    }
    swarm_peer_disconnect(s, i);
    p->rejoin_ms = now + 1 + (uint64_t)(1000 * swarm_exp(&s->rng, s->cfg.offline_mean_s));
}

void swarm_peer_timers(swarm *s, int i, uint64_t now)
{
    swarm_peer *p = &s->peers[i];
    if (p->st == SP_OFFLINE) {
        if (p->rejoin_ms && now >= p->rejoin_ms && swarm_peer_connect(s, i) != FU_OK)
            p->rejoin_ms = now + 1000;
        return;
    }
    if (s->churn && p->session_end_ms && now >= p->session_end_ms) {
        depart(s, i, now);
        return;
    }
    if (p->st == SP_JOINING && now - p->hello_ms > 10000) /* no welcome: say it again */
        send_hello(s, i);
    if (p->st == SP_ONLINE && now >= p->next_hb_ms) {
        Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
        hb.time_ms = (int64_t)now;
        hb.quiet = !s->cfg.loud_heartbeats && p->hb_n++ % SWARM_HB_ASK_EVERY != 0; /* as fusion-peer's */
        const swarm_job *j = p->job >= 0 && !p->backup ? &s->jobs[p->job] : NULL;
        hb.state = j ? FUSION__PEER_STATE__PEER_STATE_BUSY : FUSION__PEER_STATE__PEER_STATE_IDLE;
        if (j && j->running) {
            hb.step = j->step + 1;
            hb.forward_done = (uint32_t)j->micro;
            hb.backward_done = 0;
        }
        (void)swarm_peer_send(s, i, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base);
        p->next_hb_ms += p->hb_ms;
        if (p->next_hb_ms < now) /* a slow turn: no burst of catch-up beats */
            p->next_hb_ms = now + p->hb_ms;
    }
    if (p->ready_ms && now >= p->ready_ms && p->job >= 0) {
        p->ready_ms = 0;
        Fusion__StageReady r = FUSION__STAGE_READY__INIT;
        r.job_id = s->jobs[p->job].id;
        r.stage_index = p->stage;
        (void)swarm_peer_send(s, i, FUSION__MSG_TYPE__MSG_STAGE_READY, r.job_id, &r.base);
    }
}

void swarm_peer_on_message(swarm *s, int i, const wire_msg_t *m)
{
    swarm_peer *p = &s->peers[i];
    switch (wire_msg_type(m)) {
    case FUSION__MSG_TYPE__MSG_PEER_WELCOME: {
        const Fusion__PeerWelcome *w = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_WELCOME);
        if (w && w->heartbeat_ms >= 50)
            p->hb_ms = w->heartbeat_ms;
        if (p->st == SP_JOINING && !p->ever_joined)
            s->joined++;
        p->ever_joined = true;
        p->st = SP_ONLINE;
        break;
    }
    case FUSION__MSG_TYPE__MSG_HEARTBEAT: /* the answer to a beat that asked (the broker counts beats) */
        break;
    case FUSION__MSG_TYPE__MSG_STAGE_ASSIGN: {
        const Fusion__StageAssign *a = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN);
        if (a)
            swarm_job_on_assign(s, i, a);
        break;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_START: {
        const Fusion__StageStart *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_START);
        if (st)
            swarm_job_on_start(s, i, st);
        break;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_RELEASE: {
        const Fusion__StageRelease *r = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_RELEASE);
        if (r)
            swarm_job_on_release(s, i, r->job_id, r->stage_index);
        break;
    }
    case FUSION__MSG_TYPE__MSG_ERROR: {
        const Fusion__Error *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        s->errors++;
        if (e && s->errors <= 10 && !s->cfg.quiet)
            fprintf(stderr, "bench-swarm: peer %s got Error %d (to %d): %s\n", p->name, (int)e->code,
                    (int)e->in_reply_to, e->message);
        if (e && e->code == FUSION__ERROR_CODE__ERR_NOT_FOUND && e->in_reply_to == FUSION__MSG_TYPE__MSG_HEARTBEAT) {
            p->st = SP_JOINING; /* the broker forgot us: register again */
            swarm_job_peer_gone(s, i);
            p->job = -1;
            send_hello(s, i);
        }
        break;
    }
    default:
        break;
    }
}

static void on_message(swarm *s, int handle, const wire_msg_t *m)
{
    if (handle >= 0)
        swarm_peer_on_message(s, handle, m);
    else
        swarm_client_on_message(s, -1 - handle, m);
}

void swarm_mark(swarm *s, int handle)
{
    bool *flag = handle >= 0 ? &s->peers[handle].dirty : &s->clients[-1 - handle].dirty;
    if (*flag)
        return;
    *flag = true;
    s->dirty[s->n_dirty++] = handle;
}

void swarm_drain_marked(swarm *s)
{
    while (s->n_dirty > 0) {
        int h = s->dirty[--s->n_dirty];
        if (h >= 0)
            s->peers[h].dirty = false;
        else
            s->clients[-1 - h].dirty = false;
        swarm_drain(s, h);
    }
}

void swarm_drain(swarm *s, int handle)
{
    for (int k = 0; k < 64; k++) {
        void *sock = *sock_of(s, handle);
        if (!sock)
            return;
        int ev = 0;
        size_t el = sizeof ev;
        if (zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &el) != 0 || !(ev & ZMQ_POLLIN))
            return;
        wire_msg_t *m = NULL;
        fu_err rc = wire_recv(sock, WIRE_DONTWAIT, &s->counters, &m);
        if (rc == FU_EAGAIN)
            return;
        if (rc != FU_OK)
            continue;
        on_message(s, handle, m);
        wire_msg_destroy(&m);
    }
}

fu_err swarm_client_connect(swarm *s, int k)
{
    swarm_client *c = &s->clients[k];
    return open_socket(s, -1 - k, c->pk, c->sk, &c->fd);
}
