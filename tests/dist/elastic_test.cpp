// Note [Elastic restarts]: a job of 4 ranks that loses one (SIGKILL) restarts on the 3 that remain
// (tandem launch --min_processes 3 --max_restarts 1), resumes from its latest complete checkpoint
// by itself (auto_resume, checkpoints every 3 steps) and ends with the final weights of a job
// taken from 4 to 3 ranks at that checkpoint by hand, bit for bit. A SIGKILL in the middle of a
// save leaves the previous checkpoint, which the restart loads.
#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "../common/launch.h"
#include "../common/subprocess.h"

using tandem::testing::count_of;
using tandem::testing::launch;
using tandem::testing::LaunchOptions;

namespace {

const std::string kWorker = ELASTIC_WORKER;

std::string digest_of(const std::string& output) {
  const auto at = output.find("final_digest ");
  if (at == std::string::npos) return "";
  return output.substr(at + 13, output.find('\n', at) - at - 13);
}

LaunchOptions elastic() {
  return LaunchOptions().flags({"--min_processes", "3", "--max_restarts", "1"}).timeout_s(180);
}

// 4 ranks for 3 steps (one checkpoint), then 3 ranks from it to step 10.
std::string by_hand_digest() {
  const auto project = tandem::testing::temp_path("elastic", "by-hand");
  std::system(("rm -rf " + project).c_str());
  auto first = launch(4, kWorker, {"--project", project, "--steps", "10", "--exit_after", "3"},
                      LaunchOptions().timeout_s(180));
  EXPECT_EQ(first.exit_code, 0) << first.output;
  auto second = launch(3, kWorker, {"--project", project, "--steps", "10"},
                       LaunchOptions().timeout_s(180));
  EXPECT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(count_of(second.output, "world 3 resumed " + project + "/checkpoints/checkpoint_0 step 3"),
            3)
      << second.output;
  std::system(("rm -rf " + project).c_str());
  const auto d = digest_of(second.output);
  EXPECT_FALSE(d.empty()) << second.output;
  return d;
}

}  // namespace

TEST(Elastic, LostRankRestartsOnTheSurvivorsFromTheLatestCheckpoint) {
  const auto expected = by_hand_digest();
  const auto project = tandem::testing::temp_path("elastic", "kill");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(4, kWorker,
                  {"--project", project, "--steps", "10", "--kill_rank", "3", "--kill_after", "5"},
                  elastic());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "killing rank 3 after step 5"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "1 rank(s) lost (rank 3"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "restarting on the 3 that remain (restart 1 of 1)"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "world 3 resumed " + project + "/checkpoints/checkpoint_0 step 3"), 3)
      << r.output;
  EXPECT_EQ(digest_of(r.output), expected) << r.output;
  std::system(("rm -rf " + project).c_str());
}

TEST(Elastic, KilledDuringASaveResumesFromThePreviousCheckpoint) {
  const auto expected = by_hand_digest();
  const auto project = tandem::testing::temp_path("elastic", "save");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(4, kWorker, {"--project", project, "--steps", "10", "--kill_in_save", "2"},
                  elastic());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "killing rank 0 in save 2"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "1 rank(s) lost (rank 0"), 1) << r.output;
  // The save at step 6 never completed: the restart loads the one of step 3.
  EXPECT_EQ(count_of(r.output, "world 3 resumed " + project + "/checkpoints/checkpoint_0 step 3"), 3)
      << r.output;
  EXPECT_EQ(digest_of(r.output), expected) << r.output;
  std::system(("rm -rf " + project).c_str());
}

TEST(Elastic, FewerSurvivorsThanTheMinimumEndTheJob) {
  const auto project = tandem::testing::temp_path("elastic", "minimum");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(3, kWorker,
                  {"--project", project, "--steps", "10", "--kill_rank", "2", "--kill_after", "4"},
                  elastic());
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_EQ(count_of(r.output, "2 remain, fewer than --min_processes 3: not restarting"), 1)
      << r.output;
  std::system(("rm -rf " + project).c_str());
}

TEST(Elastic, MinProcessesNeedsRestartsAndOneMachine) {
  auto r = launch(2, kWorker, {"--project", "/tmp/unused", "--steps", "1"},
                  LaunchOptions().flags({"--min_processes", "1"}).timeout_s(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count_of(r.output, "--max_restarts is 0: give --max_restarts K"), 1) << r.output;
  auto over = launch(2, kWorker, {"--project", "/tmp/unused", "--steps", "1"},
                     LaunchOptions().flags({"--min_processes", "3", "--max_restarts", "1"}).timeout_s(60));
  EXPECT_EQ(over.exit_code, 2) << over.output;
  EXPECT_EQ(count_of(over.output, "--min_processes=3 must be in [0, --num_processes=2]"), 1)
      << over.output;
}
