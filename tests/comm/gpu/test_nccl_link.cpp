// The NCCL stage link (lib/comm/src/nccl_link.cpp) on real devices: the ranks form a pipeline
// and pass buffers up (tag 1) and back down (tag 2) in a pipeline's order -- the next input's
// receive posted before this output is sent, several transfers in flight, lengths from 0 to
// 1 Mi floats -- and every buffer arrives with the bits sent, in order, after the work queued
// on the sender's stream; drain() then finds nothing in flight. Refusals: a host buffer, an
// unknown tag, the rank itself as peer (InternalError); ranks that share a GPU (an agreed
// ConfigError naming why: NCCL refuses them in one communicator; train.stage_link = auto then
// takes the host-staged link). Two ranks on one GPU form a communicator only with the
// test-only host ids of bench/gpu/hostid_rank.sh. A transfer whose peer never takes part ends
// in an NcclError within the timeout, the link aborted -- both channels at once where a send
// waits behind a stuck receive.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "locus/comm/error.hpp"
#include "comm_gpu_util.hpp"
#include "locus/comm/link.hpp"

namespace locus::comm {
namespace {

using test::no_device;

constexpr int kUp = 1, kDown = 2;
constexpr int kTags[] = {kUp, kDown};

// A link that gives up on a stuck transfer after 30 s with an NcclError naming it, well within
// the GPU run's limit for this test (bench/gpu/run_gpu.sh: 90 s), which would end it silently.
LinkOptions quick() {
  LinkOptions o;
  o.timeout_s = 30;
  return o;
}

// The k-th message's length: 0, small, odd and one over NCCL's own buffering (1 Mi floats).
std::size_t length(int k) {
  constexpr std::size_t lengths[] = {7, 0, (std::size_t{1} << 20) + 1, 333, 4096};
  return lengths[static_cast<std::size_t>(k) % std::size(lengths)];
}
constexpr int kMessages = 5;

// What the k-th message in direction `tag` holds once it left its origin: exact in float.
float value(int tag, int k, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 2654435761u + 131u * static_cast<unsigned>(k) +
                                              7u * static_cast<unsigned>(tag)) %
                                             4001u) -
                            2000) /
         32.0f;
}
std::vector<float> payload(int tag, int k) {
  std::vector<float> v(length(k));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(tag, k, i);
  return v;
}

// A device buffer of n floats (never null, so a zero-length one is a valid pointer too).
struct DeviceBuffer {
  explicit DeviceBuffer(std::size_t n) : size(n) {
    CU(cudaMalloc(&data, std::max<std::size_t>(n, 1) * sizeof(float)));
  }
  ~DeviceBuffer() { cudaFree(data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  float* data = nullptr;
  std::size_t size;
};

class NcclLink : public ::testing::Test {
 protected:
  void SetUp() override {
    const mpi::Comm world = mpi::Comm::world();
    const int missing = world.allreduce(no_device() ? 1 : 0, MPI_MAX);
    if (missing != 0) GTEST_SKIP() << (no_device() ? *no_device() : "a peer rank has no device");
    int count = 0;
    CU(cudaGetDeviceCount(&count));
    CU(cudaSetDevice(world.rank() % count));
    CU(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  GradientBuffer view(const DeviceBuffer& b) const {
    return {b.data, b.size, MemorySpace::cuda, stream_};
  }
  // Skips (true) where NCCL cannot join the world's ranks into a link -- a failure instead
  // under LOCUS_REQUIRE_NCCL=1 -- or where there is no second rank.
  static bool no_nccl_link(const mpi::Comm& world) {
    const auto skip = [](const char* why) { GTEST_SKIP() << why; };  // GTEST_SKIP returns
    if (world.size() < 2) {
      skip("a stage link needs 2 ranks or more");
      return true;
    }
    if (const std::string why = nccl_link_unusable_reason(world); !why.empty()) {
      if (test::nccl_required()) {
        ADD_FAILURE() << "LOCUS_REQUIRE_NCCL=1, but NCCL refused: " << why;
        return true;
      }
      skip("NCCL cannot join these ranks (PipelinePassesBothWaysInOrder checks why)");
      return true;
    }
    return false;
  }
  // `b` from rank `from` to rank `to` under `tag`, waited for and drained on every rank.
  void exchange(StageLink& link, const DeviceBuffer& b, int from, int to, int tag) const {
    const int r = mpi::Comm::world().rank();
    LinkRequest q;
    if (r == from) link.send(view(b), to, tag, q);
    if (r == to) link.recv(view(b), from, tag, q);
    link.wait(q);
    link.drain();
  }
  // Rank 0 gives up on transfers rank 1 never joins: once `warm` (every rank) has made the
  // pairs' connections, rank 0 enqueues `stick`, and its drain() must end in the stage link's
  // NcclError within the 3 s timeout plus the polling tick, the link then going at once
  // (test::expect_gave_up_in_time). Rank 1, told over MPI, leaves its link by unwinding as a
  // rank does on an error, which aborts too. The aborted kernels end: the device stays usable.
  void expect_rank0_gives_up(const std::function<void(StageLink&)>& warm,
                             const std::function<void(StageLink&)>& stick) const {
    struct Unwind {};
    const mpi::Comm world = mpi::Comm::world();
    LinkOptions o;
    o.timeout_s = 3;
    test::GaveUp gave_up;
    try {
      auto link = make_nccl_link(world, kTags, o);
      warm(*link);
      if (world.rank() == 0) {
        stick(*link);
        gave_up = test::give_up([&] { link->drain(); }, [&] { link.reset(); });
      }
      world.barrier();  // the peers keep their links until rank 0 has given up
      if (world.rank() != 0) throw Unwind{};
    } catch (const Unwind&) {
    }
    if (world.rank() == 0) {
      test::expect_gave_up_in_time(gave_up, "a pipeline transfer (stage link)");
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the aborted transfers' kernels must end";
    world.barrier();
  }
  cudaStream_t stream_ = nullptr;
};

TEST_F(NcclLink, PipelinePassesBothWaysInOrder) {
  const mpi::Comm world = mpi::Comm::world();
  const int n = world.size(), r = world.rank();
  if (n < 2) GTEST_SKIP() << "a stage link needs 2 ranks or more";
  const std::string why = nccl_link_unusable_reason(world);
  if (!why.empty()) {
    // The ranks share a device: every rank refuses alike, naming why.
    try {
      make_nccl_link(world, kTags, quick());
      ADD_FAILURE() << "NCCL accepted ranks that " << why;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("train.stage_link = nccl cannot be used: " + why),
                std::string::npos)
          << e.what();
    }
    if (test::nccl_required()) FAIL() << "LOCUS_REQUIRE_NCCL=1, but NCCL refused: " << why;
    GTEST_SKIP() << "NCCL refused, as it must: " << why;
  }
  const auto link = make_nccl_link(world, kTags, quick());
  EXPECT_EQ(link->name(), "nccl");
  const bool first = r == 0, last = r == n - 1;
  // Per message: what came in from below / above and what goes on (device), and what the ends
  // read back (host).
  std::vector<std::unique_ptr<DeviceBuffer>> up_in, up_out, down_in, down_out;
  std::vector<LinkRequest> up_recv(kMessages), up_send(kMessages), down_recv(kMessages),
      down_send(kMessages);
  std::vector<std::vector<float>> got_up(kMessages), got_down(kMessages);
  for (int k = 0; k < kMessages; ++k) {
    for (auto* v : {&up_in, &up_out, &down_in, &down_out}) {
      v->push_back(std::make_unique<DeviceBuffer>(length(k)));
    }
  }
  const auto at = [](auto& v, int k) -> auto& { return v[static_cast<std::size_t>(k)]; };
  // The origin's data, put on the stream before the send, 20 ms late (a host function sleeps
  // on the stream first): the link must order itself after it, or it sends what the buffer
  // held before.
  const auto fill = [&](DeviceBuffer& b, int tag, int k, std::vector<float>& keep) {
    keep = payload(tag, k);
    CU(cudaLaunchHostFunc(
        stream_, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); },
        nullptr));
    if (keep.empty()) return;  // no copy from an empty vector's (null) data
    CU(cudaMemcpyAsync(b.data, keep.data(), keep.size() * sizeof(float), cudaMemcpyHostToDevice,
                       stream_));
  };
  std::vector<std::vector<float>> sent_up(kMessages), sent_down(kMessages);
  if (!first) link->recv(view(*at(up_in, 0)), r - 1, kUp, at(up_recv, 0));
  for (int k = 0; k < kMessages; ++k) {
    // Forward of message k: its input (posted one ahead), the next input posted, then on up.
    if (first) {
      fill(*at(up_out, k), kUp, k, at(sent_up, k));
    } else {
      link->wait(at(up_recv, k));
      if (k + 1 < kMessages) link->recv(view(*at(up_in, k + 1)), r - 1, kUp, at(up_recv, k + 1));
      CU(cudaMemcpyAsync(at(up_out, k)->data, at(up_in, k)->data, length(k) * sizeof(float),
                         cudaMemcpyDeviceToDevice, stream_));
    }
    if (!last) {
      link->send(view(*at(up_out, k)), r + 1, kUp, at(up_send, k));
      link->recv(view(*at(down_in, k)), r + 1, kDown, at(down_recv, k));
    } else {
      at(got_up, k).resize(length(k));
      if (length(k) > 0) {
        CU(cudaMemcpyAsync(at(got_up, k).data(), at(up_out, k)->data, length(k) * sizeof(float),
                           cudaMemcpyDeviceToHost, stream_));
      }
    }
    // Backward of message k: from the last rank down to the first.
    if (last) {
      fill(*at(down_out, k), kDown, k, at(sent_down, k));
    } else {
      link->wait(at(down_recv, k));
      CU(cudaMemcpyAsync(at(down_out, k)->data, at(down_in, k)->data, length(k) * sizeof(float),
                         cudaMemcpyDeviceToDevice, stream_));
    }
    if (!first) {
      link->send(view(*at(down_out, k)), r - 1, kDown, at(down_send, k));
    } else {
      at(got_down, k).resize(length(k));
      if (length(k) > 0) {
        CU(cudaMemcpyAsync(at(got_down, k).data(), at(down_out, k)->data,
                           length(k) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
      }
    }
  }
  for (auto* reqs : {&up_send, &down_send, &up_recv, &down_recv}) {
    for (LinkRequest& q : *reqs) {
      link->wait(q);
      EXPECT_FALSE(q.active());
    }
  }
  // settle(): the stream's work so far is complete when it returns (nothing is queued after).
  link->settle(stream_);
  EXPECT_EQ(cudaStreamQuery(stream_), cudaSuccess);
  link->drain();
  for (int k = 0; k < kMessages; ++k) {
    if (last) {
      EXPECT_EQ(at(got_up, k), payload(kUp, k)) << "message " << k << " up";
    }
    if (first) {
      EXPECT_EQ(at(got_down, k), payload(kDown, k)) << "message " << k << " down";
    }
  }
  LinkRequest idle;
  link->wait(idle);  // nothing in flight: returns at once
  EXPECT_FALSE(idle.active());
}

// A transfer whose peer never takes part (rank 1 stops after the first, which made the pair's
// connection): rank 0 gives up within the timeout (expect_rank0_gives_up). 32 MiB: more than
// NCCL buffers on a connection, so the send cannot finish without its receiver.
TEST_F(NcclLink, AStuckTransferEndsInAnNcclErrorWithinTheTimeout) {
  if (no_nccl_link(mpi::Comm::world())) return;
  const DeviceBuffer small(16), big(std::size_t{8} << 20);
  expect_rank0_gives_up([&](StageLink& link) { exchange(link, small, 0, 1, kUp); },
                        [&](StageLink& link) {
                          LinkRequest q;
                          link.send(view(big), 1, kUp, q);
                          link.wait(q);
                        });
}

// A stuck receive that the other channel's send waits behind: rank 0's stream waits for a
// receive from rank 1, which never sends, and rank 0's send up is queued after that wait. Giving
// up must abort both channels at once: aborted one at a time, the send's channel first (it
// counts the time), its abort would wait forever for its kernel, which waits behind the other
// channel's receive. The same bounds as above (both directions' connections made first).
TEST_F(NcclLink, AStuckReceiveThatASendWaitsBehindIsAbortedWithIt) {
  if (no_nccl_link(mpi::Comm::world())) return;
  const DeviceBuffer small(16), big(std::size_t{8} << 20);
  expect_rank0_gives_up(
      [&](StageLink& link) {
        exchange(link, small, 0, 1, kUp);
        exchange(link, small, 1, 0, kDown);
      },
      [&](StageLink& link) {
        LinkRequest in, out;
        link.recv(view(small), 1, kDown, in);
        link.wait(in);                      // the stream waits for a receive that never comes
        link.send(view(big), 1, kUp, out);  // the up channel waits for the stream: behind it
        link.wait(out);
      });
}

// CUDA_DEVICE_MAX_CONNECTIONS=1 (or NCCL_LAUNCH_ORDER_IMPLICIT) would put both channels'
// kernels in one queue, where 1F1B can deadlock: the link is refused, naming the setting.
TEST_F(NcclLink, RefusesSettingsThatSerializeItsChannels) {
  const mpi::Comm world = mpi::Comm::world();
  if (no_nccl_link(world)) return;
  for (const auto& [key, value] : {std::pair{"CUDA_DEVICE_MAX_CONNECTIONS", "1"},
                                   std::pair{"NCCL_LAUNCH_ORDER_IMPLICIT", "1"}}) {
    const bool mine = world.rank() == world.size() - 1;  // one rank's setting refuses them all
    if (mine) setenv(key, value, 1);
    const std::string why = nccl_link_unusable_reason(world);
    if (mine) unsetenv(key);
    EXPECT_NE(why.find(mine ? std::string(key) + "=1" : "another pipeline rank"),
              std::string::npos) << why;
    EXPECT_THROW(
        {
          if (mine) setenv(key, value, 1);
          try {
            make_nccl_link(world, kTags, quick());
          } catch (...) {
            if (mine) unsetenv(key);
            throw;
          }
        },
        ConfigError);
  }
  EXPECT_EQ(nccl_link_unusable_reason(world), "");
}

TEST_F(NcclLink, RefusesHostBuffersUnknownTagsAndItself) {
  const mpi::Comm world = mpi::Comm::world();
  if (const std::string why = nccl_link_unusable_reason(world); !why.empty()) {
    if (test::nccl_required()) FAIL() << "LOCUS_REQUIRE_NCCL=1, but NCCL refused: " << why;
    GTEST_SKIP() << "NCCL cannot join these ranks (PipelinePassesBothWaysInOrder checks why)";
  }
  const auto link = make_nccl_link(world, kTags, quick());
  const int other = (world.rank() + 1) % world.size();
  DeviceBuffer d(4);
  float host = 0;
  LinkRequest q;
  EXPECT_THROW(link->send({&host, 1, MemorySpace::host, nullptr}, other, kUp, q), InternalError);
  EXPECT_THROW(link->send(view(d), other, 99, q), InternalError);
  EXPECT_THROW(link->recv(view(d), world.rank(), kUp, q), InternalError);
  EXPECT_FALSE(q.active());
  if (world.size() > 1) {
    // NCCL pairs transfers in the order they are issued: the second of two receives of one tag
    // and peer, waited for first, would take the first message. Refused before it is issued.
    DeviceBuffer e(4);
    LinkRequest first, second;
    link->recv(view(d), other, kUp, first);
    link->recv(view(e), other, kUp, second);
    EXPECT_THROW(link->wait(second), InternalError);
  }
  link->drain();  // nothing was started
}

}  // namespace
}  // namespace locus::comm
