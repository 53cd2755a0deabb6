/* Failover and the data flows through the real fusion-broker process: a stage whose peer is
 * killed goes to the warm backup (time measured; its closed connection tells, a stopped peer's
 * silence does), without one to the fastest idle peer; with no backup left the job waits and says
 * why; a whole fine-tune run through peer processes (weights and tokens fetched and hash-checked,
 * chunked checkpoints committed and acknowledged, progress, the adapter assembled, the result
 * downloaded in chunks and resumed from an offset); the data-plane relay; a stage peer that never says
 * StageReady is released after --ready-timeout, the job waits (saying why) rather than go back to it,
 * also after a broker restart, and runs on the next peer that joins. */
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <sodium.h>

#include "cluster.h"
#include "fake_peer.h"
#include "fu_clock.h"
#include "fu_safetensors.h"
#include "testutil.h"

#define GiB (1ull << 30)

/* Submits the fixture's fine-tune: the job's id. */
static uint64_t submit(tu_broker_fx *f)
{
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_JOB_STATUS);
    uint64_t id = ((const Fusion__JobStatus *)wire_msg_body(m))->job_id;
    wire_msg_destroy(&m);
    return id;
}

/* Starts fake peers p0 and p1 (keys p0, p1, named NAME0 and NAME1) in `mode`; waits for their welcome. */
static void two_peers(tu_broker_fx *f, tu_fake_peer p[2], const char *name, const char *mode)
{
    for (int i = 0; i < 2; i++) {
        char key[8], nm[32];
        snprintf(key, sizeof key, "p%d", i);
        snprintf(nm, sizeof nm, "%s%d", name, i);
        tu_fake_peer_start(&p[i], f->c, key, nm, 4 * GiB, 50, mode);
        assert_true(tu_fake_peer_expect(&p[i], "WELCOME", 5000, NULL, 0));
    }
}

/* A one-stage job on fake peers p0 and p1 with --backups 1: one peer runs the stage, the other is its
 * warm backup. The job's id in *id; returns the stage's peer once it has started. */
static int job_with_backup(tu_broker_fx *f, tu_fake_peer p[2], uint64_t *id)
{
    tu_cluster_opts(f->c)->backups = 1;
    tu_broker_fx_start(f);
    two_peers(f, p, "p", "ready");
    *id = submit(f);
    char line[512];
    int stage_peer = -1;
    for (int i = 0; i < 2; i++) {
        assert_true(tu_fake_peer_expect(&p[i], "ASSIGN", 5000, line, sizeof line));
        if (strstr(line, "backup 0"))
            stage_peer = i;
        else
            assert_non_null(strstr(line, "backup 1"));
    }
    assert_true(stage_peer >= 0);
    assert_true(tu_fake_peer_expect(&p[stage_peer], "START", 5000, NULL, 0));
    return stage_peer;
}

/* Polls job id's status every 100 ms, at most `tries` times, until it is `want`: the last JobStatus
 * message (caller destroys; its state may be another). */
static wire_msg_t *poll_state(tu_broker_fx *f, uint64_t id, Fusion__JobState want, int tries)
{
    wire_msg_t *m = NULL;
    for (int k = 0; k < tries; k++) {
        wire_msg_destroy(&m);
        m = tu_client_job_status(&f->cl, id);
        const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st && st->state == want)
            break;
        fu_sleep_ms(100);
    }
    return m;
}

/* Waits until the job is queued with a message that holds `says` and `also` (printed); false when
 * timeout_ms pass first. */
static bool queued_saying(tu_broker_fx *f, uint64_t id, const char *says, const char *also, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        wire_msg_t *m = tu_client_job_status(&f->cl, id);
        const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        bool said = st && st->state == FUSION__JOB_STATE__JOB_STATE_QUEUED && strstr(st->message, says) &&
                    strstr(st->message, also);
        if (said)
            print_message("queued: %s\n", st->message);
        wire_msg_destroy(&m);
        if (said)
            return true;
        fu_sleep_ms(200);
    }
    return false;
}

/* Job id runs on p[stage_peer], p[1 - stage_peer] its warm backup: sends sig to the stage's peer
 * under one busy loop per core (timed: docs/TESTING.md) and waits up to timeout_ms for the backup to
 * be assigned the stage (asserted). The time it took; *cores: the busy loops. */
static uint64_t backup_takes_over(tu_fake_peer p[2], int stage_peer, uint64_t id, int sig, int timeout_ms, int *cores)
{
    char line[512], want[64];
    *cores = tu_load_start(0);
    uint64_t t0 = fu_clock_ms();
    kill(p[stage_peer].pid, sig);
    bool got = tu_fake_peer_expect(&p[1 - stage_peer], "ASSIGN", timeout_ms, line, sizeof line);
    uint64_t dt = fu_clock_ms() - t0;
    tu_load_stop();
    assert_true(got);
    print_message("the backup got: %s\n", line);
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0", id);
    assert_memory_equal(line, want, strlen(want));
    return dt;
}

static void test_broker_failover_to_warm_backup(void **state)
{
    tu_broker_fx *f = *state;
    tu_fake_peer p[2];
    uint64_t id;
    int stage_peer = job_with_backup(f, p, &id), backup = 1 - stage_peer, cores;
    fu_sleep_ms(300);
    uint64_t dt = backup_takes_over(p, stage_peer, id, SIGKILL, 8000, &cores);
    print_message("failover: stage peer killed (SIGKILL), its backup got the stage %llu ms later (%d busy loops)\n",
                  (unsigned long long)dt, cores);
    assert_true(dt < 6000);
    tu_fake_peer_stop(&p[stage_peer], SIGKILL);
    assert_true(tu_fake_peer_expect(&p[backup], "START", 5000, NULL, 0));
    wire_msg_t *m = tu_client_job_status(&f->cl, id);
    const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
    assert_non_null(st);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_RUNNING);
    wire_msg_destroy(&m);
    /* and now no backup is left: killing it sends the job back to the queue with a reason */
    tu_fake_peer_stop(&p[backup], SIGKILL);
    assert_true(queued_saying(f, id, "waiting for peers", "", 8000));
}

/* A stage peer that crashes (SIGKILL: its kernel closes its connection) is declared dead "connection
 * closed" and its warm backup gets the stage within a fraction of dead_after_ms (heartbeat 2000 ms:
 * dead after 6000 ms; the grace is 250 ms). One that is stopped (SIGSTOP: its connection stays open)
 * keeps its stage until its silence passes dead_after_ms. */
static void test_broker_failover_closed_connection(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->heartbeat_ms = 2000;
    tu_fake_peer p[2], third;
    char line[512];
    uint64_t id;
    int stage_peer = job_with_backup(f, p, &id), backup = 1 - stage_peer, cores;
    fu_sleep_ms(300);
    uint64_t dt = backup_takes_over(p, stage_peer, id, SIGKILL, 8000, &cores);
    print_message("closed connection: stage peer killed (SIGKILL), its backup got the stage %llu ms later (heartbeat "
                  "2000 ms, dead after 6000 ms; %d busy loops)\n", (unsigned long long)dt, cores);
    assert_true(dt < 3000); /* half of dead_after_ms: only the closed connection can have told */
    assert_true(tu_broker_logged(f->c, "(p%d) is dead: connection closed", stage_peer));
    tu_fake_peer_stop(&p[stage_peer], SIGKILL);
    assert_true(tu_fake_peer_expect(&p[backup], "START", 5000, NULL, 0));
    /* a third peer becomes the backup; then the stage's peer is stopped, its connection open */
    tu_fake_peer_start(&third, f->c, "p2", "p2", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&third, "WELCOME", 5000, NULL, 0));
    assert_true(tu_fake_peer_expect(&third, "ASSIGN", 8000, line, sizeof line));
    assert_non_null(strstr(line, "backup 1"));
    fu_sleep_ms(300);
    cores = tu_load_start(0);
    uint64_t t0 = fu_clock_ms();
    kill(p[backup].pid, SIGSTOP);
    /* its last heartbeat was at most 2000 ms before the stop: not dead before 4000 ms after it */
    bool early = tu_fake_peer_expect(&third, "ASSIGN", 3000, line, sizeof line);
    bool got = early || tu_fake_peer_expect(&third, "ASSIGN", 10000, line, sizeof line);
    dt = fu_clock_ms() - t0;
    tu_load_stop();
    print_message("SIGSTOP: the stopped stage peer's backup got the stage %llu ms after the stop (%d busy loops)\n",
                  (unsigned long long)dt, cores);
    assert_false(early);
    assert_true(got);
    assert_non_null(strstr(line, "backup 0"));
    assert_true(tu_broker_logged(f->c, "(p%d) is dead: silent for", backup));
    tu_fake_peer_stop(&p[backup], SIGKILL);
    tu_fake_peer_stop(&third, SIGKILL);
}

static void test_broker_failover_on_leave(void **state)
{
    tu_broker_fx *f = *state;
    tu_fake_peer p[2];
    uint64_t id;
    int stage_peer = job_with_backup(f, p, &id), backup = 1 - stage_peer, cores;
    /* SIGTERM: the stage's peer sends Leave; its stage moves at once, it is released and exits */
    uint64_t dt = backup_takes_over(p, stage_peer, id, SIGTERM, 5000, &cores);
    print_message("graceful leave: the backup got the stage %llu ms after the stage peer's SIGTERM (%d busy loops)\n",
                  (unsigned long long)dt, cores);
    assert_true(dt < 1000);
    assert_true(tu_fake_peer_expect(&p[stage_peer], "RELEASE", 3000, NULL, 0));
    assert_int_equal(tu_fake_peer_stop(&p[stage_peer], SIGTERM), 0);
    tu_fake_peer_stop(&p[backup], SIGKILL);
}

/* With no backup of its own left, a lost stage goes to the idle peer that would run it fastest, not
 * to the first one registered: the replacement sets the job's pace from then on. p0 runs the stage;
 * "slow" (10 GFLOP/s claimed, 4 measured) joins before "fast" (400 claimed, 60 measured); p0 leaves. */
static void test_broker_failover_to_the_fastest_idle_peer(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 0;
    tu_broker_fx_start(f);
    tu_fake_peer p0, slow, fast;
    char line[512];
    tu_fake_peer_start(&p0, f->c, "p0", "p0", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p0, "WELCOME", 5000, NULL, 0));
    uint64_t id = submit(f);
    assert_true(tu_fake_peer_expect(&p0, "ASSIGN", 5000, line, sizeof line));
    assert_true(tu_fake_peer_expect(&p0, "START", 5000, NULL, 0));
    tu_fake_peer_start(&slow, f->c, "p1", "slow", 4 * GiB, 10, "ready");
    assert_true(tu_fake_peer_expect(&slow, "WELCOME", 5000, NULL, 0));
    tu_fake_peer_start(&fast, f->c, "p2", "fast", 4 * GiB, 400, "ready");
    assert_true(tu_fake_peer_expect(&fast, "WELCOME", 5000, NULL, 0));
    /* both measured (a peer takes no work before its speed challenge) */
    assert_true(tu_file_wait(tu_broker_log(f->c), "claimed 10.0 GFLOP/s, measured", 10000));
    assert_true(tu_file_wait(tu_broker_log(f->c), "claimed 400.0 GFLOP/s, measured", 10000));
    kill(p0.pid, SIGTERM); /* a clean Leave: its stage moves at once */
    bool got = tu_fake_peer_expect(&fast, "ASSIGN", 5000, line, sizeof line);
    print_message("p0 left; the fast idle peer %s: %s\n", got ? "got the stage" : "got nothing", got ? line : "");
    assert_true(got);
    char want[64];
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0", id);
    assert_memory_equal(line, want, strlen(want));
    assert_false(tu_fake_peer_expect(&slow, "ASSIGN", 500, NULL, 0));
    tu_fake_peer_stop(&p0, SIGKILL);
    tu_fake_peer_stop(&slow, SIGTERM);
    tu_fake_peer_stop(&fast, SIGTERM);
}

static void test_broker_failover_retry_cap_fails_the_job(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 1;
    tu_broker_fx_start(f);
    tu_fake_peer p[2];
    two_peers(f, p, "bad", "error");
    uint64_t id = submit(f);
    wire_msg_t *m = poll_state(f, id, FUSION__JOB_STATE__JOB_STATE_FAILED, 100);
    const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
    assert_non_null(st);
    print_message("retry cap: %s\n", st->message);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_FAILED);
    assert_non_null(strstr(st->message, "recoveries without progress"));
    assert_non_null(strstr(st->message, "simulated stage failure"));
    wire_msg_destroy(&m);
    /* each failure cost its peer reputation */
    m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    const Fusion__PeerList *pl = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_LIST);
    assert_non_null(pl);
    double sum = 0;
    for (size_t i = 0; i < pl->n_peers; i++)
        sum += pl->peers[i]->reputation;
    assert_true(sum < 2.0 - 0.5);
    wire_msg_destroy(&m);
    for (int i = 0; i < 2; i++)
        tu_fake_peer_stop(&p[i], SIGKILL);
}

static void test_broker_failover_full_run_and_result(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 0;
    tu_broker_fx_start(f);
    tu_fake_peer p[2];
    char line[512];
    two_peers(f, p, "p", "train");
    uint64_t id = submit(f);
    int used = 0;
    for (int i = 0; i < 2; i++) {
        if (!tu_fake_peer_expect(&p[i], "FETCH", 3000, line, sizeof line))
            continue;
        used++;
        print_message("peer %d: %s\n", i, line);
        assert_non_null(strstr(line, "weights ok 256 tokens ok"));
        assert_true(tu_fake_peer_expect(&p[i], "CKPT", 5000, line, sizeof line));
        assert_non_null(strstr(line, "step 1 acked"));
        assert_true(tu_fake_peer_expect(&p[i], "CKPT", 5000, line, sizeof line));
        assert_non_null(strstr(line, "step 2 acked"));
    }
    assert_true(used >= 1);
    /* done: progress and result */
    wire_msg_t *m = poll_state(f, id, FUSION__JOB_STATE__JOB_STATE_DONE, 50);
    const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
    if (!st || st->state != FUSION__JOB_STATE__JOB_STATE_DONE)
        tu_file_show(tu_broker_log(f->c), 40);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    assert_int_equal(st->step, 2);
    assert_true(st->loss > 3.9 && st->loss < 4.1);
    print_message("job done on %d stage(s)\n", used);
    wire_msg_destroy(&m);
    /* download the result: adapter_model.safetensors then adapter_config.json */
    Fusion__JobResultRequest rr = FUSION__JOB_RESULT_REQUEST__INIT;
    rr.job_id = id;
    assert_int_equal(tu_client_send(&f->cl, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base), FU_OK);
    uint8_t *st_buf = NULL, *cfg_buf = NULL;
    size_t st_len = 0, cfg_len = 0;
    uint8_t st_hash[32];
    bool last = false;
    while (!last) {
        m = tu_client_recv(&f->cl, 5000);
        assert_non_null(m);
        const Fusion__JobResultChunk *c = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK);
        assert_non_null(c);
        uint8_t **buf = strcmp(c->file_name, "adapter_model.safetensors") == 0 ? &st_buf : &cfg_buf;
        size_t *len = buf == &st_buf ? &st_len : &cfg_len;
        if (!*buf)
            *buf = calloc(1, c->total + 1);
        memcpy(*buf + c->offset, c->data.data, c->data.len);
        *len = c->total;
        if (buf == &st_buf)
            memcpy(st_hash, c->content_hash.data, 32);
        last = c->last;
        wire_msg_destroy(&m);
    }
    assert_non_null(st_buf);
    assert_non_null(cfg_buf);
    uint8_t h[32];
    crypto_generichash(h, 32, st_buf, st_len, NULL, 0);
    assert_memory_equal(h, st_hash, 32);
    cJSON *cfg = cJSON_Parse((char *)cfg_buf);
    assert_non_null(cfg);
    assert_string_equal(cJSON_GetObjectItem(cfg, "peft_type")->valuestring, "LORA");
    assert_string_equal(cJSON_GetObjectItem(cfg, "task_type")->valuestring, "CAUSAL_LM");
    cJSON_Delete(cfg);
    fu_safetensors *sf = NULL;
    assert_int_equal(fu_safetensors_parse_header(st_buf, st_len, "adapter", &sf, NULL), FU_OK);
    /* A and B of every adapted linear of every stage (at least one per stage), no optimizer state */
    assert_true(fu_safetensors_count(sf) >= 2u * (size_t)used && fu_safetensors_count(sf) % 2 == 0);
    for (size_t i = 0; i < fu_safetensors_count(sf); i++)
        assert_null(strstr(fu_safetensors_at(sf, i)->name, "adam_"));
    const fu_st_tensor *tb = fu_safetensors_get(sf, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
    assert_non_null(tb);
    float v;
    memcpy(&v, tb->data, sizeof v);
    assert_true(v == 2.0f); /* the step-2 checkpoint */
    fu_safetensors_close(&sf);
    /* resume from an offset */
    rr.offset = 100;
    assert_int_equal(tu_client_send(&f->cl, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base), FU_OK);
    m = tu_client_recv(&f->cl, 5000);
    const Fusion__JobResultChunk *c = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK);
    assert_non_null(c);
    assert_int_equal(c->offset, 100);
    assert_memory_equal(c->data.data, st_buf + 100, c->data.len);
    wire_msg_destroy(&m);
    free(st_buf);
    free(cfg_buf);
    for (int i = 0; i < 2; i++)
        tu_fake_peer_stop(&p[i], SIGKILL);
}

/* Submits a 4-token generation of "Hello" (seed 3); its job id. */
static uint64_t submit_hello_infer(tu_broker_fx *f)
{
    char spec[9000];
    snprintf(spec, sizeof spec, "{\"model\": \"%s\", \"max_tokens\": 4, \"seed\": 3}", f->model);
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.kind = FUSION__JOB_KIND__JOB_KIND_INFER;
    js.spec_json = spec;
    js.data.data = (uint8_t *)"Hello";
    js.data.len = 5;
    wire_msg_t *m =
        tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_JOB_STATUS);
    uint64_t id = ((const Fusion__JobStatus *)wire_msg_body(m))->job_id;
    wire_msg_destroy(&m);
    return id;
}

static void test_broker_failover_inference_streams_tokens(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 0;
    tu_broker_fx_start(f);
    tu_fake_peer p;
    char line[512];
    tu_fake_peer_start(&p, f->c, "p0", "p0", 4 * GiB, 50, "infer");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    uint64_t id = submit_hello_infer(f);
    wire_msg_t *m = NULL;
    assert_true(tu_fake_peer_expect(&p, "FETCH", 5000, line, sizeof line));
    assert_string_equal(line, "FETCH tokens ok 20 resume 0"); /* the 5 prompt bytes as I32 */
    /* the broker hands each sampled token back to stage 0 until max_tokens */
    assert_true(tu_fake_peer_expect(&p, "TOKEN 5 65", 5000, NULL, 0));
    assert_true(tu_fake_peer_expect(&p, "TOKEN 7 67", 5000, NULL, 0));
    m = poll_state(f, id, FUSION__JOB_STATE__JOB_STATE_DONE, 50);
    const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
    assert_non_null(st);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    assert_string_equal(st->output, "ABCD");
    wire_msg_destroy(&m);
    /* the result is output.txt */
    Fusion__JobResultRequest rr = FUSION__JOB_RESULT_REQUEST__INIT;
    rr.job_id = id;
    m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base,
                       FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, 3000);
    const Fusion__JobResultChunk *c = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK);
    assert_non_null(c);
    assert_string_equal(c->file_name, "output.txt");
    assert_int_equal(c->data.len, 4);
    assert_memory_equal(c->data.data, "ABCD", 4);
    assert_true(c->last);
    wire_msg_destroy(&m);
    tu_fake_peer_stop(&p, SIGKILL);
}

/* A long-polled status request (JobRef.wait_ms) of the text of job id, known_len bytes known: the
 * answer, and how long it took in *ms. */
static wire_msg_t *long_poll(tu_broker_fx *f, uint64_t id, uint32_t wait_ms, uint64_t known_len, uint64_t *ms)
{
    Fusion__JobRef r = FUSION__JOB_REF__INIT;
    r.job_id = id;
    r.wait_ms = wait_ms;
    r.known_output_len = known_len;
    uint64_t t0 = fu_clock_ms();
    wire_msg_t *m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_STATUS_REQ, id, &r.base,
                                   FUSION__MSG_TYPE__MSG_JOB_STATUS, 6000);
    *ms = fu_clock_ms() - t0;
    assert_non_null(m);
    assert_non_null(wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS));
    return m;
}

/* `fusion serve` and `fusion wait` follow a generation by long polls: the broker holds a status
 * request until the text grows, the job ends or the wait (at most 2 s) is over, so each token is
 * passed on as it comes and nothing is asked in between. */
static void test_broker_failover_inference_long_poll(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 0;
    tu_broker_fx_start(f);
    /* No peer: the job waits, and so does its long poll, until its wait is over. */
    uint64_t id = submit_hello_infer(f), ms = 0;
    wire_msg_t *m = long_poll(f, id, 700, 0, &ms);
    const Fusion__JobStatus *st = (const Fusion__JobStatus *)wire_msg_body(m);
    printf("queued job: answered after %" PRIu64 " ms of a 700 ms wait\n", ms);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
    assert_true(ms >= 650 && ms < 3000);
    wire_msg_destroy(&m);
    m = long_poll(f, id, 60000, 0, &ms); /* held 2 s at most */
    printf("a 60 s wait: answered after %" PRIu64 " ms\n", ms);
    assert_true(ms >= 1900 && ms < 4000);
    wire_msg_destroy(&m);
    /* A token every 0.3 s: each answer brings more text, none comes back empty-handed. */
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p0", "p0", 4 * GiB, 50, "infer-slow");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    char seen[8][8];
    size_t known = 0, n = 0;
    for (int k = 0; k < 40; k++) {
        m = long_poll(f, id, 2000, known, &ms);
        st = (const Fusion__JobStatus *)wire_msg_body(m);
        size_t len = strlen(st->output);
        bool done = st->state == FUSION__JOB_STATE__JOB_STATE_DONE;
        if (!done && st->state != FUSION__JOB_STATE__JOB_STATE_QUEUED && len == known && ms < 1900)
            fail_msg("a long poll of a running job came back after %" PRIu64 " ms with nothing new", ms);
        if (len != known && n < 8)
            snprintf(seen[n++], sizeof seen[0], "%s", st->output);
        known = len;
        wire_msg_destroy(&m);
        if (done)
            break;
    }
    printf("texts seen: %zu, the last '%s'\n", n, n ? seen[n - 1] : "");
    assert_true(n >= 3); /* "A", "AB", "ABC", ... one answer per token, give or take the last */
    assert_string_equal(seen[n - 1], "ABCD");
    /* A finished job is answered at once. */
    m = long_poll(f, id, 2000, 4, &ms);
    assert_int_equal(((const Fusion__JobStatus *)wire_msg_body(m))->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    assert_true(ms < 1000);
    wire_msg_destroy(&m);
    tu_fake_peer_stop(&p, SIGKILL);
}

/* Past --keep-jobs-days a done job's result is deleted by the store's compaction: `fusion result`
 * says when and gives the result's hash; the job's status stays done (docs/STORE.md "Compaction"). */
static void test_broker_failover_result_purged_after_retention(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 0;
    tu_broker_args(f->c, "--keep-jobs-days 0.00002"); /* 1.7 s */
    tu_broker_fx_start(f);
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p0", "p0", 4 * GiB, 50, "infer");
    assert_true(tu_fake_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    uint64_t id = submit_hello_infer(f);
    wire_msg_t *m = NULL;
    m = poll_state(f, id, FUSION__JOB_STATE__JOB_STATE_DONE, 100);
    assert_int_equal(((const Fusion__JobStatus *)wire_msg_body(m))->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    wire_msg_destroy(&m);
    const char *why = NULL;
    for (int k = 0; k < 100 && !why; k++) { /* the retention, then a compaction turn (once a second) */
        Fusion__JobResultRequest rr = FUSION__JOB_RESULT_REQUEST__INIT;
        rr.job_id = id;
        m = tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base,
                           FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, 3000);
        assert_non_null(m);
        if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR) {
            const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
            print_message("after the retention: %s\n", e->message);
            assert_int_equal(e->code, FUSION__ERROR_CODE__ERR_NOT_FOUND);
            assert_non_null(strstr(e->message, "was deleted"));
            assert_non_null(strstr(e->message, "--keep-jobs-days"));
            assert_non_null(strstr(e->message, "BLAKE2b-256 was "));
            why = "deleted";
        }
        wire_msg_destroy(&m);
        if (!why)
            fu_sleep_ms(100);
    }
    assert_non_null(why);
    m = tu_client_job_status(&f->cl, id); /* still done */
    assert_int_equal(((const Fusion__JobStatus *)wire_msg_body(m))->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    wire_msg_destroy(&m);
    tu_fake_peer_stop(&p, SIGKILL);
}

static void test_broker_failover_relay(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    tu_client pa, pb;
    tu_client_open(&pa, f->c, "p0");
    tu_client_open(&pb, f->c, "p1");
    tu_client_hello(&pa, "relay-a", 4 * GiB, 10);
    tu_client_hello(&pb, "relay-b", 4 * GiB, 10);
    wire_msg_t *m = tu_client_recv(&pa, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_WELCOME);
    wire_msg_destroy(&m);
    m = tu_client_recv(&pb, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_WELCOME);
    wire_msg_destroy(&m);
    /* A → broker → B, unread: B sees A's key as the sender */
    uint8_t eph[32] = {1, 2, 3};
    Fusion__SealHello sh = FUSION__SEAL_HELLO__INIT;
    sh.long_term_key.data = (uint8_t *)wire_keypair_public(pa.kp);
    sh.long_term_key.len = 32;
    sh.ephemeral_key.data = eph;
    sh.ephemeral_key.len = 32;
    sh.job_id = 77;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_SEAL_HELLO, .job_id = 77, .sequence = 5,
                  .relay_to = wire_keypair_public_z85(pb.kp)};
    assert_int_equal(wire_send(pa.sock, NULL, 0, &h, &sh.base), FU_OK);
    for (;;) {
        m = tu_client_recv(&pb, 3000);
        assert_non_null(m);
        if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_SEAL_HELLO)
            break;
        wire_msg_destroy(&m);
    }
    assert_string_equal(wire_msg_hdr(m)->sender, wire_keypair_public_z85(pa.kp));
    assert_int_equal(wire_msg_hdr(m)->job_id, 77);
    const Fusion__SealHello *got = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_SEAL_HELLO);
    assert_memory_equal(got->ephemeral_key.data, eph, 32);
    wire_msg_destroy(&m);
    /* to a key that is not a live peer: an Error */
    char p2[41];
    tu_key_public(f->c, "p2", p2);
    h.relay_to = p2;
    assert_int_equal(wire_send(pa.sock, NULL, 0, &h, &sh.base), FU_OK);
    for (;;) {
        m = tu_client_recv(&pa, 3000);
        assert_non_null(m);
        if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR)
            break;
        wire_msg_destroy(&m);
    }
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m))->code, FUSION__ERROR_CODE__ERR_NOT_FOUND);
    wire_msg_destroy(&m);
    tu_client_close(&pa);
    tu_client_close(&pb);
}

static void test_broker_failover_ready_deadline_waits(void **state)
{
    tu_broker_fx *f = *state;
    tu_cluster_opts(f->c)->backups = 0;
    tu_cluster_opts(f->c)->ready_timeout_s = 2;
    tu_broker_fx_start(f);
    tu_fake_peer stuck, good;
    char line[512];
    tu_fake_peer_start(&stuck, f->c, "p0", "p0", 4 * GiB, 50, "noready");
    assert_true(tu_fake_peer_expect(&stuck, "WELCOME", 5000, NULL, 0));
    uint64_t id = submit(f);
    assert_true(tu_fake_peer_expect(&stuck, "ASSIGN", 5000, line, sizeof line));
    assert_non_null(strstr(line, "backup 0"));
    int cores = tu_load_start(0); /* timed: against one busy loop per core (docs/TESTING.md) */
    uint64_t t0 = fu_clock_ms();
    /* The deadline passes: it is released, and with no backup the job waits and says why. */
    assert_true(tu_fake_peer_expect(&stuck, "RELEASE", 6000, line, sizeof line));
    uint64_t dt = fu_clock_ms() - t0;
    tu_load_stop();
    print_message("released %llu ms after its assignment (%d busy loops): %s\n", (unsigned long long)dt, cores, line);
    assert_non_null(strstr(line, "missed its ready deadline"));
    assert_true(dt >= 1500 && dt < 4000);
    assert_true(queued_saying(f, id, "missed its ready deadline", "taken off this job", 5000));
    /* It is idle, yet the job is not given back to it. */
    assert_false(tu_fake_peer_expect(&stuck, "ASSIGN", 1500, NULL, 0));
    /* Nor after the broker is killed and restarted on the same store: the exclusion is stored. */
    assert_int_equal(tu_broker_stop(f->c, SIGKILL), 128 + SIGKILL);
    tu_broker_start(f->c);
    assert_true(tu_fake_peer_expect(&stuck, "WELCOME", 8000, NULL, 0)); /* registered again */
    assert_false(tu_fake_peer_expect(&stuck, "ASSIGN", 2500, NULL, 0));
    /* A peer that works takes the job. */
    tu_fake_peer_start(&good, f->c, "p1", "p1", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&good, "ASSIGN", 8000, line, sizeof line));
    assert_true(tu_fake_peer_expect(&good, "START", 5000, NULL, 0));
    tu_fake_peer_stop(&good, SIGTERM);
    tu_fake_peer_stop(&stuck, SIGTERM);
}

int main(int argc, char **argv)
{
    if (tu_fake_peer_requested(argc, argv))
        return tu_fake_peer_main(argc, argv);
    const struct CMUnitTest tests[] = {
        tu_broker_test(test_broker_failover_to_warm_backup),
        tu_broker_test(test_broker_failover_closed_connection),
        tu_broker_test(test_broker_failover_on_leave),
        tu_broker_test(test_broker_failover_to_the_fastest_idle_peer),
        tu_broker_test(test_broker_failover_retry_cap_fails_the_job),
        tu_broker_test(test_broker_failover_full_run_and_result),
        tu_broker_test(test_broker_failover_inference_streams_tokens),
        tu_broker_test(test_broker_failover_inference_long_poll),
        tu_broker_test(test_broker_failover_result_purged_after_retention),
        tu_broker_test(test_broker_failover_relay),
        tu_broker_test(test_broker_failover_ready_deadline_waits),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
