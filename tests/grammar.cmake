# test_grammar_e2e runs the real engine on the built-in default model (a
# random tiny model, which writes valid JSON only through the grammar).
if(TARGET test_grammar_e2e)
  add_dependencies(test_grammar_e2e default_model)
  set_property(TEST test_grammar_e2e APPEND PROPERTY ENVIRONMENT
               "KVSERVE_DEFAULT_MODEL=${CMAKE_BINARY_DIR}/default-model.gguf")
  set_tests_properties(test_grammar_e2e PROPERTIES TIMEOUT 1200) # minutes under ASan on 2 shared cores
endif()
# test_server_n: n > 1 choices on the same default model
if(TARGET test_server_n)
  add_dependencies(test_server_n default_model)
  set_property(TEST test_server_n APPEND PROPERTY ENVIRONMENT
               "KVSERVE_DEFAULT_MODEL=${CMAKE_BINARY_DIR}/default-model.gguf")
  set_tests_properties(test_server_n PROPERTIES TIMEOUT 1200)
endif()
