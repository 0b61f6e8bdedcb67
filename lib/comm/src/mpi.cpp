// MPI environment and owned/borrowed communicators.
#include "locus/comm/mpi.hpp"

#include <unistd.h>

#include <cstdlib>
#include <utility>

#include <fmt/format.h>

#ifdef LOCUS_COVERAGE
extern "C" void __gcov_dump(void);  // libgcov (gcc >= 11)
#endif

namespace locus::mpi {

namespace {
const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "unknown";
  }
}
}  // namespace

Environment::Environment(int& argc, char**& argv, int required) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0) {
    LOCUS_MPI_CHECK(MPI_Init_thread(&argc, &argv, required, &provided_));
    owns_ = true;
  } else {
    MPI_Query_thread(&provided_);
  }
  LOCUS_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  if (provided_ < required) {
    throw MpiError(fmt::format(
        "the MPI library provides {} but locus needs {}: use an MPI built with thread support "
        "(Debian's OpenMPI provides MPI_THREAD_MULTIPLE)",
        thread_level_name(provided_), thread_level_name(required)));
  }
}

Environment::~Environment() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && finalized == 0) MPI_Finalize();
}

Comm::Comm(MPI_Comm c, bool owned) noexcept : c_(c), owned_(owned) {
  if (c_ != MPI_COMM_NULL) {
    MPI_Comm_rank(c_, &rank_);
    MPI_Comm_size(c_, &size_);
  }
}

Comm::Comm(Comm&& o) noexcept
    : c_(std::exchange(o.c_, MPI_COMM_NULL)), owned_(std::exchange(o.owned_, false)),
      rank_(o.rank_), size_(o.size_) {}

Comm& Comm::operator=(Comm&& o) noexcept {
  if (this != &o) {
    free_if_owned();
    c_ = std::exchange(o.c_, MPI_COMM_NULL);
    owned_ = std::exchange(o.owned_, false);
    rank_ = o.rank_;
    size_ = o.size_;
  }
  return *this;
}

Comm::~Comm() { free_if_owned(); }

void Comm::free_if_owned() noexcept {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && c_ != MPI_COMM_NULL && finalized == 0) MPI_Comm_free(&c_);
  c_ = MPI_COMM_NULL;
  owned_ = false;
}

Comm Comm::dup() const {
  MPI_Comm out = MPI_COMM_NULL;
  LOCUS_MPI_CHECK(MPI_Comm_dup(c_, &out));
  LOCUS_MPI_CHECK(MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN));
  return Comm(out, true);
}

Comm Comm::split(int color, int key) const {
  MPI_Comm out = MPI_COMM_NULL;
  LOCUS_MPI_CHECK(MPI_Comm_split(c_, color, key, &out));
  if (out != MPI_COMM_NULL) LOCUS_MPI_CHECK(MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN));
  return Comm(out, true);
}

void Comm::barrier() const { LOCUS_MPI_CHECK(MPI_Barrier(c_)); }

std::int64_t Comm::exscan_sum(std::int64_t v) const {
  std::int64_t out = 0;
  LOCUS_MPI_CHECK(MPI_Exscan(&v, &out, 1, MPI_INT64_T, MPI_SUM, c_));
  return rank_ == 0 ? 0 : out;  // MPI leaves rank 0's result undefined
}

std::string Comm::bcast(std::string s, int root) const {
  std::uint64_t n = s.size();
  LOCUS_MPI_CHECK(MPI_Bcast(&n, 1, MPI_UINT64_T, root, c_));
  s.resize(n);
  if (n > 0) LOCUS_MPI_CHECK(MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, root, c_));
  return s;
}

int world_rank() noexcept {
  int init = 0, fin = 0, r = -1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init != 0 && fin == 0) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() noexcept {
  int init = 0, fin = 0, n = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init != 0 && fin == 0) MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

void abort(MPI_Comm comm, int code) noexcept {
#ifdef LOCUS_COVERAGE
  __gcov_dump();
#endif
  MPI_Abort(comm, code);
  std::_Exit(code);  // MPI_Abort should not return
}

}  // namespace locus::mpi
