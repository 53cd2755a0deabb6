/* Single-process fine-tuning and inference through the DAG executor, on a ~100M-parameter LLaMA
 * (12 layers, hidden 768, 12 heads, ffn 2048, vocab 32000; batch 4 x seq 128; 2 threads), or a small
 * model with --quick. Each case runs in a child process so that its peak memory (ru_maxrss) is its
 * own. Prints tokens/s, peak memory and saved-activation bytes as JSON lines. SALR cases use the
 * `fusion model prune` default (every linear pruned, lm_head included); infer_salr_keep_head the
 * --keep-lm-head variant (lm_head dense). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "dag_exec.h"
#include "dag_graph.h"
#include "dag_infer.h"
#include "dag_model.h"
#include "dag_quant.h"
#include "dag_spec.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"

#define TB_THREADS      2   /* BLAS and OpenMP threads */
#define TB_RANK         8   /* adapter rank */
#define TB_SALR_RANK    16  /* SALR residual rank */
#define TB_PROMPT       128 /* prompt tokens for inference */
#define TB_GENERATE     64  /* generated tokens */
#define TB_PAIRED_ROUNDS 7  /* alternating dense / pruned generation rounds of the paired ratios */

typedef struct {
    fu_modelcfg cfg;
    uint32_t batch, seq, steps;
    char dir[512];         /* dense model */
    char pruned[600];      /* SALR model, the prune default: every linear pruned, lm_head included */
    char pruned_kept[600]; /* SALR model with lm_head dense (--keep-lm-head) */
    char bf16[600];        /* the dense model's weights rounded to bf16 and stored so */
    char int8[600];        /* the bf16 model quantized (fusion model quantize: linears int8, the rest bf16) */
    bool made, pruned_made, pruned_kept_made, bf16_made, int8_made;
} tb_env;

/* The model and the run: the full size, and --quick's. */
typedef struct {
    size_t layers, hidden, heads, ffn, vocab; /* kv heads = heads, head_dim 64 */
    uint32_t batch, seq, steps;
} tb_size;

static const tb_size TB_FULL = {.layers = 12, .hidden = 768, .heads = 12, .ffn = 2048, .vocab = 32000,
                                .batch = 4, .seq = 128, .steps = 5};
static const tb_size TB_QUICK = {.layers = 4, .hidden = 256, .heads = 4, .ffn = 688, .vocab = 8000,
                                 .batch = 2, .seq = 64, .steps = 3};

/* Which model a case runs. */
typedef enum { TB_DENSE, TB_SALR, TB_SALR_KEEP_HEAD, TB_BF16, TB_INT8 } tb_model;

static tb_env env;

static void tb_threads(void)
{
    if (kern_cpu_set_threads(TB_THREADS) != FU_OK)
        fprintf(stderr, "bench: cannot set threads\n");
}

static void tb_cleanup(void)
{
    if (env.made) {
        char cmd[1200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", env.dir); /* the pruned models are inside it */
        if (system(cmd) != 0)
            fprintf(stderr, "bench: could not remove %s\n", env.dir);
    }
}

/* Runs fn in a child process; the child writes one result line into the pipe. */
static bool in_child(void (*fn)(int fd, void *), void *arg, char *line, size_t cap)
{
    int p[2];
    if (pipe(p) != 0)
        return false;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        return false;
    if (pid == 0) {
        close(p[0]);
        tb_threads();
        fn(p[1], arg);
        close(p[1]);
        _exit(0);
    }
    close(p[1]);
    size_t n = 0;
    ssize_t r;
    while (n + 1 < cap && (r = read(p[0], line + n, cap - 1 - n)) > 0)
        n += (size_t)r;
    line[n] = '\0';
    close(p[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 && n > 0;
}

static void send_line(int fd, const char *s)
{
    size_t n = strlen(s);
    if (write(fd, s, n) != (ssize_t)n)
        _exit(3);
}

static void make_model(int fd, void *arg)
{
    (void)arg;
    fu_errmsg em = {{0}};
    fu_err rc = dag_model_init_random(env.dir, &env.cfg, 1, 0.02f, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "bench: %s\n", fu_errmsg_text(&em, rc));
        _exit(2);
    }
    send_line(fd, "ok");
}

static void make_pruned(int fd, void *arg)
{
    bool head = *(const bool *)arg;
    fu_errmsg em = {{0}};
    double t0 = fu_clock_sec();
    dag_salr_prune_opts po = {.sparsity = 0.5, .rank = TB_SALR_RANK, .seed = 1, .prune_lm_head = head};
    dag_salr_prune_report rep;
    fu_err rc = dag_salr_prune(env.dir, head ? env.pruned : env.pruned_kept, &po, &rep, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "bench: %s\n", fu_errmsg_text(&em, rc));
        _exit(2);
    }
    char l[320];
    snprintf(l, sizeof l,
             "\"seconds\":%.1f,\"sparsity\":0.5,\"residual_rank\":%d,\"lm_head\":\"%s\",\"weights_mib\":%.1f,"
             "\"pruned_mib\":%.1f,\"blocks_rel_err_mean\":%.4f,\"lm_head_rel_err\":%.4f",
             fu_clock_sec() - t0, TB_SALR_RANK, rep.lm_head_pruned ? "salr" : "dense",
             (double)rep.bytes_in / 1048576.0, (double)rep.bytes_out / 1048576.0, rep.blocks_err_mean, rep.lm_head_err);
    send_line(fd, l);
}

/* env.bf16: the dense model with every tensor stored as bfloat16 (what a Hugging Face bf16 checkpoint
 * is). */
static void make_bf16(int fd, void *arg)
{
    (void)arg;
    fu_errmsg em = {{0}};
    fu_safetensors *st = NULL;
    if (fu_safetensors_open_dir(env.dir, &st, &em) != FU_OK || fu_mkdir_p(env.bf16, 0700, &em) != FU_OK ||
        fu_modelcfg_save(env.bf16, &env.cfg, &em) != FU_OK)
        _exit(2);
    size_t n = fu_safetensors_count(st);
    fu_st_tensor *ts = calloc(n, sizeof *ts);
    void **bufs = calloc(n, sizeof *bufs);
    for (size_t i = 0; i < n; i++) {
        const fu_st_tensor *src = fu_safetensors_at(st, i);
        float *f = malloc(src->nelem * sizeof *f);
        bufs[i] = malloc(src->nelem * 2);
        if (fu_st_tensor_to_f32(src, f, src->nelem, &em) != FU_OK ||
            fu_st_from_f32(FU_ST_BF16, f, src->nelem, bufs[i]) != FU_OK)
            _exit(2);
        free(f);
        ts[i] = *src;
        ts[i].dtype = FU_ST_BF16;
        ts[i].data = bufs[i];
        ts[i].nbytes = src->nelem * 2;
    }
    char *path = fu_path_join(env.bf16, FU_ST_SINGLE_FILE);
    if (fu_safetensors_write(path, ts, n, NULL, 0, NULL, NULL, &em) != FU_OK)
        _exit(2);
    send_line(fd, "ok");
}

/* env.int8: the bf16 model quantized as `fusion model quantize` does it. */
static void make_int8(int fd, void *arg)
{
    (void)arg;
    fu_errmsg em = {{0}};
    dag_quant_report rep;
    double t0 = fu_clock_sec();
    if (dag_model_quantize(env.bf16, env.int8, true, &rep, &em) != FU_OK) {
        fprintf(stderr, "bench: %s\n", em.msg);
        _exit(2);
    }
    char l[256];
    snprintf(l, sizeof l, "\"seconds\":%.2f,\"linears\":%zu,\"in_mib\":%.1f,\"out_mib\":%.1f,\"max_rel_err\":%.5f",
             fu_clock_sec() - t0, rep.quantized, (double)rep.bytes_in / 1048576.0, (double)rep.bytes_out / 1048576.0,
             rep.max_rel_err);
    send_line(fd, l);
}

static bool ensure_models(tb_model which)
{
    if (!env.made) {
        const tb_size *z = bench_quick() ? &TB_QUICK : &TB_FULL;
        fu_modelcfg_defaults(&env.cfg);
        env.cfg.num_hidden_layers = z->layers;
        env.cfg.hidden_size = z->hidden;
        env.cfg.num_attention_heads = z->heads;
        env.cfg.num_key_value_heads = z->heads;
        env.cfg.head_dim = 64;
        env.cfg.intermediate_size = z->ffn;
        env.cfg.vocab_size = z->vocab;
        env.batch = z->batch;
        env.seq = z->seq;
        env.steps = z->steps;
        env.cfg.max_position_embeddings = 2048;
        const char *t = getenv("TMPDIR");
        snprintf(env.dir, sizeof env.dir, "%s/fusion-bench-train-XXXXXX", t ? t : "/tmp");
        if (!mkdtemp(env.dir))
            return false;
        snprintf(env.pruned, sizeof env.pruned, "%s/pruned", env.dir);
        snprintf(env.pruned_kept, sizeof env.pruned_kept, "%s/pruned-keep-head", env.dir);
        snprintf(env.bf16, sizeof env.bf16, "%s/bf16", env.dir);
        snprintf(env.int8, sizeof env.int8, "%s/int8", env.dir);
        env.made = true;
        atexit(tb_cleanup);
        char line[64];
        if (!in_child(make_model, NULL, line, sizeof line))
            return false;
    }
    if ((which == TB_BF16 || which == TB_INT8) && !env.bf16_made) {
        char line[64];
        if (!in_child(make_bf16, NULL, line, sizeof line))
            return false;
        env.bf16_made = true;
    }
    if (which == TB_INT8 && !env.int8_made) {
        char line[512];
        if (!in_child(make_int8, NULL, line, sizeof line))
            return false;
        env.int8_made = true;
        bench_emit("train", "quantize_int8", "%s", line);
    }
    if (which == TB_BF16 || which == TB_INT8)
        return true;
    bool head = which == TB_SALR;
    bool *made = head ? &env.pruned_made : &env.pruned_kept_made;
    if (which != TB_DENSE && !*made) {
        char line[512];
        if (!in_child(make_pruned, &head, line, sizeof line))
            return false;
        *made = true;
        bench_emit("train", head ? "salr_prune" : "salr_prune_keep_head", "%s", line);
    }
    return true;
}

/* User + system CPU seconds of this process so far (all threads). On a shared machine,
 * work / (cpu_s / threads) estimates what the case would reach with its cores to itself. */
static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           (double)ru.ru_stime.tv_usec * 1e-6;
}

static double peak_gib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss * 1024.0 / (1024.0 * 1024.0 * 1024.0);
}

/* ---- training ------------------------------------------------------------------------------- */

typedef struct {
    dag_adapter_method method;
    kern_cpu_gemm_mode gemm; /* BLAS_THREADS: today's OpenBLAS split, to price determinism */
    int weights;             /* 0: the f32 model; 1: the bf16 model, kept bf16; 2: the bf16 model widened at load;
                                3: the int8 model, kept int8 */
} train_arg;

static void train_child(int fd, void *arg)
{
    const train_arg *ta = arg;
    dag_adapter_method m = ta->method;
    kern_cpu_gemm_set_mode(ta->gemm);
    bool salr = m == DAG_ADAPTER_SALR;
    fu_errmsg em = {{0}};
    fu_safetensors *st = NULL;
    const char *dir = salr ? env.pruned : ta->weights == 3 ? env.int8 : ta->weights ? env.bf16 : env.dir;
    if (fu_safetensors_open_dir(dir, &st, &em) != FU_OK)
        _exit(2);
    dag_model_dims d;
    dag_dims_from_cfg(&env.cfg, &d);
    dag_build_opts bo = {.method = m, .rank = TB_RANK, .alpha = 2 * TB_RANK, .res_rank = TB_SALR_RANK,
                         .salr_lm_head = salr, .head = DAG_HEAD_LOSS, .seq_len = env.seq};
    dag_graph_t *g = NULL;
    dag_exec_t *x = NULL;
    if (dag_build_llama(&d, &bo, &g) != FU_OK)
        _exit(2);
    dag_exec_opts eo = {.max_tokens = env.batch * env.seq, .training = true, .seed = 1, .widen_weights = ta->weights == 2};
    if (dag_exec_new(g, &eo, &x, &em) != FU_OK || dag_exec_load_weights(x, st, &em) != FU_OK) {
        fprintf(stderr, "bench: %s\n", em.msg);
        _exit(2);
    }
    size_t n = (size_t)env.batch * env.seq;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    for (size_t i = 0; i < n; i++) {
        tok[i] = (int32_t)((i * 7919u) % env.cfg.vocab_size);
        tgt[i] = (int32_t)((i * 104729u + 1) % env.cfg.vocab_size);
    }
    kern_adamw_params ap = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
    float loss = 0;
    double t0 = 0, c0 = 0;
    for (uint32_t s = 0; s <= env.steps; s++) {
        if (s == 1) {
            t0 = fu_clock_sec(); /* step 0 warms the buffer pool up */
            c0 = cpu_s();
        }
        if (dag_exec_set_tokens(x, 0, tok, tgt, env.batch, env.seq) != FU_OK || dag_exec_forward(x, 0) != FU_OK ||
            dag_exec_loss(x, 0, &loss, NULL) != FU_OK || dag_exec_backward(x, 0, 1.0f) != FU_OK ||
            dag_exec_step(x, &ap) != FU_OK)
            _exit(2);
    }
    double el = fu_clock_sec() - t0, cs = cpu_s() - c0;
    char line[640];
    snprintf(line, sizeof line,
             "\"method\":\"%s\",\"layers\":%zu,\"hidden\":%zu,\"vocab\":%zu,\"batch\":%u,\"seq\":%u,\"threads\":%d,"
             "\"steps\":%u,\"tokens_per_s\":%.1f,\"tokens_per_cpu_s_x_threads\":%.1f,\"peak_rss_gib\":%.3f,"
             "\"saved_activation_mib\":%.1f,\"trainable_params\":%zu,\"loss\":%.9g,\"gemm\":\"%s\",\"weights\":\"%s\"",
             dag_adapter_name(m), env.cfg.num_hidden_layers, env.cfg.hidden_size, env.cfg.vocab_size, env.batch,
             env.seq, TB_THREADS, env.steps, (double)(env.steps * n) / el,
             (double)(env.steps * n) / (cs / TB_THREADS), peak_gib(),
             (double)dag_exec_saved_bytes_peak(x) / 1048576.0, dag_exec_trainable_params(x), (double)loss,
             ta->gemm == KERN_CPU_GEMM_BLAS_THREADS ? "blas_threads" : "deterministic",
             ta->weights == 1   ? "bf16 kept"
             : ta->weights == 2 ? "bf16 widened to f32"
             : ta->weights == 3 ? "int8 linears kept, the rest bf16"
                                : "f32");
    send_line(fd, line);
    free(tok);
    free(tgt);
    dag_exec_destroy(&x);
    dag_graph_destroy(&g);
    fu_safetensors_close(&st);
}

static void train_case_w(const char *name, dag_adapter_method m, kern_cpu_gemm_mode gemm, int weights)
{
    train_arg ta = {m, gemm, weights};
    if (!ensure_models(DAG_ADAPTER_SALR == m ? TB_SALR : TB_DENSE) ||
        (weights && !ensure_models(weights == 3 ? TB_INT8 : TB_BF16))) {
        bench_emit("train", name, "\"error\":\"setup failed\"");
        return;
    }
    char line[1024];
    if (!in_child(train_child, &ta, line, sizeof line))
        bench_emit("train", name, "\"error\":\"run failed\"");
    else
        bench_emit("train", name, "%s", line);
}

static void train_case(const char *name, dag_adapter_method m, kern_cpu_gemm_mode gemm)
{
    train_case_w(name, m, gemm, 0);
}

/* A bf16 checkpoint: its weights kept bf16 in memory (the CPU's default: mapped, widened per GEMM
 * tile), and the same file widened to f32 at load (what fusion did before). Against train_lorafa
 * (the f32 file): peak memory and tokens/s. */
BENCH_CASE(train_lorafa_bf16)
{
    train_case_w("train_lorafa_bf16", DAG_ADAPTER_LORA_FA, KERN_CPU_GEMM_DETERMINISTIC, 1);
}

BENCH_CASE(train_lorafa_bf16_widened)
{
    train_case_w("train_lorafa_bf16_widened", DAG_ADAPTER_LORA_FA, KERN_CPU_GEMM_DETERMINISTIC, 2);
}

/* The bf16 model quantized (fusion model quantize): LoRA-FA over int8 linears kept int8. */
BENCH_CASE(train_lorafa_int8)
{
    train_case_w("train_lorafa_int8", DAG_ADAPTER_LORA_FA, KERN_CPU_GEMM_DETERMINISTIC, 3);
}

BENCH_CASE(train_lorafa)
{
    train_case("train_lorafa", DAG_ADAPTER_LORA_FA, KERN_CPU_GEMM_DETERMINISTIC);
}

/* The same run with OpenBLAS splitting each product between its threads (bits that depend on the
 * thread count): what the thread-independent tiles cost, in one run of the benchmark. */
BENCH_CASE(train_lorafa_blas_threads)
{
    train_case("train_lorafa_blas_threads", DAG_ADAPTER_LORA_FA, KERN_CPU_GEMM_BLAS_THREADS);
}

BENCH_CASE(train_lora)
{
    train_case("train_lora", DAG_ADAPTER_LORA, KERN_CPU_GEMM_DETERMINISTIC);
}

BENCH_CASE(train_salr)
{
    train_case("train_salr", DAG_ADAPTER_SALR, KERN_CPU_GEMM_DETERMINISTIC);
}

/* ---- inference ------------------------------------------------------------------------------ */

/* One inference executor on a model (the `fusion run infer` graph for it). */
typedef struct {
    fu_safetensors *st;
    dag_graph_t *g;
    dag_exec_t *x;
} tb_infer;

static const char *model_dir(tb_model which)
{
    switch (which) {
    case TB_SALR_KEEP_HEAD: return env.pruned_kept;
    case TB_SALR: return env.pruned;
    case TB_BF16: return env.bf16;
    case TB_INT8: return env.int8;
    default: return env.dir;
    }
}

static void infer_open(tb_model which, tb_infer *m)
{
    bool salr = which == TB_SALR || which == TB_SALR_KEEP_HEAD;
    const char *dir = model_dir(which);
    fu_errmsg em = {{0}};
    dag_salr_info info = {.lm_head = false};
    if (fu_safetensors_open_dir(dir, &m->st, &em) != FU_OK || (salr && dag_salr_info_load(dir, &info, &em) != FU_OK)) {
        fprintf(stderr, "bench: %s\n", em.msg);
        _exit(2);
    }
    dag_model_dims d;
    dag_dims_from_cfg(&env.cfg, &d);
    dag_build_opts bo = {.method = salr ? DAG_ADAPTER_SALR : DAG_ADAPTER_NONE, .rank = 0, .res_rank = TB_SALR_RANK,
                         .salr_lm_head = info.lm_head, .head = DAG_HEAD_SAMPLE, .seq_len = TB_PROMPT};
    if (dag_build_llama(&d, &bo, &m->g) != FU_OK)
        _exit(2);
    dag_exec_opts eo = {.max_tokens = TB_PROMPT, .training = false, .max_context = TB_PROMPT + TB_GENERATE + 1};
    if (dag_exec_new(m->g, &eo, &m->x, &em) != FU_OK || dag_exec_load_weights(m->x, m->st, &em) != FU_OK) {
        fprintf(stderr, "bench: %s\n", em.msg);
        _exit(2);
    }
}

static void infer_close(tb_infer *m)
{
    dag_exec_destroy(&m->x);
    dag_graph_destroy(&m->g);
    fu_safetensors_close(&m->st);
}

/* One round in a fresh session: the prompt in one pass, then TB_GENERATE tokens one at a time.
 * Wall and CPU seconds of each part. */
typedef struct {
    double prompt_s, prompt_cpu_s, gen_s, gen_cpu_s;
} tb_round;

static tb_round infer_round(tb_infer *m)
{
    int32_t prompt[TB_PROMPT];
    for (int i = 0; i < TB_PROMPT; i++)
        prompt[i] = (int32_t)((i * 7919u + 3) % env.cfg.vocab_size);
    tb_round t;
    dag_session_t *s = NULL;
    if (dag_exec_session_new(m->x, &s) != FU_OK)
        _exit(2);
    dag_exec_session_use(m->x, s);
    double t0 = fu_clock_sec(), c0 = cpu_s();
    if (dag_exec_set_tokens(m->x, 0, prompt, NULL, 1, TB_PROMPT) != FU_OK || dag_exec_forward(m->x, 0) != FU_OK)
        _exit(2);
    t.prompt_s = fu_clock_sec() - t0;
    t.prompt_cpu_s = cpu_s() - c0;
    t0 = fu_clock_sec();
    c0 = cpu_s();
    for (int k = 0; k < TB_GENERATE; k++) {
        int32_t next = 0;
        if (dag_exec_sampled(m->x, 0, &next) != FU_OK || dag_exec_set_tokens(m->x, 0, &next, NULL, 1, 1) != FU_OK ||
            dag_exec_forward(m->x, 0) != FU_OK)
            _exit(2);
    }
    t.gen_s = fu_clock_sec() - t0;
    t.gen_cpu_s = cpu_s() - c0;
    dag_exec_session_destroy(&s);
    return t;
}

static void infer_child(int fd, void *arg)
{
    tb_model which = *(const tb_model *)arg;
    tb_infer m = {0};
    infer_open(which, &m);
    double best_prompt = 0, gen_tps = 0, best_prompt_cpu = 0, gen_cpu = 0;
    int reps = bench_quick() ? 2 : 3;
    for (int r = 0; r <= reps; r++) {
        tb_round t = infer_round(&m);
        if (r == 0)
            continue; /* warms up */
        /* The best round counts (load only slows a round). */
        double v[4] = {TB_PROMPT / t.prompt_s, TB_PROMPT / (t.prompt_cpu_s / TB_THREADS), TB_GENERATE / t.gen_s,
                       TB_GENERATE / (t.gen_cpu_s / TB_THREADS)};
        double *best[4] = {&best_prompt, &best_prompt_cpu, &gen_tps, &gen_cpu};
        for (int k = 0; k < 4; k++)
            if (v[k] > *best[k])
                *best[k] = v[k];
    }
    char line[640];
    snprintf(line, sizeof line,
             "\"model\":\"%s\",\"layers\":%zu,\"hidden\":%zu,\"vocab\":%zu,\"threads\":%d,\"prompt_tokens\":%d,"
             "\"prompt_tokens_per_s\":%.1f,\"prompt_tokens_per_cpu_s_x_threads\":%.1f,\"generated_tokens\":%d,"
             "\"generated_tokens_per_s\":%.1f,\"generated_tokens_per_cpu_s_x_threads\":%.1f,\"peak_rss_gib\":%.3f",
             which == TB_SALR_KEEP_HEAD ? "salr-50%,dense-lm_head"
             : which == TB_SALR         ? "salr-50%"
             : which == TB_INT8         ? "dense,int8-linears,bf16-rest"
             : which == TB_BF16         ? "dense,bf16"
                                        : "dense",
             env.cfg.num_hidden_layers, env.cfg.hidden_size, env.cfg.vocab_size, TB_THREADS, TB_PROMPT, best_prompt,
             best_prompt_cpu, TB_GENERATE, gen_tps, gen_cpu, peak_gib());
    send_line(fd, line);
    infer_close(&m);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The dense model and a pruned one in one process, generating in alternating rounds (the order
 * flips every round): the median over rounds of dense time / pruned time, with its range. On a
 * shared machine the load changes between the separate infer cases; within a pair of adjacent rounds
 * it mostly does not. With one_thread, BLAS and the kernels run on the calling thread and rounds are
 * timed in CPU seconds: what the format and kernel save per core, nearly blind to other processes
 * (time spent descheduled is not counted; memory bandwidth they take still is). */
typedef struct {
    tb_model which; /* the pruned model */
    bool one_thread; /* BLAS and kernels on one thread, rounds timed in CPU seconds */
} tb_pair;

static void paired_child(int fd, void *arg)
{
    const tb_pair *p = arg;
    tb_model which = p->which;
    if (p->one_thread) {
        if (kern_cpu_set_threads(1) != FU_OK)
            _exit(2);
    }
    tb_infer dm = {0}, sm = {0};
    infer_open(TB_DENSE, &dm);
    infer_open(which, &sm);
    (void)infer_round(&dm);
    (void)infer_round(&sm);
    double ratio[TB_PAIRED_ROUNDS];
    int n = bench_quick() ? 3 : TB_PAIRED_ROUNDS;
    for (int r = 0; r < n; r++) {
        tb_round td, ts;
        if (r % 2 == 0) {
            td = infer_round(&dm);
            ts = infer_round(&sm);
        } else {
            ts = infer_round(&sm);
            td = infer_round(&dm);
        }
        ratio[r] = p->one_thread ? td.gen_cpu_s / ts.gen_cpu_s : td.gen_s / ts.gen_s;
    }
    qsort(ratio, (size_t)n, sizeof *ratio, cmp_double);
    const char *key = p->one_thread ? "generation_speedup_vs_dense_1thread_cpu" : "generation_speedup_vs_dense_interleaved";
    char line[200];
    snprintf(line, sizeof line, "\"%s\":%.2f,\"%s_range\":[%.2f,%.2f]", key,
             n % 2 ? ratio[n / 2] : 0.5 * (ratio[n / 2 - 1] + ratio[n / 2]), key, ratio[0], ratio[n - 1]);
    send_line(fd, line);
    infer_close(&sm);
    infer_close(&dm);
}

static double field(const char *line, const char *key)
{
    const char *p = strstr(line, key);
    return p ? atof(p + strlen(key)) : 0.0;
}

static double dense_gen_tps;

static void infer_case(const char *name, tb_model which)
{
    char line[1024];
    if (!ensure_models(which) || !in_child(infer_child, &which, line, sizeof line)) {
        bench_emit("train", name, "\"error\":\"run failed\"");
        return;
    }
    double g = field(line, "\"generated_tokens_per_s\":");
    if (which == TB_BF16 || which == TB_INT8) { /* the dense model stored narrow, kept so: against infer_dense */
        if (dense_gen_tps > 0)
            bench_emit("train", name, "%s,\"generation_speed_vs_f32\":%.2f", line, g / dense_gen_tps);
        else
            bench_emit("train", name, "%s", line);
        return;
    }
    if (which == TB_DENSE) {
        dense_gen_tps = g;
        bench_emit("train", name, "%s", line);
        return;
    }
    char pair[512], one[256];
    tb_pair p2 = {.which = which, .one_thread = false}, p1 = {.which = which, .one_thread = true};
    if (!in_child(paired_child, &p2, pair, sizeof pair))
        snprintf(pair, sizeof pair, "\"interleaved_error\":\"run failed\"");
    if (!in_child(paired_child, &p1, one, sizeof one))
        snprintf(one, sizeof one, "\"one_thread_error\":\"run failed\"");
    size_t pl = strlen(pair);
    snprintf(pair + pl, sizeof pair - pl, ",%s", one);
    if (dense_gen_tps > 0)
        bench_emit("train", name, "%s,\"generation_speedup_vs_dense\":%.2f,%s", line, g / dense_gen_tps, pair);
    else
        bench_emit("train", name, "%s,%s", line, pair);
}

BENCH_CASE(infer_dense)
{
    infer_case("infer_dense", TB_DENSE);
}

/* The same model from a bf16 file, its weights kept bf16 (after infer_dense: the ratio). */
BENCH_CASE(infer_dense_bf16)
{
    infer_case("infer_dense_bf16", TB_BF16);
}

/* The bf16 model quantized: int8 linears, bf16 embeddings and lm_head. */
BENCH_CASE(infer_dense_int8)
{
    infer_case("infer_dense_int8", TB_INT8);
}

/* The `fusion model prune` default: every linear pruned, the 32000 x 768 lm_head too. */
BENCH_CASE(infer_salr)
{
    infer_case("infer_salr", TB_SALR);
}

/* `fusion model prune --keep-lm-head`: block linears pruned, lm_head dense. */
BENCH_CASE(infer_salr_keep_head)
{
    infer_case("infer_salr_keep_head", TB_SALR_KEEP_HEAD);
}

/* ---- batched generation --------------------------------------------------------------------- */

/* K generations decoding together (docs/DAG.md "Batched sessions"): each prompt is run alone, then
 * TB_GENERATE steps each run every generation's next token in one forward (dag_infer_forward_batch,
 * as a peer's stage batches its sessions). Aggregate generated tokens per second. */
static void batch_child(int fd, void *arg)
{
    int k_sessions = *(const int *)arg;
    tb_infer m = {0};
    infer_open(TB_DENSE, &m);
    dag_session_t **sess = calloc((size_t)k_sessions, sizeof *sess);
    dag_infer_stage *st = calloc((size_t)k_sessions, sizeof *st);
    dag_infer_stage **b = calloc((size_t)k_sessions, sizeof *b);
    int32_t *next = calloc((size_t)k_sessions, sizeof *next);
    uint64_t *rows = calloc((size_t)k_sessions, sizeof *rows);
    dag_spec spec;
    dag_spec_init(&spec, DAG_JOB_INFER);
    spec.temperature = 0.8;
    int32_t prompt[TB_PROMPT];
    double best = 0, best_cpu = 0;
    for (int r = 0; r < 3; r++) {
        for (int k = 0; k < k_sessions; k++) {
            spec.seed = (uint64_t)k + 1;
            if (dag_exec_session_new(m.x, &sess[k]) != FU_OK ||
                dag_infer_stage_init(&st[k], m.x, m.g, sess[k], &spec, true, true, 0) != FU_OK)
                _exit(2);
            b[k] = &st[k];
            rows[k] = 1;
            for (int i = 0; i < TB_PROMPT; i++)
                prompt[i] = (int32_t)((i * 7919u + 3u + (unsigned)k * 131u) % env.cfg.vocab_size);
            if (dag_infer_forward(&st[k], prompt, NULL, 0, TB_PROMPT, NULL) != FU_OK ||
                dag_infer_sampled(&st[k], &next[k]) != FU_OK)
                _exit(2);
        }
        double t0 = fu_clock_sec(), c0 = cpu_s();
        for (int step = 1; step < TB_GENERATE; step++) {
            if (dag_infer_forward_batch(b, (size_t)k_sessions, next, NULL, 0, rows, NULL) != FU_OK)
                _exit(2);
            for (int k = 0; k < k_sessions; k++)
                if (dag_infer_sampled(&st[k], &next[k]) != FU_OK)
                    _exit(2);
        }
        double tps = (double)k_sessions * (TB_GENERATE - 1) / (fu_clock_sec() - t0);
        double cps = (double)k_sessions * (TB_GENERATE - 1) / ((cpu_s() - c0) / TB_THREADS);
        if (r > 0 && tps > best) /* round 0 warms up; the best round counts */
            best = tps;
        if (r > 0 && cps > best_cpu)
            best_cpu = cps;
        for (int k = 0; k < k_sessions; k++)
            dag_exec_session_destroy(&sess[k]);
    }
    char line[400];
    snprintf(line, sizeof line,
             "\"model\":\"dense\",\"layers\":%zu,\"hidden\":%zu,\"vocab\":%zu,\"threads\":%d,\"sessions\":%d,"
             "\"prompt_tokens\":%d,\"generated_tokens_per_s\":%.1f,\"generated_tokens_per_cpu_s_x_threads\":%.1f,"
             "\"peak_rss_gib\":%.3f",
             env.cfg.num_hidden_layers, env.cfg.hidden_size, env.cfg.vocab_size, TB_THREADS, k_sessions,
             TB_PROMPT, best, best_cpu, peak_gib());
    send_line(fd, line);
    dag_spec_clear(&spec);
    free(rows);
    free(next);
    free(b);
    free(st);
    free(sess);
    infer_close(&m);
}

BENCH_CASE(infer_batch)
{
    static const int ks[] = {1, 4, 16, 32};
    double one = 0;
    for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
        char line[512];
        int k = ks[i];
        if (!ensure_models(TB_DENSE) || !in_child(batch_child, &k, line, sizeof line)) {
            bench_emit("train", "infer_batch", "\"sessions\":%d,\"error\":\"run failed\"", k);
            continue;
        }
        double g = field(line, "\"generated_tokens_per_s\":");
        if (k == 1)
            one = g;
        bench_emit("train", "infer_batch", "%s,\"speedup_vs_one_session\":%.2f", line, one > 0 ? g / one : 0.0);
    }
}
