/* kern_codec: how a cut tensor (activations going down the pipeline, gradients coming up) is written
 * on the wire. The job chooses one codec for each direction (docs/PIPELINE.md "Wire codecs"):
 *
 *   f32   4 bytes a value, as computed (the default: the pipeline equals one process bit for bit)
 *   f16   2 bytes, IEEE half, rounded to nearest even (values past 65504 become infinite)
 *   bf16  2 bytes, the top half of the f32, rounded to nearest even
 *   int8  1 byte a value plus 4 a row: each row of `width` values is its scale s (f32, little-endian;
 *         s = max|x| / 127, 0 for a zero row) followed by q_i = x_i / s rounded to nearest even, in
 *         [-127, 127]; it decodes to q_i * s
 *   int8-ef  int8 on the wire; for gradients, the sender adds what its last encoding of the same
 *         micro-batch lost before encoding, and keeps what this one loses (error feedback: the
 *         state lives with the sender, dag_train_grad_encode)
 *
 * Encoding is a pure function of the values: the same bits whatever the thread count or machine, so
 * a run that applies encode-then-decode at the same cuts (`fusion run --cuts --wire-codec`) gives the
 * pipeline's bits, and recovery and verification keep their guarantees. Decoding checks what it reads:
 * an int8 row whose scale is negative or not finite is refused.
 *
 * Threads: pure functions. */
#ifndef FU_KERN_CODEC_H
#define FU_KERN_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    KERN_CODEC_F32 = 0,
    KERN_CODEC_F16 = 1,
    KERN_CODEC_BF16 = 2,
    KERN_CODEC_INT8 = 3,
    KERN_CODEC_INT8_EF = 4, /* int8's format; the sender keeps a residual */
    KERN_CODEC_COUNT_
} kern_codec;

/* "f32", "f16", "bf16", "int8", "int8-ef"; "?" for a value out of range. */
const char *kern_codec_name(kern_codec c);
/* The codec named s (as kern_codec_name writes it). FU_EINVAL for anything else. */
FU_MUST_CHECK fu_err kern_codec_parse(const char *s, kern_codec *out);

/* Bytes of `rows` rows of `width` values in codec c (0 for an unknown codec or on overflow). */
size_t kern_codec_bytes(kern_codec c, size_t rows, size_t width);

/* Writes rows x width floats x (row-major) in codec c to out (kern_codec_bytes(c, rows, width)
 * bytes). */
void kern_codec_encode(kern_codec c, const float *x, size_t rows, size_t width, uint8_t *out);

/* Reads rows x width floats from in (len bytes) into x. FU_EPROTO when len is not
 * kern_codec_bytes(c, rows, width) or an int8 scale is negative or not finite; FU_EINVAL for an
 * unknown codec. */
FU_MUST_CHECK fu_err kern_codec_decode(kern_codec c, const uint8_t *in, size_t len, size_t rows, size_t width,
                                       float *x);

#ifdef __cplusplus
}
#endif
#endif
