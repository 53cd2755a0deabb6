/* Models uploaded by content (docs/PIPELINE.md "Uploading a model"), against the real fusion-broker
 * by a client that speaks the wire protocol itself (fake_peer.h):
 * - a model is announced, its chunks sent, committed: the broker names it "u-<hex>", and a job on
 *   that name is accepted; the same manifest again is named at once, with nothing to send;
 * - a second model sharing the weights has only its changed chunk sent; the others the broker copies
 *   from the first (stubs);
 * - a chunk whose bytes do not match its hash, one of no announced upload, one out of range, and a
 *   commit before every chunk arrived, are refused or answered with what is missing;
 * - manifests with a path in a file name, no config.json, a chunk count that does not fit the size,
 *   or a model over the broker's --upload-gib, are refused with a message naming the fault; with
 *   --upload-gib 0 every upload is;
 * - a staging directory left by a crash is gone after a restart, and uploaded models survive it. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <sodium.h>

#include "cluster.h"
#include "fake_peer.h"
#include "fu_file.h"
#include "testutil.h"

#define CHUNK WIRE_UPLOAD_CHUNK

/* A model in memory: its files and their manifest. */
typedef struct {
    size_t n;
    const char *names[4];
    uint8_t *data[4];
    size_t size[4];
    Fusion__UploadFile files[4];
    Fusion__UploadFile *fp[4];
    ProtobufCBinaryData hashes[4][8];
    uint8_t hbuf[4][8][32];
    Fusion__ModelUpload mu;
} mem_model;

/* The files of DIR/model (config.json, model.safetensors) read into m, with their manifest. */
static void model_read(tu_broker_fx *f, mem_model *m)
{
    memset(m, 0, sizeof *m);
    static const char *const names[] = {"config.json", "model.safetensors"};
    m->n = 2;
    for (size_t i = 0; i < m->n; i++) {
        char *p = fu_path_join(f->model, names[i]), *txt = NULL;
        assert_int_equal(fu_file_read_all(p, 64u << 20, &txt, &m->size[i], NULL), FU_OK);
        free(p);
        m->data[i] = (uint8_t *)txt;
        m->names[i] = names[i];
    }
}

static void manifest(mem_model *m)
{
    fusion__model_upload__init(&m->mu);
    for (size_t i = 0; i < m->n; i++) {
        Fusion__UploadFile *uf = &m->files[i];
        fusion__upload_file__init(uf);
        uf->name = (char *)m->names[i];
        uf->size = m->size[i];
        uf->n_chunks = (m->size[i] + CHUNK - 1) / CHUNK;
        assert_true(uf->n_chunks <= 8);
        for (size_t k = 0; k < uf->n_chunks; k++) {
            size_t off = k * CHUNK, len = m->size[i] - off < CHUNK ? m->size[i] - off : CHUNK;
            crypto_generichash(m->hbuf[i][k], 32, m->data[i] + off, len, NULL, 0);
            m->hashes[i][k] = (ProtobufCBinaryData){.len = 32, .data = m->hbuf[i][k]};
        }
        uf->chunks = m->hashes[i];
        m->fp[i] = uf;
    }
    m->mu.n_files = m->n;
    m->mu.files = m->fp;
}

static void model_free(mem_model *m)
{
    for (size_t i = 0; i < m->n; i++)
        free(m->data[i]);
}

/* Sends mu (commit or not): the UploadStatus (caller destroys), or fails on an Error. */
static wire_msg_t *announce(tu_client *cl, Fusion__ModelUpload *mu, bool commit)
{
    mu->commit = commit;
    wire_msg_t *r = tu_client_call(cl, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD, 0, &mu->base, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, 10000);
    assert_non_null(r);
    if (wire_msg_type(r) != FUSION__MSG_TYPE__MSG_UPLOAD_STATUS)
        fail_msg("ModelUpload refused: %s", ((const Fusion__Error *)wire_msg_body(r))->message);
    return r;
}

/* The Error text an upload message got (fails the test when it was taken). */
static void refused_with(tu_client *cl, Fusion__MsgType t, const ProtobufCMessage *body, const char *needle)
{
    wire_msg_t *r = tu_client_call(cl, t, 0, body, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, 10000);
    assert_non_null(r);
    if (wire_msg_type(r) != FUSION__MSG_TYPE__MSG_ERROR)
        fail_msg("accepted, expected a refusal with '%s'", needle);
    const Fusion__Error *e = (const Fusion__Error *)wire_msg_body(r);
    print_message("refused: %s\n", e->message);
    if (!strstr(e->message, needle))
        fail_msg("refused with '%s', expected '%s'", e->message, needle);
    wire_msg_destroy(&r);
}

/* Chunk `index` (over the files in order) of m. */
static void chunk_of(const mem_model *m, uint32_t index, const uint8_t **data, size_t *len)
{
    for (size_t i = 0; i < m->n; i++) {
        size_t nc = (m->size[i] + CHUNK - 1) / CHUNK;
        if (index < nc) {
            size_t off = index * (size_t)CHUNK;
            *data = m->data[i] + off;
            *len = m->size[i] - off < CHUNK ? m->size[i] - off : CHUNK;
            return;
        }
        index -= (uint32_t)nc;
    }
    fail_msg("no chunk %u", index);
}

static void send_chunk(tu_client *cl, const mem_model *m, uint32_t index, bool stub)
{
    Fusion__ModelChunk mc = FUSION__MODEL_CHUNK__INIT;
    mc.index = index;
    if (!stub) {
        const uint8_t *d = NULL;
        size_t len = 0;
        chunk_of(m, index, &d, &len);
        mc.data.data = (uint8_t *)d;
        mc.data.len = len;
    }
    wire_msg_t *r = tu_client_call(cl, FUSION__MSG_TYPE__MSG_MODEL_CHUNK, 0, &mc.base, FUSION__MSG_TYPE__MSG_UPLOAD_STATUS, 10000);
    assert_non_null(r);
    if (wire_msg_type(r) != FUSION__MSG_TYPE__MSG_UPLOAD_STATUS)
        fail_msg("chunk %u refused: %s", index, ((const Fusion__Error *)wire_msg_body(r))->message);
    wire_msg_destroy(&r);
}

/* Uploads m as a client would: announce, send what is missing, stub what the broker holds, commit.
 * Returns the model's name (static storage); *sent and *copied count the chunks. */
static const char *upload(tu_client *cl, mem_model *m, uint32_t *sent, uint32_t *copied)
{
    static char name[128];
    *sent = *copied = 0;
    wire_msg_t *r = announce(cl, &m->mu, false);
    const Fusion__UploadStatus *s = (const Fusion__UploadStatus *)wire_msg_body(r);
    if (s->model[0]) {
        snprintf(name, sizeof name, "%s", s->model);
        wire_msg_destroy(&r);
        return name;
    }
    for (size_t i = 0; i < s->n_missing; i++, (*sent)++)
        send_chunk(cl, m, s->missing[i], false);
    for (size_t i = 0; i < s->n_copy; i++, (*copied)++)
        send_chunk(cl, m, s->copy[i], true);
    wire_msg_destroy(&r);
    for (int wait = 0; wait < 200; wait++) { /* the broker flushes the files on its worker: ask until named */
        r = announce(cl, &m->mu, true);
        s = (const Fusion__UploadStatus *)wire_msg_body(r);
        assert_int_equal(s->n_missing + s->n_copy, 0);
        bool named = s->model[0] != '\0';
        snprintf(name, sizeof name, "%s", s->model);
        wire_msg_destroy(&r);
        if (named)
            return name;
        usleep(50 * 1000);
    }
    fail_msg("the upload was never named");
    return NULL;
}

static void test_upload_then_submit_and_dedup(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_fx_start(f);
    mem_model m;
    model_read(f, &m);
    manifest(&m);
    uint32_t sent, copied;
    char first[128];
    snprintf(first, sizeof first, "%s", upload(&f->cl, &m, &sent, &copied));
    print_message("uploaded as %s: %u chunks sent, %u copied\n", first, sent, copied);
    assert_true(strncmp(first, "u-", 2) == 0 && strlen(first) == 66);
    assert_true(sent >= 2);
    assert_int_equal(copied, 0);
    char p[TU_PATH];
    tu_path(f->c, p, "uploads/%s/model.safetensors", first);
    assert_true(fu_path_exists(p));
    /* a job on the uploaded name is accepted */
    char spec[8192];
    wire_msg_t *r = tu_client_submit(&f->cl, tu_finetune_spec(first, spec, sizeof spec), NULL);
    assert_non_null(r);
    if (wire_msg_type(r) != FUSION__MSG_TYPE__MSG_JOB_STATUS)
        fail_msg("the job on %s was refused: %s", first, ((const Fusion__Error *)wire_msg_body(r))->message);
    wire_msg_destroy(&r);
    /* the same manifest: named at once, nothing to send */
    assert_string_equal(upload(&f->cl, &m, &sent, &copied), first);
    assert_int_equal(sent + copied, 0);
    /* another model with the same weights: only config.json's chunk goes over the wire */
    const char *cfg2 = "{\"model_type\": \"llama\"}";
    free(m.data[0]);
    m.data[0] = (uint8_t *)strdup(cfg2);
    m.size[0] = strlen(cfg2);
    manifest(&m);
    const char *second = upload(&f->cl, &m, &sent, &copied);
    print_message("the second model %s: %u chunks sent, %u copied\n", second, sent, copied);
    assert_string_not_equal(second, first);
    assert_int_equal(sent, 1);
    assert_true(copied >= 1);
    char a[TU_PATH], b[TU_PATH];
    tu_path(f->c, a, "uploads/%s/model.safetensors", first);
    tu_path(f->c, b, "uploads/%s/model.safetensors", second);
    char *o = NULL;
    assert_int_equal(tu_sh(&o, "cmp '%s' '%s'", a, b), 0); /* copied bytes are the same bytes */
    free(o);
    model_free(&m);
}

static void test_upload_attacks_refused(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_args(f->c, "--upload-gib 1");
    tu_broker_fx_start(f);
    mem_model m;
    model_read(f, &m);
    manifest(&m);
    /* a chunk before any announcement */
    Fusion__ModelChunk mc = FUSION__MODEL_CHUNK__INIT;
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_CHUNK, &mc.base, "no upload of yours");
    wire_msg_t *r = announce(&f->cl, &m.mu, false);
    const Fusion__UploadStatus *s = (const Fusion__UploadStatus *)wire_msg_body(r);
    assert_true(s->n_missing >= 2);
    uint32_t first = s->missing[0], n = s->chunks;
    wire_msg_destroy(&r);
    /* bytes that are not the chunk's */
    const uint8_t *d = NULL;
    size_t len = 0;
    chunk_of(&m, first, &d, &len);
    uint8_t *bad = malloc(len);
    memcpy(bad, d, len);
    bad[len / 2] ^= 1;
    mc.index = first;
    mc.data = (ProtobufCBinaryData){.len = len, .data = bad};
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_CHUNK, &mc.base, "do not match its hash");
    free(bad);
    mc.data = (ProtobufCBinaryData){0};
    mc.index = n;
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_CHUNK, &mc.base, "chunk");
    /* a stub for bytes the broker does not hold */
    mc.index = first;
    mc.data = (ProtobufCBinaryData){0};
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_CHUNK, &mc.base, "not on the broker");
    /* a commit with chunks missing: no model, the list of what is missing */
    send_chunk(&f->cl, &m, first, false);
    r = announce(&f->cl, &m.mu, true);
    s = (const Fusion__UploadStatus *)wire_msg_body(r);
    assert_string_equal(s->model, "");
    assert_int_equal(s->n_missing, n - 1);
    wire_msg_destroy(&r);
    /* malformed manifests */
    const char *name0 = m.files[1].name;
    m.files[1].name = "../../escape";
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD, &m.mu.base, "plain");
    m.files[1].name = (char *)name0;
    m.files[0].name = "cfg.json";
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD, &m.mu.base, "config.json");
    m.files[0].name = "config.json";
    m.files[1].size += CHUNK;
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD, &m.mu.base, "chunks");
    m.files[1].size -= CHUNK;
    uint64_t size1 = m.files[1].size; /* a size that wraps the chunk count around */
    m.files[1].size = UINT64_MAX;
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD, &m.mu.base, "at most");
    m.files[1].size = size1;
    /* a model over --upload-gib (1): refused before a byte is sent */
    static ProtobufCBinaryData many[512];
    for (size_t i = 0; i < 512; i++)
        many[i] = m.hashes[1][0];
    Fusion__UploadFile *big = &m.files[1];
    size_t nc0 = big->n_chunks;
    uint64_t size0 = big->size;
    ProtobufCBinaryData *h0 = big->chunks;
    big->size = 512ull * CHUNK, big->n_chunks = 512, big->chunks = many;
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD, &m.mu.base, "--upload-gib");
    big->size = size0, big->n_chunks = nc0, big->chunks = h0;
    model_free(&m);
    /* a crash mid-upload leaves a staging directory: a restart removes it */
    char st[TU_PATH];
    tu_path(f->c, st, "uploads");
    char *o = NULL;
    assert_int_equal(tu_sh(&o, "ls -a '%s' | grep -c '^.staging-'", st), 0);
    free(o);
    (void)tu_broker_stop(f->c, SIGKILL);
    tu_broker_fx_start(f);
    assert_int_not_equal(tu_sh(&o, "ls -a '%s' | grep -c '^.staging-'", st), 0);
    free(o);
}

/* --upload-gib 0: no uploads, with a message that says where models come from instead. */
static void test_upload_off(void **state)
{
    tu_broker_fx *f = *state;
    tu_broker_args(f->c, "--upload-gib 0");
    tu_broker_fx_start(f);
    mem_model m;
    model_read(f, &m);
    manifest(&m);
    refused_with(&f->cl, FUSION__MSG_TYPE__MSG_MODEL_UPLOAD, &m.mu.base, "--model-root");
    model_free(&m);
}

int main(int argc, char **argv)
{
    if (tu_fake_peer_requested(argc, argv))
        return tu_fake_peer_main(argc, argv);
    const struct CMUnitTest tests[] = {
        tu_broker_test(test_upload_then_submit_and_dedup),
        tu_broker_test(test_upload_attacks_refused),
        tu_broker_test(test_upload_off),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
