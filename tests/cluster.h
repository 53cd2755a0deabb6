/* The test cluster: fusion-broker, fusion-peers and the fusion client as real processes on loopback,
 * with real CURVE sockets and a real SQLite file, in a scratch directory (docs/TESTING.md). Every
 * process test and bench-pipeline start their programs through this module.
 *
 * A cluster is made in two steps. tu_cluster_new makes the scratch directory DIR: the key pairs
 * (DIR/broker, DIR/client, DIR/p0 .. pN-1), the allow-list DIR/allow, the model (`fusion model init
 * -o DIR/model`), the training text and the client's configuration file DIR/client.conf (read through
 * FUSION_CONFIG; the format of deploy/fusion.conf.example). tu_cluster_start then starts the broker
 * on a free port of 127.0.0.1 (read back from its log) and the peers, and waits until every peer has
 * joined. The finer steps (tu_broker_start, tu_peer_start, ...) serve tests that restart or add
 * processes. Logs: DIR/broker.log (DIR/broker-2.log after a restart, ...), DIR/pI.log.
 *
 * Every process started here gets prctl(PR_SET_PDEATHSIG, SIGKILL) right after fork and is recorded
 * until it is reaped, so nothing outlives a crashed test. tu_cluster_stop stops a cluster gracefully
 * and checks how everything ended; tu_teardown, the cmocka teardown of the process tests, kills and
 * reaps whatever a failed assertion left and keeps the scratch directory (its path printed).
 *
 * Failures: a function documented "fails the test" ends the running cmocka test with a message (and
 * the log tails that explain it). bench-pipeline runs outside cmocka: it calls tu_fail_exits() first,
 * and a failure then prints the message and exits 1.
 * One test thread: nothing here is thread-safe. */
#ifndef FU_TESTS_CLUSTER_H
#define FU_TESTS_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CMUnitTest;

#define TU_MAX_PEERS 8    /* fusion-peers in one cluster */
#define TU_PATH      4096 /* room for any path under a cluster's directory */
#define TU_ID_LEN    17   /* a job id: 16 hex digits and the NUL */

/* The model of the e2e clusters: 6 decoder layers, hidden 256 (3.7 M parameters). With
 * TU_PEER_MEMORY_GB per peer the partitioner's memory estimate (32 MiB fixed per stage + weights +
 * activations) fits two layers per peer and not three, so three peers always run a three-stage
 * pipeline, whatever their measured speeds. */
#define TU_MODEL_ARGS     "--layers 6 --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 256 --seed 3"
#define TU_PEER_MEMORY_GB "0.039"
#define TU_LINK_MBPS      "1000" /* the broker's own default: the plans the tests were written for */
/* The fine-tune options shared by `fusion submit finetune` and `fusion run finetune`. */
#define TU_TRAIN_ARGS     "--rank 4 --alpha 8 --batch 4 --seq-len 16 --lr 0.01 --seed 7"

/* The two-stage cluster of the peer tests (test_peer_broker.c, test_verify.c, ...): an 8-layer model;
 * each peer offers 60 MiB, and the broker's plan needs about 71 MiB in one stage and about 52 MiB per
 * stage in two, so every job runs as a two-stage pipeline whatever speeds the peers measured on a
 * loaded machine; heartbeat 300 ms; the seeded word stream as training text. */
#define TU_TWO_STAGE_MODEL_ARGS "--layers 8 --hidden 256 --ffn 1024 --seed 2"
#define TU_TWO_STAGE_MEMORY_GB  "0.0586"

/* The model of the tests whose peers are fake (the test speaks the protocol): `fusion model init`'s
 * default shapes (2 layers, hidden 64). */
#define TU_SMALL_MODEL_ARGS "--seed 7"

#define TU_WORDS 6000 /* words of the seeded training stream (tu_opts.word_data) */

/* What a cluster is made of; read by tu_cluster_new. Start from tu_opts_default (or one of the other
 * tu_opts_* below) and change what the test is about. The strings are borrowed: they must outlive
 * the processes the cluster starts. */
typedef struct {
    int n_peers;                /* peers pI with keys DIR/pI, all started by tu_cluster_start */
    bool peers_unlisted;        /* the peers' keys are left off the allow-list (they must enrol) */
    const char *model_args;     /* `fusion model init -o DIR/model` options (NULL: no model) */
    bool word_data;             /* train on TU_WORDS words of a seeded stream (DIR/data.txt), not
                                   deploy/data/shakespeare.txt */
    /* fusion-broker */
    int backups;                /* --backups */
    int heartbeat_ms;           /* --heartbeat-ms (0: 1000, the broker's default) */
    int ready_timeout_s;        /* --ready-timeout (0: the broker's default) */
    int step_timeout_s;         /* --step-timeout (0: the broker's default) */
    int pause_grace_s;          /* --pause-grace (0: the broker's default) */
    int challenge_ms;           /* --challenge-ms (0: 20 ms, short for the tests' peers; < 0: challenges off) */
    const char *enrol_token;    /* --enrol-token (NULL: none) */
    const char *log_level;      /* --log-level (NULL: the broker's default) */
    const char *grow_margin;    /* --grow-margin (NULL: the broker's default, 0.2) */
    const char *model_root;     /* --model-root besides DIR (the broker serves the models under DIR
                                   and these; ':'-separated; NULL: DIR only) */
    /* every fusion-peer */
    const char *peer_memory_gb; /* --max-memory (NULL: none) */
    const char *link_mbps;      /* --link-mbps (NULL: the peer measures its link) */
    const char *priority;       /* --priority (NULL: the peer's default, idle) */
    const char *peer_extra[8];  /* more arguments (NULL-terminated) */
    const char *peer_threads[8];/* --threads of peer pI (NULL: 1) */
    const char *peer_memory[8]; /* --max-memory of peer pI (NULL: peer_memory_gb; "" none) */
    const char *peer_link[8];   /* --link-mbps of peer pI (NULL: link_mbps) */
    const char *peer_gflops[8]; /* --gflops of peer pI (NULL: it measures its speed) */
    const char *corrupt_mode;   /* "scale" or "lie": peer pI runs with FUSION_TEST_CORRUPT_OUTPUT=
                                   MODE:DIR/corrupt.pI and cheats while that file exists
                                   (peer/peer_verify.h; test hooks only); NULL: honest peers */
    const char *stall;          /* "ready" or "step:N": peer pI runs with FUSION_TEST_STALL=
                                   STALL:DIR/stall.pI and stalls while that file exists (test hooks
                                   only); NULL: none. Takes the place of corrupt_mode. */
    int gateways;               /* fusion-gateways gK (keys DIR/gwK, with the gateway role) that carry the
                                   peers' and the client's connections (peer pI through gateway I mod
                                   gateways, the client through gw0): the broker gets --gateway-bind, and
                                   tu_cluster_start starts them after it (tu_gateway_start); 0: none */
    bool gateway_failover;      /* with gateways: each peer is also given the others, after its own
                                   (--broker GW_I,GW_I+1,... with their keys), and moves on when its
                                   gateway is lost */
    bool verify_late;           /* every peer runs with FUSION_TEST_VERIFY_LATE=1: it reads its stage's
                                   VerifyRequests only once it moved past their step (test hooks only;
                                   peer/peer_faults.h). Only without stall and corrupt_mode. */
} tu_opts;

/* The e2e cluster of n_peers: TU_MODEL_ARGS, Shakespeare, no backups, the broker's default timings,
 * peers at --priority normal (a test cluster is not a guest, and other tests share the machine) with
 * --max-memory TU_PEER_MEMORY_GB and --link-mbps TU_LINK_MBPS (plans that do not depend on how fast a
 * loaded machine times its link probe). */
tu_opts tu_opts_default(int n_peers);

/* The two-stage cluster above (TU_TWO_STAGE_*), with `backups` warm backups and heartbeat 300 ms. */
tu_opts tu_opts_two_stage(int n_peers, int backups);

/* A broker alone, for tests that play its peers and clients themselves (fake_peer.h): no fusion-peer,
 * one backup, --log-level debug, TU_SMALL_MODEL_ARGS, --grow-margin 0. */
tu_opts tu_opts_broker_alone(void);

typedef struct tu_cluster tu_cluster;

/* Makes the scratch directory $TMPDIR/fusion-TAG-XXXXXX and everything in it (see the top), starts
 * nothing. Skips the test (cmocka skip) when the options need test hooks this build lacks. Fails the
 * test when something cannot be made. The cluster is freed by tu_cluster_stop, or by tu_teardown
 * after a failed assertion. */
tu_cluster *tu_cluster_new(const char *tag, const tu_opts *opts);

/* Starts the broker and every peer, and waits (30 s each) until every peer has joined and had its
 * profile checked (the challenge); fails the test otherwise. */
void tu_cluster_start(tu_cluster *c);

/* Graceful stop: SIGCONT to stopped peers, SIGTERM to every peer and then to the broker. Each must
 * exit 0 (peers within 20 s, a clean leave; the broker within 5 s) and no broker log may hold a
 * sanitizer report. Removes the directory when all went well (unless FUSION_TEST_KEEP is set) and
 * keeps it otherwise (path and log tails printed). Frees the cluster and sets *c_p to NULL; a NULL
 * *c_p is FU_OK. FU_EIO when something ended badly. */
FU_MUST_CHECK fu_err tu_cluster_stop(tu_cluster **c_p);

/* The options the cluster was made with. The broker's and the peers' options may be changed: they
 * apply to the next process started (n_peers, peers_unlisted, model_args and word_data are spent). */
tu_opts *tu_cluster_opts(tu_cluster *c);

const char *tu_cluster_dir(const tu_cluster *c);  /* the scratch directory, borrowed */
pid_t tu_broker_pid(const tu_cluster *c);         /* the broker process (0: not running) */
pid_t tu_peer_pid(const tu_cluster *c, int i);    /* peer pI's process (0: not running) */
#define TU_MAX_GATEWAYS 8
/* Starts the cluster's fusion-gateway k (opts.gateways; again on the same endpoints after a stop)
 * and waits (15 s) until it listens; from then on the peers started that go through it and the
 * client (DIR/client.conf, gateway 0) connect to it with its key. Fails the test otherwise. Log:
 * DIR/gwK.log (gwK-2.log, ...). */
void tu_gateway_start(tu_cluster *c, int k);
/* Sends sig to gateway k and reaps it, as tu_broker_stop. */
int tu_gateway_stop(tu_cluster *c, int k, int sig);
pid_t tu_gateway_pid(const tu_cluster *c, int k);
const char *tu_gateway_endpoint(const tu_cluster *c, int k); /* where its peers connect, borrowed */
const char *tu_gateway_log(const tu_cluster *c, int k);      /* its log of its latest start, borrowed */
/* More fusion-broker arguments (space-separated, no quoting) for its next starts. */
void tu_broker_args(tu_cluster *c, const char *args);
const char *tu_cluster_data(const tu_cluster *c); /* the training text's path, borrowed */
int tu_cluster_n_peers(const tu_cluster *c);

/* out = DIR/<fmt, ...>. */
void tu_path(const tu_cluster *c, char out[TU_PATH], const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Prints the tails of the broker's and every peer's log. */
void tu_cluster_show_logs(const tu_cluster *c);

/* ---- keys ------------------------------------------------------------------------------------ */

/* Makes the key pair DIR/name (public.key, secret.key, as `fusion keygen -o DIR/name` does) and adds
 * its public key to the allow-list when `allowed`. Fails the test on error. */
void tu_keygen(tu_cluster *c, const char *name, bool allowed);

/* The Z85 text of DIR/name/public.key into z85; fails the test when it cannot be read. */
void tu_key_public(const tu_cluster *c, const char *name, char z85[41]);

/* Gives key pair DIR/name the roles (allow-list syntax: "client", "peer,trusted", ...) on the
 * allow-list, in place of the line tu_keygen wrote (a bare key: client and peer). Takes effect when
 * the broker next starts. Fails the test when the key is not on the list. */
void tu_allow_roles(tu_cluster *c, const char *name, const char *roles);

/* ---- the broker ------------------------------------------------------------------------------ */

/* Starts the broker, or starts it again on the same endpoint and SQLite file (its log is then
 * broker-2.log, ...), and waits (15 s) until it listens; fails the test otherwise. */
void tu_broker_start(tu_cluster *c);

/* Sends sig to the broker and reaps it (15 s, then SIGKILL): its exit code, 128 + signal when a
 * signal ended it, -1 when it had to be killed, -2 when no broker runs. */
int tu_broker_stop(tu_cluster *c, int sig);

/* A plain TCP connection to the broker's port, for hostile bytes (caller closes); fails the test
 * otherwise. */
int tu_broker_connect_raw(const tu_cluster *c);

bool tu_broker_alive(const tu_cluster *c);                /* the broker runs (not reaped) */
const char *tu_broker_endpoint(const tu_cluster *c);      /* tcp://127.0.0.1:PORT; "" before the first start */
const char *tu_broker_log(const tu_cluster *c);           /* the current broker's log, borrowed */

/* The current broker's log (caller frees; "" when there is none). */
char *tu_broker_log_text(const tu_cluster *c);

/* Whether the current broker's log holds the text fmt, ... */
bool tu_broker_logged(const tu_cluster *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Polls until the current broker's log holds the text fmt, ... (true) or timeout_ms pass (false). */
bool tu_broker_wait_log(const tu_cluster *c, int timeout_ms, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- the peers ------------------------------------------------------------------------------- */

/* Starts peer i (keys pI, --name pI, log DIR/pI.log) with the cluster's peer options and then the
 * extra arguments given (a NULL-terminated list). Does not wait for it to join. */
void tu_peer_start(tu_cluster *c, int i, ...) __attribute__((sentinel));

/* Waits until the current broker's log says peer pI joined; fails the test otherwise. */
void tu_peer_wait_joined(const tu_cluster *c, int i, int timeout_ms);

/* Sends sig to peer i (which must run); a SIGSTOPped peer is remembered so that stopping the cluster
 * sends it SIGCONT first. Fails the test when the signal cannot be sent. */
void tu_peer_signal(tu_cluster *c, int i, int sig);

/* Sends sig to peer i (0: none, it is to exit by itself) and reaps it within timeout_ms (then
 * SIGKILL): its exit code as tu_reap. */
int tu_peer_stop(tu_cluster *c, int i, int sig, int timeout_ms);

/* Index of the peer that the current broker's log says runs stage `stage` of job id ("job ID stage
 * K/N on KEY (pI)"), waiting up to timeout_ms for the plan; fails the test when there is none. */
int tu_stage_peer(const tu_cluster *c, const char *id, int stage, int timeout_ms);
/* The peer index I of a plan line of the broker's log ("job ID stage S/N on KEY (pI): ..."), at its
 * start; -1 when it is not one. */
int tu_plan_line_peer(const char *line);

/* Index of the peer named "pK" (-1 when name is not one). */
int tu_peer_index(const char *name);

/* What `fusion peers --json` says of one peer. */
typedef struct {
    char name[32];
    char state[16];         /* "idle", "busy", "paused", "dead", ... */
    char pause_reason[256]; /* "" when not paused */
    double reputation;
    double link_bps;        /* the link bandwidth the broker plans with */
} tu_peer_seen;

/* Up to cap peers that `fusion peers --json` lists, into seen: how many (-1 when the command
 * failed). */
int tu_peers_list(const tu_cluster *c, tu_peer_seen *seen, int cap);

/* What `fusion peers` says of peer pI; false when it is not listed (or the command failed). */
bool tu_peer_seen_get(const tu_cluster *c, int i, tu_peer_seen *seen);

/* ---- the client ------------------------------------------------------------------------------ */

/* Runs `fusion ARGS` in the cluster's directory with its client configuration; stdout and stderr
 * together in *out (caller frees; out may be NULL); returns the exit code. */
int tu_fusion(const tu_cluster *c, char **out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* `fusion submit ARGS -q`: the job id in id; fails the test otherwise. */
void tu_submit(const tu_cluster *c, char id[TU_ID_LEN], const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* `fusion submit finetune --model MODEL --data DATA OPTS -q`, DATA the cluster's training text: the
 * job id in id; fails the test otherwise. */
void tu_submit_finetune(const tu_cluster *c, char id[TU_ID_LEN], const char *model, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* `fusion wait ID` within timeout_s; fails the test (with the logs) when the job does not end done. */
void tu_wait_done(const tu_cluster *c, const char *id, int timeout_s);

/* `fusion result ID -o DIR/res-ID`; fails the test otherwise. */
void tu_result(const tu_cluster *c, const char *id);

/* What `fusion status ID --json` says: state, steps done, and the name of each stage's peer. */
typedef struct {
    char state[16];
    long step;
    int n_stages;
    char stage_peer[8][32];
    char message[512]; /* the broker's reason (why queued, what recovery does) */
} tu_status;

/* `fusion status ID --json` into st; false when the command failed or said nothing readable. */
bool tu_status_get(const tu_cluster *c, const char *id, tu_status *st);

/* Whether, within timeout_ms, the broker's log says the profile of the peer named `name` was checked
 * ("peer NAME (KEY): claimed ... plans use ...", or its challenge failed). */
bool tu_peer_profile_checked(const tu_cluster *c, const char *name, int timeout_ms);

/* Polls the job until it has done at least `step` steps while running; fails the test when it ends
 * first or timeout_ms pass. Returns the step seen. */
long tu_wait_step(const tu_cluster *c, const char *id, long step, int timeout_ms);

/* The cuts of job id's last plan as `fusion run finetune --cuts` takes them (the first node of every
 * stage but the first, from the broker's explanation "stage S: nodes A-B"), into out; fails the
 * test when the log names no plan of more than one stage. */
void tu_job_cuts(const tu_cluster *c, const char *id, char *out, size_t cap);

/* ---- adapters -------------------------------------------------------------------------------- */

/* Max |a - b| over every tensor of two adapter_model.safetensors files, the number of tensors in
 * *n_tensors; fails the test when their tensor names or sizes differ. */
double tu_adapter_diff(const char *path_a, const char *path_b, size_t *n_tensors);

/* Downloads job id's adapter (tu_result), makes the reference with `fusion run finetune --threads 1`
 * on model_dir with train_args (DIR/ref-ID) and returns the max abs difference over every tensor
 * (printed). Fails the test when a step fails. */
double tu_job_vs_reference(const tu_cluster *c, const char *id, const char *model_dir, const char *train_args);

/* The largest difference between a pipeline's adapter and `fusion run finetune`'s that counts as the
 * same adapter. */
#define TU_ADAPTER_TOL 1e-5

/* tu_job_vs_reference, and fails the test when the difference is over TU_ADAPTER_TOL. */
void tu_assert_same_adapter(const tu_cluster *c, const char *id, const char *model_dir, const char *train_args);

/* Job id's adapter against `fusion run finetune --threads THREADS`'s: fails the test unless every
 * tensor has the same bits (docs/DAG.md "Determinism"). */
void tu_assert_identical_adapter(const tu_cluster *c, const char *id, const char *model_dir, const char *train_args,
                                 int threads);

/* ---- processes, files, directories ---------------------------------------------------------------- */

/* fork + exec argv[0] with stdout and stderr appended to log and, when env is not NULL, the
 * environment variable env ("NAME=VALUE") set; the child dies with this process. Recorded until
 * reaped. Fails the test when fork fails. */
pid_t tu_spawn(const char *log, char *const argv[], const char *env);

/* tu_spawn with the child's stdout on out_fd (the write end of a pipe the test reads) and its
 * stderr appended to log. */
pid_t tu_spawn_piped(const char *log, char *const argv[], int out_fd);

/* Waits up to timeout_ms for pid to exit: its exit code, 128 + signal when a signal ended it; -1
 * when it had to be killed (SIGCONT, SIGKILL, reaped), -2 when it is not a child of this process. */
int tu_reap(pid_t pid, int timeout_ms);

/* A fresh scratch directory $TMPDIR/fusion-TAG-XXXXXX (caller frees); fails the test otherwise. */
char *tu_dir_new(const char *tag);

/* The broker's /metrics (started with --http 127.0.0.1:0, tu_broker_args): the port its log names,
 * the text scraped with curl (caller frees; fails the test when it cannot), and the value of the
 * sample named exactly `name`, labels included (-1 when absent). */
int tu_metrics_port(const tu_cluster *c);
char *tu_metrics_scrape(const tu_cluster *c);
double tu_metric(const char *text, const char *name);

/* Removes dir and everything under it. */
void tu_dir_remove(const char *dir);

/* The contents of path (caller frees; "" when it cannot be read). */
char *tu_file_text(const char *path);

/* Writes text and a newline to path, mode 0600 (a token file); fails the test otherwise. */
void tu_file_write_private(const char *path, const char *text);

/* Polls until the file holds needle (true) or timeout_ms pass (false). */
bool tu_file_wait(const char *path, const char *needle, int timeout_ms);

/* Prints the last `lines` lines of path. */
void tu_file_show(const char *path, int lines);

/* ---- running the tests --------------------------------------------------------------------------- */

/* cmocka teardown of the process tests: stops the competing load (tu_load_stop), kills and reaps
 * every process started here and not reaped yet, frees every cluster not stopped, keeping its
 * directory (path printed). Reads static memory only: a cluster's test function is gone by then. */
int tu_teardown(void **state);

/* The main of a process test: ignores SIGPIPE, initialises libsodium and runs the tests whose
 * names match argv[1] (cmocka's test filter: `*` and `?`; ctest registers one entry per test or
 * group of tests), or all of them without an argument. 2 when argv[1] matches no test. */
int tu_main(int argc, char **argv, const char *group, const struct CMUnitTest *tests, size_t n,
            int (*setup)(void **), int (*teardown)(void **));
#define tu_run_tests(argc, argv, tests, setup, teardown) \
    tu_main((argc), (argv), #tests, (tests), sizeof(tests) / sizeof((tests)[0]), (setup), (teardown))

/* Outside cmocka (bench-pipeline): from now on a failure prints its message and exits 1. */
void tu_fail_exits(void);

/* Ends the running test with the message (see the top); never returns. */
void tu_fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

#ifdef __cplusplus
}
#endif

#endif
