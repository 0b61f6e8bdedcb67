// lt(): dlopen of cuBLASLt and dlsym of the functions the backend uses (cublaslt_api.hpp).
#include "cuda/cublaslt_api.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_check.hpp"

namespace locus::train::cuda {

namespace {

std::string soname() { return fmt::format("libcublasLt.so.{}", CUDART_VERSION / 1000); }

void* open_library(std::string& tried) {
  std::vector<std::string> names{soname()};
#ifdef LOCUS_CUDA_LIBRARY_DIR
  names.push_back(std::string(LOCUS_CUDA_LIBRARY_DIR) + "/" + soname());
#endif
  for (const std::string& name : names) {
    if (void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return h;
    const char* why = ::dlerror();
    tried += fmt::format("{}{} ({})", tried.empty() ? "" : "; ", name, why ? why : "not found");
  }
  return nullptr;
}

template <class Fn>
void bind(void* library, const char* symbol, Fn& fn) {
  fn = reinterpret_cast<Fn>(::dlsym(library, symbol));
  if (fn == nullptr) {
    throw CublasError(fmt::format("{} has no {}: the cuda backend needs the cuBLASLt of CUDA "
                                  "{}; put that library on LD_LIBRARY_PATH",
                                  soname(), symbol, CUDART_VERSION / 1000));
  }
}

CublasLt load() {
  std::string tried;
  void* library = open_library(tried);  // kept open for the life of the process
  if (library == nullptr) {
    throw CublasError(fmt::format(
        "cannot load cuBLASLt for the cuda backend: tried {}; install CUDA {}'s cuBLAS "
        "(libcublasLt) and put its library directory on LD_LIBRARY_PATH, or use "
        "backend = cpu",
        tried, CUDART_VERSION / 1000));
  }
  CublasLt f;
  bind(library, "cublasLtCreate", f.Create);
  bind(library, "cublasLtDestroy", f.Destroy);
  bind(library, "cublasLtGetVersion", f.GetVersion);
  bind(library, "cublasLtGetStatusName", f.GetStatusName);
  bind(library, "cublasLtGetStatusString", f.GetStatusString);
  bind(library, "cublasLtMatmul", f.Matmul);
  bind(library, "cublasLtMatmulAlgoGetHeuristic", f.MatmulAlgoGetHeuristic);
  bind(library, "cublasLtMatmulDescCreate", f.MatmulDescCreate);
  bind(library, "cublasLtMatmulDescDestroy", f.MatmulDescDestroy);
  bind(library, "cublasLtMatmulDescSetAttribute", f.MatmulDescSetAttribute);
  bind(library, "cublasLtMatmulPreferenceCreate", f.MatmulPreferenceCreate);
  bind(library, "cublasLtMatmulPreferenceDestroy", f.MatmulPreferenceDestroy);
  bind(library, "cublasLtMatmulPreferenceSetAttribute", f.MatmulPreferenceSetAttribute);
  bind(library, "cublasLtMatrixLayoutCreate", f.MatrixLayoutCreate);
  bind(library, "cublasLtMatrixLayoutDestroy", f.MatrixLayoutDestroy);
  return f;
}

}  // namespace

const CublasLt& lt() {
  // A failed load throws and is tried again by the next call (call_once's rule).
  static std::once_flag once;
  static CublasLt api;
  std::call_once(once, [] { api = load(); });
  return api;
}

}  // namespace locus::train::cuda
