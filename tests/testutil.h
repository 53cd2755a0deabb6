/* Helpers for tests: run a fusion program as a real process and capture what it prints, find the
 * build's programs, make scratch directories. Header-only so each test executable stays one file. */
#ifndef FU_TESTUTIL_H
#define FU_TESTUTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

/* Path of a built program ("fusion", "fusion-broker") in FUSION_BIN_DIR; static buffer. */
static inline const char *tu_bin(const char *name)
{
    static char path[4096];
    const char *dir = getenv("FUSION_BIN_DIR");
    snprintf(path, sizeof path, "%s/%s", dir ? dir : "../bin", name);
    return path;
}

/* Runs a shell command line, captures stdout+stderr into *out (caller frees), returns the exit code
 * (128+signal if it was killed, -1 if it could not be started). */
static inline int tu_sh(char **out, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[8300];
    snprintf(full, sizeof full, "(%s) 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p)
        return -1;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (cap - len < 1024) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
    }
    if (buf)
        buf[len] = '\0';
    int st = pclose(p);
    if (out)
        *out = buf;
    else
        free(buf);
    if (st == -1)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Competing load for tests that assert on timing (docs/TESTING.md): n busy-loop processes, one per
 * core by default (n = 0), started by the test and stopped by tu_load_stop (they also die with the
 * test: PR_SET_PDEATHSIG). At most 16. */
#define TU_LOAD_MAX 16
static pid_t tu_load_pids[TU_LOAD_MAX];

static inline int tu_load_start(int n)
{
    if (n <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
    }
    if (n > TU_LOAD_MAX)
        n = TU_LOAD_MAX;
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            volatile unsigned long x = 0;
            for (;;)
                x++;
        }
        tu_load_pids[i] = pid > 0 ? pid : 0;
    }
    return n;
}

static inline void tu_load_stop(void)
{
    for (int i = 0; i < TU_LOAD_MAX; i++)
        if (tu_load_pids[i] > 0) {
            kill(tu_load_pids[i], SIGKILL);
            waitpid(tu_load_pids[i], NULL, 0);
            tu_load_pids[i] = 0;
        }
}

/* Makes a fresh scratch directory under TMPDIR; returns its path (caller frees). */
static inline char *tu_tmpdir(const char *tag)
{
    const char *base = getenv("TMPDIR");
    char tmpl[4096];
    snprintf(tmpl, sizeof tmpl, "%s/fusion-%s-XXXXXX", base ? base : "/tmp", tag);
    char *d = mkdtemp(tmpl);
    return d ? strdup(d) : NULL;
}

#endif
