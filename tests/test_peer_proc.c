/* The real fusion-peer program against a speaker of the broker protocol written here (CURVE server
 * with ZAP, WeightRequest serving, StageAssign/StageStart/StageRelease) on loopback, the test
 * itself playing the downstream stage over a sealed direct link:
 *   - PeerHello carries a sane measured profile; heartbeats follow the welcome and, after one link
 *     probe, carry its bandwidth;
 *   - a stage's activations equal the single-process executor's for the same DAG range, and after
 *     the test sends back the next stage's gradients the peer's checkpoint (PEFT names, AdamW
 *     moments, step metadata) equals the executor's state after the same AdamW step;
 *   - a weight whose bytes do not match its hash is refused (asked 3 times, then an Error, no
 *     StageReady);
 *   - SIGTERM: Leave, then exit 0 (at once without a stage; after StageRelease with one).
 * With `--device cuda:0` (test_peer_gpu, label gpu) the peer runs the stage on the CUDA backend
 * and must match the CPU executor within a tolerance; exit 77 without a device. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <sodium.h>
#include <zmq.h>

#include "cluster.h"
#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_model.h"
#include "dag_serial.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_modelcfg.h"
#include "fu_rng.h"
#include "fu_safetensors.h"
#include "kern_codec.h"
#include "peer_blob.h"
#include "dag_spec.h"
#include "testutil.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_seal.h"
#include "wire_socket.h"
#include "wire_tensor.h"
#include "wire_zap.h"

#define JOB_ID   0x1234abcd5678ef01ull
#define MODEL_ID "m:test"

static const char *g_device = "cpu";
static double g_tol = 1e-5;

typedef struct {
    char *dir;
    char model_dir[4096];
    fu_modelcfg cfg;
    dag_model_dims dims;
    fu_safetensors *st;
    void *ctx;
    wire_zap_t *zap;
    void *router;                 /* the "broker" */
    char endpoint[256];
    wire_keypair_t *bkp, *pkp, *nkp; /* broker, peer, neighbour (this test as stage 1) */
    pid_t pid;
    char log_path[4096];
    uint8_t rid[256];             /* the peer's routing id on the broker socket */
    size_t rid_len;
    Fusion__PeerHello *hello_copy;/* unused: fields checked on arrival */
    char peer_data_ep[256];
    int32_t *tokens;
    size_t n_tokens;
    const char *corrupt;          /* tensor served with a wrong hash */
    int corrupt_requests;
    const char *refuse;           /* tensor refused (Error naming it) when asked for */
    bool late_refusal;            /* before the first WeightRequest's answer, a refusal of another blob */
    int errors;                   /* Error messages from the peer */
    char last_error[512];
    int heartbeats;
    double hb_link_bps;           /* link bandwidth the last heartbeat carried */
    int64_t hb_first_ms;          /* sender's time of the first heartbeat since the reset */
    int64_t hb_last_ms;           /* sender's time of the last heartbeat (0: none since the reset) */
    int64_t hb_max_gap_ms;        /* longest gap between two heartbeats by the sender's clock */
    int hb_paused;                /* heartbeats that said PEER_STATE_PAUSED */
    int hb_state;                 /* the last heartbeat's state */
    uint64_t hb_progress;         /* the last heartbeat's step << 32 | forward_done */
    char hb_pause_reason[256];    /* the last one's reason */
    int probes;                   /* LinkProbeRequests answered */
    void *data;                   /* this test's data ROUTER (stage 1) */
    char data_ep[256];
    wire_seal_t *seal;            /* link to the peer */
    uint8_t data_rid[256];
    size_t data_rid_len;
    wire_tensor_asm_t *asm_;
    void *relay_in, *relay_out;   /* stage 1/0 frames that the "broker" relays (wire_forward) */
    bool no_listen;               /* start the peer with --no-listen */
} env;

/* ---- setup --------------------------------------------------------------------------------- */

static size_t g_hidden = 0; /* a larger model for the next env_start (0: the default) */
static const char *g_priority = "normal"; /* --priority of the next spawn_peer (a test is not a guest) */
static const char *g_extra = NULL;        /* one more fusion-peer option for the next spawn_peer */

static void env_start(env *e, const char *tag)
{
    memset(e, 0, sizeof *e);
    e->dir = tu_dir_new(tag);
    fu_errmsg em = {{0}};
    snprintf(e->model_dir, sizeof e->model_dir, "%s/model", e->dir);
    fu_modelcfg_defaults(&e->cfg); /* 2 layers, hidden 64, 4/2 heads, ffn 128, vocab 256 */
    if (g_hidden) {
        e->cfg.hidden_size = g_hidden;
        e->cfg.intermediate_size = 4 * g_hidden;
        e->cfg.num_attention_heads = 8;
        e->cfg.num_key_value_heads = 8;
        e->cfg.head_dim = g_hidden / 8;
    }
    assert_int_equal(dag_model_init_random(e->model_dir, &e->cfg, 11, 0.08f, &em), FU_OK);
    dag_dims_from_cfg(&e->cfg, &e->dims);
    assert_int_equal(fu_safetensors_open_dir(e->model_dir, &e->st, &em), FU_OK);
    e->n_tokens = 400;
    e->tokens = malloc(e->n_tokens * sizeof *e->tokens);
    fu_rng r;
    fu_rng_seed(&r, 99);
    for (size_t i = 0; i < e->n_tokens; i++)
        e->tokens[i] = (int32_t)(fu_rng_next(&r) % e->cfg.vocab_size);

    char path[4096];
    e->bkp = wire_keypair_generate();
    e->pkp = wire_keypair_generate();
    e->nkp = wire_keypair_generate();
    snprintf(path, sizeof path, "%s/broker", e->dir);
    assert_int_equal(wire_keypair_save(e->bkp, path, false, &em), FU_OK);
    snprintf(path, sizeof path, "%s/peer", e->dir);
    assert_int_equal(wire_keypair_save(e->pkp, path, false, &em), FU_OK);
    snprintf(path, sizeof path, "%s/allow.keys", e->dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", wire_keypair_public_z85(e->pkp));
    fclose(f);

    e->ctx = zmq_ctx_new();
    fu_err err;
    wire_zap_cfg zc = {.allow_file = path};
    e->zap = wire_zap_new(e->ctx, &zc, &err, &em);
    assert_non_null(e->zap);
    e->router = wire_socket_new(e->ctx, ZMQ_ROUTER, &err);
    assert_non_null(e->router);
    assert_int_equal(wire_socket_curve_server(e->router, e->bkp, NULL), FU_OK);
    assert_int_equal(zmq_bind(e->router, "tcp://127.0.0.1:*"), 0);
    assert_int_equal(wire_socket_endpoint(e->router, e->endpoint, sizeof e->endpoint), FU_OK);
    snprintf(e->log_path, sizeof e->log_path, "%s/peer.log", e->dir);
}

static void dump_log(const env *e)
{
    tu_file_show(e->log_path, 40);
}

static void spawn_peer(env *e)
{
    char bkey[4096], keys[4096], cache[4096], prog[4096];
    snprintf(bkey, sizeof bkey, "%s/broker/public.key", e->dir);
    snprintf(keys, sizeof keys, "%s/peer", e->dir);
    snprintf(cache, sizeof cache, "%s/cache", e->dir);
    snprintf(prog, sizeof prog, "%s", tu_bin("fusion-peer"));
    char *argv[32] = {prog, "--broker", e->endpoint, "--broker-key", bkey, "--keys", keys, "--cache", cache,
                      "--threads", "1", "--device", (char *)g_device, "--drain-timeout", "10", "--name", "test-peer",
                      "--log-level", "debug", "--priority", (char *)g_priority};
    int n = 21;
    if (e->no_listen) {
        argv[n++] = "--no-listen";
    } else {
        argv[n++] = "--data-bind";
        argv[n++] = "tcp://127.0.0.1:*";
    }
    argv[n++] = (char *)g_extra; /* may be NULL: the end */
    argv[n] = NULL;
    e->pid = tu_spawn(e->log_path, argv, NULL);
}

/* Waits for the peer to exit; its exit code, or -1 on timeout (then it is killed). */
static int wait_exit(env *e, int timeout_ms)
{
    int code = tu_reap(e->pid, timeout_ms);
    e->pid = 0;
    return code;
}

static void env_stop(env *e)
{
    if (e->pid > 0) {
        kill(e->pid, SIGKILL);
        (void)wait_exit(e, 5000);
    }
    wire_tensor_asm_destroy(&e->asm_);
    wire_seal_destroy(&e->seal);
    wire_socket_close(&e->data);
    wire_socket_close(&e->relay_in);
    wire_socket_close(&e->relay_out);
    wire_socket_close(&e->router);
    wire_zap_destroy(&e->zap);
    zmq_ctx_term(e->ctx);
    wire_keypair_destroy(&e->bkp);
    wire_keypair_destroy(&e->pkp);
    wire_keypair_destroy(&e->nkp);
    fu_safetensors_close(&e->st);
    free(e->tokens);
    tu_dir_remove(e->dir);
    free(e->dir);
}

/* ---- the broker side ----------------------------------------------------------------------- */

static void to_peer(env *e, Fusion__MsgType type, uint64_t job, const ProtobufCMessage *body)
{
    wire_hdr h = {.type = type, .job_id = job};
    assert_int_equal(wire_send(e->router, e->rid, e->rid_len, &h, body), FU_OK);
}

/* An answer to what the peer sent (a heartbeat's): the peer may have left since, as the broker's
 * answers may find it gone (FU_ENOTFOUND), which is no failure. */
static void answer_peer(env *e, Fusion__MsgType type, const ProtobufCMessage *body)
{
    wire_hdr h = {.type = type};
    fu_err rc = wire_send(e->router, e->rid, e->rid_len, &h, body);
    if (rc != FU_OK && rc != FU_ENOTFOUND)
        fail_msg("answering the peer: %s", fu_errname(rc));
}

/* Refuses a WeightRequest of model_id/name as the broker does: Error naming the blob. */
static void refuse_blob(env *e, const char *model_id, const char *name, const char *why)
{
    Fusion__Error er = FUSION__ERROR__INIT;
    er.code = FUSION__ERROR_CODE__ERR_NOT_FOUND;
    er.message = (char *)why;
    er.in_reply_to = FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST;
    er.model_id = (char *)model_id;
    er.tensor_name = (char *)name;
    to_peer(e, FUSION__MSG_TYPE__MSG_ERROR, 0, &er.base);
}

static void serve_weights(env *e, const Fusion__WeightRequest *rq)
{
    if (e->late_refusal) { /* what a verifier promoted while its snapshot fetch was in flight gets */
        e->late_refusal = false;
        refuse_blob(e, "job:00000000000000aa", "vsnap:0:9", "no verification snapshot of stage 0 at step 9");
    }
    if (e->refuse && strcmp(rq->tensor_name, e->refuse) == 0) {
        refuse_blob(e, rq->model_id, rq->tensor_name, "refused by the test");
        return;
    }
    const uint8_t *bytes = NULL;
    size_t total = 0;
    Fusion__Dtype dt = FUSION__DTYPE__DTYPE_U8;
    int64_t shape[8];
    size_t nd = 0;
    if (strcmp(rq->model_id, MODEL_ID) == 0) {
        const fu_st_tensor *t = fu_safetensors_get(e->st, rq->tensor_name);
        if (!t) {
            refuse_blob(e, rq->model_id, rq->tensor_name, "no such tensor");
            return;
        }
        bytes = t->data;
        total = t->nbytes;
        dt = t->dtype == FU_ST_F32 ? FUSION__DTYPE__DTYPE_F32 : t->dtype == FU_ST_F16 ? FUSION__DTYPE__DTYPE_F16
                                                                                   : FUSION__DTYPE__DTYPE_BF16;
        nd = t->ndim;
        for (size_t i = 0; i < nd; i++)
            shape[i] = (int64_t)t->shape[i];
    } else if (strcmp(rq->tensor_name, "tokens") == 0) {
        bytes = (const uint8_t *)e->tokens;
        total = e->n_tokens * sizeof(int32_t);
        dt = FUSION__DTYPE__DTYPE_I32;
        nd = 1;
        shape[0] = (int64_t)e->n_tokens;
    } else {
        fail_msg("unexpected WeightRequest %s/%s", rq->model_id, rq->tensor_name);
    }
    uint8_t hash[32];
    peer_blob_hash(hash, bytes, total);
    if (e->corrupt && strcmp(rq->tensor_name, e->corrupt) == 0) {
        hash[5] ^= 0x40;
        e->corrupt_requests++;
    }
    uint64_t end = rq->length ? rq->offset + rq->length : total;
    if (end > total)
        end = total;
    uint64_t off = rq->offset;
    do {
        size_t n = (size_t)(end - off < (1u << 20) ? end - off : (1u << 20));
        Fusion__WeightChunk c = FUSION__WEIGHT_CHUNK__INIT;
        c.model_id = rq->model_id;
        c.tensor_name = rq->tensor_name;
        c.offset = off;
        c.total = total;
        c.content_hash.data = hash;
        c.content_hash.len = 32;
        c.data.data = (uint8_t *)bytes + off;
        c.data.len = n;
        c.dtype = dt;
        c.shape = shape;
        c.n_shape = nd;
        to_peer(e, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK, 0, &c.base);
        off += n;
    } while (off < end);
}

static void on_data_seal_hello(env *e, wire_msg_t *m)
{
    const Fusion__SealHello *h = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_SEAL_HELLO);
    assert_non_null(h);
    assert_int_equal(h->long_term_key.len, 32);
    assert_memory_equal(h->long_term_key.data, wire_keypair_public(e->pkp), 32);
    assert_int_equal(h->job_id, JOB_ID);
    size_t n;
    const uint8_t *rid = wire_msg_routing_id(m, &n);
    memcpy(e->data_rid, rid, n);
    e->data_rid_len = n;
    bool relayed = wire_msg_hdr(m)->relay_to && *wire_msg_hdr(m)->relay_to;
    wire_seal_eph_t *eph = wire_seal_eph_new();
    Fusion__SealHello r = FUSION__SEAL_HELLO__INIT;
    r.long_term_key.data = (uint8_t *)wire_keypair_public(e->nkp);
    r.long_term_key.len = 32;
    r.ephemeral_key.data = (uint8_t *)wire_seal_eph_public(eph);
    r.ephemeral_key.len = 32;
    r.job_id = JOB_ID;
    r.stage_index = 1;
    r.stage_index = relayed ? 0 : 1;
    /* The peer opened (Envelope.step 0): answer with a reply echoing its opening's sequence. */
    assert_int_equal(wire_msg_hdr(m)->step, 0);
    wire_hdr hd = {.type = FUSION__MSG_TYPE__MSG_SEAL_HELLO, .job_id = JOB_ID, .stage = r.stage_index, .step = 1,
                   .sequence = wire_msg_hdr(m)->sequence};
    if (relayed) {
        hd.relay_to = wire_keypair_public_z85(e->pkp);
        assert_int_equal(wire_send(e->relay_out, NULL, 0, &hd, &r.base), FU_OK);
    } else {
        assert_int_equal(wire_send(e->data, e->data_rid, e->data_rid_len, &hd, &r.base), FU_OK);
    }
    fu_err err;
    wire_seal_destroy(&e->seal);
    e->seal = wire_seal_new(e->nkp, wire_keypair_public(e->pkp), &eph, h->ephemeral_key.data, &err);
    assert_non_null(e->seal);
}

/* Runs the broker (and stage 1's data socket) until a message of `want` arrives from the peer on
 * the broker socket (returned, caller destroys), or a tensor on the data socket when want is
 * MSG_ACTIVATION (returned in *t). Serves WeightRequests, answers SealHellos, counts the rest.
 * NULL on timeout. */
static wire_msg_t *pump(env *e, Fusion__MsgType want, int timeout_ms, wire_tensor *t)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        zmq_pollitem_t it[3] = {{e->router, 0, ZMQ_POLLIN, 0}, {e->relay_in, 0, ZMQ_POLLIN, 0},
                                {e->data, 0, ZMQ_POLLIN, 0}};
        int r = zmq_poll(it, e->data ? 3 : e->relay_in ? 2 : 1, 50);
        if (r <= 0)
            continue;
        if (e->relay_in && (it[1].revents & ZMQ_POLLIN)) {
            /* What stage 0 (this test) sends with relay_to goes to the peer as the broker relays it. */
            wire_msg_t *m = NULL;
            if (wire_recv(e->relay_in, WIRE_DONTWAIT, NULL, &m) == FU_OK) {
                assert_string_equal(wire_msg_hdr(m)->relay_to, wire_keypair_public_z85(e->pkp));
                assert_int_equal(wire_forward(e->router, e->rid, e->rid_len, m, wire_keypair_public_z85(e->nkp)),
                                 FU_OK);
                wire_msg_destroy(&m);
            }
        }
        if (it[0].revents & ZMQ_POLLIN) {
            wire_msg_t *m = NULL;
            if (wire_recv(e->router, WIRE_DONTWAIT, NULL, &m) == FU_OK) {
                Fusion__MsgType ty = wire_msg_type(m);
                const char *rt = wire_msg_hdr(m)->relay_to;
                if (rt && *rt) {
                    /* Relayed data from the peer to stage 0 (this test): the broker would forward it. */
                    assert_string_equal(rt, wire_keypair_public_z85(e->nkp));
                    if (ty == FUSION__MSG_TYPE__MSG_SEAL_HELLO) {
                        on_data_seal_hello(e, m);
                    } else if (ty == FUSION__MSG_TYPE__MSG_GRADIENT && e->seal) {
                        bool done = false;
                        assert_int_equal(wire_tensor_asm_feed(e->asm_, e->seal, m, &done), FU_OK);
                        if (done && want == FUSION__MSG_TYPE__MSG_GRADIENT) {
                            assert_int_equal(wire_tensor_asm_take(e->asm_, t), FU_OK);
                            wire_msg_destroy(&m);
                            return (wire_msg_t *)1;
                        }
                    }
                    wire_msg_destroy(&m);
                    continue;
                }
                if (ty == FUSION__MSG_TYPE__MSG_PEER_HELLO && e->rid_len == 0) {
                    size_t n;
                    const uint8_t *rid = wire_msg_routing_id(m, &n);
                    memcpy(e->rid, rid, n);
                    e->rid_len = n;
                }
                if (ty == want)
                    return m;
                if (ty == FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST) {
                    serve_weights(e, wire_msg_body_as(m, ty));
                } else if (ty == FUSION__MSG_TYPE__MSG_HEARTBEAT) {
                    const Fusion__Heartbeat *hb = wire_msg_body_as(m, ty);
                    e->heartbeats++;
                    e->hb_link_bps = hb->link_bandwidth_bps;
                    if (e->hb_last_ms && hb->time_ms - e->hb_last_ms > e->hb_max_gap_ms)
                        e->hb_max_gap_ms = hb->time_ms - e->hb_last_ms;
                    if (!e->hb_last_ms)
                        e->hb_first_ms = hb->time_ms;
                    e->hb_last_ms = hb->time_ms;
                    e->hb_state = hb->state;
                    e->hb_progress = hb->step << 32 | hb->forward_done;
                    if (hb->state == FUSION__PEER_STATE__PEER_STATE_PAUSED) {
                        e->hb_paused++;
                        snprintf(e->hb_pause_reason, sizeof e->hb_pause_reason, "%s",
                                 hb->pause_reason ? hb->pause_reason : "");
                    }
                    Fusion__Heartbeat reply = FUSION__HEARTBEAT__INIT; /* what the broker does: its answer */
                    reply.time_ms = fu_wallclock_ms();                  /* is the peer's sign of life */
                    answer_peer(e, FUSION__MSG_TYPE__MSG_HEARTBEAT, &reply.base);
                } else if (ty == FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ) { /* what the broker does */
                    const Fusion__LinkProbeRequest *rq = wire_msg_body_as(m, ty);
                    size_t len = rq->bytes < (4u << 20) ? rq->bytes : (4u << 20);
                    uint8_t *zeros = calloc(1, len ? len : 1);
                    Fusion__LinkProbe lp = FUSION__LINK_PROBE__INIT;
                    lp.data.len = len;
                    lp.data.data = zeros;
                    to_peer(e, FUSION__MSG_TYPE__MSG_LINK_PROBE, 0, &lp.base);
                    free(zeros);
                    e->probes++;
                }
                else if (ty == FUSION__MSG_TYPE__MSG_ERROR) {
                    const Fusion__Error *er = wire_msg_body_as(m, ty);
                    e->errors++;
                    snprintf(e->last_error, sizeof e->last_error, "%s", er->message);
                    printf("peer reported an Error: %s\n", er->message);
                }
                wire_msg_destroy(&m);
            }
        }
        if (e->data && (it[2].revents & ZMQ_POLLIN)) {
            wire_msg_t *m = NULL;
            if (wire_recv(e->data, WIRE_DONTWAIT, NULL, &m) == FU_OK) {
                Fusion__MsgType ty = wire_msg_type(m);
                if (ty == FUSION__MSG_TYPE__MSG_SEAL_HELLO) {
                    on_data_seal_hello(e, m);
                } else if (ty == FUSION__MSG_TYPE__MSG_ACTIVATION && e->seal) {
                    bool done = false;
                    assert_int_equal(wire_tensor_asm_feed(e->asm_, e->seal, m, &done), FU_OK);
                    if (done && want == FUSION__MSG_TYPE__MSG_ACTIVATION) {
                        assert_int_equal(wire_tensor_asm_take(e->asm_, t), FU_OK);
                        wire_msg_destroy(&m);
                        return (wire_msg_t *)1; /* a tensor, in *t */
                    }
                }
                wire_msg_destroy(&m);
            }
        }
    }
    return NULL;
}

/* PeerHello with a sane profile, then the welcome. */
static void handshake(env *e)
{
    wire_msg_t *m = pump(e, FUSION__MSG_TYPE__MSG_PEER_HELLO, 30000, NULL);
    if (!m)
        dump_log(e);
    assert_non_null(m);
    assert_string_equal(wire_msg_user_id(m), wire_keypair_public_z85(e->pkp));
    const Fusion__PeerHello *h = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_HELLO);
    assert_string_equal(h->name, "test-peer");
    assert_non_null(h->profile);
    assert_true(h->profile->n_speeds >= 1);
    assert_int_equal(h->profile->speeds[0]->dtype, FUSION__DTYPE__DTYPE_F32);
    assert_true(h->profile->speeds[0]->gemm_gflops > 0.5);
    assert_true(h->profile->free_memory_bytes > (64u << 20));
    assert_true(h->profile->link_latency_ms >= 0 && h->profile->link_latency_ms < 1000);
    printf("PeerHello: %s, %s, %.1f GFLOP/s f32, %.2f GiB, RTT %.3f ms, data %s\n", h->name,
           h->profile->device_name, h->profile->speeds[0]->gemm_gflops,
           (double)h->profile->free_memory_bytes / (1 << 30), h->profile->link_latency_ms, h->data_endpoint);
    if (e->no_listen) {
        assert_true(h->needs_relay);
        assert_string_equal(h->data_endpoint, "");
    } else {
        assert_false(h->needs_relay);
        assert_true(strncmp(h->data_endpoint, "tcp://127.0.0.1:", 16) == 0);
    }
    snprintf(e->peer_data_ep, sizeof e->peer_data_ep, "%s", h->data_endpoint);
    wire_msg_destroy(&m);
    Fusion__PeerWelcome w = FUSION__PEER_WELCOME__INIT;
    w.peer_id = (char *)wire_keypair_public_z85(e->pkp);
    w.heartbeat_ms = 200;
    w.dead_after_ms = 5000;
    to_peer(e, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 0, &w.base);
}

/* A fresh environment and the real fusion-peer connected to it, through the handshake. */
static void peer_up(env *e, const char *tag)
{
    env_start(e, tag);
    spawn_peer(e);
    handshake(e);
}

/* SIGTERM to the peer: its Leave arrives within 5 s. */
static void expect_leave(env *e)
{
    assert_int_equal(kill(e->pid, SIGTERM), 0);
    wire_msg_t *m = pump(e, FUSION__MSG_TYPE__MSG_LEAVE, 5000, NULL);
    assert_non_null(m);
    wire_msg_destroy(&m);
}

/* ---- tests --------------------------------------------------------------------------------- */

static void test_peer_graceful_leave_without_stage(void **state)
{
    (void)state;
    env e;
    peer_up(&e, "peer-leave");
    /* Heartbeats come on the welcome's interval, from the I/O thread. After the welcome the peer
     * times a link probe once; its heartbeats then carry the bandwidth. */
    (void)pump(&e, FUSION__MSG_TYPE__MSG_UNSPECIFIED, 1000, NULL);
    assert_true(e.heartbeats >= 3);
    assert_int_equal(e.probes, 1);
    printf("link from the test's broker: %.1f MB/s\n", e.hb_link_bps / 1e6);
    assert_true(e.hb_link_bps > 1e6);
    expect_leave(&e);
    int code = wait_exit(&e, 5000);
    if (code != 0)
        dump_log(&e);
    assert_int_equal(code, 0);
    env_stop(&e);
}

static const char *SPEC = "{\"model\": \"tiny\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, "
                          "\"steps\": 1, \"batch\": 4, \"seq_len\": 8, \"micro_batches\": 2, \"seed\": 3, "
                          "\"checkpoint_every\": 1}";

static dag_graph_t *make_graph(const env *e)
{
    dag_build_opts o = {.method = DAG_ADAPTER_LORA_FA, .rank = 4, .alpha = 8.0f, .head = DAG_HEAD_LOSS, .seq_len = 8};
    dag_graph_t *g = NULL;
    assert_int_equal(dag_build_llama(&e->dims, &o, &g), FU_OK);
    return g;
}

static size_t layer_start(const dag_graph_t *g, int layer)
{
    for (size_t i = 0; i < dag_graph_size(g); i++)
        if (dag_graph_node(g, i)->layer == layer)
            return i;
    fail_msg("no layer %d", layer);
    return 0;
}

/* Sends StageAssign: nodes [begin, end) of g as stage `stage` of two; this test is the other stage,
 * downstream of stage 0 at a data socket opened here, or upstream of stage 1 through the broker (the
 * relay). Received tensors are assembled within asm_budget bytes. */
static void assign_stage(env *e, const dag_graph_t *g, uint32_t stage, size_t begin, size_t end, const char *spec,
                         size_t asm_budget)
{
    uint8_t *dag = NULL;
    size_t dag_len = 0;
    assert_int_equal(dag_graph_encode(g, &dag, &dag_len), FU_OK);
    e->asm_ = wire_tensor_asm_new(asm_budget);
    Fusion__Neighbour nb = FUSION__NEIGHBOUR__INIT, *nbs[1] = {&nb};
    nb.public_key.data = (uint8_t *)wire_keypair_public(e->nkp);
    nb.public_key.len = 32;
    nb.stage_index = 1 - stage;
    Fusion__StageAssign a = FUSION__STAGE_ASSIGN__INIT;
    if (stage == 0) {
        fu_err err;
        e->data = wire_socket_new(e->ctx, ZMQ_ROUTER, &err);
        assert_non_null(e->data);
        assert_int_equal(zmq_bind(e->data, "tcp://127.0.0.1:*"), 0);
        assert_int_equal(wire_socket_endpoint(e->data, e->data_ep, sizeof e->data_ep), FU_OK);
        nb.role = FUSION__LINK_ROLE__LINK_ROLE_DOWNSTREAM;
        nb.data_endpoint = e->data_ep;
    } else {
        nb.role = FUSION__LINK_ROLE__LINK_ROLE_UPSTREAM;
        nb.data_endpoint = (char *)"";
        nb.relay = true;
        a.relay = true;
    }
    a.job_id = JOB_ID;
    a.stage_index = stage;
    a.stage_count = 2;
    a.node_begin = (uint32_t)begin;
    a.node_end = (uint32_t)end;
    a.n_neighbours = 1;
    a.neighbours = nbs;
    a.dag.data = dag;
    a.dag.len = dag_len;
    a.model_id = (char *)MODEL_ID;
    a.spec_json = (char *)spec;
    to_peer(e, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, JOB_ID, &a.base);
    free(dag);
}

/* peer_up, then stage 0 of the SPEC job (layer 0 of the test's graph, returned) assigned to the peer. */
static dag_graph_t *peer_with_stage0(env *e, const char *tag)
{
    peer_up(e, tag);
    dag_graph_t *g = make_graph(e);
    assign_stage(e, g, 0, 0, layer_start(g, 1), SPEC, (size_t)1 << 28);
    return g;
}

/* Sends StageRelease of the job (reason may be NULL: none). */
static void release_stage(env *e, const char *reason)
{
    Fusion__StageRelease rel = FUSION__STAGE_RELEASE__INIT;
    rel.job_id = JOB_ID;
    if (reason)
        rel.reason = (char *)reason;
    to_peer(e, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, JOB_ID, &rel.base);
}

static dag_exec_t *ref_exec(const env *e, const dag_graph_t *g, size_t first, size_t last)
{
    dag_exec_opts o = {.be = NULL, .first = first, .last = last, .max_tokens = 2 * 8, .n_slots = 2,
                       .training = true, .seed = 3};
    dag_exec_t *x = NULL;
    fu_errmsg em = {{0}};
    fu_err rc = dag_exec_new(g, &o, &x, &em);
    if (rc == FU_OK)
        rc = dag_exec_load_weights(x, e->st, &em);
    if (rc != FU_OK)
        fail_msg("reference executor: %s", fu_errmsg_text(&em, rc));
    return x;
}

static double max_diff(const float *a, const float *b, size_t n, double *scale)
{
    double d = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        double v = fabs((double)a[i] - (double)b[i]);
        if (v > d || isnan(v))
            d = isnan(v) ? INFINITY : v;
        if (fabs((double)b[i]) > s)
            s = fabs((double)b[i]);
    }
    if (scale)
        *scale = s;
    return d;
}

static void test_peer_stage_matches_executor(void **state)
{
    (void)state;
    env e;
    dag_graph_t *g = peer_with_stage0(&e, "peer-stage");
    size_t cut = layer_start(g, 1), n = dag_graph_size(g);

    wire_msg_t *m = pump(&e, FUSION__MSG_TYPE__MSG_STAGE_READY, 30000, NULL);
    if (!m)
        dump_log(&e);
    assert_non_null(m);
    assert_non_null(e.seal); /* StageReady only after the sealed link is up */
    const Fusion__StageReady *rd = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_READY);
    assert_int_equal(rd->job_id, JOB_ID);
    assert_int_equal(rd->stage_index, 0);
    wire_msg_destroy(&m);
    Fusion__StageStart ss = FUSION__STAGE_START__INIT;
    ss.job_id = JOB_ID;
    ss.step = 0;
    to_peer(&e, FUSION__MSG_TYPE__MSG_STAGE_START, JOB_ID, &ss.base);

    /* The references: stage 0 and stage 1 in this process, on the CPU. */
    dag_exec_t *x0 = ref_exec(&e, g, 0, cut), *x1 = ref_exec(&e, g, cut, n);
    uint32_t cut_ids[4];
    assert_int_equal(dag_exec_cut_outputs(x0, cut_ids, 4), 1);
    uint32_t cn = cut_ids[0];
    size_t width = (size_t)dag_graph_width(g, cn), rows = 2 * 8;
    dag_spec sp;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_parse(SPEC, strlen(SPEC), DAG_JOB_ANY, &sp, &em), FU_OK);
    dag_data_order order = dag_spec_data_order(&sp);
    int32_t tok[16], tgt[16];
    for (uint32_t mb = 0; mb < 2; mb++) {
        wire_tensor t = {0};
        wire_msg_t *got = pump(&e, FUSION__MSG_TYPE__MSG_ACTIVATION, 20000, &t);
        if (!got)
            dump_log(&e);
        assert_non_null(got);
        assert_int_equal(t.meta.job_id, JOB_ID);
        assert_int_equal(t.meta.step, 0);
        assert_int_equal(t.meta.micro_batch, mb);
        assert_int_equal(t.meta.ndim, 2);
        assert_int_equal(t.meta.shape[0], (int64_t)rows);
        assert_int_equal(t.meta.shape[1], (int64_t)width);
        assert_int_equal(t.len, rows * width * sizeof(float));
        /* Stage 0 on this side. */
        assert_int_equal(dag_data_rows(&order, e.tokens, e.n_tokens, 0, mb, tok, tgt), FU_OK);
        assert_int_equal(dag_exec_set_tokens(x0, mb, tok, NULL, 2, 8), FU_OK);
        assert_int_equal(dag_exec_forward(x0, mb), FU_OK);
        const float *ref;
        size_t nf;
        assert_int_equal(dag_exec_get_output(x0, mb, cn, &ref, &nf), FU_OK);
        assert_int_equal(nf, rows * width);
        double scale, d = max_diff((const float *)t.data, ref, nf, &scale);
        printf("micro-batch %u: activation max |peer - executor| = %.3g (max |x| %.3g)\n", mb, d, scale);
        assert_true(d <= g_tol * (1.0 + scale));
        /* Stage 1 here: loss, backward, the gradient back to the peer. */
        assert_int_equal(dag_exec_set_tokens(x1, mb, NULL, tgt, 2, 8), FU_OK);
        assert_int_equal(dag_exec_set_input(x1, mb, cn, (const float *)t.data, nf), FU_OK);
        assert_int_equal(dag_exec_forward(x1, mb), FU_OK);
        assert_int_equal(dag_exec_backward(x1, mb, 0.5f), FU_OK);
        const float *gr;
        size_t ng;
        assert_int_equal(dag_exec_get_input_grad(x1, cn, &gr, &ng), FU_OK);
        assert_int_equal(ng, nf);
        assert_int_equal(dag_exec_set_output_grad(x0, mb, cn, gr, ng), FU_OK);
        assert_int_equal(dag_exec_backward(x0, mb, 0.5f), FU_OK);
        wire_tensor_meta gm = {.type = FUSION__MSG_TYPE__MSG_GRADIENT, .job_id = JOB_ID, .step = 0,
                               .micro_batch = mb, .stage = 1, .dtype = FUSION__DTYPE__DTYPE_F32, .ndim = 2,
                               .shape = {(int64_t)rows, (int64_t)width}};
        assert_int_equal(wire_tensor_send(e.data, e.data_rid, e.data_rid_len, e.seal, &gm, gr, ng * sizeof(float), 0,
                                          NULL),
                         FU_OK);
        wire_tensor_clear(&t);
    }
    kern_adamw_params ap = {.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0};
    assert_int_equal(dag_exec_step(x0, &ap), FU_OK);

    /* The checkpoint after step 0 (steps = 1): adapters and AdamW moments under PEFT names. */
    uint8_t *blob = NULL;
    uint64_t total = 0, have = 0;
    uint8_t hash[32];
    while (total == 0 || have < total) {
        m = pump(&e, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, 20000, NULL);
        if (!m)
            dump_log(&e);
        assert_non_null(m);
        const Fusion__CheckpointPut *cp = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT);
        assert_int_equal(cp->job_id, JOB_ID);
        assert_int_equal(cp->stage_index, 0);
        assert_int_equal(cp->step, 1);
        if (!blob) {
            total = cp->total;
            blob = malloc(total);
            memcpy(hash, cp->content_hash.data, 32);
        }
        assert_int_equal(cp->offset, have);
        memcpy(blob + have, cp->data.data, cp->data.len);
        have += cp->data.len;
        wire_msg_destroy(&m);
    }
    uint8_t h2[32];
    peer_blob_hash(h2, blob, total);
    assert_memory_equal(h2, hash, 32);
    fu_safetensors *ck = NULL;
    assert_int_equal(fu_safetensors_parse_header(blob, total, "ckpt", &ck, &em), FU_OK);
    assert_string_equal(fu_safetensors_metadata(ck, "step"), "1");
    assert_string_equal(fu_safetensors_metadata(ck, "adam_t"), "1");
    char ref_path[4096];
    snprintf(ref_path, sizeof ref_path, "%s/ref.safetensors", e.dir);
    assert_int_equal(dag_exec_save_state(x0, ref_path, &em), FU_OK);
    fu_safetensors *rs = NULL;
    assert_int_equal(fu_safetensors_open_file(ref_path, &rs, &em), FU_OK);
    assert_int_equal(fu_safetensors_count(rs), fu_safetensors_count(ck));
    size_t n_b = 0;
    double worst = 0;
    for (size_t i = 0; i < fu_safetensors_count(rs); i++) {
        const fu_st_tensor *rt = fu_safetensors_at(rs, i);
        const char *name = rt->name; /* one naming scheme: the executor's is the checkpoint's */
        const fu_st_tensor *ct = fu_safetensors_get(ck, name);
        if (!ct)
            fail_msg("checkpoint lacks %s", name);
        assert_int_equal(ct->nbytes, rt->nbytes);
        assert_true(strncmp(name, "base_model.model.model.layers.0.", 32) == 0);
        float *a = malloc(rt->nbytes), *b = malloc(rt->nbytes);
        assert_int_equal(fu_st_tensor_to_f32(ct, a, ct->nelem, &em), FU_OK);
        assert_int_equal(fu_st_tensor_to_f32(rt, b, rt->nelem, &em), FU_OK);
        double scale, d = max_diff(a, b, rt->nelem, &scale);
        if (d > worst)
            worst = d;
        assert_true(d <= g_tol * (1.0 + scale));
        if (strstr(name, "lora_B.weight") && !strstr(name, "adam"))
            n_b++;
        free(a);
        free(b);
    }
    printf("checkpoint: %zu tensors (%zu trained B), max |peer - executor| = %.3g\n", fu_safetensors_count(rs), n_b,
           worst);
    assert_int_equal(n_b, 7); /* the seven linears of layer 0 */
    fu_safetensors_close(&rs);
    fu_safetensors_close(&ck);
    free(blob);
    Fusion__CheckpointAck ack = FUSION__CHECKPOINT_ACK__INIT;
    ack.job_id = JOB_ID;
    ack.step = 1;
    to_peer(&e, FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK, JOB_ID, &ack.base);

    /* Leaving with a stage: Leave, then it waits for StageRelease, then exits 0. */
    expect_leave(&e);
    int st;
    fu_sleep_ms(300);
    assert_int_equal(waitpid(e.pid, &st, WNOHANG), 0); /* still draining */
    release_stage(&e, "job done");
    int code = wait_exit(&e, 5000);
    if (code != 0)
        dump_log(&e);
    assert_int_equal(code, 0);
    assert_int_equal(e.errors, 0);

    dag_spec_clear(&sp);
    dag_exec_destroy(&x0);
    dag_exec_destroy(&x1);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* Runs the broker side until the peer reports an Error (20 s at most): exactly one, and no
 * StageReady, since its stage cannot load for want of `what`. */
static void await_load_error(env *e, const char *what)
{
    for (uint64_t end = fu_clock_ms() + 20000; e->errors == 0 && fu_clock_ms() < end;) {
        wire_msg_t *m = pump(e, FUSION__MSG_TYPE__MSG_STAGE_READY, 200, NULL);
        if (m) {
            dump_log(e);
            fail_msg("StageReady despite %s", what);
        }
    }
    if (e->errors != 1)
        dump_log(e);
    assert_int_equal(e->errors, 1);
}

static void test_peer_refuses_weights_with_wrong_hash(void **state)
{
    (void)state;
    env e;
    dag_graph_t *g = peer_with_stage0(&e, "peer-hash");
    e.corrupt = "model.layers.0.self_attn.q_proj.weight"; /* served with a wrong hash when asked for */
    /* No StageReady: the peer asks for the tensor 3 times, then reports an Error. */
    await_load_error(&e, "a weight with a wrong hash");
    assert_non_null(strstr(e.last_error, "q_proj"));
    assert_true(e.corrupt_requests >= 3);
    printf("wrong-hash tensor requested %d times, then: %s\n", e.corrupt_requests, e.last_error);
    /* The refused bytes were not cached. */
    char *out = NULL;
    uint8_t hash[32];
    const fu_st_tensor *t = fu_safetensors_get(e.st, e.corrupt);
    peer_blob_hash(hash, t->data, t->nbytes);
    hash[5] ^= 0x40;
    char hex[65];
    fu_hex_encode(hex, hash, 32);
    assert_int_equal(tu_sh(&out, "test ! -e '%s/cache/%s'", e.dir, hex), 0);
    free(out);
    /* The peer is still alive and leaves cleanly. */
    assert_int_equal(kill(e.pid, SIGTERM), 0);
    assert_int_equal(wait_exit(&e, 5000), 0);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* A refusal that names another blob than the one being fetched answers an earlier fetch (a
 * verifier's snapshot, asked for before it was promoted to the stage): the peer ignores it and
 * loads its stage. */
static void test_peer_ignores_late_refusal(void **state)
{
    (void)state;
    env e;
    dag_graph_t *g = peer_with_stage0(&e, "peer-late-refusal");
    e.late_refusal = true;
    wire_msg_t *m = pump(&e, FUSION__MSG_TYPE__MSG_STAGE_READY, 30000, NULL);
    if (!m || e.errors)
        dump_log(&e);
    assert_non_null(m);
    assert_false(e.late_refusal); /* it was sent */
    assert_int_equal(e.errors, 0);
    wire_msg_destroy(&m);
    expect_leave(&e); /* with a stage: it waits for StageRelease */
    release_stage(&e, "the test is over");
    assert_int_equal(wait_exit(&e, 5000), 0);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* The broker's refusal of the blob the peer fetches ends the stage with an Error naming it. */
static void test_peer_refused_blob_ends_stage(void **state)
{
    (void)state;
    env e;
    dag_graph_t *g = peer_with_stage0(&e, "peer-refused");
    e.refuse = "model.layers.0.self_attn.q_proj.weight";
    await_load_error(&e, "a tensor the broker refused");
    assert_non_null(strstr(e.last_error, "cannot load the stage"));
    assert_non_null(strstr(e.last_error, "q_proj"));
    printf("the peer on the refusal of its own fetch: %s\n", e.last_error);
    expect_leave(&e);
    assert_int_equal(wait_exit(&e, 5000), 0);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* Starts a peer that cannot listen (tag: its scratch directory) as the last stage, layer 1 on, of a
 * job with spec, its data frames relayed through this test's broker; waits for StageReady and sends
 * StageStart. Returns the graph, the stage's first node in *cut. */
static dag_graph_t *relayed_last_stage(env *e, const char *tag, const char *spec, size_t *cut)
{
    env_start(e, tag);
    e->no_listen = true;
    spawn_peer(e);
    handshake(e);
    fu_err err;
    e->relay_in = wire_socket_new(e->ctx, ZMQ_ROUTER, &err);
    e->relay_out = wire_socket_new(e->ctx, ZMQ_DEALER, &err);
    assert_int_equal(zmq_bind(e->relay_in, "inproc://test-relay"), 0);
    assert_int_equal(zmq_connect(e->relay_out, "inproc://test-relay"), 0);
    dag_graph_t *g = make_graph(e);
    *cut = layer_start(g, 1);
    assign_stage(e, g, 1, *cut, dag_graph_size(g), spec, (size_t)1 << 28);
    wire_msg_t *m = pump(e, FUSION__MSG_TYPE__MSG_STAGE_READY, 30000, NULL);
    if (!m)
        dump_log(e);
    assert_non_null(m);
    assert_non_null(e->seal);
    wire_msg_destroy(&m);
    Fusion__StageStart ss = FUSION__STAGE_START__INIT;
    ss.job_id = JOB_ID;
    to_peer(e, FUSION__MSG_TYPE__MSG_STAGE_START, JOB_ID, &ss.base);
    return g;
}

/* The last stage on a peer that cannot listen: every data frame (SealHello, activations down,
 * gradients up) goes through the broker with Envelope.relay_to, and the broker forwards it with
 * Envelope.sender (wire_forward). The peer's gradients and StepDone loss equal the executor's. */
static void test_peer_last_stage_relayed_matches_executor(void **state)
{
    (void)state;
    env e;
    size_t cut;
    dag_graph_t *g = relayed_last_stage(&e, "peer-relay", SPEC, &cut);
    size_t n = dag_graph_size(g);
    wire_msg_t *m = NULL;

    dag_exec_t *x0 = ref_exec(&e, g, 0, cut), *x1 = ref_exec(&e, g, cut, n);
    uint32_t cn;
    assert_int_equal(dag_exec_cut_outputs(x0, &cn, 1), 1);
    size_t width = (size_t)dag_graph_width(g, cn), rows = 16;
    dag_spec sp;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_parse(SPEC, strlen(SPEC), DAG_JOB_ANY, &sp, &em), FU_OK);
    dag_data_order order = dag_spec_data_order(&sp);
    int32_t tok[16], tgt[16];
    double loss_sum = 0;
    for (uint32_t mb = 0; mb < 2; mb++) {
        assert_int_equal(dag_data_rows(&order, e.tokens, e.n_tokens, 0, mb, tok, tgt), FU_OK);
        assert_int_equal(dag_exec_set_tokens(x0, mb, tok, NULL, 2, 8), FU_OK);
        assert_int_equal(dag_exec_forward(x0, mb), FU_OK);
        const float *act;
        size_t nf;
        assert_int_equal(dag_exec_get_output(x0, mb, cn, &act, &nf), FU_OK);
        float *copy = malloc(nf * sizeof *copy);
        memcpy(copy, act, nf * sizeof *copy);
        wire_tensor_meta am = {.type = FUSION__MSG_TYPE__MSG_ACTIVATION, .job_id = JOB_ID, .step = 0,
                               .micro_batch = mb, .stage = 0, .dtype = FUSION__DTYPE__DTYPE_F32, .ndim = 2,
                               .shape = {(int64_t)rows, (int64_t)width},
                               .relay_to = wire_keypair_public_z85(e.pkp)};
        assert_int_equal(wire_tensor_send(e.relay_out, NULL, 0, e.seal, &am, copy, nf * sizeof(float), 0, NULL),
                         FU_OK);
        /* The same micro-batch through stage 1 here. */
        assert_int_equal(dag_exec_set_tokens(x1, mb, NULL, tgt, 2, 8), FU_OK);
        assert_int_equal(dag_exec_set_input(x1, mb, cn, copy, nf), FU_OK);
        assert_int_equal(dag_exec_forward(x1, mb), FU_OK);
        float loss;
        assert_int_equal(dag_exec_loss(x1, mb, &loss, NULL), FU_OK);
        loss_sum += loss;
        assert_int_equal(dag_exec_backward(x1, mb, 0.5f), FU_OK);
        const float *ref;
        size_t ng;
        assert_int_equal(dag_exec_get_input_grad(x1, cn, &ref, &ng), FU_OK);
        wire_tensor t = {0};
        if (!pump(&e, FUSION__MSG_TYPE__MSG_GRADIENT, 20000, &t))
            dump_log(&e);
        assert_int_equal(t.meta.step, 0);
        assert_int_equal(t.meta.micro_batch, mb);
        assert_int_equal(t.len, ng * sizeof(float));
        double scale, d = max_diff((const float *)t.data, ref, ng, &scale);
        printf("micro-batch %u (relayed): gradient max |peer - executor| = %.3g (max |g| %.3g)\n", mb, d, scale);
        assert_true(d <= g_tol * (1.0 + scale));
        wire_tensor_clear(&t);
        free(copy);
    }
    m = pump(&e, FUSION__MSG_TYPE__MSG_STEP_DONE, 20000, NULL);
    if (!m)
        dump_log(&e);
    assert_non_null(m);
    const Fusion__StepDone *sd = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STEP_DONE);
    assert_int_equal(sd->job_id, JOB_ID);
    assert_int_equal(sd->step, 0);
    assert_int_equal(sd->tokens, 4 * 8);
    printf("StepDone: loss %.6f (executor %.6f)\n", sd->loss, loss_sum / 2);
    assert_true(fabs(sd->loss - loss_sum / 2) <= 1e-5 * (1 + fabs(sd->loss)) * (g_tol / 1e-5));
    wire_msg_destroy(&m);
    m = pump(&e, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, 20000, NULL);
    assert_non_null(m);
    const Fusion__CheckpointPut *cp = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT);
    assert_int_equal(cp->stage_index, 1);
    assert_int_equal(cp->step, 1);
    wire_msg_destroy(&m);

    release_stage(&e, NULL);
    fu_sleep_ms(200);
    expect_leave(&e);
    assert_int_equal(wait_exit(&e, 5000), 0);
    assert_int_equal(e.errors, 0);
    dag_spec_clear(&sp);
    dag_exec_destroy(&x0);
    dag_exec_destroy(&x1);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* Sends stage 0's activation of micro-batch 0 (rows x width bytes of len in dtype dt) to the relayed
 * last stage. */
static void send_activation(env *e, Fusion__Dtype dt, int64_t dim1, const void *data, size_t len)
{
    wire_tensor_meta am = {.type = FUSION__MSG_TYPE__MSG_ACTIVATION, .job_id = JOB_ID, .step = 0, .micro_batch = 0,
                           .stage = 0, .dtype = dt, .ndim = 2, .shape = {16, dim1},
                           .relay_to = wire_keypair_public_z85(e->pkp)};
    assert_int_equal(wire_tensor_send(e->relay_out, NULL, 0, e->seal, &am, data, len, 0, NULL), FU_OK);
}

/* Waits for the peer's Error number `n`, which must name the encoding; no gradient may come first. */
static void expect_codec_error(env *e, int n)
{
    uint64_t end = fu_clock_ms() + 20000;
    while (e->errors < n && fu_clock_ms() < end) {
        wire_tensor t = {0};
        if (pump(e, FUSION__MSG_TYPE__MSG_GRADIENT, 200, &t)) {
            dump_log(e);
            fail_msg("a gradient for an activation in the wrong encoding");
        }
    }
    if (e->errors < n)
        dump_log(e);
    assert_int_equal(e->errors, n);
    assert_non_null(strstr(e->last_error, "int8 expected"));
}

/* The attacker upstream (docs/SECURITY.md): a job whose activations travel as int8 refuses an f32
 * activation and an int8 one with a NaN scale (an Error each, nothing computed), and computes from a
 * well-formed one exactly what the executor computes from its decoded values. */
static void test_peer_refuses_tensor_in_wrong_codec(void **state)
{
    (void)state;
    static const char *SPEC8 = "{\"model\": \"tiny\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, "
                               "\"lr\": 0.01, \"steps\": 1, \"batch\": 4, \"seq_len\": 8, \"micro_batches\": 2, "
                               "\"seed\": 3, \"checkpoint_every\": 1, \"act_codec\": \"int8\"}";
    env e;
    size_t cut;
    dag_graph_t *g = relayed_last_stage(&e, "peer-codec", SPEC8, &cut);
    size_t n = dag_graph_size(g);

    dag_exec_t *x0 = ref_exec(&e, g, 0, cut), *x1 = ref_exec(&e, g, cut, n);
    uint32_t cn;
    assert_int_equal(dag_exec_cut_outputs(x0, &cn, 1), 1);
    size_t width = (size_t)dag_graph_width(g, cn), rows = 16;
    dag_spec sp;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_parse(SPEC8, strlen(SPEC8), DAG_JOB_ANY, &sp, &em), FU_OK);
    dag_data_order order = dag_spec_data_order(&sp);
    int32_t tok[16], tgt[16];
    assert_int_equal(dag_data_rows(&order, e.tokens, e.n_tokens, 0, 0, tok, tgt), FU_OK);
    assert_int_equal(dag_exec_set_tokens(x0, 0, tok, NULL, 2, 8), FU_OK);
    assert_int_equal(dag_exec_forward(x0, 0), FU_OK);
    const float *act;
    size_t nf;
    assert_int_equal(dag_exec_get_output(x0, 0, cn, &act, &nf), FU_OK);
    assert_int_equal(nf, rows * width);

    send_activation(&e, FUSION__DTYPE__DTYPE_F32, (int64_t)width, act, nf * sizeof(float)); /* f32: refused */
    expect_codec_error(&e, 1);
    size_t bytes = kern_codec_bytes(KERN_CODEC_INT8, rows, width);
    uint8_t *q = malloc(bytes);
    kern_codec_encode(KERN_CODEC_INT8, act, rows, width, q);
    uint8_t *evil = malloc(bytes);
    memcpy(evil, q, bytes);
    float nan = NAN;
    memcpy(evil + 3 * (width + 4), &nan, 4); /* row 3's scale */
    send_activation(&e, FUSION__DTYPE__DTYPE_U8, (int64_t)(width + 4), evil, bytes);
    expect_codec_error(&e, 2);

    send_activation(&e, FUSION__DTYPE__DTYPE_U8, (int64_t)(width + 4), q, bytes); /* well-formed */
    float *dec = malloc(nf * sizeof *dec);
    assert_int_equal(kern_codec_decode(KERN_CODEC_INT8, q, bytes, rows, width, dec), FU_OK);
    assert_int_equal(dag_exec_set_tokens(x1, 0, NULL, tgt, 2, 8), FU_OK);
    assert_int_equal(dag_exec_set_input(x1, 0, cn, dec, nf), FU_OK);
    assert_int_equal(dag_exec_forward(x1, 0), FU_OK);
    assert_int_equal(dag_exec_backward(x1, 0, 0.5f), FU_OK);
    const float *ref;
    size_t ng;
    assert_int_equal(dag_exec_get_input_grad(x1, cn, &ref, &ng), FU_OK);
    wire_tensor t = {0};
    if (!pump(&e, FUSION__MSG_TYPE__MSG_GRADIENT, 20000, &t))
        dump_log(&e);
    assert_int_equal(t.meta.dtype, FUSION__DTYPE__DTYPE_F32); /* gradients: f32 (grad_codec's default) */
    assert_int_equal(t.len, ng * sizeof(float));
    double scale, d = max_diff((const float *)t.data, ref, ng, &scale);
    printf("int8 activation: gradient max |peer - executor on the decoded input| = %.3g (max |g| %.3g)\n", d, scale);
    assert_true(d <= g_tol * (1.0 + scale));
    wire_tensor_clear(&t);
    assert_int_equal(e.errors, 2);
    free(q);
    free(evil);
    free(dec);
    release_stage(&e, NULL);
    fu_sleep_ms(200);
    expect_leave(&e);
    assert_int_equal(wait_exit(&e, 5000), 0);
    dag_spec_clear(&sp);
    dag_exec_destroy(&x0);
    dag_exec_destroy(&x1);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* A second signal during the drain exits at once (status 1), without waiting for StageRelease. */
static void test_peer_second_signal_exits_at_once(void **state)
{
    (void)state;
    env e;
    dag_graph_t *g = peer_with_stage0(&e, "peer-sig2");
    wire_msg_t *m = pump(&e, FUSION__MSG_TYPE__MSG_STAGE_READY, 30000, NULL);
    assert_non_null(m);
    wire_msg_destroy(&m);
    expect_leave(&e);
    fu_sleep_ms(200);
    int st;
    assert_int_equal(waitpid(e.pid, &st, WNOHANG), 0); /* draining: it holds a stage */
    uint64_t t0 = fu_clock_ms();
    assert_int_equal(kill(e.pid, SIGTERM), 0);
    int code = wait_exit(&e, 3000);
    printf("second SIGTERM: exit %d after %llu ms\n", code, (unsigned long long)(fu_clock_ms() - t0));
    assert_int_equal(code, 1);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* The I/O thread never waits on compute: heartbeats keep their interval while the stage runs a
 * forward that takes far longer than the interval. */
/* The I/O thread keeps every heartbeat interval while the stage computes on a machine that is busy
 * with other work: one busy-loop process per core, started and stopped here. The peer runs as a
 * guest (the default --priority idle): its compute thread gets what the busy loops leave, the I/O
 * thread keeps the process's own priority. Gaps are read from the heartbeats' own timestamps, so a
 * test process slowed by the same load does not count against the peer. */
#define HB_WINDOW_MS 4000

static void test_peer_heartbeats_while_computing(void **state)
{
    (void)state;
    env e;
    g_hidden = 512;
    env_start(&e, "peer-hb");
    g_hidden = 0;
    g_priority = "idle";
    spawn_peer(&e);
    g_priority = "normal";
    handshake(&e);
    dag_build_opts o = {.method = DAG_ADAPTER_LORA_FA, .rank = 4, .alpha = 8.0f, .head = DAG_HEAD_LOSS, .seq_len = 256};
    dag_graph_t *g = NULL;
    assert_int_equal(dag_build_llama(&e.dims, &o, &g), FU_OK);
    assign_stage(&e, g, 0, 0, layer_start(g, 1),
                 "{\"steps\": 1, \"batch\": 32, \"seq_len\": 256, \"micro_batches\": 1, \"seed\": 3}",
                 (size_t)1 << 30);
    /* The compute thread works from the assignment on: it loads the stage, then (StageStart) runs
     * the forward. On a machine busy with other work a guest may still be loading when the window
     * opens; the heartbeats must keep their interval either way. */
    wire_msg_t *m = pump(&e, FUSION__MSG_TYPE__MSG_STAGE_READY, 10000, NULL);
    bool ready = m != NULL;
    wire_msg_destroy(&m);
    int cores = tu_load_start(0);
    if (ready) {
        Fusion__StageStart ss = FUSION__STAGE_START__INIT;
        ss.job_id = JOB_ID;
        to_peer(&e, FUSION__MSG_TYPE__MSG_STAGE_START, JOB_ID, &ss.base);
    }
    e.hb_last_ms = e.hb_first_ms = 0;
    e.hb_max_gap_ms = 0;
    int hb0 = e.heartbeats;
    wire_tensor t = {0};
    int64_t opened = fu_wallclock_ms();
    wire_msg_t *early = pump(&e, FUSION__MSG_TYPE__MSG_ACTIVATION, HB_WINDOW_MS, &t);
    int64_t closed = fu_wallclock_ms();
    tu_load_stop();
    /* This process is slowed by the same load: heartbeats the peer sent in the window may still wait
     * in its socket. Read on until one sent after the window has come. */
    for (uint64_t until = fu_clock_ms() + 3000; e.hb_last_ms < closed && fu_clock_ms() < until;)
        (void)pump(&e, FUSION__MSG_TYPE__MSG_PEER_HELLO, 50, NULL);
    int hb = e.heartbeats - hb0;
    int64_t gap = e.hb_max_gap_ms;
    printf("under %d busy loops: %d heartbeats from %lld ms before the %d ms window to %lld ms after it (interval "
           "200 ms), longest gap %lld ms; the stage %s\n", cores, hb, (long long)(opened - e.hb_first_ms), HB_WINDOW_MS,
           (long long)(e.hb_last_ms - closed), (long long)gap,
           !ready ? "was still loading" : early ? "finished its forward within the window" : "was in its forward");
    /* No missed interval: a heartbeat every 200 ms by the peer's clock, a late wake-up of some ms at most,
     * over the whole window. */
    assert_true(gap > 0 && gap < 2 * 200);
    assert_true(e.hb_first_ms <= opened + 2 * 200 && e.hb_last_ms >= closed);
    assert_true(hb >= (int)((e.hb_last_ms - e.hb_first_ms) / 220)); /* on average no later than 10% */
    /* The guest's compute was slowed, not lost: its stage is held and at work (how fast it goes once
     * the loops stop depends on what else the machine runs, so it is not waited for). */
    assert_int_equal(e.errors, 0);
    if (ready && !early) {
        assert_int_equal(e.hb_state, FUSION__PEER_STATE__PEER_STATE_BUSY);
        assert_int_equal(e.hb_progress >> 32, 1); /* step 0 (+1), its forward not through yet */
        assert_int_equal(e.errors, 0);
    }
    wire_tensor_clear(&t);
    assert_int_equal(kill(e.pid, SIGKILL), 0);
    (void)wait_exit(&e, 5000);
    dag_graph_destroy(&g);
    env_stop(&e);
}

/* --pause-when-busy: with every core taken by other processes the peer says PEER_STATE_PAUSED in its
 * heartbeats, with the reason; the owner's SIGUSR1 / SIGUSR2 pause and resume it by hand. */
static void test_peer_pause_reported(void **state)
{
    (void)state;
    env e;
    env_start(&e, "peer-pause");
    g_extra = "--pause-when-busy";
    spawn_peer(&e);
    g_extra = NULL;
    handshake(&e);
    int cores = tu_load_start(0);
    uint64_t end = fu_clock_ms() + 20000;
    while (e.hb_paused == 0 && fu_clock_ms() < end)
        (void)pump(&e, FUSION__MSG_TYPE__MSG_UNSPECIFIED, 200, NULL);
    tu_load_stop();
    printf("under %d busy loops the peer said: %s\n", cores, e.hb_pause_reason);
    assert_true(e.hb_paused > 0);
    assert_non_null(strstr(e.hb_pause_reason, "busy: other processes use"));
    assert_int_equal(kill(e.pid, SIGKILL), 0);
    (void)wait_exit(&e, 5000);
    env_stop(&e);

    /* The owner's own pause, without load. */
    peer_up(&e, "peer-owner-pause");
    assert_int_equal(kill(e.pid, SIGUSR1), 0);
    end = fu_clock_ms() + 10000;
    while (e.hb_paused == 0 && fu_clock_ms() < end)
        (void)pump(&e, FUSION__MSG_TYPE__MSG_UNSPECIFIED, 100, NULL);
    assert_true(e.hb_paused > 0);
    assert_string_equal(e.hb_pause_reason, "paused by its owner");
    assert_int_equal(kill(e.pid, SIGUSR2), 0);
    (void)pump(&e, FUSION__MSG_TYPE__MSG_UNSPECIFIED, 500, NULL); /* the resume goes out at once */
    int paused = e.hb_paused;
    (void)pump(&e, FUSION__MSG_TYPE__MSG_UNSPECIFIED, 1000, NULL);
    assert_int_equal(e.hb_paused, paused); /* no paused heartbeat after the resume */
    expect_leave(&e);
    assert_int_equal(wait_exit(&e, 5000), 0);
    env_stop(&e);
}

int main(int argc, char **argv)
{
    if (sodium_init() < 0)
        return 1;
    signal(SIGPIPE, SIG_IGN);
    if (argc >= 3 && strcmp(argv[1], "--device") == 0) {
        g_device = argv[2];
        const kern_backend_t *be = NULL;
        if (kern_backend_get(g_device, &be) != FU_OK) {
            printf("no %s backend here: skipped\n", g_device);
            return 77;
        }
        g_tol = 2e-3; /* cuBLAS (TF32 off or on) against OpenBLAS */
        const struct CMUnitTest gpu[] = {cmocka_unit_test_teardown(test_peer_stage_matches_executor, tu_teardown)};
        return cmocka_run_group_tests(gpu, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_peer_graceful_leave_without_stage, tu_teardown),
        cmocka_unit_test_teardown(test_peer_stage_matches_executor, tu_teardown),
        cmocka_unit_test_teardown(test_peer_refuses_weights_with_wrong_hash, tu_teardown),
        cmocka_unit_test_teardown(test_peer_ignores_late_refusal, tu_teardown),
        cmocka_unit_test_teardown(test_peer_refused_blob_ends_stage, tu_teardown),
        cmocka_unit_test_teardown(test_peer_refuses_tensor_in_wrong_codec, tu_teardown),
        cmocka_unit_test_teardown(test_peer_last_stage_relayed_matches_executor, tu_teardown),
        cmocka_unit_test_teardown(test_peer_second_signal_exits_at_once, tu_teardown),
        cmocka_unit_test_teardown(test_peer_heartbeats_while_computing, tu_teardown),
        cmocka_unit_test_teardown(test_peer_pause_reported, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
