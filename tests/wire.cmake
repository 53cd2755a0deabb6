# The wire (proto/): codec, sockets, CURVE + ZAP, keys and keygen, sealed channel, fuzz corpora.
fu_add_test(test_wire_codec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_wire_codec.c LIBS fu_proto)
fu_add_test(test_wire_socket SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_wire_socket.c LIBS fu_proto)
fu_add_test(test_wire_curve SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_wire_curve.c LIBS fu_proto)
fu_add_test(test_wire_seal SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_wire_seal.c LIBS fu_proto)
fu_add_test(test_wire_tensor SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_wire_tensor.c LIBS fu_proto)
fu_add_test(test_wire_keys SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_wire_keys.c LIBS fu_proto)
add_dependencies(test_wire_keys fusion)   # runs `fusion keygen` as a real process

# Fuzz targets (tests/fuzz/): corpora always run as tests; libFuzzer binaries with -DFUSION_FUZZ=ON.
include(${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz.cmake)
fu_add_fuzz(envelope SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_envelope.c LIBS fu_proto)
