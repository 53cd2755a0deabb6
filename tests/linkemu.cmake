# The link emulator (tests/linkemu/): home internet links between network namespaces for tests and
# benchmarks (issue "Home links"). fusion-linkemu is the router between the namespaces (bandwidth,
# one-way delay and jitter per access link, stalls); netprobe measures a link from its two ends.
add_executable(fusion-linkemu ${CMAKE_CURRENT_SOURCE_DIR}/linkemu/linkemu.c)
target_link_libraries(fusion-linkemu PRIVATE m)
add_executable(netprobe ${CMAKE_CURRENT_SOURCE_DIR}/linkemu/netprobe.c)
# Each condition's round trip and goodput within 10% of what was asked (needs root and /dev/net/tun).
add_test(NAME test_linkemu_conditions COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/linkemu/run.sh $<TARGET_FILE:fusion-linkemu>
         $<TARGET_FILE:netprobe>)
set_tests_properties(test_linkemu_conditions PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE
                     LABELS "netns;linkemu")
# A three-stage fine-tune over the 20 Mbit/s, 60 ms condition equals the LAN run bit for bit (f32 on
# the wire) and fusion run --cuts with the same codec (int8)
# (bench/wan/run.sh --quick --only 20mbit_60ms on this build's programs).
add_test(NAME test_wan_3stage_same_bits COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/linkemu/wan_same_bits.sh ${PROJECT_BINARY_DIR})
set_tests_properties(test_wan_3stage_same_bits PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE
                     LABELS "netns;linkemu;e2e")
# A peer killed mid-job over the 20 Mbit/s, 60 ms condition: the job recovers on its backup with the
# LAN run's adapter bit for bit (bench/wan/run.sh --quick --only 20mbit_60ms --codecs f32 --kill).
add_test(NAME test_wan_peer_killed_recovers COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/linkemu/wan_peer_killed.sh
         ${PROJECT_BINARY_DIR})
set_tests_properties(test_wan_peer_killed_recovers PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 RUN_SERIAL TRUE
                     LABELS "netns;linkemu;e2e;fault")
