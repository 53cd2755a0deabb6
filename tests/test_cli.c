/* The three programs as a user runs them: --help, --version, unknown commands, missing capabilities. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "testutil.h"

static void test_cli_every_program_answers_help(void **state)
{
    (void)state;
    const char *progs[] = {"fusion", "fusion-broker", "fusion-peer"};
    for (size_t i = 0; i < 3; i++) {
        char *out = NULL;
        assert_int_equal(tu_sh(&out, "%s --help", tu_bin(progs[i])), 0);
        assert_non_null(strstr(out, "Usage:"));
        free(out);
        assert_int_equal(tu_sh(&out, "%s --version", tu_bin(progs[i])), 0);
        assert_non_null(strstr(out, FUSION_TEST_VERSION));
        free(out);
    }
}

static void test_cli_help_lists_every_subcommand(void **state)
{
    (void)state;
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "%s --help", tu_bin("fusion")), 0);
    const char *subs[] = {"keygen", "model", "run", "submit", "status", "jobs", "wait", "result", "cancel", "peers"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        char want[32];
        snprintf(want, sizeof want, "\n  %s ", subs[i]);
        assert_non_null(strstr(out, want));
    }
    free(out);
}

static void test_cli_unknown_command_and_option_exit_2(void **state)
{
    (void)state;
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "%s frobnicate", tu_bin("fusion")), 2);
    assert_non_null(strstr(out, "unknown command 'frobnicate'"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s --no-such-option", tu_bin("fusion-broker")), 2);
    assert_non_null(strstr(out, "unknown option '--no-such-option'"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s --threads many", tu_bin("fusion-peer")), 2);
    assert_non_null(strstr(out, "needs an integer"));
    free(out);
    /* values checked before anything starts (the key files need not exist) */
    assert_int_equal(tu_sh(&out, "%s --broker tcp://127.0.0.1:9 --broker-key x --keys y --link-mbps -5",
                           tu_bin("fusion-peer")), 2);
    assert_non_null(strstr(out, "--link-mbps must be"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s --broker tcp://127.0.0.1:9 --broker-key x --keys y --cache-max-gb nan",
                           tu_bin("fusion-peer")), 2);
    assert_non_null(strstr(out, "--cache-max-gb must be"));
    free(out);
    assert_int_equal(tu_sh(&out, "%s", tu_bin("fusion")), 2); /* no command: usage, exit 2 */
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cli_every_program_answers_help),
        cmocka_unit_test(test_cli_help_lists_every_subcommand),
        cmocka_unit_test(test_cli_unknown_command_and_option_exit_2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
