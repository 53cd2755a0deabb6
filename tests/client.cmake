# The `fusion` client's broker commands, run as processes against a real fusion-broker.
fu_add_test(test_cli_jobs SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cli_jobs.c LIBS fu_test_cluster TIMEOUT 300)
set_tests_properties(test_cli_jobs PROPERTIES LABELS client)
# The OpenAI API shapes of `fusion serve` (client/cli_openai.c), on their own.
fu_add_test(test_cli_openai SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_cli_openai.c ${PROJECT_SOURCE_DIR}/client/cli_openai.c
            LIBS fu_dag fu_proto fu_common LABELS client)
target_include_directories(test_cli_openai PRIVATE ${PROJECT_SOURCE_DIR}/client)
