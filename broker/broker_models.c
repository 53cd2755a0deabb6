/* broker_models: the model cache, by content (see broker_models.h). */
#include "broker_models.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_file.h"
#include "fu_log.h"
#include "fu_modelcfg.h"
#include "fu_tokenizer.h"

#define LOG "models"
#define SALR_FILE "salr_config.json"   /* dag_model.h DAG_SALR_CONFIG_FILE (broker_models sits below dag) */
#define SALR_MAX_BYTES (1u << 16)
#define DIR_MAX_ENTRIES 65536          /* files in one model directory */

typedef struct {
    broker_model *m;
    char *dir;                         /* resolved directory */
    uint8_t sig[BROKER_MODEL_HASH_LEN]; /* what the directory's files looked like when m was hashed */
    uint64_t used;                     /* last use (cache tick) */
} entry;

/* Hashes remembered from an earlier run (broker_models_known). */
typedef struct {
    char *dir;
    uint8_t sig[BROKER_MODEL_HASH_LEN];
    char id[BROKER_MODEL_ID_LEN + 1];
    uint8_t (*hashes)[BROKER_MODEL_HASH_LEN];
    size_t n;
} known;

struct broker_models {
    pthread_mutex_t mu;                /* guards everything below and every model's 0 -> 1 reference */
    char *roots[BROKER_MODEL_ROOTS_MAX]; /* resolved */
    size_t n_roots;
    size_t keep;                       /* unreferenced models kept mapped */
    entry *e;
    size_t n, cap;
    uint64_t tick;
    known *k;                          /* remembered hashes */
    size_t n_k;
};

/* ---------- pages ---------- */

void broker_model_drop_pages(const void *p, size_t n)
{
    long ps = sysconf(_SC_PAGESIZE);
    if (ps <= 0 || !p || !n)
        return;
    uintptr_t lo = ((uintptr_t)p + (uintptr_t)ps - 1) & ~((uintptr_t)ps - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~((uintptr_t)ps - 1);
    if (hi > lo) /* a read-only file mapping: the pages come back from the page cache on the next read */
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* ---------- the cache ---------- */

broker_models *broker_models_new(const char *const *roots, size_t n_roots, size_t keep, fu_errmsg *em)
{
    if (n_roots > BROKER_MODEL_ROOTS_MAX) {
        fu_errmsg_set(em, FU_EINVAL, "at most %d model roots", BROKER_MODEL_ROOTS_MAX);
        return NULL;
    }
    broker_models *c = fu_calloc(1, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    c->keep = keep ? keep : BROKER_MODELS_KEEP;
    for (size_t i = 0; i < n_roots; i++) {
        char *rp = realpath(roots[i], NULL);
        if (!rp || !fu_path_is_dir(rp)) {
            fu_errmsg_set(em, FU_ENOTFOUND, "--model-root '%s' is not an existing directory", roots[i]);
            free(rp);
            broker_models_free(&c);
            return NULL;
        }
        c->roots[c->n_roots++] = rp;
    }
    return c;
}

static void model_free(broker_model *m)
{
    if (!m)
        return;
    fu_safetensors_close(&m->st);
    free(m->hashes);
    free(m->config);
    free(m->salr);
    free(m->tokenizer);
    free(m->tok_config);
    free(m->dir);
    free(m);
}

void broker_models_free(broker_models **cp)
{
    if (!cp || !*cp)
        return;
    broker_models *c = *cp;
    for (size_t i = 0; i < c->n; i++) {
        model_free(c->e[i].m);
        free(c->e[i].dir);
    }
    free(c->e);
    for (size_t i = 0; i < c->n_k; i++) {
        free(c->k[i].dir);
        free(c->k[i].hashes);
    }
    free(c->k);
    for (size_t i = 0; i < c->n_roots; i++)
        free(c->roots[i]);
    pthread_mutex_destroy(&c->mu);
    free(c);
    *cp = NULL;
}

void broker_model_release(broker_model **m)
{
    if (!m || !*m)
        return;
    atomic_fetch_sub(&(*m)->refs, 1);
    *m = NULL;
}

/* Unmaps the least recently used unreferenced models beyond keep. Called with the lock held. */
static void trim(broker_models *c)
{
    for (;;) {
        size_t idle = 0, oldest = c->n;
        for (size_t i = 0; i < c->n; i++)
            if (atomic_load(&c->e[i].m->refs) == 0) {
                idle++;
                if (oldest == c->n || c->e[i].used < c->e[oldest].used)
                    oldest = i;
            }
        if (idle <= c->keep)
            return;
        FU_INFO(LOG, "unmapped model %s (%.18s...): unused", c->e[oldest].dir, c->e[oldest].m->id);
        model_free(c->e[oldest].m);
        free(c->e[oldest].dir);
        c->e[oldest] = c->e[--c->n];
    }
}

/* ---------- names ---------- */

static bool inside(const char *path, const char *root)
{
    size_t n = strlen(root);
    if (strncmp(path, root, n) != 0)
        return false;
    return path[n] == '\0' || path[n] == '/' || (n == 1 && root[0] == '/');
}

static bool inside_any(const broker_models *c, const char *path)
{
    for (size_t i = 0; i < c->n_roots; i++)
        if (inside(path, c->roots[i]))
            return true;
    return false;
}

/* The resolved directory of `name`, or NULL: not under the roots (whether it exists or not). */
static char *resolve(const broker_models *c, const char *name)
{
    if (!name[0] || strlen(name) >= PATH_MAX)
        return NULL;
    for (size_t i = 0; i < c->n_roots; i++) {
        char *p = name[0] == '/' ? fu_strdup(name) : fu_path_join(c->roots[i], name);
        char *rp = realpath(p, NULL);
        free(p);
        bool ok = rp && (name[0] == '/' ? inside_any(c, rp) : inside(rp, c->roots[i])) && fu_path_is_dir(rp);
        if (ok)
            return rp;
        free(rp);
        if (name[0] == '/')
            break;
    }
    return NULL;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void hash_bytes(crypto_generichash_state *h, const void *p, size_t n)
{
    uint64_t len = n;
    crypto_generichash_update(h, (const uint8_t *)&len, sizeof len);
    crypto_generichash_update(h, p, n);
}

/* The directory's signature (every entry's name, inode, size and times, in name order), refusing a
 * link that leaves the roots. */
static fu_err scan(const broker_models *c, const char *name, const char *dir, uint8_t sig[BROKER_MODEL_HASH_LEN],
                   fu_errmsg *em)
{
    DIR *d = opendir(dir);
    if (!d)
        return fu_errmsg_set(em, FU_ENOTFOUND, "model '%s' not found under the broker's model roots", name);
    char **names = NULL;
    size_t n = 0, cap = 0;
    fu_err rc = FU_OK;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        if (n == DIR_MAX_ENTRIES) {
            rc = fu_errmsg_set(em, FU_EINVAL, "model '%s' has more than %d files", name, DIR_MAX_ENTRIES);
            break;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            names = fu_realloc(names, cap * sizeof *names);
        }
        names[n++] = fu_strdup(de->d_name);
    }
    closedir(d);
    if (n)
        qsort(names, n, sizeof *names, cmp_str);
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, BROKER_MODEL_HASH_LEN);
    for (size_t i = 0; i < n && rc == FU_OK; i++) {
        char *p = fu_path_join(dir, names[i]);
        struct stat ls, st;
        if (lstat(p, &ls) == 0 && S_ISLNK(ls.st_mode)) {
            char *rp = realpath(p, NULL);
            if (rp && !inside_any(c, rp)) /* a dangling link is harmless: nothing can be read through it */
                rc = fu_errmsg_set(em, FU_EPERM,
                                   "model '%s' is refused: its '%s' is a link that leaves the broker's model roots",
                                   name, names[i]);
            free(rp);
        }
        if (rc == FU_OK && stat(p, &st) == 0) {
            int64_t f[7] = {(int64_t)st.st_dev,         (int64_t)st.st_ino,         (int64_t)st.st_size,
                            (int64_t)st.st_mtim.tv_sec, (int64_t)st.st_mtim.tv_nsec, (int64_t)st.st_ctim.tv_sec,
                            (int64_t)st.st_ctim.tv_nsec};
            hash_bytes(&h, names[i], strlen(names[i]));
            crypto_generichash_update(&h, (const uint8_t *)f, sizeof f);
        }
        free(p);
    }
    crypto_generichash_final(&h, sig, BROKER_MODEL_HASH_LEN);
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    return rc;
}

/* ---------- loading ---------- */

/* Reads dir/file (at most max bytes) into *out; missing: *out NULL and FU_OK unless required. */
static fu_err read_small(const char *name, const char *dir, const char *file, size_t max, bool required, char **out,
                         size_t *len, fu_errmsg *em)
{
    char *p = fu_path_join(dir, file);
    fu_errmsg sub = {{0}};
    fu_err rc = fu_file_read_all(p, max, out, len, &sub);
    free(p);
    if (rc == FU_ENOTFOUND && !required) {
        *out = NULL;
        *len = 0;
        return FU_OK;
    }
    if (rc == FU_ENOTFOUND)
        return fu_errmsg_set(em, FU_ENOTFOUND, "model '%s' has no %s (not a Hugging Face model directory)", name,
                             file);
    if (rc != FU_OK) {
        FU_WARN(LOG, "model %s: %s", dir, fu_errmsg_text(&sub, rc));
        return fu_errmsg_set(em, FU_EPROTO, "model '%s': its %s cannot be read (the broker's log says why)", name,
                             file);
    }
    return FU_OK;
}

/* Opens dir (as `name` to the caller) and computes its id; with k, takes the tensor hashes from k
 * when the tensors are the ones k counted (the id then checks the small files and the names). */
static fu_err load(const char *name, const char *dir, const known *k, broker_model **out, fu_errmsg *em)
{
    broker_model *m = fu_calloc(1, sizeof *m);
    m->dir = fu_strdup(dir);
    fu_err rc = read_small(name, dir, FU_MODELCFG_FILE, FU_MODELCFG_MAX_BYTES, true, &m->config, &m->config_len, em);
    if (rc == FU_OK)
        rc = read_small(name, dir, SALR_FILE, SALR_MAX_BYTES, false, &m->salr, &m->salr_len, em);
    if (rc == FU_OK)
        rc = read_small(name, dir, FU_TOKENIZER_FILE, FU_TOKENIZER_MAX_BYTES, false, &m->tokenizer, &m->tokenizer_len,
                        em);
    if (rc == FU_OK)
        rc = read_small(name, dir, FU_TOKENIZER_CONFIG_FILE, FU_TOKENIZER_MAX_BYTES, false, &m->tok_config,
                        &m->tok_config_len, em);
    fu_errmsg sub = {{0}};
    if (rc == FU_OK && (rc = fu_safetensors_open_dir(dir, &m->st, &sub)) != FU_OK) {
        /* the parser's words may quote the file (a "header length" is its first 8 bytes): log them only */
        FU_WARN(LOG, "model %s: %s", dir, fu_errmsg_text(&sub, rc));
        rc = rc == FU_ENOTFOUND
                 ? fu_errmsg_set(em, FU_ENOTFOUND, "model '%s' has no %s or %s", name, FU_ST_SINGLE_FILE,
                                 FU_ST_INDEX_FILE)
                 : fu_errmsg_set(em, FU_EPROTO,
                                 "model '%s': its weights are not valid safetensors (the broker's log says why)", name);
    }
    if (rc != FU_OK) {
        model_free(m);
        return rc;
    }
    size_t n = fu_safetensors_count(m->st);
    if (k && k->n != n)
        k = NULL;
    m->hashes = fu_calloc(n ? n : 1, sizeof *m->hashes);
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, BROKER_MODEL_HASH_LEN);
    static const char magic[] = "fusion-model-v1";
    crypto_generichash_update(&h, (const uint8_t *)magic, sizeof magic);
    const char *files[3] = {m->config, m->salr, m->tokenizer};
    const size_t lens[3] = {m->config_len, m->salr_len, m->tokenizer_len};
    for (size_t f = 0; f < 3; f++) {
        uint8_t present = files[f] != NULL;
        crypto_generichash_update(&h, &present, 1);
        if (present)
            hash_bytes(&h, files[f], lens[f]);
    }
    for (size_t i = 0; i < n; i++) { /* name order */
        const fu_st_tensor *t = fu_safetensors_at(m->st, i);
        if (k) {
            memcpy(m->hashes[i], k->hashes[i], BROKER_MODEL_HASH_LEN);
        } else {
            crypto_generichash(m->hashes[i], BROKER_MODEL_HASH_LEN, t->data, t->nbytes, NULL, 0);
            broker_model_drop_pages(t->data, t->nbytes);
        }
        m->bytes += t->nbytes;
        int64_t meta[1 + FU_ST_MAX_DIMS] = {(int64_t)t->dtype};
        for (size_t d = 0; d < t->ndim; d++)
            meta[1 + d] = (int64_t)t->shape[d];
        hash_bytes(&h, t->name, strlen(t->name));
        hash_bytes(&h, meta, (1 + t->ndim) * sizeof *meta);
        crypto_generichash_update(&h, m->hashes[i], BROKER_MODEL_HASH_LEN);
    }
    uint8_t digest[BROKER_MODEL_HASH_LEN];
    crypto_generichash_final(&h, digest, sizeof digest);
    memcpy(m->id, "m:", 2);
    fu_hex_encode(m->id + 2, digest, sizeof digest);
    if (k && strcmp(m->id, k->id) != 0) { /* the remembered hashes were not this content's: all of it */
        FU_WARN(LOG, "model %s: its remembered hashes do not match its files; hashing it again", dir);
        model_free(m);
        return load(name, dir, NULL, out, em);
    }
    *out = m;
    return FU_OK;
}

void broker_models_known(broker_models *c, const char *dir, const uint8_t sig[BROKER_MODEL_HASH_LEN],
                         const char *id, const uint8_t *hashes, size_t n_tensors)
{
    if (strlen(id) != BROKER_MODEL_ID_LEN || !n_tensors)
        return;
    pthread_mutex_lock(&c->mu);
    c->k = fu_realloc(c->k, (c->n_k + 1) * sizeof *c->k);
    known *k = &c->k[c->n_k++];
    k->dir = fu_strdup(dir);
    memcpy(k->sig, sig, BROKER_MODEL_HASH_LEN);
    snprintf(k->id, sizeof k->id, "%s", id);
    k->hashes = fu_malloc(n_tensors * sizeof *k->hashes);
    memcpy(k->hashes, hashes, n_tensors * sizeof *k->hashes);
    k->n = n_tensors;
    pthread_mutex_unlock(&c->mu);
}

fu_err broker_models_open(broker_models *c, const char *name, broker_model **out, fu_errmsg *em)
{
    *out = NULL;
    if (!c->n_roots)
        return fu_errmsg_set(em, FU_EINVAL,
                             "this broker serves no models: its operator starts it with --model-root DIR");
    char *dir = resolve(c, name);
    if (!dir)
        return fu_errmsg_set(em, FU_ENOTFOUND,
                             "model '%s' not found under the broker's model roots (name a directory inside one)", name);
    uint8_t sig[BROKER_MODEL_HASH_LEN];
    fu_err rc = scan(c, name, dir, sig, em);
    if (rc != FU_OK) {
        free(dir);
        return rc;
    }
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n && !*out; i++)
        if (strcmp(c->e[i].dir, dir) == 0 && memcmp(c->e[i].sig, sig, sizeof sig) == 0) {
            *out = c->e[i].m;
            atomic_fetch_add(&(*out)->refs, 1);
            c->e[i].used = ++c->tick;
        }
    pthread_mutex_unlock(&c->mu);
    if (*out) {
        free(dir);
        return FU_OK;
    }
    uint64_t t0 = fu_clock_ms();
    broker_model *m = NULL;
    pthread_mutex_lock(&c->mu); /* remembered hashes are added before any open (broker_models.h) */
    const known *k = NULL;
    for (size_t i = 0; i < c->n_k && !k; i++)
        if (strcmp(c->k[i].dir, dir) == 0 && memcmp(c->k[i].sig, sig, sizeof sig) == 0)
            k = &c->k[i];
    pthread_mutex_unlock(&c->mu);
    if ((rc = load(name, dir, k, &m, em)) != FU_OK) {
        free(dir);
        return rc;
    }
    memcpy(m->sig, sig, sizeof sig);
    FU_INFO(LOG, "model %s is %.18s... (%zu tensors, %.1f MB %s in %llu ms)", dir, m->id, fu_safetensors_count(m->st),
            (double)m->bytes / 1e6, k && strcmp(m->id, k->id) == 0 ? "known from the store" : "hashed",
            (unsigned long long)(fu_clock_ms() - t0));
    atomic_store(&m->refs, 1);
    pthread_mutex_lock(&c->mu);
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 8;
        c->e = fu_realloc(c->e, c->cap * sizeof *c->e);
    }
    c->e[c->n++] = (entry){.m = m, .dir = dir, .used = ++c->tick};
    memcpy(c->e[c->n - 1].sig, sig, sizeof sig);
    trim(c);
    pthread_mutex_unlock(&c->mu);
    *out = m;
    return FU_OK;
}
