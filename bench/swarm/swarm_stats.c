/* What the swarm measures outside itself: the broker process (/proc), its /metrics, its store file
 * and its log. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "swarm_stats.h"

double swarm_proc_cpu_s(int pid)
{
    char path[64], buf[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command may hold spaces */
    if (!p)
        return -1;
    unsigned long utime = 0, stime = 0;
    /* fields after ')': state(3) ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime(14) stime(15) */
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &utime, &stime) != 2)
        return -1;
    return (double)(utime + stime) / (double)sysconf(_SC_CLK_TCK);
}

double swarm_proc_rss_mib(int pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    double kib = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0)
            kib = strtod(line + 6, NULL);
    fclose(f);
    return kib < 0 ? -1 : kib / 1024.0;
}

char *swarm_http_get(int port, const char *path)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return NULL;
    struct timeval tv = {.tv_sec = 5};
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    char req[256];
    int rl = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 || write(fd, req, (size_t)rl) != rl) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) {
            cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb)
                break;
            buf = nb;
        }
        ssize_t r = read(fd, buf + len, cap - len - 1);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    buf[len] = '\0';
    char *body = strstr(buf, "\r\n\r\n");
    if (!body) {
        free(buf);
        return NULL;
    }
    memmove(buf, body + 4, strlen(body + 4) + 1);
    return buf;
}

double swarm_metric(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text ? text : ""; (p = strstr(p, name)) != NULL; p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

double swarm_store_mib(const char *db)
{
    char wal[4200];
    snprintf(wal, sizeof wal, "%s-wal", db);
    struct stat a, b;
    double total = 0;
    if (stat(db, &a) == 0)
        total += (double)a.st_size;
    if (stat(wal, &b) == 0)
        total += (double)b.st_size;
    return total / (1024.0 * 1024.0);
}

void swarm_log_plans(const char *log, swarm_plan_log *pl)
{
    FILE *f = fopen(log, "r");
    if (!f)
        return;
    char line[4096];
    static const char tag[] = " candidates in ", stag[] = "; the search ", ctag[] = " off the loop in ";
    char (*seen)[17] = NULL; /* the jobs planned so far */
    size_t n_seen = 0;
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, tag), *q = strstr(line, stag), *job = strstr(line, "] job "), *c;
        if ((c = strstr(line, ctag)) && strstr(line, " is cut again for ")) {
            swarm_samples_add(&pl->cut, strtod(c + sizeof ctag - 1, NULL));
            continue;
        }
        if (!p || !job || !strstr(line, " planned over "))
            continue;
        double ms = strtod(p + sizeof tag - 1, NULL);
        swarm_samples_add(&pl->plan, ms);
        if (q)
            swarm_samples_add(&pl->search, strtod(q + sizeof stag - 1, NULL));
        char id[17];
        snprintf(id, sizeof id, "%.16s", job + 6);
        size_t k = 0;
        while (k < n_seen && strcmp(seen[k], id) != 0)
            k++;
        swarm_samples_add(k < n_seen ? &pl->again : &pl->first, ms);
        if (k == n_seen) {
            seen = realloc(seen, (n_seen + 1) * sizeof *seen);
            if (!seen)
                abort();
            memcpy(seen[n_seen++], id, sizeof id);
        }
    }
    free(seen);
    fclose(f);
}

void swarm_plan_log_free(swarm_plan_log *pl)
{
    swarm_samples_free(&pl->plan);
    swarm_samples_free(&pl->search);
    swarm_samples_free(&pl->first);
    swarm_samples_free(&pl->again);
    swarm_samples_free(&pl->cut);
}
