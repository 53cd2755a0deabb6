/* broker_auth: failed enrolments per address (broker_auth.h). */
#include "broker_auth.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "wire.h"

/* One address that presented a wrong token. */
typedef struct {
    char addr[WIRE_ADDRESS_MAX]; /* as wire_msg_peer_address gives it */
    uint64_t seen_ms;            /* last wrong token or dropped Enrol */
    uint64_t window_ms;          /* start of the window its wrong tokens are counted in */
    uint32_t fails;              /* wrong tokens in that window */
    uint32_t strikes;            /* bans so far (each doubles the next) */
    uint64_t banned_until;       /* end of its ban; <= now when not banned */
    bool logged;                 /* a line about it was logged ... */
    uint64_t logged_ms;          /* ... at this time */
    uint32_t unlogged;           /* wrong tokens since that line, not logged */
    uint32_t dropped;            /* Enrols dropped unread (banned) since that line */
} auth_addr;

struct broker_auth {
    auth_addr *addrs; /* in no order */
    size_t n, cap;    /* n <= BROKER_AUTH_MAX_ADDRS */
};

broker_auth *broker_auth_new(void)
{
    return fu_calloc(1, sizeof(broker_auth));
}

void broker_auth_free(broker_auth **a_p)
{
    if (!a_p || !*a_p)
        return;
    free((*a_p)->addrs);
    free(*a_p);
    *a_p = NULL;
}

static auth_addr *find(broker_auth *a, const char *addr)
{
    for (size_t i = 0; i < a->n; i++)
        if (strcmp(a->addrs[i].addr, addr) == 0)
            return &a->addrs[i];
    return NULL;
}

/* addr's entry, made when new: in a free slot, else in the place of the address heard from longest
 * ago whose ban is over, else of the ban that ends first (a full table of bans keeps the longest). */
static auth_addr *find_or_add(broker_auth *a, const char *addr, uint64_t now)
{
    auth_addr *e = find(a, addr);
    if (e)
        return e;
    if (a->n < BROKER_AUTH_MAX_ADDRS) {
        if (a->n == a->cap) {
            a->cap = a->cap ? a->cap * 2 : 64;
            a->addrs = fu_realloc(a->addrs, a->cap * sizeof *a->addrs);
        }
        e = &a->addrs[a->n++];
    } else {
        for (size_t i = 0; i < a->n; i++) {
            auth_addr *c = &a->addrs[i];
            bool c_banned = c->banned_until > now;
            if (!e) {
                e = c;
                continue;
            }
            bool e_banned = e->banned_until > now;
            if (c_banned != e_banned ? !c_banned
                                     : (c_banned ? c->banned_until < e->banned_until : c->seen_ms < e->seen_ms))
                e = c;
        }
    }
    memset(e, 0, sizeof *e);
    snprintf(e->addr, sizeof e->addr, "%s", addr);
    e->window_ms = now;
    return e;
}

bool broker_auth_banned(broker_auth *a, const char *addr, uint64_t now)
{
    auth_addr *e = find(a, addr);
    if (!e || e->banned_until <= now)
        return false;
    e->dropped++;
    e->seen_ms = now;
    return true;
}

void broker_auth_failed(broker_auth *a, const char *addr, uint64_t now, broker_auth_verdict *v)
{
    memset(v, 0, sizeof *v);
    auth_addr *e = find_or_add(a, addr, now);
    uint64_t quiet_since = e->seen_ms > e->banned_until ? e->seen_ms : e->banned_until;
    if (e->strikes && now >= quiet_since && now - quiet_since >= BROKER_AUTH_BAN_MAX_MS)
        e->strikes = 0; /* a quiet hour after its last ban: the next ban is a first one again */
    e->seen_ms = now;
    if (now - e->window_ms >= BROKER_AUTH_WINDOW_MS) {
        e->window_ms = now;
        e->fails = 0;
    }
    e->fails++;
    e->unlogged++;
    if (e->fails >= BROKER_AUTH_MAX_FAILS) {
        uint64_t len = BROKER_AUTH_BAN_MS;
        for (uint32_t i = 0; i < e->strikes && len < BROKER_AUTH_BAN_MAX_MS; i++)
            len *= 2;
        if (len > BROKER_AUTH_BAN_MAX_MS)
            len = BROKER_AUTH_BAN_MAX_MS;
        e->strikes++;
        e->fails = 0;
        e->banned_until = now + len;
        v->log_summary = true;
        v->banned_until = e->banned_until;
        v->more = e->unlogged;
    } else if (!e->logged || now - e->logged_ms >= BROKER_AUTH_WINDOW_MS) {
        v->log_first = true;
        v->more = e->unlogged - 1; /* the ones before this one */
    } else {
        return;
    }
    v->dropped = e->dropped;
    e->logged = true;
    e->logged_ms = now;
    e->unlogged = 0;
    e->dropped = 0;
}
