#define _GNU_SOURCE /* mkostemp */
#include "fu_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "fu_alloc.h"

static fu_err errno_to_fu(int e)
{
    switch (e) {
    case ENOENT:
    case ENOTDIR:
        return FU_ENOTFOUND;
    case EEXIST:
        return FU_EEXIST;
    case EACCES:
    case EPERM:
    case EROFS:
        return FU_EPERM;
    case ENOMEM:
        return FU_ENOMEM;
    default:
        return FU_EIO;
    }
}

/* Opens path for reading and checks that it is a regular file: *fd (close it) and its *st. */
static fu_err open_regular(const char *path, int *fd, struct stat *st, fu_errmsg *em)
{
    *fd = open(path, O_RDONLY | O_CLOEXEC);
    if (*fd < 0) {
        int e = errno;
        return fu_errmsg_set(em, errno_to_fu(e), "cannot open '%s': %s", path, strerror(e));
    }
    if (fstat(*fd, st) != 0 || !S_ISREG(st->st_mode)) {
        close(*fd);
        *fd = -1;
        return fu_errmsg_set(em, FU_EIO, "'%s' is not a regular file", path);
    }
    return FU_OK;
}

fu_err fu_file_read_all(const char *path, size_t max_bytes, char **data, size_t *len, fu_errmsg *em)
{
    if (!path || !data || !len)
        return fu_errmsg_set(em, FU_EINVAL, "fu_file_read_all: NULL argument");
    *data = NULL;
    *len = 0;
    int fd;
    struct stat st;
    FU_TRY(open_regular(path, &fd, &st, em));
    if (st.st_size < 0 || (unsigned long long)st.st_size > max_bytes) {
        close(fd);
        return fu_errmsg_set(em, FU_ENOMEM, "'%s' is %lld bytes, more than the %zu allowed", path,
                             (long long)st.st_size, max_bytes);
    }
    size_t cap = (size_t)st.st_size;
    char *buf = fu_malloc(cap + 1);
    size_t got = 0;
    for (;;) {
        if (got == cap) {
            /* The file may have grown since fstat: read on, still under the cap. */
            if (cap >= max_bytes)
                break;
            size_t ncap = cap < 4096 ? 4096 : cap * 2;
            if (ncap > max_bytes)
                ncap = max_bytes;
            buf = fu_realloc(buf, ncap + 1);
            cap = ncap;
        }
        ssize_t n = read(fd, buf + got, cap - got);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            free(buf);
            close(fd);
            return fu_errmsg_set(em, FU_EIO, "cannot read '%s': %s", path, strerror(e));
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    buf[got] = '\0';
    *data = buf;
    *len = got;
    return FU_OK;
}

struct fu_file_writer {
    int   fd;     /* the temp file */
    char *path;   /* the target */
    char *tmp;    /* the temp file's path */
};

static char *dir_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (!slash)
        return fu_strdup(".");
    if (slash == path)
        return fu_strdup("/");
    size_t n = (size_t)(slash - path);
    char *d = fu_malloc(n + 1);
    memcpy(d, path, n);
    d[n] = '\0';
    return d;
}

static void fsync_dir(const char *path)
{
    char *d = dir_of(path);
    int fd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd); /* best effort: some filesystems refuse fsync on directories */
        close(fd);
    }
    free(d);
}

fu_err fu_file_writer_open(const char *path, mode_t mode, fu_file_writer **out, fu_errmsg *em)
{
    if (!path || !*path || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_file_writer_open: bad argument");
    *out = NULL;
    size_t n = strlen(path) + 16;
    char *tmp = fu_malloc(n);
    snprintf(tmp, n, "%s.tmp-XXXXXX", path);
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        free(tmp);
        return fu_errmsg_set(em, errno_to_fu(e) == FU_ENOTFOUND ? FU_ENOTFOUND : FU_EIO,
                             "cannot create a file beside '%s': %s", path, strerror(e));
    }
    if (fchmod(fd, mode) != 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        free(tmp);
        return fu_errmsg_set(em, FU_EIO, "cannot set the mode of '%s': %s", path, strerror(e));
    }
    fu_file_writer *w = fu_calloc(1, sizeof *w);
    w->fd = fd;
    w->path = fu_strdup(path);
    w->tmp = tmp;
    *out = w;
    return FU_OK;
}

fu_err fu_file_writer_write(fu_file_writer *w, const void *data, size_t len, fu_errmsg *em)
{
    if (!w || (!data && len))
        return fu_errmsg_set(em, FU_EINVAL, "fu_file_writer_write: bad argument");
    const uint8_t *p = data;
    while (len) {
        size_t chunk = len > ((size_t)1 << 30) ? ((size_t)1 << 30) : len;
        ssize_t n = write(w->fd, p, chunk);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            return fu_errmsg_set(em, FU_EIO, "cannot write '%s': %s", w->path, strerror(e));
        }
        p += n;
        len -= (size_t)n;
    }
    return FU_OK;
}

static void writer_free(fu_file_writer *w)
{
    free(w->path);
    free(w->tmp);
    free(w);
}

fu_err fu_file_writer_commit(fu_file_writer **w_p, fu_errmsg *em)
{
    if (!w_p || !*w_p)
        return fu_errmsg_set(em, FU_EINVAL, "fu_file_writer_commit: no writer");
    fu_file_writer *w = *w_p;
    *w_p = NULL;
    fu_err rc = FU_OK;
    if (fsync(w->fd) != 0) {
        int e = errno;
        rc = fu_errmsg_set(em, FU_EIO, "cannot fsync '%s': %s", w->path, strerror(e));
    }
    if (close(w->fd) != 0 && rc == FU_OK) {
        int e = errno;
        rc = fu_errmsg_set(em, FU_EIO, "cannot close '%s': %s", w->path, strerror(e));
    }
    if (rc == FU_OK && rename(w->tmp, w->path) != 0) {
        int e = errno;
        rc = fu_errmsg_set(em, FU_EIO, "cannot rename onto '%s': %s", w->path, strerror(e));
    }
    if (rc != FU_OK)
        unlink(w->tmp);
    else
        fsync_dir(w->path);
    writer_free(w);
    return rc;
}

void fu_file_writer_abort(fu_file_writer **w_p)
{
    if (!w_p || !*w_p)
        return;
    fu_file_writer *w = *w_p;
    *w_p = NULL;
    close(w->fd);
    unlink(w->tmp);
    writer_free(w);
}

fu_err fu_file_write_atomic(const char *path, const void *data, size_t len, mode_t mode, fu_errmsg *em)
{
    fu_file_writer *w = NULL;
    fu_err rc = fu_file_writer_open(path, mode, &w, em);
    if (rc != FU_OK)
        return rc;
    rc = fu_file_writer_write(w, data, len, em);
    if (rc != FU_OK) {
        fu_file_writer_abort(&w);
        return rc;
    }
    return fu_file_writer_commit(&w, em);
}

fu_err fu_mkdir_p(const char *path, mode_t mode, fu_errmsg *em)
{
    if (!path || !*path)
        return fu_errmsg_set(em, FU_EINVAL, "fu_mkdir_p: empty path");
    char *p = fu_strdup(path);
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/')
        p[--n] = '\0';
    fu_err rc = FU_OK;
    for (char *s = p + 1;; s++) {
        if (*s != '/' && *s != '\0')
            continue;
        char saved = *s;
        *s = '\0';
        if (mkdir(p, mode) != 0) {
            int e = errno;
            struct stat st;
            if (e == EEXIST) {
                if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) {
                    rc = fu_errmsg_set(em, FU_EEXIST, "'%s' exists and is not a directory", p);
                    break;
                }
            } else {
                rc = fu_errmsg_set(em, errno_to_fu(e) == FU_EPERM ? FU_EPERM : FU_EIO,
                                   "cannot make directory '%s': %s", p, strerror(e));
                break;
            }
        }
        *s = saved;
        if (saved == '\0')
            break;
    }
    free(p);
    return rc;
}

bool fu_path_exists(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0;
}

bool fu_path_is_dir(const char *path)
{
    struct stat st;
    return path && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

fu_err fu_dir_is_empty(const char *path, bool *empty)
{
    if (!path || !empty)
        return FU_EINVAL;
    struct stat st;
    if (stat(path, &st) != 0)
        return FU_ENOTFOUND;
    if (!S_ISDIR(st.st_mode))
        return FU_EINVAL;
    DIR *d = opendir(path);
    if (!d)
        return errno_to_fu(errno);
    bool e = true;
    struct dirent *ent;
    while ((ent = readdir(d)) != NULL) {
        if (strcmp(ent->d_name, ".") != 0 && strcmp(ent->d_name, "..") != 0) {
            e = false;
            break;
        }
    }
    closedir(d);
    *empty = e;
    return FU_OK;
}

char *fu_path_join(const char *dir, const char *name)
{
    if (!dir || !*dir)
        return fu_strdup(name ? name : "");
    size_t a = strlen(dir), b = strlen(name);
    bool slash = dir[a - 1] == '/';
    char *out = fu_malloc(a + b + 2);
    memcpy(out, dir, a);
    size_t at = a;
    if (!slash)
        out[at++] = '/';
    memcpy(out + at, name, b + 1);
    return out;
}

const char *fu_path_base(const char *path)
{
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

fu_err fu_mmap_open(const char *path, fu_mmap *out, fu_errmsg *em)
{
    if (!path || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_mmap_open: NULL argument");
    out->data = NULL;
    out->size = 0;
    int fd;
    struct stat st;
    FU_TRY(open_regular(path, &fd, &st, em));
    if (st.st_size == 0) {
        close(fd);
        return FU_OK;
    }
    if ((unsigned long long)st.st_size > SIZE_MAX) {
        close(fd);
        return fu_errmsg_set(em, FU_ENOMEM, "'%s' is too large to map", path);
    }
    size_t size = (size_t)st.st_size;
    void *p = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED)
        return fu_errmsg_set(em, FU_EIO, "cannot map '%s': %s", path, strerror(e));
    out->data = p;
    out->size = size;
    return FU_OK;
}

void fu_mmap_close(fu_mmap *m)
{
    if (!m)
        return;
    if (m->data)
        munmap((void *)(uintptr_t)m->data, m->size);
    m->data = NULL;
    m->size = 0;
}

char *fu_file_json_text(cJSON *o, const char *oom_msg)
{
    char *txt = cJSON_Print(o);
    cJSON_Delete(o);
    if (!txt) { /* cJSON fails only for lack of memory */
        fprintf(stderr, "%s\n", oom_msg);
        abort();
    }
    /* cJSON allocates with its own hooks; hand back a string the caller frees with free(). */
    size_t n = strlen(txt);
    char *out = fu_malloc(n + 2);
    memcpy(out, txt, n);
    out[n] = '\n';
    out[n + 1] = '\0';
    cJSON_free(txt);
    return out;
}
