/* cli_openai, the OpenAI API shapes of `fusion serve`, on its own: what requests are taken and
 * refused (and which field is named), the answers' and chunks' JSON, and how much of a growing text a
 * stream may pass on (stop strings, a tail that may begin one, characters not whole yet). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli_openai.h"

static fu_err parse(const char *body, bool chat, cli_oai_req *r, char *param)
{
    fu_errmsg em = {{0}};
    return cli_oai_parse(body, strlen(body), chat, 16, 1000, r, param, &em);
}

/* body must be refused, naming param. */
static void refused(const char *body, bool chat, const char *param)
{
    cli_oai_req r;
    char p[32];
    if (parse(body, chat, &r, p) != FU_EINVAL)
        fail_msg("taken: %s", body);
    if (strcmp(p, param) != 0)
        fail_msg("%s: param '%s', expected '%s'", body, p, param);
}

static void test_cli_openai_parse_takes_what_openai_takes(void **state)
{
    (void)state;
    cli_oai_req r;
    char p[32];
    assert_int_equal(parse("{\"model\": \"m\", \"prompt\": \"hi\"}", false, &r, p), FU_OK);
    assert_string_equal(r.model, "m");
    assert_string_equal(r.prompt, "hi");
    assert_int_equal(r.max_tokens, 16); /* the default given */
    assert_true(r.temperature == 1.0 && r.top_p == 1.0 && !r.has_seed && !r.stream);
    cli_oai_req_free(&r);
    assert_int_equal(parse("{\"model\": \"m\", \"prompt\": [\"one\"], \"max_tokens\": 1000, \"temperature\": 0, "
                           "\"top_p\": 0.5, \"top_k\": 7, \"seed\": 9, \"stop\": [\"a\", \"bc\"], \"stream\": true, "
                           "\"stream_options\": {\"include_usage\": true}, \"n\": 1, \"logprobs\": null, "
                           "\"presence_penalty\": 0, \"user\": \"u\", \"echo\": true}", false, &r, p), FU_OK);
    assert_string_equal(r.prompt, "one");
    assert_int_equal(r.max_tokens, 1000);
    assert_true(r.temperature == 0 && r.top_p == 0.5 && r.top_k == 7 && r.has_seed && r.seed == 9);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[1], "bc");
    assert_true(r.stream && r.include_usage && r.echo);
    cli_oai_req_free(&r);
    assert_int_equal(parse("{\"model\": \"m\", \"prompt\": [1, 2, 3]}", false, &r, p), FU_OK);
    assert_null(r.prompt);
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[2], 3);
    cli_oai_req_free(&r);
    assert_int_equal(parse("{\"model\": \"m\", \"max_completion_tokens\": 5, \"messages\": [{\"role\": \"developer\", "
                           "\"content\": \"be brief\"}, {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
                           "\"a\"}, {\"type\": \"text\", \"text\": \"b\"}]}], \"stop\": \"x\"}", true, &r, p), FU_OK);
    assert_int_equal(r.n_msgs, 2);
    assert_string_equal(r.msgs[0].role, "system"); /* developer is the system message */
    assert_string_equal(r.msgs[1].content, "ab"); /* text parts joined */
    assert_int_equal(r.max_tokens, 5);
    assert_int_equal(r.n_stop, 1);
    cli_oai_req_free(&r);
}

static void test_cli_openai_parse_refuses_naming_the_field(void **state)
{
    (void)state;
    refused("{bad", false, "");
    refused("[1]", false, "");
    refused("{\"prompt\": \"x\"}", false, "model");
    refused("{\"model\": \"\", \"prompt\": \"x\"}", false, "model");
    refused("{\"model\": \"m\"}", false, "prompt");
    refused("{\"model\": \"m\", \"prompt\": [\"a\", \"b\"]}", false, "prompt");
    refused("{\"model\": \"m\", \"prompt\": [1, -2]}", false, "prompt");
    refused("{\"model\": \"m\", \"prompt\": [1.5]}", false, "prompt");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"max_tokens\": 1001}", false, "max_tokens");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"max_tokens\": 0}", false, "max_tokens");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"max_tokens\": \"5\"}", false, "max_tokens");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"temperature\": 2.5}", false, "temperature");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"top_p\": 0}", false, "top_p");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"top_k\": -1}", false, "top_k");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"seed\": 0.5}", false, "seed");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"n\": 2}", false, "n");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"logprobs\": 3}", false, "logprobs");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"frequency_penalty\": 0.5}", false, "frequency_penalty");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"logit_bias\": {\"1\": 5}}", false, "logit_bias");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"stop\": [\"a\", \"b\", \"c\", \"d\", \"e\"]}", false, "stop");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"stop\": [\"\"]}", false, "stop");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"stop\": 5}", false, "stop");
    refused("{\"model\": \"m\", \"prompt\": \"x\", \"stream\": \"yes\"}", false, "stream");
    refused("{\"model\": \"m\", \"prompt\": [1], \"echo\": true}", false, "echo");
    refused("{\"model\": \"m\", \"messages\": []}", true, "messages");
    refused("{\"model\": \"m\", \"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", true, "messages");
    refused("{\"model\": \"m\", \"messages\": [{\"role\": \"user\"}]}", true, "messages");
    refused("{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", true,
            "messages");
    refused("{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": []}", true, "tools");
    refused("{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"response_format\": "
            "{\"type\": \"json_object\"}}", true, "response_format");
    refused("{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream_options\": 1}", true,
            "stream_options");
    /* invalid UTF-8 in a stop string: a stream could be cut inside a character */
    const char bad[] = "{\"model\": \"m\", \"prompt\": \"x\", \"stop\": \"\xff\"}";
    refused(bad, false, "stop");
}

static void test_cli_openai_answers_are_openai_json(void **state)
{
    (void)state;
    cli_oai_req r;
    char p[32];
    assert_int_equal(parse("{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", true, &r, p),
                     FU_OK);
    cli_oai_usage u = {.prompt_tokens = 3, .completion_tokens = 4};
    char *a = cli_oai_answer_json(&r, "chatcmpl-1", 7, "hi\"\n", 4, "stop", &u);
    cJSON *o = cJSON_Parse(a);
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "chat.completion");
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "content")->valuestring, "hi\"\n");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "message"), "role")->valuestring, "assistant");
    assert_string_equal(cJSON_GetObjectItem(c, "finish_reason")->valuestring, "stop");
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "usage"), "total_tokens")->valuedouble, 7);
    cJSON_Delete(o);
    free(a);
    a = cli_oai_chunk_json(&r, "chatcmpl-1", 7, "", 0, true, NULL, NULL); /* the first chunk: the role */
    o = cJSON_Parse(a);
    assert_string_equal(cJSON_GetObjectItem(o, "object")->valuestring, "chat.completion.chunk");
    c = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "choices"), 0);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(c, "delta"), "role")->valuestring, "assistant");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(c, "finish_reason")));
    cJSON_Delete(o);
    free(a);
    a = cli_oai_chunk_json(&r, "chatcmpl-1", 7, NULL, 0, false, NULL, &u); /* the usage chunk: no choices */
    o = cJSON_Parse(a);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(o, "choices")), 0);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "usage"), "completion_tokens")->valuedouble, 4);
    cJSON_Delete(o);
    free(a);
    a = cli_oai_error_json("no", "invalid_request_error", "n", NULL);
    assert_string_equal(a, "{\"error\":{\"message\":\"no\",\"type\":\"invalid_request_error\",\"param\":\"n\",\"code\":null}}");
    free(a);
    cli_oai_req_free(&r);
}

static size_t rel(const char *text, const char *const *stop, size_t n, bool final, size_t sent, bool *stopped)
{
    return cli_oai_release(text, strlen(text), stop, n, final, sent, stopped);
}

static void test_cli_openai_release_never_passes_a_stop_string(void **state)
{
    (void)state;
    const char *stop[2] = {"END", "\n\n"};
    bool st;
    assert_int_equal(rel("hello", stop, 2, false, 0, &st), 5);
    assert_false(st);
    assert_int_equal(rel("hello E", stop, 2, false, 0, &st), 6); /* "E" may begin "END" */
    assert_int_equal(rel("hello EN", stop, 2, false, 0, &st), 6);
    assert_int_equal(rel("hello EN", stop, 2, true, 0, &st), 8); /* the end: all of it */
    assert_int_equal(rel("hello ENX", stop, 2, false, 6, &st), 9); /* it was not one */
    assert_int_equal(rel("hello END and more", stop, 2, false, 0, &st), 6);
    assert_true(st);
    assert_int_equal(rel("a\n\nb END", stop, 2, false, 0, &st), 1); /* the first of them */
    assert_true(st);
    assert_int_equal(rel("hi\n", stop, 2, false, 0, &st), 2);
    /* never less than what was passed on */
    assert_int_equal(rel("abc", stop, 2, false, 3, &st), 3);
    /* a stop string that starts past the text passed on, in the middle of a later chunk */
    assert_int_equal(rel("xxENDyy", stop, 2, true, 1, &st), 2);
    assert_true(st);
}

static void test_cli_openai_release_waits_for_whole_characters(void **state)
{
    (void)state;
    bool st;
    /* the broker shows the bytes of a character still to come as '?' */
    assert_int_equal(rel("caf?", NULL, 0, false, 0, &st), 3);
    assert_int_equal(rel("caf??", NULL, 0, false, 0, &st), 3);
    assert_int_equal(rel("what????", NULL, 0, false, 0, &st), 5); /* at most 3 held back */
    assert_int_equal(rel("what?", NULL, 0, true, 0, &st), 5);     /* the end: a real '?' */
    /* raw UTF-8 cut inside a character: back to its start */
    assert_int_equal(rel("caf\xc3", NULL, 0, false, 0, &st), 3);
    assert_int_equal(rel("caf\xc3\xa9", NULL, 0, false, 0, &st), 5);
    assert_int_equal(rel("x\xe2\x82", NULL, 0, false, 0, &st), 1);
    assert_int_equal(rel("x\xe2\x82\xac", NULL, 0, false, 0, &st), 4);
    assert_int_equal(rel("x\xf0\x9f\x99", NULL, 0, false, 0, &st), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cli_openai_parse_takes_what_openai_takes),
        cmocka_unit_test(test_cli_openai_parse_refuses_naming_the_field),
        cmocka_unit_test(test_cli_openai_answers_are_openai_json),
        cmocka_unit_test(test_cli_openai_release_never_passes_a_stop_string),
        cmocka_unit_test(test_cli_openai_release_waits_for_whole_characters),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
