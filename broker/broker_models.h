/* broker_models: the models the broker serves, known by their content (docs/SECURITY.md "Models by
 * content").
 *
 * A model is a Hugging Face directory under one of the operator's model roots (--model-root). Its
 * id is "m:" and the hex BLAKE2b-256 of config.json, salr_config.json and tokenizer.json (each when
 * present) and, for every tensor in name order, its name, dtype, shape and the BLAKE2b-256 of its
 * bytes. Two directories with the same id hold the same model; a copy with one byte changed is
 * another model. Jobs are pinned to the id, and peers get each tensor with its hash (they check it),
 * so a peer receives exactly the bytes the id names.
 *
 * Names are resolved against the roots: an absolute name must lie inside one (after every link is
 * followed), a relative one is looked up in each root in turn. Anything else is "not found" whether
 * it exists or not, a model directory holding a link that leaves the roots is refused, and no error
 * returned carries bytes read from a file (format errors are logged for the operator; the caller
 * gets which file is malformed).
 *
 * Opening hashes every byte of the model (about 1 GB/s), so the broker opens models on its
 * preparation thread, never on its loop. The small files are read once, into the model, so the job
 * is built from the bytes that were hashed.
 *
 * The cache is thread-safe. A model stays mapped while a reference is held (each job holds one);
 * up to `keep` unreferenced models stay mapped for reuse, the least recently used go first. A
 * directory whose files changed (size, times, inode) is hashed again. */
#ifndef FU_BROKER_MODELS_H
#define FU_BROKER_MODELS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_safetensors.h"

#define BROKER_MODEL_HASH_LEN 32       /* BLAKE2b-256 */
#define BROKER_MODEL_ID_LEN   66       /* "m:" + 64 hex */
#define BROKER_MODELS_KEEP    4        /* default unreferenced models kept mapped */
#define BROKER_MODEL_ROOTS_MAX 16      /* --model-root directories */

typedef struct broker_models broker_models;

/* One model, immutable once opened (shared by threads without locking). */
typedef struct {
    char id[BROKER_MODEL_ID_LEN + 1];  /* "m:<hex>" */
    char *dir;                         /* its resolved directory (for the operator's log only) */
    char *config;                      /* config.json as hashed (NUL-terminated) */
    size_t config_len;
    char *salr;                        /* salr_config.json, or NULL: not a SALR-pruned model */
    size_t salr_len;
    char *tokenizer;                   /* tokenizer.json, or NULL: none */
    size_t tokenizer_len;
    char *tok_config;                  /* tokenizer_config.json (its chat_template), or NULL; not part of the id:
                                          it changes nothing the peers compute */
    size_t tok_config_len;
    fu_safetensors *st;                /* mapped weights (read-only) */
    uint8_t (*hashes)[BROKER_MODEL_HASH_LEN]; /* per tensor, in fu_safetensors_at order */
    uint64_t bytes;                    /* tensor bytes */
    uint8_t sig[BROKER_MODEL_HASH_LEN]; /* its directory's files (names, inodes, sizes, times) when hashed */
    _Atomic(unsigned) refs;            /* references held (the cache's lock guards 0 -> 1) */
} broker_model;

/* A cache over `roots` (each must be an existing directory; stored resolved). keep: unreferenced
 * models kept mapped (0: BROKER_MODELS_KEEP). NULL with why when a root is unusable. No roots: every
 * model is refused with a sentence naming --model-root. */
broker_models *broker_models_new(const char *const *roots, size_t n_roots, size_t keep, fu_errmsg *em);
void broker_models_free(broker_models **c);

/* Opens the model `name` (see above) and returns a reference in *out. May take seconds (hashing).
 * FU_ENOTFOUND: not found under the roots; FU_EPROTO: a malformed file (named); FU_EPERM: a link
 * leaving the roots; FU_EINVAL: no roots. */
FU_MUST_CHECK fu_err broker_models_open(broker_models *c, const char *name, broker_model **out, fu_errmsg *em);

/* Tells c the hashes a directory had when its files had signature sig (what a restarted broker
 * read back from its store): opening it with that signature again skips hashing the tensors; the
 * small files are read and the id recomputed, and a mismatch hashes everything. Copies its inputs.
 * Call it before the first broker_models_open. */
void broker_models_known(broker_models *c, const char *dir, const uint8_t sig[BROKER_MODEL_HASH_LEN],
                         const char *id, const uint8_t *hashes, size_t n_tensors);

/* Gives a reference back (NULL-safe); the model stays cached until evicted. Sets *m = NULL. */
void broker_model_release(broker_model **m);

/* Tells the kernel the pages of [p, p + n) may be dropped from this process (they stay in the page
 * cache): hashing or serving a model does not grow the broker's resident memory. */
void broker_model_drop_pages(const void *p, size_t n);

#endif
