#include "fu_tokenizer.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fu_alloc.h"

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

typedef struct {
    char   *key; /* owned; NULL = empty slot */
    size_t  len;
    int32_t id;
} smap_ent;

typedef struct {
    smap_ent *e;
    size_t    cap; /* power of two */
    size_t    n;
} smap;

static void smap_init(smap *m, size_t want)
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

static int32_t smap_get(const smap *m, const char *k, size_t len)
{
    if (!m->cap)
        return -1;
    const smap_ent *e = smap_slot(m, k, len);
    return e->key ? e->id : -1;
}

/* Inserts k -> id; false when k is present already. The map is sized at init (no growth). */
static bool smap_put(smap *m, const char *k, size_t len, int32_t id)
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

typedef struct {
    uint64_t key;  /* (left id << 32) | right id */
    int32_t  rank; /* merge priority (its line in "merges"); -1 = empty slot */
    int32_t  id;   /* id of the merged token */
} pmap_ent;

typedef struct {
    pmap_ent *e;
    size_t    cap;
} pmap;

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static void pmap_init(pmap *m, size_t want)
{
    size_t cap = 16;
    while (cap < want * 2)
        cap *= 2;
    m->e = fu_malloc(cap * sizeof *m->e);
    for (size_t i = 0; i < cap; i++)
        m->e[i].rank = -1;
    m->cap = cap;
}

static pmap_ent *pmap_slot(const pmap *m, uint64_t key)
{
    size_t mask = m->cap - 1, i = (size_t)mix64(key) & mask;
    while (m->e[i].rank >= 0 && m->e[i].key != key)
        i = (i + 1) & mask;
    return &m->e[i];
}

/* ---- GPT-2 byte <-> unicode ------------------------------------------------------------------ */

/* GPT-2 maps each byte to a printable code point: the printable Latin-1 ones to themselves, the
 * others to 256, 257, ... in byte order. */
static void byte_unicode_maps(uint32_t byte_cp[256], int16_t cp_byte[512])
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

static size_t utf8_put(char *out, uint32_t cp)
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

#define CP_INVALID 0xFFFFFFFFu

/* Decodes one UTF-8 character at s[i] (i < n); returns its length (>= 1). Malformed bytes come
 * back one at a time as CP_INVALID. */
static size_t utf8_next(const uint8_t *s, size_t n, size_t i, uint32_t *cp)
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

typedef struct {
    char   *content; /* the text that stands for the token */
    size_t  len;
    int32_t id;
    bool    special;
} added_tok;

struct fu_tokenizer {
    fu_tok_kind kind;
    size_t      vocab_size;    /* largest id + 1 */
    char      **id_str;        /* [vocab_size] token string as in tokenizer.json, or NULL */
    uint8_t    *id_raw;        /* [vocab_size] 1: added token, decoded as its text */
    smap        vocab;         /* token string -> id */
    pmap        merges;        /* (left, right) -> rank, merged id */
    added_tok  *added;         /* sorted by length, longest first */
    size_t      n_added;
    uint64_t    added_first[4]; /* bit set of the first bytes of added tokens */
    int32_t     unk_id;        /* model.unk_token's id, or -1 */
    int32_t     byte_tok[256]; /* id of each byte's one-character token, or -1 */
    uint32_t    byte_cp[256];  /* GPT-2 byte -> code point */
    int16_t     cp_byte[512];  /* code point -> byte, or -1 */
    bool        add_prefix_space;
    int         split;         /* SPLIT_*: how text is cut into words before BPE */
    bool        ignore_merges;
    int32_t     bos_id, eos_id;
};

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

static bool json_id(const cJSON *it, int32_t *out)
{
    if (!cJSON_IsNumber(it))
        return false;
    double d = it->valuedouble;
    if (!(d >= 0.0) || d >= (double)FU_TOKENIZER_MAX_VOCAB || d != floor(d))
        return false;
    *out = (int32_t)d;
    return true;
}

static const char *type_of(const cJSON *o)
{
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
    return cJSON_IsString(ty) ? ty->valuestring : "?";
}

static bool json_flag(const cJSON *o, const char *key, bool dflt)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsBool(it) ? (bool)cJSON_IsTrue(it) : dflt;
}

/* Word splitting rules fusion knows, by their regular expression in tokenizer.json. */
enum { SPLIT_NONE = 0, SPLIT_GPT2, SPLIT_LLAMA3, SPLIT_QWEN2 };
static const char *const split_patterns[] = {
    [SPLIT_GPT2] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
    [SPLIT_LLAMA3] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                     "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    [SPLIT_QWEN2] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};

/* A Split pre-tokenizer with one of the known patterns, isolating the matches. */
static fu_err parse_split(const cJSON *sp, const char *lab, int *split, fu_errmsg *em)
{
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(sp, "pattern");
    const cJSON *re = pat ? cJSON_GetObjectItemCaseSensitive(pat, "Regex") : NULL;
    const cJSON *beh = cJSON_GetObjectItemCaseSensitive(sp, "behavior");
    if (!cJSON_IsString(re) || !cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated") != 0 ||
        json_flag(sp, "invert", false))
        return fu_errmsg_set(em, FU_EVERSION, "%s: a Split pre_tokenizer needs a \"Regex\" pattern, behavior Isolated", lab);
    for (int k = SPLIT_GPT2; k <= SPLIT_QWEN2; k++) {
        if (strcmp(re->valuestring, split_patterns[k]) == 0) {
            *split = k;
            return FU_OK;
        }
    }
    return fu_errmsg_set(em, FU_EVERSION,
                         "%s: Split pattern '%.80s' is not one fusion knows (GPT-2, Llama-3 and Qwen2 patterns are)", lab,
                         re->valuestring);
}

/* Accepts a ByteLevel pre-tokenizer, alone, as the only member of a Sequence, or after a Split with a
 * known pattern (Llama-3 style: Split then ByteLevel with use_regex false). */
static fu_err parse_pre_tokenizer(fu_tokenizer *t, const cJSON *pt, const char *lab, fu_errmsg *em)
{
    if (!pt || cJSON_IsNull(pt))
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: has no pre_tokenizer; fusion reads byte-level BPE tokenizers (pre_tokenizer ByteLevel)", lab);
    if (!cJSON_IsObject(pt))
        return fu_errmsg_set(em, FU_EPROTO, "%s: pre_tokenizer is not an object", lab);
    int split = SPLIT_NONE;
    if (strcmp(type_of(pt), "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers");
        int n = cJSON_IsArray(list) ? cJSON_GetArraySize(list) : 0;
        if (n == 2 && cJSON_IsObject(list->child) && strcmp(type_of(list->child), "Split") == 0) {
            FU_TRY(parse_split(list->child, lab, &split, em));
            pt = list->child->next;
        } else if (n == 1) {
            pt = list->child;
        } else {
            return fu_errmsg_set(em, FU_EVERSION,
                                 "%s: pre_tokenizer Sequence is supported only as [ByteLevel] or [Split, ByteLevel]", lab);
        }
        if (!cJSON_IsObject(pt))
            return fu_errmsg_set(em, FU_EPROTO, "%s: pre_tokenizer member is not an object", lab);
    }
    if (strcmp(type_of(pt), "ByteLevel") != 0)
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: pre_tokenizer '%.40s' is not supported; fusion reads byte-level BPE tokenizers (ByteLevel)",
                             lab, type_of(pt));
    t->add_prefix_space = json_flag(pt, "add_prefix_space", false);
    bool use_regex = json_flag(pt, "use_regex", true);
    if (split != SPLIT_NONE && use_regex)
        return fu_errmsg_set(em, FU_EVERSION, "%s: a Split followed by ByteLevel with use_regex=true is not supported", lab);
    t->split = use_regex ? SPLIT_GPT2 : split;
    return FU_OK;
}

static int cmp_added(const void *a, const void *b)
{
    const added_tok *x = a, *y = b;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->id - y->id;
}

static void set_id_str(fu_tokenizer *t, int32_t id, const char *s, size_t len, bool raw)
{
    free(t->id_str[id]);
    t->id_str[id] = fu_malloc(len + 1);
    memcpy(t->id_str[id], s, len);
    t->id_str[id][len] = '\0';
    t->id_raw[id] = raw;
}

static fu_err parse_bpe(fu_tokenizer *t, const cJSON *root, const char *lab, fu_errmsg *em)
{
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    if (norm && !cJSON_IsNull(norm))
        return fu_errmsg_set(em, FU_EVERSION, "%s: normalizer '%.40s' is not supported (byte-level BPE has none)", lab,
                             type_of(norm));
    FU_TRY(parse_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), lab, em));

    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return fu_errmsg_set(em, FU_EPROTO, "%s: has no \"model\" object", lab);
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (ty && (!cJSON_IsString(ty) || strcmp(ty->valuestring, "BPE") != 0))
        return fu_errmsg_set(em, FU_EVERSION, "%s: model type '%.40s' is not supported (only BPE)", lab, type_of(model));
    const cJSON *drop = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (drop && !cJSON_IsNull(drop) && !(cJSON_IsNumber(drop) && drop->valuedouble == 0.0))
        return fu_errmsg_set(em, FU_EVERSION, "%s: BPE dropout is not supported", lab);
    const char *affixes[2] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(model, affixes[i]);
        if (a && !cJSON_IsNull(a) && !(cJSON_IsString(a) && a->valuestring[0] == '\0'))
            return fu_errmsg_set(em, FU_EVERSION, "%s: BPE %s is not supported", lab, affixes[i]);
    }
    if (json_flag(model, "byte_fallback", false))
        return fu_errmsg_set(em, FU_EVERSION, "%s: BPE byte_fallback (SentencePiece style) is not supported", lab);
    t->ignore_merges = json_flag(model, "ignore_merges", false);

    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!cJSON_IsObject(vocab))
        return fu_errmsg_set(em, FU_EPROTO, "%s: model has no \"vocab\" object", lab);
    if (merges && !cJSON_IsNull(merges) && !cJSON_IsArray(merges))
        return fu_errmsg_set(em, FU_EPROTO, "%s: model \"merges\" is not a list", lab);
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return fu_errmsg_set(em, FU_EPROTO, "%s: \"added_tokens\" is not a list", lab);

    /* Sizes first: the largest id decides the table. */
    size_t n_vocab = 0, n_added = 0, n_merges = 0;
    int32_t max_id = -1;
    for (const cJSON *v = vocab->child; v; v = v->next) {
        int32_t id;
        if (!json_id(v, &id))
            return fu_errmsg_set(em, FU_EPROTO, "%s: vocab entry '%.60s' has no valid id (0 to %zu)", lab,
                                 v->string ? v->string : "", FU_TOKENIZER_MAX_VOCAB - 1);
        if (!v->string || strlen(v->string) > FU_TOKENIZER_MAX_TOKEN)
            return fu_errmsg_set(em, FU_EPROTO, "%s: vocab has a token longer than %d bytes", lab, FU_TOKENIZER_MAX_TOKEN);
        max_id = id > max_id ? id : max_id;
        n_vocab++;
    }
    for (const cJSON *a = added ? added->child : NULL; a; a = a->next) {
        int32_t id;
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(a, "content");
        if (!cJSON_IsObject(a) || !json_id(cJSON_GetObjectItemCaseSensitive(a, "id"), &id) || !cJSON_IsString(c) ||
            c->valuestring[0] == '\0' || strlen(c->valuestring) > FU_TOKENIZER_MAX_TOKEN)
            return fu_errmsg_set(em, FU_EPROTO, "%s: added_tokens entry %zu needs an \"id\" and a non-empty \"content\"",
                                 lab, n_added);
        max_id = id > max_id ? id : max_id;
        n_added++;
    }
    if (max_id < 0)
        return fu_errmsg_set(em, FU_EPROTO, "%s: the vocabulary is empty", lab);
    for (const cJSON *m = merges ? merges->child : NULL; m; m = m->next)
        n_merges++;
    if (n_merges >= (size_t)INT32_MAX)
        return fu_errmsg_set(em, FU_ENOMEM, "%s: too many merges", lab);

    t->vocab_size = (size_t)max_id + 1;
    t->id_str = fu_calloc(t->vocab_size, sizeof *t->id_str);
    t->id_raw = fu_calloc(t->vocab_size, 1);
    smap_init(&t->vocab, n_vocab + n_added);
    for (const cJSON *v = vocab->child; v; v = v->next) {
        int32_t id = (int32_t)v->valuedouble;
        size_t len = strlen(v->string);
        if (t->id_str[id])
            return fu_errmsg_set(em, FU_EPROTO, "%s: id %d is given to both '%.60s' and '%.60s'", lab, id, t->id_str[id],
                                 v->string);
        if (!smap_put(&t->vocab, v->string, len, id))
            return fu_errmsg_set(em, FU_EPROTO, "%s: token '%.60s' is in the vocab twice", lab, v->string);
        set_id_str(t, id, v->string, len, false);
    }
    t->added = n_added ? fu_calloc(n_added, sizeof *t->added) : NULL;
    for (const cJSON *a = added ? added->child : NULL; a; a = a->next) {
        added_tok *x = &t->added[t->n_added++];
        const char *c = cJSON_GetObjectItemCaseSensitive(a, "content")->valuestring;
        x->id = (int32_t)cJSON_GetObjectItemCaseSensitive(a, "id")->valuedouble;
        x->len = strlen(c);
        x->content = fu_malloc(x->len + 1);
        memcpy(x->content, c, x->len + 1);
        x->special = json_flag(a, "special", false);
        set_id_str(t, x->id, c, x->len, true);
        t->added_first[(uint8_t)c[0] >> 6] |= (uint64_t)1 << ((uint8_t)c[0] & 63);
        smap_put(&t->vocab, c, x->len, x->id); /* already there when the vocab lists it too */
    }
    if (t->n_added > 1)
        qsort(t->added, t->n_added, sizeof *t->added, cmp_added);

    pmap_init(&t->merges, n_merges);
    int32_t rank = 0;
    char pair[2 * FU_TOKENIZER_MAX_TOKEN + 2];
    for (const cJSON *m = merges ? merges->child : NULL; m; m = m->next, rank++) {
        const char *l, *r;
        size_t ll, rl;
        if (cJSON_IsString(m)) {
            const char *sp = strchr(m->valuestring, ' ');
            if (!sp || sp == m->valuestring || sp[1] == '\0' || strchr(sp + 1, ' '))
                return fu_errmsg_set(em, FU_EPROTO, "%s: merge %d '%.60s' is not two tokens separated by one space", lab,
                                     rank, m->valuestring);
            l = m->valuestring, ll = (size_t)(sp - l), r = sp + 1, rl = strlen(r);
        } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
                   cJSON_IsString(m->child->next)) {
            l = m->child->valuestring, ll = strlen(l), r = m->child->next->valuestring, rl = strlen(r);
        } else {
            return fu_errmsg_set(em, FU_EPROTO, "%s: merge %d is neither \"a b\" nor [\"a\", \"b\"]", lab, rank);
        }
        if (ll > FU_TOKENIZER_MAX_TOKEN || rl > FU_TOKENIZER_MAX_TOKEN)
            return fu_errmsg_set(em, FU_EPROTO, "%s: merge %d has a token that is too long", lab, rank);
        int32_t a = smap_get(&t->vocab, l, ll), b = smap_get(&t->vocab, r, rl);
        memcpy(pair, l, ll);
        memcpy(pair + ll, r, rl);
        int32_t ab = smap_get(&t->vocab, pair, ll + rl);
        if (a < 0 || b < 0 || ab < 0)
            return fu_errmsg_set(em, FU_EPROTO, "%s: merge %d ('%.*s' + '%.*s') uses a token that is not in the vocab", lab,
                                 rank, (int)(ll > 60 ? 60 : ll), l, (int)(rl > 60 ? 60 : rl), r);
        uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
        pmap_ent *e = pmap_slot(&t->merges, key);
        if (e->rank < 0) { /* the first (best) rank of a repeated merge wins */
            e->key = key;
            e->rank = rank;
            e->id = ab;
        }
    }

    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    t->unk_id = cJSON_IsString(unk) ? smap_get(&t->vocab, unk->valuestring, strlen(unk->valuestring)) : -1;
    byte_unicode_maps(t->byte_cp, t->cp_byte);
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t n = utf8_put(u, t->byte_cp[b]);
        t->byte_tok[b] = smap_get(&t->vocab, u, n);
    }
    static const char *const bos_names[] = {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"};
    static const char *const eos_names[] = {"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"};
    t->bos_id = t->eos_id = -1;
    for (size_t i = 0; i < 4; i++) {
        if (t->bos_id < 0)
            t->bos_id = smap_get(&t->vocab, bos_names[i], strlen(bos_names[i]));
        if (t->eos_id < 0)
            t->eos_id = smap_get(&t->vocab, eos_names[i], strlen(eos_names[i]));
    }
    return FU_OK;
}

fu_err fu_tokenizer_parse_json(const char *json, size_t len, const char *label, fu_tokenizer **out, fu_errmsg *em)
{
    const char *lab = label ? label : FU_TOKENIZER_FILE;
    if (!json || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_parse_json: NULL argument");
    *out = NULL;
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        return fu_errmsg_set(em, FU_EPROTO, "%s: not valid JSON", lab);
    fu_tokenizer *t = fu_calloc(1, sizeof *t);
    t->kind = FU_TOK_BPE;
    fu_err rc = cJSON_IsObject(root) ? parse_bpe(t, root, lab, em)
                                     : fu_errmsg_set(em, FU_EPROTO, "%s: not a JSON object", lab);
    cJSON_Delete(root);
    if (rc != FU_OK) {
        fu_tokenizer_destroy(&t);
        return rc;
    }
    *out = t;
    return FU_OK;
}

fu_err fu_tokenizer_load(const char *path, fu_tokenizer **out, fu_errmsg *em)
{
    if (!path || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_load: NULL argument");
    *out = NULL;
    char *txt = NULL;
    size_t len = 0;
    fu_err rc = fu_file_read_all(path, FU_TOKENIZER_MAX_BYTES, &txt, &len, em);
    if (rc != FU_OK)
        return rc;
    rc = fu_tokenizer_parse_json(txt, len, fu_path_base(path), out, em);
    free(txt);
    return rc;
}

fu_err fu_tokenizer_open_dir(const char *dir, size_t model_vocab, fu_tokenizer **out, fu_errmsg *em)
{
    if (!dir || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_open_dir: NULL argument");
    *out = NULL;
    char *p = fu_path_join(dir, FU_TOKENIZER_FILE);
    fu_err rc;
    if (fu_path_exists(p)) {
        rc = fu_tokenizer_load(p, out, em);
        if (rc == FU_OK && model_vocab > 0 && (*out)->vocab_size > model_vocab) {
            rc = fu_errmsg_set(em, FU_EINVAL, "model dir '%s': %s has ids up to %zu but the model's vocab_size is %zu",
                               dir, FU_TOKENIZER_FILE, (*out)->vocab_size - 1, model_vocab);
            fu_tokenizer_destroy(out);
        }
    } else {
        *out = fu_tokenizer_new_bytes(model_vocab);
        rc = *out ? FU_OK : fu_errmsg_set(em, FU_EINVAL, "vocab_size %zu is over the limit", model_vocab);
    }
    free(p);
    return rc;
}

/* ---- encode ---------------------------------------------------------------------------------- */

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

static int char_class(uint32_t cp)
{
    if (cp == CP_INVALID)
        return CL_OTHER;
    if (cp < 0x80) {
        if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z')
            return CL_LETTER;
        if (cp >= '0' && cp <= '9')
            return CL_NUMBER;
        if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D))
            return CL_SPACE;
        return CL_OTHER;
    }
    if (cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
        cp == 0x202F || cp == 0x205F || cp == 0x3000)
        return CL_SPACE;
    return CL_LETTER; /* approximation: see the header */
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
    size_t j = i, len = utf8_next(s, n, j, &cp);
    int cl = char_class(cp);
    if (cl == CL_SPACE && s[i] == ' ' && i + 1 < n) {
        uint32_t cp1;
        utf8_next(s, n, i + 1, &cp1);
        int cl1 = char_class(cp1);
        if (cl1 != CL_SPACE) {
            j = i + 1;
            cl = cl1;
            len = 0;
        }
    }
    if (cl != CL_SPACE) {
        j += len;
        while (j < n) {
            size_t l2 = utf8_next(s, n, j, &cp);
            if (char_class(cp) != cl)
                break;
            j += l2;
        }
        return j - i;
    }
    /* A run of spaces: all of it at the end of the text; otherwise all but its last character
     * (which then prefixes the next word), or the single character when the run has one. */
    size_t last = i;
    while (j < n) {
        size_t l2 = utf8_next(s, n, j, &cp);
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
    size_t len = utf8_next(s, n, i, &cp), j;
    int cl = char_class(cp), cl1 = -1;
    if (i + len < n) {
        utf8_next(s, n, i + len, &cp1);
        cl1 = char_class(cp1);
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    if (cl == CL_LETTER || (cl1 == CL_LETTER && cl != CL_NUMBER && cp != '\r' && cp != '\n')) {
        j = cl == CL_LETTER ? i : i + len;
        while (j < n) {
            size_t l2 = utf8_next(s, n, j, &cp);
            if (char_class(cp) != CL_LETTER)
                break;
            j += l2;
        }
        return j - i;
    }
    /* \p{N}{1,D} */
    if (cl == CL_NUMBER) {
        size_t d = 0;
        j = i;
        while (j < n && d < max_digits) {
            size_t l2 = utf8_next(s, n, j, &cp);
            if (char_class(cp) != CL_NUMBER)
                break;
            j += l2;
            d++;
        }
        return j - i;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    if (cl == CL_OTHER || (s[i] == ' ' && cl1 == CL_OTHER)) {
        j = cl == CL_OTHER ? i : i + 1;
        while (j < n) {
            size_t l2 = utf8_next(s, n, j, &cp);
            if (char_class(cp) != CL_OTHER)
                break;
            j += l2;
        }
        while (j < n && (s[j] == '\r' || s[j] == '\n'))
            j++;
        return j - i;
    }
    /* Whitespace: \s*[\r\n]+ up to the run's last line break; else \s+(?!\S) then \s+. */
    size_t last = i, nl_end = 0;
    j = i;
    while (j < n) {
        size_t l2 = utf8_next(s, n, j, &cp);
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
    const pmap_ent *e = pmap_slot(&t->merges, ((uint64_t)(uint32_t)l << 32) | (uint32_t)r);
    if (e->rank >= 0)
        heap_push(w, (struct heap_ent){.rank = e->rank, .pos = a, .left = l, .right = r});
}

/* BPE of one pre-token: bytes -> ids appended to out. Merges are applied lowest rank first,
 * leftmost first among equal ranks (as Hugging Face tokenizers do), in O(n log n). */
static fu_err bpe_word(const fu_tokenizer *t, const uint8_t *s, size_t n, idvec *out, bpe_work *w, fu_errmsg *em)
{
    if (n == 0)
        return FU_OK;
    if (t->ignore_merges && n <= FU_TOKENIZER_MAX_TOKEN) {
        char buf[4 * FU_TOKENIZER_MAX_TOKEN];
        size_t m = 0;
        buf[0] = '\0';
        for (size_t i = 0; i < n; i++)
            m += utf8_put(buf + m, t->byte_cp[s[i]]);
        int32_t id = smap_get(&t->vocab, buf, m);
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
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_tok[s[i]];
        if (id < 0) {
            if (t->unk_id < 0)
                return fu_errmsg_set(em, FU_EPROTO, "tokenizer: byte 0x%02x has no token and there is no unk_token", s[i]);
            id = t->unk_id;
        }
        w->id[i] = id;
        w->prev[i] = (int32_t)i - 1;
        w->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    w->hn = 0;
    for (size_t i = 0; i + 1 < n; i++)
        push_pair(t, w, (int32_t)i);
    /* Each merge removes a symbol and pushes at most two pairs: the heap stays within 2n. */
    while (w->hn) {
        struct heap_ent e = heap_pop(w);
        int32_t a = e.pos, b = w->next[a];
        if (w->id[a] != e.left || b < 0 || w->id[b] != e.right || w->prev[a] == -2)
            continue; /* stale: one side was merged since */
        const pmap_ent *m = pmap_slot(&t->merges, ((uint64_t)(uint32_t)e.left << 32) | (uint32_t)e.right);
        w->id[a] = m->id;
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

/* Encodes a stretch of text with no added tokens in it. */
static fu_err encode_segment(const fu_tokenizer *t, const uint8_t *s, size_t n, idvec *out, bpe_work *w,
                             fu_errmsg *em)
{
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
        rc = encode_segment(t, s + seg, i - seg, &out, &w, em);
        idvec_push(&out, hit->id);
        i += hit->len;
        seg = i;
    }
    if (rc == FU_OK)
        rc = encode_segment(t, s + seg, len - seg, &out, &w, em);
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

/* ---- decode ---------------------------------------------------------------------------------- */

fu_err fu_tokenizer_decode(const fu_tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len,
                           fu_errmsg *em)
{
    if (!t || (!ids && n) || !text || !len)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_decode: NULL argument");
    *text = NULL;
    *len = 0;
    size_t cap = 64, at = 0;
    char *buf = fu_malloc(cap);
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || (size_t)id >= t->vocab_size) {
            free(buf);
            return fu_errmsg_set(em, FU_EINVAL, "token id %d is outside the vocabulary (size %zu)", id, t->vocab_size);
        }
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
            size_t cl = utf8_next(u, sl, k, &cp);
            if (cp != CP_INVALID && cp < 512 && t->cp_byte[cp] >= 0) {
                buf[at++] = (char)t->cp_byte[cp];
            } else {
                memcpy(buf + at, u + k, cl);
                at += cl;
            }
            k += cl;
        }
    }
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
    return smap_get(&t->vocab, token, strlen(token));
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
