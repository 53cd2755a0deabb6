# The broker's durable store (broker/db*.c): a real SQLite file in a scratch directory.
fu_add_test(test_db SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_db.c LIBS fu_broker TIMEOUT 120)
