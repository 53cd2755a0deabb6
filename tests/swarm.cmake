# The short swarm run (bench-swarm, bench/swarm.cmake; docs/SCALE.md): 1,000 simulated peers against
# the real broker under churn, no job lost: directly (test_swarm) and through two gateways
# (test_swarm_gateways). Label `swarm` (no GPU); each uses both cores for ~45 s.
if(NOT TARGET bench-swarm AND NOT EXISTS ${PROJECT_SOURCE_DIR}/bench/swarm.cmake)
  return()
endif()
fu_add_test(test_swarm SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_swarm.c LIBS PkgConfig::CJSON TIMEOUT 90
            ARGS test_swarm_churn_loses_no_job)
set_tests_properties(test_swarm PROPERTIES RUN_SERIAL TRUE LABELS swarm)
add_dependencies(test_swarm bench-swarm)
# the same executable's second case: the peers behind two gateways
add_test(NAME test_swarm_gateways COMMAND test_swarm test_swarm_churn_through_gateways_loses_no_job
         WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
get_test_property(test_swarm ENVIRONMENT swarm_env)
set_tests_properties(test_swarm_gateways PROPERTIES TIMEOUT 90 ENVIRONMENT "${swarm_env}" RUN_SERIAL TRUE
                     LABELS swarm)
