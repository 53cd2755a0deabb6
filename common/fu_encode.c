#include "fu_encode.h"

#include <string.h>

static const char hex_digits[] = "0123456789abcdef";

void fu_hex_encode(char *out, const uint8_t *in, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hex_digits[in[i] >> 4];
        out[2 * i + 1] = hex_digits[in[i] & 15];
    }
    out[2 * n] = '\0';
}

static int hex_val(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

fu_err fu_hex_decode(uint8_t *out, size_t n, const char *in)
{
    if (!in || strlen(in) != 2 * n)
        return FU_EINVAL;
    for (size_t i = 0; i < n; i++) {
        int hi = hex_val(in[2 * i]), lo = hex_val(in[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return FU_EINVAL;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return FU_OK;
}

static const char z85_chars[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                ".-:+=^!/*?&<>()[]{}@%$#";

fu_err fu_z85_encode(char *out, const uint8_t *in, size_t n)
{
    if (n % 4)
        return FU_EINVAL;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t v = (uint32_t)in[i] << 24 | (uint32_t)in[i + 1] << 16 | (uint32_t)in[i + 2] << 8 | in[i + 3];
        for (int k = 4; k >= 0; k--) {
            out[o + (size_t)k] = z85_chars[v % 85];
            v /= 85;
        }
        o += 5;
    }
    out[o] = '\0';
    return FU_OK;
}

fu_err fu_z85_decode(uint8_t *out, size_t out_cap, const char *in, size_t *out_len)
{
    static int8_t table[256];
    static int ready;
    if (!ready) {
        memset(table, -1, sizeof table);
        for (int i = 0; i < 85; i++)
            table[(unsigned char)z85_chars[i]] = (int8_t)i;
        ready = 1;
    }
    size_t len = in ? strlen(in) : 0;
    if (len % 5 || len / 5 * 4 > out_cap)
        return FU_EINVAL;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 5) {
        uint64_t v = 0;
        for (size_t k = 0; k < 5; k++) {
            int d = table[(unsigned char)in[i + k]];
            if (d < 0)
                return FU_EINVAL;
            v = v * 85 + (uint64_t)d;
        }
        if (v > 0xffffffffu)
            return FU_EINVAL;
        out[o++] = (uint8_t)(v >> 24);
        out[o++] = (uint8_t)(v >> 16);
        out[o++] = (uint8_t)(v >> 8);
        out[o++] = (uint8_t)v;
    }
    if (out_len)
        *out_len = o;
    return FU_OK;
}
