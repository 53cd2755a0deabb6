/* Hugging Face model families against an independent PyTorch reference (issue "Real checkpoints").
 * tests/reference/hf_reference.py (Debian's python3-torch, run as /usr/bin/python3) writes a small
 * random-weight model of a family in Hugging Face's layout (config.json, model.safetensors) and the
 * logits of every position of a token sequence, computed by its own implementation of the family
 * (written from the transformers modeling code, not from ours). `fusion run infer --dump-logits`
 * on the same directory and tokens must give logits within REF_TOL (max abs) of them.
 *   - llama: GQA, untied lm_head;
 *   - llama_tied: tied embeddings, eos_token_id a list;
 *   - llama3: rope_scaling "llama3" (factor 8) over 300 tokens (the rescaled frequencies are the
 *     low ones: over a dozen tokens plain RoPE would pass too);
 *   - mistral: sliding_window 4 over 12 tokens (two layers reach 6 positions back);
 *   - qwen2: q/k/v biases, tied embeddings, a sliding_window that use_sliding_window false disables;
 *   - qwen3: head_dim 32 with hidden 64 (q_proj wider than the model), per-head q/k RMSNorm;
 *   - Qwen with use_sliding_window true and an unknown model_type are refused, naming the field;
 *   - and the reference's own --self-test passes.
 * Exits 77 (skipped) only when /usr/bin/python3 cannot import torch, which deploy/install-deps.sh
 * installs: CI has it. */
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
#include "testutil.h"

#define REF_TOL 1e-4 /* the bound on every family's logits */
#define PY      "/usr/bin/python3"

/* The reference script. */
static const char *script(void)
{
    static char path[4096];
    const char *src = getenv("FUSION_SOURCE_DIR");
    snprintf(path, sizeof path, "%s/tests/reference/hf_reference.py", src && *src ? src : "..");
    return path;
}

/* n tokens below 256 as "a,b,c" (a fixed pseudo-random walk). */
static char *token_list(int n)
{
    char *s = malloc((size_t)n * 4 + 1);
    size_t at = 0;
    uint32_t x = 12345;
    for (int i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        at += (size_t)sprintf(s + at, "%s%u", i ? "," : "", (x >> 16) % 256);
    }
    return s;
}

/* Reads a float32 file of `want` floats. */
static float *read_f32(const char *path, size_t want)
{
    char *buf = NULL;
    size_t len = 0;
    fu_errmsg em = {{0}};
    if (fu_file_read_all(path, 1u << 28, &buf, &len, &em) != FU_OK)
        fail_msg("%s: %s", path, em.msg);
    if (len != want * sizeof(float))
        fail_msg("%s: %zu bytes, expected %zu", path, len, want * sizeof(float));
    return (float *)buf;
}

/* The family's model and reference logits, then fusion's logits on them: the max abs difference. */
static double family_diff(const char *family, int n_tokens)
{
    char dir[4200], ours[4300], theirs[4300];
    snprintf(dir, sizeof dir, "%s/%s", tu_dir, family);
    snprintf(ours, sizeof ours, "%s/fusion_logits.f32", dir);
    snprintf(theirs, sizeof theirs, "%s/reference_logits.f32", dir);
    char *tokens = token_list(n_tokens), *out = NULL;
    int rc = tu_sh(&out, PY " '%s' --family %s --out '%s' --tokens %s", script(), family, dir, tokens);
    if (rc != 0)
        fail_msg("the reference for %s failed (%d): %s", family, rc, out);
    printf("%s: reference %s", family, out);
    free(out);
    rc = tu_sh(&out, "'%s' run infer -q --threads 1 --model '%s' --prompt-tokens %s --max-tokens 1 --dump-logits '%s'",
               tu_bin("fusion"), dir, tokens, ours);
    if (rc != 0)
        fail_msg("fusion run infer on %s failed (%d): %s", family, rc, out);
    free(out);
    free(tokens);
    size_t n = (size_t)n_tokens * 256;
    float *a = read_f32(ours, n), *b = read_f32(theirs, n);
    double worst = 0, mag = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        worst = d > worst || isnan(d) ? d : worst;
        mag = fabs(b[i]) > mag ? fabs(b[i]) : mag;
    }
    printf("%s: %d tokens, max |logit| %.3g, max abs diff %.3g (bound %g)\n", family, n_tokens, mag, worst, REF_TOL);
    free(a);
    free(b);
    return worst;
}

/* The reference checks itself: causality, the window's reach, the three llama3 branches, its
 * safetensors round trip and a naive float64 twin (hf_reference.py --self-test). */
static void test_model_reference_self_test(void **state)
{
    (void)state;
    char *out = NULL;
    int rc = tu_sh(&out, PY " '%s' --self-test", script());
    printf("%s", out);
    assert_int_equal(rc, 0);
    free(out);
}

static void test_model_reference_llama(void **state)
{
    (void)state;
    assert_true(family_diff("llama", 12) <= REF_TOL);
}

static void test_model_reference_llama_tied(void **state)
{
    (void)state;
    assert_true(family_diff("llama_tied", 12) <= REF_TOL);
}

static void test_model_reference_llama3(void **state)
{
    (void)state;
    assert_true(family_diff("llama3", 300) <= REF_TOL);
}

static void test_model_reference_mistral(void **state)
{
    (void)state;
    assert_true(family_diff("mistral", 12) <= REF_TOL);
}

static void test_model_reference_qwen2(void **state)
{
    (void)state;
    assert_true(family_diff("qwen2", 12) <= REF_TOL);
}

static void test_model_reference_qwen3(void **state)
{
    (void)state;
    assert_true(family_diff("qwen3", 12) <= REF_TOL);
}

/* What fusion does not run is refused at once by `fusion model info`, naming the field: Qwen's
 * layer-dependent windows and a family it does not know. */
static void test_model_reference_refusals(void **state)
{
    (void)state;
    static const struct {
        const char *from, *to, *says;
    } edits[] = {
        {"\"use_sliding_window\": false", "\"use_sliding_window\": true", "use_sliding_window"},
        {"\"model_type\": \"qwen2\"", "\"model_type\": \"gemma\"", "model_type 'gemma'"},
    };
    char dir[4200], *out = NULL;
    snprintf(dir, sizeof dir, "%s/refused", tu_dir);
    assert_int_equal(tu_sh(&out, PY " '%s' --family qwen2 --out '%s' --tokens 1,2,3", script(), dir), 0);
    free(out);
    for (size_t k = 0; k < sizeof edits / sizeof *edits; k++) {
        assert_int_equal(tu_sh(&out, "cd '%s' && cp config.json orig.json && sed -i 's/%s/%s/' config.json && "
                               "grep -c '%s' config.json", dir, edits[k].from, edits[k].to, edits[k].to), 0);
        free(out);
        int rc = tu_sh(&out, "'%s' model info '%s'", tu_bin("fusion"), dir);
        printf("refused: exit %d: %s", rc, out);
        assert_int_not_equal(rc, 0);
        assert_non_null(strstr(out, edits[k].says));
        free(out);
        assert_int_equal(tu_sh(&out, "cd '%s' && mv orig.json config.json", dir), 0);
        free(out);
    }
}

int main(void)
{
    char *out = NULL;
    if (tu_sh(&out, PY " -c 'import torch' 2>&1") != 0) {
        printf("no PyTorch for %s (deploy/install-deps.sh installs python3-torch): skipped\n%s", PY, out ? out : "");
        free(out);
        return 77;
    }
    free(out);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_reference_self_test),
        cmocka_unit_test(test_model_reference_llama),
        cmocka_unit_test(test_model_reference_llama_tied),
        cmocka_unit_test(test_model_reference_llama3),
        cmocka_unit_test(test_model_reference_mistral),
        cmocka_unit_test(test_model_reference_qwen2),
        cmocka_unit_test(test_model_reference_qwen3),
        cmocka_unit_test(test_model_reference_refusals),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
