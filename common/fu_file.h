/* fu_file: file helpers for everything fusion keeps on disk (model directories, checkpoints,
 * keys): read a whole file with a size cap, write a file atomically (temp file + fsync + rename +
 * fsync of the directory), make directories, map a file read-only, and join paths.
 * Errors carry their text in an fu_errmsg (fu_err.h). */
#ifndef FU_FILE_H
#define FU_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads all of path into a new buffer with a NUL byte after the last one (so text files can be
 * used as C strings). FU_ENOTFOUND when the file does not exist, FU_ENOMEM when it is larger than
 * max_bytes, FU_EIO on other failures. On success *data (caller frees) and *len are set. */
FU_MUST_CHECK fu_err fu_file_read_all(const char *path, size_t max_bytes, char **data, size_t *len, fu_errmsg *em);

/* Writes len bytes to path atomically: a temp file beside it, fsync, rename over path, fsync of
 * the directory. Readers see the old file or the new one, never a part. FU_ENOTFOUND when the
 * directory does not exist, FU_EIO on other failures (the temp file is removed). mode is the new
 * file's permission bits (0644, 0600). */
FU_MUST_CHECK fu_err fu_file_write_atomic(const char *path, const void *data, size_t len, mode_t mode, fu_errmsg *em);

/* A file being written atomically, piece by piece (for files too large to build in memory). */
typedef struct fu_file_writer fu_file_writer;

/* Starts writing path through a temp file in the same directory. *out owned by the caller: finish
 * with fu_file_writer_commit (publishes) or fu_file_writer_abort (removes the temp file).
 * FU_ENOTFOUND when the directory does not exist, FU_EIO for other failures. Not thread-safe per
 * writer; distinct writers are independent. */
FU_MUST_CHECK fu_err fu_file_writer_open(const char *path, mode_t mode, fu_file_writer **out, fu_errmsg *em);
/* Appends len bytes. FU_EIO on failure (the writer stays open; abort it). */
FU_MUST_CHECK fu_err fu_file_writer_write(fu_file_writer *w, const void *data, size_t len, fu_errmsg *em);
/* fsync, rename over the target, fsync the directory; frees the writer and sets *w_p = NULL even on
 * failure (the temp file is then removed). */
FU_MUST_CHECK fu_err fu_file_writer_commit(fu_file_writer **w_p, fu_errmsg *em);
/* Discards what was written; frees the writer; idempotent (NULL or *w_p == NULL do nothing). */
void fu_file_writer_abort(fu_file_writer **w_p);

/* mkdir -p: makes path and its missing parents with mode. FU_OK when it exists as a directory
 * already; FU_EEXIST when a part of it is a file; FU_EIO or FU_EPERM otherwise. */
FU_MUST_CHECK fu_err fu_mkdir_p(const char *path, mode_t mode, fu_errmsg *em);

/* true when path exists (any type). */
bool fu_path_exists(const char *path);
/* true when path is a directory. */
bool fu_path_is_dir(const char *path);
/* Sets *empty to whether directory path has no entries but . and ..; FU_ENOTFOUND if it does not
 * exist, FU_EINVAL if it is not a directory. */
FU_MUST_CHECK fu_err fu_dir_is_empty(const char *path, bool *empty);

/* dir + "/" + name as a new string (caller frees); name is returned as-is (copied) when dir is
 * NULL or empty. Never NULL (aborts on out-of-memory like fu_malloc). */
char *fu_path_join(const char *dir, const char *name);
/* The part of path after its last '/' (borrowed from path). */
const char *fu_path_base(const char *path);

struct cJSON;
/* The text of a JSON file: o printed indented, with a newline after it (caller frees with free()).
 * Deletes o. Never NULL: when memory runs out, prints oom_msg and a newline to stderr and aborts
 * (as fu_malloc does). */
char *fu_file_json_text(struct cJSON *o, const char *oom_msg);

/* A read-only memory map of a whole file. */
typedef struct {
    const uint8_t *data; /* the file's bytes; NULL when size is 0 */
    size_t         size; /* the file's length in bytes */
} fu_mmap;

/* Maps path read-only (MAP_PRIVATE). FU_ENOTFOUND, FU_EIO. An empty file gives data NULL, size 0.
 * Release with fu_mmap_close. */
FU_MUST_CHECK fu_err fu_mmap_open(const char *path, fu_mmap *out, fu_errmsg *em);
/* Unmaps; idempotent (sets data NULL, size 0). */
void fu_mmap_close(fu_mmap *m);

#ifdef __cplusplus
}
#endif
#endif
