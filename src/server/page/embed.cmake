# cmake -DIN=FILE -DOUT=FILE.c -DNAME=SYMBOL -P embed.cmake
# Writes FILE's bytes into a C source as `const unsigned char SYMBOL[]` and
# `const size_t SYMBOL_len`, so the live page is kept as a real file and
# embedded at build time (as llama.cpp embeds its web UI).
file(READ ${IN} hex HEX)
string(LENGTH "${hex}" n)
math(EXPR n "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REPEAT "0x..," 16 row) # CMake's regex has no {16}
string(REGEX REPLACE "(${row})" "\\1\n    " bytes "${bytes}")
file(WRITE ${OUT} "/* Generated from ${IN} by embed.cmake: do not edit. */\n#include <stddef.h>\n\n"
     "const unsigned char ${NAME}[] = {\n    ${bytes}\n};\nconst size_t ${NAME}_len = ${n};\n")
