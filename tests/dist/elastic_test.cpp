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

#include <unistd.h>

#include "../common/launch.h"
#include "../common/subprocess.h"
#include "../common/two_hosts.h"

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

// 4 ranks for 3 steps (one checkpoint), then `then` ranks from it to step 10.
std::string by_hand_digest(int then = 3) {
  const auto project = tandem::testing::temp_path("elastic", "by-hand");
  std::system(("rm -rf " + project).c_str());
  auto first = launch(4, kWorker, {"--project", project, "--steps", "10", "--exit_after", "3"},
                      LaunchOptions().timeout_s(180));
  EXPECT_EQ(first.exit_code, 0) << first.output;
  auto second = launch(then, kWorker, {"--project", project, "--steps", "10"},
                       LaunchOptions().timeout_s(180));
  EXPECT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(count_of(second.output, "world " + std::to_string(then) + " resumed " + project +
                                        "/checkpoints/checkpoint_0 step 3"),
            then)
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

TEST(Elastic, MinimumSizesAreChecked) {
  auto r = launch(2, kWorker, {"--project", "/tmp/unused", "--steps", "1"},
                  LaunchOptions().flags({"--min_processes", "1"}).timeout_s(60));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count_of(r.output, "--max_restarts is 0: give --max_restarts K"), 1) << r.output;
  auto over = launch(2, kWorker, {"--project", "/tmp/unused", "--steps", "1"},
                     LaunchOptions().flags({"--min_processes", "3", "--max_restarts", "1"}).timeout_s(60));
  EXPECT_EQ(over.exit_code, 2) << over.output;
  EXPECT_EQ(count_of(over.output, "--min_processes=3 must be in [0, --num_processes=2]"), 1)
      << over.output;
  auto machines = launch(2, kWorker, {"--project", "/tmp/unused", "--steps", "1"},
                         LaunchOptions().flags({"--min_machines", "2"}).timeout_s(60));
  EXPECT_EQ(machines.exit_code, 2) << machines.output;
  EXPECT_EQ(count_of(machines.output, "--min_machines=2 must be in [0, --num_machines=1]"), 1)
      << machines.output;
}

// Note [Elastic machines]: two machines of 2 ranks (network namespaces joined by a veth pair);
// machine 1 is lost after step 5 (its launcher and ranks killed). Machine 0's launcher meets
// nobody else at the next attempt's rendezvous (--rdzv_timeout 5), runs alone on 2 ranks and
// resumes from the checkpoint of step 3: the weights of a job taken from 4 ranks to 2 at step 3
// by hand.
TEST(Elastic, LostMachineRestartsTheJobOnTheMachinesThatRemain) {
  if (geteuid() != 0) GTEST_SKIP() << "creating network namespaces needs root (ip netns add)";
  tandem::testing::TwoHosts hosts;
  const std::string why = hosts.setup();
  if (!hosts.created())
    GTEST_SKIP() << "network namespaces are not permitted here, so two machines cannot be "
                    "simulated ("
                 << why << ")";
  ASSERT_EQ(why, "") << "setting up the two hosts failed";
  const auto expected = by_hand_digest(2);
  const auto project = tandem::testing::temp_path("elastic", "machines");
  std::system(("rm -rf " + project).c_str());
  auto machine = [&](int rank) {
    return hosts.in(rank, {TANDEM_CLI, "launch", "--num_machines", "2", "--machine_rank",
                           std::to_string(rank), "--main_process_ip", "10.231.0.1",
                           "--main_process_port", "29500", "--num_processes", "4", "--cpu",
                           "--num_cpu_threads_per_process", "1", "--grace_period", "2",
                           "--max_restarts", "1", "--min_machines", "1", "--rdzv_timeout", "5",
                           kWorker, "--project", project, "--steps", "10", "--kill_rank", "3",
                           "--kill_after", "5", "--kill_machine"});
  };
  auto [r0, r1] = tandem::testing::run_two_machines(machine(0), machine(1), 1.0, 60, 180);
  EXPECT_EQ(r0.exit_code, 0) << r0.output << "\n---- machine 1:\n" << r1.output;
  EXPECT_EQ(r1.exit_code, 128 + 9) << r1.output;
  EXPECT_EQ(count_of(r1.output, "killing rank 3 and its machine's launcher after step 5"), 1)
      << r1.output;
  EXPECT_EQ(count_of(r0.output, "attempt 1 runs on 1 of 2 machines (0); this one is machine 0"), 1)
      << r0.output;
  EXPECT_EQ(count_of(r0.output, "world 2 resumed " + project + "/checkpoints/checkpoint_0 step 3"),
            2)
      << r0.output;
  EXPECT_EQ(digest_of(r0.output), expected) << r0.output;
  std::system(("rm -rf " + project).c_str());
}
