/* A client of the broker and the fake peer process (fake_peer.h). */
#include "fake_peer.h"

#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sodium.h>
#include <zmq.h>

#include "dag_peft.h"
#include "dag_serial.h"
#include "fu_clock.h"
#include "fu_challenge.h"
#include "fu_file.h"
#include "fu_safetensors.h"
#include "peer_challenge.h"
#include "wire_socket.h"

#define TU_FAKE_PEER_ARG "--fake-peer"

/* ---- a client of the broker ---------------------------------------------------------------------- */

/* Connects a client with key pair kp (taken) to endpoint, whose server key is the public key of
 * broker_dir. */
static bool client_connect(tu_client *cl, wire_keypair_t *kp, const char *endpoint, const char *broker_dir)
{
    memset(cl, 0, sizeof *cl);
    cl->kp = kp;
    char path[TU_PATH];
    snprintf(path, sizeof path, "%s/" WIRE_PUBLIC_KEY_FILE, broker_dir);
    uint8_t server[WIRE_KEY_BYTES];
    if (wire_key_load_public(path, server, NULL) != FU_OK)
        return false;
    cl->ctx = zmq_ctx_new();
    fu_err rc;
    cl->sock = cl->ctx ? wire_socket_new(cl->ctx, ZMQ_DEALER, &rc) : NULL;
    return cl->sock && wire_socket_curve_client(cl->sock, cl->kp, server) == FU_OK &&
           zmq_connect(cl->sock, endpoint) == 0;
}

void tu_client_open(tu_client *cl, const tu_cluster *c, const char *key_name)
{
    char keys[TU_PATH], broker[TU_PATH];
    tu_path(c, keys, "%s", key_name);
    tu_path(c, broker, "broker");
    wire_keypair_t *kp = NULL;
    fu_errmsg em = {{0}};
    if (wire_keypair_load(keys, &kp, &em) != FU_OK)
        tu_fail("%s: %s", keys, fu_errmsg_text(&em, FU_EIO));
    if (!client_connect(cl, kp, tu_broker_endpoint(c), broker))
        tu_fail("cannot connect a client with keys %s to %s", keys, tu_broker_endpoint(c));
    randombytes_buf(&cl->session, sizeof cl->session);
}

void tu_client_close(tu_client *cl)
{
    peer_challenge_destroy(&cl->solver);
    free(cl->forged);
    cl->forged = NULL;
    wire_socket_close(&cl->sock);
    if (cl->ctx)
        zmq_ctx_term(cl->ctx);
    cl->ctx = NULL;
    wire_keypair_destroy(&cl->kp);
}

fu_err tu_client_send(tu_client *cl, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body)
{
    wire_hdr h = {.type = t, .job_id = job, .sequence = ++cl->seq, .slot = cl->slot};
    return wire_send(cl->sock, NULL, 0, &h, body);
}

/* A forged answer: ready at once, a commitment to n rows of zeros, and those rows. */
static void forge_answer(tu_client *cl, const Fusion__Challenge *ch, Fusion__ChallengeReply *r)
{
    fusion__challenge_reply__init(r);
    r->step = ch->step;
    r->round = ch->round;
    if (ch->step == FUSION__CHALLENGE_STEP__CHALLENGE_PREPARE) {
        uint32_t n = cl->forged_n = ch->n;
        free(cl->forged);
        size_t hb = (size_t)n * FU_CHALLENGE_ROW_HASH;
        cl->forged = calloc(1, hb + (size_t)FU_CHALLENGE_ROWS * n * sizeof(float));
        float *zero = calloc(n, sizeof *zero);
        for (uint32_t i = 0; i < n; i++)
            fu_challenge_row_hash(zero, n, cl->forged + (size_t)i * FU_CHALLENGE_ROW_HASH);
        free(zero);
        fu_challenge_commit(cl->forged, n, cl->forged_commit);
    } else if (ch->step == FUSION__CHALLENGE_STEP__CHALLENGE_GO) {
        r->commit.data = cl->forged_commit;
        r->commit.len = sizeof cl->forged_commit;
    } else if (cl->forged) {
        r->row_hashes.data = cl->forged;
        r->row_hashes.len = (size_t)cl->forged_n * FU_CHALLENGE_ROW_HASH;
        r->rows.data = cl->forged + r->row_hashes.len;
        r->rows.len = (size_t)ch->n_rows * cl->forged_n * sizeof(float);
    }
}

/* Answers a profile challenge as cl->challenge says; false when m is to be passed on. */
static bool answer_challenge(tu_client *cl, const wire_msg_t *m)
{
    if (wire_msg_type(m) != FUSION__MSG_TYPE__MSG_CHALLENGE || cl->challenge == TU_CHALLENGE_PASS_ON)
        return false;
    const Fusion__Challenge *ch = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_CHALLENGE);
    Fusion__ChallengeReply r;
    if (cl->challenge == TU_CHALLENGE_FORGE) {
        forge_answer(cl, ch, &r);
    } else {
        if (!cl->solver)
            cl->solver = peer_challenge_new(kern_backend_cpu());
        peer_challenge_answer(cl->solver, ch, &r);
    }
    (void)tu_client_send(cl, FUSION__MSG_TYPE__MSG_CHALLENGE_REPLY, 0, &r.base);
    if (ch->step == FUSION__CHALLENGE_STEP__CHALLENGE_REVEAL)
        cl->challenges_answered++;
    return true;
}

wire_msg_t *tu_client_recv(tu_client *cl, int timeout_ms)
{
    zmq_pollitem_t it = {.socket = cl->sock, .events = ZMQ_POLLIN};
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        uint64_t now = fu_clock_ms();
        if (now >= end)
            return NULL;
        if (zmq_poll(&it, 1, (long)(end - now)) <= 0)
            continue;
        wire_msg_t *m = NULL;
        if (wire_recv(cl->sock, WIRE_DONTWAIT, &cl->c, &m) != FU_OK)
            continue;
        if (!answer_challenge(cl, m))
            return m;
        wire_msg_destroy(&m);
    }
}

wire_msg_t *tu_client_call(tu_client *cl, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body,
                           Fusion__MsgType want, int timeout_ms)
{
    if (tu_client_send(cl, t, job, body) != FU_OK)
        return NULL;
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        wire_msg_t *m = tu_client_recv(cl, (int)(end - fu_clock_ms()) + 1);
        if (!m)
            return NULL;
        if (wire_msg_type(m) == want || wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR)
            return m;
        wire_msg_destroy(&m);
    }
    return NULL;
}

bool tu_client_wait_up(tu_client *cl, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        wire_msg_t *m =
            tu_client_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 500);
        if (m) {
            wire_msg_destroy(&m);
            return true;
        }
    }
    return false;
}

const Fusion__JobStatus *tu_status_of(const wire_msg_t *m)
{
    if (!m)
        tu_fail("no answer from the broker");
    if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR)
        tu_fail("the broker refused: %s", ((const Fusion__Error *)wire_msg_body(m))->message);
    const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
    if (!st)
        tu_fail("the broker answered %s, not JobStatus", wire_type_name(wire_msg_type(m)));
    return st;
}

/* The PeerInfo of the peer named `name` in a PeerList answer (NULL: not listed). */
const Fusion__PeerInfo *tu_peer_listed(const wire_msg_t *m, const char *name)
{
    const Fusion__PeerList *pl = m ? wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_LIST) : NULL;
    for (size_t i = 0; pl && i < pl->n_peers; i++)
        if (strcmp(pl->peers[i]->name, name) == 0)
            return pl->peers[i];
    return NULL;
}

wire_msg_t *tu_client_peer_list(tu_client *cl)
{
    return tu_client_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 2000);
}

static const Fusion__PeerInfo *listed(const Fusion__PeerList *pl, const char *z85, const char *name)
{
    for (size_t i = 0; pl && i < pl->n_peers; i++)
        if ((z85 && strcmp(pl->peers[i]->peer_id, z85) == 0) || (name && strcmp(pl->peers[i]->name, name) == 0))
            return pl->peers[i];
    return NULL;
}

double tu_client_reputation(tu_client *cl, const char *name)
{
    wire_msg_t *m =
        tu_client_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 2000);
    const Fusion__PeerInfo *pi = listed(m ? wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_LIST) : NULL, NULL, name);
    double r = pi ? pi->reputation : -1;
    wire_msg_destroy(&m);
    return r;
}

int tu_client_peer_state(tu_client *cl, const char *z85)
{
    wire_msg_t *m =
        tu_client_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 2000);
    const Fusion__PeerInfo *pi = listed(m ? wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_LIST) : NULL, z85, NULL);
    int st = pi ? (int)pi->state : -1;
    wire_msg_destroy(&m);
    return st;
}

int tu_client_wait_peer_state(tu_client *cl, const char *z85, int want, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    int st = -1;
    while (fu_clock_ms() < end) {
        st = tu_client_peer_state(cl, z85);
        if (st == want)
            return st;
        fu_sleep_ms(50);
    }
    return st;
}

const char *tu_finetune_spec(const char *model_dir, char *buf, size_t cap)
{
    snprintf(buf, cap,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, \"steps\": 2, "
             "\"batch\": 2, \"seq_len\": 8, \"micro_batches\": 2, \"checkpoint_every\": 1}",
             model_dir);
    return buf;
}

wire_msg_t *tu_client_submit(tu_client *cl, const char *spec_json, const char *idem)
{
    static const char text[] = "the quick brown fox jumps over the lazy dog, again and again and again and again.";
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.idempotency_key = (char *)(idem ? idem : "");
    js.kind = FUSION__JOB_KIND__JOB_KIND_FINETUNE;
    js.spec_json = (char *)spec_json;
    js.data.data = (uint8_t *)text;
    js.data.len = sizeof text - 1;
    return tu_client_call(cl, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 5000);
}

wire_msg_t *tu_client_job_status(tu_client *cl, uint64_t id)
{
    Fusion__JobRef r = FUSION__JOB_REF__INIT;
    r.job_id = id;
    return tu_client_call(cl, FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ, id, &r.base, FUSION__MSG_TYPE__MSG_JOB_STATUS,
                          3000);
}

void tu_client_hello(tu_client *cl, const char *name, uint64_t mem, double gflops)
{
    Fusion__DtypeSpeed sp = FUSION__DTYPE_SPEED__INIT;
    sp.dtype = FUSION__DTYPE__DTYPE_F32;
    sp.gemm_gflops = gflops;
    Fusion__DtypeSpeed *spp = &sp;
    Fusion__PeerProfile pr = FUSION__PEER_PROFILE__INIT;
    pr.n_speeds = 1;
    pr.speeds = &spp;
    pr.free_memory_bytes = mem;
    pr.backend = FUSION__BACKEND__BACKEND_CPU;
    pr.device_name = (char *)"cpu: test";
    pr.link_bandwidth_bps = 1e9;
    pr.link_latency_ms = 0.1;
    pr.threads = 1;
    Fusion__PeerHello h = FUSION__PEER_HELLO__INIT;
    h.session = cl->session;
    h.name = (char *)name;
    h.software = (char *)"fusion-test";
    h.profile = &pr;
    h.data_endpoint = (char *)"tcp://127.0.0.1:9";
    (void)tu_client_send(cl, FUSION__MSG_TYPE__MSG_PEER_HELLO, 0, &h.base);
}

/* ---- the fixture of the broker tests ---------------------------------------------------------------- */

int tu_broker_fx_setup(void **state)
{
    tu_broker_fx *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    tu_opts o = tu_opts_broker_alone();
    f->c = tu_cluster_new("broker", &o);
    const char *keys[] = {"other", "p0", "p1", "p2", "p3"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        tu_keygen(f->c, keys[i], true);
    tu_path(f->c, f->model, "model");
    tu_finetune_spec(f->model, f->spec, sizeof f->spec);
    *state = f;
    return 0;
}

int tu_broker_fx_teardown(void **state)
{
    tu_broker_fx *f = *state;
    tu_client_close(&f->cl);
    int rc = tu_cluster_stop(&f->c) == FU_OK ? 0 : -1;
    free(f);
    return rc;
}

void tu_broker_fx_start(tu_broker_fx *f)
{
    tu_client_close(&f->cl);
    tu_broker_start(f->c);
    tu_client_open(&f->cl, f->c, "client");
    if (!tu_client_wait_up(&f->cl, 10000)) {
        tu_file_show(tu_broker_log(f->c), 40);
        tu_fail("the broker did not come up");
    }
}

/* ---- the fake peer: the test's side ---------------------------------------------------------------- */

void tu_fake_peer_start(tu_fake_peer *p, const tu_cluster *c, const char *key_name, const char *name, uint64_t mem,
                        double gflops, const char *mode)
{
    memset(p, 0, sizeof *p);
    int fds[2];
    if (pipe(fds) != 0)
        tu_fail("pipe for fake peer %s failed", name);
    char self[TU_PATH], broker[TU_PATH], keys[TU_PATH], memb[32], gf[32], log[TU_PATH];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        tu_fail("cannot find this test's executable");
    self[n] = '\0';
    tu_path(c, broker, "broker");
    tu_path(c, keys, "%s", key_name);
    tu_path(c, log, "fake-%s.log", name);
    snprintf(memb, sizeof memb, "%" PRIu64, mem);
    snprintf(gf, sizeof gf, "%g", gflops);
    char *argv[] = {self, TU_FAKE_PEER_ARG, (char *)tu_broker_endpoint(c), broker, keys, (char *)name, memb, gf,
                    (char *)mode, NULL};
    fcntl(fds[0], F_SETFD, FD_CLOEXEC);
    p->pid = tu_spawn_piped(log, argv, fds[1]);
    close(fds[1]);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    p->out = fds[0];
}

bool tu_fake_peer_expect(tu_fake_peer *p, const char *prefix, int timeout_ms, char *line, size_t cap)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    size_t np = strlen(prefix);
    for (;;) {
        char *nl;
        while ((nl = memchr(p->buf, '\n', p->len))) {
            size_t n = (size_t)(nl - p->buf);
            bool hit = n >= np && strncmp(p->buf, prefix, np) == 0;
            if (hit && line) {
                size_t k = n < cap - 1 ? n : cap - 1;
                memcpy(line, p->buf, k);
                line[k] = 0;
            }
            memmove(p->buf, nl + 1, p->len - n - 1);
            p->len -= n + 1;
            if (hit)
                return true;
        }
        uint64_t now = fu_clock_ms();
        if (now >= end)
            return false;
        struct pollfd pf = {.fd = p->out, .events = POLLIN};
        if (poll(&pf, 1, (int)(end - now)) <= 0)
            continue;
        ssize_t r = read(p->out, p->buf + p->len, sizeof p->buf - p->len - 1);
        if (r <= 0)
            return false;
        p->len += (size_t)r;
    }
}

int tu_fake_peer_stop(tu_fake_peer *p, int sig)
{
    if (!p->pid)
        return -2;
    kill(p->pid, sig);
    int code = tu_reap(p->pid, 15000);
    p->pid = 0;
    close(p->out);
    return code;
}

bool tu_fake_peer_requested(int argc, char **argv)
{
    return argc > 1 && strcmp(argv[1], TU_FAKE_PEER_ARG) == 0;
}

/* ---- the fake peer process ------------------------------------------------------------------------- */

static volatile sig_atomic_t fake_term;

static void fake_on_term(int s)
{
    (void)s;
    fake_term = 1;
}

/* Fetches tensor `name` of model_id (WeightRequest, WeightChunks) and checks its hash; its size in
 * *bytes. */
bool tu_client_fetch(tu_client *cl, const char *model_id, const char *name, uint8_t **data, size_t *len)
{
    *data = NULL;
    *len = 0;
    Fusion__WeightRequest r = FUSION__WEIGHT_REQUEST__INIT;
    r.model_id = (char *)model_id;
    r.tensor_name = (char *)name;
    if (tu_client_send(cl, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST, 0, &r.base) != FU_OK)
        return false;
    uint8_t *buf = NULL;
    uint64_t got = 0, total = 0;
    uint8_t hash[32];
    for (;;) {
        wire_msg_t *m = tu_client_recv(cl, 5000);
        if (!m)
            break;
        if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR) {
            const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
            if (e->in_reply_to == FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST) {
                fprintf(stderr, "fetch %s/%s refused: %s\n", model_id, name, e->message);
                wire_msg_destroy(&m);
                break;
            }
        }
        const Fusion__WeightChunk *c = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK);
        if (!c || c->content_hash.len != 32 || (buf && c->total != total) || c->offset > c->total ||
            c->data.len > c->total - c->offset) {
            wire_msg_destroy(&m);
            continue; /* heartbeats, or a chunk this fetch cannot use */
        }
        if (!buf) {
            total = c->total;
            buf = malloc(total ? total : 1);
            memcpy(hash, c->content_hash.data, 32);
        }
        memcpy(buf + c->offset, c->data.data, c->data.len);
        got += c->data.len;
        wire_msg_destroy(&m);
        if (got >= total)
            break;
    }
    uint8_t h2[32];
    crypto_generichash(h2, 32, buf, got, NULL, 0);
    bool ok = buf && got == total && memcmp(h2, hash, 32) == 0;
    if (!ok) {
        free(buf);
        return false;
    }
    *data = buf;
    *len = got;
    return true;
}

static bool fake_fetch(tu_client *cl, const char *model_id, const char *name, size_t *bytes)
{
    uint8_t *data = NULL;
    bool ok = tu_client_fetch(cl, model_id, name, &data, bytes);
    free(data);
    return ok;
}

/* What "train" mode knows of its stage. */
typedef struct {
    uint64_t job;
    uint32_t stage, count;
    uint64_t steps, every;
    char dir[TU_PATH]; /* where its checkpoint files go (its key directory) */
    dag_graph_t *g;    /* the job's DAG (StageAssign) */
    uint32_t first, last; /* the stage's node range */
    bool forge;        /* mode "forge": checkpoints hold a made-up tensor */
} fake_train;

/* Sends a checkpoint of the stage at `step` in two chunks and waits for the CheckpointAck. */
static bool fake_put_ckpt(tu_client *cl, const fake_train *t, uint64_t step)
{
    /* Honest in form: every adapter tensor and moment of the stage's graph range, A = stage*100 + i,
     * B = step, moments 0.5. "forge" sends one made-up tensor instead. */
    size_t cap = 8, n = 0;
    fu_st_tensor *ts = calloc(cap, sizeof *ts);
    dag_peft_tensor *names = calloc(cap, sizeof *names);
    static float forged[1] = {1337.0f};
    if (t->forge) {
        snprintf(names[0].name, sizeof names[0].name, "base_model.model.x.lora_A.weight");
        ts[n++] = (fu_st_tensor){.name = names[0].name, .dtype = FU_ST_F32, .ndim = 1, .shape = {1},
                                 .data = forged, .nbytes = sizeof forged};
    }
    for (uint32_t i = t->first; i < t->last && !t->forge; i++) {
        dag_peft_tensor pt[DAG_PEFT_PER_NODE];
        size_t c = dag_peft_node_tensors(dag_graph_node(t->g, i), true, pt);
        for (size_t k = 0; k < c; k++) {
            if (n == cap) {
                cap *= 2;
                ts = realloc(ts, cap * sizeof *ts);
                names = realloc(names, cap * sizeof *names);
            }
            names[n] = pt[k];
            size_t cnt = (size_t)(pt[k].shape[0] * pt[k].shape[1]);
            float *v = malloc(cnt * sizeof *v);
            bool is_a = strstr(pt[k].name, "lora_A.weight") && !strstr(pt[k].name, ".adam_");
            bool is_b = strstr(pt[k].name, "lora_B.weight") && !strstr(pt[k].name, ".adam_");
            for (size_t e = 0; e < cnt; e++)
                v[e] = is_a ? (float)(t->stage * 100 + e) : is_b ? (float)step : 0.5f;
            ts[n] = (fu_st_tensor){.dtype = FU_ST_F32, .ndim = 2, .shape = {pt[k].shape[0], pt[k].shape[1]},
                                   .data = v, .nbytes = cnt * sizeof *v};
            n++;
        }
    }
    for (size_t i = 0; i < n; i++)
        ts[i].name = names[i].name;
    char path[TU_PATH + 32], stepv[32];
    snprintf(path, sizeof path, "%s/ckpt-%u.safetensors", t->dir, t->stage);
    snprintf(stepv, sizeof stepv, "%llu", (unsigned long long)step);
    const char *meta[] = {"step", stepv, "adam_t", stepv};
    char *data = NULL;
    size_t len = 0;
    bool written = fu_safetensors_write(path, ts, n, meta, 2, NULL, NULL, NULL) == FU_OK &&
                   fu_file_read_all(path, 64 << 20, &data, &len, NULL) == FU_OK;
    for (size_t i = 0; i < n; i++)
        if (ts[i].data != forged)
            free((void *)ts[i].data);
    free(ts);
    free(names);
    if (!written)
        return false;
    uint8_t hash[32];
    crypto_generichash(hash, 32, (uint8_t *)data, len, NULL, 0);
    size_t half = len / 2; /* two chunks */
    for (int k = 0; k < 2; k++) {
        Fusion__CheckpointPut c = FUSION__CHECKPOINT_PUT__INIT;
        c.job_id = t->job;
        c.stage_index = t->stage;
        c.step = step;
        c.offset = k ? half : 0;
        c.total = len;
        c.content_hash.data = hash;
        c.content_hash.len = 32;
        c.data.data = (uint8_t *)data + c.offset;
        c.data.len = k ? len - half : half;
        (void)tu_client_send(cl, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, t->job, &c.base);
    }
    free(data);
    for (int tries = 0; tries < 50; tries++) {
        wire_msg_t *m = tu_client_recv(cl, 5000);
        if (!m)
            return false;
        Fusion__MsgType ty = wire_msg_type(m);
        bool ok = ty == FUSION__MSG_TYPE__MSG_CHECKPOINT_ACK;
        if (ty == FUSION__MSG_TYPE__MSG_ERROR)
            printf("ERROR ckpt %s\n", ((const Fusion__Error *)wire_msg_body(m))->message);
        wire_msg_destroy(&m);
        if (ok)
            return true;
        if (ty == FUSION__MSG_TYPE__MSG_ERROR)
            return false;
    }
    return false;
}

bool tu_fake_put_ckpt(tu_client *cl, uint64_t job, uint32_t stage, const struct dag_graph *g, uint32_t first,
                      uint32_t last, uint64_t step, const char *dir)
{
    fake_train t = {.job = job, .stage = stage, .g = (dag_graph_t *)g, .first = first, .last = last};
    snprintf(t.dir, sizeof t.dir, "%s", dir);
    return fake_put_ckpt(cl, &t, step);
}

/* Runs the steps from `from` on: StepDone on the last stage, a checkpoint every `every` steps. */
static void fake_train_run(tu_client *cl, const fake_train *t, uint64_t from)
{
    for (uint64_t s = from; s < t->steps; s++) {
        if (t->stage == t->count - 1) {
            Fusion__StepDone d = FUSION__STEP_DONE__INIT;
            d.job_id = t->job;
            d.step = s;
            d.loss = 5.0 - (double)s;
            d.tokens = 16;
            (void)tu_client_send(cl, FUSION__MSG_TYPE__MSG_STEP_DONE, t->job, &d.base);
        }
        if ((s + 1) % t->every == 0 || s + 1 == t->steps)
            printf("CKPT %u step %llu %s\n", t->stage, (unsigned long long)(s + 1),
                   fake_put_ckpt(cl, t, s + 1) ? "acked" : "FAILED");
    }
}

/* The fake peer's state between messages. */
typedef struct {
    tu_client cl;
    const char *name, *mode;
    uint64_t mem;
    double gflops;
    fake_train tr;                        /* "train" mode */
    uint64_t infer_job, prompt_len;       /* "infer" mode */
    uint32_t infer_stages, infer_stage;
    bool leaving, left;                   /* Leave sent; StageRelease seen after it */
} fake_peer;

static void fake_on_assign(fake_peer *f, const Fusion__StageAssign *a)
{
    printf("ASSIGN %016" PRIx64 " stage %u of %u backup %d resume %" PRIu64 " nodes %u-%u model %.10s dag %zu\n",
           a->job_id, a->stage_index, a->stage_count, a->backup ? 1 : 0, a->resume_step, a->node_begin, a->node_end,
           a->model_id, a->dag.len);
    if (a->backup) {
        /* a warm backup only says it is ready */
    } else if (strcmp(f->mode, "train") == 0 || strcmp(f->mode, "forge") == 0) {
        cJSON *sp = cJSON_Parse(a->spec_json);
        dag_graph_destroy(&f->tr.g);
        if (dag_graph_decode(a->dag.data, a->dag.len, &f->tr.g, NULL) != FU_OK)
            printf("DAG undecodable\n");
        f->tr.first = a->node_begin;
        f->tr.last = a->node_end;
        f->tr.forge = strcmp(f->mode, "forge") == 0;
        const cJSON *v;
        f->tr.job = a->job_id;
        f->tr.stage = a->stage_index;
        f->tr.count = a->stage_count;
        f->tr.steps = (v = cJSON_GetObjectItem(sp, "steps")) ? (uint64_t)v->valuedouble : 1;
        f->tr.every = (v = cJSON_GetObjectItem(sp, "checkpoint_every")) ? (uint64_t)v->valuedouble : f->tr.steps;
        cJSON_Delete(sp);
        size_t n1 = 0, n2 = 0;
        char jobblob[64];
        snprintf(jobblob, sizeof jobblob, "job:%016" PRIx64, a->job_id);
        bool w_ok = fake_fetch(&f->cl, a->model_id, "model.norm.weight", &n1);
        bool t_ok = fake_fetch(&f->cl, jobblob, "tokens", &n2);
        printf("FETCH weights %s %zu tokens %s %zu\n", w_ok ? "ok" : "BAD", n1, t_ok ? "ok" : "BAD", n2);
    } else if (strncmp(f->mode, "infer", 5) == 0) {
        char jobblob[64];
        size_t nb = 0;
        snprintf(jobblob, sizeof jobblob, "job:%016" PRIx64, a->job_id);
        bool t_ok = fake_fetch(&f->cl, jobblob, "tokens", &nb);
        f->infer_job = a->job_id;
        f->prompt_len = nb / 4;
        f->infer_stages = a->stage_count;
        f->infer_stage = a->stage_index;
        printf("FETCH tokens %s %zu resume %" PRIu64 "\n", t_ok ? "ok" : "BAD", nb, a->resume_step);
    } else if (strcmp(f->mode, "noready") == 0) {
        return; /* heartbeats, never says StageReady */
    } else if (strcmp(f->mode, "error") == 0) {
        Fusion__Error e = FUSION__ERROR__INIT;
        e.code = FUSION__ERROR_CODE__ERR_INTERNAL;
        e.message = (char *)"simulated stage failure";
        e.in_reply_to = FUSION__MSG_TYPE__MSG_STAGE_ASSIGN;
        (void)tu_client_send(&f->cl, FUSION__MSG_TYPE__MSG_ERROR, a->job_id, &e.base);
        return;
    }
    Fusion__StageReady r = FUSION__STAGE_READY__INIT;
    r.job_id = a->job_id;
    r.stage_index = a->stage_index;
    (void)tu_client_send(&f->cl, FUSION__MSG_TYPE__MSG_STAGE_READY, a->job_id, &r.base);
}

/* Answers one message from the broker. */
static void fake_on_message(fake_peer *f, const wire_msg_t *m, uint32_t *hb_ms, uint32_t *dead_ms)
{
    switch (wire_msg_type(m)) {
    case FUSION__MSG_TYPE__MSG_PEER_WELCOME: {
        const Fusion__PeerWelcome *w = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_WELCOME);
        *hb_ms = w->heartbeat_ms;
        *dead_ms = w->dead_after_ms;
        printf("WELCOME %u %u\n", *hb_ms, *dead_ms);
        break;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_ASSIGN:
        fake_on_assign(f, wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN));
        break;
    case FUSION__MSG_TYPE__MSG_STAGE_START: {
        const Fusion__StageStart *s = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_START);
        printf("START %016" PRIx64 " step %" PRIu64 "\n", s->job_id, s->step);
        if ((strcmp(f->mode, "train") == 0 || strcmp(f->mode, "forge") == 0) && s->job_id == f->tr.job)
            fake_train_run(&f->cl, &f->tr, s->step);
        if (strncmp(f->mode, "infer", 5) == 0 && s->job_id == f->infer_job && f->infer_stage == f->infer_stages - 1) {
            /* the "sampled" token at position p is 'A' + (p - prompt length) */
            Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
            it.job_id = f->infer_job;
            it.position = f->prompt_len;
            it.token = 'A';
            (void)tu_client_send(&f->cl, FUSION__MSG_TYPE__MSG_INFER_TOKEN, f->infer_job, &it.base);
        }
        break;
    }
    case FUSION__MSG_TYPE__MSG_STAGE_RELEASE: {
        const Fusion__StageRelease *r = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_RELEASE);
        printf("RELEASE %016" PRIx64 " stage %u: %s\n", r->job_id, r->stage_index, r->reason);
        f->left = f->leaving;
        break;
    }
    case FUSION__MSG_TYPE__MSG_INFER_TOKEN: { /* stage 0's next input; this fake is every stage */
        const Fusion__InferToken *in = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_INFER_TOKEN);
        printf("TOKEN %" PRIu64 " %d\n", in->position, in->token);
        if (strcmp(f->mode, "infer-slow") == 0)
            fu_sleep_ms(300); /* a token every 0.3 s */
        Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
        it.job_id = in->job_id;
        it.position = in->position + 1;
        it.token = (int32_t)('A' + (in->position + 1 - f->prompt_len));
        (void)tu_client_send(&f->cl, FUSION__MSG_TYPE__MSG_INFER_TOKEN, in->job_id, &it.base);
        break;
    }
    case FUSION__MSG_TYPE__MSG_ERROR: {
        const Fusion__Error *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        printf("ERROR %d %s\n", (int)e->code, e->message);
        if (e->code == FUSION__ERROR_CODE__ERR_NOT_FOUND && e->in_reply_to == FUSION__MSG_TYPE__MSG_HEARTBEAT) {
            printf("REHELLO\n");
            tu_client_hello(&f->cl, f->name, f->mem, f->gflops);
        }
        break;
    }
    default:
        break;
    }
}

/* argv: self --fake-peer ENDPOINT BROKER_KEY_DIR KEY_DIR NAME MEM_BYTES GFLOPS MODE */
int tu_fake_peer_main(int argc, char **argv)
{
    if (argc < 9)
        return 2;
    if (sodium_init() < 0)
        return 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGTERM, fake_on_term);
    signal(SIGPIPE, SIG_IGN);
    fake_peer f;
    memset(&f, 0, sizeof f);
    f.name = argv[5];
    f.mem = strtoull(argv[6], NULL, 10);
    f.gflops = strtod(argv[7], NULL);
    f.mode = argv[8];
    snprintf(f.tr.dir, sizeof f.tr.dir, "%s", argv[4]);
    wire_keypair_t *kp = NULL;
    if (wire_keypair_load(argv[4], &kp, NULL) != FU_OK || !client_connect(&f.cl, kp, argv[2], argv[3])) {
        fprintf(stderr, "fake peer %s: cannot connect to %s\n", f.name, argv[2]);
        return 1;
    }
    tu_client_hello(&f.cl, f.name, f.mem, f.gflops);
    uint32_t hb_ms = 1000, dead_ms = 3000;
    uint64_t last_hb = fu_clock_ms(), last_heard = fu_clock_ms(), leave_at = 0;
    while (!f.left) {
        if (fake_term && !f.leaving) {
            Fusion__Leave l = FUSION__LEAVE__INIT;
            l.reason = (char *)"SIGTERM";
            (void)tu_client_send(&f.cl, FUSION__MSG_TYPE__MSG_LEAVE, 0, &l.base);
            f.leaving = true;
            leave_at = fu_clock_ms();
            printf("LEAVE\n");
        }
        if (f.leaving && fu_clock_ms() - leave_at > 5000)
            break;
        uint64_t now = fu_clock_ms();
        if (!f.leaving && now - last_hb >= hb_ms / 2) {
            Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
            hb.time_ms = (int64_t)now;
            (void)tu_client_send(&f.cl, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base);
            last_hb = now;
        }
        if (!f.leaving && now - last_heard > dead_ms) { /* the broker went silent: register again */
            printf("REHELLO\n");
            tu_client_hello(&f.cl, f.name, f.mem, f.gflops);
            last_heard = now;
        }
        wire_msg_t *m = tu_client_recv(&f.cl, 100);
        if (!m)
            continue;
        last_heard = fu_clock_ms();
        fake_on_message(&f, m, &hb_ms, &dead_ms);
        wire_msg_destroy(&m);
    }
    tu_client_close(&f.cl);
    return 0;
}
