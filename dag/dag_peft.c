#include "dag_peft.h"

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
