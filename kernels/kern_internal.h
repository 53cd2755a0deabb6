/* Internal to kernels/: validation helpers shared by the wrappers, and the CPU backend's op
 * functions (defined across kern_cpu*.c, collected into the table in kern_cpu.c). Not installed;
 * the CUDA backend may use the validation helpers and kern_sample_host. */
#ifndef FU_KERN_INTERNAL_H
#define FU_KERN_INTERNAL_H

#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERN_INT_LIMIT 2147483647LL /* BLAS dimensions and leading dimensions are int */
/* Work (elements) below which a CPU loop stays on the calling thread. OpenBLAS's pthread workers
 * keep spinning for a while after each GEMM, so a small OpenMP region that follows a GEMM fights
 * them for the cores: on a loaded 2-core machine 10 RMSNorms of 512x768 took 74 ms with 2 threads
 * right after a GEMM and 1.2 ms with one. Only work worth milliseconds is split. */
#define KERN_CPU_PAR_MIN (1 << 20)

/* t is non-NULL, well formed, on be's device, with data when it has elements. */
fu_err kern_chk_dev(const kern_backend_t *be, const kern_tensor_t *t);
/* kern_chk_dev and contiguous. */
fu_err kern_chk_contig(const kern_backend_t *be, const kern_tensor_t *t);
/* Float dtypes be's ops accept (bitmask of 1u << dtype); a table that leaves float_dtypes 0
 * accepts f32 only. */
static inline unsigned kern_float_mask(const kern_backend_t *be)
{
    return be->float_dtypes ? be->float_dtypes : (1u << KERN_F32);
}
/* kern_chk_contig, a float dtype be accepts, and ndim dims (ndim 0: any). */
fu_err kern_chk_float(const kern_backend_t *be, const kern_tensor_t *t, int ndim);
/* A 2-D float matrix (dtype be accepts) with contiguous rows whose sizes fit BLAS ints. */
fu_err kern_chk_mat(const kern_backend_t *be, const kern_tensor_t *t);
/* True when b is NULL or has a's dtype. */
static inline bool kern_same_dtype(const kern_tensor_t *a, const kern_tensor_t *b)
{
    return !b || a->dtype == b->dtype;
}

/* Host sampling over n rows of V logits (row stride ld); used by the CPU backend and usable by
 * device backends after copying logits out. Arguments are assumed validated. */
fu_err kern_sample_host(const float *logits, int64_t n, int64_t V, int64_t ld,
                        const kern_sample_params *p, uint64_t counter, int32_t *out_tokens);

/* CPU backend op functions. */
fu_err kern_cpu_embedding_fwd(const kern_backend_t *be, const kern_tensor_t *ids,
                              const kern_tensor_t *table, kern_tensor_t *out);
fu_err kern_cpu_embedding_bwd(const kern_backend_t *be, const kern_tensor_t *ids,
                              const kern_tensor_t *dout, kern_tensor_t *dtable);
fu_err kern_cpu_rmsnorm_fwd(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w,
                            float eps, kern_tensor_t *y);
fu_err kern_cpu_rmsnorm_bwd(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                            const kern_tensor_t *w, float eps, kern_tensor_t *dx, kern_tensor_t *dw);
fu_err kern_cpu_rope(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos,
                     int head_dim, float theta, bool inverse, kern_tensor_t *y);
fu_err kern_cpu_silu_mul_fwd(const kern_backend_t *be, const kern_tensor_t *gate,
                             const kern_tensor_t *up, kern_tensor_t *out);
fu_err kern_cpu_silu_mul_bwd(const kern_backend_t *be, const kern_tensor_t *dout,
                             const kern_tensor_t *gate, const kern_tensor_t *up, kern_tensor_t *dgate,
                             kern_tensor_t *dup);
fu_err kern_cpu_xent_fwd(const kern_backend_t *be, const kern_tensor_t *logits,
                         const kern_tensor_t *targets, int32_t ignore_index, float *loss,
                         int64_t *n_valid);
fu_err kern_cpu_xent_bwd(const kern_backend_t *be, const kern_tensor_t *logits,
                         const kern_tensor_t *targets, int32_t ignore_index, float grad_scale,
                         kern_tensor_t *dlogits);
fu_err kern_cpu_attn_ws_bytes(const kern_backend_t *be, const kern_attn_params *p, int64_t tq,
                              int64_t tk, bool backward, size_t *bytes);
fu_err kern_cpu_attn_fwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                         const kern_tensor_t *k, const kern_tensor_t *v, kern_tensor_t *o,
                         kern_workspace_t *ws);
fu_err kern_cpu_attn_bwd(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                         const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *dout,
                         kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv,
                         kern_workspace_t *ws);
fu_err kern_cpu_sparse_matmul(const kern_backend_t *be, const kern_tensor_t *x, const kern_sparse_weight *w,
                              float beta, kern_tensor_t *y);
fu_err kern_cpu_sparse_matmul_dx(const kern_backend_t *be, const kern_tensor_t *dy, const kern_sparse_weight *w,
                                 kern_tensor_t *dx);
fu_err kern_cpu_sample(const kern_backend_t *be, const kern_tensor_t *logits,
                       const kern_sample_params *p, uint64_t counter, int32_t *out_tokens);

#ifdef __cplusplus
}
#endif
#endif
