#include "gateway_policy.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "wire.h"
#include "wire_keys.h"

#define LOG "gateway"

struct gateway_policy {
    wire_zap_t *zap;
    bool enforced;                   /* a whole list has come */
    bool staging;                    /* a whole list is coming: its first batch was read */
    uint8_t (*keys)[WIRE_KEY_BYTES]; /* the list coming */
    uint32_t *roles;
    size_t n, cap;
};

gateway_policy *gateway_policy_new(wire_zap_t *zap)
{
    gateway_policy *gp = fu_calloc(1, sizeof *gp);
    gp->zap = zap;
    return gp;
}

void gateway_policy_destroy(gateway_policy **gp_p)
{
    if (!gp_p || !*gp_p)
        return;
    free((*gp_p)->keys);
    free((*gp_p)->roles);
    free(*gp_p);
    *gp_p = NULL;
}

bool gateway_policy_enforced(const gateway_policy *gp) { return gp->enforced; }

/* Whether every part of pol can be applied. */
static bool well_formed(const Fusion__GatewayPolicy *pol)
{
    if (pol->n_roles != pol->n_keys)
        return false;
    for (size_t i = 0; i < pol->n_keys; i++)
        if (pol->keys[i].len != WIRE_KEY_BYTES)
            return false;
    for (size_t i = 0; i < pol->n_bans; i++)
        if (!pol->bans[i]->address[0] || strlen(pol->bans[i]->address) >= WIRE_ADDRESS_MAX)
            return false;
    return true;
}

/* Adds a batch to the list coming; false when it would pass WIRE_ALLOW_MAX_KEYS. */
static bool stage(gateway_policy *gp, const Fusion__GatewayPolicy *pol)
{
    if (pol->n_keys > WIRE_ALLOW_MAX_KEYS - gp->n)
        return false;
    if (gp->n + pol->n_keys > gp->cap) {
        while (gp->cap < gp->n + pol->n_keys)
            gp->cap = gp->cap ? gp->cap * 2 : 4096;
        gp->keys = fu_realloc(gp->keys, gp->cap * sizeof *gp->keys);
        gp->roles = fu_realloc(gp->roles, gp->cap * sizeof *gp->roles);
    }
    for (size_t i = 0; i < pol->n_keys; i++) {
        memcpy(gp->keys[gp->n], pol->keys[i].data, WIRE_KEY_BYTES);
        gp->roles[gp->n++] = pol->roles[i];
    }
    return true;
}

void gateway_policy_apply(gateway_policy *gp, const Fusion__GatewayPolicy *pol)
{
    if (!well_formed(pol)) {
        FU_WARN(LOG, "a malformed admission policy from the broker: ignored");
        return;
    }
    uint64_t now = fu_clock_ms();
    for (size_t i = 0; i < pol->n_bans; i++) {
        uint64_t left = pol->bans[i]->ms_left < GATEWAY_BAN_MAX_MS ? pol->bans[i]->ms_left : GATEWAY_BAN_MAX_MS;
        wire_zap_ban(gp->zap, pol->bans[i]->address, now + left);
        if (!pol->reset && gp->enforced)
            FU_INFO(LOG, "address %s banned for %llu s by the broker: new keys from it are refused", pol->bans[i]->address,
                    (unsigned long long)(left / 1000));
    }
    if (pol->reset) {
        gp->n = 0;
        gp->staging = true;
    }
    if (gp->staging) { /* a batch of a whole list */
        if (!stage(gp, pol)) {
            FU_WARN(LOG, "the broker's allow-list passes %u keys: every key is admitted as before", WIRE_ALLOW_MAX_KEYS);
            gp->staging = false;
            return;
        }
        if (!pol->complete)
            return;
        wire_zap_mirror(gp->zap, (const uint8_t(*)[WIRE_KEY_BYTES])gp->keys, gp->roles, gp->n, pol->enrolment_open);
        FU_INFO(LOG, "admission as the broker's: %zu keys, enrolment %s, %zu bans", gp->n,
                pol->enrolment_open ? "open" : "closed", pol->n_bans);
        gp->staging = false;
        gp->enforced = true;
        gp->n = 0;
        return;
    }
    for (size_t i = 0; i < pol->n_keys; i++) /* a change */
        if (wire_zap_set_roles(gp->zap, pol->keys[i].data, pol->roles[i]) != FU_OK)
            FU_WARN(LOG, "the broker gave a key unknown roles (%u): not changed", pol->roles[i]);
}
