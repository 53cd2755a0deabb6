#include "wire_tensor.h"

#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "fu_alloc.h"

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

fu_err wire_tensor_send(void *sock, const uint8_t *rid, size_t rid_len, wire_seal_t *seal,
                        const wire_tensor_meta *meta, const void *data, size_t len, size_t chunk_bytes,
                        uint64_t *plain_seq)
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
    const uint8_t *src = data;

    for (size_t i = 0; i < count; i++) {
        size_t off = i * chunk_bytes;
        size_t clen = len - off < chunk_bytes ? len - off : chunk_bytes;
        size_t plen = clen + (seal ? WIRE_SEAL_TAG_BYTES : 0);

        Fusion__TensorFrame tf = FUSION__TENSOR_FRAME__INIT;
        tf.dtype = meta->dtype;
        tf.n_shape = meta->ndim;
        tf.shape = (int64_t *)meta->shape;
        tf.total_bytes = len;
        tf.offset = off;
        tf.chunk_index = (uint32_t)i;
        tf.chunk_count = (uint32_t)count;
        tf.sealed = seal != NULL;
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

        uint64_t seq;
        if (seal) {
            wire_seal_ad ad;
            ad_from_meta(&ad, meta, off, len, (uint32_t)i, (uint32_t)count);
            fu_err rc = wire_seal_encrypt(seal, &ad, src + off, clen, payload, plen, &seq);
            if (rc != FU_OK) {
                free(buf);
                return rc;
            }
        } else {
            if (clen)
                memcpy(payload, src + off, clen);
            seq = (*plain_seq)++;
        }
        wire_hdr h = {.type = meta->type,
                      .job_id = meta->job_id,
                      .step = meta->step,
                      .micro_batch = meta->micro_batch,
                      .sequence = seq,
                      .stage = meta->stage,
                      .relay_to = meta->relay_to};
        FU_TRY(wire_send_packed(sock, rid, rid_len, &h, buf, total, free_cb, NULL)); /* buf is ZeroMQ's now */
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

struct wire_tensor_asm {
    size_t max_bytes;       /* largest tensor accepted */
    bool active;            /* a tensor is in progress */
    bool complete;          /* ... and every chunk has arrived */
    wire_tensor cur;        /* the tensor in progress */
    uint32_t chunk_count;   /* chunks it has */
    uint32_t received;      /* chunks arrived */
    uint64_t stride;        /* bytes per chunk (all but the last) */
    uint8_t *seen;          /* one bit per chunk */
    uint64_t abandoned;     /* tensors dropped incomplete */
};

wire_tensor_asm_t *wire_tensor_asm_new(size_t max_bytes)
{
    wire_tensor_asm_t *a = fu_calloc(1, sizeof *a);
    a->max_bytes = max_bytes;
    return a;
}

static void asm_reset(wire_tensor_asm_t *a)
{
    wire_tensor_clear(&a->cur);
    free(a->seen);
    a->seen = NULL;
    a->active = a->complete = false;
    a->received = a->chunk_count = 0;
}

void wire_tensor_asm_destroy(wire_tensor_asm_t **a_p)
{
    if (!a_p || !*a_p)
        return;
    asm_reset(*a_p);
    free(*a_p);
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

fu_err wire_tensor_asm_feed(wire_tensor_asm_t *a, wire_seal_t *seal, const wire_msg_t *msg, bool *done)
{
    if (!a || !msg || !done)
        return FU_EINVAL;
    *done = false;
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

    /* Open (or copy) the chunk into a scratch position first when starting, so a refused first
     * chunk leaves the assembler as it was. */
    uint8_t *buf = continuing ? a->cur.data : malloc(total ? total : 1);
    if (!buf)
        return FU_ENOMEM;
    fu_err rc = FU_OK;
    if (seal) {
        wire_seal_ad ad;
        wire_tensor_meta m = {.type = h->type,
                              .job_id = h->job_id,
                              .step = h->step,
                              .micro_batch = h->micro_batch,
                              .dtype = tf->dtype,
                              .ndim = (uint32_t)tf->n_shape};
        memcpy(m.shape, tf->shape, sizeof(int64_t) * tf->n_shape);
        ad_from_meta(&ad, &m, tf->offset, total, tf->chunk_index, tf->chunk_count);
        rc = wire_seal_decrypt(seal, &ad, h->sequence, tf->payload.data, tf->payload.len, buf + tf->offset, clen);
    } else if (clen) {
        memcpy(buf + tf->offset, tf->payload.data, clen);
    }
    if (rc != FU_OK) {
        if (!continuing)
            free(buf);
        return rc;
    }
    if (!continuing) {
        if (a->active && !a->complete)
            a->abandoned++;
        asm_reset(a);
        a->active = true;
        a->cur.data = buf;
        a->cur.len = total;
        a->cur.meta = (wire_tensor_meta){.type = h->type,
                                         .job_id = h->job_id,
                                         .step = h->step,
                                         .micro_batch = h->micro_batch,
                                         .stage = h->stage,
                                         .dtype = tf->dtype,
                                         .ndim = (uint32_t)tf->n_shape};
        memcpy(a->cur.meta.shape, tf->shape, sizeof(int64_t) * tf->n_shape);
        a->chunk_count = tf->chunk_count;
        a->stride = stride;
        a->seen = fu_calloc((tf->chunk_count + 7) / 8, 1);
    }
    a->seen[tf->chunk_index / 8] |= (uint8_t)(1u << (tf->chunk_index % 8));
    a->received++;
    if (a->received == a->chunk_count) {
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
