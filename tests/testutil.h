/* Helpers for tests: run a fusion program as a real process and capture what it prints, find the
 * build's programs, make and remove scratch directories. With cmocka (cmocka.h included first): check
 * what a command exits with and prints, the main of a unit-test file; with wire_seal.h or
 * fu_modelcfg.h included first, a sealed link's two ends and a model config on one line. Header-only
 * so each test executable stays one file. */
#ifndef FU_TESTUTIL_H
#define FU_TESTUTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

/* Path of a built program ("fusion", "fusion-broker") in FUSION_BIN_DIR; static buffer. */
static inline const char *tu_bin(const char *name)
{
    static char path[4096];
    const char *dir = getenv("FUSION_BIN_DIR");
    snprintf(path, sizeof path, "%s/%s", dir ? dir : "../bin", name);
    return path;
}

/* Runs a shell command line, captures stdout+stderr into *out (caller frees), returns the exit code
 * (128+signal if it was killed, -1 if it could not be started). */
static inline int tu_sh(char **out, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[8300];
    snprintf(full, sizeof full, "(%s) 2>&1", cmd);
    FILE *p = popen(full, "r");
    if (!p)
        return -1;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, p)) > 0) {
        len += n;
        if (cap - len < 1024) {
            cap *= 2;
            buf = realloc(buf, cap);
        }
    }
    if (buf)
        buf[len] = '\0';
    int st = pclose(p);
    if (out)
        *out = buf;
    else
        free(buf);
    if (st == -1)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Competing load for tests that assert on timing (docs/TESTING.md): n busy-loop processes, one per
 * core by default (n = 0), started by the test and stopped by tu_load_stop (they also die with the
 * test: PR_SET_PDEATHSIG). At most 16. */
#define TU_LOAD_MAX 16
static pid_t tu_load_pids[TU_LOAD_MAX];

static inline int tu_load_start(int n)
{
    if (n <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n = c > 0 ? (int)c : 1;
    }
    if (n > TU_LOAD_MAX)
        n = TU_LOAD_MAX;
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            volatile unsigned long x = 0;
            for (;;)
                x++;
        }
        tu_load_pids[i] = pid > 0 ? pid : 0;
    }
    return n;
}

static inline void tu_load_stop(void)
{
    for (int i = 0; i < TU_LOAD_MAX; i++)
        if (tu_load_pids[i] > 0) {
            kill(tu_load_pids[i], SIGKILL);
            waitpid(tu_load_pids[i], NULL, 0);
            tu_load_pids[i] = 0;
        }
}

/* Makes a fresh scratch directory under TMPDIR; returns its path (caller frees). */
static inline char *tu_tmpdir(const char *tag)
{
    const char *base = getenv("TMPDIR");
    char tmpl[4096];
    snprintf(tmpl, sizeof tmpl, "%s/fusion-%s-XXXXXX", base ? base : "/tmp", tag);
    char *d = mkdtemp(tmpl);
    return d ? strdup(d) : NULL;
}

/* Removes the directory *dir_p and everything under it, frees the path and sets *dir_p to NULL; a
 * NULL *dir_p is fine. Returns rm's exit code (0: removed). */
static inline int tu_tmpdir_remove(char **dir_p)
{
    if (!*dir_p)
        return 0;
    int rc = tu_sh(NULL, "rm -rf '%s'", *dir_p);
    free(*dir_p);
    *dir_p = NULL;
    return rc;
}

/* The scratch directory of a test file that uses tu_tmpdir_setup/tu_tmpdir_teardown as its cmocka
 * fixtures: made before (each, or the group of) its tests, removed after. */
static char *tu_dir;

static inline int tu_tmpdir_setup(void **state)
{
    (void)state;
    tu_dir = tu_tmpdir("test");
    return tu_dir ? 0 : -1;
}

static inline int tu_tmpdir_teardown(void **state)
{
    (void)state;
    return tu_tmpdir_remove(&tu_dir) == 0 ? 0 : -1;
}

/* ---- with cmocka (a test that includes cmocka.h before this file) ------------------------------ */
#ifdef cmocka_unit_test

/* Runs a shell command line like tu_sh and fails the test at the caller's line, showing the command
 * and what it printed, unless it exits want_rc and its output holds want_text (NULL: anything).
 * Returns the output (caller frees). Called through tu_sh_expect / tu_sh_expect_out. */
__attribute__((format(printf, 5, 6))) static inline char *
tu_sh_expect_at(const char *file, int line, int want_rc, const char *want_text, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char *out = NULL;
    int rc = tu_sh(&out, "%s", cmd);
    if (rc != want_rc || !out || (want_text && !strstr(out, want_text))) {
        print_error("ERROR: `%s` exited %d (expected %d%s%s%s), output:\n%s\n", cmd, rc, want_rc,
                    want_text ? ", output with '" : "", want_text ? want_text : "", want_text ? "'" : "",
                    out ? out : "(none)");
        free(out);
        _fail(file, line);
    }
    return out;
}
#define tu_sh_expect_out(want_rc, want_text, ...)                                                            \
    tu_sh_expect_at(__FILE__, __LINE__, want_rc, want_text, __VA_ARGS__)
#define tu_sh_expect(want_rc, want_text, ...) free(tu_sh_expect_out(want_rc, want_text, __VA_ARGS__))
/* The same for the build's `fusion` with the arguments fmt (a string literal). */
#define tu_fusion_expect_out(want_rc, want_text, fmt, ...)                                                   \
    tu_sh_expect_out(want_rc, want_text, "%s " fmt, tu_bin("fusion"), ##__VA_ARGS__)
#define tu_fusion_expect(want_rc, want_text, fmt, ...)                                                       \
    tu_sh_expect(want_rc, want_text, "%s " fmt, tu_bin("fusion"), ##__VA_ARGS__)

/* A row of a table of command lines and what each must do: exit rc and print says (NULL: anything). */
typedef struct {
    const char *args;
    int rc;
    const char *says;
} tu_cmd_case;

/* The main of a unit-test file: runs init first when given (sodium_init in the files that use
 * libsodium; a negative result ends it with 1), then each test of the array between setup and
 * teardown (NULL: none), except the tests whose entries name their own fixtures. Returns what
 * cmocka_run_group_tests returns. Called through tu_unit_main. */
static inline int tu_unit_main_n(const char *group, const struct CMUnitTest *tests, size_t n,
                                 int (*init)(void), CMFixtureFunction setup, CMFixtureFunction teardown)
{
    if (init && init() < 0)
        return 1;
    struct CMUnitTest *each = calloc(n, sizeof *each);
    if (!each)
        return 1;
    for (size_t i = 0; i < n; i++) {
        each[i] = tests[i];
        if (!each[i].setup_func && !each[i].teardown_func) {
            each[i].setup_func = setup;
            each[i].teardown_func = teardown;
        }
    }
    int rc = _cmocka_run_group_tests(group, each, n, NULL, NULL);
    free(each);
    return rc;
}
#define tu_unit_main(tests, init, setup, teardown)                                                           \
    tu_unit_main_n(#tests, tests, sizeof(tests) / sizeof((tests)[0]), init, setup, teardown)

#endif /* cmocka_unit_test */

/* ---- with cmocka and wire_seal.h (both included before this file) -------------------------------- */
#if defined(cmocka_unit_test) && defined(FU_WIRE_SEAL_H)

/* Both ends of a sealed link between two fresh key pairs, made as two stages make it: *a seals for
 * *b and *b for *a, each side's ephemeral key pair consumed by wire_seal_new. The ephemeral public
 * keys that travelled in the SealHellos go to a_eph/b_eph (WIRE_KEY_BYTES each) unless NULL. Fails
 * the test when the link cannot be made. tu_seal_pair_free frees all four. */
static inline void tu_seal_pair(wire_keypair_t **a_kp, wire_keypair_t **b_kp, wire_seal_t **a,
                                wire_seal_t **b, uint8_t *a_eph, uint8_t *b_eph)
{
    *a_kp = wire_keypair_generate();
    *b_kp = wire_keypair_generate();
    assert_non_null(*a_kp);
    assert_non_null(*b_kp);
    wire_seal_eph_t *ea = wire_seal_eph_new(), *eb = wire_seal_eph_new();
    uint8_t pa[WIRE_KEY_BYTES], pb[WIRE_KEY_BYTES];
    memcpy(pa, wire_seal_eph_public(ea), WIRE_KEY_BYTES);
    memcpy(pb, wire_seal_eph_public(eb), WIRE_KEY_BYTES);
    fu_err rc;
    *a = wire_seal_new(*a_kp, wire_keypair_public(*b_kp), &ea, pb, &rc);
    *b = wire_seal_new(*b_kp, wire_keypair_public(*a_kp), &eb, pa, &rc);
    assert_non_null(*a);
    assert_non_null(*b);
    assert_null(ea); /* consumed */
    assert_null(eb);
    if (a_eph)
        memcpy(a_eph, pa, WIRE_KEY_BYTES);
    if (b_eph)
        memcpy(b_eph, pb, WIRE_KEY_BYTES);
}

static inline void tu_seal_pair_free(wire_keypair_t **a_kp, wire_keypair_t **b_kp, wire_seal_t **a,
                                     wire_seal_t **b)
{
    wire_seal_destroy(a);
    wire_seal_destroy(b);
    wire_keypair_destroy(a_kp);
    wire_keypair_destroy(b_kp);
}

#endif /* cmocka_unit_test && FU_WIRE_SEAL_H */

/* ---- with fu_modelcfg.h (included before this file) ---------------------------------------------- */
#ifdef FU_MODELCFG_H

#define TU_MODELCFG_TEXT_MAX 512 /* the longest tu_modelcfg_text */

/* Every field of a model config on one line, for comparing a config with what a test expects in one
 * assert_string_equal (a mismatch prints both lines):
 * "llama LlamaForCausalLM float32 layers 2 hidden 64 heads 4/2 head_dim 16 ffn 128 vocab 256
 * max_pos 2048 eps 1e-06 theta 10000 tied 0 bos -1 eos -1 window 0" (one line). Writes buf (n bytes)
 * and returns it. */
static inline const char *tu_modelcfg_text(const fu_modelcfg *c, char *buf, size_t n)
{
    snprintf(buf, n,
             "%s %s %s layers %zu hidden %zu heads %zu/%zu head_dim %zu ffn %zu vocab %zu max_pos %zu eps %g "
             "theta %g tied %d bos %lld eos %lld window %zu",
             c->model_type, c->architecture, c->torch_dtype, c->num_hidden_layers, c->hidden_size,
             c->num_attention_heads, c->num_key_value_heads, c->head_dim, c->intermediate_size, c->vocab_size,
             c->max_position_embeddings, c->rms_norm_eps, c->rope_theta, (int)c->tie_word_embeddings,
             (long long)c->bos_token_id, (long long)c->eos_token_id, c->sliding_window);
    return buf;
}

#endif /* FU_MODELCFG_H */

#endif
