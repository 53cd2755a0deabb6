/* Speaking the broker's protocol from a test (part of the test cluster harness, cluster.h): a CURVE
 * DEALER client of a cluster's broker, and the fake peer, a real process (the test executable run
 * again with --fake-peer) that speaks the peer side of docs/PIPELINE.md with that client: PeerHello,
 * heartbeats, StageReady on StageAssign, registering again when the broker goes silent or forgets it,
 * Leave on SIGTERM. The fake peer prints one line per event on stdout ("WELCOME 1000 3000",
 * "ASSIGN <job> stage 0 of 1 backup 0 resume 0 ...", "START <job> step 0", "RELEASE ...", "LEAVE",
 * "REHELLO", ...), which the test reads through a pipe with tu_fake_peer_expect.
 * A test that starts fake peers calls tu_fake_peer_main from its main (see tu_fake_peer_requested).
 * One test thread: nothing here is thread-safe. */
#ifndef FU_TESTS_FAKE_PEER_H
#define FU_TESTS_FAKE_PEER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "cluster.h"
#include "wire.h"
#include "wire_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- a client of the broker ---------------------------------------------------------------------- */

/* How a test's wire client answers the broker's profile challenge (MSG_CHALLENGE; tu_client_recv
 * answers it before returning anything else). */
typedef enum {
    TU_CHALLENGE_HONEST = 0, /* computes it on the CPU backend (peer/peer_challenge.c), as fusion-peer does */
    TU_CHALLENGE_FORGE,      /* answers at once with a self-consistent commitment to rows of zeros */
    TU_CHALLENGE_PASS_ON,    /* does not answer: tu_client_recv returns the Challenge to the caller */
} tu_challenge_mode;

typedef struct {
    void *ctx;          /* its own ZeroMQ context */
    void *sock;         /* DEALER, CURVE client of the broker */
    wire_keypair_t *kp; /* the client's keys */
    wire_counters c;    /* what wire_recv dropped */
    uint64_t seq;       /* the last Envelope.sequence sent */
    uint64_t session;   /* PeerHello.session (random at tu_client_open; change it for a "new process") */
    tu_challenge_mode challenge; /* how it answers profile challenges */
    struct peer_challenge *solver; /* TU_CHALLENGE_HONEST: made on the first challenge */
    uint8_t *forged;    /* TU_CHALLENGE_FORGE: the zero rows' hashes and rows */
    uint32_t forged_n;  /* ... of this size */
    uint8_t forged_commit[32]; /* ... and their commitment */
    uint32_t challenges_answered; /* REVEALs answered (the challenge ran to its end) */
    uint32_t slot;      /* Envelope.slot of what it sends (0: the key itself; fusion-peer --slots) */
} tu_client;

/* Connects to c's broker with the key pair DIR/key_name; fails the test otherwise. */
void tu_client_open(tu_client *cl, const tu_cluster *c, const char *key_name);

/* Closes the socket and the context, frees the keys; idempotent (a zeroed client is closed). */
void tu_client_close(tu_client *cl);

/* Sends a message of type t about job (body may be NULL) with the next sequence number. */
fu_err tu_client_send(tu_client *cl, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body);

/* The next message within timeout_ms (caller destroys), or NULL. */
wire_msg_t *tu_client_recv(tu_client *cl, int timeout_ms);

/* Sends, then waits for a message of type `want` or an Error (returned, caller destroys; NULL on
 * timeout); other messages are dropped. */
wire_msg_t *tu_client_call(tu_client *cl, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body,
                           Fusion__MsgType want, int timeout_ms);

/* Waits until the broker answers a PeerList request (it serves this client). */
bool tu_client_wait_up(tu_client *cl, int timeout_ms);

/* The JobStatus in m (a JobSubmit's or JobStatusReq's answer); fails the test on no answer or an
 * Error (naming it). */
const Fusion__JobStatus *tu_status_of(const wire_msg_t *m);

/* The reputation the broker lists for the peer named `name`, or -1 when absent or no answer. */
double tu_client_reputation(tu_client *cl, const char *name);

/* The broker's PeerList (caller destroys), NULL when no answer. */
wire_msg_t *tu_client_peer_list(tu_client *cl);
/* The entry of the peer named `name` in the PeerList m, NULL when absent (or m is not one). */
const Fusion__PeerInfo *tu_peer_listed(const wire_msg_t *m, const char *name);

/* State of the peer with key z85 in the broker's PeerList, or -1 when absent or no answer. */
int tu_client_peer_state(tu_client *cl, const char *z85);

/* Polls tu_client_peer_state until it is `want` or timeout_ms pass: the last state seen. */
int tu_client_wait_peer_state(tu_client *cl, const char *z85, int want, int timeout_ms);

/* Submits a fine-tune job with spec_json over a short fixed text (idem: the idempotency key, may be
 * NULL): the reply, JobStatus or Error (caller destroys), NULL on timeout. */
wire_msg_t *tu_client_submit(tu_client *cl, const char *spec_json, const char *idem);

/* JobStatusReq for job id: the reply (caller destroys), NULL on timeout. */
wire_msg_t *tu_client_job_status(tu_client *cl, uint64_t id);

/* Fetches the whole blob (model_id, name) as a peer does (WeightRequest, then WeightChunks): true
 * with the bytes in *data (caller frees) when they arrived whole and hash to the content_hash the
 * chunks carry; false on an Error, a timeout or a wrong hash. */
bool tu_client_fetch(tu_client *cl, const char *model_id, const char *name, uint8_t **data, size_t *len);

/* Sends PeerHello as a peer named `name` with mem bytes free and gflops of float32 GEMM. */
void tu_client_hello(tu_client *cl, const char *name, uint64_t mem, double gflops);

/* The spec of the fake peers' fine-tune on model_dir: 2 steps of 2 micro-batches, a checkpoint every
 * step. Written into buf; returns buf. */
const char *tu_finetune_spec(const char *model_dir, char *buf, size_t cap);

/* Sends, through cl, a checkpoint of stage `stage` (nodes [first, last) of g) of job at `step` that is
 * honest in form (every adapter tensor and moment of the range), as the fake peers in "train" mode
 * do (its file goes in dir), and waits for the CheckpointAck: true when it came. */
struct dag_graph;
bool tu_fake_put_ckpt(tu_client *cl, uint64_t job, uint32_t stage, const struct dag_graph *g, uint32_t first,
                      uint32_t last, uint64_t step, const char *dir);

/* ---- the fixture of the broker tests ------------------------------------------------------------- */

/* A broker alone (tu_opts_broker_alone) and the key pairs of two clients, "client" and "other", and
 * of four peers, "p0" to "p3", all on the allow-list. Nothing runs until tu_broker_fx_start. */
typedef struct {
    tu_cluster *c;
    tu_client cl;        /* the client "client", connected by tu_broker_fx_start */
    char model[TU_PATH]; /* DIR/model */
    char spec[8192];     /* tu_finetune_spec of that model */
} tu_broker_fx;

/* cmocka setup: *state = a new tu_broker_fx. */
int tu_broker_fx_setup(void **state);

/* cmocka teardown: closes the client, stops the cluster and frees the fixture; -1 when a process of
 * the cluster ended badly (tu_cluster_stop). */
int tu_broker_fx_teardown(void **state);

/* Starts (or starts again) the broker and connects f->cl once the broker serves it (10 s); fails the
 * test otherwise. */
void tu_broker_fx_start(tu_broker_fx *f);

/* A cmocka test run with this fixture. */
#define tu_broker_test(fn) cmocka_unit_test_setup_teardown(fn, tu_broker_fx_setup, tu_broker_fx_teardown)

/* ---- the fake peer ------------------------------------------------------------------------------- */

typedef struct {
    pid_t pid;       /* 0 when not running */
    int out;         /* read end of its stdout */
    char buf[65536]; /* output not read yet */
    size_t len;
} tu_fake_peer;

/* Starts a fake peer with the key pair DIR/key_name, named `name`, offering mem bytes and gflops,
 * connected to c's broker (which must run). mode: "ready" answers StageAssign with StageReady;
 * "train" also fetches a weight and the job's tokens (hash-checked), sends a chunked checkpoint of its
 * stage (every adapter tensor of its graph range: A = stage*100 + i, B = the step, moments 0.5) every
 * checkpoint step, and StepDone on the last stage; "forge" is "train" whose checkpoints hold one
 * made-up tensor; "infer" plays every stage of an inference job, sampling 'A', 'B', ... ("infer-slow":
 * one token every 0.3 s); "error"
 * fails every stage with an Error; "noready" heartbeats but never says StageReady. */
void tu_fake_peer_start(tu_fake_peer *p, const tu_cluster *c, const char *key_name, const char *name, uint64_t mem,
                        double gflops, const char *mode);

/* Waits for a line of the peer's output that starts with prefix (the lines before it are dropped);
 * copies it into line (cap bytes; line may be NULL). False on timeout or when the peer exited. */
bool tu_fake_peer_expect(tu_fake_peer *p, const char *prefix, int timeout_ms, char *line, size_t cap);

/* Sends sig and reaps the peer: its exit code (128 + signal when a signal ended it), -1 when it had
 * to be killed, -2 when it does not run. */
int tu_fake_peer_stop(tu_fake_peer *p, int sig);

/* Whether this process was started as a fake peer (argv[1] is --fake-peer). */
bool tu_fake_peer_requested(int argc, char **argv);

/* The fake peer's main (argv as tu_fake_peer_start makes it): 0 after a clean leave. */
int tu_fake_peer_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif

#endif
