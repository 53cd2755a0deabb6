/* The simulator's shared state (swarm.h): peers, jobs, clients and the loop's clocks. Owned by the
 * one thread of swarm_run; no locking. */
#ifndef FU_BENCH_SWARM_INTERNAL_H
#define FU_BENCH_SWARM_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "dag_graph.h"
#include "swarm.h"
#include "wire.h"
#include "wire_keys.h"

#define SWARM_MAX_STAGES 64  /* stages of one simulated job */
#define SWARM_POLL_MS    5   /* longest wait of one turn of the loop */
#define SWARM_HB_ASK_EVERY 5  /* as fusion-peer's PEER_HB_ASK_EVERY: one heartbeat in 5 asks for an answer */

/* ---- hardware (swarm_hw.c) ---- */

typedef struct {
    const char *name; /* "RTX 3060" */
    double gib;       /* its memory */
    double tflops;    /* f32 peak, TFLOP/s */
    double weight;    /* share of the swarm */
} swarm_gpu;

typedef struct {
    const char *name;  /* "cable 200/20" */
    double up_mbit;    /* upload, Mbit/s: the peer's sending side, what a stage's output crosses */
    double rtt_ms;     /* round trip to the broker */
    double weight;
} swarm_link;

/* A random draw of the table by weight; rng is a splitmix64 state. */
const swarm_gpu *swarm_gpu_draw(uint64_t *rng);
const swarm_link *swarm_link_draw(uint64_t *rng);
double swarm_uniform(uint64_t *rng);                  /* in [0, 1) */
double swarm_exp(uint64_t *rng, double mean);         /* exponential with that mean */

/* ---- peers ---- */

typedef enum {
    SP_OFFLINE = 0, /* no socket; rejoins at rejoin_ms */
    SP_JOINING,     /* PeerHello sent */
    SP_ONLINE,      /* welcomed */
} swarm_pstate;

typedef struct {
    uint8_t pk[WIRE_KEY_BYTES], sk[WIRE_KEY_BYTES]; /* its identity */
    char z85[WIRE_KEY_Z85_LEN + 1];
    char name[32];
    const swarm_gpu *gpu;
    const swarm_link *link;
    double gflops;          /* f32 GEMM it reports (a share of the peak) */
    uint64_t mem;           /* bytes it offers */
    void *sock;             /* DEALER, NULL when offline */
    int fd;                 /* its ZMQ_FD in the epoll set */
    swarm_pstate st;
    bool ever_joined;
    uint64_t session;       /* PeerHello.session of the current connection */
    uint64_t seq;
    uint64_t hello_ms;      /* when the current PeerHello was sent */
    uint64_t next_hb_ms, session_end_ms, rejoin_ms;
    uint32_t hb_ms;
    uint32_t hb_n;          /* heartbeats sent: one in PEER_HB_ASK_EVERY asks for an answer, as fusion-peer's */
    /* work */
    int job;                /* index into the run's jobs, -1: none */
    uint32_t stage;
    bool backup;
    uint64_t ready_ms;      /* StageReady due at this time (0: none pending) */
    bool dirty;             /* on the list of sockets to look at again (swarm_mark) */
} swarm_peer;

/* ---- jobs and clients ---- */

typedef enum {
    SJ_NEW = 0,     /* not submitted yet (or refused with ERR_BUSY: submitted again later) */
    SJ_SUBMITTED,   /* JobSubmit sent, no answer yet */
    SJ_ACKED,       /* the broker answered with its id */
    SJ_DONE,
    SJ_FAILED,
    SJ_CANCELLED,
    SJ_LOST,        /* the broker does not know it any more */
} swarm_jstate;

typedef struct {
    int client;             /* who submits it */
    char idem[32];          /* its idempotency key */
    uint64_t id;            /* the broker's id (0 before the answer) */
    swarm_jstate st;
    uint64_t submit_ms, ack_ms, retry_ms, poll_ms;
    uint64_t final_ms;      /* when the client saw it end */
    bool planned;           /* the first plan was assigned in full (plan_ms measured) */
    /* the plan as assigned to our peers */
    uint32_t n_stages;
    int stage_peer[SWARM_MAX_STAGES];   /* peer index, -1 */
    uint32_t first[SWARM_MAX_STAGES], last[SWARM_MAX_STAGES];
    uint32_t gen;           /* counts StageStarts that restarted the run */
    uint64_t start_ms;      /* the first StageStart (0: none yet) */
    double step_s_first, step_s_last; /* the simulated step time of the first and the latest start */
    dag_graph_t *g;         /* its DAG (from the first StageAssign) */
    uint64_t steps, every, batch, seq_len, micro;
    /* the running pipeline */
    bool running;
    uint64_t step;          /* the step being computed */
    uint64_t step_due_ms;   /* when it ends */
    uint64_t steps_done;    /* highest step + 1 reported */
    /* a departed stage peer: when, for the replacement and resume times */
    uint64_t lost_ms[SWARM_MAX_STAGES];
    uint64_t any_lost_ms;   /* the first departure not yet followed by a start */
} swarm_job;

typedef struct {
    uint8_t pk[WIRE_KEY_BYTES], sk[WIRE_KEY_BYTES];
    void *sock;
    int fd;
    uint64_t seq;
    bool dirty;
} swarm_client;

/* A growing list of samples (ms). */
typedef struct {
    double *v;
    size_t n, cap;
} swarm_samples;

void swarm_samples_add(swarm_samples *s, double v);
swarm_dist swarm_samples_dist(swarm_samples *s); /* sorts s */
void swarm_samples_free(swarm_samples *s);

/* The whole run. */
typedef struct swarm {
    swarm_cfg cfg;
    void *ctx;               /* one ZeroMQ context for every socket */
    int ep;                  /* epoll set over the sockets' ZMQ_FDs */
    uint8_t broker_pk[WIRE_KEY_BYTES];
    char endpoint[128];
    int n_gw;                /* gateways the peers connect through (cfg.gateways) */
    uint8_t gw_pk[SWARM_MAX_GATEWAYS][WIRE_KEY_BYTES];
    char gw_endpoint[SWARM_MAX_GATEWAYS][128];
    int gw_pid[SWARM_MAX_GATEWAYS];
    char dir[4096];          /* the scratch directory */
    char model[4200];        /* DIR/model */
    char *data;              /* the training text every job submits */
    size_t data_len;
    uint64_t rng;
    swarm_peer *peers;
    int n_peers;
    swarm_client clients[SWARM_MAX_CLIENTS];
    swarm_job *jobs;
    int n_jobs;
    bool churn;              /* peers depart and come back (load phase only) */
    bool draining;           /* the load phase is over */
    wire_counters counters;
    /* counters for the result */
    uint64_t steps_new, steps_replayed, errors;
    int departures, crashes, stage_losses;
    swarm_samples plan_ms, replace_ms, resume_ms;
    int joined;
    uint64_t next_timers_ms; /* the next turn that runs the timers (a scan of every peer) */
    int *dirty;              /* handles sent on since their last drain (room for every handle) */
    int n_dirty;
} swarm;

/* clock: monotonic milliseconds */
uint64_t swarm_now(void);

/* swarm_peer.c */
fu_err swarm_peer_connect(swarm *s, int i);
void swarm_peer_disconnect(swarm *s, int i);
void swarm_peer_on_message(swarm *s, int i, const wire_msg_t *m);
void swarm_peer_timers(swarm *s, int i, uint64_t now);
fu_err swarm_peer_send(swarm *s, int i, Fusion__MsgType t, uint64_t job, const ProtobufCMessage *body);
/* the socket of a handle (peer i >= 0, client -1 - k) and its drain */
void swarm_drain(swarm *s, int handle);
void swarm_mark(swarm *s, int handle);   /* drain it after this turn */
void swarm_drain_marked(swarm *s);

/* swarm_job.c */
void swarm_job_on_assign(swarm *s, int peer, const Fusion__StageAssign *a);
void swarm_job_on_start(swarm *s, int peer, const Fusion__StageStart *st);
void swarm_job_on_release(swarm *s, int peer, uint64_t job_id, uint32_t stage);
void swarm_job_peer_gone(swarm *s, int peer);
void swarm_job_timers(swarm *s, uint64_t now);
void swarm_client_timers(swarm *s, uint64_t now);
void swarm_client_on_message(swarm *s, int k, const wire_msg_t *m);
fu_err swarm_client_connect(swarm *s, int k);
int swarm_job_by_id(const swarm *s, uint64_t id);

#endif
