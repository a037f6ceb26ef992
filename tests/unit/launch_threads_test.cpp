// The OpenMP environment tandem launch gives its ranks (Note [Threads per rank]): the default
// thread count, and the user's settings winning over it.
#include <c10/core/thread_pool.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "tandem/launch/launcher.h"

using tandem::launch::default_threads_per_process;
using tandem::launch::describe_plan;
using tandem::launch::LaunchOptions;
using tandem::launch::make_plan;

namespace {

int libtorch_default() {
  return static_cast<int>(c10::TaskThreadPoolBase::defaultNumThreads());
}

LaunchOptions one_process() {
  return LaunchOptions().num_processes(1).main_process_port(1);
}

}  // namespace

// Never more threads than LibTorch takes in a program started by hand, never more than the
// process's share of the cores, never fewer than 1.
TEST(LaunchThreads, DefaultIsTheShareCappedByLibTorchsOwnChoice) {
  const int by_hand = std::max(1, libtorch_default());
  EXPECT_EQ(default_threads_per_process(1, 1), 1);
  EXPECT_EQ(default_threads_per_process(2, 4), 1);
  EXPECT_EQ(default_threads_per_process(0, 1), 1);
  EXPECT_EQ(default_threads_per_process(1024, 1), by_hand);
  EXPECT_EQ(default_threads_per_process(2, 1), std::min(2, by_hand));
  EXPECT_EQ(default_threads_per_process(8, 2), std::min(4, by_hand));
}

// The issue-21 case: one process on the launcher's cores gets what it would take by hand.
TEST(LaunchThreads, OneProcessGetsWhatItTakesByHand) {
  const int cores = static_cast<int>(tandem::launch::usable_cpus().size());
  auto plan = make_plan(one_process(), {"p"}, {});
  const std::string want = std::to_string(default_threads_per_process(cores, 1));
  EXPECT_EQ(plan[0].env.at("OMP_NUM_THREADS"), want);
  EXPECT_EQ(plan[0].env.at("TANDEM_NUM_CPU_THREADS"), want);
  EXPECT_LE(std::stoi(want), std::max(1, libtorch_default()));
  EXPECT_NE(describe_plan(plan).find("OMP_NUM_THREADS=" + want + "\n"), std::string::npos);
}

// The wait policy stays OpenMP's or the user's: the launcher sets none (PASSIVE costs a third
// of an idle machine's speed), so an OMP_WAIT_POLICY or GOMP_SPINCOUNT of the user's reaches the
// ranks as it is, inherited or with --env.
TEST(LaunchThreads, WaitPolicyIsTheUsers) {
  for (int threads : {0, 1, 2}) {
    auto plan = make_plan(one_process().num_cpu_threads_per_process(threads), {"p"}, {});
    EXPECT_EQ(plan[0].env.count("OMP_WAIT_POLICY"), 0u);
    EXPECT_EQ(plan[0].env.count("GOMP_SPINCOUNT"), 0u);
  }
  auto plan = make_plan(one_process().extra_env({{"OMP_WAIT_POLICY", "PASSIVE"}}), {"p"},
                        {{"OMP_WAIT_POLICY", "ACTIVE"}});
  EXPECT_EQ(plan[0].env.at("OMP_WAIT_POLICY"), "PASSIVE");
  EXPECT_NE(describe_plan(plan).find("OMP_WAIT_POLICY=PASSIVE"), std::string::npos);  // --dry_run
}

// The user's OMP_NUM_THREADS wins over the default, from the environment or from --env;
// --num_cpu_threads_per_process wins over both.
TEST(LaunchThreads, UsersThreadCountWins) {
  auto plan = make_plan(one_process(), {"p"}, {{"OMP_NUM_THREADS", "3"}});
  EXPECT_EQ(plan[0].env.count("OMP_NUM_THREADS"), 0u);  // inherited as it is
  EXPECT_EQ(plan[0].env.at("TANDEM_NUM_CPU_THREADS"), "3");
  plan = make_plan(one_process().extra_env({{"OMP_NUM_THREADS", "3"}}), {"p"}, {});
  EXPECT_EQ(plan[0].env.at("OMP_NUM_THREADS"), "3");
  EXPECT_EQ(plan[0].env.at("TANDEM_NUM_CPU_THREADS"), "3");
  plan = make_plan(one_process().num_cpu_threads_per_process(5), {"p"}, {{"OMP_NUM_THREADS", "3"}});
  EXPECT_EQ(plan[0].env.at("OMP_NUM_THREADS"), "5");
  EXPECT_EQ(plan[0].env.at("TANDEM_NUM_CPU_THREADS"), "5");
}
