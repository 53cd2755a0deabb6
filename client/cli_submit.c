/* `fusion submit finetune|infer`: sends a job to the broker. The submission carries an idempotency
 * key (random unless --idempotency-key is given) and is retried with the same key when no answer
 * comes, so a retry never makes a second job. With --wait it then follows the job like `fusion wait`. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "cli.h"
#include "cli_jobs.h"
#include "cli_upload.h"
#include "dag_spec.h"
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

/* The spec (dag_spec) as the broker will read it: the model path made absolute when it exists here. */
static char *spec_json(dag_spec *spec)
{
    const char *model = model_path(spec->model);
    size_t n = strlen(model);
    if (model != spec->model && n < sizeof spec->model) /* else the path as given */
        memcpy(spec->model, model, n + 1);
    return dag_spec_to_json(spec);
}

/* Uploads the spec's model first when asked (the spec then names the broker's copy), sends the
 * submission (retrying with the same key), prints the job id, optionally waits. */
static int submit_and_follow(const char *prog, const cli_conn_opts *co, Fusion__JobKind kind, dag_spec *spec,
                             bool upload, const uint8_t *data, size_t data_len, const char *idem, bool wait,
                             bool quiet)
{
    char key[33];
    if (!idem) {
        uint8_t raw[16];
        randombytes_buf(raw, sizeof raw);
        fu_hex_encode(key, raw, sizeof raw);
        idem = key;
    }
    cli_conn_t *conn = NULL;
    int code = FU_EXIT_OK;
    if (cli_conn_open(prog, co, &conn, &code) != FU_OK)
        return code;
    char local[sizeof spec->model];
    snprintf(local, sizeof local, "%s", spec->model);
    if (upload) {
        char name[CLI_UPLOAD_NAME_MAX] = "";
        cli_upload_report rep;
        if (cli_upload_model(conn, prog, spec->model, quiet, name, &rep, &code) != FU_OK) {
            cli_conn_close(&conn);
            return code;
        }
        if (!quiet)
            fprintf(stderr, "model %s is %s on the broker (%u of %u chunks sent, %.1f MiB)\n", local, name, rep.sent,
                    rep.chunks, (double)rep.bytes_sent / 1048576.0);
        snprintf(spec->model, sizeof spec->model, "%s", name);
    }
    char *spec_txt = upload ? dag_spec_to_json(spec) : spec_json(spec);
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
        if (code == FU_EXIT_NOTFOUND && !upload && fu_path_is_dir(local))
            fprintf(stderr, "%s: '%s' is a model directory here: add --upload to send it to the broker\n", prog,
                    local);
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
    const char *model = NULL, *data = NULL, *idem = NULL;
    bool wait = false, quiet = false, upload = false;
    dag_spec_cli sc;
    fu_opt opts[DAG_SPEC_CLI_MAX_OPTS + 12] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "Hugging Face model directory, as the broker sees it"},
        {"upload", 0, FU_OPT_FLAG, &upload, NULL, "send the model directory (here) to the broker first, by content"},
        {"data", 0, FU_OPT_STR, &data, "FILE", "training text (sent with the job)"},
        {"idempotency-key", 0, FU_OPT_STR, &idem, "KEY", "resubmitting with the same KEY returns the same job"},
        {"wait", 'w', FU_OPT_FLAG, &wait, NULL, "follow the job until it ends"},
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print only the job id"},
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
    fu_errmsg em = {0};
    char *text = NULL;
    size_t text_len = 0;
    fu_err rc = fu_file_read_all(data, CLI_MAX_INLINE_BYTES, &text, &text_len, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", cmd.prog, fu_errmsg_text(&em, rc));
        return FU_EXIT_USAGE;
    }
    code = submit_and_follow(cmd.prog, &co, FUSION__JOB_KIND__JOB_KIND_FINETUNE, &spec, upload, (const uint8_t *)text,
                             text_len, idem, wait, quiet);
    dag_spec_clear(&spec);
    free(text);
    return code;
}

static int submit_infer(int argc, char **argv)
{
    cli_conn_opts co = {0};
    const char *model = NULL, *adapter_job = NULL, *prompt = NULL, *idem = NULL;
    bool wait = false, quiet = false, dump_logits = false, upload = false;
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
        CLI_CONN_OPTS(&co),
    };
    fu_cmd cmd = {.prog = "fusion submit infer",
                  .usage = "--model DIR (--prompt TEXT | --prompt-tokens IDS) [options]",
                  .summary = "Submits a generation job to the broker; with --wait the text streams back as "
                             "the pipeline generates it."};
    int code;
    if (dag_spec_cli_parse(&sc, DAG_JOB_INFER, 0, &cmd, opts, sizeof opts / sizeof opts[0], argc, argv,
                           &code) != FU_OK)
        return code;
    if (!model || (!prompt == !sc.prompt_tokens)) {
        fprintf(stderr, "%s: needs --model DIR and exactly one of --prompt and --prompt-tokens\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    uint64_t aid = 0;
    if (adapter_job && cli_job_arg(cmd.prog, adapter_job, &aid) != FU_OK)
        return FU_EXIT_USAGE;
    dag_spec spec;
    if (dag_spec_from_cmd(&sc, &cmd, DAG_JOB_INFER, model, &spec, &code) != FU_OK)
        return code;
    if (adapter_job)
        cli_job_id_format(aid, spec.adapter_job);
    spec.dump_logits = dump_logits;
    code = submit_and_follow(cmd.prog, &co, FUSION__JOB_KIND__JOB_KIND_INFER, &spec, upload, (const uint8_t *)prompt,
                             prompt ? strlen(prompt) : 0, idem, wait, quiet);
    dag_spec_clear(&spec);
    return code;
}

int cli_submit_main(int argc, char **argv)
{
    static const cli_sub subs[] = {{"finetune", submit_finetune}, {"infer", submit_infer}};
    int code =
        argc >= 2 ? cli_sub_dispatch("fusion submit", subs, sizeof subs / sizeof subs[0], argc, argv) : -1;
    if (code >= 0)
        return code;
    bool help = argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0);
    fprintf(help ? stdout : stderr,
            "Usage: fusion submit finetune|infer [options]\n\n"
            "  finetune   fine-tune an adapter through the broker's pipeline (options of `fusion run finetune`)\n"
            "  infer      generate text through the pipeline; --wait streams it\n\n"
            "Run 'fusion submit finetune --help' for the options.\n");
    return help ? FU_EXIT_OK : FU_EXIT_USAGE;
}
