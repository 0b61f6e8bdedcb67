// Attributes on HDF5 objects (files, groups, datasets): scalars, strings and 1-D arrays.
// In parallel HDF5 attribute writes are metadata operations: every rank of the file's
// communicator must call them with identical values.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace locus::h5 {

// Collective. Creates or replaces attribute `name` on `obj`.
void write_attr(hid_t obj, const std::string& name, double value);
void write_attr(hid_t obj, const std::string& name, std::int64_t value);
void write_attr(hid_t obj, const std::string& name, const std::string& value);  // UTF-8, variable length
void write_attr(hid_t obj, const std::string& name, const char* value);
void write_attr(hid_t obj, const std::string& name, std::span<const double> values);
void write_attr(hid_t obj, const std::string& name, std::span<const std::int64_t> values);
void write_attr(hid_t obj, const std::string& name, const std::vector<std::string>& values);

bool has_attr(hid_t obj, const std::string& name);

// Reads attribute `name`; a missing attribute or a wrong type is a DataError naming it.
// Numeric reads convert (an int attribute reads as double and vice versa).
template <class T> T read_attr(hid_t obj, const std::string& name);
template <> double read_attr<double>(hid_t obj, const std::string& name);
template <> std::int64_t read_attr<std::int64_t>(hid_t obj, const std::string& name);
template <> std::string read_attr<std::string>(hid_t obj, const std::string& name);
template <> std::vector<double> read_attr<std::vector<double>>(hid_t obj, const std::string& name);
template <> std::vector<std::int64_t> read_attr<std::vector<std::int64_t>>(hid_t obj,
                                                                           const std::string& name);
template <> std::vector<std::string> read_attr<std::vector<std::string>>(hid_t obj,
                                                                         const std::string& name);

// The HDF5 path of an object, for messages ("/features").
std::string object_name(hid_t obj);

}  // namespace locus::h5
