/* Internals of the broker's store shared by db.c, db_jobs.c, db_peers.c and db_ckpt.c: the handle,
 * the prepared-statement cache, checked binding/stepping/reading, transactions. Not for other
 * modules: they use db.h. */
#ifndef FU_BROKER_DB_INTERNAL_H
#define FU_BROKER_DB_INTERNAL_H

#include <sqlite3.h>

#include "db.h"

#define DB_STMT_CACHE 64 /* distinct SQL statements kept prepared per connection */

struct db {
    sqlite3 *conn;      /* the connection; owned */
    char    *path;      /* as given to db_open; owned */
    int      ckpt_keep; /* checkpoints kept per (job, stage) */
    db_options opts;    /* as opened, defaults filled in (db_open_sibling opens with them again) */
    db_commit_stats commits; /* db_commit's count and time (the broker's /metrics) */
    uint64_t compact_turn; /* db_compact calls (which kind of work goes first) */
    int      secure_saved;   /* PRAGMA secure_delete before db_compact set FAST (-1: not changed) */
    bool     vacuuming;      /* incremental vacuum is giving pages back (down to DB_VACUUM_SLACK) */
    bool     archive_halted; /* the event archive's newest row failed its hash: archiving stopped */
    int64_t  forget_idle_until_ms; /* db_compact looks for jobs and peers to forget again from this time */
    size_t   n_stmts;   /* entries used in stmts */
    struct {
        const char   *sql; /* the SQL literal (compared by address) */
        sqlite3_stmt *st;  /* its prepared statement; owned */
    } stmts[DB_STMT_CACHE];
};

/* Logs "what: sqlite message (code)" for the connection's last error and returns FU_EDB. */
fu_err db_sqlerr(db_t *db, int rc, const char *what);

/* The cached prepared statement for sql (a string literal: the cache keys on its address),
 * reset and with bindings cleared. */
FU_MUST_CHECK fu_err db_prep(db_t *db, const char *sql, sqlite3_stmt **st);
/* Resets st after use (releases its read snapshot) and clears its bindings. NULL is fine. */
void db_done(sqlite3_stmt *st);

/* Binds parameters 1.. of st from the varargs by fmt, one letter each: 't' const char * (NULL
 * binds NULL), 'b' const void *, size_t (NULL binds NULL), 'i' int64_t, 'd' double (NaN binds
 * NULL). Every bind is checked. */
FU_MUST_CHECK fu_err db_bind(db_t *db, sqlite3_stmt *st, const char *fmt, ...);
/* Steps st: *row = true for SQLITE_ROW, false for SQLITE_DONE; anything else is an error. */
FU_MUST_CHECK fu_err db_step(db_t *db, sqlite3_stmt *st, const char *what, bool *row);
/* Steps st expecting SQLITE_DONE (a write), then resets it. */
FU_MUST_CHECK fu_err db_run(db_t *db, sqlite3_stmt *st, const char *what);

/* BEGIN IMMEDIATE / COMMIT / ROLLBACK. db_rollback is a no-op outside a transaction. */
FU_MUST_CHECK fu_err db_begin(db_t *db);
FU_MUST_CHECK fu_err db_commit(db_t *db);
void db_rollback(db_t *db);

/* Column readers that validate what the file holds (FU_EDB when it is not what the schema says). */
/* Text of at most cap-1 bytes copied into buf; NULL gives "" when allow_null, else an error. */
FU_MUST_CHECK fu_err db_col_text(db_t *db, sqlite3_stmt *st, int col, char *buf, size_t cap, bool allow_null);
/* A malloc'd copy of text of at most max bytes; NULL stays NULL when allow_null. */
FU_MUST_CHECK fu_err db_col_dup(db_t *db, sqlite3_stmt *st, int col, size_t max, bool allow_null, char **out);
/* A malloc'd copy of a blob (NULL and length 0 for SQL NULL). FU_ENOMEM when it cannot be had. */
FU_MUST_CHECK fu_err db_col_blob(db_t *db, sqlite3_stmt *st, int col, uint8_t **out, size_t *len);
/* One of names[0..n) matched by the column's text; its index in *out. */
FU_MUST_CHECK fu_err db_col_enum(db_t *db, sqlite3_stmt *st, int col, const char *const *names, int n, int *out);

/* Appends an event inside the caller's transaction (detail is printf-formatted). */
FU_MUST_CHECK fu_err db_event_put(db_t *db, int64_t now_ms, const char *job, const char *peer, const char *kind,
                                  const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* The state of job id (of owner, when not NULL: another owner's job is FU_ENOTFOUND). */
FU_MUST_CHECK fu_err db_job_state_read(db_t *db, const char *id, const char *owner, db_job_state *out);
/* Reads the current row of a listing into item (db_collect); on an error it frees what it took. */
typedef fu_err (*db_row_read_fn)(db_t *db, sqlite3_stmt *st, const void *ctx, void *item);
/* Frees the members of one item (not the item). */
typedef void (*db_item_free_fn)(void *item);
/* Runs st (already bound) and reads every row with read into a new array of elem-byte items (*out,
 * *n; NULL and 0 when none). On an error the items read so far are freed with drop (may be NULL).
 * st is done either way. `what` names the listing in errors. */
FU_MUST_CHECK fu_err db_collect(db_t *db, sqlite3_stmt *st, const char *what, size_t elem, db_row_read_fn read,
                                const void *ctx, db_item_free_fn drop, void **out, size_t *n);
/* Frees an array of n elem-byte items from db_collect (members with drop, may be NULL) and sets
 * *arr_p = NULL. Idempotent. */
void db_items_free(void *arr_p, size_t n, size_t elem, db_item_free_fn drop);
/* Moves a job whose current state is `from` to `to` inside the caller's transaction (no checks). */
FU_MUST_CHECK fu_err db_job_move(db_t *db, const char *id, db_job_state from, db_job_state to, const char *reason,
                                 int64_t now_ms);

/* Stage releases shared by jobs and peers: marks job's non-released stages released. */
FU_MUST_CHECK fu_err db_stages_release(db_t *db, const char *job, int64_t now_ms);

/* Whether s is DB_HASH_HEX_LEN lower-case hex characters. */
static inline bool db_hash_hex_valid(const char *s)
{
    if (!s)
        return false;
    for (int i = 0; i < DB_HASH_HEX_LEN; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return false;
    return s[DB_HASH_HEX_LEN] == '\0';
}

extern const char *const db_job_kind_names[];   /* indexed by db_job_kind */
extern const char *const db_job_state_names[];  /* indexed by db_job_state */
extern const char *const db_peer_state_names[]; /* indexed by db_peer_state */
extern const char *const db_stage_state_names[];

#define DB_N_KINDS        3
#define DB_N_PEER_STATES  4
#define DB_N_STAGE_STATES 4

/* migrations[v] takes a store from user_version v to v + 1 (db_schema.c). */
extern const char *const db_migrations[];

#endif
