# Warnings live in one INTERFACE target that every locus target links privately. The C++ set
# applies to C++ sources only: nvcc rejects most of these flags, and -Wpedantic/-Wundef passed
# through -Xcompiler drown in CUDA's own headers. CUDA sources get their own set: nvcc's
# warnings plus the host compiler's -Wall/-Wextra on the host side of each .cu file.
add_library(locus_warnings INTERFACE)
add_library(locus::warnings ALIAS locus_warnings)
target_compile_options(locus_warnings INTERFACE
  "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wpedantic;-Wundef;-Wshadow;-Wnon-virtual-dtor;-Wno-missing-field-initializers>"
  "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-missing-field-initializers>")
if(LOCUS_WERROR)
  target_compile_options(locus_warnings INTERFACE "$<$<COMPILE_LANGUAGE:CXX>:-Werror>"
                         "$<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings;-Xcompiler=-Werror>")
endif()
