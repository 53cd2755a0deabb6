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

/* Runs `fusion ARGS` as client `who` (0 alice, 1 bob, 2 mallory); returns the exit code. */
static int as(int who, char **out, const char *fmt, ...)
{
    char args[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    return tu_sh(out, "%s %s %s", g_env[who], tu_bin("fusion"), args);
}

/* Submits a small fine-tune as `who` with idempotency key idem; the job id printed, in id. */
static int submit(int who, const char *idem, char id[17])
{
    char *out = NULL;
    int rc = as(who, &out, "submit finetune --model %s --data %s --steps 3 --batch 2 --seq-len 16 "
                           "--idempotency-key %s",
                g_model, tu_cluster_data(g_c), idem);
    if (rc == 0 && out)
        snprintf(id, 17, "%.16s", out);
    free(out);
    return rc;
}

static void test_client_connection_settings_come_from_options_env_or_config(void **state)
{
    (void)state;
    char *out = NULL;
    /* Nothing said: exit 2 and what to do. */
    assert_int_equal(tu_sh(&out, "env -u FUSION_BROKER FUSION_CONFIG=/nonexistent %s jobs", tu_bin("fusion")), 2);
    assert_non_null(strstr(out, "no broker given: use --broker"));
    free(out);
    /* A config file alone is enough. */
    char conf[TU_PATH];
    tu_path(g_c, conf, "alice.conf");
    FILE *f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "# test\nbroker = %s\nbroker-key=%s/broker/public.key\n  keys =  %s/alice  \n",
            tu_broker_endpoint(g_c), tu_cluster_dir(g_c), tu_cluster_dir(g_c));
    fclose(f);
    assert_int_equal(tu_sh(&out, "FUSION_CONFIG=%s %s peers --json", conf, tu_bin("fusion")), 0);
    assert_true(out[0] == '[');
    free(out);
    /* Options win over the environment: a wrong --broker-key is used, and refused. */
    assert_int_equal(as(0, &out, "peers --broker-key /nonexistent/public.key"), 2);
    assert_non_null(strstr(out, "/nonexistent/public.key"));
    free(out);
}

static void test_client_unknown_key_is_refused_with_exit_3(void **state)
{
    (void)state;
    char *out = NULL;
    assert_int_equal(as(2, &out, "jobs --timeout-ms 5000"), 3);
    assert_non_null(strstr(out, "refused this client's key"));
    free(out);
}

static void test_client_submit_is_idempotent_and_jobs_are_private(void **state)
{
    (void)state;
    char a[17] = "", a2[17] = "", b[17] = "";
    assert_int_equal(submit(0, "key-one", a), 0);
    assert_int_equal(submit(0, "key-one", a2), 0);
    assert_string_equal(a, a2); /* the retry is the same job */
    assert_int_equal(submit(1, "key-one", b), 0);
    assert_string_not_equal(a, b); /* same key, other owner: another job */

    char *out = NULL;
    assert_int_equal(as(0, &out, "status %s --json", a), 0);
    assert_non_null(strstr(out, "\"state\":\"queued\""));
    free(out);
    /* Bob can neither see nor cancel Alice's job: it does not exist for him. */
    assert_int_equal(as(1, &out, "status %s", a), 4);
    free(out);
    assert_int_equal(as(1, &out, "cancel %s", a), 4);
    free(out);
    assert_int_equal(as(1, &out, "jobs --json"), 0);
    assert_null(strstr(out, a));
    assert_non_null(strstr(out, b));
    free(out);
    /* Alice cancels hers; it is listed as cancelled, and has no result. */
    assert_int_equal(as(0, &out, "cancel %s", a), 0);
    assert_non_null(strstr(out, "cancelled"));
    free(out);
    assert_int_equal(as(0, &out, "jobs"), 0);
    assert_non_null(strstr(out, a));
    assert_non_null(strstr(out, "cancelled"));
    free(out);
    assert_int_equal(as(0, &out, "status --json"), 0); /* no JOB: all of Alice's jobs */
    assert_non_null(strstr(out, a));
    assert_null(strstr(out, b));
    free(out);
    assert_int_equal(as(0, &out, "jobs --active --json"), 0);
    assert_null(strstr(out, a));
    free(out);
    assert_int_equal(as(0, &out, "result %s -o %s/res", a, tu_cluster_dir(g_c)), 1);
    assert_non_null(strstr(out, "a result exists only once it is done"));
    free(out);
}

static void test_client_wait_reports_why_a_job_is_queued_and_times_out(void **state)
{
    (void)state;
    char id[17] = "";
    assert_int_equal(submit(1, "waiting", id), 0);
    char *out = NULL;
    assert_int_equal(as(1, &out, "wait %s --wait-timeout 1", id), 5);
    assert_non_null(strstr(out, "queued: "));
    assert_non_null(strstr(out, "still queued after 1 s"));
    free(out);
}

static void test_client_bad_arguments_exit_2(void **state)
{
    (void)state;
    char *out = NULL;
    assert_int_equal(as(0, &out, "status not-a-job"), 2);
    assert_non_null(strstr(out, "is not a job id"));
    free(out);
    assert_int_equal(as(0, &out, "submit finetune --model x"), 2);
    assert_non_null(strstr(out, "needs --model DIR and --data FILE"));
    free(out);
    assert_int_equal(as(0, &out, "submit finetune --model x --data /nonexistent/data.txt"), 2);
    free(out);
    assert_int_equal(as(0, &out, "submit infer --model x --prompt hi --prompt-tokens 1,2"), 2);
    free(out);
    assert_int_equal(as(0, &out, "submit finetune --model x --data /dev/null --verify 1.5"), 2);
    assert_non_null(strstr(out, "--verify must be a number between 0 and 1"));
    free(out);
    assert_int_equal(as(0, &out, "submit frobnicate"), 2);
    free(out);
    assert_int_equal(as(0, &out, "status 0123456789abcdef"), 4); /* well-formed, unknown */
    free(out);
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
