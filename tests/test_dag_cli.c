/* `fusion run finetune` and `fusion run infer` as real processes on a tiny model, `run infer --prompts`
 * (batched generations) among them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dag_model.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "testutil.h"
#include "wire.h"

static char *model; /* tiny model, in the scratch directory tu_dir */
static char *data;  /* training text */

static int setup(void **state)
{
    if (tu_tmpdir_setup(state) != 0)
        return -1;
    fu_modelcfg cfg;
    fu_modelcfg_defaults(&cfg); /* 2 layers, hidden 64, vocab 256 */
    size_t n = strlen(tu_dir) + 32;
    model = malloc(n);
    data = malloc(n);
    snprintf(model, n, "%s/model", tu_dir);
    snprintf(data, n, "%s/text.txt", tu_dir);
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
    free(model);
    free(data);
    return tu_tmpdir_teardown(state);
}

/* Reads the loss log tu_dir/name that `run finetune --loss-log` wrote: it must have `steps` lines and
 * its last loss must be below `ratio` times the first. */
static void expect_losses(const char *name, int steps, double ratio)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", tu_dir, name);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[512];
    double first = 0, last = 0;
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, "\"loss\":");
        assert_non_null(p);
        last = atof(p + 7);
        if (n++ == 0)
            first = last;
    }
    fclose(f);
    assert_int_equal(n, steps);
    if (!(last < ratio * first))
        fail_msg("%s: the loss went from %g to %g, not below %.2f of it", name, first, last, ratio);
}

/* `fusion run finetune --method salr` for 20 steps on the model in model_dir must exit 0 and lower
 * the loss; it writes the loss log tu_dir/NAME.jsonl and the adapter tu_dir/NAME-adapter. */
static void salr_finetune_learns(const char *model_dir, const char *name)
{
    tu_fusion_expect(
        0, NULL,
        "run finetune --model %s --data %s --method salr --rank 4 --lr 2e-2 --steps 20 --batch 2 "
        "--seq-len 16 --loss-log %s/%s.jsonl -o %s/%s-adapter",
        model_dir, data, tu_dir, name, tu_dir, name);
    char log[256];
    snprintf(log, sizeof log, "%s.jsonl", name);
    expect_losses(log, 20, 1.0);
}

/* Runs the shell command line (printf format) twice: both runs must exit 0 and print the same.
 * Returns what they printed (caller frees). */
__attribute__((format(printf, 1, 2))) static char *same_twice(const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char *a = tu_sh_expect_out(0, NULL, "%s", cmd), *b = tu_sh_expect_out(0, NULL, "%s", cmd);
    assert_string_equal(a, b);
    free(b);
    return a;
}

/* True when tu_dir/name exists. */
static bool exists(const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", tu_dir, name);
    struct stat sb;
    return stat(path, &sb) == 0;
}

static void test_dag_cli_finetune_then_infer(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    tu_fusion_expect(
        0, "step 30/30 loss",
        "run finetune --model %s --data %s --method lora-fa --rank 4 --alpha 8 --lr 2e-2 --steps 30 "
        "--batch 2 --seq-len 16 --shuffle --seed 5 --loss-log %s/loss.jsonl -o %s/adapter",
        model, data, dir, dir);
    expect_losses("loss.jsonl", 30, 0.8);
    assert_true(exists("adapter/adapter_model.safetensors"));
    assert_true(exists("adapter/adapter_config.json"));

    /* Greedy generation with and without the adapter differ; the same command twice is identical. */
    char *with = same_twice("%s run infer -q --model %s --adapter %s/adapter --prompt-tokens 116,104,101 "
                            "--max-tokens 24 2>/dev/null",
                            tu_bin("fusion"), model, dir);
    char *without = tu_fusion_expect_out(
        0, NULL,
        "run infer -q --threads 1 --model %s --prompt-tokens 116,104,101 --max-tokens 24 2>/dev/null", model);
    assert_string_not_equal(with, without);
    free(with);
    free(without);

    /* Text prompt, sampling, and the logits dump: positions × vocab float32. */
    tu_fusion_expect(
        0, "generated",
        "run infer --model %s --adapter %s/adapter --prompt 'the q' --max-tokens 8 --temperature 0.8 "
        "--top-k 20 --top-p 0.9 --seed 3 --dump-logits %s/logits.bin",
        model, dir, dir);
    char p[4096];
    snprintf(p, sizeof p, "%s/logits.bin", dir);
    struct stat sb;
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

/* Whether two files hold the same bytes. */
static bool same_bytes(const char *a, const char *b)
{
    char pa[4096], pb[4096];
    snprintf(pa, sizeof pa, "%s/%s", tu_dir, a);
    snprintf(pb, sizeof pb, "%s/%s", tu_dir, b);
    FILE *fa = fopen(pa, "rb"), *fb = fopen(pb, "rb");
    bool same = fa && fb;
    while (same) {
        int ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
        if (ca == EOF)
            break;
    }
    if (fa)
        fclose(fa);
    if (fb)
        fclose(fb);
    return same;
}

/* `fusion run finetune` and `run infer` give the same bits for every --threads (docs/DAG.md
 * "Determinism"): a model wide enough that its products are cut into several tiles and split
 * between threads, a learning rate high enough that a last-bit difference would grow. */
static void test_dag_cli_threads_same_bits(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    tu_fusion_expect(0, NULL, "model init -o %s/wide --layers 3 --hidden 256 --heads 4 --kv-heads 2 --ffn 688 "
                     "--vocab 1000 --seed 3", dir);
    static const char *const threads[] = {"1", "2", "3"};
    for (int i = 0; i < 3; i++)
        tu_fusion_expect(0, "step 12/12", "run finetune --threads %s --model %s/wide --data %s --rank 4 --alpha 8 "
                         "--lr 1e-2 --steps 12 --batch 4 --seq-len 32 --seed 7 -o %s/t%s",
                         threads[i], dir, data, dir, threads[i]);
    assert_true(same_bytes("t1/adapter_model.safetensors", "t2/adapter_model.safetensors"));
    assert_true(same_bytes("t1/adapter_model.safetensors", "t3/adapter_model.safetensors"));
    for (int i = 0; i < 2; i++)
        tu_fusion_expect(0, "generated", "run infer --threads %s --model %s/wide --adapter %s/t1 --prompt 'the q' "
                         "--max-tokens 4 --dump-logits %s/logits%s.bin", threads[i], dir, dir, dir, threads[i]);
    assert_true(same_bytes("logits1.bin", "logits2.bin"));
}

static void test_dag_cli_salr_finetune(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    char pruned[4096];
    snprintf(pruned, sizeof pruned, "%s/pruned", dir);
    fu_errmsg em = {{0}};
    assert_int_equal(dag_salr_prune_model(model, pruned, 0.5, 4, 1, &em), FU_OK);
    salr_finetune_learns(pruned, "salr");
    tu_fusion_expect(0, NULL,
                     "run infer --model %s --adapter %s/salr-adapter --prompt-tokens 1,2,3 --max-tokens 4",
                     pruned, dir);
    /* salr on a dense model, and a dense method on a pruned one, are refused. */
    tu_fusion_expect(2, "fusion model prune", "run finetune --model %s --data %s --method salr -o %s/x",
                     model, data, dir);
    tu_fusion_expect(2, NULL, "run finetune --model %s --data %s --method lora -o %s/x", pruned, data, dir);
}

/* `fusion model prune` as a user runs it: by default it prunes lm_head too and reports the head's
 * error, `fusion run` fine-tunes and generates with the pruned head (so does --prune-lm-head, said
 * explicitly); --keep-lm-head keeps it dense; the two together are a usage error; tied embeddings
 * keep it dense with a note. */
static void test_dag_cli_salr_prune_lm_head(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    char *out =
        tu_fusion_expect_out(0, "residual rank 4, lm_head pruned",
                             "model prune --method salr --svd-rank 4 -i %s -o %s/pruned-head", model, dir);
    assert_non_null(strstr(out, "block linears mean"));
    assert_non_null(strstr(out, "lm_head: relative error 0."));
    free(out);
    tu_sh_expect(0, "\"lm_head\": \"salr\"", "cat %s/pruned-head/salr_config.json", dir);
    char pruned[4096];
    snprintf(pruned, sizeof pruned, "%s/pruned-head", dir);
    salr_finetune_learns(pruned, "head");
    char *text = same_twice("%s run infer -q --model %s/pruned-head --adapter %s/head-adapter "
                            "--prompt-tokens 116,104,101 --max-tokens 12 2>/dev/null",
                            tu_bin("fusion"), dir, dir);
    assert_true(strlen(text) > 0);
    free(text);

    /* --prune-lm-head said explicitly: the same files as the default. */
    tu_fusion_expect(0, NULL,
                     "model prune --method salr --svd-rank 4 --prune-lm-head -i %s -o %s/pruned-head2 && "
                     "cmp %s/pruned-head/model.safetensors %s/pruned-head2/model.safetensors",
                     model, dir, dir, dir);

    /* --keep-lm-head: a dense head. */
    out = tu_fusion_expect_out(0, "lm_head dense",
                               "model prune --svd-rank 4 --keep-lm-head -i %s -o %s/pruned-kept", model, dir);
    assert_null(strstr(out, "lm_head: relative error"));
    free(out);
    tu_sh_expect(0, "\"lm_head\": \"dense\"", "cat %s/pruned-kept/salr_config.json", dir);
    tu_fusion_expect(0, NULL, "run infer -q --model %s/pruned-kept --prompt-tokens 1,2,3 --max-tokens 4",
                     dir);
    tu_fusion_expect(2, "contradict", "model prune --prune-lm-head --keep-lm-head -i %s -o %s/x", model, dir);
    out = tu_fusion_expect_out(0, "--prune-lm-head", "model prune --help");
    assert_non_null(strstr(out, "--keep-lm-head"));
    free(out);

    /* Tied embeddings: left dense, with a note saying why. */
    fu_modelcfg tc;
    fu_modelcfg_defaults(&tc);
    tc.tie_word_embeddings = true;
    char p[4096];
    snprintf(p, sizeof p, "%s/tied", dir);
    assert_int_equal(dag_model_init_random(p, &tc, 4, 0.08f, NULL), FU_OK);
    out = tu_fusion_expect_out(0, "tied", "model prune --svd-rank 4 -i %s -o %s/tied-pruned", p, dir);
    assert_non_null(strstr(out, "left dense"));
    assert_non_null(strstr(out, "lm_head dense"));
    free(out);
    tu_fusion_expect(0, NULL, "run infer -q --model %s/tied-pruned --prompt-tokens 1,2,3 --max-tokens 4",
                     dir);
}

static void test_dag_cli_errors(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    tu_fusion_expect(2, "required", "run finetune --data %s -o %s/x", data, dir);
    tu_fusion_expect(4, "nope", "run finetune --model %s/nope --data %s -o %s/x", dir, data, dir);
    tu_fusion_expect(2, NULL, "run finetune --model %s --data %s --method dora -o %s/x", model, data, dir);
    /* Too little data for the batch. */
    tu_fusion_expect(2, "windows", "run finetune --model %s --data %s --seq-len 4096 --batch 8 -o %s/x",
                     model, data, dir);
    tu_fusion_expect(2, NULL, "run infer --model %s --prompt-tokens 1,999 --max-tokens 2", model);
    tu_fusion_expect(2, NULL, "run infer --model %s", model);
    tu_fusion_expect(4, "adapter_config.json", "run infer --model %s --adapter %s --prompt x", model, dir);
    tu_fusion_expect(2, NULL, "run bogus");
    tu_fusion_expect(0, "--seq-len", "run finetune --help");
}

/* JSON Lines prompt/completion data (issue "Real checkpoints"): `run finetune` counts only the
 * completions in its loss (it says how many targets count: 4 bytes of " yes" for each of the 48
 * training examples, 12 held out), and `fusion eval` on the 12 held-out examples finds the
 * adapter's loss on them far below the base model's. */
static void test_dag_cli_jsonl_prompt_masking_and_eval(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    char path[4096];
    snprintf(path, sizeof path, "%s/qa.jsonl", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    static const char *const words[] = {"cat", "river", "blue", "seven", "tree", "lamp", "stone", "cloud"};
    for (int i = 0; i < 60; i++)
        fprintf(f, "{\"prompt\": \"Q: is %s %d ok?\\nA:\", \"completion\": \" yes\"}\n", words[i % 8], i * 7 % 100);
    fclose(f);
    char *out = tu_sh_expect_out(0, "prompt-completion, 60 examples, 192 target tokens counted",
                                 "'%s' run finetune --model %s --data %s --heldout 0.2 --seq-len 31 --batch 4 --steps 40 "
                                 "--lr 3e-2 --rank 4 --alpha 8 --seed 1 -o %s/qa 2>&1",
                                 tu_bin("fusion"), model, path, dir);
    free(out);
    out = tu_sh_expect_out(0, "\"data\":\"held-out\"",
                           "'%s' eval --model %s --data %s --heldout 0.2 --seq-len 31 --adapter %s/qa --json",
                           tu_bin("fusion"), model, path, dir);
    double base = 0, tuned = 0;
    long long targets = 0;
    const char *b = strstr(out, "\"base_loss\":"), *a = strstr(out, "\"adapter_loss\":"), *t = strstr(out, "\"targets\":");
    assert_true(b && a && t);
    base = atof(b + 12);
    tuned = atof(a + 15);
    targets = atoll(t + 10);
    printf("held out: %lld targets, base loss %.3f, with the adapter %.3f\n", targets, base, tuned);
    assert_int_equal(targets, 12 * 4);
    assert_true(tuned < 0.5 * base);
    free(out);
}

/* Max abs difference of two float32 files in tu_dir of the same size (fails when they are not). */
static double logits_diff(const char *a, const char *b)
{
    char pa[4096], pb[4096];
    snprintf(pa, sizeof pa, "%s/%s", tu_dir, a);
    snprintf(pb, sizeof pb, "%s/%s", tu_dir, b);
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    assert_int_equal(fu_file_read_all(pa, 1u << 28, &x, &nx, NULL), FU_OK);
    assert_int_equal(fu_file_read_all(pb, 1u << 28, &y, &ny, NULL), FU_OK);
    assert_int_equal(nx, ny);
    assert_true(nx > 0 && nx % 4 == 0);
    double worst = 0;
    for (size_t i = 0; i < nx / 4; i++) {
        double d = fabs((double)((const float *)x)[i] - ((const float *)y)[i]);
        worst = d > worst ? d : worst;
    }
    free(x);
    free(y);
    return worst;
}

/* Generation from `model merge`'s output equals generation from base plus adapter: the same text,
 * logits within 1e-4 (only the order of the sums differs), for a LoRA-FA adapter on the dense model
 * and for a SALR adapter on a pruned model (made dense: sparse + residual + adapter). */
static void check_merged(const char *base, const char *adapter, const char *merged)
{
    tu_fusion_expect(0, "took the adapter", "model merge --model %s --adapter %s/%s -o %s/%s", base, tu_dir, adapter,
                     tu_dir, merged);
    char *a = tu_sh_expect_out(0, NULL, "'%s' run infer -q --threads 1 --model %s --adapter %s/%s --prompt 'the q' "
                               "--max-tokens 12 --dump-logits %s/%s-a.bin", tu_bin("fusion"), base, tu_dir, adapter,
                               tu_dir, merged);
    char *m = tu_sh_expect_out(0, NULL, "'%s' run infer -q --threads 1 --model %s/%s --prompt 'the q' --max-tokens 12 "
                               "--dump-logits %s/%s-m.bin", tu_bin("fusion"), tu_dir, merged, tu_dir, merged);
    assert_string_equal(a, m);
    char fa[64], fm[64];
    snprintf(fa, sizeof fa, "%s-a.bin", merged);
    snprintf(fm, sizeof fm, "%s-m.bin", merged);
    double d = logits_diff(fa, fm);
    printf("%s: generated '%s', logits max abs diff %.3g\n", merged, a, d);
    assert_true(d <= 1e-4);
    free(a);
    free(m);
}

static void test_dag_cli_merge(void **state)
{
    (void)state;
    tu_fusion_expect(0, NULL, "run finetune --model %s --data %s --rank 4 --lr 3e-2 --steps 20 --batch 2 --seq-len 16 "
                     "-o %s/merge-adapter", model, data, tu_dir);
    check_merged(model, "merge-adapter", "merged");
    tu_fusion_expect(2, "--force", "model merge --model %s --adapter %s/merge-adapter -o %s/merged", model, tu_dir,
                     tu_dir);
    tu_fusion_expect(1, "nothing to merge", "model merge --model %s -o %s/nothing", model, tu_dir);
    char pruned[4096];
    snprintf(pruned, sizeof pruned, "%s/merge-pruned", tu_dir);
    fu_errmsg em = {{0}};
    assert_int_equal(dag_salr_prune_model(model, pruned, 0.5, 4, 1, &em), FU_OK);
    salr_finetune_learns(pruned, "merge-salr");
    check_merged(pruned, "merge-salr-adapter", "merged-salr");
}

/* fusion model quantize: the int8 model checks out in `model info`, LoRA-FA learns over it, and its
 * merged adapter (written over the dequantized weights) generates what base plus adapter does.
 * Pruning it, or quantizing it again, is refused. */
static void test_dag_cli_quantize(void **state)
{
    (void)state;
    tu_fusion_expect(0, "int8 per channel", "model quantize --model %s -o %s/q8", model, tu_dir);
    tu_fusion_expect(0, "int8 linears", "model info %s/q8", tu_dir);
    tu_fusion_expect(2, "--force", "model quantize --model %s -o %s/q8", model, tu_dir);
    tu_fusion_expect(1, "already quantized", "model quantize --model %s/q8 -o %s/q8b", tu_dir, tu_dir);
    tu_fusion_expect(2, "quantized (int8)", "model prune --method salr -i %s/q8 -o %s/q8p", tu_dir, tu_dir);
    tu_fusion_expect(0, NULL, "run finetune --model %s/q8 --data %s --rank 4 --lr 3e-2 --steps 20 --batch 2 "
                     "--seq-len 16 --loss-log %s/q8.jsonl -o %s/q8-adapter", tu_dir, data, tu_dir, tu_dir);
    expect_losses("q8.jsonl", 20, 1.0);
    char base[4096];
    snprintf(base, sizeof base, "%s/q8", tu_dir);
    check_merged(base, "q8-adapter", "merged-q8");
}

/* The "text" of JSON line `index` of a --prompts run's output (caller frees). */
static char *batch_text(const char *out, int index)
{
    for (const char *l = out; l && *l;) {
        const char *nl = strchr(l, '\n');
        size_t len = nl ? (size_t)(nl - l) : strlen(l);
        cJSON *o = cJSON_ParseWithLength(l, len);
        const cJSON *i = cJSON_GetObjectItemCaseSensitive(o, "index");
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "text");
        if (cJSON_IsNumber(i) && i->valueint == index && cJSON_IsString(t)) {
            char *r = strdup(t->valuestring);
            cJSON_Delete(o);
            return r;
        }
        cJSON_Delete(o);
        l = nl ? nl + 1 : NULL;
    }
    fail_msg("no result for prompt %d in:\n%s", index, out);
    return NULL;
}

static void test_dag_cli_infer_prompts_batched(void **state)
{
    (void)state;
    char path[4096];
    snprintf(path, sizeof path, "%s/prompts.jsonl", tu_dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"prompt\": \"the quick\"}\n\n{\"prompt_tokens\": [116, 104, 101, 32, 108]}\n"
          "{\"prompt\": \"over the lazy dog, and back again\"}\n{\"prompt_tokens\": [7]}\n", f);
    fclose(f);
    static const char *const solo[4] = {"--prompt 'the quick'", "--prompt-tokens 116,104,101,32,108",
                                        "--prompt 'over the lazy dog, and back again'", "--prompt-tokens 7"};
    /* One at a time (--batch 1), generation i is `run infer` with seed 7 + i: the same text. */
    char *one = tu_fusion_expect_out(0, NULL, "run infer -q --model %s --prompts %s --batch 1 --max-tokens 10 "
                                     "--temperature 0.9 --seed 7 2>/dev/null", model, path);
    for (int i = 0; i < 4; i++) {
        char *want = tu_fusion_expect_out(0, NULL, "run infer -q --model %s %s --max-tokens 10 --temperature 0.9 "
                                          "--seed %d 2>/dev/null", model, solo[i], 7 + i);
        size_t n = strlen(want);
        if (n && want[n - 1] == '\n')
            want[--n] = '\0';
        wire_utf8_clean(want, n); /* the JSON line shows bytes that are no text as '?' */
        char *got = batch_text(one, i);
        assert_string_equal(got, want);
        free(got);
        free(want);
    }
    /* All four in one batch, greedy: each its text alone (the batch's products round otherwise by
     * about 1e-6, far below this model's gaps between the two likeliest tokens), and a batch of 2 as
     * well (the third and fourth prompts join as the first two end). The statistics count them. */
    char *g1 = tu_fusion_expect_out(0, NULL, "run infer -q --model %s --prompts %s --batch 1 --max-tokens 12 "
                                    "--temperature 0 2>/dev/null", model, path);
    char *g4 = tu_fusion_expect_out(0, "4 generations: 48 tokens", "run infer --model %s --prompts %s --batch 4 "
                                    "--max-tokens 12 --temperature 0 2>&1", model, path);
    char *g2 = tu_fusion_expect_out(0, "batched steps of up to 2", "run infer --model %s --prompts %s --batch 2 "
                                    "--max-tokens 12 --temperature 0 2>&1", model, path);
    for (int i = 0; i < 4; i++) {
        char *a = batch_text(g1, i), *b = batch_text(g4, i), *c = batch_text(g2, i);
        assert_string_equal(a, b);
        assert_string_equal(a, c);
        free(a);
        free(b);
        free(c);
    }
    assert_non_null(strstr(g4, "\"completion_tokens\":12,\"finish_reason\":\"length\""));
    free(g1);
    free(g2);
    free(g4);
    free(one);

    /* Bad files and options: a clear message, nothing generated. */
    snprintf(path, sizeof path, "%s/bad.jsonl", tu_dir);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"prompt\": \"fine\"}\n{\"prompt\": 3}\n", f);
    fclose(f);
    tu_fusion_expect(1, "bad.jsonl': line 2: give one of \"prompt\" (text) or \"prompt_tokens\" (ids)",
                     "run infer --model %s --prompts %s 2>&1", model, path);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"prompt_tokens\": [1, 256]}\n", f);
    fclose(f);
    tu_fusion_expect(1, "line 1: prompt_tokens must be ids below the vocabulary size 256",
                     "run infer --model %s --prompts %s 2>&1", model, path);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("\n  \n", f);
    fclose(f);
    tu_fusion_expect(1, "no prompts in the file", "run infer --model %s --prompts %s 2>&1", model, path);
    tu_fusion_expect(4, "No such file", "run infer --model %s --prompts %s/none.jsonl 2>&1", model, tu_dir);
    tu_fusion_expect(2, "one of --prompt, --prompt-tokens or --prompts",
                     "run infer --model %s --prompts %s --prompt hi 2>&1", model, path);
    tu_fusion_expect(2, "--batch must be 1 to 256", "run infer --model %s --prompts %s --batch 0 2>&1", model, path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_cli_finetune_then_infer),
        cmocka_unit_test(test_dag_cli_threads_same_bits),
        cmocka_unit_test(test_dag_cli_salr_finetune),
        cmocka_unit_test(test_dag_cli_salr_prune_lm_head),
        cmocka_unit_test(test_dag_cli_errors),
        cmocka_unit_test(test_dag_cli_quantize),
        cmocka_unit_test(test_dag_cli_jsonl_prompt_masking_and_eval),
        cmocka_unit_test(test_dag_cli_merge),
        cmocka_unit_test(test_dag_cli_infer_prompts_batched),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
