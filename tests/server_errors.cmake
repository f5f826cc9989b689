# test_server_errors fails the n-th allocation of one request on every route:
# malloc, calloc, realloc and strdup are wrapped at link time (the server's
# cJSON hook allocates through malloc too), and the tokenizer comes from the
# built-in default model.
if(TARGET test_server_errors)
  target_link_options(test_server_errors PRIVATE -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=strdup)
  add_dependencies(test_server_errors default_model)
  set_property(TEST test_server_errors APPEND PROPERTY ENVIRONMENT
               "KVSERVE_DEFAULT_MODEL=${CMAKE_BINARY_DIR}/default-model.gguf")
  set_tests_properties(test_server_errors PROPERTIES TIMEOUT 300)
endif()
