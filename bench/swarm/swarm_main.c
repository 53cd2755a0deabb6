/* bench-swarm: the command line of the swarm simulator (swarm.h). Prints "sample" JSON lines while it
 * runs and one "result" line at the end; with --compare, a run without churn first ("baseline") and
 * the goodput of the churn run relative to it (new steps per second of makespan: first submission to
 * the last job's end; and per job, goodput_jobs_ratio: the baseline's job times over the churn run's,
 * summed over the jobs, so that one slow job does not stand for all). Exit 0 when the run worked, 1 when it failed, 3 with
 * --check when a job was lost or did not finish. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "swarm.h"

static void usage(const swarm_cfg *d)
{
    printf("usage: bench-swarm [options]\n"
           "  --peers N          simulated peers (default %d, at most %d)\n"
           "  --clients K        client identities (default %d)\n"
           "  --jobs M           fine-tunes submitted at the start (default %d)\n"
           "  --job-every SEC    submit them as a stream instead, one every SEC from the start of the load\n"
           "                     phase (M x SEC should be about --duration)\n"
           "  --broker-args ARGS more fusion-broker options, e.g. \"--keep-events 5000 --keep-jobs-days 0.005\"\n"
           "  --steps S          steps of each (default %d)\n"
           "  --ckpt-every C     checkpoint every C steps (default %d)\n"
           "  --duration SEC     load phase with churn (default %.0f)\n"
           "  --drain SEC        then at most this long, no churn, for the jobs to end (default %.0f)\n"
           "  --session SEC      mean peer session (exponential; 0: no churn; default %.0f)\n"
           "  --offline SEC      mean time away before a departed peer joins again (default %.0f)\n"
           "  --clean-leave F    share of departures that say Leave (default %.2f)\n"
           "  --work-scale X     simulated FLOPs per FLOP of the cost model (default %.0f)\n"
           "  --layers L         decoder layers of the jobs' model (default %d)\n"
           "  --heartbeat-ms MS  the broker's heartbeat (default %d)\n"
           "  --backups B        the broker's --backups (default %d)\n"
           "  --join-rate R      peers connected per second at the start (default %.0f)\n"
           "  --sample SEC       a sample line this often (0: none; default %.0f)\n"
           "  --seed N           draws (default %llu)\n"
           "  --compare          run once without churn first; print goodput relative to it\n"
           "  --check            exit 3 unless every job finished and none was lost\n"
           "  --quiet            no progress on stderr\n"
           "  --plan-only R      no broker: time the broker's planning of the jobs' model over --peers drawn\n"
           "                     peers R times (the partitioner alone) and print two \"plan\" lines\n"
           "  --idle-peers N     N more peers in a second process that only join and heartbeat (too slow and\n"
           "                     too small to be planned): with --peers, up to %d connected peers in all\n"
           "  --zmtp-ping        the peers' sockets send ZMTP pings, as fusion-peer's did before its socket to the\n"
           "                     broker became quiet (the default: none, as fusion-peer now)\n"
           "  --no-zmtp-ping     no ZMTP pings (the default; kept for older scripts)\n"
           "  --loud-heartbeats  every heartbeat asks for an answer, as fusion-peer's did before (now one in 5)\n"
           "  --gateways N       N fusion-gateway processes carry the peers' connections (peer i through gateway\n"
           "                     i mod N; docs/SCALE.md \"Gateways\"); their CPU and memory are reported apart\n"
           "                     from the broker's (0: every peer connects to the broker, the default)\n",
           d->n_peers, SWARM_MAX_PEERS, d->n_clients, d->n_jobs, d->job_steps, d->ckpt_every, d->duration_s,
           d->drain_s, d->session_mean_s, d->offline_mean_s, d->clean_leave, d->work_scale, d->layers,
           d->heartbeat_ms, d->backups, d->join_rate, d->sample_s, (unsigned long long)d->seed, SWARM_MAX_PEERS);
}

int main(int argc, char **argv)
{
    if (sodium_init() < 0)
        return 1;
    signal(SIGPIPE, SIG_IGN);
    swarm_cfg cfg = swarm_cfg_default(), dflt = cfg;
    bool compare = false, check = false;
    int plan_only = 0;
    enum { O_PEERS = 256, O_CLIENTS, O_JOBS, O_STEPS, O_CKPT, O_DURATION, O_DRAIN, O_SESSION, O_OFFLINE, O_CLEAN,
           O_SCALE, O_LAYERS, O_HB, O_BACKUPS, O_JOIN, O_SAMPLE, O_SEED, O_COMPARE, O_CHECK, O_QUIET, O_HELP, O_NOPING, O_PLAN, O_PING, O_IDLE,
           O_EVERY, O_BARGS, O_LOUD, O_GATEWAYS };
    static const struct option opts[] = {
        {"peers", 1, 0, O_PEERS},       {"clients", 1, 0, O_CLIENTS},   {"jobs", 1, 0, O_JOBS},
        {"steps", 1, 0, O_STEPS},       {"ckpt-every", 1, 0, O_CKPT},   {"duration", 1, 0, O_DURATION},
        {"drain", 1, 0, O_DRAIN},       {"session", 1, 0, O_SESSION},   {"offline", 1, 0, O_OFFLINE},
        {"clean-leave", 1, 0, O_CLEAN}, {"work-scale", 1, 0, O_SCALE},  {"layers", 1, 0, O_LAYERS},
        {"heartbeat-ms", 1, 0, O_HB},   {"backups", 1, 0, O_BACKUPS},   {"join-rate", 1, 0, O_JOIN},
        {"sample", 1, 0, O_SAMPLE},     {"seed", 1, 0, O_SEED},         {"compare", 0, 0, O_COMPARE},
        {"check", 0, 0, O_CHECK},       {"quiet", 0, 0, O_QUIET},       {"help", 0, 0, O_HELP},
        {"no-zmtp-ping", 0, 0, O_NOPING}, {"plan-only", 1, 0, O_PLAN}, {"zmtp-ping", 0, 0, O_PING}, {"idle-peers", 1, 0, O_IDLE},
        {"loud-heartbeats", 0, 0, O_LOUD},  {"gateways", 1, 0, O_GATEWAYS},
        {"job-every", 1, 0, O_EVERY},   {"broker-args", 1, 0, O_BARGS},
        {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        double v = optarg ? strtod(optarg, NULL) : 0;
        switch (o) {
        case O_PEERS: cfg.n_peers = (int)v; break;
        case O_CLIENTS: cfg.n_clients = (int)v; break;
        case O_JOBS: cfg.n_jobs = (int)v; break;
        case O_STEPS: cfg.job_steps = (int)v; break;
        case O_CKPT: cfg.ckpt_every = (int)v; break;
        case O_DURATION: cfg.duration_s = v; break;
        case O_DRAIN: cfg.drain_s = v; break;
        case O_SESSION: cfg.session_mean_s = v; break;
        case O_OFFLINE: cfg.offline_mean_s = v; break;
        case O_CLEAN: cfg.clean_leave = v; break;
        case O_SCALE: cfg.work_scale = v; break;
        case O_LAYERS: cfg.layers = (int)v; break;
        case O_HB: cfg.heartbeat_ms = (int)v; break;
        case O_BACKUPS: cfg.backups = (int)v; break;
        case O_JOIN: cfg.join_rate = v; break;
        case O_SAMPLE: cfg.sample_s = v; break;
        case O_SEED: cfg.seed = strtoull(optarg, NULL, 10); break;
        case O_COMPARE: compare = true; break;
        case O_CHECK: check = true; break;
        case O_QUIET: cfg.quiet = true; break;
        case O_NOPING: cfg.zmtp_ping = false; break;
        case O_PING: cfg.zmtp_ping = true; break;
        case O_LOUD: cfg.loud_heartbeats = true; break;
        case O_IDLE: cfg.idle_peers = (int)v; break;
        case O_GATEWAYS: cfg.gateways = (int)v; break;
        case O_PLAN: plan_only = (int)v; break;
        case O_EVERY: cfg.job_every_s = v; break;
        case O_BARGS: cfg.broker_args = optarg; break;
        case O_HELP: usage(&dflt); return 0;
        default: usage(&dflt); return 2;
        }
    }
    if (plan_only > 0)
        return swarm_plan_bench(&cfg, plan_only);
    swarm_result base = {0}, r = {0};
    if (compare) {
        swarm_cfg b = cfg;
        b.session_mean_s = 0;
        if (swarm_run(&b, &base) != FU_OK) {
            fprintf(stderr, "bench-swarm: the baseline run failed\n");
            return 1;
        }
        swarm_print("baseline", &b, &base);
    }
    fu_err rc = swarm_run(&cfg, &r);
    swarm_print("result", &cfg, &r);
    if (compare)
        printf("{\"bench\":\"swarm\",\"case\":\"goodput\",\"peers\":%d,\"session_mean_s\":%.0f,"
               "\"goodput_churn\":%.3f,\"goodput_baseline\":%.3f,\"goodput_ratio\":%.3f,"
               "\"goodput_jobs_ratio\":%.3f,\"jobs_done_share\":%.3f}\n",
               cfg.n_peers, cfg.session_mean_s, r.goodput, base.goodput, base.goodput > 0 ? r.goodput / base.goodput : 0,
               r.job_s_sum > 0 && r.jobs_done == base.jobs_done ? base.job_s_sum / r.job_s_sum : 0,
               r.jobs_acked ? (double)r.jobs_done / r.jobs_acked : 0);
    if (rc != FU_OK) {
        fprintf(stderr, "bench-swarm: the run failed: %s\n", fu_strerror(rc));
        return 1;
    }
    if (check && (r.jobs_lost || r.jobs_done != cfg.n_jobs)) {
        fprintf(stderr, "bench-swarm: %d of %d jobs done, %d lost, %d failed, %d unfinished\n", r.jobs_done,
                cfg.n_jobs, r.jobs_lost, r.jobs_failed, r.jobs_unfinished);
        return 3;
    }
    return 0;
}
