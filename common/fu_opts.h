/* Command-line options for every fusion program: a table of long options (optionally with a short
 * letter), typed destinations, and the common --help, --version, --log-level and --log-json.
 * The same options can be set from a config file of `key = value` lines (fu_opts_load_file). */
#ifndef FU_OPTS_H
#define FU_OPTS_H

#include <stdbool.h>
#include <stddef.h>

#include "fu_err.h"
#include "fu_file.h"

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

/* The exit code for a failed operation's error: 4 for FU_ENOTFOUND, 3 for FU_EPERM and FU_EAUTH, 2
 * for what this build or fusion does not support (FU_EVERSION, FU_ENOSYS), 5 for FU_ETIMEDOUT, else 1
 * (a bad value is the operation's failure here: command-line errors are the parser's, exit 2). */
int fu_exit_for(fu_err rc);

#define FU_OPTS_LINE_MAX   4096  /* longest config-file line, in bytes without the newline */
#define FU_OPTS_ARENA_SIZE 65536 /* bytes for string values read from config files, per process */

typedef enum {
    FU_OPT_FLAG,   /* bool *: set to true when present; a file says true/false, yes/no, on/off, 1/0 */
    FU_OPT_STR,    /* const char **: points into argv, or into static storage for a file's values */
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

/* The .opts and .n_opts of a fu_cmd for an array of fu_opt: `{.prog = ..., FU_OPTS_TABLE(opts)}`. */
#define FU_OPTS_TABLE(table) .opts = (table), .n_opts = sizeof(table) / sizeof((table)[0])

/* Parses argv[1..argc) against cmd plus the common options. Positional arguments are moved, in
 * order, to argv[1..1+*n_pos) (n_pos may be NULL when the count is not needed). On success returns
 * FU_OK and *exit_code is untouched. When the program should exit now (--help or --version printed
 * to stdout: exit 0; a usage error printed to stderr: exit FU_EXIT_USAGE) returns FU_ECANCELED and
 * sets *exit_code. --log-level and --log-json configure fu_log directly.
 * If cmd->opts has a FU_OPT_STR option named "config" and argv gives it (--config FILE or
 * --config=FILE, before any "--"), FILE is loaded with fu_opts_load_file first, so the command line
 * overrides the file; a file that cannot be loaded is a usage error. Not thread-safe (the common
 * options and the file arena are process-wide). */
FU_MUST_CHECK fu_err fu_opts_parse(const fu_cmd *cmd, int argc, char **argv, size_t *n_pos, int *exit_code);

/* Sets cmd's options from the config file at path: `key = value` lines, key an option's long name
 * without dashes, whitespace around key and value ignored, blank lines and lines starting with '#'
 * skipped. Values are checked as on the command line; a later line overrides an earlier one, and a
 * later fu_opts_parse overrides the file (load a default file before parsing). String values are
 * copied into static storage (FU_OPTS_ARENA_SIZE bytes per process, never freed) so they outlive the
 * file. --log-level and --log-json take effect at once; help, version and config cannot be set from
 * a file (no nesting).
 * Returns FU_OK, or on error writes one sentence to em (may be NULL; "FILE:LINE: ..."
 * for content errors) and returns FU_ENOTFOUND (no such file), FU_EIO (unreadable), FU_EINVAL (an
 * unknown key, a line without '=', a bad value, a line over FU_OPTS_LINE_MAX bytes) or FU_ENOMEM (the
 * string storage is full). Lines before the bad one may already be applied. Not thread-safe. */
FU_MUST_CHECK fu_err fu_opts_load_file(const fu_cmd *cmd, const char *path, fu_errmsg *em);

/* Prints cmd's --help text to stdout. */
void fu_opts_print_help(const fu_cmd *cmd);

/* Tells the user that the command line is wrong: "PROG: <fmt ...>" and "Try 'PROG --help' for more
 * information." on stderr. Returns FU_EXIT_USAGE, the exit code to return. */
__attribute__((format(printf, 2, 3))) int fu_opts_usage_error(const fu_cmd *cmd, const char *fmt, ...);

/* The start of a daemon's main (fusion-broker, fusion-peer), after its options are parsed:
 * initialises libsodium (before any ZeroMQ context), installs on_signal for the n signals in
 * signals (with an empty mask and no flags) and ignores SIGPIPE. Returns FU_EXIT_OK, or prints
 * "PROG: libsodium failed to initialise" and returns FU_EXIT_FAIL. Call once, before any thread. */
FU_MUST_CHECK int fu_opts_daemon_start(const char *prog, void (*on_signal)(int), const int *signals,
                                       size_t n);

#ifdef __cplusplus
}
#endif
#endif
