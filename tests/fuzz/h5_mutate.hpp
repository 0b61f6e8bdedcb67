// A structured generator for the HDF5 metadata targets: a valid file written once by locus's own
// writer (the baseline) is copied for each input and edited as the fuzzer's bytes say. Every
// attribute of the chosen objects is kept, deleted or replaced by one of another type, shape or
// value (integers, floats, strings fixed and variable, arrays, empty and null dataspaces, a
// compound, the reader's own keywords); datasets are kept, deleted or replaced by one of
// another shape and type. An exhausted input keeps everything, so an empty input is the valid
// baseline. The readers under test are locus's attribute and layout readers, not HDF5.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <string>
#include <vector>

namespace locus::fuzz {

struct H5Edits {
  std::vector<std::string> objects;   // groups whose attributes are edited ("/", "/model")
  std::vector<std::string> datasets;  // datasets that may be deleted or replaced
  std::vector<std::string> words;     // keywords the reader parses ("relu", "locus-model", ...)
};

// Reads a file's bytes (the baseline).
std::string slurp(const std::string& path);

// Writes `baseline` to `path` and applies the edits `fdp` chooses. Any HDF5 failure while
// editing aborts (it is a harness bug, not a finding).
void write_edited(const std::string& path, const std::string& baseline, const H5Edits& edits,
                  FuzzedDataProvider& fdp);

}  // namespace locus::fuzz
