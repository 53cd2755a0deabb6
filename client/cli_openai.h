/* cli_openai: the shapes of the OpenAI API that `fusion serve` speaks (docs/SERVE.md). Requests of
 * /v1/completions and /v1/chat/completions are parsed and checked into a cli_oai_req; answers,
 * stream chunks and errors are written in OpenAI's JSON; cli_oai_release says how much of the text
 * generated so far a stream may pass on (not past a stop string, not into the start of one, not into
 * a character that is not whole yet). Pure: no I/O, no globals; thread-safe. */
#ifndef FU_CLI_OPENAI_H
#define FU_CLI_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_dataset.h"
#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CLI_OAI_MAX_STOP     4        /* stop strings of one request (OpenAI's limit) */
#define CLI_OAI_MAX_STOP_LEN 256      /* bytes of one stop string */
#define CLI_OAI_MAX_MODEL    256      /* bytes of a model name */

/* One request, checked. Strings point into the parsed document (kept in doc) or are owned. */
typedef struct {
    bool chat;                       /* /v1/chat/completions */
    char model[CLI_OAI_MAX_MODEL];   /* as the client named it */
    /* chat */
    dag_chat_msg *msgs;              /* owned array; contents borrowed from doc or owned (joined parts) */
    size_t n_msgs;
    char **joined;                   /* contents made of several text parts (owned) */
    size_t n_joined;
    /* completions: the prompt as text, or as ids */
    const char *prompt;              /* NULL when given as ids */
    int32_t *prompt_ids;             /* owned; NULL when given as text */
    size_t n_prompt_ids;
    bool echo;                       /* completions: the prompt's text before the completion's */
    /* sampling; unset fields keep the defaults cli_oai_parse was given */
    uint32_t max_tokens;
    double temperature, top_p;
    uint32_t top_k;
    bool has_seed;
    uint64_t seed;
    const char *stop[CLI_OAI_MAX_STOP];
    size_t n_stop;
    bool stream, include_usage;
    void *doc;                       /* the parsed JSON (cJSON *) */
} cli_oai_req;

/* Parses body[0..len) as a request of /v1/chat/completions (chat) or /v1/completions. max_tokens
 * defaults to def_max_tokens and may not exceed cap_max_tokens. FU_EINVAL with em naming the field
 * and *param (at least 32 bytes) set to it ("" when the body itself is wrong) for anything OpenAI
 * would refuse or fusion cannot do: n > 1, logprobs, penalties, tools, a bad type or range. On
 * failure r is left freed. */
FU_MUST_CHECK fu_err cli_oai_parse(const char *body, size_t len, bool chat, uint32_t def_max_tokens,
                                   uint32_t cap_max_tokens, cli_oai_req *r, char *param, fu_errmsg *em);
void cli_oai_req_free(cli_oai_req *r);

/* Only the "messages" of a JSON object (a chat request, or {"messages": [...]}) into r, checked as
 * cli_oai_parse checks them; the object's other keys are not looked at. */
FU_MUST_CHECK fu_err cli_oai_parse_messages(const char *json, size_t len, cli_oai_req *r, fu_errmsg *em);

/* {"error": {"message", "type", "param", "code"}}: param and code may be NULL (null). Caller frees. */
char *cli_oai_error_json(const char *message, const char *type, const char *param, const char *code);

/* What a finished request used. */
typedef struct {
    uint64_t prompt_tokens, completion_tokens;
} cli_oai_usage;

/* The whole answer of a request that does not stream: text[0..len) generated, finish ("stop" or
 * "length"). id is the response's id ("chatcmpl-…" or "cmpl-…"). Caller frees. */
char *cli_oai_answer_json(const cli_oai_req *r, const char *id, int64_t created, const char *text, size_t len,
                          const char *finish, const cli_oai_usage *u);

/* One chunk of a stream: delta[0..len) of text, with the assistant's role when first (chat), and
 * finish when it is the last chunk with choices (NULL otherwise). With usage (not NULL) the chunk is
 * the usage chunk of stream_options.include_usage: no choices. Caller frees. */
char *cli_oai_chunk_json(const cli_oai_req *r, const char *id, int64_t created, const char *delta, size_t len,
                         bool first, const char *finish, const cli_oai_usage *usage);

/* How many bytes of text[0..len) (the text generated so far, UTF-8 with the broker's '?' for bytes
 * that are no text yet) a stream may have passed on: up to the first stop string of stop[0..n) when
 * one occurs (*stopped set), else when !final short of a tail that could begin a stop string and of
 * trailing '?'s and incomplete UTF-8 (they may still become a character). Never less than sent. */
size_t cli_oai_release(const char *text, size_t len, const char *const *stop, size_t n, bool final, size_t sent,
                       bool *stopped);

#ifdef __cplusplus
}
#endif
#endif
