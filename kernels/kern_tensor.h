/* kern_tensor: typed, strided views of memory that lives on one device, plus scratch workspaces.
 *
 * The tensor struct is public on purpose (as in ggml): tensors are small value descriptors that the
 * DAG executor creates by the thousand, slices and reshapes without allocating, and passes by
 * pointer to backends written in C and CUDA. An opaque handle would force a heap allocation per view
 * and an accessor call per field in every kernel. Who owns `data` is explicit: a tensor made by
 * kern_tensor_new owns it (and must be released with kern_tensor_destroy); every other tensor
 * (kern_tensor_wrap, views, workspace tensors) borrows it.
 *
 * Host code never dereferences `data` unless `device.kind == KERN_DEV_CPU`: for CUDA tensors it is
 * a device pointer. Copies between host and device go through the backend (kern_backend.h). */
#ifndef FU_KERN_TENSOR_H
#define FU_KERN_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KERN_MAX_DIMS  4  /* tensors have 1..4 dimensions */
#define KERN_ALIGN     64 /* byte alignment of backend allocations and workspace slices */

typedef enum {
    KERN_F32 = 0, /* IEEE binary32 */
    KERN_F16,     /* IEEE binary16 */
    KERN_BF16,    /* bfloat16 (upper half of a binary32) */
    KERN_I32,     /* int32: token ids, positions, targets */
    KERN_U8,      /* bytes: bitmaps, packed data */
    KERN_I8,      /* int8: a frozen weight quantized per row (kern_tensor_t.qscale) */
    KERN_DTYPE_COUNT_
} kern_dtype;

typedef enum {
    KERN_DEV_CPU = 0, /* host memory */
    KERN_DEV_CUDA,    /* CUDA device memory (index = ordinal) */
} kern_device_kind;

typedef struct {
    kern_device_kind kind; /* where the memory is */
    int              index; /* device ordinal (0 for the CPU) */
} kern_device;

struct kern_backend; /* kern_backend.h */

typedef struct kern_tensor {
    void       *data;                  /* first element (device pointer unless device is CPU) */
    kern_dtype  dtype;                 /* element type */
    int         ndim;                  /* 1..KERN_MAX_DIMS */
    int64_t     shape[KERN_MAX_DIMS];  /* extent per dimension; unused dims are 1 */
    int64_t     stride[KERN_MAX_DIMS]; /* step per dimension, in elements; unused dims are 0 */
    kern_device device;                /* where data lives */
    const struct kern_backend *owner;  /* backend that allocated data, NULL when data is borrowed */
    const float *qscale;               /* KERN_I8 only: shape[0] f32 scales, row r = data[r]·qscale[r]
                                          (borrowed, on data's device); NULL otherwise */
} kern_tensor_t;

/* Size in bytes of one element of dt; 0 for an invalid dtype. */
size_t      kern_dtype_size(kern_dtype dt);
/* "f32", "f16", "bf16", "i32", "u8", "i8"; "?" for an invalid dtype. Static storage. */
const char *kern_dtype_name(kern_dtype dt);

/* Describes existing memory (borrowed, not freed by the tensor) as a contiguous row-major tensor.
 * FU_EINVAL when ndim is not 1..4, a dim is < 0, dtype is invalid, the byte size overflows, or
 * data is NULL while the tensor has elements. */
FU_MUST_CHECK fu_err kern_tensor_wrap(kern_tensor_t *out, void *data, kern_dtype dtype, int ndim,
                                      const int64_t *shape, kern_device device);

/* Allocates a contiguous tensor with be's allocator (contents undefined). *out is owned by the
 * caller: release with kern_tensor_destroy. FU_EINVAL on bad arguments, FU_ENOMEM when the backend
 * cannot allocate. */
FU_MUST_CHECK fu_err kern_tensor_new(const struct kern_backend *be, kern_dtype dtype, int ndim,
                                     const int64_t *shape, kern_tensor_t **out);
/* As kern_tensor_new, zero-filled. */
FU_MUST_CHECK fu_err kern_tensor_new_zeros(const struct kern_backend *be, kern_dtype dtype, int ndim,
                                           const int64_t *shape, kern_tensor_t **out);
/* Frees the tensor (and its data if it owns it); sets *t_p to NULL. Idempotent, NULL-safe. */
void kern_tensor_destroy(kern_tensor_t **t_p);

int64_t kern_tensor_numel(const kern_tensor_t *t); /* product of the shape */
size_t  kern_tensor_nbytes(const kern_tensor_t *t); /* numel * element size (contiguous bytes) */
/* True when the strides are the row-major strides of the shape (dims of extent 1 are ignored). */
bool kern_tensor_is_contiguous(const kern_tensor_t *t);
/* True for a 2-D tensor whose rows are contiguous (stride[1] == 1, stride[0] >= shape[1]): the
 * layout BLAS accepts with a leading dimension. */
bool kern_tensor_is_rowmajor_2d(const kern_tensor_t *t);
/* True when a and b have the same ndim and shape. */
bool kern_tensor_same_shape(const kern_tensor_t *a, const kern_tensor_t *b);

/* View of src restricted to [start, start+len) along dim (no copy; borrows src's data).
 * FU_EINVAL when dim or the range is out of bounds. */
FU_MUST_CHECK fu_err kern_tensor_slice(const kern_tensor_t *src, int dim, int64_t start, int64_t len,
                                       kern_tensor_t *out);
/* View of a contiguous src with a new shape of the same element count (no copy). One entry of shape
 * may be -1 (inferred). FU_EINVAL when src is not contiguous or the counts differ. */
FU_MUST_CHECK fu_err kern_tensor_reshape(const kern_tensor_t *src, int ndim, const int64_t *shape,
                                         kern_tensor_t *out);
/* Pointer to element (i0, i1, i2, i3) of a CPU tensor (unused trailing indices 0); NULL when the
 * tensor is not on the CPU or an index is out of bounds. For tests and host-side glue. */
void *kern_tensor_at(const kern_tensor_t *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3);

/* ---- f16 / bf16 <-> f32 (round to nearest even; NaN and infinities preserved) ---- */
uint16_t kern_f32_to_f16(float f);
float    kern_f16_to_f32(uint16_t h);
uint16_t kern_f32_to_bf16(float f);
float    kern_bf16_to_f32(uint16_t h);
/* Converts n elements between host buffers of dtypes f32, f16, bf16 (any pair; same dtype copies).
 * FU_EINVAL for other dtypes or NULL buffers with n > 0. Buffers must not overlap. */
FU_MUST_CHECK fu_err kern_convert_host(void *dst, kern_dtype dst_dt, const void *src, kern_dtype src_dt,
                                       size_t n);

/* ---- workspaces: explicit scratch arenas for ops that need temporary memory ----
 * A workspace is one backend allocation handed out by a bump pointer. Ops that need scratch take a
 * kern_workspace_t * (NULL lets the op allocate and free its own scratch, which is simpler but
 * allocates on every call). An op resets the bump pointer to where it found it before returning,
 * so one workspace serves a whole sequence of ops. Not thread-safe: one workspace per thread. */
typedef struct kern_workspace kern_workspace_t;

/* New workspace of `bytes` bytes on be. NULL when the backend cannot allocate it. */
kern_workspace_t *kern_workspace_new(const struct kern_backend *be, size_t bytes);
void              kern_workspace_destroy(kern_workspace_t **ws_p); /* idempotent; NULLs *ws_p */
size_t            kern_workspace_capacity(const kern_workspace_t *ws);
size_t            kern_workspace_used(const kern_workspace_t *ws);
const struct kern_backend *kern_workspace_backend(const kern_workspace_t *ws);
/* Takes `bytes` (rounded up to KERN_ALIGN) from ws. FU_ENOMEM when it does not fit. */
FU_MUST_CHECK fu_err kern_workspace_take(kern_workspace_t *ws, size_t bytes, void **out);
/* A contiguous tensor whose data is taken from ws (borrowed: valid until ws is rewound). */
FU_MUST_CHECK fu_err kern_workspace_tensor(kern_workspace_t *ws, kern_dtype dtype, int ndim,
                                           const int64_t *shape, kern_tensor_t *out);
/* Bump-pointer mark and rewind: everything taken after `mark` is released. */
size_t kern_workspace_mark(const kern_workspace_t *ws);
void   kern_workspace_rewind(kern_workspace_t *ws, size_t mark);

#ifdef __cplusplus
}
#endif
#endif
