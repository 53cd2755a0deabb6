/* The swarm's hardware: consumer GPUs and home links drawn by weight, the random draws, and latency
 * samples. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "swarm_internal.h"

/* f32 peak TFLOP/s from the vendors' specifications; weights roughly follow how common the cards are
 * among gamers (Steam hardware survey order of magnitude), not a measurement. */
static const swarm_gpu gpus[] = {
    {"RTX 3060", 12, 12.7, 0.22},   {"RTX 3060 Ti", 8, 16.2, 0.10}, {"RTX 3070", 8, 20.3, 0.10},
    {"RTX 3080", 10, 29.8, 0.08},   {"RTX 3090", 24, 35.6, 0.05},   {"RTX 4060 Ti", 16, 22.1, 0.12},
    {"RTX 4070", 12, 29.1, 0.14},   {"RTX 4080", 16, 48.7, 0.08},   {"RTX 4090", 24, 82.6, 0.11},
};

/* Upload rates of common home connections and a round trip to a broker in the same region. */
static const swarm_link links[] = {
    {"DSL 50/10", 10, 35, 0.15},         {"cable 200/20", 20, 25, 0.30}, {"cable 1000/50", 50, 20, 0.20},
    {"fibre 300/300", 300, 10, 0.20},    {"fibre 1000/500", 500, 8, 0.15},
};

uint64_t swarm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint64_t splitmix(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double swarm_uniform(uint64_t *rng)
{
    return (double)(splitmix(rng) >> 11) * (1.0 / 9007199254740992.0);
}

double swarm_exp(uint64_t *rng, double mean)
{
    return -mean * log(1.0 - swarm_uniform(rng));
}

#define DRAW(table, rng)                                                   \
    do {                                                                   \
        double total = 0, x;                                               \
        size_t n = sizeof table / sizeof table[0];                         \
        for (size_t i = 0; i < n; i++)                                     \
            total += table[i].weight;                                      \
        x = swarm_uniform(rng) * total;                                    \
        for (size_t i = 0; i < n; i++) {                                   \
            if (x < table[i].weight)                                       \
                return &table[i];                                          \
            x -= table[i].weight;                                          \
        }                                                                  \
        return &table[n - 1];                                              \
    } while (0)

const swarm_gpu *swarm_gpu_draw(uint64_t *rng)
{
    DRAW(gpus, rng);
}

const swarm_link *swarm_link_draw(uint64_t *rng)
{
    DRAW(links, rng);
}

void swarm_samples_add(swarm_samples *s, double v)
{
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        double *nv = realloc(s->v, s->cap * sizeof *nv);
        if (!nv)
            abort();
        s->v = nv;
    }
    s->v[s->n++] = v;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentiles. */
swarm_dist swarm_samples_dist(swarm_samples *s)
{
    swarm_dist d = {.n = s->n};
    if (!s->n)
        return d;
    qsort(s->v, s->n, sizeof *s->v, cmp_double);
    size_t i50 = (size_t)ceil(0.50 * (double)s->n), i99 = (size_t)ceil(0.99 * (double)s->n);
    d.p50 = s->v[(i50 ? i50 : 1) - 1];
    d.p99 = s->v[(i99 ? i99 : 1) - 1];
    d.max = s->v[s->n - 1];
    return d;
}

void swarm_samples_free(swarm_samples *s)
{
    free(s->v);
    memset(s, 0, sizeof *s);
}
