/* `fusion submit finetune|infer`: sends a job to the broker. The submission carries an idempotency
 * key (random unless --idempotency-key is given) and is retried with the same key when no answer
 * comes, so a retry never makes a second job. With --wait it then follows the job like `fusion wait`. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "cli.h"
#include "cli_jobs.h"
#include "cli_upload.h"
#include "dag_spec.h"
#include "fu_alloc.h"
#include "fu_encode.h"
#include "fu_file.h"

#define CLI_MAX_INLINE_BYTES (24u << 20)     /* training text carried inside the submission */

/* A model directory the broker will read: made absolute when it exists here (loopback clusters),
 * passed as given otherwise (a path on the broker's machine). Static storage. */
static const char *model_path(const char *dir)
{
    static char abs[PATH_MAX];
    return realpath(dir, abs) ? abs : dir;
}

/* The spec (dag_spec) as the broker will read it: the model path made absolute when it exists here. */
static char *spec_json(dag_spec *spec)
{
    const char *model = model_path(spec->model);
    size_t n = strlen(model);
    if (model != spec->model && n < sizeof spec->model) /* else the path as given */
        memcpy(spec->model, model, n + 1);
    return dag_spec_to_json(spec);
}

/* The job's data file into *text (at most CLI_MAX_INLINE_BYTES); false with a message. */
/* Reads the --data file; on failure says why and returns its exit code (4: no such file). */
static int read_data(const char *prog, const char *path, char **text, size_t *len)
{
    fu_errmsg em = {0};
    fu_err rc = fu_file_read_all(path, CLI_MAX_INLINE_BYTES, text, len, &em);
    if (rc != FU_OK)
        fprintf(stderr, "%s: %s\n", prog, fu_errmsg_text(&em, rc));
    return fu_exit_for(rc);
}

/* Uploads the spec's model first when asked (the spec then names the broker's copy) and sends the
 * submission over conn (retrying with the same key): the job's id in *id, printed on stdout when
 * print_id. On failure the message is printed and the exit code returned in *code. */
static fu_err submit_on(cli_conn_t *conn, const char *prog, Fusion__JobKind kind, dag_spec *spec, bool upload,
                        const uint8_t *data, size_t data_len, const char *idem, bool quiet, bool print_id, bool json,
                        uint64_t *id, int *code)
{
    char key[33];
    if (!idem) {
        uint8_t raw[16];
        randombytes_buf(raw, sizeof raw);
        fu_hex_encode(key, raw, sizeof raw);
        idem = key;
    }
    char local[sizeof spec->model];
    snprintf(local, sizeof local, "%s", spec->model);
    if (upload) {
        char name[CLI_UPLOAD_NAME_MAX] = "";
        cli_upload_report rep;
        FU_TRY(cli_upload_model(conn, prog, spec->model, quiet, name, &rep, code));
        if (!quiet)
            fprintf(stderr, "model %s is %s on the broker (%u of %u chunks sent, %.1f MiB)\n", local, name, rep.sent,
                    rep.chunks, (double)rep.bytes_sent / 1048576.0);
        snprintf(spec->model, sizeof spec->model, "%s", name);
    }
    char *spec_txt = upload ? dag_spec_to_json(spec) : spec_json(spec);
    wire_msg_t *m = NULL;
    fu_err rc = cli_job_submit(conn, kind, spec_txt, data, data_len, idem, &m, code);
    free(spec_txt);
    if (rc != FU_OK) {
        if (*code == FU_EXIT_NOTFOUND && !upload && fu_path_is_dir(local))
            fprintf(stderr, "%s: '%s' is a model directory here: add --upload to send it to the broker\n", prog,
                    local);
        return rc;
    }
    const Fusion__JobStatus *s = (const Fusion__JobStatus *)wire_msg_body(m);
    *id = s->job_id;
    char idt[17];
    cli_job_id_format(*id, idt);
    if (print_id && json)
        cli_print_status_json(s);
    else if (print_id)
        printf("%s\n", idt);
    fflush(stdout);
    if (!quiet) {
        char ver[96];
        cli_job_verify_text(s, ver, sizeof ver);
        fprintf(stderr, "submitted job %s (%s)%s%s%s%s\n", idt, cli_job_state_name(s->state),
                s->message && s->message[0] ? ": " : "", s->message ? s->message : "", ver[0] ? "; " : "", ver);
    }
    wire_msg_destroy(&m);
    return FU_OK;
}

/* submit_on over a connection of its own; prints the job id, optionally waits. */
static int submit_and_follow(const char *prog, const cli_conn_opts *co, Fusion__JobKind kind, dag_spec *spec,
                             bool upload, const uint8_t *data, size_t data_len, const char *idem, bool wait,
                             bool quiet, bool json)
{
    cli_conn_t *conn = NULL;
    int code = FU_EXIT_OK;
    if (cli_conn_open(prog, co, &conn, &code) != FU_OK)
        return code;
    uint64_t id = 0;
    /* --json: the status as submitted, or with --wait the last one, and nothing else on stdout */
    if (submit_on(conn, prog, kind, spec, upload, data, data_len, idem, quiet || json, !(json && wait), json, &id,
                  &code) == FU_OK)
        code = wait ? cli_wait_job(conn, prog, id, 0, quiet, json) : FU_EXIT_OK;
    cli_conn_close(&conn);
    return code;
}

static int submit_finetune(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const char *model = NULL, *data = NULL, *idem = NULL;
    bool wait = false, quiet = false, upload = false, json = false;
    dag_spec_cli sc;
    fu_opt opts[DAG_SPEC_CLI_MAX_OPTS + 12] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "Hugging Face model directory, as the broker sees it"},
        {"upload", 0, FU_OPT_FLAG, &upload, NULL, "send the model directory (here) to the broker first, by content"},
        {"data", 0, FU_OPT_STR, &data, "FILE", "training text (sent with the job)"},
        {"idempotency-key", 0, FU_OPT_STR, &idem, "KEY", "resubmitting with the same KEY returns the same job"},
        {"wait", 'w', FU_OPT_FLAG, &wait, NULL, "follow the job until it ends"},
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print only the job id"},
        {"json", 0, FU_OPT_FLAG, &json, NULL, "print the job's status as JSON (with --wait: its last one)"},
        CLI_CONN_OPTS(&co),
    };
    fu_cmd cmd = {.prog = "fusion submit finetune",
                  .usage = "--model DIR --data FILE [options]",
                  .summary = "Submits a fine-tuning job to the broker and prints its id. The options are "
                             "those of `fusion run finetune`; the result is the same adapter."};
    int code;
    if (dag_spec_cli_parse(&sc, DAG_JOB_FINETUNE, DAG_SPEC_CLI_PIPELINE, &cmd, opts,
                           sizeof opts / sizeof opts[0], argc, argv, &code) != FU_OK)
        return code;
    if (!model || !data) {
        fprintf(stderr, "%s: needs --model DIR and --data FILE\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    dag_spec spec;
    if (dag_spec_from_cmd(&sc, &cmd, DAG_JOB_FINETUNE, model, &spec, &code) != FU_OK)
        return code;
    char *text = NULL;
    size_t text_len = 0;
    if ((code = read_data(cmd.prog, data, &text, &text_len)) != FU_EXIT_OK) {
        dag_spec_clear(&spec);
        return code;
    }
    code = submit_and_follow(cmd.prog, &co, FUSION__JOB_KIND__JOB_KIND_FINETUNE, &spec, upload, (const uint8_t *)text,
                             text_len, idem, wait, quiet, json);
    dag_spec_clear(&spec);
    free(text);
    return code;
}

static int submit_infer(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const char *model = NULL, *adapter_job = NULL, *prompt = NULL, *idem = NULL;
    bool wait = false, quiet = false, dump_logits = false, upload = false, json = false;
    dag_spec_cli sc;
    fu_opt opts[DAG_SPEC_CLI_MAX_OPTS + 12] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "Hugging Face model directory, as the broker sees it"},
        {"upload", 0, FU_OPT_FLAG, &upload, NULL, "send the model directory (here) to the broker first, by content"},
        {"adapter-job", 0, FU_OPT_STR, &adapter_job, "JOB", "use the adapter a finished fine-tune job made"},
        {"prompt", 0, FU_OPT_STR, &prompt, "TEXT", "prompt text"},
        {"dump-logits", 0, FU_OPT_FLAG, &dump_logits, NULL, "keep the prompt's logits in the job's result"},
        {"idempotency-key", 0, FU_OPT_STR, &idem, "KEY", "resubmitting with the same KEY returns the same job"},
        {"wait", 'w', FU_OPT_FLAG, &wait, NULL, "stream the generated text until the job ends"},
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print only the job id and the text"},
        {"json", 0, FU_OPT_FLAG, &json, NULL, "print the job's status as JSON (with --wait: its last one, text included)"},
        CLI_CONN_OPTS(&co),
    };
    fu_cmd cmd = {.prog = "fusion submit infer",
                  .usage = "--model DIR (--prompt TEXT | --prompt-tokens IDS | --sessions N) [options]",
                  .summary = "Submits a generation job to the broker; with --wait the text streams back as "
                             "the pipeline generates it. With --sessions N it is a serving job instead: it "
                             "holds up to N generations at once, opened with `fusion ask JOB`, and runs "
                             "until cancelled."};
    int code;
    if (dag_spec_cli_parse(&sc, DAG_JOB_INFER, DAG_SPEC_CLI_PIPELINE, &cmd, opts, sizeof opts / sizeof opts[0],
                           argc, argv, &code) != FU_OK)
        return code;
    if (!model) {
        fprintf(stderr, "%s: needs --model DIR\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    uint64_t aid = 0;
    if (adapter_job && cli_job_arg(cmd.prog, adapter_job, &aid) != FU_OK)
        return FU_EXIT_USAGE;
    dag_spec spec;
    if (dag_spec_from_cmd(&sc, &cmd, DAG_JOB_INFER, model, &spec, &code) != FU_OK)
        return code;
    if (spec.sessions ? prompt || sc.prompt_tokens || dump_logits : !prompt == !sc.prompt_tokens) {
        fprintf(stderr, spec.sessions ? "%s: a serving job (--sessions) takes its prompts from `fusion ask`: no "
                                        "--prompt, --prompt-tokens or --dump-logits\n"
                                      : "%s: needs exactly one of --prompt and --prompt-tokens (or --sessions N)\n",
                cmd.prog);
        dag_spec_clear(&spec);
        return FU_EXIT_USAGE;
    }
    if (adapter_job)
        cli_job_id_format(aid, spec.adapter_job);
    spec.dump_logits = dump_logits;
    code = submit_and_follow(cmd.prog, &co, FUSION__JOB_KIND__JOB_KIND_INFER, &spec, upload, (const uint8_t *)prompt,
                             prompt ? strlen(prompt) : 0, idem, wait, quiet, json);
    dag_spec_clear(&spec);
    return code;
}

/* ---- eval ----------------------------------------------------------------------------------- */

/* What an eval takes on the command line (`fusion submit eval`, `fusion eval --pipeline`). */
typedef struct {
    cli_conn_opts co;
    const char *model, *data, *adapter_job, *idem, *trusted_ends, *wire_codec;
    double heldout;
    long long seq_len, batch, micro_batches;
    bool byte_tokens, wait, quiet, upload, json, pipeline;
} eval_args;

#define EVAL_OPTS(a)                                                                                              \
    {"model", 0, FU_OPT_STR, &(a)->model, "DIR", "Hugging Face model directory, as the broker sees it"},          \
    {"data", 0, FU_OPT_STR, &(a)->data, "FILE", "text or JSON Lines, as the fine-tune read it"},                  \
    {"adapter-job", 0, FU_OPT_STR, &(a)->adapter_job, "JOB", "with the adapter this finished fine-tune made"},    \
    {"heldout", 0, FU_OPT_DOUBLE, &(a)->heldout, "F",                                                             \
     "the held-out fraction the fine-tune kept out (its --heldout; default 0.1; 0: all the data)"},               \
    {"seq-len", 0, FU_OPT_INT, &(a)->seq_len, "T", "tokens per window (the fine-tune's; default 128)"},           \
    {"batch", 0, FU_OPT_INT, &(a)->batch, "B", "windows per step (default 8)"},                                   \
    {"micro-batches", 0, FU_OPT_INT, &(a)->micro_batches, "M", "micro-batches per step, dividing B (default 1)"}, \
    {"byte-tokens", 0, FU_OPT_FLAG, &(a)->byte_tokens, NULL, "a model of more ids without tokenizer.json: bytes"}, \
    {"trusted-ends", 0, FU_OPT_STR, &(a)->trusted_ends, "on|off", "the first and last stages on trusted peers"},  \
    {"wire-codec", 0, FU_OPT_STR, &(a)->wire_codec, "C", "activations between stages: f32, f16, bf16 or int8"},  \
    {"upload", 0, FU_OPT_FLAG, &(a)->upload, NULL, "send the model directory (here) to the broker first"},        \
    {"quiet", 'q', FU_OPT_FLAG, &(a)->quiet, NULL, "print only the result"}, CLI_CONN_OPTS(&(a)->co)

static void eval_defaults(eval_args *a)
{
    memset(a, 0, sizeof *a);
    a->heldout = 0.1;
    a->seq_len = 128;
    a->batch = 8;
    a->micro_batches = 1;
}

/* The eval's spec from a, checked (the broker sets its steps from the data). */
static int eval_spec(const char *prog, const eval_args *a, const char *adapter_job, dag_spec *spec)
{
    dag_spec_init(spec, DAG_JOB_EVAL);
    uint64_t aid = 0;
    if (adapter_job && cli_job_arg(prog, adapter_job, &aid) != FU_OK)
        return FU_EXIT_USAGE;
    if (adapter_job)
        cli_job_id_format(aid, spec->adapter_job);
    if (strlen(a->model) >= sizeof spec->model) {
        fprintf(stderr, "%s: --model is too long\n", prog);
        return FU_EXIT_USAGE;
    }
    snprintf(spec->model, sizeof spec->model, "%s", a->model);
    if (!(a->heldout >= 0 && a->heldout <= 0.5) || a->seq_len < 1 || a->seq_len > 65536 || a->batch < 1 ||
        a->batch > 65536 || a->micro_batches < 1 || a->micro_batches > 64) {
        fprintf(stderr, "%s: --heldout must be 0..0.5, --seq-len 1..65536, --batch 1..65536, --micro-batches 1..64\n",
                prog);
        return FU_EXIT_USAGE;
    }
    spec->heldout = a->heldout;
    spec->seq_len = (uint32_t)a->seq_len;
    spec->batch = (uint32_t)a->batch;
    spec->micro_batches = (uint32_t)a->micro_batches;
    spec->byte_tokens = a->byte_tokens;
    if (a->trusted_ends && strcmp(a->trusted_ends, "on") != 0 && strcmp(a->trusted_ends, "off") != 0) {
        fprintf(stderr, "%s: --trusted-ends must be on or off\n", prog);
        return FU_EXIT_USAGE;
    }
    if (a->trusted_ends)
        spec->trusted_ends = strcmp(a->trusted_ends, "on") == 0;
    if (a->wire_codec && (kern_codec_parse(a->wire_codec, &spec->act_codec) != FU_OK ||
                          spec->act_codec == KERN_CODEC_INT8_EF)) {
        fprintf(stderr, "%s: --wire-codec must be f32, f16, bf16 or int8 (an eval sends no gradients)\n", prog);
        return FU_EXIT_USAGE;
    }
    fu_errmsg em = {{0}};
    if (dag_spec_check(spec, &em) != FU_OK) {
        fprintf(stderr, "%s: %s\n", prog, em.msg);
        return FU_EXIT_USAGE;
    }
    return FU_EXIT_OK;
}

static int submit_eval(int argc, char **argv)
{
    eval_args a;
    eval_defaults(&a);
    const fu_opt opts[] = {
        EVAL_OPTS(&a),
        {"idempotency-key", 0, FU_OPT_STR, &a.idem, "KEY", "resubmitting with the same KEY returns the same job"},
        {"wait", 'w', FU_OPT_FLAG, &a.wait, NULL, "follow the job; print its result (JSON) when done"},
        {"json", 0, FU_OPT_FLAG, &a.json, NULL, "print the job's status as JSON (with --wait: its last one, the "
                                                 "result in its \"output\")"},
    };
    const fu_cmd cmd = {.prog = argv[0],
                        .usage = "--model DIR --data FILE [--adapter-job JOB] [options]",
                        .summary = "Submits an eval: the loss and perplexity of the model (with a finished fine-tune's "
                                   "adapter when given) on held-out data, forward only through the broker's pipeline. "
                                   "The result is JSON (`fusion wait`, `fusion result`).",
                        FU_OPTS_TABLE(opts)};
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!a.model || !a.data)
        return fu_opts_usage_error(&cmd, "--model and --data are required");
    dag_spec spec;
    if ((code = eval_spec(cmd.prog, &a, a.adapter_job, &spec)) != FU_EXIT_OK)
        return code;
    char *text = NULL;
    size_t text_len = 0;
    if ((code = read_data(cmd.prog, a.data, &text, &text_len)) != FU_EXIT_OK)
        return code;
    code = submit_and_follow(cmd.prog, &a.co, FUSION__JOB_KIND__JOB_KIND_EVAL, &spec, a.upload, (const uint8_t *)text,
                             text_len, a.idem, a.wait, a.quiet, a.json);
    dag_spec_clear(&spec);
    free(text);
    return code;
}

/* A finished eval's result: the numbers of its JSON. */
static bool eval_numbers(const char *json, double *loss, long long *targets, char *part, size_t cap)
{
    cJSON *o = cJSON_Parse(json);
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(o, "loss"), *t = cJSON_GetObjectItemCaseSensitive(o, "targets"),
                *d = cJSON_GetObjectItemCaseSensitive(o, "data");
    bool ok = cJSON_IsNumber(l) && cJSON_IsNumber(t) && cJSON_IsString(d);
    if (ok) {
        *loss = l->valuedouble;
        *targets = (long long)t->valuedouble;
        snprintf(part, cap, "%s", d->valuestring);
    }
    cJSON_Delete(o);
    return ok;
}

int cli_eval_pipeline_main(int argc, char **argv)
{
    eval_args a;
    eval_defaults(&a);
    const fu_opt opts[] = {
        EVAL_OPTS(&a),
        {"pipeline", 0, FU_OPT_FLAG, &a.pipeline, NULL, "through the broker's pipeline (this command)"},
        {"json", 0, FU_OPT_FLAG, &a.json, NULL, "print one JSON object"},
    };
    const fu_cmd cmd = {.prog = "fusion eval --pipeline",
                        .usage = "--pipeline --model DIR --data FILE [--adapter-job JOB] [options]",
                        .summary = "`fusion eval` through the broker: the perplexity of the base model and, with "
                                   "--adapter-job, of base plus that fine-tune's adapter, each an eval job on the "
                                   "peers (forward only). Prints what `fusion eval` prints.",
                        FU_OPTS_TABLE(opts)};
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!a.model || !a.data)
        return fu_opts_usage_error(&cmd, "--model and --data are required");
    dag_spec spec[2];
    int n = a.adapter_job ? 2 : 1;
    for (int k = 0; k < n; k++)
        if ((code = eval_spec(cmd.prog, &a, k ? a.adapter_job : NULL, &spec[k])) != FU_EXIT_OK)
            return code;
    char *text = NULL;
    size_t text_len = 0;
    if ((code = read_data(cmd.prog, a.data, &text, &text_len)) != FU_EXIT_OK)
        return code;
    cli_conn_t *conn = NULL;
    if (cli_conn_open(cmd.prog, &a.co, &conn, &code) != FU_OK) {
        free(text);
        return code;
    }
    uint64_t id[2] = {0, 0};
    double loss[2] = {NAN, NAN};
    long long targets[2] = {0, 0};
    char part[2][32] = {"", ""};
    code = FU_EXIT_OK;
    for (int k = 0; k < n && code == FU_EXIT_OK; k++) /* both submitted first: they may run side by side */
        if (submit_on(conn, cmd.prog, FUSION__JOB_KIND__JOB_KIND_EVAL, &spec[k], a.upload && k == 0,
                      (const uint8_t *)text, text_len, NULL, true, false, false, &id[k], &code) == FU_OK && a.upload && n == 2)
            snprintf(spec[1].model, sizeof spec[1].model, "%s", spec[0].model); /* the uploaded name */
    for (int k = 0; k < n && code == FU_EXIT_OK; k++) {
        char *out = NULL;
        if (cli_job_output(conn, cmd.prog, id[k], &out, &code) != FU_OK)
            break;
        if (!eval_numbers(out, &loss[k], &targets[k], part[k], sizeof part[k])) {
            fprintf(stderr, "%s: the eval job's result is not what an eval gives: %.200s\n", cmd.prog, out);
            code = FU_EXIT_FAIL;
        }
        free(out);
    }
    cli_conn_close(&conn);
    free(text);
    for (int k = 0; k < n; k++)
        dag_spec_clear(&spec[k]);
    if (code != FU_EXIT_OK)
        return code;
    if (a.json)
        printf("{\"data\":\"%s\",\"targets\":%lld,\"base_loss\":%.6f,\"base_perplexity\":%.6f%s", part[0], targets[0],
               loss[0], exp(loss[0]), n == 2 ? "," : "}\n");
    else
        printf("%s data: %lld targets; base: loss %.4f, perplexity %.3f", part[0], targets[0], loss[0], exp(loss[0]));
    if (n == 2 && a.json)
        printf("\"adapter_loss\":%.6f,\"adapter_perplexity\":%.6f}\n", loss[1], exp(loss[1]));
    else if (n == 2)
        printf("; with the adapter: loss %.4f, perplexity %.3f\n", loss[1], exp(loss[1]));
    else if (!a.json)
        putchar('\n');
    return FU_EXIT_OK;
}

int cli_submit_main(int argc, char **argv)
{
    static const cli_sub subs[] = {{"finetune", submit_finetune}, {"infer", submit_infer}, {"eval", submit_eval}};
    int code =
        argc >= 2 ? cli_sub_dispatch("fusion submit", subs, sizeof subs / sizeof subs[0], argc, argv) : -1;
    if (code >= 0)
        return code;
    bool help = argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0);
    fprintf(help ? stdout : stderr,
            "Usage: fusion submit finetune|infer|eval [options]\n\n"
            "  finetune   fine-tune an adapter through the broker's pipeline (options of `fusion run finetune`)\n"
            "  infer      generate text through the pipeline; --wait streams it\n"
            "  eval       the loss on held-out data, base or with a finished fine-tune's adapter\n\n"
            "Run 'fusion submit finetune --help' for the options.\n");
    return help ? FU_EXIT_OK : FU_EXIT_USAGE;
}
