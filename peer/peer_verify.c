/* peer_verify: sketches, input hashes, sealed input chunks and their assembler for the broker's
 * verification (peer_verify.h). */
#include "peer_verify.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#include "fu_alloc.h"

/* splitmix64: the generator of the +-1 vectors (PROTOCOL.md "Verification sketch"). */
static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void peer_verify_sketch(const float *x, size_t n, uint64_t seed, double sketch[WIRE_VERIFY_SKETCH_K], double *norm)
{
    double sq = 0;
    for (size_t e = 0; e < n; e++)
        sq += (double)x[e] * (double)x[e];
    *norm = sqrt(sq);
    for (uint64_t i = 0; i < WIRE_VERIFY_SKETCH_K; i++) {
        /* vector i: its own stream, state = seed xor (i+1) * golden ratio; bit b of the k-th word
         * is the sign of element 64k + b (1: minus). */
        uint64_t state = seed ^ ((i + 1) * 0x9E3779B97F4A7C15ull);
        double acc = 0;
        for (size_t base = 0; base < n; base += 64) {
            uint64_t w = splitmix64(&state);
            size_t end = n - base < 64 ? n - base : 64;
            for (size_t b = 0; b < end; b++)
                acc += (w >> b) & 1u ? -(double)x[base + b] : (double)x[base + b];
        }
        sketch[i] = acc;
    }
}

void peer_verify_hash(const void *data, size_t n, uint8_t out[WIRE_VERIFY_HASH_BYTES])
{
    crypto_generichash(out, WIRE_VERIFY_HASH_BYTES, data, n, NULL, 0);
}

/* ---- delivered inputs (docs/PROTOCOL.md "Verification inputs") ------------------------------- */

_Static_assert(crypto_box_SEALBYTES + WIRE_VERIFY_INPUT_HEADER == WIRE_VERIFY_INPUT_OVERHEAD,
               "WIRE_VERIFY_INPUT_OVERHEAD must be the header plus crypto_box_SEALBYTES");

static const uint8_t VIN_MAGIC[8] = {'F', 'U', 'S', 'V', 'I', 'N', '0', '1'};

static void put64(uint8_t *o, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        o[i] = (uint8_t)(v >> (8 * i));
}

static void put32(uint8_t *o, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        o[i] = (uint8_t)(v >> (8 * i));
}

/* The 56-byte binding: magic, job, step, seed, offset, total (u64 LE), stage, micro-batch (u32 LE). */
static void vin_header(uint8_t h[WIRE_VERIFY_INPUT_HEADER], const peer_vin_id *id, uint64_t offset, uint64_t total)
{
    memcpy(h, VIN_MAGIC, 8);
    put64(h + 8, id->job_id);
    put64(h + 16, id->step);
    put64(h + 24, id->seed);
    put64(h + 32, offset);
    put64(h + 40, total);
    put32(h + 48, id->stage);
    put32(h + 52, id->micro_batch);
}

void peer_vin_id_to_msg(const peer_vin_id *id, Fusion__VerifyInput *vi)
{
    vi->job_id = id->job_id;
    vi->stage_index = id->stage;
    vi->step = id->step;
    vi->micro_batch = id->micro_batch;
    vi->seed = id->seed;
}

uint64_t peer_vin_chunks(uint64_t total)
{
    return total / WIRE_VERIFY_INPUT_CHUNK + (total % WIRE_VERIFY_INPUT_CHUNK != 0);
}

fu_err peer_vin_seal(const peer_vin_id *id, const uint8_t recipient[WIRE_KEY_BYTES], const uint8_t *data,
                     uint64_t total, uint64_t index, uint8_t **out, size_t *out_len)
{
    if (!id || !recipient || !data || !out || !out_len || total == 0 || index >= peer_vin_chunks(total))
        return FU_EINVAL;
    uint64_t off = index * WIRE_VERIFY_INPUT_CHUNK;
    size_t n = (size_t)(total - off < WIRE_VERIFY_INPUT_CHUNK ? total - off : WIRE_VERIFY_INPUT_CHUNK);
    uint8_t *pt = fu_malloc(WIRE_VERIFY_INPUT_HEADER + n);
    vin_header(pt, id, off, total);
    memcpy(pt + WIRE_VERIFY_INPUT_HEADER, data + off, n);
    uint8_t *ct = fu_malloc(n + WIRE_VERIFY_INPUT_OVERHEAD);
    int rc = crypto_box_seal(ct, pt, WIRE_VERIFY_INPUT_HEADER + n, recipient);
    sodium_memzero(pt, WIRE_VERIFY_INPUT_HEADER + n);
    free(pt);
    if (rc != 0) {
        free(ct);
        return FU_EINVAL;
    }
    *out = ct;
    *out_len = n + WIRE_VERIFY_INPUT_OVERHEAD;
    return FU_OK;
}

typedef struct {
    bool used;            /* an input in progress (or complete, until taken) */
    peer_vin_id id;       /* its sample */
    uint64_t total;       /* its bytes */
    uint8_t *data;        /* total bytes */
    uint8_t *have;        /* one flag per chunk */
    uint64_t n_chunks, n_have;
    uint64_t age;         /* feed counter when it started: the oldest is dropped first */
} vin_slot;

struct peer_vin_asm {
    size_t max_bytes;                 /* per input and in all */
    vin_slot slot[PEER_VIN_SLOTS];
    uint64_t counter;                 /* inputs started */
    int done;                         /* slot completed by the last feed, -1: none */
};

peer_vin_asm_t *peer_vin_asm_new(size_t max_bytes)
{
    peer_vin_asm_t *a = fu_calloc(1, sizeof *a);
    a->max_bytes = max_bytes;
    a->done = -1;
    return a;
}

static void slot_free(vin_slot *s)
{
    if (s->data)
        sodium_memzero(s->data, (size_t)s->total);
    free(s->data);
    free(s->have);
    memset(s, 0, sizeof *s);
}

void peer_vin_asm_destroy(peer_vin_asm_t **a_p)
{
    if (!a_p || !*a_p)
        return;
    for (int i = 0; i < PEER_VIN_SLOTS; i++)
        slot_free(&(*a_p)->slot[i]);
    free(*a_p);
    *a_p = NULL;
}

static bool same_id(const peer_vin_id *a, const peer_vin_id *b)
{
    return a->job_id == b->job_id && a->stage == b->stage && a->step == b->step && a->micro_batch == b->micro_batch &&
           a->seed == b->seed;
}

fu_err peer_vin_asm_feed(peer_vin_asm_t *a, const Fusion__VerifyInput *vi, const uint8_t pk[WIRE_KEY_BYTES],
                         const uint8_t sk[WIRE_KEY_BYTES], bool *done, fu_errmsg *em)
{
    if (!a || !vi || !pk || !sk || !done)
        return FU_EINVAL;
    *done = false;
    if ((vi->unavailable && vi->unavailable[0]) || vi->payload.len == 0)
        return fu_errmsg_set(em, FU_EINVAL, "a VerifyInput without a payload is not a chunk");
    uint64_t total = vi->total_bytes;
    uint64_t nch = peer_vin_chunks(total);
    if (total == 0 || vi->chunk_count != nch || vi->chunk_index >= nch ||
        vi->offset != (uint64_t)vi->chunk_index * WIRE_VERIFY_INPUT_CHUNK)
        return fu_errmsg_set(em, FU_EPROTO,
                             "chunk %u of %u at offset %" PRIu64 " does not cut %" PRIu64
                             " bytes into %u-byte chunks",
                             vi->chunk_index, vi->chunk_count, vi->offset, total, WIRE_VERIFY_INPUT_CHUNK);
    if (total > a->max_bytes)
        return fu_errmsg_set(em, FU_ENOMEM, "an input of %" PRIu64 " bytes is over this peer's %zu", total,
                             a->max_bytes);
    uint64_t n = total - vi->offset < WIRE_VERIFY_INPUT_CHUNK ? total - vi->offset : WIRE_VERIFY_INPUT_CHUNK;
    if (vi->payload.len != n + WIRE_VERIFY_INPUT_OVERHEAD)
        return fu_errmsg_set(em, FU_EPROTO, "chunk %u carries %zu sealed bytes, expected %" PRIu64,
                             vi->chunk_index, vi->payload.len, n + WIRE_VERIFY_INPUT_OVERHEAD);
    peer_vin_id id = {.job_id = vi->job_id, .stage = vi->stage_index, .step = vi->step,
                      .micro_batch = vi->micro_batch, .seed = vi->seed};
    uint8_t *pt = fu_malloc((size_t)n + WIRE_VERIFY_INPUT_HEADER);
    if (crypto_box_seal_open(pt, vi->payload.data, vi->payload.len, pk, sk) != 0) {
        free(pt);
        return fu_errmsg_set(em, FU_EAUTH, "chunk %u does not open with this peer's key", vi->chunk_index);
    }
    uint8_t want[WIRE_VERIFY_INPUT_HEADER];
    vin_header(want, &id, vi->offset, total);
    if (sodium_memcmp(pt, want, WIRE_VERIFY_INPUT_HEADER) != 0) {
        sodium_memzero(pt, (size_t)n + WIRE_VERIFY_INPUT_HEADER);
        free(pt);
        return fu_errmsg_set(em, FU_EAUTH, "chunk %u was sealed for another sample, place or size",
                             vi->chunk_index);
    }
    vin_slot *s = NULL;
    for (int i = 0; i < PEER_VIN_SLOTS && !s; i++)
        if (a->slot[i].used && same_id(&a->slot[i].id, &id) && a->slot[i].total == total && a->done != i)
            s = &a->slot[i];
    if (s && s->have[vi->chunk_index]) {
        sodium_memzero(pt, (size_t)n + WIRE_VERIFY_INPUT_HEADER);
        free(pt);
        return fu_errmsg_set(em, FU_EPROTO, "chunk %u of that input came twice", vi->chunk_index);
    }
    if (!s) {
        /* A new input: make room (the oldest first), then start it. */
        for (;;) {
            size_t held = 0;
            int oldest = -1, free_slot = -1;
            for (int i = 0; i < PEER_VIN_SLOTS; i++) {
                if (!a->slot[i].used) {
                    free_slot = free_slot < 0 ? i : free_slot;
                    continue;
                }
                held += (size_t)a->slot[i].total;
                if (oldest < 0 || a->slot[i].age < a->slot[oldest].age)
                    oldest = i;
            }
            if (free_slot >= 0 && held + total <= a->max_bytes) {
                s = &a->slot[free_slot];
                break;
            }
            if (a->done == oldest)
                a->done = -1;
            slot_free(&a->slot[oldest]);
        }
        s->used = true;
        s->id = id;
        s->total = total;
        s->data = fu_malloc((size_t)total);
        s->n_chunks = nch;
        s->have = fu_calloc((size_t)nch, 1);
        s->age = ++a->counter;
    }
    memcpy(s->data + vi->offset, pt + WIRE_VERIFY_INPUT_HEADER, (size_t)n);
    sodium_memzero(pt, (size_t)n + WIRE_VERIFY_INPUT_HEADER);
    free(pt);
    s->have[vi->chunk_index] = 1;
    if (++s->n_have == s->n_chunks) {
        a->done = (int)(s - a->slot);
        *done = true;
    }
    return FU_OK;
}

fu_err peer_vin_asm_take(peer_vin_asm_t *a, peer_vin_id *id, uint8_t **data, size_t *len)
{
    if (!a || !id || !data || !len)
        return FU_EINVAL;
    if (a->done < 0)
        return FU_EAGAIN;
    vin_slot *s = &a->slot[a->done];
    *id = s->id;
    *data = s->data;
    *len = (size_t)s->total;
    s->data = NULL;
    slot_free(s);
    a->done = -1;
    return FU_OK;
}
