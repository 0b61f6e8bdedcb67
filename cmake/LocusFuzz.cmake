# LOCUS_FUZZ: every target is compiled with libFuzzer's coverage instrumentation and ASan +
# UBSan (any undefined behaviour aborts, so the fuzzer reports it as a crash); tests/fuzz adds
# one libFuzzer executable per parser of outside data. clang only: Debian's clang-14 with
# libclang-rt-14-dev provides libFuzzer and the sanitizer runtimes.
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "LOCUS_FUZZ needs clang (libFuzzer): configure a separate build directory "
                      "with -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 "
                      "(scripts/sanitize.sh asan does it)")
endif()
# -O1 and line tables only: the sanitizers find the same bugs, the build is much faster.
add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all
                    -fno-omit-frame-pointer -O1 -gline-tables-only)
add_link_options(-fsanitize=address,undefined)
