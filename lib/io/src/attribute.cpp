// Attribute read/write over the HDF5 C API.
#include "locus/io/attribute.hpp"

#include <array>

#include <fmt/format.h>

#include "locus/io/h5.hpp"

namespace locus::h5 {

namespace {

// Creates attribute `name` (replacing any old one) and writes `buf`.
void put(hid_t obj, const std::string& name, hid_t file_type, hid_t mem_type, hid_t space,
         const void* buf) {
  if (LOCUS_H5_CHECK(H5Aexists(obj, name.c_str())) > 0)
    LOCUS_H5_CHECK(H5Adelete(obj, name.c_str()));
  Id attr(LOCUS_H5_CHECK(
      H5Acreate2(obj, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT)));
  // HDF5 rejects a null buffer even for an empty array; nothing is read from it then.
  static const std::int64_t dummy = 0;
  LOCUS_H5_CHECK(H5Awrite(attr.get(), mem_type, buf != nullptr ? buf : &dummy));
}

Id scalar_space() { return Id(LOCUS_H5_CHECK(H5Screate(H5S_SCALAR))); }

Id vector_space(std::size_t n) {
  const hsize_t dim = n;
  return Id(LOCUS_H5_CHECK(H5Screate_simple(1, &dim, nullptr)));
}

Id utf8_vlen_string() {
  Id t(LOCUS_H5_CHECK(H5Tcopy(H5T_C_S1)));
  LOCUS_H5_CHECK(H5Tset_size(t.get(), H5T_VARIABLE));
  LOCUS_H5_CHECK(H5Tset_cset(t.get(), H5T_CSET_UTF8));
  return t;
}

Id open_attr(hid_t obj, const std::string& name) {
  if (LOCUS_H5_CHECK(H5Aexists(obj, name.c_str())) <= 0) {
    throw DataError(fmt::format("'{}' has no attribute '{}'; was the file written by locus "
                                "(see docs/FORMATS.md)?", object_name(obj), name));
  }
  return Id(LOCUS_H5_CHECK(H5Aopen(obj, name.c_str(), H5P_DEFAULT)));
}

std::size_t element_count(hid_t attr) {
  Id space(LOCUS_H5_CHECK(H5Aget_space(attr)));
  return static_cast<std::size_t>(LOCUS_H5_CHECK(H5Sget_simple_extent_npoints(space.get())));
}

H5T_class_t type_class(hid_t attr) {
  Id t(LOCUS_H5_CHECK(H5Aget_type(attr)));
  return H5Tget_class(t.get());
}

template <class T>
std::vector<T> read_numbers(hid_t obj, const std::string& name, hid_t mem_type) {
  Id attr = open_attr(obj, name);
  const H5T_class_t cls = type_class(attr.get());
  if (cls != H5T_INTEGER && cls != H5T_FLOAT) {
    throw DataError(fmt::format("attribute '{}' of '{}' is not numeric", name, object_name(obj)));
  }
  std::vector<T> out(element_count(attr.get()));
  if (!out.empty()) LOCUS_H5_CHECK(H5Aread(attr.get(), mem_type, out.data()));
  return out;
}

template <class T>
T read_scalar(hid_t obj, const std::string& name, hid_t mem_type) {
  auto v = read_numbers<T>(obj, name, mem_type);
  if (v.size() != 1) {
    throw DataError(fmt::format("attribute '{}' of '{}' has {} values; expected one", name,
                                object_name(obj), v.size()));
  }
  return v[0];
}

}  // namespace

std::string object_name(hid_t obj) {
  std::array<char, 512> buf{};
  if (H5Iget_name(obj, buf.data(), buf.size()) <= 0) return "?";
  return buf.data();
}

void write_attr(hid_t obj, const std::string& name, double value) {
  put(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, scalar_space().get(), &value);
}

void write_attr(hid_t obj, const std::string& name, std::int64_t value) {
  put(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, scalar_space().get(), &value);
}

void write_attr(hid_t obj, const std::string& name, const std::string& value) {
  Id t = utf8_vlen_string();
  const char* p = value.c_str();
  put(obj, name, t.get(), t.get(), scalar_space().get(), &p);
}

void write_attr(hid_t obj, const std::string& name, const char* value) {
  write_attr(obj, name, std::string(value));
}

void write_attr(hid_t obj, const std::string& name, std::span<const double> values) {
  put(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, vector_space(values.size()).get(),
      values.data());
}

void write_attr(hid_t obj, const std::string& name, std::span<const std::int64_t> values) {
  put(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, vector_space(values.size()).get(),
      values.data());
}

void write_attr(hid_t obj, const std::string& name, const std::vector<std::string>& values) {
  Id t = utf8_vlen_string();
  std::vector<const char*> ptrs;
  ptrs.reserve(values.size());
  for (const auto& v : values) ptrs.push_back(v.c_str());
  put(obj, name, t.get(), t.get(), vector_space(values.size()).get(), ptrs.data());
}

bool has_attr(hid_t obj, const std::string& name) {
  return LOCUS_H5_CHECK(H5Aexists(obj, name.c_str())) > 0;
}

template <> double read_attr<double>(hid_t obj, const std::string& name) {
  return read_scalar<double>(obj, name, H5T_NATIVE_DOUBLE);
}

template <> std::int64_t read_attr<std::int64_t>(hid_t obj, const std::string& name) {
  return read_scalar<std::int64_t>(obj, name, H5T_NATIVE_INT64);
}

template <> std::vector<double> read_attr<std::vector<double>>(hid_t obj,
                                                               const std::string& name) {
  return read_numbers<double>(obj, name, H5T_NATIVE_DOUBLE);
}

template <> std::vector<std::int64_t> read_attr<std::vector<std::int64_t>>(
    hid_t obj, const std::string& name) {
  return read_numbers<std::int64_t>(obj, name, H5T_NATIVE_INT64);
}

template <> std::vector<std::string> read_attr<std::vector<std::string>>(
    hid_t obj, const std::string& name) {
  Id attr = open_attr(obj, name);
  if (type_class(attr.get()) != H5T_STRING) {
    throw DataError(fmt::format("attribute '{}' of '{}' is not a string", name,
                                object_name(obj)));
  }
  Id ftype(LOCUS_H5_CHECK(H5Aget_type(attr.get())));
  const std::size_t n = element_count(attr.get());
  std::vector<std::string> out;
  out.reserve(n);
  if (n == 0) return out;
  if (H5Tis_variable_str(ftype.get()) > 0) {
    Id t = utf8_vlen_string();
    std::vector<char*> ptrs(n, nullptr);
    LOCUS_H5_CHECK(H5Aread(attr.get(), t.get(), ptrs.data()));
    for (char* p : ptrs) out.emplace_back(p ? p : "");
    Id space(LOCUS_H5_CHECK(H5Aget_space(attr.get())));
    H5Dvlen_reclaim(t.get(), space.get(), H5P_DEFAULT, ptrs.data());
  } else {  // fixed-length strings (as h5py writes numpy bytes)
    const std::size_t len = H5Tget_size(ftype.get());
    std::vector<char> buf(n * len);
    LOCUS_H5_CHECK(H5Aread(attr.get(), ftype.get(), buf.data()));
    for (std::size_t i = 0; i < n; ++i) {
      const char* s = buf.data() + i * len;
      std::size_t l = 0;
      while (l < len && s[l] != '\0') ++l;
      out.emplace_back(s, l);
    }
  }
  return out;
}

template <> std::string read_attr<std::string>(hid_t obj, const std::string& name) {
  auto v = read_attr<std::vector<std::string>>(obj, name);
  if (v.size() != 1) {
    throw DataError(fmt::format("attribute '{}' of '{}' has {} strings; expected one", name,
                                object_name(obj), v.size()));
  }
  return v[0];
}

}  // namespace locus::h5
