/* broker_http: the broker's optional HTTP listener (fusion-broker --http ADDR:PORT), off unless
 * asked for. It serves GET / (the dashboard page, broker/dashboard.html, embedded in the binary),
 * GET /metrics (Prometheus text, broker_metrics.h) and GET /api/... (read-only JSON for bearers of a
 * client's token, broker_api.h); anything else is 404, any other method 405. libmicrohttpd runs without a thread of its own (external epoll mode): its one
 * descriptor joins the broker's poll and requests are answered on the broker's thread, from the live
 * state, with nothing copied or locked. Connections are capped, and time out. */
#ifndef FU_BROKER_HTTP_H
#define FU_BROKER_HTTP_H

#include <netinet/in.h>
#include <stdint.h>

#include "broker.h"
#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BROKER_HTTP_MAX_CONNS   64 /* open connections at once */
#define BROKER_HTTP_TIMEOUT_S   10 /* an idle connection is closed after this */

typedef struct broker_http broker_http_t;

/* Reads "IPV4:PORT" (port 0: any free one) into *sa. FU_EINVAL with em saying what is wrong. */
FU_MUST_CHECK fu_err broker_http_parse_addr(const char *addr, struct sockaddr_in *sa, fu_errmsg *em);

/* Listens on addr ("IPV4:PORT", port 0: any free one) for b's state. FU_EINVAL with em saying so for
 * a malformed address, FU_EIO when it cannot listen there. */
FU_MUST_CHECK fu_err broker_http_new(const char *addr, broker_t *b, broker_http_t **out, fu_errmsg *em);
void broker_http_destroy(broker_http_t **h_p);

/* The port it listens on. */
uint16_t broker_http_port(const broker_http_t *h);
/* The descriptor to poll for input (epoll). */
int broker_http_fd(const broker_http_t *h);
/* The longest the broker's poll may wait for the listener's own timers: at most max_ms. */
long broker_http_timeout_ms(broker_http_t *h, long max_ms);
/* Serves what is ready, without blocking. */
void broker_http_serve(broker_http_t *h);

#ifdef __cplusplus
}
#endif
#endif
