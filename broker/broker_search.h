/* broker_search: the partitioner's search of a plan over a snapshot of candidate peers, shared by a
 * queued job's plan (broker_sched.c) and growth (broker_grow.c). The snapshot is taken on the loop
 * (broker_cand_of); the search reads only it and the job's header, so the planner thread runs it;
 * the loop then checks the chosen candidates against the registry (broker_cand_peer). */
#ifndef FU_BROKER_SEARCH_H
#define FU_BROKER_SEARCH_H

#include "broker_internal.h"

/* Env var of the test hook, FOR TESTS ONLY (compiled in with FUSION_TEST_HOOKS): the planner thread
 * sleeps this many milliseconds before each search, so a test can show that the loop answers
 * heartbeats while a search runs (tests/test_broker_jobs.c). */
#define BROKER_PLAN_DELAY_ENV "FUSION_TEST_PLAN_DELAY_MS"

/* What a search knows of one candidate: copied from the registry on the loop, so that the planner
 * thread reads nothing the loop owns; the loop checks the chosen ones against the registry when the
 * search is back (broker_cand_peer). */
typedef struct {
    dag_peer_profile prof;             /* what the partitioner sees (profile_of) */
    bool trusted;                      /* may take an end stage */
    size_t at;                         /* its index in b->peers */
    char key[DB_KEY_LEN + 1];          /* ... and its key there */
    double gflops, link_bw, link_latency_ms; /* what the search saw of it */
    uint64_t mem_bytes;
    uint32_t n_slots;
} broker_cand;

/* What one search needs besides its candidates: the job (a copy of its header on the planner
 * thread: the graph, immutable while the job lives, kept while the search runs; its kind, spec
 * numbers and rules; no other pointer in it is followed) and the broker's numbers. */
typedef struct {
    broker_job *j;
    uint32_t backups;                  /* cfg.backups */
    double grow_margin;                /* cfg.grow_margin */
    dag_partition_ws *ws;              /* the searching thread's memory (NULL: each search maps its own) */
} broker_search_ctx;

/* A search of the job header view (a copy the search may change: the micro-batch count) with the
 * broker's numbers, on the planner thread's memory. */
broker_search_ctx broker_search_ctx_of(const broker_t *b, broker_job *view);

/* Copies what a search knows of p (the loop's registry) into *c. */
void broker_cand_of(const broker_t *b, const broker_peer *p, broker_cand *c);

/* The registry's peer of candidate c when it is as the search saw it: the same key at the same
 * place, live, its profile, memory, link, trust and slots unchanged. NULL otherwise. Whether it is
 * still free for the job is the caller's rule. */
broker_peer *broker_cand_peer(broker_t *b, const broker_cand *c);

/* Whether a plan of j made now keeps its ends on trusted peers: the spec says so, or it leaves it to
 * the broker and a trusted peer is registered. */
bool broker_ends_trusted_now(const broker_t *b, const broker_job *j);

/* The best plan of at most max_stages stages (0: any) over who[0..n) into *plan. */
fu_err broker_search_over(const broker_search_ctx *x, const broker_cand *who, size_t n, uint32_t max_stages,
                          bool ends_trusted, dag_plan *plan, fu_errmsg *em);

/* *best gives way to the plan with the fewest stages that it does not beat by the grow margin. */
void broker_search_fewest(const broker_search_ctx *x, const broker_cand *who, size_t n, dag_plan *best);

/* The plan of a queued job over idle peers, then spares (broker_search.c says in which order). */
fu_err broker_search_plan(const broker_search_ctx *x, const broker_cand *who, size_t n_first, size_t n_idle,
                          size_t n_spare, dag_plan *plan, size_t *n_used, fu_errmsg *em);

/* A fine-tune's micro-batch count, chosen with its plan (broker_search.c). */
bool broker_search_micro_batches(const broker_search_ctx *x, const broker_cand *who, size_t n_first, size_t n_idle,
                                 size_t n_spare, dag_plan *plan, size_t *n_used, double *best_s, double *one_s);

#endif
