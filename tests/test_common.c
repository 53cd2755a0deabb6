#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_challenge.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_err.h"
#include "fu_log.h"
#include "fu_opts.h"
#include "testutil.h"

static void test_common_strerror_covers_every_code(void **state)
{
    (void)state;
    for (int e = 0; e < FU_ERR_COUNT_; e++) {
        assert_non_null(fu_strerror((fu_err)e));
        assert_string_not_equal(fu_strerror((fu_err)e), "unknown error");
        assert_true(strncmp(fu_errname((fu_err)e), "FU_", 3) == 0);
    }
    assert_string_equal(fu_strerror((fu_err)999), "unknown error");
    assert_string_equal(fu_errname(FU_ENOMEM), "FU_ENOMEM");
}

static void test_common_hex_round_trip(void **state)
{
    (void)state;
    const uint8_t in[] = {0x00, 0x01, 0xab, 0xff, 0x7f};
    char hex[11];
    fu_hex_encode(hex, in, sizeof in);
    assert_string_equal(hex, "0001abff7f");
    uint8_t back[5];
    assert_int_equal(fu_hex_decode(back, 5, "0001ABff7f"), FU_OK);
    assert_memory_equal(back, in, 5);
    assert_int_equal(fu_hex_decode(back, 5, "0001abff7"), FU_EINVAL);   /* short */
    assert_int_equal(fu_hex_decode(back, 5, "0001abff7g"), FU_EINVAL);  /* bad digit */
    assert_int_equal(fu_hex_decode(back, 5, NULL), FU_EINVAL);
}

static void test_common_z85_matches_rfc32(void **state)
{
    (void)state;
    /* The test vector from ZeroMQ RFC 32. */
    const uint8_t hello[8] = {0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B};
    char txt[11];
    assert_int_equal(fu_z85_encode(txt, hello, 8), FU_OK);
    assert_string_equal(txt, "HelloWorld");
    uint8_t back[8];
    size_t n = 0;
    assert_int_equal(fu_z85_decode(back, sizeof back, "HelloWorld", &n), FU_OK);
    assert_int_equal(n, 8);
    assert_memory_equal(back, hello, 8);
    assert_int_equal(fu_z85_encode(txt, hello, 7), FU_EINVAL);                  /* not 4k bytes */
    assert_int_equal(fu_z85_decode(back, sizeof back, "Hello", &n), FU_OK);    /* 5 chars */
    assert_int_equal(fu_z85_decode(back, sizeof back, "Hell", &n), FU_EINVAL);  /* not 5k chars */
    assert_int_equal(fu_z85_decode(back, sizeof back, "Hell~", &n), FU_EINVAL); /* bad char */
    assert_int_equal(fu_z85_decode(back, 4, "HelloWorld", &n), FU_EINVAL);      /* no room */
    assert_int_equal(fu_z85_decode(back, 4, "%%%%%", &n), FU_EINVAL);           /* > 2^32 */
}

static void test_common_budget_refuses_overdraw(void **state)
{
    (void)state;
    fu_budget b = {.limit = 100, .used = 0};
    assert_int_equal(fu_budget_take(&b, 60), FU_OK);
    assert_int_equal(fu_budget_take(&b, 41), FU_ENOMEM);
    assert_int_equal(b.used, 60);
    assert_int_equal(fu_budget_take(&b, 40), FU_OK);
    fu_budget_give(&b, 50);
    assert_int_equal(b.used, 50);
    assert_int_equal(fu_budget_take(&b, SIZE_MAX), FU_ENOMEM);
    size_t out;
    assert_false(fu_size_mul(SIZE_MAX / 2 + 1, 2, &out));
    assert_true(fu_size_mul(1000, 1000, &out));
    assert_int_equal(out, 1000000);
    /* a table indexed by descriptor grows by doubling and is zeroed past what it held */
    size_t n = 0;
    uint32_t *t = fu_grow_zeroed(NULL, &n, 5, sizeof *t);
    assert_int_equal(n, 1024);
    t[5] = 7;
    t = fu_grow_zeroed(t, &n, 1023, sizeof *t); /* fits already */
    assert_int_equal(n, 1024);
    t = fu_grow_zeroed(t, &n, 5000, sizeof *t);
    assert_int_equal(n, 8192);
    assert_int_equal(t[5], 7);
    for (size_t i = 1024; i < n; i++)
        assert_int_equal(t[i], 0);
    free(t);
    /* a prefix of a string, and no more than the string when it is shorter */
    char *pre = fu_strndup("tcp://a:1,tcp://b:2", 9), *whole = fu_strndup("ab", 10);
    assert_string_equal(pre, "tcp://a:1");
    assert_string_equal(whole, "ab");
    free(pre);
    free(whole);
}

static void test_common_clock_is_monotonic(void **state)
{
    (void)state;
    uint64_t a = fu_clock_ns();
    fu_sleep_ms(5);
    uint64_t b = fu_clock_ns();
    assert_true(b - a >= 4000000ull);
    assert_true(fu_wallclock_ms() > 1600000000000LL);
}

static void test_common_log_levels_parse(void **state)
{
    (void)state;
    fu_log_level l;
    assert_int_equal(fu_log_parse_level("warn", &l), FU_OK);
    assert_int_equal(l, FU_LOG_WARN);
    assert_int_equal(fu_log_parse_level("loud", &l), FU_EINVAL);
    assert_int_equal(fu_log_parse_level(NULL, &l), FU_EINVAL);
}

static void test_common_opts_parse_values_and_positionals(void **state)
{
    (void)state;
    const char *name = NULL;
    long long steps = 1;
    double lr = 0;
    bool wait = false;
    const fu_opt opts[] = {
        {"name", 'n', FU_OPT_STR, &name, "NAME", ""},
        {"steps", 0, FU_OPT_INT, &steps, "N", ""},
        {"lr", 0, FU_OPT_DOUBLE, &lr, "LR", ""},
        {"wait", 0, FU_OPT_FLAG, &wait, NULL, ""},
    };
    const fu_cmd cmd = {.prog = "t", .opts = opts, .n_opts = 4, .min_pos = 1, .max_pos = 2};
    char *argv[] = {"t", "pos1", "--steps", "30", "-n", "x", "--lr=0.5", "--wait", "--", "--pos2", NULL};
    size_t npos = 0;
    int code = -1;
    assert_int_equal(fu_opts_parse(&cmd, 10, argv, &npos, &code), FU_OK);
    assert_int_equal(npos, 2);
    assert_string_equal(argv[1], "pos1");
    assert_string_equal(argv[2], "--pos2");
    assert_null(argv[3]);
    assert_string_equal(name, "x");
    assert_int_equal(steps, 30);
    assert_true(lr == 0.5);
    assert_true(wait);
}

/* fu_opts_parse on argv (NULL-terminated) must refuse it as a usage error. */
static void expect_usage_error(const fu_cmd *cmd, char **argv)
{
    int argc = 0;
    while (argv[argc])
        argc++;
    size_t npos = 0;
    int code = -1;
    fu_err rc = fu_opts_parse(cmd, argc, argv, &npos, &code);
    if (rc != FU_ECANCELED || code != FU_EXIT_USAGE)
        fail_msg("%s %s: %s, exit code %d (expected FU_ECANCELED, %d)", argv[1], argc > 2 ? argv[2] : "",
                 fu_errname(rc), code, FU_EXIT_USAGE);
}

static void test_common_opts_reject_bad_input(void **state)
{
    (void)state;
    long long steps = 7;
    const fu_opt opts[] = {{"steps", 0, FU_OPT_INT, &steps, "N", ""}};
    const fu_cmd cmd = {.prog = "t", .opts = opts, .n_opts = 1, .min_pos = 0, .max_pos = 0};
    char *a1[] = {"t", "--steps", "ten", NULL};
    expect_usage_error(&cmd, a1);
    assert_int_equal(steps, 7);
    char *a2[] = {"t", "--nope", NULL};
    expect_usage_error(&cmd, a2);
    char *a3[] = {"t", "--steps", NULL};
    expect_usage_error(&cmd, a3);
    char *a4[] = {"t", "extra", NULL};
    expect_usage_error(&cmd, a4);
    char *a5[] = {"t", "--log-level", "loud", NULL};
    expect_usage_error(&cmd, a5);
}

/* Config files: the options of the table below, written to a scratch directory per test. */
typedef struct {
    char       *dir;        /* scratch directory (owned) */
    char        path[4200]; /* the config file in it */
    bool        wait;       /* --wait, a flag */
    const char *name;       /* --name / -n, a string */
    long long   steps;      /* --steps, an integer (1 until set) */
    double      lr;         /* --lr, a double */
    const char *config;     /* --config / -c FILE */
    fu_opt      opts[5];    /* the table over the fields above */
    fu_cmd      cmd;        /* "t": the table, at most one positional */
} conf_fixture;

static conf_fixture *conf_new(const char *text)
{
    conf_fixture *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->dir = tu_tmpdir("opts");
    assert_non_null(f->dir);
    snprintf(f->path, sizeof f->path, "%s/t.conf", f->dir);
    FILE *fp = fopen(f->path, "w");
    assert_non_null(fp);
    fputs(text, fp);
    fclose(fp);
    f->steps = 1;
    const fu_opt opts[5] = {
        {"wait", 'w', FU_OPT_FLAG, &f->wait, NULL, ""},
        {"name", 'n', FU_OPT_STR, &f->name, "NAME", ""},
        {"steps", 0, FU_OPT_INT, &f->steps, "N", ""},
        {"lr", 0, FU_OPT_DOUBLE, &f->lr, "LR", ""},
        {"config", 'c', FU_OPT_STR, &f->config, "FILE", ""},
    };
    memcpy(f->opts, opts, sizeof opts);
    f->cmd = (fu_cmd){.prog = "t", .opts = f->opts, .n_opts = 5, .min_pos = 0, .max_pos = 1};
    return f;
}

static void conf_destroy(conf_fixture **f_p)
{
    conf_fixture *f = *f_p;
    unlink(f->path);
    rmdir(f->dir);
    free(f->dir);
    free(f);
    *f_p = NULL;
}

/* fu_opts_load_file on text must fail with FU_EINVAL and exactly "PATH:<suffix>" in its message. */
static void conf_expect_error(const char *text, const char *suffix)
{
    conf_fixture *f = conf_new(text);
    fu_errmsg em = {{0}};
    char want[FU_ERRMSG_MAX + 4200];
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, &em), FU_EINVAL);
    snprintf(want, sizeof want, "%s:%s", f->path, suffix);
    assert_string_equal(em.msg, want);
    conf_destroy(&f);
}

static void test_common_opts_file_sets_each_kind(void **state)
{
    (void)state;
    conf_fixture *f = conf_new("wait = yes\nname = model-a\nsteps = 40\nlr = 2.5e-4\n");
    fu_errmsg em = {{0}};
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, &em), FU_OK);
    assert_true(f->wait);
    assert_string_equal(f->name, "model-a");
    assert_int_equal(f->steps, 40);
    assert_true(f->lr == 2.5e-4);
    conf_destroy(&f);

    f = conf_new("wait = off\n");
    f->wait = true;
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, NULL), FU_OK);
    assert_false(f->wait);
    conf_destroy(&f);
}

static void test_common_opts_file_comments_blanks_and_whitespace(void **state)
{
    (void)state;
    conf_fixture *f = conf_new("# a comment = not a setting\n\n   \n  # indented comment\n"
                               "\t name \t=   hello world  \r\n  steps=7\nlr =\t0.5");
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, NULL), FU_OK);
    assert_string_equal(f->name, "hello world");
    assert_int_equal(f->steps, 7);
    assert_true(f->lr == 0.5); /* last line without a newline */
    conf_destroy(&f);
}

static void test_common_opts_file_string_outlives_file(void **state)
{
    (void)state;
    conf_fixture *f = conf_new("name = kept/after/the/file/is/gone\n");
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, NULL), FU_OK);
    const char *name = f->name;
    conf_destroy(&f); /* the file and the buffer that read it are gone */
    f = conf_new("steps = 12345678901234567890123456789 # overwrites the reader's line buffer\n");
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, NULL), FU_EINVAL);
    conf_destroy(&f);
    assert_string_equal(name, "kept/after/the/file/is/gone");
}

static void test_common_opts_command_line_overrides_file(void **state)
{
    (void)state;
    conf_fixture *f = conf_new("name = from-file\nsteps = 3\nlr = 0.25\n");
    char *argv[] = {"t", "--steps", "5", "pos", "--config", f->path, NULL};
    size_t npos = 0;
    int code = -1;
    assert_int_equal(fu_opts_parse(&f->cmd, 6, argv, &npos, &code), FU_OK);
    assert_int_equal(code, -1);
    assert_int_equal(f->steps, 5);              /* argv wins, though it came before --config */
    assert_string_equal(f->name, "from-file"); /* the file fills what argv does not give */
    assert_true(f->lr == 0.25);
    assert_string_equal(f->config, f->path);   /* --config itself is stored as usual */
    assert_int_equal(npos, 1);
    assert_string_equal(argv[1], "pos");
    conf_destroy(&f);
}

static void test_common_opts_config_equals_form_and_short_alias(void **state)
{
    (void)state;
    conf_fixture *f = conf_new("steps = 9\n");
    char arg[4300];
    snprintf(arg, sizeof arg, "--config=%s", f->path);
    char *a1[] = {"t", arg, NULL};
    size_t npos = 0;
    int code = -1;
    assert_int_equal(fu_opts_parse(&f->cmd, 2, a1, &npos, &code), FU_OK);
    assert_int_equal(f->steps, 9);

    f->steps = 1;
    char *a2[] = {"t", "-c", f->path, NULL};
    assert_int_equal(fu_opts_parse(&f->cmd, 3, a2, &npos, &code), FU_OK);
    assert_int_equal(f->steps, 9);

    /* After "--" it is a positional argument, and a value of another option is not --config. */
    f->steps = 1;
    char *a3[] = {"t", "--name", "--config", "--", "--config=/nonexistent/x.conf", NULL};
    assert_int_equal(fu_opts_parse(&f->cmd, 5, a3, &npos, &code), FU_OK);
    assert_int_equal(npos, 1);
    assert_string_equal(a3[1], "--config=/nonexistent/x.conf");
    assert_string_equal(f->name, "--config");
    assert_int_equal(f->steps, 1);
    conf_destroy(&f);
}

static void test_common_opts_file_unknown_key_names_line(void **state)
{
    (void)state;
    conf_expect_error("# threads\nsteps = 2\ntreads = 4\n",
                      "3: unknown setting 'treads' (see --help for the options)");
    /* Short letters and dashes are command-line spellings, not keys. */
    conf_expect_error("n = x\n", "1: unknown setting 'n' (see --help for the options)");
    conf_expect_error("--steps = 2\n", "1: unknown setting '--steps' (see --help for the options)");

    /* Through fu_opts_parse it is a usage error, and the command line is not applied. */
    conf_fixture *f = conf_new("treads = 4\n");
    char *argv[] = {"t", "--config", f->path, "--steps", "6", NULL};
    expect_usage_error(&f->cmd, argv);
    assert_int_equal(f->steps, 1);
    conf_destroy(&f);
}

static void test_common_opts_file_bad_values_refused(void **state)
{
    (void)state;
    conf_expect_error("\nsteps = abc\n", "2: --steps needs an integer, got 'abc'");
    conf_expect_error("steps = 1.5\n", "1: --steps needs an integer, got '1.5'");
    conf_expect_error("steps =\n", "1: --steps needs an integer, got ''");
    conf_expect_error("lr = fast\n", "1: --lr needs a number, got 'fast'");
    conf_expect_error("wait = maybe\n", "1: --wait needs true or false (yes/no, on/off, 1/0), got 'maybe'");
    conf_expect_error("steps 5\n", "1: expected 'key = value', got 'steps 5'");
    conf_expect_error("log-level = loud\n", "1: unknown log level 'loud' (debug, info, warn, error, off)");

    char *long_line = malloc(FU_OPTS_LINE_MAX + 16);
    assert_non_null(long_line);
    /* Exactly FU_OPTS_LINE_MAX bytes is fine; one more is refused, not cut. */
    memset(long_line, ' ', FU_OPTS_LINE_MAX);
    memcpy(long_line, "name = x", 8);
    strcpy(long_line + FU_OPTS_LINE_MAX, "\nsteps = 2\n");
    conf_fixture *f = conf_new(long_line);
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, NULL), FU_OK);
    assert_int_equal(f->steps, 2);
    conf_destroy(&f);
    memset(long_line, ' ', FU_OPTS_LINE_MAX + 1);
    memcpy(long_line, "name = x", 8);
    strcpy(long_line + FU_OPTS_LINE_MAX + 1, "\n");
    conf_expect_error(long_line, "1: line longer than 4096 bytes");
    free(long_line);
}

static void test_common_opts_file_cannot_set_config_help_version(void **state)
{
    (void)state;
    conf_expect_error("steps = 2\nconfig = other.conf\n",
                      "2: 'config' cannot be set from a config file (config files do not nest)");
    conf_expect_error("help = true\n", "1: 'help' cannot be set from a config file");
    conf_expect_error("version = yes\n", "1: 'version' cannot be set from a config file");
}

static void test_common_opts_file_missing_refused(void **state)
{
    (void)state;
    conf_fixture *f = conf_new("");
    char missing[4300], want[FU_ERRMSG_MAX + 4300];
    fu_errmsg em = {{0}};
    snprintf(missing, sizeof missing, "%s/absent.conf", f->dir);
    assert_int_equal(fu_opts_load_file(&f->cmd, missing, &em), FU_ENOTFOUND);
    snprintf(want, sizeof want, "cannot read config file '%s': No such file or directory", missing);
    assert_string_equal(em.msg, want);
    assert_int_equal(fu_opts_load_file(&f->cmd, f->dir, &em), FU_EIO); /* a directory */
    snprintf(want, sizeof want, "cannot read config file '%s': Is a directory", f->dir);
    assert_string_equal(em.msg, want);

    char *argv[] = {"t", "--config", missing, NULL};
    expect_usage_error(&f->cmd, argv);
    conf_destroy(&f);
}

/* Runs last: it fills the process-wide string storage for config files. */
static void test_common_opts_file_string_storage_is_bounded(void **state)
{
    (void)state;
    size_t n_lines = FU_OPTS_ARENA_SIZE / 4000 + 1;
    char *text = malloc(n_lines * 4010 + 1), *p = text;
    assert_non_null(text);
    for (size_t i = 0; i < n_lines; i++) {
        p += sprintf(p, "name = ");
        memset(p, 'a' + (int)(i % 26), 4000);
        p += 4000;
        *p++ = '\n';
    }
    *p = '\0';
    conf_fixture *f = conf_new(text);
    fu_errmsg em = {{0}};
    assert_int_equal(fu_opts_load_file(&f->cmd, f->path, &em), FU_ENOMEM);
    assert_non_null(strstr(em.msg, "config file strings exceed the 65536 bytes kept for them"));
    assert_int_equal(strlen(f->name), 4000); /* the lines before stay applied */
    conf_destroy(&f);
    free(text);
}

/* The profile challenge's check: every row of the plain-loop reference passes; a row computed
 * without the scale d, one with half the sum, one off by one unit in one entry's neighbourhood of
 * its magnitude, and a NaN all fail; elements are exact f32 in their ranges; sizes follow the claim. */
static void test_common_challenge_check_and_size(void **state)
{
    (void)state;
    uint8_t seed[FU_CHALLENGE_SEED_BYTES], go[FU_CHALLENGE_SEED_BYTES];
    for (unsigned i = 0; i < sizeof seed; i++) {
        seed[i] = (uint8_t)(i * 7 + 1);
        go[i] = (uint8_t)(i * 13 + 5);
    }
    const uint32_t n = 128;
    float *c = malloc((size_t)n * n * sizeof *c), *bad = malloc(n * sizeof *bad);
    fu_challenge_reference(seed, go, n, c);
    for (uint32_t i = 0; i < n; i++)
        assert_true(fu_challenge_check_row(seed, go, n, i, c + (size_t)i * n, 42 + i));
    /* the row of another d (the product made before GO) */
    uint8_t go2[FU_CHALLENGE_SEED_BYTES];
    memcpy(go2, go, sizeof go2);
    go2[0] ^= 1;
    float *c2 = malloc((size_t)n * n * sizeof *c2);
    fu_challenge_reference(seed, go2, n, c2);
    assert_false(fu_challenge_check_row(seed, go, n, 3, c2 + 3 * n, 7));
    /* half the sum: every entry halved */
    for (uint32_t j = 0; j < n; j++)
        bad[j] = c[5 * n + j] * 0.5f;
    assert_false(fu_challenge_check_row(seed, go, n, 5, bad, 7));
    /* every entry shifted by 1% of the row's largest entry */
    float big = 0;
    for (uint32_t j = 0; j < n; j++)
        big = fmaxf(big, fabsf(c[6 * n + j]));
    for (uint32_t j = 0; j < n; j++)
        bad[j] = c[6 * n + j] + 0.01f * big;
    assert_false(fu_challenge_check_row(seed, go, n, 6, bad, 7));
    memcpy(bad, c + 7 * n, n * sizeof *bad);
    for (uint32_t j = 0; j < n; j++)
        bad[j] = NAN;
    assert_false(fu_challenge_check_row(seed, go, n, 7, bad, 7));
    assert_false(fu_challenge_check_row(seed, go, n, n, c, 7)); /* no row n */
    /* elements: A and B in [-1, 1), d in [0.5, 1.5), k * 2^-23 */
    for (uint64_t k = 0; k < 1000; k++) {
        float a = fu_challenge_elem(seed, FU_CHALLENGE_A, k), d = fu_challenge_elem(go, FU_CHALLENGE_D, k);
        assert_true(a >= -1.0f && a < 1.0f && d >= 0.5f && d < 1.5f);
        assert_true(ldexpf(a, 23) == truncf(ldexpf(a, 23)));
    }
    /* commitment: changes with any row hash */
    uint8_t h[2 * FU_CHALLENGE_ROW_HASH] = {0}, c1[FU_CHALLENGE_COMMIT], cc[FU_CHALLENGE_COMMIT];
    fu_challenge_row_hash(c, n, h);
    fu_challenge_commit(h, 2, c1);
    h[FU_CHALLENGE_ROW_HASH] = 1;
    fu_challenge_commit(h, 2, cc);
    assert_memory_not_equal(c1, cc, sizeof cc);
    /* sizes: 0.3 s at 50 GFLOP/s is n = 1920 (a multiple of 64); clamped; memory bounds it */
    assert_int_equal(fu_challenge_size(50, 0.3, 0), 1920);
    assert_int_equal(fu_challenge_size(1e9, 0.3, 0), FU_CHALLENGE_N_MAX);
    assert_int_equal(fu_challenge_size(0.001, 0.3, 0), FU_CHALLENGE_N_MIN);
    assert_int_equal(fu_challenge_size(1e9, 0.3, 12ull * 1024 * 1024), 1024);
    assert_true(fu_challenge_flops(1000) == 2e9);
    free(c);
    free(c2);
    free(bad);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_common_strerror_covers_every_code),
        cmocka_unit_test(test_common_hex_round_trip),
        cmocka_unit_test(test_common_z85_matches_rfc32),
        cmocka_unit_test(test_common_budget_refuses_overdraw),
        cmocka_unit_test(test_common_clock_is_monotonic),
        cmocka_unit_test(test_common_log_levels_parse),
        cmocka_unit_test(test_common_opts_parse_values_and_positionals),
        cmocka_unit_test(test_common_opts_reject_bad_input),
        cmocka_unit_test(test_common_opts_file_sets_each_kind),
        cmocka_unit_test(test_common_opts_file_comments_blanks_and_whitespace),
        cmocka_unit_test(test_common_opts_file_string_outlives_file),
        cmocka_unit_test(test_common_opts_command_line_overrides_file),
        cmocka_unit_test(test_common_opts_config_equals_form_and_short_alias),
        cmocka_unit_test(test_common_opts_file_unknown_key_names_line),
        cmocka_unit_test(test_common_opts_file_bad_values_refused),
        cmocka_unit_test(test_common_challenge_check_and_size),
        cmocka_unit_test(test_common_opts_file_missing_refused),
        cmocka_unit_test(test_common_opts_file_cannot_set_config_help_version),
        cmocka_unit_test(test_common_opts_file_string_storage_is_bounded), /* last: fills the storage */
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
