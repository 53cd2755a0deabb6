/* db_schema: the job store's schema, as the migrations that build it (db.c runs them). */
#include "db_internal.h"

/* Schema. migrations[v] takes a store from user_version v to v+1; each runs in its own
 * transaction together with the user_version update. Never edit a released entry: append one.
 */
const char *const db_migrations[] = {
    /* 0 → 1: the initial schema. */
    "CREATE TABLE peers ("
    "  pubkey       TEXT PRIMARY KEY NOT NULL CHECK (length(pubkey) = 40),"
    "  name         TEXT NOT NULL CHECK (length(name) <= 64),"
    "  profile      TEXT NOT NULL CHECK (json_valid(profile)),"
    "  state        TEXT NOT NULL CHECK (state IN ('active','backup','left','dead')),"
    "  reputation   REAL NOT NULL CHECK (reputation >= 0.0 AND reputation <= 1.0),"
    "  last_seen_ms INTEGER NOT NULL,"
    "  joined_ms    INTEGER NOT NULL"
    ") STRICT;"
    "CREATE TABLE jobs ("
    "  id           TEXT PRIMARY KEY NOT NULL CHECK (length(id) = 16),"
    "  owner        TEXT NOT NULL CHECK (length(owner) = 40),"
    "  idem_key     TEXT CHECK (idem_key IS NULL OR length(idem_key) BETWEEN 1 AND 128),"
    "  kind         TEXT NOT NULL CHECK (kind IN ('finetune','infer')),"
    "  spec         BLOB NOT NULL,"
    "  state        TEXT NOT NULL CHECK (state IN ('queued','running','done','failed','cancelled')),"
    "  step         INTEGER NOT NULL DEFAULT 0 CHECK (step >= 0),"
    "  total_steps  INTEGER NOT NULL DEFAULT 0 CHECK (total_steps >= 0),"
    "  loss         REAL,"
    "  tokens_per_s REAL NOT NULL DEFAULT 0,"
    "  reason       TEXT,"
    "  result       BLOB,"
    "  result_path  TEXT,"
    "  result_hash  TEXT CHECK (result_hash IS NULL OR length(result_hash) = 64),"
    "  created_ms   INTEGER NOT NULL,"
    "  updated_ms   INTEGER NOT NULL,"
    "  retries      INTEGER NOT NULL DEFAULT 0 CHECK (retries >= 0),"
    "  UNIQUE (owner, idem_key)"
    ") STRICT;"
    "CREATE INDEX jobs_by_owner ON jobs(owner, created_ms);"
    "CREATE INDEX jobs_by_state ON jobs(state, created_ms);"
    "CREATE TABLE stages ("
    "  job_id            TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  idx               INTEGER NOT NULL CHECK (idx >= 0),"
    "  node_first        INTEGER NOT NULL CHECK (node_first >= 0),"
    "  node_last         INTEGER NOT NULL CHECK (node_last >= node_first),"
    "  peer_key          TEXT REFERENCES peers(pubkey),"
    "  lease_deadline_ms INTEGER NOT NULL DEFAULT 0,"
    "  state             TEXT NOT NULL CHECK (state IN ('pending','assigned','lost','released')),"
    "  updated_ms        INTEGER NOT NULL,"
    "  PRIMARY KEY (job_id, idx)"
    ") STRICT;"
    "CREATE INDEX stages_by_lease ON stages(state, lease_deadline_ms);"
    "CREATE INDEX stages_by_peer ON stages(peer_key);"
    "CREATE TABLE checkpoints ("
    "  job_id     TEXT NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  stage_idx  INTEGER NOT NULL CHECK (stage_idx >= 0),"
    "  step       INTEGER NOT NULL CHECK (step >= 0),"
    "  hash       TEXT NOT NULL CHECK (length(hash) = 64),"
    "  data       BLOB NOT NULL,"
    "  created_ms INTEGER NOT NULL,"
    "  PRIMARY KEY (job_id, stage_idx, step)"
    ") STRICT;"
    "CREATE TABLE events ("
    "  id      INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  time_ms INTEGER NOT NULL,"
    "  job_id  TEXT,"
    "  peer_key TEXT,"
    "  kind    TEXT NOT NULL CHECK (length(kind) BETWEEN 1 AND 32),"
    "  detail  TEXT NOT NULL DEFAULT ''"
    ") STRICT;"
    "CREATE INDEX events_by_job ON events(job_id, id);",
    /* 1 → 2: stage node ranges are half-open, as in memory: node_end = node_last + 1. */
    "ALTER TABLE stages RENAME COLUMN node_last TO node_end;"
    "UPDATE stages SET node_end = node_end + 1;",
    /* 2 → 3: a job is pinned to its model's content id (NULL: submitted before models had one). */
    "ALTER TABLE jobs ADD COLUMN model_id TEXT CHECK (model_id IS NULL OR length(model_id) = 66);",
    /* 3 → 4: the content hashes of the models served, so that a restart does not hash them again. */
    "CREATE TABLE model_hashes ("
    "  dir        TEXT PRIMARY KEY NOT NULL CHECK (length(dir) BETWEEN 1 AND 4096),"
    "  sig        BLOB NOT NULL CHECK (length(sig) = 32),"
    "  model_id   TEXT NOT NULL CHECK (length(model_id) = 66),"
    "  hashes     BLOB NOT NULL CHECK (length(hashes) % 32 = 0),"
    "  used_ms    INTEGER NOT NULL"
    ") STRICT;",
    /* 4 → 5: eval jobs. SQLite cannot change a CHECK in place: the table is made again (SQLite's
     * "12 steps"; migrate() turns foreign keys off around it, so the stages and checkpoints that
     * reference jobs stay, and checks them before the commit). */
    "CREATE TABLE jobs_v5 ("
    "  id           TEXT PRIMARY KEY NOT NULL CHECK (length(id) = 16),"
    "  owner        TEXT NOT NULL CHECK (length(owner) = 40),"
    "  idem_key     TEXT CHECK (idem_key IS NULL OR length(idem_key) BETWEEN 1 AND 128),"
    "  kind         TEXT NOT NULL CHECK (kind IN ('finetune','infer','eval')),"
    "  spec         BLOB NOT NULL,"
    "  state        TEXT NOT NULL CHECK (state IN ('queued','running','done','failed','cancelled')),"
    "  step         INTEGER NOT NULL DEFAULT 0 CHECK (step >= 0),"
    "  total_steps  INTEGER NOT NULL DEFAULT 0 CHECK (total_steps >= 0),"
    "  loss         REAL,"
    "  tokens_per_s REAL NOT NULL DEFAULT 0,"
    "  reason       TEXT,"
    "  result       BLOB,"
    "  result_path  TEXT,"
    "  result_hash  TEXT CHECK (result_hash IS NULL OR length(result_hash) = 64),"
    "  created_ms   INTEGER NOT NULL,"
    "  updated_ms   INTEGER NOT NULL,"
    "  retries      INTEGER NOT NULL DEFAULT 0 CHECK (retries >= 0),"
    "  model_id     TEXT CHECK (model_id IS NULL OR length(model_id) = 66),"
    "  UNIQUE (owner, idem_key)"
    ") STRICT;"
    "INSERT INTO jobs_v5 (id, owner, idem_key, kind, spec, state, step, total_steps, loss, tokens_per_s, reason,"
    "  result, result_path, result_hash, created_ms, updated_ms, retries, model_id)"
    "  SELECT id, owner, idem_key, kind, spec, state, step, total_steps, loss, tokens_per_s, reason, result,"
    "  result_path, result_hash, created_ms, updated_ms, retries, model_id FROM jobs;"
    "DROP TABLE jobs;"
    "ALTER TABLE jobs_v5 RENAME TO jobs;"
    "CREATE INDEX jobs_by_owner ON jobs(owner, created_ms);"
    "CREATE INDEX jobs_by_state ON jobs(state, created_ms);",
    /* 5 → 6: the micro-batch count the broker chose for a fine-tune whose spec left it to it (0: the
     * spec's own). */
    "ALTER TABLE jobs ADD COLUMN micro_batches INTEGER NOT NULL DEFAULT 0 CHECK (micro_batches BETWEEN 0 AND 64);",
    /* 6 → 7: a bounded store (db_compact.c, docs/STORE.md "Compaction"). A finished job's artifacts (result,
     * tokens, result file) are deleted after the retention: purged_ms says when (NULL: not purged), the
     * partial index finds the next ones in O(log n). Events past the event limits are rolled into
     * event_archive: per UTC day, counts per kind and a BLAKE2b chain over the rows removed, each archive
     * row chained to the one before it. */
    "ALTER TABLE jobs ADD COLUMN purged_ms INTEGER;"
    "CREATE INDEX jobs_ended ON jobs(updated_ms) WHERE purged_ms IS NULL AND state IN ('done','failed','cancelled');"
    "CREATE TABLE event_archive ("
    "  id        INTEGER PRIMARY KEY AUTOINCREMENT,"
    "  day       INTEGER NOT NULL,"
    "  first_id  INTEGER NOT NULL,"
    "  last_id   INTEGER NOT NULL CHECK (last_id >= first_id),"
    "  first_ms  INTEGER NOT NULL,"
    "  last_ms   INTEGER NOT NULL,"
    "  n         INTEGER NOT NULL CHECK (n >= 1),"
    "  counts    TEXT NOT NULL CHECK (json_valid(counts)),"
    "  rows_hash TEXT NOT NULL CHECK (length(rows_hash) = 64),"
    "  prev_hash TEXT NOT NULL CHECK (length(prev_hash) = 64),"
    "  hash      TEXT NOT NULL CHECK (length(hash) = 64)"
    ") STRICT;",
    /* 7 → 8: the ended, unpurged jobs by id, so that compaction tells an ended job's checkpoints from a
     * running job's without reading job rows (their spec, tokens included, comes before state and
     * updated_ms: reading those walks megabytes of overflow pages). */
    "CREATE INDEX jobs_ended_id ON jobs(id, updated_ms) WHERE purged_ms IS NULL AND "
    "state IN ('done','failed','cancelled');",
    /* 8 → 9: a job's spec (its text, a NUL, its token ids: 4 MB for a submission of a million tokens) in a
     * table of its own, written once at submission: an update of the job's row (state, progress, reason)
     * no longer rewrites it, and reading a row's columns no longer walks its overflow pages. The specs are
     * copied over and the column dropped (SQLite rewrites the jobs rows) in this one transaction. */
    "CREATE TABLE job_specs ("
    "  job_id TEXT PRIMARY KEY NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  spec   BLOB NOT NULL CHECK (length(spec) >= 1)"
    ") STRICT;"
    "INSERT INTO job_specs (job_id, spec) SELECT id, spec FROM jobs ORDER BY rowid;"
    "ALTER TABLE jobs DROP COLUMN spec;"
    /* what compaction may forget (db_compact_policy.forget_ms): purged jobs by purge time, and peers gone
     * at full reputation by the time they were last seen */
    "CREATE INDEX jobs_purged ON jobs(purged_ms) WHERE purged_ms IS NOT NULL;"
    "CREATE INDEX peers_gone ON peers(last_seen_ms) WHERE state IN ('left','dead') AND reputation >= 1.0;",
};
_Static_assert(sizeof db_migrations / sizeof db_migrations[0] == DB_SCHEMA_VERSION,
               "one migration per schema version");
