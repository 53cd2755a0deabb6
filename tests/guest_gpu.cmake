# The guest's GPU watch (peer_gpuwatch; docs/PEER.md "A good guest", the GPU).
# Against a stand-in NVML (fake_nvml.c, built as libnvidia-ml.so.1 in a folder of its own, which the
# test puts on LD_LIBRARY_PATH): which processes count, another pid namespace, the guest's pause and
# resume. Needs no GPU.
add_library(fu_fake_nvml SHARED ${CMAKE_CURRENT_SOURCE_DIR}/fake_nvml.c)
set_target_properties(fu_fake_nvml PROPERTIES OUTPUT_NAME nvidia-ml PREFIX lib SUFFIX .so.1
                      LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests/fake_nvml)
fu_add_test(test_peer_gpuwatch SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_peer_gpuwatch.c LIBS fu_peer TIMEOUT 60)
target_compile_definitions(test_peer_gpuwatch PRIVATE FAKE_NVML_DIR="${PROJECT_BINARY_DIR}/tests/fake_nvml")
add_dependencies(test_peer_gpuwatch fu_fake_nvml)

# A CUDA peer as a good guest on its owner's GPU (label gpu): another program's GEMMs on the same GPU
# (gpu_busy, a helper process) pause the peer, which resumes once it has exited. Skipped (77) without
# a device or NVML. After e2e.cmake (fu_e2e_exe, fu_e2e_case): the area files are included in name
# order.
if(FUSION_HAVE_CUDA)
  add_executable(gpu_busy ${CMAKE_CURRENT_SOURCE_DIR}/gpu_busy.c)
  target_link_libraries(gpu_busy PRIVATE fu_kernels fu_common)
  set_target_properties(gpu_busy PROPERTIES LINKER_LANGUAGE C RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  fu_e2e_exe(test_e2e_guest_gpu)
  target_compile_definitions(test_e2e_guest_gpu PRIVATE GPU_BUSY_EXE="$<TARGET_FILE:gpu_busy>")
  add_dependencies(test_e2e_guest_gpu gpu_busy)
  fu_e2e_case(test_e2e_guest_gpu test_e2e_guest_gpu_yields 240 gpu)
endif()
