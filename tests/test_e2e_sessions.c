/* End to end: serving jobs (docs/SERVE.md "Serving jobs") with a real broker, three real peers and
 * the real CLI.
 *   - `fusion submit infer --sessions 4` makes a job that runs without a prompt of its own;
 *   - three `fusion ask` at once each get the greedy text `fusion run infer` gives for its prompt,
 *     through a pipeline of at least two stages;
 *   - `fusion ask --prompts FILE` of more prompts than the job holds gives, sampled, every line
 *     `fusion run infer --prompts FILE --batch 1` gives, and the stages ran their positions in
 *     batches of more than one session;
 *   - what cannot be served is refused with a message: a prompt over the context, a session on a job
 *     that is no serving job, a prompt given to a serving job, another client's session in the job
 *     ("not found", as for its jobs); the job serves again after each;
 *   - cancelling the job ends it; one with --idle-s is cancelled by the broker once idle that long;
 *   - a stage's peer killed mid-generation: the sessions go on on the new stages, same texts. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "cluster.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "testutil.h"
#include "wire.h"

#define MAX_TOKENS 12

static const char *const PROMPTS[] = {"the quick brown fox", "To be, or not to be", "Now is the winter"};
#define N_PROMPTS 3
#define N_FILE    6 /* prompts in the file: more than the job's 4 sessions */
#define LONG_TOKENS 300  /* a generation long enough to be cut by a failover */

/* Waits until job id's stages run (a serving job never ends by itself). */
static void wait_running(const tu_cluster *c, const char *id, int timeout_ms)
{
    if (tu_broker_wait_log(c, timeout_ms, "job %s: every stage is ready", id))
        return;
    tu_file_show(tu_broker_log(c), 40);
    fail_msg("serving job %s is not running after %d ms", id, timeout_ms);
}

/* The text `fusion run infer` gives for prompt p (greedy, MAX_TOKENS). */
static char *reference(const tu_cluster *c, const char *p)
{
    char *want = NULL;
    assert_int_equal(tu_fusion(c, &want, "run infer -q --threads 1 --model model --prompt '%s' --max-tokens %d "
                               "2>/dev/null", p, MAX_TOKENS), 0);
    size_t wl = strlen(want);
    if (wl && want[wl - 1] == '\n')
        want[--wl] = '\0';
    wire_utf8_clean(want, wl); /* as the broker's status carries text: bytes that are no UTF-8 become '?' */
    return want;
}

/* The n JSON lines of `fusion ask --prompts` (got) against those of `fusion run infer --prompts
 * --batch 1` (want): the same index, token counts (each `tokens` when >= 0) and finish reason, and
 * the same text once want's bytes that are no UTF-8 are '?' as the broker's are. Cuts both. */
static void same_lines(char *got, char *want, int n, int tokens)
{
    char *gl = got, *wl = want;
    for (int i = 0; i < n; i++) {
        char *ge = strchr(gl, '\n'), *we = strchr(wl, '\n');
        assert_non_null(ge);
        assert_non_null(we);
        *ge = *we = '\0';
        cJSON *g = cJSON_Parse(gl), *w = cJSON_Parse(wl);
        assert_non_null(g);
        assert_non_null(w);
        const char *keys[] = {"index", "prompt_tokens", "completion_tokens", "finish_reason"};
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
            char *a = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(g, keys[k]));
            char *b = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(w, keys[k]));
            if (!a || !b || strcmp(a, b) != 0)
                fail_msg("prompt %d: %s is %s, fusion run infer says %s", i, keys[k], a ? a : "-", b ? b : "-");
            free(a);
            free(b);
        }
        const cJSON *gt = cJSON_GetObjectItemCaseSensitive(g, "text"), *wt = cJSON_GetObjectItemCaseSensitive(w, "text");
        const cJSON *gn = cJSON_GetObjectItemCaseSensitive(g, "completion_tokens");
        assert_true(cJSON_IsString(gt) && cJSON_IsString(wt) && cJSON_IsNumber(gn));
        wire_utf8_clean(wt->valuestring, strlen(wt->valuestring));
        printf("prompt %d: %d tokens, %s\n", i, (int)gn->valuedouble,
               strcmp(gt->valuestring, wt->valuestring) == 0 ? "fusion run infer's text" : "ANOTHER TEXT");
        if (tokens >= 0)
            assert_int_equal((int)gn->valuedouble, tokens);
        assert_string_equal(gt->valuestring, wt->valuestring);
        cJSON_Delete(g);
        cJSON_Delete(w);
        gl = ge + 1;
        wl = we + 1;
    }
}

/* How many peer logs say a batch of at least two sessions ran. */
static bool batched(const tu_cluster *c)
{
    for (int i = 0; i < 3; i++) {
        char p[TU_PATH];
        tu_path(c, p, "p%d.log", i);
        char *t = tu_file_text(p);
        bool yes = t && strstr(t, "sessions in one forward") != NULL;
        free(t);
        if (yes)
            return true;
    }
    return false;
}

static void test_e2e_sessions_concurrent_asks(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    tu_cluster *c = tu_cluster_new("e2e-sessions", &o);
    tu_keygen(c, "bob", true); /* another client, on the allow-list from the start */
    tu_broker_args(c, "--http 127.0.0.1:0");
    tu_cluster_start(c);
    char id[TU_ID_LEN];
    tu_submit(c, id, "infer --model model --sessions 4 --context 64 --max-tokens %d", MAX_TOKENS);
    wait_running(c, id, 60000);
    /* three generations at once, each its own process */
    char *out = NULL;
    const char *bin = tu_bin("fusion"), *dir = tu_cluster_dir(c);
    int rc = tu_sh(&out, "cd '%s' && export FUSION_CONFIG='%s/client.conf' && { "
                   "'%s' ask %s --json --prompt '%s' > ask0.json 2>ask0.err & a=$!; "
                   "'%s' ask %s --json --prompt '%s' > ask1.json 2>ask1.err & b=$!; "
                   "'%s' ask %s --json --prompt '%s' > ask2.json 2>ask2.err & c=$!; "
                   "wait $a && wait $b && wait $c; }",
                   dir, dir, bin, id, PROMPTS[0], bin, id, PROMPTS[1], bin, id, PROMPTS[2]);
    if (rc != 0)
        tu_sh(NULL, "cat '%s'/ask*.err >&2", dir);
    assert_int_equal(rc, 0);
    free(out);
    for (int i = 0; i < N_PROMPTS; i++) {
        char p[TU_PATH];
        tu_path(c, p, "ask%d.json", i);
        char *got = tu_file_text(p);
        char *want = reference(c, PROMPTS[i]);
        printf("session for '%s': %s\n  fusion run infer: %s\n", PROMPTS[i], got ? got : "(nothing)", want);
        cJSON *j = got ? cJSON_Parse(got) : NULL;
        assert_non_null(j);
        const cJSON *st_ = cJSON_GetObjectItemCaseSensitive(j, "state");
        const cJSON *finish = cJSON_GetObjectItemCaseSensitive(j, "finish_reason");
        const cJSON *tokens = cJSON_GetObjectItemCaseSensitive(j, "tokens");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(j, "text");
        assert_true(cJSON_IsString(st_) && strcmp(st_->valuestring, "done") == 0);
        assert_true(cJSON_IsString(finish) && strcmp(finish->valuestring, "length") == 0);
        assert_true(cJSON_IsNumber(tokens) && tokens->valuedouble == MAX_TOKENS);
        assert_true(cJSON_IsString(text));
        assert_string_equal(text->valuestring, want);
        cJSON_Delete(j);
        free(got);
        free(want);
    }
    assert_true(tu_broker_logged(c, "job %s stage 1/", id)); /* two stages or more */
    /* a file of prompts at once (more than the job holds): each line is `fusion run infer --prompts`'s
     * line for it, and the stages ran sessions together */
    char path[TU_PATH];
    tu_path(c, path, "prompts.jsonl");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < N_FILE; i++)
        fprintf(f, "{\"prompt\": \"%s %d\"}\n", PROMPTS[i % N_PROMPTS], i);
    fclose(f);
    char *got = NULL, *want = NULL;
    assert_int_equal(tu_fusion(c, &got, "ask %s --prompts prompts.jsonl --seed 5 --temperature 0.8 --max-tokens %d "
                               "2>ask.err", id, MAX_TOKENS), 0);
    assert_int_equal(tu_fusion(c, &want, "run infer --threads 1 --model model --prompts prompts.jsonl --batch 1 "
                               "--seed 5 --temperature 0.8 --max-tokens %d 2>/dev/null", MAX_TOKENS), 0);
    printf("fusion ask --prompts:\n%s" "fusion run infer --prompts:\n%s", got, want);
    same_lines(got, want, N_FILE, -1);
    free(got);
    free(want);
    assert_true(batched(c));
    /* the job runs on, with its sessions gone */
    tu_status st;
    assert_true(tu_status_get(c, id, &st));
    assert_string_equal(st.state, "running");
    /* refusals, each with its reason; the job serves after them */
    rc = tu_fusion(c, &out, "ask %s --prompt '%s' --max-tokens 60 2>&1", id, PROMPTS[0]);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "do not fit the job's context of 64 positions"));
    free(out);
    char other[TU_ID_LEN];
    tu_submit(c, other, "infer --model model --prompt 'hello' --max-tokens 2");
    rc = tu_fusion(c, &out, "ask %s --prompt hello 2>&1", other);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(out, "is no serving job"));
    free(out);
    rc = tu_fusion(c, &out, "submit infer --model model --sessions 2 --prompt hello 2>&1");
    assert_int_equal(rc, 2);
    free(out);
    /* another client can neither open a session in the job nor see or close one of it */
    rc = tu_fusion(c, &out, "ask %s --keys bob --prompt hello 2>&1", id);
    printf("bob asks in %s: exit %d: %s", id, rc, out);
    assert_int_equal(rc, 4);
    assert_non_null(strstr(out, "no serving job"));
    free(out);
    rc = tu_fusion(c, &out, "ask %s --json --prompt '%s' --max-tokens 3", id, PROMPTS[1]);
    assert_int_equal(rc, 0);
    assert_non_null(strstr(out, "\"tokens\":3"));
    free(out);
    /* the broker's /metrics counted the 10 sessions: 3 asks, 6 of the file, 1 after the refusals */
    char *m = tu_metrics_scrape(c);
    printf("metrics: %.0f sessions opened, %.0f done, %.0f open\n", tu_metric(m, "fusion_sessions_total{event=\"opened\"}"),
           tu_metric(m, "fusion_sessions_total{event=\"done\"}"), tu_metric(m, "fusion_sessions_open"));
    assert_true(tu_metric(m, "fusion_sessions_total{event=\"opened\"}") == 10);
    assert_true(tu_metric(m, "fusion_sessions_total{event=\"done\"}") == 10);
    assert_true(tu_metric(m, "fusion_sessions_open") == 0);
    free(m);
    /* cancelling ends it */
    assert_int_equal(tu_fusion(c, &out, "cancel %s", id), 0);
    free(out);
    assert_true(tu_status_get(c, id, &st));
    printf("serving job %s after cancel: %s\n", id, st.state);
    assert_true(strncmp(st.state, "cancel", 6) == 0);
    /* a serving job with --idle-s 2 is cancelled by the broker 2 s after its last session ended */
    char idle[TU_ID_LEN];
    tu_submit(c, idle, "infer --model model --sessions 2 --context 64 --max-tokens 4 --idle-s 2");
    wait_running(c, idle, 60000);
    assert_int_equal(tu_fusion(c, NULL, "ask %s --prompt hello", idle), 0);
    uint64_t t0 = fu_clock_ms();
    bool gone = false;
    while (!gone && fu_clock_ms() - t0 < 20000) {
        gone = tu_status_get(c, idle, &st) && strncmp(st.state, "cancel", 6) == 0;
        if (!gone)
            fu_sleep_ms(200);
    }
    printf("idle serving job %s: %s after %.1f s: %s\n", idle, st.state, (double)(fu_clock_ms() - t0) / 1e3,
           st.message);
    assert_true(gone);
    assert_non_null(strstr(st.message, "no session for 2 s"));
    assert_true(fu_clock_ms() - t0 >= 1500);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A stage's peer killed while two sessions generate: the broker moves the stage to the warm backup,
 * starts both sessions again on the new stages with their tokens so far, and each ends with the text
 * `fusion run infer --prompts --batch 1` gives, as if nothing had happened. */
static void test_e2e_sessions_failover(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(3, 1);
    tu_cluster *c = tu_cluster_new("e2e-sessions-fo", &o);
    tu_cluster_start(c);
    char id[TU_ID_LEN];
    tu_submit(c, id, "infer --model model --sessions 2 --context %d --max-tokens %d", LONG_TOKENS + 32, LONG_TOKENS);
    wait_running(c, id, 60000);
    char path[TU_PATH], log[TU_PATH], conf[TU_PATH + 32];
    tu_path(c, path, "long.jsonl");
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "{\"prompt\": \"the river and the stone\"}\n{\"prompt\": \"over the lazy dog\"}\n");
    fclose(f);
    tu_path(c, log, "ask-long.out");
    snprintf(conf, sizeof conf, "FUSION_CONFIG=%s/client.conf", tu_cluster_dir(c));
    char *argv[] = {(char *)tu_bin("fusion"), "ask", id, "--prompts", path, NULL};
    pid_t ask = tu_spawn(log, argv, conf);
    assert_true(tu_broker_wait_log(c, 30000, "job %s session 2: opened", id));
    fu_sleep_ms(300); /* a few dozen tokens each (300 take about two seconds here) */
    int victim = tu_stage_peer(c, id, 1, 1000);
    printf("killing p%d (stage 1 of the serving job) while its two sessions generate\n", victim);
    (void)tu_peer_stop(c, victim, SIGKILL, 5000);
    assert_int_equal(tu_reap(ask, 120000), 0);
    /* the kill came while both generated, after their first tokens */
    char *bl = tu_broker_log_text(c), needle[128];
    snprintf(needle, sizeof needle, "job %s: 2 open sessions started again on the new stages (", id);
    const char *at = strstr(bl, needle);
    long before = at ? strtol(at + strlen(needle), NULL, 10) : -1;
    printf("tokens generated before the failover: %ld of %d\n", before, 2 * LONG_TOKENS);
    if (before <= 0 || before >= 2 * LONG_TOKENS)
        tu_file_show(tu_broker_log(c), 30);
    free(bl);
    assert_true(before > 0 && before < 2 * LONG_TOKENS);
    assert_true(tu_broker_logged(c, "job %s: stage 1 moved from", id));
    char *got = tu_file_text(log), *want = NULL;
    assert_int_equal(tu_fusion(c, &want, "run infer --threads 1 --model model --prompts long.jsonl --batch 1 "
                               "--max-tokens %d 2>/dev/null", LONG_TOKENS), 0);
    /* each line's text is compared as parsed (both are cJSON's) */
    same_lines(got, want, 2, LONG_TOKENS);
    free(got);
    free(want);
    assert_int_equal(tu_fusion(c, NULL, "cancel %s", id), 0);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_sessions_concurrent_asks, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_sessions_failover, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
