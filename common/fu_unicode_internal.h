/* fu_unicode_internal: the generated tables of fu_unicode.c (common/fu_unicode_cats.c: general
 * categories; common/fu_unicode_norm.c: normalization; both written by common/fu_unicode_gen.py).
 * Private to those files. */
#ifndef FU_UNICODE_INTERNAL_H
#define FU_UNICODE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t lo, hi; /* inclusive */
} fu_uni_range;

typedef struct {
    uint32_t lo, hi; /* inclusive */
    uint8_t ccc;     /* canonical combining class (non-zero) */
} fu_uni_ccc;

typedef struct {
    uint32_t cp;
    uint8_t n;       /* code points of its full canonical decomposition */
    uint32_t d[4];
} fu_uni_decomp;

typedef struct {
    uint32_t first, second, composite;
} fu_uni_comp;

extern const char fu_unicode_version[];
extern const fu_uni_range fu_uni_letters[];
extern const size_t fu_uni_letters_n;
extern const fu_uni_range fu_uni_numbers[];
extern const size_t fu_uni_numbers_n;
extern const fu_uni_ccc fu_uni_ccc_table[];
extern const size_t fu_uni_ccc_table_n;
extern const fu_uni_decomp fu_uni_decomp_table[];
extern const size_t fu_uni_decomp_table_n;
extern const fu_uni_comp fu_uni_comp_table[];
extern const size_t fu_uni_comp_table_n;

#endif
