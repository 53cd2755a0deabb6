/* wire_keys: long-term X25519 key pairs (CURVE on the control plane, crypto_kx identity on the data
 * plane) and their files.
 *
 * A key directory holds `public.key` and `secret.key`, each a Z85 line (40 chars) after optional
 * `#` comment lines. `secret.key` must be a regular file owned by the user, with no group or other
 * permission bits (mode 0600 or stricter): the loader refuses anything looser and says how to fix
 * it. Secret keys live in sodium_malloc memory (guarded, locked, wiped on free). */
#ifndef FU_WIRE_KEYS_H
#define FU_WIRE_KEYS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define WIRE_KEY_BYTES     32u /* X25519 public or secret key */
#define WIRE_KEY_Z85_LEN   40u /* its Z85 text, without the NUL */
#define WIRE_PUBLIC_KEY_FILE "public.key"
#define WIRE_SECRET_KEY_FILE "secret.key"

typedef struct wire_keypair wire_keypair_t;

/* A fresh random key pair (crypto_box_keypair: the same X25519 keys CURVE and crypto_kx use).
 * NULL only when secure memory cannot be had. Needs sodium_init(). */
wire_keypair_t *wire_keypair_generate(void);

/* A key pair from raw bytes (tests, the broker's in-memory keys). NULL on failure. */
wire_keypair_t *wire_keypair_from_bytes(const uint8_t pk[WIRE_KEY_BYTES], const uint8_t sk[WIRE_KEY_BYTES]);

/* Loads DIR/public.key and DIR/secret.key. On failure em (may be NULL) holds a sentence for the
 * user saying what is wrong and what to do. Errors: FU_ENOTFOUND a file is missing, FU_EPERM the
 * directory is writable by group or others (they could replace the keys), or the secret key file
 * is group/other accessible, not a regular file or not owned by this user,
 * FU_EINVAL bad contents or a public key that does not match the secret key, FU_EIO read error. */
FU_MUST_CHECK fu_err wire_keypair_load(const char *dir, wire_keypair_t **out, fu_errmsg *em);

/* Writes kp into DIR (created with mode 0700 when missing): secret.key with mode 0600, public.key
 * with mode 0644, each written to a temporary file first and then moved into place. Refuses with
 * FU_EEXIST when either file exists, unless force. FU_EIO on write errors. em as above. */
FU_MUST_CHECK fu_err wire_keypair_save(const wire_keypair_t *kp, const char *dir, bool force, fu_errmsg *em);

const uint8_t *wire_keypair_public(const wire_keypair_t *kp); /* WIRE_KEY_BYTES, borrowed */
const uint8_t *wire_keypair_secret(const wire_keypair_t *kp); /* WIRE_KEY_BYTES, borrowed, secret */
const char    *wire_keypair_public_z85(const wire_keypair_t *kp); /* borrowed */
void           wire_keypair_destroy(wire_keypair_t **kp_p);       /* wipes; idempotent */

#define WIRE_TOKEN_Z85_LEN 40 /* an enrolment token as text: 32 bytes in Z85 */

/* Reads an enrolment token from a file (one line, as `fusion keygen --token` prints), so that it is
 * not on a command line where `ps` shows it to every user. The file is checked like a secret key
 * (this user's, mode 0600 or stricter, no symlink). FU_EINVAL when it holds no token. */
FU_MUST_CHECK fu_err wire_token_load(const char *path, char out[WIRE_TOKEN_Z85_LEN + 1], fu_errmsg *em);

/* The enrolment token a program was given, from (in this order) a token file, the command line
 * (`given`, may be NULL: logged as a warning, since `ps` shows it) or the environment variable env
 * (FUSION_ENROL_TOKEN, or a role's): *token points at buf, the given text or the environment, NULL
 * when none. Errors are wire_token_load's. */
FU_MUST_CHECK fu_err wire_token_choose(const char *file, const char *given, const char *env,
                                       char buf[WIRE_TOKEN_Z85_LEN + 1], const char **token, fu_errmsg *em);

/* Reads one public key file (a peer's or the broker's). Errors as wire_keypair_load. */
FU_MUST_CHECK fu_err wire_key_load_public(const char *path, uint8_t out[WIRE_KEY_BYTES], fu_errmsg *em);

/* A broker's endpoints, each with the public key it answers with: the broker's own and its
 * gateways' (fusion-peer and fusion --broker E1,E2 --broker-key K1,K2; docs/PEER.md "Several
 * endpoints"). Used one at a time, the first first. */
#define WIRE_MAX_ENDPOINTS 8
typedef struct {
    uint32_t n;
    char *ep[WIRE_MAX_ENDPOINTS];               /* owned */
    uint8_t pk[WIRE_MAX_ENDPOINTS][WIRE_KEY_BYTES];
} wire_endpoints;

/* Fills *out from endpoints (comma-separated, at most WIRE_MAX_ENDPOINTS, no empty item) and
 * key_files (comma-separated: one file for every endpoint, or one each in their order), loading each
 * key. FU_EINVAL for a malformed list (a sentence in em naming --broker / --broker-key), else
 * wire_key_load_public's errors. On failure *out is empty. Free with wire_endpoints_free. */
FU_MUST_CHECK fu_err wire_endpoints_load(const char *endpoints, const char *key_files, wire_endpoints *out,
                                         fu_errmsg *em);
void wire_endpoints_free(wire_endpoints *e);

/* The bearer token a client shows the broker's HTTP API (fusion-broker --http): the hex of the client's
 * public key, then the hex of BLAKE2b-256 keyed with the X25519 secret the two key pairs share, over
 * "fusion-http-v1" || broker key || client key. Either side makes it from its own secret and the
 * other's public key (own_sk, other_pk); only a holder of one of the two secret keys can. FU_EAUTH
 * when X25519 refuses the keys. */
#define WIRE_HTTP_TOKEN_LEN (4 * WIRE_KEY_BYTES)
FU_MUST_CHECK fu_err wire_http_token(const uint8_t own_sk[WIRE_KEY_BYTES], const uint8_t other_pk[WIRE_KEY_BYTES],
                                     const uint8_t broker_pk[WIRE_KEY_BYTES], const uint8_t client_pk[WIRE_KEY_BYTES],
                                     char out[WIRE_HTTP_TOKEN_LEN + 1]);

/* Z85 text (exactly 40 chars) to key bytes; FU_EINVAL otherwise. */
FU_MUST_CHECK fu_err wire_key_from_z85(const char *z85, uint8_t out[WIRE_KEY_BYTES]);
/* Key bytes to Z85 text; out holds WIRE_KEY_Z85_LEN + 1 chars. */
void wire_key_to_z85(const uint8_t key[WIRE_KEY_BYTES], char out[WIRE_KEY_Z85_LEN + 1]);

#ifdef __cplusplus
}
#endif
#endif
