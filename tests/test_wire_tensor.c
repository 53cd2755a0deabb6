/* The parallel tensor path: a multi-chunk sealed tensor is sealed by a pool of threads in
 * wire_tensor_send and opened on the assembler's workers by wire_tensor_asm_feed_msg. It must
 * round-trip exactly, refuse a tampered chunk in the middle (and accept the genuine one after),
 * assemble chunks delivered in any order, refuse replayed chunks, wait for room in a full queue
 * without blocking (wire_tensor_send_waiting), and leak nothing (ASan). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <zmq.h>

#include "wire.h"
#include "wire_keys.h"
#include "wire_seal.h"
#include "wire_socket.h"
#include "wire_tensor.h"

#include "testutil.h" /* after wire_seal.h: tu_seal_pair */

#define BIG (16u << 20) /* 16 MiB: 16 chunks of the default size */

typedef struct {
    wire_keypair_t *a_kp, *b_kp;
    wire_seal_t *a, *b; /* the link, seen from each side */
    void *ctx, *rx, *tx; /* an inproc pair that carries the chunks */
    uint8_t *data;       /* BIG bytes of pattern */
} fx;

static int setup(void **state)
{
    fx *F = calloc(1, sizeof *F);
    tu_seal_pair(&F->a_kp, &F->b_kp, &F->a, &F->b, NULL, NULL);
    fu_err rc;
    F->ctx = zmq_ctx_new();
    F->rx = wire_socket_new(F->ctx, ZMQ_PAIR, &rc);
    F->tx = wire_socket_new(F->ctx, ZMQ_PAIR, &rc);
    assert_non_null(F->rx);
    assert_non_null(F->tx);
    int ms = 5000;
    zmq_setsockopt(F->rx, ZMQ_RCVTIMEO, &ms, sizeof ms);
    assert_int_equal(zmq_bind(F->rx, "inproc://tensor"), 0);
    assert_int_equal(zmq_connect(F->tx, "inproc://tensor"), 0);
    F->data = malloc(BIG);
    for (size_t i = 0; i < BIG; i++)
        F->data[i] = (uint8_t)(i * 131 + (i >> 12));
    *state = F;
    return 0;
}

static int teardown(void **state)
{
    fx *F = *state;
    wire_socket_close(&F->rx);
    wire_socket_close(&F->tx);
    zmq_ctx_term(F->ctx);
    tu_seal_pair_free(&F->a_kp, &F->b_kp, &F->a, &F->b);
    free(F->data);
    free(F);
    return 0;
}

/* One chunk as it travelled: its two frames, copied. */
typedef struct {
    uint8_t *env, *body;
    size_t env_len, body_len;
} raw_chunk;

static wire_tensor_meta big_meta(uint64_t step)
{
    /* the tensor (BIG bytes of f32), then the message it travels as */
    return (wire_tensor_meta){.dtype = FUSION__DTYPE__DTYPE_F32,
                              .ndim = 2,
                              .shape = {(int64_t)(BIG / 4 / 1024), 1024},
                              .type = FUSION__MSG_TYPE__MSG_ACTIVATION,
                              .job_id = 7,
                              .step = step,
                              .micro_batch = 1};
}

/* Sends the pattern sealed (or plain with seal NULL) in chunks of chunk_bytes and captures the n
 * chunks it became. */
static raw_chunk *send_capture(fx *F, wire_seal_t *seal, uint64_t step, size_t chunk_bytes, size_t *n)
{
    wire_tensor_meta m = big_meta(step);
    uint64_t pseq = 1;
    assert_int_equal(wire_tensor_send(F->tx, NULL, 0, seal, &m, F->data, BIG, chunk_bytes, &pseq), FU_OK);
    size_t count = BIG / (chunk_bytes ? chunk_bytes : WIRE_TENSOR_CHUNK);
    raw_chunk *c = calloc(count, sizeof *c);
    for (size_t i = 0; i < count; i++) {
        zmq_msg_t env, body;
        zmq_msg_init(&env);
        zmq_msg_init(&body);
        assert_true(zmq_msg_recv(&env, F->rx, 0) >= 0);
        assert_true(zmq_msg_more(&env));
        assert_true(zmq_msg_recv(&body, F->rx, 0) >= 0);
        c[i].env_len = zmq_msg_size(&env);
        c[i].body_len = zmq_msg_size(&body);
        c[i].env = malloc(c[i].env_len);
        c[i].body = malloc(c[i].body_len);
        memcpy(c[i].env, zmq_msg_data(&env), c[i].env_len);
        memcpy(c[i].body, zmq_msg_data(&body), c[i].body_len);
        zmq_msg_close(&env);
        zmq_msg_close(&body);
    }
    *n = count;
    return c;
}

static void raw_free(raw_chunk *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(c[i].env);
        free(c[i].body);
    }
    free(c);
}

static wire_msg_t *decode(const raw_chunk *c)
{
    wire_msg_t *m = NULL;
    assert_int_equal(wire_decode(c->env, c->env_len, c->body, c->body_len, NULL, &m), FU_OK);
    return m;
}

static uint32_t chunk_index_of(const raw_chunk *c)
{
    wire_msg_t *m = decode(c);
    uint32_t i = ((const Fusion__TensorFrame *)wire_msg_body(m))->chunk_index;
    wire_msg_destroy(&m);
    return i;
}

static fu_err feed(wire_tensor_asm_t *as, wire_seal_t *seal, const raw_chunk *c, bool *done)
{
    wire_msg_t *m = decode(c);
    fu_err rc = wire_tensor_asm_feed_msg(as, seal, &m, done);
    assert_null(m); /* consumed, also on error */
    return rc;
}

static void expect_tensor(wire_tensor_asm_t *as, const fx *F, uint64_t step)
{
    wire_tensor t;
    assert_int_equal(wire_tensor_asm_take(as, &t), FU_OK);
    assert_int_equal(t.len, BIG);
    assert_int_equal(t.meta.step, step);
    assert_int_equal(t.meta.shape[1], 1024);
    assert_memory_equal(t.data, F->data, BIG);
    wire_tensor_clear(&t);
}

static void test_wire_tensor_parallel_16mib_round_trips(void **state)
{
    fx *F = *state;
    size_t sizes[] = {0, 256u << 10}; /* 16 chunks; 64 chunks (more than the opening queue holds) */
    for (size_t s = 0; s < 2; s++) {
        size_t n;
        raw_chunk *c = send_capture(F, F->a, s, sizes[s], &n);
        /* every chunk sealed under its own, distinct sequence number, close to its index order */
        uint64_t *seqs = calloc(n, sizeof *seqs);
        for (size_t i = 0; i < n; i++) {
            wire_msg_t *m = decode(&c[i]);
            seqs[i] = wire_msg_hdr(m)->sequence;
            assert_int_equal(chunk_index_of(&c[i]), i); /* sent in index order */
            wire_msg_destroy(&m);
            for (size_t j = 0; j < i; j++)
                assert_true(seqs[j] != seqs[i]);
        }
        wire_tensor_asm_t *as = wire_tensor_asm_new(BIG);
        bool done = false;
        for (size_t i = 0; i < n; i++) {
            assert_int_equal(feed(as, F->b, &c[i], &done), FU_OK);
            assert_int_equal(done, i + 1 == n);
        }
        expect_tensor(as, F, s);
        wire_tensor_asm_destroy(&as);
        assert_null(as);
        free(seqs);
        raw_free(c, n);
    }
    uint64_t failed = 9, replayed = 9;
    wire_seal_counters(F->b, &failed, &replayed);
    assert_int_equal(failed, 0);
    assert_int_equal(replayed, 0);
}

/* wire_tensor_send_waiting against a receiver whose queue holds 2 chunks (inproc high-water marks
 * of 1 each way): the wait callback runs between tries, on the sending thread, and here plays the
 * receiver's part, taking one chunk each time; the tensor arrives whole, sealed or plain. A callback
 * that gives up, or the timeout, ends the send with FU_EAGAIN and frees every chunk not sent. */
typedef struct {
    void *rx;
    wire_tensor_asm_t *as;
    wire_seal_t *seal;
    int calls, give_up_after; /* give_up_after 0: never */
    bool done;
} full_rx;

static bool take_one(void *arg)
{
    full_rx *r = arg;
    r->calls++;
    if (r->give_up_after && r->calls >= r->give_up_after)
        return false;
    if (!r->as)
        return true;
    wire_msg_t *m = NULL;
    if (wire_recv(r->rx, WIRE_DONTWAIT, NULL, &m) == FU_OK)
        assert_int_equal(wire_tensor_asm_feed_msg(r->as, r->seal, &m, &r->done), FU_OK);
    return true;
}

static void test_wire_tensor_send_waits_for_a_full_queue(void **state)
{
    fx *F = *state;
    fu_err rc;
    void *tx = wire_socket_new(F->ctx, ZMQ_PAIR, &rc), *rx = wire_socket_new(F->ctx, ZMQ_PAIR, &rc);
    int one = 1, ms = 5000;
    zmq_setsockopt(tx, ZMQ_SNDHWM, &one, sizeof one);
    zmq_setsockopt(rx, ZMQ_RCVHWM, &one, sizeof one);
    zmq_setsockopt(rx, ZMQ_RCVTIMEO, &ms, sizeof ms);
    assert_int_equal(zmq_bind(rx, "inproc://tensor-full"), 0);
    assert_int_equal(zmq_connect(tx, "inproc://tensor-full"), 0);
    for (int sealed = 0; sealed < 2; sealed++) {
        wire_tensor_meta m = big_meta(40 + (uint64_t)sealed);
        uint64_t pseq = 1;
        full_rx r = {.rx = rx, .as = wire_tensor_asm_new(BIG), .seal = sealed ? F->b : NULL};
        wire_send_wait w = {.wait = take_one, .arg = &r, .timeout_ms = 20000};
        assert_int_equal(wire_tensor_send_waiting(tx, NULL, 0, sealed ? F->a : NULL, &m, F->data, BIG, 0, &pseq, &w),
                         FU_OK);
        assert_true(r.calls >= 16 - 4); /* 16 chunks, at most a few fit without waiting */
        while (!r.done) {
            wire_msg_t *msg = NULL;
            assert_int_equal(wire_recv(rx, 0, NULL, &msg), FU_OK);
            assert_int_equal(wire_tensor_asm_feed_msg(r.as, r.seal, &msg, &r.done), FU_OK);
        }
        expect_tensor(r.as, F, 40 + (uint64_t)sealed);
        wire_tensor_asm_destroy(&r.as);
    }
    /* giving up: nothing more is sent, the chunks built and not sent are freed (ASan) */
    wire_tensor_meta m = big_meta(50);
    full_rx r = {.rx = rx, .give_up_after = 3};
    wire_send_wait w = {.wait = take_one, .arg = &r};
    assert_int_equal(wire_tensor_send_waiting(tx, NULL, 0, F->a, &m, F->data, BIG, 0, NULL, &w), FU_EAGAIN);
    assert_int_equal(r.calls, 3);
    /* the timeout alone */
    w = (wire_send_wait){.timeout_ms = 30};
    uint64_t pseq = 1;
    assert_int_equal(wire_tensor_send_waiting(tx, NULL, 0, NULL, &m, F->data, BIG, 0, &pseq, &w), FU_EAGAIN);
    wire_socket_close(&tx);
    wire_socket_close(&rx);
}

static void test_wire_tensor_tampered_middle_chunk_refused(void **state)
{
    fx *F = *state;
    size_t n;
    raw_chunk *c = send_capture(F, F->a, 1, 0, &n);
    assert_int_equal(n, 16);
    raw_chunk bad = {.env = c[7].env, .env_len = c[7].env_len, .body_len = c[7].body_len};
    bad.body = malloc(bad.body_len);
    memcpy(bad.body, c[7].body, bad.body_len);
    bad.body[bad.body_len / 2] ^= 0x01; /* one bit in the middle of the ciphertext */
    wire_tensor_asm_t *as = wire_tensor_asm_new(BIG);
    bool done = false;
    for (size_t i = 0; i < n; i++) {
        fu_err rc = feed(as, F->b, i == 7 ? &bad : &c[i], &done);
        /* the tampered chunk opens on a worker: its refusal is reported when the last chunk is in */
        assert_int_equal(rc, i + 1 == n ? FU_EAUTH : FU_OK);
        assert_false(done);
    }
    uint64_t failed = 0;
    wire_seal_counters(F->b, &failed, NULL);
    assert_int_equal(failed, 1);
    assert_int_equal(wire_tensor_asm_take(as, &(wire_tensor){0}), FU_EAGAIN);
    /* the tampered chunk is missing, not accepted: the genuine one completes the tensor */
    assert_int_equal(feed(as, F->b, &c[7], &done), FU_OK);
    assert_true(done);
    expect_tensor(as, F, 1);
    /* a tampered first chunk starts nothing */
    assert_int_equal(feed(as, F->b, &bad, &done), FU_EAUTH);
    assert_int_equal(wire_tensor_asm_take(as, &(wire_tensor){0}), FU_EAGAIN);
    wire_tensor_asm_destroy(&as);
    free(bad.body);
    raw_free(c, n);
}

static void test_wire_tensor_out_of_order_assembles(void **state)
{
    fx *F = *state;
    size_t n;
    raw_chunk *c = send_capture(F, F->a, 2, 256u << 10, &n);
    assert_int_equal(n, 64);
    /* a fixed shuffle that moves chunks by up to 34 places (inside the 64-frame replay window):
     * each half of 32 reversed, then the ends of each group of four swapped */
    size_t *order = malloc(n * sizeof *order);
    for (size_t h = 0; h < 2; h++)
        for (size_t i = 0; i < 32; i++)
            order[h * 32 + i] = h * 32 + (31 - i);
    for (size_t i = 0; i + 3 < n; i += 4) {
        size_t t = order[i];
        order[i] = order[i + 3];
        order[i + 3] = t;
    }
    wire_tensor_asm_t *as = wire_tensor_asm_new(BIG);
    bool done = false;
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(feed(as, F->b, &c[order[i]], &done), FU_OK);
        assert_int_equal(done, i + 1 == n);
    }
    expect_tensor(as, F, 2);
    /* and the plain path, fully reversed, through the same call */
    size_t pn;
    raw_chunk *p = send_capture(F, NULL, 3, 0, &pn);
    for (size_t i = 0; i < pn; i++)
        assert_int_equal(feed(as, NULL, &p[pn - 1 - i], &done), FU_OK);
    assert_true(done);
    expect_tensor(as, F, 3);
    wire_tensor_asm_destroy(&as);
    raw_free(p, pn);
    free(order);
    raw_free(c, n);
}

static void test_wire_tensor_replayed_chunk_refused(void **state)
{
    fx *F = *state;
    size_t n;
    raw_chunk *c = send_capture(F, F->a, 4, 0, &n);
    wire_tensor_asm_t *as = wire_tensor_asm_new(BIG);
    bool done = false;
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(feed(as, F->b, &c[i], &done), FU_OK);
        if (i == 5) /* a replay inside the tensor in progress */
            assert_int_equal(feed(as, F->b, &c[3], &done), FU_EPROTO);
    }
    assert_true(done);
    expect_tensor(as, F, 4);
    uint64_t replayed = 0;
    /* every chunk replayed after completion (it would start the tensor again) is refused */
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(feed(as, F->b, &c[i], &done), FU_EAUTH);
        assert_false(done);
    }
    wire_seal_counters(F->b, NULL, &replayed);
    assert_int_equal(replayed, n);
    /* and to a fresh assembler on the same link */
    wire_tensor_asm_t *fresh = wire_tensor_asm_new(BIG);
    assert_int_equal(feed(fresh, F->b, &c[n / 2], &done), FU_EAUTH);
    assert_int_equal(wire_tensor_asm_take(fresh, &(wire_tensor){0}), FU_EAGAIN);
    wire_tensor_asm_destroy(&fresh);
    /* an old chunk replayed in the middle of a newer tensor is refused at once (it would start a
     * tensor, so it is opened before anything changes) and leaves the newer tensor as it was */
    size_t n2;
    raw_chunk *d = send_capture(F, F->a, 5, 0, &n2);
    for (size_t i = 0; i < n2; i++) {
        assert_int_equal(feed(as, F->b, &d[i], &done), FU_OK);
        if (i == n2 / 2) {
            assert_int_equal(feed(as, F->b, &c[8], &done), FU_EAUTH);
            assert_false(done);
        }
    }
    assert_true(done);
    expect_tensor(as, F, 5);
    wire_tensor_asm_destroy(&as);
    raw_free(d, n2);
    raw_free(c, n);
}

static void test_wire_tensor_abandon_with_chunks_opening(void **state)
{
    fx *F = *state;
    size_t n1, n2;
    raw_chunk *c1 = send_capture(F, F->a, 10, 0, &n1);
    raw_chunk *c2 = send_capture(F, F->a, 11, 0, &n2);
    wire_tensor_asm_t *as = wire_tensor_asm_new(BIG);
    bool done = false;
    for (size_t i = 0; i < n1 / 2; i++)
        assert_int_equal(feed(as, F->b, &c1[i], &done), FU_OK);
    for (size_t i = 0; i < n2; i++)
        assert_int_equal(feed(as, F->b, &c2[i], &done), FU_OK);
    assert_true(done);
    assert_int_equal(wire_tensor_asm_abandoned(as), 1);
    expect_tensor(as, F, 11);
    /* destroy with chunks still queued: they finish, nothing leaks */
    for (size_t i = n1 / 2; i < n1; i++)
        assert_int_equal(feed(as, F->b, &c1[i], &done), FU_OK);
    wire_tensor_asm_destroy(&as);
    raw_free(c1, n1);
    raw_free(c2, n2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_tensor_parallel_16mib_round_trips),
        cmocka_unit_test(test_wire_tensor_send_waits_for_a_full_queue),
        cmocka_unit_test(test_wire_tensor_tampered_middle_chunk_refused),
        cmocka_unit_test(test_wire_tensor_out_of_order_assembles),
        cmocka_unit_test(test_wire_tensor_replayed_chunk_refused),
        cmocka_unit_test(test_wire_tensor_abandon_with_chunks_opening),
    };
    return tu_unit_main(tests, sodium_init, setup, teardown);
}
