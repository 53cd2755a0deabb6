/* fu_tokenizer_internal: what the files of the tokenizer share (fu_tokenizer.c: the object, its
 * hash maps, UTF-8 and GPT-2's byte <-> unicode mapping, decode; fu_tokenizer_json.c: reading
 * tokenizer.json; fu_tokenizer_encode.c: pre-tokenization and BPE). Private to those files. */
#ifndef FU_TOKENIZER_INTERNAL_H
#define FU_TOKENIZER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- small hash maps (fu_tokenizer.c) ---------------------------------------------------------- */

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

/* Empty map with room for want keys (it does not grow). */
void fu_tok_smap_init(smap *m, size_t want);

/* Id of k[0..len), or -1 (also for a map never initialised). */
int32_t fu_tok_smap_get(const smap *m, const char *k, size_t len);

/* Inserts k -> id; false when k is present already. The map is sized at init (no growth). */
bool fu_tok_smap_put(smap *m, const char *k, size_t len, int32_t id);

typedef struct {
    uint64_t key;  /* (left id << 32) | right id */
    int32_t  rank; /* merge priority (its line in "merges"); -1 = empty slot */
    int32_t  id;   /* id of the merged token */
} pmap_ent;

typedef struct {
    pmap_ent *e;
    size_t    cap;
} pmap;

/* Empty map with room for want merges (it does not grow). */
void fu_tok_pmap_init(pmap *m, size_t want);

/* The slot of key: its entry, or the empty slot where it goes (rank -1). */
pmap_ent *fu_tok_pmap_slot(const pmap *m, uint64_t key);

/* ---- UTF-8 and GPT-2 byte <-> unicode (fu_tokenizer.c) ----------------------------------------- */

#define CP_INVALID 0xFFFFFFFFu

/* GPT-2 maps each byte to a printable code point (byte_cp); cp_byte is the inverse, -1 elsewhere. */
void fu_tok_byte_unicode_maps(uint32_t byte_cp[256], int16_t cp_byte[512]);

/* Writes cp as UTF-8 to out (room for 4 bytes); returns its length. */
size_t fu_tok_utf8_put(char *out, uint32_t cp);

/* Decodes one UTF-8 character at s[i] (i < n); returns its length (>= 1). Malformed bytes come
 * back one at a time as CP_INVALID. */
size_t fu_tok_utf8_next(const uint8_t *s, size_t n, size_t i, uint32_t *cp);

/* ---- the tokenizer ----------------------------------------------------------------------------- */

/* Word splitting rules fusion knows (their regular expressions: fu_tokenizer_json.c). */
enum { SPLIT_NONE = 0, SPLIT_GPT2, SPLIT_LLAMA3, SPLIT_QWEN2 };

/* One step of a normalizer Sequence (tokenizer.json "normalizer"), applied to each stretch of text
 * between added tokens. */
enum { NORM_NFC = 1, NORM_PREPEND, NORM_REPLACE };
enum { MS_NEVER = 0, MS_FIRST, MS_ALWAYS };
#define FU_TOK_MAX_NORM 4

typedef struct {
    int   kind;     /* NORM_* */
    char *a, *b;    /* PREPEND: a = the prefix; REPLACE: a -> b (String patterns) */
    size_t al, bl;
} norm_step;

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
    /* SentencePiece-style BPE (Llama 2, Mistral, TinyLlama): no ByteLevel pre-tokenizer, so the
     * symbols are characters, and characters missing from the vocabulary become <0xXX> tokens. */
    bool        char_level;    /* symbols are UTF-8 characters (no GPT-2 byte mapping) */
    bool        byte_fallback; /* model.byte_fallback */
    bool        fuse_unk;      /* model.fuse_unk: consecutive unknown characters are one <unk> */
    int32_t     fallback_id[256]; /* id of <0xXX>, or -1 */
    norm_step   norm[FU_TOK_MAX_NORM];
    size_t      n_norm;
    /* decoder Sequence of a SentencePiece tokenizer: Replace(dec_from -> dec_to), ByteFallback,
     * Fuse, Strip(strip_char, strip_start leading) */
    /* a Metaspace pre-tokenizer (split false): spaces become ms_rep, which is prepended to the text
     * between added tokens unless it starts with it: always, or only at the start of the input */
    bool        metaspace;
    int         ms_prepend;    /* MS_NEVER, MS_FIRST, MS_ALWAYS */
    char       *ms_rep;
    size_t      ms_rep_len;
    char       *dec_from, *dec_to;
    size_t      dec_from_len, dec_to_len;
    int         strip_start;
    char        strip_char;
    bool        cleanup;       /* tokenizer_config.json clean_up_tokenization_spaces: " ." -> "." ... */
};

#ifdef __cplusplus
}
#endif
#endif
