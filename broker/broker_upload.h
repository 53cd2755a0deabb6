/* broker_upload: models that clients upload by content (`fusion submit --upload`, docs/PIPELINE.md
 * "Uploading a model").
 *
 * The client announces a manifest (ModelUpload: each file's plain name, size and the BLAKE2b-256 of
 * each WIRE_UPLOAD_CHUNK-byte chunk). The broker answers which chunks it must send and which it
 * holds already in a model uploaded before (it copies those itself, one chunk per ModelChunk stub,
 * so its loop never blocks on a long copy). Each chunk is checked against its hash and written at
 * its offset in a staging directory; the commit fsyncs the files, keeps the manifest beside them
 * and renames the directory to <uploads>/u-<hex of the manifest's hash>, a model root: the client
 * then submits jobs with model "u-<hex>". A manifest whose model is there already is answered with
 * its name at once (nothing is sent).
 *
 * Limits: --upload-gib bytes in all (uploaded models plus those being uploaded; 0: uploads off),
 * one upload in progress per client, BROKER_UPLOAD_FILES files of plain names (config.json among
 * them). Staging directories are removed when the broker starts and when a client replaces its
 * upload; an upload interrupted by a restart starts again (its committed neighbours still count). */
#ifndef FU_BROKER_UPLOAD_H
#define FU_BROKER_UPLOAD_H

#include <stdint.h>

#include "fu_err.h"
#include "wire.h"

#define BROKER_UPLOAD_FILES   64   /* files in one uploaded model */
#define BROKER_UPLOAD_PENDING 16   /* uploads in progress (one per client) */
#define BROKER_UPLOAD_DIR     "uploads" /* under the data directory */

typedef struct broker_uploads broker_uploads;
struct broker;

/* The uploads kept in dir (made if missing; its staging leftovers removed), at most max_bytes in
 * all. Indexes the chunks of every model uploaded before. NULL with a message on failure. */
broker_uploads *broker_uploads_new(const char *dir, uint64_t max_bytes, fu_errmsg *em);
void broker_uploads_free(broker_uploads **u_p);

/* The handlers (client role): MSG_MODEL_UPLOAD and MSG_MODEL_CHUNK, each answered by UploadStatus
 * or an Error naming what was refused. */
void broker_on_model_upload(struct broker *b, const wire_msg_t *msg);
void broker_on_model_chunk(struct broker *b, const wire_msg_t *msg);

#endif
