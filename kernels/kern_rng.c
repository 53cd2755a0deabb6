#include "kern_rng.h"

void kern_rng_seed(kern_rng *r, uint64_t seed)
{
    fu_rng_seed(r, seed);
}

uint64_t kern_rng_next(kern_rng *r)
{
    return fu_rng_next(r);
}

float kern_rng_uniform(kern_rng *r)
{
    return (float)(kern_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

double kern_rng_uniform_d(kern_rng *r)
{
    return (double)(kern_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

/* The mixer of the stateless draws (fu_rng seeds with the same function but does not export it). */
static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t kern_rng_hash(uint64_t seed, uint64_t counter, uint64_t stream)
{
    uint64_t x = seed;
    uint64_t a = splitmix64(&x);
    x = a ^ counter;
    uint64_t b = splitmix64(&x);
    x = b ^ (stream * 0xD1B54A32D192ED03ull);
    return splitmix64(&x);
}

double kern_rng_hash_uniform(uint64_t seed, uint64_t counter, uint64_t stream)
{
    return (double)(kern_rng_hash(seed, counter, stream) >> 11) * (1.0 / 9007199254740992.0);
}
