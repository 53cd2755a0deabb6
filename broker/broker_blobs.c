/* broker_blobs: named blobs served in chunks with the BLAKE2b-256 of the whole blob in every chunk
 * (docs/PIPELINE.md "Weights, data and checkpoints as blobs"): model tensors straight from the
 * mmapped safetensors (never copied whole), a job's tokens, stored checkpoints, finished adapters;
 * and the assembly of a finished job's adapter from its stages' checkpoints. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_file.h"
#include "fu_log.h"
#include "fu_modelcfg.h"

#define LOG "blobs"

static void hash_str(crypto_generichash_state *h, const char *s)
{
    crypto_generichash_update(h, (const uint8_t *)s, strlen(s) + 1);
}

/* Hashes tensor i of m (on whichever thread) and publishes it. */
static void hash_tensor(broker_model *m, size_t i)
{
    if (atomic_load_explicit(&m->ready[i], memory_order_acquire))
        return;
    const fu_st_tensor *t = fu_safetensors_at(m->st, i);
    crypto_generichash(m->hashes[i], DB_HASH_LEN, t->data, t->nbytes, NULL, 0);
    atomic_store_explicit(&m->ready[i], 1, memory_order_release);
}

/* The hasher: wanted tensors first, then the rest in order, until every hash is ready. The loop
 * thread never writes hashes while this runs (it only reads ready ones), so each is written once. */
static void *hasher(void *arg)
{
    broker_model *m = arg;
    size_t next = 0;
    while (!atomic_load(&m->stop)) {
        size_t pick = m->n;
        for (size_t i = 0; i < m->n && pick == m->n; i++)
            if (atomic_load(&m->wanted[i]) && !atomic_load(&m->ready[i]))
                pick = i;
        while (pick == m->n && next < m->n)
            if (!atomic_load(&m->ready[next++]))
                pick = next - 1;
        if (pick == m->n)
            break; /* all done */
        hash_tensor(m, pick);
    }
    return NULL;
}

fu_err broker_model_open(broker_t *b, const char *dir, const char **model_id, fu_errmsg *em)
{
    for (size_t i = 0; i < b->n_models; i++)
        if (strcmp(b->models[i]->dir, dir) == 0) {
            *model_id = b->models[i]->id;
            return FU_OK;
        }
    fu_errmsg sub = {{0}};
    char *cfg_text = NULL;
    size_t cfg_len = 0;
    char *cpath = fu_path_join(dir, FU_MODELCFG_FILE);
    fu_err rc = fu_file_read_all(cpath, FU_MODELCFG_MAX_BYTES, &cfg_text, &cfg_len, &sub);
    free(cpath);
    if (rc != FU_OK) {
        fu_errmsg_set(em, rc, "model '%s': %s", dir, fu_errmsg_text(&sub, rc));
        return rc;
    }
    fu_safetensors *st = NULL;
    if ((rc = fu_safetensors_open_dir(dir, &st, &sub)) != FU_OK) {
        free(cfg_text);
        fu_errmsg_set(em, rc, "model '%s': %s", dir, fu_errmsg_text(&sub, rc));
        return rc;
    }
    /* The id covers config.json and everything the safetensors headers say (names, dtypes,
     * shapes, files, offsets): the same model directory always gets the same id. */
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, DB_HASH_LEN);
    crypto_generichash_update(&h, (const uint8_t *)cfg_text, cfg_len);
    free(cfg_text);
    size_t n = fu_safetensors_count(st);
    for (size_t i = 0; i < n; i++) {
        const fu_st_tensor *t = fu_safetensors_at(st, i);
        char line[256];
        snprintf(line, sizeof line, "%s %zu %" PRIu64 " %zu", fu_st_dtype_name(t->dtype), t->ndim, t->offset,
                 t->nbytes);
        hash_str(&h, t->name);
        hash_str(&h, line);
        hash_str(&h, t->file ? t->file : "");
        for (size_t d = 0; d < t->ndim; d++) {
            snprintf(line, sizeof line, "%" PRIu64, t->shape[d]);
            hash_str(&h, line);
        }
    }
    uint8_t digest[DB_HASH_LEN];
    crypto_generichash_final(&h, digest, sizeof digest);
    if (b->n_models == b->cap_models) {
        b->cap_models = b->cap_models ? 2 * b->cap_models : 4;
        b->models = fu_realloc(b->models, b->cap_models * sizeof *b->models);
    }
    broker_model *m = fu_calloc(1, sizeof *m);
    b->models[b->n_models++] = m;
    memcpy(m->id, "m:", 2);
    fu_hex_encode(m->id + 2, digest, sizeof digest);
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    m->st = st;
    m->n = n;
    m->hashes = fu_calloc(n ? n : 1, sizeof *m->hashes);
    m->ready = fu_calloc(n ? n : 1, sizeof *m->ready);
    m->wanted = fu_calloc(n ? n : 1, sizeof *m->wanted);
    atomic_store(&m->stop, 0);
    if (pthread_create(&m->thread, NULL, hasher, m) == 0)
        m->thread_started = true;
    else
        FU_WARN(LOG, "no hasher thread for %s: tensors are hashed on the loop when first asked for", dir);
    FU_INFO(LOG, "serving model %s as %.18s... (%zu tensors, mapped)", dir, m->id, n);
    *model_id = m->id;
    return FU_OK;
}

void broker_models_close(broker_t *b)
{
    for (size_t i = 0; i < b->n_models; i++) {
        broker_model *m = b->models[i];
        atomic_store(&m->stop, 1);
        if (m->thread_started)
            pthread_join(m->thread, NULL);
        fu_safetensors_close(&m->st);
        free(m->hashes);
        free((void *)m->ready);
        free((void *)m->wanted);
        free(m);
    }
    free(b->models);
    b->models = NULL;
    b->n_models = b->cap_models = 0;
    free(b->pending);
    b->pending = NULL;
    b->n_pending = b->cap_pending = 0;
}

static Fusion__Dtype wire_dtype(fu_st_dtype d)
{
    switch (d) {
    case FU_ST_F32: return FUSION__DTYPE__DTYPE_F32;
    case FU_ST_F16: return FUSION__DTYPE__DTYPE_F16;
    case FU_ST_BF16: return FUSION__DTYPE__DTYPE_BF16;
    case FU_ST_I32: return FUSION__DTYPE__DTYPE_I32;
    case FU_ST_I64: return FUSION__DTYPE__DTYPE_I64;
    case FU_ST_U8: return FUSION__DTYPE__DTYPE_U8;
    default: return FUSION__DTYPE__DTYPE_UNSPECIFIED;
    }
}

/* Sends data[offset .. offset+length) (length 0: to the end; at most BROKER_BLOB_WINDOW) as chunks. */
static void send_chunks_to(broker_t *b, const uint8_t *rid, size_t rid_len, uint64_t sequence,
                           const Fusion__WeightRequest *r, const uint8_t *data, uint64_t total,
                           const uint8_t hash[DB_HASH_LEN], Fusion__Dtype dtype, const int64_t *shape, size_t ndim)
{
    uint64_t want = r->length ? r->length : total - r->offset;
    if (want > total - r->offset)
        want = total - r->offset;
    if (want > BROKER_BLOB_WINDOW)
        want = BROKER_BLOB_WINDOW;
    uint64_t pos = r->offset, end = r->offset + want;
    do {
        uint64_t n = end - pos > BROKER_BLOB_CHUNK ? BROKER_BLOB_CHUNK : end - pos;
        Fusion__WeightChunk c = FUSION__WEIGHT_CHUNK__INIT;
        c.model_id = r->model_id;
        c.tensor_name = r->tensor_name;
        c.offset = pos;
        c.total = total;
        c.content_hash.data = (uint8_t *)hash;
        c.content_hash.len = DB_HASH_LEN;
        c.data.data = (uint8_t *)data + pos;
        c.data.len = (size_t)n;
        c.dtype = dtype;
        c.n_shape = ndim;
        c.shape = (int64_t *)shape;
        wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK, .sequence = sequence};
        fu_err rc = wire_send(b->sock, rid, rid_len, &h, &c.base);
        if (rc != FU_OK) { /* the peer asks again after its resend timeout */
            FU_DEBUG(LOG, "chunk of %s at %" PRIu64 " not sent: %s", r->tensor_name, pos, fu_strerror(rc));
            return;
        }
        pos += n;
    } while (pos < end);
}

static bool range_ok(broker_t *b, const wire_msg_t *msg, const Fusion__WeightRequest *r, uint64_t total)
{
    if (r->offset > total || (r->offset == total && total > 0)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "%s/%s: offset %" PRIu64 " is at or past the blob's %" PRIu64 " bytes", r->model_id,
                           r->tensor_name, r->offset, total);
        return false;
    }
    return true;
}

static void send_chunks(broker_t *b, const wire_msg_t *msg, const Fusion__WeightRequest *r, const uint8_t *data,
                        uint64_t total, const uint8_t hash[DB_HASH_LEN], Fusion__Dtype dtype, const int64_t *shape,
                        size_t ndim)
{
    if (!range_ok(b, msg, r, total))
        return;
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(msg, &rl);
    send_chunks_to(b, rid, rl, wire_msg_hdr(msg)->sequence, r, data, total, hash, dtype, shape, ndim);
}

static void send_tensor(broker_t *b, const uint8_t *rid, size_t rid_len, uint64_t sequence, broker_model *m, size_t idx,
                        const Fusion__WeightRequest *r)
{
    const fu_st_tensor *t = fu_safetensors_at(m->st, idx);
    int64_t shape[FU_ST_MAX_DIMS];
    for (size_t d = 0; d < t->ndim; d++)
        shape[d] = (int64_t)t->shape[d];
    send_chunks_to(b, rid, rid_len, sequence, r, t->data, t->nbytes, m->hashes[idx], wire_dtype(t->dtype), shape,
                   t->ndim);
}

bool broker_blobs_pending(broker_t *b)
{
    size_t w = 0;
    for (size_t i = 0; i < b->n_pending; i++) {
        broker_pending *q = &b->pending[i];
        if (!atomic_load_explicit(&q->model->ready[q->tensor], memory_order_acquire)) {
            b->pending[w++] = *q;
            continue;
        }
        broker_peer *p = broker_peer_find(b, q->peer);
        if (p && p->live) {
            const fu_st_tensor *t = fu_safetensors_at(q->model->st, q->tensor);
            Fusion__WeightRequest r = FUSION__WEIGHT_REQUEST__INIT;
            r.model_id = q->model->id;
            r.tensor_name = (char *)t->name;
            r.offset = q->offset;
            r.length = q->length;
            send_tensor(b, p->rid, p->rid_len, q->sequence, q->model, q->tensor, &r);
        }
    }
    b->n_pending = w;
    return w > 0;
}

static bool peer_serves_model(broker_t *b, const broker_peer *p, const char *model_id)
{
    broker_job *j = p->job[0] ? broker_job_find(b, p->job) : NULL;
    return j && strcmp(j->model_id, model_id) == 0;
}

void broker_on_weight_request(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__WeightRequest *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST);
    if (!r)
        return;
    const char *mid = r->model_id, *name = r->tensor_name;
    if (strncmp(mid, "m:", 2) == 0) {
        broker_model *m = NULL;
        for (size_t i = 0; i < b->n_models; i++)
            if (strcmp(b->models[i]->id, mid) == 0)
                m = b->models[i];
        if (!m || !peer_serves_model(b, p, mid)) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                               "model %.20s... is not served to you: ask only for the model_id of a stage you were "
                               "assigned", mid);
            return;
        }
        const fu_st_tensor *t = fu_safetensors_get(m->st, name);
        if (!t) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND, "model %s has no tensor '%s'", m->dir, name);
            return;
        }
        if (!range_ok(b, msg, r, t->nbytes))
            return;
        size_t idx = 0;
        for (size_t i = 0; i < m->n; i++)
            if (fu_safetensors_at(m->st, i) == t)
                idx = i;
        if (!m->thread_started)
            hash_tensor(m, idx);
        size_t rl = 0;
        const uint8_t *rid = wire_msg_routing_id(msg, &rl);
        if (atomic_load_explicit(&m->ready[idx], memory_order_acquire)) {
            send_tensor(b, rid, rl, wire_msg_hdr(msg)->sequence, m, idx, r);
            return;
        }
        /* its hash is being computed: answer when it is ready (the loop does not stall on it) */
        atomic_store(&m->wanted[idx], 1);
        if (b->n_pending == b->cap_pending) {
            b->cap_pending = b->cap_pending ? 2 * b->cap_pending : 16;
            b->pending = fu_realloc(b->pending, b->cap_pending * sizeof *b->pending);
        }
        broker_pending *q = &b->pending[b->n_pending++];
        snprintf(q->peer, sizeof q->peer, "%s", p->key);
        q->model = m;
        q->tensor = idx;
        q->offset = r->offset;
        q->length = r->length;
        q->sequence = wire_msg_hdr(msg)->sequence;
        return;
    }
    if (strncmp(mid, "job:", 4) != 0 || !db_job_id_valid(mid + 4)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "unknown blob name '%s' (model ids are m:<hex> or job:<job hex>)", mid);
        return;
    }
    const char *jid = mid + 4;
    broker_job *mine = p->job[0] ? broker_job_find(b, p->job) : NULL;
    if (strcmp(name, "adapter") == 0) {
        if (!mine || mine->kind != DB_JOB_INFER || strcmp(mine->spec.adapter_job, jid) != 0) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                               "adapter of job %s is served only to the stages of an inference job that uses it", jid);
            return;
        }
        db_job *dj = NULL;
        if (db_job_get(b->db, jid, NULL, &dj) != FU_OK || dj->state != DB_JOB_DONE || !dj->result) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND, "job %s has no finished adapter", jid);
            db_job_free(&dj);
            return;
        }
        uint8_t hash[DB_HASH_LEN];
        crypto_generichash(hash, sizeof hash, dj->result, dj->result_len, NULL, 0);
        int64_t shape[1] = {(int64_t)dj->result_len};
        send_chunks(b, msg, r, dj->result, dj->result_len, hash, FUSION__DTYPE__DTYPE_U8, shape, 1);
        db_job_free(&dj);
        return;
    }
    if (!mine || strcmp(mine->id, jid) != 0) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "blobs of job %s are served only to its stages and backups", jid);
        return;
    }
    if (strcmp(name, "tokens") == 0) {
        /* fine-tune: the tokenized data; inference: the prompt followed by the tokens generated so far */
        size_t n = mine->n_tokens + mine->n_gen;
        if (mine->n_gen == 0) { /* the stored tokens as they are, hashed once at load */
            int64_t shape[1] = {(int64_t)n};
            send_chunks(b, msg, r, (const uint8_t *)mine->tokens, n * sizeof *mine->tokens, mine->tokens_hash,
                        FUSION__DTYPE__DTYPE_I32, shape, 1);
            return;
        }
        int32_t *all = fu_malloc((n ? n : 1) * sizeof *all);
        memcpy(all, mine->tokens, mine->n_tokens * sizeof *all);
        if (mine->n_gen)
            memcpy(all + mine->n_tokens, mine->gen, mine->n_gen * sizeof *all);
        uint8_t hash[DB_HASH_LEN];
        crypto_generichash(hash, sizeof hash, (const uint8_t *)all, n * sizeof *all, NULL, 0);
        int64_t shape[1] = {(int64_t)n};
        send_chunks(b, msg, r, (const uint8_t *)all, n * sizeof *all, hash, FUSION__DTYPE__DTYPE_I32, shape, 1);
        free(all);
        return;
    }
    unsigned stage = 0;
    long long step = 0;
    char tail = 0;
    if (sscanf(name, "ckpt:%u:%lld%c", &stage, &step, &tail) == 2 && step >= 0) {
        db_ckpt *ck = NULL;
        fu_err rc = db_ckpt_get(b->db, jid, stage, step, &ck);
        if (rc != FU_OK) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND, "job %s has no checkpoint of stage %u at step "
                               "%lld (%s)", jid, stage, step, fu_strerror(rc));
            return;
        }
        uint8_t hash[DB_HASH_LEN];
        if (fu_hex_decode(hash, sizeof hash, ck->hash) != FU_OK)
            crypto_generichash(hash, sizeof hash, ck->data, ck->len, NULL, 0);
        int64_t shape[1] = {(int64_t)ck->len};
        send_chunks(b, msg, r, ck->data, ck->len, hash, FUSION__DTYPE__DTYPE_U8, shape, 1);
        db_ckpt_free(&ck);
        return;
    }
    broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                       "unknown blob '%s' of job %s (tokens, ckpt:<stage>:<step> or adapter)", name, jid);
}

static bool is_adapter_weight(const char *name)
{
    size_t n = strlen(name);
    static const char *const suffix[] = {".lora_A.weight", ".lora_B.weight"};
    for (size_t i = 0; i < 2; i++) {
        size_t k = strlen(suffix[i]);
        if (n > k && strcmp(name + n - k, suffix[i]) == 0)
            return true;
    }
    return false;
}

fu_err broker_adapter_assemble(broker_t *b, broker_job *j, int64_t step, uint8_t **out, size_t *len, fu_errmsg *em)
{
    db_ckpt *ck[BROKER_MAX_STAGES] = {0};
    fu_safetensors *st[BROKER_MAX_STAGES] = {0};
    fu_st_tensor *list = NULL;
    size_t n = 0, cap_list = 0;
    fu_err rc = FU_OK;
    char *path = NULL;
    fu_errmsg sub = {{0}};
    for (uint32_t s = 0; s < j->n_stages && rc == FU_OK; s++) {
        if ((rc = db_ckpt_get(b->db, j->id, s, step, &ck[s])) != FU_OK) {
            fu_errmsg_set(em, rc, "stage %u has no checkpoint at step %" PRId64, s, step);
            break;
        }
        if ((rc = fu_safetensors_parse_header(ck[s]->data, ck[s]->len, "checkpoint", &st[s], &sub)) != FU_OK) {
            fu_errmsg_set(em, rc, "checkpoint of stage %u: %s", s, fu_errmsg_text(&sub, rc));
            break;
        }
        for (size_t i = 0; i < fu_safetensors_count(st[s]); i++) {
            const fu_st_tensor *t = fu_safetensors_at(st[s], i);
            if (!is_adapter_weight(t->name))
                continue;
            if (n == cap_list) {
                cap_list = cap_list ? 2 * cap_list : 64;
                list = fu_realloc(list, cap_list * sizeof *list);
            }
            list[n++] = *t;
        }
    }
    if (rc == FU_OK && n == 0) {
        rc = fu_errmsg_set(em, FU_EPROTO,
                           "the stages' checkpoints hold no adapter tensors (*.lora_A.weight / *.lora_B.weight)");
    }
    if (rc == FU_OK) {
        char name[64];
        snprintf(name, sizeof name, "adapter-%s-%d.safetensors", j->id, (int)getpid());
        path = fu_path_join(b->data_dir, name);
        if ((rc = fu_safetensors_write(path, list, n, NULL, 0, NULL, NULL, &sub)) != FU_OK)
            fu_errmsg_set(em, rc, "%s", fu_errmsg_text(&sub, rc));
    }
    if (rc == FU_OK) {
        char *data = NULL;
        if ((rc = fu_file_read_all(path, DB_BLOB_MAX, &data, len, &sub)) != FU_OK)
            fu_errmsg_set(em, rc, "%s", fu_errmsg_text(&sub, rc));
        *out = (uint8_t *)data;
    }
    if (path)
        unlink(path);
    free(path);
    free(list);
    for (uint32_t s = 0; s < BROKER_MAX_STAGES; s++) {
        fu_safetensors_close(&st[s]);
        db_ckpt_free(&ck[s]);
    }
    return rc;
}
