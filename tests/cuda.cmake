# CUDA backend tests (label `gpu`): every CUDA op against the CPU op, the fused LoRA-FA and SALR
# kernels, and a whole LLaMA block. Each exits 77 (reported as skipped) when there is no device.
if(FUSION_HAVE_CUDA)
  fu_add_test(test_kern_cuda SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_cuda.c LIBS fu_kernels LABELS gpu TIMEOUT 300)
  fu_add_test(test_kern_cuda_salr SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_cuda_salr.c LIBS fu_kernels LABELS gpu TIMEOUT 300)
  fu_add_test(test_kern_cuda_block SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_cuda_block.c LIBS fu_kernels LABELS gpu TIMEOUT 300)
  # No device needed: cuBLAS is not linked, and loads with every function the backend calls.
  fu_add_test(test_kern_cuda_blas SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_cuda_blas.c LIBS fu_kernels TIMEOUT 60)
endif()
