/* Key files: `fusion keygen` run as a real process writes public.key and a 0600 secret.key, refuses
 * to overwrite without --force; the loader refuses loose permissions with a clear message,
 * mismatched pairs, symlinks and garbage. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "testutil.h"
#include "wire_keys.h"
#include "wire_zap.h"

static mode_t mode_of(const char *dir, const char *name)
{
    char p[8400];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    return st.st_mode & 07777;
}

static void test_wire_keys_keygen_process_writes_0600(void **state)
{
    (void)state;
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/k1", tu_dir);
    char *out = tu_fusion_expect_out(0, "public key: ", "keygen -o '%s'", dir);
    assert_int_equal(mode_of(dir, WIRE_SECRET_KEY_FILE), 0600);
    assert_int_equal(mode_of(dir, WIRE_PUBLIC_KEY_FILE), 0644);
    assert_int_equal(mode_of(tu_dir, "k1"), 0700);

    wire_keypair_t *kp = NULL;
    fu_errmsg em = {{0}};
    assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_OK);
    assert_non_null(strstr(out, wire_keypair_public_z85(kp))); /* what it printed is what it wrote */
    char first[WIRE_KEY_Z85_LEN + 1];
    strcpy(first, wire_keypair_public_z85(kp));
    wire_keypair_destroy(&kp);
    assert_null(kp);
    free(out);

    /* again: refused, keys untouched */
    out = tu_fusion_expect_out(1, "refusing to overwrite", "keygen -o '%s'", dir);
    assert_non_null(strstr(out, "--force"));
    free(out);
    assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_OK);
    assert_string_equal(wire_keypair_public_z85(kp), first);
    wire_keypair_destroy(&kp);

    /* --force replaces them, still 0600 */
    tu_fusion_expect(0, NULL, "keygen -o '%s' --force", dir);
    assert_int_equal(mode_of(dir, WIRE_SECRET_KEY_FILE), 0600);
    assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_OK);
    assert_string_not_equal(wire_keypair_public_z85(kp), first);
    wire_keypair_destroy(&kp);

    /* usage errors and the token mode */
    tu_fusion_expect(2, "-o DIR", "keygen");
    out = tu_fusion_expect_out(0, NULL, "keygen --token");
    assert_int_equal(strlen(out), WIRE_KEY_Z85_LEN + 1);
    free(out);
}

static void test_wire_keys_loose_permissions_refused(void **state)
{
    (void)state;
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/k2", tu_dir);
    wire_keypair_t *kp = wire_keypair_generate();
    fu_errmsg em = {{0}};
    assert_int_equal(wire_keypair_save(kp, dir, false, &em), FU_OK);
    wire_keypair_destroy(&kp);
    char sk[4300];
    snprintf(sk, sizeof sk, "%s/%s", dir, WIRE_SECRET_KEY_FILE);
    const mode_t loose[] = {0640, 0604, 0660, 0644, 0601, 0610};
    for (size_t i = 0; i < sizeof loose / sizeof loose[0]; i++) {
        assert_int_equal(chmod(sk, loose[i]), 0);
        em.msg[0] = '\0';
        assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_EPERM);
        assert_null(kp);
        assert_non_null(strstr(em.msg, "group or others"));
        assert_non_null(strstr(em.msg, "chmod 600"));
        assert_non_null(strstr(em.msg, sk));
    }
    assert_int_equal(chmod(sk, 0400), 0); /* stricter is fine */
    assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_OK);
    wire_keypair_destroy(&kp);
    assert_int_equal(chmod(sk, 0600), 0);

    /* a directory others may write is refused (they could swap the keys); readable is fine */
    const mode_t open_dirs[] = {0777, 0770, 0707, 0730};
    for (size_t i = 0; i < sizeof open_dirs / sizeof open_dirs[0]; i++) {
        assert_int_equal(chmod(dir, open_dirs[i]), 0);
        em.msg[0] = '\0';
        assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_EPERM);
        assert_null(kp);
        assert_non_null(strstr(em.msg, "chmod 700"));
        assert_non_null(strstr(em.msg, dir));
    }
    assert_int_equal(chmod(dir, 0755), 0);
    assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_OK);
    wire_keypair_destroy(&kp);
    assert_int_equal(chmod(dir, 0700), 0);

    /* a symlink to the secret key is refused */
    char dir2[4200], cmdout[16];
    (void)cmdout;
    snprintf(dir2, sizeof dir2, "%s/k2link", tu_dir);
    assert_int_equal(mkdir(dir2, 0700), 0);
    char link_path[4300], pub2[4300], pub[4300];
    snprintf(link_path, sizeof link_path, "%s/%s", dir2, WIRE_SECRET_KEY_FILE);
    snprintf(pub, sizeof pub, "%s/%s", dir, WIRE_PUBLIC_KEY_FILE);
    snprintf(pub2, sizeof pub2, "%s/%s", dir2, WIRE_PUBLIC_KEY_FILE);
    assert_int_equal(symlink(sk, link_path), 0);
    assert_int_equal(symlink(pub, pub2), 0);
    assert_int_equal(wire_keypair_load(dir2, &kp, &em), FU_EPERM);
    assert_non_null(strstr(em.msg, "symbolic link"));
}

static void test_wire_keys_bad_files_refused(void **state)
{
    (void)state;
    fu_errmsg em = {{0}};
    wire_keypair_t *kp = NULL;
    /* missing */
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/none", tu_dir);
    assert_int_equal(wire_keypair_load(dir, &kp, &em), FU_ENOTFOUND);
    assert_non_null(strstr(em.msg, "fusion keygen"));

    /* a public key that is not the secret key's */
    char d1[4200], d2[4200];
    snprintf(d1, sizeof d1, "%s/a", tu_dir);
    snprintf(d2, sizeof d2, "%s/b", tu_dir);
    wire_keypair_t *a = wire_keypair_generate(), *b = wire_keypair_generate();
    assert_int_equal(wire_keypair_save(a, d1, false, &em), FU_OK);
    assert_int_equal(wire_keypair_save(b, d2, false, &em), FU_OK);
    assert_int_equal(wire_keypair_save(b, d2, false, &em), FU_EEXIST);
    tu_sh_expect(0, NULL, "cp '%s/public.key' '%s/public.key'", d2, d1);
    assert_int_equal(wire_keypair_load(d1, &kp, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "does not belong"));

    /* the public key alone loads */
    char p2[4300];
    uint8_t pk[WIRE_KEY_BYTES];
    snprintf(p2, sizeof p2, "%s/public.key", d2);
    assert_int_equal(wire_key_load_public(p2, pk, &em), FU_OK);
    assert_memory_equal(pk, wire_keypair_public(b), WIRE_KEY_BYTES);

    /* garbage content */
    FILE *f = fopen(p2, "w");
    fprintf(f, "# comment only\nnot a key at all\n");
    fclose(f);
    assert_int_equal(wire_key_load_public(p2, pk, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "40 Z85"));
    assert_int_equal(wire_key_from_z85("short", pk), FU_EINVAL);
    char z[WIRE_KEY_Z85_LEN + 1];
    wire_key_to_z85(wire_keypair_public(a), z);
    assert_int_equal(wire_key_from_z85(z, pk), FU_OK);
    assert_memory_equal(pk, wire_keypair_public(a), WIRE_KEY_BYTES);
    wire_keypair_destroy(&a);
    wire_keypair_destroy(&b);
}

/* An enrolment token from a file: one line as `fusion keygen --token` prints it, in a file closed to
 * group and others (it is a credential); anything else is refused with a sentence. */
static void test_wire_keys_token_file(void **state)
{
    (void)state;
    char path[4200], tok[WIRE_TOKEN_Z85_LEN + 1], got[WIRE_TOKEN_Z85_LEN + 1];
    snprintf(path, sizeof path, "%s/token", tu_dir);
    wire_token_generate(tok);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fprintf(fp, "%s\n", tok);
    fclose(fp);
    assert_int_equal(chmod(path, 0600), 0);
    fu_errmsg em = {{0}};
    assert_int_equal(wire_token_load(path, got, &em), FU_OK);
    assert_string_equal(got, tok);
    const char *chosen = NULL;
    assert_int_equal(wire_token_choose(path, "ignored", "FUSION_ENROL_TOKEN", got, &chosen, &em), FU_OK); /* the file wins */
    assert_string_equal(chosen, tok);
    assert_int_equal(chmod(path, 0644), 0);
    assert_int_equal(wire_token_load(path, got, &em), FU_EPERM);
    assert_non_null(strstr(em.msg, "chmod 600"));
    fp = fopen(path, "w");
    assert_non_null(fp);
    fputs("not a token\n", fp);
    fclose(fp);
    assert_int_equal(chmod(path, 0600), 0);
    assert_int_equal(wire_token_load(path, got, &em), FU_EINVAL);
    assert_non_null(strstr(em.msg, "fusion keygen --token"));
    snprintf(path, sizeof path, "%s/missing", tu_dir);
    assert_int_equal(wire_token_load(path, got, &em), FU_ENOTFOUND);
    /* no file, no argument: the environment */
    setenv("FUSION_ENROL_TOKEN", tok, 1);
    assert_int_equal(wire_token_choose(NULL, NULL, "FUSION_ENROL_TOKEN", got, &chosen, &em), FU_OK);
    assert_string_equal(chosen, tok);
    unsetenv("FUSION_ENROL_TOKEN");
    assert_int_equal(wire_token_choose(NULL, NULL, "FUSION_ENROL_TOKEN", got, &chosen, &em), FU_OK);
    assert_null(chosen);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire_keys_keygen_process_writes_0600),
        cmocka_unit_test(test_wire_keys_loose_permissions_refused),
        cmocka_unit_test(test_wire_keys_bad_files_refused),
        cmocka_unit_test(test_wire_keys_token_file),
    };
    return tu_unit_main(tests, sodium_init, tu_tmpdir_setup, tu_tmpdir_teardown);
}
