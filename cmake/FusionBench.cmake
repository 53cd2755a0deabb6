# fu_add_bench(NAME GLOB LIBS...): bench program build/bin/bench-NAME made of bench/GLOB files plus
# the shared harness bench/bench_main.c.
function(fu_add_bench name pattern)
  cmake_parse_arguments(B "" "" "LIBS" ${ARGN})
  file(GLOB srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/bench/${pattern})
  add_executable(bench-${name} ${PROJECT_SOURCE_DIR}/bench/bench_main.c ${srcs})
  target_include_directories(bench-${name} PRIVATE ${PROJECT_SOURCE_DIR}/bench)
  target_link_libraries(bench-${name} PRIVATE ${B_LIBS} fu_common)
  set_target_properties(bench-${name} PROPERTIES LINKER_LANGUAGE C RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
endfunction()
