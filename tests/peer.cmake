# The peer (peer/): profile, spec and data order, blob fetches in one process; the real fusion-peer
# program against an in-test speaker of the broker protocol (stage output equals the executor's,
# refused weights, graceful leave); the same on the CUDA backend (label gpu, skipped without one).
fu_add_test(test_peer_unit SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_peer_unit.c LIBS fu_peer TIMEOUT 60)
# The blob cache's size limit: least recently used evicted first, the blob just written and files
# the cache does not own never.
fu_add_test(test_peer_cache SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_peer_cache.c LIBS fu_peer TIMEOUT 30)
fu_add_test(test_peer_proc SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_peer_proc.c LIBS fu_peer fu_test_cluster TIMEOUT 240)
fu_add_test(test_peer_gpu SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_peer_proc.c LIBS fu_peer fu_test_cluster TIMEOUT 120
            ARGS --device cuda:0 LABELS gpu)
# With the real broker and client: a two-stage fine-tune equals `fusion run finetune`; a SIGKILLed
# stage fails over to the warm backup and the adapter is unchanged; the peers' connections to the
# broker cut mid-job (a TCP proxy replaced, under load): every peer beats at once on its new
# connection, nobody is declared dead, no stage moves, the adapter is unchanged.
fu_add_test(test_peer_broker SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_peer_broker.c LIBS fu_test_cluster TIMEOUT 240
            ARGS "*pipeline_equals*")
add_test(NAME test_peer_broker_failover COMMAND test_peer_broker "*failover*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_peer_broker_leave COMMAND test_peer_broker "*leave_keeps*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_peer_broker_enrol COMMAND test_peer_broker "*enrolment*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_peer_broker_restart COMMAND test_peer_broker "*restart_keeps*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_peer_broker_infer COMMAND test_peer_broker "*inference*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_peer_broker_reconnect COMMAND test_peer_broker "*reconnect*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
get_test_property(test_peer_broker ENVIRONMENT FU_PEER_TEST_ENV)
set_tests_properties(test_peer_broker_failover test_peer_broker_leave test_peer_broker_restart test_peer_broker_infer
                     test_peer_broker_enrol test_peer_broker_reconnect PROPERTIES TIMEOUT 240 SKIP_RETURN_CODE 77
                     ENVIRONMENT "${FU_PEER_TEST_ENV}")
# Verification of untrusted peers (docs/PIPELINE.md "Verification"): the sketch and the sealed input
# chunks (unit); the broker refuses malformed verification messages and relayed control messages;
# verify = 1.0 over honest peers agrees and keeps the adapter; a dishonest stage-0 peer
# (test-only fault hook) is caught, loses its stage and its work, and the job still finishes, with and
# without a third opinion; three stages with every stage verified (inputs delivered by the upstream
# peer through the broker) agree and keep the adapter; a dishonest middle stage is caught while the
# stage after it is not blamed; a stage-0 peer that keeps honest copies of what it corrupts shows up as
# input mismatches at stage 1; a single-stage job's cheater (its verified output: the loss) is caught
# too; honest peers that read their requests late (test-only hook) and no longer hold the output are
# not blamed. The three-stage cases run 6 peers: RUN_SERIAL.
fu_add_test(test_verify SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_verify.c LIBS fu_peer fu_broker fu_test_cluster
            TIMEOUT 240 ARGS "*sketch*" LABELS peer)
add_test(NAME test_verify_input_chunks COMMAND test_verify "*input_chunks*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_bad_messages COMMAND test_verify "*refuses_bad_messages*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_honest COMMAND test_verify "*honest_peers*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_dishonest COMMAND test_verify "*dishonest_peer_is_caught*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_third_opinion COMMAND test_verify "*third_opinion*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_every_stage COMMAND test_verify "*every_stage_honest*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_middle_stage COMMAND test_verify "*middle_stage_cheater*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_input_mismatch COMMAND test_verify "*input_mismatch*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_single_stage COMMAND test_verify "*single_stage_cheater*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_last_bit COMMAND test_verify "*last_bit_cheater*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
add_test(NAME test_verify_late COMMAND test_verify "*late_answers*" WORKING_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
get_test_property(test_verify ENVIRONMENT FU_VERIFY_TEST_ENV)
set_tests_properties(test_verify_input_chunks test_verify_bad_messages test_verify_honest test_verify_dishonest test_verify_third_opinion
                     test_verify_every_stage test_verify_middle_stage test_verify_input_mismatch test_verify_single_stage
                     test_verify_last_bit test_verify_late PROPERTIES TIMEOUT 240
                     SKIP_RETURN_CODE 77
                     LABELS peer ENVIRONMENT "${FU_VERIFY_TEST_ENV}")
set_tests_properties(test_verify_every_stage test_verify_middle_stage test_verify_input_mismatch PROPERTIES TIMEOUT 300
                     RUN_SERIAL TRUE)
# A good guest (peer_guest): the daily window, the busy hysteresis, the owner's pause, a paused
# compute thread that waits and resumes, the duty cycle's CPU share.
fu_add_test(test_peer_guest SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_peer_guest.c LIBS fu_peer TIMEOUT 60)
# A build without the test hooks (every build type but Debug, unless asked) carries none of them:
# no FUSION_TEST_* variable is even named in fusion-peer (docs/SECURITY.md, issue "A swarm of
# strangers": the fault hooks were once in the release peer).
if(NOT FUSION_TEST_HOOKS)
  add_test(NAME test_peer_release_has_no_hooks
           COMMAND sh -c "if grep -q FUSION_TEST_ \"$1\"; then echo \"$1 names a test hook\"; exit 1; fi"
                   sh $<TARGET_FILE:fusion-peer>)
  set_tests_properties(test_peer_release_has_no_hooks PROPERTIES LABELS peer)
endif()
