#include "fu_log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fu_clock.h"

#define FU_LOG_LINE_MAX 4096

static fu_log_level  g_level = FU_LOG_INFO;
static fu_log_format g_format = FU_LOG_TEXT;
static char          g_tag[32];

static const char *const level_names[] = {"debug", "info", "warn", "error", "off"};

void fu_log_set_level(fu_log_level level)
{
    g_level = level;
}

fu_log_level fu_log_get_level(void)
{
    return g_level;
}

void fu_log_set_format(fu_log_format format)
{
    g_format = format;
}

void fu_log_set_tag(const char *tag)
{
    snprintf(g_tag, sizeof g_tag, "%s", tag ? tag : "");
}

fu_err fu_log_parse_level(const char *s, fu_log_level *out)
{
    for (int i = 0; i <= FU_LOG_OFF; i++) {
        if (s && strcmp(s, level_names[i]) == 0) {
            *out = (fu_log_level)i;
            return FU_OK;
        }
    }
    return FU_EINVAL;
}

/* Appends s to buf as the body of a JSON string (quotes and control characters escaped). */
static size_t json_escape(char *buf, size_t cap, size_t at, const char *s)
{
    for (; *s && at + 7 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            buf[at++] = '\\';
            buf[at++] = (char)c;
        } else if (c < 0x20) {
            at += (size_t)snprintf(buf + at, cap - at, "\\u%04x", c);
        } else {
            buf[at++] = (char)c;
        }
    }
    return at;
}

void fu_log(fu_log_level level, const char *component, const char *fmt, ...)
{
    if (level < g_level || level >= FU_LOG_OFF)
        return;

    char msg[FU_LOG_LINE_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);

    int64_t now = fu_wallclock_ms();
    time_t secs = (time_t)(now / 1000);
    struct tm tm;
    gmtime_r(&secs, &tm);
    char ts[32];
    size_t tl = strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(ts + tl, sizeof ts - tl, ".%03dZ", (int)(now % 1000));

    char comp[96];
    snprintf(comp, sizeof comp, "%s%s%s", component ? component : "-", g_tag[0] ? "/" : "", g_tag);
    component = comp;
    char line[FU_LOG_LINE_MAX + 256];
    size_t n;
    if (g_format == FU_LOG_JSON) {
        n = (size_t)snprintf(line, sizeof line, "{\"ts\":\"%s\",\"level\":\"%s\",\"component\":\"", ts,
                             level_names[level]);
        n = json_escape(line, sizeof line, n, component ? component : "");
        n += (size_t)snprintf(line + n, sizeof line - n, "\",\"msg\":\"");
        n = json_escape(line, sizeof line, n, msg);
        n += (size_t)snprintf(line + n, sizeof line - n, "\"}\n");
    } else {
        n = (size_t)snprintf(line, sizeof line, "%s %-5s [%s] %s\n", ts, level_names[level],
                             component ? component : "-", msg);
    }
    if (n >= sizeof line)
        n = sizeof line - 1;
    /* One write per line keeps lines whole across threads and processes. */
    ssize_t w = write(STDERR_FILENO, line, n);
    (void)w;
}
