# End-to-end tests of `kvserve serve` (label e2e): curl for every error case,
# and the official openai npm client (tests/e2e/run.sh installs it with npm ci).
# Exit code 77 means skipped (model, curl or npm packages unavailable).
set(KS_E2E_ENV "KVSERVE_SHARED=${KS_SHARED_DIR};KVSERVE_BIN=$<TARGET_FILE:kvserve>;KVSERVE_SOURCE=${CMAKE_SOURCE_DIR}")
add_test(NAME server_curl_errors COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/curl_errors.sh)
foreach(part basic concurrency pressure)
  add_test(NAME server_e2e_${part} COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/run.sh ${part})
endforeach()
foreach(t server_curl_errors server_e2e_basic server_e2e_concurrency server_e2e_pressure)
  set_tests_properties(${t} PROPERTIES LABELS e2e TIMEOUT 900 SKIP_RETURN_CODE 77 ENVIRONMENT "${KS_E2E_ENV}")
endforeach()
