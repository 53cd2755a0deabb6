# SALR kernels: bitmap format and the SALR ops (prune, SVD residual, sparse product, adapters).
fu_add_test(test_kern_bitmap SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_bitmap.c LIBS fu_kernels)
fu_add_test(test_kern_salr SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_salr.c LIBS fu_kernels)
