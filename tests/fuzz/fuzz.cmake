# fu_add_fuzz(NAME SOURCES src... LIBS lib...): a fuzz target whose source defines
# LLVMFuzzerTestOneInput, with its seed corpus in tests/fuzz/corpus/NAME/.
#  - Always: ctest case `fuzz_corpus_NAME` runs every seed once through tests/fuzz/fuzz_driver.c
#    (under the sanitizers when FUSION_SANITIZE is on).
#  - With -DFUSION_FUZZ=ON (needs clang): a libFuzzer binary build/bin/fuzz-NAME built with
#    -fsanitize=fuzzer,address. For coverage feedback inside a library, provide a twin target
#    `<lib>_fuzz` built with -fsanitize=fuzzer-no-link (as proto/ does for fu_proto); it is used
#    instead of <lib> automatically. Run: build/bin/fuzz-NAME -max_total_time=60 tests/fuzz/corpus/NAME
# Other areas include this file first: include(${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz.cmake)
include_guard(GLOBAL)

set(FU_FUZZ_DIR ${CMAKE_CURRENT_LIST_DIR})

function(fu_add_fuzz name)
  cmake_parse_arguments(F "" "" "SOURCES;LIBS" ${ARGN})
  set(corpus ${FU_FUZZ_DIR}/corpus/${name})
  if(NOT EXISTS ${corpus})
    message(FATAL_ERROR "fu_add_fuzz(${name}): seed corpus ${corpus} is missing")
  endif()
  fu_add_test(fuzz_corpus_${name} SOURCES ${F_SOURCES} ${FU_FUZZ_DIR}/fuzz_driver.c LIBS ${F_LIBS}
              ARGS ${corpus} LABELS fuzz)
  if(FUSION_FUZZ)
    if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
      message(FATAL_ERROR "FUSION_FUZZ needs clang: configure with -DCMAKE_C_COMPILER=clang")
    endif()
    set(libs "")
    foreach(lib ${F_LIBS})
      if(TARGET ${lib}_fuzz)
        list(APPEND libs ${lib}_fuzz)
      else()
        list(APPEND libs ${lib})
      endif()
    endforeach()
    add_executable(fuzz-${name} ${F_SOURCES})
    target_compile_options(fuzz-${name} PRIVATE -fsanitize=fuzzer,address)
    target_link_options(fuzz-${name} PRIVATE -fsanitize=fuzzer,address)
    target_link_libraries(fuzz-${name} PRIVATE ${libs})
    set_target_properties(fuzz-${name} PROPERTIES LINKER_LANGUAGE C RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
  endif()
endfunction()
