// The MPI stage link (comm/link.hpp): a ring of ranks passes buffers both ways with several
// transfers in flight per tag, and every receive gets the bits sent, in the order sent; waits
// on nothing in flight return at once; a device buffer is refused (it needs a staged link).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "agreed_error.hpp"
#include "locus/comm/error.hpp"
#include "locus/comm/link.hpp"

using namespace locus;

namespace {

// The payload rank `from` sends as its k-th message under `tag`: a pure function of all three.
std::vector<float> payload(int from, int tag, int k, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = static_cast<float>(from * 1000 + tag * 100 + k) + 0.125f * static_cast<float>(i);
  }
  return v;
}

comm::GradientBuffer host(std::vector<float>& v) {
  return {v.data(), v.size(), comm::MemorySpace::host, nullptr};
}

TEST(MpiLink, RingTransfersArriveInOrderPerTag) {
  const mpi::Comm world = mpi::Comm::world();
  const auto link = comm::make_mpi_link(world);
  EXPECT_EQ(link->name(), "mpi");
  const int n = world.size(), r = world.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  constexpr int kMessages = 3;
  constexpr int kForward = 1, kBack = 2;
  // Forward to next, backward to prev, kMessages of each in flight at once; sizes differ per
  // message so a mismatched pairing would be caught by MPI (truncation) or by the values.
  std::vector<std::vector<float>> out_f, out_b, in_f, in_b;
  std::vector<comm::LinkRequest> reqs(4 * kMessages);
  for (int k = 0; k < kMessages; ++k) {
    const std::size_t len = 7 + 5 * static_cast<std::size_t>(k);
    in_f.emplace_back(len, -1.0f);
    in_b.emplace_back(len, -1.0f);
  }
  for (int k = 0; k < kMessages; ++k) {
    link->recv(host(in_f[static_cast<std::size_t>(k)]), prev, kForward, reqs[4 * k]);
    link->recv(host(in_b[static_cast<std::size_t>(k)]), next, kBack, reqs[4 * k + 1]);
  }
  for (int k = 0; k < kMessages; ++k) {
    const std::size_t len = 7 + 5 * static_cast<std::size_t>(k);
    out_f.push_back(payload(r, kForward, k, len));
    out_b.push_back(payload(r, kBack, k, len));
  }
  for (int k = 0; k < kMessages; ++k) {
    link->send(host(out_f[static_cast<std::size_t>(k)]), next, kForward, reqs[4 * k + 2]);
    link->send(host(out_b[static_cast<std::size_t>(k)]), prev, kBack, reqs[4 * k + 3]);
  }
  for (auto& q : reqs) {
    EXPECT_TRUE(q.active());
    link->wait(q);
    EXPECT_FALSE(q.active());
  }
  for (int k = 0; k < kMessages; ++k) {
    const std::size_t len = 7 + 5 * static_cast<std::size_t>(k);
    EXPECT_EQ(in_f[static_cast<std::size_t>(k)], payload(prev, kForward, k, len)) << "message " << k;
    EXPECT_EQ(in_b[static_cast<std::size_t>(k)], payload(next, kBack, k, len)) << "message " << k;
  }
  comm::LinkRequest idle;
  link->wait(idle);  // nothing in flight: returns at once
  EXPECT_FALSE(idle.active());
}

TEST(MpiLink, DeviceBufferIsRefused) {
  const auto link = comm::make_mpi_link(mpi::Comm::world());
  float x = 0;
  comm::LinkRequest q;
  EXPECT_THROW(link->send({&x, 1, comm::MemorySpace::cuda, nullptr}, 0, 1, q), InternalError);
  EXPECT_FALSE(q.active());
}

// train.stage_link = nccl where NCCL cannot join the ranks (a build without NCCL, a host
// without a GPU, ranks sharing one): an agreed ConfigError naming the reason on every rank and
// the way out. On a host where NCCL can join them the refusal does not apply.
TEST(NcclLinkChoice, RefusedWhereNcclCannotRunAndParsed) {
  const mpi::Comm world = mpi::Comm::world();
  const std::string why = comm::nccl_link_unusable_reason(world);
  if (!why.empty()) {
    constexpr int tags[] = {1, 2};
    const std::string what = test::agreed_error<ConfigError>(
        [&] { comm::make_nccl_link(world, tags, comm::LinkOptions{}); });
    EXPECT_NE(what.find("train.stage_link = nccl cannot be used: " + why), std::string::npos)
        << what;
    EXPECT_NE(what.find("Set train.stage_link = auto"), std::string::npos) << what;
  }
  EXPECT_EQ(comm::parse_link_backend("auto"), comm::LinkBackend::automatic);
  EXPECT_EQ(comm::parse_link_backend("mpi"), comm::LinkBackend::mpi);
  EXPECT_EQ(comm::to_string(comm::parse_link_backend("nccl")), "nccl");
  EXPECT_THROW(comm::parse_link_backend("gloo"), ConfigError);
  comm::LinkOptions bad;
  bad.timeout_s = -1;
  constexpr int tags[] = {1};
  EXPECT_THROW(comm::make_nccl_link(world, tags, bad), ConfigError);
}

}  // namespace
