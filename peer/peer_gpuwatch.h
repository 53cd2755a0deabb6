/* peer_gpuwatch: whether other programs run on the peer's GPU (docs/PEER.md "A good guest", the
 * GPU). peer_guest asks it once a second and pauses compute while the owner's own GPU work runs.
 *
 * NVML is loaded at run time (dlopen "libnvidia-ml.so.1", the driver's own library), so fusion-peer
 * builds and runs where there is no NVIDIA driver: peer_gpuwatch_new then says why in em and the
 * caller carries on without it. The few NVML (and CUDA driver) prototypes used are declared in the
 * .c: no CUDA header or library is needed at build time.
 *
 * Which GPU: a CUDA ordinal N (--device cuda:N) is found by its PCI bus id, which the CUDA driver
 * (libcuda.so.1, loaded at run time too: the library the CUDA runtime itself uses, so its ordinals,
 * CUDA_VISIBLE_DEVICES included, are the backend's) gives; where that fails, by NVML's index N.
 * A negative ordinal watches every GPU of the machine (a CPU peer).
 *
 * What counts as the owner's GPU work: every process in NVML's compute list (a CUDA context, held
 * or busy), and a process only in the graphics list (a desktop's compositor, a browser, a game) only
 * while NVML's per-process samples show it using at least PEER_GPUWATCH_GRAPHICS_BUSY % of the SMs
 * (a desktop always has its compositor on the GPU); where those samples are not supported,
 * graphics-only processes are not counted. Not counted: this process, and every other fusion-peer
 * (its slots, or a second peer on the same GPU: two peers that paused for each other would never
 * run again), told by /proc/PID/comm.
 *
 * Pid namespaces: in a container NVML may report the host's pids. When this process's own pid is
 * not among those listed while it holds a context on the GPU (own > 0), the pids are taken to be
 * another namespace's: none can be looked up in /proc, and `own` of the listed processes are taken
 * to be this peer's (its slots), the rest the owner's.
 *
 * Threads: one thread at a time per watcher (the peer's I/O thread). */
#ifndef FU_PEER_GPUWATCH_H
#define FU_PEER_GPUWATCH_H

#include <stdbool.h>
#include <stddef.h>

#include "fu_err.h"

#define PEER_GPUWATCH_MAX_PROCS     256 /* processes read per list and GPU (more: "that many or more") */
#define PEER_GPUWATCH_MAX_GPUS      64  /* GPUs watched at most when watching every GPU */
#define PEER_GPUWATCH_GRAPHICS_BUSY 10  /* SM percent from which a graphics-only process counts */

typedef struct peer_gpuwatch peer_gpuwatch_t;

/* Loads NVML and finds the GPU: CUDA ordinal gpu, or every GPU when gpu < 0. own: how many
 * processes of this peer hold a context on that GPU (its slots; 0 for a CPU peer), for a foreign pid
 * namespace (above). NULL when NVML cannot be loaded or started or the GPU is not found, with a
 * sentence in em (may be NULL). The caller owns the watcher: peer_gpuwatch_destroy. */
peer_gpuwatch_t *peer_gpuwatch_new(int gpu, int own, fu_errmsg *em);
/* Shuts NVML down (for this watcher) and frees; sets *w_p = NULL. NULL-safe, idempotent. */
void peer_gpuwatch_destroy(peer_gpuwatch_t **w_p);

/* How the GPU was found, for the log: "GPU 0 (PCI 0000:3b:00.0)", "GPU 1 (NVML index 1)", "4 GPUs".
 * Borrowed. */
const char *peer_gpuwatch_describe(const peer_gpuwatch_t *w);

/* One look at the GPU: *listed the distinct processes NVML lists on it (compute and graphics), *others
 * how many of them count as other programs' GPU work (above). FU_EIO when NVML fails (the
 * outputs are then 0). */
FU_MUST_CHECK fu_err peer_gpuwatch_sample(peer_gpuwatch_t *w, int *listed, int *others);

/* One process NVML lists that counts as GPU work, for the rule below. */
typedef struct {
    unsigned pid; /* as NVML reports it */
    bool fusion;  /* another fusion-peer (its /proc/PID/comm is this process's) */
} peer_gpuwatch_proc;

/* The rule peer_gpuwatch_sample applies to the n processes that count as GPU work: when self (this
 * process's pid) is among them, or own is 0, those neither self nor fusion; otherwise (another pid
 * namespace) n - own, at least 0, whatever their fusion flags say. */
int peer_gpuwatch_count_others(const peer_gpuwatch_proc *procs, size_t n, unsigned self, int own);

#endif
