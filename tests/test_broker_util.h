/* Helpers for the broker tests: keys, a real fusion-broker process (fork/exec, real signals), a
 * CURVE DEALER client that speaks the protocol, and a "fake peer" that is a real process (this test
 * executable run again with --fake-peer) speaking the peer side of docs/PIPELINE.md: PeerHello,
 * heartbeats, StageReady on StageAssign, re-registration when the broker goes silent, Leave on
 * SIGTERM. It prints one line per event on stdout, which the test reads through a pipe.
 * Header-only so each test stays one file. */
#ifndef FU_TEST_BROKER_UTIL_H
#define FU_TEST_BROKER_UTIL_H

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sodium.h>
#include <zmq.h>

#include "fu_clock.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "dag_model.h"
#include "fu_safetensors.h"
#include <cjson/cJSON.h>
#include "testutil.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_socket.h"

/* ---------- keys and files ---------- */

/* Makes DIR/<name> with a fresh key pair; returns the pair (caller destroys). */
static inline wire_keypair_t *tb_keygen(const char *dir, const char *name)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    wire_keypair_t *kp = wire_keypair_generate();
    if (!kp || wire_keypair_save(kp, path, false, NULL, 0) != FU_OK) {
        fprintf(stderr, "tb_keygen %s failed\n", path);
        abort();
    }
    return kp;
}

static inline void tb_allow(const char *file, const wire_keypair_t *kp)
{
    FILE *f = fopen(file, "a");
    if (!f)
        abort();
    fprintf(f, "%s\n", wire_keypair_public_z85(kp));
    fclose(f);
}

/* A TCP port free on 127.0.0.1 right now. */
static inline int tb_free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(s, (struct sockaddr *)&a, &l) != 0)
        abort();
    int port = ntohs(a.sin_port);
    close(s);
    return port;
}

/* A tiny random LLaMA model directory (fu_modelcfg_defaults shapes). */
static inline void tb_make_model(const char *dir)
{
    fu_modelcfg cfg;
    fu_modelcfg_defaults(&cfg);
    fu_errmsg em = {{0}};
    if (dag_model_init_random(dir, &cfg, 7, 0.02f, &em) != FU_OK) {
        fprintf(stderr, "model init failed: %s\n", em.msg);
        abort();
    }
}

/* ---------- the broker process ---------- */

typedef struct {
    char dir[4096];      /* scratch */
    char keys[4200];     /* broker key dir */
    char allow[4200];    /* allow-list */
    char db[4200];       /* store */
    char log[4200];      /* broker's stderr */
    char endpoint[64];   /* tcp://127.0.0.1:PORT */
    char bind[64];
    wire_keypair_t *kp;  /* the broker's keys */
    pid_t pid;           /* running broker, 0 when none */
    int backups;
    int heartbeat_ms;
    int ready_timeout_s; /* --ready-timeout, 0: the broker's default */
    char token[64];      /* --enrol-token, "" for none */
} tb_broker;

static inline void tb_broker_init(tb_broker *b, const char *tag)
{
    memset(b, 0, sizeof *b);
    char *d = tu_tmpdir(tag);
    snprintf(b->dir, sizeof b->dir, "%s", d);
    free(d);
    snprintf(b->keys, sizeof b->keys, "%s/broker", b->dir);
    snprintf(b->allow, sizeof b->allow, "%s/allow.txt", b->dir);
    snprintf(b->db, sizeof b->db, "%s/jobs.db", b->dir);
    snprintf(b->log, sizeof b->log, "%s/broker.log", b->dir);
    b->kp = tb_keygen(b->dir, "broker");
    int port = tb_free_port();
    snprintf(b->endpoint, sizeof b->endpoint, "tcp://127.0.0.1:%d", port);
    snprintf(b->bind, sizeof b->bind, "tcp://127.0.0.1:%d", port);
    b->backups = 1;
    b->heartbeat_ms = 1000;
    FILE *f = fopen(b->allow, "w");
    if (f)
        fclose(f);
}

static inline void tb_broker_start(tb_broker *b)
{
    char backups[16], hb[16], rt[16];
    snprintf(backups, sizeof backups, "%d", b->backups);
    snprintf(hb, sizeof hb, "%d", b->heartbeat_ms);
    snprintf(rt, sizeof rt, "%d", b->ready_timeout_s);
    char *argv[24] = {"fusion-broker", "--bind", b->bind, "--keys", b->keys, "--db", b->db, "--allow", b->allow,
                      "--backups", backups, "--heartbeat-ms", hb, "--log-level", "debug", NULL};
    int n = 15;
    if (b->token[0]) {
        argv[n++] = "--enrol-token";
        argv[n++] = b->token;
    }
    if (b->ready_timeout_s > 0) {
        argv[n++] = "--ready-timeout";
        argv[n++] = rt;
    }
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        int fd = open(b->log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) {
            dup2(fd, 2);
            dup2(fd, 1);
        }
        execv(tu_bin("fusion-broker"), argv);
        _exit(127);
    }
    b->pid = pid;
}

/* Sends sig and waits for the broker; returns its exit status (128+signal when killed). */
static inline int tb_broker_stop(tb_broker *b, int sig)
{
    if (!b->pid)
        return -1;
    kill(b->pid, sig);
    int st = 0;
    waitpid(b->pid, &st, 0);
    b->pid = 0;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static inline void tb_broker_dump_log(const tb_broker *b)
{
    char *out = NULL;
    tu_sh(&out, "tail -n 40 '%s'", b->log);
    fprintf(stderr, "---- broker log ----\n%s--------------------\n", out ? out : "");
    free(out);
}

/* Stops the broker with SIGTERM (a clean stop: under the sanitizers this is when leaks are
 * reported), checks it exited 0 with no sanitizer report in its log, removes the scratch
 * directory. Returns 0, or -1 after printing the log (a teardown failure). */
static inline int tb_broker_fini(tb_broker *b)
{
    int rc = 0;
    if (b->pid) {
        kill(b->pid, SIGTERM);
        int st = 0;
        pid_t w = 0;
        for (int i = 0; i < 100 && (w = waitpid(b->pid, &st, WNOHANG)) == 0; i++)
            fu_sleep_ms(50);
        if (w == 0) {
            fprintf(stderr, "the broker did not stop within 5 s of SIGTERM\n");
            kill(b->pid, SIGKILL);
            waitpid(b->pid, &st, 0);
            rc = -1;
        } else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "the broker exited with status %d on SIGTERM\n", st);
            rc = -1;
        }
        b->pid = 0;
    }
    char *out = NULL;
    if (tu_sh(&out, "grep -c 'Sanitizer\\|runtime error' '%s'", b->log) == 0) {
        fprintf(stderr, "sanitizer report in the broker's log\n");
        rc = -1;
    }
    free(out);
    if (rc != 0) {
        out = NULL;
        tu_sh(&out, "grep -A30 'Sanitizer\\|runtime error' '%s' | head -80; tail -n 20 '%s'", b->log, b->log);
        fprintf(stderr, "%s\n", out ? out : "");
        free(out);
    }
    wire_keypair_destroy(&b->kp);
    out = NULL;
    tu_sh(&out, "rm -rf '%s'", b->dir);
    free(out);
    return rc;
}

/* ---------- a protocol client ---------- */

typedef struct {
    void *ctx;
    void *sock;
    wire_keypair_t *kp;
    wire_counters c;
    uint64_t seq;
} tb_client;

static inline void tb_client_open(tb_client *cl, const wire_keypair_t *kp, const tb_broker *b)
{
    memset(cl, 0, sizeof *cl);
    cl->ctx = zmq_ctx_new();
    cl->kp = wire_keypair_from_bytes(wire_keypair_public(kp), wire_keypair_secret(kp));
    fu_err rc;
    cl->sock = wire_socket_new(cl->ctx, ZMQ_DEALER, &rc);
    if (!cl->sock || wire_socket_curve_client(cl->sock, cl->kp, wire_keypair_public(b->kp)) != FU_OK ||
        zmq_connect(cl->sock, b->endpoint) != 0)
        abort();
}

static inline void tb_client_close(tb_client *cl)
{
    wire_socket_close(&cl->sock);
    if (cl->ctx)
        zmq_ctx_term(cl->ctx);
    cl->ctx = NULL;
    wire_keypair_destroy(&cl->kp);
}

static inline fu_err tb_send(tb_client *cl, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body)
{
    wire_hdr h = {.type = t, .job_id = job, .sequence = ++cl->seq};
    return wire_send(cl->sock, NULL, 0, &h, body);
}

/* The next message within timeout_ms, or NULL. */
static inline wire_msg_t *tb_recv(tb_client *cl, int timeout_ms)
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
        if (wire_recv(cl->sock, WIRE_DONTWAIT, &cl->c, &m) == FU_OK)
            return m;
    }
}

/* Sends and waits for a message of type `want` (or an Error); others are dropped. */
static inline wire_msg_t *tb_call(tb_client *cl, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body,
                                  Fusion__MsgType want, int timeout_ms)
{
    if (tb_send(cl, t, job, body) != FU_OK)
        return NULL;
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        wire_msg_t *m = tb_recv(cl, (int)(end - fu_clock_ms()) + 1);
        if (!m)
            return NULL;
        if (wire_msg_type(m) == want || wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR)
            return m;
        wire_msg_destroy(&m);
    }
    return NULL;
}

/* Waits until the broker answers a PeerList request (it is up). */
static inline bool tb_wait_up(tb_client *cl, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        wire_msg_t *m = tb_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 500);
        if (m) {
            wire_msg_destroy(&m);
            return true;
        }
    }
    return false;
}

/* State of the peer with key z85 in the broker's PeerList, or -1 when absent / no answer. */
static inline int tb_peer_state(tb_client *cl, const char *z85)
{
    wire_msg_t *m = tb_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 2000);
    const Fusion__PeerList *pl = m ? wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_LIST) : NULL;
    int st = -1;
    for (size_t i = 0; pl && i < pl->n_peers; i++)
        if (strcmp(pl->peers[i]->peer_id, z85) == 0)
            st = (int)pl->peers[i]->state;
    wire_msg_destroy(&m);
    return st;
}

static inline const char *TB_FINETUNE_SPEC(const char *model, char *buf, size_t cap)
{
    snprintf(buf, cap,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, \"steps\": 2, "
             "\"batch\": 2, \"seq_len\": 8, \"micro_batches\": 2, \"checkpoint_every\": 1}",
             model);
    return buf;
}

/* Submits a fine-tune job; returns the reply (JobStatus or Error). */
static inline wire_msg_t *tb_submit(tb_client *cl, const char *spec, const char *idem)
{
    static const char text[] = "the quick brown fox jumps over the lazy dog, again and again and again and again.";
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.idempotency_key = (char *)(idem ? idem : "");
    js.kind = FUSION__JOB_KIND__JOB_KIND_FINETUNE;
    js.spec_json = (char *)spec;
    js.data.data = (uint8_t *)text;
    js.data.len = sizeof text - 1;
    return tb_call(cl, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 5000);
}

static inline wire_msg_t *tb_job_status(tb_client *cl, uint64_t id)
{
    Fusion__JobRef r = FUSION__JOB_REF__INIT;
    r.job_id = id;
    return tb_call(cl, FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ, id, &r.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 3000);
}

/* ---------- the fake peer process ---------- */

typedef struct {
    pid_t pid;
    int out;          /* read end of its stdout */
    char buf[65536];  /* unread output */
    size_t len;
} tb_peer;

/* Starts `self --fake-peer ENDPOINT BROKER_KEY_DIR KEY_DIR NAME MEM_BYTES GFLOPS MODE`. */
static inline void tb_peer_start(tb_peer *p, const tb_broker *b, const char *key_dir, const char *name,
                                 unsigned long long mem, double gflops, const char *mode)
{
    memset(p, 0, sizeof *p);
    int fds[2];
    if (pipe(fds) != 0)
        abort();
    char memb[32], gf[32];
    snprintf(memb, sizeof memb, "%llu", mem);
    snprintf(gf, sizeof gf, "%g", gflops);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        close(fds[0]);
        dup2(fds[1], 1);
        execl("/proc/self/exe", "fake-peer", "--fake-peer", b->endpoint, b->keys, key_dir, name, memb, gf, mode,
              (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    p->pid = pid;
    p->out = fds[0];
}

/* Waits for a line of the peer's output starting with prefix; copies it into line. */
static inline bool tb_peer_expect(tb_peer *p, const char *prefix, int timeout_ms, char *line, size_t cap)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        char *nl;
        while ((nl = memchr(p->buf, '\n', p->len))) {
            size_t n = (size_t)(nl - p->buf);
            bool hit = n >= strlen(prefix) && strncmp(p->buf, prefix, strlen(prefix)) == 0;
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

static inline int tb_peer_stop(tb_peer *p, int sig)
{
    if (!p->pid)
        return -1;
    kill(p->pid, sig);
    int st = 0;
    waitpid(p->pid, &st, 0);
    p->pid = 0;
    close(p->out);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static volatile sig_atomic_t tb_fake_term;
static inline void tb_fake_on_term(int s)
{
    (void)s;
    tb_fake_term = 1;
}

static inline void tb_fake_hello(tb_client *cl, const char *name, uint64_t mem, double gflops)
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
    h.name = (char *)name;
    h.software = (char *)"fusion-test";
    h.profile = &pr;
    h.data_endpoint = (char *)"tcp://127.0.0.1:9";
    (void)tb_send(cl, FUSION__MSG_TYPE__MSG_PEER_HELLO, 0, &h.base);
}


/* Fake-peer "train" mode: asks the broker for one model tensor and the job's tokens and checks
 * their hashes; on StageStart sends a checkpoint of its stage for every checkpoint step (waiting
 * for each CheckpointAck) and, on the last stage, StepDone for every step. */
typedef struct {
    uint64_t job;
    uint32_t stage, count;
    uint64_t steps, every;
    char model_id[96];
    char dir[4096];
} tb_train;

static inline bool tb_fetch(tb_client *cl, const char *model_id, const char *name, size_t *bytes)
{
    Fusion__WeightRequest r = FUSION__WEIGHT_REQUEST__INIT;
    r.model_id = (char *)model_id;
    r.tensor_name = (char *)name;
    if (tb_send(cl, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST, 0, &r.base) != FU_OK)
        return false;
    uint8_t *buf = NULL;
    uint64_t got = 0, total = 0;
    uint8_t hash[32];
    for (;;) {
        wire_msg_t *m = tb_recv(cl, 5000);
        if (!m)
            break;
        const Fusion__WeightChunk *c = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK);
        if (!c) {
            wire_msg_destroy(&m);
            continue; /* heartbeats */
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
    free(buf);
    *bytes = got;
    return ok;
}

static inline bool tb_put_ckpt(tb_client *cl, const tb_train *t, uint64_t step)
{
    char mod[128], na[200], nb[200], nm[220];
    snprintf(mod, sizeof mod, "base_model.model.model.layers.%u.self_attn.q_proj", t->stage);
    snprintf(na, sizeof na, "%s.lora_A.weight", mod);
    snprintf(nb, sizeof nb, "%s.lora_B.weight", mod);
    snprintf(nm, sizeof nm, "%s.lora_B.weight.adam_m", mod);
    float a[8], bb[8], mm[8];
    for (int i = 0; i < 8; i++) {
        a[i] = (float)(t->stage * 100 + i);
        bb[i] = (float)step;
        mm[i] = 0.5f;
    }
    fu_st_tensor ts[3] = {
        {.name = na, .dtype = FU_ST_F32, .ndim = 2, .shape = {2, 4}, .data = a, .nbytes = sizeof a},
        {.name = nb, .dtype = FU_ST_F32, .ndim = 2, .shape = {4, 2}, .data = bb, .nbytes = sizeof bb},
        {.name = nm, .dtype = FU_ST_F32, .ndim = 2, .shape = {4, 2}, .data = mm, .nbytes = sizeof mm},
    };
    char path[4200], stepv[32];
    snprintf(path, sizeof path, "%s/ckpt-%u.safetensors", t->dir, t->stage);
    snprintf(stepv, sizeof stepv, "%llu", (unsigned long long)step);
    const char *meta[] = {"step", stepv, "adam_t", stepv};
    char *data = NULL;
    size_t len = 0;
    if (fu_safetensors_write(path, ts, 3, meta, 2, NULL, NULL, NULL) != FU_OK ||
        fu_file_read_all(path, 1 << 20, &data, &len, NULL) != FU_OK)
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
        (void)tb_send(cl, FUSION__MSG_TYPE__MSG_CHECKPOINT_PUT, t->job, &c.base);
    }
    free(data);
    for (int tries = 0; tries < 50; tries++) {
        wire_msg_t *m = tb_recv(cl, 5000);
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

static inline void tb_train_run(tb_client *cl, const tb_train *t, uint64_t from)
{
    for (uint64_t s = from; s < t->steps; s++) {
        if (t->stage == t->count - 1) {
            Fusion__StepDone d = FUSION__STEP_DONE__INIT;
            d.job_id = t->job;
            d.step = s;
            d.loss = 5.0 - (double)s;
            d.tokens = 16;
            (void)tb_send(cl, FUSION__MSG_TYPE__MSG_STEP_DONE, t->job, &d.base);
        }
        if ((s + 1) % t->every == 0 || s + 1 == t->steps)
            printf("CKPT %u step %llu %s\n", t->stage, (unsigned long long)(s + 1),
                   tb_put_ckpt(cl, t, s + 1) ? "acked" : "FAILED");
    }
}

/* The fake peer's main: argv as in tb_peer_start. MODE "ready": answers StageAssign with StageReady. */
static inline int tb_fake_peer_main(int argc, char **argv)
{
    if (argc < 9)
        return 2;
    if (sodium_init() < 0)
        return 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGTERM, tb_fake_on_term);
    tb_broker b;
    memset(&b, 0, sizeof b);
    snprintf(b.endpoint, sizeof b.endpoint, "%s", argv[2]);
    wire_keypair_t *bkp = NULL, *kp = NULL;
    if (wire_keypair_load(argv[3], &bkp, NULL, 0) != FU_OK || wire_keypair_load(argv[4], &kp, NULL, 0) != FU_OK)
        return 1;
    b.kp = bkp;
    const char *name = argv[5];
    uint64_t mem = strtoull(argv[6], NULL, 10);
    double gflops = strtod(argv[7], NULL);
    tb_client cl;
    tb_client_open(&cl, kp, &b);
    tb_fake_hello(&cl, name, mem, gflops);
    bool train = strcmp(argv[8], "train") == 0, infer = strcmp(argv[8], "infer") == 0;
    bool failing = strcmp(argv[8], "error") == 0; /* every stage it gets fails with an Error */
    bool stuck = strcmp(argv[8], "noready") == 0; /* heartbeats, never says StageReady for a stage */
    uint64_t infer_job = 0, prompt_len = 0;
    uint32_t infer_stages = 0, infer_stage = 0;
    tb_train tr;
    memset(&tr, 0, sizeof tr);
    snprintf(tr.dir, sizeof tr.dir, "%s", argv[4]);
    uint32_t hb_ms = 1000, dead_ms = 3000;
    uint64_t last_hb = fu_clock_ms(), last_heard = fu_clock_ms();
    bool leaving = false, leaving_done = false;
    uint64_t leave_at = 0;
    for (;;) {
        if (tb_fake_term && !leaving) {
            Fusion__Leave l = FUSION__LEAVE__INIT;
            l.reason = (char *)"SIGTERM";
            (void)tb_send(&cl, FUSION__MSG_TYPE__MSG_LEAVE, 0, &l.base);
            leaving = true;
            leave_at = fu_clock_ms();
            printf("LEAVE\n");
        }
        if (leaving && fu_clock_ms() - leave_at > 5000)
            break;
        uint64_t now = fu_clock_ms();
        if (!leaving && now - last_hb >= hb_ms / 2) {
            Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
            hb.time_ms = (int64_t)now;
            (void)tb_send(&cl, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base);
            last_hb = now;
        }
        if (!leaving && now - last_heard > dead_ms) { /* the broker went silent: register again */
            printf("REHELLO\n");
            tb_fake_hello(&cl, name, mem, gflops);
            last_heard = now;
        }
        wire_msg_t *m = tb_recv(&cl, 100);
        if (!m)
            continue;
        last_heard = fu_clock_ms();
        const wire_hdr *h = wire_msg_hdr(m);
        switch (wire_msg_type(m)) {
        case FUSION__MSG_TYPE__MSG_PEER_WELCOME: {
            const Fusion__PeerWelcome *w = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_WELCOME);
            hb_ms = w->heartbeat_ms;
            dead_ms = w->dead_after_ms;
            printf("WELCOME %u %u\n", hb_ms, dead_ms);
            break;
        }
        case FUSION__MSG_TYPE__MSG_STAGE_ASSIGN: {
            const Fusion__StageAssign *a = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN);
            printf("ASSIGN %016" PRIx64 " stage %u of %u backup %d resume %" PRIu64 " nodes %u-%u model %.10s dag %zu\n",
                   a->job_id, a->stage_index, a->stage_count, a->backup ? 1 : 0, a->resume_step, a->node_begin,
                   a->node_end, a->model_id, a->dag.len);
            if (train && !a->backup) {
                cJSON *sp = cJSON_Parse(a->spec_json);
                const cJSON *v;
                tr.job = a->job_id;
                tr.stage = a->stage_index;
                tr.count = a->stage_count;
                tr.steps = (v = cJSON_GetObjectItem(sp, "steps")) ? (uint64_t)v->valuedouble : 1;
                tr.every = (v = cJSON_GetObjectItem(sp, "checkpoint_every")) ? (uint64_t)v->valuedouble : tr.steps;
                cJSON_Delete(sp);
                snprintf(tr.model_id, sizeof tr.model_id, "%s", a->model_id);
                size_t n1 = 0, n2 = 0;
                char jobblob[64];
                snprintf(jobblob, sizeof jobblob, "job:%016" PRIx64, a->job_id);
                bool w_ok = tb_fetch(&cl, a->model_id, "model.norm.weight", &n1);
                bool t_ok = tb_fetch(&cl, jobblob, "tokens", &n2);
                printf("FETCH weights %s %zu tokens %s %zu\n", w_ok ? "ok" : "BAD", n1, t_ok ? "ok" : "BAD", n2);
            }
            if (infer && !a->backup) {
                char jobblob[64];
                size_t nb = 0;
                snprintf(jobblob, sizeof jobblob, "job:%016" PRIx64, a->job_id);
                bool t_ok = tb_fetch(&cl, jobblob, "tokens", &nb);
                infer_job = a->job_id;
                prompt_len = nb / 4;
                infer_stages = a->stage_count;
                infer_stage = a->stage_index;
                printf("FETCH tokens %s %zu resume %" PRIu64 "\n", t_ok ? "ok" : "BAD", nb, a->resume_step);
            }
            if (stuck && !a->backup)
                break;
            if (failing && !a->backup) {
                Fusion__Error e = FUSION__ERROR__INIT;
                e.code = FUSION__ERROR_CODE__ERR_INTERNAL;
                e.message = (char *)"simulated stage failure";
                e.in_reply_to = FUSION__MSG_TYPE__MSG_STAGE_ASSIGN;
                (void)tb_send(&cl, FUSION__MSG_TYPE__MSG_ERROR, a->job_id, &e.base);
                break;
            }
            Fusion__StageReady r = FUSION__STAGE_READY__INIT;
            r.job_id = a->job_id;
            r.stage_index = a->stage_index;
            (void)tb_send(&cl, FUSION__MSG_TYPE__MSG_STAGE_READY, a->job_id, &r.base);
            break;
        }
        case FUSION__MSG_TYPE__MSG_STAGE_START: {
            const Fusion__StageStart *s = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_START);
            printf("START %016" PRIx64 " step %" PRIu64 "\n", s->job_id, s->step);
            if (train && s->job_id == tr.job)
                tb_train_run(&cl, &tr, s->step);
            if (infer && s->job_id == infer_job && infer_stage == infer_stages - 1) {
                /* the "sampled" token at position p is 'A' + (p - prompt length) */
                Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
                it.job_id = infer_job;
                it.position = prompt_len;
                it.token = 'A';
                (void)tb_send(&cl, FUSION__MSG_TYPE__MSG_INFER_TOKEN, infer_job, &it.base);
            }
            break;
        }
        case FUSION__MSG_TYPE__MSG_STAGE_RELEASE: {
            const Fusion__StageRelease *r = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_RELEASE);
            printf("RELEASE %016" PRIx64 " stage %u: %s\n", r->job_id, r->stage_index, r->reason);
            if (leaving)
                leaving_done = true;
            break;
        }
        case FUSION__MSG_TYPE__MSG_INFER_TOKEN: { /* stage 0's next input; this fake is every stage */
            const Fusion__InferToken *in = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_INFER_TOKEN);
            printf("TOKEN %" PRIu64 " %d\n", in->position, in->token);
            Fusion__InferToken it = FUSION__INFER_TOKEN__INIT;
            it.job_id = in->job_id;
            it.position = in->position + 1;
            it.token = (int32_t)('A' + (in->position + 1 - prompt_len));
            (void)tb_send(&cl, FUSION__MSG_TYPE__MSG_INFER_TOKEN, in->job_id, &it.base);
            break;
        }
        case FUSION__MSG_TYPE__MSG_ERROR: {
            const Fusion__Error *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
            printf("ERROR %d %s\n", (int)e->code, e->message);
            if (e->code == FUSION__ERROR_CODE__ERR_NOT_FOUND && e->in_reply_to == FUSION__MSG_TYPE__MSG_HEARTBEAT) {
                printf("REHELLO\n");
                tb_fake_hello(&cl, name, mem, gflops);
            }
            break;
        }
        default:
            (void)h;
            break;
        }
        wire_msg_destroy(&m);
        if (leaving_done)
            break;
    }
    tb_client_close(&cl);
    wire_keypair_destroy(&kp);
    wire_keypair_destroy(&bkp);
    return 0;
}

#endif
