/* kern_priority: how much of the machine the compute threads take. A volunteer's peer is a guest:
 * its compute threads run at idle priority, so that the owner's programs and the peer's own I/O
 * thread (heartbeats, sockets) always come first.
 *
 * The compute threads of this process are: the caller's (the executor's thread), the OpenMP team
 * it starts, the SALR helper it starts, and OpenBLAS's pool. Threads inherit the priority of the
 * thread that creates them, so the first three follow kern_priority_set_self; OpenBLAS starts its
 * pool when the library loads, before main, so kern_priority_set_others moves it.
 *
 * Linux only: the priority of a thread (SCHED_IDLE, or nice 19 where that is refused). */
#ifndef FU_KERN_PRIORITY_H
#define FU_KERN_PRIORITY_H

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    KERN_PRIORITY_NORMAL = 0, /* as started: competes with everything else */
    KERN_PRIORITY_LOW,        /* nice 19: runs when others leave time (CFS weight 15 of 1024) */
    KERN_PRIORITY_IDLE,       /* SCHED_IDLE: runs only on time nothing else wants (weight 3) */
} kern_priority;

#define KERN_PRIORITY_NICE_LOW 19 /* the nice value of KERN_PRIORITY_LOW and of IDLE's fallback */

/* Sets the calling thread's priority; threads it creates from now on inherit it. NORMAL leaves
 * the thread as it is (an unprivileged thread may not raise itself back). *got (may be NULL) says
 * what was obtained: IDLE falls back to LOW where SCHED_IDLE is refused. FU_EPERM when neither
 * could be set (the thread is unchanged). Thread-safe. */
FU_MUST_CHECK fu_err kern_priority_set_self(kern_priority want, kern_priority *got);

/* Sets the priority of every other thread of this process that exists now (OpenBLAS's pool, the
 * caller's OpenMP team). Call it before starting threads that must keep theirs, such as an I/O
 * runtime's. *got as above (the lowest any thread obtained). FU_EIO when /proc/self/task cannot
 * be read, FU_EPERM when no thread could be moved. */
FU_MUST_CHECK fu_err kern_priority_set_others(kern_priority want, kern_priority *got);

/* The priority of thread tid (0: the caller), read back from the kernel: IDLE for SCHED_IDLE,
 * LOW for nice >= KERN_PRIORITY_NICE_LOW, else NORMAL. For tests and logs. */
kern_priority kern_priority_of(int tid);

/* "normal", "low", "idle". */
const char *kern_priority_name(kern_priority p);
/* Parses one of those names; FU_EINVAL otherwise. */
FU_MUST_CHECK fu_err kern_priority_parse(const char *name, kern_priority *out);

#ifdef __cplusplus
}
#endif
#endif
