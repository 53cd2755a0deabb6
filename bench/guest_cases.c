/* bench-guest: what a fusion peer costs the owner of the machine it runs on (docs/PEER.md "A good
 * guest"). The "owner" is one busy-loop process per core counting iterations; the "compute" is one
 * thread per core in this process running single-threaded 256x256 sgemms through the kernels API,
 * at a given kern_priority; the "I/O thread" is a normal-priority thread that wakes every 200 ms, as
 * the peer's heartbeat timer does.
 *   owner_*:     the owner's iterations/s relative to the owner alone, the compute's GFLOP/s and the
 *                I/O thread's worst and median wake-up lateness, for compute at normal, low and idle
 *                priority.
 *   duty_*:      one compute thread calling peer_guest_yield between sgemms with --max-cpu 25, 50 and
 *                75 on an otherwise idle machine: the CPU share it used. */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "fu_clock.h"
#include "kern_backend.h"
#include "kern_priority.h"
#include "kern_tensor.h"
#include "peer_guest.h"

#define GB_N        256   /* sgemm size */
#define GB_TICK_MS  200   /* the I/O thread's period */

static int ncpu(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static double secs(void)
{
    return bench_quick() ? 1.0 : 3.0;
}

/* ---- the owner: busy loops that count ------------------------------------------------------------ */

typedef struct {
    pid_t pid[64];
    int fd[64];
    int n;
} owner_t;

static void owner_start(owner_t *o, int n, double seconds)
{
    o->n = n;
    for (int i = 0; i < n; i++) {
        int p[2];
        if (pipe(p) != 0)
            exit(1);
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            close(p[0]);
            uint64_t end = fu_clock_ns() + (uint64_t)(seconds * 1e9), count = 0;
            while (fu_clock_ns() < end)
                for (int k = 0; k < 100000; k++)
                    count++;
            double rate = (double)count / seconds;
            ssize_t w = write(p[1], &rate, sizeof rate);
            (void)w;
            _exit(0);
        }
        close(p[1]);
        o->pid[i] = pid;
        o->fd[i] = p[0];
    }
}

static double owner_finish(owner_t *o)
{
    double total = 0;
    for (int i = 0; i < o->n; i++) {
        double r = 0;
        if (read(o->fd[i], &r, sizeof r) == (ssize_t)sizeof r)
            total += r;
        close(o->fd[i]);
        waitpid(o->pid[i], NULL, 0);
    }
    return total;
}

/* ---- the compute: sgemm loops at a priority --------------------------------------------------------- */

typedef struct {
    atomic_bool stop;
    atomic_ullong gemms;
    kern_priority prio;
    peer_guest_t *guest; /* yield between sgemms (NULL: none) */
} compute_t;

static void *compute_worker(void *arg)
{
    compute_t *c = arg;
    const kern_backend_t *be = kern_backend_cpu();
    kern_tensor_t *a = NULL, *b = NULL, *d = NULL;
    int64_t shape[2] = {GB_N, GB_N};
    if (kern_tensor_new_zeros(be, KERN_F32, 2, shape, &a) != FU_OK || kern_tensor_new_zeros(be, KERN_F32, 2, shape, &b) != FU_OK ||
        kern_tensor_new_zeros(be, KERN_F32, 2, shape, &d) != FU_OK)
        exit(1);
    while (!atomic_load(&c->stop)) {
        if (kern_gemm(be, false, false, 1.0f, a, b, 0.0f, d) != FU_OK)
            exit(1);
        atomic_fetch_add(&c->gemms, 1);
        if (c->guest)
            peer_guest_yield(c->guest);
    }
    kern_tensor_destroy(&a);
    kern_tensor_destroy(&b);
    kern_tensor_destroy(&d);
    return NULL;
}

typedef struct {
    compute_t *c;
    int n;
    pthread_t t[64];
} leader_arg;

/* The leader sets its priority, then starts the workers, which inherit it (as a peer's compute
 * thread's OpenMP team does). */
static void *compute_leader(void *arg)
{
    leader_arg *l = arg;
    kern_priority got;
    if (kern_priority_set_self(l->c->prio, &got) != FU_OK)
        fprintf(stderr, "bench-guest: priority %s refused\n", kern_priority_name(l->c->prio));
    for (int i = 1; i < l->n; i++)
        pthread_create(&l->t[i], NULL, compute_worker, l->c);
    compute_worker(l->c);
    for (int i = 1; i < l->n; i++)
        pthread_join(l->t[i], NULL);
    return NULL;
}

/* ---- the I/O thread: a 200 ms timer, lateness measured -------------------------------------------- */

typedef struct {
    atomic_bool stop;
    double late_ms[256];
    int n;
} tick_t;

static void *ticker(void *arg)
{
    tick_t *t = arg;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    while (!atomic_load(&t->stop) && t->n < 256) {
        next.tv_nsec += GB_TICK_MS * 1000000L;
        if (next.tv_nsec >= 1000000000L) {
            next.tv_sec++;
            next.tv_nsec -= 1000000000L;
        }
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL);
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        t->late_ms[t->n++] = (double)(now.tv_sec - next.tv_sec) * 1e3 + (double)(now.tv_nsec - next.tv_nsec) / 1e6;
    }
    return NULL;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void owner_case(const char *name, int prio /* -1: no compute */, double alone)
{
    int n = ncpu();
    compute_t c = {.prio = prio < 0 ? KERN_PRIORITY_NORMAL : (kern_priority)prio};
    leader_arg l = {.c = &c, .n = n};
    tick_t tk = {0};
    pthread_t lead, tick;
    pthread_create(&tick, NULL, ticker, &tk);
    if (prio >= 0)
        pthread_create(&lead, NULL, compute_leader, &l);
    owner_t o;
    uint64_t t0 = fu_clock_ns();
    owner_start(&o, n, secs());
    double rate = owner_finish(&o);
    double wall = (double)(fu_clock_ns() - t0) / 1e9;
    atomic_store(&c.stop, true);
    atomic_store(&tk.stop, true);
    if (prio >= 0)
        pthread_join(lead, NULL);
    pthread_join(tick, NULL);
    qsort(tk.late_ms, (size_t)tk.n, sizeof tk.late_ms[0], cmp_d);
    double gflops = (double)atomic_load(&c.gemms) * 2.0 * GB_N * GB_N * GB_N / wall / 1e9;
    bench_emit("guest", name,
               "\"cores\":%d,\"compute_priority\":\"%s\",\"owner_rate_relative\":%.3f,\"compute_gflops\":%.1f,"
               "\"tick_late_ms_p50\":%.2f,\"tick_late_ms_max\":%.2f,\"ticks\":%d",
               n, prio < 0 ? "none" : kern_priority_name((kern_priority)prio), alone > 0 ? rate / alone : 1.0, gflops,
               tk.n ? tk.late_ms[tk.n / 2] : 0, tk.n ? tk.late_ms[tk.n - 1] : 0, tk.n);
}

static double owner_alone(void)
{
    owner_t o;
    owner_start(&o, ncpu(), secs());
    return owner_finish(&o);
}

BENCH_CASE(owner_load)
{
    if (kern_cpu_set_threads(1) != FU_OK) /* one thread per sgemm: the workers are the parallelism */
        exit(1);
    double alone = owner_alone();
    owner_case("owner_alone", -1, alone);
    owner_case("owner_with_compute_normal", KERN_PRIORITY_NORMAL, alone);
    owner_case("owner_with_compute_low", KERN_PRIORITY_LOW, alone);
    owner_case("owner_with_compute_idle", KERN_PRIORITY_IDLE, alone);
}

static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

BENCH_CASE(duty_cycle)
{
    if (kern_cpu_set_threads(1) != FU_OK)
        exit(1);
    static const int caps[] = {25, 50, 75};
    for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
        peer_guest_cfg gc = {.max_cpu = caps[i]};
        compute_t c = {.prio = KERN_PRIORITY_NORMAL, .guest = peer_guest_new(&gc, 1)};
        leader_arg l = {.c = &c, .n = 1};
        uint64_t w0 = fu_clock_ns(), c0 = cpu_ns();
        pthread_t lead;
        pthread_create(&lead, NULL, compute_leader, &l);
        fu_sleep_ms((uint32_t)(secs() * 1000));
        atomic_store(&c.stop, true);
        pthread_join(lead, NULL);
        double share = (double)(cpu_ns() - c0) / (double)(fu_clock_ns() - w0);
        char name[32];
        snprintf(name, sizeof name, "duty_max_cpu_%d", caps[i]);
        bench_emit("guest", name, "\"max_cpu\":%d,\"cpu_share\":%.3f", caps[i], share);
        peer_guest_destroy(&c.guest);
    }
}
