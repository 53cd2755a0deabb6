# The IR plane: graph, serialisation, partitioner, executor, and `fusion run` as real processes.
fu_add_test(test_dag_graph SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_dag_graph.c LIBS fu_dag TIMEOUT 60)
# The partitioner against an exhaustive search, and every stage limit from one search.
fu_add_test(test_dag_partition SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_dag_partition.c LIBS fu_dag TIMEOUT 60)
# The job spec (dag_spec): defaults, every field through JSON and back and refused out of range.
fu_add_test(test_dag_spec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_dag_spec.c LIBS fu_dag TIMEOUT 30)
fu_add_test(test_dag_data SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_dag_data.c LIBS fu_dag TIMEOUT 30)
fu_add_test(test_dag_exec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_dag_exec.c LIBS fu_dag TIMEOUT 120)
# The generation step (dag_infer): a two-stage split equals one stage, replays, gaps and bad inputs.
fu_add_test(test_dag_infer SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_dag_infer.c LIBS fu_dag TIMEOUT 60)
fu_add_test(test_dag_cli SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_dag_cli.c LIBS fu_dag fu_proto TIMEOUT 400)
add_dependencies(test_dag_cli fusion)

# Fuzz target of the DAG decoder: its seed corpus runs as a test; libFuzzer binary with FUSION_FUZZ.
include(${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz.cmake)
fu_add_fuzz(dag_decode SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_dag_decode.c LIBS fu_dag)
