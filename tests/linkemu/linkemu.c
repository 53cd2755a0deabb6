/* fusion-linkemu: home internet links between network namespaces, for tests and benchmarks (issue
 * "Home links"; netem is not in this kernel, so the delay is done here, in user space).
 *
 *   fusion-linkemu --tag T --host NAME:ADDR:UP_MBIT:DOWN_MBIT:DELAY_MS[:JITTER_MS] ... [options]
 *
 * Each host gets a network namespace T-NAME (made here, removed at exit) holding one TUN interface
 * with ADDR/24. The emulator is the router between them: it reads every IPv4 packet a host sends,
 * passes it through the sender's uplink (UP_MBIT, then DELAY_MS one way) and the receiver's downlink
 * (DOWN_MBIT, then its DELAY_MS, plus up to JITTER_MS), and writes it into the receiver's interface.
 * So two hosts with delay D each see a round trip of 4·D (D each way on each access link) and the
 * bandwidth of the narrower link. Each link is a FIFO: a packet leaves when the one before it has
 * been serialised; jitter never reorders a link. A link holds at most --queue-kib of packets (tail
 * drop, as a home router does); TCP then sees loss.
 *
 *   --stall P:SECONDS   each link stalls (holds everything) for SECONDS, a P share of the time on
 *                       average (Poisson starts; "0.01:2" is 1% of the time in 2 s stalls)
 *   --duration S        exit after S seconds (default 600): bounded in time
 *   --max-mib N         exit after forwarding N MiB (default 4096): bounded in traffic
 *   --seed N            the jitter and stall draws
 *   --ready FILE        written once the namespaces are up
 *
 * Runs as root (namespaces, TUN). Touches only the namespaces it makes. SIGTERM/SIGINT end it. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_HOSTS 16
#define MTU       1500
#define PKT_MAX   2048

typedef struct pkt {
    struct pkt *next;
    double at;      /* when it leaves this stage (seconds, monotonic) */
    int dst;        /* receiving host */
    size_t len;
    uint8_t data[];
} pkt;

/* One direction of a host's access link: a FIFO of packets in flight and what it holds. */
typedef struct {
    double bps;             /* bits per second */
    double busy_until;      /* the serialiser is free from then */
    double last_out;        /* the last packet's exit: no reordering */
    pkt *head, *tail;       /* packets on the link, in exit order */
    size_t bytes;           /* held */
    double stall_until;     /* a stall in progress ends then */
    double next_stall;      /* the next stall starts then */
    uint64_t dropped, sent;
} link_dir;

typedef struct {
    char name[32];
    char ns[64];
    char ifname[IFNAMSIZ];
    uint32_t addr;          /* host byte order */
    double delay, jitter;   /* seconds, one way on this host's access link */
    int fd;
    link_dir up, down;
} host;

static host hosts[MAX_HOSTS];
static int n_hosts;
static char tag[24] = "fle";
static double stall_share = 0, stall_s = 0, queue_bytes = 256 * 1024;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static volatile sig_atomic_t stop;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double uniform(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}

/* The next stall start after t: exponential gaps whose stalls cover stall_share of the time. */
static double next_stall_after(double t)
{
    if (stall_share <= 0 || stall_s <= 0)
        return INFINITY;
    double mean_gap = stall_s / stall_share - stall_s; /* stalls then cover stall_share of the time */
    return t - mean_gap * log(1.0 - uniform());
}

static void on_signal(int sig)
{
    (void)sig;
    stop = 1;
}

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    return rc == 0 ? 0 : -1;
}

static void teardown(void)
{
    for (int i = 0; i < n_hosts; i++) {
        if (hosts[i].fd >= 0)
            close(hosts[i].fd);
        (void)sh("ip netns del '%s' 2>/dev/null", hosts[i].ns);
    }
}

/* Makes host h's namespace and TUN interface (created here, moved there: the fd stays ours). */
static int host_up(host *h)
{
    h->fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (h->fd < 0) {
        fprintf(stderr, "linkemu: /dev/net/tun: %s\n", strerror(errno));
        return -1;
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", h->ifname);
    if (ioctl(h->fd, TUNSETIFF, &ifr) != 0) {
        fprintf(stderr, "linkemu: TUNSETIFF %s: %s\n", h->ifname, strerror(errno));
        return -1;
    }
    struct in_addr a = {htonl(h->addr)};
    (void)sh("ip netns del '%s' 2>/dev/null", h->ns);
    if (sh("ip netns add '%s'", h->ns) || sh("ip link set '%s' netns '%s'", h->ifname, h->ns) ||
        sh("ip -n '%s' link set lo up", h->ns) || sh("ip -n '%s' link set '%s' mtu %d up", h->ns, h->ifname, MTU) ||
        sh("ip -n '%s' addr add %s/24 dev '%s'", h->ns, inet_ntoa(a), h->ifname)) {
        fprintf(stderr, "linkemu: cannot set up namespace %s\n", h->ns);
        return -1;
    }
    return 0;
}

static int host_of_addr(uint32_t a)
{
    for (int i = 0; i < n_hosts; i++)
        if (hosts[i].addr == a)
            return i;
    return -1;
}

static void push(link_dir *l, pkt *p)
{
    p->next = NULL;
    if (l->tail)
        l->tail->next = p;
    else
        l->head = p;
    l->tail = p;
    l->bytes += p->len;
}

static pkt *pop(link_dir *l)
{
    pkt *p = l->head;
    l->head = p->next;
    if (!l->head)
        l->tail = NULL;
    l->bytes -= p->len;
    return p;
}

/* Puts p on link l at time t: it leaves after the packets before it are serialised (and any stall
 * is over), plus `delay` (and jitter), never before the one ahead. False: the link is full. */
static bool enqueue(link_dir *l, pkt *p, double t, double delay, double jitter)
{
    if (l->bytes + p->len > queue_bytes) {
        l->dropped++;
        return false;
    }
    while (t >= l->next_stall) { /* a stall began: everything waits until it ends */
        l->stall_until = l->next_stall + stall_s;
        l->next_stall = next_stall_after(l->stall_until);
    }
    double start = fmax(fmax(t, l->busy_until), l->stall_until > t ? l->stall_until : 0);
    l->busy_until = start + (double)p->len * 8.0 / l->bps;
    p->at = fmax(l->busy_until + delay + (jitter > 0 ? jitter * uniform() : 0), l->last_out);
    l->last_out = p->at;
    push(l, p);
    l->sent++;
    return true;
}

static bool parse_host(const char *arg, host *h)
{
    char name[32], addr[32];
    double up, down, delay, jitter = 0;
    int n = sscanf(arg, "%31[^:]:%31[^:]:%lf:%lf:%lf:%lf", name, addr, &up, &down, &delay, &jitter);
    struct in_addr a;
    if (n < 5 || !inet_aton(addr, &a) || !(up > 0) || !(down > 0) || delay < 0 || jitter < 0)
        return false;
    memset(h, 0, sizeof *h);
    snprintf(h->name, sizeof h->name, "%s", name);
    h->addr = ntohl(a.s_addr);
    h->up.bps = up * 1e6;
    h->down.bps = down * 1e6;
    h->delay = delay / 1000.0;
    h->jitter = jitter / 1000.0;
    h->fd = -1;
    return true;
}

int main(int argc, char **argv)
{
    double duration = 600, max_mib = 4096;
    const char *ready = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "linkemu: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (strcmp(a, "--host") == 0) {
            if (n_hosts == MAX_HOSTS || !parse_host(v, &hosts[n_hosts])) {
                fprintf(stderr, "linkemu: bad --host '%s' (NAME:ADDR:UP_MBIT:DOWN_MBIT:DELAY_MS[:JITTER_MS])\n", v);
                return 2;
            }
            n_hosts++;
        } else if (strcmp(a, "--tag") == 0) {
            snprintf(tag, sizeof tag, "%.8s", v);
        } else if (strcmp(a, "--stall") == 0) {
            if (sscanf(v, "%lf:%lf", &stall_share, &stall_s) != 2 || stall_share < 0 || stall_share >= 1 ||
                stall_s < 0) {
                fprintf(stderr, "linkemu: bad --stall '%s' (SHARE:SECONDS)\n", v);
                return 2;
            }
        } else if (strcmp(a, "--duration") == 0) {
            duration = atof(v);
        } else if (strcmp(a, "--max-mib") == 0) {
            max_mib = atof(v);
        } else if (strcmp(a, "--queue-kib") == 0) {
            queue_bytes = atof(v) * 1024.0;
        } else if (strcmp(a, "--seed") == 0) {
            rng_state ^= strtoull(v, NULL, 10) * 0xD1B54A32D192ED03ull;
        } else if (strcmp(a, "--ready") == 0) {
            ready = v;
        } else {
            fprintf(stderr, "linkemu: unknown option %s\n", a);
            return 2;
        }
    }
    if (n_hosts < 2 || !(duration > 0) || !(max_mib > 0) || !(queue_bytes >= PKT_MAX)) {
        fprintf(stderr, "usage: fusion-linkemu --tag T --host NAME:ADDR:UP:DOWN:DELAY_MS[:JITTER_MS] (two or more) "
                        "[--stall SHARE:SECONDS] [--duration S] [--max-mib N] [--queue-kib K] [--seed N] [--ready F]\n");
        return 2;
    }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    signal(SIGPIPE, SIG_IGN);
    double t0 = now_s();
    for (int i = 0; i < n_hosts; i++) {
        host *h = &hosts[i];
        char name[sizeof h->name];
        memcpy(name, h->name, sizeof name);
        snprintf(h->ns, sizeof h->ns, "%.20s-%.31s", tag, name);
        snprintf(h->ifname, sizeof h->ifname, "%.8s%.6s", tag, name);
        h->up.next_stall = next_stall_after(t0);
        h->down.next_stall = next_stall_after(t0);
        h->up.stall_until = h->down.stall_until = 0;
        for (int k = 0; k < i; k++)
            if (hosts[k].addr == h->addr || strcmp(hosts[k].name, h->name) == 0) {
                fprintf(stderr, "linkemu: host %s or its address given twice\n", h->name);
                return 2;
            }
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    int rc = ep < 0 ? 1 : 0;
    for (int i = 0; rc == 0 && i < n_hosts; i++) {
        if (host_up(&hosts[i]) != 0) {
            rc = 1;
            break;
        }
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, hosts[i].fd, &ev) != 0)
            rc = 1;
    }
    if (rc == 0 && ready) {
        FILE *f = fopen(ready, "w");
        if (f) {
            fprintf(f, "ready\n");
            fclose(f);
        }
    }
    uint64_t forwarded = 0;
    uint8_t buf[PKT_MAX];
    while (rc == 0 && !stop) {
        double t = now_s();
        if (t - t0 > duration || (double)forwarded > max_mib * 1048576.0)
            break;
        /* packets whose time came: uplink -> the receiver's downlink -> its interface */
        double next = t + 0.05;
        for (int i = 0; i < n_hosts; i++) { /* every uplink first: a downlink of any host may get packets */
            host *h = &hosts[i];
            while (h->up.head && h->up.head->at <= t) {
                pkt *p = pop(&h->up);
                host *d = &hosts[p->dst];
                if (!enqueue(&d->down, p, p->at, d->delay, d->jitter))
                    free(p);
            }
        }
        for (int i = 0; i < n_hosts; i++) {
            host *h = &hosts[i];
            while (h->down.head && h->down.head->at <= t) {
                pkt *p = pop(&h->down);
                if (write(h->fd, p->data, p->len) == (ssize_t)p->len)
                    forwarded += p->len;
                free(p);
            }
            if (h->up.head)
                next = fmin(next, h->up.head->at);
            if (h->down.head)
                next = fmin(next, h->down.head->at);
        }
        double wait = fmin(0.05, fmax(0.0, next - now_s())); /* to the microsecond: no ms rounding per hop */
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(wait * 1e9)};
        struct epoll_event evs[MAX_HOSTS];
        int n = epoll_pwait2(ep, evs, MAX_HOSTS, &ts, NULL);
        if (n < 0 && errno != EINTR)
            rc = 1;
        for (int e = 0; e < n; e++) {
            host *h = &hosts[evs[e].data.u32];
            for (int burst = 0; burst < 64; burst++) {
                ssize_t len = read(h->fd, buf, sizeof buf);
                if (len <= 0)
                    break;
                if (len < 20 || (buf[0] >> 4) != 4)
                    continue; /* IPv4 only (IPv6 neighbour chatter is dropped) */
                uint32_t dst = (uint32_t)buf[16] << 24 | (uint32_t)buf[17] << 16 | (uint32_t)buf[18] << 8 | buf[19];
                int di = host_of_addr(dst);
                if (di < 0 || &hosts[di] == h)
                    continue;
                pkt *p = malloc(sizeof *p + (size_t)len);
                if (!p)
                    continue;
                p->dst = di;
                p->len = (size_t)len;
                memcpy(p->data, buf, (size_t)len);
                if (!enqueue(&h->up, p, now_s(), h->delay, h->jitter))
                    free(p);
            }
        }
    }
    for (int i = 0; i < n_hosts; i++) {
        host *h = &hosts[i];
        fprintf(stderr, "linkemu: %s: up %llu packets (%llu dropped), down %llu (%llu dropped)\n", h->name,
                (unsigned long long)h->up.sent, (unsigned long long)h->up.dropped, (unsigned long long)h->down.sent,
                (unsigned long long)h->down.dropped);
        while (h->up.head)
            free(pop(&h->up));
        while (h->down.head)
            free(pop(&h->down));
    }
    teardown();
    return rc;
}
