/* cli_conn: the client's connection to a broker. Where the broker is and which keys to use come from
 * the command line, else the environment (FUSION_BROKER, FUSION_BROKER_KEY, FUSION_KEYS), else the
 * config file ($FUSION_CONFIG, or ~/.config/fusion/client.conf: `broker = …`, `broker-key = …`,
 * `keys = …`), so that a user types them once. The connection is a CURVE DEALER; each call sends
 * one request and waits for its answer until a deadline. */
#ifndef FU_CLI_CONN_H
#define FU_CLI_CONN_H

#include <stdbool.h>
#include <stdint.h>

#include "fu_err.h"
#include "fu_opts.h"
#include "wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CLI_DEFAULT_TIMEOUT_MS 10000 /* one request's deadline */
#define CLI_REFUSED_TRIES      3     /* refused connection attempts that mean no broker listens there */
#define CLI_HANDSHAKE_MS       4000  /* a broker that has not finished the CURVE handshake by then (or the
                                        request's deadline, when shorter) is not answering: said at once */
#define CLI_CONFIG_NAME        "client.conf"

/* What the user said about the connection; NULL fields are filled from the environment and the
 * config file by cli_conn_open. */
typedef struct {
    const char *broker;     /* control endpoint, "tcp://host:7700", or several, comma-separated (the
                               broker's and its gateways'): the next is tried while none answered */
    const char *broker_key; /* path of the broker's public.key; with several endpoints one for all, or
                               one each, comma-separated */
    const char *keys;       /* this client's key directory */
    long long timeout_ms;   /* per request; 0: CLI_DEFAULT_TIMEOUT_MS */
} cli_conn_opts;

/* The four fu_opt entries every broker-talking subcommand accepts, bound to *o. */
#define CLI_CONN_OPTS(o)                                                                                   \
    {"broker", 0, FU_OPT_STR, &(o)->broker, "ENDPOINT[,...]",                                                \
     "broker endpoint, or several tried in turn (else $FUSION_BROKER or the config)"},                       \
    {"broker-key", 0, FU_OPT_STR, &(o)->broker_key, "FILE[,...]",                                             \
     "the broker's public.key, or one per endpoint (else $FUSION_BROKER_KEY)"},                               \
    {"keys", 0, FU_OPT_STR, &(o)->keys, "DIR", "your key directory (else $FUSION_KEYS)"},                   \
    {"timeout-ms", 0, FU_OPT_INT, &(o)->timeout_ms, "MS", "deadline of each request (default 10000)"}

typedef struct cli_conn cli_conn_t;

/* Resolves o, loads the keys and connects. On failure prints a sentence for the user (prefixed with
 * prog) and returns the exit code to use in *exit_code. */
FU_MUST_CHECK fu_err cli_conn_open(const char *prog, const cli_conn_opts *o, cli_conn_t **out, int *exit_code);
void cli_conn_close(cli_conn_t **self_p);

/* Fills o's broker, broker key and keys from the environment and the configuration file where the
 * options left them NULL; each must then be known (the broker's endpoint only when need_broker). On
 * failure the message is printed and the exit code set. */
FU_MUST_CHECK fu_err cli_conn_resolve(const char *prog, cli_conn_opts *o, bool need_broker, int *exit_code);

/* Sends (hdr, body) and waits for one answer. When the answer is of type `want` it is returned in
 * *reply (free with wire_msg_destroy). An Error answer is printed (with prog) and mapped to an exit
 * code: ERR_AUTH → FU_EXIT_AUTH, ERR_NOT_FOUND → FU_EXIT_NOTFOUND, others → FU_EXIT_FAIL. A
 * refused key (the CURVE handshake failed) → FU_EXIT_AUTH; no answer by the deadline →
 * FU_EXIT_TIMEOUT, each with a message. Returns FU_OK or the error with *exit_code set. */
FU_MUST_CHECK fu_err cli_conn_call(cli_conn_t *self, const wire_hdr *hdr, const ProtobufCMessage *body,
                                   Fusion__MsgType want, wire_msg_t **reply, int *exit_code);

/* One request on a connection of its own, for the commands that ask the broker one thing:
 * cli_conn_open, cli_conn_call, cli_conn_close, with their messages and exit codes. */
FU_MUST_CHECK fu_err cli_conn_request(const char *prog, const cli_conn_opts *o, const wire_hdr *hdr,
                                      const ProtobufCMessage *body, Fusion__MsgType want, wire_msg_t **reply,
                                      int *exit_code);

/* The last failure said on c (without the prog prefix; "" when none) and, in *code when not NULL,
 * the broker's Fusion__ErrorCode for it, or -1 when the failure was the connection's. */
const char *cli_conn_last_error(const cli_conn_t *self, int *code);

/* quiet true: failures on c are no longer printed, only kept (cli_conn_last_error); false again prints. */
void cli_conn_set_quiet(cli_conn_t *self, bool quiet);

/* Sends (hdr, body) without waiting: requests in flight are answered in order (cli_conn_recv each). */
FU_MUST_CHECK fu_err cli_conn_send(cli_conn_t *self, const wire_hdr *hdr, const ProtobufCMessage *body, int *exit_code);

/* Waits for one more message of type `want` (a request answered with several, like result chunks),
 * with the same deadline, Error and refusal handling as cli_conn_call. */
FU_MUST_CHECK fu_err cli_conn_recv(cli_conn_t *self, Fusion__MsgType want, wire_msg_t **reply, int *exit_code);

/* Formats a job id as the 16 hex digits users see; buf holds 17 chars. */
void cli_job_id_format(uint64_t id, char buf[17]);
/* Parses 1 to 16 hex digits. FU_EINVAL otherwise. */
FU_MUST_CHECK fu_err cli_job_id_parse(const char *s, uint64_t *id);
/* cli_job_id_parse for a command-line argument: on failure tells the user (prefixed with prog). */
FU_MUST_CHECK fu_err cli_job_arg(const char *prog, const char *s, uint64_t *id);
/* fu_opts_parse for a command whose one positional argument is a JOB id (cmd->max_pos 1): when it is
 * given (*n_pos, may be NULL, says so) it is parsed into *id with cli_job_arg. Returns FU_OK, or an
 * error with *exit_code set (FU_EXIT_USAGE for a bad id). */
FU_MUST_CHECK fu_err cli_job_cmd_parse(const fu_cmd *cmd, int argc, char **argv, uint64_t *id, size_t *n_pos,
                                       int *exit_code);

#ifdef __cplusplus
}
#endif
#endif
