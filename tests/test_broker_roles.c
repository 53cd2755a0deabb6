/* Roles per key and failed enrolment, played against the real fusion-broker process by clients
 * that speak the wire protocol themselves (fake_peer.h; docs/PROTOCOL.md "Admission"):
 * - a client-only key cannot say PeerHello (ERR_AUTH, naming the role) and never gets a stage;
 * - a peer-only key cannot submit or list jobs, but may register as a peer;
 * - PeerList shows another tenant's running job as "busy" without its id or stage, while the
 *   job's owner and an operator see both;
 * - 50 wrong enrolment tokens on one connection get at most 5 answers and a few log lines; the
 *   address is banned (even the right token is ignored, new keys from it are refused at the
 *   handshake), while another address still enrols;
 * - the peer token (FUSION_PEER_TOKEN) makes a peer that cannot submit, the client token
 *   (FUSION_CLIENT_TOKEN) a client that cannot be a peer;
 * - a fusion-gateway admits as the broker does: strangers refused at its handshake when enrolment
 *   is closed, new keys from an address the broker banned too, members always, a key enrolled
 *   through another address at once (the broker's admission, copied to the gateway);
 * and, without processes, broker_auth's policy: bans that double up to an hour and are forgotten
 * after a quiet one, windows, and a bounded table that keeps its bans. */
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <sodium.h>
#include <zmq.h>

#include "broker_auth.h"
#include "cluster.h"
#include "fake_peer.h"
#include "fu_clock.h"
#include "testutil.h"
#include "wire_socket.h"
#include "wire_zap.h"

#define GiB (1ull << 30)

/* The Error m is (fails the test when it is something else): its code; its text must hold `says`. */
static Fusion__ErrorCode error_of(const wire_msg_t *m, const char *says)
{
    if (!m)
        fail_msg("no answer");
    if (wire_msg_type(m) != FUSION__MSG_TYPE__MSG_ERROR)
        fail_msg("expected an Error, got %s", wire_type_name(wire_msg_type(m)));
    const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
    print_message("refused: %s\n", e->message);
    if (!strstr(e->message, says))
        fail_msg("the error does not say \"%s\": %s", says, e->message);
    return e->code;
}

static uint64_t submitted(wire_msg_t *m)
{
    if (!m)
        fail_msg("no answer to the submission");
    if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR)
        fail_msg("submission refused: %s", ((const Fusion__Error *)wire_msg_body(m))->message);
    uint64_t id = ((const Fusion__JobStatus *)wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS))->job_id;
    wire_msg_destroy(&m);
    return id;
}

/* Says PeerHello as cl and returns the answer: PeerWelcome or an Error (caller destroys), NULL. */
static wire_msg_t *hello(tu_client *cl, const char *name)
{
    tu_client_hello(cl, name, 4 * GiB, 50);
    uint64_t end = fu_clock_ms() + 3000;
    while (fu_clock_ms() < end) {
        wire_msg_t *m = tu_client_recv(cl, 500);
        if (m && (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_PEER_WELCOME ||
                  wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR))
            return m;
        wire_msg_destroy(&m);
    }
    return NULL;
}

/* Sends Enrol with token as cl: the answer within timeout_ms (EnrolAck or Error), NULL when none. */
static wire_msg_t *enrol(tu_client *cl, const char *token, int timeout_ms)
{
    Fusion__Enrol e = FUSION__ENROL__INIT;
    e.token = (char *)token;
    e.name = (char *)"test";
    return tu_client_call(cl, FUSION__MSG_TYPE__MSG_ENROL, 0, &e.base, FUSION__MSG_TYPE__MSG_ENROL_ACK, timeout_ms);
}

/* What PeerList, asked by cl, says of the peer with key z85; false when it is not listed. */
static bool peer_seen(tu_client *cl, const char *z85, uint64_t *job, uint32_t *stage, Fusion__PeerState *state)
{
    wire_msg_t *m =
        tu_client_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    const Fusion__PeerList *pl = m ? wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_LIST) : NULL;
    bool found = false;
    for (size_t i = 0; pl && i < pl->n_peers; i++)
        if (strcmp(pl->peers[i]->peer_id, z85) == 0) {
            *job = pl->peers[i]->job_id;
            *stage = pl->peers[i]->stage_index;
            *state = pl->peers[i]->state;
            found = true;
        }
    wire_msg_destroy(&m);
    return found;
}

/* tu_client_open, but the connection comes from the local address src (another loopback address:
 * another address for the broker's bans), to the broker or through gateway gw (>= 0). Returns a
 * monitor of the connection's handshakes (handshake_result), or NULL when mon is false. */
static void *client_open_at(tu_client *cl, const tu_cluster *c, const char *key_name, const char *src, int gw, bool mon)
{
    memset(cl, 0, sizeof *cl);
    char keys[TU_PATH], server_key[TU_PATH], endpoint[TU_PATH];
    tu_path(c, keys, "%s", key_name);
    if (gw >= 0)
        tu_path(c, server_key, "gw%d/" WIRE_PUBLIC_KEY_FILE, gw);
    else
        tu_path(c, server_key, "broker/" WIRE_PUBLIC_KEY_FILE);
    fu_errmsg em = {{0}};
    uint8_t server[WIRE_KEY_BYTES];
    if (wire_keypair_load(keys, &cl->kp, &em) != FU_OK || wire_key_load_public(server_key, server, &em) != FU_OK)
        tu_fail("%s: %s", keys, fu_errmsg_text(&em, FU_EIO));
    const char *ep = gw >= 0 ? tu_gateway_endpoint(c, gw) : tu_broker_endpoint(c); /* tcp://127.0.0.1:PORT */
    snprintf(endpoint, sizeof endpoint, "tcp://%s:0;%s", src, ep + strlen("tcp://"));
    fu_err rc;
    cl->ctx = zmq_ctx_new();
    cl->sock = wire_socket_new(cl->ctx, ZMQ_DEALER, &rc);
    if (!cl->sock || wire_socket_curve_client(cl->sock, cl->kp, server) != FU_OK)
        tu_fail("cannot make a client socket: %s", zmq_strerror(zmq_errno()));
    void *m = NULL;
    if (mon) {
        static int n_mon;
        char mon_ep[64];
        snprintf(mon_ep, sizeof mon_ep, "inproc://test-handshakes-%d", ++n_mon);
        m = wire_monitor_open(cl->ctx, cl->sock, mon_ep,
                              ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH);
        if (!m)
            tu_fail("cannot watch the client's handshakes: %s", zmq_strerror(zmq_errno()));
    }
    if (zmq_connect(cl->sock, endpoint) != 0)
        tu_fail("cannot connect from %s to %s: %s", src, ep, zmq_strerror(zmq_errno()));
    randombytes_buf(&cl->session, sizeof cl->session);
    return m;
}

static void client_open_from(tu_client *cl, const tu_cluster *c, const char *key_name, const char *src)
{
    (void)client_open_at(cl, c, key_name, src, -1, false);
}

/* The first handshake outcome mon saw within timeout_ms: 1 admitted, -1 refused (ZAP said 400), 0
 * none. Stops the monitor (*mon_p is NULL after). */
static int handshake_result(tu_client *cl, void **mon_p, int timeout_ms)
{
    int result = 0;
    for (uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms; !result && fu_clock_ms() < end;) {
        zmq_pollitem_t it = {*mon_p, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0)
            continue;
        uint16_t ev;
        uint32_t value;
        while (!result && wire_monitor_next(*mon_p, &ev, &value))
            result = ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED ? 1 : ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? -1 : 0;
    }
    wire_monitor_close(cl->sock, mon_p);
    return result;
}

/* Lines of the broker's log that hold needle. */
static int log_lines(const tu_cluster *c, const char *needle)
{
    char *text = tu_broker_log_text(c);
    int n = 0;
    for (const char *at = strstr(text, needle); at; at = strstr(at + 1, needle))
        n++;
    free(text);
    return n;
}

/* ---- the policy of broker_auth.h, without processes ---- */

#define T0 1000000u /* a monotonic time to start from */

/* n wrong tokens from addr at now: the last verdict. */
static broker_auth_verdict fail_n(broker_auth *a, const char *addr, uint64_t now, int n)
{
    broker_auth_verdict v = {0};
    for (int i = 0; i < n; i++)
        broker_auth_failed(a, addr, now, &v);
    return v;
}

static void test_broker_roles_auth_bans_double_and_forget(void **state)
{
    (void)state;
    broker_auth *a = broker_auth_new();
    broker_auth_verdict v;
    broker_auth_failed(a, "1.2.3.4", T0, &v);
    assert_true(v.log_first); /* the first is logged */
    assert_false(v.log_summary);
    v = fail_n(a, "1.2.3.4", T0 + 10, 3);
    assert_false(v.log_first || v.log_summary); /* then silence */
    assert_false(broker_auth_banned(a, "1.2.3.4", T0 + 10));
    broker_auth_failed(a, "1.2.3.4", T0 + 20, &v); /* the fifth in a minute */
    assert_true(v.log_summary);
    assert_int_equal(v.more, 4);
    assert_int_equal(v.banned_until, T0 + 20 + BROKER_AUTH_BAN_MS);
    assert_true(broker_auth_banned(a, "1.2.3.4", T0 + 30));
    assert_true(broker_auth_banned(a, "1.2.3.4", T0 + 40));
    assert_false(broker_auth_banned(a, "5.6.7.8", T0 + 40)); /* another address */
    assert_false(broker_auth_banned(a, "1.2.3.4", v.banned_until));
    /* each repeat doubles the ban, up to the cap */
    uint64_t now = v.banned_until, len = BROKER_AUTH_BAN_MS;
    for (int k = 0; k < 8; k++) {
        broker_auth_failed(a, "1.2.3.4", now, &v);
        assert_true(v.log_first); /* a minute after the last line */
        if (k == 0)
            assert_int_equal(v.dropped, 2); /* the Enrols dropped during the first ban are said */
        v = fail_n(a, "1.2.3.4", now, (int)BROKER_AUTH_MAX_FAILS - 1);
        len = len * 2 > BROKER_AUTH_BAN_MAX_MS ? BROKER_AUTH_BAN_MAX_MS : len * 2;
        assert_true(v.log_summary);
        assert_int_equal(v.banned_until - now, len);
        now = v.banned_until;
    }
    assert_int_equal(len, BROKER_AUTH_BAN_MAX_MS);
    /* a quiet hour after the ban forgets the repeats */
    now += BROKER_AUTH_BAN_MAX_MS;
    v = fail_n(a, "1.2.3.4", now, (int)BROKER_AUTH_MAX_FAILS);
    assert_int_equal(v.banned_until - now, BROKER_AUTH_BAN_MS);
    /* wrong tokens spread over more than a window never ban */
    for (int k = 0; k < 10; k++) {
        v = fail_n(a, "9.9.9.9", T0 + (uint64_t)k * BROKER_AUTH_WINDOW_MS, (int)BROKER_AUTH_MAX_FAILS - 1);
        assert_false(v.log_summary);
        assert_false(broker_auth_banned(a, "9.9.9.9", T0 + (uint64_t)k * BROKER_AUTH_WINDOW_MS));
    }
    broker_auth_free(&a);
    assert_null(a);
}

static void test_broker_roles_auth_bounded(void **state)
{
    (void)state;
    broker_auth *a = broker_auth_new();
    broker_auth_verdict v;
    fail_n(a, "oldest", T0, (int)BROKER_AUTH_MAX_FAILS - 1);
    fail_n(a, "second", T0 + 1, (int)BROKER_AUTH_MAX_FAILS - 1);
    fail_n(a, "banned", T0 + 2, (int)BROKER_AUTH_MAX_FAILS); /* heard from early, but banned */
    char addr[32];
    for (unsigned i = 3; i < BROKER_AUTH_MAX_ADDRS; i++) {
        snprintf(addr, sizeof addr, "10.%u.%u.1", i / 256, i % 256);
        broker_auth_failed(a, addr, T0 + 10, &v);
    }
    broker_auth_failed(a, "newcomer", T0 + 20, &v); /* the table is full: one address goes */
    assert_true(v.log_first);
    /* the one heard from longest ago went, not the banned one nor the next oldest */
    assert_true(broker_auth_banned(a, "banned", T0 + 30));
    broker_auth_failed(a, "second", T0 + 30, &v); /* remembered: this is its fifth */
    assert_true(v.log_summary);
    broker_auth_failed(a, "oldest", T0 + 40, &v); /* forgotten: its count starts again */
    assert_false(v.log_summary);
    assert_true(v.log_first);
    broker_auth_free(&a);
}

static void test_broker_roles_client_cannot_be_a_peer(void **state)
{
    tu_broker_fx *f = *state;
    tu_keygen(f->c, "tenant", true);
    tu_allow_roles(f->c, "tenant", "client");
    tu_broker_fx_start(f);
    uint64_t id = submitted(tu_client_submit(&f->cl, f->spec, NULL));
    tu_client tenant;
    tu_client_open(&tenant, f->c, "tenant");
    wire_msg_t *m = hello(&tenant, "tenant");
    assert_int_equal(error_of(m, "not admitted as a peer: ask the operator for the peer role"),
                     FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    m = tu_client_call(&tenant, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base, FUSION__MSG_TYPE__MSG_HEARTBEAT, 3000);
    assert_int_equal(error_of(m, "not admitted as a peer"), FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    /* nothing is assigned to it while the job waits for a peer */
    uint64_t end = fu_clock_ms() + 1500;
    while (fu_clock_ms() < end) {
        m = tu_client_recv(&tenant, 200);
        if (m && wire_msg_type(m) == FUSION__MSG_TYPE__MSG_STAGE_ASSIGN)
            fail_msg("a client-only key was given a stage");
        wire_msg_destroy(&m);
    }
    /* the job was there to take: a peer gets it at once */
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p0", "p0", 4 * GiB, 50, "ready");
    char line[512], want[64];
    assert_true(tu_fake_peer_expect(&p, "ASSIGN", 5000, line, sizeof line));
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0", id);
    assert_memory_equal(line, want, strlen(want));
    /* the tenant remains a client: it submits */
    submitted(tu_client_submit(&tenant, f->spec, NULL));
    tu_client_close(&tenant);
    tu_fake_peer_stop(&p, SIGKILL);
}

static void test_broker_roles_peer_cannot_submit(void **state)
{
    tu_broker_fx *f = *state;
    tu_keygen(f->c, "worker", true);
    tu_allow_roles(f->c, "worker", "peer");
    tu_broker_fx_start(f);
    tu_client w;
    tu_client_open(&w, f->c, "worker");
    wire_msg_t *m = tu_client_submit(&w, f->spec, NULL);
    assert_int_equal(error_of(m, "not admitted as a client: ask the operator for the client role or the client "
                                 "enrolment token"),
                     FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    Fusion__JobListRequest lr = FUSION__JOB_LIST_REQUEST__INIT;
    m = tu_client_call(&w, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ, 0, &lr.base, FUSION__MSG_TYPE__MSG_JOB_LIST, 3000);
    assert_int_equal(error_of(m, "not admitted as a client"), FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    /* nothing was stored for it */
    m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ, 0, &lr.base, FUSION__MSG_TYPE__MSG_JOB_LIST, 3000);
    assert_non_null(m);
    assert_int_equal(((const Fusion__JobList *)wire_msg_body(m))->n_jobs, 0);
    wire_msg_destroy(&m);
    /* what it is for, it may do */
    m = hello(&w, "worker");
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_WELCOME);
    wire_msg_destroy(&m);
    tu_client_close(&w);
}

static void test_broker_roles_peer_list_hides_other_tenants(void **state)
{
    tu_broker_fx *f = *state;
    tu_keygen(f->c, "op", true);
    tu_allow_roles(f->c, "op", "operator");
    tu_broker_fx_start(f);
    uint64_t id = submitted(tu_client_submit(&f->cl, f->spec, NULL));
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p0", "p0", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p, "START", 8000, NULL, 0));
    char p0[41];
    tu_key_public(f->c, "p0", p0);
    tu_client other, op;
    tu_client_open(&other, f->c, "other");
    tu_client_open(&op, f->c, "op");
    uint64_t job = 0;
    uint32_t stage = 0;
    Fusion__PeerState st = 0;
    /* the owner sees its job */
    assert_true(peer_seen(&f->cl, p0, &job, &stage, &st));
    assert_int_equal(job, id);
    assert_int_equal(st, FUSION__PEER_STATE__PEER_STATE_BUSY);
    /* another tenant sees a busy peer, not whose job or which stage */
    assert_true(peer_seen(&other, p0, &job, &stage, &st));
    print_message("another tenant sees p0: state %d, job %" PRIx64 ", stage %u\n", (int)st, job, stage);
    assert_int_equal(job, 0);
    assert_int_equal(stage, 0);
    assert_int_equal(st, FUSION__PEER_STATE__PEER_STATE_BUSY);
    /* an operator sees everything */
    assert_true(peer_seen(&op, p0, &job, &stage, &st));
    assert_int_equal(job, id);
    /* an operator-only key is no client */
    wire_msg_t *m = tu_client_job_status(&op, id);
    assert_int_equal(error_of(m, "not admitted as a client"), FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    tu_client_close(&other);
    tu_client_close(&op);
    tu_fake_peer_stop(&p, SIGKILL);
}

/* 50 wrong enrolment tokens from cl as fast as the socket takes them: at most 5 are answered (each
 * an ERR_AUTH "enrolment refused"), then the address is banned and the rest dropped unanswered. */
static void brute_force(tu_client *cl)
{
    for (int i = 0; i < 50; i++) {
        char wrong[WIRE_KEY_Z85_LEN + 1];
        wire_token_generate(wrong);
        Fusion__Enrol e = FUSION__ENROL__INIT;
        e.token = wrong;
        e.name = (char *)"mallory";
        assert_int_equal(tu_client_send(cl, FUSION__MSG_TYPE__MSG_ENROL, 0, &e.base), FU_OK);
    }
    int answers = 0;
    for (wire_msg_t *m; (m = tu_client_recv(cl, 2000));) {
        assert_int_equal(error_of(m, "enrolment refused"), FUSION__ERROR_CODE__ERR_AUTH);
        wire_msg_destroy(&m);
        answers++;
    }
    print_message("50 wrong tokens: %d answers\n", answers);
    assert_true(answers >= 1 && answers <= 5);
}

static void test_broker_roles_enrolment_brute_force_banned(void **state)
{
    tu_broker_fx *f = *state;
    char token[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(token);
    tu_cluster_opts(f->c)->enrol_token = token;
    tu_keygen(f->c, "mallory", false);
    tu_keygen(f->c, "mallory2", false);
    tu_keygen(f->c, "newcomer", false);
    tu_broker_fx_start(f);
    tu_client mal;
    tu_client_open(&mal, f->c, "mallory");
    brute_force(&mal);
    /* banned: the right token on the same connection is dropped, and a new key from the address
     * does not get past the handshake */
    assert_null(enrol(&mal, token, 1500));
    tu_client mal2;
    tu_client_open(&mal2, f->c, "mallory2");
    assert_null(enrol(&mal2, token, 1500));
    char key[41], allow[TU_PATH];
    tu_key_public(f->c, "mallory", key);
    tu_path(f->c, allow, "allow");
    char *text = tu_file_text(allow);
    assert_null(strstr(text, key));
    free(text);
    /* another address enrols with the right token */
    tu_client nc;
    client_open_from(&nc, f->c, "newcomer", "127.0.0.2");
    wire_msg_t *m = enrol(&nc, token, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ENROL_ACK);
    wire_msg_destroy(&m);
    assert_true(tu_broker_wait_log(f->c, 3000, "from 127.0.0.2 as client,peer"));
    /* and the log holds a few lines about it all, not one per try */
    int wrong_lines = log_lines(f->c, "wrong enrolment token");
    print_message("log lines about wrong tokens: %d\n", wrong_lines);
    assert_true(tu_broker_logged(f->c, "wrong enrolment token from 127.0.0.1"));
    assert_true(tu_broker_logged(f->c, "more wrong enrolment tokens from 127.0.0.1, banned until"));
    assert_true(wrong_lines <= 3);
    assert_int_equal(log_lines(f->c, "refused MSG_ENROL"), 0);
    tu_client_close(&nc);
    tu_client_close(&mal2);
    tu_client_close(&mal);
}

/* Appends n random keys (peer role) to the allow-list: a list of many batches for the gateways. */
static void add_random_keys(const tu_cluster *c, int n)
{
    char allow[TU_PATH];
    tu_path(c, allow, "allow");
    FILE *f = fopen(allow, "a");
    assert_non_null(f);
    for (int i = 0; i < n; i++) {
        uint8_t key[WIRE_KEY_BYTES];
        char z85[WIRE_KEY_Z85_LEN + 1];
        randombytes_buf(key, sizeof key);
        wire_key_to_z85(key, z85);
        fprintf(f, "%s peer\n", z85);
    }
    assert_int_equal(fclose(f), 0);
}

/* Connects key_name from src through gateway 0: 1 admitted, -1 refused at the handshake, 0 neither
 * within 3 s. The client stays open in *cl. */
static int via_gateway(tu_client *cl, const tu_cluster *c, const char *key_name, const char *src)
{
    void *mon = client_open_at(cl, c, key_name, src, 0, true);
    int r = handshake_result(cl, &mon, 3000);
    print_message("%s from %s through the gateway: %s\n", key_name, src,
                  r > 0 ? "admitted" : r < 0 ? "refused at the handshake" : "no handshake");
    return r;
}

/* The member "client" connects from 127.0.0.1 through gateway 0, gets in and is answered. */
static void member_through_gateway(tu_client *cl, const tu_cluster *c)
{
    assert_int_equal(via_gateway(cl, c, "client", "127.0.0.1"), 1);
    wire_msg_t *m =
        tu_client_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    assert_non_null(m);
    wire_msg_destroy(&m);
}

/* A gateway admits as the broker does (docs/PROTOCOL.md "Gateways"; SECURITY.md "Gateways"). With
 * enrolment open a stranger gets in to enrol; its 50 wrong tokens, sent through the gateway, ban its
 * address at the broker, which tells the gateway: a new key from that address is then refused at
 * the gateway's handshake (not just unanswered at the broker), while a member from it still gets in.
 * A key enrolled from another address is a member at the gateway at once, so it gets in even from
 * the banned one. The list holds 5,000 more keys: it reaches the gateway in 3 batches. */
static void test_broker_roles_gateway_admits_as_the_broker(void **state)
{
    (void)state;
    char token[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(token);
    tu_opts o = tu_opts_broker_alone();
    o.gateways = 1;
    o.enrol_token = token;
    tu_cluster *c = tu_cluster_new("gw-admission", &o);
    tu_keygen(c, "mallory", false);
    tu_keygen(c, "mallory2", false);
    tu_keygen(c, "newcomer", false);
    add_random_keys(c, 5000);
    tu_broker_start(c);
    tu_gateway_start(c, 0);
    if (!tu_file_wait(tu_gateway_log(c, 0), "admission as the broker's: ", 10000)) {
        tu_file_show(tu_gateway_log(c, 0), 20);
        fail_msg("the gateway never applied the broker's admission");
    }
    assert_true(tu_broker_logged(c, " keys in 3 messages, 0 bans, enrolment open)"));
    tu_client mal, mal2, member, nc;
    assert_int_equal(via_gateway(&mal, c, "mallory", "127.0.0.1"), 1); /* a stranger, to enrol */
    brute_force(&mal);
    assert_true(tu_broker_logged(c, "more wrong enrolment tokens from 127.0.0.1, banned until"));
    assert_true(tu_file_wait(tu_gateway_log(c, 0), "address 127.0.0.1 banned for ", 3000));
    /* a new key from the banned address: the gateway's handshake refuses it */
    assert_int_equal(via_gateway(&mal2, c, "mallory2", "127.0.0.1"), -1);
    /* a member from the same address gets in, and the broker answers it */
    member_through_gateway(&member, c);
    /* a newcomer enrols from another address; its key is a member at the gateway at once */
    assert_int_equal(via_gateway(&nc, c, "newcomer", "127.0.0.2"), 1);
    wire_msg_t *m = enrol(&nc, token, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ENROL_ACK);
    wire_msg_destroy(&m);
    tu_client_close(&nc);
    assert_int_equal(via_gateway(&nc, c, "newcomer", "127.0.0.1"), 1);
    tu_client_close(&nc);
    tu_client_close(&member);
    tu_client_close(&mal2);
    tu_client_close(&mal);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Enrolment closed: a key off the allow-list is refused at the gateway's handshake, as at the
 * broker's, and a member gets in. */
static void test_broker_roles_gateway_refuses_strangers(void **state)
{
    (void)state;
    tu_opts o = tu_opts_broker_alone();
    o.gateways = 1;
    tu_cluster *c = tu_cluster_new("gw-strangers", &o);
    tu_keygen(c, "stranger", false);
    tu_broker_start(c);
    tu_gateway_start(c, 0);
    assert_true(tu_file_wait(tu_gateway_log(c, 0), "enrolment closed", 10000));
    tu_client st, member;
    assert_int_equal(via_gateway(&st, c, "stranger", "127.0.0.1"), -1);
    member_through_gateway(&member, c);
    tu_client_close(&member);
    tu_client_close(&st);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_broker_roles_token_per_role(void **state)
{
    tu_broker_fx *f = *state;
    char ptok[WIRE_KEY_Z85_LEN + 1], ctok[WIRE_KEY_Z85_LEN + 1];
    wire_token_generate(ptok);
    wire_token_generate(ctok);
    tu_keygen(f->c, "joiner", false);
    tu_keygen(f->c, "buyer", false);
    /* from the environment, as a service manager would pass them */
    setenv("FUSION_PEER_TOKEN", ptok, 1);
    setenv("FUSION_CLIENT_TOKEN", ctok, 1);
    tu_broker_fx_start(f);
    unsetenv("FUSION_PEER_TOKEN");
    unsetenv("FUSION_CLIENT_TOKEN");
    assert_true(tu_broker_logged(f->c, "allow-list + enrolment as peer, client"));
    /* the peer token makes a peer */
    tu_client j;
    tu_client_open(&j, f->c, "joiner");
    wire_msg_t *m = enrol(&j, ptok, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ENROL_ACK);
    wire_msg_destroy(&m);
    m = hello(&j, "joiner"); /* on the same connection: the live list decides */
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_WELCOME);
    wire_msg_destroy(&m);
    m = tu_client_submit(&j, f->spec, NULL);
    assert_int_equal(error_of(m, "not admitted as a client"), FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    /* the client token a client */
    tu_client b;
    tu_client_open(&b, f->c, "buyer");
    m = enrol(&b, ctok, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ENROL_ACK);
    wire_msg_destroy(&m);
    submitted(tu_client_submit(&b, f->spec, NULL));
    m = hello(&b, "buyer");
    assert_int_equal(error_of(m, "not admitted as a peer"), FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    /* each is on the allow-list with its role for the next start */
    char allow[TU_PATH], key[41], line[64];
    tu_path(f->c, allow, "allow");
    char *text = tu_file_text(allow);
    tu_key_public(f->c, "joiner", key);
    snprintf(line, sizeof line, "%s peer\n", key);
    assert_non_null(strstr(text, line));
    tu_key_public(f->c, "buyer", key);
    snprintf(line, sizeof line, "%s client\n", key);
    assert_non_null(strstr(text, line));
    free(text);
    tu_client_close(&j);
    tu_client_close(&b);
}

int main(int argc, char **argv)
{
    if (tu_fake_peer_requested(argc, argv))
        return tu_fake_peer_main(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_broker_roles_auth_bans_double_and_forget),
        cmocka_unit_test(test_broker_roles_auth_bounded),
        tu_broker_test(test_broker_roles_client_cannot_be_a_peer),
        tu_broker_test(test_broker_roles_peer_cannot_submit),
        tu_broker_test(test_broker_roles_peer_list_hides_other_tenants),
        tu_broker_test(test_broker_roles_enrolment_brute_force_banned),
        tu_broker_test(test_broker_roles_token_per_role),
        cmocka_unit_test_teardown(test_broker_roles_gateway_admits_as_the_broker, tu_teardown),
        cmocka_unit_test_teardown(test_broker_roles_gateway_refuses_strangers, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
