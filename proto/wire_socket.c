#include "wire_socket.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <zmq.h>

#include "fu_log.h"
#include "wire.h"

/* A draft option in zmq.h 4.3 that the released library accepts. */
#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93
#endif

static int setopt_int(void *sock, int opt, int v)
{
    return zmq_setsockopt(sock, opt, &v, sizeof v);
}

void *wire_socket_new(void *ctx, int type, fu_err *err)
{
    fu_err rc = FU_EINVAL;
    void *s = ctx ? zmq_socket(ctx, type) : NULL;
    if (!s) {
        rc = ctx && zmq_errno() == ETERM ? FU_ECANCELED : FU_EINVAL;
        goto fail;
    }
    int64_t maxmsg = WIRE_MAX_MSG_BYTES;
    int bad = 0;
    bad |= setopt_int(s, ZMQ_LINGER, WIRE_LINGER_MS);
    bad |= zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    bad |= setopt_int(s, ZMQ_SNDHWM, WIRE_HWM);
    bad |= setopt_int(s, ZMQ_RCVHWM, WIRE_HWM);
    bad |= setopt_int(s, ZMQ_HEARTBEAT_IVL, WIRE_HEARTBEAT_IVL_MS);
    bad |= setopt_int(s, ZMQ_HEARTBEAT_TIMEOUT, WIRE_HEARTBEAT_TIMEOUT_MS);
    bad |= setopt_int(s, ZMQ_HEARTBEAT_TTL, WIRE_HEARTBEAT_TIMEOUT_MS);
    bad |= setopt_int(s, ZMQ_SNDTIMEO, WIRE_SEND_TIMEOUT_MS);
    bad |= setopt_int(s, ZMQ_HANDSHAKE_IVL, WIRE_HANDSHAKE_MS);
    bad |= setopt_int(s, ZMQ_RECONNECT_IVL, WIRE_RECONNECT_MS);
    bad |= setopt_int(s, ZMQ_RECONNECT_IVL_MAX, WIRE_RECONNECT_MAX_MS);
    if (type == ZMQ_ROUTER) {
        bad |= setopt_int(s, ZMQ_ROUTER_MANDATORY, 1);
        /* A ROUTER serves many peers from one event loop: a peer whose queue is full must not
         * stall the others, so sends to it fail at once (FU_EAGAIN) instead of waiting. */
        bad |= setopt_int(s, ZMQ_SNDTIMEO, 0);
    }
    if (bad) {
        FU_ERROR("wire", "setting socket options failed: %s", zmq_strerror(zmq_errno()));
        zmq_close(s);
        rc = FU_EIO;
        goto fail;
    }
    if (err)
        *err = FU_OK;
    return s;
fail:
    if (err)
        *err = rc;
    return NULL;
}

fu_err wire_socket_quiet(void *sock)
{
    int bad = 0;
    bad |= setopt_int(sock, ZMQ_HEARTBEAT_IVL, 0);
    bad |= setopt_int(sock, ZMQ_TCP_KEEPALIVE, 1);
    bad |= setopt_int(sock, ZMQ_TCP_KEEPALIVE_IDLE, WIRE_KEEPALIVE_IDLE_S);
    bad |= setopt_int(sock, ZMQ_TCP_KEEPALIVE_INTVL, WIRE_KEEPALIVE_INTVL_S);
    bad |= setopt_int(sock, ZMQ_TCP_KEEPALIVE_CNT, WIRE_KEEPALIVE_CNT);
    bad |= setopt_int(sock, ZMQ_TCP_MAXRT, WIRE_TCP_MAXRT_MS);
    if (bad) {
        FU_WARN("wire", "cannot make a socket quiet: %s", zmq_strerror(zmq_errno()));
        return FU_EIO;
    }
    return FU_OK;
}

void wire_socket_close(void **sock_p)
{
    if (!sock_p || !*sock_p)
        return;
    zmq_close(*sock_p);
    *sock_p = NULL;
}

fu_err wire_curve_available(fu_errmsg *em)
{
    int major, minor, patch;
    zmq_version(&major, &minor, &patch);
    int v = major * 10000 + minor * 100 + patch;
    if (v < WIRE_CURVE_MIN_ZMQ_VERSION)
        return fu_errmsg_set(
            em, FU_EVERSION,
            "libzmq %d.%d.%d is too old to serve CURVE safely (CVE-2020-15166); install libzmq "
            "4.3.3 or newer",
            major, minor, patch);
    if (!zmq_has("curve"))
        return fu_errmsg_set(em, FU_ENOSYS,
                             "this libzmq was built without CURVE; install a libzmq built with libsodium");
    return FU_OK;
}

fu_err wire_socket_curve_server(void *sock, const wire_keypair_t *kp, const char *domain)
{
    if (!sock || !kp)
        return FU_EINVAL;
    fu_errmsg em = {0};
    fu_err rc = wire_curve_available(&em);
    if (rc != FU_OK) {
        FU_ERROR("wire", "refusing to open a CURVE listener: %s", fu_errmsg_text(&em, rc));
        return rc;
    }
    const char *dom = domain ? domain : WIRE_ZAP_DOMAIN;
    if (setopt_int(sock, ZMQ_CURVE_SERVER, 1) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, wire_keypair_secret(kp), WIRE_KEY_BYTES) != 0 ||
        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, dom, strlen(dom)) != 0 ||
        setopt_int(sock, ZMQ_ZAP_ENFORCE_DOMAIN, 1) != 0)
        return FU_EINVAL;
    return FU_OK;
}

fu_err wire_socket_curve_client(void *sock, const wire_keypair_t *kp, const uint8_t server_pk[WIRE_KEY_BYTES])
{
    if (!sock || !kp || !server_pk)
        return FU_EINVAL;
    if (!zmq_has("curve"))
        return FU_ENOSYS;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_pk, WIRE_KEY_BYTES) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, wire_keypair_public(kp), WIRE_KEY_BYTES) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, wire_keypair_secret(kp), WIRE_KEY_BYTES) != 0)
        return FU_EINVAL;
    return FU_OK;
}

fu_err wire_socket_endpoint(void *sock, char *buf, size_t cap)
{
    if (!sock || !buf || cap == 0)
        return FU_EINVAL;
    size_t sz = cap;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, buf, &sz) != 0)
        return FU_EINVAL;
    return FU_OK;
}

void *wire_monitor_open(void *ctx, void *sock, const char *endpoint, int events)
{
    if (zmq_socket_monitor(sock, endpoint, events) != 0)
        return NULL;
    void *m = zmq_socket(ctx, ZMQ_PAIR);
    int zero = 0;
    if (!m || zmq_setsockopt(m, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_setsockopt(m, ZMQ_RCVHWM, &zero, sizeof zero) != 0 || zmq_connect(m, endpoint) != 0) {
        int e = zmq_errno();
        if (m)
            zmq_close(m);
        (void)zmq_socket_monitor(sock, NULL, 0);
        errno = e;
        return NULL;
    }
    return m;
}

void wire_monitor_close(void *sock, void **mon_p)
{
    if (!*mon_p)
        return;
    (void)zmq_socket_monitor(sock, NULL, 0);
    zmq_close(*mon_p);
    *mon_p = NULL;
}

bool wire_monitor_next(void *mon, uint16_t *event, uint32_t *value)
{
    zmq_msg_t f;
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&f);
        return false;
    }
    *event = 0;
    *value = 0;
    if (zmq_msg_size(&f) >= 6) { /* the event (2 bytes) and its value (4 bytes) */
        memcpy(event, zmq_msg_data(&f), sizeof *event);
        memcpy(value, (const uint8_t *)zmq_msg_data(&f) + 2, sizeof *value);
    }
    while (zmq_msg_more(&f)) { /* the endpoint: not needed */
        zmq_msg_close(&f);
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, mon, 0) < 0)
            break;
    }
    zmq_msg_close(&f);
    return true;
}
