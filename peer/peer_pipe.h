/* peer_pipe: what the I/O thread and the compute thread (peer_stage.c) say to each other over their
 * inproc PAIR. Each ZeroMQ message on the pipe is one pointer to a peer_cmd whose ownership (and that
 * of everything it points to) passes to the receiver. */
#ifndef FU_PEER_PIPE_H
#define FU_PEER_PIPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fusion.pb-c.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PEER_PIPE_ENDPOINT "inproc://fusion-peer-pipe"

typedef enum {
    PEER_CMD_MSG = 1,     /* io -> compute: a broker message for the stage (msg) */
    PEER_CMD_TENSOR,      /* io -> compute: an assembled, opened activation or gradient (tensor) */
    PEER_CMD_STOP,        /* io -> compute: finish the current command and exit */
    PEER_CMD_SEND,        /* compute -> io: a packed message for the broker (hdr fields, body) */
    PEER_CMD_SEND_TENSOR, /* compute -> io: a tensor for a neighbour (role, meta, data) */
    PEER_CMD_READY,       /* compute -> io: stage loaded; send StageReady once the links are up */
    PEER_CMD_STAGE_GONE,  /* compute -> io: the stage ended (released, failed): links may close */
    PEER_CMD_FATAL,       /* compute -> io: the backend failed; the peer must leave */
    PEER_CMD_VERIFY_SEND, /* compute -> io: deliver an output to a verifier (data, seed, key: seal to it) */
    PEER_CMD_VERIFY_INPUT, /* io -> compute: a delivered, opened stage input (data), or NULL data and text
                              when the upstream could not deliver it */
} peer_cmd_kind;

typedef struct {
    peer_cmd_kind kind;       /* what this is */
    wire_msg_t *msg;          /* MSG: owned */
    wire_tensor tensor;       /* TENSOR: owned data */
    Fusion__MsgType type;     /* SEND: envelope type */
    uint64_t job_id;          /* SEND / READY / STAGE_GONE / SEND_TENSOR / VERIFY_*: job */
    uint64_t step;            /* SEND / VERIFY_*: envelope step */
    uint32_t micro_batch;     /* SEND / VERIFY_*: envelope micro-batch */
    uint32_t stage;           /* SEND / READY: stage index; VERIFY_*: the stage being verified */
    uint8_t *body;            /* SEND: packed body (malloc), NULL for an empty body */
    size_t body_len;
    Fusion__LinkRole role;    /* SEND_TENSOR: which neighbour */
    wire_tensor_meta meta;    /* SEND_TENSOR: metadata (relay_to filled in by io) */
    uint8_t *data;            /* SEND_TENSOR / VERIFY_*: plaintext (malloc) */
    size_t len;
    uint64_t gen;             /* MSG (StageAssign) / READY / STAGE_GONE: the I/O thread's assignment number */
    bool backup;              /* READY: a warm backup (StageReady at once: it has no links) */
    fu_err err;               /* FATAL: why */
    uint64_t seed;            /* VERIFY_*: the sample's seed (with job_id, stage, step, micro_batch) */
    uint8_t key[WIRE_KEY_BYTES]; /* VERIFY_SEND: the verifier's public key */
    char *text;               /* VERIFY_INPUT: why it was not delivered (malloc), NULL when data is there */
} peer_cmd;

peer_cmd *peer_cmd_new(peer_cmd_kind kind);
void peer_cmd_destroy(peer_cmd **c_p);
/* Sends *c_p over the pipe (pointer message). flags: ZMQ_DONTWAIT or 0. On success *c_p is NULL
 * (the receiver owns it); FU_EAGAIN when the pipe is full with ZMQ_DONTWAIT (*c_p kept). */
FU_MUST_CHECK fu_err peer_cmd_send(void *pipe, peer_cmd **c_p, int flags);
/* Receives one command; FU_EAGAIN with ZMQ_DONTWAIT and nothing there; FU_ETIMEDOUT (RCVTIMEO). */
FU_MUST_CHECK fu_err peer_cmd_recv(void *pipe, int flags, peer_cmd **out);

/* Packs body into a SEND command for the broker. */
peer_cmd *peer_cmd_send_new(Fusion__MsgType type, uint64_t job_id, uint64_t step, uint32_t stage,
                            const ProtobufCMessage *body);

#ifdef __cplusplus
}
#endif
#endif
