/* dag_dataset: fine-tuning data as people bring it, made into the token stream dag_data reads
 * (docs/PIPELINE.md "Data order"; docs/FORMATS.md "Training data").
 *
 * Plain text is tokenized whole, every target counted. JSON Lines (the first line a JSON object) is
 * read line by line, one example each:
 *   {"text": "..."}                        every token counted, an EOS after each, packed;
 *   {"prompt": "...", "completion": "..."} only the completion (and its EOS) counted;
 *   {"messages": [{"role", "content"}]}    rendered whole in the model's chat format (dag_chat_text,
 *                                          as `fusion serve` prompts), only the assistant's turns
 *                                          counted.
 * Prompt/completion and chat examples start with BOS and are padded (masked) to a whole number of
 * windows of seq_len + 1, so that no window mixes two of them. A token that must not count is
 * stored as DAG_DATA_MASKED(id). A held-out fraction (the last examples; for plain text, the last
 * tokens at a window boundary) is kept out of training for `fusion eval`. Pure; thread-safe. */
#ifndef FU_DAG_DATASET_H
#define FU_DAG_DATASET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How "messages" become text: recognised from tokenizer_config.json's chat_template. */
typedef enum {
    DAG_CHAT_NONE = 0, /* the model has no chat template: "messages" are refused */
    DAG_CHAT_LLAMA3,   /* <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> */
    DAG_CHAT_CHATML,   /* <|im_start|>role\ncontent<|im_end|>\n (Qwen) */
    DAG_CHAT_INST,     /* <s>[INST] user [/INST] assistant </s> (Llama 2, Mistral) */
} dag_chat_format;

#define DAG_DATASET_MAX_HELDOUT 0.5 /* most of the data that may be held out */

/* The format of a chat_template by its markers; FU_EVERSION (naming what was looked for) for a
 * template fusion does not know. NULL or "" is DAG_CHAT_NONE. */
FU_MUST_CHECK fu_err dag_chat_format_of(const char *chat_template, dag_chat_format *out, fu_errmsg *em);
/* The same from the text of tokenizer_config.json (NULL: none). */
FU_MUST_CHECK fu_err dag_chat_format_from_config(const char *json, size_t len, dag_chat_format *out, fu_errmsg *em);
/* The same from a model directory's tokenizer_config.json (none there: DAG_CHAT_NONE). */
FU_MUST_CHECK fu_err dag_chat_format_from_dir(const char *dir, dag_chat_format *out, fu_errmsg *em);
/* "llama3", "chatml", "inst" or "none". */
const char *dag_chat_format_name(dag_chat_format f);

/* One message of a chat: role "system", "user" or "assistant", and its text. */
typedef struct {
    const char *role;
    const char *content;
} dag_chat_msg;

#define DAG_CHAT_MAX_MSGS 4096 /* most messages of one chat */

/* The text of the chat msgs[0..n) as the model's chat_template renders it (transformers'
 * apply_chat_template), for a prompt that asks for the assistant's next turn: Llama 3 and [INST]
 * trim each content as their templates do, [INST] folds a leading system message into the first user
 * turn and needs user and assistant turns to alternate; bos and eos are the BOS and EOS tokens' text
 * (NULL: none). With gen_prompt the text ends with the assistant's opening (Llama 3's assistant
 * header, ChatML's "<|im_start|>assistant\n"; [INST] ends after the last user turn's " [/INST]").
 * FU_EINVAL naming the message for a role that is not one of the three, a chat that [INST] cannot
 * render, an empty chat, or DAG_CHAT_NONE. *out is new (caller frees). */
FU_MUST_CHECK fu_err dag_chat_text(dag_chat_format fmt, const dag_chat_msg *msgs, size_t n, const char *bos,
                                   const char *eos, bool gen_prompt, char **out, fu_errmsg *em);

/* dag_chat_text of msgs[0..n) with the generation prompt, encoded with tok: the ids of the prompt
 * that asks for the assistant's next turn. bos and eos are the model's BOS and EOS ids (-1: the
 * tokenizer's guess; none: no text for them). *ids is new (caller frees). */
FU_MUST_CHECK fu_err dag_chat_prompt(const fu_tokenizer *tok, dag_chat_format fmt, int32_t bos, int32_t eos,
                                     const dag_chat_msg *msgs, size_t n, int32_t **ids, size_t *n_ids, fu_errmsg *em);

typedef struct {
    uint32_t seq_len;     /* tokens per training row: examples are padded to multiples of seq_len + 1 */
    double heldout;       /* fraction kept out of training, 0 .. DAG_DATASET_MAX_HELDOUT */
    dag_chat_format chat; /* how "messages" are rendered */
} dag_dataset_opts;

typedef struct {
    int32_t *train;          /* the stream fine-tuning reads (dag_data_rows) */
    size_t n_train;
    int32_t *heldout;        /* the held-out stream (NULL when nothing is held out) */
    size_t n_heldout;
    const char *format;      /* "text", "jsonl" (texts), "prompt-completion", "chat" */
    size_t examples;         /* JSON lines read (0 for plain text) */
    size_t heldout_examples; /* of which held out */
    size_t counted, masked;  /* tokens of the training stream whose target counts / does not */
} dag_dataset;

/* Makes the dataset of data[0..len) with tok. FU_EINVAL with the line and the reason for a JSON line
 * that is not one of the three kinds, a role that is not system/user/assistant, "messages" without
 * a chat format, or options out of range; the tokenizer's errors otherwise. */
FU_MUST_CHECK fu_err dag_dataset_make(const fu_tokenizer *tok, const char *data, size_t len, const dag_dataset_opts *o,
                                      dag_dataset *out, fu_errmsg *em);
void dag_dataset_free(dag_dataset *d);

#ifdef __cplusplus
}
#endif
#endif
