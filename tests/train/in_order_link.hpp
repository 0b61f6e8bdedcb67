// A model of the NCCL stage link's ordering (lib/comm/src/nccl_link.cpp) over host buffers, so
// that the pipeline's issue order is tested against it on the CPU (test_pipeline.cpp): the NCCL
// link itself runs only on GPUs. What it keeps of NCCL, each as strict as NCCL or stricter:
//   - a channel per tag, whose transfers run one at a time in the order the host issued them
//     (a thread per channel standing for its stream);
//   - a send completes only once the peer's matching receive runs (MPI_Issend: a rendezvous,
//     where NCCL may finish a small send into the peer's buffer early);
//   - a receive is issued at wait(), not at recv(), and the receives of one tag and peer must
//     be waited for in posting order (the NCCL link asserts it too);
//   - the first transfer between two ranks on a channel blocks the host until the peer issues
//     its side (NCCL connects lazily): a host-side rendezvous, once per channel, peer and
//     direction;
//   - a zero-length transfer moves nothing and needs no peer, but takes its place in its
//     channel's order (the NCCL link records its event on the channel's stream);
//   - a receive must be as long as the message (NCCL pairs equal counts; MPI would accept a
//     longer receive).
// wait() blocks the host until the transfer is done (on a GPU only the buffer's stream waits):
// the CPU pipeline reads a received buffer, or reuses a sent one, right after it. A transfer
// not done within the timeout is a deadlock of the pipeline's order under these rules: the
// model prints which transfer it waited for and aborts the job (its channel threads sit in MPI
// calls that could not be unwound). What it cannot show: its threads test their requests all
// the time, which moves every MPI message of the process, so a hang of an MPI message that
// only its rank's own MPI calls would move (as the pipeline's labels once had,
// pipeline_stage.cpp) does not appear here.
#pragma once

#include <fmt/format.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/comm/link.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::train::test {

// What the links of a run did, summed over their channels (shared with the test).
struct InOrderLog {
  std::atomic<int> sends{0};     // non-empty transfers run, each way
  std::atomic<int> receives{0};
  std::atomic<int> connects{0};  // host-side rendezvous of a first transfer
};

class InOrderLink final : public comm::StageLink {
 public:
  // Collective over pp (communicators of its own per tag).
  InOrderLink(const mpi::Comm& pp, std::span<const int> tags, std::shared_ptr<InOrderLog> log,
              double timeout_s = 30)
      : rank_(pp.rank()), size_(pp.size()), log_(std::move(log)), timeout_s_(timeout_s) {
    for (const int tag : tags) {
      auto c = std::make_unique<Channel>();
      c->tag = tag;
      c->comm = pp.dup();
      c->connect = pp.dup();
      channels_.push_back(std::move(c));
    }
    for (auto& c : channels_) c->worker = std::thread([this, ch = c.get()] { run(*ch); });
  }

  ~InOrderLink() override {
    if (std::uncaught_exceptions() == 0) drain();
    for (auto& c : channels_) {
      {
        const std::lock_guard lock(c->mu);
        c->stop = true;
      }
      c->cv.notify_all();
      c->worker.join();
    }
  }

  void send(const comm::GradientBuffer& buf, int peer, int tag, comm::LinkRequest& r) override {
    Channel& c = channel(buf, peer, tag, r);
    const int i = acquire(buf, peer, tag);
    if (buf.size > 0) connect(c, peer, true);
    enqueue(c, {true, buf.data, buf.size, peer, i});
    r.staging = i;
  }

  void recv(const comm::GradientBuffer& buf, int peer, int tag, comm::LinkRequest& r) override {
    channel(buf, peer, tag, r);
    const int i = acquire(buf, peer, tag);
    {
      const std::lock_guard lock(mu_);
      Slot& s = slots_[static_cast<std::size_t>(i)];
      s.receive_pending = true;
      s.order = posted_[{tag, peer}]++;
    }
    r.staging = i;
  }

  void wait(comm::LinkRequest& r) override {
    if (r.staging < 0) return;
    const int i = r.staging;
    Slot s;
    {
      const std::lock_guard lock(mu_);
      s = slots_[static_cast<std::size_t>(i)];
    }
    if (s.receive_pending) {  // issued now, where it is needed (as the NCCL link does)
      std::uint64_t& next = issued_[{s.tag, s.peer}];
      LOCUS_ASSERT(s.order == next,
                   fmt::format("receive {} from rank {} under tag {} was waited for before "
                               "receive {}, posted earlier",
                               s.order, s.peer, s.tag, next));
      ++next;
      {
        const std::lock_guard lock(mu_);
        slots_[static_cast<std::size_t>(i)].receive_pending = false;
      }
      Channel& c = channel_of(s.tag);
      if (s.buf.size > 0) connect(c, s.peer, false);
      enqueue(c, {false, s.buf.data, s.buf.size, s.peer, i});
    }
    await(fmt::format("the {} of {} floats {} rank {} under tag {}",
                      s.receive_pending ? "receive" : "send", s.buf.size,
                      s.receive_pending ? "from" : "to", s.peer, s.tag),
          [&] { return slots_[static_cast<std::size_t>(i)].done; });
    {
      const std::lock_guard lock(mu_);
      slots_[static_cast<std::size_t>(i)].busy = false;
    }
    r.staging = -1;
  }

  void drain() override {
    await("the transfers in flight (drain)", [&] {
      for (const Slot& s : slots_) {
        if (s.busy && s.issued && !s.done) return false;
      }
      return true;
    });
  }

  std::string_view name() const noexcept override { return "nccl-order-model"; }

 private:
  struct Op {
    bool send = false;
    float* data = nullptr;
    std::size_t size = 0;
    int peer = -1;
    int slot = -1;
  };
  struct Channel {
    int tag = 0;
    mpi::Comm comm;     // the transfers
    mpi::Comm connect;  // the first transfers' rendezvous
    std::set<std::pair<int, bool>> connected;  // (peer, sending); the host's only
    std::thread worker;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Op> queue;
    bool stop = false;
  };
  struct Slot {
    comm::GradientBuffer buf;
    int peer = -1;
    int tag = 0;
    std::uint64_t order = 0;
    bool receive_pending = false;
    bool issued = false;  // handed to the channel (or done at once)
    bool done = false;
    bool busy = false;
  };

  Channel& channel_of(int tag) {
    for (auto& c : channels_) {
      if (c->tag == tag) return *c;
    }
    throw InternalError(fmt::format("the model link has no channel for tag {}", tag));
  }

  Channel& channel(const comm::GradientBuffer& buf, int peer, int tag,
                   const comm::LinkRequest& r) {
    LOCUS_ASSERT(buf.space == comm::MemorySpace::host, "the model link moves host buffers");
    LOCUS_ASSERT(!r.active(), "a link request was reused while its transfer is in flight");
    LOCUS_ASSERT(peer >= 0 && peer < size_ && peer != rank_,
                 fmt::format("rank {} of {} cannot send to or receive from rank {}", rank_,
                             size_, peer));
    return channel_of(tag);
  }

  int acquire(const comm::GradientBuffer& buf, int peer, int tag) {
    const std::lock_guard lock(mu_);
    std::size_t i = 0;
    while (i < slots_.size() && slots_[i].busy) ++i;
    if (i == slots_.size()) slots_.emplace_back();
    slots_[i] = Slot{buf, peer, tag, 0, false, false, false, true};
    return static_cast<int>(i);
  }

  // NCCL connects two ranks at their first transfer on a communicator: the host blocks until
  // the peer issues its side.
  void connect(Channel& c, int peer, bool sending) {
    if (!c.connected.insert({peer, sending}).second) return;
    int token = 0;
    MPI_Request req = MPI_REQUEST_NULL;
    if (sending) {
      LOCUS_MPI_CHECK(MPI_Issend(&token, 1, MPI_INT, peer, c.tag, c.connect.get(), &req));
    } else {
      LOCUS_MPI_CHECK(MPI_Irecv(&token, 1, MPI_INT, peer, c.tag, c.connect.get(), &req));
    }
    complete(req, fmt::format("the first {} rank {} under tag {} (NCCL's connection)",
                              sending ? "send to" : "receive from", peer, c.tag));
    ++log_->connects;
  }

  void enqueue(Channel& c, const Op& op) {
    {
      const std::lock_guard lock(mu_);
      slots_[static_cast<std::size_t>(op.slot)].issued = true;
    }
    {
      const std::lock_guard lock(c.mu);
      c.queue.push_back(op);
    }
    c.cv.notify_all();
  }

  void finish(int i) {
    {
      const std::lock_guard lock(mu_);
      Slot& s = slots_[static_cast<std::size_t>(i)];
      s.issued = s.done = true;
    }
    done_cv_.notify_all();
  }

  // A channel's transfers, one at a time in issue order (its "stream").
  void run(Channel& c) {
    for (;;) {
      Op op;
      {
        std::unique_lock lock(c.mu);
        c.cv.wait(lock, [&] { return c.stop || !c.queue.empty(); });
        if (c.queue.empty()) return;
        op = c.queue.front();
        c.queue.pop_front();
      }
      const int n = static_cast<int>(op.size);
      if (n > 0) {
        const std::string what =
            fmt::format("a {} of {} floats {} rank {} under tag {} on its channel",
                        op.send ? "send" : "receive", n, op.send ? "to" : "from", op.peer, c.tag);
        MPI_Request req = MPI_REQUEST_NULL;
        MPI_Status status{};
        if (op.send) {
          LOCUS_MPI_CHECK(MPI_Issend(op.data, n, MPI_FLOAT, op.peer, 0, c.comm.get(), &req));
          ++log_->sends;
        } else {
          // A longer message fails as truncated (an MpiError on this thread ends the process),
          // a shorter one shows in the count below.
          LOCUS_MPI_CHECK(MPI_Irecv(op.data, n, MPI_FLOAT, op.peer, 0, c.comm.get(), &req));
          ++log_->receives;
        }
        complete(req, what, &status);
        int got = n;
        if (!op.send) LOCUS_MPI_CHECK(MPI_Get_count(&status, MPI_FLOAT, &got));
        if (got != n) fail(fmt::format("{}: the message had {} floats", what, got));
      }
      finish(op.slot);
    }
  }

  // Tests req until done, yielding the core between tests (ranks share the cores in tests).
  void complete(MPI_Request& req, const std::string& what,
                MPI_Status* status = MPI_STATUS_IGNORE) const {
    const auto until = deadline();
    int flag = 0;
    for (;;) {
      LOCUS_MPI_CHECK(MPI_Test(&req, &flag, status));
      if (flag != 0) return;
      if (std::chrono::steady_clock::now() > until) deadlock(what);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  template <class Done>
  void await(const std::string& what, Done done) {
    std::unique_lock lock(mu_);
    if (!done_cv_.wait_until(lock, deadline(), done)) {
      lock.unlock();
      deadlock(what);
    }
  }

  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(timeout_s_));
  }

  [[noreturn]] void deadlock(const std::string& what) const {
    fail(fmt::format("waited {:.0f} s for {}: the pipeline's order deadlocks under the NCCL "
                     "link's rules",
                     timeout_s_, what));
  }

  // Ends the job: the channels' threads may sit in MPI calls that cannot be unwound.
  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "in_order_link: pipeline rank %d of %d: %s\n", rank_, size_,
                 why.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::abort();
  }

  int rank_;
  int size_;
  std::shared_ptr<InOrderLog> log_;
  double timeout_s_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::mutex mu_;  // slots_ (the channels' threads mark them done)
  std::condition_variable done_cv_;
  std::deque<Slot> slots_;
  // Receives posted and issued so far, by (tag, peer): issued in posting order.
  std::map<std::pair<int, int>, std::uint64_t> posted_, issued_;
};

}  // namespace locus::train::test
