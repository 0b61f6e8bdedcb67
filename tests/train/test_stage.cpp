// Node-local staging (lib/train/src/data/stage.cpp) at 1, 2 and 4 ranks, and at 4 ranks as
// two emulated nodes (LOCUS_TEST_RANKS_PER_NODE=2): batches from the staged copy equal the
// source's in every shuffle mode and residency; the copy holds exactly the node's rows; a
// second loader reuses it (checksum verified); a corrupted, truncated or foreign copy is
// rebuilt; a bad stage_dir fails alike on every rank and stages nothing; removal.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "loader_test_util.hpp"
#include "locus/comm/topology.hpp"
#include "locus/train/data/stage.hpp"
#include "shared_tmpdir.hpp"
#include "scoped_env.hpp"

using locus::test_support::ScopedEnv;

using namespace locus;
using train::Loader;
using train::LoaderOptions;
using train::Residency;
using train::Shuffle;

namespace {

constexpr std::uint64_t kRows = 53, kCols = 5;
constexpr std::uint64_t kRowBytes = kCols * 4 + 4;
constexpr std::uint64_t kTiny = 6 * kRowBytes;  // streamed / per-batch reads
constexpr std::uint64_t kLarge = 1 << 20;


class StageTest : public testing::Test {
 protected:
  StageTest() : world_(mpi::Comm::world()), dir_(world_) {
    test::write_file(world_, source(), {.rows = kRows, .cols = kCols, .committed = kRows,
                                        .label_rows = kRows});
    if (world_.is_root()) std::filesystem::create_directory(stage_dir());
    world_.barrier();
  }
  std::string source() const { return dir_.file("data.h5"); }
  std::string stage_dir() const { return dir_.file("stage"); }
  LoaderOptions opts(Shuffle s, std::uint64_t budget, bool staged) const {
    LoaderOptions o;
    o.path = source();
    o.shuffle = s;
    o.global_batch = 8;
    o.memory_budget = budget;
    o.seed = 99;
    if (staged) o.stage_dir = stage_dir();
    return o;
  }
  // Two epochs (the second resumed at step 2) as this rank saw them.
  std::vector<test::Epoch> run(const LoaderOptions& o) const {
    Loader l(world_, o);
    std::vector<test::Epoch> out;
    out.push_back(test::record(l, 0));
    out.push_back(test::record(l, 1, 2));
    return out;
  }
  static void expect_same(const std::vector<test::Epoch>& a, const std::vector<test::Epoch>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t e = 0; e < a.size(); ++e) {
      EXPECT_EQ(a[e].ids, b[e].ids) << "epoch " << e;
      EXPECT_EQ(a[e].global_rows, b[e].global_rows) << "epoch " << e;
      EXPECT_EQ(a[e].x, b[e].x) << "epoch " << e;
    }
  }
  // This node's staged file (local; topo: of the world, as the loader's dup sees it).
  static std::string my_file(const LoaderOptions& o, const comm::Topology& topo) {
    return train::staged_file_path(o, topo.node_index());
  }
  // Collective: whether any rank still sees a staged or temporary file in stage_dir.
  bool any_file_left() const {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(stage_dir())) {
      static_cast<void>(e);
      ++n;
    }
    return world_.allreduce(n, MPI_MAX) > 0;
  }

  mpi::Comm world_;
  test::SharedTmpDir dir_;
};

// The node's expected rows: its ranks' partitions (local/none) or all rows (global).
std::uint64_t expected_rows(Shuffle s, const comm::Topology& topo) {
  if (s == Shuffle::global) return kRows;
  std::uint64_t n = 0;
  const int p = static_cast<int>(topo.node_of_rank().size());
  for (int r = 0; r < p; ++r) {
    if (topo.node_of_rank()[static_cast<std::size_t>(r)] == topo.node_index())
      n += h5::partition_rows(kRows, r, p).count;
  }
  return n;
}

std::int64_t features_offset(const std::string& path) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(f, 0) << path;
  const hid_t d = H5Dopen2(f, "/features", H5P_DEFAULT);
  const hid_t space = H5Dget_space(d);
  hsize_t dims[2] = {0, 0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  const auto off = static_cast<std::int64_t>(H5Dget_offset(d));
  EXPECT_EQ(dims[1], kCols);
  H5Sclose(space);
  H5Dclose(d);
  H5Fclose(f);
  return off;
}

std::uint64_t staged_rows_in(const std::string& path) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t d = H5Dopen2(f, "/features", H5P_DEFAULT);
  const hid_t space = H5Dget_space(d);
  hsize_t dims[2] = {0, 0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  H5Sclose(space);
  H5Dclose(d);
  H5Fclose(f);
  return dims[0];
}

}  // namespace

class StageModes : public StageTest {
 public:
  void check(const char* ranks_per_node) {
    ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", ranks_per_node);
    const comm::Topology topo(world_);
    const struct {
      Shuffle s;
      std::uint64_t budget;
      Residency r;
    } modes[] = {{Shuffle::global, kLarge, Residency::dataset},
                 {Shuffle::global, kTiny, Residency::per_batch},
                 {Shuffle::local, kLarge, Residency::partition},
                 {Shuffle::local, kTiny, Residency::streamed},
                 {Shuffle::none, kTiny, Residency::streamed}};
    for (const auto& m : modes) {
      SCOPED_TRACE(std::string("shuffle ") + train::to_string(m.s) + ", " +
                   train::to_string(m.r));
      const auto direct = run(opts(m.s, m.budget, false));
      const LoaderOptions o = opts(m.s, m.budget, true);
      {
        Loader l(world_, o);
        EXPECT_EQ(l.residency(), m.r);
        const train::StageReport& rep = l.stage_report();
        EXPECT_TRUE(rep.staged);
        EXPECT_EQ(rep.nodes, topo.nodes());
        EXPECT_EQ(rep.reused_nodes, 0);  // the previous mode's copies were removed
        EXPECT_EQ(rep.path, train::staged_file_path(o, 0));  // node 0's, on every rank
      }
      // The node's copy holds exactly its rows.
      if (topo.is_leader()) {
        EXPECT_EQ(staged_rows_in(my_file(o, topo)), expected_rows(m.s, topo));
      }
      // A second run reuses every node's copy and sees the same batches as the source.
      const auto staged = run(o);
      expect_same(direct, staged);
      {
        Loader l(world_, o);
        EXPECT_EQ(l.stage_report().reused_nodes, topo.nodes()) << l.stage_report().describe();
        EXPECT_NE(l.stage_report().describe().find("reused"), std::string::npos);
      }
      EXPECT_TRUE(train::remove_staged_copy(world_, o));
      EXPECT_FALSE(any_file_left());
    }
  }
};

TEST_F(StageModes, StagedBatchesEqualTheSourceOnOneNodePerHost) { check(nullptr); }

TEST_F(StageModes, StagedBatchesEqualTheSourceOnTwoEmulatedNodes) {
  if (world_.size() != 4) GTEST_SKIP() << "two nodes of two ranks need 4 ranks";
  check("2");
}

TEST_F(StageTest, FirstRunStagesSecondReusesAndRemovalRespectsKeep) {
  ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", world_.size() == 4 ? "2" : nullptr);
  LoaderOptions o = opts(Shuffle::local, kLarge, true);
  const comm::Topology topo(world_);
  {
    Loader l(world_, o);
    EXPECT_EQ(l.stage_report().reused_nodes, 0);
    EXPECT_EQ(l.stage_report().reason, "no staged copy yet");
    EXPECT_EQ(l.stage_report().source_bytes_read, kRows * kRowBytes);  // each byte once
  }
  {
    Loader l(world_, o);
    EXPECT_EQ(l.stage_report().reused_nodes, topo.nodes());
    EXPECT_EQ(l.stage_report().source_bytes_read, 0u);
  }
  o.stage_keep = true;
  EXPECT_FALSE(train::remove_staged_copy(world_, o));
  EXPECT_TRUE(std::filesystem::exists(my_file(o, topo)));
  o.stage_keep = false;
  EXPECT_TRUE(train::remove_staged_copy(world_, o));
  EXPECT_FALSE(std::filesystem::exists(my_file(o, topo)));
}

TEST_F(StageTest, GlobalShuffleReadsEachSourceByteOncePerNode) {
  ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", world_.size() == 4 ? "2" : nullptr);
  const comm::Topology topo(world_);
  Loader l(world_, opts(Shuffle::global, kLarge, true));
  EXPECT_EQ(l.stage_report().source_bytes_read,
            static_cast<std::uint64_t>(topo.nodes()) * kRows * kRowBytes);
}

TEST_F(StageTest, CorruptedCopyIsDetectedAndRebuilt) {
  ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", world_.size() == 4 ? "2" : nullptr);
  const LoaderOptions o = opts(Shuffle::global, kLarge, true);
  const auto direct = run(opts(Shuffle::global, kLarge, false));
  { Loader l(world_, o); }
  // One flipped bit in the last node's features.
  const comm::Topology topo(world_);
  if (topo.is_leader() && topo.node_index() == topo.nodes() - 1) {
    const std::string path = my_file(o, topo);
    const std::int64_t off = features_offset(path) + 4 * 17 + 1;
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char b = 0;
    ASSERT_EQ(::pread(fd, &b, 1, off), 1);
    b ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &b, 1, off), 1);
    ::close(fd);
  }
  world_.barrier();
  {
    Loader l(world_, o);
    EXPECT_EQ(l.stage_report().reused_nodes, topo.nodes() - 1) << l.stage_report().describe();
    if (topo.nodes() == 1) {
      EXPECT_NE(l.stage_report().reason.find("checksum mismatch"), std::string::npos)
          << l.stage_report().reason;
    }
  }
  // Rebuilt: reused everywhere now, and the batches are the source's.
  const auto staged = run(o);
  expect_same(direct, staged);
  Loader l(world_, o);
  EXPECT_EQ(l.stage_report().reused_nodes, topo.nodes());
}

TEST_F(StageTest, DamagedForeignOrIncompleteCopiesAreRebuilt) {
  ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", world_.size() == 4 ? "2" : nullptr);
  const LoaderOptions local = opts(Shuffle::local, kLarge, true);
  const comm::Topology topo(world_);
  const std::string path = my_file(local, topo);
  // A garbage file under the final name and a temporary file of a crashed build.
  if (topo.is_leader()) {
    std::ofstream(path) << "not hdf5";
    std::ofstream(path + ".tmp.12345") << "half a copy";
  }
  world_.barrier();
  {
    Loader l(world_, local);
    EXPECT_EQ(l.stage_report().reused_nodes, 0);
    EXPECT_EQ(l.stage_report().reason, "the staged file is not readable HDF5 (damaged)");
  }
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp.12345"));
  // Another shuffle mode's copy holds other rows when there are several nodes (on one node
  // the node's partitions are all rows, the same copy as under global shuffle).
  if (topo.nodes() > 1) {
    Loader l(world_, opts(Shuffle::global, kLarge, true));
    EXPECT_EQ(l.stage_report().reused_nodes, 0);
    EXPECT_NE(l.stage_report().reason.find("other rows"), std::string::npos)
        << l.stage_report().reason;
  }
  // A changed source (new mtime and size) is never taken for the old one.
  test::write_file(world_, source(), {.rows = kRows + 3, .cols = kCols, .committed = kRows,
                                      .label_rows = kRows + 3});
  Loader l(world_, opts(Shuffle::global, kLarge, true));
  EXPECT_EQ(l.stage_report().reused_nodes, 0);
  EXPECT_NE(l.stage_report().reason.find("source file changed"), std::string::npos)
      << l.stage_report().reason;
}

TEST_F(StageTest, MissingStageDirFailsOnEveryRankAndStagesNothing) {
  LoaderOptions o = opts(Shuffle::local, kLarge, true);
  o.stage_dir = dir_.file("no-such-dir");
  const std::string msg = test::error_of<ConfigError>([&] { Loader l(world_, o); });
  EXPECT_NE(msg.find("data.stage_dir '" + o.stage_dir + "' is not a directory"),
            std::string::npos) << msg;
  // A file where the directory should be.
  if (world_.is_root()) std::ofstream(dir_.file("a-file")) << "x";
  world_.barrier();
  o.stage_dir = dir_.file("a-file");
  const std::string msg2 = test::error_of<ConfigError>([&] { Loader l(world_, o); });
  EXPECT_NE(msg2.find("is not a directory"), std::string::npos) << msg2;
  EXPECT_FALSE(any_file_left());
}

TEST_F(StageTest, BadSourceFailsBeforeStaging) {
  LoaderOptions o = opts(Shuffle::local, kLarge, true);
  o.path = dir_.file("missing.h5");
  const std::string msg = test::error_of<DataError>([&] { Loader l(world_, o); });
  EXPECT_NE(msg.find("missing.h5"), std::string::npos) << msg;
  EXPECT_FALSE(any_file_left());
}

// The loader really reads the staged copy: the source is changed in place behind the manifest's
// back (one value; size, inode and mtime restored), so the verified copy still holds the old
// value while a direct read sees the new one.
TEST_F(StageTest, BatchesComeFromTheStagedCopy) {
  LoaderOptions o = opts(Shuffle::global, kLarge, true);
  { Loader l(world_, o); }
  if (world_.is_root()) {
    struct stat st {};
    ASSERT_EQ(::stat(source().c_str(), &st), 0);
    const hid_t f = H5Fopen(source().c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t d = H5Dopen2(f, "/features", H5P_DEFAULT);
    const hid_t space = H5Dget_space(d);
    const hsize_t start[2] = {0, 0}, count[2] = {1, 1};
    H5Sselect_hyperslab(space, H5S_SELECT_SET, start, nullptr, count, nullptr);
    const hid_t mem = H5Screate_simple(2, count, nullptr);
    const float v = 12345.0f;
    ASSERT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, &v), 0);
    H5Sclose(mem);
    H5Sclose(space);
    H5Dclose(d);
    H5Fclose(f);
    const timespec times[2] = {st.st_atim, st.st_mtim};
    ASSERT_EQ(::utimensat(AT_FDCWD, source().c_str(), times, 0), 0);
    struct stat after {};
    ASSERT_EQ(::stat(source().c_str(), &after), 0);
    ASSERT_EQ(after.st_size, st.st_size) << "the in-place write changed the size";
  }
  world_.barrier();
  Loader staged(world_, o);
  ASSERT_EQ(staged.residency(), Residency::dataset);
  EXPECT_EQ(staged.stage_report().reused_nodes, staged.stage_report().nodes);
  EXPECT_EQ(staged.resident().x[0], test::feature_at(0, 0));
  EXPECT_EQ(staged.resident().x[1], test::feature_at(0, 1));
  Loader direct(world_, opts(Shuffle::global, kLarge, false));
  EXPECT_EQ(direct.resident().x[0], 12345.0f);
}

TEST_F(StageTest, TooSmallStageDirFailsOnEveryRankAndStagesNothing) {
  ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", world_.size() == 4 ? "2" : nullptr);
  ScopedEnv small("LOCUS_TEST_STAGE_FREE_BYTES", "4096");
  const LoaderOptions o = opts(Shuffle::global, kLarge, true);
  const std::string msg = test::error_of<IoError>([&] { Loader l(world_, o); });
  EXPECT_NE(msg.find("data.stage_dir '" + stage_dir() + "' on node 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("free space there"), std::string::npos) << msg;
  EXPECT_FALSE(any_file_left());
}

// A source with its own dataset names: the copy names them /features and /labels, and the
// loader finds them there.
TEST_F(StageTest, SourceDatasetNamesOtherThanTheDefaults) {
  const std::string other = dir_.file("named.h5");
  test::write_file(world_, other, {.rows = kRows, .cols = kCols, .label_rows = kRows,
                                   .features = "/data/x", .labels = "/data/y"});
  for (const Shuffle s : {Shuffle::local, Shuffle::global}) {
    LoaderOptions o = opts(s, kLarge, false);
    o.path = other;
    o.features = "/data/x";
    o.labels = "/data/y";
    const auto direct = run(o);
    o.stage_dir = stage_dir();
    const auto staged = run(o);
    expect_same(direct, staged);
    EXPECT_TRUE(train::remove_staged_copy(world_, o));
  }
}
