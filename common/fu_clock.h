/* Monotonic and wall clocks. */
#ifndef FU_CLOCK_H
#define FU_CLOCK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

uint64_t fu_clock_ns(void);      /* monotonic nanoseconds since an arbitrary origin */
uint64_t fu_clock_ms(void);      /* monotonic milliseconds since an arbitrary origin */
double   fu_clock_sec(void);     /* monotonic seconds, for benchmarks */
int64_t  fu_wallclock_ms(void);  /* milliseconds since the Unix epoch */
void     fu_sleep_ms(uint32_t ms);

#ifdef __cplusplus
}
#endif
#endif
