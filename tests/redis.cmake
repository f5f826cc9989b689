# The shared Redis tier against a real redis-server and two replicas on the
# built-in model (tests/e2e/redis_tier.sh; exit 77 without redis-server).
add_test(NAME server_redis_tier COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/redis_tier.sh)
set_tests_properties(server_redis_tier PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "KVSERVE_SHARED=${KS_SHARED_DIR};KVSERVE_BIN=$<TARGET_FILE:kvserve>;KVSERVE_SOURCE=${CMAKE_SOURCE_DIR}")
# scripts/cluster.sh: redis-server, two replicas and HAProxy on loopback (exit 77 without them)
add_test(NAME server_redis_cluster COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/redis_cluster.sh)
set_tests_properties(server_redis_cluster PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "KVSERVE_SHARED=${KS_SHARED_DIR};KVSERVE_BIN=$<TARGET_FILE:kvserve>;KVSERVE_SOURCE=${CMAKE_SOURCE_DIR}")
# kvserve route: two replicas publishing KV events behind the router (scripts/cluster.sh -r; exit 77 without redis-server)
add_test(NAME server_route COMMAND ${CMAKE_SOURCE_DIR}/tests/e2e/route.sh)
set_tests_properties(server_route PROPERTIES LABELS e2e TIMEOUT 300 SKIP_RETURN_CODE 77
                     ENVIRONMENT "KVSERVE_SHARED=${KS_SHARED_DIR};KVSERVE_BIN=$<TARGET_FILE:kvserve>;KVSERVE_SOURCE=${CMAKE_SOURCE_DIR}")
