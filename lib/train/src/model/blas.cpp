// The BLAS thread count (OpenBLAS's own setter, declared in its cblas.h).
#include "locus/train/model/blas.hpp"

#include <cblas.h>
#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::train {

void set_blas_threads(int n) {
  if (n < 1) {
    throw ConfigError(fmt::format("BLAS threads {} is invalid: use 1 or more (1 per rank is "
                                  "the usual choice)",
                                  n));
  }
  openblas_set_num_threads(n);
}

int blas_threads() noexcept { return openblas_get_num_threads(); }

}  // namespace locus::train
