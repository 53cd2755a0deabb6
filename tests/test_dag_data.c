/* dag_data: the data order every pipeline stage and `fusion run finetune` share. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "dag_data.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dag_data_file_order_and_targets_shifted),
        cmocka_unit_test(test_dag_data_micro_batches_split_the_batch),
        cmocka_unit_test(test_dag_data_shuffle_is_a_fresh_permutation_each_pass),
        cmocka_unit_test(test_dag_data_rejects_inconsistent_sizes),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
