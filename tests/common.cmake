fu_add_test(test_common SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_common.c LIBS fu_common)
fu_add_test(test_cli SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cli.c TIMEOUT 60)
target_compile_definitions(test_cli PRIVATE FUSION_TEST_VERSION="${PROJECT_VERSION}")
add_dependencies(test_cli fusion fusion-broker fusion-peer)
