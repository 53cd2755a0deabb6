/* kern_priority: compute threads as guests of the machine (see kern_priority.h). */
#define _GNU_SOURCE
#include "kern_priority.h"

#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

static pid_t self_tid(void)
{
    return (pid_t)syscall(SYS_gettid);
}

/* One thread. On Linux sched_setscheduler and setpriority act on the thread whose id is given. */
static fu_err set_tid(pid_t tid, kern_priority want, kern_priority *got)
{
    *got = KERN_PRIORITY_NORMAL;
    if (want == KERN_PRIORITY_NORMAL)
        return FU_OK;
    if (want == KERN_PRIORITY_IDLE) {
        struct sched_param sp = {.sched_priority = 0};
        if (sched_setscheduler(tid, SCHED_IDLE, &sp) == 0) {
            *got = KERN_PRIORITY_IDLE;
            return FU_OK;
        }
    }
    if (setpriority(PRIO_PROCESS, (id_t)tid, KERN_PRIORITY_NICE_LOW) == 0) {
        *got = KERN_PRIORITY_LOW;
        return FU_OK;
    }
    return errno == ESRCH ? FU_ENOTFOUND : FU_EPERM;
}

fu_err kern_priority_set_self(kern_priority want, kern_priority *got)
{
    kern_priority g = KERN_PRIORITY_NORMAL;
    fu_err rc = set_tid(self_tid(), want, &g);
    if (got)
        *got = g;
    return rc;
}

fu_err kern_priority_set_others(kern_priority want, kern_priority *got)
{
    if (got)
        *got = want;
    if (want == KERN_PRIORITY_NORMAL)
        return FU_OK;
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return FU_EIO;
    pid_t me = self_tid();
    kern_priority lowest = want;
    size_t moved = 0, tried = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char *end;
        long tid = strtol(e->d_name, &end, 10);
        if (*end || tid <= 0 || tid == me)
            continue;
        kern_priority g;
        fu_err rc = set_tid((pid_t)tid, want, &g);
        if (rc == FU_ENOTFOUND) /* it exited meanwhile */
            continue;
        tried++;
        if (rc == FU_OK) {
            moved++;
            if (g < lowest) /* LOW obtained where IDLE was wanted */
                lowest = g;
        }
    }
    closedir(d);
    if (got)
        *got = lowest;
    return tried && !moved ? FU_EPERM : FU_OK;
}

kern_priority kern_priority_of(int tid)
{
    pid_t t = tid ? (pid_t)tid : self_tid();
    if (sched_getscheduler(t) == SCHED_IDLE)
        return KERN_PRIORITY_IDLE;
    errno = 0;
    int nice = getpriority(PRIO_PROCESS, (id_t)t);
    return errno == 0 && nice >= KERN_PRIORITY_NICE_LOW ? KERN_PRIORITY_LOW : KERN_PRIORITY_NORMAL;
}

static const char *const NAMES[] = {"normal", "low", "idle"};

const char *kern_priority_name(kern_priority p)
{
    return (unsigned)p < sizeof NAMES / sizeof NAMES[0] ? NAMES[p] : "?";
}

fu_err kern_priority_parse(const char *name, kern_priority *out)
{
    for (unsigned i = 0; name && i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (strcmp(name, NAMES[i]) == 0) {
            *out = (kern_priority)i;
            return FU_OK;
        }
    return FU_EINVAL;
}
