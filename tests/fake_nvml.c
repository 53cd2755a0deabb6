/* A stand-in for NVML (libnvidia-ml.so.1) for test_peer_gpuwatch: the few functions peer_gpuwatch
 * loads, with one GPU whose processes are read, at each call, from the file named by
 * $FAKE_NVML_PROCS: lines "c PID" (a compute process) and "g PID SM" (a graphics process using SM %
 * of the SMs). $FAKE_NVML_INIT_FAILS makes nvmlInit fail. Built as libnvidia-ml.so.1 in its own
 * folder, found through LD_LIBRARY_PATH. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

typedef struct {
    unsigned int pid;
    unsigned long long used_memory;
    unsigned int gpu_instance, compute_instance;
} fake_proc; /* nvmlProcessInfo_v2_t */
typedef struct {
    unsigned int pid;
    unsigned long long time_us;
    unsigned int sm, mem, enc, dec;
} fake_util; /* nvmlProcessUtilizationSample_t */

#define FAKE_MAX 1024
#define FAKE_DEV ((void *)0x1)

/* The file's entries of kind k ('c' or 'g'): pids and SM percents; how many. */
static int fake_read(char k, unsigned *pid, unsigned *sm)
{
    const char *path = getenv("FAKE_NVML_PROCS");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f)
        return 0;
    int n = 0;
    char kind;
    unsigned p, s;
    char line[128];
    while (n < FAKE_MAX && fgets(line, sizeof line, f)) {
        s = 0;
        if (sscanf(line, " %c %u %u", &kind, &p, &s) >= 2 && kind == k) {
            pid[n] = p;
            sm[n++] = s;
        }
    }
    fclose(f);
    return n;
}

int nvmlInit_v2(void);
int nvmlInit_v2(void)
{
    return getenv("FAKE_NVML_INIT_FAILS") ? 9 : 0; /* NVML_ERROR_DRIVER_NOT_LOADED */
}

int nvmlShutdown(void);
int nvmlShutdown(void)
{
    return 0;
}

const char *nvmlErrorString(int r);
const char *nvmlErrorString(int r)
{
    return r == 9 ? "Driver Not Loaded" : "fake error";
}

int nvmlDeviceGetCount_v2(unsigned *n);
int nvmlDeviceGetCount_v2(unsigned *n)
{
    *n = 1;
    return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **dev);
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **dev)
{
    if (i != 0)
        return 2; /* NVML_ERROR_INVALID_ARGUMENT */
    *dev = FAKE_DEV;
    return 0;
}

int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **dev);
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **dev)
{
    (void)bus;
    (void)dev;
    return 6; /* NVML_ERROR_NOT_FOUND: the tests find GPU 0 by its index */
}

static int fake_list(char k, void *dev, unsigned *count, fake_proc *out)
{
    static unsigned pid[FAKE_MAX], sm[FAKE_MAX];
    if (dev != FAKE_DEV)
        return 2;
    int n = fake_read(k, pid, sm);
    if ((unsigned)n > *count) {
        *count = (unsigned)n;
        return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    }
    for (int i = 0; i < n; i++)
        out[i] = (fake_proc){.pid = pid[i], .used_memory = 1u << 20, .gpu_instance = ~0u, .compute_instance = ~0u};
    *count = (unsigned)n;
    return 0;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *dev, unsigned *count, fake_proc *out);
int nvmlDeviceGetComputeRunningProcesses_v3(void *dev, unsigned *count, fake_proc *out)
{
    return fake_list('c', dev, count, out);
}

int nvmlDeviceGetGraphicsRunningProcesses_v3(void *dev, unsigned *count, fake_proc *out);
int nvmlDeviceGetGraphicsRunningProcesses_v3(void *dev, unsigned *count, fake_proc *out)
{
    return fake_list('g', dev, count, out);
}

int nvmlDeviceGetProcessUtilization(void *dev, fake_util *out, unsigned *count, unsigned long long since);
int nvmlDeviceGetProcessUtilization(void *dev, fake_util *out, unsigned *count, unsigned long long since)
{
    static unsigned pid[FAKE_MAX], sm[FAKE_MAX];
    if (dev != FAKE_DEV)
        return 2;
    int n = fake_read('g', pid, sm);
    struct timeval tv;
    gettimeofday(&tv, NULL);
    unsigned long long now = (unsigned long long)tv.tv_sec * 1000000ull + (unsigned long long)tv.tv_usec;
    if (n == 0 || now <= since)
        return 6; /* NVML_ERROR_NOT_FOUND: no sample since `since` */
    if ((unsigned)n > *count) {
        *count = (unsigned)n;
        return 7;
    }
    for (int i = 0; i < n; i++)
        out[i] = (fake_util){.pid = pid[i], .time_us = now, .sm = sm[i]};
    *count = (unsigned)n;
    return 0;
}
