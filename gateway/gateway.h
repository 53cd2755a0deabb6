/* gateway: fusion-gateway, many peers' connections carried to the broker on one (docs/PROTOCOL.md
 * "Gateways", docs/SCALE.md "Gateways").
 *
 * Each connection costs libzmq about 135 KB once its pipes have cycled (docs/SCALE.md "Memory per
 * connection"), so a broker holding 10,000 of them needs 1.1-1.35 GB. A gateway holds them instead:
 * peers and clients connect to it exactly as they would to the broker (CURVE, with the gateway's
 * public key as the server key), and it carries their messages to the broker's gateway socket, each
 * with a GatewayHop frame naming the sender as the gateway's own handshake authenticated it, and the
 * broker's answers back to the connection they name. The broker holds one connection per gateway.
 *
 * It decodes nothing but what it writes: bodies pass through untouched (no copy), and the broker
 * checks every message as it checks a direct one. A gateway's key must have the gateway role on the
 * broker's allow-list: the broker believes its hops because the operator runs it (docs/SECURITY.md
 * "Gateways"). When a peer's connection closes (a crash), the gateway tells the broker
 * (MSG_GATEWAY_CLOSED), so its stage moves as quickly as a direct peer's would.
 *
 * Threads: gateway_run on one thread; gateway_request_stop from a signal handler. */
#ifndef FU_GATEWAY_H
#define FU_GATEWAY_H

#include <stdint.h>

#include "fu_err.h"
#include "wire_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GATEWAY_LISTEN_DEFAULT "tcp://*:7710"
#define GATEWAY_HWM            65536 /* messages queued to or from the broker (thousands of peers' worth) */
#define GATEWAY_TURN_MSGS      256   /* messages read from one side in one turn */
#define GATEWAY_STATS_MS       60000 /* a line of counters this often */

typedef struct {
    const char *listen;             /* where peers connect; GATEWAY_LISTEN_DEFAULT when NULL */
    const char *broker;             /* the broker's gateway endpoint (fusion-broker --gateway-bind) */
    const uint8_t *broker_pk;       /* the broker's public key (WIRE_KEY_BYTES) */
    const wire_keypair_t *kp;       /* the gateway's keys: server key to peers, client key to the broker */
} gateway_cfg;

typedef struct {
    uint64_t up;           /* messages carried to the broker */
    uint64_t down;         /* messages carried to peers */
    uint64_t closed;       /* closed peer connections told to the broker */
    uint64_t dropped_bad;  /* a peer's message without the [Envelope] [body] frames (or over 3 frames) */
    uint64_t dropped_up;   /* the broker's queue was full: the message was dropped (the peer resends) */
    uint64_t dropped_down; /* the peer is gone or its queue is full */
} gateway_counters;

typedef struct gateway gateway_t;

/* Binds cfg->listen, connects to the broker. NULL on failure with *err (may be NULL) and a sentence
 * in em (may be NULL). */
gateway_t *gateway_new(const gateway_cfg *cfg, fu_err *err, fu_errmsg *em);

/* Carries messages both ways until gateway_request_stop. FU_OK on a requested stop, FU_EIO when
 * polling failed. */
FU_MUST_CHECK fu_err gateway_run(gateway_t *g);

/* Asks gateway_run to return (async-signal-safe). */
void gateway_request_stop(void);

/* The endpoint peers connect to, as bound ("tcp://0.0.0.0:7710"). Borrowed. */
const char *gateway_endpoint(const gateway_t *g);

void gateway_get_counters(const gateway_t *g, gateway_counters *out);

/* Closes the sockets and the context; idempotent; sets *g_p = NULL. */
void gateway_destroy(gateway_t **g_p);

#ifdef __cplusplus
}
#endif
#endif
