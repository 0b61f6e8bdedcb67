// MPI environment and communicators with explicit ownership: Comm::world() borrows
// MPI_COMM_WORLD; dup() and split() return communicators that free themselves.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "locus/comm/error.hpp"

namespace locus::mpi {

// The first object of every main: initialises MPI with the requested thread level, refuses a
// lower one, sets MPI_ERRORS_RETURN on MPI_COMM_WORLD and finalizes in its destructor.
class Environment {
 public:
  Environment(int& argc, char**& argv, int required = MPI_THREAD_FUNNELED);
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;
  ~Environment();
  int thread_level() const noexcept { return provided_; }

 private:
  int provided_ = MPI_THREAD_SINGLE;
  bool owns_ = false;
};

template <class T> MPI_Datatype datatype();
template <> inline MPI_Datatype datatype<float>() { return MPI_FLOAT; }
template <> inline MPI_Datatype datatype<double>() { return MPI_DOUBLE; }
template <> inline MPI_Datatype datatype<int>() { return MPI_INT; }
template <> inline MPI_Datatype datatype<std::int64_t>() { return MPI_INT64_T; }
template <> inline MPI_Datatype datatype<std::uint64_t>() { return MPI_UINT64_T; }
template <> inline MPI_Datatype datatype<char>() { return MPI_CHAR; }
template <> inline MPI_Datatype datatype<unsigned char>() { return MPI_UNSIGNED_CHAR; }

class Comm {
 public:
  static Comm world() noexcept { return Comm(MPI_COMM_WORLD, false); }
  // Wraps a communicator without taking ownership.
  static Comm borrow(MPI_Comm c) noexcept { return Comm(c, false); }
  // A null communicator (get() == MPI_COMM_NULL), e.g. what split() gives with MPI_UNDEFINED.
  Comm() noexcept = default;

  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  Comm(Comm&& o) noexcept;
  Comm& operator=(Comm&& o) noexcept;
  ~Comm();

  // Collective over this communicator. The results are owned and freed on destruction.
  Comm dup() const;
  Comm split(int color, int key) const;
  // A borrowed view of the same communicator (no ownership).
  Comm view() const noexcept { return Comm(c_, false); }

  MPI_Comm get() const noexcept { return c_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  bool is_root() const noexcept { return rank_ == 0; }

  // Collectives over this communicator.
  void barrier() const;
  template <class T> T allreduce(T v, MPI_Op op) const {
    T out{};
    LOCUS_MPI_CHECK(MPI_Allreduce(&v, &out, 1, datatype<T>(), op, c_));
    return out;
  }
  template <class T> void allreduce_inplace(std::span<T> v, MPI_Op op) const {
    LOCUS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()),
                                  datatype<T>(), op, c_));
  }
  // Exclusive prefix sum (0 on rank 0).
  std::int64_t exscan_sum(std::int64_t v) const;
  template <class T> std::vector<T> allgather(T v) const {
    std::vector<T> out(static_cast<std::size_t>(size_));
    LOCUS_MPI_CHECK(MPI_Allgather(&v, 1, datatype<T>(), out.data(), 1, datatype<T>(), c_));
    return out;
  }
  // Broadcasts a string from root (every rank returns root's value).
  std::string bcast(std::string s, int root = 0) const;
  template <class T> void bcast(std::span<T> v, int root = 0) const {
    LOCUS_MPI_CHECK(MPI_Bcast(v.data(), static_cast<int>(v.size()), datatype<T>(), root, c_));
  }

 private:
  Comm(MPI_Comm c, bool owned) noexcept;
  void free_if_owned() noexcept;

  MPI_Comm c_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 1;
};

// Rank in MPI_COMM_WORLD, or -1 before MPI_Init / after MPI_Finalize (used in messages).
int world_rank() noexcept;
int world_size() noexcept;
std::string hostname();

// MPI_Abort(comm, code), which does not return: the one way a locus process ends the job
// abnormally. A coverage build (-DLOCUS_COVERAGE=ON) first writes the process's counters, which
// only a normal exit would write.
[[noreturn]] void abort(MPI_Comm comm, int code) noexcept;

}  // namespace locus::mpi
