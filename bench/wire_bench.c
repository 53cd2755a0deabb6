/* bench-wire: tensor frames over loopback TCP through the real wire path (wire_tensor_send ->
 * ZeroMQ -> wire_recv -> wire_tensor_asm_feed), plain and sealed, for 64 KiB, 1 MiB and 16 MiB.
 *   throughput: one thread streams frames to a receiver that assembles (and opens) them; GB/s of
 *               tensor payload, measured from the first send to the last completed frame.
 *   latency:    a frame goes to an echo peer that assembles it and sends it back (sealed links
 *               open and re-seal); median round-trip time.
 * Sender and receiver each have their own ZeroMQ context (own I/O thread), as two peers would. */
#include <malloc.h>
#include <sys/resource.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <zmq.h>

#include "bench.h"
#include "fu_clock.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_seal.h"
#include "wire_socket.h"
#include "wire_tensor.h"

typedef struct {
    wire_seal_t *a, *b; /* sender's and receiver's view of one link */
    wire_keypair_t *ka, *kb;
} link_t;

static void link_make(link_t *L)
{
    L->ka = wire_keypair_generate();
    L->kb = wire_keypair_generate();
    wire_seal_eph_t *ea = wire_seal_eph_new(), *eb = wire_seal_eph_new();
    uint8_t pa[32], pb[32];
    memcpy(pa, wire_seal_eph_public(ea), 32);
    memcpy(pb, wire_seal_eph_public(eb), 32);
    fu_err rc;
    L->a = wire_seal_new(L->ka, wire_keypair_public(L->kb), &ea, pb, &rc);
    L->b = wire_seal_new(L->kb, wire_keypair_public(L->ka), &eb, pa, &rc);
    if (!L->a || !L->b) {
        fprintf(stderr, "bench-wire: seal setup failed\n");
        exit(1);
    }
}

static void link_free(link_t *L)
{
    wire_seal_destroy(&L->a);
    wire_seal_destroy(&L->b);
    wire_keypair_destroy(&L->ka);
    wire_keypair_destroy(&L->kb);
}

static wire_tensor_meta meta_for(size_t bytes, Fusion__MsgType type, uint64_t step)
{
    wire_tensor_meta m = {.type = type,
                          .job_id = 1,
                          .step = step,
                          .micro_batch = 0,
                          .dtype = FUSION__DTYPE__DTYPE_F32,
                          .ndim = 2,
                          .shape = {(int64_t)(bytes / 4 / 1024), 1024}};
    return m;
}

typedef struct {
    void *ctx;
    char endpoint[256];
    wire_seal_t *seal; /* NULL: plain */
    size_t bytes;
    int frames;
    uint8_t *data;
    pthread_barrier_t *go;
} sender_arg;

static void *sender(void *p)
{
    sender_arg *a = p;
    fu_err rc;
    void *s = wire_socket_new(a->ctx, ZMQ_DEALER, &rc);
    int hwm = 100000, to = -1; /* the benchmark measures throughput, not back-pressure timeouts */
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &to, sizeof to);
    zmq_connect(s, a->endpoint);
    uint64_t pseq = 1;
    pthread_barrier_wait(a->go);
    for (int k = 0; k < a->frames; k++) {
        wire_tensor_meta m = meta_for(a->bytes, FUSION__MSG_TYPE__MSG_ACTIVATION, (uint64_t)k);
        rc = wire_tensor_send(s, NULL, 0, a->seal, &m, a->data, a->bytes, 0, &pseq);
        if (rc != FU_OK) {
            fprintf(stderr, "bench-wire: send failed: %s\n", fu_strerror(rc));
            break;
        }
    }
    /* wait for the receiver's "done" before closing, so nothing is cut short */
    wire_counters c = {0};
    wire_msg_t *m = NULL;
    if (wire_recv(s, 0, &c, &m) == FU_OK)
        wire_msg_destroy(&m);
    wire_socket_close(&s);
    return NULL;
}

/* CPU seconds (user + system) used so far by every thread of this process. */
static double cpu_sec(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0)
        return 0.0;
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec * 1e-6;
}

/* Receives `frames` tensors; returns seconds from the start barrier to the last one, and in *cpu
 * the CPU seconds the whole process (sender, receiver, both I/O threads, sealing workers) spent. */
static double run_throughput(size_t bytes, int frames, bool sealed, double *cpu)
{
    link_t L;
    link_make(&L);
    void *rctx = zmq_ctx_new(), *sctx = zmq_ctx_new();
    fu_err rc;
    void *r = wire_socket_new(rctx, ZMQ_ROUTER, &rc);
    int hwm = 100000;
    zmq_setsockopt(r, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_bind(r, "tcp://127.0.0.1:*");
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, 2);
    sender_arg a = {.ctx = sctx, .seal = sealed ? L.a : NULL, .bytes = bytes, .frames = frames, .go = &go};
    if (wire_socket_endpoint(r, a.endpoint, sizeof a.endpoint) != FU_OK)
        exit(1);
    a.data = malloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        a.data[i] = (uint8_t)(i * 7);
    pthread_t th;
    pthread_create(&th, NULL, sender, &a);
    wire_tensor_asm_t *as = wire_tensor_asm_new(bytes);
    wire_counters c = {0};
    pthread_barrier_wait(&go);
    double c0 = cpu_sec();
    double t0 = fu_clock_sec(), t1 = t0;
    int got = 0;
    uint8_t rid[256];
    size_t rl = 0;
    while (got < frames) {
        wire_msg_t *m = NULL;
        if (wire_recv(r, 0, &c, &m) != FU_OK)
            break;
        const uint8_t *rp = wire_msg_routing_id(m, &rl);
        memcpy(rid, rp, rl);
        bool done = false;
        rc = wire_tensor_asm_feed_msg(as, sealed ? L.b : NULL, &m, &done); /* opens on workers */
        if (rc != FU_OK) {
            fprintf(stderr, "bench-wire: feed failed: %s\n", fu_strerror(rc));
            break;
        }
        if (done) {
            wire_tensor t;
            if (wire_tensor_asm_take(as, &t) == FU_OK)
                wire_tensor_clear(&t);
            got++;
        }
    }
    t1 = fu_clock_sec();
    *cpu = cpu_sec() - c0;
    Fusion__Leave bye = FUSION__LEAVE__INIT;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_LEAVE};
    if (wire_send(r, rid, rl, &h, &bye.base) != FU_OK)
        fprintf(stderr, "bench-wire: could not tell the sender to stop\n");
    pthread_join(th, NULL);
    wire_tensor_asm_destroy(&as);
    wire_socket_close(&r);
    zmq_ctx_term(rctx);
    zmq_ctx_term(sctx);
    pthread_barrier_destroy(&go);
    free(a.data);
    link_free(&L);
    return got == frames ? t1 - t0 : -1.0;
}

typedef struct {
    void *ctx;
    char endpoint[256];
    wire_seal_t *seal;
    size_t bytes;
    int reps;
} echo_arg;

/* Receives each tensor and sends it back as a gradient. */
static void *echo(void *p)
{
    echo_arg *a = p;
    fu_err rc;
    void *s = wire_socket_new(a->ctx, ZMQ_DEALER, &rc);
    zmq_connect(s, a->endpoint);
    /* say hello so the ROUTER knows us */
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_HEARTBEAT};
    if (wire_send(s, NULL, 0, &h, &hb.base) != FU_OK)
        return NULL;
    wire_tensor_asm_t *as = wire_tensor_asm_new(a->bytes);
    wire_counters c = {0};
    uint64_t pseq = 1;
    for (int k = 0; k < a->reps;) {
        wire_msg_t *m = NULL;
        if (wire_recv(s, 0, &c, &m) != FU_OK)
            break;
        bool done = false;
        rc = wire_tensor_asm_feed_msg(as, a->seal, &m, &done);
        if (rc != FU_OK)
            break;
        if (!done)
            continue;
        wire_tensor t;
        if (wire_tensor_asm_take(as, &t) != FU_OK)
            break;
        t.meta.type = FUSION__MSG_TYPE__MSG_GRADIENT;
        rc = wire_tensor_send(s, NULL, 0, a->seal, &t.meta, t.data, t.len, 0, &pseq);
        wire_tensor_clear(&t);
        if (rc != FU_OK)
            break;
        k++;
    }
    wire_tensor_asm_destroy(&as);
    wire_socket_close(&s);
    return NULL;
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* Median round trip in seconds, or -1 on failure. */
static double run_latency(size_t bytes, int reps, bool sealed)
{
    link_t L;
    link_make(&L);
    void *rctx = zmq_ctx_new(), *ectx = zmq_ctx_new();
    fu_err rc;
    void *r = wire_socket_new(rctx, ZMQ_ROUTER, &rc);
    zmq_bind(r, "tcp://127.0.0.1:*");
    echo_arg a = {.ctx = ectx, .seal = sealed ? L.b : NULL, .bytes = bytes, .reps = reps + 1};
    if (wire_socket_endpoint(r, a.endpoint, sizeof a.endpoint) != FU_OK)
        exit(1);
    pthread_t th;
    pthread_create(&th, NULL, echo, &a);
    wire_counters c = {0};
    wire_msg_t *m = NULL;
    double result = -1.0;
    uint8_t rid[256];
    size_t rl = 0;
    if (wire_recv(r, 0, &c, &m) == FU_OK) { /* the echo's hello */
        const uint8_t *rp = wire_msg_routing_id(m, &rl);
        memcpy(rid, rp, rl);
        wire_msg_destroy(&m);
    }
    uint8_t *data = malloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        data[i] = (uint8_t)(i * 13);
    wire_tensor_asm_t *as = wire_tensor_asm_new(bytes);
    double *t = calloc((size_t)reps + 1, sizeof *t);
    uint64_t pseq = 1;
    int ok = 0;
    for (int k = 0; k <= reps; k++) { /* the first round trip warms up */
        wire_tensor_meta meta = meta_for(bytes, FUSION__MSG_TYPE__MSG_ACTIVATION, (uint64_t)k);
        double t0 = fu_clock_sec();
        if (wire_tensor_send(r, rid, rl, sealed ? L.a : NULL, &meta, data, bytes, 0, &pseq) != FU_OK)
            break;
        bool done = false;
        while (!done) {
            if (wire_recv(r, 0, &c, &m) != FU_OK)
                goto out;
            rc = wire_tensor_asm_feed_msg(as, sealed ? L.a : NULL, &m, &done);
            if (rc != FU_OK)
                goto out;
        }
        t[k] = fu_clock_sec() - t0;
        wire_tensor back;
        if (wire_tensor_asm_take(as, &back) != FU_OK || back.len != bytes || memcmp(back.data, data, bytes) != 0)
            goto out;
        wire_tensor_clear(&back);
        ok++;
    }
out:
    if (ok == reps + 1) {
        qsort(t + 1, (size_t)reps, sizeof *t, cmp_double);
        result = t[1 + reps / 2];
    }
    pthread_join(th, NULL);
    free(t);
    free(data);
    wire_tensor_asm_destroy(&as);
    wire_socket_close(&r);
    zmq_ctx_term(rctx);
    zmq_ctx_term(ectx);
    link_free(&L);
    return result;
}

/* The start of a tensor case: libsodium (false when it fails: skip the case), and the heap kept for
 * big buffers. Large buffers (chunks, frames, tensors) come and go at a high rate; glibc would mmap
 * and unmap each one and fault its pages in again every time. Keeping them on the heap is what a
 * data-plane daemon should do too; it applies to the plain and sealed runs alike. */
static bool tensor_case_start(void)
{
    if (sodium_init() < 0)
        return false;
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    return true;
}

static const struct {
    const char *name;
    size_t bytes;
} sizes[] = {{"64KiB", 64u << 10}, {"1MiB", 1u << 20}, {"16MiB", 16u << 20}};

BENCH_CASE(wire_tensor_throughput)
{
    if (!tensor_case_start())
        return;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t bytes = sizes[i].bytes;
        size_t volume = bench_quick() ? (64u << 20) : (512u << 20);
        int frames = (int)(volume / bytes);
        if (frames < 8)
            frames = 8;
        double gbps[2] = {0, 0};
        for (int sealed = 0; sealed < 2; sealed++) {
            /* best of three runs: the machine is shared */
            double best = -1, best_cpu = 0;
            for (int rep = 0; rep < (bench_quick() ? 1 : 3); rep++) {
                double cpu = 0;
                double sec = run_throughput(bytes, frames, sealed, &cpu);
                if (sec > 0 && (best < 0 || sec < best)) {
                    best = sec;
                    best_cpu = cpu;
                }
            }
            double gb = (double)bytes * frames / 1e9;
            gbps[sealed] = best > 0 ? gb / best : 0.0;
            /* cpu_s_per_gb: CPU seconds of all threads per GB moved; cores / cpu_s_per_gb is the
             * throughput ceiling when the CPU, not the pipeline, is the limit */
            bench_emit("wire", "tensor_throughput",
                       "\"frame\":\"%s\",\"bytes\":%zu,\"mode\":\"%s\",\"frames\":%d,\"gb_per_s\":%.3f,"
                       "\"cpu_s_per_gb\":%.3f",
                       sizes[i].name, bytes, sealed ? "sealed" : "plain", frames, gbps[sealed], best_cpu / gb);
        }
        bench_emit("wire", "tensor_throughput_ratio", "\"frame\":\"%s\",\"sealed_over_plain\":%.3f", sizes[i].name,
                   gbps[0] > 0 ? gbps[1] / gbps[0] : 0.0);
    }
}

BENCH_CASE(wire_tensor_roundtrip)
{
    if (!tensor_case_start())
        return;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t bytes = sizes[i].bytes;
        int reps = bytes >= (16u << 20) ? (bench_quick() ? 3 : 11) : (bench_quick() ? 5 : 51);
        for (int sealed = 0; sealed < 2; sealed++) {
            double rtt = run_latency(bytes, reps, sealed);
            bench_emit("wire", "tensor_roundtrip", "\"frame\":\"%s\",\"bytes\":%zu,\"mode\":\"%s\",\"reps\":%d,\"rtt_ms\":%.3f",
                       sizes[i].name, bytes, sealed ? "sealed" : "plain", reps, rtt > 0 ? rtt * 1e3 : -1.0);
        }
    }
}

/* The sealing primitive alone on one core, for reference. */
BENCH_CASE(wire_seal_single_core)
{
    if (sodium_init() < 0)
        return;
    link_t L;
    link_make(&L);
    size_t n = 1u << 20;
    uint8_t *pt = calloc(1, n), *ct = malloc(n + WIRE_SEAL_TAG_BYTES);
    wire_seal_ad ad = {.kind = 9, .total = n, .chunk_count = 1, .dtype = 1, .ndim = 1, .shape = {(int64_t)n / 4}};
    int iters = bench_quick() ? 64 : 512;
    double t0 = fu_clock_sec();
    for (int i = 0; i < iters; i++) {
        uint64_t seq;
        if (wire_seal_encrypt(L.a, &ad, pt, n, ct, n + WIRE_SEAL_TAG_BYTES, &seq) != FU_OK)
            break;
    }
    double sec = fu_clock_sec() - t0;
    bench_emit("wire", "seal_single_core", "\"chunk\":%zu,\"gb_per_s\":%.3f", n, (double)n * iters / sec / 1e9);
    free(pt);
    free(ct);
    link_free(&L);
}
