/* db: the broker's durable store. One SQLite file (WAL, synchronous=FULL, foreign keys on) holds the
 * registry of peers, the jobs with their stage plan, stage leases and checkpoints, and an
 * append-only event log. docs/STORE.md describes the schema and its guarantees.
 *
 * Conventions for every function here:
 *  - Returns FU_OK or an fu_err; results go to out-parameters, which are only written on FU_OK.
 *  - A write returns only after its transaction committed durably (the WAL was fsync'd), so a
 *    caller may acknowledge it to a client as soon as the call returns FU_OK.
 *  - A failed write (including a full disk) changes nothing: it is rolled back as a whole.
 *  - SQLite errors are logged through fu_log (component "db") with sqlite3_errmsg and returned as
 *    FU_EDB; rows that fail validation when read back (corruption, a foreign writer) are FU_EDB too.
 *  - Times are milliseconds since the Unix epoch, passed in by the caller (`now_ms`), so that tests
 *    control the clock and the broker stamps a whole event with one time.
 *  - Keys are Z85 text of 32-byte Curve25519 public keys (40 characters, DB_KEY_LEN); job ids are
 *    16 lower-case hex characters (DB_JOB_ID_LEN). Malformed ones are FU_EINVAL.
 *  - Strings and blobs handed out are copies the caller owns; free them with the matching *_free.
 *  - A db_t is not thread-safe: one thread (the broker's loop) uses it at a time.
 */
#ifndef FU_BROKER_DB_H
#define FU_BROKER_DB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DB_SCHEMA_VERSION     9          /* PRAGMA user_version this code writes and understands */
#define DB_KEY_LEN            40         /* Z85 characters of a 32-byte public key */
#define DB_JOB_ID_LEN         16         /* hex characters of a job id (8 random bytes) */
#define DB_HASH_LEN           32         /* BLAKE2b digest bytes (crypto_generichash) */
#define DB_HASH_HEX_LEN       (2 * DB_HASH_LEN)
#define DB_MODEL_ID_LEN       (2 + DB_HASH_HEX_LEN) /* "m:" + hex content hash (broker_models.h) */
#define DB_IDEM_KEY_MAX       128        /* longest idempotency key, bytes */
#define DB_NAME_MAX           64         /* longest peer name, bytes */
#define DB_PROFILE_MAX        65536      /* longest peer profile JSON, bytes */
#define DB_REASON_MAX         1024       /* longest wait/failure reason, bytes */
#define DB_PATH_MAX           4096       /* longest result path, bytes */
#define DB_EVENT_KIND_MAX     32         /* longest event kind, bytes */
#define DB_EVENT_DETAIL_MAX   4096       /* longest event detail, bytes */
#define DB_SPEC_MAX           (16u << 20) /* largest job spec, bytes */
#define DB_BLOB_MAX           1000000000u /* largest result/checkpoint blob (SQLite's length limit) */
#define DB_BUSY_TIMEOUT_MS    5000       /* default wait for a lock held by another connection */
#define DB_CKPT_KEEP          3          /* default checkpoints kept per (job, stage) */
#define DB_REPUTATION_INIT    1.0        /* reputation of a new peer; kept within [0, 1] */

typedef struct db db_t;

/* Options for db_open_opts; zero-initialise and set what you need. */
typedef struct {
    int     busy_timeout_ms; /* 0: DB_BUSY_TIMEOUT_MS */
    int     ckpt_keep;       /* checkpoints kept per (job, stage); 0: DB_CKPT_KEEP */
    int64_t max_page_count;  /* >0: cap the file at this many pages (PRAGMA max_page_count), to
                                simulate a full disk in tests; SQLite never shrinks the cap below
                                the current size. 0: no cap */
    bool    read_only;       /* open for reading only; no schema creation or migration */
    bool    init_empty;      /* an existing 0-byte file may become a new store (else FU_EPROTO: a store
                                that lost its content is not silently replaced by an empty one) */
    bool    full_check;      /* PRAGMA integrity_check at open instead of quick_check (a damaged
                                store is FU_EPROTO either way) */
} db_options;

typedef enum { DB_JOB_FINETUNE = 0, DB_JOB_INFER, DB_JOB_EVAL } db_job_kind;

/* Allowed transitions: queued → running | failed | cancelled; running → queued (a retry: the
 * retry count goes up) | done | failed | cancelled. done, failed and cancelled are final. */
typedef enum {
    DB_JOB_QUEUED = 0,
    DB_JOB_RUNNING,
    DB_JOB_DONE,
    DB_JOB_FAILED,
    DB_JOB_CANCELLED,
} db_job_state;
#define DB_N_JOB_STATES 5

typedef enum { DB_PEER_ACTIVE = 0, DB_PEER_BACKUP, DB_PEER_LEFT, DB_PEER_DEAD } db_peer_state;

/* pending: no peer holds it; assigned: a peer holds it under a lease; lost: its lease ran out or
 * its peer went away, waiting for a backup; released: the job ended. */
typedef enum { DB_STAGE_PENDING = 0, DB_STAGE_ASSIGNED, DB_STAGE_LOST, DB_STAGE_RELEASED } db_stage_state;

/* A job as stored. Owned by the caller; free with db_job_free / db_job_array_free. */
typedef struct {
    char          id[DB_JOB_ID_LEN + 1];   /* 16 hex chars */
    char          owner[DB_KEY_LEN + 1];   /* the submitter's public key (Z85) */
    char         *idem_key;                /* idempotency key, or NULL when none was given */
    db_job_kind   kind;                    /* finetune, infer or eval */
    db_job_state  state;                   /* where it is in its life */
    uint8_t      *spec;                    /* the job spec as submitted (NULL in list results) */
    size_t        spec_len;                /* its length (set in list results too) */
    int64_t       step;                    /* progress: steps done */
    int64_t       total_steps;             /* progress: steps planned (0: unknown) */
    double        loss;                    /* progress: newest training loss (NaN: none yet) */
    double        tokens_per_s;            /* progress: newest throughput */
    char         *reason;                  /* why it waits or failed; NULL when none */
    uint8_t      *result;                  /* result blob, or NULL (always NULL in list results) */
    size_t        result_len;              /* its length (set in list results too) */
    char         *result_path;             /* result stored as a file, or NULL */
    char          result_hash[DB_HASH_HEX_LEN + 1]; /* BLAKE2b hex of the result; "" when none */
    char          model_id[DB_MODEL_ID_LEN + 1]; /* the model's content id the job is pinned to; "" none */
    int64_t       created_ms;              /* submission time */
    int64_t       updated_ms;              /* last change of state or progress */
    int           retries;                 /* times it went from running back to queued */
    uint32_t      micro_batches;           /* fine-tune: the M the broker chose when the spec left it to it
                                              (0: none chosen; the spec's M) */
    int64_t       purged_ms;               /* when its artifacts (result, tokens, result file) were deleted
                                              after the retention (db_compact); 0: they were not */
} db_job;

/* A peer as stored. Owned by the caller; free with db_peer_free / db_peer_array_free. */
typedef struct {
    char          key[DB_KEY_LEN + 1]; /* public key (Z85) */
    char         *name;                /* display name the peer gave */
    char         *profile;             /* JSON object: gflops per dtype, memory, backend, link */
    db_peer_state state;               /* active, backup, left or dead */
    double        reputation;          /* in [0, 1]; starts at DB_REPUTATION_INIT */
    int64_t       last_seen_ms;        /* last registration, heartbeat or touch */
    int64_t       joined_ms;           /* first registration */
} db_peer;

/* One stage of a job's pipeline plan, as given to db_stage_assign. */
typedef struct {
    uint32_t    first;              /* first DAG node of the stage (topological index) */
    uint32_t    end;                /* one past its last node (> first): [first, end) as everywhere */
    const char *peer;               /* key of the peer that runs it, or NULL for pending */
    int64_t     lease_deadline_ms;  /* lease end when peer is set */
    const uint8_t *ckpt;            /* NULL, or the stage's checkpoint at ckpt_step cut for this plan (every
                                       stage has one or none does): the job's other checkpoints are dropped */
    size_t      ckpt_len;           /* bytes at ckpt */
    int64_t     ckpt_step;          /* the step it was taken after */
} db_stage_plan;

/* A stage as stored. Plain data: free an array of them with db_stage_array_free. */
typedef struct {
    char           job[DB_JOB_ID_LEN + 1]; /* the job it belongs to */
    uint32_t       index;              /* position in the pipeline, 0-based */
    uint32_t       first, end;         /* DAG node range [first, end) */
    char           peer[DB_KEY_LEN + 1]; /* holder's key; "" when none */
    int64_t        lease_deadline_ms;  /* 0 when no lease */
    db_stage_state state;              /* pending, assigned, lost or released */
    int64_t        updated_ms;         /* last change */
} db_stage;

/* A checkpoint of one stage at one step. Free with db_ckpt_free. */
typedef struct {
    char     job[DB_JOB_ID_LEN + 1];    /* the job */
    uint32_t stage;                     /* the stage's index in the plan */
    int64_t  step;                      /* the training step it was taken after */
    char     hash[DB_HASH_HEX_LEN + 1]; /* BLAKE2b-256 hex of data */
    uint8_t *data;                      /* adapter + optimizer state */
    size_t   len;                       /* bytes in data */
    int64_t  created_ms;                /* when it was stored */
} db_ckpt;

/* One event of the log. Free an array with db_event_array_free. */
typedef struct {
    int64_t id;                          /* increasing; use as the cursor of db_event_list */
    int64_t time_ms;                     /* when it happened */
    char    job[DB_JOB_ID_LEN + 1];      /* "" when not about a job */
    char    peer[DB_KEY_LEN + 1];        /* "" when not about a peer */
    char    kind[DB_EVENT_KIND_MAX + 1]; /* "submitted", "state", "peer-join", ... */
    char   *detail;                      /* free text; never NULL ("" when none) */
} db_event;

/* ---- names ---- */
const char *db_job_kind_name(db_job_kind k);     /* "finetune", "infer", "eval"; "?" when out of range */
const char *db_job_state_name(db_job_state s);   /* "queued", ... */
const char *db_peer_state_name(db_peer_state s); /* "active", "backup", "left", "dead" */
const char *db_stage_state_name(db_stage_state s);
FU_MUST_CHECK fu_err db_job_state_parse(const char *s, db_job_state *out); /* FU_EINVAL if unknown */
FU_MUST_CHECK fu_err db_job_kind_parse(const char *s, db_job_kind *out);
bool db_job_state_final(db_job_state s);          /* done, failed, cancelled */
/* Whether a job may go from `from` to `to` (the same state counts as allowed: a no-op). */
bool db_job_transition_ok(db_job_state from, db_job_state to);
bool db_key_valid(const char *key);               /* 40 Z85 chars decoding to 32 bytes */
bool db_job_id_valid(const char *id);             /* 16 lower-case hex chars */
/* BLAKE2b-256 (crypto_generichash, no key) of data, as lower-case hex into out. */
void db_hash_hex(char out[DB_HASH_HEX_LEN + 1], const void *data, size_t len);

/* ---- open / close ---- */

/* Opens (creating if missing) the store at path with default options and brings its schema to
 * DB_SCHEMA_VERSION, migrating forward in one transaction per version. Errors, each logged with a
 * sentence that says what to do: FU_EINVAL path NULL/empty; FU_ENOTFOUND its directory does not
 * exist; FU_EPROTO the file is not an SQLite database, is damaged (quick_check at every open), or
 * is an existing empty file (see db_options.init_empty); FU_EVERSION the file was written by a newer
 * fusion (user_version > DB_SCHEMA_VERSION); FU_EPERM it cannot be opened for writing; FU_EDB other
 * SQLite errors. *out is set only on success. */
FU_MUST_CHECK fu_err db_open(const char *path, db_t **out);
/* As db_open, with options (opts may be NULL for defaults). */
FU_MUST_CHECK fu_err db_open_opts(const char *path, const db_options *opts, db_t **out);
/* Another connection to the store db has open, with its options, for another thread of this
 * process (a connection is used by one thread at a time): no creation, checks or migration, which
 * db's open did. Writes wait for each other (SQLite's one writer; busy_timeout_ms at most). */
FU_MUST_CHECK fu_err db_open_sibling(const db_t *db, db_t **out);
/* Closes the store and sets *db_p = NULL. Idempotent; NULL and *db_p == NULL are fine. */
void db_close(db_t **db_p);

/* Transactions committed since db_open and the time the commits took (fsync included). */
typedef struct {
    uint64_t n;       /* commits */
    double sum_s;     /* seconds, all of them */
    double max_s;     /* the slowest */
} db_commit_stats;

db_commit_stats db_commits(const db_t *db);
/* The schema version stored in the file (PRAGMA user_version). */
FU_MUST_CHECK fu_err db_user_version(db_t *db, int *out);
/* The path the store was opened with (borrowed, valid until db_close). */
const char *db_path(const db_t *db);

/* ---- jobs ---- */

/* Stores a new queued job and returns its id, or, when (owner, idem_key) was submitted before,
 * returns that job's id with *created = false and stores nothing. idem_key may be NULL (every call
 * then makes a new job). Returns only after the commit is durable. FU_EINVAL bad owner/key/spec
 * (spec_len 0 or > DB_SPEC_MAX); FU_EEXIST the same (owner, idem_key) was used for a different
 * kind or spec (a client bug: a retry carries the same request). model_id: the content id of the
 * job's model ("m:" + hex), or NULL. job_id receives DB_JOB_ID_LEN + 1 bytes. */
FU_MUST_CHECK fu_err db_job_submit(db_t *db, const char *owner, const char *idem_key, db_job_kind kind,
                                   const void *spec, size_t spec_len, const char *model_id, int64_t now_ms,
                                   char job_id[DB_JOB_ID_LEN + 1], bool *created);
/* Loads job id. owner NULL: any owner (the broker itself); otherwise a job of another owner is
 * FU_ENOTFOUND, exactly like a job that does not exist. *out is the caller's (db_job_free). */
FU_MUST_CHECK fu_err db_job_get(db_t *db, const char *id, const char *owner, db_job **out);
/* The same without the spec and result blobs (spec and result NULL, their lengths set): what a
 * status answer needs, without reading megabytes of tokens. */
FU_MUST_CHECK fu_err db_job_get_brief(db_t *db, const char *id, const char *owner, db_job **out);
/* Frees a job from db_job_get and sets *job_p = NULL. Idempotent. */
void db_job_free(db_job **job_p);
/* The jobs of owner (NULL: every job), oldest first, without spec and result blobs (their lengths
 * are set). *out is an array of *n jobs (NULL when none); free with db_job_array_free. */
FU_MUST_CHECK fu_err db_job_list(db_t *db, const char *owner, db_job **out, size_t *n);
/* Every queued or running job with its spec, oldest first: what a restarted broker resumes. */
FU_MUST_CHECK fu_err db_jobs_unfinished(db_t *db, db_job **out, size_t *n);
/* The content hashes of a model directory as they were when its files had signature sig (broker
 * models: the BLAKE2b of every file's name, inode, size and times), kept so that a restarted broker
 * does not hash every byte again. At most DB_MODEL_HASHES_MAX rows: the least recently used go. */
#define DB_MODEL_HASHES_MAX 256
typedef struct {
    char *dir;
    uint8_t sig[DB_HASH_LEN];
    char model_id[DB_MODEL_ID_LEN + 1];
    uint8_t *hashes;                   /* n_tensors x DB_HASH_LEN */
    size_t n_tensors;
} db_model_hashes;
FU_MUST_CHECK fu_err db_model_hashes_put(db_t *db, const db_model_hashes *m, int64_t now_ms);
/* Every row (caller frees with db_model_hashes_free). */
FU_MUST_CHECK fu_err db_model_hashes_all(db_t *db, db_model_hashes **out, size_t *n);
void db_model_hashes_free(db_model_hashes **arr, size_t n);

/* What owner holds in the store: its unfinished (queued or running) jobs and the bytes of all its
 * jobs' specs and results (per-client quotas, docs/SECURITY.md). */
FU_MUST_CHECK fu_err db_owner_usage(db_t *db, const char *owner, int64_t *unfinished, int64_t *bytes);
/* Jobs of every owner in each state: counts[s] for s < DB_N_JOB_STATES. */
FU_MUST_CHECK fu_err db_job_counts(db_t *db, int64_t counts[DB_N_JOB_STATES]);
/* Frees an array of n jobs from db_job_list / db_jobs_unfinished and sets *arr_p = NULL. */
void db_job_array_free(db_job **arr_p, size_t n);
/* Moves job id to state `to` (owner NULL: the broker acting), checking the transition. reason (may
 * be NULL) replaces the job's reason text (why it waits, why it failed). running → queued counts a
 * retry. Entering a final state releases the job's stages. Same state: FU_OK, only the reason and
 * update time change. FU_ENOTFOUND no such job (for owner); FU_EPERM a transition not allowed
 * (done → running, anything out of a final state). */
FU_MUST_CHECK fu_err db_job_set_state(db_t *db, const char *id, db_job_state to, const char *reason,
                                      int64_t now_ms);
/* Cancels owner's job. FU_OK when it is now cancelled (also when it already was); FU_ENOTFOUND for
 * a job that does not exist or belongs to someone else; FU_EPERM when it already finished (done or
 * failed). owner NULL: the broker cancels any job. */
/* Records the micro-batch count (1..64) the broker chose for job id. FU_EINVAL bad arguments,
 * FU_ENOTFOUND no such job. */
FU_MUST_CHECK fu_err db_job_set_micro_batches(db_t *db, const char *id, uint32_t m);
FU_MUST_CHECK fu_err db_job_cancel(db_t *db, const char *id, const char *owner, int64_t now_ms);
/* Records progress of a running job. loss may be NaN (not known). FU_EPERM if the job is not
 * running (a late report for a job that moved on); FU_EINVAL negative step/total. */
FU_MUST_CHECK fu_err db_job_progress(db_t *db, const char *id, int64_t step, int64_t total_steps, double loss,
                                     double tokens_per_s, int64_t now_ms);
/* Marks a running job done with its result: a blob (result != NULL, hash_hex optional and, when
 * given, checked: mismatch → FU_EAUTH) and/or a file path (path != NULL, hash_hex required). The
 * stored hash is BLAKE2b-256 hex. FU_EPERM the job is not running. */
FU_MUST_CHECK fu_err db_job_complete(db_t *db, const char *id, const void *result, size_t result_len,
                                     const char *path, const char *hash_hex, int64_t now_ms);
/* Keeps what a job that ended without finishing (failed or cancelled) had made: result (1..
 * DB_BLOB_MAX bytes) as its result, and note appended to its reason (at most DB_REASON_MAX bytes in
 * all). FU_EPERM when the job is in another state. */
FU_MUST_CHECK fu_err db_job_keep_partial(db_t *db, const char *id, const void *result, size_t result_len,
                                         const char *note);

/* ---- peers ---- */

/* Registers a peer or updates a known one (same key): name, profile and state are replaced,
 * last_seen = now; joined time and reputation are kept. profile must be a JSON object of at most
 * DB_PROFILE_MAX bytes (FU_EINVAL otherwise). *created (may be NULL) tells whether it is new. */
FU_MUST_CHECK fu_err db_peer_upsert(db_t *db, const char *key, const char *name, const char *profile_json,
                                    db_peer_state state, int64_t now_ms, bool *created);
/* Replaces a peer's profile (a JSON object of at most DB_PROFILE_MAX bytes). FU_ENOTFOUND unknown peer. */
FU_MUST_CHECK fu_err db_peer_set_profile(db_t *db, const char *key, const char *profile_json);
/* Sets a peer's state. FU_ENOTFOUND unknown peer. A peer that becomes left or dead loses its
 * stages: each stage it held in a running/queued job becomes lost (lease cleared). */
FU_MUST_CHECK fu_err db_peer_set_state(db_t *db, const char *key, db_peer_state state, int64_t now_ms);
/* A peer left (left) or died: db_peer_set_state to left or dead with ONE event, kind "peer-left" or
 * "peer-dead", naming job (NULL: none) and saying why (NULL: nothing) before the state and the stages
 * lost: a departure is one commit (docs/SCALE.md). Errors as db_peer_set_state; FU_EINVAL for a job
 * id that is not one. */
FU_MUST_CHECK fu_err db_peer_gone(db_t *db, const char *key, bool left, int64_t now_ms, const char *job,
                                  const char *why);
/* Records that the peer was heard from at now_ms. FU_ENOTFOUND unknown peer. */
FU_MUST_CHECK fu_err db_peer_touch(db_t *db, const char *key, int64_t now_ms);
/* Adds delta to a peer's reputation, clamped to [0, 1]; *out (may be NULL) gets the new value. */
FU_MUST_CHECK fu_err db_peer_reputation_adjust(db_t *db, const char *key, double delta, int64_t now_ms,
                                               double *out);
/* Loads one peer (db_peer_free). FU_ENOTFOUND unknown peer. */
FU_MUST_CHECK fu_err db_peer_get(db_t *db, const char *key, db_peer **out);
void db_peer_free(db_peer **peer_p);
/* The peers whose state bit is in state_mask (1u << DB_PEER_ACTIVE | ...; 0: all), by join time. */
FU_MUST_CHECK fu_err db_peer_list(db_t *db, unsigned state_mask, db_peer **out, size_t *n);
void db_peer_array_free(db_peer **arr_p, size_t n);

/* ---- stages and leases ---- */

/* Replaces job's stage plan with n stages (index = position in plan) in one transaction; with a
 * running_reason (may be NULL) the same transaction moves the job to running with that reason. A
 * stage with a peer is assigned with that lease, one without is pending. Ranges must be in order and not
 * overlap (FU_EINVAL); the job must be queued or running (FU_EPERM) and every peer known
 * (FU_ENOTFOUND). Checkpoints are kept: a re-plan with the same cut resumes from them; a plan whose
 * stages carry checkpoints (cut again for its ranges) replaces every checkpoint of the job with
 * them, in the same transaction. */
FU_MUST_CHECK fu_err db_stage_assign(db_t *db, const char *job, const db_stage_plan *plan, size_t n,
                                     const char *running_reason, int64_t now_ms);
/* Hands stage `index` of job to peer (a backup taking over) with a new lease. FU_ENOTFOUND no such
 * stage or peer; FU_EPERM the job is final. */
FU_MUST_CHECK fu_err db_stage_reassign(db_t *db, const char *job, uint32_t index, const char *peer,
                                       int64_t lease_deadline_ms, int64_t now_ms);
/* Extends the lease of stage `index` held by peer to lease_deadline_ms (never shortens it).
 * FU_EPERM the stage is held by another peer or not assigned; FU_ETIMEDOUT the lease had already
 * run out at now_ms (the stage may have been handed to someone else: the peer must stop);
 * FU_ENOTFOUND no such stage. */
FU_MUST_CHECK fu_err db_stage_lease_extend(db_t *db, const char *job, uint32_t index, const char *peer,
                                           int64_t lease_deadline_ms, int64_t now_ms);
/* One lease to extend in a batch (db_stage_leases_extend). The strings are borrowed. */
typedef struct {
    const char *job;     /* job id */
    uint32_t index;      /* stage */
    const char *peer;    /* the holder */
    int64_t deadline_ms; /* the new deadline (never shortens the lease) */
    fu_err result;       /* out: what db_stage_lease_extend would have returned for it alone */
} db_lease;
/* db_stage_lease_extend for every lease of leases[0..n) in ONE transaction (one commit for all the
 * heartbeats of a sweep, not one per heartbeat: docs/SCALE.md). A lease refused (FU_EPERM,
 * FU_ETIMEDOUT, FU_ENOTFOUND, FU_EINVAL in its result) changes nothing and the others go on; any other
 * failure rolls them all back and is returned (FU_EDB). */
FU_MUST_CHECK fu_err db_stage_leases_extend(db_t *db, db_lease *leases, size_t n, int64_t now_ms);
/* The stages of job in pipeline order (db_stage_array_free). An empty plan gives *n = 0. */
FU_MUST_CHECK fu_err db_stage_list(db_t *db, const char *job, db_stage **out, size_t *n);
/* Marks every assigned stage whose lease deadline is before now_ms as lost, and returns those
 * stages (the broker then assigns backups). In one transaction. */
FU_MUST_CHECK fu_err db_stage_expired(db_t *db, int64_t now_ms, db_stage **out, size_t *n);
/* Every stage in `state` across all jobs, by job and index: the lost stages waiting for a backup
 * (after a peer died, or after a restart), or the assigned ones whose leases a restarted broker
 * must honour. */
FU_MUST_CHECK fu_err db_stages_in_state(db_t *db, db_stage_state state, db_stage **out, size_t *n);
void db_stage_array_free(db_stage **arr_p, size_t n);

/* ---- checkpoints ---- */

/* Stores the checkpoint of (job, stage) at step after checking that hash_hex is the BLAKE2b-256
 * of data (mismatch: FU_EAUTH, nothing stored), then keeps only the newest ckpt_keep steps of that
 * (job, stage), the job's newest common step, and keep_step (-1: none): the step a run that is
 * starting loads its stages from, which checkpoints of later steps (stages of the run before,
 * still at work) must not prune away. Storing the same step again replaces it. Returns after the
 * commit is durable: only then may the broker acknowledge the checkpoint. FU_ENOTFOUND no such
 * job; FU_EINVAL len 0 or > DB_BLOB_MAX, step < 0. */
FU_MUST_CHECK fu_err db_ckpt_put(db_t *db, const char *job, uint32_t stage, int64_t step, const void *data,
                                 size_t len, const char *hash_hex, int64_t keep_step, int64_t now_ms);
/* Loads the checkpoint of (job, stage) at step (step < 0: the newest), re-checking its hash
 * (FU_EAUTH when the stored data no longer matches). FU_ENOTFOUND none. db_ckpt_free frees it. */
FU_MUST_CHECK fu_err db_ckpt_get(db_t *db, const char *job, uint32_t stage, int64_t step, db_ckpt **out);
void db_ckpt_free(db_ckpt **ckpt_p);
/* The newest step that every stage of job's current plan has a checkpoint for: where recovery
 * rewinds to. FU_ENOTFOUND when the job has no plan or no such step exists (start from zero). */
FU_MUST_CHECK fu_err db_ckpt_common_step(db_t *db, const char *job, int64_t *step);

/* ---- events ---- */

/* Appends an event. job and peer may be NULL; kind is 1..DB_EVENT_KIND_MAX bytes, detail (may be
 * NULL) at most DB_EVENT_DETAIL_MAX. The store also logs its own events (submitted, state, ...). */
FU_MUST_CHECK fu_err db_event_add(db_t *db, int64_t now_ms, const char *job, const char *peer, const char *kind,
                                  const char *detail);
/* Events with id > after_id (0: from the start), about job (NULL: all), oldest first, at most
 * limit (0: DB_EVENT_LIST_MAX). Checks no ownership: before showing a client the events of a job,
 * look the job up with db_job_get(db, id, client_key, ...). */
#define DB_EVENT_LIST_MAX 1000
FU_MUST_CHECK fu_err db_event_list(db_t *db, const char *job, int64_t after_id, size_t limit, db_event **out,
                                   size_t *n);
void db_event_array_free(db_event **arr_p, size_t n);

/* ---- compaction: a bounded store (docs/STORE.md "Compaction") ---- */

#define DB_COMPACT_BATCH     500       /* default events archived per transaction */
#define DB_VACUUM_SLACK      1024      /* free pages kept for reuse (4 MiB of 4 KiB pages) */
#define DB_VACUUM_PAGES      256       /* most pages returned to the file system per db_compact (1 MiB) */
#define DB_JOURNAL_LIMIT     (64 << 20) /* the WAL file is truncated to this after a checkpoint */

/* What db_compact removes. Zero-initialise: zero means "no limit" for each limit. */
typedef struct {
    int64_t events_max;     /* events kept in the events table (the newest); older ones are archived.
                               0: no count limit */
    int64_t events_keep_ms; /* events older than this are archived. 0: no age limit */
    int64_t jobs_keep_ms;   /* a job that ended (done, failed, cancelled) longer ago than this loses its
                               artifacts: result blob, result file, tokens (its row, spec text, result hash
                               and events stay). 0: kept for ever */
    int64_t ckpt_grace_ms;  /* the checkpoints of a job that ended longer ago than this are deleted (its
                               result already holds the adapter). < 0: kept */
    int64_t forget_ms;      /* a job purged (jobs_keep_ms) longer ago than this is deleted: its row, spec
                               text, stages and idempotency key (one "forgotten" event keeps its result
                               hash in the log); so is a peer that left or died longer ago than this, at
                               full reputation, that no stored stage names. 0: kept for ever */
    int     batch;          /* events archived per transaction; 0: DB_COMPACT_BATCH */
    double  budget_s;       /* no new transaction starts once db_compact has run this long; 0: one
                               transaction of each kind at most */
} db_compact_policy;

/* What one db_compact did. */
typedef struct {
    int64_t events_archived; /* events moved into the archive */
    int64_t ckpts_dropped;   /* checkpoint rows deleted (of ended jobs) */
    int64_t ckpt_bytes;      /* their bytes */
    int64_t jobs_purged;     /* jobs whose artifacts were deleted */
    int64_t purged_bytes;    /* the bytes of those artifacts in the store (result + tokens) */
    int64_t jobs_forgotten;  /* purged jobs deleted (forget_ms) */
    int64_t peers_forgotten; /* peer rows deleted (forget_ms) */
    int64_t pages_vacuumed;  /* free pages returned to the file system */
    int     commits;         /* transactions committed */
    double  seconds;         /* time it took */
    bool    more;            /* work was left when the budget ran out: call again soon */
} db_compact_stats;

/* Makes the store smaller by policy, in transactions of bounded size, until the work is done or
 * policy->budget_s has passed (a transaction started is finished): events beyond the limits are
 * archived oldest first (a per-day archive row with counts per kind and a hash chain over them,
 * db_event_audit) and deleted, except the `excluded` events of unfinished jobs (a restarted broker
 * reads them); checkpoints of ended jobs are deleted after the grace; artifacts of jobs that ended
 * before the retention are deleted (one "purged" event each), result files unlinked after the
 * commit; jobs purged and peers gone before forget_ms are deleted (one "forgotten" event each); then free pages beyond DB_VACUUM_SLACK go back to the file system (incremental vacuum,
 * at most DB_VACUUM_PAGES). Nothing a queued or running job needs is touched. *out (may be NULL)
 * says what was done. FU_EDB on a store error (what was committed stays). */
FU_MUST_CHECK fu_err db_compact(db_t *db, const db_compact_policy *policy, int64_t now_ms, db_compact_stats *out);

/* The result of db_event_audit. */
typedef struct {
    int64_t rows;       /* archive rows checked */
    int64_t events;     /* events they account for */
    int64_t bad_row;    /* id of the first archive row that fails (0: none, or the failure is not one row's) */
    char    why[192];   /* what failed ("" when the chain holds) */
} db_audit;

/* Checks the event archive: every row's hash is the BLAKE2b of its fields and of the hash of the row
 * before it (so a row altered, removed or inserted breaks the chain), and the archived and live
 * events account for every event id issued since the first archived one (so events deleted outside
 * the archive show). FU_OK when it holds; FU_EAUTH when it does not (out says where and why); FU_EDB
 * on a store error. */
FU_MUST_CHECK fu_err db_event_audit(db_t *db, db_audit *out);

/* One day of the event archive (db_event_archive_list). Free an array with db_event_archive_free. */
typedef struct {
    int64_t id;                          /* archive row id (increasing) */
    int64_t day;                         /* UTC days since 1970-01-01 of its first event */
    int64_t first_id, last_id;           /* the event ids it covers */
    int64_t first_ms, last_ms;           /* their times */
    int64_t n;                           /* events archived in it */
    char   *counts;                      /* JSON object: events per kind */
    char    hash[DB_HASH_HEX_LEN + 1];   /* the chain's hash after it */
} db_archive_day;
/* The archive rows with id > after_id, oldest first, at most limit (0: DB_EVENT_LIST_MAX). */
FU_MUST_CHECK fu_err db_event_archive_list(db_t *db, int64_t after_id, size_t limit, db_archive_day **out, size_t *n);
void db_event_archive_free(db_archive_day **arr_p, size_t n);

/* The store's size and what fills it (the broker's /metrics). */
typedef struct {
    int64_t events;          /* rows in events */
    int64_t archived_events; /* events accounted for by the archive */
    int64_t archive_rows;    /* rows in event_archive */
    int64_t checkpoints;     /* checkpoint rows */
    int64_t checkpoint_bytes;/* their bytes */
    int64_t jobs_ended;      /* jobs done, failed or cancelled (deep only; else -1) */
    int64_t jobs_purged;     /* of them, those whose artifacts were deleted (deep only; else -1) */
    int64_t pages, free_pages, page_size; /* the main file: pages, of which free, bytes per page */
} db_store_stats;
/* The figures; deep adds those that count every ended job (two index scans, a few milliseconds per
 * 100,000 jobs: not for every turn of a loop). No figure reads a job row: an ended job's result comes
 * before most of its columns, and reading the columns after it walks its overflow pages. */
FU_MUST_CHECK fu_err db_store_stats_get(db_t *db, bool deep, db_store_stats *out);

#ifdef __cplusplus
}
#endif
#endif
