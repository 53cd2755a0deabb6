/* Logging: one line per event to stderr with a timestamp, level and component, or one JSON object
 * per line when the JSON format is chosen. Thread-safe (each line is written with one call). */
#ifndef FU_LOG_H
#define FU_LOG_H

#include <stdbool.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FU_LOG_DEBUG = 0, FU_LOG_INFO, FU_LOG_WARN, FU_LOG_ERROR, FU_LOG_OFF } fu_log_level;
typedef enum { FU_LOG_TEXT = 0, FU_LOG_JSON } fu_log_format;

void         fu_log_set_level(fu_log_level level);
fu_log_level fu_log_get_level(void);
void         fu_log_set_format(fu_log_format format);
/* A tag this process adds to every component ("peer" becomes "peer/slot1"; NULL or "": none), so
 * that the lines of several processes sharing one stderr tell apart. Set it before other threads log. */
void         fu_log_set_tag(const char *tag);
/* Parses "debug", "info", "warn", "error" or "off". FU_EINVAL on anything else. */
FU_MUST_CHECK fu_err fu_log_parse_level(const char *s, fu_log_level *out);

/* Writes one log line if level is enabled. component names the module ("broker", "wire"). */
void fu_log(fu_log_level level, const char *component, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define FU_DEBUG(comp, ...) fu_log(FU_LOG_DEBUG, comp, __VA_ARGS__)
#define FU_INFO(comp, ...)  fu_log(FU_LOG_INFO, comp, __VA_ARGS__)
#define FU_WARN(comp, ...)  fu_log(FU_LOG_WARN, comp, __VA_ARGS__)
#define FU_ERROR(comp, ...) fu_log(FU_LOG_ERROR, comp, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
