/* CURVE + ZAP on a real server over tcp://127.0.0.1: an allowed key is admitted and its User-Id
 * is its Z85 public key; unknown keys, NULL-mechanism clients and wrong server keys are refused;
 * without a ZAP handler the server fails closed; enrolment by token; roles on the allow-list and
 * one token per role; a banned address's strangers are refused; gateways: only a key with the
 * gateway role gets onto the gateway domain, only its hop frames are believed, and answers reach
 * the route they name. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>
#include <zmq.h>

#include "fu_clock.h"
#include "fu_file.h"
#include "testutil.h"
#include "wire.h"
#include "wire_keys.h"
#include "wire_socket.h"
#include "wire_zap.h"

typedef struct {
    void *ctx;
    wire_keypair_t *server_kp;
    void *server;
    char endpoint[256];
    char *dir;
    char allow_path[4096];
    void *clients[8];
    size_t n_clients;
    wire_keypair_t *kps[8];
    size_t n_kps;
    wire_zap_t *zap;
} fixture;

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof *f);
    f->ctx = zmq_ctx_new();
    f->server_kp = wire_keypair_generate();
    f->dir = tu_tmpdir("curve");
    snprintf(f->allow_path, sizeof f->allow_path, "%s/allow.keys", f->dir);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    for (size_t i = 0; i < f->n_clients; i++)
        wire_socket_close(&f->clients[i]);
    wire_socket_close(&f->server);
    wire_zap_destroy(&f->zap);
    zmq_ctx_term(f->ctx);
    for (size_t i = 0; i < f->n_kps; i++)
        wire_keypair_destroy(&f->kps[i]);
    wire_keypair_destroy(&f->server_kp);
    tu_tmpdir_remove(&f->dir);
    free(f);
    return 0;
}

/* Starts f's server on ZAP domain `domain` (NULL: fusion's). */
static void start_server_on(fixture *f, const char *domain)
{
    fu_err rc;
    f->server = wire_socket_new(f->ctx, ZMQ_ROUTER, &rc);
    assert_non_null(f->server);
    assert_int_equal(wire_socket_curve_server(f->server, f->server_kp, domain), FU_OK);
    assert_int_equal(zmq_bind(f->server, "tcp://127.0.0.1:*"), 0);
    assert_int_equal(wire_socket_endpoint(f->server, f->endpoint, sizeof f->endpoint), FU_OK);
    int ms = 1500;
    zmq_setsockopt(f->server, ZMQ_RCVTIMEO, &ms, sizeof ms);
}

static void start_server(fixture *f) { start_server_on(f, NULL); }

static wire_keypair_t *new_kp(fixture *f)
{
    wire_keypair_t *kp = wire_keypair_generate();
    f->kps[f->n_kps++] = kp;
    return kp;
}

/* A CURVE client (kp NULL: a NULL-mechanism client) that sends one Heartbeat. */
static void *client_send(fixture *f, const wire_keypair_t *kp, const uint8_t *server_pk)
{
    fu_err rc;
    void *c = wire_socket_new(f->ctx, ZMQ_DEALER, &rc);
    assert_non_null(c);
    f->clients[f->n_clients++] = c;
    if (kp)
        assert_int_equal(wire_socket_curve_client(c, kp, server_pk), FU_OK);
    assert_int_equal(zmq_connect(c, f->endpoint), 0);
    int ms = 1500;
    zmq_setsockopt(c, ZMQ_RCVTIMEO, &ms, sizeof ms);
    zmq_setsockopt(c, ZMQ_SNDTIMEO, &ms, sizeof ms);
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_HEARTBEAT};
    /* Queued until connected, as a rule. On a loaded machine the handshake can finish, and a
     * refused one tear down the socket's only pipe, before this send runs: then it times out
     * (FU_EAGAIN). What counts is what the server receives, which the callers check. */
    fu_err sent = wire_send(c, NULL, 0, &h, &hb.base);
    if (sent != FU_OK && sent != FU_EAGAIN)
        fail_msg("wire_send: %s", fu_errname(sent));
    return c;
}

static void write_allow_list(fixture *f, const wire_keypair_t *kp)
{
    FILE *fp = fopen(f->allow_path, "w");
    assert_non_null(fp);
    fprintf(fp, "# fusion allow-list\n\n  %s  # alice\n", wire_keypair_public_z85(kp));
    fclose(fp);
}

/* Starts f's ZAP handler with cfg; fails the test when it cannot. */
static void zap_start(fixture *f, const wire_zap_cfg *cfg)
{
    fu_err rc = FU_OK;
    fu_errmsg em = {{0}};
    f->zap = wire_zap_new(f->ctx, cfg, &rc, &em);
    if (!f->zap)
        fail_msg("wire_zap_new: %s", fu_errmsg_text(&em, rc));
}

/* Starts f's server with a ZAP handler whose allow-list holds member's public key alone. */
static void serve_allowing(fixture *f, const wire_keypair_t *member)
{
    write_allow_list(f, member);
    wire_zap_cfg cfg = {.allow_file = f->allow_path};
    zap_start(f, &cfg);
    start_server(f);
}

/* A new client with key pair kp, taking the server's public key to be f's, sends one message: returns
 * what the server's wire_recv gives (*m: the message, NULL when none came). */
static fu_err send_as(fixture *f, const wire_keypair_t *kp, wire_msg_t **m)
{
    client_send(f, kp, wire_keypair_public(f->server_kp));
    wire_counters c = {0};
    *m = NULL;
    return wire_recv(f->server, 0, &c, m);
}

/* f's ZAP handler's counters. */
static wire_zap_counters zap_counters(const fixture *f)
{
    wire_zap_counters zc;
    wire_zap_get_counters(f->zap, &zc);
    return zc;
}

static void test_wire_curve_available_here(void **state)
{
    (void)state;
    fu_errmsg em = {{0}};
    assert_int_equal(wire_curve_available(&em), FU_OK);
}

static void test_wire_curve_allowed_key_admitted_with_user_id(void **state)
{
    fixture *f = *state;
    wire_keypair_t *alice = new_kp(f);
    serve_allowing(f, alice);
    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, alice, &m), FU_OK);
    assert_string_equal(wire_msg_user_id(m), wire_keypair_public_z85(alice));
    assert_string_equal(wire_msg_admission(m), WIRE_ADMIT_MEMBER);
    assert_true(wire_zap_msg_is_member(f->zap, m));
    assert_int_equal(wire_zap_msg_roles(f->zap, m), WIRE_ROLES_DEFAULT); /* a bare key */
    assert_string_equal(wire_msg_peer_address(m), "127.0.0.1");
    wire_zap_counters zc = zap_counters(f);
    assert_int_equal(zc.admitted, 1);
    assert_int_equal(zc.refused, 0);
    wire_msg_destroy(&m);
}

static void test_wire_curve_unknown_key_refused(void **state)
{
    fixture *f = *state;
    wire_keypair_t *alice = new_kp(f), *mallory = new_kp(f);
    serve_allowing(f, alice);
    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, mallory, &m), FU_ETIMEDOUT);
    assert_null(m);
    wire_zap_counters zc = zap_counters(f);
    assert_true(zc.refused >= 1);
    assert_int_equal(zc.admitted, 0);

    /* A client with no CURVE at all gets nowhere either, nor one that has the wrong server key. */
    client_send(f, NULL, NULL);
    wire_keypair_t *other = new_kp(f);
    client_send(f, alice, wire_keypair_public(other));
    wire_counters c = {0};
    assert_int_equal(wire_recv(f->server, 0, &c, &m), FU_ETIMEDOUT);

    /* and alice still gets in */
    assert_int_equal(send_as(f, alice, &m), FU_OK);
    assert_string_equal(wire_msg_user_id(m), wire_keypair_public_z85(alice));
    wire_msg_destroy(&m);

    /* a denied key is refused on its next connection */
    wire_zap_deny(f->zap, wire_keypair_public(alice));
    assert_false(wire_zap_is_member(f->zap, wire_keypair_public_z85(alice)));
    assert_int_equal(send_as(f, alice, &m), FU_ETIMEDOUT);
}

static void test_wire_curve_no_zap_handler_fails_closed(void **state)
{
    fixture *f = *state;
    wire_keypair_t *alice = new_kp(f);
    start_server(f); /* no wire_zap_new: ZMQ_ZAP_ENFORCE_DOMAIN must refuse everyone */
    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, alice, &m), FU_ETIMEDOUT);
}

static void test_wire_curve_enrolment_by_token(void **state)
{
    fixture *f = *state;
    char token[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(token);
    wire_zap_cfg cfg = {.allow_file = f->allow_path, .enrol_token = token}; /* file does not exist yet */
    zap_start(f, &cfg);
    start_server(f);
    wire_keypair_t *bob = new_kp(f), *eve = new_kp(f);

    /* bob is admitted as enrolling: the broker accepts only an Enrol from him */
    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, bob, &m), FU_OK);
    assert_string_equal(wire_msg_admission(m), WIRE_ADMIT_ENROLLING);
    assert_false(wire_zap_msg_is_member(f->zap, m));
    wire_msg_destroy(&m);

    void *cb = f->clients[f->n_clients - 1];
    Fusion__Enrol en = FUSION__ENROL__INIT;
    en.token = token;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_ENROL};
    assert_int_equal(wire_send(cb, NULL, 0, &h, &en.base), FU_OK);
    wire_counters c = {0};
    assert_int_equal(wire_recv(f->server, 0, &c, &m), FU_OK);
    const Fusion__Enrol *got = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ENROL);
    assert_non_null(got);
    uint32_t granted = 0;
    assert_int_equal(wire_zap_enrol(f->zap, wire_msg_user_id(m), got->token, &granted), FU_OK);
    assert_int_equal(granted, WIRE_ROLES_DEFAULT); /* enrol_token: client and peer */
    assert_true(wire_zap_msg_is_member(f->zap, m)); /* the live list decides */
    wire_msg_destroy(&m);

    /* eve presents a wrong token */
    assert_int_equal(send_as(f, eve, &m), FU_OK);
    char wrong[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(wrong);
    assert_int_equal(wire_zap_enrol(f->zap, wire_msg_user_id(m), wrong, NULL), FU_EAUTH);
    assert_int_equal(wire_zap_enrol(f->zap, wire_msg_user_id(m), "short", NULL), FU_EAUTH);
    assert_int_equal(wire_zap_enrol(f->zap, wire_msg_user_id(m), NULL, NULL), FU_EAUTH);
    assert_false(wire_zap_msg_is_member(f->zap, m));
    wire_msg_destroy(&m);

    /* bob's key was appended to the allow-list file and a fresh handler admits him as a member */
    uint8_t (*keys)[WIRE_KEY_BYTES] = NULL;
    uint32_t *roles = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(wire_allow_list_load(f->allow_path, &keys, &roles, &n, &em), FU_OK);
    assert_int_equal(n, 1);
    assert_memory_equal(keys[0], wire_keypair_public(bob), WIRE_KEY_BYTES);
    assert_int_equal(roles[0], WIRE_ROLES_DEFAULT);
    free(keys);
    free(roles);
    assert_int_equal(send_as(f, bob, &m), FU_OK);
    assert_string_equal(wire_msg_admission(m), WIRE_ADMIT_MEMBER);
    wire_msg_destroy(&m);

    wire_zap_counters zc = zap_counters(f);
    assert_int_equal(zc.enrolled, 1);
    assert_int_equal(zc.bad_tokens, 3);
}

static void test_wire_curve_enrolment_disabled_without_token(void **state)
{
    fixture *f = *state;
    wire_zap_cfg cfg = {0};
    zap_start(f, &cfg);
    char token[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(token);
    wire_keypair_t *bob = new_kp(f);
    assert_int_equal(wire_zap_enrol(f->zap, wire_keypair_public_z85(bob), token, NULL), FU_EAUTH);
    /* a second handler in the same context is refused */
    fu_err rc = FU_OK;
    wire_zap_t *again = wire_zap_new(f->ctx, &cfg, &rc, NULL);
    assert_null(again);
    assert_int_equal(rc, FU_EEXIST);
}

static void test_wire_curve_allow_list_parsing(void **state)
{
    fixture *f = *state;
    wire_keypair_t *a = new_kp(f);
    FILE *fp = fopen(f->allow_path, "w");
    fprintf(fp, "# ok\n%s\nnot-a-key\n", wire_keypair_public_z85(a));
    fclose(fp);
    uint8_t (*keys)[WIRE_KEY_BYTES] = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(wire_allow_list_load(f->allow_path, &keys, NULL, &n, &em), FU_EINVAL);
    print_message("allow-list: %s\n", em.msg);
    assert_non_null(strstr(em.msg, "line 3"));
    assert_null(keys);
    wire_zap_cfg cfg = {.allow_file = f->allow_path};
    fu_err rc;
    assert_null(wire_zap_new(f->ctx, &cfg, &rc, &em));
    assert_int_equal(rc, FU_EINVAL);
    cfg.allow_file = NULL;
    cfg.enrol_token = "too-short";
    assert_null(wire_zap_new(f->ctx, &cfg, &rc, &em));
    assert_int_equal(rc, FU_EINVAL);
}

/* Writes the allow-list text (a printf format) to f's allow-list file. */
static void write_allow_text(fixture *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void write_allow_text(fixture *f, const char *fmt, ...)
{
    FILE *fp = fopen(f->allow_path, "w");
    assert_non_null(fp);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(fp, fmt, ap);
    va_end(ap);
    fclose(fp);
}

/* wire_allow_list_load of f's file must fail with FU_EINVAL and a message holding both needles. */
static void expect_bad_allow_list(fixture *f, const char *needle, const char *needle2)
{
    uint8_t (*keys)[WIRE_KEY_BYTES] = NULL;
    uint32_t *roles = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(wire_allow_list_load(f->allow_path, &keys, &roles, &n, &em), FU_EINVAL);
    print_message("allow-list: %s\n", em.msg);
    assert_non_null(strstr(em.msg, needle));
    assert_non_null(strstr(em.msg, needle2));
    assert_null(keys);
    assert_null(roles);
}

static void test_wire_curve_allow_list_roles(void **state)
{
    fixture *f = *state;
    wire_keypair_t *a = new_kp(f), *b = new_kp(f), *c = new_kp(f), *d = new_kp(f);
    const char *za = wire_keypair_public_z85(a), *zb = wire_keypair_public_z85(b), *zc = wire_keypair_public_z85(c),
               *zd = wire_keypair_public_z85(d);
    write_allow_text(f, "# roles\n%s\n%s client # a tenant\n  %s\ttrusted\n%s operator,client\n%s peer\n", za, zb, zc,
                     zd, zb);
    uint8_t (*keys)[WIRE_KEY_BYTES] = NULL;
    uint32_t *roles = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(wire_allow_list_load(f->allow_path, &keys, &roles, &n, &em), FU_OK);
    assert_int_equal(n, 5);
    assert_memory_equal(keys[2], wire_keypair_public(c), WIRE_KEY_BYTES);
    assert_int_equal(roles[0], WIRE_ROLE_CLIENT | WIRE_ROLE_PEER); /* a bare key, as before roles */
    assert_int_equal(roles[1], WIRE_ROLE_CLIENT);
    assert_int_equal(roles[2], WIRE_ROLE_TRUSTED | WIRE_ROLE_PEER); /* trusted implies peer */
    assert_int_equal(roles[3], WIRE_ROLE_OPERATOR | WIRE_ROLE_CLIENT);
    assert_int_equal(roles[4], WIRE_ROLE_PEER);
    free(keys);
    free(roles);

    /* the handler answers with the union of a key's lines */
    wire_zap_cfg cfg = {.allow_file = f->allow_path};
    zap_start(f, &cfg);
    assert_int_equal(wire_zap_roles(f->zap, za), WIRE_ROLES_DEFAULT);
    assert_int_equal(wire_zap_roles(f->zap, zb), WIRE_ROLE_CLIENT | WIRE_ROLE_PEER);
    assert_int_equal(wire_zap_roles(f->zap, zc), WIRE_ROLE_TRUSTED | WIRE_ROLE_PEER);
    assert_int_equal(wire_zap_roles(f->zap, zd), WIRE_ROLE_OPERATOR | WIRE_ROLE_CLIENT);
    assert_int_equal(wire_zap_roles(f->zap, "not a key"), 0);
    assert_true(wire_zap_is_member(f->zap, zc));
    wire_zap_deny(f->zap, wire_keypair_public(b)); /* every line of it */
    assert_int_equal(wire_zap_roles(f->zap, zb), 0);
    assert_false(wire_zap_is_member(f->zap, zb));
    char text[WIRE_ROLES_TEXT_MAX];
    assert_string_equal(wire_roles_text(WIRE_ROLE_TRUSTED | WIRE_ROLE_PEER, text), "peer,trusted");
    assert_string_equal(wire_roles_text(0, text), "");

    /* wrong role names, empty ones and trailing words are refused, naming the line */
    write_allow_text(f, "%s\n%s clinet\n", za, zb);
    expect_bad_allow_list(f, "line 2", "'clinet'");
    write_allow_text(f, "%s client,,peer\n", za);
    expect_bad_allow_list(f, "line 1", "unknown role ''");
    write_allow_text(f, "\n\n%s Client\n", za);
    expect_bad_allow_list(f, "line 3", "'Client'");
    write_allow_text(f, "%s client peer\n", za);
    expect_bad_allow_list(f, "line 1", "more than a key and its roles");
    fu_err rc;
    wire_zap_t *z2 = wire_zap_new(f->ctx, &cfg, &rc, &em); /* the file is read before anything is bound */
    assert_null(z2);
    assert_int_equal(rc, FU_EINVAL);
}

static void test_wire_curve_enrolment_per_role(void **state)
{
    fixture *f = *state;
    char both[WIRE_KEY_Z85_LEN + 1], peer[WIRE_KEY_Z85_LEN + 1], client[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(both);
    wire_token_generate(peer);
    wire_token_generate(client);

    /* tokens that would make operators or trusted peers, and a fourth token, are refused */
    fu_err rc;
    fu_errmsg em = {{0}};
    wire_zap_cfg bad = {.tokens = {{peer, WIRE_ROLE_PEER | WIRE_ROLE_OPERATOR}}};
    assert_null(wire_zap_new(f->ctx, &bad, &rc, &em));
    assert_int_equal(rc, FU_EINVAL);
    assert_non_null(strstr(em.msg, "client and peer roles only"));
    bad.tokens[0].roles = WIRE_ROLE_TRUSTED;
    assert_null(wire_zap_new(f->ctx, &bad, &rc, &em));
    wire_zap_cfg four = {.enrol_token = both,
                         .tokens = {{peer, WIRE_ROLE_PEER}, {client, WIRE_ROLE_CLIENT}, {both, WIRE_ROLE_CLIENT}}};
    assert_null(wire_zap_new(f->ctx, &four, &rc, &em));
    assert_int_equal(rc, FU_EINVAL);
    assert_non_null(strstr(em.msg, "more than 3"));
    four.tokens[0].token = "too-short";
    four.tokens[2].token = NULL;
    assert_null(wire_zap_new(f->ctx, &four, &rc, &em));
    assert_non_null(strstr(em.msg, "the peer enrolment token is not 40 Z85"));

    wire_zap_cfg cfg = {.allow_file = f->allow_path,
                        .enrol_token = both,
                        .tokens = {{peer, WIRE_ROLE_PEER}, {client, WIRE_ROLE_CLIENT}}};
    zap_start(f, &cfg);
    wire_keypair_t *kb = new_kp(f), *kp = new_kp(f), *kc = new_kp(f);
    const char *zb = wire_keypair_public_z85(kb), *zp = wire_keypair_public_z85(kp), *zc = wire_keypair_public_z85(kc);
    uint32_t granted = 0;
    assert_int_equal(wire_zap_enrol(f->zap, zp, peer, &granted), FU_OK);
    assert_int_equal(granted, WIRE_ROLE_PEER);
    assert_int_equal(wire_zap_enrol(f->zap, zc, client, &granted), FU_OK);
    assert_int_equal(granted, WIRE_ROLE_CLIENT);
    assert_int_equal(wire_zap_enrol(f->zap, zb, both, &granted), FU_OK);
    assert_int_equal(granted, WIRE_ROLES_DEFAULT);
    assert_int_equal(wire_zap_roles(f->zap, zp), WIRE_ROLE_PEER);
    assert_int_equal(wire_zap_roles(f->zap, zc), WIRE_ROLE_CLIENT);
    /* the same key again with the same token changes nothing (and writes nothing) */
    assert_int_equal(wire_zap_enrol(f->zap, zc, client, &granted), FU_OK);
    assert_int_equal(granted, WIRE_ROLE_CLIENT);
    /* a wrong token grants nothing, whatever the key had */
    char wrong[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(wrong);
    assert_int_equal(wire_zap_enrol(f->zap, zc, wrong, &granted), FU_EAUTH);
    assert_int_equal(granted, 0);
    assert_int_equal(wire_zap_roles(f->zap, zc), WIRE_ROLE_CLIENT);

    /* every grant is appended to the file with its roles, and a fresh handler reads them back */
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(fu_file_read_all(f->allow_path, 1 << 20, &text, &len, &em), FU_OK);
    print_message("allow-list after enrolment:\n%s", text);
    char line[128];
    snprintf(line, sizeof line, "%s peer\n", zp);
    assert_non_null(strstr(text, line));
    snprintf(line, sizeof line, "%s client\n", zc);
    assert_non_null(strstr(text, line));
    assert_null(strstr(strstr(text, line) + 1, line)); /* once */
    snprintf(line, sizeof line, "%s client,peer\n", zb);
    assert_non_null(strstr(text, line));
    free(text);

    /* the client enrols as a peer too: it has both roles, and the file says so */
    assert_int_equal(wire_zap_enrol(f->zap, zc, peer, &granted), FU_OK);
    assert_int_equal(granted, WIRE_ROLES_DEFAULT);
    wire_zap_destroy(&f->zap);
    wire_zap_cfg none = {.allow_file = f->allow_path};
    zap_start(f, &none);
    assert_int_equal(wire_zap_roles(f->zap, zp), WIRE_ROLE_PEER);
    assert_int_equal(wire_zap_roles(f->zap, zc), WIRE_ROLES_DEFAULT);
    assert_int_equal(wire_zap_roles(f->zap, zb), WIRE_ROLES_DEFAULT);
    /* and without tokens nobody enrols */
    assert_int_equal(wire_zap_enrol(f->zap, zp, peer, NULL), FU_EAUTH);
}

static void test_wire_curve_ban_refuses_strangers(void **state)
{
    fixture *f = *state;
    char token[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(token);
    wire_keypair_t *alice = new_kp(f), *stranger = new_kp(f), *later = new_kp(f);
    write_allow_list(f, alice);
    wire_zap_cfg cfg = {.allow_file = f->allow_path, .enrol_token = token};
    zap_start(f, &cfg);
    start_server(f);
    wire_zap_ban(f->zap, "127.0.0.1", fu_clock_ms() + 120000);
    /* a table full of shorter bans of other addresses, and more: the longest ban stays */
    for (unsigned i = 0; i <= WIRE_ZAP_BANS_MAX; i++) {
        char addr[32];
        snprintf(addr, sizeof addr, "10.0.%u.%u", i / 256, i % 256);
        wire_zap_ban(f->zap, addr, fu_clock_ms() + 60000);
    }

    /* a key that would be enrolling is refused at the handshake: nothing reaches the server */
    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, stranger, &m), FU_ETIMEDOUT);
    assert_null(m);
    wire_zap_counters zc = zap_counters(f);
    assert_true(zc.banned >= 1);
    assert_int_equal(zc.enrolling, 0);

    /* a member from the same address is still admitted: its key is its credential */
    assert_int_equal(send_as(f, alice, &m), FU_OK);
    assert_string_equal(wire_msg_admission(m), WIRE_ADMIT_MEMBER);
    wire_msg_destroy(&m);

    /* the ban lifted, strangers may enrol again */
    wire_zap_ban(f->zap, "127.0.0.1", 0);
    assert_int_equal(send_as(f, later, &m), FU_OK);
    assert_string_equal(wire_msg_admission(m), WIRE_ADMIT_ENROLLING);
    wire_msg_destroy(&m);
}

/* ---------- gateways ---------- */

/* Sends, on c, [GatewayHop (route, uid, 10.1.2.3)] [Envelope: a Heartbeat] [body]: what a gateway
 * sends (hop NULL: the hop frame is 3 bytes of garbage). */
static void send_hopped(void *c, const char *uid, const uint8_t *route, size_t route_len, bool hop_ok)
{
    Fusion__GatewayHop hop = FUSION__GATEWAY_HOP__INIT;
    hop.route.data = (uint8_t *)route;
    hop.route.len = route_len;
    hop.user_id = (char *)uid;
    hop.peer_address = "10.1.2.3";
    uint8_t buf[WIRE_GATEWAY_HOP_MAX];
    size_t n = hop_ok ? fusion__gateway_hop__pack(&hop, buf) : 3;
    if (!hop_ok)
        memcpy(buf, "\xff\xff\xff", 3);
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_HEARTBEAT};
    uint8_t *env = NULL, *body = NULL;
    size_t el = 0, bl = 0;
    assert_int_equal(wire_encode(&h, &hb.base, &env, &el, &body, &bl), FU_OK);
    assert_true(zmq_send(c, buf, n, ZMQ_SNDMORE) >= 0);
    assert_true(zmq_send(c, env, el, ZMQ_SNDMORE) >= 0);
    assert_true(zmq_send(c, body, bl, 0) >= 0);
    free(env);
    free(body);
}

/* A DEALER CURVE client of f's server with kp, connected, nothing sent. */
static void *client_of(fixture *f, const wire_keypair_t *kp)
{
    fu_err rc;
    void *c = wire_socket_new(f->ctx, ZMQ_DEALER, &rc);
    assert_non_null(c);
    f->clients[f->n_clients++] = c;
    assert_int_equal(wire_socket_curve_client(c, kp, wire_keypair_public(f->server_kp)), FU_OK);
    assert_int_equal(zmq_connect(c, f->endpoint), 0);
    int ms = 1500;
    zmq_setsockopt(c, ZMQ_RCVTIMEO, &ms, sizeof ms);
    zmq_setsockopt(c, ZMQ_SNDTIMEO, &ms, sizeof ms);
    return c;
}

/* The broker's gateway socket: on the gateway domain only a key with the gateway role gets in; its
 * hops are believed (the message is the hop's key's, from its address, with a route as its routing
 * id), and an answer on that route reaches the gateway as [route] [Envelope] [body]; a malformed hop
 * is dropped as malformed. */
static void test_wire_curve_gateway_hops_believed(void **state)
{
    fixture *f = *state;
    wire_keypair_t *gw = new_kp(f), *member = new_kp(f), *victim = new_kp(f);
    write_allow_text(f, "%s gateway\n%s\n", wire_keypair_public_z85(gw), wire_keypair_public_z85(member));
    wire_zap_cfg cfg = {.allow_file = f->allow_path};
    zap_start(f, &cfg);
    start_server_on(f, WIRE_ZAP_GATEWAY_DOMAIN);

    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, member, &m), FU_ETIMEDOUT); /* a member without the role: refused */
    assert_null(m);
    assert_true(zap_counters(f).refused >= 1);

    void *c = client_of(f, gw);
    const uint8_t route[] = {0x00, 0x6b, 0x8b, 0x45, 0x67};
    send_hopped(c, wire_keypair_public_z85(victim), route, sizeof route, true);
    wire_counters wc = {0};
    assert_int_equal(wire_recv(f->server, 0, &wc, &m), FU_OK);
    assert_string_equal(wire_msg_user_id(m), wire_keypair_public_z85(victim));
    assert_string_equal(wire_msg_gateway(m), wire_keypair_public_z85(gw));
    assert_string_equal(wire_msg_peer_address(m), "10.1.2.3");
    assert_int_equal(wire_msg_src_fd(m), -1);
    size_t rl = 0;
    const uint8_t *rid = wire_msg_routing_id(m, &rl);
    assert_true(wire_route_is(rid, rl));
    assert_int_equal(wire_reply_error(f->server, m, FUSION__ERROR_CODE__ERR_BUSY, "busy"), FU_OK);
    wire_msg_destroy(&m);
    zmq_msg_t part;
    zmq_msg_init(&part);
    assert_int_equal(zmq_msg_recv(&part, c, 0), (int)sizeof route); /* the answer names the route */
    assert_memory_equal(zmq_msg_data(&part), route, sizeof route);
    assert_true(zmq_msg_more(&part));
    zmq_msg_close(&part);
    wire_counters cc = {0};
    assert_int_equal(wire_recv(c, 0, &cc, &m), FU_OK); /* the rest is an ordinary message */
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    wire_msg_destroy(&m);

    send_hopped(c, wire_keypair_public_z85(victim), route, sizeof route, false);
    assert_int_equal(wire_recv(f->server, 0, &wc, &m), FU_EPROTO);
    assert_int_equal(wc.dropped_malformed, 1);
    uint8_t long_route[WIRE_GATEWAY_ROUTE_MAX + 1] = {0};
    send_hopped(c, wire_keypair_public_z85(victim), long_route, sizeof long_route, true);
    assert_int_equal(wire_recv(f->server, 0, &wc, &m), FU_EPROTO);
    assert_int_equal(wc.dropped_malformed, 2);
    send_hopped(c, "not a key", route, sizeof route, true);
    assert_int_equal(wire_recv(f->server, 0, &wc, &m), FU_EPROTO);
    assert_int_equal(wc.dropped_malformed, 3);
}

/* On the ordinary domain a member's hop frames are forgeries: the four-frame message is dropped
 * (dropped_frames) and nothing it claims is believed; the member's next plain message is its own. */
static void test_wire_curve_hops_forged_by_members_dropped(void **state)
{
    fixture *f = *state;
    wire_keypair_t *member = new_kp(f), *victim = new_kp(f);
    serve_allowing(f, member);
    void *c = client_of(f, member);
    const uint8_t route[] = {0x00, 1, 2, 3, 4};
    send_hopped(c, wire_keypair_public_z85(victim), route, sizeof route, true);
    wire_counters wc = {0};
    wire_msg_t *m = NULL;
    assert_int_equal(wire_recv(f->server, 0, &wc, &m), FU_EPROTO);
    assert_null(m);
    assert_int_equal(wc.dropped_frames, 1);
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_HEARTBEAT};
    assert_int_equal(wire_send(c, NULL, 0, &h, &hb.base), FU_OK);
    assert_int_equal(wire_recv(f->server, 0, &wc, &m), FU_OK);
    assert_string_equal(wire_msg_user_id(m), wire_keypair_public_z85(member));
    assert_string_equal(wire_msg_gateway(m), "");
    wire_msg_destroy(&m);
}

/* A gateway's own front (admit_any) admits any key, with its key as User-Id, and no gateway. */
static void test_wire_curve_admit_any(void **state)
{
    fixture *f = *state;
    wire_zap_cfg cfg = {.admit_any = true};
    zap_start(f, &cfg);
    start_server(f);
    wire_keypair_t *stranger = new_kp(f);
    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, stranger, &m), FU_OK);
    assert_string_equal(wire_msg_user_id(m), wire_keypair_public_z85(stranger));
    wire_msg_destroy(&m);
    assert_int_equal(zap_counters(f).admitted, 1);
}

/* A gateway's front made a mirror of the broker's admission (wire_zap_mirror): members only with
 * enrolment closed; a key's roles set exactly, and taken away with 0; the list and bans copied out
 * as the broker sends them (wire_zap_list, wire_zap_bans). */
static void test_wire_curve_mirror(void **state)
{
    fixture *f = *state;
    wire_zap_cfg cfg = {.admit_any = true};
    zap_start(f, &cfg);
    start_server(f);
    wire_keypair_t *alice = new_kp(f), *bob = new_kp(f);
    const uint8_t(*keys)[WIRE_KEY_BYTES] = (const uint8_t(*)[WIRE_KEY_BYTES])wire_keypair_public(alice);
    uint32_t roles = WIRE_ROLE_PEER;
    wire_zap_mirror(f->zap, keys, &roles, 1, false);
    assert_false(wire_zap_enrolment_open(f->zap));
    wire_msg_t *m = NULL;
    assert_int_equal(send_as(f, alice, &m), FU_OK); /* a member */
    wire_msg_destroy(&m);
    assert_int_equal(send_as(f, bob, &m), FU_ETIMEDOUT); /* a stranger, with enrolment closed */
    assert_null(m);
    /* bob enrolled at the broker: a member now, with exactly the roles sent */
    assert_int_equal(wire_zap_set_roles(f->zap, wire_keypair_public(bob), WIRE_ROLE_CLIENT | WIRE_ROLE_PEER), FU_OK);
    assert_int_equal(wire_zap_set_roles(f->zap, wire_keypair_public(bob), WIRE_ROLE_CLIENT), FU_OK);
    assert_int_equal(wire_zap_roles(f->zap, wire_keypair_public_z85(bob)), WIRE_ROLE_CLIENT);
    assert_int_equal(send_as(f, bob, &m), FU_OK);
    wire_msg_destroy(&m);
    assert_int_equal(wire_zap_set_roles(f->zap, wire_keypair_public(bob), 1u << 30), FU_EINVAL);
    /* what the broker would send: the list and the bans in force */
    wire_zap_ban(f->zap, "10.1.2.3", fu_clock_ms() + 60000);
    wire_zap_ban(f->zap, "10.9.9.9", fu_clock_ms() - 1); /* over */
    uint8_t(*list)[WIRE_KEY_BYTES] = NULL;
    uint32_t *lr = NULL;
    size_t n = 0;
    wire_zap_list(f->zap, &list, &lr, &n);
    assert_int_equal(n, 2);
    free(list);
    free(lr);
    char addr[4][WIRE_ADDRESS_MAX];
    uint64_t left[4];
    assert_int_equal(wire_zap_bans(f->zap, fu_clock_ms(), addr, left, 4), 1);
    assert_string_equal(addr[0], "10.1.2.3");
    assert_true(left[0] > 50000 && left[0] <= 60000);
    /* taken away: refused again */
    assert_int_equal(wire_zap_set_roles(f->zap, wire_keypair_public(alice), 0), FU_OK);
    assert_int_equal(wire_zap_roles(f->zap, wire_keypair_public_z85(alice)), 0);
    assert_int_equal(send_as(f, alice, &m), FU_ETIMEDOUT);
    assert_null(m);
}

/* Routes: what is one and what is not (libzmq's own 5-byte ids, user ids, too short). */
static void test_wire_curve_routes(void **state)
{
    (void)state;
    uint8_t out[WIRE_MAX_ROUTING_ID];
    const uint8_t gw[] = {'G', 1, 2}, peer[] = {0, 9, 9, 9, 9};
    size_t n = wire_route_make(gw, sizeof gw, peer, sizeof peer, out);
    assert_int_equal(n, 2 + sizeof gw + sizeof peer);
    assert_true(wire_route_is(out, n));
    assert_false(wire_route_is(peer, sizeof peer)); /* libzmq's own id */
    for (unsigned b = 0; b < 256; b++) { /* whatever its counter: a 5-byte id is never a route */
        const uint8_t own[5] = {0, (uint8_t)b, (uint8_t)(b * 7), 1, 0};
        assert_false(wire_route_is(own, sizeof own));
    }
    const uint8_t one[] = {'g'}, two[] = {1, 2};
    assert_int_equal(wire_route_make(one, sizeof one, two, sizeof two, out), 0); /* would be 5 bytes */
    assert_false(wire_route_is(gw, sizeof gw));
    assert_false(wire_route_is(out, 2 + sizeof gw)); /* no peer part */
    uint8_t big[WIRE_GATEWAY_ROUTE_MAX + 1] = {0};
    assert_int_equal(wire_route_make(gw, sizeof gw, big, sizeof big, out), 0);
    assert_int_equal(wire_route_make(gw, 0, peer, sizeof peer, out), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_curve_available_here),
        cmocka_unit_test(test_wire_curve_allowed_key_admitted_with_user_id),
        cmocka_unit_test(test_wire_curve_unknown_key_refused),
        cmocka_unit_test(test_wire_curve_no_zap_handler_fails_closed),
        cmocka_unit_test(test_wire_curve_enrolment_by_token),
        cmocka_unit_test(test_wire_curve_enrolment_disabled_without_token),
        cmocka_unit_test(test_wire_curve_allow_list_parsing),
        cmocka_unit_test(test_wire_curve_allow_list_roles),
        cmocka_unit_test(test_wire_curve_enrolment_per_role),
        cmocka_unit_test(test_wire_curve_ban_refuses_strangers),
        cmocka_unit_test(test_wire_curve_gateway_hops_believed),
        cmocka_unit_test(test_wire_curve_hops_forged_by_members_dropped),
        cmocka_unit_test(test_wire_curve_admit_any),
        cmocka_unit_test(test_wire_curve_mirror),
        cmocka_unit_test(test_wire_curve_routes),
    };
    return tu_unit_main(tests, sodium_init, setup, teardown);
}
