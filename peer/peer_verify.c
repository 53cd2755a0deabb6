/* peer_verify: sketches of stage outputs for the broker's verification, and the test-only fault
 * hook (peer_verify.h). */
#include "peer_verify.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* splitmix64: the generator of the +-1 vectors (PROTOCOL.md "Verification sketch"). */
static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void peer_verify_sketch(const float *x, size_t n, uint64_t seed, double sketch[WIRE_VERIFY_SKETCH_K], double *norm)
{
    double sq = 0;
    for (size_t e = 0; e < n; e++)
        sq += (double)x[e] * (double)x[e];
    *norm = sqrt(sq);
    for (uint64_t i = 0; i < WIRE_VERIFY_SKETCH_K; i++) {
        /* vector i: its own stream, state = seed xor (i+1) * golden ratio; bit b of the k-th word
         * is the sign of element 64k + b (1: minus). */
        uint64_t state = seed ^ ((i + 1) * 0x9E3779B97F4A7C15ull);
        double acc = 0;
        for (size_t base = 0; base < n; base += 64) {
            uint64_t w = splitmix64(&state);
            size_t end = n - base < 64 ? n - base : 64;
            for (size_t b = 0; b < end; b++)
                acc += (w >> b) & 1u ? -(double)x[base + b] : (double)x[base + b];
        }
        sketch[i] = acc;
    }
}

bool peer_verify_corrupt_now(void)
{
    const char *v = getenv(PEER_CORRUPT_ENV);
    if (!v || strncmp(v, "scale", 5) != 0)
        return false;
    if (v[5] == '\0')
        return true;
    return v[5] == ':' && v[6] && access(v + 6, F_OK) == 0;
}
