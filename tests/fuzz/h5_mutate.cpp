// The HDF5 edit generator of h5_mutate.hpp over the HDF5 C API (the sec2 driver, no MPI).
#include "h5_mutate.hpp"

#include <hdf5.h>

#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>

#include "fuzz_support.hpp"
#include "locus/io/h5.hpp"

namespace locus::fuzz {

namespace {

using h5::Id;

hid_t check(hid_t rc, const char* what) {
  if (rc < 0) unexpected("HDF5 call of the edit generator failed", what);
  return rc;
}

Id simple_space(std::vector<hsize_t> dims) {
  return Id(check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                  "H5Screate_simple"));
}

Id string_type(bool variable, std::size_t len, bool utf8) {
  Id t(check(H5Tcopy(H5T_C_S1), "H5Tcopy"));
  check(H5Tset_size(t.get(), variable ? H5T_VARIABLE : std::max<std::size_t>(len, 1)), "size");
  check(H5Tset_cset(t.get(), utf8 ? H5T_CSET_UTF8 : H5T_CSET_ASCII), "cset");
  return t;
}

void put(hid_t obj, const std::string& name, hid_t type, hid_t space, const void* buf) {
  Id a(check(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), "H5Acreate2"));
  if (buf != nullptr) check(H5Awrite(a.get(), type, buf), "H5Awrite");
}

double special_double(FuzzedDataProvider& fdp) {
  switch (fdp.ConsumeIntegralInRange(0, 5)) {
    case 0: return std::numeric_limits<double>::quiet_NaN();
    case 1: return std::numeric_limits<double>::infinity();
    case 2: return -std::numeric_limits<double>::infinity();
    case 3: return 1e300;
    case 4: return -1e300;
    default: return fdp.ConsumeFloatingPoint<double>();
  }
}

// Replaces (or adds) attribute `name` of obj by one of the fuzzer's choosing.
void random_attr(hid_t obj, const std::string& name, const H5Edits& e, FuzzedDataProvider& fdp) {
  const Id scalar(check(H5Screate(H5S_SCALAR), "H5Screate"));
  switch (fdp.ConsumeIntegralInRange(0, 15)) {
    case 0: {
      const auto v = fdp.ConsumeIntegral<std::int64_t>();
      put(obj, name, H5T_NATIVE_INT64, scalar.get(), &v);
      break;
    }
    case 1: {
      const auto v = fdp.ConsumeIntegralInRange<std::int64_t>(-3, 70);
      put(obj, name, H5T_NATIVE_INT64, scalar.get(), &v);
      break;
    }
    case 2: {
      const double v = special_double(fdp);
      put(obj, name, H5T_NATIVE_DOUBLE, scalar.get(), &v);
      break;
    }
    case 3: {
      const std::string s = fdp.ConsumeRandomLengthString(64);
      const char* p = s.c_str();
      put(obj, name, string_type(true, 0, true).get(), scalar.get(), &p);
      break;
    }
    case 4: {
      const std::string s = e.words.empty() ? std::string("x") : e.words[fdp.ConsumeIntegralInRange<std::size_t>(0, e.words.size() - 1)];
      const char* p = s.c_str();
      put(obj, name, string_type(true, 0, fdp.ConsumeBool()).get(), scalar.get(), &p);
      break;
    }
    case 5: {  // fixed-length strings, as h5py writes numpy bytes
      const auto n = fdp.ConsumeIntegralInRange<hsize_t>(0, 3);
      const auto len = fdp.ConsumeIntegralInRange<std::size_t>(1, 16);
      std::string buf = fdp.ConsumeBytesAsString(n * len);
      buf.resize(n * len, 'a');
      put(obj, name, string_type(false, len, false).get(), simple_space({n}).get(),
          n == 0 ? nullptr : buf.data());
      break;
    }
    case 6: {  // vector of variable-length strings
      const auto n = fdp.ConsumeIntegralInRange<hsize_t>(0, 3);
      std::vector<std::string> s;
      std::vector<const char*> p;
      for (hsize_t i = 0; i < n; ++i) s.push_back(fdp.ConsumeRandomLengthString(16));
      for (const auto& x : s) p.push_back(x.c_str());
      put(obj, name, string_type(true, 0, true).get(), simple_space({n}).get(),
          n == 0 ? nullptr : p.data());
      break;
    }
    case 7: {  // integer vector of small values (widths, counts)
      const auto n = fdp.ConsumeIntegralInRange<hsize_t>(0, 6);
      std::vector<std::int64_t> v(n);
      for (auto& x : v) x = fdp.ConsumeIntegralInRange<std::int64_t>(-2, 40);
      put(obj, name, H5T_NATIVE_INT64, simple_space({n}).get(), n == 0 ? nullptr : v.data());
      break;
    }
    case 8: {  // integer vector of any values
      const auto n = fdp.ConsumeIntegralInRange<hsize_t>(0, 4);
      std::vector<std::int64_t> v(n);
      for (auto& x : v) x = fdp.ConsumeIntegral<std::int64_t>();
      put(obj, name, H5T_NATIVE_INT64, simple_space({n}).get(), n == 0 ? nullptr : v.data());
      break;
    }
    case 9: {
      const auto n = fdp.ConsumeIntegralInRange<hsize_t>(0, 4);
      std::vector<double> v(n);
      for (auto& x : v) x = special_double(fdp);
      put(obj, name, H5T_NATIVE_DOUBLE, simple_space({n}).get(), n == 0 ? nullptr : v.data());
      break;
    }
    case 10: {
      const auto v = fdp.ConsumeIntegral<std::uint64_t>();
      put(obj, name, H5T_NATIVE_UINT64, scalar.get(), &v);
      break;
    }
    case 11: {
      const auto v = fdp.ConsumeIntegral<std::int8_t>();
      put(obj, name, H5T_NATIVE_INT8, scalar.get(), &v);
      break;
    }
    case 12: {
      const auto v = static_cast<float>(fdp.ConsumeFloatingPoint<float>());
      put(obj, name, H5T_NATIVE_FLOAT, scalar.get(), &v);
      break;
    }
    case 13: {  // a null dataspace: an attribute with no elements at all
      const Id null_space(check(H5Screate(H5S_NULL), "H5Screate"));
      put(obj, name, H5T_NATIVE_INT64, null_space.get(), nullptr);
      break;
    }
    case 14: {
      const std::int32_t v[4] = {fdp.ConsumeIntegral<std::int32_t>(), 1, 2, 3};
      put(obj, name, H5T_NATIVE_INT32, simple_space({2, 2}).get(), v);
      break;
    }
    default: {  // a compound: neither numeric nor string
      struct Pair { std::int32_t a; double b; } v{fdp.ConsumeIntegral<std::int32_t>(), 1.0};
      const Id t(check(H5Tcreate(H5T_COMPOUND, sizeof(Pair)), "H5Tcreate"));
      check(H5Tinsert(t.get(), "a", HOFFSET(Pair, a), H5T_NATIVE_INT32), "H5Tinsert");
      check(H5Tinsert(t.get(), "b", HOFFSET(Pair, b), H5T_NATIVE_DOUBLE), "H5Tinsert");
      put(obj, name, t.get(), scalar.get(), &v);
      break;
    }
  }
}

void random_dataset(hid_t file, const std::string& name, FuzzedDataProvider& fdp) {
  static const hid_t types[] = {H5T_NATIVE_FLOAT, H5T_NATIVE_DOUBLE, H5T_NATIVE_INT32,
                                H5T_NATIVE_UINT8};
  const hid_t type = fdp.PickValueInArray(types);
  std::vector<hsize_t> dims(fdp.ConsumeIntegralInRange<std::size_t>(0, 3));
  for (auto& d : dims) d = fdp.ConsumeIntegralInRange<hsize_t>(0, 12);
  const Id space = dims.empty() ? Id(check(H5Screate(H5S_SCALAR), "H5Screate"))
                                : simple_space(dims);
  Id ds(check(H5Dcreate2(file, name.c_str(), type, space.get(), H5P_DEFAULT, H5P_DEFAULT,
                         H5P_DEFAULT), "H5Dcreate2"));
  if (fdp.ConsumeBool()) return;  // never written: reads give the fill value
  hsize_t n = 1;
  for (auto d : dims) n *= d;
  std::vector<unsigned char> buf(n * H5Tget_size(type));
  const std::vector<std::uint8_t> bytes = fdp.ConsumeBytes<std::uint8_t>(buf.size());
  std::copy(bytes.begin(), bytes.end(), buf.begin());
  if (n > 0) check(H5Dwrite(ds.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()), "H5Dwrite");
}

std::vector<std::string> attr_names(hid_t obj) {
  H5O_info_t info;  // HDF5 1.10 (Debian 12): H5Oget_info2 and H5O_info_t
  check(H5Oget_info2(obj, &info, H5O_INFO_NUM_ATTRS), "H5Oget_info2");
  std::vector<std::string> out;
  for (hsize_t i = 0; i < info.num_attrs; ++i) {
    char buf[256] = {};
    check(H5Aget_name_by_idx(obj, ".", H5_INDEX_NAME, H5_ITER_INC, i, buf, sizeof buf,
                             H5P_DEFAULT), "H5Aget_name_by_idx");
    out.emplace_back(buf);
  }
  return out;
}

}  // namespace

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (!in) unexpected("cannot read the baseline file", path);
  return ss.str();
}

void write_edited(const std::string& path, const std::string& baseline, const H5Edits& edits,
                  FuzzedDataProvider& fdp) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(baseline.data(), static_cast<std::streamsize>(baseline.size()));
    if (!out) unexpected("cannot write the scratch file", path);
  }
  if (fdp.remaining_bytes() == 0) return;
  Id file(check(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "H5Fopen"));
  for (const std::string& group : edits.objects) {
    if (H5Lexists(file.get(), group.c_str(), H5P_DEFAULT) <= 0 && group != "/") continue;
    Id obj(check(H5Oopen(file.get(), group.c_str(), H5P_DEFAULT), "H5Oopen"));
    for (const std::string& name : attr_names(obj.get())) {
      const auto choice = fdp.ConsumeIntegral<std::uint8_t>();
      if (choice < 128) continue;  // keep (also what an exhausted input chooses)
      check(H5Adelete(obj.get(), name.c_str()), "H5Adelete");
      if (choice >= 160) random_attr(obj.get(), name, edits, fdp);
    }
  }
  for (const std::string& name : edits.datasets) {
    const auto choice = fdp.ConsumeIntegral<std::uint8_t>();
    if (choice < 192 || H5Lexists(file.get(), name.c_str(), H5P_DEFAULT) <= 0) continue;
    check(H5Ldelete(file.get(), name.c_str(), H5P_DEFAULT), "H5Ldelete");
    if (choice >= 208) random_dataset(file.get(), name, fdp);
  }
  check(H5Fclose(file.release()), "H5Fclose");
}

}  // namespace locus::fuzz
