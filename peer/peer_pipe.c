/* peer_pipe: the inproc PAIR between the I/O thread and the compute thread (peer_pipe.h): making,
 * freeing, sending and receiving the peer_cmd messages, one pointer per ZeroMQ message. */
#include "peer_pipe.h"

#include <errno.h>
#include <stdlib.h>

#include <zmq.h>

#include "fu_alloc.h"

peer_cmd *peer_cmd_new(peer_cmd_kind kind)
{
    peer_cmd *c = fu_calloc(1, sizeof *c);
    c->kind = kind;
    return c;
}

void peer_cmd_destroy(peer_cmd **c_p)
{
    if (!c_p || !*c_p)
        return;
    peer_cmd *c = *c_p;
    wire_msg_destroy(&c->msg);
    wire_tensor_clear(&c->tensor);
    free(c->body);
    free(c->data);
    free((char *)c->meta.relay_to);
    free(c->text);
    free(c);
    *c_p = NULL;
}

fu_err peer_cmd_send(void *pipe, peer_cmd **c_p, int flags)
{
    if (!pipe || !c_p || !*c_p)
        return FU_EINVAL;
    peer_cmd *c = *c_p;
    if (zmq_send(pipe, &c, sizeof c, flags) != (int)sizeof c) {
        int e = zmq_errno();
        if (e == EAGAIN)
            return FU_EAGAIN;
        return e == ETERM ? FU_ECANCELED : FU_EIO;
    }
    *c_p = NULL;
    return FU_OK;
}

fu_err peer_cmd_recv(void *pipe, int flags, peer_cmd **out)
{
    peer_cmd *c = NULL;
    int n = zmq_recv(pipe, &c, sizeof c, flags);
    if (n < 0) {
        int e = zmq_errno();
        if (e == EAGAIN)
            return (flags & ZMQ_DONTWAIT) ? FU_EAGAIN : FU_ETIMEDOUT;
        return e == ETERM ? FU_ECANCELED : FU_EIO;
    }
    if (n != (int)sizeof c || !c)
        return FU_EPROTO;
    *out = c;
    return FU_OK;
}

peer_cmd *peer_cmd_send_new(Fusion__MsgType type, uint64_t job_id, uint64_t step, uint32_t stage,
                            const ProtobufCMessage *body)
{
    peer_cmd *c = peer_cmd_new(PEER_CMD_SEND);
    c->type = type;
    c->job_id = job_id;
    c->step = step;
    c->stage = stage;
    if (body) {
        c->body_len = protobuf_c_message_get_packed_size(body);
        c->body = fu_malloc(c->body_len ? c->body_len : 1);
        protobuf_c_message_pack(body, c->body);
    }
    return c;
}
