/* peer_guest: the daily window, the busy hysteresis, the owner's pause, a paused compute thread that
 * waits and resumes, and the duty cycle's CPU share. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "fu_clock.h"
#include "peer_guest.h"

static void test_peer_guest_hours_parse(void **state)
{
    (void)state;
    int f, t;
    fu_errmsg em = {{0}};
    assert_int_equal(peer_guest_hours_parse("22-08", &f, &t, &em), FU_OK);
    assert_int_equal(f, 22 * 60);
    assert_int_equal(t, 8 * 60);
    assert_int_equal(peer_guest_hours_parse("9-17", &f, &t, &em), FU_OK);
    assert_int_equal(f, 9 * 60);
    assert_int_equal(t, 17 * 60);
    assert_int_equal(peer_guest_hours_parse("22:30-07:15", &f, &t, &em), FU_OK);
    assert_int_equal(f, 22 * 60 + 30);
    assert_int_equal(t, 7 * 60 + 15);
    assert_int_equal(peer_guest_hours_parse("0-24", &f, &t, &em), FU_EINVAL); /* the whole day */
    assert_non_null(strstr(em.msg, "whole day"));
    const char *bad[] = {"", "22", "25-3", "22-08x", "7-7", "22:3-08", "22:60-08", "-3-4", "24:30-1", "a-b"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        em.msg[0] = '\0';
        assert_int_equal(peer_guest_hours_parse(bad[i], &f, &t, &em), FU_EINVAL);
        assert_non_null(strstr(em.msg, "--hours"));
    }
}

static void test_peer_guest_in_hours(void **state)
{
    (void)state;
    int f = 22 * 60, t = 8 * 60; /* wraps past midnight */
    assert_true(peer_guest_in_hours(f, t, 23 * 60));
    assert_true(peer_guest_in_hours(f, t, 0));
    assert_true(peer_guest_in_hours(f, t, 7 * 60 + 59));
    assert_false(peer_guest_in_hours(f, t, 8 * 60));
    assert_false(peer_guest_in_hours(f, t, 12 * 60));
    assert_true(peer_guest_in_hours(f, t, 22 * 60));
    assert_true(peer_guest_in_hours(9 * 60, 17 * 60, 9 * 60));
    assert_false(peer_guest_in_hours(9 * 60, 17 * 60, 17 * 60));
    assert_false(peer_guest_in_hours(9 * 60, 17 * 60, 3 * 60));
}

static void test_peer_guest_busy_hysteresis(void **state)
{
    (void)state;
    peer_guest_cfg c = {.pause_when_busy = true, .busy_percent = 50};
    peer_guest_t *g = peer_guest_new(&c, 1);
    assert_non_null(g);
    assert_int_equal(peer_guest_feed(g, 80, -1), 0); /* one busy sample is not enough */
    assert_int_equal(peer_guest_feed(g, 30, -1), 0); /* ... and the run starts again */
    for (int i = 1; i < PEER_GUEST_BUSY_ON; i++)
        assert_int_equal(peer_guest_feed(g, 90, -1), 0);
    assert_int_equal(peer_guest_feed(g, 90, -1), PEER_PAUSE_BUSY);
    assert_int_equal(peer_guest_paused(g), PEER_PAUSE_BUSY);
    char text[200];
    peer_guest_describe(g, peer_guest_paused(g), text, sizeof text);
    assert_non_null(strstr(text, "90%"));
    assert_int_equal(peer_guest_feed(g, -1, -1), PEER_PAUSE_BUSY); /* an unreadable sample changes nothing */
    for (int i = 1; i < PEER_GUEST_BUSY_OFF; i++)
        assert_int_equal(peer_guest_feed(g, 10, -1), PEER_PAUSE_BUSY);
    assert_int_equal(peer_guest_feed(g, 10, -1), 0);
    peer_guest_destroy(&g);
    assert_null(g);
    /* Without --pause-when-busy the load never pauses. */
    peer_guest_cfg off = {0};
    g = peer_guest_new(&off, 1);
    for (int i = 0; i < 10; i++)
        assert_int_equal(peer_guest_feed(g, 100, -1), 0);
    peer_guest_destroy(&g);
}

static void test_peer_guest_hours_and_owner(void **state)
{
    (void)state;
    peer_guest_cfg c = {.hours_from = 22 * 60, .hours_to = 8 * 60};
    peer_guest_t *g = peer_guest_new(&c, 2);
    assert_int_equal(peer_guest_feed(g, -1, 23 * 60), 0);
    assert_int_equal(peer_guest_feed(g, -1, 12 * 60), PEER_PAUSE_HOURS);
    peer_guest_owner_pause(g, true);
    assert_int_equal(peer_guest_paused(g), PEER_PAUSE_HOURS | PEER_PAUSE_OWNER);
    char text[200];
    peer_guest_describe(g, peer_guest_paused(g), text, sizeof text);
    assert_string_equal(text, "outside hours 22:00-08:00; paused by its owner");
    assert_int_equal(peer_guest_feed(g, -1, 1 * 60), PEER_PAUSE_OWNER); /* back in the window */
    peer_guest_owner_pause(g, false);
    assert_int_equal(peer_guest_paused(g), 0);
    /* Leaving: no pause from then on. */
    peer_guest_owner_pause(g, true);
    peer_guest_release(g);
    assert_int_equal(peer_guest_paused(g), 0);
    peer_guest_owner_pause(g, true);
    assert_int_equal(peer_guest_feed(g, -1, 12 * 60), 0);
    peer_guest_destroy(&g);
    /* Out of range settings are refused. */
    peer_guest_cfg bad = {.max_cpu = 101};
    assert_null(peer_guest_new(&bad, 1));
    bad = (peer_guest_cfg){.hours_from = 1440};
    assert_null(peer_guest_new(&bad, 1));
    assert_null(peer_guest_new(NULL, 1));
}

typedef struct {
    peer_guest_t *g;
    atomic_int done;
} yield_arg;

static void *yield_thread(void *arg)
{
    yield_arg *a = arg;
    peer_guest_yield(a->g);
    atomic_store(&a->done, 1);
    return NULL;
}

/* A paused compute thread waits in the yield hook and goes on when the pause ends. */
static void test_peer_guest_yield_waits_while_paused(void **state)
{
    (void)state;
    peer_guest_cfg c = {0};
    yield_arg a = {.g = peer_guest_new(&c, 1)};
    peer_guest_owner_pause(a.g, true);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, yield_thread, &a), 0);
    fu_sleep_ms(300);
    assert_int_equal(atomic_load(&a.done), 0);
    peer_guest_owner_pause(a.g, false);
    uint64_t end = fu_clock_ms() + 10000;
    while (!atomic_load(&a.done) && fu_clock_ms() < end)
        fu_sleep_ms(5);
    assert_int_equal(atomic_load(&a.done), 1);
    pthread_join(t, NULL);
    /* A release ends a pause too (the peer is leaving). */
    atomic_store(&a.done, 0);
    peer_guest_owner_pause(a.g, true);
    assert_int_equal(pthread_create(&t, NULL, yield_thread, &a), 0);
    fu_sleep_ms(100);
    peer_guest_release(a.g);
    pthread_join(t, NULL);
    assert_int_equal(atomic_load(&a.done), 1);
    peer_guest_destroy(&a.g);
}

static uint64_t cpu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* --max-cpu 25: a compute loop that calls the hook between pieces of work uses at most about a
 * quarter of its CPU. Competing load can only lower the share, so the bound holds on a busy machine. */
static void test_peer_guest_duty_cycle(void **state)
{
    (void)state;
    peer_guest_cfg c = {.max_cpu = 25};
    peer_guest_t *g = peer_guest_new(&c, 1);
    uint64_t w0 = fu_clock_ns(), c0 = cpu_now_ns();
    volatile double x = 0;
    while (fu_clock_ns() - w0 < 1500000000ull) {
        for (int i = 0; i < 20000; i++) /* about 20-50 us of work */
            x = x + 1e-9 * i;
        peer_guest_yield(g);
    }
    double share = (double)(cpu_now_ns() - c0) / (double)(fu_clock_ns() - w0);
    printf("--max-cpu 25: the loop used %.0f%% of one CPU over %.1f s\n", share * 100, (double)(fu_clock_ns() - w0) / 1e9);
    assert_true(share < 0.40);
    assert_true(share > 0.0);
    peer_guest_destroy(&g);
}

static void test_peer_guest_sample(void **state)
{
    (void)state;
    peer_guest_sample a, b;
    assert_int_equal(peer_guest_sample_read(&a), FU_OK);
    volatile double x = 0;
    uint64_t t0 = fu_clock_ms();
    while (fu_clock_ms() - t0 < 200) /* some ticks of our own */
        x = x + 1;
    fu_sleep_ms(100);
    assert_int_equal(peer_guest_sample_read(&b), FU_OK);
    assert_true(b.total > a.total);
    assert_true(b.own >= a.own);
    double others = peer_guest_others_percent(&a, &b);
    assert_true(others >= 0 && others <= 100);
    assert_true(peer_guest_others_percent(&b, &a) < 0); /* readings out of order: unknown */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peer_guest_hours_parse),
        cmocka_unit_test(test_peer_guest_in_hours),
        cmocka_unit_test(test_peer_guest_busy_hysteresis),
        cmocka_unit_test(test_peer_guest_hours_and_owner),
        cmocka_unit_test(test_peer_guest_yield_waits_while_paused),
        cmocka_unit_test(test_peer_guest_duty_cycle),
        cmocka_unit_test(test_peer_guest_sample),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
