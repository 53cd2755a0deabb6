/* broker_metrics: Prometheus text of the broker's state (see broker_metrics.h). */
#include "broker_metrics.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "broker_internal.h"

/* "# HELP" and "# TYPE" lines of one metric family. */
static void family(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void peers(FILE *f, const broker_t *b)
{
    enum { IDLE, STAGE, BACKUP, PAUSED, DRAINING, GONE, N };
    static const char *const names[N] = {"idle", "stage", "backup", "paused", "draining", "gone"};
    uint64_t n[N] = {0};
    for (size_t i = 0; i < b->n_peers; i++) {
        const broker_peer *p = &b->peers[i];
        n[!p->live ? GONE : p->paused ? PAUSED : p->draining ? DRAINING : !p->job[0] ? IDLE : p->backup ? BACKUP : STAGE]++;
    }
    family(f, "fusion_peers", "gauge", "Peers the broker knows, by state (gone: registered, not live).");
    for (int s = 0; s < N; s++)
        fprintf(f, "fusion_peers{state=\"%s\"} %" PRIu64 "\n", names[s], n[s]);
}

static void jobs(FILE *f, broker_t *b)
{
    int64_t counts[DB_N_JOB_STATES];
    if (db_job_counts(b->db, counts) == FU_OK) {
        family(f, "fusion_jobs", "gauge", "Jobs in the store, by state.");
        for (int s = 0; s < DB_N_JOB_STATES; s++)
            fprintf(f, "fusion_jobs{state=\"%s\"} %" PRId64 "\n", db_job_state_name((db_job_state)s), counts[s]);
    }
    static const char *const phases[] = {"queued", "starting", "running", "recover_wait"};
    uint64_t n[4] = {0};
    uint64_t v[4] = {b->tot.v_agree, b->tot.v_disagree, b->tot.v_mismatch, b->tot.v_skipped};
    for (size_t i = 0; i < b->n_jobs; i++) {
        const broker_job *j = b->jobs[i];
        if (!j->dead && (unsigned)j->phase < 4)
            n[j->phase]++;
        v[0] += j->v_agree;
        v[1] += j->v_disagree;
        v[2] += j->v_mismatch;
        v[3] += j->v_skipped;
    }
    family(f, "fusion_jobs_active", "gauge", "Unfinished jobs the scheduler holds, by phase.");
    for (int p = 0; p < 4; p++)
        fprintf(f, "fusion_jobs_active{phase=\"%s\"} %" PRIu64 "\n", phases[p], n[p]);
    family(f, "fusion_verify_samples_total", "counter",
           "Verification samples by outcome (disagreed: a stage's output was found wrong; mismatch: two "
           "accounts of its input differed).");
    static const char *const outcomes[] = {"agreed", "disagreed", "mismatch", "skipped"};
    for (int k = 0; k < 4; k++)
        fprintf(f, "fusion_verify_samples_total{outcome=\"%s\"} %" PRIu64 "\n", outcomes[k], v[k]);
}

/* The store's size, what fills it and what compaction removed (docs/STORE.md "Compaction"). */
static void store(FILE *f, broker_t *b)
{
    db_store_stats st;
    /* the figures that read every job row: at most once a minute */
    bool deep = !b->store_deep_ms || broker_now() - b->store_deep_ms >= 60000;
    if (db_store_stats_get(b->db, deep, &st) == FU_OK) {
        if (deep) {
            b->store_deep_ms = broker_now();
            b->store_ended = st.jobs_ended;
            b->store_purged = st.jobs_purged;
        }
        st.jobs_ended = b->store_ended;
        st.jobs_purged = b->store_purged;
        family(f, "fusion_store_bytes", "gauge",
               "The store's main file (pages x page size), of it the free pages, and the checkpoints' bytes.");
        fprintf(f, "fusion_store_bytes{part=\"file\"} %" PRId64 "\n", st.pages * st.page_size);
        fprintf(f, "fusion_store_bytes{part=\"free\"} %" PRId64 "\n", st.free_pages * st.page_size);
        fprintf(f, "fusion_store_bytes{part=\"checkpoints\"} %" PRId64 "\n", st.checkpoint_bytes);
        family(f, "fusion_store_rows", "gauge", "Rows in the store: events, archive days, checkpoints, ended jobs and of them the purged.");
        fprintf(f, "fusion_store_rows{table=\"events\"} %" PRId64 "\n", st.events);
        fprintf(f, "fusion_store_rows{table=\"event_archive\"} %" PRId64 "\n", st.archive_rows);
        fprintf(f, "fusion_store_rows{table=\"checkpoints\"} %" PRId64 "\n", st.checkpoints);
        fprintf(f, "fusion_store_rows{table=\"jobs_ended\"} %" PRId64 "\n", st.jobs_ended);
        fprintf(f, "fusion_store_rows{table=\"jobs_purged\"} %" PRId64 "\n", st.jobs_purged);
        family(f, "fusion_store_events_archived", "gauge", "Events the archive accounts for (all time).");
        fprintf(f, "fusion_store_events_archived %" PRId64 "\n", st.archived_events);
    }
    const db_compact_stats *c = &b->tot.compacted;
    family(f, "fusion_store_compacted_total", "counter", "What compaction removed since the broker started.");
    fprintf(f, "fusion_store_compacted_total{what=\"events\"} %" PRId64 "\n", c->events_archived);
    fprintf(f, "fusion_store_compacted_total{what=\"checkpoints\"} %" PRId64 "\n", c->ckpts_dropped);
    fprintf(f, "fusion_store_compacted_total{what=\"jobs\"} %" PRId64 "\n", c->jobs_purged);
    fprintf(f, "fusion_store_compacted_total{what=\"pages\"} %" PRId64 "\n", c->pages_vacuumed);
    family(f, "fusion_store_compact_seconds_total", "counter", "Seconds compaction took, in all.");
    fprintf(f, "fusion_store_compact_seconds_total %.6f\n", c->seconds);
    family(f, "fusion_store_compact_turns_total", "counter", "Compaction turns (once a second, more while work is left).");
    fprintf(f, "fusion_store_compact_turns_total %" PRIu64 "\n", b->tot.compact_turns);
    family(f, "fusion_store_compact_seconds_max", "gauge", "The longest compaction turn since the broker started.");
    fprintf(f, "fusion_store_compact_seconds_max %.6f\n", b->tot.compact_s_max);
}

char *broker_metrics_text(broker_t *b, size_t *len)
{
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (!f)
        return NULL;
    peers(f, b);
    jobs(f, b);
    const broker_totals *t = &b->tot;
    family(f, "fusion_steps_total", "counter", "Fine-tune steps reported done.");
    fprintf(f, "fusion_steps_total %" PRIu64 "\n", t->steps);
    family(f, "fusion_step_seconds_total", "counter",
           "Seconds those steps took (rate over fusion_steps_total: the mean step time).");
    fprintf(f, "fusion_step_seconds_total %.6f\n", t->step_s_sum);
    family(f, "fusion_trained_tokens_total", "counter", "Tokens the fine-tune steps trained on (rate: tokens/s).");
    fprintf(f, "fusion_trained_tokens_total %" PRIu64 "\n", t->trained_tokens);
    family(f, "fusion_generated_tokens_total", "counter", "Tokens inference jobs generated.");
    fprintf(f, "fusion_generated_tokens_total %" PRIu64 "\n", t->generated_tokens);
    uint64_t open = 0;
    for (size_t i = 0; i < b->n_jobs; i++)
        open += b->jobs[i]->dead ? 0 : broker_serve_open_count(b->jobs[i]);
    family(f, "fusion_sessions_open", "gauge", "Serving jobs' sessions generating now.");
    fprintf(f, "fusion_sessions_open %" PRIu64 "\n", open);
    family(f, "fusion_sessions_total", "counter",
           "Serving jobs' sessions opened, and ended: done, failed, or closed (by their client or their job's end).");
    fprintf(f, "fusion_sessions_total{event=\"opened\"} %" PRIu64 "\n", t->sessions_opened);
    fprintf(f, "fusion_sessions_total{event=\"done\"} %" PRIu64 "\n", t->sessions_done);
    fprintf(f, "fusion_sessions_total{event=\"failed\"} %" PRIu64 "\n", t->sessions_failed);
    fprintf(f, "fusion_sessions_total{event=\"closed\"} %" PRIu64 "\n", t->sessions_closed);
    family(f, "fusion_plans_total", "counter", "Jobs planned (a plan over the idle peers assigned).");
    fprintf(f, "fusion_plans_total %" PRIu64 "\n", t->plans);
    family(f, "fusion_plans_failed_total", "counter", "Planning searches that found no plan that fits (the job waits).");
    fprintf(f, "fusion_plans_failed_total %" PRIu64 "\n", t->plans_failed);
    family(f, "fusion_plans_skipped_total", "counter",
           "Searches not made: a waiting job's candidates were those of its last failed search.");
    fprintf(f, "fusion_plans_skipped_total %" PRIu64 "\n", t->plans_skipped);
    family(f, "fusion_plans_stale_total", "counter",
           "Searches whose chosen peers changed while they ran on the planner thread (the job is planned again).");
    fprintf(f, "fusion_plans_stale_total %" PRIu64 "\n", t->plans_stale);
    family(f, "fusion_plan_seconds_total", "counter", "Seconds those planning passes took (candidates, partitioner).");
    fprintf(f, "fusion_plan_seconds_total %.6f\n", t->plan_s_sum);
    family(f, "fusion_plan_seconds_max", "gauge", "The longest planning pass since the broker started.");
    fprintf(f, "fusion_plan_seconds_max %.6f\n", t->plan_s_max);
    family(f, "fusion_cuts_total", "counter",
           "Re-plans whose checkpoint was cut for the new stages and stored with the plan, off the loop.");
    fprintf(f, "fusion_cuts_total %" PRIu64 "\n", t->cuts);
    family(f, "fusion_cut_seconds_total", "counter", "Seconds those cuts and their commits took on the writer thread.");
    fprintf(f, "fusion_cut_seconds_total %.6f\n", t->cut_s_sum);
    family(f, "fusion_cut_seconds_max", "gauge", "The longest cut since the broker started.");
    fprintf(f, "fusion_cut_seconds_max %.6f\n", t->cut_s_max);
    family(f, "fusion_loop_turn_seconds_max", "gauge",
           "The broker loop's longest turn (from poll to poll, the wait not counted): how long a heartbeat can wait.");
    fprintf(f, "fusion_loop_turn_seconds_max %.6f\n", t->turn_s_max);
    family(f, "fusion_loop_turns_slow_total", "counter", "Turns of the broker loop that took 100 ms or more.");
    fprintf(f, "fusion_loop_turns_slow_total %" PRIu64 "\n", t->turns_slow);
    family(f, "fusion_failovers_total", "counter", "Stages moved to another peer.");
    fprintf(f, "fusion_failovers_total %" PRIu64 "\n", t->failovers);
    family(f, "fusion_peers_closed_total", "counter",
           "Peers whose connection closed: declared dead at once, or heard again within the grace.");
    fprintf(f, "fusion_peers_closed_total{outcome=\"dead\"} %" PRIu64 "\n", t->conn_deaths);
    fprintf(f, "fusion_peers_closed_total{outcome=\"heard_again\"} %" PRIu64 "\n", t->conn_reheard);
    family(f, "fusion_gateway_refused_total", "counter",
           "Messages through a gateway whose key no longer has the gateway role (dropped).");
    fprintf(f, "fusion_gateway_refused_total %" PRIu64 "\n", t->gateway_refused);
    family(f, "fusion_relayed_frames_total", "counter", "Sealed data frames relayed between peers.");
    fprintf(f, "fusion_relayed_frames_total %" PRIu64 "\n", b->relayed);
    family(f, "fusion_heartbeats_received_total", "counter", "Peers' heartbeats handled.");
    fprintf(f, "fusion_heartbeats_received_total %" PRIu64 "\n", t->heartbeats);
    family(f, "fusion_relayed_bytes_total", "counter", "Bytes of those frames (sealed: the broker cannot read them).");
    fprintf(f, "fusion_relayed_bytes_total %" PRIu64 "\n", t->relayed_bytes);
    const wire_counters *c = &b->counters;
    family(f, "fusion_messages_received_total", "counter", "Well-formed messages handled.");
    fprintf(f, "fusion_messages_received_total %" PRIu64 "\n", c->received);
    family(f, "fusion_messages_dropped_total", "counter", "Messages dropped on receipt, by cause.");
    fprintf(f, "fusion_messages_dropped_total{cause=\"frames\"} %" PRIu64 "\n", c->dropped_frames);
    fprintf(f, "fusion_messages_dropped_total{cause=\"malformed\"} %" PRIu64 "\n", c->dropped_malformed);
    fprintf(f, "fusion_messages_dropped_total{cause=\"version\"} %" PRIu64 "\n", c->dropped_version);
    fprintf(f, "fusion_messages_dropped_total{cause=\"unknown_type\"} %" PRIu64 "\n", c->dropped_unknown_type);
    fprintf(f, "fusion_messages_dropped_total{cause=\"too_large\"} %" PRIu64 "\n", c->dropped_too_large);
    family(f, "fusion_errors_replied_total", "counter", "Error messages sent back for refused messages.");
    fprintf(f, "fusion_errors_replied_total %" PRIu64 "\n", c->errors_replied);
    db_commit_stats cs = db_commits(b->db);
    family(f, "fusion_store_commits_total", "counter", "Transactions committed to the SQLite store.");
    fprintf(f, "fusion_store_commits_total %" PRIu64 "\n", cs.n);
    family(f, "fusion_store_commit_seconds_total", "counter", "Seconds those commits took (fsync included).");
    fprintf(f, "fusion_store_commit_seconds_total %.6f\n", cs.sum_s);
    family(f, "fusion_store_commit_seconds_max", "gauge", "The slowest commit since the broker started.");
    fprintf(f, "fusion_store_commit_seconds_max %.6f\n", cs.max_s);
    store(f, b);
    family(f, "fusion_uptime_seconds", "gauge", "Seconds since the broker started.");
    fprintf(f, "fusion_uptime_seconds %.3f\n", (double)(broker_now() - b->started_ms) / 1000.0);
    if (fclose(f) != 0) {
        free(text);
        return NULL;
    }
    *len = n;
    return text;
}
