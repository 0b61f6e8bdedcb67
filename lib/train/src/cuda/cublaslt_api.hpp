// cuBLASLt, loaded when the CUDA backend first needs it rather than when the process starts.
// Linking libcublasLt makes every process pay for its constructors, which set up its kernel
// tables whether or not a GPU is ever used: about 0.4 s of CPU on this project's machine
// (locus-train --help took 1.1 s against 0.6 s for an app without it), paid by every
// cpu-backend run and every test. The functions the backend calls are looked up once, on the
// first call of lt(); the rest of the backend calls them as lt().Matmul(...) and so on.
#pragma once

#include <cublasLt.h>

namespace locus::train::cuda {

struct CublasLt {
  decltype(&::cublasLtCreate) Create = nullptr;
  decltype(&::cublasLtDestroy) Destroy = nullptr;
  decltype(&::cublasLtGetVersion) GetVersion = nullptr;
  decltype(&::cublasLtGetStatusName) GetStatusName = nullptr;
  decltype(&::cublasLtGetStatusString) GetStatusString = nullptr;
  decltype(&::cublasLtMatmul) Matmul = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
};

// The process's cuBLASLt (libcublasLt.so.<CUDA major>, from LD_LIBRARY_PATH, the executable's
// run path or the CUDA toolkit's library directory this build used), loaded on the first
// call; a CublasError naming the library and what to do when it cannot be loaded. Thread-safe.
const CublasLt& lt();

}  // namespace locus::train::cuda
