// Paths between the two executables of the command line (full_cli.h).
#include "full_cli.h"

#include <unistd.h>

#include <climits>
#include <stdexcept>

namespace tandem::cli {
namespace {

std::string directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

std::string self_executable() {
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) throw std::runtime_error("cannot find this executable (/proc/self/exe)");
  self[n] = '\0';
  return std::string(self);
}

std::string full_cli_path(const std::string& front) {
  return directory_of(front) + "/../libexec/tandem/tandem";
}

std::string launcher_path(const std::string& full) {
  const std::string front = directory_of(full) + "/../../bin/tandem";
  return ::access(front.c_str(), X_OK) == 0 ? front : full;
}

}  // namespace tandem::cli
