#include "fu_opts.h"

#include <ctype.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <sodium.h>

#include "fu_log.h"

#ifndef FUSION_VERSION
#define FUSION_VERSION "0.0.0"
#endif

static bool flag_help, flag_version, flag_log_json;
static const char *opt_log_level;

static const fu_opt common_opts[] = {
    {"log-level", 0, FU_OPT_STR, &opt_log_level, "LEVEL", "log level: debug, info, warn, error, off (default info)"},
    {"log-json", 0, FU_OPT_FLAG, &flag_log_json, NULL, "write log lines as JSON objects"},
    {"help", 'h', FU_OPT_FLAG, &flag_help, NULL, "show this help and exit"},
    {"version", 0, FU_OPT_FLAG, &flag_version, NULL, "show the version and exit"},
};
#define N_COMMON (sizeof common_opts / sizeof common_opts[0])

static void print_opt(const fu_opt *o)
{
    char left[64];
    if (o->short_name)
        snprintf(left, sizeof left, "-%c, --%s%s%s", o->short_name, o->name, o->metavar ? " " : "",
                 o->metavar ? o->metavar : "");
    else
        snprintf(left, sizeof left, "    --%s%s%s", o->name, o->metavar ? " " : "", o->metavar ? o->metavar : "");
    printf("  %-30s %s\n", left, o->help ? o->help : "");
}

void fu_opts_print_help(const fu_cmd *cmd)
{
    printf("Usage: %s %s\n\n", cmd->prog, cmd->usage ? cmd->usage : "[options]");
    if (cmd->summary)
        printf("%s\n\n", cmd->summary);
    if (cmd->n_opts) {
        printf("Options:\n");
        for (size_t i = 0; i < cmd->n_opts; i++)
            print_opt(&cmd->opts[i]);
        printf("\n");
    }
    printf("Common options:\n");
    for (size_t i = 0; i < N_COMMON; i++)
        print_opt(&common_opts[i]);
}

static const fu_opt *find_long(const fu_cmd *cmd, const char *name, size_t len)
{
    for (size_t i = 0; i < cmd->n_opts; i++)
        if (strlen(cmd->opts[i].name) == len && strncmp(cmd->opts[i].name, name, len) == 0)
            return &cmd->opts[i];
    for (size_t i = 0; i < N_COMMON; i++)
        if (strlen(common_opts[i].name) == len && strncmp(common_opts[i].name, name, len) == 0)
            return &common_opts[i];
    return NULL;
}

static const fu_opt *find_short(const fu_cmd *cmd, char c)
{
    for (size_t i = 0; i < cmd->n_opts; i++)
        if (cmd->opts[i].short_name == c)
            return &cmd->opts[i];
    for (size_t i = 0; i < N_COMMON; i++)
        if (common_opts[i].short_name == c)
            return &common_opts[i];
    return NULL;
}

int fu_opts_usage_error(const fu_cmd *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", cmd->prog);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\nTry '%s --help' for more information.\n", cmd->prog);
    va_end(ap);
    return FU_EXIT_USAGE;
}

static bool parse_bool(const char *s, bool *out)
{
    static const char *const words[] = {"true", "false", "yes", "no", "on", "off", "1", "0"};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
        if (strcasecmp(s, words[i]) == 0) {
            *out = i % 2 == 0;
            return true;
        }
    return false;
}

/* The one conversion of an option's text value, for argv and files alike. val is NULL for a flag
 * given on the command line; a STR val must outlive the program's use of it. */
static fu_err opt_set(const fu_opt *o, const char *val, fu_errmsg *em)
{
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case FU_OPT_FLAG: {
        bool v = true;
        if (val && !parse_bool(val, &v))
            return fu_errmsg_set(em, FU_EINVAL, "--%s needs true or false (yes/no, on/off, 1/0), got '%s'",
                                 o->name, val);
        *(bool *)o->dest = v;
        return FU_OK;
    }
    case FU_OPT_STR:
        *(const char **)o->dest = val;
        return FU_OK;
    case FU_OPT_INT: {
        long long v = strtoll(val, &end, 0);
        if (errno || end == val || *end)
            return fu_errmsg_set(em, FU_EINVAL, "--%s needs an integer, got '%s'", o->name, val);
        *(long long *)o->dest = v;
        return FU_OK;
    }
    case FU_OPT_DOUBLE: {
        double v = strtod(val, &end);
        if (errno || end == val || *end)
            return fu_errmsg_set(em, FU_EINVAL, "--%s needs a number, got '%s'", o->name, val);
        *(double *)o->dest = v;
        return FU_OK;
    }
    }
    return fu_errmsg_set(em, FU_EINVAL, "--%s has an unknown kind", o->name);
}

/* Applies --log-level and --log-json to fu_log, if they were given. */
static fu_err apply_log(fu_errmsg *em)
{
    if (opt_log_level) {
        fu_log_level lvl;
        if (fu_log_parse_level(opt_log_level, &lvl) != FU_OK)
            return fu_errmsg_set(em, FU_EINVAL, "unknown log level '%s' (debug, info, warn, error, off)",
                                 opt_log_level);
        fu_log_set_level(lvl);
    }
    if (flag_log_json)
        fu_log_set_format(FU_LOG_JSON);
    return FU_OK;
}

/* String values read from config files: copied here, kept until exit, so nothing is freed or leaked. */
static char   arena[FU_OPTS_ARENA_SIZE];
static size_t arena_used;

static const char *arena_copy(const char *s)
{
    size_t n = strlen(s) + 1;
    if (n > sizeof arena - arena_used)
        return NULL;
    char *p = memcpy(arena + arena_used, s, n);
    arena_used += n;
    return p;
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    for (char *e = s + strlen(s); e > s && isspace((unsigned char)e[-1]); e--)
        e[-1] = '\0';
    return s;
}

static const fu_opt *find_config(const fu_cmd *cmd)
{
    for (size_t i = 0; i < cmd->n_opts; i++)
        if (cmd->opts[i].kind == FU_OPT_STR && strcmp(cmd->opts[i].name, "config") == 0)
            return &cmd->opts[i];
    return NULL;
}

/* Applies one config-file line (as read by fgets, newline included when it fit). */
static fu_err load_line(const fu_cmd *cmd, char *line, fu_errmsg *em)
{
    size_t len = strlen(line);
    if (len > FU_OPTS_LINE_MAX && line[len - 1] != '\n')
        return fu_errmsg_set(em, FU_EINVAL, "line longer than %d bytes", FU_OPTS_LINE_MAX);
    char *key = trim(line);
    if (*key == '\0' || *key == '#')
        return FU_OK;
    char *eq = strchr(key, '=');
    if (!eq)
        return fu_errmsg_set(em, FU_EINVAL, "expected 'key = value', got '%s'", key);
    *eq = '\0';
    key = trim(key);
    const char *val = trim(eq + 1);
    const fu_opt *o = find_long(cmd, key, strlen(key));
    if (!o)
        return fu_errmsg_set(em, FU_EINVAL, "unknown setting '%s' (see --help for the options)", key);
    if (o == find_config(cmd))
        return fu_errmsg_set(em, FU_EINVAL,
                             "'config' cannot be set from a config file (config files do not nest)");
    if (o->dest == &flag_help || o->dest == &flag_version)
        return fu_errmsg_set(em, FU_EINVAL, "'%s' cannot be set from a config file", key);
    if (o->kind == FU_OPT_STR && !(val = arena_copy(val)))
        return fu_errmsg_set(em, FU_ENOMEM, "config file strings exceed the %d bytes kept for them",
                             FU_OPTS_ARENA_SIZE);
    fu_err err = opt_set(o, val, em);
    if (err == FU_OK && (o->dest == &opt_log_level || o->dest == &flag_log_json))
        err = apply_log(em);
    return err;
}

fu_err fu_opts_load_file(const fu_cmd *cmd, const char *path, fu_errmsg *em)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        int e = errno;
        return fu_errmsg_set(em, e == ENOENT ? FU_ENOTFOUND : FU_EIO, "cannot read config file '%s': %s",
                             path, strerror(e));
    }
    char line[FU_OPTS_LINE_MAX + 2];
    fu_errmsg line_em = {{0}}; /* the line's problem, quoted after its place */
    unsigned lineno = 0;
    fu_err err = FU_OK;
    while (err == FU_OK && fgets(line, sizeof line, f)) {
        lineno++;
        err = load_line(cmd, line, &line_em);
    }
    if (err != FU_OK)
        fu_errmsg_set(em, err, "%s:%u: %s", path, lineno, fu_errmsg_text(&line_em, err));
    else if (ferror(f))
        err = fu_errmsg_set(em, FU_EIO, "cannot read config file '%s': %s", path, strerror(errno));
    fclose(f);
    return err;
}

/* One walk over argv[1..argc). Normally stores every option and moves positionals to
 * argv[1..1+*npos). In the pre-scan (only non-NULL) it stores nothing and moves nothing: it just
 * puts the value of option `only`, if given, in *only_val. Returns 0 or an exit code. */
static int walk_argv(const fu_cmd *cmd, int argc, char **argv, const fu_opt *only, const char **only_val,
                     size_t *npos)
{
    bool only_pos = false;
    int rc = 0;
    for (int i = 1; i < argc && rc == 0; i++) {
        char *a = argv[i];
        if (only_pos || a[0] != '-' || a[1] == '\0') {
            if (!only)
                argv[1 + (*npos)++] = a;
            continue;
        }
        if (strcmp(a, "--") == 0) {
            only_pos = true;
            continue;
        }
        const fu_opt *o;
        const char *val = NULL;
        if (a[1] == '-') {
            const char *name = a + 2, *eq = strchr(name, '=');
            o = find_long(cmd, name, eq ? (size_t)(eq - name) : strlen(name));
            if (!o)
                return fu_opts_usage_error(cmd, "unknown option '%s'", a);
            if (eq) {
                if (o->kind == FU_OPT_FLAG)
                    return fu_opts_usage_error(cmd, "option '%s' takes no value", a);
                val = eq + 1;
            }
        } else {
            o = a[2] == '\0' ? find_short(cmd, a[1]) : NULL;
            if (!o)
                return fu_opts_usage_error(cmd, "unknown option '%s'", a);
        }
        if (o->kind != FU_OPT_FLAG && !val) {
            if (i + 1 >= argc)
                return fu_opts_usage_error(cmd, "option '%s' needs a value", a);
            val = argv[++i];
        }
        if (only) {
            if (o == only)
                *only_val = val;
            continue;
        }
        fu_errmsg em = {{0}};
        if (opt_set(o, val, &em) != FU_OK)
            rc = fu_opts_usage_error(cmd, "%s", em.msg);
    }
    return rc;
}

fu_err fu_opts_parse(const fu_cmd *cmd, int argc, char **argv, size_t *n_pos, int *exit_code)
{
    flag_help = flag_version = flag_log_json = false;
    opt_log_level = NULL;
    size_t npos = 0;
    fu_errmsg em = {{0}};
    int rc = 0;

    const fu_opt *config = find_config(cmd);
    const char *config_path = NULL;
    if (config)
        rc = walk_argv(cmd, argc, argv, config, &config_path, &npos);
    if (rc == 0 && config_path && fu_opts_load_file(cmd, config_path, &em) != FU_OK)
        rc = fu_opts_usage_error(cmd, "%s", em.msg);
    if (rc == 0)
        rc = walk_argv(cmd, argc, argv, NULL, NULL, &npos);
    if (rc) {
        *exit_code = rc;
        return FU_ECANCELED;
    }
    if (flag_help) {
        fu_opts_print_help(cmd);
        *exit_code = FU_EXIT_OK;
        return FU_ECANCELED;
    }
    if (flag_version) {
        printf("%s %s\n", cmd->prog, FUSION_VERSION);
        *exit_code = FU_EXIT_OK;
        return FU_ECANCELED;
    }
    if (apply_log(&em) != FU_OK) {
        *exit_code = fu_opts_usage_error(cmd, "%s", em.msg);
        return FU_ECANCELED;
    }
    if (npos < cmd->min_pos || npos > cmd->max_pos) {
        char want[64];
        if (cmd->min_pos == cmd->max_pos)
            snprintf(want, sizeof want, "%zu", cmd->min_pos);
        else
            snprintf(want, sizeof want, "%zu to %zu", cmd->min_pos, cmd->max_pos);
        *exit_code = fu_opts_usage_error(cmd, "expects %s argument(s)", want);
        return FU_ECANCELED;
    }
    argv[1 + npos] = NULL;
    if (n_pos)
        *n_pos = npos;
    return FU_OK;
}

int fu_opts_daemon_start(const char *prog, void (*on_signal)(int), const int *signals, size_t n)
{
    if (sodium_init() < 0) {
        fprintf(stderr, "%s: libsodium failed to initialise\n", prog);
        return FU_EXIT_FAIL;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < n; i++)
        sigaction(signals[i], &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    return FU_EXIT_OK;
}

int fu_exit_for(fu_err rc)
{
    switch (rc) {
    case FU_OK: return FU_EXIT_OK;
    case FU_ENOTFOUND: return FU_EXIT_NOTFOUND;
    case FU_EPERM:
    case FU_EAUTH: return FU_EXIT_AUTH;
    case FU_EVERSION:
    case FU_ENOSYS: return FU_EXIT_USAGE;
    case FU_ETIMEDOUT: return FU_EXIT_TIMEOUT;
    default: return FU_EXIT_FAIL;
    }
}
