// The CPU math libraries a process loads, as `tandem env` and the Accelerator report them: the
// project's install scripts put OpenBLAS under LibTorch, and a process that ends up on Debian's
// reference BLAS anyway is told so, once, with the fix.
#include <gtest/gtest.h>

#include "../common/subprocess.h"
#include "tandem/runtime.h"

using tandem::testing::count_of;
using tandem::testing::run_command;

namespace {
// Debian's reference BLAS, which this directory's libblas.so.3 is (libblas3).
const char* kReferenceBlasDir = "/usr/lib/x86_64-linux-gnu/blas";
}  // namespace

TEST(CpuRuntime, ThisProcessRunsOnAnOptimizedBlas) {
  auto r = tandem::cpu_runtime();
  EXPECT_EQ(r.blas_kind, "openblas") << tandem::cpu_runtime_report(r);
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
  EXPECT_NE(r.output.find("BLAS: openblas ("), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("LibTorch threads: intra-op "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("OpenMP runtime: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("oneDNN: "), std::string::npos) << r.output;
}

TEST(CpuRuntime, ReferenceBlasIsReportedAndWarnedOnce) {
  auto env = run_command({TANDEM_CLI, "env"}, {{"LD_LIBRARY_PATH", kReferenceBlasDir}});
  ASSERT_EQ(env.exit_code, 0) << env.output;
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
