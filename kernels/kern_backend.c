/* Backend lookup and the memory wrappers. Op wrappers live in kern_ops.c. */
#include "kern_backend.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "kern_bitmap.h"
#include "kern_internal.h"

#ifdef FUSION_KERN_HAVE_CUDA
#include "kern_cuda.h"
/* Provided by the CUDA backend's sources (the kernels/ .cu files) when the build has them: the backend for
 * device `ordinal` (static storage), FU_ENOTFOUND when there is no such device, FU_ECUDA when the
 * driver fails. */
fu_err kern_backend_cuda(int ordinal, const kern_backend_t **out);
#endif

fu_err kern_backend_get(const char *name, const kern_backend_t **out)
{
    if (!name || !out)
        return FU_EINVAL;
    *out = NULL;
    if (strcmp(name, "cpu") == 0) {
        *out = kern_backend_cpu();
        return FU_OK;
    }
    if (strncmp(name, "cuda", 4) != 0)
        return FU_EINVAL;
    long ordinal = 0;
    if (name[4] == ':') {
        const char *digits = name + 5;
        if (*digits < '0' || *digits > '9')
            return FU_EINVAL;
        char *end = NULL;
        errno = 0;
        ordinal = strtol(digits, &end, 10);
        if (errno || *end != '\0' || ordinal < 0 || ordinal > 1024)
            return FU_EINVAL;
    } else if (name[4] != '\0') {
        return FU_EINVAL;
    }
#ifdef FUSION_KERN_HAVE_CUDA
    return kern_backend_cuda((int)ordinal, out);
#else
    return FU_ENOSYS;
#endif
}

/* A copy between t and host memory: t contiguous on be, host_bytes == nbytes(t), host non-NULL
 * unless that is 0. */
static fu_err chk_host_copy(const kern_backend_t *be, const kern_tensor_t *t, const void *host, size_t host_bytes)
{
    FU_TRY(kern_chk_contig(be, t));
    size_t n = kern_tensor_nbytes(t);
    if (host_bytes != n || (n && !host))
        return FU_EINVAL;
    return FU_OK;
}

fu_err kern_tensor_copy_in(const kern_backend_t *be, kern_tensor_t *t, const void *host, size_t host_bytes)
{
    FU_TRY(chk_host_copy(be, t, host, host_bytes));
    if (host_bytes == 0)
        return FU_OK;
    return be->copy_in(be, t->data, host, host_bytes);
}

fu_err kern_tensor_copy_out(const kern_backend_t *be, const kern_tensor_t *t, void *host, size_t host_bytes)
{
    FU_TRY(chk_host_copy(be, t, host, host_bytes));
    if (host_bytes == 0)
        return FU_OK;
    return be->copy_out(be, host, t->data, host_bytes);
}

fu_err kern_tensor_copy(const kern_backend_t *be, const kern_tensor_t *src, kern_tensor_t *dst)
{
    FU_TRY(kern_chk_contig(be, src));
    FU_TRY(kern_chk_contig(be, dst));
    if (src->dtype != dst->dtype || kern_tensor_numel(src) != kern_tensor_numel(dst))
        return FU_EINVAL;
    size_t n = kern_tensor_nbytes(src);
    if (n == 0 || src->data == dst->data)
        return FU_OK;
    return be->copy(be, dst->data, src->data, n);
}

fu_err kern_tensor_zero(const kern_backend_t *be, kern_tensor_t *t)
{
    FU_TRY(kern_chk_contig(be, t));
    size_t n = kern_tensor_nbytes(t);
    return n ? be->fill_zero(be, t->data, n) : FU_OK;
}

fu_err kern_tensor_convert(const kern_backend_t *be, const kern_tensor_t *src, kern_tensor_t *dst)
{
    FU_TRY(kern_chk_contig(be, src));
    FU_TRY(kern_chk_contig(be, dst));
    if (!kern_tensor_same_shape(src, dst))
        return FU_EINVAL;
    bool okd = dst->dtype == KERN_F32 || dst->dtype == KERN_F16 || dst->dtype == KERN_BF16;
    bool oks = src->dtype == KERN_F32 || src->dtype == KERN_F16 || src->dtype == KERN_BF16;
    if (!okd || !oks)
        return FU_EINVAL;
    if (kern_tensor_numel(src) == 0)
        return FU_OK;
    return be->convert(be, src, dst);
}

fu_err kern_backend_sync(const kern_backend_t *be)
{
    if (!be)
        return FU_EINVAL;
    return be->synchronize(be);
}

/* ---- shared validation helpers (kern_internal.h) ---- */

fu_err kern_chk_dev(const kern_backend_t *be, const kern_tensor_t *t)
{
    if (!be || !t)
        return FU_EINVAL;
    if (t->ndim < 1 || t->ndim > KERN_MAX_DIMS || kern_dtype_size(t->dtype) == 0)
        return FU_EINVAL;
    if (t->device.kind != be->device.kind || t->device.index != be->device.index)
        return FU_EINVAL;
    size_t bytes = kern_dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++) /* a hand-made descriptor may lie: no overflowing sizes */
        if (t->shape[i] < 0 || !fu_size_mul(bytes, (size_t)t->shape[i], &bytes) || bytes > (size_t)INT64_MAX)
            return FU_EINVAL;
    if (!t->data && kern_tensor_numel(t) > 0)
        return FU_EINVAL;
    return FU_OK;
}

fu_err kern_chk_contig(const kern_backend_t *be, const kern_tensor_t *t)
{
    FU_TRY(kern_chk_dev(be, t));
    return kern_tensor_is_contiguous(t) ? FU_OK : FU_EINVAL;
}

fu_err kern_chk_float(const kern_backend_t *be, const kern_tensor_t *t, int ndim)
{
    FU_TRY(kern_chk_contig(be, t));
    if (!((kern_float_mask(be) >> t->dtype) & 1u) || (ndim > 0 && t->ndim != ndim))
        return FU_EINVAL;
    return FU_OK;
}

fu_err kern_chk_weight(const kern_backend_t *be, const kern_tensor_t *t)
{
    FU_TRY(kern_chk_dev(be, t));
    unsigned mask = kern_float_mask(be) | be->weight_dtypes;
    if (!((mask >> t->dtype) & 1u) || !kern_tensor_is_rowmajor_2d(t) || t->shape[0] > KERN_INT_LIMIT ||
        t->shape[1] > KERN_INT_LIMIT || t->stride[0] > KERN_INT_LIMIT)
        return FU_EINVAL;
    if ((t->dtype == KERN_I8) != (t->qscale != NULL))
        return FU_EINVAL; /* int8 rows need their scales; nothing else has any */
    return FU_OK;
}

fu_err kern_chk_mat(const kern_backend_t *be, const kern_tensor_t *t)
{
    FU_TRY(kern_chk_dev(be, t));
    if (!((kern_float_mask(be) >> t->dtype) & 1u) || !kern_tensor_is_rowmajor_2d(t))
        return FU_EINVAL;
    if (t->shape[0] > KERN_INT_LIMIT || t->shape[1] > KERN_INT_LIMIT || t->stride[0] > KERN_INT_LIMIT)
        return FU_EINVAL;
    return FU_OK;
}

/* ---- the device ---------------------------------------------------------------------------- */

/* "key: value" of a /proc file into out (the value's first line), or false. */
static bool proc_field(const char *path, const char *key, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char line[512];
    size_t kl = strlen(key);
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, key, kl) != 0)
            continue;
        const char *c = strchr(line + kl, ':');
        if (!c)
            continue;
        c++;
        while (*c == ' ' || *c == '\t')
            c++;
        snprintf(out, cap, "%.*s", (int)strcspn(c, "\n"), c);
        found = true;
    }
    fclose(f);
    return found;
}

/* OpenBLAS's build and the kernels it chose for this CPU; weak so that another BLAS still links. */
extern char *openblas_get_config(void) __attribute__((weak));
extern char *openblas_get_corename(void) __attribute__((weak));

/* What decides the CPU backend's bits besides the job: this code (its version), OpenBLAS's build and
 * kernels, the SALR decoders' instruction set and whether the element-wise loops take their AVX2
 * clones (KERN_HOT). The thread count does not (kern_cpu_gemm.c). */
static void cpu_numeric_class(char *out, size_t cap)
{
    static const char *const isa[] = {"auto", "scalar", "avx2", "avx512"};
    kern_simd_isa s = kern_simd_active();
    snprintf(out, cap, "cpu fusion-%s %s core=%s simd=%s hot=%s", FUSION_VERSION,
             openblas_get_config ? openblas_get_config() : "blas", openblas_get_corename ? openblas_get_corename() : "?",
             (unsigned)s < sizeof isa / sizeof isa[0] ? isa[s] : "?",
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
             __builtin_cpu_supports("avx2") ? "avx2" : "base"
#else
             "base"
#endif
    );
}

fu_err kern_backend_device_info(const kern_backend_t *be, kern_device_info *out)
{
    if (!be || !out)
        return FU_EINVAL;
    memset(out, 0, sizeof *out);
    if (be->device.kind == KERN_DEV_CUDA) {
#ifdef FUSION_KERN_HAVE_CUDA
        kern_cuda_info ci;
        FU_TRY(kern_cuda_device_info(be->device.index, &ci));
        snprintf(out->name, sizeof out->name, "%s", ci.name);
        out->free_bytes = ci.free_bytes;
        out->total_bytes = ci.total_bytes;
        return FU_OK;
#else
        return FU_ENOSYS;
#endif
    }
    cpu_numeric_class(out->numeric_class, sizeof out->numeric_class);
    char v[256];
    snprintf(out->name, sizeof out->name, "cpu");
    if (proc_field("/proc/cpuinfo", "model name", v, sizeof v))
        snprintf(out->name, sizeof out->name, "cpu: %.240s", v);
    unsigned long long kb = 0;
    if (proc_field("/proc/meminfo", "MemAvailable", v, sizeof v) && sscanf(v, "%llu", &kb) == 1)
        out->free_bytes = (uint64_t)kb * 1024u;
    if (proc_field("/proc/meminfo", "MemTotal", v, sizeof v) && sscanf(v, "%llu", &kb) == 1)
        out->total_bytes = (uint64_t)kb * 1024u;
    return FU_OK;
}

/* ---- sparse weights ------------------------------------------------------------------------ */

bool kern_backend_has_sparse(const kern_backend_t *be)
{
    if (!be || !be->sparse_matmul)
        return false;
#ifdef FUSION_KERN_HAVE_CUDA
    if (be->device.kind == KERN_DEV_CUDA)
        return true;
#endif
    return be->device.kind == KERN_DEV_CPU;
}

fu_err kern_sparse_weight_make(const kern_backend_t *be, struct kern_bitmap **bm, int64_t rows, int64_t cols,
                               kern_sparse_weight *w, void **dev)
{
    if (!be || !bm || !*bm || !w || !dev)
        return FU_EINVAL;
    *dev = NULL;
    if (!kern_backend_has_sparse(be))
        return FU_ENOSYS;
    *w = (kern_sparse_weight){.handle = *bm, .rows = rows, .cols = cols};
#ifdef FUSION_KERN_HAVE_CUDA
    if (be->device.kind == KERN_DEV_CUDA) {
        kern_cuda_bitmap_t *cb = NULL;
        FU_TRY(kern_cuda_bitmap_upload(be, *bm, &cb));
        *dev = cb;
        w->handle = cb;
        kern_bitmap_destroy(bm);
    }
#endif
    return FU_OK;
}

void kern_sparse_weight_release(const kern_backend_t *be, void **dev)
{
    (void)be;
    if (!dev || !*dev)
        return;
#ifdef FUSION_KERN_HAVE_CUDA
    kern_cuda_bitmap_t *cb = *dev;
    kern_cuda_bitmap_destroy(&cb);
#endif
    *dev = NULL;
}
