/* Token sampling on the host: greedy, temperature, top-k, top-p, with a counter-based RNG so that a
 * draw depends only on (seed, counter, row). Used by the CPU backend; a device backend may copy the
 * logits out and call kern_sample_host. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"
#include "kern_rng.h"

typedef struct {
    float   v;  /* scaled logit */
    int32_t id; /* token id */
} cand;

/* Descending by value, ascending by id on ties (a total, deterministic order). */
static int cand_cmp(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->v > y->v)
        return -1;
    if (x->v < y->v)
        return 1;
    return (x->id > y->id) - (x->id < y->id);
}

static bool cand_less(const cand *a, const cand *b)
{
    return cand_cmp(a, b) > 0; /* a ranks after b */
}

/* Min-heap on rank (root = worst kept candidate). */
static void heap_sift_down(cand *h, int64_t n, int64_t i)
{
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && cand_less(&h[l], &h[m]))
            m = l;
        if (r < n && cand_less(&h[r], &h[m]))
            m = r;
        if (m == i)
            return;
        cand t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static inline float clean(float x)
{
    return isnan(x) ? -INFINITY : x;
}

static int32_t sample_row(const float *row, int64_t V, const kern_sample_params *p, uint64_t counter, uint64_t r,
                          cand *buf)
{
    if (p->temperature <= 0.0f) {
        int64_t best = 0;
        float bv = clean(row[0]);
        for (int64_t j = 1; j < V; j++) {
            float x = clean(row[j]);
            if (x > bv) {
                bv = x;
                best = j;
            }
        }
        return (int32_t)best;
    }
    const float invt = 1.0f / p->temperature;
    const double u = kern_rng_hash_uniform(p->seed, counter, r);
    bool use_k = p->top_k > 0 && (int64_t)p->top_k < V;
    bool use_p = p->top_p > 0.0f && p->top_p < 1.0f;
    int64_t n = 0;
    if (use_k) {
        int64_t k = p->top_k;
        for (int64_t j = 0; j < V; j++) {
            cand c = {clean(row[j]) * invt, (int32_t)j};
            if (n < k) {
                buf[n++] = c;
                if (n == k)
                    for (int64_t i = k / 2 - 1; i >= 0; i--)
                        heap_sift_down(buf, k, i);
            } else if (cand_less(&buf[0], &c)) {
                buf[0] = c;
                heap_sift_down(buf, k, 0);
            }
        }
        qsort(buf, (size_t)n, sizeof(cand), cand_cmp);
    } else if (use_p) {
        for (int64_t j = 0; j < V; j++)
            buf[j] = (cand){clean(row[j]) * invt, (int32_t)j};
        n = V;
        qsort(buf, (size_t)n, sizeof(cand), cand_cmp);
    } else {
        /* Plain temperature sampling: no ordering needed. */
        float mx = -INFINITY;
        for (int64_t j = 0; j < V; j++)
            mx = fmaxf(mx, clean(row[j]) * invt);
        if (mx == -INFINITY || isinf(mx))
            return sample_row(row, V, &(kern_sample_params){0}, counter, r, buf);
        double total = 0.0;
        for (int64_t j = 0; j < V; j++)
            total += exp((double)(clean(row[j]) * invt - mx));
        double target = u * total, acc = 0.0;
        for (int64_t j = 0; j < V; j++) {
            acc += exp((double)(clean(row[j]) * invt - mx));
            if (acc > target)
                return (int32_t)j;
        }
        return sample_row(row, V, &(kern_sample_params){0}, counter, r, buf);
    }
    /* buf[0..n) sorted best first. */
    float mx = buf[0].v;
    if (mx == -INFINITY || isinf(mx))
        return buf[0].id;
    double total = 0.0;
    for (int64_t i = 0; i < n; i++)
        total += exp((double)(buf[i].v - mx));
    int64_t keep = n;
    if (use_p) {
        double acc = 0.0;
        for (int64_t i = 0; i < n; i++) {
            acc += exp((double)(buf[i].v - mx)) / total;
            if (acc >= (double)p->top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    double kept = 0.0;
    for (int64_t i = 0; i < keep; i++)
        kept += exp((double)(buf[i].v - mx));
    double target = u * kept, acc = 0.0;
    for (int64_t i = 0; i < keep; i++) {
        acc += exp((double)(buf[i].v - mx));
        if (acc > target)
            return buf[i].id;
    }
    return buf[keep - 1].id;
}

fu_err kern_sample_host(const float *logits, int64_t n, int64_t V, int64_t ld, const kern_sample_params *p,
                        uint64_t counter, int32_t *out_tokens)
{
    bool need_buf = p->temperature > 0.0f &&
                    ((p->top_k > 0 && (int64_t)p->top_k < V) || (p->top_p > 0.0f && p->top_p < 1.0f));
    cand *buf = need_buf ? fu_malloc((size_t)V * sizeof(cand)) : NULL;
    for (int64_t r = 0; r < n; r++)
        out_tokens[r] = sample_row(logits + r * ld, V, p, counter, (uint64_t)r, buf);
    free(buf);
    return FU_OK;
}

fu_err kern_cpu_sample(const kern_backend_t *be, const kern_tensor_t *logits, const kern_sample_params *p,
                       uint64_t counter, int32_t *out_tokens)
{
    (void)be;
    int64_t n = logits->ndim == 1 ? 1 : logits->shape[0];
    int64_t V = logits->ndim == 1 ? logits->shape[0] : logits->shape[1];
    return kern_sample_host(logits->data, n, V, V, p, counter, out_tokens);
}
