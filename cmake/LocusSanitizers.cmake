# LOCUS_SANITIZE: "address,undefined" (ASan + UBSan) or "thread" (TSan) for every C and C++
# target of the build. UBSan findings abort (-fno-sanitize-recover), so a test that trips one
# fails. The CUDA backend must be off in such builds (-DLOCUS_WITH_CUDA=OFF): the CUDA runtime
# and the sanitizers' memory maps do not mix. scripts/sanitize.sh configures, builds and runs
# the suites with the runtime options and the suppressions of tests/sanitizers/.
set(LOCUS_SANITIZE "" CACHE STRING "Sanitizers for every target: address,undefined | thread")
if(LOCUS_SANITIZE)
  if(NOT LOCUS_SANITIZE MATCHES "^(address,undefined|address|undefined|thread)$")
    message(FATAL_ERROR "LOCUS_SANITIZE=${LOCUS_SANITIZE}: use address,undefined or thread")
  endif()
  if(LOCUS_WITH_CUDA)
    message(FATAL_ERROR "LOCUS_SANITIZE needs -DLOCUS_WITH_CUDA=OFF (the CUDA runtime and the "
                        "sanitizers do not mix)")
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=${LOCUS_SANITIZE};-fno-omit-frame-pointer;-fno-sanitize-recover=all>")
  add_link_options("-fsanitize=${LOCUS_SANITIZE}")
  # GCC 12's flow analysis sees the sanitizers' instrumentation as uninitialised reads inside
  # libstdc++ (std::function in <regex>): false positives that -Werror would turn into errors.
  target_compile_options(locus_warnings INTERFACE
                         "$<$<COMPILE_LANGUAGE:CXX>:-Wno-maybe-uninitialized>")
  message(STATUS "locus: sanitizers ${LOCUS_SANITIZE}")
endif()
