/* Benchmark harness: each benchmark file registers cases with BENCH_CASE; bench_main.c runs them
 * (all, or those whose name contains --filter) and every case prints one JSON object per line. */
#ifndef FU_BENCH_H
#define FU_BENCH_H

#include <stdbool.h>
#include <stddef.h>

typedef void (*bench_fn)(void);

void bench_register(const char *name, bench_fn fn);

/* True when --quick was given: cases should use fewer repeats and smaller shapes (CI smoke runs). */
bool bench_quick(void);

/* Median wall time in seconds of `repeats` calls of fn(arg), after one warm-up call. */
double bench_median(void (*fn)(void *), void *arg, int repeats);

/* Prints one JSON line: {"bench":..., "case":..., <fields>} where fields is a preformatted list of
 * "\"key\":value" pairs (printf-style), for example bench_emit("kernels", "gemm", "\"m\":%d", m). */
void bench_emit(const char *bench, const char *name, const char *fields_fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define BENCH_CASE(fn)                                                  \
    static void fn(void);                                               \
    __attribute__((constructor)) static void bench_register_##fn(void) \
    {                                                                   \
        bench_register(#fn, fn);                                        \
    }                                                                   \
    static void fn(void)

#endif
