/* The `fusion` client CLI: one entry point per subcommand, each in its own cli_<name>.c. Every entry
 * gets argv with argv[0] set to the full command name ("fusion run") and returns an exit code
 * (FU_EXIT_* from fu_opts.h). */
#ifndef FU_CLI_H
#define FU_CLI_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*cli_main_fn)(int argc, char **argv);

/* One subcommand of a command (`init` of `fusion model`): its name as typed and its entry. */
typedef struct {
    const char *name;
    cli_main_fn main;
} cli_sub;

/* Dispatch helpers, cli_main.c. true when argv names no subcommand (argc < 2) or asks for help
 * (--help, -h, help). */
bool cli_help_asked(int argc, char **argv);
/* Runs main with argc - 1 and argv + 1, its argv[0] "<prog> <name>". Returns its exit code. */
int cli_sub_run(const char *prog, const char *name, cli_main_fn main, int argc, char **argv);
/* cli_sub_run of the entry of subs[0..n) named argv[1]; -1 (nothing run) when none has that name. */
int cli_sub_dispatch(const char *prog, const cli_sub *subs, size_t n, int argc, char **argv);

int cli_keygen_main(int argc, char **argv); /* `fusion keygen`, cli_keygen.c */

/* `fusion model` (init, info; prune comes with SALR). cli_model.c */
int cli_model_main(int argc, char **argv);

/* `fusion run` (finetune, infer): a job in this process, no broker. cli_run.c */
int cli_run_main(int argc, char **argv);

/* Jobs on a broker: cli_submit.c (submit), cli_jobs.c (status, jobs, wait, cancel, peers). */
int cli_submit_main(int argc, char **argv);
int cli_status_main(int argc, char **argv);
int cli_jobs_main(int argc, char **argv);
int cli_wait_main(int argc, char **argv);
int cli_cancel_main(int argc, char **argv);
int cli_peers_main(int argc, char **argv);
int cli_result_main(int argc, char **argv); /* `fusion result`, cli_result.c */
int cli_tokenize_main(int argc, char **argv); /* `fusion tokenize`, cli_tokenize.c */
int cli_http_token_main(int argc, char **argv); /* `fusion http-token`, cli_http.c */
int cli_serve_main(int argc, char **argv);      /* `fusion serve`, cli_serve.c */
int cli_ask_main(int argc, char **argv);        /* `fusion ask`: a generation in a serving job, cli_ask.c */
int cli_eval_main(int argc, char **argv);     /* `fusion eval` (= `fusion run eval`), cli_run.c */
int cli_eval_pipeline_main(int argc, char **argv); /* `fusion eval --pipeline`: through the broker, cli_submit.c */

#ifdef __cplusplus
}
#endif
#endif
