/* The progress lines of `fusion wait` and `fusion run finetune` on a real terminal (issue "Operate and
 * serve", CLI points): a three-peer fine-tune is followed, and a local one run, under script(1), which
 * gives `fusion` a pseudo-terminal of a chosen width. Every redraw must fit in the terminal less one
 * column (a line that wraps scrolls the screen at every redraw), show the step once, and, when there
 * is room, the loss, tokens/s, the time followed and the ETA; on a narrow terminal the line is cut,
 * never wrapped. An error that ends `wait` starts on a line of its own, not glued to the bar. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>

#include <cmocka.h>

#include "cluster.h"
#include "testutil.h"

/* The progress redraws (segments between \r and \n that begin with the bar) of what `fusion` drew on
 * a terminal of cols columns, for a job of `total` steps ("/100000"); each checked. Returns how many
 * there were; *full counts those that show loss, tokens/s, time followed and ETA. */
static int check_redraws(char *out, int cols, const char *total, int *full)
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
        const char *of = strstr(seg, total);
        assert_non_null(of);
        assert_null(strstr(of + 1, total)); /* the step once */
        if (strstr(seg, " loss ") && strstr(seg, " tok/s ") && strstr(seg, " ETA ") && strstr(seg, "0:0"))
            (*full)++;
    }
    return n;
}

/* The "stages:" line `wait` printed names each stage's layers without overlap: a stage that ends
 * inside layer K ("K.attn") is followed by one that starts at "K.mlp", one that ends with layer K
 * (whole, or its mlp) by one that starts at layer K + 1. */
static void check_stage_labels(const char *out)
{
    const char *p = strstr(out, "stages: ");
    assert_non_null(p);
    const char *end = p + strcspn(p, "\r\n");
    char prev[32] = "";
    int n = 0;
    for (const char *q = strstr(p, "(layer"); q && q < end; q = strstr(q + 1, "(layer"), n++) {
        char lab[64];
        size_t len = strcspn(q + 1, ")");
        snprintf(lab, sizeof lab, "%.*s", (int)len, q + 1);
        char *from = strchr(lab, ' ') + 1, *dash = strchr(from, '-');
        char *to = dash ? dash + 1 : from;
        if (dash)
            *dash = '\0';
        if (prev[0]) {
            char want[32];
            if (strstr(prev, ".attn"))
                snprintf(want, sizeof want, "%d.mlp", atoi(prev));
            else
                snprintf(want, sizeof want, "%d", atoi(prev) + 1);
            if (strncmp(from, want, strlen(want)) != 0 || (strstr(want, ".mlp") == NULL && strstr(from, ".mlp")))
                fail_msg("stage %d starts at '%s' after a stage that ends at '%s': '%.*s'", n, from, prev,
                         (int)(end - p), p);
        }
        snprintf(prev, sizeof prev, "%s", to);
    }
    assert_int_equal(n, 3);
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
        if (w == 0)
            check_stage_labels(out);
        int full = 0, n = check_redraws(out, widths[w], "/100000", &full);
        printf("terminal of %d columns: %d redraws, %d with loss, tok/s, time and ETA\n", widths[w], n, full);
        assert_true(n >= 2);
        if (widths[w] >= 100)
            assert_true(full >= 1);
        free(out);
    }
    /* The broker stops answering while `wait` draws: its error begins a line of its own. */
    char *out = tu_sh_expect_out(5, "no answer from the broker", "script -qfec \"stty cols 80 rows 24; "
                                 "FUSION_CONFIG='%s' '%s' wait %s --timeout-ms 2000 & p=\\$!; sleep 3; kill -STOP %d; wait \\$p\" "
                                 "/dev/null", conf, tu_bin("fusion"), id, (int)tu_broker_pid(c));
    assert_int_equal(kill(tu_broker_pid(c), SIGCONT), 0);
    const char *err = strstr(out, "no answer from the broker");
    const char *line = err;
    while (line > out && line[-1] != '\n')
        line--;
    if (memchr(line, '[', (size_t)(err - line)))
        fail_msg("the error is glued to the progress line: '%.*s'", (int)(err - line) + 30, line);
    assert_non_null(strstr(out, "/100000")); /* there was a bar before it */
    free(out);
    assert_int_equal(tu_fusion(c, NULL, "cancel %s", id), 0);

    /* `fusion run finetune`'s line, on a narrow terminal and a wide one */
    char model[TU_PATH];
    tu_path(c, model, "model");
    for (int w = 0; w < 2; w++) {
        out = tu_sh_expect_out(0, "wrote adapter", "script -qfec \"stty cols %d rows 24; '%s' run finetune --model "
                               "'%s' --data '%s' -o '%s/run-%d' --steps 40 --batch 2 --seq-len 16 --threads 1\" "
                               "/dev/null", widths[w], tu_bin("fusion"), model, tu_cluster_data(c),
                               tu_cluster_dir(c), w);
        int full = 0, n = check_redraws(out, widths[w], "/40", &full);
        printf("run finetune on a terminal of %d columns: %d redraws, %d with loss, tok/s, time and ETA\n",
               widths[w], n, full);
        assert_true(n >= 40);
        if (widths[w] >= 100)
            assert_true(full >= 1);
        free(out);
    }
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_cli_progress_line_fits_the_terminal, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
