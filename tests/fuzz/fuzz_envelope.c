/* libFuzzer target: the envelope decoder (wire_decode) and everything behind it (budgeted unpack,
 * validation, the tensor assembler). Input layout: 2 bytes little-endian envelope length L, then L
 * bytes of envelope frame, then the body frame (the rest). Invariants checked:
 *   - a message that decodes re-encodes, and the re-encoding decodes to the same header (or is
 *     refused only for its byte budget);
 *   - a decoded tensor chunk fed to a plain assembler never writes out of bounds (ASan).
 * Built as a libFuzzer binary with -DFUSION_FUZZ=ON (clang), and run over its seed corpus
 * (tests/fuzz/corpus/envelope/) as an ordinary test by fuzz_driver.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "wire.h"
#include "wire_tensor.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int ready;
    if (!ready) {
        if (sodium_init() < 0)
            abort();
        ready = 1;
    }
    if (size < 2)
        return 0;
    size_t env_len = (size_t)data[0] | (size_t)data[1] << 8;
    if (env_len > size - 2)
        env_len = size - 2;
    const uint8_t *env = data + 2, *body = data + 2 + env_len;
    size_t body_len = size - 2 - env_len;

    wire_counters c = {0};
    wire_msg_t *m = NULL;
    fu_err rc = wire_decode(env, env_len, body, body_len, &c, &m);
    if (rc != FU_OK) {
        if (m || c.received != 0 || wire_counters_dropped(&c) != 1)
            __builtin_trap(); /* a refusal is counted exactly once and returns nothing */
        return 0;
    }
    const wire_hdr *h = wire_msg_hdr(m);
    uint8_t *e2 = NULL, *b2 = NULL;
    size_t el2 = 0, bl2 = 0;
    if (wire_encode(h, wire_msg_body(m), &e2, &el2, &b2, &bl2) != FU_OK)
        __builtin_trap();
    wire_msg_t *m2 = NULL;
    rc = wire_decode(e2, el2, b2, bl2, NULL, &m2);
    /* The canonical re-encoding can be smaller than the input, and with it the unpack budget:
     * only a budget refusal is allowed, never a protocol one. */
    if (rc != FU_OK && rc != FU_ENOMEM)
        __builtin_trap();
    if (rc == FU_OK) {
        const wire_hdr *h2 = wire_msg_hdr(m2);
        if (h2->type != h->type || h2->job_id != h->job_id || h2->sequence != h->sequence ||
            strcmp(h2->sender, h->sender) != 0)
            __builtin_trap();
        wire_msg_destroy(&m2);
    }
    free(e2);
    free(b2);

    if (h->type == FUSION__MSG_TYPE__MSG_ACTIVATION || h->type == FUSION__MSG_TYPE__MSG_GRADIENT) {
        wire_tensor_asm_t *as = wire_tensor_asm_new(1u << 20);
        bool done = false;
        if (wire_tensor_asm_feed(as, NULL, m, &done) == FU_OK && done) {
            wire_tensor t;
            if (wire_tensor_asm_take(as, &t) != FU_OK)
                __builtin_trap();
            wire_tensor_clear(&t);
        }
        wire_tensor_asm_destroy(&as);
    }
    wire_msg_destroy(&m);
    return 0;
}
