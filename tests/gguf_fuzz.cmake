# The GGUF fuzz harness lives under tests/fuzz/ (see its fuzz.cmake).
include(${CMAKE_CURRENT_LIST_DIR}/fuzz/fuzz.cmake)
