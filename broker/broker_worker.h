/* broker_worker: one thread that runs slow work off the broker's loop (docs/SECURITY.md
 * "Isolation"): opening and hashing models, building a job's DAG, tokenizing its data. The loop
 * posts a task, goes on answering heartbeats, and takes the task back when its wake fd is readable.
 *
 * A task is the caller's struct with a broker_task first: run() is called on the worker thread and
 * must touch nothing the loop owns; done() is called on the loop when it takes the task back (it
 * finishes the work there and frees the task); drop() frees a task that will never come back (the
 * worker is freed first). Tasks run one at a time, in the order posted. */
#ifndef FU_BROKER_WORKER_H
#define FU_BROKER_WORKER_H

#include <stdbool.h>
#include <stddef.h>

#include "fu_err.h"

typedef struct broker_task broker_task;
struct broker_task {
    void (*run)(broker_task *t);       /* on the worker thread */
    void (*done)(broker_task *t, void *loop); /* on the loop, with its state (the broker): finishes, frees */
    void (*drop)(broker_task *t);      /* frees a task never taken back */
    broker_task *next;                 /* the worker's */
};

typedef struct broker_worker broker_worker;

/* Starts the thread; at most `depth` tasks wait or run at once. NULL with why. */
broker_worker *broker_worker_new(size_t depth, fu_errmsg *em);
/* Stops after the task running now, drops every other task, joins. Sets *w = NULL. */
void broker_worker_free(broker_worker **w);

/* Queues t; false (t not taken) when `depth` tasks are already queued or running. */
bool broker_worker_post(broker_worker *w, broker_task *t);
/* A task whose run() finished, oldest first, or NULL. The caller owns it again. */
broker_task *broker_worker_take(broker_worker *w);
/* Readable while finished tasks wait to be taken (poll it; broker_worker_take drains it). */
int broker_worker_fd(const broker_worker *w);

/* A test hook, FOR TESTS ONLY: a task's run() sleeps the milliseconds environment variable `env`
 * names, so that a test can act while the task runs (the loop answers meanwhile). Nothing without
 * FUSION_TEST_HOOKS. */
void broker_task_test_delay(const char *env);

#endif
