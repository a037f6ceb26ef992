// The CPU math libraries a process has loaded (see runtime.h); LibTorch's own settings are read
// by cpu_runtime() in torch_runtime.cpp, so that this file does not need LibTorch at run time
// (the launcher, Note [A launcher without LibTorch]).
#include "tandem/runtime.h"
#include "tandem/state.h"

#include <dlfcn.h>
#include <link.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

namespace tandem {

std::vector<int> usable_cpus() {
  std::vector<int> out;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  if (out.empty()) {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n; ++c) out.push_back(static_cast<int>(c));
  }
  return out;
}

namespace {

std::string resolved(const char* path) {
  char buf[PATH_MAX];
  if (path && *path && ::realpath(path, buf)) return buf;
  return path ? path : "";
}

std::string base_name(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Every shared object mapped into this process, resolved.
std::vector<std::string> loaded_objects() {
  std::vector<std::string> out;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        if (info->dlpi_name && *info->dlpi_name)
          static_cast<std::vector<std::string>*>(data)->push_back(resolved(info->dlpi_name));
        return 0;
      },
      &out);
  return out;
}

// The widest x86 vector ISA a core's kernels use: 1 SSE, 2 AVX, 3 AVX2, 4 AVX-512; 0 unknown.
int isa_level(const std::string& core) {
  static const std::map<std::string, int> levels = {
      {"katmai", 1},      {"coppermine", 1},  {"northwood", 1},  {"prescott", 1},
      {"banias", 1},      {"core2", 1},       {"penryn", 1},     {"dunnington", 1},
      {"nehalem", 1},     {"atom", 1},        {"opteron", 1},    {"opteron_sse3", 1},
      {"barcelona", 1},   {"bobcat", 1},      {"nano", 1},       {"sandybridge", 2},
      {"bulldozer", 2},   {"piledriver", 2},  {"steamroller", 3}, {"excavator", 3},
      {"haswell", 3},     {"zen", 3},         {"skylakex", 4},   {"cooperlake", 4},
      {"sapphirerapids", 4}};
  std::string lower;
  for (char c : core) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto it = levels.find(lower);
  return it == levels.end() ? 0 : it->second;
}

}  // namespace

std::string openblas_better_coretype(const std::string& chosen_core,
                                     const std::vector<std::string>& cpu_flags) {
  std::set<std::string> f(cpu_flags.begin(), cpu_flags.end());
  auto has = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (!f.count(n)) return false;
    return true;
  };
  std::string best;
  if (has({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}))
    best = "SkylakeX";  // Cooperlake's sgemm is SkylakeX's, and OpenBLAS 0.3.21 cannot force it
  else if (has({"avx2", "fma"}))
    best = "Haswell";
  else if (has({"avx"}))
    best = "Sandybridge";
  const int chosen = isa_level(chosen_core);
  if (best.empty() || chosen == 0 || chosen >= isa_level(best)) return "";
  return best;
}

std::vector<std::string> cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  std::vector<std::string> flags;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.push_back(w);
    break;
  }
  return flags;
}

CpuRuntime cpu_libraries() {
  CpuRuntime r;
  // The variables other libraries read, from one snapshot (Note [The environment is read in
  // one place]).
  const EnvMap env = current_environment();
  auto variable = [&env](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  r.blas_core_forced = variable("OPENBLAS_CORETYPE");
  for (const auto& path : loaded_objects()) {
    const auto name = base_name(path);
    if (starts_with(name, "libgomp.so") || starts_with(name, "libiomp5") ||
        starts_with(name, "libomp.so")) {
      r.openmp.push_back(path);
    } else if (starts_with(name, "libdnnl") || starts_with(name, "libmkldnn")) {
      r.onednn_path = path;
    }
  }
  // Note [Which BLAS runs]: several BLAS libraries can be mapped at once (LAPACK from OpenBLAS
  // pulls libopenblas in beside a reference libblas), so the one that runs is the one LibTorch's
  // calls bind to: the first definition of sgemm_ in the global scope.
  if (void* sgemm = ::dlsym(RTLD_DEFAULT, "sgemm_")) {
    Dl_info info{};
    if (::dladdr(sgemm, &info) && info.dli_fname) r.blas_path = resolved(info.dli_fname);
  }
  if (void* getrf = ::dlsym(RTLD_DEFAULT, "sgetrf_")) {
    Dl_info info{};
    if (::dladdr(getrf, &info) && info.dli_fname) r.lapack_path = resolved(info.dli_fname);
  }
  const auto& b = r.blas_path;
  using ConfigFn = char* (*)();
  using ParallelFn = int (*)();
  if (b.empty()) {
    r.blas_kind = "none loaded";
  } else if (b.find("openblas") != std::string::npos) {
    r.blas_kind = "openblas";
    // The provider's own configuration (not another OpenBLAS that happens to be mapped).
    if (void* h = ::dlopen(b.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      if (auto config = reinterpret_cast<ConfigFn>(::dlsym(h, "openblas_get_config")))
        r.blas_config = config();
      if (auto core = reinterpret_cast<ConfigFn>(::dlsym(h, "openblas_get_corename"))) {
        r.blas_core = core();
        if (r.blas_core_forced.empty())  // a user's choice stands
          r.blas_core_better = openblas_better_coretype(r.blas_core, cpu_flags());
      }
      if (auto par = reinterpret_cast<ParallelFn>(::dlsym(h, "openblas_get_parallel"))) {
        const int p = par();
        r.blas_threading = p == 0 ? "sequential" : p == 1 ? "pthreads" : p == 2 ? "openmp" : "?";
      }
      ::dlclose(h);
    }
  } else if (b.find("mkl") != std::string::npos) {
    r.blas_kind = "mkl";
  } else if (auto mkl = reinterpret_cast<void (*)(char*, int)>(
                 ::dlsym(RTLD_DEFAULT, "MKL_Get_Version_String"))) {
    // PyPI's torch wheels link MKL statically into libtorch_cpu.
    r.blas_kind = "mkl";
    char version[256] = {0};
    mkl(version, sizeof(version) - 1);
    r.blas_config = std::string(version) + ", linked into " + base_name(b);
  } else if (b.find("blis") != std::string::npos) {
    r.blas_kind = "blis";
  } else if (b.find("/blas/libblas.so") != std::string::npos) {
    r.blas_kind = "reference";  // Debian's libblas3 (netlib), under .../blas/
  } else {
    r.blas_kind = "unknown";
  }
  if (env.count("OMP_NUM_THREADS")) r.omp_num_threads = variable("OMP_NUM_THREADS");
  r.usable_cores = static_cast<int>(usable_cpus().size());
  r.online_cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  return r;
}

std::string cpu_runtime_report(const CpuRuntime& r) {
  std::ostringstream os;
  os << "BLAS: " << r.blas_kind;
  if (!r.blas_path.empty()) os << " (" << r.blas_path << ")";
  os << "\n";
  if (!r.blas_config.empty())
    os << "BLAS config: " << r.blas_config
       << (r.blas_threading.empty() ? "" : ", threading " + r.blas_threading) << "\n";
  if (!r.blas_core.empty()) {
    os << "BLAS kernels: " << r.blas_core;
    if (!r.blas_core_forced.empty()) os << " (OPENBLAS_CORETYPE=" << r.blas_core_forced << ")";
    if (!r.blas_core_better.empty())
      os << " (narrower than this CPU: OPENBLAS_CORETYPE=" << r.blas_core_better
         << " selects its kernels; tandem launch sets it for its ranks)";
    os << "\n";
  }
  os << "LAPACK: " << (r.lapack_path.empty() ? "none loaded" : r.lapack_path) << "\n";
  os << "OpenMP runtime: ";
  if (r.openmp.empty()) os << "none loaded";
  for (size_t i = 0; i < r.openmp.size(); ++i) os << (i ? ", " : "") << r.openmp[i];
  os << "\n";
  os << "LibTorch threads: intra-op " << r.intra_op_threads << ", inter-op " << r.inter_op_threads
     << " (OMP_NUM_THREADS " << (r.omp_num_threads.empty() ? "unset" : r.omp_num_threads) << ")\n";
  os << "oneDNN: " << (r.onednn ? "yes" : "no");
  if (!r.onednn_path.empty()) os << " (" << r.onednn_path << ")";
  os << "\n";
  os << "CPU cores: " << r.usable_cores << " usable of " << r.online_cores << " online\n";
  return os.str();
}

std::string blas_kernels_warning(const CpuRuntime& r) {
  if (r.blas_core_better.empty()) return "";
  return "tandem: warning: OpenBLAS does not know this CPU and runs its " + r.blas_core +
         " kernels, 2-3x slower than the CPU's own on every matmul. Set OPENBLAS_CORETYPE=" +
         r.blas_core_better + " in the environment (tandem launch does it for its ranks).";
}

std::string reference_blas_warning(const CpuRuntime& r) {
  if (!r.reference_blas()) return "";
  return "tandem: warning: LibTorch's matrix products run on the reference BLAS (" + r.blas_path +
         "), 10-15x slower than an optimized BLAS on every matmul. Install OpenBLAS: `apt-get "
         "install libopenblas0-openmp` (Debian's alternatives then select it; "
         "scripts/install-deps.sh does this), or put another BLAS first on LD_LIBRARY_PATH. "
         "`tandem env` shows what a process loads.";
}

}  // namespace tandem
