/* fu_challenge: the profile challenge's inputs, commitment and checks (see fu_challenge.h). */
#include "fu_challenge.h"

#include <math.h>
#include <string.h>

#include <sodium.h>

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t mix(uint64_t z) /* splitmix64's finaliser */
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t seed_key(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], fu_challenge_matrix which)
{
    uint64_t k = rd64(seed) ^ rotl(rd64(seed + 8), 17) ^ rotl(rd64(seed + 16), 31) ^ rotl(rd64(seed + 24), 47);
    return mix(k ^ ((uint64_t)which << 60));
}

/* Exactly representable: A and B are k·2^-23 in [-1, 1), d is 0.5 + k·2^-23 in [0.5, 1.5). */
static float elem(uint64_t key, fu_challenge_matrix which, uint64_t index)
{
    uint64_t z = mix(key ^ index);
    if (which == FU_CHALLENGE_D)
        return 0.5f + (float)(z >> 41) * 0x1.0p-23f;
    return (float)((int32_t)(z >> 40) - (1 << 23)) * 0x1.0p-23f;
}

float fu_challenge_elem(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], fu_challenge_matrix which, uint64_t index)
{
    return elem(seed_key(seed, which), which, index);
}

void fu_challenge_fill(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], fu_challenge_matrix which, uint64_t first,
                       size_t count, float *out)
{
    uint64_t key = seed_key(seed, which);
    for (size_t i = 0; i < count; i++)
        out[i] = elem(key, which, first + i);
}

void fu_challenge_row_hash(const float *row, uint32_t n, uint8_t out[FU_CHALLENGE_ROW_HASH])
{
    /* f32 bytes as they lie: every supported host is little-endian (fu_safetensors makes the same assumption) */
    crypto_generichash(out, FU_CHALLENGE_ROW_HASH, (const uint8_t *)row, (size_t)n * sizeof *row, NULL, 0);
}

void fu_challenge_commit(const uint8_t *row_hashes, uint32_t n, uint8_t out[FU_CHALLENGE_COMMIT])
{
    crypto_generichash(out, FU_CHALLENGE_COMMIT, row_hashes, (size_t)n * FU_CHALLENGE_ROW_HASH, NULL, 0);
}

bool fu_challenge_check_row(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], const uint8_t go_seed[FU_CHALLENGE_SEED_BYTES],
                            uint32_t n, uint32_t i, const float *row, uint64_t pick_seed)
{
    if (n < 1 || i >= n)
        return false;
    uint64_t ka = seed_key(seed, FU_CHALLENGE_A), kb = seed_key(seed, FU_CHALLENGE_B);
    uint64_t kd = seed_key(go_seed, FU_CHALLENGE_D);
    double ss = 0;
    for (uint32_t k = 0; k < n; k++) {
        double a = elem(ka, FU_CHALLENGE_A, (uint64_t)i * n + k);
        ss += a * a;
    }
    double r = 1.0 / sqrt(ss / n + (double)FU_CHALLENGE_EPS);
    for (uint32_t t = 0; t < FU_CHALLENGE_CHECKS; t++) {
        uint32_t j = (uint32_t)(mix(pick_seed ^ ((uint64_t)i << 32) ^ t) % n);
        double sum = 0, mag = 0;
        for (uint32_t k = 0; k < n; k++) {
            double v = (double)elem(ka, FU_CHALLENGE_A, (uint64_t)i * n + k) * elem(kd, FU_CHALLENGE_D, k) *
                       elem(kb, FU_CHALLENGE_B, (uint64_t)k * n + j);
            sum += v;
            mag += fabs(v);
        }
        double got = row[j];
        if (!isfinite(got) || fabs(got - r * sum) > FU_CHALLENGE_RTOL * r * mag + 1e-30)
            return false;
    }
    return true;
}

void fu_challenge_reference(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], const uint8_t go_seed[FU_CHALLENGE_SEED_BYTES],
                            uint32_t n, float *c)
{
    uint64_t ka = seed_key(seed, FU_CHALLENGE_A), kb = seed_key(seed, FU_CHALLENGE_B);
    uint64_t kd = seed_key(go_seed, FU_CHALLENGE_D);
    for (uint32_t i = 0; i < n; i++) {
        float ss = 0;
        for (uint32_t k = 0; k < n; k++) {
            float a = elem(ka, FU_CHALLENGE_A, (uint64_t)i * n + k);
            ss += a * a;
        }
        float r = 1.0f / sqrtf(ss / (float)n + FU_CHALLENGE_EPS);
        float *ci = c + (size_t)i * n;
        memset(ci, 0, (size_t)n * sizeof *ci);
        for (uint32_t k = 0; k < n; k++) {
            float a = elem(ka, FU_CHALLENGE_A, (uint64_t)i * n + k) * r * elem(kd, FU_CHALLENGE_D, k);
            for (uint32_t j = 0; j < n; j++)
                ci[j] += a * elem(kb, FU_CHALLENGE_B, (uint64_t)k * n + j);
        }
    }
}

uint32_t fu_challenge_size(double gflops, double target_s, uint64_t mem_bytes)
{
    double n = isfinite(gflops) && gflops > 0 && target_s > 0 ? cbrt(target_s * gflops * 1e9 / 2.0) : 0;
    if (mem_bytes) {
        double n_mem = sqrt((double)mem_bytes / (3.0 * sizeof(float)));
        n = fmin(n, n_mem);
    }
    n = fmax(FU_CHALLENGE_N_MIN, fmin(FU_CHALLENGE_N_MAX, n));
    return (uint32_t)n / 64u * 64u;
}

double fu_challenge_flops(uint32_t n)
{
    return 2.0 * (double)n * (double)n * (double)n;
}
