/* The real fusion-broker process with real peer processes on loopback: join and leave, the link
 * probe and the bandwidth heartbeats carry, heartbeat
 * timeout of a SIGSTOPped peer (detection time measured), re-registration, an unknown key refused
 * in allow-list mode, garbage bytes on the broker's port, slots, a closed connection declared dead
 * at once (detection time measured), clean stop on SIGTERM. */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <sodium.h>
#include <zmq.h>

#include "cluster.h"
#include "fake_peer.h"
#include "fu_clock.h"
#include "testutil.h"
#include "wire_zap.h"

#define GiB (1ull << 30)

static void test_broker_peers_join_and_leave(void **state)
{
    tu_broker_fx *f = *state;
    char key[41], line[512];
    tu_key_public(f->c, "p1", key);
    tu_broker_fx_start(f);
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p1", "p1", 2 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, line, sizeof line));
    assert_string_equal(line, "WELCOME 1000 3000");
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_IDLE, 3000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    /* SIGTERM: the peer sends Leave, the broker acknowledges, the peer exits; the registry says gone */
    kill(p.pid, SIGTERM);
    assert_true(tu_fake_peer_expect(&p, "LEAVE", 3000, NULL, 0));
    assert_true(tu_fake_peer_expect(&p, "RELEASE", 3000, line, sizeof line));
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_DEAD, 3000),
                     FUSION__PEER_STATE__PEER_STATE_DEAD);
    assert_int_equal(tu_fake_peer_stop(&p, SIGTERM), 0);
    /* the same key joins again */
    tu_fake_peer_start(&p, f->c, "p1", "p1-again", 2 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_IDLE, 3000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    tu_fake_peer_stop(&p, SIGKILL);
    /* SIGTERM stops the broker cleanly */
    assert_int_equal(tu_broker_stop(f->c, SIGTERM), 0);
}

/* The link probe: a registered peer gets the payload it asked for, at most 4 MiB, once a minute
 * (then ERR_BUSY); a key that never said PeerHello gets nothing; the bandwidth a heartbeat then
 * reports is what the peer list shows, and an absurd one is not believed. */
static double listed_link_bw(tu_client *cl, const char *key)
{
    wire_msg_t *m =
        tu_client_call(cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    assert_non_null(m);
    const Fusion__PeerList *l = (const Fusion__PeerList *)wire_msg_body(m);
    double bw = -1;
    for (size_t i = 0; l && i < l->n_peers; i++)
        if (strcmp(l->peers[i]->peer_id, key) == 0 && l->peers[i]->profile)
            bw = l->peers[i]->profile->link_bandwidth_bps;
    wire_msg_destroy(&m);
    return bw;
}

static void test_broker_peers_link_probe(void **state)
{
    tu_broker_fx *f = *state;
    char key[41];
    tu_key_public(f->c, "p0", key);
    tu_broker_fx_start(f);
    tu_client pc;
    tu_client_open(&pc, f->c, "p0");
    Fusion__LinkProbeRequest rq = FUSION__LINK_PROBE_REQUEST__INIT;
    rq.bytes = 100u << 20;
    /* not registered yet: no payload */
    wire_msg_t *m = tu_client_call(&pc, FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ, 0, &rq.base,
                                   FUSION__MSG_TYPE__MSG_LINK_PROBE, 1000);
    assert_true(m == NULL || wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR);
    wire_msg_destroy(&m);
    tu_client_hello(&pc, "prober", 2 * GiB, 50);
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_IDLE, 3000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    m = tu_client_call(&pc, FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ, 0, &rq.base, FUSION__MSG_TYPE__MSG_LINK_PROBE, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_LINK_PROBE);
    const Fusion__LinkProbe *lp = (const Fusion__LinkProbe *)wire_msg_body(m);
    assert_int_equal(lp->data.len, 4u << 20); /* capped */
    wire_msg_destroy(&m);
    m = tu_client_call(&pc, FUSION__MSG_TYPE__MSG_LINK_PROBE_REQ, 0, &rq.base, FUSION__MSG_TYPE__MSG_LINK_PROBE, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m))->code, FUSION__ERROR_CODE__ERR_BUSY);
    wire_msg_destroy(&m);
    /* the measured bandwidth, carried by a heartbeat, replaces the hello's */
    assert_true(listed_link_bw(&f->cl, key) == 1e9);
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    hb.state = FUSION__PEER_STATE__PEER_STATE_IDLE;
    hb.link_bandwidth_bps = 123.5e6;
    assert_int_equal(tu_client_send(&pc, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base), FU_OK);
    double bw = -1;
    for (int i = 0; i < 40 && bw != 123.5e6; i++, fu_sleep_ms(50))
        bw = listed_link_bw(&f->cl, key);
    assert_true(bw == 123.5e6);
    hb.link_bandwidth_bps = 1e15; /* not believed */
    assert_int_equal(tu_client_send(&pc, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base), FU_OK);
    hb.link_bandwidth_bps = NAN;
    assert_int_equal(tu_client_send(&pc, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base), FU_OK);
    fu_sleep_ms(200);
    assert_true(listed_link_bw(&f->cl, key) == 123.5e6);
    /* A quiet heartbeat (fusion-peer's) is heard and not answered; another one is answered. */
    for (wire_msg_t *old = tu_client_recv(&pc, 300); old; old = tu_client_recv(&pc, 300))
        wire_msg_destroy(&old); /* the answers to the three heartbeats above */
    hb.link_bandwidth_bps = 0;
    hb.quiet = true;
    assert_int_equal(tu_client_send(&pc, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base), FU_OK);
    wire_msg_t *none = tu_client_recv(&pc, 600);
    if (none)
        fail_msg("a quiet heartbeat was answered with a %s", wire_type_name(wire_msg_type(none)));
    hb.quiet = false;
    m = tu_client_call(&pc, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base, FUSION__MSG_TYPE__MSG_HEARTBEAT, 3000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_HEARTBEAT);
    wire_msg_destroy(&m);
    tu_client_close(&pc);
}

static void test_broker_peers_sigstop_is_dead(void **state)
{
    tu_broker_fx *f = *state;
    char key[41];
    tu_key_public(f->c, "p2", key);
    tu_broker_fx_start(f);
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p2", "stopped", 2 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_IDLE, 3000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    fu_sleep_ms(600); /* let it beat a few times */
    int cores = tu_load_start(0); /* timed: against one busy loop per core (docs/TESTING.md) */
    uint64_t t0 = fu_clock_ms();
    kill(p.pid, SIGSTOP); /* the socket stays open: only the heartbeats tell */
    int st = tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_DEAD, 8000);
    uint64_t dt = fu_clock_ms() - t0;
    tu_load_stop();
    print_message("heartbeat timeout: a SIGSTOPped peer was declared dead after %llu ms (heartbeat 1000 ms, dead "
                  "after 3000 ms; %d busy loops)\n", (unsigned long long)dt, cores);
    assert_int_equal(st, FUSION__PEER_STATE__PEER_STATE_DEAD);
    assert_true(dt <= 5000);
    assert_true(dt >= 2000); /* not before its silence was long enough */
    /* its connection stayed open: the heartbeat rule, not the closed-connection one (broker_conn.c) */
    assert_true(tu_broker_logged(f->c, "peer %.8s (stopped) is dead: silent for", key));
    assert_false(tu_broker_logged(f->c, "connection closed"));
    /* SIGCONT: its next heartbeat is refused, it registers again and is live */
    kill(p.pid, SIGCONT);
    assert_true(tu_fake_peer_expect(&p, "REHELLO", 5000, NULL, 0));
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_IDLE, 5000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    tu_fake_peer_stop(&p, SIGKILL);
}

static void test_broker_peers_unknown_key_refused(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    tu_keygen(f->c, "stranger", false); /* not on the allow-list */
    tu_client sc;
    tu_client_open(&sc, f->c, "stranger");
    wire_msg_t *m =
        tu_client_call(&sc, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 1500);
    assert_null(m); /* ZAP refused the handshake: nothing reaches the broker */
    tu_client_close(&sc);
    /* the allowed client is still served, and no job was stored for anyone */
    Fusion__JobListRequest lr = FUSION__JOB_LIST_REQUEST__INIT;
    lr.include_done = true;
    m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ, 0, &lr.base, FUSION__MSG_TYPE__MSG_JOB_LIST, 3000);
    assert_non_null(m);
    assert_int_equal(((const Fusion__JobList *)wire_msg_body(m))->n_jobs, 0);
    wire_msg_destroy(&m);
}

static void test_broker_peers_enrolment_token(void **state)
{
    tu_broker_fx *f = *state;
    char token[WIRE_KEY_Z85_LEN + 1], key[41];
    wire_token_generate(token);
    tu_cluster_opts(f->c)->enrol_token = token;
    tu_broker_fx_start(f);
    tu_keygen(f->c, "newcomer", false);
    tu_key_public(f->c, "newcomer", key);
    tu_client nc;
    tu_client_open(&nc, f->c, "newcomer");
    /* admitted as "enrolling": anything but Enrol is refused, saying what to do */
    wire_msg_t *m =
        tu_client_call(&nc, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m))->code, FUSION__ERROR_CODE__ERR_AUTH);
    wire_msg_destroy(&m);
    Fusion__Enrol e = FUSION__ENROL__INIT;
    e.token = (char *)"0000000000000000000000000000000000000000";
    e.name = (char *)"newcomer";
    m = tu_client_call(&nc, FUSION__MSG_TYPE__MSG_ENROL, 0, &e.base, FUSION__MSG_TYPE__MSG_ENROL_ACK, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR); /* wrong token */
    wire_msg_destroy(&m);
    e.token = token;
    m = tu_client_call(&nc, FUSION__MSG_TYPE__MSG_ENROL, 0, &e.base, FUSION__MSG_TYPE__MSG_ENROL_ACK, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ENROL_ACK);
    assert_string_equal(((const Fusion__EnrolAck *)wire_msg_body(m))->peer_id, key);
    wire_msg_destroy(&m);
    /* now a member: served */
    m = tu_client_call(&nc, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_LIST);
    wire_msg_destroy(&m);
    tu_client_close(&nc);
    /* and on the allow-list file for the next start */
    char allow[TU_PATH], *out = NULL;
    tu_path(f->c, allow, "allow");
    assert_int_equal(tu_sh(&out, "grep -cF -e '%s' '%s'", key, allow), 0);
    free(out);
}

static void test_broker_peers_garbage_on_the_port(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    uint8_t junk[4096];
    for (int round = 0; round < 20; round++) {
        int s = tu_broker_connect_raw(f->c);
        randombytes_buf(junk, sizeof junk);
        if (round % 4 == 0) /* a ZMTP greeting signature, then junk */
            memcpy(junk, "\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", 10);
        ssize_t w = write(s, junk, (size_t)(64 + round * 200));
        (void)w;
        close(s);
    }
    /* the broker still serves */
    wire_msg_t *m =
        tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_LIST);
    wire_msg_destroy(&m);
    assert_true(tu_broker_alive(f->c));
    /* an authenticated client sending a malformed body gets an Error, and the broker goes on */
    uint8_t env_junk[] = {0x08, 0x01, 0x10, 13};       /* Envelope{version 1, type JOB_SUBMIT} */
    uint8_t body_junk[] = {0x0a, 0xff, 0xff, 0xff, 0x7f}; /* a string field longer than the frame */
    zmq_send(f->cl.sock, env_junk, sizeof env_junk, ZMQ_SNDMORE);
    zmq_send(f->cl.sock, body_junk, sizeof body_junk, 0);
    m = tu_client_recv(&f->cl, 3000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    wire_msg_destroy(&m);
    m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    assert_non_null(m);
    wire_msg_destroy(&m);
}

/* The next message of type want on cl (challenges answered on the way), NULL on timeout. */
static wire_msg_t *expect_type(tu_client *cl, Fusion__MsgType want, int timeout_ms)
{
    for (uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms; fu_clock_ms() < end;) {
        wire_msg_t *m = tu_client_recv(cl, 200);
        if (m && wire_msg_type(m) == want)
            return m;
        wire_msg_destroy(&m);
    }
    return NULL;
}

/* Slots (fusion-peer --slots): one key speaks as several peers, each on its own connection with
 * Envelope.slot. Slot 0 is the key itself; slot 1 is another peer of another name (a hash of the key
 * and the slot), listed apart and leaving apart. A slot out of range is refused, and neither a slot
 * the key never registered nor another key's slot of the same number is a registered peer. */
static void test_broker_peers_slots(void **state)
{
    tu_broker_fx *f = *state;
    char key[41];
    tu_key_public(f->c, "p0", key);
    tu_broker_fx_start(f);
    tu_client s0, s1, bad, other;
    tu_client_open(&s0, f->c, "p0");
    tu_client_open(&s1, f->c, "p0");
    s1.slot = 1;
    tu_client_hello(&s0, "slotted#0", 2 * GiB, 50);
    tu_client_hello(&s1, "slotted#1", 2 * GiB, 50);
    wire_msg_t *w0 = expect_type(&s0, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000);
    wire_msg_t *w1 = expect_type(&s1, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000);
    assert_non_null(w0);
    assert_non_null(w1);
    const char *id0 = ((const Fusion__PeerWelcome *)wire_msg_body(w0))->peer_id;
    char id1[41];
    snprintf(id1, sizeof id1, "%s", ((const Fusion__PeerWelcome *)wire_msg_body(w1))->peer_id);
    printf("slot 0: %s, slot 1: %s\n", id0, id1);
    assert_string_equal(id0, key);
    assert_int_equal(strlen(id1), 40);
    assert_string_not_equal(id1, key);
    wire_msg_destroy(&w0);
    wire_msg_destroy(&w1);
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_IDLE, 3000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    assert_int_equal(tu_client_wait_peer_state(&f->cl, id1, FUSION__PEER_STATE__PEER_STATE_IDLE, 3000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    /* out of range */
    tu_client_open(&bad, f->c, "p0");
    bad.slot = 8;
    tu_client_hello(&bad, "slotted#8", 2 * GiB, 50);
    wire_msg_t *m = expect_type(&bad, FUSION__MSG_TYPE__MSG_ERROR, 3000);
    assert_non_null(m);
    printf("slot 8: %s\n", ((const Fusion__Error *)wire_msg_body(m))->message);
    assert_non_null(strstr(((const Fusion__Error *)wire_msg_body(m))->message, "slot 8 is out of range"));
    wire_msg_destroy(&m);
    /* a slot never registered, and another key's slot 1: not registered peers */
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    hb.state = FUSION__PEER_STATE__PEER_STATE_IDLE;
    bad.slot = 2;
    hb.quiet = true; /* an Error still answers a quiet heartbeat: it is how a peer learns to register again */
    m = tu_client_call(&bad, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base, FUSION__MSG_TYPE__MSG_ERROR, 3000);
    assert_non_null(m);
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m))->code, FUSION__ERROR_CODE__ERR_NOT_FOUND);
    wire_msg_destroy(&m);
    tu_client_open(&other, f->c, "p1");
    other.slot = 1;
    m = tu_client_call(&other, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base, FUSION__MSG_TYPE__MSG_ERROR, 3000);
    assert_non_null(m);
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m))->code, FUSION__ERROR_CODE__ERR_NOT_FOUND);
    wire_msg_destroy(&m);
    /* slot 1 leaves; slot 0 stays */
    Fusion__Leave lv = FUSION__LEAVE__INIT;
    lv.reason = (char *)"test";
    assert_int_equal(tu_client_send(&s1, FUSION__MSG_TYPE__MSG_LEAVE, 0, &lv.base), FU_OK);
    assert_int_equal(tu_client_wait_peer_state(&f->cl, id1, FUSION__PEER_STATE__PEER_STATE_DEAD, 3000),
                     FUSION__PEER_STATE__PEER_STATE_DEAD);
    assert_int_equal(tu_client_peer_state(&f->cl, key), FUSION__PEER_STATE__PEER_STATE_IDLE);
    tu_client_close(&other);
    tu_client_close(&bad);
    tu_client_close(&s1);
    tu_client_close(&s0);
}

/* A peer's connection closing (broker_conn.c): the same process on a new socket before its old one
 * closes keeps its registration; when its connection closes for good (no Leave) it is declared dead
 * "connection closed" long before its silence would tell (grace 250 ms, dead after 3000 ms), and so
 * is a second slot of the process on that connection. */
static void test_broker_peers_closed_connection(void **state)
{
    tu_broker_fx *f = *state;
    char key[41], id1[41];
    tu_key_public(f->c, "p1", key);
    tu_broker_fx_start(f);
    /* timed: against one busy loop per core (docs/TESTING.md), forked before the sockets are opened
     * (a child holding a copy of a connection's descriptor would keep it open) */
    int cores = tu_load_start(0);
    tu_client a, b;
    tu_client_open(&a, f->c, "p1");
    tu_client_hello(&a, "conn", 2 * GiB, 50);
    wire_msg_t *w = expect_type(&a, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000);
    assert_non_null(w);
    wire_msg_destroy(&w);
    /* a new socket of the same process (same session), then the old one closes */
    tu_client_open(&b, f->c, "p1");
    b.session = a.session;
    tu_client_hello(&b, "conn", 2 * GiB, 50);
    w = expect_type(&b, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000);
    assert_non_null(w);
    wire_msg_destroy(&w);
    assert_true(tu_broker_wait_log(f->c, 3000, "peer %.8s (conn) said hello again (same session)", key));
    tu_client_close(&a);
    fu_sleep_ms(800); /* three graces, well within its heartbeat silence (3000 ms) */
    assert_int_not_equal(tu_client_peer_state(&f->cl, key), FUSION__PEER_STATE__PEER_STATE_DEAD);
    assert_false(tu_broker_logged(f->c, "is dead"));
    /* slot 1 of the process on the same connection */
    b.slot = 1;
    tu_client_hello(&b, "conn#1", 2 * GiB, 50);
    w = expect_type(&b, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000);
    assert_non_null(w);
    snprintf(id1, sizeof id1, "%s", ((const Fusion__PeerWelcome *)wire_msg_body(w))->peer_id);
    wire_msg_destroy(&w);
    /* the connection closes without a Leave, as when the process is killed */
    uint64_t t0 = fu_clock_ms();
    tu_client_close(&b);
    int st0 = tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_DEAD, 2500);
    int st1 = tu_client_wait_peer_state(&f->cl, id1, FUSION__PEER_STATE__PEER_STATE_DEAD, 2500);
    uint64_t dt = fu_clock_ms() - t0;
    tu_load_stop();
    print_message("closed connection: both slots declared dead %llu ms after their connection closed (grace 250 "
                  "ms, dead after 3000 ms; %d busy loops)\n", (unsigned long long)dt, cores);
    assert_int_equal(st0, FUSION__PEER_STATE__PEER_STATE_DEAD);
    assert_int_equal(st1, FUSION__PEER_STATE__PEER_STATE_DEAD);
    assert_true(tu_broker_logged(f->c, "peer %.8s (conn) is dead: connection closed", key));
    assert_true(tu_broker_logged(f->c, "peer %.8s (conn#1) is dead: connection closed", id1));
    assert_false(tu_broker_logged(f->c, "silent for"));
    assert_true(dt < 2500); /* the silence rule could not have fired before 3000 ms */
}

int main(int argc, char **argv)
{
    if (tu_fake_peer_requested(argc, argv))
        return tu_fake_peer_main(argc, argv);
    const struct CMUnitTest tests[] = {
        tu_broker_test(test_broker_peers_join_and_leave),
        tu_broker_test(test_broker_peers_link_probe),
        tu_broker_test(test_broker_peers_sigstop_is_dead),
        tu_broker_test(test_broker_peers_unknown_key_refused),
        tu_broker_test(test_broker_peers_enrolment_token),
        tu_broker_test(test_broker_peers_garbage_on_the_port),
        tu_broker_test(test_broker_peers_slots),
        tu_broker_test(test_broker_peers_closed_connection),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
