/* broker_quota: how fast each client may submit (docs/SECURITY.md "Isolation and quotas"). A token
 * bucket per client key: `per_minute` submissions, refilled continuously, at most `per_minute` at
 * once; and the submissions of each client being prepared right now (at most `preparing`), so that
 * no client fills the preparation queue that every client shares. Bounded: at most
 * BROKER_QUOTA_CLIENTS clients are tracked, the one idle longest is forgotten first (a forgotten
 * client starts with a full bucket, which costs nothing: it was idle for a while). Loop thread only. */
#ifndef FU_BROKER_QUOTA_H
#define FU_BROKER_QUOTA_H

#include <stdbool.h>
#include <stdint.h>

#define BROKER_QUOTA_CLIENTS 4096

typedef struct broker_quota broker_quota;

/* preparing 0: none counted (a bucket alone, as for the sessions a client opens). */
broker_quota *broker_quota_new(uint32_t per_minute, uint32_t preparing);
void broker_quota_free(broker_quota **q);

/* One submission of `owner` at now_ms: true when its bucket and its preparations allow it (and
 * both are charged); false with *retry_s (seconds until one is allowed; 0: when one of its
 * preparations ends) otherwise. */
bool broker_quota_take(broker_quota *q, const char *owner, uint64_t now_ms, uint32_t *retry_s);

/* A preparation of `owner` ended (stored, refused or dropped). */
void broker_quota_done(broker_quota *q, const char *owner);

#endif
