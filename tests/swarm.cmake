# The short swarm run (bench-swarm, bench/swarm.cmake; docs/SCALE.md): 1,000 simulated peers against
# the real broker under churn, no job lost, directly and through two gateways. Label `swarm` (no GPU);
# it uses both cores for ~90 s.
if(NOT TARGET bench-swarm AND NOT EXISTS ${PROJECT_SOURCE_DIR}/bench/swarm.cmake)
  return()
endif()
fu_add_test(test_swarm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_swarm.c LIBS PkgConfig::CJSON TIMEOUT 200)
set_tests_properties(test_swarm PROPERTIES RUN_SERIAL TRUE LABELS swarm)
add_dependencies(test_swarm bench-swarm)
