// IDX input source (the MNIST / Fashion-MNIST format): each rank parses its own records.
#pragma once

#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

struct IdxOptions {
  std::string images;  // IDX file of shape [N, d1, d2, ...] (any IDX dtype), plain or gzip
  std::string labels;  // optional IDX [N] file of integer labels, plain or gzip ("" = none)
};

// Collective over comm. Rank r parses records [begin, end) of the balanced partition of N
// (the first N % size ranks get one extra record), converted to float as stored (no scaling;
// int32 values above 2^24 and float64 values lose precision). Features are flattened to
// D = d1*d2*...; feature_names are "pixel0".."pixel<D-1>"; label_name is "label" when a labels
// file is given. Labels must be an integer dtype (u8, i8, i16, i32) of shape [N] (or [N, 1]).
//
// Gzip (detected by the 1f 8b magic, not the file name) cannot be seeked: each rank streams
// the decompression from the start and discards output until its first record, then stops
// after its last one. That decompression prefix is the price of gzip; ranks still never
// funnel data through each other. The rank holding the last record reads to the end of the
// stream, so zlib verifies the gzip CRC and trailing data is detected.
//
// Throws DataError, identical on every rank, when a file cannot be opened, has a wrong magic,
// an unknown dtype, more than 2^24 features per record, is shorter (or longer) than its
// header says (memory grows with the data read, never with a gzip header's claim), is a
// truncated or corrupt gzip, or when the label count differs from the image count.
Table read_idx(const mpi::Comm& comm, const IdxOptions& opts);

}  // namespace locus::io
