/* fu_tokenizer_encode: text -> token ids (see fu_tokenizer.h): added tokens matched in the raw text,
 * the pre-tokenizers that cut the rest into words (GPT-2's split and the Llama-3 / Qwen2 one, on
 * character classes), and byte-level BPE of each word (merges by rank with a heap). */
#include "fu_tokenizer.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_tokenizer_internal.h"
#include "fu_unicode.h"

typedef struct {
    int32_t *v;
    size_t   n, cap;
} idvec;

static void idvec_push(idvec *v, int32_t id)
{
    if (v->n == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 64;
        v->v = fu_realloc(v->v, v->cap * sizeof *v->v);
    }
    v->v[v->n++] = id;
}

enum { CL_LETTER, CL_NUMBER, CL_SPACE, CL_OTHER };

/* \p{L}, \p{N}, \s (JavaScript's, as transformers.js: the conformance reference) or anything else. */
static int char_class(uint32_t cp)
{
    if (cp == CP_INVALID)
        return CL_OTHER;
    if (fu_uni_is_letter(cp))
        return CL_LETTER;
    if (fu_uni_is_number(cp))
        return CL_NUMBER;
    if (fu_uni_is_space(cp))
        return CL_SPACE;
    return CL_OTHER;
}

/* Where the run of at most max characters of class cl that starts at s[j] ends. */
static size_t run_end(const uint8_t *s, size_t n, size_t j, int cl, size_t max)
{
    uint32_t cp;
    for (size_t k = 0; j < n && k < max; k++) {
        size_t l = fu_tok_utf8_next(s, n, j, &cp);
        if (char_class(cp) != cl)
            break;
        j += l;
    }
    return j;
}

/* Length of the GPT-2 pre-token starting at s[i] (the regex
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ ). */
static size_t gpt2_piece(const uint8_t *s, size_t n, size_t i)
{
    if (s[i] == '\'' && i + 1 < n) {
        uint8_t c = s[i + 1];
        if (c == 's' || c == 't' || c == 'm' || c == 'd')
            return 2;
        if (i + 2 < n && ((c == 'r' && s[i + 2] == 'e') || (c == 'v' && s[i + 2] == 'e') || (c == 'l' && s[i + 2] == 'l')))
            return 3;
    }
    uint32_t cp;
    size_t j = i, len = fu_tok_utf8_next(s, n, j, &cp);
    int cl = char_class(cp);
    if (cl == CL_SPACE && s[i] == ' ' && i + 1 < n) {
        uint32_t cp1;
        fu_tok_utf8_next(s, n, i + 1, &cp1);
        int cl1 = char_class(cp1);
        if (cl1 != CL_SPACE) {
            j = i + 1;
            cl = cl1;
            len = 0;
        }
    }
    if (cl != CL_SPACE)
        return run_end(s, n, j + len, cl, SIZE_MAX) - i;
    /* A run of spaces: all of it at the end of the text; otherwise all but its last character
     * (which then prefixes the next word), or the single character when the run has one. */
    size_t last = i;
    while (j < n) {
        size_t l2 = fu_tok_utf8_next(s, n, j, &cp);
        if (char_class(cp) != CL_SPACE)
            break;
        last = j;
        j += l2;
    }
    if (j == n || last == i)
        return j - i;
    return last - i;
}

/* Length of the Llama-3 / Qwen2 pre-token starting at s[i] (the regex
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*
 * |\s*[\r\n]+|\s+(?!\S)|\s+  with D = max_digits). */
static size_t llama3_piece(const uint8_t *s, size_t n, size_t i, size_t max_digits)
{
    if (s[i] == '\'' && i + 1 < n) {
        uint8_t c = s[i + 1] | 0x20;
        if (c == 's' || c == 't' || c == 'm' || c == 'd')
            return 2;
        if (i + 2 < n) {
            uint8_t c2 = s[i + 2] | 0x20;
            if ((c == 'r' && c2 == 'e') || (c == 'v' && c2 == 'e') || (c == 'l' && c2 == 'l'))
                return 3;
        }
    }
    uint32_t cp, cp1 = CP_INVALID;
    size_t len = fu_tok_utf8_next(s, n, i, &cp), j;
    int cl = char_class(cp), cl1 = -1;
    if (i + len < n) {
        fu_tok_utf8_next(s, n, i + len, &cp1);
        cl1 = char_class(cp1);
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (cl == CL_LETTER || (cl1 == CL_LETTER && cl != CL_NUMBER && cp != '\r' && cp != '\n')) {
        return run_end(s, n, cl == CL_LETTER ? i : i + len, CL_LETTER, SIZE_MAX) - i;
    }
    /* \p{N}{1,D} */
    if (cl == CL_NUMBER)
        return run_end(s, n, i, CL_NUMBER, max_digits) - i;
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    if (cl == CL_OTHER || (s[i] == ' ' && cl1 == CL_OTHER)) {
        j = run_end(s, n, cl == CL_OTHER ? i : i + 1, CL_OTHER, SIZE_MAX);
        while (j < n && (s[j] == '\r' || s[j] == '\n'))
            j++;
        return j - i;
    }
    /* Whitespace: \s*[\r\n]+ up to the run's last line break; else \s+(?!\S) then \s+. */
    size_t last = i, nl_end = 0;
    j = i;
    while (j < n) {
        size_t l2 = fu_tok_utf8_next(s, n, j, &cp);
        if (char_class(cp) != CL_SPACE)
            break;
        if (cp == '\r' || cp == '\n')
            nl_end = j + 1;
        last = j;
        j += l2;
    }
    if (nl_end)
        return nl_end - i;
    if (j == n || last == i)
        return j - i;
    return last - i;
}

/* Work space of bpe_word, reused across words. */
typedef struct {
    int32_t *id;   /* symbol ids */
    int32_t *prev; /* previous live symbol, -1 at the start */
    int32_t *next; /* next live symbol, -1 at the end */
    struct heap_ent {
        int32_t rank;     /* merge rank: lower first */
        int32_t pos;      /* left symbol: leftmost first among equal ranks */
        int32_t left, right; /* the pair's ids when pushed (stale entries are skipped) */
    } *heap;
    size_t hn;   /* entries in the heap */
    size_t cap;  /* symbols the arrays hold (the heap holds 2*cap) */
} bpe_work;

static bool heap_less(const struct heap_ent *a, const struct heap_ent *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(bpe_work *w, struct heap_ent e)
{
    size_t i = w->hn++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&e, &w->heap[p]))
            break;
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = e;
}

static struct heap_ent heap_pop(bpe_work *w)
{
    struct heap_ent top = w->heap[0], last = w->heap[--w->hn];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= w->hn)
            break;
        if (c + 1 < w->hn && heap_less(&w->heap[c + 1], &w->heap[c]))
            c++;
        if (!heap_less(&w->heap[c], &last))
            break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (w->hn)
        w->heap[i] = last;
    return top;
}

/* Pushes the pair (symbol a, its next) when a merge exists for it. */
static void push_pair(const fu_tokenizer *t, bpe_work *w, int32_t a)
{
    if (a < 0 || w->next[a] < 0)
        return;
    int32_t l = w->id[a], r = w->id[w->next[a]];
    const pmap_ent *e = fu_tok_pmap_slot(&t->merges, ((uint64_t)(uint32_t)l << 32) | (uint32_t)r);
    if (e->rank >= 0)
        heap_push(w, (struct heap_ent){.rank = e->rank, .pos = a, .left = l, .right = r});
}

/* BPE of one pre-token: bytes -> ids appended to out. Merges are applied lowest rank first,
 * leftmost first among equal ranks (as Hugging Face tokenizers do), in O(n log n). */
/* The first symbols of a character-level word: each character's token, else its bytes' <0xXX>
 * tokens (byte_fallback), else <unk> (consecutive ones fused with fuse_unk). Returns how many. */
static fu_err char_symbols(const fu_tokenizer *t, const uint8_t *s, size_t n, bpe_work *w, size_t *m_out,
                           fu_errmsg *em)
{
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t l = fu_tok_utf8_next(s, n, i, &cp);
        int32_t id = cp == CP_INVALID ? -1 : fu_tok_smap_get(&t->vocab, (const char *)s + i, l);
        if (id >= 0) {
            w->id[m++] = id;
        } else if (t->byte_fallback && t->fallback_id[s[i]] >= 0) {
            for (size_t k = 0; k < l; k++)
                w->id[m++] = t->fallback_id[s[i + k]] >= 0 ? t->fallback_id[s[i + k]] : t->unk_id;
        } else if (t->unk_id >= 0) {
            if (!(t->fuse_unk && m && w->id[m - 1] == t->unk_id))
                w->id[m++] = t->unk_id;
        } else {
            return fu_errmsg_set(em, FU_EPROTO, "tokenizer: a character has no token and there is no unk_token");
        }
        i += l;
    }
    *m_out = m;
    return FU_OK;
}

static fu_err bpe_word(const fu_tokenizer *t, const uint8_t *s, size_t n, idvec *out, bpe_work *w, fu_errmsg *em)
{
    if (n == 0)
        return FU_OK;
    if (t->ignore_merges && t->char_level && n <= FU_TOKENIZER_MAX_TOKEN) {
        int32_t id = fu_tok_smap_get(&t->vocab, (const char *)s, n);
        if (id >= 0) {
            idvec_push(out, id);
            return FU_OK;
        }
    }
    if (t->ignore_merges && !t->char_level && n <= FU_TOKENIZER_MAX_TOKEN) {
        char buf[4 * FU_TOKENIZER_MAX_TOKEN];
        size_t m = 0;
        buf[0] = '\0';
        for (size_t i = 0; i < n; i++)
            m += fu_tok_utf8_put(buf + m, t->byte_cp[s[i]]);
        int32_t id = fu_tok_smap_get(&t->vocab, buf, m);
        if (id >= 0) {
            idvec_push(out, id);
            return FU_OK;
        }
    }
    if (n > (size_t)INT32_MAX / 2)
        return fu_errmsg_set(em, FU_ENOMEM, "tokenizer: a word of %zu bytes is too long", n);
    if (w->cap < n) {
        w->cap = n;
        w->id = fu_realloc(w->id, n * sizeof *w->id);
        w->prev = fu_realloc(w->prev, n * sizeof *w->prev);
        w->next = fu_realloc(w->next, n * sizeof *w->next);
        w->heap = fu_realloc(w->heap, 2 * n * sizeof *w->heap);
    }
    size_t m = n; /* symbols: one per byte (byte-level), or per character (char_symbols) */
    if (t->char_level) {
        FU_TRY(char_symbols(t, s, n, w, &m, em));
    } else {
        for (size_t i = 0; i < n; i++) {
            int32_t id = t->byte_tok[s[i]];
            if (id < 0) {
                if (t->unk_id < 0)
                    return fu_errmsg_set(em, FU_EPROTO, "tokenizer: byte 0x%02x has no token and there is no unk_token",
                                         s[i]);
                id = t->unk_id;
            }
            w->id[i] = id;
        }
    }
    if (m == 0)
        return FU_OK;
    for (size_t i = 0; i < m; i++) {
        w->prev[i] = (int32_t)i - 1;
        w->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
    }
    w->hn = 0;
    for (size_t i = 0; i + 1 < m; i++)
        push_pair(t, w, (int32_t)i);
    /* Each merge removes a symbol and pushes at most two pairs: the heap stays within 2n. */
    while (w->hn) {
        struct heap_ent e = heap_pop(w);
        int32_t a = e.pos, b = w->next[a];
        if (w->id[a] != e.left || b < 0 || w->id[b] != e.right || w->prev[a] == -2)
            continue; /* stale: one side was merged since */
        const pmap_ent *pm =
            fu_tok_pmap_slot(&t->merges, ((uint64_t)(uint32_t)e.left << 32) | (uint32_t)e.right);
        w->id[a] = pm->id;
        w->next[a] = w->next[b];
        if (w->next[b] >= 0)
            w->prev[w->next[b]] = a;
        w->prev[b] = -2; /* dead */
        w->next[b] = -1;
        push_pair(t, w, w->prev[a]);
        push_pair(t, w, a);
    }
    for (int32_t i = 0; i >= 0; i = w->next[i])
        idvec_push(out, w->id[i]);
    return FU_OK;
}

/* The normalizers of t applied to s[0..n): a new buffer in *out (NULL when there are none). */
static void normalize(const fu_tokenizer *t, const uint8_t *s, size_t n, uint8_t **out, size_t *out_n)
{
    *out = NULL;
    *out_n = n;
    if (t->n_norm == 0 || n == 0)
        return;
    char *cur = fu_malloc(n + 1);
    memcpy(cur, s, n);
    size_t len = n;
    for (size_t k = 0; k < t->n_norm; k++) {
        const norm_step *st = &t->norm[k];
        char *next = NULL;
        size_t nl = 0;
        if (st->kind == NORM_NFC) {
            if (fu_uni_nfc(cur, len, &next, &nl) != FU_OK)
                continue;
        } else if (st->kind == NORM_PREPEND) {
            next = fu_malloc(st->al + len + 1);
            memcpy(next, st->a, st->al);
            memcpy(next + st->al, cur, len);
            nl = st->al + len;
        } else { /* NORM_REPLACE: every occurrence, left to right */
            size_t hits = 0;
            for (size_t i = 0; i + st->al <= len;)
                i += memcmp(cur + i, st->a, st->al) == 0 ? (hits++, st->al) : 1;
            next = fu_malloc(len + hits * st->bl + 1);
            for (size_t i = 0; i < len;) {
                if (i + st->al <= len && memcmp(cur + i, st->a, st->al) == 0) {
                    memcpy(next + nl, st->b, st->bl);
                    nl += st->bl;
                    i += st->al;
                } else {
                    next[nl++] = cur[i++];
                }
            }
        }
        free(cur);
        cur = next;
        len = nl;
    }
    *out = (uint8_t *)cur;
    *out_n = len;
}

/* A Metaspace pre-tokenizer over s[0..n): spaces replaced by ms_rep, which is prepended (unless s
 * starts with it) always, or only to the stretch at the start of the input (first). A new buffer. */
static uint8_t *metaspace(const fu_tokenizer *t, const uint8_t *s, size_t *n, bool first)
{
    size_t spaces = 0;
    for (size_t i = 0; i < *n; i++)
        spaces += s[i] == ' ';
    uint8_t *o = fu_malloc(*n + (spaces + 1) * t->ms_rep_len + 1);
    size_t k = 0;
    for (size_t i = 0; i < *n; i++)
        if (s[i] == ' ')
            memcpy(o + k, t->ms_rep, t->ms_rep_len), k += t->ms_rep_len;
        else
            o[k++] = s[i];
    bool starts = k >= t->ms_rep_len && memcmp(o, t->ms_rep, t->ms_rep_len) == 0;
    if (!starts && (t->ms_prepend == MS_ALWAYS || (t->ms_prepend == MS_FIRST && first))) {
        memmove(o + t->ms_rep_len, o, k);
        memcpy(o, t->ms_rep, t->ms_rep_len);
        k += t->ms_rep_len;
    }
    *n = k;
    return o;
}

/* Encodes a stretch of text with no added tokens in it; first: it starts the input. */
static fu_err encode_segment(const fu_tokenizer *t, const uint8_t *s, size_t n, bool first, idvec *out, bpe_work *w,
                             fu_errmsg *em)
{
    uint8_t *normed = NULL, *ms = NULL;
    normalize(t, s, n, &normed, &n);
    if (normed)
        s = normed;
    if (t->metaspace && n > 0)
        s = ms = metaspace(t, s, &n, first);
    uint8_t *tmp = NULL;
    if (t->add_prefix_space && n && s[0] != ' ') {
        tmp = fu_malloc(n + 1);
        tmp[0] = ' ';
        memcpy(tmp + 1, s, n);
        s = tmp;
        n++;
    }
    fu_err rc = FU_OK;
    for (size_t i = 0; i < n && rc == FU_OK;) {
        size_t len = t->split == SPLIT_GPT2     ? gpt2_piece(s, n, i)
                     : t->split == SPLIT_LLAMA3 ? llama3_piece(s, n, i, 3)
                     : t->split == SPLIT_QWEN2  ? llama3_piece(s, n, i, 1)
                                                : n - i;
        rc = bpe_word(t, s + i, len, out, w, em);
        i += len;
    }
    free(tmp);
    free(ms);
    free(normed);
    return rc;
}

fu_err fu_tokenizer_encode(const fu_tokenizer *t, const char *text, size_t len, int32_t **ids, size_t *n,
                           fu_errmsg *em)
{
    if (!t || (!text && len) || !ids || !n)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_encode: NULL argument");
    *ids = NULL;
    *n = 0;
    const uint8_t *s = (const uint8_t *)text;
    idvec out = {0};
    if (t->kind == FU_TOK_BYTES) {
        if (len) {
            out.v = fu_malloc(len * sizeof *out.v);
            for (size_t i = 0; i < len; i++)
                out.v[i] = s[i];
        }
        *ids = out.v;
        *n = len;
        return FU_OK;
    }
    bpe_work w = {0};
    size_t seg = 0;
    fu_err rc = FU_OK;
    for (size_t i = 0; i < len && rc == FU_OK;) {
        const added_tok *hit = NULL;
        if (!(t->added_first[s[i] >> 6] >> (s[i] & 63) & 1)) {
            i++;
            continue;
        }
        for (size_t k = 0; k < t->n_added; k++) {
            const added_tok *a = &t->added[k];
            if (a->len <= len - i && (uint8_t)a->content[0] == s[i] && memcmp(a->content, s + i, a->len) == 0) {
                hit = a; /* sorted longest first: the longest match */
                break;
            }
        }
        if (!hit) {
            i++;
            continue;
        }
        rc = encode_segment(t, s + seg, i - seg, seg == 0, &out, &w, em);
        idvec_push(&out, hit->id);
        i += hit->len;
        seg = i;
    }
    if (rc == FU_OK)
        rc = encode_segment(t, s + seg, len - seg, seg == 0, &out, &w, em);
    free(w.id);
    free(w.prev);
    free(w.next);
    free(w.heap);
    if (rc != FU_OK) {
        free(out.v);
        return rc;
    }
    *ids = out.v;
    *n = out.n;
    return FU_OK;
}
