// The loader's row count (committed_rows vs extent), optional labels, and its errors: each
// names the file/dataset/option and is thrown on every rank.
#include <gtest/gtest.h>

#include <algorithm>

#include "loader_test_util.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;
using train::Loader;
using train::LoaderOptions;
using train::Shuffle;

namespace {

LoaderOptions options(const std::string& path, std::int64_t batch = 4) {
  LoaderOptions o;
  o.path = path;
  o.global_batch = batch;
  return o;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(LoaderRows, CommittedRowsBoundTheDatasetElseTheExtent) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  // A locus dataset mid-append: 40 rows allocated, 30 committed.
  test::write_file(world, dir.file("c.h5"), {.rows = 40, .cols = 3, .committed = 30,
                                              .label_rows = 40});
  test::write_file(world, dir.file("plain.h5"), {.rows = 40, .cols = 3, .label_rows = 40});
  for (Shuffle s : {Shuffle::global, Shuffle::local, Shuffle::none}) {
    LoaderOptions o = options(dir.file("c.h5"), 6);
    o.shuffle = s;
    Loader committed(world, o);
    EXPECT_EQ(committed.rows(), 30);
    EXPECT_EQ(committed.steps_per_epoch(), 5);
    std::vector<std::uint64_t> mine;
    for (const auto& ids : test::record(committed, 0).ids) {
      mine.insert(mine.end(), ids.begin(), ids.end());
    }
    std::vector<std::uint64_t> all = test::gather_concat(world, mine);
    std::sort(all.begin(), all.end());
    ASSERT_EQ(all.size(), 30u);
    for (std::uint64_t i = 0; i < 30; ++i) EXPECT_EQ(all[i], i);
    o.path = dir.file("plain.h5");
    Loader plain(world, o);
    EXPECT_EQ(plain.rows(), 40);
  }
}

TEST(LoaderRows, LabelsAreOptional) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  test::write_file(world, dir.file("nolabels.h5"), {.rows = 20, .cols = 2});
  test::write_file(world, dir.file("grouped.h5"),
                   {.rows = 20, .cols = 2, .label_rows = 20, .features = "/data/x",
                    .labels = "/data/y"});
  Loader l(world, options(dir.file("nolabels.h5")));
  EXPECT_FALSE(l.has_labels());
  test::record(l, 0);  // checks that y is empty
  LoaderOptions o = options(dir.file("grouped.h5"));
  o.features = "/data/x";
  o.labels = "";
  Loader unlabelled(world, o);
  EXPECT_FALSE(unlabelled.has_labels());
  o.labels = "/data/y";
  Loader labelled(world, o);
  EXPECT_TRUE(labelled.has_labels());
  test::record(labelled, 0);  // checks every label against the file
}

TEST(LoaderErrors, BadOptionsAreConfigErrors) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string path = dir.file("d.h5");
  test::write_file(world, path, {.rows = 10, .cols = 2, .label_rows = 10});
  EXPECT_TRUE(contains(test::error_of<ConfigError>([&] { Loader l(world, options(path, 0)); }),
                       "global_batch = 0"));
  const std::string big = test::error_of<ConfigError>([&] { Loader l(world, options(path, 11)); });
  EXPECT_TRUE(contains(big, "global_batch = 11") && contains(big, "10 rows") &&
              contains(big, path)) << big;
  LoaderOptions o = options(path);
  o.prefetch_depth = 0;
  EXPECT_TRUE(contains(test::error_of<ConfigError>([&] { Loader l(world, o); }),
                       "prefetch_depth = 0"));
  const std::string shuffle = test::error_of<ConfigError>([] { train::parse_shuffle("random"); });
  EXPECT_TRUE(contains(shuffle, "'random'") && contains(shuffle, "global")) << shuffle;
  EXPECT_EQ(train::parse_shuffle("global"), Shuffle::global);

  Loader l(world, options(path));
  EXPECT_THROW(l.next(), InternalError);  // before start_epoch
  EXPECT_TRUE(contains(test::error_of<ConfigError>([&] { l.start_epoch(0, 4); }), "[0, 3]"));
  EXPECT_THROW(l.start_epoch(-1), ConfigError);
  test::record(l, 0);  // the loader still works after refused calls
}

TEST(LoaderErrors, MissingOrMalformedDataAreAgreedDataErrors) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string missing = dir.file("nope.h5");
  std::string msg = test::error_of<DataError>([&] { Loader l(world, options(missing)); });
  EXPECT_TRUE(contains(msg, missing)) << msg;

  const std::string path = dir.file("d.h5");
  test::write_file(world, path, {.rows = 12, .cols = 2, .label_rows = 10});
  LoaderOptions o = options(path);
  o.labels = "";
  for (const char* name : {"/feats", "/group/feats"}) {
    o.features = name;
    msg = test::error_of<DataError>([&] { Loader l(world, o); });
    EXPECT_TRUE(contains(msg, name) && contains(msg, path)) << msg;
  }
  o.features = "/labels";  // 1-D
  msg = test::error_of<DataError>([&] { Loader l(world, o); });
  EXPECT_TRUE(contains(msg, "[N, D]")) << msg;

  msg = test::error_of<DataError>([&] { Loader l(world, options(path)); });
  EXPECT_TRUE(contains(msg, "10 rows") && contains(msg, "12") && contains(msg, "/labels")) << msg;

  const std::string text = dir.file("text.h5");
  if (world.is_root()) {
    FILE* f = std::fopen(text.c_str(), "w");
    std::fputs("not hdf5\n", f);
    std::fclose(f);
  }
  world.barrier();
  msg = test::error_of<DataError>([&] { Loader l(world, options(text)); });
  EXPECT_TRUE(contains(msg, text)) << msg;
  try {
    Loader l(world, options(missing));
  } catch (const Error& e) {
    EXPECT_TRUE(e.agreed());
  }
  // After all these refusals the next loader opens and reads normally.
  Loader good(world, [&] { LoaderOptions g = options(path); g.labels = ""; return g; }());
  test::record(good, 0);
}

}  // namespace
