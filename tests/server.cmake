# End-to-end tests of `kvserve serve` (label e2e): curl for every error case,
# the official openai npm client (tests/e2e/run.sh installs it with npm ci), and
# the live page in headless Chromium.
# Exit code 77 means skipped (model, curl, chromium or npm packages unavailable).
set(KS_E2E_ENV "KVSERVE_SHARED=${KS_SHARED_DIR};KVSERVE_BIN=$<TARGET_FILE:kvserve>;KVSERVE_SOURCE=${CMAKE_SOURCE_DIR}")
add_test(NAME server_curl_errors COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/curl_errors.sh)
# the live page in headless Chromium; leaves kv_page.png in the build dir
add_test(NAME server_page_chromium COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/page_chromium.sh)
foreach(part basic concurrency pressure tools clients)
  add_test(NAME server_e2e_${part} COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/run.sh ${part})
endforeach()
# the prefix cache's SSD tier across a restart (needs only curl and python3)
add_test(NAME server_prefix_restart COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/prefix_restart.sh)
# connections: 2000 idle + slowloris, limits, timeouts, 401/413 before the body, cross-site requests (python3)
add_test(NAME server_conn COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/e2e/conn.py)
# llama-server's routes against the anchor's llama-server on the default model (python3)
add_test(NAME server_llama_parity COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/llama_parity.py)
# /v1/embeddings and /embeddings on the embedding synth presets, against tests/data/embed-*.json (python3)
add_test(NAME server_embeddings COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/embeddings.py)
# /infill against the anchor's llama-server on a tiny model with Qwen3's FIM vocabulary (python3)
add_test(NAME server_infill_parity COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/infill_parity.py)
# tenant isolation: cache_salt, --cache-salt-from-key, --admin-key, --cache-show-text (curl)
add_test(NAME server_cache_salt COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/cache_salt.sh)
# bodies cJSON takes but the server refuses: duplicate keys, trailing bytes, NUL, bad UTF-8; a large enum (curl)
add_test(NAME server_strict_requests COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/strict_requests.sh)
foreach(t server_curl_errors server_page_chromium server_e2e_basic server_e2e_concurrency server_e2e_pressure
          server_e2e_tools server_e2e_clients
          server_prefix_restart server_conn server_llama_parity server_infill_parity server_cache_salt
          server_strict_requests server_embeddings)
  set_tests_properties(${t} PROPERTIES LABELS e2e TIMEOUT 900 SKIP_RETURN_CODE 77 ENVIRONMENT "${KS_E2E_ENV}")
endforeach()
# Anthropic's /v1/messages and OpenAI's /v1/responses against the chat route on the default model (python3)
add_test(NAME server_apis COMMAND python3 ${CMAKE_SOURCE_DIR}/tests/e2e/apis.py)
set_tests_properties(server_apis PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT "${KS_E2E_ENV}")
# the same routes through the official @anthropic-ai/sdk and openai clients (tests/e2e/sdk/run.sh: npm ci, else 77)
add_test(NAME server_apis_sdk COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/sdk/run.sh)
set_tests_properties(server_apis_sdk PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT "${KS_E2E_ENV}")
# speculative decoding with a draft model (serve -md): the same greedy text, usage and the pool (curl, python3)
add_test(NAME server_draft COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/draft.sh)
set_tests_properties(server_draft PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT "${KS_E2E_ENV}")
