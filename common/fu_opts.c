#include "fu_opts.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

static int usage_error(const fu_cmd *cmd, const char *fmt, const char *a)
{
    fprintf(stderr, "%s: ", cmd->prog);
    fprintf(stderr, fmt, a);
    fprintf(stderr, "\nTry '%s --help' for more information.\n", cmd->prog);
    return FU_EXIT_USAGE;
}

static int store(const fu_cmd *cmd, const fu_opt *o, const char *val)
{
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case FU_OPT_FLAG:
        *(bool *)o->dest = true;
        return 0;
    case FU_OPT_STR:
        *(const char **)o->dest = val;
        return 0;
    case FU_OPT_INT: {
        long long v = strtoll(val, &end, 0);
        if (errno || end == val || *end)
            return usage_error(cmd, "option needs an integer, got '%s'", val);
        *(long long *)o->dest = v;
        return 0;
    }
    case FU_OPT_DOUBLE: {
        double v = strtod(val, &end);
        if (errno || end == val || *end)
            return usage_error(cmd, "option needs a number, got '%s'", val);
        *(double *)o->dest = v;
        return 0;
    }
    }
    return FU_EXIT_USAGE;
}

fu_err fu_opts_parse(const fu_cmd *cmd, int argc, char **argv, size_t *n_pos, int *exit_code)
{
    flag_help = flag_version = flag_log_json = false;
    opt_log_level = NULL;
    size_t npos = 0;
    bool only_pos = false;
    int rc = 0;

    for (int i = 1; i < argc && rc == 0; i++) {
        char *a = argv[i];
        if (only_pos || a[0] != '-' || a[1] == '\0') {
            argv[1 + npos++] = a;
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
            if (!o) {
                rc = usage_error(cmd, "unknown option '%s'", a);
                break;
            }
            if (eq) {
                if (o->kind == FU_OPT_FLAG) {
                    rc = usage_error(cmd, "option '%s' takes no value", a);
                    break;
                }
                val = eq + 1;
            }
        } else {
            o = a[2] == '\0' ? find_short(cmd, a[1]) : NULL;
            if (!o) {
                rc = usage_error(cmd, "unknown option '%s'", a);
                break;
            }
        }
        if (o->kind != FU_OPT_FLAG && !val) {
            if (i + 1 >= argc) {
                rc = usage_error(cmd, "option '%s' needs a value", a);
                break;
            }
            val = argv[++i];
        }
        rc = store(cmd, o, val);
    }
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
    if (opt_log_level) {
        fu_log_level lvl;
        if (fu_log_parse_level(opt_log_level, &lvl) != FU_OK) {
            *exit_code = usage_error(cmd, "unknown log level '%s' (debug, info, warn, error, off)", opt_log_level);
            return FU_ECANCELED;
        }
        fu_log_set_level(lvl);
    }
    if (flag_log_json)
        fu_log_set_format(FU_LOG_JSON);
    if (npos < cmd->min_pos || npos > cmd->max_pos) {
        char want[64];
        if (cmd->min_pos == cmd->max_pos)
            snprintf(want, sizeof want, "%zu", cmd->min_pos);
        else
            snprintf(want, sizeof want, "%zu to %zu", cmd->min_pos, cmd->max_pos);
        *exit_code = usage_error(cmd, "expects %s argument(s)", want);
        return FU_ECANCELED;
    }
    argv[1 + npos] = NULL;
    *n_pos = npos;
    return FU_OK;
}
