/* broker_challenge: a peer's claimed speed is capped by a timed computation the broker checks
 * (docs/SECURITY.md "Verified profiles", docs/PROTOCOL.md "Profile challenge", common/fu_challenge.h).
 *
 * A new registration gets a challenge sized so that C = rmsnorm(A, d)·B takes --challenge-ms at the
 * speed its profile claims. PREPARE (A and B from a seed: not timed), then GO (d from a second seed:
 * the clock runs until the commitment to C's row hashes arrives), then REVEAL (every row hash and
 * FU_CHALLENGE_ROWS rows chosen after the commitment). The broker checks the commitment, each row's
 * hash and FU_CHALLENGE_CHECKS entries of each row in O(n) apiece. Plans then use
 * min(claimed, BROKER_CHALLENGE_SLACK x measured): the slack covers an honest peer's overheads (making
 * d, the copy of C to the host, hashing it, the link's round trip), and a peer that skips part of the
 * product is caught with probability 1 - (share computed)^FU_CHALLENGE_ROWS.
 *
 * Until it passes, a peer gets no work (broker_peer_trusted). A wrong answer fails the registration
 * and costs BROKER_CHALLENGE_PENALTY; a step not answered within BROKER_CHALLENGE_STEP_MS is tried
 * again after BROKER_CHALLENGE_RETRY_MS (a busy honest machine is not punished). */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "broker_internal.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_log.h"

#define LOG "challenge"

_Static_assert((int)BCH_PREPARING == (int)FUSION__CHALLENGE_STEP__CHALLENGE_PREPARE &&
                   (int)BCH_COMPUTING == (int)FUSION__CHALLENGE_STEP__CHALLENGE_GO &&
                   (int)BCH_REVEALING == (int)FUSION__CHALLENGE_STEP__CHALLENGE_REVEAL,
               "a peer's challenge state names the step whose answer it waits for");

static void send_step(broker_t *b, broker_peer *p, Fusion__ChallengeStep step)
{
    Fusion__Challenge c = FUSION__CHALLENGE__INIT;
    c.step = step;
    c.round = p->ch_round;
    if (step == FUSION__CHALLENGE_STEP__CHALLENGE_PREPARE) {
        c.n = p->ch_n;
        c.seed.data = p->ch_seed;
        c.seed.len = sizeof p->ch_seed;
    } else if (step == FUSION__CHALLENGE_STEP__CHALLENGE_GO) {
        c.seed.data = p->ch_go;
        c.seed.len = sizeof p->ch_go;
    } else {
        c.rows = p->ch_rows;
        c.n_rows = FU_CHALLENGE_ROWS;
    }
    p->ch_sent_ns = fu_clock_ns();
    if (broker_send_peer(b, p, FUSION__MSG_TYPE__MSG_CHALLENGE, 0, &c.base) != FU_OK)
        FU_WARN(LOG, "cannot send the challenge to peer %.8s", p->key);
}

/* Plans use min(claimed, slack x verified) from now on; the store keeps it with the session. */
static void pass(broker_t *b, broker_peer *p, const char *how)
{
    p->ch = BCH_PASSED;
    double cap = BROKER_CHALLENGE_SLACK * p->verified_gflops;
    p->gflops = p->verified_gflops > 0 && cap < p->claimed_gflops ? cap : p->claimed_gflops;
    char text[200];
    snprintf(text, sizeof text, "claimed %.1f GFLOP/s, measured %.1f (%s): plans use %.1f", p->claimed_gflops,
             p->verified_gflops, how, p->gflops);
    FU_INFO(LOG, "peer %s (%.8s): %s", p->name, p->key, text);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), NULL, p->key, "profile-verified", text));
    broker_peer_store_profile(b, p);
    b->sched_dirty = true;
    broker_recover_ready(b);
}

static void fail(broker_t *b, broker_peer *p, bool penalise, const char *why)
{
    p->ch = BCH_FAILED;
    FU_WARN(LOG, "peer %s (%.8s) failed its profile challenge: %s; it gets no work until it registers again",
            p->name, p->key, why);
    BROKER_IGNORE(db_event_add(b->db, broker_wall(), NULL, p->key, "profile-challenge-failed", why));
    if (penalise)
        broker_peer_reputation_adjust(b, p, -BROKER_CHALLENGE_PENALTY);
}

void broker_challenge_start(broker_t *b, broker_peer *p)
{
    if (!b->cfg.challenge_ms) {
        p->verified_gflops = 0;
        pass(b, p, "challenges off");
        return;
    }
    if (p->verified_gflops > 0) { /* this very process passed before the broker restarted */
        pass(b, p, "remembered from this session");
        return;
    }
    p->ch_round = ++b->ch_rounds;
    p->ch_n = fu_challenge_size(p->claimed_gflops, b->cfg.challenge_ms / 1000.0, p->mem_bytes / 2);
    randombytes_buf(p->ch_seed, sizeof p->ch_seed);
    p->ch = BCH_PREPARING;
    p->ch_retry_ms = 0;
    FU_DEBUG(LOG, "peer %.8s: challenge %u, n = %u", p->key, p->ch_round, p->ch_n);
    send_step(b, p, FUSION__CHALLENGE_STEP__CHALLENGE_PREPARE);
}

/* Checks the REVEAL answer; NULL when right, else why not. */
static const char *check_reveal(const broker_peer *p, const Fusion__ChallengeReply *r)
{
    uint32_t n = p->ch_n;
    if (r->row_hashes.len != (size_t)n * FU_CHALLENGE_ROW_HASH || r->rows.len != (size_t)FU_CHALLENGE_ROWS * n * 4)
        return "the reveal has the wrong size";
    uint8_t commit[FU_CHALLENGE_COMMIT];
    fu_challenge_commit(r->row_hashes.data, n, commit);
    if (sodium_memcmp(commit, p->ch_commit, sizeof commit) != 0)
        return "the row hashes do not match the commitment";
    float *row = fu_malloc((size_t)n * sizeof *row);
    const char *why = NULL;
    for (uint32_t k = 0; k < FU_CHALLENGE_ROWS && !why; k++) {
        memcpy(row, r->rows.data + (size_t)k * n * sizeof *row, (size_t)n * sizeof *row);
        uint8_t h[FU_CHALLENGE_ROW_HASH];
        fu_challenge_row_hash(row, n, h);
        if (sodium_memcmp(h, r->row_hashes.data + (size_t)p->ch_rows[k] * FU_CHALLENGE_ROW_HASH, sizeof h) != 0)
            why = "a revealed row does not match its committed hash";
        else if (!fu_challenge_check_row(p->ch_seed, p->ch_go, n, p->ch_rows[k], row, p->ch_pick))
            why = "a revealed row is not the product";
    }
    free(row);
    return why;
}

void broker_on_challenge_reply(broker_t *b, broker_peer *p, const wire_msg_t *msg)
{
    const Fusion__ChallengeReply *r = wire_msg_body_as(msg, FUSION__MSG_TYPE__MSG_CHALLENGE_REPLY);
    uint64_t now_ns = fu_clock_ns();
    if (!r || r->round != p->ch_round || p->ch < BCH_PREPARING || p->ch > BCH_REVEALING ||
        (int)r->step != (int)p->ch) { /* BCH_PREPARING..REVEALING are numbered as the steps they wait on */
        FU_DEBUG(LOG, "peer %.8s: a challenge reply out of turn ignored", p->key);
        return;
    }
    if (r->error && r->error[0]) {
        char why[300];
        snprintf(why, sizeof why, "the peer could not take it: %.200s", r->error);
        fail(b, p, false, why);
        return;
    }
    switch (p->ch) {
    case BCH_PREPARING:
        randombytes_buf(p->ch_go, sizeof p->ch_go);
        p->ch = BCH_COMPUTING;
        send_step(b, p, FUSION__CHALLENGE_STEP__CHALLENGE_GO);
        break;
    case BCH_COMPUTING: {
        if (r->commit.len != FU_CHALLENGE_COMMIT) {
            fail(b, p, true, "the commitment is not 32 bytes");
            return;
        }
        double el = (double)(now_ns - p->ch_sent_ns) / 1e9;
        p->verified_gflops = fu_challenge_flops(p->ch_n) / fmax(el, 1e-6) / 1e9;
        memcpy(p->ch_commit, r->commit.data, sizeof p->ch_commit);
        /* Rows to reveal, chosen only now: distinct when n allows (it always does: n >= 128). */
        for (uint32_t k = 0; k < FU_CHALLENGE_ROWS; k++) {
            bool again;
            do {
                p->ch_rows[k] = randombytes_uniform(p->ch_n);
                again = false;
                for (uint32_t q = 0; q < k; q++)
                    again = again || p->ch_rows[q] == p->ch_rows[k];
            } while (again);
        }
        randombytes_buf(&p->ch_pick, sizeof p->ch_pick);
        p->ch = BCH_REVEALING;
        send_step(b, p, FUSION__CHALLENGE_STEP__CHALLENGE_REVEAL);
        break;
    }
    case BCH_REVEALING: {
        const char *why = check_reveal(p, r);
        if (why) {
            p->verified_gflops = 0;
            fail(b, p, true, why);
            return;
        }
        char how[64];
        snprintf(how, sizeof how, "n = %u", p->ch_n);
        pass(b, p, how);
        break;
    }
    default:
        break;
    }
}

void broker_challenge_sweep(broker_t *b)
{
    uint64_t now = broker_now(), now_ns = fu_clock_ns();
    for (size_t i = 0; i < b->n_peers; i++) {
        broker_peer *p = &b->peers[i];
        if (!p->live)
            continue;
        if (p->ch == BCH_NONE && p->ch_retry_ms && now >= p->ch_retry_ms) {
            broker_challenge_start(b, p);
        } else if (p->ch >= BCH_PREPARING && p->ch <= BCH_REVEALING &&
                   now_ns - p->ch_sent_ns > (uint64_t)BROKER_CHALLENGE_STEP_MS * 1000000u) {
            FU_WARN(LOG, "peer %s (%.8s) did not answer its profile challenge within %u s; trying again in %u s",
                    p->name, p->key, BROKER_CHALLENGE_STEP_MS / 1000, BROKER_CHALLENGE_RETRY_MS / 1000);
            BROKER_IGNORE(db_event_add(b->db, broker_wall(), NULL, p->key, "profile-challenge-timeout", ""));
            p->ch = BCH_NONE;
            p->verified_gflops = 0;
            p->ch_retry_ms = now + BROKER_CHALLENGE_RETRY_MS;
        }
    }
}
