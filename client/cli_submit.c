/* `fusion submit finetune|infer`: sends a job to the broker. The submission carries an idempotency
 * key (random unless --idempotency-key is given) and is retried with the same key when no answer
 * comes, so a retry never makes a second job. With --wait it then follows the job like `fusion wait`. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "cli.h"
#include "cli_jobs.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_file.h"

#define CLI_SUBMIT_TRIES     3               /* sends of one submission before giving up */
#define CLI_MAX_INLINE_BYTES (24u << 20)     /* training text carried inside the submission */

/* A model directory the broker will read: made absolute when it exists here (loopback clusters),
 * passed as given otherwise (a path on the broker's machine). Static storage. */
static const char *model_path(const char *dir)
{
    static char abs[PATH_MAX];
    return realpath(dir, abs) ? abs : dir;
}

/* Sends the submission (retrying with the same key), prints the job id, optionally waits. */
static int submit_and_follow(const char *prog, const cli_conn_opts *co, Fusion__JobKind kind, cJSON *spec,
                             const uint8_t *data, size_t data_len, const char *idem, bool wait, bool quiet)
{
    char key[33];
    if (!idem) {
        uint8_t raw[16];
        randombytes_buf(raw, sizeof raw);
        fu_hex_encode(key, raw, sizeof raw);
        idem = key;
    }
    char *spec_txt = cJSON_PrintUnformatted(spec);
    cJSON_Delete(spec);
    cli_conn_t *conn = NULL;
    int code = FU_EXIT_OK;
    if (cli_conn_open(prog, co, &conn, &code) != FU_OK) {
        free(spec_txt);
        return code;
    }
    Fusion__JobSubmit sub = FUSION__JOB_SUBMIT__INIT;
    sub.idempotency_key = (char *)idem;
    sub.kind = kind;
    sub.spec_json = spec_txt;
    sub.data.data = (uint8_t *)data;
    sub.data.len = data_len;
    wire_hdr h = {.type = FUSION__MSG_TYPE__MSG_JOB_SUBMIT};
    wire_msg_t *m = NULL;
    fu_err rc = FU_ETIMEDOUT;
    for (int t = 0; t < CLI_SUBMIT_TRIES && rc == FU_ETIMEDOUT; t++)
        rc = cli_conn_call(conn, &h, &sub.base, FUSION__MSG_TYPE__MSG_JOB_STATUS, &m, &code);
    free(spec_txt);
    if (rc != FU_OK) {
        cli_conn_close(&conn);
        return code;
    }
    const Fusion__JobStatus *s = (const Fusion__JobStatus *)wire_msg_body(m);
    uint64_t id = s->job_id;
    char idt[17];
    cli_job_id_format(id, idt);
    printf("%s\n", idt);
    fflush(stdout);
    if (!quiet)
        fprintf(stderr, "submitted job %s (%s)%s%s\n", idt, cli_job_state_name(s->state),
                s->message && s->message[0] ? ": " : "", s->message ? s->message : "");
    wire_msg_destroy(&m);
    code = wait ? cli_wait_job(conn, prog, id, 0, quiet) : FU_EXIT_OK;
    cli_conn_close(&conn);
    return code;
}

static int submit_finetune(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const char *model = NULL, *data = NULL, *method = "lora-fa", *targets = NULL, *idem = NULL;
    long long rank = 8, steps = 100, batch = 4, seq_len = 128, seed = 0, micro = 1, ckpt_every = 10;
    double alpha = 0, lr = 1e-3, wd = 0, verify = -1;
    bool shuffle = false, wait = false, quiet = false;
    const fu_opt opts[] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "Hugging Face model directory, as the broker sees it"},
        {"data", 0, FU_OPT_STR, &data, "FILE", "training text (sent with the job)"},
        {"method", 0, FU_OPT_STR, &method, "M", "lora-fa (default), lora, or salr (needs a pruned model)"},
        {"rank", 0, FU_OPT_INT, &rank, "R", "adapter rank (default 8)"},
        {"alpha", 0, FU_OPT_DOUBLE, &alpha, "A", "adapter alpha; scale = alpha/rank (default 2·rank)"},
        {"targets", 0, FU_OPT_STR, &targets, "LIST", "linears to adapt: q,k,v,o,gate,up,down (default all)"},
        {"lr", 0, FU_OPT_DOUBLE, &lr, "LR", "AdamW learning rate (default 1e-3)"},
        {"weight-decay", 0, FU_OPT_DOUBLE, &wd, "W", "AdamW decoupled weight decay (default 0)"},
        {"steps", 0, FU_OPT_INT, &steps, "N", "optimizer steps (default 100)"},
        {"batch", 0, FU_OPT_INT, &batch, "B", "sequences per step (default 4)"},
        {"seq-len", 0, FU_OPT_INT, &seq_len, "T", "tokens per sequence (default 128)"},
        {"micro-batches", 0, FU_OPT_INT, &micro, "M", "micro-batches per step, dividing B (default 1)"},
        {"checkpoint-every", 0, FU_OPT_INT, &ckpt_every, "K", "checkpoint every K steps (default 10)"},
        {"shuffle", 0, FU_OPT_FLAG, &shuffle, NULL, "visit the windows in a seeded random order"},
        {"seed", 0, FU_OPT_INT, &seed, "S", "seed of the shuffle and the adapter initialisation (default 0)"},
        {"verify", 0, FU_OPT_DOUBLE, &verify, "F",
         "fraction 0..1 of micro-batches the broker re-runs on a second peer (default: the broker's --verify)"},
        {"idempotency-key", 0, FU_OPT_STR, &idem, "KEY", "resubmitting with the same KEY returns the same job"},
        {"wait", 'w', FU_OPT_FLAG, &wait, NULL, "follow the job until it ends"},
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print only the job id"},
        CLI_CONN_OPTS(&co),
    };
    const fu_cmd cmd = {.prog = "fusion submit finetune", .usage = "--model DIR --data FILE [options]",
                        .summary = "Submits a fine-tuning job to the broker and prints its id. The options are "
                                   "those of `fusion run finetune`; the result is the same adapter.",
                        .opts = opts, .n_opts = sizeof opts / sizeof opts[0], .min_pos = 0, .max_pos = 0};
    size_t npos;
    int code;
    if (fu_opts_parse(&cmd, argc, argv, &npos, &code) != FU_OK)
        return code;
    if (!model || !data) {
        fprintf(stderr, "%s: needs --model DIR and --data FILE\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    if (rank <= 0 || steps <= 0 || batch <= 0 || seq_len <= 0 || micro <= 0 || batch % micro || ckpt_every <= 0) {
        fprintf(stderr, "%s: rank, steps, batch, seq-len, micro-batches and checkpoint-every must be positive, "
                        "and micro-batches must divide batch\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    if (verify != -1 && !(verify >= 0 && verify <= 1)) {
        fprintf(stderr, "%s: --verify must be a fraction between 0 and 1 (0 turns verification off)\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    char *text = NULL;
    size_t text_len = 0;
    fu_errmsg em = {0};
    fu_err rc = fu_file_read_all(data, CLI_MAX_INLINE_BYTES, &text, &text_len, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", cmd.prog, fu_errmsg_text(&em, rc));
        return FU_EXIT_USAGE;
    }
    cJSON *spec = cJSON_CreateObject();
    cJSON_AddStringToObject(spec, "model", model_path(model));
    cJSON_AddStringToObject(spec, "method", method);
    cJSON_AddNumberToObject(spec, "rank", (double)rank);
    cJSON_AddNumberToObject(spec, "alpha", alpha > 0 ? alpha : 2.0 * (double)rank);
    if (targets)
        cJSON_AddStringToObject(spec, "targets", targets);
    cJSON_AddNumberToObject(spec, "lr", lr);
    cJSON_AddNumberToObject(spec, "weight_decay", wd);
    cJSON_AddNumberToObject(spec, "steps", (double)steps);
    cJSON_AddNumberToObject(spec, "batch", (double)batch);
    cJSON_AddNumberToObject(spec, "seq_len", (double)seq_len);
    cJSON_AddNumberToObject(spec, "micro_batches", (double)micro);
    cJSON_AddNumberToObject(spec, "checkpoint_every", (double)ckpt_every);
    cJSON_AddBoolToObject(spec, "shuffle", shuffle);
    cJSON_AddNumberToObject(spec, "seed", (double)seed);
    if (verify >= 0)
        cJSON_AddNumberToObject(spec, "verify", verify);
    code = submit_and_follow(cmd.prog, &co, FUSION__JOB_KIND__JOB_KIND_FINETUNE, spec, (const uint8_t *)text, text_len, idem, wait,
                             quiet);
    free(text);
    return code;
}

static int submit_infer(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const char *model = NULL, *adapter_job = NULL, *prompt = NULL, *prompt_tokens = NULL, *idem = NULL;
    long long max_tokens = 64, top_k = 0, seed = 0;
    double temperature = 0, top_p = 1;
    bool wait = false, quiet = false, dump_logits = false;
    const fu_opt opts[] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "Hugging Face model directory, as the broker sees it"},
        {"adapter-job", 0, FU_OPT_STR, &adapter_job, "JOB", "use the adapter a finished fine-tune job made"},
        {"prompt", 0, FU_OPT_STR, &prompt, "TEXT", "prompt text"},
        {"prompt-tokens", 0, FU_OPT_STR, &prompt_tokens, "IDS", "prompt as comma-separated token ids"},
        {"max-tokens", 0, FU_OPT_INT, &max_tokens, "N", "tokens to generate (default 64)"},
        {"temperature", 0, FU_OPT_DOUBLE, &temperature, "T", "sampling temperature; 0 = greedy (default 0)"},
        {"top-k", 0, FU_OPT_INT, &top_k, "K", "sample among the K most likely tokens (default 0: all)"},
        {"top-p", 0, FU_OPT_DOUBLE, &top_p, "P", "nucleus sampling threshold (default 1: off)"},
        {"seed", 0, FU_OPT_INT, &seed, "S", "sampling seed (default 0)"},
        {"dump-logits", 0, FU_OPT_FLAG, &dump_logits, NULL, "keep the prompt's logits in the job's result"},
        {"idempotency-key", 0, FU_OPT_STR, &idem, "KEY", "resubmitting with the same KEY returns the same job"},
        {"wait", 'w', FU_OPT_FLAG, &wait, NULL, "stream the generated text until the job ends"},
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print only the job id and the text"},
        CLI_CONN_OPTS(&co),
    };
    const fu_cmd cmd = {.prog = "fusion submit infer", .usage = "--model DIR (--prompt TEXT | --prompt-tokens IDS) [options]",
                        .summary = "Submits a generation job to the broker; with --wait the text streams back as "
                                   "the pipeline generates it.",
                        .opts = opts, .n_opts = sizeof opts / sizeof opts[0], .min_pos = 0, .max_pos = 0};
    size_t npos;
    int code;
    if (fu_opts_parse(&cmd, argc, argv, &npos, &code) != FU_OK)
        return code;
    if (!model || (!prompt == !prompt_tokens) || max_tokens <= 0) {
        fprintf(stderr, "%s: needs --model DIR, exactly one of --prompt and --prompt-tokens, and a positive "
                        "--max-tokens\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    uint64_t aid = 0;
    if (adapter_job && cli_job_arg(cmd.prog, adapter_job, &aid) != FU_OK)
        return FU_EXIT_USAGE;
    cJSON *spec = cJSON_CreateObject();
    cJSON_AddStringToObject(spec, "model", model_path(model));
    if (adapter_job) {
        char idt[17];
        cli_job_id_format(aid, idt);
        cJSON_AddStringToObject(spec, "adapter_job", idt);
    }
    if (prompt_tokens) {
        cJSON *arr = cJSON_AddArrayToObject(spec, "prompt_tokens");
        for (const char *p = prompt_tokens; *p;) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
                fprintf(stderr, "%s: --prompt-tokens wants comma-separated token ids, got '%s'\n", cmd.prog,
                        prompt_tokens);
                cJSON_Delete(spec);
                return FU_EXIT_USAGE;
            }
            cJSON_AddItemToArray(arr, cJSON_CreateNumber((double)v));
            p = *end ? end + 1 : end;
        }
    }
    cJSON_AddNumberToObject(spec, "max_tokens", (double)max_tokens);
    cJSON_AddNumberToObject(spec, "temperature", temperature);
    cJSON_AddNumberToObject(spec, "top_k", (double)top_k);
    cJSON_AddNumberToObject(spec, "top_p", top_p);
    cJSON_AddNumberToObject(spec, "seed", (double)seed);
    cJSON_AddBoolToObject(spec, "dump_logits", dump_logits);
    return submit_and_follow(cmd.prog, &co, FUSION__JOB_KIND__JOB_KIND_INFER, spec, (const uint8_t *)prompt,
                             prompt ? strlen(prompt) : 0, idem, wait, quiet);
}

int cli_submit_main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "finetune") == 0)
        return submit_finetune(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "infer") == 0)
        return submit_infer(argc - 1, argv + 1);
    bool help = argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0);
    fprintf(help ? stdout : stderr,
            "Usage: fusion submit finetune|infer [options]\n\n"
            "  finetune   fine-tune an adapter through the broker's pipeline (options of `fusion run finetune`)\n"
            "  infer      generate text through the pipeline; --wait streams it\n\n"
            "Run 'fusion submit finetune --help' for the options.\n");
    return help ? FU_EXIT_OK : FU_EXIT_USAGE;
}
