#include "dag_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "fu_alloc.h"
#include "fu_rng.h"
#include "fu_safetensors.h"
#include "fu_tokenizer.h"
#include "kern_bitmap.h"
#include "kern_salr.h"

/* Copies dir/name to out_dir when it is there. */
static fu_err copy_file(const char *dir, const char *out_dir, const char *name, fu_errmsg *em)
{
    char *src = fu_path_join(dir, name), *dst = fu_path_join(out_dir, name), *txt = NULL;
    size_t len = 0;
    fu_err rc = FU_OK;
    if (fu_path_exists(src) && (rc = fu_file_read_all(src, FU_TOKENIZER_MAX_BYTES, &txt, &len, em)) == FU_OK)
        rc = fu_file_write_atomic(dst, txt, len, 0644, em);
    free(txt);
    free(src);
    free(dst);
    return rc;
}

fu_err dag_model_copy_tokenizer(const char *dir, const char *out_dir, fu_errmsg *em)
{
    FU_TRY(copy_file(dir, out_dir, FU_TOKENIZER_FILE, em));
    return copy_file(dir, out_dir, FU_TOKENIZER_CONFIG_FILE, em);
}

void dag_dims_from_cfg(const fu_modelcfg *c, dag_model_dims *d)
{
    memset(d, 0, sizeof *d);
    d->vocab_size = (uint32_t)c->vocab_size;
    d->hidden_size = (uint32_t)c->hidden_size;
    d->intermediate_size = (uint32_t)c->intermediate_size;
    d->n_layers = (uint32_t)c->num_hidden_layers;
    d->n_heads = (uint32_t)c->num_attention_heads;
    d->n_kv_heads = (uint32_t)c->num_key_value_heads;
    d->head_dim = (uint32_t)c->head_dim;
    d->rms_eps = (float)c->rms_norm_eps;
    d->rope_theta = (float)c->rope_theta;
    d->tie_word_embeddings = c->tie_word_embeddings;
    d->rope_factor = (float)c->rope_factor;
    d->rope_low_freq = (float)c->rope_low_freq_factor;
    d->rope_high_freq = (float)c->rope_high_freq_factor;
    d->rope_orig_max = (float)c->rope_original_max_pos;
    d->sliding_window = c->sliding_window < UINT32_MAX ? (uint32_t)c->sliding_window : 0;
    d->qkv_bias = c->attn_qkv_bias;
    d->o_bias = c->attn_o_bias;
    d->qk_norm = c->qk_norm;
    d->int8_weights = c->int8_weights;
}

/* ---- random model ----------------------------------------------------------------------------- */

typedef struct {
    uint64_t seed;
    float std;
    const fu_weight_info *w;
} rand_ctx;

static fu_err rand_fill(void *vctx, size_t index, const fu_st_tensor *t, void *buf, size_t nbytes)
{
    const rand_ctx *c = vctx;
    float *f = t->dtype == FU_ST_F32 ? buf : fu_malloc(t->nelem * sizeof *f);
    (void)nbytes;
    if (c->w[index].is_norm) {
        for (size_t i = 0; i < t->nelem; i++)
            f[i] = 1.0f;
    } else {
        fu_rng r;
        fu_rng_seed_stream(&r, c->seed, c->w[index].name);
        fu_rng_fill_normal_f32(&r, f, t->nelem, 0.0f, c->std);
    }
    fu_err rc = FU_OK;
    if (t->dtype != FU_ST_F32) {
        rc = fu_st_from_f32(t->dtype, f, t->nelem, buf);
        free(f);
    }
    return rc;
}

fu_err dag_model_init_random(const char *dir, const fu_modelcfg *cfg, uint64_t seed, float std, fu_errmsg *em)
{
    return dag_model_init_random_as(dir, cfg, seed, std, FU_ST_F32, em);
}

fu_err dag_model_init_random_as(const char *dir, const fu_modelcfg *cfg, uint64_t seed, float std,
                                fu_st_dtype dtype, fu_errmsg *em)
{
    if (!dir || !cfg || (dtype != FU_ST_F32 && dtype != FU_ST_F16 && dtype != FU_ST_BF16))
        return FU_EINVAL;
    FU_TRY(fu_modelcfg_validate(cfg, em));
    FU_TRY(fu_mkdir_p(dir, 0755, em));
    size_t n = fu_modelcfg_weight_count(cfg);
    fu_weight_info *w = fu_calloc(n, sizeof *w);
    fu_st_tensor *t = fu_calloc(n, sizeof *t);
    fu_err rc = FU_OK;
    for (size_t i = 0; i < n && rc == FU_OK; i++) {
        rc = fu_modelcfg_weight(cfg, i, &w[i]);
        t[i].name = w[i].name;
        t[i].dtype = dtype;
        t[i].ndim = w[i].ndim;
        t[i].nelem = 1;
        for (size_t k = 0; k < w[i].ndim; k++) {
            t[i].shape[k] = w[i].shape[k];
            t[i].nelem *= (size_t)w[i].shape[k];
        }
    }
    rand_ctx ctx = {.seed = seed, .std = std, .w = w};
    char *path = fu_path_join(dir, FU_ST_SINGLE_FILE);
    if (rc == FU_OK)
        rc = fu_safetensors_write(path, t, n, NULL, 0, rand_fill, &ctx, em);
    if (rc == FU_OK)
        rc = fu_modelcfg_save(dir, cfg, em);
    free(path);
    free(t);
    free(w);
    return rc;
}

/* ---- SALR pruning --------------------------------------------------------------------------- */

static bool is_linear(fu_weight_kind k)
{
    return k == FU_W_Q || k == FU_W_K || k == FU_W_V || k == FU_W_O || k == FU_W_GATE || k == FU_W_UP ||
           k == FU_W_DOWN;
}

typedef struct {
    fu_st_tensor *t;
    char **names;
    void **data;
    size_t n, cap;
} out_list;

static void out_add(out_list *l, const char *name, fu_st_dtype dt, size_t ndim, uint64_t d0, uint64_t d1, void *data,
                    size_t nbytes)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->t = fu_realloc(l->t, l->cap * sizeof *l->t);
        l->names = fu_realloc(l->names, l->cap * sizeof *l->names);
        l->data = fu_realloc(l->data, l->cap * sizeof *l->data);
    }
    fu_st_tensor *t = &l->t[l->n];
    memset(t, 0, sizeof *t);
    l->names[l->n] = fu_strdup(name);
    l->data[l->n] = data;
    t->name = l->names[l->n];
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->nelem = ndim == 1 ? (size_t)d0 : (size_t)(d0 * d1);
    t->data = data;
    t->nbytes = nbytes;
    l->n++;
}

static void out_free(out_list *l)
{
    for (size_t i = 0; i < l->n; i++) {
        free(l->names[i]);
        free(l->data[i]);
    }
    free(l->t);
    free(l->names);
    free(l->data);
}

static double sumsq(const float *f, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (double)f[i] * f[i];
    return s;
}

/* Prunes one matrix f [rows, cols] (consumed: freed) into l's tensors and meta's format entry.
 * *rel_err and *svd_ratio receive its errors (see dag_salr_prune_report). */
static fu_err prune_matrix(out_list *l, char ***meta, size_t *n_meta, const char *wname, float *f, size_t rows,
                           size_t cols, const dag_salr_prune_opts *o, uint64_t seed, double *rel_err,
                           double *svd_ratio, fu_errmsg *em)
{
    uint32_t rank = o->rank;
    if (rank > (rows < cols ? rows : cols)) {
        free(f);
        return fu_errmsg_set(em, FU_EINVAL, "residual rank %u exceeds the smaller side of '%s' [%zu, %zu]", rank,
                             wname, rows, cols);
    }
    size_t ne = rows * cols;
    double w2 = sumsq(f, ne), r2 = 0, ratio = 0;
    float *res = fu_malloc(ne * sizeof *res);
    fu_err rc = kern_salr_prune(f, rows, cols, o->sparsity, f, res, NULL);
    float *la = fu_malloc((size_t)rank * cols * sizeof *la);
    float *lb = fu_malloc(rows * (size_t)rank * sizeof *lb);
    if (rc == FU_OK) {
        r2 = sumsq(res, ne);
        rc = kern_salr_svd(res, rows, cols, rank, KERN_SALR_SVD_AUTO, seed, la, lb, &ratio);
    }
    free(res);
    kern_bitmap_t *bm = NULL;
    if (rc == FU_OK)
        rc = kern_bitmap_encode(f, rows, cols, cols, KERN_BITMAP_F32, &bm);
    free(f);
    if (rc != FU_OK) {
        free(la);
        free(lb);
        return fu_errmsg_set(em, rc, "cannot prune '%s'", wname);
    }
    *rel_err = w2 > 0 ? sqrt(ratio * r2 / w2) : 0.0;
    *svd_ratio = ratio;
    char name[160], mod[100];
    snprintf(mod, sizeof mod, "%s", wname);
    size_t ml = strlen(mod);
    if (ml > 7 && strcmp(mod + ml - 7, ".weight") == 0)
        mod[ml - 7] = '\0';
    size_t blen, vlen, olen;
    const uint8_t *bb = kern_bitmap_bitmap(bm, &blen);
    const void *vv = kern_bitmap_values(bm, &vlen);
    const int32_t *oo = kern_bitmap_offsets(bm, &olen);
    void *bc = fu_malloc(blen ? blen : 1), *vc = fu_malloc(vlen ? vlen : 1), *oc = fu_malloc(olen ? olen : 1);
    memcpy(bc, bb, blen);
    memcpy(vc, vv, vlen);
    memcpy(oc, oo, olen);
    snprintf(name, sizeof name, "%s.bitmap", wname);
    out_add(l, name, FU_ST_U8, 1, blen, 1, bc, blen);
    snprintf(name, sizeof name, "%s.values", wname);
    out_add(l, name, FU_ST_F32, 1, vlen / sizeof(float), 1, vc, vlen);
    snprintf(name, sizeof name, "%s.offsets", wname);
    out_add(l, name, FU_ST_I32, 1, olen / sizeof(int32_t), 1, oc, olen);
    snprintf(name, sizeof name, "%s.salr_A.weight", mod);
    out_add(l, name, FU_ST_F32, 2, rank, cols, la, (size_t)rank * cols * sizeof(float));
    snprintf(name, sizeof name, "%s.salr_B.weight", mod);
    out_add(l, name, FU_ST_F32, 2, rows, rank, lb, rows * (size_t)rank * sizeof(float));
    kern_bitmap_destroy(&bm);
    *meta = fu_realloc(*meta, (2 * *n_meta + 2) * sizeof **meta);
    snprintf(name, sizeof name, "%s.format", wname);
    (*meta)[2 * *n_meta] = fu_strdup(name);
    (*meta)[2 * *n_meta + 1] = fu_strdup(KERN_BITMAP_FORMAT_NAME);
    (*n_meta)++;
    return FU_OK;
}

fu_err dag_salr_prune(const char *in_dir, const char *out_dir, const dag_salr_prune_opts *o,
                      dag_salr_prune_report *rep_out, fu_errmsg *em)
{
    if (!in_dir || !out_dir || !o)
        return FU_EINVAL;
    if (!(o->sparsity >= 0.0 && o->sparsity < 1.0))
        return fu_errmsg_set(em, FU_EINVAL, "sparsity %g is outside [0, 1)", o->sparsity);
    if (o->rank == 0)
        return fu_errmsg_set(em, FU_EINVAL, "the residual rank must be at least 1");
    fu_modelcfg cfg;
    FU_TRY(fu_modelcfg_load(in_dir, &cfg, em));
    if (cfg.int8_weights)
        return fu_errmsg_set(em, FU_EINVAL, "'%s' is quantized (int8): prune the model it was quantized from", in_dir);
    fu_safetensors *st = NULL;
    FU_TRY(fu_safetensors_open_dir(in_dir, &st, em));
    dag_salr_prune_report rep;
    memset(&rep, 0, sizeof rep);
    rep.lm_head_tied = o->prune_lm_head && cfg.tie_word_embeddings;
    out_list l = {0};
    char **meta = NULL;
    size_t n_meta = 0;
    fu_err rc = FU_OK;
    size_t n = fu_modelcfg_weight_count(&cfg);
    for (size_t i = 0; i < n && rc == FU_OK; i++) {
        fu_weight_info w;
        rc = fu_modelcfg_weight(&cfg, i, &w);
        if (rc != FU_OK)
            break;
        size_t ne = w.ndim == 1 ? (size_t)w.shape[0] : (size_t)(w.shape[0] * w.shape[1]);
        float *f = fu_malloc(ne * sizeof *f);
        rc = fu_safetensors_read_f32(st, w.name, w.ndim, w.shape, f, ne, em);
        if (rc != FU_OK) {
            free(f);
            break;
        }
        rep.bytes_in += ne * sizeof(float);
        bool lm = w.kind == FU_W_LM_HEAD && o->prune_lm_head;
        if (!is_linear(w.kind) && !lm) {
            out_add(&l, w.name, FU_ST_F32, w.ndim, w.shape[0], w.shape[1], f, ne * sizeof *f);
            continue;
        }
        double err = 0, ratio = 0;
        rc = prune_matrix(&l, &meta, &n_meta, w.name, f, (size_t)w.shape[0], (size_t)w.shape[1], o,
                          o->seed ^ (uint64_t)i, &err, &ratio, em);
        if (rc != FU_OK)
            break;
        if (lm) {
            rep.lm_head_pruned = true;
            rep.lm_head_err = err;
            rep.lm_head_svd_ratio = ratio;
        } else {
            rep.n_blocks++;
            rep.blocks_err_mean += err;
            if (err > rep.blocks_err_max)
                rep.blocks_err_max = err;
        }
    }
    fu_safetensors_close(&st);
    if (rep.n_blocks)
        rep.blocks_err_mean /= (double)rep.n_blocks;
    for (size_t i = 0; i < l.n; i++)
        rep.bytes_out += l.t[i].nbytes;
    if (rc == FU_OK)
        rc = fu_mkdir_p(out_dir, 0755, em);
    if (rc == FU_OK) {
        char *path = fu_path_join(out_dir, FU_ST_SINGLE_FILE);
        rc = fu_safetensors_write(path, l.t, l.n, (const char *const *)meta, n_meta, NULL, NULL, em);
        free(path);
    }
    if (rc == FU_OK)
        rc = fu_modelcfg_save(out_dir, &cfg, em);
    if (rc == FU_OK) {
        char js[320];
        int len = snprintf(js, sizeof js,
                           "{\n  \"method\": \"salr\",\n  \"sparsity\": %.6g,\n  \"residual_rank\": %u,\n"
                           "  \"format\": \"%s\",\n  \"lm_head\": \"%s\"\n}\n",
                           o->sparsity, o->rank, KERN_BITMAP_FORMAT_NAME, rep.lm_head_pruned ? "salr" : "dense");
        char *path = fu_path_join(out_dir, DAG_SALR_CONFIG_FILE);
        rc = fu_file_write_atomic(path, js, (size_t)len, 0644, em);
        free(path);
    }
    for (size_t i = 0; i < 2 * n_meta; i++)
        free(meta[i]);
    free(meta);
    out_free(&l);
    if (rc == FU_OK && rep_out)
        *rep_out = rep;
    return rc;
}

fu_err dag_salr_prune_model(const char *in_dir, const char *out_dir, double sparsity, uint32_t rank, uint64_t seed,
                            fu_errmsg *em)
{
    dag_salr_prune_opts o = {.sparsity = sparsity, .rank = rank, .seed = seed, .prune_lm_head = false};
    return dag_salr_prune(in_dir, out_dir, &o, NULL, em);
}

fu_err dag_salr_info_load(const char *dir, dag_salr_info *out, fu_errmsg *em)
{
    if (!dir || !out)
        return FU_EINVAL;
    char *path = fu_path_join(dir, DAG_SALR_CONFIG_FILE);
    char *txt = NULL;
    size_t len = 0;
    fu_err rc = fu_file_read_all(path, 1 << 16, &txt, &len, em);
    free(path);
    if (rc == FU_ENOTFOUND)
        return fu_errmsg_set(em, FU_ENOTFOUND,
                             "model dir '%s' has no %s (not a SALR-pruned model: make one with `fusion model prune`)",
                             dir, DAG_SALR_CONFIG_FILE);
    FU_TRY(rc);
    rc = dag_salr_info_parse(txt, len, out, em);
    free(txt);
    return rc;
}

fu_err dag_salr_info_parse(const char *txt, size_t len, dag_salr_info *out, fu_errmsg *em)
{
    if (!txt || !out)
        return FU_EINVAL;
    fu_err rc;
    cJSON *j = cJSON_ParseWithLength(txt, len);
    if (!j)
        return fu_errmsg_set(em, FU_EPROTO, "%s: not valid JSON", DAG_SALR_CONFIG_FILE);
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "residual_rank");
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(j, "sparsity");
    const cJSON *lh = cJSON_GetObjectItemCaseSensitive(j, "lm_head");
    rc = FU_OK;
    if (!cJSON_IsNumber(r) || r->valuedouble < 1 || r->valuedouble > DAG_MAX_RANK || !cJSON_IsNumber(s) ||
        !(s->valuedouble >= 0 && s->valuedouble < 1))
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: residual_rank must be 1..%d and sparsity in [0, 1)",
                           DAG_SALR_CONFIG_FILE, DAG_MAX_RANK);
    else if (lh && !(cJSON_IsString(lh) && (strcmp(lh->valuestring, "salr") == 0 ||
                                            strcmp(lh->valuestring, "dense") == 0)))
        rc = fu_errmsg_set(em, FU_EPROTO, "%s: lm_head must be \"salr\" or \"dense\"", DAG_SALR_CONFIG_FILE);
    else {
        out->residual_rank = (uint32_t)r->valuedouble;
        out->sparsity = s->valuedouble;
        out->lm_head = lh && strcmp(lh->valuestring, "salr") == 0;
    }
    cJSON_Delete(j);
    return rc;
}
