fu_add_bench(kernels "kernels_*.c" LIBS fu_kernels)
