/* Checked allocation for internal sizes. These abort with a message on failure: use them only for
 * sizes the program chose. Sizes read from a socket or a file go through fu_budget or an explicit
 * check that returns FU_ENOMEM instead. */
#ifndef FU_ALLOC_H
#define FU_ALLOC_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

void *fu_malloc(size_t n);                 /* never NULL; aborts on failure */
void *fu_calloc(size_t count, size_t size); /* zeroed; aborts on failure or overflow */
void *fu_realloc(void *p, size_t n);       /* never NULL; aborts on failure */
char *fu_strdup(const char *s);            /* caller frees; NULL in, NULL out */
char *fu_strndup(const char *s, size_t n); /* the first n bytes of s (fewer at its end), terminated */
/* Grows the array p of *n elements of elem bytes (doubling, from 1024) until it holds index i; the
 * new elements are zeroed. Returns the array (moved or not); aborts on failure. */
void *fu_grow_zeroed(void *p, size_t *n, size_t i, size_t elem);
/* 64-byte aligned, for SIMD and BLAS buffers; free with fu_free_aligned. Aborts on failure. */
void *fu_malloc_aligned(size_t n);
void  fu_free_aligned(void *p);

/* Overflow-checked size arithmetic: false when a*b (or a+b) does not fit in size_t. */
static inline bool fu_size_mul(size_t a, size_t b, size_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool fu_size_add(size_t a, size_t b, size_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

/* A byte budget for allocations driven by untrusted input. fu_budget_take returns FU_ENOMEM once
 * more than `limit` bytes would be outstanding; fu_budget_give returns bytes. Not thread-safe. */
typedef struct {
    size_t limit; /* most bytes that may be outstanding */
    size_t used;  /* bytes outstanding now */
} fu_budget;

FU_MUST_CHECK fu_err fu_budget_take(fu_budget *b, size_t n);
void                 fu_budget_give(fu_budget *b, size_t n);

#ifdef __cplusplus
}
#endif
#endif
