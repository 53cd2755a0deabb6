/* broker_api: GET /api/peers, /api/jobs, /api/jobs/JOB/events, /api/jobs/JOB/loss, /api/archive as
 * JSON (see broker_api.h). */
#include "broker_api.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "broker_internal.h"
#include "fu_encode.h"
#include "wire_keys.h"

#define BEARER "Bearer "

/* The client key (Z85, in key) a bearer token proves, and its roles; false when there is none. */
static bool caller_of(broker_t *b, const char *authorization, char key[WIRE_KEY_Z85_LEN + 1], uint32_t *roles)
{
    size_t bl = strlen(BEARER);
    if (!authorization || strncmp(authorization, BEARER, bl) != 0 || strlen(authorization + bl) != WIRE_HTTP_TOKEN_LEN)
        return false;
    const char *token = authorization + bl;
    char pk_hex[2 * WIRE_KEY_BYTES + 1];
    memcpy(pk_hex, token, 2 * WIRE_KEY_BYTES);
    pk_hex[2 * WIRE_KEY_BYTES] = '\0';
    uint8_t client_pk[WIRE_KEY_BYTES];
    char want[WIRE_HTTP_TOKEN_LEN + 1];
    if (fu_hex_decode(client_pk, sizeof client_pk, pk_hex) != FU_OK ||
        wire_http_token(wire_keypair_secret(b->kp), client_pk, wire_keypair_public(b->kp), client_pk, want) != FU_OK ||
        sodium_memcmp(want, token, WIRE_HTTP_TOKEN_LEN) != 0)
        return false;
    wire_key_to_z85(client_pk, key);
    *roles = wire_zap_roles(b->zap, key);
    return (*roles & (WIRE_ROLE_CLIENT | WIRE_ROLE_OPERATOR)) != 0;
}

static void reply_json(broker_api_reply *r, unsigned status, cJSON *o)
{
    r->status = status;
    r->body = o ? cJSON_PrintUnformatted(o) : NULL;
    r->len = r->body ? strlen(r->body) : 0;
    cJSON_Delete(o);
}

static void reply_error(broker_api_reply *r, unsigned status, const char *text)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "error", text);
    reply_json(r, status, o);
}

static const char *peer_state(const broker_peer *p, bool visible)
{
    if (!p->live)
        return "gone";
    if (p->draining)
        return "draining";
    if (p->paused)
        return "paused";
    if (!p->job[0])
        return "idle";
    if (!visible)
        return "busy";
    return p->backup ? "backup" : "stage";
}

static cJSON *peers_json(broker_t *b, const char *caller, uint32_t roles)
{
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; i < b->n_peers; i++) {
        const broker_peer *p = &b->peers[i];
        const broker_job *j = p->job[0] ? broker_job_find(b, p->job) : NULL;
        bool visible = (roles & WIRE_ROLE_OPERATOR) || (j && caller && strcmp(j->owner, caller) == 0);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "peer", p->key);
        cJSON_AddStringToObject(o, "name", p->name);
        cJSON_AddStringToObject(o, "device", p->device);
        cJSON_AddStringToObject(o, "backend", p->backend == FUSION__BACKEND__BACKEND_CUDA ? "cuda" : "cpu");
        cJSON_AddNumberToObject(o, "gflops", p->gflops);
        cJSON_AddNumberToObject(o, "gflops_verified", p->verified_gflops);
        cJSON_AddNumberToObject(o, "memory_bytes", (double)p->mem_bytes);
        cJSON_AddNumberToObject(o, "link_bps", p->link_bw);
        cJSON_AddNumberToObject(o, "link_latency_ms", p->link_latency_ms);
        cJSON_AddNumberToObject(o, "reputation", p->reputation);
        cJSON_AddStringToObject(o, "state", peer_state(p, visible));
        if (visible && j) {
            cJSON_AddStringToObject(o, "job", j->id);
            cJSON_AddNumberToObject(o, "stage", p->stage);
        }
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

static cJSON *stages_json(broker_t *b, const broker_job *j)
{
    cJSON *arr = cJSON_CreateArray();
    for (uint32_t s = 0; j && j->phase != BJ_QUEUED && s < j->n_stages; s++) {
        const broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        char label[48];
        dag_graph_range_label(j->graph, j->stages[s].first, j->stages[s].last, label, sizeof label);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "index", s);
        cJSON_AddStringToObject(o, "peer", j->stages[s].peer);
        cJSON_AddStringToObject(o, "peer_name", p ? p->name : "");
        cJSON_AddStringToObject(o, "layers", label);
        cJSON_AddNumberToObject(o, "node_begin", j->stages[s].first);
        cJSON_AddNumberToObject(o, "node_end", j->stages[s].last);
        cJSON_AddBoolToObject(o, "ready", j->stages[s].ready);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

static cJSON *jobs_json(broker_t *b, const char *caller)
{
    db_job *arr = NULL;
    size_t n = 0;
    if (db_job_list(b->db, caller, &arr, &n) != FU_OK)
        return NULL;
    cJSON *out = cJSON_CreateArray();
    for (size_t i = 0; i < n; i++) {
        const db_job *dj = &arr[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "job", dj->id);
        cJSON_AddStringToObject(o, "kind", db_job_kind_name(dj->kind));
        cJSON_AddStringToObject(o, "state", db_job_state_name(dj->state));
        cJSON_AddNumberToObject(o, "step", (double)dj->step);
        cJSON_AddNumberToObject(o, "total_steps", (double)dj->total_steps);
        if (!isnan(dj->loss))
            cJSON_AddNumberToObject(o, "loss", dj->loss);
        cJSON_AddNumberToObject(o, "tokens_per_s", dj->tokens_per_s);
        cJSON_AddStringToObject(o, "message", dj->reason ? dj->reason : "");
        cJSON_AddNumberToObject(o, "created_ms", (double)dj->created_ms);
        cJSON_AddNumberToObject(o, "updated_ms", (double)dj->updated_ms);
        broker_job *j = broker_job_find(b, dj->id);
        if (j && j->kind == DB_JOB_FINETUNE) /* the fraction verified: the spec's, else the broker's default */
            cJSON_AddNumberToObject(o, "verify", broker_job_verify_fraction(b, j));
        cJSON_AddItemToObject(o, "stages", stages_json(b, j));
        cJSON_AddItemToArray(out, o);
    }
    db_job_array_free(&arr, n);
    return out;
}

static cJSON *events_json(broker_t *b, const char *job)
{
    db_event *ev = NULL;
    size_t n = 0;
    if (db_event_list(b->db, job, 0, 0, &ev, &n) != FU_OK)
        return NULL;
    cJSON *out = cJSON_CreateArray();
    for (size_t i = 0; i < n; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "id", (double)ev[i].id);
        cJSON_AddNumberToObject(o, "time_ms", (double)ev[i].time_ms);
        cJSON_AddStringToObject(o, "kind", ev[i].kind);
        cJSON_AddStringToObject(o, "peer", ev[i].peer);
        cJSON_AddStringToObject(o, "detail", ev[i].detail);
        cJSON_AddItemToArray(out, o);
    }
    db_event_array_free(&ev, n);
    return out;
}

/* The loss curve of job (broker_losshist.h): {"job","kind","stride","points":[[step,loss],...]};
 * no points for a job that has none (not a fine-tune, no step yet, or not since the broker started). */
static cJSON *loss_json(broker_t *b, const db_job *dj)
{
    cJSON *out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "job", dj->id);
    cJSON_AddStringToObject(out, "kind", db_job_kind_name(dj->kind));
    const broker_losshist *h = dj->kind == DB_JOB_FINETUNE ? broker_losses_find(b->losses, dj->id) : NULL;
    size_t n = 0;
    const broker_loss_point *pts = h ? broker_losshist_points(h, &n) : NULL;
    cJSON_AddNumberToObject(out, "stride", h ? (double)broker_losshist_stride(h) : 1);
    cJSON *arr = cJSON_AddArrayToObject(out, "points");
    for (size_t i = 0; i < n; i++) {
        cJSON *pt = cJSON_CreateArray();
        cJSON_AddItemToArray(pt, cJSON_CreateNumber((double)pts[i].step));
        cJSON_AddItemToArray(pt, cJSON_CreateNumber(pts[i].loss));
        cJSON_AddItemToArray(arr, pt);
    }
    return out;
}

/* The event archive (docs/STORE.md "Compaction"): the audit's verdict and the newest days, at most
 * DB_EVENT_LIST_MAX of them. */
static cJSON *archive_json(broker_t *b)
{
    db_audit au;
    fu_err rc = db_event_audit(b->db, &au);
    if (rc != FU_OK && rc != FU_EAUTH)
        return NULL;
    db_archive_day *d = NULL;
    size_t n = 0, total = 0;
    int64_t after = 0;
    cJSON *days = cJSON_CreateArray();
    do { /* page to the end; keep the newest DB_EVENT_LIST_MAX */
        if (db_event_archive_list(b->db, after, 0, &d, &n) != FU_OK) {
            cJSON_Delete(days);
            return NULL;
        }
        for (size_t i = 0; i < n; i++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "day", (double)d[i].day);
            cJSON_AddNumberToObject(o, "first_id", (double)d[i].first_id);
            cJSON_AddNumberToObject(o, "last_id", (double)d[i].last_id);
            cJSON_AddNumberToObject(o, "first_ms", (double)d[i].first_ms);
            cJSON_AddNumberToObject(o, "last_ms", (double)d[i].last_ms);
            cJSON_AddNumberToObject(o, "events", (double)d[i].n);
            cJSON *counts = cJSON_Parse(d[i].counts);
            cJSON_AddItemToObject(o, "counts", counts ? counts : cJSON_CreateObject());
            cJSON_AddStringToObject(o, "hash", d[i].hash);
            cJSON_AddItemToArray(days, o);
            if (++total > DB_EVENT_LIST_MAX)
                cJSON_DeleteItemFromArray(days, 0);
        }
        after = n ? d[n - 1].id : after;
        db_event_archive_free(&d, n);
    } while (n == DB_EVENT_LIST_MAX);
    cJSON *out = cJSON_CreateObject();
    cJSON_AddBoolToObject(out, "audit_ok", rc == FU_OK);
    if (rc != FU_OK) {
        cJSON_AddNumberToObject(out, "audit_bad_row", (double)au.bad_row);
        cJSON_AddStringToObject(out, "audit_why", au.why);
    }
    cJSON_AddNumberToObject(out, "archived_events", (double)au.events);
    cJSON_AddItemToObject(out, "days", days);
    return out;
}

void broker_api_get(broker_t *b, const char *path, const char *authorization, broker_api_reply *r)
{
    char key[WIRE_KEY_Z85_LEN + 1];
    uint32_t roles = 0;
    bool known = caller_of(b, authorization, key, &roles);
    if (authorization && !known) {
        reply_error(r, 401, "the bearer token is not one of an allowed client's (`fusion http-token` prints yours)");
        return;
    }
    if (strcmp(path, "/api/peers") == 0) {
        reply_json(r, 200, peers_json(b, known ? key : NULL, roles));
        return;
    }
    if (strcmp(path, "/api/archive") == 0) {
        if (!known || !(roles & WIRE_ROLE_OPERATOR)) {
            reply_error(r, 401, "the event archive is shown to operators only");
            return;
        }
        cJSON *o = archive_json(b);
        if (o)
            reply_json(r, 200, o);
        else
            reply_error(r, 500, "the broker's store failed");
        return;
    }
    if (strcmp(path, "/api/jobs") != 0 && strncmp(path, "/api/jobs/", 10) != 0) {
        reply_error(r, 404, "not found: the API serves /api/peers, /api/jobs, /api/jobs/JOB/events, "
                            "/api/jobs/JOB/loss and /api/archive");
        return;
    }
    if (!known) {
        reply_error(r, 401, "jobs are shown to their owner only: send `Authorization: Bearer TOKEN` (`fusion "
                            "http-token` prints yours)");
        return;
    }
    if (strcmp(path, "/api/jobs") == 0) {
        cJSON *o = jobs_json(b, (roles & WIRE_ROLE_OPERATOR) ? NULL : key);
        if (o)
            reply_json(r, 200, o);
        else
            reply_error(r, 500, "the broker's store failed");
        return;
    }
    char id[DB_JOB_ID_LEN + 1];
    const char *rest = path + 10;
    bool loss = false;
    if (strlen(rest) == DB_JOB_ID_LEN + strlen("/loss") && strcmp(rest + DB_JOB_ID_LEN, "/loss") == 0)
        loss = true;
    else if (strlen(rest) != DB_JOB_ID_LEN + strlen("/events") || strcmp(rest + DB_JOB_ID_LEN, "/events") != 0) {
        reply_error(r, 404, "not found: the API serves /api/jobs/JOB/events and /api/jobs/JOB/loss");
        return;
    }
    memcpy(id, rest, DB_JOB_ID_LEN);
    id[DB_JOB_ID_LEN] = '\0';
    db_job *dj = NULL;
    if (!db_job_id_valid(id) ||
        db_job_get_brief(b->db, id, (roles & WIRE_ROLE_OPERATOR) ? NULL : key, &dj) != FU_OK) {
        reply_error(r, 404, "no such job among yours");
        return;
    }
    if (loss) {
        reply_json(r, 200, loss_json(b, dj));
        db_job_free(&dj);
        return;
    }
    db_job_free(&dj);
    cJSON *o = events_json(b, id);
    if (o)
        reply_json(r, 200, o);
    else
        reply_error(r, 500, "the broker's store failed");
}
