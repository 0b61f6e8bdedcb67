// Small text files that other programs read while a job runs (node_exporter's textfile
// collector reads the Prometheus files of locus-train, locus-infer and locus-ingest): replaced
// whole, so a reader never sees half of one.
#pragma once

#include <string>
#include <string_view>

namespace locus::io {

// Replaces `path` with `text`: written to `.<name>.<pid>.locus-tmp` in the same directory, then
// renamed over it. Returns 0, or the errno of the step that failed (the temporary file is then
// removed and `path` left as it was).
int replace_file(const std::string& path, std::string_view text) noexcept;

// Whether this process may create files in the directory of `path`: 0, or the errno that says
// why not.
int directory_writable(const std::string& path) noexcept;

}  // namespace locus::io
