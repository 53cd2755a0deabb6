/* peer_guest: fusion-peer as a good guest on a machine its owner also uses (docs/PEER.md "A good
 * guest").
 *
 *   - priority: the compute threads run at idle priority (kern_priority), the I/O thread at the
 *     process's own, so heartbeats keep their interval whatever else runs;
 *   - --max-cpu P: a duty cycle on the compute threads (they run at most P% of the time);
 *   - --pause-when-busy: compute pauses while other processes use more than --busy-percent of the
 *     machine's CPU; --hours FROM-TO: compute runs only inside a daily window (local time);
 *     SIGUSR1/SIGUSR2: the owner pauses and resumes by hand;
 *   - --pause-when-gpu-busy (the default on a CUDA peer): compute pauses while other programs run on
 *     the peer's GPU (peer_gpuwatch.h, NVML loaded at run time; without NVML, no such pause).
 *
 * A pause stops the compute thread between two nodes of the executor (peer_guest_yield, the
 * executor's yield hook): the stage keeps every tensor, link and lease, and goes on where it stopped,
 * so its result is unchanged. The I/O thread reports the pause in its heartbeats (PEER_STATE_PAUSED
 * with a reason) and the broker waits for a paused stage up to its grace period before moving it.
 *
 * Threads: peer_guest_tick, peer_guest_owner_pause and peer_guest_release from the I/O thread;
 * peer_guest_yield from the compute thread; peer_guest_paused from either. */
#ifndef FU_PEER_GUEST_H
#define FU_PEER_GUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"
#include "kern_priority.h"

#define PEER_GUEST_SAMPLE_MS     1000 /* how often the I/O thread reads the machine's load */
#define PEER_GUEST_BUSY_ON       2    /* consecutive busy samples before a pause */
#define PEER_GUEST_BUSY_OFF      5    /* consecutive quiet samples before resuming */
#define PEER_GUEST_BUSY_DEFAULT  25   /* --busy-percent: as BOINC's "non-BOINC CPU usage" default */
#define PEER_GUEST_DUTY_SLICE_MS 100  /* the duty cycle looks at the CPU time used this often */
#define PEER_GUEST_DUTY_MAX_MS   5000 /* longest single duty-cycle sleep */
#define PEER_GUEST_WAIT_MS       50   /* a paused compute thread looks again this often */

/* Why compute is paused: a bit mask. */
enum {
    PEER_PAUSE_BUSY = 1u << 0,  /* other processes use more than --busy-percent */
    PEER_PAUSE_HOURS = 1u << 1, /* outside --hours */
    PEER_PAUSE_OWNER = 1u << 2, /* the owner asked (SIGUSR1; SIGUSR2 resumes) */
    PEER_PAUSE_GPU = 1u << 3,   /* other programs run on the peer's GPU (--pause-when-gpu-busy) */
};

typedef struct {
    kern_priority priority; /* of the compute threads (default KERN_PRIORITY_IDLE) */
    int max_cpu;            /* 1..100: percent of the time compute may run (100 or 0: no cap) */
    bool pause_when_busy;   /* watch the other processes' CPU use */
    int busy_percent;       /* 1..100: their share of the machine above which compute pauses */
    int hours_from;         /* compute runs in [hours_from, hours_to), minutes of the local day; */
    int hours_to;           /* equal: always */
    bool pause_when_gpu_busy; /* watch the GPU for other programs' processes (peer_gpuwatch.h) */
    int gpu;                /* the CUDA ordinal watched; -1: every GPU (a CPU peer) */
    int gpu_own;            /* this peer's processes with a context on that GPU (its slots; 0 on a CPU peer) */
} peer_guest_cfg;

typedef struct peer_guest peer_guest_t;

/* Parses a daily window "22-08", "9-17" or "22:30-07:15" (local time; FROM == TO is refused, use
 * no --hours for always) into minutes of the day. FU_EINVAL with a sentence in em otherwise. */
FU_MUST_CHECK fu_err peer_guest_hours_parse(const char *text, int *from, int *to, fu_errmsg *em);
/* Whether minute m of the day lies in [from, to), a window that may wrap past midnight. */
bool peer_guest_in_hours(int from, int to, int m);

/* Makes the guest for a compute backend using `threads` threads (0: one per CPU). NULL when cfg
 * is out of range. With pause_when_gpu_busy it loads NVML and finds the GPU (peer_gpuwatch_new);
 * where that fails it logs why, once, and the guest never pauses for the GPU. */
peer_guest_t *peer_guest_new(const peer_guest_cfg *cfg, int threads);
void peer_guest_destroy(peer_guest_t **g_p);

/* I/O thread, about every PEER_GUEST_SAMPLE_MS: reads the machine's CPU use and the local time and
 * returns the pause mask now in force. Between samples it only returns the current mask. */
unsigned peer_guest_tick(peer_guest_t *g, uint64_t now_ms);
/* What peer_guest_tick decides from one sample: the other processes' share of the machine's CPU
 * (percent, or a negative value when unknown) and the minute of the local day. For tests. */
unsigned peer_guest_feed(peer_guest_t *g, double others_percent, int minute_of_day);
/* What peer_guest_tick decides from one look at the GPU: how many other programs' processes run on
 * it (a negative value: unknown, nothing changes). Pauses after PEER_GUEST_BUSY_ON looks with some,
 * resumes after PEER_GUEST_BUSY_OFF without, as for the CPU. Nothing without pause_when_gpu_busy.
 * For tests. */
unsigned peer_guest_feed_gpu(peer_guest_t *g, int others);
/* Whether the GPU is watched: pause_when_gpu_busy and NVML found the GPU. */
bool peer_guest_gpu_watched(const peer_guest_t *g);
/* Owner's pause (true) or resume (false). */
void peer_guest_owner_pause(peer_guest_t *g, bool on);
/* No more pauses from now on (the peer is leaving: its stage must drain). */
void peer_guest_release(peer_guest_t *g);
/* The mask now in force (0: running). Any thread. */
unsigned peer_guest_paused(const peer_guest_t *g);
/* A short text for mask, for heartbeats and logs: "busy: others use 87% of the CPU", "outside hours
 * 22:00-08:00", "gpu: 2 other processes use GPU 0", "paused by its owner" (joined with "; "). */
void peer_guest_describe(const peer_guest_t *g, unsigned mask, char *out, size_t cap);

/* Compute thread, between two pieces of work (the executor's yield hook; arg is the guest): waits
 * while paused and sleeps as the duty cycle asks. Returns at once when neither applies. */
void peer_guest_yield(void *arg);

/* The other processes' CPU share between two readings of /proc/stat and /proc/self/stat, in
 * percent of the whole machine, or -1 when it cannot be read. own_* are this process's ticks. */
typedef struct {
    uint64_t total; /* every CPU's ticks, idle included */
    uint64_t busy;  /* every CPU's non-idle ticks */
    uint64_t own;   /* this process's user + system ticks */
} peer_guest_sample;
FU_MUST_CHECK fu_err peer_guest_sample_read(peer_guest_sample *s);
double peer_guest_others_percent(const peer_guest_sample *a, const peer_guest_sample *b);

#endif
