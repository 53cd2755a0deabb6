/* peer_profile: GEMM throughput, memory and device of this peer (see peer_profile.h). */
#include "peer_profile.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_clock.h"

#define PROFILE_CPU_N  512  /* 0.27 GFLOP per GEMM: a few ms on one core, many reps in the budget */
#define PROFILE_CUDA_N 4096 /* 137 GFLOP: large enough to reach a GPU's steady throughput */

/* GFLOP/s of square n×n GEMMs in dtype dt on be, run for about budget seconds after a warm-up. */
static fu_err gemm_speed(const kern_backend_t *be, kern_dtype dt, int64_t n, double budget, double *gflops,
                         fu_errmsg *em)
{
    const int64_t shape[2] = {n, n};
    kern_tensor_t *a = NULL, *b = NULL, *c = NULL;
    float *host = NULL;
    fu_err rc;
    if ((rc = kern_tensor_new(be, dt, 2, shape, &a)) != FU_OK || (rc = kern_tensor_new(be, dt, 2, shape, &b)) != FU_OK ||
        (rc = kern_tensor_new(be, dt, 2, shape, &c)) != FU_OK) {
        fu_errmsg_set(em, rc, "profile: cannot allocate %lld x %lld %s matrices on %s", (long long)n, (long long)n,
                      kern_dtype_name(dt), be->name);
        goto done;
    }
    /* Ordinary values (a denormal-free pattern in [-1, 1)) so that no fast path skews the time. */
    size_t ne = (size_t)(n * n);
    host = malloc(ne * sizeof *host);
    void *conv = malloc(ne * sizeof *host);
    if (!host || !conv) {
        free(conv);
        rc = fu_errmsg_set(em, FU_ENOMEM, "profile: out of host memory");
        goto done;
    }
    for (size_t i = 0; i < ne; i++)
        host[i] = (float)((int)(i * 2654435761u % 2001u) - 1000) / 1000.0f;
    rc = kern_convert_host(conv, dt, host, KERN_F32, ne);
    if (rc == FU_OK)
        rc = kern_tensor_copy_in(be, a, conv, kern_tensor_nbytes(a));
    if (rc == FU_OK)
        rc = kern_tensor_copy_in(be, b, conv, kern_tensor_nbytes(b));
    free(conv);
    if (rc == FU_OK)
        rc = kern_gemm(be, false, false, 1.0f, a, b, 0.0f, c); /* warm-up: threads, caches, cuBLAS */
    if (rc == FU_OK)
        rc = kern_backend_sync(be);
    if (rc != FU_OK) {
        fu_errmsg_set(em, rc, "profile: %s GEMM failed on %s: %s", kern_dtype_name(dt), be->name, fu_strerror(rc));
        goto done;
    }
    int reps = 0;
    double t0 = fu_clock_sec(), el = 0;
    do {
        rc = kern_gemm(be, false, false, 1.0f, a, b, 0.0f, c);
        if (rc == FU_OK && (++reps % 4 == 0 || fu_clock_sec() - t0 > budget * 0.5))
            rc = kern_backend_sync(be);
        el = fu_clock_sec() - t0;
    } while (rc == FU_OK && el < budget && reps < 100000);
    if (rc == FU_OK)
        rc = kern_backend_sync(be);
    el = fu_clock_sec() - t0;
    if (rc != FU_OK) {
        fu_errmsg_set(em, rc, "profile: %s GEMM failed on %s: %s", kern_dtype_name(dt), be->name, fu_strerror(rc));
        goto done;
    }
    *gflops = 2.0 * (double)n * (double)n * (double)n * reps / (el > 0 ? el : 1e-9) / 1e9;
done:
    free(host);
    kern_tensor_destroy(&a);
    kern_tensor_destroy(&b);
    kern_tensor_destroy(&c);
    return rc;
}

fu_err peer_profile_measure(const kern_backend_t *be, uint64_t max_memory_bytes, double budget_s, peer_profile *out,
                            fu_errmsg *em)
{
    if (!be || !out)
        return FU_EINVAL;
    memset(out, 0, sizeof *out);
    if (!(budget_s > 0))
        budget_s = PEER_PROFILE_BUDGET_S;
    out->cuda = be->device.kind == KERN_DEV_CUDA;
    int t = kern_cpu_threads();
    out->threads = t > 0 ? (uint32_t)t : 1u;
    kern_dtype cand[PEER_PROFILE_MAX_DTYPES] = {KERN_F32, KERN_F16, KERN_BF16};
    unsigned mask = be->float_dtypes ? be->float_dtypes : (1u << KERN_F32);
    uint32_t n_dt = 0;
    for (int i = 0; i < PEER_PROFILE_MAX_DTYPES; i++)
        if (mask & (1u << cand[i]))
            out->dtypes[n_dt++] = cand[i];
    int64_t n = out->cuda ? PROFILE_CUDA_N : PROFILE_CPU_N;
    out->gemm_n = (uint32_t)n;
    for (uint32_t i = 0; i < n_dt; i++)
        FU_TRY(gemm_speed(be, out->dtypes[i], n, budget_s / n_dt, &out->gflops[i], em));
    out->n_speeds = n_dt;

    kern_device_info di;
    fu_err rc = kern_backend_device_info(be, &di);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "profile: cannot query the device of %s: %s", be->name, fu_strerror(rc));
    out->device_free_bytes = di.free_bytes;
    snprintf(out->device_name, sizeof out->device_name, "%.127s", di.name);
    snprintf(out->numeric_class, sizeof out->numeric_class, "%s", di.numeric_class);
    out->free_memory_bytes = out->device_free_bytes;
    if (max_memory_bytes && max_memory_bytes < out->free_memory_bytes)
        out->free_memory_bytes = max_memory_bytes;
    return FU_OK;
}

void peer_profile_format(const peer_profile *p, char *buf, size_t cap)
{
    size_t off = 0;
    int k = snprintf(buf, cap, "%s, %u threads", p->device_name, p->threads);
    off = k > 0 ? (size_t)k : 0;
    for (uint32_t i = 0; i < p->n_speeds && off < cap; i++) {
        k = snprintf(buf + off, cap - off, " | %s GEMM %u: %.1f GFLOP/s", kern_dtype_name(p->dtypes[i]), p->gemm_n,
                     p->gflops[i]);
        off += k > 0 ? (size_t)k : 0;
    }
    if (off < cap)
        snprintf(buf + off, cap - off, " | offers %.2f GiB (free %.2f GiB)",
                 (double)p->free_memory_bytes / (1024.0 * 1024 * 1024),
                 (double)p->device_free_bytes / (1024.0 * 1024 * 1024));
}
