// What every locus fuzz target shares: MPI started once per process (a singleton world of one
// rank), inputs written to scratch files for the parsers that take a path, and the verdict on
// an exception: locus's typed errors for bad input are the expected outcome, anything else
// (another exception type, an internal error from an assertion or a std:: exception turned
// into one by agree_on) is a bug and aborts, so libFuzzer records the input as a crash.
#pragma once

#include <cstddef>
#include <exception>
#include <string>
#include <string_view>

#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::fuzz {

// Starts MPI (once; call from LLVMFuzzerInitialize) and returns the one-rank world.
const mpi::Comm& world();

// A scratch file of this process in /dev/shm (else the temp directory), removed at exit.
class ScratchFile {
 public:
  explicit ScratchFile(std::string_view tag);
  ~ScratchFile();
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  const std::string& path() const noexcept { return path_; }
  // Replaces the file's contents.
  void write(const void* data, std::size_t size) const;
  void write(std::string_view text) const { write(text.data(), text.size()); }
  void remove() const;

 private:
  std::string path_;
};

// Closes every HDF5 object still open. Locus leaves a file open while an exception unwinds
// (closing is collective; HDF5 closes it at MPI_Finalize), so a process that reads thousands
// of rejected files must close them itself after each input, as MPI_Finalize would.
void close_open_h5_objects();

// Prints what went wrong and aborts (libFuzzer then saves the input as a crash).
[[noreturn]] void unexpected(std::string_view what, std::string_view message);
// ConfigError, DataError and H5Error: the parsers' typed rejection of bad input.
bool expected_kind(ErrorKind kind);

// Runs fn; returns true when it returned, false when it threw an expected error. Aborts with
// the message on any other error kind or exception type.
template <class Fn>
bool parses(Fn&& fn) {
  try {
    fn();
    return true;
  } catch (const Error& e) {
    if (!expected_kind(e.kind())) unexpected("locus::Error of an unexpected kind", e.what());
    return false;
  } catch (const std::exception& e) {
    unexpected("an exception that is not a locus::Error", e.what());
  } catch (...) {
    unexpected("an exception of unknown type", "");
  }
}

}  // namespace locus::fuzz
