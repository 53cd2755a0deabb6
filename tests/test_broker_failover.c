/* Failover and the data flows through the real fusion-broker process: a stage whose peer is
 * killed goes to the warm backup (time measured); with no backup left the job waits and says
 * why; a whole fine-tune run through peer processes (weights and tokens fetched and hash-checked,
 * chunked checkpoints committed and acknowledged, progress, the adapter assembled, the result
 * downloaded in chunks and resumed from an offset); the data-plane relay; a stage peer that never says
 * StageReady is released after --ready-timeout, the job waits (saying why) rather than go back to it,
 * also after a broker restart, and runs on the next peer that joins. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "test_broker_util.h"

#define GiB (1ull << 30)

typedef struct {
    tb_broker b;
    wire_keypair_t *alice, *pk[3];
    char pdir[3][4300];
    tb_client a;
    char model[4300];
    char spec[8192];
} fx;

static int setup(void **state)
{
    fx *f = calloc(1, sizeof *f);
    tb_broker_init(&f->b, "broker-failover");
    f->alice = tb_keygen(f->b.dir, "alice");
    tb_allow(f->b.allow, f->alice);
    for (int i = 0; i < 3; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        f->pk[i] = tb_keygen(f->b.dir, name);
        tb_allow(f->b.allow, f->pk[i]);
        snprintf(f->pdir[i], sizeof f->pdir[i], "%s/%s", f->b.dir, name);
    }
    snprintf(f->model, sizeof f->model, "%s/model", f->b.dir);
    tb_make_model(f->model);
    TB_FINETUNE_SPEC(f->model, f->spec, sizeof f->spec);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fx *f = *state;
    tb_client_close(&f->a);
    wire_keypair_destroy(&f->alice);
    for (int i = 0; i < 3; i++)
        wire_keypair_destroy(&f->pk[i]);
    int rc = tb_broker_fini(&f->b);
    free(f);
    return rc;
}

static void start(fx *f)
{
    tb_broker_start(&f->b);
    tb_client_open(&f->a, f->alice, &f->b);
    if (!tb_wait_up(&f->a, 10000)) {
        tb_broker_dump_log(&f->b);
        fail_msg("the broker did not come up");
    }
}

static uint64_t submit(fx *f)
{
    wire_msg_t *m = tb_submit(&f->a, f->spec, NULL);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_JOB_STATUS);
    uint64_t id = ((const Fusion__JobStatus *)wire_msg_body(m))->job_id;
    wire_msg_destroy(&m);
    return id;
}

static void test_broker_failover_to_warm_backup(void **state)
{
    fx *f = *state;
    f->b.backups = 1;
    start(f);
    tb_peer p[2];
    char line[512];
    for (int i = 0; i < 2; i++) {
        tb_peer_start(&p[i], &f->b, f->pdir[i], i ? "p1" : "p0", 4 * GiB, 50, "ready");
        assert_true(tb_peer_expect(&p[i], "WELCOME", 5000, NULL, 0));
    }
    uint64_t id = submit(f);
    /* one peer runs the stage, the other is its warm backup */
    int stage_peer = -1;
    for (int i = 0; i < 2; i++) {
        assert_true(tb_peer_expect(&p[i], "ASSIGN", 5000, line, sizeof line));
        if (strstr(line, "backup 0"))
            stage_peer = i;
        else
            assert_non_null(strstr(line, "backup 1"));
    }
    assert_true(stage_peer >= 0);
    int backup = 1 - stage_peer;
    assert_true(tb_peer_expect(&p[stage_peer], "START", 5000, NULL, 0));
    fu_sleep_ms(300);
    int cores = tu_load_start(0); /* timed: against one busy loop per core (docs/TESTING.md) */
    uint64_t t0 = fu_clock_ms();
    tb_peer_stop(&p[stage_peer], SIGKILL);
    char want[64];
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0", id);
    assert_true(tb_peer_expect(&p[backup], "ASSIGN", 8000, line, sizeof line));
    uint64_t dt = fu_clock_ms() - t0;
    tu_load_stop();
    print_message("failover: stage peer killed (SIGKILL), its backup got the stage %llu ms later (%d busy loops): %s\n",
                  (unsigned long long)dt, cores, line);
    assert_memory_equal(line, want, strlen(want));
    assert_true(dt < 6000);
    assert_true(tb_peer_expect(&p[backup], "START", 5000, NULL, 0));
    wire_msg_t *m = tb_job_status(&f->a, id);
    const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
    assert_non_null(st);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_RUNNING);
    wire_msg_destroy(&m);
    /* and now no backup is left: killing it sends the job back to the queue with a reason */
    tb_peer_stop(&p[backup], SIGKILL);
    uint64_t end = fu_clock_ms() + 8000;
    bool queued = false;
    while (!queued && fu_clock_ms() < end) {
        m = tb_job_status(&f->a, id);
        st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st && st->state == FUSION__JOB_STATE__JOB_STATE_QUEUED && strstr(st->message, "waiting for peers")) {
            print_message("with no backup left: %s\n", st->message);
            queued = true;
        }
        wire_msg_destroy(&m);
        fu_sleep_ms(200);
    }
    assert_true(queued);
}

static void test_broker_failover_on_leave(void **state)
{
    fx *f = *state;
    f->b.backups = 1;
    start(f);
    tb_peer p[2];
    char line[512];
    for (int i = 0; i < 2; i++) {
        tb_peer_start(&p[i], &f->b, f->pdir[i], i ? "p1" : "p0", 4 * GiB, 50, "ready");
        assert_true(tb_peer_expect(&p[i], "WELCOME", 5000, NULL, 0));
    }
    uint64_t id = submit(f);
    int stage_peer = -1;
    for (int i = 0; i < 2; i++) {
        assert_true(tb_peer_expect(&p[i], "ASSIGN", 5000, line, sizeof line));
        if (strstr(line, "backup 0"))
            stage_peer = i;
    }
    assert_true(stage_peer >= 0);
    int backup = 1 - stage_peer;
    assert_true(tb_peer_expect(&p[stage_peer], "START", 5000, NULL, 0));
    /* SIGTERM: the stage's peer sends Leave; its stage moves at once, it is released and exits */
    int cores = tu_load_start(0); /* timed: against one busy loop per core (docs/TESTING.md) */
    uint64_t t0 = fu_clock_ms();
    kill(p[stage_peer].pid, SIGTERM);
    char want[64];
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0", id);
    assert_true(tb_peer_expect(&p[backup], "ASSIGN", 5000, line, sizeof line));
    uint64_t dt = fu_clock_ms() - t0;
    tu_load_stop();
    print_message("graceful leave: the backup got the stage %llu ms after the stage peer's SIGTERM (%d busy loops)\n",
                  (unsigned long long)dt, cores);
    assert_memory_equal(line, want, strlen(want));
    assert_true(dt < 1000);
    assert_true(tb_peer_expect(&p[stage_peer], "RELEASE", 3000, NULL, 0));
    assert_int_equal(tb_peer_stop(&p[stage_peer], SIGTERM), 0);
    tb_peer_stop(&p[backup], SIGKILL);
}

static void test_broker_failover_retry_cap_fails_the_job(void **state)
{
    fx *f = *state;
    f->b.backups = 1;
    start(f);
    tb_peer p[2];
    for (int i = 0; i < 2; i++) {
        tb_peer_start(&p[i], &f->b, f->pdir[i], i ? "bad1" : "bad0", 4 * GiB, 50, "error");
        assert_true(tb_peer_expect(&p[i], "WELCOME", 5000, NULL, 0));
    }
    uint64_t id = submit(f);
    const Fusion__JobStatus *st = NULL;
    wire_msg_t *m = NULL;
    for (int k = 0; k < 100; k++) {
        wire_msg_destroy(&m);
        m = tb_job_status(&f->a, id);
        st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st && st->state == FUSION__JOB_STATE__JOB_STATE_FAILED)
            break;
        fu_sleep_ms(100);
    }
    assert_non_null(st);
    print_message("retry cap: %s\n", st->message);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_FAILED);
    assert_non_null(strstr(st->message, "recoveries without progress"));
    assert_non_null(strstr(st->message, "simulated stage failure"));
    wire_msg_destroy(&m);
    /* each failure cost its peer reputation */
    m = tb_call(&f->a, FUSION__MSG_TYPE__MSG_PEER_LIST_REQ, 0, NULL, FUSION__MSG_TYPE__MSG_PEER_LIST, 3000);
    const Fusion__PeerList *pl = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_PEER_LIST);
    assert_non_null(pl);
    double sum = 0;
    for (size_t i = 0; i < pl->n_peers; i++)
        sum += pl->peers[i]->reputation;
    assert_true(sum < 2.0 - 0.5);
    wire_msg_destroy(&m);
    for (int i = 0; i < 2; i++)
        tb_peer_stop(&p[i], SIGKILL);
}

static void test_broker_failover_full_run_and_result(void **state)
{
    fx *f = *state;
    f->b.backups = 0;
    start(f);
    tb_peer p[2];
    char line[512];
    for (int i = 0; i < 2; i++) {
        tb_peer_start(&p[i], &f->b, f->pdir[i], i ? "p1" : "p0", 4 * GiB, 50, "train");
        assert_true(tb_peer_expect(&p[i], "WELCOME", 5000, NULL, 0));
    }
    uint64_t id = submit(f);
    int used = 0;
    for (int i = 0; i < 2; i++) {
        if (!tb_peer_expect(&p[i], "FETCH", 3000, line, sizeof line))
            continue;
        used++;
        print_message("peer %d: %s\n", i, line);
        assert_non_null(strstr(line, "weights ok 256 tokens ok"));
        assert_true(tb_peer_expect(&p[i], "CKPT", 5000, line, sizeof line));
        assert_non_null(strstr(line, "step 1 acked"));
        assert_true(tb_peer_expect(&p[i], "CKPT", 5000, line, sizeof line));
        assert_non_null(strstr(line, "step 2 acked"));
    }
    assert_true(used >= 1);
    /* done: progress and result */
    const Fusion__JobStatus *st = NULL;
    wire_msg_t *m = NULL;
    for (int k = 0; k < 50; k++) {
        wire_msg_destroy(&m);
        m = tb_job_status(&f->a, id);
        st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st && st->state == FUSION__JOB_STATE__JOB_STATE_DONE)
            break;
        fu_sleep_ms(100);
    }
    if (!st || st->state != FUSION__JOB_STATE__JOB_STATE_DONE)
        tb_broker_dump_log(&f->b);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    assert_int_equal(st->step, 2);
    assert_true(st->loss > 3.9 && st->loss < 4.1);
    print_message("job done on %d stage(s)\n", used);
    wire_msg_destroy(&m);
    /* download the result: adapter_model.safetensors then adapter_config.json */
    Fusion__JobResultRequest rr = FUSION__JOB_RESULT_REQUEST__INIT;
    rr.job_id = id;
    assert_int_equal(tb_send(&f->a, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base), FU_OK);
    uint8_t *st_buf = NULL, *cfg_buf = NULL;
    size_t st_len = 0, cfg_len = 0;
    uint8_t st_hash[32];
    bool last = false;
    while (!last) {
        m = tb_recv(&f->a, 5000);
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
    assert_int_equal(fu_safetensors_count(sf), 2u * (size_t)used); /* A and B of each stage, no optimizer state */
    const fu_st_tensor *tb = fu_safetensors_get(sf, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight");
    assert_non_null(tb);
    float v;
    memcpy(&v, tb->data, sizeof v);
    assert_true(v == 2.0f); /* the step-2 checkpoint */
    fu_safetensors_close(&sf);
    /* resume from an offset */
    rr.offset = 100;
    assert_int_equal(tb_send(&f->a, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base), FU_OK);
    m = tb_recv(&f->a, 5000);
    const Fusion__JobResultChunk *c = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK);
    assert_non_null(c);
    assert_int_equal(c->offset, 100);
    assert_memory_equal(c->data.data, st_buf + 100, c->data.len);
    wire_msg_destroy(&m);
    free(st_buf);
    free(cfg_buf);
    for (int i = 0; i < 2; i++)
        tb_peer_stop(&p[i], SIGKILL);
}

static void test_broker_failover_inference_streams_tokens(void **state)
{
    fx *f = *state;
    f->b.backups = 0;
    start(f);
    tb_peer p;
    char line[512];
    tb_peer_start(&p, &f->b, f->pdir[0], "p0", 4 * GiB, 50, "infer");
    assert_true(tb_peer_expect(&p, "WELCOME", 5000, NULL, 0));
    char spec[9000];
    snprintf(spec, sizeof spec, "{\"model\": \"%s\", \"max_tokens\": 4, \"seed\": 3}", f->model);
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.kind = FUSION__JOB_KIND__JOB_KIND_INFER;
    js.spec_json = spec;
    js.data.data = (uint8_t *)"Hello";
    js.data.len = 5;
    wire_msg_t *m = tb_call(&f->a, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_JOB_STATUS);
    uint64_t id = ((const Fusion__JobStatus *)wire_msg_body(m))->job_id;
    wire_msg_destroy(&m);
    assert_true(tb_peer_expect(&p, "FETCH", 5000, line, sizeof line));
    assert_string_equal(line, "FETCH tokens ok 20 resume 0"); /* the 5 prompt bytes as I32 */
    /* the broker hands each sampled token back to stage 0 until max_tokens */
    assert_true(tb_peer_expect(&p, "TOKEN 5 65", 5000, NULL, 0));
    assert_true(tb_peer_expect(&p, "TOKEN 7 67", 5000, NULL, 0));
    const Fusion__JobStatus *st = NULL;
    for (int k = 0; k < 50; k++) {
        wire_msg_destroy(&m);
        m = tb_job_status(&f->a, id);
        st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st && st->state == FUSION__JOB_STATE__JOB_STATE_DONE)
            break;
        fu_sleep_ms(100);
    }
    assert_non_null(st);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    assert_string_equal(st->output, "ABCD");
    wire_msg_destroy(&m);
    /* the result is output.txt */
    Fusion__JobResultRequest rr = FUSION__JOB_RESULT_REQUEST__INIT;
    rr.job_id = id;
    m = tb_call(&f->a, FUSION__MSG_TYPE__MSG_JOB_RESULT_REQ, id, &rr.base, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK, 3000);
    const Fusion__JobResultChunk *c = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_RESULT_CHUNK);
    assert_non_null(c);
    assert_string_equal(c->file_name, "output.txt");
    assert_int_equal(c->data.len, 4);
    assert_memory_equal(c->data.data, "ABCD", 4);
    assert_true(c->last);
    wire_msg_destroy(&m);
    tb_peer_stop(&p, SIGKILL);
}

static void test_broker_failover_relay(void **state)
{
    fx *f = *state;
    start(f);
    tb_client pa, pb;
    tb_client_open(&pa, f->pk[0], &f->b);
    tb_client_open(&pb, f->pk[1], &f->b);
    tb_fake_hello(&pa, "relay-a", 4 * GiB, 10);
    tb_fake_hello(&pb, "relay-b", 4 * GiB, 10);
    wire_msg_t *m = tb_recv(&pa, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_WELCOME);
    wire_msg_destroy(&m);
    m = tb_recv(&pb, 3000);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_PEER_WELCOME);
    wire_msg_destroy(&m);
    /* A → broker → B, unread: B sees A's key as the sender */
    uint8_t eph[32] = {1, 2, 3};
    Fusion__SealHello sh = FUSION__SEAL_HELLO__INIT;
    sh.long_term_key.data = (uint8_t *)wire_keypair_public(f->pk[0]);
    sh.long_term_key.len = 32;
    sh.ephemeral_key.data = eph;
    sh.ephemeral_key.len = 32;
    sh.job_id = 77;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_SEAL_HELLO, .job_id = 77, .sequence = 5,
                  .relay_to = wire_keypair_public_z85(f->pk[1])};
    assert_int_equal(wire_send(pa.sock, NULL, 0, &h, &sh.base), FU_OK);
    for (;;) {
        m = tb_recv(&pb, 3000);
        assert_non_null(m);
        if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_SEAL_HELLO)
            break;
        wire_msg_destroy(&m);
    }
    assert_string_equal(wire_msg_hdr(m)->sender, wire_keypair_public_z85(f->pk[0]));
    assert_int_equal(wire_msg_hdr(m)->job_id, 77);
    const Fusion__SealHello *got = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_SEAL_HELLO);
    assert_memory_equal(got->ephemeral_key.data, eph, 32);
    wire_msg_destroy(&m);
    /* to a key that is not a live peer: an Error */
    h.relay_to = wire_keypair_public_z85(f->pk[2]);
    assert_int_equal(wire_send(pa.sock, NULL, 0, &h, &sh.base), FU_OK);
    for (;;) {
        m = tb_recv(&pa, 3000);
        assert_non_null(m);
        if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR)
            break;
        wire_msg_destroy(&m);
    }
    assert_int_equal(((const Fusion__Error *)wire_msg_body(m))->code, FUSION__ERROR_CODE__ERR_NOT_FOUND);
    wire_msg_destroy(&m);
    tb_client_close(&pa);
    tb_client_close(&pb);
}

static void test_broker_failover_ready_deadline_waits(void **state)
{
    fx *f = *state;
    f->b.backups = 0;
    f->b.ready_timeout_s = 2;
    start(f);
    tb_peer stuck, good;
    char line[512];
    tb_peer_start(&stuck, &f->b, f->pdir[0], "p0", 4 * GiB, 50, "noready");
    assert_true(tb_peer_expect(&stuck, "WELCOME", 5000, NULL, 0));
    uint64_t id = submit(f);
    assert_true(tb_peer_expect(&stuck, "ASSIGN", 5000, line, sizeof line));
    assert_non_null(strstr(line, "backup 0"));
    int cores = tu_load_start(0); /* timed: against one busy loop per core (docs/TESTING.md) */
    uint64_t t0 = fu_clock_ms();
    /* The deadline passes: it is released, and with no backup the job waits and says why. */
    assert_true(tb_peer_expect(&stuck, "RELEASE", 6000, line, sizeof line));
    uint64_t dt = fu_clock_ms() - t0;
    tu_load_stop();
    print_message("released %llu ms after its assignment (%d busy loops): %s\n", (unsigned long long)dt, cores, line);
    assert_non_null(strstr(line, "missed its ready deadline"));
    assert_true(dt >= 1500 && dt < 4000);
    uint64_t end = fu_clock_ms() + 5000;
    bool said = false;
    while (!said && fu_clock_ms() < end) {
        wire_msg_t *m = tb_job_status(&f->a, id);
        const Fusion__JobStatus *st = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_JOB_STATUS);
        if (st && st->state == FUSION__JOB_STATE__JOB_STATE_QUEUED &&
            strstr(st->message, "missed its ready deadline") && strstr(st->message, "taken off this job")) {
            print_message("queued: %s\n", st->message);
            said = true;
        }
        wire_msg_destroy(&m);
        fu_sleep_ms(200);
    }
    assert_true(said);
    /* It is idle, yet the job is not given back to it. */
    assert_false(tb_peer_expect(&stuck, "ASSIGN", 1500, NULL, 0));
    /* Nor after the broker is killed and restarted on the same store: the exclusion is stored. */
    assert_int_equal(tb_broker_stop(&f->b, SIGKILL), 128 + SIGKILL);
    tb_broker_start(&f->b);
    assert_true(tb_peer_expect(&stuck, "WELCOME", 8000, NULL, 0)); /* registered again */
    assert_false(tb_peer_expect(&stuck, "ASSIGN", 2500, NULL, 0));
    /* A peer that works takes the job. */
    tb_peer_start(&good, &f->b, f->pdir[1], "p1", 4 * GiB, 50, "ready");
    assert_true(tb_peer_expect(&good, "ASSIGN", 8000, line, sizeof line));
    assert_true(tb_peer_expect(&good, "START", 5000, NULL, 0));
    tb_peer_stop(&good, SIGTERM);
    tb_peer_stop(&stuck, SIGTERM);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--fake-peer") == 0)
        return tb_fake_peer_main(argc, argv);
    if (sodium_init() < 0)
        return 1;
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_broker_failover_to_warm_backup, setup, teardown),
        cmocka_unit_test_setup_teardown(test_broker_failover_on_leave, setup, teardown),
        cmocka_unit_test_setup_teardown(test_broker_failover_retry_cap_fails_the_job, setup, teardown),
        cmocka_unit_test_setup_teardown(test_broker_failover_full_run_and_result, setup, teardown),
        cmocka_unit_test_setup_teardown(test_broker_failover_inference_streams_tokens, setup, teardown),
        cmocka_unit_test_setup_teardown(test_broker_failover_relay, setup, teardown),
        cmocka_unit_test_setup_teardown(test_broker_failover_ready_deadline_waits, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
