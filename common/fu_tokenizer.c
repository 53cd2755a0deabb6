/* fu_tokenizer: the tokenizer object (see fu_tokenizer.h): construction of the byte-level kind,
 * destruction, its hash maps (token strings, merges), UTF-8 and GPT-2's byte <-> unicode mapping,
 * decode and the token lookups. Reading tokenizer.json is fu_tokenizer_json.c; encoding (the
 * pre-tokenizers and BPE) is fu_tokenizer_encode.c. */
#include "fu_tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_tokenizer_internal.h"

/* ---- small hash maps -------------------------------------------------------------------------- */

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

void fu_tok_smap_init(smap *m, size_t want)
{
    size_t cap = 16;
    while (cap < want * 2)
        cap *= 2;
    m->e = fu_calloc(cap, sizeof *m->e);
    m->cap = cap;
    m->n = 0;
}

static void smap_free(smap *m)
{
    for (size_t i = 0; i < m->cap; i++)
        free(m->e[i].key);
    free(m->e);
    m->e = NULL;
    m->cap = m->n = 0;
}

static smap_ent *smap_slot(const smap *m, const char *k, size_t len)
{
    size_t mask = m->cap - 1, i = (size_t)fnv1a(k, len) & mask;
    while (m->e[i].key && !(m->e[i].len == len && memcmp(m->e[i].key, k, len) == 0))
        i = (i + 1) & mask;
    return &m->e[i];
}

int32_t fu_tok_smap_get(const smap *m, const char *k, size_t len)
{
    if (!m->cap)
        return -1;
    const smap_ent *e = smap_slot(m, k, len);
    return e->key ? e->id : -1;
}

/* Inserts k -> id; false when k is present already. The map is sized at init (no growth). */
bool fu_tok_smap_put(smap *m, const char *k, size_t len, int32_t id)
{
    smap_ent *e = smap_slot(m, k, len);
    if (e->key)
        return false;
    e->key = fu_malloc(len + 1);
    memcpy(e->key, k, len);
    e->key[len] = '\0';
    e->len = len;
    e->id = id;
    m->n++;
    return true;
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

void fu_tok_pmap_init(pmap *m, size_t want)
{
    size_t cap = 16;
    while (cap < want * 2)
        cap *= 2;
    m->e = fu_malloc(cap * sizeof *m->e);
    for (size_t i = 0; i < cap; i++)
        m->e[i].rank = -1;
    m->cap = cap;
}

pmap_ent *fu_tok_pmap_slot(const pmap *m, uint64_t key)
{
    size_t mask = m->cap - 1, i = (size_t)mix64(key) & mask;
    while (m->e[i].rank >= 0 && m->e[i].key != key)
        i = (i + 1) & mask;
    return &m->e[i];
}

/* ---- GPT-2 byte <-> unicode ------------------------------------------------------------------ */

/* GPT-2 maps each byte to a printable code point: the printable Latin-1 ones to themselves, the
 * others to 256, 257, ... in byte order. */
void fu_tok_byte_unicode_maps(uint32_t byte_cp[256], int16_t cp_byte[512])
{
    for (int i = 0; i < 512; i++)
        cp_byte[i] = -1;
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; b++) {
        bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        byte_cp[b] = keep ? b : next++;
        cp_byte[byte_cp[b]] = (int16_t)b;
    }
}

size_t fu_tok_utf8_put(char *out, uint32_t cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Decodes one UTF-8 character at s[i] (i < n); returns its length (>= 1). Malformed bytes come
 * back one at a time as CP_INVALID. */
size_t fu_tok_utf8_next(const uint8_t *s, size_t n, size_t i, uint32_t *cp)
{
    uint8_t c = s[i];
    size_t len;
    uint32_t v;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if ((c & 0xE0) == 0xC0) {
        len = 2, v = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
        len = 3, v = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
        len = 4, v = c & 0x07;
    } else {
        *cp = CP_INVALID;
        return 1;
    }
    if (i + len > n) {
        *cp = CP_INVALID;
        return 1;
    }
    for (size_t k = 1; k < len; k++) {
        if ((s[i + k] & 0xC0) != 0x80) {
            *cp = CP_INVALID;
            return 1;
        }
        v = (v << 6) | (s[i + k] & 0x3F);
    }
    static const uint32_t min_for_len[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min_for_len[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        *cp = CP_INVALID;
        return 1;
    }
    *cp = v;
    return len;
}

/* ---- the tokenizer --------------------------------------------------------------------------- */

fu_tokenizer *fu_tokenizer_new_bytes(size_t vocab_size)
{
    if (vocab_size > FU_TOKENIZER_MAX_VOCAB)
        return NULL;
    fu_tokenizer *t = fu_calloc(1, sizeof *t);
    t->kind = FU_TOK_BYTES;
    t->vocab_size = vocab_size < 256 ? 256 : vocab_size;
    t->unk_id = t->bos_id = t->eos_id = -1;
    return t;
}

void fu_tokenizer_destroy(fu_tokenizer **tok_p)
{
    if (!tok_p || !*tok_p)
        return;
    fu_tokenizer *t = *tok_p;
    *tok_p = NULL;
    if (t->id_str) {
        for (size_t i = 0; i < t->vocab_size; i++)
            free(t->id_str[i]);
        free(t->id_str);
    }
    free(t->id_raw);
    if (t->vocab.e)
        smap_free(&t->vocab);
    free(t->merges.e);
    for (size_t i = 0; i < t->n_added; i++)
        free(t->added[i].content);
    free(t->added);
    for (size_t i = 0; i < t->n_norm; i++) {
        free(t->norm[i].a);
        free(t->norm[i].b);
    }
    free(t->dec_from);
    free(t->ms_rep);
    free(t->dec_to);
    free(t);
}

fu_tok_kind fu_tokenizer_kind(const fu_tokenizer *t)
{
    return t->kind;
}

size_t fu_tokenizer_vocab_size(const fu_tokenizer *t)
{
    return t->vocab_size;
}

/* ---- decode ---------------------------------------------------------------------------------- */

/* Appends s[0..n) to the growing buffer *buf (capacity *cap, *at used). */
static void append(char **buf, size_t *cap, size_t *at, const char *s, size_t n)
{
    if (*at + n + 1 > *cap) {
        while (*at + n + 1 > *cap)
            *cap *= 2;
        *buf = fu_realloc(*buf, *cap);
    }
    memcpy(*buf + *at, s, n);
    *at += n;
}

/* The byte of a byte-fallback token "<0xXX>", or -1. */
static int fallback_byte(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int v = 0;
    for (int k = 3; k < 5; k++) {
        char c = s[k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* A character-level (SentencePiece) decode: each token's text with the decoder's Replace applied
 * (byte-fallback tokens become their bytes), fused, then Strip's leading characters removed. */
static void decode_chars(const fu_tokenizer *t, const int32_t *ids, size_t n, char **buf, size_t *cap, size_t *at)
{
    for (size_t i = 0; i < n; i++) {
        const char *s = t->id_str[ids[i]];
        if (!s)
            continue;
        size_t sl = strlen(s);
        int b = t->byte_fallback && !t->id_raw[ids[i]] ? fallback_byte(s, sl) : -1;
        if (b >= 0) {
            char c = (char)b;
            append(buf, cap, at, &c, 1);
            continue;
        }
        for (size_t k = 0; k < sl;) {
            if (t->dec_from && k + t->dec_from_len <= sl && memcmp(s + k, t->dec_from, t->dec_from_len) == 0) {
                append(buf, cap, at, t->dec_to, t->dec_to_len);
                k += t->dec_from_len;
            } else {
                append(buf, cap, at, s + k, 1);
                k++;
            }
        }
    }
    size_t cut = 0;
    while ((int)cut < t->strip_start && cut < *at && (*buf)[cut] == t->strip_char)
        cut++;
    memmove(*buf, *buf + cut, *at - cut);
    *at -= cut;
}

/* transformers' clean_up_tokenization: " ." -> ".", " ?", " !", " ,", " ' " -> "'", " n't", " 'm",
 * " 's", " 've", " 're", in that order, in place. */
static void clean_up(char *s, size_t *len)
{
    static const char *const from[] = {" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're"};
    static const char *const to[] = {".", "?", "!", ",", "'", "n't", "'m", "'s", "'ve", "'re"};
    for (size_t r = 0; r < sizeof from / sizeof *from; r++) {
        size_t fl = strlen(from[r]), tl = strlen(to[r]), w = 0;
        for (size_t i = 0; i < *len;) {
            if (i + fl <= *len && memcmp(s + i, from[r], fl) == 0) {
                memmove(s + w, to[r], tl);
                w += tl;
                i += fl;
            } else {
                s[w++] = s[i++];
            }
        }
        *len = w;
    }
}

fu_err fu_tokenizer_decode(const fu_tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len,
                           fu_errmsg *em)
{
    if (!t || (!ids && n) || !text || !len)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_decode: NULL argument");
    *text = NULL;
    *len = 0;
    size_t cap = 64, at = 0;
    char *buf = fu_malloc(cap);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (size_t)ids[i] >= t->vocab_size) {
            free(buf);
            return fu_errmsg_set(em, FU_EINVAL, "token id %d is outside the vocabulary (size %zu)", ids[i],
                                 t->vocab_size);
        }
    if (t->kind == FU_TOK_BPE && t->char_level) {
        decode_chars(t, ids, n, &buf, &cap, &at);
        n = 0; /* done */
    }
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        const char *s = NULL;
        size_t sl = 0;
        char one;
        if (t->kind == FU_TOK_BYTES) {
            if (id < 256) {
                one = (char)id;
                s = &one;
                sl = 1;
            }
        } else if (t->id_str[id]) {
            s = t->id_str[id];
            sl = strlen(s);
        }
        if (!s)
            continue;
        if (at + sl + 1 > cap) {
            while (at + sl + 1 > cap)
                cap *= 2;
            buf = fu_realloc(buf, cap);
        }
        if (t->kind == FU_TOK_BYTES || t->id_raw[id]) {
            memcpy(buf + at, s, sl);
            at += sl;
            continue;
        }
        /* Byte-level: each character of the token stands for one byte (decoding never grows). */
        const uint8_t *u = (const uint8_t *)s;
        for (size_t k = 0; k < sl;) {
            uint32_t cp;
            size_t cl = fu_tok_utf8_next(u, sl, k, &cp);
            if (cp != CP_INVALID && cp < 512 && t->cp_byte[cp] >= 0) {
                buf[at++] = (char)t->cp_byte[cp];
            } else {
                memcpy(buf + at, u + k, cl);
                at += cl;
            }
            k += cl;
        }
    }
    if (t->cleanup)
        clean_up(buf, &at);
    buf[at] = '\0';
    *text = buf;
    *len = at;
    return FU_OK;
}

int32_t fu_tokenizer_token_id(const fu_tokenizer *t, const char *token)
{
    if (!t || !token)
        return -1;
    if (t->kind == FU_TOK_BYTES)
        return strlen(token) == 1 ? (int32_t)(uint8_t)token[0] : -1;
    return fu_tok_smap_get(&t->vocab, token, strlen(token));
}

const char *fu_tokenizer_token(const fu_tokenizer *t, int32_t id)
{
    if (!t || t->kind == FU_TOK_BYTES || id < 0 || (size_t)id >= t->vocab_size)
        return NULL;
    return t->id_str[id];
}

int32_t fu_tokenizer_bos_id(const fu_tokenizer *t)
{
    return t ? t->bos_id : -1;
}

int32_t fu_tokenizer_eos_id(const fu_tokenizer *t)
{
    return t ? t->eos_id : -1;
}
