/* dag_quant: frozen base weights in int8 (`fusion model quantize`). Every linear projection of the
 * decoder layers (q, k, v, o, gate, up, down) becomes symmetric int8 per output channel: row r keeps
 * scale_r = max|W[r,:]| / 127 and q = round(W / scale_r) in [-127, 127], stored as the I8 tensor
 * NAME beside NAME_scale (F32 [out, 1]); config.json gains quantization_config {"quant_method":
 * "fusion-int8"}. Embeddings, lm_head, norms and biases keep their dtype and bits. The CPU executor
 * keeps the int8 weights in memory and widens them per GEMM tile (kern_cpu_sgemm_wn), so LoRA-FA
 * trains over them with a quarter of f32's weight memory; results have exactly the bits of the
 * dequantized f32 weights. docs/DAG.md "Int8 weights" states the logits bound. */
#ifndef FU_DAG_QUANT_H
#define FU_DAG_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    size_t   tensors;     /* weights written (not counting scales) */
    size_t   quantized;   /* of them, int8 */
    uint64_t bytes_in;    /* the weights' bytes in the source */
    uint64_t bytes_out;   /* ... in the quantized model (scales included) */
    double   max_rel_err; /* largest |W - Q·s| / max|W[r,:]| over every quantized row (at most 1/254) */
} dag_quant_report;

/* Quantizes model_dir into out_dir (created; an existing model there is refused unless force) and
 * copies its tokenizer files. Refused with a message: a SALR-pruned model, one already quantized,
 * a weight that is not finite. */
FU_MUST_CHECK fu_err dag_model_quantize(const char *model_dir, const char *out_dir, bool force, dag_quant_report *rep,
                                        fu_errmsg *em);

#ifdef __cplusplus
}
#endif
#endif
