// The raw-I/O side of the HDF5 bandwidth benchmark: `dd conv=fsync` and `cat` of the same
// bytes on the same file system, page-cache eviction and residency of one file, and the
// waits that keep idle ranks off the CPU while rank 0 runs a shell command.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "locus/comm/mpi.hpp"

namespace locus::bench {

// Collective over comm: a barrier that sleeps between polls instead of spinning, so a rank
// that waits does not take one of the machine's two cores from the rank or command at work.
void idle_barrier(const mpi::Comm& comm);

// Collective over comm: rank 0 runs fn while the others wait in idle_barrier; an error on
// rank 0 is re-thrown, agreed, on every rank.
void on_root(const mpi::Comm& comm, const std::function<void()>& fn);

// Runs a shell command; throws IoError naming it when it fails.
void run_shell(const std::string& command);

// `dd if=/dev/zero of=path bs=16M count=bytes/16MiB conv=fsync` (bytes: a multiple of 16 MiB).
std::string dd_write_command(const std::string& path, std::uint64_t bytes);
// `cat path > /dev/null`.
std::string cat_read_command(const std::string& path);

// Drops a file's (clean) pages from the page cache with posix_fadvise(DONTNEED): a cold read
// without root's global drop_caches. Throws IoError naming the file.
void evict_from_page_cache(const std::string& path);
// The fraction of the file's pages in the page cache (mincore), to show a read was cold.
double resident_fraction(const std::string& path);

// The file system type of a directory ("ext4", "xfs", "tmpfs", "nfs", "lustre", ... or the
// statfs magic number in hex).
std::string filesystem_type(const std::string& dir);

// Removes a file if it exists; throws IoError naming it otherwise.
void remove_file(const std::string& path);

}  // namespace locus::bench
