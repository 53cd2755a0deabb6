/* wire_validate: what wire.c checks in every message it decodes, and what the other modules use on
 * text received: strict UTF-8, and a walk of any generated protobuf-c message by its descriptor
 * (enum values the schema names, UTF-8 strings, repeated fields and nesting within the limits of
 * wire.h). protobuf-c checks none of these itself. Declared in wire.h. */
#include <string.h>

#include "wire.h"

bool wire_utf8_valid(const char *str, size_t n)
{
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp, min;
        if ((c & 0xE0) == 0xC0) {
            len = 2, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, cp = c & 0x07, min = 0x10000;
        } else {
            return false;
        }
        if (n - i < len)
            return false;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return false;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += len;
    }
    return true;
}

size_t wire_utf8_char_len(const char *s, size_t n)
{
    if (n == 0)
        return 0;
    unsigned char c = (unsigned char)s[0];
    size_t len = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    return len && len <= n && wire_utf8_valid(s, len) && c != 0 ? len : 0;
}

void wire_utf8_clean(char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        size_t len = wire_utf8_char_len(s + i, n - i);
        if (len)
            i += len;
        else
            s[i++] = '?';
    }
}

static fu_err validate_at(const ProtobufCMessage *m, unsigned depth);

static fu_err validate_value(const ProtobufCFieldDescriptor *f, const void *p, unsigned depth)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_ENUM: {
        int v = *(const int *)p;
        if (!protobuf_c_enum_descriptor_get_value(f->descriptor, v))
            return FU_EPROTO;
        return FU_OK;
    }
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)p;
        if (!s)
            return FU_OK; /* protobuf-c uses the default "" */
        return wire_utf8_valid(s, strlen(s)) ? FU_OK : FU_EPROTO;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *sub = *(ProtobufCMessage *const *)p;
        return sub ? validate_at(sub, depth + 1) : FU_OK;
    }
    default:
        return FU_OK;
    }
}

static size_t field_elem_size(const ProtobufCFieldDescriptor *f)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT:
    case PROTOBUF_C_TYPE_ENUM:
        return 4;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return 8;
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    }
    return 0;
}

static fu_err validate_at(const ProtobufCMessage *m, unsigned depth)
{
    if (depth > WIRE_MAX_DEPTH)
        return FU_EPROTO;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    if (!d || d->magic != PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC)
        return FU_EINVAL;
    /* protobuf-c keeps unknown fields (forward compatibility) but also accepts field number 0,
     * which protobuf forbids and which does not survive re-encoding: refuse it. */
    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        if (m->unknown_fields[i].tag == 0)
            return FU_EPROTO;
    const char *base = (const char *)m;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_ENUM && f->type != PROTOBUF_C_TYPE_STRING &&
            f->type != PROTOBUF_C_TYPE_MESSAGE && f->label != PROTOBUF_C_LABEL_REPEATED)
            continue;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            if (n > WIRE_MAX_REPEATED)
                return FU_EPROTO;
            const char *arr = *(char *const *)(base + f->offset);
            if (n && !arr)
                return FU_EPROTO;
            size_t es = field_elem_size(f);
            for (size_t k = 0; k < n; k++)
                FU_TRY(validate_value(f, arr + k * es, depth));
            continue;
        }
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t which = *(const uint32_t *)(base + f->quantifier_offset);
            if (which != f->id)
                continue;
        }
        FU_TRY(validate_value(f, base + f->offset, depth));
    }
    return FU_OK;
}

fu_err wire_validate(const ProtobufCMessage *m)
{
    if (!m)
        return FU_EINVAL;
    return validate_at(m, 0);
}
