/* db: jobs (submit with idempotency keys, ownership, state machine, progress, results). */
#include "db_internal.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_log.h"

#define DB_LOG "db"

/* The columns read_job expects, in order (from `jobs`); the list variant leaves the blobs out. A job's
 * spec is in job_specs (schema version 9), written once at submission: the jobs row stays small, so that
 * updating it (state, progress) or reading it never touches the spec's megabytes of tokens. length() of a
 * blob reads no overflow page. */
#define JOB_SPEC_OF_ROW "(SELECT s.spec FROM job_specs s WHERE s.job_id = jobs.id)"
#define JOB_COLS                                                                                   \
    "id, owner, idem_key, kind, state, step, total_steps, loss, tokens_per_s, reason, result_path, " \
    "result_hash, created_ms, updated_ms, retries, (SELECT length(s.spec) FROM job_specs s WHERE s.job_id = " \
    "jobs.id), length(result), model_id, micro_batches, coalesce(purged_ms, 0)"
#define JOB_COLS_BLOBS JOB_COLS ", " JOB_SPEC_OF_ROW ", result"

static void job_members_free(db_job *j)
{
    free(j->idem_key);
    free(j->spec);
    free(j->reason);
    free(j->result);
    free(j->result_path);
    memset(j, 0, sizeof *j);
}

/* Reads the current row of st (JOB_COLS or JOB_COLS_BLOBS) into *j, validating every field. */
static fu_err read_job(db_t *db, sqlite3_stmt *st, bool blobs, db_job *j)
{
    fu_err err;
    int kind = 0, state = 0;
    memset(j, 0, sizeof *j);
    if ((err = db_col_text(db, st, 0, j->id, sizeof j->id, false)) != FU_OK ||
        (err = db_col_text(db, st, 1, j->owner, sizeof j->owner, false)) != FU_OK ||
        (err = db_col_dup(db, st, 2, DB_IDEM_KEY_MAX, true, &j->idem_key)) != FU_OK ||
        (err = db_col_enum(db, st, 3, db_job_kind_names, DB_N_KINDS, &kind)) != FU_OK ||
        (err = db_col_enum(db, st, 4, db_job_state_names, DB_N_JOB_STATES, &state)) != FU_OK ||
        (err = db_col_dup(db, st, 9, DB_REASON_MAX, true, &j->reason)) != FU_OK ||
        (err = db_col_dup(db, st, 10, DB_PATH_MAX, true, &j->result_path)) != FU_OK ||
        (err = db_col_text(db, st, 11, j->result_hash, sizeof j->result_hash, true)) != FU_OK ||
        (err = db_col_text(db, st, 17, j->model_id, sizeof j->model_id, true)) != FU_OK)
        goto fail;
    j->kind = (db_job_kind)kind;
    j->state = (db_job_state)state;
    j->step = sqlite3_column_int64(st, 5);
    j->total_steps = sqlite3_column_int64(st, 6);
    j->loss = sqlite3_column_type(st, 7) == SQLITE_NULL ? NAN : sqlite3_column_double(st, 7);
    j->tokens_per_s = sqlite3_column_double(st, 8);
    j->created_ms = sqlite3_column_int64(st, 12);
    j->updated_ms = sqlite3_column_int64(st, 13);
    int64_t retries = sqlite3_column_int64(st, 14);
    int64_t spec_len = sqlite3_column_int64(st, 15), result_len = sqlite3_column_int64(st, 16);
    int64_t micro = sqlite3_column_int64(st, 18);
    j->purged_ms = sqlite3_column_int64(st, 19);
    if (!db_job_id_valid(j->id) || !db_key_valid(j->owner) || j->step < 0 || j->total_steps < 0 || retries < 0 ||
        micro < 0 || micro > 64 || j->purged_ms < 0 ||
        retries > INT_MAX || spec_len <= 0 || result_len < 0 || (j->result_hash[0] && !db_hash_hex_valid(j->result_hash))) {
        FU_ERROR(DB_LOG, "%s: job row '%s' fails validation (corrupt or foreign row)", db->path, j->id);
        err = FU_EDB;
        goto fail;
    }
    j->retries = (int)retries;
    j->micro_batches = (uint32_t)micro;
    j->spec_len = (size_t)spec_len;
    j->result_len = (size_t)result_len;
    if (blobs) {
        size_t n = 0;
        if ((err = db_col_blob(db, st, 20, &j->spec, &n)) != FU_OK)
            goto fail;
        if (n != j->spec_len) {
            err = FU_EDB;
            goto fail;
        }
        if ((err = db_col_blob(db, st, 21, &j->result, &n)) != FU_OK)
            goto fail;
        if (n != j->result_len) {
            err = FU_EDB;
            goto fail;
        }
    }
    return FU_OK;
fail:
    job_members_free(j);
    return err;
}

static fu_err read_job_row(db_t *db, sqlite3_stmt *st, const void *blobs, void *item)
{
    return read_job(db, st, *(const bool *)blobs, item);
}

static void job_item_free(void *item)
{
    job_members_free(item);
}

/* Runs st (already bound) and collects every row into an array. */
static fu_err collect_jobs(db_t *db, sqlite3_stmt *st, bool blobs, db_job **out, size_t *n)
{
    return db_collect(db, st, "listing jobs", sizeof **out, read_job_row, &blobs, job_item_free, (void **)out, n);
}

void db_job_free(db_job **job_p)
{
    if (!job_p || !*job_p)
        return;
    job_members_free(*job_p);
    free(*job_p);
    *job_p = NULL;
}

void db_job_array_free(db_job **arr_p, size_t n)
{
    db_items_free(arr_p, n, sizeof **arr_p, job_item_free);
}

static bool idem_valid(const char *k)
{
    if (!k)
        return true;
    size_t n = strnlen(k, DB_IDEM_KEY_MAX + 1);
    return n >= 1 && n <= DB_IDEM_KEY_MAX;
}

static bool text_ok(const char *s, size_t max)
{
    return !s || strnlen(s, max + 1) <= max;
}

fu_err db_job_submit(db_t *db, const char *owner, const char *idem_key, db_job_kind kind, const void *spec,
                     size_t spec_len, const char *model_id, int64_t now_ms, char job_id[DB_JOB_ID_LEN + 1], bool *created)
{
    static const char SQL_FIND[] = "SELECT id, kind, " JOB_SPEC_OF_ROW " = ?3 FROM jobs WHERE owner = ?1 AND "
                                   "idem_key = ?2";
    static const char SQL_TAKEN[] = "SELECT 1 FROM jobs WHERE id = ?";
    static const char SQL_INSERT[] = "INSERT INTO jobs (id, owner, idem_key, kind, state, created_ms, updated_ms, "
                                     "model_id) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?)";
    static const char SQL_SPEC[] = "INSERT INTO job_specs (job_id, spec) VALUES (?, ?)";
    if (!db || !db_key_valid(owner) || !idem_valid(idem_key) || (unsigned)kind >= DB_N_KINDS || !spec ||
        spec_len == 0 || spec_len > DB_SPEC_MAX || !job_id || !created ||
        (model_id && strlen(model_id) != DB_MODEL_ID_LEN))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    fu_err err;
    bool row;
    char id[DB_JOB_ID_LEN + 1];
    if (idem_key) {
        if ((err = db_prep(db, SQL_FIND, &st)) != FU_OK ||
            (err = db_bind(db, st, "ttb", owner, idem_key, spec, spec_len)) != FU_OK ||
            (err = db_step(db, st, "looking up an idempotency key", &row)) != FU_OK)
            goto fail;
        if (row) {
            int k = 0;
            if ((err = db_col_text(db, st, 0, id, sizeof id, false)) != FU_OK ||
                (err = db_col_enum(db, st, 1, db_job_kind_names, DB_N_KINDS, &k)) != FU_OK)
                goto fail_st;
            bool same = k == (int)kind && sqlite3_column_int(st, 2) == 1;
            db_done(st);
            db_rollback(db); /* nothing written: the original submission committed long ago */
            if (!db_job_id_valid(id))
                return FU_EDB;
            if (!same) {
                FU_WARN(DB_LOG, "job %s: idempotency key reused with a different request", id);
                return FU_EEXIST;
            }
            memcpy(job_id, id, sizeof id);
            *created = false;
            return FU_OK;
        }
        db_done(st);
    }
    /* 64 random bits: a collision is unlikely but checked, not assumed away. */
    for (int tries = 0;; tries++) {
        uint8_t raw[DB_JOB_ID_LEN / 2];
        randombytes_buf(raw, sizeof raw);
        fu_hex_encode(id, raw, sizeof raw);
        if ((err = db_prep(db, SQL_TAKEN, &st)) != FU_OK || (err = db_bind(db, st, "t", id)) != FU_OK ||
            (err = db_step(db, st, "checking a new job id", &row)) != FU_OK)
            goto fail;
        db_done(st);
        if (!row)
            break;
        if (tries >= 8) {
            err = FU_EDB;
            goto fail;
        }
    }
    if ((err = db_prep(db, SQL_INSERT, &st)) != FU_OK ||
        (err = db_bind(db, st, "ttttiit", id, owner, idem_key, db_job_kind_names[kind], now_ms, now_ms, model_id)) !=
            FU_OK ||
        (err = db_run(db, st, "inserting a job")) != FU_OK || (err = db_prep(db, SQL_SPEC, &st)) != FU_OK ||
        (err = db_bind(db, st, "tb", id, spec, spec_len)) != FU_OK ||
        (err = db_run(db, st, "storing a job's spec")) != FU_OK)
        goto fail;
    if ((err = db_event_put(db, now_ms, id, NULL, "submitted", "%s, spec %zu bytes", db_job_kind_names[kind],
                            spec_len)) != FU_OK)
        goto fail;
    if ((err = db_commit(db)) != FU_OK)
        goto fail;
    memcpy(job_id, id, sizeof id);
    *created = true;
    return FU_OK;
fail_st:
    db_done(st);
fail:
    db_rollback(db);
    return err;
}

static fu_err job_get(db_t *db, const char *id, const char *owner, bool blobs, db_job **out)
{
    static const char SQL_BLOBS[] = "SELECT " JOB_COLS_BLOBS " FROM jobs WHERE id = ?1 AND (?2 IS NULL OR owner = ?2)";
    static const char SQL_BRIEF[] = "SELECT " JOB_COLS " FROM jobs WHERE id = ?1 AND (?2 IS NULL OR owner = ?2)";
    if (!db || !db_job_id_valid(id) || (owner && !db_key_valid(owner)) || !out)
        return FU_EINVAL;
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, blobs ? SQL_BLOBS : SQL_BRIEF, &st));
    FU_TRY(db_bind(db, st, "tt", id, owner));
    FU_TRY(db_step(db, st, "loading a job", &row));
    if (!row) {
        db_done(st);
        return FU_ENOTFOUND;
    }
    db_job *j = fu_calloc(1, sizeof *j);
    fu_err err = read_job(db, st, blobs, j);
    db_done(st);
    if (err != FU_OK) {
        free(j);
        return err;
    }
    *out = j;
    return FU_OK;
}

fu_err db_job_get(db_t *db, const char *id, const char *owner, db_job **out)
{
    return job_get(db, id, owner, true, out);
}

fu_err db_job_get_brief(db_t *db, const char *id, const char *owner, db_job **out)
{
    return job_get(db, id, owner, false, out);
}

fu_err db_job_list(db_t *db, const char *owner, db_job **out, size_t *n)
{
    static const char SQL[] = "SELECT " JOB_COLS " FROM jobs WHERE (?1 IS NULL OR owner = ?1) "
                              "ORDER BY created_ms, id";
    if (!db || (owner && !db_key_valid(owner)) || !out || !n)
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "t", owner));
    return collect_jobs(db, st, false, out, n);
}

fu_err db_job_counts(db_t *db, int64_t counts[DB_N_JOB_STATES])
{
    static const char SQL[] = "SELECT state, count(*) FROM jobs GROUP BY state";
    if (!db || !counts)
        return FU_EINVAL;
    for (int i = 0; i < DB_N_JOB_STATES; i++)
        counts[i] = 0;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    for (;;) {
        bool row;
        FU_TRY(db_step(db, st, "counting jobs by state", &row));
        if (!row)
            return FU_OK;
        int s;
        FU_TRY(db_col_enum(db, st, 0, db_job_state_names, DB_N_JOB_STATES, &s));
        counts[s] = sqlite3_column_int64(st, 1);
    }
}

fu_err db_owner_usage(db_t *db, const char *owner, int64_t *unfinished, int64_t *bytes)
{
    static const char SQL[] = "SELECT count(*) FILTER (WHERE state IN ('queued', 'running')), "
                              "coalesce(sum(coalesce((SELECT length(s.spec) FROM job_specs s WHERE s.job_id = "
                              "jobs.id), 0) + coalesce(length(result), 0)), 0) "
                              "FROM jobs WHERE owner = ?1";
    if (!db || !db_key_valid(owner) || !unfinished || !bytes)
        return FU_EINVAL;
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "t", owner));
    FU_TRY(db_step(db, st, "summing a client's jobs", &row));
    *unfinished = row ? sqlite3_column_int64(st, 0) : 0;
    *bytes = row ? sqlite3_column_int64(st, 1) : 0;
    db_done(st);
    return FU_OK;
}

fu_err db_jobs_unfinished(db_t *db, db_job **out, size_t *n)
{
    static const char SQL[] = "SELECT " JOB_COLS_BLOBS " FROM jobs WHERE state IN ('queued', 'running') "
                              "ORDER BY created_ms, id";
    if (!db || !out || !n)
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    return collect_jobs(db, st, true, out, n);
}

fu_err db_job_state_read(db_t *db, const char *id, const char *owner, db_job_state *out)
{
    static const char SQL[] = "SELECT state FROM jobs WHERE id = ?1 AND (?2 IS NULL OR owner = ?2)";
    sqlite3_stmt *st;
    bool row;
    int s = 0;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "tt", id, owner));
    FU_TRY(db_step(db, st, "reading a job's state", &row));
    fu_err err = row ? db_col_enum(db, st, 0, db_job_state_names, DB_N_JOB_STATES, &s) : FU_ENOTFOUND;
    db_done(st);
    if (err == FU_OK)
        *out = (db_job_state)s;
    return err;
}

fu_err db_stages_release(db_t *db, const char *job, int64_t now_ms)
{
    static const char SQL[] = "UPDATE stages SET state = 'released', lease_deadline_ms = 0, updated_ms = ? "
                              "WHERE job_id = ? AND state != 'released'";
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "it", now_ms, job));
    return db_run(db, st, "releasing stages");
}

fu_err db_job_move(db_t *db, const char *id, db_job_state from, db_job_state to, const char *reason,
                   int64_t now_ms)
{
    static const char SQL[] = "UPDATE jobs SET state = ?, reason = ?, updated_ms = ?, retries = retries + ? "
                              "WHERE id = ?";
    sqlite3_stmt *st;
    int64_t retry = from == DB_JOB_RUNNING && to == DB_JOB_QUEUED ? 1 : 0;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "ttiit", db_job_state_names[to], reason, now_ms, retry, id));
    FU_TRY(db_run(db, st, "updating a job's state"));
    if (db_job_state_final(to) && from != to)
        FU_TRY(db_stages_release(db, id, now_ms));
    if (from != to)
        FU_TRY(db_event_put(db, now_ms, id, NULL, "state", "%s -> %s%s%s", db_job_state_names[from],
                            db_job_state_names[to], reason ? ": " : "", reason ? reason : ""));
    return FU_OK;
}

fu_err db_job_set_state(db_t *db, const char *id, db_job_state to, const char *reason, int64_t now_ms)
{
    if (!db || !db_job_id_valid(id) || (unsigned)to >= DB_N_JOB_STATES || !text_ok(reason, DB_REASON_MAX))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    db_job_state from;
    fu_err err = db_job_state_read(db, id, NULL, &from);
    if (err != FU_OK)
        goto fail;
    if (!db_job_transition_ok(from, to)) {
        FU_WARN(DB_LOG, "job %s: refused transition %s -> %s", id, db_job_state_names[from], db_job_state_names[to]);
        err = FU_EPERM;
        goto fail;
    }
    if ((err = db_job_move(db, id, from, to, reason, now_ms)) != FU_OK || (err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_job_cancel(db_t *db, const char *id, const char *owner, int64_t now_ms)
{
    if (!db || !db_job_id_valid(id) || (owner && !db_key_valid(owner)))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    db_job_state from;
    fu_err err = db_job_state_read(db, id, owner, &from);
    if (err != FU_OK)
        goto fail;
    if (from == DB_JOB_CANCELLED) {
        db_rollback(db);
        return FU_OK;
    }
    if (db_job_state_final(from)) {
        err = FU_EPERM;
        goto fail;
    }
    if ((err = db_job_move(db, id, from, DB_JOB_CANCELLED, owner ? "cancelled by its owner" : "cancelled by the broker",
                        now_ms)) != FU_OK ||
        (err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_job_set_micro_batches(db_t *db, const char *id, uint32_t m)
{
    static const char SQL[] = "UPDATE jobs SET micro_batches = ? WHERE id = ?";
    if (!db || !db_job_id_valid(id) || m < 1 || m > 64)
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "it", (int64_t)m, id));
    FU_TRY(db_run(db, st, "recording the micro-batch count"));
    return sqlite3_changes(db->conn) == 1 ? FU_OK : FU_ENOTFOUND;
}

fu_err db_job_progress(db_t *db, const char *id, int64_t step, int64_t total_steps, double loss,
                       double tokens_per_s, int64_t now_ms)
{
    static const char SQL[] = "UPDATE jobs SET step = ?, total_steps = ?, loss = ?, tokens_per_s = ?, "
                              "updated_ms = ? WHERE id = ? AND state = 'running'";
    if (!db || !db_job_id_valid(id) || step < 0 || total_steps < 0 || isinf(loss) || !isfinite(tokens_per_s) ||
        tokens_per_s < 0)
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "iiddit", step, total_steps, loss, tokens_per_s, now_ms, id));
    FU_TRY(db_run(db, st, "recording progress"));
    if (sqlite3_changes(db->conn) == 1)
        return FU_OK;
    db_job_state s;
    fu_err err = db_job_state_read(db, id, NULL, &s);
    return err == FU_OK ? FU_EPERM : err;
}

fu_err db_job_complete(db_t *db, const char *id, const void *result, size_t result_len, const char *path,
                       const char *hash_hex, int64_t now_ms)
{
    static const char SQL[] = "UPDATE jobs SET result = ?, result_path = ?, result_hash = ? WHERE id = ?";
    if (!db || !db_job_id_valid(id) || (!result && !path) || (result && (result_len == 0 || result_len > DB_BLOB_MAX)) ||
        (path && (!*path || strnlen(path, DB_PATH_MAX + 1) > DB_PATH_MAX)) || (path && !hash_hex) ||
        (hash_hex && !db_hash_hex_valid(hash_hex)))
        return FU_EINVAL;
    char hash[DB_HASH_HEX_LEN + 1];
    if (result) {
        db_hash_hex(hash, result, result_len);
        if (hash_hex && sodium_memcmp(hash, hash_hex, DB_HASH_HEX_LEN) != 0)
            return FU_EAUTH;
    } else {
        memcpy(hash, hash_hex, sizeof hash);
    }
    FU_TRY(db_begin(db));
    db_job_state from;
    sqlite3_stmt *st;
    fu_err err = db_job_state_read(db, id, NULL, &from);
    if (err != FU_OK)
        goto fail;
    if (from != DB_JOB_RUNNING) {
        err = FU_EPERM;
        goto fail;
    }
    if ((err = db_prep(db, SQL, &st)) != FU_OK ||
        (err = db_bind(db, st, "bttt", result, result_len, path, hash, id)) != FU_OK ||
        (err = db_run(db, st, "storing a result")) != FU_OK ||
        (err = db_job_move(db, id, from, DB_JOB_DONE, NULL, now_ms)) != FU_OK || (err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_job_keep_partial(db_t *db, const char *id, const void *result, size_t result_len, const char *note)
{
    static const char SQL[] = "UPDATE jobs SET result = ?1, result_hash = ?2, "
                              "reason = substr(coalesce(reason, '') || ?3, 1, ?4) "
                              "WHERE id = ?5 AND state IN ('failed', 'cancelled')";
    if (!db || !db_job_id_valid(id) || !result || result_len == 0 || result_len > DB_BLOB_MAX || !note)
        return FU_EINVAL;
    char hash[DB_HASH_HEX_LEN + 1];
    db_hash_hex(hash, result, result_len);
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "bttit", result, result_len, hash, note, (int64_t)DB_REASON_MAX - 1, id));
    FU_TRY(db_run(db, st, "keeping a partial result"));
    return sqlite3_changes(db->conn) == 1 ? FU_OK : FU_EPERM;
}
