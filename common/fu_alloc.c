#include "fu_alloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void fu_oom(size_t n)
{
    fprintf(stderr, "fusion: out of memory allocating %zu bytes\n", n);
    abort();
}

void *fu_malloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        fu_oom(n);
    return p;
}

void *fu_calloc(size_t count, size_t size)
{
    size_t total;
    if (!fu_size_mul(count, size, &total))
        fu_oom(SIZE_MAX);
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p)
        fu_oom(total);
    return p;
}

void *fu_realloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q)
        fu_oom(n);
    return q;
}

void *fu_grow_zeroed(void *p, size_t *n, size_t i, size_t elem)
{
    if (i < *n)
        return p;
    size_t m = *n ? *n : 1024;
    while (m <= i)
        m *= 2;
    size_t bytes;
    if (!fu_size_mul(m, elem, &bytes))
        abort();
    p = fu_realloc(p, bytes);
    memset((char *)p + *n * elem, 0, (m - *n) * elem);
    *n = m;
    return p;
}

char *fu_strdup(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *d = fu_malloc(n);
    memcpy(d, s, n);
    return d;
}

char *fu_strndup(const char *s, size_t n)
{
    size_t len = strnlen(s, n);
    char *d = fu_malloc(len + 1);
    memcpy(d, s, len);
    d[len] = '\0';
    return d;
}

void *fu_malloc_aligned(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 1) != 0)
        fu_oom(n);
    return p;
}

void fu_free_aligned(void *p)
{
    free(p);
}

fu_err fu_budget_take(fu_budget *b, size_t n)
{
    size_t after;
    if (!fu_size_add(b->used, n, &after) || after > b->limit)
        return FU_ENOMEM;
    b->used = after;
    return FU_OK;
}

void fu_budget_give(fu_budget *b, size_t n)
{
    b->used = n > b->used ? 0 : b->used - n;
}
