/* broker_worker: the loop's helper thread (see broker_worker.h). An eventfd tells the loop that
 * finished tasks wait; two singly linked FIFOs hold the queued and the finished ones. */
#include "broker_worker.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "fu_alloc.h"
#include "fu_clock.h"

typedef struct {
    broker_task *head, *tail;
} fifo;

struct broker_worker {
    pthread_mutex_t mu;
    pthread_cond_t cv;                 /* a task was queued, or stop */
    fifo queued, done;
    size_t busy, depth;                /* posted and not taken back; the most allowed */
    bool stop;
    int efd;                           /* eventfd: readable while `done` is not empty */
    pthread_t thread;
};

static void push(fifo *f, broker_task *t)
{
    t->next = NULL;
    if (f->tail)
        f->tail->next = t;
    else
        f->head = t;
    f->tail = t;
}

static broker_task *pop(fifo *f)
{
    broker_task *t = f->head;
    if (t) {
        f->head = t->next;
        if (!f->head)
            f->tail = NULL;
        t->next = NULL;
    }
    return t;
}

static void *worker_main(void *arg)
{
    broker_worker *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stop && !w->queued.head)
            pthread_cond_wait(&w->cv, &w->mu);
        if (w->stop)
            break;
        broker_task *t = pop(&w->queued);
        pthread_mutex_unlock(&w->mu);
        t->run(t);
        pthread_mutex_lock(&w->mu);
        push(&w->done, t);
        uint64_t one = 1;
        ssize_t r = write(w->efd, &one, sizeof one);
        (void)r; /* the counter cannot overflow at these rates; a failure only delays the wake */
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

broker_worker *broker_worker_new(size_t depth, fu_errmsg *em)
{
    broker_worker *w = fu_calloc(1, sizeof *w);
    w->depth = depth ? depth : 1;
    w->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->efd < 0) {
        fu_errmsg_set(em, FU_EIO, "cannot make an eventfd: %s", strerror(errno));
        free(w);
        return NULL;
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    int e = pthread_create(&w->thread, NULL, worker_main, w);
    if (e != 0) {
        fu_errmsg_set(em, FU_EIO, "cannot start the preparation thread: %s", strerror(e));
        close(w->efd);
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return NULL;
    }
    return w;
}

void broker_task_test_delay(const char *env)
{
#ifdef FUSION_TEST_HOOKS
    const char *ms = getenv(env);
    if (ms && atoi(ms) > 0)
        fu_sleep_ms((uint32_t)atoi(ms));
#else
    (void)env;
#endif
}

void broker_worker_free(broker_worker **wp)
{
    if (!wp || !*wp)
        return;
    broker_worker *w = *wp;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    broker_task *t;
    while ((t = pop(&w->queued)) != NULL)
        t->drop(t);
    while ((t = pop(&w->done)) != NULL)
        t->drop(t);
    close(w->efd);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
    *wp = NULL;
}

bool broker_worker_post(broker_worker *w, broker_task *t)
{
    pthread_mutex_lock(&w->mu);
    bool ok = w->busy < w->depth;
    if (ok) {
        w->busy++;
        push(&w->queued, t);
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return ok;
}

broker_task *broker_worker_take(broker_worker *w)
{
    uint64_t n;
    ssize_t r = read(w->efd, &n, sizeof n); /* reset the wake; more may be pushed after: they write again */
    (void)r;
    pthread_mutex_lock(&w->mu);
    broker_task *t = pop(&w->done);
    if (t)
        w->busy--;
    bool more = w->done.head != NULL;
    pthread_mutex_unlock(&w->mu);
    if (more) { /* keep the fd readable for the ones left */
        uint64_t one = 1;
        r = write(w->efd, &one, sizeof one);
        (void)r;
    }
    return t;
}

int broker_worker_fd(const broker_worker *w)
{
    return w->efd;
}

