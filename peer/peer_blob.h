/* peer_blob: fetching one named blob from the broker (docs/PIPELINE.md "Weights, data and
 * checkpoints as blobs"): WeightRequest windows answered by WeightChunks, BLAKE2b-256 verified, and
 * for model tensors a cache by hash under --cache.
 *
 * The fetch is a state machine that owns no socket: the owner asks it for the next request to
 * send (peer_blob_request) and feeds it the chunks that come back (peer_blob_feed). Requests cover
 * at most PEER_BLOB_WINDOW bytes and the next is asked only when the previous window has arrived,
 * so at most one window per fetch is ever in flight (bounded memory, no unbounded queue).
 *
 * Cached fetches first ask for one byte (offset 0, length 1) to learn the blob's hash, size, dtype
 * and shape; a cache file <cache>/<hex hash> whose contents hash to that value is used without
 * fetching, one that does not is refused (deleted, counted) and the blob fetched again. A fetched
 * blob whose hash does not match the chunks' hash is refused and fetched again, at most
 * PEER_BLOB_ATTEMPTS times, then FU_EAUTH.
 *
 * Threads: one fetch belongs to one thread. */
#ifndef FU_PEER_BLOB_H
#define FU_PEER_BLOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"
#include "fusion.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PEER_BLOB_WINDOW     (4u << 20) /* bytes asked for by one WeightRequest, at most */
#define PEER_BLOB_WINDOW_MIN (256u << 10) /* ... and at least (peer_blob_set_window) */
#define PEER_BLOB_ATTEMPTS   3          /* fetches of one blob before its hash mismatch is an error */
#define PEER_BLOB_HASH_BYTES 32u        /* BLAKE2b-256 */
#define PEER_BLOB_RESEND_MS  5000       /* a window with no chunk for this long is asked for again */
#define PEER_BLOB_MAX_DIMS   8u

typedef struct peer_blob peer_blob_t;

/* A fetch of (model_id, name). cache_dir: NULL for blobs that are not cached (job data,
 * checkpoints). max_bytes: the largest blob accepted (memory budget). NULL on bad arguments. */
peer_blob_t *peer_blob_new(const char *model_id, const char *name, const char *cache_dir, uint64_t max_bytes);
void peer_blob_destroy(peer_blob_t **b_p);
/* After a cached blob is written, the cache is trimmed to max_bytes keeping that blob
 * (peer_cache_trim; 0, the default: no limit). A cache hit marks its file as used. */
void peer_blob_set_cache_max(peer_blob_t *b, uint64_t max_bytes);

/* Sizes the windows asked for (PEER_BLOB_WINDOW_MIN..PEER_BLOB_WINDOW; PEER_BLOB_WINDOW until set):
 * about a second of the link, so that on a slow link a window does not hold the broker's other
 * messages to this peer back for long (they queue behind it on the same connection). */
void peer_blob_set_window(peer_blob_t *b, uint64_t bytes);

/* The window for a link of link_bytes_per_s (0: not known): a second of it, within the bounds. */
uint64_t peer_blob_window_for(uint64_t link_bytes_per_s);

/* The next WeightRequest to send, when one is due now (now_ms: fu_clock_ms()); false when the
 * fetch is waiting for chunks or done. */
bool peer_blob_request(peer_blob_t *b, uint64_t now_ms, Fusion__WeightRequest *req);

/* Feeds one WeightChunk for this blob (the caller matched model_id and tensor_name). *done turns
 * true when the blob is complete and verified. FU_EPROTO for a chunk inconsistent with the blob's
 * first (size, hash, range) - it is dropped and the window asked for again; FU_EAUTH when the
 * blob failed its hash PEER_BLOB_ATTEMPTS times; FU_ENOMEM when the blob is over max_bytes;
 * FU_EIO when a verified blob cannot be written to the cache (the blob is still usable). */
FU_MUST_CHECK fu_err peer_blob_feed(peer_blob_t *b, const Fusion__WeightChunk *c, uint64_t now_ms, bool *done);

bool peer_blob_done(const peer_blob_t *b);
/* The verified bytes (borrowed until destroy) and what the chunks said they are. */
const uint8_t *peer_blob_data(const peer_blob_t *b, size_t *len);
Fusion__Dtype peer_blob_dtype(const peer_blob_t *b);
size_t peer_blob_shape(const peer_blob_t *b, int64_t *shape, size_t cap);
const char *peer_blob_name(const peer_blob_t *b);
const char *peer_blob_model_id(const peer_blob_t *b);
/* Counters: hash mismatches of fetched blobs, cache files refused, cache hits. */
void peer_blob_counters(const peer_blob_t *b, uint32_t *bad_fetches, uint32_t *bad_cache, bool *cache_hit);

/* BLAKE2b-256 of len bytes. */
void peer_blob_hash(uint8_t out[PEER_BLOB_HASH_BYTES], const void *data, size_t len);

#ifdef __cplusplus
}
#endif
#endif
