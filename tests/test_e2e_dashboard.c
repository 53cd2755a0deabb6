/* The broker's dashboard (GET / on fusion-broker --http; broker/dashboard.html) in a real browser:
 * headless Chromium loads it against a running three-peer fine-tune, with the client's token in the
 * URL (`fusion http-token`), and the page's own JavaScript fills the DOM from the JSON API:
 *   - every peer, in its state (the three holding a stage as "stage");
 *   - the running job, its three stages laid over their peers, its step and tokens/s, its events;
 *   - its loss curve from step 1 on, though the page was loaded after several steps: the broker's
 *     history (GET /api/jobs/JOB/loss) holds the steps the page did not see;
 *   - the page loads nothing from elsewhere (its Content-Security-Policy says so, and it has no
 *     external URL).
 * A screenshot is saved as dashboard-screenshot.png in the test's working directory (the build's
 * tests/). Needs Debian's chromium (deploy/install-deps.sh). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "cluster.h"
#include "testutil.h"

#define CHROMIUM "chromium --headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage " \
                 "--virtual-time-budget=6000 --window-size=1280,1000"

static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static void test_e2e_dashboard_shows_a_running_job(void **state)
{
    (void)state;
    if (tu_sh(NULL, "command -v chromium") != 0)
        fail_msg("chromium is not installed: run ./deploy/install-deps.sh");
    tu_opts o = tu_opts_default(3);
    tu_cluster *c = tu_cluster_new("e2e-dashboard", &o);
    tu_broker_args(c, "--http 127.0.0.1:0");
    tu_cluster_start(c);
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --steps 100000 --checkpoint-every 1000", TU_TRAIN_ARGS);
    long before = tu_wait_step(c, id, 5, 120000); /* steps done before the page is loaded */
    int port = tu_metrics_port(c);
    const char *dir = tu_cluster_dir(c);
    char *tok = tu_sh_expect_out(0, NULL, "FUSION_CONFIG= %s http-token --broker-key %s/broker/public.key --keys %s/client",
                                 tu_bin("fusion"), dir, dir);
    tok[strcspn(tok, "\n")] = '\0';
    char url[512];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/#token=%s", port, tok);
    free(tok);

    char *dom = tu_sh_expect_out(0, "data-ready=\"1\"", "timeout 120 " CHROMIUM " --dump-dom '%s' 2>/dev/null", url);
    printf("the dashboard's DOM: %zu bytes, %d peer rows, %d stage boxes\n", strlen(dom),
           count_of(dom, "data-peer=\""), count_of(dom, "data-stage=\""));
    for (int i = 0; i < 3; i++) {
        char want[32];
        snprintf(want, sizeof want, "data-peer=\"p%d\"", i);
        if (!strstr(dom, want))
            fail_msg("no row for peer p%d in the dashboard:\n%s", i, dom);
    }
    assert_int_equal(count_of(dom, "<td class=\"state-stage\">stage</td>"), 3);
    char job[48];
    snprintf(job, sizeof job, "id=\"job-%s\"", id);
    assert_non_null(strstr(dom, job));
    assert_non_null(strstr(dom, "class=\"state-running\">running"));
    for (int s = 0; s < 3; s++) {
        char want[32];
        snprintf(want, sizeof want, "data-stage=\"%d\"", s);
        assert_non_null(strstr(dom, want));
    }
    assert_non_null(strstr(dom, "tok/s"));
    assert_non_null(strstr(dom, "verified 25%")); /* the broker's default verification, shown */
    assert_non_null(strstr(dom, "submitted")); /* the event log */
    /* the loss curve: the broker's history from step 1, at least the steps done before the load */
    const char *curve = strstr(dom, "class=\"loss\" data-points=\"");
    if (!curve)
        fail_msg("no loss curve in the dashboard:\n%s", dom);
    long points = strtol(curve + strlen("class=\"loss\" data-points=\""), NULL, 10);
    printf("the loss curve: %ld points, %ld steps done before the page was loaded\n", points, before);
    assert_true(points >= before);
    assert_non_null(strstr(curve, "data-first-step=\"1\""));
    assert_non_null(strstr(curve, "<polyline points=\""));
    assert_null(strstr(dom, "src=\"http")); /* nothing from elsewhere */
    free(dom);
    char *csp = tu_sh_expect_out(0, "Content-Security-Policy: default-src 'none'",
                                 "curl -sI http://127.0.0.1:%d/", port);
    free(csp);

    remove("dashboard-screenshot.png");
    tu_sh_expect(0, NULL, "timeout 120 " CHROMIUM " --screenshot=$PWD/dashboard-screenshot.png '%s' >/dev/null 2>&1",
                 url);
    struct stat st;
    assert_int_equal(stat("dashboard-screenshot.png", &st), 0);
    printf("screenshot: dashboard-screenshot.png, %lld bytes\n", (long long)st.st_size);
    assert_true(st.st_size > 10000);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "cancel %s", id), 0);
    free(out);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_dashboard_shows_a_running_job, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
