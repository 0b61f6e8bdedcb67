// What every bench program shares besides the library: its command line (Boost.Program_options,
// errors as ConfigError naming the program) and the machine's load for its report.
#pragma once

#include <cstdio>
#include <iostream>
#include <string>

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::bench {

// Parses argv into the variables bound in `desc` (their defaults and notifiers applied) and
// into `vm`. True when --help was given: the options are printed and the program should exit.
inline bool parse_command_line(const boost::program_options::options_description& desc,
                               int argc, char** argv, const std::string& program,
                               boost::program_options::variables_map& vm) {
  namespace po = boost::program_options;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    if (vm.count("help") != 0) {  // before notify: --help needs no required option
      std::cout << desc << "\n";
      return true;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw ConfigError(fmt::format("{}: see {} --help", e.what(), program));
  }
  return false;
}

// The 1-minute load average (0 where /proc/loadavg cannot be read): how busy the shared
// machine was while a benchmark ran.
inline double loadavg() {
  double l = 0;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = 0;
    std::fclose(f);
  }
  return l;
}

}  // namespace locus::bench
