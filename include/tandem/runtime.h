// What a process actually runs its CPU math on: the BLAS and LAPACK libraries loaded (not the
// ones installed), the OpenMP runtime, LibTorch's thread counts and oneDNN. CPU training speed
// is decided mostly here: Debian's reference BLAS is 10-15x slower than OpenBLAS on every matmul.
#pragma once

#include <string>
#include <vector>

namespace tandem {

/// The cores this process may run on (its affinity mask), ascending; hardware_concurrency()'s
/// when the mask cannot be read. The launcher divides them among its ranks.
std::vector<int> usable_cpus();

/// The CPU math libraries of this process.
struct CpuRuntime {
  /// The library LibTorch's BLAS calls bind to (the provider of sgemm_), resolved through
  /// Debian's alternatives symlinks; "" when none is loaded.
  std::string blas_path;
  /// "openblas", "mkl", "blis", "reference" (Debian's netlib libblas3) or "unknown".
  std::string blas_kind;
  /// OpenBLAS: its configuration string (version, architecture, threading); else "".
  std::string blas_config;
  /// OpenBLAS: "sequential", "pthreads" or "openmp"; else "".
  std::string blas_threading;
  /// OpenBLAS: the kernels it chose for this CPU (openblas_get_corename(): "Haswell",
  /// "SkylakeX", ... or a generic fallback such as "Prescott" when it does not know the CPU).
  std::string blas_core;
  /// OpenBLAS: the OPENBLAS_CORETYPE that would give this CPU wider vector kernels than
  /// blas_core (Note [OpenBLAS kernels]); "" when blas_core already fits.
  std::string blas_core_better;
  /// OPENBLAS_CORETYPE as set in the environment (a user's choice of kernels), or "".
  std::string blas_core_forced;
  /// The provider of LAPACK's sgetrf_, resolved; "" when none is loaded.
  std::string lapack_path;
  /// Loaded OpenMP runtimes (libgomp, libiomp5, libomp), resolved paths.
  std::vector<std::string> openmp;
  /// LibTorch's intra-op and inter-op thread pools.
  int intra_op_threads = 0;
  int inter_op_threads = 0;
  /// OMP_NUM_THREADS as set in the environment, or "" when unset.
  std::string omp_num_threads;
  /// Whether LibTorch was built with oneDNN (MKLDNN), and the loaded libdnnl path.
  bool onednn = false;
  std::string onednn_path;
  /// CPU cores this process may run on (its affinity mask) and cores online.
  int usable_cores = 0;
  int online_cores = 0;

  /// True when matrix products run on Debian's reference BLAS.
  bool reference_blas() const { return blas_kind == "reference"; }
};

/// Reads the CpuRuntime of this process (/proc/self, the loaded libraries' own symbols and
/// LibTorch's thread settings). Cheap: no computation.
CpuRuntime cpu_runtime();

/// cpu_runtime() without LibTorch's settings (threads and oneDNN stay 0 and false): what a
/// process that does not load LibTorch, as the launcher, can read of the libraries it maps.
CpuRuntime cpu_libraries();

/// Lines "BLAS: ...", "LAPACK: ...", "OpenMP: ...", "threads: ...", "oneDNN: ...", "CPU cores: ...".
std::string cpu_runtime_report(const CpuRuntime& runtime);

/// When this process runs on the reference BLAS, the warning that says so and how to fix it;
/// "" otherwise.
std::string reference_blas_warning(const CpuRuntime& runtime);

/// When OpenBLAS runs kernels narrower than the CPU (blas_core_better), the warning that says
/// so and how to fix it; "" otherwise.
std::string blas_kernels_warning(const CpuRuntime& runtime);

/// Note [OpenBLAS kernels]: OpenBLAS picks its kernels from the CPU model; a release older than
/// the CPU does not know it and falls back to SSE3 kernels ("Prescott"), 2-3x slower than the
/// AVX-512 ones the CPU runs. Given the core OpenBLAS chose and the CPU's feature flags (as
/// /proc/cpuinfo names them), the OPENBLAS_CORETYPE of the widest kernels the CPU supports when
/// they are wider than the chosen ones, else "". `tandem launch` sets it for its ranks.
std::string openblas_better_coretype(const std::string& chosen_core,
                                     const std::vector<std::string>& cpu_flags);

/// The CPU feature flags of this machine (/proc/cpuinfo's first "flags" line).
std::vector<std::string> cpu_flags();

}  // namespace tandem
