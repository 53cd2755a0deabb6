/* fu_rng: a small seeded pseudo-random generator (xoshiro256**, seeded through splitmix64) with
 * uniform and normal helpers. The integer stream is the same for a given seed everywhere; the
 * normal helper goes through libm's log/cos, so its floats are bit-identical for a given seed and C
 * library (model weights and adapter initialisations made from a seed reproduce exactly). Not for secrets (use
 * libsodium's randombytes for keys). A value type: one per thread, no locking. */
#ifndef FU_RNG_H
#define FU_RNG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    uint64_t s[4]; /* xoshiro256** state; never all zero */
} fu_rng;

/* Seeds r from one 64-bit number (any value, zero included). */
void fu_rng_seed(fu_rng *r, uint64_t seed);

/* Seeds r from a seed and a stream name (for example a tensor name), so that each named stream is
 * independent of the order in which streams are used. */
void fu_rng_seed_stream(fu_rng *r, uint64_t seed, const char *stream);

/* Next 64 random bits. */
uint64_t fu_rng_next(fu_rng *r);

/* Uniform double in [0, 1) with 53 random bits. */
double fu_rng_uniform(fu_rng *r);

/* Uniform float in [lo, hi). */
float fu_rng_uniform_f32(fu_rng *r, float lo, float hi);

/* Standard normal N(0, 1) by the Box-Muller transform (uses two uniforms per call, no cached
 * second value, so the sequence depends only on the number of calls). */
double fu_rng_normal(fu_rng *r);

/* Fills dst[0..n) with N(mean, std^2) as floats. */
void fu_rng_fill_normal_f32(fu_rng *r, float *dst, size_t n, float mean, float std);

/* Fills dst[0..n) with U[lo, hi) as floats. */
void fu_rng_fill_uniform_f32(fu_rng *r, float *dst, size_t n, float lo, float hi);

#ifdef __cplusplus
}
#endif
#endif
