/* Trust among strangers (docs/SECURITY.md), played against the real fusion-broker process by a
 * hostile client and a hostile peer that speak the wire protocol themselves (fake_peer.h):
 * - a poisoned copy of another tenant's model is another model: the victim's peers get the victim's
 *   bytes, hash-checked, and the copy gets its own id;
 * - names outside the model roots are "not found" whether they exist or not;
 * - a model file linked out of the roots, or one that is not safetensors, leaks no byte in the error;
 * - a model changed on disk after its job was submitted fails the job at the next start instead of
 *   training on other bytes (an unchanged one is not hashed again: its hashes are in the store);
 * - a fabricated checkpoint (tensors the job's graph does not have) is refused and costs its sender;
 * - a backlog of PeerHellos of one peer process (after a broker outage) keeps its stage;
 * - a client with a job running waits behind one with none; a flood of submissions meets the
 *   per-minute limit while other clients still get in;
 * - the stages that see tokens stay on peers the allow-list marks trusted;
 * - a peer's claimed speed is capped by its profile challenge; a forged answer or none gets no work;
 * - a stage that reports steps faster than its verified speed allows is flagged;
 * - a stage's peer that withholds its output from verification pays as if it had lied; one whose
 *   pipeline can have moved past the sampled step, by the broker's records, is not blamed (a stage
 *   before the last gets a short wait for the last stage's StepDone, no more);
 * - a stage's peer that cannot load because the broker lost the checkpoint its assignment named keeps
 *   its reputation;
 * - a burst of submissions (each hashing its own 175 MB model) leaves heartbeats answered at once;
 * - 150 rejected submissions over 30 model copies leave the broker's memory flat. */
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
#include <sodium.h>
#include <unistd.h>

#include "cluster.h"
#include "dag_graph.h"
#include "dag_serial.h"
#include "fake_peer.h"
#include "fu_clock.h"
#include "fu_safetensors.h"
#include "testutil.h"

#define GiB (1ull << 30)

/* The Error a submission of spec by cl got (fails the test when it was accepted); its text in buf. */
static Fusion__ErrorCode refused_by(tu_client *cl, const char *spec, char *buf, size_t cap)
{
    wire_msg_t *m = tu_client_submit(cl, spec, NULL);
    assert_non_null(m);
    if (wire_msg_type(m) != FUSION__MSG_TYPE__MSG_ERROR)
        fail_msg("accepted: %s", spec);
    const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
    snprintf(buf, cap, "%s", e->message);
    Fusion__ErrorCode code = e->code;
    wire_msg_destroy(&m);
    if (!strstr(buf, "fewer than batch")) /* the 150 of the memory test say the same */
        print_message("refused: %s\n", buf);
    return code;
}

static Fusion__ErrorCode refused(tu_broker_fx *f, const char *spec, char *buf, size_t cap)
{
    return refused_by(&f->cl, spec, buf, cap);
}

/* A copy of DIR/model as DIR/name, with every tensor byte after the header zeroed when `zero`. */
static void copy_model(tu_broker_fx *f, const char *name, bool zero, char out[TU_PATH])
{
    tu_path(f->c, out, "%s", name);
    char *o = NULL;
    if (tu_sh(&o, "rm -rf '%s' && cp -r '%s' '%s'", out, f->model, out) != 0)
        fail_msg("cp: %s", o);
    free(o);
    if (!zero)
        return;
    char st[TU_PATH];
    tu_path(f->c, st, "%s/model.safetensors", name);
    FILE *fp = fopen(st, "r+b");
    assert_non_null(fp);
    uint64_t hl = 0;
    assert_int_equal(fread(&hl, 8, 1, fp), 1);
    fseek(fp, 0, SEEK_END);
    long end = ftell(fp);
    fseek(fp, (long)(8 + hl), SEEK_SET);
    for (long i = (long)(8 + hl); i < end; i++)
        fputc(0, fp);
    fclose(fp);
}

/* Says PeerHello as peer key_name and waits for its StageAssign: the model id it names (out). */
static void peer_assigned(tu_client *peer, tu_broker_fx *f, const char *key_name, char out[80])
{
    tu_client_open(peer, f->c, key_name);
    tu_client_hello(peer, key_name, 4 * GiB, 50);
    uint64_t end = fu_clock_ms() + 10000;
    while (fu_clock_ms() < end) {
        wire_msg_t *m = tu_client_recv(peer, 500);
        const Fusion__StageAssign *a = m ? wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN) : NULL;
        if (a) {
            snprintf(out, 80, "%s", a->model_id);
            wire_msg_destroy(&m);
            return;
        }
        wire_msg_destroy(&m);
    }
    fail_msg("peer %s got no StageAssign", key_name);
}

/* Tenant "other" submits a copy of "client"'s model with zeroed weights after "client" submitted
 * its job: the copy is another model, and the victim's peer gets the victim's bytes. */
static void test_trust_poisoned_copy_is_another_model(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
    uint64_t victim = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    char poisoned[TU_PATH], spec[9000];
    copy_model(f, "model-copy", true, poisoned);
    tu_finetune_spec(poisoned, spec, sizeof spec);
    tu_client mallory;
    tu_client_open(&mallory, f->c, "other");
    m = tu_client_submit(&mallory, spec, NULL);
    uint64_t attacker = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    assert_true(attacker != victim);
    /* the victim's job (first in the queue) goes to the first peer, the copy's to the second */
    tu_client p0, p1;
    char id0[80], id1[80];
    peer_assigned(&p0, f, "p0", id0);
    peer_assigned(&p1, f, "p1", id1);
    print_message("victim's model %s, the poisoned copy %s\n", id0, id1);
    assert_string_not_equal(id0, id1);
    /* p0 gets exactly the victim's bytes of a tensor, hash-checked; p0 cannot ask for the copy */
    char path[TU_PATH + 32];
    snprintf(path, sizeof path, "%s/model.safetensors", f->model);
    fu_safetensors *st = NULL;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_safetensors_open_file(path, &st, &em), FU_OK);
    const fu_st_tensor *t = fu_safetensors_get(st, "model.norm.weight");
    assert_non_null(t);
    uint8_t *data = NULL;
    size_t len = 0;
    assert_true(tu_client_fetch(&p0, id0, t->name, &data, &len));
    assert_int_equal(len, t->nbytes);
    assert_memory_equal(data, t->data, len);
    free(data);
    assert_false(tu_client_fetch(&p0, id1, t->name, &data, &len));
    /* and the copy's peer gets the zeros it asked for */
    assert_true(tu_client_fetch(&p1, id1, t->name, &data, &len));
    assert_int_equal(len, t->nbytes);
    for (size_t i = 0; i < len; i++)
        assert_int_equal(data[i], 0);
    free(data);
    fu_safetensors_close(&st);
    tu_client_close(&p0);
    tu_client_close(&p1);
    tu_client_close(&mallory);
}

/* A name outside the roots is "not found", with the same words whether it exists or not. */
static void test_trust_outside_roots_not_found(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    static const char *const names[] = {"/etc", "/nonexistent/model", "../../../../etc", "/"};
    char spec[9000], msg[1024], first[1024] = "";
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        tu_finetune_spec(names[i], spec, sizeof spec);
        assert_int_equal(refused(f, spec, msg, sizeof msg), FUSION__ERROR_CODE__ERR_NOT_FOUND);
        char *at = strstr(msg, names[i]); /* the words around the name */
        assert_non_null(at);
        char words[1024];
        snprintf(words, sizeof words, "%.*s%s", (int)(at - msg), msg, at + strlen(names[i]));
        assert_non_null(strstr(words, "not found under the broker's model roots"));
        if (i == 0)
            snprintf(first, sizeof first, "%s", words);
        else
            assert_string_equal(words, first);
    }
    /* a link inside the root that points out of it is no way out */
    char link[TU_PATH];
    tu_path(f->c, link, "etc-link");
    assert_int_equal(symlink("/etc", link), 0);
    tu_finetune_spec(link, spec, sizeof spec);
    assert_int_equal(refused(f, spec, msg, sizeof msg), FUSION__ERROR_CODE__ERR_NOT_FOUND);
    /* a name relative to the root works */
    tu_finetune_spec("model", spec, sizeof spec);
    wire_msg_t *m = tu_client_submit(&f->cl, spec, NULL);
    assert_int_equal(tu_status_of(m)->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
    wire_msg_destroy(&m);
}

/* No error carries bytes of a file: a weights file linked out of the roots is refused before it is
 * read, and a weights file that is not safetensors is reported without its "header length". */
static void test_trust_malformed_weights_leak_nothing(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    static const char secret[] = "SECRET!!the rest of a private file\n";
    uint64_t secret_u64;
    memcpy(&secret_u64, secret, 8);
    char num[32];
    snprintf(num, sizeof num, "%" PRIu64, secret_u64);
    /* the private file lives outside the roots */
    char *outside = tu_tmpdir("trust-outside");
    char priv[TU_PATH];
    snprintf(priv, sizeof priv, "%s/private", outside);
    FILE *fp = fopen(priv, "wb");
    assert_non_null(fp);
    fputs(secret, fp);
    fclose(fp);
    char linked[TU_PATH], path[TU_PATH + 32], spec[9000], msg[1024];
    copy_model(f, "model-linked", false, linked);
    snprintf(path, sizeof path, "%s/model.safetensors", linked);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(symlink(priv, path), 0);
    tu_finetune_spec(linked, spec, sizeof spec);
    assert_int_equal(refused(f, spec, msg, sizeof msg), FUSION__ERROR_CODE__ERR_INVALID);
    assert_non_null(strstr(msg, "link that leaves the broker's model roots"));
    assert_null(strstr(msg, "SECRET"));
    assert_null(strstr(msg, num));
    /* the same bytes as a file inside the root: not safetensors, and still no byte of it shown */
    char garbage[TU_PATH];
    copy_model(f, "model-garbage", false, garbage);
    snprintf(path, sizeof path, "%s/model.safetensors", garbage);
    fp = fopen(path, "wb");
    assert_non_null(fp);
    fputs(secret, fp);
    fclose(fp);
    tu_finetune_spec(garbage, spec, sizeof spec);
    assert_int_equal(refused(f, spec, msg, sizeof msg), FUSION__ERROR_CODE__ERR_INVALID);
    assert_non_null(strstr(msg, "not valid safetensors"));
    assert_null(strstr(msg, "SECRET"));
    assert_null(strstr(msg, num));
    tu_tmpdir_remove(&outside);
}

/* A queued job's model is changed in place while the broker is down: at the next start the job
 * fails, naming the change, instead of training on bytes nobody submitted. */
static void test_trust_model_changed_after_submit(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    char copy[TU_PATH], spec[9000];
    copy_model(f, "model-mutable", false, copy);
    tu_finetune_spec(copy, spec, sizeof spec);
    wire_msg_t *m = tu_client_submit(&f->cl, spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    /* a restart with nothing changed takes the model's hashes from the store instead of hashing it */
    assert_int_equal(tu_broker_stop(f->c, SIGTERM), 0);
    tu_client_close(&f->cl);
    tu_broker_fx_start(f);
    assert_true(tu_broker_wait_log(f->c, 5000, "model-mutable is m:"));
    assert_true(tu_broker_logged(f->c, "known from the store"));
    m = tu_client_job_status(&f->cl, id);
    assert_int_equal(tu_status_of(m)->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
    wire_msg_destroy(&m);
    assert_int_equal(tu_broker_stop(f->c, SIGTERM), 0);
    copy_model(f, "model-mutable", true, copy); /* same names and shapes, other bytes */
    tu_client_close(&f->cl);
    tu_broker_fx_start(f);
    m = tu_client_job_status(&f->cl, id);
    const Fusion__JobStatus *st = tu_status_of(m);
    print_message("after the restart: %s\n", st->message);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_FAILED);
    assert_non_null(strstr(st->message, "changed since it was submitted"));
    wire_msg_destroy(&m);
}

/* A worker that fabricates its checkpoint (one made-up tensor, as the fake peer did): the
 * checkpoint is refused before it is stored, the worker loses reputation and its stage, and the job
 * is not done. */
static void test_trust_forged_checkpoint_refused(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    tu_fake_peer p;
    tu_fake_peer_start(&p, f->c, "p0", "forger", 4 * GiB, 50, "forge");
    char line[512];
    assert_true(tu_fake_peer_expect(&p, "CKPT 0 step 1", 10000, line, sizeof line));
    print_message("forger: %s\n", line);
    assert_non_null(strstr(line, "FAILED"));
    assert_true(tu_broker_wait_log(f->c, 5000, "bad-checkpoint") || tu_broker_wait_log(f->c, 1, "does not fit the job"));
    double rep = tu_client_reputation(&f->cl, "forger");
    print_message("the forger's reputation: %.2f\n", rep);
    assert_true(rep >= 0 && rep < 1.0);
    m = tu_client_job_status(&f->cl, id);
    const Fusion__JobStatus *st = tu_status_of(m);
    print_message("the job: %s\n", st->message);
    assert_int_not_equal(st->state, FUSION__JOB_STATE__JOB_STATE_DONE);
    wire_msg_destroy(&m);
    tu_fake_peer_stop(&p, SIGKILL);
}

/* A burst of 12 submissions of 1 M tokens each (what 4 MB of English makes with a BPE tokenizer; the
 * test model's tokenizer is byte-level), each on its own 175 MB model (hard-linked copies: every one
 * is hashed), while a peer heartbeats every 100 ms: the broker prepares them on its worker, and no
 * heartbeat waits a heartbeat interval (1 s; dead is 3 s) for its answer, on a machine busy with one
 * busy loop per core. What is left on the loop is each job's store commits: the submission's row and
 * its first reason, each of which writes the row with its 4 MB of token ids (a third, storing "queued"
 * again, took the slowest answer from 0.84 to 0.29 s when it went). */
static void test_trust_submission_burst_keeps_heartbeats(void **state)
{
    tu_broker_fx *f = *state;
    enum { JOBS = 12 };
    char big[TU_PATH], *o = NULL;
    tu_path(f->c, big, "big");
    if (tu_sh(&o, "'%s' model init -o '%s' --layers 4 --hidden 512 --heads 8 --kv-heads 8 --ffn 1408 --vocab 32000 "
                  "--seed 3 && for i in $(seq 1 %d); do cp -al '%s' '%s'-$i; done",
              tu_bin("fusion"), big, JOBS, big, big) != 0)
        fail_msg("model init: %s", o);
    free(o);
    tu_broker_fx_start(f);
    tu_client peer, mallory;
    tu_client_open(&peer, f->c, "p0");
    tu_client_hello(&peer, "p0", 1u << 20, 50); /* too small for any job: it only heartbeats */
    tu_client_open(&mallory, f->c, "other");
    size_t data_len = 1u << 20;
    char *data = malloc(data_len);
    for (size_t i = 0; i < data_len; i++)
        data[i] = (char)('a' + i % 26);
    uint64_t t0 = fu_clock_ms();
    for (int i = 1; i <= JOBS; i++) {
        char spec[9000], dir[TU_PATH + 16];
        snprintf(dir, sizeof dir, "%s-%d", big, i);
        tu_finetune_spec(dir, spec, sizeof spec);
        Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
        js.kind = FUSION__JOB_KIND__JOB_KIND_FINETUNE;
        js.spec_json = spec;
        js.data.data = (uint8_t *)data;
        js.data.len = data_len;
        assert_int_equal(tu_client_send(&mallory, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base), FU_OK);
    }
    free(data);
    tu_load_start(2); /* a busy machine: one busy loop per core (docs/TESTING.md) */
    uint64_t sent_at[4096] = {0}, worst = 0, burst_ms = 0;
    int answered = 0, accepted = 0, beats = 0;
    uint64_t next_beat = fu_clock_ms();
    while (fu_clock_ms() < t0 + 30000 && (answered < JOBS || fu_clock_ms() < t0 + 1000)) {
        uint64_t now = fu_clock_ms();
        if (now >= next_beat && peer.seq + 1 < 4096) {
            Fusion__Heartbeat hb = FUSION__HEARTBEAT__INIT;
            assert_int_equal(tu_client_send(&peer, FUSION__MSG_TYPE__MSG_HEARTBEAT, 0, &hb.base), FU_OK);
            sent_at[peer.seq] = now;
            beats++;
            next_beat = now + 100;
        }
        wire_msg_t *m = tu_client_recv(&peer, 5);
        if (m && wire_msg_type(m) == FUSION__MSG_TYPE__MSG_HEARTBEAT) {
            uint64_t sq = wire_msg_hdr(m)->sequence;
            if (sq < 4096 && sent_at[sq]) {
                uint64_t lat = fu_clock_ms() - sent_at[sq];
                worst = lat > worst ? lat : worst;
                sent_at[sq] = 0;
            }
        }
        wire_msg_destroy(&m);
        while ((m = tu_client_recv(&mallory, 1)) != NULL) {
            Fusion__MsgType t = wire_msg_type(m);
            if (t == FUSION__MSG_TYPE__MSG_JOB_STATUS || t == FUSION__MSG_TYPE__MSG_ERROR) {
                answered++;
                accepted += t == FUSION__MSG_TYPE__MSG_JOB_STATUS;
                if (t == FUSION__MSG_TYPE__MSG_ERROR && answered == accepted + 1)
                    print_message("submission refused: %s\n", ((const Fusion__Error *)wire_msg_body(m))->message);
                if (answered == JOBS)
                    burst_ms = fu_clock_ms() - t0;
            }
            wire_msg_destroy(&m);
        }
    }
    tu_load_stop();
    for (size_t i = 0; i < 4096; i++) /* a heartbeat never answered counts as the whole wait */
        if (sent_at[i] && fu_clock_ms() - sent_at[i] > 1000)
            worst = fu_clock_ms() - sent_at[i];
    print_message("%d submissions of 1 M tokens answered in %" PRIu64 " ms (%d accepted); %d heartbeats, the slowest "
                  "answered in %" PRIu64 " ms\n", answered, burst_ms, accepted, beats, worst);
    assert_int_equal(answered, JOBS);
    assert_true(accepted >= 8); /* BROKER_PREP_PER_CLIENT; the rest: "being prepared", submit again */
    assert_true(worst < 1000); /* answered before the next heartbeat is due */
    tu_client_close(&peer);
    tu_client_close(&mallory);
}

/* Waits up to timeout_ms for a message of type t on cl (others dropped); true when one came. */
static bool got(tu_client *cl, Fusion__MsgType t, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (fu_clock_ms() < end) {
        wire_msg_t *m = tu_client_recv(cl, 100);
        bool hit = m && wire_msg_type(m) == t;
        wire_msg_destroy(&m);
        if (hit)
            return true;
    }
    return false;
}

/* A backlog of PeerHellos from the same peer process (what ZeroMQ delivers after a broker outage)
 * is answered and changes nothing: the peer keeps its stage and nobody loses reputation. A hello of
 * a new session (the peer restarted) gives its stage up, as before. */
static void test_trust_hello_backlog_keeps_the_stage(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    tu_client peer;
    char mid[80];
    peer_assigned(&peer, f, "p0", mid);
    for (int i = 0; i < 5; i++) /* the backlog */
        tu_client_hello(&peer, "p0", 4 * GiB, 50);
    assert_true(got(&peer, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 3000));
    assert_false(got(&peer, FUSION__MSG_TYPE__MSG_STAGE_RELEASE, 1000));
    m = tu_client_job_status(&f->cl, id);
    const Fusion__JobStatus *st = tu_status_of(m);
    print_message("after 5 hellos of the same session: %s\n", st->message);
    assert_int_equal(st->state, FUSION__JOB_STATE__JOB_STATE_RUNNING);
    assert_int_equal(st->n_stage_info, 1);
    wire_msg_destroy(&m);
    assert_true(tu_client_reputation(&f->cl, "p0") == 1.0);
    assert_false(tu_broker_wait_log(f->c, 1, "registered again (new session)"));
    /* the peer restarted: its work is gone */
    peer.session++;
    tu_client_hello(&peer, "p0", 4 * GiB, 50);
    assert_true(tu_broker_wait_log(f->c, 5000, "registered again (new session)"));
    tu_client_close(&peer);
}

/* Fair queueing: "client" queues two jobs before "other" queues one. The first peer takes the
 * oldest job; the second takes "other"'s job, not "client"'s second: a client with a job running
 * waits behind one with none. And a flood of submissions meets the per-minute limit, while another
 * client still gets in. */
static void test_trust_fair_queue_and_rate_limit(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    uint64_t a[2], bid;
    uint64_t t0 = fu_clock_ms(); /* the bucket starts full and refills one submission a second */
    for (int i = 0; i < 2; i++) {
        wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
        a[i] = tu_status_of(m)->job_id;
        wire_msg_destroy(&m);
    }
    tu_client other;
    tu_client_open(&other, f->c, "other");
    wire_msg_t *m = tu_client_submit(&other, f->spec, NULL);
    bid = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    char line[512], want[64];
    tu_fake_peer p0, p1;
    tu_fake_peer_start(&p0, f->c, "p0", "p0", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p0, "ASSIGN", 5000, line, sizeof line));
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64, a[0]);
    assert_memory_equal(line, want, strlen(want));
    tu_fake_peer_start(&p1, f->c, "p1", "p1", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&p1, "ASSIGN", 5000, line, sizeof line));
    print_message("the second peer got: %s\n", line);
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64, bid);
    assert_memory_equal(line, want, strlen(want));
    tu_fake_peer_stop(&p0, SIGKILL);
    tu_fake_peer_stop(&p1, SIGKILL);
    /* the flood: 60 a minute (the default), the rest refused with when to try again */
    int accepted = 2, refused_rate = 0;
    char msg[1024];
    for (int i = 0; i < 70; i++) {
        m = tu_client_submit(&f->cl, f->spec, NULL);
        assert_non_null(m);
        if (wire_msg_type(m) == FUSION__MSG_TYPE__MSG_JOB_STATUS) {
            accepted++;
        } else {
            const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
            snprintf(msg, sizeof msg, "%s", e->message);
            assert_int_equal(e->code, FUSION__ERROR_CODE__ERR_BUSY);
            refused_rate += strstr(msg, "in the last minute") != NULL;
        }
        wire_msg_destroy(&m);
    }
    /* 60 at once, plus what refilled while the test ran (a loaded machine takes seconds over it) */
    int refilled = (int)((fu_clock_ms() - t0) / 1000) + 1;
    print_message("72 submissions in a burst: %d accepted, %d refused by the rate, %d refilled (\"%s\")\n", accepted,
                  refused_rate, refilled, msg);
    assert_true(accepted <= 60 + refilled && refused_rate >= 12 - refilled && refused_rate >= 1);
    m = tu_client_submit(&other, f->spec, NULL); /* another client is not held back */
    assert_int_equal(tu_status_of(m)->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
    wire_msg_destroy(&m);
    tu_client_close(&other);
}

/* A peer claiming 1e308 GFLOP/s (the fake peer) is refused at its hello, naming the bound;
 * a believable claim is welcomed. */
static void test_trust_unbelievable_profile_refused(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    tu_client liar;
    tu_client_open(&liar, f->c, "p0");
    tu_client_hello(&liar, "liar", 4 * GiB, 1e308);
    uint64_t end = fu_clock_ms() + 5000;
    bool refused_hello = false, welcomed = false;
    while (fu_clock_ms() < end && !refused_hello && !welcomed) {
        wire_msg_t *m = tu_client_recv(&liar, 100);
        if (m && wire_msg_type(m) == FUSION__MSG_TYPE__MSG_ERROR) {
            const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
            print_message("refused: %s\n", e->message);
            refused_hello = e->in_reply_to == FUSION__MSG_TYPE__MSG_PEER_HELLO && strstr(e->message, "not believable");
        }
        welcomed = m && wire_msg_type(m) == FUSION__MSG_TYPE__MSG_PEER_WELCOME;
        wire_msg_destroy(&m);
    }
    assert_true(refused_hello);
    assert_false(welcomed);
    tu_client_hello(&liar, "honest", 4 * GiB, 50);
    assert_true(got(&liar, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000));
    tu_client_close(&liar);
}

/* Waits until the broker lists `name` with profile_check `want`; the list (caller destroys). */
static wire_msg_t *listed_as(tu_client *cl, const char *name, const char *want, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    for (;;) {
        wire_msg_t *m = tu_client_peer_list(cl);
        const Fusion__PeerInfo *pi = tu_peer_listed(m, name);
        if (pi && strcmp(pi->profile_check, want) == 0)
            return m;
        if (fu_clock_ms() >= end)
            fail_msg("%s is listed as '%s', not '%s'", name, pi ? pi->profile_check : "(absent)", want);
        wire_msg_destroy(&m);
        fu_sleep_ms(100);
    }
}

/* Whether cl gets a StageAssign within timeout_ms (answering challenges meanwhile). */
static bool assigned_within(tu_client *cl, int timeout_ms)
{
    return got(cl, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN, timeout_ms);
}

/* A peer claiming 40x the speed of this machine answers its profile challenge honestly: the broker
 * measures it, and plans with at most BROKER_CHALLENGE_SLACK (1.5) x the measured speed, far below
 * the claim. It then gets work. */
static void test_trust_profile_capped_by_challenge(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    tu_client boaster;
    tu_client_open(&boaster, f->c, "p0");
    tu_client_hello(&boaster, "boaster", 4 * GiB, 2000);
    assert_true(got(&boaster, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000));
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
    wire_msg_destroy(&m);
    assert_true(assigned_within(&boaster, 60000)); /* the challenge runs first (n = 2688 here) */
    m = listed_as(&f->cl, "boaster", "verified", 1000);
    const Fusion__PeerInfo *pi = tu_peer_listed(m, "boaster");
    double plan = pi->profile->speeds[0]->gemm_gflops;
    print_message("claimed %.0f GFLOP/s, measured %.1f, plans use %.1f\n", pi->gflops_claimed, pi->gflops_verified,
                  plan);
    assert_true(pi->gflops_claimed == 2000);
    assert_true(pi->gflops_verified > 0 && pi->gflops_verified < 1000); /* two cores do not do a TFLOP/s */
    assert_true(plan <= 1.5 * pi->gflops_verified + 1e-9);
    wire_msg_destroy(&m);
    assert_int_equal(boaster.challenges_answered, 1);
    tu_client_close(&boaster);
}

/* A peer that forges its answer (a commitment to rows of zeros, made without computing) is caught:
 * it gets no work, its registration is marked failed, and it loses reputation; an honest peer
 * takes the job. A peer that never answers gets no work either (listed "pending"). */
static void test_trust_forged_or_missing_challenge_gets_no_work(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    tu_client forger, mute, honest;
    tu_client_open(&forger, f->c, "p0");
    tu_client_open(&mute, f->c, "p1");
    forger.challenge = TU_CHALLENGE_FORGE;
    mute.challenge = TU_CHALLENGE_PASS_ON;
    tu_client_hello(&forger, "forger", 4 * GiB, 2000);
    tu_client_hello(&mute, "mute", 4 * GiB, 2000);
    assert_true(got(&forger, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000));
    assert_true(got(&mute, FUSION__MSG_TYPE__MSG_PEER_WELCOME, 5000));
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
    wire_msg_destroy(&m);
    assert_false(assigned_within(&forger, 3000));
    assert_false(assigned_within(&mute, 500));
    assert_int_equal(forger.challenges_answered, 1);
    m = listed_as(&f->cl, "forger", "failed", 1000);
    const Fusion__PeerInfo *pi = tu_peer_listed(m, "forger");
    print_message("forger: %s, reputation %.2f, measured %.1f GFLOP/s\n", pi->profile_check, pi->reputation,
                  pi->gflops_verified);
    assert_true(pi->reputation < 0.75);
    assert_true(pi->gflops_verified == 0);
    assert_string_equal(tu_peer_listed(m, "mute")->profile_check, "pending");
    wire_msg_destroy(&m);
    tu_client_open(&honest, f->c, "p2");
    tu_client_hello(&honest, "honest", 4 * GiB, 50);
    assert_true(assigned_within(&honest, 10000));
    tu_client_close(&honest);
    tu_client_close(&mute);
    tu_client_close(&forger);
}

/* A peer that reports steps of a 65,536-token job 5 ms apart (the fake worker) is faster
 * than its verified speed allows by far: the broker flags the stage (log and event) so that every
 * micro-batch of it is verified from then on. */
static void test_trust_too_fast_stage_flagged(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    char spec[9000];
    snprintf(spec, sizeof spec,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, \"steps\": 20, "
             "\"batch\": 256, \"seq_len\": 256, \"micro_batches\": 2, \"checkpoint_every\": 20}",
             f->model);
    size_t len = 70000;
    char *text = malloc(len);
    for (size_t i = 0; i < len; i++)
        text[i] = (char)('a' + i % 26);
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.kind = FUSION__JOB_KIND__JOB_KIND_FINETUNE;
    js.spec_json = spec;
    js.data.data = (uint8_t *)text;
    js.data.len = len;
    wire_msg_t *m =
        tu_client_call(&f->cl, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 10000);
    free(text);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    tu_client w;
    tu_client_open(&w, f->c, "p0");
    tu_client_hello(&w, "speedy", 4 * GiB, 50);
    assert_true(assigned_within(&w, 20000));
    Fusion__StageReady r = FUSION__STAGE_READY__INIT;
    r.job_id = id;
    assert_int_equal(tu_client_send(&w, FUSION__MSG_TYPE__MSG_STAGE_READY, id, &r.base), FU_OK);
    assert_true(got(&w, FUSION__MSG_TYPE__MSG_STAGE_START, 5000));
    for (uint64_t s = 0; s < 4; s++) {
        Fusion__StepDone d = FUSION__STEP_DONE__INIT;
        d.job_id = id;
        d.step = s;
        d.loss = 1.0;
        d.tokens = 65536;
        assert_int_equal(tu_client_send(&w, FUSION__MSG_TYPE__MSG_STEP_DONE, id, &d.base), FU_OK);
        fu_sleep_ms(5);
    }
    assert_true(tu_broker_wait_log(f->c, 5000, "stage 0 reported a step in"));
    assert_true(tu_broker_logged(f->c, "every micro-batch of it is verified from now on"));
    tu_client_close(&w);
}

/* Submits a single-stage job of `steps` steps, one micro-batch, every one verified, and starts two
 * wire peers named "ann" (p0) and "bob" (p1): one gets the stage (*primary, its name in
 * *primary_name), the other its warm backup (the verifier). Returns the job id. */
static uint64_t verified_pair(tu_broker_fx *f, uint64_t steps, tu_client pc[2], tu_client **primary,
                              const char **primary_name)
{
    char spec[9000];
    snprintf(spec, sizeof spec,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, \"steps\": %" PRIu64
             ", \"batch\": 2, \"seq_len\": 8, \"micro_batches\": 1, \"checkpoint_every\": 4, \"verify\": 1.0}",
             f->model, steps);
    wire_msg_t *m = tu_client_submit(&f->cl, spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    static const char *const names[2] = {"ann", "bob"};
    *primary = NULL;
    for (int i = 0; i < 2; i++) {
        tu_client_open(&pc[i], f->c, i ? "p1" : "p0");
        tu_client_hello(&pc[i], names[i], 4 * GiB, 50);
    }
    for (int i = 0; i < 2; i++) { /* one gets the stage, the other its backup: both say ready */
        uint64_t end = fu_clock_ms() + 20000;
        bool assigned = false;
        while (!assigned && fu_clock_ms() < end) {
            wire_msg_t *a = tu_client_recv(&pc[i], 200);
            const Fusion__StageAssign *sa = a ? wire_msg_body_as(a, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN) : NULL;
            if (sa) {
                assigned = true;
                if (!sa->backup) {
                    *primary = &pc[i];
                    *primary_name = names[i];
                }
                Fusion__StageReady r = FUSION__STAGE_READY__INIT;
                r.job_id = id;
                assert_int_equal(tu_client_send(&pc[i], FUSION__MSG_TYPE__MSG_STAGE_READY, id, &r.base), FU_OK);
            }
            wire_msg_destroy(&a);
        }
        assert_true(assigned);
    }
    assert_non_null(*primary);
    assert_true(got(*primary, FUSION__MSG_TYPE__MSG_STAGE_START, 5000));
    /* the checker's StageReady came on another connection: the step waits until it is a warm verifier */
    tu_client *checker = *primary == &pc[0] ? &pc[1] : &pc[0];
    assert_int_equal(tu_client_wait_peer_state(&f->cl, wire_keypair_public_z85(checker->kp),
                                               FUSION__PEER_STATE__PEER_STATE_WARM, 5000),
                     FUSION__PEER_STATE__PEER_STATE_WARM);
    return id;
}

static void step_done(tu_client *cl, uint64_t id, uint64_t step)
{
    Fusion__StepDone d = FUSION__STEP_DONE__INIT;
    d.job_id = id;
    d.step = step;
    d.loss = 1.0;
    d.tokens = 16;
    assert_int_equal(tu_client_send(cl, FUSION__MSG_TYPE__MSG_STEP_DONE, id, &d.base), FU_OK);
}

/* Answers the VerifyRequest of step `step` (seed in seeds[step]) with "no longer held". */
static void say_unavailable(tu_client *cl, uint64_t id, uint64_t step, uint64_t seed)
{
    Fusion__VerifySketch vs = FUSION__VERIFY_SKETCH__INIT;
    vs.job_id = id;
    vs.stage_index = 0;
    vs.step = step;
    vs.micro_batch = 0;
    vs.seed = seed;
    vs.unavailable = (char *)"that output is no longer held (this peer keeps the last 3 steps)";
    assert_int_equal(tu_client_send(cl, FUSION__MSG_TYPE__MSG_VERIFY_SKETCH, id, &vs.base), FU_OK);
}

/* Collects the VerifyRequests for steps from..n-1 (their seeds, by step) that cl gets within timeout_ms. */
static bool verify_requests(tu_client *cl, uint64_t from, uint64_t n, uint64_t seeds[], int timeout_ms)
{
    bool have[8] = {false};
    uint64_t left = n - from, end = fu_clock_ms() + (uint64_t)timeout_ms;
    while (left > 0 && fu_clock_ms() < end) {
        wire_msg_t *q = tu_client_recv(cl, 200);
        const Fusion__VerifyRequest *vr = q ? wire_msg_body_as(q, FUSION__MSG_TYPE__MSG_VERIFY_REQUEST) : NULL;
        if (vr && vr->step >= from && vr->step < n && vr->step < 8 && !have[vr->step]) {
            have[vr->step] = true;
            seeds[vr->step] = vr->seed;
            left--;
        }
        wire_msg_destroy(&q);
    }
    return left == 0;
}

/* A stage's peer asked for the sketch of a step it just ran answers "unavailable" (to dodge the
 * check): that counts as a wrong answer (event "withheld", 0.3 reputation), not a skipped sample. */
static void test_trust_withheld_output_costs_like_a_lie(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    tu_client pc[2], *primary;
    const char *dodger = NULL;
    uint64_t id = verified_pair(f, 4, pc, &primary, &dodger);
    step_done(primary, id, 0);
    uint64_t seed[1];
    assert_true(verify_requests(primary, 0, 1, seed, 5000));
    say_unavailable(primary, id, 0, seed[0]);
    assert_true(tu_broker_wait_log(f->c, 5000, "WITHHELD"));
    double rep = tu_client_reputation(&f->cl, dodger);
    print_message("%s withheld its output: reputation %.2f\n", dodger, rep);
    assert_true(rep > 0.65 && rep < 0.75);
    tu_client_close(&pc[0]);
    tu_client_close(&pc[1]);
}

/* The honest but fast case: the stage runs steps 0, 1 and 2 before it reads the broker's request for
 * step 0, and by then no longer holds step 0 (a peer keeps its last 3 steps). The broker's own
 * records (StepDone 2 came before the answer) show the pipeline can have moved that far: the sample
 * is skipped and the peer keeps its reputation. The same answer about step 1, which the peer must
 * still hold after step 2, is withheld: claiming to have moved on is bounded by the StepDones. */
static void test_trust_evicted_output_is_skipped(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    tu_client pc[2], *primary;
    const char *name = NULL;
    uint64_t id = verified_pair(f, 6, pc, &primary, &name);
    for (uint64_t s = 0; s < 3; s++)
        step_done(primary, id, s);
    uint64_t seeds[3];
    assert_true(verify_requests(primary, 0, 3, seeds, 10000));
    say_unavailable(primary, id, 0, seeds[0]);
    assert_true(tu_broker_wait_log(f->c, 5000, "step 0 mb 0: sample skipped: peer"));
    assert_true(tu_broker_logged(f->c, "the pipeline can have moved on (the last stage reported step 2 done"));
    assert_false(tu_broker_logged(f->c, "WITHHELD"));
    double rep = tu_client_reputation(&f->cl, name);
    print_message("%s no longer held step 0 after step 2: reputation %.2f\n", name, rep);
    assert_true(rep > 0.99);
    say_unavailable(primary, id, 1, seeds[1]);
    assert_true(tu_broker_wait_log(f->c, 5000, "step 1 mb 0: WITHHELD"));
    rep = tu_client_reputation(&f->cl, name);
    print_message("%s withheld step 1 after step 2: reputation %.2f\n", name, rep);
    assert_true(rep > 0.65 && rep < 0.75);
    tu_client_close(&pc[0]);
    tu_client_close(&pc[1]);
}

/* A two-stage job of three wire peers (the stage peers and a warm backup of stage 0, its verifier):
 * stage 0's peer answers "no longer held" at once about step 0 while the last stage has reported
 * only step 0 done. A stage k < last gets a short wait for the last stage's StepDone (it comes on
 * another connection): none comes, so it withheld the output (0.3). Then it says the same about
 * step 1 and the last stage reports steps 2 and 3 within the wait: it can have moved past step 1,
 * and the sample is skipped at no cost. */
static void test_trust_withheld_waits_for_the_last_stage(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    char spec[9000];
    snprintf(spec, sizeof spec,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, \"steps\": 8, "
             "\"batch\": 2, \"seq_len\": 8, \"micro_batches\": 1, \"checkpoint_every\": 8, \"verify\": 1.0}",
             f->model);
    wire_msg_t *m = tu_client_submit(&f->cl, spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    static const char *const names[3] = {"ann", "bob", "cy"};
    tu_client pc[3];
    tu_client *st[2] = {NULL, NULL}, *backup = NULL;
    const char *st0_name = NULL;
    /* the broker's estimate for this model: about 33 MiB whole, 32 MiB its smallest stage; peers of
     * 32.6 MiB each make a plan of two stages and a backup */
    const uint64_t mem = 34183578;
    for (int i = 0; i < 3; i++) {
        char key[8];
        snprintf(key, sizeof key, "p%d", i);
        tu_client_open(&pc[i], f->c, key);
        tu_client_hello(&pc[i], names[i], mem, 50);
    }
    /* all three answer their profile challenges at once (a plan needs them all), then say ready */
    bool assigned[3] = {false, false, false};
    int n_assigned = 0;
    for (uint64_t end = fu_clock_ms() + 20000; n_assigned < 3 && fu_clock_ms() < end;) {
        for (int i = 0; i < 3; i++) {
            wire_msg_t *a = assigned[i] ? NULL : tu_client_recv(&pc[i], 50);
            const Fusion__StageAssign *sa = a ? wire_msg_body_as(a, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN) : NULL;
            if (sa) {
                assigned[i] = true;
                n_assigned++;
                print_message("%s: stage %u of %u%s\n", names[i], sa->stage_index, sa->stage_count,
                              sa->backup ? " (backup)" : "");
                if (sa->backup)
                    backup = &pc[i];
                else if (sa->stage_index < 2) {
                    st[sa->stage_index] = &pc[i];
                    if (sa->stage_index == 0)
                        st0_name = names[i];
                }
                Fusion__StageReady r = FUSION__STAGE_READY__INIT;
                r.job_id = id;
                r.stage_index = sa->stage_index;
                assert_int_equal(tu_client_send(&pc[i], FUSION__MSG_TYPE__MSG_STAGE_READY, id, &r.base), FU_OK);
            }
            wire_msg_destroy(&a);
        }
    }
    assert_int_equal(n_assigned, 3);
    assert_non_null(st[0]);
    assert_non_null(st[1]);
    assert_non_null(backup);
    assert_true(got(st[1], FUSION__MSG_TYPE__MSG_STAGE_START, 5000));
    assert_int_equal(tu_client_wait_peer_state(&f->cl, wire_keypair_public_z85(backup->kp),
                                               FUSION__PEER_STATE__PEER_STATE_WARM, 5000),
                     FUSION__PEER_STATE__PEER_STATE_WARM);
    step_done(st[1], id, 0);
    uint64_t seed[2];
    assert_true(verify_requests(st[0], 0, 1, seed, 5000));
    say_unavailable(st[0], id, 0, seed[0]);
    assert_true(tu_broker_wait_log(f->c, 5000, "for the StepDone that shows it could"));
    assert_true(tu_broker_wait_log(f->c, 5000, "stage 0 step 0 mb 0: WITHHELD"));
    double rep = tu_client_reputation(&f->cl, st0_name);
    print_message("%s said step 0 was gone with only step 0 done: reputation %.2f\n", st0_name, rep);
    assert_true(rep > 0.65 && rep < 0.75);
    step_done(st[1], id, 1);
    assert_true(verify_requests(st[0], 1, 2, seed, 5000));
    say_unavailable(st[0], id, 1, seed[1]);
    fu_sleep_ms(50);
    step_done(st[1], id, 2);
    step_done(st[1], id, 3);
    assert_true(tu_broker_wait_log(f->c, 5000, "stage 0 step 1 mb 0: sample skipped: peer"));
    rep = tu_client_reputation(&f->cl, st0_name);
    print_message("%s said step 1 was gone and the last stage reported step 3 within the wait: reputation %.2f\n",
                  st0_name, rep);
    assert_true(rep > 0.65 && rep < 0.75);
    for (int i = 0; i < 3; i++)
        tu_client_close(&pc[i]);
}

/* The stage's peer of a run resumed from step 2 cannot load its stage because the broker no longer has
 * the checkpoint its StageAssign named (here deleted from the store under the broker; in CI a prune
 * did it: "no blob ckpt:2:60"): the broker's fault, so the stage fails over and the peer keeps its
 * reputation. The broker goes by its own record of the refusal, not by the peer's word. */
static void test_trust_missing_blob_costs_nothing(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    char spec[9000];
    snprintf(spec, sizeof spec,
             "{\"model\": \"%s\", \"method\": \"lora-fa\", \"rank\": 4, \"alpha\": 8, \"lr\": 0.01, \"steps\": 4, "
             "\"batch\": 2, \"seq_len\": 8, \"micro_batches\": 1, \"checkpoint_every\": 2, \"verify\": 0}",
             f->model);
    wire_msg_t *m = tu_client_submit(&f->cl, spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    /* ann runs steps 0 and 1, commits the checkpoint of step 2, and goes */
    tu_client ann;
    tu_client_open(&ann, f->c, "p0");
    tu_client_hello(&ann, "ann", 4 * GiB, 50);
    dag_graph_t *g = NULL;
    uint32_t first = 0, last = 0;
    for (uint64_t end = fu_clock_ms() + 20000; !g && fu_clock_ms() < end;) {
        wire_msg_t *a = tu_client_recv(&ann, 200);
        const Fusion__StageAssign *sa = a ? wire_msg_body_as(a, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN) : NULL;
        if (sa) {
            assert_int_equal(dag_graph_decode(sa->dag.data, sa->dag.len, &g, NULL), FU_OK);
            first = sa->node_begin;
            last = sa->node_end;
        }
        wire_msg_destroy(&a);
    }
    assert_non_null(g);
    Fusion__StageReady r = FUSION__STAGE_READY__INIT;
    r.job_id = id;
    assert_int_equal(tu_client_send(&ann, FUSION__MSG_TYPE__MSG_STAGE_READY, id, &r.base), FU_OK);
    assert_true(got(&ann, FUSION__MSG_TYPE__MSG_STAGE_START, 5000));
    step_done(&ann, id, 0);
    step_done(&ann, id, 1);
    assert_true(tu_fake_put_ckpt(&ann, id, 0, g, first, last, 2, tu_cluster_dir(f->c)));
    dag_graph_destroy(&g);
    tu_client_close(&ann);
    /* bob takes the stage over from step 2; the store loses that checkpoint before bob asks for it */
    tu_client bob;
    tu_client_open(&bob, f->c, "p1");
    tu_client_hello(&bob, "bob", 4 * GiB, 50);
    bool resumed = false;
    for (uint64_t end = fu_clock_ms() + 30000; !resumed && fu_clock_ms() < end;) {
        wire_msg_t *a = tu_client_recv(&bob, 200);
        const Fusion__StageAssign *sa = a ? wire_msg_body_as(a, FUSION__MSG_TYPE__MSG_STAGE_ASSIGN) : NULL;
        resumed = sa && !sa->backup && sa->resume_step == 2;
        wire_msg_destroy(&a);
    }
    assert_true(resumed);
    char *out = NULL;
    int rc = tu_sh(&out, "sqlite3 -cmd '.timeout 10000' '%s/store.db' \"DELETE FROM checkpoints WHERE job_id = "
                   "'%016" PRIx64 "'\"", tu_cluster_dir(f->c), id);
    if (rc != 0)
        fail_msg("sqlite3: %s", out);
    free(out);
    Fusion__WeightRequest w = FUSION__WEIGHT_REQUEST__INIT;
    char jid[64];
    snprintf(jid, sizeof jid, "job:%016" PRIx64, id);
    w.model_id = jid;
    w.tensor_name = (char *)"ckpt:0:2";
    m = tu_client_call(&bob, FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST, 0, &w.base, FUSION__MSG_TYPE__MSG_WEIGHT_CHUNK,
                       5000);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    const Fusion__Error *re = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
    print_message("the broker refused bob the checkpoint: %s\n", re->message);
    assert_string_equal(re->model_id, jid); /* the refusal names the blob: a peer tells it from a later fetch's */
    assert_string_equal(re->tensor_name, "ckpt:0:2");
    wire_msg_destroy(&m);
    Fusion__Error e = FUSION__ERROR__INIT; /* what fusion-peer says then (peer_stage.c) */
    e.code = FUSION__ERROR_CODE__ERR_NOT_FOUND;
    e.in_reply_to = FUSION__MSG_TYPE__MSG_WEIGHT_REQUEST;
    e.message = (char *)"cannot load the stage: the broker has no blob";
    assert_int_equal(tu_client_send(&bob, FUSION__MSG_TYPE__MSG_ERROR, id, &e.base), FU_OK);
    assert_true(tu_broker_wait_log(f->c, 5000, "the broker's fault, no reputation lost"));
    double rep = tu_client_reputation(&f->cl, "bob");
    print_message("bob could not load its stage for want of the broker's blob: reputation %.2f\n", rep);
    assert_true(rep > 0.99);
    tu_client_close(&bob);
}

/* The other per-client limits, made small: a client with 3 unfinished jobs is told to wait or
 * cancel; one whose jobs would hold more than 1 MiB is told so; another client is not affected. */
static void test_trust_quotas_name_the_limit(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_args(f->c, "--max-jobs-per-client 3 --max-mib-per-client 1");
    tu_broker_fx_start(f);
    for (int i = 0; i < 3; i++) {
        wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
        assert_int_equal(tu_status_of(m)->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
        wire_msg_destroy(&m);
    }
    char msg[1024];
    assert_int_equal(refused(f, f->spec, msg, sizeof msg), FUSION__ERROR_CODE__ERR_BUSY);
    assert_non_null(strstr(msg, "3 unfinished jobs"));
    tu_client other;
    tu_client_open(&other, f->c, "other");
    size_t big = 300u << 10; /* up to 4 bytes a token: 1.2 MiB */
    char *text = malloc(big);
    memset(text, 'a', big);
    Fusion__JobSubmit js = FUSION__JOB_SUBMIT__INIT;
    js.kind = FUSION__JOB_KIND__JOB_KIND_FINETUNE;
    js.spec_json = f->spec;
    js.data.data = (uint8_t *)text;
    js.data.len = big;
    wire_msg_t *m =
        tu_client_call(&other, FUSION__MSG_TYPE__MSG_JOB_SUBMIT, 0, &js.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, 5000);
    free(text);
    assert_non_null(m);
    assert_int_equal(wire_msg_type(m), FUSION__MSG_TYPE__MSG_ERROR);
    const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(m);
    print_message("refused: %s\n", e->message);
    assert_int_equal(e->code, FUSION__ERROR_CODE__ERR_TOO_LARGE);
    assert_non_null(strstr(e->message, "at most 1 MiB per client"));
    wire_msg_destroy(&m);
    m = tu_client_submit(&other, f->spec, NULL); /* a small one is fine */
    assert_int_equal(tu_status_of(m)->state, FUSION__JOB_STATE__JOB_STATE_QUEUED);
    wire_msg_destroy(&m);
    tu_client_close(&other);
}

/* Trusted ends: with a peer the allow-list marks trusted registered, a job's first and last stages
 * (here its only stage, which sees the tokens) go to it even though a faster stranger is idle, and
 * the stranger is not even made its backup; a job that says "trusted_ends": false takes the
 * stranger. */
static void test_trust_ends_stay_on_trusted_peers(void **state)
{
    tu_broker_fx *f = *state;
    tu_allow_roles(f->c, "p1", "peer,trusted");
    tu_broker_fx_start(f);
    tu_fake_peer fast, trusted;
    tu_fake_peer_start(&fast, f->c, "p0", "stranger", 4 * GiB, 500, "ready");
    tu_fake_peer_start(&trusted, f->c, "p1", "trusted", 4 * GiB, 50, "ready");
    assert_true(tu_fake_peer_expect(&fast, "WELCOME", 5000, NULL, 0));
    assert_true(tu_fake_peer_expect(&trusted, "WELCOME", 5000, NULL, 0));
    wire_msg_t *m = tu_client_submit(&f->cl, f->spec, NULL);
    uint64_t id = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    char line[512], want[64];
    assert_true(tu_fake_peer_expect(&trusted, "ASSIGN", 5000, line, sizeof line));
    print_message("the trusted peer got: %s\n", line);
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0", id);
    assert_memory_equal(line, want, strlen(want));
    assert_false(tu_fake_peer_expect(&fast, "ASSIGN", 1500, NULL, 0)); /* not even its backup */
    /* the owner may let the ends go anywhere */
    char spec[9000];
    snprintf(spec, sizeof spec, "%.*s, \"trusted_ends\": false}", (int)strlen(f->spec) - 1, f->spec);
    m = tu_client_submit(&f->cl, spec, NULL);
    uint64_t id2 = tu_status_of(m)->job_id;
    wire_msg_destroy(&m);
    assert_true(tu_fake_peer_expect(&fast, "ASSIGN", 5000, line, sizeof line));
    snprintf(want, sizeof want, "ASSIGN %016" PRIx64 " stage 0 of 1 backup 0", id2);
    assert_memory_equal(line, want, strlen(want));
    tu_fake_peer_stop(&fast, SIGKILL);
    tu_fake_peer_stop(&trusted, SIGKILL);
}

/* The resident memory of process pid, in KiB (VmRSS). */
static long rss_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *fp = fopen(path, "r");
    long kib = -1;
    while (fp && fgets(line, sizeof line, fp))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    if (fp)
        fclose(fp);
    return kib;
}

/* 150 submissions refused after their model was opened (too little data for the batch), over 30
 * copies of the model: the broker keeps a bounded cache and its memory stays flat. */
static void test_trust_rejected_submissions_memory_flat(void **state)
{
    tu_broker_fx *f = *state;
    /* under AddressSanitizer freed memory waits in a quarantine of up to 256 MiB before it is reused:
     * the broker this test measures runs without one (a plain build is unaffected) */
    char *asan = getenv("ASAN_OPTIONS") ? strdup(getenv("ASAN_OPTIONS")) : NULL;
    char opts[1024];
    snprintf(opts, sizeof opts, "%s%squarantine_size_mb=0:thread_local_quarantine_size_kb=0", asan ? asan : "",
             asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);
    tu_broker_fx_start(f);
    enum { COPIES = 30 }; /* 30 x 0.4 MB: a cache that kept them all would grow by 12 MB */
    static char copies[COPIES][TU_PATH];
    char spec[9000], msg[1024];
    for (int i = 0; i < COPIES; i++) {
        char name[32];
        snprintf(name, sizeof name, "model-%d", i);
        copy_model(f, name, false, copies[i]);
    }
    long before = 0;
    tu_client others[2]; /* three clients, 50 each: under the 60 submissions a minute one may make */
    tu_client_open(&others[0], f->c, "other");
    tu_client_open(&others[1], f->c, "p3");
    for (int i = 0; i < 150; i++) {
        snprintf(spec, sizeof spec, "{\"model\": \"%s\", \"steps\": 2, \"batch\": 64, \"seq_len\": 64}",
                 copies[i % COPIES]);
        tu_client *cl = i % 3 ? &others[i % 3 - 1] : &f->cl;
        assert_int_equal(refused_by(cl, spec, msg, sizeof msg), FUSION__ERROR_CODE__ERR_INVALID);
        assert_non_null(strstr(msg, "fewer than batch"));
        if (i == 5)
            before = rss_kib(tu_broker_pid(f->c));
    }
    long after = rss_kib(tu_broker_pid(f->c));
    tu_client_close(&others[0]);
    tu_client_close(&others[1]);
    if (asan)
        setenv("ASAN_OPTIONS", asan, 1);
    else
        unsetenv("ASAN_OPTIONS");
    free(asan);
    print_message("broker RSS after 6 refusals %ld KiB, after 150 %ld KiB\n", before, after);
    assert_true(before > 0 && after > 0);
    assert_true(after < before + 4 * 1024);
}

int main(int argc, char **argv)
{
    if (tu_fake_peer_requested(argc, argv))
        return tu_fake_peer_main(argc, argv);
    const struct CMUnitTest tests[] = {
        tu_broker_test(test_trust_poisoned_copy_is_another_model),
        tu_broker_test(test_trust_outside_roots_not_found),
        tu_broker_test(test_trust_malformed_weights_leak_nothing),
        tu_broker_test(test_trust_model_changed_after_submit),
        tu_broker_test(test_trust_forged_checkpoint_refused),
        tu_broker_test(test_trust_submission_burst_keeps_heartbeats),
        tu_broker_test(test_trust_hello_backlog_keeps_the_stage),
        tu_broker_test(test_trust_fair_queue_and_rate_limit),
        tu_broker_test(test_trust_ends_stay_on_trusted_peers),
        tu_broker_test(test_trust_quotas_name_the_limit),
        tu_broker_test(test_trust_unbelievable_profile_refused),
        tu_broker_test(test_trust_rejected_submissions_memory_flat),
        tu_broker_test(test_trust_profile_capped_by_challenge),
        tu_broker_test(test_trust_forged_or_missing_challenge_gets_no_work),
        tu_broker_test(test_trust_too_fast_stage_flagged),
        tu_broker_test(test_trust_withheld_output_costs_like_a_lie),
        tu_broker_test(test_trust_evicted_output_is_skipped),
        tu_broker_test(test_trust_withheld_waits_for_the_last_stage),
        tu_broker_test(test_trust_missing_blob_costs_nothing),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
