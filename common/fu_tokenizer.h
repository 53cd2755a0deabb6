/* fu_tokenizer: text <-> token ids for fine-tuning data and generation (docs/FORMATS.md).
 *
 * Two kinds:
 *  - byte-level (the default, and what `fusion model init` models use): token id = byte value,
 *    vocab >= 256, decode is the identity on bytes; ids 256.. (a larger model vocab) decode to
 *    nothing.
 *  - BPE read from a Hugging Face tokenizer.json, of either family:
 *    - byte-level BPE (GPT-2, Llama 3, Qwen2/3): a ByteLevel pre-tokenizer (GPT-2's byte<->unicode
 *      mapping and its split of words, numbers, punctuation and spaces), optionally after a Split
 *      with the Llama-3 or Qwen2 pattern; ignore_merges; an NFC normalizer (Qwen);
 *    - SentencePiece-style BPE (Llama 2, Mistral, TinyLlama): no pre-tokenizer, a normalizer
 *      Sequence of Prepend("▁") and Replace(" " -> "▁"), BPE over characters with byte_fallback
 *      (<0xXX> tokens) and fuse_unk, and the decoder Sequence Replace, ByteFallback, Fuse, Strip;
 *    "added_tokens" (special tokens such as <s>) are matched in the raw text first, and each
 *    stretch between them is normalized and encoded alone. tokenizer_config.json beside it gives
 *    clean_up_tokenization_spaces for decoding.
 * Categories (\p{L}, \p{N}) come from Unicode tables (fu_unicode.h) and \s is JavaScript's: ids
 * equal @lenml/tokenizers' (transformers.js) on the conformance corpus (test_tokenizer_conformance).
 *
 * Limits (said by FU_EVERSION at load time, never silently ignored): other normalizers (NFKC,
 * Lowercase, Replace with a Regex), other pre-tokenizers (Metaspace, Whitespace, Digits), Split
 * patterns other than the GPT-2, Llama-3 and Qwen2 ones, BPE dropout, continuing_subword_prefix,
 * end_of_word_suffix, and models other than BPE (WordPiece, Unigram).
 *
 * A tokenizer is read-only after construction and may be shared by threads. */
#ifndef FU_TOKENIZER_H
#define FU_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FU_TOKENIZER_FILE "tokenizer.json"
#define FU_TOKENIZER_CONFIG_FILE "tokenizer_config.json" /* beside it: clean_up_tokenization_spaces */
/* Largest tokenizer.json read. */
#define FU_TOKENIZER_MAX_BYTES ((size_t)64 << 20)
/* Largest token id + 1 accepted. */
#define FU_TOKENIZER_MAX_VOCAB ((size_t)1 << 22)
/* Longest token string accepted (bytes). */
#define FU_TOKENIZER_MAX_TOKEN 1024

typedef enum {
    FU_TOK_BYTES = 0, /* token id = byte value */
    FU_TOK_BPE,       /* byte-level BPE from tokenizer.json */
} fu_tok_kind;

typedef struct fu_tokenizer fu_tokenizer;

/* A byte-level tokenizer with vocab_size ids (raised to 256 when smaller). NULL when vocab_size is
 * over FU_TOKENIZER_MAX_VOCAB. Destroy with fu_tokenizer_destroy. */
fu_tokenizer *fu_tokenizer_new_bytes(size_t vocab_size);

/* Parses tokenizer.json text. label names it in messages. FU_EPROTO for malformed content,
 * FU_EVERSION for features not supported (see above), FU_ENOMEM over the limits. */
FU_MUST_CHECK fu_err fu_tokenizer_parse_json(const char *json, size_t len, const char *label, fu_tokenizer **out,
                                             fu_errmsg *em);

/* Reads and parses a tokenizer.json file. */
FU_MUST_CHECK fu_err fu_tokenizer_load(const char *path, fu_tokenizer **out, fu_errmsg *em);

/* The tokenizer of a model directory: dir/tokenizer.json when present, else byte-level with
 * model_vocab ids, which a model of more than 256 ids gets only with allow_bytes (FU_EINVAL
 * otherwise: its ids are not bytes, and a byte tokenizer would feed it nonsense). When model_vocab > 0
 * every id of the tokenizer must be below it (FU_EINVAL: "tokenizer.json has ids up to N but the
 * model's vocab_size is M"). */
FU_MUST_CHECK fu_err fu_tokenizer_open_dir(const char *dir, size_t model_vocab, bool allow_bytes, fu_tokenizer **out,
                                           fu_errmsg *em);
/* The same from the text of tokenizer.json (NULL: the model has none: byte-level). */
FU_MUST_CHECK fu_err fu_tokenizer_for_model(const char *json, size_t len, size_t model_vocab, bool allow_bytes,
                                            fu_tokenizer **out, fu_errmsg *em);

/* What tokenizer_config.json's text says about decoding: clean_up_tokenization_spaces (true when
 * the file does not say, transformers' default). The loaders that read a directory apply the file
 * beside tokenizer.json themselves; call this while the tokenizer is being set up (it is read-only
 * afterwards). A no-op for byte-level tokenizers and NULL json; FU_EPROTO for text that is not a
 * JSON object. */
FU_MUST_CHECK fu_err fu_tokenizer_apply_config(fu_tokenizer *tok, const char *json, size_t len, fu_errmsg *em);

/* Frees; idempotent; sets *tok_p = NULL. */
void fu_tokenizer_destroy(fu_tokenizer **tok_p);

fu_tok_kind fu_tokenizer_kind(const fu_tokenizer *tok);
/* Largest token id + 1. */
size_t fu_tokenizer_vocab_size(const fu_tokenizer *tok);

/* Encodes text[0..len) (any bytes; UTF-8 expected) to ids. *ids is a new array (caller frees; NULL
 * when *n is 0). FU_EPROTO when a byte has no token and the model has no unk_token. Special tokens
 * written in the text (for example "<s>") become their ids. No BOS/EOS is added. */
FU_MUST_CHECK fu_err fu_tokenizer_encode(const fu_tokenizer *tok, const char *text, size_t len, int32_t **ids,
                                         size_t *n, fu_errmsg *em);

/* Decodes ids to bytes: *text is new (caller frees) and NUL-terminated, *len excludes the NUL.
 * FU_EINVAL for an id outside the vocabulary. */
FU_MUST_CHECK fu_err fu_tokenizer_decode(const fu_tokenizer *tok, const int32_t *ids, size_t n, char **text,
                                         size_t *len, fu_errmsg *em);

/* Id of a token by its string as written in tokenizer.json ("<s>", "Ġthe"), or -1. For byte-level
 * tokenizers a one-byte string gives its byte. */
int32_t fu_tokenizer_token_id(const fu_tokenizer *tok, const char *token);

/* The string of id as written in tokenizer.json (borrowed), or NULL (also for byte-level). */
const char *fu_tokenizer_token(const fu_tokenizer *tok, int32_t id);

/* Begin/end-of-sequence ids guessed from the special tokens (<s>, <|begin_of_text|>, <bos> and
 * </s>, <|end_of_text|>, <|endoftext|>, <eos>), or -1. A model's config.json bos_token_id and
 * eos_token_id take precedence. */
int32_t fu_tokenizer_bos_id(const fu_tokenizer *tok);
int32_t fu_tokenizer_eos_id(const fu_tokenizer *tok);

#ifdef __cplusplus
}
#endif
#endif
