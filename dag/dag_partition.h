/* dag_partition: the cost model and the partitioner. Cuts a DAG into contiguous stages and gives
 * each stage a peer, minimising the pipeline's slowest stage
 *     time(stage) = tokens·flops(stage)/speed(peer) + tokens·bytes(cut)/bandwidth(link) + latency
 * subject to each peer's memory (parameters + saved activations of M micro-batches in flight +
 * cut buffers). Peers left out of the plan are the job's backup pool. Each stage carries a
 * one-line explanation of its time, memory and why it is where it is. Pure computation: no I/O. */
#ifndef FU_DAG_PARTITION_H
#define FU_DAG_PARTITION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dag_graph.h"
#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DAG_PEER_NAME_MAX   64  /* peer label in explanations, including the NUL */
#define DAG_WHY_MAX         320 /* explanation of one stage, including the NUL */
#define DAG_PARTITION_EXACT 10  /* up to this many peers every subset and order is tried */

/* A peer's measured profile. */
typedef struct {
    char name[DAG_PEER_NAME_MAX]; /* label for explanations (identity, host) */
    double gflops;                /* sustained GEMM GFLOP/s (f32) */
    uint64_t mem_bytes;           /* memory it offers (device or host) */
    double link_bw;               /* bytes/s of its link */
    double link_latency_s;        /* one-way latency of its link, seconds */
} dag_peer_profile;

/* The search's scratch memory: its tables and its dynamic program, 2^P x cuts cells (for 80 layers
 * over 10 peers about 8 MiB). A caller that plans often keeps one, so that the memory is mapped once:
 * it grows to the largest search made and is populated when it grows, in one call, rather than
 * faulted in page by page inside a search (about 2,000 faults: 25 ms of a 30 ms first search on a
 * paravirtualized host). One thread at a time. */
typedef struct dag_partition_ws dag_partition_ws;

dag_partition_ws *dag_partition_ws_new(void);
void dag_partition_ws_free(dag_partition_ws **ws); /* NULL-safe; sets *ws = NULL */
size_t dag_partition_ws_bytes(const dag_partition_ws *ws); /* mapped now */

/* What the plan is for. */
typedef struct {
    uint32_t tokens_per_micro; /* batch × seq_len of one micro-batch */
    uint32_t micro_batches;    /* M micro-batches in flight per step (training) */
    bool training;             /* forward + backward (else forward only) */
    uint32_t max_stages;       /* most stages (0: as many as peers) */
    const bool *ends_ok;       /* per peer (in the order given): the first and the last stage (they see
                                  the tokens) go only to peers marked true; NULL: any peer */
    double act_wire_bytes;     /* bytes a value of the activations takes on the wire (the job's codec;
                                  0: 4, f32) */
    double grad_wire_bytes;    /* the same for the gradients sent back */
    uint64_t kv_positions;     /* inference: positions of KV cache held besides one forward's buffers
                                  (a serving job's sessions x context; 0: none counted apart) */
    dag_partition_ws *ws;      /* scratch memory kept between searches (NULL: the call maps its own) */
} dag_partition_opts;

/* One stage of a plan. */
typedef struct {
    size_t first, last;   /* node range [first, last) */
    size_t peer;          /* index into the profiles given */
    int32_t first_layer;  /* lowest decoder layer in the stage (DAG_NO_LAYER if none) */
    int32_t last_layer;   /* highest decoder layer in the stage */
    double compute_s;     /* estimated compute seconds per micro-batch */
    double comm_s;        /* estimated link seconds per micro-batch (cut out + gradients back) */
    double latency_s;     /* the part of comm_s that is its links' latency */
    double time_s;        /* compute_s + comm_s */
    uint64_t mem_bytes;   /* estimated peak memory on the peer */
    uint64_t cut_bytes;   /* bytes of the tensors sent to the next stage per micro-batch */
    char why[DAG_WHY_MAX]; /* explanation */
} dag_stage;

/* A plan: stages in pipeline order. */
typedef struct {
    size_t n_stages;      /* number of stages */
    dag_stage *stages;    /* n_stages entries (owned; dag_plan_free) */
    double bottleneck_s;  /* the slowest stage's time_s per micro-batch */
    double step_s;        /* estimated step time: (M + n_stages - 1) × bottleneck */
} dag_plan;

/* Estimated seconds and memory of nodes [first, last) on peer p (the cost model the partitioner
 * uses). mem_out may be NULL. */
double dag_cost_stage_time(const dag_graph_t *g, size_t first, size_t last, const dag_peer_profile *p,
                           const dag_partition_opts *o, double *compute_s, double *comm_s);
uint64_t dag_cost_stage_memory(const dag_graph_t *g, size_t first, size_t last, const dag_partition_opts *o);

/* Finds the plan with the smallest bottleneck (ties: the smallest sum of stage times, then fewer
 * stages). Every stage's memory fits its peer. Up to DAG_PARTITION_EXACT peers all subsets and
 * orders are searched; beyond that peers are ordered fastest first. Cuts fall where only the narrowest
 * tensor crosses (between decoder layers, and between a layer's attention and MLP halves).
 * FU_EINVAL on bad arguments (no peers, zero speed/bandwidth, empty graph); FU_ENOMEM with a message
 * in em (may be NULL) when no assignment fits in the peers' memory (with o->ends_ok: none that puts
 * both ends on a peer marked true). plan is filled on success
 * (dag_plan_free). */
FU_MUST_CHECK fu_err dag_partition(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                                   const dag_partition_opts *o, dag_plan *plan, fu_errmsg *em);

/* dag_partition for every stage count at once: plans[k - 1] is the best plan of at most k stages, for
 * k = 1 .. cap (and no more than o->max_stages or the peers searched; the entries past those, and
 * those of a k with no plan that fits, are left empty: n_stages 0). One search gives them all, at
 * the cost of one dag_partition. FU_OK when any of them has a plan; the errors are dag_partition's.
 * Each filled entry is the caller's (dag_plan_free). */
FU_MUST_CHECK fu_err dag_partition_each(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                                        const dag_partition_opts *o, dag_plan *plans, size_t cap, fu_errmsg *em);

/* The naive plan for comparison: every peer, in the order given, gets an equal share of the decoder
 * layers (embedding with the first, head with the last). Memory is not checked. */
FU_MUST_CHECK fu_err dag_partition_even(const dag_graph_t *g, const dag_peer_profile *peers, size_t n_peers,
                                        const dag_partition_opts *o, dag_plan *plan);

/* Seconds a micro-batch costs each stage beyond its compute and transfers (messages, smaller GEMMs):
 * what keeps the estimate below from splitting a step into ever smaller micro-batches. */
#define DAG_MICRO_OVERHEAD_S 0.0005

/* The step time of plan with M micro-batches, as a pipeline runs them: the first micro-batch's way
 * through every stage and back (each stage's compute and transfers, each link's latency), then M - 1
 * more behind the slowest stage (latency overlaps with them), each stage's time per micro-batch with
 * DAG_MICRO_OVERHEAD_S added. The plan must have been made for M (dag_partition_opts.micro_batches
 * and tokens_per_micro). */
double dag_plan_pipeline_time(const dag_plan *plan, uint32_t M);

/* Frees plan->stages; idempotent. */
void dag_plan_free(dag_plan *plan);

#ifdef __cplusplus
}
#endif
#endif
