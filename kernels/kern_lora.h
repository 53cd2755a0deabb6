/* kern_lora: low-rank adapters on a frozen linear layer, in PEFT layouts.
 *
 *   Y = X·Wᵀ + s·(X·Aᵀ)·Bᵀ      X [n,in], W [out,in], A [r,in], B [out,r], s = alpha/r
 *
 * LoRA trains A and B and must keep X for backward. LoRA-FA (Zhang et al., 2023) freezes A as well
 * and trains only B, so backward needs only H = X·Aᵀ ([n,r]), never X:
 *   dB += s·dYᵀ·H,   dX = dY·W + s·(dY·B)·A.
 * Both share kern_lora_forward (which writes H); they differ in backward and in what the caller
 * keeps (kern_lora_saved_bytes).
 *
 * Extra frozen adapters (SALR's frozen SVD adapter) plug in without new entry points: concatenate
 * the adapters as A = [A₁; A₂] (rows) and B = [s₁B₁ | s₂B₂] (columns), call with scale 1, and take
 * the trainable part's gradient from column views (kern_tensor_slice) of H and B. A base weight
 * that is not a dense W (a bitmap-sparse W) plugs in through w == NULL: the caller has already
 * written the base product into Y (forward) or dY·W into dX (backward), and these functions add the
 * adapter term.
 *
 * All tensors 2-D, rows contiguous (row strides allowed), on be's device, of one float dtype the
 * backend computes in (f32 on the CPU). Parameter gradients
 * (dA, dB) accumulate; dX is overwritten unless w is NULL (then the adapter term is added). */
#ifndef FU_KERN_LORA_H
#define FU_KERN_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    KERN_ADAPTER_LORA = 0, /* trains A and B; saves X and H */
    KERN_ADAPTER_LORA_FA,  /* trains B only; saves H */
} kern_adapter_kind;

/* s = alpha / rank (0 when rank <= 0). */
float kern_lora_scale(float alpha, int64_t rank);

/* Initialises an adapter: A [r,in] from Kaiming-uniform U(−1/√in, 1/√in) drawn by a seeded
 * xoshiro256** stream (same seed, same A on every backend), B [out,r] = 0. FU_EINVAL on bad
 * shapes. */
FU_MUST_CHECK fu_err kern_lora_init(const kern_backend_t *be, kern_tensor_t *a, kern_tensor_t *b, uint64_t seed);

/* Bytes a layer keeps between forward and backward for n tokens of `in` features at rank r in
 * dtype dt: LoRA-FA n·r elements (H); LoRA n·in + n·r (X and H). FU_EINVAL on negative sizes or
 * overflow. */
FU_MUST_CHECK fu_err kern_lora_saved_bytes(kern_adapter_kind kind, int64_t n, int64_t in, int64_t rank, kern_dtype dt,
                                           size_t *bytes);

/* Forward for both kinds: h [n,r] = X·Aᵀ (keep it for backward), Y [n,out] = X·Wᵀ + s·H·Bᵀ.
 * w == NULL: Y already holds the base product and only s·H·Bᵀ is added. */
FU_MUST_CHECK fu_err kern_lora_forward(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w,
                                       const kern_tensor_t *a, const kern_tensor_t *b, float scale,
                                       kern_tensor_t *h, kern_tensor_t *y);

/* LoRA-FA backward from H alone: db [out,r] += s·dYᵀ·H (NULL to skip); dx [n,in] = dY·W + s·(dY·B)·A
 * (NULL to skip; w == NULL: only the adapter term is added to dx). Scratch of n·r floats comes from
 * ws (NULL: allocated here). */
FU_MUST_CHECK fu_err kern_lorafa_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *h,
                                          const kern_tensor_t *w, const kern_tensor_t *a, const kern_tensor_t *b,
                                          float scale, kern_tensor_t *dx, kern_tensor_t *db,
                                          kern_workspace_t *ws);

/* Plain LoRA backward: as kern_lorafa_backward, plus da [r,in] += s·(dY·B)ᵀ·X (NULL to skip), which
 * is why X must be kept. */
FU_MUST_CHECK fu_err kern_lora_backward(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                                        const kern_tensor_t *h, const kern_tensor_t *w, const kern_tensor_t *a,
                                        const kern_tensor_t *b, float scale, kern_tensor_t *dx,
                                        kern_tensor_t *da, kern_tensor_t *db, kern_workspace_t *ws);

/* Optional LoRA-FA gradient correction used by PEFT's LoRA-FA optimizer (not part of the published
 * method, which trains B with the plain gradient): db ← db·(A·Aᵀ)⁻¹ / s². A·Aᵀ must be positive
 * definite (A of full row rank); FU_EINVAL otherwise. Runs on the host (LAPACK), copying through
 * the backend for device tensors. f32 tensors only. */
FU_MUST_CHECK fu_err kern_lorafa_correct_grad(const kern_backend_t *be, const kern_tensor_t *a, float scale,
                                              kern_tensor_t *db);

#ifdef __cplusplus
}
#endif
#endif
