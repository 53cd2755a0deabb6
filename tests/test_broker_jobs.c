/* The client API of the real fusion-broker process: a queued job waits and says why, then is
 * assigned when a peer joins; idempotent resubmission; a second client can neither see nor cancel
 * the first one's job; a bad spec is refused naming the key; kill -9 and restart lose no
 * acknowledged job and a running job is recovered onto its reconnected peer (time measured); a
 * damaged or emptied store is refused at start. */
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
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cluster.h"
#include "fake_peer.h"
#include "fu_clock.h"
#include "testutil.h"

#define GiB (1ull << 30)

/* Job id is queued, and its status says `says` (printed with `when`). */
static void assert_queued(tu_broker_fx *f, uint64_t id, const char *when, const char *says)
{
    wire_msg_t *m = tu_client_job_status(&f->cl, id);
    const Fusion__JobStatus *st = tu_status_of(m);
    print_message("%s the job says: %s\n", when, st->message);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
    assert_non_null(strstr(st->message, says));
    wire_msg_destroy(&m);
}

static void test_broker_jobs_queued_then_assigned(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_args(f->c, "--http 127.0.0.1:0");
    tu_broker_fx_start(f);
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, "q1");
    const Fusion__JobStatus *st = tu_status_of(m);
    uint64_t id = st->job_id;
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
    wire_msg_destroy(&m);
    /* no peer: it waits and says why */
    fu_sleep_ms(400);
    assert_queued(f, id, "with no peer", "waiting for peers");
    /* a peer too small for the model: still queued, and the reason is the memory */
    tu_fake_peer small;
    tu_fake_peer_start(&small, f->c, "p2", "small", 1u << 20, 50, "ready");
    assert_true(tu_fake_peer_expect(&small, "WELCOME", 5000, NULL, 0));
    fu_sleep_ms(300);
    assert_queued(f, id, "with a 1 MiB peer", "waiting for peers: the model does not fit in the peers' memory");
    char *t = tu_metrics_scrape(f->c);
    double failed = tu_metric(t, "fusion_plans_failed_total");
    assert_true(failed >= 1);
    assert_true(tu_metric(t, "fusion_plans_skipped_total") == 0);
    free(t);
    /* a second job makes a planning round over the same candidates: the first job's search, which
     * found nothing over them, is not made again (its reason stands); the second job's is */
    m = tu_client_submit(&f->cl, f->spec, "q2");
    uint64_t id2 = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    fu_sleep_ms(300);
    t = tu_metrics_scrape(f->c);
    assert_true(tu_metric(t, "fusion_plans_skipped_total") >= 1);
    assert_true(tu_metric(t, "fusion_plans_failed_total") >= failed + 1);
    free(t);
    assert_queued(f, id, "after the second job", "waiting for peers: the model does not fit in the peers' memory");
    assert_queued(f, id2, "the second job", "waiting for peers: the model does not fit in the peers' memory");
    Fusion__JobRef r2 = FUSION__JOB_REF__INIT;
    r2.job_id = id2;
    m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_CANCEL, id2, &r2.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 3000);
    assert_int_equal(tu_status_of(m)->state, FUSION__JOB_STATE__JOB_STATE_CANCELED);
    wire_msg_destroy(&m);
    tu_fake_peer_stop(&small, SIGKILL);
    /* a peer joins: it gets the stage */
    char line[512];
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p1", "p1", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p, "ASSIGN", 5000, line, sizeof line));
    print_message("peer got: %s\n", line);
    char want[64];
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0 resume 0", id);
    assert_memory_equal(line, want, strlen(want));
    assert_true(tu_fake_peer_expect(&p, "START", 5000, line, sizeof line));
    m = tu_client_job_status(&f->cl, id);
    st = tu_status_of(m);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_RUNNING);
    assert_int_equal(st->stages, 1);
    wire_msg_destroy(&m);
    tu_fake_peer_stop(&p, SIGKILL);
}

static void test_broker_jobs_idempotent_and_private(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    wire_msg_t *m1 = tu_client_submit(&f->cl, f->spec, "same-key");
    wire_msg_t *m2 = tu_client_submit(&f->cl, f->spec, "same-key");
    uint64_t id = tu_status_of(m1)->job_id;
    assert_int_equal(tu_status_of(m2)->job_id, id);
    assert_string_equal(tu_status_of(m2)->idempotency_key, "same-key");
    wire_msg_destroy(&m1);
    wire_msg_destroy(&m2);
    /* the same key for a different request is refused */
    char other[9000];
    snprintf(other, sizeof other, "{\"model\": \"%s\", \"steps\": 3, \"batch\": 2, \"seq_len\": 8}", f->model);
    m1 = tu_client_submit(&f->cl, other, "same-key");
    assert_int_equal(wire_msg_type(m1), FUSION__MSG_TYPE__MSG_ERROR);
    wire_msg_destroy(&m1);
    /* another client sees nothing of this one's and cannot cancel it */
    tu_client bob;
    tu_client_open(&bob, f->c, "other");
    m1 = tu_client_job_status(&bob, id);
    assert_non_null(m1);
    assert_int_equal(wire_msg_type(m1), FUSION__MSG_TYPE__MSG_ERROR);
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m1))->code, FUSION__ERROR_CODE__ERR_NOT_FOUND);
    wire_msg_destroy(&m1);
    Fusion__JobRef r = FUSION__JOB_REF__INIT;
    r.job_id = id;
    m1 = tu_client_call(&bob, FUSION__MSG_TYPE__MSG_JOB_CANCEL, id, &r.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 3000);
    assert_int_equal(wire_msg_type(m1), FUSION__MSG_TYPE__MSG_ERROR);
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m1))->code, FUSION__ERROR_CODE__ERR_NOT_FOUND);
    wire_msg_destroy(&m1);
    Fusion__JobListRequest lr = FUSION__JOB_LIST_REQUEST__INIT;
    lr.include_done = true;
    m1 = tu_client_call(&bob, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ, 0, &lr.base, FUSION__MSG_TYPE__MSG_JOB_LIST, 3000);
    assert_int_equal(((const Fusion__JobList *)wire_msg_body(m1))->n_jobs, 0);
    wire_msg_destroy(&m1);
    m1 = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ, 0, &lr.base, FUSION__MSG_TYPE__MSG_JOB_LIST, 3000);
    assert_int_equal(((const Fusion__JobList *)wire_msg_body(m1))->n_jobs, 1);
    wire_msg_destroy(&m1);
    /* its owner cancels it */
    m1 = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_CANCEL, id, &r.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 3000);
    assert_int_equal(tu_status_of(m1)->state, FUSION__JOB_STATE__JOB_STATE_CANCELED);
    wire_msg_destroy(&m1);
    tu_client_close(&bob);
}

static void test_broker_jobs_bad_spec_says_why(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    char spec[9000];
    snprintf(spec, sizeof spec, "{\"model\": \"%s\", \"stepz\": 3}", f->model);
    wire_msg_t *m = tu_client_submit(&f->cl, spec, NULL);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
    print_message("refused: %s\n", e->message);
    assert_int_equal(e->code, FUSION__ERROR_CODE__ERR_INVALID);
    assert_non_null(strstr(e->message, "stepz"));
    wire_msg_destroy(&m);
    m = tu_client_submit(&f->cl, "{\"model\": \"/nonexistent/model\"}", NULL);
    e = (const Fusion__Error *)wire_msg_body(m);
    print_message("refused: %s\n", e->message);
    assert_non_null(strstr(e->message, "/nonexistent/model"));
    wire_msg_destroy(&m);
    /* verification: a fraction of micro-batches, 0..1 */
    snprintf(spec, sizeof spec, "{\"model\": \"%s\", \"verify\": 1.5}", f->model);
    m = tu_client_submit(&f->cl, spec, NULL);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    e = (const Fusion__Error *)wire_msg_body(m);
    print_message("refused: %s\n", e->message);
    assert_non_null(strstr(e->message, "\"verify\" must be a number between 0 and 1"));
    wire_msg_destroy(&m);
    /* a result of a job that is not done is refused with a reason */
    m = tu_client_submit(&f->cl, f->spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    Fusion__JobResultRequest rr = FUSION__JOB_RESULT_REQUEST__INIT;
    rr.job_id = id;
    m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base,
                       FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    assert_non_null(strstr(((const Fusion__Error *)wire_msg_body(m))->message, "queued"));
    wire_msg_destroy(&m);
}

static void test_broker_jobs_kill9_restart_loses_nothing(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    /* one job running on a peer, three more queued behind it (the only peer is busy) */
    char line[512];
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p1", "p1", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    uint64_t ids[4];
    for (int i = 0; i < 4; i++) {
        char key[16];
        snprintf(key, sizeof key, "k%d", i);
        wire_msg_t *m = tu_client_submit(&f->cl, f->spec, key);
        ids[i] = tu_status_of(m)->job_id;
        wire_msg_destroy(&m);
    }
    assert_true(tu_fake_peer_expect(&p, "START", 5000, line, sizeof line));
    uint64_t running = strtoull(line + 6, NULL, 16);
    /* kill -9 right after the acknowledgements */
    assert_int_equal(tu_broker_stop(f->c, SIGKILL), 128 + SIGKILL);
    tu_client_close(&f->cl);
    uint64_t t0 = fu_clock_ms();
    tu_broker_fx_start(f);
    uint64_t up = fu_clock_ms() - t0;
    Fusion__JobListRequest lr = FUSION__JOB_LIST_REQUEST__INIT;
    lr.include_done = true;
    wire_msg_t *m =
        tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ, 0, &lr.base, FUSION__MSG_TYPE__MSG_JOB_LIST, 3000);
    const Fusion__JobList *jl = (const Fusion__JobList *)wire_msg_body(m);
    assert_int_equal(jl->n_jobs, 4);
    for (int i = 0; i < 4; i++) {
        bool found = false;
        for (size_t k = 0; k < jl->n_jobs; k++)
            found |= jl->jobs[k]->job_id == ids[i];
        assert_true(found);
    }
    wire_msg_destroy(&m);
    /* idempotency survives the restart */
    m = tu_client_submit(&f->cl, f->spec, "k2");
    assert_int_equal(tu_status_of(m)->job_id, ids[2]);
    wire_msg_destroy(&m);
    /* the peer notices the silence, registers again, and the running job is recovered on it */
    assert_true(tu_fake_peer_expect(&p, "REHELLO", 8000, NULL, 0));
    char want[64];
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0", running);
    bool got = false;
    while (!got && tu_fake_peer_expect(&p, "ASSIGN", 15000, line, sizeof line))
        got = strncmp(line, want, strlen(want)) == 0;
    uint64_t rec = fu_clock_ms() - t0;
    print_message("broker restart: up again in %llu ms; running job %016" PRIx64 " re-assigned to its peer %llu ms "
                  "after the restart\n", (unsigned long long)up, running, (unsigned long long)rec);
    if (!got)
        tu_file_show(tu_broker_log(f->c), 40);
    assert_true(got);
    assert_true(tu_fake_peer_expect(&p, "START", 5000, NULL, 0));
    m = tu_client_job_status(&f->cl, running);
    assert_int_equal(tu_status_of(m)->state, FUSION__JOB_STATE__JOB_STATE_RUNNING);
    wire_msg_destroy(&m);
    tu_fake_peer_stop(&p, SIGKILL);
}

static void test_broker_jobs_kill9_mid_burst_keeps_every_ack(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    /* 40 submissions in flight; SIGKILL as soon as the 8th acknowledgement arrives */
    static const char text[] = "the quick brown fox jumps over the lazy dog, again and again and again and again.";
    enum { N = 40 };
    for (int i = 0; i < N; i++) {
        char key[16];
        snprintf(key, sizeof key, "burst-%d", i);
        Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
        js.idempotency_key = key;
        js.kind = FUSION__JOB_KIND__JOB_KIND_FINETUNE;
        js.spec_json = f->spec;
        js.data.data = (uint8_t *)text;
        js.data.len = sizeof text - 1;
        assert_int_equal(tu_client_send(&f->cl, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base), FU_OK);
    }
    uint64_t acked[N];
    size_t n_acked = 0;
    while (n_acked < 8) {
        wire_msg_t *m = tu_client_recv(&f->cl, 5000);
        assert_non_null(m);
        const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st)
            acked[n_acked++] = st->job_id;
        wire_msg_destroy(&m);
    }
    assert_int_equal(tu_broker_stop(f->c, SIGKILL), 128 + SIGKILL);
    /* acknowledgements that were already on their way count too */
    for (wire_msg_t *m; n_acked < N && (m = tu_client_recv(&f->cl, 200));) {
        const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st)
            acked[n_acked++] = st->job_id;
        wire_msg_destroy(&m);
    }
    tu_broker_fx_start(f);
    Fusion__JobListRequest lr = FUSION__JOB_LIST_REQUEST__INIT;
    lr.include_done = true;
    wire_msg_t *m =
        tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_LIST_REQ, 0, &lr.base, FUSION__MSG_TYPE__MSG_JOB_LIST, 3000);
    const Fusion__JobList *jl = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_LIST);
    assert_non_null(jl);
    print_message("kill -9 mid-burst: %zu of %d submissions acknowledged, %zu jobs in the store after the restart\n",
                  n_acked, N, jl->n_jobs);
    assert_true(jl->n_jobs >= n_acked);
    for (size_t i = 0; i < n_acked; i++) {
        bool found = false;
        for (size_t k = 0; k < jl->n_jobs; k++)
            found |= jl->jobs[k]->job_id == acked[i];
        assert_true(found);
    }
    wire_msg_destroy(&m);
}

/* The store is checked at every start: an existing empty file, or a store with a damaged page, makes
 * fusion-broker exit 1 naming the file and what to do, and leaves the file alone; --init makes an
 * empty file a store. */
static void test_broker_jobs_damaged_store_refused(void **state)
{
    tu_broker_fx *f = *state;
    char keys[TU_PATH], db[TU_PATH], run[3 * TU_PATH + 128];
    tu_path(f->c, keys, "broker");
    tu_path(f->c, db, "store.db");
    snprintf(run, sizeof run, "%s --bind 'tcp://127.0.0.1:*' --keys '%s' --db '%s'", tu_bin("fusion-broker"), keys,
             db);
    int fd = open(db, O_CREAT | O_WRONLY, 0600);
    assert_true(fd >= 0);
    close(fd);
    tu_sh_expect(1, "start once with --init", "%s 2>&1", run);
    struct stat sb;
    assert_int_equal(stat(db, &sb), 0);
    assert_int_equal(sb.st_size, 0);
    /* --init: it starts (and is stopped by SIGTERM after 3 s, closing the store cleanly) */
    tu_sh_expect(124, "listening on", "timeout 3 %s --init 2>&1", run);
    assert_int_equal(stat(db, &sb), 0);
    long page = 4096, pages = (long)sb.st_size / page;
    assert_true(pages >= 4);
    /* garbage over a page of the schema's tables (page 1, the header, still reads) */
    FILE *fp = fopen(db, "r+b");
    assert_non_null(fp);
    assert_int_equal(fseek(fp, 2 * page, SEEK_SET), 0);
    for (long i = 0; i < page; i++)
        fputc(0xA5, fp);
    fclose(fp);
    char *out = tu_sh_expect_out(1, "is damaged (quick_check", "%s 2>&1", run);
    assert_non_null(strstr(out, db));
    assert_non_null(strstr(out, ".recover"));
    free(out);
    tu_sh_expect(1, "is damaged (integrity_check", "%s --check-store 2>&1", run);
    struct stat after;
    assert_int_equal(stat(db, &after), 0);
    assert_int_equal(after.st_size, sb.st_size);
}

/* The loop answers while a plan is searched (docs/SCALE.md "Planning off the loop"): with the test
 * hook that makes every search on the planner thread take 3 s, a registered peer's heartbeats and a
 * client's status requests are answered at once meanwhile (a search in the loop would hold them for
 * the 3 s), and the job is then planned onto the peer as without the hook. */
static void test_broker_jobs_heartbeats_while_planning(void **state)
{
#ifndef FUSION_TEST_HOOKS
    (void)state;
    skip();
#else
    tu_broker_fx *f = *state;
    setenv("FUSION_TEST_PLAN_DELAY_MS", "3000", 1); /* the broker inherits it; nothing else started here */
    tu_broker_fx_start(f);
    unsetenv("FUSION_TEST_PLAN_DELAY_MS");
    char key[41];
    tu_key_public(f->c, "p0", key);
    tu_client pc;
    tu_client_open(&pc, f->c, "p0");
    tu_client_hello(&pc, "planned", 4 * GiB, 50);
    assert_int_equal(tu_client_wait_peer_state(&f->cl, key, FUSION__PEER_STATE__PEER_STATE_IDLE, 5000),
                     FUSION__PEER_STATE__PEER_STATE_IDLE);
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, "slow-plan");
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    uint64_t t0 = fu_clock_ms(), worst = 0;
    int answered = 0;
    fu_sleep_ms(200); /* the search is on the planner thread now, asleep */
    while (fu_clock_ms() - t0 < 2000) {
        Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
        hb.state = FUSION__PEER_STATE__PEER_STATE_IDLE;
        uint64_t s = fu_clock_ms();
        m = tu_client_call(&pc, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base, FUSION__MSG_TYPE__MSG_HEARTBEAT, 2500);
        assert_non_null(m);
        assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_HEARTBEAT);
        wire_msg_destroy(&m);
        uint64_t lat = fu_clock_ms() - s;
        worst = lat > worst ? lat : worst;
        answered++;
        fu_sleep_ms(100);
    }
    assert_queued(f, id, "while its plan is searched", "");
    print_message("while the search ran: %d heartbeats answered, the slowest in %" PRIu64 " ms\n", answered, worst);
    assert_true(answered >= 8);
    assert_true(worst < 1000); /* the search sleeps 3 s: in the loop, the answers would wait for it */
    /* the search comes back and the job is planned onto the peer */
    bool assigned = false;
    for (uint64_t t1 = fu_clock_ms(); !assigned && fu_clock_ms() - t1 < 10000;) {
        m = tu_client_recv(&pc, 500);
        assigned = m && wire_msg_type(m) == FUSION__MSG_TYPE__MSG_STAGE_ASSIGN;
        wire_msg_destroy(&m);
    }
    assert_true(assigned);
    assert_true(tu_broker_logged(f->c, "job %016" PRIx64 " planned over 1 candidates", id));
    tu_client_close(&pc);
#endif
}

int main(int argc, char **argv)
{
    if (tu_fake_peer_requested(argc, argv))
        return tu_fake_peer_main(argc, argv);
    const struct CMUnitTest tests[] = {
        tu_broker_test(test_broker_jobs_queued_then_assigned),
        tu_broker_test(test_broker_jobs_idempotent_and_private),
        tu_broker_test(test_broker_jobs_bad_spec_says_why),
        tu_broker_test(test_broker_jobs_kill9_restart_loses_nothing),
        tu_broker_test(test_broker_jobs_kill9_mid_burst_keeps_every_ack),
        tu_broker_test(test_broker_jobs_damaged_store_refused),
        tu_broker_test(test_broker_jobs_heartbeats_while_planning),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
