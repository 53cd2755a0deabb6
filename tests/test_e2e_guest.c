/* End to end: a peer that is a guest on its owner's machine (docs/PEER.md "A good guest"), on the
 * two-stage cluster of real processes (tests/e2e_util.h). The peers run at normal priority: a pause
 * is the same at any priority, and an idle-priority cluster would crawl on a machine busy with other
 * work (the priority itself is tested by test_peer_proc's heartbeats_while_computing).
 *   - pause_resume: stage 1's peer is paused by its owner (SIGUSR1) mid-job; `fusion peers` shows it
 *     paused with the reason, the job's status says so, and the broker waits through twice its step
 *     deadline without recovering anything; after SIGUSR2 the job finishes with exactly the adapter
 *     of the uninterrupted `fusion run finetune`, and the paused peer keeps its reputation.
 *   - pause_grace: with a free peer and --pause-grace 3, a pause longer than the grace moves stage 1
 *     to the free peer (from the newest checkpoint); the paused peer is not taken off the job for good
 *     and keeps its reputation; the adapter equals the uninterrupted run's. */
#include "e2e_util.h"

#define GUEST_STEPS "60"

static const char *guest_train_args(void)
{
    static char a[256];
    snprintf(a, sizeof a, "%s --steps " GUEST_STEPS, E2E_TRAIN_ARGS);
    return a;
}

/* What `fusion peers --json` says of peer pI: its state, pause reason and reputation. */
typedef struct {
    char state[16];
    char reason[256];
    double reputation;
} peer_seen;

static bool peer_get(const e2e_cluster *c, int i, peer_seen *ps)
{
    memset(ps, 0, sizeof *ps);
    char *out = NULL, name[16];
    snprintf(name, sizeof name, "p%d", i);
    int rc = e2e_fusion(c, &out, "peers --json 2>/dev/null");
    cJSON *j = rc == 0 && out ? cJSON_Parse(out) : NULL;
    free(out);
    bool found = false;
    const cJSON *e;
    cJSON_ArrayForEach(e, j)
    {
        const cJSON *n = cJSON_GetObjectItem(e, "name");
        if (!cJSON_IsString(n) || strcmp(n->valuestring, name) != 0)
            continue;
        const cJSON *s = cJSON_GetObjectItem(e, "state"), *r = cJSON_GetObjectItem(e, "pause_reason"),
                    *rep = cJSON_GetObjectItem(e, "reputation");
        if (cJSON_IsString(s))
            snprintf(ps->state, sizeof ps->state, "%s", s->valuestring);
        if (cJSON_IsString(r))
            snprintf(ps->reason, sizeof ps->reason, "%s", r->valuestring);
        if (cJSON_IsNumber(rep))
            ps->reputation = rep->valuedouble;
        found = true;
    }
    cJSON_Delete(j);
    return found;
}

/* Waits until `fusion peers` shows pI in state want; fails the test otherwise. */
static void wait_peer_state(const e2e_cluster *c, int i, const char *want, peer_seen *ps, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (!(peer_get(c, i, ps) && strcmp(ps->state, want) == 0)) {
        if (fu_clock_ms() > end) {
            e2e_show_all(c);
            fail_msg("p%d is %s, not %s, after %d ms", i, ps->state, want, timeout_ms);
        }
        fu_sleep_ms(100);
    }
}

static bool logged(const e2e_cluster *c, const char *needle)
{
    char log[E2E_PATH];
    e2e_broker_log(c, log);
    char *bl = e2e_slurp(log);
    bool at = strstr(bl, needle) != NULL;
    free(bl);
    return at;
}

/* Starts the two-stage cluster with guests, submits the long job, waits for step 5 and pauses stage
 * 1's peer. Returns its index. */
static int start_and_pause(e2e_cluster *c, const char *tag, int n_peers, int backups, int grace_s, char id[17],
                           peer_seen *before)
{
    e2e_two_stage_init(c, tag, n_peers, backups);
    c->step_timeout_s = 3;
    c->pause_grace_s = grace_s;
    e2e_cluster_start(c);
    e2e_submit(c, id, "finetune --model model --data '%s' %s --checkpoint-every 5", c->data, guest_train_args());
    int victim = e2e_planned_peer(c, id, 1, 30000);
    (void)e2e_wait_step(c, id, 5, 60000);
    assert_true(peer_get(c, victim, before));
    assert_int_equal(kill(c->peers[victim], SIGUSR1), 0);
    peer_seen ps;
    wait_peer_state(c, victim, "paused", &ps, 10000);
    assert_string_equal(ps.reason, "paused by its owner");
    printf("p%d (stage 1) paused by its owner; `fusion peers` says: %s (%s)\n", victim, ps.state, ps.reason);
    return victim;
}

static void test_e2e_guest_pause_resume(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17];
    peer_seen before, ps;
    int victim = start_and_pause(&c, "e2e-pause", 2, 0, 600, id, &before);
    e2e_status st;
    assert_true(e2e_get_status(&c, id, &st));
    long s0 = st.step;
    fu_sleep_ms(6000); /* twice the step deadline */
    assert_true(e2e_get_status(&c, id, &st));
    printf("after 6 s paused: %s at step %ld (was %ld): %s\n", st.state, st.step, s0, st.message);
    assert_string_equal(st.state, "running");
    assert_non_null(strstr(st.message, "paused"));
    assert_true(st.step <= s0 + 1); /* compute stopped within the step it was in */
    assert_false(logged(&c, "no progress past"));
    char *out = NULL;
    assert_int_equal(e2e_fusion(&c, &out, "peers"), 0);
    printf("%s", out);
    assert_non_null(strstr(out, "paused by its owner"));
    free(out);
    assert_int_equal(kill(c.peers[victim], SIGUSR2), 0);
    wait_peer_state(&c, victim, "busy", &ps, 10000);
    e2e_wait_done(&c, id, 120);
    assert_false(logged(&c, "moved from"));
    double d = e2e_job_vs_reference(&c, id, "model", guest_train_args());
    assert_true(d == 0.0); /* a pause changes nothing */
    assert_true(peer_get(&c, victim, &ps));
    assert_true(ps.reputation >= before.reputation);
    e2e_cluster_stop(&c);
}

static void test_e2e_guest_pause_grace(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17], needle[160];
    peer_seen before, ps;
    int victim = start_and_pause(&c, "e2e-pause-grace", 3, 1, 3, id, &before);
    e2e_wait_done(&c, id, 120);
    assert_true(logged(&c, "past the grace period of 3 s"));
    snprintf(needle, sizeof needle, "job %s: stage 1 moved from", id);
    assert_true(logged(&c, needle));
    assert_false(logged(&c, "is taken off the job")); /* not blamed: no exclusion */
    double d = e2e_job_vs_reference(&c, id, "model", guest_train_args());
    assert_true(d <= 1e-5);
    assert_true(peer_get(&c, victim, &ps));
    printf("p%d after the job: %s, reputation %.2f (before %.2f)\n", victim, ps.state, ps.reputation,
           before.reputation);
    assert_true(ps.reputation >= before.reputation);
    assert_int_equal(kill(c.peers[victim], SIGUSR2), 0);
    e2e_cluster_stop(&c);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_guest_pause_resume, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_guest_pause_grace, e2e_teardown),
    };
    return e2e_main(argc, argv, tests, sizeof tests / sizeof tests[0], "e2e_guest");
}
