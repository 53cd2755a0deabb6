# bench-swarm: thousands of simulated peers and a few clients against the real fusion-broker process
# (bench/swarm/swarm.h, docs/SCALE.md). It starts the broker with the tests' cluster harness
# (fu_test_cluster), which exists only where the tests are built (BUILD_TESTING). It has its own
# main (flags for the swarm's size, churn and duration), not bench_main.c's case list.
if(NOT TARGET fu_test_cluster)
  return()
endif()
file(GLOB FU_SWARM_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/bench/swarm/swarm_*.c)
list(REMOVE_ITEM FU_SWARM_SOURCES ${PROJECT_SOURCE_DIR}/bench/swarm/swarm_main.c)
add_library(fu_swarm STATIC ${FU_SWARM_SOURCES})
target_include_directories(fu_swarm PUBLIC ${PROJECT_SOURCE_DIR}/bench/swarm)
target_link_libraries(fu_swarm PUBLIC fu_test_cluster fu_dag fu_proto fu_common PkgConfig::SQLITE PkgConfig::SODIUM
                      PkgConfig::CJSON PkgConfig::ZMQ)
add_executable(bench-swarm ${PROJECT_SOURCE_DIR}/bench/swarm/swarm_main.c)
target_link_libraries(bench-swarm PRIVATE fu_swarm)
set_target_properties(bench-swarm PROPERTIES LINKER_LANGUAGE C RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
