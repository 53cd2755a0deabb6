# The broker daemon (broker/broker*.c): the real fusion-broker process, real peer processes (the
# test executable run again as a fake peer, tests/fake_peer.h), real CURVE sockets on loopback, a real
# SQLite file. The timeouts are a safety net, not a bound: a machine busy with other work (a build, a
# simulation beside the suite) took test_broker_trust past 90 s.
foreach(t peers jobs failover trust roles upload metrics)
  fu_add_test(test_broker_${t} SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_broker_${t}.c LIBS fu_test_cluster TIMEOUT 180)
  set_tests_properties(test_broker_${t} PROPERTIES RUN_SERIAL TRUE LABELS broker)
endforeach()
# test_broker_roles also checks broker_auth's ban policy in-process (no clock, no sockets).
target_link_libraries(test_broker_roles PRIVATE fu_broker)
# broker_losshist (the loss curves of /api/jobs/JOB/loss) in-process: no sockets, no processes.
fu_add_test(test_broker_losshist SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_broker_losshist.c LIBS fu_broker TIMEOUT 30)
set_tests_properties(test_broker_losshist PROPERTIES LABELS broker)
