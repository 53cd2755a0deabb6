# kernels/: one cmocka executable per module (tensor, ops, attention, LoRA). CPU only.
fu_add_test(test_kern_tensor SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_tensor.c LIBS fu_kernels)
fu_add_test(test_kern_ops SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_ops.c LIBS fu_kernels)
fu_add_test(test_kern_attn SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_attn.c LIBS fu_kernels)
fu_add_test(test_kern_lora SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_lora.c LIBS fu_kernels)
# Wire codecs of cut tensors (f16, bf16, int8 per row): bounds, purity, refusals.
fu_add_test(test_kern_codec SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_codec.c LIBS fu_kernels)
# Compute threads as guests (kern_priority): idle/low priority read back, inherited, set on others.
fu_add_test(test_kern_priority SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/test_kern_priority.c LIBS fu_kernels)
