// `tandem launch --max_restarts`: a rank crashes once in the middle of training, every rank is
// started again, resumes from its state file, and ends exactly where an uninterrupted run does.
#include <gtest/gtest.h>

#include <regex>

#include "../common/launch.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;

namespace {

const std::string kWorker = RESTART_WORKER;

std::string temp_dir() {
  char tmpl[] = "/tmp/tandem-restart-XXXXXX";
  return mkdtemp(tmpl);
}

// The "final ..." line of each rank, in rank order.
std::vector<std::string> finals(const std::string& out, int n) {
  std::vector<std::string> lines;
  for (int r = 0; r < n; ++r) {
    std::smatch m;
    std::regex re("\\[rank " + std::to_string(r) + "\\] (final [^\\n]*)");
    lines.push_back(std::regex_search(out, m, re) ? m[1].str() : "");
  }
  return lines;
}

// The launcher's own thread count, two seconds' grace for the other rank when one fails, then
// `flags`; 90 s per job.
LaunchOptions with_flags(std::vector<std::string> flags = {}) {
  flags.insert(flags.begin(), {"--grace_period", "2"});
  return LaunchOptions().threads_per_process(0).flags(std::move(flags)).timeout_s(90);
}

}  // namespace

TEST(Restart, CrashedRankResumesAndEndsLikeAnUninterruptedRun) {
  const std::map<std::string, std::string> env{{"TANDEM_CONFIG_HOME", temp_dir()}};
  const std::string clean_dir = temp_dir(), crash_dir = temp_dir();
  // 40 steps in `clean_dir`.
  auto clean = launch(2, kWorker, {clean_dir, "40"}, with_flags().env(env));
  ASSERT_EQ(clean.exit_code, 0) << clean.output;

  // Rank 1 crashes at step 17 of 40 on the first attempt.
  auto crashed =
      launch(2, kWorker, {crash_dir, "40", "17"}, with_flags({"--max_restarts", "1"}).env(env));
  ASSERT_FALSE(crashed.timed_out) << crashed.output;
  ASSERT_EQ(crashed.exit_code, 0) << crashed.output;
  EXPECT_EQ(count_of(crashed.output, "rank 1 crashes at step 17"), 1) << crashed.output;
  EXPECT_NE(crashed.output.find("restarting all ranks (restart 1 of 1)"), std::string::npos)
      << crashed.output;
  // Both ranks resume at the step they agree on: 17 (steps 0-16 done), or 16 should rank 0 have
  // been stopped between its allreduce and its save.
  EXPECT_EQ(count_of(crashed.output, "resumes at step 17") +
                count_of(crashed.output, "resumes at step 16"),
            2)
      << crashed.output;

  auto want = finals(clean.output, 2), got = finals(crashed.output, 2);
  ASSERT_NE(want[0], "") << clean.output;
  EXPECT_EQ(want[0], want[1]);  // data parallel: every rank holds the same weights
  EXPECT_EQ(got, want) << "resumed training must equal the uninterrupted run bitwise\n"
                       << crashed.output;
  std::system(
      ("rm -rf " + clean_dir + " " + crash_dir + " " + env.at("TANDEM_CONFIG_HOME")).c_str());
}

TEST(Restart, WithoutRestartsTheCrashFailsTheJob) {
  const std::string dir = temp_dir();
  auto r = launch(2, kWorker, {dir, "40", "5"}, with_flags().env({{"TANDEM_CONFIG_HOME", dir}}));
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("rank 1 (pid"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
  std::system(("rm -rf " + dir).c_str());
}
