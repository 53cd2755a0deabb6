/* peer_cache: least-recently-used trimming of the blob cache (see peer_cache.h). */
#include "peer_cache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fu_alloc.h"
#include "fu_log.h"

typedef struct {
    char name[PEER_CACHE_NAME_LEN + 1]; /* the file's hex name */
    uint64_t size;                      /* st_size */
    struct timespec mtime;              /* last use */
} cache_entry;

bool peer_cache_is_name(const char *name)
{
    if (!name)
        return false;
    size_t i = 0;
    for (; name[i]; i++) {
        if (i >= PEER_CACHE_NAME_LEN)
            return false;
        char c = name[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return false;
    }
    return i == PEER_CACHE_NAME_LEN;
}

static int by_mtime(const void *a, const void *b)
{
    const cache_entry *x = a, *y = b;
    if (x->mtime.tv_sec != y->mtime.tv_sec)
        return x->mtime.tv_sec < y->mtime.tv_sec ? -1 : 1;
    if (x->mtime.tv_nsec != y->mtime.tv_nsec)
        return x->mtime.tv_nsec < y->mtime.tv_nsec ? -1 : 1;
    return strcmp(x->name, y->name);
}

fu_err peer_cache_trim(const char *dir, uint64_t max_bytes, const char *keep_hex, uint64_t *freed,
                       fu_errmsg *em)
{
    if (freed)
        *freed = 0;
    if (!dir)
        return fu_errmsg_set(em, FU_EINVAL, "no cache directory given");
    if (max_bytes == 0)
        return FU_OK;
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT)
            return FU_OK;
        return fu_errmsg_set(em, FU_EIO, "cannot read the cache directory '%s': %s", dir, strerror(errno));
    }
    int dfd = dirfd(d);
    cache_entry *e = NULL;
    size_t n = 0, cap = 0;
    uint64_t total = 0;
    fu_err rc = FU_OK;
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(d);
        if (!de) {
            if (errno)
                rc = fu_errmsg_set(em, FU_EIO, "cannot list the cache directory '%s': %s", dir,
                                   strerror(errno));
            break;
        }
        if (!peer_cache_is_name(de->d_name))
            continue;
        struct stat st;
        if (fstatat(dfd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode))
            continue; /* gone meanwhile, or not a plain file: not ours */
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            e = fu_realloc(e, cap * sizeof *e);
        }
        memcpy(e[n].name, de->d_name, PEER_CACHE_NAME_LEN + 1);
        e[n].size = (uint64_t)st.st_size;
        e[n].mtime = st.st_mtim;
        total += e[n].size;
        n++;
    }
    uint64_t gone = 0;
    size_t count = 0;
    if (rc == FU_OK && total > max_bytes) {
        qsort(e, n, sizeof *e, by_mtime);
        for (size_t i = 0; i < n && total > max_bytes; i++) {
            if (keep_hex && strcmp(e[i].name, keep_hex) == 0)
                continue;
            if (unlinkat(dfd, e[i].name, 0) != 0) {
                if (errno != ENOENT) {
                    rc = fu_errmsg_set(em, FU_EIO, "cannot delete the cache file '%s/%s': %s", dir, e[i].name,
                                       strerror(errno));
                    break;
                }
                total -= e[i].size; /* another process sharing the cache deleted it first */
                continue;
            }
            total -= e[i].size;
            gone += e[i].size;
            count++;
        }
    }
    if (count)
        FU_INFO("peer",
                "cache %s: evicted %zu least recently used blob%s (%llu bytes) to stay under %llu bytes", dir,
                count, count == 1 ? "" : "s", (unsigned long long)gone, (unsigned long long)max_bytes);
    if (freed)
        *freed = gone;
    free(e);
    closedir(d);
    return rc;
}

fu_err peer_cache_touch(const char *path, fu_errmsg *em)
{
    if (!path)
        return fu_errmsg_set(em, FU_EINVAL, "no cache file given");
    if (utimensat(AT_FDCWD, path, NULL, 0) != 0)
        return fu_errmsg_set(em, errno == ENOENT ? FU_ENOTFOUND : FU_EIO,
                             "cannot mark the cache file '%s' as used: %s", path, strerror(errno));
    return FU_OK;
}
