/* broker_metrics: the broker's state and counters as Prometheus text (exposition format 0.0.4), for
 * the /metrics of its HTTP listener (broker_http.h). Aggregates only: no job ids, keys or names, so
 * a scraper learns nothing about one tenant (docs/SECURITY.md). Read on the broker's thread. */
#ifndef FU_BROKER_METRICS_H
#define FU_BROKER_METRICS_H

#include <stddef.h>

#include "broker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The text (malloc, NUL-terminated; *len its bytes), or NULL without memory. */
char *broker_metrics_text(broker_t *b, size_t *len);

#ifdef __cplusplus
}
#endif
#endif
