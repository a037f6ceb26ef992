// `tandem sweep` on real trials: the example GPT swept over learning rate and width under two
// data-parallel processes, a pruned trial, a killed sweep resumed, trials side by side on their
// own cores, a failing trial, refused launch settings; and in-process trials on two ranks.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "../common/launch.h"
#include "../common/subprocess.h"
#include "../common/temp_dir.h"
#include "tandem/runtime.h"
#include "tandem/trials/study.h"

namespace tt = tandem::trials;
using tandem::testing::run_command;
using tandem::testing::TempDir;

namespace {

std::string write(const std::string& path, const std::string& text, bool executable = false) {
  std::ofstream(path) << text;
  if (executable) std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

std::vector<nlohmann::json> end_lines(const std::string& study_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(study_dir + "/trials.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["event"] == "end") out.push_back(j);
  }
  return out;
}

// A seed whose grid order puts `last` at the end, so that the trials before it are on record
// when it runs (what the median rule compares against).
uint64_t seed_with_last(const std::string& yaml_without_seed, const std::string& param,
                        const std::string& last) {
  auto c = tt::parse_study(yaml_without_seed, "", false);
  for (uint64_t seed = 0; seed < 100; ++seed) {
    std::vector<tt::TrialRecord> h;
    for (int n = 0; n < 3; ++n) {
      tt::TrialRecord t;
      t.number = n;
      t.params = *tt::sample(c.sampler, c.space, h, c.direction, seed, n);
      h.push_back(t);
    }
    if (h.back().params.at(param) == last) return seed;
  }
  ADD_FAILURE() << "no seed puts " << last << " last";
  return 0;
}

// A trial program of a few lines: writes `f` = its --x at steps 1..3 into
// <--project_dir>/logs/metrics.jsonl (what a JSONL tracker writes), the cores it may use into
// <dir>/cpus; exits 3 when --x is "bad".
std::string fake_trial(const std::string& dir) {
  return write(dir + "/trial.sh", R"(#!/bin/sh
dir=$2; x=$4
mkdir -p "$dir/logs"
grep Cpus_allowed_list /proc/self/status > "$dir/cpus"
[ "$x" = bad ] && exit 3
for s in 1 2 3; do
  sleep 0.4
  echo "{\"step\": $s, \"wall_time\": 0, \"values\": {\"f\": $x}}" >> "$dir/logs/metrics.jsonl"
done
)", true);
}

}  // namespace

TEST(Sweep, FindsTheGoodRegionOfTrainGptUnderDataParallel) {
  TempDir dir;
  const std::string study = write(dir.str() + "/gpt.yaml", std::string(R"(
program: )") + TRAIN_GPT + R"(
args: [--steps, 30, --layers, 1, --heads, 2, --context, 32, --batch-size, 8, --eval-every, 10,
       --eval-batches, 4, --project_dir, "{trial_dir}", --log_with, jsonl]
launch: {num_processes: 2, cpu: true, num_cpu_threads_per_process: 1, start_method: fork}
space:
  lr: {type: loguniform, low: 1e-5, high: 1}
  width: {type: categorical, choices: [16, 32]}
objective: {metric: eval_loss, mode: min}
trials: 8
sampler: {type: tpe, startup_trials: 4}
seed: 3
study_dir: study
)");
  auto r = run_command({TANDEM_CLI, "sweep", study}, {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ends = end_lines(dir.str() + "/study");
  ASSERT_EQ(ends.size(), 8u) << r.output;
  double best = 1e9, smallest_lr = 1e9, at_smallest = 0;
  std::string best_lr;
  for (auto& e : ends) {
    ASSERT_EQ(e["state"], "complete") << e.dump() << r.output;
    EXPECT_EQ(e["intermediate"].size(), 3u) << "eval_loss at steps 10, 20, 30";
    const double v = e["value"].get<double>();
    const double lr = std::stod(e["params"]["lr"].get<std::string>());
    if (v < best) best = v, best_lr = e["params"]["lr"];
    if (lr < smallest_lr) smallest_lr = lr, at_smallest = v;
  }
  // The known-good region of this model and budget: learning rates between 1e-3 and 0.3 (under
  // 1e-3 it barely learns in 30 steps; 0.8 diverges). Within it the losses are level (3.70-3.78
  // from 0.008 to 0.14 on LibTorch 2.12), so which of them is best differs between builds.
  EXPECT_GE(std::stod(best_lr), 1e-3) << r.output;
  EXPECT_LE(std::stod(best_lr), 0.3) << r.output;
  EXPECT_LT(best, at_smallest - 0.3) << "the best trial learned; the smallest rate barely did";
  char want[64];
  std::snprintf(want, sizeof want, "best: %.6g\n", best);
  EXPECT_NE(r.output.find(want), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("best params: lr=" + best_lr), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::file_size(dir.str() + "/study/objective.png") > 1000);
}

TEST(Sweep, APrunedTrialStopsEarly) {
  TempDir dir;
  std::string body = std::string(R"(
program: )") + TRAIN_GPT + R"(
args: [--steps, 40, --layers, 1, --heads, 2, --width, 32, --context, 32, --batch-size, 8,
       --eval-every, 5, --eval-batches, 4, --project_dir, "{trial_dir}", --log_with, jsonl]
launch: {num_processes: 1, cpu: true}
space:
  lr: {type: categorical, choices: ["0.003", "0.01", "0.00001"]}
objective: {metric: eval_loss, mode: min}
trials: 3
sampler: grid
pruner: {type: median, startup_trials: 2}
study_dir: study
)";
  const uint64_t seed = seed_with_last(body, "lr", "0.00001");
  const std::string study = write(dir.str() + "/p.yaml", body + "seed: " + std::to_string(seed) + "\n");
  auto r = run_command({TANDEM_CLI, "sweep", study}, {}, 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ends = end_lines(dir.str() + "/study");
  ASSERT_EQ(ends.size(), 3u);
  for (auto& e : ends) {
    const auto lr = e["params"]["lr"].get<std::string>();
    const int64_t last_step = e["intermediate"].back()[0].get<int64_t>();
    if (lr == "0.00001") {
      EXPECT_EQ(e["state"], "pruned") << r.output;
      EXPECT_LT(last_step, 40) << "it stopped before its 40 steps";
    } else {
      EXPECT_EQ(e["state"], "complete") << r.output;
      EXPECT_EQ(last_step, 40);
    }
  }
}

TEST(Sweep, AKilledSweepResumesWithoutRepeatingAFinishedTrial) {
  TempDir dir;
  const std::string program = fake_trial(dir.str());
  const std::string study = write(dir.str() + "/r.yaml", "program: " + program + R"(
args: [--project_dir, "{trial_dir}"]
launch: {num_processes: 1, cpu: true}
space:
  x: {type: uniform, low: 0, high: 1}
objective: {metric: f, mode: max}
trials: 5
sampler: random
study_dir: study
)");
  pid_t pid = fork();
  if (pid == 0) {
    int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    execl(TANDEM_CLI, TANDEM_CLI, "sweep", study.c_str(), nullptr);
    _exit(127);
  }
  const std::string sd = dir.str() + "/study";
  for (int i = 0; i < 600 && end_lines(sd).size() < 2; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // inside trial 2
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  auto before = end_lines(sd);
  ASSERT_GE(before.size(), 2u);
  ASSERT_LT(before.size(), 5u);
  auto r = run_command({TANDEM_CLI, "sweep", study}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(std::to_string(before.size()) + " trial(s) on record"), std::string::npos) << r.output;
  auto after = end_lines(sd);
  ASSERT_EQ(after.size(), 5u) << r.output;
  std::set<int> numbers;
  for (auto& e : after) EXPECT_TRUE(numbers.insert(e["trial"].get<int>()).second) << "trial twice: " << e;
  EXPECT_EQ(numbers, (std::set<int>{0, 1, 2, 3, 4}));
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(after[i], before[i]) << "finished trials stay as they were";
  for (auto& e : after) EXPECT_EQ(e["state"], "complete");
}

TEST(Sweep, TrialsSideBySideGetDisjointCoresAndAFailureIsRecorded) {
  if (tandem::usable_cpus().size() < 2) GTEST_SKIP() << "needs 2 cores";
  TempDir dir;
  const std::string program = fake_trial(dir.str());
  const std::string study = write(dir.str() + "/p.yaml", "program: " + program + R"(
args: [--project_dir, "{trial_dir}"]
launch: {num_processes: 1, cpu: true}
space:
  x: {type: categorical, choices: ["0.5", "0.25", bad]}
objective: {metric: f, mode: max}
trials: 3
sampler: grid
parallel: 2
study_dir: study
)");
  auto r = run_command({TANDEM_CLI, "sweep", study}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ends = end_lines(dir.str() + "/study");
  ASSERT_EQ(ends.size(), 3u) << r.output;
  std::map<std::string, std::string> state;
  for (auto& e : ends) state[e["params"]["x"]] = e["state"];
  EXPECT_EQ(state["bad"], "failed");
  EXPECT_EQ(state["0.5"], "complete");
  EXPECT_EQ(state["0.25"], "complete");
  EXPECT_NE(r.output.find("exit code 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("best: 0.5\n"), std::string::npos) << r.output;
  // Two trials ran at once, each on its own core.
  const auto second_start = r.output.find("trial 1 started");
  ASSERT_NE(second_start, std::string::npos);
  EXPECT_LT(second_start, r.output.find("complete:")) << r.output;
  std::ifstream c0(dir.str() + "/study/trial_0/cpus"), c1(dir.str() + "/study/trial_1/cpus");
  std::string a, b;
  std::getline(c0, a), std::getline(c1, b);
  EXPECT_FALSE(a.empty());
  EXPECT_NE(a, b);
}

TEST(Sweep, RefusesWhatCannotTakeEffect) {
  TempDir dir;
  const std::string program = fake_trial(dir.str());
  auto study = [&](const std::string& extra, const std::string& launch) {
    return write(dir.str() + "/bad.yaml", "program: " + program + R"(
args: [--project_dir, "{trial_dir}"]
launch: )" + launch + R"(
space:
  x: {type: uniform, low: 0, high: 1}
objective: {metric: f, mode: max}
)" + extra);
  };
  auto r = run_command({TANDEM_CLI, "sweep", study("", "{num_processes: 2, cpu: true, zero_stage: 7}")}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("`launch` settings refused by tandem launch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("zero_stage"), std::string::npos) << r.output;
  r = run_command({TANDEM_CLI, "sweep", study("trial: 4\n", "{cpu: true}")}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("unknown key `trial`"), std::string::npos) << r.output;
  r = run_command({TANDEM_CLI, "sweep", study("parallel: 64\n", "{cpu: true}")}, {}, 60);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("lower `parallel`"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir.str() + "/study/trials.jsonl")) << "nothing ran";
}

TEST(InProcessTrials, TwoRanksTakeTheSameValuesAndTheSameDecisions) {
  TempDir dir;
  std::string body = R"(
space:
  lr: {type: categorical, choices: ["0.1", "0.05", "0.000001"]}
objective: {metric: loss, mode: min}
trials: 3
sampler: grid
pruner: {type: median, startup_trials: 2}
study_dir: )" + dir.str() + "/study\n";
  const uint64_t seed = seed_with_last(body, "lr", "0.000001");
  const std::string study = write(dir.str() + "/s.yaml", body + "seed: " + std::to_string(seed) + "\n");
  auto r = tandem::testing::launch(2, TRIALS_WORKER, {study});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<int, std::vector<std::string>> lines;
  std::istringstream in(r.output);
  std::string line;
  while (std::getline(in, line)) {
    auto at = line.rfind("rank ");
    if (at == std::string::npos || line.find(" trial ", at) == std::string::npos) continue;
    line = line.substr(at);
    int rank = line[5] - '0';
    lines[rank].push_back(line.substr(7));
  }
  ASSERT_EQ(lines[0].size(), 4u) << r.output;
  EXPECT_EQ(lines[0], lines[1]) << r.output;
  bool pruned_small = false;
  for (auto& l : lines[0]) pruned_small |= l.find("lr 0.000001 pruned at step") != std::string::npos;
  EXPECT_TRUE(pruned_small) << r.output;
  auto ends = end_lines(dir.str() + "/study");
  EXPECT_EQ(ends.size(), 3u) << "rank 0 alone writes the results";
}
