/* wire over real sockets on tcp://127.0.0.1: round trips through ROUTER/DEALER, malformed
 * multipart messages dropped and counted (and answered when asked), an oversized message never
 * delivered, ROUTER_MANDATORY, and the broker's relay (wire_forward). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <zmq.h>

#include "testutil.h"
#include "wire.h"
#include "wire_socket.h"

typedef struct {
    void *ctx;
    void *router;
    char endpoint[256];
    void *extra[8];  /* sockets a test opened: closed by teardown even when an assertion fails */
    size_t n_extra;
} fixture;

static void set_rcvtimeo(void *s, int ms)
{
    assert_int_equal(zmq_setsockopt(s, ZMQ_RCVTIMEO, &ms, sizeof ms), 0);
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    f->ctx = zmq_ctx_new();
    fu_err rc;
    f->router = wire_socket_new(f->ctx, ZMQ_ROUTER, &rc);
    assert_non_null(f->router);
    assert_int_equal(zmq_bind(f->router, "tcp://127.0.0.1:*"), 0);
    assert_int_equal(wire_socket_endpoint(f->router, f->endpoint, sizeof f->endpoint), FU_OK);
    set_rcvtimeo(f->router, 5000);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    wire_socket_close(&f->router);
    for (size_t i = 0; i < f->n_extra; i++)
        wire_socket_close(&f->extra[i]);
    zmq_ctx_term(f->ctx);
    free(f);
    return 0;
}

static void *dealer(fixture *f)
{
    fu_err rc;
    void *d = wire_socket_new(f->ctx, ZMQ_DEALER, &rc);
    assert_non_null(d);
    assert_int_equal(rc, FU_OK);
    assert_int_equal(zmq_connect(d, f->endpoint), 0);
    set_rcvtimeo(d, 5000);
    f->extra[f->n_extra++] = d;
    return d;
}

static void test_wire_socket_options_set_on_purpose(void **state)
{
    fixture *f = *state;
    int v;
    size_t sz = sizeof v;
    assert_int_equal(zmq_getsockopt(f->router, ZMQ_LINGER, &v, &sz), 0);
    assert_int_equal(v, WIRE_LINGER_MS);
    int64_t max;
    sz = sizeof max;
    assert_int_equal(zmq_getsockopt(f->router, ZMQ_MAXMSGSIZE, &max, &sz), 0);
    assert_int_equal(max, WIRE_MAX_MSG_BYTES);
    sz = sizeof v;
    assert_int_equal(zmq_getsockopt(f->router, ZMQ_SNDHWM, &v, &sz), 0);
    assert_int_equal(v, WIRE_HWM);
    assert_int_equal(zmq_getsockopt(f->router, ZMQ_HEARTBEAT_IVL, &v, &sz), 0);
    assert_int_equal(v, 1000);
    assert_int_equal(zmq_getsockopt(f->router, ZMQ_HEARTBEAT_TIMEOUT, &v, &sz), 0);
    assert_int_equal(v, 3000);
    assert_int_equal(zmq_getsockopt(f->router, ZMQ_SNDTIMEO, &v, &sz), 0);
    assert_int_equal(v, 0); /* a ROUTER never blocks on one peer */
    void *d = dealer(f);
    assert_int_equal(zmq_getsockopt(d, ZMQ_SNDTIMEO, &v, &sz), 0);
    assert_int_equal(v, WIRE_SEND_TIMEOUT_MS);
}

/* A quiet socket (the broker's ROUTER, a peer's socket to it) sends no ZMTP pings and leaves a
 * vanished other end to the kernel's TCP keepalive and retransmission limit; it still carries
 * messages. */
static void test_wire_socket_quiet_leaves_liveness_to_tcp(void **state)
{
    fixture *f = *state;
    fu_err rc;
    void *d = wire_socket_new(f->ctx, ZMQ_DEALER, &rc);
    assert_non_null(d);
    f->extra[f->n_extra++] = d;
    assert_int_equal(wire_socket_quiet(d), FU_OK);
    static const struct {
        int opt, want;
    } want[] = {{ZMQ_HEARTBEAT_IVL, 0},
                {ZMQ_TCP_KEEPALIVE, 1},
                {ZMQ_TCP_KEEPALIVE_IDLE, WIRE_KEEPALIVE_IDLE_S},
                {ZMQ_TCP_KEEPALIVE_INTVL, WIRE_KEEPALIVE_INTVL_S},
                {ZMQ_TCP_KEEPALIVE_CNT, WIRE_KEEPALIVE_CNT},
                {ZMQ_TCP_MAXRT, WIRE_TCP_MAXRT_MS}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        int v = -7;
        size_t sz = sizeof v;
        assert_int_equal(zmq_getsockopt(d, want[i].opt, &v, &sz), 0);
        assert_int_equal(v, want[i].want);
    }
    assert_int_equal(zmq_connect(d, f->endpoint), 0);
    set_rcvtimeo(d, 5000);
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_HEARTBEAT, .sequence = 9};
    assert_int_equal(wire_send(d, NULL, 0, &h, &hb.base), FU_OK);
    wire_counters c = {0};
    wire_msg_t *m = NULL;
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_OK);
    assert_int_equal(wire_msg_hdr(m)->sequence, 9);
    wire_msg_destroy(&m);
}

static void test_wire_socket_round_trip_router_dealer(void **state)
{
    fixture *f = *state;
    void *d = dealer(f);
    Fusion__PeerHello hello = FUSION__PEER_HELLO__INIT;
    Fusion__PeerProfile prof = FUSION__PEER_PROFILE__INIT;
    prof.device_name = (char *)"cpu";
    prof.threads = 2;
    hello.profile = &prof;
    hello.name = (char *)"p1";
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_PEER_HELLO, .sequence = 1};
    assert_int_equal(wire_send(d, NULL, 0, &h, &hello.base), FU_OK);

    wire_counters c = {0};
    wire_msg_t *m = NULL;
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_OK);
    assert_int_equal(c.received, 1);
    const Fusion__PeerHello *got = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_HELLO);
    assert_non_null(got);
    assert_string_equal(got->name, "p1");
    assert_int_equal(got->profile->threads, 2);
    assert_string_equal(wire_msg_user_id(m), ""); /* no ZAP on this socket */
    size_t rl;
    const uint8_t *rid = wire_msg_routing_id(m, &rl);
    assert_non_null(rid);
    assert_true(rl > 0);

    Fusion__PeerWelcome w = FUSION__PEER_WELCOME__INIT;
    w.heartbeat_ms = 1000;
    wire_hdr hw = {.type = FUSION__MSG_TYPE__MSG_PEER_WELCOME};
    assert_int_equal(wire_send(f->router, rid, rl, &hw, &w.base), FU_OK);
    wire_msg_destroy(&m);

    wire_counters dc = {0};
    assert_int_equal(wire_recv(d, 0, &dc, &m), FU_OK);
    const Fusion__PeerWelcome *gw = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_WELCOME);
    assert_non_null(gw);
    assert_int_equal(gw->heartbeat_ms, 1000);
    wire_msg_destroy(&m);

    /* Nothing else queued. */
    assert_int_equal(wire_recv(d, WIRE_DONTWAIT, &dc, &m), FU_EAGAIN);
}

/* Sends raw frames from a plain ZeroMQ socket. */
static void send_frames(void *s, const void *const *data, const size_t *len, size_t n)
{
    for (size_t i = 0; i < n; i++)
        assert_true(zmq_send(s, data[i], len[i], i + 1 < n ? ZMQ_SNDMORE : 0) >= 0);
}

static void test_wire_socket_malformed_dropped_counted_answered(void **state)
{
    fixture *f = *state;
    void *d = dealer(f);
    wire_counters c = {0};
    wire_msg_t *m = NULL;

    /* A valid envelope/body pair to mutate. */
    Fusion__Leave leave = FUSION__LEAVE__INIT;
    leave.reason = (char *)"bye";
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_LEAVE, .sequence = 5};
    uint8_t *env, *body;
    size_t el, bl;
    assert_int_equal(wire_encode(&h, &leave.base, &env, &el, &body, &bl), FU_OK);

    /* one frame only */
    send_frames(d, (const void *[]){env}, (size_t[]){el}, 1);
    assert_int_equal(wire_recv(f->router, WIRE_REPLY_ERRORS, &c, &m), FU_EPROTO);
    assert_int_equal(c.dropped_frames, 1);
    /* three frames */
    send_frames(d, (const void *[]){env, body, body}, (size_t[]){el, bl, bl}, 3);
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_EPROTO);
    assert_int_equal(c.dropped_frames, 2);
    /* garbage envelope */
    send_frames(d, (const void *[]){"\xff\xff\xff", body}, (size_t[]){3, bl}, 2);
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_EPROTO);
    assert_int_equal(c.dropped_malformed, 1);
    /* wrong version, answered with an Error */
    Fusion__Envelope e = FUSION__ENVELOPE__INIT;
    e.version = 9;
    e.type = FUSION__MSG_TYPE__MSG_LEAVE;
    e.sequence = 77;
    uint8_t eb[64];
    size_t en = protobuf_c_message_pack(&e.base, eb);
    send_frames(d, (const void *[]){eb, body}, (size_t[]){en, bl}, 2);
    assert_int_equal(wire_recv(f->router, WIRE_REPLY_ERRORS, &c, &m), FU_EVERSION);
    assert_int_equal(c.dropped_version, 1);
    assert_int_equal(c.errors_replied, 1); /* a message without its frames is not answered */
    /* unknown type */
    e.version = WIRE_PROTOCOL_VERSION;
    e.type = (Fusion__MsgType)200;
    en = protobuf_c_message_pack(&e.base, eb);
    send_frames(d, (const void *[]){eb, body}, (size_t[]){en, bl}, 2);
    assert_int_equal(wire_recv(f->router, WIRE_REPLY_ERRORS, &c, &m), FU_EPROTO);
    assert_int_equal(c.dropped_unknown_type, 1);
    assert_int_equal(c.errors_replied, 2);

    /* The dealer got the Errors, with the right codes. */
    wire_counters dc = {0};
    Fusion__ErrorCode want[] = {FUSION__ERROR_CODE__ERR_VERSION, FUSION__ERROR_CODE__ERR_UNKNOWN_TYPE};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(wire_recv(d, 0, &dc, &m), FU_OK);
        const Fusion__Error *err = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        assert_non_null(err);
        assert_int_equal(err->code, want[i]);
        if (i == 0) {
            assert_int_equal(err->sequence, 77);
            assert_int_equal(err->in_reply_to, FUSION__MSG_TYPE__MSG_LEAVE);
        }
        wire_msg_destroy(&m);
    }

    /* An Error that is itself malformed is never answered (no ping-pong of errors). */
    e.version = 9;
    e.type = FUSION__MSG_TYPE__MSG_ERROR;
    en = protobuf_c_message_pack(&e.base, eb);
    send_frames(d, (const void *[]){eb, ""}, (size_t[]){en, 0}, 2);
    assert_int_equal(wire_recv(f->router, WIRE_REPLY_ERRORS, &c, &m), FU_EVERSION);
    assert_int_equal(c.errors_replied, 2);

    /* The socket still serves well-formed messages. */
    send_frames(d, (const void *[]){env, body}, (size_t[]){el, bl}, 2);
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_OK);
    assert_string_equal(((const Fusion__Leave *)wire_msg_body(m))->reason, "bye");
    wire_msg_destroy(&m);
    assert_int_equal(c.received, 1);
    assert_int_equal(wire_counters_dropped(&c), 6);
    free(env);
    free(body);
}

static void test_wire_socket_oversized_message_never_delivered(void **state)
{
    fixture *f = *state;
    /* A raw socket without our limits sends a frame over ZMQ_MAXMSGSIZE: libzmq drops the
     * connection; nothing reaches the application. */
    void *raw = zmq_socket(f->ctx, ZMQ_DEALER);
    f->extra[f->n_extra++] = raw;
    int linger = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &linger, sizeof linger);
    assert_int_equal(zmq_connect(raw, f->endpoint), 0);
    size_t big = WIRE_MAX_MSG_BYTES + 1024;
    uint8_t *junk = calloc(1, big);
    uint8_t env[] = {0x08, 0x01, 0x10, 0x04}; /* version 1, MSG_LEAVE */
    send_frames(raw, (const void *[]){env, junk}, (size_t[]){sizeof env, big}, 2);
    free(junk);
    set_rcvtimeo(f->router, 1500);
    f->extra[--f->n_extra] = NULL;
    wire_counters c = {0};
    wire_msg_t *m = NULL;
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_ETIMEDOUT);
    assert_null(m);
    assert_int_equal(c.received, 0);
    zmq_close(raw);

    /* wire_send refuses to make one. */
    void *d = dealer(f);
    uint8_t *buf = malloc(WIRE_MAX_MSG_BYTES + 1);
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_ACTIVATION};
    assert_int_equal(wire_send_packed(d, NULL, 0, &h, buf, WIRE_MAX_MSG_BYTES + 1, NULL, NULL), FU_EINVAL);
    free(buf);
    /* and another connection is served as before */
    Fusion__Leave leave = FUSION__LEAVE__INIT;
    h.type = FUSION__MSG_TYPE__MSG_LEAVE;
    assert_int_equal(wire_send(d, NULL, 0, &h, &leave.base), FU_OK);
    set_rcvtimeo(f->router, 5000);
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_OK);
    wire_msg_destroy(&m);
}

static void test_wire_socket_router_mandatory(void **state)
{
    fixture *f = *state;
    Fusion__Leave leave = FUSION__LEAVE__INIT;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_LEAVE};
    const uint8_t nobody[] = {0, 1, 2, 3, 4};
    assert_int_equal(wire_send(f->router, nobody, sizeof nobody, &h, &leave.base), FU_ENOTFOUND);
}

static void test_wire_socket_forward_relays_body_unchanged(void **state)
{
    fixture *f = *state;
    void *a = dealer(f), *b = dealer(f);
    wire_counters c = {0};
    wire_msg_t *m = NULL;
    /* b says hello so the broker learns its routing id */
    wire_hdr hb = {.type = FUSION__MSG_TYPE__MSG_HEARTBEAT};
    Fusion__Heartbeat beat = FUSION__HEARTBEAT__INIT;
    assert_int_equal(wire_send(b, NULL, 0, &hb, &beat.base), FU_OK);
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_OK);
    size_t brl;
    const uint8_t *brid_p = wire_msg_routing_id(m, &brl);
    uint8_t brid[256];
    memcpy(brid, brid_p, brl);
    wire_msg_destroy(&m);

    /* a sends a checkpoint-sized frame addressed to b through the broker */
    Fusion__CheckpointPut put = FUSION__CHECKPOINT_PUT__INIT;
    size_t n = 3 << 20;
    uint8_t *blob = malloc(n);
    for (size_t i = 0; i < n; i++)
        blob[i] = (uint8_t)(i * 31);
    put.data.data = blob;
    put.data.len = n;
    put.total = n;
    wire_hdr ha = {.type = FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, .job_id = 9, .sequence = 3, .relay_to = "B-key"};
    assert_int_equal(wire_send(a, NULL, 0, &ha, &put.base), FU_OK);
    assert_int_equal(wire_recv(f->router, 0, &c, &m), FU_OK);
    assert_string_equal(wire_msg_hdr(m)->relay_to, "B-key");
    assert_int_equal(wire_forward(f->router, brid, brl, m, "A-key"), FU_OK);
    wire_msg_destroy(&m);

    assert_int_equal(wire_recv(b, 0, &c, &m), FU_OK);
    const wire_hdr *h = wire_msg_hdr(m);
    assert_int_equal(h->type, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT);
    assert_int_equal(h->job_id, 9);
    assert_int_equal(h->sequence, 3);
    assert_string_equal(h->sender, "A-key");
    assert_string_equal(h->relay_to, "");
    const Fusion__CheckpointPut *got = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT);
    assert_int_equal(got->data.len, n);
    assert_memory_equal(got->data.data, blob, n);
    wire_msg_destroy(&m);
    free(blob);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_socket_options_set_on_purpose),
        cmocka_unit_test(test_wire_socket_quiet_leaves_liveness_to_tcp),
        cmocka_unit_test(test_wire_socket_round_trip_router_dealer),
        cmocka_unit_test(test_wire_socket_malformed_dropped_counted_answered),
        cmocka_unit_test(test_wire_socket_oversized_message_never_delivered),
        cmocka_unit_test(test_wire_socket_router_mandatory),
        cmocka_unit_test(test_wire_socket_forward_relays_body_unchanged),
    };
    return tu_unit_main(tests, sodium_init, setup, teardown);
}
