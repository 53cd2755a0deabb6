#include "broker_upload.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_file.h"
#include "fu_log.h"

#define LOG "upload"
#define HASH_LEN 32
#define MANIFEST_FILE ".fusion-upload" /* a committed model's manifest (ModelUpload, serialized) */
#define STAGING_PREFIX ".staging-"

/* Where a chunk's bytes lie in a committed model. */
typedef struct {
    uint8_t hash[HASH_LEN];
    char *path;                  /* the file that holds it (owned) */
    uint64_t offset;
    uint32_t len;
} chunk_loc;

/* One chunk of a manifest: its file and place. */
typedef struct {
    const uint8_t *hash;         /* into the manifest */
    uint32_t file;
    uint64_t offset;
    uint32_t len;
} chunk_ref;

/* An upload in progress (one per client). */
typedef struct {
    char owner[DB_KEY_LEN + 1];
    char id[2 * HASH_LEN + 1];   /* hex of the manifest's hash */
    Fusion__ModelUpload *man;    /* the manifest (unpacked copy) */
    chunk_ref *chunks;
    uint32_t n_chunks, n_got;
    uint8_t *got;                /* per chunk: written */
    uint64_t bytes;
    char *staging;               /* its directory */
    bool committing;             /* its commit runs on the worker: nothing may change it */
    char *failed;                /* why its commit failed (told at the client's next ModelUpload) */
} pending;

struct broker_uploads {
    char *dir;
    uint64_t max_bytes, used_bytes; /* committed models' bytes */
    chunk_loc *index;               /* sorted by hash */
    size_t n_index, cap_index;
    pending pend[BROKER_UPLOAD_PENDING];
};

static int loc_cmp(const void *a, const void *b)
{
    return memcmp(((const chunk_loc *)a)->hash, ((const chunk_loc *)b)->hash, HASH_LEN);
}

static const chunk_loc *index_find(const broker_uploads *u, const uint8_t *hash)
{
    chunk_loc key;
    memcpy(key.hash, hash, HASH_LEN);
    return u->n_index ? bsearch(&key, u->index, u->n_index, sizeof key, loc_cmp) : NULL;
}

static void remove_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        for (struct dirent *e; (e = readdir(d));)
            if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) {
                char *p = fu_path_join(dir, e->d_name);
                (void)unlink(p);
                free(p);
            }
        closedir(d);
    }
    (void)rmdir(dir);
}

/* A manifest's file name: plain, printable, not hidden. */
static bool plain_name(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > 128 || s[0] == '.')
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '.' || s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

/* Checks the manifest; counts its chunks and bytes. The message says what is wrong. */
static bool manifest_ok(const Fusion__ModelUpload *m, uint32_t *chunks, uint64_t *bytes, char *why, size_t wn)
{
    uint64_t nc = 0, nb = 0;
    bool config = false;
    if (m->n_files == 0 || m->n_files > BROKER_UPLOAD_FILES) {
        snprintf(why, wn, "a model has 1 to %d files, not %zu", BROKER_UPLOAD_FILES, m->n_files);
        return false;
    }
    for (size_t i = 0; i < m->n_files; i++) {
        const Fusion__UploadFile *f = m->files[i];
        if (!plain_name(f->name)) {
            snprintf(why, wn, "file %zu: names are plain ([A-Za-z0-9._-], not starting with '.')", i);
            return false;
        }
        for (size_t k = 0; k < i; k++)
            if (strcmp(m->files[k]->name, f->name) == 0) {
                snprintf(why, wn, "'%s' is named twice", f->name);
                return false;
            }
        if (f->size > (uint64_t)WIRE_MAX_REPEATED * WIRE_UPLOAD_CHUNK) {
            snprintf(why, wn, "'%s': a file holds at most %u chunks of %u bytes", f->name, WIRE_MAX_REPEATED,
                     WIRE_UPLOAD_CHUNK);
            return false;
        }
        uint64_t want = (f->size + WIRE_UPLOAD_CHUNK - 1) / WIRE_UPLOAD_CHUNK;
        if (f->n_chunks != want) {
            snprintf(why, wn, "'%s': %" PRIu64 " bytes take %" PRIu64 " chunks, not %zu", f->name, f->size, want,
                     f->n_chunks);
            return false;
        }
        for (size_t k = 0; k < f->n_chunks; k++)
            if (f->chunks[k].len != HASH_LEN) {
                snprintf(why, wn, "'%s': chunk hashes are %d bytes", f->name, HASH_LEN);
                return false;
            }
        config |= strcmp(f->name, "config.json") == 0;
        nc += f->n_chunks;
        nb += f->size;
    }
    if (!config) {
        snprintf(why, wn, "a model directory has a config.json");
        return false;
    }
    if (nc > UINT32_MAX / 2) {
        snprintf(why, wn, "too many chunks");
        return false;
    }
    *chunks = (uint32_t)nc;
    *bytes = nb;
    return true;
}

/* The manifest's hash (its canonical content: names, sizes, chunk hashes) in hex. */
static void manifest_id(const Fusion__ModelUpload *m, char id[2 * HASH_LEN + 1])
{
    crypto_generichash_state st;
    crypto_generichash_init(&st, (const uint8_t *)"fusion upload", 13, HASH_LEN);
    for (size_t i = 0; i < m->n_files; i++) {
        const Fusion__UploadFile *f = m->files[i];
        uint8_t sz[8];
        for (int k = 0; k < 8; k++)
            sz[k] = (uint8_t)(f->size >> (8 * k));
        crypto_generichash_update(&st, (const uint8_t *)f->name, strlen(f->name) + 1);
        crypto_generichash_update(&st, sz, sizeof sz);
        for (size_t k = 0; k < f->n_chunks; k++)
            crypto_generichash_update(&st, f->chunks[k].data, HASH_LEN);
    }
    uint8_t h[HASH_LEN];
    crypto_generichash_final(&st, h, HASH_LEN);
    fu_hex_encode(id, h, HASH_LEN);
}

/* Adds the chunks of the committed model in mdir (its manifest m) to the index. */
static void index_add(broker_uploads *u, const char *mdir, const Fusion__ModelUpload *m)
{
    for (size_t i = 0; i < m->n_files; i++) {
        const Fusion__UploadFile *f = m->files[i];
        for (size_t k = 0; k < f->n_chunks; k++) {
            if (u->n_index == u->cap_index) {
                u->cap_index = u->cap_index ? 2 * u->cap_index : 256;
                u->index = fu_realloc(u->index, u->cap_index * sizeof *u->index);
            }
            chunk_loc *c = &u->index[u->n_index++];
            memcpy(c->hash, f->chunks[k].data, HASH_LEN);
            c->offset = (uint64_t)k * WIRE_UPLOAD_CHUNK;
            c->len = (uint32_t)(f->size - c->offset < WIRE_UPLOAD_CHUNK ? f->size - c->offset : WIRE_UPLOAD_CHUNK);
            c->path = fu_path_join(mdir, f->name);
        }
        u->used_bytes += f->size;
    }
    qsort(u->index, u->n_index, sizeof *u->index, loc_cmp);
}

broker_uploads *broker_uploads_new(const char *dir, uint64_t max_bytes, fu_errmsg *em)
{
    if (fu_mkdir_p(dir, 0700, em) != FU_OK)
        return NULL;
    broker_uploads *u = fu_calloc(1, sizeof *u);
    u->dir = fu_strdup(dir);
    u->max_bytes = max_bytes;
    DIR *d = opendir(dir);
    if (!d) {
        fu_errmsg_set(em, FU_EIO, "cannot read the uploads directory '%s': %s", dir, strerror(errno));
        broker_uploads_free(&u);
        return NULL;
    }
    for (struct dirent *e; (e = readdir(d));) {
        char *p = fu_path_join(dir, e->d_name);
        if (strncmp(e->d_name, STAGING_PREFIX, strlen(STAGING_PREFIX)) == 0) {
            remove_tree(p); /* an upload a restart cut short */
        } else if (strncmp(e->d_name, "u-", 2) == 0) {
            char *mp = fu_path_join(p, MANIFEST_FILE), *txt = NULL;
            size_t len = 0;
            fu_errmsg sub = {{0}};
            Fusion__ModelUpload *m = NULL;
            if (fu_file_read_all(mp, WIRE_MAX_MSG_BYTES, &txt, &len, &sub) == FU_OK &&
                (m = fusion__model_upload__unpack(NULL, len, (const uint8_t *)txt)) != NULL) {
                uint32_t nc;
                uint64_t nb;
                char why[160];
                if (manifest_ok(m, &nc, &nb, why, sizeof why))
                    index_add(u, p, m);
                fusion__model_upload__free_unpacked(m, NULL);
            } else {
                FU_WARN(LOG, "uploaded model %s has no readable manifest: its chunks are not reused", p);
            }
            free(txt);
            free(mp);
        }
        free(p);
    }
    closedir(d);
    return u;
}

static void pending_clear(pending *p)
{
    if (p->staging) {
        remove_tree(p->staging);
        free(p->staging);
    }
    if (p->man)
        fusion__model_upload__free_unpacked(p->man, NULL);
    free(p->chunks);
    free(p->got);
    free(p->failed);
    memset(p, 0, sizeof *p);
}

void broker_uploads_free(broker_uploads **u_p)
{
    if (!u_p || !*u_p)
        return;
    broker_uploads *u = *u_p;
    for (size_t i = 0; i < BROKER_UPLOAD_PENDING; i++)
        pending_clear(&u->pend[i]);
    for (size_t i = 0; i < u->n_index; i++)
        free(u->index[i].path);
    free(u->index);
    free(u->dir);
    free(u);
    *u_p = NULL;
}

static pending *pending_of(broker_uploads *u, const char *owner)
{
    for (size_t i = 0; i < BROKER_UPLOAD_PENDING; i++)
        if (u->pend[i].man && strcmp(u->pend[i].owner, owner) == 0)
            return &u->pend[i];
    return NULL;
}

static uint64_t pending_bytes(const broker_uploads *u)
{
    uint64_t n = 0;
    for (size_t i = 0; i < BROKER_UPLOAD_PENDING; i++)
        n += u->pend[i].man ? u->pend[i].bytes : 0;
    return n;
}

/* Answers with the chunks still to send (missing: bytes from the client; copy: a stub, the broker
 * holds them), or with the model's name once made. */
static void answer(broker_t *b, const wire_msg_t *msg, const pending *p, const char *model, uint32_t chunks)
{
    Fusion__UploadStatus st = FUSION__UPLOAD_STATUS__INIT;
    uint32_t *miss = NULL, *copy = NULL;
    size_t nm = 0, ncp = 0;
    if (p) {
        miss = fu_malloc((p->n_chunks + 1) * sizeof *miss);
        copy = fu_malloc((p->n_chunks + 1) * sizeof *copy);
        for (uint32_t i = 0; i < p->n_chunks; i++)
            if (!p->got[i]) {
                if (index_find(b->uploads, p->chunks[i].hash))
                    copy[ncp++] = i;
                else
                    miss[nm++] = i;
            }
    }
    /* at most WIRE_MAX_REPEATED indices a list: the client asks again after sending those */
    st.n_missing = nm < WIRE_MAX_REPEATED ? nm : WIRE_MAX_REPEATED;
    st.missing = miss;
    st.n_copy = ncp < WIRE_MAX_REPEATED ? ncp : WIRE_MAX_REPEATED;
    st.copy = copy;
    st.have = p ? p->n_got : chunks;
    st.chunks = p ? p->n_chunks : chunks;
    st.model = (char *)(model ? model : "");
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, &st.base);
    free(miss);
    free(copy);
}

/* Makes p's staging directory with its files at their sizes. */
static fu_err staging_make(broker_uploads *u, pending *p, fu_errmsg *em)
{
    char name[sizeof STAGING_PREFIX + 2 * HASH_LEN];
    snprintf(name, sizeof name, STAGING_PREFIX "%s", p->id);
    p->staging = fu_path_join(u->dir, name);
    remove_tree(p->staging);
    if (mkdir(p->staging, 0700) != 0)
        return fu_errmsg_set(em, FU_EIO, "cannot make '%s': %s", p->staging, strerror(errno));
    for (size_t i = 0; i < p->man->n_files; i++) {
        char *fp = fu_path_join(p->staging, p->man->files[i]->name);
        int fd = open(fp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        int rc = fd < 0 ? -1 : ftruncate(fd, (off_t)p->man->files[i]->size);
        int err = errno;
        if (fd >= 0)
            close(fd);
        free(fp);
        if (rc != 0)
            return fu_errmsg_set(em, FU_EIO, "cannot make the file '%s' of the upload: %s", p->man->files[i]->name,
                                 strerror(err));
    }
    return FU_OK;
}

/* Makes the pending upload *out of the manifest m (consumed) for owner. */
static fu_err pending_new(broker_uploads *u, const char *owner, Fusion__ModelUpload *m, const char *id,
                          uint32_t chunks, uint64_t bytes, pending **out, fu_errmsg *em)
{
    pending *p = NULL;
    for (size_t i = 0; i < BROKER_UPLOAD_PENDING && !p; i++)
        if (!u->pend[i].man)
            p = &u->pend[i];
    if (!p) {
        fusion__model_upload__free_unpacked(m, NULL);
        return fu_errmsg_set(em, FU_EAGAIN, "%d uploads are in progress already; try again later",
                             BROKER_UPLOAD_PENDING);
    }
    snprintf(p->owner, sizeof p->owner, "%s", owner);
    snprintf(p->id, sizeof p->id, "%s", id);
    p->man = m;
    p->n_chunks = chunks;
    p->bytes = bytes;
    p->chunks = fu_calloc(chunks + 1, sizeof *p->chunks);
    p->got = fu_calloc(chunks + 1, 1);
    uint32_t c = 0;
    for (size_t i = 0; i < m->n_files; i++)
        for (size_t k = 0; k < m->files[i]->n_chunks; k++, c++) {
            uint64_t off = (uint64_t)k * WIRE_UPLOAD_CHUNK, left = m->files[i]->size - off;
            p->chunks[c] = (chunk_ref){.hash = m->files[i]->chunks[k].data, .file = (uint32_t)i, .offset = off,
                                       .len = (uint32_t)(left < WIRE_UPLOAD_CHUNK ? left : WIRE_UPLOAD_CHUNK)};
        }
    fu_err rc = staging_make(u, p, em);
    if (rc != FU_OK) {
        pending_clear(p);
        return rc;
    }
    *out = p;
    return FU_OK;
}

static void models_dir_name(const char *id, char out[2 * HASH_LEN + 3])
{
    snprintf(out, 2 * HASH_LEN + 3, "u-%s", id);
}

static Fusion__ErrorCode code_of(fu_err rc)
{
    return rc == FU_EAGAIN ? FUSION__ERROR_CODE__ERR_BUSY
           : rc == FU_EIO ? FUSION__ERROR_CODE__ERR_INTERNAL
                          : FUSION__ERROR_CODE__ERR_INVALID;
}

/* A commit, on the broker's worker thread (fsyncing gigabytes must not hold the loop): the files
 * flushed, the manifest written beside them, the directory renamed. The loop then indexes the
 * model, clears the upload and answers (commit_done). Holds copies of all it needs. */
typedef struct {
    broker_task base;
    char id[2 * HASH_LEN + 1];
    char owner[DB_KEY_LEN + 1];
    char *staging, *dst;
    char **files;               /* the files' paths in staging */
    size_t n_files;
    uint8_t *manifest;          /* packed */
    size_t manifest_len;
    uint32_t chunks;
    fu_err rc;
    fu_errmsg em;
} commit_task;

static void commit_free(commit_task *t)
{
    for (size_t i = 0; i < t->n_files; i++)
        free(t->files[i]);
    free(t->files);
    free(t->staging);
    free(t->dst);
    free(t->manifest);
    free(t);
}

static void commit_run(broker_task *bt)
{
    commit_task *t = (commit_task *)bt;
    for (size_t i = 0; i < t->n_files; i++) {
        int fd = open(t->files[i], O_RDONLY | O_CLOEXEC);
        int rc = fd < 0 ? -1 : fsync(fd);
        int err = errno;
        if (fd >= 0)
            close(fd);
        if (rc != 0) {
            t->rc = fu_errmsg_set(&t->em, FU_EIO, "cannot flush the upload's '%s': %s", fu_path_base(t->files[i]),
                                  strerror(err));
            return;
        }
    }
    char *mp = fu_path_join(t->staging, MANIFEST_FILE);
    t->rc = fu_file_write_atomic(mp, t->manifest, t->manifest_len, 0600, &t->em);
    free(mp);
    if (t->rc == FU_OK && rename(t->staging, t->dst) != 0)
        t->rc = fu_errmsg_set(&t->em, FU_EIO, "cannot make the model '%s': %s", t->dst, strerror(errno));
}

static void commit_drop(broker_task *bt)
{
    commit_free((commit_task *)bt); /* shutting down: a staging directory left is removed at the next start */
}

static void commit_done(broker_task *bt, void *loop)
{
    commit_task *t = (commit_task *)bt;
    broker_t *b = loop;
    broker_uploads *u = b->uploads;
    pending *p = NULL;
    for (size_t i = 0; i < BROKER_UPLOAD_PENDING && !p; i++)
        if (u->pend[i].committing && strcmp(u->pend[i].id, t->id) == 0 && strcmp(u->pend[i].owner, t->owner) == 0)
            p = &u->pend[i];
    if (t->rc != FU_OK) {
        FU_WARN(LOG, "upload %s: %s", t->id, t->em.msg);
        if (p) { /* the client hears it when it asks next */
            p->committing = false;
            free(p->failed);
            p->failed = fu_strdup(t->em.msg);
        }
        commit_free(t);
        return;
    }
    Fusion__ModelUpload *m = fusion__model_upload__unpack(NULL, t->manifest_len, t->manifest);
    if (m) {
        index_add(u, t->dst, m);
        fusion__model_upload__free_unpacked(m, NULL);
    }
    FU_INFO(LOG, "client %.12s uploaded model %s (%.1f MiB)", t->owner, fu_path_base(t->dst),
            p ? (double)p->bytes / 1048576.0 : 0.0);
    if (p) {
        free(p->staging);
        p->staging = NULL; /* renamed: nothing to remove */
        pending_clear(p);
    }
    commit_free(t);
}

/* Posts the commit of p to the worker (p stays, marked committing, until commit_done). */
static fu_err commit_post(broker_t *b, pending *p, fu_errmsg *em)
{
    broker_uploads *u = b->uploads;
    commit_task *t = fu_calloc(1, sizeof *t);
    t->base.run = commit_run;
    t->base.done = commit_done;
    t->base.drop = commit_drop;
    snprintf(t->id, sizeof t->id, "%s", p->id);
    snprintf(t->owner, sizeof t->owner, "%s", p->owner);
    t->staging = fu_strdup(p->staging);
    char model[2 * HASH_LEN + 3];
    models_dir_name(p->id, model);
    t->dst = fu_path_join(u->dir, model);
    t->n_files = p->man->n_files;
    t->files = fu_calloc(t->n_files + 1, sizeof *t->files);
    for (size_t i = 0; i < t->n_files; i++)
        t->files[i] = fu_path_join(p->staging, p->man->files[i]->name);
    t->manifest_len = fusion__model_upload__get_packed_size(p->man);
    t->manifest = fu_malloc(t->manifest_len + 1);
    fusion__model_upload__pack(p->man, t->manifest);
    t->chunks = p->n_chunks;
    if (!broker_worker_post(b->worker, &t->base)) {
        commit_free(t);
        return fu_errmsg_set(em, FU_EAGAIN, "the broker is busy; commit again in a moment");
    }
    p->committing = true;
    return FU_OK;
}

void broker_on_model_upload(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__ModelUpload *mu = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD);
    broker_uploads *u = b->uploads;
    if (!mu) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_PROTO, "malformed ModelUpload");
        return;
    }
    if (!u) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                           "this broker takes no uploads (its operator set --upload-gib 0): ask for the model to be "
                           "put under its --model-root");
        return;
    }
    uint32_t chunks = 0;
    uint64_t bytes = 0;
    char why[200];
    if (!manifest_ok(mu, &chunks, &bytes, why, sizeof why)) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "ModelUpload: %s", why);
        return;
    }
    char id[2 * HASH_LEN + 1], model[2 * HASH_LEN + 3];
    manifest_id(mu, id);
    models_dir_name(id, model);
    char *done = fu_path_join(u->dir, model);
    bool there = fu_path_is_dir(done);
    free(done);
    const char *owner = wire_msg_user_id(msg);
    pending *p = pending_of(u, owner);
    if (p && p->committing) { /* nothing to send, no name yet: the client asks again */
        answer(b, msg, NULL, NULL, chunks);
        return;
    }
    if (p && p->failed && strcmp(p->id, id) == 0) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker could not make the model: %s",
                           p->failed);
        pending_clear(p);
        return;
    }
    if (there) { /* the same model, uploaded before */
        if (p && strcmp(p->id, id) == 0)
            pending_clear(p);
        answer(b, msg, NULL, model, chunks);
        return;
    }
    const bool replaces = p && strcmp(p->id, id) != 0; /* a new upload replaces the client's old one */
    if (!p || replaces) {
        uint64_t held = u->used_bytes + pending_bytes(u) - (replaces ? p->bytes : 0);
        if (held + bytes > u->max_bytes) {
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_TOO_LARGE,
                               "the model is %.1f MiB, and the broker's uploads hold %.1f of at most %.1f MiB: ask "
                               "its operator for room (--upload-gib)",
                               (double)bytes / 1048576.0, (double)held / 1048576.0, (double)u->max_bytes / 1048576.0);
            return;
        }
        if (replaces)
            pending_clear(p), p = NULL;
        size_t len = fusion__model_upload__get_packed_size(mu);
        uint8_t *buf = fu_malloc(len + 1);
        fusion__model_upload__pack(mu, buf);
        Fusion__ModelUpload *copy = fusion__model_upload__unpack(NULL, len, buf);
        free(buf);
        fu_errmsg em = {{0}};
        fu_err rc = copy ? pending_new(u, owner, copy, id, chunks, bytes, &p, &em) : FU_ENOMEM;
        if (rc != FU_OK) {
            broker_reply_error(b, msg, code_of(rc), "%s", copy ? em.msg : "out of memory");
            return;
        }
    }
    if (mu->commit) {
        if (p->n_got < p->n_chunks) {
            answer(b, msg, p, NULL, chunks); /* still missing: the lists say which */
            return;
        }
        fu_errmsg em = {{0}};
        fu_err rc = commit_post(b, p, &em); /* the client asks until the model is named */
        if (rc != FU_OK)
            broker_reply_error(b, msg, code_of(rc), "%s", em.msg);
        else
            answer(b, msg, NULL, NULL, chunks);
        return;
    }
    answer(b, msg, p, NULL, chunks);
}

/* Reads the len bytes a committed model holds under hash into buf (checked against it). */
static bool copy_from_index(const broker_uploads *u, const uint8_t *hash, uint8_t *buf, uint32_t len)
{
    const chunk_loc *c = index_find(u, hash);
    if (!c || c->len != len)
        return false;
    int fd = open(c->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = pread(fd, buf, len, (off_t)c->offset);
    close(fd);
    uint8_t h[HASH_LEN];
    crypto_generichash(h, HASH_LEN, buf, len, NULL, 0);
    return n == (ssize_t)len && sodium_memcmp(h, hash, HASH_LEN) == 0;
}

void broker_on_model_chunk(broker_t *b, const wire_msg_t *msg)
{
    const Fusion__ModelChunk *mc = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_MODEL_CHUNK);
    broker_uploads *u = b->uploads;
    pending *p = u && mc ? pending_of(u, wire_msg_user_id(msg)) : NULL;
    if (!mc) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_PROTO, "malformed ModelChunk");
        return;
    }
    if (!p) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                           "no upload of yours is in progress: announce the model first (ModelUpload)");
        return;
    }
    if (p->committing) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_BUSY, "your upload is being committed");
        return;
    }
    if (mc->index >= p->n_chunks) {
        broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "chunk %u of %u", mc->index, p->n_chunks);
        return;
    }
    const chunk_ref *c = &p->chunks[mc->index];
    if (!p->got[mc->index]) {
        uint8_t *own = NULL;
        const uint8_t *data = mc->data.data;
        if (mc->data.len == 0) { /* the broker holds these bytes */
            own = fu_malloc(c->len + 1);
            if (!copy_from_index(u, c->hash, own, c->len)) {
                free(own);
                broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_NOT_FOUND,
                                   "chunk %u is not on the broker (any more): send its bytes", mc->index);
                return;
            }
            data = own;
        } else {
            uint8_t h[HASH_LEN];
            crypto_generichash(h, HASH_LEN, mc->data.data, mc->data.len, NULL, 0);
            if (mc->data.len != c->len || sodium_memcmp(h, c->hash, HASH_LEN) != 0) {
                if (mc->data.len != c->len)
                    broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID, "chunk %u has %zu bytes, not %u",
                                       mc->index, mc->data.len, c->len);
                else
                    broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INVALID,
                                       "chunk %u's bytes do not match its hash in the manifest", mc->index);
                return;
            }
        }
        char *fp = fu_path_join(p->staging, p->man->files[c->file]->name);
        int fd = open(fp, O_WRONLY | O_CLOEXEC);
        ssize_t n = fd < 0 ? -1 : pwrite(fd, data, c->len, (off_t)c->offset);
        int err = errno;
        if (fd >= 0)
            close(fd);
        free(fp);
        free(own);
        if (n != (ssize_t)c->len) {
            FU_WARN(LOG, "upload %s: cannot write chunk %u: %s", p->id, mc->index, strerror(err));
            broker_reply_error(b, msg, FUSION__ERROR_CODE__ERR_INTERNAL, "the broker cannot write the chunk (%s)",
                               n < 0 ? strerror(err) : "short write");
            return;
        }
        p->got[mc->index] = 1;
        p->n_got++;
    }
    Fusion__UploadStatus st = FUSION__UPLOAD_STATUS__INIT;
    st.have = p->n_got;
    st.chunks = p->n_chunks;
    st.model = "";
    (void)broker_reply(b, msg, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, &st.base);
}
