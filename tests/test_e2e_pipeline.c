/* End to end, no faults: a broker, three peers and the client as real processes on loopback (the
 * test cluster, tests/cluster.h).
 *   - a LoRA-FA fine-tune through a three-stage pipeline (the peer tests cover two stages) gives the
 *     adapter `fusion run finetune` gives (max abs difference over every tensor <= 1e-5), downloaded
 *     with `fusion result`; `fusion peers` shows each peer's link as its operator stated it
 *     (`fusion-peer --link-mbps`);
 *   - greedy generation through the same three stages with that adapter (`fusion submit infer
 *     --adapter-job --dump-logits`, `fusion result`) gives the tokens `fusion run infer --adapter`
 *     gives;
 *   - with --dump-logits the job's result carries the prompt's logits, equal to `fusion run infer
 *     --dump-logits`;
 *   - a model with hidden 512 > vocabulary 256 on peers that each hold 2/3 of it runs as a pipeline;
 *   - `--targets q,v`: the adapter holds exactly the q and v projections, as `fusion run finetune`'s;
 *   - SALR: `fusion model prune --method salr` (every linear pruned, lm_head included), then
 *     `fusion submit finetune --method salr` on the pruned model equals `fusion run finetune --method
 *     salr` on it, and greedy generation through the pipeline with that adapter equals `fusion run
 *     infer`'s;
 *   - peers of unlike speeds (--gflops 40, 10, 10): the fast one holds more layers than either slow
 *     one, as the broker's explanation of the plan says, and the adapter is fusion run's. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cluster.h"
#include "fu_modelcfg.h"
#include "dag_model.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "fu_opts.h"
#include "fu_safetensors.h"
#include "testutil.h"

#define PROMPT_TOKENS "116,104,101,32,113,117,105,99,107"
#define N_PROMPT      9

/* Starts the three-peer e2e cluster (no backups) with the peers' memory cap memory_gb. */
static tu_cluster *three_peers(const char *tag, const char *memory_gb)
{
    tu_opts o = tu_opts_default(3);
    o.peer_memory_gb = memory_gb;
    tu_cluster *c = tu_cluster_new(tag, &o);
    tu_cluster_start(c);
    return c;
}

/* The job ran as a pipeline of at least `want` stages: the broker's plan names stage want-1. */
static void assert_stages(const tu_cluster *c, const char *id, int want)
{
    bool ok = tu_broker_logged(c, "job %s stage %d/", id, want - 1);
    if (!ok)
        tu_file_show(tu_broker_log(c), 40);
    assert_true(ok);
}

/* A fine-tune of model with train (a checkpoint every `every` steps) through the pipeline: done, run
 * as at least `stages` stages, with the adapter `fusion run finetune` gives. Its id in id. */
static void finetune_as_run(tu_cluster *c, const char *model, const char *train, int every, int stages, char id[17])
{
    tu_submit_finetune(c, id, model, "%s --checkpoint-every %d", train, every);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, stages);
    tu_assert_same_adapter(c, id, model, train);
}

/* Inference job id's stage 0 took its tokens straight from the last stage (the ring) rather than
 * waiting for the broker's copy, as its peer's log says. */
static void assert_ring_used(const tu_cluster *c, const char *id)
{
    char p[TU_PATH], want[96];
    snprintf(want, sizeof want, "job %s stage 0: tokens come straight from the last stage", id);
    for (int i = 0; i < tu_cluster_n_peers(c); i++) {
        tu_path(c, p, "p%d.log", i);
        char *log = tu_file_text(p);
        bool hit = log && strstr(log, want);
        free(log);
        if (hit)
            return;
    }
    fail_msg("no peer log says \"%s\"", want);
}

/* Greedy generation of max_tokens with fine-tune job ftid's adapter through the pipeline (`fusion
 * submit infer --adapter-job`, `fusion result`) gives the text `fusion run infer --adapter` gives.
 * Inference needs less memory than the fine-tune (no optimiser state): two or three stages fit, and
 * which the planner picks depends on the speeds the peers measured, which a loaded machine changes;
 * it runs as at least two. */
static void expect_same_generation(tu_cluster *c, const char *model, const char *ftid, int max_tokens)
{
    char iid[17];
    tu_submit(c, iid, "infer --model %s --adapter-job %s --prompt-tokens " PROMPT_TOKENS " --max-tokens %d "
              "--dump-logits", model, ftid, max_tokens);
    tu_wait_done(c, iid, 60);
    tu_result(c, iid);
    char p[TU_PATH];
    tu_path(c, p, "res-%s/output.txt", iid);
    char *got = tu_file_text(p);
    char *want = NULL;
    int rc = tu_fusion(c, &want, "run infer -q --threads 1 --model %s --adapter 'res-%s' --prompt-tokens "
                       PROMPT_TOKENS " --max-tokens %d 2>/dev/null", model, ftid, max_tokens);
    assert_int_equal(rc, 0);
    size_t wl = strlen(want);
    if (wl && want[wl - 1] == '\n')
        want[--wl] = '\0';
    printf("infer %s on %s: pipeline %zu bytes, fusion run %zu bytes: %s\n", iid, model, strlen(got), wl,
           strcmp(got, want) == 0 ? "identical" : "DIFFERENT");
    assert_true(wl > 0);
    assert_string_equal(got, want);
    free(got);
    free(want);
    assert_stages(c, iid, 2);
    assert_ring_used(c, iid);
}

/* How many peers `fusion peers --json` lists with a link of want_bps. */
static int peers_with_link(const tu_cluster *c, double want_bps)
{
    tu_peer_seen seen[TU_MAX_PEERS];
    int n = tu_peers_list(c, seen, TU_MAX_PEERS), k = 0;
    for (int i = 0; i < n; i++)
        k += seen[i].link_bps == want_bps;
    return k;
}

static void test_e2e_pipeline_finetune_then_infer(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    o.link_mbps = "900"; /* stated by the operator: no probe, and the broker plans with it */
    tu_cluster *c = tu_cluster_new("e2e-pipeline", &o);
    tu_broker_args(c, "--http 127.0.0.1:0");
    tu_cluster_start(c);
    const char *train = TU_TRAIN_ARGS " --steps 20";
    char id[17];
    finetune_as_run(c, "model", train, 5, 3, id); /* the memory cap makes the fine-tune need all three stages */
    assert_int_equal(peers_with_link(c, 900e6), 3);
    expect_same_generation(c, "model", id, 24);
    /* the broker's /metrics counted what ran: 20 steps of 4 x 16 tokens, 24 generated tokens, two jobs
     * done, three peers idle again */
    char *m = tu_metrics_scrape(c);
    printf("metrics: %.0f steps, %.0f trained tokens, %.0f generated, %.0f jobs done, %.0f peers idle\n",
           tu_metric(m, "fusion_steps_total"), tu_metric(m, "fusion_trained_tokens_total"),
           tu_metric(m, "fusion_generated_tokens_total"), tu_metric(m, "fusion_jobs{state=\"done\"}"),
           tu_metric(m, "fusion_peers{state=\"idle\"}"));
    assert_true(tu_metric(m, "fusion_steps_total") == 20);
    assert_true(tu_metric(m, "fusion_trained_tokens_total") == 20 * 4 * 16);
    assert_true(tu_metric(m, "fusion_generated_tokens_total") == 24);
    assert_true(tu_metric(m, "fusion_jobs{state=\"done\"}") == 2);
    assert_true(tu_metric(m, "fusion_step_seconds_total") > 0);
    free(m);
    /* The adapter on another model of the same shapes (other weights): refused at submission, not run
     * into text that means nothing. */
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "model init -o other --seed 9 >/dev/null"), 0);
    free(out);
    assert_int_not_equal(tu_fusion(c, &out, "submit infer --model other --adapter-job %s --prompt-tokens "
                                   PROMPT_TOKENS " --max-tokens 4 2>&1", id), 0);
    if (!strstr(out, "was fine-tuned on another model") || !strstr(out, "/other' (m:"))
        fail_msg("an adapter of 'model' on 'other': %s", out);
    free(out);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Issue "Operate and serve", CLI points: a fine-tune cancelled mid-run keeps the adapter of its last
 * common checkpoint: `fusion result` downloads it and says which step it is, and it is the adapter
 * `fusion run finetune --steps K` makes. A cancelled job without a checkpoint says so instead of
 * "wait". */
static void test_e2e_pipeline_cancelled_keeps_its_checkpoint(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-cancel", TU_PEER_MEMORY_GB);
    char id[17], none[17];
    tu_submit_finetune(c, id, "model", "%s --steps 400 --checkpoint-every 2", TU_TRAIN_ARGS);
    (void)tu_wait_step(c, id, 6, 60000);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "cancel %s", id), 0);
    free(out);
    assert_int_equal(tu_fusion(c, &out, "result %s -o 'res-%s'", id, id), 0);
    printf("fusion result of the cancelled job: %s", out);
    const char *at = strstr(out, "the adapter of step ");
    assert_non_null(at);
    long k = atol(at + strlen("the adapter of step "));
    free(out);
    assert_true(k >= 2 && k % 2 == 0);
    char train[256];
    snprintf(train, sizeof train, "%s --steps %ld", TU_TRAIN_ARGS, k);
    double d = tu_job_vs_reference(c, id, "model", train);
    printf("cancelled at step >= 6: the adapter of its checkpoint at step %ld, max diff %g to fusion run --steps %ld\n",
           k, d, k);
    assert_true(d <= 1e-5);
    /* no checkpoint (the first would be at step 1000): no result, and the reason why */
    tu_submit_finetune(c, none, "model", "%s --steps 400 --checkpoint-every 1000", TU_TRAIN_ARGS);
    (void)tu_wait_step(c, none, 2, 60000);
    assert_int_equal(tu_fusion(c, &out, "cancel %s", none), 0);
    free(out);
    assert_int_equal(tu_fusion(c, &out, "result %s -o 'res-%s'", none, none), 4);
    assert_non_null(strstr(out, "before its first checkpoint"));
    free(out);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Wire codecs (issue "Home links"): a three-stage fine-tune with int8 activations and bf16 gradients
 * on the wire has the adapter of `fusion run finetune` cut where the plan cut it, with the same codecs,
 * bit for bit; and not f32's (the codecs were applied). */
static void test_e2e_pipeline_wire_codec(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-codec", TU_PEER_MEMORY_GB);
    const char *plain = TU_TRAIN_ARGS " --steps 8 --micro-batches 2";
    char train[256], ref[384], cuts[64], id[17];
    snprintf(train, sizeof train, "%s --wire-codec int8,bf16", plain);
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 4", train);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, 3);
    tu_job_cuts(c, id, cuts, sizeof cuts);
    snprintf(ref, sizeof ref, "%s --cuts %s", train, cuts);
    tu_assert_identical_adapter(c, id, "model", ref, 1);
    double d = tu_job_vs_reference(c, id, "model", plain);
    assert_true(d > 1e-7);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The micro-batch count left to the broker (issue "Home links"): over links stated at 20 Mbit/s the
 * broker splits the step into more than one micro-batch (they hide the transfers), says how many in the
 * job's status, keeps its choice across its own SIGKILL and restart, and the adapter is `fusion run
 * --micro-batches M`'s bit for bit. */
static void test_e2e_pipeline_micro_batches_chosen(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    o.link_mbps = "20";
    tu_cluster *c = tu_cluster_new("e2e-micro", &o);
    tu_cluster_start(c);
    const char *train = "--rank 4 --alpha 8 --batch 8 --seq-len 16 --lr 0.01 --seed 7 --steps 40"; /* the kill lands mid-job */
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --micro-batches 0 --checkpoint-every 4", train);
    (void)tu_wait_step(c, id, 5, 60000);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "status %s --json", id), 0);
    const char *mb = strstr(out, "\"micro_batches\":");
    assert_non_null(mb);
    int M = atoi(mb + strlen("\"micro_batches\":"));
    printf("the broker chose %d micro-batches: %s\n", M, out);
    char cuts[64], want_cuts[96];
    tu_job_cuts(c, id, cuts, sizeof cuts);
    snprintf(want_cuts, sizeof want_cuts, "\"cuts\":\"%s\"", cuts); /* what fusion run --cuts takes */
    assert_non_null(strstr(out, want_cuts));
    free(out);
    assert_true(M > 1 && 8 % M == 0);
    assert_true(tu_broker_logged(c, "job %s: %d micro-batches of %d tokens (left to the broker", id, M, 8 / M * 16));
    assert_int_equal(tu_broker_stop(c, SIGKILL), 128 + SIGKILL);
    tu_broker_start(c); /* same port, same SQLite file: the choice is stored */
    tu_wait_done(c, id, 90);
    assert_int_equal(tu_fusion(c, &out, "status %s --json", id), 0);
    char want[32];
    snprintf(want, sizeof want, "\"micro_batches\":%d", M);
    assert_non_null(strstr(out, want));
    free(out);
    char ref[256];
    snprintf(ref, sizeof ref, "%s --micro-batches %d", train, M);
    tu_assert_identical_adapter(c, id, "model", ref, 1);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Peers with 1, 2 and 3 compute threads run a three-stage fine-tune whose adapter has the bits of
 * `fusion run finetune --threads 2` (docs/DAG.md "Determinism"): neither the partition nor any
 * process's thread count changes a bit. */
static void test_e2e_pipeline_mixed_threads(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    /* FFN and vocabulary wider than one GEMM tile (KERN_GEMM_TILE_N): their products are split */
    o.model_args = "--layers 6 --hidden 256 --heads 4 --kv-heads 2 --ffn 768 --vocab 1000 --seed 3";
    o.peer_memory_gb = "0.042"; /* 43 MiB: two stages of this model do not fit, three do */
    o.peer_threads[1] = "2";
    o.peer_threads[2] = "3";
    tu_cluster *c = tu_cluster_new("e2e-threads", &o);
    tu_cluster_start(c);
    const char *train = TU_TRAIN_ARGS " --steps 12";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 4", train);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, 3);
    tu_assert_identical_adapter(c, id, "model", train, 2);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Layers of the plan's stage on peer pI, from the broker's explanation of job id ("job ID stage S/N
 * on KEY (pI): stage S: nodes A-B (layers X-Y..."); 0 when pI holds no stage. */
static int layers_on(const tu_cluster *c, const char *id, int i)
{
    char *log = tu_broker_log_text(c), needle[64];
    snprintf(needle, sizeof needle, "job %s stage ", id);
    int n = 0;
    for (const char *at = log; (at = strstr(at, needle)) != NULL; at++) {
        const char *nl = strchr(at, '\n'), *l = strstr(at, "(layers ");
        const char *dash = l ? strchr(l, '-') : NULL; /* "(layers X[.part]-Y[.part]" */
        int x, y;
        if (tu_plan_line_peer(at) != i || !l || (nl && l > nl) || !dash ||
            sscanf(l, "(layers %d", &x) != 1 || sscanf(dash, "-%d", &y) != 1)
            continue;
        printf("%.*s\n", (int)(nl ? nl - at : (ptrdiff_t)strlen(at)), at);
        n = y - x + 1;
    }
    free(log);
    return n;
}

/* Unlike speeds (issue "Elastic and heterogeneous"): three peers state 40, 10 and 10 GFLOP/s
 * (--gflops, challenges off: a loaded machine's measurements would make the split a coin toss). The
 * partitioner sizes each stage to its peer, so the fast one holds more layers than either slow one,
 * and the broker's log says why; the adapter is still fusion run's, bit for bit. */
static void test_e2e_pipeline_faster_peers_more_layers(void **state)
{
    (void)state;
    static const char *const gflops[] = {"40", "10", "10"};
    tu_opts o = tu_opts_default(3);
    o.model_args = "--layers 12 --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 256 --seed 3";
    o.peer_memory_gb = NULL;
    o.challenge_ms = -1;
    o.grow_margin = "0"; /* every peer that lowers the slowest stage */
    for (int i = 0; i < 3; i++)
        o.peer_gflops[i] = gflops[i];
    tu_cluster *c = tu_cluster_new("e2e-speeds", &o);
    tu_cluster_start(c);
    const char *train = TU_TRAIN_ARGS " --steps 8";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 4", train);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, 3);
    int fast = layers_on(c, id, 0), slow1 = layers_on(c, id, 1), slow2 = layers_on(c, id, 2);
    printf("layers: p0 (40 GFLOP/s) %d, p1 (10) %d, p2 (10) %d\n", fast, slow1, slow2);
    assert_true(fast > slow1 && fast > slow2);
    assert_true(slow1 > 0 && slow2 > 0);
    assert_true(tu_broker_logged(c, "at 40.0 GFLOP/s = "));
    tu_assert_identical_adapter(c, id, "model", train, 1);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Where job id's line "job ID<what>" is in the broker's log text (SIZE_MAX when it is not). */
static size_t log_at(const char *log, const char *id, const char *what)
{
    char needle[160];
    snprintf(needle, sizeof needle, "job %s%s", id, what);
    const char *at = strstr(log, needle);
    return at ? (size_t)(at - log) : SIZE_MAX;
}

/* Several jobs at once (docs/PIPELINE.md "Growth"): six peers with the e2e memory cap (a job needs
 * three stages), three jobs of two owners submitted together. A job takes only the stages it needs,
 * so two run at the same time and the third follows; each finishes with fusion run's adapter, bit
 * for bit (the same options: every job's adapter is the same file). */
static void test_e2e_pipeline_concurrent_jobs(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(6);
    tu_cluster *c = tu_cluster_new("e2e-jobs", &o);
    tu_keygen(c, "bob", true); /* a second owner */
    tu_cluster_start(c);
    const char *train = TU_TRAIN_ARGS " --steps 20";
    char ids[3][17];
    tu_submit_finetune(c, ids[0], "model", "%s", train);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "submit finetune --keys bob --model model --data '%s' %s -q", tu_cluster_data(c),
                               train), 0);
    assert_int_equal(sscanf(out, "%16s", ids[1]), 1);
    free(out);
    tu_submit_finetune(c, ids[2], "model", "%s", train);
    tu_wait_done(c, ids[0], 120);
    tu_wait_done(c, ids[2], 120);
    out = NULL;
    assert_int_equal(tu_fusion(c, &out, "wait %s --keys bob --wait-timeout 120", ids[1]), 0);
    free(out);
    /* two of them ran at the same time: one started before another was done */
    char *bl = tu_broker_log_text(c);
    bool overlap = false;
    for (int x = 0; x < 3; x++)
        for (int y = 0; y < 3; y++)
            overlap = overlap || (x != y && log_at(bl, ids[x], ": every stage is ready; started at step 0") <
                                                 log_at(bl, ids[y], " done") &&
                                  log_at(bl, ids[y], ": every stage is ready; started at step 0") <
                                      log_at(bl, ids[x], " done"));
    free(bl);
    for (int x = 0; x < 3; x++)
        assert_stages(c, ids[x], 3);
    assert_true(overlap);
    tu_assert_identical_adapter(c, ids[0], "model", train, 1);
    tu_assert_identical_adapter(c, ids[2], "model", train, 1);
    out = NULL;
    assert_int_equal(tu_fusion(c, &out, "result %s --keys bob -o res-%s", ids[1], ids[1]), 0);
    free(out);
    char a[TU_PATH], b[TU_PATH];
    tu_path(c, a, "res-%s/adapter_model.safetensors", ids[0]);
    tu_path(c, b, "res-%s/adapter_model.safetensors", ids[1]);
    size_t nt = 0;
    assert_true(tu_adapter_diff(a, b, &nt) == 0 && nt > 0);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Waits until the broker has checked the profile of the peer named `name`. */
static void wait_checked(const tu_cluster *c, const char *name)
{
    if (!tu_broker_wait_log(c, 30000, "(%s) joined", name) || !tu_peer_profile_checked(c, name, 30000)) {
        tu_cluster_show_logs(c);
        fail_msg("peer %s did not join, or its profile was not checked", name);
    }
}

/* Slots (docs/PEER.md "Slots"): two peer processes, each `fusion-peer --slots 2` with room for two
 * stages' worth (each slot gets half: a job of this model needs two stages), so the broker sees four
 * peers of two keys. Two jobs submitted together each take one slot of each process (distinct
 * processes first): every process holds stages of both jobs at once, the jobs overlap, and each
 * adapter is fusion run's, bit for bit. */
static void test_e2e_pipeline_slots_two_jobs(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(2, 0);
    o.peer_memory_gb = "0.1172"; /* two slots of TU_TWO_STAGE_MEMORY_GB */
    tu_cluster *c = tu_cluster_new("e2e-slots", &o);
    tu_broker_start(c);
    for (int i = 0; i < 2; i++)
        tu_peer_start(c, i, "--slots", "2", NULL);
    static const char *const names[] = {"p0#0", "p0#1", "p1#0", "p1#1"};
    for (int i = 0; i < 4; i++)
        wait_checked(c, names[i]);
    const char *train = TU_TRAIN_ARGS " --steps 10";
    char ids[2][17];
    for (int x = 0; x < 2; x++)
        tu_submit_finetune(c, ids[x], "model", "%s --checkpoint-every 5", train);
    for (int x = 0; x < 2; x++)
        tu_wait_done(c, ids[x], 120);
    char *bl = tu_broker_log_text(c);
    bool overlap = log_at(bl, ids[0], ": every stage is ready; started at step 0") < log_at(bl, ids[1], " done") &&
                   log_at(bl, ids[1], ": every stage is ready; started at step 0") < log_at(bl, ids[0], " done");
    free(bl);
    assert_true(overlap);
    for (int x = 0; x < 2; x++)
        assert_stages(c, ids[x], 2);
    for (int pr = 0; pr < 2; pr++) { /* each process held a stage of each job, on one of its slots */
        int jobs_on = 0;
        for (int x = 0; x < 2; x++) {
            char *log = tu_broker_log_text(c), needle[64], who[16];
            snprintf(needle, sizeof needle, "job %s stage ", ids[x]);
            snprintf(who, sizeof who, " (p%d#", pr);
            bool on = false;
            for (const char *at = log; !on && (at = strstr(at, needle)) != NULL; at++) {
                const char *nl = strchr(at, '\n'), *w = strstr(at, who);
                on = w && (!nl || w < nl) && strstr(at, "/2 on ") && strstr(at, "/2 on ") < w;
                if (on)
                    printf("%.*s\n", (int)(nl ? nl - at : (ptrdiff_t)strlen(at)), at);
            }
            free(log);
            jobs_on += on;
        }
        printf("p%d held stages of %d jobs\n", pr, jobs_on);
        assert_int_equal(jobs_on, 2);
    }
    tu_peer_seen seen[TU_MAX_PEERS];
    int n = tu_peers_list(c, seen, TU_MAX_PEERS), slots = 0;
    for (int i = 0; i < n; i++)
        slots += strchr(seen[i].name, '#') != NULL;
    assert_int_equal(slots, 4);
    for (int x = 0; x < 2; x++)
        tu_assert_identical_adapter(c, ids[x], "model", train, 1);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* Spares give way (issue "Elastic and heterogeneous": each job gets the stages its plan needs plus
 * its share of spares): four peers, one backup per job, jobs of two stages that do not verify (a
 * job that verifies keeps a backup per stage as its verifiers). The first job takes two stages and
 * a backup; the second finds one idle peer and takes the first job's backup as its other stage
 * instead of waiting. Both run at once and both adapters are fusion run's, bit for bit. */
static void test_e2e_pipeline_spares_give_way(void **state)
{
    (void)state;
    tu_opts o = tu_opts_two_stage(4, 1);
    tu_cluster *c = tu_cluster_new("e2e-spares", &o);
    tu_cluster_start(c);
    const char *train = TU_TRAIN_ARGS " --steps 60";
    char ids[2][17];
    tu_submit_finetune(c, ids[0], "model", "%s --checkpoint-every 10 --verify 0", train);
    (void)tu_wait_step(c, ids[0], 1, 60000);
    assert_true(tu_broker_logged(c, "job %s: peer ", ids[0]) && tu_broker_logged(c, "is a warm backup for stage"));
    tu_submit_finetune(c, ids[1], "model", "%s --checkpoint-every 10 --verify 0", train);
    for (int x = 0; x < 2; x++)
        tu_wait_done(c, ids[x], 120);
    assert_true(tu_broker_logged(c, "job %s: takes peer ", ids[1]));
    assert_true(tu_broker_logged(c, "a backup of job %s (spares give way to queued jobs)", ids[0]));
    char *bl = tu_broker_log_text(c);
    bool overlap = log_at(bl, ids[1], ": every stage is ready; started at step 0") < log_at(bl, ids[0], " done");
    free(bl);
    assert_true(overlap);
    for (int x = 0; x < 2; x++) {
        assert_stages(c, ids[x], 2);
        tu_assert_identical_adapter(c, ids[x], "model", train, 1);
    }
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* The new families through the wire (issue "Real checkpoints"): a Qwen3-shaped model (per-head q/k
 * RMSNorm: head_norm nodes; attention_bias: biased linears; head_dim 48 over hidden 128; Llama 3
 * rope scaling) fine-tuned on three peers gives fusion run's adapter bit for bit, and generation
 * through the stages with it gives fusion run infer's text: every new node field crosses the
 * DAG encoding to the peers intact. */
static void test_e2e_pipeline_qwen3_shape(void **state)
{
    (void)state;
    tu_opts o = tu_opts_default(3);
    /* 34.8 MiB a peer: the whole model (about 35 MiB with its 32 MiB fixed share) fits none, so the
     * fine-tune and the generation both run as pipelines whatever speeds a loaded machine measures */
    o.peer_memory_gb = "0.034";
    o.grow_margin = "0"; /* every peer that lowers the slowest stage */
    tu_cluster *c = tu_cluster_new("e2e-qwen", &o);
    char model[TU_PATH];
    tu_path(c, model, "model");
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "rm -rf '%s'", model), 0);
    free(out);
    fu_modelcfg cfg;
    fu_modelcfg_defaults(&cfg);
    snprintf(cfg.model_type, sizeof cfg.model_type, "qwen3");
    snprintf(cfg.architecture, sizeof cfg.architecture, "Qwen3ForCausalLM");
    cfg.num_hidden_layers = 4;
    cfg.hidden_size = 128;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = 2;
    cfg.head_dim = 48;
    cfg.intermediate_size = 256;
    cfg.qk_norm = cfg.attn_qkv_bias = cfg.attn_o_bias = true;
    cfg.rope_theta = 500000;
    cfg.rope_factor = 8;
    cfg.rope_low_freq_factor = 1;
    cfg.rope_high_freq_factor = 4;
    cfg.rope_original_max_pos = 64;
    cfg.byte_tokens = true;
    fu_errmsg em = {{0}};
    if (dag_model_init_random(model, &cfg, 5, 0.05f, &em) != FU_OK)
        fail_msg("%s", em.msg);
    tu_cluster_start(c);
    const char *train = TU_TRAIN_ARGS " --steps 12";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 4", train);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, 2);
    tu_assert_identical_adapter(c, id, "model", train, 1);
    expect_same_generation(c, "model", id, 12);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* JSON Lines through the broker (issue "Real checkpoints"): prompt/completion examples, a tenth
 * held out; the broker makes the same masked token stream as `fusion run` (dag_dataset), so the
 * pipeline's adapter has fusion run's bits. */
static void test_e2e_pipeline_jsonl_prompt_completion(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-jsonl", TU_PEER_MEMORY_GB);
    FILE *f = fopen(tu_cluster_data(c), "w");
    assert_non_null(f);
    static const char *const q[] = {"what colour is the sky", "name a fruit", "two plus two", "say hello"};
    static const char *const a[] = {" blue", " apple", " four", " hello"};
    for (int i = 0; i < 240; i++)
        fprintf(f, "{\"prompt\": \"Q%d: %s?\\nA:\", \"completion\": \"%s\"}\n", i, q[i % 4], a[i % 4]);
    fclose(f);
    const char *train = TU_TRAIN_ARGS " --steps 12 --heldout 0.1";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s --checkpoint-every 4", train);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, 2);
    tu_assert_identical_adapter(c, id, "model", train, 1);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* An int8 model (fusion model quantize) through the broker: the peers fetch each int8 weight with
 * its row scales, and the pipeline's adapter equals `fusion run finetune`'s on the same model. */
static void test_e2e_pipeline_int8_finetune(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-int8", TU_PEER_MEMORY_GB);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "model quantize --model model -o q8"), 0);
    free(out);
    const char *train = TU_TRAIN_ARGS " --steps 8";
    char id[17];
    tu_submit_finetune(c, id, "q8", "%s", train);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, 2);
    tu_assert_identical_adapter(c, id, "q8", train, 1);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A model the broker does not have: `fusion submit` names it at once and says --upload; with
 * --upload the directory goes over by content and the pipeline's adapter equals `fusion run`'s on
 * the local copy; `fusion upload` of the same directory again sends nothing. */
static void test_e2e_pipeline_upload_model(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-upload", TU_PEER_MEMORY_GB);
    char *away = tu_dir_new("e2e-upload-client"); /* outside the broker's model roots */
    char *out = NULL;
    assert_int_equal(tu_sh(&out, "cp -r '%s/model' '%s/mine'", tu_cluster_dir(c), away), 0);
    free(out);
    const char *train = TU_TRAIN_ARGS " --steps 6";
    int rc = tu_fusion(c, &out, "submit finetune --model '%s/mine' --data '%s' %s 2>&1", away, tu_cluster_data(c),
                       train);
    print_message("without --upload: exit %d: %s", rc, out);
    assert_int_equal(rc, FU_EXIT_NOTFOUND);
    assert_non_null(strstr(out, "not found under the broker's model roots"));
    assert_non_null(strstr(out, "add --upload"));
    free(out);
    char id[17], mine[TU_PATH];
    snprintf(mine, sizeof mine, "%s/mine", away);
    tu_submit_finetune(c, id, mine, "--upload %s", train);
    tu_wait_done(c, id, 80);
    assert_stages(c, id, 2);
    tu_assert_identical_adapter(c, id, mine, train, 1);
    assert_int_equal(tu_fusion(c, &out, "upload '%s' 2>&1", mine), 0);
    print_message("again: %s", out);
    assert_non_null(strstr(out, "u-"));
    assert_non_null(strstr(out, "sent 0 of"));
    free(out);
    tu_dir_remove(away);
    free(away);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A number field of the JSON object text (fails the test when missing). */
static double json_number(const char *text, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = text ? strstr(text, k) : NULL;
    if (!p)
        fail_msg("no %s in %s", key, text ? text : "(nothing)");
    return strtod(p + strlen(k), NULL);
}

/* `fusion eval --pipeline`: the base model's and the fine-tuned adapter's perplexity on the held-out
 * tenth, each an eval job forward only through the peers (two micro-batches a step), equal to
 * `fusion eval` in one process on the same data and the downloaded adapter (the same windows and
 * targets; losses within 1e-5 relative), and the adapter lowers the loss; with bf16 activations on the
 * wire (--wire-codec) the base loss moves, by less than 0.5%. */
static void test_e2e_pipeline_eval(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-eval", TU_PEER_MEMORY_GB);
    const char *train = TU_TRAIN_ARGS " --steps 30 --heldout 0.1";
    char id[17];
    tu_submit_finetune(c, id, "model", "%s", train);
    tu_wait_done(c, id, 80);
    tu_result(c, id);
    const char *ev = "--heldout 0.1 --seq-len 16 --batch 4";
    char *pipe = NULL, *local = NULL;
    int rc = tu_fusion(c, &pipe, "eval --pipeline --model model --data '%s' --adapter-job %s %s --micro-batches 2 --json",
                       tu_cluster_data(c), id, ev);
    print_message("through the broker: %s", pipe);
    assert_int_equal(rc, 0);
    assert_int_equal(tu_fusion(c, &local, "eval --model model --data '%s' --adapter res-%s %s --json",
                               tu_cluster_data(c), id, ev),
                     0);
    print_message("in one process:     %s", local);
    assert_true(json_number(pipe, "targets") > 0);
    assert_true(json_number(pipe, "targets") == json_number(local, "targets"));
    static const char *const keys[] = {"base_loss", "adapter_loss"};
    for (int k = 0; k < 2; k++) {
        double a = json_number(pipe, keys[k]), b = json_number(local, keys[k]);
        if (!(fabs(a - b) <= 1e-5 * fabs(b)))
            fail_msg("%s: %.9g through the broker, %.9g in one process", keys[k], a, b);
    }
    assert_true(json_number(pipe, "adapter_loss") < json_number(pipe, "base_loss"));
    char *bl = tu_broker_log_text(c);
    int evals = 0;
    for (const char *q = bl; (q = strstr(q, ": eval over ")); q++, evals++) {
        char eid[17], want[64];
        snprintf(eid, sizeof eid, "%.16s", q - 16); /* "job <id>: eval over" */
        snprintf(want, sizeof want, "job %s stage 1/2 on", eid);
        if (!strstr(bl, want))
            fail_msg("eval job %s did not run as two stages", eid);
    }
    assert_int_equal(evals, 2);
    free(bl);
    /* The same eval with bf16 activations between its stages: the same targets, the loss within 0.5%
     * (bf16 keeps 8 bits of each value), and not the f32 bits (the codec was applied). */
    char *coded = NULL;
    rc = tu_fusion(c, &coded, "eval --pipeline --model model --data '%s' %s --micro-batches 2 --wire-codec bf16 --json",
                   tu_cluster_data(c), ev);
    print_message("bf16 on the wire:   %s", coded);
    assert_int_equal(rc, 0);
    assert_true(json_number(coded, "targets") == json_number(pipe, "targets"));
    double lb = json_number(coded, "base_loss"), l32 = json_number(pipe, "base_loss");
    assert_true(fabs(lb - l32) <= 5e-3 * l32 && lb != l32);
    free(coded);
    free(pipe);
    free(local);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* `fusion submit infer --dump-logits`: the result holds the prompt's logits (logits.f32), equal to
 * `fusion run infer --dump-logits`. */
static void test_e2e_pipeline_infer_logits(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-logits", TU_PEER_MEMORY_GB);
    char iid[17];
    tu_submit(c, iid, "infer --model model --prompt-tokens " PROMPT_TOKENS " --max-tokens 8 --dump-logits");
    tu_wait_done(c, iid, 60);
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "result %s -o res", iid), 0);
    free(out);
    assert_int_equal(tu_fusion(c, &out, "run infer -q --threads 1 --model model --prompt-tokens " PROMPT_TOKENS
                               " --max-tokens 8 --dump-logits ref-logits.bin >/dev/null"), 0);
    free(out);
    char p[TU_PATH];
    tu_path(c, p, "ref-logits.bin");
    char *ref = NULL;
    size_t nref = 0;
    fu_errmsg em = {{0}};
    assert_int_equal(fu_file_read_all(p, 1u << 26, &ref, &nref, &em), FU_OK);
    assert_int_equal(nref, (size_t)N_PROMPT * 256 * sizeof(float));
    /* The pipeline's logits: any result file named logits* (the broker's name for them is open). */
    char *name = NULL;
    (void)tu_sh(&name, "ls '%s/res' | grep '^logits' | head -n 1", tu_cluster_dir(c));
    size_t nl = strlen(name);
    while (nl && (name[nl - 1] == '\n' || name[nl - 1] == ' '))
        name[--nl] = '\0';
    if (nl == 0) {
        (void)tu_sh(&out, "ls -l '%s/res'", tu_cluster_dir(c));
        fail_msg("the result of an inference job submitted with --dump-logits holds no logits file (files: %s); "
                 "the broker drops InferToken.logits", out);
    }
    tu_path(c, p, "res/%s", name);
    free(name);
    char *got = NULL;
    size_t ngot = 0;
    assert_int_equal(fu_file_read_all(p, 1u << 26, &got, &ngot, &em), FU_OK);
    assert_int_equal(ngot, nref);
    double worst = 0;
    for (size_t i = 0; i < nref / sizeof(float); i++) {
        float a, b;
        memcpy(&a, got + i * sizeof a, sizeof a);
        memcpy(&b, ref + i * sizeof b, sizeof b);
        if (fabs((double)a - (double)b) > worst)
            worst = fabs((double)a - (double)b);
    }
    printf("logits of %d prompt positions: max |pipeline - fusion run| = %.3g\n", N_PROMPT, worst);
    assert_true(worst <= 1e-4);
    free(got);
    free(ref);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

static void test_e2e_pipeline_salr(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-salr", TU_PEER_MEMORY_GB);
    char *out = NULL;
    int rc = tu_fusion(c, &out, "model prune --method salr --sparsity 0.5 --svd-rank 8 --seed 1 -i model -o pruned");
    if (rc != 0)
        fail_msg("fusion model prune: exit %d: %s", rc, out);
    assert_non_null(strstr(out, "lm_head pruned")); /* the peers fetch and run a bitmap-encoded head */
    free(out);
    const char *train = "--method salr " TU_TRAIN_ARGS " --steps 12";
    char id[17];
    finetune_as_run(c, "pruned", train, 4, 2, id); /* more than one stage */
    expect_same_generation(c, "pruned", id, 16);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* A model whose hidden size is larger than its vocabulary (the byte-level 256 of `fusion model init`
 * with --hidden 512) is cut between layers when no peer can hold all of it. (Found by this test: the
 * partitioner used to cut only where the narrowest tensor crosses, the logits, and left the job
 * queued; fixed in dag/dag_partition.c, b08d299.) */
static void test_e2e_pipeline_wide_model_splits(void **state)
{
    (void)state;
    /* about 2/3 of what the whole job needs: two stages fit, one does not */
    tu_cluster *c = three_peers("e2e-wide", "0.066");
    char *out = NULL;
    assert_int_equal(tu_fusion(c, &out, "model init -o wide --layers 4 --hidden 512 --heads 8 --kv-heads 4 "
                               "--ffn 1376 --vocab 256 --seed 3 >/dev/null"), 0);
    free(out);
    const char *train = TU_TRAIN_ARGS " --steps 4";
    char id[17];
    tu_submit_finetune(c, id, "wide", "%s --checkpoint-every 2", train);
    tu_status st;
    uint64_t end = fu_clock_ms() + 60000;
    do {
        assert_true(tu_status_get(c, id, &st));
        if (strcmp(st.state, "done") == 0 || strcmp(st.state, "failed") == 0)
            break;
        fu_sleep_ms(50);
    } while (fu_clock_ms() < end);
    if (strcmp(st.state, "done") != 0)
        fail_msg("job %s on a model with hidden 512 > vocab 256 and peers that hold half of it each: %s: %s", id,
                 st.state, st.message);
    assert_stages(c, id, 2);
    tu_assert_same_adapter(c, id, "wide", train);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

/* `fusion submit finetune --targets q,v` through the pipeline: the adapter holds exactly the q and v
 * projections of every layer (nothing else), and equals `fusion run finetune --targets q,v`'s. (The
 * client used to send "q,v" as a string where the broker wanted a list, and the job was refused.) */
static void test_e2e_pipeline_targets(void **state)
{
    (void)state;
    tu_cluster *c = three_peers("e2e-targets", TU_PEER_MEMORY_GB);
    const char *train = TU_TRAIN_ARGS " --steps 6 --targets q,v";
    char id[17];
    finetune_as_run(c, "model", train, 3, 2, id);
    char path[TU_PATH];
    tu_path(c, path, "res-%s/adapter_model.safetensors", id);
    fu_errmsg em = {{0}};
    fu_safetensors *st = NULL;
    assert_int_equal(fu_safetensors_open_file(path, &st, &em), FU_OK);
    size_t q = 0, v = 0, n = fu_safetensors_count(st);
    for (size_t i = 0; i < n; i++) {
        const char *name = fu_safetensors_at(st, i)->name;
        q += strstr(name, ".q_proj.") != NULL;
        v += strstr(name, ".v_proj.") != NULL;
        if (!strstr(name, ".q_proj.") && !strstr(name, ".v_proj."))
            fail_msg("the adapter of --targets q,v holds %s", name);
    }
    printf("job %s: %zu tensors, %zu of q_proj and %zu of v_proj\n", id, n, q, v);
    assert_true(q > 0 && q == v && q + v == n);
    fu_safetensors_close(&st);
    char cfg[TU_PATH];
    tu_path(c, cfg, "res-%s/adapter_config.json", id);
    char *txt = tu_file_text(cfg);
    assert_non_null(strstr(txt, "q_proj"));
    assert_non_null(strstr(txt, "v_proj"));
    assert_null(strstr(txt, "k_proj"));
    free(txt);
    assert_int_equal(tu_cluster_stop(&c), FU_OK);
}

int main(int argc, char **argv)
{
    /* Used by tests/netns/run.sh: the max abs difference of two adapter files; exit 0 when it is at
     * most TU_ADAPTER_TOL. */
    if (argc == 4 && strcmp(argv[1], "--adapter-diff") == 0) {
        tu_fail_exits();
        size_t nt = 0;
        double d = tu_adapter_diff(argv[2], argv[3], &nt);
        printf("%zu adapter tensors, max |a - b| = %.3g\n", nt, d);
        return d <= TU_ADAPTER_TOL ? 0 : 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_e2e_pipeline_finetune_then_infer, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_salr, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_infer_logits, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_cancelled_keeps_its_checkpoint, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_wide_model_splits, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_targets, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_wire_codec, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_micro_batches_chosen, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_mixed_threads, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_concurrent_jobs, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_faster_peers_more_layers, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_slots_two_jobs, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_spares_give_way, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_qwen3_shape, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_jsonl_prompt_completion, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_int8_finetune, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_upload_model, tu_teardown),
        cmocka_unit_test_teardown(test_e2e_pipeline_eval, tu_teardown),
    };
    return tu_run_tests(argc, argv, tests, NULL, NULL);
}
