/* `fusion model init|info|prune` as a user runs them: the directory it writes loads through
 * fu_modelcfg and fu_safetensors with the right shapes, the same seed gives the same bytes, and it
 * refuses to overwrite. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"
#include "testutil.h"

/* Checks every weight the config lists is in the directory with its shape and the given dtype;
 * norms are all 1 and the rest look like N(0, 0.02). */
static void check_model_dir(const char *dir, fu_st_dtype want_dtype)
{
    fu_modelcfg c;
    fu_errmsg em = {{0}};
    if (fu_modelcfg_load(dir, &c, &em) != FU_OK)
        fail_msg("config: %s", em.msg);
    fu_safetensors *st = NULL;
    if (fu_safetensors_open_dir(dir, &st, &em) != FU_OK)
        fail_msg("weights: %s", em.msg);
    size_t n = fu_modelcfg_weight_count(&c);
    assert_int_equal(fu_safetensors_count(st), n);
    assert_string_equal(fu_safetensors_metadata(st, "format"), "pt");
    for (size_t i = 0; i < n; i++) {
        fu_weight_info w;
        const fu_st_tensor *t = NULL;
        assert_int_equal(fu_modelcfg_weight(&c, i, &w), FU_OK);
        if (fu_safetensors_expect(st, w.name, w.ndim, w.shape, &t, &em) != FU_OK)
            fail_msg("%s", em.msg);
        assert_int_equal(t->dtype, want_dtype);
        float *v = malloc(t->nelem * sizeof *v);
        assert_int_equal(fu_st_tensor_to_f32(t, v, t->nelem, &em), FU_OK);
        double s = 0, s2 = 0;
        for (size_t k = 0; k < t->nelem; k++) {
            s += v[k];
            s2 += (double)v[k] * v[k];
        }
        double mean = s / (double)t->nelem, sd = sqrt(s2 / (double)t->nelem - mean * mean);
        if (w.is_norm) {
            assert_true(mean == 1.0 && sd < 1e-6);
        } else {
            if (!(fabs(mean) < 0.005 && fabs(sd - 0.02) < 0.003))
                fail_msg("%s: mean %g sd %g", w.name, mean, sd);
        }
        free(v);
    }
    fu_safetensors_close(&st);
}

/* Loads dir's config.json and checks it reads `want` (tu_modelcfg_text). */
static void check_config(const char *dir, const char *want)
{
    fu_modelcfg c;
    fu_errmsg em = {{0}};
    if (fu_modelcfg_load(dir, &c, &em) != FU_OK)
        fail_msg("config: %s", em.msg);
    char text[TU_MODELCFG_TEXT_MAX];
    assert_string_equal(tu_modelcfg_text(&c, text, sizeof text), want);
}

static void test_model_cli_init_defaults_load_with_right_shapes(void **state)
{
    (void)state;
    char *dir = fu_path_join(tu_dir, "default");
    tu_fusion_expect(0, "106816 parameters", "model init --seed 1 -o '%s'", dir);
    check_model_dir(dir, FU_ST_F32);
    check_config(dir,
                 "llama LlamaForCausalLM float32 layers 2 hidden 64 heads 4/2 head_dim 16 ffn 128 vocab 256 "
                 "max_pos 2048 eps 1e-06 theta 10000 tied 0 bos -1 eos -1 window 0");
    /* `model info` agrees. */
    tu_fusion_expect(0, "21 tensors", "model info '%s'", dir);
    free(dir);
}

static void test_model_cli_init_options_and_dtypes(void **state)
{
    (void)state;
    char *dir = fu_path_join(tu_dir, "custom");
    tu_fusion_expect(0, NULL,
                     "model init --layers 3 --hidden 48 --heads 6 --kv-heads 3 --ffn 96 --vocab 300 --seed 9 "
                     "--dtype bf16 --tie --max-pos 512 --rope-theta 500000 -o '%s'",
                     dir);
    check_config(dir,
                 "llama LlamaForCausalLM bfloat16 layers 3 hidden 48 heads 6/3 head_dim 8 ffn 96 vocab 300 "
                 "max_pos 512 eps 1e-06 theta 500000 tied 1 bos -1 eos -1 window 0");
    check_model_dir(dir, FU_ST_BF16);
    fu_safetensors *st = NULL;
    assert_int_equal(fu_safetensors_open_dir(dir, &st, NULL), FU_OK);
    assert_null(fu_safetensors_get(st, "lm_head.weight")); /* tied */
    fu_safetensors_close(&st);
    free(dir);

    /* An explicit head size that is not hidden/heads. */
    dir = fu_path_join(tu_dir, "headdim");
    tu_fusion_expect(0, NULL,
                     "model init --layers 1 --hidden 40 --heads 4 --kv-heads 1 --head-dim 16 -o '%s'", dir);
    fu_modelcfg c;
    assert_int_equal(fu_modelcfg_load(dir, &c, NULL), FU_OK);
    assert_int_equal(c.head_dim, 16);
    check_model_dir(dir, FU_ST_F32);
    fu_weight_info w;
    assert_int_equal(fu_modelcfg_weight_of(&c, FU_W_Q, 0, &w), FU_OK);
    assert_true(w.shape[0] == 64 && w.shape[1] == 40);
    free(dir);

    dir = fu_path_join(tu_dir, "half");
    tu_fusion_expect(0, NULL, "model init --layers 1 --dtype f16 -o '%s'", dir);
    check_model_dir(dir, FU_ST_F16);
    free(dir);
}

/* A checkpoint of more than 256 ids without tokenizer.json (not one `model init` made: that one says
 * "fusion_byte_tokens") is refused by `model info`, `tokenize` and `run`, saying what to do, and
 * taken with --byte-tokens. */
static void test_model_cli_no_tokenizer_needs_byte_tokens(void **state)
{
    (void)state;
    char *dir = fu_path_join(tu_dir, "notok");
    tu_fusion_expect(0, NULL, "model init --layers 1 --vocab 300 --seed 2 -o '%s'", dir);
    tu_fusion_expect(0, "byte tokens (ids 0..255)", "model info '%s'", dir);
    tu_sh_expect(0, NULL, "sed -i '/fusion_byte_tokens/d' '%s/config.json'", dir);
    tu_fusion_expect(1, "300 token ids but no tokenizer.json", "model info '%s'", dir);
    tu_fusion_expect(0, "byte tokens", "model info --byte-tokens '%s'", dir);
    tu_fusion_expect(1, "--byte-tokens", "tokenize '%s' hello", dir);
    tu_fusion_expect(0, "[104,101,108,108,111]", "tokenize --byte-tokens '%s' hello", dir);
    /* Decoded to JSON, a byte that begins no UTF-8 character is U+FFFD (JSON cannot carry it raw):
     * "é" (195 169), then 200 alone, then "A". */
    tu_sh_expect(0, "\"\xc3\xa9\xef\xbf\xbd" "A\"",
                 "echo '[195,169,200,65]' | %s tokenize --decode --jsonl --byte-tokens '%s'", tu_bin("fusion"), dir);
    tu_fusion_expect(1, "no tokenizer.json", "run infer -q --model '%s' --prompt hello --max-tokens 2", dir);
    tu_fusion_expect(0, NULL, "run infer -q --byte-tokens --model '%s' --prompt hello --max-tokens 2", dir);
    free(dir);
}

static bool same_file(const char *a, const char *b)
{
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    assert_int_equal(fu_file_read_all(a, 64u << 20, &x, &nx, NULL), FU_OK);
    assert_int_equal(fu_file_read_all(b, 64u << 20, &y, &ny, NULL), FU_OK);
    bool same = nx == ny && memcmp(x, y, nx) == 0;
    free(x);
    free(y);
    return same;
}

static void test_model_cli_same_seed_same_bytes(void **state)
{
    (void)state;
    const char *names[3] = {"s1a", "s1b", "s2"};
    const int seeds[3] = {1234, 1234, 1235};
    char *dirs[3];
    for (int i = 0; i < 3; i++) {
        dirs[i] = fu_path_join(tu_dir, names[i]);
        tu_fusion_expect(0, NULL, "model init --seed %d --dtype f16 -o '%s'", seeds[i], dirs[i]);
    }
    char *a = fu_path_join(dirs[0], "model.safetensors"), *b = fu_path_join(dirs[1], "model.safetensors"),
         *c = fu_path_join(dirs[2], "model.safetensors");
    assert_true(same_file(a, b));
    assert_false(same_file(a, c));
    free(a), free(b), free(c);
    a = fu_path_join(dirs[0], "config.json"), b = fu_path_join(dirs[1], "config.json");
    assert_true(same_file(a, b));
    free(a), free(b);
    for (int i = 0; i < 3; i++)
        free(dirs[i]);
}

static void test_model_cli_refuses_to_overwrite(void **state)
{
    (void)state;
    char *dir = fu_path_join(tu_dir, "keep");
    tu_fusion_expect(0, NULL, "model init --seed 1 -o '%s'", dir);
    char *st = fu_path_join(dir, "model.safetensors");
    char *saved = fu_path_join(tu_dir, "keep.saved");
    tu_sh_expect(0, NULL, "cp '%s' '%s'", st, saved);
    char *out = tu_fusion_expect_out(1, "is not empty", "model init --seed 2 -o '%s'", dir);
    assert_non_null(strstr(out, "--force"));
    free(out);
    assert_true(same_file(st, saved)); /* untouched */
    /* A stray shard index would shadow the new file: --force removes it. */
    char *idx = fu_path_join(dir, FU_ST_INDEX_FILE);
    assert_int_equal(fu_file_write_atomic(idx, "{}", 2, 0644, NULL), FU_OK);
    tu_fusion_expect(0, NULL, "model init --seed 2 --force -o '%s'", dir);
    assert_false(same_file(st, saved));
    assert_false(fu_path_exists(idx));
    check_model_dir(dir, FU_ST_F32);
    /* A file where the directory should be. */
    tu_fusion_expect(1, "not a directory", "model init -o '%s'", saved);
    /* An empty directory is fine without --force. */
    char *empty = fu_path_join(tu_dir, "empty");
    assert_int_equal(fu_mkdir_p(empty, 0755, NULL), FU_OK);
    tu_fusion_expect(0, NULL, "model init --layers 1 -o '%s'", empty);
    free(empty);
    free(idx);
    free(saved);
    free(st);
    free(dir);
}

static void test_model_cli_bad_arguments_exit_2(void **state)
{
    (void)state;
    char *dir = fu_path_join(tu_dir, "bad");
    static const struct {
        const char *opts;
        const char *says;
    } cases[] = {
        {"--heads 5", "not divisible by --heads 5"},
        {"--heads 4 --kv-heads 3", "num_attention_heads 4 is not divisible by num_key_value_heads 3"},
        {"--dtype f8", "--dtype must be f32, f16 or bf16"},
        {"--layers 0", "--layers must be a positive integer"},
        {"--vocab -3", "--vocab must be a positive integer"},
        {"--hidden lots", "needs an integer"},
        {"--rope-theta 0", "rope_theta"},
        {"--frobnicate", "unknown option"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        tu_fusion_expect(2, cases[i].says, "model init %s -o '%s'", cases[i].opts, dir);
    assert_false(fu_path_exists(dir)); /* nothing written */
    static const tu_cmd_case usage[] = {
        {"model init", 2, "-o DIR is required"},
        {"model init --help", 0, "--kv-heads"},
        {"model", 2, NULL},
        {"model --help", 0, "init"},
        {"model frob", 2, "unknown command 'frob'"},
    };
    for (size_t i = 0; i < sizeof usage / sizeof usage[0]; i++)
        tu_fusion_expect(usage[i].rc, usage[i].says, "%s", usage[i].args);
    free(dir);
}

/* `model prune` writes a SALR model: bitmap-encoded linears, the SVD residual adapters and
 * salr_config.json; it refuses to write into a non-empty directory without --force. */
static void test_model_cli_prune_writes_salr_model(void **state)
{
    (void)state;
    char *src = fu_path_join(tu_dir, "prune-src"), *dst = fu_path_join(tu_dir, "prune-dst");
    tu_fusion_expect(
        0, NULL, "model init --layers 1 --hidden 32 --heads 2 --kv-heads 1 --ffn 64 --seed 3 -o '%s'", src);
    tu_fusion_expect(0, "sparsity 0.50, residual rank 4, lm_head pruned",
                     "model prune --method salr --sparsity 0.5 --svd-rank 4 -i '%s' -o '%s'", src, dst);
    char *cfg = fu_path_join(dst, "salr_config.json");
    assert_true(fu_path_exists(cfg));
    free(cfg);
    fu_safetensors *st = NULL;
    assert_int_equal(fu_safetensors_open_dir(dst, &st, NULL), FU_OK);
    assert_non_null(fu_safetensors_get(st, "model.layers.0.self_attn.q_proj.weight.bitmap"));
    assert_non_null(fu_safetensors_get(st, "model.layers.0.mlp.down_proj.weight.values"));
    assert_null(fu_safetensors_get(st, "model.layers.0.mlp.down_proj.weight")); /* no dense copy */
    assert_non_null(fu_safetensors_get(st, "lm_head.weight.bitmap"));           /* the head too, by default */
    assert_null(fu_safetensors_get(st, "lm_head.weight"));
    assert_non_null(fu_safetensors_get(st, "model.embed_tokens.weight"));     /* copied as is */
    fu_safetensors_close(&st);
    /* A second run into the same directory is refused, then allowed with --force. */
    tu_fusion_expect(1, "exists and is not empty",
                     "model prune --method salr --sparsity 0.5 --svd-rank 4 -i '%s' -o '%s'", src, dst);
    tu_fusion_expect(0, NULL, "model prune --sparsity 0.5 --svd-rank 4 --force -i '%s' -o '%s'", src, dst);
    free(src);
    free(dst);
}

static void test_model_cli_prune_and_info_errors(void **state)
{
    (void)state;
    tu_fusion_expect(2, "expects 0 argument", "model prune --method salr x");
    tu_fusion_expect(2, "unknown method 'magnitude'", "model prune --method magnitude -i a -o b");
    tu_fusion_expect(2, "--sparsity must be in [0, 1)", "model prune -i a -o b --sparsity 1.5");
    char *dir = fu_path_join(tu_dir, "info-empty");
    assert_int_equal(fu_mkdir_p(dir, 0755, NULL), FU_OK);
    char want[4300];
    snprintf(want, sizeof want, "fusion: model dir '%s' has no config.json (expected a Hugging Face model directory)",
             dir);
    tu_fusion_expect(4, want, "model info '%s'", dir);
    /* A config whose weights do not match: the message names the file and the tensor. */
    char *src = fu_path_join(tu_dir, "info-src");
    tu_fusion_expect(0, NULL,
                     "model init --ffn 64 -o '%s' && cp '%s/model.safetensors' '%s/' && "
                     "%s model init --ffn 128 --force -o '%s' >/dev/null",
                     src, src, dir, tu_bin("fusion"), src);
    char *cfg = fu_path_join(src, "config.json");
    tu_sh_expect(0, NULL, "cp '%s' '%s/'", cfg, dir);
    tu_fusion_expect(1,
                     "model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 64], "
                     "expected [128, 64]",
                     "model info '%s'", dir);
    free(cfg);
    free(src);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_cli_init_defaults_load_with_right_shapes),
        cmocka_unit_test(test_model_cli_init_options_and_dtypes),
        cmocka_unit_test(test_model_cli_no_tokenizer_needs_byte_tokens),
        cmocka_unit_test(test_model_cli_same_seed_same_bytes),
        cmocka_unit_test(test_model_cli_refuses_to_overwrite),
        cmocka_unit_test(test_model_cli_bad_arguments_exit_2),
        cmocka_unit_test(test_model_cli_prune_writes_salr_model),
        cmocka_unit_test(test_model_cli_prune_and_info_errors),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
