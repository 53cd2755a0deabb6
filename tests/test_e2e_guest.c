/* End to end: a peer that is a guest on its owner's machine (docs/PEER.md "A good guest"), on the
 * two-stage cluster of real processes (the test cluster, tests/cluster.h). The peers run at normal
 * priority: a pause is the same at any priority, and an idle-priority cluster would crawl on a machine
 * busy with other work (the priority itself is tested by test_peer_proc's heartbeats_while_computing).
 *   - pause_resume: stage 1's peer is paused by its owner (SIGUSR1) mid-job; `fusion peers` shows it
 *     paused with the reason, the job's status says so, and the broker waits through twice its step
 *     deadline without recovering anything; after SIGUSR2 the job finishes with exactly the adapter
 *     of the uninterrupted `fusion run finetune`, and the paused peer keeps its reputation.
 *   - pause_grace: with a free peer and --pause-grace 3, a pause longer than the grace moves stage 1
 *     to the free peer (from the newest checkpoint); the paused peer is not taken off the job for good
 *     and keeps its reputation; the adapter equals the uninterrupted run's. */
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

#define GUEST_STEPS "60"

static const char *guest_train_args(void)
{
    static char a[256];
    snprintf(a, sizeof a, "%s --steps " GUEST_STEPS, TU_TRAIN_ARGS);
    return a;
}

/* Waits until `fusion peers` shows pI in state want; fails the test otherwise. */
static void wait_peer_state(const tu_cluster *c, int i, const char *want, tu_peer_seen *ps, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (!(tu_peer_seen_get(c, i, ps) && strcmp(ps->state, want) == 0)) {
        if (fu_clock_ms() > end) {
            tu_cluster_show_logs(c);
            fail_msg("p%d is %s, not %s, after %d ms", i, ps->state, want, timeout_ms);
        }
        fu_sleep_ms(100);
    }
}

/* Starts the two-stage cluster with guests, submits the long job, waits for step 5 and pauses stage
 * 1's peer. Returns its index. */
static int start_and_pause(tu_cluster **c_p, const char *tag, int n_peers, int backups, int grace_s, char id[17],
                           tu_peer_seen *before)
{
    tu_opts o = tu_opts_two_stage(n_peers, backups);
    o.step_timeout_s = 3;
    o.pause_grace_s = grace_s;
    tu_cluster *c = *c_p = tu_cluster_new(tag, &o);
    tu_cluster_start(c);
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 5", guest_train_args());
    int victim = tu_stage_peer(c, id, 1, 30000);
    (void)tu_wait_step(c, id, 5, 60000);
    assert_true(tu_peer_seen_get(c, victim, before));
    tu_peer_signal(c, victim, SIGUSR1);
    tu_peer_seen ps;
    wait_peer_state(c, victim, "paused", &ps, 10000);
    assert_string_equal(ps.pause_reason, "paused by its owner");
    printf("p%d (stage 1) paused by its owner; `fusion peers` says: %s (%s)\n", victim, ps.state, ps.pause_reason);
    return victim;
}

static void test_e2e_guest_pause_resume(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17];
    tu_peer_seen before, ps;
    int victim = start_and_pause(&c, "e2e-pause", 2, 0, 600, id, &before);
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    long s0 = st.step;
    fu_sleep_ms(6000); /* twice the step deadline */
    assert_true(tu_status_get(c, id, &st));
    printf("after 6 s paused: %s at step %ld (was %ld): %s\n", st.state, st.step, s0, st.message);
    assert_string_equal(st.state, "running");
    assert_non_null(strstr(st.message, "paused"));
    assert_true(st.step <= s0 + 1); /* compute stopped within the step it was in */
    assert_false(tu_broker_logged(c, "no progress past"));
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "peers"), 0);
    printf("%s", out);
    assert_non_null(strstr(out, "paused by its owner"));
    free(out);
    tu_peer_signal(c, victim, SIGUSR2);
    wait_peer_state(c, victim, "busy", &ps, 10000);
    tu_wait_done(c, id, 120);
    assert_false(tu_broker_logged(c, "moved from"));
    double d = tu_job_vs_reference(c, id, "model", guest_train_args());
    assert_true(d == 0.0); /* a pause changes nothing */
    assert_true(tu_peer_seen_get(c, victim, &ps));
    assert_true(ps.reputation >= before.reputation);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_e2e_guest_pause_grace(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17];
    tu_peer_seen before, ps;
    int victim = start_and_pause(&c, "e2e-pause-grace", 3, 1, 3, id, &before);
    tu_wait_done(c, id, 120);
    assert_true(tu_broker_logged(c, "past the grace period of 3 s"));
    assert_true(tu_broker_logged(c, "job %s: stage 1 moved from", id));
    assert_false(tu_broker_logged(c, "is taken off the job")); /* not blamed: no exclusion */
    tu_assert_same_adapter(c, id, "model", guest_train_args());
    assert_true(tu_peer_seen_get(c, victim, &ps));
    printf("p%d after the job: %s, reputation %.2f (before %.2f)\n", victim, ps.state, ps.reputation,
           before.reputation);
    assert_true(ps.reputation >= before.reputation);
    tu_peer_signal(c, victim, SIGUSR2);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_guest_pause_resume, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_guest_pause_grace, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
