/* fusion-peer with the real fusion-broker and the real client, as processes on loopback (the
 * two-stage cluster of tests/e2e_util.h: an 8-layer model over 60 MiB peers, one warm backup):
 *   - a fine-tune through a two-stage pipeline gives the adapter `fusion run finetune` gives in one
 *     process (same data order, same arithmetic);
 *   - SIGKILL of the last stage's peer mid-job: the broker moves the stage to the warm backup, every
 *     stage rewinds to the newest common checkpoint, and the final adapter is still the same;
 *   - the same with SIGTERM (Leave), and with a SIGKILLed broker restarted on the same store;
 *   - inference equals `fusion run infer`, also across a failover mid-generation;
 *   - enrolment with a token;
 *   - the peers leave on SIGTERM with exit 0.
 * The adapter is downloaded with `fusion result` once the job is done. */
#include "e2e_util.h"

#include <sodium.h>

#define N_PEERS 3

/* Starts the cluster: 3 peers, one of them a warm backup. */
static void cluster_start(e2e_cluster *c, const char *tag)
{
    e2e_two_stage_init(c, tag, N_PEERS, 1);
    e2e_cluster_start(c);
}

/* `fusion submit finetune` with opts on the cluster's model and text: the job id in id[17]. */
static void submit(e2e_cluster *c, char id[17], const char *opts)
{
    e2e_submit(c, id, "finetune --model '%s/model' --data '%s' %s", c->dir, c->data, opts);
}

/* The job's adapter equals `fusion run finetune`'s with run_opts (max abs difference <= 1e-5). */
static void check_result(e2e_cluster *c, const char *id, const char *run_opts)
{
    double d = e2e_job_vs_reference(c, id, "model", run_opts);
    assert_true(d <= 1e-5);
}

static void test_peer_broker_pipeline_equals_single_process(void **state)
{
    (void)state;
    e2e_cluster c;
    cluster_start(&c, "peer-broker");
    const char *common = "--rank 4 --steps 12 --batch 4 --seq-len 16 --lr 0.01";
    char opts[512], id[17];
    snprintf(opts, sizeof opts, "%s --micro-batches 1 --checkpoint-every 4", common);
    submit(&c, id, opts);
    e2e_wait_done(&c, id, 80);
    char blog[E2E_PATH], needle[128];
    e2e_broker_log(&c, blog);
    snprintf(needle, sizeof needle, "job %s stage 1/2", id);
    char *bl = e2e_slurp(blog);
    bool two = strstr(bl, needle) != NULL;
    if (!two)
        printf("the broker's plan:\n%s\n", bl);
    free(bl);
    assert_true(two); /* the job really ran as a two-stage pipeline */
    check_result(&c, id, common);
    e2e_cluster_stop(&c);
}

/* The last stage's peer goes away mid-job: SIGKILL (dead after the heartbeat timeout) or SIGTERM
 * (Leave: it drains and exits 0). Either way the job ends with the uninterrupted run's adapter. */
static void lose_stage(int sig)
{
    e2e_cluster c;
    cluster_start(&c, sig == SIGKILL ? "peer-failover" : "peer-leave");
    const char *common = "--rank 4 --steps 100 --batch 4 --seq-len 16 --lr 0.01";
    /* Submit without waiting, kill the last stage's peer after a checkpoint, then wait. */
    char opts[512], id[17];
    snprintf(opts, sizeof opts, "%s --checkpoint-every 20", common);
    submit(&c, id, opts);
    char blog[E2E_PATH], needle[160];
    e2e_broker_log(&c, blog);
    snprintf(needle, sizeof needle, "job %s: checkpoint of stage 1 at step 40 committed", id);
    if (!e2e_wait_file(blog, needle, 60000)) {
        e2e_show(blog, 30);
        fail_msg("no checkpoint at step 40");
    }
    int victim = e2e_planned_peer(&c, id, 1, 1000);
    printf("%s p%d (stage 1)\n", sig == SIGKILL ? "SIGKILL to" : "SIGTERM to", victim);
    kill(c.peers[victim], sig);
    int vcode = e2e_reap(c.peers[victim], 15000);
    c.peers[victim] = 0;
    if (sig == SIGTERM)
        assert_int_equal(vcode, 0); /* Leave, StageRelease, exit 0 */
    e2e_wait_done(&c, id, 80);
    snprintf(needle, sizeof needle, "job %s: stage 1 moved from", id);
    char *bl = e2e_slurp(blog);
    assert_non_null(strstr(bl, needle));
    free(bl);
    check_result(&c, id, common);
    e2e_cluster_stop(&c);
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
    e2e_cluster c;
    cluster_start(&c, "peer-brestart");
    const char *common = "--rank 4 --steps 100 --batch 4 --seq-len 16 --lr 0.01";
    char opts[512], id[17];
    snprintf(opts, sizeof opts, "%s --checkpoint-every 20", common);
    submit(&c, id, opts);
    char blog[E2E_PATH], needle[160];
    e2e_broker_log(&c, blog);
    snprintf(needle, sizeof needle, "job %s: checkpoint of stage 1 at step 40 committed", id);
    if (!e2e_wait_file(blog, needle, 60000)) {
        e2e_show(blog, 30);
        fail_msg("no checkpoint at step 40");
    }
    printf("SIGKILL to the broker, then a restart on %s\n", c.endpoint);
    kill(c.broker, SIGKILL);
    (void)e2e_reap(c.broker, 10000);
    c.broker = 0;
    e2e_broker_start(&c); /* the same endpoint and store; its log is broker-2.log */
    e2e_wait_done(&c, id, 80);
    int rejoined = 0;
    e2e_broker_log(&c, blog);
    char *bl = e2e_slurp(blog);
    for (const char *q = bl; (q = strstr(q, "registered: ")) != NULL; q++) /* "re-registered: " */
        rejoined++;
    for (const char *q = bl; (q = strstr(q, ") joined: ")) != NULL; q++)
        rejoined++;
    free(bl);
    printf("%d peers registered again with the restarted broker\n", rejoined);
    assert_true(rejoined >= 2);
    check_result(&c, id, common);
    e2e_cluster_stop(&c);
}

/* The generated bytes of an inference job (`fusion result`'s output.txt). */
static char *infer_result(e2e_cluster *c, const char *id, size_t *len)
{
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "result %s -o 'res-%s'", id, id);
    if (rc != 0)
        fail_msg("fusion result %s: exit %d: %s", id, rc, out ? out : "");
    free(out);
    char p[E2E_PATH];
    e2e_path(c, p, "res-%s/output.txt", id);
    char *r = e2e_slurp(p);
    *len = strlen(r);
    return r;
}

static char *run_infer(e2e_cluster *c, const char *opts, size_t *len)
{
    char *out = NULL;
    int rc = e2e_fusion(c, &out, "run infer --model model %s 2>/dev/null", opts);
    if (rc != 0)
        fail_msg("fusion run infer failed: %s", out);
    *len = strlen(out);
    if (*len && out[*len - 1] == '\n')
        out[--(*len)] = '\0';
    return out;
}

/* Submits an inference job: its id in id[17]. */
static void submit_infer(e2e_cluster *c, char id[17], const char *opts)
{
    e2e_submit(c, id, "infer --model '%s/model' %s", c->dir, opts);
}

/* Generation through the pipeline gives the tokens `fusion run infer` gives (greedy and seeded
 * sampling); killing the last stage mid-generation: the backup rebuilds its KV cache by replaying
 * the prompt and the tokens so far, and the text is unchanged (greedy). */
static void test_peer_broker_inference_equals_single_process(void **state)
{
    (void)state;
    e2e_cluster c;
    cluster_start(&c, "peer-infer");
    const char *runs[] = {"--prompt 'the quick brown fox' --max-tokens 24",
                          "--prompt 'over the lazy dog' --max-tokens 24 --temperature 0.9 --top-k 40 --seed 5"};
    for (size_t k = 0; k < 2; k++) {
        char id[17];
        submit_infer(&c, id, runs[k]);
        e2e_wait_done(&c, id, 60);
        size_t n1, n2;
        char *got = infer_result(&c, id, &n1), *want = run_infer(&c, runs[k], &n2);
        printf("infer %s: pipeline %zu bytes, fusion run %zu bytes, %s\n", id, n1, n2,
               n1 == n2 && memcmp(got, want, n1) == 0 ? "identical" : "DIFFERENT");
        assert_int_equal(n1, n2);
        assert_memory_equal(got, want, n1);
        free(got);
        free(want);
    }

    /* Failover mid-generation (greedy): kill the last stage's peer once 100 tokens are out. */
    const char *lng = "--prompt 'the river and the stone' --max-tokens 600";
    char id[17];
    submit_infer(&c, id, lng);
    uint64_t end = fu_clock_ms() + 60000;
    long done = 0;
    while (done < 100 && fu_clock_ms() < end) {
        char *out = NULL;
        (void)e2e_fusion(&c, &out, "status %s", id);
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
    int victim = e2e_planned_peer(&c, id, 1, 1000);
    printf("killing p%d (stage 1 of the generation) at token %ld\n", victim, done);
    e2e_peer_kill9(&c, victim);
    e2e_wait_done(&c, id, 80);
    char blog[E2E_PATH], needle[160];
    e2e_broker_log(&c, blog);
    snprintf(needle, sizeof needle, "job %s: stage 1 moved from", id);
    char *bl = e2e_slurp(blog);
    bool moved = strstr(bl, needle) != NULL;
    free(bl);
    if (!moved)
        e2e_show(blog, 30);
    assert_true(moved);
    size_t n1, n2;
    char *got = infer_result(&c, id, &n1), *want = run_infer(&c, lng, &n2);
    printf("infer %s after failover: pipeline %zu bytes, fusion run %zu bytes, %s\n", id, n1, n2,
           n1 == n2 && memcmp(got, want, n1) == 0 ? "identical" : "DIFFERENT");
    assert_int_equal(n1, n2);
    assert_memory_equal(got, want, n1);
    free(got);
    free(want);
    e2e_cluster_stop(&c);
}

/* --enrol-token: a key not on the allow-list enrols with the broker's token, reconnects as a member
 * and joins; a wrong token is refused and the peer exits 3 with a sentence. */
static void test_peer_broker_enrolment(void **state)
{
    (void)state;
    char *dir = tu_tmpdir("peer-enrol");
    assert_non_null(dir);
    char *out = NULL;
    int rc = tu_sh(&out, "cd '%s' && for k in broker p0 p1 tok; do '%s' keygen -o $k >/dev/null || exit 1; done && "
                   ": > allow", dir, tu_bin("fusion"));
    assert_int_equal(rc, 0);
    free(out);
    char tokfile[4096], token[64] = "";
    snprintf(tokfile, sizeof tokfile, "%s/tok/public.key", dir);
    char *tk = e2e_slurp(tokfile); /* any 40-char Z85 string is a token; a public key file has one */
    for (char *line = strtok(tk, "\n"); line; line = strtok(NULL, "\n"))
        if (line[0] != '#' && strlen(line) == 40)
            snprintf(token, sizeof token, "%s", line);
    free(tk);
    assert_int_equal(strlen(token), 40);
    char blog[4096], keys[4096], db[4096], allow[4096], bkey[4096];
    snprintf(blog, sizeof blog, "%s/broker.log", dir);
    snprintf(keys, sizeof keys, "%s/broker", dir);
    snprintf(db, sizeof db, "%s/store.db", dir);
    snprintf(allow, sizeof allow, "%s/allow", dir);
    snprintf(bkey, sizeof bkey, "%s/broker/public.key", dir);
    char *bargv[] = {strdup(tu_bin("fusion-broker")), "--bind", "tcp://127.0.0.1:*", "--keys", keys, "--db", db,
                     "--allow", allow, "--enrol-token", token, "--heartbeat-ms", "300", NULL};
    pid_t broker = e2e_spawn(blog, bargv);
    free(bargv[0]);
    assert_true(e2e_wait_file(blog, "listening on ", 10000));
    char ep[128] = "";
    char *bl = e2e_slurp(blog);
    sscanf(strstr(bl, "listening on ") + 13, "%127s", ep);
    free(bl);
    pid_t peers[2];
    for (int i = 0; i < 2; i++) {
        char plog[4096], pkeys[4096], cache[4096], name[16];
        snprintf(plog, sizeof plog, "%s/p%d.log", dir, i);
        snprintf(pkeys, sizeof pkeys, "%s/p%d", dir, i);
        snprintf(cache, sizeof cache, "%s/cache%d", dir, i);
        snprintf(name, sizeof name, "e%d", i);
        char *pargv[] = {strdup(tu_bin("fusion-peer")), "--broker", ep, "--broker-key", bkey, "--keys", pkeys,
                         "--data-bind", "tcp://127.0.0.1:*", "--cache", cache, "--threads", "1", "--name", name, "--priority", "normal",
                         "--enrol-token", i == 0 ? token : "0000000000000000000000000000000000000000", NULL};
        peers[i] = e2e_spawn(plog, pargv);
        free(pargv[0]);
    }
    bool joined = e2e_wait_file(blog, "(e0) joined", 20000);
    int bad = e2e_reap(peers[1], 20000);
    char plog1[4096];
    snprintf(plog1, sizeof plog1, "%s/p1.log", dir);
    char *l1 = e2e_slurp(plog1);
    printf("wrong token: exit %d: %s", bad, l1);
    bool said = strstr(l1, "enrolment") != NULL;
    free(l1);
    if (!joined)
        e2e_show(blog, 30);
    assert_true(joined);
    assert_int_equal(bad, 3);
    assert_true(said);
    kill(peers[0], SIGTERM);
    assert_int_equal(e2e_reap(peers[0], 15000), 0);
    kill(broker, SIGTERM);
    (void)e2e_reap(broker, 10000);
    rc = tu_sh(&out, "rm -rf '%s'", dir);
    free(out);
    free(dir);
}

int main(int argc, char **argv)
{
    if (sodium_init() < 0)
        return 1;
    if (argc > 1)
        cmocka_set_test_filter(argv[1]); /* one ctest entry per test (tests/peer.cmake) */
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_peer_broker_pipeline_equals_single_process, e2e_teardown),
        cmocka_unit_test_teardown(test_peer_broker_failover_keeps_the_adapter, e2e_teardown),
        cmocka_unit_test_teardown(test_peer_broker_leave_keeps_the_adapter, e2e_teardown),
        cmocka_unit_test_teardown(test_peer_broker_restart_keeps_the_adapter, e2e_teardown),
        cmocka_unit_test_teardown(test_peer_broker_inference_equals_single_process, e2e_teardown),
        cmocka_unit_test(test_peer_broker_enrolment),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
