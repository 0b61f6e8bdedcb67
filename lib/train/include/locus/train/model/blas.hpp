// The BLAS thread count. locus trains with 1 BLAS thread per rank unless told otherwise
// (ranks already occupy the cores); OpenBLAS alone would start one thread per core.
#pragma once

namespace locus::train {

// Sets OpenBLAS's thread count (openblas_set_num_threads); n >= 1 (ConfigError otherwise).
void set_blas_threads(int n = 1);
int blas_threads() noexcept;

}  // namespace locus::train
