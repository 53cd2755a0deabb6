# bench-pipeline: the distributed fine-tune (broker + 1..3 local peers) against `fusion run finetune`,
# the share of step time spent sealing and sending, the recovery time after a peer is killed, and the
# compute that verification at the default fraction adds.
# It runs the programs found next to itself (build/bin).
# It starts them with the tests' cluster harness (fu_test_cluster, tests/cluster.h: a bench may link the
# test harness library), which exists only where the tests are built (BUILD_TESTING).
if(NOT TARGET fu_test_cluster)
  return()
endif()
fu_add_bench(pipeline "pipeline_*.c" LIBS fu_test_cluster)
target_compile_definitions(bench-pipeline PRIVATE FU_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
