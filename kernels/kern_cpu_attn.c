/* CPU backend: causal grouped-query attention, forward and backward.
 *
 * Three forward paths.
 *   Many queries (training, prefill): per (sequence, head, block of ATTN_BLOCK_Q query rows) the
 *     scores S = scale·Q·Kᵀ over the keys the block can see and the output P·V are OpenBLAS GEMMs
 *     on strided views of the packed [tokens, heads*dim] activations; the masked softmax runs on
 *     OpenMP threads over rows when a block is big enough.
 *   One query (decode): per (sequence, KV head) one GEMM pair whose rows are the group's query
 *     heads (adjacent in q's row), so K and V are read once per group; gemv when the group is 1.
 *   A few queries (2..ATTN_SMALL_TQ, e.g. a short chunk against a cache): rows of different tokens
 *     see different keys, so each (sequence, head, query row) is a hand-written loop and threads
 *     split the heads.
 * Backward always takes the blocked GEMM path and recomputes P from q and k. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_internal.h"

#define ATTN_SMALL_TQ 8 /* at most this many query rows per sequence: the hand-written path */
#define ATTN_BLOCK_Q  128 /* query rows per block of the GEMM path: a block only multiplies the keys
                             its last row may see, so causal attention skips most of the masked half */

static float attn_scale(const kern_attn_params *p)
{
    return p->scale != 0.0f ? p->scale : 1.0f / sqrtf((float)p->head_dim);
}

fu_err kern_cpu_attn_ws_bytes(const kern_backend_t *be, const kern_attn_params *p, int64_t tq, int64_t tk,
                              bool backward, size_t *bytes)
{
    (void)be;
    (void)p;
    size_t nt = (size_t)kern_cpu_threads();
    size_t floats;
    size_t bq = (size_t)(tq < ATTN_BLOCK_Q ? tq : ATTN_BLOCK_Q);
    size_t group = (size_t)(p->n_kv_head > 0 ? p->n_head / p->n_kv_head : 1);
    if (backward)
        floats = 2 * bq * (size_t)tk;
    else if (tq <= ATTN_SMALL_TQ)
        floats = (nt > group ? nt : group) * (size_t)tk;
    else
        floats = bq * (size_t)tk;
    *bytes = floats * sizeof(float) + 2 * KERN_ALIGN;
    return FU_OK;
}

/* Scratch from ws (rewound by the caller) or from the heap (freed by the caller via *owned). */
static fu_err scratch(kern_workspace_t *ws, size_t floats, float **out, void **owned)
{
    *owned = NULL;
    size_t bytes = floats * sizeof(float);
    if (ws) {
        void *p = NULL;
        FU_TRY(kern_workspace_take(ws, bytes, &p));
        *out = p;
        return FU_OK;
    }
    void *p = NULL;
    if (posix_memalign(&p, KERN_ALIGN, bytes ? bytes : 1) != 0)
        return FU_ENOMEM;
    *owned = p;
    *out = p;
    return FU_OK;
}

/* In place: row[j] = exp(row[j] − mx) for j < n; returns their sum. Always inlined, so it is
 * vectorised for the caller's clone. */
static inline __attribute__((always_inline)) float exp_shifted_sum(float *row, int64_t n, float mx)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) {
        row[j] = kern_expf(row[j] - mx);
        sum += row[j];
    }
    return sum;
}

/* In place: row[0..lim) becomes softmax(row[0..lim)), row[lim..tk) becomes 0. */
KERN_HOT static void softmax_row(float *row, int64_t lim, int64_t tk)
{
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < lim; j++)
        mx = row[j] > mx ? row[j] : mx;
    float inv = 1.0f / exp_shifted_sum(row, lim, mx);
#pragma omp simd
    for (int64_t j = 0; j < lim; j++)
        row[j] *= inv;
    for (int64_t j = lim; j < tk; j++)
        row[j] = 0.0f;
}

/* The first key a query at position `pos` sees: 0, or with a sliding window the window's first. */
static inline int64_t window_lo(const kern_attn_params *p, int64_t pos)
{
    return p->window > 0 && pos + 1 > p->window ? pos + 1 - p->window : 0;
}

/* In-place causal softmax of S rows: row i keeps columns lo..q_offset+i (lo: window_lo), the rest
 * become 0. */
static void masked_softmax(const kern_attn_params *p, float *S, int64_t tq, int64_t tk, int64_t q_offset)
{
#pragma omp parallel for num_threads(kern_cpu_threads()) if (tq * tk > kern_cpu_par_min()) schedule(static)
    for (int64_t i = 0; i < tq; i++) {
        int64_t lim = q_offset + i + 1, lo = window_lo(p, q_offset + i); /* allowed: lo <= j < lim */
        lim = lim < tk ? lim : tk;
        lo = lo < lim ? lo : lim;
        float *row = S + i * tk;
        for (int64_t j = 0; j < lo; j++)
            row[j] = 0.0f;
        softmax_row(row + lo, lim - lo, tk - lo);
    }
}

/* dS = P ⊙ (dP − rowsum(P ⊙ dP)) for one row, in place in dr. */
KERN_HOT static void dsoftmax_row(const float *pr, float *dr, int64_t tk)
{
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < tk; j++)
        dot += pr[j] * dr[j];
#pragma omp simd
    for (int64_t j = 0; j < tk; j++)
        dr[j] = pr[j] * (dr[j] - dot);
}

/* One query row against keys/values 0..lim-1 (row stride ldk): o = softmax(scale·q·Kᵀ)·V. */
KERN_HOT static void attn_row(const float *q, const float *K, const float *V, int64_t ldk, int64_t lim, int64_t D,
                              float scale, float *sc, float *o)
{
    float mx = -INFINITY;
    for (int64_t j = 0; j < lim; j++) {
        const float *k = K + j * ldk;
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int64_t c = 0; c < D; c++)
            d += q[c] * k[c];
        sc[j] = d * scale;
        mx = sc[j] > mx ? sc[j] : mx;
    }
    float sum = exp_shifted_sum(sc, lim, mx);
    for (int64_t c = 0; c < D; c++)
        o[c] = 0.0f;
    for (int64_t j = 0; j < lim; j++) {
        const float *v = V + j * ldk;
        float w = sc[j];
#pragma omp simd
        for (int64_t c = 0; c < D; c++)
            o[c] += w * v[c];
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t c = 0; c < D; c++)
        o[c] *= inv;
}

/* Hand-written path: each thread handles whole (sequence, head) pairs, one query row at a time. */
static void attn_fwd_small(const kern_attn_params *p, int64_t tq, int64_t tk, const float *Q, const float *K,
                           const float *V, float *O, float *scr, float scale)
{
    const int64_t D = p->head_dim, Hq = p->n_head, Hkv = p->n_kv_head, group = Hq / Hkv;
    const int64_t ldq = Hq * D, ldk = Hkv * D;
    const int64_t pairs = (int64_t)p->n_seq * Hq;
#pragma omp parallel num_threads(kern_cpu_threads()) if (pairs * tk * D > kern_cpu_par_min())
    {
        float *sc = scr + (int64_t)omp_get_thread_num() * tk;
#pragma omp for schedule(static)
        for (int64_t ph = 0; ph < pairs; ph++) {
            int64_t s = ph / Hq, h = ph % Hq, g = h / group;
            for (int64_t i = 0; i < tq; i++) {
                int64_t lim = p->q_offset + i + 1, lo = window_lo(p, p->q_offset + i);
                lim = lim < tk ? lim : tk;
                lo = lo < lim ? lo : lim;
                attn_row(Q + (s * tq + i) * ldq + h * D, K + (s * tk + lo) * ldk + g * D,
                         V + (s * tk + lo) * ldk + g * D, ldk, lim - lo, D, scale, sc, O + (s * tq + i) * ldq + h * D);
            }
        }
    }
}

fu_err kern_cpu_attn_fwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                         const kern_tensor_t *k, const kern_tensor_t *v, kern_tensor_t *o, kern_workspace_t *ws)
{
    (void)be;
    const int64_t S = p->n_seq;
    const int64_t tq = q->shape[0] / S, tk = k->shape[0] / S;
    const int64_t D = p->head_dim, Hq = p->n_head, Hkv = p->n_kv_head, group = Hq / Hkv;
    const int ldq = (int)(Hq * D), ldk = (int)(Hkv * D);
    const float scale = attn_scale(p);
    const float *Q = q->data, *K = k->data, *Vp = v->data;
    float *O = o->data;
    if (tq == 0 || Hq == 0)
        return FU_OK;
    size_t mark = kern_workspace_mark(ws);
    void *owned = NULL;
    float *scr = NULL;
    bool small = tq <= ATTN_SMALL_TQ;
    const int64_t BQ = tq < ATTN_BLOCK_Q ? tq : ATTN_BLOCK_Q;
    size_t nt = (size_t)kern_cpu_threads(), rows = nt > (size_t)group ? nt : (size_t)group;
    size_t floats = small ? rows * (size_t)tk : (size_t)BQ * (size_t)tk;
    FU_TRY(scratch(ws, floats, &scr, &owned));
    if (tq == 1) {
        /* Decode: the query heads sharing a KV head are the rows of one [group, D] matrix (adjacent
         * in q's row), so each (sequence, KV head) is one GEMM pair that reads K and V once. */
        const int64_t end = p->q_offset + 1 < tk ? p->q_offset + 1 : tk, lo = window_lo(p, p->q_offset);
        const int64_t lim = end - (lo < end ? lo : end); /* keys seen: lo..end-1 */
        for (int64_t s = 0; s < S; s++) {
            for (int64_t g = 0; g < Hkv; g++) {
                const float *Qg = Q + s * ldq + g * group * D;
                const float *Kg = K + (s * tk + end - lim) * ldk + g * D;
                const float *Vg = Vp + (s * tk + end - lim) * ldk + g * D;
                float *Og = O + s * ldq + g * group * D;
                if (group == 1) { /* BLAS gemv beats a one-row gemm */
                    cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)lim, (int)D, scale, Kg, ldk, Qg, 1, 0.0f, scr, 1);
                    softmax_row(scr, lim, lim);
                    cblas_sgemv(CblasRowMajor, CblasTrans, (int)lim, (int)D, 1.0f, Vg, ldk, scr, 1, 0.0f, Og, 1);
                } else {
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)group, (int)lim, (int)D, scale, Qg,
                                (int)D, Kg, ldk, 0.0f, scr, (int)lim);
                    for (int64_t r = 0; r < group; r++)
                        softmax_row(scr + r * lim, lim, lim);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)group, (int)D, (int)lim, 1.0f, scr,
                                (int)lim, Vg, ldk, 0.0f, Og, (int)D);
                }
            }
        }
    } else if (small) {
        attn_fwd_small(p, tq, tk, Q, K, Vp, O, scr, scale);
    } else {
        for (int64_t s = 0; s < S; s++) {
            for (int64_t h = 0; h < Hq; h++) {
                int64_t g = h / group;
                const float *Kg = K + s * tk * ldk + g * D;
                const float *Vg = Vp + s * tk * ldk + g * D;
                for (int64_t i0 = 0; i0 < tq; i0 += BQ) {
                    int64_t bq = tq - i0 < BQ ? tq - i0 : BQ;
                    int64_t kl = p->q_offset + i0 + bq; /* keys the block's last row sees */
                    kl = kl < tk ? kl : tk;
                    const float *Qb = Q + (s * tq + i0) * ldq + h * D;
                    float *Ob = O + (s * tq + i0) * ldq + h * D;
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bq, (int)kl, (int)D, scale, Qb, ldq, Kg,
                                ldk, 0.0f, scr, (int)kl);
                    masked_softmax(p, scr, bq, kl, p->q_offset + i0);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bq, (int)D, (int)kl, 1.0f, scr,
                                (int)kl, Vg, ldk, 0.0f, Ob, ldq);
                }
            }
        }
    }
    free(owned);
    kern_workspace_rewind(ws, mark);
    return FU_OK;
}

fu_err kern_cpu_attn_bwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                         const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *dout,
                         kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv, kern_workspace_t *ws)
{
    (void)be;
    const int64_t S = p->n_seq;
    const int64_t tq = q->shape[0] / S, tk = k->shape[0] / S;
    const int64_t D = p->head_dim, Hq = p->n_head, Hkv = p->n_kv_head, group = Hq / Hkv;
    const int ldq = (int)(Hq * D), ldk = (int)(Hkv * D);
    const float scale = attn_scale(p);
    const float *Q = q->data, *K = k->data, *Vp = v->data, *dO = dout->data;
    float *dQ = dq->data, *dK = dk->data, *dV = dv->data;
    memset(dK, 0, kern_tensor_nbytes(dk));
    memset(dV, 0, kern_tensor_nbytes(dv));
    if (tq == 0 || tk == 0) {
        memset(dQ, 0, kern_tensor_nbytes(dq));
        return FU_OK;
    }
    size_t mark = kern_workspace_mark(ws);
    void *owned = NULL;
    float *P = NULL;
    const int64_t BQ = tq < ATTN_BLOCK_Q ? tq : ATTN_BLOCK_Q;
    FU_TRY(scratch(ws, 2 * (size_t)BQ * (size_t)tk, &P, &owned));
    float *dP = P + BQ * tk;
    for (int64_t s = 0; s < S; s++) {
        for (int64_t h = 0; h < Hq; h++) {
            int64_t g = h / group;
            const float *Kg = K + s * tk * ldk + g * D;
            const float *Vg = Vp + s * tk * ldk + g * D;
            float *dKg = dK + s * tk * ldk + g * D;
            float *dVg = dV + s * tk * ldk + g * D;
            for (int64_t i0 = 0; i0 < tq; i0 += BQ) {
                int64_t bq = tq - i0 < BQ ? tq - i0 : BQ;
                int64_t kl = p->q_offset + i0 + bq; /* keys the block's last row sees */
                kl = kl < tk ? kl : tk;
                const float *Qb = Q + (s * tq + i0) * ldq + h * D;
                const float *dOb = dO + (s * tq + i0) * ldq + h * D;
                float *dQb = dQ + (s * tq + i0) * ldq + h * D;
                const int ldp = (int)kl;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bq, (int)kl, (int)D, scale, Qb, ldq, Kg, ldk,
                            0.0f, P, ldp);
                masked_softmax(p, P, bq, kl, p->q_offset + i0);
                /* dP = dO·Vᵀ; dV += Pᵀ·dO */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bq, (int)kl, (int)D, 1.0f, dOb, ldq, Vg, ldk,
                            0.0f, dP, ldp);
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)kl, (int)D, (int)bq, 1.0f, P, ldp, dOb, ldq,
                            1.0f, dVg, ldk);
                /* dS = P ⊙ (dP − rowsum(P ⊙ dP)), stored in dP */
#pragma omp parallel for num_threads(kern_cpu_threads()) if (bq * kl > kern_cpu_par_min()) schedule(static)
                for (int64_t i = 0; i < bq; i++)
                    dsoftmax_row(P + i * kl, dP + i * kl, kl);
                /* dQ = scale·dS·K; dK += scale·dSᵀ·Q */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bq, (int)D, (int)kl, scale, dP, ldp, Kg,
                            ldk, 0.0f, dQb, ldq);
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)kl, (int)D, (int)bq, scale, dP, ldp, Qb, ldq,
                            1.0f, dKg, ldk);
            }
        }
    }
    free(owned);
    kern_workspace_rewind(ws, mark);
    return FU_OK;
}
