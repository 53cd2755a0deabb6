/* kern_kvcache: per-layer key/value cache for incremental decoding. Keys and values are stored
 * post-RoPE as [max_tokens, n_kv_head*head_dim] tensors on the cache's backend; appending new
 * positions copies rows on the device, and attention over the cache is kern_attn_forward with
 * q_offset = tokens already cached (kern_kvcache_attend does that bookkeeping). One sequence per
 * cache. Not thread-safe: one owner at a time. */
#ifndef FU_KERN_KVCACHE_H
#define FU_KERN_KVCACHE_H

#include <stdint.h>

#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kern_kvcache kern_kvcache_t;

/* New empty cache for up to max_tokens positions on be, storing dtype (a float dtype be computes
 * in: KERN_F32 on the CPU). FU_EINVAL on non-positive sizes or another dtype, FU_ENOMEM when the
 * backend cannot allocate. *out is owned by the caller. */
FU_MUST_CHECK fu_err kern_kvcache_new(const kern_backend_t *be, kern_dtype dtype, int n_kv_head, int head_dim,
                                      int64_t max_tokens, kern_kvcache_t **out);
void kern_kvcache_destroy(kern_kvcache_t **c_p); /* idempotent; NULLs *c_p */

int64_t kern_kvcache_len(const kern_kvcache_t *c);      /* positions cached */
int64_t kern_kvcache_capacity(const kern_kvcache_t *c); /* max_tokens */

/* Appends k_new, v_new ([t, n_kv_head*head_dim], contiguous, on the cache's device) as positions
 * len..len+t-1. FU_EINVAL on a shape mismatch, FU_ENOMEM when the cache would overflow (nothing is
 * appended then). */
FU_MUST_CHECK fu_err kern_kvcache_append(kern_kvcache_t *c, const kern_tensor_t *k_new,
                                         const kern_tensor_t *v_new);
/* Forgets positions >= len (rollback, or replay from a point). FU_EINVAL when len > current len. */
FU_MUST_CHECK fu_err kern_kvcache_truncate(kern_kvcache_t *c, int64_t len);
/* Views of the cached keys and values, [len, n_kv_head*head_dim] (borrowed; valid until the next
 * append, truncate or destroy). */
FU_MUST_CHECK fu_err kern_kvcache_view(const kern_kvcache_t *c, kern_tensor_t *k, kern_tensor_t *v);

/* Appends k_new/v_new, then computes attention of q ([t, n_head*head_dim], t = rows of k_new) over
 * the whole cache into o (same shape as q). p->n_kv_head and p->head_dim must match the cache;
 * p->n_seq must be 1; p->q_offset is ignored (set from the cache). If attention fails the append is
 * rolled back. */
FU_MUST_CHECK fu_err kern_kvcache_attend(kern_kvcache_t *c, const kern_attn_params *p, const kern_tensor_t *q,
                                         const kern_tensor_t *k_new, const kern_tensor_t *v_new,
                                         kern_tensor_t *o, kern_workspace_t *ws);

#ifdef __cplusplus
}
#endif
#endif
