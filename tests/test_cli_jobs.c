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
#include <signal.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

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
    tu_broker_args(g_c, "--max-sessions-per-minute 3");
    tu_broker_start(g_c);
    const char *dir = tu_cluster_dir(g_c);
    for (int i = 0; i < 3; i++)
        snprintf(g_env[i], sizeof g_env[i],
                 "FUSION_CONFIG= FUSION_BROKER=%s FUSION_BROKER_KEY=%s/broker/public.key "
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
                 "env -u FUSION_BROKER FUSION_CONFIG= %s jobs", tu_bin("fusion"));
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
    run_as(0, 4, "is cancelled and has no result", "result %s -o %s/res", a, tu_cluster_dir(g_c));
    /* a job still queued: not yet */
    run_as(1, 1, "a result exists only once it is done", "result %s -o %s/res", b, tu_cluster_dir(g_c));
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
        {"submit finetune --model x --data /nonexistent/data.txt", 4, "/nonexistent/data.txt"},
        {"submit infer --model x --prompt hi --prompt-tokens 1,2", 2, NULL},
        {"submit finetune --model x --data /dev/null --verify 1.5", 2,
         "--verify must be a number between 0 and 1"},
        {"submit frobnicate", 2, NULL},
        {"status 0123456789abcdef", 4, NULL}, /* well-formed, unknown */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_as(0, cases[i].rc, cases[i].says, "%s", cases[i].args);
}

/* A TCP port on loopback that nothing listens on (bound, then closed). */
static int closed_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* Issue "Operate and serve", CLI points: a broker that is not there is said at once (not after the
 * request's deadline: here 60 s, which would exit 5), and a misspelt configuration file or a
 * $FUSION_CONFIG that does not exist stops the command with the line or the file named. */
static void test_client_dead_broker_and_bad_config_said_at_once(void **state)
{
    (void)state;
    const char *dir = tu_cluster_dir(g_c);
    double t0 = fu_clock_sec();
    tu_sh_expect(1, "the connection is refused",
                 "FUSION_CONFIG= %s status --broker tcp://127.0.0.1:%d --broker-key %s/broker/public.key --keys "
                 "%s/alice --timeout-ms 60000", tu_bin("fusion"), closed_port(), dir, dir);
    printf("a broker that is not there: said after %.1f s\n", fu_clock_sec() - t0);
    /* A broker that is there but does not answer (stopped: the kernel still takes the connection) is
     * said within a few seconds too, as a timeout, and not at the 60 s deadline. */
    pid_t broker = tu_broker_pid(g_c);
    assert_int_equal(kill(broker, SIGSTOP), 0);
    t0 = fu_clock_sec();
    char *o = run_as_out(0, 5, "has not finished its handshake in 4.0 s", "status --timeout-ms 60000");
    double took = fu_clock_sec() - t0;
    assert_int_equal(kill(broker, SIGCONT), 0);
    printf("a broker that is stopped: said after %.1f s\n", took);
    assert_true(took < 15);
    free(o);
    run_as(0, 0, NULL, "jobs"); /* it goes on once continued */
    char conf[TU_PATH];
    tu_path(g_c, conf, "typo.conf");
    FILE *f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "# a typo on line 3\nbroker = %s\nbrokr-key = %s/broker/public.key\n", tu_broker_endpoint(g_c), dir);
    fclose(f);
    tu_sh_expect(2, "line 3: unknown setting 'brokr-key'", "env -u FUSION_BROKER_KEY FUSION_CONFIG=%s %s jobs", conf,
                 tu_bin("fusion"));
    tu_sh_expect(4, "cannot read the configuration file '/nonexistent/client.conf' ($FUSION_CONFIG",
                 "FUSION_CONFIG=/nonexistent/client.conf %s jobs", tu_bin("fusion"));
    /* fusion-broker --allow with a path that does not exist and no enrolment token: it would admit nobody */
    tu_sh_expect(4, "--allow '/nonexistent/allow' does not exist", "%s --allow /nonexistent/allow --keys %s/broker "
                 "--db %s/other.db --bind tcp://127.0.0.1:%d", tu_bin("fusion-broker"), dir, dir, closed_port());
    /* a directory is no allow-list; with an enrolment token the list may be missing, but it must be
     * possible to make it */
    tu_sh_expect(2, "is a directory, not an allow-list file", "%s --allow %s --keys %s/broker --db %s/other.db "
                 "--bind tcp://127.0.0.1:%d", tu_bin("fusion-broker"), dir, dir, dir, closed_port());
    char want[TU_PATH + 64];
    snprintf(want, sizeof want, "does not exist and cannot be made in '%s/no-dir'", dir);
    tu_sh_expect(4, want, "%s --allow %s/no-dir/allow --enrol-token 0123456789abcdef0123 --keys %s/broker --db "
                 "%s/other.db --bind tcp://127.0.0.1:%d", tu_bin("fusion-broker"), dir, dir, dir, closed_port());
}

/* Issue "Operate and serve", CLI points: exit codes as the README says, the same from `run` and
 * `submit`: 4 for a model or data file that is not there, 2 for a model feature fusion does not
 * support. */
static void test_client_exit_codes_agree_between_run_and_submit(void **state)
{
    (void)state;
    const char *data = tu_cluster_data(g_c);
    run_as(0, 4, "does not exist", "run finetune --model /nonexistent/model --data %s -o %s/o1 --steps 1", data,
           tu_cluster_dir(g_c));
    run_as(0, 4, "nope.txt", "run finetune --model %s --data /nonexistent/nope.txt -o %s/o2 --steps 1", g_model,
           tu_cluster_dir(g_c));
    run_as(0, 4, NULL, "submit finetune --model nonexistent-model --data %s --steps 1", data);
    run_as(0, 4, "nope.txt", "submit finetune --model %s --data /nonexistent/nope.txt --steps 1", g_model);
    /* a model of a family fusion does not run (model_type gpt2), in the broker's model root */
    char odd[TU_PATH], cfg[TU_PATH];
    tu_path(g_c, odd, "gpt2ish");
    tu_sh_expect(0, NULL, "cp -r %s %s", g_model, odd);
    tu_path(g_c, cfg, "gpt2ish/config.json");
    tu_sh_expect(0, NULL, "sed -i 's/\"model_type\":[[:space:]]*\"llama\"/\"model_type\": \"gpt2\"/' %s && grep -q gpt2 %s",
                 cfg, cfg);
    run_as(0, 2, "model_type 'gpt2' is not supported", "run infer --model %s --prompt hi --max-tokens 1", odd);
    run_as(0, 2, "model_type 'gpt2' is not supported", "submit infer --model %s --prompt hi --max-tokens 1", odd);
}

/* Issue "Operate and serve", CLI points: `run finetune -o DIR` checks DIR before the first step, and
 * keeps an adapter already there unless --force. */
static void test_client_run_output_checked_before_training(void **state)
{
    (void)state;
    char out[TU_PATH], ad[TU_PATH];
    tu_path(g_c, out, "adapter-there");
    tu_path(g_c, ad, "adapter-there/adapter_model.safetensors");
    tu_sh_expect(0, NULL, "mkdir -p %s && echo keep > %s", out, ad);
    char *o = run_as_out(0, 2, "holds an adapter already; use --force",
                         "run finetune --model %s --data %s -o %s --steps 500 --batch 2 --seq-len 16", g_model,
                         tu_cluster_data(g_c), out);
    assert_null(strstr(o, "step")); /* not one step trained */
    free(o);
    char *kept = tu_file_text(ad);
    assert_string_equal(kept, "keep\n");
    free(kept);
    run_as(0, 1, "-o '/proc/self/none'", "run finetune --model %s --data %s -o /proc/self/none --steps 500", g_model,
           tu_cluster_data(g_c));
    run_as(0, 0, "wrote adapter", "run finetune --model %s --data %s -o %s --steps 1 --batch 2 --seq-len 16 --force",
           g_model, tu_cluster_data(g_c), out);
}

/* Issue "Operate and serve", CLI points: Ctrl-C on `fusion wait` says that the job goes on on the broker
 * and how to follow or cancel it; the job is untouched. */
static void test_client_wait_interrupted_says_the_job_goes_on(void **state)
{
    (void)state;
    char id[17] = "";
    submit(1, "interrupted", id);
    char *out = tu_sh_expect_out(130, "it goes on on the broker", "%s timeout --preserve-status -s INT 2 %s wait %s",
                                 g_env[1], tu_bin("fusion"), id);
    char want[64];
    snprintf(want, sizeof want, "`fusion wait %s`", id);
    assert_non_null(strstr(out, want));
    free(out);
    run_as(1, 0, "queued", "status %s", id);
}

/* Issue "Operate and serve", CLI points: --json on `model info`, `submit` and `wait`: one JSON object
 * on stdout and nothing else there. */
static void test_client_json_everywhere(void **state)
{
    (void)state;
    char *o = tu_sh_expect_out(0, "\"layers\":", "%s model info --json %s 2>/dev/null", tu_bin("fusion"), g_model);
    assert_true(o[0] == '{');
    assert_non_null(strstr(o, "\"model_type\":\"llama\""));
    assert_non_null(strstr(o, "\"tokenizer\":"));
    assert_ptr_equal(strchr(o, '\n'), o + strlen(o) - 1); /* one line */
    free(o);
    o = run_as_out(1, 0, "\"state\":\"queued\"",
                   "submit finetune --model %s --data %s --steps 3 --batch 2 --seq-len 16 --idempotency-key j1 --json "
                   "2>/dev/null", g_model, tu_cluster_data(g_c));
    assert_true(o[0] == '{');
    char id[17];
    const char *at = strstr(o, "\"job\":\"");
    assert_non_null(at);
    snprintf(id, sizeof id, "%.16s", at + 7);
    /* a fine-tune's verification is shown, the broker's default when the spec says nothing */
    assert_non_null(strstr(o, "\"verify\":0.25"));
    free(o);
    /* infer and eval too */
    free(run_as_out(1, 0, "\"kind\":\"infer\"", "submit infer --model %s --prompt hi --max-tokens 2 --json 2>/dev/null",
                    g_model));
    char *e = run_as_out(1, 0, "\"kind\":\"eval\"", "submit eval --model %s --data %s --batch 2 --seq-len 16 --json "
                         "2>/dev/null", g_model, tu_cluster_data(g_c));
    assert_true(e[0] == '{');
    assert_ptr_equal(strchr(e, '\n'), e + strlen(e) - 1);
    free(e);
    /* a queued job waited for one second: exit 5, and its status as JSON on stdout */
    o = run_as_out(1, 5, "\"state\":\"queued\"", "wait %s --wait-timeout 1 --json 2>/dev/null", id);
    assert_true(o[0] == '{');
    assert_non_null(strstr(o, id));
    free(o);
}

/* Issue "Operate and serve", CLI points: verification is on by default (the broker's --verify, 0.25)
 * and every fine-tune says how much of it runs: at submission, in `status` and in its JSON; a spec's
 * own fraction (0 included) is what is shown. */
static void test_client_verification_is_on_by_default_and_shown(void **state)
{
    (void)state;
    const char *args = "--steps 3 --batch 2 --seq-len 16";
    char *o = run_as_out(0, 0, "25% of micro-batches verified on a second peer",
                         "submit finetune --model %s --data %s %s --idempotency-key v-default 2>&1", g_model,
                         tu_cluster_data(g_c), args);
    char id[17];
    snprintf(id, sizeof id, "%.16s", o);
    free(o);
    run_as(0, 0, "25% of micro-batches verified on a second peer", "status %s", id);
    run_as(0, 0, "\"verify\":0.25", "status %s --json", id);
    o = run_as_out(0, 0, "verification off", "submit finetune --model %s --data %s %s --verify 0 "
                   "--idempotency-key v-off 2>&1", g_model, tu_cluster_data(g_c), args);
    snprintf(id, sizeof id, "%.16s", o);
    free(o);
    run_as(0, 0, "\"verify\":0,", "status %s --json", id);
    o = run_as_out(0, 0, "50% of micro-batches", "submit finetune --model %s --data %s %s --verify 0.5 "
                   "--idempotency-key v-half 2>&1", g_model, tu_cluster_data(g_c), args);
    free(o);
    /* an inference has no verification to show */
    o = run_as_out(0, 0, NULL, "submit infer --model %s --prompt hi --max-tokens 2 --json", g_model);
    assert_null(strstr(o, "\"verify\""));
    free(o);
}

/* Issue "Operate and serve", CLI points: Ctrl-C on `run finetune` keeps the work done: the adapter of
 * the last finished step is written, the one `--steps N` makes, bit for bit, and the exit is 130. */
static void test_client_run_interrupted_saves_the_adapter(void **state)
{
    (void)state;
    const char *dir = tu_cluster_dir(g_c), *train = "--batch 2 --seq-len 16 --threads 1 --seed 3";
    char *o = tu_sh_expect_out(130, "interrupted: ",
                               "timeout --preserve-status -s INT 3 %s run finetune --model %s --data %s -o %s/cut %s "
                               "--steps 1000000", tu_bin("fusion"), g_model, tu_cluster_data(g_c), dir, train);
    const char *at = strstr(o, "the adapter after step ");
    assert_non_null(at);
    long long n = atoll(at + strlen("the adapter after step "));
    printf("interrupted after step %lld\n", n);
    assert_true(n >= 1);
    free(o);
    tu_sh_expect(0, "wrote adapter", "%s run finetune --model %s --data %s -o %s/whole %s --steps %lld",
                 tu_bin("fusion"), g_model, tu_cluster_data(g_c), dir, train, n);
    tu_sh_expect(0, NULL, "cmp %s/cut/adapter_model.safetensors %s/whole/adapter_model.safetensors", dir, dir);
}

/* Runs `fusion ask JOB --prompt hello` as alice until the broker has opened its session n, then
 * interrupts it (Ctrl-C): it closes the session and exits 130. */
static void ask_and_interrupt(const char *id, int n)
{
    const char *dir = tu_cluster_dir(g_c);
    char bkey[TU_PATH], keys[TU_PATH], log[TU_PATH], fusion[TU_PATH], broker[256], job[17];
    snprintf(bkey, sizeof bkey, "%s/broker/public.key", dir);
    snprintf(keys, sizeof keys, "%s/alice", dir);
    snprintf(fusion, sizeof fusion, "%s", tu_bin("fusion"));
    snprintf(broker, sizeof broker, "%s", tu_broker_endpoint(g_c));
    snprintf(job, sizeof job, "%s", id);
    tu_path(g_c, log, "ask-%d.log", n);
    char *argv[] = {fusion, "ask", job, "--prompt", "hello", "--broker", broker, "--broker-key", bkey, "--keys", keys,
                    NULL};
    pid_t pid = tu_spawn(log, argv, "FUSION_CONFIG=");
    assert_true(tu_broker_wait_log(g_c, 60000, "job %s session %d: opened", id, n));
    assert_int_equal(kill(pid, SIGINT), 0);
    assert_int_equal(tu_reap(pid, 60000), 130);
}

/* A client opens sessions in its serving job no faster than the broker's --max-sessions-per-minute
 * (3 here): each open costs the broker a tokenization and memory for the session's text, so a client
 * that opens and closes them in a loop is refused, with when to come back. The job has no peers: each
 * session waits until `fusion ask` is interrupted, which closes it. */
static void test_client_sessions_opened_at_a_bounded_rate(void **state)
{
    (void)state;
    char *o = run_as_out(0, 0, NULL, "submit infer --model %s --sessions 2 --context 64 --max-tokens 8", g_model);
    char id[17];
    snprintf(id, sizeof id, "%.16s", o);
    free(o);
    for (int i = 1; i <= 3; i++)
        ask_and_interrupt(id, i);
    /* (a timeout: were it let in, it would wait for peers for ever) */
    tu_sh_expect(1, "you opened 3 sessions in the last minute, the most this broker takes: open again in",
                 "%s timeout 60 %s ask %s --prompt hello", g_env[0], tu_bin("fusion"), id);
    run_as(1, 4, NULL, "ask %s --prompt hello", id); /* another client: not its job, whatever its rate */
    run_as(0, 0, "cancelled", "cancel %s", id);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_client_connection_settings_come_from_options_env_or_config),
        cmocka_unit_test(test_client_unknown_key_is_refused_with_exit_3),
        cmocka_unit_test(test_client_submit_is_idempotent_and_jobs_are_private),
        cmocka_unit_test(test_client_wait_reports_why_a_job_is_queued_and_times_out),
        cmocka_unit_test(test_client_bad_arguments_exit_2),
        cmocka_unit_test(test_client_dead_broker_and_bad_config_said_at_once),
        cmocka_unit_test(test_client_exit_codes_agree_between_run_and_submit),
        cmocka_unit_test(test_client_run_output_checked_before_training),
        cmocka_unit_test(test_client_wait_interrupted_says_the_job_goes_on),
        cmocka_unit_test(test_client_json_everywhere),
        cmocka_unit_test(test_client_run_interrupted_saves_the_adapter),
        cmocka_unit_test(test_client_verification_is_on_by_default_and_shown),
        cmocka_unit_test(test_client_sessions_opened_at_a_bounded_rate),
    };
    return tu_run_tests(argc, argv, tests, setup, teardown);
}
