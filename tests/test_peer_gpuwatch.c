/* peer_gpuwatch against a stand-in NVML (tests/fake_nvml.c, loaded as libnvidia-ml.so.1 through
 * LD_LIBRARY_PATH; this program re-executes itself with it set): the GPU found by NVML's index where
 * the CUDA driver's bus id is not known, the processes that count as other programs' GPU work (this
 * process and another of the same name do not; a busy graphics process does, an idle one not),
 * another pid namespace, a list too long to read, NVML that cannot start; and the guest pausing
 * and resuming on what the watcher sees. No GPU or driver needed. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "peer_gpuwatch.h"
#include "peer_guest.h"

static char g_procs[256];  /* the stand-in's process list ($FAKE_NVML_PROCS) */
static pid_t g_other;      /* a `sleep` process: another program */
static pid_t g_twin;       /* a child of this program: the same name, as another fusion-peer's slot */

static void procs(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void procs(const char *fmt, ...)
{
    FILE *f = fopen(g_procs, "w");
    assert_non_null(f);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fclose(f);
}

static void look(peer_gpuwatch_t *w, int want_listed, int want_others)
{
    int listed = -1, others = -1;
    assert_int_equal(peer_gpuwatch_sample(w, &listed, &others), FU_OK);
    assert_int_equal(listed, want_listed);
    assert_int_equal(others, want_others);
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_procs, sizeof g_procs, "%s/fu-fake-nvml-%d", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    setenv("FAKE_NVML_PROCS", g_procs, 1);
    if ((g_other = fork()) == 0) {
        execlp("sleep", "sleep", "60", (char *)NULL);
        _exit(127);
    }
    if ((g_twin = fork()) == 0) {
        pause();
        _exit(0);
    }
    usleep(200000); /* sleep's exec done: its comm is "sleep" */
    return g_other > 0 && g_twin > 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    pid_t kids[2] = {g_other, g_twin};
    for (int i = 0; i < 2; i++)
        if (kids[i] > 0) {
            kill(kids[i], SIGKILL);
            waitpid(kids[i], NULL, 0);
        }
    unlink(g_procs);
    return 0;
}

static void test_peer_gpuwatch_counts(void **state)
{
    (void)state;
    unsigned self = (unsigned)getpid();
    fu_errmsg em = {{0}};
    peer_gpuwatch_t *w = peer_gpuwatch_new(0, 1, &em);
    if (!w)
        fail_msg("no watcher with the stand-in NVML: %s", em.msg);
    assert_string_equal(peer_gpuwatch_describe(w), "GPU 0 (NVML index 0)");
    procs("c %u\n", self);
    look(w, 1, 0); /* the peer alone */
    procs("c %u\nc %d\n", self, (int)g_other);
    look(w, 2, 1);
    procs("c %u\nc %d\nc %d\n", self, (int)g_other, (int)g_twin);
    look(w, 3, 1); /* the twin is another fusion-peer */
    procs("c %u\ng %d 0\n", self, (int)g_other);
    look(w, 2, 0); /* a graphics process at rest: a desktop's compositor */
    procs("c %u\ng %d 55\n", self, (int)g_other);
    look(w, 2, 1); /* ... busy: a game */
    procs("c %u\ng %d 55\nc %d\n", self, (int)g_other, (int)g_other);
    look(w, 2, 1); /* in both lists: one process */
    procs("g %u 90\n", self);
    look(w, 1, 0);
    /* Another pid namespace: our pid is not listed; one of those listed is ours. */
    procs("c 99999991\n");
    look(w, 1, 0);
    procs("c 99999991\nc 99999992\ng 99999993 80\n");
    look(w, 3, 2);
    /* More processes than a look reads: surely some other program's. */
    FILE *f = fopen(g_procs, "w");
    for (unsigned i = 0; i < PEER_GPUWATCH_MAX_PROCS + 10; i++)
        fprintf(f, "c %u\n", 1000 + i);
    fclose(f);
    int listed = 0, others = 0;
    assert_int_equal(peer_gpuwatch_sample(w, &listed, &others), FU_OK);
    assert_true(others > 0);
    peer_gpuwatch_destroy(&w);
    assert_null(w);
    peer_gpuwatch_destroy(&w);
    /* Every GPU (a CPU peer): one here; no context of its own, so its pid is not looked for. */
    w = peer_gpuwatch_new(-1, 0, &em);
    assert_non_null(w);
    assert_string_equal(peer_gpuwatch_describe(w), "1 GPU");
    procs("c %d\nc %d\n", (int)g_other, (int)g_twin);
    look(w, 2, 1);
    peer_gpuwatch_destroy(&w);
    /* No such GPU; NVML that cannot start. */
    em.msg[0] = '\0';
    assert_null(peer_gpuwatch_new(5, 1, &em));
    assert_non_null(strstr(em.msg, "GPU 5"));
    setenv("FAKE_NVML_INIT_FAILS", "1", 1);
    assert_null(peer_gpuwatch_new(0, 1, &em));
    assert_non_null(strstr(em.msg, "Driver Not Loaded"));
    unsetenv("FAKE_NVML_INIT_FAILS");
}

/* The guest's tick looks at the GPU each second: a pause after 2 looks with another program, the
 * reason in the text, a resume after 5 looks without. */
static void test_peer_gpuwatch_guest_pauses(void **state)
{
    (void)state;
    peer_guest_cfg c = {.pause_when_gpu_busy = true, .gpu = 0, .gpu_own = 1};
    peer_guest_t *g = peer_guest_new(&c, 1);
    assert_non_null(g);
    assert_true(peer_guest_gpu_watched(g));
    uint64_t now = 1000;
    procs("c %u\nc %d\n", (unsigned)getpid(), (int)g_other);
    assert_int_equal(peer_guest_tick(g, now), 0);
    assert_int_equal(peer_guest_tick(g, now + 500), 0); /* between looks: nothing new */
    now += PEER_GUEST_SAMPLE_MS;
    assert_int_equal(peer_guest_tick(g, now), PEER_PAUSE_GPU);
    char text[200];
    peer_guest_describe(g, peer_guest_paused(g), text, sizeof text);
    assert_string_equal(text, "gpu: 1 other process uses GPU 0");
    procs("c %u\n", (unsigned)getpid());
    for (int i = 1; i < PEER_GUEST_BUSY_OFF; i++) {
        now += PEER_GUEST_SAMPLE_MS;
        assert_int_equal(peer_guest_tick(g, now), PEER_PAUSE_GPU);
    }
    now += PEER_GUEST_SAMPLE_MS;
    assert_int_equal(peer_guest_tick(g, now), 0);
    peer_guest_destroy(&g);
}

int main(int argc, char **argv)
{
    (void)argc;
    if (!getenv("FU_FAKE_NVML")) { /* dlopen reads LD_LIBRARY_PATH at start only: run again with it */
        setenv("LD_LIBRARY_PATH", FAKE_NVML_DIR, 1);
        setenv("FU_FAKE_NVML", "1", 1);
        execv("/proc/self/exe", argv);
        perror("test_peer_gpuwatch: cannot run itself again");
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peer_gpuwatch_counts),
        cmocka_unit_test(test_peer_gpuwatch_guest_pauses),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
