/* peer_blob: fetch, verify and cache one blob (see peer_blob.h). */
#include "peer_blob.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_log.h"
#include "peer_cache.h"

typedef enum {
    B_PROBE,     /* cached fetch: ask one byte to learn the hash */
    B_PROBE_OUT, /* probe asked, waiting */
    B_WINDOW,    /* a window is due to be asked for */
    B_WINDOW_OUT,/* a window asked, waiting for its chunks */
    B_DONE,
} bstate;

struct peer_blob {
    char *model_id;          /* request's model_id */
    char *name;              /* request's tensor_name */
    char *cache_dir;         /* NULL: not cached */
    uint64_t cache_max;      /* cache size limit after a write (0: none) */
    uint64_t max_bytes;      /* budget */
    bstate st;               /* where the fetch is */
    bool known;              /* total/hash/dtype/shape learnt from a chunk */
    uint64_t total;          /* blob bytes */
    uint8_t hash[PEER_BLOB_HASH_BYTES]; /* what every chunk says */
    Fusion__Dtype dtype;     /* chunk's dtype */
    size_t ndim;             /* chunk's shape */
    int64_t shape[PEER_BLOB_MAX_DIMS];
    uint8_t *data;           /* total bytes once known */
    uint64_t next;           /* next byte expected (chunks are taken in order) */
    uint64_t win_end;        /* end of the window asked for */
    uint64_t window;         /* bytes asked for at once (peer_blob_set_window) */
    uint64_t asked_ms;       /* when the current request went out (or the last chunk came) */
    uint32_t attempts;       /* full fetches that failed their hash */
    uint32_t bad_cache;      /* cache files refused */
    bool cache_hit;          /* served from the cache */
};

void peer_blob_hash(uint8_t out[PEER_BLOB_HASH_BYTES], const void *data, size_t len)
{
    crypto_generichash(out, PEER_BLOB_HASH_BYTES, data, len, NULL, 0);
}

peer_blob_t *peer_blob_new(const char *model_id, const char *name, const char *cache_dir, uint64_t max_bytes)
{
    if (!model_id || !name)
        return NULL;
    peer_blob_t *b = fu_calloc(1, sizeof *b);
    b->window = PEER_BLOB_WINDOW;
    b->model_id = fu_strdup(model_id);
    b->name = fu_strdup(name);
    b->cache_dir = cache_dir && *cache_dir ? fu_strdup(cache_dir) : NULL;
    b->max_bytes = max_bytes;
    b->st = b->cache_dir ? B_PROBE : B_WINDOW;
    return b;
}

void peer_blob_set_cache_max(peer_blob_t *b, uint64_t max_bytes)
{
    if (b)
        b->cache_max = max_bytes;
}

void peer_blob_destroy(peer_blob_t **b_p)
{
    if (!b_p || !*b_p)
        return;
    peer_blob_t *b = *b_p;
    free(b->model_id);
    free(b->name);
    free(b->cache_dir);
    free(b->data);
    free(b);
    *b_p = NULL;
}

static char *cache_path(const peer_blob_t *b)
{
    char hex[2 * PEER_BLOB_HASH_BYTES + 1];
    fu_hex_encode(hex, b->hash, PEER_BLOB_HASH_BYTES);
    return fu_path_join(b->cache_dir, hex);
}

/* Serves the blob from the cache when a file with its hash holds bytes that hash to it. */
static bool try_cache(peer_blob_t *b)
{
    char *path = cache_path(b);
    if (!fu_path_exists(path)) {
        free(path);
        return false;
    }
    char *d = NULL;
    size_t len = 0;
    fu_errmsg em = {{0}};
    bool ok = false;
    if (fu_file_read_all(path, (size_t)b->max_bytes, &d, &len, &em) == FU_OK) {
        uint8_t h[PEER_BLOB_HASH_BYTES];
        peer_blob_hash(h, d, len);
        ok = len == b->total && sodium_memcmp(h, b->hash, sizeof h) == 0;
    }
    if (ok) {
        free(b->data);
        b->data = (uint8_t *)d;
        b->st = B_DONE;
        b->cache_hit = true;
        FU_DEBUG("peer", "blob %s/%s: from the cache", b->model_id, b->name);
        if (peer_cache_touch(path, &em) != FU_OK)
            FU_WARN("peer", "%s (it may be evicted before others)", em.msg);
    } else {
        free(d);
        b->bad_cache++;
        FU_WARN("peer", "cache file %s does not hold the blob %s/%s it is named for: refused, fetching again", path,
                b->model_id, b->name);
        if (unlink(path) != 0)
            FU_WARN("peer", "cannot remove the bad cache file %s", path);
    }
    free(path);
    return ok;
}

uint64_t peer_blob_window_for(uint64_t link_bytes_per_s)
{
    if (!link_bytes_per_s || link_bytes_per_s >= PEER_BLOB_WINDOW)
        return PEER_BLOB_WINDOW;
    return link_bytes_per_s > PEER_BLOB_WINDOW_MIN ? link_bytes_per_s : PEER_BLOB_WINDOW_MIN;
}

void peer_blob_set_window(peer_blob_t *b, uint64_t bytes)
{
    if (b)
        b->window = bytes < PEER_BLOB_WINDOW_MIN ? PEER_BLOB_WINDOW_MIN : bytes > PEER_BLOB_WINDOW ? PEER_BLOB_WINDOW : bytes;
}

bool peer_blob_request(peer_blob_t *b, uint64_t now_ms, Fusion__WeightRequest *req)
{
    if (!b || !req || b->st == B_DONE)
        return false;
    bool late = (b->st == B_PROBE_OUT || b->st == B_WINDOW_OUT) && now_ms - b->asked_ms >= PEER_BLOB_RESEND_MS;
    if (late)
        FU_WARN("peer", "blob %s/%s: no answer for %d ms, asking again", b->model_id, b->name, PEER_BLOB_RESEND_MS);
    fusion__weight_request__init(req);
    req->model_id = b->model_id;
    req->tensor_name = b->name;
    if (b->st == B_PROBE || (late && b->st == B_PROBE_OUT)) {
        req->offset = 0;
        req->length = 1;
        b->st = B_PROBE_OUT;
    } else if (b->st == B_WINDOW || late) {
        req->offset = b->next;
        req->length = b->window;
        b->win_end = b->next + b->window;
        b->st = B_WINDOW_OUT;
    } else {
        return false;
    }
    b->asked_ms = now_ms;
    return true;
}

static fu_err learn(peer_blob_t *b, const Fusion__WeightChunk *c)
{
    if (c->content_hash.len != PEER_BLOB_HASH_BYTES || c->n_shape > PEER_BLOB_MAX_DIMS)
        return FU_EPROTO;
    if (c->total > b->max_bytes) {
        FU_ERROR("peer", "blob %s/%s is %llu bytes, over this peer's budget of %llu", b->model_id, b->name,
                 (unsigned long long)c->total, (unsigned long long)b->max_bytes);
        return FU_ENOMEM;
    }
    b->total = c->total;
    memcpy(b->hash, c->content_hash.data, PEER_BLOB_HASH_BYTES);
    b->dtype = c->dtype;
    b->ndim = c->n_shape;
    for (size_t i = 0; i < c->n_shape; i++)
        b->shape[i] = c->shape[i];
    free(b->data);
    b->data = malloc(b->total ? (size_t)b->total : 1);
    if (!b->data)
        return FU_ENOMEM;
    b->known = true;
    return FU_OK;
}

fu_err peer_blob_feed(peer_blob_t *b, const Fusion__WeightChunk *c, uint64_t now_ms, bool *done)
{
    if (!b || !c || !done)
        return FU_EINVAL;
    *done = b->st == B_DONE;
    if (b->st == B_DONE)
        return FU_OK; /* a late duplicate */
    if (b->st == B_PROBE_OUT) {
        if (c->offset != 0)
            return FU_OK; /* the rest of an answer that ignored the probe's length */
        FU_TRY(learn(b, c));
        b->next = 0;
        if (try_cache(b)) {
            *done = true;
            return FU_OK;
        }
        b->st = B_WINDOW;
        return FU_OK;
    }
    if (b->st != B_WINDOW_OUT)
        return FU_OK; /* a chunk from an earlier request: the window will be asked again */
    if (!b->known) {
        if (c->offset != 0)
            return FU_OK;
        FU_TRY(learn(b, c));
    }
    if (c->total != b->total || c->content_hash.len != PEER_BLOB_HASH_BYTES ||
        memcmp(c->content_hash.data, b->hash, PEER_BLOB_HASH_BYTES) != 0 || c->offset > b->total ||
        c->data.len > b->total - c->offset) {
        FU_WARN("peer", "blob %s/%s: chunk at %llu does not match the blob's size or hash: dropped", b->model_id,
                b->name, (unsigned long long)c->offset);
        b->st = B_WINDOW; /* ask the window again */
        return FU_EPROTO;
    }
    if (c->offset != b->next)
        return FU_OK; /* out of order or duplicate: ignored, the in-order stream continues */
    if (c->data.len)
        memcpy(b->data + b->next, c->data.data, c->data.len);
    b->next += c->data.len;
    b->asked_ms = now_ms;
    if (b->next < b->total) {
        if (b->next >= b->win_end)
            b->st = B_WINDOW;
        else if (c->data.len == 0)
            b->st = B_WINDOW; /* an empty chunk before the end: ask again rather than spin */
        return FU_OK;
    }
    uint8_t h[PEER_BLOB_HASH_BYTES];
    peer_blob_hash(h, b->data, (size_t)b->total);
    if (sodium_memcmp(h, b->hash, sizeof h) != 0) {
        b->attempts++;
        FU_WARN("peer", "blob %s/%s: its bytes do not hash to the hash sent with it (attempt %u of %d): refused",
                b->model_id, b->name, b->attempts, PEER_BLOB_ATTEMPTS);
        if (b->attempts >= PEER_BLOB_ATTEMPTS)
            return FU_EAUTH;
        b->known = false;
        b->next = 0;
        b->st = B_WINDOW;
        return FU_OK;
    }
    b->st = B_DONE;
    *done = true;
    if (b->cache_dir) {
        fu_errmsg em = {{0}};
        char *path = cache_path(b);
        fu_err rc = fu_mkdir_p(b->cache_dir, 0700, &em);
        if (rc == FU_OK)
            rc = fu_file_write_atomic(path, b->data, (size_t)b->total, 0600, &em);
        free(path);
        if (rc != FU_OK) {
            FU_WARN("peer", "cannot cache blob %s/%s: %s", b->model_id, b->name, fu_errmsg_text(&em, rc));
            return FU_EIO;
        }
        char hex[2 * PEER_BLOB_HASH_BYTES + 1];
        fu_hex_encode(hex, b->hash, PEER_BLOB_HASH_BYTES);
        uint64_t freed;
        /* A failed trim leaves the cache larger than asked, not the blob unusable: a warning. */
        if (peer_cache_trim(b->cache_dir, b->cache_max, hex, &freed, &em) != FU_OK)
            FU_WARN("peer", "cannot keep the cache under its limit: %s", em.msg);
    }
    return FU_OK;
}

bool peer_blob_done(const peer_blob_t *b)
{
    return b && b->st == B_DONE;
}

const uint8_t *peer_blob_data(const peer_blob_t *b, size_t *len)
{
    if (len)
        *len = b && b->st == B_DONE ? (size_t)b->total : 0;
    return b && b->st == B_DONE ? b->data : NULL;
}

Fusion__Dtype peer_blob_dtype(const peer_blob_t *b)
{
    return b ? b->dtype : FUSION__DTYPE__DTYPE_UNSPECIFIED;
}

size_t peer_blob_shape(const peer_blob_t *b, int64_t *shape, size_t cap)
{
    if (!b)
        return 0;
    for (size_t i = 0; i < b->ndim && i < cap; i++)
        shape[i] = b->shape[i];
    return b->ndim;
}

const char *peer_blob_name(const peer_blob_t *b)
{
    return b ? b->name : "";
}

const char *peer_blob_model_id(const peer_blob_t *b)
{
    return b ? b->model_id : "";
}

void peer_blob_counters(const peer_blob_t *b, uint32_t *bad_fetches, uint32_t *bad_cache, bool *cache_hit)
{
    if (bad_fetches)
        *bad_fetches = b ? b->attempts : 0;
    if (bad_cache)
        *bad_cache = b ? b->bad_cache : 0;
    if (cache_hit)
        *cache_hit = b && b->cache_hit;
}
