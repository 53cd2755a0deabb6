#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_encode.h"
#include "fu_err.h"
#include "fu_log.h"
#include "fu_opts.h"

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

static void test_common_opts_reject_bad_input(void **state)
{
    (void)state;
    long long steps = 7;
    const fu_opt opts[] = {{"steps", 0, FU_OPT_INT, &steps, "N", ""}};
    const fu_cmd cmd = {.prog = "t", .opts = opts, .n_opts = 1, .min_pos = 0, .max_pos = 0};
    size_t npos;
    int code;
    char *a1[] = {"t", "--steps", "ten", NULL};
    assert_int_equal(fu_opts_parse(&cmd, 3, a1, &npos, &code), FU_ECANCELED);
    assert_int_equal(code, FU_EXIT_USAGE);
    assert_int_equal(steps, 7);
    char *a2[] = {"t", "--nope", NULL};
    assert_int_equal(fu_opts_parse(&cmd, 2, a2, &npos, &code), FU_ECANCELED);
    assert_int_equal(code, FU_EXIT_USAGE);
    char *a3[] = {"t", "--steps", NULL};
    assert_int_equal(fu_opts_parse(&cmd, 2, a3, &npos, &code), FU_ECANCELED);
    char *a4[] = {"t", "extra", NULL};
    assert_int_equal(fu_opts_parse(&cmd, 2, a4, &npos, &code), FU_ECANCELED);
    assert_int_equal(code, FU_EXIT_USAGE);
    char *a5[] = {"t", "--log-level", "loud", NULL};
    assert_int_equal(fu_opts_parse(&cmd, 3, a5, &npos, &code), FU_ECANCELED);
    assert_int_equal(code, FU_EXIT_USAGE);
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
