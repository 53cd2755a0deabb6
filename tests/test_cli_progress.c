/* `fusion wait`'s progress line on a real terminal (issue "Operate and serve", CLI points): a
 * three-peer fine-tune is followed under script(1), which gives `fusion` a pseudo-terminal of a chosen
 * width. Every redraw must fit in the terminal less one column (a line that wraps scrolls the screen
 * at every redraw), show the step once, and, when there is room, the loss, tokens/s, the time
 * followed and the ETA; on a narrow terminal the line is cut, never wrapped. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cluster.h"
#include "testutil.h"

/* The progress redraws (segments between \r and \n that begin with the bar) of what `fusion wait`
 * drew on a terminal of cols columns; each checked. Returns how many there were; *full counts those
 * that show loss, tokens/s, time followed and ETA. */
static int check_redraws(char *out, int cols, int *full)
{
    int n = 0;
    *full = 0;
    for (char *seg = strtok(out, "\r\n"); seg; seg = strtok(NULL, "\r\n")) {
        char *k;
        while ((k = strstr(seg, "\033[K")) != NULL) /* erase to the end of the line: no width */
            memmove(k, k + 3, strlen(k + 3) + 1);
        if (seg[0] != '[' || !strchr(seg, ']'))
            continue;
        n++;
        if ((int)strlen(seg) > cols - 1)
            fail_msg("a progress line of %zu columns on a terminal of %d: '%s'", strlen(seg), cols, seg);
        const char *of = strstr(seg, "/100000");
        assert_non_null(of);
        assert_null(strstr(of + 1, "/100000")); /* the step once */
        if (strstr(seg, " loss ") && strstr(seg, " tok/s ") && strstr(seg, " ETA ") && strstr(seg, "0:0"))
            (*full)++;
    }
    return n;
}

static void test_cli_progress_line_fits_the_terminal(void **state)
{
    (void)state;
    if (tu_sh(NULL, "command -v script") != 0)
        fail_msg("script(1) (util-linux) is not installed");
    tu_opts o = tu_opts_default(3);
    tu_cluster *c = tu_cluster_new("cli-progress", &o);
    tu_cluster_start(c);
    char id[TU_ID_LEN], conf[TU_PATH];
    tu_path(c, conf, "client.conf");
    tu_submit_finetune(c, id, "model", "%s --steps 100000 --checkpoint-every 1000", TU_TRAIN_ARGS);
    (void)tu_wait_step(c, id, 2, 90000);
    const int widths[2] = {44, 160};
    for (int w = 0; w < 2; w++) {
        /* exit 5: --wait-timeout passed with the job still running */
        char *out = tu_sh_expect_out(5, NULL, "script -qfec \"stty cols %d rows 24; FUSION_CONFIG='%s' '%s' wait %s "
                                     "--wait-timeout 5\" /dev/null", widths[w], conf, tu_bin("fusion"), id);
        int full = 0, n = check_redraws(out, widths[w], &full);
        printf("terminal of %d columns: %d redraws, %d with loss, tok/s, time and ETA\n", widths[w], n, full);
        assert_true(n >= 2);
        if (widths[w] >= 100)
            assert_true(full >= 1);
        free(out);
    }
    assert_int_equal(tu_fusion(c, NULL, "cancel %s", id), 0);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_cli_progress_line_fits_the_terminal, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
