/* peer_challenge: the profile challenge, computed on this peer's backend (see peer_challenge.h). */
#include "peer_challenge.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"
#include "fu_challenge.h"
#include "fu_log.h"
#include "kern_tensor.h"

struct peer_challenge {
    const kern_backend_t *be;
    uint32_t round, n;              /* the challenge prepared, n = 0 when none */
    kern_tensor_t *a, *b, *d, *an, *cm; /* A, B, d, rmsnorm(A, d), C on the backend */
    float *host;                    /* C on the host (GO onwards) */
    uint8_t *hashes;                /* n row hashes */
    uint8_t commit[FU_CHALLENGE_COMMIT];
    float *rows;                    /* the revealed rows */
    bool computed;                  /* GO done */
    char error[160];
};

peer_challenge_t *peer_challenge_new(const kern_backend_t *be)
{
    peer_challenge_t *c = fu_calloc(1, sizeof *c);
    c->be = be;
    return c;
}

/* Frees the matrices (the bulk of it); the row hashes stay for the reply. */
static void release_matrices(peer_challenge_t *c)
{
    kern_tensor_destroy(&c->a);
    kern_tensor_destroy(&c->b);
    kern_tensor_destroy(&c->d);
    kern_tensor_destroy(&c->an);
    kern_tensor_destroy(&c->cm);
    free(c->host);
    c->host = NULL;
}

static void release(peer_challenge_t *c)
{
    release_matrices(c);
    free(c->hashes);
    c->hashes = NULL;
    c->n = 0;
    c->computed = false;
}

void peer_challenge_destroy(peer_challenge_t **c_p)
{
    if (!c_p || !*c_p)
        return;
    release(*c_p);
    free((*c_p)->rows);
    free(*c_p);
    *c_p = NULL;
}

/* A matrix of `which` from seed, made on the host a slice at a time and copied in. */
static fu_err upload(peer_challenge_t *c, const uint8_t *seed, fu_challenge_matrix which, kern_tensor_t *t)
{
    size_t total = kern_tensor_numel(t);
    float *host = malloc(total * sizeof *host);
    if (!host)
        return FU_ENOMEM;
#pragma omp parallel for schedule(static)
    for (size_t r = 0; r < (total + 4095) / 4096; r++) {
        size_t first = r * 4096, cnt = total - first < 4096 ? total - first : 4096;
        fu_challenge_fill(seed, which, first, cnt, host + first);
    }
    fu_err rc = kern_tensor_copy_in(c->be, t, host, total * sizeof *host);
    free(host);
    return rc;
}

static fu_err prepare(peer_challenge_t *c, const Fusion__Challenge *ch)
{
    release(c);
    if (ch->n < FU_CHALLENGE_N_MIN || ch->n > FU_CHALLENGE_N_MAX || ch->seed.len != FU_CHALLENGE_SEED_BYTES) {
        snprintf(c->error, sizeof c->error, "PREPARE needs n in [%u, %u] and a %u-byte seed", FU_CHALLENGE_N_MIN,
                 FU_CHALLENGE_N_MAX, FU_CHALLENGE_SEED_BYTES);
        return FU_EINVAL;
    }
    int64_t sq[2] = {ch->n, ch->n}, vec[1] = {ch->n};
    fu_err rc;
    if ((rc = kern_tensor_new(c->be, KERN_F32, 2, sq, &c->a)) != FU_OK ||
        (rc = kern_tensor_new(c->be, KERN_F32, 2, sq, &c->b)) != FU_OK ||
        (rc = kern_tensor_new(c->be, KERN_F32, 1, vec, &c->d)) != FU_OK ||
        (rc = kern_tensor_new(c->be, KERN_F32, 2, sq, &c->an)) != FU_OK ||
        (rc = kern_tensor_new(c->be, KERN_F32, 2, sq, &c->cm)) != FU_OK ||
        (rc = upload(c, ch->seed.data, FU_CHALLENGE_A, c->a)) != FU_OK ||
        (rc = upload(c, ch->seed.data, FU_CHALLENGE_B, c->b)) != FU_OK || (rc = kern_backend_sync(c->be)) != FU_OK) {
        snprintf(c->error, sizeof c->error, "cannot make two %ux%u matrices on %s: %s", ch->n, ch->n, c->be->name,
                 fu_strerror(rc));
        release(c);
        return rc;
    }
    c->round = ch->round;
    c->n = ch->n;
    return FU_OK;
}

static fu_err go(peer_challenge_t *c, const Fusion__Challenge *ch)
{
    if (!c->n || c->computed || ch->round != c->round || ch->seed.len != FU_CHALLENGE_SEED_BYTES) {
        snprintf(c->error, sizeof c->error, "GO for round %u, which is not prepared", ch->round);
        return FU_EINVAL;
    }
    uint32_t n = c->n;
    float *dv = malloc(n * sizeof *dv);
    c->host = malloc((size_t)n * n * sizeof *c->host);
    c->hashes = malloc((size_t)n * FU_CHALLENGE_ROW_HASH);
    fu_err rc = dv && c->host && c->hashes ? FU_OK : FU_ENOMEM;
    if (rc == FU_OK) {
        fu_challenge_fill(ch->seed.data, FU_CHALLENGE_D, 0, n, dv);
        rc = kern_tensor_copy_in(c->be, c->d, dv, n * sizeof *dv);
    }
    free(dv);
    if (rc == FU_OK)
        rc = kern_rmsnorm_forward(c->be, c->a, c->d, FU_CHALLENGE_EPS, c->an);
    if (rc == FU_OK)
        rc = kern_gemm(c->be, false, false, 1.0f, c->an, c->b, 0.0f, c->cm);
    if (rc == FU_OK)
        rc = kern_tensor_copy_out(c->be, c->cm, c->host, (size_t)n * n * sizeof *c->host);
    if (rc != FU_OK) {
        snprintf(c->error, sizeof c->error, "the challenge's product failed on %s: %s", c->be->name, fu_strerror(rc));
        release(c);
        return rc;
    }
#pragma omp parallel for schedule(static)
    for (uint32_t i = 0; i < n; i++)
        fu_challenge_row_hash(c->host + (size_t)i * n, n, c->hashes + (size_t)i * FU_CHALLENGE_ROW_HASH);
    fu_challenge_commit(c->hashes, n, c->commit);
    c->computed = true;
    return FU_OK;
}

static fu_err reveal(peer_challenge_t *c, const Fusion__Challenge *ch, Fusion__ChallengeReply *r)
{
    if (!c->computed || ch->round != c->round || ch->n_rows > FU_CHALLENGE_ROWS) {
        snprintf(c->error, sizeof c->error, "REVEAL for round %u, which is not computed (or over %u rows)", ch->round,
                 FU_CHALLENGE_ROWS);
        return FU_EINVAL;
    }
    uint32_t n = c->n;
    free(c->rows);
    c->rows = fu_calloc(ch->n_rows ? ch->n_rows * (size_t)n : 1, sizeof *c->rows);
    for (size_t k = 0; k < ch->n_rows; k++) {
        if (ch->rows[k] >= n) {
            snprintf(c->error, sizeof c->error, "REVEAL of row %u of %u", ch->rows[k], n);
            return FU_EINVAL;
        }
        memcpy(c->rows + k * n, c->host + (size_t)ch->rows[k] * n, n * sizeof *c->rows);
    }
    release_matrices(c); /* the challenge is over: an idle peer keeps no 4·n² floats */
    c->computed = false;
    r->row_hashes.data = c->hashes;
    r->row_hashes.len = (size_t)n * FU_CHALLENGE_ROW_HASH;
    r->rows.data = (uint8_t *)c->rows;
    r->rows.len = ch->n_rows * (size_t)n * sizeof *c->rows;
    return FU_OK;
}

void peer_challenge_answer(peer_challenge_t *c, const Fusion__Challenge *ch, Fusion__ChallengeReply *r)
{
    fusion__challenge_reply__init(r);
    r->step = ch->step;
    r->round = ch->round;
    c->error[0] = '\0';
    fu_err rc = FU_EINVAL;
    switch (ch->step) {
    case FUSION__CHALLENGE_STEP__CHALLENGE_PREPARE:
        rc = prepare(c, ch);
        break;
    case FUSION__CHALLENGE_STEP__CHALLENGE_GO:
        if ((rc = go(c, ch)) == FU_OK) {
            r->commit.data = c->commit;
            r->commit.len = sizeof c->commit;
        }
        break;
    case FUSION__CHALLENGE_STEP__CHALLENGE_REVEAL:
        rc = reveal(c, ch, r);
        break;
    default:
        snprintf(c->error, sizeof c->error, "unknown challenge step %d", (int)ch->step);
        break;
    }
    if (rc != FU_OK) {
        if (!c->error[0])
            snprintf(c->error, sizeof c->error, "%s", fu_strerror(rc));
        FU_WARN("peer", "profile challenge round %u: %s", ch->round, c->error);
        r->error = c->error;
    }
}
