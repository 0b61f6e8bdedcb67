// Atomic publication: nothing under the final name until every rank closed successfully;
// leftovers of a killed run are overwritten; parallel copy is byte-exact.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/io/publish.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;
namespace fs = std::filesystem;

namespace {
void write_small(const mpi::Comm& world, const std::string& path, float value) {
  h5::File f = h5::File::create(world, path);
  {
    auto ds =
        h5::Dataset::create(f, {.name = "/x", .dtype = h5::Dtype::f32, .rows = 4, .cols = 2});
    auto mine = h5::partition_rows(4, world.rank(), world.size());
    std::vector<float> v(mine.count * 2, value);
    ds.write_rows<float>(mine.begin, v);
  }
  f.close();
}
float first_value(const mpi::Comm& world, const std::string& path) {
  h5::File f = h5::File::open(world, path, h5::File::Mode::read);
  auto ds = h5::Dataset::open(f, "/x");
  std::vector<float> v(8);
  ds.read_rows<float>(0, v);  // every rank reads all rows
  return v[0];
}
}  // namespace

TEST(Publish, FinalNameAppearsOnlyAtCommit) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string out = dir.file("out.h5");
  io::Publication pub(world, out);
  EXPECT_EQ(pub.temp_path(), dir.file(".out.h5.locus-tmp"));
  write_small(world, pub.temp_path(), 1.0f);
  EXPECT_FALSE(fs::exists(out));
  pub.commit();
  EXPECT_TRUE(fs::exists(out));
  EXPECT_FALSE(fs::exists(pub.temp_path()));
  EXPECT_EQ(first_value(world, out), 1.0f);
}

TEST(Publish, AbandonedRunLeavesOldOutputAndNoTemp) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string out = dir.file("out.h5");
  {
    io::Publication pub(world, out);
    write_small(world, pub.temp_path(), 1.0f);
    pub.commit();
  }
  {
    io::Publication pub(world, out);
    write_small(world, pub.temp_path(), 2.0f);
    world.barrier();
    // destroyed without commit, as when an error unwinds the app
  }
  world.barrier();
  EXPECT_FALSE(fs::exists(io::temp_path_for(out)));
  EXPECT_EQ(first_value(world, out), 1.0f);
}

TEST(Publish, LeftoverOfAKilledRunIsOverwritten) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string out = dir.file("out.h5");
  if (world.is_root()) std::ofstream(io::temp_path_for(out)) << "half-written garbage";
  world.barrier();
  io::Publication pub(world, out);
  write_small(world, pub.temp_path(), 3.0f);
  pub.commit();
  EXPECT_EQ(first_value(world, out), 3.0f);
}

TEST(Publish, UnwritableDirectoryIsRefusedBeforeAnyWork) {
  mpi::Comm world = mpi::Comm::world();
  EXPECT_THROW(io::Publication(world, "/proc/locus-out.h5"), IoError);
}

TEST(Copy, ParallelCopyIsByteExact) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string src = dir.file("src.bin"), dst = dir.file("dst.bin");
  std::string content;
  for (int i = 0; i < (3 << 20) + 12345; ++i) content.push_back(static_cast<char>(i * 7 + i / 251));
  if (world.is_root()) std::ofstream(src, std::ios::binary) << content;
  world.barrier();
  io::copy_file_parallel(world, src, dst);
  std::ifstream in(dst, std::ios::binary);
  std::string back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(back.size(), content.size());
  EXPECT_TRUE(back == content);
}
