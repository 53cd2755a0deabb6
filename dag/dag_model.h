/* dag_model: model directories as the IR plane sees them: dimensions from config.json, a random
 * model for tests and benchmarks, and SALR pruning of a model directory (`fusion model prune`).
 *
 * A pruned (SALR) model directory holds config.json, salr_config.json and model.safetensors where
 * each of the seven linear weights of every layer is stored bitmap-encoded as three tensors
 * <name>.bitmap (U8), <name>.values (F32) and <name>.offsets (I32) (kern_bitmap.h; metadata
 * <name>.format = "salr-bitmap-v1"), next to its frozen truncated-SVD residual adapter
 * <module>.salr_A.weight [r, in] and <module>.salr_B.weight [out, r] (R ≈ salr_B·salr_A). Other
 * tensors are copied unchanged. See docs/DAG.md. */
#ifndef FU_DAG_MODEL_H
#define FU_DAG_MODEL_H

#include <stdint.h>

#include "dag_graph.h"
#include "fu_err.h"
#include "fu_file.h"
#include "fu_modelcfg.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_SALR_CONFIG_FILE "salr_config.json"
#define DAG_SALR_DEFAULT_RANK 16 /* residual rank when none is given */

/* The builder's dimensions from a validated config. */
void dag_dims_from_cfg(const fu_modelcfg *cfg, dag_model_dims *out);

/* Writes config.json and model.safetensors (F32) of a model with cfg's shapes into dir (made if
 * needed): norms 1, every other weight N(0, std²) from a seeded stream per tensor name. For tests
 * and benchmarks. */
FU_MUST_CHECK fu_err dag_model_init_random(const char *dir, const fu_modelcfg *cfg, uint64_t seed, float std,
                                           fu_errmsg *em);

/* SALR-prunes the model in in_dir into out_dir: each linear weight magnitude-pruned to `sparsity`
 * (kern_salr_prune), stored bitmap-encoded, its residual kept as a rank-`rank` SVD adapter
 * (kern_salr_svd, seeded); everything else copied. Writes salr_config.json
 * {"sparsity", "residual_rank", "format"}. FU_EINVAL for sparsity outside [0, 1) or a rank above
 * a matrix's smaller side; errors of reading/writing with a message. */
FU_MUST_CHECK fu_err dag_salr_prune_model(const char *in_dir, const char *out_dir, double sparsity, uint32_t rank,
                                          uint64_t seed, fu_errmsg *em);

/* Reads dir/salr_config.json. FU_ENOTFOUND when dir is not a pruned model. */
FU_MUST_CHECK fu_err dag_salr_config_load(const char *dir, uint32_t *residual_rank, double *sparsity, fu_errmsg *em);

#ifdef __cplusplus
}
#endif
#endif
