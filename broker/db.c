/* db: opening, migrating (the schema is db_schema.c's), the statement cache and checked SQLite helpers, events. */
#include "db_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_log.h"

#define DB_LOG "db"

/* PRAGMA application_id of a fusion store ("FUS1"): tells our file from another SQLite database. */
#define DB_APPLICATION_ID 0x46555331

const char *const db_job_kind_names[] = {"finetune", "infer", "eval"};
const char *const db_job_state_names[] = {"queued", "running", "done", "failed", "cancelled"};
const char *const db_peer_state_names[] = {"active", "backup", "left", "dead"};
const char *const db_stage_state_names[] = {"pending", "assigned", "lost", "released"};


/* ------------------------------------------------------------------------------------------------
 * Names and validation.
 */
const char *db_job_kind_name(db_job_kind k)
{
    return (unsigned)k < DB_N_KINDS ? db_job_kind_names[k] : "?";
}

const char *db_job_state_name(db_job_state s)
{
    return (unsigned)s < DB_N_JOB_STATES ? db_job_state_names[s] : "?";
}

const char *db_peer_state_name(db_peer_state s)
{
    return (unsigned)s < DB_N_PEER_STATES ? db_peer_state_names[s] : "?";
}

const char *db_stage_state_name(db_stage_state s)
{
    return (unsigned)s < DB_N_STAGE_STATES ? db_stage_state_names[s] : "?";
}

fu_err db_job_state_parse(const char *s, db_job_state *out)
{
    for (int i = 0; s && i < DB_N_JOB_STATES; i++)
        if (strcmp(s, db_job_state_names[i]) == 0) {
            *out = (db_job_state)i;
            return FU_OK;
        }
    return FU_EINVAL;
}

fu_err db_job_kind_parse(const char *s, db_job_kind *out)
{
    for (int i = 0; s && i < DB_N_KINDS; i++)
        if (strcmp(s, db_job_kind_names[i]) == 0) {
            *out = (db_job_kind)i;
            return FU_OK;
        }
    return FU_EINVAL;
}

bool db_job_state_final(db_job_state s)
{
    return s == DB_JOB_DONE || s == DB_JOB_FAILED || s == DB_JOB_CANCELLED;
}

bool db_job_transition_ok(db_job_state from, db_job_state to)
{
    if ((unsigned)from >= DB_N_JOB_STATES || (unsigned)to >= DB_N_JOB_STATES)
        return false;
    if (from == to)
        return true;
    switch (from) {
    case DB_JOB_QUEUED:
        return to == DB_JOB_RUNNING || to == DB_JOB_FAILED || to == DB_JOB_CANCELLED;
    case DB_JOB_RUNNING:
        return to == DB_JOB_QUEUED || to == DB_JOB_DONE || to == DB_JOB_FAILED || to == DB_JOB_CANCELLED;
    default:
        return false; /* final states have no way out */
    }
}

bool db_key_valid(const char *key)
{
    uint8_t raw[32];
    size_t n = 0;
    if (!key || strnlen(key, DB_KEY_LEN + 1) != DB_KEY_LEN)
        return false;
    return fu_z85_decode(raw, sizeof raw, key, &n) == FU_OK && n == sizeof raw;
}

bool db_job_id_valid(const char *id)
{
    if (!id || strnlen(id, DB_JOB_ID_LEN + 1) != DB_JOB_ID_LEN)
        return false;
    for (size_t i = 0; i < DB_JOB_ID_LEN; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f')))
            return false;
    return true;
}

void db_hash_hex(char out[DB_HASH_HEX_LEN + 1], const void *data, size_t len)
{
    uint8_t h[DB_HASH_LEN];
    crypto_generichash(h, sizeof h, (const unsigned char *)data, (unsigned long long)len, NULL, 0);
    fu_hex_encode(out, h, sizeof h);
}

/* ------------------------------------------------------------------------------------------------
 * Checked SQLite helpers.
 */
fu_err db_sqlerr(db_t *db, int rc, const char *what)
{
    FU_ERROR(DB_LOG, "%s: %s: %s (sqlite code %d)", db && db->path ? db->path : "?", what,
             db && db->conn ? sqlite3_errmsg(db->conn) : sqlite3_errstr(rc), rc);
    return FU_EDB;
}

fu_err db_prep(db_t *db, const char *sql, sqlite3_stmt **st)
{
    for (size_t i = 0; i < db->n_stmts; i++)
        if (db->stmts[i].sql == sql) {
            sqlite3_reset(db->stmts[i].st);
            sqlite3_clear_bindings(db->stmts[i].st);
            *st = db->stmts[i].st;
            return FU_OK;
        }
    sqlite3_stmt *s = NULL;
    int rc = sqlite3_prepare_v3(db->conn, sql, -1, SQLITE_PREPARE_PERSISTENT, &s, NULL);
    if (rc != SQLITE_OK || !s) {
        sqlite3_finalize(s);
        return db_sqlerr(db, rc, "preparing a statement");
    }
    if (db->n_stmts < DB_STMT_CACHE) {
        db->stmts[db->n_stmts].sql = sql;
        db->stmts[db->n_stmts].st = s;
        db->n_stmts++;
    } else {
        /* A programming error (more distinct statements than the cache holds): fail loudly. */
        sqlite3_finalize(s);
        FU_ERROR(DB_LOG, "statement cache full (raise DB_STMT_CACHE)");
        return FU_EDB;
    }
    *st = s;
    return FU_OK;
}

void db_done(sqlite3_stmt *st)
{
    if (st) {
        sqlite3_reset(st);
        sqlite3_clear_bindings(st);
    }
}

fu_err db_bind(db_t *db, sqlite3_stmt *st, const char *fmt, ...)
{
    /* One letter per parameter: a mismatch is a programming error, caught before any binding. */
    if ((int)strlen(fmt) != sqlite3_bind_parameter_count(st)) {
        FU_ERROR(DB_LOG, "%s: %d parameters bound to a statement that has %d: %s", db->path, (int)strlen(fmt),
                 sqlite3_bind_parameter_count(st), sqlite3_sql(st));
        db_done(st);
        return FU_EDB;
    }
    va_list ap;
    va_start(ap, fmt);
    int rc = SQLITE_OK;
    for (int i = 0; fmt[i] && rc == SQLITE_OK; i++) {
        int at = i + 1;
        switch (fmt[i]) {
        case 't': {
            const char *s = va_arg(ap, const char *);
            rc = s ? sqlite3_bind_text(st, at, s, -1, SQLITE_STATIC) : sqlite3_bind_null(st, at);
            break;
        }
        case 'b': {
            const void *p = va_arg(ap, const void *);
            size_t n = va_arg(ap, size_t);
            rc = p ? sqlite3_bind_blob64(st, at, p, (sqlite3_uint64)n, SQLITE_STATIC) : sqlite3_bind_null(st, at);
            break;
        }
        case 'i':
            rc = sqlite3_bind_int64(st, at, (sqlite3_int64)va_arg(ap, int64_t));
            break;
        case 'd': {
            double d = va_arg(ap, double);
            rc = isnan(d) ? sqlite3_bind_null(st, at) : sqlite3_bind_double(st, at, d);
            break;
        }
        default:
            rc = SQLITE_MISUSE;
            break;
        }
    }
    va_end(ap);
    if (rc != SQLITE_OK) {
        db_done(st);
        return db_sqlerr(db, rc, "binding a parameter");
    }
    return FU_OK;
}

fu_err db_step(db_t *db, sqlite3_stmt *st, const char *what, bool *row)
{
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        *row = true;
        return FU_OK;
    }
    if (rc == SQLITE_DONE) {
        *row = false;
        return FU_OK;
    }
    fu_err err = db_sqlerr(db, rc, what);
    db_done(st);
    return err;
}

fu_err db_run(db_t *db, sqlite3_stmt *st, const char *what)
{
    int rc = sqlite3_step(st);
    fu_err err = FU_OK;
    if (rc != SQLITE_DONE)
        err = db_sqlerr(db, rc, what);
    db_done(st);
    return err;
}

fu_err db_begin(db_t *db)
{
    static const char SQL[] = "BEGIN IMMEDIATE";
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    return db_run(db, st, "starting a transaction");
}

fu_err db_commit(db_t *db)
{
    static const char SQL[] = "COMMIT";
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    double t0 = fu_clock_sec();
    fu_err rc = db_run(db, st, "committing");
    double dt = fu_clock_sec() - t0;
    db->commits.n++;
    db->commits.sum_s += dt;
    if (dt > db->commits.max_s)
        db->commits.max_s = dt;
    return rc;
}

db_commit_stats db_commits(const db_t *db)
{
    return db->commits;
}

void db_rollback(db_t *db)
{
    static const char SQL[] = "ROLLBACK";
    if (sqlite3_get_autocommit(db->conn))
        return; /* no transaction open (SQLite may have rolled back by itself, e.g. on SQLITE_FULL) */
    sqlite3_stmt *st;
    if (db_prep(db, SQL, &st) != FU_OK)
        return;
    if (db_run(db, st, "rolling back") != FU_OK)
        FU_ERROR(DB_LOG, "%s: rollback failed; the connection may hold a transaction", db->path);
}

fu_err db_col_text(db_t *db, sqlite3_stmt *st, int col, char *buf, size_t cap, bool allow_null)
{
    const unsigned char *s = sqlite3_column_text(st, col);
    int n = sqlite3_column_bytes(st, col);
    if (!s) {
        if (allow_null && sqlite3_column_type(st, col) == SQLITE_NULL) {
            buf[0] = '\0';
            return FU_OK;
        }
        goto bad;
    }
    if (n < 0 || (size_t)n >= cap || strlen((const char *)s) != (size_t)n)
        goto bad;
    memcpy(buf, s, (size_t)n + 1);
    return FU_OK;
bad:
    FU_ERROR(DB_LOG, "%s: column '%s' holds an unexpected value (corrupt or foreign row)", db->path,
             sqlite3_column_name(st, col));
    return FU_EDB;
}

fu_err db_col_dup(db_t *db, sqlite3_stmt *st, int col, size_t max, bool allow_null, char **out)
{
    if (sqlite3_column_type(st, col) == SQLITE_NULL) {
        if (!allow_null)
            goto bad;
        *out = NULL;
        return FU_OK;
    }
    const unsigned char *s = sqlite3_column_text(st, col);
    int n = sqlite3_column_bytes(st, col);
    if (!s || n < 0 || (size_t)n > max || strlen((const char *)s) != (size_t)n)
        goto bad;
    char *c = malloc((size_t)n + 1);
    if (!c)
        return FU_ENOMEM;
    memcpy(c, s, (size_t)n + 1);
    *out = c;
    return FU_OK;
bad:
    FU_ERROR(DB_LOG, "%s: column '%s' holds an unexpected value (corrupt or foreign row)", db->path,
             sqlite3_column_name(st, col));
    return FU_EDB;
}

fu_err db_col_blob(db_t *db, sqlite3_stmt *st, int col, uint8_t **out, size_t *len)
{
    if (sqlite3_column_type(st, col) == SQLITE_NULL) {
        *out = NULL;
        *len = 0;
        return FU_OK;
    }
    const void *p = sqlite3_column_blob(st, col);
    int n = sqlite3_column_bytes(st, col);
    if (n < 0 || (n > 0 && !p)) {
        FU_ERROR(DB_LOG, "%s: cannot read blob column '%s'", db->path, sqlite3_column_name(st, col));
        return n < 0 ? FU_EDB : FU_ENOMEM;
    }
    uint8_t *c = malloc(n > 0 ? (size_t)n : 1);
    if (!c)
        return FU_ENOMEM;
    if (n > 0)
        memcpy(c, p, (size_t)n);
    *out = c;
    *len = (size_t)n;
    return FU_OK;
}

fu_err db_col_enum(db_t *db, sqlite3_stmt *st, int col, const char *const *names, int n, int *out)
{
    const unsigned char *s = sqlite3_column_text(st, col);
    for (int i = 0; s && i < n; i++)
        if (strcmp((const char *)s, names[i]) == 0) {
            *out = i;
            return FU_OK;
        }
    FU_ERROR(DB_LOG, "%s: column '%s' holds an unknown value '%.32s'", db->path, sqlite3_column_name(st, col),
             s ? (const char *)s : "(null)");
    return FU_EDB;
}

/* ------------------------------------------------------------------------------------------------
 * Open, migrate, close.
 */

/* Reads an integer PRAGMA (user_version, application_id, foreign_keys). */
static fu_err pragma_int(db_t *db, const char *sql, int64_t *out, int *rc_out)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db->conn, sql, -1, &st, NULL);
    if (rc == SQLITE_OK) {
        rc = sqlite3_step(st);
        if (rc == SQLITE_ROW) {
            *out = sqlite3_column_int64(st, 0);
            rc = SQLITE_OK;
        } else if (rc == SQLITE_DONE) {
            rc = SQLITE_CORRUPT; /* a pragma that returns no row: not what we asked */
        }
    }
    sqlite3_finalize(st);
    *rc_out = rc;
    return rc == SQLITE_OK ? FU_OK : FU_EDB;
}

/* Runs a statement that returns at most one text row and compares it with want (journal_mode). */
static fu_err pragma_expect_text(db_t *db, const char *sql, const char *want)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db->conn, sql, -1, &st, NULL);
    fu_err err = FU_OK;
    if (rc != SQLITE_OK) {
        err = db_sqlerr(db, rc, sql);
    } else if ((rc = sqlite3_step(st)) != SQLITE_ROW) {
        err = db_sqlerr(db, rc, sql);
    } else {
        const unsigned char *v = sqlite3_column_text(st, 0);
        if (!v || sqlite3_stricmp((const char *)v, want) != 0) {
            FU_ERROR(DB_LOG, "%s: '%s' gave '%s', expected '%s'", db->path, sql, v ? (const char *)v : "(null)", want);
            err = FU_EDB;
        }
    }
    sqlite3_finalize(st);
    return err;
}

static fu_err exec_sql(db_t *db, const char *sql, const char *what)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db->conn, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK) {
        FU_ERROR(DB_LOG, "%s: %s: %s (sqlite code %d)", db->path, what, msg ? msg : sqlite3_errstr(rc), rc);
        sqlite3_free(msg);
        return FU_EDB;
    }
    return FU_OK;
}

/* Checks the directory that will hold path exists, so a typo is a clear error, not SQLITE_CANTOPEN. */
static fu_err check_dir(const char *path)
{
    char *copy = fu_strdup(path);
    const char *dir = dirname(copy);
    struct stat sb;
    fu_err err = FU_OK;
    if (stat(dir, &sb) != 0) {
        FU_ERROR(DB_LOG, "cannot open job store '%s': directory '%s' %s (create it first, or choose "
                 "another --db path)", path, dir, errno == ENOENT ? "does not exist" : strerror(errno));
        err = FU_ENOTFOUND;
    } else if (!S_ISDIR(sb.st_mode)) {
        FU_ERROR(DB_LOG, "cannot open job store '%s': '%s' is not a directory (choose another --db path)",
                 path, dir);
        err = FU_ENOTFOUND;
    }
    free(copy);
    return err;
}

/* fsyncs the directory holding path, so that a file just created there survives a power loss. */
static fu_err sync_dir(const char *path)
{
    char *copy = fu_strdup(path);
    const char *dir = dirname(copy);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    fu_err err = FU_OK;
    if (fd < 0 || fsync(fd) != 0) {
        FU_ERROR(DB_LOG, "cannot sync directory '%s' of job store '%s': %s", dir, path, strerror(errno));
        err = FU_EIO;
    }
    if (fd >= 0)
        close(fd);
    free(copy);
    return err;
}

/* Is this an SQLite file that some other program uses (tables but no fusion application id)? */
static fu_err check_ours(db_t *db, int64_t app_id, int64_t version)
{
    if (app_id == DB_APPLICATION_ID)
        return FU_OK;
    if (app_id != 0) {
        FU_ERROR(DB_LOG, "'%s' is an SQLite database of another program (application_id 0x%llx), not a "
                 "fusion job store: choose another --db path", db->path, (unsigned long long)app_id);
        return FU_EPROTO;
    }
    if (version != 0) {
        FU_ERROR(DB_LOG, "'%s' has schema version %lld but no fusion mark: not a fusion job store",
                 db->path, (long long)version);
        return FU_EPROTO;
    }
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db->conn, "SELECT count(*) FROM sqlite_schema", -1, &st, NULL);
    int64_t tables = 0;
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        tables = sqlite3_column_int64(st, 0);
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_OK)
        return db_sqlerr(db, rc, "reading the schema");
    if (tables > 0) {
        FU_ERROR(DB_LOG, "'%s' is an SQLite database with tables of another program, not a fusion job "
                 "store: choose another --db path", db->path);
        return FU_EPROTO;
    }
    return FU_OK;
}

static fu_err migrate_steps(db_t *db);

/* A store made before version 7 has no auto_vacuum: freed pages stay in the file. Turning it on needs
 * one VACUUM (the file rewritten: it takes a while and as much free disk as the file): done once,
 * logged; when it fails (no room) the store keeps working without it, and is tried again at the next
 * start. */
static void incremental_vacuum_on(db_t *db)
{
    int64_t av = 0, pages = 0, psize = 0;
    int rc;
    if (pragma_int(db, "PRAGMA auto_vacuum", &av, &rc) != FU_OK || av == 2)
        return;
    (void)pragma_int(db, "PRAGMA page_count", &pages, &rc);
    (void)pragma_int(db, "PRAGMA page_size", &psize, &rc);
    FU_INFO(DB_LOG, "%s: converting the store to incremental vacuum (once: the file, %.1f MiB, is rewritten)",
            db->path, (double)(pages * psize) / (1 << 20));
    double t0 = fu_clock_sec();
    if (exec_sql(db, "PRAGMA auto_vacuum = INCREMENTAL; VACUUM", "converting to incremental vacuum") != FU_OK) {
        FU_WARN(DB_LOG, "%s: the store stays without incremental vacuum for now (freed pages are reused, not given "
                "back); it is tried again at the next start", db->path);
        return;
    }
    (void)pragma_int(db, "PRAGMA page_count", &pages, &rc);
    FU_INFO(DB_LOG, "%s: incremental vacuum on, %.1f MiB after %.1f s", db->path,
            (double)(pages * psize) / (1 << 20), fu_clock_sec() - t0);
}

/* Migrates with foreign keys off (a migration may make a referenced table again; PRAGMA
 * foreign_keys is a no-op inside a transaction), on again after. */
static fu_err migrate(db_t *db)
{
    FU_TRY(exec_sql(db, "PRAGMA foreign_keys = OFF", "migrating the schema"));
    fu_err rc = migrate_steps(db);
    fu_err on = exec_sql(db, "PRAGMA foreign_keys = ON", "migrating the schema");
    return rc != FU_OK ? rc : on;
}

/* Whether the references hold after a migration: no row of PRAGMA foreign_key_check. */
static fu_err foreign_keys_hold(db_t *db)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db->conn, "PRAGMA foreign_key_check", -1, &st, NULL);
    if (rc != SQLITE_OK)
        return db_sqlerr(db, rc, "checking foreign keys");
    rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc == SQLITE_ROW) {
        FU_ERROR(DB_LOG, "%s: a migration broke a reference between tables (PRAGMA foreign_key_check)", db->path);
        return FU_EPROTO;
    }
    return rc == SQLITE_DONE ? FU_OK : db_sqlerr(db, rc, "checking foreign keys");
}

static fu_err migrate_steps(db_t *db)
{
    for (;;) {
        FU_TRY(db_begin(db));
        int64_t v = 0, app = 0;
        int rc;
        fu_err err = FU_OK;
        /* Read again under the write lock: another process may have migrated meanwhile. */
        if (pragma_int(db, "PRAGMA user_version", &v, &rc) != FU_OK) {
            err = db_sqlerr(db, rc, "reading the schema version");
            goto fail;
        }
        if (v >= DB_SCHEMA_VERSION) {
            db_rollback(db);
            return FU_OK;
        }
        if (v < 0) {
            FU_ERROR(DB_LOG, "%s: schema version %lld is invalid", db->path, (long long)v);
            err = FU_EVERSION;
            goto fail;
        }
        if (v == 0 && (err = pragma_int(db, "PRAGMA application_id", &app, &rc)) == FU_OK)
            err = check_ours(db, app, v);
        if (err != FU_OK)
            goto fail;
        if ((err = exec_sql(db, db_migrations[v], "migrating the schema")) != FU_OK || (err = foreign_keys_hold(db)) != FU_OK)
            goto fail;
        char sql[96];
        snprintf(sql, sizeof sql, "PRAGMA user_version = %lld; PRAGMA application_id = %d", (long long)v + 1,
                 DB_APPLICATION_ID);
        if ((err = exec_sql(db, sql, "setting the schema version")) != FU_OK)
            goto fail;
        if ((err = db_commit(db)) != FU_OK)
            goto fail;
        FU_INFO(DB_LOG, "%s: schema migrated from version %lld to %lld", db->path, (long long)v, (long long)v + 1);
        continue;
    fail:
        db_rollback(db);
        return err;
    }
}

/* Runs PRAGMA quick_check (integrity_check when full) on the whole file: FU_EPROTO with the file
 * named, and how to try a recovery, when a page is damaged. */
static fu_err check_integrity(db_t *db, bool full)
{
    const char *sql = full ? "PRAGMA integrity_check(1)" : "PRAGMA quick_check(1)";
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db->conn, sql, -1, &st, NULL);
    char first[300] = "";
    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const unsigned char *v = sqlite3_column_text(st, 0);
        snprintf(first, sizeof first, "%s", v ? (const char *)v : "(null)");
        for (char *c = first; *c; c++) /* "*** in database main ***\nPage 3: ..." on one line */
            if (*c == '\n')
                *c = ' ';
        rc = SQLITE_OK;
    }
    sqlite3_finalize(st);
    if (rc == SQLITE_OK && strcmp(first, "ok") == 0)
        return FU_OK;
    if (rc != SQLITE_OK && (rc & 0xff) != SQLITE_CORRUPT && (rc & 0xff) != SQLITE_NOTADB)
        return db_sqlerr(db, rc, sql);
    FU_ERROR(DB_LOG, "job store '%s' is damaged (%s: %s): the broker will not use it. Stop anything that writes it, "
             "keep a copy of the file (with its -wal), then try `sqlite3 '%s' .recover | sqlite3 recovered.db` "
             "and start with --db recovered.db, or restore a backup",
             db->path, full ? "integrity_check" : "quick_check", first[0] ? first : sqlite3_errstr(rc), db->path);
    return FU_EPROTO;
}

/* True when path is an existing file of 0 bytes whose -wal is missing or empty too: a store with
 * nothing in it, which is not made into one without asking (db_options.init_empty). */
static bool empty_file(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0 || sb.st_size != 0)
        return false;
    char wal[4096];
    snprintf(wal, sizeof wal, "%s-wal", path);
    return stat(wal, &sb) != 0 || sb.st_size == 0;
}

fu_err db_open(const char *path, db_t **out)
{
    return db_open_opts(path, NULL, out);
}

/* Opens path with opts; `sibling`: the store is open (checked, migrated) in this process already, and
 * this is another connection to it (db_open_sibling): no creation, no checks, no migration. */
static fu_err open_store(const char *path, const db_options *opts, bool sibling, db_t **out)
{
    db_options o = {0};
    if (opts)
        o = *opts;
    if (!path || !*path || !out)
        return FU_EINVAL;
    if (o.busy_timeout_ms <= 0)
        o.busy_timeout_ms = DB_BUSY_TIMEOUT_MS;
    if (o.ckpt_keep <= 0)
        o.ckpt_keep = DB_CKPT_KEEP;
    if (sodium_init() < 0) {
        FU_ERROR(DB_LOG, "libsodium failed to initialise");
        return FU_EIO;
    }
    FU_TRY(check_dir(path));

    db_t *db = fu_calloc(1, sizeof *db);
    db->path = fu_strdup(path);
    db->ckpt_keep = o.ckpt_keep;
    db->opts = o;
    fu_err err = FU_OK;
    int rc;
    if (!o.read_only && !sibling) {
        /* A new store is private to the broker's user (SQLite gives its -wal and -shm files the
         * same mode); an existing one keeps the mode the operator gave it. */
        int fd = open(path, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
        if (fd >= 0) {
            close(fd);
            /* Make the new name itself durable: SQLite syncs the directory for the -wal file it
             * creates, not for a main file that already exists. */
            if ((err = sync_dir(path)) != FU_OK)
                goto fail;
        } else if (errno != EEXIST) {
            FU_ERROR(DB_LOG, "cannot create job store '%s': %s (check the directory's permissions)", path,
                     strerror(errno));
            err = errno == EACCES || errno == EPERM || errno == EROFS ? FU_EPERM : FU_EIO;
            goto fail;
        } else if (!o.init_empty && empty_file(path)) {
            FU_ERROR(DB_LOG, "job store '%s' is an empty file: it holds no jobs. If it is meant to be a new store, "
                     "start once with --init; if it held jobs, restore it from a backup", path);
            err = FU_EPROTO;
            goto fail;
        }
    }
    int flags = o.read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE;
    rc = sqlite3_open_v2(path, &db->conn, flags, NULL);
    if (rc != SQLITE_OK) {
        FU_ERROR(DB_LOG, "cannot open job store '%s': %s (check the path and its permissions)", path,
                 db->conn ? sqlite3_errmsg(db->conn) : sqlite3_errstr(rc));
        err = (rc & 0xff) == SQLITE_CANTOPEN || (rc & 0xff) == SQLITE_PERM ? FU_EPERM : FU_EDB;
        goto fail;
    }
    sqlite3_extended_result_codes(db->conn, 1);
    if (!o.read_only && sqlite3_db_readonly(db->conn, "main") == 1) {
        /* SQLite falls back to read-only when the file is not writable; the broker must write. */
        FU_ERROR(DB_LOG, "job store '%s' is read-only to this user: fix its permissions (and those of its "
                 "-wal and -shm files), or run fusion-broker as its owner", path);
        err = FU_EPERM;
        goto fail;
    }
    if ((rc = sqlite3_busy_timeout(db->conn, o.busy_timeout_ms)) != SQLITE_OK) {
        err = db_sqlerr(db, rc, "setting the busy timeout");
        goto fail;
    }
    /* Refuse schema tricks from a hostile file (writable_schema, shadow-table writes). */
    if ((rc = sqlite3_db_config(db->conn, SQLITE_DBCONFIG_DEFENSIVE, 1, NULL)) != SQLITE_OK) {
        err = db_sqlerr(db, rc, "enabling defensive mode");
        goto fail;
    }

    /* The first read of the file: tells a database from anything else, and its version. */
    int64_t version = 0, app = 0;
    if (pragma_int(db, "PRAGMA user_version", &version, &rc) != FU_OK ||
        pragma_int(db, "PRAGMA application_id", &app, &rc) != FU_OK) {
        if ((rc & 0xff) == SQLITE_NOTADB || (rc & 0xff) == SQLITE_CORRUPT) {
            FU_ERROR(DB_LOG, "'%s' is not a fusion job store (not an SQLite database, or damaged): choose "
                     "another --db path, or move the file away", path);
            err = FU_EPROTO;
        } else {
            err = db_sqlerr(db, rc, "reading the schema version");
        }
        goto fail;
    }
    if (version > DB_SCHEMA_VERSION) {
        FU_ERROR(DB_LOG, "job store '%s' has schema version %lld, newer than this fusion understands (%d): "
                 "it was written by a newer fusion-broker; run that version, or restore a backup",
                 path, (long long)version, DB_SCHEMA_VERSION);
        err = FU_EVERSION;
        goto fail;
    }
    if (sibling && version != DB_SCHEMA_VERSION) {
        FU_ERROR(DB_LOG, "job store '%s': another connection found schema version %lld, not %d", path,
                 (long long)version, DB_SCHEMA_VERSION);
        err = FU_EVERSION;
        goto fail;
    }
    if (!sibling &&
        ((err = check_ours(db, app, version)) != FU_OK || (err = check_integrity(db, o.full_check)) != FU_OK))
        goto fail;

    if (!o.read_only) {
        /* A new store gets incremental vacuum before anything is written to it (db_compact gives free
         * pages back); an older one is converted after its migration (incremental_vacuum_on). */
        if (!sibling && version == 0 &&
            (err = exec_sql(db, "PRAGMA auto_vacuum = INCREMENTAL", "enabling incremental vacuum")) != FU_OK)
            goto fail;
        if ((err = pragma_expect_text(db, "PRAGMA journal_mode = WAL", "wal")) != FU_OK)
            goto fail;
        if ((err = exec_sql(db, "PRAGMA synchronous = FULL", "setting synchronous=FULL")) != FU_OK)
            goto fail;
        char sql[64];
        snprintf(sql, sizeof sql, "PRAGMA journal_size_limit = %d", DB_JOURNAL_LIMIT);
        if ((err = exec_sql(db, sql, "limiting the WAL file")) != FU_OK)
            goto fail;
    }
    if ((err = exec_sql(db, "PRAGMA foreign_keys = ON", "enabling foreign keys")) != FU_OK)
        goto fail;
    int64_t fk = 0;
    if (pragma_int(db, "PRAGMA foreign_keys", &fk, &rc) != FU_OK || fk != 1) {
        FU_ERROR(DB_LOG, "%s: this SQLite cannot enforce foreign keys", path);
        err = FU_EDB;
        goto fail;
    }
    if (!o.read_only && !sibling) {
        if ((err = migrate(db)) != FU_OK)
            goto fail;
        incremental_vacuum_on(db);
    } else if (version != DB_SCHEMA_VERSION) {
        FU_ERROR(DB_LOG, "job store '%s' has schema version %lld and cannot be migrated read-only", path,
                 (long long)version);
        err = FU_EVERSION;
        goto fail;
    }
    if (o.full_check && !sibling) {
        db_audit au;
        if ((err = db_event_audit(db, &au)) != FU_OK) {
            if (err == FU_EAUTH)
                FU_ERROR(DB_LOG, "job store '%s': the event archive does not hold (row %lld: %s): events or their "
                         "archive were changed outside fusion-broker; keep a copy of the file and investigate",
                         path, (long long)au.bad_row, au.why);
            err = FU_EPROTO;
            goto fail;
        }
        FU_INFO(DB_LOG, "%s: event archive checked: %lld days, %lld events", path, (long long)au.rows,
                (long long)au.events);
    }
    if (o.max_page_count > 0) {
        char sql[64];
        snprintf(sql, sizeof sql, "PRAGMA max_page_count = %lld", (long long)o.max_page_count);
        int64_t got = 0;
        if (pragma_int(db, sql, &got, &rc) != FU_OK) {
            err = db_sqlerr(db, rc, "setting max_page_count");
            goto fail;
        }
        FU_DEBUG(DB_LOG, "%s: max_page_count %lld", path, (long long)got);
    }
    *out = db;
    return FU_OK;
fail:
    db_close(&db);
    return err;
}

fu_err db_open_opts(const char *path, const db_options *opts, db_t **out)
{
    return open_store(path, opts, false, out);
}

fu_err db_open_sibling(const db_t *db, db_t **out)
{
    if (!db || !out)
        return FU_EINVAL;
    return open_store(db->path, &db->opts, true, out);
}

void db_close(db_t **db_p)
{
    if (!db_p || !*db_p)
        return;
    db_t *db = *db_p;
    for (size_t i = 0; i < db->n_stmts; i++)
        sqlite3_finalize(db->stmts[i].st);
    if (db->conn) {
        int rc = sqlite3_close(db->conn);
        if (rc != SQLITE_OK)
            FU_ERROR(DB_LOG, "%s: close failed: %s", db->path, sqlite3_errstr(rc));
    }
    free(db->path);
    free(db);
    *db_p = NULL;
}

fu_err db_user_version(db_t *db, int *out)
{
    int64_t v = 0;
    int rc;
    if (!db || !out)
        return FU_EINVAL;
    if (pragma_int(db, "PRAGMA user_version", &v, &rc) != FU_OK)
        return db_sqlerr(db, rc, "reading the schema version");
    *out = (int)v;
    return FU_OK;
}

const char *db_path(const db_t *db)
{
    return db ? db->path : NULL;
}

/* ------------------------------------------------------------------------------------------------
 * Events.
 */
static bool event_args_ok(const char *job, const char *peer, const char *kind, const char *detail)
{
    size_t kl = kind ? strnlen(kind, DB_EVENT_KIND_MAX + 1) : 0;
    return (!job || db_job_id_valid(job)) && (!peer || db_key_valid(peer)) && kl >= 1 && kl <= DB_EVENT_KIND_MAX &&
           (!detail || strnlen(detail, DB_EVENT_DETAIL_MAX + 1) <= DB_EVENT_DETAIL_MAX);
}

static fu_err event_insert(db_t *db, int64_t now_ms, const char *job, const char *peer, const char *kind,
                           const char *detail)
{
    static const char SQL[] = "INSERT INTO events (time_ms, job_id, peer_key, kind, detail) VALUES (?,?,?,?,?)";
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "itttt", now_ms, job, peer, kind, detail ? detail : ""));
    return db_run(db, st, "appending an event");
}

fu_err db_event_put(db_t *db, int64_t now_ms, const char *job, const char *peer, const char *kind, const char *fmt,
                    ...)
{
    char detail[DB_EVENT_DETAIL_MAX + 1];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return event_insert(db, now_ms, job, peer, kind, detail);
}

fu_err db_event_add(db_t *db, int64_t now_ms, const char *job, const char *peer, const char *kind,
                    const char *detail)
{
    if (!db || !event_args_ok(job, peer, kind, detail))
        return FU_EINVAL;
    /* A single INSERT is its own durable transaction. */
    return event_insert(db, now_ms, job, peer, kind, detail);
}

fu_err db_collect(db_t *db, sqlite3_stmt *st, const char *what, size_t elem, db_row_read_fn read, const void *ctx,
                  db_item_free_fn drop, void **out, size_t *n)
{
    uint8_t *arr = NULL;
    size_t cnt = 0, cap = 0;
    fu_err err;
    for (;;) {
        bool row;
        if ((err = db_step(db, st, what, &row)) != FU_OK)
            goto fail;
        if (!row)
            break;
        if (cnt == cap) {
            cap = cap ? 2 * cap : 16;
            arr = fu_realloc(arr, cap * elem);
        }
        memset(arr + cnt * elem, 0, elem);
        if ((err = read(db, st, ctx, arr + cnt * elem)) != FU_OK)
            goto fail;
        cnt++;
    }
    db_done(st);
    *out = arr;
    *n = cnt;
    return FU_OK;
fail:
    db_done(st);
    db_items_free(&arr, cnt, elem, drop);
    return err;
}

void db_items_free(void *arr_p, size_t n, size_t elem, db_item_free_fn drop)
{
    uint8_t **pp = arr_p;
    if (!pp || !*pp)
        return;
    for (size_t i = 0; drop && i < n; i++)
        drop(*pp + i * elem);
    free(*pp);
    *pp = NULL;
}

static fu_err read_event(db_t *db, sqlite3_stmt *st, const void *ctx, void *item)
{
    (void)ctx;
    db_event *e = item;
    e->id = sqlite3_column_int64(st, 0);
    e->time_ms = sqlite3_column_int64(st, 1);
    fu_err err;
    if ((err = db_col_text(db, st, 2, e->job, sizeof e->job, true)) != FU_OK ||
        (err = db_col_text(db, st, 3, e->peer, sizeof e->peer, true)) != FU_OK ||
        (err = db_col_text(db, st, 4, e->kind, sizeof e->kind, false)) != FU_OK ||
        (err = db_col_dup(db, st, 5, DB_EVENT_DETAIL_MAX, false, &e->detail)) != FU_OK) {
        free(e->detail);
        return err;
    }
    return FU_OK;
}

static void event_members_free(void *item)
{
    free(((db_event *)item)->detail);
}

fu_err db_event_list(db_t *db, const char *job, int64_t after_id, size_t limit, db_event **out, size_t *n)
{
    static const char SQL[] = "SELECT id, time_ms, job_id, peer_key, kind, detail FROM events "
                              "WHERE id > ? AND (?2 IS NULL OR job_id = ?2) ORDER BY id LIMIT ?";
    if (!db || !out || !n || (job && !db_job_id_valid(job)))
        return FU_EINVAL;
    if (limit == 0 || limit > DB_EVENT_LIST_MAX)
        limit = DB_EVENT_LIST_MAX;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "iti", after_id, job, (int64_t)limit));
    return db_collect(db, st, "listing events", sizeof **out, read_event, NULL, event_members_free, (void **)out, n);
}

void db_event_array_free(db_event **arr_p, size_t n)
{
    db_items_free(arr_p, n, sizeof **arr_p, event_members_free);
}
