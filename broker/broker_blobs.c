/* broker_blobs: named blobs served in chunks with the BLAKE2b-256 of the whole blob in every chunk
 * (docs/PIPELINE.md "Weights, data and checkpoints as blobs"): model tensors straight from the
 * mmapped safetensors (never copied whole), a job's tokens, stored checkpoints, finished adapters. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#include "broker_internal.h"
#include "dag_peft.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_file.h"
#include "fu_log.h"
#include "fu_modelcfg.h"

#define LOG "blobs"

static Fusion__Dtype wire_dtype(fu_st_dtype d)
{
    switch (d) {
    case FU_ST_F32: return FUSION__DTYPE__DTYPE_F32;
    case FU_ST_F16: return FUSION__DTYPE__DTYPE_F16;
    case FU_ST_BF16: return FUSION__DTYPE__DTYPE_BF16;
    case FU_ST_I32: return FUSION__DTYPE__DTYPE_I32;
    case FU_ST_I64: return FUSION__DTYPE__DTYPE_I64;
    case FU_ST_U8: return FUSION__DTYPE__DTYPE_U8;
    case FU_ST_I8: return FUSION__DTYPE__DTYPE_I8;
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
        fu_err rc = wire_send(broker_sock_for(b, rid, rid_len), rid, rid_len, &h, &c.base);
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
        broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_INVALID,
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

/* Sends (part of) tensor idx of m with its hash, then lets the kernel drop the pages it touched. */
static void send_tensor(broker_t *b, const wire_msg_t *msg, const broker_model *m, size_t idx,
                        const Fusion__WeightRequest *r)
{
    const fu_st_tensor *t = fu_safetensors_at(m->st, idx);
    int64_t shape[FU_ST_MAX_DIMS];
    for (size_t d = 0; d < t->ndim; d++)
        shape[d] = (int64_t)t->shape[d];
    send_chunks(b, msg, r, t->data, t->nbytes, m->hashes[idx], wire_dtype(t->dtype), shape, t->ndim);
    if (r->offset < t->nbytes)
        broker_model_drop_pages((const uint8_t *)t->data + r->offset, (size_t)(t->nbytes - r->offset));
}

void broker_on_weight_request(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__WeightRequest *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST);
    if (!r)
        return;
    const char *mid = r->model_id, *name = r->tensor_name;
    broker_job *mine = p->job[0] ? broker_job_find(b, p->job) : NULL;
    if (strncmp(mid, "m:", 2) == 0) {
        /* the model of the job this peer works on, and no other (the job holds it mapped) */
        if (!mine || strcmp(mine->model->id, mid) != 0) {
            broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                               "model %.20s... is not served to you: ask only for the model_id of a stage you were "
                               "assigned", mid);
            return;
        }
        long idx = fu_safetensors_index(mine->model->st, name);
        if (idx < 0) {
            broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND, "model %.20s... has no tensor '%s'", mid,
                               name);
            return;
        }
        send_tensor(b, msg, mine->model, (size_t)idx, r);
        return;
    }
    if (strncmp(mid, "job:", 4) != 0 || !db_job_id_valid(mid + 4)) {
        broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "unknown blob name '%s' (model ids are m:<hex> or job:<job hex>)", mid);
        return;
    }
    const char *jid = mid + 4;
    if (strcmp(name, "adapter") == 0) {
        if (!mine || (mine->kind != DB_JOB_INFER && mine->kind != DB_JOB_EVAL) ||
            strcmp(mine->spec.adapter_job, jid) != 0) {
            broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                               "adapter of job %s is served only to the stages of an inference or eval job that uses it",
                               jid);
            return;
        }
        db_job *dj = NULL;
        if (db_job_get(b->db, jid, NULL, &dj) != FU_OK || dj->state != DB_JOB_DONE || !dj->result) {
            /* the job was admitted with this adapter and its stage told to load it: the broker's fault */
            snprintf(p->lacked, sizeof p->lacked, "%s", mine->id);
            broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND, "job %s has no finished adapter", jid);
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
        broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND,
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
            /* The checkpoint its StageAssign names (its stage at the run's start step; peer_stage.c) is the
             * broker's to keep: when it is missing (pruned, lost) or the store fails, the stage's load
             * failure that follows is the broker's fault, and costs the peer nothing. */
            if (!p->backup && stage == p->stage && (uint64_t)step == mine->start_step && mine->start_step > 0)
                snprintf(p->lacked, sizeof p->lacked, "%s", mine->id);
            broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                               "job %s has no checkpoint of stage %u at step %lld (%s)", jid, stage, step,
                               fu_strerror(rc));
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
    if (sscanf(name, "vsnap:%u:%lld%c", &stage, &step, &tail) == 2 && step >= 0) {
        const broker_snap *sn = broker_verify_snapshot(b, mine->id64, stage, (uint64_t)step);
        if (!sn) {
            broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                               "job %s has no verification snapshot of stage %u at step %lld", jid, stage, step);
            return;
        }
        int64_t shape[1] = {(int64_t)sn->total};
        send_chunks(b, msg, r, sn->buf, (size_t)sn->total, sn->hash, FUSION__DTYPE__DTYPE_U8, shape, 1);
        return;
    }
    broker_refuse_blob(b, msg, r, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                       "unknown blob '%s' of job %s (tokens, ckpt:<stage>:<step>, vsnap:<stage>:<step> or adapter)",
                       name, jid);
}
