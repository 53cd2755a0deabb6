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
        tu_sh_expect(0, "Usage:", "%s --help", tu_bin(progs[i]));
        tu_sh_expect(0, FUSION_TEST_VERSION, "%s --version", tu_bin(progs[i]));
    }
}

static void test_cli_help_lists_every_subcommand(void **state)
{
    (void)state;
    char *out = tu_fusion_expect_out(0, NULL, "--help");
    const char *subs[] = {"keygen", "model", "run", "submit", "status", "jobs", "wait", "result", "cancel", "peers"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        char want[32];
        snprintf(want, sizeof want, "\n  %s ", subs[i]);
        if (!strstr(out, want))
            fail_msg("`fusion --help` does not list '%s':\n%s", subs[i], out);
    }
    free(out);
}

static void test_cli_unknown_command_and_option_exit_2(void **state)
{
    (void)state;
    static const struct {
        const char *prog, *args;
        const char *says; /* NULL: anything */
    } cases[] = {
        {"fusion", "frobnicate", "unknown command 'frobnicate'"},
        {"fusion-broker", "--no-such-option", "unknown option '--no-such-option'"},
        {"fusion-peer", "--threads many", "needs an integer"},
        /* values checked before anything starts (the key files need not exist) */
        {"fusion-peer", "--broker tcp://127.0.0.1:9 --broker-key x --keys y --link-mbps -5",
         "--link-mbps must be"},
        {"fusion-peer", "--broker tcp://127.0.0.1:9 --broker-key x --keys y --cache-max-gb nan",
         "--cache-max-gb must be"},
        /* several endpoints: one key for all or one each, no empty item */
        {"fusion-peer", "--broker tcp://127.0.0.1:9,tcp://127.0.0.1:10 --broker-key x,y,z --keys y",
         "--broker names 2 endpoints and --broker-key 3 keys"},
        {"fusion-peer", "--broker tcp://127.0.0.1:9,,tcp://127.0.0.1:10 --broker-key x --keys y", "has an empty item"},
        /* wire codecs and the broker's micro-batch count, refused where they cannot act */
        {"fusion", "run finetune --model m --data d -o o --wire-codec int8", "give them with --cuts"},
        {"fusion", "run finetune --model m --data d -o o --wire-codec int8-ef --cuts 5", "--wire-codec must be"},
        {"fusion", "run finetune --model m --data d -o o --micro-batches 0", "leaves the count to a broker"},
        {"fusion", "run finetune --model m --data d -o o --cuts 5,x", "--cuts wants"},
        {"fusion", "submit eval --model m --data d --wire-codec int8-ef", "an eval sends no gradients"},
        {"fusion", "", NULL}, /* no command: usage, exit 2 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        tu_sh_expect(2, cases[i].says, "%s %s", tu_bin(cases[i].prog), cases[i].args);
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
