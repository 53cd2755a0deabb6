/* broker_http: GET /metrics over libmicrohttpd in external epoll mode (see broker_http.h). */
#include "broker_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <microhttpd.h>

#include "broker_api.h"
#include "broker_metrics.h"
#include "fu_alloc.h"
#include "fu_net.h"

/* dashboard.html, embedded at build time (broker/embed.cmake) */
extern const unsigned char broker_dashboard_html[];
extern const size_t broker_dashboard_html_len;

struct broker_http {
    struct MHD_Daemon *d;
    broker_t *b;
    uint16_t port;
    int fd;
};

/* Queues body (len bytes of type, kept or freed by mode) with status; csp, when not NULL, is the
 * page's Content-Security-Policy. */
static enum MHD_Result reply(struct MHD_Connection *c, unsigned int status, const char *type, void *body, size_t len,
                             enum MHD_ResponseMemoryMode mode, const char *csp)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    if (csp)
        MHD_add_response_header(r, "Content-Security-Policy", csp);
    enum MHD_Result ok = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ok;
}

/* A static line of text. */
static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned int status, const char *text)
{
    return reply(c, status, "text/plain", (void *)text, strlen(text), MHD_RESPMEM_PERSISTENT, NULL);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **con_cls)
{
    (void)version;
    (void)upload_data;
    broker_http_t *h = cls;
    if (!*con_cls) { /* the headers: answer when the request is whole */
        *con_cls = h;
        return MHD_YES;
    }
    if (*upload_data_size) { /* a body nobody asked for: read and ignored */
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return reply_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET is served\n");
    if (strcmp(url, "/") == 0 || strcmp(url, "/index.html") == 0) /* it loads nothing from elsewhere and talks
                                                                      to this broker only */
        return reply(c, MHD_HTTP_OK, "text/html; charset=utf-8", (void *)broker_dashboard_html,
                     broker_dashboard_html_len, MHD_RESPMEM_PERSISTENT,
                     "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                     "connect-src 'self'; img-src 'self' data:");
    if (strncmp(url, "/api/", 5) == 0) {
        broker_api_reply r = {0};
        broker_api_get(h->b, url, MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION), &r);
        if (!r.body)
            return reply_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
        return reply(c, r.status, "application/json", r.body, r.len, MHD_RESPMEM_MUST_FREE, NULL);
    }
    if (strcmp(url, "/metrics") != 0)
        return reply_text(c, MHD_HTTP_NOT_FOUND, "not found: the broker serves /, /metrics and /api/ (docs/BROKER.md)\n");
    size_t len = 0;
    char *text = broker_metrics_text(h->b, &len);
    if (!text)
        return reply_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    return reply(c, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len, MHD_RESPMEM_MUST_FREE, NULL);
}

fu_err broker_http_parse_addr(const char *addr, struct sockaddr_in *sa, fu_errmsg *em)
{
    return fu_net_parse_ipv4(addr, "--http", sa, em);
}

fu_err broker_http_new(const char *addr, broker_t *b, broker_http_t **out, fu_errmsg *em)
{
    *out = NULL;
    struct sockaddr_in sa;
    FU_TRY(broker_http_parse_addr(addr, &sa, em));
    uint16_t port = ntohs(sa.sin_port);
    broker_http_t *h = fu_calloc(1, sizeof *h);
    h->b = b;
    h->d = MHD_start_daemon(MHD_USE_EPOLL, port, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR,
                            (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT, (unsigned)BROKER_HTTP_MAX_CONNS,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)BROKER_HTTP_TIMEOUT_S, MHD_OPTION_END);
    const union MHD_DaemonInfo *fi = h->d ? MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD) : NULL;
    const union MHD_DaemonInfo *pi = h->d ? MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT) : NULL;
    if (!fi || !pi) {
        broker_http_destroy(&h);
        return fu_errmsg_set(em, FU_EIO, "--http: cannot listen on %s (in use, or not an address of this host?)",
                             addr);
    }
    h->fd = fi->epoll_fd;
    h->port = pi->port;
    *out = h;
    return FU_OK;
}

void broker_http_destroy(broker_http_t **h_p)
{
    broker_http_t *h = *h_p;
    if (!h)
        return;
    if (h->d)
        MHD_stop_daemon(h->d);
    free(h);
    *h_p = NULL;
}

uint16_t broker_http_port(const broker_http_t *h)
{
    return h->port;
}

int broker_http_fd(const broker_http_t *h)
{
    return h->fd;
}

long broker_http_timeout_ms(broker_http_t *h, long max_ms)
{
    MHD_UNSIGNED_LONG_LONG t = 0;
    if (MHD_get_timeout(h->d, &t) == MHD_YES && (long long)t < max_ms)
        return (long)t;
    return max_ms;
}

void broker_http_serve(broker_http_t *h)
{
    (void)MHD_run(h->d);
}
