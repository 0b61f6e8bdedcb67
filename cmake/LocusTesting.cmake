# Test registration: one line registers a unit test, or an MPI test at several rank counts.
find_package(GTest REQUIRED)
set(LOCUS_MPIEXEC ${MPIEXEC_EXECUTABLE} CACHE STRING "MPI launcher used by the tests")
# Open MPI on a small box (and as root, as in CI) needs these.
set(LOCUS_MPIEXEC_FLAGS --oversubscribe --bind-to none CACHE STRING "Extra launcher flags")
set(LOCUS_TEST_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    OMPI_MCA_rmaps_base_oversubscribe=1 OPENBLAS_NUM_THREADS=1
    # Oversubscribed ranks must yield while they wait, or their busy-polling starves the
    # peer (and the loader threads) they wait for.
    OMPI_MCA_mpi_yield_when_idle=1
    # The ob1 PML, which Open MPI picks on these hosts anyway (pml_base_verbose), named: else
    # every MPI_Init first opens the cm PML's PSM, PSM2 and libfabric MTLs, 0.2 s of waiting
    # for fabrics these hosts lack, and the tests start an MPI job about every second
    # (app_train.np2 29 -> 19 s, app_infer.np2 70 -> 55 s alone; docs/CI-TIME.md). Not
    # "^cm": the ucx PML then initialises, and under ThreadSanitizer every rank crashed in it.
    OMPI_MCA_pml=ob1
    LOCUS_SOURCE_DIR=${CMAKE_SOURCE_DIR} LOCUS_BINARY_DIR=${CMAKE_BINARY_DIR})

# locus_add_test(name SOURCES ... [LIBS ...] [LABELS ...] [TIMEOUT s])
function(locus_add_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main locus::warnings)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "unit;${T_LABELS}"
                       ENVIRONMENT "${LOCUS_TEST_ENV}")
endfunction()

# locus_add_mpi_test(name SOURCES ... [LIBS ...] RANKS 1 2 4 [LABELS ...] [TIMEOUT s])
# Builds one executable with the MPI test main (failures gathered from every rank) and
# registers one ctest per rank count, named name.np<N>, with PROCESSORS so ctest -j does
# not oversubscribe the machine more than the launcher already does.
function(locus_add_mpi_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;RANKS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} locus::mpi_test_main locus::warnings)
  if(NOT T_RANKS)
    set(T_RANKS 1 2 4)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 180)
  endif()
  foreach(np IN LISTS T_RANKS)
    set(test_name ${name}.np${np})
    add_test(NAME ${test_name}
             COMMAND ${LOCUS_MPIEXEC} ${LOCUS_MPIEXEC_FLAGS} -n ${np} $<TARGET_FILE:${name}>)
    set(procs ${np})
    if(procs GREATER 2)
      set(procs 2)
    endif()
    set_tests_properties(${test_name} PROPERTIES TIMEOUT ${T_TIMEOUT} PROCESSORS ${procs}
                         LABELS "mpi;${T_LABELS}" ENVIRONMENT "${LOCUS_TEST_ENV}")
  endforeach()
endfunction()

# locus_add_script_test(name COMMAND ... [LABELS ...] [TIMEOUT s] [PROCESSORS n])
# End-to-end tests driven by a shell script (apps under mpiexec, Slurm jobs).
function(locus_add_script_test name)
  cmake_parse_arguments(T "" "TIMEOUT;PROCESSORS" "COMMAND;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  if(NOT T_PROCESSORS)
    set(T_PROCESSORS 2)
  endif()
  add_test(NAME ${name} COMMAND ${T_COMMAND})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} PROCESSORS ${T_PROCESSORS}
                       LABELS "${T_LABELS}" ENVIRONMENT "${LOCUS_TEST_ENV};LOCUS_MPIEXEC=${LOCUS_MPIEXEC}")
endfunction()

# locus_add_gpu_test(name SOURCES ... [LIBS ...] [RANKS n ...] [TIMEOUT s])
# A test of the CUDA backend (label gpu), built only with LOCUS_WITH_CUDA. Without a usable
# device its cases call GTEST_SKIP with the reason, and ctest reports the test as skipped
# (not passed). With RANKS it is an MPI test (the MPI test main) at those rank counts.
function(locus_add_gpu_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;RANKS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  if(T_RANKS)
    locus_add_mpi_test(${name} SOURCES ${T_SOURCES} LIBS ${T_LIBS} RANKS ${T_RANKS}
                       LABELS gpu TIMEOUT ${T_TIMEOUT})
    foreach(np IN LISTS T_RANKS)
      set_tests_properties(${name}.np${np} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
    endforeach()
  else()
    locus_add_test(${name} SOURCES ${T_SOURCES} LIBS ${T_LIBS} LABELS gpu TIMEOUT ${T_TIMEOUT})
    set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
  endif()
endfunction()
