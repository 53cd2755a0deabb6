/* broker: construction, the poll loop, dispatch by message type, sending helpers and the relay. */
#include "broker.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>
#include <zmq.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "fu_log.h"
#include "wire_socket.h"

#define LOG "broker"
#define BROKER_SWEEP_MIN_MS 50  /* shortest timer period */
#define BROKER_SWEEP_MAX_MS 250 /* longest sleep in zmq_poll */
#define BROKER_TURN_MSGS    256 /* messages read from a socket in one turn of the loop */
/* Messages queued to or from one gateway (ZMQ_SNDHWM/RCVHWM of the gateways' socket): a gateway
 * carries thousands of peers, each of which may have WIRE_HWM queued on a direct connection. */
#define BROKER_GATEWAY_HWM  65536

static volatile sig_atomic_t g_stop;
static volatile int g_wake_fd = -1; /* write end of the self-pipe */

void broker_request_stop(void)
{
    g_stop = 1;
    int fd = g_wake_fd;
    if (fd >= 0) {
        char c = 1;
        ssize_t r = write(fd, &c, 1);
        (void)r;
    }
}

/* ---------- relay ---------- */

void broker_on_relay(broker_t *b, const wire_msg_t *msg)
{
    const char *to = wire_msg_hdr(msg)->relay_to;
    char from[DB_KEY_LEN + 1];
    broker_peer *src = broker_msg_peer_id(msg, from) ? broker_peer_find(b, from) : NULL;
    if (!src || !src->live) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_AUTH, "only registered peers may relay: send PeerHello first");
        return;
    }
    Fusion__MsgType t = wire_msg_type(msg);
    if (t != FUSION__MSG_TYPE__MSG_SEAL_HELLO && t != FUSION__MSG_TYPE__MSG_ACTIVATION &&
        t != FUSION__MSG_TYPE__MSG_GRADIENT) {
        /* Only data-plane frames travel peer to peer; anything else relayed would reach the other peer
         * looking like the broker's own word (a StageAssign, a VerifyRequest...). */
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "only SealHello, activation and gradient frames are relayed, not %s", wire_type_name(t));
        return;
    }
    broker_peer *dst = broker_peer_find(b, to);
    if (!dst || !dst->live) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND, "relay target %.12s... is not a live peer", to);
        return;
    }
    fu_err rc = wire_forward(broker_sock_for(b, dst->rid, dst->rid_len), dst->rid, dst->rid_len, msg, from);
    if (rc != FU_OK) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY, "relay to %.12s... failed: %s", to, fu_strerror(rc));
        return;
    }
    b->relayed++;
    b->tot.relayed_bytes += wire_msg_heap_bytes(msg);
}

/* ---------- dispatch ---------- */

/* Answers an Enrol with Error{ERR_AUTH} without the log line broker_reply_error writes: wrong tokens
 * are logged by on_enrol, a few lines per address however many come. */
static void enrol_refuse(broker_t *b, const wire_msg_t *msg)
{
    Fusion__Error e = FUSION__ERROR__INIT;
    e.code = FUSION__ERROR_CODE__ERR_AUTH;
    e.message = (char *)"enrolment refused: the token is wrong or enrolment is off (ask the operator for the "
                        "broker's client or peer enrolment token)";
    e.in_reply_to = wire_msg_type(msg);
    e.sequence = wire_msg_hdr(msg)->sequence;
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_ERROR, &e.base);
}

/* Logs a wrong token as the verdict says: nothing, the first of its address in a minute, or the
 * summary that goes with a new ban. */
static void enrol_log_failure(const char *addr, const char *uid, const broker_auth_verdict *v, uint64_t now)
{
    char dropped[64] = "";
    if (v->dropped)
        snprintf(dropped, sizeof dropped, ", %u dropped unread while banned", v->dropped);
    if (v->log_first) {
        char more[64] = "";
        if (v->more)
            snprintf(more, sizeof more, "; %u more before it not logged", v->more);
        FU_WARN(LOG, "wrong enrolment token from %s (key %.12s...)%s%s", addr, uid, more, dropped);
    } else if (v->log_summary) {
        uint64_t left_ms = v->banned_until - now;
        time_t end = (time_t)((broker_wall() + (int64_t)left_ms) / 1000);
        struct tm tm;
        char when[32] = "?";
        if (gmtime_r(&end, &tm))
            strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
        FU_WARN(LOG, "%u more wrong enrolment tokens from %s%s, banned until %s (%llu s): its Enrols and new keys "
                     "are refused unanswered until then",
                v->more, addr, dropped, when, (unsigned long long)(left_ms / 1000));
    }
}

/* Enrol: a key presents a token for the roles that token grants (wire_zap_enrol). Wrong tokens are
 * rate-limited per address: BROKER_AUTH_MAX_FAILS in a window ban the address (broker_auth.h), and
 * a banned address's Enrols are dropped unanswered: an answer is what a brute force needs. */
static void on_enrol(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__Enrol *e = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_ENROL);
    const char *uid = wire_msg_user_id(msg), *addr = wire_msg_peer_address(msg);
    uint64_t now = broker_now();
    if (broker_auth_banned(b->auth, addr, now))
        return;
    uint32_t roles = 0;
    fu_err rc = e ? wire_zap_enrol(b->zap, uid, e->token, &roles) : FU_EAUTH;
    if (rc == FU_EAUTH || rc == FU_EINVAL) {
        broker_auth_verdict v;
        broker_auth_failed(b->auth, addr, now, &v);
        if (v.log_summary) {
            wire_zap_ban(b->zap, addr, v.banned_until);
            broker_gateways_ban(b, addr, v.banned_until); /* refused at their handshakes too */
        }
        enrol_log_failure(addr[0] ? addr : "an unknown address", uid, &v, now);
        enrol_refuse(b, msg);
        return;
    }
    if (rc != FU_OK) /* enrolled in memory; the next start will not know it */
        FU_ERROR(LOG, "could not append key %s to the allow-list file: %s (add it by hand)", uid, fu_strerror(rc));
    broker_gateways_key(b, uid, roles); /* before the answer: its next connection may be through one */
    char text[WIRE_ROLES_TEXT_MAX];
    FU_INFO(LOG, "enrolled key %s (%s) from %s as %s", uid, e->name, addr, wire_roles_text(roles, text));
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), NULL, uid, "enrolled", e->name));
    Fusion__EnrolAck ack = FUSION__ENROL_ACK__INIT;
    ack.peer_id = (char *)uid;
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_ENROL_ACK, &ack.base);
}

/* Messages only a registered, live peer may send. */
static broker_peer *peer_of(broker_t *b, const wire_msg_t *msg)
{
    char id[DB_KEY_LEN + 1];
    broker_peer *p = broker_msg_peer_id(msg, id) ? broker_peer_find(b, id) : NULL;
    if (!p || !p->live) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "this key is not a registered peer (or was declared dead): send PeerHello to register");
        return NULL;
    }
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    if (rl && rl <= sizeof p->rid) { /* the newest connection of this key is where it listens */
        memcpy(p->rid, rid, rl);
        p->rid_len = rl;
    }
    p->last_heard_ms = broker_now();
    broker_conn_heard(b, p, msg);
    return p;
}

/* The role a message type needs (docs/PROTOCOL.md "Admission"): what only a peer sends needs
 * WIRE_ROLE_PEER, the client API WIRE_ROLE_CLIENT; 0 for any member (PeerList, Enrol, and types the
 * broker refuses anyway). */
static uint32_t role_needed(Fusion__MsgType t)
{
    switch (t) {
    case FUSION__MSG_TYPE__MSG_PEER_HELLO:
    case FUSION__MSG_TYPE__MSG_HEARTBEAT:
    case FUSION__MSG_TYPE__MSG_LEAVE:
    case FUSION__MSG_TYPE__MSG_STAGE_READY:
    case FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST:
    case FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT:
    case FUSION__MSG_TYPE__MSG_STEP_DONE:
    case FUSION__MSG_TYPE__MSG_INFER_TOKEN:
    case FUSION__MSG_TYPE__MSG_VERIFY_SKETCH:
    case FUSION__MSG_TYPE__MSG_VERIFY_INPUT:
    case FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ:
    case FUSION__MSG_TYPE__MSG_CHALLENGE_REPLY:
    case FUSION__MSG_TYPE__MSG_ERROR:
        return WIRE_ROLE_PEER;
    case FUSION__MSG_TYPE__MSG_JOB_SUBMIT:
    case FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ:
    case FUSION__MSG_TYPE__MSG_JOB_LIST_REQ:
    case FUSION__MSG_TYPE__MSG_JOB_CANCEL:
    case FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ:
    case FUSION__MSG_TYPE__MSG_MODEL_UPLOAD:
    case FUSION__MSG_TYPE__MSG_MODEL_CHUNK:
    case FUSION__MSG_TYPE__MSG_SESSION_OPEN:
    case FUSION__MSG_TYPE__MSG_SESSION_STATUS_REQ:
    case FUSION__MSG_TYPE__MSG_SESSION_CLOSE:
        return WIRE_ROLE_CLIENT;
    default:
        return 0;
    }
}

static void dispatch(broker_t *b, const wire_msg_t *msg)
{
    Fusion__MsgType t = wire_msg_type(msg);
    const char *uid = wire_msg_user_id(msg);
    if (!db_key_valid(uid)) { /* never happens with ZAP on; refuse rather than trust a routing id */
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_AUTH, "no authenticated key on this connection");
        return;
    }
    const char *gw = wire_msg_gateway(msg);
    if (gw[0] && !(wire_zap_roles(b->zap, gw) & WIRE_ROLE_GATEWAY)) {
        /* its role was taken away since it connected: nothing it vouches for is believed */
        b->tot.gateway_refused++;
        return;
    }
    if (t == FUSION__MSG_TYPE__MSG_GATEWAY_CLOSED) { /* a gateway's word only; from anyone else, noise */
        if (gw[0])
            broker_conn_gateway_closed(b, msg);
        return;
    }
    if (t == FUSION__MSG_TYPE__MSG_GATEWAY_HELLO) { /* a gateway for itself, on the gateway socket only */
        if (!gw[0] && (wire_zap_msg_roles(b->zap, msg) & WIRE_ROLE_GATEWAY))
            broker_gateways_hello(b, msg);
        return;
    }
    uint32_t roles = wire_zap_msg_roles(b->zap, msg);
    if (!roles) {
        if (t == FUSION__MSG_TYPE__MSG_ENROL)
            on_enrol(b, msg);
        else
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_AUTH,
                               "this key is not admitted yet: send Enrol with the broker's enrolment token first");
        return;
    }
    const char *relay_to = wire_msg_hdr(msg)->relay_to;
    bool relayed = relay_to && relay_to[0];
    uint32_t need = relayed ? WIRE_ROLE_PEER : role_needed(t);
    if (need & ~roles) {
        if (t == FUSION__MSG_TYPE__MSG_ERROR)
            return; /* an Error is never answered */
        const char *role = need == WIRE_ROLE_PEER ? "peer" : "client";
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_AUTH,
                           "this key is not admitted as a %s: ask the operator for the %s role or the %s enrolment "
                           "token",
                           role, role, role);
        return;
    }
    if (relayed) {
        broker_on_relay(b, msg);
        return;
    }
    broker_peer *p;
    switch (t) {
    case FUSION__MSG_TYPE__MSG_PEER_HELLO: {
        broker_on_hello(b, msg);
        char id[DB_KEY_LEN + 1];
        p = broker_msg_peer_id(msg, id) ? broker_peer_find(b, id) : NULL;
        if (p && p->live) /* registered: its connection is this message's */
            broker_conn_heard(b, p, msg);
        break;
    }
    case FUSION__MSG_TYPE__MSG_HEARTBEAT:
        if ((p = peer_of(b, msg)))
            broker_on_heartbeat(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_LEAVE:
        if ((p = peer_of(b, msg)))
            broker_on_leave(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_STAGE_READY:
        if ((p = peer_of(b, msg)))
            broker_on_stage_ready(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST:
        if ((p = peer_of(b, msg)))
            broker_on_weight_request(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT:
        if ((p = peer_of(b, msg)))
            broker_on_checkpoint(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_STEP_DONE:
        if ((p = peer_of(b, msg)))
            broker_on_step_done(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_INFER_TOKEN:
        if ((p = peer_of(b, msg)))
            broker_on_infer_token(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_VERIFY_SKETCH:
        if ((p = peer_of(b, msg)))
            broker_on_verify_sketch(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_VERIFY_INPUT:
        if ((p = peer_of(b, msg)))
            broker_on_verify_input(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ:
        if ((p = peer_of(b, msg)))
            broker_on_link_probe(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_CHALLENGE_REPLY:
        if ((p = peer_of(b, msg)))
            broker_on_challenge_reply(b, p, msg);
        break;
    case FUSION__MSG_TYPE__MSG_ERROR:
        p = broker_peer_find(b, uid);
        if (p && p->live)
            broker_on_peer_error(b, p, msg);
        break; /* an Error is never answered */
    case FUSION__MSG_TYPE__MSG_JOB_SUBMIT:
        broker_on_submit(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ:
        broker_on_status(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_SESSION_OPEN:
        broker_on_session_open(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_SESSION_STATUS_REQ:
    case FUSION__MSG_TYPE__MSG_SESSION_CLOSE:
        broker_on_session_status(b, msg, t == FUSION__MSG_TYPE__MSG_SESSION_CLOSE);
        break;
    case FUSION__MSG_TYPE__MSG_JOB_LIST_REQ:
        broker_on_list(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_JOB_CANCEL:
        broker_on_cancel(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ:
        broker_on_result(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_MODEL_UPLOAD:
        broker_on_model_upload(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_MODEL_CHUNK:
        broker_on_model_chunk(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_PEER_LIST_REQ:
        broker_on_peer_list(b, msg);
        break;
    case FUSION__MSG_TYPE__MSG_ENROL: {
        /* A member's token may add roles (a client enrolling as a peer too); without one there is
         * nothing to do. */
        const Fusion__Enrol *e = wire_msg_body_as(msg, t);
        if (e && e->token && e->token[0]) {
            on_enrol(b, msg);
            break;
        }
        Fusion__EnrolAck ack = FUSION__ENROL_ACK__INIT;
        ack.peer_id = (char *)uid;
        (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_ENROL_ACK, &ack.base);
        break;
    }
    case FUSION__MSG_TYPE__MSG_ACTIVATION:
    case FUSION__MSG_TYPE__MSG_GRADIENT:
    case FUSION__MSG_TYPE__MSG_SEAL_HELLO:
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "%s to the broker needs Envelope.relay_to (the receiving peer's key)", wire_type_name(t));
        break;
    default:
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_UNKNOWN_TYPE, "%s is not a message the broker accepts",
                           wire_type_name(t));
        break;
    }
}

/* ---------- lifecycle ---------- */

static void resume_jobs(broker_t *b)
{
    db_job *arr = NULL;
    size_t n = 0;
    if (db_jobs_unfinished(b->db, &arr, &n) != FU_OK) {
        FU_ERROR(LOG, "could not read unfinished jobs back from the store");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        fu_errmsg em = {{0}};
        broker_job *j = NULL;
        fu_err rc = broker_job_load(b, &arr[i], &j, &em);
        if (rc != FU_OK) {
            broker_job_refuse(b, arr[i].id, fu_errmsg_text(&em, rc));
            continue;
        }
        if (arr[i].state == DB_JOB_RUNNING) { /* peers notice our silence and re-register: recover once they could */
            j->after_restart = true;
            broker_job_recover_wait(b, j, broker_now() + 2u * b->dead_after_ms);
        }
        FU_INFO(LOG, "resumed job %s (%s, %s)", j->id, db_job_kind_name(j->kind), db_job_state_name(arr[i].state));
    }
    db_job_array_free(&arr, n);
    b->sched_dirty = true;
}

/* The model cache over the ':'-separated roots. */
/* The model roots: --model-root's, then the uploads directory (when uploads are on). */
static fu_err models_new(broker_t *b, const char *roots, fu_errmsg *em)
{
    char *copy = fu_strdup(roots ? roots : "");
    const char *list[BROKER_MODEL_ROOTS_MAX];
    size_t n = 0;
    fu_err rc = FU_OK;
    char *up = b->cfg.upload_gib ? fu_path_join(b->data_dir, BROKER_UPLOAD_DIR) : NULL;
    if (up && !(b->uploads = broker_uploads_new(up, (uint64_t)b->cfg.upload_gib << 30, em))) {
        free(up);
        free(copy);
        return FU_EIO;
    }
    for (char *save = NULL, *r = strtok_r(copy, ":", &save); r; r = strtok_r(NULL, ":", &save)) {
        if (n == BROKER_MODEL_ROOTS_MAX - 1) {
            rc = fu_errmsg_set(em, FU_EINVAL, "--model-root names more than %d directories", BROKER_MODEL_ROOTS_MAX);
            break;
        }
        list[n++] = r;
    }
    if (rc == FU_OK && n == 0)
        FU_WARN(LOG, "no --model-root: this broker serves only models clients upload%s",
                up ? "" : " (and takes no uploads: every job will be refused)");
    if (up)
        list[n++] = up;
    if (rc == FU_OK && !(b->models = broker_models_new(list, n, 0, em)))
        rc = FU_ENOTFOUND;
    free(up);
    free(copy);
    return rc;
}

/* Who may join, for the start line: "allow-list" and the enrolments open. Static storage. */
static const char *enrolments_open(const broker_cfg *cfg)
{
    static char text[128];
    bool both = cfg->enrol_token && cfg->enrol_token[0], peer = cfg->peer_token && cfg->peer_token[0],
         client = cfg->client_token && cfg->client_token[0];
    snprintf(text, sizeof text, "allow-list%s%s%s%s", both || peer || client ? " + enrolment as " : "",
             both ? "client+peer" : "", peer ? (both ? ", peer" : "peer") : "",
             client ? (both || peer ? ", client" : "client") : "");
    return text;
}

/* The gateways' ROUTER (docs/PROTOCOL.md "Gateways"): CURVE with the broker's keys on the gateway
 * ZAP domain, so only keys with the gateway role get in, and with queues as deep as the thousands of
 * peers a gateway carries need (one peer's queue on the main socket is WIRE_HWM). A gateway that
 * reconnects with its routing id (fusion-gateway sets one) takes over its old connection, and the
 * routes of its peers stay good. */
static fu_err gateway_socket(broker_t *b, const char *endpoint, fu_errmsg *em)
{
    fu_err rc = FU_OK;
    b->gw_sock = wire_socket_new(b->ctx, ZMQ_ROUTER, &rc);
    if (!b->gw_sock)
        return fu_errmsg_set(em, rc, "cannot create the gateways' ROUTER socket");
    if ((rc = wire_socket_curve_server(b->gw_sock, b->kp, WIRE_ZAP_GATEWAY_DOMAIN)) != FU_OK)
        return fu_errmsg_set(em, rc, "cannot make the gateways' socket a CURVE server");
    int hwm = BROKER_GATEWAY_HWM, one = 1;
    if (wire_socket_quiet(b->gw_sock) != FU_OK || zmq_setsockopt(b->gw_sock, ZMQ_SNDHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(b->gw_sock, ZMQ_RCVHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(b->gw_sock, ZMQ_ROUTER_HANDOVER, &one, sizeof one) != 0)
        return fu_errmsg_set(em, FU_EIO, "cannot set the gateways' socket options: %s", zmq_strerror(zmq_errno()));
    if (zmq_bind(b->gw_sock, endpoint) != 0)
        return fu_errmsg_set(em, FU_EIO, "cannot bind the gateway endpoint %s: %s", endpoint,
                             zmq_strerror(zmq_errno()));
    char ep[256] = "";
    if (wire_socket_endpoint(b->gw_sock, ep, sizeof ep) != FU_OK)
        snprintf(ep, sizeof ep, "%s", endpoint);
    FU_INFO(LOG, "listening for gateways on %s", ep);
    return FU_OK;
}

broker_t *broker_new(const broker_cfg *cfg, fu_err *err, fu_errmsg *em)
{
    fu_err rc = FU_EINVAL;
    broker_t *b = fu_calloc(1, sizeof *b);
    if (!cfg || !cfg->bind || !cfg->keys_dir || !cfg->db_path) {
        fu_errmsg_set(em, rc, "--bind, --keys and --db are required");
        goto fail;
    }
    b->cfg = *cfg;
    if (!(b->cfg.min_reputation > 0 && b->cfg.min_reputation <= 1))
        b->cfg.min_reputation = BROKER_MIN_REPUTATION;
    if (!(b->cfg.verify >= 0 && b->cfg.verify <= 1))
        b->cfg.verify = 0;
    if (!b->cfg.ready_timeout_s || b->cfg.ready_timeout_s > BROKER_TIMEOUT_MAX_S)
        b->cfg.ready_timeout_s = BROKER_READY_TIMEOUT_S;
    if (b->cfg.step_timeout_s > BROKER_TIMEOUT_MAX_S)
        b->cfg.step_timeout_s = 0;
    if (!b->cfg.pause_grace_s || b->cfg.pause_grace_s > BROKER_TIMEOUT_MAX_S)
        b->cfg.pause_grace_s = BROKER_PAUSE_GRACE_S;
    if (!b->cfg.client_jobs)
        b->cfg.client_jobs = BROKER_CLIENT_JOBS;
    if (!b->cfg.client_mib)
        b->cfg.client_mib = BROKER_CLIENT_MIB;
    if (!b->cfg.client_per_min)
        b->cfg.client_per_min = BROKER_CLIENT_PER_MIN;
    if (!b->cfg.sessions_per_min)
        b->cfg.sessions_per_min = BROKER_SESSIONS_PER_MIN;
    if (!b->cfg.keep_events)
        b->cfg.keep_events = BROKER_KEEP_EVENTS;
    if (!(b->cfg.keep_events_days != 0)) /* 0 or NaN */
        b->cfg.keep_events_days = BROKER_KEEP_EVENTS_DAYS;
    if (!(b->cfg.keep_jobs_days != 0))
        b->cfg.keep_jobs_days = BROKER_KEEP_JOBS_DAYS;
    b->compact = (db_compact_policy){
        .events_max = b->cfg.keep_events > 0 ? b->cfg.keep_events : 0,
        .events_keep_ms = b->cfg.keep_events_days > 0 ? (int64_t)(b->cfg.keep_events_days * 86400e3) : 0,
        .jobs_keep_ms = b->cfg.keep_jobs_days > 0 ? (int64_t)(b->cfg.keep_jobs_days * 86400e3) : 0,
        .forget_ms = b->cfg.forget_days > 0 ? (int64_t)(b->cfg.forget_days * 86400e3) : 0,
        .ckpt_grace_ms = BROKER_CKPT_GRACE_MS,
        .budget_s = BROKER_COMPACT_BUDGET_MS / 1e3};
    b->quota = broker_quota_new(b->cfg.client_per_min, BROKER_PREP_PER_CLIENT);
    b->session_quota = broker_quota_new(b->cfg.sessions_per_min, 0);
    b->auth = broker_auth_new();
    b->losses = broker_losses_new(BROKER_LOSSHIST_POINTS, BROKER_LOSSES_ENDED);
    randombytes_buf(b->verify_key, sizeof b->verify_key); /* sample selection the peers cannot predict */
    if (!b->cfg.heartbeat_ms)
        b->cfg.heartbeat_ms = BROKER_HEARTBEAT_MS;
    if (b->cfg.heartbeat_ms < 50 || b->cfg.heartbeat_ms > 60000) {
        fu_errmsg_set(em, rc, "--heartbeat-ms must be between 50 and 60000");
        goto fail;
    }
    b->dead_after_ms = BROKER_DEAD_FACTOR * b->cfg.heartbeat_ms;
    if (cfg->data_dir) {
        snprintf(b->data_dir, sizeof b->data_dir, "%s", cfg->data_dir);
    } else {
        snprintf(b->data_dir, sizeof b->data_dir, "%s", cfg->db_path);
        char *slash = strrchr(b->data_dir, '/');
        if (slash)
            *slash = '\0';
        else
            snprintf(b->data_dir, sizeof b->data_dir, ".");
    }
    fu_errmsg inner = {{0}}; /* a callee's message, quoted in em */
    if ((rc = fu_mkdir_p(b->data_dir, 0700, &inner)) != FU_OK) {
        fu_errmsg_set(em, rc, "cannot make --data-dir '%s': %s", b->data_dir, fu_errmsg_text(&inner, rc));
        goto fail;
    }
    if ((rc = wire_keypair_load(cfg->keys_dir, &b->kp, em)) != FU_OK)
        goto fail;
    db_options dbo = {.init_empty = cfg->init_store, .full_check = cfg->check_store};
    if ((rc = db_open_opts(cfg->db_path, &dbo, &b->db)) != FU_OK) {
        fu_errmsg_set(em, rc, "cannot open the store '%s': %s (see the log line above)", cfg->db_path,
                      fu_strerror(rc));
        goto fail;
    }
    if ((rc = wire_curve_available(em)) != FU_OK)
        goto fail;
    if ((rc = models_new(b, cfg->model_roots, em)) != FU_OK)
        goto fail;
    db_model_hashes *mh = NULL; /* hashes of earlier runs: a restart does not hash those models again */
    size_t n_mh = 0;
    if (db_model_hashes_all(b->db, &mh, &n_mh) == FU_OK)
        for (size_t i = 0; i < n_mh; i++)
            broker_models_known(b->models, mh[i].dir, mh[i].sig, mh[i].model_id, mh[i].hashes, mh[i].n_tensors);
    db_model_hashes_free(&mh, n_mh);
    if (!(b->worker = broker_worker_new(BROKER_PREP_DEPTH, em))) {
        rc = FU_EIO;
        goto fail;
    }
    /* Its own thread: a submission's preparation takes seconds, a plan milliseconds. */
    if (!(b->planner = broker_worker_new(1 + BROKER_GROWS_MAX, em))) { /* a queued job's search, growth's */
        rc = FU_EIO;
        goto fail;
    }
    b->plan_ws = dag_partition_ws_new();
    b->loop_ws = dag_partition_ws_new();
    /* The worker stores what it prepared, and the writer (peers' checkpoints, re-plans' cuts) writes
     * megabytes at a time: each with a store connection of its own, so the loop does not wait. */
    if ((rc = db_open_sibling(b->db, &b->worker_db)) != FU_OK ||
        (rc = db_open_sibling(b->db, &b->writer_db)) != FU_OK) {
        fu_errmsg_set(em, rc, "cannot open more connections to the store '%s': %s", cfg->db_path, fu_strerror(rc));
        goto fail;
    }
    if (!(b->writer = broker_worker_new(BROKER_WRITER_DEPTH, em))) {
        rc = FU_EIO;
        goto fail;
    }
    b->ctx = zmq_ctx_new();
    if (!b->ctx) {
        rc = FU_EIO;
        fu_errmsg_set(em, rc, "cannot create a ZeroMQ context");
        goto fail;
    }
    /* Two I/O threads: CURVE for relayed frames and checkpoints on two cores. More cost memory (each
     * keeps its own malloc arena: 10,000 peers took about 1 GiB with four, 0.5-0.7 GiB with one or two)
     * and wake-ups; the walks over ZMTP ping timers that once made four worth it are gone with the
     * pings (docs/SCALE.md, fixes 10 and 13). */
    if (zmq_ctx_set(b->ctx, ZMQ_IO_THREADS, BROKER_IO_THREADS) != 0)
        FU_WARN(LOG, "cannot use %d ZeroMQ I/O threads: %s", BROKER_IO_THREADS, zmq_strerror(zmq_errno()));
    wire_zap_cfg zc = {.allow_file = cfg->allow_file,
                       .enrol_token = cfg->enrol_token,
                       .tokens = {{cfg->peer_token, WIRE_ROLE_PEER}, {cfg->client_token, WIRE_ROLE_CLIENT}}};
    b->zap = wire_zap_new(b->ctx, &zc, &rc, em);
    if (!b->zap)
        goto fail;
    b->sock = wire_socket_new(b->ctx, ZMQ_ROUTER, &rc);
    if (!b->sock) {
        fu_errmsg_set(em, rc, "cannot create the ROUTER socket");
        goto fail;
    }
    if ((rc = wire_socket_curve_server(b->sock, b->kp, NULL)) != FU_OK) {
        fu_errmsg_set(em, rc, "cannot make the socket a CURVE server");
        goto fail;
    }
    /* No ZMTP pings on a socket of thousands of connections (wire_socket_quiet): a peer's liveness is
     * its application heartbeat (dead_after_ms), and the kernel closes a connection whose peer
     * vanished. */
    if (wire_socket_quiet(b->sock) != FU_OK)
        FU_WARN(LOG, "the ROUTER socket still pings: expect more CPU per message with many peers");
    broker_conn_open(b); /* before the first connection: a crashed peer's closed connection tells */
    int handover = 1; /* a reconnecting peer with the same routing id replaces the old connection */
    (void)zmq_setsockopt(b->sock, ZMQ_ROUTER_HANDOVER, &handover, sizeof handover);
    if (zmq_bind(b->sock, cfg->bind) != 0) {
        rc = FU_EIO;
        fu_errmsg_set(em, rc, "cannot bind %s: %s (is another broker running on that port?)", cfg->bind,
                      zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (cfg->gateway_bind && (rc = gateway_socket(b, cfg->gateway_bind, em)) != FU_OK)
        goto fail;
    if (cfg->http) {
        if ((rc = broker_http_new(cfg->http, b, &b->http, em)) != FU_OK)
            goto fail;
        FU_INFO(LOG, "serving metrics on http://%.*s:%u/metrics", (int)(strrchr(cfg->http, ':') - cfg->http),
                cfg->http, broker_http_port(b->http));
    }
    b->started_ms = broker_now();
    resume_jobs(b);
    char ep[256] = "";
    if (wire_socket_endpoint(b->sock, ep, sizeof ep) != FU_OK)
        snprintf(ep, sizeof ep, "%s", cfg->bind);
    FU_INFO(LOG, "listening on %s as %s (heartbeat %u ms, dead after %u ms, %u backups per job, %.0f%% of "
            "micro-batches verified unless a job says otherwise, %s)", ep, wire_keypair_public_z85(b->kp),
            b->cfg.heartbeat_ms, b->dead_after_ms, b->cfg.backups, 100.0 * b->cfg.verify, enrolments_open(cfg));
    if (err)
        *err = FU_OK;
    return b;
fail:
    if (err)
        *err = rc == FU_OK ? FU_EINVAL : rc;
    broker_destroy(&b);
    return NULL;
}

void broker_destroy(broker_t **b_p)
{
    if (!b_p || !*b_p)
        return;
    broker_t *b = *b_p;
    broker_http_destroy(&b->http);
    broker_worker_free(&b->worker); /* before the jobs and models its tasks borrow, and its connection */
    db_close(&b->worker_db);
    broker_worker_free(&b->planner); /* before the memory its searches use */
    dag_partition_ws_free(&b->plan_ws);
    dag_partition_ws_free(&b->loop_ws);
    broker_worker_free(&b->writer); /* before its connection */
    db_close(&b->writer_db);
    broker_quota_free(&b->quota);
    broker_quota_free(&b->session_quota);
    broker_auth_free(&b->auth);
    broker_losses_destroy(&b->losses);
    for (size_t i = 0; i < b->n_jobs; i++)
        broker_job_free(&b->jobs[i]);
    free(b->jobs);
    free(b->peers);
    free(b->peer_index);
    free(b->probe_zeros);
    for (int i = 0; i < BROKER_VERIFY_SNAPS; i++)
        free(b->snaps[i].buf);
    broker_models_free(&b->models);
    broker_uploads_free(&b->uploads);
    broker_conn_close(b);
    wire_socket_close(&b->gw_sock);
    wire_socket_close(&b->sock);
    wire_zap_destroy(&b->zap);
    if (b->ctx)
        zmq_ctx_term(b->ctx);
    db_close(&b->db);
    wire_keypair_destroy(&b->kp);
    free(b);
    *b_p = NULL;
}

static uint64_t sweep_period(const broker_t *b)
{
    uint64_t p = b->cfg.heartbeat_ms / 4;
    if (p < BROKER_SWEEP_MIN_MS)
        p = BROKER_SWEEP_MIN_MS;
    if (p > BROKER_SWEEP_MAX_MS)
        p = BROKER_SWEEP_MAX_MS;
    return p;
}

/* One turn of the store's compaction (db_compact, at most BROKER_COMPACT_BUDGET_MS of new work); the
 * milliseconds until the next: a sweep period while work is left, else BROKER_COMPACT_EVERY_MS. */
static uint64_t compact(broker_t *b)
{
    db_compact_stats s;
    if (db_compact(b->db, &b->compact, broker_wall(), &s) != FU_OK)
        return BROKER_COMPACT_EVERY_MS * 10; /* logged by the store; try again later */
    db_compact_stats *t = &b->tot.compacted;
    t->events_archived += s.events_archived;
    t->ckpts_dropped += s.ckpts_dropped;
    t->ckpt_bytes += s.ckpt_bytes;
    t->jobs_purged += s.jobs_purged;
    t->purged_bytes += s.purged_bytes;
    t->pages_vacuumed += s.pages_vacuumed;
    t->commits += s.commits;
    t->seconds += s.seconds;
    if (s.seconds > b->tot.compact_s_max)
        b->tot.compact_s_max = s.seconds;
    b->tot.compact_turns++;
    if (s.jobs_purged || s.events_archived >= 10000 || s.seconds > 0.010)
        FU_INFO(LOG, "store compacted: %lld events archived, %lld checkpoints (%.1f MiB) of ended jobs and the "
                "artifacts of %lld jobs (%.1f MiB) deleted, %lld pages freed, %d commits in %.1f ms",
                (long long)s.events_archived, (long long)s.ckpts_dropped, (double)s.ckpt_bytes / (1 << 20),
                (long long)s.jobs_purged, (double)s.purged_bytes / (1 << 20), (long long)s.pages_vacuumed,
                s.commits, 1e3 * s.seconds);
    return s.more ? sweep_period(b) : BROKER_COMPACT_EVERY_MS;
}

/* The timers that are due; returns the ms until the next closed connection's grace ends
 * (UINT64_MAX: none). */
static uint64_t timers(broker_t *b)
{
    uint64_t conn_wait = broker_conn_sweep(b); /* before the scheduler: a peer it declares dead frees work */
    uint64_t now = broker_now();
    if (now >= b->next_sweep_ms) {
        broker_peers_sweep(b);
        broker_verify_sweep(b);
        broker_challenge_sweep(b);
        broker_deadlines_sweep(b);
        for (size_t i = 0; i < b->n_jobs; i++) {
            broker_job *j = b->jobs[i];
            if (!j->dead && j->phase == BJ_RECOVER_WAIT && now >= j->recover_at_ms)
                broker_recover(b, j);
            broker_job_wake(b, j, true); /* long polls whose wait is over */
            broker_serve_sweep(b, j);
        }
        b->next_sweep_ms = now + sweep_period(b);
    }
    if (now >= b->next_compact_ms)
        b->next_compact_ms = now + compact(b);
    if (b->sched_dirty) {
        b->sched_dirty = false;
        broker_schedule(b);
    }
    broker_jobs_reap(b);
    return conn_wait;
}

/* Where one turn of the loop went (broker_run): a slow turn is counted and said, so that an operator
 * sees what kept heartbeats waiting. */
typedef struct {
    uint64_t woke_ns;                  /* the poll returned (0: no turn yet) */
    uint64_t http_ns;                  /* connection events and the HTTP server */
    uint64_t tasks_ns;                 /* finished tasks of the worker, the planner and the writer */
    uint64_t msgs_ns, slowest_ns;      /* the messages handled, and the slowest of them */
    int n_msgs;
    Fusion__MsgType slowest;
    uint64_t timers_ns;                /* the sweeps and the scheduler, at the top of the next turn */
    uint64_t last_log_ms;              /* the last slow turn said (one a second at most) */
} turn_prof;

static void turn_end(broker_t *b, turn_prof *tp)
{
    if (!tp->woke_ns)
        return;
    uint64_t ns = fu_clock_ns() - tp->woke_ns;
    double turn = (double)ns / 1e9;
    if (turn > b->tot.turn_s_max)
        b->tot.turn_s_max = turn;
    if (turn * 1e3 < BROKER_TURN_SLOW_MS)
        return;
    b->tot.turns_slow++;
    uint64_t now = broker_now();
    if (now - tp->last_log_ms < 1000)
        return;
    tp->last_log_ms = now;
    FU_INFO(LOG, "a slow turn of the loop: %.1f ms (connections and HTTP %.1f ms, finished tasks %.1f ms, %d "
            "messages %.1f ms, the slowest a %s of %.1f ms; sweeps and scheduling %.1f ms)", turn * 1e3,
            (double)tp->http_ns / 1e6, (double)tp->tasks_ns / 1e6, tp->n_msgs, (double)tp->msgs_ns / 1e6,
            tp->n_msgs ? wire_type_name(tp->slowest) : "none", (double)tp->slowest_ns / 1e6,
            (double)tp->timers_ns / 1e6);
}

/* Reads and handles up to BROKER_TURN_MSGS messages of sock (when it polled readable); false when it
 * stopped at that cap with messages left. */
static bool read_socket(broker_t *b, void *sock, bool readable, turn_prof *tp)
{
    int k = 0;
    for (; k < BROKER_TURN_MSGS && readable && !g_stop; k++) {
        broker_conn_events(b); /* a reused descriptor's accept is known before its messages are */
        wire_msg_t *msg = NULL;
        fu_err rc = wire_recv(sock, WIRE_DONTWAIT | WIRE_REPLY_ERRORS, &b->counters, &msg);
        if (rc == FU_EAGAIN)
            break;
        if (rc == FU_ECANCELED) {
            g_stop = 1;
            break;
        }
        if (rc != FU_OK) {
            FU_DEBUG(LOG, "dropped a message: %s (%llu dropped so far)", fu_strerror(rc),
                     (unsigned long long)wire_counters_dropped(&b->counters));
            continue;
        }
        uint64_t t_msg = fu_clock_ns();
        dispatch(b, msg);
        uint64_t took = fu_clock_ns() - t_msg;
        tp->msgs_ns += took;
        tp->n_msgs++;
        if (took > tp->slowest_ns) {
            tp->slowest_ns = took;
            tp->slowest = wire_msg_type(msg);
        }
        wire_msg_destroy(&msg);
    }
    return k < BROKER_TURN_MSGS;
}

fu_err broker_run(broker_t *b)
{
    int pfd[2];
    if (pipe(pfd) != 0)
        return FU_EIO;
    for (int i = 0; i < 2; i++)
        (void)fcntl(pfd[i], F_SETFL, fcntl(pfd[i], F_GETFL) | O_NONBLOCK);
    g_wake_fd = pfd[1];
    if (g_stop) /* a signal before the pipe existed */
        broker_request_stop();
    fu_err result = FU_OK;
    b->next_sweep_ms = b->drained_ms = broker_now();
    turn_prof tp = {0};
    while (!g_stop) {
        uint64_t t_timers = fu_clock_ns();
        uint64_t conn_wait = timers(b);
        tp.timers_ns = fu_clock_ns() - t_timers;
        turn_end(b, &tp);
        uint64_t now = broker_now();
        long timeout = b->next_sweep_ms > now ? (long)(b->next_sweep_ms - now) : 0;
        if (conn_wait < (uint64_t)timeout)
            timeout = (long)conn_wait;
        if (b->http)
            timeout = broker_http_timeout_ms(b->http, timeout);
        zmq_pollitem_t items[8] = {{.socket = b->sock, .events = ZMQ_POLLIN},
                                   {.fd = pfd[0], .events = ZMQ_POLLIN},
                                   {.fd = broker_worker_fd(b->worker), .events = ZMQ_POLLIN},
                                   {.fd = broker_worker_fd(b->planner), .events = ZMQ_POLLIN},
                                   {.fd = broker_worker_fd(b->writer), .events = ZMQ_POLLIN}};
        int n_items = 5, http_item = -1, gw_item = -1;
        if (b->gw_sock) {
            gw_item = n_items;
            items[n_items++] = (zmq_pollitem_t){.socket = b->gw_sock, .events = ZMQ_POLLIN};
        }
        if (b->mon) /* the connections' events (broker_conn.c), read below whatever woke the poll */
            items[n_items++] = (zmq_pollitem_t){.socket = b->mon, .events = ZMQ_POLLIN};
        if (b->http) {
            http_item = n_items;
            items[n_items++] = (zmq_pollitem_t){.fd = broker_http_fd(b->http), .events = ZMQ_POLLIN};
        }
        int n = zmq_poll(items, n_items, timeout);
        tp = (turn_prof){.woke_ns = fu_clock_ns(), .last_log_ms = tp.last_log_ms};
        if (n < 0) {
            if (zmq_errno() == EINTR)
                continue;
            FU_ERROR(LOG, "poll failed: %s", zmq_strerror(zmq_errno()));
            result = FU_EIO;
            break;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            char buf[64];
            while (read(pfd[0], buf, sizeof buf) > 0) {
            }
        }
        broker_conn_events(b);
        if (b->http && (n == 0 || (items[http_item].revents & ZMQ_POLLIN))) /* a request, or its timers are due */
            broker_http_serve(b->http);
        uint64_t t_tasks = fu_clock_ns();
        tp.http_ns = t_tasks - tp.woke_ns;
        /* One finished task of each worker per turn of the loop (a prepared job, a search, a write):
         * heartbeats are served between them (an eventfd stays readable while tasks wait). */
        broker_worker *const workers[] = {b->worker, b->planner, b->writer};
        for (int w = 0; w < 3; w++) {
            broker_task *t = items[2 + w].revents & ZMQ_POLLIN ? broker_worker_take(workers[w]) : NULL;
            if (t)
                t->done(t, b);
        }
        tp.tasks_ns = fu_clock_ns() - t_tasks;
        /* Drain what is queued, but give the timers a turn every so often. A turn that stops at the cap
         * leaves messages unread: silence is judged up to the last turn that read everything
         * (b->drained_ms). */
        bool all_read = read_socket(b, b->sock, items[0].revents & ZMQ_POLLIN, &tp);
        if (gw_item >= 0 && !read_socket(b, b->gw_sock, items[gw_item].revents & ZMQ_POLLIN, &tp))
            all_read = false;
        if (all_read) /* everything sent before now has been read */
            b->drained_ms = broker_now();
    }
    FU_INFO(LOG, "stopping: %llu messages handled, %llu dropped, %llu relayed",
            (unsigned long long)b->counters.received, (unsigned long long)wire_counters_dropped(&b->counters),
            (unsigned long long)b->relayed);
    g_wake_fd = -1;
    close(pfd[0]);
    close(pfd[1]);
    return result;
}
