#include "fu_rng.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void fu_rng_seed(fu_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
    if (!(r->s[0] | r->s[1] | r->s[2] | r->s[3]))
        r->s[0] = 1; /* cannot happen with splitmix64, kept as the invariant's guard */
}

void fu_rng_seed_stream(fu_rng *r, uint64_t seed, const char *stream)
{
    /* FNV-1a of the stream name, mixed into the seed. */
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)(stream ? stream : ""); *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ull;
    }
    uint64_t x = seed ^ h;
    fu_rng_seed(r, splitmix64(&x) ^ seed);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t fu_rng_next(fu_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double fu_rng_uniform(fu_rng *r)
{
    return (double)(fu_rng_next(r) >> 11) * 0x1.0p-53;
}

float fu_rng_uniform_f32(fu_rng *r, float lo, float hi)
{
    return (float)(lo + (hi - lo) * fu_rng_uniform(r));
}

double fu_rng_normal(fu_rng *r)
{
    double u1 = 1.0 - fu_rng_uniform(r); /* (0, 1]: log is finite */
    double u2 = fu_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

void fu_rng_fill_normal_f32(fu_rng *r, float *dst, size_t n, float mean, float std)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = (float)(mean + std * fu_rng_normal(r));
}

void fu_rng_fill_uniform_f32(fu_rng *r, float *dst, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = fu_rng_uniform_f32(r, lo, hi);
}
