/* `fusion serve`, the OpenAI-compatible gateway, in front of a real three-peer pipeline (a broker and
 * three fusion-peers over loopback, the gateway as its own process with the client's keys):
 *   - OpenAI's own client library (the npm package openai) lists the models, streams a chat
 *     completion and gets the same text without streaming, and is refused n = 2 with a 400;
 *   - with curl: a greedy completion equals `fusion run infer` in one process; a streamed chat comes
 *     as server-sent events (the role first, the text, the finish reason, usage, [DONE]); a stop
 *     string cuts the text before it; a client that hangs up cancels its job; bad requests get
 *     OpenAI's error shapes; the API key is needed;
 *   - "NAME:JOB" serves a finished fine-tune's adapter, as `fusion submit infer --adapter-job` does;
 *     /v1/models lists the fine-tunes of the gateway's model only, not those of another model (the
 *     same shapes, other weights) that the broker also serves;
 *   - with --sessions (the default), concurrent requests are sessions of one serving job, and a
 *     streaming client that hangs up closes its session while the job serves on;
 *   - the gateway refuses to listen beyond loopback without a key, and stops on SIGTERM.
 * The model is the e2e model (bytes as tokens) with a ChatML chat_template in its
 * tokenizer_config.json; the real tokenizers' chat prompts are held to transformers.js in
 * test_tokenizer_conformance. Needs node and the npm test data (deploy/fetch-test-data.sh). */
#include <ctype.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "cluster.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "testutil.h"

#define KEY "serve-test-key-0123456789abcdef"

#define CHATML "{\"chat_template\": \"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\\\n' + " \
               "message['content'] + '<|im_end|>' + '\\\\n'}}{% endfor %}{% if add_generation_prompt %}{{ " \
               "'<|im_start|>assistant\\\\n' }}{% endif %}\"}\n"

typedef struct {
    tu_cluster *c;
    pid_t pid;
    char url[128]; /* http://127.0.0.1:PORT/v1 */
    char log[TU_PATH];
} gateway;

static const char *src_dir(void)
{
    const char *s = getenv("FUSION_SOURCE_DIR");
    return s && *s ? s : "..";
}

/* Starts `fusion serve` for the cluster's model with the arguments extra (NULL-terminated, at most 8;
 * NULL: none); waits for its URL. */
static void gateway_start(gateway *g, tu_cluster *c, const char *const *extra)
{
    g->c = c;
    tu_path(c, g->log, "serve.log");
    char key_file[TU_PATH], model[TU_PATH], bkey[TU_PATH], keys[TU_PATH];
    tu_path(c, key_file, "serve.key");
    tu_file_write_private(key_file, KEY "\n");
    tu_path(c, model, "model");
    tu_path(c, bkey, "broker/public.key");
    tu_path(c, keys, "client");
    char *argv[] = {(char *)tu_bin("fusion"), "serve", "--model", model, "--listen", "127.0.0.1:0", "--api-key-file",
                    key_file, "--broker", (char *)tu_broker_endpoint(c), "--broker-key", bkey, "--keys", keys,
                    "--max-tokens", "2000", "--queue-timeout", "8", NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                    NULL};
    size_t at = 0;
    while (argv[at])
        at++;
    for (size_t i = 0; extra && extra[i] && i < 8; i++)
        argv[at++] = (char *)extra[i];
    g->pid = tu_spawn(g->log, argv, "FUSION_CONFIG=");
    if (!tu_file_wait(g->log, "http://127.0.0.1:", 30000)) {
        tu_file_show(g->log, 40);
        fail_msg("fusion serve did not say where it listens");
    }
    char *text = tu_file_text(g->log);
    const char *u = strstr(text, "http://127.0.0.1:");
    size_t n = strcspn(u, "\n ;");
    assert_true(n < sizeof g->url);
    memcpy(g->url, u, n);
    g->url[n] = '\0';
    free(text);
    printf("gateway at %s\n", g->url);
}

/* curl with the key and extra options: the body of GET PATH, or of POST PATH with data. */
static char *curl(const gateway *g, const char *extra, const char *path, const char *data)
{
    char *out = NULL, body[TU_PATH], post[TU_PATH + 32] = "";
    if (data) {
        tu_path(g->c, body, "req.json");
        tu_file_write_private(body, data);
        snprintf(post, sizeof post, "--data-binary '@%s'", body);
    }
    int rc = tu_sh(&out, "curl -sS --max-time 120 -H 'Authorization: Bearer " KEY "' -H 'Content-Type: "
                         "application/json' %s %s '%s%s'", extra, post, g->url, path);
    if (rc != 0 && !strstr(extra, "--max-time")) /* a --max-time of the test's own ends the transfer */
        fail_msg("curl %s failed (%d): %s", path, rc, out ? out : "");
    return out;
}

static cJSON *curl_json(const gateway *g, const char *path, const char *data)
{
    char *out = curl(g, "", path, data);
    cJSON *o = cJSON_Parse(out);
    if (!cJSON_IsObject(o))
        fail_msg("not JSON from %s: %s", path, out);
    free(out);
    return o;
}

static const char *str_at(const cJSON *o, const char *a, const char *b, const char *c)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, a);
    if (b && cJSON_IsArray(v))
        v = cJSON_GetArrayItem(v, 0);
    if (b)
        v = cJSON_GetObjectItemCaseSensitive(v, b);
    if (c)
        v = cJSON_GetObjectItemCaseSensitive(v, c);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static double num_at(const cJSON *o, const char *a, const char *b)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, a), b);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

/* The bytes of s with every byte that is not part of valid UTF-8 shown as '?' (as the broker shows
 * generated bytes that are no text). In place. */
static void utf8_clean(char *s)
{
    size_t n = strlen(s);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        size_t len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
        bool ok = len && i + len <= n;
        for (size_t k = 1; ok && k < len; k++)
            ok = ((unsigned char)s[i + k] & 0xc0) == 0x80;
        if (ok && len == 2)
            ok = c >= 0xc2;
        if (ok && len == 3) {
            unsigned cp = (c & 0x0fu) << 12 | ((unsigned char)s[i + 1] & 0x3fu) << 6 | ((unsigned char)s[i + 2] & 0x3fu);
            ok = cp >= 0x800 && (cp < 0xd800 || cp > 0xdfff);
        }
        if (ok && len == 4) {
            unsigned cp = (c & 0x07u) << 18 | ((unsigned char)s[i + 1] & 0x3fu) << 12;
            ok = cp >= 0x10000 && cp <= 0x10ffff;
        }
        if (ok) {
            i += len;
        } else {
            s[i++] = '?';
        }
    }
}

/* The server-sent events of a streamed request: the text of its deltas, the count of data lines,
 * and whether they end with [DONE]; the first chunk's role and id, the finish reason and usage. */
typedef struct {
    char text[8192];
    char role[32], id[64], finish[32];
    int events;
    long completion_tokens;
    bool done;
} sse_seen;

static void sse_parse(const char *out, bool chat, sse_seen *s)
{
    memset(s, 0, sizeof *s);
    s->completion_tokens = -1;
    for (const char *p = strstr(out, "data: "); p; p = strstr(p + 1, "\n\ndata: ")) {
        if (p != out && strncmp(p, "\n\ndata: ", 8) == 0)
            p += 2;
        const char *body = p + 6, *end = strstr(body, "\n\n");
        assert_non_null(end); /* every event ends with a blank line */
        s->events++;
        if (strncmp(body, "[DONE]", 6) == 0) {
            s->done = true;
            assert_null(strstr(end + 2, "data: ")); /* nothing after [DONE] */
            break;
        }
        cJSON *o = cJSON_ParseWithLength(body, (size_t)(end - body));
        assert_true(cJSON_IsObject(o));
        const char *id = str_at(o, "id", NULL, NULL);
        if (!s->id[0] && id)
            snprintf(s->id, sizeof s->id, "%s", id);
        const char *t = chat ? str_at(o, "choices", "delta", "content") : str_at(o, "choices", "text", NULL);
        const char *role = chat ? str_at(o, "choices", "delta", "role") : NULL;
        const char *fin = str_at(o, "choices", "finish_reason", NULL);
        if (t)
            strncat(s->text, t, sizeof s->text - strlen(s->text) - 1);
        if (role && !s->role[0])
            snprintf(s->role, sizeof s->role, "%s", role);
        if (fin)
            snprintf(s->finish, sizeof s->finish, "%s", fin);
        double ct = num_at(o, "usage", "completion_tokens");
        if (ct >= 0)
            s->completion_tokens = (long)ct;
        cJSON_Delete(o);
    }
}

/* A job's state from `fusion status --json`. */
static void job_state(const tu_cluster *c, const char *id, char *state, size_t cap)
{
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "status %s --json", id), 0);
    cJSON *o = cJSON_Parse(out);
    const char *st = str_at(o, "state", NULL, NULL);
    snprintf(state, cap, "%s", st ? st : "?");
    cJSON_Delete(o);
    free(out);
}

/* POST /v1/completions of "Once upon a time", 12 tokens, with the sampling fields json, against `fusion
 * run infer` with the same options (args) in this process: the same text (the gateway's with its
 * newlines, the local one's bytes that are no text shown as '?'), its usage counted. When oc (the
 * openai client's answers) is given, its completion (greedy) must be the same too. */
static bool same_as_run_infer(const gateway *g, const char *model, const char *json, const char *args, const cJSON *oc)
{
    char *local = tu_sh_expect_out(0, NULL, "FUSION_CONFIG= %s run infer --model '%s' --prompt 'Once upon a time' "
                                   "--max-tokens 12 %s 2>/dev/null", tu_bin("fusion"), model, args);
    size_t ll = strlen(local);
    if (ll && local[ll - 1] == '\n') /* run infer ends the text with a newline */
        local[ll - 1] = '\0';
    utf8_clean(local);
    char req[512];
    snprintf(req, sizeof req, "{\"model\": \"model\", \"prompt\": \"Once upon a time\", \"max_tokens\": 12, %s}", json);
    cJSON *comp = curl_json(g, "/completions", req);
    const char *text = str_at(comp, "choices", "text", NULL);
    printf("completion (%s): '%s'\nrun infer %s: '%s'\n", json, text, args, local);
    assert_string_equal(str_at(comp, "object", NULL, NULL), "text_completion");
    assert_string_equal(str_at(comp, "choices", "finish_reason", NULL), "length");
    assert_int_equal((long)num_at(comp, "usage", "prompt_tokens"), 16); /* bytes */
    assert_int_equal((long)num_at(comp, "usage", "completion_tokens"), 12);
    bool same = text && strcmp(text, local) == 0;
    if (oc)
        same = same && strcmp(text, str_at(oc, "completion_text", NULL, NULL)) == 0;
    cJSON_Delete(comp);
    free(local);
    return same;
}

static void test_e2e_serve_openai_client_through_three_peers(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    tu_cluster *c = tu_cluster_new("e2e-serve", &o);
    char cfg[TU_PATH];
    tu_path(c, cfg, "model/tokenizer_config.json");
    tu_file_write_private(cfg, CHATML);
    /* another base model beside it: the same shapes, other weights (so another content id) */
    char *mi = NULL;
    int mrc = tu_sh(&mi, "cd '%s' && '%s' model init -o model2 --layers 6 --hidden 256 --heads 4 --kv-heads 2 "
                    "--ffn 512 --vocab 256 --seed 4", tu_cluster_dir(c), tu_bin("fusion"));
    if (mrc != 0)
        fail_msg("fusion model init model2: exit %d: %s", mrc, mi ? mi : "");
    free(mi);
    tu_cluster_start(c);
    gateway g;
    const char *const per_job[] = {"--sessions", "0", NULL}; /* a job per request: what this test follows */
    gateway_start(&g, c, per_job);

    /* the key is needed; the models are listed */
    tu_sh_expect(0, "invalid_api_key", "curl -s '%s/models'", g.url);
    tu_sh_expect(0, "\"401\"", "curl -s -o /dev/null -w '\"%%{http_code}\"' '%s/models'", g.url);
    cJSON *models = curl_json(&g, "/models", NULL);
    assert_string_equal(str_at(models, "data", "id", NULL), "model");
    cJSON_Delete(models);

    /* OpenAI's client: stream, whole, completion, a refusal */
    char *out = tu_sh_expect_out(0, "stream_text", "timeout 300 node '%s/tests/reference/openai_client.mjs' "
                                 "'%s/var/testdata/node_modules' '%s' '%s' model", src_dir(), src_dir(), g.url, KEY);
    printf("openai client: %s", out);
    cJSON *oc = cJSON_Parse(strstr(out, "{\"models\""));
    free(out);
    assert_true(cJSON_IsObject(oc));
    assert_string_equal(str_at(oc, "stream_role", NULL, NULL), "assistant");
    assert_string_equal(str_at(oc, "stream_finish", NULL, NULL), "length");
    assert_string_equal(str_at(oc, "stream_text", NULL, NULL), str_at(oc, "whole_text", NULL, NULL));
    assert_true(strlen(str_at(oc, "stream_text", NULL, NULL)) > 0);
    assert_true(cJSON_GetObjectItemCaseSensitive(oc, "stream_chunks")->valuedouble >= 1);
    assert_int_equal((long)num_at(oc, "stream_usage", "completion_tokens"), 12);
    assert_int_equal((long)num_at(oc, "whole_usage", "completion_tokens"), 12);
    assert_int_equal((long)num_at(oc, "refused", "status"), 400);
    assert_string_equal(str_at(oc, "refused", "param", NULL), "n");
    /* the streamed chat ran as a three-stage job */
    char jid[TU_ID_LEN], st[32];
    const char *sid = str_at(oc, "stream_id", NULL, NULL);
    assert_non_null(sid);
    assert_int_equal(strncmp(sid, "chatcmpl-", 9), 0);
    snprintf(jid, sizeof jid, "%s", sid + 9);
    job_state(c, jid, st, sizeof st);
    assert_string_equal(st, "done");
    char want[64];
    snprintf(want, sizeof want, "job %s stage 2/3 on", jid); /* the planner's line for each stage */
    assert_true(tu_broker_logged(c, "%s", want));
    printf("the streamed chat's job ran as three stages (%s)\n", want);

    /* a completion is `fusion run infer` in one process: greedy, and sampled with a seed */
    char model[TU_PATH];
    tu_path(c, model, "model");
    assert_true(same_as_run_infer(&g, model, "\"temperature\": 0", "", oc));
    char *text = NULL;
    assert_true(same_as_run_infer(&g, model, "\"temperature\": 0.9, \"top_k\": 40, \"seed\": 5",
                                  "--temperature 0.9 --top-k 40 --seed 5", NULL));
    {
        cJSON *comp = curl_json(&g, "/completions", "{\"model\": \"model\", \"prompt\": \"Once upon a time\", "
                                                    "\"max_tokens\": 12, \"temperature\": 0.9, \"top_k\": 40, "
                                                    "\"seed\": 5}");
        text = strdup(str_at(comp, "choices", "text", NULL));
        cJSON_Delete(comp);
    }
    cJSON_Delete(oc);

    /* a stop string ends the text before it: the job ends there itself (done, not cancelled), as
     * `fusion run infer --stop` does */
    size_t cut = 1;
    while (text[cut] && !isalnum((unsigned char)text[cut]))
        cut++;
    assert_true(text[cut] != '\0'); /* the seeded text has a letter or digit after its first byte */
    char stop[2] = {text[cut], 0}, req[512];
    const char *first = strchr(text, stop[0]);
    snprintf(req, sizeof req, "{\"model\": \"model\", \"prompt\": \"Once upon a time\", \"max_tokens\": 12, "
                              "\"temperature\": 0.9, \"top_k\": 40, \"seed\": 5, \"stop\": [\"%s\"]}", stop);
    cJSON *sj = curl_json(&g, "/completions", req);
    const char *stopped = str_at(sj, "choices", "text", NULL);
    printf("stop '%s': '%s'\n", stop, stopped);
    assert_int_equal(strlen(stopped), (size_t)(first - text));
    assert_string_equal(str_at(sj, "choices", "finish_reason", NULL), "stop");
    assert_true(num_at(sj, "usage", "completion_tokens") < 12);
    char *local_stop = tu_sh_expect_out(0, NULL, "FUSION_CONFIG= %s run infer --model '%s' --prompt 'Once upon a time' "
                                        "--max-tokens 12 --temperature 0.9 --top-k 40 --seed 5 --stop '%s' 2>/dev/null",
                                        tu_bin("fusion"), model, stop);
    local_stop[strcspn(local_stop, "\n")] = '\0';
    utf8_clean(local_stop);
    assert_string_equal(stopped, local_stop);
    free(local_stop);
    snprintf(jid, sizeof jid, "%s", str_at(sj, "id", NULL, NULL) + 5);
    job_state(c, jid, st, sizeof st);
    assert_string_equal(st, "done");
    cJSON_Delete(sj);
    free(text);

    /* curl streams a chat: role first, the text, finish, usage, [DONE] */
    const char *chat = "{\"model\": \"model\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                       "\"max_tokens\": 20, \"temperature\": 0, \"stream\": true, "
                       "\"stream_options\": {\"include_usage\": true}}";
    out = curl(&g, "-N", "/chat/completions", chat);
    sse_seen ss;
    sse_parse(out, true, &ss);
    free(out);
    assert_true(ss.done);
    assert_string_equal(ss.role, "assistant");
    assert_string_equal(ss.finish, "length");
    assert_int_equal(ss.completion_tokens, 20);
    cJSON *whole = curl_json(&g, "/chat/completions", "{\"model\": \"model\", \"messages\": [{\"role\": \"user\", "
                                                      "\"content\": \"hi\"}], \"max_tokens\": 20, \"temperature\": 0}");
    assert_string_equal(ss.text, str_at(whole, "choices", "message", "content"));
    cJSON_Delete(whole);

    /* a client that hangs up cancels its job: while a long fine-tune holds the peers, a streamed chat
     * waits in the broker's queue; its client reads the first event (the role) and goes after 2 s */
    char busy[TU_ID_LEN];
    tu_submit_finetune(c, busy, "model", "%s --steps 100000 --checkpoint-every 1000", TU_TRAIN_ARGS);
    (void)tu_wait_step(c, busy, 1, 90000);
    out = tu_sh_expect_out(0, "chatcmpl-", "curl -sSN --max-time 2 -H 'Authorization: Bearer " KEY "' --data "
                           "'{\"model\": \"model\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                           "\"max_tokens\": 20, \"stream\": true}' '%s/chat/completions' 2>/dev/null | head -n 1",
                           g.url);
    const char *cid = strstr(out, "chatcmpl-") + 9;
    snprintf(jid, sizeof jid, "%.16s", cid);
    free(out);
    bool cancelled = false;
    for (int i = 0; i < 100 && !cancelled; i++) { /* the gateway sees the hang-up within a poll */
        job_state(c, jid, st, sizeof st);
        cancelled = strcmp(st, "cancelled") == 0;
        if (!cancelled)
            usleep(100000);
    }
    printf("the hung-up stream's job %s: %s\n", jid, st);
    assert_string_equal(st, "cancelled");
    /* a request the swarm cannot start in time: its job waits behind the fine-tune, and after
     * --queue-timeout (8 s) it is cancelled and answered 503 with the broker's reason */
    double q0 = fu_clock_sec();
    out = curl(&g, "-w ' HTTP %{http_code}'", "/completions", "{\"model\": \"model\", \"prompt\": \"x\", \"max_tokens\": 4}");
    double waited = fu_clock_sec() - q0;
    printf("a request behind the fine-tune, after %.1f s: %s\n", waited, out);
    assert_non_null(strstr(out, " HTTP 503"));
    assert_non_null(strstr(out, "did not start this request within 8 s"));
    assert_non_null(strstr(out, "waiting for peers"));
    assert_true(waited >= 7.5 && waited < 30);
    free(out);
    assert_int_equal(tu_fusion(c, NULL, "cancel %s", busy), 0);

    /* OpenAI's error shapes */
    tu_sh_expect(0, "\"400\"", "curl -s -o /dev/null -w '\"%%{http_code}\"' -H 'Authorization: Bearer " KEY "' "
                 "--data '{bad' '%s/completions'", g.url);
    out = curl(&g, "", "/completions", "{\"model\": \"other\", \"prompt\": \"x\"}");
    assert_non_null(strstr(out, "\"type\":\"invalid_request_error\"") && strstr(out, "not served here"));
    free(out);
    out = curl(&g, "", "/chat/completions", "{\"model\": \"model\", \"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}");
    assert_non_null(strstr(out, "\"param\":\"messages\""));
    free(out);
    out = curl(&g, "", "/completions", "{\"model\": \"model\", \"prompt\": \"x\", \"temperature\": 9}");
    assert_non_null(strstr(out, "\"param\":\"temperature\""));
    free(out);
    tu_sh_expect(0, "\"413\"", "head -c 5000000 /dev/zero | tr '\\0' ' ' | curl -s -o /dev/null -w '\"%%{http_code}\"' "
                 "-H 'Authorization: Bearer " KEY "' --data-binary @- '%s/completions'", g.url);

    /* a finished fine-tune's adapter, by its model name; a fine-tune of another model is not listed */
    char ft[TU_ID_LEN], ft2[TU_ID_LEN];
    tu_submit_finetune(c, ft, "model", "%s --steps 4 --checkpoint-every 2", TU_TRAIN_ARGS);
    tu_submit_finetune(c, ft2, "model2", "%s --steps 4 --checkpoint-every 2", TU_TRAIN_ARGS);
    tu_wait_done(c, ft, 300);
    tu_wait_done(c, ft2, 300);
    models = curl_json(&g, "/models", NULL);
    char name[64], name2[64];
    snprintf(name, sizeof name, "model:%s", ft);
    snprintf(name2, sizeof name2, "model:%s", ft2);
    char *listed = cJSON_PrintUnformatted(models);
    printf("GET /v1/models: %s (fine-tune of model %s, of model2 %s)\n", listed, ft, ft2);
    assert_non_null(strstr(listed, name));
    assert_null(strstr(listed, name2));
    free(listed);
    cJSON_Delete(models);
    tu_sh_expect(0, "\"404\"", "curl -s -o /dev/null -w '\"%%{http_code}\"' -H 'Authorization: Bearer " KEY "' "
                 "'%s/models/%s'", g.url, name2);
    char path[96];
    snprintf(path, sizeof path, "/models/%s", name);
    cJSON *one = curl_json(&g, path, NULL);
    assert_string_equal(str_at(one, "id", NULL, NULL), name);
    cJSON_Delete(one);
    snprintf(req, sizeof req, "{\"model\": \"%s\", \"prompt\": \"Once upon a time\", \"max_tokens\": 8, "
                              "\"temperature\": 0}", name);
    cJSON *ad = curl_json(&g, "/completions", req);
    char *cli_text = NULL;
    assert_int_equal(tu_fusion(c, &cli_text, "submit infer --model model --adapter-job %s --prompt 'Once upon a time' "
                                             "--max-tokens 8 --wait --json", ft), 0);
    cJSON *cj = cJSON_Parse(cli_text);
    printf("adapter %s: gateway '%s', fusion submit '%s'\n", ft, str_at(ad, "choices", "text", NULL),
           str_at(cj, "output", NULL, NULL));
    assert_string_equal(str_at(ad, "choices", "text", NULL), str_at(cj, "output", NULL, NULL));
    cJSON_Delete(cj);
    free(cli_text);
    cJSON_Delete(ad);

    /* SIGTERM stops it */
    kill(g.pid, SIGTERM);
    assert_int_equal(tu_reap(g.pid, 15000), 0);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* With --sessions (the default) concurrent requests are sessions of one serving job: three at once
 * each get `fusion run infer`'s text, all in the one job the gateway submitted for its model; the
 * broker cancels the job once it is idle for --job-idle-s and the next request gets a new one;
 * stopping the gateway cancels that one. */
static void test_e2e_serve_sessions_share_one_job(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    tu_cluster *c = tu_cluster_new("e2e-serve-sessions", &o);
    tu_cluster_start(c);
    gateway g;
    const char *const serving[] = {"--sessions", "4", "--context", "160", "--max-tokens", "64", "--job-idle-s", "4",
                                   NULL};
    gateway_start(&g, c, serving);
    static const char *const prompts[] = {"Once upon a time", "To be, or not to be", "Now is the winter"};
    char cmd[4096];
    size_t n = (size_t)snprintf(cmd, sizeof cmd, "cd '%s' && { ", tu_cluster_dir(c));
    for (int i = 0; i < 3; i++) {
        char body[TU_PATH];
        tu_path(c, body, "req%d.json", i);
        char req[256];
        snprintf(req, sizeof req, "{\"model\": \"model\", \"prompt\": \"%s\", \"max_tokens\": 48, "
                                  "\"temperature\": 0}", prompts[i]);
        tu_file_write_private(body, req);
        n += (size_t)snprintf(cmd + n, sizeof cmd - n, "curl -sS --max-time 120 -H 'Authorization: Bearer " KEY "' "
                              "-H 'Content-Type: application/json' --data-binary @req%d.json '%s/completions' "
                              "> resp%d.json & p%d=$!; ", i, g.url, i, i);
    }
    snprintf(cmd + n, sizeof cmd - n, "wait $p0 && wait $p1 && wait $p2; }");
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "%s", cmd), 0);
    free(out);
    double idle_from = fu_clock_sec();
    char job[17] = "";
    for (int i = 0; i < 3; i++) {
        char path[TU_PATH];
        tu_path(c, path, "resp%d.json", i);
        char *text = tu_file_text(path);
        cJSON *r = cJSON_Parse(text);
        if (!cJSON_IsObject(r))
            fail_msg("request %d: not JSON: %s", i, text ? text : "");
        const char *id = str_at(r, "id", NULL, NULL), *got = str_at(r, "choices", "text", NULL);
        char *want = tu_sh_expect_out(0, NULL, "cd '%s' && FUSION_CONFIG= %s run infer --model model --prompt '%s' "
                                      "--max-tokens 48 2>/dev/null", tu_cluster_dir(c), tu_bin("fusion"), prompts[i]);
        want[strcspn(want, "\n")] = '\0';
        utf8_clean(want);
        printf("request %d (%s): %s\n", i, id, strcmp(got, want) == 0 ? "fusion run infer's text" : "ANOTHER TEXT");
        assert_true(strncmp(id, "cmpl-", 5) == 0 && strlen(id) > 5 + 16 && id[5 + 16] == '-');
        if (!job[0])
            memcpy(job, id + 5, 16);
        assert_memory_equal(job, id + 5, 16); /* one serving job for all three */
        assert_string_equal(got, want);
        assert_int_equal((int)num_at(r, "usage", "completion_tokens"), 48);
        free(want);
        cJSON_Delete(r);
        free(text);
    }
    /* the gateway submitted that one job, and no other */
    char *log = tu_file_text(g.log), needle[96];
    size_t jobs = 0;
    for (const char *q = log; (q = strstr(q, ": serving job ")) != NULL; q++)
        jobs += strstr(q, " sessions of ") != NULL;
    snprintf(needle, sizeof needle, ": serving job %s for model: 4 sessions of 160 positions", job);
    printf("serving jobs the gateway submitted: %zu (%s)\n", jobs, strstr(log, needle) ? job : "not the one answering");
    assert_non_null(strstr(log, needle));
    assert_int_equal(jobs, 1);
    free(log);
    /* idle for --job-idle-s (4 s), the broker cancels the job; the next request gets a new one */
    char st[32];
    for (int i = 0; i < 100; i++) {
        job_state(c, job, st, sizeof st);
        if (strcmp(st, "cancelled") == 0)
            break;
        usleep(200000);
    }
    printf("serving job %s %.1f s after its last request: %s\n", job, fu_clock_sec() - idle_from, st);
    assert_string_equal(st, "cancelled");
    assert_true(fu_clock_sec() - idle_from > 3.5);
    cJSON *again = curl_json(&g, "/completions", "{\"model\": \"model\", \"prompt\": \"x\", \"max_tokens\": 4}");
    const char *id2 = str_at(again, "id", NULL, NULL);
    char job2[17];
    snprintf(job2, sizeof job2, "%.16s", id2 + 5);
    printf("the next request: %s (a new serving job: %s)\n", id2, strcmp(job2, job) ? "yes" : "NO");
    assert_string_not_equal(job2, job);
    assert_true(tu_file_wait(g.log, "ended; the next request submits another", 1000));
    cJSON_Delete(again);
    /* SIGTERM stops the gateway and cancels its serving job */
    kill(g.pid, SIGTERM);
    assert_int_equal(tu_reap(g.pid, 15000), 0);
    job_state(c, job2, st, sizeof st);
    printf("serving job %s after the gateway stopped: %s\n", job2, st);
    assert_string_equal(st, "cancelled");
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Listening where other machines reach it needs an API key; a model that is not here is said. */
static void test_e2e_serve_refuses_an_open_listener(void **state)
{
    (void)state;
    char *dir = tu_tmpdir("serve-open");
    tu_sh_expect(0, NULL, "cd '%s' && %s model init -o model >/dev/null", dir, tu_bin("fusion"));
    tu_sh_expect(2, "reachable from other machines", "cd '%s' && FUSION_CONFIG= FUSION_SERVE_API_KEY= %s serve "
                 "--model model --listen 0.0.0.0:0 --broker tcp://127.0.0.1:1 --broker-key x --keys x", dir,
                 tu_bin("fusion"));
    tu_sh_expect(4, "not a model directory", "cd '%s' && FUSION_CONFIG= %s serve --model nothing --broker "
                 "tcp://127.0.0.1:1 --broker-key x --keys x", dir, tu_bin("fusion"));
    tu_sh_expect(2, "--listen", "cd '%s' && FUSION_CONFIG= %s serve --model model --listen localhost", dir,
                 tu_bin("fusion"));
    tu_tmpdir_remove(&dir);
}

/* With --sessions a streaming client that hangs up closes its session, not the serving job: the
 * broker ends the session ("closed by its owner") long before its 2,000 tokens, the job goes on, and
 * the next request is a session of the same job. */
static void test_e2e_serve_session_hung_up_is_closed(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    o.peer_memory_gb = "0.1"; /* room for the sessions' 2,100 positions */
    tu_cluster *c = tu_cluster_new("e2e-serve-hangup", &o);
    tu_cluster_start(c);
    gateway g;
    const char *const serving[] = {"--sessions", "2", "--context", "2100", "--max-tokens", "2000", NULL};
    gateway_start(&g, c, serving);
    /* the client reads the first event and goes: head exits, curl's next write fails */
    char *out = tu_sh_expect_out(0, "cmpl-", "curl -sSN --max-time 60 -H 'Authorization: Bearer " KEY "' --data "
                                 "'{\"model\": \"model\", \"prompt\": \"x\", \"max_tokens\": 2000, "
                                 "\"temperature\": 0, \"stream\": true}' '%s/completions' 2>/dev/null | head -n 1",
                                 g.url);
    char job[17];
    snprintf(job, sizeof job, "%.16s", strstr(out, "cmpl-") + 5);
    free(out);
    char needle[160];
    snprintf(needle, sizeof needle, "job %s session ", job);
    const char *closed = NULL;
    char *bl = NULL;
    for (int i = 0; i < 150 && !closed; i++) { /* the gateway sees the hang-up within a long poll */
        free(bl);
        bl = tu_broker_log_text(c);
        for (const char *q = bl; !closed && (q = strstr(q, needle)) != NULL; q++) {
            const char *eol = strchr(q, '\n'), *by = strstr(q, "closed by its owner");
            if (by && (!eol || by < eol))
                closed = q;
        }
        if (!closed)
            usleep(100000);
    }
    if (!closed)
        tu_file_show(tu_broker_log(c), 30);
    assert_non_null(closed);
    unsigned sid = 0, gen = 0;
    assert_int_equal(sscanf(closed + strlen(needle), "%u: ended after %u tokens", &sid, &gen), 2);
    printf("the hung-up stream's session %u of job %s: closed by its owner after %u of 2000 tokens\n", sid, job, gen);
    assert_true(gen < 2000);
    free(bl);
    char st[32];
    job_state(c, job, st, sizeof st);
    printf("serving job %s after the hang-up: %s\n", job, st);
    assert_string_equal(st, "running");
    assert_true(tu_file_wait(g.log, "the client went away; its session was closed", 5000));
    /* the next request is a session of the same job, and gets its whole answer */
    cJSON *again = curl_json(&g, "/completions", "{\"model\": \"model\", \"prompt\": \"x\", \"max_tokens\": 4}");
    const char *id2 = str_at(again, "id", NULL, NULL);
    printf("the next request: %s\n", id2);
    assert_true(strncmp(id2, "cmpl-", 5) == 0 && strncmp(id2 + 5, job, 16) == 0);
    assert_int_equal((int)num_at(again, "usage", "completion_tokens"), 4);
    cJSON_Delete(again);
    kill(g.pid, SIGTERM);
    assert_int_equal(tu_reap(g.pid, 15000), 0);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_serve_openai_client_through_three_peers, tu_teardown),
        cmocka_unit_test(test_e2e_serve_refuses_an_open_listener),
        cmocka_unit_test_teardown(test_e2e_serve_sessions_share_one_job, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_serve_session_hung_up_is_closed, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
