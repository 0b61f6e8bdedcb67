# LOCUS_COVERAGE: gcc's line coverage for every C and C++ target (scripts/coverage.sh builds with
# it and reports with gcovr). Counters are updated atomically: locus runs threads, and racing
# plain increments made counts negative, which gcov's readers refuse. LOCUS_COVERAGE is also
# defined for the code, so that mpi::abort writes a process's counters before MPI_Abort (a
# normal exit writes them; an abort would lose the error paths that end in one).
option(LOCUS_COVERAGE "Build with gcc's coverage instrumentation (scripts/coverage.sh)" OFF)
if(LOCUS_COVERAGE)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    message(FATAL_ERROR "LOCUS_COVERAGE needs gcc (its gcov format is what gcovr reads)")
  endif()
  if(LOCUS_WITH_CUDA)
    message(FATAL_ERROR "LOCUS_COVERAGE needs -DLOCUS_WITH_CUDA=OFF (GPU code runs on a GPU "
                        "only; this measures the CPU suite)")
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:--coverage;-fprofile-update=atomic>")
  add_compile_definitions(LOCUS_COVERAGE)
  add_link_options(--coverage)
  message(STATUS "locus: coverage instrumentation")
endif()
