/* fu_safetensors and fu_file: write/read round trips per dtype, sharded directories, and every way
 * a hostile or damaged file can be wrong. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fu_file.h"
#include "fu_rng.h"
#include "fu_safetensors.h"
#include "testutil.h"

static char *path_in(const char *name)
{
    return fu_path_join(tu_dir, name);
}

/* A safetensors image built by hand: header text + data bytes. Caller frees. */
static uint8_t *make_image(const char *header, size_t data_len, size_t *len)
{
    size_t h = strlen(header);
    *len = 8 + h + data_len;
    uint8_t *b = calloc(1, *len ? *len : 1);
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    for (size_t i = 0; i < data_len; i++)
        b[8 + h + i] = (uint8_t)i;
    return b;
}

/* Parses a hand-made image and returns the result; em gets the message. */
static fu_err parse_text(const char *header, size_t data_len, fu_errmsg *em)
{
    size_t len;
    uint8_t *b = make_image(header, data_len, &len);
    fu_safetensors *st = NULL;
    memset(em, 0, sizeof *em);
    fu_err rc = fu_safetensors_parse_header(b, len, "bad.safetensors", &st, em);
    if (rc == FU_OK)
        assert_non_null(st);
    else
        assert_null(st);
    fu_safetensors_close(&st);
    free(b);
    return rc;
}

static void test_safetensors_half_conversions(void **state)
{
    (void)state;
    assert_int_equal(fu_f32_to_f16(1.0f), 0x3C00);
    assert_int_equal(fu_f32_to_f16(-2.0f), 0xC000);
    assert_int_equal(fu_f32_to_f16(65504.0f), 0x7BFF);
    assert_int_equal(fu_f32_to_f16(1e6f), 0x7C00);          /* overflow to inf */
    assert_int_equal(fu_f32_to_f16(0x1.0p-24f), 0x0001);    /* smallest subnormal */
    assert_int_equal(fu_f32_to_f16(0x1.0p-26f), 0x0000);    /* underflow */
    assert_int_equal(fu_f32_to_f16(1.0f + 0x1.0p-11f), 0x3C00); /* tie: to even */
    assert_int_equal(fu_f32_to_f16(1.0f + 0x1.8p-10f), 0x3C02); /* tie at 1.5 ulp: to even */
    assert_int_equal(fu_f32_to_f16(1.0f + 0x1.8p-11f), 0x3C01); /* 0.75 ulp: up */
    assert_true(isnan(fu_f16_to_f32(fu_f32_to_f16(NAN))));
    assert_true(fu_f16_to_f32(0x3555) > 0.333f && fu_f16_to_f32(0x3555) < 0.3334f);
    assert_true(fu_f16_to_f32(0x0001) == 0x1.0p-24f);
    assert_true(isinf(fu_f16_to_f32(0xFC00)) && fu_f16_to_f32(0xFC00) < 0);
    /* Every half value survives the round trip through float. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF))
            continue; /* NaNs: payload may change */
        assert_int_equal(fu_f32_to_f16(fu_f16_to_f32((uint16_t)h)), h);
    }
    assert_int_equal(fu_f32_to_bf16(1.0f), 0x3F80);
    assert_int_equal(fu_f32_to_bf16(-1.0f), 0xBF80);
    assert_int_equal(fu_f32_to_bf16(1.0f + 0x1.0p-8f), 0x3F80);  /* tie: to even */
    assert_int_equal(fu_f32_to_bf16(1.0f + 0x1.8p-7f), 0x3F82);
    assert_int_equal(fu_f32_to_bf16(1.0f + 0x1.8p-8f), 0x3F81);
    assert_true(fu_bf16_to_f32(0x4049) > 3.14f && fu_bf16_to_f32(0x4049) < 3.15f);
    assert_true(isnan(fu_bf16_to_f32(fu_f32_to_bf16(NAN))));
}

#define RT_N 24

static void test_safetensors_round_trip_every_dtype(void **state)
{
    (void)state;
    float src[RT_N];
    for (int i = 0; i < RT_N; i++)
        src[i] = (float)(i - 12) * 0.37f + 0.001f * (float)i;
    uint8_t f16[RT_N * 2], bf16[RT_N * 2];
    assert_int_equal(fu_st_from_f32(FU_ST_F16, src, RT_N, f16), FU_OK);
    assert_int_equal(fu_st_from_f32(FU_ST_BF16, src, RT_N, bf16), FU_OK);
    int64_t i64[3] = {-1, 0, (int64_t)1 << 40};
    int32_t i32[5] = {1, -2, 3, -4, 5};
    uint8_t u8[7] = {0xff, 1, 2, 3, 4, 5, 6};
    fu_st_tensor t[6] = {
        {.name = "a.f32", .dtype = FU_ST_F32, .ndim = 2, .shape = {4, 6}, .data = src, .nbytes = sizeof src},
        {.name = "b.f16", .dtype = FU_ST_F16, .ndim = 2, .shape = {6, 4}, .data = f16, .nbytes = sizeof f16},
        {.name = "c.bf16", .dtype = FU_ST_BF16, .ndim = 1, .shape = {RT_N}, .data = bf16, .nbytes = sizeof bf16},
        {.name = "d.i64", .dtype = FU_ST_I64, .ndim = 1, .shape = {3}, .data = i64, .nbytes = sizeof i64},
        {.name = "e.i32", .dtype = FU_ST_I32, .ndim = 1, .shape = {5}, .data = i32, .nbytes = sizeof i32},
        {.name = "f.u8 \"quoted\"", .dtype = FU_ST_U8, .ndim = 1, .shape = {7}, .data = u8, .nbytes = sizeof u8},
    };
    char *p = path_in("rt.safetensors");
    const char *meta[] = {"producer", "fusion test"};
    fu_errmsg em = {{0}};
    assert_int_equal(fu_safetensors_write(p, t, 6, meta, 1, NULL, NULL, &em), FU_OK);
    /* In memory: the same bytes as the file (checkpoints travel this way, with no temp file). */
    uint8_t *mem = NULL;
    size_t mem_len = 0;
    assert_int_equal(fu_safetensors_serialize(t, 6, meta, 1, NULL, NULL, &mem, &mem_len, &em), FU_OK);
    char *file_bytes = NULL;
    size_t file_len = 0;
    assert_int_equal(fu_file_read_all(p, 1 << 20, &file_bytes, &file_len, &em), FU_OK);
    assert_int_equal(mem_len, file_len);
    assert_memory_equal(mem, file_bytes, file_len);
    free(mem);
    free(file_bytes);
    fu_st_tensor dup[2] = {t[0], t[0]};
    assert_int_equal(fu_safetensors_serialize(dup, 2, NULL, 0, NULL, NULL, &mem, &mem_len, &em), FU_EINVAL);

    fu_safetensors *st = NULL;
    assert_int_equal(fu_safetensors_open_file(p, &st, &em), FU_OK);
    assert_int_equal(fu_safetensors_count(st), 6);
    assert_string_equal(fu_safetensors_metadata(st, "format"), "pt");
    assert_string_equal(fu_safetensors_metadata(st, "producer"), "fusion test");
    assert_null(fu_safetensors_metadata(st, "nope"));
    /* Sorted by name. */
    assert_string_equal(fu_safetensors_at(st, 0)->name, "a.f32");
    assert_null(fu_safetensors_at(st, 6));

    float back[RT_N];
    const uint64_t s46[2] = {4, 6}, s64[2] = {6, 4}, s24[1] = {RT_N};
    assert_int_equal(fu_safetensors_read_f32(st, "a.f32", 2, s46, back, RT_N, &em), FU_OK);
    assert_memory_equal(back, src, sizeof src);
    assert_int_equal(fu_safetensors_read_f32(st, "b.f16", 2, s64, back, RT_N, &em), FU_OK);
    for (int i = 0; i < RT_N; i++)
        assert_true(fabsf(back[i] - src[i]) <= fabsf(src[i]) * 0x1.0p-11f + 1e-7f);
    assert_int_equal(fu_safetensors_read_f32(st, "c.bf16", 1, s24, back, RT_N, &em), FU_OK);
    for (int i = 0; i < RT_N; i++)
        assert_true(fabsf(back[i] - src[i]) <= fabsf(src[i]) * 0x1.0p-8f + 1e-7f);

    const fu_st_tensor *x = fu_safetensors_get(st, "d.i64");
    assert_non_null(x);
    assert_int_equal(x->dtype, FU_ST_I64);
    assert_int_equal(x->nbytes, sizeof i64);
    assert_memory_equal(x->data, i64, sizeof i64);
    assert_int_equal(((uintptr_t)x->data) % 8, 0); /* 8-byte types first, data section 8-aligned */
    x = fu_safetensors_get(st, "e.i32");
    assert_memory_equal(x->data, i32, sizeof i32);
    assert_int_equal(((uintptr_t)x->data) % 4, 0);
    x = fu_safetensors_get(st, "a.f32");
    assert_int_equal(((uintptr_t)x->data) % 4, 0);
    assert_string_equal(x->file, "rt.safetensors");
    x = fu_safetensors_get(st, "f.u8 \"quoted\"");
    assert_non_null(x);
    assert_memory_equal(x->data, u8, sizeof u8);

    /* Integers are not floats. */
    int32_t dummy[5];
    assert_int_equal(fu_st_tensor_to_f32(fu_safetensors_get(st, "e.i32"), (float *)dummy, 5, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "rt.safetensors: tensor 'e.i32' has dtype I32"));
    /* Wrong buffer length. */
    assert_int_equal(fu_st_tensor_to_f32(fu_safetensors_get(st, "a.f32"), back, 3, &em), FU_EINVAL);
    fu_safetensors_close(&st);
    assert_null(st);
    fu_safetensors_close(&st); /* idempotent */

    /* The file's header is 8-aligned: the data section starts at a multiple of 8. */
    char *txt = NULL;
    size_t len = 0;
    assert_int_equal(fu_file_read_all(p, 1 << 20, &txt, &len, &em), FU_OK);
    uint64_t hlen;
    memcpy(&hlen, txt, 8);
    assert_int_equal((8 + hlen) % 8, 0);
    assert_non_null(strstr(txt + 8, "\"__metadata__\":{\"format\":\"pt\""));
    free(txt);
    free(p);
}

static void test_safetensors_shape_and_missing_errors_name_file_and_tensor(void **state)
{
    (void)state;
    static float w[64 * 32];
    fu_st_tensor t = {.name = "model.layers.3.mlp.up_proj.weight", .dtype = FU_ST_F32, .ndim = 2, .shape = {64, 32},
                      .data = w, .nbytes = sizeof w};
    char *dir = path_in("shape-model");
    assert_int_equal(fu_mkdir_p(dir, 0755, NULL), FU_OK);
    char *p = fu_path_join(dir, "model.safetensors");
    fu_errmsg em = {{0}};
    assert_int_equal(fu_safetensors_write(p, &t, 1, NULL, 0, NULL, NULL, &em), FU_OK);
    fu_safetensors *st = NULL;
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_OK);
    const uint64_t want[2] = {128, 32};
    const fu_st_tensor *got = NULL;
    assert_int_equal(fu_safetensors_expect(st, "model.layers.3.mlp.up_proj.weight", 2, want, &got, &em), FU_EINVAL);
    assert_null(got);
    assert_string_equal(em.msg, "model.safetensors: tensor 'model.layers.3.mlp.up_proj.weight' has shape [64, 32], "
                                "expected [128, 32]");
    const uint64_t want1[1] = {64};
    assert_int_equal(fu_safetensors_expect(st, "model.layers.3.mlp.up_proj.weight", 1, want1, &got, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "expected [64]"));
    assert_int_equal(fu_safetensors_find(st, "lm_head.weight", &got, &em), FU_ENOTFOUND);
    assert_string_equal(em.msg, "model.safetensors: no tensor 'lm_head.weight'");
    float out[10];
    assert_int_equal(fu_safetensors_read_f32(st, "lm_head.weight", 2, want, out, 10, &em), FU_ENOTFOUND);
    assert_null(fu_safetensors_get(st, "lm_head.weight"));
    const uint64_t ok[2] = {64, 32};
    assert_int_equal(fu_safetensors_expect(st, "model.layers.3.mlp.up_proj.weight", 2, ok, &got, &em), FU_OK);
    assert_non_null(got);
    fu_safetensors_close(&st);

    /* A directory without weights. */
    char *empty = path_in("no-weights");
    assert_int_equal(fu_mkdir_p(empty, 0755, NULL), FU_OK);
    assert_int_equal(fu_safetensors_open_dir(empty, &st, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "has no model.safetensors"));
    assert_int_equal(fu_safetensors_open_dir("/nonexistent/fusion", &st, &em), FU_ENOTFOUND);
    assert_int_equal(fu_safetensors_open_file("/nonexistent/x.safetensors", &st, &em), FU_ENOTFOUND);
    assert_null(st);
    free(empty);
    free(p);
    free(dir);
}

static void write_shard(const char *dir, const char *file, const char *n1, const char *n2, float base)
{
    float a[6], b[3];
    for (int i = 0; i < 6; i++)
        a[i] = base + (float)i;
    for (int i = 0; i < 3; i++)
        b[i] = -base - (float)i;
    fu_st_tensor t[2] = {
        {.name = n1, .dtype = FU_ST_F32, .ndim = 2, .shape = {2, 3}, .data = a, .nbytes = sizeof a},
        {.name = n2, .dtype = FU_ST_F32, .ndim = 1, .shape = {3}, .data = b, .nbytes = sizeof b},
    };
    char *p = fu_path_join(dir, file);
    assert_int_equal(fu_safetensors_write(p, t, 2, NULL, 0, NULL, NULL, NULL), FU_OK);
    free(p);
}

static void write_index(const char *dir, const char *json)
{
    char *p = fu_path_join(dir, FU_ST_INDEX_FILE);
    assert_int_equal(fu_file_write_atomic(p, json, strlen(json), 0644, NULL), FU_OK);
    free(p);
}

static void test_safetensors_sharded_index(void **state)
{
    (void)state;
    char *dir = path_in("sharded");
    assert_int_equal(fu_mkdir_p(dir, 0755, NULL), FU_OK);
    write_shard(dir, "model-00001-of-00002.safetensors", "model.embed_tokens.weight", "model.norm.weight", 1.0f);
    write_shard(dir, "model-00002-of-00002.safetensors", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                10.0f);
    write_index(dir, "{\"metadata\":{\"total_size\":72},\"weight_map\":{"
                     "\"model.embed_tokens.weight\":\"model-00001-of-00002.safetensors\","
                     "\"model.norm.weight\":\"model-00001-of-00002.safetensors\","
                     "\"lm_head.weight\":\"model-00002-of-00002.safetensors\","
                     "\"model.layers.0.input_layernorm.weight\":\"model-00002-of-00002.safetensors\"}}");
    fu_safetensors *st = NULL;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_OK);
    assert_int_equal(fu_safetensors_count(st), 4);
    const fu_st_tensor *t = fu_safetensors_get(st, "lm_head.weight");
    assert_non_null(t);
    assert_string_equal(t->file, "model-00002-of-00002.safetensors");
    float v[6];
    const uint64_t s23[2] = {2, 3};
    assert_int_equal(fu_safetensors_read_f32(st, "lm_head.weight", 2, s23, v, 6, &em), FU_OK);
    assert_true(v[0] == 10.0f && v[5] == 15.0f);
    assert_int_equal(fu_safetensors_read_f32(st, "model.embed_tokens.weight", 2, s23, v, 6, &em), FU_OK);
    assert_true(v[0] == 1.0f && v[5] == 6.0f);
    const uint64_t s4[1] = {4};
    assert_int_equal(fu_safetensors_read_f32(st, "model.norm.weight", 1, s4, v, 4, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "model-00001-of-00002.safetensors: tensor 'model.norm.weight' has shape [3], "
                                   "expected [4]"));
    fu_safetensors_close(&st);

    /* weight_map points at the wrong shard. */
    write_index(dir, "{\"weight_map\":{\"lm_head.weight\":\"model-00001-of-00002.safetensors\"}}");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "'lm_head.weight' is not in model-00001-of-00002.safetensors"));
    /* A shard that does not exist. */
    write_index(dir, "{\"weight_map\":{\"lm_head.weight\":\"model-00003-of-00002.safetensors\"}}");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "model-00003-of-00002.safetensors"));
    /* Paths out of the directory are refused. */
    write_index(dir, "{\"weight_map\":{\"lm_head.weight\":\"../model-00001-of-00002.safetensors\"}}");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "not a plain file name"));
    write_index(dir, "{\"weight_map\":{\"lm_head.weight\":\"/etc/passwd\"}}");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_EPROTO);
    write_index(dir, "{\"weight_map\":[]}");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_EPROTO);
    write_index(dir, "{\"weight_map\":{\"x\":7}}");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_EPROTO);
    write_index(dir, "not json");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, FU_ST_INDEX_FILE));
    /* The same tensor in two shards. */
    write_shard(dir, "dup.safetensors", "lm_head.weight", "other", 0.0f);
    write_index(dir, "{\"weight_map\":{\"lm_head.weight\":\"model-00002-of-00002.safetensors\","
                     "\"other\":\"dup.safetensors\"}}");
    assert_int_equal(fu_safetensors_open_dir(dir, &st, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "'lm_head.weight' is in both"));
    assert_null(st);
    free(dir);
}

static void test_safetensors_rejects_bad_headers(void **state)
{
    (void)state;
    fu_errmsg em;
    /* The minimal valid image: no tensors. */
    assert_int_equal(parse_text("{}", 0, &em), FU_OK);
    assert_int_equal(parse_text("{\"__metadata__\":{\"format\":\"pt\"}}  ", 0, &em), FU_OK);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", 4, &em), FU_OK);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[0,5],\"data_offsets\":[0,0]}}", 0, &em), FU_OK);

    /* Too short for the length prefix. */
    fu_safetensors *st = NULL;
    memset(&em, 0, sizeof em);
    assert_int_equal(fu_safetensors_parse_header((const uint8_t *)"abc", 3, "short.safetensors", &st, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "short.safetensors: truncated"));
    assert_int_equal(fu_safetensors_parse_header(NULL, 0, "empty.safetensors", &st, &em), FU_EPROTO);
    /* Header length over the limit, and past the end of the file. */
    uint8_t big[16] = {0};
    uint64_t hl = FU_ST_HEADER_MAX + 1;
    memcpy(big, &hl, 8);
    assert_int_equal(fu_safetensors_parse_header(big, sizeof big, "big.safetensors", &st, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "over the"));
    hl = 100;
    memcpy(big, &hl, 8);
    assert_int_equal(fu_safetensors_parse_header(big, sizeof big, "big.safetensors", &st, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "truncated: header length is 100"));
    hl = UINT64_MAX;
    memcpy(big, &hl, 8);
    assert_int_equal(fu_safetensors_parse_header(big, sizeof big, "big.safetensors", &st, &em), FU_EPROTO);

    /* Not JSON, not an object, trailing bytes. */
    assert_int_equal(parse_text("{\"x\":", 0, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "bad.safetensors: header is not valid JSON"));
    assert_int_equal(parse_text("[1,2]", 0, &em), FU_EPROTO);
    assert_int_equal(parse_text("{} xx", 0, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":3}", 0, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"__metadata__\":{\"a\":1}}", 0, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"__metadata__\":[]}", 0, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &em), FU_EPROTO);

    /* Fields missing or of the wrong type. */
    assert_int_equal(parse_text("{\"x\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":1,\"data_offsets\":[0,4]}}", 4, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[\"1\"],\"data_offsets\":[0,4]}}", 4, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4, &em), FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
                                &em),
                     FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,4]}}", 4, &em),
                     FU_EPROTO);
    /* Unknown dtype. */
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, &em),
                     FU_EVERSION);
    assert_non_null(strstr(em.msg, "bad.safetensors: tensor 'x' has dtype 'F8_E4M3'"));

    /* Element count and byte size overflow. */
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
                                "\"data_offsets\":[0,4]}}",
                                4, &em),
                     FU_EPROTO);
    assert_non_null(strstr(em.msg, "overflows"));
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],"
                                "\"data_offsets\":[0,8]}}",
                                8, &em),
                     FU_EPROTO);

    /* Offsets: begin after end, size mismatch, out of range, overlap, gap, tail. */
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "begin after end"));
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 8, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "shape [2] of F32 needs 8 bytes"));
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "bad.safetensors: tensor 'x' ends at byte 8 of the data section, which has only 4"));
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[9007199254740988,"
                                "9007199254740992]}}",
                                4, &em),
                     FU_EPROTO);
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                                12, &em),
                     FU_EPROTO);
    assert_non_null(strstr(em.msg, "overlaps"));
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "gap"));
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 9, &em), FU_EPROTO);
    assert_non_null(strstr(em.msg, "has 9 bytes but its tensors cover 4"));
    /* Too many JSON values for the parser's memory (checked before parsing). */
    size_t big_n = 2 * ((size_t)FU_ST_MAX_JSON_VALUES + 16) + 16;
    char *huge = malloc(big_n);
    strcpy(huge, "{\"x\":[");
    size_t at = strlen(huge);
    while (at + 4 < big_n) {
        huge[at++] = '0';
        huge[at++] = ',';
    }
    strcpy(huge + at, "0]}");
    assert_int_equal(parse_text(huge, 0, &em), FU_ENOMEM);
    assert_non_null(strstr(em.msg, "JSON values"));
    free(huge);
    /* A duplicated tensor name. */
    assert_int_equal(parse_text("{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                                "\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                                2, &em),
                     FU_EPROTO);
    assert_non_null(strstr(em.msg, "listed twice"));
}

static void test_safetensors_truncated_file_names_the_file(void **state)
{
    (void)state;
    float w[100];
    for (int i = 0; i < 100; i++)
        w[i] = (float)i;
    fu_st_tensor t = {.name = "w", .dtype = FU_ST_F32, .ndim = 2, .shape = {10, 10}, .data = w, .nbytes = sizeof w};
    char *p = path_in("trunc.safetensors");
    assert_int_equal(fu_safetensors_write(p, &t, 1, NULL, 0, NULL, NULL, NULL), FU_OK);
    struct stat sb;
    assert_int_equal(stat(p, &sb), 0);
    fu_safetensors *st = NULL;
    fu_errmsg em = {{0}};
    /* Cut into the data, then into the header, then into the length. */
    const off_t cuts[] = {sb.st_size - 1, sb.st_size - 400, 20, 5, 0};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        assert_int_equal(truncate(p, cuts[i]), 0);
        memset(&em, 0, sizeof em);
        assert_int_equal(fu_safetensors_open_file(p, &st, &em), FU_EPROTO);
        assert_null(st);
        assert_true(strncmp(em.msg, "trunc.safetensors: ", 19) == 0);
        if (i < 2)
            assert_non_null(strstr(em.msg, "truncated file?"));
        else
            assert_non_null(strstr(em.msg, "truncated"));
    }
    free(p);
}

/* Random damage to a valid image: whatever comes out, it is FU_OK or an error, never a crash. Under
 * ASan this is a small in-tree fuzz run of fu_safetensors_parse_header. */
static void test_safetensors_survives_random_damage(void **state)
{
    (void)state;
    float a[12] = {0};
    uint16_t b[5] = {0};
    fu_st_tensor t[2] = {
        {.name = "model.layers.0.mlp.up_proj.weight", .dtype = FU_ST_F32, .ndim = 2, .shape = {3, 4}, .data = a,
         .nbytes = sizeof a},
        {.name = "model.norm.weight", .dtype = FU_ST_BF16, .ndim = 1, .shape = {5}, .data = b, .nbytes = sizeof b},
    };
    char *p = path_in("fuzz.safetensors");
    assert_int_equal(fu_safetensors_write(p, t, 2, NULL, 0, NULL, NULL, NULL), FU_OK);
    char *img = NULL;
    size_t len = 0;
    assert_int_equal(fu_file_read_all(p, 1 << 20, &img, &len, NULL), FU_OK);
    fu_rng r;
    fu_rng_seed(&r, 1234);
    uint8_t *buf = malloc(len);
    size_t ok = 0;
    for (int iter = 0; iter < 4000; iter++) {
        memcpy(buf, img, len);
        size_t n = len;
        int flips = 1 + (int)(fu_rng_next(&r) % 4);
        for (int k = 0; k < flips; k++) {
            size_t at = (size_t)(fu_rng_next(&r) % len);
            switch (fu_rng_next(&r) % 4) {
            case 0: buf[at] ^= (uint8_t)(1u << (fu_rng_next(&r) % 8)); break;
            case 1: buf[at] = (uint8_t)fu_rng_next(&r); break;
            case 2: buf[at] = (uint8_t)"{}[],:\"0123456789-e. \\"[fu_rng_next(&r) % 22]; break;
            default: n = at; break;
            }
        }
        fu_safetensors *st = NULL;
        fu_errmsg em = {{0}};
        fu_err rc = fu_safetensors_parse_header(buf, n, "fuzz.safetensors", &st, &em);
        if (rc == FU_OK) {
            ok++;
            for (size_t i = 0; i < fu_safetensors_count(st); i++) {
                const fu_st_tensor *x = fu_safetensors_at(st, i);
                assert_true((const uint8_t *)x->data + x->nbytes <= buf + n);
                if (fu_st_dtype_is_float(x->dtype) && x->nelem < 4096) {
                    float tmp[4096];
                    assert_int_equal(fu_st_tensor_to_f32(x, tmp, x->nelem, NULL), FU_OK);
                }
            }
        } else {
            assert_true(rc == FU_EPROTO || rc == FU_EVERSION || rc == FU_ENOMEM);
            assert_true(em.msg[0] != '\0');
        }
        fu_safetensors_close(&st);
    }
    assert_true(ok > 0); /* some damage lands in data or padding and leaves a valid file */
    free(buf);
    free(img);
    free(p);
}

static fu_err fill_iota(void *ctx, size_t index, const fu_st_tensor *t, void *buf, size_t nbytes)
{
    (void)ctx;
    (void)t;
    uint8_t *b = buf;
    for (size_t i = 0; i < nbytes; i++)
        b[i] = (uint8_t)(index + i);
    return FU_OK;
}

static fu_err fill_fail(void *ctx, size_t index, const fu_st_tensor *t, void *buf, size_t nbytes)
{
    (void)ctx, (void)index, (void)t, (void)buf, (void)nbytes;
    return FU_EIO;
}

static void test_safetensors_writer_refuses_bad_lists(void **state)
{
    (void)state;
    float a[4] = {0};
    char *p = path_in("w.safetensors");
    fu_errmsg em = {{0}};
    fu_st_tensor dup[2] = {
        {.name = "x", .dtype = FU_ST_F32, .ndim = 1, .shape = {4}, .data = a, .nbytes = sizeof a},
        {.name = "x", .dtype = FU_ST_U8, .ndim = 1, .shape = {16}, .data = a, .nbytes = sizeof a},
    };
    assert_int_equal(fu_safetensors_write(p, dup, 2, NULL, 0, NULL, NULL, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "'x' is given twice"));
    fu_st_tensor bad = {.name = "y", .dtype = FU_ST_F32, .ndim = 1, .shape = {5}, .data = a, .nbytes = sizeof a};
    assert_int_equal(fu_safetensors_write(p, &bad, 1, NULL, 0, NULL, NULL, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "'y' has 16 bytes of data, its shape needs 20"));
    fu_st_tensor noname = {.name = "", .dtype = FU_ST_F32, .ndim = 1, .shape = {4}, .data = a, .nbytes = sizeof a};
    assert_int_equal(fu_safetensors_write(p, &noname, 1, NULL, 0, NULL, NULL, &em), FU_EINVAL);
    fu_st_tensor nodata = {.name = "z", .dtype = FU_ST_F32, .ndim = 1, .shape = {4}};
    assert_int_equal(fu_safetensors_write(p, &nodata, 1, NULL, 0, NULL, NULL, &em), FU_EINVAL);
    assert_false(fu_path_exists(p));
    /* A failing fill leaves no file and no temp file behind. */
    assert_int_equal(fu_safetensors_write(p, &nodata, 1, NULL, 0, fill_fail, NULL, &em), FU_EIO);
    assert_false(fu_path_exists(p));
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "ls '%s' | grep -c tmp-", tu_dir), 1); /* grep found nothing */
    free(out);
    /* The fill callback path. */
    assert_int_equal(fu_safetensors_write(p, &nodata, 1, NULL, 0, fill_iota, NULL, &em), FU_OK);
    fu_safetensors *st = NULL;
    assert_int_equal(fu_safetensors_open_file(p, &st, &em), FU_OK);
    const fu_st_tensor *z = fu_safetensors_get(st, "z");
    assert_non_null(z);
    assert_int_equal(((const uint8_t *)z->data)[15], 15);
    fu_safetensors_close(&st);
    /* Into a directory that does not exist. */
    assert_int_equal(fu_safetensors_write("/nonexistent/dir/x.safetensors", &bad, 0, NULL, 0, NULL, NULL, &em),
                     FU_ENOTFOUND);
    free(p);
}

static void test_safetensors_file_helpers(void **state)
{
    (void)state;
    char *d = path_in("a/b/c");
    fu_errmsg em = {{0}};
    assert_int_equal(fu_mkdir_p(d, 0755, &em), FU_OK);
    assert_int_equal(fu_mkdir_p(d, 0755, &em), FU_OK); /* exists already */
    assert_true(fu_path_is_dir(d));
    bool empty = false;
    assert_int_equal(fu_dir_is_empty(d, &empty), FU_OK);
    assert_true(empty);
    char *f = fu_path_join(d, "x.txt");
    assert_int_equal(fu_file_write_atomic(f, "hello", 5, 0600, &em), FU_OK);
    assert_int_equal(fu_dir_is_empty(d, &empty), FU_OK);
    assert_false(empty);
    assert_int_equal(fu_dir_is_empty(f, &empty), FU_EINVAL);
    char *txt = NULL;
    size_t n = 0;
    assert_int_equal(fu_file_read_all(f, 100, &txt, &n, &em), FU_OK);
    assert_int_equal(n, 5);
    assert_string_equal(txt, "hello");
    free(txt);
    assert_int_equal(fu_file_read_all(f, 4, &txt, &n, &em), FU_ENOMEM);
    assert_int_equal(fu_file_write_atomic(f, "bye", 3, 0600, &em), FU_OK); /* replace */
    assert_int_equal(fu_file_read_all(f, 100, &txt, &n, &em), FU_OK);
    assert_string_equal(txt, "bye");
    free(txt);
    struct stat sb;
    assert_int_equal(stat(f, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    assert_int_equal(fu_mkdir_p(f, 0755, &em), FU_EEXIST); /* a file in the way */
    char *under = fu_path_join(f, "sub");
    assert_int_equal(fu_mkdir_p(under, 0755, &em), FU_EEXIST);
    free(under);
    fu_mmap m;
    assert_int_equal(fu_mmap_open(f, &m, &em), FU_OK);
    assert_int_equal(m.size, 3);
    assert_memory_equal(m.data, "bye", 3);
    fu_mmap_close(&m);
    fu_mmap_close(&m);
    assert_int_equal(fu_mmap_open("/nonexistent/q", &m, &em), FU_ENOTFOUND);
    assert_int_equal(fu_file_read_all("/nonexistent/q", 10, &txt, &n, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "/nonexistent/q"));
    assert_string_equal(fu_path_base("/a/b/c.json"), "c.json");
    assert_string_equal(fu_path_base("c.json"), "c.json");
    char *j = fu_path_join("dir/", "f");
    assert_string_equal(j, "dir/f");
    free(j);
    assert_string_equal(fu_errmsg_text(NULL, FU_EIO), fu_strerror(FU_EIO));
    free(f);
    free(d);
}

static void test_safetensors_rng_is_deterministic(void **state)
{
    (void)state;
    fu_rng a, b;
    fu_rng_seed(&a, 42);
    fu_rng_seed(&b, 42);
    for (int i = 0; i < 100; i++)
        assert_true(fu_rng_next(&a) == fu_rng_next(&b));
    fu_rng_seed_stream(&a, 42, "x");
    fu_rng_seed_stream(&b, 42, "y");
    assert_true(fu_rng_next(&a) != fu_rng_next(&b));
    /* Normal samples: mean about 0, std about 1. */
    fu_rng_seed(&a, 7);
    double s = 0, s2 = 0;
    const int n = 20000;
    for (int i = 0; i < n; i++) {
        double x = fu_rng_normal(&a);
        s += x;
        s2 += x * x;
    }
    assert_true(fabs(s / n) < 0.05);
    assert_true(fabs(s2 / n - 1.0) < 0.05);
    for (int i = 0; i < 1000; i++) {
        double u = fu_rng_uniform(&a);
        assert_true(u >= 0.0 && u < 1.0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_safetensors_half_conversions),
        cmocka_unit_test(test_safetensors_round_trip_every_dtype),
        cmocka_unit_test(test_safetensors_shape_and_missing_errors_name_file_and_tensor),
        cmocka_unit_test(test_safetensors_sharded_index),
        cmocka_unit_test(test_safetensors_rejects_bad_headers),
        cmocka_unit_test(test_safetensors_truncated_file_names_the_file),
        cmocka_unit_test(test_safetensors_survives_random_damage),
        cmocka_unit_test(test_safetensors_writer_refuses_bad_lists),
        cmocka_unit_test(test_safetensors_file_helpers),
        cmocka_unit_test(test_safetensors_rng_is_deterministic),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
