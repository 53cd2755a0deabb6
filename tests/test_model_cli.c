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

static char *g_dir;

static int setup(void **state)
{
    (void)state;
    g_dir = tu_tmpdir("modelcli");
    return g_dir ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char *out = NULL;
    tu_sh(&out, "rm -rf '%s'", g_dir);
    free(out);
    free(g_dir);
    return 0;
}

/* Runs `fusion ARGS` and returns the exit code; *out gets what it printed (caller frees). */
static int fusion(char **out, const char *args)
{
    return tu_sh(out, "%s %s", tu_bin("fusion"), args);
}

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

static void test_model_cli_init_defaults_load_with_right_shapes(void **state)
{
    (void)state;
    char *out = NULL;
    char args[4300];
    char *dir = fu_path_join(g_dir, "default");
    snprintf(args, sizeof args, "model init --seed 1 -o '%s'", dir);
    int rc = fusion(&out, args);
    if (rc != 0)
        fail_msg("exit %d: %s", rc, out);
    assert_non_null(strstr(out, "106816 parameters"));
    free(out);
    check_model_dir(dir, FU_ST_F32);
    fu_modelcfg c;
    assert_int_equal(fu_modelcfg_load(dir, &c, NULL), FU_OK);
    assert_int_equal(c.num_hidden_layers, 2);
    assert_int_equal(c.hidden_size, 64);
    assert_int_equal(c.num_attention_heads, 4);
    assert_int_equal(c.num_key_value_heads, 2);
    assert_int_equal(c.intermediate_size, 128);
    assert_int_equal(c.vocab_size, 256);
    assert_string_equal(c.torch_dtype, "float32");
    /* `model info` agrees. */
    snprintf(args, sizeof args, "model info '%s'", dir);
    assert_int_equal(fusion(&out, args), 0);
    assert_non_null(strstr(out, "21 tensors"));
    free(out);
    free(dir);
}

static void test_model_cli_init_options_and_dtypes(void **state)
{
    (void)state;
    char *out = NULL;
    char args[4300];
    char *dir = fu_path_join(g_dir, "custom");
    snprintf(args, sizeof args,
             "model init --layers 3 --hidden 48 --heads 6 --kv-heads 3 --ffn 96 --vocab 300 --seed 9 "
             "--dtype bf16 --tie --max-pos 512 --rope-theta 500000 -o '%s'",
             dir);
    int rc = fusion(&out, args);
    if (rc != 0)
        fail_msg("exit %d: %s", rc, out);
    free(out);
    fu_modelcfg c;
    assert_int_equal(fu_modelcfg_load(dir, &c, NULL), FU_OK);
    assert_int_equal(c.num_hidden_layers, 3);
    assert_int_equal(c.hidden_size, 48);
    assert_int_equal(c.num_attention_heads, 6);
    assert_int_equal(c.num_key_value_heads, 3);
    assert_int_equal(c.head_dim, 8);
    assert_int_equal(c.intermediate_size, 96);
    assert_int_equal(c.vocab_size, 300);
    assert_int_equal(c.max_position_embeddings, 512);
    assert_true(c.rope_theta == 500000.0);
    assert_true(c.tie_word_embeddings);
    assert_string_equal(c.torch_dtype, "bfloat16");
    check_model_dir(dir, FU_ST_BF16);
    fu_safetensors *st = NULL;
    assert_int_equal(fu_safetensors_open_dir(dir, &st, NULL), FU_OK);
    assert_null(fu_safetensors_get(st, "lm_head.weight")); /* tied */
    fu_safetensors_close(&st);
    free(dir);

    /* An explicit head size that is not hidden/heads. */
    dir = fu_path_join(g_dir, "headdim");
    snprintf(args, sizeof args, "model init --layers 1 --hidden 40 --heads 4 --kv-heads 1 --head-dim 16 -o '%s'", dir);
    rc = fusion(&out, args);
    if (rc != 0)
        fail_msg("exit %d: %s", rc, out);
    free(out);
    assert_int_equal(fu_modelcfg_load(dir, &c, NULL), FU_OK);
    assert_int_equal(c.head_dim, 16);
    check_model_dir(dir, FU_ST_F32);
    fu_weight_info w;
    assert_int_equal(fu_modelcfg_weight_of(&c, FU_W_Q, 0, &w), FU_OK);
    assert_true(w.shape[0] == 64 && w.shape[1] == 40);
    free(dir);

    dir = fu_path_join(g_dir, "half");
    snprintf(args, sizeof args, "model init --layers 1 --dtype f16 -o '%s'", dir);
    assert_int_equal(fusion(&out, args), 0);
    free(out);
    check_model_dir(dir, FU_ST_F16);
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
    char *out = NULL;
    char args[4300];
    const char *names[3] = {"s1a", "s1b", "s2"};
    const int seeds[3] = {1234, 1234, 1235};
    char *dirs[3];
    for (int i = 0; i < 3; i++) {
        dirs[i] = fu_path_join(g_dir, names[i]);
        snprintf(args, sizeof args, "model init --seed %d --dtype f16 -o '%s'", seeds[i], dirs[i]);
        assert_int_equal(fusion(&out, args), 0);
        free(out);
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
    char *out = NULL;
    char args[4300];
    char *dir = fu_path_join(g_dir, "keep");
    snprintf(args, sizeof args, "model init --seed 1 -o '%s'", dir);
    assert_int_equal(fusion(&out, args), 0);
    free(out);
    char *st = fu_path_join(dir, "model.safetensors");
    char *saved = fu_path_join(g_dir, "keep.saved");
    assert_int_equal(tu_sh(NULL, "cp '%s' '%s'", st, saved), 0);
    snprintf(args, sizeof args, "model init --seed 2 -o '%s'", dir);
    assert_int_equal(fusion(&out, args), 1);
    assert_non_null(strstr(out, "is not empty"));
    assert_non_null(strstr(out, "--force"));
    free(out);
    assert_true(same_file(st, saved)); /* untouched */
    /* A stray shard index would shadow the new file: --force removes it. */
    char *idx = fu_path_join(dir, FU_ST_INDEX_FILE);
    assert_int_equal(fu_file_write_atomic(idx, "{}", 2, 0644, NULL), FU_OK);
    snprintf(args, sizeof args, "model init --seed 2 --force -o '%s'", dir);
    assert_int_equal(fusion(&out, args), 0);
    free(out);
    assert_false(same_file(st, saved));
    assert_false(fu_path_exists(idx));
    check_model_dir(dir, FU_ST_F32);
    /* A file where the directory should be. */
    snprintf(args, sizeof args, "model init -o '%s'", saved);
    assert_int_equal(fusion(&out, args), 1);
    assert_non_null(strstr(out, "not a directory"));
    free(out);
    /* An empty directory is fine without --force. */
    char *empty = fu_path_join(g_dir, "empty");
    assert_int_equal(fu_mkdir_p(empty, 0755, NULL), FU_OK);
    snprintf(args, sizeof args, "model init --layers 1 -o '%s'", empty);
    assert_int_equal(fusion(&out, args), 0);
    free(out);
    free(empty);
    free(idx);
    free(saved);
    free(st);
    free(dir);
}

static void test_model_cli_bad_arguments_exit_2(void **state)
{
    (void)state;
    char *out = NULL;
    char args[4300];
    char *dir = fu_path_join(g_dir, "bad");
    struct {
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
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(args, sizeof args, "model init %s -o '%s'", cases[i].opts, dir);
        int rc = fusion(&out, args);
        if (rc != 2 || !strstr(out, cases[i].says))
            fail_msg("'%s': exit %d, output: %s", cases[i].opts, rc, out);
        free(out);
    }
    assert_false(fu_path_exists(dir)); /* nothing written */
    assert_int_equal(fusion(&out, "model init"), 2);
    assert_non_null(strstr(out, "-o DIR is required"));
    free(out);
    assert_int_equal(fusion(&out, "model init --help"), 0);
    assert_non_null(strstr(out, "--kv-heads"));
    free(out);
    assert_int_equal(fusion(&out, "model"), 2);
    free(out);
    assert_int_equal(fusion(&out, "model --help"), 0);
    assert_non_null(strstr(out, "init"));
    free(out);
    assert_int_equal(fusion(&out, "model frob"), 2);
    assert_non_null(strstr(out, "unknown command 'frob'"));
    free(out);
    free(dir);
}

/* `model prune` writes a SALR model: bitmap-encoded linears, the SVD residual adapters and
 * salr_config.json; it refuses to write into a non-empty directory without --force. */
static void test_model_cli_prune_writes_salr_model(void **state)
{
    (void)state;
    char *src = fu_path_join(g_dir, "prune-src"), *dst = fu_path_join(g_dir, "prune-dst");
    char args[4300], *out = NULL;
    snprintf(args, sizeof args, "model init --layers 1 --hidden 32 --heads 2 --kv-heads 1 --ffn 64 --seed 3 -o '%s'",
             src);
    assert_int_equal(fusion(&out, args), 0);
    free(out);
    snprintf(args, sizeof args, "model prune --method salr --sparsity 0.5 --svd-rank 4 -i '%s' -o '%s'", src, dst);
    assert_int_equal(fusion(&out, args), 0);
    assert_non_null(strstr(out, "sparsity 0.50, residual rank 4, lm_head pruned"));
    free(out);
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
    assert_int_equal(fusion(&out, args), 1);
    assert_non_null(strstr(out, "exists and is not empty"));
    free(out);
    snprintf(args, sizeof args, "model prune --sparsity 0.5 --svd-rank 4 --force -i '%s' -o '%s'", src, dst);
    assert_int_equal(fusion(&out, args), 0);
    free(out);
    free(src);
    free(dst);
}

static void test_model_cli_prune_and_info_errors(void **state)
{
    (void)state;
    char *out = NULL;
    char args[4300];
    assert_int_equal(fusion(&out, "model prune --method salr x"), 2);
    assert_non_null(strstr(out, "expects 0 argument"));
    free(out);
    assert_int_equal(fusion(&out, "model prune --method magnitude -i a -o b"), 2);
    assert_non_null(strstr(out, "unknown method 'magnitude'"));
    free(out);
    assert_int_equal(fusion(&out, "model prune -i a -o b --sparsity 1.5"), 2);
    assert_non_null(strstr(out, "--sparsity must be in [0, 1)"));
    free(out);
    char *dir = fu_path_join(g_dir, "info-empty");
    assert_int_equal(fu_mkdir_p(dir, 0755, NULL), FU_OK);
    snprintf(args, sizeof args, "model info '%s'", dir);
    assert_int_equal(fusion(&out, args), 4);
    char want[4300];
    snprintf(want, sizeof want, "fusion: model dir '%s' has no config.json (expected a Hugging Face model directory)",
             dir);
    assert_non_null(strstr(out, want));
    free(out);
    /* A config whose weights do not match: the message names the file and the tensor. */
    char *src = fu_path_join(g_dir, "info-src");
    snprintf(args, sizeof args, "model init --ffn 64 -o '%s' && cp '%s/model.safetensors' '%s/' && "
                                "%s model init --ffn 128 --force -o '%s' >/dev/null",
             src, src, dir, tu_bin("fusion"), src);
    assert_int_equal(fusion(&out, args), 0);
    free(out);
    char *cfg = fu_path_join(src, "config.json");
    assert_int_equal(tu_sh(NULL, "cp '%s' '%s/'", cfg, dir), 0);
    snprintf(args, sizeof args, "model info '%s'", dir);
    assert_int_equal(fusion(&out, args), 1);
    assert_non_null(strstr(out, "model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 64], "
                                "expected [128, 64]"));
    free(out);
    free(cfg);
    free(src);
    free(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_cli_init_defaults_load_with_right_shapes),
        cmocka_unit_test(test_model_cli_init_options_and_dtypes),
        cmocka_unit_test(test_model_cli_same_seed_same_bytes),
        cmocka_unit_test(test_model_cli_refuses_to_overwrite),
        cmocka_unit_test(test_model_cli_bad_arguments_exit_2),
        cmocka_unit_test(test_model_cli_prune_writes_salr_model),
        cmocka_unit_test(test_model_cli_prune_and_info_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
