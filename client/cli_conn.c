#include "cli_conn.h"

#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "fu_alloc.h"
#include "cli_progress.h"
#include "fu_clock.h"
#include "wire_keys.h"
#include "wire_socket.h"

struct cli_conn {
    const char *prog;   /* for messages; borrowed */
    wire_endpoints eps; /* the broker's endpoints and keys (--broker E1,E2 --broker-key K1,K2) */
    uint32_t cur;       /* the one in use: the next is tried while none has answered yet */
    wire_keypair_t *kp; /* this client's keys */
    uint8_t *req_env, *req_body; /* the last request, sent again on the next endpoint */
    size_t req_env_len, req_body_len;
    void *ctx;          /* ZeroMQ context */
    void *sock;         /* DEALER to the broker */
    void *monitor;      /* PAIR receiving the DEALER's handshake events */
    long long timeout_ms;
    bool connected;     /* a TCP connection to the broker was made (once is enough) */
    bool handshaken;    /* ... and its CURVE handshake finished */
    uint64_t opened_ms; /* when the connection was opened: the handshake's clock */
    int refused;        /* connection attempts refused before that */
    uint64_t sequence;  /* of our requests */
    char endpoint[256]; /* the broker, for messages */
    int last_code;      /* the last failure's Fusion__ErrorCode, or -1 when the broker gave none */
    bool quiet;         /* failures are kept (cli_conn_last_error) but not printed */
    char last_err[512]; /* the last failure's sentence */
};

/* Reads `key = value` from the config file into the fields still NULL. Values are copied into
 * static storage: the CLI makes one connection per process. A $FUSION_CONFIG that cannot be read, or a
 * line that is no known setting, is an error (said on stderr; the exit code returned): a typo must not
 * pass for a setting. The default file may be missing; FUSION_CONFIG set empty reads none. */
static int conn_read_config(const char *prog, cli_conn_opts *o)
{
    static char broker[256], broker_key[1024], keys[1024];
    char path[1024];
    const char *env = getenv("FUSION_CONFIG"), *home = getenv("HOME");
    if (env && !env[0])
        return FU_EXIT_OK; /* FUSION_CONFIG= (empty): no configuration file */
    if (env)
        snprintf(path, sizeof path, "%s", env);
    else if (home)
        snprintf(path, sizeof path, "%s/.config/fusion/%s", home, CLI_CONFIG_NAME);
    else
        return FU_EXIT_OK;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (!env && errno == ENOENT)
            return FU_EXIT_OK;
        fprintf(stderr, "%s: cannot read the configuration file '%s'%s: %s\n", prog, path,
                env ? " ($FUSION_CONFIG; set it empty for none)" : "", strerror(errno));
        return errno == ENOENT ? FU_EXIT_NOTFOUND : FU_EXIT_USAGE;
    }
    char line[1200];
    int code = FU_EXIT_OK;
    for (unsigned no = 1; code == FU_EXIT_OK && fgets(line, sizeof line, f); no++) {
        char *k = line;
        while (*k == ' ' || *k == '\t')
            k++;
        if (*k == '#' || *k == '\n' || *k == '\r' || *k == '\0')
            continue;
        char *eq = strchr(k, '=');
        if (!eq) {
            fprintf(stderr, "%s: %s line %u: expected `key = value`, got '%.60s'\n", prog, path, no,
                    strtok(k, "\r\n"));
            code = FU_EXIT_USAGE;
            break;
        }
        *eq = '\0';
        char *v = eq + 1;
        for (char *e = k + strlen(k); e > k && (e[-1] == ' ' || e[-1] == '\t'); e--)
            e[-1] = '\0';
        while (*v == ' ' || *v == '\t')
            v++;
        v[strcspn(v, "\r\n")] = '\0';
        for (char *e = v + strlen(v); e > v && (e[-1] == ' ' || e[-1] == '\t'); e--)
            e[-1] = '\0';
        if (strcmp(k, "broker") == 0) {
            if (!o->broker)
                o->broker = strncpy(broker, v, sizeof broker - 1);
        } else if (strcmp(k, "broker-key") == 0) {
            if (!o->broker_key)
                o->broker_key = strncpy(broker_key, v, sizeof broker_key - 1);
        } else if (strcmp(k, "keys") == 0) {
            if (!o->keys)
                o->keys = strncpy(keys, v, sizeof keys - 1);
        } else {
            fprintf(stderr, "%s: %s line %u: unknown setting '%.40s' (the settings are broker, broker-key and keys)\n",
                    prog, path, no, k);
            code = FU_EXIT_USAGE;
        }
    }
    fclose(f);
    return code;
}

static fu_err conn_fail(const char *prog, int *exit_code, int code, const char *msg, const char *arg)
{
    fprintf(stderr, "%s: ", prog);
    fprintf(stderr, msg, arg);
    fputc('\n', stderr);
    *exit_code = code;
    return code == FU_EXIT_AUTH ? FU_EAUTH : FU_EINVAL;
}

fu_err cli_conn_resolve(const char *prog, cli_conn_opts *o_, bool need_broker, int *exit_code)
{
    cli_conn_opts o = *o_;
    if (!o.broker)
        o.broker = getenv("FUSION_BROKER");
    if (!o.broker_key)
        o.broker_key = getenv("FUSION_BROKER_KEY");
    if (!o.keys)
        o.keys = getenv("FUSION_KEYS");
    int cfg_code = conn_read_config(prog, &o);
    if (cfg_code != FU_EXIT_OK) {
        *exit_code = cfg_code;
        return FU_EINVAL;
    }
    if (!o.broker && need_broker)
        return conn_fail(prog, exit_code, FU_EXIT_USAGE,
                         "no broker given: use --broker tcp://HOST:7700, set FUSION_BROKER, or put "
                         "`broker = …` in ~/.config/fusion/client.conf%s", "");
    if (!o.broker_key)
        return conn_fail(prog, exit_code, FU_EXIT_USAGE,
                         "no broker key given: use --broker-key FILE (the broker's public.key) or set "
                         "FUSION_BROKER_KEY%s", "");
    if (!o.keys)
        return conn_fail(prog, exit_code, FU_EXIT_USAGE,
                         "no client keys given: make them with `fusion keygen -o DIR`, then use --keys DIR "
                         "or set FUSION_KEYS%s", "");
    *o_ = o;
    return FU_OK;
}

/* Closes the socket and its monitor (the context stays). */
static void conn_socket_close(cli_conn_t *c)
{
    if (c->monitor) {
        int zero = 0;
        zmq_setsockopt(c->monitor, ZMQ_LINGER, &zero, sizeof zero);
        zmq_close(c->monitor);
        c->monitor = NULL;
    }
    wire_socket_close(&c->sock);
}

/* A socket to endpoint c->cur, its handshake watched. FU_EINVAL for an endpoint zmq refuses. */
static fu_err conn_socket_open(cli_conn_t *c)
{
    fu_err rc = FU_EIO;
    c->connected = c->handshaken = false;
    c->refused = 0;
    c->opened_ms = fu_clock_ms();
    snprintf(c->endpoint, sizeof c->endpoint, "%s", c->eps.ep[c->cur]);
    c->sock = wire_socket_new(c->ctx, ZMQ_DEALER, &rc);
    if (!c->sock)
        return rc;
    if ((rc = wire_socket_curve_client(c->sock, c->kp, c->eps.pk[c->cur])) != FU_OK)
        return rc;
    /* Watch the handshake so a refused key is reported as such rather than as a timeout, and a
     * broker that is not there (connection refused) as such, at once. */
    char mon[64];
    snprintf(mon, sizeof mon, "inproc://cli-monitor-%p-%u", (void *)c, c->cur);
    if (zmq_socket_monitor(c->sock, mon, ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                             ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_CONNECTED |
                                             ZMQ_EVENT_CONNECT_RETRIED) != 0)
        return FU_EIO;
    c->monitor = zmq_socket(c->ctx, ZMQ_PAIR);
    if (!c->monitor || zmq_connect(c->monitor, mon) != 0)
        return FU_EIO;
    if (zmq_connect(c->sock, c->endpoint) != 0)
        return FU_EINVAL;
    return FU_OK;
}

fu_err cli_conn_open(const char *prog, const cli_conn_opts *given, cli_conn_t **out, int *exit_code)
{
    cli_conn_opts o = *given;
    FU_TRY(cli_conn_resolve(prog, &o, true, exit_code));

    fu_errmsg em = {{0}};
    cli_conn_t *c = fu_calloc(1, sizeof *c);
    c->prog = prog;
    c->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : CLI_DEFAULT_TIMEOUT_MS;
    fu_err krc = wire_endpoints_load(o.broker, o.broker_key, &c->eps, &em);
    if (krc == FU_OK)
        krc = wire_keypair_load(o.keys, &c->kp, &em);
    if (krc != FU_OK) {
        cli_conn_close(&c);
        return conn_fail(prog, exit_code, FU_EXIT_USAGE, "%s", fu_errmsg_text(&em, krc));
    }
    fu_err rc = FU_EIO;
    c->ctx = zmq_ctx_new();
    if (c->ctx)
        rc = conn_socket_open(c);
    if (rc == FU_EINVAL) {
        char ep[256];
        snprintf(ep, sizeof ep, "%s", c->endpoint);
        cli_conn_close(&c);
        return conn_fail(prog, exit_code, FU_EXIT_USAGE, "cannot use broker endpoint '%s' (expected tcp://HOST:PORT)",
                         ep);
    }
    if (rc != FU_OK) {
        fprintf(stderr, "%s: cannot set up the connection to %s: %s\n", prog, o.broker, fu_strerror(rc));
        cli_conn_close(&c);
        *exit_code = FU_EXIT_FAIL;
        return rc;
    }
    *out = c;
    return FU_OK;
}

/* Sends the last request (kept encoded: a move to the next endpoint sends it again). */
static fu_err send_request(cli_conn_t *c)
{
    if (zmq_send(c->sock, c->req_env, c->req_env_len, ZMQ_SNDMORE) < 0 ||
        zmq_send(c->sock, c->req_body, c->req_body_len, 0) < 0)
        return FU_EIO;
    return FU_OK;
}

/* Nothing answered at the endpoint in use, ever: the next one, with the last request sent again.
 * False when there is none (or the socket could not be made: the failure is then said as it is). */
static bool conn_next(cli_conn_t *c, const char *why)
{
    if (c->cur + 1 >= c->eps.n)
        return false;
    char was[256];
    snprintf(was, sizeof was, "%s", c->endpoint);
    conn_socket_close(c);
    c->cur++;
    if (conn_socket_open(c) != FU_OK)
        return false;
    if (!c->quiet) {
        cli_progress_break();
        fprintf(stderr, "%s: %s at %s: trying %s\n", c->prog, why, was, c->endpoint);
    }
    return !c->req_env || send_request(c) == FU_OK;
}

void cli_conn_close(cli_conn_t **self_p)
{
    cli_conn_t *c = *self_p;
    if (!c)
        return;
    conn_socket_close(c);
    if (c->ctx)
        zmq_ctx_term(c->ctx);
    wire_keypair_destroy(&c->kp);
    wire_endpoints_free(&c->eps);
    free(c->req_env);
    free(c->req_body);
    free(c);
    *self_p = NULL;
}

/* Reads one monitor event: returns its event number, or 0 when none is queued. */
static int conn_monitor_event(cli_conn_t *c)
{
    zmq_msg_t ev, addr;
    zmq_msg_init(&ev);
    if (zmq_msg_recv(&ev, c->monitor, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&ev);
        return 0;
    }
    uint16_t event = 0;
    if (zmq_msg_size(&ev) >= sizeof event)
        memcpy(&event, zmq_msg_data(&ev), sizeof event);
    zmq_msg_close(&ev);
    zmq_msg_init(&addr); /* second frame: the endpoint */
    if (zmq_msg_recv(&addr, c->monitor, ZMQ_DONTWAIT) < 0) {
    }
    zmq_msg_close(&addr);
    return event;
}

static int error_exit_code(Fusion__ErrorCode code)
{
    switch (code) {
    case FUSION__ERROR_CODE__ERR_AUTH:
        return FU_EXIT_AUTH;
    case FUSION__ERROR_CODE__ERR_NOT_FOUND:
        return FU_EXIT_NOTFOUND;
    case FUSION__ERROR_CODE__ERR_VERSION: /* a protocol version or a model feature fusion does not support */
        return FU_EXIT_USAGE;
    default:
        return FU_EXIT_FAIL;
    }
}

/* Says a failure of c on stderr (prefixed with its prog) and keeps it as its last error, with the
 * broker's error code (-1: none). */
static void conn_err(cli_conn_t *c, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void conn_err(cli_conn_t *c, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_err, sizeof c->last_err, fmt, ap);
    va_end(ap);
    c->last_code = code;
    if (c->quiet)
        return;
    cli_progress_break(); /* an error after a progress line starts a line of its own */
    fprintf(stderr, "%s: %s\n", c->prog, c->last_err);
}

void cli_conn_set_quiet(cli_conn_t *c, bool quiet)
{
    c->quiet = quiet;
}

const char *cli_conn_last_error(const cli_conn_t *c, int *code)
{
    if (code)
        *code = c->last_code;
    return c->last_err;
}

fu_err cli_conn_send(cli_conn_t *c, const wire_hdr *hdr, const ProtobufCMessage *body, int *exit_code)
{
    wire_hdr h = *hdr;
    h.sequence = ++c->sequence;
    free(c->req_env);
    free(c->req_body);
    c->req_env = c->req_body = NULL;
    fu_err rc = wire_encode(&h, body, &c->req_env, &c->req_env_len, &c->req_body, &c->req_body_len);
    if (rc == FU_OK)
        rc = send_request(c);
    if (rc != FU_OK) {
        conn_err(c, -1, "cannot send to the broker at %s: %s", c->endpoint, fu_strerror(rc));
        *exit_code = FU_EXIT_FAIL;
    }
    return rc;
}

fu_err cli_conn_call(cli_conn_t *c, const wire_hdr *hdr, const ProtobufCMessage *body, Fusion__MsgType want,
                     wire_msg_t **reply, int *exit_code)
{
    FU_TRY(cli_conn_send(c, hdr, body, exit_code));
    return cli_conn_recv(c, want, reply, exit_code);
}

fu_err cli_conn_request(const char *prog, const cli_conn_opts *o, const wire_hdr *hdr,
                        const ProtobufCMessage *body, Fusion__MsgType want, wire_msg_t **reply,
                        int *exit_code)
{
    cli_conn_t *c = NULL;
    fu_err rc = cli_conn_open(prog, o, &c, exit_code);
    if (rc == FU_OK)
        rc = cli_conn_call(c, hdr, body, want, reply, exit_code);
    cli_conn_close(&c);
    return rc;
}

fu_err cli_conn_recv(cli_conn_t *c, Fusion__MsgType want, wire_msg_t **reply, int *exit_code)
{
    uint64_t deadline = fu_clock_ms() + (uint64_t)c->timeout_ms;
    uint64_t shake_ms = (uint64_t)(c->timeout_ms < CLI_HANDSHAKE_MS ? c->timeout_ms : CLI_HANDSHAKE_MS);
    for (;;) {
        uint64_t now = fu_clock_ms();
        /* A broker that is stopped, hung or behind a black hole never finishes the handshake: said after
         * a few seconds rather than at the request's deadline. Once it has, a restart is waited for. */
        if (!c->handshaken && now >= c->opened_ms + shake_ms && now < deadline) {
            if (conn_next(c, c->connected ? "no handshake" : "no connection")) {
                deadline = fu_clock_ms() + (uint64_t)c->timeout_ms; /* the request starts again there */
                continue;
            }
            if (c->connected)
                conn_err(c, -1,
                         "the broker at %s took the connection but has not finished its handshake in %.1f s (is "
                         "fusion-broker stopped or hung, or is something else listening on that port?)",
                         c->endpoint, (double)shake_ms / 1000.0);
            else
                conn_err(c, -1,
                         "cannot reach %s: no connection in %.1f s (is the host up, and the port open to you?)",
                         c->endpoint, (double)shake_ms / 1000.0);
            *exit_code = FU_EXIT_TIMEOUT;
            return FU_ETIMEDOUT;
        }
        if (now >= deadline) {
            conn_err(c, -1,
                     "no answer from the broker at %s within %lld ms (is fusion-broker running there, and is "
                     "--broker-key its public key?)",
                     c->endpoint, c->timeout_ms);
            *exit_code = FU_EXIT_TIMEOUT;
            return FU_ETIMEDOUT;
        }
        zmq_pollitem_t items[2] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->monitor, 0, ZMQ_POLLIN, 0}};
        long wait = (long)(deadline - now);
        if (zmq_poll(items, 2, wait > 200 ? 200 : wait) < 0 && errno != EINTR) {
            *exit_code = FU_EXIT_FAIL;
            return FU_EIO;
        }
        if (items[1].revents & ZMQ_POLLIN) {
            int ev = conn_monitor_event(c);
            c->connected |= ev == ZMQ_EVENT_CONNECTED || ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED;
            c->handshaken |= ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED;
            /* Refused again and again (a retry every WIRE_RECONNECT_MS at first) before it ever
             * connected: nothing listens there. Once connected, a broker that restarts is waited for. */
            if (ev == ZMQ_EVENT_CONNECT_RETRIED && !c->connected && ++c->refused >= CLI_REFUSED_TRIES) {
                if (conn_next(c, "connection refused")) {
                    deadline = fu_clock_ms() + (uint64_t)c->timeout_ms;
                    continue;
                }
                conn_err(c, -1,
                         "nothing answers at %s: the connection is refused (is fusion-broker running there, on "
                         "that port?)",
                         c->endpoint);
                *exit_code = FU_EXIT_FAIL;
                return FU_EIO;
            }
            if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH || ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
                conn_err(c, FUSION__ERROR_CODE__ERR_AUTH,
                         "the broker at %s refused this client's key (ask its operator to allow your public.key, "
                         "or check --broker-key)",
                         c->endpoint);
                *exit_code = FU_EXIT_AUTH;
                return FU_EAUTH;
            }
        }
        if (!(items[0].revents & ZMQ_POLLIN))
            continue;
        wire_msg_t *m = NULL;
        fu_err rc = wire_recv(c->sock, WIRE_DONTWAIT, NULL, &m);
        if (rc == FU_EAGAIN)
            continue;
        c->handshaken = true; /* an answer came: its event may still be queued on the monitor */
        if (rc != FU_OK) {
            conn_err(c, -1, "bad answer from the broker: %s", fu_strerror(rc));
            *exit_code = FU_EXIT_FAIL;
            return rc;
        }
        const Fusion__Error *err = wire_msg_body_as(m, FUSION__MSG_TYPE__MSG_ERROR);
        if (err) {
            conn_err(c, (int)err->code, "%s", err->message && err->message[0] ? err->message : "refused");
            *exit_code = error_exit_code(err->code);
            wire_msg_destroy(&m);
            return *exit_code == FU_EXIT_AUTH ? FU_EAUTH : *exit_code == FU_EXIT_NOTFOUND ? FU_ENOTFOUND : FU_EPROTO;
        }
        if (wire_msg_type(m) != want) { /* a late answer to an earlier request */
            wire_msg_destroy(&m);
            continue;
        }
        *reply = m;
        return FU_OK;
    }
}

void cli_job_id_format(uint64_t id, char buf[17])
{
    snprintf(buf, 17, "%016" PRIx64, id);
}

fu_err cli_job_id_parse(const char *s, uint64_t *id)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > 16 || strspn(s, "0123456789abcdefABCDEF") != n)
        return FU_EINVAL;
    *id = strtoull(s, NULL, 16);
    return FU_OK;
}

fu_err cli_job_arg(const char *prog, const char *s, uint64_t *id)
{
    fu_err rc = cli_job_id_parse(s, id);
    if (rc != FU_OK)
        fprintf(stderr, "%s: '%s' is not a job id (16 hex digits, as `fusion jobs` shows)\n", prog, s);
    return rc;
}

fu_err cli_job_cmd_parse(const fu_cmd *cmd, int argc, char **argv, uint64_t *id, size_t *n_pos,
                         int *exit_code)
{
    size_t npos = 0;
    fu_err rc = fu_opts_parse(cmd, argc, argv, &npos, exit_code);
    if (rc == FU_OK && npos && (rc = cli_job_arg(cmd->prog, argv[1], id)) != FU_OK)
        *exit_code = FU_EXIT_USAGE;
    if (n_pos)
        *n_pos = npos;
    return rc;
}
