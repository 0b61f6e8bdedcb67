// Whole-file replacement of small text files by rename(2).
#include "locus/io/text_file.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>

namespace locus::io {

int replace_file(const std::string& path, std::string_view text) noexcept {
  try {
    const std::filesystem::path p(path);
    const std::filesystem::path tmp =
        p.parent_path() / fmt::format(".{}.{}.locus-tmp", p.filename().string(), ::getpid());
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) return errno;
    int err = 0;
    if (std::fwrite(text.data(), 1, text.size(), f) != text.size()) err = errno != 0 ? errno : EIO;
    if (std::fclose(f) != 0 && err == 0) err = errno != 0 ? errno : EIO;
    if (err == 0 && std::rename(tmp.c_str(), p.c_str()) != 0) err = errno;
    if (err != 0) std::remove(tmp.c_str());
    return err;
  } catch (...) {  // a path or format allocation failed
    return ENOMEM;
  }
}

int directory_writable(const std::string& path) noexcept {
  try {
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    const std::string d = dir.empty() ? "." : dir.string();
    return ::access(d.c_str(), W_OK | X_OK) == 0 ? 0 : errno;
  } catch (...) {
    return ENOMEM;
  }
}

}  // namespace locus::io
