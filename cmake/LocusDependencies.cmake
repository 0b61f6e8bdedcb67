# Finds every dependency from Debian 12 packages. GPU support is optional and off when absent.
find_package(MPI REQUIRED COMPONENTS C)
find_package(Threads REQUIRED)
find_package(ZLIB REQUIRED)

# Debian installs the parallel HDF5 under an "openmpi" flavour; point FindHDF5 at it.
set(HDF5_PREFER_PARALLEL TRUE)
if(NOT HDF5_C_COMPILER_EXECUTABLE AND EXISTS /usr/bin/h5pcc.openmpi)
  set(HDF5_C_COMPILER_EXECUTABLE /usr/bin/h5pcc.openmpi)
endif()
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "locus needs a parallel (MPI-IO) HDF5: install libhdf5-openmpi-dev "
                      "(scripts/install-deps.sh does it)")
endif()

set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(CBLAS_INCLUDE_DIR cblas.h PATHS /usr/include/x86_64-linux-gnu/openblas-pthread
          /usr/include/openblas /usr/include REQUIRED)

find_package(Boost 1.74 REQUIRED COMPONENTS program_options)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3 REQUIRED)  # nlohmann-json3-dev: the JSON reports and metrics

# Optional GPU backend: detected, never required.
option(LOCUS_WITH_CUDA "Build the CUDA/cuBLAS backend when CUDA is found" ON)
option(LOCUS_WITH_NCCL "Build the NCCL reducer when NCCL is found" ON)
if(LOCUS_WITH_CUDA)
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND)
    set(LOCUS_WITH_CUDA OFF)
  endif()
endif()
if(LOCUS_WITH_CUDA AND NOT EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/lib/train/src/cuda/kernels.cu)
  # The backend's host code is in the tree; its kernels are not yet: build without it.
  message(STATUS "locus: lib/train/src/cuda/kernels.cu is not written yet: CUDA backend off")
  set(LOCUS_WITH_CUDA OFF)
endif()
if(LOCUS_WITH_CUDA)
  # No GPU at configure time (CI, the build hosts): name the targets instead of letting CMake
  # probe one. 90 = sm_90 machine code for Hopper (H100/H200) plus compute_90 PTX that the
  # driver compiles for newer parts. Override with -DCMAKE_CUDA_ARCHITECTURES=...
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  if(NOT CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
  endif()
  if(NOT CMAKE_CUDA_HOST_COMPILER)
    set(CMAKE_CUDA_HOST_COMPILER ${CMAKE_CXX_COMPILER})
  endif()
  enable_language(CUDA)
  # CMake 3.25 knows no nvcc flag for C++20 and, with CXX_STANDARD 20 set, refuses CUDA sources
  # ("requires the language dialect CUDA20"): tell it the flag nvcc >= 12 takes.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  # Line tables for device code, so that compute-sanitizer (bench/gpu/run_gpu.sh) and ncu name
  # the source line of a finding. The machine code stays the same: the sm_90 cubins of
  # kernels.cu and score_kernels.cu built with and without it have byte-identical .text
  # sections (56 kernels; the flag adds .debug_line and .nv_debug_line_sass only).
  add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>")
endif()
if(LOCUS_WITH_NCCL AND LOCUS_WITH_CUDA)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_ROOT} /usr/local/cuda
               PATH_SUFFIXES lib lib64 targets/x86_64-linux/lib)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  if(NOT NCCL_LIBRARY OR NOT NCCL_INCLUDE_DIR)
    set(LOCUS_WITH_NCCL OFF)
  endif()
else()
  set(LOCUS_WITH_NCCL OFF)
endif()
message(STATUS "locus: CUDA backend ${LOCUS_WITH_CUDA}, NCCL reducer ${LOCUS_WITH_NCCL}")
