/* kern_cuda: the CUDA backend (cuBLAS GEMMs + hand-written kernels) and the GPU-only fused paths
 * (LoRA-FA layer, SALR bitmap-sparse products) that the generic backend table does not describe.
 *
 * Built only when nvcc is found (FUSION_HAVE_CUDA). Every function here returns an error instead
 * of aborting: FU_ENOSYS/FU_ENOTFOUND when there is no usable device, FU_ENOMEM when device memory
 * runs out, FU_ECUDA (with the CUDA/cuBLAS message logged through fu_log, component "cuda") for any
 * other driver or library failure, FU_EINVAL for bad shapes, dtypes or devices.
 *
 * A backend instance owns one CUDA stream; every op of that instance is queued on it in call order
 * and is asynchronous unless its contract says it returns data to the host (copy_out, xent_fwd,
 * sample, and the ops that validate ids/targets, which wait for the stream). Float tensors may be
 * f32, f16 or bf16 (f16/bf16 are storage types: arithmetic accumulates in f32). docs/CUDA.md
 * describes the kernels. */
#ifndef FU_KERN_CUDA_H
#define FU_KERN_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "kern_backend.h"
#include "kern_bitmap.h"
#include "kern_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERN_CUDA_MAX_DEVICES 64 /* ordinals kern_backend_cuda serves */
#define KERN_CUDA_BITMAP_GEMV_MAX_BATCH 16   /* batches up to this use the fused decode+GEMV kernel */
#define KERN_CUDA_BITMAP_DENSE_MIN_BATCH 256 /* batches from this decode W to a dense scratch + cuBLAS */

/* Number of usable CUDA devices; 0 when there is no driver, no device, or the runtime fails (never
 * crashes, logs at debug level). Thread-safe. */
int kern_cuda_device_count(void);

/* What a peer reports about a device (its profile for the scheduler). */
typedef struct {
    char   name[256];     /* "NVIDIA H100 80GB HBM3" (cudaDeviceProp.name) */
    int    cc_major;      /* compute capability */
    int    cc_minor;
    int    sm_count;      /* multiprocessors */
    size_t total_bytes;   /* device memory */
    size_t free_bytes;    /* free now (cudaMemGetInfo) */
    size_t smem_per_block; /* shared memory a block may opt in to */
} kern_cuda_info;

/* Fills *out for device `device`. FU_ENOTFOUND when there is no such device, FU_ECUDA when the
 * driver fails. Thread-safe. */
FU_MUST_CHECK fu_err kern_cuda_device_info(int device, kern_cuda_info *out);

/* The shared backend of device `ordinal` (created on first use, static storage, never freed): what
 * kern_backend_get("cuda:N") returns. FU_ENOTFOUND when there is no such device, FU_ECUDA/FU_ENOMEM
 * when creating its stream, cuBLAS handle or buffers fails. Thread-safe. */
FU_MUST_CHECK fu_err kern_backend_cuda(int ordinal, const kern_backend_t **out);

/* A private backend instance of device `device` with its own stream, cuBLAS handle and memory pool
 * (for example one per pipeline stage). Errors as kern_backend_cuda. The caller owns *out and
 * releases it with kern_backend_cuda_close after every tensor allocated from it was destroyed. */
FU_MUST_CHECK fu_err kern_backend_cuda_open(int device, kern_backend_t **out);
/* Waits for the instance's stream, frees its pool, handle and stream; sets *be_p to NULL.
 * NULL-safe and idempotent. Must not be given the shared instances of kern_backend_cuda. */
void kern_backend_cuda_close(kern_backend_t **be_p);

/* Bytes the instance's pool holds: handed out (live) and cached for reuse, plus the peak of live. */
FU_MUST_CHECK fu_err kern_cuda_pool_stats(const kern_backend_t *be, size_t *live, size_t *cached,
                                          size_t *peak);
/* Returns the pool's cached (unused) blocks to the driver. */
FU_MUST_CHECK fu_err kern_cuda_pool_trim(const kern_backend_t *be);

/* Pinned (page-locked) host memory for frames that cross the network: copies to and from it run at
 * full PCIe speed. FU_ENOMEM when it cannot be had. Free with kern_cuda_host_free (NULL-safe). */
FU_MUST_CHECK fu_err kern_cuda_host_alloc(size_t bytes, void **out);
void kern_cuda_host_free(void *p);

/* ---- LoRA-FA (fused) ----
 * Y[n,out] = X·Wᵀ + s·(X·Aᵀ)·Bᵀ with W [out,in], A [r,in] frozen, B [out,r] trained. Writes
 * h [n,r] = X·Aᵀ, the only activation backward needs. Three cuBLAS calls: h = X·Aᵀ, Y = s·h·Bᵀ,
 * then the frozen GEMM Y = X·Wᵀ + 1·Y, whose epilogue absorbs the adapter (no extra pass over Y).
 * All tensors 2-D with contiguous rows, one float dtype, on be's device. */
FU_MUST_CHECK fu_err kern_cuda_lorafa_forward(const kern_backend_t *be, const kern_tensor_t *x,
                                              const kern_tensor_t *w, const kern_tensor_t *a,
                                              const kern_tensor_t *b, float s, kern_tensor_t *h,
                                              kern_tensor_t *y);
/* Backward: dB += s·dYᵀ·h (skipped when db is NULL); dX = dY·W + s·(dY·B)·A (overwritten;
 * skipped when dx is NULL). Needs only h, never X. Scratch [n,r] comes from the pool. */
FU_MUST_CHECK fu_err kern_cuda_lorafa_backward(const kern_backend_t *be, const kern_tensor_t *dy,
                                               const kern_tensor_t *h, const kern_tensor_t *w,
                                               const kern_tensor_t *a, const kern_tensor_t *b, float s,
                                               kern_tensor_t *dx, kern_tensor_t *db);

/* ---- SALR: bitmap-sparse frozen weights on the device ---- */
typedef struct kern_cuda_bitmap kern_cuda_bitmap_t;

/* Uploads a bitmap matrix (kern_bitmap.h layout, unchanged: 8x64 tiles, packed values, per-tile
 * offsets) to be's device. The device copy is immutable. FU_ENOMEM / FU_ECUDA on failure. The
 * caller owns *out (kern_cuda_bitmap_destroy, before the backend is closed). */
FU_MUST_CHECK fu_err kern_cuda_bitmap_upload(const kern_backend_t *be, const kern_bitmap_t *bm,
                                             kern_cuda_bitmap_t **out);
void kern_cuda_bitmap_destroy(kern_cuda_bitmap_t **self_p); /* NULL-safe; NULLs *self_p */
size_t kern_cuda_bitmap_rows(const kern_cuda_bitmap_t *self);
size_t kern_cuda_bitmap_cols(const kern_cuda_bitmap_t *self);

/* Y[n,rows] = X[n,cols]·Wᵀ + beta·Y with W the bitmap matrix (beta 0 or 1). X and Y 2-D with
 * contiguous rows, same float dtype. n <= KERN_CUDA_BITMAP_GEMV_MAX_BATCH: fused decode+GEMV kernel
 * (tiles staged through shared memory with cp.async, double-buffered); up to
 * KERN_CUDA_BITMAP_DENSE_MIN_BATCH with f16/bf16 (sm_80+, cols % 8 == 0): tile-by-tile decode into
 * shared memory pipelined with tensor-core MMA; otherwise decode to a dense scratch (from the pool,
 * rows·cols elements) + cuBLAS, which at large batch costs about one extra pass over W. */
FU_MUST_CHECK fu_err kern_cuda_bitmap_matmul(const kern_backend_t *be, const kern_tensor_t *x,
                                             const kern_cuda_bitmap_t *w, float beta, kern_tensor_t *y);
/* As kern_cuda_bitmap_matmul but never the dense scratch: the GEMV kernel up to the GEMV batch, the
 * tensor-core kernel above it (FU_EINVAL when that kernel cannot serve: f32, sm < 80, cols % 8).
 * For benchmarks and tests of the fused kernels. */
FU_MUST_CHECK fu_err kern_cuda_bitmap_matmul_fused(const kern_backend_t *be, const kern_tensor_t *x,
                                                   const kern_cuda_bitmap_t *w, float beta, kern_tensor_t *y);
/* dX[n,cols] = dY[n,rows]·W (overwritten): the input gradient through a frozen sparse weight
 * (decode to a dense scratch + cuBLAS). */
FU_MUST_CHECK fu_err kern_cuda_bitmap_matmul_dx(const kern_backend_t *be, const kern_tensor_t *dy,
                                                const kern_cuda_bitmap_t *w, kern_tensor_t *dx);
/* dst [rows, cols] (2-D, contiguous rows, any float dtype) = the dense matrix. */
FU_MUST_CHECK fu_err kern_cuda_bitmap_decode(const kern_backend_t *be, const kern_cuda_bitmap_t *w,
                                             kern_tensor_t *dst);

/* SALR layer forward with the concatenated adapters of kern_salr.h (a_cat [rt,in] = [A1;A2],
 * b_cat [out,rt] = [s1·B1 | s2·B2]): Y = X·W_sparseᵀ + (X·a_catᵀ)·b_catᵀ as the sparse kernel plus
 * ONE GEMM pair; writes h [n,rt] = X·a_catᵀ for backward. a_cat/b_cat/h may all be NULL (no
 * adapters). */
FU_MUST_CHECK fu_err kern_cuda_salr_forward(const kern_backend_t *be, const kern_tensor_t *x,
                                            const kern_cuda_bitmap_t *w, const kern_tensor_t *a_cat,
                                            const kern_tensor_t *b_cat, kern_tensor_t *h,
                                            kern_tensor_t *y);
/* SALR layer backward given dY [n,out] and the forward's h [n,rt]:
 *   db1 [out,r1] += s1·dYᵀ·h[:, :r1]   (NULL skips; r1 = db1's column count)
 *   dx  [n,in]    = dY·W_sparse + (dY·b_cat)·a_cat   (overwritten; NULL skips). */
FU_MUST_CHECK fu_err kern_cuda_salr_backward(const kern_backend_t *be, const kern_tensor_t *dy,
                                             const kern_tensor_t *h, const kern_cuda_bitmap_t *w,
                                             const kern_tensor_t *a_cat, const kern_tensor_t *b_cat,
                                             float s1, kern_tensor_t *db1, kern_tensor_t *dx);

#ifdef __cplusplus
}
#endif
#endif
