/* broker_losshist (broker/broker_losshist.h), in-process: a fine-tune's loss curve as the broker keeps
 * it for GET /api/jobs/JOB/loss, and the set of curves by job.
 *   - every step while it fits; when full, every other point and a doubled stride, again and again,
 *     with the newest step always there and at most `cap` points;
 *   - a replayed step (a recovery) drops the points from it on;
 *   - step 0 and losses that are not finite are not kept;
 *   - the set keeps running jobs' curves and the newest ended ones, dropping the oldest ended. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "broker_losshist.h"

static double loss_of(uint64_t step)
{
    return 10.0 / (double)step;
}

/* The points of h are in increasing order, each with loss_of(step), on the stride but the last. */
static void check_curve(const broker_losshist *h, size_t cap)
{
    size_t n = 0;
    const broker_loss_point *p = broker_losshist_points(h, &n);
    uint64_t stride = broker_losshist_stride(h);
    assert_true(n <= cap);
    for (size_t i = 0; i < n; i++) {
        assert_true(p[i].loss == loss_of(p[i].step));
        if (i > 0)
            assert_true(p[i].step > p[i - 1].step);
        if (i + 1 < n)
            assert_int_equal((p[i].step - 1) % stride, 0);
    }
}

static void test_broker_losshist_every_step_while_it_fits(void **state)
{
    (void)state;
    broker_losshist *h = broker_losshist_new(8);
    for (uint64_t s = 1; s <= 8; s++)
        broker_losshist_add(h, s, loss_of(s));
    size_t n = 0;
    const broker_loss_point *p = broker_losshist_points(h, &n);
    assert_int_equal(n, 8);
    assert_int_equal(broker_losshist_stride(h), 1);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(p[i].step, i + 1);
    check_curve(h, 8);
    broker_losshist_destroy(&h);
    assert_null(h);
    broker_losshist_destroy(&h); /* idempotent */
}

static void test_broker_losshist_full_halves_and_doubles_the_stride(void **state)
{
    (void)state;
    broker_losshist *h = broker_losshist_new(8);
    for (uint64_t s = 1; s <= 9; s++) /* the 9th step: 1,3,5,7 kept, stride 2, then 9 */
        broker_losshist_add(h, s, loss_of(s));
    size_t n = 0;
    const broker_loss_point *p = broker_losshist_points(h, &n);
    assert_int_equal(broker_losshist_stride(h), 2);
    assert_int_equal(n, 5);
    const uint64_t want[] = {1, 3, 5, 7, 9};
    for (size_t i = 0; i < n; i++)
        assert_int_equal(p[i].step, want[i]);
    broker_losshist_add(h, 10, loss_of(10)); /* off the stride: the newest, kept */
    p = broker_losshist_points(h, &n);
    assert_int_equal(n, 6);
    assert_int_equal(p[5].step, 10);
    broker_losshist_add(h, 11, loss_of(11)); /* replaces 10 */
    p = broker_losshist_points(h, &n);
    assert_int_equal(n, 6);
    assert_int_equal(p[4].step, 9);
    assert_int_equal(p[5].step, 11);
    check_curve(h, 8);
    broker_losshist_destroy(&h);
}

/* A long run in the default capacity: 1,024 points at most, an even coverage from step 1 to the
 * newest, the stride the smallest power of two that fits the run. */
static void test_broker_losshist_long_run_stays_bounded(void **state)
{
    (void)state;
    broker_losshist *h = broker_losshist_new(BROKER_LOSSHIST_POINTS);
    const uint64_t steps = 100000;
    size_t most = 0;
    for (uint64_t s = 1; s <= steps; s++) {
        broker_losshist_add(h, s, loss_of(s));
        size_t n = 0;
        (void)broker_losshist_points(h, &n);
        if (n > most)
            most = n;
    }
    check_curve(h, BROKER_LOSSHIST_POINTS);
    size_t n = 0;
    const broker_loss_point *p = broker_losshist_points(h, &n);
    uint64_t stride = broker_losshist_stride(h);
    print_message("100,000 steps: %zu points (at most %zu at once), stride %llu\n", n, most,
                  (unsigned long long)stride);
    assert_int_equal(most, BROKER_LOSSHIST_POINTS);
    assert_int_equal(stride, 128); /* 100,000 / 128 = 782 points fit; / 64 = 1,563 do not */
    assert_int_equal(p[0].step, 1);
    assert_int_equal(p[n - 1].step, steps);
    assert_int_equal(n, (steps - 1) / stride + 1 + 1); /* every stride-th step and the newest */
    for (size_t i = 1; i + 1 < n; i++)
        assert_int_equal(p[i].step - p[i - 1].step, stride);
    broker_losshist_destroy(&h);
}

static void test_broker_losshist_replay_rewinds(void **state)
{
    (void)state;
    broker_losshist *h = broker_losshist_new(16);
    for (uint64_t s = 1; s <= 10; s++)
        broker_losshist_add(h, s, 1.0);
    broker_losshist_add(h, 6, 2.0); /* recovered from the step-5 checkpoint */
    size_t n = 0;
    const broker_loss_point *p = broker_losshist_points(h, &n);
    assert_int_equal(n, 6);
    assert_int_equal(p[5].step, 6);
    assert_true(p[5].loss == 2.0);
    assert_true(p[4].loss == 1.0);
    broker_losshist_add(h, 6, 3.0); /* the same step again: replaced */
    p = broker_losshist_points(h, &n);
    assert_int_equal(n, 6);
    assert_true(p[5].loss == 3.0);
    broker_losshist_destroy(&h);
}

static void test_broker_losshist_refuses_nonsense(void **state)
{
    (void)state;
    broker_losshist *h = broker_losshist_new(0); /* the least capacity instead */
    broker_losshist_add(h, 0, 1.0);
    broker_losshist_add(h, 1, NAN);
    broker_losshist_add(h, 2, INFINITY);
    size_t n = 1;
    (void)broker_losshist_points(h, &n);
    assert_int_equal(n, 0);
    for (uint64_t s = 1; s <= 5; s++)
        broker_losshist_add(h, s, loss_of(s));
    check_curve(h, BROKER_LOSSHIST_MIN);
    const broker_loss_point *p = broker_losshist_points(h, &n);
    assert_int_equal(n, 2);
    assert_int_equal(p[0].step, 1);
    assert_int_equal(p[1].step, 5);
    broker_losshist_destroy(&h);
}

static void test_broker_losshist_set_keeps_the_newest_ended(void **state)
{
    (void)state;
    broker_losses *l = broker_losses_new(4, 2);
    char id[8][17];
    for (int i = 0; i < 8; i++) {
        snprintf(id[i], sizeof id[i], "%016x", i + 1);
        for (uint64_t s = 1; s <= 6; s++)
            broker_losses_add(l, id[i], s, loss_of(s));
    }
    assert_int_equal(broker_losses_count(l), 8);
    const broker_losshist *h = broker_losses_find(l, id[3]);
    assert_non_null(h);
    check_curve(h, 4);
    assert_null(broker_losses_find(l, "00000000000000ff"));
    broker_losses_add(l, "00000000000000ff", 0, 1.0); /* no step: no curve made */
    assert_null(broker_losses_find(l, "00000000000000ff"));
    /* jobs 0, 1, 2 end in that order: the two that ended last stay */
    broker_losses_ended(l, id[0]);
    broker_losses_ended(l, id[1]);
    assert_int_equal(broker_losses_count(l), 8);
    broker_losses_ended(l, id[2]);
    broker_losses_ended(l, id[2]);              /* twice: once */
    broker_losses_ended(l, "00000000000000ff"); /* none: nothing */
    assert_int_equal(broker_losses_count(l), 7);
    assert_null(broker_losses_find(l, id[0]));
    assert_non_null(broker_losses_find(l, id[1]));
    assert_non_null(broker_losses_find(l, id[2]));
    for (int i = 3; i < 8; i++)
        assert_non_null(broker_losses_find(l, id[i])); /* running: kept */
    broker_losses_destroy(&l);
    assert_null(l);
    broker_losses_destroy(&l);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_broker_losshist_every_step_while_it_fits),
        cmocka_unit_test(test_broker_losshist_full_halves_and_doubles_the_stride),
        cmocka_unit_test(test_broker_losshist_long_run_stays_bounded),
        cmocka_unit_test(test_broker_losshist_replay_rewinds),
        cmocka_unit_test(test_broker_losshist_refuses_nonsense),
        cmocka_unit_test(test_broker_losshist_set_keeps_the_newest_ended),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
