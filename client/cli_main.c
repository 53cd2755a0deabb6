/* `fusion`: the client CLI. Dispatches to one subcommand; subcommands whose capability has not
 * landed yet say which one is missing and exit FU_EXIT_USAGE. */
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "cli.h"
#include "cli_upload.h"
#include "fu_opts.h"

typedef struct {
    const char *name;       /* subcommand as typed */
    const char *summary;    /* one line for `fusion --help` */
    cli_main_fn main;       /* NULL while its capability has not landed */
    const char *capability; /* the issue that brings it, for the "not yet" message */
} cli_subcommand;

static const cli_subcommand subcommands[] = {
    {"keygen", "make a CURVE key pair (public.key, secret.key) in a directory", cli_keygen_main, "The wire"},
    {"model", "make (init) or prune (prune --method salr) a Hugging Face model directory", cli_model_main,
     "Models and the DAG"},
    {"run", "fine-tune (run finetune) or generate (run infer) in this process, no broker", cli_run_main,
     "Models and the DAG"},
    {"submit", "submit a finetune or infer job to a broker", cli_submit_main, "End to end: client CLI"},
    {"upload", "send a model directory to the broker by content (only what it lacks)", cli_upload_main,
     "End to end: client CLI"},
    {"status", "show one job, or all of yours", cli_status_main, "End to end: client CLI"},
    {"jobs", "list your jobs", cli_jobs_main, "End to end: client CLI"},
    {"wait", "follow a job until it ends, with a progress bar", cli_wait_main, "End to end: client CLI"},
    {"result", "download a finished job's adapter (PEFT format)", cli_result_main, "End to end: client CLI"},
    {"cancel", "cancel one of your jobs", cli_cancel_main, "End to end: client CLI"},
    {"ask", "one generation in a serving job (submit infer --sessions N), its text streamed", cli_ask_main,
     "Serving"},
    {"peers", "list the broker's peers: device, speed, memory, state, stage", cli_peers_main, "End to end: client CLI"},
    {"http-token", "the bearer token of your key for the broker's HTTP API (--http)", cli_http_token_main,
     "Operate and serve"},
    {"serve", "an OpenAI-compatible endpoint (/v1/chat/completions) that runs requests on the broker",
     cli_serve_main, "Operate and serve"},
    {"eval", "perplexity of a model, with and without an adapter, on held-out data", cli_eval_main, "Data"},
    {"tokenize", "encode text to token ids with a model's tokenizer, or decode ids (--decode)", cli_tokenize_main,
     "Tokenizers"},
};
#define N_SUB (sizeof subcommands / sizeof subcommands[0])

static void print_help(void)
{
    printf("Usage: fusion COMMAND [options]\n\n"
           "fusion pools GPUs and CPUs to fine-tune and serve LLMs with LoRA-FA and SALR adapters.\n"
           "This is the client: it talks to a fusion-broker, or runs a job in-process with `fusion run`.\n\n"
           "Commands:\n");
    for (size_t i = 0; i < N_SUB; i++)
        printf("  %-10s %s%s\n", subcommands[i].name, subcommands[i].summary,
               subcommands[i].main ? "" : " [not in this build yet]");
    printf("\nRun 'fusion COMMAND --help' for a command's options.\n"
           "Exit codes: 0 ok, 1 failed, 2 usage or missing capability, 3 refused, 4 not found, 5 timed out.\n");
}

bool cli_help_asked(int argc, char **argv)
{
    return argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
           strcmp(argv[1], "help") == 0;
}

int cli_sub_run(const char *prog, const char *name, cli_main_fn main, int argc, char **argv)
{
    char full[64];
    snprintf(full, sizeof full, "%s %s", prog, name);
    argv[1] = full;
    return main(argc - 1, argv + 1);
}

int cli_sub_dispatch(const char *prog, const cli_sub *subs, size_t n, int argc, char **argv)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(argv[1], subs[i].name) == 0)
            return cli_sub_run(prog, subs[i].name, subs[i].main, argc, argv);
    return -1;
}

int main(int argc, char **argv)
{
    if (cli_help_asked(argc, argv)) {
        print_help();
        return argc < 2 ? FU_EXIT_USAGE : FU_EXIT_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("fusion %s\n", FUSION_VERSION);
        return FU_EXIT_OK;
    }
    if (sodium_init() < 0) {
        fprintf(stderr, "fusion: libsodium failed to initialise\n");
        return FU_EXIT_FAIL;
    }
    for (size_t i = 0; i < N_SUB; i++) {
        const cli_subcommand *s = &subcommands[i];
        if (strcmp(argv[1], s->name) != 0)
            continue;
        if (!s->main) {
            fprintf(stderr,
                    "fusion %s: not available yet: it comes with the capability \"%s\", which this "
                    "build does not have\n",
                    s->name, s->capability);
            return FU_EXIT_USAGE;
        }
        return cli_sub_run("fusion", s->name, s->main, argc, argv);
    }
    fprintf(stderr, "fusion: unknown command '%s'\nRun 'fusion --help' for the list of commands.\n", argv[1]);
    return FU_EXIT_USAGE;
}
