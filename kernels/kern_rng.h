/* kern_rng: small deterministic RNGs for kernels (initialisation, sampling, dropout).
 * xoshiro256** for streams, and a stateless counter-based draw (splitmix64 of seed and counter) for
 * places where a value must be a pure function of (seed, counter), such as replayable sampling. */
#ifndef FU_KERN_RNG_H
#define FU_KERN_RNG_H

#include <stdint.h>

#include "fu_rng.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The stream generator is common/'s fu_rng (xoshiro256**): the same seed gives the same 64-bit
 * stream from kern_rng_next and fu_rng_next. */
typedef fu_rng kern_rng;

/* Seeds the generator from a 64-bit seed (fu_rng_seed: expanded with splitmix64). Same seed, same
 * stream. */
void     kern_rng_seed(kern_rng *r, uint64_t seed);
uint64_t kern_rng_next(kern_rng *r);     /* next 64 random bits */
float    kern_rng_uniform(kern_rng *r);  /* uniform in [0, 1), 24-bit resolution */
double   kern_rng_uniform_d(kern_rng *r); /* uniform in [0, 1), 53-bit resolution */

/* Stateless: 64 random bits determined by (seed, counter, stream) only. */
uint64_t kern_rng_hash(uint64_t seed, uint64_t counter, uint64_t stream);
/* Stateless uniform double in [0, 1) from (seed, counter, stream). */
double   kern_rng_hash_uniform(uint64_t seed, uint64_t counter, uint64_t stream);

#ifdef __cplusplus
}
#endif
#endif
