// The CPU math libraries a process loads, as `tandem env` and the Accelerator report them: the
// project's install scripts put OpenBLAS under LibTorch, and a process that ends up on Debian's
// reference BLAS anyway is told so, once, with the fix.
#include <gtest/gtest.h>

#include <cstdlib>

#include "../common/subprocess.h"
#include "tandem/runtime.h"

using tandem::testing::count_of;
using tandem::testing::run_command;

namespace {
// Debian's reference BLAS, which this directory's libblas.so.3 is (libblas3).
const char* kReferenceBlasDir = "/usr/lib/x86_64-linux-gnu/blas";
}  // namespace

// OpenBLAS under Debian's LibTorch (the install scripts' choice); MKL linked into a PyPI wheel's.
bool optimized(const tandem::CpuRuntime& r) { return r.blas_kind == "openblas" || r.blas_kind == "mkl"; }

// Whether LibTorch calls a BLAS that LD_LIBRARY_PATH can swap (Debian's libblas.so.3
// alternatives), as opposed to one linked into libtorch_cpu.
bool shared_system_blas(const tandem::CpuRuntime& r) {
  return r.blas_path.find("libtorch_cpu") == std::string::npos;
}

TEST(CpuRuntime, ThisProcessRunsOnAnOptimizedBlas) {
  auto r = tandem::cpu_runtime();
  EXPECT_TRUE(optimized(r)) << tandem::cpu_runtime_report(r);
  EXPECT_FALSE(r.blas_config.empty());
  EXPECT_FALSE(r.reference_blas());
  EXPECT_TRUE(tandem::reference_blas_warning(r).empty());
  EXPECT_GE(r.intra_op_threads, 1);
  EXPECT_GE(r.usable_cores, 1);
  EXPECT_FALSE(r.openmp.empty()) << tandem::cpu_runtime_report(r);
}

TEST(CpuRuntime, EnvReportsTheLoadedBlas) {
  auto r = run_command({TANDEM_CLI, "env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto here = tandem::cpu_runtime();
  EXPECT_NE(r.output.find("BLAS: " + here.blas_kind + " ("), std::string::npos) << r.output;
  EXPECT_TRUE(optimized(here)) << r.output;
  EXPECT_NE(r.output.find("LibTorch threads: intra-op "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("OpenMP runtime: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("oneDNN: "), std::string::npos) << r.output;
}

TEST(CpuRuntime, ReferenceBlasIsReportedAndWarnedOnce) {
  auto env = run_command({TANDEM_CLI, "env"}, {{"LD_LIBRARY_PATH", kReferenceBlasDir}});
  ASSERT_EQ(env.exit_code, 0) << env.output;
  const auto here = tandem::cpu_runtime();
  if (!shared_system_blas(here)) {
    // A LibTorch with its BLAS linked in (PyPI's wheel: MKL) cannot be put on the reference
    // BLAS: the report says what runs, and nobody is warned.
    EXPECT_NE(env.output.find("BLAS: " + here.blas_kind + " (" + here.blas_path), std::string::npos)
        << env.output;
    EXPECT_EQ(count_of(env.output, "reference BLAS"), 0) << env.output;
    return;
  }
  EXPECT_NE(env.output.find("BLAS: reference (/usr/lib/x86_64-linux-gnu/blas/libblas.so.3"),
            std::string::npos)
      << env.output;
  // Two ranks through the launcher: the main process warns, once.
  auto run = run_command({TANDEM_CLI, "launch", "--num_processes", "2", "--cpu", TRAIN_MLP,
                          "--samples", "256", "--epochs", "1"},
                         {{"LD_LIBRARY_PATH", kReferenceBlasDir}}, 300);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(count_of(run.output, "run on the reference BLAS"), 1) << run.output;
  EXPECT_NE(run.output.find("apt-get install libopenblas0-openmp"), std::string::npos);
  auto fast = run_command({TANDEM_CLI, "launch", "--num_processes", "2", "--cpu", TRAIN_MLP,
                           "--samples", "256", "--epochs", "1"},
                          {}, 300);
  ASSERT_EQ(fast.exit_code, 0) << fast.output;
  EXPECT_EQ(count_of(fast.output, "reference BLAS"), 0) << fast.output;
}

// Note [OpenBLAS kernels]: which OPENBLAS_CORETYPE gives a CPU wider kernels than OpenBLAS chose.
TEST(OpenBlasKernels, BetterCoretypeFollowsTheCpuFlags) {
  const std::vector<std::string> avx512 = {"sse4_2", "avx", "avx2", "fma", "avx512f",
                                           "avx512cd", "avx512bw", "avx512dq", "avx512vl"};
  auto with_bf16 = avx512;
  with_bf16.push_back("avx512_bf16");
  // An unknown CPU model: OpenBLAS fell back to its SSE3 kernels.
  EXPECT_EQ(tandem::openblas_better_coretype("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(tandem::openblas_better_coretype("Prescott", with_bf16), "SkylakeX");
  EXPECT_EQ(tandem::openblas_better_coretype("Nehalem", {"avx", "avx2", "fma"}), "Haswell");
  EXPECT_EQ(tandem::openblas_better_coretype("Core2", {"avx"}), "Sandybridge");
  EXPECT_EQ(tandem::openblas_better_coretype("Sandybridge", with_bf16), "SkylakeX");
  // Kernels that already fit, a CPU without wider units, and names it does not know: left alone.
  EXPECT_EQ(tandem::openblas_better_coretype("SkylakeX", with_bf16), "");
  EXPECT_EQ(tandem::openblas_better_coretype("Haswell", {"avx", "avx2", "fma"}), "");
  EXPECT_EQ(tandem::openblas_better_coretype("Prescott", {"sse3", "sse4_2"}), "");
  EXPECT_EQ(tandem::openblas_better_coretype("Haswell", {"avx", "avx512f"}), "");
  EXPECT_EQ(tandem::openblas_better_coretype("SomeFutureCore", with_bf16), "");
  EXPECT_EQ(tandem::openblas_better_coretype("", with_bf16), "");
}

// A rank started by `tandem launch` runs the widest kernels of this CPU: either OpenBLAS knew the
// CPU, or the launcher set OPENBLAS_CORETYPE (to what this process's own OpenBLAS lacks). A user's
// OPENBLAS_CORETYPE is left as it is.
TEST(OpenBlasKernels, LaunchedRanksRunTheCpusKernels) {
  const auto here = tandem::cpu_runtime();
  if (here.blas_kind != "openblas") {
    // Not OpenBLAS (the wheel's MKL chooses its kernels at run time): no kernel line, and the
    // launcher leaves OPENBLAS_CORETYPE alone: unset, or the user's own value.
    EXPECT_TRUE(here.blas_core.empty());
    auto launched = run_command({TANDEM_CLI, "launch", "--num_processes", "1", "--cpu", "sh",
                                 "-c", "echo coretype=${OPENBLAS_CORETYPE:-unset}"});
    ASSERT_EQ(launched.exit_code, 0) << launched.output;
    const char* user = std::getenv("OPENBLAS_CORETYPE");
    const std::string want = std::string("coretype=") + (user && *user ? user : "unset") + "\n";
    EXPECT_NE(launched.output.find(want), std::string::npos) << launched.output;
    return;
  }
  ASSERT_FALSE(here.blas_core.empty()) << tandem::cpu_runtime_report(here);
  auto direct = run_command({TANDEM_CLI, "env"});
  ASSERT_EQ(direct.exit_code, 0) << direct.output;
  EXPECT_NE(direct.output.find("BLAS kernels: " + here.blas_core), std::string::npos)
      << direct.output;
  EXPECT_EQ(direct.output.find("narrower than this CPU") != std::string::npos,
            !here.blas_core_better.empty())
      << direct.output;
  auto launched = run_command({TANDEM_CLI, "launch", "--num_processes", "1", "--cpu", TANDEM_CLI,
                               "env"});
  ASSERT_EQ(launched.exit_code, 0) << launched.output;
  EXPECT_EQ(launched.output.find("narrower than this CPU"), std::string::npos) << launched.output;
  if (!here.blas_core_better.empty()) {
    EXPECT_NE(launched.output.find("BLAS kernels: " + here.blas_core_better +
                                   " (OPENBLAS_CORETYPE=" + here.blas_core_better + ")"),
              std::string::npos)
        << launched.output;
  }
  auto chosen = run_command({TANDEM_CLI, "launch", "--num_processes", "1", "--cpu", TANDEM_CLI,
                             "env"},
                            {{"OPENBLAS_CORETYPE", "Nehalem"}});
  ASSERT_EQ(chosen.exit_code, 0) << chosen.output;
  EXPECT_NE(chosen.output.find("BLAS kernels: Nehalem (OPENBLAS_CORETYPE=Nehalem)"),
            std::string::npos)
      << chosen.output;
}
