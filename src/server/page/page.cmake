# The live page (GET /) is src/server/page/index.html, embedded into ks_server
# at build time; editing the page rebuilds the generated source.
set(KS_PAGE_SRC ${CMAKE_SOURCE_DIR}/src/server/page/index.html)
set(KS_PAGE_C ${CMAKE_BINARY_DIR}/generated/server_page_html.c)
add_custom_command(
  OUTPUT ${KS_PAGE_C}
  COMMAND ${CMAKE_COMMAND} -DIN=${KS_PAGE_SRC} -DOUT=${KS_PAGE_C} -DNAME=server_page_html
          -P ${CMAKE_SOURCE_DIR}/src/server/page/embed.cmake
  DEPENDS ${KS_PAGE_SRC} ${CMAKE_SOURCE_DIR}/src/server/page/embed.cmake
  COMMENT "Embedding the live page ${KS_PAGE_SRC}"
  VERBATIM)
target_sources(ks_server PRIVATE ${KS_PAGE_C})
