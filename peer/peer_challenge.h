/* peer_challenge: the peer's side of the profile challenge (common/fu_challenge.h, docs/PROTOCOL.md
 * "Profile challenge"). PREPARE makes A and B on the backend (not timed); GO makes d, computes
 * C = rmsnorm(A, d)·B with the backend's own kernels, brings C to the host and answers with the
 * commitment to its row hashes (the broker times this step); REVEAL answers with every row hash and
 * the rows asked for, and frees the matrices.
 * Threads: one caller (the compute thread in fusion-peer; a test's thread in the harness). */
#ifndef FU_PEER_CHALLENGE_H
#define FU_PEER_CHALLENGE_H

#include <stdint.h>

#include "fusion.pb-c.h"
#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct peer_challenge peer_challenge_t;

peer_challenge_t *peer_challenge_new(const kern_backend_t *be);
void peer_challenge_destroy(peer_challenge_t **c_p);

/* Answers one step of the challenge in *reply (its byte fields point into c, valid until the next
 * call). A step it cannot take (out of memory, a step out of order, bad sizes) is answered with
 * reply->error set, never by failing. */
void peer_challenge_answer(peer_challenge_t *c, const Fusion__Challenge *ch, Fusion__ChallengeReply *reply);

#ifdef __cplusplus
}
#endif
#endif
