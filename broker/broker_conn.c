/* broker_conn: the ROUTER's connections. A peer that crashes (killed, out of memory, its process
 * aborted) has its TCP connection closed by its kernel, and the broker's libzmq sees that within a
 * millisecond; its heartbeats would take dead_after_ms (three intervals) to tell. The ROUTER's socket
 * monitor reports every connection accepted and closed with its descriptor, and every message says
 * the descriptor it came in on (wire_msg_src_fd), so a closed connection names the peer last heard on
 * it, and the peer is declared dead "connection closed" unless it is heard again within
 * close_grace_ms.
 *
 * Two things make that naming uncertain, and are settled here:
 * - Descriptors are reused: a connection accepted after the close may get the same number. Each
 *   descriptor has an epoch (connections accepted on it so far). The monitor is read before every
 *   message of the ROUTER (broker_conn_events), and a new connection's accept is reported before its
 *   CURVE handshake even starts, so its first message is read after its accept and after the close
 *   of the connection that had the descriptor before it.
 * - The monitor and the ROUTER are two queues with no order between them: what the closed connection
 *   sent before it closed may be read after its close. A message on the closed connection's
 *   descriptor in the same epoch is such a late one: it is handled as usual but does not count as
 *   hearing the peer again; one on another descriptor, or after a new accept on the same one, does.
 *
 * The grace: libzmq reconnects a dropped connection by itself (after WIRE_RECONNECT_MS), and a peer
 * that opened a new socket says PeerHello at once (the same session keeps its work); a quarter of the
 * heartbeat interval, at least twice the reconnect interval, at most BROKER_CLOSE_GRACE_MAX_MS so that
 * a crashed stage holder is replaced well under a second after its crash. A live peer whose
 * connection only dropped and that does not speak within the grace is declared dead too, and
 * registers again at its next heartbeat (refused: "declared dead"): what a crash would have cost.
 * Silent peers whose connection stays open (SIGSTOP, a cut cable) still go by their heartbeats
 * (broker_peers_sweep), and so does a peer whose last heartbeat said it is paused: it keeps the grace
 * its pause gives (docs/BROKER.md "Paused peers"). Their connection does not stay open for ever:
 * libzmq closes it when its ZMTP pings go unanswered for WIRE_HEARTBEAT_TIMEOUT_MS. A close after that
 * much silence is such a timeout, not a crash (a crashed peer spoke within its last heartbeat
 * interval), and is left to the heartbeats; with intervals of BROKER_SILENT_CLOSE_MS and more a crash
 * late in an interval looks the same and is found by its silence too. Everything here is O(1) per
 * event and message. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_log.h"
#include "wire_socket.h"

#define LOG "registry"
#define BROKER_CONN_MONITOR       "inproc://fusion-broker-connections"
#define BROKER_CONN_FD_MAX        (1 << 24) /* descriptors past this are not watched (never seen) */
#define BROKER_CLOSE_GRACE_MAX_MS 250u      /* longest grace of a closed connection */
#define BROKER_CLOSE_GRACE_MIN_MS (2u * WIRE_RECONNECT_MS) /* shortest: a reconnect and its handshake */
/* A connection closed after this much silence was closed by libzmq's ZMTP ping timeout (no byte for
 * WIRE_HEARTBEAT_TIMEOUT_MS), not by a crash: the peer is stopped or cut off, and goes by its
 * heartbeats. Half a ping interval below the timeout, for the loop's lag in reading. */
#define BROKER_SILENT_CLOSE_MS (WIRE_HEARTBEAT_TIMEOUT_MS - WIRE_HEARTBEAT_IVL_MS / 2)

void broker_conn_open(broker_t *b)
{
    uint32_t g = b->cfg.heartbeat_ms / 4;
    if (g < BROKER_CLOSE_GRACE_MIN_MS)
        g = BROKER_CLOSE_GRACE_MIN_MS;
    if (g > BROKER_CLOSE_GRACE_MAX_MS)
        g = BROKER_CLOSE_GRACE_MAX_MS;
    b->close_grace_ms = g;
    /* the loop reads it before every message */
    b->mon = wire_monitor_open(b->ctx, b->sock, BROKER_CONN_MONITOR, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED);
    if (!b->mon)
        FU_WARN(LOG, "cannot watch the connections of the broker's socket (%s): a crashed peer is declared dead by "
                "its silence only (%u ms)", zmq_strerror(zmq_errno()), b->dead_after_ms);
}

void broker_conn_close(broker_t *b)
{
    wire_monitor_close(b->sock, &b->mon);
    free(b->conns);
    b->conns = NULL;
    b->n_conns = 0;
    free(b->closing);
    b->closing = NULL;
    b->n_closing = b->closing_head = b->cap_closing = 0;
}

/* The record of descriptor fd (grown on first use), NULL when fd is none or out of range. */
static broker_conn *conn_at(broker_t *b, int fd)
{
    if (fd < 0 || fd >= BROKER_CONN_FD_MAX)
        return NULL;
    b->conns = fu_grow_zeroed(b->conns, &b->n_conns, (size_t)fd, sizeof *b->conns);
    return &b->conns[fd];
}

/* p's connection closed at now: dead unless heard again within close_grace_ms. Queues its grace
 * (the queue is in due order: one grace for all). */
static void grace_start(broker_t *b, broker_peer *p, uint64_t now)
{
    p->closed_ms = now ? now : 1;
    FU_DEBUG(LOG, "peer %.8s (%s): its connection closed; dead unless heard again within %u ms", p->key, p->name,
             b->close_grace_ms);
    if (b->closing_head == b->n_closing) {
        b->closing_head = b->n_closing = 0;
    } else if (b->n_closing == b->cap_closing && b->closing_head > 0) {
        memmove(b->closing, b->closing + b->closing_head, (b->n_closing - b->closing_head) * sizeof *b->closing);
        b->n_closing -= b->closing_head;
        b->closing_head = 0;
    }
    if (b->n_closing == b->cap_closing) {
        b->cap_closing = b->cap_closing ? 2 * b->cap_closing : 64;
        b->closing = fu_realloc(b->closing, b->cap_closing * sizeof *b->closing);
    }
    b->closing[b->n_closing++] =
        (broker_closing){.peer = (uint32_t)(p - b->peers), .closed_ms = p->closed_ms, .due_ms = now + b->close_grace_ms};
}

/* Slot s of p's process: p itself for its own slot, else looked up (NULL when not registered). The
 * slots of one process share its connection. */
static broker_peer *slot_of(broker_t *b, broker_peer *p, uint32_t s)
{
    if (s == p->slot)
        return p;
    char id[DB_KEY_LEN + 1];
    broker_peer_id(p->pk, s, id);
    return broker_peer_find(b, id);
}

/* p, whose connection closed, was heard again on another one. */
static void heard_again(broker_t *b, broker_peer *p)
{
    p->closed_ms = 0;
    b->tot.conn_reheard++;
    FU_INFO(LOG, "peer %.8s (%s) was heard again on a new connection after its connection closed", p->key, p->name);
}

/* The connection on descriptor fd closed: every live slot last heard on it starts its grace. */
static void on_closed(broker_t *b, int fd, uint64_t now)
{
    broker_conn *c = conn_at(b, fd);
    if (!c)
        return;
    uint32_t owner = c->peer;
    c->peer = 0;
    if (!owner || owner > b->n_peers)
        return;
    broker_peer *p = &b->peers[owner - 1];
    if (!p->live || p->conn_fd != fd + 1)
        return; /* gone already, or it speaks on another connection since */
    if (now - p->last_heard_ms >= BROKER_SILENT_CLOSE_MS) {
        /* libzmq's ZMTP ping timed out: the peer was silent, not crashed (see above) */
        FU_DEBUG(LOG, "peer %.8s (%s): its connection timed out after %llu ms of silence; judged by its heartbeats",
                 p->key, p->name, (unsigned long long)(now - p->last_heard_ms));
        return;
    }
    for (uint32_t s = 0; s < p->n_slots && s < BROKER_MAX_SLOTS; s++) { /* at most BROKER_MAX_SLOTS lookups */
        broker_peer *q = slot_of(b, p, s);
        if (!q || !q->live || q->conn_fd != fd + 1 || q->closed_ms)
            continue;
        grace_start(b, q, now);
        q->closed_epoch = c->epoch;
    }
}

void broker_conn_events(broker_t *b)
{
    uint16_t ev;
    uint32_t value;
    while (b->mon && wire_monitor_next(b->mon, &ev, &value)) {
        int fd = value <= (uint32_t)BROKER_CONN_FD_MAX ? (int)value : -1;
        if (ev == ZMQ_EVENT_ACCEPTED) {
            broker_conn *c = conn_at(b, fd);
            if (c) { /* a new connection: whoever was heard on this number before is not on it */
                c->epoch++;
                c->peer = 0;
            }
        } else if (ev == ZMQ_EVENT_DISCONNECTED) {
            on_closed(b, fd, broker_now());
        }
    }
}

/* FNV-1a of a route (never 0: 0 means none). */
static uint64_t route_hash(const uint8_t *r, size_t n)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ r[i]) * 1099511628211ull;
    return h ? h : 1;
}

/* p was heard through a gateway: a message on the route that closed is a late one; any other is
 * the peer again. Its direct connection, if it had one, is not its own any more. */
static void gateway_heard(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    if (p->closed_ms) {
        if (p->closed_route == route_hash(rid, rl))
            return;
        heard_again(b, p);
    }
    p->closed_route = 0;
    if (p->conn_fd) {
        broker_conn *old = b->mon ? conn_at(b, p->conn_fd - 1) : NULL;
        if (old && old->peer == (uint32_t)(p - b->peers) + 1)
            old->peer = 0;
        p->conn_fd = 0;
    }
}

void broker_conn_gateway_closed(broker_t *b, const wire_msg_t *msg)
{
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    char id[DB_KEY_LEN + 1];
    broker_peer *p = broker_msg_peer_id(msg, id) ? broker_peer_find(b, id) : NULL;
    uint64_t now = broker_now();
    if (!p || !p->live)
        return;
    if (now - p->last_heard_ms >= BROKER_SILENT_CLOSE_MS)
        return; /* silent that long: stopped or cut off, judged by its heartbeats (see above) */
    for (uint32_t s = 0; s < p->n_slots && s < BROKER_MAX_SLOTS; s++) {
        broker_peer *q = slot_of(b, p, s);
        if (!q || !q->live || q->closed_ms || q->rid_len != rl || memcmp(q->rid, rid, rl) != 0)
            continue; /* gone, closing already, or it speaks on another connection since */
        grace_start(b, q, now);
        q->closed_route = route_hash(rid, rl);
    }
}

void broker_conn_heard(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    if (wire_msg_gateway(msg)[0]) {
        gateway_heard(b, p, msg);
        return;
    }
    int fd = wire_msg_src_fd(msg);
    broker_conn *c = b->mon ? conn_at(b, fd) : NULL;
    if (!c)
        return;
    if (p->closed_ms) {
        if (!p->closed_route && p->conn_fd == fd + 1 && c->epoch == p->closed_epoch)
            return; /* a late message of the closed connection: proves nothing */
        heard_again(b, p);
    }
    p->closed_route = 0;
    uint32_t idx = (uint32_t)(p - b->peers) + 1;
    if (p->conn_fd && p->conn_fd != fd + 1) {
        broker_conn *old = conn_at(b, p->conn_fd - 1);
        if (old && old->peer == idx)
            old->peer = 0;
    }
    p->conn_fd = fd + 1;
    c->peer = idx;
}

uint64_t broker_conn_sweep(broker_t *b)
{
    uint64_t now = broker_now();
    while (b->closing_head < b->n_closing) {
        const broker_closing e = b->closing[b->closing_head];
        /* Judged as of the last turn that read the socket empty: a message on a new connection may be
         * waiting unread behind a long turn. */
        if (e.due_ms > b->drained_ms)
            return e.due_ms > now ? e.due_ms - now : 0;
        b->closing_head++;
        broker_peer *p = e.peer < b->n_peers ? &b->peers[e.peer] : NULL;
        if (!p || p->closed_ms != e.closed_ms)
            continue; /* heard again, or closed again later (its own entry) */
        p->closed_ms = 0;
        if (!p->live)
            continue; /* gone meanwhile (a Leave read after the close, its silence) */
        if (p->paused) {
            FU_INFO(LOG, "peer %.8s (%s): its connection closed while it is paused (%s); its heartbeats decide",
                    p->key, p->name, p->pause_reason);
            continue;
        }
        char why[96];
        snprintf(why, sizeof why, "connection closed (not heard again within %u ms)", b->close_grace_ms);
        b->tot.conn_deaths++;
        broker_peer_gone(b, p, false, why);
    }
    b->closing_head = b->n_closing = 0;
    return UINT64_MAX;
}
