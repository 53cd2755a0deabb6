/* dag_spec: the job spec (docs/PIPELINE.md "The job spec"), with one owner for its fields, their
 * defaults and limits (one table in dag_spec.c), its JSON codec and its command-line options.
 * `fusion run`, `fusion submit`, the broker and the peer all go through here; nothing else parses a
 * spec.
 *
 *   - The JSON form is an object of the fields below, named as in the table ("seq_len"), plus
 *     "kind": "finetune" | "infer". Unknown keys, wrong types and values out of range are refused
 *     with a message naming the key. Absent keys take their defaults, the same everywhere.
 *   - dag_spec_to_json writes every field (the canonical form the broker sends to peers).
 *   - dag_spec_cli_opts adds the spec's options to a command's fu_opt table; dag_spec_from_cli turns
 *     what was parsed into a checked spec, with the same limits and messages as the JSON form.
 *
 * Threads: pure functions; a dag_spec is plain data (its prompt_tokens owned). */
#ifndef FU_DAG_SPEC_H
#define FU_DAG_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_data.h"
#include "dag_graph.h"
#include "fu_err.h"
#include "fu_file.h"
#include "fu_opts.h"
#include "kern_backend.h"
#include "kern_codec.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_SPEC_MAX_BYTES   (1u << 20) /* a spec's JSON text longer than this is refused */
#define DAG_SPEC_MODEL_MAX   1024       /* longest model path */
#define DAG_SPEC_MAX_PROMPT  65536u     /* most prompt_tokens */
#define DAG_SPEC_MAX_ROWS    (1u << 20) /* batch x seq_len: most tokens of one step */
#define DAG_SPEC_MAX_TOKENS  65536u     /* most tokens one inference job generates */
#define DAG_SPEC_JOB_ID_LEN  16         /* "adapter_job": 16 hex characters */
#define DAG_SPEC_MAX_SESSIONS 256      /* most sessions of a serving job (DAG_INFER_MAX_BATCH) */
#define DAG_SPEC_CONTEXT      2048u    /* a serving job's positions per session unless "context" says */
#define DAG_SPEC_MAX_STOP    4          /* "stop": strings that end a generation's text */
#define DAG_SPEC_STOP_LEN    256        /* bytes of one stop string */
#define DAG_SPEC_MAX_SEED    1125899906842624.0 /* 2^50: JSON numbers (doubles, printed with 15 digits) keep
                                                    every seed up to here exactly */

/* AdamW's constants (the spec carries lr and weight_decay; these are fixed for every job). */
#define DAG_SPEC_ADAM_BETA1 0.9f
#define DAG_SPEC_ADAM_BETA2 0.999f
#define DAG_SPEC_ADAM_EPS   1e-8f

typedef enum {
    DAG_JOB_FINETUNE = 0, /* train an adapter */
    DAG_JOB_INFER = 1,    /* generate */
    DAG_JOB_EVAL = 2,     /* the loss on held-out data, forward only (base, or with a finished job's adapter) */
    DAG_JOB_ANY = 3,      /* dag_spec_parse: take the kind from the text ("kind", else its keys) */
} dag_job_kind;

typedef struct {
    dag_job_kind kind;                  /* FINETUNE, INFER or EVAL */
    char model[DAG_SPEC_MODEL_MAX];     /* model directory as the broker sees it ("" when not given) */
    uint64_t seed;                      /* shuffle and adapter initialisation; the sampler (default 0) */
    /* fine-tuning */
    dag_adapter_method method;          /* lora-fa (default), lora, salr */
    uint32_t rank;                      /* adapter rank (default 8) */
    double alpha;                       /* adapter alpha (default 2 x rank) */
    uint32_t targets;                   /* DAG_TARGET_BIT mask (0: all linears) */
    double lr;                          /* AdamW learning rate (default 1e-3) */
    double weight_decay;                /* AdamW decoupled weight decay (default 0) */
    uint64_t steps;                     /* optimizer steps (default 100); eval: batches of held-out windows (the
                                           broker sets it from the data) */
    uint32_t batch;                     /* B sequences per step (default 4) */
    uint32_t seq_len;                   /* tokens per sequence (default 128) */
    uint32_t micro_batches;             /* M, divides B (default 1) */
    bool shuffle;                       /* seeded order of the windows (default false) */
    bool byte_tokens;                   /* a model of more than 256 ids without tokenizer.json takes byte ids
                                           anyway (default false: refused) */
    uint64_t checkpoint_every;          /* K: a checkpoint after step s when (s+1) % K == 0 (default 10) */
    double verify;                      /* fraction of micro-batches verified; -1: the broker's --verify */
    double heldout;                     /* fraction of the data kept out of training (dag_dataset; default 0) */
    int trusted_ends;                   /* the first and last stages (they see tokens) on peers the broker's
                                           allow-list marks trusted: 1 yes, 0 no, -1 (default) yes when a
                                           trusted peer is registered */
    kern_codec act_codec;               /* fine-tune and eval: activations on the wire (default f32) */
    kern_codec grad_codec;              /* fine-tune: gradients on the wire (default f32; int8-ef: int8 with
                                           error feedback) */
    /* inference and eval */
    char adapter_job[DAG_SPEC_JOB_ID_LEN + 1]; /* fine-tune job whose adapter to use ("": none) */
    uint32_t max_tokens;                /* tokens to generate (default 64) */
    double temperature;                 /* 0: greedy (default) */
    uint32_t top_k;                     /* 0: off (default) */
    double top_p;                       /* 1: off (default) */
    bool dump_logits;                   /* keep the prompt's logits in the result */
    char stop[DAG_SPEC_MAX_STOP][DAG_SPEC_STOP_LEN + 1]; /* the text ends before the first of these */
    uint32_t n_stop;                    /* how many (default 0) */
    uint32_t sessions;                  /* > 0: a serving job of up to this many generations at once, each
                                           opened by SessionOpen (no prompt of its own); 0 (default): one */
    uint32_t context;                   /* serving job: positions of one session, prompt and generated
                                           (0: DAG_SPEC_CONTEXT) */
    uint32_t idle_s;                    /* serving job: the broker cancels it after this many seconds
                                           without a session (0, default: never) */
    int32_t *prompt_tokens;             /* the prompt as ids when given (owned), else NULL */
    size_t n_prompt_tokens;
} dag_spec;

/* The defaults of kind (FINETUNE, INFER or EVAL). */
void dag_spec_init(dag_spec *s, dag_job_kind kind);
/* Frees prompt_tokens; the spec is left as dag_spec_init(kind) left it. NULL-safe. */
void dag_spec_clear(dag_spec *s);
/* A deep copy (dst's old contents are not freed). */
void dag_spec_copy(dag_spec *dst, const dag_spec *src);

/* Checks every limit and the rules across fields (micro_batches divides batch, batch x seq_len at
 * most DAG_SPEC_MAX_ROWS, ...). FU_EINVAL with a message naming the field ("spec: \"rank\" must be
 * ..."). */
FU_MUST_CHECK fu_err dag_spec_check(const dag_spec *s, fu_errmsg *em);

/* Parses and checks a spec's JSON text (at most DAG_SPEC_MAX_BYTES) of the given kind (DAG_JOB_ANY:
 * from its "kind", else INFER when it has an inference-only key). A "kind" in the text must agree.
 * FU_EPROTO for text that is not a JSON object, FU_EINVAL for an unknown key or a bad value, with
 * em naming it. On success *out owns what it holds (dag_spec_clear); on failure it is cleared. */
FU_MUST_CHECK fu_err dag_spec_parse(const char *json, size_t len, dag_job_kind kind, dag_spec *out, fu_errmsg *em);

/* The canonical JSON text of s: every field of its kind (caller frees). */
char *dag_spec_to_json(const dag_spec *s);

/* Where a generation's text[0..len) ends by s's stop strings: the offset of the first occurrence of
 * any of them, or len when none occurs. */
size_t dag_spec_stop_at(const dag_spec *s, const char *text, size_t len);

/* The data order of a fine-tune (dag_data_rows). */
dag_data_order dag_spec_data_order(const dag_spec *s);
/* The optimizer step of a fine-tune (AdamW with the spec's lr and weight decay). */
kern_adamw_params dag_spec_adamw(const dag_spec *s);

/* ---- command-line options ------------------------------------------------------------------- */

#define DAG_SPEC_CLI_PIPELINE    (1u << 0) /* also --checkpoint-every and --verify (fusion submit) */
#define DAG_SPEC_CLI_CHECKPOINTS (1u << 1) /* also --checkpoint-every (fusion run: where int8-ef restarts) */
#define DAG_SPEC_CLI_MAX_OPTS 30        /* most entries dag_spec_cli_opts adds */

/* Where fu_opts_parse puts the spec's options; read by dag_spec_from_cli. */
typedef struct {
    long long ival[24];                 /* integer fields, by their index in the table */
    double dval[24];                    /* number fields, by their index in the table */
    const char *method;                 /* --method */
    const char *targets;                /* --targets */
    const char *prompt_tokens;          /* --prompt-tokens */
    bool shuffle;                       /* --shuffle */
    bool byte_tokens;                   /* --byte-tokens */
    const char *trusted_ends;           /* --trusted-ends on|off (NULL: not given) */
    const char *wire_codec;             /* --wire-codec ACT[,GRAD] (NULL: not given) */
    const char *stop;                   /* --stop TEXT (NULL: not given) */
} dag_spec_cli;

/* Sets c to the defaults of kind and appends the options of kind (and of flags) to opts, which has
 * room for cap entries from *n on; *n grows by what was added. Their help text gives the defaults. */
void dag_spec_cli_opts(dag_spec_cli *c, dag_job_kind kind, unsigned flags, fu_opt *opts, size_t cap, size_t *n);

/* The command line of a job command (`fusion run`, `fusion submit`): opts holds the command's own
 * entries, ended by one with a NULL name, and has room for cap in all; dag_spec_cli_opts appends the
 * spec's options of kind (and of flags), cmd->opts and cmd->n_opts are set to the whole table, and
 * fu_opts_parse reads argv. FU_OK to go on; otherwise the program exits with *exit_code (0 after
 * --help). */
FU_MUST_CHECK fu_err dag_spec_cli_parse(dag_spec_cli *c, dag_job_kind kind, unsigned flags, fu_cmd *cmd,
                                        fu_opt *opts, size_t cap, int argc, char **argv, int *exit_code);

/* dag_spec_from_cli for command cmd: on error tells the user ("PROG: --rank must be ...") and
 * returns it with *exit_code FU_EXIT_USAGE. */
FU_MUST_CHECK fu_err dag_spec_from_cmd(const dag_spec_cli *c, const fu_cmd *cmd, dag_job_kind kind,
                                       const char *model, dag_spec *out, int *exit_code);

/* The spec of kind that the parsed options c give, with model (may be NULL), checked as
 * dag_spec_parse checks JSON. FU_EINVAL with em naming the option ("--rank must be ..."). */
FU_MUST_CHECK fu_err dag_spec_from_cli(const dag_spec_cli *c, dag_job_kind kind, const char *model, dag_spec *out,
                                       fu_errmsg *em);

#ifdef __cplusplus
}
#endif
#endif
