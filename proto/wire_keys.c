#include "wire_keys.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_log.h"

struct wire_keypair {
    uint8_t pk[WIRE_KEY_BYTES];           /* public key */
    uint8_t sk[WIRE_KEY_BYTES];           /* secret key (the whole struct is sodium_malloc'd) */
    char pk_z85[WIRE_KEY_Z85_LEN + 1];    /* public key as text */
};

static wire_keypair_t *kp_alloc(void)
{
    wire_keypair_t *kp = sodium_malloc(sizeof *kp);
    if (kp)
        sodium_memzero(kp, sizeof *kp);
    return kp;
}

void wire_key_to_z85(const uint8_t key[WIRE_KEY_BYTES], char out[WIRE_KEY_Z85_LEN + 1])
{
    if (fu_z85_encode(out, key, WIRE_KEY_BYTES) != FU_OK) /* cannot fail: 32 is a multiple of 4 */
        out[0] = '\0';
}

fu_err wire_key_from_z85(const char *z85, uint8_t out[WIRE_KEY_BYTES])
{
    size_t n = 0;
    if (!z85 || strlen(z85) != WIRE_KEY_Z85_LEN)
        return FU_EINVAL;
    FU_TRY(fu_z85_decode(out, WIRE_KEY_BYTES, z85, &n));
    return n == WIRE_KEY_BYTES ? FU_OK : FU_EINVAL;
}

wire_keypair_t *wire_keypair_from_bytes(const uint8_t pk[WIRE_KEY_BYTES], const uint8_t sk[WIRE_KEY_BYTES])
{
    wire_keypair_t *kp = kp_alloc();
    if (!kp)
        return NULL;
    memcpy(kp->pk, pk, WIRE_KEY_BYTES);
    memcpy(kp->sk, sk, WIRE_KEY_BYTES);
    wire_key_to_z85(kp->pk, kp->pk_z85);
    return kp;
}

wire_keypair_t *wire_keypair_generate(void)
{
    wire_keypair_t *kp = kp_alloc();
    if (!kp)
        return NULL;
    crypto_box_keypair(kp->pk, kp->sk);
    wire_key_to_z85(kp->pk, kp->pk_z85);
    return kp;
}

const uint8_t *wire_keypair_public(const wire_keypair_t *kp)
{
    return kp->pk;
}

const uint8_t *wire_keypair_secret(const wire_keypair_t *kp)
{
    return kp->sk;
}

const char *wire_keypair_public_z85(const wire_keypair_t *kp)
{
    return kp->pk_z85;
}

void wire_keypair_destroy(wire_keypair_t **kp_p)
{
    if (!kp_p || !*kp_p)
        return;
    sodium_free(*kp_p); /* wipes */
    *kp_p = NULL;
}

/* Reads a key file into key. secret: enforce owner-only permissions. */
#define KEYS_MAKE "make keys with: fusion keygen -o DIR" /* what a missing or bad key file needs */

/* Opens a key or token file for reading: no symlink, a regular file; a secret one (what says which
 * kind, for messages) must be this user's and closed to group and others. */
static fu_err open_key_file(const char *path, bool secret, const char *what, const char *make, int *fd_out,
                            fu_errmsg *em)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT)
            return fu_errmsg_set(em, FU_ENOTFOUND, "%s '%s' does not exist (%s)", what, path, make);
        if (e == ELOOP)
            return fu_errmsg_set(em, FU_EPERM, "%s '%s' is a symbolic link; point to the real file", what, path);
        return fu_errmsg_set(em, e == EACCES ? FU_EPERM : FU_EIO, "cannot open %s '%s': %s", what, path,
                             strerror(e));
    }
    struct stat st;
    fu_err rc = FU_OK;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        rc = fu_errmsg_set(em, FU_EPERM, "%s '%s' is not a regular file", what, path);
    else if (secret && (st.st_mode & (S_IRWXG | S_IRWXO)))
        rc = fu_errmsg_set(em, FU_EPERM,
                           "%s '%s' has mode %04o: it is accessible by group or others, so it is refused; fix it "
                           "with: chmod 600 '%s' (and consider it compromised if others could read it)",
                           what, path, (unsigned)(st.st_mode & 07777), path);
    else if (secret && st.st_uid != geteuid())
        rc = fu_errmsg_set(em, FU_EPERM, "%s '%s' is owned by uid %u, not by this user (uid %u); refused", what,
                           path, (unsigned)st.st_uid, (unsigned)geteuid());
    if (rc != FU_OK) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    return FU_OK;
}

/* Reads the 32 bytes a key or token file holds: its first line that is 40 Z85 characters, after
 * '#' comment lines. `what` names the file in messages, `make` says how to make one. */
static fu_err read_key_file(const char *path, bool secret, const char *what, const char *make,
                            uint8_t key[WIRE_KEY_BYTES], fu_errmsg *em)
{
    int fd = -1;
    FU_TRY(open_key_file(path, secret, what, make, &fd, em));
    char buf[1024];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0)
        return fu_errmsg_set(em, FU_EIO, "cannot read key file '%s': %s", path, strerror(errno));
    buf[n] = '\0';
    fu_err rc = FU_EINVAL;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        while (*line == ' ' || *line == '\t')
            line++;
        size_t len = strlen(line);
        while (len && (line[len - 1] == '\r' || line[len - 1] == ' ' || line[len - 1] == '\t'))
            line[--len] = '\0';
        if (len == 0)
            continue;
        /* Z85 uses '#': a line is the key when it is one; otherwise a '#' line is a comment. */
        if (wire_key_from_z85(line, key) == FU_OK) {
            rc = FU_OK;
            break;
        }
        if (line[0] != '#')
            break;
    }
    sodium_memzero(buf, sizeof buf);
    if (rc != FU_OK)
        return fu_errmsg_set(em, rc, "%s '%s' holds no valid key (expected one line of 40 Z85 characters; %s)", what,
                             path, make);
    return FU_OK;
}

fu_err wire_key_load_public(const char *path, uint8_t out[WIRE_KEY_BYTES], fu_errmsg *em)
{
    if (!path || !out)
        return FU_EINVAL;
    return read_key_file(path, false, "key file", KEYS_MAKE, out, em);
}

/* Splits list (comma-separated, no empty item) into at most max copies in out; *n their number. */
static fu_err split_list(const char *list, const char *what, char **out, uint32_t max, uint32_t *n, fu_errmsg *em)
{
    *n = 0;
    for (const char *at = list;; at++) {
        const char *end = strchr(at, ',');
        size_t len = end ? (size_t)(end - at) : strlen(at);
        if (len == 0)
            return fu_errmsg_set(em, FU_EINVAL, "%s '%s' has an empty item", what, list);
        if (*n == max)
            return fu_errmsg_set(em, FU_EINVAL, "%s names more than %u", what, max);
        out[(*n)++] = fu_strndup(at, len);
        if (!end)
            return FU_OK;
        at = end;
    }
}

fu_err wire_endpoints_load(const char *endpoints, const char *key_files, wire_endpoints *out, fu_errmsg *em)
{
    memset(out, 0, sizeof *out);
    if (!endpoints || !key_files)
        return fu_errmsg_set(em, FU_EINVAL, "no broker endpoint or no broker key");
    char *keys[WIRE_MAX_ENDPOINTS] = {0};
    uint32_t n_keys = 0;
    fu_err rc = split_list(endpoints, "--broker", out->ep, WIRE_MAX_ENDPOINTS, &out->n, em);
    if (rc == FU_OK)
        rc = split_list(key_files, "--broker-key", keys, WIRE_MAX_ENDPOINTS, &n_keys, em);
    if (rc == FU_OK && n_keys != 1 && n_keys != out->n)
        rc = fu_errmsg_set(em, FU_EINVAL,
                           "--broker names %u endpoints and --broker-key %u keys: give one key, or one each",
                           out->n, n_keys);
    for (uint32_t i = 0; rc == FU_OK && i < out->n; i++)
        rc = wire_key_load_public(keys[n_keys == 1 ? 0 : i], out->pk[i], em);
    for (uint32_t i = 0; i < n_keys; i++)
        free(keys[i]);
    if (rc != FU_OK)
        wire_endpoints_free(out);
    return rc;
}

void wire_endpoints_free(wire_endpoints *e)
{
    for (uint32_t i = 0; i < e->n; i++)
        free(e->ep[i]);
    memset(e, 0, sizeof *e);
}

fu_err wire_token_load(const char *path, char out[WIRE_TOKEN_Z85_LEN + 1], fu_errmsg *em)
{
    if (!path || !out)
        return FU_EINVAL;
    uint8_t raw[WIRE_KEY_BYTES]; /* a token is 32 bytes in Z85, written like a key */
    FU_TRY(read_key_file(path, true, "enrolment token file", "make one with: fusion keygen --token > FILE", raw,
                         em));
    wire_key_to_z85(raw, out);
    sodium_memzero(raw, sizeof raw);
    return FU_OK;
}

fu_err wire_token_choose(const char *file, const char *given, const char *env, char buf[WIRE_TOKEN_Z85_LEN + 1],
                         const char **token, fu_errmsg *em)
{
    *token = NULL;
    if (file && file[0]) {
        FU_TRY(wire_token_load(file, buf, em));
        *token = buf;
    } else if (given && given[0]) {
        FU_WARN("keys", "the enrolment token was given on the command line, where `ps` shows it to every user of "
                        "this machine: prefer a token file or %s", env);
        *token = given;
    } else {
        const char *v = getenv(env);
        *token = v && v[0] ? v : NULL;
    }
    return FU_OK;
}

fu_err wire_keypair_load(const char *dir, wire_keypair_t **out, fu_errmsg *em)
{
    if (!dir || !out)
        return FU_EINVAL;
    *out = NULL;
    /* Whoever may write the directory may swap the keys in it (a public key that is theirs, so that
     * this program's identity or the broker key it trusts is theirs). */
    struct stat ds;
    if (stat(dir, &ds) == 0 && S_ISDIR(ds.st_mode) && (ds.st_mode & (S_IWGRP | S_IWOTH)))
        return fu_errmsg_set(em, FU_EPERM,
                             "key directory '%s' has mode %04o: group or others may write it, so they could replace "
                             "the keys in it; run: chmod 700 '%s'",
                             dir, (unsigned)(ds.st_mode & 07777), dir);
    char path[4096];
    wire_keypair_t *kp = kp_alloc();
    if (!kp)
        return FU_ENOMEM;
    snprintf(path, sizeof path, "%s/%s", dir, WIRE_SECRET_KEY_FILE);
    fu_err rc = read_key_file(path, true, "secret key file", KEYS_MAKE, kp->sk, em);
    if (rc != FU_OK)
        goto fail;
    snprintf(path, sizeof path, "%s/%s", dir, WIRE_PUBLIC_KEY_FILE);
    if ((rc = read_key_file(path, false, "key file", KEYS_MAKE, kp->pk, em)) != FU_OK)
        goto fail;
    uint8_t derived[WIRE_KEY_BYTES];
    if (crypto_scalarmult_base(derived, kp->sk) != 0 || sodium_memcmp(derived, kp->pk, WIRE_KEY_BYTES) != 0) {
        rc = fu_errmsg_set(
            em, FU_EINVAL,
            "'%s' does not belong to the secret key beside it; make a new pair with fusion keygen", path);
        goto fail;
    }
    wire_key_to_z85(kp->pk, kp->pk_z85);
    *out = kp;
    return FU_OK;
fail:
    wire_keypair_destroy(&kp);
    return rc;
}

/* Writes text to dir/name through a temporary file with the given mode. */
static fu_err write_key_file(const char *dir, const char *name, const char *text, mode_t mode, bool force,
                             fu_errmsg *em)
{
    char tmp[4096], path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp-XXXXXX", dir, name);
    int fd = mkstemp(tmp); /* created 0600 */
    if (fd < 0)
        return fu_errmsg_set(em, FU_EIO, "cannot create a file in '%s': %s", dir, strerror(errno));
    size_t len = strlen(text);
    bool ok = fchmod(fd, mode) == 0 && write(fd, text, len) == (ssize_t)len && fsync(fd) == 0;
    ok = (close(fd) == 0) && ok;
    if (ok) {
        if (force) {
            ok = rename(tmp, path) == 0;
        } else {
            ok = link(tmp, path) == 0; /* fails if the file appeared meanwhile: never overwrite */
            int e = errno;
            unlink(tmp);
            errno = e;
            if (!ok && e == EEXIST)
                return fu_errmsg_set(em, FU_EEXIST,
                                     "'%s' exists; refusing to overwrite a key (use --force to replace it)",
                                     path);
        }
    }
    if (!ok) {
        int e = errno;
        unlink(tmp);
        return fu_errmsg_set(em, FU_EIO, "cannot write '%s': %s", path, strerror(e));
    }
    return FU_OK;
}

fu_err wire_keypair_save(const wire_keypair_t *kp, const char *dir, bool force, fu_errmsg *em)
{
    if (!kp || !dir)
        return FU_EINVAL;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return fu_errmsg_set(em, FU_EIO, "cannot create directory '%s': %s", dir, strerror(errno));
    char path[4096];
    const char *names[2] = {WIRE_SECRET_KEY_FILE, WIRE_PUBLIC_KEY_FILE};
    if (!force) {
        for (int i = 0; i < 2; i++) {
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            struct stat st;
            if (lstat(path, &st) == 0)
                return fu_errmsg_set(em, FU_EEXIST,
                                     "'%s' exists; refusing to overwrite a key (use --force to replace it)",
                                     path);
        }
    }
    char *text = sodium_malloc(256);
    if (!text)
        return FU_ENOMEM;
    char z85[WIRE_KEY_Z85_LEN + 1];
    wire_key_to_z85(kp->sk, z85);
    snprintf(text, 256, "# fusion secret key (X25519, Z85). Keep it private: mode 0600, never share it.\n%s\n", z85);
    sodium_memzero(z85, sizeof z85);
    fu_err rc = write_key_file(dir, WIRE_SECRET_KEY_FILE, text, 0600, force, em);
    sodium_free(text);
    if (rc != FU_OK)
        return rc;
    char pub[256];
    snprintf(pub, sizeof pub, "# fusion public key (X25519, Z85). Share it freely.\n%s\n", kp->pk_z85);
    return write_key_file(dir, WIRE_PUBLIC_KEY_FILE, pub, 0644, force, em);
}

fu_err wire_http_token(const uint8_t own_sk[WIRE_KEY_BYTES], const uint8_t other_pk[WIRE_KEY_BYTES],
                       const uint8_t broker_pk[WIRE_KEY_BYTES], const uint8_t client_pk[WIRE_KEY_BYTES],
                       char out[WIRE_HTTP_TOKEN_LEN + 1])
{
    static const char label[] = "fusion-http-v1";
    uint8_t shared[crypto_scalarmult_BYTES], mac[WIRE_KEY_BYTES];
    if (crypto_scalarmult(shared, own_sk, other_pk) != 0)
        return FU_EAUTH;
    crypto_generichash_state st;
    crypto_generichash_init(&st, shared, sizeof shared, sizeof mac);
    crypto_generichash_update(&st, (const uint8_t *)label, sizeof label - 1);
    crypto_generichash_update(&st, broker_pk, WIRE_KEY_BYTES);
    crypto_generichash_update(&st, client_pk, WIRE_KEY_BYTES);
    crypto_generichash_final(&st, mac, sizeof mac);
    sodium_memzero(shared, sizeof shared);
    sodium_memzero(&st, sizeof st);
    fu_hex_encode(out, client_pk, WIRE_KEY_BYTES);
    fu_hex_encode(out + 2 * WIRE_KEY_BYTES, mac, sizeof mac);
    out[WIRE_HTTP_TOKEN_LEN] = '\0';
    return FU_OK;
}
