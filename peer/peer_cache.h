/* peer_cache: the size limit of the blob cache under --cache (docs/PEER.md, `--cache-max-gb` and "Blobs").
 *
 * The cache holds one file per model tensor, named by the 64 lower-case hex chars of its
 * BLAKE2b-256 hash (peer_blob.c writes them). A file's mtime means "last used": it is set when the
 * file is written and again on every cache hit (peer_cache_touch). peer_cache_trim keeps the total
 * size of those files at or under a limit by deleting the least recently used first. Files whose
 * names are not 64 lower-case hex chars (scratch files, temp files of an atomic write, anything an
 * operator put there), symbolic links and directories are never counted and never deleted.
 *
 * Threads: no state; safe from any thread. Several processes may share one cache directory: a file
 * another process deleted first is not an error. */
#ifndef FU_PEER_CACHE_H
#define FU_PEER_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PEER_CACHE_NAME_LEN   64u  /* hex chars of a cache file's name (BLAKE2b-256) */
#define PEER_CACHE_DEFAULT_GB 20.0 /* --cache-max-gb when not given */

/* Deletes cache files of dir, oldest mtime first (ties by name), until the files it owns total at
 * most max_bytes; never the file named keep_hex (may be NULL), even when it alone is over the
 * limit. max_bytes 0: no limit, nothing is deleted. A dir that does not exist is FU_OK with nothing
 * to trim. *freed (may be NULL) gets the bytes deleted, also on error. Logs one info line with the
 * count and bytes evicted when it deleted anything. FU_EINVAL on a NULL dir, FU_EIO when dir cannot
 * be read or a file cannot be deleted (em says which; files deleted before it stay deleted). */
FU_MUST_CHECK fu_err peer_cache_trim(const char *dir, uint64_t max_bytes, const char *keep_hex,
                                     uint64_t *freed, fu_errmsg *em);

/* Sets path's mtime (and atime) to now, so that a cache hit counts as a use. FU_ENOTFOUND when
 * the file is gone, FU_EIO on other failures (em says why). */
FU_MUST_CHECK fu_err peer_cache_touch(const char *path, fu_errmsg *em);

/* true when name is a cache file's name: exactly PEER_CACHE_NAME_LEN chars of [0-9a-f]. */
bool peer_cache_is_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif
