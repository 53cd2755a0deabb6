/* peer_link: the sealed data links of fusion-peer's I/O thread (see peer.h): the links of an
 * assignment (opening, keeping, closing), the SealHello handshake (openings and replies), reading the
 * data plane and assembling incoming tensors, sealing and sending outgoing ones (directly or relayed
 * through the broker) while heartbeats go on, and StageReady once the links are up. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <zmq.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "peer_internal.h"
#include "peer_faults.h"
#include "peer_io_internal.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_seal.h"
#include "wire_socket.h"
#include "wire_tensor.h"

void peer_link_reset(link_t *l)
{
    wire_seal_eph_destroy(&l->eph);
    wire_seal_destroy(&l->seal);
    wire_tensor_asm_destroy(&l->asm_);
    memset(l, 0, sizeof *l);
}

void peer_link_close_all(peer_t *p)
{
    peer_link_reset(&p->links[0]);
    peer_link_reset(&p->links[1]);
    wire_socket_close(&p->down);
    p->ready_pending = false;
    p->job_id = 0;
}

/* Largest activation/gradient a neighbour may send: what this peer offers, at most IO_MAX_TENSOR. */
size_t peer_link_max_tensor(const peer_t *p)
{
    uint64_t m = p->prof.free_memory_bytes / 2;
    return m && m < IO_MAX_TENSOR ? (size_t)m : IO_MAX_TENSOR;
}

/* SealHello handshake. An *opening* (Envelope.step 0, Envelope.sequence = our opening number) carries
 * our pending ephemeral key; a *reply* (Envelope.step 1, Envelope.sequence = the opening it answers)
 * carries the key we derived with. Every opening is answered; a reply is used only when it answers
 * our latest opening; a reply never triggers a message, so two sides never ping-pong. Openings that
 * cross (both sides relayed) are each answered and both sides derive from the same pair. */
static fu_err send_seal_hello(peer_t *p, link_t *l, bool reply, uint64_t seq, const uint8_t eph_pub[WIRE_KEY_BYTES])
{
    Fusion__SealHello h = FUSION__SEAL_HELLO__INIT;
    h.long_term_key.data = (uint8_t *)wire_keypair_public(p->kp);
    h.long_term_key.len = WIRE_KEY_BYTES;
    h.ephemeral_key.data = (uint8_t *)eph_pub;
    h.ephemeral_key.len = WIRE_KEY_BYTES;
    h.job_id = p->job_id;
    h.stage_index = p->stage_index;
    wire_hdr hdr = {.type = FUSION__MSG_TYPE__MSG_SEAL_HELLO, .job_id = p->job_id, .stage = p->stage_index,
                    .step = reply ? 1 : 0, .sequence = seq, .relay_to = l->relay ? l->id_z85 : NULL,
                    .slot = l->relay ? p->cfg.slot : 0};
    fu_err rc;
    if (l->relay)
        rc = wire_send(p->broker, NULL, 0, &hdr, &h.base);
    else if (l == &p->links[LINK_DOWN_IDX])
        rc = wire_send(p->down, NULL, 0, &hdr, &h.base);
    else
        rc = wire_send(p->router, l->rid, l->rid_len, &hdr, &h.base);
    if (rc != FU_OK)
        FU_WARN("peer", "SealHello to stage %u failed: %s", l->stage_index, fu_strerror(rc));
    return rc;
}

/* Sends an opening with a fresh pending ephemeral key. */
static fu_err send_opening(peer_t *p, link_t *l)
{
    wire_seal_eph_destroy(&l->eph);
    if (!(l->eph = wire_seal_eph_new()))
        return FU_ENOMEM;
    l->open_seq = ++p->open_counter;
    fu_err rc = send_seal_hello(p, l, false, l->open_seq, wire_seal_eph_public(l->eph));
    l->hello_sent = rc == FU_OK;
    return rc;
}

void peer_link_send_ready(peer_t *p, uint64_t job, uint32_t stage, const char *what)
{
    Fusion__StageReady r = FUSION__STAGE_READY__INIT;
    r.job_id = job;
    r.stage_index = stage;
    if (peer_io_to_broker(p, FUSION__MSG_TYPE__MSG_STAGE_READY, job, 0, stage, &r.base) == FU_OK)
        FU_INFO("peer", "job %016" PRIx64 " stage %u: %s", job, stage, what);
}

void peer_link_check_ready(peer_t *p)
{
    if (!p->ready_pending)
        return;
    for (int i = 0; i < 2; i++)
        if (p->links[i].active && !p->links[i].up)
            return;
    if (peer_fault_stall_ready()) /* test hook (PEER_STALL_ENV): retried at every heartbeat */
        return;
    peer_link_send_ready(p, p->job_id, p->stage_index, "StageReady");
    p->ready_pending = false;
}

static void on_seal_hello(peer_t *p, int src, wire_msg_t *m);

/* Opens the links of a new (non-backup) assignment; SealHellos that came early are taken now. */
void peer_link_open_all(peer_t *p, const Fusion__StageAssign *a)
{
    /* A sealed upstream link to the same neighbour for the same job (its opening for this
     * assignment came before the assignment did, e.g. after a broker restart) is kept. */
    link_t kept;
    bool keep = false;
    link_t *ou = &p->links[LINK_UP_IDX];
    for (size_t i = 0; i < a->n_neighbours && ou->active && ou->up && !ou->relay && ou->rid_len; i++) {
        const Fusion__Neighbour *nb = a->neighbours[i];
        if (nb->role == FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM && !nb->relay && !a->relay && a->job_id == p->job_id &&
            nb->public_key.len == WIRE_KEY_BYTES && sodium_memcmp(nb->public_key.data, ou->pk, WIRE_KEY_BYTES) == 0 &&
            strcmp(nb->peer_id && nb->peer_id[0] ? nb->peer_id : ou->pk_z85, ou->id_z85) == 0) { /* the same slot */
            kept = *ou;
            memset(ou, 0, sizeof *ou); /* ownership moves to kept */
            keep = true;
        }
    }
    peer_link_close_all(p);
    p->gen++;
    p->job_id = a->job_id;
    p->stage_index = a->stage_index;
    p->assign_ms = fu_clock_ms();
    for (size_t i = 0; i < a->n_neighbours && i < 2; i++) {
        const Fusion__Neighbour *nb = a->neighbours[i];
        int idx = nb->role == FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM     ? LINK_UP_IDX
                  : nb->role == FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM ? LINK_DOWN_IDX
                                                                         : -1;
        if (idx < 0 || nb->public_key.len != WIRE_KEY_BYTES || p->links[idx].active) {
            FU_WARN("peer", "StageAssign: ignoring a malformed neighbour");
            continue;
        }
        link_t *l = &p->links[idx];
        if (idx == LINK_UP_IDX && keep) {
            *l = kept;
            keep = false;
            l->stage_index = nb->stage_index;
            FU_INFO("peer", "job %016" PRIx64 ": sealed link to upstream stage %u kept", a->job_id, l->stage_index);
            continue;
        }
        l->active = true;
        memcpy(l->pk, nb->public_key.data, WIRE_KEY_BYTES);
        wire_key_to_z85(l->pk, l->pk_z85);
        snprintf(l->id_z85, sizeof l->id_z85, "%s", nb->peer_id && nb->peer_id[0] ? nb->peer_id : l->pk_z85);
        l->stage_index = nb->stage_index;
        snprintf(l->endpoint, sizeof l->endpoint, "%s", nb->data_endpoint ? nb->data_endpoint : "");
        l->relay = nb->relay || a->relay || (idx == LINK_UP_IDX && !p->router) ||
                   (idx == LINK_DOWN_IDX && !l->endpoint[0]);
        l->asm_ = wire_tensor_asm_new(peer_link_max_tensor(p));
        if (idx == LINK_DOWN_IDX && !l->relay) {
            fu_err err;
            p->down = wire_socket_new(p->ctx, ZMQ_DEALER, &err);
            if (!p->down || zmq_connect(p->down, l->endpoint) != 0) {
                FU_ERROR("peer", "cannot connect to the downstream stage at '%s'", l->endpoint);
                wire_socket_close(&p->down);
                continue;
            }
        }
        if ((l->relay || idx == LINK_DOWN_IDX) && send_opening(p, l) == FU_ENOMEM) {
            FU_ERROR("peer", "no secure memory for a link key");
            l->active = false;
            continue;
        }
        FU_INFO("peer", "job %016" PRIx64 ": link to %s stage %u %s%s", a->job_id, idx ? "downstream" : "upstream",
                l->stage_index, l->relay ? "relayed by the broker" : "direct ", l->relay ? "" : l->endpoint);
    }
    if (keep)
        peer_link_reset(&kept); /* the assignment has no such upstream any more */
    for (int s = 0; s < SRC_COUNT; s++) {
        wire_msg_t *m = p->early[s];
        p->early[s] = NULL;
        if (m) {
            if (s == SRC_ROUTER) {
                memcpy(p->links[LINK_UP_IDX].rid, p->early_rid, p->early_rid_len);
                p->links[LINK_UP_IDX].rid_len = p->early_rid_len;
            }
            on_seal_hello(p, s, m); /* takes m */
        }
    }
}

static link_t *link_for(peer_t *p, int src, const wire_msg_t *m)
{
    if (src == SRC_ROUTER)
        return p->links[LINK_UP_IDX].active && !p->links[LINK_UP_IDX].relay ? &p->links[LINK_UP_IDX] : NULL;
    if (src == SRC_DOWN)
        return p->links[LINK_DOWN_IDX].active && !p->links[LINK_DOWN_IDX].relay ? &p->links[LINK_DOWN_IDX] : NULL;
    const char *sender = wire_msg_hdr(m)->sender;
    for (int i = 0; i < 2; i++)
        if (p->links[i].active && p->links[i].relay && sender && strcmp(sender, p->links[i].id_z85) == 0)
            return &p->links[i];
    return NULL;
}

/* Takes m. */
static void on_seal_hello(peer_t *p, int src, wire_msg_t *m)
{
    const Fusion__SealHello *h = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_SEAL_HELLO);
    if (!h) {
        wire_msg_destroy(&m);
        return;
    }
    link_t *l = link_for(p, src, m);
    if (!l || h->job_id != p->job_id) {
        /* Before our assignment (or between a release and the next): keep the newest per source. */
        wire_msg_destroy(&p->early[src]);
        p->early[src] = m;
        if (src == SRC_ROUTER) {
            size_t n;
            const uint8_t *rid = wire_msg_routing_id(m, &n);
            memcpy(p->early_rid, rid, n);
            p->early_rid_len = n;
        }
        return;
    }
    if (h->long_term_key.len != WIRE_KEY_BYTES || h->ephemeral_key.len != WIRE_KEY_BYTES ||
        sodium_memcmp(h->long_term_key.data, l->pk, WIRE_KEY_BYTES) != 0) {
        FU_WARN("peer", "SealHello from stage %u refused: its key is not the one the broker introduced",
                h->stage_index);
        wire_msg_destroy(&m);
        return;
    }
    if (src == SRC_ROUTER) {
        size_t n;
        const uint8_t *rid = wire_msg_routing_id(m, &n);
        memcpy(l->rid, rid, n);
        l->rid_len = n;
    }
    const wire_hdr *hd = wire_msg_hdr(m);
    bool reply = hd->step == 1;
    uint64_t their_seq = hd->sequence;
    if (reply && !(l->eph && l->hello_sent && their_seq == l->open_seq)) {
        FU_DEBUG("peer", "SealHello reply from stage %u to an opening we no longer wait for: ignored", l->stage_index);
        wire_msg_destroy(&m);
        return;
    }
    if (!reply) {
        /* An opening: answer it, with our pending key when our own opening crossed it, else a new one. */
        if (!(l->eph && l->hello_sent)) {
            wire_seal_eph_destroy(&l->eph);
            if (!(l->eph = wire_seal_eph_new())) {
                wire_msg_destroy(&m);
                return;
            }
        }
        uint8_t pub[WIRE_KEY_BYTES];
        memcpy(pub, wire_seal_eph_public(l->eph), WIRE_KEY_BYTES);
        if (send_seal_hello(p, l, true, their_seq, pub) != FU_OK) {
            wire_msg_destroy(&m);
            return;
        }
    }
    fu_err err = FU_OK;
    wire_seal_destroy(&l->seal);
    l->seal = wire_seal_new(p->kp, l->pk, &l->eph, h->ephemeral_key.data, &err);
    l->hello_sent = false;
    wire_msg_destroy(&m);
    if (!l->seal) {
        FU_WARN("peer", "link to stage %u: cannot derive keys: %s", l->stage_index, fu_strerror(err));
        l->up = false;
        return;
    }
    wire_tensor_asm_destroy(&l->asm_);
    l->asm_ = wire_tensor_asm_new(peer_link_max_tensor(p));
    l->up = true;
    FU_INFO("peer", "job %016" PRIx64 ": sealed link to stage %u up", p->job_id, l->stage_index);
    peer_link_check_ready(p);
}

/* A data-plane message (takes m). */
void peer_link_on_data(peer_t *p, int src, wire_msg_t *m)
{
    Fusion__MsgType t = wire_msg_type(m);
    if (t == FUSION__MSG_TYPE__MSG_SEAL_HELLO) {
        on_seal_hello(p, src, m); /* takes m */
        return;
    }
    if (t != FUSION__MSG_TYPE__MSG_ACTIVATION && t != FUSION__MSG_TYPE__MSG_GRADIENT) {
        FU_DEBUG("peer", "data plane: %s ignored", wire_type_name(t));
        wire_msg_destroy(&m);
        return;
    }
    link_t *l = link_for(p, src, m);
    /* Activations come from upstream, gradients from downstream. */
    if (!l || !l->up || (t == FUSION__MSG_TYPE__MSG_ACTIVATION) != (l == &p->links[LINK_UP_IDX])) {
        p->counters.dropped_malformed++;
        wire_msg_destroy(&m);
        return;
    }
    bool done = false;
    /* Takes m: a sealed chunk is opened on the assembler's workers while the next one arrives. */
    fu_err rc = wire_tensor_asm_feed_msg(l->asm_, l->seal, &m, &done);
    if (rc != FU_OK) {
        FU_WARN("peer", "%s chunk from stage %u refused: %s", wire_type_name(t), l->stage_index, fu_strerror(rc));
        return;
    }
    if (!done)
        return;
    peer_cmd *c = peer_cmd_new(PEER_CMD_TENSOR);
    if (wire_tensor_asm_take(l->asm_, &c->tensor) != FU_OK) {
        peer_cmd_destroy(&c);
        return;
    }
    peer_io_deliver(p, c);
}

/* Reads up to 64 data-plane messages from sock (NULL: none) while the compute thread keeps up. With
 * hold, only tensor chunks are handled now; anything else is held for the loop (see send_wait). */
void peer_link_read_data(peer_t *p, void *sock, int src, bool hold)
{
    for (int k = 0; sock && k < 64 && !peer_io_input_paused(p) && !(hold && p->n_held == PEER_HELD); k++) {
        wire_msg_t *m = NULL;
        fu_err rc = wire_recv(sock, WIRE_DONTWAIT, &p->counters, &m);
        if (rc == FU_EAGAIN)
            break;
        if (rc != FU_OK)
            continue;
        Fusion__MsgType t = wire_msg_type(m);
        if (hold && t != FUSION__MSG_TYPE__MSG_ACTIVATION && t != FUSION__MSG_TYPE__MSG_GRADIENT) {
            p->held[p->n_held] = m;
            p->held_src[p->n_held++] = src;
        } else {
            peer_link_on_data(p, src, m); /* takes m */
        }
    }
}

/* While a tensor waits for room in a neighbour's queue (wire_tensor_send_waiting): heartbeats go
 * out on time (blocking here used to silence them for up to the 10 s send timeout, long enough to
 * be declared dead), and tensor chunks coming the other way are taken, so that two neighbours
 * sending to each other with full queues do not wait on each other. Anything else read meanwhile is
 * held for the loop: it may change the links a send is using. Gives up on stop or a failed compute
 * thread. */
static bool send_wait(void *arg)
{
    peer_t *p = arg;
    p->send_waited = true;
    if (p->known && fu_clock_ms() - p->last_hb_ms >= p->hb_ms)
        peer_io_send_heartbeat(p, true);
    peer_io_flush_stash(p);
    peer_link_read_data(p, p->router, SRC_ROUTER, true);
    peer_link_read_data(p, p->down, SRC_DOWN, true);
    return !peer_io_stop_requested() && !p->fatal;
}

void peer_link_handle_held(peer_t *p)
{
    size_t n = p->n_held;
    p->n_held = 0;
    for (size_t i = 0; i < n; i++)
        peer_link_on_data(p, p->held_src[i], p->held[i]); /* takes it */
}

void peer_link_send_tensor(peer_t *p, peer_cmd *c)
{
    link_t *l = &p->links[c->role == FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM ? LINK_DOWN_IDX : LINK_UP_IDX];
    if (!l->active || !l->up || c->job_id != p->job_id || c->gen != p->gen) {
        FU_WARN("peer", "no open link to send %s (%" PRIu64 ", %u): dropped", wire_type_name(c->meta.type),
                c->meta.step, c->meta.micro_batch);
        return;
    }
    void *sock = l->relay ? p->broker : l == &p->links[LINK_DOWN_IDX] ? p->down : p->router;
    c->meta.relay_to = l->relay ? fu_strdup(l->id_z85) : NULL;
    c->meta.slot = p->cfg.slot;
    uint64_t seq = 0;
    wire_send_wait w = {.wait = send_wait, .arg = p, .timeout_ms = PEER_SEND_WAIT_MS};
    p->send_waited = false;
    fu_err rc = wire_tensor_send_waiting(sock, l->relay || l == &p->links[LINK_DOWN_IDX] ? NULL : l->rid,
                                         l->relay || l == &p->links[LINK_DOWN_IDX] ? 0 : l->rid_len, l->seal,
                                         &c->meta, c->data, c->len, 0, &seq, &w);
    if (p->send_waited) /* the broker's messages queued unread meanwhile: not its silence */
        p->last_broker_ms = fu_clock_ms();
    if (rc != FU_OK)
        FU_WARN("peer", "sending %s (%" PRIu64 ", %u) to stage %u failed: %s", wire_type_name(c->meta.type),
                c->meta.step, c->meta.micro_batch, l->stage_index, fu_strerror(rc));
}
