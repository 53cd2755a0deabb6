# cmake -DIN=FILE -DOUT=FILE.c -DNAME=SYMBOL -P embed.cmake: FILE's bytes as a C array SYMBOL (NUL-terminated)
# and SYMBOL_len (their count), so that the broker carries its dashboard page with no file to install.
file(READ ${IN} HEX HEX)
string(LENGTH "${HEX}" N)
math(EXPR LEN "${N} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," BYTES "${HEX}")
string(REGEX REPLACE "((0x..,){24})" "\\1\n    " BYTES "${BYTES}")
file(WRITE ${OUT} "/* Generated from ${IN} by broker/embed.cmake: do not edit. */\n#include <stddef.h>\n\n"
                  "const unsigned char ${NAME}[] = {\n    ${BYTES}0x00};\nconst size_t ${NAME}_len = ${LEN};\n")
