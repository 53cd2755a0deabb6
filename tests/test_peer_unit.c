/* Peer pieces in one process: the measured profile, the job spec and the data order of
 * docs/PIPELINE.md, and blob fetches (hash verification, refusal, the cache by hash). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <sodium.h>

#include "fu_encode.h"
#include "fu_file.h"
#include "fu_rng.h"
#include "kern_backend.h"
#include "peer_blob.h"
#include "peer_profile.h"
#include "dag_spec.h"
#include "testutil.h"

static void test_peer_profile_measures_this_machine(void **state)
{
    (void)state;
    peer_profile p;
    fu_errmsg em = {{0}};
    assert_int_equal(peer_profile_measure(kern_backend_cpu(), 0, 0.3, &p, &em), FU_OK);
    char line[512];
    peer_profile_format(&p, line, sizeof line);
    printf("measured profile: %s\n", line);
    assert_true(p.n_speeds >= 1);
    assert_int_equal(p.dtypes[0], KERN_F32);
    /* Any CPU of the last 15 years does a 512^3 sgemm at more than 0.5 GFLOP/s, and none at
     * 100 TFLOP/s: outside that the measurement is broken. */
    assert_true(p.gflops[0] > 0.5 && p.gflops[0] < 1e5);
    assert_true(p.free_memory_bytes > (64u << 20));
    assert_true(p.free_memory_bytes <= p.device_free_bytes);
    assert_true(p.threads >= 1);
    assert_true(strncmp(p.device_name, "cpu", 3) == 0);
    /* --max-memory caps what is offered. */
    peer_profile q;
    assert_int_equal(peer_profile_measure(kern_backend_cpu(), 100u << 20, 0.05, &q, &em), FU_OK);
    assert_int_equal(q.free_memory_bytes, 100u << 20);
}

/* The data order of spec s (what a stage computes for itself). */
static fu_err peer_data_rows(const dag_spec *s, const int32_t *ids, size_t n, uint64_t step, uint32_t mb, int32_t *tok,
                             int32_t *tgt)
{
    dag_data_order o = dag_spec_data_order(s);
    return dag_data_rows(&o, ids, n, step, mb, tok, tgt);
}

static void test_peer_spec_parses_the_contract_example(void **state)
{
    (void)state;
    const char *js = "{\"model\": \"/srv/models/tiny\", \"method\": \"lora-fa\", \"rank\": 8, \"alpha\": 16, "
                     "\"targets\": [\"q_proj\", \"down_proj\"], \"lr\": 0.01, \"weight_decay\": 0.0, \"steps\": 40, "
                     "\"batch\": 4, \"seq_len\": 64, \"micro_batches\": 2, \"shuffle\": true, \"seed\": 1, "
                     "\"checkpoint_every\": 5}";
    dag_spec s;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_parse(js, strlen(js), DAG_JOB_ANY, &s, &em), FU_OK);
    assert_int_equal(s.kind, DAG_JOB_FINETUNE);
    assert_true(s.lr == 0.01);
    assert_int_equal(s.steps, 40);
    assert_int_equal(s.batch, 4);
    assert_int_equal(s.seq_len, 64);
    assert_int_equal(s.micro_batches, 2);
    assert_true(s.shuffle);
    assert_int_equal(s.seed, 1);
    assert_int_equal(s.checkpoint_every, 5);
    dag_spec_clear(&s);

    const char *inf = "{\"model\":\"m\",\"adapter_job\":\"\",\"max_tokens\":5,\"temperature\":0,\"top_k\":0,"
                      "\"top_p\":1,\"seed\":3,\"dump_logits\":true,\"prompt_tokens\":[1,2,3]}";
    assert_int_equal(dag_spec_parse(inf, strlen(inf), DAG_JOB_ANY, &s, &em), FU_OK);
    assert_int_equal(s.kind, DAG_JOB_INFER);
    assert_int_equal(s.max_tokens, 5);
    assert_true(s.dump_logits);
    assert_int_equal(s.n_prompt_tokens, 3);
    assert_int_equal(s.prompt_tokens[2], 3);
    dag_spec_clear(&s);

    /* Wrong types, bad values, broken JSON: refused, never a crash. */
    const char *bad[] = {"{\"steps\": \"ten\"}", "{\"batch\": 4, \"micro_batches\": 3}", "{\"lr\": -1}",
                         "{\"steps\": 1.5}", "{\"steps\": 10", "[1,2]", "{\"a\" 1}", "", "{\"x\": tru}",
                         "{\"prompt_tokens\": [1, -2]}", "{\"nested\": {\"a\": [1, {\"b\": null}]}}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fu_err rc = dag_spec_parse(bad[i], strlen(bad[i]), DAG_JOB_ANY, &s, &em);
        assert_true(rc == FU_EINVAL || rc == FU_EPROTO);
    }
    /* Deep nesting is refused, not recursed into without bound. */
    char deep[4096];
    size_t n = 0;
    n += (size_t)snprintf(deep, sizeof deep, "{\"x\":");
    for (int i = 0; i < 1000; i++)
        deep[n++] = '[';
    deep[n] = '\0';
    assert_int_equal(dag_spec_parse(deep, n, DAG_JOB_ANY, &s, &em), FU_EPROTO);
}

/* The data order, written out the way PIPELINE.md states it. */
static void test_peer_data_order_follows_the_contract(void **state)
{
    (void)state;
    enum { T = 3, NTOK = 4 * 7 + 2 }; /* W = 7 windows of 4 tokens */
    int32_t ids[NTOK];
    for (int i = 0; i < NTOK; i++)
        ids[i] = 1000 + i;
    dag_spec s;
    dag_spec_init(&s, DAG_JOB_FINETUNE);
    s.batch = 4;
    s.seq_len = T;
    s.micro_batches = 2;
    s.steps = 10;
    int32_t tok[2 * T], tgt[2 * T];
    /* Identity order: step 2, micro-batch 1 → k = 2*4 + 1*2 + j = 10, 11 → windows 3, 4. */
    assert_int_equal(peer_data_rows(&s, ids, NTOK, 2, 1, tok, tgt), FU_OK);
    for (int j = 0; j < 2; j++)
        for (int t = 0; t < T; t++) {
            assert_int_equal(tok[j * T + t], 1000 + (3 + j) * (T + 1) + t);
            assert_int_equal(tgt[j * T + t], 1000 + (3 + j) * (T + 1) + t + 1);
        }
    /* Shuffled: every epoch visits each window once, with the permutation of seed + epoch. */
    s.shuffle = true;
    s.seed = 5;
    size_t W = 7;
    for (uint64_t epoch = 0; epoch < 3; epoch++) {
        size_t order[7];
        for (size_t i = 0; i < W; i++)
            order[i] = i;
        fu_rng r;
        fu_rng_seed(&r, s.seed + epoch);
        for (size_t i = W; i > 1; i--) {
            size_t j = (size_t)(fu_rng_next(&r) % i), t = order[i - 1];
            order[i - 1] = order[j];
            order[j] = t;
        }
        for (size_t idx = 0; idx < W; idx++) {
            uint64_t k = epoch * W + idx; /* global row index */
            uint64_t step = k / 4, rem = k % 4;
            uint32_t mb = (uint32_t)(rem / 2), j = (uint32_t)(rem % 2);
            assert_int_equal(peer_data_rows(&s, ids, NTOK, step, mb, tok, tgt), FU_OK);
            assert_int_equal(tok[j * T], 1000 + (int32_t)(order[idx] * (T + 1)));
        }
    }
    /* No window at all: refused. */
    assert_int_equal(peer_data_rows(&s, ids, 3, 0, 0, tok, tgt), FU_EINVAL);
}

/* Serves a blob as a broker would: chunks of `chunk` bytes of [offset, offset+length). */
static void serve(peer_blob_t *b, const uint8_t *blob, size_t len, const uint8_t hash[32], size_t chunk, bool *done,
                  fu_err *last, int *requests)
{
    Fusion__WeightRequest req;
    uint64_t now = 1000;
    *done = false;
    *last = FU_OK;
    int guard = 0;
    while (!*done && guard++ < 1000 && peer_blob_request(b, now, &req)) {
        (*requests)++;
        uint64_t end = req.length ? req.offset + req.length : len;
        if (end > len)
            end = len;
        uint64_t off = req.offset;
        do {
            size_t n = (size_t)(end - off < chunk ? end - off : chunk);
            Fusion__WeightChunk c = FUSION__WEIGHT_CHUNK__INIT;
            c.model_id = (char *)"m:x";
            c.tensor_name = (char *)"w";
            c.offset = off;
            c.total = len;
            c.content_hash.data = (uint8_t *)hash;
            c.content_hash.len = 32;
            c.data.data = (uint8_t *)blob + off;
            c.data.len = n;
            c.dtype = FUSION__DTYPE__DTYPE_U8;
            int64_t shape[1] = {(int64_t)len};
            c.shape = shape;
            c.n_shape = 1;
            *last = peer_blob_feed(b, &c, now, done);
            if (*last != FU_OK && *last != FU_EIO)
                return;
            off += n;
        } while (off < end && !*done);
        now += 10;
    }
}

/* Windows sized by the link: about a second of it, within PEER_BLOB_WINDOW_MIN..PEER_BLOB_WINDOW; a
 * fetch asks for exactly that and still assembles the blob. */
static void test_peer_blob_window_follows_the_link(void **state)
{
    (void)state;
    assert_int_equal(peer_blob_window_for(0), PEER_BLOB_WINDOW);                 /* not measured */
    assert_int_equal(peer_blob_window_for(1000000000), PEER_BLOB_WINDOW);        /* LAN */
    assert_int_equal(peer_blob_window_for(1250000), 1250000);                    /* 10 Mbit/s */
    assert_int_equal(peer_blob_window_for(10000), PEER_BLOB_WINDOW_MIN);         /* 80 kbit/s */
    size_t len = 3u << 20;
    uint8_t *blob = malloc(len);
    for (size_t i = 0; i < len; i++)
        blob[i] = (uint8_t)(i * 13 + 1);
    uint8_t hash[32];
    peer_blob_hash(hash, blob, len);
    peer_blob_t *b = peer_blob_new("m:x", "w", NULL, (uint64_t)1 << 30);
    peer_blob_set_window(b, 1250000);
    Fusion__WeightRequest req;
    assert_true(peer_blob_request(b, 1000, &req));
    assert_int_equal(req.length, 1250000);
    peer_blob_destroy(&b);
    b = peer_blob_new("m:x", "w", NULL, (uint64_t)1 << 30);
    peer_blob_set_window(b, 1250000);
    bool done;
    fu_err rc;
    int reqs = 0;
    serve(b, blob, len, hash, 1u << 20, &done, &rc, &reqs);
    assert_true(done);
    assert_int_equal(reqs, 3); /* ceil(3 MiB / 1.25 MB) */
    assert_memory_equal(peer_blob_data(b, NULL), blob, len);
    peer_blob_destroy(&b);
    free(blob);
}

static void test_peer_blob_verifies_refuses_and_caches(void **state)
{
    (void)state;
    size_t len = (PEER_BLOB_WINDOW * 2) + 12345; /* three windows */
    uint8_t *blob = malloc(len);
    for (size_t i = 0; i < len; i++)
        blob[i] = (uint8_t)(i * 31 + 7);
    uint8_t hash[32], bad[32];
    peer_blob_hash(hash, blob, len);
    memcpy(bad, hash, 32);
    bad[0] ^= 1;
    char *cache = tu_tmpdir("peer-cache");
    bool done;
    fu_err rc;
    int reqs = 0;

    /* A blob whose bytes do not hash to the hash sent with it: refused 3 times, then FU_EAUTH. */
    peer_blob_t *b = peer_blob_new("m:x", "w", NULL, (uint64_t)1 << 30);
    serve(b, blob, len, bad, 1u << 20, &done, &rc, &reqs);
    assert_false(done);
    assert_int_equal(rc, FU_EAUTH);
    uint32_t bad_fetches;
    peer_blob_counters(b, &bad_fetches, NULL, NULL);
    assert_int_equal(bad_fetches, PEER_BLOB_ATTEMPTS);
    peer_blob_destroy(&b);

    /* Good blob: verified, cached under its hash. */
    b = peer_blob_new("m:x", "w", cache, (uint64_t)1 << 30);
    reqs = 0;
    serve(b, blob, len, hash, 1u << 20, &done, &rc, &reqs);
    assert_true(done);
    assert_int_equal(rc, FU_OK);
    assert_int_equal(reqs, 1 + 3); /* probe + three windows */
    size_t got;
    assert_memory_equal(peer_blob_data(b, &got), blob, len);
    assert_int_equal(got, len);
    peer_blob_destroy(&b);
    char hex[65];
    fu_hex_encode(hex, hash, 32);
    char *path = fu_path_join(cache, hex);
    assert_true(fu_path_exists(path));

    /* Second fetch: served from the cache after the probe. */
    b = peer_blob_new("m:x", "w", cache, (uint64_t)1 << 30);
    reqs = 0;
    serve(b, blob, len, hash, 1u << 20, &done, &rc, &reqs);
    bool hit;
    peer_blob_counters(b, NULL, NULL, &hit);
    assert_true(done && hit);
    assert_int_equal(reqs, 1);
    peer_blob_destroy(&b);

    /* A cache file with the wrong contents: refused (removed) and fetched again. */
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    fseek(f, 100, SEEK_SET);
    fputc(0x5a ^ blob[100], f);
    fclose(f);
    b = peer_blob_new("m:x", "w", cache, (uint64_t)1 << 30);
    reqs = 0;
    serve(b, blob, len, hash, 1u << 20, &done, &rc, &reqs);
    uint32_t bad_cache;
    peer_blob_counters(b, NULL, &bad_cache, &hit);
    assert_true(done);
    assert_false(hit);
    assert_int_equal(bad_cache, 1);
    assert_memory_equal(peer_blob_data(b, &got), blob, len);
    peer_blob_destroy(&b);
    char *d = NULL;
    size_t dl = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_file_read_all(path, len + 1, &d, &dl, &em), FU_OK);
    assert_int_equal(dl, len);
    assert_memory_equal(d, blob, len); /* the refetched, verified copy replaced the bad one */
    free(d);

    /* A blob over the memory budget is refused before anything is allocated for it. */
    b = peer_blob_new("m:x", "w", NULL, 1000);
    reqs = 0;
    serve(b, blob, len, hash, 1u << 20, &done, &rc, &reqs);
    assert_int_equal(rc, FU_ENOMEM);
    peer_blob_destroy(&b);

    tu_tmpdir_remove(&cache);
    free(path);
    free(blob);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peer_profile_measures_this_machine),
        cmocka_unit_test(test_peer_spec_parses_the_contract_example),
        cmocka_unit_test(test_peer_data_order_follows_the_contract),
        cmocka_unit_test(test_peer_blob_verifies_refuses_and_caches),
        cmocka_unit_test(test_peer_blob_window_follows_the_link),
    };
    return tu_unit_main(tests, sodium_init, NULL, NULL);
}
