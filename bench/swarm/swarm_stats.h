/* swarm_stats: reading the broker from outside: its process (/proc), its /metrics, its store files
 * and its log. Every function is stateless; strings returned are the caller's to free. */
#ifndef FU_BENCH_SWARM_STATS_H
#define FU_BENCH_SWARM_STATS_H

#include "swarm_internal.h"

/* CPU seconds (user + system) process pid has used, -1 when it cannot be read. */
double swarm_proc_cpu_s(int pid);

/* Its resident set, MiB, -1 when it cannot be read. */
double swarm_proc_rss_mib(int pid);

/* The body of GET path on 127.0.0.1:port (caller frees), NULL on failure (5 s timeouts). */
char *swarm_http_get(int port, const char *path);

/* The value of the Prometheus sample named exactly `name` (labels included) in text, -1 when absent. */
double swarm_metric(const char *text, const char *name);

/* MiB of the SQLite file db and its -wal file. */
double swarm_store_mib(const char *db);

/* What the broker's log says of its plans, in ms. */
typedef struct {
    swarm_samples plan;   /* "job ... planned over N candidates in X ms (S stages; ...": every plan */
    swarm_samples search; /* "...; the search Y ms ...": its search, on the planner thread */
    swarm_samples first;  /* the plans of jobs planned for the first time (submissions) */
    swarm_samples again;  /* the plans of jobs planned before (failover, growth) */
    swarm_samples cut;    /* "... stored with the plan off the loop in Z ms": a re-plan's checkpoint cut
                             and commit on the cutter thread */
} swarm_plan_log;

/* Reads log into pl (its samples added to); swarm_plan_log_free frees them. */
void swarm_log_plans(const char *log, swarm_plan_log *pl);
void swarm_plan_log_free(swarm_plan_log *pl);

#endif
