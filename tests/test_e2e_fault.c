/* End to end, with faults, on a three-stage pipeline of real processes (tests/e2e_util.h):
 *   - peer_kill9: the middle stage's peer is SIGKILLed mid-job (broker --backups 1, 4 peers); the
 *     backup takes the stage, every stage rewinds to the newest common checkpoint, and the adapter
 *     equals the uninterrupted `fusion run finetune` (<= 1e-5). (The peer tests do this for the last
 *     stage of a two-stage pipeline.)
 *   - peer_leave: stage 0's peer gets SIGTERM mid-job: it leaves gracefully (exit 0), the backup takes
 *     over, the adapter is the same.
 *   - peer_sigstop: the last stage's peer is SIGSTOPped (its sockets stay open: only the missing
 *     heartbeats tell): it is declared dead within 5 s and replaced; detection and recovery times
 *     are measured and printed; after SIGCONT it registers again; the adapter is the same.
 *   - broker_kill9_restart: the broker is SIGKILLed mid-job and restarted on the same port and SQLite
 *     file: every job acknowledged before the kill is listed after it, the running job finishes with
 *     the uninterrupted run's adapter, and the queued ones finish too.
 *   - ready_deadline: on the two-stage cluster, stage 1's peer is alive and heartbeating but never
 *     says StageReady (test hook FUSION_TEST_STALL=ready:FILE): after --ready-timeout the broker
 *     takes it off the job, the backup takes stage 1, `fusion status` says why, and the adapter
 *     equals the uninterrupted run's.
 *   - step_deadline: stage 1's peer stops working at step 8 while heartbeating (FUSION_TEST_STALL=
 *     step:8:FILE): after --step-timeout the broker names stage 1 from the heartbeats' progress, moves
 *     it to the free peer and takes the staller off the job; with no free peer (_no_spare) every
 *     stage restarts from the newest common checkpoint. Either way the job finishes with the
 *     uninterrupted run's adapter. */
#include "e2e_util.h"

#define JOB_STEPS 120
#define KILL_AT   25 /* steps done before the fault (a checkpoint at 20 is committed) */

static const char *train_args(void)
{
    static char a[256];
    snprintf(a, sizeof a, "%s --steps %d", E2E_TRAIN_ARGS, JOB_STEPS);
    return a;
}

/* Starts a 4-peer cluster with one backup and a long job; waits until it runs three stages and
 * has done KILL_AT steps. Returns the index of the peer that holds `stage`. */
static int start_job(e2e_cluster *c, const char *tag, int heartbeat_ms, int stage, char id[17])
{
    e2e_cluster_init(c, tag, 4);
    c->backups = 1;
    c->heartbeat_ms = heartbeat_ms;
    e2e_cluster_start(c);
    e2e_submit(c, id, "finetune --model model --data '%s' %s --checkpoint-every 10", c->data, train_args());
    (void)e2e_wait_step(c, id, KILL_AT, 60000);
    e2e_status st;
    assert_true(e2e_get_status(c, id, &st));
    if (st.n_stages != 3)
        e2e_show_all(c);
    assert_int_equal(st.n_stages, 3);
    int victim = e2e_peer_index(st.stage_peer[stage]);
    assert_true(victim >= 0 && victim < c->n_peers);
    printf("job %s: stages on %s, %s, %s; step %ld\n", id, st.stage_peer[0], st.stage_peer[1], st.stage_peer[2],
           st.step);
    return victim;
}

/* The first line of the broker's log holding needle (printed), or a test failure. */
static void assert_logged(const e2e_cluster *c, const char *needle)
{
    char log[E2E_PATH];
    e2e_broker_log(c, log);
    char *bl = e2e_slurp(log);
    const char *at = strstr(bl, needle);
    if (at) {
        const char *nl = strchr(at, '\n');
        printf("%.*s\n", (int)(nl ? nl - at : (ptrdiff_t)strlen(at)), at);
    } else {
        e2e_show(log, 40);
    }
    free(bl);
    if (!at)
        fail_msg("the broker's log has no '%s'", needle);
}

/* The broker moved `stage` away from its peer (the failover line of its log). */
static void assert_moved(const e2e_cluster *c, const char *id, int stage)
{
    char needle[96];
    snprintf(needle, sizeof needle, "job %s: stage %d moved from", id, stage);
    assert_logged(c, needle);
}

static void test_e2e_fault_peer_kill9(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17];
    int victim = start_job(&c, "e2e-kill9", 300, 1, id);
    printf("SIGKILL to p%d (stage 1 of 3)\n", victim);
    uint64_t t0 = fu_clock_ms();
    e2e_peer_kill9(&c, victim);
    e2e_wait_done(&c, id, 80);
    printf("the job finished %llu ms after the kill\n", (unsigned long long)(fu_clock_ms() - t0));
    assert_moved(&c, id, 1);
    double d = e2e_job_vs_reference(&c, id, "model", train_args());
    assert_true(d <= 1e-5);
    e2e_cluster_stop(&c);
}

static void test_e2e_fault_peer_leave(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17];
    int victim = start_job(&c, "e2e-leave", 300, 0, id);
    printf("SIGTERM to p%d (stage 0 of 3)\n", victim);
    kill(c.peers[victim], SIGTERM);
    int code = e2e_reap(c.peers[victim], 20000);
    c.peers[victim] = 0;
    assert_int_equal(code, 0); /* a graceful leave */
    e2e_wait_done(&c, id, 80);
    assert_moved(&c, id, 0);
    double d = e2e_job_vs_reference(&c, id, "model", train_args());
    assert_true(d <= 1e-5);
    e2e_cluster_stop(&c);
}

/* The state `fusion peers --json` gives peer pI ("" when not listed). */
static void peer_state(const e2e_cluster *c, int i, char *state, size_t cap)
{
    state[0] = '\0';
    char *out = NULL, name[16];
    snprintf(name, sizeof name, "p%d", i);
    if (e2e_fusion(c, &out, "peers --json 2>/dev/null") == 0) {
        cJSON *arr = cJSON_Parse(out);
        const cJSON *e;
        cJSON_ArrayForEach(e, arr)
        {
            const cJSON *n = cJSON_GetObjectItem(e, "name"), *s = cJSON_GetObjectItem(e, "state");
            if (cJSON_IsString(n) && cJSON_IsString(s) && strcmp(n->valuestring, name) == 0)
                snprintf(state, cap, "%s", s->valuestring);
        }
        cJSON_Delete(arr);
    }
    free(out);
}

static void test_e2e_fault_peer_sigstop(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17];
    /* The broker's default heartbeat (1000 ms, dead after 3000 ms): the detection time is real. */
    int victim = start_job(&c, "e2e-sigstop", 0, 2, id);
    e2e_status st;
    assert_true(e2e_get_status(&c, id, &st));
    long at_stop = st.step;
    printf("SIGSTOP to p%d (stage 2 of 3) at step %ld\n", victim, at_stop);
    uint64_t t0 = fu_clock_ms();
    kill(c.peers[victim], SIGSTOP);
    c.stopped[victim] = true;
    /* Detection: the broker lists the peer as dead. */
    char ps[32] = "";
    uint64_t t_dead = 0, t_moved = 0, t_resumed = 0;
    uint64_t end = t0 + 15000;
    while (fu_clock_ms() < end && !t_dead) {
        peer_state(&c, victim, ps, sizeof ps);
        if (strcmp(ps, "dead") == 0)
            t_dead = fu_clock_ms();
        else
            fu_sleep_ms(20);
    }
    if (!t_dead)
        e2e_show_all(&c);
    assert_true(t_dead > 0);
    /* Recovery: the stage is on another peer, and the job is past the step it had reached. */
    char victim_name[16];
    snprintf(victim_name, sizeof victim_name, "p%d", victim);
    end = t0 + 60000;
    while (fu_clock_ms() < end && !t_resumed) {
        if (e2e_get_status(&c, id, &st)) {
            if (!t_moved && st.n_stages == 3 && st.stage_peer[2][0] && strcmp(st.stage_peer[2], victim_name) != 0)
                t_moved = fu_clock_ms();
            if (strcmp(st.state, "done") == 0 || (t_moved && st.step > at_stop))
                t_resumed = fu_clock_ms();
        }
        if (!t_resumed)
            fu_sleep_ms(20);
    }
    if (!t_resumed)
        e2e_show_all(&c);
    assert_true(t_resumed > 0);
    if (!t_moved)
        t_moved = t_resumed;
    printf("SIGSTOP: detected (peer dead) after %llu ms; stage reassigned after %llu ms; the job past step %ld "
           "again after %llu ms (heartbeat 1000 ms, dead after 3000 ms)\n",
           (unsigned long long)(t_dead - t0), (unsigned long long)(t_moved - t0), at_stop,
           (unsigned long long)(t_resumed - t0));
    assert_true(t_dead - t0 <= 5000);
    e2e_wait_done(&c, id, 60);
    assert_moved(&c, id, 2);
    double d = e2e_job_vs_reference(&c, id, "model", train_args());
    assert_true(d <= 1e-5);
    /* SIGCONT: its next message is refused, it registers again and is live (not dead) */
    kill(c.peers[victim], SIGCONT);
    c.stopped[victim] = false;
    end = fu_clock_ms() + 15000;
    do {
        peer_state(&c, victim, ps, sizeof ps);
        if (strcmp(ps, "dead") != 0 && ps[0])
            break;
        fu_sleep_ms(50);
    } while (fu_clock_ms() < end);
    printf("after SIGCONT p%d is %s\n", victim, ps);
    assert_string_not_equal(ps, "dead");
    e2e_cluster_stop(&c);
}

/* The job ids `fusion jobs --json` lists, concatenated. */
static char *listed_jobs(const e2e_cluster *c)
{
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "jobs --json 2>/dev/null");
    assert_int_equal(rc, 0);
    cJSON *arr = cJSON_Parse(out);
    assert_non_null(arr);
    size_t cap = 64 + 17 * (size_t)cJSON_GetArraySize(arr);
    char *ids = calloc(1, cap);
    const cJSON *e;
    cJSON_ArrayForEach(e, arr)
    {
        const cJSON *j = cJSON_GetObjectItem(e, "job");
        if (cJSON_IsString(j)) {
            strncat(ids, j->valuestring, cap - strlen(ids) - 2);
            strcat(ids, " ");
        }
    }
    cJSON_Delete(arr);
    free(out);
    return ids;
}

static void test_e2e_fault_broker_kill9_restart(void **state)
{
    (void)state;
    e2e_cluster c;
    e2e_cluster_init(&c, "e2e-broker", 3);
    c.backups = 0;
    c.heartbeat_ms = 300;
    e2e_cluster_start(&c);
    char run[17], q[2][17];
    e2e_submit(&c, run, "finetune --model model --data '%s' %s --checkpoint-every 10", c.data, train_args());
    const char *small = E2E_TRAIN_ARGS " --steps 6";
    for (int i = 0; i < 2; i++) /* queued behind it: every peer is busy */
        e2e_submit(&c, q[i], "finetune --model model --data '%s' %s --checkpoint-every 3", c.data, small);
    (void)e2e_wait_step(&c, run, KILL_AT, 60000);
    char *before = listed_jobs(&c);
    printf("before the kill: jobs %s\n", before);
    kill(c.broker, SIGKILL);
    assert_int_equal(e2e_reap(c.broker, 5000), 128 + SIGKILL);
    c.broker = 0;
    uint64_t t0 = fu_clock_ms();
    e2e_broker_start(&c); /* same port, same SQLite file */
    printf("broker restarted in %llu ms\n", (unsigned long long)(fu_clock_ms() - t0));
    char *after = listed_jobs(&c);
    printf("after the restart: jobs %s\n", after);
    const char *ids[3] = {run, q[0], q[1]};
    for (int i = 0; i < 3; i++) {
        assert_non_null(strstr(before, ids[i]));
        if (!strstr(after, ids[i]))
            fail_msg("job %s was acknowledged before the kill and is not listed after the restart", ids[i]);
    }
    free(before);
    free(after);
    e2e_wait_done(&c, run, 70);
    printf("the running job finished %llu ms after the restart\n", (unsigned long long)(fu_clock_ms() - t0));
    char log[E2E_PATH];
    e2e_broker_log(&c, log);
    char needle[96];
    snprintf(needle, sizeof needle, "job %s: recovering after a broker restart", run);
    char *bl = e2e_slurp(log);
    const char *rec = strstr(bl, needle);
    if (rec) {
        const char *nl = strchr(rec, '\n');
        printf("%.*s\n", (int)(nl ? nl - rec : (ptrdiff_t)strlen(rec)), rec);
    }
    free(bl);
    double d = e2e_job_vs_reference(&c, run, "model", train_args());
    assert_true(d <= 1e-5);
    for (int i = 0; i < 2; i++)
        e2e_wait_done(&c, q[i], 30);
    e2e_cluster_stop(&c);
}

/* ---- deadlines on the work (two-stage cluster, docs/PIPELINE.md "Failures") --------------------- */

#define DL_STEPS 20
static const char *dl_train_args(void)
{
    static char a[256];
    snprintf(a, sizeof a, "%s --steps %d", E2E_TRAIN_ARGS, DL_STEPS);
    return a;
}

static void stall_file(const e2e_cluster *c, int i, bool on)
{
    char f[E2E_PATH];
    e2e_path(c, f, "stall.p%d", i);
    if (on) {
        FILE *fp = fopen(f, "w");
        assert_non_null(fp);
        fclose(fp);
    } else {
        (void)unlink(f);
    }
}


static void test_e2e_fault_ready_deadline(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17], needle[160];
    e2e_two_stage_init(&c, "e2e-ready", 3, 1);
    c.stall = "ready";
    c.ready_timeout_s = 5;
    e2e_cluster_start(&c);
    for (int i = 0; i < c.n_peers; i++) /* nobody says StageReady until the victim is known */
        stall_file(&c, i, true);
    e2e_submit(&c, id, "finetune --model model --data '%s' %s --checkpoint-every 5", c.data, dl_train_args());
    int victim = e2e_planned_peer(&c, id, 1, 30000);
    uint64_t t0 = fu_clock_ms();
    for (int i = 0; i < c.n_peers; i++)
        if (i != victim)
            stall_file(&c, i, false);
    printf("p%d (stage 1) never says StageReady; --ready-timeout %d\n", victim, c.ready_timeout_s);
    /* While it recovers, and after, the job says why. */
    char seen[512] = "";
    e2e_status st;
    while (fu_clock_ms() < t0 + 30000 && !seen[0]) {
        if (e2e_get_status(&c, id, &st) && strstr(st.message, "missed its ready deadline"))
            snprintf(seen, sizeof seen, "%s", st.message);
        else if (strcmp(st.state, "done") == 0 || strcmp(st.state, "failed") == 0)
            break;
    }
    printf("fusion status: %s\n", seen[0] ? seen : "(the recovery was not seen)");
    e2e_wait_done(&c, id, 60);
    printf("the job finished %llu ms after the victim was chosen\n", (unsigned long long)(fu_clock_ms() - t0));
    snprintf(needle, sizeof needle, "(p%d) missed its ready deadline", victim);
    assert_logged(&c, needle);
    snprintf(needle, sizeof needle, "job %s: stage 1 moved from", id);
    assert_logged(&c, needle);
    assert_true(seen[0]);
    assert_non_null(strstr(seen, "recover"));
    double d = e2e_job_vs_reference(&c, id, "model", dl_train_args());
    assert_true(d <= 1e-5);
    e2e_cluster_stop(&c);
}

/* Starts a two-stage job on n_peers peers, makes stage 1's peer stall at step 8 while it keeps
 * heartbeating (--step-timeout 3), waits for the job to finish and checks that the broker saw the
 * deadline pass and named stage 1 from the heartbeats. */
static void stall_stage1(e2e_cluster *c, const char *tag, int n_peers, int backups, char id[17])
{
    char needle[160];
    e2e_two_stage_init(c, tag, n_peers, backups);
    c->stall = "step:8";
    c->step_timeout_s = 3;
    e2e_cluster_start(c);
    e2e_submit(c, id, "finetune --model model --data '%s' %s --checkpoint-every 5", c->data, dl_train_args());
    int victim = e2e_planned_peer(c, id, 1, 30000);
    stall_file(c, victim, true);
    printf("p%d (stage 1) stalls at step 8 while heartbeating; --step-timeout %d\n", victim, c->step_timeout_s);
    uint64_t t0 = fu_clock_ms();
    e2e_wait_done(c, id, 70);
    printf("the job finished %llu ms after the stall was armed\n", (unsigned long long)(fu_clock_ms() - t0));
    char plog[E2E_PATH];
    e2e_path(c, plog, "p%d.log", victim);
    char *pl = e2e_slurp(plog);
    bool stalled = strstr(pl, "stalling at step 8") != NULL;
    free(pl);
    if (!stalled)
        fail_msg("p%d never stalled (the job passed step 8 before the hook was armed?)", victim);
    snprintf(needle, sizeof needle, "job %s: no progress past step 8 for", id);
    assert_logged(c, needle);
    assert_logged(c, "; stage 1 (peer "); /* named from the heartbeats: 0/1 forward */
}

/* With a free peer, the stage behind moves to it and the staller is taken off the job. */
static void test_e2e_fault_step_deadline(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17], needle[160];
    stall_stage1(&c, "e2e-step", 3, 1, id);
    snprintf(needle, sizeof needle, "job %s: stage 1: peer", id);
    assert_logged(&c, needle);
    assert_logged(&c, "is taken off the job");
    assert_moved(&c, id, 1);
    double d = e2e_job_vs_reference(&c, id, "model", dl_train_args());
    assert_true(d <= 1e-5);
    e2e_cluster_stop(&c);
}

/* With no other peer to move the stage to, every stage restarts from the newest checkpoint on the
 * same peers (the hook stalls once, so the second run gets through). */
static void test_e2e_fault_step_deadline_no_spare(void **state)
{
    (void)state;
    e2e_cluster c;
    char id[17];
    stall_stage1(&c, "e2e-step-same", 2, 0, id);
    assert_logged(&c, "restarting every stage from step 5");
    double d = e2e_job_vs_reference(&c, id, "model", dl_train_args());
    assert_true(d <= 1e-5);
    e2e_cluster_stop(&c);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_fault_peer_kill9, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_peer_leave, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_peer_sigstop, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_broker_kill9_restart, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_ready_deadline, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_step_deadline, e2e_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_step_deadline_no_spare, e2e_teardown),
    };
    return e2e_main(argc, argv, tests, sizeof tests / sizeof tests[0], "e2e_fault");
}
