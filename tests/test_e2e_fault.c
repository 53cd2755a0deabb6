/* End to end, with faults, on a three-stage pipeline of real processes (the test cluster,
 * tests/cluster.h):
 *   - peer_kill9: the middle stage's peer is SIGKILLed mid-job (broker --backups 1, 4 peers); the
 *     backup takes the stage, every stage rewinds to the newest common checkpoint, and the adapter
 *     equals the uninterrupted `fusion run finetune` (<= 1e-5). (The peer tests do this for the last
 *     stage of a two-stage pipeline.)
 *   - peer_kill9_gateway: the same with every peer and the client behind two fusion-gateways; the
 *     killed peer's closed connection, which its gateway tells, makes it dead within the grace.
 *   - gateway_kill9_failover: every peer is given both gateways; the one that carries two of them is
 *     SIGKILLed mid-job: they move to the other within a heartbeat, nobody is declared dead, no
 *     stage moves, the adapter is the same.
 *   - peer_leave: stage 0's peer gets SIGTERM mid-job: it leaves gracefully (exit 0), the backup takes
 *     over, the adapter is the same.
 *   - peer_sigstop: the last stage's peer is SIGSTOPped (its sockets stay open: only the missing
 *     heartbeats tell): it is declared dead within 5 s and replaced; detection and recovery times
 *     are measured and printed; after SIGCONT it registers again; the adapter is the same.
 *   - broker_kill9_restart: the broker is SIGKILLed mid-job and restarted on the same port and SQLite
 *     file: every job acknowledged before the kill is listed after it, the running job finishes with
 *     the uninterrupted run's adapter, and the queued ones finish too.
 *     broker_kill9_restart_gateway: the same with the peers and the client behind a gateway, which
 *     lives through it and reconnects by itself.
 *   - broker_outage_storm: the broker is down 8 s while the peers queue PeerHellos; restarted, it
 *     registers each peer once, the job resumes once and finishes with the uninterrupted run's
 *     adapter, and no peer loses reputation.
 *   - ready_deadline: on the two-stage cluster, stage 1's peer is alive and heartbeating but never
 *     says StageReady (test hook FUSION_TEST_STALL=ready:FILE): after --ready-timeout the broker
 *     takes it off the job, the backup takes stage 1, `fusion status` says why, and the adapter
 *     equals the uninterrupted run's.
 *   - step_deadline: stage 1's peer stops working at step 8 while heartbeating (FUSION_TEST_STALL=
 *     step:8:FILE): after --step-timeout the broker names stage 1 from the heartbeats' progress, moves
 *     it to the free peer and takes the staller off the job; with no free peer (_no_spare) every
 *     stage restarts from the newest common checkpoint. Either way the job finishes with the
 *     uninterrupted run's adapter. */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "cluster.h"
#include "fu_clock.h"
#include "wire_keys.h"

#define JOB_STEPS 120
#define KILL_AT   25 /* steps done before the fault (a checkpoint at 20 is committed) */

static const char *g_train_extra = ""; /* more options of the job (a test's wire codecs) */

static const char *train_args(void)
{
    static char a[256];
    snprintf(a, sizeof a, "%s --steps %d%s", TU_TRAIN_ARGS, JOB_STEPS, g_train_extra);
    return a;
}

/* Starts a 4-peer cluster with one backup and a long job; waits until it runs three stages and
 * has done KILL_AT steps. Returns the index of the peer that holds `stage`. */
static int start_job_on(tu_cluster **c_p, const char *tag, const tu_opts *o, const char *broker_args, int stage,
                        char id[17])
{
    tu_cluster *c = *c_p = tu_cluster_new(tag, o);
    if (broker_args)
        tu_broker_args(c, broker_args);
    tu_cluster_start(c);
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 10", train_args());
    (void)tu_wait_step(c, id, KILL_AT, 60000);
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    if (st.n_stages != 3)
        tu_cluster_show_logs(c);
    assert_int_equal(st.n_stages, 3);
    int victim = tu_peer_index(st.stage_peer[stage]);
    assert_true(victim >= 0 && victim < tu_cluster_n_peers(c));
    printf("job %s: stages on %s, %s, %s; step %ld\n", id, st.stage_peer[0], st.stage_peer[1], st.stage_peer[2],
           st.step);
    return victim;
}

static int start_job(tu_cluster **c_p, const char *tag, int heartbeat_ms, int stage, char id[17])
{
    tu_opts o = tu_opts_default(4);
    o.backups = 1;
    o.heartbeat_ms = heartbeat_ms;
    return start_job_on(c_p, tag, &o, NULL, stage, id);
}

/* Prints the first line of the broker's log holding needle; false when there is none. */
static bool print_logged(const tu_cluster *c, const char *needle)
{
    char *bl = tu_broker_log_text(c);
    const char *at = strstr(bl, needle);
    if (at) {
        const char *nl = strchr(at, '\n');
        printf("%.*s\n", (int)(nl ? nl - at : (ptrdiff_t)strlen(at)), at);
    }
    free(bl);
    return at != NULL;
}

/* The first line of the broker's log holding needle (printed), or a test failure. */
static void assert_logged(const tu_cluster *c, const char *needle)
{
    if (print_logged(c, needle))
        return;
    tu_file_show(tu_broker_log(c), 40);
    fail_msg("the broker's log has no '%s'", needle);
}

/* SIGKILLs the broker and starts it again on the same port and store (the environment's test hooks
 * no longer set); the job id is then waited for to be done within timeout_s, and its recovery line
 * printed. */
static void broker_restart_until_done(tu_cluster *c, const char *id, int timeout_s)
{
    assert_int_equal(tu_broker_stop(c, SIGKILL), 128 + SIGKILL);
    uint64_t t0 = fu_clock_ms();
    tu_broker_start(c);
    tu_wait_done(c, id, timeout_s);
    printf("done %llu ms after the restart\n", (unsigned long long)(fu_clock_ms() - t0));
    char needle[96];
    snprintf(needle, sizeof needle, "job %s: recovering after a broker restart", id);
    (void)print_logged(c, needle);
}

/* The broker moved `stage` away from its peer (the failover line of its log). */
static void assert_moved(const tu_cluster *c, const char *id, int stage)
{
    char needle[96];
    snprintf(needle, sizeof needle, "job %s: stage %d moved from", id, stage);
    assert_logged(c, needle);
}

static void test_e2e_fault_peer_kill9(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17];
    int victim = start_job(&c, "e2e-kill9", 300, 1, id);
    printf("SIGKILL to p%d (stage 1 of 3)\n", victim);
    uint64_t t0 = fu_clock_ms();
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    tu_wait_done(c, id, 80);
    printf("the job finished %llu ms after the kill\n", (unsigned long long)(fu_clock_ms() - t0));
    assert_moved(c, id, 1);
    tu_assert_same_adapter(c, id, "model", train_args());
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* 4 peers, a backup, heartbeats 2000 ms apart (dead after 6000 ms of silence), p0 and p2 through
 * gateway gw0, p1 and p3 through gw1; failover: each is given the other gateway too. */
static tu_opts two_gateways(bool failover)
{
    tu_opts o = tu_opts_default(4);
    o.backups = 1;
    o.heartbeat_ms = 2000;
    o.gateways = 2;
    o.gateway_failover = failover;
    return o;
}

/* The same through gateways (docs/PROTOCOL.md "Gateways"): every peer and the client connect to one
 * of two fusion-gateways, which alone hold connections to the broker, so consecutive stages talk to
 * the broker through different gateways. With heartbeats 2000 ms apart (dead after 6000 ms) the
 * killed peer is declared dead "connection closed", which only its gateway's MSG_GATEWAY_CLOSED can
 * have told, and the adapter is the uninterrupted run's. */
static void test_e2e_fault_peer_kill9_gateway(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17];
    tu_opts o = two_gateways(false);
    int victim = start_job_on(&c, "e2e-kill9-gw", &o, NULL, 1, id);
    printf("SIGKILL to p%d (stage 1 of 3), behind gateway gw%d\n", victim, victim % 2);
    uint64_t t0 = fu_clock_ms();
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    assert_true(tu_broker_wait_log(c, 4000, "(p%d) is dead: connection closed", victim));
    printf("declared dead %llu ms after the kill (dead after 6000 ms by silence)\n",
           (unsigned long long)(fu_clock_ms() - t0));
    tu_wait_done(c, id, 80);
    assert_moved(c, id, 1);
    tu_assert_same_adapter(c, id, "model", train_args());
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A gateway dies (docs/PEER.md "Several endpoints"): every peer is given both gateways, its own
 * first, and gw1, which carries p1 and p3 (one of them holds a stage: three stages and a backup on
 * four peers), is SIGKILLed mid-job. Its peers lose their connection and, half a heartbeat later
 * (1000 ms), move to gw0 and say at once that they are alive, well inside the broker's silence (6000
 * ms): no peer is declared dead, no stage moves, and the adapter is the uninterrupted run's. */
static void test_e2e_fault_gateway_kill9_failover(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17];
    tu_opts o = two_gateways(true);
    (void)start_job_on(&c, "e2e-gw-failover", &o, NULL, 1, id);
    printf("SIGKILL to gateway gw1 (p1 and p3 connect through it)\n");
    uint64_t t0 = fu_clock_ms();
    (void)tu_gateway_stop(c, 1, SIGKILL);
    for (int i = 1; i < 4; i += 2) {
        char log[TU_PATH];
        tu_path(c, log, "p%d.log", i);
        if (!tu_file_wait(log, "moving to", 5000)) {
            tu_cluster_show_logs(c);
            fail_msg("p%d did not move to the other gateway within 5 s of its gateway's death", i);
        }
        printf("p%d moved to gw0 within %llu ms of the kill\n", i, (unsigned long long)(fu_clock_ms() - t0));
    }
    /* a client given both gateways, the dead one first, is answered through the other */
    char k0[TU_PATH], k1[TU_PATH], *out = NULL;
    tu_path(c, k0, "gw0/" WIRE_PUBLIC_KEY_FILE);
    tu_path(c, k1, "gw1/" WIRE_PUBLIC_KEY_FILE);
    int code = tu_fusion(c, &out, "status %s --broker %s,%s --broker-key %s,%s", id, tu_gateway_endpoint(c, 1),
                         tu_gateway_endpoint(c, 0), k1, k0);
    printf("%s", out);
    assert_int_equal(code, 0);
    assert_non_null(strstr(out, "connection refused at "));
    free(out);
    tu_wait_done(c, id, 80);
    char *bl = tu_broker_log_text(c);
    bool dead = strstr(bl, ") is dead") != NULL, moved = strstr(bl, " moved from ") != NULL;
    free(bl);
    if (dead || moved)
        tu_file_show(tu_broker_log(c), 60);
    assert_false(dead);
    assert_false(moved);
    tu_assert_same_adapter(c, id, "model", train_args());
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Wire codecs through a failover (issue "Home links"): int8 activations and int8 gradients with error
 * feedback. The peer of stage 1 is SIGKILLed after step KILL_AT; its backup takes the same range from
 * the checkpoint of step 20, where every residual starts from zero as in a run without the fault, so
 * the adapter is `fusion run finetune --cuts (the plan's) --wire-codec int8,int8-ef --checkpoint-every
 * 10`'s bit for bit. */
static void test_e2e_fault_peer_kill9_int8_ef(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17], cuts[64], ref[384];
    g_train_extra = " --wire-codec int8,int8-ef";
    int victim = start_job(&c, "e2e-kill9-ef", 300, 1, id);
    printf("SIGKILL to p%d (stage 1 of 3)\n", victim);
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    tu_wait_done(c, id, 80);
    assert_moved(c, id, 1);
    tu_job_cuts(c, id, cuts, sizeof cuts);
    snprintf(ref, sizeof ref, "%s --cuts %s --checkpoint-every 10", train_args(), cuts);
    g_train_extra = "";
    tu_assert_identical_adapter(c, id, "model", ref, 1);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_e2e_fault_peer_leave(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17];
    int victim = start_job(&c, "e2e-leave", 300, 0, id);
    printf("SIGTERM to p%d (stage 0 of 3)\n", victim);
    assert_int_equal(tu_peer_stop(c, victim, SIGTERM, 20000), 0); /* a graceful leave */
    tu_wait_done(c, id, 80);
    assert_moved(c, id, 0);
    tu_assert_same_adapter(c, id, "model", train_args());
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The state `fusion peers --json` gives peer pI ("" when not listed). */
static void peer_state(const tu_cluster *c, int i, char *state, size_t cap)
{
    tu_peer_seen seen;
    (void)tu_peer_seen_get(c, i, &seen);
    snprintf(state, cap, "%s", seen.state);
}

/* The wall-clock time (ms since the epoch) of the first line of the broker's log that holds needle,
 * from the line's own ISO-8601 stamp; 0 when there is none. The broker's judgement, not when a
 * client polling it under load happened to hear of it. */
static int64_t broker_log_time(const tu_cluster *c, const char *needle)
{
    char *log = tu_broker_log_text(c);
    const char *hit = log ? strstr(log, needle) : NULL;
    int64_t ms = 0;
    if (hit) {
        const char *line = hit;
        while (line > log && line[-1] != '\n')
            line--;
        struct tm tm;
        memset(&tm, 0, sizeof tm);
        int milli = 0;
        if (sscanf(line, "%d-%d-%dT%d:%d:%d.%dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min,
                   &tm.tm_sec, &milli) == 7) {
            tm.tm_year -= 1900;
            tm.tm_mon -= 1;
            ms = (int64_t)timegm(&tm) * 1000 + milli;
        }
    }
    free(log);
    return ms;
}

static void test_e2e_fault_peer_sigstop(void **state)
{
    (void)state;
    tu_cluster *c;
    char id[17];
    /* The broker's default heartbeat (1000 ms, dead after 3000 ms): the detection time is real. */
    int victim = start_job(&c, "e2e-sigstop", 0, 2, id);
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    long at_stop = st.step;
    printf("SIGSTOP to p%d (stage 2 of 3) at step %ld\n", victim, at_stop);
    uint64_t t0 = fu_clock_ms();
    int64_t t0_wall = fu_wallclock_ms();
    tu_peer_signal(c, victim, SIGSTOP);
    /* Detection: the broker lists the peer as dead. */
    char ps[32] = "";
    uint64_t t_dead = 0, t_moved = 0, t_resumed = 0;
    uint64_t end = t0 + 15000;
    while (fu_clock_ms() < end && !t_dead) {
        peer_state(c, victim, ps, sizeof ps);
        if (strcmp(ps, "dead") == 0)
            t_dead = fu_clock_ms();
        else
            fu_sleep_ms(20);
    }
    if (!t_dead)
        tu_cluster_show_logs(c);
    assert_true(t_dead > 0);
    /* Recovery: the stage is on another peer, and the job is past the step it had reached. */
    char victim_name[16];
    snprintf(victim_name, sizeof victim_name, "p%d", victim);
    end = t0 + 60000;
    while (fu_clock_ms() < end && !t_resumed) {
        if (tu_status_get(c, id, &st)) {
            if (!t_moved && st.n_stages == 3 && st.stage_peer[2][0] && strcmp(st.stage_peer[2], victim_name) != 0)
                t_moved = fu_clock_ms();
            if (strcmp(st.state, "done") == 0 || (t_moved && st.step > at_stop))
                t_resumed = fu_clock_ms();
        }
        if (!t_resumed)
            fu_sleep_ms(20);
    }
    if (!t_resumed)
        tu_cluster_show_logs(c);
    assert_true(t_resumed > 0);
    if (!t_moved)
        t_moved = t_resumed;
    printf("SIGSTOP: detected (peer dead) after %llu ms; stage reassigned after %llu ms; the job past step %ld "
           "again after %llu ms (heartbeat 1000 ms, dead after 3000 ms)\n",
           (unsigned long long)(t_dead - t0), (unsigned long long)(t_moved - t0), at_stop,
           (unsigned long long)(t_resumed - t0));
    /* The broker declares it dead 3 s after its last heartbeat (so 2 to 3 s after the stop): within
     * 5 s by the broker's own clock; the client's polls (processes of their own, slow on a loaded
     * machine) only tell it later. */
    char needle[32];
    snprintf(needle, sizeof needle, "(p%d) is dead: silent", victim);
    int64_t t_declared = broker_log_time(c, needle);
    printf("the broker declared it dead %lld ms after the stop\n", (long long)(t_declared - t0_wall));
    assert_true(t_declared > 0);
    assert_true(t_declared - t0_wall >= 1500 && t_declared - t0_wall <= 5000);
    tu_wait_done(c, id, 60);
    assert_moved(c, id, 2);
    tu_assert_same_adapter(c, id, "model", train_args());
    /* SIGCONT: its next message is refused, it registers again and is live (not dead) */
    tu_peer_signal(c, victim, SIGCONT);
    end = fu_clock_ms() + 15000;
    do {
        peer_state(c, victim, ps, sizeof ps);
        if (strcmp(ps, "dead") != 0 && ps[0])
            break;
        fu_sleep_ms(50);
    } while (fu_clock_ms() < end);
    printf("after SIGCONT p%d is %s\n", victim, ps);
    assert_string_not_equal(ps, "dead");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The job ids `fusion jobs --json` lists, concatenated. */
static char *listed_jobs(const tu_cluster *c)
{
    char *out = NULL;
    int rc = tu_fusion(c, &out, "jobs --json 2>/dev/null");
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

/* The broker is SIGKILLed mid-job and restarted on its port and store; with `gateways`, every peer
 * and the client stay connected to their gateway, which reconnects to the restarted broker by
 * itself. */
static void broker_kill9_restart(int gateways)
{
    tu_opts o = tu_opts_default(3);
    o.heartbeat_ms = 300;
    o.gateways = gateways;
    tu_cluster *c = tu_cluster_new("e2e-broker", &o);
    tu_cluster_start(c);
    char run[17], q[2][17];
    tu_submit_finetune(c, run, "model", "%s --checkpoint-every 10", train_args());
    const char *small = TU_TRAIN_ARGS " --steps 6";
    for (int i = 0; i < 2; i++) /* queued behind it: every peer is busy */
        tu_submit_finetune(c, q[i], "model", "%s --checkpoint-every 3", small);
    (void)tu_wait_step(c, run, KILL_AT, 60000);
    char *before = listed_jobs(c);
    printf("before the kill: jobs %s\n", before);
    assert_int_equal(tu_broker_stop(c, SIGKILL), 128 + SIGKILL);
    uint64_t t0 = fu_clock_ms();
    tu_broker_start(c); /* same port, same SQLite file */
    printf("broker restarted in %llu ms\n", (unsigned long long)(fu_clock_ms() - t0));
    char *after = listed_jobs(c);
    printf("after the restart: jobs %s\n", after);
    const char *ids[3] = {run, q[0], q[1]};
    for (int i = 0; i < 3; i++) {
        assert_non_null(strstr(before, ids[i]));
        if (!strstr(after, ids[i]))
            fail_msg("job %s was acknowledged before the kill and is not listed after the restart", ids[i]);
    }
    free(before);
    free(after);
    tu_wait_done(c, run, 70);
    printf("the running job finished %llu ms after the restart\n", (unsigned long long)(fu_clock_ms() - t0));
    char needle[96];
    snprintf(needle, sizeof needle, "job %s: recovering after a broker restart", run);
    (void)print_logged(c, needle);
    tu_assert_same_adapter(c, run, "model", train_args());
    for (int i = 0; i < 2; i++)
        tu_wait_done(c, q[i], 30);
    for (int k = 0; k < gateways; k++) /* the gateways lived through it */
        assert_true(tu_gateway_pid(c, k) > 0 && kill(tu_gateway_pid(c, k), 0) == 0);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_e2e_fault_broker_kill9_restart(void **state)
{
    (void)state;
    broker_kill9_restart(0);
}

/* The same behind a gateway: the gateway's connection to the broker comes back with its routing id,
 * and the broker's answers find the peers through it again. */
static void test_e2e_fault_broker_kill9_restart_gateway(void **state)
{
    (void)state;
    broker_kill9_restart(1);
}

/* The broker is down for 8 s (heartbeat 300 ms): each peer says PeerHello every 0.9 s into the void,
 * and ZeroMQ delivers that backlog when the broker is back. The first hello of a peer registers it,
 * the rest of the same session are answered and change nothing: the job resumes once, finishes with
 * the uninterrupted run's adapter, and no peer loses reputation for the broker's outage. */
static void test_e2e_fault_broker_outage_storm(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    o.heartbeat_ms = 300;
    tu_cluster *c = tu_cluster_new("e2e-storm", &o);
    tu_cluster_start(c);
    char run[17];
    tu_submit_finetune(c, run, "model", "%s --checkpoint-every 10", train_args());
    (void)tu_wait_step(c, run, KILL_AT, 60000);
    tu_peer_seen before[3];
    for (int i = 0; i < 3; i++)
        assert_true(tu_peer_seen_get(c, i, &before[i]));
    assert_int_equal(tu_broker_stop(c, SIGKILL), 128 + SIGKILL);
    fu_sleep_ms(8000);
    uint64_t t0 = fu_clock_ms();
    tu_broker_start(c); /* same port, same SQLite file */
    tu_wait_done(c, run, 90);
    printf("the job finished %llu ms after the restart\n", (unsigned long long)(fu_clock_ms() - t0));
    char *bl = tu_broker_log_text(c);
    int recoveries = 0;
    for (const char *at = bl; (at = strstr(at, "recovering after a broker restart")) != NULL; at++)
        recoveries++;
    int sessions = 0;
    for (const char *at = bl; (at = strstr(at, "registered again (new session)")) != NULL; at++)
        sessions++;
    printf("after the restart: %d recoveries, %d stages dropped for a new session\n", recoveries, sessions);
    free(bl);
    assert_int_equal(sessions, 0);
    tu_assert_same_adapter(c, run, "model", train_args());
    for (int i = 0; i < 3; i++) {
        tu_peer_seen now;
        assert_true(tu_peer_seen_get(c, i, &now));
        printf("p%d: reputation %.2f (before the outage %.2f)\n", i, now.reputation, before[i].reputation);
        assert_true(now.reputation >= before[i].reputation);
    }
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* ---- deadlines on the work (two-stage cluster, docs/PIPELINE.md "Failures") --------------------- */

#define DL_STEPS 20
static const char *dl_train_args(void)
{
    static char a[256];
    snprintf(a, sizeof a, "%s --steps %d", TU_TRAIN_ARGS, DL_STEPS);
    return a;
}

static void stall_file(const tu_cluster *c, int i, bool on)
{
    char f[TU_PATH];
    tu_path(c, f, "stall.p%d", i);
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
    char id[17], needle[160];
    tu_opts o = tu_opts_two_stage(3, 1);
    o.stall = "ready";
    o.ready_timeout_s = 5;
    tu_cluster *c = tu_cluster_new("e2e-ready", &o);
    tu_cluster_start(c);
    for (int i = 0; i < o.n_peers; i++) /* nobody says StageReady until the victim is known */
        stall_file(c, i, true);
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 5", dl_train_args());
    int victim = tu_stage_peer(c, id, 1, 30000);
    uint64_t t0 = fu_clock_ms();
    for (int i = 0; i < o.n_peers; i++)
        if (i != victim)
            stall_file(c, i, false);
    printf("p%d (stage 1) never says StageReady; --ready-timeout %d\n", victim, o.ready_timeout_s);
    /* While it recovers, and after, the job says why. */
    char seen[512] = "";
    tu_status st;
    while (fu_clock_ms() < t0 + 30000 && !seen[0]) {
        if (tu_status_get(c, id, &st) && strstr(st.message, "missed its ready deadline"))
            snprintf(seen, sizeof seen, "%s", st.message);
        else if (strcmp(st.state, "done") == 0 || strcmp(st.state, "failed") == 0)
            break;
    }
    printf("fusion status: %s\n", seen[0] ? seen : "(the recovery was not seen)");
    tu_wait_done(c, id, 60);
    printf("the job finished %llu ms after the victim was chosen\n", (unsigned long long)(fu_clock_ms() - t0));
    snprintf(needle, sizeof needle, "(p%d) missed its ready deadline", victim);
    assert_logged(c, needle);
    assert_moved(c, id, 1);
    assert_true(seen[0]);
    assert_non_null(strstr(seen, "recover"));
    tu_assert_same_adapter(c, id, "model", dl_train_args());
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Starts a two-stage job on n_peers peers, makes stage 1's peer stall at step 8 while it keeps
 * heartbeating (--step-timeout 3), waits for the job to finish and checks that the broker saw the
 * deadline pass and named stage 1 from the heartbeats. */
static tu_cluster *stall_stage1(const char *tag, int n_peers, int backups, char id[17])
{
    char needle[160];
    tu_opts o = tu_opts_two_stage(n_peers, backups);
    o.stall = "step:8";
    o.step_timeout_s = 3;
    tu_cluster *c = tu_cluster_new(tag, &o);
    tu_cluster_start(c);
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 5", dl_train_args());
    int victim = tu_stage_peer(c, id, 1, 30000);
    stall_file(c, victim, true);
    printf("p%d (stage 1) stalls at step 8 while heartbeating; --step-timeout %d\n", victim, o.step_timeout_s);
    uint64_t t0 = fu_clock_ms();
    tu_wait_done(c, id, 70);
    printf("the job finished %llu ms after the stall was armed\n", (unsigned long long)(fu_clock_ms() - t0));
    char plog[TU_PATH];
    tu_path(c, plog, "p%d.log", victim);
    char *pl = tu_file_text(plog);
    bool stalled = strstr(pl, "stalling at step 8") != NULL;
    free(pl);
    if (!stalled)
        fail_msg("p%d never stalled (the job passed step 8 before the hook was armed?)", victim);
    snprintf(needle, sizeof needle, "job %s: no progress past step 8 for", id);
    assert_logged(c, needle);
    assert_logged(c, "; stage 1 (peer "); /* named from the heartbeats: 0/1 forward */
    return c;
}

/* With a free peer, the stage behind moves to it and the staller is taken off the job. */
static void test_e2e_fault_step_deadline(void **state)
{
    (void)state;
    char id[17], needle[160];
    tu_cluster *c = stall_stage1("e2e-step", 3, 1, id);
    snprintf(needle, sizeof needle, "job %s: stage 1: peer", id);
    assert_logged(c, needle);
    assert_logged(c, "is taken off the job");
    assert_moved(c, id, 1);
    tu_assert_same_adapter(c, id, "model", dl_train_args());
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* With no other peer to move the stage to, every stage restarts from the newest checkpoint on the
 * same peers (the hook stalls once, so the second run gets through). */
static void test_e2e_fault_step_deadline_no_spare(void **state)
{
    (void)state;
    char id[17];
    tu_cluster *c = stall_stage1("e2e-step-same", 2, 0, id);
    assert_logged(c, "restarting every stage from step 5");
    tu_assert_same_adapter(c, id, "model", dl_train_args());
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* An eval (forward only, no checkpoint) whose stage 1 stalls at step 8: after the step deadline it
 * starts again from step 0 (its sums with it) on the peers it gets, and its result equals `fusion
 * eval` in one process: no step counted twice or lost. */
static void test_e2e_fault_eval_starts_again(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(3, 1);
    o.stall = "step:8";
    o.step_timeout_s = 3;
    tu_cluster *c = tu_cluster_new("e2e-eval-stall", &o);
    tu_cluster_start(c);
    const char *ev = "--heldout 0.5 --seq-len 16 --batch 4";
    char id[17];
    tu_submit(c, id, "eval --model model --data '%s' %s", tu_cluster_data(c), ev);
    int victim = tu_stage_peer(c, id, 1, 30000);
    stall_file(c, victim, true);
    tu_wait_done(c, id, 70);
    char plog[TU_PATH];
    tu_path(c, plog, "p%d.log", victim);
    char *pl = tu_file_text(plog);
    bool stalled = strstr(pl, "stalling at step 8") != NULL;
    free(pl);
    if (!stalled)
        fail_msg("p%d never stalled (the eval passed step 8 before the hook was armed?)", victim);
    char needle[160];
    snprintf(needle, sizeof needle, "job %s: no progress past step 8 for", id);
    assert_logged(c, needle);
    snprintf(needle, sizeof needle, "job %s: every stage is ready; started at step 0", id);
    char *bl = tu_broker_log_text(c);
    int starts = 0;
    for (const char *q = bl; (q = strstr(q, needle)); q++)
        starts++;
    free(bl);
    assert_true(starts >= 2); /* started again from step 0 */
    char *st = NULL, *local = NULL;
    assert_int_equal(tu_fusion(c, &st, "status %s --json", id), 0);
    assert_int_equal(tu_fusion(c, &local, "eval --model model --data '%s' %s --json", tu_cluster_data(c), ev), 0);
    printf("through the broker: %.300s\nin one process: %s", st, local);
    const char *l = strstr(st, "\\\"loss\\\":"), *t = strstr(st, "\\\"targets\\\":");
    const char *bl2 = strstr(local, "\"base_loss\":"), *tl = strstr(local, "\"targets\":");
    assert_non_null(l);
    assert_non_null(t);
    assert_non_null(bl2);
    assert_non_null(tl);
    double a = strtod(l + 9, NULL), b = strtod(bl2 + 12, NULL);
    assert_int_equal(strtol(t + 12, NULL, 10), strtol(tl + 10, NULL, 10));
    if (!(fabs(a - b) <= 1e-5 * fabs(b)))
        fail_msg("loss %.9g through the broker after the stall, %.9g in one process", a, b);
    free(st);
    free(local);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Re-planning onto the peers that are left (docs/PIPELINE.md "Re-planning"): three peers, no backup,
 * a three-stage job; one stage's peer is SIGKILLed after a checkpoint (every 10 steps). The two
 * survivors can hold the job in two stages (each offers 48 MiB: three layers, not six), so the broker
 * plans it again over them, cuts the three stages' newest checkpoint into two by tensor name,
 * and the job finishes with fusion run's adapter, bit for bit. The survivors keep their reputation. */
static void test_e2e_fault_replan_without_spare(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    o.peer_memory_gb = "0.047";
    o.heartbeat_ms = 300;
    tu_cluster *c;
    char id[17];
    /* --grow-margin 0: the job takes every peer that lowers its bottleneck (with one micro-batch two
     * stages predict the same step time as three, and the job would take two) */
    int victim = start_job_on(&c, "e2e-replan", &o, "--grow-margin 0", 1, id);
    printf("SIGKILL to p%d (stage 1 of 3)\n", victim);
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    tu_wait_done(c, id, 120);
    char needle[160];
    snprintf(needle, sizeof needle, "job %s: its checkpoint at step ", id);
    assert_logged(c, needle);
    assert_logged(c, " (3 stages) is cut again for 2 stages");
    assert_true(tu_broker_logged(c, "job %s stage 1/2 on ", id)); /* the second plan has two stages */
    tu_assert_identical_adapter(c, id, "model", train_args(), 2);
    /* the survivors did nothing wrong */
    tu_peer_seen seen[TU_MAX_PEERS];
    int n = tu_peers_list(c, seen, TU_MAX_PEERS);
    for (int i = 0; i < n; i++) {
        if (tu_peer_index(seen[i].name) == victim)
            continue;
        printf("%s: reputation %.2f\n", seen[i].name, seen[i].reputation);
        assert_true(seen[i].reputation >= 0.999);
    }
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The replan_without_spare setup with the writer slowed to 3 s (FUSION_TEST_CUT_DELAY_MS, a test
 * hook): the job's stage-1 peer is SIGKILLed, the job is planned again over the two survivors, and
 * its checkpoint is cut for the two stages off the broker's loop. Returns the cluster and the index
 * of the victim once the broker has taken that decision; the loop still answers meanwhile: `fusion
 * status` says the checkpoint is being cut. */
static tu_cluster *replan_while_cut(const char *tag, char id[17], int *victim)
{
#ifndef FUSION_TEST_HOOKS
    skip(); /* without the hook the cut is over before the test can act while it runs */
#endif
    tu_opts o = tu_opts_default(4); /* p3 is started by the test that wants it */
    o.peer_memory_gb = "0.047";
    o.heartbeat_ms = 300;
    tu_cluster *c = tu_cluster_new(tag, &o);
    tu_broker_args(c, "--grow-margin 0");
    setenv("FUSION_TEST_CUT_DELAY_MS", "3000", 1); /* the broker inherits it */
    tu_broker_start(c);
    unsetenv("FUSION_TEST_CUT_DELAY_MS");
    for (int i = 0; i < 3; i++)
        tu_peer_start(c, i, NULL);
    for (int i = 0; i < 3; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        tu_peer_wait_joined(c, i, 30000);
        assert_true(tu_peer_profile_checked(c, name, 30000)); /* planned over all three */
    }
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 10", train_args());
    (void)tu_wait_step(c, id, KILL_AT, 60000);
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    assert_int_equal(st.n_stages, 3);
    *victim = tu_stage_peer(c, id, 1, 30000);
    printf("SIGKILL to p%d (stage 1 of 3)\n", *victim);
    (void)tu_peer_stop(c, *victim, SIGKILL, 5000);
    if (!tu_broker_wait_log(c, 30000, "taking the peers; its checkpoint is cut for the new stages"))
        tu_file_show(tu_broker_log(c), 40);
    assert_true(tu_broker_logged(c, "taking the peers; its checkpoint is cut for the new stages"));
    assert_true(tu_status_get(c, id, &st));
    printf("while the checkpoint is cut: %s: %s\n", st.state, st.message);
    assert_non_null(strstr(st.message, "is cut for the new stages"));
    return c;
}

/* While the re-plan's checkpoint is cut, a survivor the plan chose is SIGKILLed: the plan does not
 * start on it (the writer's commit is refused, the peer being dead in the store, or the plan is
 * made again when the cut is back); a fourth peer joins, the job is planned over it and the other
 * survivor, and it finishes with `fusion run finetune`'s adapter, bit for bit. */
static void test_e2e_fault_replan_peer_lost_while_cut(void **state)
{
    (void)state;
    char id[17];
    int victim = -1;
    tu_cluster *c = replan_while_cut("e2e-cutloss", id, &victim);
    int lost = victim == 0 ? 1 : 0;
    printf("SIGKILL to p%d (a survivor the new plan chose); p3 joins\n", lost);
    (void)tu_peer_stop(c, lost, SIGKILL, 5000);
    tu_peer_start(c, 3, NULL);
    tu_wait_done(c, id, 180);
    bool refused = tu_broker_logged(c, "could not be stored: the job ended, or a peer it chose left, meanwhile");
    bool again = tu_broker_logged(c, "left while its checkpoint was cut");
    printf("the first cut's plan was %s\n", refused ? "refused by the store" : again ? "made again" : "started (!)");
    assert_true(refused || again);
    assert_true(tu_broker_logged(c, "job %s stage 1/2 on ", id));
    tu_assert_identical_adapter(c, id, "model", train_args(), 2);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The broker SIGKILLed while a re-plan's checkpoint is cut (the writer slowed to 3 s, its commit of
 * the cut and the new plan not made) and restarted on the same store: the store still holds the
 * old plan and the uncut checkpoint, so the restart recovers from that, plans the job over the two
 * survivors again and cuts again, and the job ends with fusion run's adapter, bit for bit. */
static void test_e2e_fault_broker_killed_while_cut(void **state)
{
    (void)state;
    char id[17];
    int victim = -1;
    tu_cluster *c = replan_while_cut("e2e-cutbroker", id, &victim);
    printf("SIGKILL to the broker while the checkpoint of job %s is cut\n", id);
    broker_restart_until_done(c, id, 120);
    tu_assert_identical_adapter(c, id, "model", train_args(), 2);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A job cancelled while its checkpoint is cut ends cancelled: the writer's commit is refused (or
 * made before, and the cancel comes after it), and the peers it took are idle again. */
static void test_e2e_fault_cancel_while_cut(void **state)
{
    (void)state;
    char id[17];
    int victim = -1;
    tu_cluster *c = replan_while_cut("e2e-cutcancel", id, &victim);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "cancel %s", id), 0);
    printf("%s", out);
    free(out);
    assert_true(tu_broker_wait_log(c, 20000, "job %s ended while its checkpoint was cut", id));
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    printf("after the cut: %s: %s\n", st.state, st.message);
    assert_string_equal(st.state, "cancelled");
    tu_peer_seen seen[TU_MAX_PEERS];
    int n = tu_peers_list(c, seen, TU_MAX_PEERS), live = 0;
    for (int i = 0; i < n; i++) {
        printf("%s: %s\n", seen[i].name, seen[i].state);
        if (tu_peer_index(seen[i].name) != victim) {
            live++;
            assert_string_equal(seen[i].state, "idle");
        }
    }
    assert_int_equal(live, 2);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A job whose every stage is done, with the broker's finish (its adapter assembled from the
 * stages' checkpoints and committed, on the writer thread) slowed to 3 s by FUSION_TEST_FINISH_DELAY_MS
 * (a test hook). Returns the cluster and the index of stage 1's peer once the finish has begun. */
static tu_cluster *finish_slowly(const char *tag, char id[17], int *victim)
{
#ifndef FUSION_TEST_HOOKS
    skip(); /* without the hook the finish is over before the test can act while it runs */
#endif
    tu_cluster *c = NULL;
    setenv("FUSION_TEST_FINISH_DELAY_MS", "3000", 1); /* the broker inherits it */
    *victim = start_job(&c, tag, 300, 1, id);
    unsetenv("FUSION_TEST_FINISH_DELAY_MS");
    if (!tu_broker_wait_log(c, 120000, "job %s: every stage is done; its adapter is assembled", id))
        tu_file_show(tu_broker_log(c), 40);
    assert_true(tu_broker_logged(c, "job %s: every stage is done; its adapter is assembled", id));
    tu_status st;
    assert_true(tu_status_get(c, id, &st)); /* the loop answers meanwhile */
    printf("while it finishes: %s, step %ld: %s\n", st.state, st.step, st.message);
    assert_string_equal(st.state, "running");
    return c;
}

/* A stage's peer SIGKILLed while its job finishes: its work is done, so the stage does not move
 * (no failover, no restart from a checkpoint), and the job ends done with fusion run's adapter. */
static void test_e2e_fault_peer_lost_while_finishing(void **state)
{
    (void)state;
    char id[17];
    int victim = -1;
    tu_cluster *c = finish_slowly("e2e-finloss", id, &victim);
    printf("SIGKILL to p%d (stage 1 of 3, done)\n", victim);
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    tu_wait_done(c, id, 60);
    assert_false(tu_broker_logged(c, "job %s: stage 1 moved from", id));
    assert_false(tu_broker_logged(c, "job %s: stage 1 lost its peer", id));
    tu_assert_identical_adapter(c, id, "model", train_args(), 3);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The broker SIGKILLed while a job finishes (its adapter being assembled on the writer, the result
 * not yet committed) and restarted on the same store: the job is still running there, every stage's
 * last checkpoint committed, so the restart finishes it from those checkpoints without running a
 * step again, and it ends done with fusion run's adapter, bit for bit. */
static void test_e2e_fault_broker_killed_while_finishing(void **state)
{
    (void)state;
    char id[17];
    int victim = -1;
    tu_cluster *c = finish_slowly("e2e-finbroker", id, &victim);
    printf("SIGKILL to the broker while job %s finishes\n", id);
    broker_restart_until_done(c, id, 60);
    tu_assert_identical_adapter(c, id, "model", train_args(), 3);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A job cancelled while it finishes ends cancelled: the writer's commit of its result is refused
 * (the job is no longer running in the store), and its peers are idle again. */
static void test_e2e_fault_cancel_while_finishing(void **state)
{
    (void)state;
    char id[17];
    int victim = -1;
    tu_cluster *c = finish_slowly("e2e-fincancel", id, &victim);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "cancel %s", id), 0);
    printf("%s", out);
    free(out);
    assert_true(tu_broker_wait_log(c, 20000, "job %s: its adapter was assembled after it ended", id));
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    printf("after the finish: %s: %s\n", st.state, st.message);
    assert_string_equal(st.state, "cancelled");
    tu_peer_seen seen[TU_MAX_PEERS];
    int n = tu_peers_list(c, seen, TU_MAX_PEERS);
    assert_int_equal(n, 4);
    for (int i = 0; i < n; i++) {
        printf("%s: %s\n", seen[i].name, seen[i].state);
        assert_string_equal(seen[i].state, "idle");
    }
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Growth (docs/PIPELINE.md "Growth"): a job on a 12-layer model runs on two peers (no memory cap:
 * the partitioner gives each its own stage, six layers); a third peer joins. With 8 micro-batches
 * three stages of four layers predict a step about a quarter shorter ((8 + 2) x 4 against
 * (8 + 1) x 6 layer-times), so at the job's next checkpoint it is planned again over the three and
 * goes on from that checkpoint, cut for three stages; its adapter is fusion run's, bit for bit. The
 * peers claim 10 GFLOP/s each (--gflops) and the broker believes them (challenges off): speeds
 * measured on a loaded machine made the newcomer's gain a coin toss (one measured at 18 against 30
 * and 36 made three stages only 4% faster). With equal speeds the gain is 15-30% (the links' measured
 * latency, which load changes, counts in the plan: 0.194 s against 0.228 s once in CI), so the broker
 * here grows past a 10% gain (--grow-margin 0.1). */
static void test_e2e_fault_grow_when_a_peer_joins(void **state)
{
    (void)state;
    static const char train[] = "--rank 4 --alpha 8 --batch 8 --micro-batches 8 --seq-len 16 --lr 0.01 --seed 7 "
                                "--steps 120";
    tu_opts o = tu_opts_default(3);
    o.model_args = "--layers 12 --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 256 --seed 3";
    o.peer_memory_gb = NULL;
    o.heartbeat_ms = 300;
    o.log_level = "debug";
    o.peer_extra[0] = "--gflops";
    o.peer_extra[1] = "10";
    o.challenge_ms = -1;
    o.grow_margin = "0.1";
    tu_cluster *c = tu_cluster_new("e2e-grow", &o);
    tu_broker_start(c);
    for (int i = 0; i < 2; i++)
        tu_peer_start(c, i, NULL);
    for (int i = 0; i < 2; i++)
        tu_peer_wait_joined(c, i, 30000);
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 10", train);
    long at = tu_wait_step(c, id, 5, 60000);
    assert_true(tu_broker_logged(c, "job %s stage 1/2 on ", id));
    printf("job %s runs on two stages at step %ld; p2 joins\n", id, at);
    tu_peer_start(c, 2, NULL);
    tu_peer_wait_joined(c, 2, 30000);
    tu_wait_done(c, id, 120);
    char needle[160];
    snprintf(needle, sizeof needle, "job %s: growing: 1 idle peer can join", id);
    assert_logged(c, needle);
    assert_logged(c, " (2 stages) is cut again for 3 stages");
    assert_true(tu_broker_logged(c, "job %s stage 2/3 on ", id));
    tu_assert_identical_adapter(c, id, "model", train, 1);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The chaotic configuration (issue "Elastic and heterogeneous"): four unlike peers (1, 2, 3 and 1
 * compute threads; room for two layers, no cap, no cap, room for three; links of 300, 1000, 100 and
 * 1000 MB/s), no backup, the broker taking every peer that lowers the slowest stage. The plan sizes
 * each stage to its peer (the broker's log explains it); mid-job the last stage's peer is SIGKILLed
 * and the job is planned again over the three left, its checkpoint cut for the new stages. The
 * adapter has the bits of `fusion run finetune` with --threads 1 and with --threads 2. */
static void test_e2e_fault_chaotic_same_bits(void **state)
{
    (void)state;
    static const char *const threads[] = {"1", "2", "3", "1"}, *const memory[] = {"0.039", "", "", "0.047"},
                             *const link[] = {"300", "1000", "100", "1000"};
    tu_opts o = tu_opts_default(4);
    o.heartbeat_ms = 300;
    for (int i = 0; i < 4; i++) {
        o.peer_threads[i] = threads[i];
        o.peer_memory[i] = memory[i];
        o.peer_link[i] = link[i];
    }
    tu_cluster *c = tu_cluster_new("e2e-chaos", &o);
    tu_broker_args(c, "--grow-margin 0");
    tu_cluster_start(c);
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 10", train_args());
    (void)tu_wait_step(c, id, KILL_AT, 60000);
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    assert_true(st.n_stages >= 2);
    char *bl = tu_broker_log_text(c), needle[40];
    snprintf(needle, sizeof needle, "job %s stage ", id);
    for (const char *at = bl; (at = strstr(at, needle)) != NULL; at++) { /* the plans and why */
        const char *nl = strchr(at, '\n');
        printf("%.*s\n", (int)(nl ? nl - at : (ptrdiff_t)strlen(at)), at);
    }
    free(bl);
    int victim = tu_peer_index(st.stage_peer[st.n_stages - 1]);
    printf("SIGKILL to p%d (the last of %d stages) at step %ld\n", victim, st.n_stages, st.step);
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    tu_wait_done(c, id, 150);
    tu_assert_identical_adapter(c, id, "model", train_args(), 1);
    tu_assert_identical_adapter(c, id, "model", train_args(), 2);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_fault_peer_kill9, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_peer_kill9_gateway, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_gateway_kill9_failover, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_peer_kill9_int8_ef, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_peer_leave, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_peer_sigstop, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_broker_kill9_restart, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_broker_kill9_restart_gateway, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_broker_outage_storm, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_ready_deadline, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_step_deadline, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_step_deadline_no_spare, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_eval_starts_again, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_replan_without_spare, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_replan_peer_lost_while_cut, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_cancel_while_cut, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_broker_killed_while_cut, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_peer_lost_while_finishing, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_cancel_while_finishing, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_broker_killed_while_finishing, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_grow_when_a_peer_joins, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_fault_chaotic_same_bits, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
