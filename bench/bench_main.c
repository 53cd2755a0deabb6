#include "bench.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_clock.h"

#define BENCH_MAX_CASES 128

static struct {
    const char *name;
    bench_fn    fn;
} cases[BENCH_MAX_CASES];
static size_t n_cases;
static bool   quick;

void bench_register(const char *name, bench_fn fn)
{
    if (n_cases < BENCH_MAX_CASES)
        cases[n_cases++] = (typeof(cases[0])){name, fn};
}

bool bench_quick(void)
{
    return quick;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(void (*fn)(void *), void *arg, int repeats)
{
    if (repeats < 1)
        repeats = 1;
    double *t = malloc(sizeof(double) * (size_t)repeats);
    fn(arg);
    for (int i = 0; i < repeats; i++) {
        double t0 = fu_clock_sec();
        fn(arg);
        t[i] = fu_clock_sec() - t0;
    }
    qsort(t, (size_t)repeats, sizeof(double), cmp_double);
    double med = t[repeats / 2];
    free(t);
    return med;
}

void bench_emit(const char *bench, const char *name, const char *fields_fmt, ...)
{
    char fields[2048];
    va_list ap;
    va_start(ap, fields_fmt);
    vsnprintf(fields, sizeof fields, fields_fmt, ap);
    va_end(ap);
    printf("{\"bench\":\"%s\",\"case\":\"%s\"%s%s}\n", bench, name, fields[0] ? "," : "", fields);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (strcmp(argv[i], "--filter") == 0 && i + 1 < argc) {
            filter = argv[++i];
        } else if (strcmp(argv[i], "--list") == 0) {
            for (size_t k = 0; k < n_cases; k++)
                printf("%s\n", cases[k].name);
            return 0;
        } else {
            fprintf(stderr,
                    "Usage: %s [--quick] [--filter SUBSTRING] [--list]\n"
                    "Runs the benchmark cases and prints one JSON object per line.\n",
                    argv[0]);
            return strcmp(argv[i], "--help") == 0 ? 0 : 2;
        }
    }
    for (size_t k = 0; k < n_cases; k++)
        if (!filter || strstr(cases[k].name, filter))
            cases[k].fn();
    return 0;
}
