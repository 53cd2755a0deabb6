/* wire_tensor: activation and gradient tensors on the data plane, as TensorFrame chunks.
 *
 * A tensor is cut into chunks (WIRE_TENSOR_CHUNK bytes by default); each chunk is one ZeroMQ
 * message [Envelope][TensorFrame], sealed with wire_seal when the link has one. The chunk's
 * ciphertext is written straight into the buffer ZeroMQ sends (the protobuf body is laid out by
 * hand around it), and nothing of the tensor is copied on the way out. A sealed tensor of several
 * chunks is sealed by a small pool (one thread per available core, at most 8, the caller included)
 * while the caller hands finished chunks to ZeroMQ in order, so sealing overlaps with itself and
 * with libzmq's I/O thread sending. On the way in, an
 * assembler checks every chunk against the first (kind, job, step, micro-batch, dtype, shape,
 * sizes), opens it into its place, and hands over the tensor when every chunk has arrived;
 * wire_tensor_asm_feed_msg opens chunks on worker threads while the next ones arrive.
 *
 * Threads: the socket belongs to the calling thread (sealing workers never touch it); the assembler
 * to whoever feeds it. */
#ifndef FU_WIRE_TENSOR_H
#define FU_WIRE_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "wire.h"
#include "wire_seal.h"

#ifdef __cplusplus
extern "C" {
#endif

#define WIRE_TENSOR_CHUNK      (1u << 20) /* default chunk: small enough to pipeline, big enough to amortise */
#define WIRE_TENSOR_MAX_CHUNKS 65536u
#define WIRE_TENSOR_MAX_DIMS   WIRE_SEAL_MAX_DIMS

/* What a tensor is and where it belongs. */
typedef struct {
    Fusion__MsgType type;   /* FUSION__MSG_TYPE__MSG_ACTIVATION or ..._MSG_GRADIENT */
    uint64_t job_id;
    uint64_t step;
    uint32_t micro_batch;
    uint32_t stage;         /* sending stage */
    Fusion__Dtype dtype;
    uint32_t ndim;          /* <= WIRE_TENSOR_MAX_DIMS */
    int64_t shape[WIRE_TENSOR_MAX_DIMS];
    const char *relay_to;   /* the broker's id of the receiver when the broker relays; NULL = direct */
    uint32_t slot;          /* relayed: the sender's slot (Envelope.slot; the broker names senders by it) */
} wire_tensor_meta;

/* Bytes of one element of dtype; 0 for unknown dtypes. */
size_t wire_dtype_size(Fusion__Dtype dtype);

/* Sends len bytes of data as ceil(len / chunk_bytes) chunks (chunk_bytes 0 = WIRE_TENSOR_CHUNK).
 * len must equal the product of shape times the dtype's size. seal: the link's channel, or NULL
 * for a plain link, in which case *plain_seq supplies (and advances) the sequence numbers.
 * rid/rid_len as wire_send. Chunks always go out in index order; sealed ones of a multi-chunk
 * tensor are sealed by min(cores available, 8, chunks) threads (this one included, the others
 * started and joined within the call, never touching sock), so their sequence numbers may be out
 * of index order by at most that many. Errors: FU_EINVAL bad metadata, the send errors of
 * wire_send (chunks before the failing one have been sent). */
FU_MUST_CHECK fu_err wire_tensor_send(void *sock, const uint8_t *rid, size_t rid_len, wire_seal_t *seal,
                                      const wire_tensor_meta *meta, const void *data, size_t len, size_t chunk_bytes,
                                      uint64_t *plain_seq);

#define WIRE_SEND_RETRY_MS 2 /* wire_tensor_send_waiting: pause between tries while a queue is full */

/* How wire_tensor_send_waiting waits while the receiver's queue is full. */
typedef struct {
    bool (*wait)(void *arg); /* called between tries (NULL: none): do what must not wait, such as a
                                heartbeat that is due; return false to give up */
    void *arg;
    uint32_t timeout_ms;     /* give up after this long without room for one chunk (0: never) */
} wire_send_wait;

/* wire_tensor_send that never blocks inside ZeroMQ (wait NULL: it does, as wire_tensor_send): while
 * a chunk finds the queue full it calls wait->wait every WIRE_SEND_RETRY_MS and tries again, until
 * the chunk goes, wait->wait returns false or wait->timeout_ms passes (then FU_EAGAIN; the chunks
 * before it have been sent). Sealing threads run as in wire_tensor_send; wait runs on this thread. */
FU_MUST_CHECK fu_err wire_tensor_send_waiting(void *sock, const uint8_t *rid, size_t rid_len, wire_seal_t *seal,
                                              const wire_tensor_meta *meta, const void *data, size_t len,
                                              size_t chunk_bytes, uint64_t *plain_seq, const wire_send_wait *wait);

/* A received tensor. data is the caller's after wire_tensor_asm_take: free with wire_tensor_clear. */
typedef struct {
    wire_tensor_meta meta; /* relay_to is NULL */
    uint8_t *data;
    size_t len;
} wire_tensor;

void wire_tensor_clear(wire_tensor *t);

typedef struct wire_tensor_asm wire_tensor_asm_t;

/* An assembler that accepts tensors of at most max_bytes (what the receiver has memory for). */
wire_tensor_asm_t *wire_tensor_asm_new(size_t max_bytes);
void               wire_tensor_asm_destroy(wire_tensor_asm_t **a_p);

/* Feeds one received MSG_ACTIVATION / MSG_GRADIENT message. seal: the link's channel (then only
 * sealed chunks are accepted), or NULL (then only plain ones are). *done becomes true when the
 * tensor is complete; take it with wire_tensor_asm_take. A chunk of a different tensor than the
 * one in progress abandons that one (counted). Errors: FU_EPROTO inconsistent or out-of-range
 * chunk, FU_EAUTH sealing mismatch, tampering or replay (see wire_seal_decrypt), FU_ENOMEM tensor
 * over max_bytes. A refused chunk leaves the tensor in progress as it was. */
FU_MUST_CHECK fu_err wire_tensor_asm_feed(wire_tensor_asm_t *a, wire_seal_t *seal, const wire_msg_t *msg, bool *done);

/* As wire_tensor_asm_feed, but takes the message (*msg_p is consumed and NULLed, also on error)
 * so that a sealed chunk can be opened on one of the assembler's worker threads while the caller
 * receives the next one. The first chunk of a tensor is checked and opened before this returns (so
 * only an authentic chunk starts a tensor or abandons the one in progress); later chunks are
 * checked (geometry, consistency, duplicates) before this returns and opened in parallel, at most
 * 16 waiting for a worker (this call waits for room), which keeps how far they are opened out of
 * order well inside the replay window. The channel marks a sequence as seen only after its chunk
 * authenticated. When the last chunk has been fed, the call waits for every opening: if all
 * authenticated, *done becomes true; if any failed, those chunks count as never received (their
 * bytes are wiped), the error is returned (FU_EAUTH) and the tensor stays in progress, so the
 * genuine chunk can still complete it. Other errors as wire_tensor_asm_feed, at once.
 * Threads: the workers (one per available core, at most 8, started on first use; none with a
 * single core, then every chunk is opened here) touch only the tensor's buffer and the channel,
 * never a socket; wire_tensor_asm_destroy ends them. wire_tensor_asm_feed, take and destroy first
 * wait for pending openings (a chunk that failed is then simply missing). */
FU_MUST_CHECK fu_err wire_tensor_asm_feed_msg(wire_tensor_asm_t *a, wire_seal_t *seal, wire_msg_t **msg_p,
                                              bool *done);

/* Moves the completed tensor into *out. FU_EAGAIN when none is complete. */
FU_MUST_CHECK fu_err wire_tensor_asm_take(wire_tensor_asm_t *a, wire_tensor *out);

/* Tensors abandoned incomplete because another one started. */
uint64_t wire_tensor_asm_abandoned(const wire_tensor_asm_t *a);

#ifdef __cplusplus
}
#endif
#endif
