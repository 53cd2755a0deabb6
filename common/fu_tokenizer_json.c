/* fu_tokenizer_json: reading a Hugging Face tokenizer.json (see fu_tokenizer.h): the checks of what
 * fusion supports (normalizer, pre-tokenizers and their Split patterns, the BPE options), the
 * vocabulary, the added tokens, the merges, unk/BOS/EOS, and the loaders (a file, a model
 * directory). */
#include "fu_tokenizer.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fu_alloc.h"
#include "fu_tokenizer_internal.h"

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

/* A string-valued field of o, copied into *out (its length in *len); false when it is not a string. */
static bool dup_string(const cJSON *o, const char *key, char **out, size_t *len)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(it) || strlen(it->valuestring) > FU_TOKENIZER_MAX_TOKEN)
        return false;
    *len = strlen(it->valuestring);
    *out = fu_malloc(*len + 1);
    memcpy(*out, it->valuestring, *len + 1);
    return true;
}

/* A Metaspace object's prepend scheme: prepend_scheme ("always", "first", "never"), else the older
 * add_prefix_space (true: always); add_prefix_space false is never. -1 when malformed. */
static int metaspace_scheme(const cJSON *o)
{
    const cJSON *ps = cJSON_GetObjectItemCaseSensitive(o, "prepend_scheme");
    const cJSON *ap = cJSON_GetObjectItemCaseSensitive(o, "add_prefix_space");
    if (ap && !cJSON_IsBool(ap))
        return -1;
    if (cJSON_IsFalse(ap))
        return MS_NEVER;
    if (!ps || cJSON_IsNull(ps))
        return MS_ALWAYS;
    if (!cJSON_IsString(ps))
        return -1;
    return strcmp(ps->valuestring, "always") == 0 ? MS_ALWAYS
           : strcmp(ps->valuestring, "first") == 0 ? MS_FIRST
           : strcmp(ps->valuestring, "never") == 0 ? MS_NEVER
                                                   : -1;
}

/* SentencePiece style through a Metaspace pre-tokenizer (newer exports of Llama 2 and Mistral):
 * BPE over the characters of each stretch between added tokens, its spaces replaced. */
static fu_err parse_metaspace(fu_tokenizer *t, const cJSON *pt, const char *lab, fu_errmsg *em)
{
    if (json_flag(pt, "split", false))
        return fu_errmsg_set(em, FU_EVERSION, "%s: a Metaspace pre-tokenizer with split=true is not supported", lab);
    int scheme = metaspace_scheme(pt);
    if (scheme < 0 || !dup_string(pt, "replacement", &t->ms_rep, &t->ms_rep_len) || t->ms_rep_len == 0)
        return fu_errmsg_set(em, FU_EPROTO,
                             "%s: a Metaspace pre-tokenizer needs a \"replacement\" and a prepend_scheme of always, "
                             "first or never",
                             lab);
    t->metaspace = true;
    t->ms_prepend = scheme;
    t->char_level = true;
    t->split = SPLIT_NONE;
    return FU_OK;
}

/* Accepts a ByteLevel pre-tokenizer, alone, as the only member of a Sequence, or after a Split with a
 * known pattern (Llama-3 style: Split then ByteLevel with use_regex false). */
static fu_err parse_pre_tokenizer(fu_tokenizer *t, const cJSON *pt, const char *lab, fu_errmsg *em)
{
    if (!pt || cJSON_IsNull(pt)) { /* SentencePiece style: the normalizer marks the spaces, BPE over characters */
        t->char_level = true;
        t->split = SPLIT_NONE;
        return FU_OK;
    }
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
    if (strcmp(type_of(pt), "Metaspace") == 0 && split == SPLIT_NONE)
        return parse_metaspace(t, pt, lab, em);
    if (strcmp(type_of(pt), "ByteLevel") != 0)
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: pre_tokenizer '%.40s' is not supported; fusion reads ByteLevel and Metaspace "
                             "pre-tokenizers",
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

/* One normalizer: NFC, Prepend, or Replace with a String pattern. */
static fu_err parse_norm_step(fu_tokenizer *t, const cJSON *n, const char *lab, fu_errmsg *em)
{
    if (t->n_norm == FU_TOK_MAX_NORM)
        return fu_errmsg_set(em, FU_EVERSION, "%s: more than %d normalizers", lab, FU_TOK_MAX_NORM);
    norm_step *s = &t->norm[t->n_norm];
    const char *ty = type_of(n);
    if (strcmp(ty, "NFC") == 0) {
        s->kind = NORM_NFC;
    } else if (strcmp(ty, "Prepend") == 0) {
        if (!dup_string(n, "prepend", &s->a, &s->al))
            return fu_errmsg_set(em, FU_EPROTO, "%s: a Prepend normalizer needs a \"prepend\" string", lab);
        s->kind = NORM_PREPEND;
    } else if (strcmp(ty, "Replace") == 0) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        if (!dup_string(pat, "String", &s->a, &s->al) || s->al == 0 || !dup_string(n, "content", &s->b, &s->bl)) {
            free(s->a);
            s->a = NULL;
            return fu_errmsg_set(em, FU_EVERSION, "%s: a Replace normalizer is supported with a String pattern only",
                                 lab);
        }
        s->kind = NORM_REPLACE;
    } else {
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: normalizer '%.40s' is not supported (fusion applies NFC, Prepend and Replace)", lab, ty);
    }
    t->n_norm++;
    return FU_OK;
}

static fu_err parse_normalizer(fu_tokenizer *t, const cJSON *norm, const char *lab, fu_errmsg *em)
{
    if (!norm || cJSON_IsNull(norm))
        return FU_OK;
    if (!cJSON_IsObject(norm))
        return fu_errmsg_set(em, FU_EPROTO, "%s: normalizer is not an object", lab);
    if (strcmp(type_of(norm), "Sequence") != 0)
        return parse_norm_step(t, norm, lab, em);
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(norm, "normalizers");
    if (!cJSON_IsArray(list))
        return fu_errmsg_set(em, FU_EPROTO, "%s: a Sequence normalizer needs \"normalizers\"", lab);
    for (const cJSON *n = list->child; n; n = n->next) {
        if (!cJSON_IsObject(n))
            return fu_errmsg_set(em, FU_EPROTO, "%s: a normalizer is not an object", lab);
        FU_TRY(parse_norm_step(t, n, lab, em));
    }
    return FU_OK;
}

/* The decoder of a character-level (SentencePiece) tokenizer: a Sequence of Replace (String),
 * ByteFallback, Fuse and Strip, applied in that order. */
static fu_err parse_sp_decoder(fu_tokenizer *t, const cJSON *dec, const char *lab, fu_errmsg *em)
{
    const bool alone = cJSON_IsObject(dec) && strcmp(type_of(dec), "Metaspace") == 0; /* a list of one */
    const cJSON *list = cJSON_IsObject(dec) && strcmp(type_of(dec), "Sequence") == 0
                            ? cJSON_GetObjectItemCaseSensitive(dec, "decoders")
                            : NULL;
    if (!cJSON_IsArray(list) && !alone)
        return fu_errmsg_set(em, FU_EVERSION,
                             "%s: a tokenizer without a ByteLevel pre-tokenizer needs a Metaspace decoder or a decoder "
                             "Sequence of Metaspace or Replace, ByteFallback, Fuse and Strip (SentencePiece style)",
                             lab);
    for (const cJSON *d = alone ? dec : list->child; d; d = alone ? NULL : d->next) {
        const char *ty = type_of(d);
        if (strcmp(ty, "Metaspace") == 0) { /* its replacement back to spaces; the first one dropped */
            int scheme = metaspace_scheme(d);
            if (t->dec_from || scheme < 0 || !dup_string(d, "replacement", &t->dec_from, &t->dec_from_len) ||
                t->dec_from_len == 0)
                return fu_errmsg_set(em, FU_EVERSION, "%s: a Metaspace decoder needs a \"replacement\"", lab);
            t->dec_to = fu_strdup(" ");
            t->dec_to_len = 1;
            if (scheme != MS_NEVER)
                t->strip_char = ' ', t->strip_start = 1;
        } else if (strcmp(ty, "Replace") == 0) {
            const cJSON *pat = cJSON_GetObjectItemCaseSensitive(d, "pattern");
            if (t->dec_from || !dup_string(pat, "String", &t->dec_from, &t->dec_from_len) || t->dec_from_len == 0 ||
                !dup_string(d, "content", &t->dec_to, &t->dec_to_len))
                return fu_errmsg_set(em, FU_EVERSION, "%s: one Replace decoder with a String pattern is supported", lab);
        } else if (strcmp(ty, "Strip") == 0) {
            const cJSON *c = cJSON_GetObjectItemCaseSensitive(d, "content"), *st = cJSON_GetObjectItemCaseSensitive(d, "start"),
                        *sp = cJSON_GetObjectItemCaseSensitive(d, "stop");
            if (!cJSON_IsString(c) || strlen(c->valuestring) != 1 || !cJSON_IsNumber(st) || st->valuedouble < 0 ||
                st->valuedouble > 16 || (sp && !(cJSON_IsNumber(sp) && sp->valuedouble == 0)))
                return fu_errmsg_set(em, FU_EVERSION, "%s: a Strip decoder is supported for one character at the start",
                                     lab);
            t->strip_char = c->valuestring[0];
            t->strip_start = (int)st->valuedouble;
        } else if (strcmp(ty, "ByteFallback") != 0 && strcmp(ty, "Fuse") != 0) {
            return fu_errmsg_set(em, FU_EVERSION, "%s: decoder '%.40s' is not supported in a SentencePiece-style Sequence",
                                 lab, ty);
        }
    }
    return FU_OK;
}

static fu_err parse_bpe(fu_tokenizer *t, const cJSON *root, const char *lab, fu_errmsg *em)
{
    FU_TRY(parse_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), lab, em));
    FU_TRY(parse_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), lab, em));
    if (t->char_level)
        FU_TRY(parse_sp_decoder(t, cJSON_GetObjectItemCaseSensitive(root, "decoder"), lab, em));

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
    t->byte_fallback = json_flag(model, "byte_fallback", false);
    if (t->byte_fallback && !t->char_level)
        return fu_errmsg_set(em, FU_EVERSION, "%s: BPE byte_fallback with a ByteLevel pre-tokenizer is not supported", lab);
    t->fuse_unk = json_flag(model, "fuse_unk", false);
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
    fu_tok_smap_init(&t->vocab, n_vocab + n_added);
    for (const cJSON *v = vocab->child; v; v = v->next) {
        int32_t id = (int32_t)v->valuedouble;
        size_t len = strlen(v->string);
        if (t->id_str[id])
            return fu_errmsg_set(em, FU_EPROTO, "%s: id %d is given to both '%.60s' and '%.60s'", lab, id, t->id_str[id],
                                 v->string);
        if (!fu_tok_smap_put(&t->vocab, v->string, len, id))
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
        fu_tok_smap_put(&t->vocab, c, x->len, x->id); /* already there when the vocab lists it too */
    }
    if (t->n_added > 1)
        qsort(t->added, t->n_added, sizeof *t->added, cmp_added);

    fu_tok_pmap_init(&t->merges, n_merges);
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
        int32_t a = fu_tok_smap_get(&t->vocab, l, ll), b = fu_tok_smap_get(&t->vocab, r, rl);
        memcpy(pair, l, ll);
        memcpy(pair + ll, r, rl);
        int32_t ab = fu_tok_smap_get(&t->vocab, pair, ll + rl);
        if (a < 0 || b < 0 || ab < 0)
            return fu_errmsg_set(em, FU_EPROTO, "%s: merge %d ('%.*s' + '%.*s') uses a token that is not in the vocab", lab,
                                 rank, (int)(ll > 60 ? 60 : ll), l, (int)(rl > 60 ? 60 : rl), r);
        uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
        pmap_ent *e = fu_tok_pmap_slot(&t->merges, key);
        if (e->rank < 0) { /* the first (best) rank of a repeated merge wins */
            e->key = key;
            e->rank = rank;
            e->id = ab;
        }
    }

    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    t->unk_id =
        cJSON_IsString(unk) ? fu_tok_smap_get(&t->vocab, unk->valuestring, strlen(unk->valuestring)) : -1;
    fu_tok_byte_unicode_maps(t->byte_cp, t->cp_byte);
    for (int b = 0; b < 256; b++) {
        char u[8];
        size_t n = fu_tok_utf8_put(u, t->byte_cp[b]);
        t->byte_tok[b] = t->char_level ? -1 : fu_tok_smap_get(&t->vocab, u, n);
        snprintf(u, sizeof u, "<0x%02X>", b);
        t->fallback_id[b] = t->byte_fallback ? fu_tok_smap_get(&t->vocab, u, 6) : -1;
    }
    static const char *const bos_names[] = {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"};
    static const char *const eos_names[] = {"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"};
    t->bos_id = t->eos_id = -1;
    for (size_t i = 0; i < 4; i++) {
        if (t->bos_id < 0)
            t->bos_id = fu_tok_smap_get(&t->vocab, bos_names[i], strlen(bos_names[i]));
        if (t->eos_id < 0)
            t->eos_id = fu_tok_smap_get(&t->vocab, eos_names[i], strlen(eos_names[i]));
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

fu_err fu_tokenizer_apply_config(fu_tokenizer *t, const char *json, size_t len, fu_errmsg *em)
{
    if (!t || !json || t->kind != FU_TOK_BPE)
        return FU_OK;
    cJSON *c = cJSON_ParseWithLength(json, len);
    fu_err rc = FU_OK;
    if (!cJSON_IsObject(c))
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: not a JSON object", FU_TOKENIZER_CONFIG_FILE);
    else
        t->cleanup = json_flag(c, "clean_up_tokenization_spaces", true);
    cJSON_Delete(c);
    return rc;
}

/* tokenizer_config.json beside a tokenizer.json (dir/FU_TOKENIZER_CONFIG_FILE), when there. */
static fu_err read_config(fu_tokenizer *t, const char *dir, fu_errmsg *em)
{
    char *p = fu_path_join(dir, FU_TOKENIZER_CONFIG_FILE);
    char *txt = NULL;
    size_t len = 0;
    fu_err rc = FU_OK;
    if (fu_path_exists(p) && (rc = fu_file_read_all(p, FU_TOKENIZER_MAX_BYTES, &txt, &len, em)) == FU_OK)
        rc = fu_tokenizer_apply_config(t, txt, len, em);
    free(txt);
    free(p);
    return rc;
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
    if (rc == FU_OK && (*out)->kind == FU_TOK_BPE) {
        const char *base = fu_path_base(path); /* the folder of path: its text before the base name */
        char *dir = fu_malloc((size_t)(base - path) + 1);
        memcpy(dir, path, (size_t)(base - path));
        dir[base - path] = '\0';
        rc = read_config(*out, dir[0] ? dir : ".", em);
        free(dir);
        if (rc != FU_OK)
            fu_tokenizer_destroy(out);
    }
    return rc;
}

fu_err fu_tokenizer_for_model(const char *json, size_t len, size_t model_vocab, bool allow_bytes, fu_tokenizer **out,
                              fu_errmsg *em)
{
    if (!out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_for_model: NULL argument");
    *out = NULL;
    if (!json && model_vocab > 256 && !allow_bytes)
        return fu_errmsg_set(em, FU_EINVAL,
                             "the model has %zu token ids but no %s: its ids are not bytes, so text cannot be "
                             "tokenized for it (add the checkpoint's tokenizer.json, or pass --byte-tokens to use "
                             "ids 0..255 anyway)",
                             model_vocab, FU_TOKENIZER_FILE);
    if (!json) {
        *out = fu_tokenizer_new_bytes(model_vocab);
        return *out ? FU_OK : fu_errmsg_set(em, FU_EINVAL, "vocab_size %zu is over the limit", model_vocab);
    }
    fu_err rc = fu_tokenizer_parse_json(json, len, FU_TOKENIZER_FILE, out, em);
    if (rc == FU_OK && model_vocab > 0 && (*out)->vocab_size > model_vocab) {
        rc = fu_errmsg_set(em, FU_EINVAL, "%s has ids up to %zu but the model's vocab_size is %zu", FU_TOKENIZER_FILE,
                           (*out)->vocab_size - 1, model_vocab);
        fu_tokenizer_destroy(out);
    }
    return rc;
}

fu_err fu_tokenizer_open_dir(const char *dir, size_t model_vocab, bool allow_bytes, fu_tokenizer **out, fu_errmsg *em)
{
    if (!dir || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_tokenizer_open_dir: NULL argument");
    *out = NULL;
    char *p = fu_path_join(dir, FU_TOKENIZER_FILE);
    char *txt = NULL;
    size_t len = 0;
    fu_err rc = FU_OK;
    if (fu_path_exists(p))
        rc = fu_file_read_all(p, FU_TOKENIZER_MAX_BYTES, &txt, &len, em);
    free(p);
    if (rc == FU_OK)
        rc = fu_tokenizer_for_model(txt, len, model_vocab, allow_bytes, out, em);
    free(txt);
    if (rc == FU_OK && (*out)->kind == FU_TOK_BPE && (rc = read_config(*out, dir, em)) != FU_OK)
        fu_tokenizer_destroy(out);
    return rc;
}
