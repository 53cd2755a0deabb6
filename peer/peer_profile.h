/* peer_profile: what a peer tells the broker about itself in PeerHello (PeerProfile): GEMM
 * throughput per float dtype its backend runs, memory it offers, its device and threads. The link
 * to the broker (latency, bandwidth) is measured by the I/O thread (peer_io.c) and filled in there.
 * Threads: peer_profile_measure runs kernels on be; call it before the daemon's threads start. */
#ifndef FU_PEER_PROFILE_H
#define FU_PEER_PROFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"
#include "kern_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PEER_PROFILE_BUDGET_S 0.3  /* wall time the GEMM measurement may take, all dtypes together */
#define PEER_PROFILE_MAX_DTYPES 3  /* f32, f16, bf16 */

typedef struct {
    uint32_t n_speeds;                            /* entries used below */
    kern_dtype dtypes[PEER_PROFILE_MAX_DTYPES];   /* dtypes measured (those the backend's GEMM takes) */
    double gflops[PEER_PROFILE_MAX_DTYPES];       /* measured GEMM GFLOP/s per dtype */
    uint32_t gemm_n;                              /* square size of the GEMM measured */
    uint64_t free_memory_bytes;                   /* offered: free memory capped by --max-memory */
    uint64_t device_free_bytes;                   /* what the device (or /proc/meminfo) said was free */
    bool cuda;                                    /* the backend is a CUDA device */
    char device_name[128];                        /* "cpu: <model name>" or the GPU's name */
    char numeric_class[160];                      /* kern_device_info's: same class, same bits */
    uint32_t threads;                             /* CPU threads used */
    double link_latency_ms;                       /* round trip to the broker (0: not measured) */
    double link_bandwidth_bps;                    /* bytes/s from the broker (0: not measured yet) */
} peer_profile;

/* Measures be: square GEMMs (C = A·B) per float dtype be accepts, for about budget_s seconds in
 * all (0: PEER_PROFILE_BUDGET_S), after one warm-up; the device's name and free memory from
 * kern_backend_device_info (MemAvailable on the CPU, the GPU's free memory on CUDA), capped at
 * max_memory_bytes when that is not 0. FU_ECUDA / FU_ENOMEM from the backend with a message. */
FU_MUST_CHECK fu_err peer_profile_measure(const kern_backend_t *be, uint64_t max_memory_bytes, double budget_s,
                                          peer_profile *out, fu_errmsg *em);

/* One line for logs and tests: "cpu: ... | f32 112.3 GFLOP/s | 3.1 GiB free". */
void peer_profile_format(const peer_profile *p, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
