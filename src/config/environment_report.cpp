// The environment report of `tandem env` (config.h).
#include <sys/utsname.h>
#include <unistd.h>

#include <torch/cuda.h>

#include <fstream>
#include <sstream>

#include "tandem/config/config.h"
#include "tandem/runtime.h"
#include "tandem/version.h"

namespace tandem::config {

std::string environment_report() {
  std::ostringstream os;
  os << "tandem version: " << kVersion << "\n";
  os << "LibTorch version: " << torch_version() << "\n";
  bool cuda = torch::cuda::is_available();
  os << "CUDA available: " << (cuda ? "yes" : "no") << "\n";
  if (cuda) os << "CUDA devices: " << torch::cuda::device_count() << "\n";
#if defined(TANDEM_WITH_NCCL)
  os << "NCCL: built in\n";
#else
  os << "NCCL: not available (LibTorch without CUDA)\n";
#endif
  os << "Gloo: built in\n";
  os << cpu_runtime_report(cpu_runtime());
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  os << "Memory: " << (static_cast<double>(pages) * page / (1024.0 * 1024 * 1024)) << " GiB\n";
  utsname u{};
  if (uname(&u) == 0) os << "OS: " << u.sysname << " " << u.release << " " << u.machine << "\n";
  std::ifstream osr("/etc/os-release");
  std::string line;
  while (std::getline(osr, line))
    if (line.rfind("PRETTY_NAME=", 0) == 0) os << "Distribution: " << line.substr(12) << "\n";
  os << default_config_report(current_environment());
  return os.str();
}

}  // namespace tandem::config
