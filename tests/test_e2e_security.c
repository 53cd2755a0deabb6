/* End to end, hostile clients, against the real programs (tests/e2e_util.h):
 *   - unknown_key_refused: `fusion` with a key pair that is not on the broker's allow-list exits 3
 *     ("refused") with a sentence that says what to do, for a read (peers) and a write (submit);
 *   - garbage_spares_the_job: while a three-stage fine-tune runs, raw TCP connections to the broker's
 *     port send random bytes, half a ZMTP greeting (left open), and full greetings followed by a frame
 *     announcing a huge length; the broker keeps serving, and the job finishes with the adapter of the
 *     uninterrupted `fusion run finetune`. (test_broker_peers sends garbage with a fake peer and no
 *     job; this one checks that a running pipeline is not disturbed.) */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <sodium.h>

#include "e2e_util.h"

static void test_e2e_security_unknown_key_refused(void **state)
{
    (void)state;
    e2e_cluster c;
    e2e_cluster_init(&c, "e2e-key", 1);
    c.backups = 0;
    e2e_cluster_start(&c);
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "'%s' keygen -o '%s/stranger'", tu_bin("fusion"), c.dir), 0);
    free(out);
    /* --keys on the command line wins over the configuration file's keys */
    int rc = e2e_fusion(&c, &out, "peers --keys stranger");
    printf("fusion peers with an unknown key: exit %d: %s", rc, out);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "refused this client's key"));
    free(out);
    rc = e2e_fusion(&c, &out, "submit finetune --keys stranger --model model --data '%s' --steps 2 -q", c.data);
    printf("fusion submit with an unknown key: exit %d: %s", rc, out);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "refused"));
    free(out);
    /* the allowed client is served, and nothing was stored for the stranger's attempt */
    rc = e2e_fusion(&c, &out, "jobs --json");
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "[]"));
    free(out);
    e2e_cluster_stop(&c);
}

static int tcp_connect(int port)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(s >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(connect(s, (struct sockaddr *)&a, sizeof a), 0);
    return s;
}

/* A ZMTP 3.0 greeting (64 bytes) offering the given mechanism. */
static void greeting(uint8_t g[64], const char *mechanism)
{
    memset(g, 0, 64);
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; /* version 3.0 */
    g[11] = 0;
    memcpy(g + 12, mechanism, strlen(mechanism));
}

/* One round of hostile connections; returns the sockets left open in keep[] (half greetings). */
static size_t hostile_round(int port, int *keep, size_t cap)
{
    size_t nk = 0;
    uint8_t junk[4096];
    for (int i = 0; i < 8; i++) { /* random bytes */
        int s = tcp_connect(port);
        randombytes_buf(junk, sizeof junk);
        ssize_t w = write(s, junk, (size_t)(100 + i * 500));
        (void)w;
        close(s);
    }
    for (int i = 0; i < 2 && nk < cap; i++) { /* half a greeting, left hanging */
        int s = tcp_connect(port);
        uint8_t g[64];
        greeting(g, "CURVE");
        ssize_t w = write(s, g, 11);
        (void)w;
        keep[nk++] = s;
    }
    const char *mechs[] = {"CURVE", "NULL", "PLAIN"};
    for (int i = 0; i < 3; i++) { /* a whole greeting, then a frame announcing 2^62 bytes */
        int s = tcp_connect(port);
        uint8_t g[64 + 9 + 64];
        greeting(g, mechs[i]);
        g[64] = 0x06; /* long command frame */
        uint64_t huge = (uint64_t)1 << 62;
        for (int b = 0; b < 8; b++)
            g[65 + b] = (uint8_t)(huge >> (56 - 8 * b));
        randombytes_buf(g + 73, 64);
        ssize_t w = write(s, g, sizeof g);
        (void)w;
        close(s);
    }
    return nk;
}

static void test_e2e_security_garbage_spares_the_job(void **state)
{
    (void)state;
    e2e_cluster c;
    e2e_cluster_init(&c, "e2e-garbage", 3);
    c.backups = 0;
    e2e_cluster_start(&c);
    const char *train = E2E_TRAIN_ARGS " --steps 60";
    char id[17];
    e2e_submit(&c, id, "finetune --model model --data '%s' %s --checkpoint-every 10", c.data, train);
    (void)e2e_wait_step(&c, id, 5, 60000);
    int port = atoi(strrchr(c.endpoint, ':') + 1);
    assert_true(port > 0);
    int keep[16];
    size_t nk = 0;
    long rounds = 0;
    e2e_status st;
    /* Keep attacking while the job runs (at least 3 rounds). */
    do {
        nk += hostile_round(port, keep + nk, sizeof keep / sizeof keep[0] - nk);
        rounds++;
        assert_true(e2e_get_status(&c, id, &st));
        assert_int_equal(kill(c.broker, 0), 0);
    } while (rounds < 3 || (strcmp(st.state, "running") == 0 && rounds < 200));
    printf("%ld rounds of hostile connections (%zu half greetings left open) while job %s ran to step %ld (%s)\n",
           rounds, nk, id, st.step, st.state);
    e2e_wait_done(&c, id, 60);
    for (size_t i = 0; i < nk; i++)
        close(keep[i]);
    /* the broker still serves */
    char *out = NULL;
    assert_int_equal(e2e_fusion(&c, &out, "peers"), 0);
    free(out);
    double d = e2e_job_vs_reference(&c, id, "model", train);
    assert_true(d <= 1e-5);
    e2e_cluster_stop(&c);
}

int main(int argc, char **argv)
{
    if (sodium_init() < 0)
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_security_unknown_key_refused, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_security_garbage_spares_the_job, e2e_teardown),
    };
    return e2e_main(argc, argv, tests, sizeof tests / sizeof tests[0], "e2e_security");
}
