/* wire_zap: the ZAP handler (RFC 27) that decides which CURVE keys may talk to the broker.
 *
 * An actor thread owns a REP socket bound to inproc://zeromq.zap.01 in the broker's context and
 * answers libzmq's authentication requests for the configured domain:
 *   - a key on the allow-list is admitted as a "member";
 *   - when an enrolment token is configured, any other key is admitted as "enrolling": the broker
 *     must accept nothing from it but one MSG_ENROL carrying the token, checked with
 *     wire_zap_enrol, which puts the key on the allow-list (and appends it to the allow-list file);
 *   - everything else, other mechanisms (NULL, PLAIN) and other domains are refused (400).
 * The admitted identity (User-Id) is the client's public key in Z85; the admission state travels
 * as connection metadata "X-Fusion-Admission" (wire_msg_user_id / wire_msg_admission read them).
 * CURVE's ZAP request carries no password, which is why the token is a message, not a credential:
 * see docs/PROTOCOL.md "Admission".
 *
 * Threads: wire_zap_new/destroy from the thread that owns the context's sockets; the query and
 * update functions are thread-safe (a mutex guards the allow-list). */
#ifndef FU_WIRE_ZAP_H
#define FU_WIRE_ZAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "wire.h"
#include "wire_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

#define WIRE_ZAP_ENDPOINT     "inproc://zeromq.zap.01"
#define WIRE_ADMIT_MEMBER     "member"
#define WIRE_ADMIT_ENROLLING  "enrolling"
#define WIRE_TOKEN_BYTES      32u /* enrolment tokens: 32 random bytes, 40 Z85 chars */
#define WIRE_ALLOW_MAX_KEYS   100000u

typedef struct {
    const char *domain;      /* ZAP domain served; WIRE_ZAP_DOMAIN when NULL */
    const char *allow_file;  /* allow-list file (Z85 keys, one per line, # comments); NULL = none.
                              * A missing file is an empty list; enrolled keys are appended to it. */
    const char *enrol_token; /* Z85 enrolment token; NULL or "" disables enrolment */
} wire_zap_cfg;

typedef struct {
    uint64_t admitted;   /* requests answered 200 as member */
    uint64_t enrolling;  /* requests answered 200 as enrolling */
    uint64_t refused;    /* requests answered 400 */
    uint64_t enrolled;   /* successful wire_zap_enrol calls */
    uint64_t bad_tokens; /* refused wire_zap_enrol calls */
} wire_zap_counters;

typedef struct wire_zap wire_zap_t;

/* Starts the handler in ctx: loads the allow-list, binds inproc://zeromq.zap.01 (synchronously,
 * so it is ready when this returns) and starts the actor thread. NULL on failure with *err (may be
 * NULL) and a sentence in em (may be NULL): FU_EINVAL bad allow-list line or token, FU_EEXIST a
 * handler is already bound in ctx, FU_EIO other. */
wire_zap_t *wire_zap_new(void *ctx, const wire_zap_cfg *cfg, fu_err *err, fu_errmsg *em);

/* Stops the thread, closes its sockets, wipes the token. Idempotent; sets *zap_p = NULL. Call it
 * before zmq_ctx_term: its sockets live in the context, which cannot end while they are open. */
void wire_zap_destroy(wire_zap_t **zap_p);

/* Adds key to the allow-list (in memory and, when configured, appended to the file). */
FU_MUST_CHECK fu_err wire_zap_allow(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES]);

/* Removes key from the in-memory allow-list (existing connections stay; new ones are refused). */
void wire_zap_deny(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES]);

/* True when the Z85 key is on the allow-list now. */
bool wire_zap_is_member(wire_zap_t *zap, const char *z85);

/* True when msg comes from a member: admitted as one, or enrolled since its connection opened. */
bool wire_zap_msg_is_member(wire_zap_t *zap, const wire_msg_t *msg);

/* Checks an enrolment token presented by the connection authenticated as user_id (Z85): on a
 * match (constant time) adds the key to the allow-list. FU_EAUTH for a wrong token or when
 * enrolment is disabled; FU_EINVAL for a malformed user_id. */
FU_MUST_CHECK fu_err wire_zap_enrol(wire_zap_t *zap, const char *user_id, const char *token);

void wire_zap_get_counters(wire_zap_t *zap, wire_zap_counters *out);

/* Parses an allow-list file into a new array of keys (caller frees *keys with free()). A missing
 * file gives FU_ENOTFOUND; a bad line FU_EINVAL with its line number in em (may be NULL). */
FU_MUST_CHECK fu_err wire_allow_list_load(const char *path, uint8_t (**keys)[WIRE_KEY_BYTES], size_t *n,
                                          fu_errmsg *em);

/* A fresh random enrolment token (Z85, 40 chars + NUL). */
void wire_token_generate(char out[WIRE_KEY_Z85_LEN + 1]);

#ifdef __cplusplus
}
#endif
#endif
