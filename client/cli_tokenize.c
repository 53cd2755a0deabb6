/* `fusion tokenize`: a model's tokenizer from the command line (docs/FORMATS.md "tokenizer.json").
 * Encodes text to a JSON array of ids, or decodes one back (--decode); with --jsonl, one JSON value
 * per input line (a string to encode, an array to decode), so a whole corpus goes through one
 * process (the conformance test, test_tokenizer_conformance). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cli_openai.h"
#include "dag_dataset.h"
#include "fu_alloc.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_opts.h"
#include "fu_tokenizer.h"
#include "wire.h"

#define TOK_MAX_INPUT ((size_t)256 << 20) /* most bytes read from stdin */

/* How --chat renders: the chat format and the model's BOS and EOS ids (-1: the tokenizer's). */
typedef struct {
    dag_chat_format fmt;
    int32_t bos, eos;
} tok_chat;

/* The tokenizer of src: a model directory (its tokenizer.json, else bytes over its vocabulary) or a
 * tokenizer.json file; with chat, also how chats render (tokenizer_config.json beside it). */
static fu_err open_tokenizer(const char *src, bool byte_tokens, fu_tokenizer **tok, tok_chat *chat, fu_errmsg *em)
{
    if (chat)
        *chat = (tok_chat){.fmt = DAG_CHAT_NONE, .bos = -1, .eos = -1};
    if (!fu_path_is_dir(src)) {
        FU_TRY(fu_tokenizer_load(src, tok, em));
        if (!chat)
            return FU_OK;
        char *dir = fu_strdup(src), *slash = strrchr(dir, '/');
        if (slash)
            *slash = '\0';
        fu_err rc = dag_chat_format_from_dir(slash ? dir : ".", &chat->fmt, em);
        free(dir);
        return rc;
    }
    fu_modelcfg cfg;
    FU_TRY(fu_modelcfg_load(src, &cfg, em));
    FU_TRY(fu_tokenizer_open_dir(src, cfg.vocab_size, cfg.byte_tokens || byte_tokens, tok, em));
    if (!chat)
        return FU_OK;
    chat->bos = (int32_t)cfg.bos_token_id;
    chat->eos = (int32_t)cfg.eos_token_id;
    return dag_chat_format_from_dir(src, &chat->fmt, em);
}

/* All of stdin (at most TOK_MAX_INPUT bytes) into *out (NUL-terminated, caller frees). */
static fu_err read_stdin(char **out, size_t *len, fu_errmsg *em)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = fu_malloc(cap);
    for (size_t got; (got = fread(buf + n, 1, cap - n - 1, stdin)) > 0;) {
        n += got;
        if (n + 1 == cap) {
            if (cap >= TOK_MAX_INPUT) {
                free(buf);
                return fu_errmsg_set(em, FU_EINVAL, "more than %zu bytes", TOK_MAX_INPUT);
            }
            cap *= 2;
            buf = fu_realloc(buf, cap);
        }
    }
    if (ferror(stdin)) {
        free(buf);
        return fu_errmsg_set(em, FU_EIO, "read error");
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return FU_OK;
}

/* Prints ids as a JSON array and a newline. */
static void print_ids(const int32_t *ids, size_t n)
{
    putchar('[');
    for (size_t i = 0; i < n; i++)
        printf(i ? ",%d" : "%d", ids[i]);
    puts("]");
}

/* Prints text[0..len) as a JSON string and a newline (a byte that begins no valid UTF-8 character
 * becomes U+FFFD, byte by byte, as JSON cannot carry it; cJSON would print it raw). */
static void print_string(const char *text, size_t len)
{
    char *z = fu_malloc(3 * len + 1), *o = z;
    for (size_t i = 0; i < len;) {
        size_t cl = wire_utf8_char_len(text + i, len - i);
        if (cl) {
            memcpy(o, text + i, cl);
            o += cl;
            i += cl;
        } else {
            memcpy(o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    *o = '\0';
    cJSON *s = cJSON_CreateString(z);
    char *out = s ? cJSON_PrintUnformatted(s) : NULL;
    puts(out ? out : "null");
    free(out);
    cJSON_Delete(s);
    free(z);
}

/* Encodes text[0..len) and prints its ids. */
static int encode_one(const fu_tokenizer *tok, const char *text, size_t len, const char *prog)
{
    int32_t *ids = NULL;
    size_t n = 0;
    fu_errmsg em = {{0}};
    fu_err rc = fu_tokenizer_encode(tok, text, len, &ids, &n, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", prog, fu_errmsg_text(&em, rc));
        return FU_EXIT_FAIL;
    }
    print_ids(ids, n);
    free(ids);
    return FU_EXIT_OK;
}

/* Decodes the JSON array of ids in json and prints the text (raw, or as a JSON string). */
static int decode_one(const fu_tokenizer *tok, const char *json, bool as_json, const char *prog)
{
    cJSON *a = cJSON_Parse(json);
    int code = FU_EXIT_OK;
    if (!cJSON_IsArray(a)) {
        fprintf(stderr, "%s: --decode expects a JSON array of token ids, such as [1, 415, 2936]\n", prog);
        cJSON_Delete(a);
        return FU_EXIT_USAGE;
    }
    size_t n = (size_t)cJSON_GetArraySize(a), k = 0;
    int32_t *ids = fu_calloc(n ? n : 1, sizeof *ids);
    const cJSON *e;
    cJSON_ArrayForEach(e, a)
    {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > 2147483647.0 ||
            e->valuedouble != (double)(int32_t)e->valuedouble) {
            fprintf(stderr, "%s: --decode: element %zu is not a token id\n", prog, k);
            code = FU_EXIT_USAGE;
            break;
        }
        ids[k++] = (int32_t)e->valuedouble;
    }
    char *text = NULL;
    size_t len = 0;
    fu_errmsg em = {{0}};
    fu_err rc = code == FU_EXIT_OK ? fu_tokenizer_decode(tok, ids, n, &text, &len, &em) : FU_EINVAL;
    if (code == FU_EXIT_OK && rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", prog, fu_errmsg_text(&em, rc));
        code = FU_EXIT_FAIL;
    } else if (code == FU_EXIT_OK) {
        if (as_json) {
            print_string(text, len);
        } else {
            fwrite(text, 1, len, stdout);
            putchar('\n');
        }
    }
    free(text);
    free(ids);
    cJSON_Delete(a);
    return code;
}

/* The chat of json ({"messages": [...]}, as a chat request has them) rendered in fmt as `fusion
 * serve` renders it for the model's next turn: its ids printed. */
static int chat_one(const fu_tokenizer *tok, const tok_chat *chat, const char *json, size_t len, const char *prog)
{
    cli_oai_req r;
    fu_errmsg em = {{0}};
    fu_err rc = cli_oai_parse_messages(json, len, &r, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: --chat: %s\n", prog, fu_errmsg_text(&em, rc));
        return FU_EXIT_USAGE;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    rc = dag_chat_prompt(tok, chat->fmt, chat->bos, chat->eos, r.msgs, r.n_msgs, &ids, &n, &em);
    cli_oai_req_free(&r);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: --chat: %s\n", prog, fu_errmsg_text(&em, rc));
        return FU_EXIT_USAGE;
    }
    print_ids(ids, n);
    free(ids);
    return FU_EXIT_OK;
}

/* --jsonl: one JSON value per line of in. */
static int per_line(const fu_tokenizer *tok, char *in, bool decode, const tok_chat *chat, const char *prog)
{
    int code = FU_EXIT_OK;
    size_t line = 0;
    for (char *p = in; *p && code == FU_EXIT_OK; line++) {
        char *nl = strchr(p, '\n');
        if (nl)
            *nl = '\0';
        if (decode) {
            code = decode_one(tok, p, true, prog);
        } else if (chat) {
            code = chat_one(tok, chat, p, strlen(p), prog);
        } else {
            cJSON *s = cJSON_Parse(p);
            if (!cJSON_IsString(s)) {
                fprintf(stderr, "%s: --jsonl: line %zu is not a JSON string\n", prog, line + 1);
                code = FU_EXIT_USAGE;
            } else {
                code = encode_one(tok, s->valuestring, strlen(s->valuestring), prog);
            }
            cJSON_Delete(s);
        }
        if (!nl)
            break;
        p = nl + 1;
    }
    return code;
}

int cli_tokenize_main(int argc, char **argv)
{
    bool decode = false, jsonl = false, byte_tokens = false, chat_flag = false;
    const fu_opt opts[] = {
        {"decode", 'd', FU_OPT_FLAG, &decode, NULL, "decode a JSON array of ids to text instead"},
        {"jsonl", 0, FU_OPT_FLAG, &jsonl, NULL,
         "read one JSON value per line from stdin (strings to encode, or arrays with --decode) and answer one "
         "line each"},
        {"chat", 0, FU_OPT_FLAG, &chat_flag, NULL,
         "encode a chat ({\"messages\": [...]}) as `fusion serve` prompts the model with it: in the model's chat "
         "format (tokenizer_config.json), ready for the assistant's turn"},
        {"byte-tokens", 0, FU_OPT_FLAG, &byte_tokens, NULL,
         "a model of more than 256 ids without tokenizer.json: use byte ids anyway"},
    };
    const fu_cmd cmd = {
        .prog = argv[0],
        .usage = "[--decode | --chat] [--jsonl] MODEL_DIR|tokenizer.json [TEXT|IDS|CHAT]",
        .summary = "Encodes TEXT (or stdin) with a model's tokenizer and prints the ids as a JSON array, or "
                   "with --decode prints the text of a JSON array of ids. Special tokens written in the text "
                   "(<s>, <|im_start|>) become their ids; nothing is added around it.",
        .min_pos = 1,
        .max_pos = 2,
        FU_OPTS_TABLE(opts),
    };
    int code = FU_EXIT_OK;
    size_t n_pos = 0;
    if (fu_opts_parse(&cmd, argc, argv, &n_pos, &code) != FU_OK)
        return code;
    const char *src = argv[1];
    if (jsonl && n_pos > 1) {
        fprintf(stderr, "%s: --jsonl reads stdin: give no TEXT\n", argv[0]);
        return FU_EXIT_USAGE;
    }
    if (decode && chat_flag) {
        fprintf(stderr, "%s: --decode and --chat do not go together\n", argv[0]);
        return FU_EXIT_USAGE;
    }
    fu_errmsg em = {{0}};
    fu_tokenizer *tok = NULL;
    tok_chat chat;
    fu_err rc = open_tokenizer(src, byte_tokens, &tok, chat_flag ? &chat : NULL, &em);
    int fail = rc == FU_ENOTFOUND ? FU_EXIT_NOTFOUND : FU_EXIT_FAIL;
    if (rc == FU_OK && chat_flag && chat.fmt == DAG_CHAT_NONE) {
        rc = fu_errmsg_set(&em, FU_EINVAL, "--chat: %s has no chat_template in its tokenizer_config.json", src);
        fail = FU_EXIT_USAGE;
    }
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], fu_errmsg_text(&em, rc));
        fu_tokenizer_destroy(&tok);
        return fail;
    }
    char *in = NULL;
    size_t len = 0;
    if (n_pos > 1) {
        in = fu_strdup(argv[2]);
        len = strlen(in);
    } else if ((rc = read_stdin(&in, &len, &em)) != FU_OK) {
        fprintf(stderr, "%s: cannot read stdin: %s\n", argv[0], fu_errmsg_text(&em, rc));
        fu_tokenizer_destroy(&tok);
        return FU_EXIT_FAIL;
    }
    if (jsonl)
        code = per_line(tok, in, decode, chat_flag ? &chat : NULL, argv[0]);
    else if (chat_flag)
        code = chat_one(tok, &chat, in, len, argv[0]);
    else if (decode)
        code = decode_one(tok, in, false, argv[0]);
    else
        code = encode_one(tok, in, len, argv[0]);
    free(in);
    fu_tokenizer_destroy(&tok);
    return code;
}
