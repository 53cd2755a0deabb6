/* fu_tokenizer: byte-level by default; byte-level BPE from a tokenizer.json the test writes itself
 * (both forms of merges), special tokens, GPT-2 splitting, round trips for ASCII, UTF-8 and random
 * bytes, and the features it refuses. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_file.h"
#include "fu_rng.h"
#include "fu_tokenizer.h"
#include "fu_unicode.h"
#include "testutil.h"

/* GPT-2's byte -> code point table, written out independently of the library's. */
static uint32_t gpt2_cp(uint32_t b)
{
    uint32_t n = 0;
    for (uint32_t x = 0; x < 256; x++) {
        bool keep = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
        if (x == b)
            return keep ? x : 256 + n;
        if (!keep)
            n++;
    }
    return 0;
}

/* Appends the JSON string of byte b's token ("\u0120" style escapes for safety). */
static void put_byte_token(char *buf, size_t cap, uint32_t b)
{
    size_t at = strlen(buf);
    snprintf(buf + at, cap - at, "\"\\u%04x\"", gpt2_cp(b));
}

/* Merges of the test tokenizer, in rank order, with the ids of what they make (256 + rank). The
 * text uses 'G' for the GPT-2 space character U+0120 ('Ġ'). */
static const char *const merges[][2] = {
    {"h", "e"},     /* 256 he */
    {"l", "l"},     /* 257 ll */
    {"he", "ll"},   /* 258 hell */
    {"hell", "o"},  /* 259 hello */
    {"G", "w"},     /* 260 Ġw */
    {"o", "r"},     /* 261 or */
    {"Gw", "or"},   /* 262 Ġwor */
    {"Gwor", "l"},  /* 263 Ġworl */
    {"Gworl", "d"}, /* 264 Ġworld */
    {"G", "t"},     /* 265 Ġt */
    {"Gt", "he"},   /* 266 Ġthe */
    {"3", "4"},     /* 267 34 */
};
#define N_MERGES (sizeof merges / sizeof merges[0])
#define ID_HELLO 259
#define ID_WORLD 264
#define ID_THE   266
#define ID_34    267
#define ID_BOS   268
#define ID_EOS   269

/* Writes s with 'G' replaced by the JSON escape of U+0120. */
static void put_sym(char *buf, size_t cap, const char *s)
{
    size_t at = strlen(buf);
    for (; *s && at + 8 < cap; s++) {
        if (*s == 'G')
            at += (size_t)snprintf(buf + at, cap - at, "\\u0120");
        else
            buf[at++] = *s, buf[at] = '\0';
    }
}

/* A small byte-level BPE tokenizer.json: the 256 byte tokens with id = byte value, the merges
 * above, <s> and </s>. pair_form chooses [a, b] merges instead of "a b". extra is spliced into the
 * top-level object (to add or override fields). Caller frees. */
static char *make_tokenizer_json(bool pair_form, const char *pre_tokenizer, const char *extra_model)
{
    size_t cap = 64 * 1024;
    char *j = calloc(1, cap);
    snprintf(j, cap,
             "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,"
             "\"added_tokens\":[{\"id\":%d,\"content\":\"<s>\",\"single_word\":false,\"lstrip\":false,"
             "\"rstrip\":false,\"normalized\":false,\"special\":true},"
             "{\"id\":%d,\"content\":\"</s>\",\"special\":true}],"
             "\"normalizer\":null,\"pre_tokenizer\":%s,"
             "\"post_processor\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true},"
             "\"decoder\":{\"type\":\"ByteLevel\"},"
             "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,%s\"vocab\":{",
             ID_BOS, ID_EOS, pre_tokenizer, extra_model);
    for (uint32_t b = 0; b < 256; b++) {
        put_byte_token(j, cap, b);
        size_t at = strlen(j);
        snprintf(j + at, cap - at, ":%u,", b);
    }
    for (size_t m = 0; m < N_MERGES; m++) {
        strcat(j, "\"");
        put_sym(j, cap, merges[m][0]);
        put_sym(j, cap, merges[m][1]);
        size_t at = strlen(j);
        snprintf(j + at, cap - at, "\":%zu%s", 256 + m, m + 1 < N_MERGES ? "," : "");
    }
    strcat(j, "},\"merges\":[");
    for (size_t m = 0; m < N_MERGES; m++) {
        strcat(j, pair_form ? "[\"" : "\"");
        put_sym(j, cap, merges[m][0]);
        strcat(j, pair_form ? "\",\"" : " ");
        put_sym(j, cap, merges[m][1]);
        strcat(j, pair_form ? "\"]" : "\"");
        if (m + 1 < N_MERGES)
            strcat(j, ",");
    }
    strcat(j, "]}}");
    return j;
}

static const char *bytelevel = "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,"
                               "\"use_regex\":true}";

static fu_tokenizer *bpe(bool pair_form)
{
    char *j = make_tokenizer_json(pair_form, bytelevel, "");
    fu_tokenizer *t = NULL;
    fu_errmsg em = {{0}};
    if (fu_tokenizer_parse_json(j, strlen(j), "tokenizer.json", &t, &em) != FU_OK)
        fail_msg("parse: %s", em.msg);
    free(j);
    return t;
}

/* Encodes text and compares with want[0..n). */
static void expect_ids(const fu_tokenizer *t, const char *text, const int32_t *want, size_t n)
{
    int32_t *ids = NULL;
    size_t got = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_tokenizer_encode(t, text, strlen(text), &ids, &got, &em), FU_OK);
    if (got != n || (n && memcmp(ids, want, n * sizeof *ids) != 0)) {
        char line[512] = "";
        for (size_t i = 0; i < got && i < 40; i++) {
            size_t at = strlen(line);
            snprintf(line + at, sizeof line - at, "%d ", ids[i]);
        }
        fail_msg("'%s' encoded to [%s] (%zu ids, wanted %zu)", text, line, got, n);
    }
    free(ids);
}

/* decode(encode(text)) == text. */
static void expect_round_trip(const fu_tokenizer *t, const char *text, size_t len)
{
    int32_t *ids = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_tokenizer_encode(t, text, len, &ids, &n, &em), FU_OK);
    char *back = NULL;
    size_t blen = 0;
    assert_int_equal(fu_tokenizer_decode(t, ids, n, &back, &blen, &em), FU_OK);
    assert_int_equal(blen, len);
    assert_memory_equal(back, text, len);
    assert_int_equal(back[blen], '\0');
    free(back);
    free(ids);
}

static void test_tokenizer_byte_level_default(void **state)
{
    (void)state;
    fu_tokenizer *t = fu_tokenizer_new_bytes(0);
    assert_non_null(t);
    assert_int_equal(fu_tokenizer_kind(t), FU_TOK_BYTES);
    assert_int_equal(fu_tokenizer_vocab_size(t), 256);
    const char text[] = "h\xc3\xa9llo\0x\xff";
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(fu_tokenizer_encode(t, text, sizeof text - 1, &ids, &n, NULL), FU_OK);
    assert_int_equal(n, sizeof text - 1);
    assert_int_equal(ids[0], 'h');
    assert_int_equal(ids[1], 0xc3);
    assert_int_equal(ids[6], 0);
    assert_int_equal(ids[8], 0xff);
    free(ids);
    expect_round_trip(t, text, sizeof text - 1);
    expect_round_trip(t, "", 0);
    assert_int_equal(fu_tokenizer_token_id(t, "A"), 65);
    assert_int_equal(fu_tokenizer_token_id(t, "AB"), -1);
    assert_null(fu_tokenizer_token(t, 65));
    assert_int_equal(fu_tokenizer_bos_id(t), -1);
    fu_tokenizer_destroy(&t);
    assert_null(t);
    fu_tokenizer_destroy(&t);

    /* A model vocab above 256: the extra ids decode to nothing; ids past it are refused. */
    t = fu_tokenizer_new_bytes(300);
    assert_int_equal(fu_tokenizer_vocab_size(t), 300);
    const int32_t some[] = {'o', 299, 'k'};
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(fu_tokenizer_decode(t, some, 3, &out, &len, NULL), FU_OK);
    assert_string_equal(out, "ok");
    free(out);
    const int32_t bad[] = {'o', 300};
    fu_errmsg em = {{0}};
    assert_int_equal(fu_tokenizer_decode(t, bad, 2, &out, &len, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "token id 300 is outside the vocabulary (size 300)"));
    const int32_t neg[] = {-1};
    assert_int_equal(fu_tokenizer_decode(t, neg, 1, &out, &len, &em), FU_EINVAL);
    fu_tokenizer_destroy(&t);
    assert_null(fu_tokenizer_new_bytes(FU_TOKENIZER_MAX_VOCAB + 1));
}

static void test_tokenizer_bpe_encodes_with_merges(void **state)
{
    (void)state;
    for (int form = 0; form < 2; form++) {
        fu_tokenizer *t = bpe(form == 1);
        assert_int_equal(fu_tokenizer_kind(t), FU_TOK_BPE);
        assert_int_equal(fu_tokenizer_vocab_size(t), 270);
        expect_ids(t, "hello", (const int32_t[]){ID_HELLO}, 1);
        expect_ids(t, "hello world", (const int32_t[]){ID_HELLO, ID_WORLD}, 2);
        expect_ids(t, "hello the world!", (const int32_t[]){ID_HELLO, ID_THE, ID_WORLD, '!'}, 4);
        /* Special tokens in the text. */
        expect_ids(t, "<s>hello</s>", (const int32_t[]){ID_BOS, ID_HELLO, ID_EOS}, 3);
        expect_ids(t, "<s> world</s></s>", (const int32_t[]){ID_BOS, ID_WORLD, ID_EOS, ID_EOS}, 4);
        expect_ids(t, "<x>", (const int32_t[]){'<', 'x', '>'}, 3);
        /* GPT-2 splitting: runs of spaces leave their last space to the next word. */
        expect_ids(t, "  hello", (const int32_t[]){' ', ' ', ID_HELLO}, 3);
        expect_ids(t, "hello  ", (const int32_t[]){ID_HELLO, ' ', ' '}, 3);
        expect_ids(t, "hello\n\nworld", (const int32_t[]){ID_HELLO, '\n', '\n', 'w', 261, 'l', 'd'}, 7); /* 261 = or */
        expect_ids(t, "it's", (const int32_t[]){'i', 't', '\'', 's'}, 4);
        expect_ids(t, "hellohello", (const int32_t[]){ID_HELLO, ID_HELLO}, 2); /* equal ranks: all merged */
        fu_tokenizer_destroy(&t);
    }
}

static void test_tokenizer_bpe_utf8_and_round_trips(void **state)
{
    (void)state;
    fu_tokenizer *t = bpe(false);
    /* é is two bytes, each its own byte token; "ll" still merges. */
    expect_ids(t, "h\xc3\xa9llo", (const int32_t[]){'h', 0xc3, 0xa9, 257, 'o'}, 5);
    const char *texts[] = {
        "hello world",
        "The quick brown fox jumps over the lazy dog. 0123456789 !@#$%^&*()",
        "  leading and trailing spaces   ",
        "tabs\tand\nnewlines\r\n",
        "h\xc3\xa9llo w\xc3\xb6rld \xe2\x9c\x93 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80",
        "<s>special</s> in <s>the</s> middle",
        "it's we're they've I'm you'll he'd",
        "",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        expect_round_trip(t, texts[i], strlen(texts[i]));
    /* Any bytes at all, invalid UTF-8 included. */
    fu_rng r;
    fu_rng_seed(&r, 99);
    char buf[3000];
    for (int iter = 0; iter < 20; iter++) {
        size_t n = (size_t)(fu_rng_next(&r) % sizeof buf);
        for (size_t i = 0; i < n; i++)
            buf[i] = iter % 2 ? (char)fu_rng_next(&r) : "hello world<s></s> \n"[fu_rng_next(&r) % 20];
        expect_round_trip(t, buf, n);
    }
    /* A long run of one character: merges stay fast (heap, not quadratic). */
    size_t big = 200000;
    char *lots = malloc(big);
    for (size_t i = 0; i < big; i++)
        lots[i] = 'l';
    expect_round_trip(t, lots, big);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(fu_tokenizer_encode(t, lots, big, &ids, &n, NULL), FU_OK);
    assert_int_equal(n, big / 2); /* "ll" pairs, leftmost first */
    free(ids);
    free(lots);

    assert_int_equal(fu_tokenizer_token_id(t, "<s>"), ID_BOS);
    assert_int_equal(fu_tokenizer_token_id(t, "hello"), ID_HELLO);
    assert_int_equal(fu_tokenizer_token_id(t, "nope"), -1);
    assert_string_equal(fu_tokenizer_token(t, ID_HELLO), "hello");
    assert_string_equal(fu_tokenizer_token(t, ID_WORLD), "\xc4\xa0world"); /* Ġworld */
    assert_null(fu_tokenizer_token(t, 5000));
    assert_int_equal(fu_tokenizer_bos_id(t), ID_BOS);
    assert_int_equal(fu_tokenizer_eos_id(t), ID_EOS);
    const int32_t bad[] = {ID_HELLO, 270};
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(fu_tokenizer_decode(t, bad, 2, &out, &len, NULL), FU_EINVAL);
    fu_tokenizer_destroy(&t);
}

static void test_tokenizer_prefix_space_and_ignore_merges(void **state)
{
    (void)state;
    char *j = make_tokenizer_json(false, "{\"type\":\"ByteLevel\",\"add_prefix_space\":true}", "");
    fu_tokenizer *t = NULL;
    assert_int_equal(fu_tokenizer_parse_json(j, strlen(j), NULL, &t, NULL), FU_OK);
    expect_ids(t, "world", (const int32_t[]){ID_WORLD}, 1);
    fu_tokenizer_destroy(&t);
    free(j);
    /* A Sequence holding only ByteLevel is the same thing. */
    j = make_tokenizer_json(false, "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"ByteLevel\"}]}", "");
    assert_int_equal(fu_tokenizer_parse_json(j, strlen(j), NULL, &t, NULL), FU_OK);
    expect_ids(t, "hello world", (const int32_t[]){ID_HELLO, ID_WORLD}, 2);
    fu_tokenizer_destroy(&t);
    free(j);
    /* Llama-3 style: a Split with Llama-3's pattern, then ByteLevel without its own regex. Digits go
     * by threes, so "1234" is "123" + "4" and the "3 4" merge cannot apply; with GPT-2's rule the
     * digits stay together and it does. */
    const char *llama3 =
        "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
        "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| "
        "?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},"
        "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
        "\"trim_offsets\":true,\"use_regex\":false}]}";
    j = make_tokenizer_json(false, llama3, "");
    fu_errmsg em = {{0}};
    if (fu_tokenizer_parse_json(j, strlen(j), NULL, &t, &em) != FU_OK)
        fail_msg("llama3: %s", em.msg);
    expect_ids(t, "hello world", (const int32_t[]){ID_HELLO, ID_WORLD}, 2);
    expect_ids(t, "1234", (const int32_t[]){'1', '2', '3', '4'}, 4);
    expect_ids(t, "x34", (const int32_t[]){'x', ID_34}, 2); /* "x" then "34": a new piece */
    expect_ids(t, "234", (const int32_t[]){'2', ID_34}, 2);
    const char *mixed = "Hello, World!\r\n\n  IT'S 12345 (x) \xe6\x97\xa5";
    expect_round_trip(t, mixed, strlen(mixed));
    fu_tokenizer_destroy(&t);
    free(j);
    t = bpe(false);
    expect_ids(t, "1234", (const int32_t[]){'1', '2', ID_34}, 3);
    fu_tokenizer_destroy(&t);
    /* An unknown Split pattern, or a double split, is refused. */
    j = make_tokenizer_json(false, "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":"
                                   "{\"Regex\":\"\\\\w+\"},\"behavior\":\"Isolated\"},{\"type\":\"ByteLevel\"}]}", "");
    assert_int_equal(fu_tokenizer_parse_json(j, strlen(j), NULL, &t, &em), FU_EVERSION);
    assert_non_null(strstr(em.msg, "is not one fusion knows"));
    free(j);
    /* ignore_merges: a word in the vocab is taken whole. Without merges "hello" would be bytes. */
    j = make_tokenizer_json(false, bytelevel, "\"ignore_merges\":true,");
    char *m = strstr(j, "\"merges\":[");
    assert_non_null(m);
    strcpy(m, "\"merges\":[]}}");
    assert_int_equal(fu_tokenizer_parse_json(j, strlen(j), NULL, &t, NULL), FU_OK);
    expect_ids(t, "hello hellp", (const int32_t[]){ID_HELLO, ' ', 'h', 'e', 'l', 'l', 'p'}, 7);
    fu_tokenizer_destroy(&t);
    free(j);
}

static void test_tokenizer_refuses_what_it_cannot_do(void **state)
{
    (void)state;
    fu_tokenizer *t = NULL;
    fu_errmsg em = {{0}};
    struct {
        const char *json;
        fu_err      rc;
        const char *says;
    } cases[] = {
        {"{", FU_EPROTO, "not valid JSON"},
        {"[]", FU_EPROTO, "not a JSON object"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"}}", FU_EPROTO, "no \"model\" object"},
        {"{\"normalizer\":{\"type\":\"NFKC\"},\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{}}", FU_EVERSION,
         "normalizer 'NFKC' is not supported"},
        {"{\"normalizer\":{\"type\":\"Replace\",\"pattern\":{\"Regex\":\" +\"},\"content\":\" \"},"
         "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{}}",
         FU_EVERSION, "Replace normalizer is supported with a String pattern only"},
        {"{\"pre_tokenizer\":{\"type\":\"Whitespace\"},\"model\":{}}", FU_EVERSION, "pre_tokenizer 'Whitespace'"},
        {"{\"pre_tokenizer\":{\"type\":\"Metaspace\"},\"model\":{}}", FU_EPROTO, "needs a \"replacement\""},
        {"{\"pre_tokenizer\":{\"type\":\"Metaspace\",\"replacement\":\"_\",\"split\":true},\"model\":{}}", FU_EVERSION,
         "split=true"},
        {"{\"pre_tokenizer\":{\"type\":\"Metaspace\",\"replacement\":\"_\",\"prepend_scheme\":\"sometimes\"},"
         "\"model\":{}}",
         FU_EPROTO, "prepend_scheme"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0}}}", FU_EVERSION, "needs a Metaspace decoder or a decoder Sequence"},
        {"{\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"CTC\"}]},\"model\":{\"type\":\"BPE\","
         "\"vocab\":{\"a\":0}}}",
         FU_EVERSION, "decoder 'CTC' is not supported"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", FU_EVERSION,
         "model type 'WordPiece'"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"byte_fallback\":true,"
         "\"vocab\":{\"a\":0}}}",
         FU_EVERSION, "byte_fallback with a ByteLevel pre-tokenizer"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"dropout\":0.1,\"vocab\":{\"a\":0}}}",
         FU_EVERSION, "dropout"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\","
         "\"continuing_subword_prefix\":\"##\",\"vocab\":{\"a\":0}}}",
         FU_EVERSION, "continuing_subword_prefix"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{}}}", FU_EPROTO,
         "vocabulary is empty"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-1}}}", FU_EPROTO,
         "no valid id"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":99999999}}}",
         FU_EPROTO, "no valid id"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":0}}}",
         FU_EPROTO, "id 0 is given to both"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
         "\"merges\":[\"a b\"]}}",
         FU_EPROTO, "not in the vocab"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
         "\"merges\":[\"ab\"]}}",
         FU_EPROTO, "not two tokens"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},"
         "\"merges\":[[\"a\"]]}}",
         FU_EPROTO, "neither"},
        {"{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"added_tokens\":[{\"id\":3}],\"model\":{\"type\":\"BPE\","
         "\"vocab\":{\"a\":0}}}",
         FU_EPROTO, "added_tokens entry 0"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memset(&em, 0, sizeof em);
        fu_err rc = fu_tokenizer_parse_json(cases[i].json, strlen(cases[i].json), "tokenizer.json", &t, &em);
        if (rc != cases[i].rc || !strstr(em.msg, cases[i].says))
            fail_msg("case %zu: rc %d, message '%s', wanted '%s'", i, rc, em.msg, cases[i].says);
        assert_null(t);
    }
    /* A byte with no token and no unk_token: encoding that byte fails, others work. */
    const char *small = "{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\","
                        "\"vocab\":{\"a\":0,\"b\":1,\"ab\":2},\"merges\":[\"a b\"]}}";
    assert_int_equal(fu_tokenizer_parse_json(small, strlen(small), NULL, &t, &em), FU_OK);
    expect_ids(t, "abab", (const int32_t[]){2, 2}, 2);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(fu_tokenizer_encode(t, "abc", 3, &ids, &n, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "byte 0x63 has no token"));
    assert_null(ids);
    fu_tokenizer_destroy(&t);
}

static void test_tokenizer_open_dir(void **state)
{
    (void)state;
    char *dir = tu_tmpdir("tok");
    fu_tokenizer *t = NULL;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_tokenizer_open_dir(dir, 256, false, &t, &em), FU_OK);
    assert_int_equal(fu_tokenizer_kind(t), FU_TOK_BYTES);
    fu_tokenizer_destroy(&t);
    /* more ids than bytes and no tokenizer.json: refused, unless byte ids are asked for */
    assert_int_equal(fu_tokenizer_open_dir(dir, 32000, false, &t, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "32000 token ids but no tokenizer.json"));
    assert_null(t);
    assert_int_equal(fu_tokenizer_open_dir(dir, 32000, true, &t, &em), FU_OK);
    assert_int_equal(fu_tokenizer_kind(t), FU_TOK_BYTES);
    fu_tokenizer_destroy(&t);
    char *j = make_tokenizer_json(false, bytelevel, "");
    char *p = fu_path_join(dir, FU_TOKENIZER_FILE);
    assert_int_equal(fu_file_write_atomic(p, j, strlen(j), 0644, NULL), FU_OK);
    assert_int_equal(fu_tokenizer_open_dir(dir, 300, true, &t, &em), FU_OK);
    assert_int_equal(fu_tokenizer_kind(t), FU_TOK_BPE);
    expect_ids(t, "hello", (const int32_t[]){ID_HELLO}, 1);
    fu_tokenizer_destroy(&t);
    assert_int_equal(fu_tokenizer_open_dir(dir, 256, false, &t, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "tokenizer.json has ids up to 269 but the model's vocab_size is 256"));
    assert_null(t);
    assert_int_equal(fu_file_write_atomic(p, "{\"model\":", 9, 0644, NULL), FU_OK);
    assert_int_equal(fu_tokenizer_open_dir(dir, 300, true, &t, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "tokenizer.json: not valid JSON"));
    assert_int_equal(fu_tokenizer_load("/nonexistent/tokenizer.json", &t, &em), FU_ENOTFOUND);
    free(p);
    free(j);
    tu_tmpdir_remove(&dir);
}

/* fu_unicode: categories as the regular expressions see them, and NFC (decomposition, canonical
 * order, composition, Hangul, blocking, invalid bytes kept). */
static void test_tokenizer_unicode_classes_and_nfc(void **state)
{
    (void)state;
    assert_true(fu_uni_is_letter('a') && fu_uni_is_letter(0x4F60) && fu_uni_is_letter(0x0416) && fu_uni_is_letter(0xAC00));
    assert_false(fu_uni_is_letter(0x0301) || fu_uni_is_letter(0x00A1) || fu_uni_is_letter('1') || fu_uni_is_letter(0x1F916));
    assert_true(fu_uni_is_number('7') && fu_uni_is_number(0x0663) && fu_uni_is_number(0x00BE) && fu_uni_is_number(0x2460));
    assert_true(fu_uni_is_space(0x3000) && fu_uni_is_space(0xFEFF) && fu_uni_is_space('\t'));
    assert_false(fu_uni_is_space(0x0085) || fu_uni_is_space(0x200B)); /* as JavaScript's \s */
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"e\xcc\x81", "\xc3\xa9"},                       /* e + acute -> é */
        {"A\xcc\x8a", "\xc3\x85"},                       /* A + ring -> Å */
        {"\xe1\x84\x92\xe1\x85\xa1\xe1\x86\xab", "\xed\x95\x9c"}, /* jamo H A N -> 한 */
        {"a\xcc\x82\xcc\xa3", "\xe1\xba\xad"},              /* a + circumflex + dot below: reordered -> ậ */
        {"\xe2\x84\xab", "\xc3\x85"},                       /* Angstrom sign (a singleton) -> Å */
        {"e\xcc\x81\xcc\x81", "\xc3\xa9\xcc\x81"},              /* the second acute is blocked */
        {"x\xff\xcc\x81y", "x\xff\xcc\x81y"},                /* an invalid byte stays and blocks */
        {"plain ascii", "plain ascii"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *out = NULL;
        size_t n = 0;
        assert_int_equal(fu_uni_nfc(cases[i].in, strlen(cases[i].in), &out, &n), FU_OK);
        if (n != strlen(cases[i].out) || memcmp(out, cases[i].out, n) != 0)
            fail_msg("NFC case %zu: got %zu bytes", i, n);
        free(out);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenizer_byte_level_default),
        cmocka_unit_test(test_tokenizer_bpe_encodes_with_merges),
        cmocka_unit_test(test_tokenizer_bpe_utf8_and_round_trips),
        cmocka_unit_test(test_tokenizer_prefix_space_and_ignore_merges),
        cmocka_unit_test(test_tokenizer_refuses_what_it_cannot_do),
        cmocka_unit_test(test_tokenizer_open_dir),
        cmocka_unit_test(test_tokenizer_unicode_classes_and_nfc),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
