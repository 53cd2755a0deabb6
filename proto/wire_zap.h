/* wire_zap: the ZAP handler (RFC 27) that decides which CURVE keys may talk to the broker, and
 * with which roles.
 *
 * An actor thread owns a REP socket bound to inproc://zeromq.zap.01 in the broker's context and
 * answers libzmq's authentication requests for the configured domain:
 *   - a key on the allow-list is admitted as a "member"; the list also says its roles (client,
 *     peer, operator, trusted), which the broker asks for with wire_zap_msg_roles;
 *   - when enrolment tokens are configured, any other key is admitted as "enrolling": the broker
 *     must accept nothing from it but one MSG_ENROL carrying a token, checked with wire_zap_enrol,
 *     which puts the key on the allow-list with the roles that token grants (and appends it to the
 *     allow-list file) -- unless its address is banned (wire_zap_ban), then it is refused;
 *   - on the domain WIRE_ZAP_GATEWAY_DOMAIN (the broker's gateway socket) only keys with the gateway
 *     role are admitted, as "gateway": wire_recv believes the GatewayHop frames of such a
 *     connection only;
 *   - everything else, other mechanisms (NULL, PLAIN) and other domains are refused (400).
 * A gateway's own handler (admit_any) admits every CURVE key as a member until the broker's policy
 * arrives (wire_zap_mirror): from then on it decides as the broker's does, and the broker behind it
 * still decides, message by message, what each key may do.
 * The admitted identity (User-Id) is the client's public key in Z85; the admission state travels
 * as connection metadata "X-Fusion-Admission" (wire_msg_user_id / wire_msg_admission read them).
 * CURVE's ZAP request carries no password, which is why the token is a message, not a credential:
 * see docs/PROTOCOL.md "Admission".
 *
 * Threads: wire_zap_new/destroy from the thread that owns the context's sockets; the query and
 * update functions are thread-safe (a mutex guards the allow-list and the bans). */
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
#define WIRE_ADMIT_GATEWAY    "gateway"        /* a gateway's connection (WIRE_ZAP_GATEWAY_DOMAIN) */
#define WIRE_ZAP_GATEWAY_DOMAIN "fusion-gateway" /* the broker's gateway socket: WIRE_ROLE_GATEWAY keys only */
#define WIRE_TOKEN_BYTES      32u /* enrolment tokens: 32 random bytes, 40 Z85 chars */
#define WIRE_ALLOW_MAX_KEYS   100000u
#define WIRE_ZAP_TOKENS_MAX   3u    /* enrolment tokens configured at once (one per role set) */
#define WIRE_ZAP_BANS_MAX     4096u /* banned addresses held (the one whose ban ends first makes room) */

/* Roles of a key (docs/PROTOCOL.md "Admission"). An allow-list line without roles means
 * WIRE_ROLES_DEFAULT, so lists written before roles existed keep working. */
#define WIRE_ROLE_CLIENT   1u /* submits, watches and cancels its own jobs */
#define WIRE_ROLE_PEER     2u /* registers as a peer and runs stages */
#define WIRE_ROLE_OPERATOR 4u /* sees every tenant's work (never granted by a token) */
#define WIRE_ROLE_TRUSTED  8u /* a peer the operator trusts with the stages that see tokens; implies
                               * WIRE_ROLE_PEER (never granted by a token) */
#define WIRE_ROLE_GATEWAY 16u /* a fusion-gateway: may connect to the broker's gateway socket and speak
                               * for the peers it carries (never granted by a token) */
#define WIRE_ROLES_DEFAULT (WIRE_ROLE_CLIENT | WIRE_ROLE_PEER)
#define WIRE_ROLES_TEXT_MAX 48u /* "client,peer,operator,trusted,gateway" and the NUL */

/* An enrolment token and what it grants. */
typedef struct {
    const char *token; /* Z85 enrolment token; NULL or "" = this slot is unused */
    uint32_t roles;    /* WIRE_ROLE_CLIENT and/or WIRE_ROLE_PEER */
} wire_zap_token;

typedef struct {
    const char *domain;      /* ZAP domain served; WIRE_ZAP_DOMAIN when NULL */
    const char *allow_file;  /* allow-list file (`KEY [ROLES] [# comment]` lines); NULL = none.
                              * A missing file is an empty list; enrolled keys are appended to it. */
    const char *enrol_token; /* Z85 token granting WIRE_ROLES_DEFAULT; NULL or "" = none */
    wire_zap_token tokens[WIRE_ZAP_TOKENS_MAX]; /* more tokens, each with its roles; with
                              * enrol_token at most WIRE_ZAP_TOKENS_MAX in all. No token at all
                              * disables enrolment. */
    bool admit_any;          /* a gateway's front: admit every CURVE key as a member (no list) */
} wire_zap_cfg;

typedef struct {
    uint64_t admitted;   /* requests answered 200 as member */
    uint64_t enrolling;  /* requests answered 200 as enrolling */
    uint64_t refused;    /* requests answered 400 */
    uint64_t enrolled;   /* successful wire_zap_enrol calls */
    uint64_t bad_tokens; /* refused wire_zap_enrol calls */
    uint64_t banned;     /* requests answered 400 because their address is banned (also in refused) */
} wire_zap_counters;

typedef struct wire_zap wire_zap_t;

/* Starts the handler in ctx: loads the allow-list, binds inproc://zeromq.zap.01 (synchronously,
 * so it is ready when this returns) and starts the actor thread. NULL on failure with *err (may be
 * NULL) and a sentence in em (may be NULL): FU_EINVAL bad allow-list line, a malformed token, more
 * than WIRE_ZAP_TOKENS_MAX tokens or one granting roles other than client and peer; FU_EEXIST a
 * handler is already bound in ctx; FU_EIO other. */
wire_zap_t *wire_zap_new(void *ctx, const wire_zap_cfg *cfg, fu_err *err, fu_errmsg *em);

/* Stops the thread, closes its sockets, wipes the token. Idempotent; sets *zap_p = NULL. Call it
 * before zmq_ctx_term: its sockets live in the context, which cannot end while they are open. */
void wire_zap_destroy(wire_zap_t **zap_p);

/* Gives key the roles (WIRE_ROLE_*, added to any it has) on the allow-list: in memory and, when
 * configured and the key's roles changed, appended to the file as `KEY ROLES`. FU_EINVAL for no
 * roles or unknown bits; FU_EIO when the file could not be written (the key is allowed in memory). */
FU_MUST_CHECK fu_err wire_zap_allow(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES], uint32_t roles);

/* Removes key from the in-memory allow-list (existing connections stay; new ones are refused). */
void wire_zap_deny(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES]);

/* The roles of the Z85 key on the allow-list now; 0 when it is not a member (or z85 is malformed). */
uint32_t wire_zap_roles(wire_zap_t *zap, const char *z85);

/* The roles of msg's sender now (wire_zap_roles of its User-Id): the live list decides, so a key
 * enrolled since its connection opened has its new roles from its next message. */
uint32_t wire_zap_msg_roles(wire_zap_t *zap, const wire_msg_t *msg);

/* True when the Z85 key is on the allow-list now (with any role). */
bool wire_zap_is_member(wire_zap_t *zap, const char *z85);

/* True when msg comes from a member: admitted as one, or enrolled since its connection opened. */
bool wire_zap_msg_is_member(wire_zap_t *zap, const wire_msg_t *msg);

/* Checks an enrolment token presented by the connection authenticated as user_id (Z85) against
 * every configured token (constant time, whichever matches): on a match gives the key that token's
 * roles (wire_zap_allow) and sets *granted (may be NULL) to the key's roles now. FU_EAUTH for a
 * wrong token or when enrolment is disabled; FU_EINVAL for a malformed user_id; FU_EIO when the
 * allow-list file could not be written (the key is enrolled in memory). */
FU_MUST_CHECK fu_err wire_zap_enrol(wire_zap_t *zap, const char *user_id, const char *token, uint32_t *granted);

/* Bans the address addr (as ZAP and the "Peer-Address" metadata give it: an IP address) until the
 * monotonic time until_ms (fu_clock_ms): handshakes from it by keys not on the allow-list are
 * refused (members keep their access: their key is their credential, and a stranger behind the
 * same address must not lock them out). until_ms in the past lifts the ban. At most
 * WIRE_ZAP_BANS_MAX addresses are held; a new one takes the place of the ban that ends first. */
void wire_zap_ban(wire_zap_t *zap, const char *addr, uint64_t until_ms);

void wire_zap_get_counters(wire_zap_t *zap, wire_zap_counters *out);

/* ---- the broker's admission, copied to its gateways (MSG_GATEWAY_POLICY) ---- */

/* Copies the allow-list: *n entries of *keys and *roles (caller frees both; a key listed twice has
 * an entry each, whose roles add up). */
void wire_zap_list(wire_zap_t *zap, uint8_t (**keys)[WIRE_KEY_BYTES], uint32_t **roles, size_t *n);

/* Copies up to max bans in force at now (fu_clock_ms): each address and how long it still runs.
 * Returns how many. */
size_t wire_zap_bans(wire_zap_t *zap, uint64_t now, char (*addr)[WIRE_ADDRESS_MAX], uint64_t *ms_left, size_t max);

/* Whether a stranger's key may connect to enrol (tokens configured, or a mirror told so). */
bool wire_zap_enrolment_open(wire_zap_t *zap);

/* Makes zap (a gateway's, admit_any) a mirror of the broker's admission: its allow-list becomes the
 * entries of keys with a nonzero role (copied), every key is admitted no more, and a stranger is
 * admitted to enrol while enrolment_open and its address is not banned (wire_zap_ban), refused
 * otherwise: what the broker's own handler decides. Bans are kept. */
void wire_zap_mirror(wire_zap_t *zap, const uint8_t (*keys)[WIRE_KEY_BYTES], const uint32_t *roles, size_t n,
                     bool enrolment_open);

/* Sets key's roles to exactly roles (0: not a member any more), in memory only: a mirror's change.
 * FU_EINVAL for unknown role bits. */
FU_MUST_CHECK fu_err wire_zap_set_roles(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES], uint32_t roles);

/* Parses an allow-list file (`KEY [ROLES] [# comment]` lines, ROLES a comma-separated list of
 * client, peer, operator, trusted, gateway; none means WIRE_ROLES_DEFAULT) into new arrays of keys and of
 * their roles, in file order (caller frees both with free(); roles may be NULL when not wanted). A
 * key listed twice has both lines' roles. A missing file gives FU_ENOTFOUND; a bad line (not a key,
 * an unknown role) FU_EINVAL with its line number in em (may be NULL). */
FU_MUST_CHECK fu_err wire_allow_list_load(const char *path, uint8_t (**keys)[WIRE_KEY_BYTES], uint32_t **roles,
                                          size_t *n, fu_errmsg *em);

/* The roles as allow-list text ("client,peer"; "" for none) in buf; returns buf. */
const char *wire_roles_text(uint32_t roles, char buf[WIRE_ROLES_TEXT_MAX]);

/* A fresh random enrolment token (Z85, 40 chars + NUL). */
void wire_token_generate(char out[WIRE_KEY_Z85_LEN + 1]);

#ifdef __cplusplus
}
#endif
#endif
