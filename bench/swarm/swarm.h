/* bench-swarm: N simulated peers and K clients against the real fusion-broker process (docs/SCALE.md).
 *
 * One process, one thread: the broker is started by the tests' cluster harness (tests/cluster.h) on
 * loopback with a temporary store, keys and allow-list; every simulated peer has its own CURVE key
 * pair and its own DEALER socket (one TCP connection, one identity) and speaks the peer protocol
 * (PeerHello, Heartbeat, StageReady, StepDone, CheckpointPut, Leave); clients submit fine-tunes and
 * poll their status. Stage work is a timer from the job's DAG cost model and the peer's drawn
 * hardware. Sockets are watched by one epoll set over their ZMQ_FD (swarm_run.c), so a turn of the
 * loop costs what is ready, not N.
 *
 * Ownership: swarm_run owns everything it makes and frees it before returning; the result is the
 * caller's (plain values). Not thread-safe; one run at a time per process. */
#ifndef FU_BENCH_SWARM_H
#define FU_BENCH_SWARM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fu_err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SWARM_MAX_PEERS   20000 /* simulated peers in one run (two file descriptors each) */
#define SWARM_MAX_CLIENTS 64    /* client identities */
#define SWARM_MAX_JOBS    4096  /* jobs submitted in one run */
#define SWARM_MAX_GATEWAYS 8    /* --gateways (the cluster harness's TU_MAX_GATEWAYS) */

/* What a run does. swarm_cfg_default gives the values documented in bench-swarm --help. */
typedef struct {
    int n_peers;            /* simulated peers */
    int n_clients;          /* client identities (K) */
    int n_jobs;             /* fine-tunes submitted, spread over the clients (M): all at the start, or one
                               every job_every_s */
    double job_every_s;     /* > 0: a continuous stream, job k submitted job_every_s x k after the start of the
                               load phase (the store sees hours of work); 0: all at the start */
    const char *broker_args; /* more fusion-broker arguments (space-separated), or NULL */
    int idle_peers;         /* --idle-peers N: N more peers, simulated by a second (forked) process, that only
                               join and heartbeat: too slow and too small to be planned, they load the broker as
                               any connected peer does. Each simulated peer takes two descriptors of its
                               process, so two processes carry twice as many (10,000 in all on this machine) */
    int job_steps;          /* steps of each fine-tune */
    int ckpt_every;         /* its checkpoint_every */
    double duration_s;      /* churn and load run this long */
    double drain_s;         /* then up to this long (churn stopped) for the unfinished jobs to end */
    double session_mean_s;  /* mean online session of a peer (exponential); 0: no churn */
    double offline_mean_s;  /* mean time a departed peer stays away before it joins again */
    double clean_leave;     /* share of departures that send Leave (the rest vanish: a crash) */
    double work_scale;      /* simulated FLOPs per FLOP of the model's cost estimate (a tiny model
                               standing in for a large one) */
    double mem_per_gib;     /* bytes a peer offers per GiB of its GPU, on top of the 32 MiB the partitioner
                               reserves per stage: small, so that the small model needs several stages as a
                               large one would on these cards */
    int heartbeat_ms;       /* the broker's --heartbeat-ms */
    int backups;            /* the broker's --backups */
    int layers;             /* decoder layers of the model the jobs fine-tune */
    uint64_t seed;          /* hardware, sessions and churn draws */
    double join_rate;       /* peers connected per second at the start (ramp) */
    double sample_s;        /* a "sample" line this often (0: none) */
    bool quiet;             /* no progress lines on stderr */
    bool zmtp_ping;         /* --zmtp-ping: the peers' sockets send ZMTP pings, as fusion-peer's did before its
                               socket to the broker became quiet (wire_socket_quiet); off (the default, as
                               fusion-peer now) spares the broker a walk over its connections' timers per
                               message and the simulator's one I/O thread its own */
    int gateways;           /* --gateways N: fusion-gateway processes carry the peers' connections (peer i
                               through gateway i mod N), the broker holds one connection per gateway; the
                               clients connect to the broker; 0: none */
    bool loud_heartbeats;   /* --loud-heartbeats: heartbeats ask for an answer, as fusion-peer's did before
                               Heartbeat.quiet (the answers were half of the broker's messages) */
} swarm_cfg;

/* A latency distribution, milliseconds. */
typedef struct {
    size_t n;
    double p50, p99, max;
} swarm_dist;

/* What a run measured (docs/SCALE.md says how each is measured). */
typedef struct {
    int peers_joined;           /* distinct peers welcomed at least once */
    int peers_online_end;       /* online at the end of the load phase */
    int broker_peers_end;       /* live peers the broker counts at the end of the load phase (idle ones included) */
    double run_s;               /* load phase as it ran */
    double broker_cpu;          /* broker CPU seconds / wall seconds over the load phase (1.0 = one core) */
    double broker_cpu_steady;   /* ... over the second half of it */
    double sim_cpu;             /* this process's share over the same time */
    double broker_rss_mib;      /* broker resident memory at the end of the load phase */
    double broker_rss_max_mib;  /* the most seen during the run */
    double gw_cpu;              /* the gateways' CPU seconds (all of them) / wall seconds over the load phase */
    double gw_rss_mib;          /* their resident memory (all of them) at the end of the load phase */
    double gw_rss_max_mib;      /* the most seen during the run */
    double hb_per_s;            /* heartbeats answered per second (second half of the load phase) */
    double msgs_per_s;          /* messages the broker handled per second (its own counter, same window) */
    swarm_dist plan_ms;         /* JobSubmit's answer -> every stage of the first plan assigned */
    swarm_dist plan_broker_ms;  /* the broker's own planning pass time per job (fusion_plan_seconds) */
    swarm_dist plan_search_ms;  /* the part of it that was the search (candidates and partitioner), not
                                   storing the plan */
    swarm_dist plan_first_ms;   /* plan_broker_ms of jobs planned for the first time (submissions) */
    swarm_dist plan_again_ms;   /* plan_broker_ms of jobs planned again (failover, growth) */
    swarm_dist cut_ms;          /* a re-plan's checkpoint cut and stored with its plan, off the loop */
    swarm_dist replace_ms;      /* a stage's peer departs -> that stage assigned to another peer */
    swarm_dist resume_ms;       /* a stage's peer departs -> the job's stages told to start again */
    swarm_dist job_ms;          /* a finished job's submission -> the client seeing it done */
    double job_s_sum;           /* the sum of those, seconds: --compare's per-job goodput divides them */
    int jobs_submitted, jobs_acked, jobs_done, jobs_failed, jobs_cancelled, jobs_unfinished;
    int jobs_lost;              /* acknowledged, then unknown to the broker or failed */
    double steps_per_s;         /* new (not replayed) steps per second over the load phase */
    double makespan_s;          /* first submission -> the last job seen final (the clients poll every second) */
    double goodput;             /* new steps per second of makespan: what --compare divides */
    uint64_t steps_new, steps_replayed;
    int departures, crashes, stage_losses; /* peers that left or vanished; those that held a stage */
    double commits_per_s;       /* store commits per second over the load phase */
    double store_mib_end;       /* store file + WAL at the end */
    double store_mib_max;
    double events_end;          /* rows in the events table at the end (from the store) */
    double events_archived_end; /* events the store's archive accounts for at the end */
    double ckpts_end;           /* checkpoint rows at the end */
    double jobs_purged_end;     /* jobs whose artifacts the broker deleted (--keep-jobs-days) */
    double turn_max_ms;         /* the broker loop's longest turn (fusion_loop_turn_seconds_max) */
    double turns_slow;          /* its turns of 100 ms or more (fusion_loop_turns_slow_total) */
    uint64_t errors_seen;       /* Error messages the broker sent the simulated peers and clients */
} swarm_result;

/* The defaults of bench-swarm. */
swarm_cfg swarm_cfg_default(void);

/* Runs the swarm: makes the scratch directory (keys, allow-list, model), starts the broker, joins
 * the peers, submits the jobs, runs cfg->duration_s then drains, stops the broker and removes the
 * directory (kept when FUSION_TEST_KEEP is set). Prints "sample" JSON lines on stdout while it runs
 * (cfg->sample_s). FU_EINVAL on a bad configuration, FU_EIO when the broker or a socket failed (the
 * message on stderr). */
FU_MUST_CHECK fu_err swarm_run(const swarm_cfg *cfg, swarm_result *out);

/* Prints r as one JSON line {"bench":"swarm","case":name,...} with the configuration. */
void swarm_print(const char *name, const swarm_cfg *cfg, const swarm_result *r);

/* --plan-only: no broker, no sockets; the broker's planning of the jobs' model over cfg->n_peers
 * drawn peers, `repeats` times (swarm_plan.c). Prints the "plan" and "plan_measured" lines; 0, or 1 on bad arguments. */
int swarm_plan_bench(const swarm_cfg *cfg, int repeats);

#ifdef __cplusplus
}
#endif

#endif
