#include "wire_zap.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <zmq.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"
#include "wire_socket.h"

/* An address whose would-be enrollers are refused until a time. */
typedef struct {
    char addr[WIRE_ADDRESS_MAX]; /* "" = free slot */
    uint64_t until_ms;           /* fu_clock_ms time the ban ends */
} zap_ban;

/* A configured enrolment token: only its hash is kept. */
typedef struct {
    uint8_t *hash;  /* BLAKE2b-256 of the token's bytes, sodium_malloc'd */
    uint32_t roles; /* what it grants */
} zap_token;

struct wire_zap {
    void *ctx;                          /* borrowed ZeroMQ context */
    void *rep;                          /* REP on inproc://zeromq.zap.01; owned by the actor thread */
    void *pipe_main;                    /* PAIR: destroy() sends the stop word on it */
    void *pipe_actor;                   /* PAIR: owned by the actor thread */
    pthread_t thread;
    bool started;
    bool bound;                         /* rep holds WIRE_ZAP_ENDPOINT */
    char domain[256];
    bool admit_any;                     /* wire_zap_cfg.admit_any, until wire_zap_mirror */
    bool mirror_enrol;                  /* a mirror: the broker takes enrolment tokens (wire_zap_mirror) */
    char *allow_file;                   /* NULL = no file */
    pthread_mutex_t mu;                 /* guards keys, roles, bans, counters, the file */
    uint8_t (*keys)[WIRE_KEY_BYTES];
    uint32_t *roles;                    /* roles[i]: WIRE_ROLE_* of keys[i] */
    size_t n_keys, cap_keys;
    uint32_t *index;                    /* open-addressing hash of keys: i + 1, 0 empty; a power of two at
                                           least twice n_keys (every message asks for its key's roles) */
    size_t index_cap;
    uint8_t index_key[crypto_shorthash_KEYBYTES]; /* SipHash key: nobody can pick keys that collide */
    zap_token tokens[WIRE_ZAP_TOKENS_MAX];
    size_t n_tokens;                    /* 0: enrolment is off */
    zap_ban *bans;                      /* WIRE_ZAP_BANS_MAX slots, allocated at the first ban */
    wire_zap_counters counters;
};

void wire_token_generate(char out[WIRE_KEY_Z85_LEN + 1])
{
    uint8_t t[WIRE_TOKEN_BYTES];
    randombytes_buf(t, sizeof t);
    wire_key_to_z85(t, out);
    sodium_memzero(t, sizeof t);
}

/* ---------- roles and the allow-list file ---------- */

static const struct {
    const char *name;
    uint32_t bit;
} role_names[] = {
    {"client", WIRE_ROLE_CLIENT},
    {"peer", WIRE_ROLE_PEER},
    {"operator", WIRE_ROLE_OPERATOR},
    {"trusted", WIRE_ROLE_TRUSTED},
    {"gateway", WIRE_ROLE_GATEWAY},
};

#define ROLES_ALL (WIRE_ROLE_CLIENT | WIRE_ROLE_PEER | WIRE_ROLE_OPERATOR | WIRE_ROLE_TRUSTED | WIRE_ROLE_GATEWAY)

const char *wire_roles_text(uint32_t roles, char buf[WIRE_ROLES_TEXT_MAX])
{
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof role_names / sizeof *role_names; i++)
        if (roles & role_names[i].bit) {
            int w = snprintf(buf + o, WIRE_ROLES_TEXT_MAX - o, "%s%s", o ? "," : "", role_names[i].name);
            if (w > 0)
                o += (size_t)w;
        }
    return buf;
}

/* Parses a comma-separated role list s[0..len) into *out; false on an empty or unknown name, whose
 * text goes to bad (cap bytes). */
static bool roles_parse(const char *s, size_t len, uint32_t *out, char *bad, size_t cap)
{
    uint32_t roles = 0;
    size_t i = 0;
    for (;;) {
        size_t n = 0;
        while (i + n < len && s[i + n] != ',')
            n++;
        uint32_t bit = 0;
        for (size_t k = 0; k < sizeof role_names / sizeof *role_names; k++)
            if (n == strlen(role_names[k].name) && memcmp(s + i, role_names[k].name, n) == 0)
                bit = role_names[k].bit;
        if (!bit) {
            snprintf(bad, cap, "%.*s", (int)(n < 32 ? n : 32), s + i);
            return false;
        }
        roles |= bit;
        i += n;
        if (i == len)
            break;
        i++; /* the comma */
    }
    if (roles & WIRE_ROLE_TRUSTED) /* a trusted peer is a peer */
        roles |= WIRE_ROLE_PEER;
    *out = roles;
    return true;
}

fu_err wire_allow_list_load(const char *path, uint8_t (**keys)[WIRE_KEY_BYTES], uint32_t **roles, size_t *n,
                            fu_errmsg *em)
{
    if (!path || !keys || !n)
        return FU_EINVAL;
    *keys = NULL;
    if (roles)
        *roles = NULL;
    *n = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        int e = errno;
        return fu_errmsg_set(em, e == ENOENT ? FU_ENOTFOUND : FU_EIO, "cannot open allow-list '%s': %s", path,
                             strerror(e));
    }
    size_t cap = 0, count = 0, lineno = 0;
    uint8_t (*arr)[WIRE_KEY_BYTES] = NULL;
    uint32_t *rarr = NULL;
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
         * key (and its roles), whitespace and then '#' start a trailing comment. */
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
        if (!is_key) {
            rc = fu_errmsg_set(em, FU_EINVAL,
                               "allow-list '%s' line %zu is not a Z85 public key (40 characters)", path,
                               lineno);
            break;
        }
        uint32_t r = WIRE_ROLES_DEFAULT;
        if (*rest && *rest != '#') {
            size_t rlen = strcspn(rest, " \t\r\n");
            char *after = rest + rlen;
            while (*after == ' ' || *after == '\t' || *after == '\r' || *after == '\n')
                after++;
            char bad[40];
            if (!roles_parse(rest, rlen, &r, bad, sizeof bad)) {
                rc = fu_errmsg_set(em, FU_EINVAL,
                                   "allow-list '%s' line %zu names the unknown role '%s' (roles are client, peer, "
                                   "operator and trusted, separated by commas: KEY client,peer)",
                                   path, lineno, bad);
                break;
            }
            if (*after && *after != '#') {
                rc = fu_errmsg_set(em, FU_EINVAL,
                                   "allow-list '%s' line %zu has more than a key and its roles (write KEY ROLES "
                                   "# comment)",
                                   path, lineno);
                break;
            }
        }
        if (count == WIRE_ALLOW_MAX_KEYS) {
            rc = fu_errmsg_set(em, FU_EINVAL, "allow-list '%s' has more than %u keys", path,
                               WIRE_ALLOW_MAX_KEYS);
            break;
        }
        if (count == cap) {
            cap = cap ? cap * 2 : 16;
            arr = fu_realloc(arr, cap * sizeof *arr);
            rarr = fu_realloc(rarr, cap * sizeof *rarr);
        }
        memcpy(arr[count], key, WIRE_KEY_BYTES);
        rarr[count] = r;
        count++;
    }
    if (rc == FU_OK && ferror(f))
        rc = fu_errmsg_set(em, FU_EIO, "cannot read allow-list '%s'", path);
    fclose(f);
    if (rc != FU_OK) {
        free(arr);
        free(rarr);
        return rc;
    }
    *keys = arr;
    if (roles)
        *roles = rarr;
    else
        free(rarr);
    *n = count;
    return FU_OK;
}

/* The slot where key's probe starts. */
static size_t index_home(const wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    uint8_t h[crypto_shorthash_BYTES];
    crypto_shorthash(h, key, WIRE_KEY_BYTES, zap->index_key);
    uint64_t v;
    memcpy(&v, h, sizeof v);
    return (size_t)v & (zap->index_cap - 1);
}

/* Caller holds mu. */
static void index_put(wire_zap_t *zap, size_t i)
{
    size_t mask = zap->index_cap - 1;
    for (size_t at = index_home(zap, zap->keys[i]);; at = (at + 1) & mask)
        if (!zap->index[at]) {
            zap->index[at] = (uint32_t)(i + 1);
            return;
        }
}

/* Makes the index again over keys[0..n_keys) (after a load or a removal). Caller holds mu. */
static void index_rebuild(wire_zap_t *zap)
{
    size_t cap = 64;
    while (cap < 2 * zap->n_keys)
        cap *= 2;
    free(zap->index);
    zap->index = fu_calloc(cap, sizeof *zap->index);
    zap->index_cap = cap;
    for (size_t i = 0; i < zap->n_keys; i++)
        index_put(zap, i);
}

/* The roles of key: those of every entry that holds it (a key enrolled again, or listed twice,
 * has one entry per line; each is in the index). 0 when it is not a member. Caller holds mu. */
static uint32_t roles_of(const wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    uint32_t roles = 0;
    if (!zap->index_cap)
        return 0;
    size_t mask = zap->index_cap - 1;
    for (size_t at = index_home(zap, key); zap->index[at]; at = (at + 1) & mask) {
        size_t i = zap->index[at] - 1;
        if (sodium_memcmp(zap->keys[i], key, WIRE_KEY_BYTES) == 0)
            roles |= zap->roles[i];
    }
    return roles;
}

/* Caller holds mu. */
static void add_key(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES], uint32_t roles)
{
    if (zap->n_keys == zap->cap_keys) {
        zap->cap_keys = zap->cap_keys ? zap->cap_keys * 2 : 16;
        zap->keys = fu_realloc(zap->keys, zap->cap_keys * sizeof *zap->keys);
        zap->roles = fu_realloc(zap->roles, zap->cap_keys * sizeof *zap->roles);
    }
    memcpy(zap->keys[zap->n_keys], key, WIRE_KEY_BYTES);
    zap->roles[zap->n_keys++] = roles;
    if (zap->index_cap < 2 * zap->n_keys)
        index_rebuild(zap);
    else
        index_put(zap, zap->n_keys - 1);
}

/* Whether a stranger may connect to enrol: tokens are configured, or the broker a mirror follows
 * takes them. Caller holds mu. */
static bool enrol_open(const wire_zap_t *zap)
{
    return zap->n_tokens || zap->mirror_enrol;
}

/* Whether addr is banned now. Caller holds mu. */
static bool is_banned(const wire_zap_t *zap, const char *addr, uint64_t now)
{
    if (!zap->bans)
        return false;
    for (size_t i = 0; i < WIRE_ZAP_BANS_MAX; i++)
        if (zap->bans[i].addr[0] && zap->bans[i].until_ms > now && strcmp(zap->bans[i].addr, addr) == 0)
            return true;
    return false;
}

/* ---------- the actor ---------- */

static bool frame_is(zmq_msg_t *f, const char *text)
{
    size_t n = strlen(text);
    return zmq_msg_size(f) == n && memcmp(zmq_msg_data(f), text, n) == 0;
}

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
    bool main_domain = n == ZAP_FRAMES && frame_is(&f[2], zap->domain);
    bool gw_domain = n == ZAP_FRAMES && !zap->admit_any && frame_is(&f[2], WIRE_ZAP_GATEWAY_DOMAIN);
    if (n == ZAP_FRAMES && frame_is(&f[0], "1.0") && (main_domain || gw_domain) && frame_is(&f[5], "CURVE") &&
        zmq_msg_size(&f[6]) == WIRE_KEY_BYTES) {
        const uint8_t *key = zmq_msg_data(&f[6]);
        wire_key_to_z85(key, user);
        char addr[WIRE_ADDRESS_MAX] = ""; /* frame 3: the address, an IP address for TCP */
        if (zmq_msg_size(&f[3]) < sizeof addr)
            memcpy(addr, zmq_msg_data(&f[3]), zmq_msg_size(&f[3]));
        pthread_mutex_lock(&zap->mu);
        if (gw_domain) {
            if (roles_of(zap, key) & WIRE_ROLE_GATEWAY) {
                code = "200", text = "OK", admission = WIRE_ADMIT_GATEWAY;
                zap->counters.admitted++;
            } else {
                text = "key has no gateway role";
                zap->counters.refused++;
            }
        } else if (zap->admit_any || roles_of(zap, key)) {
            code = "200", text = "OK", admission = WIRE_ADMIT_MEMBER;
            zap->counters.admitted++;
        } else if (enrol_open(zap) && is_banned(zap, addr, fu_clock_ms())) {
            text = "address banned for failed enrolments";
            zap->counters.refused++;
            zap->counters.banned++;
        } else if (enrol_open(zap)) {
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

/* Keeps the hash of one configured token (an unused slot is skipped). */
static fu_err token_add(wire_zap_t *zap, const wire_zap_token *t, fu_errmsg *em)
{
    if (!t->token || !t->token[0])
        return FU_OK;
    if (zap->n_tokens == WIRE_ZAP_TOKENS_MAX)
        return fu_errmsg_set(em, FU_EINVAL, "more than %u enrolment tokens configured", WIRE_ZAP_TOKENS_MAX);
    if (!t->roles || (t->roles & ~(WIRE_ROLE_CLIENT | WIRE_ROLE_PEER)))
        return fu_errmsg_set(em, FU_EINVAL,
                             "an enrolment token may grant the client and peer roles only (operators and trusted "
                             "peers are put on the allow-list by hand)");
    uint8_t tok[WIRE_KEY_BYTES];
    char roles[WIRE_ROLES_TEXT_MAX];
    if (wire_key_from_z85(t->token, tok) != FU_OK)
        return fu_errmsg_set(em, FU_EINVAL,
                             "the %s enrolment token is not 40 Z85 characters (make one with fusion keygen "
                             "--token)",
                             wire_roles_text(t->roles, roles));
    zap_token *z = &zap->tokens[zap->n_tokens];
    z->hash = sodium_malloc(crypto_generichash_BYTES);
    if (!z->hash) {
        sodium_memzero(tok, sizeof tok);
        return FU_ENOMEM;
    }
    crypto_generichash(z->hash, crypto_generichash_BYTES, tok, sizeof tok, NULL, 0);
    sodium_memzero(tok, sizeof tok);
    z->roles = t->roles;
    zap->n_tokens++;
    return FU_OK;
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
    zap->admit_any = cfg->admit_any;
    if (cfg->allow_file) {
        zap->allow_file = fu_strdup(cfg->allow_file);
        size_t n = 0;
        rc = wire_allow_list_load(cfg->allow_file, &zap->keys, &zap->roles, &n, em);
        if (rc == FU_ENOTFOUND) {
            rc = FU_OK;
        } else if (rc != FU_OK) {
            goto fail;
        }
        zap->n_keys = zap->cap_keys = n;
    }
    crypto_shorthash_keygen(zap->index_key);
    index_rebuild(zap);
    wire_zap_token all[WIRE_ZAP_TOKENS_MAX + 1] = {{cfg->enrol_token, WIRE_ROLES_DEFAULT}};
    memcpy(all + 1, cfg->tokens, sizeof cfg->tokens);
    for (size_t i = 0; i < WIRE_ZAP_TOKENS_MAX + 1; i++)
        if ((rc = token_add(zap, &all[i], em)) != FU_OK)
            goto fail;
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
    zap->bound = zmq_bind(zap->rep, WIRE_ZAP_ENDPOINT) == 0;
    if (!zap->bound) {
        int e = zmq_errno();
        rc = fu_errmsg_set(em, e == EADDRINUSE ? FU_EEXIST : FU_EIO, "cannot bind the ZAP handler at %s: %s",
                           WIRE_ZAP_ENDPOINT, zmq_strerror(e));
        goto fail;
    }
    /* A counter, not the address: malloc hands a freed handler's address to the next one before
     * the reaper has released the old name. */
    static atomic_uint next_pipe;
    char pipe_ep[64];
    snprintf(pipe_ep, sizeof pipe_ep, "inproc://fusion-zap-pipe-%u", atomic_fetch_add(&next_pipe, 1));
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
    if (zap->rep) { /* unbound first: a close frees the inproc name only when the reaper gets to it */
        if (zap->bound)
            (void)zmq_unbind(zap->rep, WIRE_ZAP_ENDPOINT);
        zmq_close(zap->rep);
    }
    if (zap->pipe_main)
        zmq_close(zap->pipe_main);
    if (zap->pipe_actor)
        zmq_close(zap->pipe_actor);
    for (size_t i = 0; i < zap->n_tokens; i++)
        sodium_free(zap->tokens[i].hash);
    free(zap->keys);
    free(zap->roles);
    free(zap->index);
    free(zap->bans);
    free(zap->allow_file);
    pthread_mutex_destroy(&zap->mu);
    free(zap);
    *zap_p = NULL;
}

/* Caller holds mu. */
static fu_err append_to_file(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES], uint32_t roles)
{
    if (!zap->allow_file)
        return FU_OK;
    FILE *f = fopen(zap->allow_file, "a");
    if (!f)
        return FU_EIO;
    char z85[WIRE_KEY_Z85_LEN + 1], text[WIRE_ROLES_TEXT_MAX];
    wire_key_to_z85(key, z85);
    bool ok = fprintf(f, "%s %s\n", z85, wire_roles_text(roles, text)) > 0;
    ok = fclose(f) == 0 && ok;
    return ok ? FU_OK : FU_EIO;
}

/* Gives key the roles, remembering a change in the file. Caller holds mu. */
static fu_err grant(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES], uint32_t roles)
{
    uint32_t had = roles_of(zap, key);
    if ((had | roles) == had)
        return FU_OK;
    add_key(zap, key, roles);
    return append_to_file(zap, key, had | roles);
}

fu_err wire_zap_allow(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES], uint32_t roles)
{
    if (!zap || !key || !roles || (roles & ~ROLES_ALL))
        return FU_EINVAL;
    if (roles & WIRE_ROLE_TRUSTED)
        roles |= WIRE_ROLE_PEER;
    pthread_mutex_lock(&zap->mu);
    fu_err rc = grant(zap, key, roles);
    pthread_mutex_unlock(&zap->mu);
    return rc;
}

/* Removes every entry of key. Caller holds mu. */
static void remove_key(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    if (!roles_of(zap, key))
        return; /* not there (a role of 0 is never stored): the index stays */
    size_t kept = 0;
    for (size_t i = 0; i < zap->n_keys; i++) {
        if (sodium_memcmp(zap->keys[i], key, WIRE_KEY_BYTES) == 0)
            continue;
        memmove(zap->keys[kept], zap->keys[i], WIRE_KEY_BYTES);
        zap->roles[kept++] = zap->roles[i];
    }
    zap->n_keys = kept;
    index_rebuild(zap);
}

void wire_zap_deny(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES])
{
    if (!zap || !key)
        return;
    pthread_mutex_lock(&zap->mu);
    remove_key(zap, key);
    pthread_mutex_unlock(&zap->mu);
}

fu_err wire_zap_set_roles(wire_zap_t *zap, const uint8_t key[WIRE_KEY_BYTES], uint32_t roles)
{
    if (!zap || !key || (roles & ~ROLES_ALL))
        return FU_EINVAL;
    pthread_mutex_lock(&zap->mu);
    remove_key(zap, key);
    if (roles)
        add_key(zap, key, roles);
    pthread_mutex_unlock(&zap->mu);
    return FU_OK;
}

void wire_zap_mirror(wire_zap_t *zap, const uint8_t (*keys)[WIRE_KEY_BYTES], const uint32_t *roles, size_t n,
                     bool enrolment_open)
{
    if (!zap)
        return;
    pthread_mutex_lock(&zap->mu);
    zap->n_keys = 0;
    index_rebuild(zap);
    for (size_t i = 0; i < n; i++)
        if (roles[i] && !(roles[i] & ~ROLES_ALL))
            add_key(zap, keys[i], roles[i]);
    zap->admit_any = false;
    zap->mirror_enrol = enrolment_open;
    pthread_mutex_unlock(&zap->mu);
}

void wire_zap_list(wire_zap_t *zap, uint8_t (**keys)[WIRE_KEY_BYTES], uint32_t **roles, size_t *n)
{
    pthread_mutex_lock(&zap->mu);
    *n = zap->n_keys;
    *keys = fu_malloc((zap->n_keys ? zap->n_keys : 1) * sizeof **keys);
    *roles = fu_malloc((zap->n_keys ? zap->n_keys : 1) * sizeof **roles);
    if (zap->n_keys) {
        memcpy(*keys, zap->keys, zap->n_keys * sizeof **keys);
        memcpy(*roles, zap->roles, zap->n_keys * sizeof **roles);
    }
    pthread_mutex_unlock(&zap->mu);
}

size_t wire_zap_bans(wire_zap_t *zap, uint64_t now, char (*addr)[WIRE_ADDRESS_MAX], uint64_t *ms_left, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&zap->mu);
    for (size_t i = 0; zap->bans && i < WIRE_ZAP_BANS_MAX && n < max; i++)
        if (zap->bans[i].addr[0] && zap->bans[i].until_ms > now) {
            memcpy(addr[n], zap->bans[i].addr, WIRE_ADDRESS_MAX);
            ms_left[n++] = zap->bans[i].until_ms - now;
        }
    pthread_mutex_unlock(&zap->mu);
    return n;
}

bool wire_zap_enrolment_open(wire_zap_t *zap)
{
    pthread_mutex_lock(&zap->mu);
    bool open = enrol_open(zap);
    pthread_mutex_unlock(&zap->mu);
    return open;
}

uint32_t wire_zap_roles(wire_zap_t *zap, const char *z85)
{
    uint8_t key[WIRE_KEY_BYTES];
    if (!zap || !z85 || wire_key_from_z85(z85, key) != FU_OK)
        return 0;
    pthread_mutex_lock(&zap->mu);
    uint32_t roles = roles_of(zap, key);
    pthread_mutex_unlock(&zap->mu);
    return roles;
}

uint32_t wire_zap_msg_roles(wire_zap_t *zap, const wire_msg_t *msg)
{
    /* The live list decides, not the connection's admission metadata: a key may have enrolled (or
     * been denied) since its connection was admitted. */
    return msg ? wire_zap_roles(zap, wire_msg_user_id(msg)) : 0;
}

bool wire_zap_is_member(wire_zap_t *zap, const char *z85)
{
    return wire_zap_roles(zap, z85) != 0;
}

bool wire_zap_msg_is_member(wire_zap_t *zap, const wire_msg_t *msg)
{
    return wire_zap_msg_roles(zap, msg) != 0;
}

fu_err wire_zap_enrol(wire_zap_t *zap, const char *user_id, const char *token, uint32_t *granted)
{
    uint8_t key[WIRE_KEY_BYTES];
    if (granted)
        *granted = 0;
    if (!zap || !user_id || wire_key_from_z85(user_id, key) != FU_OK)
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
    /* Every token is compared, whichever matches: the time says nothing about which one did. */
    uint32_t roles = 0;
    for (size_t i = 0; i < zap->n_tokens; i++) {
        uint32_t match = (uint32_t)(sodium_memcmp(h, zap->tokens[i].hash, sizeof h) == 0);
        roles |= zap->tokens[i].roles & (0u - match);
    }
    fu_err rc = FU_EAUTH;
    if (well_formed && roles) {
        rc = grant(zap, key, roles);
        if (granted)
            *granted = roles_of(zap, key);
        zap->counters.enrolled++;
    } else {
        zap->counters.bad_tokens++;
    }
    pthread_mutex_unlock(&zap->mu);
    return rc;
}

void wire_zap_ban(wire_zap_t *zap, const char *addr, uint64_t until_ms)
{
    if (!zap || !addr)
        return;
    pthread_mutex_lock(&zap->mu);
    if (!zap->bans)
        zap->bans = fu_calloc(WIRE_ZAP_BANS_MAX, sizeof *zap->bans);
    /* Its own slot, else the slot whose ban ends first (a free or lapsed one ends at once). */
    zap_ban *slot = &zap->bans[0];
    for (size_t i = 0; i < WIRE_ZAP_BANS_MAX; i++) {
        zap_ban *z = &zap->bans[i];
        if (z->addr[0] && strcmp(z->addr, addr) == 0) {
            slot = z;
            break;
        }
        uint64_t ends = z->addr[0] ? z->until_ms : 0, best = slot->addr[0] ? slot->until_ms : 0;
        if (ends < best)
            slot = z;
    }
    snprintf(slot->addr, sizeof slot->addr, "%s", addr);
    slot->until_ms = until_ms;
    pthread_mutex_unlock(&zap->mu);
}

void wire_zap_get_counters(wire_zap_t *zap, wire_zap_counters *out)
{
    pthread_mutex_lock(&zap->mu);
    *out = zap->counters;
    pthread_mutex_unlock(&zap->mu);
}
