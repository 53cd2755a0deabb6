/* `fusion serve`: the serving jobs the gateway holds (docs/SERVE.md "Serving jobs"). With --sessions
 * N each model name it serves (the base model, each NAME:JOB) gets one serving job of N sessions,
 * submitted by the first request that names it; every request is then a session of that job, so
 * concurrent requests share one pipeline and its stages batch them. A job that ended (cancelled by
 * its owner elsewhere, failed) is forgotten and the next request submits another. The gateway
 * cancels its jobs when it stops. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_jobs.h"
#include "cli_serve.h"

uint64_t serve_job_for(serve_t *s, cli_conn_t *c, const char *adapter, int *code, char *err, size_t cap)
{
    pthread_mutex_lock(&s->jobs_mu); /* one submission per model name, the others wait for it */
    serve_sjob *sj = NULL, *free_slot = NULL;
    for (size_t i = 0; i < SERVE_JOBS_MAX && !sj; i++) {
        if (s->jobs[i].job && strcmp(s->jobs[i].adapter, adapter) == 0)
            sj = &s->jobs[i];
        else if (!s->jobs[i].job && !free_slot)
            free_slot = &s->jobs[i];
    }
    uint64_t job = sj ? sj->job : 0;
    if (!job && !free_slot) {
        *code = FUSION__ERROR_CODE__ERR_BUSY;
        snprintf(err, cap, "this gateway holds serving jobs for %d model names, its most", SERVE_JOBS_MAX);
    } else if (!job) {
        dag_spec sp;
        dag_spec_init(&sp, DAG_JOB_INFER);
        snprintf(sp.model, sizeof sp.model, "%s", s->spec_model);
        snprintf(sp.adapter_job, sizeof sp.adapter_job, "%s", adapter);
        sp.sessions = s->sessions;
        sp.context = s->context;
        sp.max_tokens = s->max_tokens;
        sp.idle_s = s->idle_s; /* a gateway that is killed leaves no job holding the peers for ever */
        char *spec = dag_spec_to_json(&sp);
        dag_spec_clear(&sp);
        char idem[SERVE_IDEM_LEN];
        serve_idem_new(idem);
        wire_msg_t *m = NULL;
        int exit_code;
        if (cli_job_submit(c, FUSION__JOB_KIND__JOB_KIND_INFER, spec, NULL, 0, idem, &m, &exit_code) == FU_OK) {
            job = ((const Fusion__JobStatus *)wire_msg_body(m))->job_id;
            snprintf(free_slot->adapter, sizeof free_slot->adapter, "%s", adapter);
            free_slot->job = job;
            fprintf(stderr, "%s: serving job %016" PRIx64 " for %s%s%s: %u sessions of %u positions\n", s->prog, job,
                    s->name, adapter[0] ? ":" : "", adapter, s->sessions, s->context);
        } else {
            snprintf(err, cap, "%s", cli_conn_last_error(c, code));
        }
        wire_msg_destroy(&m);
        free(spec);
    }
    pthread_mutex_unlock(&s->jobs_mu);
    return job;
}

void serve_job_gone(serve_t *s, uint64_t job)
{
    pthread_mutex_lock(&s->jobs_mu);
    for (size_t i = 0; i < SERVE_JOBS_MAX; i++)
        if (s->jobs[i].job == job) {
            fprintf(stderr, "%s: serving job %016" PRIx64 " ended; the next request submits another\n", s->prog, job);
            s->jobs[i].job = 0;
        }
    pthread_mutex_unlock(&s->jobs_mu);
}

void serve_jobs_cancel_all(serve_t *s)
{
    cli_conn_t *c = NULL;
    pthread_mutex_lock(&s->jobs_mu);
    for (size_t i = 0; i < SERVE_JOBS_MAX; i++) {
        if (!s->jobs[i].job)
            continue;
        int code;
        if (!c && !(c = serve_conn_get(s)))
            break;
        if (cli_job_cancel(c, s->jobs[i].job, &code) == FU_OK)
            fprintf(stderr, "%s: serving job %016" PRIx64 " cancelled\n", s->prog, s->jobs[i].job);
        s->jobs[i].job = 0;
    }
    pthread_mutex_unlock(&s->jobs_mu);
    serve_conn_put(s, c, false);
}
