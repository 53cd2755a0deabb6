/* broker_io: what every broker module uses to speak: the clocks, sending to a peer, answering a
 * message (or refusing it with an Error), and cleaning text for the wire. It calls no other broker
 * module. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_clock.h"
#include "fu_log.h"

#define LOG "broker"

uint64_t broker_now(void) { return fu_clock_ms(); }

void *broker_sock_for(const broker_t *b, const uint8_t *rid, size_t rid_len)
{
    return wire_route_is(rid, rid_len) && b->gw_sock ? b->gw_sock : b->sock;
}

int64_t broker_wall(void) { return fu_wallclock_ms(); }

fu_err broker_send_peer(broker_t *b, const broker_peer *p, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body)
{
    wire_hdr h = {.type = t, .job_id = job};
    fu_err rc = wire_send(broker_sock_for(b, p->rid, p->rid_len), p->rid, p->rid_len, &h, body);
    if (rc != FU_OK)
        FU_WARN(LOG, "send %s to peer %.8s (%s) failed: %s", wire_type_name(t), p->key, p->name, fu_strerror(rc));
    return rc;
}

void broker_ret_of(const wire_msg_t *msg, broker_ret *r)
{
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    r->rid_len = rl <= sizeof r->rid ? rl : 0;
    memcpy(r->rid, rid, r->rid_len);
    r->sequence = wire_msg_hdr(msg)->sequence;
    r->job_id = wire_msg_hdr(msg)->job_id;
    r->type = wire_msg_type(msg);
    snprintf(r->uid, sizeof r->uid, "%s", wire_msg_user_id(msg));
}

fu_err broker_answer(broker_t *b, const broker_ret *r, Fusion__MsgType t, const ProtobufCMessage *body)
{
    wire_hdr h = {.type = t, .job_id = r->job_id, .sequence = r->sequence};
    fu_err rc = wire_send(broker_sock_for(b, r->rid, r->rid_len), r->rid, r->rid_len, &h, body);
    if (rc != FU_OK)
        FU_WARN(LOG, "reply %s to %.8s failed: %s", wire_type_name(t), r->uid, fu_strerror(rc));
    return rc;
}

/* wr: the WeightRequest refused, whose blob the Error names (NULL for any other message). */
static void answer_verror(broker_t *b, const broker_ret *r, const Fusion__WeightRequest *wr, Fusion__ErrorCode code,
                          const char *fmt, va_list ap)
{
    char text[1024];
    vsnprintf(text, sizeof text, fmt, ap);
    broker_utf8_trim(text);
    FU_INFO(LOG, "refused %s from %.8s: %s", wire_type_name(r->type), r->uid, text);
    Fusion__Error e = FUSION__ERROR__INIT;
    e.code = code;
    e.message = text;
    e.in_reply_to = r->type;
    e.sequence = r->sequence;
    if (wr) {
        e.model_id = wr->model_id;
        e.tensor_name = wr->tensor_name;
    }
    (void)broker_answer(b, r, FUSION__MSG_TYPE__MSG_ERROR, &e.base);
}

void broker_answer_error(broker_t *b, const broker_ret *r, Fusion__ErrorCode code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    answer_verror(b, r, NULL, code, fmt, ap);
    va_end(ap);
}

fu_err broker_reply(broker_t *b, const wire_msg_t *msg, Fusion__MsgType t, const ProtobufCMessage *body)
{
    /* every heartbeat is answered here: no broker_ret copy on this path */
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    const wire_hdr *in = wire_msg_hdr(msg);
    wire_hdr h = {.type = t, .job_id = in->job_id, .sequence = in->sequence};
    fu_err rc = wire_send(broker_sock_for(b, rid, rl), rid, rl, &h, body);
    if (rc != FU_OK)
        FU_WARN(LOG, "reply %s to %.8s failed: %s", wire_type_name(t), wire_msg_user_id(msg), fu_strerror(rc));
    return rc;
}

void broker_reply_error(broker_t *b, const wire_msg_t *msg, Fusion__ErrorCode code, const char *fmt, ...)
{
    broker_ret r;
    broker_ret_of(msg, &r);
    va_list ap;
    va_start(ap, fmt);
    answer_verror(b, &r, NULL, code, fmt, ap);
    va_end(ap);
}

void broker_refuse_blob(broker_t *b, const wire_msg_t *msg, const Fusion__WeightRequest *wr, Fusion__ErrorCode code,
                        const char *fmt, ...)
{
    broker_ret r;
    broker_ret_of(msg, &r);
    va_list ap;
    va_start(ap, fmt);
    answer_verror(b, &r, wr, code, fmt, ap);
    va_end(ap);
}
