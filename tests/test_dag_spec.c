/* dag_spec: defaults, every field through JSON and back, every field refused out of range or of the
 * wrong type with its name in the message, unknown keys, kinds, targets as a list, and the command
 * line giving the same spec as the JSON. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "dag_spec.h"

static void test_dag_spec_defaults(void **state)
{
    (void)state;
    dag_spec s;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_parse("{}", 2, DAG_JOB_FINETUNE, &s, &em), FU_OK);
    assert_int_equal(s.kind, DAG_JOB_FINETUNE);
    assert_int_equal(s.method, DAG_ADAPTER_LORA_FA);
    assert_int_equal(s.rank, 8);
    assert_true(s.alpha == 16.0); /* 2 x rank */
    assert_true(s.lr == 1e-3);
    assert_int_equal(s.steps, 100);
    assert_int_equal(s.batch, 4);
    assert_int_equal(s.seq_len, 128);
    assert_int_equal(s.micro_batches, 1);
    assert_int_equal(s.checkpoint_every, 10);
    assert_true(s.verify == -1);
    assert_int_equal(s.seed, 0);
    assert_int_equal(s.targets, 0);
    kern_adamw_params ap = dag_spec_adamw(&s);
    assert_true(ap.beta1 == 0.9f && ap.beta2 == 0.999f && ap.eps == 1e-8f && ap.lr == 1e-3f);
    dag_spec_clear(&s);
    assert_int_equal(dag_spec_parse("{}", 2, DAG_JOB_INFER, &s, &em), FU_OK);
    assert_int_equal(s.max_tokens, 64);
    assert_true(s.top_p == 1.0 && s.temperature == 0.0);
    assert_null(s.prompt_tokens);
    dag_spec_clear(&s);
}

static void roundtrip(dag_spec *s)
{
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_check(s, &em), FU_OK);
    char *txt = dag_spec_to_json(s);
    dag_spec back;
    if (dag_spec_parse(txt, strlen(txt), DAG_JOB_ANY, &back, &em) != FU_OK)
        fail_msg("%s: %s", txt, em.msg);
    char *again = dag_spec_to_json(&back);
    assert_string_equal(txt, again);
    assert_int_equal(back.kind, s->kind);
    assert_string_equal(back.model, s->model);
    assert_int_equal(back.n_prompt_tokens, s->n_prompt_tokens);
    if (s->n_prompt_tokens)
        assert_memory_equal(back.prompt_tokens, s->prompt_tokens, s->n_prompt_tokens * sizeof *s->prompt_tokens);
    free(txt);
    free(again);
    dag_spec_clear(&back);
}

static void test_dag_spec_every_field_roundtrips(void **state)
{
    (void)state;
    dag_spec s;
    dag_spec_init(&s, DAG_JOB_FINETUNE);
    snprintf(s.model, sizeof s.model, "/models/llama");
    s.method = DAG_ADAPTER_SALR;
    s.rank = 12;
    s.alpha = 7.5;
    s.targets = DAG_TARGET_BIT(DAG_TARGET_Q) | DAG_TARGET_BIT(DAG_TARGET_V);
    s.lr = 3e-4;
    s.weight_decay = 0.01;
    s.steps = 77;
    s.batch = 6;
    s.seq_len = 33;
    s.micro_batches = 3;
    s.shuffle = true;
    s.seed = 1125899906842623ull; /* 2^50 - 1: the largest seed kept exactly */
    s.checkpoint_every = 5;
    s.verify = 0.25;
    s.act_codec = KERN_CODEC_INT8;
    s.grad_codec = KERN_CODEC_BF16;
    roundtrip(&s);
    char *txt = dag_spec_to_json(&s);
    assert_non_null(strstr(txt, "\"targets\":[\"q_proj\",\"v_proj\"]"));
    assert_non_null(strstr(txt, "\"act_codec\":\"int8\",\"grad_codec\":\"bf16\""));
    free(txt);
    s.micro_batches = 0; /* a fine-tune may leave the count to the broker */
    roundtrip(&s);
    dag_spec_init(&s, DAG_JOB_INFER);
    snprintf(s.adapter_job, sizeof s.adapter_job, "00112233aabbccdd");
    int32_t ids[] = {1, 2, 70000};
    s.prompt_tokens = ids;
    s.n_prompt_tokens = 3;
    s.max_tokens = 5;
    s.dump_logits = true;
    /* sampling */
    s.seed = 3;
    s.temperature = 0.7;
    s.top_k = 40;
    s.top_p = 0.9;
    roundtrip(&s);
    /* stop strings: kept through the round trip, left out of the text when there are none */
    snprintf(s.stop[0], sizeof s.stop[0], "\n\n");
    snprintf(s.stop[1], sizeof s.stop[1], "END");
    s.n_stop = 2;
    roundtrip(&s);
    txt = dag_spec_to_json(&s);
    assert_non_null(strstr(txt, "\"stop\":[\"\\n\\n\",\"END\"]"));
    free(txt);
    assert_int_equal(dag_spec_stop_at(&s, "abc END x\n\n", 12), 4); /* the first of any */
    assert_int_equal(dag_spec_stop_at(&s, "a\n\nEND", 6), 1);
    assert_int_equal(dag_spec_stop_at(&s, "EN", 2), 2); /* none */
    s.n_stop = 0;
    txt = dag_spec_to_json(&s);
    assert_null(strstr(txt, "stop"));
    free(txt);
}

/* Every numeric key: a string, a value above and below its range are refused naming the key. */
static void test_dag_spec_refuses_bad_values(void **state)
{
    (void)state;
    static const struct {
        const char *key, *hi, *lo;
        dag_job_kind kind;
    } cases[] = {
        {"rank", "4097", "0", DAG_JOB_FINETUNE},          {"alpha", "1e7", "-1", DAG_JOB_FINETUNE},
        {"lr", "11", "0", DAG_JOB_FINETUNE},              {"weight_decay", "11", "-0.1", DAG_JOB_FINETUNE},
        {"steps", "1e10", "0", DAG_JOB_FINETUNE},         {"batch", "65537", "0", DAG_JOB_FINETUNE},
        {"seq_len", "2000000", "0", DAG_JOB_FINETUNE},    {"micro_batches", "65537", "-1", DAG_JOB_FINETUNE},
        {"checkpoint_every", "1e10", "0", DAG_JOB_FINETUNE}, {"verify", "1.5", "-0.5", DAG_JOB_FINETUNE},
        {"seed", "1e17", "-1", DAG_JOB_FINETUNE},         {"max_tokens", "65537", "0", DAG_JOB_INFER},
        {"temperature", "101", "-1", DAG_JOB_INFER},      {"top_k", "5000000", "-1", DAG_JOB_INFER},
        {"top_p", "1.5", "-0.1", DAG_JOB_INFER},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *vals[] = {cases[i].hi, cases[i].lo, "\"3\"", "true", "1.5"};
        for (size_t v = 0; v < sizeof vals / sizeof vals[0]; v++) {
            if (v == 4 && (strcmp(cases[i].key, "alpha") == 0 || strcmp(cases[i].key, "lr") == 0 ||
                           strcmp(cases[i].key, "weight_decay") == 0 || strcmp(cases[i].key, "verify") == 0 ||
                           strcmp(cases[i].key, "temperature") == 0))
                continue; /* fractions are fine there (1.5 > 1 for verify and top_p is covered by hi) */
            char txt[128], want[64];
            snprintf(txt, sizeof txt, "{\"%s\": %s}", cases[i].key, vals[v]);
            snprintf(want, sizeof want, "\"%s\"", cases[i].key);
            dag_spec s;
            fu_errmsg em = {{0}};
            fu_err rc = dag_spec_parse(txt, strlen(txt), cases[i].kind, &s, &em);
            if (rc != FU_EINVAL || !strstr(em.msg, want))
                fail_msg("%s: %s (%s)", txt, fu_strerror(rc), em.msg);
        }
    }
}

static void expect_refused(const char *txt, dag_job_kind kind, fu_err want, const char *needle)
{
    dag_spec s;
    fu_errmsg em = {{0}};
    fu_err rc = dag_spec_parse(txt, strlen(txt), kind, &s, &em);
    if (rc != want || !strstr(em.msg, needle))
        fail_msg("%s: %s: '%s' (wanted '%s')", txt, fu_strerror(rc), em.msg, needle);
    assert_null(s.prompt_tokens); /* cleared */
}

static void test_dag_spec_refuses_bad_specs(void **state)
{
    (void)state;
    expect_refused("[1]", DAG_JOB_FINETUNE, FU_EPROTO, "not a JSON object");
    expect_refused("{\"rank\": 8", DAG_JOB_FINETUNE, FU_EPROTO, "not a JSON object");
    expect_refused("{\"ranq\": 8}", DAG_JOB_FINETUNE, FU_EINVAL, "unknown key \"ranq\" for a finetune job");
    expect_refused("{\"max_tokens\": 8}", DAG_JOB_FINETUNE, FU_EINVAL, "unknown key \"max_tokens\"");
    expect_refused("{\"steps\": 8}", DAG_JOB_INFER, FU_EINVAL, "unknown key \"steps\" for a infer job");
    expect_refused("{\"targets\": \"q,v\"}", DAG_JOB_FINETUNE, FU_EINVAL, "\"targets\" must be a list");
    expect_refused("{\"targets\": [\"q_proj\", \"x_proj\"]}", DAG_JOB_FINETUNE, FU_EINVAL, "\"targets\"");
    expect_refused("{\"targets\": []}", DAG_JOB_FINETUNE, FU_EINVAL, "\"targets\"");
    expect_refused("{\"method\": \"none\"}", DAG_JOB_FINETUNE, FU_EINVAL, "\"method\"");
    expect_refused("{\"shuffle\": 1}", DAG_JOB_FINETUNE, FU_EINVAL, "\"shuffle\"");
    expect_refused("{\"model\": 3}", DAG_JOB_FINETUNE, FU_EINVAL, "\"model\"");
    expect_refused("{\"batch\": 6, \"micro_batches\": 4}", DAG_JOB_FINETUNE, FU_EINVAL, "must divide");
    expect_refused("{\"micro_batches\": 0}", DAG_JOB_EVAL, FU_EINVAL, "is for fine-tunes");
    expect_refused("{\"act_codec\": \"int4\"}", DAG_JOB_FINETUNE, FU_EINVAL, "\"act_codec\" must be f32, f16, bf16 or int8");
    expect_refused("{\"grad_codec\": 8}", DAG_JOB_FINETUNE, FU_EINVAL, "\"grad_codec\"");
    expect_refused("{\"grad_codec\": \"int8\"}", DAG_JOB_EVAL, FU_EINVAL, "unknown key \"grad_codec\"");
    expect_refused("{\"act_codec\": \"int8\"}", DAG_JOB_INFER, FU_EINVAL, "unknown key \"act_codec\"");
    expect_refused("{\"batch\": 4096, \"seq_len\": 4096}", DAG_JOB_FINETUNE, FU_EINVAL, "at most");
    expect_refused("{\"kind\": \"infer\"}", DAG_JOB_FINETUNE, FU_EINVAL, "\"kind\" is \"infer\" in a finetune job");
    expect_refused("{\"kind\": \"train\"}", DAG_JOB_ANY, FU_EINVAL, "\"kind\"");
    expect_refused("{\"adapter_job\": \"xyz\"}", DAG_JOB_INFER, FU_EINVAL, "\"adapter_job\"");
    expect_refused("{\"prompt_tokens\": [1, -2]}", DAG_JOB_INFER, FU_EINVAL, "\"prompt_tokens\"");
    expect_refused("{\"prompt_tokens\": 5}", DAG_JOB_INFER, FU_EINVAL, "\"prompt_tokens\"");
    expect_refused("{\"dump_logits\": \"yes\"}", DAG_JOB_INFER, FU_EINVAL, "\"dump_logits\"");
    expect_refused("{\"stop\": \"x\"}", DAG_JOB_INFER, FU_EINVAL, "\"stop\"");
    expect_refused("{\"stop\": [\"\"]}", DAG_JOB_INFER, FU_EINVAL, "\"stop\" strings are 1 to 256 bytes");
    expect_refused("{\"stop\": [\"a\", \"b\", \"c\", \"d\", \"e\"]}", DAG_JOB_INFER, FU_EINVAL, "at most 4");
    expect_refused("{\"stop\": [\"a\"]}", DAG_JOB_FINETUNE, FU_EINVAL, "unknown key \"stop\"");
    expect_refused("{\"trusted_ends\": 1}", DAG_JOB_FINETUNE, FU_EINVAL, "\"trusted_ends\" must be true or false");
}

/* trusted_ends: unset (-1) by default and left out of the canonical text; true or false for either
 * kind, kept through a round trip. */
static void test_dag_spec_trusted_ends(void **state)
{
    (void)state;
    dag_spec s;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_parse("{}", 2, DAG_JOB_FINETUNE, &s, &em), FU_OK);
    assert_int_equal(s.trusted_ends, -1);
    char *t = dag_spec_to_json(&s);
    assert_null(strstr(t, "trusted_ends"));
    free(t);
    dag_spec_clear(&s);
    static const char *const texts[] = {"{\"trusted_ends\": false}", "{\"kind\": \"infer\", \"trusted_ends\": true}"};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(dag_spec_parse(texts[i], strlen(texts[i]), DAG_JOB_ANY, &s, &em), FU_OK);
        assert_int_equal(s.trusted_ends, i);
        t = dag_spec_to_json(&s);
        dag_spec back;
        assert_int_equal(dag_spec_parse(t, strlen(t), DAG_JOB_ANY, &back, &em), FU_OK);
        assert_int_equal(back.trusted_ends, i);
        free(t);
        dag_spec_clear(&back);
        dag_spec_clear(&s);
    }
}

static void test_dag_spec_kind_from_text(void **state)
{
    (void)state;
    dag_spec s;
    fu_errmsg em = {{0}};
    const char *ft = "{\"steps\": 3, \"targets\": [\"q\", \"v_proj\"]}";
    assert_int_equal(dag_spec_parse(ft, strlen(ft), DAG_JOB_ANY, &s, &em), FU_OK);
    assert_int_equal(s.kind, DAG_JOB_FINETUNE);
    assert_int_equal(s.targets, DAG_TARGET_BIT(DAG_TARGET_Q) | DAG_TARGET_BIT(DAG_TARGET_V));
    dag_spec_clear(&s);
    const char *in = "{\"max_tokens\": 3, \"seed\": 2}";
    assert_int_equal(dag_spec_parse(in, strlen(in), DAG_JOB_ANY, &s, &em), FU_OK);
    assert_int_equal(s.kind, DAG_JOB_INFER);
    assert_int_equal(s.max_tokens, 3);
    dag_spec_clear(&s);
    const char *k = "{\"kind\": \"infer\"}";
    assert_int_equal(dag_spec_parse(k, strlen(k), DAG_JOB_ANY, &s, &em), FU_OK);
    assert_int_equal(s.kind, DAG_JOB_INFER);
    dag_spec_clear(&s);
}

/* The options of `fusion submit finetune` give the spec the JSON gives. */
static void test_dag_spec_cli_matches_json(void **state)
{
    (void)state;
    dag_spec_cli c;
    fu_opt opts[DAG_SPEC_CLI_MAX_OPTS];
    size_t n = 0;
    dag_spec_cli_opts(&c, DAG_JOB_FINETUNE, DAG_SPEC_CLI_PIPELINE, opts, DAG_SPEC_CLI_MAX_OPTS, &n);
    assert_true(n >= 14);
    fu_cmd cmd = {.prog = "test", .usage = "", .summary = "", .opts = opts, .n_opts = n};
    char *argv[] = {"test", "--targets", "q,v", "--rank", "4", "--steps", "20", "--batch", "4", "--micro-batches", "2",
                    "--seq-len", "16", "--lr", "0.01", "--seed", "7", "--shuffle", "--verify", "0.5",
                    "--wire-codec", "int8,bf16", NULL};
    int argc = (int)(sizeof argv / sizeof argv[0]) - 1, code = 0;
    size_t npos;
    assert_int_equal(fu_opts_parse(&cmd, argc, argv, &npos, &code), FU_OK);
    dag_spec a, b;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_FINETUNE, "/m", &a, &em), FU_OK);
    const char *txt = "{\"model\": \"/m\", \"targets\": [\"q_proj\", \"v_proj\"], \"rank\": 4, \"steps\": 20, "
                      "\"batch\": 4, \"micro_batches\": 2, \"seq_len\": 16, \"lr\": 0.01, \"seed\": 7, "
                      "\"shuffle\": true, \"verify\": 0.5, \"act_codec\": \"int8\", \"grad_codec\": \"bf16\"}";
    assert_int_equal(dag_spec_parse(txt, strlen(txt), DAG_JOB_FINETUNE, &b, &em), FU_OK);
    char *ja = dag_spec_to_json(&a), *jb = dag_spec_to_json(&b);
    assert_string_equal(ja, jb);
    free(ja);
    free(jb);
    /* One codec for both directions; bad ones name the option. */
    c.wire_codec = "bf16";
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_FINETUNE, "/m", &a, &em), FU_OK);
    assert_true(a.act_codec == KERN_CODEC_BF16 && a.grad_codec == KERN_CODEC_BF16);
    c.wire_codec = "int8"; /* int8 alone: its gradients with error feedback */
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_FINETUNE, "/m", &a, &em), FU_OK);
    assert_true(a.act_codec == KERN_CODEC_INT8 && a.grad_codec == KERN_CODEC_INT8_EF);
    c.wire_codec = "int8,int8";
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_FINETUNE, "/m", &a, &em), FU_OK);
    assert_true(a.act_codec == KERN_CODEC_INT8 && a.grad_codec == KERN_CODEC_INT8);
    const char *bad[] = {"int4", "int8,", ",int8", "f32,f16,bf16", "averyveryverylongcodecname", "int8-ef"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c.wire_codec = bad[i];
        assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_FINETUNE, "/m", &a, &em), FU_EINVAL);
        assert_non_null(strstr(em.msg, "--wire-codec must be"));
    }
    c.wire_codec = NULL;
    /* Bad options name themselves. */
    c.ival[0] = 0; /* rank */
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_FINETUNE, "/m", &a, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "--rank must be"));
    c.ival[0] = 4;
    c.targets = "q,x";
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_FINETUNE, "/m", &a, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "--targets"));
    /* Inference: the prompt ids. */
    n = 0;
    dag_spec_cli_opts(&c, DAG_JOB_INFER, 0, opts, DAG_SPEC_CLI_MAX_OPTS, &n);
    c.prompt_tokens = "5,6,7";
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_INFER, NULL, &a, &em), FU_OK);
    assert_int_equal(a.n_prompt_tokens, 3);
    assert_int_equal(a.prompt_tokens[2], 7);
    dag_spec_clear(&a);
    c.prompt_tokens = "5,,7";
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_INFER, NULL, &a, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "--prompt-tokens"));
    c.prompt_tokens = "5";
    c.stop = "\n";
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_INFER, NULL, &a, &em), FU_OK);
    assert_int_equal(a.n_stop, 1);
    assert_string_equal(a.stop[0], "\n");
    dag_spec_clear(&a);
    c.stop = "";
    assert_int_equal(dag_spec_from_cli(&c, DAG_JOB_INFER, NULL, &a, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "--stop"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_spec_defaults),
        cmocka_unit_test(test_dag_spec_every_field_roundtrips),
        cmocka_unit_test(test_dag_spec_refuses_bad_values),
        cmocka_unit_test(test_dag_spec_refuses_bad_specs),
        cmocka_unit_test(test_dag_spec_trusted_ends),
        cmocka_unit_test(test_dag_spec_kind_from_text),
        cmocka_unit_test(test_dag_spec_cli_matches_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
