/* The broker's HTTP listener (fusion-broker --http, broker/broker_http.c): its read-only JSON API
 * (each client sees its own jobs, by the bearer token `fusion http-token` prints), and its metrics: an
 * operator's scraper reads
 * GET /metrics with curl, and the counters say what the test did to the real broker:
 *   - a job submitted while no peer can take it: one queued job in the store, a commit counted;
 *   - three malformed messages: three drops for that cause, three Errors sent back;
 *   - two peers registered, then one leaving: two idle, then one idle and one gone;
 *   - a path it does not serve: 404; another method: 405; no job id or key in
 *     the text.
 * The loss curve of a fine-tune (GET /api/jobs/JOB/loss) is checked against a fake peer's 1,100
 * steps: every loss in step order, downsampled to stride 2 past 1,024 points, still served once the
 * job is done; another client's job and an unknown one are 404.
 * Off by default: without --http nothing listens. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <zmq.h>

#include "cluster.h"
#include "fake_peer.h"
#include "fu_clock.h"
#include "testutil.h"

/* Scrapes until sample `name` is want (10 s); returns the last text (caller frees). */
static char *scrape_until(const tu_cluster *c, const char *name, double want)
{
    char *t = NULL;
    for (uint64_t end = fu_clock_ms() + 10000; fu_clock_ms() < end; fu_sleep_ms(100)) {
        free(t);
        t = tu_metrics_scrape(c);
        if (tu_metric(t, name) == want)
            return t;
    }
    fail_msg("%s never became %g:\n%s", name, want, t);
    return t;
}

static void test_broker_metrics_count_what_happened(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_args(f->c, "--http 127.0.0.1:0");
    tu_broker_fx_start(f);
    int port = tu_metrics_port(f->c);
    char *t = tu_metrics_scrape(f->c);
    assert_true(tu_metric(t, "fusion_peers{state=\"idle\"}") == 0);
    assert_true(tu_metric(t, "fusion_jobs{state=\"queued\"}") == 0);
    assert_true(tu_metric(t, "fusion_messages_dropped_total{cause=\"malformed\"}") == 0);
    double commits0 = tu_metric(t, "fusion_store_commits_total");
    free(t);

    /* a job nobody can take yet */
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, "metrics-job");
    assert_non_null(m);
    char id[17];
    snprintf(id, sizeof id, "%016llx", (unsigned long long)tu_status_of(m)->job_id);
    wire_msg_destroy(&m);
    t = scrape_until(f->c, "fusion_jobs{state=\"queued\"}", 1);
    assert_true(tu_metric(t, "fusion_store_commits_total") > commits0);
    assert_null(strstr(t, id)); /* aggregates only */
    free(t);

    /* three malformed bodies: each dropped and answered */
    uint8_t env_junk[] = {0x08, 0x01, 0x10, 13};          /* Envelope{version 1, type JOB_SUBMIT} */
    uint8_t body_junk[] = {0x0a, 0xff, 0xff, 0xff, 0x7f}; /* a string longer than the frame */
    for (int i = 0; i < 3; i++) {
        zmq_send(f->cl.sock, env_junk, sizeof env_junk, ZMQ_SNDMORE);
        zmq_send(f->cl.sock, body_junk, sizeof body_junk, 0);
        m = tu_client_recv(&f->cl, 3000);
        assert_non_null(m);
        assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
        wire_msg_destroy(&m);
    }
    t = tu_metrics_scrape(f->c);
    assert_true(tu_metric(t, "fusion_messages_dropped_total{cause=\"malformed\"}") == 3);
    assert_true(tu_metric(t, "fusion_errors_replied_total") >= 3);
    free(t);

    /* two peers too small for the job, then one leaves */
    tu_client p[2] = {{0}};
    for (int i = 0; i < 2; i++) {
        char name[8];
        snprintf(name, sizeof name, "p%d", i);
        tu_client_open(&p[i], f->c, name);
        tu_client_hello(&p[i], name, 1u << 20, 10.0);
    }
    free(scrape_until(f->c, "fusion_peers{state=\"idle\"}", 2));
    Fusion__Leave lv = FUSION__LEAVE__INIT;
    lv.reason = (char *)"the test";
    assert_int_equal(tu_client_send(&p[1], FUSION__MSG_TYPE__MSG_LEAVE, 0, &lv.base), FU_OK);
    t = scrape_until(f->c, "fusion_peers{state=\"gone\"}", 1);
    assert_true(tu_metric(t, "fusion_peers{state=\"idle\"}") == 1);
    assert_true(tu_metric(t, "fusion_jobs{state=\"queued\"}") == 1);
    assert_true(tu_metric(t, "fusion_messages_received_total") > 3);
    printf("%s", t);
    free(t);
    for (int i = 0; i < 2; i++)
        tu_client_close(&p[i]);

    /* nothing else is served */
    tu_sh_expect(0, "404", "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/other", port);
    tu_sh_expect(0, "405", "curl -s -o /dev/null -w '%%{http_code}' -X POST http://127.0.0.1:%d/metrics", port);
}

/* The bearer token of key `name` (tu_keygen's directory) for c's broker, as `fusion http-token` prints it. */
static void http_token(const tu_cluster *c, const char *name, char *out, size_t cap)
{
    const char *dir = tu_cluster_dir(c);
    char *t = tu_sh_expect_out(0, NULL, "FUSION_CONFIG= %s http-token --broker-key %s/broker/public.key --keys %s/%s",
                               tu_bin("fusion"), dir, dir, name);
    t[strcspn(t, "\n")] = '\0';
    assert_int_equal(strlen(t), 128);
    snprintf(out, cap, "%s", t);
    free(t);
}

/* The read-only JSON API (broker_api.h): a job is shown to its owner only, with its stages and
 * events, whoever asks without a token sees the peers but no job, and a token made with another
 * key, or bytes that only look like one, is refused. */
static void test_broker_metrics_api_shows_each_client_its_own(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_args(f->c, "--http 127.0.0.1:0");
    tu_keygen(f->c, "op", true);
    tu_allow_roles(f->c, "op", "operator");
    tu_broker_fx_start(f);
    int port = tu_metrics_port(f->c);
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, "api-job");
    assert_non_null(m);
    char id[17];
    snprintf(id, sizeof id, "%016llx", (unsigned long long)tu_status_of(m)->job_id);
    wire_msg_destroy(&m);
    tu_client p0 = {0};
    tu_client_open(&p0, f->c, "p0");
    tu_client_hello(&p0, "p0", 1u << 20, 10.0);
    char mine[160], other[160];
    http_token(f->c, "client", mine, sizeof mine);
    http_token(f->c, "other", other, sizeof other);
    /* the owner: its job, and the job's events */
    char *o = tu_sh_expect_out(0, id, "curl -sf -H 'Authorization: Bearer %s' http://127.0.0.1:%d/api/jobs", mine,
                               port);
    assert_true(o[0] == '[');
    assert_non_null(strstr(o, "\"state\":\"queued\""));
    free(o);
    o = tu_sh_expect_out(0, "\"kind\":\"submitted\"",
                         "curl -sf -H 'Authorization: Bearer %s' http://127.0.0.1:%d/api/jobs/%s/events", mine, port, id);
    free(o);
    /* another client: an empty list, and not the owner's events */
    o = tu_sh_expect_out(0, "[]", "curl -sf -H 'Authorization: Bearer %s' http://127.0.0.1:%d/api/jobs", other, port);
    assert_null(strstr(o, id));
    free(o);
    tu_sh_expect(0, "404", "curl -s -o /dev/null -w '%%{http_code}' -H 'Authorization: Bearer %s' "
                 "http://127.0.0.1:%d/api/jobs/%s/events", other, port, id);
    /* the loss curve: none yet for a queued job; another client's is not found, like a job that does
     * not exist */
    o = tu_sh_expect_out(0, "\"points\":[]", "curl -sf -H 'Authorization: Bearer %s' "
                         "http://127.0.0.1:%d/api/jobs/%s/loss", mine, port, id);
    assert_non_null(strstr(o, "\"kind\":\"finetune\""));
    free(o);
    tu_sh_expect(0, "404", "curl -s -o /dev/null -w '%%{http_code}' -H 'Authorization: Bearer %s' "
                 "http://127.0.0.1:%d/api/jobs/%s/loss", other, port, id);
    tu_sh_expect(0, "401", "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/api/jobs/%s/loss", port, id);
    /* nobody: the peers, no jobs */
    o = tu_sh_expect_out(0, "\"name\":\"p0\"", "curl -sf http://127.0.0.1:%d/api/peers", port);
    assert_non_null(strstr(o, "\"gflops\":"));
    free(o);
    tu_sh_expect(0, "401", "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/api/jobs", port);
    /* a forged token: the owner's public key with a MAC of someone else's making */
    char forged[160];
    snprintf(forged, sizeof forged, "%.64s%s", mine, other + 64);
    tu_sh_expect(0, "401", "curl -s -o /dev/null -w '%%{http_code}' -H 'Authorization: Bearer %s' "
                 "http://127.0.0.1:%d/api/jobs", forged, port);
    tu_sh_expect(0, "401", "curl -s -o /dev/null -w '%%{http_code}' -H 'Authorization: Bearer zz' "
                 "http://127.0.0.1:%d/api/peers", port);
    /* the event archive: operators only; its audit holds */
    tu_sh_expect(0, "401", "curl -s -o /dev/null -w '%%{http_code}' -H 'Authorization: Bearer %s' "
                 "http://127.0.0.1:%d/api/archive", mine, port);
    char op[160];
    http_token(f->c, "op", op, sizeof op);
    o = tu_sh_expect_out(0, "\"audit_ok\":true",
                         "curl -sf -H 'Authorization: Bearer %s' http://127.0.0.1:%d/api/archive", op, port);
    assert_non_null(strstr(o, "\"days\":[]"));
    free(o);
    /* the store's figures */
    char *t = tu_metrics_scrape(f->c);
    assert_true(tu_metric(t, "fusion_store_rows{table=\"events\"}") >= 1);
    assert_true(tu_metric(t, "fusion_store_bytes{part=\"file\"}") > 0);
    assert_true(tu_metric(t, "fusion_store_compact_turns_total") >= 1);
    free(t);
    tu_client_close(&p0);
}

/* GET /api/jobs/JOB/loss of a fine-tune a fake peer runs (broker_losshist.h): the fake peer reports
 * loss 5 - s for its step s (counted from 0), so the API's step n (counted from 1) has loss 6 - n.
 * 1,100 steps overflow the 1,024 points: steps 1, 3, ..., 1099 stay (stride 2), and the newest,
 * 1100. */
static void test_broker_metrics_api_loss_curve(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 0;
    tu_broker_args(f->c, "--http 127.0.0.1:0");
    tu_broker_fx_start(f);
    int port = tu_metrics_port(f->c);
    tu_fake_peer p = {0};
    tu_fake_peer_start(&p, f->c, "p0", "p0", 4ull << 30, 50, "train");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    const unsigned steps = 1100;
    char spec[8192];
    snprintf(spec, sizeof spec,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, "
             "\"steps\": %u, \"batch\": 2, \"seq_len\": 8, \"micro_batches\": 2, \"checkpoint_every\": %u}",
             f->model, steps, steps);
    wire_msg_t *m = tu_client_submit(&f->cl, spec, "loss-job");
    assert_non_null(m);
    uint64_t id64 = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    char id[17];
    snprintf(id, sizeof id, "%016llx", (unsigned long long)id64);
    uint64_t t0 = fu_clock_ms();
    bool done = false;
    for (uint64_t end = t0 + 120000; !done && fu_clock_ms() < end; fu_sleep_ms(100)) {
        m = tu_client_job_status(&f->cl, id64);
        const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        done = st && st->state == FUSION__JOB_STATE__JOB_STATE_DONE;
        wire_msg_destroy(&m);
    }
    if (!done)
        tu_file_show(tu_broker_log(f->c), 40);
    assert_true(done);
    print_message("%u steps done in %.1f s\n", steps, (double)(fu_clock_ms() - t0) / 1e3);
    char mine[160], other[160];
    http_token(f->c, "client", mine, sizeof mine);
    http_token(f->c, "other", other, sizeof other);
    char *o = tu_sh_expect_out(0, "\"points\"", "curl -sf -H 'Authorization: Bearer %s' "
                               "http://127.0.0.1:%d/api/jobs/%s/loss", mine, port, id);
    cJSON *j = cJSON_Parse(o);
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItem(j, "job")->valuestring, id);
    assert_string_equal(cJSON_GetObjectItem(j, "kind")->valuestring, "finetune");
    assert_int_equal((int)cJSON_GetObjectItem(j, "stride")->valuedouble, 2);
    const cJSON *pts = cJSON_GetObjectItem(j, "points");
    int n = cJSON_GetArraySize(pts);
    print_message("the loss curve: %d points, %zu bytes of JSON\n", n, strlen(o));
    assert_int_equal(n, 551); /* 1, 3, ..., 1099 and 1100 */
    for (int i = 0; i < n; i++) {
        const cJSON *pt = cJSON_GetArrayItem(pts, i);
        assert_int_equal(cJSON_GetArraySize(pt), 2);
        double step = cJSON_GetArrayItem(pt, 0)->valuedouble, loss = cJSON_GetArrayItem(pt, 1)->valuedouble;
        assert_true(step == (i + 1 < n ? 2.0 * i + 1 : (double)steps));
        assert_true(loss == 6.0 - step);
    }
    cJSON_Delete(j);
    free(o);
    /* another client's job, an unknown job: not found, as JSON */
    o = tu_sh_expect_out(0, "404", "curl -s -w '%%{http_code}' -H 'Authorization: Bearer %s' "
                         "http://127.0.0.1:%d/api/jobs/%s/loss", other, port, id);
    assert_non_null(strstr(o, "{\"error\":\"no such job among yours\"}"));
    free(o);
    o = tu_sh_expect_out(0, "404", "curl -s -w '%%{http_code}' -H 'Authorization: Bearer %s' "
                         "http://127.0.0.1:%d/api/jobs/00000000deadbeef/loss", mine, port);
    assert_non_null(strstr(o, "{\"error\":"));
    free(o);
    tu_sh_expect(0, "404", "curl -s -o /dev/null -w '%%{http_code}' -H 'Authorization: Bearer %s' "
                 "http://127.0.0.1:%d/api/jobs/%s/lossy", mine, port, id);
    tu_fake_peer_stop(&p, SIGTERM);
}

/* A malformed --http is refused before the broker starts. */
static void test_broker_metrics_bad_address_refused(void **state)
{
    tu_broker_fx *f = *state;
    char db[TU_PATH], keys[TU_PATH];
    tu_path(f->c, db, "other.db");
    tu_path(f->c, keys, "broker");
    tu_sh_expect(2, "--http wants IPV4:PORT", "%s --keys %s --db %s --bind tcp://127.0.0.1:0 --http localhost",
                 tu_bin("fusion-broker"), keys, db);
    tu_sh_expect(2, "is not an IPv4 address", "%s --keys %s --db %s --bind tcp://127.0.0.1:0 --http nohost:9",
                 tu_bin("fusion-broker"), keys, db);
}

int main(int argc, char **argv)
{
    if (tu_fake_peer_requested(argc, argv))
        return tu_fake_peer_main(argc, argv);
    const struct CMUnitTest tests[] = {
        tu_broker_test(test_broker_metrics_count_what_happened),
        tu_broker_test(test_broker_metrics_bad_address_refused),
        tu_broker_test(test_broker_metrics_api_shows_each_client_its_own),
        tu_broker_test(test_broker_metrics_api_loss_curve),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
