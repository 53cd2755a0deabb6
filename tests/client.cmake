# The `fusion` client's broker commands, run as processes against a real fusion-broker.
fu_add_test(test_client SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_client.c LIBS fu_test_cluster TIMEOUT 90)
set_tests_properties(test_client PROPERTIES LABELS client)
