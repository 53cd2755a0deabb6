/* peer_gpuwatch: other programs' processes on the peer's GPU, through NVML loaded at run time (see
 * peer_gpuwatch.h). */
#define _GNU_SOURCE
#include "peer_gpuwatch.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include "fu_alloc.h"
#include "fu_log.h"

/* The NVML ABI used here (nvml.h, stable since the _v2 symbols of CUDA 11; declared here so that
 * nothing of CUDA is needed at build time). */
typedef int nvml_ret;                   /* nvmlReturn_t */
typedef struct nvml_device *nvml_dev;   /* nvmlDevice_t */
#define NVML_OK                0        /* NVML_SUCCESS */
#define NVML_E_INSUFFICIENT    7        /* NVML_ERROR_INSUFFICIENT_SIZE */
typedef struct {                        /* nvmlProcessInfo_v2_t (and nvmlProcessInfo_t): the _v2, _v3 lists */
    unsigned int pid;
    unsigned long long used_memory;
    unsigned int gpu_instance, compute_instance;
} nvml_proc2;
typedef struct {                        /* nvmlProcessInfo_v1_t: the unversioned lists of old drivers */
    unsigned int pid;
    unsigned long long used_memory;
} nvml_proc1;
typedef struct {                        /* nvmlProcessUtilizationSample_t */
    unsigned int pid;
    unsigned long long time_us;
    unsigned int sm, mem, enc, dec;     /* percent */
} nvml_util;
typedef nvml_ret (*nvml_list2_fn)(nvml_dev, unsigned int *, nvml_proc2 *);
typedef nvml_ret (*nvml_list1_fn)(nvml_dev, unsigned int *, nvml_proc1 *);
typedef nvml_ret (*nvml_util_fn)(nvml_dev, nvml_util *, unsigned int *, unsigned long long);

#define GW_UTIL_SAMPLES 512 /* per-process utilization samples read per GPU and look */

struct peer_gpuwatch {
    void *lib;                              /* libnvidia-ml.so.1 */
    nvml_ret (*shutdown)(void);
    const char *(*errstr)(nvml_ret);
    nvml_list2_fn list2[2];                 /* compute, graphics: the _v3 or _v2 symbols */
    nvml_list1_fn list1[2];                 /* ... or the v1 ones */
    nvml_util_fn util;                      /* nvmlDeviceGetProcessUtilization (NULL: graphics ignored) */
    nvml_dev dev[PEER_GPUWATCH_MAX_GPUS];   /* the GPUs watched */
    unsigned long long util_seen[PEER_GPUWATCH_MAX_GPUS]; /* newest utilization sample read, per GPU */
    int n_dev;
    int own;                                /* this peer's processes on the GPU (peer_gpuwatch_new) */
    unsigned self;                          /* getpid() */
    char comm[32];                          /* this process's /proc/self/comm */
    char what[96];                          /* peer_gpuwatch_describe */
    /* scratch of one look */
    nvml_proc2 buf[PEER_GPUWATCH_MAX_PROCS];
    nvml_proc1 buf1[PEER_GPUWATCH_MAX_PROCS];
    nvml_util ubuf[GW_UTIL_SAMPLES];
    struct gw_proc {
        unsigned pid;
        bool compute;  /* in the compute list */
        bool graphics; /* in the graphics list */
        bool busy;     /* its SM use reached PEER_GPUWATCH_GRAPHICS_BUSY in the latest samples */
    } procs[PEER_GPUWATCH_MAX_PROCS];
    peer_gpuwatch_proc counted[PEER_GPUWATCH_MAX_PROCS];
};

int peer_gpuwatch_count_others(const peer_gpuwatch_proc *procs, size_t n, unsigned self, int own)
{
    bool seen = false;
    for (size_t i = 0; i < n; i++)
        seen = seen || procs[i].pid == self;
    if (!seen && own > 0) /* another pid namespace: `own` of them are ours */
        return n > (size_t)own ? (int)(n - (size_t)own) : 0;
    int others = 0;
    for (size_t i = 0; i < n; i++)
        others += procs[i].pid != self && !procs[i].fusion;
    return others;
}

static void *sym(void *lib, const char *a, const char *b)
{
    void *f = dlsym(lib, a);
    return f || !b ? f : dlsym(lib, b);
}

/* The first line of path into out (empty when it cannot be read). */
static void read_line(const char *path, char *out, size_t cap)
{
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    if (!fgets(out, (int)cap, f))
        out[0] = '\0';
    fclose(f);
    out[strcspn(out, "\n")] = '\0';
}

/* CUDA ordinal's PCI bus id ("0000:3b:00.0") from the CUDA driver. The library stays loaded: the
 * CUDA runtime of a CUDA peer holds it anyway, and unloading it after cuInit is not supported. */
static bool cuda_bus_id(int ordinal, char *out, int cap)
{
    void *cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cu)
        return false;
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(cu, "cuInit");
    int (*get)(int *, int) = (int (*)(int *, int))dlsym(cu, "cuDeviceGet");
    int (*bus)(char *, int, int) = (int (*)(char *, int, int))dlsym(cu, "cuDeviceGetPCIBusId");
    int dev = 0;
    return init && get && bus && init(0) == 0 && get(&dev, ordinal) == 0 && bus(out, cap, dev) == 0 && out[0];
}

peer_gpuwatch_t *peer_gpuwatch_new(int gpu, int own, fu_errmsg *em)
{
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fu_errmsg_set(em, FU_ENOSYS, "NVML cannot be loaded (%s; it comes with the NVIDIA driver)",
                      dlerror());
        return NULL;
    }
    peer_gpuwatch_t *w = fu_calloc(1, sizeof *w);
    w->lib = lib;
    w->own = own > 0 ? own : 0;
    w->self = (unsigned)getpid();
    read_line("/proc/self/comm", w->comm, sizeof w->comm);
    nvml_ret (*init)(void) = (nvml_ret(*)(void))sym(lib, "nvmlInit_v2", "nvmlInit");
    w->shutdown = (nvml_ret(*)(void))sym(lib, "nvmlShutdown", NULL);
    w->errstr = (const char *(*)(nvml_ret))sym(lib, "nvmlErrorString", NULL);
    w->list2[0] = (nvml_list2_fn)sym(lib, "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2");
    w->list2[1] = (nvml_list2_fn)sym(lib, "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2");
    if (!w->list2[0])
        w->list1[0] = (nvml_list1_fn)sym(lib, "nvmlDeviceGetComputeRunningProcesses", NULL);
    if (!w->list2[1])
        w->list1[1] = (nvml_list1_fn)sym(lib, "nvmlDeviceGetGraphicsRunningProcesses", NULL);
    w->util = (nvml_util_fn)sym(lib, "nvmlDeviceGetProcessUtilization", NULL);
    nvml_ret (*by_bus)(const char *, nvml_dev *) =
        (nvml_ret(*)(const char *, nvml_dev *))sym(lib, "nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleByPciBusId");
    nvml_ret (*by_index)(unsigned, nvml_dev *) =
        (nvml_ret(*)(unsigned, nvml_dev *))sym(lib, "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex");
    nvml_ret (*count)(unsigned *) = (nvml_ret(*)(unsigned *))sym(lib, "nvmlDeviceGetCount_v2", "nvmlDeviceGetCount");
    if (!init || !w->shutdown || !by_index || !count || (!w->list2[0] && !w->list1[0])) {
        fu_errmsg_set(em, FU_ENOSYS, "NVML (libnvidia-ml.so.1) lacks the functions needed to list a GPU's processes");
        dlclose(lib);
        free(w);
        return NULL;
    }
    nvml_ret r = init();
    if (r != NVML_OK) {
        fu_errmsg_set(em, FU_EIO, "NVML cannot start: %s (error %d)", w->errstr ? w->errstr(r) : "?", r);
        dlclose(lib);
        free(w);
        return NULL;
    }
    char bus[64] = "";
    if (gpu >= 0 && by_bus && cuda_bus_id(gpu, bus, (int)sizeof bus) && by_bus(bus, &w->dev[0]) == NVML_OK) {
        w->n_dev = 1;
        snprintf(w->what, sizeof w->what, "GPU %d (PCI %s)", gpu, bus);
    } else if (gpu >= 0 && (r = by_index((unsigned)gpu, &w->dev[0])) == NVML_OK) {
        w->n_dev = 1;
        snprintf(w->what, sizeof w->what, "GPU %d (NVML index %d)", gpu, gpu);
    } else if (gpu < 0) {
        unsigned n = 0;
        if ((r = count(&n)) == NVML_OK)
            for (unsigned i = 0; i < n && w->n_dev < PEER_GPUWATCH_MAX_GPUS; i++)
                if (by_index(i, &w->dev[w->n_dev]) == NVML_OK)
                    w->n_dev++;
        snprintf(w->what, sizeof w->what, "%d GPU%s", w->n_dev, w->n_dev == 1 ? "" : "s");
    }
    if (w->n_dev == 0) {
        if (gpu >= 0)
            fu_errmsg_set(em, FU_ENOTFOUND, "NVML does not know CUDA's GPU %d%s%s", gpu, bus[0] ? " at PCI " : "", bus);
        else
            fu_errmsg_set(em, FU_ENOTFOUND, "NVML finds no GPU on this machine");
        peer_gpuwatch_destroy(&w);
        return NULL;
    }
    return w;
}

void peer_gpuwatch_destroy(peer_gpuwatch_t **w_p)
{
    if (!w_p || !*w_p)
        return;
    peer_gpuwatch_t *w = *w_p;
    w->shutdown();
    dlclose(w->lib);
    free(w);
    *w_p = NULL;
}

const char *peer_gpuwatch_describe(const peer_gpuwatch_t *w)
{
    return w ? w->what : "no GPU";
}

/* ---- one look ---------------------------------------------------------------------------------- */

static struct gw_proc *proc_add(peer_gpuwatch_t *w, int *n, unsigned pid)
{
    for (int i = 0; i < *n; i++)
        if (w->procs[i].pid == pid)
            return &w->procs[i];
    if (*n >= PEER_GPUWATCH_MAX_PROCS)
        return NULL;
    struct gw_proc *p = &w->procs[(*n)++];
    memset(p, 0, sizeof *p);
    p->pid = pid;
    return p;
}

/* Adds device d's compute (kind 0) or graphics (kind 1) processes. *more: NVML had more than fit. */
static nvml_ret list(peer_gpuwatch_t *w, int kind, nvml_dev d, int *n, bool *more)
{
    unsigned cnt = PEER_GPUWATCH_MAX_PROCS;
    nvml_ret r;
    if (w->list2[kind]) {
        r = w->list2[kind](d, &cnt, w->buf);
    } else if (w->list1[kind]) {
        r = w->list1[kind](d, &cnt, w->buf1);
        for (unsigned i = 0; r == NVML_OK && i < cnt && i < PEER_GPUWATCH_MAX_PROCS; i++)
            w->buf[i].pid = w->buf1[i].pid;
    } else {
        return NVML_OK; /* no graphics list in this NVML */
    }
    if (r == NVML_E_INSUFFICIENT) {
        *more = true;
        return NVML_OK;
    }
    if (r != NVML_OK)
        return r;
    for (unsigned i = 0; i < cnt && i < PEER_GPUWATCH_MAX_PROCS; i++) {
        struct gw_proc *p = proc_add(w, n, w->buf[i].pid);
        if (!p) {
            *more = true;
            break;
        }
        if (kind == 0)
            p->compute = true;
        else
            p->graphics = true;
    }
    return NVML_OK;
}

/* NVML's sample clock: microseconds of the wall clock, a second ago. */
static unsigned long long util_since(void)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (unsigned long long)tv.tv_sec * 1000000ull + (unsigned long long)tv.tv_usec - 1000000ull;
}

/* Marks the graphics processes of device k whose SM use reached PEER_GPUWATCH_GRAPHICS_BUSY in the
 * samples NVML took since the previous look. */
static void mark_busy(peer_gpuwatch_t *w, int k, int n)
{
    unsigned cnt = GW_UTIL_SAMPLES;
    if (!w->util)
        return;
    if (!w->util_seen[k])
        w->util_seen[k] = util_since();
    nvml_ret r = w->util(w->dev[k], w->ubuf, &cnt, w->util_seen[k]);
    if (r == NVML_E_INSUFFICIENT)
        w->util_seen[k] = util_since(); /* too many at once: from a second ago next time */
    if (r != NVML_OK)
        return; /* not supported, or no sample since the previous look */
    for (unsigned i = 0; i < cnt && i < GW_UTIL_SAMPLES; i++) {
        const nvml_util *u = &w->ubuf[i];
        if (u->time_us > w->util_seen[k])
            w->util_seen[k] = u->time_us;
        if (u->sm < PEER_GPUWATCH_GRAPHICS_BUSY)
            continue;
        for (int j = 0; j < n; j++)
            if (w->procs[j].pid == u->pid)
                w->procs[j].busy = true;
    }
}

fu_err peer_gpuwatch_sample(peer_gpuwatch_t *w, int *listed, int *others)
{
    *listed = *others = 0;
    if (!w)
        return FU_EINVAL;
    int n = 0;
    bool more = false;
    for (int k = 0; k < w->n_dev; k++) {
        nvml_ret r = list(w, 0, w->dev[k], &n, &more);
        if (r == NVML_OK)
            r = list(w, 1, w->dev[k], &n, &more);
        if (r != NVML_OK) {
            FU_DEBUG("peer", "NVML cannot list the processes of %s: %s (error %d)", w->what,
                     w->errstr ? w->errstr(r) : "?", r);
            return FU_EIO;
        }
        bool graphics_only = false;
        for (int j = 0; j < n; j++)
            graphics_only = graphics_only || (w->procs[j].graphics && !w->procs[j].compute);
        if (graphics_only)
            mark_busy(w, k, n);
    }
    size_t m = 0;
    for (int j = 0; j < n; j++) {
        const struct gw_proc *p = &w->procs[j];
        if (!p->compute && !p->busy)
            continue;
        char path[64], comm[32];
        snprintf(path, sizeof path, "/proc/%u/comm", p->pid);
        read_line(path, comm, sizeof comm);
        w->counted[m++] = (peer_gpuwatch_proc){.pid = p->pid, .fusion = p->pid != w->self && w->comm[0] &&
                                                                           strcmp(comm, w->comm) == 0};
    }
    *listed = n;
    *others = peer_gpuwatch_count_others(w->counted, m, w->self, w->own);
    if (more && *others == 0) /* more processes than fit: surely not all ours */
        *others = PEER_GPUWATCH_MAX_PROCS;
    return FU_OK;
}
