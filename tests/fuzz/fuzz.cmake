# libFuzzer harnesses, built only with -DKS_FUZZ=ON and clang. Included from
# tests/gguf_fuzz.cmake (CMake auto-includes only tests/*.cmake).
if(NOT KS_FUZZ)
  return()
endif()
if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "KS_FUZZ needs clang: configure with CC=clang (got ${CMAKE_C_COMPILER_ID})")
endif()

set(KS_FUZZ_FLAGS -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer
    -fno-sanitize-recover=undefined)

# The module under test is compiled again with coverage instrumentation, so
# other targets in this build directory stay uninstrumented.
file(GLOB KS_FUZZ_GGUF_SRCS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/gguf/*.c)
add_library(ks_gguf_fuzz STATIC ${KS_FUZZ_GGUF_SRCS})
target_include_directories(ks_gguf_fuzz PUBLIC ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/tests)
target_compile_options(ks_gguf_fuzz PRIVATE ${KS_FUZZ_FLAGS})
target_link_libraries(ks_gguf_fuzz PUBLIC ks_quant ks_status)

add_executable(fuzz_gguf ${CMAKE_CURRENT_LIST_DIR}/fuzz_gguf.c)
target_compile_options(fuzz_gguf PRIVATE -fsanitize=fuzzer,address,undefined -fno-omit-frame-pointer)
target_link_options(fuzz_gguf PRIVATE -fsanitize=fuzzer,address,undefined)
target_link_libraries(fuzz_gguf PRIVATE ks_gguf_fuzz)

add_executable(gguf_seeds ${CMAKE_CURRENT_LIST_DIR}/gguf_seeds.c)
target_include_directories(gguf_seeds PRIVATE ${CMAKE_SOURCE_DIR}/tests)
target_link_libraries(gguf_seeds PRIVATE ks_gguf)

# A short deterministic smoke run for ctest in fuzz builds (label "fuzz");
# real fuzzing sessions are run by hand, see README.
add_test(NAME fuzz_gguf_smoke COMMAND fuzz_gguf -runs=100000 -seed=1 -max_len=4096
         -dict=${CMAKE_CURRENT_LIST_DIR}/gguf.dict)
set_tests_properties(fuzz_gguf_smoke PROPERTIES LABELS fuzz TIMEOUT 600)
