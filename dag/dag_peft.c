#include "dag_peft.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "dag_graph.h"
#include "fu_file.h"

char *dag_peft_config_json(const char *base_model, uint32_t r, double alpha, uint32_t targets)
{
    if (!targets)
        targets = DAG_TARGETS_ALL;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "peft_type", "LORA");
    cJSON_AddStringToObject(o, "task_type", "CAUSAL_LM");
    cJSON_AddStringToObject(o, "base_model_name_or_path", base_model ? base_model : "");
    cJSON_AddNumberToObject(o, "r", r);
    cJSON_AddNumberToObject(o, "lora_alpha", alpha);
    cJSON_AddNumberToObject(o, "lora_dropout", 0.0);
    cJSON_AddStringToObject(o, "bias", "none");
    cJSON_AddFalseToObject(o, "fan_in_fan_out");
    cJSON_AddTrueToObject(o, "inference_mode");
    cJSON_AddTrueToObject(o, "init_lora_weights");
    cJSON *tm = cJSON_AddArrayToObject(o, "target_modules");
    for (int t = 1; t < DAG_TARGET_COUNT_; t++)
        if (targets & DAG_TARGET_BIT(t))
            cJSON_AddItemToArray(tm, cJSON_CreateString(dag_target_name((dag_target)t)));
    cJSON_AddNullToObject(o, "modules_to_save");
    cJSON_AddNullToObject(o, "revision");
    return fu_file_json_text(o, "fusion: out of memory writing adapter_config.json");
}

size_t dag_peft_node_tensors(const dag_node *nd, bool with_state, dag_peft_tensor out[DAG_PEFT_PER_NODE])
{
    if (nd->op != DAG_OP_LINEAR || nd->adapter.method == DAG_ADAPTER_NONE || nd->adapter.rank == 0)
        return 0;
    uint64_t r = nd->adapter.rank;
    bool train_a = nd->adapter.method == DAG_ADAPTER_LORA;
    const struct {
        const char *suffix;
        uint64_t d0, d1;
        bool present;
    } items[DAG_PEFT_PER_NODE] = {
        {"lora_A.weight", r, nd->dim_in, true},
        {"lora_B.weight", nd->dim_out, r, true},
        {"lora_A.weight.adam_m", r, nd->dim_in, with_state && train_a},
        {"lora_A.weight.adam_v", r, nd->dim_in, with_state && train_a},
        {"lora_B.weight.adam_m", nd->dim_out, r, with_state},
        {"lora_B.weight.adam_v", nd->dim_out, r, with_state},
    };
    /* "model.layers.0.self_attn.q_proj.weight" -> module "model.layers.0.self_attn.q_proj" */
    char mod[DAG_NAME_MAX];
    snprintf(mod, sizeof mod, "%s", nd->params[0]);
    size_t l = strlen(mod);
    if (l > 7 && strcmp(mod + l - 7, ".weight") == 0)
        mod[l - 7] = '\0';
    size_t n = 0;
    for (size_t k = 0; k < DAG_PEFT_PER_NODE; k++) {
        if (!items[k].present)
            continue;
        snprintf(out[n].name, sizeof out[n].name, DAG_PEFT_PREFIX "%s.%s", mod, items[k].suffix);
        out[n].shape[0] = items[k].d0;
        out[n].shape[1] = items[k].d1;
        n++;
    }
    return n;
}

fu_err dag_peft_check(const dag_graph_t *g, size_t first, size_t last, bool with_state, const fu_safetensors *st,
                      fu_errmsg *em)
{
    if (!g || !st || first > last || last > dag_graph_size(g))
        return fu_errmsg_set(em, FU_EINVAL, "dag_peft_check: bad arguments");
    size_t want = 0;
    for (size_t i = first; i < last; i++) {
        dag_peft_tensor pt[DAG_PEFT_PER_NODE];
        size_t n = dag_peft_node_tensors(dag_graph_node(g, i), with_state, pt);
        for (size_t k = 0; k < n; k++) {
            const fu_st_tensor *t = fu_safetensors_get(st, pt[k].name);
            if (!t)
                return fu_errmsg_set(em, FU_EPROTO, "no tensor '%s'", pt[k].name);
            if (t->dtype != FU_ST_F32 || t->ndim != 2 || t->shape[0] != pt[k].shape[0] ||
                t->shape[1] != pt[k].shape[1])
                return fu_errmsg_set(em, FU_EPROTO, "'%s' is not float32 [%" PRIu64 ", %" PRIu64 "]", pt[k].name,
                                     pt[k].shape[0], pt[k].shape[1]);
        }
        want += n;
    }
    size_t have = fu_safetensors_count(st);
    if (have != want) { /* every wanted one is there: the rest are strangers */
        for (size_t i = 0; i < have; i++) {
            const char *name = fu_safetensors_at(st, i)->name;
            bool ours = false;
            for (size_t n = first; n < last && !ours; n++) {
                dag_peft_tensor pt[DAG_PEFT_PER_NODE];
                size_t c = dag_peft_node_tensors(dag_graph_node(g, n), with_state, pt);
                for (size_t k = 0; k < c && !ours; k++)
                    ours = strcmp(pt[k].name, name) == 0;
            }
            if (!ours)
                return fu_errmsg_set(em, FU_EPROTO, "tensor '%.200s' is not an adapter tensor of this range", name);
        }
        return fu_errmsg_set(em, FU_EPROTO, "%zu tensors where %zu were expected", have, want);
    }
    if (with_state) {
        const char *t = fu_safetensors_metadata(st, "adam_t");
        char *end = NULL;
        long long v = t ? strtoll(t, &end, 10) : -1;
        if (!t || !end || *end || v < 0)
            return fu_errmsg_set(em, FU_EPROTO, "no valid adam_t metadata");
    }
    return FU_OK;
}

fu_err dag_peft_config_load(const char *dir, uint32_t *r, float *alpha, uint32_t *targets, fu_errmsg *em)
{
    char *path = fu_path_join(dir, DAG_PEFT_CONFIG_FILE);
    char *txt = NULL;
    size_t len = 0;
    fu_err rc = fu_file_read_all(path, 1 << 20, &txt, &len, em);
    free(path);
    if (rc == FU_ENOTFOUND)
        return fu_errmsg_set(em, rc, "adapter dir '%s' has no adapter_config.json (expected a PEFT adapter)", dir);
    FU_TRY(rc);
    cJSON *j = cJSON_ParseWithLength(txt, len);
    free(txt);
    if (!j)
        return fu_errmsg_set(em, FU_EPROTO, "adapter_config.json: not valid JSON");
    const cJSON *jr = cJSON_GetObjectItemCaseSensitive(j, "r");
    const cJSON *ja = cJSON_GetObjectItemCaseSensitive(j, "lora_alpha");
    const cJSON *jt = cJSON_GetObjectItemCaseSensitive(j, "target_modules");
    const cJSON *jp = cJSON_GetObjectItemCaseSensitive(j, "peft_type");
    rc = FU_OK;
    if (!cJSON_IsNumber(jr) || jr->valuedouble < 1 || jr->valuedouble > DAG_MAX_RANK || !cJSON_IsNumber(ja) ||
        !(ja->valuedouble > 0) || !cJSON_IsArray(jt) || (jp && (!cJSON_IsString(jp) || strcmp(jp->valuestring, "LORA")))) {
        rc = fu_errmsg_set(em, FU_EPROTO,
                           "adapter_config.json: needs peft_type LORA, r (1..%d), lora_alpha > 0 and target_modules",
                           DAG_MAX_RANK);
    } else {
        *r = (uint32_t)jr->valuedouble;
        *alpha = (float)ja->valuedouble;
        *targets = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, jt)
        {
            uint32_t one = 0;
            if (!cJSON_IsString(it) || dag_targets_parse(it->valuestring, &one) != FU_OK) {
                rc = fu_errmsg_set(em, FU_EPROTO, "adapter_config.json: unknown target module '%s'",
                                   cJSON_IsString(it) ? it->valuestring : "?");
                break;
            }
            *targets |= one;
        }
        if (rc == FU_OK && !*targets)
            rc = fu_errmsg_set(em, FU_EPROTO, "adapter_config.json: empty target_modules");
    }
    cJSON_Delete(j);
    return rc;
}
