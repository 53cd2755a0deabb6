/* db: checkpoints of stages (hash-checked, pruned, newest common step). */
#include "db_internal.h"

#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "fu_log.h"

#define DB_LOG "db"

/* The newest step every stage of job's plan has checkpointed, inside the caller's transaction;
 * *found = false when there is none. */
static fu_err common_step(db_t *db, const char *job, int64_t *step, bool *found)
{
    static const char SQL[] = "SELECT c.step FROM checkpoints c JOIN stages s ON s.job_id = c.job_id AND "
                              "s.idx = c.stage_idx WHERE c.job_id = ?1 GROUP BY c.step "
                              "HAVING count(*) = (SELECT count(*) FROM stages WHERE job_id = ?1) "
                              "ORDER BY c.step DESC LIMIT 1";
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "t", job));
    FU_TRY(db_step(db, st, "finding the newest common checkpoint", found));
    if (*found)
        *step = sqlite3_column_int64(st, 0);
    db_done(st);
    return FU_OK;
}

fu_err db_ckpt_put(db_t *db, const char *job, uint32_t stage, int64_t step, const void *data, size_t len,
                   const char *hash_hex, int64_t keep_step, int64_t now_ms)
{
    static const char SQL_PUT[] = "INSERT OR REPLACE INTO checkpoints (job_id, stage_idx, step, hash, data, "
                                  "created_ms) VALUES (?, ?, ?, ?, ?, ?)";
    /* Keeps the newest ckpt_keep steps of (job, stage), and always the job's newest common step, so
     * that recovery has a consistent point even when one stage ran ahead of the others, and the step
     * a starting run loads (?5). */
    static const char SQL_PRUNE[] = "DELETE FROM checkpoints WHERE job_id = ?1 AND stage_idx = ?2 AND step != ?4 "
                                    "AND step != ?5 AND step NOT IN (SELECT step FROM checkpoints WHERE job_id = ?1 "
                                    "AND stage_idx = ?2 ORDER BY step DESC LIMIT ?3)";
    if (!db || !db_job_id_valid(job) || step < 0 || !data || len == 0 || len > DB_BLOB_MAX ||
        !db_hash_hex_valid(hash_hex))
        return FU_EINVAL;
    char hash[DB_HASH_HEX_LEN + 1];
    db_hash_hex(hash, data, len);
    if (sodium_memcmp(hash, hash_hex, DB_HASH_HEX_LEN) != 0) {
        FU_WARN(DB_LOG, "job %s stage %u step %lld: checkpoint hash mismatch, refused", job, stage, (long long)step);
        return FU_EAUTH;
    }
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    db_job_state js;
    int64_t common = -1;
    bool found = false;
    fu_err err = db_job_state_read(db, job, NULL, &js);
    if (err != FU_OK)
        goto fail;
    if (db_job_state_final(js)) {
        err = FU_EPERM;
        goto fail;
    }
    if ((err = db_prep(db, SQL_PUT, &st)) != FU_OK ||
        (err = db_bind(db, st, "tiitbi", job, (int64_t)stage, step, hash, data, len, now_ms)) != FU_OK ||
        (err = db_run(db, st, "storing a checkpoint")) != FU_OK)
        goto fail;
    if ((err = common_step(db, job, &common, &found)) != FU_OK)
        goto fail;
    if ((err = db_prep(db, SQL_PRUNE, &st)) != FU_OK ||
        (err = db_bind(db, st, "tiiii", job, (int64_t)stage, (int64_t)db->ckpt_keep, found ? common : (int64_t)-1,
                       keep_step)) !=
            FU_OK ||
        (err = db_run(db, st, "pruning checkpoints")) != FU_OK)
        goto fail;
    if ((err = db_event_put(db, now_ms, job, NULL, "checkpoint", "stage %u step %lld, %zu bytes", stage,
                            (long long)step, len)) != FU_OK ||
        (err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_ckpt_get(db_t *db, const char *job, uint32_t stage, int64_t step, db_ckpt **out)
{
    static const char SQL[] = "SELECT step, hash, data, created_ms FROM checkpoints WHERE job_id = ?1 AND "
                              "stage_idx = ?2 AND (?3 < 0 OR step = ?3) ORDER BY step DESC LIMIT 1";
    if (!db || !db_job_id_valid(job) || !out)
        return FU_EINVAL;
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "tii", job, (int64_t)stage, step));
    FU_TRY(db_step(db, st, "loading a checkpoint", &row));
    if (!row) {
        db_done(st);
        return FU_ENOTFOUND;
    }
    db_ckpt *c = fu_calloc(1, sizeof *c);
    memcpy(c->job, job, sizeof c->job);
    c->stage = stage;
    c->step = sqlite3_column_int64(st, 0);
    c->created_ms = sqlite3_column_int64(st, 3);
    fu_err err;
    if ((err = db_col_text(db, st, 1, c->hash, sizeof c->hash, false)) != FU_OK ||
        (err = db_col_blob(db, st, 2, &c->data, &c->len)) != FU_OK)
        goto fail;
    db_done(st);
    char hash[DB_HASH_HEX_LEN + 1];
    db_hash_hex(hash, c->data, c->len);
    if (!db_hash_hex_valid(c->hash) || c->len == 0 || sodium_memcmp(hash, c->hash, DB_HASH_HEX_LEN) != 0) {
        FU_ERROR(DB_LOG, "%s: checkpoint of job %s stage %u step %lld does not match its hash (damaged)", db->path,
                 job, stage, (long long)c->step);
        err = FU_EAUTH;
        goto fail;
    }
    *out = c;
    return FU_OK;
fail:
    db_done(st);
    db_ckpt_free(&c);
    return err;
}

void db_ckpt_free(db_ckpt **ckpt_p)
{
    if (!ckpt_p || !*ckpt_p)
        return;
    free((*ckpt_p)->data);
    free(*ckpt_p);
    *ckpt_p = NULL;
}

fu_err db_ckpt_common_step(db_t *db, const char *job, int64_t *step)
{
    if (!db || !db_job_id_valid(job) || !step)
        return FU_EINVAL;
    bool found = false;
    int64_t s = 0;
    FU_TRY(common_step(db, job, &s, &found));
    if (!found)
        return FU_ENOTFOUND;
    *step = s;
    return FU_OK;
}
