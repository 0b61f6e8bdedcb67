// Model files: bit-exact round trips at every world size (each rank writes a share of every
// tensor), checkpoints (/model group), and one clear DataError per kind of damage.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "locus/io/attribute.hpp"
#include "locus/io/file.hpp"
#include "locus/train/model/model_file.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;

namespace {

train::Mlp make_model(std::vector<int> widths, std::uint64_t seed,
                      train::Activation act = train::Activation::relu) {
  train::Mlp m(train::ModelSpec{.widths = std::move(widths), .activation = act,
                                .init = train::Init::xavier, .dropout = 0.25f, .seed = seed});
  // Non-zero biases so they are checked too.
  const auto& layout = m.layout();
  for (int l = 0; l < layout.num_layers(); ++l) {
    auto b = layout.bias(m.params(), l);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = 0.01f * static_cast<float>(i + l) - 0.3f;
  }
  return m;
}

train::ModelInfo make_info(std::int64_t classes = 3) {
  train::ModelInfo info;
  info.loss = train::Loss::softmax_cross_entropy;
  info.num_classes = classes;
  info.trained_steps = 1234;
  info.dataset = "out/train.h5";
  info.config = "[train]\nlr = 0.1\n";
  return info;
}

void expect_same(const train::Mlp& a, const train::Mlp& b) {
  ASSERT_EQ(a.spec().widths, b.spec().widths);
  ASSERT_EQ(a.params().size(), b.params().size());
  EXPECT_EQ(std::memcmp(a.params().data(), b.params().data(), a.params().size_bytes()), 0)
      << "parameters are not bit-identical";
  EXPECT_EQ(a.spec().activation, b.spec().activation);
  EXPECT_EQ(a.spec().init, b.spec().init);
  EXPECT_EQ(a.spec().dropout, b.spec().dropout);
  EXPECT_EQ(a.spec().seed, b.spec().seed);
}

// Rank 0 edits a finished file with the serial HDF5 API; everyone waits.
void edit(const mpi::Comm& world, const std::string& path, const std::function<void(hid_t)>& fn) {
  world.barrier();
  if (world.is_root()) {
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    fn(f);
    H5Fclose(f);
  }
  world.barrier();
}

void replace_tensor(hid_t f, const char* name, std::vector<hsize_t> dims, float value) {
  if (H5Lexists(f, name, H5P_DEFAULT) > 0) H5Ldelete(f, name, H5P_DEFAULT);
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  const hid_t d = H5Dcreate2(f, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT,
                             H5P_DEFAULT);
  hsize_t n = 1;
  for (hsize_t x : dims) n *= x;
  std::vector<float> v(n, value);
  H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Dclose(d);
  H5Sclose(space);
}

// Expects read_model_file to throw a DataError (on every rank) mentioning every needle.
void expect_data_error(const mpi::Comm& world, const std::string& path,
                       std::vector<std::string> needles) {
  try {
    train::read_model_file(world, path);
    ADD_FAILURE() << "reading " << path << " should have failed";
  } catch (const DataError& e) {
    EXPECT_TRUE(e.agreed());
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\nmissing: " << n;
  }
}

}  // namespace

TEST(ModelFile, RoundTripIsBitExactAtEveryWorldSize) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  // Includes tensors with fewer rows than ranks (the last layer has 1 output).
  for (auto widths : {std::vector<int>{784, 256, 128, 10}, std::vector<int>{5, 3, 1}}) {
    const train::Mlp m = make_model(widths, 7, train::Activation::gelu);
    const std::string path = dir.file("m.h5");
    train::write_model_file(world, path, m, make_info(widths.back()));
    train::ModelInfo info;
    const train::Mlp back = train::read_model_file(world, path, &info);
    expect_same(m, back);
    EXPECT_EQ(info.loss, train::Loss::softmax_cross_entropy);
    EXPECT_EQ(info.num_classes, widths.back());
    EXPECT_EQ(info.trained_steps, 1234);
    EXPECT_EQ(info.dataset, "out/train.h5");
    EXPECT_EQ(info.config, "[train]\nlr = 0.1\n");
    EXPECT_FALSE(info.tool_version.empty());
  }
}

TEST(ModelFile, CheckpointModelGroupIsRead) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const train::Mlp m = make_model({6, 4, 3}, 3, train::Activation::tanh);
  const std::string path = dir.file("ckpt.h5");
  {
    h5::File f = h5::File::create(world, path);
    h5::write_attr(f.id(), "locus_format", train::kCheckpointFormat);
    train::write_model(f, "/model", m, make_info());
    f.close();
  }
  expect_same(m, train::read_model_file(world, path));
}

TEST(ModelFile, DamageIsAClearDataErrorOnEveryRank) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const train::Mlp m = make_model({6, 4, 3}, 5);
  auto fresh = [&](const std::string& name) {
    const std::string p = dir.file(name);
    train::write_model_file(world, p, m, make_info());
    return p;
  };
  std::string p = fresh("missing.h5");
  edit(world, p, [](hid_t f) { H5Ldelete(f, "layers.1.bias", H5P_DEFAULT); });
  expect_data_error(world, p, {"missing.h5", "layers.1.bias", "6,4,3"});

  p = fresh("shape.h5");
  edit(world, p, [](hid_t f) { replace_tensor(f, "layers.0.weight", {4, 5}, 0.0f); });
  expect_data_error(world, p, {"shape.h5", "layers.0.weight", "[4, 5]", "[4, 6]"});

  p = fresh("bias2d.h5");
  edit(world, p, [](hid_t f) { replace_tensor(f, "layers.0.bias", {4, 1}, 0.0f); });
  expect_data_error(world, p, {"layers.0.bias", "[4, 1]", "[4]"});

  p = fresh("nan.h5");
  edit(world, p, [](hid_t f) {
    replace_tensor(f, "layers.1.weight", {3, 4}, std::numeric_limits<float>::quiet_NaN());
  });
  expect_data_error(world, p, {"nan.h5", "layers.1.weight", "nan"});

  p = fresh("extra.h5");
  edit(world, p, [](hid_t f) { replace_tensor(f, "layers.2.weight", {2, 3}, 0.0f); });
  expect_data_error(world, p, {"extra.h5", "layers.2.weight", "declares 2 layers"});

  p = fresh("act.h5");
  edit(world, p, [](hid_t f) { h5::write_attr(f, "activation", "swish"); });
  expect_data_error(world, p, {"act.h5", "activation", "swish"});

  p = fresh("newer.h5");
  edit(world, p, [](hid_t f) { h5::write_attr(f, "schema_version", std::int64_t{2}); });
  expect_data_error(world, p, {"newer.h5", "schema_version 2", "upgrade"});

  p = fresh("classes.h5");
  edit(world, p, [](hid_t f) { h5::write_attr(f, "num_classes", std::int64_t{7}); });
  expect_data_error(world, p, {"classes.h5", "num_classes = 7", "3 units"});

  p = fresh("nowidths.h5");
  edit(world, p, [](hid_t f) { H5Adelete(f, "widths"); });
  expect_data_error(world, p, {"nowidths.h5", "widths"});

  p = fresh("notmodel.h5");
  edit(world, p, [](hid_t f) { h5::write_attr(f, "locus_format", "locus-dataset"); });
  expect_data_error(world, p, {"notmodel.h5", "locus-dataset", "locus-model"});

  p = fresh("ckpt.h5");
  edit(world, p, [](hid_t f) { h5::write_attr(f, "locus_format", "locus-checkpoint"); });
  expect_data_error(world, p, {"ckpt.h5", "/model"});

  expect_data_error(world, dir.file("absent.h5"), {"absent.h5"});
  EXPECT_THROW(train::write_model_file(world, dir.file("w.h5"), m, make_info(4)), ConfigError);
}
