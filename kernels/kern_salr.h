/* kern_salr: the CPU kernels of SALR (sparsity-aware low-rank adaptation).
 *
 *   1. kern_salr_prune        magnitude pruning of a frozen weight to a target sparsity
 *   2. kern_salr_svd          the pruned residual R = W - W_sparse as a frozen rank-r adapter
 *   3. kern_salr_spmm         Y (+)= X * W_sparse^T with W_sparse bitmap-encoded (kern_bitmap.h)
 *   4. kern_salr_concat_*     every adapter of a layer (trainable LoRA / LoRA-FA A1,B1 and the
 *                             frozen residual A2,B2) as ONE GEMM pair
 *
 * All matrices are plain row-major float arrays with explicit dimensions. Weights use the Hugging
 * Face layout W [out, in]; a linear layer is Y = X * W^T with X [n, in], Y [n, out]. Adapters use
 * PEFT's orientation: lora_A [r, in], lora_B [out, r], delta W = B * A.
 *
 * Dense parts run on OpenBLAS (cblas/LAPACKE); functions are thread-safe for distinct outputs. */
#ifndef FU_KERN_SALR_H
#define FU_KERN_SALR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "kern_bitmap.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERN_SALR_DEFAULT_SPARSITY 0.5     /* fraction of a matrix's elements pruned */
#define KERN_SALR_THREADS          2       /* worker threads of kern_salr_spmm when 0 is given */
#define KERN_SALR_FUSED_MAX_BATCH  4       /* batch rows one fused decode-and-multiply pass serves */
#ifndef KERN_SALR_FUSED_BATCH_LIMIT
#define KERN_SALR_FUSED_BATCH_LIMIT 16     /* batches up to this use fused passes, larger ones the
                                              decode + sgemm pipeline */
#endif
#ifndef KERN_SALR_BLOCK_BYTES
#define KERN_SALR_BLOCK_BYTES      (32u << 20) /* dense row block decoded per sgemm (at most): big
                                              blocks keep sgemm from re-packing X often, and
                                              32 MiB still stays in a desktop L3 */
#endif
#define KERN_SALR_SVD_EXACT_MAX_DIM 1024   /* KERN_SALR_SVD_AUTO: exact SVD when min(rows, cols)
                                              is at most this */
#define KERN_SALR_SVD_OVERSAMPLE   16      /* randomized SVD: extra columns of the range sketch */
#define KERN_SALR_SVD_POWER_ITERS  3       /* randomized SVD: subspace (power) iterations */

/* Magnitude pruning. Keeps the n_keep = rows*cols - round(sparsity*rows*cols) elements of largest
 * |w| (ties: the lower flat index wins, so the result is deterministic) and writes
 *   w_sparse[i] = kept ? w[i] : 0,   residual[i] = kept ? 0 : w[i]   (residual may be NULL).
 * w_sparse may be w itself (in place); residual must not alias w. Linear time (a 3-pass radix
 * selection on the bit patterns of |w|, then one pass), no sort, no copy of w.
 * *n_kept (may be NULL) receives n_keep. Returns FU_EINVAL for NULL w/w_sparse, zero dimensions,
 * sparsity outside [0, 1] or NaN in w. Thread-safe. */
FU_MUST_CHECK fu_err kern_salr_prune(const float *w, size_t rows, size_t cols, double sparsity,
                                     float *w_sparse, float *residual, size_t *n_kept);

/* How kern_salr_svd computes the truncated SVD. */
typedef enum {
    KERN_SALR_SVD_AUTO = 0,   /* exact for small matrices; randomized for big ones, falling back to
                                 exact when the sketch would break the SALR error bound */
    KERN_SALR_SVD_EXACT,      /* LAPACKE_sgesdd of the whole matrix */
    KERN_SALR_SVD_RANDOMIZED, /* Gaussian range sketch + power iterations + small sgesdd */
} kern_salr_svd_method;

/* Rank-r factors of r_mat [rows, cols] (the pruned residual): with R ~= U_r S_r V_r^T,
 *   lora_b [rows, rank] = U_r * S_r^(1/2)      (the paper's A2, PEFT's lora_B)
 *   lora_a [rank, cols] = S_r^(1/2) * V_r^T    (the paper's B2, PEFT's lora_A)
 * so R ~= lora_b * lora_a and the adapter concatenates with a LoRA adapter of the same layer.
 * Exact SVD guarantees ||R - R_r||_F^2 <= (1 - rank/min(rows, cols)) * ||R||_F^2; AUTO keeps that
 * guarantee. *err_ratio (may be NULL) receives ||R - R_r||_F^2 / ||R||_F^2 (0 when R = 0).
 * seed drives the randomized sketch (deterministic for a given seed). Returns FU_EINVAL for NULL
 * pointers, rank 0, rank > min(rows, cols), dimensions beyond LAPACK's int or an unknown method,
 * FU_EINVAL also when LAPACK reports an error or no convergence. Thread-safe. */
FU_MUST_CHECK fu_err kern_salr_svd(const float *r_mat, size_t rows, size_t cols, size_t rank,
                                   kern_salr_svd_method method, uint64_t seed, float *lora_a,
                                   float *lora_b, double *err_ratio);

/* How kern_salr_spmm runs batches above KERN_SALR_FUSED_BATCH_LIMIT. Both decode W to dense row
 * blocks and multiply each with cblas_sgemm; they differ in what overlaps. */
typedef enum {
    KERN_SALR_STRATEGY_AUTO = 0,  /* PIPELINED when n_threads exceeds OpenBLAS's thread count (a
                                     core is free for the decoder), else BLOCKED */
    KERN_SALR_STRATEGY_BLOCKED,   /* decode block k with all n_threads, multiply it with all BLAS
                                     threads, then block k+1 */
    KERN_SALR_STRATEGY_PIPELINED, /* a decode thread fills block k+1 while block k is multiplied */
} kern_salr_strategy;

/* Process-wide choice for kern_salr_spmm (benchmarks and tests; AUTO by default). Thread-safe. */
void kern_salr_set_strategy(kern_salr_strategy s);

/* Sparse x dense product Y = X * W^T (accumulate: Y += X * W^T) with W [out, in] bitmap-encoded,
 * X [n, in], Y [n, out], both contiguous row-major. Batches up to KERN_SALR_FUSED_BATCH_LIMIT run
 * the fused decode-and-multiply kernel (AVX-512 expand / AVX2 / scalar, chosen at run time) with
 * tile rows split over n_threads threads (with 2, the second half runs on a persistent helper
 * thread started on first use and kept until exit); larger batches decode dense row blocks and
 * multiply them with cblas_sgemm (kern_salr_strategy). n_threads <= 0 means KERN_SALR_THREADS; a
 * thread that cannot be started leaves its work to the calling thread. Returns FU_EINVAL for NULL
 * pointers, n = 0 or dimensions beyond BLAS's int. Thread-safe for distinct y. */
FU_MUST_CHECK fu_err kern_salr_spmm(const kern_bitmap_t *w, const float *x, size_t n, float *y,
                                    bool accumulate, int n_threads);

/* kern_salr_spmm keeps its dense block buffer (at most KERN_SALR_BLOCK_BYTES) for
 * the next call instead of faulting fresh pages in every time. This frees them (for example
 * before a process drops to a small footprint). Thread-safe. */
void kern_salr_scratch_release(void);

/* Shapes of a layer's concatenated adapters: adapter 1 (trainable LoRA or LoRA-FA, rank r1) and
 * adapter 2 (the frozen SVD residual, rank r2) on a linear layer in -> out. rt = r1 + r2. */
typedef struct {
    size_t in;  /* input features */
    size_t out; /* output features */
    size_t r1;  /* rank of the trainable adapter (may be 0) */
    size_t r2;  /* rank of the frozen residual adapter (may be 0) */
} kern_salr_dims;

/* Builds the concatenated matrices
 *   a_cat [rt, in]  = [A1; A2]           (rows of A1, then rows of A2)
 *   b_cat [out, rt] = [s1*B1 | s2*B2]    (columns of s1*B1, then of s2*B2)
 * from PEFT-oriented a1 [r1, in], b1 [out, r1], a2 [r2, in], b2 [out, r2] (pointers of a rank-0
 * adapter may be NULL). Returns FU_EINVAL for NULL outputs or inputs of a non-zero rank, zero
 * in/out or r1 + r2 = 0. */
FU_MUST_CHECK fu_err kern_salr_concat_build(const kern_salr_dims *d, const float *a1, const float *b1,
                                            float s1, const float *a2, const float *b2, float s2,
                                            float *a_cat, float *b_cat);

/* Refreshes the trainable columns of b_cat from b1 (after an optimizer step): b_cat[:, :r1] =
 * s1*B1. Returns FU_EINVAL for NULL pointers or r1 = 0. */
FU_MUST_CHECK fu_err kern_salr_concat_set_b1(const kern_salr_dims *d, const float *b1, float s1,
                                             float *b_cat);

/* Forward of all adapters as one GEMM pair: h [n, rt] = X * a_cat^T, then Y += h * b_cat^T.
 * h is the caller's buffer and is what backward needs (LoRA-FA keeps only h, never X).
 * Returns FU_EINVAL for NULL pointers or n = 0. */
FU_MUST_CHECK fu_err kern_salr_concat_forward(const kern_salr_dims *d, const float *a_cat,
                                              const float *b_cat, const float *x, size_t n, float *h,
                                              float *y);

/* Backward of the concatenated adapters given dY [n, out] and the forward's h [n, rt]:
 *   db1 [out, r1] = s1 * dY^T * h[:, :r1]                    (the LoRA-FA gradient; written, not
 *                                                             accumulated; NULL to skip)
 *   da1 [r1, in]  = (s1 * dY * B1)^T * X                     (plain LoRA only: needs x; NULL skips)
 *   dx  [n, in]  += (dY * b_cat) * a_cat                     (through both adapters; NULL skips)
 * The frozen residual adapter gets no gradient. Returns FU_EINVAL for NULL a_cat, b_cat, h or dy,
 * n = 0, da1 without x, or db1/da1 with r1 = 0. */
FU_MUST_CHECK fu_err kern_salr_concat_backward(const kern_salr_dims *d, const float *a_cat,
                                               const float *b_cat, float s1, const float *h,
                                               const float *dy, size_t n, float *db1, const float *x,
                                               float *da1, float *dx);

/* A whole SALR linear layer forward: Y = X * W_sparse^T + adapters, i.e. kern_salr_spmm followed
 * by kern_salr_concat_forward (d may be NULL for no adapters; then a_cat, b_cat, h are ignored).
 * Errors as those two. */
FU_MUST_CHECK fu_err kern_salr_linear_forward(const kern_bitmap_t *w, const kern_salr_dims *d,
                                              const float *a_cat, const float *b_cat, const float *x,
                                              size_t n, float *h, float *y);

#ifdef __cplusplus
}
#endif
#endif
