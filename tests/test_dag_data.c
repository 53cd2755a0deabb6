/* dag_data: the data order every pipeline stage and `fusion run finetune` share. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dag_data.h"
#include "dag_dataset.h"
#include "fu_tokenizer.h"

#define T 4          /* seq_len */
#define W 10         /* windows */
#define NTOK (W * (T + 1) + 3)

/* Token i of the text is i, so a row's first token tells its window: (first) / (T+1). */
static int32_t ids[NTOK];

static int setup(void **state)
{
    (void)state;
    for (int i = 0; i < NTOK; i++)
        ids[i] = i;
    return 0;
}

static size_t window_of(const int32_t *row)
{
    return (size_t)row[0] / (T + 1);
}

static void test_dag_data_file_order_and_targets_shifted(void **state)
{
    (void)state;
    dag_data_order o = {.batch = 4, .micro_batches = 1, .seq_len = T};
    assert_int_equal(dag_data_windows(&o, NTOK), W);
    int32_t tok[4 * T], tgt[4 * T];
    assert_int_equal(dag_data_rows(&o, ids, NTOK, 2, 0, tok, tgt), FU_OK);
    for (int j = 0; j < 4; j++) {
        assert_int_equal(window_of(tok + j * T), (size_t)((2 * 4 + j) % W)); /* wraps past the end */
        for (int t = 0; t < T; t++)
            assert_int_equal(tgt[j * T + t], tok[j * T + t] + 1);
    }
}

static void test_dag_data_micro_batches_split_the_batch(void **state)
{
    (void)state;
    for (int shuffle = 0; shuffle < 2; shuffle++) {
        dag_data_order one = {.batch = 6, .micro_batches = 1, .seq_len = T, .shuffle = shuffle, .seed = 7};
        dag_data_order three = one;
        three.micro_batches = 3;
        for (uint64_t step = 0; step < 5; step++) {
            int32_t all[6 * T], part[6 * T];
            assert_int_equal(dag_data_rows(&one, ids, NTOK, step, 0, all, NULL), FU_OK);
            for (uint32_t m = 0; m < 3; m++)
                assert_int_equal(dag_data_rows(&three, ids, NTOK, step, m, part + m * 2 * T, NULL), FU_OK);
            assert_memory_equal(all, part, sizeof all);
        }
    }
}

static void test_dag_data_shuffle_is_a_fresh_permutation_each_pass(void **state)
{
    (void)state;
    dag_data_order o = {.batch = 5, .micro_batches = 1, .seq_len = T, .shuffle = true, .seed = 3};
    size_t first_pass[W];
    bool differs = false;
    for (int pass = 0; pass < 3; pass++) {
        int seen[W] = {0};
        size_t order[W];
        for (uint64_t step = (uint64_t)pass * 2; step < (uint64_t)pass * 2 + 2; step++) { /* 2 steps = 10 rows */
            int32_t tok[5 * T];
            assert_int_equal(dag_data_rows(&o, ids, NTOK, step, 0, tok, NULL), FU_OK);
            for (int j = 0; j < 5; j++) {
                size_t w = window_of(tok + j * T);
                seen[w]++;
                order[(step - (uint64_t)pass * 2) * 5 + (uint64_t)j] = w;
            }
        }
        for (int w = 0; w < W; w++)
            assert_int_equal(seen[w], 1); /* every window exactly once per pass */
        if (pass == 0)
            memcpy(first_pass, order, sizeof order);
        else if (memcmp(first_pass, order, sizeof order) != 0)
            differs = true;
    }
    assert_true(differs);
    /* Pure: asking again gives the same rows; another seed gives another order. */
    int32_t a[5 * T], b[5 * T];
    assert_int_equal(dag_data_rows(&o, ids, NTOK, 3, 0, a, NULL), FU_OK);
    assert_int_equal(dag_data_rows(&o, ids, NTOK, 3, 0, b, NULL), FU_OK);
    assert_memory_equal(a, b, sizeof a);
    o.seed = 4;
    bool other = false;
    for (uint64_t step = 0; step < 2 && !other; step++) {
        dag_data_order o3 = o;
        o3.seed = 3;
        assert_int_equal(dag_data_rows(&o, ids, NTOK, step, 0, a, NULL), FU_OK);
        assert_int_equal(dag_data_rows(&o3, ids, NTOK, step, 0, b, NULL), FU_OK);
        other = memcmp(a, b, sizeof a) != 0;
    }
    assert_true(other);
}

static void test_dag_data_rejects_inconsistent_sizes(void **state)
{
    (void)state;
    int32_t tok[8 * T];
    dag_data_order o = {.batch = 4, .micro_batches = 3, .seq_len = T};
    assert_int_equal(dag_data_rows(&o, ids, NTOK, 0, 0, tok, NULL), FU_EINVAL); /* 3 does not divide 4 */
    o.micro_batches = 2;
    assert_int_equal(dag_data_rows(&o, ids, NTOK, 0, 2, tok, NULL), FU_EINVAL); /* mb out of range */
    assert_int_equal(dag_data_rows(&o, ids, T, 0, 0, tok, NULL), FU_EINVAL);    /* no whole window */
    o.micro_batches = 0;
    assert_int_equal(dag_data_rows(&o, ids, NTOK, 0, 0, tok, NULL), FU_EINVAL);
    o.micro_batches = 1;
    o.seq_len = 0;
    assert_int_equal(dag_data_rows(&o, ids, NTOK, 0, 0, tok, NULL), FU_EINVAL);
    assert_int_equal(dag_data_rows(NULL, ids, NTOK, 0, 0, tok, NULL), FU_EINVAL);
}

/* ---- dag_dataset: JSON Lines, masks, chat formats, the held-out split ---------------------------- */

static size_t count_ignored(const int32_t *t, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += t[i] == DAG_DATA_IGNORE;
    return k;
}

/* Prompt/completion lines: only completion bytes count (byte tokens: no BOS/EOS), each example is
 * padded to whole windows, and the rows dag_data cuts give -100 for every other target. */
static void test_dag_dataset_prompt_completion_masks_the_prompt(void **state)
{
    (void)state;
    fu_tokenizer *tok = fu_tokenizer_new_bytes(256);
    const char *data = "{\"prompt\": \"2+2=\", \"completion\": \"4\"}\n"
                       "\n"
                       "{\"prompt\": \"capital of France? \", \"completion\": \"Paris\"}\n";
    dag_dataset_opts o = {.seq_len = 7};
    dag_dataset ds;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_dataset_make(tok, data, strlen(data), &o, &ds, &em), FU_OK);
    assert_string_equal(ds.format, "prompt-completion");
    assert_int_equal(ds.examples, 2);
    assert_int_equal(ds.n_train % 8, 0); /* whole windows of seq_len + 1 */
    assert_int_equal(ds.n_train, 8 + 3 * 8); /* 5 tokens -> 1 window, 24 tokens -> 3 */
    /* completion bytes are the only targets that count: "4" (its window's 5th token) and "Paris" */
    assert_int_equal(ds.counted, 1 + 5);
    assert_int_equal(ds.masked, 4 * 7 - 6);
    dag_data_order ord = {.batch = 4, .micro_batches = 1, .seq_len = 7};
    int32_t tk[28], tg[28];
    assert_int_equal(dag_data_rows(&ord, ds.train, ds.n_train, 0, 0, tk, tg), FU_OK);
    assert_int_equal(tk[0], '2');           /* inputs are the ids, masked or not */
    assert_int_equal(tg[3], '4');           /* the target after "2+2=" is the completion */
    assert_int_equal(tg[0], DAG_DATA_IGNORE); /* "+" is prompt: not counted */
    assert_int_equal(28 - count_ignored(tg, 28), 6);
    dag_dataset_free(&ds);
    fu_tokenizer_destroy(&tok);
}

/* Chat lines in ChatML: the assistant's content and its <|im_end|> count, the rest does not; a
 * model with no chat template, a bad role and a line of another shape are refused, naming the line. */
static void test_dag_dataset_chat_and_refusals(void **state)
{
    (void)state;
    fu_tokenizer *tok = fu_tokenizer_new_bytes(256);
    const char *chat = "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, "
                       "{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}\n";
    dag_dataset_opts o = {.seq_len = 127, .chat = DAG_CHAT_CHATML}; /* the chat fits one window */
    dag_dataset ds;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_dataset_make(tok, chat, strlen(chat), &o, &ds, &em), FU_OK);
    assert_string_equal(ds.format, "chat");
    assert_int_equal(ds.counted, strlen("hello") + strlen("<|im_end|>"));
    dag_dataset_free(&ds);
    dag_chat_format f;
    assert_int_equal(dag_chat_format_of("{% for m in messages %}<|im_start|>{{ m.role }}<|im_end|>{% endfor %}", &f, &em),
                     FU_OK);
    assert_int_equal(f, DAG_CHAT_CHATML);
    assert_int_equal(dag_chat_format_of("<|start_header_id|>x<|end_header_id|><|eot_id|>", &f, &em), FU_OK);
    assert_int_equal(f, DAG_CHAT_LLAMA3);
    assert_int_equal(dag_chat_format_of("{{ bos_token }}[INST] {{ m }} [/INST]", &f, &em), FU_OK);
    assert_int_equal(f, DAG_CHAT_INST);
    assert_int_equal(dag_chat_format_of("<start_of_turn>user", &f, &em), FU_EVERSION);
    assert_non_null(strstr(em.msg, "not one fusion knows"));
    o.chat = DAG_CHAT_NONE;
    assert_int_equal(dag_dataset_make(tok, chat, strlen(chat), &o, &ds, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "line 1") && strstr(em.msg, "chat_template"));
    const char *role = "{\"text\": \"fine\"}\n{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}\n";
    o.chat = DAG_CHAT_LLAMA3;
    assert_int_equal(dag_dataset_make(tok, role, strlen(role), &o, &ds, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "line 2") && strstr(em.msg, "robot"));
    const char *shape = "{\"text\": \"fine\"}\n{\"question\": \"?\"}\n";
    assert_int_equal(dag_dataset_make(tok, shape, strlen(shape), &o, &ds, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "line 2 is not"));
    fu_tokenizer_destroy(&tok);
}

/* The held-out split: the last examples (JSON Lines), the last windows (plain text). */
static void test_dag_dataset_heldout_split(void **state)
{
    (void)state;
    fu_tokenizer *tok = fu_tokenizer_new_bytes(256);
    char data[2048] = "";
    for (int i = 0; i < 10; i++)
        snprintf(data + strlen(data), sizeof data - strlen(data), "{\"prompt\": \"q%d \", \"completion\": \"a%d\"}\n", i, i);
    dag_dataset_opts o = {.seq_len = 7, .heldout = 0.2};
    dag_dataset ds;
    fu_errmsg em = {{0}};
    assert_int_equal(dag_dataset_make(tok, data, strlen(data), &o, &ds, &em), FU_OK);
    assert_int_equal(ds.examples, 10);
    assert_int_equal(ds.heldout_examples, 2);
    assert_int_equal(ds.n_train, 8 * 8);
    assert_int_equal(ds.n_heldout, 2 * 8);
    assert_int_equal(DAG_DATA_ID(ds.heldout[0]), 'q');
    assert_int_equal(DAG_DATA_ID(ds.heldout[1]), '8'); /* the 9th example */
    dag_dataset_free(&ds);
    const char *text = "abcdefghijklmnopqrstuvwxyz0123456789"; /* 36 bytes: 4 windows of 8 and 4 left */
    assert_int_equal(dag_dataset_make(tok, text, strlen(text), &o, &ds, &em), FU_OK);
    assert_string_equal(ds.format, "text");
    assert_int_equal(ds.n_train, 24);
    assert_int_equal(ds.n_heldout, 12);
    assert_int_equal(ds.heldout[0], 'y'); /* the last window and what is left: "yz0123456789" */
    assert_int_equal(ds.masked, 0);       /* plain text: everything counts */
    dag_dataset_free(&ds);
    o.heldout = 0.9;
    assert_int_equal(dag_dataset_make(tok, text, strlen(text), &o, &ds, &em), FU_EINVAL);
    fu_tokenizer_destroy(&tok);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_data_file_order_and_targets_shifted),
        cmocka_unit_test(test_dag_data_micro_batches_split_the_batch),
        cmocka_unit_test(test_dag_data_shuffle_is_a_fresh_permutation_each_pass),
        cmocka_unit_test(test_dag_data_rejects_inconsistent_sizes),
        cmocka_unit_test(test_dag_dataset_prompt_completion_masks_the_prompt),
        cmocka_unit_test(test_dag_dataset_chat_and_refusals),
        cmocka_unit_test(test_dag_dataset_heldout_split),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
