// Agreement on a verdict before a collective: every rank runs a local check; if any rank
// failed, all ranks throw the same error (the lowest failing rank's kind and message), marked
// agreed so apps exit cleanly on every rank instead of deadlocking or aborting.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::mpi {

struct Failure {
  ErrorKind kind = ErrorKind::internal;
  std::string message;
};

// Collective over comm. Given this rank's failure (or none), returns the lowest failing
// rank's failure on every rank, or nullopt when all ranks succeeded.
std::optional<Failure> agree(const Comm& comm, const std::optional<Failure>& local);

// Collective over comm. Runs fn on every rank; a locus::Error thrown by fn on any rank is
// re-thrown, agreed, on all ranks. Other exceptions are converted to InternalError.
template <class Fn>
void agree_on(const Comm& comm, Fn&& fn) {
  std::optional<Failure> local;
  try {
    std::forward<Fn>(fn)();
  } catch (const Error& e) {
    local = Failure{e.kind(), e.what()};
  } catch (const std::exception& e) {
    local = Failure{ErrorKind::internal, e.what()};
  }
  if (auto f = agree(comm, local)) throw_error(f->kind, f->message, /*agreed=*/true);
}

}  // namespace locus::mpi
