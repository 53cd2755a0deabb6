#include "kern_rng.h"

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

void kern_rng_seed(kern_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
    if (!(r->s[0] | r->s[1] | r->s[2] | r->s[3]))
        r->s[0] = 1;
}

uint64_t kern_rng_next(kern_rng *r)
{
    uint64_t *s = r->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

float kern_rng_uniform(kern_rng *r)
{
    return (float)(kern_rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

double kern_rng_uniform_d(kern_rng *r)
{
    return (double)(kern_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
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
