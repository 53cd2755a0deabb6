/* broker_quota: per-client submission rate and preparations in flight (see broker_quota.h). */
#include "broker_quota.h"

#include <stdlib.h>
#include <string.h>

#include "db.h"
#include "fu_alloc.h"

typedef struct {
    char owner[DB_KEY_LEN + 1];
    double tokens;                     /* submissions allowed now (fractional: continuous refill) */
    uint64_t at_ms;                    /* when tokens was computed */
    uint32_t preparing;                /* submissions on the worker now */
} client;

struct broker_quota {
    uint32_t per_minute, preparing;
    client *c;
    size_t n;
};

broker_quota *broker_quota_new(uint32_t per_minute, uint32_t preparing)
{
    broker_quota *q = fu_calloc(1, sizeof *q);
    q->per_minute = per_minute ? per_minute : 1;
    q->preparing = preparing ? preparing : UINT32_MAX;
    q->c = fu_calloc(BROKER_QUOTA_CLIENTS, sizeof *q->c);
    return q;
}

void broker_quota_free(broker_quota **q)
{
    if (!q || !*q)
        return;
    free((*q)->c);
    free(*q);
    *q = NULL;
}

static client *find(broker_quota *q, const char *owner, bool add, uint64_t now_ms)
{
    for (size_t i = 0; i < q->n; i++)
        if (strcmp(q->c[i].owner, owner) == 0)
            return &q->c[i];
    if (!add)
        return NULL;
    client *c = NULL;
    if (q->n < BROKER_QUOTA_CLIENTS) {
        c = &q->c[q->n++];
    } else { /* forget the client idle longest that prepares nothing */
        for (size_t i = 0; i < q->n; i++)
            if (!q->c[i].preparing && (!c || q->c[i].at_ms < c->at_ms))
                c = &q->c[i];
        if (!c)
            return NULL;
    }
    memset(c, 0, sizeof *c);
    strncpy(c->owner, owner, DB_KEY_LEN);
    c->tokens = q->per_minute;
    c->at_ms = now_ms;
    return c;
}

bool broker_quota_take(broker_quota *q, const char *owner, uint64_t now_ms, uint32_t *retry_s)
{
    *retry_s = 0;
    client *c = find(q, owner, true, now_ms);
    if (!c) /* 4096 clients preparing at once: the worker's own depth refuses the rest */
        return true;
    double rate = q->per_minute / 60000.0; /* per ms */
    if (now_ms > c->at_ms) {
        c->tokens += (double)(now_ms - c->at_ms) * rate;
        if (c->tokens > q->per_minute)
            c->tokens = q->per_minute;
        c->at_ms = now_ms;
    }
    if (c->preparing >= q->preparing)
        return false;
    if (c->tokens < 1.0) {
        *retry_s = (uint32_t)((1.0 - c->tokens) / rate / 1000.0) + 1;
        return false;
    }
    c->tokens -= 1.0;
    if (q->preparing != UINT32_MAX)
        c->preparing++;
    return true;
}

void broker_quota_done(broker_quota *q, const char *owner)
{
    client *c = find(q, owner, false, 0);
    if (c && c->preparing)
        c->preparing--;
}
