/* gpu_busy SECONDS: another program's GPU work, for test_e2e_guest_gpu. Opens CUDA device 0 through
 * the kern CUDA backend and runs 2048² f32 GEMMs (cuBLAS) for SECONDS, then exits 0. SECONDS 0 only
 * checks that a device can be opened. Exit 77 where there is no CUDA device (or this build has no
 * CUDA backend), 1 when a GEMM fails, 2 on a bad argument. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fu_clock.h"
#include "kern_backend.h"
#include "kern_tensor.h"
#ifdef FUSION_KERN_HAVE_CUDA
#include "kern_cuda.h"
#endif

#define GPU_BUSY_N     2048 /* square GEMM size */
#define GPU_BUSY_BATCH 8    /* GEMMs queued between two waits */

int main(int argc, char **argv)
{
    char *end = NULL;
    double secs = argc == 2 ? strtod(argv[1], &end) : -1;
    if (argc != 2 || !end || *end || !(secs >= 0) || secs > 3600) {
        fprintf(stderr, "usage: gpu_busy SECONDS (0 to 3600)\n");
        return 2;
    }
#ifdef FUSION_KERN_HAVE_CUDA
    if (kern_cuda_device_count() <= 0) {
        printf("gpu_busy: no CUDA device\n");
        return 77;
    }
#endif
    const kern_backend_t *be = NULL;
    if (kern_backend_get("cuda:0", &be) != FU_OK || !be) {
        printf("gpu_busy: CUDA device 0 cannot be opened\n");
        return 77;
    }
    int64_t shape[2] = {GPU_BUSY_N, GPU_BUSY_N};
    kern_tensor_t *a = NULL, *b = NULL, *c = NULL;
    if (kern_tensor_new_zeros(be, KERN_F32, 2, shape, &a) != FU_OK ||
        kern_tensor_new_zeros(be, KERN_F32, 2, shape, &b) != FU_OK ||
        kern_tensor_new_zeros(be, KERN_F32, 2, shape, &c) != FU_OK) {
        fprintf(stderr, "gpu_busy: cannot allocate 3 x %d² floats on cuda:0\n", GPU_BUSY_N);
        return 1;
    }
    printf("gpu_busy: pid %d runs GEMMs on cuda:0 for %.1f s\n", (int)getpid(), secs);
    fflush(stdout);
    uint64_t t0 = fu_clock_ms(), until = t0 + (uint64_t)(secs * 1000.0);
    long n = 0;
    int rc = 0;
    while (fu_clock_ms() < until && rc == 0) {
        for (int i = 0; i < GPU_BUSY_BATCH && rc == 0; i++, n++)
            if (kern_gemm(be, false, false, 1.0f, a, b, 0.0f, c) != FU_OK)
                rc = 1;
        if (rc == 0 && kern_backend_sync(be) != FU_OK)
            rc = 1;
    }
    printf("gpu_busy: %ld GEMMs in %.1f s%s\n", n, (double)(fu_clock_ms() - t0) / 1000.0, rc ? ": a GEMM failed" : "");
    kern_tensor_destroy(&a);
    kern_tensor_destroy(&b);
    kern_tensor_destroy(&c);
    return rc;
}
