# imatrix_ones: the importance matrix llama-quantize needs to make IQ2/IQ1 files
# from a synthetic model (tools/imatrix/imatrix_ones.c).
add_executable(imatrix_ones ${CMAKE_SOURCE_DIR}/tools/imatrix/imatrix_ones.c)
target_link_libraries(imatrix_ones PRIVATE kvserve_all)
# test_model_iq2 runs it to have llama-quantize make its files.
set_property(TEST test_model_iq2 APPEND PROPERTY ENVIRONMENT "KVSERVE_IMATRIX_ONES=$<TARGET_FILE:imatrix_ones>")
