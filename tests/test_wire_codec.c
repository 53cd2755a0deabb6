/* wire codec: every message type round-trips; truncated, garbage, oversized, wrong-version,
 * unknown-type, bad-enum and bad-UTF-8 frames are refused and counted, never crash or leak. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "testutil.h"
#include "wire.h"

/* Fills every field of a freshly allocated message of descriptor d with a non-default value
 * (strings with non-ASCII UTF-8, bytes with a pattern, repeated fields with two elements, enums
 * with their last value). Free with protobuf_c_message_free_unpacked(m, NULL). */
static ProtobufCMessage *fill_new(const ProtobufCMessageDescriptor *d, unsigned salt);

static void fill_value(const ProtobufCFieldDescriptor *f, void *p, unsigned salt)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
        *(int32_t *)p = -(int32_t)(7 + salt);
        break;
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        *(uint32_t *)p = 4000000000u - salt;
        break;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
        *(int64_t *)p = -(int64_t)(1234567890123ll + salt);
        break;
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        *(uint64_t *)p = 0xfedcba9876543210ull - salt;
        break;
    case PROTOBUF_C_TYPE_FLOAT:
        *(float *)p = 1.5f + (float)salt;
        break;
    case PROTOBUF_C_TYPE_DOUBLE:
        *(double *)p = 3.25 + salt;
        break;
    case PROTOBUF_C_TYPE_BOOL:
        *(protobuf_c_boolean *)p = 1;
        break;
    case PROTOBUF_C_TYPE_ENUM: {
        const ProtobufCEnumDescriptor *ed = f->descriptor;
        *(int *)p = ed->values[ed->n_values - 1].value;
        break;
    }
    case PROTOBUF_C_TYPE_STRING: {
        char buf[64];
        snprintf(buf, sizeof buf, "h\xc3\xa9llo-%s-%u", f->name, salt);
        *(char **)p = strdup(buf);
        break;
    }
    case PROTOBUF_C_TYPE_BYTES: {
        ProtobufCBinaryData *b = p;
        b->len = 33 + salt;
        b->data = malloc(b->len);
        for (size_t i = 0; i < b->len; i++)
            b->data[i] = (uint8_t)(i * 7 + salt);
        break;
    }
    case PROTOBUF_C_TYPE_MESSAGE:
        *(ProtobufCMessage **)p = fill_new(f->descriptor, salt + 1);
        break;
    }
}

/* The size of one element of a repeated field of each type: the stride of its array. */
static const size_t elem_size[] = {
    [PROTOBUF_C_TYPE_INT32] = sizeof(int32_t),
    [PROTOBUF_C_TYPE_SINT32] = sizeof(int32_t),
    [PROTOBUF_C_TYPE_SFIXED32] = sizeof(int32_t),
    [PROTOBUF_C_TYPE_INT64] = sizeof(int64_t),
    [PROTOBUF_C_TYPE_SINT64] = sizeof(int64_t),
    [PROTOBUF_C_TYPE_SFIXED64] = sizeof(int64_t),
    [PROTOBUF_C_TYPE_UINT32] = sizeof(uint32_t),
    [PROTOBUF_C_TYPE_FIXED32] = sizeof(uint32_t),
    [PROTOBUF_C_TYPE_UINT64] = sizeof(uint64_t),
    [PROTOBUF_C_TYPE_FIXED64] = sizeof(uint64_t),
    [PROTOBUF_C_TYPE_FLOAT] = sizeof(float),
    [PROTOBUF_C_TYPE_DOUBLE] = sizeof(double),
    [PROTOBUF_C_TYPE_BOOL] = sizeof(protobuf_c_boolean),
    [PROTOBUF_C_TYPE_ENUM] = sizeof(int),
    [PROTOBUF_C_TYPE_STRING] = sizeof(char *),
    [PROTOBUF_C_TYPE_BYTES] = sizeof(ProtobufCBinaryData),
    [PROTOBUF_C_TYPE_MESSAGE] = sizeof(ProtobufCMessage *),
};

static ProtobufCMessage *fill_new(const ProtobufCMessageDescriptor *d, unsigned salt)
{
    ProtobufCMessage *m = calloc(1, d->sizeof_message);
    d->message_init(m);
    char *base = (char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t es = elem_size[f->type];
            char *arr = calloc(2, es);
            for (unsigned k = 0; k < 2; k++)
                fill_value(f, arr + k * es, salt + k);
            *(size_t *)(base + f->quantifier_offset) = 2;
            *(char **)(base + f->offset) = arr;
        } else {
            fill_value(f, base + f->offset, salt);
        }
    }
    return m;
}

static const Fusion__MsgType all_types[] = {
    FUSION__MSG_TYPE__MSG_PEER_HELLO,     FUSION__MSG_TYPE__MSG_PEER_WELCOME,    FUSION__MSG_TYPE__MSG_HEARTBEAT,
    FUSION__MSG_TYPE__MSG_LEAVE,          FUSION__MSG_TYPE__MSG_STAGE_ASSIGN,    FUSION__MSG_TYPE__MSG_STAGE_READY,
    FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK,    FUSION__MSG_TYPE__MSG_ACTIVATION,
    FUSION__MSG_TYPE__MSG_GRADIENT,       FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT,  FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK,
    FUSION__MSG_TYPE__MSG_JOB_SUBMIT,     FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ,  FUSION__MSG_TYPE__MSG_JOB_STATUS,
    FUSION__MSG_TYPE__MSG_JOB_LIST_REQ,   FUSION__MSG_TYPE__MSG_JOB_LIST,        FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ,
    FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, FUSION__MSG_TYPE__MSG_JOB_CANCEL,    FUSION__MSG_TYPE__MSG_PEER_LIST_REQ,
    FUSION__MSG_TYPE__MSG_PEER_LIST,      FUSION__MSG_TYPE__MSG_ERROR,           FUSION__MSG_TYPE__MSG_ENROL,
    FUSION__MSG_TYPE__MSG_ENROL_ACK,      FUSION__MSG_TYPE__MSG_SEAL_HELLO,      FUSION__MSG_TYPE__MSG_STAGE_RELEASE,
    FUSION__MSG_TYPE__MSG_STAGE_START,    FUSION__MSG_TYPE__MSG_STEP_DONE,       FUSION__MSG_TYPE__MSG_INFER_TOKEN,
    FUSION__MSG_TYPE__MSG_VERIFY_REQUEST, FUSION__MSG_TYPE__MSG_VERIFY_SKETCH,  FUSION__MSG_TYPE__MSG_VERIFY_DELIVER,
    FUSION__MSG_TYPE__MSG_VERIFY_INPUT,
    FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ,
    FUSION__MSG_TYPE__MSG_LINK_PROBE,
    FUSION__MSG_TYPE__MSG_CHALLENGE,
    FUSION__MSG_TYPE__MSG_CHALLENGE_REPLY,
    FUSION__MSG_TYPE__MSG_MODEL_UPLOAD,
    FUSION__MSG_TYPE__MSG_MODEL_CHUNK,
    FUSION__MSG_TYPE__MSG_UPLOAD_STATUS,
    FUSION__MSG_TYPE__MSG_SESSION_OPEN,
    FUSION__MSG_TYPE__MSG_SESSION_STATUS_REQ,
    FUSION__MSG_TYPE__MSG_SESSION_STATUS,
    FUSION__MSG_TYPE__MSG_SESSION_CLOSE,
    FUSION__MSG_TYPE__MSG_SESSION_START,
    FUSION__MSG_TYPE__MSG_SESSION_END,
    FUSION__MSG_TYPE__MSG_GATEWAY_CLOSED,
    FUSION__MSG_TYPE__MSG_GATEWAY_HELLO,
    FUSION__MSG_TYPE__MSG_GATEWAY_POLICY,
};
#define N_ALL (sizeof all_types / sizeof all_types[0])

static wire_hdr sample_hdr(Fusion__MsgType t)
{
    return (wire_hdr){.type = t,
                      .job_id = 42,
                      .step = 7,
                      .micro_batch = 3,
                      .sequence = 99,
                      .stage = 2,
                      .sender = "peer-\xc3\xa9",
                      .relay_to = NULL};
}

static void test_wire_codec_every_type_is_known_and_named(void **state)
{
    (void)state;
    /* The table covers every value of the MsgType enum except 0. */
    const ProtobufCEnumDescriptor *ed = &fusion__msg_type__descriptor;
    assert_int_equal(ed->n_values - 1, N_ALL);
    for (unsigned i = 0; i < ed->n_values; i++) {
        Fusion__MsgType t = (Fusion__MsgType)ed->values[i].value;
        if (t == FUSION__MSG_TYPE__MSG_UNSPECIFIED) {
            assert_false(wire_type_known(t));
            continue;
        }
        assert_true(wire_type_known(t));
        assert_string_equal(wire_type_name(t), ed->values[i].name);
    }
    assert_false(wire_type_known((Fusion__MsgType)999));
    assert_string_equal(wire_type_name((Fusion__MsgType)999), "MSG_?");
}

static void test_wire_codec_every_message_round_trips(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_ALL; i++) {
        Fusion__MsgType t = all_types[i];
        const ProtobufCMessageDescriptor *d = wire_type_body(t);
        ProtobufCMessage *body = d ? fill_new(d, (unsigned)i) : NULL;
        wire_hdr h = sample_hdr(t);
        uint8_t *env = NULL, *b = NULL;
        size_t env_len = 0, b_len = 0;
        assert_int_equal(wire_encode(&h, body, &env, &env_len, &b, &b_len), FU_OK);
        if (d)
            assert_true(b_len > 0);
        wire_counters c = {0};
        wire_msg_t *m = NULL;
        assert_int_equal(wire_decode(env, env_len, b, b_len, &c, &m), FU_OK);
        assert_int_equal(c.received, 1);
        assert_int_equal(wire_counters_dropped(&c), 0);
        const wire_hdr *got = wire_msg_hdr(m);
        assert_int_equal(got->type, t);
        assert_int_equal(got->job_id, 42);
        assert_int_equal(got->step, 7);
        assert_int_equal(got->micro_batch, 3);
        assert_int_equal(got->sequence, 99);
        assert_int_equal(got->stage, 2);
        assert_string_equal(got->sender, "peer-\xc3\xa9");
        assert_string_equal(got->relay_to, "");
        if (d) {
            const ProtobufCMessage *gb = wire_msg_body(m);
            assert_non_null(gb);
            assert_ptr_equal(gb, wire_msg_body_as(m, t));
            assert_null(wire_msg_body_as(m, t == FUSION__MSG_TYPE__MSG_ERROR ? FUSION__MSG_TYPE__MSG_LEAVE
                                                                             : FUSION__MSG_TYPE__MSG_ERROR));
            size_t n2 = protobuf_c_message_get_packed_size(gb);
            assert_int_equal(n2, b_len);
            uint8_t *again = malloc(n2);
            protobuf_c_message_pack(gb, again);
            assert_memory_equal(again, b, b_len);
            free(again);
            assert_true(wire_msg_heap_bytes(m) > 0);
        } else {
            assert_null(wire_msg_body(m));
        }
        wire_msg_destroy(&m);
        assert_null(m);
        free(env);
        free(b);
        if (body)
            protobuf_c_message_free_unpacked(body, NULL);
    }
}

static void test_wire_codec_encode_refuses_mismatched_body(void **state)
{
    (void)state;
    Fusion__Leave leave = FUSION__LEAVE__INIT;
    wire_hdr h = sample_hdr(FUSION__MSG_TYPE__MSG_HEARTBEAT);
    uint8_t *e, *b;
    size_t el, bl;
    assert_int_equal(wire_encode(&h, &leave.base, &e, &el, &b, &bl), FU_EINVAL); /* wrong body type */
    h.type = FUSION__MSG_TYPE__MSG_PEER_LIST_REQ;
    assert_int_equal(wire_encode(&h, &leave.base, &e, &el, &b, &bl), FU_EINVAL); /* body where none goes */
    h.type = (Fusion__MsgType)555;
    assert_int_equal(wire_encode(&h, NULL, &e, &el, &b, &bl), FU_EINVAL); /* unknown type */
    h.type = FUSION__MSG_TYPE__MSG_LEAVE;
    assert_int_equal(wire_encode(&h, NULL, &e, &el, &b, &bl), FU_EINVAL); /* missing body */
}

/* A message as wire_encode writes it: the envelope frame and the body frame (owned). */
typedef struct {
    uint8_t *env, *b;
    size_t el, bl;
} frames;

static void frames_free(frames *f)
{
    free(f->env);
    free(f->b);
}

/* A valid Leave message, encoded. */
static frames leave_frames(const char *reason)
{
    Fusion__Leave leave = FUSION__LEAVE__INIT;
    leave.reason = (char *)reason;
    wire_hdr h = sample_hdr(FUSION__MSG_TYPE__MSG_LEAVE);
    frames f;
    assert_int_equal(wire_encode(&h, &leave.base, &f.env, &f.el, &f.b, &f.bl), FU_OK);
    return f;
}

/* Encodes h with body (which must succeed) and returns what decoding the frames gives; c counts. */
static fu_err decode_of(const wire_hdr *h, const ProtobufCMessage *body, wire_counters *c)
{
    frames f;
    assert_int_equal(wire_encode(h, body, &f.env, &f.el, &f.b, &f.bl), FU_OK);
    wire_msg_t *m = NULL;
    fu_err rc = wire_decode(f.env, f.el, f.b, f.bl, c, &m);
    wire_msg_destroy(&m);
    frames_free(&f);
    return rc;
}

static void test_wire_codec_truncated_frames_refused(void **state)
{
    (void)state;
    const ProtobufCMessageDescriptor *d = wire_type_body(FUSION__MSG_TYPE__MSG_STAGE_ASSIGN);
    ProtobufCMessage *body = fill_new(d, 1);
    wire_hdr h = sample_hdr(FUSION__MSG_TYPE__MSG_STAGE_ASSIGN);
    uint8_t *env, *b;
    size_t el, bl;
    assert_int_equal(wire_encode(&h, body, &env, &el, &b, &bl), FU_OK);
    protobuf_c_message_free_unpacked(body, NULL);
    wire_counters c = {0};
    size_t refused = 0;
    for (size_t cut = 0; cut < bl; cut++) {
        wire_msg_t *m = NULL;
        uint8_t *copy = malloc(cut ? cut : 1); /* exact-size copy: ASan sees any over-read */
        memcpy(copy, b, cut);
        fu_err rc = wire_decode(env, el, copy, cut, &c, &m);
        /* A cut at a field boundary is a valid (shorter) message; anything else is refused. */
        if (rc != FU_OK) {
            assert_int_equal(rc, FU_EPROTO);
            assert_null(m);
            refused++;
        }
        wire_msg_destroy(&m);
        free(copy);
    }
    assert_true(refused > bl / 2);
    size_t env_refused = 0;
    for (size_t cut = 0; cut < el; cut++) {
        wire_msg_t *m = NULL;
        uint8_t *copy = malloc(cut ? cut : 1);
        memcpy(copy, env, cut);
        fu_err rc = wire_decode(copy, cut, b, bl, &c, &m);
        if (cut < 4) /* version or type missing */
            assert_int_not_equal(rc, FU_OK);
        if (rc != FU_OK)
            env_refused++;
        wire_msg_destroy(&m);
        free(copy);
    }
    assert_true(wire_counters_dropped(&c) == refused + env_refused);
    free(env);
    free(b);
}

static void test_wire_codec_garbage_refused(void **state)
{
    (void)state;
    wire_counters c = {0};
    frames lv = leave_frames("bye");
    uint32_t seed = 12345;
    for (int iter = 0; iter < 20000; iter++) {
        uint8_t junk[256];
        size_t n = (size_t)(iter % 256);
        for (size_t i = 0; i < n; i++) {
            seed = seed * 1103515245u + 12345u;
            junk[i] = (uint8_t)(seed >> 16);
        }
        wire_msg_t *m = NULL;
        /* garbage body with a good envelope, and a garbage envelope with a good body */
        if (wire_decode(lv.env, lv.el, junk, n, &c, &m) == FU_OK)
            assert_non_null(wire_msg_body(m));
        wire_msg_destroy(&m);
        if (wire_decode(junk, n, lv.b, lv.bl, &c, &m) == FU_OK)
            assert_int_equal(wire_msg_hdr(m)->type, FUSION__MSG_TYPE__MSG_LEAVE);
        wire_msg_destroy(&m);
    }
    assert_true(wire_counters_dropped(&c) > 30000);
    frames_free(&lv);
}

static void test_wire_codec_wrong_version_and_unknown_type(void **state)
{
    (void)state;
    frames lv = leave_frames("bye");
    wire_counters c = {0};
    wire_msg_t *m = NULL;

    Fusion__Envelope e = FUSION__ENVELOPE__INIT;
    e.version = WIRE_PROTOCOL_VERSION + 1;
    e.type = FUSION__MSG_TYPE__MSG_LEAVE;
    uint8_t buf[256];
    size_t n = protobuf_c_message_pack(&e.base, buf);
    assert_int_equal(wire_decode(buf, n, lv.b, lv.bl, &c, &m), FU_EVERSION);
    assert_null(m);
    assert_int_equal(c.dropped_version, 1);

    e.version = WIRE_PROTOCOL_VERSION;
    e.type = (Fusion__MsgType)77; /* not in the schema */
    n = protobuf_c_message_pack(&e.base, buf);
    assert_int_equal(wire_decode(buf, n, lv.b, lv.bl, &c, &m), FU_EPROTO);
    assert_int_equal(c.dropped_unknown_type, 1);

    e.type = FUSION__MSG_TYPE__MSG_UNSPECIFIED;
    n = protobuf_c_message_pack(&e.base, buf);
    assert_int_equal(wire_decode(buf, n, lv.b, lv.bl, &c, &m), FU_EPROTO);
    assert_int_equal(c.dropped_unknown_type, 2);

    /* no version at all (an empty envelope) */
    assert_int_equal(wire_decode(buf, 0, lv.b, lv.bl, &c, &m), FU_EVERSION);
    assert_int_equal(c.received, 0);
    frames_free(&lv);
}

static void test_wire_codec_bad_enum_and_utf8_refused(void **state)
{
    (void)state;
    wire_counters c = {0};

    /* Heartbeat.state = 99: protobuf-c accepts it; the validator must not. */
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    hb.state = (Fusion__PeerState)99;
    wire_hdr h = sample_hdr(FUSION__MSG_TYPE__MSG_HEARTBEAT);
    assert_int_equal(decode_of(&h, &hb.base, &c), FU_EPROTO);
    assert_int_equal(c.dropped_malformed, 1);

    /* A bad enum inside a repeated sub-message (PeerHello.profile.speeds[1].dtype). */
    Fusion__DtypeSpeed s0 = FUSION__DTYPE_SPEED__INIT, s1 = FUSION__DTYPE_SPEED__INIT;
    s0.dtype = FUSION__DTYPE__DTYPE_F32;
    s1.dtype = (Fusion__Dtype)1000;
    Fusion__DtypeSpeed *speeds[2] = {&s0, &s1};
    Fusion__PeerProfile prof = FUSION__PEER_PROFILE__INIT;
    prof.n_speeds = 2;
    prof.speeds = speeds;
    Fusion__PeerHello hello = FUSION__PEER_HELLO__INIT;
    hello.profile = &prof;
    h.type = FUSION__MSG_TYPE__MSG_PEER_HELLO;
    assert_int_equal(decode_of(&h, &hello.base, &c), FU_EPROTO);
    assert_int_equal(c.dropped_malformed, 2);
    s1.dtype = FUSION__DTYPE__DTYPE_BF16;
    assert_int_equal(decode_of(&h, &hello.base, &c), FU_OK);

    /* Invalid UTF-8 in a body string and in the envelope's sender. */
    const char *bad[] = {"\xff", "a\xc3", "\xc0\xaf" /* overlong */, "\xed\xa0\x80" /* surrogate */,
                         "\xf4\x90\x80\x80" /* > U+10FFFF */};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        Fusion__Leave leave = FUSION__LEAVE__INIT;
        leave.reason = (char *)bad[i];
        h = sample_hdr(FUSION__MSG_TYPE__MSG_LEAVE);
        if (decode_of(&h, &leave.base, &c) != FU_EPROTO)
            fail_msg("bad string %zu in a body accepted", i);
        h.sender = bad[i];
        leave.reason = (char *)"fine";
        if (decode_of(&h, &leave.base, &c) != FU_EPROTO)
            fail_msg("bad string %zu as the sender accepted", i);
    }
    assert_true(wire_utf8_valid("\xe2\x82\xac \xf0\x9f\x98\x80", 8));
    assert_int_equal(c.received, 1);
}

static void test_wire_codec_oversized_refused(void **state)
{
    (void)state;
    frames lv = leave_frames("bye");
    wire_counters c = {0};
    wire_msg_t *m = NULL;

    /* A control message's body over WIRE_MAX_CONTROL_BYTES: refused before unpacking. */
    size_t big = WIRE_MAX_CONTROL_BYTES + 1;
    uint8_t *junk = calloc(1, big);
    assert_int_equal(wire_decode(lv.env, lv.el, junk, big, &c, &m), FU_ENOMEM);
    assert_int_equal(c.dropped_too_large, 1);
    /* An envelope frame over WIRE_MAX_ENVELOPE_BYTES. */
    assert_int_equal(wire_decode(junk, WIRE_MAX_ENVELOPE_BYTES + 1, lv.b, lv.bl, &c, &m), FU_ENOMEM);
    assert_int_equal(c.dropped_too_large, 2);
    free(junk);

    /* An expansion bomb within the frame cap: PeerList with 60000 empty PeerInfo entries is
     * 120 KB on the wire but would unpack to megabytes; the budget (or the repeated cap) stops it. */
    size_t n_entries = 60000;
    uint8_t *bomb = malloc(n_entries * 2);
    for (size_t i = 0; i < n_entries; i++) {
        bomb[2 * i] = (1 << 3) | 2; /* field 1, length-delimited */
        bomb[2 * i + 1] = 0;        /* empty sub-message */
    }
    Fusion__Envelope e = FUSION__ENVELOPE__INIT;
    e.version = WIRE_PROTOCOL_VERSION;
    e.type = FUSION__MSG_TYPE__MSG_PEER_LIST;
    uint8_t eb[64];
    size_t en = protobuf_c_message_pack(&e.base, eb);
    assert_int_equal(wire_decode(eb, en, bomb, n_entries * 2, &c, &m), FU_ENOMEM);
    assert_null(m);
    assert_int_equal(c.dropped_too_large, 3);
    /* 5000 entries are under WIRE_MAX_REPEATED and the budget: accepted */
    assert_int_equal(wire_decode(eb, en, bomb, 5000 * 2, &c, &m), FU_OK);
    wire_msg_destroy(&m);
    free(bomb);

    /* Encoding refuses to make an oversized control message. */
    Fusion__Leave leave = FUSION__LEAVE__INIT;
    char *huge = malloc(WIRE_MAX_CONTROL_BYTES + 10);
    memset(huge, 'x', WIRE_MAX_CONTROL_BYTES + 9);
    huge[WIRE_MAX_CONTROL_BYTES + 9] = '\0';
    leave.reason = huge;
    wire_hdr h = sample_hdr(FUSION__MSG_TYPE__MSG_LEAVE);
    uint8_t *e2, *b2;
    size_t el2, bl2;
    assert_int_equal(wire_encode(&h, &leave.base, &e2, &el2, &b2, &bl2), FU_EINVAL);
    free(huge);
    frames_free(&lv);
}

static void test_wire_codec_long_list_of_small_entries_accepted(void **state)
{
    (void)state;
    /* 1000 nearly empty JobStatus entries: a few KB on the wire that expand ~50x in memory. A
     * legitimate message: the budget must not refuse it. */
    enum { N = 1000 };
    Fusion__JobStatus *items = calloc(N, sizeof *items);
    Fusion__JobStatus **ptrs = calloc(N, sizeof *ptrs);
    for (size_t i = 0; i < N; i++) {
        fusion__job_status__init(&items[i]);
        items[i].job_id = i + 1;
        ptrs[i] = &items[i];
    }
    Fusion__JobList list = FUSION__JOB_LIST__INIT;
    list.n_jobs = N;
    list.jobs = ptrs;
    wire_hdr h = sample_hdr(FUSION__MSG_TYPE__MSG_JOB_LIST);
    uint8_t *e, *b;
    size_t el, bl;
    assert_int_equal(wire_encode(&h, &list.base, &e, &el, &b, &bl), FU_OK);
    wire_msg_t *m = NULL;
    assert_int_equal(wire_decode(e, el, b, bl, NULL, &m), FU_OK);
    const Fusion__JobList *got = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_LIST);
    assert_int_equal(got->n_jobs, N);
    assert_int_equal(got->jobs[N - 1]->job_id, N);
    assert_true(wire_msg_heap_bytes(m) > 20 * bl);
    wire_msg_destroy(&m);
    free(e);
    free(b);
    free(items);
    free(ptrs);
}

static void test_wire_codec_unpack_budgeted(void **state)
{
    (void)state;
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.idempotency_key = (char *)"k1";
    uint8_t data[5000];
    memset(data, 7, sizeof data);
    js.data.data = data;
    js.data.len = sizeof data;
    size_t n = protobuf_c_message_get_packed_size(&js.base);
    uint8_t *buf = malloc(n);
    protobuf_c_message_pack(&js.base, buf);
    ProtobufCMessage *m = NULL;
    assert_int_equal(wire_unpack_budgeted(&fusion__job_submit__descriptor, buf, n, 1000, &m), FU_ENOMEM);
    assert_null(m);
    assert_int_equal(wire_unpack_budgeted(&fusion__job_submit__descriptor, buf, n, 64 * 1024, &m), FU_OK);
    assert_string_equal(((Fusion__JobSubmit *)m)->idempotency_key, "k1");
    assert_int_equal(((Fusion__JobSubmit *)m)->data.len, sizeof data);
    wire_unpacked_free(m);
    assert_int_equal(wire_unpack_budgeted(&fusion__job_submit__descriptor, buf, n - 1, 64 * 1024, &m), FU_EPROTO);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_codec_every_type_is_known_and_named),
        cmocka_unit_test(test_wire_codec_every_message_round_trips),
        cmocka_unit_test(test_wire_codec_encode_refuses_mismatched_body),
        cmocka_unit_test(test_wire_codec_truncated_frames_refused),
        cmocka_unit_test(test_wire_codec_garbage_refused),
        cmocka_unit_test(test_wire_codec_wrong_version_and_unknown_type),
        cmocka_unit_test(test_wire_codec_bad_enum_and_utf8_refused),
        cmocka_unit_test(test_wire_codec_oversized_refused),
        cmocka_unit_test(test_wire_codec_long_list_of_small_entries_accepted),
        cmocka_unit_test(test_wire_codec_unpack_budgeted),
    };
    return tu_unit_main(tests, sodium_init, NULL, NULL);
}
