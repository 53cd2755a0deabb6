/* `fusion run finetune` and `fusion run infer` as real processes on a tiny model. */
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

#include "dag_model.h"
#include "fu_modelcfg.h"
#include "testutil.h"

static char *dir;   /* scratch directory */
static char *model; /* tiny model */
static char *data;  /* training text */

static int setup(void **state)
{
    (void)state;
    dir = tu_tmpdir("dagcli");
    if (!dir)
        return -1;
    fu_modelcfg cfg;
    fu_modelcfg_defaults(&cfg); /* 2 layers, hidden 64, vocab 256 */
    size_t n = strlen(dir) + 32;
    model = malloc(n);
    data = malloc(n);
    snprintf(model, n, "%s/model", dir);
    snprintf(data, n, "%s/text.txt", dir);
    if (dag_model_init_random(model, &cfg, 3, 0.08f, NULL) != FU_OK)
        return -1;
    FILE *f = fopen(data, "w");
    if (!f)
        return -1;
    for (int i = 0; i < 60; i++)
        fputs("the quick brown fox jumps over the lazy dog. ", f);
    fclose(f);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char *out = NULL;
    (void)tu_sh(&out, "rm -rf '%s'", dir);
    free(out);
    free(dir);
    free(model);
    free(data);
    return 0;
}

static void read_losses(const char *path, double *first, double *last, int *n)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[512];
    *n = 0;
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, "\"loss\":");
        assert_non_null(p);
        double l = atof(p + 7);
        if (*n == 0)
            *first = l;
        *last = l;
        (*n)++;
    }
    fclose(f);
}

static void test_dag_cli_finetune_then_infer(void **state)
{
    (void)state;
    char *out = NULL;
    int rc = tu_sh(&out,
                   "%s run finetune --model %s --data %s --method lora-fa --rank 4 --alpha 8 --lr 2e-2 --steps 30 "
                   "--batch 2 --seq-len 16 --shuffle --seed 5 --loss-log %s/loss.jsonl -o %s/adapter",
                   tu_bin("fusion"), model, data, dir, dir);
    if (rc != 0)
        fail_msg("finetune exited %d: %s", rc, out);
    assert_non_null(strstr(out, "step 30/30 loss"));
    free(out);
    char p[4096];
    snprintf(p, sizeof p, "%s/loss.jsonl", dir);
    double first = 0, last = 0;
    int n = 0;
    read_losses(p, &first, &last, &n);
    assert_int_equal(n, 30);
    assert_true(last < 0.8 * first);
    struct stat sb;
    snprintf(p, sizeof p, "%s/adapter/adapter_model.safetensors", dir);
    assert_int_equal(stat(p, &sb), 0);
    snprintf(p, sizeof p, "%s/adapter/adapter_config.json", dir);
    assert_int_equal(stat(p, &sb), 0);

    /* Greedy generation with and without the adapter differ; the same command twice is identical. */
    char *with = NULL, *with2 = NULL, *without = NULL;
    assert_int_equal(tu_sh(&with, "%s run infer -q --model %s --adapter %s/adapter --prompt-tokens 116,104,101 "
                                  "--max-tokens 24 2>/dev/null", tu_bin("fusion"), model, dir), 0);
    assert_int_equal(tu_sh(&with2, "%s run infer -q --model %s --adapter %s/adapter --prompt-tokens 116,104,101 "
                                   "--max-tokens 24 2>/dev/null", tu_bin("fusion"), model, dir), 0);
    assert_int_equal(tu_sh(&without, "%s run infer -q --threads 1 --model %s --prompt-tokens 116,104,101 --max-tokens 24 "
                                     "2>/dev/null", tu_bin("fusion"), model), 0);
    assert_string_equal(with, with2);
    assert_string_not_equal(with, without);
    free(with);
    free(with2);
    free(without);

    /* Text prompt, sampling, and the logits dump: positions × vocab float32. */
    assert_int_equal(tu_sh(&out, "%s run infer --model %s --adapter %s/adapter --prompt 'the q' --max-tokens 8 "
                                 "--temperature 0.8 --top-k 20 --top-p 0.9 --seed 3 --dump-logits %s/logits.bin",
                           tu_bin("fusion"), model, dir, dir), 0);
    assert_non_null(strstr(out, "generated"));
    free(out);
    snprintf(p, sizeof p, "%s/logits.bin", dir);
    assert_int_equal(stat(p, &sb), 0);
    assert_int_equal(sb.st_size, 5 * 256 * 4);
    FILE *f = fopen(p, "rb");
    assert_non_null(f);
    float lg[5 * 256];
    assert_int_equal(fread(lg, sizeof(float), 5 * 256, f), 5 * 256);
    fclose(f);
    for (int i = 0; i < 5 * 256; i++)
        assert_true(isfinite(lg[i]));
}

static void test_dag_cli_salr_finetune(void **state)
{
    (void)state;
    char pruned[4096];
    snprintf(pruned, sizeof pruned, "%s/pruned", dir);
    fu_errmsg em = {{0}};
    assert_int_equal(dag_salr_prune_model(model, pruned, 0.5, 4, 1, &em), FU_OK);
    char *out = NULL;
    int rc = tu_sh(&out,
                   "%s run finetune --model %s --data %s --method salr --rank 4 --lr 2e-2 --steps 20 --batch 2 "
                   "--seq-len 16 --loss-log %s/salr.jsonl -o %s/salr-adapter",
                   tu_bin("fusion"), pruned, data, dir, dir);
    if (rc != 0)
        fail_msg("salr finetune exited %d: %s", rc, out);
    free(out);
    char p[4096];
    snprintf(p, sizeof p, "%s/salr.jsonl", dir);
    double first = 0, last = 0;
    int n = 0;
    read_losses(p, &first, &last, &n);
    assert_int_equal(n, 20);
    assert_true(last < first);
    assert_int_equal(tu_sh(&out, "%s run infer --model %s --adapter %s/salr-adapter --prompt-tokens 1,2,3 "
                                 "--max-tokens 4", tu_bin("fusion"), pruned, dir), 0);
    free(out);
    /* salr on a dense model, and a dense method on a pruned one, are refused. */
    assert_int_equal(tu_sh(&out, "%s run finetune --model %s --data %s --method salr -o %s/x", tu_bin("fusion"), model,
                           data, dir), 2);
    assert_non_null(strstr(out, "fusion model prune"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s run finetune --model %s --data %s --method lora -o %s/x", tu_bin("fusion"),
                           pruned, data, dir), 2);
    free(out);
}

/* `fusion model prune` as a user runs it: by default it prunes lm_head too and reports the head's
 * error, `fusion run` fine-tunes and generates with the pruned head (so does --prune-lm-head, said
 * explicitly); --keep-lm-head keeps it dense; the two together are a usage error; tied embeddings
 * keep it dense with a note. */
static void test_dag_cli_salr_prune_lm_head(void **state)
{
    (void)state;
    char *out = NULL;
    int rc = tu_sh(&out, "%s model prune --method salr --svd-rank 4 -i %s -o %s/pruned-head", tu_bin("fusion"),
                   model, dir);
    if (rc != 0)
        fail_msg("prune exited %d: %s", rc, out);
    assert_non_null(strstr(out, "residual rank 4, lm_head pruned"));
    assert_non_null(strstr(out, "block linears mean"));
    assert_non_null(strstr(out, "lm_head: relative error 0."));
    free(out);
    char p[4096];
    snprintf(p, sizeof p, "%s/pruned-head/salr_config.json", dir);
    char *cfg = NULL;
    assert_int_equal(tu_sh(&cfg, "cat %s", p), 0);
    assert_non_null(strstr(cfg, "\"lm_head\": \"salr\""));
    free(cfg);
    rc = tu_sh(&out,
               "%s run finetune --model %s/pruned-head --data %s --method salr --rank 4 --lr 2e-2 --steps 20 "
               "--batch 2 --seq-len 16 --loss-log %s/head.jsonl -o %s/head-adapter",
               tu_bin("fusion"), dir, data, dir, dir);
    if (rc != 0)
        fail_msg("finetune on the pruned head exited %d: %s", rc, out);
    free(out);
    snprintf(p, sizeof p, "%s/head.jsonl", dir);
    double first = 0, last = 0;
    int n = 0;
    read_losses(p, &first, &last, &n);
    assert_int_equal(n, 20);
    assert_true(last < first);
    char *a = NULL, *b = NULL;
    assert_int_equal(tu_sh(&a, "%s run infer -q --model %s/pruned-head --adapter %s/head-adapter "
                               "--prompt-tokens 116,104,101 --max-tokens 12 2>/dev/null", tu_bin("fusion"), dir, dir), 0);
    assert_int_equal(tu_sh(&b, "%s run infer -q --model %s/pruned-head --adapter %s/head-adapter "
                               "--prompt-tokens 116,104,101 --max-tokens 12 2>/dev/null", tu_bin("fusion"), dir, dir), 0);
    assert_true(strlen(a) > 0);
    assert_string_equal(a, b);
    free(a);
    free(b);

    /* --prune-lm-head said explicitly: the same files as the default. */
    assert_int_equal(tu_sh(&out, "%s model prune --method salr --svd-rank 4 --prune-lm-head -i %s -o %s/pruned-head2 && "
                                 "cmp %s/pruned-head/model.safetensors %s/pruned-head2/model.safetensors",
                           tu_bin("fusion"), model, dir, dir, dir), 0);
    free(out);

    /* --keep-lm-head: a dense head. */
    assert_int_equal(tu_sh(&out, "%s model prune --svd-rank 4 --keep-lm-head -i %s -o %s/pruned-kept", tu_bin("fusion"),
                           model, dir), 0);
    assert_non_null(strstr(out, "lm_head dense"));
    assert_null(strstr(out, "lm_head: relative error"));
    free(out);
    snprintf(p, sizeof p, "%s/pruned-kept/salr_config.json", dir);
    assert_int_equal(tu_sh(&cfg, "cat %s", p), 0);
    assert_non_null(strstr(cfg, "\"lm_head\": \"dense\""));
    free(cfg);
    assert_int_equal(tu_sh(&out, "%s run infer -q --model %s/pruned-kept --prompt-tokens 1,2,3 --max-tokens 4",
                           tu_bin("fusion"), dir), 0);
    free(out);
    assert_int_equal(tu_sh(&out, "%s model prune --prune-lm-head --keep-lm-head -i %s -o %s/x", tu_bin("fusion"), model,
                           dir), 2);
    assert_non_null(strstr(out, "contradict"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s model prune --help", tu_bin("fusion")), 0);
    assert_non_null(strstr(out, "--prune-lm-head"));
    assert_non_null(strstr(out, "--keep-lm-head"));
    free(out);

    /* Tied embeddings: left dense, with a note saying why. */
    fu_modelcfg tc;
    fu_modelcfg_defaults(&tc);
    tc.tie_word_embeddings = true;
    snprintf(p, sizeof p, "%s/tied", dir);
    assert_int_equal(dag_model_init_random(p, &tc, 4, 0.08f, NULL), FU_OK);
    assert_int_equal(tu_sh(&out, "%s model prune --svd-rank 4 -i %s -o %s/tied-pruned",
                           tu_bin("fusion"), p, dir), 0);
    assert_non_null(strstr(out, "tied"));
    assert_non_null(strstr(out, "left dense"));
    assert_non_null(strstr(out, "lm_head dense"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s run infer -q --model %s/tied-pruned --prompt-tokens 1,2,3 --max-tokens 4",
                           tu_bin("fusion"), dir), 0);
    free(out);
}

static void test_dag_cli_errors(void **state)
{
    (void)state;
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "%s run finetune --data %s -o %s/x", tu_bin("fusion"), data, dir), 2);
    assert_non_null(strstr(out, "required"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s run finetune --model %s/nope --data %s -o %s/x", tu_bin("fusion"), dir, data, dir),
                     4);
    assert_non_null(strstr(out, "nope"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s run finetune --model %s --data %s --method dora -o %s/x", tu_bin("fusion"), model,
                           data, dir), 2);
    free(out);
    /* Too little data for the batch. */
    assert_int_equal(tu_sh(&out, "%s run finetune --model %s --data %s --seq-len 4096 --batch 8 -o %s/x",
                           tu_bin("fusion"), model, data, dir), 2);
    assert_non_null(strstr(out, "windows"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s run infer --model %s --prompt-tokens 1,999 --max-tokens 2", tu_bin("fusion"),
                           model), 2);
    free(out);
    assert_int_equal(tu_sh(&out, "%s run infer --model %s", tu_bin("fusion"), model), 2);
    free(out);
    assert_int_equal(tu_sh(&out, "%s run infer --model %s --adapter %s --prompt x", tu_bin("fusion"), model, dir), 4);
    assert_non_null(strstr(out, "adapter_config.json"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s run bogus", tu_bin("fusion")), 2);
    free(out);
    assert_int_equal(tu_sh(&out, "%s run finetune --help", tu_bin("fusion")), 0);
    assert_non_null(strstr(out, "--seq-len"));
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_cli_finetune_then_infer),
        cmocka_unit_test(test_dag_cli_salr_finetune),
        cmocka_unit_test(test_dag_cli_salr_prune_lm_head),
        cmocka_unit_test(test_dag_cli_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
