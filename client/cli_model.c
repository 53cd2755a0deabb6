/* `fusion model`: make a random-weight model directory in Hugging Face layout (`model init`),
 * check one (`model info`), or SALR-prune one (`model prune`). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "fu_file.h"
#include "dag_merge.h"
#include "dag_quant.h"
#include "fu_modelcfg.h"
#include "fu_tokenizer.h"
#include "dag_model.h"
#include "fu_opts.h"
#include "fu_safetensors.h"

/* Standard deviation of the normal initialisation of linear and embedding weights (the
 * transformers LlamaConfig initializer_range). */
#define CLI_MODEL_INIT_STD 0.02f

/* ---- model init ----------------------------------------------------------------------------- */

static int model_init(int argc, char **argv)
{
    long long layers = 2, hidden = 64, heads = 4, kv_heads = -1, ffn = 128, vocab = 256, seed = 0;
    long long max_pos = FU_MODELCFG_DEFAULT_MAX_POS, head_dim = 0;
    double rope_theta = FU_MODELCFG_DEFAULT_ROPE_THETA, rms_eps = FU_MODELCFG_DEFAULT_RMS_EPS;
    const char *dtype = "f32", *out = NULL;
    bool tie = false, force = false;
    const fu_opt opts[] = {
        {"layers", 0, FU_OPT_INT, &layers, "L", "decoder layers (default 2)"},
        {"hidden", 0, FU_OPT_INT, &hidden, "D", "hidden size (default 64)"},
        {"heads", 0, FU_OPT_INT, &heads, "H", "attention heads (default 4)"},
        {"kv-heads", 0, FU_OPT_INT, &kv_heads, "K", "key/value heads, dividing H (default 2, or H when H is odd)"},
        {"head-dim", 0, FU_OPT_INT, &head_dim, "N", "size of one head (default D/H)"},
        {"ffn", 0, FU_OPT_INT, &ffn, "F", "SwiGLU intermediate size (default 128)"},
        {"vocab", 0, FU_OPT_INT, &vocab, "V", "vocabulary size (default 256, byte-level)"},
        {"max-pos", 0, FU_OPT_INT, &max_pos, "N", "max_position_embeddings (default 2048)"},
        {"rope-theta", 0, FU_OPT_DOUBLE, &rope_theta, "T", "RoPE base (default 10000)"},
        {"rms-eps", 0, FU_OPT_DOUBLE, &rms_eps, "E", "RMSNorm epsilon (default 1e-6)"},
        {"seed", 's', FU_OPT_INT, &seed, "S", "random seed; the same seed gives the same bytes (default 0)"},
        {"dtype", 0, FU_OPT_STR, &dtype, "T", "f32, f16 or bf16 (default f32)"},
        {"tie", 0, FU_OPT_FLAG, &tie, NULL, "tie lm_head to the embedding (no lm_head.weight)"},
        {"output", 'o', FU_OPT_STR, &out, "DIR", "the model directory to write (required)"},
        {"force", 'f', FU_OPT_FLAG, &force, NULL, "overwrite the model files of a non-empty DIR"},
    };
    const fu_cmd cmd = {
        .prog = "fusion model init",
        .usage = "[options] -o DIR",
        .summary = "Writes a LLaMA model with random weights in Hugging Face layout: DIR/config.json "
                   "(LlamaForCausalLM) and DIR/model.safetensors. Norms are 1, linear and embedding "
                   "weights are normal(0, 0.02) from --seed.",
        FU_OPTS_TABLE(opts),
    };
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!out)
        return fu_opts_usage_error(&cmd, "-o DIR is required");
    fu_st_dtype dt;
    const char *torch_dtype;
    if (strcmp(dtype, "f32") == 0 || strcmp(dtype, "float32") == 0)
        dt = FU_ST_F32, torch_dtype = "float32";
    else if (strcmp(dtype, "f16") == 0 || strcmp(dtype, "float16") == 0)
        dt = FU_ST_F16, torch_dtype = "float16";
    else if (strcmp(dtype, "bf16") == 0 || strcmp(dtype, "bfloat16") == 0)
        dt = FU_ST_BF16, torch_dtype = "bfloat16";
    else {
        fprintf(stderr, "%s: --dtype must be f32, f16 or bf16, not '%s'\n", cmd.prog, dtype);
        return FU_EXIT_USAGE;
    }
    if (kv_heads < 0)
        kv_heads = heads > 0 && heads % 2 == 0 ? heads / 2 : heads;
    const long long vals[] = {layers, hidden, heads, kv_heads, ffn, vocab, max_pos, head_dim};
    const char *names[] = {"--layers", "--hidden", "--heads", "--kv-heads", "--ffn", "--vocab", "--max-pos", "--head-dim"};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        if (vals[i] < 0 || (vals[i] == 0 && i < 7) || vals[i] > (1LL << 30)) {
            fprintf(stderr, "%s: %s must be a positive integer, not %lld\n", cmd.prog, names[i], vals[i]);
            return FU_EXIT_USAGE;
        }
    }
    fu_modelcfg cfg;
    fu_modelcfg_defaults(&cfg);
    cfg.num_hidden_layers = (size_t)layers;
    cfg.hidden_size = (size_t)hidden;
    cfg.num_attention_heads = (size_t)heads;
    cfg.num_key_value_heads = (size_t)kv_heads;
    cfg.intermediate_size = (size_t)ffn;
    cfg.vocab_size = (size_t)vocab;
    cfg.byte_tokens = true; /* no tokenizer.json: its ids are bytes, whatever the vocabulary */
    cfg.max_position_embeddings = (size_t)max_pos;
    cfg.rope_theta = rope_theta;
    cfg.rms_norm_eps = rms_eps;
    cfg.tie_word_embeddings = tie;
    snprintf(cfg.torch_dtype, sizeof cfg.torch_dtype, "%s", torch_dtype);
    if (head_dim > 0) {
        cfg.head_dim = (size_t)head_dim;
    } else if (cfg.hidden_size % cfg.num_attention_heads != 0) {
        fprintf(stderr, "%s: --hidden %zu is not divisible by --heads %zu\n", cmd.prog, cfg.hidden_size,
                cfg.num_attention_heads);
        return FU_EXIT_USAGE;
    } else {
        cfg.head_dim = cfg.hidden_size / cfg.num_attention_heads;
    }
    fu_errmsg em = {{0}};
    fu_err rc = fu_modelcfg_validate(&cfg, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: invalid model: %s\n", cmd.prog, fu_errmsg_text(&em, rc));
        return FU_EXIT_USAGE;
    }

    if (fu_path_exists(out)) {
        bool empty = false;
        if (!fu_path_is_dir(out)) {
            fprintf(stderr, "%s: '%s' exists and is not a directory\n", cmd.prog, out);
            return FU_EXIT_FAIL;
        }
        if (fu_dir_is_empty(out, &empty) != FU_OK) {
            fprintf(stderr, "%s: cannot read directory '%s'\n", cmd.prog, out);
            return FU_EXIT_FAIL;
        }
        if (!empty && !force) {
            fprintf(stderr, "%s: '%s' is not empty; refusing to overwrite it (pass --force to replace its model files)\n",
                    cmd.prog, out);
            return FU_EXIT_FAIL;
        }
    } else if ((rc = fu_mkdir_p(out, 0755, &em)) != FU_OK) {
        fprintf(stderr, "%s: %s\n", cmd.prog, fu_errmsg_text(&em, rc));
        return fu_exit_for(rc);
    }

    /* A stale shard index would win over the new single file when the directory is read. */
    char *index_path = fu_path_join(out, FU_ST_INDEX_FILE);
    if (fu_path_exists(index_path) && remove(index_path) != 0) {
        fprintf(stderr, "%s: cannot remove the old '%s'\n", cmd.prog, index_path);
        free(index_path);
        return FU_EXIT_FAIL;
    }
    free(index_path);
    rc = dag_model_init_random_as(out, &cfg, (uint64_t)seed, CLI_MODEL_INIT_STD, dt, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", cmd.prog, fu_errmsg_text(&em, rc));
        return fu_exit_for(rc);
    }
    uint64_t params = fu_modelcfg_param_count(&cfg);
    printf("wrote %s: %s, %zu layers, hidden %zu, heads %zu/%zu, ffn %zu, vocab %zu, %llu parameters "
           "(%.1f MiB %s), seed %llu\n",
           out, cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
           cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size, (unsigned long long)params,
           (double)(params * fu_st_dtype_size(dt)) / (1024.0 * 1024.0), torch_dtype,
           (unsigned long long)seed);
    return FU_EXIT_OK;
}

/* ---- model info ----------------------------------------------------------------------------- */

static int model_info(int argc, char **argv)
{
    bool byte_tokens = false, json = false;
    const fu_opt opts[] = {
        {"byte-tokens", 0, FU_OPT_FLAG, &byte_tokens, NULL,
         "accept a model of more than 256 ids without tokenizer.json (its text as byte ids)"},
        {"json", 0, FU_OPT_FLAG, &json, NULL, "print the summary as one JSON object"},
    };
    const fu_cmd cmd = {
        .prog = "fusion model info",
        .usage = "[options] DIR",
        .summary = "Reads a Hugging Face model directory (config.json, its safetensors and tokenizer.json), checks "
                   "that every weight its family needs is there with the right shape and that the tokenizer "
                   "loads and fits the vocabulary, and prints a summary.",
        .min_pos = 1,
        .max_pos = 1,
        FU_OPTS_TABLE(opts),
    };
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    const char *dir = argv[1];
    fu_errmsg em = {{0}};
    fu_modelcfg cfg;
    fu_err rc = fu_modelcfg_load(dir, &cfg, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion: %s\n", fu_errmsg_text(&em, rc));
        return fu_exit_for(rc);
    }
    fu_safetensors *st = NULL;
    rc = fu_safetensors_open_dir(dir, &st, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion: %s\n", fu_errmsg_text(&em, rc));
        return fu_exit_for(rc);
    }
    rc = fu_modelcfg_check_weights(&cfg, st, &em);
    const char *dtname = "?";
    if (rc == FU_OK && fu_safetensors_count(st) > 0)
        dtname = cfg.int8_weights ? "int8 linears, per-channel scales"
                                  : fu_st_dtype_name(fu_safetensors_get(st, "model.embed_tokens.weight")->dtype);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion: model dir '%s': %s\n", dir, fu_errmsg_text(&em, rc));
        fu_safetensors_close(&st);
        return fu_exit_for(rc);
    }
    fu_tokenizer *tok = NULL;
    rc = fu_tokenizer_open_dir(dir, cfg.vocab_size, cfg.byte_tokens || byte_tokens, &tok, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion: model dir '%s': tokenizer: %s\n", dir, fu_errmsg_text(&em, rc));
        fu_safetensors_close(&st);
        return fu_exit_for(rc);
    }
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "dir", dir);
        cJSON_AddStringToObject(o, "architecture", cfg.architecture);
        cJSON_AddStringToObject(o, "model_type", cfg.model_type);
        cJSON_AddNumberToObject(o, "layers", (double)cfg.num_hidden_layers);
        cJSON_AddNumberToObject(o, "hidden", (double)cfg.hidden_size);
        cJSON_AddNumberToObject(o, "heads", (double)cfg.num_attention_heads);
        cJSON_AddNumberToObject(o, "kv_heads", (double)cfg.num_key_value_heads);
        cJSON_AddNumberToObject(o, "head_dim", (double)cfg.head_dim);
        cJSON_AddNumberToObject(o, "ffn", (double)cfg.intermediate_size);
        cJSON_AddNumberToObject(o, "vocab", (double)cfg.vocab_size);
        cJSON_AddNumberToObject(o, "max_pos", (double)cfg.max_position_embeddings);
        cJSON_AddNumberToObject(o, "rope_theta", cfg.rope_theta);
        cJSON_AddNumberToObject(o, "rms_eps", cfg.rms_norm_eps);
        cJSON_AddBoolToObject(o, "tied_embeddings", cfg.tie_word_embeddings);
        cJSON_AddNumberToObject(o, "parameters", (double)fu_modelcfg_param_count(&cfg));
        cJSON_AddNumberToObject(o, "tensors", (double)fu_safetensors_count(st));
        cJSON_AddStringToObject(o, "weights", dtname);
        bool bytes = fu_tokenizer_kind(tok) == FU_TOK_BYTES;
        cJSON_AddStringToObject(o, "tokenizer", bytes ? "bytes" : "bpe");
        cJSON_AddNumberToObject(o, "tokenizer_vocab", (double)fu_tokenizer_vocab_size(tok));
        cJSON_AddNumberToObject(o, "bos", bytes ? -1 : fu_tokenizer_bos_id(tok));
        cJSON_AddNumberToObject(o, "eos", bytes ? -1 : fu_tokenizer_eos_id(tok));
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text);
        free(text);
        cJSON_Delete(o);
        fu_tokenizer_destroy(&tok);
        fu_safetensors_close(&st);
        return FU_EXIT_OK;
    }
    char toks[160];
    if (fu_tokenizer_kind(tok) == FU_TOK_BYTES)
        snprintf(toks, sizeof toks, "byte tokens (ids 0..255)");
    else
        snprintf(toks, sizeof toks, "BPE tokenizer of %zu ids, BOS %d, EOS %d", fu_tokenizer_vocab_size(tok),
                 fu_tokenizer_bos_id(tok), fu_tokenizer_eos_id(tok));
    fu_tokenizer_destroy(&tok);
    printf("%s: %s (%s), %zu layers, hidden %zu, heads %zu, kv heads %zu, head_dim %zu, ffn %zu, vocab %zu, "
           "max_pos %zu, rope_theta %g, rms_eps %g, %s, %llu parameters in %zu tensors (%s); %s\n",
           dir, cfg.architecture, cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
           cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings,
           cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings ? "tied embeddings" : "separate lm_head",
           (unsigned long long)fu_modelcfg_param_count(&cfg), fu_safetensors_count(st), dtname, toks);
    fu_safetensors_close(&st);
    return FU_EXIT_OK;
}

/* ---- merge ---------------------------------------------------------------------------------- */

static int model_merge(int argc, char **argv)
{
    const char *model = NULL, *adapter = NULL, *out = NULL;
    bool force = false;
    const fu_opt opts[] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "the base model (dense, or SALR-pruned)"},
        {"adapter", 0, FU_OPT_STR, &adapter, "DIR", "the PEFT adapter to write into it (none: only densify a SALR model)"},
        {"out", 'o', FU_OPT_STR, &out, "DIR", "where to write the merged model"},
        {"force", 0, FU_OPT_FLAG, &force, NULL, "replace a model already in DIR"},
    };
    const fu_cmd cmd = {
        .prog = "fusion model merge",
        .usage = "--model DIR --adapter DIR -o OUT [--force]",
        .summary = "Writes the adapter into the base model's weights (W + alpha/r * B·A for every adapted linear; a "
                   "SALR-pruned model is made dense: sparse weight + frozen residual + adapter) as a Hugging Face "
                   "model directory in float32, with its config and tokenizer files.",
        FU_OPTS_TABLE(opts),
    };
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!model || !out)
        return fu_opts_usage_error(&cmd, "--model and -o are required");
    fu_errmsg em = {{0}};
    dag_merge_report rep;
    fu_err rc = dag_model_merge(model, adapter, out, force, &rep, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion model merge: %s\n", fu_errmsg_text(&em, rc));
        return rc == FU_EEXIST ? FU_EXIT_USAGE : fu_exit_for(rc);
    }
    printf("wrote %s: %zu tensors (%.1f MB, float32); %zu linears took the adapter, %zu SALR linears made dense\n",
           out, rep.tensors, (double)rep.bytes / 1e6, rep.merged, rep.densified);
    return FU_EXIT_OK;
}

/* ---- quantize ------------------------------------------------------------------------------- */

static int model_quantize(int argc, char **argv)
{
    const char *model = NULL, *out = NULL;
    bool force = false;
    const fu_opt opts[] = {
        {"model", 0, FU_OPT_STR, &model, "DIR", "the model to quantize (dense: f32, f16 or bf16)"},
        {"out", 'o', FU_OPT_STR, &out, "DIR", "where to write the int8 model"},
        {"force", 0, FU_OPT_FLAG, &force, NULL, "replace a model already in DIR"},
    };
    const fu_cmd cmd = {
        .prog = "fusion model quantize",
        .usage = "--model DIR -o OUT [--force]",
        .summary = "Writes the model with every decoder linear (q, k, v, o, gate, up, down) in int8, symmetric per "
                   "output channel (NAME int8 and NAME_scale f32); embeddings, lm_head, norms and biases keep their "
                   "dtype. The result is a frozen base for LoRA-FA: fine-tuning and generation read the int8 "
                   "weights in place.",
        FU_OPTS_TABLE(opts),
    };
    int code = 0;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (!model || !out)
        return fu_opts_usage_error(&cmd, "--model and -o are required");
    fu_errmsg em = {{0}};
    dag_quant_report rep;
    fu_err rc = dag_model_quantize(model, out, force, &rep, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "fusion model quantize: %s\n", fu_errmsg_text(&em, rc));
        return rc == FU_EEXIST ? FU_EXIT_USAGE : fu_exit_for(rc);
    }
    printf("wrote %s: %zu of %zu weights int8 per channel; %.1f MB -> %.1f MB; largest rounding error %.5f of a "
           "row's largest weight\n",
           out, rep.quantized, rep.tensors, (double)rep.bytes_in / 1e6, (double)rep.bytes_out / 1e6, rep.max_rel_err);
    return FU_EXIT_OK;
}

/* ---- prune ---------------------------------------------------------------------------------- */

static int model_prune(int argc, char **argv)
{
    const char *in = NULL, *out = NULL, *method = "salr";
    double sparsity = 0.5;
    long long rank = DAG_SALR_DEFAULT_RANK, seed = 0;
    bool force = false, prune_head = false, keep_head = false;
    const fu_opt opts[] = {
        {"method", 0, FU_OPT_STR, &method, "M", "pruning method: salr (the only one)"},
        {"sparsity", 0, FU_OPT_DOUBLE, &sparsity, "S", "fraction of each linear weight set to zero (default 0.5)"},
        {"svd-rank", 0, FU_OPT_INT, &rank, "R", "rank of the frozen SVD adapter kept for the pruned residual (default 16)"},
        {"seed", 0, FU_OPT_INT, &seed, "S", "seed of the randomized SVD (default 0)"},
        {"prune-lm-head", 0, FU_OPT_FLAG, &prune_head, NULL, "prune lm_head.weight too (the default)"},
        {"keep-lm-head", 0, FU_OPT_FLAG, &keep_head, NULL,
         "keep lm_head.weight dense (closer logits, slower generation: the head is a fifth of a small model)"},
        {"input", 'i', FU_OPT_STR, &in, "DIR", "the dense Hugging Face model directory"},
        {"output", 'o', FU_OPT_STR, &out, "DIR", "where to write the pruned model"},
        {"force", 0, FU_OPT_FLAG, &force, NULL, "write into a non-empty output directory"},
    };
    const fu_cmd cmd = {
        .prog = argv[0],
        .usage = "--method salr -i DIR -o DIR [--sparsity 0.5] [--svd-rank R] [--prune-lm-head | --keep-lm-head]",
        .summary = "Writes a SALR model: every linear weight (the decoder layers' and the output projection\n"
                   "lm_head, unless --keep-lm-head or the embeddings are tied) magnitude-pruned per matrix and\n"
                   "stored bitmap-encoded, with the pruned residual kept as a frozen truncated-SVD adapter.\n"
                   "`fusion run` and `fusion submit` (finetune --method salr, infer) read the result.",
        FU_OPTS_TABLE(opts),
    };
    int code;
    if (fu_opts_parse(&cmd, argc, argv, NULL, &code) != FU_OK)
        return code;
    if (strcmp(method, "salr") != 0) {
        fprintf(stderr, "%s: unknown method '%s' (only salr)\n", cmd.prog, method);
        return FU_EXIT_USAGE;
    }
    if (!in || !out) {
        fprintf(stderr, "%s: needs -i DIR (the dense model) and -o DIR (where to write)\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    if (!(sparsity >= 0 && sparsity < 1) || rank < 1 || rank > 65536) {
        fprintf(stderr, "%s: --sparsity must be in [0, 1) and --svd-rank in 1..65536\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    if (prune_head && keep_head) {
        fprintf(stderr, "%s: --prune-lm-head and --keep-lm-head contradict each other; give one\n", cmd.prog);
        return FU_EXIT_USAGE;
    }
    bool empty = true;
    if (!force && fu_path_exists(out) && (fu_dir_is_empty(out, &empty) != FU_OK || !empty)) {
        fprintf(stderr, "%s: '%s' exists and is not empty; use --force to write into it\n", cmd.prog, out);
        return FU_EXIT_FAIL;
    }
    fu_errmsg em = {0};
    dag_salr_prune_opts po = {.sparsity = sparsity, .rank = (uint32_t)rank, .seed = (uint64_t)seed,
                              .prune_lm_head = !keep_head};
    dag_salr_prune_report rep;
    fu_err rc = dag_salr_prune(in, out, &po, &rep, &em);
    if (rc != FU_OK) {
        fprintf(stderr, "%s: %s\n", cmd.prog, fu_errmsg_text(&em, rc));
        return rc == FU_EINVAL ? FU_EXIT_USAGE : rc == FU_ENOTFOUND ? FU_EXIT_NOTFOUND : FU_EXIT_FAIL;
    }
    if (rep.lm_head_tied)
        fprintf(stderr, "%s: the embeddings are tied (tie_word_embeddings): lm_head is the embedding table, which "
                        "the token lookup needs dense, so it is left dense\n", cmd.prog);
    printf("wrote %s: SALR, sparsity %.2f, residual rank %lld, lm_head %s; %.1f MiB of weights -> %.1f MiB\n", out,
           sparsity, rank, rep.lm_head_pruned ? "pruned" : "dense", (double)rep.bytes_in / 1048576.0,
           (double)rep.bytes_out / 1048576.0);
    printf("  relative error |W - (W_sparse + B*A)| / |W| (Frobenius): %zu block linears mean %.4f, worst %.4f\n",
           rep.n_blocks, rep.blocks_err_mean, rep.blocks_err_max);
    if (rep.lm_head_pruned)
        printf("  lm_head: relative error %.4f (the rank-%lld residual kept %.1f%% of the pruned energy)\n",
               rep.lm_head_err, rank, 100.0 * (1.0 - rep.lm_head_svd_ratio));
    return FU_EXIT_OK;
}

/* ---- dispatch ------------------------------------------------------------------------------- */

static void model_help(void)
{
    printf("Usage: fusion model COMMAND [options]\n\n"
           "Commands:\n"
           "  init     write a random-weight LLaMA model directory (Hugging Face layout)\n"
           "  info     check and summarise a Hugging Face model directory\n"
           "  prune    SALR-prune a model (bitmap-encoded sparse weights + frozen SVD residual adapters)\n"
           "  merge    write an adapter into its base model's weights (a dense Hugging Face model)\n"
           "  quantize make a model's decoder linears int8 (a frozen base for LoRA-FA)\n\n"
           "Run 'fusion model COMMAND --help' for a command's options.\n");
}

int cli_model_main(int argc, char **argv)
{
    if (cli_help_asked(argc, argv)) {
        model_help();
        return argc < 2 ? FU_EXIT_USAGE : FU_EXIT_OK;
    }
    static const cli_sub subs[] = {
        {"init", model_init}, {"info", model_info}, {"prune", model_prune}, {"merge", model_merge},
        {"quantize", model_quantize}};
    int code = cli_sub_dispatch("fusion model", subs, sizeof subs / sizeof subs[0], argc, argv);
    if (code >= 0)
        return code;
    fprintf(stderr, "fusion model: unknown command '%s'\nRun 'fusion model --help' for the list.\n", argv[1]);
    return FU_EXIT_USAGE;
}
