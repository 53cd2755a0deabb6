#include "wire.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "fu_alloc.h"
#include "fu_log.h"
#include "wire_zap.h"

/* ---------- the type table ---------- */

typedef struct {
    Fusion__MsgType type;
    const ProtobufCMessageDescriptor *body; /* NULL: empty body */
    bool bulk;                              /* body may exceed WIRE_MAX_CONTROL_BYTES */
    const char *name;
} wire_type_info;

#define T(t, d, b) {FUSION__MSG_TYPE__##t, d, b, #t}
static const wire_type_info type_table[] = {
    T(MSG_PEER_HELLO, &fusion__peer_hello__descriptor, false),
    T(MSG_PEER_WELCOME, &fusion__peer_welcome__descriptor, false),
    T(MSG_HEARTBEAT, &fusion__heartbeat__descriptor, false),
    T(MSG_LEAVE, &fusion__leave__descriptor, false),
    T(MSG_STAGE_ASSIGN, &fusion__stage_assign__descriptor, true), /* carries the job's DAG */
    T(MSG_STAGE_READY, &fusion__stage_ready__descriptor, false),
    T(MSG_WEIGHT_REQUEST, &fusion__weight_request__descriptor, false),
    T(MSG_WEIGHT_CHUNK, &fusion__weight_chunk__descriptor, true),
    T(MSG_ACTIVATION, &fusion__tensor_frame__descriptor, true),
    T(MSG_GRADIENT, &fusion__tensor_frame__descriptor, true),
    T(MSG_CHECKPOINT_PUT, &fusion__checkpoint_put__descriptor, true),
    T(MSG_CHECKPOINT_ACK, &fusion__checkpoint_ack__descriptor, false),
    T(MSG_JOB_SUBMIT, &fusion__job_submit__descriptor, true),
    T(MSG_JOB_STATUS_REQ, &fusion__job_ref__descriptor, false),
    T(MSG_JOB_STATUS, &fusion__job_status__descriptor, false),
    T(MSG_JOB_LIST_REQ, &fusion__job_list_request__descriptor, false),
    T(MSG_JOB_LIST, &fusion__job_list__descriptor, false),
    T(MSG_JOB_RESULT_REQ, &fusion__job_result_request__descriptor, false),
    T(MSG_JOB_RESULT_CHUNK, &fusion__job_result_chunk__descriptor, true),
    T(MSG_JOB_CANCEL, &fusion__job_ref__descriptor, false),
    T(MSG_PEER_LIST_REQ, NULL, false),
    T(MSG_PEER_LIST, &fusion__peer_list__descriptor, false),
    T(MSG_ERROR, &fusion__error__descriptor, false),
    T(MSG_ENROL, &fusion__enrol__descriptor, false),
    T(MSG_ENROL_ACK, &fusion__enrol_ack__descriptor, false),
    T(MSG_SEAL_HELLO, &fusion__seal_hello__descriptor, false),
    T(MSG_STAGE_RELEASE, &fusion__stage_release__descriptor, false),
    T(MSG_STAGE_START, &fusion__stage_start__descriptor, false),
    T(MSG_STEP_DONE, &fusion__step_done__descriptor, false),
    T(MSG_INFER_TOKEN, &fusion__infer_token__descriptor, true), /* logits of every prompt position */
    T(MSG_VERIFY_REQUEST, &fusion__verify_request__descriptor, false),
    T(MSG_VERIFY_SKETCH, &fusion__verify_sketch__descriptor, false),
    T(MSG_VERIFY_DELIVER, &fusion__verify_deliver__descriptor, false),
    T(MSG_VERIFY_INPUT, &fusion__verify_input__descriptor, true), /* a sealed chunk of an activation */
    T(MSG_LINK_PROBE_REQ, &fusion__link_probe_request__descriptor, false),
    T(MSG_LINK_PROBE, &fusion__link_probe__descriptor, true), /* up to 4 MiB of zeros */
    T(MSG_CHALLENGE, &fusion__challenge__descriptor, false),
    T(MSG_CHALLENGE_REPLY, &fusion__challenge_reply__descriptor, false), /* <= 8192 x 16 + 8 x 8192 x 4 bytes */
    T(MSG_MODEL_UPLOAD, &fusion__model_upload__descriptor, true), /* a manifest: 34 bytes a chunk */
    T(MSG_MODEL_CHUNK, &fusion__model_chunk__descriptor, true),   /* up to WIRE_UPLOAD_CHUNK bytes */
    T(MSG_UPLOAD_STATUS, &fusion__upload_status__descriptor, false),
    T(MSG_SESSION_OPEN, &fusion__session_open__descriptor, true), /* a prompt of up to 64 Ki tokens */
    T(MSG_SESSION_STATUS_REQ, &fusion__session_ref__descriptor, false),
    T(MSG_SESSION_STATUS, &fusion__session_status__descriptor, false),
    T(MSG_SESSION_CLOSE, &fusion__session_ref__descriptor, false),
    T(MSG_SESSION_START, &fusion__session_start__descriptor, true), /* a session's tokens */
    T(MSG_SESSION_END, &fusion__session_end__descriptor, false),
    T(MSG_GATEWAY_CLOSED, NULL, false),
    T(MSG_GATEWAY_HELLO, NULL, false),
    T(MSG_GATEWAY_POLICY, &fusion__gateway_policy__descriptor, false), /* a batch of 2,048 keys: ~80 KB */
};
#undef T
#define N_TYPES (sizeof type_table / sizeof type_table[0])

static const wire_type_info *type_info(Fusion__MsgType t)
{
    for (size_t i = 0; i < N_TYPES; i++)
        if (type_table[i].type == t)
            return &type_table[i];
    return NULL;
}

const ProtobufCMessageDescriptor *wire_type_body(Fusion__MsgType type)
{
    const wire_type_info *ti = type_info(type);
    return ti ? ti->body : NULL;
}

bool wire_type_known(Fusion__MsgType type)
{
    return type_info(type) != NULL;
}

bool wire_type_bulk(Fusion__MsgType type)
{
    const wire_type_info *ti = type_info(type);
    return ti && ti->bulk;
}

const char *wire_type_name(Fusion__MsgType type)
{
    const wire_type_info *ti = type_info(type);
    return ti ? ti->name : "MSG_?";
}

static size_t body_cap(Fusion__MsgType t)
{
    return wire_type_bulk(t) ? WIRE_MAX_MSG_BYTES : WIRE_MAX_CONTROL_BYTES;
}

uint64_t wire_counters_dropped(const wire_counters *c)
{
    return c->dropped_frames + c->dropped_malformed + c->dropped_version + c->dropped_unknown_type +
           c->dropped_too_large;
}

/* ---------- the byte-budgeted allocator ---------- */

/* Every block carries a header before it: its size (to give back to the budget) and the pool it
 * came from, so a message unpacked by wire_unpack_budgeted can be freed from its pointer alone. */
typedef struct budget_pool {
    fu_budget budget;
    ProtobufCAllocator alloc;
    bool refused; /* an allocation was refused (over the budget, or by malloc) */
} budget_pool;

typedef union {
    struct {
        size_t size;
        budget_pool *pool;
    } h;
    max_align_t align_;
} block_hdr;

static void *pool_alloc(void *data, size_t size)
{
    budget_pool *pool = data;
    size_t total;
    if (!fu_size_add(size, sizeof(block_hdr), &total) || fu_budget_take(&pool->budget, total) != FU_OK) {
        pool->refused = true;
        return NULL;
    }
    block_hdr *b = malloc(total);
    if (!b) {
        fu_budget_give(&pool->budget, total);
        pool->refused = true;
        return NULL;
    }
    b->h.size = total;
    b->h.pool = pool;
    return b + 1;
}

static void pool_free(void *data, void *p)
{
    budget_pool *pool = data;
    if (!p)
        return;
    block_hdr *b = (block_hdr *)p - 1;
    fu_budget_give(&pool->budget, b->h.size);
    free(b);
}

static void pool_init(budget_pool *pool, size_t limit)
{
    pool->budget.limit = limit;
    pool->budget.used = 0;
    pool->refused = false;
    pool->alloc.alloc = pool_alloc;
    pool->alloc.free = pool_free;
    pool->alloc.allocator_data = pool;
}

/* Budget for unpacking a frame of n bytes: its size (bytes and strings are copied out) plus a fixed
 * slack for protobuf-c's structs and arrays. Flat rather than proportional: a canonical list of
 * small sub-messages legitimately expands 50x or more, while a bomb of empty sub-messages (1 MiB
 * became 84 MiB) is stopped at WIRE_BUDGET_SLACK whatever its size. */
static size_t budget_for(size_t n)
{
    return n + WIRE_BUDGET_SLACK;
}

fu_err wire_unpack_unvalidated(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                               size_t budget, ProtobufCMessage **out)
{
    if (!d || !out || (len && !data))
        return FU_EINVAL;
    *out = NULL;
    if (len > budget)
        return FU_ENOMEM;
    budget_pool *pool = fu_malloc(sizeof *pool);
    pool_init(pool, budget);
    ProtobufCMessage *m = protobuf_c_message_unpack(d, &pool->alloc, len, data);
    if (!m) {
        bool over = pool->refused; /* protobuf-c reports both kinds of failure as NULL */
        free(pool);
        return over ? FU_ENOMEM : FU_EPROTO;
    }
    *out = m;
    return FU_OK;
}

fu_err wire_unpack_budgeted(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                            size_t budget, ProtobufCMessage **out)
{
    FU_TRY(wire_unpack_unvalidated(d, data, len, budget, out));
    if (wire_validate(*out) != FU_OK) {
        wire_unpacked_free(*out);
        *out = NULL;
        return FU_EPROTO;
    }
    return FU_OK;
}

void wire_unpacked_free(ProtobufCMessage *m)
{
    if (!m)
        return;
    budget_pool *pool = ((block_hdr *)m - 1)->h.pool;
    protobuf_c_message_free_unpacked(m, &pool->alloc);
    free(pool);
}

/* ---------- messages ---------- */

struct wire_msg {
    wire_hdr hdr;                      /* strings point into env */
    Fusion__Envelope *env;             /* unpacked through pool */
    ProtobufCMessage *body;            /* unpacked through pool; NULL for empty-body types */
    budget_pool pool;                  /* one budget for envelope and body */
    uint8_t rid[WIRE_MAX_ROUTING_ID];  /* ROUTER routing id */
    size_t rid_len;
    char user_id[WIRE_Z85_KEY_LEN + 24]; /* ZAP User-Id of the connection ("" without ZAP) */
    char admission[16];                /* "member", "enrolling", "" */
    char peer_address[WIRE_ADDRESS_MAX]; /* libzmq's "Peer-Address" of the connection, "" when none */
    char gateway[WIRE_Z85_KEY_LEN + 1];  /* the gateway's key when it came through one, else "" */
    int src_fd;                        /* descriptor of the connection (ZMQ_SRCFD), -1 when none */
    zmq_msg_t raw_body;                /* the body frame as received (for wire_forward) */
    bool has_raw;
};

static fu_err decode_into(wire_msg_t *m, const uint8_t *env, size_t env_len, const uint8_t *body, size_t body_len,
                          wire_counters *c)
{
    if (env_len > WIRE_MAX_ENVELOPE_BYTES || body_len > WIRE_MAX_MSG_BYTES) {
        if (c)
            c->dropped_too_large++;
        return FU_ENOMEM;
    }
    pool_init(&m->pool, budget_for(env_len) + budget_for(body_len));
    m->env = (Fusion__Envelope *)protobuf_c_message_unpack(&fusion__envelope__descriptor, &m->pool.alloc, env_len,
                                                           env);
    if (!m->env) {
        if (c) {
            if (m->pool.refused)
                c->dropped_too_large++;
            else
                c->dropped_malformed++;
        }
        return m->pool.refused ? FU_ENOMEM : FU_EPROTO;
    }
    if (m->env->version != WIRE_PROTOCOL_VERSION) {
        if (c)
            c->dropped_version++;
        return FU_EVERSION;
    }
    const wire_type_info *ti = type_info(m->env->type);
    if (!ti) {
        if (c)
            c->dropped_unknown_type++;
        return FU_EPROTO;
    }
    /* Envelope strings: UTF-8, and short (they are keys and names). */
    if (wire_validate(&m->env->base) != FU_OK || strlen(m->env->sender) > 256 || strlen(m->env->relay_to) > 256) {
        if (c)
            c->dropped_malformed++;
        return FU_EPROTO;
    }
    if (body_len > body_cap(ti->type)) {
        if (c)
            c->dropped_too_large++;
        return FU_ENOMEM;
    }
    if (!ti->body) {
        if (body_len != 0) {
            if (c)
                c->dropped_malformed++;
            return FU_EPROTO;
        }
    } else {
        m->body = protobuf_c_message_unpack(ti->body, &m->pool.alloc, body_len, body);
        if (!m->body) {
            bool over = m->pool.refused;
            if (c) {
                if (over)
                    c->dropped_too_large++;
                else
                    c->dropped_malformed++;
            }
            return over ? FU_ENOMEM : FU_EPROTO;
        }
        if (wire_validate(m->body) != FU_OK) {
            if (c)
                c->dropped_malformed++;
            return FU_EPROTO;
        }
    }
    Fusion__Envelope *e = m->env;
    m->hdr = (wire_hdr){.type = e->type,
                        .job_id = e->job_id,
                        .step = e->step,
                        .micro_batch = e->micro_batch,
                        .sequence = e->sequence,
                        .stage = e->stage,
                        .sender = e->sender,
                        .relay_to = e->relay_to,
                        .slot = e->slot};
    return FU_OK;
}

static wire_msg_t *msg_alloc(void)
{
    wire_msg_t *m = fu_calloc(1, sizeof *m);
    pool_init(&m->pool, 0);
    m->src_fd = -1;
    return m;
}

void wire_msg_destroy(wire_msg_t **msg_p)
{
    if (!msg_p || !*msg_p)
        return;
    wire_msg_t *m = *msg_p;
    if (m->body)
        protobuf_c_message_free_unpacked(m->body, &m->pool.alloc);
    if (m->env)
        protobuf_c_message_free_unpacked(&m->env->base, &m->pool.alloc);
    if (m->has_raw)
        zmq_msg_close(&m->raw_body);
    free(m);
    *msg_p = NULL;
}

fu_err wire_decode(const uint8_t *env, size_t env_len, const uint8_t *body, size_t body_len, wire_counters *c,
                   wire_msg_t **out)
{
    if (!out || (env_len && !env) || (body_len && !body))
        return FU_EINVAL;
    *out = NULL;
    wire_msg_t *m = msg_alloc();
    fu_err rc = decode_into(m, env, env_len, body, body_len, c);
    if (rc != FU_OK) {
        wire_msg_destroy(&m);
        return rc;
    }
    if (c)
        c->received++;
    *out = m;
    return FU_OK;
}

const wire_hdr *wire_msg_hdr(const wire_msg_t *msg)
{
    return &msg->hdr;
}

Fusion__MsgType wire_msg_type(const wire_msg_t *msg)
{
    return msg->hdr.type;
}

const ProtobufCMessage *wire_msg_body(const wire_msg_t *msg)
{
    return msg->body;
}

const void *wire_msg_body_as(const wire_msg_t *msg, Fusion__MsgType type)
{
    return msg && msg->hdr.type == type ? (const void *)msg->body : NULL;
}

const uint8_t *wire_msg_routing_id(const wire_msg_t *msg, size_t *len)
{
    *len = msg->rid_len;
    return msg->rid_len ? msg->rid : NULL;
}

const char *wire_msg_user_id(const wire_msg_t *msg)
{
    return msg->user_id;
}

const char *wire_msg_admission(const wire_msg_t *msg)
{
    return msg->admission;
}

const char *wire_msg_peer_address(const wire_msg_t *msg)
{
    return msg->peer_address;
}

const char *wire_msg_gateway(const wire_msg_t *msg)
{
    return msg->gateway;
}

int wire_msg_src_fd(const wire_msg_t *msg)
{
    return msg->src_fd;
}

size_t wire_msg_heap_bytes(const wire_msg_t *msg)
{
    return msg->pool.budget.used;
}

/* ---------- gateway routes ---------- */

/* libzmq's own routing ids are 5 bytes, a zero byte and a counter; one that a socket sets may not
 * start with a zero byte. A route starts with one and is never 5 bytes long. */
#define ZMQ_OWN_ID_LEN 5

bool wire_route_is(const uint8_t *rid, size_t len)
{
    return rid && len > ZMQ_OWN_ID_LEN && rid[0] == 0 && rid[1] && (size_t)rid[1] + 2 < len;
}

size_t wire_route_make(const uint8_t *gw, size_t gw_len, const uint8_t *route, size_t route_len,
                       uint8_t out[WIRE_MAX_ROUTING_ID])
{
    if (!gw_len || gw_len > WIRE_GATEWAY_ID_MAX || !route_len || route_len > WIRE_GATEWAY_ROUTE_MAX ||
        2 + gw_len + route_len <= ZMQ_OWN_ID_LEN)
        return 0;
    out[0] = 0;
    out[1] = (uint8_t)gw_len;
    memcpy(out + 2, gw, gw_len);
    memcpy(out + 2 + gw_len, route, route_len);
    return 2 + gw_len + route_len;
}

/* ---------- encoding and sending ---------- */

static fu_err pack_envelope(const wire_hdr *h, uint8_t *buf, size_t cap, size_t *len)
{
    Fusion__Envelope e = FUSION__ENVELOPE__INIT;
    e.version = WIRE_PROTOCOL_VERSION;
    e.type = h->type;
    e.job_id = h->job_id;
    e.step = h->step;
    e.micro_batch = h->micro_batch;
    e.sequence = h->sequence;
    e.stage = h->stage;
    e.sender = (char *)(h->sender ? h->sender : "");
    e.relay_to = (char *)(h->relay_to ? h->relay_to : "");
    e.slot = h->slot;
    size_t n = protobuf_c_message_get_packed_size(&e.base);
    if (n > cap)
        return FU_EINVAL;
    *len = protobuf_c_message_pack(&e.base, buf);
    return FU_OK;
}

static fu_err check_body(const wire_hdr *h, const ProtobufCMessage *body)
{
    const wire_type_info *ti = h ? type_info(h->type) : NULL;
    if (!ti)
        return FU_EINVAL;
    if (!ti->body)
        return body ? FU_EINVAL : FU_OK;
    if (!body || body->descriptor != ti->body)
        return FU_EINVAL;
    return FU_OK;
}

fu_err wire_encode(const wire_hdr *hdr, const ProtobufCMessage *body, uint8_t **env_out, size_t *env_len,
                   uint8_t **body_out, size_t *body_len)
{
    if (!env_out || !env_len || !body_out || !body_len)
        return FU_EINVAL;
    *env_out = *body_out = NULL;
    FU_TRY(check_body(hdr, body));
    size_t bn = body ? protobuf_c_message_get_packed_size(body) : 0;
    if (bn > body_cap(hdr->type))
        return FU_EINVAL;
    uint8_t envbuf[WIRE_MAX_ENVELOPE_BYTES];
    size_t en;
    FU_TRY(pack_envelope(hdr, envbuf, sizeof envbuf, &en));
    *env_out = fu_malloc(en);
    memcpy(*env_out, envbuf, en);
    *env_len = en;
    *body_out = fu_malloc(bn);
    *body_len = body ? protobuf_c_message_pack(body, *body_out) : 0;
    return FU_OK;
}

static fu_err zmq_errno_to_fu(int e)
{
    switch (e) {
    case EAGAIN:
        return FU_EAGAIN;
    case EHOSTUNREACH:
        return FU_ENOTFOUND;
    case ETERM:
        return FU_ECANCELED;
    case EINTR:
        return FU_EAGAIN;
    case EFSM:
    case ENOTSUP:
    case EINVAL:
        return FU_EINVAL;
    default:
        return FU_EIO;
    }
}

static void free_cb(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* Sends [rid][envelope] with SNDMORE; the caller sends the body. With first_flags ZMQ_DONTWAIT a
 * full queue fails the first frame (FU_EAGAIN) and nothing is sent; once the first frame of a
 * multipart message is queued, ZeroMQ queues the rest. */
static fu_err send_head(void *sock, const uint8_t *rid, size_t rid_len, const uint8_t *env, size_t env_len,
                        int first_flags)
{
    if (wire_route_is(rid, rid_len)) { /* the gateway's id, then its id of the peer's connection */
        size_t gl = rid[1];
        if (zmq_send(sock, rid + 2, gl, ZMQ_SNDMORE | first_flags) < 0)
            return zmq_errno_to_fu(zmq_errno());
        rid += 2 + gl, rid_len -= 2 + gl, first_flags = 0;
    }
    if (rid_len && zmq_send(sock, rid, rid_len, ZMQ_SNDMORE | first_flags) < 0)
        return zmq_errno_to_fu(zmq_errno());
    if (zmq_send(sock, env, env_len, ZMQ_SNDMORE | (rid_len ? 0 : first_flags)) < 0) /* copies: small */
        return zmq_errno_to_fu(zmq_errno());
    return FU_OK;
}

/* wire_send_packed and wire_send_packed_try (try_: a full queue returns FU_EAGAIN with data still
 * the caller's). */
static fu_err send_packed(void *sock, const uint8_t *rid, size_t rid_len, const wire_hdr *hdr, void *data,
                          size_t len, void (*free_fn)(void *data, void *hint), void *hint, bool try_)
{
    fu_err rc = FU_EINVAL;
    if (!sock || !hdr || !type_info(hdr->type) || rid_len > WIRE_MAX_ROUTING_ID || (len && !data) ||
        len > body_cap(hdr->type))
        goto fail;
    uint8_t env[WIRE_MAX_ENVELOPE_BYTES];
    size_t env_len;
    if ((rc = pack_envelope(hdr, env, sizeof env, &env_len)) != FU_OK)
        goto fail;
    if ((rc = send_head(sock, rid, rid_len, env, env_len, try_ ? ZMQ_DONTWAIT : 0)) != FU_OK) {
        if (try_ && rc == FU_EAGAIN)
            return rc; /* nothing sent; data stays the caller's */
        goto fail;
    }
    zmq_msg_t part;
    if (free_fn) {
        if (zmq_msg_init_data(&part, data, len, free_fn, hint) != 0) {
            rc = FU_ENOMEM;
            goto fail_sent;
        }
        free_fn = NULL; /* ZeroMQ owns data now */
    } else if (zmq_msg_init_size(&part, len) != 0) {
        rc = FU_ENOMEM;
        goto fail_sent;
    } else if (len) {
        memcpy(zmq_msg_data(&part), data, len);
    }
    if (zmq_msg_send(&part, sock, 0) < 0) {
        rc = zmq_errno_to_fu(zmq_errno());
        zmq_msg_close(&part);
        return rc;
    }
    return FU_OK;
fail_sent:
    /* The head is queued: end the multipart message so the socket stays usable (the receiver
     * refuses the empty body as malformed). */
    (void)zmq_send(sock, "", 0, 0);
fail:
    if (free_fn)
        free_fn(data, hint);
    return rc;
}

fu_err wire_send_packed(void *sock, const uint8_t *rid, size_t rid_len, const wire_hdr *hdr, void *data, size_t len,
                        void (*free_fn)(void *data, void *hint), void *hint)
{
    return send_packed(sock, rid, rid_len, hdr, data, len, free_fn, hint, false);
}

fu_err wire_send_packed_try(void *sock, const uint8_t *rid, size_t rid_len, const wire_hdr *hdr, void *data,
                            size_t len, void (*free_fn)(void *data, void *hint), void *hint)
{
    return send_packed(sock, rid, rid_len, hdr, data, len, free_fn, hint, true);
}

fu_err wire_send(void *sock, const uint8_t *rid, size_t rid_len, const wire_hdr *hdr, const ProtobufCMessage *body)
{
    if (!sock)
        return FU_EINVAL;
    FU_TRY(check_body(hdr, body));
    size_t bn = body ? protobuf_c_message_get_packed_size(body) : 0;
    if (bn > body_cap(hdr->type))
        return FU_EINVAL;
    uint8_t *buf = fu_malloc(bn);
    if (body)
        protobuf_c_message_pack(body, buf);
    return wire_send_packed(sock, rid, rid_len, hdr, buf, bn, free_cb, NULL);
}

/* ---------- receiving ---------- */

static int socket_type(void *sock)
{
    int t = -1;
    size_t sz = sizeof t;
    if (zmq_getsockopt(sock, ZMQ_TYPE, &t, &sz) != 0)
        return -1;
    return t;
}

/* Reads the rest of a multipart message and throws it away. */
static void drain(void *sock)
{
    int more = 1;
    size_t sz = sizeof more;
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) == 0 && more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        int r = zmq_msg_recv(&part, sock, 0);
        zmq_msg_close(&part);
        if (r < 0)
            break;
        sz = sizeof more;
    }
}

static Fusion__ErrorCode code_for(fu_err rc, const wire_counters *before, const wire_counters *after)
{
    if (rc == FU_EVERSION)
        return FUSION__ERROR_CODE__ERR_VERSION;
    if (rc == FU_ENOMEM)
        return FUSION__ERROR_CODE__ERR_TOO_LARGE;
    if (before && after && after->dropped_unknown_type != before->dropped_unknown_type)
        return FUSION__ERROR_CODE__ERR_UNKNOWN_TYPE;
    return FUSION__ERROR_CODE__ERR_PROTO;
}

static void reply_refusal(void *sock, const uint8_t *rid, size_t rid_len, fu_err rc, Fusion__ErrorCode code,
                          const uint8_t *env, size_t env_len, wire_counters *c)
{
    /* What we can tell of the refused message, read with a tiny budget; never answer an Error. */
    Fusion__MsgType in_type = FUSION__MSG_TYPE__MSG_UNSPECIFIED;
    uint64_t seq = 0;
    if (env_len <= WIRE_MAX_ENVELOPE_BYTES) {
        ProtobufCMessage *e = NULL;
        if (wire_unpack_budgeted(&fusion__envelope__descriptor, env, env_len, budget_for(env_len), &e) == FU_OK) {
            in_type = ((Fusion__Envelope *)e)->type;
            seq = ((Fusion__Envelope *)e)->sequence;
            wire_unpacked_free(e);
        } else {
            /* An unknown enum value fails validation: read the type with a raw scan. */
            Fusion__Envelope *raw =
                (Fusion__Envelope *)protobuf_c_message_unpack(&fusion__envelope__descriptor, NULL, env_len, env);
            if (raw) {
                in_type = raw->type;
                seq = raw->sequence;
                protobuf_c_message_free_unpacked(&raw->base, NULL);
            }
        }
    }
    if (in_type == FUSION__MSG_TYPE__MSG_ERROR)
        return;
    Fusion__Error err = FUSION__ERROR__INIT;
    err.code = code;
    err.message = (char *)fu_strerror(rc);
    err.in_reply_to = type_info(in_type) ? in_type : FUSION__MSG_TYPE__MSG_UNSPECIFIED;
    err.sequence = seq;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_ERROR};
    if (wire_send(sock, rid, rid_len, &h, &err.base) == FU_OK && c)
        c->errors_replied++;
}

/* Reads the GatewayHop frame f of a message from the gateway whose routing id is gw: FU_EAUTH when
 * the connection was not admitted as a gateway (anyone else's hop frames are forgeries), FU_EPROTO
 * when the frame is malformed. On success *hop_out is the hop (free with wire_unpacked_free) and
 * route/route_len the route to answer on. */
static fu_err gateway_hop(zmq_msg_t *f, const uint8_t *gw, size_t gw_len, Fusion__GatewayHop **hop_out,
                          uint8_t route[WIRE_MAX_ROUTING_ID], size_t *route_len)
{
    const char *adm = zmq_msg_gets(f, "X-Fusion-Admission");
    if (!adm || strcmp(adm, WIRE_ADMIT_GATEWAY) != 0)
        return FU_EAUTH;
    if (zmq_msg_size(f) > WIRE_GATEWAY_HOP_MAX)
        return FU_EPROTO;
    ProtobufCMessage *pm = NULL;
    if (wire_unpack_budgeted(&fusion__gateway_hop__descriptor, zmq_msg_data(f), zmq_msg_size(f),
                             budget_for(zmq_msg_size(f)), &pm) != FU_OK)
        return FU_EPROTO;
    Fusion__GatewayHop *hop = (Fusion__GatewayHop *)pm;
    size_t rl = wire_route_make(gw, gw_len, hop->route.data, hop->route.len, route);
    if (!rl || strlen(hop->user_id) != WIRE_Z85_KEY_LEN || strlen(hop->peer_address) >= WIRE_ADDRESS_MAX) {
        wire_unpacked_free(pm);
        return FU_EPROTO;
    }
    *hop_out = hop;
    *route_len = rl;
    return FU_OK;
}

fu_err wire_recv(void *sock, int flags, wire_counters *c_in, wire_msg_t **out)
{
    wire_counters local = {0};
    wire_counters *c = c_in ? c_in : &local;
    if (!sock || !out)
        return FU_EINVAL;
    *out = NULL;
    int st = socket_type(sock);
    if (st < 0)
        return FU_EINVAL;
    size_t want = st == ZMQ_ROUTER ? 3 : 2, most = st == ZMQ_ROUTER ? 4 : 2; /* 4: through a gateway */
    zmq_msg_t parts[4];
    size_t got = 0;
    bool too_many = false;
    for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        int zf = got == 0 && (flags & WIRE_DONTWAIT) ? ZMQ_DONTWAIT : 0;
        if (zmq_msg_recv(&part, sock, zf) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&part);
            for (size_t i = 0; i < got; i++)
                zmq_msg_close(&parts[i]);
            if (got > 0)
                drain(sock);
            if (e == EAGAIN)
                return (flags & WIRE_DONTWAIT) ? FU_EAGAIN : FU_ETIMEDOUT;
            return e == ETERM ? FU_ECANCELED : e == EINTR ? FU_EAGAIN : FU_EIO;
        }
        bool more = zmq_msg_more(&part);
        if (got < most) {
            parts[got++] = part;
        } else {
            zmq_msg_close(&part);
            too_many = true;
        }
        if (!more)
            break;
        if (too_many) {
            drain(sock);
            break;
        }
    }

    fu_err rc = FU_OK;
    size_t base = want - 2;
    wire_msg_t *m = NULL;
    wire_counters before = *c;
    const uint8_t *rid = NULL;
    size_t rid_len = 0;
    if (st == ZMQ_ROUTER && got >= 1) {
        rid = zmq_msg_data(&parts[0]);
        rid_len = zmq_msg_size(&parts[0]);
    }
    Fusion__GatewayHop *hop = NULL;
    uint8_t route[WIRE_MAX_ROUTING_ID];
    if (got == 4 && !too_many) { /* [gateway] [GatewayHop] [Envelope] [body], from a gateway only */
        if ((rc = gateway_hop(&parts[1], rid, rid_len, &hop, route, &rid_len)) != FU_OK) {
            c->dropped_frames += rc == FU_EAUTH;
            c->dropped_malformed += rc != FU_EAUTH;
            rc = FU_EPROTO;
            goto refuse;
        }
        rid = route;
        base = 2;
        want = 4;
    }
    if (too_many || got != want || rid_len > WIRE_MAX_ROUTING_ID) {
        if (c)
            c->dropped_frames++;
        rc = FU_EPROTO;
        goto refuse;
    }
    m = msg_alloc();
    rc = decode_into(m, zmq_msg_data(&parts[base]), zmq_msg_size(&parts[base]), zmq_msg_data(&parts[base + 1]),
                     zmq_msg_size(&parts[base + 1]), c);
    if (rc != FU_OK)
        goto refuse;
    if (rid_len) {
        memcpy(m->rid, rid, rid_len);
        m->rid_len = rid_len;
    }
    if (hop) { /* the gateway vouches for who sent it; its own connection is the gateway's */
        strcpy(m->user_id, hop->user_id);
        strcpy(m->admission, WIRE_ADMIT_MEMBER);
        strcpy(m->peer_address, hop->peer_address);
        const char *gw = zmq_msg_gets(&parts[base], "User-Id");
        if (gw && strlen(gw) < sizeof m->gateway)
            strcpy(m->gateway, gw);
        wire_unpacked_free(&hop->base);
        hop = NULL;
    } else {
        const char *uid = zmq_msg_gets(&parts[base], "User-Id");
        if (uid && strlen(uid) < sizeof m->user_id)
            strcpy(m->user_id, uid);
        const char *adm = zmq_msg_gets(&parts[base], "X-Fusion-Admission");
        if (adm && strlen(adm) < sizeof m->admission)
            strcpy(m->admission, adm);
        const char *addr = zmq_msg_gets(&parts[base], "Peer-Address");
        if (addr && strlen(addr) < sizeof m->peer_address)
            strcpy(m->peer_address, addr);
        m->src_fd = zmq_msg_get(&parts[base], ZMQ_SRCFD);
        if (m->src_fd < 0)
            m->src_fd = -1;
    }
    m->raw_body = parts[base + 1]; /* keep the body frame for wire_forward */
    m->has_raw = true;
    for (size_t i = 0; i < base + 1; i++)
        zmq_msg_close(&parts[i]);
    if (c)
        c->received++;
    *out = m;
    return FU_OK;

refuse:
    if (hop)
        wire_unpacked_free(&hop->base);
    if ((flags & WIRE_REPLY_ERRORS) && got == want && rid_len <= WIRE_MAX_ROUTING_ID)
        reply_refusal(sock, rid, rid_len, rc, code_for(rc, &before, c), zmq_msg_data(&parts[base]),
                      zmq_msg_size(&parts[base]), c);
    for (size_t i = 0; i < got; i++)
        zmq_msg_close(&parts[i]);
    wire_msg_destroy(&m);
    FU_DEBUG("wire", "refused a message: %s", fu_strerror(rc));
    return rc;
}

fu_err wire_forward(void *sock, const uint8_t *rid, size_t rid_len, const wire_msg_t *msg, const char *origin)
{
    if (!sock || !msg || !msg->has_raw || rid_len > WIRE_MAX_ROUTING_ID)
        return FU_EINVAL;
    wire_hdr h = msg->hdr;
    h.sender = origin;
    h.relay_to = NULL;
    h.slot = 0;
    uint8_t env[WIRE_MAX_ENVELOPE_BYTES];
    size_t env_len;
    FU_TRY(pack_envelope(&h, env, sizeof env, &env_len));
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_copy(&part, (zmq_msg_t *)&msg->raw_body) != 0) { /* reference-counted, no copy */
        zmq_msg_close(&part);
        return FU_ENOMEM;
    }
    fu_err rc = send_head(sock, rid, rid_len, env, env_len, 0);
    if (rc == FU_OK && zmq_msg_send(&part, sock, 0) < 0)
        rc = zmq_errno_to_fu(zmq_errno());
    if (rc != FU_OK)
        zmq_msg_close(&part);
    return rc;
}

fu_err wire_reply_error(void *sock, const wire_msg_t *msg, Fusion__ErrorCode code, const char *text)
{
    if (!sock || !msg)
        return FU_EINVAL;
    Fusion__Error err = FUSION__ERROR__INIT;
    err.code = code;
    err.message = (char *)(text ? text : "");
    err.in_reply_to = msg->hdr.type;
    err.sequence = msg->hdr.sequence;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_ERROR, .job_id = msg->hdr.job_id};
    return wire_send(sock, msg->rid_len ? msg->rid : NULL, msg->rid_len, &h, &err.base);
}
