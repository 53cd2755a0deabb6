/* libFuzzer target: the safetensors parser (fu_safetensors_parse_header), which reads model files
 * and checkpoints that may come from anywhere. Invariants checked: any input gives FU_OK or an
 * error with a message, never a crash or a leak (ASan); on FU_OK every tensor lies inside the
 * input, its size is its shape times its dtype size, and converting an F32/F16/BF16 tensor to f32
 * reads only its own bytes. Seeds: tests/fuzz/corpus/safetensors/. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fu_safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fu_safetensors *st = NULL;
    fu_errmsg em = {{0}};
    fu_err rc = fu_safetensors_parse_header(data, size, "fuzz.safetensors", &st, &em);
    if (rc != FU_OK) {
        if (!em.msg[0])
            abort(); /* every refusal says why */
        return 0;
    }
    for (size_t i = 0; i < fu_safetensors_count(st); i++) {
        const fu_st_tensor *t = fu_safetensors_at(st, i);
        const uint8_t *p = t->data;
        if (p < data || p + t->nbytes > data + size)
            abort();
        uint64_t n = 1;
        for (size_t d = 0; d < t->ndim; d++)
            n *= t->shape[d];
        if (n != t->nelem || n * fu_st_dtype_size(t->dtype) != t->nbytes)
            abort();
        if ((t->dtype == FU_ST_F32 || t->dtype == FU_ST_F16 || t->dtype == FU_ST_BF16) && t->nelem <= (1u << 16)) {
            float *dst = malloc(sizeof(float) * (t->nelem ? t->nelem : 1));
            if (fu_st_tensor_to_f32(t, dst, t->nelem, NULL) != FU_OK)
                abort();
            free(dst);
        }
    }
    fu_safetensors_close(&st);
    return 0;
}
