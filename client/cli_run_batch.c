/* `fusion run infer --prompts FILE`: many generations in this process, batched (docs/DAG.md "Batched
 * sessions"). Each prompt of the file is run alone (its prefill), then joins the batch: every step
 * runs the next token of each generation in the batch in one forward (dag_infer_forward_batch, the
 * step a peer's stage takes for its sessions), and a generation that ends makes room for the next
 * prompt. Each generation's result is one JSON line on stdout as it ends. */
#include "cli_run_batch.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_openai.h"
#include "dag_infer.h"
#include "fu_alloc.h"
#include "fu_clock.h"
#include "fu_file.h"
#include "fu_opts.h"
#include "wire.h"

#define CRB_MAX_FILE    ((size_t)64 << 20) /* largest --prompts file */
#define CRB_MAX_PROMPTS 100000             /* prompts one file may hold */

/* One prompt of the file and, while it runs, its generation. */
typedef struct {
    int32_t *prompt;       /* its token ids */
    size_t n_prompt;
    dag_session_t *sess;   /* while running */
    dag_infer_stage is;
    int32_t *ids;          /* generated so far (the EOS token not included) */
    size_t n_ids, cap_ids;
    int32_t next;          /* the token drawn last: the input of its next step */
    size_t text_len;       /* a stop string ended the text here (SIZE_MAX: none) */
} crb_gen;

static void gens_free(crb_gen *g, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(g[i].prompt);
        free(g[i].ids);
        dag_exec_session_destroy(&g[i].sess);
    }
    free(g);
}

/* Line `line` of the file (len bytes, no newline): {"prompt": TEXT} or {"prompt_tokens": [IDS]}. */
static fu_err parse_line(const cli_runmodel *m, const char *line, size_t len, size_t lineno, crb_gen *g,
                         fu_errmsg *em)
{
    cJSON *o = cJSON_ParseWithLength(line, len);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return fu_errmsg_set(em, FU_EINVAL, "line %zu: not a JSON object", lineno);
    }
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "prompt_tokens");
    fu_err rc = FU_OK;
    if (cJSON_IsString(p) == cJSON_IsArray(t)) {
        rc = fu_errmsg_set(em, FU_EINVAL, "line %zu: give one of \"prompt\" (text) or \"prompt_tokens\" (ids)", lineno);
    } else if (cJSON_IsString(p)) {
        rc = fu_tokenizer_encode(m->tok, p->valuestring, strlen(p->valuestring), &g->prompt, &g->n_prompt, em);
    } else {
        g->n_prompt = (size_t)cJSON_GetArraySize(t);
        g->prompt = fu_malloc((g->n_prompt ? g->n_prompt : 1) * sizeof *g->prompt);
        size_t k = 0;
        const cJSON *id;
        cJSON_ArrayForEach(id, t) {
            if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= m->dims.vocab_size ||
                id->valuedouble != (double)(int32_t)id->valuedouble) {
                rc = fu_errmsg_set(em, FU_EINVAL, "line %zu: prompt_tokens must be ids below the vocabulary size %u",
                                   lineno, m->dims.vocab_size);
                break;
            }
            g->prompt[k++] = (int32_t)id->valuedouble;
        }
    }
    cJSON_Delete(o);
    if (rc == FU_OK && (g->n_prompt == 0 || g->n_prompt > CLI_RUN_BATCH_MAX_PROMPT))
        rc = fu_errmsg_set(em, FU_EINVAL, "line %zu: the prompt has %zu tokens (1 to %d accepted)", lineno,
                           g->n_prompt, CLI_RUN_BATCH_MAX_PROMPT);
    return rc;
}

/* The file's prompts (blank lines skipped). */
static fu_err read_prompts(const cli_runmodel *m, const char *path, crb_gen **out, size_t *n_out, fu_errmsg *em)
{
    char *data = NULL;
    size_t len = 0;
    FU_TRY(fu_file_read_all(path, CRB_MAX_FILE, &data, &len, em));
    crb_gen *g = NULL;
    size_t n = 0, cap = 0, lineno = 0;
    fu_err rc = FU_OK;
    for (size_t at = 0; at < len && rc == FU_OK;) {
        const char *nl = memchr(data + at, '\n', len - at);
        size_t end = nl ? (size_t)(nl - data) : len;
        lineno++;
        size_t a = at, b = end;
        while (a < b && (data[a] == ' ' || data[a] == '\t' || data[a] == '\r'))
            a++;
        if (a < b) {
            if (n == CRB_MAX_PROMPTS) {
                rc = fu_errmsg_set(em, FU_EINVAL, "more than %d prompts", CRB_MAX_PROMPTS);
                break;
            }
            if (n == cap)
                g = fu_realloc(g, (cap = cap ? 2 * cap : 16) * sizeof *g);
            memset(&g[n], 0, sizeof g[n]);
            rc = parse_line(m, data + a, b - a, lineno, &g[n], em);
            n++;
        }
        at = end + 1;
    }
    free(data);
    if (rc == FU_OK && n == 0)
        rc = fu_errmsg_set(em, FU_EINVAL, "no prompts in the file");
    if (rc != FU_OK) {
        gens_free(g, n);
        char why[sizeof em->msg];
        memcpy(why, em->msg, sizeof why);
        return fu_errmsg_set(em, rc, "--prompts '%s': %s", path, why);
    }
    *out = g;
    *n_out = n;
    return FU_OK;
}

/* Token id drawn for generation g: whether it ends it, and why (*finish). */
static bool take_token(const cli_runmodel *m, const dag_spec *spec, crb_gen *g, int32_t id, const char **finish)
{
    if (fu_modelcfg_is_eos(&m->cfg, fu_tokenizer_eos_id(m->tok), id)) {
        *finish = "stop";
        return true;
    }
    if (g->n_ids == g->cap_ids)
        g->ids = fu_realloc(g->ids, (g->cap_ids = g->cap_ids ? 2 * g->cap_ids : 64) * sizeof *g->ids);
    g->ids[g->n_ids++] = id;
    g->next = id;
    if (spec->n_stop) {
        char *text = NULL;
        size_t len = 0;
        if (fu_tokenizer_decode(m->tok, g->ids, g->n_ids, &text, &len, NULL) == FU_OK) {
            const char *stops[DAG_SPEC_MAX_STOP];
            for (uint32_t i = 0; i < spec->n_stop; i++)
                stops[i] = spec->stop[i];
            bool stopped = false;
            size_t upto = cli_oai_release(text, len, stops, spec->n_stop, false, 0, &stopped);
            free(text);
            if (stopped) {
                g->text_len = upto;
                *finish = "stop";
                return true;
            }
        }
    }
    if ((long long)g->n_ids >= spec->max_tokens) {
        *finish = "length";
        return true;
    }
    return false;
}

/* Generation `index` ended: its JSON line on stdout. */
static void emit(const cli_runmodel *m, size_t index, const crb_gen *g, const char *finish)
{
    char *text = NULL;
    size_t len = 0;
    if (fu_tokenizer_decode(m->tok, g->ids, g->n_ids, &text, &len, NULL) != FU_OK)
        len = 0;
    if (g->text_len != SIZE_MAX && g->text_len < len)
        len = g->text_len;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", (double)index);
    char *t = fu_malloc(len + 1);
    if (len)
        memcpy(t, text, len);
    t[len] = '\0';
    wire_utf8_clean(t, len); /* JSON carries text: bytes that are none show as '?', as the broker shows them */
    cJSON_AddStringToObject(o, "text", t);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)g->n_prompt);
    cJSON_AddNumberToObject(o, "completion_tokens", (double)g->n_ids);
    cJSON_AddStringToObject(o, "finish_reason", finish);
    char *line = cJSON_PrintUnformatted(o);
    if (line) {
        fputs(line, stdout);
        fputc('\n', stdout);
        fflush(stdout);
    }
    free(line);
    cJSON_Delete(o);
    free(t);
    free(text);
}

int cli_run_infer_batch(const char *prog, const cli_runmodel *m, const dag_spec *spec, const dag_build_opts *bo,
                        const fu_safetensors *ast, const char *path, uint32_t batch, bool quiet)
{
    fu_errmsg em = {{0}};
    crb_gen *g = NULL;
    size_t n = 0;
    fu_err rc = read_prompts(m, path, &g, &n, &em);
    if (rc != FU_OK)
        return cli_run_fail(prog, rc, &em);
    size_t longest = 0;
    for (size_t i = 0; i < n; i++)
        longest = g[i].n_prompt > longest ? g[i].n_prompt : longest;
    dag_exec_opts eo = {.max_tokens = (uint32_t)(longest > batch ? longest : batch), .n_slots = 1,
                        .max_context = (uint32_t)(longest + (size_t)spec->max_tokens + 1)};
    dag_graph_t *graph = NULL;
    dag_exec_t *x = NULL;
    if ((rc = cli_runmodel_exec(m, bo, &eo, &graph, &x, &em)) != FU_OK ||
        (ast && (rc = dag_exec_load_adapter(x, ast, &em)) != FU_OK)) {
        int code = cli_run_fail(prog, rc, &em);
        dag_exec_destroy(&x);
        dag_graph_destroy(&graph);
        gens_free(g, n);
        return code;
    }
    size_t *live = fu_malloc((size_t)batch * sizeof *live); /* indices of the batch's generations */
    dag_infer_stage **b = fu_malloc((size_t)batch * sizeof *b);
    int32_t *toks = fu_malloc((size_t)batch * sizeof *toks);
    uint64_t *rows = fu_malloc((size_t)batch * sizeof *rows);
    size_t n_live = 0, next_prompt = 0, steps = 0, widest = 0;
    uint64_t generated = 0;
    double t0 = fu_clock_sec();
    while (rc == FU_OK && (n_live || next_prompt < n)) {
        /* Room in the batch: the next prompts run their prefill and join. */
        while (rc == FU_OK && n_live < batch && next_prompt < n) {
            size_t i = next_prompt++;
            crb_gen *q = &g[i];
            dag_spec own = *spec;
            own.seed = spec->seed + i; /* each generation draws its own tokens */
            q->text_len = SIZE_MAX;
            if ((rc = dag_exec_session_new(x, &q->sess)) != FU_OK ||
                (rc = dag_infer_stage_init(&q->is, x, graph, q->sess, &own, true, true, 0)) != FU_OK ||
                (rc = dag_infer_forward(&q->is, q->prompt, NULL, 0, q->n_prompt, &em)) != FU_OK ||
                (rc = dag_infer_sampled(&q->is, &q->next)) != FU_OK)
                break;
            generated++;
            const char *finish = NULL;
            if (take_token(m, spec, q, q->next, &finish)) {
                emit(m, i, q, finish);
                dag_exec_session_destroy(&q->sess);
            } else {
                live[n_live++] = i;
            }
        }
        if (rc != FU_OK || n_live == 0)
            continue;
        /* One step of every generation in the batch. */
        for (size_t k = 0; k < n_live; k++) {
            b[k] = &g[live[k]].is;
            toks[k] = g[live[k]].next;
            rows[k] = 1;
        }
        if ((rc = dag_infer_forward_batch(b, n_live, toks, NULL, 0, rows, &em)) != FU_OK)
            break;
        steps++;
        widest = n_live > widest ? n_live : widest;
        size_t kept = 0;
        for (size_t k = 0; k < n_live && rc == FU_OK; k++) {
            crb_gen *q = &g[live[k]];
            int32_t id = 0;
            if ((rc = dag_infer_sampled(&q->is, &id)) != FU_OK)
                break;
            generated++;
            const char *finish = NULL;
            if (take_token(m, spec, q, id, &finish)) {
                emit(m, live[k], q, finish);
                dag_exec_session_destroy(&q->sess);
            } else {
                live[kept++] = live[k];
            }
        }
        n_live = kept;
    }
    double secs = fu_clock_sec() - t0;
    int code = FU_EXIT_OK;
    if (rc != FU_OK) {
        fprintf(stderr, "%s: generation failed: %s\n", prog, em.msg[0] ? em.msg : fu_strerror(rc));
        code = FU_EXIT_FAIL;
    } else if (!quiet) {
        fprintf(stderr,
                "%zu generations: %" PRIu64 " tokens in %.3f s (%.1f tokens/s), %zu batched steps of up to %zu\n", n,
                generated, secs, (double)generated / (secs > 0 ? secs : 1e-9), steps, widest);
    }
    free(rows);
    free(toks);
    free(b);
    free(live);
    gens_free(g, n);
    dag_exec_destroy(&x);
    dag_graph_destroy(&graph);
    return code;
}
