/* kern_codec: the wire codecs of cut tensors (kern_codec.h has the formats). */
#include "kern_codec.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "kern_tensor.h"

static const char *const NAMES[KERN_CODEC_COUNT_] = {"f32", "f16", "bf16", "int8", "int8-ef"};

const char *kern_codec_name(kern_codec c)
{
    return (unsigned)c < KERN_CODEC_COUNT_ ? NAMES[c] : "?";
}

fu_err kern_codec_parse(const char *s, kern_codec *out)
{
    for (int c = 0; s && c < KERN_CODEC_COUNT_; c++)
        if (strcmp(s, NAMES[c]) == 0) {
            *out = (kern_codec)c;
            return FU_OK;
        }
    return FU_EINVAL;
}

size_t kern_codec_bytes(kern_codec c, size_t rows, size_t width)
{
    size_t row;
    switch (c) {
    case KERN_CODEC_F32:
        row = width * 4;
        break;
    case KERN_CODEC_F16:
    case KERN_CODEC_BF16:
        row = width * 2;
        break;
    case KERN_CODEC_INT8:
    case KERN_CODEC_INT8_EF:
        row = width + 4;
        break;
    default:
        return 0;
    }
    if ((width && row / width == 0) || (rows && row > SIZE_MAX / rows) || width > SIZE_MAX / 4)
        return 0;
    return rows * row;
}

static void put_f32(uint8_t *p, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    p[0] = (uint8_t)u, p[1] = (uint8_t)(u >> 8), p[2] = (uint8_t)(u >> 16), p[3] = (uint8_t)(u >> 24);
}

static float get_f32(const uint8_t *p)
{
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void put_u16(uint8_t *p, uint16_t h)
{
    p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

/* One int8 row: its scale, then its values. A row holding a NaN or an infinity gets that as its
 * scale (and zeros): the receiver refuses it rather than train on it. */
static void encode_int8_row(const float *x, size_t width, uint8_t *out)
{
    float amax = 0;
    bool finite = true;
    for (size_t i = 0; i < width; i++) {
        float a = fabsf(x[i]);
        finite &= isfinite(a) != 0;
        amax = a > amax ? a : amax;
    }
    float s = finite ? amax / 127.0f : NAN;
    put_f32(out, s);
    int8_t *q = (int8_t *)(out + 4);
    if (!(s > 0)) {
        memset(q, 0, width);
        return;
    }
    for (size_t i = 0; i < width; i++) {
        float v = nearbyintf(x[i] / s); /* the default rounding: to nearest, ties to even */
        q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v);
    }
}

void kern_codec_encode(kern_codec c, const float *x, size_t rows, size_t width, uint8_t *out)
{
    size_t n = rows * width;
    switch (c) {
    case KERN_CODEC_F32:
        for (size_t i = 0; i < n; i++)
            put_f32(out + 4 * i, x[i]);
        break;
    case KERN_CODEC_F16:
        for (size_t i = 0; i < n; i++)
            put_u16(out + 2 * i, kern_f32_to_f16(x[i]));
        break;
    case KERN_CODEC_BF16:
        for (size_t i = 0; i < n; i++)
            put_u16(out + 2 * i, kern_f32_to_bf16(x[i]));
        break;
    case KERN_CODEC_INT8:
    case KERN_CODEC_INT8_EF:
        for (size_t r = 0; r < rows; r++)
            encode_int8_row(x + r * width, width, out + r * (width + 4));
        break;
    default:
        break;
    }
}

fu_err kern_codec_decode(kern_codec c, const uint8_t *in, size_t len, size_t rows, size_t width, float *x)
{
    if ((unsigned)c >= KERN_CODEC_COUNT_)
        return FU_EINVAL;
    size_t want = kern_codec_bytes(c, rows, width);
    if ((want == 0 && rows && width) || len != want)
        return FU_EPROTO;
    size_t n = rows * width;
    switch (c) {
    case KERN_CODEC_F32:
        for (size_t i = 0; i < n; i++)
            x[i] = get_f32(in + 4 * i);
        break;
    case KERN_CODEC_F16:
        for (size_t i = 0; i < n; i++)
            x[i] = kern_f16_to_f32(get_u16(in + 2 * i));
        break;
    case KERN_CODEC_BF16:
        for (size_t i = 0; i < n; i++)
            x[i] = kern_bf16_to_f32(get_u16(in + 2 * i));
        break;
    default:
        for (size_t r = 0; r < rows; r++) {
            const uint8_t *row = in + r * (width + 4);
            float s = get_f32(row);
            if (!isfinite(s) || s < 0)
                return FU_EPROTO;
            const int8_t *q = (const int8_t *)(row + 4);
            for (size_t i = 0; i < width; i++)
                x[r * width + i] = (float)q[i] * s;
        }
        break;
    }
    return FU_OK;
}
