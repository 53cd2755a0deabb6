#include "fu_unicode.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_unicode_internal.h"

/* Hangul syllables are composed and decomposed by arithmetic (Unicode 3.12). */
enum {
    H_SBASE = 0xAC00,
    H_LBASE = 0x1100,
    H_VBASE = 0x1161,
    H_TBASE = 0x11A7,
    H_LCOUNT = 19,
    H_VCOUNT = 21,
    H_TCOUNT = 28,
    H_NCOUNT = H_VCOUNT * H_TCOUNT,
    H_SCOUNT = H_LCOUNT * H_NCOUNT,
};

static bool in_ranges(const fu_uni_range *r, size_t n, uint32_t cp)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < r[mid].lo)
            hi = mid;
        else if (cp > r[mid].hi)
            lo = mid + 1;
        else
            return true;
    }
    return false;
}

bool fu_uni_is_letter(uint32_t cp)
{
    if (cp < 0x80)
        return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
    return in_ranges(fu_uni_letters, fu_uni_letters_n, cp);
}

bool fu_uni_is_number(uint32_t cp)
{
    if (cp < 0x80)
        return cp >= '0' && cp <= '9';
    return in_ranges(fu_uni_numbers, fu_uni_numbers_n, cp);
}

bool fu_uni_is_space(uint32_t cp)
{
    return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000 || cp == 0xFEFF;
}

const char *fu_uni_version(void)
{
    return fu_unicode_version;
}

static uint8_t ccc_of(uint32_t cp)
{
    if (cp < 0x300)
        return 0;
    size_t lo = 0, hi = fu_uni_ccc_table_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < fu_uni_ccc_table[mid].lo)
            hi = mid;
        else if (cp > fu_uni_ccc_table[mid].hi)
            lo = mid + 1;
        else
            return fu_uni_ccc_table[mid].ccc;
    }
    return 0;
}

static const fu_uni_decomp *decomp_of(uint32_t cp)
{
    size_t lo = 0, hi = fu_uni_decomp_table_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < fu_uni_decomp_table[mid].cp)
            hi = mid;
        else if (cp > fu_uni_decomp_table[mid].cp)
            lo = mid + 1;
        else
            return &fu_uni_decomp_table[mid];
    }
    return NULL;
}

/* The primary composite of (a, b), or 0. */
static uint32_t compose(uint32_t a, uint32_t b)
{
    if (a >= H_LBASE && a < H_LBASE + H_LCOUNT && b >= H_VBASE && b < H_VBASE + H_VCOUNT)
        return H_SBASE + ((a - H_LBASE) * H_VCOUNT + (b - H_VBASE)) * H_TCOUNT;
    if (a >= H_SBASE && a < H_SBASE + H_SCOUNT && (a - H_SBASE) % H_TCOUNT == 0 && b > H_TBASE &&
        b < H_TBASE + H_TCOUNT)
        return a + (b - H_TBASE);
    size_t lo = 0, hi = fu_uni_comp_table_n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const fu_uni_comp *c = &fu_uni_comp_table[mid];
        if (a < c->first || (a == c->first && b < c->second))
            hi = mid;
        else if (a > c->first || b > c->second)
            lo = mid + 1;
        else
            return c->composite;
    }
    return 0;
}

/* A growing array of code points; CP_BYTE | b stands for an invalid byte b kept as it is. */
#define CP_BYTE 0x80000000u
typedef struct {
    uint32_t *v;
    size_t n, cap;
} cpvec;

static void push(cpvec *c, uint32_t cp)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 64;
        c->v = fu_realloc(c->v, c->cap * sizeof *c->v);
    }
    c->v[c->n++] = cp;
}

/* One UTF-8 character at s[i]: its length, *cp = CP_BYTE | s[i] when malformed. */
static size_t next_cp(const uint8_t *s, size_t n, size_t i, uint32_t *cp)
{
    uint8_t c = s[i];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    uint32_t v = len == 1 ? c : len == 2 ? (c & 0x1Fu) : len == 3 ? (c & 0x0Fu) : (c & 0x07u);
    if (len == 0 || i + len > n) {
        *cp = CP_BYTE | c;
        return 1;
    }
    for (size_t k = 1; k < len; k++) {
        if ((s[i + k] & 0xC0) != 0x80) {
            *cp = CP_BYTE | c;
            return 1;
        }
        v = v << 6 | (s[i + k] & 0x3Fu);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        *cp = CP_BYTE | c;
        return 1;
    }
    *cp = v;
    return len;
}

static void decompose(cpvec *out, uint32_t cp)
{
    if (cp >= H_SBASE && cp < H_SBASE + H_SCOUNT) {
        uint32_t s = cp - H_SBASE, t = s % H_TCOUNT;
        push(out, H_LBASE + s / H_NCOUNT);
        push(out, H_VBASE + (s % H_NCOUNT) / H_TCOUNT);
        if (t)
            push(out, H_TBASE + t);
        return;
    }
    const fu_uni_decomp *d = cp >= 0xC0 && !(cp & CP_BYTE) ? decomp_of(cp) : NULL;
    if (!d) {
        push(out, cp);
        return;
    }
    for (uint8_t k = 0; k < d->n; k++)
        push(out, d->d[k]);
}

static uint8_t cls(uint32_t cp)
{
    return cp & CP_BYTE ? 0 : ccc_of(cp);
}

fu_err fu_uni_nfc(const char *text, size_t n, char **out, size_t *out_n)
{
    if ((!text && n) || !out || !out_n)
        return FU_EINVAL;
    const uint8_t *s = (const uint8_t *)text;
    cpvec c = {0};
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += next_cp(s, n, i, &cp);
        decompose(&c, cp);
    }
    /* canonical ordering: each run of non-starters sorted by class, stably (insertion sort) */
    for (size_t i = 1; i < c.n; i++) {
        uint8_t k = cls(c.v[i]);
        if (!k)
            continue;
        for (size_t j = i; j > 0 && cls(c.v[j - 1]) > k; j--) {
            uint32_t t = c.v[j];
            c.v[j] = c.v[j - 1];
            c.v[j - 1] = t;
        }
    }
    /* canonical composition: a character joins the last starter when nothing between them blocks
     * it: the character right after the starter, or one whose class is above every class since */
    size_t w = 0, starter = SIZE_MAX;
    int last = -1; /* class of the last character kept since the starter; -1: none */
    for (size_t i = 0; i < c.n; i++) {
        uint32_t cp = c.v[i];
        uint8_t k = cls(cp);
        if (starter != SIZE_MAX && !(cp & CP_BYTE) && !(c.v[starter] & CP_BYTE) &&
            (last == -1 || (last != 0 && last < k))) {
            uint32_t m = compose(c.v[starter], cp);
            if (m) {
                c.v[starter] = m;
                continue;
            }
        }
        if (k == 0) {
            starter = w;
            last = -1;
        } else {
            last = k;
        }
        c.v[w++] = cp;
    }
    c.n = w;
    char *buf = fu_malloc(4 * c.n + 1);
    size_t m = 0;
    for (size_t i = 0; i < c.n; i++) {
        uint32_t cp = c.v[i];
        if (cp & CP_BYTE)
            buf[m++] = (char)(cp & 0xFF);
        else if (cp < 0x80)
            buf[m++] = (char)cp;
        else if (cp < 0x800)
            buf[m++] = (char)(0xC0 | cp >> 6), buf[m++] = (char)(0x80 | (cp & 0x3F));
        else if (cp < 0x10000)
            buf[m++] = (char)(0xE0 | cp >> 12), buf[m++] = (char)(0x80 | (cp >> 6 & 0x3F)),
            buf[m++] = (char)(0x80 | (cp & 0x3F));
        else
            buf[m++] = (char)(0xF0 | cp >> 18), buf[m++] = (char)(0x80 | (cp >> 12 & 0x3F)),
            buf[m++] = (char)(0x80 | (cp >> 6 & 0x3F)), buf[m++] = (char)(0x80 | (cp & 0x3F));
    }
    buf[m] = '\0';
    free(c.v);
    *out = buf;
    *out_n = m;
    return FU_OK;
}
