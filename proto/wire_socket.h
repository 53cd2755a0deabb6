/* wire_socket: every fusion ZeroMQ socket is made here, with its options chosen in one place, and
 * CURVE is switched on here.
 *
 * Options set on every socket (values below, reasons beside them):
 *   ZMQ_LINGER            WIRE_LINGER_MS     libzmq's default (-1) hangs zmq_ctx_term on unsent data
 *   ZMQ_MAXMSGSIZE        WIRE_MAX_MSG_BYTES a peer cannot make us buffer an unbounded frame; an
 *                                            oversized frame drops that connection (PITFALLS.md)
 *   ZMQ_SNDHWM/RCVHWM     WIRE_HWM           bounds queued memory (default 1000 x 32 MiB frames)
 *   ZMQ_HEARTBEAT_IVL     1000 ms            ZMTP PINGs notice a stopped or cut-off peer in ~4 s
 *   ZMQ_HEARTBEAT_TIMEOUT 3000 ms            (without them: 20 s and more)
 *   ZMQ_HEARTBEAT_TTL     3000 ms            the other side drops us as quickly
 *                                            (no pings on a quiet socket: wire_socket_quiet)
 *   ZMQ_SNDTIMEO          WIRE_SEND_TIMEOUT_MS a blocked send (full HWM) fails instead of hanging;
 *                         0 on ROUTER     one slow peer never stalls a daemon's event loop
 *   ZMQ_HANDSHAKE_IVL     WIRE_HANDSHAKE_MS  half-open handshakes are shed
 *   ZMQ_RECONNECT_IVL(_MAX) 100 / 5000 ms    quick reconnect with back-off
 *   ZMQ_ROUTER_MANDATORY  1 (ROUTER only)    a send to an unknown peer fails (EHOSTUNREACH ->
 *                                            FU_ENOTFOUND) instead of vanishing
 * Threads: a socket belongs to the thread that uses it; these helpers keep no state. */
#ifndef FU_WIRE_SOCKET_H
#define FU_WIRE_SOCKET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "wire_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

#define WIRE_LINGER_MS            200    /* long enough to flush a Leave, short enough to exit */
#define WIRE_HWM                  256    /* messages queued per peer and direction */
#define WIRE_HEARTBEAT_IVL_MS     1000
#define WIRE_HEARTBEAT_TIMEOUT_MS 3000
#define WIRE_SEND_TIMEOUT_MS      10000
#define WIRE_HANDSHAKE_MS         10000
#define WIRE_RECONNECT_MS         100
#define WIRE_RECONNECT_MAX_MS     5000
#define WIRE_ZAP_DOMAIN           "fusion"
/* Oldest libzmq allowed to run a CURVE server: 4.3.3 fixed CVE-2020-15166 (unauthenticated
 * clients could exhaust memory before the handshake completed). */
#define WIRE_CURVE_MIN_ZMQ_VERSION 40303

/* A new socket of ZeroMQ type `type` (ZMQ_ROUTER, ZMQ_DEALER, ...) in ctx with the options above.
 * NULL on failure with *err set (err may be NULL). Close with wire_socket_close. */
void *wire_socket_new(void *ctx, int type, fu_err *err);

/* A socket of many connections, or one to such a socket, sends no ZMTP pings: libzmq keeps every
 * connection's ping timers in one ordered map per I/O thread and walks it to cancel one, on each
 * message after a ping, so that pings cost a broker O(connections) per message (docs/SCALE.md).
 * The application's heartbeats say who is alive; the kernel closes a connection whose other end
 * vanished (TCP keepalive: WIRE_KEEPALIVE_IDLE_S idle, then WIRE_KEEPALIVE_CNT probes
 * WIRE_KEEPALIVE_INTVL_S apart; and data unacknowledged for WIRE_TCP_MAXRT_MS), after which libzmq
 * reconnects a connecting socket as it does after a ping timeout. Call before connect or bind.
 * FU_EIO when an option is refused. The broker's ROUTER and a peer's socket to it are quiet. */
#define WIRE_KEEPALIVE_IDLE_S  10
#define WIRE_KEEPALIVE_INTVL_S 5
#define WIRE_KEEPALIVE_CNT     3
#define WIRE_TCP_MAXRT_MS      15000
FU_MUST_CHECK fu_err wire_socket_quiet(void *sock);

/* Closes *sock_p (pending messages get WIRE_LINGER_MS) and sets it to NULL. Idempotent. */
void wire_socket_close(void **sock_p);

/* FU_OK when this libzmq can serve CURVE safely (version >= 4.3.3 and built with CURVE);
 * FU_EVERSION or FU_ENOSYS otherwise, with a sentence in em (may be NULL). */
FU_MUST_CHECK fu_err wire_curve_available(fu_errmsg *em);

/* Makes sock a CURVE server with kp and ZAP domain `domain` (WIRE_ZAP_DOMAIN when NULL), with
 * ZMQ_ZAP_ENFORCE_DOMAIN=1 so that a missing ZAP handler refuses every client (fail closed). Call
 * before bind. FU_EVERSION / FU_ENOSYS as wire_curve_available; FU_EINVAL bad arguments. */
FU_MUST_CHECK fu_err wire_socket_curve_server(void *sock, const wire_keypair_t *kp, const char *domain);

/* Makes sock a CURVE client of the server whose public key is server_pk. Call before connect. */
FU_MUST_CHECK fu_err wire_socket_curve_client(void *sock, const wire_keypair_t *kp,
                                              const uint8_t server_pk[WIRE_KEY_BYTES]);

/* A monitor of sock's `events` (ZMQ_EVENT_* bits) on the inproc endpoint `endpoint`, read through a
 * new PAIR socket in ctx with linger 0 and RCVHWM 0 (the monitor's queue is unbounded: no event is
 * ever dropped, nor does libzmq's I/O thread wait on it). NULL when libzmq refuses (zmq_errno()
 * says why). Stop it with wire_monitor_close before sock closes. */
void *wire_monitor_open(void *ctx, void *sock, const char *endpoint, int events);
/* Stops sock's monitor and closes *mon_p (NULL after); nothing when *mon_p is NULL. */
void wire_monitor_close(void *sock, void **mon_p);
/* Reads the next event queued on mon without waiting: true with its *event and *value (for
 * accepted and closed connections, the descriptor), false when none is queued. */
bool wire_monitor_next(void *mon, uint16_t *event, uint32_t *value);

/* The endpoint the socket last bound ("tcp://127.0.0.1:41234"): how a test finds the port it got
 * from "tcp://127.0.0.1:*". FU_EINVAL when it does not fit in cap. */
FU_MUST_CHECK fu_err wire_socket_endpoint(void *sock, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
