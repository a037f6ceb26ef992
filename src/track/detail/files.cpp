// File helpers for src/track.
#include "track/detail/files.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <system_error>

namespace tandem::track::detail {

void ensure_directory(const std::string& dir, const std::string& what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    throw std::runtime_error(what + ": expected a writable folder '" + dir +
                             "', but it could not be created (" +
                             (ec ? ec.message() : std::string("a file has that name")) +
                             "); pass a logging folder this process can write to");
  }
}

double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string format_double(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // The fewest %g digits that read back exactly: "0.0003" rather than to_chars' "3e-04".
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  return buf;
}

void write_file_atomically(const std::string& path, const std::string& contents,
                           const std::string& what) {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << contents;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      throw std::runtime_error(what + ": could not write '" + tmp +
                               "' (disk full or folder not writable?); free space or choose "
                               "another folder");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw std::runtime_error(what + ": could not move '" + tmp + "' to '" + path + "' (" +
                             ec.message() + ")");
  }
}

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace tandem::track::detail
