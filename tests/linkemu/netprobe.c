/* netprobe: what a link emulated by fusion-linkemu does, measured from its two ends.
 *
 *   netprobe serve PORT            UDP echo on PORT; TCP on PORT: receives one bulk transfer and
 *                                  prints "goodput_mbit X" (over its last three quarters)
 *   netprobe rtt HOST PORT N       N UDP round trips, 100 ms apart: "rtt_ms MEDIAN MIN MAX"
 *   netprobe bulk HOST PORT MB     sends MB megabytes over TCP
 *
 * Exits 1 on a socket error, and `serve` after 60 s without a transfer. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static struct sockaddr_in addr_of(const char *host, int port)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (!host)
        a.sin_addr.s_addr = htonl(INADDR_ANY);
    else if (inet_pton(AF_INET, host, &a.sin_addr) != 1) {
        fprintf(stderr, "netprobe: bad address %s\n", host);
        exit(2);
    }
    return a;
}

static int serve(int port)
{
    struct sockaddr_in a = addr_of(NULL, port);
    int u = socket(AF_INET, SOCK_DGRAM, 0), l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (u < 0 || l < 0 || bind(u, (struct sockaddr *)&a, sizeof a) || bind(l, (struct sockaddr *)&a, sizeof a) ||
        listen(l, 1)) {
        perror("netprobe: serve");
        return 1;
    }
    double end = now_s() + 60;
    static char buf[1 << 16];
    for (;;) {
        struct pollfd p[2] = {{u, POLLIN, 0}, {l, POLLIN, 0}};
        if (now_s() > end || poll(p, 2, 500) < 0)
            return 1;
        if (p[0].revents & POLLIN) {
            struct sockaddr_in from;
            socklen_t fl = sizeof from;
            ssize_t n = recvfrom(u, buf, sizeof buf, 0, (struct sockaddr *)&from, &fl);
            if (n > 0)
                (void)sendto(u, buf, (size_t)n, 0, (struct sockaddr *)&from, fl);
        }
        if (p[1].revents & POLLIN)
            break;
    }
    int c = accept(l, NULL, NULL);
    if (c < 0)
        return 1;
    size_t cap = 1 << 16, n = 0;
    double *t = malloc(cap * sizeof *t), *b = malloc(cap * sizeof *b), total = 0;
    for (;;) {
        ssize_t r = recv(c, buf, sizeof buf, 0);
        if (r <= 0)
            break;
        total += (double)r;
        if (n == cap) {
            cap *= 2;
            t = realloc(t, cap * sizeof *t);
            b = realloc(b, cap * sizeof *b);
        }
        t[n] = now_s();
        b[n++] = total;
    }
    close(c);
    close(l);
    close(u);
    size_t q = n / 4;
    if (n >= 8)
        printf("goodput_mbit %.3f bytes %.0f\n", (b[n - 1] - b[q]) * 8 / (t[n - 1] - t[q]) / 1e6, total);
    free(t);
    free(b);
    return n >= 8 ? 0 : 1;
}

static int rtt(const char *host, int port, int count)
{
    struct sockaddr_in a = addr_of(host, port);
    int u = socket(AF_INET, SOCK_DGRAM, 0);
    if (u < 0 || connect(u, (struct sockaddr *)&a, sizeof a))
        return 1;
    double *r = calloc((size_t)count, sizeof *r);
    int got = 0;
    for (int i = 0; i < count; i++) {
        char x = (char)i, y;
        double t0 = now_s();
        if (send(u, &x, 1, 0) != 1)
            break;
        struct pollfd p = {u, POLLIN, 0};
        if (poll(&p, 1, 5000) == 1 && recv(u, &y, 1, 0) == 1 && y == x)
            r[got++] = (now_s() - t0) * 1000.0;
        usleep(100 * 1000);
    }
    close(u);
    if (got > 0) {
        qsort(r, (size_t)got, sizeof *r, cmp_double);
        printf("rtt_ms %.3f %.3f %.3f answered %d of %d\n", r[got / 2], r[0], r[got - 1], got, count);
    }
    free(r);
    return got > 0 ? 0 : 1;
}

static int bulk(const char *host, int port, double mb)
{
    struct sockaddr_in a = addr_of(host, port);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a)) {
        perror("netprobe: bulk");
        return 1;
    }
    static char buf[1 << 16];
    for (double left = mb * 1e6; left > 0; left -= sizeof buf)
        if (send(s, buf, sizeof buf, 0) <= 0)
            return 1;
    close(s);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "serve") == 0)
        return serve(atoi(argv[2]));
    if (argc == 5 && strcmp(argv[1], "rtt") == 0)
        return rtt(argv[2], atoi(argv[3]), atoi(argv[4]));
    if (argc == 5 && strcmp(argv[1], "bulk") == 0)
        return bulk(argv[2], atoi(argv[3]), atof(argv[4]));
    fprintf(stderr, "usage: netprobe serve PORT | rtt HOST PORT N | bulk HOST PORT MB\n");
    return 2;
}
