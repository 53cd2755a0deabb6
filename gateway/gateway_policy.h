/* gateway_policy: the broker's admission as a gateway's front applies it (MSG_GATEWAY_POLICY,
 * docs/PROTOCOL.md "Gateways").
 *
 * A gateway admits every key until the broker's whole allow-list has come (a new gateway, or one
 * whose broker is older); from then on its ZAP handler is a mirror of the broker's (wire_zap_mirror):
 * members are admitted, a stranger only to enrol, only while the broker takes tokens and its address
 * is not banned. The whole list comes in batches, staged here until the batch that completes it;
 * a change later (a key enrolled, an address banned) applies at once.
 *
 * Threads: the gateway's loop only. */
#ifndef FU_GATEWAY_POLICY_H
#define FU_GATEWAY_POLICY_H

#include <stdbool.h>
#include <stddef.h>

#include "fusion.pb-c.h"
#include "wire_zap.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GATEWAY_BAN_MAX_MS (24ull * 3600 * 1000) /* longest ban believed (the broker's are an hour at most) */

typedef struct gateway_policy gateway_policy;

/* A policy for zap (borrowed: the gateway's front handler, made with admit_any). */
gateway_policy *gateway_policy_new(wire_zap_t *zap);

void gateway_policy_destroy(gateway_policy **gp_p);

/* Applies one GatewayPolicy from the broker. A malformed one (a key not 32 bytes, roles not one per
 * key, an address too long) changes nothing and is logged. */
void gateway_policy_apply(gateway_policy *gp, const Fusion__GatewayPolicy *pol);

/* Whether a whole list has come: the front refuses what the broker would. */
bool gateway_policy_enforced(const gateway_policy *gp);

#ifdef __cplusplus
}
#endif
#endif
