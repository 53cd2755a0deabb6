/* broker_gateways: the broker's admission, copied to its gateways (docs/PROTOCOL.md "Gateways").
 *
 * A gateway's front would otherwise admit every key and leave each message to the broker: a key the
 * broker refuses would still cost the gateway a handshake and reach the broker's dispatch, and an
 * address banned for wrong enrolment tokens would still get new keys through the gateway. So a
 * gateway says GatewayHello on each connection, and the broker answers with its whole allow-list (in
 * batches of BROKER_GW_BATCH keys), the bans in force and whether it takes enrolment tokens; each
 * later change (a key enrolled, an address banned) goes to every gateway heard from. The gateway
 * then refuses at its handshake what the broker's own handler would refuse (wire_zap_mirror). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "wire.h"
#include "wire_zap.h"

#define LOG "broker"
#define BROKER_GW_BATCH 2048u /* keys a GatewayPolicy carries (about 80 KB) */

/* Sends pol to gateway k; a gateway that is gone (or whose queue is full) is forgotten: it says
 * GatewayHello again when it connects, and gets the whole list then. */
static bool send_to(broker_t *b, uint32_t k, const Fusion__GatewayPolicy *pol)
{
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_GATEWAY_POLICY};
    fu_err rc = wire_send(b->gw_sock, b->gws[k].id, b->gws[k].id_len, &h, &pol->base);
    if (rc == FU_OK)
        return true;
    FU_WARN(LOG, "gateway %u: cannot send its admission policy (%s): forgotten until its next GatewayHello", k,
            fu_strerror(rc));
    b->gws[k] = b->gws[--b->n_gws];
    return false;
}

/* Sends pol to every gateway heard from. */
static void send_all(broker_t *b, const Fusion__GatewayPolicy *pol)
{
    for (uint32_t k = 0; k < b->n_gws;)
        if (send_to(b, k, pol))
            k++;
}

/* The gateway with routing id (id, len): its slot, a new one, or the one heard from longest ago. */
static uint32_t slot_for(broker_t *b, const uint8_t *id, size_t len)
{
    uint32_t oldest = 0;
    for (uint32_t k = 0; k < b->n_gws; k++) {
        if (b->gws[k].id_len == len && memcmp(b->gws[k].id, id, len) == 0)
            return k;
        if (b->gws[k].hello_ms < b->gws[oldest].hello_ms)
            oldest = k;
    }
    if (b->n_gws < BROKER_GATEWAYS_MAX)
        return b->n_gws++;
    FU_WARN(LOG, "more than %d gateways: the one heard from longest ago no longer gets admission changes",
            BROKER_GATEWAYS_MAX);
    return oldest;
}

void broker_gateways_hello(broker_t *b, const wire_msg_t *msg)
{
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    if (!b->gw_sock || strcmp(wire_msg_admission(msg), WIRE_ADMIT_GATEWAY) != 0 || !rl || rl > WIRE_MAX_ROUTING_ID)
        return; /* not on the gateway socket: a gateway key elsewhere speaks for nobody */
    uint32_t k = slot_for(b, rid, rl);
    memcpy(b->gws[k].id, rid, rl);
    b->gws[k].id_len = (uint8_t)rl;
    b->gws[k].hello_ms = broker_now();

    uint8_t(*keys)[WIRE_KEY_BYTES] = NULL;
    uint32_t *roles = NULL;
    size_t n = 0;
    wire_zap_list(b->zap, &keys, &roles, &n);
    char(*addr)[WIRE_ADDRESS_MAX] = fu_malloc(WIRE_ZAP_BANS_MAX * sizeof *addr);
    uint64_t *left = fu_malloc(WIRE_ZAP_BANS_MAX * sizeof *left);
    size_t n_bans = wire_zap_bans(b->zap, fu_clock_ms(), addr, left, WIRE_ZAP_BANS_MAX);
    Fusion__GatewayBan *bans = fu_calloc(n_bans ? n_bans : 1, sizeof *bans);
    Fusion__GatewayBan **banp = fu_calloc(n_bans ? n_bans : 1, sizeof *banp);
    for (size_t i = 0; i < n_bans; i++) {
        fusion__gateway_ban__init(&bans[i]);
        bans[i].address = addr[i];
        bans[i].ms_left = left[i];
        banp[i] = &bans[i];
    }
    ProtobufCBinaryData *kb = fu_calloc(BROKER_GW_BATCH, sizeof *kb);
    bool open = wire_zap_enrolment_open(b->zap), sent = true;
    size_t batches = 0, at = 0;
    do { /* at least one message, even for an empty list */
        size_t m = n - at < BROKER_GW_BATCH ? n - at : BROKER_GW_BATCH;
        Fusion__GatewayPolicy pol = FUSION__GATEWAY_POLICY__INIT;
        pol.reset = at == 0;
        pol.complete = at + m == n;
        pol.enrolment_open = open;
        for (size_t i = 0; i < m; i++)
            kb[i] = (ProtobufCBinaryData){.len = WIRE_KEY_BYTES, .data = keys[at + i]};
        pol.n_keys = m;
        pol.keys = kb;
        pol.n_roles = m;
        pol.roles = roles + at;
        if (pol.complete) {
            pol.n_bans = n_bans;
            pol.bans = banp;
        }
        sent = send_to(b, k, &pol);
        at += m;
        batches++;
    } while (sent && at < n);
    if (sent)
        FU_INFO(LOG, "gateway %.12s...: sent its admission policy (%zu keys in %zu messages, %zu bans, enrolment %s)",
                wire_msg_user_id(msg), n, batches, n_bans, open ? "open" : "closed");
    free(kb);
    free(banp);
    free(bans);
    free(left);
    free(addr);
    free(roles);
    free(keys);
}

void broker_gateways_key(broker_t *b, const char *z85, uint32_t roles)
{
    uint8_t key[WIRE_KEY_BYTES];
    if (!b->n_gws || wire_key_from_z85(z85, key) != FU_OK)
        return;
    ProtobufCBinaryData kb = {.len = WIRE_KEY_BYTES, .data = key};
    Fusion__GatewayPolicy pol = FUSION__GATEWAY_POLICY__INIT;
    pol.complete = true;
    pol.enrolment_open = wire_zap_enrolment_open(b->zap);
    pol.n_keys = pol.n_roles = 1;
    pol.keys = &kb;
    pol.roles = &roles;
    send_all(b, &pol);
}

void broker_gateways_ban(broker_t *b, const char *addr, uint64_t until_ms)
{
    uint64_t now = fu_clock_ms();
    if (!b->n_gws || until_ms <= now)
        return;
    Fusion__GatewayBan ban = FUSION__GATEWAY_BAN__INIT, *banp = &ban;
    ban.address = (char *)addr;
    ban.ms_left = until_ms - now;
    Fusion__GatewayPolicy pol = FUSION__GATEWAY_POLICY__INIT;
    pol.complete = true;
    pol.enrolment_open = wire_zap_enrolment_open(b->zap);
    pol.n_bans = 1;
    pol.bans = &banp;
    send_all(b, &pol);
}
