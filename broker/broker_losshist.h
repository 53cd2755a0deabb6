/* broker_losshist: the loss curves of fine-tunes, kept in memory for the dashboard and
 * GET /api/jobs/JOB/loss (docs/BROKER.md "The JSON API").
 *
 * A curve (broker_losshist) holds the loss of each step as a StepDone reported it, bounded: at most
 * `cap` points. It starts with stride 1 (every step). When it is full, it keeps every other point
 * (the steps s with (s - 1) % (2 × stride) == 0) and doubles the stride, so a long run keeps an even
 * coverage of its whole length in at most `cap` points: steps 1, 1 + stride, 1 + 2 × stride, ...,
 * plus the newest step whatever its place (replaced by the next one when it is off the stride). A step
 * at or before the newest one (a job that recovered from a checkpoint replays its steps) first drops
 * every point from that step on, so the curve is the one the run took. Steps count from 1, as the
 * `step` of /api/jobs does (the number of steps done once it is); a loss that is not finite is not
 * kept.
 *
 * The set (broker_losses) holds one curve per job, by job id: made at the job's first step, kept
 * while the job runs and, once it ended, among the BROKER_LOSSES_ENDED curves of the jobs that ended
 * last (the oldest ended one is dropped first). Memory only: a broker restart starts every curve
 * again from the step the job resumes at.
 *
 * Loop thread only; nothing here is thread-safe. */
#ifndef FU_BROKER_LOSSHIST_H
#define FU_BROKER_LOSSHIST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BROKER_LOSSHIST_POINTS 1024 /* points a job's curve keeps at most (16 KiB) */
#define BROKER_LOSSHIST_MIN    2    /* the smallest capacity a curve may be given */
#define BROKER_LOSSES_ENDED    32   /* curves of ended jobs kept, the newest ended */

typedef struct {
    uint64_t step; /* 1 for the first step */
    double loss;   /* as StepDone reported it */
} broker_loss_point;

typedef struct broker_losshist broker_losshist;

/* A new empty curve of at most cap points (at least BROKER_LOSSHIST_MIN), stride 1. Aborts without
 * memory (fu_malloc). */
broker_losshist *broker_losshist_new(size_t cap);

/* Frees *h_p and sets it to NULL; idempotent. */
void broker_losshist_destroy(broker_losshist **h_p);

/* Records the loss of step (≥ 1) as described above; step 0 and a loss that is not finite are
 * ignored. */
void broker_losshist_add(broker_losshist *h, uint64_t step, double loss);

/* The points in increasing step order (borrowed: valid until the next add or destroy), their count
 * in *n. */
const broker_loss_point *broker_losshist_points(const broker_losshist *h, size_t *n);

/* The steps between two kept points (1, 2, 4, ...), the newest point aside. */
uint64_t broker_losshist_stride(const broker_losshist *h);

typedef struct broker_losses broker_losses;

/* An empty set whose curves hold at most points points each and which keeps the curves of the
 * `ended` jobs that ended last. Aborts without memory. */
broker_losses *broker_losses_new(size_t points, size_t ended);

/* Frees *l_p and every curve, sets it to NULL; idempotent. */
void broker_losses_destroy(broker_losses **l_p);

/* Records the loss of job's step (broker_losshist_add), making the job's curve at its first step.
 * job is a job id (copied, at most 63 bytes). */
void broker_losses_add(broker_losses *l, const char *job, uint64_t step, double loss);

/* Job's curve (borrowed: valid until the next call that changes l), NULL when it has none. */
const broker_losshist *broker_losses_find(const broker_losses *l, const char *job);

/* Job ended (done, failed, cancelled): its curve, if any, is kept among the ended ones; the curve of
 * the job that ended longest ago is dropped when there are more than the set keeps. */
void broker_losses_ended(broker_losses *l, const char *job);

/* Curves held (running and ended jobs), for tests. */
size_t broker_losses_count(const broker_losses *l);

#ifdef __cplusplus
}
#endif
#endif
