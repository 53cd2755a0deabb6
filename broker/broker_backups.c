/* broker_backups: the backup pool. Each running job keeps up to --backups warm backups, idle peers
 * that hold a stage's weights and take it over on a failover (broker_failover.c), and that verify
 * their stage's outputs when the job is verified (broker_verify.c). */
#include <stdint.h>
#include <string.h>

#include "broker_internal.h"
#include "fu_log.h"

#define LOG "sched"

/* Stage whose peer is most likely to be lost: the one heard from longest ago. */
static uint32_t likely_loss(broker_t *b, const broker_job *j)
{
    uint32_t best = 0;
    uint64_t oldest = UINT64_MAX;
    for (uint32_t s = 0; s < j->n_stages; s++) {
        broker_peer *p = broker_peer_find(b, j->stages[s].peer);
        uint64_t t = p ? p->last_heard_ms : 0;
        if (t < oldest) {
            oldest = t;
            best = s;
        }
    }
    return best;
}

/* Whether p may back up stage k of j: it fits, and it is not a slot of the peer process that runs
 * the stage (the same machine fails with it, and cannot verify it). */
static bool may_back_up(broker_t *b, const broker_job *j, uint32_t k, const broker_peer *p)
{
    return broker_peer_fits(j, k, p) && !broker_peer_same_key(broker_peer_find(b, j->stages[k].peer), p);
}

/* The stage idle peer p would back up for j, or UINT32_MAX when it can hold none: `likely` (the stage
 * likeliest lost), or with verification the stage with the fewest backups (n_back: j's live backups
 * per stage). */
static uint32_t backup_stage(broker_t *b, const broker_job *j, const broker_peer *p, uint32_t likely, bool verify,
                             const uint32_t *n_back)
{
    uint32_t s = likely;
    if (verify) {
        /* Verification wants a warm backup of every stage (a verifier), then a second of each (a
         * third opinion): the stage with the fewest backups gets the next one (ties: the lowest
         * index). Any backup still takes over any stage on a failover (broker_failover). */
        uint32_t fewest = UINT32_MAX;
        for (uint32_t k = 0; k < j->n_stages; k++) {
            if (n_back[k] < fewest && may_back_up(b, j, k, p)) {
                fewest = n_back[k];
                s = k;
            }
        }
    }
    if (may_back_up(b, j, s, p))
        return s;
    for (uint32_t k = 0; k < j->n_stages; k++) /* a backup for a stage it can hold, or none */
        if (may_back_up(b, j, k, p))
            return k;
    return UINT32_MAX;
}

/* Tops up j's warm backups from the idle peers, the fastest first: a backup that takes over a stage
 * sets the pace of the whole pipeline from then on, so a slow one made a job that lost a stage end
 * far behind the others (docs/SCALE.md, goodput). Peers within BROKER_BACKUP_SPEED_TIE of each
 * other's speed count as equal (the registry's order decides), so that measurements' noise does not
 * reorder like machines. One pass over the peers per backup, O(stages) per candidate. */
void broker_give_backups(broker_t *b, broker_job *j)
{
    uint32_t n_back[BROKER_MAX_STAGES] = {0}, have = 0;
    for (size_t i = 0; i < b->n_peers; i++) {
        const broker_peer *p = &b->peers[i];
        if (p->live && p->backup && strcmp(p->job, j->id) == 0) {
            have++;
            if (p->stage < BROKER_MAX_STAGES)
                n_back[p->stage]++;
        }
    }
    if (have >= b->cfg.backups)
        return;
    uint32_t likely = likely_loss(b, j);
    bool verify = broker_job_verify_fraction(b, j) > 0;
    for (; have < b->cfg.backups; have++) {
        broker_peer *best = NULL;
        uint32_t s = UINT32_MAX;
        for (size_t i = 0; i < b->n_peers; i++) {
            broker_peer *p = &b->peers[i];
            if (!broker_peer_idle(b, p) || (best && p->gflops <= best->gflops * (1.0 + BROKER_BACKUP_SPEED_TIE)) ||
                broker_job_excludes(j, p->key))
                continue;
            uint32_t k = backup_stage(b, j, p, likely, verify, n_back);
            if (k != UINT32_MAX) {
                best = p;
                s = k;
            }
        }
        if (!best)
            return;
        broker_peer_take(b, best, j, s, true);
        if (broker_send_assign(b, j, s, best, true) != FU_OK) {
            broker_peer_forget_work(best);
            return; /* its socket refuses now: the next round tries again */
        }
        FU_INFO(LOG, "job %s: peer %.8s (%s) is a warm backup for stage %u", j->id, best->key, best->name, s);
        n_back[s]++;
    }
}
