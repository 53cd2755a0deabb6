/* fu_safetensors: read and write Hugging Face safetensors files (docs/FORMATS.md).
 *
 * Reading maps the files read-only: a single `model.safetensors`, or the shards named by a
 * `model.safetensors.index.json` (its "weight_map"). Tensors are looked up by their Hugging Face
 * names and handed out as borrowed views into the map. Every header is parsed as hostile input:
 * bounded header length, well-formed JSON, known dtypes, shapes whose element count and byte size
 * are computed with overflow checks, data_offsets inside the data section, contiguous and without
 * overlaps (the same rule as the reference implementation). Errors come back as FU_EPROTO (bad
 * content), FU_ENOTFOUND (missing file or tensor), FU_EINVAL (shape or dtype not what the caller
 * expected) with a message naming the file and the tensor.
 *
 * Writing produces a file the Python `safetensors` package loads: `__metadata__` with
 * {"format":"pt"}, the header padded with spaces to a multiple of 8 bytes, tensors packed without
 * gaps in order of decreasing element size (so each is aligned to its element size), written
 * atomically (temp file + fsync + rename).
 *
 * A handle is read-only after open and may be shared by threads. Data is little-endian. A file
 * truncated by someone else while mapped raises SIGBUS on access: model files are treated as
 * immutable while open. */
#ifndef FU_SAFETENSORS_H
#define FU_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest JSON header accepted (the reference implementation's limit is 100 MB as well). */
#define FU_ST_HEADER_MAX ((uint64_t)100 << 20)
/* Most JSON values (separators, counted before parsing) in one header: about 400k tensors. */
#define FU_ST_MAX_JSON_VALUES (4 << 20)
/* Most dimensions of one tensor. */
#define FU_ST_MAX_DIMS 8
/* Most shards a model.safetensors.index.json may name. */
#define FU_ST_MAX_SHARDS 4096
/* Largest model.safetensors.index.json read. */
#define FU_ST_INDEX_MAX ((size_t)64 << 20)
/* File names of a Hugging Face model directory. */
#define FU_ST_SINGLE_FILE "model.safetensors"
#define FU_ST_INDEX_FILE  "model.safetensors.index.json"

/* Element types, named as in the file ("F32", "BF16", ...). */
typedef enum {
    FU_ST_F32 = 0,
    FU_ST_F16,
    FU_ST_BF16,
    FU_ST_F64,
    FU_ST_I64,
    FU_ST_I32,
    FU_ST_I16,
    FU_ST_I8,
    FU_ST_U8,
    FU_ST_BOOL,
    FU_ST_DTYPE_COUNT_
} fu_st_dtype;

/* Bytes per element of dt (0 for an invalid value). */
size_t fu_st_dtype_size(fu_st_dtype dt);
/* The file's name of dt ("F32"); "?" for an invalid value. */
const char *fu_st_dtype_name(fu_st_dtype dt);
/* Parses a file's dtype name (exact, upper case). FU_EINVAL when unknown. */
FU_MUST_CHECK fu_err fu_st_dtype_parse(const char *name, fu_st_dtype *out);
/* true for F32, F16, BF16 and F64 (the types fu_st_tensor_to_f32 converts). */
bool fu_st_dtype_is_float(fu_st_dtype dt);

/* One tensor: as found in a file (all fields set by the reader, borrowed from the handle), or as
 * given to the writer (name, dtype, ndim, shape, data, nbytes; the rest ignored). */
typedef struct {
    const char *name;                   /* Hugging Face name ("model.norm.weight") */
    fu_st_dtype dtype;                  /* element type */
    size_t      ndim;                   /* number of dimensions, 0 for a scalar */
    uint64_t    shape[FU_ST_MAX_DIMS];  /* sizes, outermost first (PyTorch order) */
    size_t      nelem;                  /* product of shape (1 for a scalar) */
    const void *data;                   /* the bytes (little-endian); may be unaligned in files
                                           written by others: read floats via fu_st_tensor_to_f32 */
    size_t      nbytes;                 /* nelem * fu_st_dtype_size(dtype) */
    uint64_t    offset;                 /* reader: start within its file's data section */
    const char *file;                   /* reader: base name of the file that holds it */
} fu_st_tensor;

/* An open set of tensors (one file, the shards of a model directory, or a parsed buffer). */
typedef struct fu_safetensors fu_safetensors;

/* Parses a complete safetensors image in memory (8-byte little-endian header length, JSON header,
 * data section) without copying the data: tensors' data pointers point into buf, which must
 * outlive the handle. label names the image in error messages (a file name). This is the fuzzing
 * entry point: any buf/len must give FU_OK or FU_EPROTO/FU_EVERSION/FU_ENOMEM with a message, never
 * a crash or a leak. *out is owned by the caller (fu_safetensors_close). */
FU_MUST_CHECK fu_err fu_safetensors_parse_header(const uint8_t *buf, size_t len, const char *label,
                                                 fu_safetensors **out, fu_errmsg *em);

/* Maps and parses one safetensors file. Error messages name the file by its base name. */
FU_MUST_CHECK fu_err fu_safetensors_open_file(const char *path, fu_safetensors **out, fu_errmsg *em);

/* Opens a Hugging Face model directory's weights: the shards listed in model.safetensors.index.json
 * when it exists (each tensor must be in the shard its weight_map names; shard names must be plain
 * file names inside dir), otherwise model.safetensors. FU_ENOTFOUND when dir has neither. A tensor
 * name found in two shards is FU_EPROTO. */
FU_MUST_CHECK fu_err fu_safetensors_open_dir(const char *dir, fu_safetensors **out, fu_errmsg *em);

/* Unmaps and frees; every fu_st_tensor pointer obtained from the handle dies with it. Idempotent;
 * sets *st_p = NULL. */
void fu_safetensors_close(fu_safetensors **st_p);

/* Number of tensors, and the i-th in name order (borrowed; NULL when i is out of range). */
size_t              fu_safetensors_count(const fu_safetensors *st);
const fu_st_tensor *fu_safetensors_at(const fu_safetensors *st, size_t i);

/* The tensor called name, or NULL. */
const fu_st_tensor *fu_safetensors_get(const fu_safetensors *st, const char *name);
/* Its index in name order (fu_safetensors_at), or -1 when there is none. */
long fu_safetensors_index(const fu_safetensors *st, const char *name);

/* Like fu_safetensors_get, but FU_ENOTFOUND with a message naming the file(s) and the tensor
 * ("model.safetensors: no tensor 'lm_head.weight'") when missing. */
FU_MUST_CHECK fu_err fu_safetensors_find(const fu_safetensors *st, const char *name, const fu_st_tensor **out,
                                         fu_errmsg *em);

/* Finds name and checks its shape is exactly shape[0..ndim). FU_EINVAL on a mismatch with a message
 * such as "model.safetensors: tensor 'model.layers.3.mlp.up_proj.weight' has shape [64, 32],
 * expected [128, 32]". */
FU_MUST_CHECK fu_err fu_safetensors_expect(const fu_safetensors *st, const char *name, size_t ndim,
                                           const uint64_t *shape, const fu_st_tensor **out, fu_errmsg *em);

/* Converts t's elements to float into dst[0..dst_len): F32 is copied, F16 and BF16 are widened
 * exactly, F64 is rounded. FU_EINVAL when t is not a float type or dst_len != t->nelem (the message
 * names the file and tensor). */
FU_MUST_CHECK fu_err fu_st_tensor_to_f32(const fu_st_tensor *t, float *dst, size_t dst_len, fu_errmsg *em);

/* Int8 weights (fusion model quantize): a 2-D I8 tensor NAME holds round(w / scale) per row, and
 * NAME_scale (F32, [rows] or [rows, 1]) the rows' scales; w = (float)q · scale. */
#define FU_ST_QSCALE_SUFFIX "_scale"

/* The row scales of the 2-D I8 tensor t of st into scale[0..t->shape[0]). FU_ENOTFOUND when st has
 * no NAME_scale, FU_EINVAL when it is not F32 of that shape or holds a value that is not finite,
 * each with a message naming the tensor. */
FU_MUST_CHECK fu_err fu_safetensors_qscale(const fu_safetensors *st, const fu_st_tensor *t, float *scale,
                                           fu_errmsg *em);

/* fu_safetensors_expect then fu_st_tensor_to_f32 (an I8 weight dequantized with its row scales):
 * the usual way to load a weight. dst must hold the product of shape elements. */
FU_MUST_CHECK fu_err fu_safetensors_read_f32(const fu_safetensors *st, const char *name, size_t ndim,
                                             const uint64_t *shape, float *dst, size_t dst_len, fu_errmsg *em);

/* Value of the string key in the (first file's) "__metadata__" object, or NULL. Borrowed. */
const char *fu_safetensors_metadata(const fu_safetensors *st, const char *key);

/* Produces the bytes of tensor index i (in the caller's array) into buf[0..nbytes), for writers
 * whose data is made on the fly (tensors given with data == NULL). */
typedef fu_err (*fu_st_fill_fn)(void *ctx, size_t index, const fu_st_tensor *t, void *buf, size_t nbytes);

/* Writes tensors[0..n) to path atomically. Each tensor needs name (unique, non-empty), dtype, ndim,
 * shape and either data with nbytes == product(shape) * dtype size, or data == NULL and a fill
 * callback. meta_kv is NULL or 2*n_meta strings (key, value) added to "__metadata__" after
 * "format":"pt". FU_EINVAL for a bad tensor list, FU_EIO for file errors. */
FU_MUST_CHECK fu_err fu_safetensors_write(const char *path, const fu_st_tensor *tensors, size_t n,
                                          const char *const *meta_kv, size_t n_meta, fu_st_fill_fn fill,
                                          void *fill_ctx, fu_errmsg *em);

/* The bytes fu_safetensors_write would write, in memory: *out (caller frees) of *out_len bytes.
 * Errors as fu_safetensors_write. */
FU_MUST_CHECK fu_err fu_safetensors_serialize(const fu_st_tensor *tensors, size_t n, const char *const *meta_kv,
                                              size_t n_meta, fu_st_fill_fn fill, void *fill_ctx, uint8_t **out,
                                              size_t *out_len, fu_errmsg *em);

/* IEEE half and bfloat16 conversions (round to nearest even; NaN stays NaN). */
float    fu_f16_to_f32(uint16_t h);
uint16_t fu_f32_to_f16(float f);
float    fu_bf16_to_f32(uint16_t b);
uint16_t fu_f32_to_bf16(float f);

/* Converts n floats into dtype dt (F32, F16, BF16 or F64) at dst (little-endian bytes, size
 * n * fu_st_dtype_size(dt)). FU_EINVAL for other dtypes. */
FU_MUST_CHECK fu_err fu_st_from_f32(fu_st_dtype dt, const float *src, size_t n, void *dst);

#ifdef __cplusplus
}
#endif
#endif
