#include "dag_data.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_rng.h"

size_t dag_data_windows(const dag_data_order *o, size_t n_ids)
{
    return o && o->seq_len ? n_ids / ((size_t)o->seq_len + 1) : 0;
}

/* Fisher-Yates over 0..w-1 with the stream of seed. */
static void permute(size_t *order, size_t w, uint64_t seed)
{
    fu_rng rng;
    fu_rng_seed(&rng, seed);
    for (size_t i = 0; i < w; i++)
        order[i] = i;
    for (size_t i = w; i > 1; i--) {
        size_t j = (size_t)(fu_rng_next(&rng) % i);
        size_t t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
}

fu_err dag_data_rows(const dag_data_order *o, const int32_t *ids, size_t n_ids, uint64_t step, uint32_t mb,
                     int32_t *tokens, int32_t *targets)
{
    if (!o || !ids || o->micro_batches == 0 || o->batch % o->micro_batches != 0 || mb >= o->micro_batches ||
        o->seq_len == 0)
        return FU_EINVAL;
    size_t win = (size_t)o->seq_len + 1, w = n_ids / win;
    if (w == 0)
        return FU_EINVAL;
    uint32_t rows = o->batch / o->micro_batches;
    size_t *order = o->shuffle ? fu_malloc(w * sizeof *order) : NULL;
    uint64_t have_epoch = UINT64_MAX;
    for (uint32_t j = 0; j < rows; j++) {
        uint64_t k = step * o->batch + (uint64_t)mb * rows + j;
        uint64_t epoch = k / w;
        size_t wi = (size_t)(k % w);
        if (order) {
            if (epoch != have_epoch) {
                permute(order, w, o->seed + epoch);
                have_epoch = epoch;
            }
            wi = order[wi];
        }
        const int32_t *src = ids + wi * win;
        for (uint32_t t = 0; t < o->seq_len; t++) {
            if (tokens)
                tokens[(size_t)j * o->seq_len + t] = DAG_DATA_ID(src[t]);
            if (targets)
                targets[(size_t)j * o->seq_len + t] = src[t + 1] < 0 ? DAG_DATA_IGNORE : src[t + 1];
        }
    }
    free(order);
    return FU_OK;
}
