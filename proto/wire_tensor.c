#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "wire_tensor.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "fu_clock.h"

size_t wire_dtype_size(Fusion__Dtype dtype)
{
    switch (dtype) {
    case FUSION__DTYPE__DTYPE_F32:
    case FUSION__DTYPE__DTYPE_I32:
        return 4;
    case FUSION__DTYPE__DTYPE_F16:
    case FUSION__DTYPE__DTYPE_BF16:
        return 2;
    case FUSION__DTYPE__DTYPE_I64:
        return 8;
    case FUSION__DTYPE__DTYPE_U8:
    case FUSION__DTYPE__DTYPE_I8:
        return 1;
    default:
        return 0;
    }
}

/* Bytes of a tensor of this shape and dtype; false on a bad dtype, dims, or overflow. */
static bool tensor_bytes(Fusion__Dtype dtype, uint32_t ndim, const int64_t *shape, size_t *out)
{
    size_t n = wire_dtype_size(dtype);
    if (!n || ndim > WIRE_TENSOR_MAX_DIMS)
        return false;
    for (uint32_t i = 0; i < ndim; i++) {
        if (shape[i] < 0 || !fu_size_mul(n, (size_t)shape[i], &n))
            return false;
    }
    *out = n;
    return true;
}

static void ad_from_meta(wire_seal_ad *ad, const wire_tensor_meta *m, uint64_t offset, uint64_t total,
                         uint32_t index, uint32_t count)
{
    memset(ad, 0, sizeof *ad);
    ad->job_id = m->job_id;
    ad->step = m->step;
    ad->micro_batch = m->micro_batch;
    ad->kind = (uint32_t)m->type;
    ad->offset = offset;
    ad->total = total;
    ad->chunk_index = index;
    ad->chunk_count = count;
    ad->dtype = (uint32_t)m->dtype;
    ad->ndim = m->ndim;
    memcpy(ad->shape, m->shape, sizeof(int64_t) * m->ndim);
}

static size_t varint_put(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

static void free_cb(void *data, void *hint)
{
    (void)hint;
    free(data);
}

/* TensorFrame.payload is field 8, length-delimited. */
#define PAYLOAD_TAG ((8u << 3) | 2u)

/* Cores this process may run on (sched affinity), at least 1. */
static size_t cores_available(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        return n > 0 ? (size_t)n : 1;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (size_t)n : 1;
}

/* Everything one wire_tensor_send needs to build chunk i. */
typedef struct {
    wire_seal_t *seal;
    const wire_tensor_meta *meta;
    const uint8_t *src;
    size_t len, chunk_bytes, count;
    const wire_send_wait *wait; /* NULL: block in ZeroMQ (the socket's send timeout) */
} send_plan;

/* One chunk, ready to go: [TensorFrame header][payload tag + varint][payload]. */
typedef struct {
    uint8_t *buf;  /* malloc'd; ZeroMQ's once sent */
    size_t total;  /* bytes of buf */
    uint64_t seq;  /* sealed: the sequence it was sealed under */
    fu_err rc;     /* FU_OK once built */
    bool ready;    /* built (or failed) */
} send_chunk;

/* Lays out chunk i and seals (or copies) its payload in place. Thread-safe for distinct i: the
 * sealing channel hands out sequence numbers atomically. */
static fu_err chunk_build(const send_plan *P, size_t i, send_chunk *out)
{
    size_t off = i * P->chunk_bytes;
    size_t clen = P->len - off < P->chunk_bytes ? P->len - off : P->chunk_bytes;
    size_t plen = clen + (P->seal ? WIRE_SEAL_TAG_BYTES : 0);
    const wire_tensor_meta *meta = P->meta;

    Fusion__TensorFrame tf = FUSION__TENSOR_FRAME__INIT;
    tf.dtype = meta->dtype;
    tf.n_shape = meta->ndim;
    tf.shape = (int64_t *)meta->shape;
    tf.total_bytes = P->len;
    tf.offset = off;
    tf.chunk_index = (uint32_t)i;
    tf.chunk_count = (uint32_t)P->count;
    tf.sealed = P->seal != NULL;
    size_t hlen = protobuf_c_message_get_packed_size(&tf.base);
    uint8_t vbuf[10];
    size_t vlen = varint_put(vbuf, plen);
    size_t total = hlen + 1 + vlen + plen;
    uint8_t *buf = malloc(total);
    if (!buf)
        return FU_ENOMEM;
    protobuf_c_message_pack(&tf.base, buf);
    buf[hlen] = PAYLOAD_TAG;
    memcpy(buf + hlen + 1, vbuf, vlen);
    uint8_t *payload = buf + hlen + 1 + vlen;
    uint64_t seq = 0;
    if (P->seal) {
        wire_seal_ad ad;
        ad_from_meta(&ad, meta, off, P->len, (uint32_t)i, (uint32_t)P->count);
        fu_err rc = wire_seal_encrypt(P->seal, &ad, P->src + off, clen, payload, plen, &seq);
        if (rc != FU_OK) {
            free(buf);
            return rc;
        }
    } else if (clen) {
        memcpy(payload, P->src + off, clen);
    }
    out->buf = buf;
    out->total = total;
    out->seq = seq;
    return FU_OK;
}

static fu_err chunk_send(void *sock, const uint8_t *rid, size_t rid_len, const send_plan *P, send_chunk *c)
{
    const wire_tensor_meta *meta = P->meta;
    wire_hdr h = {.type = meta->type,
                  .job_id = meta->job_id,
                  .step = meta->step,
                  .micro_batch = meta->micro_batch,
                  .sequence = c->seq,
                  .stage = meta->stage,
                  .relay_to = meta->relay_to,
                  .slot = meta->relay_to ? meta->slot : 0};
    const wire_send_wait *w = P->wait;
    if (!w) {
        uint8_t *buf = c->buf;
        c->buf = NULL; /* ZeroMQ's now, also on failure */
        return wire_send_packed(sock, rid, rid_len, &h, buf, c->total, free_cb, NULL);
    }
    /* The receiver's queue is full: instead of blocking this thread, let the caller do what must
     * not wait (heartbeats) between tries. */
    uint64_t t0 = fu_clock_ms();
    for (;;) {
        fu_err rc = wire_send_packed_try(sock, rid, rid_len, &h, c->buf, c->total, free_cb, NULL);
        if (rc != FU_EAGAIN) {
            c->buf = NULL; /* ZeroMQ's */
            return rc;
        }
        if ((w->timeout_ms && fu_clock_ms() - t0 >= w->timeout_ms) || (w->wait && !w->wait(w->arg)))
            return FU_EAGAIN; /* c->buf is freed by the caller */
        fu_sleep_ms(WIRE_SEND_RETRY_MS);
    }
}

/* Parallel sealing: workers (and the sending thread, when the next chunk is not ready yet) claim
 * chunks in index order and seal them; the sending thread hands them to ZeroMQ in index order as
 * they become ready. The sequence numbers of chunks sealed side by side may come out of index
 * order by at most the number of sealing threads, well inside the receiver's replay window. */
typedef struct {
    const send_plan *plan;
    send_chunk *chunks;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a chunk became ready */
    size_t next;       /* next chunk to claim */
    bool stop;         /* the sender gave up: claim nothing more */
} seal_pool;

/* Claims and builds one chunk; false when there is nothing left to claim. Called without mu. */
static bool seal_pool_step(seal_pool *sp)
{
    pthread_mutex_lock(&sp->mu);
    if (sp->stop || sp->next >= sp->plan->count) {
        pthread_mutex_unlock(&sp->mu);
        return false;
    }
    size_t i = sp->next++;
    pthread_mutex_unlock(&sp->mu);
    send_chunk c = {0};
    fu_err rc = chunk_build(sp->plan, i, &c);
    pthread_mutex_lock(&sp->mu);
    sp->chunks[i].buf = c.buf;
    sp->chunks[i].total = c.total;
    sp->chunks[i].seq = c.seq;
    sp->chunks[i].rc = rc;
    sp->chunks[i].ready = true;
    pthread_cond_broadcast(&sp->cv);
    pthread_mutex_unlock(&sp->mu);
    return true;
}

static void *seal_worker(void *arg)
{
    seal_pool *sp = arg;
    while (seal_pool_step(sp)) {
    }
    return NULL;
}

#define SEAL_MAX_THREADS 8u /* sealing threads per send, caller included (keeps reordering << window) */

static fu_err send_parallel(void *sock, const uint8_t *rid, size_t rid_len, const send_plan *P, size_t threads)
{
    seal_pool sp = {.plan = P, .chunks = fu_calloc(P->count, sizeof(send_chunk))};
    pthread_mutex_init(&sp.mu, NULL);
    pthread_cond_init(&sp.cv, NULL);
    pthread_t th[SEAL_MAX_THREADS];
    size_t started = 0;
    for (size_t t = 0; t + 1 < threads; t++) {
        if (pthread_create(&th[started], NULL, seal_worker, &sp) != 0)
            break; /* fewer workers; the sending thread seals what is left */
        started++;
    }
    fu_err rc = FU_OK;
    for (size_t i = 0; i < P->count && rc == FU_OK; i++) {
        pthread_mutex_lock(&sp.mu);
        while (!sp.chunks[i].ready) {
            if (sp.next < P->count) { /* help rather than wait */
                pthread_mutex_unlock(&sp.mu);
                seal_pool_step(&sp);
                pthread_mutex_lock(&sp.mu);
            } else {
                pthread_cond_wait(&sp.cv, &sp.mu);
            }
        }
        rc = sp.chunks[i].rc;
        pthread_mutex_unlock(&sp.mu);
        if (rc == FU_OK)
            rc = chunk_send(sock, rid, rid_len, P, &sp.chunks[i]);
    }
    if (rc != FU_OK) {
        pthread_mutex_lock(&sp.mu);
        sp.stop = true;
        pthread_mutex_unlock(&sp.mu);
    }
    for (size_t t = 0; t < started; t++)
        pthread_join(th[t], NULL);
    for (size_t i = 0; i < P->count; i++)
        free(sp.chunks[i].buf); /* built but never sent (after an error) */
    pthread_cond_destroy(&sp.cv);
    pthread_mutex_destroy(&sp.mu);
    free(sp.chunks);
    return rc;
}

fu_err wire_tensor_send(void *sock, const uint8_t *rid, size_t rid_len, wire_seal_t *seal,
                        const wire_tensor_meta *meta, const void *data, size_t len, size_t chunk_bytes,
                        uint64_t *plain_seq)
{
    return wire_tensor_send_waiting(sock, rid, rid_len, seal, meta, data, len, chunk_bytes, plain_seq, NULL);
}

fu_err wire_tensor_send_waiting(void *sock, const uint8_t *rid, size_t rid_len, wire_seal_t *seal,
                                const wire_tensor_meta *meta, const void *data, size_t len, size_t chunk_bytes,
                                uint64_t *plain_seq, const wire_send_wait *wait)
{
    size_t want;
    if (!sock || !meta || (len && !data) || (!seal && !plain_seq) ||
        (meta->type != FUSION__MSG_TYPE__MSG_ACTIVATION && meta->type != FUSION__MSG_TYPE__MSG_GRADIENT) ||
        !tensor_bytes(meta->dtype, meta->ndim, meta->shape, &want) || want != len)
        return FU_EINVAL;
    if (chunk_bytes == 0)
        chunk_bytes = WIRE_TENSOR_CHUNK;
    if (chunk_bytes > WIRE_MAX_MSG_BYTES - 4096)
        return FU_EINVAL;
    size_t count = len ? (len + chunk_bytes - 1) / chunk_bytes : 1;
    if (count > WIRE_TENSOR_MAX_CHUNKS)
        return FU_EINVAL;
    send_plan P = {.seal = seal, .meta = meta, .src = data, .len = len, .chunk_bytes = chunk_bytes, .count = count,
                   .wait = wait};

    size_t threads = cores_available();
    if (threads > SEAL_MAX_THREADS)
        threads = SEAL_MAX_THREADS;
    if (threads > count)
        threads = count;
    if (seal && threads >= 2)
        return send_parallel(sock, rid, rid_len, &P, threads);

    for (size_t i = 0; i < count; i++) {
        send_chunk c = {0};
        FU_TRY(chunk_build(&P, i, &c));
        if (!seal)
            c.seq = (*plain_seq)++;
        fu_err rc = chunk_send(sock, rid, rid_len, &P, &c);
        free(c.buf); /* only when it was not sent */
        FU_TRY(rc);
    }
    return FU_OK;
}

void wire_tensor_clear(wire_tensor *t)
{
    if (!t)
        return;
    free(t->data);
    memset(t, 0, sizeof *t);
}

/* One chunk whose opening was handed to the assembler's workers. */
typedef struct {
    wire_msg_t *msg;     /* owned until opened */
    wire_seal_t *seal;   /* the link's channel (thread-safe) */
    wire_seal_ad ad;     /* what it must be bound to */
    uint64_t seq;        /* its Envelope sequence */
    uint8_t *dst;        /* its place in the tensor */
    size_t clen;         /* plaintext bytes */
    uint32_t index;      /* chunk index */
} open_job;

#define ASM_QUEUE   16u /* chunks waiting for a worker at most (keeps reordering << replay window) */
#define ASM_WORKERS 8u  /* opening threads at most */

struct wire_tensor_asm {
    size_t max_bytes;       /* largest tensor accepted */
    bool active;            /* a tensor is in progress */
    bool complete;          /* ... and every chunk has arrived */
    wire_tensor cur;        /* the tensor in progress */
    uint32_t chunk_count;   /* chunks it has */
    uint32_t received;      /* chunks arrived (queued ones included) */
    uint64_t stride;        /* bytes per chunk (all but the last) */
    uint8_t *seen;          /* one bit per chunk (queued ones included) */
    uint64_t abandoned;     /* tensors dropped incomplete */
    /* Parallel opening (wire_tensor_asm_feed_msg); the workers start on first use. */
    pthread_mutex_t mu;     /* guards the fields below */
    pthread_cond_t work;    /* a job was queued, or stop */
    pthread_cond_t idle;    /* a job finished */
    open_job queue[ASM_QUEUE]; /* ring of queued jobs */
    uint32_t q_head, q_len; /* ring position and length */
    uint32_t busy;          /* jobs taken by a worker, not finished */
    uint8_t *bad;           /* one bit per chunk whose opening failed (chunk_count bits) */
    uint32_t n_bad;         /* bits set in bad */
    fu_err bad_rc;          /* the first failure's error */
    bool stop;              /* workers must exit */
    pthread_t th[ASM_WORKERS];
    size_t n_th;            /* workers started */
};

wire_tensor_asm_t *wire_tensor_asm_new(size_t max_bytes)
{
    wire_tensor_asm_t *a = fu_calloc(1, sizeof *a);
    a->max_bytes = max_bytes;
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->work, NULL);
    pthread_cond_init(&a->idle, NULL);
    return a;
}

/* Waits until no chunk is queued or being opened, then takes failed chunks back out of the tensor
 * in progress (they count as never received). Returns the first failure's error, or FU_OK. */
static fu_err asm_drain(wire_tensor_asm_t *a)
{
    if (!a->n_th)
        return FU_OK;
    pthread_mutex_lock(&a->mu);
    while (a->q_len || a->busy)
        pthread_cond_wait(&a->idle, &a->mu);
    fu_err rc = FU_OK;
    if (a->n_bad) {
        for (uint32_t i = 0; i < a->chunk_count; i++) {
            if (a->bad[i / 8] >> (i % 8) & 1) {
                a->seen[i / 8] &= (uint8_t)~(1u << (i % 8));
                a->received--;
            }
        }
        memset(a->bad, 0, (a->chunk_count + 7) / 8);
        a->n_bad = 0;
        rc = a->bad_rc;
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

static void asm_reset(wire_tensor_asm_t *a)
{
    (void)asm_drain(a); /* the tensor is going away: failures in it no longer matter */
    wire_tensor_clear(&a->cur);
    free(a->seen);
    free(a->bad);
    a->seen = a->bad = NULL;
    a->active = a->complete = false;
    a->received = a->chunk_count = 0;
}

void wire_tensor_asm_destroy(wire_tensor_asm_t **a_p)
{
    if (!a_p || !*a_p)
        return;
    wire_tensor_asm_t *a = *a_p;
    asm_reset(a);
    pthread_mutex_lock(&a->mu);
    a->stop = true;
    pthread_cond_broadcast(&a->work);
    pthread_mutex_unlock(&a->mu);
    for (size_t i = 0; i < a->n_th; i++)
        pthread_join(a->th[i], NULL);
    pthread_cond_destroy(&a->work);
    pthread_cond_destroy(&a->idle);
    pthread_mutex_destroy(&a->mu);
    free(a);
    *a_p = NULL;
}

uint64_t wire_tensor_asm_abandoned(const wire_tensor_asm_t *a)
{
    return a->abandoned;
}

/* A tensor's identity on a link is (kind, job, step, micro-batch). */
static bool same_tensor(const wire_tensor_meta *m, const wire_hdr *h)
{
    return m->type == h->type && m->job_id == h->job_id && m->step == h->step && m->micro_batch == h->micro_batch;
}

/* What a checked chunk is and where it goes. */
typedef struct {
    const wire_hdr *h;
    const Fusion__TensorFrame *tf;
    size_t total;     /* tensor bytes */
    size_t clen;      /* plaintext bytes of this chunk */
    uint64_t stride;  /* chunk stride */
    bool continuing;  /* belongs to the tensor in progress */
} chunk_info;

/* Checks one chunk against itself and the tensor in progress; changes nothing. */
static fu_err chunk_check(const wire_tensor_asm_t *a, const wire_seal_t *seal, const wire_msg_t *msg, chunk_info *ci)
{
    const wire_hdr *h = wire_msg_hdr(msg);
    if (h->type != FUSION__MSG_TYPE__MSG_ACTIVATION && h->type != FUSION__MSG_TYPE__MSG_GRADIENT)
        return FU_EPROTO;
    const Fusion__TensorFrame *tf = (const Fusion__TensorFrame *)wire_msg_body(msg);
    if (!tf)
        return FU_EPROTO;
    if ((bool)tf->sealed != (seal != NULL))
        return FU_EAUTH; /* a sealed link takes no plaintext, and the other way round */
    size_t total;
    if (tf->n_shape > WIRE_TENSOR_MAX_DIMS || !tensor_bytes(tf->dtype, (uint32_t)tf->n_shape, tf->shape, &total) ||
        total != tf->total_bytes)
        return FU_EPROTO;
    if (total > a->max_bytes)
        return FU_ENOMEM;
    if (tf->chunk_count == 0 || tf->chunk_count > WIRE_TENSOR_MAX_CHUNKS || tf->chunk_index >= tf->chunk_count)
        return FU_EPROTO;
    size_t tag = seal ? WIRE_SEAL_TAG_BYTES : 0;
    if (tf->payload.len < tag)
        return FU_EPROTO;
    size_t clen = tf->payload.len - tag;
    if (tf->offset > total || clen > total - tf->offset)
        return FU_EPROTO;
    /* Chunk geometry: chunk i covers [i*L, min((i+1)*L, total)) for one stride L, so once every index
     * has arrived every byte of the tensor has been written (the buffer need not be zeroed). */
    uint64_t stride;
    if (tf->chunk_count == 1) {
        stride = total;
    } else if (tf->chunk_index == 0) {
        stride = clen;
    } else {
        if (tf->offset % tf->chunk_index)
            return FU_EPROTO;
        stride = tf->offset / tf->chunk_index;
    }
    if (tf->offset != (uint64_t)tf->chunk_index * stride ||
        clen != (total - tf->offset < stride ? total - tf->offset : stride))
        return FU_EPROTO;
    if (tf->chunk_count > 1 &&
        (stride == 0 || (uint64_t)(tf->chunk_count - 1) * stride >= total || (uint64_t)tf->chunk_count * stride < total))
        return FU_EPROTO;

    bool continuing = a->active && !a->complete && same_tensor(&a->cur.meta, h);
    if (continuing) {
        const wire_tensor_meta *m = &a->cur.meta;
        if (m->dtype != tf->dtype || m->ndim != tf->n_shape ||
            memcmp(m->shape, tf->shape, sizeof(int64_t) * tf->n_shape) != 0 || a->cur.len != total ||
            a->chunk_count != tf->chunk_count || a->stride != stride)
            return FU_EPROTO;
        if (a->seen[tf->chunk_index / 8] >> (tf->chunk_index % 8) & 1)
            return FU_EPROTO; /* duplicate chunk (a sealed one is also caught by the replay window) */
    }
    *ci = (chunk_info){.h = h, .tf = tf, .total = total, .clen = clen, .stride = stride, .continuing = continuing};
    return FU_OK;
}

static void chunk_ad(wire_seal_ad *ad, const chunk_info *ci)
{
    wire_tensor_meta m = {.type = ci->h->type,
                          .job_id = ci->h->job_id,
                          .step = ci->h->step,
                          .micro_batch = ci->h->micro_batch,
                          .dtype = ci->tf->dtype,
                          .ndim = (uint32_t)ci->tf->n_shape};
    memcpy(m.shape, ci->tf->shape, sizeof(int64_t) * ci->tf->n_shape);
    ad_from_meta(ad, &m, ci->tf->offset, ci->total, ci->tf->chunk_index, ci->tf->chunk_count);
}

/* Records chunk ci->tf->chunk_index as received (or queued for opening). */
static void chunk_mark(wire_tensor_asm_t *a, const chunk_info *ci)
{
    uint32_t i = ci->tf->chunk_index;
    a->seen[i / 8] |= (uint8_t)(1u << (i % 8));
    a->received++;
}

/* Opens (or copies) a chunk synchronously; starts a new tensor when it does not continue the one
 * in progress (only after the chunk checked out, so a refused first chunk changes nothing). */
static fu_err feed_sync(wire_tensor_asm_t *a, wire_seal_t *seal, const chunk_info *ci)
{
    const Fusion__TensorFrame *tf = ci->tf;
    const wire_hdr *h = ci->h;
    uint8_t *buf = ci->continuing ? a->cur.data : malloc(ci->total ? ci->total : 1);
    if (!buf)
        return FU_ENOMEM;
    fu_err rc = FU_OK;
    if (seal) {
        wire_seal_ad ad;
        chunk_ad(&ad, ci);
        rc = wire_seal_decrypt(seal, &ad, h->sequence, tf->payload.data, tf->payload.len, buf + tf->offset, ci->clen);
    } else if (ci->clen) {
        memcpy(buf + tf->offset, tf->payload.data, ci->clen);
    }
    if (rc != FU_OK) {
        if (!ci->continuing)
            free(buf);
        return rc;
    }
    if (!ci->continuing) {
        if (a->active && !a->complete)
            a->abandoned++;
        asm_reset(a);
        a->active = true;
        a->cur.data = buf;
        a->cur.len = ci->total;
        a->cur.meta = (wire_tensor_meta){.type = h->type,
                                         .job_id = h->job_id,
                                         .step = h->step,
                                         .micro_batch = h->micro_batch,
                                         .stage = h->stage,
                                         .dtype = tf->dtype,
                                         .ndim = (uint32_t)tf->n_shape};
        memcpy(a->cur.meta.shape, tf->shape, sizeof(int64_t) * tf->n_shape);
        a->chunk_count = tf->chunk_count;
        a->stride = ci->stride;
        a->seen = fu_calloc((tf->chunk_count + 7) / 8, 1);
        a->bad = fu_calloc((tf->chunk_count + 7) / 8, 1);
    }
    chunk_mark(a, ci);
    return FU_OK;
}

fu_err wire_tensor_asm_feed(wire_tensor_asm_t *a, wire_seal_t *seal, const wire_msg_t *msg, bool *done)
{
    if (!a || !msg || !done)
        return FU_EINVAL;
    *done = false;
    /* Chunks still opening from wire_tensor_asm_feed_msg finish first; one that failed is counted by
     * the channel and simply missing from the tensor. */
    (void)asm_drain(a);
    chunk_info ci;
    FU_TRY(chunk_check(a, seal, msg, &ci));
    fu_err rc = feed_sync(a, seal, &ci);
    if (rc != FU_OK)
        return rc;
    if (a->received == a->chunk_count) {
        a->complete = true;
        *done = true;
    }
    return FU_OK;
}

static void *open_worker(void *arg)
{
    wire_tensor_asm_t *a = arg;
    pthread_mutex_lock(&a->mu);
    for (;;) {
        while (!a->stop && !a->q_len)
            pthread_cond_wait(&a->work, &a->mu);
        if (a->stop && !a->q_len)
            break;
        open_job j = a->queue[a->q_head];
        a->q_head = (a->q_head + 1) % ASM_QUEUE;
        a->q_len--;
        a->busy++;
        pthread_mutex_unlock(&a->mu);
        const Fusion__TensorFrame *tf = (const Fusion__TensorFrame *)wire_msg_body(j.msg);
        fu_err rc = wire_seal_decrypt(j.seal, &j.ad, j.seq, tf->payload.data, tf->payload.len, j.dst, j.clen);
        wire_msg_destroy(&j.msg);
        pthread_mutex_lock(&a->mu);
        if (rc != FU_OK) {
            if (!a->n_bad)
                a->bad_rc = rc;
            a->bad[j.index / 8] |= (uint8_t)(1u << (j.index % 8));
            a->n_bad++;
        }
        a->busy--;
        pthread_cond_broadcast(&a->idle);
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

/* Starts the opening workers once; false when this process has a single core to run on. */
static bool asm_workers_start(wire_tensor_asm_t *a)
{
    if (a->n_th)
        return true;
    size_t n = cores_available();
    if (n < 2)
        return false;
    if (n > ASM_WORKERS)
        n = ASM_WORKERS;
    for (size_t i = 0; i < n; i++) {
        if (pthread_create(&a->th[a->n_th], NULL, open_worker, a) != 0)
            break;
        a->n_th++;
    }
    return a->n_th > 0;
}

fu_err wire_tensor_asm_feed_msg(wire_tensor_asm_t *a, wire_seal_t *seal, wire_msg_t **msg_p, bool *done)
{
    if (!a || !msg_p || !*msg_p || !done) {
        if (msg_p)
            wire_msg_destroy(msg_p);
        return FU_EINVAL;
    }
    *done = false;
    wire_msg_t *msg = *msg_p;
    *msg_p = NULL;
    chunk_info ci;
    fu_err rc = chunk_check(a, seal, msg, &ci);
    if (rc != FU_OK) {
        wire_msg_destroy(&msg);
        return rc;
    }
    /* The first chunk of a tensor is opened here, so only an authentic chunk starts a tensor (and
     * abandons the one in progress); plain links and single-chunk tensors have nothing to overlap. */
    if (!seal || !ci.continuing || !asm_workers_start(a)) {
        rc = feed_sync(a, seal, &ci);
        wire_msg_destroy(&msg);
        if (rc != FU_OK)
            return rc;
    } else {
        open_job j = {.msg = msg,
                      .seal = seal,
                      .seq = ci.h->sequence,
                      .dst = a->cur.data + ci.tf->offset,
                      .clen = ci.clen,
                      .index = ci.tf->chunk_index};
        chunk_ad(&j.ad, &ci);
        chunk_mark(a, &ci); /* before the worker may free msg (ci points into it) */
        pthread_mutex_lock(&a->mu);
        while (a->q_len == ASM_QUEUE)
            pthread_cond_wait(&a->idle, &a->mu);
        a->queue[(a->q_head + a->q_len) % ASM_QUEUE] = j;
        a->q_len++;
        pthread_cond_signal(&a->work);
        pthread_mutex_unlock(&a->mu);
    }
    if (a->received == a->chunk_count) {
        rc = asm_drain(a);
        if (rc != FU_OK)
            return rc; /* the failed chunks are missing again; the tensor stays in progress */
        a->complete = true;
        *done = true;
    }
    return FU_OK;
}

fu_err wire_tensor_asm_take(wire_tensor_asm_t *a, wire_tensor *out)
{
    if (!a || !out)
        return FU_EINVAL;
    if (!a->active || !a->complete)
        return FU_EAGAIN;
    *out = a->cur;
    a->cur.data = NULL;
    asm_reset(a);
    return FU_OK;
}
