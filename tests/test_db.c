/* Tests of the broker's durable store (broker/db*.c) against a real SQLite file in a scratch
 * directory: schema and versions, idempotent submission, ownership, the job state machine,
 * checkpoints, peers, stage leases, durability across SIGKILL, and a full disk. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sodium.h>
#include <sqlite3.h>

#include "db.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_log.h"
#include "testutil.h"

/* A fresh random public key in Z85. */
/* One stage of a plan for db_stage_assign (no checkpoint of its own). */
#define SP(f, e, p, l) {.first = (f), .end = (e), .peer = (p), .lease_deadline_ms = (l)}

static void make_key(char out[DB_KEY_LEN + 1])
{
    uint8_t raw[32];
    randombytes_buf(raw, sizeof raw);
    assert_int_equal(fu_z85_encode(out, raw, sizeof raw), FU_OK);
}

/* ---- fixture: one scratch directory and store path per test, and fresh keys ---- */
typedef struct {
    char *dir;
    char  path[4096];
    char key[5][DB_KEY_LEN + 1]; /* public keys (owners, peers), different each test */
} fx;

static int fx_setup(void **state)
{
    fx *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    f->dir = tu_tmpdir("db");
    if (!f->dir) {
        free(f);
        return -1;
    }
    snprintf(f->path, sizeof f->path, "%s/broker.db", f->dir);
    for (size_t i = 0; i < sizeof f->key / sizeof f->key[0]; i++)
        make_key(f->key[i]);
    *state = f;
    return 0;
}

static int fx_teardown(void **state)
{
    fx *f = *state;
    int rc = tu_tmpdir_remove(&f->dir);
    free(f);
    return rc == 0 ? 0 : -1;
}

static db_t *open_ok(const char *path)
{
    db_t *db = NULL;
    assert_int_equal(db_open(path, &db), FU_OK);
    assert_non_null(db);
    return db;
}

static const char PROFILE[] = "{\"gflops\":{\"f32\":120.5,\"f16\":0},\"memory\":8589934592,\"backend\":\"cpu\","
                              "\"link\":{\"bw\":1.0e9,\"latency_ms\":0.2}}";

/* Runs one SQL statement on a raw connection to path (to set up states the API never makes). */
static void raw_exec(const char *path, const char *sql)
{
    sqlite3 *c = NULL;
    assert_int_equal(sqlite3_open(path, &c), SQLITE_OK);
    char *msg = NULL;
    int rc = sqlite3_exec(c, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK)
        print_message("raw_exec(%s): %s\n", sql, msg ? msg : "?");
    sqlite3_free(msg);
    assert_int_equal(rc, SQLITE_OK);
    assert_int_equal(sqlite3_close(c), SQLITE_OK);
}

/* The first column of the first row of sql on a raw connection, as an integer. */
static int64_t raw_int(const char *path, const char *sql)
{
    sqlite3 *c = NULL;
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_open_v2(path, &c, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(c, sql, -1, &st, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    int64_t v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(c);
    return v;
}

/* The migrations as broker/db_schema.c has them: a test builds a store exactly as an older version made it. */
extern const char *const db_migrations[];
#define TEST_APPLICATION_ID 0x46555331 /* "FUS1" (broker/db.c) */

/* A store as version 8 wrote it, made by migrations 0..7 on a raw connection (the spec in the jobs row,
 * before state and progress). */
static void raw_v8_store(const char *path)
{
    char sql[128];
    snprintf(sql, sizeof sql, "PRAGMA auto_vacuum = INCREMENTAL; PRAGMA journal_mode = WAL; PRAGMA application_id = %d",
             TEST_APPLICATION_ID);
    raw_exec(path, sql);
    for (int v = 0; v < 8; v++)
        raw_exec(path, db_migrations[v]);
    raw_exec(path, "PRAGMA user_version = 8");
}

/* Turns a current store back into what version 8 had (the spec in the jobs row, no job_specs, no indexes
 * of what to forget), so that a test of an older version can go on downgrading from there. */
static void raw_back_to_v8(const char *path)
{
    raw_exec(path, "ALTER TABLE jobs ADD COLUMN spec BLOB NOT NULL DEFAULT x'00';"
                   "UPDATE jobs SET spec = (SELECT s.spec FROM job_specs s WHERE s.job_id = jobs.id);"
                   "DROP TABLE job_specs; DROP INDEX jobs_purged; DROP INDEX peers_gone; PRAGMA user_version = 8");
}

static int64_t file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (int64_t)st.st_size : 0;
}

/* The bytes in path's WAL file. */
static int64_t wal_size(const char *path)
{
    char wal[4200];
    snprintf(wal, sizeof wal, "%s-wal", path);
    return file_size(wal);
}

/* Copies the WAL into the store and truncates it to 0 bytes from a second connection (the store's own
 * connection holds no read transaction between calls), so that wal_size then counts what the next
 * commits write. */
static void raw_wal_truncate(sqlite3 *c)
{
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_prepare_v2(c, "PRAGMA wal_checkpoint(TRUNCATE)", -1, &st, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    assert_int_equal(sqlite3_column_int(st, 0), 0); /* not busy */
    sqlite3_finalize(st);
}

/* Captures what the code under test logs to stderr between capture_start and capture_stop. */
static int g_saved_stderr = -1;
static char g_capture_path[4200];

static void capture_start(const fx *f)
{
    snprintf(g_capture_path, sizeof g_capture_path, "%s/stderr.txt", f->dir);
    fflush(stderr);
    g_saved_stderr = dup(2);
    int fd = open(g_capture_path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    assert_true(fd >= 0 && g_saved_stderr >= 0);
    dup2(fd, 2);
    close(fd);
}

/* Returns what was captured (caller frees). */
static char *capture_stop(void)
{
    fflush(stderr);
    dup2(g_saved_stderr, 2);
    close(g_saved_stderr);
    g_saved_stderr = -1;
    FILE *fp = fopen(g_capture_path, "r");
    assert_non_null(fp);
    char *buf = calloc(1, 65536);
    assert_non_null(buf);
    size_t n = fread(buf, 1, 65535, fp);
    buf[n] = '\0';
    fclose(fp);
    fputs(buf, stderr); /* keep it visible in the test log */
    return buf;
}

/* db_open(path) must fail with want, open nothing and log a line holding says. Returns the log
 * (caller frees). */
static char *open_refused(const fx *f, const char *path, fu_err want, const char *says)
{
    db_t *db = NULL;
    capture_start(f);
    fu_err err = db_open(path, &db);
    char *log = capture_stop();
    assert_int_equal(err, want);
    assert_null(db);
    if (!strstr(log, says))
        fail_msg("opening %s: the log does not say '%s'", path, says);
    return log;
}

static void submit_ok(db_t *db, const char *owner, const char *idem, const char *spec, char id[DB_JOB_ID_LEN + 1])
{
    bool created = false;
    assert_int_equal(db_job_submit(db, owner, idem, DB_JOB_FINETUNE, spec, strlen(spec), NULL, 1000, id, &created), FU_OK);
    assert_true(created);
    assert_true(db_job_id_valid(id));
}

/* ---------------------------------------------------------------------------------------------- */

static void test_db_schema_created(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    int v = -1;
    assert_int_equal(db_user_version(db, &v), FU_OK);
    assert_int_equal(v, DB_SCHEMA_VERSION);
    assert_string_equal(db_path(db), f->path);
    db_close(&db);
    assert_null(db);
    db_close(&db); /* idempotent */
    assert_int_equal(raw_int(f->path, "PRAGMA user_version"), DB_SCHEMA_VERSION);
    struct stat sb;
    assert_int_equal(stat(f->path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600); /* a new store is private to its user */
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN "
                                      "('peers','jobs','stages','checkpoints','events')"),
                     5);
    /* WAL is a property of the file: a plain connection sees it. */
    sqlite3 *c = NULL;
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_open(f->path, &c), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(c, "PRAGMA journal_mode", -1, &st, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(st, 0), "wal");
    sqlite3_finalize(st);
    sqlite3_close(c);
    /* An existing empty file may be a store that lost its content: refused, and left as it is, unless
     * asked (fusion-broker --init); then it is migrated forward like a new one. */
    char empty[4200];
    snprintf(empty, sizeof empty, "%s/empty.db", f->dir);
    int fd = open(empty, O_CREAT | O_WRONLY, 0600);
    assert_true(fd >= 0);
    close(fd);
    free(open_refused(f, empty, FU_EPROTO, "is an empty file"));
    assert_int_equal(stat(empty, &sb), 0);
    assert_int_equal(sb.st_size, 0);
    db_options init = {.init_empty = true};
    assert_int_equal(db_open_opts(empty, &init, &db), FU_OK);
    assert_int_equal(db_user_version(db, &v), FU_OK);
    assert_int_equal(v, DB_SCHEMA_VERSION);
    db_close(&db);
}

/* A store with a damaged page is refused at open (quick_check; integrity_check with full_check),
 * naming the file and the recovery to try; the file is left as it is. */
static void test_db_damaged_store_refused(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    for (int i = 0; i < 200; i++) { /* rows over several pages */
        char idem[16], id[DB_JOB_ID_LEN + 1];
        snprintf(idem, sizeof idem, "k%d", i);
        submit_ok(db, f->key[0], idem, "{\"steps\":10,\"note\":\"some text to fill the pages of the jobs table\"}",
                  id);
    }
    db_close(&db); /* checkpoints the WAL into the file */
    int64_t page = raw_int(f->path, "PRAGMA page_size"), pages = raw_int(f->path, "PRAGMA page_count");
    assert_true(pages >= 6);
    /* Garbage over a page in the middle: page 1 (the header, the schema) still reads. */
    FILE *fp = fopen(f->path, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, (long)(page * (pages / 2)), SEEK_SET), 0);
    for (int64_t i = 0; i < page; i++)
        fputc(0xA5, fp);
    fclose(fp);
    struct stat before, after;
    assert_int_equal(stat(f->path, &before), 0);
    char *log = open_refused(f, f->path, FU_EPROTO, "is damaged (quick_check");
    assert_non_null(strstr(log, f->path));
    assert_non_null(strstr(log, ".recover"));
    free(log);
    db_options full = {.full_check = true};
    assert_int_equal(db_open_opts(f->path, &full, &db), FU_EPROTO);
    assert_null(db);
    assert_int_equal(stat(f->path, &after), 0);
    assert_int_equal(before.st_size, after.st_size);
}

static void test_db_reopen_keeps_data(void **state)
{
    fx *f = *state;
    char id[DB_JOB_ID_LEN + 1];
    const char *owner = f->key[0], *peer = f->key[1];
    db_t *db = open_ok(f->path);
    submit_ok(db, owner, "k1", "{\"steps\":10}", id);
    assert_int_equal(db_peer_upsert(db, peer, "gpu-box", PROFILE, DB_PEER_ACTIVE, 1000, NULL), FU_OK);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 1100), FU_OK);
    assert_int_equal(db_job_progress(db, id, 3, 10, 2.5, 123.0, 1200), FU_OK);
    db_close(&db);

    db = open_ok(f->path);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, owner, &j), FU_OK);
    assert_string_equal(j->id, id);
    assert_string_equal(j->owner, owner);
    assert_string_equal(j->idem_key, "k1");
    assert_int_equal(j->kind, DB_JOB_FINETUNE);
    assert_int_equal(j->state, DB_JOB_RUNNING);
    assert_int_equal(j->spec_len, strlen("{\"steps\":10}"));
    assert_memory_equal(j->spec, "{\"steps\":10}", j->spec_len);
    assert_int_equal(j->step, 3);
    assert_int_equal(j->total_steps, 10);
    assert_true(fabs(j->loss - 2.5) < 1e-12);
    assert_true(fabs(j->tokens_per_s - 123.0) < 1e-12);
    assert_int_equal(j->created_ms, 1000);
    assert_int_equal(j->updated_ms, 1200);
    assert_null(j->result);
    assert_string_equal(j->result_hash, "");
    db_job_free(&j);
    assert_null(j);
    db_peer *p = NULL;
    assert_int_equal(db_peer_get(db, peer, &p), FU_OK);
    assert_string_equal(p->name, "gpu-box");
    assert_string_equal(p->profile, PROFILE);
    db_peer_free(&p);
    db_close(&db);
}

static void job_with_plan(db_t *db, const char *owner, const char *idem, uint32_t nstages, char id[DB_JOB_ID_LEN + 1]);
static void put_ckpt(db_t *db, const char *job, uint32_t stage, int64_t step);

/* A version-1 store (stage ranges inclusive, column node_last; jobs without model_id) opens as the
 * current version with the same stages as half-open ranges: nothing lost, nothing shifted; its
 * jobs are not pinned to a model (model_id ""). */
static void test_db_v1_stage_ranges_migrate(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    char id[DB_JOB_ID_LEN + 1];
    const char *owner = f->key[0];
    job_with_plan(db, owner, "idem-v1", 3, id);
    db_close(&db);
    /* What version 1 wrote for the same plan. */
    raw_back_to_v8(f->path);
    raw_exec(f->path, "ALTER TABLE stages RENAME COLUMN node_end TO node_last;"
                      "UPDATE stages SET node_last = node_last - 1; ALTER TABLE jobs DROP COLUMN model_id;"
                      "DROP TABLE model_hashes; DROP TABLE event_archive;"
                      "PRAGMA user_version = 1");
    db = open_ok(f->path);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_string_equal(j->model_id, "");
    db_job_free(&j);
    db_stage *st = NULL;
    size_t n = 0;
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(n, 3);
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(st[i].first, 10 * i);
        assert_int_equal(st[i].end, 10 * i + 10);
    }
    db_stage_array_free(&st, n);
    db_close(&db);
    assert_int_equal(raw_int(f->path, "PRAGMA user_version"), DB_SCHEMA_VERSION);
}

/* A version-4 store (jobs without the eval kind) becomes version 5 by making the jobs table again:
 * its stages and checkpoints, which reference the job with ON DELETE CASCADE, are all still there
 * (foreign keys are off around the rebuild), and an eval job can be stored after it. */
static void test_db_v4_jobs_rebuilt_keeps_references(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    char id[DB_JOB_ID_LEN + 1];
    job_with_plan(db, f->key[0], "idem-v4", 3, id);
    put_ckpt(db, id, 1, 5);
    db_close(&db);
    raw_back_to_v8(f->path);
    raw_exec(f->path, "DROP TABLE event_archive; PRAGMA user_version = 4");
    db = open_ok(f->path);
    db_stage *st = NULL;
    size_t n = 0;
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(n, 3);
    db_stage_array_free(&st, n);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM checkpoints"), 1);
    char eid[DB_JOB_ID_LEN + 1];
    bool created = false;
    assert_int_equal(db_job_submit(db, f->key[0], NULL, DB_JOB_EVAL, "{}", 2, NULL, 1000, eid, &created), FU_OK);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, eid, NULL, &j), FU_OK);
    assert_int_equal(j->kind, DB_JOB_EVAL);
    db_job_free(&j);
    db_close(&db);
    assert_int_equal(raw_int(f->path, "PRAGMA user_version"), DB_SCHEMA_VERSION);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM pragma_foreign_key_check"), 0);
}

static void test_db_newer_version_refused(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    db_close(&db);
    raw_exec(f->path, "PRAGMA user_version = 99");
    char *log = open_refused(f, f->path, FU_EVERSION, "newer");
    assert_non_null(strstr(log, "99"));
    free(log);
    assert_int_equal(raw_int(f->path, "PRAGMA user_version"), 99); /* left as it was */
}

static void test_db_garbage_refused(void **state)
{
    fx *f = *state;
    FILE *fp = fopen(f->path, "wb");
    assert_non_null(fp);
    for (int i = 0; i < 512; i++)
        fputs("this is not a database. ", fp);
    fclose(fp);
    struct stat before, after;
    assert_int_equal(stat(f->path, &before), 0);
    free(open_refused(f, f->path, FU_EPROTO, "not a fusion job store"));
    db_t *db = NULL;
    assert_int_equal(stat(f->path, &after), 0);
    assert_int_equal(before.st_size, after.st_size);

    /* Another program's SQLite database is refused too, and left alone. */
    char other[4200];
    snprintf(other, sizeof other, "%s/other.db", f->dir);
    raw_exec(other, "CREATE TABLE recipes (name TEXT)");
    assert_int_equal(db_open(other, &db), FU_EPROTO);
    assert_null(db);
    assert_int_equal(raw_int(other, "PRAGMA user_version"), 0);
}

static void test_db_missing_dir_refused(void **state)
{
    fx *f = *state;
    char path[4200];
    snprintf(path, sizeof path, "%s/no/such/dir/broker.db", f->dir);
    free(open_refused(f, path, FU_ENOTFOUND, "does not exist"));
    db_t *db = NULL;
    assert_int_equal(db_open("", &db), FU_EINVAL);
    assert_int_equal(db_open(NULL, &db), FU_EINVAL);
    /* A path whose "directory" is a file. */
    snprintf(path, sizeof path, "%s/broker.db/x.db", f->dir);
    db = open_ok(f->path);
    db_close(&db);
    assert_int_equal(db_open(path, &db), FU_ENOTFOUND);
}

/* A job is stored with the content id of its model; an id of the wrong length is refused. */
static void test_db_job_model_id(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    char mid[DB_MODEL_ID_LEN + 2], id[DB_JOB_ID_LEN + 1];
    snprintf(mid, sizeof mid, "m:%064d", 7);
    bool created = false;
    assert_int_equal(db_job_submit(db, f->key[0], NULL, DB_JOB_FINETUNE, "{}", 2, mid, 1, id, &created), FU_OK);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_string_equal(j->model_id, mid);
    db_job_free(&j);
    strcat(mid, "0");
    assert_int_equal(db_job_submit(db, f->key[0], NULL, DB_JOB_FINETUNE, "{}", 2, mid, 1, id, &created), FU_EINVAL);
    db_close(&db);
}

/* The micro-batch count the broker chose is stored with the job and read back after a reopen (0 until
 * chosen); counts outside 1..64 and unknown jobs are refused. */
static void test_db_job_micro_batches(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    char id[DB_JOB_ID_LEN + 1];
    bool created = false;
    assert_int_equal(db_job_submit(db, f->key[0], NULL, DB_JOB_FINETUNE, "{}", 2, NULL, 1, id, &created), FU_OK);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->micro_batches, 0);
    db_job_free(&j);
    assert_int_equal(db_job_set_micro_batches(db, id, 0), FU_EINVAL);
    assert_int_equal(db_job_set_micro_batches(db, id, 65), FU_EINVAL);
    assert_int_equal(db_job_set_micro_batches(db, "0123456789abcdef", 4), FU_ENOTFOUND);
    assert_int_equal(db_job_set_micro_batches(db, id, 8), FU_OK);
    db_close(&db);
    db = open_ok(f->path);
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->micro_batches, 8);
    db_job_free(&j);
    db_job *all = NULL;
    size_t n = 0;
    assert_int_equal(db_jobs_unfinished(db, &all, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_int_equal(all[0].micro_batches, 8);
    db_job_array_free(&all, n);
    db_close(&db);
}

/* Model hashes kept across restarts: a row round-trips, a directory is replaced in place, and at
 * most DB_MODEL_HASHES_MAX rows stay (the least recently used go). */
static void test_db_model_hashes(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    uint8_t hashes[3 * DB_HASH_LEN];
    for (size_t i = 0; i < sizeof hashes; i++)
        hashes[i] = (uint8_t)i;
    for (int i = 0; i < DB_MODEL_HASHES_MAX + 5; i++) {
        char dir[64];
        snprintf(dir, sizeof dir, "/models/m%d", i);
        db_model_hashes m = {.dir = dir, .hashes = hashes, .n_tensors = 3};
        memset(m.sig, i & 0xff, sizeof m.sig);
        snprintf(m.model_id, sizeof m.model_id, "m:%064d", i);
        assert_int_equal(db_model_hashes_put(db, &m, 1000 + i), FU_OK);
    }
    db_model_hashes m = {.dir = "/models/m0", .hashes = hashes, .n_tensors = 0};
    assert_int_equal(db_model_hashes_put(db, &m, 1), FU_EINVAL); /* no tensors, no id */
    db_model_hashes *all = NULL;
    size_t n = 0;
    assert_int_equal(db_model_hashes_all(db, &all, &n), FU_OK);
    assert_int_equal(n, DB_MODEL_HASHES_MAX);
    char want[64];
    snprintf(want, sizeof want, "/models/m%d", DB_MODEL_HASHES_MAX + 4);
    assert_string_equal(all[0].dir, want); /* newest first */
    assert_int_equal(all[0].n_tensors, 3);
    assert_memory_equal(all[0].hashes, hashes, sizeof hashes);
    for (size_t i = 0; i < n; i++)
        assert_string_not_equal(all[i].dir, "/models/m0"); /* the oldest went */
    db_model_hashes_free(&all, n);
    db_close(&db);
}

static void test_db_submit_idempotent(void **state)
{
    fx *f = *state;
    const char *a = f->key[0], *b = f->key[1];
    db_t *db = open_ok(f->path);
    const char spec[] = "{\"model\":\"tiny\"}";
    char id1[DB_JOB_ID_LEN + 1], id2[DB_JOB_ID_LEN + 1], id3[DB_JOB_ID_LEN + 1], id4[DB_JOB_ID_LEN + 1];
    bool created = false;
    assert_int_equal(db_job_submit(db, a, "key-1", DB_JOB_FINETUNE, spec, sizeof spec, NULL, 1, id1, &created), FU_OK);
    assert_true(created);
    /* Same owner, same key: the same job, nothing new. */
    assert_int_equal(db_job_submit(db, a, "key-1", DB_JOB_FINETUNE, spec, sizeof spec, NULL, 2, id2, &created), FU_OK);
    assert_false(created);
    assert_string_equal(id1, id2);
    /* Same owner, another key: a new job. */
    assert_int_equal(db_job_submit(db, a, "key-2", DB_JOB_FINETUNE, spec, sizeof spec, NULL, 3, id3, &created), FU_OK);
    assert_true(created);
    assert_string_not_equal(id1, id3);
    /* Same key, another owner: a separate job. */
    assert_int_equal(db_job_submit(db, b, "key-1", DB_JOB_FINETUNE, spec, sizeof spec, NULL, 4, id4, &created), FU_OK);
    assert_true(created);
    assert_string_not_equal(id1, id4);
    assert_string_not_equal(id3, id4);
    /* Same key, different request: refused, the key stays with the first job. */
    assert_int_equal(db_job_submit(db, a, "key-1", DB_JOB_INFER, spec, sizeof spec, NULL, 5, id2, &created), FU_EEXIST);
    assert_int_equal(db_job_submit(db, a, "key-1", DB_JOB_FINETUNE, "{}", 2, NULL, 5, id2, &created), FU_EEXIST);
    /* No key: every call is a new job. */
    assert_int_equal(db_job_submit(db, a, NULL, DB_JOB_INFER, spec, sizeof spec, NULL, 6, id2, &created), FU_OK);
    assert_true(created);
    assert_int_equal(db_job_submit(db, a, NULL, DB_JOB_INFER, spec, sizeof spec, NULL, 7, id3, &created), FU_OK);
    assert_true(created);
    assert_string_not_equal(id2, id3);
    db_job *list = NULL;
    size_t n = 0;
    assert_int_equal(db_job_list(db, a, &list, &n), FU_OK);
    assert_int_equal(n, 4);
    assert_string_equal(list[0].id, id1);
    assert_null(list[0].spec); /* lists leave the blobs out */
    assert_int_equal(list[0].spec_len, sizeof spec);
    db_job_array_free(&list, n);
    assert_null(list);
    /* One "submitted" event per job created, none for the replay. */
    db_event *ev = NULL;
    assert_int_equal(db_event_list(db, id1, 0, 0, &ev, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_string_equal(ev[0].kind, "submitted");
    db_event_array_free(&ev, n);
    /* Bad arguments. */
    char bad_owner[] = "not-a-key";
    char long_key[DB_IDEM_KEY_MAX + 2];
    memset(long_key, 'k', sizeof long_key - 1);
    long_key[sizeof long_key - 1] = '\0';
    assert_int_equal(db_job_submit(db, bad_owner, "k", DB_JOB_FINETUNE, spec, sizeof spec, NULL, 1, id2, &created), FU_EINVAL);
    assert_int_equal(db_job_submit(db, a, long_key, DB_JOB_FINETUNE, spec, sizeof spec, NULL, 1, id2, &created), FU_EINVAL);
    assert_int_equal(db_job_submit(db, a, "", DB_JOB_FINETUNE, spec, sizeof spec, NULL, 1, id2, &created), FU_EINVAL);
    assert_int_equal(db_job_submit(db, a, "k", DB_JOB_FINETUNE, spec, 0, NULL, 1, id2, &created), FU_EINVAL);
    assert_int_equal(db_job_submit(db, a, "k", DB_JOB_FINETUNE, spec, DB_SPEC_MAX + 1, NULL, 1, id2, &created), FU_EINVAL);
    assert_int_equal(db_job_submit(db, a, "k", (db_job_kind)7, spec, sizeof spec, NULL, 1, id2, &created), FU_EINVAL);
    db_close(&db);
}

static void test_db_ownership(void **state)
{
    fx *f = *state;
    const char *a = f->key[0], *b = f->key[1];
    db_t *db = open_ok(f->path);
    char ja[DB_JOB_ID_LEN + 1], jb[DB_JOB_ID_LEN + 1], ja2[DB_JOB_ID_LEN + 1];
    submit_ok(db, a, "x", "{\"a\":1}", ja);
    submit_ok(db, a, "y", "{\"a\":2}", ja2);
    submit_ok(db, b, "x", "{\"b\":1}", jb);
    db_job *j = NULL;
    /* B cannot see A's job: the same answer as for a job that does not exist. */
    assert_int_equal(db_job_get(db, ja, b, &j), FU_ENOTFOUND);
    assert_null(j);
    assert_int_equal(db_job_get(db, "0000000000000000", b, &j), FU_ENOTFOUND);
    assert_int_equal(db_job_cancel(db, ja, b, 10), FU_ENOTFOUND);
    assert_int_equal(db_job_get(db, ja, a, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_QUEUED); /* B's cancel changed nothing */
    db_job_free(&j);
    /* The broker (owner NULL) sees every job. */
    assert_int_equal(db_job_get(db, jb, NULL, &j), FU_OK);
    assert_string_equal(j->owner, b);
    db_job_free(&j);
    db_job *list = NULL;
    size_t n = 0;
    assert_int_equal(db_job_list(db, b, &list, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_string_equal(list[0].id, jb);
    db_job_array_free(&list, n);
    assert_int_equal(db_job_list(db, a, &list, &n), FU_OK);
    assert_int_equal(n, 2);
    for (size_t i = 0; i < n; i++)
        assert_string_equal(list[i].owner, a);
    db_job_array_free(&list, n);
    assert_int_equal(db_job_list(db, NULL, &list, &n), FU_OK);
    assert_int_equal(n, 3);
    db_job_array_free(&list, n);
    /* The owner can cancel; malformed ids are refused before any lookup. */
    assert_int_equal(db_job_cancel(db, ja, a, 20), FU_OK);
    assert_int_equal(db_job_get(db, "ABCDEF0123456789", a, &j), FU_EINVAL);
    assert_int_equal(db_job_get(db, "abc", a, &j), FU_EINVAL);
    assert_int_equal(db_job_get(db, "abcdef0123456789'", a, &j), FU_EINVAL);
    db_close(&db);
}

static void test_db_state_transitions(void **state)
{
    fx *f = *state;
    char id[DB_JOB_ID_LEN + 1], id2[DB_JOB_ID_LEN + 1];
    const char *a = f->key[0];
    db_t *db = open_ok(f->path);
    submit_ok(db, a, "t1", "{\"x\":1}", id);
    submit_ok(db, a, "t2", "{\"x\":2}", id2);
    db_job *j = NULL;

    /* Progress only for a running job. */
    assert_int_equal(db_job_progress(db, id, 1, 10, 3.0, 1.0, 1500), FU_EPERM);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_DONE, NULL, 1500), FU_EPERM); /* queued → done */
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 2000), FU_OK);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 2001), FU_OK); /* same state: no-op */
    assert_int_equal(db_job_progress(db, id, 1, 10, NAN, 1.0, 2100), FU_OK);
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_true(isnan(j->loss));
    db_job_free(&j);
    /* A retry goes back to queued and is counted. */
    assert_int_equal(db_job_set_state(db, id, DB_JOB_QUEUED, "waiting for 2 peers", 2200), FU_OK);
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->retries, 1);
    assert_string_equal(j->reason, "waiting for 2 peers");
    db_job_free(&j);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 2300), FU_OK);

    /* The unfinished list is what a restarted broker resumes. */
    db_job *list = NULL;
    size_t n = 0;
    assert_int_equal(db_jobs_unfinished(db, &list, &n), FU_OK);
    assert_int_equal(n, 2);
    assert_non_null(list[0].spec);
    db_job_array_free(&list, n);

    /* Complete with a result blob; a wrong hash is refused and changes nothing. */
    const char result[] = "adapter bytes";
    char bad[DB_HASH_HEX_LEN + 1], good[DB_HASH_HEX_LEN + 1];
    db_hash_hex(good, result, sizeof result);
    db_hash_hex(bad, "other", 5);
    assert_int_equal(db_job_complete(db, id, result, sizeof result, NULL, bad, 2400), FU_EAUTH);
    assert_int_equal(db_job_complete(db, id, NULL, 0, "/srv/out/adapter", NULL, 2400), FU_EINVAL);
    assert_int_equal(db_job_complete(db, id, result, sizeof result, "/srv/out/adapter", good, 2500), FU_OK);
    assert_int_equal(db_job_get(db, id, a, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_DONE);
    assert_int_equal(j->result_len, sizeof result);
    assert_memory_equal(j->result, result, sizeof result);
    assert_string_equal(j->result_path, "/srv/out/adapter");
    assert_string_equal(j->result_hash, good);
    db_job_free(&j);

    /* Nothing leaves a final state. */
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 2600), FU_EPERM);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_QUEUED, NULL, 2600), FU_EPERM);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_FAILED, NULL, 2600), FU_EPERM);
    assert_int_equal(db_job_complete(db, id, result, sizeof result, NULL, NULL, 2600), FU_EPERM);
    assert_int_equal(db_job_progress(db, id, 5, 10, 1.0, 1.0, 2600), FU_EPERM);
    assert_int_equal(db_job_cancel(db, id, a, 2600), FU_EPERM); /* a finished job cannot be cancelled */
    assert_int_equal(db_job_get(db, id, a, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_DONE);
    db_job_free(&j);

    /* Cancel a queued job; again is fine; then it stays cancelled. */
    assert_int_equal(db_job_cancel(db, id2, a, 2700), FU_OK);
    assert_int_equal(db_job_cancel(db, id2, a, 2701), FU_OK);
    assert_int_equal(db_job_set_state(db, id2, DB_JOB_RUNNING, NULL, 2800), FU_EPERM);
    assert_int_equal(db_jobs_unfinished(db, &list, &n), FU_OK);
    assert_int_equal(n, 0);
    db_job_array_free(&list, n);

    /* The table of transitions. */
    assert_true(db_job_transition_ok(DB_JOB_QUEUED, DB_JOB_RUNNING));
    assert_true(db_job_transition_ok(DB_JOB_RUNNING, DB_JOB_QUEUED));
    assert_false(db_job_transition_ok(DB_JOB_DONE, DB_JOB_RUNNING));
    assert_false(db_job_transition_ok(DB_JOB_FAILED, DB_JOB_QUEUED));
    assert_false(db_job_transition_ok(DB_JOB_CANCELLED, DB_JOB_DONE));
    assert_false(db_job_transition_ok(DB_JOB_QUEUED, DB_JOB_DONE));
    db_job_state s;
    assert_int_equal(db_job_state_parse("cancelled", &s), FU_OK);
    assert_int_equal(s, DB_JOB_CANCELLED);
    assert_int_equal(db_job_state_parse("paused", &s), FU_EINVAL);

    /* The event log tells the story of the first job. */
    db_event *ev = NULL;
    assert_int_equal(db_event_list(db, id, 0, 0, &ev, &n), FU_OK);
    assert_true(n >= 5);
    assert_string_equal(ev[0].kind, "submitted");
    assert_string_equal(ev[n - 1].kind, "state");
    assert_non_null(strstr(ev[n - 1].detail, "running -> done"));
    db_event_array_free(&ev, n);
    db_close(&db);
}

/* A job with a plan of nstages stages on one fresh peer. */
static void job_with_plan(db_t *db, const char *owner, const char *idem, uint32_t nstages, char id[DB_JOB_ID_LEN + 1])
{
    char peer[DB_KEY_LEN + 1];
    make_key(peer);
    submit_ok(db, owner, idem, "{\"ckpt\":1}", id);
    assert_int_equal(db_peer_upsert(db, peer, "p", PROFILE, DB_PEER_ACTIVE, 1000, NULL), FU_OK);
    db_stage_plan plan[8];
    assert_true(nstages <= 8);
    for (uint32_t i = 0; i < nstages; i++)
        plan[i] = (db_stage_plan){.first = 10 * i, .end = 10 * i + 10, .peer = peer, .lease_deadline_ms = 5000};
    assert_int_equal(db_stage_assign(db, id, plan, nstages, NULL, 1000), FU_OK);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 1000), FU_OK);
}

static void put_ckpt(db_t *db, const char *job, uint32_t stage, int64_t step)
{
    char data[64], hash[DB_HASH_HEX_LEN + 1];
    int n = snprintf(data, sizeof data, "state of stage %u at step %lld", stage, (long long)step);
    db_hash_hex(hash, data, (size_t)n);
    assert_int_equal(db_ckpt_put(db, job, stage, step, data, (size_t)n, hash, -1, 1000 + step), FU_OK);
}

static bool has_ckpt(db_t *db, const char *job, uint32_t stage, int64_t step)
{
    db_ckpt *c = NULL;
    fu_err err = db_ckpt_get(db, job, stage, step, &c);
    assert_true(err == FU_OK || err == FU_ENOTFOUND);
    if (err == FU_OK) {
        assert_int_equal(c->step, step);
        assert_int_equal(c->stage, stage);
    }
    db_ckpt_free(&c);
    return err == FU_OK;
}

static void test_db_ckpt_hash_and_common_step(void **state)
{
    fx *f = *state;
    char id[DB_JOB_ID_LEN + 1];
    const char *a = f->key[0];
    db_t *db = open_ok(f->path);
    job_with_plan(db, a, "c", 3, id);
    int64_t step = -1;
    assert_int_equal(db_ckpt_common_step(db, id, &step), FU_ENOTFOUND);

    /* A hash that does not match the data: FU_EAUTH and nothing stored. */
    const char data[] = "adapter B and AdamW moments";
    char wrong[DB_HASH_HEX_LEN + 1], right[DB_HASH_HEX_LEN + 1];
    db_hash_hex(right, data, sizeof data);
    memcpy(wrong, right, sizeof wrong);
    wrong[0] = wrong[0] == 'a' ? 'b' : 'a';
    assert_int_equal(db_ckpt_put(db, id, 0, 2, data, sizeof data, wrong, -1, 1000), FU_EAUTH);
    assert_false(has_ckpt(db, id, 0, 2));
    assert_int_equal(db_ckpt_put(db, id, 0, 2, data, sizeof data, "xyz", -1, 1000), FU_EINVAL);
    assert_int_equal(db_ckpt_put(db, id, 0, 2, data, sizeof data, right, -1, 1000), FU_OK);
    db_ckpt *c = NULL;
    assert_int_equal(db_ckpt_get(db, id, 0, -1, &c), FU_OK);
    assert_int_equal(c->len, sizeof data);
    assert_memory_equal(c->data, data, sizeof data);
    assert_string_equal(c->hash, right);
    db_ckpt_free(&c);
    assert_null(c);

    /* Stage 0: 2, 4, 6; stage 1: 2, 4; stage 2: 2, 4, 6 → every stage has 4. */
    put_ckpt(db, id, 0, 4);
    put_ckpt(db, id, 0, 6);
    put_ckpt(db, id, 1, 2);
    put_ckpt(db, id, 1, 4);
    put_ckpt(db, id, 2, 2);
    assert_int_equal(db_ckpt_common_step(db, id, &step), FU_OK);
    assert_int_equal(step, 2);
    put_ckpt(db, id, 2, 4);
    put_ckpt(db, id, 2, 6);
    assert_int_equal(db_ckpt_common_step(db, id, &step), FU_OK);
    assert_int_equal(step, 4);
    put_ckpt(db, id, 1, 6);
    assert_int_equal(db_ckpt_common_step(db, id, &step), FU_OK);
    assert_int_equal(step, 6);
    /* A run starting from step 6 (keep_step): newer checkpoints of every stage (7, 8, 9, 10: the run
     * before, still at work) move the newest common step past 6 and would prune it; they do not.
     * Without keep_step it goes. */
    for (int64_t k = 7; k <= 10; k++)
        for (uint32_t s = 0; s < 3; s++) {
            char d[64], h[DB_HASH_HEX_LEN + 1];
            int n = snprintf(d, sizeof d, "state of stage %u at step %lld", s, (long long)k);
            db_hash_hex(h, d, (size_t)n);
            assert_int_equal(db_ckpt_put(db, id, s, k, d, (size_t)n, h, 6, 2000 + k), FU_OK);
        }
    assert_int_equal(db_ckpt_common_step(db, id, &step), FU_OK);
    assert_int_equal(step, 10);
    for (uint32_t s = 0; s < 3; s++)
        assert_true(has_ckpt(db, id, s, 6));
    put_ckpt(db, id, 0, 11);
    assert_false(has_ckpt(db, id, 0, 6));
    assert_true(has_ckpt(db, id, 1, 6));
    /* A checkpoint of a stage outside the plan does not count. */
    put_ckpt(db, id, 7, 12);
    assert_int_equal(db_ckpt_common_step(db, id, &step), FU_OK);
    assert_int_equal(step, 10);
    /* The newest of one stage, and an unknown job. */
    assert_int_equal(db_ckpt_get(db, id, 1, -1, &c), FU_OK);
    assert_int_equal(c->step, 10);
    db_ckpt_free(&c);
    assert_int_equal(db_ckpt_put(db, "0123456789abcdef", 0, 1, data, sizeof data, right, -1, 1000), FU_ENOTFOUND);

    /* Damage in the file is noticed on read. */
    db_close(&db);
    char sql[256];
    snprintf(sql, sizeof sql, "UPDATE checkpoints SET data = X'00' WHERE job_id = '%s' AND stage_idx = 1 AND step = 10",
             id);
    raw_exec(f->path, sql);
    db = open_ok(f->path);
    assert_int_equal(db_ckpt_get(db, id, 1, 10, &c), FU_EAUTH);
    assert_null(c);
    /* No checkpoints for a finished job. */
    assert_int_equal(db_job_cancel(db, id, a, 3000), FU_OK);
    assert_int_equal(db_ckpt_put(db, id, 0, 8, data, sizeof data, right, -1, 3000), FU_EPERM);
    db_close(&db);
}

/* A re-plan that carries checkpoints cut for its stages replaces every checkpoint of the job with
 * them in the same commit; they must come for every stage or none, all of one step. */
static void test_db_ckpt_recut_replaces_the_old_plan(void **state)
{
    fx *f = *state;
    char id[DB_JOB_ID_LEN + 1], peer[DB_KEY_LEN + 1];
    db_t *db = open_ok(f->path);
    job_with_plan(db, f->key[0], "r", 3, id);
    for (uint32_t s = 0; s < 3; s++) {
        put_ckpt(db, id, s, 10);
        put_ckpt(db, id, s, 20);
    }
    make_key(peer);
    assert_int_equal(db_peer_upsert(db, peer, "q", PROFILE, DB_PEER_ACTIVE, 1000, NULL), FU_OK);
    static const uint8_t a[] = "stage 0 of the new plan", b[] = "stage 1 of the new plan";
    db_stage_plan two[2] = {SP(0, 15, peer, 9000), SP(15, 30, peer, 9000)};
    two[0].ckpt = a, two[0].ckpt_len = sizeof a, two[0].ckpt_step = 20;
    assert_int_equal(db_stage_assign(db, id, two, 2, NULL, 2000), FU_EINVAL); /* stage 1 has none */
    two[1].ckpt = b, two[1].ckpt_len = sizeof b, two[1].ckpt_step = 10;
    assert_int_equal(db_stage_assign(db, id, two, 2, NULL, 2000), FU_EINVAL); /* two steps */
    two[1].ckpt_step = 20;
    assert_int_equal(db_stage_assign(db, id, two, 2, NULL, 2000), FU_OK);
    int64_t step = -1;
    assert_int_equal(db_ckpt_common_step(db, id, &step), FU_OK);
    assert_int_equal(step, 20);
    db_ckpt *c = NULL;
    assert_int_equal(db_ckpt_get(db, id, 1, 20, &c), FU_OK); /* hash checked on the way out */
    assert_int_equal(c->len, sizeof b);
    assert_memory_equal(c->data, b, sizeof b);
    db_ckpt_free(&c);
    assert_false(has_ckpt(db, id, 2, 20)); /* the old plan's are gone, older steps too */
    assert_false(has_ckpt(db, id, 0, 10));
    db_close(&db);
}

static void test_db_ckpt_pruning_keeps_newest(void **state)
{
    fx *f = *state;
    char id[DB_JOB_ID_LEN + 1], id2[DB_JOB_ID_LEN + 1];
    const char *a = f->key[0];
    db_options o = {.ckpt_keep = 3};
    db_t *db = NULL;
    assert_int_equal(db_open_opts(f->path, &o, &db), FU_OK);

    /* One stage: only the newest 3 steps remain. */
    job_with_plan(db, a, "one", 1, id);
    for (int64_t s = 1; s <= 10; s++)
        put_ckpt(db, id, 0, s);
    for (int64_t s = 1; s <= 10; s++)
        assert_int_equal(has_ckpt(db, id, 0, s), s >= 8);
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT count(*) FROM checkpoints WHERE job_id = '%s'", id);
    assert_int_equal(raw_int(f->path, sql), 3);

    /* Two stages, stage 1 behind at step 2: stage 0 keeps its newest 3 and the common step 2. */
    job_with_plan(db, a, "two", 2, id2);
    put_ckpt(db, id2, 1, 2);
    for (int64_t s = 1; s <= 10; s++)
        put_ckpt(db, id2, 0, s);
    for (int64_t s = 1; s <= 10; s++)
        assert_int_equal(has_ckpt(db, id2, 0, s), s >= 8 || s == 2);
    int64_t step = -1;
    assert_int_equal(db_ckpt_common_step(db, id2, &step), FU_OK);
    assert_int_equal(step, 2);
    /* Re-storing a step replaces it rather than adding one. */
    put_ckpt(db, id2, 1, 2);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM checkpoints WHERE job_id = '%s' AND stage_idx = 1", id2);
    assert_int_equal(raw_int(f->path, sql), 1);
    db_close(&db);
}

static void test_db_peers(void **state)
{
    fx *f = *state;
    const char *k1 = f->key[0], *k2 = f->key[1], *k3 = f->key[2];
    db_t *db = open_ok(f->path);
    bool created = false;
    assert_int_equal(db_peer_upsert(db, k1, "alpha", PROFILE, DB_PEER_ACTIVE, 1000, &created), FU_OK);
    assert_true(created);
    assert_int_equal(db_peer_upsert(db, k2, "beta", "{}", DB_PEER_BACKUP, 1100, &created), FU_OK);
    assert_true(created);
    /* Re-registering keeps join time and reputation, replaces the rest. */
    double rep = -1;
    assert_int_equal(db_peer_reputation_adjust(db, k1, -0.25, 1150, &rep), FU_OK);
    assert_true(fabs(rep - 0.75) < 1e-12);
    assert_int_equal(db_peer_upsert(db, k1, "alpha2", "{\"backend\":\"cuda\"}", DB_PEER_BACKUP, 2000, &created), FU_OK);
    assert_false(created);
    db_peer *p = NULL;
    assert_int_equal(db_peer_get(db, k1, &p), FU_OK);
    assert_string_equal(p->name, "alpha2");
    assert_string_equal(p->profile, "{\"backend\":\"cuda\"}");
    assert_int_equal(p->state, DB_PEER_BACKUP);
    assert_int_equal(p->joined_ms, 1000);
    assert_int_equal(p->last_seen_ms, 2000);
    assert_true(fabs(p->reputation - 0.75) < 1e-12);
    db_peer_free(&p);
    /* Touch moves last_seen forward only. */
    assert_int_equal(db_peer_touch(db, k1, 3000), FU_OK);
    assert_int_equal(db_peer_touch(db, k1, 2500), FU_OK);
    assert_int_equal(db_peer_get(db, k1, &p), FU_OK);
    assert_int_equal(p->last_seen_ms, 3000);
    db_peer_free(&p);
    assert_int_equal(db_peer_touch(db, k3, 3000), FU_ENOTFOUND);
    assert_int_equal(db_peer_get(db, k3, &p), FU_ENOTFOUND);
    assert_int_equal(db_peer_set_state(db, k3, DB_PEER_DEAD, 3000), FU_ENOTFOUND);
    /* Reputation stays within [0, 1]. */
    assert_int_equal(db_peer_reputation_adjust(db, k1, -5.0, 3100, &rep), FU_OK);
    assert_true(rep == 0.0);
    assert_int_equal(db_peer_reputation_adjust(db, k2, 5.0, 3100, &rep), FU_OK);
    assert_true(rep == 1.0);
    assert_int_equal(db_peer_reputation_adjust(db, k2, NAN, 3100, &rep), FU_EINVAL);
    assert_int_equal(db_peer_reputation_adjust(db, k3, 0.1, 3100, &rep), FU_ENOTFOUND);
    /* States and filtered lists. */
    assert_int_equal(db_peer_set_state(db, k2, DB_PEER_LEFT, 3200), FU_OK);
    db_peer *list = NULL;
    size_t n = 0;
    assert_int_equal(db_peer_list(db, 0, &list, &n), FU_OK);
    assert_int_equal(n, 2);
    assert_string_equal(list[0].key, k1);
    db_peer_array_free(&list, n);
    assert_null(list);
    assert_int_equal(db_peer_list(db, 1u << DB_PEER_LEFT, &list, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_string_equal(list[0].key, k2);
    assert_int_equal(list[0].state, DB_PEER_LEFT);
    db_peer_array_free(&list, n);
    assert_int_equal(db_peer_list(db, 1u << DB_PEER_ACTIVE | 1u << DB_PEER_DEAD, &list, &n), FU_OK);
    assert_int_equal(n, 0);
    db_peer_array_free(&list, n);
    /* Bad input. */
    assert_int_equal(db_peer_upsert(db, k3, "x", "not json", DB_PEER_ACTIVE, 1, NULL), FU_EINVAL);
    assert_int_equal(db_peer_upsert(db, k3, "x", "[1,2]", DB_PEER_ACTIVE, 1, NULL), FU_EINVAL);
    assert_int_equal(db_peer_upsert(db, k3, "", "{}", DB_PEER_ACTIVE, 1, NULL), FU_EINVAL);
    assert_int_equal(db_peer_upsert(db, k3, "a\nb", "{}", DB_PEER_ACTIVE, 1, NULL), FU_EINVAL);
    assert_int_equal(db_peer_upsert(db, k3, "x", "{}", DB_PEER_DEAD, 1, NULL), FU_EINVAL);
    assert_int_equal(db_peer_upsert(db, "short", "x", "{}", DB_PEER_ACTIVE, 1, NULL), FU_EINVAL);
    assert_int_equal(db_peer_get(db, k3, &p), FU_ENOTFOUND);
    db_close(&db);
}

/* db_stage_leases_extend: many leases in one commit (a sweep's heartbeats); each one refused as
 * db_stage_lease_extend would refuse it alone, without holding the others back. */
static void test_db_stage_leases_batch(void **state)
{
    fx *f = *state;
    const char *owner = f->key[0], *pa = f->key[1], *pb = f->key[2];
    char id[DB_JOB_ID_LEN + 1];
    db_t *db = open_ok(f->path);
    assert_int_equal(db_peer_upsert(db, pa, "a", PROFILE, DB_PEER_ACTIVE, 0, NULL), FU_OK);
    assert_int_equal(db_peer_upsert(db, pb, "b", PROFILE, DB_PEER_ACTIVE, 0, NULL), FU_OK);
    submit_ok(db, owner, "s", "{\"layers\":4}", id);
    db_stage_plan plan[3] = {SP(0, 10, pa, 1000), SP(10, 20, pb, 2000), SP(20, 30, NULL, 0)};
    assert_int_equal(db_stage_assign(db, id, plan, 3, "starting", 0), FU_OK);
    db_lease ls[5] = {{id, 0, pa, 1500, FU_EIO}, {id, 0, pb, 9000, FU_EIO}, {id, 9, pa, 9000, FU_EIO},
                      {id, 1, pb, 3000, FU_EIO}, {id, 2, pa, 9000, FU_EIO}};
    uint64_t commits = db_commits(db).n;
    assert_int_equal(db_stage_leases_extend(db, ls, 5, 500), FU_OK);
    assert_int_equal(db_commits(db).n, commits + 1); /* one commit for the lot */
    assert_int_equal(ls[0].result, FU_OK);
    assert_int_equal(ls[1].result, FU_EPERM);     /* another peer's stage */
    assert_int_equal(ls[2].result, FU_ENOTFOUND); /* no such stage */
    assert_int_equal(ls[3].result, FU_OK);
    assert_int_equal(ls[4].result, FU_EPERM);     /* pending: nobody holds it */
    db_stage *st = NULL;
    size_t n = 0;
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(n, 3);
    assert_int_equal(st[0].lease_deadline_ms, 1500);
    assert_int_equal(st[1].lease_deadline_ms, 3000);
    db_stage_array_free(&st, n);
    /* at 2000 stage 0's lease (1500) has run out: told so, and stage 1 is still extended */
    db_lease late[2] = {{id, 0, pa, 9000, FU_EIO}, {id, 1, pb, 4000, FU_EIO}};
    assert_int_equal(db_stage_leases_extend(db, late, 2, 2000), FU_OK);
    assert_int_equal(late[0].result, FU_ETIMEDOUT);
    assert_int_equal(late[1].result, FU_OK);
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(st[0].lease_deadline_ms, 1500);
    assert_int_equal(st[1].lease_deadline_ms, 4000);
    db_stage_array_free(&st, n);
    commits = db_commits(db).n;
    assert_int_equal(db_stage_leases_extend(db, NULL, 0, 2000), FU_OK); /* nothing: no commit */
    assert_int_equal(db_commits(db).n, commits);
    assert_int_equal(db_stage_leases_extend(db, NULL, 1, 2000), FU_EINVAL);
    db_close(&db);
}

/* db_peer_gone: a departure is one commit with one event that says why, names the job and counts
 * the stages it lost; they are lost. */
static void test_db_peer_gone_one_commit(void **state)
{
    fx *f = *state;
    const char *owner = f->key[0], *pa = f->key[1], *pb = f->key[2];
    char id[DB_JOB_ID_LEN + 1];
    db_t *db = open_ok(f->path);
    assert_int_equal(db_peer_upsert(db, pa, "a", PROFILE, DB_PEER_ACTIVE, 0, NULL), FU_OK);
    assert_int_equal(db_peer_upsert(db, pb, "b", PROFILE, DB_PEER_ACTIVE, 0, NULL), FU_OK);
    submit_ok(db, owner, "s", "{\"layers\":4}", id);
    db_stage_plan plan[2] = {SP(0, 10, pa, 1000), SP(10, 20, pb, 2000)};
    assert_int_equal(db_stage_assign(db, id, plan, 2, "starting", 0), FU_OK);
    uint64_t commits = db_commits(db).n;
    assert_int_equal(db_peer_gone(db, pa, false, 500, id, "silent for 3000 ms"), FU_OK);
    assert_int_equal(db_commits(db).n, commits + 1);
    assert_int_equal(db_peer_gone(db, pb, true, 600, NULL, NULL), FU_OK);
    assert_int_equal(db_peer_gone(db, pb, true, 600, "not-a-job", "x"), FU_EINVAL);
    assert_int_equal(db_peer_gone(db, f->key[4], true, 600, NULL, "x"), FU_ENOTFOUND);
    db_stage *st = NULL;
    size_t n = 0;
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(st[0].state, DB_STAGE_LOST);
    assert_int_equal(st[1].state, DB_STAGE_LOST);
    db_stage_array_free(&st, n);
    db_event *ev = NULL;
    assert_int_equal(db_event_list(db, id, 0, 100, &ev, &n), FU_OK);
    bool seen = false;
    for (size_t i = 0; i < n; i++)
        if (strcmp(ev[i].kind, "peer-dead") == 0) {
            assert_string_equal(ev[i].peer, pa);
            assert_string_equal(ev[i].detail, "silent for 3000 ms: dead (1 stages lost)");
            seen = true;
        }
    assert_true(seen);
    db_event_array_free(&ev, n);
    db_close(&db);
}

static void test_db_stage_leases(void **state)
{
    fx *f = *state;
    const char *owner = f->key[0], *pa = f->key[1], *pb = f->key[2], *pc = f->key[3], *unknown = f->key[4];
    char id[DB_JOB_ID_LEN + 1];
    db_t *db = open_ok(f->path);
    assert_int_equal(db_peer_upsert(db, pa, "a", PROFILE, DB_PEER_ACTIVE, 0, NULL), FU_OK);
    assert_int_equal(db_peer_upsert(db, pb, "b", PROFILE, DB_PEER_ACTIVE, 0, NULL), FU_OK);
    assert_int_equal(db_peer_upsert(db, pc, "c", PROFILE, DB_PEER_BACKUP, 0, NULL), FU_OK);
    submit_ok(db, owner, "s", "{\"layers\":4}", id);

    /* Bad plans change nothing. */
    db_stage_plan overlap[2] = {SP(0, 11, pa, 1000), SP(10, 20, pb, 2000)}; /* [first, end): 10 in both */
    db_stage_plan reversed[1] = {SP(5, 5, pa, 1000)};                      /* empty */
    db_stage_plan stranger[2] = {SP(0, 10, pa, 1000), SP(10, 20, unknown, 2000)};
    assert_int_equal(db_stage_assign(db, id, overlap, 2, "planned", 0), FU_EINVAL);
    assert_int_equal(db_stage_assign(db, id, reversed, 1, "planned", 0), FU_EINVAL);
    assert_int_equal(db_stage_assign(db, id, stranger, 2, "planned", 0), FU_ENOTFOUND);
    db_stage *st = NULL;
    size_t n = 0;
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(n, 0);
    db_stage_array_free(&st, n);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_QUEUED); /* a refused plan does not move the job either */
    db_job_free(&j);

    /* The plan and the job's move to running are one transaction. */
    db_stage_plan plan[3] = {SP(0, 10, pa, 1000), SP(10, 20, pb, 2000), SP(20, 30, NULL, 0)};
    assert_int_equal(db_stage_assign(db, id, plan, 3, "starting: stages assigned", 0), FU_OK);
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_RUNNING);
    assert_string_equal(j->reason, "starting: stages assigned");
    db_job_free(&j);
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(n, 3);
    assert_int_equal(st[0].state, DB_STAGE_ASSIGNED);
    assert_string_equal(st[0].peer, pa);
    assert_int_equal(st[1].first, 10);
    assert_int_equal(st[1].end, 20);
    assert_int_equal(st[1].lease_deadline_ms, 2000);
    assert_int_equal(st[2].state, DB_STAGE_PENDING);
    assert_string_equal(st[2].peer, "");
    db_stage_array_free(&st, n);

    /* The holder extends; others cannot; a lease is never shortened. */
    assert_int_equal(db_stage_lease_extend(db, id, 0, pa, 1500, 500), FU_OK);
    assert_int_equal(db_stage_lease_extend(db, id, 0, pa, 1200, 600), FU_OK);
    assert_int_equal(db_stage_lease_extend(db, id, 0, pb, 9000, 600), FU_EPERM);
    assert_int_equal(db_stage_lease_extend(db, id, 2, pa, 9000, 600), FU_EPERM); /* pending: nobody holds it */
    assert_int_equal(db_stage_lease_extend(db, id, 9, pa, 9000, 600), FU_ENOTFOUND);
    /* A holder whose lease ran out is told so, even before the sweep. */
    assert_int_equal(db_stage_lease_extend(db, id, 1, pb, 9000, 2500), FU_ETIMEDOUT);

    /* At 1600 only stage 0 (deadline 1500) has expired. */
    assert_int_equal(db_stage_expired(db, 1600, &st, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_int_equal(st[0].index, 0);
    assert_int_equal(st[0].state, DB_STAGE_LOST);
    assert_string_equal(st[0].peer, pa);
    db_stage_array_free(&st, n);
    assert_int_equal(db_stage_expired(db, 1600, &st, &n), FU_OK); /* swept once */
    assert_int_equal(n, 0);
    db_stage_array_free(&st, n);
    assert_int_equal(db_stage_lease_extend(db, id, 0, pa, 9000, 1700), FU_EPERM);

    /* A backup takes the lost stage over and renews its lease. */
    assert_int_equal(db_stage_reassign(db, id, 0, pc, 4000, 1700), FU_OK);
    assert_int_equal(db_stage_lease_extend(db, id, 0, pc, 5000, 3000), FU_OK);
    assert_int_equal(db_stage_reassign(db, id, 5, pc, 4000, 1700), FU_ENOTFOUND);
    assert_int_equal(db_stage_reassign(db, id, 0, unknown, 4000, 1700), FU_ENOTFOUND);

    /* A peer that dies loses its stages at once. */
    assert_int_equal(db_peer_set_state(db, pc, DB_PEER_DEAD, 3100), FU_OK);
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(st[0].state, DB_STAGE_LOST);
    db_stage_array_free(&st, n);
    assert_int_equal(db_stage_reassign(db, id, 0, pc, 9000, 3200), FU_EPERM); /* dead peers get no work */
    assert_int_equal(db_stages_in_state(db, DB_STAGE_LOST, &st, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_int_equal(st[0].index, 0);
    assert_string_equal(st[0].peer, pc);
    assert_int_equal(st[0].lease_deadline_ms, 0);
    db_stage_array_free(&st, n);
    assert_int_equal(db_stages_in_state(db, DB_STAGE_ASSIGNED, &st, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_int_equal(st[0].index, 1);
    db_stage_array_free(&st, n);
    assert_int_equal(db_stages_in_state(db, (db_stage_state)9, &st, &n), FU_EINVAL);

    /* A finished job releases everything and takes no new plan. */
    assert_int_equal(db_job_cancel(db, id, owner, 3300), FU_OK);
    assert_int_equal(db_stage_list(db, id, &st, &n), FU_OK);
    assert_int_equal(n, 3);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(st[i].state, DB_STAGE_RELEASED);
        assert_int_equal(st[i].lease_deadline_ms, 0);
    }
    db_stage_array_free(&st, n);
    assert_int_equal(db_stage_expired(db, 99999, &st, &n), FU_OK);
    assert_int_equal(n, 0);
    db_stage_array_free(&st, n);
    assert_int_equal(db_stage_assign(db, id, plan, 3, NULL, 3400), FU_EPERM);
    assert_int_equal(db_stage_reassign(db, id, 1, pa, 9000, 3400), FU_EPERM);
    db_close(&db);
}

static void test_db_events(void **state)
{
    fx *f = *state;
    char id[DB_JOB_ID_LEN + 1];
    const char *k = f->key[0];
    db_t *db = open_ok(f->path);
    submit_ok(db, k, "e", "{}", id);
    assert_int_equal(db_event_add(db, 5000, id, k, "note", "hello"), FU_OK);
    assert_int_equal(db_event_add(db, 5001, NULL, NULL, "broker-start", NULL), FU_OK);
    assert_int_equal(db_event_add(db, 5002, NULL, NULL, "", "x"), FU_EINVAL);
    assert_int_equal(db_event_add(db, 5002, NULL, NULL, "a-kind-that-is-much-too-long-for-it", "x"), FU_EINVAL);
    assert_int_equal(db_event_add(db, 5002, "nope", NULL, "k", "x"), FU_EINVAL);
    db_event *ev = NULL;
    size_t n = 0;
    assert_int_equal(db_event_list(db, NULL, 0, 0, &ev, &n), FU_OK);
    assert_int_equal(n, 3);
    assert_string_equal(ev[1].kind, "note");
    assert_string_equal(ev[1].detail, "hello");
    assert_string_equal(ev[1].peer, k);
    assert_string_equal(ev[2].job, "");
    assert_string_equal(ev[2].detail, "");
    int64_t cursor = ev[1].id;
    db_event_array_free(&ev, n);
    assert_int_equal(db_event_list(db, NULL, cursor, 0, &ev, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_string_equal(ev[0].kind, "broker-start");
    db_event_array_free(&ev, n);
    assert_int_equal(db_event_list(db, id, 0, 1, &ev, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_string_equal(ev[0].kind, "submitted");
    db_event_array_free(&ev, n);
    /* Retention: events before a time go (into the archive), the rest stay. */
    db_compact_policy pol = {.events_keep_ms = 1, .ckpt_grace_ms = -1};
    db_compact_stats cs;
    assert_int_equal(db_compact(db, &pol, 5002, &cs), FU_OK);
    assert_int_equal(cs.events_archived, 2); /* "submitted" (at 1000) and "note" (at 5000) */
    assert_int_equal(db_event_list(db, NULL, 0, 0, &ev, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_string_equal(ev[0].kind, "broker-start");
    db_event_array_free(&ev, n);
    db_close(&db);
}


static void test_db_names_and_validators(void **state)
{
    (void)state;
    /* BLAKE2b-256 of the empty string and of "abc" (RFC 7693 parameters, 32-byte digest). */
    char h[DB_HASH_HEX_LEN + 1];
    db_hash_hex(h, "", 0);
    assert_string_equal(h, "0e5751c026e543b2e8ab2eb06099daa1d1e5df47778f7787faab45cdf12fe3a8");
    db_hash_hex(h, "abc", 3);
    assert_string_equal(h, "bddd813c634239723171ef3fee98579b94964e3bb1cb3e427262c8c068d52319");
    char key[DB_KEY_LEN + 1];
    make_key(key);
    assert_true(db_key_valid(key));
    assert_false(db_key_valid(NULL));
    assert_false(db_key_valid("HelloWorld"));
    key[3] = '~'; /* not a Z85 character */
    assert_false(db_key_valid(key));
    assert_true(db_job_id_valid("0123456789abcdef"));
    assert_false(db_job_id_valid("0123456789abcdeF"));
    assert_false(db_job_id_valid("0123456789abcde"));
    assert_false(db_job_id_valid("0123456789abcdef0"));
    assert_false(db_job_id_valid(NULL));
    assert_string_equal(db_job_state_name(DB_JOB_RUNNING), "running");
    assert_string_equal(db_job_state_name((db_job_state)42), "?");
    assert_string_equal(db_job_kind_name(DB_JOB_INFER), "infer");
    assert_string_equal(db_peer_state_name(DB_PEER_DEAD), "dead");
    assert_string_equal(db_stage_state_name(DB_STAGE_LOST), "lost");
    db_job_kind k;
    assert_int_equal(db_job_kind_parse("finetune", &k), FU_OK);
    assert_int_equal(k, DB_JOB_FINETUNE);
    assert_int_equal(db_job_kind_parse("train", &k), FU_EINVAL);
    assert_true(db_job_state_final(DB_JOB_FAILED));
    assert_false(db_job_state_final(DB_JOB_QUEUED));
}

/* Rows that break the schema's rules (written by hand with the checks switched off) come back as
 * FU_EDB, never as a crash or a bogus value. */
static void test_db_corrupt_rows_are_errors(void **state)
{
    fx *f = *state;
    char id[DB_JOB_ID_LEN + 1], id2[DB_JOB_ID_LEN + 1];
    const char *owner = f->key[0], *peer = f->key[1];
    db_t *db = open_ok(f->path);
    submit_ok(db, owner, "c1", "{}", id);
    submit_ok(db, owner, "c2", "{}", id2);
    assert_int_equal(db_peer_upsert(db, peer, "p", "{}", DB_PEER_ACTIVE, 1, NULL), FU_OK);
    /* Rows damaged while the store is open (another writer): each read of them is an error. */
    char sql[512];
    snprintf(sql, sizeof sql,
             "PRAGMA ignore_check_constraints = 1;"
             "UPDATE jobs SET state = 'exploded' WHERE id = '%s';"
             "UPDATE jobs SET owner = 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx~' WHERE id = '%s';"
             "UPDATE peers SET reputation = 7.5, name = 'a' || char(10) || 'b';",
             id, id2);
    raw_exec(f->path, sql);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_EDB);
    assert_null(j);
    assert_int_equal(db_job_get(db, id2, NULL, &j), FU_EDB);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 2), FU_EDB);
    db_job *list = NULL;
    size_t n = 0;
    assert_int_equal(db_job_list(db, NULL, &list, &n), FU_EDB);
    assert_null(list);
    db_peer *p = NULL;
    assert_int_equal(db_peer_get(db, peer, &p), FU_EDB);
    assert_null(p);
    db_close(&db);
    /* At the next open the check finds them: the store is refused. */
    free(open_refused(f, f->path, FU_EPROTO, "CHECK constraint failed"));
}

static void test_db_read_only_and_two_connections(void **state)
{
    fx *f = *state;
    char id1[DB_JOB_ID_LEN + 1], id2[DB_JOB_ID_LEN + 1];
    const char *owner = f->key[0];
    /* Two connections to one file share the idempotency keys. */
    db_t *a = open_ok(f->path), *b = open_ok(f->path);
    bool created = false;
    assert_int_equal(db_job_submit(a, owner, "shared", DB_JOB_INFER, "{}", 2, NULL, 1, id1, &created), FU_OK);
    assert_true(created);
    assert_int_equal(db_job_submit(b, owner, "shared", DB_JOB_INFER, "{}", 2, NULL, 2, id2, &created), FU_OK);
    assert_false(created);
    assert_string_equal(id1, id2);
    db_close(&b);
    db_close(&a);
    /* A read-only connection reads and refuses writes. */
    db_options o = {.read_only = true};
    db_t *ro = NULL;
    assert_int_equal(db_open_opts(f->path, &o, &ro), FU_OK);
    db_job *j = NULL;
    assert_int_equal(db_job_get(ro, id1, owner, &j), FU_OK);
    db_job_free(&j);
    assert_int_equal(db_job_submit(ro, owner, "other", DB_JOB_INFER, "{}", 2, NULL, 3, id2, &created), FU_EDB);
    db_close(&ro);
    /* Read-only on a file that does not exist yet: nothing to read, nothing created. */
    char missing[4200];
    snprintf(missing, sizeof missing, "%s/missing.db", f->dir);
    assert_int_not_equal(db_open_opts(missing, &o, &ro), FU_OK);
    assert_null(ro);
    assert_int_not_equal(access(missing, F_OK), 0);
}

/* db_open_sibling: another connection to an open store, for another thread (the broker's writer).
 * Its writes are the store's; it opens with the first one's options (a capped file stays capped);
 * without a store open it has nothing to be a sibling of. */
static void test_db_sibling_connection(void **state)
{
    fx *f = *state;
    const char *owner = f->key[0];
    db_t *m = open_ok(f->path), *sib = NULL;
    assert_int_equal(db_open_sibling(m, &sib), FU_OK);
    char id[DB_JOB_ID_LEN + 1], id2[DB_JOB_ID_LEN + 1];
    bool created = false;
    assert_int_equal(db_job_submit(sib, owner, "sib", DB_JOB_INFER, "{}", 2, NULL, 1, id, &created), FU_OK);
    assert_true(created);
    db_job *j = NULL;
    assert_int_equal(db_job_get(m, id, owner, &j), FU_OK); /* the first connection sees it */
    db_job_free(&j);
    assert_int_equal(db_job_submit(m, owner, "main", DB_JOB_INFER, "{}", 2, NULL, 2, id2, &created), FU_OK);
    assert_int_equal(db_job_get(sib, id2, owner, &j), FU_OK);
    db_job_free(&j);
    db_close(&sib);
    db_close(&m);
    /* the options travel: a store capped at its size refuses a large write through the sibling too */
    db_options o = {.max_page_count = raw_int(f->path, "PRAGMA page_count") + 2};
    assert_int_equal(db_open_opts(f->path, &o, &m), FU_OK);
    assert_int_equal(db_open_sibling(m, &sib), FU_OK);
    size_t big = 256 * 1024;
    uint8_t *spec = calloc(1, big);
    assert_non_null(spec);
    assert_int_equal(db_job_submit(sib, owner, "big", DB_JOB_FINETUNE, spec, big, NULL, 3, id, &created), FU_EDB);
    free(spec);
    db_close(&sib);
    db_close(&m);
    assert_int_equal(db_open_sibling(NULL, &sib), FU_EINVAL);
    assert_null(sib);
}

/* ---- durability: a writer killed with SIGKILL keeps every job it acknowledged ---- */

/* What a writer child works on. */
typedef struct {
    const char *path;     /* the store */
    const char *owner;    /* child_submit: the jobs' owner */
    int round;            /* child_submit: part of the jobs' keys */
    bool die_after_first; /* child_submit: SIGKILL itself after the first job */
    const char *job;      /* child_ckpt: the job whose checkpoints it stores */
    int64_t base;         /* child_ckpt: the first step */
} writer;

/* Forks a child that runs child(w, fd): it writes one line to fd for each write the store
 * acknowledged, forever. Reads `want` lines (or until the child dies) into lines, then kills the
 * child with SIGKILL (unless w->die_after_first: it kills itself) and reaps it: it must have died of
 * that signal. Returns how many lines it read. */
static unsigned run_killed_writer(void (*child)(const writer *w, int fd), const writer *w, unsigned want,
                                  char (*lines)[160])
{
    int p[2];
    assert_int_equal(pipe(p), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(p[0]);
        child(w, p[1]);
        _exit(0);
    }
    close(p[1]);
    FILE *rd = fdopen(p[0], "r");
    assert_non_null(rd);
    unsigned got = 0;
    while (got < want && fgets(lines[got], 160, rd))
        got++;
    if (!w->die_after_first)
        kill(pid, SIGKILL);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    fclose(rd);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    return got;
}

/* Child: submits jobs with keys "r<round>-<i>" forever, writing "<id> <i>\n" to fd after each
 * submission returned; with die_after_first, raises SIGKILL right after the first one returned. */
static void child_submit(const writer *w, int fd)
{
    db_t *db = NULL;
    if (db_open(w->path, &db) != FU_OK)
        _exit(3);
    for (int i = 0;; i++) {
        char key[64], id[DB_JOB_ID_LEN + 1], line[64];
        snprintf(key, sizeof key, "r%d-%d", w->round, i);
        bool created;
        if (db_job_submit(db, w->owner, key, DB_JOB_FINETUNE, key, strlen(key), NULL, fu_wallclock_ms(), id,
                          &created) != FU_OK)
            _exit(4);
        if (w->die_after_first)
            raise(SIGKILL); /* the acknowledgement below is sent by the parent reading the DB */
        int n = snprintf(line, sizeof line, "%s %d\n", id, i);
        if (write(fd, line, (size_t)n) != n)
            _exit(5);
    }
}

static void test_db_durability_sigkill(void **state)
{
    fx *f = *state;
    const char *owner = f->key[0];
    db_t *db = open_ok(f->path); /* create the schema before the children race on it */
    db_close(&db);
    size_t total_acked = 0;
    for (int round = 0; round < 6; round++) {
        bool die_first = round == 0;
        /* Read a random number of acknowledgements, then kill the writer mid-stream. */
        unsigned want = die_first ? 0 : 1 + randombytes_uniform(40);
        writer w = {.path = f->path, .owner = owner, .round = round, .die_after_first = die_first};
        char lines[64][160], acked[64][DB_JOB_ID_LEN + 1];
        int acked_i[64];
        unsigned got = run_killed_writer(child_submit, &w, want, lines);
        assert_int_equal(got, want);
        for (unsigned i = 0; i < got; i++)
            assert_int_equal(sscanf(lines[i], "%16s %d", acked[i], &acked_i[i]), 2);

        db = open_ok(f->path);
        db_job *j = NULL;
        for (unsigned i = 0; i < got; i++) {
            assert_int_equal(db_job_get(db, acked[i], owner, &j), FU_OK);
            char key[64];
            snprintf(key, sizeof key, "r%d-%d", round, acked_i[i]);
            assert_string_equal(j->idem_key, key);
            assert_int_equal(j->state, DB_JOB_QUEUED);
            assert_memory_equal(j->spec, key, strlen(key));
            db_job_free(&j);
        }
        if (die_first) {
            /* The child died right after db_job_submit returned: its job is there, and a retry
             * with the same key finds it instead of making a second one. */
            char id[DB_JOB_ID_LEN + 1];
            bool created = true;
            assert_int_equal(db_job_submit(db, owner, "r0-0", DB_JOB_FINETUNE, "r0-0", 4, NULL, 1, id, &created), FU_OK);
            assert_false(created);
            got = 1;
        }
        /* The store is consistent after every kill. */
        db_close(&db);
        assert_int_equal(raw_int(f->path, "SELECT count(*) FROM pragma_integrity_check WHERE integrity_check != 'ok'"), 0);
        total_acked += got;
    }
    char sql[128];
    snprintf(sql, sizeof sql, "SELECT count(*) FROM jobs WHERE owner = '%s'", owner);
    assert_true((size_t)raw_int(f->path, sql) >= total_acked);
    print_message("durability: %zu acknowledged jobs over 6 SIGKILLs, all present\n", total_acked);
}

/* Child: stores checkpoints of stage 0 of job at steps base, base+1, ... (ckpt_keep large, so
 * nothing is pruned), writing "<step> <hash>\n" to fd after each db_ckpt_put returned. */
static void child_ckpt(const writer *w, int fd)
{
    db_options o = {.ckpt_keep = 100000};
    db_t *db = NULL;
    if (db_open_opts(w->path, &o, &db) != FU_OK)
        _exit(3);
    size_t len = 256 * 1024;
    uint8_t *data = malloc(len);
    if (!data)
        _exit(6);
    for (int64_t step = w->base;; step++) {
        char hash[DB_HASH_HEX_LEN + 1], line[128];
        randombytes_buf(data, len);
        db_hash_hex(hash, data, len);
        if (db_ckpt_put(db, w->job, 0, step, data, len, hash, -1, step) != FU_OK)
            _exit(4);
        int n = snprintf(line, sizeof line, "%lld %s\n", (long long)step, hash);
        if (write(fd, line, (size_t)n) != n)
            _exit(5);
    }
}

static void test_db_durability_ckpt_sigkill(void **state)
{
    fx *f = *state;
    char job[DB_JOB_ID_LEN + 1];
    const char *owner = f->key[0];
    db_options o = {.ckpt_keep = 100000};
    db_t *db = NULL;
    assert_int_equal(db_open_opts(f->path, &o, &db), FU_OK);
    job_with_plan(db, owner, "ck", 1, job);
    db_close(&db);
    unsigned total = 0;
    for (int round = 0; round < 4; round++) {
        unsigned want = 1 + randombytes_uniform(12);
        writer w = {.path = f->path, .job = job, .base = (int64_t)round * 1000};
        char lines[16][160], hashes[16][DB_HASH_HEX_LEN + 1];
        long long steps[16];
        unsigned got = run_killed_writer(child_ckpt, &w, want, lines);
        assert_int_equal(got, want);
        for (unsigned i = 0; i < got; i++)
            assert_int_equal(sscanf(lines[i], "%lld %64s", &steps[i], hashes[i]), 2);
        assert_int_equal(db_open_opts(f->path, &o, &db), FU_OK);
        for (unsigned i = 0; i < got; i++) {
            db_ckpt *c = NULL;
            assert_int_equal(db_ckpt_get(db, job, 0, steps[i], &c), FU_OK); /* present and intact */
            assert_string_equal(c->hash, hashes[i]);
            db_ckpt_free(&c);
        }
        db_close(&db);
        total += got;
    }
    print_message("durability: %u acknowledged checkpoints over 4 SIGKILLs, all present and intact\n", total);
}

/* ---- a full disk ---- */

static void test_db_disk_full(void **state)
{
    fx *f = *state;
    const char *owner = f->key[0], *peer = f->key[1];
    char ids[20][DB_JOB_ID_LEN + 1];
    db_t *db = open_ok(f->path);
    for (int i = 0; i < 20; i++) {
        char key[16];
        snprintf(key, sizeof key, "pre-%d", i);
        submit_ok(db, owner, key, "{\"small\":true}", ids[i]);
    }
    assert_int_equal(db_peer_upsert(db, peer, "p", PROFILE, DB_PEER_ACTIVE, 1, NULL), FU_OK);
    db_stage_plan plan[1] = {SP(0, 10, peer, 100000)};
    assert_int_equal(db_stage_assign(db, ids[0], plan, 1, NULL, 1), FU_OK);
    assert_int_equal(db_job_set_state(db, ids[0], DB_JOB_RUNNING, NULL, 1), FU_OK);
    db_close(&db);

    /* Cap the file a little above its current size: some writes fit, then the "disk" is full. */
    int64_t pages = raw_int(f->path, "PRAGMA page_count");
    db_options o = {.max_page_count = pages + 48};
    assert_int_equal(db_open_opts(f->path, &o, &db), FU_OK);
    size_t big = 8 * 1024, huge = 1024 * 1024;
    uint8_t *spec = malloc(huge);
    assert_non_null(spec);
    randombytes_buf(spec, huge);
    char extra[64][DB_JOB_ID_LEN + 1];
    int n_extra = 0;
    fu_err err = FU_OK;
    for (int i = 0; i < 64; i++) {
        char key[16], id[DB_JOB_ID_LEN + 1];
        bool created;
        snprintf(key, sizeof key, "big-%d", i);
        err = db_job_submit(db, owner, key, DB_JOB_FINETUNE, spec, big, NULL, 2, id, &created);
        if (err != FU_OK)
            break;
        memcpy(extra[n_extra++], id, sizeof id);
    }
    assert_int_equal(err, FU_EDB); /* refused cleanly, not a crash */
    assert_true(n_extra > 0 && n_extra < 64);
    /* A checkpoint that does not fit is refused and leaves nothing behind. */
    char hash[DB_HASH_HEX_LEN + 1];
    db_hash_hex(hash, spec, huge);
    assert_int_equal(db_ckpt_put(db, ids[0], 0, 5, spec, huge, hash, -1, 3), FU_EDB);
    /* The connection still serves reads, and every committed row is there. */
    db_job *list = NULL;
    size_t n = 0;
    assert_int_equal(db_job_list(db, owner, &list, &n), FU_OK);
    assert_int_equal(n, 20 + (size_t)n_extra);
    db_job_array_free(&list, n);
    db_ckpt *c = NULL;
    assert_int_equal(db_ckpt_get(db, ids[0], 0, 5, &c), FU_ENOTFOUND);
    /* Small writes that fit in free pages may still succeed; they must not corrupt anything. */
    fu_err small = db_job_progress(db, ids[0], 1, 10, 1.0, 1.0, 4);
    assert_true(small == FU_OK || small == FU_EDB);
    db_close(&db);

    /* Reopened without the cap: everything acknowledged is there, nothing half-written. */
    db = open_ok(f->path);
    for (int i = 0; i < 20; i++) {
        db_job *j = NULL;
        assert_int_equal(db_job_get(db, ids[i], owner, &j), FU_OK);
        db_job_free(&j);
    }
    for (int i = 0; i < n_extra; i++) {
        db_job *j = NULL;
        assert_int_equal(db_job_get(db, extra[i], owner, &j), FU_OK);
        assert_int_equal(j->spec_len, big);
        assert_memory_equal(j->spec, spec, big);
        db_job_free(&j);
    }
    assert_int_equal(db_job_list(db, owner, &list, &n), FU_OK);
    assert_int_equal(n, 20 + (size_t)n_extra);
    db_job_array_free(&list, n);
    /* With room again, writes work. */
    char id[DB_JOB_ID_LEN + 1];
    bool created;
    assert_int_equal(db_job_submit(db, owner, "after", DB_JOB_FINETUNE, spec, big, NULL, 5, id, &created), FU_OK);
    assert_true(created);
    db_close(&db);
    free(spec);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM pragma_integrity_check WHERE integrity_check != 'ok'"), 0);
    print_message("disk full: %d large jobs fit before FU_EDB; all %d committed jobs kept\n", n_extra, 20 + n_extra);
}

/* ---- a figure for the docs: the cost of one durable commit ---- */

static void test_db_commit_latency(void **state)
{
    fx *f = *state;
    const char *owner = f->key[0];
    db_t *db = open_ok(f->path);
    const int N = 200;
    double t0 = fu_clock_sec();
    for (int i = 0; i < N; i++) {
        char key[32], id[DB_JOB_ID_LEN + 1];
        bool created;
        snprintf(key, sizeof key, "lat-%d", i);
        assert_int_equal(db_job_submit(db, owner, key, DB_JOB_INFER, "{\"prompt\":\"hi\"}", 15, NULL, i, id, &created), FU_OK);
    }
    double t1 = fu_clock_sec();
    char id[DB_JOB_ID_LEN + 1];
    submit_ok(db, owner, "lat-run", "{}", id);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, NULL, 1), FU_OK);
    double t2 = fu_clock_sec();
    for (int i = 0; i < N; i++)
        assert_int_equal(db_job_progress(db, id, i, N, 1.0, 2.0, i), FU_OK);
    double t3 = fu_clock_sec();
    print_message("commit latency: submit %.3f ms, progress %.3f ms (mean of %d, WAL + synchronous=FULL)\n",
                  (t1 - t0) * 1e3 / N, (t3 - t2) * 1e3 / N, N);

    /* Checkpoints of 4 MiB (a small model's adapters and AdamW moments): put (hash, commit, prune)
     * and get (read, re-hash). */
    char cj[DB_JOB_ID_LEN + 1];
    job_with_plan(db, owner, "lat-ckpt", 1, cj);
    const size_t len = 4u << 20;
    const int M = 10;
    uint8_t *blob = malloc(len);
    assert_non_null(blob);
    randombytes_buf(blob, len);
    char hash[DB_HASH_HEX_LEN + 1];
    double put = 0, get = 0;
    for (int i = 0; i < M; i++) {
        blob[0] = (uint8_t)i;
        db_hash_hex(hash, blob, len);
        double a = fu_clock_sec();
        assert_int_equal(db_ckpt_put(db, cj, 0, i, blob, len, hash, -1, i), FU_OK);
        double b = fu_clock_sec();
        db_ckpt *c = NULL;
        assert_int_equal(db_ckpt_get(db, cj, 0, -1, &c), FU_OK);
        double d = fu_clock_sec();
        assert_int_equal(c->len, len);
        db_ckpt_free(&c);
        put += b - a;
        get += d - b;
    }
    print_message("checkpoint 4 MiB: put %.1f ms (%.0f MB/s), get %.1f ms (%.0f MB/s) (mean of %d)\n",
                  put * 1e3 / M, (double)len * M / put / 1e6, get * 1e3 / M, (double)len * M / get / 1e6, M);
    free(blob);
    db_close(&db);
}

/* ---- compaction: a bounded store (docs/STORE.md "Compaction") ---------------------------------- */

#define DAY (24ll * 3600 * 1000)

/* Runs db_compact until no work is left (at most 10,000 turns); the sum of what it did. */
static db_compact_stats compact_all(db_t *db, const db_compact_policy *p, int64_t now_ms)
{
    db_compact_stats sum = {0};
    for (int i = 0; i < 10000; i++) {
        db_compact_stats s;
        assert_int_equal(db_compact(db, p, now_ms, &s), FU_OK);
        sum.events_archived += s.events_archived;
        sum.ckpts_dropped += s.ckpts_dropped;
        sum.jobs_purged += s.jobs_purged;
        sum.jobs_forgotten += s.jobs_forgotten;
        sum.peers_forgotten += s.peers_forgotten;
        sum.pages_vacuumed += s.pages_vacuumed;
        sum.commits += s.commits;
        if (s.seconds > sum.seconds)
            sum.seconds = s.seconds; /* the longest turn */
        if (!s.more)
            return sum;
    }
    fail_msg("compaction did not finish");
    return sum;
}

static int64_t count_events(db_t *db)
{
    db_store_stats st;
    assert_int_equal(db_store_stats_get(db, true, &st), FU_OK);
    return st.events;
}

/* Events past the count limit go into the archive, one row per UTC day with counts per kind, chained
 * by hashes: the audit holds; the newest events are still listed; any change to an archived row, a
 * removed archive row or an event deleted outside the archive makes the audit fail (and --check-store
 * refuse the store); a changed newest row stops archiving without stopping the store. */
static void test_db_compact_events_archived_and_audited(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    /* 1,200 events over three days (400 a day), kinds "a" and "b" */
    for (int i = 0; i < 1200; i++)
        assert_int_equal(db_event_add(db, 10 * DAY + (i / 400) * DAY + i, NULL, i % 3 ? NULL : f->key[1],
                                      i % 2 ? "a" : "b", "detail"),
                         FU_OK);
    db_audit au;
    assert_int_equal(db_event_audit(db, &au), FU_OK); /* an empty archive holds */
    assert_int_equal(au.rows, 0);
    db_compact_policy pol = {.events_max = 100, .ckpt_grace_ms = -1, .batch = 250, .budget_s = 10};
    db_compact_stats cs = compact_all(db, &pol, 13 * DAY);
    assert_int_equal(cs.events_archived, 1100);
    assert_int_equal(count_events(db), 100);
    assert_int_equal(db_event_audit(db, &au), FU_OK);
    assert_int_equal(au.rows, 3); /* one per day */
    assert_int_equal(au.events, 1100);
    db_archive_day *days = NULL;
    size_t nd = 0;
    assert_int_equal(db_event_archive_list(db, 0, 0, &days, &nd), FU_OK);
    assert_int_equal(nd, 3);
    assert_int_equal(days[0].day, 10);
    assert_int_equal(days[0].n, 400);
    assert_string_equal(days[0].counts, "{\"b\":200,\"a\":200}");
    assert_int_equal(days[2].n, 300);
    assert_int_equal(days[2].last_id, 1100);
    db_event_archive_free(&days, nd);
    assert_null(days);
    /* the live log lists from the first event kept */
    db_event *ev = NULL;
    size_t n = 0;
    assert_int_equal(db_event_list(db, NULL, 0, 0, &ev, &n), FU_OK);
    assert_int_equal(n, 100);
    assert_int_equal(ev[0].id, 1101);
    db_event_array_free(&ev, n);
    /* nothing more to do: a turn that finds no work commits nothing */
    assert_int_equal(db_compact(db, &pol, 13 * DAY, &cs), FU_OK);
    assert_int_equal(cs.commits, 0);
    assert_false(cs.more);
    /* more events, more archived: the third day's row goes on (same day), its chain with it */
    for (int i = 0; i < 50; i++)
        assert_int_equal(db_event_add(db, 12 * DAY + 500 + i, NULL, NULL, "c", NULL), FU_OK);
    cs = compact_all(db, &pol, 13 * DAY);
    assert_int_equal(cs.events_archived, 50);
    assert_int_equal(db_event_audit(db, &au), FU_OK);
    assert_int_equal(au.rows, 3);
    assert_int_equal(au.events, 1150);
    db_close(&db);
    char copy[8300];
    snprintf(copy, sizeof copy, "cp '%s' '%s.good'", f->path, f->path);
    assert_int_equal(system(copy), 0);

    /* a count changed in an archived row */
    raw_exec(f->path, "UPDATE event_archive SET counts = '{\"b\":199,\"a\":201}' WHERE id = 1");
    db = open_ok(f->path);
    assert_int_equal(db_event_audit(db, &au), FU_EAUTH);
    assert_int_equal(au.bad_row, 1);
    print_message("audit after a changed row: %s\n", au.why);
    db_close(&db);
    db_options o = {.full_check = true};
    assert_int_equal(db_open_opts(f->path, &o, &db), FU_EPROTO); /* --check-store refuses it */
    assert_null(db);

    /* an archive row removed (the first two rows' successor no longer chains) */
    snprintf(copy, sizeof copy, "cp '%s.good' '%s'", f->path, f->path);
    assert_int_equal(system(copy), 0);
    raw_exec(f->path, "DELETE FROM event_archive WHERE id = 2");
    db = open_ok(f->path);
    assert_int_equal(db_event_audit(db, &au), FU_EAUTH);
    assert_int_equal(au.bad_row, 3);
    db_close(&db);

    /* an event deleted from the live log */
    snprintf(copy, sizeof copy, "cp '%s.good' '%s'", f->path, f->path);
    assert_int_equal(system(copy), 0);
    raw_exec(f->path, "DELETE FROM events WHERE id = 1200");
    db = open_ok(f->path);
    assert_int_equal(db_event_audit(db, &au), FU_EAUTH);
    assert_int_equal(au.bad_row, 0);
    db_close(&db);

    /* the newest archive row changed: archiving stops (logged), the store goes on serving */
    snprintf(copy, sizeof copy, "cp '%s.good' '%s'", f->path, f->path);
    assert_int_equal(system(copy), 0);
    raw_exec(f->path, "UPDATE event_archive SET n = n - 1 WHERE id = 3");
    db = open_ok(f->path);
    for (int i = 0; i < 10; i++)
        assert_int_equal(db_event_add(db, 12 * DAY + 900 + i, NULL, NULL, "d", NULL), FU_OK);
    int64_t before = count_events(db);
    assert_int_equal(db_compact(db, &pol, 13 * DAY, &cs), FU_OK);
    assert_int_equal(cs.events_archived, 0);
    assert_int_equal(count_events(db), before);
    assert_int_equal(db_event_add(db, 12 * DAY + 999, NULL, NULL, "e", NULL), FU_OK);
    db_close(&db);
}

/* The archive's hashes are what docs/STORE.md says, so that whoever kept a copy of the events (a log
 * shipper, a backup) can prove them: the running hash over the events, then the row's hash. */
static void le64(crypto_generichash_state *h, int64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)v >> (8 * i));
    crypto_generichash_update(h, b, 8);
}

static void lestr(crypto_generichash_state *h, const char *s)
{
    uint32_t n = s ? (uint32_t)strlen(s) : 0xffffffffu;
    uint8_t b[4] = {(uint8_t)n, (uint8_t)(n >> 8), (uint8_t)(n >> 16), (uint8_t)(n >> 24)};
    crypto_generichash_update(h, b, 4);
    if (s)
        crypto_generichash_update(h, (const uint8_t *)s, n);
}

static void test_db_compact_archive_hashes_as_documented(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    char id[DB_JOB_ID_LEN + 1];
    submit_ok(db, f->key[0], "doc", "{}", id); /* event 1: "submitted" of job id at 1000 */
    assert_int_equal(db_event_add(db, 2000, NULL, f->key[1], "peer-join", "hello"), FU_OK);
    assert_int_equal(db_event_add(db, 3000, id, NULL, "note", NULL), FU_OK); /* detail NULL is stored as "" */
    db_event *ev = NULL;
    size_t n = 0;
    assert_int_equal(db_event_list(db, NULL, 0, 0, &ev, &n), FU_OK);
    assert_int_equal(n, 3);
    uint8_t chain[32] = {0}; /* the first row starts from zeros */
    for (size_t i = 0; i < n; i++) {
        crypto_generichash_state h;
        crypto_generichash_init(&h, NULL, 0, 32);
        crypto_generichash_update(&h, chain, 32);
        le64(&h, ev[i].id);
        le64(&h, ev[i].time_ms);
        lestr(&h, ev[i].job[0] ? ev[i].job : NULL);
        lestr(&h, ev[i].peer[0] ? ev[i].peer : NULL);
        lestr(&h, ev[i].kind);
        lestr(&h, ev[i].detail);
        crypto_generichash_final(&h, chain, 32);
    }
    db_event_array_free(&ev, n);
    db_compact_policy pol = {.events_keep_ms = 1, .ckpt_grace_ms = -1, .budget_s = 10};
    db_compact_stats cs = compact_all(db, &pol, 5000);
    assert_int_equal(cs.events_archived, 3);
    db_close(&db);
    sqlite3 *c = NULL;
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_open_v2(f->path, &c, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(c, "SELECT day, first_id, last_id, first_ms, last_ms, n, counts, rows_hash, "
                                           "prev_hash, hash FROM event_archive", -1, &st, NULL),
                     SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    char hex[65];
    fu_hex_encode(hex, chain, 32);
    assert_string_equal((const char *)sqlite3_column_text(st, 7), hex); /* rows_hash */
    assert_string_equal((const char *)sqlite3_column_text(st, 8), /* prev_hash: zeros */
                        "0000000000000000000000000000000000000000000000000000000000000000");
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, 32);
    lestr(&h, "fusion event archive v1");
    uint8_t zeros[32] = {0}, row[32];
    crypto_generichash_update(&h, zeros, 32);
    for (int k = 0; k < 6; k++)
        le64(&h, sqlite3_column_int64(st, k));
    lestr(&h, (const char *)sqlite3_column_text(st, 6));
    crypto_generichash_update(&h, chain, 32);
    crypto_generichash_final(&h, row, 32);
    fu_hex_encode(hex, row, 32);
    assert_string_equal((const char *)sqlite3_column_text(st, 9), hex); /* hash */
    assert_int_equal(sqlite3_column_int64(st, 0), 0);                   /* day 0: 1970-01-01 */
    assert_int_equal(sqlite3_column_int64(st, 5), 3);
    sqlite3_finalize(st);
    sqlite3_close(c);
}

/* The age limit archives events older than it whatever their number; the `excluded` events of a
 * running job stay (a restarted broker reads them back) until the job ends; the audit still holds
 * when such an event is archived after newer ones. */
static void test_db_compact_keeps_what_running_jobs_need(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    char id[DB_JOB_ID_LEN + 1];
    job_with_plan(db, f->key[0], "run", 2, id);
    assert_int_equal(db_event_add(db, 2000, id, f->key[1], "excluded", "missed its deadline"), FU_OK);
    for (int i = 0; i < 20; i++)
        assert_int_equal(db_event_add(db, 3000 + i, id, NULL, "note", NULL), FU_OK);
    db_compact_policy pol = {.events_keep_ms = DAY, .ckpt_grace_ms = 0, .batch = 7, .budget_s = 10};
    db_compact_stats cs = compact_all(db, &pol, 10 * DAY);
    db_event *ev = NULL;
    size_t n = 0;
    assert_int_equal(db_event_list(db, id, 0, 0, &ev, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_string_equal(ev[0].kind, "excluded");
    int64_t excluded_id = ev[0].id;
    db_event_array_free(&ev, n);
    db_audit au;
    assert_int_equal(db_event_audit(db, &au), FU_OK);
    /* the job ends: its exclusion is archived in the current row, below that row's other ids */
    uint8_t result[32] = {1};
    assert_int_equal(db_job_complete(db, id, result, sizeof result, NULL, NULL, 10 * DAY), FU_OK);
    cs = compact_all(db, &pol, 12 * DAY);
    assert_true(cs.events_archived >= 1);
    assert_int_equal(db_event_list(db, id, 0, 0, &ev, &n), FU_OK);
    for (size_t i = 0; i < n; i++)
        assert_int_not_equal(ev[i].id, excluded_id);
    db_event_array_free(&ev, n);
    assert_int_equal(db_event_audit(db, &au), FU_OK);
    db_close(&db);
}

/* Checkpoints of a job that ended go after the grace (its result holds the adapter); those of a
 * running job are not touched, so that its recovery point survives any compaction. */
static void test_db_compact_checkpoints_of_ended_jobs(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    char run[DB_JOB_ID_LEN + 1], done[DB_JOB_ID_LEN + 1], failed[DB_JOB_ID_LEN + 1];
    job_with_plan(db, f->key[0], "run", 2, run);
    job_with_plan(db, f->key[0], "done", 2, done);
    job_with_plan(db, f->key[0], "failed", 2, failed);
    for (uint32_t s = 0; s < 2; s++)
        for (int64_t step = 5; step <= 15; step += 5) {
            put_ckpt(db, run, s, step);
            put_ckpt(db, done, s, step);
            put_ckpt(db, failed, s, step);
        }
    uint8_t result[64] = {7};
    assert_int_equal(db_job_complete(db, done, result, sizeof result, NULL, NULL, 100000), FU_OK);
    assert_int_equal(db_job_set_state(db, failed, DB_JOB_FAILED, "a stage failed", 100000), FU_OK);
    db_compact_policy pol = {.ckpt_grace_ms = 60000, .budget_s = 10};
    db_compact_stats cs = compact_all(db, &pol, 130000); /* 30 s after they ended: within the grace */
    assert_int_equal(cs.ckpts_dropped, 0);
    assert_true(has_ckpt(db, done, 1, 15));
    cs = compact_all(db, &pol, 160001);
    assert_int_equal(cs.ckpts_dropped, 12); /* 3 steps x 2 stages x 2 ended jobs */
    for (uint32_t s = 0; s < 2; s++) {
        assert_false(has_ckpt(db, done, s, -1));
        assert_false(has_ckpt(db, failed, s, -1));
        for (int64_t step = 5; step <= 15; step += 5)
            assert_true(has_ckpt(db, run, s, step));
    }
    int64_t common = 0;
    assert_int_equal(db_ckpt_common_step(db, run, &common), FU_OK);
    assert_int_equal(common, 15);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, done, NULL, &j), FU_OK); /* the result is what `fusion result` serves */
    assert_int_equal(j->result_len, sizeof result);
    assert_int_equal(j->purged_ms, 0);
    db_job_free(&j);
    db_close(&db);
}

/* Past the retention, an ended job's artifacts go (result blob, tokens after the spec text, result
 * file) with one "purged" event; its row, spec text and result hash stay; a running job, however old,
 * keeps everything. */
static void test_db_compact_purges_jobs_past_retention(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    const char *owner = f->key[0];
    char run[DB_JOB_ID_LEN + 1], done[DB_JOB_ID_LEN + 1];
    uint8_t spec[64];
    const char text[] = "{\"steps\":3}";
    memcpy(spec, text, sizeof text); /* the spec text, its NUL, then 4 tokens */
    for (int i = 0; i < 16; i++)
        spec[sizeof text + (size_t)i] = (uint8_t)i;
    size_t spec_len = sizeof text + 16;
    bool created = false;
    assert_int_equal(db_job_submit(db, owner, "r", DB_JOB_FINETUNE, spec, spec_len, NULL, 1000, run, &created), FU_OK);
    assert_int_equal(db_job_submit(db, owner, "d", DB_JOB_FINETUNE, spec, spec_len, NULL, 1000, done, &created), FU_OK);
    assert_int_equal(db_job_set_state(db, run, DB_JOB_RUNNING, NULL, 1000), FU_OK);
    assert_int_equal(db_job_set_state(db, done, DB_JOB_RUNNING, NULL, 1000), FU_OK);
    char file[4200];
    snprintf(file, sizeof file, "%s/logits.f32", f->dir);
    FILE *fp = fopen(file, "w");
    assert_non_null(fp);
    fputs("logits", fp);
    fclose(fp);
    uint8_t result[1000];
    memset(result, 3, sizeof result);
    char hash[DB_HASH_HEX_LEN + 1];
    db_hash_hex(hash, result, sizeof result);
    assert_int_equal(db_job_complete(db, done, result, sizeof result, file, hash, 2000), FU_OK);
    int64_t unfinished = 0, bytes_before = 0, bytes_after = 0;
    assert_int_equal(db_owner_usage(db, owner, &unfinished, &bytes_before), FU_OK);
    db_compact_policy pol = {.jobs_keep_ms = DAY, .ckpt_grace_ms = 0, .budget_s = 10};
    db_compact_stats cs = compact_all(db, &pol, 2000 + DAY / 2);
    assert_int_equal(cs.jobs_purged, 0);
    cs = compact_all(db, &pol, 2000 + 2 * DAY);
    assert_int_equal(cs.jobs_purged, 1);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, done, NULL, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_DONE);
    assert_null(j->result);
    assert_int_equal(j->result_len, 0);
    assert_null(j->result_path);
    assert_string_equal(j->result_hash, hash); /* what the result was stays provable */
    assert_int_equal(j->purged_ms, 2000 + 2 * DAY);
    assert_int_equal(j->spec_len, sizeof text); /* the spec text and its NUL: no tokens */
    assert_memory_equal(j->spec, text, sizeof text);
    db_job_free(&j);
    char sql[160];
    snprintf(sql, sizeof sql, "SELECT length(spec) FROM job_specs WHERE job_id = '%s'", done);
    assert_int_equal(raw_int(f->path, sql), (int64_t)sizeof text); /* in the specs' own table */
    assert_int_not_equal(access(file, F_OK), 0); /* the result file is gone */
    assert_int_equal(db_job_get(db, run, NULL, &j), FU_OK); /* the running job: untouched */
    assert_int_equal(j->spec_len, spec_len);
    assert_int_equal(j->purged_ms, 0);
    db_job_free(&j);
    assert_int_equal(db_owner_usage(db, owner, &unfinished, &bytes_after), FU_OK);
    assert_int_equal(bytes_before - bytes_after, (int64_t)sizeof result + 16);
    db_event *ev = NULL;
    size_t n = 0;
    assert_int_equal(db_event_list(db, done, 0, 0, &ev, &n), FU_OK);
    assert_true(n > 0);
    assert_string_equal(ev[n - 1].kind, "purged");
    db_event_array_free(&ev, n);
    cs = compact_all(db, &pol, 2000 + 3 * DAY); /* once */
    assert_int_equal(cs.jobs_purged, 0);
    db_close(&db);
}

/* With forget_ms, a job purged longer ago than that goes whole (row, spec text, stages, idempotency key) with
 * one "forgotten" event that keeps its result hash, and so does a peer that left or died that long ago at
 * full reputation once no stored stage names it; a peer that lost reputation, an active peer and a running
 * job stay whatever their age. Without forget_ms nothing is forgotten. */
static void test_db_compact_forgets_purged_jobs_and_gone_peers(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    const char *owner = f->key[0];
    char done[DB_JOB_ID_LEN + 1], run[DB_JOB_ID_LEN + 1];
    job_with_plan(db, owner, "done", 2, done);
    job_with_plan(db, owner, "run", 1, run);
    db_stage *st = NULL;
    size_t n = 0;
    assert_int_equal(db_stage_list(db, done, &st, &n), FU_OK);
    char holder[DB_KEY_LEN + 1]; /* the peer that held the ended job's stages */
    snprintf(holder, sizeof holder, "%s", st[0].peer);
    db_stage_array_free(&st, n);
    uint8_t result[100];
    memset(result, 5, sizeof result);
    char hash[DB_HASH_HEX_LEN + 1];
    db_hash_hex(hash, result, sizeof result);
    assert_int_equal(db_job_complete(db, done, result, sizeof result, NULL, NULL, 2000), FU_OK);
    assert_int_equal(db_peer_gone(db, holder, true, 3000, NULL, "went home"), FU_OK);
    const char *gone = f->key[1], *bad = f->key[2], *active = f->key[3];
    for (int i = 1; i <= 3; i++)
        assert_int_equal(db_peer_upsert(db, f->key[i], "p", PROFILE, DB_PEER_ACTIVE, 1000, NULL), FU_OK);
    assert_int_equal(db_peer_reputation_adjust(db, bad, -0.3, 1500, NULL), FU_OK);
    assert_int_equal(db_peer_gone(db, gone, true, 3000, NULL, NULL), FU_OK);
    assert_int_equal(db_peer_gone(db, bad, false, 3000, NULL, NULL), FU_OK);
    db_peer *p = NULL;
    assert_int_equal(db_peer_get(db, gone, &p), FU_OK);
    assert_int_equal(p->last_seen_ms, 3000); /* a departure is when it was last heard of */
    db_peer_free(&p);

    /* no forget_ms: nothing goes, however old */
    db_compact_policy keep = {.jobs_keep_ms = DAY, .ckpt_grace_ms = 0, .budget_s = 10};
    db_compact_stats cs = compact_all(db, &keep, 2000 + 100 * DAY);
    assert_int_equal(cs.jobs_purged, 1);
    assert_int_equal(cs.jobs_forgotten + cs.peers_forgotten, 0);
    assert_int_equal(db_peer_get(db, gone, &p), FU_OK);
    db_peer_free(&p);
    db_close(&db);

    /* forget_ms of 2 days (a second connection: its own minute of rest after a look that found nothing) */
    db = open_ok(f->path);
    db_compact_policy pol = {.jobs_keep_ms = DAY, .forget_ms = 2 * DAY, .ckpt_grace_ms = 0, .budget_s = 10};
    int64_t purged_at = 2000 + 100 * DAY;
    cs = compact_all(db, &pol, purged_at + DAY); /* purged a day ago: the job stays, and its stages' peer */
    assert_int_equal(cs.jobs_forgotten, 0);
    assert_int_equal(cs.peers_forgotten, 1); /* `gone`: full reputation, no stage */
    assert_int_equal(db_peer_get(db, gone, &p), FU_ENOTFOUND);
    assert_int_equal(db_peer_get(db, holder, &p), FU_OK);
    db_peer_free(&p);
    cs = compact_all(db, &pol, purged_at + DAY + 1000); /* within the minute of rest: nothing looked at */
    assert_int_equal(cs.jobs_forgotten + cs.peers_forgotten, 0);
    cs = compact_all(db, &pol, purged_at + 3 * DAY);
    assert_int_equal(cs.jobs_forgotten, 1);
    assert_int_equal(cs.peers_forgotten, 1); /* `holder`, once the job's stages went with it */
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, done, NULL, &j), FU_ENOTFOUND);
    assert_int_equal(db_peer_get(db, holder, &p), FU_ENOTFOUND);
    char sql[200];
    snprintf(sql, sizeof sql, "SELECT (SELECT count(*) FROM job_specs WHERE job_id = '%s') + (SELECT count(*) FROM "
                              "stages WHERE job_id = '%s')", done, done);
    assert_int_equal(raw_int(f->path, sql), 0);
    db_event *ev = NULL;
    assert_int_equal(db_event_list(db, done, 0, 0, &ev, &n), FU_OK);
    assert_true(n > 0);
    assert_string_equal(ev[n - 1].kind, "forgotten");
    assert_non_null(strstr(ev[n - 1].detail, hash)); /* what the result was is still in the log */
    db_event_array_free(&ev, n);
    /* what stays: the running job with its spec and stages, a peer below full reputation, an active peer */
    assert_int_equal(db_job_get(db, run, NULL, &j), FU_OK);
    assert_int_equal(j->state, DB_JOB_RUNNING);
    assert_true(j->spec_len > 0);
    db_job_free(&j);
    assert_int_equal(db_stage_list(db, run, &st, &n), FU_OK);
    assert_int_equal(n, 1);
    db_stage_array_free(&st, n);
    assert_int_equal(db_peer_get(db, bad, &p), FU_OK);
    db_peer_free(&p);
    assert_int_equal(db_peer_get(db, active, &p), FU_OK);
    db_peer_free(&p);
    /* the forgotten idempotency key makes a new job; the forgotten peer joins as new */
    char again[DB_JOB_ID_LEN + 1];
    bool created = false;
    assert_int_equal(db_job_submit(db, owner, "done", DB_JOB_FINETUNE, "{}", 2, NULL, purged_at + 4 * DAY, again,
                                   &created), FU_OK);
    assert_true(created);
    assert_int_equal(db_peer_upsert(db, gone, "p", PROFILE, DB_PEER_ACTIVE, purged_at + 4 * DAY, &created), FU_OK);
    assert_true(created);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM pragma_foreign_key_check"), 0);
    db_close(&db);
}

/* A store of version 6 (no archive, no purged_ms, no auto_vacuum) opens as the current version with its data,
 * converted to incremental vacuum; space freed by compaction then goes back to the file system. */
static void test_db_v6_store_migrates_and_shrinks(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    assert_int_equal(raw_int(f->path, "PRAGMA auto_vacuum"), 2); /* a new store has it */
    char id[DB_JOB_ID_LEN + 1];
    job_with_plan(db, f->key[0], "v6", 2, id);
    size_t big = 2u << 20;
    uint8_t *blob = malloc(big);
    assert_non_null(blob);
    char hash[DB_HASH_HEX_LEN + 1];
    for (uint32_t s = 0; s < 2; s++)
        for (int64_t step = 1; step <= 3; step++) {
            randombytes_buf(blob, big);
            db_hash_hex(hash, blob, big);
            assert_int_equal(db_ckpt_put(db, id, s, step, blob, big, hash, -1, 2000), FU_OK);
        }
    free(blob);
    assert_int_equal(db_event_add(db, 3000, id, NULL, "note", "before the migration"), FU_OK);
    db_close(&db);
    raw_back_to_v8(f->path);
    raw_exec(f->path, "DROP TABLE event_archive; DROP INDEX jobs_ended; DROP INDEX jobs_ended_id; "
                      "ALTER TABLE jobs DROP COLUMN purged_ms; PRAGMA user_version = 6");
    raw_exec(f->path, "PRAGMA auto_vacuum = NONE; VACUUM");
    assert_int_equal(raw_int(f->path, "PRAGMA auto_vacuum"), 0);
    assert_int_equal(raw_int(f->path, "PRAGMA user_version"), 6);

    db = open_ok(f->path);
    assert_int_equal(raw_int(f->path, "PRAGMA user_version"), DB_SCHEMA_VERSION);
    assert_int_equal(raw_int(f->path, "PRAGMA auto_vacuum"), 2);
    assert_true(has_ckpt(db, id, 1, 3));
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->purged_ms, 0);
    db_job_free(&j);
    db_store_stats st0, st1;
    assert_int_equal(db_store_stats_get(db, true, &st0), FU_OK);
    assert_true(st0.pages * st0.page_size > (int64_t)(10u << 20));
    uint8_t result[16] = {1};
    assert_int_equal(db_job_complete(db, id, result, sizeof result, NULL, NULL, 5000), FU_OK);
    db_compact_policy pol = {.events_max = 1, .ckpt_grace_ms = 0, .budget_s = 10};
    db_compact_stats cs = compact_all(db, &pol, 6000);
    assert_int_equal(cs.ckpts_dropped, 6);
    assert_true(cs.pages_vacuumed > 0);
    assert_int_equal(db_store_stats_get(db, true, &st1), FU_OK);
    print_message("v6 store: %.1f MiB -> %.1f MiB (%lld free pages left)\n",
                  (double)(st0.pages * st0.page_size) / (1 << 20), (double)(st1.pages * st1.page_size) / (1 << 20),
                  (long long)st1.free_pages);
    assert_true(st1.pages * st1.page_size < (int64_t)(6u << 20)); /* ~12 MiB of checkpoints gone */
    assert_true(st1.free_pages <= 2 * DB_VACUUM_SLACK);
    db_audit au;
    assert_int_equal(db_event_audit(db, &au), FU_OK);
    assert_true(au.events >= 1);
    db_close(&db);
}

/* A spec as the broker stores it: the spec text, its NUL, then n_tokens int32 token ids. Caller frees. */
static uint8_t *make_spec(const char *text, size_t n_tokens, size_t *len)
{
    size_t tl = strlen(text) + 1;
    *len = tl + 4 * n_tokens;
    uint8_t *b = malloc(*len);
    assert_non_null(b);
    memcpy(b, text, tl);
    for (size_t i = 0; i < n_tokens; i++) {
        uint32_t t = (uint32_t)(i * 2654435761u) % 32000u;
        memcpy(b + tl + 4 * i, &t, 4);
    }
    return b;
}

/* Inserts a job row as version 8 wrote it (the spec in the row) on a raw connection. */
static void raw_v8_job(sqlite3 *c, const char *id, const char *owner, const char *idem, const char *kind,
                       const uint8_t *spec, size_t len, const char *state)
{
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_prepare_v2(c, "INSERT INTO jobs (id, owner, idem_key, kind, spec, state, created_ms, "
                                           "updated_ms) VALUES (?, ?, ?, ?, ?, ?, 1000, 1000)", -1, &st, NULL),
                     SQLITE_OK);
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, owner, -1, SQLITE_STATIC);
    if (idem)
        sqlite3_bind_text(st, 3, idem, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 4, kind, -1, SQLITE_STATIC);
    sqlite3_bind_blob64(st, 5, spec, len, SQLITE_STATIC);
    sqlite3_bind_text(st, 6, state, -1, SQLITE_STATIC);
    assert_int_equal(sqlite3_step(st), SQLITE_DONE);
    sqlite3_finalize(st);
}

/* A store of version 8 (each job's spec in its jobs row) opens as the current version: every job keeps
 * its spec byte for byte, now in job_specs (the jobs table has no spec column), its stages and
 * checkpoints keep their references, and a retried submission still matches its spec. Also measures
 * what a change of state with a reason (db_job_move's update) of a job with a million tokens writes
 * before the migration (a row whose size changes is written again whole, spec included: SQLite rewrites
 * unchanged overflow pages in place only when the row keeps its size, as a progress update mostly does)
 * and after it. */
static void test_db_v8_store_specs_move_to_their_table(void **state)
{
    fx *f = *state;
    raw_v8_store(f->path);
    size_t len[3];
    uint8_t *spec[3] = {make_spec("{\"steps\":30}", 1000000, &len[0]), make_spec("{\"steps\":2}", 0, &len[1]),
                        make_spec("{\"max_tokens\":8}", 10, &len[2])};
    const char *ids[3] = {"00000000000000a1", "00000000000000b2", "00000000000000c3"};
    const char *peer = f->key[3];
    sqlite3 *c = NULL;
    assert_int_equal(sqlite3_open(f->path, &c), SQLITE_OK);
    raw_v8_job(c, ids[0], f->key[0], "big", "finetune", spec[0], len[0], "running");
    raw_v8_job(c, ids[1], f->key[0], "small", "finetune", spec[1], len[1], "done");
    raw_v8_job(c, ids[2], f->key[1], NULL, "infer", spec[2], len[2], "queued");
    char sql[1024];
    snprintf(sql, sizeof sql,
             "INSERT INTO peers VALUES ('%s', 'p', '{}', 'active', 1.0, 1000, 1000);"
             "INSERT INTO stages VALUES ('%s', 0, 0, 10, '%s', 5000, 'assigned', 1000);"
             "INSERT INTO checkpoints VALUES ('%s', 0, 3, '%064d', x'0102', 1000);"
             "UPDATE jobs SET result = x'0a0b0c', result_hash = '%064d' WHERE id = '%s';",
             peer, ids[0], peer, ids[0], 0, 0, ids[1]);
    assert_int_equal(sqlite3_exec(c, sql, NULL, NULL, NULL), SQLITE_OK);
    /* version 8: a change of state rewrites the row, spec and all */
    raw_wal_truncate(c);
    snprintf(sql, sizeof sql, "UPDATE jobs SET state = 'queued', reason = 'a stage was lost', updated_ms = 2000, "
                              "retries = retries + 1 WHERE id = '%s'", ids[0]);
    assert_int_equal(sqlite3_exec(c, sql, NULL, NULL, NULL), SQLITE_OK);
    int64_t wal_v8 = wal_size(f->path);
    assert_int_equal(sqlite3_close(c), SQLITE_OK);

    db_t *db = open_ok(f->path);
    assert_int_equal(raw_int(f->path, "PRAGMA user_version"), DB_SCHEMA_VERSION);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM pragma_table_info('jobs') WHERE name = 'spec'"), 0);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM job_specs"), 3);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM pragma_foreign_key_check"), 0);
    for (int i = 0; i < 3; i++) {
        db_job *j = NULL;
        assert_int_equal(db_job_get(db, ids[i], NULL, &j), FU_OK);
        assert_int_equal(j->spec_len, len[i]);
        assert_memory_equal(j->spec, spec[i], len[i]);
        db_job_free(&j);
    }
    db_job *list = NULL;
    size_t n = 0;
    assert_int_equal(db_jobs_unfinished(db, &list, &n), FU_OK);
    assert_int_equal(n, 2);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(list[i].spec_len, strcmp(list[i].id, ids[0]) == 0 ? len[0] : len[2]);
    db_job_array_free(&list, n);
    assert_int_equal(db_job_list(db, NULL, &list, &n), FU_OK);
    assert_int_equal(n, 3);
    db_job_array_free(&list, n);
    db_stage *st = NULL;
    assert_int_equal(db_stage_list(db, ids[0], &st, &n), FU_OK);
    assert_int_equal(n, 1);
    db_stage_array_free(&st, n);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM checkpoints"), 1);
    int64_t unfinished = 0, bytes = 0;
    assert_int_equal(db_owner_usage(db, f->key[0], &unfinished, &bytes), FU_OK);
    assert_int_equal(unfinished, 1);
    assert_int_equal(bytes, (int64_t)(len[0] + len[1] + 3));
    /* a retry of the first submission matches its migrated spec; another spec under its key does not */
    char again[DB_JOB_ID_LEN + 1];
    bool created = true;
    assert_int_equal(db_job_submit(db, f->key[0], "big", DB_JOB_FINETUNE, spec[0], len[0], NULL, 3000, again, &created),
                     FU_OK);
    assert_false(created);
    assert_string_equal(again, ids[0]);
    assert_int_equal(db_job_submit(db, f->key[0], "big", DB_JOB_FINETUNE, spec[2], len[2], NULL, 3000, again, &created),
                     FU_EEXIST);
    /* version 9: the same change writes a few pages */
    assert_int_equal(sqlite3_open(f->path, &c), SQLITE_OK);
    raw_wal_truncate(c);
    assert_int_equal(db_job_set_state(db, ids[0], DB_JOB_RUNNING, "resumed after the migration", 4000), FU_OK);
    int64_t wal_v9 = wal_size(f->path);
    assert_int_equal(sqlite3_close(c), SQLITE_OK);
    print_message("a change of state of a job of 1 M tokens wrote %.1f KiB to the WAL at version 8, %.1f KiB "
                  "after the migration\n", (double)wal_v8 / 1024, (double)wal_v9 / 1024);
    assert_true(wal_v8 > (int64_t)len[0]);
    assert_true(wal_v9 < 64 * 1024);
    db_close(&db);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM pragma_integrity_check WHERE integrity_check != 'ok'"), 0);
    for (int i = 0; i < 3; i++)
        free(spec[i]);
}

/* The spec of a job (4 MB of token ids) is written once, at submission: the updates of the job's life
 * (running, progress, a reason, a retry, done) write a few pages each, not the spec again, and the jobs
 * table stays a few pages whatever the specs hold. */
static void test_db_job_updates_leave_the_spec_alone(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    size_t len = 0;
    uint8_t *spec = make_spec("{\"steps\":30}", 1000000, &len);
    char id[DB_JOB_ID_LEN + 1];
    bool created = false;
    sqlite3 *c = NULL;
    assert_int_equal(sqlite3_open(f->path, &c), SQLITE_OK);
    raw_wal_truncate(c);
    assert_int_equal(db_job_submit(db, f->key[0], "k", DB_JOB_FINETUNE, spec, len, NULL, 1000, id, &created), FU_OK);
    int64_t wal_submit = wal_size(f->path);
    assert_true(wal_submit > (int64_t)len); /* written once */
    raw_wal_truncate(c);
    int updates = 0;
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, "planned", 1100), FU_OK);
    updates++;
    for (int64_t step = 1; step <= 20; step++, updates++)
        assert_int_equal(db_job_progress(db, id, step, 30, 2.0, 50, 1100 + step), FU_OK);
    assert_int_equal(db_job_set_micro_batches(db, id, 4), FU_OK);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_QUEUED, "a stage was lost", 1200), FU_OK);
    assert_int_equal(db_job_set_state(db, id, DB_JOB_RUNNING, "resumed", 1300), FU_OK);
    uint8_t result[64] = {7};
    assert_int_equal(db_job_complete(db, id, result, sizeof result, NULL, NULL, 1400), FU_OK);
    updates += 4;
    int64_t wal_updates = wal_size(f->path);
    assert_int_equal(sqlite3_close(c), SQLITE_OK);
    print_message("a job of 1 M tokens: its submission wrote %.1f MiB to the WAL, its %d updates %.1f KiB in all\n",
                  (double)wal_submit / (1 << 20), updates, (double)wal_updates / 1024);
    assert_true(wal_updates < updates * 4 * 4200); /* a few pages a commit; one spec would be 4 MB */
    /* the jobs table: a page or two; the spec is in job_specs */
    assert_true(raw_int(f->path, "SELECT coalesce(sum(length(id) + length(owner) + coalesce(length(reason), 0) + "
                                 "coalesce(length(result), 0)), 0) FROM jobs") < 1024);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    assert_int_equal(j->spec_len, len);
    assert_memory_equal(j->spec, spec, len);
    assert_int_equal(j->step, 20);
    assert_int_equal(j->state, DB_JOB_DONE);
    db_job_free(&j);
    assert_int_equal(db_job_get_brief(db, id, NULL, &j), FU_OK);
    assert_null(j->spec);
    assert_int_equal(j->spec_len, len);
    db_job_free(&j);
    db_close(&db);
    free(spec);
}

/* Many jobs one after another, each with MiB of checkpoints and a result, and a steady stream of
 * events: with compaction in the loop the file stops growing; every turn stays short. */
static void test_db_compact_store_stays_bounded(void **state)
{
    fx *f = *state;
    db_t *db = open_ok(f->path);
    db_compact_policy pol = {.events_max = 2000, .events_keep_ms = DAY, .jobs_keep_ms = 20000, .ckpt_grace_ms = 1000,
                             .budget_s = 0.004};
    size_t big = 256u << 10;
    uint8_t *blob = malloc(big);
    assert_non_null(blob);
    int64_t now = 1000000, size_at[40] = {0};
    double turn_max = 0;
    for (int k = 0; k < 40; k++) {
        char id[DB_JOB_ID_LEN + 1], idem[32];
        snprintf(idem, sizeof idem, "job-%d", k);
        job_with_plan(db, f->key[0], idem, 2, id);
        for (int64_t step = 1; step <= 4; step++)
            for (uint32_t s = 0; s < 2; s++) {
                randombytes_buf(blob, big);
                char hash[DB_HASH_HEX_LEN + 1];
                db_hash_hex(hash, blob, big);
                assert_int_equal(db_ckpt_put(db, id, s, step, blob, big, hash, -1, now), FU_OK);
            }
        for (int e = 0; e < 300; e++)
            assert_int_equal(db_event_add(db, now + e, NULL, f->key[1], "peer-join", "a peer"), FU_OK);
        assert_int_equal(db_job_complete(db, id, blob, big, NULL, NULL, now), FU_OK);
        now += 5000;
        for (int t = 0; t < 20; t++) { /* the broker's turns: a few ms each */
            db_compact_stats cs;
            assert_int_equal(db_compact(db, &pol, now, &cs), FU_OK);
            if (getenv("FUSION_TEST_VERBOSE"))
                print_message("turn %.2f ms: %lld ev %lld ck %lld jobs %lld pages\n", 1e3 * cs.seconds,
                              (long long)cs.events_archived, (long long)cs.ckpts_dropped, (long long)cs.jobs_purged,
                              (long long)cs.pages_vacuumed);
            if (cs.seconds > turn_max) {
                turn_max = cs.seconds;
                print_message("turn %.1f ms: %lld events, %lld checkpoints, %lld jobs, %lld pages, %d commits\n",
                              1e3 * cs.seconds, (long long)cs.events_archived, (long long)cs.ckpts_dropped,
                              (long long)cs.jobs_purged, (long long)cs.pages_vacuumed, cs.commits);
            }
            if (!cs.more)
                break;
        }
        db_store_stats st;
        assert_int_equal(db_store_stats_get(db, true, &st), FU_OK);
        size_at[k] = st.pages * st.page_size;
        assert_true(st.events <= 2000 + 300);
    }
    free(blob);
    print_message("store after 10, 20, 30, 40 jobs: %.1f %.1f %.1f %.1f MiB; longest turn %.1f ms\n",
                  (double)size_at[9] / (1 << 20), (double)size_at[19] / (1 << 20), (double)size_at[29] / (1 << 20),
                  (double)size_at[39] / (1 << 20), 1e3 * turn_max);
    assert_true(size_at[39] <= size_at[19] + (2 << 20)); /* flat once the retention is reached */
    assert_true(turn_max < 0.25);                       /* a loaded 2-core machine: a loose bound */
    db_audit au;
    assert_int_equal(db_event_audit(db, &au), FU_OK);
    assert_true(au.events > 30 * 300);
    db_close(&db);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_db_schema_created),
        cmocka_unit_test(test_db_reopen_keeps_data),
        cmocka_unit_test(test_db_newer_version_refused),
        cmocka_unit_test(test_db_v1_stage_ranges_migrate),
        cmocka_unit_test(test_db_v4_jobs_rebuilt_keeps_references),
        cmocka_unit_test(test_db_garbage_refused),
        cmocka_unit_test(test_db_damaged_store_refused),
        cmocka_unit_test(test_db_missing_dir_refused),
        cmocka_unit_test(test_db_submit_idempotent),
        cmocka_unit_test(test_db_job_model_id),
        cmocka_unit_test(test_db_job_micro_batches),
        cmocka_unit_test(test_db_model_hashes),
        cmocka_unit_test(test_db_ownership),
        cmocka_unit_test(test_db_state_transitions),
        cmocka_unit_test(test_db_ckpt_hash_and_common_step),
        cmocka_unit_test(test_db_ckpt_pruning_keeps_newest),
        cmocka_unit_test(test_db_ckpt_recut_replaces_the_old_plan),
        cmocka_unit_test(test_db_peers),
        cmocka_unit_test(test_db_stage_leases),
        cmocka_unit_test(test_db_stage_leases_batch),
        cmocka_unit_test(test_db_peer_gone_one_commit),
        cmocka_unit_test(test_db_events),
        cmocka_unit_test(test_db_names_and_validators),
        cmocka_unit_test(test_db_corrupt_rows_are_errors),
        cmocka_unit_test(test_db_read_only_and_two_connections),
        cmocka_unit_test(test_db_sibling_connection),
        cmocka_unit_test(test_db_durability_sigkill),
        cmocka_unit_test(test_db_durability_ckpt_sigkill),
        cmocka_unit_test(test_db_disk_full),
        cmocka_unit_test(test_db_commit_latency),
        cmocka_unit_test(test_db_compact_events_archived_and_audited),
        cmocka_unit_test(test_db_compact_archive_hashes_as_documented),
        cmocka_unit_test(test_db_compact_keeps_what_running_jobs_need),
        cmocka_unit_test(test_db_compact_checkpoints_of_ended_jobs),
        cmocka_unit_test(test_db_compact_purges_jobs_past_retention),
        cmocka_unit_test(test_db_compact_forgets_purged_jobs_and_gone_peers),
        cmocka_unit_test(test_db_v6_store_migrates_and_shrinks),
        cmocka_unit_test(test_db_v8_store_specs_move_to_their_table),
        cmocka_unit_test(test_db_job_updates_leave_the_spec_alone),
        cmocka_unit_test(test_db_compact_store_stays_bounded),
    };
    return tu_unit_main(tests, sodium_init, fx_setup, fx_teardown);
}
