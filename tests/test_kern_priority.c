/* kern_priority: a thread moved to idle (or low) priority reads it back, the threads it starts
 * inherit it, set_others moves the other threads and not the caller, names parse. */
#define _GNU_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmocka.h>

#include "fu_clock.h"
#include "kern_priority.h"

typedef struct {
    kern_priority want, got, read_back, child;
    fu_err rc;
} self_arg;

static void *child_main(void *arg)
{
    *(kern_priority *)arg = kern_priority_of(0);
    return NULL;
}

static void *self_main(void *arg)
{
    self_arg *a = arg;
    a->rc = kern_priority_set_self(a->want, &a->got);
    a->read_back = kern_priority_of(0);
    pthread_t t;
    if (pthread_create(&t, NULL, child_main, &a->child) == 0)
        pthread_join(t, NULL);
    return NULL;
}

static void test_kern_priority_self_and_children(void **state)
{
    (void)state;
    kern_priority wants[] = {KERN_PRIORITY_IDLE, KERN_PRIORITY_LOW};
    for (size_t i = 0; i < 2; i++) {
        self_arg a = {.want = wants[i], .child = KERN_PRIORITY_NORMAL};
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, self_main, &a), 0);
        pthread_join(t, NULL);
        assert_int_equal(a.rc, FU_OK);
        /* IDLE may fall back to LOW where SCHED_IDLE is refused; either way it is what the kernel says. */
        assert_true(a.got == a.want || (a.want == KERN_PRIORITY_IDLE && a.got == KERN_PRIORITY_LOW));
        assert_int_equal(a.read_back, a.got);
        assert_int_equal(a.child, a.got); /* inherited: OpenMP teams and helpers started later follow */
    }
    assert_int_equal(kern_priority_of(0), KERN_PRIORITY_NORMAL); /* the test's own thread is untouched */
}

typedef struct {
    atomic_int go;
    atomic_int tid;
    kern_priority seen;
} other_arg;

static void *other_main(void *arg)
{
    other_arg *a = arg;
    atomic_store(&a->tid, (int)syscall(SYS_gettid));
    while (!atomic_load(&a->go))
        fu_sleep_ms(1);
    a->seen = kern_priority_of(0);
    return NULL;
}

static void test_kern_priority_others(void **state)
{
    (void)state;
    other_arg a = {0};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, other_main, &a), 0);
    while (!atomic_load(&a.tid))
        fu_sleep_ms(1);
    kern_priority got;
    assert_int_equal(kern_priority_set_others(KERN_PRIORITY_IDLE, &got), FU_OK);
    assert_true(got == KERN_PRIORITY_IDLE || got == KERN_PRIORITY_LOW);
    assert_int_equal(kern_priority_of(atomic_load(&a.tid)), got);
    atomic_store(&a.go, 1);
    pthread_join(t, NULL);
    assert_int_equal(a.seen, got);
    assert_int_equal(kern_priority_of(0), KERN_PRIORITY_NORMAL); /* not the caller */
    assert_int_equal(kern_priority_set_others(KERN_PRIORITY_NORMAL, &got), FU_OK); /* NORMAL: nothing to do */
    assert_int_equal(got, KERN_PRIORITY_NORMAL);
}

static void test_kern_priority_names(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        kern_priority p;
    } names[] = {{"idle", KERN_PRIORITY_IDLE}, {"low", KERN_PRIORITY_LOW}, {"normal", KERN_PRIORITY_NORMAL}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        kern_priority p;
        if (kern_priority_parse(names[i].name, &p) != FU_OK || p != names[i].p)
            fail_msg("'%s' does not parse to %d", names[i].name, (int)names[i].p);
        assert_string_equal(kern_priority_name(names[i].p), names[i].name);
    }
    const char *bad[] = {"IDLE", "", NULL};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kern_priority p;
        if (kern_priority_parse(bad[i], &p) != FU_EINVAL)
            fail_msg("'%s' is not refused", bad[i] ? bad[i] : "(null)");
    }
    assert_string_equal(kern_priority_name((kern_priority)9), "?");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kern_priority_self_and_children),
        cmocka_unit_test(test_kern_priority_others),
        cmocka_unit_test(test_kern_priority_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
