/* Command-line options for every fusion program: a table of long options (optionally with a short
 * letter), typed destinations, and the common --help, --version, --log-level and --log-json. */
#ifndef FU_OPTS_H
#define FU_OPTS_H

#include <stdbool.h>
#include <stddef.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Exit codes shared by the three programs (documented in the README). */
#define FU_EXIT_OK      0 /* success */
#define FU_EXIT_FAIL    1 /* the operation failed (the message says why) */
#define FU_EXIT_USAGE   2 /* bad command line, or a capability this build does not have yet */
#define FU_EXIT_AUTH    3 /* refused: authentication or permission */
#define FU_EXIT_NOTFOUND 4 /* the job, file or peer named does not exist */
#define FU_EXIT_TIMEOUT 5 /* a wait ran out of time */

typedef enum {
    FU_OPT_FLAG,   /* bool *: set to true when present */
    FU_OPT_STR,    /* const char **: points into argv */
    FU_OPT_INT,    /* long long * */
    FU_OPT_DOUBLE, /* double * */
} fu_opt_kind;

typedef struct {
    const char *name;    /* long name without the dashes ("steps") */
    char        short_name; /* one-letter alias ('o'), or 0 */
    fu_opt_kind kind;    /* the destination's type */
    void       *dest;    /* where the value goes; left untouched when the option is absent */
    const char *metavar; /* placeholder in --help ("N"); NULL for flags */
    const char *help;    /* one line for --help */
} fu_opt;

typedef struct {
    const char   *prog;     /* program name as the user types it ("fusion run finetune") */
    const char   *usage;    /* the argument synopsis after prog ("[options] FILE") */
    const char   *summary;  /* one paragraph: what the command does */
    const fu_opt *opts;     /* the command's own options */
    size_t        n_opts;
    size_t        min_pos;  /* fewest positional arguments accepted */
    size_t        max_pos;  /* most positional arguments accepted */
} fu_cmd;

/* Parses argv[1..argc) against cmd plus the common options. Positional arguments are moved, in
 * order, to argv[1..1+*n_pos). On success returns FU_OK and *exit_code is untouched. When the
 * program should exit now (--help or --version printed to stdout: exit 0; a usage error printed to
 * stderr: exit FU_EXIT_USAGE) returns FU_ECANCELED and sets *exit_code. --log-level and --log-json
 * configure fu_log directly. */
FU_MUST_CHECK fu_err fu_opts_parse(const fu_cmd *cmd, int argc, char **argv, size_t *n_pos, int *exit_code);

/* Prints cmd's --help text to stdout. */
void fu_opts_print_help(const fu_cmd *cmd);

#ifdef __cplusplus
}
#endif
#endif
