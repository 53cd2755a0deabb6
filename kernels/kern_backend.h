/* kern_backend: the table of function pointers a compute backend provides (ggml-style), and the
 * public op wrappers `kern_<op>_<verb>(be, ...)` that the DAG executor calls.
 *
 * The wrappers validate everything that can be checked from tensor descriptors (dtype, shape,
 * strides, device, sizes) and return FU_EINVAL instead of crashing; only then do they dispatch to
 * be->op. A backend function may therefore assume well-formed arguments, but must still check data
 * it reads (token ids, targets) and return FU_EINVAL for out-of-range values.
 *
 * Conventions shared by all ops:
 *   - float tensors use a dtype in be->float_dtypes (the CPU: f32 only; frozen weights may stay
 *     narrow, see weight_dtypes; other f16/bf16 tensors are
 *     converted once with kern_tensor_convert; a GPU backend may also take f16/bf16), and all float
 *     tensors of one call share one dtype; ids, positions and targets are i32;
 *   - activations are row-major [tokens, features]; weights use the Hugging Face layout
 *     [out_features, in_features], so linear is Y = X·Wᵀ;
 *   - every tensor passed to a backend must live on that backend's device;
 *   - input gradients (dX, dQ, dgate...) are OVERWRITTEN; parameter gradients (dW, dB, dA, dtable,
 *     dweight) are ACCUMULATED (+=) so micro-batches sum into one step's gradient;
 *   - unless an op says otherwise, outputs must not overlap inputs.
 * A backend is immutable after creation: its ops may be called from several threads at once on
 * disjoint tensors. */
#ifndef FU_KERN_BACKEND_H
#define FU_KERN_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "kern_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERN_XENT_IGNORE_DEFAULT (-100) /* Hugging Face's ignore_index for labels */
#define KERN_ROPE_THETA_DEFAULT  10000.0f /* LLaMA's rope_theta */
#define KERN_ROPE_MAX_HEAD_DIM   512      /* largest head_dim RoPE takes */

/* Causal multi-head attention with grouped-query heads.
 * q is [n_seq*tq, n_head*head_dim]; k, v are [n_seq*tk, n_kv_head*head_dim]; rows of sequence s
 * are rows s*tq.. (queries) and s*tk.. (keys). Query row i of a sequence sits at absolute position
 * q_offset + i among that sequence's keys and attends to keys 0..q_offset+i (causal). Training:
 * tq == tk, q_offset == 0. Decode with a KV cache: tk = cache length, q_offset = tk - tq. Query head
 * h uses key/value head h / (n_head / n_kv_head) (Hugging Face repeat_kv). */
typedef struct {
    int     n_head;    /* query heads */
    int     n_kv_head; /* key/value heads; divides n_head */
    int     head_dim;  /* features per head */
    int     n_seq;     /* independent sequences stacked along rows (>= 1) */
    int64_t q_offset;  /* absolute position of each sequence's first query among its keys */
    float   scale;     /* score scale; 0 means 1/sqrt(head_dim) */
    int64_t window;    /* sliding window (Mistral): a query at position p sees keys p-window+1..p; 0 = none */
} kern_attn_params;

/* Rotary embedding frequencies (Hugging Face): inv_freq[i] = 1 / theta^(2i/head_dim) in float32,
 * then with factor > 0 Llama 3's rescaling (rope_type "llama3"): wavelengths longer than
 * original_max_pos / low_freq_factor are divided by factor, those shorter than original_max_pos /
 * high_freq_factor kept, and those between blended. */
typedef struct {
    float theta;            /* base, > 0 */
    float factor;           /* llama3 scale factor; 0 = plain RoPE */
    float low_freq_factor;  /* llama3 */
    float high_freq_factor; /* llama3, > low_freq_factor */
    float original_max_pos; /* llama3: original_max_position_embeddings */
} kern_rope_params;

/* Whether rp and head_dim are usable: head_dim even and at most KERN_ROPE_MAX_HEAD_DIM, theta > 0,
 * and factor 0 or Llama 3's numbers in range (factor >= 1, 0 < low < high, original > 0). */
bool kern_rope_params_ok(const kern_rope_params *rp, int head_dim);

/* The head_dim/2 frequencies of rp into inv_freq (float32, as Hugging Face computes them). FU_EINVAL
 * on a head_dim that is not even and positive or on parameters out of range. */
FU_MUST_CHECK fu_err kern_rope_inv_freq(const kern_rope_params *rp, int head_dim, float *inv_freq);

/* AdamW (PyTorch semantics): p -= lr*wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g²;
 * p -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps). */
typedef struct {
    float lr;           /* learning rate */
    float beta1;        /* first-moment decay, [0, 1) */
    float beta2;        /* second-moment decay, [0, 1) */
    float eps;          /* denominator epsilon, > 0 */
    float weight_decay; /* decoupled weight decay, >= 0 */
} kern_adamw_params;

/* Token sampling. temperature <= 0 is greedy (argmax, lowest id on ties). Otherwise logits are
 * divided by temperature, restricted to the top_k most likely (0 = no limit), then to the smallest
 * set whose probability reaches top_p (>= 1 = no limit), and one token is drawn. The draw for row r
 * is a pure function of (seed, counter, r): replays reproduce it. */
typedef struct {
    float    temperature; /* <= 0: greedy */
    int      top_k;       /* 0: off */
    float    top_p;       /* (0, 1]: nucleus; >= 1: off */
    uint64_t seed;        /* RNG seed */
} kern_sample_params;

/* A frozen sparse weight W [rows, cols] (Hugging Face layout: rows = out_features) in a backend's
 * own representation: on the CPU `handle` is a const kern_bitmap_t * (kern_bitmap.h); on CUDA a
 * const kern_cuda_bitmap_t * (kern_cuda.h). rows/cols repeat the matrix's dimensions so that the
 * wrappers can validate shapes without knowing the representation; the backend checks they match. */
typedef struct {
    const void *handle; /* backend-specific sparse matrix (borrowed) */
    int64_t     rows;   /* out_features */
    int64_t     cols;   /* in_features */
} kern_sparse_weight;

typedef struct kern_backend kern_backend_t;

/* The backend table. Memory functions move raw bytes; op functions receive validated arguments
 * (see the wrappers below for each op's contract). `impl` is the backend's private state. */
struct kern_backend {
    const char *name;   /* "cpu", "cuda:0" */
    kern_device device; /* where this backend's tensors live */
    void       *impl;   /* backend-private state */
    unsigned    float_dtypes; /* bitmask (1u << kern_dtype) of float dtypes the ops accept; 0 = f32 */
    unsigned    weight_dtypes; /* dtypes a frozen weight may keep while the other operands are f32: a gemm's B
                                  operand, an embedding table (the CPU: f16, bf16 and per-row int8, widened per tile);
                                  0 = none beyond float_dtypes */

    fu_err (*alloc)(const kern_backend_t *be, size_t bytes, void **out); /* KERN_ALIGN-aligned */
    void (*free)(const kern_backend_t *be, void *p);
    fu_err (*copy_in)(const kern_backend_t *be, void *dst, const void *host_src, size_t bytes);
    fu_err (*copy_out)(const kern_backend_t *be, void *host_dst, const void *src, size_t bytes);
    fu_err (*copy)(const kern_backend_t *be, void *dst, const void *src, size_t bytes); /* on device */
    fu_err (*fill_zero)(const kern_backend_t *be, void *dst, size_t bytes);
    fu_err (*synchronize)(const kern_backend_t *be);

    fu_err (*convert)(const kern_backend_t *be, const kern_tensor_t *src, kern_tensor_t *dst);
    fu_err (*gemm)(const kern_backend_t *be, bool trans_a, bool trans_b, float alpha,
                   const kern_tensor_t *a, const kern_tensor_t *b, float beta, kern_tensor_t *c);
    fu_err (*add)(const kern_backend_t *be, const kern_tensor_t *a, const kern_tensor_t *b,
                  kern_tensor_t *y);
    fu_err (*axpy)(const kern_backend_t *be, float alpha, const kern_tensor_t *x, kern_tensor_t *y);
    fu_err (*embedding_fwd)(const kern_backend_t *be, const kern_tensor_t *ids,
                            const kern_tensor_t *table, kern_tensor_t *out);
    fu_err (*embedding_bwd)(const kern_backend_t *be, const kern_tensor_t *ids,
                            const kern_tensor_t *dout, kern_tensor_t *dtable);
    fu_err (*rmsnorm_fwd)(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *w,
                          float eps, kern_tensor_t *y);
    fu_err (*rmsnorm_bwd)(const kern_backend_t *be, const kern_tensor_t *dy, const kern_tensor_t *x,
                          const kern_tensor_t *w, float eps, kern_tensor_t *dx, kern_tensor_t *dw);
    /* inverse=false rotates by +angle (forward), inverse=true by -angle (backward). */
    fu_err (*rope)(const kern_backend_t *be, const kern_tensor_t *x, const kern_tensor_t *pos,
                   int head_dim, const kern_rope_params *rp, bool inverse, kern_tensor_t *y);
    fu_err (*silu_mul_fwd)(const kern_backend_t *be, const kern_tensor_t *gate,
                           const kern_tensor_t *up, kern_tensor_t *out);
    fu_err (*silu_mul_bwd)(const kern_backend_t *be, const kern_tensor_t *dout,
                           const kern_tensor_t *gate, const kern_tensor_t *up, kern_tensor_t *dgate,
                           kern_tensor_t *dup);
    fu_err (*attn_ws_bytes)(const kern_backend_t *be, const kern_attn_params *p, int64_t tq,
                            int64_t tk, bool backward, size_t *bytes);
    fu_err (*attn_fwd)(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                       const kern_tensor_t *k, const kern_tensor_t *v, kern_tensor_t *o,
                       kern_workspace_t *ws);
    fu_err (*attn_bwd)(const kern_backend_t *be, const kern_attn_params *p, const kern_tensor_t *q,
                       const kern_tensor_t *k, const kern_tensor_t *v, const kern_tensor_t *dout,
                       kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv, kern_workspace_t *ws);
    fu_err (*xent_fwd)(const kern_backend_t *be, const kern_tensor_t *logits,
                       const kern_tensor_t *targets, int32_t ignore_index, float *loss,
                       int64_t *n_valid);
    fu_err (*xent_bwd)(const kern_backend_t *be, const kern_tensor_t *logits,
                       const kern_tensor_t *targets, int32_t ignore_index, float grad_scale,
                       kern_tensor_t *dlogits);
    /* Optional (NULL: the wrapper runs xent_fwd then xent_bwd): loss and gradient in one pass. */
    fu_err (*xent_fused)(const kern_backend_t *be, const kern_tensor_t *logits, const kern_tensor_t *targets,
                         int32_t ignore_index, float grad_scale, float *loss, int64_t *n_valid,
                         kern_tensor_t *dlogits);
    fu_err (*adamw)(const kern_backend_t *be, kern_tensor_t *param, const kern_tensor_t *grad,
                    kern_tensor_t *m, kern_tensor_t *v, const kern_adamw_params *p, int64_t step);
    fu_err (*sample)(const kern_backend_t *be, const kern_tensor_t *logits,
                     const kern_sample_params *p, uint64_t counter, int32_t *out_tokens);
    /* Frozen sparse (bitmap) weights; NULL when a backend has no sparse kernels. */
    fu_err (*sparse_matmul)(const kern_backend_t *be, const kern_tensor_t *x, const kern_sparse_weight *w,
                            float beta, kern_tensor_t *y);
    fu_err (*sparse_matmul_dx)(const kern_backend_t *be, const kern_tensor_t *dy, const kern_sparse_weight *w,
                               kern_tensor_t *dx);
};

/* ---------------------------------------------------------------------------------------------
 * Backends */

/* The CPU backend (OpenBLAS + OpenMP). Always available; static storage, never freed. */
const kern_backend_t *kern_backend_cpu(void);

/* Looks a backend up by name: "cpu", "cuda" (= "cuda:0"), "cuda:N". FU_ENOSYS for cuda names when
 * this build has no CUDA backend; FU_ENOTFOUND for a CUDA ordinal that does not exist; FU_EINVAL for
 * any other name. *out is borrowed (static storage). */
FU_MUST_CHECK fu_err kern_backend_get(const char *name, const kern_backend_t **out);

/* ---------------------------------------------------------------------------------------------
 * Sparse (bitmap) weights on any backend. */

struct kern_bitmap;

/* Whether be can multiply by frozen bitmap-sparse weights (SALR). */
bool kern_backend_has_sparse(const kern_backend_t *be);

/* Makes *bm (a rows x cols bitmap matrix, kern_bitmap.h) a sparse weight of be: *w is what be's
 * sparse ops take. On the CPU the bitmap is used in place (*bm kept; *dev NULL); on a GPU it is
 * uploaded, *dev owns the device copy and *bm is freed (the device copy is the one used). FU_ENOSYS
 * when be has no sparse kernels, FU_ENOMEM / FU_ECUDA when the upload fails (*bm kept). */
FU_MUST_CHECK fu_err kern_sparse_weight_make(const kern_backend_t *be, struct kern_bitmap **bm, int64_t rows,
                                             int64_t cols, kern_sparse_weight *w, void **dev);
/* Frees what kern_sparse_weight_make left in *dev (NULL-safe; NULLs *dev). */
void kern_sparse_weight_release(const kern_backend_t *be, void **dev);

/* What a backend's device is, for a peer's profile. */
typedef struct {
    char name[256];        /* "cpu: AMD EPYC 9R14" (/proc/cpuinfo) or the GPU's name */
    uint64_t free_bytes;   /* memory free now: MemAvailable, or the GPU's free memory */
    uint64_t total_bytes;  /* all of it (0 when unknown) */
    char numeric_class[160]; /* two devices of the same non-empty class compute the same bits for the same
                                job (docs/DAG.md "Determinism"); "" where that is not promised (CUDA) */
} kern_device_info;

/* Fills *out for be's device. FU_ECUDA when the driver cannot say, FU_EINVAL without be. */
FU_MUST_CHECK fu_err kern_backend_device_info(const kern_backend_t *be, kern_device_info *out);

/* Number of threads the CPU backend uses (OpenMP loops and the tiles of its GEMMs; OpenBLAS itself
 * runs one thread per call). Small ops always run on the calling thread. Every CPU op gives the
 * same bits whatever this number is (docs/DAG.md "Determinism"). */
int kern_cpu_threads(void);
/* Sets that number process-wide (0: automatic = OpenMP's default). FU_EINVAL when n < 0 or absurd.
 * Thread-safe, but workspace sizes queried before a change may no longer fit attention's
 * few-query path (it then returns FU_ENOMEM rather than overrun). */
FU_MUST_CHECK fu_err kern_cpu_set_threads(int n);

/* How the CPU backend's GEMMs use threads. DETERMINISTIC (the default): fixed tiles, the same bits
 * for any thread count. BLAS_THREADS: one OpenBLAS call split by OpenBLAS's own threads (set to
 * kern_cpu_threads() when the mode is chosen), whose bits depend on the thread count; it exists so
 * that benchmarks can measure what determinism costs, and nothing else should choose it. Not
 * thread-safe against GEMMs running at the time. */
typedef enum { KERN_CPU_GEMM_DETERMINISTIC = 0, KERN_CPU_GEMM_BLAS_THREADS } kern_cpu_gemm_mode;
void kern_cpu_gemm_set_mode(kern_cpu_gemm_mode mode);

/* ---------------------------------------------------------------------------------------------
 * Memory. All take the backend the tensors live on; FU_EINVAL when a tensor is on another device,
 * not contiguous, or the sizes differ. */

/* Copies nbytes(t) bytes from host memory into t. */
FU_MUST_CHECK fu_err kern_tensor_copy_in(const kern_backend_t *be, kern_tensor_t *t, const void *host,
                                         size_t host_bytes);
/* Copies t (contiguous) into host memory of host_bytes (must equal nbytes(t)). */
FU_MUST_CHECK fu_err kern_tensor_copy_out(const kern_backend_t *be, const kern_tensor_t *t, void *host,
                                          size_t host_bytes);
/* dst = src (same dtype and shape, both contiguous, same device). */
FU_MUST_CHECK fu_err kern_tensor_copy(const kern_backend_t *be, const kern_tensor_t *src,
                                      kern_tensor_t *dst);
/* Sets every byte of contiguous t to 0. */
FU_MUST_CHECK fu_err kern_tensor_zero(const kern_backend_t *be, kern_tensor_t *t);
/* dst = src converted between f32/f16/bf16 (same shape, both contiguous). */
FU_MUST_CHECK fu_err kern_tensor_convert(const kern_backend_t *be, const kern_tensor_t *src,
                                         kern_tensor_t *dst);
/* Waits for queued work (no-op on the CPU). */
FU_MUST_CHECK fu_err kern_backend_sync(const kern_backend_t *be);

/* ---------------------------------------------------------------------------------------------
 * Ops. Shapes in comments; n = tokens. FU_EINVAL for any shape/dtype/device mismatch. */

/* C = alpha·op(A)·op(B) + beta·C, op(X) = Xᵀ when trans_x. All 2-D, one float dtype, contiguous rows
 * (row strides allowed, so column slices work). Dimensions must fit in int. */
FU_MUST_CHECK fu_err kern_gemm(const kern_backend_t *be, bool trans_a, bool trans_b, float alpha,
                               const kern_tensor_t *a, const kern_tensor_t *b, float beta,
                               kern_tensor_t *c);

/* Y[n,out] = X[n,in]·W[out,in]ᵀ (row strides allowed). */
FU_MUST_CHECK fu_err kern_linear_forward(const kern_backend_t *be, const kern_tensor_t *x,
                                         const kern_tensor_t *w, kern_tensor_t *y);
/* dX[n,in] = dY·W (overwritten; skipped if dx is NULL); dW[out,in] += dYᵀ·X (skipped if dw is NULL,
 * and then x may be NULL). */
FU_MUST_CHECK fu_err kern_linear_backward(const kern_backend_t *be, const kern_tensor_t *dy,
                                          const kern_tensor_t *x, const kern_tensor_t *w,
                                          kern_tensor_t *dx, kern_tensor_t *dw);

/* y = a + b (same shape, contiguous); y may be a or b (in place). Its backward is the identity. */
FU_MUST_CHECK fu_err kern_add_forward(const kern_backend_t *be, const kern_tensor_t *a,
                                      const kern_tensor_t *b, kern_tensor_t *y);
/* y += alpha·x (same shape, contiguous): gradient accumulation. */
FU_MUST_CHECK fu_err kern_axpy(const kern_backend_t *be, float alpha, const kern_tensor_t *x,
                               kern_tensor_t *y);

/* out[n,d] = table[ids[i], :]; ids i32 [n], table [vocab,d]. FU_EINVAL if an id is outside
 * [0, vocab) (out is then unspecified). */
FU_MUST_CHECK fu_err kern_embedding_forward(const kern_backend_t *be, const kern_tensor_t *ids,
                                            const kern_tensor_t *table, kern_tensor_t *out);
/* dtable[ids[i], :] += dout[i, :] (scatter-add; repeated ids sum). FU_EINVAL on a bad id. */
FU_MUST_CHECK fu_err kern_embedding_backward(const kern_backend_t *be, const kern_tensor_t *ids,
                                             const kern_tensor_t *dout, kern_tensor_t *dtable);

/* Hugging Face LlamaRMSNorm: y = x / sqrt(mean(x²) + eps) * w; x,y [n,d], w [d], eps > 0. */
FU_MUST_CHECK fu_err kern_rmsnorm_forward(const kern_backend_t *be, const kern_tensor_t *x,
                                          const kern_tensor_t *w, float eps, kern_tensor_t *y);
/* dx [n,d] overwritten; dw [d] accumulated (NULL to skip). Recomputes the norm from x. */
FU_MUST_CHECK fu_err kern_rmsnorm_backward(const kern_backend_t *be, const kern_tensor_t *dy,
                                           const kern_tensor_t *x, const kern_tensor_t *w, float eps,
                                           kern_tensor_t *dx, kern_tensor_t *dw);

/* Rotary embedding, Hugging Face LLaMA rotate-half: for each head of head_dim features and
 * i < head_dim/2, with a = pos·inv_freq[i] (kern_rope_inv_freq: theta^(−2i/head_dim), rescaled for
 * Llama 3):
 *   y[i] = x[i]·cos a − x[i+h/2]·sin a,  y[i+h/2] = x[i+h/2]·cos a + x[i]·sin a.
 * x,y [n, heads*head_dim]; pos i32 [n] (absolute positions, so a KV-cache offset works); head_dim
 * even; theta > 0. y may be x (in place). */
FU_MUST_CHECK fu_err kern_rope_forward(const kern_backend_t *be, const kern_tensor_t *x,
                                       const kern_tensor_t *pos, int head_dim, const kern_rope_params *rp,
                                       kern_tensor_t *y);
/* dx = rotation by −a of dy (the transpose); same shapes; dx may be dy. */
FU_MUST_CHECK fu_err kern_rope_backward(const kern_backend_t *be, const kern_tensor_t *dy,
                                        const kern_tensor_t *pos, int head_dim, const kern_rope_params *rp,
                                        kern_tensor_t *dx);

/* SwiGLU: out = silu(gate) ⊙ up; all [n,f]. */
FU_MUST_CHECK fu_err kern_silu_mul_forward(const kern_backend_t *be, const kern_tensor_t *gate,
                                           const kern_tensor_t *up, kern_tensor_t *out);
/* dgate = dout ⊙ up ⊙ silu'(gate), dup = dout ⊙ silu(gate) (both overwritten). */
FU_MUST_CHECK fu_err kern_silu_mul_backward(const kern_backend_t *be, const kern_tensor_t *dout,
                                            const kern_tensor_t *gate, const kern_tensor_t *up,
                                            kern_tensor_t *dgate, kern_tensor_t *dup);

/* Scratch bytes attn forward (backward=false) or backward needs for tq queries and tk keys per
 * sequence; pass a workspace with at least that much free, or NULL to let the op allocate. */
FU_MUST_CHECK fu_err kern_attn_workspace_bytes(const kern_backend_t *be, const kern_attn_params *p,
                                               int64_t tq, int64_t tk, bool backward, size_t *bytes);
/* Causal GQA attention (see kern_attn_params): o [n_seq*tq, n_head*head_dim]. Requires
 * 0 <= q_offset and q_offset + tq <= tk. All tensors contiguous. */
FU_MUST_CHECK fu_err kern_attn_forward(const kern_backend_t *be, const kern_attn_params *p,
                                       const kern_tensor_t *q, const kern_tensor_t *k,
                                       const kern_tensor_t *v, kern_tensor_t *o,
                                       kern_workspace_t *ws);
/* Gradients of kern_attn_forward w.r.t. q, k, v (all overwritten; shapes as q, k, v). Recomputes
 * the attention probabilities, so nothing but q, k, v needs to be saved. */
FU_MUST_CHECK fu_err kern_attn_backward(const kern_backend_t *be, const kern_attn_params *p,
                                        const kern_tensor_t *q, const kern_tensor_t *k,
                                        const kern_tensor_t *v, const kern_tensor_t *dout,
                                        kern_tensor_t *dq, kern_tensor_t *dk, kern_tensor_t *dv,
                                        kern_workspace_t *ws);

/* Softmax cross-entropy: logits [n,V], targets i32 [n]; rows whose target == ignore_index are
 * skipped. *loss = mean over the *n_valid other rows of logsumexp(row) − row[target] (0 when no row
 * counts). FU_EINVAL when a target is outside [0,V) and not ignore_index. */
FU_MUST_CHECK fu_err kern_xent_forward(const kern_backend_t *be, const kern_tensor_t *logits,
                                       const kern_tensor_t *targets, int32_t ignore_index,
                                       float *loss, int64_t *n_valid);
/* dlogits = grad_scale·(softmax(logits) − onehot(target)) / n_valid, ignored rows 0 (overwritten).
 * dlogits may be logits (in place, saving a [n,V] buffer). grad_scale is dLoss (1 for a plain loss,
 * 1/M to average M micro-batches). */
FU_MUST_CHECK fu_err kern_xent_backward(const kern_backend_t *be, const kern_tensor_t *logits,
                                        const kern_tensor_t *targets, int32_t ignore_index,
                                        float grad_scale, kern_tensor_t *dlogits);

/* kern_xent_forward and kern_xent_backward in one pass over the logits (each row's logsumexp is
 * computed once): *loss, *n_valid and dlogits as those two give. dlogits may be logits (in place:
 * the logits are then gone, which is what training wants after the loss). */
FU_MUST_CHECK fu_err kern_xent_forward_backward(const kern_backend_t *be, const kern_tensor_t *logits,
                                                const kern_tensor_t *targets, int32_t ignore_index,
                                                float grad_scale, float *loss, int64_t *n_valid,
                                                kern_tensor_t *dlogits);

/* One AdamW step (see kern_adamw_params) over param, grad, m, v (same shape and dtype, contiguous);
 * step is the 1-based step count used for bias correction. */
FU_MUST_CHECK fu_err kern_adamw_step(const kern_backend_t *be, kern_tensor_t *param,
                                     const kern_tensor_t *grad, kern_tensor_t *m, kern_tensor_t *v,
                                     const kern_adamw_params *p, int64_t step);

/* Y[n,rows] = X[n,cols]·Wᵀ + beta·Y for a frozen sparse weight (SALR's pruned base weight); beta is
 * 0 or 1. X and Y contiguous. With kern_lora_forward(w = NULL) afterwards this is a SALR layer.
 * FU_ENOSYS when be has no sparse kernels; FU_EINVAL when w's handle does not match rows/cols. */
FU_MUST_CHECK fu_err kern_sparse_linear_forward(const kern_backend_t *be, const kern_tensor_t *x,
                                                const kern_sparse_weight *w, float beta, kern_tensor_t *y);
/* dX[n,cols] = dY[n,rows]·W (overwritten): the input gradient through a frozen sparse weight. */
FU_MUST_CHECK fu_err kern_sparse_linear_backward(const kern_backend_t *be, const kern_tensor_t *dy,
                                                 const kern_sparse_weight *w, kern_tensor_t *dx);

/* Draws one token per row of logits [n,V] (or [V]) into out_tokens[n] (host memory). */
FU_MUST_CHECK fu_err kern_sample(const kern_backend_t *be, const kern_tensor_t *logits,
                                 const kern_sample_params *p, uint64_t counter, int32_t *out_tokens);

#ifdef __cplusplus
}
#endif
#endif
