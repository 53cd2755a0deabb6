/* peer_session: the messages fusion-peer's I/O thread takes (see peer.h): the broker's (PeerWelcome,
 * the link probe, Errors, StageAssign/StageRelease, forwarded data frames, the rest handed to the
 * compute thread) and the compute thread's commands (sends, tensors, StageReady, a fatal failure),
 * with the verification inputs relayed through the broker between a stage's upstream and its
 * verifier. */
#include <inttypes.h>
#include <stdlib.h>

#include <sodium.h>
#include <zmq.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "peer_internal.h"
#include "peer_io_internal.h"
#include "peer_verify.h"
#include "wire.h"
#include "wire_keys.h"

static void free_cb(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* ---- verification inputs (docs/PROTOCOL.md "Verification inputs") ------------------------- */

/* As the upstream of a stage being verified: seal the output the compute thread handed over to the
 * verifier's key, chunk by chunk, and send the chunks to the broker, which forwards them. */
static void send_verify_input(peer_t *p, const peer_cmd *c)
{
    peer_vin_id id = {.job_id = c->job_id, .stage = c->stage, .step = c->step, .micro_batch = c->micro_batch,
                      .seed = c->seed};
    uint64_t n = peer_vin_chunks(c->len);
    for (uint64_t i = 0; i < n; i++) {
        uint8_t *sealed = NULL;
        size_t sealed_len = 0;
        fu_err rc = peer_vin_seal(&id, c->key, c->data, c->len, i, &sealed, &sealed_len);
        if (rc != FU_OK) {
            FU_WARN("peer", "job %016" PRIx64 ": cannot seal the input of stage %u step %" PRIu64 " mb %u for its "
                    "verifier: %s", c->job_id, c->stage, c->step, c->micro_batch, fu_strerror(rc));
            return;
        }
        Fusion__VerifyInput vi = FUSION__VERIFY_INPUT__INIT;
        peer_vin_id_to_msg(&id, &vi);
        vi.verifier_key.data = (uint8_t *)c->key;
        vi.verifier_key.len = WIRE_KEY_BYTES;
        vi.total_bytes = c->len;
        vi.offset = i * WIRE_VERIFY_INPUT_CHUNK;
        vi.chunk_index = (uint32_t)i;
        vi.chunk_count = (uint32_t)n;
        vi.payload.data = sealed;
        vi.payload.len = sealed_len;
        rc = peer_io_to_broker(p, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, c->job_id, c->step, c->stage - 1,
                               &vi.base);
        free(sealed);
        if (rc != FU_OK)
            return;
    }
    FU_DEBUG("peer", "job %016" PRIx64 ": input of stage %u step %" PRIu64 " mb %u sent to its verifier (%zu bytes)",
             c->job_id, c->stage, c->step, c->micro_batch, c->len);
}

/* A chunk of a stage input delivered to this peer as a verifier (or the news that none comes),
 * forwarded by the broker: open, assemble, hand the whole input to the compute thread. Takes m. */
static void on_verify_input(peer_t *p, wire_msg_t *m)
{
    const Fusion__VerifyInput *vi = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_VERIFY_INPUT);
    if (!vi || vi->verifier_key.len != WIRE_KEY_BYTES ||
        sodium_memcmp(vi->verifier_key.data, wire_keypair_public(p->kp), WIRE_KEY_BYTES) != 0) {
        FU_WARN("peer", "a verification input sealed for another key: dropped");
        wire_msg_destroy(&m);
        return;
    }
    peer_cmd *c = peer_cmd_new(PEER_CMD_VERIFY_INPUT);
    c->job_id = vi->job_id;
    c->stage = vi->stage_index;
    c->step = vi->step;
    c->micro_batch = vi->micro_batch;
    c->seed = vi->seed;
    if (vi->unavailable && vi->unavailable[0]) {
        c->text = fu_strdup(vi->unavailable);
        wire_msg_destroy(&m);
        peer_io_deliver(p, c);
        return;
    }
    bool done = false;
    fu_errmsg em = {{0}};
    fu_err rc = peer_vin_asm_feed(p->vin, vi, wire_keypair_public(p->kp), wire_keypair_secret(p->kp), &done, &em);
    wire_msg_destroy(&m);
    if (rc != FU_OK) {
        FU_WARN("peer", "job %016" PRIx64 ": verification input of stage %u step %" PRIu64 " mb %u refused: %s",
                c->job_id, c->stage, c->step, c->micro_batch, fu_errmsg_text(&em, rc));
        peer_cmd_destroy(&c);
        return;
    }
    peer_vin_id id;
    if (!done || peer_vin_asm_take(p->vin, &id, &c->data, &c->len) != FU_OK) {
        peer_cmd_destroy(&c);
        return;
    }
    peer_io_deliver(p, c);
}

/* ---- messages from the broker and the compute thread --------------------------------------- */

void peer_io_on_broker(peer_t *p, wire_msg_t *m)
{
    p->last_broker_ms = fu_clock_ms();
    Fusion__MsgType t = wire_msg_type(m);
    const wire_hdr *h = wire_msg_hdr(m);
    if (h->sender && *h->sender && (t == FUSION__MSG_TYPE__MSG_SEAL_HELLO || t == FUSION__MSG_TYPE__MSG_ACTIVATION ||
                                    t == FUSION__MSG_TYPE__MSG_GRADIENT)) {
        peer_link_on_data(p, SRC_RELAY, m);
        return;
    }
    if (h->sender && *h->sender && t != FUSION__MSG_TYPE__MSG_VERIFY_INPUT) {
        /* Envelope.sender is set only on what the broker forwards from another peer: data frames and
         * verification inputs. Anything else claiming to come from a peer is not the broker's word. */
        FU_WARN("peer", "%s forwarded from peer %.12s... ignored: only data frames come that way", wire_type_name(t),
                h->sender);
        wire_msg_destroy(&m);
        return;
    }
    switch (t) {
    case FUSION__MSG_TYPE__MSG_PEER_WELCOME: {
        const Fusion__PeerWelcome *w = wire_msg_body_as(m, t);
        p->hb_ms = w->heartbeat_ms >= 50 && w->heartbeat_ms <= 60000 ? w->heartbeat_ms : PEER_HEARTBEAT_MS;
        p->dead_ms = w->dead_after_ms >= 2 * p->hb_ms && w->dead_after_ms <= 600000 ? w->dead_after_ms
                                                                                   : 3 * p->hb_ms;
        if (!p->welcomed)
            FU_INFO("peer", "welcomed by the broker as %s (heartbeat %u ms)", w->peer_id, p->hb_ms);
        p->welcomed = p->known = true;
        if (p->cfg.link_mbps <= 0 && !p->probe_t0_ns &&
            (!p->probe_done_ms || fu_clock_ms() - p->probe_done_ms >= PEER_PROBE_EVERY_MS)) {
            Fusion__LinkProbeRequest rq = FUSION__LINK_PROBE_REQUEST__INIT;
            rq.bytes = PEER_PROBE_BYTES;
            if (peer_io_to_broker(p, FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ, 0, 0, 0, &rq.base) == FU_OK)
                p->probe_t0_ns = fu_clock_ns();
        }
        break;
    }
    case FUSION__MSG_TYPE__MSG_LINK_PROBE: {
        /* Request to last byte: one round trip plus the payload's transfer, a lower bound of the
         * link's bandwidth. Heartbeats carry it to the broker's scheduler. */
        const Fusion__LinkProbe *lp = wire_msg_body_as(m, t);
        uint64_t el_ns = p->probe_t0_ns ? fu_clock_ns() - p->probe_t0_ns : 0;
        if (el_ns && lp->data.len >= PEER_PROBE_BYTES / 4) {
            p->prof.link_bandwidth_bps = (double)lp->data.len * 1e9 / (double)el_ns;
            atomic_store(&p->shared.link_bytes_per_s, (uint64_t)p->prof.link_bandwidth_bps);
            FU_INFO("peer", "link from the broker: %.1f MB/s (%zu bytes in %.1f ms)", p->prof.link_bandwidth_bps / 1e6,
                    lp->data.len, (double)el_ns / 1e6);
        }
        p->probe_t0_ns = 0;
        p->probe_done_ms = fu_clock_ms();
        break;
    }
    case FUSION__MSG_TYPE__MSG_HEARTBEAT:
    case FUSION__MSG_TYPE__MSG_ENROL_ACK:
        break;
    case FUSION__MSG_TYPE__MSG_ERROR: {
        const Fusion__Error *e = wire_msg_body_as(m, t);
        FU_WARN("peer", "the broker refused our %s: %s", wire_type_name(e->in_reply_to), e->message);
        if (e->in_reply_to == FUSION__MSG_TYPE__MSG_HEARTBEAT && fu_clock_ms() - p->hello_ms >= p->hb_ms) {
            /* It does not know us (a restarted broker, or we were declared dead): register again. */
            peer_io_send_hello(p);
            break;
        }
        if (e->in_reply_to == FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ) { /* too soon: keep what we have */
            p->probe_t0_ns = 0;
            p->probe_done_ms = fu_clock_ms();
            break;
        }
        if (e->in_reply_to == FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST) { /* the fetch must stop waiting */
            peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
            c->msg = m;
            peer_io_deliver(p, c);
            return;
        }
        break;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_ASSIGN: {
        const Fusion__StageAssign *a = wire_msg_body_as(m, t);
        if (p->leaving) {
            FU_INFO("peer", "leaving: StageAssign for job %016" PRIx64 " not taken", a->job_id);
            break;
        }
        if (!a->backup)
            peer_link_open_all(p, a);
        peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
        c->msg = m;
        c->gen = a->backup ? 0 : p->gen;
        peer_io_deliver(p, c);
        return;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_RELEASE: {
        const Fusion__StageRelease *r = wire_msg_body_as(m, t);
        if (r->job_id == p->job_id || r->job_id == 0)
            peer_link_close_all(p);
        peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
        c->msg = m;
        peer_io_deliver(p, c);
        return;
    }
    case FUSION__MSG_TYPE__MSG_VERIFY_INPUT:
        on_verify_input(p, m); /* takes m */
        return;
    case FUSION__MSG_TYPE__MSG_STAGE_START:
    case FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK:
    case FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK:
    case FUSION__MSG_TYPE__MSG_INFER_TOKEN:
    case FUSION__MSG_TYPE__MSG_SESSION_START:
    case FUSION__MSG_TYPE__MSG_SESSION_END:
    case FUSION__MSG_TYPE__MSG_VERIFY_REQUEST:
    case FUSION__MSG_TYPE__MSG_VERIFY_DELIVER:
    case FUSION__MSG_TYPE__MSG_CHALLENGE: {
        peer_cmd *c = peer_cmd_new(PEER_CMD_MSG);
        c->msg = m;
        peer_io_deliver(p, c);
        return;
    }
    default:
        FU_DEBUG("peer", "broker: %s ignored", wire_type_name(t));
        break;
    }
    wire_msg_destroy(&m);
}

void peer_io_on_compute(peer_t *p, peer_cmd *c)
{
    switch (c->kind) {
    case PEER_CMD_SEND: {
        wire_hdr h = {.type = c->type, .job_id = c->job_id, .step = c->step, .stage = c->stage,
                      .sequence = ++p->seq, .slot = p->cfg.slot};
        void *body = c->body;
        c->body = NULL;
        fu_err rc = wire_send_packed(p->broker, NULL, 0, &h, body, body ? c->body_len : 0, body ? free_cb : NULL,
                                     NULL);
        if (rc != FU_OK)
            FU_WARN("peer", "cannot send %s to the broker: %s", wire_type_name(c->type), fu_strerror(rc));
        break;
    }
    case PEER_CMD_SEND_TENSOR:
        peer_link_send_tensor(p, c);
        break;
    case PEER_CMD_VERIFY_SEND:
        send_verify_input(p, c);
        break;
    case PEER_CMD_READY:
        if (c->backup) {
            peer_link_send_ready(p, c->job_id, c->stage, "warm backup ready");
        } else if (c->gen == p->gen && c->job_id == p->job_id) {
            p->ready_pending = true;
            peer_link_check_ready(p);
        }
        break;
    case PEER_CMD_STAGE_GONE:
        if (c->gen == p->gen && c->job_id == p->job_id)
            peer_link_close_all(p); /* a newer assignment's links stay */
        break;
    case PEER_CMD_FATAL:
        p->fatal = true;
        p->fatal_err = c->err;
        break;
    default:
        break;
    }
    peer_cmd_destroy(&c);
}
