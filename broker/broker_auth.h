/* broker_auth: what the broker remembers of failed enrolments, per address (docs/PROTOCOL.md
 * "Admission"): wrong tokens are counted in windows of BROKER_AUTH_WINDOW_MS; the
 * BROKER_AUTH_MAX_FAILS-th in one window bans the address for BROKER_AUTH_BAN_MS, twice as long at
 * each repeat up to BROKER_AUTH_BAN_MAX_MS. It also decides which failures are logged: the first of
 * an address in a minute, then one summary line per ban, so that a brute force costs the log a few
 * lines instead of one per try.
 *
 * It only decides; the caller (broker.c on_enrol) answers, logs, and tells wire_zap about bans. At
 * most BROKER_AUTH_MAX_ADDRS addresses are tracked: a new one takes the place of the one heard from
 * longest ago whose ban is over (or, when every one is banned, of the ban that ends first).
 *
 * Times are monotonic milliseconds (fu_clock_ms), passed in so that tests need no clock.
 * Threads: none of its own; one thread uses an instance. */
#ifndef FU_BROKER_AUTH_H
#define FU_BROKER_AUTH_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BROKER_AUTH_MAX_FAILS  5u                 /* wrong tokens in one window that ban an address */
#define BROKER_AUTH_WINDOW_MS  60000u             /* ... the window, and the log's minute */
#define BROKER_AUTH_BAN_MS     60000u             /* the first ban; each repeat doubles it ... */
#define BROKER_AUTH_BAN_MAX_MS (3600u * 1000u)    /* ... up to this; an hour without wrong tokens after
                                                     the last ban forgets the repeats */
#define BROKER_AUTH_MAX_ADDRS  4096u              /* addresses tracked at once */

typedef struct broker_auth broker_auth;

/* What to do about one wrong token. */
typedef struct {
    bool log_first;        /* log it: the first wrong token of its address in a minute */
    bool log_summary;      /* log a summary: this token started a ban */
    uint32_t more;         /* wrong tokens of the address not logged since its last line */
    uint32_t dropped;      /* Enrols of the address dropped unread while it was banned, since then */
    uint64_t banned_until; /* log_summary: when the new ban ends (tell wire_zap_ban); else 0 */
} broker_auth_verdict;

/* A new, empty tracker. Never NULL (allocation failure aborts). */
broker_auth *broker_auth_new(void);

/* Frees a; idempotent; sets *a_p = NULL. */
void broker_auth_free(broker_auth **a_p);

/* True when addr is banned at now: its Enrol is dropped unanswered and unlogged (it is counted,
 * and said in the address's next summary). */
bool broker_auth_banned(broker_auth *a, const char *addr, uint64_t now);

/* Records a wrong token from addr at now and says, in *v, what to log and whether a ban starts. */
void broker_auth_failed(broker_auth *a, const char *addr, uint64_t now, broker_auth_verdict *v);

#ifdef __cplusplus
}
#endif
#endif
