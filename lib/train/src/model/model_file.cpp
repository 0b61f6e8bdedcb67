// Model files: tensors in state_dict order, each written by the ranks holding its layer (every
// rank, or a pipeline stage's replicas) row-shared among them, attributes for the spec and
// provenance, and a validating reader for model files, checkpoints and h5py files.
#include "locus/train/model/model_file.hpp"

#include <fmt/format.h>

#include <climits>
#include <cmath>
#include <vector>

#include "model/layer_owners.hpp"
#include "locus/comm/agree.hpp"
#include "locus/config.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/publish.hpp"

namespace locus::train {

namespace {

constexpr const char* kLayoutHint = "see docs/FORMATS.md, \"Model files\"";

std::string prefix_of(const std::string& group) {
  if (group.empty() || group == "/") return "/";
  return group.back() == '/' ? group : group + "/";
}

std::string group_label(const std::string& group) {
  return group.empty() || group == "/" ? std::string("/") : group;
}

std::string shape_text(const h5::Dataset& ds) {
  return ds.cols() == 0 ? fmt::format("[{}]", ds.rows())
                        : fmt::format("[{}, {}]", ds.rows(), ds.cols());
}

std::string shape_text(const TensorInfo& t) {
  return t.shape.size() == 1 ? fmt::format("[{}]", t.shape[0])
                             : fmt::format("[{}, {}]", t.shape[0], t.shape[1]);
}

// The MPI type of one tensor row, so all-gather counts stay far below INT_MAX.
struct RowType {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  explicit RowType(std::size_t width) {
    LOCUS_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(width), MPI_FLOAT, &type));
    LOCUS_MPI_CHECK(MPI_Type_commit(&type));
  }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  ~RowType() { MPI_Type_free(&type); }
};

void write_attributes(hid_t where, const Mlp& model, const ModelInfo& info) {
  const ModelSpec& spec = model.spec();
  std::vector<std::int64_t> widths(spec.widths.begin(), spec.widths.end());
  h5::write_attr(where, "locus_format", kModelFormat);
  h5::write_attr(where, "schema_version", kModelSchemaVersion);
  h5::write_attr(where, "widths", std::span<const std::int64_t>(widths));
  h5::write_attr(where, "activation", std::string(to_string(spec.activation)));
  h5::write_attr(where, "init", std::string(to_string(spec.init)));
  h5::write_attr(where, "dropout", static_cast<double>(spec.dropout));
  h5::write_attr(where, "seed", static_cast<std::int64_t>(spec.seed));
  h5::write_attr(where, "loss", std::string(to_string(info.loss)));
  // A classifier has one output per class; 0 (unset) records exactly that.
  const std::int64_t classes = info.loss == Loss::softmax_cross_entropy && info.num_classes == 0
                                   ? spec.widths.back()
                                   : info.num_classes;
  h5::write_attr(where, "num_classes", classes);
  h5::write_attr(where, "trained_steps", info.trained_steps);
  h5::write_attr(where, "dataset", info.dataset);
  h5::write_attr(where, "config", info.config);
  h5::write_attr(where, "tool_version", LOCUS_VERSION);
  h5::write_attr(where, "git_revision", LOCUS_GIT_REVISION);
}

template <class T>
T attr_or(hid_t obj, const std::string& name, T fallback) {
  return h5::has_attr(obj, name) ? h5::read_attr<T>(obj, name) : fallback;
}

// A ConfigError from a parser (unknown activation ...) becomes a DataError about the file.
template <class Fn>
auto parse_attr(const std::string& path, const std::string& name, const std::string& value,
                Fn&& fn) {
  try {
    return fn(value);
  } catch (const ConfigError& e) {
    throw DataError(fmt::format("model file '{}': attribute '{}' = '{}' is invalid: {}", path,
                                name, value, e.what()));
  }
}

ModelInfo read_info(const std::string& path, hid_t g, const std::string& group) {
  ModelInfo info;
  const std::string where = fmt::format("model file '{}' (group {})", path, group_label(group));
  for (const char* required : {"schema_version", "widths", "activation"}) {
    if (!h5::has_attr(g, required)) {
      throw DataError(fmt::format("{} has no attribute '{}'; a model needs at least "
                                  "schema_version, widths and activation ({})",
                                  where, required, kLayoutHint));
    }
  }
  const auto version = h5::read_attr<std::int64_t>(g, "schema_version");
  if (version > kModelSchemaVersion || version < 1) {
    throw DataError(fmt::format("{} has model schema_version {}; this locus reads version 1 to "
                                "{}: upgrade locus (or rewrite the file)",
                                where, version, kModelSchemaVersion));
  }
  for (std::int64_t w : h5::read_attr<std::vector<std::int64_t>>(g, "widths")) {
    if (w < 1 || w > INT_MAX) {
      throw DataError(fmt::format("{}: attribute 'widths' holds {}; widths must be positive "
                                  "layer sizes, input first", where, w));
    }
    info.spec.widths.push_back(static_cast<int>(w));
  }
  info.spec.activation = parse_attr(path, "activation", h5::read_attr<std::string>(g, "activation"),
                                    [](const std::string& s) { return parse_activation(s); });
  info.spec.init = parse_attr(path, "init", attr_or<std::string>(g, "init", "he"),
                              [](const std::string& s) { return parse_init(s); });
  info.spec.dropout = static_cast<float>(attr_or<double>(g, "dropout", 0.0));
  info.spec.seed = static_cast<std::uint64_t>(attr_or<std::int64_t>(g, "seed", 0));
  info.loss = parse_attr(path, "loss", attr_or<std::string>(g, "loss", "cross_entropy"),
                         [](const std::string& s) { return parse_loss(s); });
  try {
    validate(info.spec);
  } catch (const ConfigError& e) {
    throw DataError(fmt::format("{}: {}", where, e.what()));
  }
  const std::int64_t outputs = info.spec.widths.back();
  info.num_classes = attr_or<std::int64_t>(g, "num_classes", 0);
  if (info.loss == Loss::softmax_cross_entropy && info.num_classes == 0) info.num_classes = outputs;
  if (info.loss == Loss::softmax_cross_entropy && info.num_classes != outputs) {
    throw DataError(fmt::format("{}: num_classes = {} but the output layer has {} units; a "
                                "cross_entropy model has one output per class",
                                where, info.num_classes, outputs));
  }
  info.trained_steps = attr_or<std::int64_t>(g, "trained_steps", 0);
  info.dataset = attr_or<std::string>(g, "dataset", "");
  info.config = attr_or<std::string>(g, "config", "");
  info.tool_version = attr_or<std::string>(g, "tool_version", "");
  info.git_revision = attr_or<std::string>(g, "git_revision", "");
  return info;
}

// Throws unless every tensor of the layout exists with its shape and a float type.
void check_tensors(const std::string& path, h5::File& file, const std::string& group,
                   const ParamLayout& layout) {
  const std::string prefix = prefix_of(group);
  const std::string widths = format_widths(layout.widths());
  for (const TensorInfo& t : layout.tensors()) {
    if (!h5::exists(file.id(), prefix + t.name)) {
      throw DataError(fmt::format(
          "model file '{}' has no tensor '{}' in group {}; widths {} need float32 tensors "
          "layers.<l>.weight [out, in] and layers.<l>.bias [out] for l = 0..{} ({})",
          path, t.name, group_label(group), widths, layout.num_layers() - 1, kLayoutHint));
    }
    h5::Dataset ds = h5::Dataset::open(file, prefix + t.name);
    const bool ok = t.shape.size() == 1
                        ? ds.cols() == 0 && ds.rows() == t.shape[0]
                        : ds.cols() == t.shape[1] && ds.rows() == t.shape[0];
    if (!ok) {
      throw DataError(fmt::format("model file '{}': tensor '{}' has shape {}; expected {} for "
                                  "widths {} ({})",
                                  path, t.name, shape_text(ds), shape_text(t), widths,
                                  kLayoutHint));
    }
    if (ds.dtype() != h5::Dtype::f32 && ds.dtype() != h5::Dtype::f64) {
      throw DataError(fmt::format("model file '{}': tensor '{}' holds {}; expected float32",
                                  path, t.name, h5::dtype_name(ds.dtype())));
    }
  }
  const std::string extra = prefix + ParamLayout::weight_name(layout.num_layers());
  if (h5::exists(file.id(), extra)) {
    throw DataError(fmt::format("model file '{}' has tensor '{}' but its widths attribute ({}) "
                                "declares {} layers; fix the widths attribute",
                                path, extra, widths, layout.num_layers()));
  }
}

// Collective: each rank reads its share of the tensor's rows, then the shares are gathered.
void read_tensor(h5::File& file, const std::string& name, const TensorInfo& t,
                 std::span<float> params) {
  const mpi::Comm& comm = file.comm();
  h5::Dataset ds = h5::Dataset::open(file, name);
  const std::size_t rows = t.shape[0];
  const std::size_t width = t.shape.size() == 2 ? t.shape[1] : 1;
  const h5::RowRange mine = h5::partition_rows(rows, comm.rank(), comm.size());
  std::span<float> all = params.subspan(t.offset, t.size());
  ds.read_rows<float>(mine.begin, all.subspan(mine.begin * width, mine.count * width));
  if (comm.size() == 1) return;
  std::vector<int> counts(static_cast<std::size_t>(comm.size()));
  std::vector<int> displs(counts.size());
  for (int r = 0; r < comm.size(); ++r) {
    const h5::RowRange rr = h5::partition_rows(rows, r, comm.size());
    counts[static_cast<std::size_t>(r)] = static_cast<int>(rr.count);
    displs[static_cast<std::size_t>(r)] = static_cast<int>(rr.begin);
  }
  RowType row(width);
  LOCUS_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all.data(), counts.data(),
                                 displs.data(), row.type, comm.get()));
}

void check_finite(const std::string& path, const ParamLayout& layout,
                  std::span<const float> params) {
  for (const TensorInfo& t : layout.tensors()) {
    for (std::size_t i = 0; i < t.size(); ++i) {
      if (!std::isfinite(params[t.offset + i])) {
        throw DataError(fmt::format("model file '{}': tensor '{}' holds {} at flat index {}; "
                                    "the model diverged or the file is corrupt",
                                    path, t.name, params[t.offset + i], i));
      }
    }
  }
}

// The group holding the model: "/" in a model file, "/model" in a checkpoint.
std::string locate_group(h5::File& file) {
  const hid_t root = file.id();
  if (!h5::has_attr(root, "locus_format")) {
    throw DataError(fmt::format("'{}' is not a locus model (no locus_format attribute at the "
                                "root); {}", file.path(), kLayoutHint));
  }
  const auto format = h5::read_attr<std::string>(root, "locus_format");
  if (format == kModelFormat) return "/";
  if (format == kCheckpointFormat) {
    if (!h5::exists(root, "/model")) {
      throw DataError(fmt::format("checkpoint '{}' has no /model group; it is incomplete or "
                                  "corrupt: use an earlier checkpoint", file.path()));
    }
    // Only the /model group is read here, and it carries its own schema_version: a checkpoint
    // without format_version (hand-made, as docs/FORMATS.md allows for /model) is read; one
    // of a newer format is refused, as --resume and locus-ckpt verify refuse it.
    const std::int64_t version = h5::has_attr(root, "format_version")
                                     ? h5::read_attr<std::int64_t>(root, "format_version")
                                     : 1;
    if (version > kCheckpointFormatVersion || version < 1) {
      throw DataError(fmt::format("checkpoint '{}' has format_version {}; this locus reads 1 to "
                                  "{}: score it with a newer locus, or export a model file "
                                  "with the locus that wrote it (locus-ckpt export)",
                                  file.path(), version, kCheckpointFormatVersion));
    }
    return "/model";
  }
  throw DataError(fmt::format("'{}' has locus_format = \"{}\"; expected a model (\"{}\") or a "
                              "checkpoint (\"{}\")", file.path(), format, kModelFormat,
                              kCheckpointFormat));
}

}  // namespace

void write_model(h5::File& file, const std::string& group, const Mlp& model,
                 const ModelInfo& info) {
  const mpi::Comm& comm = file.comm();
  const int outputs = model.layout().output_width();
  if (info.loss == Loss::softmax_cross_entropy && info.num_classes != 0 &&
      info.num_classes != outputs) {
    throw ConfigError(fmt::format("writing model '{}': num_classes = {} but the output layer has "
                                  "{} units; a cross_entropy model has one output per class",
                                  file.path(), info.num_classes, outputs));
  }
  h5::Id g;
  hid_t where = file.id();
  if (prefix_of(group) != "/") {
    g = h5::exists(file.id(), group) ? h5::open_group(file.id(), group)
                                     : h5::create_group(file.id(), group);
    where = g.get();
  }
  const std::string prefix = prefix_of(group);
  const std::span<const float> params = model.params();
  // No rank holds the whole model on the pipeline path: each tensor comes from the ranks
  // holding its layer, split in rows over them; the others join the collective transfer with
  // no rows.
  const detail::LayerOwners owners(comm, model.held(), model.num_layers());
  for (const TensorInfo& t : model.layout().tensors()) {
    const std::size_t width = t.shape.size() == 2 ? t.shape[1] : 1;
    h5::Dataset ds = h5::Dataset::create(
        file, {.name = prefix + t.name, .dtype = h5::Dtype::f32, .rows = t.shape[0],
               .cols = t.shape.size() == 2 ? t.shape[1] : 0});
    const h5::RowRange mine = owners.rows(t.layer, t.shape[0]);
    ds.write_rows<float>(mine.begin, mine.count == 0 ? params.first(0)
                                                     : params.subspan(t.offset - model.offset() +
                                                                          mine.begin * width,
                                                                      mine.count * width));
  }
  write_attributes(where, model, info);
}

void write_model_file(const mpi::Comm& comm, const std::string& path, const Mlp& model,
                      const ModelInfo& info, const io::OutputLock* held) {
  io::Publication pub = held != nullptr ? io::Publication(comm, path, *held)
                                        : io::Publication(comm, path);
  {
    h5::File file = h5::File::create(comm, pub.temp_path());
    write_model(file, "/", model, info);
    mpi::agree_on(comm, [&] { file.close(); });
  }
  pub.commit();
}

Mlp read_model(h5::File& file, const std::string& group, ModelInfo* info) {
  ModelInfo mi;
  mpi::agree_on(file.comm(), [&] {
    if (prefix_of(group) != "/" && !h5::exists(file.id(), group)) {
      throw DataError(fmt::format("'{}' has no group {}", file.path(), group));
    }
    h5::Id g = prefix_of(group) == "/" ? h5::Id() : h5::open_group(file.id(), group);
    mi = read_info(file.path(), g ? g.get() : file.id(), group);
    check_tensors(file.path(), file, group, ParamLayout(mi.spec.widths));
  });
  Mlp model(mi.spec);
  const std::string prefix = prefix_of(group);
  for (const TensorInfo& t : model.layout().tensors())
    read_tensor(file, prefix + t.name, t, model.params());
  mpi::agree_on(file.comm(),
                [&] { check_finite(file.path(), model.layout(), model.params()); });
  if (info != nullptr) *info = std::move(mi);
  return model;
}

Mlp read_model_file(const mpi::Comm& comm, const std::string& path, ModelInfo* info) {
  h5::File file = h5::File::open(comm, path, h5::File::Mode::read);
  std::string group;
  mpi::agree_on(file.comm(), [&] { group = locate_group(file); });
  Mlp model = read_model(file, group, info);
  mpi::agree_on(file.comm(), [&] { file.close(); });
  return model;
}

}  // namespace locus::train
