# The wire (proto/): codec, sockets, CURVE + ZAP, keys and keygen, sealed channel, fuzz corpora.
fu_add_test(test_wire_codec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_wire_codec.c LIBS fu_proto)
