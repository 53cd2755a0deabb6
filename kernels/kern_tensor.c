#include "kern_tensor.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_backend.h"

size_t kern_dtype_size(kern_dtype dt)
{
    switch (dt) {
    case KERN_F32:
    case KERN_I32:
        return 4;
    case KERN_F16:
    case KERN_BF16:
        return 2;
    case KERN_U8:
    case KERN_I8:
        return 1;
    default:
        return 0;
    }
}

const char *kern_dtype_name(kern_dtype dt)
{
    static const char *const names[] = {"f32", "f16", "bf16", "i32", "u8", "i8"};
    if ((unsigned)dt >= (unsigned)KERN_DTYPE_COUNT_)
        return "?";
    return names[dt];
}

/* Fills shape and row-major strides; checks dims and the total byte size. */
static fu_err set_shape(kern_tensor_t *t, kern_dtype dtype, int ndim, const int64_t *shape)
{
    if (ndim < 1 || ndim > KERN_MAX_DIMS || !shape || kern_dtype_size(dtype) == 0)
        return FU_EINVAL;
    size_t total = kern_dtype_size(dtype);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return FU_EINVAL;
        if (!fu_size_mul(total, (size_t)shape[i], &total) || total > (size_t)INT64_MAX)
            return FU_EINVAL;
    }
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < KERN_MAX_DIMS; i++) {
        t->shape[i] = i < ndim ? shape[i] : 1;
        t->stride[i] = 0;
    }
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->stride[i] = s;
        s *= t->shape[i];
    }
    return FU_OK;
}

fu_err kern_tensor_wrap(kern_tensor_t *out, void *data, kern_dtype dtype, int ndim, const int64_t *shape,
                        kern_device device)
{
    if (!out)
        return FU_EINVAL;
    kern_tensor_t t;
    memset(&t, 0, sizeof t);
    FU_TRY(set_shape(&t, dtype, ndim, shape));
    if (!data && kern_tensor_numel(&t) > 0)
        return FU_EINVAL;
    if (device.kind != KERN_DEV_CPU && device.kind != KERN_DEV_CUDA)
        return FU_EINVAL;
    t.data = data;
    t.device = device;
    t.owner = NULL;
    *out = t;
    return FU_OK;
}

static fu_err tensor_new(const kern_backend_t *be, kern_dtype dtype, int ndim, const int64_t *shape,
                         bool zero, kern_tensor_t **out)
{
    if (!be || !out)
        return FU_EINVAL;
    *out = NULL;
    kern_tensor_t t;
    memset(&t, 0, sizeof t);
    FU_TRY(set_shape(&t, dtype, ndim, shape));
    size_t bytes = kern_tensor_nbytes(&t);
    void *data = NULL;
    FU_TRY(be->alloc(be, bytes, &data));
    if (zero) {
        fu_err rc = be->fill_zero(be, data, bytes);
        if (rc != FU_OK) {
            be->free(be, data);
            return rc;
        }
    }
    t.data = data;
    t.device = be->device;
    t.owner = be;
    kern_tensor_t *h = fu_malloc(sizeof *h);
    *h = t;
    *out = h;
    return FU_OK;
}

fu_err kern_tensor_new(const kern_backend_t *be, kern_dtype dtype, int ndim, const int64_t *shape,
                       kern_tensor_t **out)
{
    return tensor_new(be, dtype, ndim, shape, false, out);
}

fu_err kern_tensor_new_zeros(const kern_backend_t *be, kern_dtype dtype, int ndim, const int64_t *shape,
                             kern_tensor_t **out)
{
    return tensor_new(be, dtype, ndim, shape, true, out);
}

void kern_tensor_destroy(kern_tensor_t **t_p)
{
    if (!t_p || !*t_p)
        return;
    kern_tensor_t *t = *t_p;
    if (t->owner && t->data)
        t->owner->free(t->owner, t->data);
    free(t);
    *t_p = NULL;
}

int64_t kern_tensor_numel(const kern_tensor_t *t)
{
    if (!t || t->ndim < 1 || t->ndim > KERN_MAX_DIMS)
        return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

size_t kern_tensor_nbytes(const kern_tensor_t *t)
{
    return (size_t)kern_tensor_numel(t) * kern_dtype_size(t ? t->dtype : KERN_DTYPE_COUNT_);
}

bool kern_tensor_is_contiguous(const kern_tensor_t *t)
{
    if (!t || t->ndim < 1 || t->ndim > KERN_MAX_DIMS)
        return false;
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s)
            return false;
        s *= t->shape[i];
    }
    return true;
}

bool kern_tensor_is_rowmajor_2d(const kern_tensor_t *t)
{
    if (!t || t->ndim != 2)
        return false;
    if (t->shape[1] > 1 && t->stride[1] != 1)
        return false;
    return t->shape[0] <= 1 || t->stride[0] >= t->shape[1];
}

bool kern_tensor_same_shape(const kern_tensor_t *a, const kern_tensor_t *b)
{
    if (!a || !b || a->ndim != b->ndim)
        return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return false;
    return true;
}

fu_err kern_tensor_slice(const kern_tensor_t *src, int dim, int64_t start, int64_t len, kern_tensor_t *out)
{
    if (!src || !out || dim < 0 || dim >= src->ndim || src->ndim > KERN_MAX_DIMS)
        return FU_EINVAL;
    if (start < 0 || len < 0 || start > src->shape[dim] || len > src->shape[dim] - start)
        return FU_EINVAL;
    kern_tensor_t t = *src;
    size_t es = kern_dtype_size(src->dtype);
    if (es == 0)
        return FU_EINVAL;
    if (t.data)
        t.data = (char *)t.data + (size_t)(start * src->stride[dim]) * es;
    if (t.qscale && dim == 0) /* row scales follow their rows */
        t.qscale += start;
    t.shape[dim] = len;
    t.owner = NULL;
    *out = t;
    return FU_OK;
}

fu_err kern_tensor_reshape(const kern_tensor_t *src, int ndim, const int64_t *shape, kern_tensor_t *out)
{
    if (!src || !out || !shape || ndim < 1 || ndim > KERN_MAX_DIMS)
        return FU_EINVAL;
    if (!kern_tensor_is_contiguous(src))
        return FU_EINVAL;
    int64_t want[KERN_MAX_DIMS];
    int infer = -1;
    int64_t known = 1;
    for (int i = 0; i < ndim; i++) {
        want[i] = shape[i];
        if (shape[i] == -1) {
            if (infer >= 0)
                return FU_EINVAL;
            infer = i;
        } else if (shape[i] < 0) {
            return FU_EINVAL;
        } else {
            if (shape[i] != 0 && known > INT64_MAX / shape[i])
                return FU_EINVAL;
            known *= shape[i];
        }
    }
    int64_t n = kern_tensor_numel(src);
    if (infer >= 0) {
        if (known == 0 || n % known != 0)
            return FU_EINVAL;
        want[infer] = n / known;
    } else if (known != n) {
        return FU_EINVAL;
    }
    if (src->qscale && want[0] != src->shape[0])
        return FU_EINVAL; /* row scales belong to the rows */
    kern_tensor_t t = *src;
    FU_TRY(set_shape(&t, src->dtype, ndim, want));
    t.owner = NULL;
    *out = t;
    return FU_OK;
}

void *kern_tensor_at(const kern_tensor_t *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3)
{
    if (!t || !t->data || t->device.kind != KERN_DEV_CPU)
        return NULL;
    int64_t idx[KERN_MAX_DIMS] = {i0, i1, i2, i3};
    int64_t off = 0;
    for (int i = 0; i < KERN_MAX_DIMS; i++) {
        int64_t ext = i < t->ndim ? t->shape[i] : 1;
        if (idx[i] < 0 || idx[i] >= ext)
            return NULL;
        off += idx[i] * (i < t->ndim ? t->stride[i] : 0);
    }
    return (char *)t->data + (size_t)off * kern_dtype_size(t->dtype);
}

/* ---- half precision ---- */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t kern_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t mant = x & 0x7fffffu;
    if (exp == 0xff) /* inf or nan (keep a quiet nan) */
        return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31)
        return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (e <= 0) {
        if (e < -10)
            return (uint16_t)sign; /* underflow -> signed zero */
        mant |= 0x800000u;         /* implicit bit */
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = sign | ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u)))
        half++; /* may carry into the exponent, up to inf: correct */
    return (uint16_t)half;
}

float kern_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        if (mant == 0)
            return bits_f32(sign);
        /* subnormal: value = mant * 2^-24 */
        float v = (float)mant * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 31)
        return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 127u - 15u) << 23) | (mant << 13));
}

uint16_t kern_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffffu))
        return (uint16_t)((x >> 16) | 0x40u); /* quiet nan */
    uint32_t lsb = (x >> 16) & 1u;
    x += 0x7fffu + lsb;
    return (uint16_t)(x >> 16);
}

float kern_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

static bool float_dtype(kern_dtype dt)
{
    return dt == KERN_F32 || dt == KERN_F16 || dt == KERN_BF16;
}

fu_err kern_convert_host(void *dst, kern_dtype dst_dt, const void *src, kern_dtype src_dt, size_t n)
{
    if (!float_dtype(dst_dt) || !float_dtype(src_dt))
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    if (!dst || !src)
        return FU_EINVAL;
    if (dst_dt == src_dt) {
        memcpy(dst, src, n * kern_dtype_size(dst_dt));
        return FU_OK;
    }
    if (src_dt == KERN_BF16 && dst_dt == KERN_F32) { /* the common load path: a shift, vectorised */
        const uint16_t *s = src;
        uint32_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = (uint32_t)s[i] << 16;
        return FU_OK;
    }
    if (src_dt == KERN_F32 && dst_dt == KERN_BF16) {
        const uint32_t *s = src;
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++) {
            uint32_t x = s[i];
            uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
            bool nan = (x & 0x7fffffffu) > 0x7f800000u;
            d[i] = (uint16_t)(nan ? (x >> 16) | 0x40u : rounded);
        }
        return FU_OK;
    }
    for (size_t i = 0; i < n; i++) {
        float v;
        switch (src_dt) {
        case KERN_F32:
            v = ((const float *)src)[i];
            break;
        case KERN_F16:
            v = kern_f16_to_f32(((const uint16_t *)src)[i]);
            break;
        default:
            v = kern_bf16_to_f32(((const uint16_t *)src)[i]);
            break;
        }
        switch (dst_dt) {
        case KERN_F32:
            ((float *)dst)[i] = v;
            break;
        case KERN_F16:
            ((uint16_t *)dst)[i] = kern_f32_to_f16(v);
            break;
        default:
            ((uint16_t *)dst)[i] = kern_f32_to_bf16(v);
            break;
        }
    }
    return FU_OK;
}

/* ---- workspaces ---- */

struct kern_workspace {
    const kern_backend_t *be; /* allocator of base */
    char                 *base; /* device memory */
    size_t                cap; /* bytes at base */
    size_t                used; /* bump offset */
};

kern_workspace_t *kern_workspace_new(const kern_backend_t *be, size_t bytes)
{
    if (!be)
        return NULL;
    void *p = NULL;
    if (be->alloc(be, bytes, &p) != FU_OK)
        return NULL;
    kern_workspace_t *ws = fu_calloc(1, sizeof *ws);
    ws->be = be;
    ws->base = p;
    ws->cap = bytes;
    return ws;
}

void kern_workspace_destroy(kern_workspace_t **ws_p)
{
    if (!ws_p || !*ws_p)
        return;
    kern_workspace_t *ws = *ws_p;
    ws->be->free(ws->be, ws->base);
    free(ws);
    *ws_p = NULL;
}

size_t kern_workspace_capacity(const kern_workspace_t *ws)
{
    return ws ? ws->cap : 0;
}

size_t kern_workspace_used(const kern_workspace_t *ws)
{
    return ws ? ws->used : 0;
}

const kern_backend_t *kern_workspace_backend(const kern_workspace_t *ws)
{
    return ws ? ws->be : NULL;
}

fu_err kern_workspace_take(kern_workspace_t *ws, size_t bytes, void **out)
{
    if (!ws || !out)
        return FU_EINVAL;
    size_t rounded;
    if (!fu_size_add(bytes, KERN_ALIGN - 1, &rounded))
        return FU_ENOMEM;
    rounded &= ~(size_t)(KERN_ALIGN - 1);
    if (rounded > ws->cap - ws->used)
        return FU_ENOMEM;
    *out = ws->base + ws->used;
    ws->used += rounded;
    return FU_OK;
}

fu_err kern_workspace_tensor(kern_workspace_t *ws, kern_dtype dtype, int ndim, const int64_t *shape,
                             kern_tensor_t *out)
{
    if (!ws || !out)
        return FU_EINVAL;
    kern_tensor_t t;
    memset(&t, 0, sizeof t);
    FU_TRY(set_shape(&t, dtype, ndim, shape));
    void *p = NULL;
    FU_TRY(kern_workspace_take(ws, kern_tensor_nbytes(&t), &p));
    t.data = p;
    t.device = ws->be->device;
    t.owner = NULL;
    *out = t;
    return FU_OK;
}

size_t kern_workspace_mark(const kern_workspace_t *ws)
{
    return ws ? ws->used : 0;
}

void kern_workspace_rewind(kern_workspace_t *ws, size_t mark)
{
    if (ws && mark <= ws->used)
        ws->used = mark;
}
