/* wire: fusion's message framing over ZeroMQ.
 *
 * Every message is multipart: [routing id, ROUTER sockets only] [Envelope] [body]. The Envelope
 * (fusion.proto) says the protocol version and the message type; the body frame is the protobuf
 * message that type names (wire_type_body), or empty for types without a body. Keeping the body a
 * separate frame lets a large tensor be packed once and handed to ZeroMQ without another copy.
 *
 * Receiving is defensive: frames are size-checked before unpacking, unpacking goes through a
 * byte-budgeted ProtobufCAllocator (fu_budget), and every enum and string is validated after
 * unpacking (protobuf-c checks neither). A bad message is dropped and counted in the caller's
 * wire_counters (and, when asked, answered with an Error); nothing received reaches an assert.
 *
 * Threads: one thread owns each socket; these functions keep no global state, so different
 * threads may use them on different sockets at once. */
#ifndef FU_WIRE_H
#define FU_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "fu_err.h"
#include "fusion.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

#define WIRE_PROTOCOL_VERSION   1u
#define WIRE_VERIFY_SKETCH_K 16 /* entries of VerifySketch.sketch (docs/PROTOCOL.md "Verification sketch") */
#define WIRE_VERIFY_HASH_BYTES 32u /* VerifySketch.input_hash: BLAKE2b-256 */
/* Steps a verified stage's peer keeps its outputs, input hashes and snapshots of (StageAssign.verify;
 * docs/PIPELINE.md "Verification"): the broker's rule for a withheld output counts on it. */
#define WIRE_VERIFY_KEEP_STEPS 3
/* VerifyInput chunks (docs/PROTOCOL.md "Verification inputs"): plaintext bytes per chunk, and what
 * sealing adds to each (a 56-byte binding header + crypto_box_SEALBYTES = 48). */
#define WIRE_VERIFY_INPUT_CHUNK    (1u << 20)
#define WIRE_VERIFY_INPUT_HEADER   56u
#define WIRE_VERIFY_INPUT_OVERHEAD (WIRE_VERIFY_INPUT_HEADER + 48u)
#define WIRE_MAX_MSG_BYTES      (32u << 20) /* ZMQ_MAXMSGSIZE of every socket: largest frame */
#define WIRE_MAX_ENVELOPE_BYTES 4096u       /* an Envelope frame over this is refused unread */
#define WIRE_MAX_CONTROL_BYTES  (1u << 20)  /* body cap for types that carry no bulk bytes */
#define WIRE_MAX_ROUTING_ID     255u        /* ZeroMQ's own limit on routing ids */
#define WIRE_MAX_REPEATED       10000u      /* elements in any one repeated field */
#define WIRE_UPLOAD_CHUNK       (4u << 20)  /* bytes of one chunk of an uploaded model (ModelChunk) */
#define WIRE_MAX_DEPTH          4u          /* sub-message nesting the validator accepts */
/* Unpacking a frame may allocate its size plus this much (protobuf-c expands repeated fields:
 * 1 MiB of empty sub-messages became 84 MiB of heap unbudgeted). */
#define WIRE_BUDGET_SLACK       (1u << 20)
#define WIRE_Z85_KEY_LEN        40u         /* a 32-byte key in Z85 */
#define WIRE_ADDRESS_MAX        64u         /* longest peer address kept, NUL included (IPv6 text: 45) */

/* Flags for wire_recv. */
#define WIRE_DONTWAIT     1 /* return FU_EAGAIN at once when nothing is queued */
#define WIRE_REPLY_ERRORS 2 /* answer a refused message with an Error (never answers an Error) */

/* The envelope fields a sender chooses (version is always WIRE_PROTOCOL_VERSION). */
typedef struct {
    Fusion__MsgType type;  /* what the body is */
    uint64_t job_id;       /* 0 when not about a job */
    uint64_t step;         /* training step */
    uint32_t micro_batch;  /* micro-batch within the step */
    uint64_t sequence;     /* per sender and link */
    uint32_t stage;        /* sending stage index, when relevant */
    const char *sender;    /* NULL or "" when unset; borrowed */
    const char *relay_to;  /* broker's id of the final receiver when relayed by the broker; NULL = direct */
    uint32_t slot;         /* peer -> broker: the sending slot of a peer process (fusion-peer --slots) */
} wire_hdr;

/* What a receiving thread has seen on its socket(s). Owned by the caller; zero-initialise. */
typedef struct {
    uint64_t received;             /* well-formed messages handed to the caller */
    uint64_t dropped_frames;       /* wrong number of frames or a bad routing id */
    uint64_t dropped_malformed;    /* did not decode, or failed validation (enum, UTF-8, limits) */
    uint64_t dropped_version;      /* protocol version other than WIRE_PROTOCOL_VERSION */
    uint64_t dropped_unknown_type; /* message type this build does not know */
    uint64_t dropped_too_large;    /* a frame over its cap, or unpacking over its byte budget */
    uint64_t errors_replied;       /* Error messages sent back for refused messages */
} wire_counters;

/* Total of every dropped_* counter. */
uint64_t wire_counters_dropped(const wire_counters *c);

/* A received, validated message. Opaque; see the accessors below. */
typedef struct wire_msg wire_msg_t;

/* The body message descriptor of a type; NULL for types whose body is empty and for unknown
 * types (tell them apart with wire_type_known). */
const ProtobufCMessageDescriptor *wire_type_body(Fusion__MsgType type);
bool        wire_type_known(Fusion__MsgType type);
/* True for types whose body may be bulk (tensors, shards, checkpoints): body capped at
 * WIRE_MAX_MSG_BYTES instead of WIRE_MAX_CONTROL_BYTES. */
bool        wire_type_bulk(Fusion__MsgType type);
/* "MSG_PEER_HELLO"; "MSG_?" for unknown values. Static storage. */
const char *wire_type_name(Fusion__MsgType type);

/* Encodes hdr and body into two freshly allocated buffers (caller frees both with free()).
 * body may be NULL only for types with an empty body; otherwise its descriptor must match
 * wire_type_body(hdr->type). FU_EINVAL on a mismatch or a body over its size cap. */
FU_MUST_CHECK fu_err wire_encode(const wire_hdr *hdr, const ProtobufCMessage *body, uint8_t **env_out,
                                 size_t *env_len, uint8_t **body_out, size_t *body_len);

/* Decodes and validates an envelope frame and a body frame (not retained). On success *out is a
 * new message (free with wire_msg_destroy). Errors, each also counted in *c when c is not NULL:
 * FU_EVERSION wrong version, FU_EPROTO malformed / unknown type / failed validation, FU_ENOMEM
 * a frame over its cap or unpacking over budget. Never asserts on the input. */
FU_MUST_CHECK fu_err wire_decode(const uint8_t *env, size_t env_len, const uint8_t *body, size_t body_len,
                                 wire_counters *c, wire_msg_t **out);

/* Sends one message. rid/rid_len: the routing id on ROUTER sockets (else NULL, 0). body as for
 * wire_encode. The body is packed once and handed to ZeroMQ without another copy.
 * Errors: FU_EINVAL bad arguments or oversized body, FU_ENOTFOUND no such peer (ROUTER_MANDATORY),
 * FU_EAGAIN high-water mark reached or send timeout, FU_ECANCELED context terminated, FU_EIO other. */
FU_MUST_CHECK fu_err wire_send(void *sock, const uint8_t *rid, size_t rid_len, const wire_hdr *hdr,
                               const ProtobufCMessage *body);

/* Sends an already-packed body with hdr; the data is copied into the ZeroMQ message unless
 * free_fn is not NULL, in which case ZeroMQ takes ownership of data and calls free_fn(data, hint)
 * when done (also when the send fails). Used by wire_tensor for zero-copy sealed chunks. */
FU_MUST_CHECK fu_err wire_send_packed(void *sock, const uint8_t *rid, size_t rid_len, const wire_hdr *hdr,
                                      void *data, size_t len, void (*free_fn)(void *data, void *hint),
                                      void *hint);

/* wire_send_packed that never waits for room: when the receiver's queue is full it returns
 * FU_EAGAIN at once, having sent nothing, and data stays the caller's (free_fn is not called).
 * Any other outcome is wire_send_packed's. */
FU_MUST_CHECK fu_err wire_send_packed_try(void *sock, const uint8_t *rid, size_t rid_len, const wire_hdr *hdr,
                                          void *data, size_t len, void (*free_fn)(void *data, void *hint),
                                          void *hint);

/* Receives one message from sock and validates it. flags: WIRE_DONTWAIT, WIRE_REPLY_ERRORS.
 * On success *out is the message (free with wire_msg_destroy) and c->received grows. A refused
 * message is fully drained from the socket, counted in *c (c may be NULL), optionally answered,
 * and reported as its error (see wire_decode; FU_EPROTO also for a bad frame count).
 * Other errors: FU_EAGAIN nothing queued with WIRE_DONTWAIT, FU_ETIMEDOUT ZMQ_RCVTIMEO passed,
 * FU_ECANCELED the context was terminated, FU_EIO other socket errors. */
FU_MUST_CHECK fu_err wire_recv(void *sock, int flags, wire_counters *c, wire_msg_t **out);

/* Relays a received message to another socket/peer (the broker's data-plane relay): the body
 * frame is passed on unchanged (no copy), the envelope is re-encoded with sender set to `origin`
 * (the z85 key ZAP authenticated for the original sender) and relay_to cleared. */
FU_MUST_CHECK fu_err wire_forward(void *sock, const uint8_t *rid, size_t rid_len, const wire_msg_t *msg,
                                  const char *origin);

/* Gateways (docs/PROTOCOL.md "Gateways"). A fusion-gateway holds many peers' connections and
 * carries their messages to the broker's gateway socket on one connection, each with a GatewayHop
 * frame before its Envelope. wire_recv on a ROUTER takes such a four-frame message only from a
 * connection admitted as a gateway (wire_zap: WIRE_ADMIT_GATEWAY); the message then has the hop's
 * user id and address, and as routing id a route: the gateway's routing id and the gateway's id of
 * the peer's connection, packed in one id that libzmq never makes (a zero byte, the gateway id's
 * length, the two ids; libzmq's own ids begin with a zero byte too, and are 5 bytes long: a route
 * never is). Every send
 * here sends a route as its two frames, so an answer finds the peer through its gateway. */
#define WIRE_GATEWAY_ID_MAX    64u  /* longest gateway routing id in a route */
#define WIRE_GATEWAY_ROUTE_MAX 32u  /* longest GatewayHop.route */
#define WIRE_GATEWAY_HOP_MAX   512u /* a GatewayHop frame over this is refused */
/* True when rid is a route (a peer behind a gateway). */
bool wire_route_is(const uint8_t *rid, size_t len);
/* Packs the gateway's routing id and its id of a peer's connection into out; returns the route's
 * length, or 0 when either is empty or over its limit, or the route would be 5 bytes long (the
 * length of libzmq's own ids). */
size_t wire_route_make(const uint8_t *gw, size_t gw_len, const uint8_t *route, size_t route_len,
                       uint8_t out[WIRE_MAX_ROUTING_ID]);

/* Sends an Error answering msg (to its routing id on ROUTER sockets). */
FU_MUST_CHECK fu_err wire_reply_error(void *sock, const wire_msg_t *msg, Fusion__ErrorCode code, const char *text);

/* Accessors; every pointer is borrowed from msg and lives as long as it. */
const wire_hdr *wire_msg_hdr(const wire_msg_t *msg);
Fusion__MsgType wire_msg_type(const wire_msg_t *msg);
/* The decoded body, or NULL for empty-body types. Cast to the type wire_type_body names, e.g.
 * (const Fusion__PeerHello *)wire_msg_body(m). */
const ProtobufCMessage *wire_msg_body(const wire_msg_t *msg);
/* The body if msg has the given type, else NULL: a checked cast. */
const void *wire_msg_body_as(const wire_msg_t *msg, Fusion__MsgType type);
/* The sender's routing id (ROUTER sockets), or NULL with *len = 0. */
const uint8_t *wire_msg_routing_id(const wire_msg_t *msg, size_t *len);
/* The identity ZAP authenticated for the connection (for CURVE: the z85 public key), or "" when
 * the socket has no ZAP authentication. This, not the routing id, is who sent the message. */
const char *wire_msg_user_id(const wire_msg_t *msg);
/* The key (z85) of the gateway the message came through, or "" when it came directly. */
const char *wire_msg_gateway(const wire_msg_t *msg);
/* ZAP admission of the connection: "member", "enrolling", or "" without ZAP (wire_zap.h). */
const char *wire_msg_admission(const wire_msg_t *msg);
/* The address the connection comes from, as libzmq reads it from the socket ("Peer-Address"
 * metadata: the IP address of a TCP peer, without its port; the same text ZAP sees), or "" when
 * libzmq gave none (or one of WIRE_ADDRESS_MAX characters or more). */
const char *wire_msg_peer_address(const wire_msg_t *msg);
/* The descriptor of the TCP connection the message came in on (libzmq's ZMQ_SRCFD, deprecated but
 * kept in 4.3), or -1 when libzmq gave none (inproc, a decoded message). Descriptors are reused once
 * a connection closes: pair it with the socket monitor's events (broker_conn.c). */
int wire_msg_src_fd(const wire_msg_t *msg);
/* Bytes the body's unpacking allocated (what the budget charged). */
size_t wire_msg_heap_bytes(const wire_msg_t *msg);
void   wire_msg_destroy(wire_msg_t **msg_p);

/* Strict UTF-8 check (no overlongs, no surrogates, nothing above U+10FFFF) of n bytes. */
bool wire_utf8_valid(const char *s, size_t n);
/* The length (1 to 4) of the valid UTF-8 character (NUL excluded) that s[0..n) begins with, or 0. */
size_t wire_utf8_char_len(const char *s, size_t n);
/* Replaces, in place, every byte of s[0..n) that does not begin a valid UTF-8 character (and NUL)
 * with '?', as the broker shows a generation's bytes that are no text (yet). */
void wire_utf8_clean(char *s, size_t n);

/* Validates a decoded protobuf-c message: every enum value is one the schema names, every string
 * is valid UTF-8, no repeated field has more than WIRE_MAX_REPEATED elements, nesting at most
 * WIRE_MAX_DEPTH. FU_EPROTO otherwise. Works for any generated message (dag.proto too). */
FU_MUST_CHECK fu_err wire_validate(const ProtobufCMessage *m);

/* Unpacks len bytes as a message of descriptor d through a byte budget of `budget` bytes, then
 * validates it. On success *out must be freed with wire_unpacked_free(*out). FU_ENOMEM when over
 * budget, FU_EPROTO when malformed or invalid. For other modules' untrusted blobs (a job's DAG). */
FU_MUST_CHECK fu_err wire_unpack_budgeted(const ProtobufCMessageDescriptor *d, const uint8_t *data, size_t len,
                                          size_t budget, ProtobufCMessage **out);
/* wire_unpack_budgeted without the validation, for a module that checks what it decodes itself
 * (dag_graph_decode: a graph may hold more nodes than WIRE_MAX_REPEATED). Free as above. */
FU_MUST_CHECK fu_err wire_unpack_unvalidated(const ProtobufCMessageDescriptor *d, const uint8_t *data,
                                             size_t len, size_t budget, ProtobufCMessage **out);
void wire_unpacked_free(ProtobufCMessage *m);

#ifdef __cplusplus
}
#endif
#endif
