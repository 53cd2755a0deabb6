# Every external library comes from a Debian package and is found through pkg-config.
# A missing one stops configure with the package to install.
find_package(PkgConfig)
if(NOT PKG_CONFIG_FOUND)
  message(FATAL_ERROR "pkg-config not found: run ./deploy/install-deps.sh (Debian package: pkg-config)")
endif()

function(fu_require_pkg var module debpkg)
  pkg_check_modules(${var} QUIET IMPORTED_TARGET GLOBAL ${module})
  if(NOT ${var}_FOUND)
    message(FATAL_ERROR "fusion needs ${module}: install the Debian package '${debpkg}' "
                        "(or run ./deploy/install-deps.sh)")
  endif()
  message(STATUS "found ${module} ${${var}_VERSION}")
endfunction()

fu_require_pkg(ZMQ       libzmq         libzmq3-dev)
fu_require_pkg(PROTOBUFC libprotobuf-c  libprotobuf-c-dev)
fu_require_pkg(SODIUM    libsodium      libsodium-dev)
fu_require_pkg(SQLITE    sqlite3        libsqlite3-dev)
fu_require_pkg(CJSON     libcjson       libcjson-dev)
fu_require_pkg(MHD       libmicrohttpd  libmicrohttpd-dev)
fu_require_pkg(OPENBLAS  openblas       libopenblas-dev)
fu_require_pkg(LAPACKE   lapacke        liblapacke-dev)
if(BUILD_TESTING OR NOT DEFINED BUILD_TESTING)
  fu_require_pkg(CMOCKA  cmocka         libcmocka-dev)
endif()

find_program(PROTOC_C protoc-c)
if(NOT PROTOC_C)
  message(FATAL_ERROR "fusion needs protoc-c: install the Debian package 'protobuf-c-compiler' "
                      "(or run ./deploy/install-deps.sh)")
endif()

find_package(Threads REQUIRED)
find_library(MATH_LIB m REQUIRED)
