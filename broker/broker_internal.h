/* broker_internal: the state the broker's modules share. Everything here is owned by the loop's
 * thread (broker.c); no locking. */
#ifndef FU_BROKER_INTERNAL_H
#define FU_BROKER_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "broker.h"
#include "broker_http.h"
#include "broker_auth.h"
#include "broker_losshist.h"
#include "broker_models.h"
#include "broker_quota.h"
#include "broker_upload.h"
#include "broker_worker.h"
#include "dag_graph.h"
#include "dag_partition.h"
#include "dag_spec.h"
#include "db.h"
#include "fu_challenge.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "fu_tokenizer.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_zap.h"

/* Ignores a must-check result whose failure the store already logged (events, peer states). */
#define BROKER_IGNORE(x)      \
    do {                      \
        fu_err ign_ = (x);    \
        (void)ign_;           \
    } while (0)

#define BROKER_SPEC_MODEL_MAX 1024  /* longest model path in a spec */
#define BROKER_ENDPOINT_MAX   256   /* longest data endpoint */
#define BROKER_NUMERIC_CLASS_MAX 159 /* longest PeerProfile.numeric_class */
#define BROKER_MODEL_ID_MAX   80    /* "m:" + 64 hex */
#define BROKER_PAUSE_REASON_MAX 200 /* longest pause reason kept from a heartbeat */
#define BROKER_PAUSE_EVENT_MS   60000 /* a peer's pause events are stored at most this often */
/* Reputations are sums of decimal penalties (1.0 - 16 x 0.05 is 0.1999...98 in binary): compare with
 * the threshold to within this, so that a peer exactly at the threshold stays trusted. */
#define BROKER_REPUTATION_EPS   1e-9

#define BROKER_MAX_PEER_GFLOPS  2e6   /* a profile claiming more f32 GEMM GFLOP/s than this is refused (the
                                         fastest single accelerators are ~100x below it) */
#define BROKER_MAX_PEER_MEMORY  (16ull << 40) /* ... or more bytes of memory than this */

_Static_assert(BROKER_MODEL_HASH_LEN == DB_HASH_LEN && BROKER_MODEL_ID_LEN == DB_MODEL_ID_LEN,
               "model ids and hashes are stored as they are made");

/* Where a peer is in its profile challenge (broker_challenge.c). */
typedef enum {
    BCH_NONE = 0,   /* none under way (a new registration, or waiting to try again after a timeout) */
    BCH_PREPARING,  /* PREPARE sent */
    BCH_COMPUTING,  /* GO sent: the clock runs */
    BCH_REVEALING,  /* REVEAL sent */
    BCH_PASSED,     /* its speed is verified (or challenges are off): it may get work */
    BCH_FAILED,     /* a wrong or refused answer: no work for this registration */
} broker_ch_state;

/* A peer the broker has heard from since it started. */
typedef struct {
    char key[DB_KEY_LEN + 1];          /* the identity: pk itself for slot 0, else broker_peer_id's name */
    char pk[DB_KEY_LEN + 1];           /* z85 public key of its connection: roles, sealing, the same machine */
    uint32_t slot;                     /* which slot of its peer process (fusion-peer --slots), 0 for the first */
    uint32_t n_slots;                  /* how many its process runs (PeerHello.slots; 1 when it said none) */
    uint8_t rid[WIRE_MAX_ROUTING_ID];  /* routing id of its current connection */
    size_t rid_len;                    /* its length */
    char name[DB_NAME_MAX + 1];        /* display name */
    char device[128];                  /* device name from its profile */
    char numeric_class[BROKER_NUMERIC_CLASS_MAX + 1]; /* its profile's: peers of one non-empty class give the same
                                                         bits, and verification compares exact hashes */
    uint8_t class_id[16];              /* BLAKE2b-128 of numeric_class (all zero when it is empty) */
    Fusion__Backend backend;           /* cpu or cuda */
    double gflops;                     /* f32 GEMM GFLOP/s plans use: min(claimed, slack x verified) */
    double claimed_gflops;             /* what its profile said (the best f32, else any dtype) */
    double verified_gflops;            /* what its profile challenge measured (0: not yet) */
    /* The profile challenge (broker_challenge.c). */
    broker_ch_state ch;                /* where it is */
    uint32_t ch_round, ch_n;           /* its round number and matrix size */
    uint8_t ch_seed[FU_CHALLENGE_SEED_BYTES], ch_go[FU_CHALLENGE_SEED_BYTES];
    uint8_t ch_commit[FU_CHALLENGE_COMMIT];
    uint32_t ch_rows[FU_CHALLENGE_ROWS]; /* the rows asked for in REVEAL */
    uint64_t ch_pick;                  /* seed of the entries checked in them */
    uint64_t ch_sent_ns;               /* when the current step was sent (fu_clock_ns) */
    uint64_t ch_retry_ms;              /* BCH_NONE: start (again) at this broker_now */
    uint64_t mem_bytes;                /* memory it offers */
    double link_bw;                    /* bytes/s */
    bool link_measured;                /* link_bw came from the peer's measurement */
    uint64_t probe_ms;                 /* last LinkProbe sent to it (broker_now), 0: none */
    double link_latency_ms;            /* round trip ms */
    uint32_t threads;                  /* compute threads */
    char endpoint[BROKER_ENDPOINT_MAX]; /* data endpoint, "" when relayed */
    bool relay;                        /* needs the broker to relay its data frames */
    bool live;                         /* registered and not dead or gone */
    uint64_t session;                  /* PeerHello.session of its registration (0: none given) */
    bool trusted;                      /* the allow-list marks it trusted (may run the stages that see tokens) */
    bool draining;                     /* sent Leave: takes no new work */
    uint64_t last_heard_ms;            /* monotonic time of its last message */
    int64_t joined_ms;                 /* wall time of its registration */
    char job[DB_JOB_ID_LEN + 1];       /* job it works for, "" when idle */
    uint32_t stage;                    /* stage it runs or backs up */
    bool backup;                       /* it is a (warm) backup, not running */
    bool warm;                         /* backup that reported StageReady */
    double reputation;                 /* from the store, in [0, 1] */
    uint32_t v_checked, v_failed;      /* verification samples it took part in / was found wrong in */
    uint32_t v_mismatch;               /* samples where its account of a stage input differed (see broker_verify.c) */
    char lacked[DB_JOB_ID_LEN + 1];    /* a job whose blob, named by this peer's assignment, the broker could not
                                          serve it (missing, store error): the load failure the peer reports next
                                          is the broker's fault, not the peer's (broker_stages.c); "" when none */
    /* Fine-tuning progress from its last heartbeat (broker_failover.c: which stage stalled). */
    char prog_job[DB_JOB_ID_LEN + 1];  /* the job it was for, "" when none reported */
    uint64_t prog_step;                /* step worked on, plus 1 */
    uint32_t prog_fwd, prog_bwd;       /* micro-batches of it through forward / backward */
    uint64_t prog_ms;                  /* when it came (broker_now) */
    /* Paused by its owner's machine (heartbeats say PEER_STATE_PAUSED): alive, keeps its stage up to
     * the grace period, computes nothing meanwhile, and gets no new work. */
    bool paused;                       /* its last heartbeat said paused */
    uint64_t paused_since_ms;          /* since when (broker_now) */
    char pause_reason[BROKER_PAUSE_REASON_MAX + 1]; /* why, as it said (printable ASCII) */
    uint64_t pause_event_ms;           /* last peer-paused / peer-resumed event stored (broker_now) */
    bool lease_due;                    /* beat while it runs a stage: its lease is extended at the next
                                          sweep, with every other one in one commit */
    /* Its connection (broker_conn.c): a crashed peer's connection closes at once, its heartbeats
     * would take dead_after_ms to tell. */
    int conn_fd;                       /* descriptor + 1 of the connection it was last heard on, 0: none */
    uint64_t closed_ms;                /* when that connection was seen to close (broker_now), 0: not */
    uint32_t closed_epoch;             /* its descriptor's epoch then: a later message on that descriptor in
                                          the same epoch is a late one of the closed connection */
    uint64_t closed_route;             /* through a gateway: a hash of the closed connection's route (a
                                          later message on that route is a late one), 0: none */
} broker_peer;

/* A descriptor of the ROUTER's connections, as its socket monitor and the messages read tell
 * (broker_conn.c). */
typedef struct {
    uint32_t epoch;                    /* connections accepted on it so far (descriptors are reused) */
    uint32_t peer;                     /* index + 1 in peers of the peer last heard on it, 0: none */
} broker_conn;

/* A peer whose connection closed, judged when its grace is over (broker_conn.c). */
typedef struct {
    uint32_t peer;                     /* index in peers */
    uint64_t closed_ms;                /* its closed_ms when queued: a hearing or a newer close supersedes */
    uint64_t due_ms;                   /* broker_now when the grace is over */
} broker_closing;


/* A job stage as the loop tracks it. */
typedef struct {
    uint32_t first, last;              /* DAG node range [first, last) */
    char peer[DB_KEY_LEN + 1];         /* who runs it, "" when nobody */
    bool ready;                        /* StageReady received for the current assignment */
    uint64_t assigned_ms;              /* monotonic time the current StageAssign was sent (ready deadline) */
    int64_t final_ckpt_step;           /* newest checkpoint step committed */
    /* a checkpoint being received */
    uint8_t *ck_buf;                   /* assembly buffer, NULL when none */
    uint64_t ck_total, ck_got, ck_step; /* size, bytes so far, step */
    uint8_t ck_hash[DB_HASH_LEN];      /* announced BLAKE2b-256 */
    /* A peer that reported this stage's step faster than its verified speed allows (broker_stages.c):
     * while it holds the stage, every micro-batch of it is verified. */
    char too_fast[DB_KEY_LEN + 1];
} broker_jstage;

typedef enum {
    BJ_QUEUED = 0,   /* waiting for peers (reason says why) */
    BJ_STARTING,     /* stages assigned, waiting for every StageReady */
    BJ_RUNNING,      /* StageStart sent */
    BJ_RECOVER_WAIT, /* restarted broker: waiting for peers to come back before recovery */
} broker_phase;

/* Where an answer to a request goes (its connection, sequence, job and type), kept while the
 * request is prepared off the loop. */
typedef struct {
    uint8_t rid[WIRE_MAX_ROUTING_ID];
    size_t rid_len;
    uint64_t sequence, job_id;
    Fusion__MsgType type;
    char uid[DB_KEY_LEN + 1];
} broker_ret;

#define BROKER_JOB_WAITERS 8      /* long-polled status requests one job holds (more are answered at once) */
#define BROKER_WAIT_MAX_MS 2000u  /* the longest a status request is held */

/* A status request held until its job's output changes (JobRef.wait_ms): who to answer, by when. */
typedef struct {
    broker_ret ret;
    uint64_t deadline_ms;
} broker_waiter;

/* A serving job's sessions (broker_serve.c). */
typedef struct broker_serve broker_serve;

/* A queued or running job. */
typedef struct {
    char id[DB_JOB_ID_LEN + 1];        /* hex id */
    uint64_t id64;                     /* the same as a number (Envelope.job_id) */
    char owner[DB_KEY_LEN + 1];        /* submitter */
    db_job_kind kind;                  /* finetune, infer or eval */
    dag_spec spec;                     /* parsed spec (dag_spec owns the format) */
    char *spec_json;                   /* spec text as submitted (and stored) */
    char *spec_canon;                  /* what peers get: dag_spec_to_json of spec without the model path */
    int32_t *tokens;                   /* tokenized data / prompt */
    size_t n_tokens;                   /* count */
    uint8_t tokens_hash[DB_HASH_LEN];  /* BLAKE2b-256 of the tokens' bytes */
    dag_graph_t *graph;                /* the job's DAG */
    uint8_t *dag_bytes;                /* encoded */
    size_t dag_len;                    /* its length */
    broker_model *model;               /* its model, by content (a reference: broker_models.h) */
    broker_phase phase;                /* where it is */
    uint32_t n_stages;                 /* stages in the plan (0 while queued without a plan) */
    broker_jstage stages[BROKER_MAX_STAGES];
    uint64_t start_step;               /* step (or position) of the current run */
    uint64_t steps_done;               /* progress */
    double loss;                       /* latest loss */
    uint32_t retries;                  /* recoveries since the last progress */
    char reason[DB_REASON_MAX];        /* why it waits */
    uint64_t recover_at_ms;            /* BJ_RECOVER_WAIT: monotonic time to recover */
    /* eval: the sums of the steps reported in order since the run started (from step 0 each time) */
    double eval_sum;                   /* of the counted targets' losses */
    uint64_t eval_targets;             /* targets counted */
    /* inference */
    int32_t *gen;                      /* generated tokens */
    size_t n_gen, cap_gen;
    char *output;                      /* decoded generated text (NUL-terminated) */
    broker_serve *serve;               /* a serving job's sessions (spec.sessions > 0), NULL until one opens */
    broker_waiter waiters[BROKER_JOB_WAITERS]; /* status requests held until the output changes */
    uint32_t n_waiters;
    uint8_t *logits;                   /* infer with dump_logits: float32 logits of every prompt
                                          position (positions × vocab, little-endian), or NULL */
    size_t logits_len;                 /* bytes */
    fu_tokenizer *tok;                 /* the model's tokenizer (infer: decode output) */
    int64_t eos[FU_MODELCFG_MAX_EOS];  /* the ids that end a generation (config.json's, else the tokenizer's) */
    size_t n_eos;                      /* how many */
    bool no_ring;                      /* the last stage sends its tokens only through the broker: it sent
                                          stage 0 another token than it reported (ERR_CONFLICT) */
    uint64_t last_step_ms;             /* monotonic time of the last StepDone (throughput) */
    uint64_t progress_ms;              /* monotonic time of the last sign of progress: StageStart, StepDone,
                                          InferToken, a committed checkpoint (step deadline) */
    uint64_t pause_held_ms;            /* time since that progress that a paused peer held j (pause_hold):
                                          not counted against the step deadline, at most the grace */
    uint64_t pause_progress_ms;        /* the progress_ms pause_held_ms counts from */
    uint64_t pause_last_ms;            /* last sweep that held j (0: the previous sweep did not) */
    double slowest_s;                  /* slowest step (fine-tune) or token gap (inference) seen, seconds */
    bool stepped;                      /* a step or token came since the last StageStart */
    uint64_t sched_tried;              /* the planning round it was last tried in */
    uint32_t plan_stale;               /* its searches in a row whose chosen peers changed meanwhile */
    bool cutting;                      /* planned (queued, its peers taken): the writer cuts its checkpoint
                                          for the plan and stores both; kept, even dead, until it is back */
    bool growing;                      /* its growth search is on the planner (grow_task reads its graph) */
    uint32_t runs;                     /* runs started (broker_job_starting): a growth search of an older
                                          run is stale */
    bool finishing;                    /* a fine-tune whose every stage is done: the writer assembles its
                                          adapter and commits it as the result; nothing else moves it
                                          meanwhile (no failover, no deadline); kept, even dead, until
                                          it is back */
    uint64_t plan_failed_on;           /* what its last plan that found none was made over (plan_inputs;
                                          0: none failed): the same candidates are not searched again */
    bool ends_trusted;                 /* its first and last stages are kept on trusted peers (decided when
                                          it is planned: spec trusted_ends, or a trusted peer registered) */
    bool after_restart;                /* resumed by a restarted broker and no step since: what goes wrong
                                          now is the outage's doing, not a peer's (no reputation lost) */
    char excluded[BROKER_JOB_EXCLUDE_MAX][DB_KEY_LEN + 1]; /* peers taken off this job for missing a
                                          deadline: never picked for it again ("excluded" events
                                          keep them across restarts) */
    uint32_t n_excluded;               /* how many */
    bool dead;                         /* finished or removed: free at the next sweep */
    uint32_t v_agree, v_disagree, v_skipped; /* verification samples: agreed, disagreed, not run */
    uint64_t v_no_verifier;            /* bit s: "no warm backup to verify stage s with" was logged */
    uint32_t v_mismatch;               /* samples left inconclusive: the two peers used different inputs */
} broker_job;

/* What the broker has counted since it started (its /metrics; broker_metrics.c). */
typedef struct {
    uint64_t relayed_bytes;            /* bytes of the frames relayed between peers */
    uint64_t heartbeats;               /* peers' heartbeats handled */
    uint64_t steps;                    /* fine-tune steps reported done */
    double step_s_sum;                 /* the time those steps took, seconds */
    uint64_t trained_tokens;           /* tokens those steps trained on */
    uint64_t generated_tokens;         /* tokens generated by inference jobs */
    uint64_t sessions_opened;          /* serving jobs' sessions opened, and how they ended */
    uint64_t sessions_done, sessions_failed, sessions_closed;
    uint64_t failovers;                /* stages moved to another peer */
    uint64_t conn_deaths;              /* peers declared dead because their connection closed */
    uint64_t conn_reheard;             /* peers whose connection closed and that were heard again in time */
    uint64_t gateway_refused;          /* messages through a gateway whose key lost the gateway role */
    uint64_t plans;                    /* jobs planned (a plan assigned) */
    uint64_t plans_failed;             /* searches that found no plan that fits */
    uint64_t plans_skipped;            /* searches not made: the candidates of a job's failed one again */
    uint64_t plans_stale;              /* searches whose chosen peers changed while they ran: made again */
    double plan_s_sum, plan_s_max;     /* seconds those planning passes took, in all and the longest */
    uint64_t v_agree, v_disagree, v_mismatch, v_skipped; /* verification samples of the jobs gone from
                                          memory (the live jobs count their own) */
    db_compact_stats compacted;        /* compaction: what it removed in all (seconds: its time in all) */
    double compact_s_max;              /* the longest compaction turn, seconds */
    uint64_t compact_turns;            /* compaction turns (db_compact calls) */
    uint64_t cuts;                     /* re-plans' checkpoints cut and stored with their plan (the writer) */
    double cut_s_sum, cut_s_max;       /* seconds those took on the writer, in all and the longest */
    double turn_s_max;                 /* the loop's longest turn (poll to poll, the wait not counted) */
    uint64_t turns_slow;               /* its turns of BROKER_TURN_SLOW_MS or more */
} broker_totals;

/* One verification sample in flight (docs/PIPELINE.md "Verification"): who was asked for the
 * sketch of (job, stage, step, micro-batch) with which seed, and what came back. Slot 0 is the
 * stage's peer, 1 the verifier, 2 a third opinion (asked only after a disagreement). For a stage
 * k > 0 the peer of stage k-1 (`up`) delivers the input to slots 1 and 2 through the broker. */
typedef struct {
    bool used;                         /* slot in use */
    char job[DB_JOB_ID_LEN + 1];       /* the job */
    uint64_t job64;                    /* the same as a number */
    uint32_t stage;                    /* the stage checked */
    uint64_t step;                     /* training step */
    uint32_t mb;                       /* micro-batch */
    uint64_t seed;                     /* seed of the +-1 vectors */
    char who[3][DB_KEY_LEN + 1];       /* peers asked ("" for none) */
    bool have[3];                      /* their sketch came back */
    double sk[3][WIRE_VERIFY_SKETCH_K]; /* the sketches */
    double norm[3];                    /* the output norms */
    uint8_t ih[3][WIRE_VERIFY_HASH_BYTES]; /* the input hashes they reported */
    uint8_t oh[3][WIRE_VERIFY_HASH_BYTES]; /* the output hashes they reported (when has_oh) */
    bool has_oh[3];                    /* an output hash came back */
    uint8_t cls[3][16];                /* BLAKE2b-128 of the answering peer's numeric class (when has_cls) */
    bool has_cls[3];                   /* the peer promised a numeric class */
    bool bad[3];                       /* a malformed answer (counts as a wrong one) */
    char up[DB_KEY_LEN + 1];           /* stage > 0: the upstream peer asked to deliver the input; "" for stage 0 */
    bool fed[3];                       /* slots 1, 2: the last chunk of their input was forwarded */
    uint64_t deadline_ms;              /* monotonic time after which the sample is dropped */
    int snap;                          /* 1 + the index of the snapshot (b->snaps) the verifiers restore; 0: a
                                          checkpoint. The verifier is asked once the snapshot is in. */
    uint64_t asked_ms;                 /* when it was taken (broker_now, at the StepDone of its step) */
    uint64_t done;                     /* the most steps the job's last stage has reported done (StepDone step + 1)
                                          since: how far the broker knows the pipeline moved past the sample */
    uint64_t evict_by_ms;              /* the stage's peer (k < last) said it no longer holds the output while
                                          `done` did not show the pipeline WIRE_VERIFY_KEEP_STEPS past it: withheld
                                          unless a StepDone shows that by then (0: no such answer) */
} broker_vsample;

/* A verification snapshot: the state of a stage at the start of a step without a checkpoint,
 * uploaded by the stage's peer (CheckpointPut.snapshot) for the verifiers of that step's samples,
 * served as job blob vsnap:<stage>:<step>, dropped when no sample in flight needs it. */
typedef struct {
    bool used;
    uint64_t job64;                    /* the job */
    uint32_t stage;
    uint64_t step;
    char peer[DB_KEY_LEN + 1];         /* the stage's peer: the only one that may upload it */
    uint8_t *buf;                      /* assembly buffer, then the snapshot */
    uint64_t total, got;               /* size, bytes so far */
    uint8_t hash[DB_HASH_LEN];         /* announced BLAKE2b-256 */
    bool complete;                     /* in whole, hash and tensors checked */
} broker_snap;

/* A gateway heard from (its GatewayHello): where the broker's admission changes are sent. */
#define BROKER_GATEWAYS_MAX 64
typedef struct {
    uint8_t id[WIRE_MAX_ROUTING_ID]; /* its routing id on gw_sock */
    uint8_t id_len;
    uint64_t hello_ms;               /* its last GatewayHello (the oldest makes room) */
} broker_gw;

struct broker {
    broker_cfg cfg;                    /* options (strings borrowed from argv) */
    char data_dir[DB_PATH_MAX];        /* scratch directory */
    uint32_t dead_after_ms;            /* BROKER_DEAD_FACTOR × heartbeat */
    void *ctx;                         /* ZeroMQ context */
    void *sock;                        /* the ROUTER */
    void *gw_sock;                     /* the gateways' ROUTER (--gateway-bind), or NULL */
    broker_gw gws[BROKER_GATEWAYS_MAX]; /* the gateways that said GatewayHello (broker_gateways.c) */
    uint32_t n_gws;
    uint8_t *probe_zeros;              /* LinkProbe payload (made on first use) */
    wire_zap_t *zap;                   /* ZAP handler */
    wire_keypair_t *kp;                /* the broker's keys */
    db_t *db;                          /* the store */
    broker_http_t *http;               /* the --http listener, NULL when off */
    wire_counters counters;            /* receive counters */
    broker_peer *peers;                /* registry */
    size_t n_peers, cap_peers;
    bool leases_due;                   /* some peer's lease_due is set */
    uint64_t drained_ms;               /* broker_now when a turn of the loop last read the socket empty: a
                                          peer is silent only if nothing of it came before then */
    void *mon;                         /* PAIR reading the ROUTER's monitor (accepted, disconnected); NULL:
                                          off, peers go by their heartbeats alone */
    broker_conn *conns;                /* by descriptor, n_conns of them */
    size_t n_conns;
    broker_closing *closing;           /* closed connections in their grace, due in order: [closing_head,
                                          n_closing) */
    size_t n_closing, closing_head, cap_closing;
    uint32_t close_grace_ms;           /* how long a peer whose connection closed has to be heard again */
    uint32_t *peer_index;              /* open-addressing hash of peers[].key: index + 1, 0 empty
                                          (broker_registry.c); a power of two at least twice n_peers */
    size_t peer_index_cap;
    broker_job **jobs;                 /* queued and running jobs */
    size_t n_jobs, cap_jobs;
    broker_models *models;             /* the models served, by content id */
    broker_uploads *uploads;           /* models clients upload; NULL: uploads off */
    broker_worker *worker;             /* job preparation off the loop */
    broker_worker *planner;            /* plan searches off the loop (broker_sched.c, broker_grow.c), one at a time */
    broker_job *planning;              /* the job whose search is on the planner now (kept, even dead), NULL */
    uint32_t n_growing;                /* growth searches on the planner or waiting for it (BROKER_GROWS_MAX) */
    dag_partition_ws *plan_ws;         /* the planner thread's search memory, kept between its searches */
    dag_partition_ws *loop_ws;         /* the loop's, for its own searches (a running job's growth) */
    broker_worker *writer;             /* large writes off the loop: peers' checkpoints (broker_stages.c), re-plans'
                                          checkpoint cuts with their plans (broker_ckpt.c) */
    db_t *writer_db;                   /* the writer's own connection to the store */
    db_t *worker_db;                   /* the preparation worker's: it stores the submissions it prepared */
    size_t writer_bytes;               /* checkpoint bytes posted to the writer and not back yet */
    bool sched_changed;                /* the scheduler was asked for while a search ran: a new round next */
    broker_quota *quota;               /* per-client submission rate and preparations */
    broker_quota *session_quota;       /* per-client rate of sessions opened in serving jobs */
    broker_auth *auth;                 /* failed enrolments by address, and bans */
    broker_losses *losses;             /* fine-tunes' loss curves (GET /api/jobs/JOB/loss), memory only */
    bool sched_dirty;                  /* something changed: run the scheduler */
    uint64_t sched_round;              /* planning round: a job is tried once per round (sched_tried) */
    bool sched_resume;                 /* the last pass was cut short: go on with the same round */
    uint64_t next_sweep_ms;            /* next liveness / lease sweep */
    uint64_t next_compact_ms;          /* next compaction of the store (compact() in broker.c) */
    db_compact_policy compact;         /* what it keeps (from the configuration) */
    uint64_t store_deep_ms;            /* when /metrics last read the figures that scan every job (0: never) */
    int64_t store_ended, store_purged; /* what they were: ended jobs, purged jobs */
    uint64_t started_ms;               /* monotonic start time */
    uint64_t relayed;                  /* frames relayed */
    broker_totals tot;                 /* counts since start, for /metrics (broker_metrics.c) */
    uint8_t verify_key[32];            /* random key of the sample selection (peers cannot predict it) */
    uint32_t ch_rounds;                /* profile challenges started (each gets the next number) */
    broker_vsample vs[BROKER_VERIFY_MAX]; /* verification samples in flight */
    broker_snap snaps[BROKER_VERIFY_SNAPS]; /* verification snapshots */
};

/* The modules, from the bottom up; each calls only those above it in this list (docs/BROKER.md
 * "Modules"): io ← registry ← job ← sched ← failover ← the handlers (peers, stages, verify, blobs,
 * jobs) ← conn ← broker.c (the loop and dispatch). */

/* ---- broker_io.c: clocks and sending ---- */
/* Sends body of type t to a peer (by its current routing id); logs and returns the error. */
/* The socket that reaches routing id rid: the gateways' for a route (wire_route_is), else the ROUTER. */
void *broker_sock_for(const broker_t *b, const uint8_t *rid, size_t rid_len);
fu_err broker_send_peer(broker_t *b, const broker_peer *p, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body);
void broker_ret_of(const wire_msg_t *msg, broker_ret *r);
/* Answers the request r with a body of type t, or with Error{code, text}. */
fu_err broker_answer(broker_t *b, const broker_ret *r, Fusion__MsgType t, const ProtobufCMessage *body);
void broker_answer_error(broker_t *b, const broker_ret *r, Fusion__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Answers msg with a body of type t. */
fu_err broker_reply(broker_t *b, const wire_msg_t *msg, Fusion__MsgType t, const ProtobufCMessage *body);
/* Answers msg with Error{code, text}. */
void broker_reply_error(broker_t *b, const wire_msg_t *msg, Fusion__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Refuses the WeightRequest wr (in msg) with Error{code, text} naming wr's blob: a peer tells a late
 * refusal of an earlier fetch from one of the fetch it waits on. */
void broker_refuse_blob(broker_t *b, const wire_msg_t *msg, const Fusion__WeightRequest *wr, Fusion__ErrorCode code,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Makes the string s valid UTF-8 in place (wire_utf8_clean: every byte that does not start a valid
 * character becomes '?'; a snprintf that cut a character in two). */
#define broker_utf8_trim(s) wire_utf8_clean((s), strlen(s))
uint64_t broker_now(void);  /* monotonic ms */
int64_t broker_wall(void);  /* Unix ms */

/* ---- broker_registry.c: the peers ---- */
/* The peer named key (its identity: broker_peer.key), NULL when none. */
broker_peer *broker_peer_find(broker_t *b, const char *key);
/* The identity of slot `slot` of the peer process with public key pk (z85): pk itself for slot 0,
 * else the z85 of BLAKE2b-256("fusion slot" || key || slot as 4 little-endian bytes), which names
 * it alike in the store and on the wire (PeerWelcome.peer_id, Neighbour.peer_id). */
void broker_peer_id(const char *pk, uint32_t slot, char out[DB_KEY_LEN + 1]);
/* The identity of msg's sender: its authenticated key and Envelope.slot; false when the slot is out
 * of range (BROKER_MAX_SLOTS) or the key is not z85. */
bool broker_msg_peer_id(const wire_msg_t *msg, char out[DB_KEY_LEN + 1]);
/* Whether a and b are slots of one peer process (one key: one machine, one owner). */
bool broker_peer_same_key(const broker_peer *a, const broker_peer *b);
/* Stores p's profile (its verified speed and session included) in the store; failures are logged. */
void broker_peer_store_profile(broker_t *b, const broker_peer *p);
/* Checks what a PeerHello claims (texts, a believable profile, an endpoint); FU_EINVAL with why. */
FU_MUST_CHECK fu_err broker_peer_hello_check(const Fusion__PeerHello *h, fu_errmsg *em);
/* Registers (or renews) slot `slot` of key pk from a checked PeerHello on connection rid: idle, live, stored.
 * FU_EAGAIN when the table is full of live peers; the store's error when it failed. */
FU_MUST_CHECK fu_err broker_peer_admit(broker_t *b, const char *pk, uint32_t slot, const Fusion__PeerHello *h,
                                       const uint8_t *rid, size_t rl, broker_peer **out, fu_errmsg *em);
/* What a heartbeat tells: free memory, its stage's progress, a pause, its link; marks its lease to be
 * extended at the next sweep. */
void broker_peer_heartbeat(broker_t *b, broker_peer *p, const Fusion__Heartbeat *hb);
/* Extends, in one commit, the leases of every peer that beat since the last call while it ran a
 * stage (broker_peers_sweep calls it first). */
void broker_peer_leases_flush(broker_t *b);
/* Idle, warm (a backup that is ready) or busy, as the wire says it. */
Fusion__PeerState broker_peer_wire_state(const broker_peer *p);
/* p is gone (left or dead): stored with an event (naming job, may be ""), no work, not live. */
void broker_peer_set_gone(broker_t *b, broker_peer *p, bool left, const char *job, const char *why);
/* p takes stage `stage` of j, as its runner or as a backup (stored as active or backup). */
void broker_peer_take(broker_t *b, broker_peer *p, const broker_job *j, uint32_t stage, bool backup);
/* p holds no work any more (in memory; its stage, if any, is the caller's to hand on). */
void broker_peer_forget_work(broker_peer *p);
/* Takes p (working on j) off the job: StageRelease{reason} when it is live, back to the backup
 * state in the store, free for the scheduler. */
void broker_peer_release(broker_t *b, broker_job *j, broker_peer *p, const char *reason);
/* Adds delta to p's reputation (stored; clamped to [0, 1]). */
void broker_peer_reputation_adjust(broker_t *b, broker_peer *p, double delta);
/* True when p may be given work (live, not draining, reputation at or above the threshold). */
bool broker_peer_trusted(const broker_t *b, const broker_peer *p);
/* Trusted, holding no work and not paused. */
bool broker_peer_free(const broker_t *b, const broker_peer *p);
/* True when p is named in the stored plan of a job a restarted broker is about to recover. */
bool broker_peer_reserved(const broker_t *b, const broker_peer *p);
/* Free and not reserved: the scheduler may give it work. */
bool broker_peer_idle(const broker_t *b, const broker_peer *p);

/* ---- broker_serve.c: the sessions of serving jobs ---- */
void broker_on_session_open(broker_t *b, const wire_msg_t *msg);
/* SessionRef: a status (close false) or SessionClose (close true). */
void broker_on_session_status(broker_t *b, const wire_msg_t *msg, bool close);
/* A token of session t->session of serving job j from its last stage (checked: j's last stage). */
void broker_serve_on_token(broker_t *b, broker_job *j, const wire_msg_t *msg, const Fusion__InferToken *t);
/* j's stages started (StageStart sent): every open session is started on them again. */
void broker_serve_started(broker_t *b, broker_job *j);
/* j ended (done, failed, cancelled): its open sessions end with why. */
void broker_serve_ended(broker_t *b, broker_job *j, const char *why);
/* Answers the long polls whose wait is over and forgets sessions that ended a while ago. */
void broker_serve_sweep(broker_t *b, broker_job *j);
/* Sessions of j that are generating. */
uint32_t broker_serve_open_count(const broker_job *j);
void broker_serve_free(broker_serve **svp);

/* ---- broker_job.c: the jobs and their state machine ---- */
broker_job *broker_job_new(db_job_kind kind);
/* Puts j in the table (the table owns it from then on). */
void broker_job_add(broker_t *b, broker_job *j);
broker_job *broker_job_find(broker_t *b, const char *id);
broker_job *broker_job_find64(broker_t *b, uint64_t id);
void broker_job_free(broker_job **j_p);
/* Removes jobs marked dead from the table. */
void broker_jobs_reap(broker_t *b);
const char *broker_phase_name(broker_phase p);
/* The transitions. Each stores the job's state and reason in one commit (or none when they did not
 * change) and logs. */
/* A new job, stored queued by db_job_submit: queued, in the table (no second commit). */
void broker_job_enqueue(broker_t *b, broker_job *j);
/* A job read back after a restart that was running: wait until at_ms for its peers. */
void broker_job_recover_wait(broker_t *b, broker_job *j, uint64_t at_ms);
/* A plan for j: its stages, stored with the move to running in one commit (nothing changes in
 * memory when the store refuses). */
FU_MUST_CHECK fu_err broker_job_planned(broker_t *b, broker_job *j, const db_stage_plan *plan, size_t n);
/* The in-memory half of broker_job_planned, for a plan stored already (by the writer). */
void broker_job_plan_stored(broker_job *j, const db_stage_plan *plan, size_t n);
#define BROKER_PLANNED_REASON "starting: stages assigned" /* a job's reason as its plan is stored */
/* Stages (re)assigned from resume_step: waiting for every StageReady. reason NULL keeps the reason. */
void broker_job_starting(broker_t *b, broker_job *j, uint64_t resume_step, const char *reason);
/* Every stage is ready: running (the caller sends StageStart). */
void broker_job_running(broker_t *b, broker_job *j);
/* Back to the queue: stages released, plan dropped. */
void broker_job_requeue(broker_t *b, broker_job *j, const char *reason);
/* Failed for good: stages released, out of the table. */
void broker_job_fail(broker_t *b, broker_job *j, const char *reason);
/* Done with its result (blob and/or file; hash hex): stored in one commit, stages released, out of
 * the table. The store's error leaves j as it was. */
FU_MUST_CHECK fu_err broker_job_done(broker_t *b, broker_job *j, const uint8_t *result, size_t len,
                                     const char *file, const char *hash);
/* The rest of broker_job_done once its result of len bytes (hash hex) is stored: stages released,
 * out of the table. */
void broker_job_ended_done(broker_t *b, broker_job *j, size_t len, const char *hash);
/* Cancels owner's job id (db_job_cancel's errors); releases it when it is in the table. */
FU_MUST_CHECK fu_err broker_job_cancel(broker_t *b, const char *id, const char *owner);
/* The text of the n tokens gen that inference job j generated with sampling spec sp (its own, or a
 * session's): decoded without a last end-of-sequence token and cut before the first stop string (a
 * malloc'd string, *len bytes). *ends: the generation is over (an end-of-sequence token, a stop
 * string, sp's max_tokens). The tokenizer's error when the ids cannot be decoded. */
FU_MUST_CHECK fu_err broker_gen_text(const broker_job *j, const dag_spec *sp, const int32_t *gen, size_t n,
                                     bool *ends, char **text, size_t *len);
/* Token tok of position pos (of session `session`, 0: the job's one generation) on to stage 0 of
 * inference job j as its next input; nothing while stage 0 has no live peer (failover under way). */
void broker_token_to_first(broker_t *b, const broker_job *j, uint32_t session, uint64_t pos, int32_t tok);
/* The broker ends j itself (a serving job idle past its spec's idle_s): released, stored cancelled
 * with reason, an event "retired". */
void broker_job_retire(broker_t *b, broker_job *j, const char *reason);
/* A stored job that cannot be made into one (a corrupt row, a model gone): stored as failed. */
void broker_job_refuse(broker_t *b, const char *id, const char *reason);
/* A new reason within the phase (why it waits), stored when it changed. */
void broker_job_note(broker_t *b, broker_job *j, const char *reason);
/* A reason shown by `fusion status` but not stored: live detail that changes every sweep. */
void broker_job_show(broker_job *j, const char *reason);
/* Stops every stage and backup of j (StageRelease) and frees its peers. */
void broker_job_release(broker_t *b, broker_job *j, const char *reason);
/* True when key was taken off j for missing a deadline (the scheduler and failover skip it for j). */
bool broker_job_excludes(const broker_job *j, const char *key);
/* Takes key off j for good, recorded as an "excluded" event (kept across restarts). */
void broker_job_exclude(broker_t *b, broker_job *j, const char *key, const char *why);
/* Reads back the peers taken off j ("excluded" events) after a broker restart. */
void broker_job_exclusions_load(broker_t *b, broker_job *j);
/* The fraction of j's micro-batches to verify (the spec's "verify", else --verify; 0 for inference). */
double broker_job_verify_fraction(const broker_t *b, const broker_job *j);
/* j->spec_canon from j->spec (what peers get: the spec without the broker's paths). */
void broker_job_canon(broker_job *j);
/* The partitioner's options for j (tokens per micro-batch, micro-batches, training). */
dag_partition_opts broker_job_popts(const broker_job *j);
/* Where a (re)started run of j begins: a fine-tune at its stages' common checkpoint `ckpt`, an
 * inference after the tokens generated so far, an eval at step 0 (its sums start again). */
uint64_t broker_job_resume_step(const broker_job *j, int64_t ckpt);

/* ---- broker_sched.c: plan; broker_grow.c: grow; broker_search.c: what the partitioner knows of a
 * peer; broker_backups.c; broker_assign.c: assign, start ---- */
/* Plans queued jobs over idle peers; hands out backups. */
void broker_schedule(broker_t *b);
/* Tops up j's warm backups from the idle peers, the fastest first. */
void broker_give_backups(broker_t *b, broker_job *j);
/* Every stage of running fine-tune j has committed its checkpoint of `step`: when idle peers would
 * make a plan whose predicted step time is at least cfg.grow_margin shorter, j goes back to the
 * queue to be planned again at once from that checkpoint (cut for the new plan). */
void broker_grow(broker_t *b, broker_job *j, int64_t step);
/* True when p may hold stage s of j: it has the memory the stage needs (the partitioner's estimate)
 * and, for an end stage of a job that keeps its ends on trusted peers, it is trusted. */
bool broker_peer_fits(const broker_job *j, uint32_t s, const broker_peer *p);
/* The cost model's seconds of one micro-batch of stage s of j on p (its profile: speed, link). */
double broker_peer_stage_s(const broker_job *j, uint32_t s, const broker_peer *p);
/* Sends StageAssign (backup or not) for stage s of j to peer p. */
fu_err broker_send_assign(broker_t *b, broker_job *j, uint32_t s, broker_peer *p, bool backup);
/* Starts j's stages from resume_step (broker_job_starting with reason) and sends each its StageAssign. */
void broker_start_stages(broker_t *b, broker_job *j, uint64_t resume_step, const char *reason);

/* ---- broker_failover.c: what replaces what ---- */
/* The peer running stage `stage` of j is gone: hand it to a backup and resume from the newest
 * common checkpoint, or requeue. */
void broker_failover(broker_t *b, broker_job *j, uint32_t stage, const char *why);
/* After a restart: re-assign a job that was running from its stored plan. */
void broker_recover(broker_t *b, broker_job *j);
/* Recovers at once every restarted job whose stored plan's peers are all back. */
void broker_recover_ready(broker_t *b);
/* The step deadline of j in ms: --step-timeout, else max(BROKER_STEP_TIMEOUT_MIN_S,
 * BROKER_STEP_TIMEOUT_FACTOR x the slowest step seen), and no less than the ready deadline before the
 * first step of a run (it includes the warm-up). */
uint64_t broker_step_timeout_ms(const broker_t *b, const broker_job *j);
/* Enforces the ready and step deadlines of every job (docs/PIPELINE.md "Failures"). */
void broker_deadlines_sweep(broker_t *b);

/* ---- broker_peers.c: a peer's messages ---- */
void broker_on_hello(broker_t *b, const wire_msg_t *msg);
void broker_on_heartbeat(broker_t *b, broker_peer *p, const wire_msg_t *msg);
void broker_on_link_probe(broker_t *b, broker_peer *p, const wire_msg_t *msg);
void broker_on_leave(broker_t *b, broker_peer *p, const wire_msg_t *msg);
void broker_on_peer_list(broker_t *b, const wire_msg_t *msg);
/* Marks p gone (dead or left): its stage fails over, then it is stored as gone. */
void broker_peer_gone(broker_t *b, broker_peer *p, bool left, const char *why);
/* Declares peers silent for dead_after_ms dead, and stages whose lease ran out lost. */
void broker_peers_sweep(broker_t *b);

/* ---- broker_stages.c: a running job's stage messages ---- */
void broker_on_stage_ready(broker_t *b, broker_peer *p, const wire_msg_t *msg);
void broker_on_step_done(broker_t *b, broker_peer *p, const wire_msg_t *msg);
void broker_on_infer_token(broker_t *b, broker_peer *p, const wire_msg_t *msg);
void broker_on_checkpoint(broker_t *b, broker_peer *p, const wire_msg_t *msg);
void broker_on_peer_error(broker_t *b, broker_peer *p, const wire_msg_t *msg);

/* ---- broker_verify.c ---- */
/* Step `step` of j is done (StepDone): starts the sampled verifications of its micro-batches. */
void broker_verify_step(broker_t *b, broker_job *j, uint64_t step);
void broker_on_verify_sketch(broker_t *b, broker_peer *p, const wire_msg_t *msg);
/* A chunk of a stage input the upstream peer delivers for a verifier: checked against the samples in
 * flight and forwarded unread to the verifier (docs/PROTOCOL.md "Verification inputs"). */
void broker_on_verify_input(broker_t *b, broker_peer *p, const wire_msg_t *msg);
/* Drops samples past their deadline (logged), and snapshots no sample needs. */
void broker_verify_sweep(broker_t *b);
/* j starts a new run (a failover, a rewind, growth): its samples in flight and their snapshots belong
 * to the run that ended and are dropped (counted skipped; nobody loses reputation). A step of the new
 * run is sampled afresh: the old run's snapshot of the same step is another state. */
void broker_verify_job_restarted(broker_t *b, broker_job *j);
/* A chunk of a verification snapshot (CheckpointPut.snapshot) from p, the peer of stage c->stage_index
 * of j: assembled; once whole and checked, the verifiers waiting for it are asked. */
void broker_verify_on_snapshot(broker_t *b, broker_peer *p, broker_job *j, const wire_msg_t *msg,
                               const Fusion__CheckpointPut *c);
/* The complete snapshot of (job, stage, step), NULL when none. */
const broker_snap *broker_verify_snapshot(const broker_t *b, uint64_t job64, uint32_t stage, uint64_t step);

/* ---- broker_challenge.c: the profile challenge (docs/SECURITY.md "Verified profiles") ---- */
/* A new registration of p: starts its challenge, or passes it at once when challenges are off or the
 * store remembers this very session's result (verified_gflops already set by broker_peer_admit). */
void broker_challenge_start(broker_t *b, broker_peer *p);
void broker_on_challenge_reply(broker_t *b, broker_peer *p, const wire_msg_t *msg);
/* Steps past their deadline are dropped and tried again later; retries due are started. */
void broker_challenge_sweep(broker_t *b);

/* ---- broker_blobs.c ---- */
void broker_on_weight_request(broker_t *b, broker_peer *p, const wire_msg_t *msg);

/* ---- broker_ckpt.c: checkpoints by tensor name against the job's graph ---- */
/* Checks a checkpoint (or snapshot) blob of stage `stage` of j: the stage's adapter tensors and
 * moments exactly, metadata step `step`. FU_EPROTO with why. */
FU_MUST_CHECK fu_err broker_ckpt_check(const broker_job *j, uint32_t stage, const uint8_t *data, size_t len,
                                       uint64_t step, fu_errmsg *em);
/* Builds the finished adapter (PEFT safetensors, *out of *len bytes, caller frees) from every
 * stage's checkpoint at `step`. */
FU_MUST_CHECK fu_err broker_adapter_assemble(broker_t *b, broker_job *j, int64_t step, uint8_t **out, size_t *len,
                                             fu_errmsg *em);
/* The same for job id of graph g whose stages span first[s]..last[s], s < n, read through db only:
 * the writer thread runs it with its own connection. */
FU_MUST_CHECK fu_err broker_adapter_assemble_at(db_t *db, const char *id, const dag_graph_t *g, const uint32_t *first,
                                                const uint32_t *last, uint32_t n, int64_t step, uint8_t **out,
                                                size_t *len, fu_errmsg *em);
/* Cuts job id's checkpoints at `step` under the stored plan old[0..n_old) of graph g again for the
 * stages of plan[0..n): each plan[s] gets the checkpoint of its own node range (its tensors found by
 * name in whichever old stage held them, the optimizer's step kept) in ckpt / ckpt_len / ckpt_step,
 * freed by broker_ckpt_recut_free. On an error none is set. Reads through db only: the writer thread
 * runs it with its own connection. */
FU_MUST_CHECK fu_err broker_ckpt_recut(db_t *db, const char *id, const dag_graph_t *g, const db_stage *old,
                                       size_t n_old, int64_t step, db_stage_plan *plan, size_t n, fu_errmsg *em);
void broker_ckpt_recut_free(db_stage_plan *plan, size_t n);

/* A re-plan of a fine-tune whose stages change: its newest common checkpoint cut for the new stages
 * and stored with the plan, in one commit, on the writer thread (b->writer_db): tens of megabytes to
 * parse, slice and write durably, kept off the loop. The caller fills the inputs, sets `then` and
 * `arg`, and posts it with broker_cut_post; `then` runs on the loop with the outputs (the plan is
 * stored when rc is FU_OK), and the cut is freed after it. */
typedef struct broker_cut broker_cut;
struct broker_cut {
    broker_task base;
    /* in */
    char job[DB_JOB_ID_LEN + 1];
    const dag_graph_t *graph;          /* the job's: the job is kept while it is cut (broker_job.cutting) */
    int64_t step;                      /* the common checkpoint of the stored plan */
    db_stage old[BROKER_MAX_STAGES];   /* the stored plan's ranges (first, end) */
    size_t n_old;
    db_stage_plan plan[BROKER_MAX_STAGES]; /* the new plan; peer points into keys */
    char keys[BROKER_MAX_STAGES][DB_KEY_LEN + 1];
    size_t n;
    int64_t lease_ms;                  /* the stages' leases run this long from the commit */
    /* out */
    fu_err rc;
    fu_errmsg em;                      /* why, when rc is not FU_OK */
    bool cut_failed;                   /* rc is the cut's (else the commit's) */
    double cut_s, store_s;             /* the cut and the commit, on the writer */
    size_t bytes;                      /* the new checkpoints' bytes */
    /* the caller's */
    void (*then)(broker_t *b, broker_cut *c);
    void *arg;
    void (*free_arg)(void *arg);       /* frees arg when the cut never comes back (the broker stops) */
    db_t *db;                          /* set by broker_cut_post */
};
/* Posts c to the writer; false (c not taken) when it is busy: cut and store on the loop then. */
bool broker_cut_post(broker_t *b, broker_cut *c);

/* ---- broker_prep.c: making a job (thread-safe: the worker runs it for submissions) ---- */
/* Parses and checks a spec; FU_EINVAL with a sentence in why. */
fu_err broker_spec_parse(const char *json, size_t len, db_job_kind kind, dag_spec *out, fu_errmsg *em);
/* The stored form of a job: spec text, a NUL, then its tokens (I32 little-endian). */
uint8_t *broker_stored_spec(const char *spec, size_t spec_len, const int32_t *tok, size_t n, size_t *len);
/* Opens j's model (j->spec.model) by content and builds its DAG, tokenizer and canonical spec.
 * adapter_spec: an inference job's adapter_job spec text, or NULL. FU_ENOTFOUND: no such model. */
fu_err broker_job_prepare(broker_models *models, broker_job *j, const char *adapter_spec, fu_errmsg *em);

/* A JobSubmit being prepared on the worker: the request copied in, the job (or why not) out. */
typedef struct {
    broker_task base;                  /* first */
    broker_models *models;             /* borrowed */
    broker_ret ret;                    /* who to answer */
    db_job_kind kind;
    char owner[DB_KEY_LEN + 1];
    char *idem;                        /* idempotency key or NULL */
    bool check_only;                   /* JobSubmit.check_only: answer the model's id, store nothing */
    char *spec_json;                   /* as submitted */
    size_t spec_len;
    uint8_t *data;                     /* JobSubmit.data (freed once tokenized) */
    size_t data_len;
    char *adapter_spec;                /* the adapter_job's spec text, or NULL */
    char adapter_model[DB_MODEL_ID_LEN + 1]; /* the model the adapter_job was pinned to ("": none known) */
    db_t *db;                          /* the worker's store connection: it stores the job it prepared */
    /* out */
    broker_job *job;                   /* the prepared job, or NULL with code and em */
    Fusion__ErrorCode code;
    fu_errmsg em;
    uint8_t *blob;                     /* its stored form */
    size_t blob_len;
    size_t n_ids;                      /* tokens */
    fu_err store_rc;                   /* db_job_submit's, when job is set and not check_only */
    char id[DB_JOB_ID_LEN + 1];        /* the stored job (a new one when created) */
    bool created;
} broker_submit_task;
broker_submit_task *broker_submit_task_new(broker_models *models, const wire_msg_t *msg, db_job_kind kind,
                                           const Fusion__JobSubmit *js, const char *adapter_spec);
void broker_submit_task_free(broker_submit_task **t);

/* ---- broker_jobs.c (client API) ---- */
/* An inference's or eval's adapter must have been fine-tuned on the job's model: FU_EINVAL with em
 * saying so when adapter_model (the fine-tune's pinned model id, "" when not known) is not j's. */
FU_MUST_CHECK fu_err broker_adapter_model_check(const broker_job *j, const char *adapter_model, fu_errmsg *em);
void broker_on_submit(broker_t *b, const wire_msg_t *msg);
/* Answers the status requests job j holds (JobRef.wait_ms): every one (its output changed, or it
 * ends), or with due_only those whose wait is over. */
void broker_job_wake(broker_t *b, broker_job *j, bool due_only);
void broker_on_status(broker_t *b, const wire_msg_t *msg);
void broker_on_list(broker_t *b, const wire_msg_t *msg);
void broker_on_cancel(broker_t *b, const wire_msg_t *msg);
void broker_on_result(broker_t *b, const wire_msg_t *msg);
/* Loads an unfinished job from the store into the table (restart). */
fu_err broker_job_load(broker_t *b, const db_job *dj, broker_job **out, fu_errmsg *em);
/* adapter_config.json of a finished fine-tune (caller frees). */
char *broker_adapter_config(const dag_spec *spec);

/* ---- broker_conn.c: the ROUTER's connections (docs/BROKER.md "Failures") ---- */
/* Starts watching the ROUTER's connections (a socket monitor: accepted and disconnected); when that
 * fails it logs why and peers go by their heartbeats alone. */
void broker_conn_open(broker_t *b);
/* Stops watching (before the ROUTER closes); idempotent. */
void broker_conn_close(broker_t *b);
/* Reads every connection event queued: the closed connection of a live peer starts its grace. Call
 * it before reading each message of the ROUTER, so that a descriptor reused by a new connection is
 * known as such before that connection's messages are. O(1) per event. */
void broker_conn_events(broker_t *b);
/* p was heard in msg: msg's connection is p's now; a message on another connection (or on a reused
 * descriptor) ends the grace of one that closed. O(1). */
void broker_conn_heard(broker_t *b, broker_peer *p, const wire_msg_t *msg);
/* msg is a gateway's MSG_GATEWAY_CLOSED: the connection of the peer it names, through that gateway,
 * closed. Its slots still on that route start their grace as on_closed's do. O(slots). */
void broker_conn_gateway_closed(broker_t *b, const wire_msg_t *msg);
/* Declares dead ("connection closed") the peers whose connection closed close_grace_ms ago and that
 * were not heard again since, judged up to b->drained_ms (a paused peer is left to its heartbeats).
 * Returns the ms until the next grace ends, UINT64_MAX when none runs. */
uint64_t broker_conn_sweep(broker_t *b);

/* ---- broker_gateways.c: the admission the gateways copy (docs/PROTOCOL.md "Gateways") ---- */
/* msg is a gateway's GatewayHello (on a connection admitted as a gateway): remembers the gateway and
 * sends it the whole allow-list, the bans in force and whether enrolment is open. */
void broker_gateways_hello(broker_t *b, const wire_msg_t *msg);
/* Tells every gateway that the Z85 key has the roles now (an enrolment). */
void broker_gateways_key(broker_t *b, const char *z85, uint32_t roles);
/* Tells every gateway that addr is banned until until_ms (fu_clock_ms). */
void broker_gateways_ban(broker_t *b, const char *addr, uint64_t until_ms);

/* ---- broker.c ---- */
void broker_on_relay(broker_t *b, const wire_msg_t *msg);

#endif
