#include "wire_seal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "fu_alloc.h"

struct wire_seal_eph {
    uint8_t pk[crypto_kx_PUBLICKEYBYTES]; /* public half, sent in SealHello */
    uint8_t sk[crypto_kx_SECRETKEYBYTES]; /* secret half (the struct is sodium_malloc'd) */
};

typedef struct {
    uint8_t tx[crypto_aead_xchacha20poly1305_ietf_KEYBYTES]; /* seals what this side sends */
    uint8_t rx[crypto_aead_xchacha20poly1305_ietf_KEYBYTES]; /* opens what the other side sends */
} seal_keys;

struct wire_seal {
    seal_keys *keys;          /* sodium_malloc'd, read-only after derivation */
    uint8_t my_dir;           /* 0: kx client, 1: kx server; the other side's is 1 - my_dir */
    _Atomic uint64_t next_tx; /* next sequence to seal (starts at 1) */
    pthread_mutex_t mu;       /* guards the window and counters */
    uint64_t rx_max;          /* highest sequence opened */
    uint64_t rx_bitmap;       /* bit i: rx_max - i was opened */
    bool rx_any;              /* anything opened yet */
    uint64_t auth_failed;
    uint64_t replayed;
};

wire_seal_eph_t *wire_seal_eph_new(void)
{
    wire_seal_eph_t *e = sodium_malloc(sizeof *e);
    if (!e)
        return NULL;
    crypto_kx_keypair(e->pk, e->sk);
    return e;
}

const uint8_t *wire_seal_eph_public(const wire_seal_eph_t *eph)
{
    return eph->pk;
}

void wire_seal_eph_destroy(wire_seal_eph_t **eph_p)
{
    if (!eph_p || !*eph_p)
        return;
    sodium_free(*eph_p);
    *eph_p = NULL;
}

static const char seal_context[] = "fusion/seal/v1";

/* key = BLAKE2b-256(key = lt, context || eph || client_eph_pk || server_eph_pk) */
static void combine(uint8_t out[32], const uint8_t lt[32], const uint8_t eph[32], const uint8_t *client_eph_pk,
                    const uint8_t *server_eph_pk)
{
    crypto_generichash_state st;
    crypto_generichash_init(&st, lt, 32, 32);
    crypto_generichash_update(&st, (const uint8_t *)seal_context, sizeof seal_context);
    crypto_generichash_update(&st, eph, 32);
    crypto_generichash_update(&st, client_eph_pk, crypto_kx_PUBLICKEYBYTES);
    crypto_generichash_update(&st, server_eph_pk, crypto_kx_PUBLICKEYBYTES);
    crypto_generichash_final(&st, out, 32);
    sodium_memzero(&st, sizeof st);
}

wire_seal_t *wire_seal_new(const wire_keypair_t *me, const uint8_t peer_pk[WIRE_KEY_BYTES], wire_seal_eph_t **eph_p,
                           const uint8_t peer_eph_pk[WIRE_KEY_BYTES], fu_err *err)
{
    fu_err rc = FU_EINVAL;
    wire_seal_t *s = NULL;
    wire_seal_eph_t *eph = eph_p ? *eph_p : NULL;
    if (!me || !peer_pk || !eph || !peer_eph_pk)
        goto fail;
    const uint8_t *my_pk = wire_keypair_public(me);
    int order = memcmp(my_pk, peer_pk, WIRE_KEY_BYTES);
    if (order == 0 || sodium_memcmp(eph->pk, peer_eph_pk, crypto_kx_PUBLICKEYBYTES) == 0)
        goto fail;
    bool client = order < 0;

    /* Scratch: four kx keys live in secure memory too. */
    uint8_t *tmp = sodium_malloc(4 * 32);
    if (!tmp) {
        rc = FU_ENOMEM;
        goto fail;
    }
    uint8_t *lt_rx = tmp, *lt_tx = tmp + 32, *e_rx = tmp + 64, *e_tx = tmp + 96;
    int bad;
    if (client)
        bad = crypto_kx_client_session_keys(lt_rx, lt_tx, my_pk, wire_keypair_secret(me), peer_pk) |
              crypto_kx_client_session_keys(e_rx, e_tx, eph->pk, eph->sk, peer_eph_pk);
    else
        bad = crypto_kx_server_session_keys(lt_rx, lt_tx, my_pk, wire_keypair_secret(me), peer_pk) |
              crypto_kx_server_session_keys(e_rx, e_tx, eph->pk, eph->sk, peer_eph_pk);
    if (bad) { /* a low-order public key */
        sodium_free(tmp);
        goto fail;
    }
    s = fu_calloc(1, sizeof *s);
    s->keys = sodium_malloc(sizeof *s->keys);
    if (!s->keys) {
        sodium_free(tmp);
        free(s);
        s = NULL;
        rc = FU_ENOMEM;
        goto fail;
    }
    const uint8_t *c_eph = client ? eph->pk : peer_eph_pk;
    const uint8_t *s_eph = client ? peer_eph_pk : eph->pk;
    combine(s->keys->tx, lt_tx, e_tx, c_eph, s_eph);
    combine(s->keys->rx, lt_rx, e_rx, c_eph, s_eph);
    sodium_free(tmp); /* wipes */
    sodium_mprotect_readonly(s->keys);
    s->my_dir = client ? 0 : 1;
    atomic_init(&s->next_tx, 1);
    pthread_mutex_init(&s->mu, NULL);
    wire_seal_eph_destroy(eph_p);
    if (err)
        *err = FU_OK;
    return s;
fail:
    wire_seal_eph_destroy(eph_p);
    if (err)
        *err = rc;
    return NULL;
}

void wire_seal_destroy(wire_seal_t **seal_p)
{
    if (!seal_p || !*seal_p)
        return;
    wire_seal_t *s = *seal_p;
    sodium_free(s->keys); /* wipes, even when read-only */
    pthread_mutex_destroy(&s->mu);
    free(s);
    *seal_p = NULL;
}

#define AD_BYTES (16 + 4 + 4 + 8 + 8 + 4 + 4 + 4 + 4 + 8 + 8 + 8 + 4 + 8 * WIRE_SEAL_MAX_DIMS)

static void put32(uint8_t **p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        *(*p)++ = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t **p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        *(*p)++ = (uint8_t)(v >> (8 * i));
}

/* Fixed little-endian layout of everything a frame is bound to. */
static void ad_build(uint8_t out[AD_BYTES], const wire_seal_ad *ad, uint8_t dir, uint64_t seq)
{
    uint8_t *p = out;
    memset(out, 0, AD_BYTES);
    memcpy(p, seal_context, sizeof seal_context); /* 15 bytes incl. NUL, padded to 16 */
    p += 16;
    put32(&p, dir);
    put32(&p, ad->kind);
    put64(&p, ad->job_id);
    put64(&p, ad->step);
    put32(&p, ad->micro_batch);
    put32(&p, ad->chunk_index);
    put32(&p, ad->chunk_count);
    put32(&p, ad->dtype);
    put64(&p, ad->offset);
    put64(&p, ad->total);
    put64(&p, seq);
    put32(&p, ad->ndim);
    for (uint32_t i = 0; i < WIRE_SEAL_MAX_DIMS; i++)
        put64(&p, i < ad->ndim ? (uint64_t)ad->shape[i] : 0);
}

static void nonce_build(uint8_t n[crypto_aead_xchacha20poly1305_ietf_NPUBBYTES], uint8_t dir, uint64_t seq)
{
    memset(n, 0, crypto_aead_xchacha20poly1305_ietf_NPUBBYTES);
    memcpy(n, "fsn1", 4);
    n[4] = dir;
    uint8_t *p = n + 8;
    put64(&p, seq);
}

fu_err wire_seal_encrypt(wire_seal_t *s, const wire_seal_ad *ad, const uint8_t *pt, size_t len, uint8_t *out,
                         size_t out_cap, uint64_t *seq)
{
    if (!s || !ad || (len && !pt) || !out || !seq || ad->ndim > WIRE_SEAL_MAX_DIMS)
        return FU_EINVAL;
    size_t need;
    if (!fu_size_add(len, WIRE_SEAL_TAG_BYTES, &need) || need > out_cap)
        return FU_ENOMEM;
    uint64_t q = atomic_fetch_add(&s->next_tx, 1);
    if (q == UINT64_MAX) /* never wraps: a wrapped counter would reuse nonces */
        return FU_EINVAL;
    uint8_t a[AD_BYTES], n[crypto_aead_xchacha20poly1305_ietf_NPUBBYTES];
    ad_build(a, ad, s->my_dir, q);
    nonce_build(n, s->my_dir, q);
    unsigned long long clen = 0;
    crypto_aead_xchacha20poly1305_ietf_encrypt(out, &clen, pt, len, a, sizeof a, NULL, n, s->keys->tx);
    *seq = q;
    return FU_OK;
}

/* Caller holds mu. True when seq may still be accepted. */
static bool window_ok(const wire_seal_t *s, uint64_t seq)
{
    if (!s->rx_any || seq > s->rx_max)
        return true;
    uint64_t diff = s->rx_max - seq;
    if (diff >= WIRE_SEAL_WINDOW)
        return false;
    return !(s->rx_bitmap >> diff & 1u);
}

/* Caller holds mu and checked window_ok. */
static void window_mark(wire_seal_t *s, uint64_t seq)
{
    if (!s->rx_any) {
        s->rx_any = true;
        s->rx_max = seq;
        s->rx_bitmap = 1;
    } else if (seq > s->rx_max) {
        uint64_t shift = seq - s->rx_max;
        s->rx_bitmap = shift >= 64 ? 1 : (s->rx_bitmap << shift) | 1;
        s->rx_max = seq;
    } else {
        s->rx_bitmap |= (uint64_t)1 << (s->rx_max - seq);
    }
}

fu_err wire_seal_decrypt(wire_seal_t *s, const wire_seal_ad *ad, uint64_t seq, const uint8_t *ct, size_t ct_len,
                         uint8_t *out, size_t out_cap)
{
    if (!s || !ad || !ct || !out || ad->ndim > WIRE_SEAL_MAX_DIMS)
        return FU_EINVAL;
    if (ct_len < WIRE_SEAL_TAG_BYTES || seq == 0)
        return FU_EAUTH;
    if (ct_len - WIRE_SEAL_TAG_BYTES > out_cap)
        return FU_ENOMEM;
    /* Cheap refusal before any work; checked again (atomically with marking) after opening. */
    pthread_mutex_lock(&s->mu);
    bool fresh = window_ok(s, seq);
    if (!fresh)
        s->replayed++;
    pthread_mutex_unlock(&s->mu);
    if (!fresh)
        return FU_EAUTH;
    uint8_t a[AD_BYTES], n[crypto_aead_xchacha20poly1305_ietf_NPUBBYTES];
    uint8_t peer_dir = (uint8_t)(1 - s->my_dir);
    ad_build(a, ad, peer_dir, seq);
    nonce_build(n, peer_dir, seq);
    unsigned long long mlen = 0;
    if (crypto_aead_xchacha20poly1305_ietf_decrypt(out, &mlen, NULL, ct, ct_len, a, sizeof a, n, s->keys->rx) != 0) {
        sodium_memzero(out, ct_len - WIRE_SEAL_TAG_BYTES);
        pthread_mutex_lock(&s->mu);
        s->auth_failed++;
        pthread_mutex_unlock(&s->mu);
        return FU_EAUTH;
    }
    pthread_mutex_lock(&s->mu);
    fresh = window_ok(s, seq);
    if (fresh)
        window_mark(s, seq);
    else
        s->replayed++;
    pthread_mutex_unlock(&s->mu);
    if (!fresh) {
        sodium_memzero(out, (size_t)mlen);
        return FU_EAUTH;
    }
    return FU_OK;
}

void wire_seal_counters(wire_seal_t *s, uint64_t *auth_failed, uint64_t *replayed)
{
    pthread_mutex_lock(&s->mu);
    if (auth_failed)
        *auth_failed = s->auth_failed;
    if (replayed)
        *replayed = s->replayed;
    pthread_mutex_unlock(&s->mu);
}
