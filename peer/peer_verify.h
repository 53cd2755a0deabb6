/* peer_verify: the verification sketch of a stage output (docs/PROTOCOL.md "Verification sketch"),
 * and the test-only fault-injection hook that makes a peer cheat. */
#ifndef FU_PEER_VERIFY_H
#define FU_PEER_VERIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Env var of the fault-injection hook, FOR TESTS ONLY: "scale" multiplies every stage output this
 * peer sends (as a stage, not as a verifier) by PEER_CORRUPT_SCALE; "scale:PATH" does so only while
 * the file PATH exists. A peer run this way is a dishonest peer; verification must catch it. */
#define PEER_CORRUPT_ENV   "FUSION_TEST_CORRUPT_OUTPUT"
#define PEER_CORRUPT_SCALE 1.5f

/* sketch[i] = sum_e x[e] * r_i[e] for i < WIRE_VERIFY_SKETCH_K, with r_i[e] = +1 or -1 from the
 * seeded generator of PROTOCOL.md, and *norm = sqrt(sum_e x[e]^2); sums in double, in element order.
 * Pure function; thread-safe. */
void peer_verify_sketch(const float *x, size_t n, uint64_t seed, double sketch[WIRE_VERIFY_SKETCH_K], double *norm);

/* True when the fault-injection hook asks this peer to corrupt its outputs now. */
bool peer_verify_corrupt_now(void);

#ifdef __cplusplus
}
#endif
#endif
