/* fu_modelcfg: config.json of LLaMA-family models: valid, invalid, missing, written and read back,
 * and the list of weights with their Hugging Face names and shapes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "testutil.h"

/* The config.json of TinyLlama-1.1B (as published), trimmed of nothing. */
static const char *tinyllama =
    "{\n"
    "  \"architectures\": [\"LlamaForCausalLM\"],\n"
    "  \"attention_bias\": false,\n"
    "  \"bos_token_id\": 1,\n"
    "  \"eos_token_id\": 2,\n"
    "  \"hidden_act\": \"silu\",\n"
    "  \"hidden_size\": 2048,\n"
    "  \"initializer_range\": 0.02,\n"
    "  \"intermediate_size\": 5632,\n"
    "  \"max_position_embeddings\": 2048,\n"
    "  \"model_type\": \"llama\",\n"
    "  \"num_attention_heads\": 32,\n"
    "  \"num_hidden_layers\": 22,\n"
    "  \"num_key_value_heads\": 4,\n"
    "  \"pretraining_tp\": 1,\n"
    "  \"rms_norm_eps\": 1e-05,\n"
    "  \"rope_scaling\": null,\n"
    "  \"rope_theta\": 10000.0,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"torch_dtype\": \"bfloat16\",\n"
    "  \"transformers_version\": \"4.35.0\",\n"
    "  \"use_cache\": true,\n"
    "  \"vocab_size\": 32000\n"
    "}\n";

static fu_err parse(const char *json, fu_modelcfg *c, fu_errmsg *em)
{
    memset(em, 0, sizeof *em);
    return fu_modelcfg_parse(json, strlen(json), "config.json", c, em);
}

/* Parses json and checks the config reads `want` (tu_modelcfg_text). */
static void expect_config(const char *json, const char *want)
{
    fu_modelcfg c;
    fu_errmsg em;
    if (parse(json, &c, &em) != FU_OK)
        fail_msg("%s: %s", json, em.msg);
    char text[TU_MODELCFG_TEXT_MAX];
    assert_string_equal(tu_modelcfg_text(&c, text, sizeof text), want);
}

static void test_modelcfg_parses_a_real_config(void **state)
{
    (void)state;
    expect_config(tinyllama,
                  "llama LlamaForCausalLM bfloat16 layers 22 hidden 2048 heads 32/4 head_dim 64 ffn 5632 "
                  "vocab 32000 max_pos 2048 eps 1e-05 theta 10000 tied 0 bos 1 eos 2 window 0");
    /* 1.1B parameters. */
    fu_modelcfg c;
    fu_errmsg em;
    assert_int_equal(parse(tinyllama, &c, &em), FU_OK);
    uint64_t p = fu_modelcfg_param_count(&c);
    assert_true(p > 1090000000ull && p < 1110000000ull);
}

static void test_modelcfg_defaults_for_missing_fields(void **state)
{
    (void)state;
    /* kv heads = heads, head_dim = hidden/heads, no dtype, the default eps, theta and max_pos, no bos,
     * the first of the eos ids. */
    char want[TU_MODELCFG_TEXT_MAX];
    snprintf(want, sizeof want,
             "mistral MistralForCausalLM  layers 1 hidden 32 heads 4/4 head_dim 8 ffn 64 vocab 100 max_pos "
             "%d eps %g "
             "theta 10000 tied 0 bos -1 eos 7 window 4096",
             FU_MODELCFG_DEFAULT_MAX_POS, FU_MODELCFG_DEFAULT_RMS_EPS);
    expect_config("{\"model_type\":\"mistral\",\"hidden_size\":32,\"intermediate_size\":64,"
                  "\"num_hidden_layers\":1,\"num_attention_heads\":4,\"vocab_size\":100,"
                  "\"eos_token_id\":[7,8],\"sliding_window\":4096}",
                  want);
    /* An explicit head_dim need not be hidden/heads. */
    snprintf(
        want, sizeof want,
        "llama LlamaForCausalLM  layers 1 hidden 30 heads 4/2 head_dim 16 ffn 64 vocab 100 max_pos %d eps %g "
        "theta 10000 tied 1 bos -1 eos -1 window 0",
        FU_MODELCFG_DEFAULT_MAX_POS, FU_MODELCFG_DEFAULT_RMS_EPS);
    expect_config("{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":30,\"intermediate_size\":64,"
                  "\"num_hidden_layers\":1,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                  "\"head_dim\":16,\"vocab_size\":100,\"tie_word_embeddings\":true}",
                  want);
}

/* A valid base config with the fields `extra` added must be refused with rc and a message that holds
 * `says`. */
static void expect_refused(const char *extra, fu_err rc, const char *says)
{
    char json[1024];
    snprintf(json, sizeof json,
             "{\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":2,\"vocab_size\":256%s}",
             extra);
    fu_modelcfg c;
    fu_errmsg em;
    fu_err got = parse(json, &c, &em);
    if (got != rc || !strstr(em.msg, says))
        fail_msg("for %s: %s '%s', expected %s and '%s'", json, fu_errname(got), em.msg, fu_errname(rc),
                 says);
}

static void test_modelcfg_rejects_invalid_configs(void **state)
{
    (void)state;
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":5", FU_EINVAL,
                   "hidden_size 64 is not divisible by num_attention_heads 5");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"num_key_value_heads\":3", FU_EINVAL,
                   "num_attention_heads 4 is not divisible by num_key_value_heads 3");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":0", FU_EINVAL,
                   "num_attention_heads must be positive");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":-4", FU_EPROTO,
                   "\"num_attention_heads\" must be a non-negative integer");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4.5", FU_EPROTO,
                   "non-negative integer");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":\"4\"", FU_EPROTO,
                   "non-negative integer");
    expect_refused(",\"model_type\":\"llama\"", FU_EPROTO, "\"num_attention_heads\" is missing");
    expect_refused(",\"model_type\":\"gpt2\",\"num_attention_heads\":4", FU_EVERSION,
                   "model_type 'gpt2' is not supported");
    expect_refused(",\"architectures\":[\"GPT2LMHeadModel\"],\"num_attention_heads\":4", FU_EVERSION,
                   "architecture 'GPT2LMHeadModel' is not supported");
    expect_refused(",\"num_attention_heads\":4", FU_EVERSION, "neither \"model_type\" nor \"architectures\"");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"hidden_act\":\"gelu\"", FU_EVERSION,
                   "hidden_act");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"mlp_bias\":true", FU_EVERSION,
                   "mlp_bias");
    expect_refused(",\"model_type\":\"qwen2\",\"num_attention_heads\":4,\"use_sliding_window\":true", FU_EVERSION,
                   "use_sliding_window=true is not supported for qwen2");
    expect_refused(
        ",\"model_type\":\"llama\",\"num_attention_heads\":4,\"rope_scaling\":{\"type\":\"linear\"}",
        FU_EVERSION, "rope_scaling");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"rms_norm_eps\":0", FU_EINVAL,
                   "rms_norm_eps");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"rope_theta\":-1", FU_EINVAL,
                   "rope_theta");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"tie_word_embeddings\":1", FU_EPROTO,
                   "\"tie_word_embeddings\" must be true or false");
    expect_refused(
        ",\"model_type\":\"llama\",\"num_attention_heads\":4,\"max_position_embeddings\":100000000",
        FU_EINVAL, "max_position_embeddings 100000000 is over the limit");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":64,\"head_dim\":3", FU_EINVAL,
                   "head_dim 3 must be even");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"max_position_embeddings\":1e30",
                   FU_EPROTO, "\"max_position_embeddings\" must be a non-negative integer");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"bos_token_id\":300", FU_EINVAL,
                   "bos_token_id");
    fu_modelcfg c;
    fu_errmsg em;
    assert_int_equal(parse("{\"hidden_size\":", &c, &em), FU_EPROTO);
    assert_string_equal(em.msg, "config.json: not valid JSON");
    assert_int_equal(parse("[]", &c, &em), FU_EPROTO);
    assert_int_equal(parse("", &c, &em), FU_EPROTO);
}

/* Llama 3.2's config.json (1B, as published, trimmed of nothing that matters here): rope_scaling
 * "llama3" and a list of end-of-sequence ids are taken, survive a save and a load, and any of the
 * ids ends a generation; broken variants are refused, naming the field. */
static const char *llama32 =
    "{\"architectures\":[\"LlamaForCausalLM\"],\"attention_bias\":false,\"bos_token_id\":128000,"
    "\"eos_token_id\":[128001,128008,128009],\"head_dim\":64,\"hidden_act\":\"silu\",\"hidden_size\":2048,"
    "\"intermediate_size\":8192,\"max_position_embeddings\":131072,\"model_type\":\"llama\","
    "\"num_attention_heads\":32,\"num_hidden_layers\":16,\"num_key_value_heads\":8,\"rms_norm_eps\":1e-05,"
    "\"rope_scaling\":{\"factor\":32.0,\"high_freq_factor\":4.0,\"low_freq_factor\":1.0,"
    "\"original_max_position_embeddings\":8192,\"rope_type\":\"llama3\"},\"rope_theta\":500000.0,"
    "\"tie_word_embeddings\":true,\"torch_dtype\":\"bfloat16\",\"vocab_size\":128256}";

static void test_modelcfg_llama3_rope_scaling_and_eos_list(void **state)
{
    (void)state;
    fu_modelcfg c, back;
    fu_errmsg em;
    if (parse(llama32, &c, &em) != FU_OK)
        fail_msg("%s", em.msg);
    assert_true(c.rope_factor == 32.0 && c.rope_low_freq_factor == 1.0 && c.rope_high_freq_factor == 4.0);
    assert_int_equal(c.rope_original_max_pos, 8192);
    assert_int_equal(c.n_eos, 3);
    assert_int_equal(c.eos_token_id, 128001);
    assert_true(fu_modelcfg_is_eos(&c, -1, 128009) && fu_modelcfg_is_eos(&c, -1, 128008));
    assert_false(fu_modelcfg_is_eos(&c, 5, 5)); /* the list wins over the tokenizer's */
    char *json = fu_modelcfg_to_json(&c);
    if (parse(json, &back, &em) != FU_OK)
        fail_msg("%s: %s", json, em.msg);
    free(json);
    assert_true(back.rope_factor == 32.0 && back.rope_original_max_pos == 8192 && back.n_eos == 3 &&
                back.eos_token_ids[2] == 128009);
    /* a Mistral v0.2 config says "sliding_window": null: no window */
    assert_int_equal(parse("{\"model_type\":\"mistral\",\"hidden_size\":64,\"intermediate_size\":128,"
                           "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":256,"
                           "\"sliding_window\":null}", &c, &em), FU_OK);
    assert_int_equal(c.sliding_window, 0);
    const char *rs = ",\"model_type\":\"llama\",\"num_attention_heads\":4,\"rope_scaling\":";
    char bad[512];
    snprintf(bad, sizeof bad, "%s{\"rope_type\":\"yarn\",\"factor\":4}", rs);
    expect_refused(bad, FU_EVERSION, "rope_scaling.rope_type 'yarn' is not supported");
    snprintf(bad, sizeof bad, "%s{\"rope_type\":\"llama3\",\"low_freq_factor\":1,\"high_freq_factor\":4,"
             "\"original_max_position_embeddings\":8192}", rs);
    expect_refused(bad, FU_EINVAL, "rope_scaling llama3 needs factor >= 1"); /* factor missing */
    snprintf(bad, sizeof bad, "%s{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":4,"
             "\"high_freq_factor\":1,\"original_max_position_embeddings\":8192}", rs);
    expect_refused(bad, FU_EINVAL, "low_freq_factor < high_freq_factor");
    snprintf(bad, sizeof bad, "%s[1,2]", rs);
    expect_refused(bad, FU_EPROTO, "\"rope_scaling\" must be an object");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"eos_token_id\":[2,300]", FU_EINVAL,
                   "eos_token_id 300 must be below vocab_size 256");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"eos_token_id\":[1,2,3,4,5,6,7,8,9]",
                   FU_EINVAL, "more than 8 ids");
    expect_refused(",\"model_type\":\"llama\",\"num_attention_heads\":4,\"eos_token_id\":[2,\"x\"]", FU_EPROTO,
                   "a token id or a list of them");
}

static void test_modelcfg_missing_file_says_what_to_do(void **state)
{
    (void)state;
    char *dir = tu_tmpdir("cfg");
    assert_non_null(dir);
    fu_modelcfg c;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_modelcfg_load(dir, &c, &em), FU_ENOTFOUND);
    char want[4200];
    snprintf(want, sizeof want, "model dir '%s' has no config.json (expected a Hugging Face model directory)", dir);
    assert_string_equal(em.msg, want);
    assert_int_equal(fu_modelcfg_load("/nonexistent/model", &c, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "does not exist"));
    char *p = fu_path_join(dir, "config.json");
    assert_int_equal(fu_file_write_atomic(p, tinyllama, strlen(tinyllama), 0644, NULL), FU_OK);
    assert_int_equal(fu_modelcfg_load(dir, &c, &em), FU_OK);
    assert_int_equal(c.num_hidden_layers, 22);
    free(p);
    tu_tmpdir_remove(&dir);
}

static void test_modelcfg_save_and_load_round_trip(void **state)
{
    (void)state;
    char *dir = tu_tmpdir("cfg");
    fu_modelcfg c, back;
    fu_modelcfg_defaults(&c);
    c.num_hidden_layers = 3;
    c.rope_theta = 500000.0;
    c.rms_norm_eps = 1e-5;
    c.tie_word_embeddings = true;
    c.max_position_embeddings = 4096;
    c.bos_token_id = 1;
    snprintf(c.torch_dtype, sizeof c.torch_dtype, "bfloat16");
    fu_errmsg em = {{0}};
    assert_int_equal(fu_modelcfg_save(dir, &c, &em), FU_OK);
    assert_int_equal(fu_modelcfg_load(dir, &back, &em), FU_OK);
    char text[TU_MODELCFG_TEXT_MAX];
    assert_string_equal(
        tu_modelcfg_text(&back, text, sizeof text),
        "llama LlamaForCausalLM bfloat16 layers 3 hidden 64 heads 4/2 head_dim 16 ffn 128 vocab 256 "
        "max_pos 4096 eps 1e-05 theta 500000 tied 1 bos 1 eos -1 window 0");
    char *json = fu_modelcfg_to_json(&c);
    assert_non_null(strstr(json, "\"model_type\":\t\"llama\""));
    assert_non_null(strstr(json, "\"LlamaForCausalLM\""));
    free(json);
    /* An invalid configuration is not written. */
    c.num_key_value_heads = 3;
    assert_int_equal(fu_modelcfg_save(dir, &c, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "num_key_value_heads"));
    tu_tmpdir_remove(&dir);
}

static void test_modelcfg_weight_list_has_hf_names_and_shapes(void **state)
{
    (void)state;
    fu_modelcfg c;
    fu_modelcfg_defaults(&c); /* 2 layers, hidden 64, heads 4, kv 2, ffn 128, vocab 256 */
    assert_int_equal(fu_modelcfg_weight_count(&c), 21);
    fu_weight_info w;
    assert_int_equal(fu_modelcfg_weight(&c, 0, &w), FU_OK);
    assert_string_equal(w.name, "model.embed_tokens.weight");
    assert_int_equal(w.shape[0], 256);
    assert_int_equal(w.shape[1], 64);
    assert_int_equal(fu_modelcfg_weight(&c, 1, &w), FU_OK);
    assert_string_equal(w.name, "model.layers.0.input_layernorm.weight");
    assert_true(w.is_norm && w.ndim == 1 && w.shape[0] == 64 && w.layer == 0);
    assert_int_equal(fu_modelcfg_weight(&c, 3, &w), FU_OK);
    assert_string_equal(w.name, "model.layers.0.self_attn.k_proj.weight");
    assert_true(w.shape[0] == 32 && w.shape[1] == 64); /* 2 kv heads x 16 */
    assert_int_equal(fu_modelcfg_weight(&c, 5, &w), FU_OK);
    assert_string_equal(w.name, "model.layers.0.self_attn.o_proj.weight");
    assert_true(w.shape[0] == 64 && w.shape[1] == 64);
    assert_int_equal(fu_modelcfg_weight(&c, 9, &w), FU_OK);
    assert_string_equal(w.name, "model.layers.0.mlp.down_proj.weight");
    assert_true(w.shape[0] == 64 && w.shape[1] == 128);
    assert_int_equal(fu_modelcfg_weight(&c, 16, &w), FU_OK);
    assert_string_equal(w.name, "model.layers.1.mlp.gate_proj.weight");
    assert_true(w.shape[0] == 128 && w.shape[1] == 64 && w.layer == 1);
    assert_int_equal(fu_modelcfg_weight(&c, 19, &w), FU_OK);
    assert_string_equal(w.name, "model.norm.weight");
    assert_int_equal(fu_modelcfg_weight(&c, 20, &w), FU_OK);
    assert_string_equal(w.name, "lm_head.weight");
    assert_int_equal(fu_modelcfg_weight(&c, 21, &w), FU_EINVAL);
    assert_int_equal(fu_modelcfg_weight_of(&c, FU_W_UP, 1, &w), FU_OK);
    assert_string_equal(w.name, "model.layers.1.mlp.up_proj.weight");
    assert_int_equal(fu_modelcfg_weight_of(&c, FU_W_UP, 2, &w), FU_EINVAL);
    assert_int_equal(fu_modelcfg_weight_of(&c, FU_W_Q, -1, &w), FU_EINVAL);
    c.tie_word_embeddings = true;
    assert_int_equal(fu_modelcfg_weight_count(&c), 20);
    assert_int_equal(fu_modelcfg_weight_of(&c, FU_W_LM_HEAD, -1, &w), FU_ENOTFOUND);
    /* 256*64 + 2*(64 + 64*64 + 2*32*64 + 64*64 + 64 + 3*128*64) + 64 */
    assert_int_equal(fu_modelcfg_param_count(&c), 256 * 64 + 2 * (64 + 4096 + 4096 + 4096 + 64 + 3 * 8192) + 64);
}

/* Writes zero weights for cfg into dir/model.safetensors; skip names one tensor to leave out,
 * bad_dtype gives every tensor that dtype, wrong_shape names one tensor to make one row short. */
static void write_weights(const char *dir, const fu_modelcfg *c, const char *skip, fu_st_dtype dt, const char *wrong)
{
    size_t n = fu_modelcfg_weight_count(c), k = 0;
    fu_weight_info *w = calloc(n, sizeof *w);
    fu_st_tensor *t = calloc(n, sizeof *t);
    void **bufs = calloc(n, sizeof *bufs);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(fu_modelcfg_weight(c, i, &w[i]), FU_OK);
        if (skip && strcmp(w[i].name, skip) == 0)
            continue;
        fu_st_tensor *x = &t[k++];
        x->name = w[i].name;
        x->dtype = dt;
        x->ndim = w[i].ndim;
        size_t ne = 1;
        for (size_t d = 0; d < w[i].ndim; d++) {
            x->shape[d] = w[i].shape[d] - (wrong && d == 0 && strcmp(w[i].name, wrong) == 0 ? 1 : 0);
            ne *= (size_t)x->shape[d];
        }
        x->nbytes = ne * fu_st_dtype_size(dt);
        bufs[i] = calloc(1, x->nbytes + 1);
        x->data = bufs[i];
    }
    char *p = fu_path_join(dir, "model.safetensors");
    fu_errmsg em = {{0}};
    if (fu_safetensors_write(p, t, k, NULL, 0, NULL, NULL, &em) != FU_OK)
        fail_msg("%s", em.msg);
    free(p);
    for (size_t i = 0; i < n; i++)
        free(bufs[i]);
    free(bufs);
    free(t);
    free(w);
}

static fu_err check_dir(const char *dir, const fu_modelcfg *c, fu_errmsg *em)
{
    fu_safetensors *st = NULL;
    fu_err rc = fu_safetensors_open_dir(dir, &st, em);
    if (rc == FU_OK)
        rc = fu_modelcfg_check_weights(c, st, em);
    fu_safetensors_close(&st);
    return rc;
}

static void test_modelcfg_check_weights(void **state)
{
    (void)state;
    char *dir = tu_tmpdir("cfgw");
    fu_modelcfg c;
    fu_modelcfg_defaults(&c);
    fu_errmsg em = {{0}};
    write_weights(dir, &c, NULL, FU_ST_BF16, NULL);
    assert_int_equal(check_dir(dir, &c, &em), FU_OK);
    c.tie_word_embeddings = true; /* a spare lm_head is fine */
    assert_int_equal(check_dir(dir, &c, &em), FU_OK);
    c.tie_word_embeddings = false;
    write_weights(dir, &c, "model.layers.1.self_attn.v_proj.weight", FU_ST_F32, NULL);
    assert_int_equal(check_dir(dir, &c, &em), FU_ENOTFOUND);
    assert_string_equal(em.msg, "model.safetensors: no tensor 'model.layers.1.self_attn.v_proj.weight'");
    write_weights(dir, &c, NULL, FU_ST_F32, "model.layers.1.mlp.down_proj.weight");
    assert_int_equal(check_dir(dir, &c, &em), FU_EINVAL);
    assert_string_equal(em.msg, "model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' has shape [63, 128], "
                                "expected [64, 128]");
    write_weights(dir, &c, NULL, FU_ST_I32, NULL);
    assert_int_equal(check_dir(dir, &c, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "has dtype I32, expected F32, F16 or BF16"));
    tu_tmpdir_remove(&dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_modelcfg_parses_a_real_config),
        cmocka_unit_test(test_modelcfg_defaults_for_missing_fields),
        cmocka_unit_test(test_modelcfg_rejects_invalid_configs),
        cmocka_unit_test(test_modelcfg_llama3_rope_scaling_and_eos_list),
        cmocka_unit_test(test_modelcfg_missing_file_says_what_to_do),
        cmocka_unit_test(test_modelcfg_save_and_load_round_trip),
        cmocka_unit_test(test_modelcfg_weight_list_has_hf_names_and_shapes),
        cmocka_unit_test(test_modelcfg_check_weights),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
