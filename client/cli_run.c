/* `fusion run`: a job in this process, no broker. `run finetune` trains a LoRA / LoRA-FA / SALR
 * adapter on a text file and writes it in PEFT format; `run infer` generates text from a model
 * (optionally with an adapter), streaming tokens as they come. Both build the job's DAG and run it
 * whole with the DAG executor (dag_exec), the same code a peer runs for one stage. */
#include <cblas.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


#include "cli.h"
#include "cli_openai.h"
#include "cli_progress.h"
#include "cli_run_batch.h"
#include "cli_runmodel.h"
#include "dag_chain.h"
#include "dag_data.h"
#include "dag_peft.h"
#include "dag_dataset.h"
#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_infer.h"
#include "dag_model.h"
#include "dag_spec.h"
#include "dag_train.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_opts.h"
#include "fu_safetensors.h"
#include "fu_tokenizer.h"

#define CLI_RUN_MAX_DATA      ((size_t)1 << 30) /* largest --data file read */
#define CLI_RUN_MAX_PROMPT    CLI_RUN_BATCH_MAX_PROMPT /* longest prompt in tokens */

/* Ctrl-C (SIGINT) or SIGTERM during `run finetune`: the step under way finishes, then the adapter of
 * the last finished step is written before the command exits 130. */
static volatile sig_atomic_t g_interrupted;

static void on_interrupt(int sig)
{
    (void)sig;
    g_interrupted = 1;
}

static void interrupt_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* The adapter's output directory, made now and checked writable, so that a fine-tune never trains
 * only to fail at the end; an adapter already there is kept unless force (as `fusion result`). */
static int output_dir_ready(const char *prog, const char *out, bool force)
{
    fu_errmsg em = {{0}};
    fu_err rc = fu_mkdir_p(out, 0755, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: -o '%s': %s\n", prog, out, fu_errmsg_text(&em, rc));
        return fu_exit_for(rc);
    }
    if (access(out, W_OK | X_OK) != 0) {
        fprintf(stderr, "%s: -o '%s': %s\n", prog, out, strerror(errno));
        return errno == EACCES || errno == EPERM || errno == EROFS ? FU_EXIT_AUTH : FU_EXIT_FAIL;
    }
    static const char *const files[] = {"adapter_model.safetensors", "adapter_config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0] && !force; i++) {
        char *p = fu_path_join(out, files[i]);
        bool there = fu_path_exists(p);
        free(p);
        if (there) {
            fprintf(stderr, "%s: '%s' holds an adapter already; use --force to replace it, or another -o\n", prog,
                    out);
            return FU_EXIT_USAGE;
        }
    }
    return FU_EXIT_OK;
}

/* ---- finetune ------------------------------------------------------------------------------- */

/* A step done: the progress line on a terminal, else a line on stdout. */
static void progress(cli_progress *p, bool tty, long long step, long long steps, double loss, double tps)
{
    if (tty) {
        char count[48], detail[64];
        snprintf(count, sizeof count, "step %lld/%lld", step, steps);
        snprintf(detail, sizeof detail, "loss %.4f %.0f tok/s", loss, tps);
        cli_progress_draw(p, (double)step, (double)steps, count, detail, NULL);
        if (step == steps)
            cli_progress_break();
    } else {
        printf("step %lld/%lld loss %.4f tokens/s %.0f\n", step, steps, (double)loss, tps);
        fflush(stdout);
    }
}

static int run_finetune(int argc, char **argv)
{
    const char *model_dir = NULL, *data = NULL, *out = NULL, *loss_log = NULL, *cuts_arg = NULL;
    long long threads = 0;
    bool correction = false, force = false;
    dag_spec_cli sc;
    fu_opt opts[DAG_SPEC_CLI_MAX_OPTS + 8] = {
        {"model", 0, FU_OPT_STR, &model_dir, "DIR", "Hugging Face model directory (config.json + safetensors)"},
        {"data", 0, FU_OPT_STR, &data, "FILE", "training text (tokenized with the model's tokenizer)"},
        {"loss-log", 0, FU_OPT_STR, &loss_log, "FILE", "append one JSON line per step (step, loss, tokens/s)"},
        {"output", 'o', FU_OPT_STR, &out, "DIR", "where to write the adapter (PEFT format)"},
        {"force", 0, FU_OPT_FLAG, &force, NULL, "replace an adapter already in the -o directory"},
        {"threads", 0, FU_OPT_INT, &threads, "N", "compute threads (default: all cores)"},
        {"lorafa-correction", 0, FU_OPT_FLAG, &correction, NULL,
         "lora-fa: precondition B's gradient with (A·Aᵀ)⁻¹/s² (PEFT's LoRA-FA optimizer)"},
        {"cuts", 0, FU_OPT_STR, &cuts_arg, "N,...",
         "run as a pipeline whose stages begin at these node ids (the broker's \"nodes A-B\"), each cut "
         "tensor through --wire-codec: the adapter equals such a pipeline's bit for bit"},
    };
    fu_cmd cmd = {
        .prog = argv[0],
        .usage = "--model DIR --data FILE -o DIR [options]",
        .summary = "Fine-tunes an adapter in this process. Samples are non-overlapping windows of seq-len+1 "
                   "tokens of the data (inputs the first seq-len, targets the last seq-len), in file order "
                   "unless --shuffle; the loss is the mean next-token cross-entropy over the batch; AdamW "
                   "with beta1 0.9, beta2 0.999, eps 1e-8. Writes adapter_model.safetensors and "
                   "adapter_config.json (PEFT)."};
    int code = 0;
    if (dag_spec_cli_parse(&sc, DAG_JOB_FINETUNE, DAG_SPEC_CLI_CHECKPOINTS, &cmd, opts, sizeof opts / sizeof opts[0], argc, argv,
                           &code) != FU_OK)
        return code;
    const char *prog = argv[0];
    if (!model_dir || !data || !out)
        return fu_opts_usage_error(&cmd, "--model, --data and -o are required");
    dag_spec spec;
    if (dag_spec_from_cmd(&sc, &cmd, DAG_JOB_FINETUNE, model_dir, &spec, &code) != FU_OK)
        return code;
    if (spec.micro_batches == 0) {
        fprintf(stderr, "%s: --micro-batches 0 leaves the count to a broker (fusion submit); here give it "
                        "(fusion status shows the one a broker chose)\n", argv[0]);
        return FU_EXIT_USAGE;
    }
    size_t cuts[DAG_CHAIN_MAX_STAGES], n_cuts = 0;
    for (const char *p = cuts_arg; p && *p;) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || v <= 0 || (*end && *end != ',') || n_cuts + 1 >= DAG_CHAIN_MAX_STAGES) {
            fprintf(stderr, "%s: --cuts wants at most %d increasing node ids separated by commas, got '%.80s'\n",
                    argv[0], DAG_CHAIN_MAX_STAGES - 1, cuts_arg);
            return FU_EXIT_USAGE;
        }
        cuts[n_cuts++] = (size_t)v;
        p = *end ? end + 1 : end;
    }
    if (!n_cuts && (spec.act_codec != KERN_CODEC_F32 || spec.grad_codec != KERN_CODEC_F32)) {
        fprintf(stderr, "%s: --wire-codec acts at the cuts between stages: give them with --cuts\n", argv[0]);
        return FU_EXIT_USAGE;
    }
    const dag_adapter_method method = spec.method;
    const long long rank = spec.rank, steps = (long long)spec.steps, batch = spec.batch, seq_len = spec.seq_len,
                    micro = spec.micro_batches;
    const double alpha = spec.alpha;
    if (!cli_run_threads(prog, threads))
        return FU_EXIT_USAGE;

    fu_errmsg em = {{0}};
    cli_runmodel m;
    fu_err rc = cli_runmodel_open(model_dir, spec.byte_tokens, &m, &em);
    if (rc != FU_OK) {
        cli_runmodel_close(&m);
        return cli_run_fail(prog, rc, &em);
    }
    if (method == DAG_ADAPTER_SALR && !m.salr) {
        fprintf(stderr, "%s: --method salr needs a SALR-pruned model; make one with `fusion model prune` "
                        "('%s' has no %s)\n", prog, model_dir, DAG_SALR_CONFIG_FILE);
        cli_runmodel_close(&m);
        return FU_EXIT_USAGE;
    }
    if (m.salr && method != DAG_ADAPTER_SALR) {
        fprintf(stderr, "%s: '%s' is a SALR-pruned model: use --method salr\n", prog, model_dir);
        cli_runmodel_close(&m);
        return FU_EXIT_USAGE;
    }
    char *text = NULL;
    size_t text_len = 0;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    dag_graph_t *g = NULL;
    FILE *log = NULL;
    dag_chain chain = {0};
    int exit_code = FU_EXIT_OK;
    dag_dataset ds = {0};
    dag_dataset_opts dopt = {.seq_len = (uint32_t)seq_len, .heldout = spec.heldout, .chat = m.chat};
    if ((rc = fu_file_read_all(data, CLI_RUN_MAX_DATA, &text, &text_len, &em)) != FU_OK ||
        (rc = dag_dataset_make(m.tok, text, text_len, &dopt, &ds, &em)) != FU_OK) {
        exit_code = cli_run_fail(prog, rc, &em);
        goto done;
    }
    ids = ds.train;
    n_ids = ds.n_train;
    ds.train = NULL;
    fprintf(stderr, "%s: data '%s': %s, %zu examples, %zu target tokens counted and %zu masked (prompts, "
                        "padding), %zu examples held out\n",
                prog, data, ds.format, ds.examples, ds.counted, ds.masked, ds.heldout_examples);
    dag_dataset_free(&ds);
    size_t win = (size_t)seq_len + 1, n_win = n_ids / win;
    if (n_win < (size_t)batch) {
        fprintf(stderr, "%s: '%s' has %zu tokens: that makes %zu windows of %zu tokens, fewer than --batch %lld "
                        "(use a shorter --seq-len or a smaller --batch)\n", prog, data, n_ids, n_win, win, batch);
        exit_code = FU_EXIT_USAGE;
        goto done;
    }
    dag_build_opts bo = {.method = method, .rank = (uint32_t)rank, .alpha = (float)alpha, .targets = spec.targets,
                         .res_rank = m.res_rank, .salr_lm_head = m.salr_lm_head, .head = DAG_HEAD_LOSS,
                         .seq_len = (uint32_t)seq_len};
    uint32_t rows = (uint32_t)(batch / micro); /* sequences per micro-batch */
    dag_exec_opts eo = {.max_tokens = rows * (uint32_t)seq_len, .n_slots = 1, .training = true,
                        .seed = spec.seed, .lorafa_correction = correction};
    if ((rc = cli_runmodel_graph(&m, &bo, &g, &em)) != FU_OK ||
        (rc = dag_chain_new(&chain, g, &eo, m.st, cuts, n_cuts, &spec, ids, n_ids, &em)) != FU_OK) {
        exit_code = cli_run_fail(prog, rc, &em);
        goto done;
    }
    if ((exit_code = output_dir_ready(prog, out, force)) != FU_EXIT_OK)
        goto done; /* every input checked, and not a single step trained yet */
    if (loss_log && !(log = fopen(loss_log, "a"))) {
        fprintf(stderr, "%s: cannot open --loss-log '%s' for appending\n", prog, loss_log);
        exit_code = FU_EXIT_FAIL;
        goto done;
    }
    if (n_cuts)
        fprintf(stderr, "%s: %zu stages, activations as %s and gradients as %s between them\n", prog, chain.n,
                kern_codec_name(spec.act_codec), kern_codec_name(spec.grad_codec));
    bool tty = isatty(STDERR_FILENO) != 0;
    if (!tty)
        printf("fine-tuning %s rank %lld alpha %g on %zu tokens (%zu windows of %lld), %lld steps of %lld x %lld, "
               "%zu trainable parameters\n",
               dag_adapter_name(method), rank, alpha, n_ids, n_win, seq_len, steps, batch, seq_len,
               dag_chain_trainable_params(&chain));
    double t0 = fu_clock_sec();
    cli_progress bar;
    cli_progress_init(&bar);
    long long done_steps = 0;
    interrupt_install();
    for (long long s = 1; s <= steps && !g_interrupted; s++) {
        double loss = 0;
        rc = dag_chain_step(&chain, (uint64_t)(s - 1), &loss, &em);
        if (rc != FU_OK) {
            cli_progress_break();
            fprintf(stderr, "%s: step %lld failed: %s\n", prog, s, fu_errmsg_text(&em, rc));
            exit_code = FU_EXIT_FAIL;
            goto done;
        }
        if (!isfinite(loss)) {
            cli_progress_break();
            fprintf(stderr, "%s: the loss is not finite at step %lld (learning rate too high?)\n", prog, s);
            exit_code = FU_EXIT_FAIL;
            goto done;
        }
        done_steps = s;
        double el = fu_clock_sec() - t0;
        double tps = (double)(s * batch * seq_len) / (el > 0 ? el : 1e-9);
        progress(&bar, tty, s, steps, loss, tps);
        if (log) {
            fprintf(log, "{\"step\":%lld,\"loss\":%.6f,\"tokens\":%lld,\"elapsed_s\":%.3f,\"tokens_per_s\":%.1f}\n", s,
                    (double)loss, s * batch * seq_len, el, tps);
            fflush(log);
        }
    }
    if ((rc = dag_chain_save_adapter(&chain, out, model_dir, &em)) != FU_OK) {
        exit_code = cli_run_fail(prog, rc, &em);
        goto done;
    }
    if (g_interrupted) {
        cli_progress_break();
        fprintf(stderr, "%s: interrupted: %s holds the adapter after step %lld of %lld (the one --steps %lld "
                        "makes)\n", prog, out, done_steps, steps, done_steps);
        exit_code = 130;
    }
    printf("wrote adapter %s (PEFT: adapter_model.safetensors, adapter_config.json)\n", out);
done:
    if (log)
        fclose(log);
    dag_chain_clear(&chain);
    dag_graph_destroy(&g);
    free(ids);
    free(text);
    cli_runmodel_close(&m);
    return exit_code;
}

/* ---- infer ---------------------------------------------------------------------------------- */


/* --dump-logits: the prompt pass's logits, f32 little-endian (positions x vocab). */
static bool write_logits(const dag_infer_stage *is, const char *path)
{
    const float *lg = NULL;
    size_t nf = 0;
    if (dag_infer_logits(is, &lg, &nf) != FU_OK)
        return false;
    FILE *f = fopen(path, "wb");
    if (!f)
        return false;
    bool ok = fwrite(lg, sizeof(float), nf, f) == nf;
    return fclose(f) == 0 && ok;
}

/* --stop: the text so far, written up to where it may still be followed by a stop string. */
typedef struct {
    const dag_spec *spec;
    int32_t *ids;
    size_t n, cap, written;
} stop_text;

/* Adds token id (-1: none; final: the generation ended) and writes what may be written: up to the first
 * stop string, and short of a tail that could begin one until the end. true when a stop string came. */
static bool stop_text_add(stop_text *st, const fu_tokenizer *tok, int32_t id, bool final)
{
    if (id >= 0) {
        if (st->n == st->cap)
            st->ids = fu_realloc(st->ids, (st->cap = st->cap ? 2 * st->cap : 64) * sizeof *st->ids);
        st->ids[st->n++] = id;
    }
    char *text = NULL;
    size_t len = 0;
    if (fu_tokenizer_decode(tok, st->ids, st->n, &text, &len, NULL) != FU_OK)
        return true;
    const char *stops[DAG_SPEC_MAX_STOP];
    for (uint32_t i = 0; i < st->spec->n_stop; i++)
        stops[i] = st->spec->stop[i];
    bool stopped;
    size_t upto = cli_oai_release(text, len, stops, st->spec->n_stop, final, st->written, &stopped);
    fwrite(text + st->written, 1, upto - st->written, stdout);
    fflush(stdout);
    st->written = upto;
    free(text);
    return stopped;
}

static int run_infer(int argc, char **argv)
{
    const char *model_dir = NULL, *adapter = NULL, *prompt = NULL, *dump = NULL, *prompts = NULL;
    long long threads = 0, batch = 8;
    bool quiet = false;
    dag_spec_cli sc;
    fu_opt opts[DAG_SPEC_CLI_MAX_OPTS + 8] = {
        {"model", 0, FU_OPT_STR, &model_dir, "DIR", "Hugging Face model directory"},
        {"adapter", 0, FU_OPT_STR, &adapter, "DIR", "PEFT adapter directory (from `fusion run finetune`)"},
        {"prompt", 0, FU_OPT_STR, &prompt, "TEXT", "prompt text"},
        {"prompts", 0, FU_OPT_STR, &prompts, "FILE",
         "JSON Lines of {\"prompt\": TEXT} or {\"prompt_tokens\": [IDS]}: generate for each, batched; one JSON "
         "line per result (generation i seeds with --seed + i)"},
        {"batch", 0, FU_OPT_INT, &batch, "N", "with --prompts: generations run together (default 8)"},
        {"dump-logits", 0, FU_OPT_STR, &dump, "FILE",
         "write float32 logits of every prompt position (little-endian, positions x vocab)"},
        {"quiet", 'q', FU_OPT_FLAG, &quiet, NULL, "print only the generated text (no statistics)"},
        {"threads", 0, FU_OPT_INT, &threads, "N", "compute threads (default: all cores)"},
    };
    fu_cmd cmd = {
        .prog = argv[0],
        .usage = "--model DIR (--prompt TEXT | --prompt-tokens IDS | --prompts FILE) [options]",
        .summary = "Generates text in this process, streaming tokens as they are drawn. The prompt is run "
                   "through the model in one pass, then tokens are generated one at a time with a KV cache."};
    int code = 0;
    if (dag_spec_cli_parse(&sc, DAG_JOB_INFER, 0, &cmd, opts, sizeof opts / sizeof opts[0], argc, argv,
                           &code) != FU_OK)
        return code;
    const char *prog = argv[0];
    if (!model_dir || (!!prompt + !!sc.prompt_tokens + !!prompts) != 1)
        return fu_opts_usage_error(&cmd, "--model and one of --prompt, --prompt-tokens or --prompts are required");
    if (batch < 1 || batch > DAG_INFER_MAX_BATCH)
        return fu_opts_usage_error(&cmd, "--batch must be 1 to 256");
    if (prompts && dump)
        return fu_opts_usage_error(&cmd, "--dump-logits takes one prompt, not --prompts");
    dag_spec spec;
    if (dag_spec_from_cmd(&sc, &cmd, DAG_JOB_INFER, model_dir, &spec, &code) != FU_OK)
        return code;
    const long long max_new = spec.max_tokens;
    fu_errmsg em = {{0}};
    cli_runmodel m;
    fu_err rc = !cli_run_threads(prog, threads) ? FU_EINVAL : cli_runmodel_open(model_dir, spec.byte_tokens, &m, &em);
    if (rc != FU_OK) {
        dag_spec_clear(&spec);
        if (rc == FU_EINVAL && !em.msg[0])
            return FU_EXIT_USAGE; /* --threads */
        cli_runmodel_close(&m);
        return cli_run_fail(prog, rc, &em);
    }
    int32_t *ids = NULL;
    size_t n_prompt = 0;
    dag_graph_t *g = NULL;
    dag_exec_t *x = NULL;
    dag_session_t *sess = NULL;
    fu_safetensors *ast = NULL;
    int exit_code = FU_EXIT_OK;
    if (prompts) {
        n_prompt = 1; /* the graph's cost estimates only */
    } else if (spec.prompt_tokens) {
        for (size_t i = 0; i < spec.n_prompt_tokens; i++)
            if ((uint32_t)spec.prompt_tokens[i] >= m.dims.vocab_size) {
                fprintf(stderr, "%s: --prompt-tokens must be ids below the vocabulary size %u\n", prog,
                        m.dims.vocab_size);
                exit_code = FU_EXIT_USAGE;
                goto done;
            }
        ids = spec.prompt_tokens; /* the spec's: ownership moves to ids */
        n_prompt = spec.n_prompt_tokens;
        spec.prompt_tokens = NULL;
    } else if ((rc = fu_tokenizer_encode(m.tok, prompt, strlen(prompt), &ids, &n_prompt, &em)) != FU_OK) {
        exit_code = cli_run_fail(prog, rc, &em);
        goto done;
    }
    if (n_prompt == 0 || n_prompt > CLI_RUN_MAX_PROMPT) {
        fprintf(stderr, "%s: the prompt has %zu tokens (1 to %d accepted)\n", prog, n_prompt, CLI_RUN_MAX_PROMPT);
        exit_code = FU_EXIT_USAGE;
        goto done;
    }
    dag_build_opts bo = {.method = m.salr ? DAG_ADAPTER_SALR : DAG_ADAPTER_NONE, .rank = 0, .alpha = 0,
                         .res_rank = m.res_rank, .salr_lm_head = m.salr_lm_head, .head = DAG_HEAD_SAMPLE,
                         .seq_len = (uint32_t)n_prompt};
    if (adapter) {
        uint32_t r = 0, tg = 0;
        float a = 0;
        if ((rc = dag_peft_config_load(adapter, &r, &a, &tg, &em)) != FU_OK) {
            exit_code = cli_run_fail(prog, rc, &em);
            goto done;
        }
        if (!m.salr)
            bo.method = DAG_ADAPTER_LORA;
        bo.rank = r;
        bo.alpha = a;
        bo.targets = tg;
        char *ap = fu_path_join(adapter, "adapter_model.safetensors");
        rc = fu_safetensors_open_file(ap, &ast, &em);
        free(ap);
        if (rc != FU_OK) {
            exit_code = cli_run_fail(prog, rc, &em);
            goto done;
        }
    }
    if (prompts) {
        exit_code = cli_run_infer_batch(prog, &m, &spec, &bo, ast, prompts, (uint32_t)batch, quiet);
        goto done;
    }
    dag_exec_opts eo = {.max_tokens = (uint32_t)n_prompt, .n_slots = 1, .training = false,
                        .logits_all = dump != NULL, .max_context = (uint32_t)(n_prompt + (size_t)max_new + 1)};
    dag_infer_stage is;
    if ((rc = cli_runmodel_exec(&m, &bo, &eo, &g, &x, &em)) != FU_OK ||
        (ast && (rc = dag_exec_load_adapter(x, ast, &em)) != FU_OK) || (rc = dag_exec_session_new(x, &sess)) != FU_OK ||
        (rc = dag_infer_stage_init(&is, x, g, sess, &spec, true, true, 0)) != FU_OK) {
        exit_code = cli_run_fail(prog, rc, &em);
        goto done;
    }
    /* The one-stage pipeline: the peers' step (dag_infer) with this process as stage 0 and the last
     * stage: the prompt at position 0, then each sampled token fed back at the next position. */
    double t0 = fu_clock_sec();
    if ((rc = dag_infer_forward(&is, ids, NULL, 0, n_prompt, NULL)) != FU_OK) {
        fprintf(stderr, "%s: the prompt pass failed: %s\n", prog, fu_strerror(rc));
        exit_code = FU_EXIT_FAIL;
        goto done;
    }
    double t_prompt = fu_clock_sec() - t0;
    if (dump && !write_logits(&is, dump)) {
        fprintf(stderr, "%s: cannot write --dump-logits '%s'\n", prog, dump);
        exit_code = FU_EXIT_FAIL;
        goto done;
    }
    int64_t eos_fallback = fu_tokenizer_eos_id(m.tok);
    long long generated = 0;
    double t1 = fu_clock_sec();
    int32_t next = 0;
    stop_text st = {.spec = &spec};
    for (long long k = 0; k < max_new; k++) {
        if ((k > 0 && (rc = dag_infer_forward(&is, &next, NULL, 0, 1, NULL)) != FU_OK) ||
            (rc = dag_infer_sampled(&is, &next)) != FU_OK)
            break;
        generated++;
        if (fu_modelcfg_is_eos(&m.cfg, eos_fallback, next))
            break;
        if (spec.n_stop) {
            if (stop_text_add(&st, m.tok, next, false))
                break;
            continue;
        }
        char *piece = NULL;
        size_t plen = 0;
        if (fu_tokenizer_decode(m.tok, &next, 1, &piece, &plen, NULL) == FU_OK) {
            fwrite(piece, 1, plen, stdout);
            fflush(stdout);
        }
        free(piece);
    }
    if (spec.n_stop)
        (void)stop_text_add(&st, m.tok, -1, true);
    free(st.ids);
    double t_gen = fu_clock_sec() - t1;
    if (rc != FU_OK) {
        fprintf(stderr, "\n%s: generation failed: %s\n", prog, fu_strerror(rc));
        exit_code = FU_EXIT_FAIL;
        goto done;
    }
    printf("\n");
    if (!quiet)
        fprintf(stderr, "prompt: %zu tokens in %.3f s (%.1f tokens/s); generated %lld tokens in %.3f s (%.1f tokens/s)\n",
                n_prompt, t_prompt, (double)n_prompt / (t_prompt > 0 ? t_prompt : 1e-9), generated, t_gen,
                (double)generated / (t_gen > 0 ? t_gen : 1e-9));
done:
    dag_exec_session_destroy(&sess);
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
    fu_safetensors_close(&ast);
    free(ids);
    dag_spec_clear(&spec);
    cli_runmodel_close(&m);
    return exit_code;
}

/* ---- eval ----------------------------------------------------------------------------------- */

/* Mean loss per counted target over the whole windows of stream (rows of batch windows), with the
 * graph bo of model m (and adapter ast when given). */
static fu_err mean_loss(const cli_runmodel *m, const dag_build_opts *bo, const fu_safetensors *ast, const int32_t *stream,
                        size_t n, uint32_t seq_len, uint32_t batch, double *loss, int64_t *counted, fu_errmsg *em)
{
    dag_exec_opts eo = {.max_tokens = batch * seq_len, .n_slots = 1, .training = false};
    dag_graph_t *g = NULL;
    dag_exec_t *x = NULL;
    fu_err rc = cli_runmodel_exec(m, bo, &eo, &g, &x, em);
    if (rc == FU_OK && ast)
        rc = dag_exec_load_adapter(x, ast, em);
    const size_t win = (size_t)seq_len + 1, w = n / win;
    int32_t *tok = fu_malloc((size_t)batch * seq_len * sizeof *tok), *tgt = fu_malloc((size_t)batch * seq_len * sizeof *tgt);
    double sum = 0;
    int64_t total = 0;
    for (size_t w0 = 0; rc == FU_OK && w0 < w; w0 += batch) {
        uint32_t rows = (uint32_t)(w - w0 < batch ? w - w0 : batch);
        for (uint32_t r = 0; r < rows; r++)
            for (uint32_t t = 0; t < seq_len; t++) {
                const int32_t *src = stream + (w0 + r) * win;
                tok[(size_t)r * seq_len + t] = DAG_DATA_ID(src[t]);
                tgt[(size_t)r * seq_len + t] = src[t + 1] < 0 ? DAG_DATA_IGNORE : src[t + 1];
            }
        float l = 0;
        int64_t nv = 0;
        if ((rc = dag_exec_set_tokens(x, 0, tok, tgt, rows, seq_len)) == FU_OK && (rc = dag_exec_forward(x, 0)) == FU_OK &&
            (rc = dag_exec_loss(x, 0, &l, &nv)) == FU_OK) {
            sum += (double)l * (double)nv;
            total += nv;
        }
    }
    if (rc != FU_OK && !em->msg[0])
        fu_errmsg_set(em, rc, "the evaluation pass failed: %s", fu_strerror(rc));
    free(tok);
    free(tgt);
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
    *loss = total ? sum / (double)total : NAN;
    *counted = total;
    return rc;
}

static int run_eval(int argc, char **argv)
{
    const char *model_dir = NULL, *data = NULL, *adapter = NULL;
    double heldout = 0.1;
    long long seq_len = 128, batch = 8, threads = 0;
    bool byte_tokens = false, json = false;
    const fu_opt opts[] = {
        {"model", 0, FU_OPT_STR, &model_dir, "DIR", "the base model"},
        {"data", 0, FU_OPT_STR, &data, "FILE", "text or JSON Lines, as `fusion run finetune --data` reads it"},
        {"adapter", 0, FU_OPT_STR, &adapter, "DIR", "also evaluate base plus this PEFT adapter"},
        {"heldout", 0, FU_OPT_DOUBLE, &heldout, "F",
         "evaluate on the held-out fraction the fine-tune kept out (its --heldout; default 0.1; 0: all the data)"},
        {"seq-len", 0, FU_OPT_INT, &seq_len, "T", "tokens per window (the fine-tune's; default 128)"},
        {"batch", 0, FU_OPT_INT, &batch, "B", "windows per forward pass (default 8)"},
        {"threads", 0, FU_OPT_INT, &threads, "N", "compute threads (default: all cores)"},
        {"byte-tokens", 0, FU_OPT_FLAG, &byte_tokens, NULL, "a model of more ids without tokenizer.json: bytes"},
        {"json", 0, FU_OPT_FLAG, &json, NULL, "print one JSON object"},
    };
    fu_cmd cmd = {.prog = argv[0],
                  .usage = "--model DIR --data FILE [--adapter DIR] [options]   (--pipeline: through the broker, "
                           "see `fusion eval --pipeline --help`)",
                  .summary = "Reports the perplexity of a model, and of the model with an adapter, on held-out data: "
                             "the examples a fine-tune with the same --heldout and --seq-len kept out of training. "
                             "Only the targets a fine-tune counts are scored (completions and assistant turns of "
                             "JSON Lines data).",
                  FU_OPTS_TABLE(opts)};
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    const char *prog = argv[0];
    if (!model_dir || !data)
        return fu_opts_usage_error(&cmd, "--model and --data are required");
    if (!(heldout >= 0 && heldout <= DAG_DATASET_MAX_HELDOUT) || seq_len < 1 || seq_len > 65536 || batch < 1 ||
        batch > 4096)
        return fu_opts_usage_error(&cmd, "--heldout must be 0..0.5, --seq-len 1..65536, --batch 1..4096");
    if (!cli_run_threads(prog, threads))
        return FU_EXIT_USAGE;
    fu_errmsg em = {{0}};
    cli_runmodel m;
    fu_safetensors *ast = NULL;
    char *text = NULL;
    size_t text_len = 0;
    dag_dataset ds = {0};
    int exit_code = FU_EXIT_OK;
    fu_err rc = cli_runmodel_open(model_dir, byte_tokens, &m, &em);
    dag_dataset_opts dopt = {.seq_len = (uint32_t)seq_len, .heldout = heldout, .chat = m.chat};
    if (rc == FU_OK && (rc = fu_file_read_all(data, CLI_RUN_MAX_DATA, &text, &text_len, &em)) == FU_OK)
        rc = dag_dataset_make(m.tok, text, text_len, &dopt, &ds, &em);
    if (rc != FU_OK) {
        exit_code = cli_run_fail(prog, rc, &em);
        goto done;
    }
    const int32_t *stream = ds.n_heldout ? ds.heldout : ds.train;
    size_t n = ds.n_heldout ? ds.n_heldout : ds.n_train;
    if (n / ((size_t)seq_len + 1) == 0) {
        fprintf(stderr, "%s: the %s part of '%s' is shorter than one window of %lld tokens\n", prog,
                ds.n_heldout ? "held-out" : "whole", data, seq_len + 1);
        exit_code = FU_EXIT_USAGE;
        goto done;
    }
    dag_build_opts bo = {.method = m.salr ? DAG_ADAPTER_SALR : DAG_ADAPTER_NONE, .res_rank = m.res_rank,
                         .salr_lm_head = m.salr_lm_head, .head = DAG_HEAD_LOSS, .seq_len = (uint32_t)seq_len};
    double base = NAN, tuned = NAN;
    int64_t counted = 0;
    if ((rc = mean_loss(&m, &bo, NULL, stream, n, (uint32_t)seq_len, (uint32_t)batch, &base, &counted, &em)) != FU_OK) {
        exit_code = cli_run_fail(prog, rc, &em);
        goto done;
    }
    if (adapter) {
        uint32_t r = 0, tg = 0;
        float a = 0;
        char *ap = fu_path_join(adapter, "adapter_model.safetensors");
        rc = dag_peft_config_load(adapter, &r, &a, &tg, &em);
        if (rc == FU_OK)
            rc = fu_safetensors_open_file(ap, &ast, &em);
        free(ap);
        if (!m.salr)
            bo.method = DAG_ADAPTER_LORA;
        bo.rank = r;
        bo.alpha = a;
        bo.targets = tg;
        if (rc == FU_OK)
            rc = mean_loss(&m, &bo, ast, stream, n, (uint32_t)seq_len, (uint32_t)batch, &tuned, &counted, &em);
        if (rc != FU_OK) {
            exit_code = cli_run_fail(prog, rc, &em);
            goto done;
        }
    }
    const char *part = ds.n_heldout ? "held-out" : "all";
    if (json)
        printf("{\"data\":\"%s\",\"targets\":%lld,\"base_loss\":%.6f,\"base_perplexity\":%.6f%s", part,
               (long long)counted, base, exp(base), adapter ? "," : "}\n");
    else
        printf("%s data: %lld targets; base: loss %.4f, perplexity %.3f", part, (long long)counted, base, exp(base));
    if (adapter && json)
        printf("\"adapter_loss\":%.6f,\"adapter_perplexity\":%.6f}\n", tuned, exp(tuned));
    else if (adapter)
        printf("; with the adapter: loss %.4f, perplexity %.3f\n", tuned, exp(tuned));
    else if (!json)
        putchar('\n');
done:
    dag_dataset_free(&ds);
    free(text);
    fu_safetensors_close(&ast);
    cli_runmodel_close(&m);
    return exit_code;
}

int cli_eval_main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) /* through the broker */
        if (strcmp(argv[i], "--pipeline") == 0)
            return cli_eval_pipeline_main(argc, argv);
    return run_eval(argc, argv);
}

/* ---- dispatch ------------------------------------------------------------------------------- */

int cli_run_main(int argc, char **argv)
{
    if (cli_help_asked(argc, argv)) {
        printf("Usage: fusion run COMMAND [options]\n\n"
               "Runs a job in this process (no broker):\n"
               "  finetune  train a LoRA-FA, LoRA or SALR adapter on a text file (PEFT output)\n"
               "  infer     generate text, optionally with an adapter\n"
               "  eval      perplexity on held-out data, with and without an adapter (also `fusion eval`)\n\n"
               "Run 'fusion run COMMAND --help' for a command's options.\n");
        return argc < 2 ? FU_EXIT_USAGE : FU_EXIT_OK;
    }
    static const cli_sub subs[] = {{"finetune", run_finetune}, {"infer", run_infer}, {"eval", run_eval}};
    int code = cli_sub_dispatch("fusion run", subs, sizeof subs / sizeof subs[0], argc, argv);
    if (code >= 0)
        return code;
    fprintf(stderr, "fusion run: unknown command '%s' (finetune or infer)\n", argv[1]);
    return FU_EXIT_USAGE;
}
