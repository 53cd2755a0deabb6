#include "gateway.h"

#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "fusion.pb-c.h"
#include "wire.h"
#include "wire_socket.h"
#include "wire_zap.h"
#include "gateway_policy.h"

#define LOG "gateway"
#define GATEWAY_MONITOR "inproc://fusion-gateway-connections"
#define GATEWAY_BACK_MONITOR "inproc://fusion-gateway-broker"
#define GATEWAY_FD_MAX  (1 << 24) /* descriptors past this are not watched */

/* Who was last heard on a descriptor of the front socket: what a close of it is told as. */
typedef struct {
    uint8_t route[WIRE_GATEWAY_ROUTE_MAX];
    uint8_t route_len; /* 0: nobody heard on it since it was accepted */
    char uid[WIRE_KEY_Z85_LEN + 1];
} gw_conn;

struct gateway {
    void *ctx;
    void *front; /* ROUTER: the peers */
    void *back;  /* DEALER: the broker's gateway socket */
    void *mon;   /* PAIR: the front's connection events; NULL when they cannot be watched */
    void *back_mon; /* PAIR: the broker connection's handshakes (each is followed by GatewayHello) */
    wire_zap_t *zap;
    gateway_policy *policy; /* the broker's admission, which zap applies once it has come */
    gw_conn *conns;
    size_t n_conns;
    gateway_counters counters;
    char endpoint[256];
};

static volatile sig_atomic_t g_stop;

void gateway_request_stop(void) { g_stop = 1; }

static gw_conn *conn_at(gateway_t *g, int fd)
{
    if (fd < 0 || fd >= GATEWAY_FD_MAX)
        return NULL;
    g->conns = fu_grow_zeroed(g->conns, &g->n_conns, (size_t)fd, sizeof *g->conns);
    return &g->conns[fd];
}

/* Packs the hop of (route, uid, addr) into buf; its length, 0 when it does not fit. */
static size_t pack_hop(const uint8_t *route, size_t route_len, const char *uid, const char *addr,
                       uint8_t buf[WIRE_GATEWAY_HOP_MAX])
{
    Fusion__GatewayHop hop = FUSION__GATEWAY_HOP__INIT;
    hop.route.data = (uint8_t *)route;
    hop.route.len = route_len;
    hop.user_id = (char *)uid;
    hop.peer_address = (char *)addr;
    size_t n = fusion__gateway_hop__get_packed_size(&hop);
    if (n > WIRE_GATEWAY_HOP_MAX)
        return 0;
    return fusion__gateway_hop__pack(&hop, buf);
}

/* Tells the broker that the connection c, on which a peer was heard, has closed. */
static void tell_closed(gateway_t *g, const gw_conn *c)
{
    uint8_t hop[WIRE_GATEWAY_HOP_MAX];
    size_t hl = pack_hop(c->route, c->route_len, c->uid, "", hop);
    uint8_t *env = NULL, *body = NULL;
    size_t el = 0, bl = 0;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_GATEWAY_CLOSED};
    if (!hl || wire_encode(&h, NULL, &env, &el, &body, &bl) != FU_OK)
        return;
    if (zmq_send(g->back, hop, hl, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
        g->counters.dropped_up++;
    } else {
        (void)zmq_send(g->back, env, el, ZMQ_SNDMORE);
        (void)zmq_send(g->back, body, bl, 0);
        g->counters.closed++;
    }
    free(env);
    free(body);
}

/* Reads every connection event queued: before each message, so that a descriptor reused by a new
 * connection is known as such before that connection's messages are (as the broker does). */
static void conn_events(gateway_t *g)
{
    uint16_t ev;
    uint32_t value;
    while (g->mon && wire_monitor_next(g->mon, &ev, &value)) {
        gw_conn *c = conn_at(g, value <= (uint32_t)GATEWAY_FD_MAX ? (int)value : -1);
        if (!c)
            continue;
        if (ev == ZMQ_EVENT_DISCONNECTED && c->route_len)
            tell_closed(g, c);
        c->route_len = 0; /* closed, or a new connection on the descriptor */
    }
}

/* Receives one message of at most 3 frames from sock without waiting. Returns the frames read
 * (0: nothing queued), and sets *bad when the message had more (they are drained and dropped). */
static size_t recv3(void *sock, zmq_msg_t parts[3], bool *bad)
{
    size_t got = 0;
    *bad = false;
    for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, got || *bad ? 0 : ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&part);
            return got;
        }
        bool more = zmq_msg_more(&part);
        if (got < 3)
            parts[got++] = part;
        else {
            zmq_msg_close(&part);
            *bad = true;
        }
        if (!more)
            return got;
    }
}

static void close_parts(zmq_msg_t *parts, size_t n)
{
    for (size_t i = 0; i < n; i++)
        zmq_msg_close(&parts[i]);
}

/* Sends parts[from..3) on sock, the first with first_flags; the rest cannot fail once the first is
 * queued (a multipart message is queued whole). Closes what was not sent. */
static bool send_parts(void *sock, zmq_msg_t *parts, size_t from, int first_flags)
{
    for (size_t i = from; i < 3; i++) {
        int fl = (i + 1 < 3 ? ZMQ_SNDMORE : 0) | (i == from ? first_flags : 0);
        if (zmq_msg_send(&parts[i], sock, fl) < 0) {
            close_parts(parts + i, 3 - i);
            return false;
        }
    }
    return true;
}

/* Peers to the broker: [route] [Envelope] [body] becomes [GatewayHop] [Envelope] [body]. */
static void carry_up(gateway_t *g)
{
    for (int k = 0; k < GATEWAY_TURN_MSGS && !g_stop; k++) {
        conn_events(g);
        zmq_msg_t parts[3];
        bool bad;
        size_t got = recv3(g->front, parts, &bad);
        if (!got && !bad)
            return;
        const char *uid = got == 3 ? zmq_msg_gets(&parts[1], "User-Id") : NULL;
        const char *addr = got == 3 ? zmq_msg_gets(&parts[1], "Peer-Address") : NULL;
        size_t rl = got ? zmq_msg_size(&parts[0]) : 0;
        uint8_t hop[WIRE_GATEWAY_HOP_MAX];
        size_t hl = 0;
        if (!bad && got == 3 && uid && strlen(uid) == WIRE_KEY_Z85_LEN && rl && rl <= WIRE_GATEWAY_ROUTE_MAX)
            hl = pack_hop(zmq_msg_data(&parts[0]), rl, uid, addr && strlen(addr) < WIRE_ADDRESS_MAX ? addr : "", hop);
        if (!hl) {
            g->counters.dropped_bad++;
            close_parts(parts, got);
            continue;
        }
        gw_conn *c = conn_at(g, zmq_msg_get(&parts[1], ZMQ_SRCFD));
        if (c) { /* who a close of this connection is told about */
            memcpy(c->route, zmq_msg_data(&parts[0]), rl);
            c->route_len = (uint8_t)rl;
            memcpy(c->uid, uid, WIRE_KEY_Z85_LEN + 1);
        }
        if (zmq_send(g->back, hop, hl, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            g->counters.dropped_up++;
            close_parts(parts, 3);
            continue;
        }
        zmq_msg_close(&parts[0]);
        if (send_parts(g->back, parts, 1, 0))
            g->counters.up++;
    }
}

/* Asks the broker for its admission (GatewayHello), on each new connection to it: a restarted
 * broker's list may differ. */
static void broker_events(gateway_t *g)
{
    uint16_t ev;
    uint32_t value;
    while (g->back_mon && wire_monitor_next(g->back_mon, &ev, &value)) {
        if (ev != ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
            continue;
        wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_GATEWAY_HELLO};
        fu_err rc = wire_send(g->back, NULL, 0, &h, NULL);
        if (rc != FU_OK)
            FU_WARN(LOG, "cannot ask the broker for its admission policy: %s", fu_strerror(rc));
    }
}

/* A message of the broker to the gateway itself ([Envelope] [body], no route): its admission. */
static void own_message(gateway_t *g, zmq_msg_t parts[2])
{
    wire_msg_t *m = NULL;
    if (wire_decode(zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0]), zmq_msg_data(&parts[1]),
                    zmq_msg_size(&parts[1]), NULL, &m) != FU_OK ||
        wire_msg_type(m) != FUSION__MSG_TYPE__MSG_GATEWAY_POLICY) {
        g->counters.dropped_bad++;
    } else {
        gateway_policy_apply(g->policy, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_GATEWAY_POLICY));
    }
    wire_msg_destroy(&m);
    close_parts(parts, 2);
}

/* The broker to peers: [route] [Envelope] [body] goes out of the front socket as it is. */
static void carry_down(gateway_t *g)
{
    for (int k = 0; k < GATEWAY_TURN_MSGS && !g_stop; k++) {
        zmq_msg_t parts[3];
        bool bad;
        size_t got = recv3(g->back, parts, &bad);
        if (!got && !bad)
            return;
        if (!bad && got == 2) {
            own_message(g, parts);
            continue;
        }
        if (bad || got != 3 || zmq_msg_size(&parts[0]) == 0) { /* the broker sends nothing else */
            g->counters.dropped_bad++;
            close_parts(parts, got);
            continue;
        }
        if (send_parts(g->front, parts, 0, ZMQ_DONTWAIT)) /* gone (EHOSTUNREACH) or full: dropped */
            g->counters.down++;
        else
            g->counters.dropped_down++;
    }
}

static void log_stats(const gateway_t *g)
{
    const gateway_counters *c = &g->counters;
    FU_INFO(LOG, "%llu messages to the broker, %llu to peers, %llu closed connections told; dropped: %llu "
            "malformed, %llu with the broker's queue full, %llu to peers gone or full",
            (unsigned long long)c->up, (unsigned long long)c->down, (unsigned long long)c->closed,
            (unsigned long long)c->dropped_bad, (unsigned long long)c->dropped_up,
            (unsigned long long)c->dropped_down);
}

fu_err gateway_run(gateway_t *g)
{
    uint64_t next_stats = fu_clock_ms() + GATEWAY_STATS_MS;
    while (!g_stop) {
        zmq_pollitem_t it[4] = {{.socket = g->front, .events = ZMQ_POLLIN},
                                {.socket = g->back, .events = ZMQ_POLLIN}};
        int n = 2;
        if (g->back_mon)
            it[n++] = (zmq_pollitem_t){.socket = g->back_mon, .events = ZMQ_POLLIN};
        if (g->mon)
            it[n++] = (zmq_pollitem_t){.socket = g->mon, .events = ZMQ_POLLIN};
        if (zmq_poll(it, n, 250) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            FU_ERROR(LOG, "poll failed: %s", zmq_strerror(zmq_errno()));
            return FU_EIO;
        }
        broker_events(g);
        conn_events(g);
        if (it[0].revents & ZMQ_POLLIN)
            carry_up(g);
        if (it[1].revents & ZMQ_POLLIN)
            carry_down(g);
        if (fu_clock_ms() >= next_stats) {
            log_stats(g);
            next_stats = fu_clock_ms() + GATEWAY_STATS_MS;
        }
    }
    log_stats(g);
    return FU_OK;
}

/* Watches the front socket's connections (accepted, closed) on g->mon; a warning when it cannot:
 * crashed peers are then found by their silence only. */
static void watch_front(gateway_t *g)
{
    g->mon = wire_monitor_open(g->ctx, g->front, GATEWAY_MONITOR, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED);
    if (!g->mon)
        FU_WARN(LOG, "cannot watch the peers' connections (%s): the broker finds a crashed peer by its silence only",
                zmq_strerror(zmq_errno()));
}

gateway_t *gateway_new(const gateway_cfg *cfg, fu_err *err, fu_errmsg *em)
{
    fu_err rc = FU_EINVAL;
    gateway_t *g = fu_calloc(1, sizeof *g);
    if (!cfg || !cfg->broker || !cfg->broker_pk || !cfg->kp) {
        fu_errmsg_set(em, rc, "gateway_new: no broker endpoint, broker key or keys");
        goto fail;
    }
    const char *listen = cfg->listen ? cfg->listen : GATEWAY_LISTEN_DEFAULT;
    if ((rc = wire_curve_available(em)) != FU_OK)
        goto fail;
    if (!(g->ctx = zmq_ctx_new())) {
        fu_errmsg_set(em, rc = FU_EIO, "cannot create a ZeroMQ context: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    wire_zap_cfg zc = {.admit_any = true}; /* the broker decides what each key may do */
    if (!(g->zap = wire_zap_new(g->ctx, &zc, &rc, em)))
        goto fail;
    g->policy = gateway_policy_new(g->zap); /* until the broker's admission comes */
    if (!(g->front = wire_socket_new(g->ctx, ZMQ_ROUTER, &rc)) ||
        (rc = wire_socket_curve_server(g->front, cfg->kp, NULL)) != FU_OK ||
        (rc = wire_socket_quiet(g->front)) != FU_OK) {
        fu_errmsg_set(em, rc, "cannot make the peers' socket");
        goto fail;
    }
    watch_front(g);
    if (zmq_bind(g->front, listen) != 0) {
        fu_errmsg_set(em, rc = FU_EIO, "cannot bind %s: %s (is another gateway running on that port?)", listen,
                      zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (wire_socket_endpoint(g->front, g->endpoint, sizeof g->endpoint) != FU_OK)
        snprintf(g->endpoint, sizeof g->endpoint, "%s", listen);
    /* The broker's side: its routing id is the gateway's own (not a zero byte first, as libzmq's are), so
     * a reconnection takes over the old one and the routes the broker holds stay good. */
    uint8_t id[1 + 16] = {'G'};
    memcpy(id + 1, wire_keypair_public(cfg->kp), 16);
    int hwm = GATEWAY_HWM;
    if (!(g->back = wire_socket_new(g->ctx, ZMQ_DEALER, &rc)) ||
        (rc = wire_socket_curve_client(g->back, cfg->kp, cfg->broker_pk)) != FU_OK ||
        zmq_setsockopt(g->back, ZMQ_ROUTING_ID, id, sizeof id) != 0 ||
        zmq_setsockopt(g->back, ZMQ_SNDHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(g->back, ZMQ_RCVHWM, &hwm, sizeof hwm) != 0) {
        fu_errmsg_set(em, rc = rc == FU_OK ? FU_EIO : rc, "cannot make the broker's socket");
        goto fail;
    }
    g->back_mon = wire_monitor_open(g->ctx, g->back, GATEWAY_BACK_MONITOR, ZMQ_EVENT_HANDSHAKE_SUCCEEDED);
    if (!g->back_mon)
        FU_WARN(LOG, "cannot watch the broker connection (%s): every key is admitted, the broker decides",
                zmq_strerror(zmq_errno()));
    if (zmq_connect(g->back, cfg->broker) != 0) {
        fu_errmsg_set(em, rc = FU_EINVAL, "cannot connect to %s: %s", cfg->broker, zmq_strerror(zmq_errno()));
        goto fail;
    }
    FU_INFO(LOG, "carrying peers from %s as %s to the broker at %s", g->endpoint, wire_keypair_public_z85(cfg->kp),
            cfg->broker);
    if (err)
        *err = FU_OK;
    return g;
fail:
    if (err)
        *err = rc == FU_OK ? FU_EINVAL : rc;
    gateway_destroy(&g);
    return NULL;
}

const char *gateway_endpoint(const gateway_t *g) { return g->endpoint; }

void gateway_get_counters(const gateway_t *g, gateway_counters *out) { *out = g->counters; }

void gateway_destroy(gateway_t **g_p)
{
    if (!g_p || !*g_p)
        return;
    gateway_t *g = *g_p;
    wire_monitor_close(g->front, &g->mon);
    wire_monitor_close(g->back, &g->back_mon);
    wire_socket_close(&g->front);
    wire_socket_close(&g->back);
    wire_zap_destroy(&g->zap);
    gateway_policy_destroy(&g->policy);
    if (g->ctx)
        zmq_ctx_term(g->ctx);
    free(g->conns);
    free(g);
    *g_p = NULL;
}
