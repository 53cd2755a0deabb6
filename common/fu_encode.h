/* Text encodings for keys and hashes: hex and Z85 (ZeroMQ's base-85, RFC 32). */
#ifndef FU_ENCODE_H
#define FU_ENCODE_H

#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Lower-case hex of n bytes into out, which must hold 2n+1 chars (NUL-terminated). */
void fu_hex_encode(char *out, const uint8_t *in, size_t n);
/* Decodes exactly 2*n hex chars (either case) from in into n bytes. FU_EINVAL on bad length/char. */
FU_MUST_CHECK fu_err fu_hex_decode(uint8_t *out, size_t n, const char *in);

/* Z85 of n bytes (n a multiple of 4) into out, which must hold n*5/4+1 chars. FU_EINVAL otherwise. */
FU_MUST_CHECK fu_err fu_z85_encode(char *out, const uint8_t *in, size_t n);
/* Decodes a Z85 string of length 5k into 4k bytes; out_cap is out's size. FU_EINVAL on bad input. */
FU_MUST_CHECK fu_err fu_z85_decode(uint8_t *out, size_t out_cap, const char *in, size_t *out_len);

#ifdef __cplusplus
}
#endif
#endif
