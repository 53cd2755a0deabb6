/* fu_safetensors_write: the writer half of fu_safetensors.h: a safetensors image (header JSON, the
 * tensors' data in order, aligned) to a file or to memory. The reader (parsing, opening, lookup and
 * conversion) is fu_safetensors.c. */
#include "fu_safetensors.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"

/* ---- writer ----------------------------------------------------------------------------------- */

typedef struct {
    char  *p;
    size_t len, cap;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->len + n + 1)
            c *= 2;
        b->p = fu_realloc(b->p, c);
        b->cap = c;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

/* Appends s as a JSON string literal. */
static void sb_json_str(sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        switch (*p) {
        case '"': sb_put(b, "\\\"", 2); break;
        case '\\': sb_put(b, "\\\\", 2); break;
        case '\n': sb_put(b, "\\n", 2); break;
        case '\r': sb_put(b, "\\r", 2); break;
        case '\t': sb_put(b, "\\t", 2); break;
        default:
            if (*p < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", *p);
                sb_put(b, esc, 6);
            } else {
                sb_put(b, (const char *)p, 1);
            }
        }
    }
    sb_put(b, "\"", 1);
}

typedef struct {
    const fu_st_tensor *t;
    size_t              index;
    size_t              nbytes;
} wr_item;

static int cmp_write_name(const void *a, const void *b)
{
    return strcmp(((const wr_item *)a)->t->name, ((const wr_item *)b)->t->name);
}

static int cmp_write_order(const void *a, const void *b)
{
    const wr_item *x = a, *y = b;
    size_t sx = fu_st_dtype_size(x->t->dtype), sy = fu_st_dtype_size(y->t->dtype);
    if (sx != sy)
        return sx > sy ? -1 : 1;
    return strcmp(x->t->name, y->t->name);
}

/* Where the writer's bytes go: a file (path) or memory (mem). */
typedef struct {
    fu_file_writer *w; /* the file, or NULL */
    sbuf *mem;         /* the memory, or NULL */
} st_sink;

static fu_err sink_put(st_sink *k, const void *data, size_t len, fu_errmsg *em)
{
    if (k->mem) {
        sb_put(k->mem, data, len);
        return FU_OK;
    }
    return fu_file_writer_write(k->w, data, len, em);
}

/* The writer: checks the tensors, builds the header, sends header and data to the sink (a file at
 * path, or memory); lab names the output in messages. */
static fu_err st_write(const char *path, const char *lab, const fu_st_tensor *tensors, size_t n,
                       const char *const *meta_kv, size_t n_meta, fu_st_fill_fn fill, void *fill_ctx, sbuf *mem,
                       fu_errmsg *em)
{
    wr_item *items = n ? fu_calloc(n, sizeof *items) : NULL;
    sbuf h = {0};
    st_sink k = {.mem = mem};
    void *buf = NULL;
    fu_err rc = FU_OK;

    for (size_t i = 0; i < n; i++) {
        const fu_st_tensor *t = &tensors[i];
        items[i].t = t;
        items[i].index = i;
        if (!t->name || !*t->name || strcmp(t->name, "__metadata__") == 0) {
            rc = fu_errmsg_set(em, FU_EINVAL, "%s: tensor %zu has no usable name", lab, i);
            goto out;
        }
        if ((unsigned)t->dtype >= FU_ST_DTYPE_COUNT_ || t->ndim > FU_ST_MAX_DIMS) {
            rc = fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' has a bad dtype or too many dimensions", lab, t->name);
            goto out;
        }
        size_t ne = 1;
        for (size_t d = 0; d < t->ndim; d++) {
            if (t->shape[d] > SIZE_MAX || !fu_size_mul(ne, (size_t)t->shape[d], &ne)) {
                rc = fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' is too large", lab, t->name);
                goto out;
            }
        }
        size_t nb;
        if (!fu_size_mul(ne, fu_st_dtype_size(t->dtype), &nb) || nb > ((size_t)1 << 52)) {
            rc = fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' is too large", lab, t->name);
            goto out;
        }
        if (t->data ? t->nbytes != nb : !fill) {
            rc = fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' has %zu bytes of data, its shape needs %zu", lab, t->name,
                               t->data ? t->nbytes : 0, nb);
            goto out;
        }
        items[i].nbytes = nb;
    }
    if (n > 1) {
        /* Names must be unique: check on a name-sorted copy, then sort into write order. */
        qsort(items, n, sizeof *items, cmp_write_name);
        for (size_t i = 1; i < n; i++) {
            if (strcmp(items[i - 1].t->name, items[i].t->name) == 0) {
                rc = fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' is given twice", lab, items[i].t->name);
                goto out;
            }
        }
        qsort(items, n, sizeof *items, cmp_write_order);
    }
    sb_str(&h, "{\"__metadata__\":{\"format\":\"pt\"");
    for (size_t i = 0; i < n_meta; i++) {
        if (!meta_kv[2 * i] || !meta_kv[2 * i + 1] || strcmp(meta_kv[2 * i], "format") == 0)
            continue;
        sb_str(&h, ",");
        sb_json_str(&h, meta_kv[2 * i]);
        sb_str(&h, ":");
        sb_json_str(&h, meta_kv[2 * i + 1]);
    }
    sb_str(&h, "}");
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const fu_st_tensor *t = items[i].t;
        char num[48];
        sb_str(&h, ",");
        sb_json_str(&h, t->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, fu_st_dtype_name(t->dtype));
        sb_str(&h, "\",\"shape\":[");
        for (size_t d = 0; d < t->ndim; d++) {
            snprintf(num, sizeof num, "%s%llu", d ? "," : "", (unsigned long long)t->shape[d]);
            sb_str(&h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                 (unsigned long long)(off + items[i].nbytes));
        sb_str(&h, num);
        off += items[i].nbytes;
    }
    sb_str(&h, "}");
    while ((8 + h.len) % 8)
        sb_put(&h, " ", 1);
    if (h.len > FU_ST_HEADER_MAX) {
        rc = fu_errmsg_set(em, FU_EINVAL, "%s: header would be %zu bytes, over the limit", lab, h.len);
        goto out;
    }
    uint8_t lenb[8];
    for (int i = 0; i < 8; i++)
        lenb[i] = (uint8_t)((uint64_t)h.len >> (8 * i));

    if (!mem && (rc = fu_file_writer_open(path, 0644, &k.w, em)) != FU_OK)
        goto out;
    rc = sink_put(&k, lenb, 8, em);
    if (rc == FU_OK)
        rc = sink_put(&k, h.p, h.len, em);
    for (size_t i = 0; rc == FU_OK && i < n; i++) {
        const fu_st_tensor *t = items[i].t;
        if (t->data) {
            rc = sink_put(&k, t->data, items[i].nbytes, em);
            continue;
        }
        if (items[i].nbytes == 0)
            continue;
        buf = fu_malloc(items[i].nbytes);
        rc = fill(fill_ctx, items[i].index, t, buf, items[i].nbytes);
        if (rc != FU_OK)
            fu_errmsg_set(em, rc, "%s: could not make the data of tensor '%s': %s", lab, t->name, fu_strerror(rc));
        else
            rc = sink_put(&k, buf, items[i].nbytes, em);
        free(buf);
        buf = NULL;
    }
    if (rc == FU_OK && k.w)
        rc = fu_file_writer_commit(&k.w, em);
out:
    fu_file_writer_abort(&k.w);
    free(buf);
    free(h.p);
    free(items);
    return rc;
}

fu_err fu_safetensors_write(const char *path, const fu_st_tensor *tensors, size_t n, const char *const *meta_kv,
                            size_t n_meta, fu_st_fill_fn fill, void *fill_ctx, fu_errmsg *em)
{
    if (!path || (!tensors && n) || (!meta_kv && n_meta))
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_write: NULL argument");
    return st_write(path, fu_path_base(path), tensors, n, meta_kv, n_meta, fill, fill_ctx, NULL, em);
}

fu_err fu_safetensors_serialize(const fu_st_tensor *tensors, size_t n, const char *const *meta_kv, size_t n_meta,
                                fu_st_fill_fn fill, void *fill_ctx, uint8_t **out, size_t *out_len, fu_errmsg *em)
{
    if ((!tensors && n) || (!meta_kv && n_meta) || !out || !out_len)
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_serialize: NULL argument");
    sbuf mem = {0};
    fu_err rc = st_write(NULL, "safetensors", tensors, n, meta_kv, n_meta, fill, fill_ctx, &mem, em);
    if (rc != FU_OK) {
        free(mem.p);
        return rc;
    }
    *out = (uint8_t *)mem.p;
    *out_len = mem.len;
    return FU_OK;
}
