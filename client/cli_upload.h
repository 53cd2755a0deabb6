/* cli_upload: a model directory sent to the broker by content (`fusion submit --upload`, `fusion
 * upload`; docs/PIPELINE.md "Uploading a model"). The client hashes each file in WIRE_UPLOAD_CHUNK
 * pieces (BLAKE2b-256), announces the manifest, sends only the chunks the broker lacks (with a
 * progress line on a terminal), has it copy those it holds already, and commits. The broker answers
 * with the model's name ("u-<hex>"), which jobs then use. */
#ifndef FU_CLI_UPLOAD_H
#define FU_CLI_UPLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cli_conn.h"

#define CLI_UPLOAD_NAME_MAX 80 /* "u-" + 64 hex, with room */

/* What an upload did. */
typedef struct {
    uint32_t chunks;         /* in the manifest */
    uint32_t sent;           /* whose bytes went over the wire */
    uint32_t copied;         /* the broker held already (in another model) */
    uint64_t bytes, bytes_sent;
    double seconds;
} cli_upload_report;

/* Uploads the regular files of dir (plain names; subdirectories and hidden files are skipped) over
 * conn and writes the broker's name for the model into name. prog prefixes messages; quiet drops the
 * progress line. Returns FU_OK, or an error with *exit_code set and a message printed. */
FU_MUST_CHECK fu_err cli_upload_model(cli_conn_t *conn, const char *prog, const char *dir, bool quiet,
                                      char name[CLI_UPLOAD_NAME_MAX], cli_upload_report *rep, int *exit_code);

/* `fusion upload DIR`: uploads and prints the model's name. */
int cli_upload_main(int argc, char **argv);

#endif
