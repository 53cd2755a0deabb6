/* peer_guest: pauses, hours and the duty cycle of the compute thread (see peer_guest.h). */
#define _GNU_SOURCE
#include "peer_guest.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "peer_gpuwatch.h"

/* Consecutive busy and quiet samples of one watched resource. */
typedef struct {
    int busy_run, quiet_run;
} hysteresis;

struct peer_guest {
    peer_guest_cfg cfg;
    int threads;               /* compute threads, for the duty cycle's share */
    _Atomic unsigned mask;     /* PEER_PAUSE_* in force */
    _Atomic bool released;     /* leaving: never pause again */
    /* I/O thread */
    uint64_t next_sample_ms;   /* when peer_guest_tick reads the machine again */
    peer_guest_sample last;    /* the previous reading (total 0: none yet) */
    double others;             /* the latest share of the other processes, percent (-1: unknown) */
    hysteresis cpu;            /* of the CPU samples */
    peer_gpuwatch_t *gpu;      /* NULL: the GPU is not watched */
    int gpu_others;            /* other programs' processes on the GPU at the latest look */
    hysteresis gpu_h;          /* of the GPU looks */
    /* compute thread: the duty cycle's window */
    uint64_t wall0_ns, cpu0_ns;
};

fu_err peer_guest_hours_parse(const char *text, int *from, int *to, fu_errmsg *em)
{
    int h[2] = {0, 0}, m[2] = {0, 0};
    const char *p = text ? text : "";
    for (int i = 0; i < 2; i++) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > 24)
            goto bad;
        h[i] = (int)v;
        p = end;
        if (*p == ':') {
            v = strtol(p + 1, &end, 10);
            if (end == p + 1 || end - p != 3 || v < 0 || v > 59)
                goto bad;
            m[i] = (int)v;
            p = end;
        }
        if (h[i] == 24 && m[i] != 0)
            goto bad;
        if (i == 0 && *p++ != '-')
            goto bad;
    }
    if (*p)
        goto bad;
    *from = (h[0] * 60 + m[0]) % 1440;
    *to = (h[1] * 60 + m[1]) % 1440;
    if (*from == *to) {
        return fu_errmsg_set(em, FU_EINVAL, "--hours '%s' is empty or the whole day (leave --hours out to run at any "
                                            "time)", text);
    }
    return FU_OK;
bad:
    return fu_errmsg_set(em, FU_EINVAL, "--hours '%s': expected FROM-TO in local hours, like 22-08 or 22:30-07:15",
                         text ? text : "");
}

bool peer_guest_in_hours(int from, int to, int m)
{
    if (from == to)
        return true;
    return from < to ? m >= from && m < to : m >= from || m < to;
}

peer_guest_t *peer_guest_new(const peer_guest_cfg *cfg, int threads)
{
    if (!cfg || cfg->max_cpu < 0 || cfg->max_cpu > 100 || cfg->busy_percent < 0 || cfg->busy_percent > 100 ||
        cfg->hours_from < 0 || cfg->hours_from >= 1440 || cfg->hours_to < 0 || cfg->hours_to >= 1440 || threads < 0 ||
        cfg->gpu < -1 || cfg->gpu_own < 0)
        return NULL;
    peer_guest_t *g = fu_calloc(1, sizeof *g);
    g->cfg = *cfg;
    if (g->cfg.max_cpu == 0)
        g->cfg.max_cpu = 100;
    if (g->cfg.busy_percent == 0)
        g->cfg.busy_percent = PEER_GUEST_BUSY_DEFAULT;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    g->threads = threads > 0 ? threads : n > 0 ? (int)n : 1;
    g->others = -1;
    if (g->cfg.pause_when_gpu_busy) {
        fu_errmsg em = {{0}};
        g->gpu = peer_gpuwatch_new(g->cfg.gpu, g->cfg.gpu_own, &em);
        if (g->gpu)
            FU_INFO("peer", "--pause-when-gpu-busy: watching %s for other programs' processes",
                    peer_gpuwatch_describe(g->gpu));
        else
            FU_WARN("peer", "--pause-when-gpu-busy: %s; compute will not pause for other programs' GPU work",
                    fu_errmsg_text(&em, FU_ENOSYS));
    }
    return g;
}

void peer_guest_destroy(peer_guest_t **g_p)
{
    if (!g_p || !*g_p)
        return;
    peer_gpuwatch_destroy(&(*g_p)->gpu);
    free(*g_p);
    *g_p = NULL;
}

/* ---- the machine ------------------------------------------------------------------------------ */

fu_err peer_guest_sample_read(peer_guest_sample *s)
{
    memset(s, 0, sizeof *s);
    FILE *f = fopen("/proc/stat", "r");
    if (!f)
        return FU_EIO;
    unsigned long long v[10] = {0};
    int n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
                   &v[5], &v[6], &v[7], &v[8], &v[9]);
    fclose(f);
    if (n < 4)
        return FU_EIO;
    /* user nice system idle iowait irq softirq steal guest guest_nice: guest time is already in user */
    for (int i = 0; i < 8 && i < n; i++)
        s->total += v[i];
    s->busy = s->total - v[3] - (n > 4 ? v[4] : 0);
    f = fopen("/proc/self/stat", "r");
    if (!f)
        return FU_EIO;
    char buf[1024];
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long long ut = 0, st = 0;
    if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return FU_EIO;
    s->own = ut + st;
    return FU_OK;
}

double peer_guest_others_percent(const peer_guest_sample *a, const peer_guest_sample *b)
{
    if (b->total <= a->total || b->busy < a->busy)
        return -1;
    double busy = (double)(b->busy - a->busy), own = b->own >= a->own ? (double)(b->own - a->own) : 0;
    double others = busy > own ? busy - own : 0;
    return 100.0 * others / (double)(b->total - a->total);
}

/* ---- the I/O thread ---------------------------------------------------------------------------- */

static void mask_set(peer_guest_t *g, unsigned bit, bool on)
{
    if (on)
        atomic_fetch_or(&g->mask, bit);
    else
        atomic_fetch_and(&g->mask, ~bit);
}

/* One busy or quiet sample: the pause `bit` begins after PEER_GUEST_BUSY_ON busy samples in a row
 * and ends after PEER_GUEST_BUSY_OFF quiet ones. */
static void hysteresis_feed(peer_guest_t *g, hysteresis *h, unsigned bit, bool busy)
{
    h->busy_run = busy ? h->busy_run + 1 : 0;
    h->quiet_run = busy ? 0 : h->quiet_run + 1;
    if (h->busy_run >= PEER_GUEST_BUSY_ON)
        mask_set(g, bit, true);
    else if (h->quiet_run >= PEER_GUEST_BUSY_OFF)
        mask_set(g, bit, false);
}

unsigned peer_guest_feed(peer_guest_t *g, double others_percent, int minute_of_day)
{
    if (atomic_load(&g->released))
        return 0;
    g->others = others_percent;
    if (g->cfg.pause_when_busy && others_percent >= 0)
        hysteresis_feed(g, &g->cpu, PEER_PAUSE_BUSY, others_percent > (double)g->cfg.busy_percent);
    if (minute_of_day >= 0)
        mask_set(g, PEER_PAUSE_HOURS, !peer_guest_in_hours(g->cfg.hours_from, g->cfg.hours_to, minute_of_day));
    return atomic_load(&g->mask);
}

unsigned peer_guest_tick(peer_guest_t *g, uint64_t now_ms)
{
    if (!g)
        return 0;
    if (now_ms < g->next_sample_ms)
        return atomic_load(&g->mask);
    g->next_sample_ms = now_ms + PEER_GUEST_SAMPLE_MS;
    double others = -1;
    if (g->cfg.pause_when_busy) {
        peer_guest_sample s;
        if (peer_guest_sample_read(&s) == FU_OK) {
            if (g->last.total)
                others = peer_guest_others_percent(&g->last, &s);
            g->last = s;
        }
    }
    int minute = -1;
    if (g->cfg.hours_from != g->cfg.hours_to) {
        time_t t = time(NULL);
        struct tm tm;
        if (localtime_r(&t, &tm))
            minute = tm.tm_hour * 60 + tm.tm_min;
    }
    if (g->gpu) {
        int listed = 0, on_gpu = -1;
        if (peer_gpuwatch_sample(g->gpu, &listed, &on_gpu) != FU_OK)
            on_gpu = -1;
        (void)peer_guest_feed_gpu(g, on_gpu);
    }
    return peer_guest_feed(g, others, minute);
}

unsigned peer_guest_feed_gpu(peer_guest_t *g, int others)
{
    if (!g || atomic_load(&g->released))
        return 0;
    if (g->cfg.pause_when_gpu_busy && others >= 0) {
        if (others > 0)
            g->gpu_others = others;
        hysteresis_feed(g, &g->gpu_h, PEER_PAUSE_GPU, others > 0);
    }
    return atomic_load(&g->mask);
}

bool peer_guest_gpu_watched(const peer_guest_t *g)
{
    return g && g->gpu;
}

void peer_guest_owner_pause(peer_guest_t *g, bool on)
{
    if (g && !atomic_load(&g->released))
        mask_set(g, PEER_PAUSE_OWNER, on);
}

void peer_guest_release(peer_guest_t *g)
{
    if (!g)
        return;
    atomic_store(&g->released, true);
    atomic_store(&g->mask, 0u);
}

unsigned peer_guest_paused(const peer_guest_t *g)
{
    return g ? atomic_load(&((peer_guest_t *)g)->mask) : 0;
}

void peer_guest_describe(const peer_guest_t *g, unsigned mask, char *out, size_t cap)
{
    size_t len = 0;
    out[0] = '\0';
    if ((mask & PEER_PAUSE_BUSY) && len < cap) {
        if (g && g->others >= 0)
            len += (size_t)snprintf(out + len, cap - len, "busy: other processes use %.0f%% of the CPU (over %d%%)",
                                    g->others, g->cfg.busy_percent);
        else
            len += (size_t)snprintf(out + len, cap - len, "busy: other processes use the CPU");
    }
    if ((mask & PEER_PAUSE_HOURS) && len < cap && g)
        len += (size_t)snprintf(out + len, cap - len, "%soutside hours %02d:%02d-%02d:%02d", len ? "; " : "",
                                g->cfg.hours_from / 60, g->cfg.hours_from % 60, g->cfg.hours_to / 60,
                                g->cfg.hours_to % 60);
    if ((mask & PEER_PAUSE_GPU) && len < cap) {
        int n = g ? g->gpu_others : 0;
        char which[32] = "the GPU";
        if (g && g->cfg.gpu >= 0)
            snprintf(which, sizeof which, "GPU %d", g->cfg.gpu);
        len += (size_t)snprintf(out + len, cap - len, "%sgpu: %d other process%s use%s %s", len ? "; " : "", n,
                                n == 1 ? "" : "es", n == 1 ? "s" : "", which);
    }
    if ((mask & PEER_PAUSE_OWNER) && len < cap)
        (void)snprintf(out + len, cap - len, "%spaused by its owner", len ? "; " : "");
}

/* ---- the compute thread ------------------------------------------------------------------------ */

static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void peer_guest_yield(void *arg)
{
    peer_guest_t *g = arg;
    if (!g)
        return;
    if (atomic_load(&g->mask)) {
        while (atomic_load(&g->mask) && !atomic_load(&g->released))
            fu_sleep_ms(PEER_GUEST_WAIT_MS);
        g->wall0_ns = 0; /* the pause is not part of the duty cycle's window */
    }
    if (g->cfg.max_cpu >= 100)
        return;
    uint64_t wall = fu_clock_ns(), cpu = cpu_ns();
    if (!g->wall0_ns || wall < g->wall0_ns || cpu < g->cpu0_ns) {
        g->wall0_ns = wall;
        g->cpu0_ns = cpu;
        return;
    }
    uint64_t dw = wall - g->wall0_ns;
    if (dw < (uint64_t)PEER_GUEST_DUTY_SLICE_MS * 1000000u)
        return;
    /* The process used dc of CPU over dw: at most max_cpu% of `threads` CPUs over dw + the sleep. */
    double dc = (double)(cpu - g->cpu0_ns);
    double sleep_ns = dc * 100.0 / ((double)g->threads * g->cfg.max_cpu) - (double)dw;
    if (sleep_ns > 1e6) {
        double cap = (double)PEER_GUEST_DUTY_MAX_MS * 1e6;
        fu_sleep_ms((uint32_t)((sleep_ns < cap ? sleep_ns : cap) / 1e6));
    }
    g->wall0_ns = fu_clock_ns();
    g->cpu0_ns = cpu_ns();
}
