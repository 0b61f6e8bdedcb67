// Test-only LD_PRELOAD shim for the chaos suite (tests/chaos): makes write-side system calls
// fail with ENOSPC or EIO, as a full or failing disk would, so the apps' handling of a failed
// write can be checked end to end (exit 5 naming the path, nothing published, earlier outputs
// and checkpoints intact). Never linked into locus itself.
//
// Intercepted (through the dynamic linker, so calls made by locus, HDF5 and Open MPI's MPI-IO
// components are all seen): write, pwrite, pwrite64, writev, pwritev, pwritev64, pwritev2,
// copy_file_range, fsync, fdatasync. Not seen: writes glibc makes internally (stdio's
// fwrite/fflush/fclose call the kernel without going through these symbols).
//
// Controlled by environment variables (read once, at the first intercepted call):
//   LOCUS_FAULT_ERRNO      ENOSPC (default) or EIO: the error of a failing call
//   LOCUS_FAULT_PATH       only calls on files whose path (readlink /proc/self/fd/N) contains
//                          this substring count and fail (default: every regular file)
//   LOCUS_FAULT_AFTER_BYTES  fail once this many bytes were written to matching files by this
//                          process (a write that crosses the limit is cut short at it, as the
//                          kernel does on a full disk; the next one fails)
//   LOCUS_FAULT_AT_CALL    fail the N-th matching call (1-based) and every later one
//   LOCUS_FAULT_CALLS      comma-separated call names that count and fail (default: all above;
//                          e.g. "fsync,fdatasync" to fail only the flushes)
//   LOCUS_FAULT_RANK       only in the process whose OMPI_COMM_WORLD_RANK / PMIX_RANK equals it
//   LOCUS_FAULT_TRACE      a file: one line per matching call ("pid call path bytes result"),
//                          appended with O_APPEND (several processes share it)
// Without LOCUS_FAULT_AFTER_BYTES and LOCUS_FAULT_AT_CALL nothing fails (trace only). Once a
// call failed, every later matching call fails too: a full disk stays full.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;
static int g_active;           // this process matches LOCUS_FAULT_RANK (or none is set)
static int g_errno = ENOSPC;
static const char* g_path;     // substring filter, or NULL
static long long g_after_bytes = -1;
static long long g_at_call = -1;
static const char* g_calls;    // comma-separated names, or NULL for all
static int g_trace_fd = -1;
static long long g_bytes;      // bytes written to matching files
static long long g_count;      // matching calls
static int g_failed;           // sticky

static ssize_t (*real_write)(int, const void*, size_t);
static ssize_t (*real_pwrite)(int, const void*, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void*, size_t, off64_t);
static ssize_t (*real_writev)(int, const struct iovec*, int);
static ssize_t (*real_pwritev)(int, const struct iovec*, int, off_t);
static ssize_t (*real_pwritev64)(int, const struct iovec*, int, off64_t);
static ssize_t (*real_pwritev2)(int, const struct iovec*, int, off_t, int);
static ssize_t (*real_copy_file_range)(int, loff_t*, int, loff_t*, size_t, unsigned int);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);

static long long env_ll(const char* name) {
  const char* v = getenv(name);
  return v != NULL && *v != '\0' ? atoll(v) : -1;
}

static void init(void) {
  real_write = dlsym(RTLD_NEXT, "write");
  real_pwrite = dlsym(RTLD_NEXT, "pwrite");
  real_pwrite64 = dlsym(RTLD_NEXT, "pwrite64");
  real_writev = dlsym(RTLD_NEXT, "writev");
  real_pwritev = dlsym(RTLD_NEXT, "pwritev");
  real_pwritev64 = dlsym(RTLD_NEXT, "pwritev64");
  real_pwritev2 = dlsym(RTLD_NEXT, "pwritev2");
  real_copy_file_range = dlsym(RTLD_NEXT, "copy_file_range");
  real_fsync = dlsym(RTLD_NEXT, "fsync");
  real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
  const char* e = getenv("LOCUS_FAULT_ERRNO");
  if (e != NULL && strcmp(e, "EIO") == 0) g_errno = EIO;
  g_path = getenv("LOCUS_FAULT_PATH");
  if (g_path != NULL && *g_path == '\0') g_path = NULL;
  g_after_bytes = env_ll("LOCUS_FAULT_AFTER_BYTES");
  g_at_call = env_ll("LOCUS_FAULT_AT_CALL");
  g_calls = getenv("LOCUS_FAULT_CALLS");
  if (g_calls != NULL && *g_calls == '\0') g_calls = NULL;
  g_active = 1;
  const char* want = getenv("LOCUS_FAULT_RANK");
  if (want != NULL && *want != '\0') {
    const char* rank = getenv("OMPI_COMM_WORLD_RANK");
    if (rank == NULL) rank = getenv("PMIX_RANK");
    g_active = rank != NULL && strcmp(rank, want) == 0;
  }
  const char* trace = getenv("LOCUS_FAULT_TRACE");
  if (trace != NULL && *trace != '\0') {
    g_trace_fd = open(trace, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  }
}

static int call_selected(const char* call) {
  if (g_calls == NULL) return 1;
  const size_t n = strlen(call);
  for (const char* p = g_calls; (p = strstr(p, call)) != NULL; p += n) {
    const int starts = p == g_calls || p[-1] == ',';
    const int ends = p[n] == '\0' || p[n] == ',';
    if (starts && ends) return 1;
  }
  return 0;
}

// The path of fd into buf ("" when it is not a regular file: pipes, sockets, ttys never count,
// so Open MPI's and the terminal's traffic is left alone).
static void path_of(int fd, char* buf, size_t size) {
  buf[0] = '\0';
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return;
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, buf, size - 1);
  buf[n > 0 ? (size_t)n : 0] = '\0';
}

static void trace(const char* call, const char* path, long long bytes, long long result) {
  if (g_trace_fd < 0) return;
  char line[4352];
  const int n = snprintf(line, sizeof line, "%ld %s %s %lld %lld\n", (long)getpid(), call, path,
                         bytes, result);
  if (n > 0 && real_write != NULL) {
    const ssize_t ignored = real_write(g_trace_fd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
    (void)ignored;
  }
}

// Decides a matching call's fate: -1 (fail with g_errno), or how many of `bytes` may be
// written (all of them, or fewer where the byte limit cuts the call short). *matched says
// whether the call counts at all (a regular file, the path filter, the call list).
static long long decide(const char* call, int fd, long long bytes, char* path, size_t size,
                        int* matched) {
  pthread_once(&g_once, init);
  *matched = 0;
  path[0] = '\0';
  if (!g_active || !call_selected(call)) return bytes;
  path_of(fd, path, size);
  if (path[0] == '\0') return bytes;
  if (g_path != NULL && strstr(path, g_path) == NULL) return bytes;
  *matched = 1;
  pthread_mutex_lock(&g_mutex);
  long long allowed = bytes;
  ++g_count;
  if (g_failed || (g_at_call > 0 && g_count >= g_at_call)) {
    allowed = -1;
  } else if (g_after_bytes >= 0 && bytes > 0) {
    const long long left = g_after_bytes - g_bytes;
    if (left <= 0) allowed = -1;
    else if (bytes > left) allowed = left;
  }
  if (allowed < 0) g_failed = 1;
  else g_bytes += allowed;
  pthread_mutex_unlock(&g_mutex);
  return allowed;
}

#define PATH_BUF 4096

ssize_t write(int fd, const void* buf, size_t count) {
  char path[PATH_BUF];
  int m = 0;
  const long long ok = decide("write", fd, (long long)count, path, sizeof path, &m);
  ssize_t r;
  if (ok < 0) {
    r = -1;
    errno = g_errno;
  } else {
    r = real_write(fd, buf, (size_t)ok);
  }
  if (m) {
    const int e = errno;
    trace("write", path, (long long)count, r);
    errno = e;
  }
  return r;
}

#define PWRITE_LIKE(name, off_type, real)                                              \
  ssize_t name(int fd, const void* buf, size_t count, off_type offset) {               \
    char path[PATH_BUF];                                                               \
    int m = 0;                                                                         \
    const long long ok = decide(#name, fd, (long long)count, path, sizeof path, &m);    \
    ssize_t r;                                                                         \
    if (ok < 0) {                                                                      \
      r = -1;                                                                          \
      errno = g_errno;                                                                 \
    } else {                                                                           \
      r = real(fd, buf, (size_t)ok, offset);                                           \
    }                                                                                  \
    if (m) {                                                                           \
      const int e = errno;                                                             \
      trace(#name, path, (long long)count, r);                                         \
      errno = e;                                                                       \
    }                                                                                  \
    return r;                                                                          \
  }

PWRITE_LIKE(pwrite, off_t, real_pwrite)
PWRITE_LIKE(pwrite64, off64_t, real_pwrite64)

static long long iov_bytes(const struct iovec* iov, int n) {
  long long total = 0;
  for (int i = 0; i < n; ++i) total += (long long)iov[i].iov_len;
  return total;
}

// Vectored writes fail whole or pass whole (a cut inside one would need a copy of the vector;
// the byte limit is then exceeded by at most one call).
#define PWRITEV_LIKE(name, off_type, real)                                             \
  ssize_t name(int fd, const struct iovec* iov, int n, off_type offset) {              \
    char path[PATH_BUF];                                                               \
    int m = 0;                                                                         \
    const long long bytes = iov_bytes(iov, n);                                         \
    const long long ok = decide(#name, fd, bytes, path, sizeof path, &m);               \
    ssize_t r;                                                                         \
    if (ok < 0) {                                                                      \
      r = -1;                                                                          \
      errno = g_errno;                                                                 \
    } else {                                                                           \
      r = real(fd, iov, n, offset);                                                    \
    }                                                                                  \
    if (m) {                                                                           \
      const int e = errno;                                                             \
      trace(#name, path, bytes, r);                                                    \
      errno = e;                                                                       \
    }                                                                                  \
    return r;                                                                          \
  }

PWRITEV_LIKE(pwritev, off_t, real_pwritev)
PWRITEV_LIKE(pwritev64, off64_t, real_pwritev64)

ssize_t writev(int fd, const struct iovec* iov, int n) {
  char path[PATH_BUF];
  int m = 0;
  const long long bytes = iov_bytes(iov, n);
  const long long ok = decide("writev", fd, bytes, path, sizeof path, &m);
  ssize_t r;
  if (ok < 0) {
    r = -1;
    errno = g_errno;
  } else {
    r = real_writev(fd, iov, n);
  }
  if (m) {
    const int e = errno;
    trace("writev", path, bytes, r);
    errno = e;
  }
  return r;
}

ssize_t pwritev2(int fd, const struct iovec* iov, int n, off_t offset, int flags) {
  char path[PATH_BUF];
  int m = 0;
  const long long bytes = iov_bytes(iov, n);
  const long long ok = decide("pwritev2", fd, bytes, path, sizeof path, &m);
  ssize_t r;
  if (ok < 0) {
    r = -1;
    errno = g_errno;
  } else {
    r = real_pwritev2(fd, iov, n, offset, flags);
  }
  if (m) {
    const int e = errno;
    trace("pwritev2", path, bytes, r);
    errno = e;
  }
  return r;
}

ssize_t copy_file_range(int in, loff_t* off_in, int out, loff_t* off_out, size_t len,
                        unsigned int flags) {
  char path[PATH_BUF];
  int m = 0;
  const long long ok = decide("copy_file_range", out, (long long)len, path, sizeof path, &m);
  ssize_t r;
  if (ok < 0) {
    r = -1;
    errno = g_errno;
  } else {
    r = real_copy_file_range(in, off_in, out, off_out, (size_t)ok, flags);
  }
  if (m) {
    const int e = errno;
    trace("copy_file_range", path, (long long)len, r);
    errno = e;
  }
  return r;
}

#define SYNC_LIKE(name, real)                                                          \
  int name(int fd) {                                                                   \
    char path[PATH_BUF];                                                               \
    int m = 0;                                                                         \
    const long long ok = decide(#name, fd, 0, path, sizeof path, &m);                   \
    int r;                                                                             \
    if (ok < 0) {                                                                      \
      r = -1;                                                                          \
      errno = g_errno;                                                                 \
    } else {                                                                           \
      r = real(fd);                                                                    \
    }                                                                                  \
    if (m) {                                                                           \
      const int e = errno;                                                             \
      trace(#name, path, 0, r);                                                        \
      errno = e;                                                                       \
    }                                                                                  \
    return r;                                                                          \
  }

SYNC_LIKE(fsync, real_fsync)
SYNC_LIKE(fdatasync, real_fdatasync)
