/* db: compaction, so that the store stays bounded (docs/STORE.md "Compaction"): the event archive
 * (per-day rows with counts per kind and a BLAKE2b chain over the events removed, db_event_audit),
 * checkpoints of ended jobs, the artifacts of jobs past their retention, forgetting purged jobs and gone
 * peers, and incremental vacuum. */
#include "db_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_log.h"

#define DB_LOG     "db"
#define DAY_MS     (24ll * 3600 * 1000)
#define ARCHIVE_V1 "fusion event archive v1" /* domain of an archive row's hash */
#define HEAD_EXTRA 64 /* rows read past a batch: `excluded` events of unfinished jobs stay and are skipped */
/* Whether event e stays: an `excluded` event of a queued or running job (a restarted broker reads them).
 * CASE, not AND: SQLite evaluates both sides of an AND in a result column (and before schema version 9 a
 * job's state came after its spec in the row: reading it walked the spec's overflow pages). */
#define KEEP_EXPR                                                                                          \
    "CASE WHEN e.kind = 'excluded' THEN EXISTS (SELECT 1 FROM jobs j WHERE j.id = e.job_id AND j.state IN " \
    "('queued','running')) ELSE 0 END"

/* ------------------------------------------------------------------------------------------------
 * Hashing: an event as bytes, an archive row's hash.
 */
static void put_u64(crypto_generichash_state *h, int64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)v >> (8 * i));
    crypto_generichash_update(h, b, sizeof b);
}

/* Length (4 bytes, little-endian; 0xffffffff for NULL) then the bytes: no two rows encode alike. */
static void put_str(crypto_generichash_state *h, const char *s)
{
    uint32_t n = s ? (uint32_t)strlen(s) : 0xffffffffu;
    uint8_t b[4] = {(uint8_t)n, (uint8_t)(n >> 8), (uint8_t)(n >> 16), (uint8_t)(n >> 24)};
    crypto_generichash_update(h, b, sizeof b);
    if (s)
        crypto_generichash_update(h, (const uint8_t *)s, n);
}

/* SQLite as Debian builds it zeroes every deleted page (SECURE_DELETE): megabytes of zeros through the
 * WAL for one job's checkpoints. For compaction's deletes it is FAST: what is written anyway is zeroed;
 * freed overflow pages are overwritten when reused or cut off by the incremental vacuum (at most
 * DB_VACUUM_SLACK of them stay). Set before the first delete of a db_compact, restored at its end. */
static void fast_delete(db_t *db)
{
    if (db->secure_saved >= 0)
        return;
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(db->conn, "PRAGMA secure_delete", -1, &st, NULL) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW) {
        int v = sqlite3_column_int(st, 0);
        if (v != 2 && sqlite3_exec(db->conn, "PRAGMA secure_delete = FAST", NULL, NULL, NULL) == SQLITE_OK)
            db->secure_saved = v;
    }
    sqlite3_finalize(st);
}

/* One event as read for archiving (job and peer NULL when the column is NULL). */
typedef struct {
    int64_t id, time_ms;
    char *job, *peer, *kind, *detail;
} ev_row;

static void ev_row_free(ev_row *e)
{
    free(e->job);
    free(e->peer);
    free(e->kind);
    free(e->detail);
}

/* chain = BLAKE2b-256(chain || the event): the archive row's running hash over its events in id order. */
static void fold_event(uint8_t chain[DB_HASH_LEN], const ev_row *e)
{
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, DB_HASH_LEN);
    crypto_generichash_update(&h, chain, DB_HASH_LEN);
    put_u64(&h, e->id);
    put_u64(&h, e->time_ms);
    put_str(&h, e->job);
    put_str(&h, e->peer);
    put_str(&h, e->kind);
    put_str(&h, e->detail);
    crypto_generichash_final(&h, chain, DB_HASH_LEN);
}

/* An archive row in memory. */
typedef struct {
    int64_t id; /* 0: not stored yet */
    int64_t day, first_id, last_id, first_ms, last_ms, n;
    cJSON *counts;                /* kind -> events */
    uint8_t rows[DB_HASH_LEN];    /* the running hash over its events (starts as prev) */
    uint8_t prev[DB_HASH_LEN];    /* the hash of the archive row before it (zeros for the first) */
    bool dirty;
} arc_row;

/* The hash of an archive row: its fields, counts as stored, the running hash and the previous row's. */
static void arc_hash(uint8_t out[DB_HASH_LEN], const uint8_t prev[DB_HASH_LEN], int64_t day, int64_t first_id,
                     int64_t last_id, int64_t first_ms, int64_t last_ms, int64_t n, const char *counts,
                     const uint8_t rows[DB_HASH_LEN])
{
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, DB_HASH_LEN);
    put_str(&h, ARCHIVE_V1);
    crypto_generichash_update(&h, prev, DB_HASH_LEN);
    put_u64(&h, day);
    put_u64(&h, first_id);
    put_u64(&h, last_id);
    put_u64(&h, first_ms);
    put_u64(&h, last_ms);
    put_u64(&h, n);
    put_str(&h, counts);
    crypto_generichash_update(&h, rows, DB_HASH_LEN);
    crypto_generichash_final(&h, out, DB_HASH_LEN);
}

static int64_t day_of(int64_t ms)
{
    return ms >= 0 ? ms / DAY_MS : -((-ms + DAY_MS - 1) / DAY_MS);
}

static fu_err col_hash(db_t *db, sqlite3_stmt *st, int col, uint8_t out[DB_HASH_LEN])
{
    char hex[DB_HASH_HEX_LEN + 1];
    FU_TRY(db_col_text(db, st, col, hex, sizeof hex, false));
    if (!db_hash_hex_valid(hex) || fu_hex_decode(out, DB_HASH_LEN, hex) != FU_OK) {
        FU_ERROR(DB_LOG, "%s: event archive: a hash column holds '%.64s', not a hash", db->path, hex);
        return FU_EDB;
    }
    return FU_OK;
}

/* Loads the newest archive row into *a (a->id = 0, zeros, when the archive is empty). */
static fu_err arc_load_last(db_t *db, arc_row *a)
{
    static const char SQL[] = "SELECT id, day, first_id, last_id, first_ms, last_ms, n, counts, rows_hash, prev_hash, "
                              "hash FROM event_archive ORDER BY id DESC LIMIT 1";
    memset(a, 0, sizeof *a);
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_step(db, st, "reading the event archive", &row));
    if (!row) {
        db_done(st);
        return FU_OK;
    }
    a->id = sqlite3_column_int64(st, 0);
    a->day = sqlite3_column_int64(st, 1);
    a->first_id = sqlite3_column_int64(st, 2);
    a->last_id = sqlite3_column_int64(st, 3);
    a->first_ms = sqlite3_column_int64(st, 4);
    a->last_ms = sqlite3_column_int64(st, 5);
    a->n = sqlite3_column_int64(st, 6);
    const char *counts = (const char *)sqlite3_column_text(st, 7);
    a->counts = counts ? cJSON_Parse(counts) : NULL;
    uint8_t stored[DB_HASH_LEN], want[DB_HASH_LEN];
    fu_err err = FU_OK;
    if (!cJSON_IsObject(a->counts)) {
        FU_ERROR(DB_LOG, "%s: event archive row %lld: counts are not a JSON object", db->path, (long long)a->id);
        err = FU_EDB;
    } else if ((err = col_hash(db, st, 8, a->rows)) == FU_OK && (err = col_hash(db, st, 9, a->prev)) == FU_OK &&
               (err = col_hash(db, st, 10, stored)) == FU_OK) {
        /* The chain goes on from this row: it must be what it claims (db_event_audit says the rest). */
        arc_hash(want, a->prev, a->day, a->first_id, a->last_id, a->first_ms, a->last_ms, a->n, counts, a->rows);
        if (sodium_memcmp(want, stored, DB_HASH_LEN) != 0) {
            FU_ERROR(DB_LOG, "%s: event archive row %lld does not match its hash (changed outside fusion-broker): "
                     "nothing more is archived until it is looked into (db_event_audit)", db->path, (long long)a->id);
            err = FU_EAUTH;
        }
    }
    db_done(st);
    if (err != FU_OK) {
        cJSON_Delete(a->counts);
        a->counts = NULL;
    }
    return err;
}

/* Writes a (insert when new, update when it was loaded), with its hash; *hash gets that hash. */
static fu_err arc_store(db_t *db, arc_row *a, uint8_t hash[DB_HASH_LEN])
{
    static const char SQL_INS[] = "INSERT INTO event_archive (day, first_id, last_id, first_ms, last_ms, n, counts, "
                                  "rows_hash, prev_hash, hash) VALUES (?,?,?,?,?,?,?,?,?,?)";
    static const char SQL_UPD[] = "UPDATE event_archive SET day = ?, first_id = ?, last_id = ?, first_ms = ?, "
                                  "last_ms = ?, n = ?, counts = ?, rows_hash = ?, prev_hash = ?, hash = ? WHERE id = ?";
    char *counts = cJSON_PrintUnformatted(a->counts);
    if (!counts)
        return FU_ENOMEM;
    arc_hash(hash, a->prev, a->day, a->first_id, a->last_id, a->first_ms, a->last_ms, a->n, counts, a->rows);
    char rows_hex[DB_HASH_HEX_LEN + 1], prev_hex[DB_HASH_HEX_LEN + 1], hash_hex[DB_HASH_HEX_LEN + 1];
    fu_hex_encode(rows_hex, a->rows, DB_HASH_LEN);
    fu_hex_encode(prev_hex, a->prev, DB_HASH_LEN);
    fu_hex_encode(hash_hex, hash, DB_HASH_LEN);
    sqlite3_stmt *st;
    fu_err err = db_prep(db, a->id ? SQL_UPD : SQL_INS, &st);
    if (err == FU_OK)
        err = a->id ? db_bind(db, st, "iiiiiitttti", a->day, a->first_id, a->last_id, a->first_ms, a->last_ms, a->n,
                              counts, rows_hex, prev_hex, hash_hex, a->id)
                    : db_bind(db, st, "iiiiiitttt", a->day, a->first_id, a->last_id, a->first_ms, a->last_ms, a->n,
                              counts, rows_hex, prev_hex, hash_hex);
    if (err == FU_OK)
        err = db_run(db, st, "writing the event archive");
    if (err == FU_OK && !a->id)
        a->id = sqlite3_last_insert_rowid(db->conn);
    cJSON_free(counts);
    a->dirty = false;
    return err;
}

/* Adds e to a's counts and chain. */
static void arc_add(arc_row *a, const ev_row *e)
{
    if (a->n == 0 || e->id < a->first_id)
        a->first_id = e->id;
    if (a->n == 0 || e->id > a->last_id)
        a->last_id = e->id;
    if (a->n == 0 || e->time_ms < a->first_ms)
        a->first_ms = e->time_ms;
    if (a->n == 0 || e->time_ms > a->last_ms)
        a->last_ms = e->time_ms;
    a->n++;
    cJSON *c = cJSON_GetObjectItemCaseSensitive(a->counts, e->kind);
    if (cJSON_IsNumber(c))
        cJSON_SetNumberValue(c, c->valuedouble + 1);
    else
        cJSON_AddNumberToObject(a->counts, e->kind, 1);
    fold_event(a->rows, e);
    a->dirty = true;
}

/* Reads the oldest events (at most max) into rows[]; *n how many. keep[i]: an `excluded` event of an
 * unfinished job (a restarted broker reads them back: never archived while the job may run). */
static fu_err head_read(db_t *db, int max, ev_row *rows, bool *keep, int *n)
{
    static const char SQL[] =
        "SELECT e.id, e.time_ms, e.job_id, e.peer_key, e.kind, e.detail, " KEEP_EXPR " FROM events e ORDER BY e.id LIMIT ?";
    sqlite3_stmt *st;
    *n = 0;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "i", (int64_t)max));
    fu_err err = FU_OK;
    for (;;) {
        bool row;
        if ((err = db_step(db, st, "reading the oldest events", &row)) != FU_OK || !row)
            break;
        ev_row *e = &rows[*n];
        memset(e, 0, sizeof *e);
        e->id = sqlite3_column_int64(st, 0);
        e->time_ms = sqlite3_column_int64(st, 1);
        if ((err = db_col_dup(db, st, 2, DB_JOB_ID_LEN, true, &e->job)) != FU_OK ||
            (err = db_col_dup(db, st, 3, DB_KEY_LEN, true, &e->peer)) != FU_OK ||
            (err = db_col_dup(db, st, 4, DB_EVENT_KIND_MAX, false, &e->kind)) != FU_OK ||
            (err = db_col_dup(db, st, 5, DB_EVENT_DETAIL_MAX, false, &e->detail)) != FU_OK) {
            ev_row_free(e);
            break;
        }
        keep[*n] = sqlite3_column_int(st, 6) != 0;
        (*n)++;
    }
    db_done(st);
    if (err != FU_OK) {
        for (int i = 0; i < *n; i++)
            ev_row_free(&rows[i]);
        *n = 0;
    }
    return err;
}

/* The newest event id (0 when the table is empty). */
static fu_err events_max_id(db_t *db, int64_t *out)
{
    static const char SQL[] = "SELECT coalesce(max(id), 0) FROM events";
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_step(db, st, "reading the newest event", &row));
    *out = row ? sqlite3_column_int64(st, 0) : 0;
    db_done(st);
    return FU_OK;
}

/* Whether one of the oldest HEAD_EXTRA + 1 events is past a limit and may go (ids and times only). */
static fu_err head_probe(db_t *db, int64_t cut_id, int64_t cut_ms, bool *work)
{
    static const char SQL[] =
        "SELECT e.id, e.time_ms, " KEEP_EXPR " FROM events e ORDER BY e.id LIMIT ?";
    sqlite3_stmt *st;
    *work = false;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "i", (int64_t)HEAD_EXTRA + 1));
    for (;;) {
        bool row;
        FU_TRY(db_step(db, st, "looking at the oldest events", &row));
        if (!row)
            break;
        int64_t id = sqlite3_column_int64(st, 0), t = sqlite3_column_int64(st, 1);
        if (sqlite3_column_int(st, 2))
            continue;
        *work = id <= cut_id || t < cut_ms;
        break;
    }
    db_done(st);
    return FU_OK;
}

/* One transaction: archives and deletes at most batch of the oldest events that are past a limit.
 * *archived how many; *more whether the next ones are past a limit too. */
static fu_err events_step(db_t *db, const db_compact_policy *p, int64_t now_ms, int batch, int64_t *archived,
                          bool *more)
{
    static const char SQL_DEL[] = "DELETE FROM events WHERE id = ?";
    *archived = 0;
    *more = false;
    if (p->events_max <= 0 && p->events_keep_ms <= 0)
        return FU_OK;
    /* a read before any write lock: most turns find nothing to do */
    int64_t max_id = 0;
    bool work = false;
    FU_TRY(events_max_id(db, &max_id));
    int64_t cut_id = p->events_max > 0 ? max_id - p->events_max : INT64_MIN;
    int64_t cut_ms = p->events_keep_ms > 0 ? now_ms - p->events_keep_ms : INT64_MIN;
    FU_TRY(head_probe(db, cut_id, cut_ms, &work));
    if (!work)
        return FU_OK;
    int cap = batch + HEAD_EXTRA;
    ev_row *rows = fu_calloc((size_t)cap, sizeof *rows);
    bool *keep = fu_calloc((size_t)cap, sizeof *keep);
    arc_row *arc = NULL;
    size_t n_arc = 0, cap_arc = 0;
    int n = 0;
    fast_delete(db);
    fu_err err = db_begin(db);
    if (err != FU_OK)
        goto out;
    if ((err = head_read(db, cap, rows, keep, &n)) != FU_OK)
        goto fail;
    int done = 0;
    for (int i = 0; i < n; i++) {
        const ev_row *e = &rows[i];
        if (keep[i])
            continue;
        if (!(e->id <= cut_id || e->time_ms < cut_ms))
            break; /* the oldest event within both limits: the rest are newer */
        if (done == batch) {
            *more = true;
            break;
        }
        if (n_arc == 0) { /* the archive's newest row goes on, or the chain starts */
            cap_arc = 4;
            arc = fu_calloc(cap_arc, sizeof *arc);
            if ((err = arc_load_last(db, &arc[0])) != FU_OK)
                goto fail;
            if (!arc[0].id)
                arc[0].counts = cJSON_CreateObject();
            n_arc = 1;
        }
        arc_row *a = &arc[n_arc - 1];
        int64_t day = day_of(e->time_ms);
        if (a->n > 0 && day > a->day) { /* a new day: a new row chained to this one */
            uint8_t h[DB_HASH_LEN];
            if ((err = arc_store(db, a, h)) != FU_OK)
                goto fail;
            if (n_arc == cap_arc) {
                cap_arc *= 2;
                arc = fu_realloc(arc, cap_arc * sizeof *arc);
            }
            a = &arc[n_arc++];
            memset(a, 0, sizeof *a);
            a->counts = cJSON_CreateObject();
            memcpy(a->prev, h, DB_HASH_LEN);
            memcpy(a->rows, h, DB_HASH_LEN);
        }
        if (a->n == 0)
            a->day = day;
        arc_add(a, e);
        sqlite3_stmt *st;
        if ((err = db_prep(db, SQL_DEL, &st)) != FU_OK || (err = db_bind(db, st, "i", e->id)) != FU_OK ||
            (err = db_run(db, st, "deleting an archived event")) != FU_OK)
            goto fail;
        done++;
    }
    if (n_arc && arc[n_arc - 1].dirty) {
        uint8_t h[DB_HASH_LEN];
        if ((err = arc_store(db, &arc[n_arc - 1], h)) != FU_OK)
            goto fail;
    }
    if (done == 0) {
        db_rollback(db);
        goto out;
    }
    if ((err = db_commit(db)) != FU_OK)
        goto fail;
    *archived = done;
    goto out;
fail:
    db_rollback(db);
out:
    for (size_t i = 0; i < n_arc; i++)
        cJSON_Delete(arc[i].counts);
    free(arc);
    for (int i = 0; i < n; i++)
        ev_row_free(&rows[i]);
    free(rows);
    free(keep);
    return err;
}

/* ------------------------------------------------------------------------------------------------
 * Checkpoints of ended jobs, artifacts past the retention.
 */

/* One transaction: deletes every checkpoint of one job that ended at or before before_ms. */
static fu_err ckpt_step(db_t *db, int64_t before_ms, int64_t *rows, int64_t *bytes, bool *found)
{
    /* From the few jobs that have checkpoints (a covering index), never from all the ended jobs (a GROUP BY
     * over the join made SQLite read every blob: 150 ms for 4 MiB), and through jobs_ended_id: no job row is
     * read (an ended job's result comes before updated_ms: megabytes of overflow pages for every turn). */
    static const char SQL_FIND[] = "SELECT c.job_id, (SELECT count(*) FROM checkpoints k WHERE k.job_id = c.job_id), "
                                   "(SELECT sum(length(k.data)) FROM checkpoints k WHERE k.job_id = c.job_id) FROM "
                                   "(SELECT DISTINCT job_id FROM checkpoints) c JOIN jobs AS j INDEXED BY jobs_ended_id "
                                   "ON j.id = c.job_id WHERE j.purged_ms IS NULL AND j.state IN "
                                   "('done','failed','cancelled') AND j.updated_ms <= ?1 LIMIT 1";
    static const char SQL_DEL[] = "DELETE FROM checkpoints WHERE job_id = ?";
    *rows = *bytes = 0;
    *found = false;
    sqlite3_stmt *st;
    char job[DB_JOB_ID_LEN + 1];
    bool row;
    fu_err err;
    /* found outside the transaction: the broker's loop is the only writer, and most turns find none */
    FU_TRY(db_prep(db, SQL_FIND, &st));
    FU_TRY(db_bind(db, st, "i", before_ms));
    FU_TRY(db_step(db, st, "finding checkpoints of ended jobs", &row));
    if (!row) {
        db_done(st);
        return FU_OK;
    }
    err = db_col_text(db, st, 0, job, sizeof job, false);
    int64_t n = sqlite3_column_int64(st, 1), b = sqlite3_column_int64(st, 2);
    db_done(st);
    if (err != FU_OK)
        return err;
    fast_delete(db);
    FU_TRY(db_begin(db));
    if ((err = db_prep(db, SQL_DEL, &st)) != FU_OK || (err = db_bind(db, st, "t", job)) != FU_OK ||
        (err = db_run(db, st, "deleting checkpoints of an ended job")) != FU_OK || (err = db_commit(db)) != FU_OK)
        goto fail;
    FU_DEBUG(DB_LOG, "job %s ended: its %lld checkpoints (%.1f MiB) deleted", job, (long long)n, (double)b / (1 << 20));
    *rows = n;
    *bytes = b;
    *found = true;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

#define PURGE_BATCH 4 /* jobs purged per transaction */

/* One transaction: deletes the artifacts of at most PURGE_BATCH jobs that ended before before_ms:
 * the result blob (its hash stays), the tokens after the spec text, the result file (unlinked after
 * the commit); one "purged" event each. */
static fu_err purge_step(db_t *db, int64_t before_ms, int64_t now_ms, int64_t keep_ms, int64_t *jobs,
                         int64_t *bytes, bool *more)
{
    static const char SQL_FIND[] =
        "SELECT j.id, coalesce(length(j.result), 0), (SELECT CASE WHEN instr(s.spec, x'00') > 0 THEN length(s.spec) - "
        "instr(s.spec, x'00') ELSE 0 END FROM job_specs s WHERE s.job_id = j.id), j.result_path FROM jobs j INDEXED BY "
        "jobs_ended WHERE j.purged_ms IS NULL AND j.state IN ('done','failed','cancelled') AND j.updated_ms < ?1 "
        "ORDER BY j.updated_ms LIMIT ?2";
    static const char SQL_PURGE[] = "UPDATE jobs SET result = NULL, result_path = NULL, purged_ms = ?2 WHERE id = ?1";
    /* the spec keeps its text and NUL (job_specs, schema version 9): the tokens go */
    static const char SQL_TOKENS[] = "UPDATE job_specs SET spec = substr(spec, 1, instr(spec, x'00')) "
                                     "WHERE job_id = ?1 AND instr(spec, x'00') BETWEEN 1 AND length(spec) - 1";
    static const char SQL_CK[] = "DELETE FROM checkpoints WHERE job_id = ?";
    struct {
        char id[DB_JOB_ID_LEN + 1];
        int64_t result, tokens;
        char *path;
    } j[PURGE_BATCH + 1];
    int n = 0;
    *jobs = *bytes = 0;
    *more = false;
    sqlite3_stmt *st;
    fu_err err;
    /* found outside the transaction, as in ckpt_step */
    FU_TRY(db_prep(db, SQL_FIND, &st));
    FU_TRY(db_bind(db, st, "ii", before_ms, (int64_t)PURGE_BATCH + 1));
    for (;;) {
        bool row;
        if ((err = db_step(db, st, "finding jobs past the retention", &row)) != FU_OK || !row)
            break;
        if (n == PURGE_BATCH) {
            *more = true;
            break;
        }
        j[n].path = NULL;
        if ((err = db_col_text(db, st, 0, j[n].id, sizeof j[n].id, false)) != FU_OK ||
            (err = db_col_dup(db, st, 3, DB_PATH_MAX, true, &j[n].path)) != FU_OK)
            break;
        j[n].result = sqlite3_column_int64(st, 1);
        j[n].tokens = sqlite3_column_int64(st, 2);
        n++;
    }
    db_done(st);
    if (err != FU_OK || n == 0)
        goto fail;
    fast_delete(db);
    if ((err = db_begin(db)) != FU_OK)
        goto fail;
    for (int i = 0; i < n; i++) {
        if ((err = db_prep(db, SQL_PURGE, &st)) != FU_OK || (err = db_bind(db, st, "ti", j[i].id, now_ms)) != FU_OK ||
            (err = db_run(db, st, "deleting a job's artifacts")) != FU_OK ||
            (err = db_prep(db, SQL_TOKENS, &st)) != FU_OK || (err = db_bind(db, st, "t", j[i].id)) != FU_OK ||
            (err = db_run(db, st, "deleting a job's tokens")) != FU_OK ||
            (err = db_prep(db, SQL_CK, &st)) != FU_OK || (err = db_bind(db, st, "t", j[i].id)) != FU_OK ||
            (err = db_run(db, st, "deleting a job's checkpoints")) != FU_OK ||
            (err = db_event_put(db, now_ms, j[i].id, NULL, "purged",
                                "artifacts deleted after the retention (%.3g %s after the job ended): result %lld "
                                "bytes (its hash stays), tokens %lld bytes%s",
                                keep_ms >= DAY_MS ? (double)keep_ms / DAY_MS : (double)keep_ms / 1e3,
                                keep_ms >= DAY_MS ? "days" : "seconds", (long long)j[i].result,
                                (long long)j[i].tokens, j[i].path ? ", result file" : "")) != FU_OK)
            goto fail;
    }
    if ((err = db_commit(db)) != FU_OK)
        goto fail;
    for (int i = 0; i < n; i++) {
        if (j[i].path && unlink(j[i].path) != 0 && errno != ENOENT)
            FU_WARN(DB_LOG, "job %s: its result file '%s' cannot be deleted: %s", j[i].id, j[i].path, strerror(errno));
        free(j[i].path);
        *bytes += j[i].result + j[i].tokens;
    }
    *jobs = n;
    return FU_OK;
fail:
    db_rollback(db);
    for (int i = 0; i < n; i++)
        free(j[i].path);
    return err;
}

#define FORGET_BATCH   32       /* jobs, and peers, deleted per transaction */
#define FORGET_IDLE_MS 60000ll  /* after a look that found nothing to forget, the next one a minute later */

/* One transaction: deletes at most FORGET_BATCH jobs purged before before_ms (their rows, spec texts and
 * stages: ON DELETE CASCADE), one "forgotten" event each with what the row said, and at most FORGET_BATCH
 * peers that left or died before before_ms at full reputation and that no stored stage names (a peer below
 * full reputation stays: its reputation is the key's memory, docs/SECURITY.md). */
static fu_err forget_step(db_t *db, int64_t before_ms, int64_t now_ms, int64_t *jobs, int64_t *peers, bool *more)
{
    static const char SQL_JOBS[] = "SELECT id, kind, state, coalesce(result_hash, ''), purged_ms FROM jobs INDEXED BY "
                                   "jobs_purged WHERE purged_ms IS NOT NULL AND purged_ms < ?1 ORDER BY purged_ms "
                                   "LIMIT ?2";
    static const char SQL_PEERS[] = "SELECT p.pubkey FROM peers p INDEXED BY peers_gone WHERE p.state IN "
                                    "('left','dead') AND p.reputation >= 1.0 AND p.last_seen_ms < ?1 AND NOT EXISTS "
                                    "(SELECT 1 FROM stages s WHERE s.peer_key = p.pubkey) ORDER BY p.last_seen_ms "
                                    "LIMIT ?2";
    static const char SQL_DEL_JOB[] = "DELETE FROM jobs WHERE id = ?";
    static const char SQL_DEL_PEER[] = "DELETE FROM peers WHERE pubkey = ?";
    *jobs = *peers = 0;
    *more = false;
    if (now_ms < db->forget_idle_until_ms)
        return FU_OK;
    sqlite3_stmt *st;
    fu_err err = FU_OK;
    int nj = 0, np = 0;
    bool row;
    struct {
        char id[DB_JOB_ID_LEN + 1], kind[16], state[16], hash[DB_HASH_HEX_LEN + 1];
        int64_t purged_ms;
    } j[FORGET_BATCH];
    char pk[FORGET_BATCH][DB_KEY_LEN + 1];
    fast_delete(db);
    FU_TRY(db_begin(db));
    /* the rows first, the deletes after (each query walks an index its deletes change) */
    if ((err = db_prep(db, SQL_JOBS, &st)) != FU_OK ||
        (err = db_bind(db, st, "ii", before_ms, (int64_t)FORGET_BATCH + 1)) != FU_OK)
        goto fail;
    for (;;) {
        if ((err = db_step(db, st, "finding purged jobs to forget", &row)) != FU_OK || !row)
            break;
        if (nj == FORGET_BATCH) {
            *more = true;
            break;
        }
        if ((err = db_col_text(db, st, 0, j[nj].id, sizeof j[nj].id, false)) != FU_OK ||
            (err = db_col_text(db, st, 1, j[nj].kind, sizeof j[nj].kind, false)) != FU_OK ||
            (err = db_col_text(db, st, 2, j[nj].state, sizeof j[nj].state, false)) != FU_OK ||
            (err = db_col_text(db, st, 3, j[nj].hash, sizeof j[nj].hash, false)) != FU_OK)
            break;
        j[nj].purged_ms = sqlite3_column_int64(st, 4);
        nj++;
    }
    db_done(st);
    if (err != FU_OK)
        goto fail;
    for (int i = 0; i < nj; i++) {
        sqlite3_stmt *del;
        if ((err = db_event_put(db, now_ms, j[i].id, NULL, "forgotten",
                                "%s job, %s, result BLAKE2b-256 %s: its row, spec text and stages deleted %.3g days "
                                "after its artifacts", j[i].kind, j[i].state, j[i].hash[0] ? j[i].hash : "(none)",
                                (double)(now_ms - j[i].purged_ms) / DAY_MS)) != FU_OK ||
            (err = db_prep(db, SQL_DEL_JOB, &del)) != FU_OK || (err = db_bind(db, del, "t", j[i].id)) != FU_OK ||
            (err = db_run(db, del, "forgetting a purged job")) != FU_OK)
            goto fail;
    }
    if ((err = db_prep(db, SQL_PEERS, &st)) != FU_OK ||
        (err = db_bind(db, st, "ii", before_ms, (int64_t)FORGET_BATCH + 1)) != FU_OK)
        goto fail;
    for (;;) {
        if ((err = db_step(db, st, "finding gone peers to forget", &row)) != FU_OK || !row)
            break;
        if (np == FORGET_BATCH) {
            *more = true;
            break;
        }
        if ((err = db_col_text(db, st, 0, pk[np], sizeof pk[np], false)) != FU_OK)
            break;
        np++;
    }
    db_done(st);
    if (err != FU_OK)
        goto fail;
    for (int i = 0; i < np; i++)
        if ((err = db_prep(db, SQL_DEL_PEER, &st)) != FU_OK || (err = db_bind(db, st, "t", pk[i])) != FU_OK ||
            (err = db_run(db, st, "forgetting a gone peer")) != FU_OK ||
            (err = db_event_put(db, now_ms, NULL, pk[i], "forgotten",
                                "peer gone since before the retention, at full reputation: its row deleted")) != FU_OK)
            goto fail;
    if (nj + np == 0) {
        db_rollback(db);
        db->forget_idle_until_ms = now_ms + FORGET_IDLE_MS;
        return FU_OK;
    }
    if ((err = db_commit(db)) != FU_OK)
        goto fail;
    *jobs = nj;
    *peers = np;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

static fu_err pragma_i64(db_t *db, const char *sql, int64_t *out)
{
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, sql, &st));
    FU_TRY(db_step(db, st, sql, &row));
    *out = row ? sqlite3_column_int64(st, 0) : 0;
    db_done(st);
    return FU_OK;
}

/* Gives free pages beyond DB_VACUUM_SLACK back to the file system, at most DB_VACUUM_PAGES. */
static fu_err vacuum_step(db_t *db, int64_t *pages, bool *more)
{
    static const char SQL_FREE[] = "PRAGMA freelist_count";
    static const char SQL_AV[] = "PRAGMA auto_vacuum";
    int64_t free_pages = 0, av = 0;
    *pages = 0;
    *more = false;
    FU_TRY(pragma_i64(db, SQL_AV, &av));
    FU_TRY(pragma_i64(db, SQL_FREE, &free_pages));
    /* hysteresis: starts past twice the slack, goes on down to the slack */
    if (av != 2 || free_pages <= (db->vacuuming ? DB_VACUUM_SLACK : 2 * DB_VACUUM_SLACK)) {
        db->vacuuming = false;
        return FU_OK;
    }
    int64_t n = free_pages - DB_VACUUM_SLACK;
    if (n > DB_VACUUM_PAGES)
        n = DB_VACUUM_PAGES;
    char sql[64];
    snprintf(sql, sizeof sql, "PRAGMA incremental_vacuum(%lld)", (long long)n);
    char *msg = NULL;
    int rc = sqlite3_exec(db->conn, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK) {
        FU_ERROR(DB_LOG, "%s: incremental vacuum: %s (sqlite code %d)", db->path, msg ? msg : sqlite3_errstr(rc), rc);
        sqlite3_free(msg);
        return FU_EDB;
    }
    int64_t after = free_pages;
    FU_TRY(pragma_i64(db, SQL_FREE, &after));
    *pages = free_pages - after;
    *more = db->vacuuming = after > DB_VACUUM_SLACK;
    return FU_OK;
}

fu_err db_compact(db_t *db, const db_compact_policy *policy, int64_t now_ms, db_compact_stats *out)
{
    if (!db || !policy || policy->batch < 0 || policy->events_max < 0 || policy->events_keep_ms < 0 ||
        policy->jobs_keep_ms < 0 || policy->forget_ms < 0)
        return FU_EINVAL;
    db_compact_stats s = {0};
    int batch = policy->batch ? policy->batch : DB_COMPACT_BATCH;
    double t0 = fu_clock_sec();
    fu_err err = FU_OK;
    /* events, checkpoints, artifacts, forgetting; the first kind turns with every call, so that none
     * starves another when the budget allows one transaction */
    enum { KINDS = 4 };
    bool more[KINDS] = {(policy->events_max > 0 || policy->events_keep_ms > 0) && !db->archive_halted,
                        policy->ckpt_grace_ms >= 0, policy->jobs_keep_ms > 0, policy->forget_ms > 0};
    int first = (int)(db->compact_turn++ % KINDS);
    bool ran = false;
    db->secure_saved = -1;
    for (;;) {
        bool any = false;
        for (int i = 0; i < KINDS && err == FU_OK; i++) {
            int k = (first + i) % KINDS;
            if (!more[k])
                continue;
            if (ran && fu_clock_sec() - t0 >= policy->budget_s) {
                s.more = true;
                goto vacuum;
            }
            ran = true;
            int64_t a = 0, b = 0;
            bool did = false;
            if (k == 0) {
                err = events_step(db, policy, now_ms, batch, &a, &more[0]);
                if (err == FU_EAUTH) { /* the archive's newest row was changed: stop archiving, keep serving */
                    db->archive_halted = true;
                    more[0] = false;
                    err = FU_OK;
                }
                s.events_archived += a;
                did = a > 0;
            } else if (k == 1) {
                err = ckpt_step(db, now_ms - policy->ckpt_grace_ms, &a, &b, &did);
                more[1] = did;
                s.ckpts_dropped += a;
                s.ckpt_bytes += b;
            } else if (k == 2) {
                err = purge_step(db, now_ms - policy->jobs_keep_ms, now_ms, policy->jobs_keep_ms, &a, &b, &more[2]);
                s.jobs_purged += a;
                s.purged_bytes += b;
                did = a > 0;
            } else {
                err = forget_step(db, now_ms - policy->forget_ms, now_ms, &a, &b, &more[3]);
                s.jobs_forgotten += a;
                s.peers_forgotten += b;
                did = a + b > 0;
            }
            s.commits += did;
            any |= did;
            if (!did)
                more[k] = false;
        }
        if (err != FU_OK || !any)
            break;
    }
vacuum:
    if (err == FU_OK && (!ran || fu_clock_sec() - t0 < policy->budget_s)) {
        bool vmore = false;
        err = vacuum_step(db, &s.pages_vacuumed, &vmore);
        s.commits += s.pages_vacuumed > 0;
        s.more |= vmore;
    }
    if (db->secure_saved >= 0)
        (void)sqlite3_exec(db->conn,
                           db->secure_saved == 1   ? "PRAGMA secure_delete = ON"
                           : db->secure_saved == 2 ? "PRAGMA secure_delete = FAST"
                                                   : "PRAGMA secure_delete = OFF",
                           NULL, NULL, NULL);
    s.seconds = fu_clock_sec() - t0;
    if (out)
        *out = s;
    return err;
}

/* ------------------------------------------------------------------------------------------------
 * The audit, the archive's listing, the store's figures.
 */
static fu_err audit_fail(db_audit *out, int64_t row, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static fu_err audit_fail(db_audit *out, int64_t row, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->why, sizeof out->why, fmt, ap);
    va_end(ap);
    out->bad_row = row;
    return FU_EAUTH;
}

fu_err db_event_audit(db_t *db, db_audit *out)
{
    static const char SQL[] = "SELECT id, day, first_id, last_id, first_ms, last_ms, n, counts, rows_hash, prev_hash, "
                              "hash FROM event_archive ORDER BY id";
    static const char SQL_LIVE[] = "SELECT count(*) FROM events WHERE id >= ?";
    static const char SQL_SEQ[] = "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)";
    if (!db || !out)
        return FU_EINVAL;
    memset(out, 0, sizeof *out);
    uint8_t prev[DB_HASH_LEN] = {0};
    int64_t min_first = INT64_MAX, sum_n = 0, last_id = 0;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    fu_err err = FU_OK;
    for (;;) {
        bool row;
        if ((err = db_step(db, st, "reading the event archive", &row)) != FU_OK || !row)
            break;
        int64_t id = sqlite3_column_int64(st, 0), day = sqlite3_column_int64(st, 1);
        int64_t f = sqlite3_column_int64(st, 2), l = sqlite3_column_int64(st, 3);
        int64_t fm = sqlite3_column_int64(st, 4), lm = sqlite3_column_int64(st, 5), n = sqlite3_column_int64(st, 6);
        const char *counts = (const char *)sqlite3_column_text(st, 7);
        uint8_t rows[DB_HASH_LEN], p[DB_HASH_LEN], h[DB_HASH_LEN], want[DB_HASH_LEN];
        if (col_hash(db, st, 8, rows) != FU_OK || col_hash(db, st, 9, p) != FU_OK || col_hash(db, st, 10, h) != FU_OK) {
            err = audit_fail(out, id, "a hash column is not a hash");
            break;
        }
        if (sodium_memcmp(p, prev, DB_HASH_LEN) != 0) {
            err = audit_fail(out, id, "its previous hash is not the hash of the row before it (a row removed, "
                                      "inserted or changed before it)");
            break;
        }
        arc_hash(want, p, day, f, l, fm, lm, n, counts ? counts : "", rows);
        if (sodium_memcmp(want, h, DB_HASH_LEN) != 0) {
            err = audit_fail(out, id, "its fields do not match its hash (the row was changed)");
            break;
        }
        /* counts add up to n */
        cJSON *c = counts ? cJSON_Parse(counts) : NULL;
        double total = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, c) total += cJSON_IsNumber(it) ? it->valuedouble : 0;
        cJSON_Delete(c);
        if ((int64_t)total != n || n < 1 || n > l - f + 1) {
            err = audit_fail(out, id, "its counts (%.0f) do not add up to its %lld events over ids %lld..%lld", total,
                             (long long)n, (long long)f, (long long)l);
            break;
        }
        memcpy(prev, h, DB_HASH_LEN);
        if (f < min_first)
            min_first = f;
        if (l > last_id)
            last_id = l;
        sum_n += n;
        out->rows++;
    }
    db_done(st);
    if (err != FU_OK || out->rows == 0) {
        out->events = sum_n;
        return err;
    }
    out->events = sum_n;
    /* every id issued since the first archived one is archived or still live */
    int64_t live = 0, seq = 0;
    bool row;
    FU_TRY(db_prep(db, SQL_LIVE, &st));
    FU_TRY(db_bind(db, st, "i", min_first));
    FU_TRY(db_step(db, st, "counting events", &row));
    live = row ? sqlite3_column_int64(st, 0) : 0;
    db_done(st);
    FU_TRY(db_prep(db, SQL_SEQ, &st));
    FU_TRY(db_step(db, st, "reading the event sequence", &row));
    seq = row ? sqlite3_column_int64(st, 0) : 0;
    db_done(st);
    if (seq < last_id || sum_n + live != seq - min_first + 1)
        return audit_fail(out, 0, "events %lld..%lld: %lld archived and %lld in the log, %lld missing (deleted "
                          "outside the archive)", (long long)min_first, (long long)seq, (long long)sum_n,
                          (long long)live, (long long)(seq - min_first + 1 - sum_n - live));
    return FU_OK;
}

static fu_err read_day(db_t *db, sqlite3_stmt *st, const void *ctx, void *item)
{
    (void)ctx;
    db_archive_day *d = item;
    d->id = sqlite3_column_int64(st, 0);
    d->day = sqlite3_column_int64(st, 1);
    d->first_id = sqlite3_column_int64(st, 2);
    d->last_id = sqlite3_column_int64(st, 3);
    d->first_ms = sqlite3_column_int64(st, 4);
    d->last_ms = sqlite3_column_int64(st, 5);
    d->n = sqlite3_column_int64(st, 6);
    fu_err err;
    if ((err = db_col_dup(db, st, 7, DB_EVENT_DETAIL_MAX * 4, false, &d->counts)) != FU_OK ||
        (err = db_col_text(db, st, 8, d->hash, sizeof d->hash, false)) != FU_OK) {
        free(d->counts);
        d->counts = NULL;
        return err;
    }
    return FU_OK;
}

static void day_members_free(void *item)
{
    free(((db_archive_day *)item)->counts);
}

fu_err db_event_archive_list(db_t *db, int64_t after_id, size_t limit, db_archive_day **out, size_t *n)
{
    static const char SQL[] = "SELECT id, day, first_id, last_id, first_ms, last_ms, n, counts, hash FROM "
                              "event_archive WHERE id > ? ORDER BY id LIMIT ?";
    if (!db || !out || !n)
        return FU_EINVAL;
    if (limit == 0 || limit > DB_EVENT_LIST_MAX)
        limit = DB_EVENT_LIST_MAX;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "ii", after_id, (int64_t)limit));
    return db_collect(db, st, "listing the event archive", sizeof **out, read_day, NULL, day_members_free,
                      (void **)out, n);
}

void db_event_archive_free(db_archive_day **arr_p, size_t n)
{
    db_items_free(arr_p, n, sizeof **arr_p, day_members_free);
}

fu_err db_store_stats_get(db_t *db, bool deep, db_store_stats *out)
{
    static const char SQL[] =
        "SELECT (SELECT count(*) FROM events), (SELECT coalesce(sum(n), 0) FROM event_archive), "
        "(SELECT count(*) FROM event_archive), (SELECT count(*) FROM checkpoints), "
        "(SELECT coalesce(sum(length(data)), 0) FROM checkpoints)";
    static const char SQL_DEEP[] =
        "SELECT (SELECT count(*) FROM jobs INDEXED BY jobs_by_state WHERE state IN ('done','failed','cancelled')), "
        "(SELECT count(*) FROM jobs INDEXED BY jobs_ended_id WHERE purged_ms IS NULL AND state IN "
        "('done','failed','cancelled'))";
    if (!db || !out)
        return FU_EINVAL;
    memset(out, 0, sizeof *out);
    out->jobs_ended = out->jobs_purged = -1;
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_step(db, st, "reading the store's figures", &row));
    if (row) {
        out->events = sqlite3_column_int64(st, 0);
        out->archived_events = sqlite3_column_int64(st, 1);
        out->archive_rows = sqlite3_column_int64(st, 2);
        out->checkpoints = sqlite3_column_int64(st, 3);
        out->checkpoint_bytes = sqlite3_column_int64(st, 4);
    }
    db_done(st);
    if (deep) {
        FU_TRY(db_prep(db, SQL_DEEP, &st));
        FU_TRY(db_step(db, st, "reading the store's figures", &row));
        if (row) {
            out->jobs_ended = sqlite3_column_int64(st, 0);
            out->jobs_purged = out->jobs_ended - sqlite3_column_int64(st, 1);
        }
        db_done(st);
    }
    FU_TRY(pragma_i64(db, "PRAGMA page_count", &out->pages));
    FU_TRY(pragma_i64(db, "PRAGMA freelist_count", &out->free_pages));
    FU_TRY(pragma_i64(db, "PRAGMA page_size", &out->page_size));
    return FU_OK;
}
