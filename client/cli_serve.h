/* cli_serve: the pieces of `fusion serve` (cli_serve.c: the server, its models and its set-up;
 * cli_serve_gen.c: one generation request, answered whole or streamed) that both files use. The
 * serve_t is set up before the server starts and read-only afterwards, except the connection pool
 * (under mu) and in_flight (atomic). Every function here may run on any connection's thread. */
#ifndef FU_CLI_SERVE_H
#define FU_CLI_SERVE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <microhttpd.h>

#include "cli_conn.h"
#include "cli_openai.h"
#include "dag_dataset.h"
#include "dag_spec.h"
#include "fu_modelcfg.h"
#include "fu_tokenizer.h"

#define SERVE_POOL         16         /* idle broker connections kept */
#define SERVE_JOBS_MAX     16         /* serving jobs one gateway holds (a model name each) */

/* A serving job the gateway holds for one model name (cli_serve_jobs.c). */
typedef struct {
    char adapter[DAG_SPEC_JOB_ID_LEN + 1]; /* "" for the base model, else the fine-tune's job id */
    uint64_t job;                          /* 0: none submitted (or it ended) */
} serve_sjob;
#define SERVE_KEY_MAX      256        /* bytes of the API key */

typedef struct {
    const char *prog;
    cli_conn_opts co;
    char spec_model[DAG_SPEC_MODEL_MAX]; /* the model as the broker names it */
    char model_id[80];                   /* its content id ("m:" + hex) as the broker computed it; "" when the
                                            broker did not say (one from before JobStatus.model_id) */
    char name[CLI_OAI_MAX_MODEL];        /* the model as clients name it */
    fu_modelcfg cfg;
    fu_tokenizer *tok;
    dag_chat_format chat;
    char chat_err[256];                  /* why chats are refused, when chat is DAG_CHAT_NONE */
    const char *eos_text[FU_MODELCFG_MAX_EOS]; /* the end-of-sequence tokens' text: the text ends there */
    size_t n_eos_text;
    uint32_t max_tokens;                 /* the most one request may ask; chat's default */
    double timeout_s;                    /* one request's limit */
    double queue_timeout_s;              /* how long its job may wait in the broker's queue before it starts */
    unsigned max_requests;
    char key[SERVE_KEY_MAX];             /* "": no API key asked */
    int64_t started;
    uint32_t sessions;                   /* > 0: requests are sessions of a serving job per model name holding
                                            this many; 0: a job per request */
    uint32_t context;                    /* the serving jobs' positions per session */
    uint32_t idle_s;                     /* the broker cancels a serving job that long without a session */
    pthread_mutex_t jobs_mu;             /* guards jobs */
    serve_sjob jobs[SERVE_JOBS_MAX];
    pthread_mutex_t mu;                  /* guards idle, n_idle */
    cli_conn_t *idle[SERVE_POOL];
    size_t n_idle;
    atomic_uint in_flight;
} serve_t;

#define SERVE_IDEM_LEN 33 /* a fresh idempotency key: 32 hex digits */
/* A fresh random idempotency key (one submission's: a retry never makes a second job). */
void serve_idem_new(char out[SERVE_IDEM_LEN]);

/* A broker connection from the pool, or a new one (NULL when it cannot be opened; the log says why). */
cli_conn_t *serve_conn_get(serve_t *s);
/* Gives c back to the pool, or closes it when broken or the pool is full. NULL-safe. */
void serve_conn_put(serve_t *s, cli_conn_t *c, bool broken);

/* Queues r (taken; NULL: MHD_NO) with status and Content-Type type, not to be cached. */
enum MHD_Result serve_queue(struct MHD_Connection *mc, unsigned status, struct MHD_Response *r, const char *type);
/* Queues json (taken) with status, as application/json. */
enum MHD_Result serve_reply_json(struct MHD_Connection *mc, unsigned status, char *json);
/* Queues an error in OpenAI's form (param and code may be NULL). */
enum MHD_Result serve_reply_error(struct MHD_Connection *mc, unsigned status, const char *type, const char *param,
                                  const char *code, const char *message);
/* The HTTP status and OpenAI error type of a broker's refusal (code: Fusion__ErrorCode, -1: the
 * connection failed). */
unsigned serve_status_of(int code, const char **type);

/* The adapter job a model name asks for: "" for the model itself, the job's id for "NAME:JOB".
 * false for a name this gateway does not serve. */
bool serve_model_adapter(const serve_t *s, const char *model, char adapter[DAG_SPEC_JOB_ID_LEN + 1]);

/* The serving job for the model name's adapter ("" for the base model): the one held, or a new one
 * submitted on c. 0 with *code set (the broker's Fusion__ErrorCode, -1: the connection's) and err
 * saying why when it cannot be had. */
uint64_t serve_job_for(serve_t *s, cli_conn_t *c, const char *adapter, int *code, char *err, size_t cap);
/* Serving job `job` ended (cancelled by someone, failed): the next request submits another. */
void serve_job_gone(serve_t *s, uint64_t job);
/* Cancels every serving job held (the gateway stops). */
void serve_jobs_cancel_all(serve_t *s);

/* Whether the gateway is stopping (requests in flight then cancel their jobs). */
bool serve_stopping(void);

/* POST /v1/chat/completions (chat) or /v1/completions with body[0..len): checked, run as an
 * inference job, answered whole or streamed (cli_serve_gen.c). */
enum MHD_Result serve_generate(serve_t *s, struct MHD_Connection *mc, bool chat, const char *body, size_t len);

#endif
