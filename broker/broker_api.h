/* broker_api: the read-only JSON API of the broker's HTTP listener (broker_http.h):
 *   GET /api/peers              every peer: device, speed, memory, link, reputation, state, and the
 *                               job and stage it runs when the caller may see them (its own job, or an
 *                               operator); another tenant's work shows as "busy"
 *   GET /api/jobs               the caller's jobs, with their stages while they run
 *   GET /api/jobs/JOB/events    the event log of one of the caller's jobs
 *   GET /api/jobs/JOB/loss      the loss curve of one of the caller's fine-tunes, from the broker's
 *                               memory (broker_losshist.h): {"job","kind","stride","points":[[step,
 *                               loss],...]}, no points for other kinds or since a restart
 * The caller is whoever shows `Authorization: Bearer TOKEN`, TOKEN being wire_http_token of a key on
 * the allow-list with the client or operator role (`fusion http-token` prints it). Without one,
 * /api/peers shows what any stranger may see and the job routes answer 401. Read on the broker's
 * thread. */
#ifndef FU_BROKER_API_H
#define FU_BROKER_API_H

#include <stddef.h>

#include "broker.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    unsigned status; /* HTTP status */
    char *body;      /* JSON (malloc), NULL without memory */
    size_t len;
} broker_api_reply;

/* Answers GET path (starting "/api/") with authorization the request's Authorization header (NULL:
 * none). */
void broker_api_get(broker_t *b, const char *path, const char *authorization, broker_api_reply *r);

#ifdef __cplusplus
}
#endif
#endif
