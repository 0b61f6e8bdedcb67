// HDF5 handle closing, error-stack capture and initialisation.
#include "locus/io/h5.hpp"

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <mutex>
#include <thread>

#include "locus/comm/app.hpp"
#include "locus/comm/quiet_wait.hpp"

namespace locus::h5 {

void IdTraits::close(hid_t id) noexcept {
  switch (H5Iget_type(id)) {
    case H5I_FILE: H5Fclose(id); break;
    case H5I_GROUP: H5Gclose(id); break;
    case H5I_DATASET: H5Dclose(id); break;
    case H5I_DATASPACE: H5Sclose(id); break;
    case H5I_DATATYPE: H5Tclose(id); break;
    case H5I_ATTR: H5Aclose(id); break;
    case H5I_GENPROP_LST: H5Pclose(id); break;
    default: H5Idec_ref(id); break;
  }
}

void init() {
  static std::once_flag once;
  std::call_once(once, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
}

namespace {
std::string message_text(hid_t msg_id) {
  char buf[256] = {};
  if (H5Eget_msg(msg_id, nullptr, buf, sizeof buf) < 0) return "?";
  return buf;
}

herr_t collect_frame(unsigned n, const H5E_error2_t* err, void* out) {
  auto* text = static_cast<std::string*>(out);
  *text += fmt::format("\n  #{:03} {}:{} in {}(): {} [{}: {}]", n, err->file_name, err->line,
                       err->func_name, err->desc ? err->desc : "", message_text(err->maj_num),
                       message_text(err->min_num));
  return 0;
}
}  // namespace

std::string error_stack() {
  std::string text;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_frame, &text);
  return text;
}

namespace detail {
void h5_fail(const char* call, const char* file, int line) {
  std::string stack = error_stack();
  H5Eclear2(H5E_DEFAULT);
  throw H5Error(fmt::format("{} failed at {}{}{}", call, where(file, line),
                            stack.empty() ? "" : "; HDF5 error stack:", stack));
}

namespace {
// Frames of a write the file system refused: the virtual file driver's write or truncate
// (MPI-IO or POSIX) failed, below whatever HDF5 was doing (raw data, a metadata flush).
bool write_refused(const std::string& stack) {
  return stack.find("H5FD_write()") != std::string::npos ||
         stack.find("H5FD__mpio_write()") != std::string::npos ||
         stack.find("H5FD__sec2_write()") != std::string::npos ||
         stack.find("H5FD_truncate()") != std::string::npos;
}
}  // namespace

std::string file_of(hid_t obj) {
  const ssize_t n = H5Fget_name(obj, nullptr, 0);
  if (n <= 0) return "?";
  std::string name(static_cast<std::size_t>(n) + 1, '\0');
  if (H5Fget_name(obj, name.data(), name.size()) < 0) return "?";
  name.resize(static_cast<std::size_t>(n));
  return name;
}

void h5_write_fail(const char* call, const std::function<std::string()>& name, const char* file,
                   int line) {
  std::string stack = error_stack();
  H5Eclear2(H5E_DEFAULT);
  const std::string path = name();
  if (write_refused(stack)) {
    throw IoError(fmt::format("cannot write '{}': the file system refused a write (disk full, "
                              "over quota or an I/O error; {} failed at {}); free space or "
                              "choose another output path, then rerun; HDF5 error stack:{}",
                              path, call, where(file, line), stack));
  }
  throw H5Error(fmt::format("{} failed on '{}' at {}{}{}", call, path, where(file, line),
                            stack.empty() ? "" : "; HDF5 error stack:", stack));
}

void settle_collective_write(const mpi::Comm& comm, std::exception_ptr own,
                             const std::string& path) {
  constexpr double kPeerWaitS = 30.0;  // peers normally come out within milliseconds
  std::array<int, 2> status{own ? comm.rank() : -1, own ? 0 : 1};  // a failed rank, any ok
  const bool heard = comm::allreduce_max_within(comm, status, own ? kPeerWaitS : 0.0);
  if (!own && status[0] < 0) return;
  if (own && heard && status[1] == 0) std::rethrow_exception(own);  // every rank failed
  if (own) {
    try {
      std::rethrow_exception(own);
    } catch (const Error& e) {
      abort_job(heard ? std::string(e.what())
                      : fmt::format("{} (the other ranks did not come out of the collective "
                                    "write within {:.0f} s)",
                                    e.what(), kPeerWaitS),
                exit_code_for(e.kind()));
    }
  }
  // The failed rank's MPI_Abort ends this process in a moment.
  std::this_thread::sleep_for(std::chrono::duration<double>(kPeerWaitS));
  abort_job(fmt::format("cannot write '{}': rank {}'s part of a collective write failed (its "
                        "message names the cause: disk full, over quota or an I/O error); "
                        "nothing is published; free space or choose another output path, "
                        "then rerun",
                        path, status[0]),
            exit_code::io);
}
}  // namespace detail

}  // namespace locus::h5
