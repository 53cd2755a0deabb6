/* db: the peer registry, and the stage plan of each job with its leases. */
#include "db_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fu_alloc.h"
#include "fu_log.h"

#define DB_LOG "db"
#define DB_STAGES_MAX 4096 /* most stages in one job's plan */

/* ------------------------------------------------------------------------------------------------
 * Peers.
 */
#define PEER_COLS "pubkey, name, profile, state, reputation, last_seen_ms, joined_ms"

static void peer_members_free(db_peer *p)
{
    free(p->name);
    free(p->profile);
    memset(p, 0, sizeof *p);
}

static bool name_valid(const char *name)
{
    size_t n = name ? strnlen(name, DB_NAME_MAX + 1) : 0;
    if (n < 1 || n > DB_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
            return false;
    return true;
}

static fu_err read_peer(db_t *db, sqlite3_stmt *st, db_peer *p)
{
    fu_err err;
    int state = 0;
    memset(p, 0, sizeof *p);
    if ((err = db_col_text(db, st, 0, p->key, sizeof p->key, false)) != FU_OK ||
        (err = db_col_dup(db, st, 1, DB_NAME_MAX, false, &p->name)) != FU_OK ||
        (err = db_col_dup(db, st, 2, DB_PROFILE_MAX, false, &p->profile)) != FU_OK ||
        (err = db_col_enum(db, st, 3, db_peer_state_names, DB_N_PEER_STATES, &state)) != FU_OK)
        goto fail;
    p->state = (db_peer_state)state;
    p->reputation = sqlite3_column_double(st, 4);
    p->last_seen_ms = sqlite3_column_int64(st, 5);
    p->joined_ms = sqlite3_column_int64(st, 6);
    if (!db_key_valid(p->key) || !name_valid(p->name) || !(p->reputation >= 0.0 && p->reputation <= 1.0)) {
        FU_ERROR(DB_LOG, "%s: peer row '%s' fails validation (corrupt or foreign row)", db->path, p->key);
        err = FU_EDB;
        goto fail;
    }
    return FU_OK;
fail:
    peer_members_free(p);
    return err;
}

static bool profile_valid(const char *json)
{
    size_t n = json ? strnlen(json, DB_PROFILE_MAX + 1) : 0;
    if (n < 2 || n > DB_PROFILE_MAX)
        return false;
    cJSON *j = cJSON_ParseWithLength(json, n);
    bool ok = j && cJSON_IsObject(j);
    cJSON_Delete(j);
    return ok;
}

/* Does the peer exist, and is it alive (active or backup)? */
static fu_err peer_alive(db_t *db, const char *key, bool *alive)
{
    static const char SQL[] = "SELECT state IN ('active', 'backup') FROM peers WHERE pubkey = ?";
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "t", key));
    FU_TRY(db_step(db, st, "looking up a peer", &row));
    if (row)
        *alive = sqlite3_column_int(st, 0) == 1;
    db_done(st);
    return row ? FU_OK : FU_ENOTFOUND;
}

fu_err db_peer_upsert(db_t *db, const char *key, const char *name, const char *profile_json, db_peer_state state,
                      int64_t now_ms, bool *created)
{
    static const char SQL_UPDATE[] = "UPDATE peers SET name = ?, profile = ?, state = ?, last_seen_ms = ? "
                                     "WHERE pubkey = ?";
    static const char SQL_INSERT[] = "INSERT INTO peers (pubkey, name, profile, state, reputation, last_seen_ms, "
                                     "joined_ms) VALUES (?, ?, ?, ?, ?, ?, ?)";
    if (!db || !db_key_valid(key) || !name_valid(name) || !profile_valid(profile_json) ||
        (state != DB_PEER_ACTIVE && state != DB_PEER_BACKUP))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    fu_err err;
    if ((err = db_prep(db, SQL_UPDATE, &st)) != FU_OK ||
        (err = db_bind(db, st, "tttit", name, profile_json, db_peer_state_names[state], now_ms, key)) != FU_OK ||
        (err = db_run(db, st, "updating a peer")) != FU_OK)
        goto fail;
    bool is_new = sqlite3_changes(db->conn) == 0;
    if (is_new && ((err = db_prep(db, SQL_INSERT, &st)) != FU_OK ||
                   (err = db_bind(db, st, "ttttdii", key, name, profile_json, db_peer_state_names[state],
                                  DB_REPUTATION_INIT, now_ms, now_ms)) != FU_OK ||
                   (err = db_run(db, st, "inserting a peer")) != FU_OK))
        goto fail;
    if ((err = db_event_put(db, now_ms, NULL, key, is_new ? "peer-join" : "peer-rejoin", "%s as %s", name,
                            db_peer_state_names[state])) != FU_OK ||
        (err = db_commit(db)) != FU_OK)
        goto fail;
    if (created)
        *created = is_new;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_peer_set_profile(db_t *db, const char *key, const char *profile_json)
{
    static const char SQL[] = "UPDATE peers SET profile = ? WHERE pubkey = ?";
    if (!db || !db_key_valid(key) || !profile_valid(profile_json))
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "tt", profile_json, key));
    FU_TRY(db_run(db, st, "storing a peer's profile"));
    return sqlite3_changes(db->conn) ? FU_OK : FU_ENOTFOUND;
}

/* db_peer_set_state and db_peer_gone: the state, the stages a departure loses, and one event (kind,
 * job, detail: why, then the state and the stages lost), in one transaction. */
static fu_err set_state(db_t *db, const char *key, db_peer_state state, int64_t now_ms, const char *kind,
                        const char *job, const char *why)
{
    /* a departure is the last time the peer was heard of (forgetting counts from it: db_compact) */
    static const char SQL[] = "UPDATE peers SET state = ?1, last_seen_ms = CASE WHEN ?1 IN ('left','dead') THEN "
                              "max(last_seen_ms, ?3) ELSE last_seen_ms END WHERE pubkey = ?2";
    static const char SQL_LOSE[] = "UPDATE stages SET state = 'lost', lease_deadline_ms = 0, updated_ms = ? "
                                   "WHERE peer_key = ? AND state = 'assigned'";
    if (!db || !db_key_valid(key) || (unsigned)state >= DB_N_PEER_STATES || (job && !db_job_id_valid(job)))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    fu_err err;
    if ((err = db_prep(db, SQL, &st)) != FU_OK ||
        (err = db_bind(db, st, "tti", db_peer_state_names[state], key, now_ms)) != FU_OK ||
        (err = db_run(db, st, "setting a peer's state")) != FU_OK)
        goto fail;
    if (sqlite3_changes(db->conn) == 0) {
        err = FU_ENOTFOUND;
        goto fail;
    }
    int lost = 0;
    if (state == DB_PEER_LEFT || state == DB_PEER_DEAD) {
        if ((err = db_prep(db, SQL_LOSE, &st)) != FU_OK || (err = db_bind(db, st, "it", now_ms, key)) != FU_OK ||
            (err = db_run(db, st, "releasing a peer's stages")) != FU_OK)
            goto fail;
        lost = sqlite3_changes(db->conn);
    }
    if ((err = db_event_put(db, now_ms, job, key, kind, "%.3900s%s%s (%d stages lost)", why ? why : "",
                            why ? ": " : "", db_peer_state_names[state], lost)) != FU_OK ||
        (err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_peer_set_state(db_t *db, const char *key, db_peer_state state, int64_t now_ms)
{
    return set_state(db, key, state, now_ms, "peer-state", NULL, NULL);
}

fu_err db_peer_gone(db_t *db, const char *key, bool left, int64_t now_ms, const char *job, const char *why)
{
    return set_state(db, key, left ? DB_PEER_LEFT : DB_PEER_DEAD, now_ms, left ? "peer-left" : "peer-dead", job,
                     why);
}

fu_err db_peer_touch(db_t *db, const char *key, int64_t now_ms)
{
    static const char SQL[] = "UPDATE peers SET last_seen_ms = max(last_seen_ms, ?) WHERE pubkey = ?";
    if (!db || !db_key_valid(key))
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "it", now_ms, key));
    FU_TRY(db_run(db, st, "touching a peer"));
    return sqlite3_changes(db->conn) == 1 ? FU_OK : FU_ENOTFOUND;
}

fu_err db_peer_reputation_adjust(db_t *db, const char *key, double delta, int64_t now_ms, double *out)
{
    static const char SQL[] = "UPDATE peers SET reputation = min(1.0, max(0.0, reputation + ?)) WHERE pubkey = ? "
                              "RETURNING reputation";
    if (!db || !db_key_valid(key) || !isfinite(delta))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    fu_err err;
    bool row;
    double rep = 0;
    if ((err = db_prep(db, SQL, &st)) != FU_OK || (err = db_bind(db, st, "dt", delta, key)) != FU_OK ||
        (err = db_step(db, st, "adjusting reputation", &row)) != FU_OK)
        goto fail;
    if (!row) {
        db_done(st);
        err = FU_ENOTFOUND;
        goto fail;
    }
    rep = sqlite3_column_double(st, 0);
    /* RETURNING: the update is complete only once the statement has run to the end. */
    if ((err = db_step(db, st, "adjusting reputation", &row)) != FU_OK)
        goto fail;
    db_done(st);
    if ((err = db_event_put(db, now_ms, NULL, key, "reputation", "%+.3f -> %.3f", delta, rep)) != FU_OK ||
        (err = db_commit(db)) != FU_OK)
        goto fail;
    if (out)
        *out = rep;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_peer_get(db_t *db, const char *key, db_peer **out)
{
    static const char SQL[] = "SELECT " PEER_COLS " FROM peers WHERE pubkey = ?";
    if (!db || !db_key_valid(key) || !out)
        return FU_EINVAL;
    sqlite3_stmt *st;
    bool row;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "t", key));
    FU_TRY(db_step(db, st, "loading a peer", &row));
    if (!row) {
        db_done(st);
        return FU_ENOTFOUND;
    }
    db_peer *p = fu_calloc(1, sizeof *p);
    fu_err err = read_peer(db, st, p);
    db_done(st);
    if (err != FU_OK) {
        free(p);
        return err;
    }
    *out = p;
    return FU_OK;
}

static fu_err read_peer_row(db_t *db, sqlite3_stmt *st, const void *ctx, void *item)
{
    (void)ctx;
    return read_peer(db, st, item);
}

static void peer_item_free(void *item)
{
    peer_members_free(item);
}

void db_peer_free(db_peer **peer_p)
{
    if (!peer_p || !*peer_p)
        return;
    peer_members_free(*peer_p);
    free(*peer_p);
    *peer_p = NULL;
}

fu_err db_peer_list(db_t *db, unsigned state_mask, db_peer **out, size_t *n)
{
    static const char SQL[] = "SELECT " PEER_COLS " FROM peers ORDER BY joined_ms, pubkey";
    if (!db || !out || !n)
        return FU_EINVAL;
    if (state_mask == 0)
        state_mask = ~0u;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    db_peer *arr = NULL;
    size_t cnt = 0;
    FU_TRY(db_collect(db, st, "listing peers", sizeof *arr, read_peer_row, NULL, peer_item_free, (void **)&arr, &cnt));
    size_t k = 0; /* keep those in state_mask */
    for (size_t i = 0; i < cnt; i++) {
        if (state_mask & (1u << arr[i].state))
            arr[k++] = arr[i];
        else
            peer_members_free(&arr[i]);
    }
    *out = arr;
    *n = k;
    return FU_OK;
}

void db_peer_array_free(db_peer **arr_p, size_t n)
{
    db_items_free(arr_p, n, sizeof **arr_p, peer_item_free);
}

/* ------------------------------------------------------------------------------------------------
 * Stages and leases.
 */
#define STAGE_COLS "job_id, idx, node_first, node_end, peer_key, lease_deadline_ms, state, updated_ms"

static fu_err read_stage(db_t *db, sqlite3_stmt *st, db_stage *s)
{
    fu_err err;
    int state = 0;
    memset(s, 0, sizeof *s);
    if ((err = db_col_text(db, st, 0, s->job, sizeof s->job, false)) != FU_OK ||
        (err = db_col_text(db, st, 4, s->peer, sizeof s->peer, true)) != FU_OK ||
        (err = db_col_enum(db, st, 6, db_stage_state_names, DB_N_STAGE_STATES, &state)) != FU_OK)
        return err;
    int64_t idx = sqlite3_column_int64(st, 1), first = sqlite3_column_int64(st, 2), end = sqlite3_column_int64(st, 3);
    if (idx < 0 || idx > UINT32_MAX || first < 0 || end <= first || end > UINT32_MAX ||
        (s->peer[0] && !db_key_valid(s->peer))) {
        FU_ERROR(DB_LOG, "%s: stage row of job '%s' fails validation (corrupt or foreign row)", db->path, s->job);
        return FU_EDB;
    }
    s->index = (uint32_t)idx;
    s->first = (uint32_t)first;
    s->end = (uint32_t)end;
    s->lease_deadline_ms = sqlite3_column_int64(st, 5);
    s->state = (db_stage_state)state;
    s->updated_ms = sqlite3_column_int64(st, 7);
    return FU_OK;
}

static fu_err read_stage_row(db_t *db, sqlite3_stmt *st, const void *ctx, void *item)
{
    (void)ctx;
    return read_stage(db, st, item);
}

static fu_err collect_stages(db_t *db, sqlite3_stmt *st, db_stage **out, size_t *n)
{
    return db_collect(db, st, "listing stages", sizeof **out, read_stage_row, NULL, NULL, (void **)out, n);
}

/* The job must exist and not be final; the peer (when given) must exist and be alive. */
static fu_err check_job_peer(db_t *db, const char *job, const char *peer)
{
    db_job_state js;
    FU_TRY(db_job_state_read(db, job, NULL, &js));
    if (db_job_state_final(js))
        return FU_EPERM;
    if (peer) {
        bool alive = false;
        FU_TRY(peer_alive(db, peer, &alive));
        if (!alive)
            return FU_EPERM;
    }
    return FU_OK;
}

fu_err db_stage_assign(db_t *db, const char *job, const db_stage_plan *plan, size_t n, const char *running_reason,
                       int64_t now_ms)
{
    static const char SQL_CLEAR[] = "DELETE FROM stages WHERE job_id = ?";
    static const char SQL_INSERT[] = "INSERT INTO stages (job_id, idx, node_first, node_end, peer_key, "
                                     "lease_deadline_ms, state, updated_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)";
    static const char SQL_CK_CLEAR[] = "DELETE FROM checkpoints WHERE job_id = ?";
    static const char SQL_CK_PUT[] = "INSERT INTO checkpoints (job_id, stage_idx, step, hash, data, created_ms) "
                                     "VALUES (?, ?, ?, ?, ?, ?)";
    if (!db || !db_job_id_valid(job) || !plan || n == 0 || n > DB_STAGES_MAX)
        return FU_EINVAL;
    const bool recut = plan[0].ckpt != NULL;
    for (size_t i = 0; i < n; i++)
        if (plan[i].end <= plan[i].first || (i > 0 && plan[i].first < plan[i - 1].end) ||
            (plan[i].peer && !db_key_valid(plan[i].peer)) || (plan[i].ckpt != NULL) != recut ||
            (recut && (plan[i].ckpt_len == 0 || plan[i].ckpt_len > DB_BLOB_MAX || plan[i].ckpt_step < 0 ||
                       plan[i].ckpt_step != plan[0].ckpt_step)))
            return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    fu_err err;
    if ((err = check_job_peer(db, job, NULL)) != FU_OK)
        goto fail;
    if ((err = db_prep(db, SQL_CLEAR, &st)) != FU_OK || (err = db_bind(db, st, "t", job)) != FU_OK ||
        (err = db_run(db, st, "clearing a stage plan")) != FU_OK)
        goto fail;
    for (size_t i = 0; i < n; i++) {
        const db_stage_plan *p = &plan[i];
        if (p->peer && (err = check_job_peer(db, job, p->peer)) != FU_OK)
            goto fail;
        if ((err = db_prep(db, SQL_INSERT, &st)) != FU_OK ||
            (err = db_bind(db, st, "tiiititi", job, (int64_t)i, (int64_t)p->first, (int64_t)p->end, p->peer,
                           p->peer ? p->lease_deadline_ms : (int64_t)0,
                           db_stage_state_names[p->peer ? DB_STAGE_ASSIGNED : DB_STAGE_PENDING], now_ms)) != FU_OK ||
            (err = db_run(db, st, "inserting a stage")) != FU_OK)
            goto fail;
    }
    if (recut) { /* the old plan's checkpoints give way to the same state cut for this plan */
        if ((err = db_prep(db, SQL_CK_CLEAR, &st)) != FU_OK || (err = db_bind(db, st, "t", job)) != FU_OK ||
            (err = db_run(db, st, "dropping the old plan's checkpoints")) != FU_OK)
            goto fail;
        for (size_t i = 0; i < n; i++) {
            char hash[DB_HASH_HEX_LEN + 1];
            db_hash_hex(hash, plan[i].ckpt, plan[i].ckpt_len);
            if ((err = db_prep(db, SQL_CK_PUT, &st)) != FU_OK ||
                (err = db_bind(db, st, "tiitbi", job, (int64_t)i, plan[i].ckpt_step, hash, plan[i].ckpt,
                               plan[i].ckpt_len, now_ms)) != FU_OK ||
                (err = db_run(db, st, "storing a re-cut checkpoint")) != FU_OK)
                goto fail;
        }
    }
    db_job_state from;
    if (running_reason && ((err = db_job_state_read(db, job, NULL, &from)) != FU_OK ||
                           (err = db_job_move(db, job, from, DB_JOB_RUNNING, running_reason, now_ms)) != FU_OK))
        goto fail;
    if ((err = db_event_put(db, now_ms, job, NULL, "plan", "%zu stages over nodes [%u, %u)%s", n, plan[0].first,
                            plan[n - 1].end, recut ? ", checkpoints cut again for it" : "")) != FU_OK ||
        (err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

fu_err db_stage_reassign(db_t *db, const char *job, uint32_t index, const char *peer, int64_t lease_deadline_ms,
                         int64_t now_ms)
{
    static const char SQL[] = "UPDATE stages SET peer_key = ?, lease_deadline_ms = ?, state = 'assigned', "
                              "updated_ms = ? WHERE job_id = ? AND idx = ?";
    if (!db || !db_job_id_valid(job) || !db_key_valid(peer))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    fu_err err;
    if ((err = check_job_peer(db, job, peer)) != FU_OK)
        goto fail;
    if ((err = db_prep(db, SQL, &st)) != FU_OK ||
        (err = db_bind(db, st, "tiiti", peer, lease_deadline_ms, now_ms, job, (int64_t)index)) != FU_OK ||
        (err = db_run(db, st, "reassigning a stage")) != FU_OK)
        goto fail;
    if (sqlite3_changes(db->conn) != 1) {
        err = FU_ENOTFOUND;
        goto fail;
    }
    if ((err = db_event_put(db, now_ms, job, peer, "reassign", "stage %u", index)) != FU_OK ||
        (err = db_commit(db)) != FU_OK)
        goto fail;
    return FU_OK;
fail:
    db_rollback(db);
    return err;
}

/* The checks and the update of db_stage_lease_extend, inside the caller's transaction. */
static fu_err lease_extend_in_tx(db_t *db, const char *job, uint32_t index, const char *peer,
                                 int64_t lease_deadline_ms, int64_t now_ms)
{
    static const char SQL_GET[] = "SELECT " STAGE_COLS " FROM stages WHERE job_id = ? AND idx = ?";
    static const char SQL_SET[] = "UPDATE stages SET lease_deadline_ms = max(lease_deadline_ms, ?), updated_ms = ? "
                                  "WHERE job_id = ? AND idx = ?";
    if (!db_job_id_valid(job) || !db_key_valid(peer))
        return FU_EINVAL;
    sqlite3_stmt *st;
    fu_err err;
    bool row;
    db_stage s;
    if ((err = db_prep(db, SQL_GET, &st)) != FU_OK || (err = db_bind(db, st, "ti", job, (int64_t)index)) != FU_OK ||
        (err = db_step(db, st, "reading a lease", &row)) != FU_OK)
        return err;
    err = row ? read_stage(db, st, &s) : FU_ENOTFOUND;
    db_done(st);
    if (err != FU_OK)
        return err;
    if (s.state != DB_STAGE_ASSIGNED || strcmp(s.peer, peer) != 0)
        return FU_EPERM;
    if (s.lease_deadline_ms < now_ms)
        return FU_ETIMEDOUT;
    if ((err = db_prep(db, SQL_SET, &st)) != FU_OK ||
        (err = db_bind(db, st, "iiti", lease_deadline_ms, now_ms, job, (int64_t)index)) != FU_OK)
        return err;
    return db_run(db, st, "extending a lease");
}

fu_err db_stage_lease_extend(db_t *db, const char *job, uint32_t index, const char *peer, int64_t lease_deadline_ms,
                             int64_t now_ms)
{
    if (!db || !db_job_id_valid(job) || !db_key_valid(peer))
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    fu_err err = lease_extend_in_tx(db, job, index, peer, lease_deadline_ms, now_ms);
    if (err == FU_OK && (err = db_commit(db)) == FU_OK)
        return FU_OK;
    db_rollback(db);
    return err;
}

fu_err db_stage_leases_extend(db_t *db, db_lease *leases, size_t n, int64_t now_ms)
{
    if (!db || (n && !leases))
        return FU_EINVAL;
    if (n == 0)
        return FU_OK;
    FU_TRY(db_begin(db));
    for (size_t i = 0; i < n; i++) {
        db_lease *l = &leases[i];
        l->result = lease_extend_in_tx(db, l->job, l->index, l->peer, l->deadline_ms, now_ms);
        /* a lease refused (another holder, run out, no such stage) changes nothing: go on */
        if (l->result != FU_OK && l->result != FU_EPERM && l->result != FU_ETIMEDOUT && l->result != FU_ENOTFOUND &&
            l->result != FU_EINVAL) {
            fu_err err = l->result;
            db_rollback(db);
            return err;
        }
    }
    fu_err err = db_commit(db);
    if (err != FU_OK)
        db_rollback(db);
    return err;
}

fu_err db_stage_list(db_t *db, const char *job, db_stage **out, size_t *n)
{
    static const char SQL[] = "SELECT " STAGE_COLS " FROM stages WHERE job_id = ? ORDER BY idx";
    if (!db || !db_job_id_valid(job) || !out || !n)
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "t", job));
    return collect_stages(db, st, out, n);
}

fu_err db_stage_expired(db_t *db, int64_t now_ms, db_stage **out, size_t *n)
{
    static const char SQL_FIND[] = "SELECT " STAGE_COLS " FROM stages WHERE state = 'assigned' AND "
                                   "lease_deadline_ms < ? ORDER BY job_id, idx";
    static const char SQL_LOSE[] = "UPDATE stages SET state = 'lost', updated_ms = ? WHERE job_id = ? AND idx = ?";
    if (!db || !out || !n)
        return FU_EINVAL;
    FU_TRY(db_begin(db));
    sqlite3_stmt *st;
    db_stage *arr = NULL;
    size_t cnt = 0;
    fu_err err;
    if ((err = db_prep(db, SQL_FIND, &st)) != FU_OK || (err = db_bind(db, st, "i", now_ms)) != FU_OK ||
        (err = collect_stages(db, st, &arr, &cnt)) != FU_OK)
        goto fail;
    for (size_t i = 0; i < cnt; i++) {
        arr[i].state = DB_STAGE_LOST;
        arr[i].updated_ms = now_ms;
        if ((err = db_prep(db, SQL_LOSE, &st)) != FU_OK ||
            (err = db_bind(db, st, "iti", now_ms, arr[i].job, (int64_t)arr[i].index)) != FU_OK ||
            (err = db_run(db, st, "expiring a lease")) != FU_OK ||
            (err = db_event_put(db, now_ms, arr[i].job, arr[i].peer[0] ? arr[i].peer : NULL, "lease-expired",
                                "stage %u, deadline %lld", arr[i].index, (long long)arr[i].lease_deadline_ms)) != FU_OK)
            goto fail;
    }
    if ((err = db_commit(db)) != FU_OK)
        goto fail;
    *out = arr;
    *n = cnt;
    return FU_OK;
fail:
    free(arr);
    db_rollback(db);
    return err;
}

fu_err db_stages_in_state(db_t *db, db_stage_state state, db_stage **out, size_t *n)
{
    static const char SQL[] = "SELECT " STAGE_COLS " FROM stages WHERE state = ? ORDER BY job_id, idx";
    if (!db || (unsigned)state >= DB_N_STAGE_STATES || !out || !n)
        return FU_EINVAL;
    sqlite3_stmt *st;
    FU_TRY(db_prep(db, SQL, &st));
    FU_TRY(db_bind(db, st, "t", db_stage_state_names[state]));
    return collect_stages(db, st, out, n);
}

void db_stage_array_free(db_stage **arr_p, size_t n)
{
    db_items_free(arr_p, n, sizeof **arr_p, NULL);
}
