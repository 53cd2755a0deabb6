/* dag_model: model directories as the IR plane sees them: dimensions from config.json, a random
 * model for tests and benchmarks, and SALR pruning of a model directory (`fusion model prune`).
 *
 * A pruned (SALR) model directory holds config.json, salr_config.json and model.safetensors where
 * each of the seven linear weights of every layer is stored bitmap-encoded as three tensors
 * <name>.bitmap (U8), <name>.values (F32) and <name>.offsets (I32) (kern_bitmap.h; metadata
 * <name>.format = "salr-bitmap-v1"), next to its frozen truncated-SVD residual adapter
 * <module>.salr_A.weight [r, in] and <module>.salr_B.weight [out, r] (R ≈ salr_B·salr_A). Unless
 * --keep-lm-head (or tied embeddings), lm_head.weight is stored the same way (lm_head.salr_A/B.weight). Other tensors are
 * copied unchanged. See docs/DAG.md and docs/SALR.md. */
#ifndef FU_DAG_MODEL_H
#define FU_DAG_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_graph.h"
#include "fu_err.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_SALR_CONFIG_FILE "salr_config.json"
#define DAG_SALR_DEFAULT_RANK 16 /* residual rank when none is given */

/* Copies tokenizer.json and tokenizer_config.json from dir to out_dir, each when it is there (a
 * model written from another: merged, quantized). */
FU_MUST_CHECK fu_err dag_model_copy_tokenizer(const char *dir, const char *out_dir, fu_errmsg *em);

/* The builder's dimensions from a validated config. */
void dag_dims_from_cfg(const fu_modelcfg *cfg, dag_model_dims *out);

/* Writes config.json and model.safetensors (F32) of a model with cfg's shapes into dir (made if
 * needed): norms 1, every other weight N(0, std²) from a seeded stream per tensor name. For tests
 * and benchmarks. */
FU_MUST_CHECK fu_err dag_model_init_random(const char *dir, const fu_modelcfg *cfg, uint64_t seed, float std,
                                           fu_errmsg *em);
/* dag_model_init_random with every tensor stored as dtype (F32, F16 or BF16; the same F32 draws,
 * converted): `fusion model init`. */
FU_MUST_CHECK fu_err dag_model_init_random_as(const char *dir, const fu_modelcfg *cfg, uint64_t seed,
                                              float std, fu_st_dtype dtype, fu_errmsg *em);

/* What `fusion model prune` does. */
typedef struct {
    double sparsity;    /* fraction of each pruned matrix set to zero, in [0, 1) */
    uint32_t rank;      /* rank of each frozen residual adapter (1..the matrix's smaller side) */
    uint64_t seed;      /* randomized SVD */
    bool prune_lm_head; /* prune lm_head.weight too (ignored, and reported, with tied embeddings) */
} dag_salr_prune_opts;

/* What pruning did: relative errors ‖W − (W_s + B·A)‖_F / ‖W‖_F of the weight the model then
 * computes with (the pruned matrix plus its rank-r residual) against the dense one. */
typedef struct {
    size_t n_blocks;          /* block linears pruned */
    double blocks_err_mean;   /* mean relative error over the block linears */
    double blocks_err_max;    /* worst relative error over the block linears */
    bool lm_head_pruned;      /* lm_head.weight was pruned */
    bool lm_head_tied;        /* pruning was asked for but the embeddings are tied: left dense */
    double lm_head_err;       /* relative error of the pruned lm_head (0 when dense) */
    double lm_head_svd_ratio; /* ‖R − R_r‖²_F / ‖R‖²_F of lm_head's residual (how little rank r kept) */
    uint64_t bytes_in;        /* f32 bytes of every tensor read from in_dir */
    uint64_t bytes_out;       /* bytes of the tensors written to out_dir */
} dag_salr_prune_report;

/* SALR-prunes the model in in_dir into out_dir: each linear weight of every layer (and lm_head.weight
 * when o->prune_lm_head and the embeddings are untied) magnitude-pruned to o->sparsity
 * (kern_salr_prune), stored bitmap-encoded, its residual kept as a rank-o->rank SVD adapter
 * (kern_salr_svd, seeded); everything else copied. Writes salr_config.json {"method", "sparsity",
 * "residual_rank", "format", "lm_head": "salr" | "dense"}. rep (may be NULL) receives what was done.
 * FU_EINVAL for sparsity outside [0, 1) or a rank above a matrix's smaller side; errors of
 * reading/writing with a message. */
FU_MUST_CHECK fu_err dag_salr_prune(const char *in_dir, const char *out_dir, const dag_salr_prune_opts *o,
                                    dag_salr_prune_report *rep, fu_errmsg *em);

/* dag_salr_prune with the block linears only (lm_head kept dense, as `fusion model prune --keep-lm-head`). */
FU_MUST_CHECK fu_err dag_salr_prune_model(const char *in_dir, const char *out_dir, double sparsity, uint32_t rank,
                                          uint64_t seed, fu_errmsg *em);

/* A pruned model's salr_config.json. */
typedef struct {
    uint32_t residual_rank; /* rank of every residual adapter */
    double sparsity;        /* pruned fraction of each matrix */
    bool lm_head;           /* lm_head.weight is pruned too ("lm_head": "salr"): build with salr_lm_head */
} dag_salr_info;

/* Reads dir/salr_config.json. A file without "lm_head" (written before lm_head pruning existed)
 * means a dense lm_head. FU_ENOTFOUND when dir is not a pruned model; FU_EPROTO for a malformed file. */
FU_MUST_CHECK fu_err dag_salr_info_load(const char *dir, dag_salr_info *out, fu_errmsg *em);
/* The same from the file's text. */
FU_MUST_CHECK fu_err dag_salr_info_parse(const char *txt, size_t len, dag_salr_info *out, fu_errmsg *em);

#ifdef __cplusplus
}
#endif
#endif
