# The `fusion` client's broker commands, run as processes against a real fusion-broker.
fu_add_test(test_client SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_client.c LIBS fu_broker TIMEOUT 90)
add_dependencies(test_client fusion fusion-broker)
set_tests_properties(test_client PROPERTIES LABELS client)
