# Model files in common/: safetensors, config.json, tokenizer; and `fusion model` as a real process.
fu_add_test(test_safetensors SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_safetensors.c LIBS fu_common)
fu_add_test(test_modelcfg SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_modelcfg.c LIBS fu_common)
fu_add_test(test_model_cli SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_model_cli.c LIBS fu_common TIMEOUT 120)
add_dependencies(test_model_cli fusion)
fu_add_test(test_tokenizer SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_tokenizer.c LIBS fu_common)
# Real tokenizer.json files against @lenml/tokenizers on 10,000 strings (deploy/fetch-test-data.sh).
fu_add_test(test_tokenizer_conformance SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_tokenizer_conformance.c LIBS fu_dag fu_common
            TIMEOUT 300)
add_dependencies(test_tokenizer_conformance fusion)
# Each Hugging Face family's logits against a PyTorch reference (tests/reference/hf_reference.py).
fu_add_test(test_model_reference SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_model_reference.c LIBS fu_common TIMEOUT 300)
add_dependencies(test_model_reference fusion)

# Fuzz target for the safetensors parser (its seed corpus runs as an ordinary test).
include(${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz.cmake)
fu_add_fuzz(safetensors SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_safetensors.c LIBS fu_common)
