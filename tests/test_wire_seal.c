/* The sealed data-plane channel: both sides derive matching keys; a relay cannot read a frame;
 * any bit flip or relabelling is detected; replayed and stale frames are refused; tensors travel
 * in sealed chunks over TCP, directly and through a relaying ROUTER (wire_forward). */
#define _GNU_SOURCE /* memmem */
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

typedef struct {
    wire_keypair_t *a_kp, *b_kp, *r_kp; /* two stages and a relay */
    wire_seal_t *a, *b;                 /* the link, seen from each side */
    uint8_t a_eph_pk[32], b_eph_pk[32]; /* what travelled in the SealHellos */
} link_fx;

static int setup(void **state)
{
    link_fx *L = calloc(1, sizeof *L);
    tu_seal_pair(&L->a_kp, &L->b_kp, &L->a, &L->b, L->a_eph_pk, L->b_eph_pk);
    L->r_kp = wire_keypair_generate();
    *state = L;
    return 0;
}

static int teardown(void **state)
{
    link_fx *L = *state;
    tu_seal_pair_free(&L->a_kp, &L->b_kp, &L->a, &L->b);
    wire_keypair_destroy(&L->r_kp);
    free(L);
    return 0;
}

static wire_seal_ad sample_ad(void)
{
    /* the first and only chunk (offset 0, index 0) of a 4 x 4 f32 activation */
    wire_seal_ad ad = {.job_id = 5,
                       .step = 100,
                       .micro_batch = 2,
                       .kind = FUSION__MSG_TYPE__MSG_ACTIVATION,
                       .total = 64,
                       .chunk_count = 1,
                       .dtype = FUSION__DTYPE__DTYPE_F32,
                       .ndim = 2,
                       .shape = {4, 4}};
    return ad;
}

static const char secret_text[] = "activations of stage 3: the quick brown fox jumps over it";

static void test_wire_seal_both_directions_round_trip(void **state)
{
    link_fx *L = *state;
    wire_seal_ad ad = sample_ad();
    uint8_t ct[256], pt[256];
    uint64_t seq = 0;
    size_t n = sizeof secret_text;
    assert_int_equal(wire_seal_encrypt(L->a, &ad, (const uint8_t *)secret_text, n, ct, sizeof ct, &seq), FU_OK);
    assert_int_equal(seq, 1);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seq, ct, n + WIRE_SEAL_TAG_BYTES, pt, sizeof pt), FU_OK);
    assert_memory_equal(pt, secret_text, n);
    /* the other direction, with its own key and counter */
    assert_int_equal(wire_seal_encrypt(L->b, &ad, (const uint8_t *)secret_text, n, ct, sizeof ct, &seq), FU_OK);
    assert_int_equal(seq, 1);
    assert_int_equal(wire_seal_decrypt(L->a, &ad, seq, ct, n + WIRE_SEAL_TAG_BYTES, pt, sizeof pt), FU_OK);
    assert_memory_equal(pt, secret_text, n);
    /* a frame cannot be reflected back to its sender */
    assert_int_equal(wire_seal_encrypt(L->a, &ad, (const uint8_t *)secret_text, n, ct, sizeof ct, &seq), FU_OK);
    assert_int_equal(wire_seal_decrypt(L->a, &ad, seq, ct, n + WIRE_SEAL_TAG_BYTES, pt, sizeof pt), FU_EAUTH);
    /* too small an output buffer */
    assert_int_equal(wire_seal_encrypt(L->a, &ad, (const uint8_t *)secret_text, n, ct, n, &seq), FU_ENOMEM);
}

static void test_wire_seal_relay_cannot_read(void **state)
{
    link_fx *L = *state;
    wire_seal_ad ad = sample_ad();
    uint8_t ct[256], pt[256];
    uint64_t seq;
    size_t n = sizeof secret_text;
    assert_int_equal(wire_seal_encrypt(L->a, &ad, (const uint8_t *)secret_text, n, ct, sizeof ct, &seq), FU_OK);
    /* nothing of the plaintext shows */
    assert_null(memmem(ct, n + WIRE_SEAL_TAG_BYTES, "quick brown", 11));
    /* The relay saw both SealHellos and knows both long-term public keys; with its own key pair it
     * derives something else, impersonating either end. */
    for (int side = 0; side < 2; side++) {
        wire_seal_eph_t *er = wire_seal_eph_new();
        fu_err rc;
        wire_seal_t *r = wire_seal_new(L->r_kp, wire_keypair_public(side ? L->a_kp : L->b_kp), &er,
                                       side ? L->a_eph_pk : L->b_eph_pk, &rc);
        assert_non_null(r);
        assert_int_equal(wire_seal_decrypt(r, &ad, seq, ct, n + WIRE_SEAL_TAG_BYTES, pt, sizeof pt), FU_EAUTH);
        for (size_t i = 0; i < n; i++)
            assert_int_equal(pt[i], 0); /* wiped on failure */
        wire_seal_destroy(&r);
    }
    /* The real receiver still opens it. */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seq, ct, n + WIRE_SEAL_TAG_BYTES, pt, sizeof pt), FU_OK);
}

static void test_wire_seal_every_bit_flip_detected(void **state)
{
    link_fx *L = *state;
    wire_seal_ad ad = sample_ad();
    uint8_t ct[128], bad[128], pt[128];
    uint64_t seq;
    size_t n = 64, cn = n + WIRE_SEAL_TAG_BYTES;
    uint8_t msg[64];
    for (size_t i = 0; i < n; i++)
        msg[i] = (uint8_t)i;
    assert_int_equal(wire_seal_encrypt(L->a, &ad, msg, n, ct, sizeof ct, &seq), FU_OK);
    for (size_t bit = 0; bit < cn * 8; bit++) {
        memcpy(bad, ct, cn);
        bad[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        assert_int_equal(wire_seal_decrypt(L->b, &ad, seq, bad, cn, pt, sizeof pt), FU_EAUTH);
    }
    /* truncation */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seq, ct, cn - 1, pt, sizeof pt), FU_EAUTH);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seq, ct, 3, pt, sizeof pt), FU_EAUTH);
    /* every field of the associated data is bound */
    wire_seal_ad v[12];
    for (int i = 0; i < 12; i++)
        v[i] = ad;
    v[0].job_id++;
    v[1].step++;
    v[2].micro_batch++;
    v[3].kind = FUSION__MSG_TYPE__MSG_GRADIENT;
    v[4].offset = 8;
    v[5].total++;
    v[6].chunk_index = 1;
    v[7].chunk_count = 2;
    v[8].dtype = FUSION__DTYPE__DTYPE_BF16;
    v[9].ndim = 1;
    v[10].shape[1] = 5;
    v[11].shape[0] = 8, v[11].shape[1] = 2;
    for (int i = 0; i < 12; i++)
        assert_int_equal(wire_seal_decrypt(L->b, &v[i], seq, ct, cn, pt, sizeof pt), FU_EAUTH);
    /* and the sequence number */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seq + 1, ct, cn, pt, sizeof pt), FU_EAUTH);
    uint64_t failed = 0, replayed = 0;
    wire_seal_counters(L->b, &failed, &replayed);
    assert_int_equal(failed, cn * 8 + 1 + 12 + 1);
    /* the untouched frame still opens */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seq, ct, cn, pt, sizeof pt), FU_OK);
    assert_memory_equal(pt, msg, n);
}

static void test_wire_seal_replay_and_stale_refused(void **state)
{
    link_fx *L = *state;
    wire_seal_ad ad = sample_ad();
    enum { N = 100 };
    uint8_t ct[N][32 + WIRE_SEAL_TAG_BYTES], pt[64];
    uint64_t seqs[N];
    uint8_t msg[32] = {1, 2, 3};
    for (int i = 0; i < N; i++)
        assert_int_equal(wire_seal_encrypt(L->a, &ad, msg, 32, ct[i], sizeof ct[i], &seqs[i]), FU_OK);
    size_t cn = sizeof ct[0];
    /* frame 0 arrives, then again: replay */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[0], ct[0], cn, pt, sizeof pt), FU_OK);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[0], ct[0], cn, pt, sizeof pt), FU_EAUTH);
    /* out of order inside the window is fine: 10, then 5 */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[10], ct[10], cn, pt, sizeof pt), FU_OK);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[5], ct[5], cn, pt, sizeof pt), FU_OK);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[5], ct[5], cn, pt, sizeof pt), FU_EAUTH);
    /* the newest is 99; frame 20 is 79 behind, outside the 64-frame window: stale */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[99], ct[99], cn, pt, sizeof pt), FU_OK);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[20], ct[20], cn, pt, sizeof pt), FU_EAUTH);
    /* frame 40 is 59 behind: still inside, accepted once */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[40], ct[40], cn, pt, sizeof pt), FU_OK);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[40], ct[40], cn, pt, sizeof pt), FU_EAUTH);
    assert_int_equal(wire_seal_decrypt(L->b, &ad, seqs[99], ct[99], cn, pt, sizeof pt), FU_EAUTH);
    uint64_t failed = 0, replayed = 0;
    wire_seal_counters(L->b, &failed, &replayed);
    assert_int_equal(replayed, 5);
    assert_int_equal(failed, 0);
    /* sequence 0 is never valid */
    assert_int_equal(wire_seal_decrypt(L->b, &ad, 0, ct[1], cn, pt, sizeof pt), FU_EAUTH);
}

static void test_wire_seal_bad_keys_refused(void **state)
{
    link_fx *L = *state;
    fu_err rc;
    wire_seal_eph_t *e = wire_seal_eph_new();
    uint8_t peer_eph[32];
    memcpy(peer_eph, L->b_eph_pk, 32);
    /* a link to oneself */
    assert_null(wire_seal_new(L->a_kp, wire_keypair_public(L->a_kp), &e, peer_eph, &rc));
    assert_int_equal(rc, FU_EINVAL);
    assert_null(e);
    /* a low-order (all-zero) ephemeral key */
    e = wire_seal_eph_new();
    uint8_t zero[32] = {0};
    assert_null(wire_seal_new(L->a_kp, wire_keypair_public(L->b_kp), &e, zero, &rc));
    assert_int_equal(rc, FU_EINVAL);
    assert_null(wire_seal_new(L->a_kp, wire_keypair_public(L->b_kp), NULL, zero, &rc));
}

/* ---------- tensors over sockets ---------- */

typedef struct {
    void *ctx;
    void *socks[4];
} net;

static void net_close(net *n)
{
    for (int i = 0; i < 4; i++)
        wire_socket_close(&n->socks[i]);
    zmq_ctx_term(n->ctx);
}

static void *mk(net *n, int slot, int type, const char *bind_or_connect, int bind)
{
    fu_err rc;
    void *s = wire_socket_new(n->ctx, type, &rc);
    assert_non_null(s);
    n->socks[slot] = s;
    int ms = 5000;
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &ms, sizeof ms);
    if (bind)
        assert_int_equal(zmq_bind(s, bind_or_connect), 0);
    else
        assert_int_equal(zmq_connect(s, bind_or_connect), 0);
    return s;
}

static void fill_pattern(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(i * 131 + (i >> 12));
}

static void test_wire_seal_tensor_direct_and_relayed(void **state)
{
    link_fx *L = *state;
    net n = {.ctx = zmq_ctx_new()};
    void *broker = mk(&n, 0, ZMQ_ROUTER, "tcp://127.0.0.1:*", 1);
    char ep[256];
    assert_int_equal(wire_socket_endpoint(broker, ep, sizeof ep), FU_OK);
    void *sa = mk(&n, 1, ZMQ_DEALER, ep, 0);
    void *sb = mk(&n, 2, ZMQ_DEALER, ep, 0);
    wire_counters c = {0};
    wire_msg_t *m = NULL;

    /* b registers with the broker */
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    wire_hdr hh = {.type = FUSION__MSG_TYPE__MSG_HEARTBEAT};
    assert_int_equal(wire_send(sb, NULL, 0, &hh, &hb.base), FU_OK);
    assert_int_equal(wire_recv(broker, 0, &c, &m), FU_OK);
    size_t brl;
    uint8_t brid[256];
    const uint8_t *brid_p = wire_msg_routing_id(m, &brl);
    memcpy(brid, brid_p, brl);
    wire_msg_destroy(&m);

    /* a sends a 3.5 MiB f32 activation, sealed, in 1 MiB chunks, relayed to b */
    size_t len = 7 * 128 * 1024 * 4; /* 3.5 MiB */
    uint8_t *data = malloc(len);
    fill_pattern(data, len);
    wire_tensor_meta meta = {.type = FUSION__MSG_TYPE__MSG_ACTIVATION,
                             .job_id = 5,
                             .step = 100,
                             .micro_batch = 1,
                             .stage = 0,
                             .dtype = FUSION__DTYPE__DTYPE_F32,
                             .ndim = 2,
                             .shape = {7 * 128, 1024},
                             .relay_to = wire_keypair_public_z85(L->b_kp)};
    assert_int_equal(wire_tensor_send(sa, NULL, 0, L->a, &meta, data, len, 0, NULL), FU_OK);

    wire_tensor_asm_t *relay_asm = wire_tensor_asm_new(64u << 20);
    wire_tensor_asm_t *b_asm = wire_tensor_asm_new(64u << 20);
    bool done = false;
    wire_msg_t *first = NULL;
    for (int i = 0; i < 4; i++) {
        assert_int_equal(wire_recv(broker, 0, &c, &m), FU_OK);
        const Fusion__TensorFrame *tf = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ACTIVATION);
        assert_non_null(tf);
        assert_true(tf->sealed);
        /* the relay sees only ciphertext: the plaintext's first bytes appear nowhere */
        assert_null(memmem(tf->payload.data, tf->payload.len, data + tf->offset, 32));
        bool rdone;
        assert_int_equal(wire_tensor_asm_feed(relay_asm, NULL, m, &rdone), FU_EAUTH);
        assert_string_equal(wire_msg_hdr(m)->relay_to, wire_keypair_public_z85(L->b_kp));
        assert_int_equal(wire_forward(broker, brid, brl, m, wire_keypair_public_z85(L->a_kp)), FU_OK);
        wire_msg_destroy(&m);
    }
    for (int i = 0; i < 4; i++) {
        assert_int_equal(wire_recv(sb, 0, &c, &m), FU_OK);
        assert_string_equal(wire_msg_hdr(m)->sender, wire_keypair_public_z85(L->a_kp));
        assert_int_equal(wire_tensor_asm_feed(b_asm, L->b, m, &done), FU_OK);
        assert_int_equal(done, i == 3);
        if (i == 1) { /* the same chunk again is refused and changes nothing */
            bool d2;
            assert_int_equal(wire_tensor_asm_feed(b_asm, L->b, m, &d2), FU_EPROTO);
        }
        if (i == 0)
            first = m; /* kept to replay later */
        else
            wire_msg_destroy(&m);
    }
    wire_tensor t;
    assert_int_equal(wire_tensor_asm_take(b_asm, &t), FU_OK);
    assert_int_equal(t.len, len);
    assert_memory_equal(t.data, data, len);
    assert_int_equal(t.meta.ndim, 2);
    assert_int_equal(t.meta.shape[0], 7 * 128);
    assert_int_equal(t.meta.step, 100);
    wire_tensor_clear(&t);
    assert_int_equal(wire_tensor_asm_take(b_asm, &t), FU_EAGAIN);
    /* replaying the first chunk after the tensor is done: the seal's replay window refuses it */
    assert_int_equal(wire_tensor_asm_feed(b_asm, L->b, first, &done), FU_EAUTH);
    assert_false(done);
    wire_msg_destroy(&first);

    /* b answers with a plain gradient on an unsealed link: a sealed receiver refuses it */
    uint64_t pseq = 1;
    meta.type = FUSION__MSG_TYPE__MSG_GRADIENT;
    meta.relay_to = NULL;
    assert_int_equal(wire_tensor_send(sb, NULL, 0, NULL, &meta, data, len, 1u << 20, &pseq), FU_OK);
    assert_int_equal(pseq, 5);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(wire_recv(broker, 0, &c, &m), FU_OK);
        assert_int_equal(wire_tensor_asm_feed(relay_asm, L->a, m, &done), FU_EAUTH);
        assert_int_equal(wire_tensor_asm_feed(relay_asm, NULL, m, &done), FU_OK);
        wire_msg_destroy(&m);
    }
    assert_true(done);
    assert_int_equal(wire_tensor_asm_take(relay_asm, &t), FU_OK);
    assert_memory_equal(t.data, data, len);
    wire_tensor_clear(&t);

    /* bad metadata is refused before anything is sent */
    meta.shape[0] = 3;
    assert_int_equal(wire_tensor_send(sa, NULL, 0, L->a, &meta, data, len, 0, NULL), FU_EINVAL);
    wire_tensor_asm_destroy(&relay_asm);
    wire_tensor_asm_destroy(&b_asm);
    free(data);
    net_close(&n);
}

static void test_wire_seal_tensor_tampered_chunk_refused(void **state)
{
    link_fx *L = *state;
    net n = {.ctx = zmq_ctx_new()};
    void *rx = mk(&n, 0, ZMQ_PAIR, "inproc://tamper", 1);
    void *tx = mk(&n, 1, ZMQ_PAIR, "inproc://tamper", 0);
    uint8_t data[4096];
    fill_pattern(data, sizeof data);
    wire_tensor_meta meta = {.type = FUSION__MSG_TYPE__MSG_GRADIENT,
                             .job_id = 1,
                             .step = 2,
                             .micro_batch = 3,
                             .dtype = FUSION__DTYPE__DTYPE_U8,
                             .ndim = 1,
                             .shape = {4096}};
    assert_int_equal(wire_tensor_send(tx, NULL, 0, L->a, &meta, data, sizeof data, 1024, NULL), FU_OK);
    wire_tensor_asm_t *as = wire_tensor_asm_new(1u << 20);
    bool done = false;
    for (int i = 0; i < 4; i++) {
        zmq_msg_t env, body;
        zmq_msg_init(&env);
        zmq_msg_init(&body);
        assert_true(zmq_msg_recv(&env, rx, 0) >= 0);
        assert_true(zmq_msg_recv(&body, rx, 0) >= 0);
        size_t bl = zmq_msg_size(&body);
        uint8_t *copy = malloc(bl);
        memcpy(copy, zmq_msg_data(&body), bl);
        copy[bl - 100] ^= 0x10; /* inside the ciphertext */
        wire_msg_t *m = NULL;
        assert_int_equal(wire_decode(zmq_msg_data(&env), zmq_msg_size(&env), copy, bl, NULL, &m), FU_OK);
        assert_int_equal(wire_tensor_asm_feed(as, L->b, m, &done), FU_EAUTH);
        wire_msg_destroy(&m);
        /* the untouched chunk is accepted */
        assert_int_equal(wire_decode(zmq_msg_data(&env), zmq_msg_size(&env), zmq_msg_data(&body), bl, NULL, &m), FU_OK);
        assert_int_equal(wire_tensor_asm_feed(as, L->b, m, &done), FU_OK);
        wire_msg_destroy(&m);
        free(copy);
        zmq_msg_close(&env);
        zmq_msg_close(&body);
    }
    assert_true(done);
    wire_tensor t;
    assert_int_equal(wire_tensor_asm_take(as, &t), FU_OK);
    assert_memory_equal(t.data, data, sizeof data);
    wire_tensor_clear(&t);
    /* a tensor bigger than the receiver accepts */
    wire_tensor_asm_t *small = wire_tensor_asm_new(100);
    assert_int_equal(wire_tensor_send(tx, NULL, 0, L->a, &meta, data, sizeof data, 0, NULL), FU_OK);
    wire_counters c = {0};
    wire_msg_t *m = NULL;
    assert_int_equal(wire_recv(rx, 0, &c, &m), FU_OK);
    assert_int_equal(wire_tensor_asm_feed(small, L->b, m, &done), FU_ENOMEM);
    wire_msg_destroy(&m);
    wire_tensor_asm_destroy(&small);
    wire_tensor_asm_destroy(&as);
    net_close(&n);
}

/* Encodes a plain TensorFrame chunk and feeds it to a. */
static fu_err feed_chunk(wire_tensor_asm_t *a, uint64_t total, uint64_t offset, uint32_t index, uint32_t count,
                         size_t len, bool *done)
{
    static uint8_t payload[64];
    int64_t shape[1] = {(int64_t)total};
    Fusion__TensorFrame tf = FUSION__TENSOR_FRAME__INIT;
    tf.dtype = FUSION__DTYPE__DTYPE_U8;
    tf.n_shape = 1;
    tf.shape = shape;
    tf.total_bytes = total;
    tf.offset = offset;
    tf.chunk_index = index;
    tf.chunk_count = count;
    tf.payload.data = payload;
    tf.payload.len = len;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_ACTIVATION, .job_id = 1, .sequence = index + 1};
    uint8_t *e, *b;
    size_t el, bl;
    assert_int_equal(wire_encode(&h, &tf.base, &e, &el, &b, &bl), FU_OK);
    wire_msg_t *m = NULL;
    assert_int_equal(wire_decode(e, el, b, bl, NULL, &m), FU_OK);
    fu_err rc = wire_tensor_asm_feed(a, NULL, m, done);
    wire_msg_destroy(&m);
    free(e);
    free(b);
    return rc;
}

static void test_wire_seal_tensor_bad_geometry_refused(void **state)
{
    (void)state;
    wire_tensor_asm_t *a = wire_tensor_asm_new(1024);
    bool done = false;
    /* 40 bytes in 3 chunks of 16: [0,16) [16,32) [32,40) */
    assert_int_equal(feed_chunk(a, 40, 16, 1, 3, 16, &done), FU_OK);
    assert_int_equal(feed_chunk(a, 40, 16, 1, 3, 16, &done), FU_EPROTO); /* duplicate */
    assert_int_equal(feed_chunk(a, 40, 8, 0, 3, 16, &done), FU_EPROTO);  /* wrong offset */
    assert_int_equal(feed_chunk(a, 40, 0, 0, 3, 8, &done), FU_EPROTO);   /* other stride: leaves a gap */
    assert_int_equal(feed_chunk(a, 40, 32, 2, 3, 16, &done), FU_EPROTO); /* past the end */
    assert_int_equal(feed_chunk(a, 40, 32, 2, 3, 8, &done), FU_OK);
    assert_false(done);
    assert_int_equal(feed_chunk(a, 40, 0, 0, 3, 16, &done), FU_OK);
    assert_true(done);
    wire_tensor t;
    assert_int_equal(wire_tensor_asm_take(a, &t), FU_OK);
    assert_int_equal(t.len, 40);
    wire_tensor_clear(&t);
    /* strides that cannot tile the tensor with that many chunks */
    assert_int_equal(feed_chunk(a, 40, 0, 0, 2, 16, &done), FU_EPROTO); /* 2 x 16 < 40 */
    assert_int_equal(feed_chunk(a, 40, 0, 0, 5, 16, &done), FU_EPROTO); /* 4 x 16 >= 40 */
    assert_int_equal(feed_chunk(a, 40, 7, 1, 3, 16, &done), FU_EPROTO); /* offset not index x stride */
    assert_int_equal(feed_chunk(a, 40, 0, 3, 3, 16, &done), FU_EPROTO); /* index out of range */
    assert_int_equal(feed_chunk(a, 2000, 0, 0, 1, 0, &done), FU_ENOMEM); /* over max_bytes */
    wire_tensor_asm_destroy(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_seal_both_directions_round_trip),
        cmocka_unit_test(test_wire_seal_relay_cannot_read),
        cmocka_unit_test(test_wire_seal_every_bit_flip_detected),
        cmocka_unit_test(test_wire_seal_replay_and_stale_refused),
        cmocka_unit_test(test_wire_seal_bad_keys_refused),
        cmocka_unit_test(test_wire_seal_tensor_direct_and_relayed),
        cmocka_unit_test(test_wire_seal_tensor_tampered_chunk_refused),
        cmocka_unit_test(test_wire_seal_tensor_bad_geometry_refused),
    };
    return tu_unit_main(tests, sodium_init, setup, teardown);
}
