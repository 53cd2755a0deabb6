/* peer_spec: what a stage needs from a job spec (StageAssign.spec_json, docs/PIPELINE.md "The job
 * spec"), and the pipeline's data order ("Data order"): which token windows step s, micro-batch m
 * uses. Every stage computes the data order itself from (spec, step, micro-batch), so stage 0
 * (inputs) and the last stage (targets) need no data messages from each other.
 *
 * The broker validates the spec before a job is accepted; the peer parses only the keys it uses,
 * ignores the others, and still treats the text as untrusted (bounded, typed, range-checked).
 * Threads: pure functions; no state. */
#ifndef FU_PEER_SPEC_H
#define FU_PEER_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_file.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PEER_SPEC_MAX_BYTES     (1u << 20) /* a spec longer than this is refused */
#define PEER_SPEC_MAX_PROMPT    65536u     /* most prompt_tokens accepted */
#define PEER_SPEC_MAX_STEPS     100000000ull
#define PEER_SPEC_MAX_ROWS      (1u << 20) /* batch · seq_len bound (as `fusion run finetune`) */

/* The keys of a job spec a stage uses (defaults as `fusion run`). */
typedef struct {
    bool infer;               /* an inference spec (has "max_tokens"), else fine-tuning */
    /* fine-tuning */
    double lr;                /* AdamW learning rate (default 1e-3) */
    double weight_decay;      /* AdamW decoupled weight decay (default 0) */
    uint64_t steps;           /* optimizer steps (default 100) */
    uint32_t batch;           /* B sequences per step (default 4) */
    uint32_t seq_len;         /* tokens per sequence (default 128) */
    uint32_t micro_batches;   /* M, divides B (default 1) */
    bool shuffle;             /* seeded Fisher-Yates order of the windows */
    uint64_t seed;            /* shuffle and adapter initialisation seed (default 0) */
    uint64_t checkpoint_every;/* K: checkpoint after step s when (s+1) % K == 0 (0: only the last) */
    /* inference */
    uint32_t max_tokens;      /* tokens to generate */
    double temperature;       /* <= 0: greedy */
    int32_t top_k;            /* 0: off */
    double top_p;             /* >= 1: off */
    bool dump_logits;         /* send the logits of every prompt position with the first token */
    int32_t *prompt_tokens;   /* "prompt_tokens": [..] when given (owned), else NULL */
    size_t n_prompt_tokens;
} peer_spec;

/* Parses a spec. Unknown keys are ignored (the broker refuses them before a job runs); a known key
 * with the wrong type or an out-of-range value is FU_EINVAL with a message naming it; malformed
 * JSON is FU_EPROTO. micro_batches must divide batch. *out is overwritten (free with
 * peer_spec_clear). */
FU_MUST_CHECK fu_err peer_spec_parse(const char *json, size_t len, peer_spec *out, fu_errmsg *em);
void peer_spec_clear(peer_spec *s);

/* The rows of micro-batch `micro_batch` of step `step` in the data order of docs/PIPELINE.md:
 * dag_data_rows with the spec's batch, micro-batches, seq_len, shuffle and seed. */
FU_MUST_CHECK fu_err peer_data_rows(const peer_spec *spec, const int32_t *ids, size_t n_ids, uint64_t step,
                                    uint32_t micro_batch, int32_t *tokens, int32_t *targets);

#ifdef __cplusplus
}
#endif
#endif
