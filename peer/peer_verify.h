/* peer_verify: what a peer computes and moves for the broker's verification (docs/PIPELINE.md
 * "Verification"): the sketch of a stage output (docs/PROTOCOL.md "Verification sketch"), the input
 * hash, the sealed chunks that carry a stage's input from the upstream peer to a verifier through
 * the broker (docs/PROTOCOL.md "Verification inputs") and their assembler. The test-only hooks
 * that make a peer cheat or stall are in peer_faults.h. */
#ifndef FU_PEER_VERIFY_H
#define FU_PEER_VERIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "wire.h"
#include "wire_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PEER_VIN_SLOTS 4 /* delivered inputs a verifier assembles at once (the oldest is dropped) */

/* sketch[i] = sum_e x[e] * r_i[e] for i < WIRE_VERIFY_SKETCH_K, with r_i[e] = +1 or -1 from the
 * seeded generator of PROTOCOL.md, and *norm = sqrt(sum_e x[e]^2); sums in double, in element order.
 * Pure function; thread-safe. */
void peer_verify_sketch(const float *x, size_t n, uint64_t seed, double sketch[WIRE_VERIFY_SKETCH_K], double *norm);

/* The input hash of VerifySketch: BLAKE2b-256 of n bytes. Thread-safe. */
void peer_verify_hash(const void *data, size_t n, uint8_t out[WIRE_VERIFY_HASH_BYTES]);

/* The verification sample a delivered input belongs to; every sealed chunk is bound to it. */
typedef struct {
    uint64_t job_id;      /* the job */
    uint32_t stage;       /* the stage being verified (k >= 1): the input is stage k-1's output */
    uint64_t step;        /* training step */
    uint32_t micro_batch; /* micro-batch */
    uint64_t seed;        /* the sample's VerifyRequest.seed */
} peer_vin_id;

/* Sets the sample fields of a VerifyInput message (job_id, stage_index, step, micro_batch, seed). */
void peer_vin_id_to_msg(const peer_vin_id *id, Fusion__VerifyInput *vi);

/* Chunks of a delivered input of `total` bytes: ceil(total / WIRE_VERIFY_INPUT_CHUNK). */
uint64_t peer_vin_chunks(uint64_t total);

/* Seals chunk `index` of data[0..total) to the X25519 public key `recipient`: *out (malloc'd, the
 * caller frees) = crypto_box_seal(header || chunk bytes), *out_len = chunk bytes +
 * WIRE_VERIFY_INPUT_OVERHEAD; the header binds id, offset and total. FU_EINVAL for an index past the
 * last chunk or total 0; FU_EINVAL when the key is not a valid curve point. Thread-safe. */
FU_MUST_CHECK fu_err peer_vin_seal(const peer_vin_id *id, const uint8_t recipient[WIRE_KEY_BYTES],
                                   const uint8_t *data, uint64_t total, uint64_t index, uint8_t **out,
                                   size_t *out_len);

/* Assembles delivered inputs (VerifyInput chunks sealed to this peer) in up to PEER_VIN_SLOTS slots.
 * One owner thread (the peer's I/O thread). */
typedef struct peer_vin_asm peer_vin_asm_t;

/* An assembler for inputs of at most max_bytes each, and max_bytes in all (the oldest input in
 * progress is dropped to make room). NULL never (allocation failure aborts). */
peer_vin_asm_t *peer_vin_asm_new(size_t max_bytes);
void peer_vin_asm_destroy(peer_vin_asm_t **a_p); /* idempotent; sets *a_p = NULL */

/* Feeds one VerifyInput whose payload is sealed to (pk, sk), this peer's long-term keys. Checks the
 * geometry (total, chunk count, index, offset, payload size), opens the payload, checks that the
 * sealed header names exactly the message's sample, offset and total, and places the bytes. *done
 * becomes true when that input is complete: take it with peer_vin_asm_take before the next feed.
 * Errors (the input in progress is left as it was; em, which may be NULL, holds a sentence):
 * FU_EINVAL a message that is not a chunk (no payload, `unavailable` set), FU_EPROTO bad geometry or
 * a chunk seen before, FU_EAUTH the payload does not open with this key or its header does not
 * match, FU_ENOMEM an input over max_bytes. */
FU_MUST_CHECK fu_err peer_vin_asm_feed(peer_vin_asm_t *a, const Fusion__VerifyInput *vi,
                                       const uint8_t pk[WIRE_KEY_BYTES],
                                       const uint8_t sk[WIRE_KEY_BYTES], bool *done, fu_errmsg *em);

/* Moves the input the last feed completed into *data (malloc'd, the caller frees; *len bytes) and
 * its sample into *id. FU_EAGAIN when none is complete. */
FU_MUST_CHECK fu_err peer_vin_asm_take(peer_vin_asm_t *a, peer_vin_id *id, uint8_t **data, size_t *len);

#ifdef __cplusplus
}
#endif
#endif
