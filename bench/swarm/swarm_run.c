/* swarm_run: the scratch directory and the broker (through the tests' cluster harness), the
 * identities, the one event loop over every socket (epoll on their ZMQ_FDs), the phases of a run
 * (join ramp, load with churn, drain) and the figures. */
#include <inttypes.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sodium.h>
#include <sqlite3.h>
#include <zmq.h>

#include "cluster.h"
#include "swarm_internal.h"
#include "swarm_stats.h"
#include "wire_socket.h"

swarm_cfg swarm_cfg_default(void)
{
    return (swarm_cfg){.n_peers = 100,
                       .n_clients = 4,
                       .n_jobs = 8,
                       .job_steps = 20,
                       .ckpt_every = 5,
                       .duration_s = 60,
                       .drain_s = 60,
                       .session_mean_s = 1800,
                       .offline_mean_s = 60,
                       .clean_leave = 0.5,
                       .work_scale = 10000,
                       .mem_per_gib = 1024 * 1024,
                       .heartbeat_ms = 1000,
                       .backups = 1,
                       .layers = 16,
                       .seed = 1,
                       .join_rate = 500,
                       .sample_s = 10,
                       .zmtp_ping = false};
}

/* The model every job fine-tunes: hidden 128, so that a layer is about 1 MiB of f32 weights. */
#define SWARM_MODEL_FMT "--layers %d --hidden 128 --heads 4 --kv-heads 2 --ffn 384 --vocab 256 --seed 5"
#define SWARM_STAGE_FIXED (32ull << 20) /* the partitioner's fixed memory per stage (a peer offers it on top) */

static fu_err make_identities(swarm *s, const char *allow)
{
    FILE *f = fopen(allow, "a");
    if (!f)
        return FU_EIO;
    for (int i = 0; i < s->n_peers; i++) {
        swarm_peer *p = &s->peers[i];
        crypto_box_keypair(p->pk, p->sk);
        wire_key_to_z85(p->pk, p->z85);
        snprintf(p->name, sizeof p->name, "sim%d", i);
        p->gpu = swarm_gpu_draw(&s->rng);
        p->link = swarm_link_draw(&s->rng);
        p->gflops = p->gpu->tflops * 1000.0 * 0.6; /* GEMM reaches about 60% of the peak */
        p->mem = SWARM_STAGE_FIXED + (uint64_t)(p->gpu->gib * s->cfg.mem_per_gib);
        p->job = -1;
        fprintf(f, "%s peer\n", p->z85);
    }
    for (int k = 0; k < s->cfg.n_clients; k++) {
        char z[WIRE_KEY_Z85_LEN + 1];
        crypto_box_keypair(s->clients[k].pk, s->clients[k].sk);
        wire_key_to_z85(s->clients[k].pk, z);
        fprintf(f, "%s client\n", z);
    }
    return fclose(f) == 0 ? FU_OK : FU_EIO;
}

static long count_events(const char *db)
{
    sqlite3 *h = NULL;
    long n = -1;
    if (sqlite3_open_v2(db, &h, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK) {
        sqlite3_stmt *st = NULL;
        if (sqlite3_prepare_v2(h, "SELECT count(*) FROM events", -1, &st, NULL) == SQLITE_OK &&
            sqlite3_step(st) == SQLITE_ROW)
            n = sqlite3_column_int64(st, 0);
        sqlite3_finalize(st);
    }
    sqlite3_close(h);
    return n;
}

/* One "job" line per job: where its time went (queued before its first start, then running), how
 * often it started again, and the simulated step time of its first and its latest plan (a job that
 * ends late after a failover on slower peers shows it there). */
static void print_jobs(const swarm *s, const swarm_cfg *cfg)
{
    for (int k = 0; k < s->n_jobs; k++) {
        const swarm_job *j = &s->jobs[k];
        double queued = j->start_ms > j->submit_ms && j->submit_ms ? (double)(j->start_ms - j->submit_ms) / 1000.0 : -1;
        double run = j->final_ms > j->start_ms && j->start_ms ? (double)(j->final_ms - j->start_ms) / 1000.0 : -1;
        printf("{\"bench\":\"swarm\",\"case\":\"job\",\"session_mean_s\":%.0f,\"job\":%d,\"done\":%s,"
               "\"stages\":%u,\"queued_s\":%.1f,\"run_s\":%.1f,\"starts\":%u,\"step_s_first\":%.3f,"
               "\"step_s_last\":%.3f}\n",
               cfg->session_mean_s, k, j->st == SJ_DONE ? "true" : "false", j->n_stages, queued, run, j->gen,
               j->step_s_first, j->step_s_last);
    }
    fflush(stdout);
}

/* A snapshot of the broker for the windows of the result. */
typedef struct {
    uint64_t ms;
    double cpu_s, sim_cpu_s, gw_cpu_s, msgs, commits;
    uint64_t hb;
} snap;

/* The gateways' CPU seconds and resident MiB, all of them together. */
static double gw_cpu_s(const swarm *s)
{
    double t = 0;
    for (int k = 0; k < s->n_gw; k++)
        t += swarm_proc_cpu_s(s->gw_pid[k]);
    return t;
}

static double gw_rss_mib(const swarm *s)
{
    double t = 0;
    for (int k = 0; k < s->n_gw; k++)
        t += swarm_proc_rss_mib(s->gw_pid[k]);
    return t;
}

static double self_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec / 1e6;
}

static snap take(const swarm *s, int pid, int port)
{
    snap x = {.ms = swarm_now(), .cpu_s = swarm_proc_cpu_s(pid), .sim_cpu_s = self_cpu_s(), .gw_cpu_s = gw_cpu_s(s)};
    char *m = swarm_http_get(port, "/metrics");
    x.hb = (uint64_t)swarm_metric(m, "fusion_heartbeats_received_total"); /* handled, answered or not */
    x.msgs = swarm_metric(m, "fusion_messages_received_total");
    x.commits = swarm_metric(m, "fusion_store_commits_total");
    free(m);
    return x;
}

/* One turn: wait for sockets (at most SWARM_POLL_MS), read what is ready, run the timers. */
static void turn(swarm *s, bool clients_on)
{
    struct epoll_event ev[256];
    int n = epoll_wait(s->ep, ev, 256, SWARM_POLL_MS);
    for (int e = 0; e < n; e++) {
        uint32_t tag = ev[e].data.u32;
        swarm_drain(s, tag < SWARM_MAX_PEERS ? (int)tag : -1 - (int)(tag - SWARM_MAX_PEERS));
    }
    swarm_drain_marked(s);
    uint64_t now = swarm_now();
    if (now < s->next_timers_ms) /* the peers' timers are looked at every SWARM_POLL_MS at most */
        return;
    s->next_timers_ms = now + SWARM_POLL_MS;
    for (int i = 0; i < s->n_peers; i++)
        swarm_peer_timers(s, i, now);
    swarm_job_timers(s, now);
    if (clients_on)
        swarm_client_timers(s, now);
    swarm_drain_marked(s);
}

static int jobs_final(const swarm *s)
{
    int n = 0;
    for (int k = 0; k < s->n_jobs; k++)
        n += s->jobs[k].st >= SJ_DONE;
    return n;
}

static void sample_line(swarm *s, int pid, int port, const char *db, double t, const char *phase, swarm_result *r)
{
    double rss = swarm_proc_rss_mib(pid), mib = swarm_store_mib(db), gw_rss = gw_rss_mib(s);
    if (rss > r->broker_rss_max_mib)
        r->broker_rss_max_mib = rss;
    if (gw_rss > r->gw_rss_max_mib)
        r->gw_rss_max_mib = gw_rss;
    if (mib > r->store_mib_max)
        r->store_mib_max = mib;
    if (s->cfg.sample_s <= 0)
        return;
    char *m = swarm_http_get(port, "/metrics");
    int online = 0;
    for (int i = 0; i < s->n_peers; i++)
        online += s->peers[i].st == SP_ONLINE;
    printf("{\"bench\":\"swarm\",\"case\":\"sample\",\"phase\":\"%s\",\"t_s\":%.1f,\"peers_online\":%d,"
           "\"broker_cpu_s\":%.2f,\"broker_rss_mib\":%.1f,\"store_mib\":%.2f,\"store_commits\":%.0f,"
           "\"messages\":%.0f,\"jobs_final\":%d,\"steps_new\":%" PRIu64 ",\"failovers\":%.0f,"
           "\"store_free_mib\":%.2f,\"events\":%.0f,\"events_archived\":%.0f,\"archive_rows\":%.0f,"
           "\"checkpoints\":%.0f,\"checkpoint_mib\":%.2f,\"jobs_ended\":%.0f,\"jobs_purged\":%.0f,"
           "\"compact_max_ms\":%.2f,\"compact_s\":%.3f,\"compact_turns\":%.0f,\"gw_cpu_s\":%.2f,"
           "\"gw_rss_mib\":%.1f}\n",
           phase, t, online, swarm_proc_cpu_s(pid), rss, mib, swarm_metric(m, "fusion_store_commits_total"),
           swarm_metric(m, "fusion_messages_received_total"), jobs_final(s), s->steps_new,
           swarm_metric(m, "fusion_failovers_total"), swarm_metric(m, "fusion_store_bytes{part=\"free\"}") / (1 << 20),
           swarm_metric(m, "fusion_store_rows{table=\"events\"}"), swarm_metric(m, "fusion_store_events_archived"),
           swarm_metric(m, "fusion_store_rows{table=\"event_archive\"}"),
           swarm_metric(m, "fusion_store_rows{table=\"checkpoints\"}"),
           swarm_metric(m, "fusion_store_bytes{part=\"checkpoints\"}") / (1 << 20),
           swarm_metric(m, "fusion_store_rows{table=\"jobs_ended\"}"),
           swarm_metric(m, "fusion_store_rows{table=\"jobs_purged\"}"),
           1e3 * swarm_metric(m, "fusion_store_compact_seconds_max"),
           swarm_metric(m, "fusion_store_compact_seconds_total"), swarm_metric(m, "fusion_store_compact_turns_total"),
           gw_cpu_s(s), gw_rss);
    fflush(stdout);
    free(m);
}

static void set_bin_dir(void)
{
    if (getenv("FUSION_BIN_DIR"))
        return;
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return;
    self[n] = '\0';
    setenv("FUSION_BIN_DIR", dirname(self), 1);
}

static fu_err setup(swarm *s, tu_cluster **cp)
{
    tu_opts o = tu_opts_default(0);
    char margs[256];
    snprintf(margs, sizeof margs, SWARM_MODEL_FMT, s->cfg.layers);
    o.model_args = margs;
    o.backups = s->cfg.backups;
    o.heartbeat_ms = s->cfg.heartbeat_ms;
    o.challenge_ms = -1; /* profiles believed: the simulated peers compute nothing */
    o.log_level = "info";
    o.word_data = true; /* the harness wants a training text; the jobs submit their own */
    o.gateways = s->cfg.gateways;
    tu_cluster *c = *cp = tu_cluster_new("swarm", &o);
    snprintf(s->dir, sizeof s->dir, "%s", tu_cluster_dir(c));
    tu_path(c, s->model, "model");
    char allow[TU_PATH];
    tu_path(c, allow, "allow");
    if (make_identities(s, allow) != FU_OK)
        return FU_EIO;
    char bargs[512];
    snprintf(bargs, sizeof bargs, "--http 127.0.0.1:0 --verify 0 --max-jobs-per-client 100000 --max-submits-per-minute "
             "100000%s%s", s->cfg.broker_args ? " " : "", s->cfg.broker_args ? s->cfg.broker_args : "");
    tu_broker_args(c, bargs);
    tu_broker_start(c);
    snprintf(s->endpoint, sizeof s->endpoint, "%s", tu_broker_endpoint(c));
    char bpk[TU_PATH];
    tu_path(c, bpk, "broker/public.key");
    if (wire_key_load_public(bpk, s->broker_pk, NULL) != FU_OK)
        return FU_EIO;
    for (int k = 0; k < s->cfg.gateways; k++) {
        tu_gateway_start(c, k);
        snprintf(s->gw_endpoint[k], sizeof s->gw_endpoint[k], "%s", tu_gateway_endpoint(c, k));
        s->gw_pid[k] = (int)tu_gateway_pid(c, k);
        tu_path(c, bpk, "gw%d/public.key", k);
        if (wire_key_load_public(bpk, s->gw_pk[k], NULL) != FU_OK)
            return FU_EIO;
    }
    s->n_gw = s->cfg.gateways;
    /* the training text: a few KiB of words */
    s->data_len = 8192;
    s->data = malloc(s->data_len);
    static const char *words[] = {"swarm ", "peer ", "broker ", "stage ", "step ", "layer ", "adapter ", "token "};
    for (size_t i = 0; i < s->data_len; i++)
        s->data[i] = words[(i / 7) % 8][i % 6];
    return FU_OK;
}

/* Says on stderr where each unfinished job stands, as the simulation sees it. */
static void show_unfinished(const swarm *s)
{
    for (int k = 0; k < s->n_jobs; k++) {
        const swarm_job *j = &s->jobs[k];
        if (j->st != SJ_ACKED && j->st != SJ_SUBMITTED && j->st != SJ_NEW)
            continue;
        fprintf(stderr, "bench-swarm: job %016" PRIx64 " unfinished: %s, %u stages, %s at step %" PRIu64
                " (%" PRIu64 " done), stage peers:", j->id, j->st == SJ_ACKED ? "acknowledged" : "not acknowledged",
                j->n_stages, j->running ? "running" : "stopped", j->step, j->steps_done);
        for (uint32_t t = 0; t < j->n_stages; t++) {
            int pi = j->stage_peer[t];
            fprintf(stderr, " %s(%s)", pi >= 0 ? s->peers[pi].name : "-",
                    pi < 0 ? "" : s->peers[pi].st == SP_ONLINE ? "online" : "away");
        }
        fprintf(stderr, "\n");
    }
}

static void collect(swarm *s, swarm_result *r)
{
    if (!s->cfg.quiet)
        show_unfinished(s);
    for (int k = 0; k < s->n_jobs; k++) {
        const swarm_job *j = &s->jobs[k];
        r->jobs_submitted += j->st != SJ_NEW || j->submit_ms;
        r->jobs_acked += j->id != 0;
        r->jobs_done += j->st == SJ_DONE;
        r->jobs_failed += j->st == SJ_FAILED;
        r->jobs_cancelled += j->st == SJ_CANCELLED;
        r->jobs_unfinished += j->st == SJ_ACKED || j->st == SJ_SUBMITTED || j->st == SJ_NEW;
        r->jobs_lost += j->st == SJ_LOST || (j->id && j->st == SJ_FAILED);
    }
    uint64_t first = 0, last = 0;
    swarm_samples jobs = {0};
    for (int k = 0; k < s->n_jobs; k++) {
        const swarm_job *j = &s->jobs[k];
        if (j->st == SJ_DONE && j->final_ms > j->submit_ms) {
            swarm_samples_add(&jobs, (double)(j->final_ms - j->submit_ms));
            r->job_s_sum += (double)(j->final_ms - j->submit_ms) / 1000.0;
        }
        if (j->submit_ms && (!first || j->submit_ms < first))
            first = j->submit_ms;
        if (j->final_ms > last)
            last = j->final_ms;
    }
    r->job_ms = swarm_samples_dist(&jobs);
    swarm_samples_free(&jobs);
    r->makespan_s = first && last > first ? (double)(last - first) / 1000.0 : 0;
    r->goodput = r->makespan_s > 0 ? (double)s->steps_new / r->makespan_s : 0;
    r->steps_new = s->steps_new;
    r->steps_replayed = s->steps_replayed;
    r->departures = s->departures;
    r->crashes = s->crashes;
    r->stage_losses = s->stage_losses;
    r->errors_seen = s->errors;
    r->peers_joined = s->joined;
    r->plan_ms = swarm_samples_dist(&s->plan_ms);
    r->replace_ms = swarm_samples_dist(&s->replace_ms);
    r->resume_ms = swarm_samples_dist(&s->resume_ms);
}

/* The second process of --idle-peers: the identities after the parent's own, each joining at the
 * ramp's rate and heartbeating until the parent kills it (or dies). Its own libzmq context and epoll
 * set: nothing of the parent's is touched after the fork. */
static _Noreturn void idle_process(swarm *s)
{
    (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
    s->peers += s->cfg.n_peers;
    s->n_peers = s->cfg.idle_peers;
    s->n_jobs = 0;
    s->churn = false;
    s->ctx = zmq_ctx_new();
    (void)zmq_ctx_set(s->ctx, ZMQ_MAX_SOCKETS, s->n_peers + 16);
    s->ep = epoll_create1(EPOLL_CLOEXEC);
    uint64_t t0 = swarm_now();
    for (int i = 0; i < s->n_peers; i++) {
        swarm_peer *p = &s->peers[i];
        p->gflops = 1.0;      /* never among the fastest candidates */
        p->mem = 1u << 20;    /* and no stage fits */
        p->rejoin_ms = t0 + 1 + (uint64_t)(1000.0 * i / s->cfg.join_rate);
    }
    for (;;)
        turn(s, false);
}

fu_err swarm_run(const swarm_cfg *cfg, swarm_result *out)
{
    memset(out, 0, sizeof *out);
    if (cfg->n_peers < 1 || cfg->idle_peers < 0 || cfg->n_peers + cfg->idle_peers > SWARM_MAX_PEERS || cfg->n_clients < 1 ||
        cfg->n_clients > SWARM_MAX_CLIENTS || cfg->n_jobs < 0 || cfg->n_jobs > SWARM_MAX_JOBS || cfg->job_steps < 1 ||
        cfg->ckpt_every < 1 || cfg->heartbeat_ms < 50 || cfg->layers < 1 || cfg->join_rate <= 0 ||
        cfg->gateways < 0 || cfg->gateways > SWARM_MAX_GATEWAYS)
        return FU_EINVAL;
    set_bin_dir();
    tu_fail_exits();
    swarm *s = calloc(1, sizeof *s);
    s->cfg = *cfg;
    s->rng = cfg->seed * 0x9E3779B97F4A7C15ull + 7;
    s->n_peers = cfg->n_peers + cfg->idle_peers; /* identities for both processes; the parent keeps its own */
    s->peers = calloc((size_t)s->n_peers, sizeof *s->peers);
    s->n_jobs = cfg->n_jobs;
    s->jobs = calloc((size_t)(s->n_jobs ? s->n_jobs : 1), sizeof *s->jobs);
    s->dirty = calloc((size_t)(s->n_peers + SWARM_MAX_CLIENTS), sizeof *s->dirty);
    s->ep = epoll_create1(EPOLL_CLOEXEC);
    s->ctx = zmq_ctx_new();
    (void)zmq_ctx_set(s->ctx, ZMQ_MAX_SOCKETS, s->n_peers + SWARM_MAX_CLIENTS + 16);
    tu_cluster *c = NULL;
    fu_err rc = setup(s, &c);
    pid_t idle_pid = -1;
    if (rc == FU_OK && cfg->idle_peers > 0) {
        fflush(stdout);
        if ((idle_pid = fork()) == 0)
            idle_process(s);
        if (idle_pid < 0)
            rc = FU_EIO;
    }
    s->n_peers = cfg->n_peers;
    if (rc != FU_OK)
        goto done;
    int pid = (int)tu_broker_pid(c), port = tu_metrics_port(c);
    char db[TU_PATH];
    tu_path(c, db, "store.db");
    for (int k = 0; k < s->n_jobs; k++) {
        s->jobs[k].client = k % cfg->n_clients;
        snprintf(s->jobs[k].idem, sizeof s->jobs[k].idem, "swarm-%d", k);
        for (int t = 0; t < SWARM_MAX_STAGES; t++)
            s->jobs[k].stage_peer[t] = -1;
    }
    /* the join ramp */
    uint64_t t0 = swarm_now();
    for (int i = 0; i < s->n_peers; i++)
        s->peers[i].rejoin_ms = t0 + 1 + (uint64_t)(1000.0 * i / cfg->join_rate);
    uint64_t ramp_end = t0 + (uint64_t)(1000.0 * s->n_peers / cfg->join_rate) + 30000;
    while (s->joined < s->n_peers && swarm_now() < ramp_end)
        turn(s, false);
    if (!cfg->quiet)
        fprintf(stderr, "bench-swarm: %d of %d peers joined in %.1f s\n", s->joined, s->n_peers,
                (double)(swarm_now() - t0) / 1000.0);
    for (int k = 0; k < cfg->n_clients; k++)
        if ((rc = swarm_client_connect(s, k)) != FU_OK)
            goto done;
    /* the load phase: jobs submitted at once, churn on */
    s->churn = cfg->session_mean_s > 0;
    uint64_t l0 = swarm_now(), lend = l0 + (uint64_t)(cfg->duration_s * 1000), half = l0 + (lend - l0) / 2;
    uint64_t next_sample = l0;
    if (cfg->job_every_s > 0) /* a stream: job k waits until its time (swarm_client_timers) */
        for (int k = 0; k < s->n_jobs; k++)
            s->jobs[k].retry_ms = l0 + (uint64_t)(1000.0 * cfg->job_every_s * k);
    snap a = take(s, pid, port), h = a;
    bool half_taken = false;
    while (swarm_now() < lend) {
        turn(s, true);
        uint64_t now = swarm_now();
        if (!half_taken && now >= half) {
            h = take(s, pid, port);
            half_taken = true;
        }
        if (now >= next_sample) {
            sample_line(s, pid, port, db, (double)(now - l0) / 1000.0, "load", out);
            next_sample = now + (uint64_t)(cfg->sample_s > 0 ? cfg->sample_s * 1000 : 5000);
        }
    }
    snap z = take(s, pid, port);
    double wall = (double)(z.ms - a.ms) / 1000.0, hw = (double)(z.ms - h.ms) / 1000.0;
    out->run_s = wall;
    out->broker_cpu = (z.cpu_s - a.cpu_s) / wall;
    out->broker_cpu_steady = (z.cpu_s - h.cpu_s) / hw;
    out->sim_cpu = (z.sim_cpu_s - a.sim_cpu_s) / wall;
    out->hb_per_s = (double)(z.hb - h.hb) / hw;
    out->msgs_per_s = (z.msgs - h.msgs) / hw;
    out->commits_per_s = (z.commits - a.commits) / wall;
    out->broker_rss_mib = swarm_proc_rss_mib(pid);
    out->gw_cpu = (z.gw_cpu_s - a.gw_cpu_s) / wall;
    out->gw_rss_mib = gw_rss_mib(s);
    out->steps_per_s = (double)s->steps_new / wall;
    for (int i = 0; i < s->n_peers; i++)
        out->peers_online_end += s->peers[i].st == SP_ONLINE;
    {
        char *m = swarm_http_get(port, "/metrics");
        static const char *live[] = {"idle", "stage", "backup", "paused", "draining"};
        for (size_t k = 0; k < sizeof live / sizeof live[0]; k++) {
            char name[64];
            snprintf(name, sizeof name, "fusion_peers{state=\"%s\"}", live[k]);
            out->broker_peers_end += (int)swarm_metric(m, name);
        }
        free(m);
    }
    sample_line(s, pid, port, db, wall, "load-end", out);
    /* drain: churn off, the unfinished jobs may end */
    s->churn = false;
    s->draining = true;
    uint64_t dend = swarm_now() + (uint64_t)(cfg->drain_s * 1000);
    while (swarm_now() < dend && jobs_final(s) < s->n_jobs)
        turn(s, true);
    out->store_mib_end = swarm_store_mib(db);
    {
        char *m = swarm_http_get(port, "/metrics");
        out->events_archived_end = swarm_metric(m, "fusion_store_events_archived");
        out->ckpts_end = swarm_metric(m, "fusion_store_rows{table=\"checkpoints\"}");
        out->jobs_purged_end = swarm_metric(m, "fusion_store_rows{table=\"jobs_purged\"}");
        out->turn_max_ms = 1e3 * swarm_metric(m, "fusion_loop_turn_seconds_max");
        out->turns_slow = swarm_metric(m, "fusion_loop_turns_slow_total");
        free(m);
    }
    sample_line(s, pid, port, db, (double)(swarm_now() - l0) / 1000.0, "drain-end", out);
    collect(s, out);
    print_jobs(s, cfg);
    {
        char log[TU_PATH];
        snprintf(log, sizeof log, "%s", tu_broker_log(c));
        swarm_plan_log pl = {0}; /* the broker's own planning times */
        swarm_log_plans(log, &pl);
        out->plan_broker_ms = swarm_samples_dist(&pl.plan);
        out->plan_search_ms = swarm_samples_dist(&pl.search);
        out->plan_first_ms = swarm_samples_dist(&pl.first);
        out->plan_again_ms = swarm_samples_dist(&pl.again);
        out->cut_ms = swarm_samples_dist(&pl.cut);
        swarm_plan_log_free(&pl);
    }
done:
    if (idle_pid > 0) {
        kill(idle_pid, SIGKILL);
        (void)waitpid(idle_pid, NULL, 0);
    }
    for (int i = 0; i < s->n_peers; i++)
        if (s->peers[i].sock)
            swarm_peer_disconnect(s, i);
    for (int k = 0; k < SWARM_MAX_CLIENTS; k++)
        wire_socket_close(&s->clients[k].sock);
    zmq_ctx_term(s->ctx);
    if (c) {
        char db2[TU_PATH];
        tu_path(c, db2, "store.db");
        if (tu_broker_stop(c, SIGTERM) != 0)
            rc = rc == FU_OK ? FU_EIO : rc;
        out->events_end = (double)count_events(db2);
        if (tu_cluster_stop(&c) != FU_OK)
            rc = rc == FU_OK ? FU_EIO : rc;
    }
    for (int k = 0; k < s->n_jobs; k++)
        dag_graph_destroy(&s->jobs[k].g);
    swarm_samples_free(&s->plan_ms);
    swarm_samples_free(&s->replace_ms);
    swarm_samples_free(&s->resume_ms);
    close(s->ep);
    free(s->data);
    free(s->dirty);
    free(s->jobs);
    sodium_memzero(s->peers, (size_t)s->n_peers * sizeof *s->peers);
    free(s->peers);
    free(s);
    return rc;
}

static void dist(const char *name, const swarm_dist *d)
{
    printf(",\"%s_n\":%zu,\"%s_p50\":%.1f,\"%s_p99\":%.1f,\"%s_max\":%.1f", name, d->n, name, d->p50, name, d->p99,
           name, d->max);
}

void swarm_print(const char *name, const swarm_cfg *cfg, const swarm_result *r)
{
    printf("{\"bench\":\"swarm\",\"case\":\"%s\",\"peers\":%d,\"clients\":%d,\"jobs\":%d,\"job_steps\":%d,"
           "\"duration_s\":%.0f,\"session_mean_s\":%.0f,\"heartbeat_ms\":%d,\"layers\":%d,\"backups\":%d,"
           "\"idle_peers\":%d,\"peers_joined\":%d,\"peers_online_end\":%d,\"broker_peers_end\":%d,"
           "\"run_s\":%.1f,\"broker_cpu\":%.3f,"
           "\"broker_cpu_steady\":%.3f,\"sim_cpu\":%.3f,\"broker_rss_mib\":%.1f,\"broker_rss_max_mib\":%.1f,"
           "\"heartbeats_per_s\":%.1f,\"broker_msgs_per_s\":%.1f,\"gateways\":%d,\"gw_cpu\":%.3f,\"gw_rss_mib\":%.1f,"
           "\"gw_rss_max_mib\":%.1f",
           name, cfg->n_peers, cfg->n_clients, cfg->n_jobs, cfg->job_steps, cfg->duration_s, cfg->session_mean_s,
           cfg->heartbeat_ms, cfg->layers, cfg->backups, cfg->idle_peers, r->peers_joined, r->peers_online_end,
           r->broker_peers_end, r->run_s,
           r->broker_cpu, r->broker_cpu_steady, r->sim_cpu, r->broker_rss_mib, r->broker_rss_max_mib, r->hb_per_s,
           r->msgs_per_s, cfg->gateways, r->gw_cpu, r->gw_rss_mib, r->gw_rss_max_mib);
    dist("plan_ms", &r->plan_ms);
    dist("plan_broker_ms", &r->plan_broker_ms);
    dist("plan_search_ms", &r->plan_search_ms);
    dist("plan_first_ms", &r->plan_first_ms);
    dist("plan_again_ms", &r->plan_again_ms);
    dist("cut_ms", &r->cut_ms);
    dist("replace_ms", &r->replace_ms);
    dist("resume_ms", &r->resume_ms);
    dist("job_ms", &r->job_ms);
    int acked = r->jobs_acked ? r->jobs_acked : 1;
    printf(",\"jobs_submitted\":%d,\"jobs_acked\":%d,\"jobs_done\":%d,\"jobs_failed\":%d,\"jobs_cancelled\":%d,"
           "\"jobs_unfinished\":%d,\"jobs_lost\":%d,\"jobs_done_share\":%.3f,\"makespan_s\":%.1f,\"goodput_steps_per_s\":%.3f,"
           "\"steps_new\":%" PRIu64
           ",\"steps_replayed\":%" PRIu64 ",\"steps_per_s\":%.2f,\"departures\":%d,\"crashes\":%d,"
           "\"stage_losses\":%d,\"store_commits_per_s\":%.1f,\"store_mib_end\":%.2f,\"store_mib_max\":%.2f,"
           "\"events_end\":%.0f,\"events_archived_end\":%.0f,\"checkpoints_end\":%.0f,\"jobs_purged_end\":%.0f,"
           "\"loop_turn_max_ms\":%.1f,\"loop_turns_slow\":%.0f,\"errors_seen\":%" PRIu64 "}\n",
           r->jobs_submitted, r->jobs_acked, r->jobs_done, r->jobs_failed, r->jobs_cancelled, r->jobs_unfinished,
           r->jobs_lost, (double)r->jobs_done / acked, r->makespan_s, r->goodput, r->steps_new, r->steps_replayed, r->steps_per_s, r->departures,
           r->crashes, r->stage_losses, r->commits_per_s, r->store_mib_end, r->store_mib_max, r->events_end,
           r->events_archived_end, r->ckpts_end, r->jobs_purged_end, r->turn_max_ms, r->turns_slow, r->errors_seen);
    fflush(stdout);
}
