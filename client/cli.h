/* The `fusion` client CLI: one entry point per subcommand, each in its own cli_<name>.c. Every entry
 * gets argv with argv[0] set to the full command name ("fusion run") and returns an exit code
 * (FU_EXIT_* from fu_opts.h). */
#ifndef FU_CLI_H
#define FU_CLI_H

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*cli_main_fn)(int argc, char **argv);
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

#ifdef __cplusplus
}
#endif
#endif
