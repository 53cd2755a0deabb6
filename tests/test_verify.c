/* Verification of untrusted peers (docs/PIPELINE.md "Verification"), with the real fusion-broker,
 * real fusion-peer processes and the real client on loopback (the test clusters of tests/cluster.h):
 *   - the sketch itself: deterministic, linear, seed-dependent, norm exact; the sealed chunks that
 *     carry a stage's input to a verifier: round trip, and every way a chunk is refused;
 *   - the broker refuses malformed verification messages from a registered peer with a sentence (or
 *     drops those about no sample in flight), refuses to relay anything but data frames, and keeps
 *     serving;
 *   - two stages, verify = 1.0 over honest peers: every sampled micro-batch of stage 0 agrees, the
 *     broker logs and records (events "verified") them, and the adapter equals `fusion run
 *     finetune`'s;
 *   - honest peers that read their requests late (the test-only hook FUSION_TEST_VERIFY_LATE) and no
 *     longer hold what is asked for are not blamed: the broker's StepDones show they moved on;
 *   - a dishonest stage-0 peer (the test-only hook FUSION_TEST_CORRUPT_OUTPUT=scale:FILE, armed by
 *     creating FILE once the plan is known) is caught: its reputation falls below the threshold,
 *     its stage fails over to the backup, it gets no more work, and the job still finishes; with two
 *     backups of stage 0 a third opinion settles each disagreement;
 *   - a single-stage job: its verified output is the loss; a peer that reports scaled losses is
 *     caught the same way;
 *   - three stages, every stage verified: stage 1 and stage 2 get their inputs from the upstream peer
 *     sealed to the verifier, and every sample agrees; the adapter is unchanged;
 *   - a dishonest middle stage (stage 1 of 3) is caught the same way while the stage after it, which
 *     computes on the corrupted activations, is not blamed (the inputs match, the outputs agree);
 *   - a stage-0 peer that sends corrupted activations but keeps honest copies shows up as input
 *     mismatches at stage 1: inconclusive samples, "input-mismatch" events, and both accounts' peers
 *     sink together.
 * The tests print how many verified samples it took. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <sodium.h>

#include "cluster.h"
#include "fake_peer.h"
#include "fu_clock.h"

#include "db.h"
#include "peer_faults.h"
#include "peer_verify.h"

#define VERIFY_OPTS "--checkpoint-every 2 --verify 1.0"

static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* Lines of the broker log `bl` about job id's stage `stage` that contain `what`. */
static int lines_with(const char *bl, const char *id, int stage, const char *what)
{
    char needle[96];
    snprintf(needle, sizeof needle, "job %s stage %d step", id, stage);
    int n = 0;
    for (const char *p = strstr(bl, needle); p; p = strstr(p + 1, needle)) {
        const char *eol = strchr(p, '\n');
        const char *w = strstr(p, what);
        if (w && (!eol || w < eol))
            n++;
    }
    return n;
}

/* Events of kind `kind` of job id in the cluster's store whose detail starts with "stage S " (and
 * that name peer `key`, unless it is NULL). */
static int peer_events_of(const tu_cluster *c, const char *id, const char *kind, int stage, const char *key)
{
    char dbp[TU_PATH], pre[32];
    tu_path(c, dbp, "store.db");
    snprintf(pre, sizeof pre, "stage %d ", stage);
    db_t *db = NULL;
    assert_int_equal(db_open(dbp, &db), FU_OK);
    db_event *ev = NULL;
    size_t n = 0;
    assert_int_equal(db_event_list(db, id, 0, 0, &ev, &n), FU_OK);
    int k = 0;
    for (size_t i = 0; i < n; i++)
        k += strcmp(ev[i].kind, kind) == 0 && ev[i].detail && strncmp(ev[i].detail, pre, strlen(pre)) == 0 &&
             (!key || strcmp(ev[i].peer, key) == 0);
    db_event_array_free(&ev, n);
    db_close(&db);
    return k;
}

static int events_of(const tu_cluster *c, const char *id, const char *kind, int stage)
{
    return peer_events_of(c, id, kind, stage, NULL);
}

/* Input-mismatch events of job id's stage 1 that name p<i> as the stage's peer. */
static int mismatches_of(const tu_cluster *c, const char *id, int i)
{
    char key[41], name[16];
    snprintf(name, sizeof name, "p%d", i);
    tu_key_public(c, name, key);
    return peer_events_of(c, id, "input-mismatch", 1, key);
}

/* Reputation of peer p<i> in the store of c. */
static double reputation_of(const tu_cluster *c, int i)
{
    char key[41], name[16], dbp[TU_PATH];
    snprintf(name, sizeof name, "p%d", i);
    tu_key_public(c, name, key);
    tu_path(c, dbp, "store.db");
    db_t *db = NULL;
    assert_int_equal(db_open(dbp, &db), FU_OK);
    db_peer *dp = NULL;
    assert_int_equal(db_peer_get(db, key, &dp), FU_OK);
    double r = dp->reputation;
    db_peer_free(&dp);
    db_close(&db);
    return r;
}

/* The job's state in the store. */
static db_job_state job_state(const tu_cluster *c, const char *id)
{
    char dbp[TU_PATH];
    tu_path(c, dbp, "store.db");
    db_t *db = NULL;
    assert_int_equal(db_open(dbp, &db), FU_OK);
    db_job *j = NULL;
    assert_int_equal(db_job_get(db, id, NULL, &j), FU_OK);
    db_job_state st = j->state;
    db_job_free(&j);
    db_close(&db);
    return st;
}

static void test_verify_sketch_properties(void **state)
{
    (void)state;
    enum { N = 1000 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    double sq = 0;
    for (int i = 0; i < N; i++) {
        x[i] = (float)sin(0.37 * i) * 3.0f;
        y[i] = 1.5f * x[i];
        sq += (double)x[i] * x[i];
    }
    double a[WIRE_VERIFY_SKETCH_K], b[WIRE_VERIFY_SKETCH_K], c[WIRE_VERIFY_SKETCH_K], d[WIRE_VERIFY_SKETCH_K];
    double na, nb, nc, nd;
    peer_verify_sketch(x, N, 77, a, &na);
    peer_verify_sketch(x, N, 77, b, &nb);
    peer_verify_sketch(y, N, 77, c, &nc);
    peer_verify_sketch(x, N, 78, d, &nd);
    assert_true(fabs(na - sqrt(sq)) <= 1e-9 * na);
    assert_true(fabs(nc - 1.5 * na) <= 1e-6 * nc);
    int differ = 0;
    for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++) {
        assert_true(a[i] == b[i]);                                  /* deterministic */
        assert_true(fabs(c[i] - 1.5 * a[i]) <= 1e-5 * na);         /* linear */
        assert_true(fabs(a[i]) <= na * sqrt((double)N) + 1e-9);     /* |<x, r>| <= |x| |r| */
        differ += fabs(a[i] - d[i]) > 1e-3 * na;                    /* the seed matters */
    }
    assert_true(differ >= WIRE_VERIFY_SKETCH_K / 2);
    /* A small relative change stays far inside the broker's tolerance only when it is tiny. */
    x[3] += 1e-6f;
    peer_verify_sketch(x, N, 77, b, &nb);
    for (int i = 0; i < WIRE_VERIFY_SKETCH_K; i++)
        assert_true(fabs(a[i] - b[i]) <= 1e-3 * na);
    free(x);
    free(y);
}

/* The sealed chunks of a delivered input (docs/PROTOCOL.md "Verification inputs"): a 2.5 MiB input in
 * three chunks fed out of order comes back exactly; a chunk sealed to another key, one whose sealed
 * header names another sample, a duplicate, bad geometry, an input over the budget and an
 * `unavailable` message are refused; the oldest input in progress makes room for new ones. */
static void test_verify_input_chunks(void **state)
{
    (void)state;
    uint8_t pk[crypto_box_PUBLICKEYBYTES], sk[crypto_box_SECRETKEYBYTES], pk2[crypto_box_PUBLICKEYBYTES],
        sk2[crypto_box_SECRETKEYBYTES];
    crypto_box_keypair(pk, sk);
    crypto_box_keypair(pk2, sk2);
    const size_t total = (5u << 20) / 2;
    uint8_t *data = malloc(total);
    assert_non_null(data);
    randombytes_buf(data, total);
    peer_vin_id id = {.job_id = 0x1234, .stage = 2, .step = 6, .micro_batch = 1, .seed = 99};
    uint64_t nch = peer_vin_chunks(total);
    assert_int_equal(nch, 3);
    uint8_t *ct[3];
    size_t ct_len[3];
    for (uint64_t i = 0; i < nch; i++)
        assert_int_equal(peer_vin_seal(&id, pk, data, total, i, &ct[i], &ct_len[i]), FU_OK);
    assert_int_equal(ct_len[2], total - 2 * WIRE_VERIFY_INPUT_CHUNK + WIRE_VERIFY_INPUT_OVERHEAD);
    uint8_t *bad = NULL;
    size_t bad_len = 0;
    assert_int_equal(peer_vin_seal(&id, pk, data, total, 3, &bad, &bad_len), FU_EINVAL); /* past the last */
    Fusion__VerifyInput vi = FUSION__VERIFY_INPUT__INIT;
    vi.job_id = id.job_id;
    vi.stage_index = id.stage;
    vi.step = id.step;
    vi.micro_batch = id.micro_batch;
    vi.seed = id.seed;
    vi.verifier_key.data = pk;
    vi.verifier_key.len = sizeof pk;
    vi.total_bytes = total;
    vi.chunk_count = (uint32_t)nch;
#define CHUNK(i)                                                                                                      \
    do {                                                                                                              \
        vi.chunk_index = (i);                                                                                         \
        vi.offset = (uint64_t)(i) * WIRE_VERIFY_INPUT_CHUNK;                                                          \
        vi.payload.data = ct[i];                                                                                      \
        vi.payload.len = ct_len[i];                                                                                   \
    } while (0)
    peer_vin_asm_t *a = peer_vin_asm_new(8u << 20);
    bool done = false;
    fu_errmsg em = {{0}};
    peer_vin_id got_id;
    uint8_t *got = NULL;
    size_t got_len = 0;
    assert_int_equal(peer_vin_asm_take(a, &got_id, &got, &got_len), FU_EAGAIN);
    CHUNK(2);
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk2, sk2, &done, &em), FU_EAUTH); /* not our key */
    printf("another key: %s\n", em.msg);
    vi.seed = 100; /* the message says another sample than the sealed header */
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_EAUTH);
    printf("another sample: %s\n", em.msg);
    vi.seed = id.seed;
    vi.offset = 0; /* geometry that does not fit the index */
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_EPROTO);
    printf("bad offset: %s\n", em.msg);
    CHUNK(2);
    vi.payload.len--;
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_EPROTO);
    CHUNK(2);
    vi.chunk_count = 4;
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_EPROTO);
    vi.chunk_count = (uint32_t)nch;
    CHUNK(2);
    vi.unavailable = (char *)"gone";
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_EINVAL);
    vi.unavailable = (char *)"";
    /* The genuine chunks, out of order, with a duplicate in between. */
    CHUNK(2);
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_OK);
    assert_false(done);
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_EPROTO);
    printf("duplicate: %s\n", em.msg);
    CHUNK(0);
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_OK);
    assert_false(done);
    CHUNK(1);
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_OK);
    assert_true(done);
    assert_int_equal(peer_vin_asm_take(a, &got_id, &got, &got_len), FU_OK);
    assert_int_equal(got_len, total);
    assert_memory_equal(got, data, total);
    assert_int_equal(got_id.seed, id.seed);
    assert_int_equal(got_id.stage, id.stage);
    free(got);
    assert_int_equal(peer_vin_asm_take(a, &got_id, &got, &got_len), FU_EAGAIN);
    peer_vin_asm_destroy(&a);
    assert_null(a);
    /* Over the budget. */
    a = peer_vin_asm_new(1u << 20);
    CHUNK(0);
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_ENOMEM);
    printf("over budget: %s\n", em.msg);
    peer_vin_asm_destroy(&a);
    /* More inputs in progress than slots (or than the budget holds): the oldest is dropped. */
    a = peer_vin_asm_new(total * PEER_VIN_SLOTS);
    for (uint64_t s = 0; s <= PEER_VIN_SLOTS; s++) {
        peer_vin_id o = id;
        o.seed = 1000 + s;
        uint8_t *c0 = NULL;
        size_t l0 = 0;
        assert_int_equal(peer_vin_seal(&o, pk, data, total, 0, &c0, &l0), FU_OK);
        vi.seed = o.seed;
        vi.chunk_index = 0;
        vi.offset = 0;
        vi.payload.data = c0;
        vi.payload.len = l0;
        assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_OK);
        assert_false(done);
        free(c0);
    }
    /* seed 1000 was dropped: its chunk 0 is accepted again as a new input, not as a duplicate */
    peer_vin_id o = id;
    o.seed = 1000;
    uint8_t *c0 = NULL;
    size_t l0 = 0;
    assert_int_equal(peer_vin_seal(&o, pk, data, total, 0, &c0, &l0), FU_OK);
    vi.seed = o.seed;
    vi.payload.data = c0;
    vi.payload.len = l0;
    assert_int_equal(peer_vin_asm_feed(a, &vi, pk, sk, &done, &em), FU_OK);
    free(c0);
    peer_vin_asm_destroy(&a);
#undef CHUNK
    for (uint64_t i = 0; i < nch; i++)
        free(ct[i]);
    free(data);
}

/* Waits for an Error answering a message of type `about`; its text (static) or NULL. */
static const char *expect_error(tu_client *cl, Fusion__MsgType about, Fusion__ErrorCode code)
{
    static char text[512];
    for (uint64_t end = fu_clock_ms() + 3000; fu_clock_ms() < end;) {
        wire_msg_t *m = tu_client_recv(cl, 500);
        if (!m)
            continue;
        const Fusion__Error *e = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        bool hit = e && e->in_reply_to == about;
        if (hit) {
            assert_int_equal(e->code, code);
            snprintf(text, sizeof text, "%s", e->message);
        }
        wire_msg_destroy(&m);
        if (hit)
            return text;
    }
    return NULL;
}

/* A registered peer (this test speaking the protocol) sends the broker malformed or unsolicited
 * verification messages: each is refused with a sentence, or dropped when it names no sample in
 * flight; a relayed control message is refused; the broker answers heartbeats all along and stops
 * cleanly with no sanitizer report. */
static void test_verify_broker_refuses_bad_messages(void **state)
{
    (void)state;
    tu_opts o = tu_opts_broker_alone();
    o.model_args = NULL;
    tu_cluster *c = tu_cluster_new("verify-bad", &o);
    tu_keygen(c, "peer", true);
    tu_broker_start(c);
    tu_client cl;
    tu_client_open(&cl, c, "peer");
    assert_true(tu_client_wait_up(&cl, 10000));
    tu_client_hello(&cl, "bad", 1ull << 30, 10);
    wire_msg_t *m = NULL;
    for (uint64_t end = fu_clock_ms() + 5000; !m && fu_clock_ms() < end;) {
        m = tu_client_recv(&cl, 500);
        if (m && wire_msg_type(m) != FUSION__MSG_TYPE__MSG_PEER_WELCOME)
            wire_msg_destroy(&m);
    }
    assert_non_null(m);
    wire_msg_destroy(&m);
    uint8_t key[WIRE_KEY_BYTES] = {9}, payload[64] = {0};
    Fusion__VerifyInput vi = FUSION__VERIFY_INPUT__INIT;
    vi.job_id = 0x77;
    vi.stage_index = 0; /* stage 0 has no upstream */
    vi.verifier_key.data = key;
    vi.verifier_key.len = sizeof key;
    vi.total_bytes = 16;
    vi.chunk_count = 1;
    vi.payload.data = payload;
    vi.payload.len = sizeof payload;
    assert_int_equal(tu_client_send(&cl, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, 0x77, &vi.base), FU_OK);
    const char *why = expect_error(&cl, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, FUSION__ERROR_CODE__ERR_INVALID);
    assert_non_null(why);
    printf("VerifyInput for stage 0: %s\n", why);
    vi.stage_index = 1;
    vi.verifier_key.len = 5; /* not a key */
    assert_int_equal(tu_client_send(&cl, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, 0x77, &vi.base), FU_OK);
    assert_non_null(expect_error(&cl, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, FUSION__ERROR_CODE__ERR_INVALID));
    vi.stage_index = 100000; /* out of range */
    vi.verifier_key.len = sizeof key;
    assert_int_equal(tu_client_send(&cl, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, 0x77, &vi.base), FU_OK);
    assert_non_null(expect_error(&cl, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, FUSION__ERROR_CODE__ERR_INVALID));
    /* Well-formed but about no sample in flight: dropped (a late delivery is normal). */
    vi.stage_index = 1;
    vi.unavailable = (char *)"not held";
    assert_int_equal(tu_client_send(&cl, FUSION__MSG_TYPE__MSG_VERIFY_INPUT, 0x77, &vi.base), FU_OK);
    double sk[WIRE_VERIFY_SKETCH_K] = {0};
    Fusion__VerifySketch vs = FUSION__VERIFY_SKETCH__INIT;
    vs.job_id = 0x77;
    vs.stage_index = 3;
    vs.n_sketch = 3; /* wrong length, and no sample */
    vs.sketch = sk;
    assert_int_equal(tu_client_send(&cl, FUSION__MSG_TYPE__MSG_VERIFY_SKETCH, 0x77, &vs.base), FU_OK);
    /* Broker-bound only: VerifyDeliver and VerifyRequest come from the broker, not to it. */
    Fusion__VerifyDeliver vd = FUSION__VERIFY_DELIVER__INIT;
    vd.stage_index = 1;
    assert_int_equal(tu_client_send(&cl, FUSION__MSG_TYPE__MSG_VERIFY_DELIVER, 0x77, &vd.base), FU_OK);
    why = expect_error(&cl, FUSION__MSG_TYPE__MSG_VERIFY_DELIVER, FUSION__ERROR_CODE__ERR_UNKNOWN_TYPE);
    assert_non_null(why);
    printf("VerifyDeliver to the broker: %s\n", why);
    /* A control message relayed to a peer (here: to itself) would look like the broker's word. */
    Fusion__VerifyRequest vr = FUSION__VERIFY_REQUEST__INIT;
    vr.stage_index = 1;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_VERIFY_REQUEST, .job_id = 0x77, .sequence = ++cl.seq,
                  .relay_to = wire_keypair_public_z85(cl.kp)};
    assert_int_equal(wire_send(cl.sock, NULL, 0, &h, &vr.base), FU_OK);
    why = expect_error(&cl, FUSION__MSG_TYPE__MSG_VERIFY_REQUEST, FUSION__ERROR_CODE__ERR_INVALID);
    assert_non_null(why);
    printf("relayed VerifyRequest: %s\n", why);
    /* Still serving. */
    Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
    m = tu_client_call(&cl, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base, FUSION__MSG_TYPE__MSG_HEARTBEAT, 3000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_HEARTBEAT);
    wire_msg_destroy(&m);
    tu_client_close(&cl);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Two stages (3 peers, one backup: a verifier of stage 0), verify 1.0 over honest peers. */
static void test_verify_honest_peers_agree(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(3, 1);
    tu_cluster *c = tu_cluster_new("verify-honest", &o);
    tu_cluster_start(c);
    const char *common = "--rank 4 --steps 12 --batch 4 --seq-len 16 --lr 0.01 --micro-batches 2";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s " VERIFY_OPTS, common);
    tu_wait_done(c, id, 90);
    assert_true(tu_broker_logged(c, "job %s stage 0/2 on", id)); /* a two-stage pipeline */
    char *bl = tu_broker_log_text(c);
    int agree = lines_with(bl, id, 0, ": agree ("), disagree = count_of(bl, "DISAGREE"),
        skipped = count_of(bl, "sample skipped"), mismatch = count_of(bl, "INPUT MISMATCH");
    printf("job %s: %d samples of stage 0 agreed, %d disagreed, %d input mismatches, %d skipped (12 steps x 2 "
           "micro-batches, every step eligible (odd steps from snapshots): 24 possible per stage; the one backup "
           "verifies stage 0)\n", id,
           agree, disagree, mismatch, skipped);
    if (agree == 0 || disagree != 0)
        tu_file_show(tu_broker_log(c), 40);
    free(bl);
    assert_int_equal(disagree, 0);
    assert_int_equal(mismatch, 0);
    assert_true(agree >= 12); /* most samples ran (a few may find the backup still warming up) */
    /* steps without a checkpoint were verified too, from the stage's snapshot */
    char odd[96];
    snprintf(odd, sizeof odd, "job %s stage 0 step 3 mb 0: agree", id);
    assert_true(tu_broker_logged(c, "%s", odd));
    assert_int_equal(events_of(c, id, "verified", 0), agree); /* the store records them */
    /* Verification changed nothing in the result. */
    tu_assert_same_adapter(c, id, "model", common);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Honest peers that read their VerifyRequests late (the test-only hook FUSION_TEST_VERIFY_LATE: a
 * stage's peer answers only once it has moved 3 steps past the sampled step, as on a loaded machine):
 * they no longer hold most of what is asked for and say so. The broker's records (the last stage's
 * StepDones) show the pipeline can have moved that far: every such sample is skipped, nobody is
 * blamed ("withheld"), nobody loses reputation, and the job finishes. Stage 0's answers wait for the
 * last stage's StepDone (another connection); the last stage's are judged at once. */
static void test_verify_late_answers_not_blamed(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(4, 2);
    o.verify_late = true;
    tu_cluster *c = tu_cluster_new("verify-late", &o);
    tu_cluster_start(c);
    char id[17];
    tu_submit_finetune(c, id, "model", "--rank 4 --steps 10 --batch 4 --seq-len 16 --lr 0.01 --micro-batches 2 "
                       "--checkpoint-every 5 --verify 1.0");
    tu_wait_done(c, id, 120);
    assert_true(tu_broker_logged(c, "job %s stage 0/2 on", id)); /* a two-stage pipeline */
    char *bl = tu_broker_log_text(c);
    int moved = count_of(bl, "no longer holds it, and the pipeline can have moved on"),
        withheld = count_of(bl, "WITHHELD"), agree = count_of(bl, ": agree (");
    printf("job %s: %d samples skipped as moved past (a peer keeps 3 steps), %d withheld, %d agreed\n", id, moved,
           withheld, agree);
    if (withheld || moved == 0)
        tu_file_show(tu_broker_log(c), 60);
    free(bl);
    assert_int_equal(withheld, 0);
    assert_true(moved >= 1);
    for (int i = 0; i < 4; i++) {
        double r = reputation_of(c, i);
        printf("p%d: reputation %.2f\n", i, r);
        assert_true(r >= 0.999);
    }
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Once every stage of job id is ready, peer pI starts to cheat (the hook's file DIR/corrupt.pI). */
static void corrupt_once_ready(const tu_cluster *c, const char *id, int i)
{
    assert_true(tu_broker_wait_log(c, 30000, "job %s: every stage is ready", id));
    char flag[TU_PATH];
    tu_path(c, flag, "corrupt.p%d", i);
    FILE *f = fopen(flag, "w");
    assert_non_null(f);
    fclose(f);
}

/* A dishonest stage-`stage` peer of a `n_stages`-stage job: armed once every stage is ready, caught
 * after a few disagreeing samples, released, its stage failed over, never assigned again; the job
 * finishes. Returns the cheater's index. */
static int catch_cheater(tu_cluster *c, const char *id, int stage, int n_stages)
{
    char needle[200];
    int cheat = tu_stage_peer(c, id, stage, 30000);
    assert_true(tu_broker_logged(c, "job %s stage %d/%d on ", id, stage, n_stages));
    /* Once the job runs, the stage's peer starts to cheat (its outputs x 1.5). */
    corrupt_once_ready(c, id, cheat);
    printf("p%d (stage %d of %d) now cheats (%s)\n", cheat, stage, n_stages, tu_cluster_opts(c)->corrupt_mode);
    /* `fusion status` tells the tally while the job runs (once there is one). */
    bool tallied = false, ran = false;
    tu_status st;
    for (uint64_t end = fu_clock_ms() + 20000; !tallied && fu_clock_ms() < end; fu_sleep_ms(50)) {
        if (!tu_status_get(c, id, &st))
            continue;
        if (strcmp(st.state, "running") != 0 && strcmp(st.state, "queued") != 0)
            break;
        ran = ran || strstr(st.message, "running on ") != NULL;
        tallied = strstr(st.message, "verified samples: ") && !strstr(st.message, "samples: 0 agreed, 0 disagreed");
    }
    printf("fusion status: %s\n", tallied ? st.message : "(the job ended before a status showed the tally)");
    assert_true(tallied || !ran);
    tu_wait_done(c, id, 100);
    char *bl = tu_broker_log_text(c);
    snprintf(needle, sizeof needle, "(p%d) is below the reputation threshold", cheat);
    const char *det = strstr(bl, needle);
    if (!det)
        tu_file_show(tu_broker_log(c), 40);
    assert_non_null(det);
    unsigned failed = 0, checked = 0;
    const char *after = strstr(det, "after ");
    assert_non_null(after);
    assert_int_equal(sscanf(after, "after %u disagreeing samples of %u verified", &failed, &checked), 2);
    printf("p%d was caught after %u disagreeing samples (%u of its samples verified in all)\n", cheat, failed,
           checked);
    assert_true(failed >= 1 && failed <= 4);
    snprintf(needle, sizeof needle, "job %s: stage %d moved from", id, stage);
    assert_non_null(strstr(bl, needle)); /* its stage failed over to a backup */
    /* It got no more work after the detection: its own log shows the one assignment it cheated in. */
    snprintf(needle, sizeof needle, "(p%d) is a warm backup", cheat);
    assert_null(strstr(det, needle));
    free(bl);
    char plog[TU_PATH];
    tu_path(c, plog, "p%d.log", cheat);
    char *pl = tu_file_text(plog);
    int assigned = count_of(pl, ": assigned stage ");
    free(pl);
    printf("p%d was assigned %d stage(s) in all\n", cheat, assigned);
    assert_int_equal(assigned, 1);
    assert_true(reputation_of(c, cheat) < 0.2);
    assert_int_equal(job_state(c, id), DB_JOB_DONE);
    return cheat;
}

/* Starts the cluster of o (its corrupt_mode set), runs the verification tests' job of `steps` steps on
 * it and catches its stage-0 peer cheating (catch_cheater) in a job of n_stages; *cheat: that peer. */
static tu_cluster *cheating_job(const char *tag, const tu_opts *o, int n_stages, int steps, int *cheat)
{
    tu_cluster *c = tu_cluster_new(tag, o);
    tu_cluster_start(c);
    char id[17];
    tu_submit_finetune(c, id, "model", "--rank 4 --steps %d --batch 4 --seq-len 16 --lr 0.01 --micro-batches 2 "
                       VERIFY_OPTS, steps);
    *cheat = catch_cheater(c, id, 0, n_stages);
    return c;
}

/* Two stages with a dishonest stage-0 peer. n_peers = 3: one backup (stage 0's verifier), no third
 * opinion (the verifier loses a little too); 5: three backups, two of them for stage 0 (the broker
 * gives every stage one before any gets a second; ties go to the lower stage), so the second settles
 * each disagreement and the honest verifier keeps its reputation. */
static void dishonest(int n_peers)
{
    tu_opts o = tu_opts_two_stage(n_peers, n_peers > 3 ? 3 : 1);
    o.corrupt_mode = "scale";
    int cheat = -1;
    tu_cluster *c = cheating_job(n_peers > 3 ? "verify-cheat3" : "verify-cheat", &o, 2, 60, &cheat);
    char *bl = tu_broker_log_text(c);
    int thirds = count_of(bl, "for a third opinion"), sided = count_of(bl, "sides with the verifier");
    free(bl);
    printf("%d peers: %d disagreements went to a third opinion, %d sided with the verifier\n", n_peers, thirds,
           sided);
    if (n_peers > 3)
        assert_true(thirds >= 1 && sided >= 1);
    else
        assert_int_equal(thirds, 0);
    double worst_honest = 1;
    for (int i = 0; i < n_peers; i++) {
        double r = reputation_of(c, i);
        printf("p%d: reputation %.2f in the store%s\n", i, r, i == cheat ? " (the dishonest one)" : "");
        if (i != cheat && r < worst_honest)
            worst_honest = r;
    }
    if (n_peers > 3)
        assert_true(worst_honest >= 0.999); /* the third opinion sided with the honest verifier */
    else
        assert_true(worst_honest >= 0.7 && worst_honest < 1); /* no third opinion: the verifier paid a little */
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_verify_dishonest_peer_is_caught(void **state)
{
    (void)state;
    dishonest(3);
}

static void test_verify_dishonest_peer_third_opinion(void **state)
{
    (void)state;
    dishonest(5);
}

/* A stage-0 peer whose output is one unit in the last place off (the first value of each output):
 * within any tolerance a sketch could use, so only the exact comparison catches it. The peers share
 * one numeric class (this machine, this build), so the broker compares output hashes. */
static void test_verify_last_bit_cheater(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(3, 1);
    o.corrupt_mode = "nudge";
    int cheat = -1;
    tu_cluster *c = cheating_job("verify-nudge", &o, 2, 60, &cheat);
    char *bl = tu_broker_log_text(c);
    printf("%d samples agreed with the same bits, %d disagreed with other bits\n", count_of(bl, "agree (same bits"),
           count_of(bl, "DISAGREE (other bits"));
    assert_true(count_of(bl, "DISAGREE (other bits") >= 1);
    assert_true(count_of(bl, "within tolerance") == 0 && count_of(bl, "beyond tolerance") == 0);
    free(bl);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A job on a single stage: the whole (small) model fits one peer, the other is its verifier. Its
 * verified output is each micro-batch's loss (it sends nothing else); a peer that reports scaled
 * losses is caught like any other, and the job finishes on the verifier. A single stage of the small
 * model steps faster than its verifier answers, so most samples are skipped (the peer has moved
 * WIRE_VERIFY_KEEP_STEPS on: 55 of 62 on a quiet machine): the job has 240 steps, so that on a loaded
 * one it still lasts until the third disagreement. */
static void test_verify_single_stage_cheater(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(2);
    o.model_args = TU_SMALL_MODEL_ARGS;
    o.peer_memory_gb = NULL; /* no cap: one stage */
    o.backups = 1;
    o.heartbeat_ms = 300;
    o.corrupt_mode = "scale";
    int cheat = -1;
    tu_cluster *c = cheating_job("verify-solo", &o, 1, 240, &cheat);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The three-stage cluster: the e2e model over 6 peers, 3 running the stages and 3 warm backups (one
 * per stage: every stage has a verifier). */
static tu_cluster *three_stages(const char *tag, const char *corrupt_mode)
{
    tu_opts o = tu_opts_default(6);
    o.backups = 3;
    o.heartbeat_ms = 300;
    o.corrupt_mode = corrupt_mode;
    tu_cluster *c = tu_cluster_new(tag, &o);
    tu_cluster_start(c);
    return c;
}

/* Every stage of a three-stage job verified over honest peers: stages 1 and 2 get their inputs from
 * the upstream peer through the broker, sealed to the verifier, and agree; so does stage 0; the
 * store records each; the adapter equals `fusion run finetune`'s. */
static void test_verify_every_stage_honest(void **state)
{
    (void)state;
    tu_cluster *c = three_stages("verify-stages", NULL);
    const char *train = TU_TRAIN_ARGS " --steps 12 --micro-batches 2";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s " VERIFY_OPTS, train);
    tu_wait_done(c, id, 100);
    char needle[160];
    char *bl = tu_broker_log_text(c);
    snprintf(needle, sizeof needle, "job %s stage 2/3 on", id);
    bool three = strstr(bl, needle) != NULL;
    for (int s = 0; s < 3; s++) {
        snprintf(needle, sizeof needle, "is a warm backup for stage %d", s);
        three = three && strstr(bl, needle);
    }
    if (!three)
        tu_file_show(tu_broker_log(c), 40);
    assert_true(three); /* three stages, a warm backup (verifier) for each */
    int agree[3], disagree = count_of(bl, "DISAGREE"), mismatch = count_of(bl, "INPUT MISMATCH"),
                  skipped = count_of(bl, "sample skipped");
    for (int s = 0; s < 3; s++)
        agree[s] = lines_with(bl, id, s, ": agree (");
    printf("job %s: samples agreed per stage %d / %d / %d, %d disagreed, %d input mismatches, %d skipped (24 "
           "possible per stage)\n", id, agree[0], agree[1], agree[2], disagree, mismatch, skipped);
    if (disagree || mismatch || agree[1] < 4 || agree[2] < 4)
        tu_file_show(tu_broker_log(c), 60);
    free(bl);
    assert_int_equal(disagree, 0);
    assert_int_equal(mismatch, 0);
    for (int s = 0; s < 3; s++) {
        assert_true(agree[s] >= 4); /* most samples ran (a few find a backup still warming up) */
        assert_int_equal(events_of(c, id, "verified", s), agree[s]);
    }
    for (int i = 0; i < tu_cluster_n_peers(c); i++)
        assert_true(reputation_of(c, i) >= 0.999);
    tu_assert_same_adapter(c, id, "model", train);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A dishonest middle stage (stage 1 of 3): caught, released, failed over, no more work; the job
 * finishes. Stage 2 computes on the corrupted activations, but its inputs match what the cheater
 * delivers to stage 2's verifier, so its samples agree and it loses nothing. */
static void test_verify_middle_stage_cheater(void **state)
{
    (void)state;
    tu_cluster *c = three_stages("verify-middle", "scale");
    char id[17];
    tu_submit_finetune(c, id, "model", TU_TRAIN_ARGS " --steps 60 --micro-batches 2 " VERIFY_OPTS);
    int stage2 = tu_stage_peer(c, id, 2, 30000);
    int cheat = catch_cheater(c, id, 1, 3);
    char *bl = tu_broker_log_text(c);
    int dis[3], agree2 = lines_with(bl, id, 2, ": agree ("), mismatch = count_of(bl, "INPUT MISMATCH");
    for (int s = 0; s < 3; s++)
        dis[s] = lines_with(bl, id, s, "DISAGREE");
    printf("job %s: disagreements per stage %d / %d / %d; stage 2 agreed %d times; %d input mismatches\n", id, dis[0],
           dis[1], dis[2], agree2, mismatch);
    free(bl);
    assert_int_equal(dis[0], 0);
    assert_int_equal(dis[2], 0);
    assert_true(dis[1] >= 1);
    assert_true(agree2 >= 1);
    assert_int_equal(mismatch, 0);
    for (int i = 0; i < tu_cluster_n_peers(c); i++) {
        double r = reputation_of(c, i);
        printf("p%d: reputation %.2f%s\n", i, r, i == cheat ? " (the dishonest one)" : i == stage2 ? " (stage 2)" : "");
        if (i != cheat)
            assert_true(r >= 0.7); /* at most stage 1's verifier paid 0.05 per disagreement */
    }
    assert_true(reputation_of(c, stage2) >= 0.999);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A stage-0 peer that lies: it sends scaled activations to stage 1 but keeps (and sketches, and
 * delivers to stage 1's verifier) the honest ones. Its own samples agree; every sample of stage 1
 * finds that the input stage 1 says it received is not the one the upstream delivered: an input
 * mismatch, inconclusive (no disagreement counted), recorded as an "input-mismatch" event, and both
 * peers lose 0.05. The broker cannot tell which of the two lied, so both sink together after
 * enough mismatches (the documented price for the honest one, split between stage 1's holders if
 * it changed hands), both stages fail over, and the job still finishes. */
static void test_verify_input_mismatch(void **state)
{
    (void)state;
    tu_cluster *c = three_stages("verify-lie", "lie");
    char id[17], needle[160];
    tu_submit_finetune(c, id, "model", TU_TRAIN_ARGS " --steps 80 --micro-batches 2 " VERIFY_OPTS);
    int liar = tu_stage_peer(c, id, 0, 30000), next = tu_stage_peer(c, id, 1, 30000);
    corrupt_once_ready(c, id, liar);
    printf("p%d (stage 0) now sends scaled activations to p%d (stage 1) but keeps the honest ones\n", liar, next);
    tu_wait_done(c, id, 150);
    char *bl = tu_broker_log_text(c);
    int mism = lines_with(bl, id, 1, "INPUT MISMATCH"), dis1 = lines_with(bl, id, 1, "DISAGREE"),
        dis0 = lines_with(bl, id, 0, "DISAGREE");
    int events = events_of(c, id, "input-mismatch", 1);
    printf("job %s: %d input mismatches at stage 1 (%d events), %d disagreements at stage 1, %d at stage 0\n", id, mism,
           events, dis1, dis0);
    snprintf(needle, sizeof needle, "(p%d) is below the reputation threshold", liar);
    bool liar_out = strstr(bl, needle) != NULL;
    snprintf(needle, sizeof needle, "job %s: stage 0 moved from", id);
    bool moved0 = strstr(bl, needle) != NULL;
    if (!liar_out || !moved0 || mism < 1)
        tu_file_show(tu_broker_log(c), 60);
    free(bl);
    assert_true(mism >= 17); /* 1.0 - 17 x 0.05 < 0.2 */
    assert_int_equal(events, mism);
    assert_int_equal(dis0, 0); /* its own sketches are of the honest copies */
    assert_int_equal(dis1, 0); /* inconclusive, never a disagreement */
    assert_true(liar_out);
    assert_true(moved0);
    /* Each mismatch costs the liar and the peer that held stage 1 then 0.05 each. That is p<next>
     * throughout, unless stage 1 changed hands (a busy machine can make its peer miss heartbeats):
     * then the collateral is split between the holders and none of them need sink. */
    double rl = reputation_of(c, liar), rn = reputation_of(c, next);
    int charged = 0;
    printf("p%d (the liar): reputation %.2f; p%d (its honest downstream): %.2f, %d mismatches charged\n", liar, rl,
           next, rn, mismatches_of(c, id, next));
    assert_true(rl < 0.2);
    assert_true(fabs(rl - fmax(0, 1 - 0.05 * mism)) < 1e-6);
    for (int i = 0; i < tu_cluster_n_peers(c); i++) {
        if (i == liar)
            continue;
        int m = mismatches_of(c, id, i);
        double r = reputation_of(c, i);
        if (m && i != next)
            printf("p%d held stage 1 for %d mismatches: reputation %.2f\n", i, m, r);
        assert_true(fabs(r - fmax(0, 1 - 0.05 * m)) < 1e-6); /* charged exactly for its own mismatches */
        charged += m;
    }
    assert_int_equal(charged, mism);
    assert_true(mismatches_of(c, id, next) >= 1);
    if (mismatches_of(c, id, next) == mism)
        assert_true(rn < 0.2); /* the documented collateral: the broker cannot tell which of the two lied */
    assert_int_equal(job_state(c, id), DB_JOB_DONE);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_verify_sketch_properties),
        cmocka_unit_test(test_verify_input_chunks),
        cmocka_unit_test_teardown(test_verify_broker_refuses_bad_messages, tu_teardown),
        cmocka_unit_test_teardown(test_verify_honest_peers_agree, tu_teardown),
        cmocka_unit_test_teardown(test_verify_late_answers_not_blamed, tu_teardown),
        cmocka_unit_test_teardown(test_verify_dishonest_peer_is_caught, tu_teardown),
        cmocka_unit_test_teardown(test_verify_dishonest_peer_third_opinion, tu_teardown),
        cmocka_unit_test_teardown(test_verify_single_stage_cheater, tu_teardown),
        cmocka_unit_test_teardown(test_verify_last_bit_cheater, tu_teardown),
        cmocka_unit_test_teardown(test_verify_every_stage_honest, tu_teardown),
        cmocka_unit_test_teardown(test_verify_middle_stage_cheater, tu_teardown),
        cmocka_unit_test_teardown(test_verify_input_mismatch, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
