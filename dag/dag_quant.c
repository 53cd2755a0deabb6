#include "dag_quant.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dag_model.h"
#include "fu_alloc.h"
#include "fu_file.h"
#include "fu_modelcfg.h"
#include "fu_safetensors.h"

/* One tensor of the output: a source weight copied, or one half (values or scales) of a quantized one. */
typedef struct {
    fu_weight_info w;
    const fu_st_tensor *src;
    enum { COPY, QVALUES, QSCALES } part;
    char name[sizeof ((fu_weight_info *)0)->name + sizeof FU_ST_QSCALE_SUFFIX];
} qtensor;

typedef struct {
    const fu_safetensors *st;
    qtensor *q;
    dag_quant_report *rep;
    fu_errmsg *em;
} quant_ctx;

static bool is_linear(fu_weight_kind k)
{
    return k == FU_W_Q || k == FU_W_K || k == FU_W_V || k == FU_W_O || k == FU_W_GATE || k == FU_W_UP ||
           k == FU_W_DOWN;
}

/* Row r's scale: max|row| / 127 (0 for a row of zeros). */
static float row_scale(const float *row, uint64_t cols)
{
    float amax = 0.0f;
    for (uint64_t c = 0; c < cols; c++)
        amax = fmaxf(amax, fabsf(row[c]));
    return amax / 127.0f;
}

static fu_err fill(void *vctx, size_t i, const fu_st_tensor *t, void *buf, size_t nbytes)
{
    quant_ctx *c = vctx;
    const qtensor *q = &c->q[i];
    (void)t;
    if (q->part == COPY) {
        memcpy(buf, q->src->data, nbytes);
        return FU_OK;
    }
    const uint64_t rows = q->w.shape[0], cols = q->w.shape[1];
    float *w = fu_malloc((size_t)(rows * cols) * sizeof *w);
    fu_err rc = fu_safetensors_read_f32(c->st, q->w.name, 2, q->w.shape, w, (size_t)(rows * cols), c->em);
    for (uint64_t r = 0; rc == FU_OK && r < rows; r++) {
        const float *row = w + r * cols;
        for (uint64_t k = 0; k < cols; k++)
            if (!isfinite(row[k])) {
                rc = fu_errmsg_set(c->em, FU_EINVAL, "'%s' holds a value that is not finite (row %llu)", q->w.name,
                                   (unsigned long long)r);
                break;
            }
        if (rc != FU_OK)
            break;
        const float s = row_scale(row, cols);
        if (q->part == QSCALES) {
            ((float *)buf)[r] = s;
            continue;
        }
        int8_t *out = (int8_t *)buf + r * cols;
        double worst = 0.0;
        for (uint64_t k = 0; k < cols; k++) {
            float v = s > 0.0f ? nearbyintf(row[k] / s) : 0.0f;
            out[k] = (int8_t)fmaxf(-127.0f, fminf(127.0f, v));
            double err = fabs((double)row[k] - (double)((float)out[k] * s));
            worst = err > worst ? err : worst;
        }
        if (s > 0.0f && worst / (127.0 * (double)s) > c->rep->max_rel_err)
            c->rep->max_rel_err = worst / (127.0 * (double)s);
    }
    free(w);
    return rc;
}

fu_err dag_model_quantize(const char *model_dir, const char *out_dir, bool force, dag_quant_report *rep,
                          fu_errmsg *em)
{
    dag_quant_report scratch;
    rep = rep ? rep : &scratch;
    memset(rep, 0, sizeof *rep);
    fu_modelcfg cfg;
    FU_TRY(fu_modelcfg_load(model_dir, &cfg, em));
    if (cfg.int8_weights)
        return fu_errmsg_set(em, FU_EINVAL, "'%s' is already quantized (int8)", model_dir);
    char *sc = fu_path_join(model_dir, DAG_SALR_CONFIG_FILE);
    bool salr = fu_path_exists(sc);
    free(sc);
    if (salr)
        return fu_errmsg_set(em, FU_EINVAL,
                             "'%s' is SALR-pruned: its linears are bitmap-encoded already (quantize the dense model)",
                             model_dir);
    char *probe = fu_path_join(out_dir, FU_MODELCFG_FILE);
    bool exists = fu_path_exists(probe);
    free(probe);
    if (exists && !force)
        return fu_errmsg_set(em, FU_EEXIST, "'%s' already holds a model (use --force to replace it)", out_dir);
    fu_safetensors *st = NULL;
    FU_TRY(fu_safetensors_open_dir(model_dir, &st, em));
    fu_err rc = fu_modelcfg_check_weights(&cfg, st, em);
    const size_t n = fu_modelcfg_weight_count(&cfg);
    qtensor *q = fu_calloc(2 * n, sizeof *q);
    fu_st_tensor *ts = fu_calloc(2 * n, sizeof *ts);
    size_t m = 0;
    for (size_t i = 0; rc == FU_OK && i < n; i++) {
        fu_weight_info w;
        if ((rc = fu_modelcfg_weight(&cfg, i, &w)) != FU_OK)
            break;
        const fu_st_tensor *src = fu_safetensors_get(st, w.name);
        rep->tensors++;
        rep->bytes_in += src->nbytes;
        const bool quant = is_linear(w.kind) && w.ndim == 2;
        for (int part = 0; part < (quant ? 2 : 1); part++, m++) {
            q[m] = (qtensor){.w = w, .src = src, .part = quant ? (part ? QSCALES : QVALUES) : COPY};
            snprintf(q[m].name, sizeof q[m].name, "%s%s", w.name, part ? FU_ST_QSCALE_SUFFIX : "");
            ts[m].name = q[m].name;
            ts[m].ndim = 2;
            if (!quant) { /* as in the source */
                ts[m].dtype = src->dtype;
                ts[m].ndim = src->ndim;
                memcpy(ts[m].shape, src->shape, sizeof ts[m].shape);
                ts[m].nelem = src->nelem;
                ts[m].nbytes = src->nbytes;
            } else if (part == 0) {
                ts[m].dtype = FU_ST_I8;
                ts[m].shape[0] = w.shape[0], ts[m].shape[1] = w.shape[1];
                ts[m].nelem = w.shape[0] * w.shape[1];
                ts[m].nbytes = ts[m].nelem;
            } else {
                ts[m].dtype = FU_ST_F32;
                ts[m].shape[0] = w.shape[0], ts[m].shape[1] = 1;
                ts[m].nelem = w.shape[0];
                ts[m].nbytes = w.shape[0] * sizeof(float);
            }
            rep->bytes_out += ts[m].nbytes;
        }
        rep->quantized += quant;
    }
    if (rc == FU_OK)
        rc = fu_mkdir_p(out_dir, 0755, em);
    if (rc == FU_OK) {
        quant_ctx c = {.st = st, .q = q, .rep = rep, .em = em};
        char *out = fu_path_join(out_dir, FU_ST_SINGLE_FILE);
        rc = fu_safetensors_write(out, ts, m, NULL, 0, fill, &c, em);
        free(out);
    }
    if (rc == FU_OK) {
        cfg.int8_weights = true;
        rc = fu_modelcfg_save(out_dir, &cfg, em);
    }
    if (rc == FU_OK)
        rc = dag_model_copy_tokenizer(model_dir, out_dir, em);
    free(q);
    free(ts);
    fu_safetensors_close(&st);
    return rc;
}
