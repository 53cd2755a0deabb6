/* fusion-peer with the real fusion-broker and the real client, as processes on loopback (the
 * two-stage test cluster of tests/cluster.h: an 8-layer model over 60 MiB peers, one warm backup):
 *   - a fine-tune through a two-stage pipeline gives the adapter `fusion run finetune` gives in one
 *     process (same data order, same arithmetic);
 *   - SIGKILL of the last stage's peer mid-job: the broker moves the stage to the warm backup, every
 *     stage rewinds to the newest common checkpoint, and the final adapter is still the same;
 *   - the same with SIGTERM (Leave), and with a SIGKILLed broker restarted on the same store;
 *   - inference equals `fusion run infer`, also across a failover mid-generation;
 *   - enrolment with a token;
 *   - the peers leave on SIGTERM with exit 0.
 * The adapter is downloaded with `fusion result` once the job is done. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cluster.h"
#include "fu_clock.h"
#include "wire_zap.h"

#define N_PEERS 3
#define COMMON  "--rank 4 --batch 4 --seq-len 16 --lr 0.01" /* the options of every fine-tune here */

/* Starts the cluster: 3 peers, one of them a warm backup. */
static tu_cluster *cluster_start(const char *tag)
{
    tu_opts o = tu_opts_two_stage(N_PEERS, 1);
    tu_cluster *c = tu_cluster_new(tag, &o);
    tu_cluster_start(c);
    return c;
}

/* The broker's log says that job id's stage 1 moved to another peer. */
static void assert_moved(const tu_cluster *c, const char *id)
{
    bool moved = tu_broker_logged(c, "job %s: stage 1 moved from", id);
    if (!moved)
        tu_file_show(tu_broker_log(c), 30);
    assert_true(moved);
}

/* Submits a 100-step fine-tune and waits until stage 1 has committed its checkpoint at step 40. */
static void submit_long(tu_cluster *c, char id[17])
{
    tu_submit_finetune(c, id, "model", COMMON " --steps 100 --checkpoint-every 20");
    if (!tu_broker_wait_log(c, 60000, "job %s: checkpoint of stage 1 at step 40 committed", id)) {
        tu_file_show(tu_broker_log(c), 30);
        fail_msg("no checkpoint at step 40");
    }
}

static void test_peer_broker_pipeline_equals_single_process(void **state)
{
    (void)state;
    tu_cluster *c = cluster_start("peer-broker");
    char id[17];
    tu_submit_finetune(c, id, "model", COMMON " --steps 12 --micro-batches 1 --checkpoint-every 4");
    tu_wait_done(c, id, 80);
    bool two = tu_broker_logged(c, "job %s stage 1/2", id);
    if (!two)
        tu_file_show(tu_broker_log(c), 60);
    assert_true(two); /* the job really ran as a two-stage pipeline */
    tu_assert_same_adapter(c, id, "model", COMMON " --steps 12");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The last stage's peer goes away mid-job: SIGKILL (dead after the heartbeat timeout) or SIGTERM
 * (Leave: it drains and exits 0). Either way the job ends with the uninterrupted run's adapter. */
static void lose_stage(int sig)
{
    tu_cluster *c = cluster_start(sig == SIGKILL ? "peer-failover" : "peer-leave");
    /* Submit without waiting, kill the last stage's peer after a checkpoint, then wait. */
    char id[17];
    submit_long(c, id);
    int victim = tu_stage_peer(c, id, 1, 1000);
    printf("%s p%d (stage 1)\n", sig == SIGKILL ? "SIGKILL to" : "SIGTERM to", victim);
    int vcode = tu_peer_stop(c, victim, sig, 15000);
    if (sig == SIGTERM)
        assert_int_equal(vcode, 0); /* Leave, StageRelease, exit 0 */
    tu_wait_done(c, id, 80);
    assert_moved(c, id);
    tu_assert_same_adapter(c, id, "model", COMMON " --steps 100");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_peer_broker_failover_keeps_the_adapter(void **state)
{
    (void)state;
    lose_stage(SIGKILL);
}

static void test_peer_broker_leave_keeps_the_adapter(void **state)
{
    (void)state;
    lose_stage(SIGTERM);
}

/* The broker is SIGKILLed mid-job and started again on the same endpoint and store: the peers
 * notice its silence, say PeerHello again, the broker resumes the job from the newest common
 * checkpoint, and the adapter is still the uninterrupted run's. */
static void test_peer_broker_restart_keeps_the_adapter(void **state)
{
    (void)state;
    tu_cluster *c = cluster_start("peer-brestart");
    char id[17];
    submit_long(c, id);
    printf("SIGKILL to the broker, then a restart on %s\n", tu_broker_endpoint(c));
    (void)tu_broker_stop(c, SIGKILL);
    tu_broker_start(c); /* the same endpoint and store; its log is broker-2.log */
    tu_wait_done(c, id, 80);
    int rejoined = 0;
    char *bl = tu_broker_log_text(c);
    for (const char *q = bl; (q = strstr(q, "registered: ")) != NULL; q++) /* "re-registered: " */
        rejoined++;
    for (const char *q = bl; (q = strstr(q, ") joined: ")) != NULL; q++)
        rejoined++;
    free(bl);
    printf("%d peers registered again with the restarted broker\n", rejoined);
    assert_true(rejoined >= 2);
    tu_assert_same_adapter(c, id, "model", COMMON " --steps 100");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The generated bytes of an inference job (`fusion result`'s output.txt). */
static char *infer_result(tu_cluster *c, const char *id, size_t *len)
{
    tu_result(c, id);
    char p[TU_PATH];
    tu_path(c, p, "res-%s/output.txt", id);
    char *r = tu_file_text(p);
    *len = strlen(r);
    return r;
}

static char *run_infer(tu_cluster *c, const char *opts, size_t *len)
{
    char *out = NULL;
    int rc = tu_fusion(c, &out, "run infer --model model %s 2>/dev/null", opts);
    if (rc != 0)
        fail_msg("fusion run infer failed: %s", out);
    *len = strlen(out);
    if (*len && out[*len - 1] == '\n')
        out[--(*len)] = '\0';
    return out;
}

/* Job id's generation through the pipeline equals `fusion run infer` with opts. */
static void expect_same_text(tu_cluster *c, const char *id, const char *opts, const char *when)
{
    size_t n1, n2;
    char *got = infer_result(c, id, &n1), *want = run_infer(c, opts, &n2);
    printf("infer %s%s: pipeline %zu bytes, fusion run %zu bytes, %s\n", id, when, n1, n2,
           n1 == n2 && memcmp(got, want, n1) == 0 ? "identical" : "DIFFERENT");
    assert_int_equal(n1, n2);
    assert_memory_equal(got, want, n1);
    free(got);
    free(want);
}

/* Generation through the pipeline gives the tokens `fusion run infer` gives (greedy and seeded
 * sampling); killing the last stage mid-generation: the backup rebuilds its KV cache by replaying
 * the prompt and the tokens so far, and the text is unchanged (greedy). */
static void test_peer_broker_inference_equals_single_process(void **state)
{
    (void)state;
    tu_cluster *c = cluster_start("peer-infer");
    const char *runs[] = {"--prompt 'the quick brown fox' --max-tokens 24",
                          "--prompt 'over the lazy dog' --max-tokens 24 --temperature 0.9 --top-k 40 --seed 5"};
    for (size_t k = 0; k < 2; k++) {
        char id[17];
        tu_submit(c, id, "infer --model model %s", runs[k]);
        tu_wait_done(c, id, 60);
        expect_same_text(c, id, runs[k], "");
    }

    /* Failover mid-generation (greedy): kill the last stage's peer once 100 tokens are out. */
    const char *lng = "--prompt 'the river and the stone' --max-tokens 600";
    char id[17];
    tu_submit(c, id, "infer --model model %s", lng);
    uint64_t end = fu_clock_ms() + 60000;
    long done = 0;
    while (done < 100 && fu_clock_ms() < end) {
        char *out = NULL;
        (void)tu_fusion(c, &out, "status %s", id);
        const char *at = out ? strstr(out, id) : NULL;
        const char *sl = at ? strchr(at, '/') : NULL;
        if (sl) {
            const char *q = sl;
            while (q > at && q[-1] >= '0' && q[-1] <= '9')
                q--;
            done = strtol(q, NULL, 10);
        }
        if (out && strstr(out, "done"))
            fail_msg("the generation ended before the kill: %s", out);
        free(out);
        fu_sleep_ms(10);
    }
    assert_true(done >= 100);
    int victim = tu_stage_peer(c, id, 1, 1000);
    printf("killing p%d (stage 1 of the generation) at token %ld\n", victim, done);
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    tu_wait_done(c, id, 80);
    assert_moved(c, id);
    expect_same_text(c, id, lng, " after failover");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Enrolment: a key not on the allow-list enrols with the broker's token (both read it from a 0600
 * file, --enrol-token-file), reconnects as a member and joins; a wrong token (--enrol-token) is
 * refused and the peer exits 3 with a sentence. */
static void test_peer_broker_enrolment(void **state)
{
    (void)state;
    char token[64];
    wire_token_generate(token);
    tu_opts o = tu_opts_default(2);
    o.peers_unlisted = true; /* they must enrol */
    o.enrol_token = token;
    o.heartbeat_ms = 300;
    o.model_args = NULL;
    tu_cluster *c = tu_cluster_new("peer-enrol", &o);
    tu_broker_start(c);
    char token_file[TU_PATH];
    tu_path(c, token_file, "p0.token");
    tu_file_write_private(token_file, token);
    tu_peer_start(c, 0, "--enrol-token-file", token_file, NULL);
    tu_peer_start(c, 1, "--enrol-token", "0000000000000000000000000000000000000000", NULL);
    bool joined = tu_broker_wait_log(c, 20000, "(p0) joined");
    int bad = tu_peer_stop(c, 1, 0, 20000); /* no signal: it exits by itself */
    char plog1[TU_PATH];
    tu_path(c, plog1, "p1.log");
    char *l1 = tu_file_text(plog1);
    printf("wrong token: exit %d: %s", bad, l1);
    bool said = strstr(l1, "enrolment") != NULL;
    free(l1);
    if (!joined)
        tu_file_show(tu_broker_log(c), 30);
    assert_true(joined);
    assert_int_equal(bad, 3);
    assert_true(said);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_peer_broker_pipeline_equals_single_process, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_failover_keeps_the_adapter, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_leave_keeps_the_adapter, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_restart_keeps_the_adapter, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_inference_equals_single_process, tu_teardown),
        cmocka_unit_test_teardown(test_peer_broker_enrolment, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
