/* broker_losshist: fine-tunes' loss curves in memory (see broker_losshist.h). */
#include "broker_losshist.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fu_alloc.h"

#define LOSSES_ID_MAX 64 /* a job id and its NUL, at most */

struct broker_losshist {
    broker_loss_point *pts; /* n of them, increasing steps; all but the last on the stride */
    size_t n, cap;
    uint64_t stride; /* steps 1, 1 + stride, ... are kept */
};

typedef struct {
    char job[LOSSES_ID_MAX];
    broker_losshist *h;
    uint64_t ended; /* 0 while the job runs; else the order it ended in (1, 2, ...) */
} losses_entry;

struct broker_losses {
    losses_entry *e; /* n of them, in no order */
    size_t n, cap;
    size_t points; /* each curve's capacity */
    size_t keep;   /* ended curves kept */
    uint64_t ends; /* ends seen: the next ended order */
};

/* ---- one curve ---------------------------------------------------------------------------------- */

broker_losshist *broker_losshist_new(size_t cap)
{
    broker_losshist *h = fu_calloc(1, sizeof *h);
    h->cap = cap < BROKER_LOSSHIST_MIN ? BROKER_LOSSHIST_MIN : cap;
    h->pts = fu_calloc(h->cap, sizeof *h->pts);
    h->stride = 1;
    return h;
}

void broker_losshist_destroy(broker_losshist **h_p)
{
    if (!h_p || !*h_p)
        return;
    free((*h_p)->pts);
    free(*h_p);
    *h_p = NULL;
}

static bool on_stride(uint64_t step, uint64_t stride)
{
    return (step - 1) % stride == 0;
}

/* Keeps every other point of a full curve and doubles its stride, until it has room; a stride that
 * cannot double any more (2^63 steps: never in practice) drops the oldest point instead. */
static void make_room(broker_losshist *h)
{
    while (h->n >= h->cap) {
        if (h->stride > UINT64_MAX / 2) {
            memmove(h->pts, h->pts + 1, (h->n - 1) * sizeof *h->pts);
            h->n--;
            break;
        }
        h->stride *= 2;
        size_t w = 0;
        for (size_t i = 0; i < h->n; i++)
            if (on_stride(h->pts[i].step, h->stride))
                h->pts[w++] = h->pts[i];
        h->n = w;
    }
}

void broker_losshist_add(broker_losshist *h, uint64_t step, double loss)
{
    if (step == 0 || !isfinite(loss))
        return;
    while (h->n > 0 && h->pts[h->n - 1].step >= step) /* a replay: the run from that step on again */
        h->n--;
    if (h->n > 0 && !on_stride(h->pts[h->n - 1].step, h->stride)) /* the newest, off the stride */
        h->n--;
    make_room(h);
    h->pts[h->n++] = (broker_loss_point){.step = step, .loss = loss};
}

const broker_loss_point *broker_losshist_points(const broker_losshist *h, size_t *n)
{
    *n = h->n;
    return h->pts;
}

uint64_t broker_losshist_stride(const broker_losshist *h)
{
    return h->stride;
}

/* ---- the set ------------------------------------------------------------------------------------ */

broker_losses *broker_losses_new(size_t points, size_t ended)
{
    broker_losses *l = fu_calloc(1, sizeof *l);
    l->points = points;
    l->keep = ended;
    return l;
}

void broker_losses_destroy(broker_losses **l_p)
{
    if (!l_p || !*l_p)
        return;
    broker_losses *l = *l_p;
    for (size_t i = 0; i < l->n; i++)
        broker_losshist_destroy(&l->e[i].h);
    free(l->e);
    free(l);
    *l_p = NULL;
}

static losses_entry *entry_of(const broker_losses *l, const char *job)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->e[i].job, job) == 0)
            return &l->e[i];
    return NULL;
}

static void entry_drop(broker_losses *l, losses_entry *e)
{
    broker_losshist_destroy(&e->h);
    *e = l->e[--l->n];
}

void broker_losses_add(broker_losses *l, const char *job, uint64_t step, double loss)
{
    if (step == 0 || !isfinite(loss) || strlen(job) >= LOSSES_ID_MAX)
        return;
    losses_entry *e = entry_of(l, job);
    if (!e) {
        if (l->n == l->cap) {
            l->cap = l->cap ? 2 * l->cap : 16;
            l->e = fu_realloc(l->e, l->cap * sizeof *l->e);
        }
        e = &l->e[l->n++];
        snprintf(e->job, sizeof e->job, "%s", job);
        e->h = broker_losshist_new(l->points);
        e->ended = 0;
    }
    broker_losshist_add(e->h, step, loss);
}

const broker_losshist *broker_losses_find(const broker_losses *l, const char *job)
{
    const losses_entry *e = entry_of(l, job);
    return e ? e->h : NULL;
}

void broker_losses_ended(broker_losses *l, const char *job)
{
    losses_entry *e = entry_of(l, job);
    if (!e || e->ended)
        return;
    e->ended = ++l->ends;
    size_t n_ended = 0;
    losses_entry *oldest = NULL;
    for (size_t i = 0; i < l->n; i++) {
        if (!l->e[i].ended)
            continue;
        n_ended++;
        if (!oldest || l->e[i].ended < oldest->ended)
            oldest = &l->e[i];
    }
    if (n_ended > l->keep && oldest)
        entry_drop(l, oldest);
}

size_t broker_losses_count(const broker_losses *l)
{
    return l->n;
}
