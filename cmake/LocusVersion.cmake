# Generates locus/config.hpp: version, git revision (at configure time) and GPU switches.
execute_process(COMMAND git rev-parse --short=12 HEAD
                WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}
                OUTPUT_VARIABLE LOCUS_GIT_REVISION OUTPUT_STRIP_TRAILING_WHITESPACE
                ERROR_QUIET RESULT_VARIABLE _git_rc)
if(NOT _git_rc EQUAL 0 OR LOCUS_GIT_REVISION STREQUAL "")
  set(LOCUS_GIT_REVISION "unknown")
endif()
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/cmake/config.hpp.in
               ${CMAKE_CURRENT_BINARY_DIR}/generated/locus/config.hpp @ONLY)
add_library(locus_config INTERFACE)
add_library(locus::config ALIAS locus_config)
target_include_directories(locus_config INTERFACE ${CMAKE_CURRENT_BINARY_DIR}/generated)
