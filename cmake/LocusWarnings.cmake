# Warnings live in one INTERFACE target that every locus target links privately.
add_library(locus_warnings INTERFACE)
add_library(locus::warnings ALIAS locus_warnings)
target_compile_options(locus_warnings INTERFACE -Wall -Wextra -Wpedantic -Wundef -Wshadow
                       -Wnon-virtual-dtor -Wno-missing-field-initializers)
if(LOCUS_WERROR)
  target_compile_options(locus_warnings INTERFACE -Werror)
endif()
