# bench-pipeline: the distributed fine-tune (broker + 1..3 local peers) against `fusion run finetune`,
# the share of step time spent sealing and sending, and the recovery time after a peer is killed.
# It runs the programs found next to itself (build/bin).
fu_add_bench(pipeline "pipeline_*.c" LIBS fu_common)
target_compile_definitions(bench-pipeline PRIVATE FU_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(bench-pipeline fusion fusion-broker fusion-peer)
