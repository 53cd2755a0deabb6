/* fu_safetensors: the reader half of fu_safetensors.h: dtypes and their conversions, parsing a
 * header, opening a file or a sharded directory, lookup and reading tensors as f32. The writer is
 * fu_safetensors_write.c. */
#include "fu_safetensors.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fu_alloc.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fu_safetensors assumes a little-endian host (safetensors data is little-endian)"
#endif

/* ---- dtypes ------------------------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t      size;
} dtype_table[FU_ST_DTYPE_COUNT_] = {
    [FU_ST_F32] = {"F32", 4}, [FU_ST_F16] = {"F16", 2}, [FU_ST_BF16] = {"BF16", 2},
    [FU_ST_F64] = {"F64", 8}, [FU_ST_I64] = {"I64", 8}, [FU_ST_I32] = {"I32", 4},
    [FU_ST_I16] = {"I16", 2}, [FU_ST_I8] = {"I8", 1},   [FU_ST_U8] = {"U8", 1},
    [FU_ST_BOOL] = {"BOOL", 1},
};

size_t fu_st_dtype_size(fu_st_dtype dt)
{
    return (unsigned)dt < FU_ST_DTYPE_COUNT_ ? dtype_table[dt].size : 0;
}

const char *fu_st_dtype_name(fu_st_dtype dt)
{
    return (unsigned)dt < FU_ST_DTYPE_COUNT_ ? dtype_table[dt].name : "?";
}

fu_err fu_st_dtype_parse(const char *name, fu_st_dtype *out)
{
    if (!name || !out)
        return FU_EINVAL;
    for (int i = 0; i < FU_ST_DTYPE_COUNT_; i++) {
        if (strcmp(name, dtype_table[i].name) == 0) {
            *out = (fu_st_dtype)i;
            return FU_OK;
        }
    }
    return FU_EINVAL;
}

bool fu_st_dtype_is_float(fu_st_dtype dt)
{
    return dt == FU_ST_F32 || dt == FU_ST_F16 || dt == FU_ST_BF16 || dt == FU_ST_F64;
}

/* ---- half and bfloat16 ---------------------------------------------------------------------- */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Both half conversions follow the branch-free method of the FP16 library (M. Dukhan), which is
 * exact and rounds to nearest even. */
float fu_f16_to_f32(uint16_t h)
{
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t cutoff = 1u << 27;
    return f32_from_bits(sign | (two_w < cutoff ? f32_bits(denormalized) : f32_bits(normalized)));
}

uint16_t fu_f32_to_f16(float f)
{
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mant_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mant_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float fu_bf16_to_f32(uint16_t b)
{
    return f32_from_bits((uint32_t)b << 16);
}

uint16_t fu_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN, sign kept */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

fu_err fu_st_from_f32(fu_st_dtype dt, const float *src, size_t n, void *dst)
{
    if ((!src || !dst) && n)
        return FU_EINVAL;
    uint8_t *d = dst;
    switch (dt) {
    case FU_ST_F32:
        if (n)
            memcpy(d, src, n * 4);
        return FU_OK;
    case FU_ST_F16:
    case FU_ST_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h = dt == FU_ST_F16 ? fu_f32_to_f16(src[i]) : fu_f32_to_bf16(src[i]);
            memcpy(d + 2 * i, &h, 2);
        }
        return FU_OK;
    case FU_ST_F64:
        for (size_t i = 0; i < n; i++) {
            double v = src[i];
            memcpy(d + 8 * i, &v, 8);
        }
        return FU_OK;
    default:
        return FU_EINVAL;
    }
}

/* ---- the handle ----------------------------------------------------------------------------- */

typedef struct {
    fu_mmap map;   /* the mapped file (empty for a caller's buffer) */
    char   *label; /* base name for messages */
} st_file;

struct fu_safetensors {
    st_file      *files;    /* every file opened, in the order opened */
    size_t        n_files;
    fu_st_tensor *t;        /* every tensor, sorted by name after st_finish */
    size_t        n, cap;
    char        **meta;     /* key, value, key, value ... of the first file's __metadata__ */
    size_t        n_meta;   /* number of pairs */
    char         *label;    /* how messages name the whole set */
};

static fu_safetensors *st_new(const char *label)
{
    fu_safetensors *st = fu_calloc(1, sizeof *st);
    st->label = fu_strdup(label ? label : "safetensors");
    return st;
}

void fu_safetensors_close(fu_safetensors **st_p)
{
    if (!st_p || !*st_p)
        return;
    fu_safetensors *st = *st_p;
    *st_p = NULL;
    for (size_t i = 0; i < st->n; i++)
        free((char *)(uintptr_t)st->t[i].name);
    free(st->t);
    for (size_t i = 0; i < st->n_files; i++) {
        fu_mmap_close(&st->files[i].map);
        free(st->files[i].label);
    }
    free(st->files);
    for (size_t i = 0; i < 2 * st->n_meta; i++)
        free(st->meta[i]);
    free(st->meta);
    free(st->label);
    free(st);
}

static st_file *st_add_file_slot(fu_safetensors *st, const char *label)
{
    st->files = fu_realloc(st->files, (st->n_files + 1) * sizeof *st->files);
    st_file *f = &st->files[st->n_files++];
    memset(f, 0, sizeof *f);
    f->label = fu_strdup(label);
    return f;
}

static fu_st_tensor *st_push(fu_safetensors *st)
{
    if (st->n == st->cap) {
        st->cap = st->cap ? st->cap * 2 : 16;
        st->t = fu_realloc(st->t, st->cap * sizeof *st->t);
    }
    fu_st_tensor *t = &st->t[st->n++];
    memset(t, 0, sizeof *t);
    return t;
}

/* A JSON number that is a non-negative integer small enough to be exact in a double. */
static bool json_u64(const cJSON *item, uint64_t *out)
{
    if (!cJSON_IsNumber(item))
        return false;
    double d = item->valuedouble;
    if (!(d >= 0.0) || d > 9007199254740992.0 || d != floor(d))
        return false;
    *out = (uint64_t)d;
    return true;
}

static int cmp_by_offset(const void *a, const void *b)
{
    const fu_st_tensor *x = *(const fu_st_tensor *const *)a, *y = *(const fu_st_tensor *const *)b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes)
        return x->nbytes < y->nbytes ? -1 : 1;
    return 0;
}

static void shape_str(char *buf, size_t cap, size_t ndim, const uint64_t *shape)
{
    size_t at = 0;
    at += (size_t)snprintf(buf + at, cap - at, "[");
    for (size_t i = 0; i < ndim && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%llu", i ? ", " : "", (unsigned long long)shape[i]);
    if (at < cap)
        snprintf(buf + at, cap - at, "]");
}

/* Parses one image (header + data) held in buf and appends its tensors to st. The file label is
 * f->label. The first image's metadata is kept. */
static fu_err st_parse_image(fu_safetensors *st, const st_file *f, const uint8_t *buf, size_t len, fu_errmsg *em)
{
    const char *lab = f->label;
    if (len < 8)
        return fu_errmsg_set(em, FU_EPROTO,
                             "%s: truncated: %zu bytes, but a safetensors file starts with an 8-byte header length",
                             lab, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | buf[i];
    if (hlen > FU_ST_HEADER_MAX)
        return fu_errmsg_set(em, FU_EPROTO, "%s: header length %llu is over the %llu-byte limit (not a safetensors file?)",
                             lab, (unsigned long long)hlen, (unsigned long long)FU_ST_HEADER_MAX);
    if (hlen > len - 8)
        return fu_errmsg_set(em, FU_EPROTO, "%s: truncated: header length is %llu but only %zu bytes follow it", lab,
                             (unsigned long long)hlen, len - 8);
    if (hlen < 2 || buf[8] != '{')
        return fu_errmsg_set(em, FU_EPROTO, "%s: header is not a JSON object", lab);
    const char *hdr = (const char *)buf + 8;
    size_t hsz = (size_t)hlen;
    const uint8_t *data = buf + 8 + hsz;
    size_t data_len = len - 8 - hsz;

    /* cJSON spends about 64 bytes per JSON value: bound the values before parsing, so that a
     * 100 MiB header of "0,0,0,..." cannot cost gigabytes. Counting separators over-estimates. */
    size_t values = 1;
    for (size_t i = 0; i < hsz; i++)
        values += hdr[i] == ',' || hdr[i] == ':' || hdr[i] == '[' || hdr[i] == '{';
    if (values > FU_ST_MAX_JSON_VALUES)
        return fu_errmsg_set(em, FU_ENOMEM, "%s: header has about %zu JSON values, more than the %d allowed", lab, values,
                             FU_ST_MAX_JSON_VALUES);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, hsz, &end, 0);
    if (!root) {
        size_t at = (end && end >= hdr && end <= hdr + hsz) ? (size_t)(end - hdr) : 0;
        return fu_errmsg_set(em, FU_EPROTO, "%s: header is not valid JSON (near byte %zu of the header)", lab, at);
    }
    fu_err rc = FU_OK;
    size_t first = st->n;
    fu_st_tensor **order = NULL;
    if (end) {
        for (const char *p = end; p < hdr + hsz; p++) {
            if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
                rc = fu_errmsg_set(em, FU_EPROTO, "%s: header has bytes after its JSON object", lab);
                goto out;
            }
        }
    }
    if (!cJSON_IsObject(root)) {
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: header is not a JSON object", lab);
        goto out;
    }
    for (const cJSON *it = root->child; it; it = it->next) {
        const char *key = it->string;
        if (!key || !*key) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: header has a tensor with an empty name", lab);
            goto out;
        }
        if (strcmp(key, "__metadata__") == 0) {
            if (!cJSON_IsObject(it)) {
                rc = fu_errmsg_set(em, FU_EPROTO, "%s: __metadata__ is not an object", lab);
                goto out;
            }
            bool keep = st->n_files == 1 && st->n_meta == 0 && st->meta == NULL;
            size_t cnt = 0;
            for (const cJSON *m = it->child; m; m = m->next) {
                if (!cJSON_IsString(m) || !m->string) {
                    rc = fu_errmsg_set(em, FU_EPROTO, "%s: __metadata__ value '%s' is not a string", lab,
                                       m->string ? m->string : "");
                    goto out;
                }
                cnt++;
            }
            if (keep && cnt) {
                st->meta = fu_calloc(2 * cnt, sizeof *st->meta);
                for (const cJSON *m = it->child; m; m = m->next) {
                    st->meta[2 * st->n_meta] = fu_strdup(m->string);
                    st->meta[2 * st->n_meta + 1] = fu_strdup(m->valuestring);
                    st->n_meta++;
                }
            }
            continue;
        }
        if (!cJSON_IsObject(it)) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' is not a JSON object", lab, key);
            goto out;
        }
        const cJSON *jd = cJSON_GetObjectItemCaseSensitive(it, "dtype");
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(it, "shape");
        const cJSON *jo = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
        if (!cJSON_IsString(jd) || !cJSON_IsArray(js) || !cJSON_IsArray(jo)) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' needs \"dtype\" (string), \"shape\" and \"data_offsets\" (arrays)",
                               lab, key);
            goto out;
        }
        fu_st_tensor *t = st_push(st);
        t->name = fu_strdup(key);
        t->file = f->label;
        if (fu_st_dtype_parse(jd->valuestring, &t->dtype) != FU_OK) {
            rc = fu_errmsg_set(em, FU_EVERSION, "%s: tensor '%s' has dtype '%.32s', which fusion does not read", lab, key,
                               jd->valuestring);
            goto out;
        }
        uint64_t nelem = 1;
        for (const cJSON *d = js->child; d; d = d->next) {
            if (t->ndim == FU_ST_MAX_DIMS) {
                rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' has more than %d dimensions", lab, key, FU_ST_MAX_DIMS);
                goto out;
            }
            uint64_t v;
            if (!json_u64(d, &v)) {
                rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' has a shape entry that is not a non-negative integer",
                                   lab, key);
                goto out;
            }
            t->shape[t->ndim++] = v;
            if (__builtin_mul_overflow(nelem, v, &nelem)) {
                rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' has a shape whose element count overflows", lab, key);
                goto out;
            }
        }
        uint64_t nbytes;
        if (__builtin_mul_overflow(nelem, (uint64_t)fu_st_dtype_size(t->dtype), &nbytes) || nbytes > SIZE_MAX) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' has a shape whose byte size overflows", lab, key);
            goto out;
        }
        t->nelem = (size_t)nelem;
        t->nbytes = (size_t)nbytes;
        uint64_t b, e;
        if (cJSON_GetArraySize(jo) != 2 || !json_u64(jo->child, &b) || !json_u64(jo->child->next, &e)) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' needs data_offsets [begin, end] of non-negative integers",
                               lab, key);
            goto out;
        }
        if (b > e) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' has data_offsets [%llu, %llu] with begin after end", lab,
                               key, (unsigned long long)b, (unsigned long long)e);
            goto out;
        }
        if (e - b != nbytes) {
            char sh[160];
            shape_str(sh, sizeof sh, t->ndim, t->shape);
            rc = fu_errmsg_set(em, FU_EPROTO,
                               "%s: tensor '%s' has data_offsets [%llu, %llu] (%llu bytes) but shape %s of %s needs %llu bytes",
                               lab, key, (unsigned long long)b, (unsigned long long)e, (unsigned long long)(e - b), sh,
                               fu_st_dtype_name(t->dtype), (unsigned long long)nbytes);
            goto out;
        }
        if (e > data_len) {
            rc = fu_errmsg_set(em, FU_EPROTO,
                               "%s: tensor '%s' ends at byte %llu of the data section, which has only %zu bytes (truncated file?)",
                               lab, key, (unsigned long long)e, data_len);
            goto out;
        }
        t->offset = b;
        t->data = data + b;
    }
    /* The reference rule: tensors tile the data section exactly, with no gap, overlap or tail. */
    size_t cnt = st->n - first;
    if (cnt) {
        order = fu_malloc(cnt * sizeof *order);
        for (size_t i = 0; i < cnt; i++)
            order[i] = &st->t[first + i];
        qsort(order, cnt, sizeof *order, cmp_by_offset);
    }
    uint64_t at = 0;
    for (size_t i = 0; i < cnt; i++) {
        if (order[i]->offset < at) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' overlaps tensor '%s' in the data section", lab,
                               order[i]->name, order[i - 1]->name);
            goto out;
        }
        if (order[i]->offset > at) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: the data section has a gap of %llu bytes before tensor '%s'", lab,
                               (unsigned long long)(order[i]->offset - at), order[i]->name);
            goto out;
        }
        at = order[i]->offset + order[i]->nbytes;
    }
    if (at != data_len) {
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: the data section has %zu bytes but its tensors cover %llu", lab, data_len,
                           (unsigned long long)at);
        goto out;
    }
out:
    free(order);
    cJSON_Delete(root);
    return rc;
}

static int cmp_by_name(const void *a, const void *b)
{
    return strcmp(((const fu_st_tensor *)a)->name, ((const fu_st_tensor *)b)->name);
}

/* Sorts by name and refuses duplicates. */
static fu_err st_finish(fu_safetensors *st, fu_errmsg *em)
{
    if (st->n > 1)
        qsort(st->t, st->n, sizeof *st->t, cmp_by_name);
    for (size_t i = 1; i < st->n; i++) {
        if (strcmp(st->t[i - 1].name, st->t[i].name) == 0) {
            if (st->t[i - 1].file == st->t[i].file)
                return fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' is listed twice", st->t[i].file, st->t[i].name);
            return fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' is in both %s and %s", st->label, st->t[i].name,
                                 st->t[i - 1].file, st->t[i].file);
        }
    }
    return FU_OK;
}

/* Ends an opening: when rc (the reading's result) is FU_OK, st_finish; then st goes to *out, or is
 * closed on failure. Returns the result. */
static fu_err st_hand_out(fu_safetensors *st, fu_err rc, fu_safetensors **out, fu_errmsg *em)
{
    if (rc == FU_OK)
        rc = st_finish(st, em);
    if (rc != FU_OK) {
        fu_safetensors_close(&st);
        return rc;
    }
    *out = st;
    return FU_OK;
}

fu_err fu_safetensors_parse_header(const uint8_t *buf, size_t len, const char *label, fu_safetensors **out,
                                   fu_errmsg *em)
{
    if (!out || (!buf && len))
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_parse_header: NULL argument");
    *out = NULL;
    const char *lab = label ? label : "safetensors";
    fu_safetensors *st = st_new(lab);
    const st_file *f = st_add_file_slot(st, lab);
    return st_hand_out(st, st_parse_image(st, f, buf ? buf : (const uint8_t *)"", len, em), out, em);
}

/* Maps path, appends its tensors; label is its base name. */
static fu_err st_add_path(fu_safetensors *st, const char *path, fu_errmsg *em)
{
    st_file *f = st_add_file_slot(st, fu_path_base(path));
    fu_mmap m;
    fu_err rc = fu_mmap_open(path, &m, em);
    if (rc != FU_OK)
        return rc;
    f->map = m;
    return st_parse_image(st, f, m.data ? m.data : (const uint8_t *)"", m.size, em);
}

fu_err fu_safetensors_open_file(const char *path, fu_safetensors **out, fu_errmsg *em)
{
    if (!path || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_open_file: NULL argument");
    *out = NULL;
    fu_safetensors *st = st_new(fu_path_base(path));
    return st_hand_out(st, st_add_path(st, path, em), out, em);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static bool plain_file_name(const char *s)
{
    return s && *s && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static fu_err open_sharded(fu_safetensors *st, const char *dir, const char *index_path, fu_errmsg *em)
{
    char *txt = NULL;
    size_t len = 0;
    fu_err rc = fu_file_read_all(index_path, FU_ST_INDEX_MAX, &txt, &len, em);
    if (rc != FU_OK)
        return rc;
    const char **names = NULL;
    cJSON *root = cJSON_ParseWithLength(txt, len);
    const cJSON *wm = root ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!root || !cJSON_IsObject(root)) {
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: not a JSON object", FU_ST_INDEX_FILE);
        goto out;
    }
    if (!cJSON_IsObject(wm)) {
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: has no \"weight_map\" object", FU_ST_INDEX_FILE);
        goto out;
    }
    size_t n = 0;
    for (const cJSON *e = wm->child; e; e = e->next) {
        if (!cJSON_IsString(e) || !plain_file_name(e->valuestring)) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: weight_map entry '%s' is not a plain file name in the model directory",
                               FU_ST_INDEX_FILE, e->string ? e->string : "");
            goto out;
        }
        n++;
    }
    if (n == 0) {
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: weight_map is empty", FU_ST_INDEX_FILE);
        goto out;
    }
    names = fu_malloc(n * sizeof *names);
    size_t i = 0;
    for (const cJSON *e = wm->child; e; e = e->next)
        names[i++] = e->valuestring;
    qsort(names, n, sizeof *names, cmp_str);
    size_t u = 0;
    for (i = 0; i < n; i++)
        if (u == 0 || strcmp(names[u - 1], names[i]) != 0)
            names[u++] = names[i];
    if (u > FU_ST_MAX_SHARDS) {
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: names %zu shards, more than the %d allowed", FU_ST_INDEX_FILE, u,
                           FU_ST_MAX_SHARDS);
        goto out;
    }
    for (i = 0; i < u; i++) {
        char *p = fu_path_join(dir, names[i]);
        rc = st_add_path(st, p, em);
        free(p);
        if (rc != FU_OK)
            goto out;
    }
    rc = st_finish(st, em);
    if (rc != FU_OK)
        goto out;
    for (const cJSON *e = wm->child; e; e = e->next) {
        const fu_st_tensor *t = fu_safetensors_get(st, e->string);
        if (!t) {
            rc = fu_errmsg_set(em, FU_ENOTFOUND, "%s: tensor '%s' is not in %s, where weight_map says it is",
                               FU_ST_INDEX_FILE, e->string, e->valuestring);
            goto out;
        }
        if (strcmp(t->file, e->valuestring) != 0) {
            rc = fu_errmsg_set(em, FU_EPROTO, "%s: tensor '%s' is in %s, but weight_map says %s", FU_ST_INDEX_FILE,
                               e->string, t->file, e->valuestring);
            goto out;
        }
    }
out:
    free(names);
    cJSON_Delete(root);
    free(txt);
    return rc;
}

fu_err fu_safetensors_open_dir(const char *dir, fu_safetensors **out, fu_errmsg *em)
{
    if (!dir || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_open_dir: NULL argument");
    *out = NULL;
    if (!fu_path_is_dir(dir))
        return fu_errmsg_set(em, FU_ENOTFOUND, "model dir '%s' does not exist or is not a directory", dir);
    char *index = fu_path_join(dir, FU_ST_INDEX_FILE);
    char *single = fu_path_join(dir, FU_ST_SINGLE_FILE);
    fu_safetensors *st = NULL;
    fu_err rc;
    if (fu_path_exists(index)) {
        st = st_new(FU_ST_INDEX_FILE);
        rc = open_sharded(st, dir, index, em);
    } else if (fu_path_exists(single)) {
        rc = fu_safetensors_open_file(single, &st, em); /* labelled FU_ST_SINGLE_FILE, its base name */
    } else {
        rc = fu_errmsg_set(em, FU_ENOTFOUND, "model dir '%s' has no %s or %s (expected a Hugging Face model directory)",
                           dir, FU_ST_SINGLE_FILE, FU_ST_INDEX_FILE);
    }
    free(index);
    free(single);
    if (rc != FU_OK) {
        fu_safetensors_close(&st);
        return rc;
    }
    *out = st;
    return FU_OK;
}

size_t fu_safetensors_count(const fu_safetensors *st)
{
    return st ? st->n : 0;
}

const fu_st_tensor *fu_safetensors_at(const fu_safetensors *st, size_t i)
{
    return st && i < st->n ? &st->t[i] : NULL;
}

long fu_safetensors_index(const fu_safetensors *st, const char *name)
{
    if (!st || !name)
        return -1;
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, st->t[mid].name);
        if (c == 0)
            return (long)mid;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return -1;
}

const fu_st_tensor *fu_safetensors_get(const fu_safetensors *st, const char *name)
{
    long i = fu_safetensors_index(st, name);
    return i < 0 ? NULL : &st->t[i];
}

fu_err fu_safetensors_find(const fu_safetensors *st, const char *name, const fu_st_tensor **out, fu_errmsg *em)
{
    if (!st || !name || !out)
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_find: NULL argument");
    *out = fu_safetensors_get(st, name);
    if (!*out)
        return fu_errmsg_set(em, FU_ENOTFOUND, "%s: no tensor '%s'", st->label, name);
    return FU_OK;
}

fu_err fu_safetensors_expect(const fu_safetensors *st, const char *name, size_t ndim, const uint64_t *shape,
                             const fu_st_tensor **out, fu_errmsg *em)
{
    const fu_st_tensor *t = NULL;
    if (out)
        *out = NULL;
    if (ndim > FU_ST_MAX_DIMS || (ndim && !shape))
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_expect: bad expected shape");
    fu_err rc = fu_safetensors_find(st, name, &t, em);
    if (rc != FU_OK)
        return rc;
    bool same = t->ndim == ndim;
    for (size_t i = 0; same && i < ndim; i++)
        same = t->shape[i] == shape[i];
    if (!same) {
        char have[160], want[160];
        shape_str(have, sizeof have, t->ndim, t->shape);
        shape_str(want, sizeof want, ndim, shape);
        return fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' has shape %s, expected %s", t->file, t->name, have, want);
    }
    if (out)
        *out = t;
    return FU_OK;
}

fu_err fu_st_tensor_to_f32(const fu_st_tensor *t, float *dst, size_t dst_len, fu_errmsg *em)
{
    if (!t || (!dst && dst_len))
        return fu_errmsg_set(em, FU_EINVAL, "fu_st_tensor_to_f32: NULL argument");
    if (!fu_st_dtype_is_float(t->dtype))
        return fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' has dtype %s, expected a float type (F32, F16, BF16)",
                             t->file ? t->file : "safetensors", t->name, fu_st_dtype_name(t->dtype));
    if (dst_len != t->nelem)
        return fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' has %zu elements, but the buffer holds %zu",
                             t->file ? t->file : "safetensors", t->name, t->nelem, dst_len);
    const uint8_t *s = t->data;
    switch (t->dtype) {
    case FU_ST_F32:
        if (t->nelem)
            memcpy(dst, s, t->nelem * 4);
        break;
    case FU_ST_F16:
    case FU_ST_BF16: {
        const bool f16 = t->dtype == FU_ST_F16;
        for (size_t i = 0; i < t->nelem; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = f16 ? fu_f16_to_f32(h) : fu_bf16_to_f32(h);
        }
        break;
    }
    case FU_ST_F64:
        for (size_t i = 0; i < t->nelem; i++) {
            double v;
            memcpy(&v, s + 8 * i, 8);
            dst[i] = (float)v;
        }
        break;
    default:
        break;
    }
    return FU_OK;
}

fu_err fu_safetensors_read_f32(const fu_safetensors *st, const char *name, size_t ndim, const uint64_t *shape,
                               float *dst, size_t dst_len, fu_errmsg *em)
{
    const fu_st_tensor *t = NULL;
    fu_err rc = fu_safetensors_expect(st, name, ndim, shape, &t, em);
    if (rc != FU_OK)
        return rc;
    if (t->dtype != FU_ST_I8 || t->ndim != 2)
        return fu_st_tensor_to_f32(t, dst, dst_len, em);
    if (dst_len != t->nelem)
        return fu_errmsg_set(em, FU_EINVAL, "%s: tensor '%s' has %zu elements, the buffer %zu", t->file, t->name,
                             (size_t)t->nelem, dst_len);
    const uint64_t rows = t->shape[0], cols = t->shape[1];
    float *scale = malloc((rows ? rows : 1) * sizeof *scale);
    if (!scale)
        return fu_errmsg_set(em, FU_ENOMEM, "out of memory for the scales of '%s'", t->name);
    rc = fu_safetensors_qscale(st, t, scale, em);
    const int8_t *q = t->data;
    for (uint64_t r = 0; rc == FU_OK && r < rows; r++)
        for (uint64_t c = 0; c < cols; c++)
            dst[r * cols + c] = (float)q[r * cols + c] * scale[r];
    free(scale);
    return rc;
}

fu_err fu_safetensors_qscale(const fu_safetensors *st, const fu_st_tensor *t, float *scale, fu_errmsg *em)
{
    if (!st || !t || !scale || t->dtype != FU_ST_I8 || t->ndim != 2)
        return fu_errmsg_set(em, FU_EINVAL, "fu_safetensors_qscale: not a 2-D int8 tensor");
    size_t len = strlen(t->name) + sizeof FU_ST_QSCALE_SUFFIX;
    char *name = fu_malloc(len);
    snprintf(name, len, "%s%s", t->name, FU_ST_QSCALE_SUFFIX);
    const fu_st_tensor *s = NULL;
    fu_err rc = fu_safetensors_find(st, name, &s, em);
    if (rc == FU_OK && (s->dtype != FU_ST_F32 || s->nelem != t->shape[0] || s->ndim < 1 || s->ndim > 2 ||
                        (s->ndim == 2 && s->shape[1] != 1)))
        rc = fu_errmsg_set(em, FU_EINVAL, "%s: the scales '%s' must be F32 [%" PRIu64 "] or [%" PRIu64 ", 1]", s->file,
                           name, t->shape[0], t->shape[0]);
    if (rc == FU_OK)
        rc = fu_st_tensor_to_f32(s, scale, s->nelem, em);
    for (uint64_t r = 0; rc == FU_OK && r < t->shape[0]; r++)
        if (!isfinite(scale[r]))
            rc = fu_errmsg_set(em, FU_EINVAL, "%s: the scales '%s' hold a value that is not finite (row %" PRIu64 ")",
                               s->file, name, r);
    free(name);
    return rc;
}

const char *fu_safetensors_metadata(const fu_safetensors *st, const char *key)
{
    if (!st || !key)
        return NULL;
    for (size_t i = 0; i < st->n_meta; i++)
        if (strcmp(st->meta[2 * i], key) == 0)
            return st->meta[2 * i + 1];
    return NULL;
}
