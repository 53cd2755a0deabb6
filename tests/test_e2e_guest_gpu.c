/* End to end on a GPU (label gpu): a CUDA peer is a good guest on its owner's GPU (docs/PEER.md "A
 * good guest", --pause-when-gpu-busy). The real broker and one fusion-peer on `--device cuda:0`:
 *   - the peer alone on the GPU is not paused (its own CUDA context is not another program's);
 *   - another program that runs GEMMs on the same GPU (tests/gpu_busy.c, a process of its own) pauses
 *     it within a few seconds: `fusion peers` shows it paused with the reason "gpu: 1 other process
 *     uses GPU 0";
 *   - once that program has exited, the peer resumes by itself (5 quiet looks).
 * Exits 77 (skipped) where this build has no CUDA backend, the machine no device, or no NVML
 * (libnvidia-ml.so.1). This process never touches CUDA itself: a context of its own would be
 * another program's GPU work too. */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "cluster.h"
#include "fu_clock.h"
#include "peer_gpuwatch.h"

#define GPU_BUSY_SECONDS "20" /* how long the other program runs */
/* gpu_busy is a helper, not under test: in the sanitizer build it runs CUDA under ASan (which needs
 * the shadow gap unprotected), and the driver's allocations must not turn its exit code into a leak
 * report. Harmless without ASan. */
#define GPU_BUSY_ENV "ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0"

/* Waits until `fusion peers` shows p0 in state want; fails the test otherwise. */
static void wait_state(const tu_cluster *c, const char *want, tu_peer_seen *ps, int timeout_ms)
{
    uint64_t end = fu_clock_ms() + (uint64_t)timeout_ms;
    memset(ps, 0, sizeof *ps);
    while (!(tu_peer_seen_get(c, 0, ps) && strcmp(ps->state, want) == 0)) {
        if (fu_clock_ms() > end) {
            tu_cluster_show_logs(c);
            fail_msg("p0 is %s (%s), not %s, after %d ms", ps->state, ps->pause_reason, want, timeout_ms);
        }
        fu_sleep_ms(200);
    }
}

static void test_e2e_guest_gpu_yields(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(1);
    o.model_args = NULL; /* no job: the pause shows on an idle peer */
    o.peer_extra[0] = "--device";
    o.peer_extra[1] = "cuda:0";
    o.peer_extra[2] = "--pause-when-gpu-busy";
    tu_cluster *c = tu_cluster_new("e2e-gpu-guest", &o);
    tu_cluster_start(c);
    char log[TU_PATH];
    tu_path(c, log, "p0.log");
    if (!tu_file_wait(log, "--pause-when-gpu-busy: watching", 10000)) {
        tu_file_show(log, 30);
        fail_msg("p0 does not watch its GPU (its log above says why)");
    }
    /* The peer alone: its own context does not pause it (looks every second, pause after 2). */
    fu_sleep_ms(4000);
    tu_peer_seen ps;
    assert_true(tu_peer_seen_get(c, 0, &ps));
    printf("p0 alone on GPU 0: %s %s\n", ps.state, ps.pause_reason);
    if (strcmp(ps.state, "idle") != 0) {
        tu_file_show(log, 30);
        fail_msg("p0 is %s (%s) with no other program on the GPU", ps.state, ps.pause_reason);
    }
    /* Another program's GEMMs on the same GPU. */
    char busy_log[TU_PATH];
    tu_path(c, busy_log, "gpu_busy.log");
    char *argv[] = {(char *)GPU_BUSY_EXE, (char *)GPU_BUSY_SECONDS, NULL};
    uint64_t t0 = fu_clock_ms();
    pid_t busy = tu_spawn(busy_log, argv, GPU_BUSY_ENV);
    if (!tu_file_wait(busy_log, "runs GEMMs", 30000)) {
        tu_file_show(busy_log, 20);
        fail_msg("gpu_busy did not start its GEMMs");
    }
    /* What NVML itself lists now (every GPU; this process holds no context): the peer and gpu_busy.
     * Fewer means NVML shows no processes here (some containers): the pause cannot work. */
    fu_errmsg em = {{0}};
    peer_gpuwatch_t *w = peer_gpuwatch_new(-1, 0, &em);
    if (!w)
        fail_msg("NVML was there for the peer but not for the test: %s", em.msg);
    int listed = 0, others = 0;
    assert_int_equal(peer_gpuwatch_sample(w, &listed, &others), FU_OK);
    printf("NVML lists %d processes on %s while gpu_busy runs\n", listed, peer_gpuwatch_describe(w));
    peer_gpuwatch_destroy(&w);
    if (listed < 2) {
        printf("NVML lists fewer than the peer and gpu_busy here (a pid namespace that hides them?): skipped\n");
        skip();
    }
    wait_state(c, "paused", &ps, 20000);
    printf("p0 paused %.1f s after gpu_busy started: %s\n", (double)(fu_clock_ms() - t0) / 1000.0, ps.pause_reason);
    assert_string_equal(ps.pause_reason, "gpu: 1 other process uses GPU 0");
    assert_true(tu_file_wait(log, "compute paused: gpu: 1 other process uses GPU 0", 5000));
    /* gpu_busy ends by itself; the peer resumes after 5 quiet looks. */
    assert_int_equal(tu_reap(busy, 60000), 0);
    tu_file_show(busy_log, 5);
    t0 = fu_clock_ms();
    wait_state(c, "idle", &ps, 30000);
    printf("p0 resumed %.1f s after gpu_busy exited\n", (double)(fu_clock_ms() - t0) / 1000.0);
    assert_true(tu_file_wait(log, "compute resumed", 5000));
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!nvml) {
        printf("no NVML (libnvidia-ml.so.1) here: skipped\n");
        return 77;
    }
    dlclose(nvml);
    int st = system(GPU_BUSY_ENV " '" GPU_BUSY_EXE "' 0"); /* a device gpu_busy can open (its own process) */
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        printf("gpu_busy cannot open CUDA device 0 here (status %d): skipped\n", st);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_guest_gpu_yields, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
