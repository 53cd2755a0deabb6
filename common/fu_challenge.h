/* fu_challenge: the profile challenge, a timed computation whose result the broker can check
 * (docs/SECURITY.md "Verified profiles", docs/PROTOCOL.md "Profile challenge").
 *
 * The peer computes C = rmsnorm(A, d) · B for n×n f32 matrices A, B and a length-n vector d:
 *   C[i][j] = r_i · Σ_k A[i][k]·d[k]·B[k][j],   r_i = 1 / sqrt(mean_k(A[i][k]²) + FU_CHALLENGE_EPS)
 * A and B come from the challenge seed (the peer makes them before the clock starts), d from a
 * second seed sent when the clock starts: C cannot be computed before it, and it is n rank-one
 * terms, so no product made in advance helps. Every element is a counter-based hash of its index,
 * exactly representable in f32: the broker makes any row of A or column of B in O(n).
 *
 * The peer commits to C with the BLAKE2b of its row hashes; only then does the broker name rows to
 * reveal, and it checks FU_CHALLENGE_CHECKS entries of each in O(n) apiece against a tolerance wide
 * enough for any summation order and TF32/bf16 tensor cores, and far narrower than a wrong sum. */
#ifndef FU_CHALLENGE_H
#define FU_CHALLENGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FU_CHALLENGE_SEED_BYTES 32u
#define FU_CHALLENGE_ROW_HASH   16u    /* BLAKE2b-128 of a row's f32 little-endian bytes */
#define FU_CHALLENGE_COMMIT     32u    /* BLAKE2b-256 of the n row hashes */
#define FU_CHALLENGE_N_MIN      128u
#define FU_CHALLENGE_N_MAX      8192u  /* n row hashes and the revealed rows fit a control message */
#define FU_CHALLENGE_ROWS       8u     /* rows the broker asks to see */
#define FU_CHALLENGE_CHECKS     16u    /* entries it checks in each */
#define FU_CHALLENGE_EPS        1e-5f
#define FU_CHALLENGE_RTOL       2e-3   /* |c - ref| <= RTOL · r_i · Σ_k |A d B| (+ a tiny absolute floor) */

typedef enum { FU_CHALLENGE_A = 0, FU_CHALLENGE_B = 1, FU_CHALLENGE_D = 2 } fu_challenge_matrix;

/* Element `index` (row-major) of matrix `which` under seed: A and B in [-1, 1), d in [0.5, 1.5). */
float fu_challenge_elem(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], fu_challenge_matrix which, uint64_t index);

/* Fills out[0, count) with elements first..first+count-1 of `which`. */
void fu_challenge_fill(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], fu_challenge_matrix which, uint64_t first,
                       size_t count, float *out);

/* The row hash of n floats (as their little-endian bytes). */
void fu_challenge_row_hash(const float *row, uint32_t n, uint8_t out[FU_CHALLENGE_ROW_HASH]);

/* The commitment: BLAKE2b-256 of n row hashes laid end to end. */
void fu_challenge_commit(const uint8_t *row_hashes, uint32_t n, uint8_t out[FU_CHALLENGE_COMMIT]);

/* Whether `row` is row i of C for (seed, go_seed, n): FU_CHALLENGE_CHECKS entries chosen by
 * pick_seed checked in O(n) each. */
bool fu_challenge_check_row(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], const uint8_t go_seed[FU_CHALLENGE_SEED_BYTES],
                            uint32_t n, uint32_t i, const float *row, uint64_t pick_seed);

/* Reference C = rmsnorm(A, d) · B on the CPU, in plain loops, O(n³): for tests and small n only. */
void fu_challenge_reference(const uint8_t seed[FU_CHALLENGE_SEED_BYTES], const uint8_t go_seed[FU_CHALLENGE_SEED_BYTES],
                            uint32_t n, float *c);

/* n for a peer claiming gflops, so that the product takes about target_s at that speed, within
 * [FU_CHALLENGE_N_MIN, FU_CHALLENGE_N_MAX] and with A, B, C (3·n²·4 bytes) in at most mem_bytes. */
uint32_t fu_challenge_size(double gflops, double target_s, uint64_t mem_bytes);

/* Floating-point operations of the product: 2·n³. */
double fu_challenge_flops(uint32_t n);

#ifdef __cplusplus
}
#endif
#endif
