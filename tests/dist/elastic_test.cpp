// Note [Elastic restarts]: a job of 4 ranks that loses one (SIGKILL) restarts on the 3 that remain
// (tandem launch --min_processes 3 --max_restarts 1), resumes from its latest complete checkpoint
// by itself (auto_resume, checkpoints every 3 steps) and ends with the final weights of a job
// taken from 4 to 3 ranks at that checkpoint by hand, bit for bit. A SIGKILL in the middle of a
// save leaves the previous checkpoint, which the restart loads.
#include <gtest/gtest.h>

#include <chrono>
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

// ---- Note [Preemption] ------------------------------------------------------------------------

namespace {

// 2 ranks, 10 steps, checkpoints every 3 (and on preemption: auto_resume turns it on).
std::string uninterrupted_digest(const std::vector<std::string>& flags) {
  const auto project = tandem::testing::temp_path("preempt", "whole");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(2, kWorker, {"--project", project, "--steps", "10"},
                  LaunchOptions().flags(flags).timeout_s(180));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::system(("rm -rf " + project).c_str());
  const auto d = digest_of(r.output);
  EXPECT_FALSE(d.empty()) << r.output;
  return d;
}

// The step the job was preempted at, from "preempted at step <k>: saved <dir>".
int preempted_step(const std::string& output) {
  const auto at = output.find("preempted at step ");
  if (at == std::string::npos) return -1;
  return std::stoi(output.substr(at + 18));
}

// A SIGTERM after step 4 (to the launcher, which forwards it, or to rank 1 alone): every rank
// finishes its step, they save together and exit 75; the same command again resumes from that
// checkpoint and ends with the uninterrupted run's weights, bit for bit.
void preempt_and_resume(const std::vector<std::string>& flags) {
  const auto expected = uninterrupted_digest(flags);
  for (const bool to_launcher : {true, false}) {
    SCOPED_TRACE(to_launcher ? "SIGTERM to the launcher" : "SIGTERM to rank 1");
    const auto project = tandem::testing::temp_path("preempt", to_launcher ? "launcher" : "rank");
    std::system(("rm -rf " + project).c_str());
    std::vector<std::string> args{"--project", project, "--steps", "10", "--preempt_after", "4"};
    if (to_launcher) args.push_back("--preempt_launcher");
    else args.insert(args.end(), {"--preempt_rank", "1"});
    auto first = launch(2, kWorker, args, LaunchOptions().flags(flags).timeout_s(180));
    EXPECT_EQ(first.exit_code, 75) << first.output;
    EXPECT_EQ(count_of(first.output, "tandem launch: the job was preempted: its ranks saved a "
                                     "checkpoint and stopped; exit code 75"),
              1)
        << first.output;
    const int k = preempted_step(first.output);
    EXPECT_GE(k, 5) << first.output;  // the signal came after step 4: a later boundary saw it
    EXPECT_EQ(count_of(first.output, "final_digest"), 0) << first.output;
    const auto dir = project + "/checkpoints/checkpoint_" + std::to_string((k - 1) / 3);
    EXPECT_EQ(count_of(first.output, "preempted at step " + std::to_string(k) + ": saved " + dir), 1)
        << first.output;

    auto second = launch(2, kWorker, {"--project", project, "--steps", "10"},
                         LaunchOptions().flags(flags).timeout_s(180));
    EXPECT_EQ(second.exit_code, 0) << second.output;
    EXPECT_EQ(count_of(second.output, "world 2 resumed " + dir + " step " + std::to_string(k)), 2)
        << second.output;
    EXPECT_EQ(digest_of(second.output), expected) << second.output;
    std::system(("rm -rf " + project).c_str());
  }
}

}  // namespace

TEST(Preemption, DataParallelSavesOnSigtermAndResumesBitwise) { preempt_and_resume({}); }

TEST(Preemption, ZeroThreeSavesOnSigtermAndResumesBitwise) {
  preempt_and_resume({"--use_deepspeed", "--zero_stage", "3"});
}

// A second SIGTERM to the launcher while the preemption's save is being written ends the job at
// once (SIGKILL): the cut save is never a checkpoint, and the job resumes from the one before.
TEST(Preemption, ASecondSignalDuringTheSaveLeavesThePreviousCheckpoint) {
  const auto expected = uninterrupted_digest({});
  const auto project = tandem::testing::temp_path("preempt", "twice");
  std::system(("rm -rf " + project).c_str());
  auto first = launch(2, kWorker,
                      {"--project", project, "--steps", "10", "--preempt_after", "4",
                       "--preempt_launcher", "--signal_in_save"},
                      LaunchOptions().timeout_s(180));
  EXPECT_EQ(first.exit_code, 128 + 15) << first.output;
  EXPECT_EQ(count_of(first.output, "second signal in save"), 1) << first.output;
  EXPECT_EQ(count_of(first.output, "received signal 15 (SIGTERM)"), 2) << first.output;
  auto second = launch(2, kWorker, {"--project", project, "--steps", "10"},
                       LaunchOptions().timeout_s(180));
  EXPECT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(count_of(second.output, "world 2 resumed " + project + "/checkpoints/checkpoint_0 step 3"), 2)
      << second.output;
  EXPECT_EQ(digest_of(second.output), expected) << second.output;
  std::system(("rm -rf " + project).c_str());
}

// --preemption_signal USR1 (SLURM's --signal=USR1@90): the launcher forwards it as SIGTERM, the
// ranks save on it; a name that is not a signal a process can catch is refused.
TEST(Preemption, APreemptionSignalOfTheClusterIsForwardedAndSavedOn) {
  const auto project = tandem::testing::temp_path("preempt", "usr1");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(2, kWorker,
                  {"--project", project, "--steps", "10", "--preempt_after", "4",
                   "--preempt_launcher", "--preempt_signal", "USR1"},
                  LaunchOptions().flags({"--preemption_signal", "USR1"}).timeout_s(180));
  EXPECT_EQ(r.exit_code, 75) << r.output;
  EXPECT_EQ(count_of(r.output, "received signal 10 (SIGUSR1), forwarding it to every rank (a rank that "
                               "checkpoints on preemption saves and stops; SIGKILL in 30 s"),
            1)
      << r.output;
  EXPECT_EQ(count_of(r.output, "preempted (SIGUSR1) at step"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "tandem launch: the job was preempted"), 1) << r.output;
  std::system(("rm -rf " + project).c_str());
  auto bad = launch(2, kWorker, {"--project", project, "--steps", "1"},
                    LaunchOptions().flags({"--preemption_signal", "KILL"}).timeout_s(60));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_EQ(count_of(bad.output, "--preemption_signal=KILL: expected a signal a process can catch"), 1)
      << bad.output;
}

// ---- Note [Flight recorder] -------------------------------------------------------------------

namespace {

bool has_file(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

}  // namespace

// Rank 2 of 3 stops after step 4 (its recorder dumped on SIGUSR2); the others' next collective
// fails and dumps theirs; tandem doctor names rank 2 as behind and where the others were.
TEST(FlightRecorder, ARankThatStoppedIsNamedBehindTheOthers) {
  const auto project = tandem::testing::temp_path("flight", "behind");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(3, kWorker,
                  {"--project", project, "--steps", "10", "--stop_rank", "2", "--stop_after", "4",
                   "--timeout_s", "30"},
                  LaunchOptions().timeout_s(180));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "rank 2 stops after step 4"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "tandem: flight recorder written to " + project + "/flight/rank2.json"), 1)
      << r.output;
  for (int k = 0; k < 3; ++k)
    EXPECT_TRUE(has_file(project + "/flight/rank" + std::to_string(k) + ".json")) << r.output;
  auto doctor = tandem::testing::run_command({TANDEM_CLI, "doctor", project + "/flight"});
  EXPECT_EQ(doctor.exit_code, 0) << doctor.output;
  EXPECT_EQ(count_of(doctor.output, "3 of 3 ranks' flight records in " + project + "/flight"), 1)
      << doctor.output;
  EXPECT_GE(count_of(doctor.output, ": rank 2 is behind: its last collective is #"), 1)
      << doctor.output;
  EXPECT_GE(count_of(doctor.output, "while ranks 0 and 1 reached #"), 1) << doctor.output;
  EXPECT_EQ(count_of(doctor.output, "rank 0 is behind"), 0) << doctor.output;
  std::system(("rm -rf " + project).c_str());
}

// Note [Heartbeat]: rank 2 of 3 stops itself with SIGSTOP after step 4, and ranks 0 and 1 wait
// in their next collective, whose timeout is 120 s. The launcher sees rank 2's heartbeat go stale
// and ends the job within the heartbeat timeout + 10 s of the stop, naming rank 2 and the
// collective the others wait in; the ranks that run dump their flight recorders first.
void a_stopped_rank_is_named(const std::vector<std::string>& flags, const std::string& op) {
  const auto project = tandem::testing::temp_path("heartbeat", "stopped");
  std::system(("rm -rf " + project).c_str());
  const double timeout_s = 5;
  std::vector<std::string> all = flags;
  all.insert(all.end(), {"--heartbeat_timeout_s", "5"});
  auto r = launch(3, kWorker,
                  {"--project", project, "--steps", "10", "--freeze_rank", "2", "--freeze_after",
                   "4", "--freeze", "sigstop", "--timeout_s", "120"},
                  LaunchOptions().flags(all).timeout_s(180));
  const double ended = std::chrono::duration<double>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;  // the named rank's end: SIGKILL
  const auto at = r.output.find("rank 2 freezes (sigstop) after step 4 at ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const double frozen = std::stod(r.output.substr(at + 41, r.output.find('\n', at) - at - 41));
  EXPECT_LE(ended - frozen, timeout_s + 10) << r.output;
  EXPECT_GE(ended - frozen, timeout_s - 1) << r.output;  // not before the timeout
  EXPECT_EQ(count_of(r.output, "tandem launch: rank 2 (pid "), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "stopped running: its heartbeat is "), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "s old (--heartbeat_timeout_s 5); when it last beat, it "), 1)
      << r.output;
  for (const char* rank : {"Rank 0 waits in #", "Rank 1 waits in #"})
    EXPECT_EQ(count_of(r.output, std::string(rank)), 1) << r.output;
  EXPECT_GE(count_of(r.output, ") in group world (for "), 2) << r.output;
  EXPECT_GE(count_of(r.output, " " + op + " ("), 2) << r.output;
  EXPECT_EQ(count_of(r.output, "tandem doctor " + project + "/flight; stopping the job"), 1)
      << r.output;
  for (int k = 0; k < 2; ++k)
    EXPECT_TRUE(has_file(project + "/flight/rank" + std::to_string(k) + ".json")) << r.output;
  std::system(("rm -rf " + project).c_str());
}

TEST(Heartbeat, AStoppedRankIsNamedWithinTheTimeoutUnderDataParallel) {
  a_stopped_rank_is_named({}, "allreduce");
}

TEST(Heartbeat, AStoppedRankIsNamedWithinTheTimeoutUnderZeroThree) {
  a_stopped_rank_is_named({"--use_deepspeed", "--zero_stage", "3"}, "all-gather");
}

// Rank 1 of 2 sleeps for good after step 4, alive: its heartbeat goes on, and rank 0 waits in a
// collective rank 1 never joins. Named as a hang, with rank 1 not in it; under --max_restarts 1
// the job restarts from its checkpoint and finishes.
TEST(Heartbeat, ARankThatNeverJoinsIsNamedAndTheJobRestarts) {
  const auto project = tandem::testing::temp_path("heartbeat", "asleep");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(2, kWorker,
                  {"--project", project, "--steps", "8", "--freeze_rank", "1", "--freeze_after",
                   "4", "--freeze", "sleep", "--timeout_s", "120"},
                  LaunchOptions()
                      .flags({"--heartbeat_timeout_s", "4", "--max_restarts", "1"})
                      .timeout_s(180));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "rank 1 freezes (sleep) after step 4"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "tandem launch: rank 0 waited in a collective for longer than "
                               "--heartbeat_timeout_s 4 s, beginning or ending no other: a hang. "
                               "rank 1 (pid "),
            1)
      << r.output;
  EXPECT_EQ(count_of(r.output, ": it is in no collective; its last: #"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "(look at its stack: gdb -p "), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "Rank 0 waits in #"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "restarting all ranks (restart 1 of 1)"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "world 2 resumed " + project + "/checkpoints/checkpoint_"), 2)
      << r.output;
  EXPECT_FALSE(digest_of(r.output).empty()) << r.output;
  std::system(("rm -rf " + project).c_str());
}

// Rank 1 reduces 9 elements where rank 0 reduces 8: both dump when the collective fails, and
// tandem doctor names the sequence number and both calls.
TEST(FlightRecorder, DifferentSizesAtOneCollectiveAreNamed) {
  const auto project = tandem::testing::temp_path("flight", "mismatch");
  std::system(("rm -rf " + project).c_str());
  auto r = launch(2, kWorker,
                  {"--project", project, "--steps", "10", "--mismatch_rank", "1",
                   "--mismatch_after", "2", "--timeout_s", "5"},
                  LaunchOptions().timeout_s(180));
  EXPECT_NE(r.exit_code, 0) << r.output;
  auto doctor = tandem::testing::run_command({TANDEM_CLI, "doctor", project + "/flight"});
  EXPECT_EQ(doctor.exit_code, 0) << doctor.output;
  EXPECT_EQ(count_of(doctor.output, "the ranks called different collectives: rank 0 allreduce "
                                    "(8 x Float); rank 1 allreduce (9 x Float);"),
            1)
      << r.output << doctor.output;
  auto none = tandem::testing::run_command({TANDEM_CLI, "doctor", project + "/no-such"});
  EXPECT_NE(none.exit_code, 0) << none.output;
  EXPECT_EQ(count_of(none.output, "is not a directory (expected the flight folder of a job"), 1)
      << none.output;
  std::system(("rm -rf " + project).c_str());
}
