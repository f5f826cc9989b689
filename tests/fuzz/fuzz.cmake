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
# the same dependencies as the module itself
get_target_property(ks_gguf_deps ks_gguf INTERFACE_LINK_LIBRARIES)
target_link_libraries(ks_gguf_fuzz PUBLIC ${ks_gguf_deps})

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

# The tokenizer (with its chat templates) and the server's request parsing,
# instrumented as object libraries: objects always link, so the plain
# ks_tokenizer / ks_server archives that kvserve_all also names are never
# pulled in for them.
file(GLOB KS_FUZZ_TOK_SRCS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/tokenizer/*.c)
add_library(ks_tokenizer_fuzz OBJECT ${KS_FUZZ_TOK_SRCS})
target_include_directories(ks_tokenizer_fuzz PUBLIC ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/tests)
target_compile_options(ks_tokenizer_fuzz PRIVATE ${KS_FUZZ_FLAGS})
get_target_property(ks_tokenizer_deps ks_tokenizer INTERFACE_LINK_LIBRARIES)
target_link_libraries(ks_tokenizer_fuzz PUBLIC ${ks_tokenizer_deps})

file(GLOB KS_FUZZ_SERVER_SRCS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/server/*.c)
add_library(ks_server_fuzz OBJECT ${KS_FUZZ_SERVER_SRCS})
target_include_directories(ks_server_fuzz PUBLIC ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/tests)
target_compile_options(ks_server_fuzz PRIVATE ${KS_FUZZ_FLAGS})
get_target_property(ks_server_deps ks_server INTERFACE_LINK_LIBRARIES)
list(REMOVE_ITEM ks_server_deps ks_tokenizer) # its instrumented objects are linked instead
target_link_libraries(ks_server_fuzz PUBLIC ${ks_server_deps})

# fuzz_NAME: harness tests/fuzz/fuzz_NAME.c, corpus tests/fuzz/NAME/, and
# tests/fuzz/NAME.dict when there is one. The vocabularies come from
# $KVSERVE_SHARED/models/vocab, by default the shared dir found at configure.
function(ks_fuzz_harness name)
  add_executable(fuzz_${name} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/fuzz_${name}.c)
  target_compile_options(fuzz_${name} PRIVATE -fsanitize=fuzzer,address,undefined -fno-omit-frame-pointer)
  target_compile_definitions(fuzz_${name} PRIVATE KS_FUZZ_SHARED="${KS_SHARED_DIR}")
  target_link_options(fuzz_${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_${name} PRIVATE ${ARGN})
  # replay the committed corpus (crashes found once stay fixed); -runs=0
  # mutates nothing, so nothing is written into the source tree
  add_test(NAME fuzz_${name}_corpus COMMAND fuzz_${name} -runs=0 ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/${name})
  set_tests_properties(fuzz_${name}_corpus PROPERTIES LABELS fuzz TIMEOUT 600
    ENVIRONMENT "KVSERVE_SHARED=${KS_SHARED_DIR}")
endfunction()

ks_fuzz_harness(tokenizer ks_tokenizer_fuzz ks_gguf)
ks_fuzz_harness(chat ks_tokenizer_fuzz ks_gguf)
ks_fuzz_harness(body ks_server_fuzz ks_tokenizer_fuzz kvserve_all)
ks_fuzz_harness(apis ks_server_fuzz ks_tokenizer_fuzz kvserve_all)
add_test(NAME fuzz_gguf_corpus COMMAND fuzz_gguf -runs=0 ${CMAKE_CURRENT_LIST_DIR}/gguf)
set_tests_properties(fuzz_gguf_corpus PROPERTIES LABELS fuzz TIMEOUT 600)
