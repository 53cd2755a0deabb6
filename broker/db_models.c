/* db: the content hashes of the models served (see db.h db_model_hashes). */
#include "db_internal.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"

fu_err db_model_hashes_put(db_t *db, const db_model_hashes *m, int64_t now_ms)
{
    static const char SQL_PUT[] = "INSERT OR REPLACE INTO model_hashes (dir, sig, model_id, hashes, used_ms) "
                                  "VALUES (?, ?, ?, ?, ?)";
    static const char SQL_PRUNE[] = "DELETE FROM model_hashes WHERE dir NOT IN (SELECT dir FROM model_hashes "
                                    "ORDER BY used_ms DESC LIMIT ?1)";
    if (!db || !m || !m->dir || !m->dir[0] || strlen(m->model_id) != DB_MODEL_ID_LEN || !m->hashes ||
        !m->n_tensors || m->n_tensors > (1u << 24))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    fu_err err;
    if ((err = db_prep(db, SQL_PUT, &st)) != FU_OK ||
        (err = db_bind(db, st, "tbtbi", m->dir, m->sig, (size_t)DB_HASH_LEN, m->model_id, m->hashes,
                       m->n_tensors * DB_HASH_LEN, now_ms)) != FU_OK ||
        (err = db_run(db, st, "storing a model's hashes")) != FU_OK)
        goto fail;
    if ((err = db_prep(db, SQL_PRUNE, &st)) != FU_OK || (err = db_bind(db, st, "i", (int64_t)DB_MODEL_HASHES_MAX)) != FU_OK ||
        (err = db_run(db, st, "pruning model hashes")) != FU_OK)
        goto fail;
    if ((err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

void db_model_hashes_free(db_model_hashes **arr, size_t n)
{
    if (!arr || !*arr)
        return;
    for (size_t i = 0; i < n; i++) {
        free((*arr)[i].dir);
        free((*arr)[i].hashes);
    }
    free(*arr);
    *arr = NULL;
}

fu_err db_model_hashes_all(db_t *db, db_model_hashes **out, size_t *n)
{
    static const char SQL[] = "SELECT dir, sig, model_id, hashes FROM model_hashes ORDER BY used_ms DESC";
    if (!db || !out || !n)
        return FU_EINVAL;
    *out = NULL;
    *n = 0;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    db_model_hashes *arr = fu_calloc(DB_MODEL_HASHES_MAX, sizeof *arr);
    size_t k = 0;
    fu_err err = FU_OK;
    bool row;
    while (k < DB_MODEL_HASHES_MAX && (err = db_step(db, st, "reading model hashes", &row)) == FU_OK && row) {
        db_model_hashes *m = &arr[k];
        uint8_t *sig = NULL;
        size_t sl = 0, hl = 0;
        if ((err = db_col_dup(db, st, 0, 4096, false, &m->dir)) != FU_OK ||
            (err = db_col_blob(db, st, 1, &sig, &sl)) != FU_OK ||
            (err = db_col_text(db, st, 2, m->model_id, sizeof m->model_id, false)) != FU_OK ||
            (err = db_col_blob(db, st, 3, &m->hashes, &hl)) != FU_OK) {
            free(sig);
            k++;
            break;
        }
        if (sl == DB_HASH_LEN)
            memcpy(m->sig, sig, DB_HASH_LEN);
        free(sig);
        m->n_tensors = hl / DB_HASH_LEN;
        k++;
        if (sl != DB_HASH_LEN || strlen(m->model_id) != DB_MODEL_ID_LEN || !m->n_tensors || hl % DB_HASH_LEN) {
            err = FU_EDB;
            break;
        }
    }
    db_done(st);
    if (err != FU_OK) {
        db_model_hashes_free(&arr, k);
        return err;
    }
    *out = arr;
    *n = k;
    return FU_OK;
}
