/* Shared pieces of the job commands (cli_jobs.c, cli_submit.c). */
#ifndef FU_CLI_JOBS_H
#define FU_CLI_JOBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cli_conn.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CLI_WAIT_POLL_MS 200 /* how often `wait` asks for a job's status */
#define CLI_WAIT_LONG_POLL_MS 1000 /* how long the broker may hold `wait`'s question about an inference's text */
#define CLI_SUBMIT_TRIES 3   /* sends of one submission before giving up */

/* Job id's JobStatus from the broker over conn (*m: the reply, for wire_msg_destroy); on failure the
 * message is printed and the exit code set. */
FU_MUST_CHECK fu_err cli_job_fetch_status(cli_conn_t *conn, uint64_t id, wire_msg_t **m, int *code);
/* The same as a long poll (JobRef.wait_ms): the broker answers once the job's output is no longer
 * known_len bytes long, the job ends, or wait_ms (at most 2000) passed; a broker that does not hold
 * requests answers at once (cli_job_poll_pause then says to wait). */
FU_MUST_CHECK fu_err cli_job_watch_status(cli_conn_t *conn, uint64_t id, uint32_t wait_ms, uint64_t known_len,
                                          wire_msg_t **m, int *code);
/* After a long poll that began at started_ms and brought nothing new: whether the broker answered at
 * once (it does not hold requests), so that the caller waits poll_ms itself before asking again. */
bool cli_job_poll_pause(uint64_t started_ms, uint32_t wait_ms);

/* Submits a job: kind, its spec's JSON text and data[0..len) (training text, or an inference
 * prompt), under idempotency key idem, sent again with the same key when no answer comes (so a retry
 * never makes a second job). The broker's JobStatus in *m (wire_msg_destroy); on failure the message
 * is printed and the exit code set. */
FU_MUST_CHECK fu_err cli_job_submit(cli_conn_t *conn, Fusion__JobKind kind, const char *spec_json, const uint8_t *data,
                                    size_t len, const char *idem, wire_msg_t **m, int *code);

/* Cancels job id (the broker's answer is not kept); on failure the message is printed and the exit
 * code set. */
FU_MUST_CHECK fu_err cli_job_cancel(cli_conn_t *conn, uint64_t id, int *code);

/* Prints job status s on stdout as one JSON object, as `fusion status JOB --json` does. */
void cli_print_status_json(const Fusion__JobStatus *s);

/* Follows job `id` until it ends: a progress bar on a terminal (step of steps, loss, tokens/s, time
 * followed, ETA; never wider than the terminal), one line per step otherwise, generated text as it
 * arrives for inference jobs, nothing with quiet. Ctrl-C (SIGINT) stops following with a line saying
 * that the job goes on and how to follow or cancel it (exit 130). Returns the exit code: 0 done, 1
 * failed or cancelled, 5 when timeout_s (> 0) passed first. With json, nothing but the job's last
 * status as one JSON object on stdout (as `fusion status --json`). */
int cli_wait_job(cli_conn_t *conn, const char *prog, uint64_t id, double timeout_s, bool quiet, bool json);

/* Waits (quietly) until job id ends: done, its JobStatus.output in *output (caller frees; "" when
 * none); failed or cancelled, the reason printed and FU_EXIT_FAIL in *code. */
FU_MUST_CHECK fu_err cli_job_output(cli_conn_t *conn, const char *prog, uint64_t id, char **output, int *code);

/* State names users see ("queued", "running", ...). */
const char *cli_job_state_name(Fusion__JobState s);

/* What a fine-tune's verification is, in words ("25% of micro-batches verified on a second peer"), in
 * buf; "" for other jobs and when the broker did not say. Returns buf. */
const char *cli_job_verify_text(const Fusion__JobStatus *s, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
