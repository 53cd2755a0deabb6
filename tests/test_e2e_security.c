/* End to end, hostile clients, against the real programs (the test cluster, tests/cluster.h):
 *   - unknown_key_refused: `fusion` with a key pair that is not on the broker's allow-list exits 3
 *     ("refused") with a sentence that says what to do, for a read (peers) and a write (submit);
 *   - garbage_spares_the_job: while a three-stage fine-tune runs, raw TCP connections to the broker's
 *     port send random bytes, half a ZMTP greeting (left open), and full greetings followed by a frame
 *     announcing a huge length; the broker keeps serving, and the job finishes with the adapter of the
 *     uninterrupted `fusion run finetune`. (test_broker_peers sends garbage with a fake peer and no
 *     job; this one checks that a running pipeline is not disturbed.)
 *   - ring_liar_caught: the last stage of a generation sends stage 0, straight over the ring, other
 *     tokens than it reports to the broker (the test-only hook FUSION_TEST_CORRUPT_OUTPUT=ring, on
 *     every peer): stage 0 notices, the broker drops what came after, blames the last stage and sends
 *     the job's tokens through itself from then on; the text is still `fusion run infer`'s. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <sodium.h>

#include "cluster.h"

static void test_e2e_security_unknown_key_refused(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(1);
    tu_cluster *c = tu_cluster_new("e2e-key", &o);
    tu_cluster_start(c);
    tu_keygen(c, "stranger", false);
    /* --keys on the command line wins over the configuration file's keys */
    char *out = NULL;
    int rc = tu_fusion(c, &out, "peers --keys stranger");
    printf("fusion peers with an unknown key: exit %d: %s", rc, out);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "refused this client's key"));
    free(out);
    rc = tu_fusion(c, &out, "submit finetune --keys stranger --model model --data '%s' --steps 2 -q",
                   tu_cluster_data(c));
    printf("fusion submit with an unknown key: exit %d: %s", rc, out);
    assert_int_equal(rc, 3);
    assert_non_null(strstr(out, "refused"));
    free(out);
    /* the allowed client is served, and nothing was stored for the stranger's attempt */
    rc = tu_fusion(c, &out, "jobs --json");
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "[]"));
    free(out);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
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
static size_t hostile_round(const tu_cluster *c, int *keep, size_t cap)
{
    size_t nk = 0;
    uint8_t junk[4096];
    for (int i = 0; i < 8; i++) { /* random bytes */
        int s = tu_broker_connect_raw(c);
        randombytes_buf(junk, sizeof junk);
        ssize_t w = write(s, junk, (size_t)(100 + i * 500));
        (void)w;
        close(s);
    }
    for (int i = 0; i < 2 && nk < cap; i++) { /* half a greeting, left hanging */
        int s = tu_broker_connect_raw(c);
        uint8_t g[64];
        greeting(g, "CURVE");
        ssize_t w = write(s, g, 11);
        (void)w;
        keep[nk++] = s;
    }
    const char *mechs[] = {"CURVE", "NULL", "PLAIN"};
    for (int i = 0; i < 3; i++) { /* a whole greeting, then a frame announcing 2^62 bytes */
        int s = tu_broker_connect_raw(c);
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
    tu_opts o = tu_opts_default(3);
    tu_cluster *c = tu_cluster_new("e2e-garbage", &o);
    tu_cluster_start(c);
    const char *train = TU_TRAIN_ARGS " --steps 60";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 10", train);
    (void)tu_wait_step(c, id, 5, 60000);
    int keep[16];
    size_t nk = 0;
    long rounds = 0;
    tu_status st;
    /* Keep attacking while the job runs (at least 3 rounds). */
    do {
        nk += hostile_round(c, keep + nk, sizeof keep / sizeof keep[0] - nk);
        rounds++;
        assert_true(tu_status_get(c, id, &st));
        assert_true(tu_broker_alive(c));
    } while (rounds < 3 || (strcmp(st.state, "running") == 0 && rounds < 200));
    printf("%ld rounds of hostile connections (%zu half greetings left open) while job %s ran to step %ld (%s)\n",
           rounds, nk, id, st.step, st.state);
    tu_wait_done(c, id, 60);
    for (size_t i = 0; i < nk; i++)
        close(keep[i]);
    /* the broker still serves; the real peers passed their profile challenge */
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "peers"), 0);
    printf("%s", out);
    assert_non_null(strstr(out, "CHECKED"));
    assert_null(strstr(out, "pending"));
    assert_non_null(strstr(out, "verified"));
    free(out);
    tu_assert_same_adapter(c, id, "model", train);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

#define RING_PROMPT "116,104,101,32,113,117,105,99,107"

static void test_e2e_security_ring_liar_caught(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(4);
    o.corrupt_mode = "ring"; /* every peer lies when it is the last stage, from the start */
    tu_cluster *c = tu_cluster_new("e2e-ring", &o);
    for (int i = 0; i < 4; i++) {
        char p[TU_PATH];
        tu_path(c, p, "corrupt.p%d", i);
        tu_file_write_private(p, "armed");
    }
    tu_cluster_start(c);
    char id[17];
    tu_submit(c, id, "infer --model model --prompt-tokens " RING_PROMPT " --max-tokens 24");
    tu_wait_done(c, id, 90);
    bool two = tu_broker_logged(c, "job %s stage 1/", id);
    bool caught = tu_broker_logged(c, "job %s: stage 0", id) &&
                  tu_broker_logged(c, "another token for position");
    if (!two || !caught)
        tu_cluster_show_logs(c);
    assert_true(two); /* a ring needs two stages */
    assert_true(caught);
    tu_result(c, id);
    char p[TU_PATH];
    tu_path(c, p, "res-%s/output.txt", id);
    char *got = tu_file_text(p);
    char *want = NULL;
    assert_int_equal(tu_fusion(c, &want, "run infer -q --threads 1 --model model --prompt-tokens " RING_PROMPT
                               " --max-tokens 24 2>/dev/null"), 0);
    size_t wl = strlen(want);
    if (wl && want[wl - 1] == '\n')
        want[--wl] = '\0';
    printf("generation %s with a lying last stage: %zu bytes, fusion run %zu bytes: %s\n", id, strlen(got), wl,
           strcmp(got, want) == 0 ? "identical" : "DIFFERENT");
    assert_true(wl > 0);
    assert_string_equal(got, want);
    free(got);
    free(want);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_security_unknown_key_refused, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_security_garbage_spares_the_job, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_security_ring_liar_caught, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
