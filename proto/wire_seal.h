/* wire_seal: the sealed data-plane channel between two pipeline stages.
 *
 * Each link derives two session keys (one per direction) from BOTH
 *   - crypto_kx over the two peers' long-term X25519 keys (the broker introduces each stage's
 *     neighbour key in StageAssign: this is what authenticates the link), and
 *   - crypto_kx over fresh per-link ephemeral keys exchanged in SealHello (forward secrecy: the
 *     session keys die with the link even if a long-term key leaks later),
 * combined with keyed BLAKE2b over the transcript (both ephemeral public keys in role order).
 * Roles (kx client/server) follow the byte order of the long-term public keys, so the two sides
 * agree without talking about it.
 *
 * Each frame is sealed with XChaCha20-Poly1305 (IETF) under its direction's key. The nonce is
 * derived from the frame's sequence number (unique per key: the counter never repeats within a
 * link, and every link has fresh keys). The associated data binds job, step, micro-batch,
 * direction, sequence, message kind and the chunk's place in its tensor (offset, total, index,
 * count, dtype, shape), so a relay can neither read a frame nor move, replay or relabel it.
 * The receiver keeps a 64-frame sliding replay window per direction: a sequence seen before, or
 * more than 64 behind the newest, is refused.
 *
 * Secrets (session keys, ephemeral secret keys) live in sodium_malloc memory, read-only once
 * derived, wiped by the destroy functions.
 *
 * Threads: wire_seal_encrypt and wire_seal_decrypt are thread-safe (an atomic counter and a mutex
 * guarding the window), so chunks of one tensor may be sealed or opened on several threads. */
#ifndef FU_WIRE_SEAL_H
#define FU_WIRE_SEAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "wire_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

#define WIRE_SEAL_TAG_BYTES 16u  /* Poly1305 tag appended to each sealed chunk */
#define WIRE_SEAL_WINDOW    64u  /* replay window, in frames */
#define WIRE_SEAL_MAX_DIMS  8u

/* A fresh ephemeral key pair for one link handshake. */
typedef struct wire_seal_eph wire_seal_eph_t;
wire_seal_eph_t *wire_seal_eph_new(void);                         /* NULL without secure memory */
const uint8_t   *wire_seal_eph_public(const wire_seal_eph_t *eph); /* WIRE_KEY_BYTES, send it in SealHello */
void             wire_seal_eph_destroy(wire_seal_eph_t **eph_p);   /* wipes; idempotent */

typedef struct wire_seal wire_seal_t;

/* Derives the link's session keys. me: this peer's long-term key pair; peer_pk: the neighbour's
 * long-term public key AS INTRODUCED BY THE BROKER (never the one in SealHello); *eph_p: this
 * side's ephemeral pair, consumed (wiped and NULLed, also on failure); peer_eph_pk: from the
 * neighbour's SealHello. NULL on failure with *err: FU_EINVAL equal long-term keys or a degenerate
 * public key, FU_ENOMEM no secure memory. */
wire_seal_t *wire_seal_new(const wire_keypair_t *me, const uint8_t peer_pk[WIRE_KEY_BYTES], wire_seal_eph_t **eph_p,
                           const uint8_t peer_eph_pk[WIRE_KEY_BYTES], fu_err *err);
void wire_seal_destroy(wire_seal_t **seal_p); /* wipes; idempotent */

/* What a sealed frame is bound to, besides its direction and sequence. */
typedef struct {
    uint64_t job_id;
    uint64_t step;
    uint32_t micro_batch;
    uint32_t kind;         /* the Envelope's message type (MSG_ACTIVATION, MSG_GRADIENT) */
    uint64_t offset;       /* the chunk's plaintext offset in its tensor */
    uint64_t total;        /* the tensor's plaintext bytes */
    uint32_t chunk_index;
    uint32_t chunk_count;
    uint32_t dtype;
    uint32_t ndim;         /* <= WIRE_SEAL_MAX_DIMS */
    int64_t shape[WIRE_SEAL_MAX_DIMS];
} wire_seal_ad;

/* Seals len bytes of pt into out (out_cap >= len + WIRE_SEAL_TAG_BYTES; out may not overlap pt)
 * under the next sequence number of this side's direction, returned in *seq (put it in the
 * Envelope). FU_EINVAL bad arguments, FU_ENOMEM out too small. */
FU_MUST_CHECK fu_err wire_seal_encrypt(wire_seal_t *s, const wire_seal_ad *ad, const uint8_t *pt, size_t len,
                                       uint8_t *out, size_t out_cap, uint64_t *seq);

/* Opens ct (ct_len >= WIRE_SEAL_TAG_BYTES) sealed by the other side with sequence seq into out
 * (out_cap >= ct_len - WIRE_SEAL_TAG_BYTES). FU_EAUTH when the frame was altered, sealed under
 * other keys or other associated data, replayed, or older than the window; out is wiped then.
 * FU_EINVAL/FU_ENOMEM bad arguments. */
FU_MUST_CHECK fu_err wire_seal_decrypt(wire_seal_t *s, const wire_seal_ad *ad, uint64_t seq, const uint8_t *ct,
                                       size_t ct_len, uint8_t *out, size_t out_cap);

/* Frames refused by wire_seal_decrypt so far: integrity failures and replay-window refusals. */
void wire_seal_counters(wire_seal_t *s, uint64_t *auth_failed, uint64_t *replayed);

#ifdef __cplusplus
}
#endif
#endif
