# A CUDA peer as a good guest on its owner's GPU (label gpu; docs/PEER.md "A good guest"): another
# program's GEMMs on the same GPU (gpu_busy, a helper process) pause the peer, which resumes once it
# has exited. Skipped (77) without a device or NVML. After e2e.cmake (fu_e2e_exe, fu_e2e_case): the
# area files are included in name order.
if(FUSION_HAVE_CUDA)
  add_executable(gpu_busy ${CMAKE_CURRENT_SOURCE_DIR}/gpu_busy.c)
  target_link_libraries(gpu_busy PRIVATE fu_kernels fu_common)
  set_target_properties(gpu_busy PROPERTIES LINKER_LANGUAGE C RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  fu_e2e_exe(test_e2e_guest_gpu)
  target_compile_definitions(test_e2e_guest_gpu PRIVATE GPU_BUSY_EXE="$<TARGET_FILE:gpu_busy>")
  add_dependencies(test_e2e_guest_gpu gpu_busy)
  fu_e2e_case(test_e2e_guest_gpu test_e2e_guest_gpu_yields 240 gpu)
endif()
