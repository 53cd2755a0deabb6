/* broker: the fusion-broker daemon as a library: one ROUTER socket (CURVE server with a ZAP
 * handler), one poll loop that owns the socket, the timers and the SQLite store, and the modules
 * that loop dispatches to (registry, scheduler, client API, blobs, failover). docs/BROKER.md and
 * docs/PIPELINE.md describe the behaviour; main() in broker_main.c only parses options.
 *
 * Threads: broker_run runs the loop on the calling thread, which owns every socket and the store.
 * broker_request_stop is async-signal-safe and may be called from a signal handler or any thread. */
#ifndef FU_BROKER_H
#define FU_BROKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BROKER_HEARTBEAT_MS     1000      /* default heartbeat interval told to peers */
#define BROKER_DEAD_FACTOR      3         /* a peer silent for this many intervals is dead */
#define BROKER_LEASE_FACTOR     6         /* stage leases last this many intervals, renewed by heartbeats */
#define BROKER_MAX_RETRIES      5         /* recoveries without progress before a job fails */
/* Deadlines on the work itself (docs/PIPELINE.md "Failures"): leases only prove a peer is alive. */
#define BROKER_READY_TIMEOUT_S  600       /* default --ready-timeout: StageAssign to StageReady (weights fetched) */
#define BROKER_STEP_TIMEOUT_MIN_S 120     /* derived step deadline: at least this many seconds ... */
#define BROKER_STEP_TIMEOUT_FACTOR 20     /* ... and at least this many times the slowest step (token) seen */
#define BROKER_TIMEOUT_MAX_S    86400     /* largest --ready-timeout / --step-timeout accepted */
#define BROKER_PAUSE_GRACE_S    300       /* default --pause-grace: a paused stage keeps its peer this long */
#define BROKER_JOB_EXCLUDE_MAX  16        /* peers a job remembers as taken off it for missing a deadline */
#define BROKER_BACKUPS          1         /* default warm backups per job */
#define BROKER_BLOB_CHUNK       (1u << 20) /* bytes of one WeightChunk / JobResultChunk */
#define BROKER_BLOB_WINDOW      (16u << 20) /* most bytes answered to one WeightRequest or JobResultRequest */
#define BROKER_LOGITS_FILE      "logits.f32" /* inference result file: prompt logits, positions x vocab float32 */
#define BROKER_MAX_LOGITS_BYTES (1ull << 31) /* largest logits file served */
#define BROKER_MAX_PEERS        65536     /* peers held in the registry (about 1.5 KiB each) */
#define BROKER_MAX_SLOTS        8         /* slots of one peer process (fusion-peer --slots) */
#define BROKER_MAX_ACTIVE_JOBS  1024      /* queued + running jobs held in memory */
#define BROKER_MAX_STAGES       64        /* stages of one job */
#define BROKER_PLAN_CANDIDATES  128       /* idle peers one partitioner run considers: the fastest */
#define BROKER_BACKUP_SPEED_TIE 0.10     /* warm backups: peers within 10% of each other's speed are equals */
#define BROKER_IO_THREADS       2         /* libzmq I/O threads of the broker's context (broker.c) */
#define BROKER_MAX_CKPT_BYTES   (512u << 20) /* largest checkpoint blob accepted */
#define BROKER_MAX_DATA_BYTES   (8u << 20)   /* largest JobSubmit.data accepted */
#define BROKER_PREP_DEPTH       16        /* submissions being prepared (or waiting to be) at once */
#define BROKER_WRITER_DEPTH     64        /* checkpoints and cuts the writer thread holds at once */
#define BROKER_WRITER_BYTES     (256u << 20) /* and the checkpoint bytes they hold: more are stored on the loop */
#define BROKER_TURN_SLOW_MS     100       /* a turn of the loop this long counts as slow (/metrics) */
#define BROKER_PREP_PER_CLIENT  8         /* ... of them from one client */
#define BROKER_CLIENT_JOBS      64        /* default --max-jobs-per-client: unfinished jobs */
#define BROKER_CLIENT_MIB       4096      /* default --max-mib-per-client: MiB of specs, tokens and results stored */
#define BROKER_UPLOAD_GIB       64        /* default --upload-gib: GiB of models clients may upload */
#define BROKER_CLIENT_PER_MIN   60        /* default --max-submits-per-minute */
#define BROKER_SESSIONS_PER_MIN 1200      /* default --max-sessions-per-minute (a serving job's generations) */
#define BROKER_MAX_INFER_TOKENS 65536     /* most tokens one inference job may generate */
#define BROKER_MIN_REPUTATION   0.2       /* a peer below this reputation gets no work */
/* A bounded store (docs/STORE.md "Compaction"): what the periodic compaction keeps. */
#define BROKER_KEEP_EVENTS      100000    /* default --keep-events: events kept; older ones go to the archive */
#define BROKER_KEEP_EVENTS_DAYS 30.0      /* default --keep-events-days: events older than this go to the archive */
#define BROKER_KEEP_JOBS_DAYS   30.0      /* default --keep-jobs-days: artifacts of jobs that ended longer ago go */
#define BROKER_CKPT_GRACE_MS    60000     /* checkpoints of a job that ended this long ago go (its result holds
                                             the adapter) */
#define BROKER_COMPACT_EVERY_MS 1000      /* compaction runs this often (every sweep while work is left) */
#define BROKER_COMPACT_BUDGET_MS 4        /* no new compaction transaction starts after this long in one turn */
#define BROKER_SCHED_SLICE_MS   100       /* longest planning pass before the loop serves messages */
#define BROKER_GROWS_MAX        4         /* growth searches waiting for the planner at once (one per job) */
#define BROKER_PLAN_STALE_MAX   3         /* searches in a row of one job whose chosen peers changed meanwhile
                                             that are made again at once; then it waits for the next round */
#define BROKER_ERROR_PENALTY    0.1       /* reputation lost by a peer whose stage failed */
/* Verification of untrusted peers (docs/PIPELINE.md "Verification"). */
#define BROKER_GROW_MARGIN      0.2       /* default --grow-margin */
#define BROKER_VERIFY_DEFAULT   0.25      /* default --verify: with 4 micro-batches, one sample per stage per
                                             checkpoint step; a peer lying on every micro-batch is caught (3
                                             disagreements) within 6 checkpoint steps with 96% (docs/SECURITY.md) */
#define BROKER_VERIFY_RTOL      1e-3      /* sketches agree when every entry and the norm differ by <= this x norm */
#define BROKER_VERIFY_PENALTY   0.3       /* reputation lost by the peer a verification found wrong */
#define BROKER_VERIFY_SOLO_PENALTY 0.05   /* lost by the verifier when no third opinion could settle a disagreement */
#define BROKER_VERIFY_INPUT_PENALTY 0.05  /* lost by each of the two peers whose accounts of a stage input differ */
#define BROKER_VERIFY_MAX_INPUT (1ull << 30) /* largest stage input the broker forwards to a verifier (bytes) */
#define BROKER_VERIFY_MAX       256       /* verification samples in flight (more are skipped and logged) */
#define BROKER_VERIFY_TIMEOUT_MS 60000    /* a sample whose sketches did not all come back by then is dropped */
#define BROKER_VERIFY_SNAPS     4         /* verification snapshots (states of steps without a checkpoint) held */
#define BROKER_VERIFY_EVICT_GRACE_MS 250  /* least wait, after a stage k < last said a sampled output is no longer
                                             held, for the last stage's StepDone that shows it could have moved on
                                             (broker_verify.c "Evicted or withheld") */
/* The profile challenge (broker_challenge.c, docs/SECURITY.md "Verified profiles"). */
#define BROKER_CHALLENGE_MS     300       /* default --challenge-ms: the product takes this long at the claimed speed */
#define BROKER_CHALLENGE_SLACK  1.5       /* plans use min(claimed, this x measured) GFLOP/s */
#define BROKER_CHALLENGE_STEP_MS 30000    /* each step of the challenge must be answered within this */
#define BROKER_CHALLENGE_RETRY_MS 60000   /* a challenge not answered in time is tried again after this */
#define BROKER_CHALLENGE_PENALTY 0.3      /* reputation lost by a peer whose answer is wrong */
#define BROKER_PACE_FACTOR      8.0       /* a step shorter than a stage's FLOPs / (this x its peer's verified
                                             speed) flags the stage: every micro-batch of it is verified */

typedef struct {
    const char *bind;          /* control endpoint (for example tcp://0.0.0.0:7700) */
    const char *gateway_bind;  /* the gateways' endpoint (docs/PROTOCOL.md "Gateways"), or NULL: none */
    const char *keys_dir;      /* the broker's key directory */
    const char *db_path;       /* SQLite store */
    bool init_store;           /* an existing empty file at db_path may become a new store (--init) */
    bool check_store;          /* full integrity check of the store at start (--check-store) */
    const char *allow_file;    /* allow-list file, or NULL */
    const char *http;          /* --http IPV4:PORT: GET /metrics there (broker_http.h); NULL: no listener */
    const char *enrol_token;   /* enrolment token (Z85) granting the client and peer roles, or NULL */
    const char *peer_token;    /* enrolment token granting the peer role only, or NULL */
    const char *client_token;  /* enrolment token granting the client role only, or NULL */
    const char *data_dir;      /* scratch files (adapter assembly); NULL: the store's directory */
    const char *model_roots;   /* directories models are served from, ':'-separated; NULL: none (every
                                  model is refused) */
    uint32_t backups;          /* warm backups per job */
    uint32_t heartbeat_ms;     /* heartbeat interval (dead after BROKER_DEAD_FACTOR of them) */
    double verify;             /* fraction of micro-batches verified for jobs whose spec says nothing (0: off) */
    double min_reputation;     /* peers below this get no work; <= 0: BROKER_MIN_REPUTATION */
    uint32_t ready_timeout_s;  /* a stage must send StageReady this long after StageAssign; 0: BROKER_READY_TIMEOUT_S */
    uint32_t step_timeout_s;   /* a running job must make progress this often; 0: derived (broker_step_timeout_ms) */
    uint32_t pause_grace_s;    /* a paused peer keeps its stage this long before it moves; 0: BROKER_PAUSE_GRACE_S */
    uint32_t client_jobs;      /* unfinished jobs one client may have; 0: BROKER_CLIENT_JOBS */
    uint32_t client_mib;       /* MiB one client's jobs may hold in the store; 0: BROKER_CLIENT_MIB */
    uint32_t client_per_min;   /* submissions one client may make per minute; 0: BROKER_CLIENT_PER_MIN */
    uint32_t sessions_per_min; /* sessions one client may open per minute; 0: BROKER_SESSIONS_PER_MIN */
    uint32_t challenge_ms;     /* the profile challenge's length at a peer's claimed speed; 0: no challenge
                                  (profiles believed: only for a cluster of one's own machines) */
    uint32_t upload_gib;       /* GiB of models clients may upload (fusion submit --upload) in all; 0: none */
    int64_t keep_events;       /* events kept in the store (the newest; older ones are archived); 0:
                                  BROKER_KEEP_EVENTS; < 0: no count limit */
    double keep_events_days;   /* events older than this are archived; 0: BROKER_KEEP_EVENTS_DAYS; < 0: no age limit */
    double keep_jobs_days;     /* artifacts (result, tokens, result file) of jobs that ended longer ago are deleted;
                                  0: BROKER_KEEP_JOBS_DAYS; < 0: kept for ever */
    double forget_days;        /* jobs whose artifacts were deleted longer ago, and peers gone longer ago at full
                                  reputation, are deleted from the store (db_compact_policy.forget_ms); <= 0: kept
                                  for ever */
    double grow_margin;        /* a job takes more stages (when planned, or from idle peers at a checkpoint)
                                  only when they make its predicted step time at least this much shorter
                                  (0.2: 20%); 0: every peer that lowers its slowest stage, and no growth */
} broker_cfg;

typedef struct broker broker_t;

/* Opens the store, loads the keys, starts the ZAP handler, binds the socket and reads back every
 * unfinished job. NULL on failure with *err set (err may be NULL) and a sentence for the operator in
 * em (may be NULL). */
broker_t *broker_new(const broker_cfg *cfg, fu_err *err, fu_errmsg *em);

/* Runs the loop until broker_request_stop; FU_OK on a clean stop, FU_EIO when the socket failed. */
FU_MUST_CHECK fu_err broker_run(broker_t *b);

/* Asks every running broker loop of this process to stop soon. Async-signal-safe. */
void broker_request_stop(void);

/* Closes the socket, stops ZAP, closes the store; idempotent; sets *b_p = NULL. */
void broker_destroy(broker_t **b_p);

#ifdef __cplusplus
}
#endif
#endif
