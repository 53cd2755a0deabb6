fu_add_bench(wire "wire_*.c" LIBS fu_proto)
