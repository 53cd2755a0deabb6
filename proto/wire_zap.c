#include "wire_zap.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <zmq.h>

#include "fu_alloc.h"
#include "fu_log.h"
#include "wire_socket.h"

struct wire_zap {
    void *ctx;                          /* borrowed ZeroMQ context */
    void *rep;                          /* REP on inproc://zeromq.zap.01; owned by the actor thread */
    void *pipe_main;                    /* PAIR: destroy() sends the stop word on it */
    void *pipe_actor;                   /* PAIR: owned by the actor thread */
    pthread_t thread;
    bool started;
    char domain[256];
    char *allow_file;                   /* NULL = no file */
    pthread_mutex_t mu;                 /* guards keys, n_keys, cap_keys, counters, the file */
    uint8_t (*keys)[WIRE_KEY_BYTES];
    size_t n_keys, cap_keys;
    bool enrol_enabled;
    uint8_t *token_hash;                /* BLAKE2b-256 of the token, sodium_malloc'd */
    wire_zap_counters counters;
};

void wire_token_generate(char out[WIRE_KEY_Z85_LEN + 1])
{
    uint8_t t[WIRE_TOKEN_BYTES];
    randombytes_buf(t, sizeof t);
    wire_key_to_z85(t, out);
    sodium_memzero(t, sizeof t);
}

fu_err wire_allow_list_load(const char *path, uint8_t (**keys)[WIRE_KEY_BYTES], size_t *n, fu_errmsg *em)
{
    if (!path || !keys || !n)
        return FU_EINVAL;
    *keys = NULL;
    *n = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        int e = errno;
        return fu_errmsg_set(em, e == ENOENT ? FU_ENOTFOUND : FU_EIO, "cannot open allow-list '%s': %s", path,
                             strerror(e));
    }
    size_t cap = 0, count = 0, lineno = 0;
    uint8_t (*arr)[WIRE_KEY_BYTES] = NULL;
    char line[512];
    fu_err rc = FU_OK;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        if (len == sizeof line - 1 && line[len - 1] != '\n') {
            rc = fu_errmsg_set(em, FU_EINVAL, "allow-list '%s' line %zu is too long", path, lineno);
            break;
        }
        /* Z85 uses '#', so a comment is a line starting with '#' that is not itself a key; after a
         * key, whitespace and then '#' start a trailing comment. */
        char *s = line;
        while (*s == ' ' || *s == '\t')
            s++;
        size_t tok = strcspn(s, " \t\r\n");
        char *rest = s + tok;
        while (*rest == ' ' || *rest == '\t' || *rest == '\r' || *rest == '\n')
            rest++;
        if (tok == 0)
            continue; /* blank line */
        char saved = s[tok];
        s[tok] = '\0';
        uint8_t key[WIRE_KEY_BYTES];
        bool is_key = wire_key_from_z85(s, key) == FU_OK;
        s[tok] = saved;
        if (!is_key && s[0] == '#')
            continue;
        if (!is_key || (*rest && *rest != '#')) {
            rc = fu_errmsg_set(em, FU_EINVAL,
                               "allow-list '%s' line %zu is not a Z85 public key (40 characters)", path,
                               lineno);
            break;
        }
        if (count == WIRE_ALLOW_MAX_KEYS) {
            rc = fu_errmsg_set(em, FU_EINVAL, "allow-list '%s' has more than %u keys", path,
                               WIRE_ALLOW_MAX_KEYS);
            break;
        }
        if (count == cap) {
            cap = cap ? cap * 2 : 16;
            arr = fu_realloc(arr, cap * sizeof *arr);
        }
        memcpy(arr[count], key, WIRE_KEY_BYTES);
        count++;
    }
    if (rc == FU_OK && ferror(f))
        rc = fu_errmsg_set(em, FU_EIO, "cannot read allow-list '%s'", path);
    fclose(f);
    if (rc != FU_OK) {
        free(arr);
        return rc;
    }
    *keys = arr;
    *n = count;
    return FU_OK;
}

/* Caller holds mu. */
static bool find_key(const wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    for (size_t i = 0; i < zap->n_keys; i++)
        if (sodium_memcmp(zap->keys[i], key, WIRE_KEY_BYTES) == 0)
            return true;
    return false;
}

/* Caller holds mu. */
static void add_key(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    if (find_key(zap, key))
        return;
    if (zap->n_keys == zap->cap_keys) {
        zap->cap_keys = zap->cap_keys ? zap->cap_keys * 2 : 16;
        zap->keys = fu_realloc(zap->keys, zap->cap_keys * sizeof *zap->keys);
    }
    memcpy(zap->keys[zap->n_keys++], key, WIRE_KEY_BYTES);
}

/* ---------- the actor ---------- */

static void send_str(void *s, const char *str, int more)
{
    zmq_send(s, str, strlen(str), more ? ZMQ_SNDMORE : 0);
}

/* Reply frames: version, request id, status code, status text, user id, metadata. */
static void zap_reply(void *rep, zmq_msg_t *req_id, const char *code, const char *text, const char *user,
                      const char *admission)
{
    send_str(rep, "1.0", 1);
    zmq_send(rep, req_id ? zmq_msg_data(req_id) : "", req_id ? zmq_msg_size(req_id) : 0, ZMQ_SNDMORE);
    send_str(rep, code, 1);
    send_str(rep, text, 1);
    send_str(rep, user, 1);
    if (admission) {
        /* ZMTP metadata: name length (1 byte), name, value length (4 bytes, big-endian), value. */
        static const char name[] = "X-Fusion-Admission";
        uint8_t meta[64];
        size_t nl = sizeof name - 1, vl = strlen(admission), o = 0;
        meta[o++] = (uint8_t)nl;
        memcpy(meta + o, name, nl);
        o += nl;
        meta[o++] = 0, meta[o++] = 0, meta[o++] = 0, meta[o++] = (uint8_t)vl;
        memcpy(meta + o, admission, vl);
        o += vl;
        zmq_send(rep, meta, o, 0);
    } else {
        zmq_send(rep, "", 0, 0);
    }
}

#define ZAP_FRAMES 7 /* version, request id, domain, address, identity, mechanism, credentials */

static void handle_request(wire_zap_t *zap)
{
    zmq_msg_t f[ZAP_FRAMES + 1];
    size_t n = 0;
    int more = 1;
    while (more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, zap->rep, 0) < 0) {
            zmq_msg_close(&part);
            break;
        }
        more = zmq_msg_more(&part);
        if (n < ZAP_FRAMES + 1)
            f[n++] = part;
        else
            zmq_msg_close(&part);
    }
    if (n == 0)
        return;
    const char *code = "400", *text = "refused";
    const char *admission = NULL;
    char user[WIRE_KEY_Z85_LEN + 1] = "";
    if (n == ZAP_FRAMES && zmq_msg_size(&f[0]) == 3 && memcmp(zmq_msg_data(&f[0]), "1.0", 3) == 0 &&
        zmq_msg_size(&f[2]) == strlen(zap->domain) && memcmp(zmq_msg_data(&f[2]), zap->domain, strlen(zap->domain)) == 0 &&
        zmq_msg_size(&f[5]) == 5 && memcmp(zmq_msg_data(&f[5]), "CURVE", 5) == 0 &&
        zmq_msg_size(&f[6]) == WIRE_KEY_BYTES) {
        const uint8_t *key = zmq_msg_data(&f[6]);
        wire_key_to_z85(key, user);
        pthread_mutex_lock(&zap->mu);
        if (find_key(zap, key)) {
            code = "200", text = "OK", admission = WIRE_ADMIT_MEMBER;
            zap->counters.admitted++;
        } else if (zap->enrol_enabled) {
            code = "200", text = "OK, enrol first", admission = WIRE_ADMIT_ENROLLING;
            zap->counters.enrolling++;
        } else {
            text = "key not on the allow-list";
            zap->counters.refused++;
        }
        pthread_mutex_unlock(&zap->mu);
    } else {
        pthread_mutex_lock(&zap->mu);
        zap->counters.refused++;
        pthread_mutex_unlock(&zap->mu);
        text = "unsupported request, domain or mechanism";
    }
    if (code[0] != '2')
        user[0] = '\0';
    FU_DEBUG("wire", "zap: %s %s (%s)", code, user[0] ? user : "-", text);
    zap_reply(zap->rep, n >= 2 ? &f[1] : NULL, code, text, user, admission);
    for (size_t i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
}

static void *zap_actor(void *arg)
{
    wire_zap_t *zap = arg;
    for (;;) {
        zmq_pollitem_t items[2] = {{zap->pipe_actor, 0, ZMQ_POLLIN, 0}, {zap->rep, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, -1) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            break;
        }
        if (items[0].revents & ZMQ_POLLIN)
            break; /* the stop word */
        if (items[1].revents & ZMQ_POLLIN)
            handle_request(zap);
    }
    return NULL;
}

wire_zap_t *wire_zap_new(void *ctx, const wire_zap_cfg *cfg, fu_err *err, fu_errmsg *em)
{
    fu_err rc = FU_EINVAL;
    if (!ctx || !cfg) {
        rc = fu_errmsg_set(em, rc, "wire_zap_new: no context or configuration");
        if (err)
            *err = rc;
        return NULL;
    }
    wire_zap_t *zap = fu_calloc(1, sizeof *zap);
    pthread_mutex_init(&zap->mu, NULL);
    zap->ctx = ctx;
    snprintf(zap->domain, sizeof zap->domain, "%s", cfg->domain ? cfg->domain : WIRE_ZAP_DOMAIN);
    if (cfg->allow_file) {
        zap->allow_file = fu_strdup(cfg->allow_file);
        size_t n = 0;
        rc = wire_allow_list_load(cfg->allow_file, &zap->keys, &n, em);
        if (rc == FU_ENOTFOUND) {
            rc = FU_OK;
        } else if (rc != FU_OK) {
            goto fail;
        }
        zap->n_keys = zap->cap_keys = n;
    }
    if (cfg->enrol_token && cfg->enrol_token[0]) {
        uint8_t tok[WIRE_KEY_BYTES];
        if (wire_key_from_z85(cfg->enrol_token, tok) != FU_OK) {
            rc = fu_errmsg_set(
                em, FU_EINVAL,
                "the enrolment token is not 40 Z85 characters (make one with fusion keygen --token)");
            goto fail;
        }
        zap->token_hash = sodium_malloc(crypto_generichash_BYTES);
        if (!zap->token_hash) {
            rc = FU_ENOMEM;
            goto fail;
        }
        crypto_generichash(zap->token_hash, crypto_generichash_BYTES, tok, sizeof tok, NULL, 0);
        sodium_memzero(tok, sizeof tok);
        zap->enrol_enabled = true;
    }
    zap->rep = zmq_socket(ctx, ZMQ_REP);
    zap->pipe_main = zmq_socket(ctx, ZMQ_PAIR);
    zap->pipe_actor = zmq_socket(ctx, ZMQ_PAIR);
    if (!zap->rep || !zap->pipe_main || !zap->pipe_actor) {
        rc = fu_errmsg_set(em, FU_EIO, "cannot make ZAP sockets: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int linger = 0;
    zmq_setsockopt(zap->rep, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(zap->pipe_main, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(zap->pipe_actor, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(zap->rep, WIRE_ZAP_ENDPOINT) != 0) {
        int e = zmq_errno();
        rc = fu_errmsg_set(em, e == EADDRINUSE ? FU_EEXIST : FU_EIO, "cannot bind the ZAP handler at %s: %s",
                           WIRE_ZAP_ENDPOINT, zmq_strerror(e));
        goto fail;
    }
    char pipe_ep[64];
    snprintf(pipe_ep, sizeof pipe_ep, "inproc://fusion-zap-pipe-%p", (void *)zap);
    if (zmq_bind(zap->pipe_actor, pipe_ep) != 0 || zmq_connect(zap->pipe_main, pipe_ep) != 0) {
        rc = fu_errmsg_set(em, FU_EIO, "cannot make the ZAP handler's pipe: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    /* The sockets move to the actor thread; pthread_create is the full memory barrier libzmq asks for. */
    if (pthread_create(&zap->thread, NULL, zap_actor, zap) != 0) {
        rc = fu_errmsg_set(em, FU_EIO, "cannot start the ZAP handler thread");
        goto fail;
    }
    zap->started = true;
    if (err)
        *err = FU_OK;
    return zap;
fail:
    wire_zap_destroy(&zap);
    if (err)
        *err = rc;
    return NULL;
}

void wire_zap_destroy(wire_zap_t **zap_p)
{
    if (!zap_p || !*zap_p)
        return;
    wire_zap_t *zap = *zap_p;
    if (zap->started) {
        zmq_send(zap->pipe_main, "$TERM", 5, 0);
        pthread_join(zap->thread, NULL);
    }
    if (zap->rep)
        zmq_close(zap->rep);
    if (zap->pipe_main)
        zmq_close(zap->pipe_main);
    if (zap->pipe_actor)
        zmq_close(zap->pipe_actor);
    if (zap->token_hash)
        sodium_free(zap->token_hash);
    free(zap->keys);
    free(zap->allow_file);
    pthread_mutex_destroy(&zap->mu);
    free(zap);
    *zap_p = NULL;
}

/* Caller holds mu. */
static fu_err append_to_file(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    if (!zap->allow_file)
        return FU_OK;
    FILE *f = fopen(zap->allow_file, "a");
    if (!f)
        return FU_EIO;
    char z85[WIRE_KEY_Z85_LEN + 1];
    wire_key_to_z85(key, z85);
    bool ok = fprintf(f, "%s\n", z85) > 0;
    ok = fclose(f) == 0 && ok;
    return ok ? FU_OK : FU_EIO;
}

fu_err wire_zap_allow(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    if (!zap || !key)
        return FU_EINVAL;
    pthread_mutex_lock(&zap->mu);
    fu_err rc = FU_OK;
    if (!find_key(zap, key)) {
        add_key(zap, key);
        rc = append_to_file(zap, key);
    }
    pthread_mutex_unlock(&zap->mu);
    return rc;
}

void wire_zap_deny(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    if (!zap || !key)
        return;
    pthread_mutex_lock(&zap->mu);
    for (size_t i = 0; i < zap->n_keys; i++) {
        if (sodium_memcmp(zap->keys[i], key, WIRE_KEY_BYTES) == 0) {
            memmove(zap->keys[i], zap->keys[i + 1], (zap->n_keys - i - 1) * WIRE_KEY_BYTES);
            zap->n_keys--;
            break;
        }
    }
    pthread_mutex_unlock(&zap->mu);
}

bool wire_zap_is_member(wire_zap_t *zap, const char *z85)
{
    uint8_t key[WIRE_KEY_BYTES];
    if (!zap || wire_key_from_z85(z85, key) != FU_OK)
        return false;
    pthread_mutex_lock(&zap->mu);
    bool found = find_key(zap, key);
    pthread_mutex_unlock(&zap->mu);
    return found;
}

bool wire_zap_msg_is_member(wire_zap_t *zap, const wire_msg_t *msg)
{
    if (!msg)
        return false;
    /* The live list decides, not the connection's admission metadata: a key may have enrolled (or
     * been denied) since its connection was admitted. */
    return wire_zap_is_member(zap, wire_msg_user_id(msg));
}

fu_err wire_zap_enrol(wire_zap_t *zap, const char *user_id, const char *token)
{
    uint8_t key[WIRE_KEY_BYTES];
    if (!zap || wire_key_from_z85(user_id, key) != FU_OK)
        return FU_EINVAL;
    uint8_t h[crypto_generichash_BYTES];
    /* Hash whatever was presented, so the comparison takes the same time for any length. */
    const char *t = token ? token : "";
    uint8_t tok[WIRE_KEY_BYTES];
    bool well_formed = wire_key_from_z85(t, tok) == FU_OK;
    if (well_formed)
        crypto_generichash(h, sizeof h, tok, sizeof tok, NULL, 0);
    else
        crypto_generichash(h, sizeof h, (const uint8_t *)t, strlen(t), NULL, 0);
    sodium_memzero(tok, sizeof tok);
    pthread_mutex_lock(&zap->mu);
    bool ok = zap->enrol_enabled && well_formed && sodium_memcmp(h, zap->token_hash, sizeof h) == 0;
    fu_err rc = FU_EAUTH;
    if (ok) {
        rc = FU_OK;
        if (!find_key(zap, key)) {
            add_key(zap, key);
            rc = append_to_file(zap, key);
        }
        zap->counters.enrolled++;
    } else {
        zap->counters.bad_tokens++;
    }
    pthread_mutex_unlock(&zap->mu);
    return rc;
}

void wire_zap_get_counters(wire_zap_t *zap, wire_zap_counters *out)
{
    pthread_mutex_lock(&zap->mu);
    *out = zap->counters;
    pthread_mutex_unlock(&zap->mu);
}
