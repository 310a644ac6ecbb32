# ctest install_find_package: installs the build tree into a scratch prefix, then configures, builds
# and runs tests/install as a separate project against it. Any failure is fatal.
# Inputs: -DSOURCE_DIR=<repo> -DBINARY_DIR=<build tree> -DGENERATOR=<CMake generator>.
cmake_minimum_required(VERSION 3.24)

foreach(var SOURCE_DIR BINARY_DIR GENERATOR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run.cmake: -D${var}=... is required")
  endif()
endforeach()

set(work "${BINARY_DIR}/install-test")
set(prefix "${work}/prefix")
set(build "${work}/build")
file(REMOVE_RECURSE "${work}")

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${what}:\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install_find_package: ${what} failed (exit ${rc})")
  endif()
endfunction()

step("install" "${CMAKE_COMMAND}" --install "${BINARY_DIR}" --prefix "${prefix}")
if(NOT EXISTS "${prefix}/include/sparse_attn/sparse_attn.hpp")
  message(FATAL_ERROR "install_find_package: the headers were not installed under ${prefix}/include")
endif()

# The scratch prefix goes first so that a copy installed elsewhere on the system cannot be picked up.
step("configure downstream" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/tests/install" -B "${build}" -G "${GENERATOR}"
     -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
step("build downstream" "${CMAKE_COMMAND}" --build "${build}")
step("run downstream" "${build}/downstream")
