/* `fusion submit|status|jobs|wait|cancel|peers|result` as a user runs them, against a real
 * fusion-broker process with a real SQLite store: where the broker and keys come from, exit codes,
 * idempotent submission, ownership, refused keys. No peers join, so jobs stay queued: the full
 * pipeline is the end-to-end tests' business. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cluster.h"
#include "fu_clock.h"
#include "testutil.h"

static tu_cluster *g_c;
static char g_model[TU_PATH];
static char g_env[3][8600]; /* FUSION_BROKER=… for the first client, the second, the stranger */

static int setup(void **state)
{
    (void)state;
    tu_opts o = tu_opts_broker_alone();
    g_c = tu_cluster_new("client", &o);
    const char *names[3] = {"alice", "bob", "mallory"};
    for (int i = 0; i < 3; i++)
        tu_keygen(g_c, names[i], i < 2); /* mallory is not on the allow-list */
    tu_path(g_c, g_model, "model");
    tu_broker_start(g_c);
    const char *dir = tu_cluster_dir(g_c);
    for (int i = 0; i < 3; i++)
        snprintf(g_env[i], sizeof g_env[i],
                 "FUSION_CONFIG=/nonexistent FUSION_BROKER=%s FUSION_BROKER_KEY=%s/broker/public.key "
                 "FUSION_KEYS=%s/%s", tu_broker_endpoint(g_c), dir, dir, names[i]);
    char *out = NULL;
    for (int i = 0; i < 100; i++) { /* until it answers */
        if (tu_sh(&out, "%s %s peers", g_env[0], tu_bin("fusion")) == 0)
            break;
        free(out);
        out = NULL;
        fu_sleep_ms(100);
    }
    free(out);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return tu_cluster_stop(&g_c) == FU_OK ? 0 : -1;
}

/* Runs `fusion ARGS` (fmt: a string literal) as client `who` (0 alice, 1 bob, 2 mallory): it must exit
 * want_rc and print want_text (NULL: anything). run_as_out returns what it printed (caller frees). */
#define run_as_out(who, want_rc, want_text, fmt, ...)                                                        \
    tu_sh_expect_out(want_rc, want_text, "%s %s " fmt, g_env[who], tu_bin("fusion"), ##__VA_ARGS__)
#define run_as(who, want_rc, want_text, fmt, ...)                                                            \
    free(run_as_out(who, want_rc, want_text, fmt, ##__VA_ARGS__))

/* Submits a small fine-tune as `who` with idempotency key idem (it must be accepted); the job id
 * printed, in id. */
static void submit(int who, const char *idem, char id[17])
{
    char *out = run_as_out(who, 0, NULL,
                           "submit finetune --model %s --data %s --steps 3 --batch 2 --seq-len 16 "
                           "--idempotency-key %s",
                           g_model, tu_cluster_data(g_c), idem);
    snprintf(id, 17, "%.16s", out);
    free(out);
}

static void test_client_connection_settings_come_from_options_env_or_config(void **state)
{
    (void)state;
    /* Nothing said: exit 2 and what to do. */
    tu_sh_expect(2, "no broker given: use --broker",
                 "env -u FUSION_BROKER FUSION_CONFIG=/nonexistent %s jobs", tu_bin("fusion"));
    /* A config file alone is enough. */
    char conf[TU_PATH];
    tu_path(g_c, conf, "alice.conf");
    FILE *f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "# test\nbroker = %s\nbroker-key=%s/broker/public.key\n  keys =  %s/alice  \n",
            tu_broker_endpoint(g_c), tu_cluster_dir(g_c), tu_cluster_dir(g_c));
    fclose(f);
    char *out = tu_sh_expect_out(0, NULL, "FUSION_CONFIG=%s %s peers --json", conf, tu_bin("fusion"));
    assert_true(out[0] == '[');
    free(out);
    /* Options win over the environment: a wrong --broker-key is used, and refused. */
    run_as(0, 2, "/nonexistent/public.key", "peers --broker-key /nonexistent/public.key");
}

static void test_client_unknown_key_is_refused_with_exit_3(void **state)
{
    (void)state;
    run_as(2, 3, "refused this client's key", "jobs --timeout-ms 5000");
}

static void test_client_submit_is_idempotent_and_jobs_are_private(void **state)
{
    (void)state;
    char a[17] = "", a2[17] = "", b[17] = "";
    submit(0, "key-one", a);
    submit(0, "key-one", a2);
    assert_string_equal(a, a2); /* the retry is the same job */
    submit(1, "key-one", b);
    assert_string_not_equal(a, b); /* same key, other owner: another job */

    run_as(0, 0, "\"state\":\"queued\"", "status %s --json", a);
    /* Bob can neither see nor cancel Alice's job: it does not exist for him. */
    run_as(1, 4, NULL, "status %s", a);
    run_as(1, 4, NULL, "cancel %s", a);
    char *out = run_as_out(1, 0, b, "jobs --json");
    assert_null(strstr(out, a));
    free(out);
    /* Alice cancels hers; it is listed as cancelled, and has no result. */
    run_as(0, 0, "cancelled", "cancel %s", a);
    out = run_as_out(0, 0, a, "jobs");
    assert_non_null(strstr(out, "cancelled"));
    free(out);
    out = run_as_out(0, 0, a, "status --json"); /* no JOB: all of Alice's jobs */
    assert_null(strstr(out, b));
    free(out);
    out = run_as_out(0, 0, NULL, "jobs --active --json");
    assert_null(strstr(out, a));
    free(out);
    run_as(0, 1, "a result exists only once it is done", "result %s -o %s/res", a, tu_cluster_dir(g_c));
}

static void test_client_wait_reports_why_a_job_is_queued_and_times_out(void **state)
{
    (void)state;
    char id[17] = "";
    submit(1, "waiting", id);
    char *out = run_as_out(1, 5, "queued: ", "wait %s --wait-timeout 1", id);
    assert_non_null(strstr(out, "still queued after 1 s"));
    free(out);
}

static void test_client_bad_arguments_exit_2(void **state)
{
    (void)state;
    static const tu_cmd_case cases[] = {
        {"status not-a-job", 2, "is not a job id"},
        {"submit finetune --model x", 2, "needs --model DIR and --data FILE"},
        {"submit finetune --model x --data /nonexistent/data.txt", 2, NULL},
        {"submit infer --model x --prompt hi --prompt-tokens 1,2", 2, NULL},
        {"submit finetune --model x --data /dev/null --verify 1.5", 2,
         "--verify must be a number between 0 and 1"},
        {"submit frobnicate", 2, NULL},
        {"status 0123456789abcdef", 4, NULL}, /* well-formed, unknown */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_as(0, cases[i].rc, cases[i].says, "%s", cases[i].args);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_client_connection_settings_come_from_options_env_or_config),
        cmocka_unit_test(test_client_unknown_key_is_refused_with_exit_3),
        cmocka_unit_test(test_client_submit_is_idempotent_and_jobs_are_private),
        cmocka_unit_test(test_client_wait_reports_why_a_job_is_queued_and_times_out),
        cmocka_unit_test(test_client_bad_arguments_exit_2),
    };
    return tu_run_tests(argc, argv, tests, setup, teardown);
}
