/* peer_cache: the blob cache's size limit (docs/PEER.md "Blobs"): least recently used
 * first, the kept blob never, files the cache does not own never, 0 = no limit, a missing
 * directory is fine, a touch makes a file the newest; and through peer_blob: a hit touches, a
 * write trims. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <sodium.h>

#include "fu_file.h"
#include "fu_encode.h"
#include "peer_blob.h"
#include "peer_cache.h"
#include "testutil.h"

/* A 64-hex name made of one repeated char ('a' -> "aaaa...a"). */
static void hexname(char out[PEER_CACHE_NAME_LEN + 1], char c)
{
    memset(out, c, PEER_CACHE_NAME_LEN);
    out[PEER_CACHE_NAME_LEN] = '\0';
}

/* hexname(c) in static storage that lasts the whole run. */
static const char *name_of(char c)
{
    static char names[256][PEER_CACHE_NAME_LEN + 1];
    char *n = names[(unsigned char)c];
    hexname(n, c);
    return n;
}

/* Writes size bytes to dir/name with mtime t (seconds since the epoch). */
static void put(const char *dir, const char *name, size_t size, time_t t)
{
    char *path = fu_path_join(dir, name);
    char *buf = calloc(1, size ? size : 1);
    assert_non_null(buf);
    assert_int_equal(fu_file_write_atomic(path, buf, size, 0600, NULL), FU_OK);
    struct timespec ts[2] = {{.tv_sec = t}, {.tv_sec = t}};
    assert_int_equal(utimensat(AT_FDCWD, path, ts, 0), 0);
    free(buf);
    free(path);
}

static bool has(const char *dir, const char *name)
{
    char *path = fu_path_join(dir, name);
    bool e = fu_path_exists(path);
    free(path);
    return e;
}

/* Trims dir to max bytes (keeping `keep`, NULL: none), which must succeed, and returns how many bytes
 * it freed. */
static uint64_t trimmed(const char *dir, uint64_t max, const char *keep)
{
    uint64_t freed = 7;
    fu_errmsg em = {{0}};
    fu_err rc = peer_cache_trim(dir, max, keep, &freed, &em);
    if (rc != FU_OK)
        fail_msg("trimming %s to %llu: %s", dir, (unsigned long long)max, fu_errmsg_text(&em, rc));
    return freed;
}

static void test_peer_cache_trim_evicts_oldest_first(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    const char *a = name_of('a'), *b = name_of('b'), *c = name_of('c'), *d = name_of('d');
    /* b is the oldest, then d, c, a. 400 bytes in all. */
    put(dir, a, 100, 4000);
    put(dir, b, 100, 1000);
    put(dir, c, 100, 3000);
    put(dir, d, 100, 2000);
    /* Under the limit already: nothing goes. */
    assert_int_equal(trimmed(dir, 400, NULL), 0);
    assert_true(has(dir, a) && has(dir, b) && has(dir, c) && has(dir, d));
    /* 250: the two oldest go (b then d), the two newest stay. */
    assert_int_equal(trimmed(dir, 250, NULL), 200);
    assert_false(has(dir, b));
    assert_false(has(dir, d));
    assert_true(has(dir, a) && has(dir, c));
    /* 199: c (older) goes, a stays. */
    assert_int_equal(trimmed(dir, 199, NULL), 100);
    assert_false(has(dir, c));
    assert_true(has(dir, a));
}

static void test_peer_cache_trim_never_deletes_the_kept_blob(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    const char *a = name_of('a'), *b = name_of('b'), *k = name_of('0');
    put(dir, k, 500, 1000); /* the oldest and alone over the limit */
    put(dir, a, 10, 2000);
    put(dir, b, 10, 3000);
    assert_int_equal(trimmed(dir, 100, k), 20);
    assert_true(has(dir, k));
    assert_false(has(dir, a));
    assert_false(has(dir, b));
    /* Again: only the kept one is left, nothing to do, no error. */
    assert_int_equal(trimmed(dir, 100, k), 0);
    assert_true(has(dir, k));
}

static void test_peer_cache_trim_ignores_files_it_does_not_own(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    const char *a = name_of('a'), *sub = name_of('1'), *link = name_of('2');
    const char *upper = name_of('A'); /* upper case: not a name peer_blob writes */
    char longer[66], shorter[64];
    memset(longer, 'e', 65); /* 65 chars */
    longer[65] = '\0';
    memset(shorter, 'e', 63); /* 63 chars */
    shorter[63] = '\0';
    put(dir, a, 100, 5000);
    put(dir, upper, 1000, 1000);
    put(dir, longer, 1000, 1000);
    put(dir, shorter, 1000, 1000);
    put(dir, ".stage-1-00-0.safetensors", 1000, 1000);
    put(dir, "notes.txt", 1000, 1000);
    char *sp = fu_path_join(dir, sub);
    assert_int_equal(mkdir(sp, 0700), 0);
    put(sp, a, 1000, 1000); /* a hash-named file inside a subdirectory: not looked at */
    char *lp = fu_path_join(dir, link);
    char *target = fu_path_join(dir, "notes.txt");
    assert_int_equal(symlink(target, lp), 0);
    /* Only a counts (100 bytes): under 150, nothing goes. */
    assert_int_equal(trimmed(dir, 150, NULL), 0);
    /* Under 50: a goes, nothing else does. */
    assert_int_equal(trimmed(dir, 50, NULL), 100);
    assert_false(has(dir, a));
    assert_true(has(dir, upper) && has(dir, longer) && has(dir, shorter));
    assert_true(has(dir, ".stage-1-00-0.safetensors") && has(dir, "notes.txt"));
    assert_true(fu_path_is_dir(sp));
    assert_true(has(sp, a));
    struct stat st;
    assert_int_equal(lstat(lp, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    free(sp);
    free(lp);
    free(target);
}

static void test_peer_cache_trim_zero_is_unlimited_and_missing_dir_ok(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    const char *a = name_of('a');
    put(dir, a, 1000, 1000);
    assert_int_equal(trimmed(dir, 0, NULL), 0);
    assert_true(has(dir, a));
    char *missing = fu_path_join(dir, "no-such-dir");
    assert_int_equal(trimmed(missing, 1, NULL), 0);
    uint64_t freed = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(peer_cache_trim(NULL, 1, NULL, &freed, &em), FU_EINVAL);
    /* A file where the directory should be: an error with a sentence, no abort. */
    char *file = fu_path_join(dir, a);
    assert_int_equal(peer_cache_trim(file, 1, NULL, &freed, &em), FU_EIO);
    assert_non_null(strstr(em.msg, "cache directory"));
    free(file);
    free(missing);
}

static void test_peer_cache_touch_makes_a_file_newest(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    const char *a = name_of('a'), *b = name_of('b');
    put(dir, a, 100, 1000); /* the oldest ... */
    put(dir, b, 100, 2000);
    char *pa = fu_path_join(dir, a);
    fu_errmsg em = {{0}};
    assert_int_equal(peer_cache_touch(pa, &em), FU_OK); /* ... until it is used */
    assert_int_equal(trimmed(dir, 150, NULL), 100);
    assert_true(has(dir, a));
    assert_false(has(dir, b));
    char *pb = fu_path_join(dir, b);
    assert_int_equal(peer_cache_touch(pb, &em), FU_ENOTFOUND);
    assert_true(em.msg[0] != '\0');
    free(pa);
    free(pb);
}

/* Answers b's requests as a broker would, one chunk per request, until it is done. */
static void serve(peer_blob_t *b, const uint8_t *blob, size_t len, const uint8_t hash[32], bool *hit)
{
    Fusion__WeightRequest req;
    bool done = false;
    int guard = 0;
    while (!done && guard++ < 10 && peer_blob_request(b, 1000, &req)) {
        uint64_t end = req.offset + req.length < len ? req.offset + req.length : len;
        Fusion__WeightChunk c = FUSION__WEIGHT_CHUNK__INIT;
        c.model_id = (char *)"m:x";
        c.tensor_name = (char *)"w";
        c.offset = req.offset;
        c.total = len;
        c.content_hash.data = (uint8_t *)hash;
        c.content_hash.len = 32;
        c.data.data = (uint8_t *)blob + req.offset;
        c.data.len = (size_t)(end - req.offset);
        c.dtype = FUSION__DTYPE__DTYPE_U8;
        int64_t shape[1] = {(int64_t)len};
        c.shape = shape;
        c.n_shape = 1;
        assert_int_equal(peer_blob_feed(b, &c, 1000, &done), FU_OK);
    }
    assert_true(done);
    peer_blob_counters(b, NULL, NULL, hit);
}

static void test_peer_cache_blob_write_trims_and_hit_touches(void **state)
{
    (void)state;
    const char *dir = tu_dir;
    const char *x = name_of('a'), *y = name_of('b');
    char hex[65];
    put(dir, x, 1000, 1000);
    put(dir, y, 1000, 2000);
    uint8_t blob[1000], hash[32];
    for (size_t i = 0; i < sizeof blob; i++)
        blob[i] = (uint8_t)(i * 7 + 1);
    peer_blob_hash(hash, blob, sizeof blob);
    fu_hex_encode(hex, hash, 32);
    /* Fetched and written: 3000 bytes over 2500, the oldest (x) goes, the new blob stays. */
    bool hit = true;
    peer_blob_t *b = peer_blob_new("m:x", "w", dir, 1u << 20);
    peer_blob_set_cache_max(b, 2500);
    serve(b, blob, sizeof blob, hash, &hit);
    assert_false(hit);
    peer_blob_destroy(&b);
    assert_false(has(dir, x));
    assert_true(has(dir, y) && has(dir, hex));
    /* Make the blob the oldest, then use it from the cache: the hit makes it the newest. */
    char *path = fu_path_join(dir, hex);
    struct timespec ts[2] = {{.tv_sec = 500}, {.tv_sec = 500}};
    assert_int_equal(utimensat(AT_FDCWD, path, ts, 0), 0);
    b = peer_blob_new("m:x", "w", dir, 1u << 20);
    peer_blob_set_cache_max(b, 2500);
    serve(b, blob, sizeof blob, hash, &hit);
    assert_true(hit);
    peer_blob_destroy(&b);
    assert_int_equal(trimmed(dir, 1500, NULL), 1000);
    assert_false(has(dir, y));
    assert_true(has(dir, hex));
    free(path);
}

static void test_peer_cache_is_name(void **state)
{
    (void)state;
    char n[66];
    hexname(n, 'f');
    assert_true(peer_cache_is_name(n));
    n[10] = 'g';
    assert_false(peer_cache_is_name(n));
    hexname(n, 'F');
    assert_false(peer_cache_is_name(n));
    assert_false(peer_cache_is_name(""));
    assert_false(peer_cache_is_name(NULL));
    assert_false(peer_cache_is_name("0123"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_peer_cache_trim_evicts_oldest_first),
        cmocka_unit_test(test_peer_cache_trim_never_deletes_the_kept_blob),
        cmocka_unit_test(test_peer_cache_trim_ignores_files_it_does_not_own),
        cmocka_unit_test(test_peer_cache_trim_zero_is_unlimited_and_missing_dir_ok),
        cmocka_unit_test(test_peer_cache_touch_makes_a_file_newest),
        cmocka_unit_test(test_peer_cache_blob_write_trims_and_hit_touches),
        cmocka_unit_test(test_peer_cache_is_name),
    };
    return tu_unit_main(tests, sodium_init, tu_tmpdir_setup, tu_tmpdir_teardown);
}
