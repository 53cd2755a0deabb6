/* peer_guest: the daily window, the busy hysteresis, the owner's pause, a paused compute thread that
 * waits and resumes, and the duty cycle's CPU share; the GPU's pause (its hysteresis and text, the
 * rule that tells other programs' processes from the peer's, and a machine without NVML). */
#include <dlfcn.h>
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
#include "peer_gpuwatch.h"
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

/* --pause-when-gpu-busy: other programs' processes on the GPU pause compute after PEER_GUEST_BUSY_ON
 * looks and resume it after PEER_GUEST_BUSY_OFF looks without; the reason names them and the GPU. */
static void test_peer_guest_gpu_hysteresis(void **state)
{
    (void)state;
    peer_guest_cfg c = {.pause_when_gpu_busy = true, .gpu = 0, .gpu_own = 1};
    peer_guest_t *g = peer_guest_new(&c, 1);
    assert_non_null(g);
    assert_int_equal(peer_guest_feed_gpu(g, 2), 0); /* one look is not enough */
    assert_int_equal(peer_guest_feed_gpu(g, 0), 0); /* ... and the run starts again */
    for (int i = 1; i < PEER_GUEST_BUSY_ON; i++)
        assert_int_equal(peer_guest_feed_gpu(g, 2), 0);
    assert_int_equal(peer_guest_feed_gpu(g, 2), PEER_PAUSE_GPU);
    assert_int_equal(peer_guest_paused(g), PEER_PAUSE_GPU);
    char text[200];
    peer_guest_describe(g, peer_guest_paused(g), text, sizeof text);
    assert_string_equal(text, "gpu: 2 other processes use GPU 0");
    assert_int_equal(peer_guest_feed_gpu(g, -1), PEER_PAUSE_GPU); /* a failed look changes nothing */
    assert_int_equal(peer_guest_feed(g, 10, -1), PEER_PAUSE_GPU);  /* nor does the CPU (not watched) */
    for (int i = 1; i < PEER_GUEST_BUSY_OFF; i++)
        assert_int_equal(peer_guest_feed_gpu(g, 0), PEER_PAUSE_GPU);
    assert_int_equal(peer_guest_feed_gpu(g, 0), 0);
    /* With the owner's pause, one process, and the CPU busy too: every reason, in order. */
    c.pause_when_busy = true;
    c.busy_percent = 50;
    peer_guest_destroy(&g);
    g = peer_guest_new(&c, 1);
    for (int i = 0; i < PEER_GUEST_BUSY_ON; i++) {
        (void)peer_guest_feed_gpu(g, 1);
        (void)peer_guest_feed(g, 90, -1);
    }
    peer_guest_owner_pause(g, true);
    assert_int_equal(peer_guest_paused(g), PEER_PAUSE_GPU | PEER_PAUSE_BUSY | PEER_PAUSE_OWNER);
    peer_guest_describe(g, peer_guest_paused(g), text, sizeof text);
    assert_string_equal(text, "busy: other processes use 90% of the CPU (over 50%); gpu: 1 other process uses "
                              "GPU 0; paused by its owner");
    peer_guest_describe(g, PEER_PAUSE_GPU, text, 12); /* cut short, still a string */
    assert_string_equal(text, "gpu: 1 othe");
    /* Leaving: the GPU pauses no more. */
    peer_guest_release(g);
    assert_int_equal(peer_guest_feed_gpu(g, 3), 0);
    assert_int_equal(peer_guest_feed_gpu(g, 3), 0);
    peer_guest_destroy(&g);
    /* Without --pause-when-gpu-busy the GPU never pauses; a CPU peer's text names no GPU number. */
    peer_guest_cfg off = {.gpu = -1};
    g = peer_guest_new(&off, 1);
    for (int i = 0; i < 10; i++)
        assert_int_equal(peer_guest_feed_gpu(g, 4), 0);
    assert_false(peer_guest_gpu_watched(g));
    peer_guest_describe(g, PEER_PAUSE_GPU, text, sizeof text);
    assert_string_equal(text, "gpu: 0 other processes use the GPU");
    peer_guest_destroy(&g);
    peer_guest_cfg bad = {.gpu = -2};
    assert_null(peer_guest_new(&bad, 1));
    bad = (peer_guest_cfg){.gpu_own = -1};
    assert_null(peer_guest_new(&bad, 1));
}

/* Which processes on the GPU are other programs': not this process, not another fusion-peer; and in
 * another pid namespace (this pid not listed while the peer holds a context), all but `own`. */
static void test_peer_guest_gpu_count_others(void **state)
{
    (void)state;
    const unsigned self = 4242;
    peer_gpuwatch_proc same[] = {{self, false}, {1234, false}, {999, true}, {77, false}};
    assert_int_equal(peer_gpuwatch_count_others(same, 4, self, 1), 2);
    assert_int_equal(peer_gpuwatch_count_others(same, 1, self, 1), 0);  /* the peer alone */
    assert_int_equal(peer_gpuwatch_count_others(same, 3, self, 3), 1);  /* slots: the other fusion-peer */
    assert_int_equal(peer_gpuwatch_count_others(NULL, 0, self, 1), 0);
    peer_gpuwatch_proc host[] = {{90001, false}, {90002, true}, {90003, false}};
    assert_int_equal(peer_gpuwatch_count_others(host, 1, self, 1), 0); /* ours, by its host pid */
    assert_int_equal(peer_gpuwatch_count_others(host, 3, self, 1), 2); /* flags not trusted there */
    assert_int_equal(peer_gpuwatch_count_others(host, 3, self, 2), 1);
    assert_int_equal(peer_gpuwatch_count_others(host, 1, self, 4), 0);
    /* A CPU peer (own 0) holds no context: it cannot tell namespaces apart and goes by the flags. */
    assert_int_equal(peer_gpuwatch_count_others(host, 3, self, 0), 2);
}

/* A machine without the NVIDIA driver (this one, in CI): the watcher says why, the guest logs it and
 * carries on, and the GPU never pauses compute however often it ticks. */
static void test_peer_guest_gpu_without_nvml(void **state)
{
    (void)state;
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (nvml) {
        dlclose(nvml);
        printf("NVML is installed here: the case without it is not tested\n");
        skip();
    }
    fu_errmsg em = {{0}};
    assert_null(peer_gpuwatch_new(0, 1, &em));
    assert_non_null(strstr(em.msg, "libnvidia-ml.so.1"));
    printf("without NVML: %s\n", em.msg);
    assert_null(peer_gpuwatch_new(-1, 0, NULL));
    int listed = 7, others = 7;
    assert_int_equal(peer_gpuwatch_sample(NULL, &listed, &others), FU_EINVAL);
    assert_int_equal(listed, 0);
    assert_int_equal(others, 0);
    assert_string_equal(peer_gpuwatch_describe(NULL), "no GPU");
    peer_guest_destroy(NULL);
    for (int gpu = -1; gpu <= 0; gpu++) {
        peer_guest_cfg c = {.pause_when_gpu_busy = true, .gpu = gpu, .gpu_own = gpu >= 0};
        peer_guest_t *g = peer_guest_new(&c, 1);
        assert_non_null(g);
        assert_false(peer_guest_gpu_watched(g));
        for (uint64_t now = 1000; now <= 20000; now += PEER_GUEST_SAMPLE_MS)
            assert_int_equal(peer_guest_tick(g, now), 0);
        peer_guest_destroy(&g);
        assert_null(g);
    }
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
        cmocka_unit_test(test_peer_guest_gpu_hysteresis),
        cmocka_unit_test(test_peer_guest_gpu_count_others),
        cmocka_unit_test(test_peer_guest_gpu_without_nvml),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
