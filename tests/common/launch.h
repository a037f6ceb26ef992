// Starts a program on N ranks through `tandem launch --num_processes N --cpu`: the one way the
// multi-process tests start their workers. The test target defines TANDEM_CLI, the path of the
// `tandem` binary (tandem_dist_tests in tests/CMakeLists.txt does).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "subprocess.h"

#ifndef TANDEM_CLI
#error "tests/common/launch.h needs TANDEM_CLI, the path of the tandem binary"
#endif

namespace tandem::testing {

/// How `launch` starts the ranks.
///
/// Example:
///   auto r = launch(2, kWorker, {"train", "--steps", "4"},
///                   LaunchOptions().flags({"--use_deepspeed", "--zero_stage", "3"}).timeout_s(240));
class LaunchOptions {
 public:
  /// Launcher flags, placed after `--cpu` and the thread count, before the program.
  LaunchOptions& flags(std::vector<std::string> v) {
    flags_ = std::move(v);
    return *this;
  }
  const std::vector<std::string>& flags() const { return flags_; }

  /// `--num_cpu_threads_per_process`: 1 by default (up to 4 ranks share the 2 cores the suite
  /// runs on); 0 passes no flag and leaves the count to the launcher.
  LaunchOptions& threads_per_process(int v) {
    threads_per_process_ = v;
    return *this;
  }
  int threads_per_process() const { return threads_per_process_; }

  /// `--start_method`: by default "fork" for 2 ranks or more (Note [Fork start]: the worker
  /// starts once and forks its ranks, which saves loading LibTorch in every rank) and "exec" for
  /// one (a fork would only add the server's exit), or TANDEM_TEST_START_METHOD when the suite
  /// runs with it set (to compare the two); "exec" for a test of how ranks start by themselves.
  LaunchOptions& start_method(std::string v) {
    start_method_ = std::move(v);
    return *this;
  }
  /// The method for `n` ranks.
  std::string start_method(int n) const {
    if (!start_method_.empty()) return start_method_;
    const char* v = std::getenv("TANDEM_TEST_START_METHOD");
    if (v && *v) return v;
    return n > 1 ? "fork" : "exec";
  }

  /// Variables added to the test's own environment for the launcher and its ranks.
  LaunchOptions& env(std::map<std::string, std::string> v) {
    env_ = std::move(v);
    return *this;
  }
  const std::map<std::string, std::string>& env() const { return env_; }

  /// The limit on the whole job, in seconds; past it every process of the job is killed.
  LaunchOptions& timeout_s(double v) {
    timeout_s_ = v;
    return *this;
  }
  double timeout_s() const { return timeout_s_; }

 private:
  std::vector<std::string> flags_;
  int threads_per_process_ = 1;
  std::string start_method_;  // empty: by the number of ranks
  std::map<std::string, std::string> env_;
  double timeout_s_ = 120;
};

/// The command line `launch` runs: `tandem launch --num_processes n --cpu
/// [--num_cpu_threads_per_process t] --start_method m FLAGS... program ARGS...` (for a test that
/// starts it itself).
inline std::vector<std::string> launch_command(int n, const std::string& program,
                                               const std::vector<std::string>& args = {},
                                               const LaunchOptions& options = {}) {
  std::vector<std::string> argv{TANDEM_CLI, "launch", "--num_processes", std::to_string(n), "--cpu"};
  if (options.threads_per_process() > 0)
    argv.insert(argv.end(),
                {"--num_cpu_threads_per_process", std::to_string(options.threads_per_process())});
  argv.insert(argv.end(), {"--start_method", options.start_method(n)});
  argv.insert(argv.end(), options.flags().begin(), options.flags().end());
  argv.push_back(program);
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

/// Runs `program args...` on `n` ranks and waits for the job: its exit code and every rank's
/// output, each line prefixed "[rank r] " by the launcher.
inline RunResult launch(int n, const std::string& program, const std::vector<std::string>& args = {},
                        const LaunchOptions& options = {}) {
  return run_command(launch_command(n, program, args, options), options.env(), options.timeout_s());
}

/// One job of `launch_jobs`: the worker's arguments and the launch options it would have had
/// alone (flags, environment, timeout). `may_fail`: a refusal that every rank makes alike, after
/// which the launch's next job runs (the job's exit code says how it ended); a job that fails
/// on some ranks only would leave the others waiting for it.
struct Job {
  std::vector<std::string> args;
  LaunchOptions options;
  bool may_fail = false;
};

namespace detail {

// Variables that say where a rank is in this launch, not how it is configured: the one real
// launch of `launch_jobs` sets them, never a job.
inline bool identifies_the_launch(const std::string& key) {
  static const char* const kKeys[] = {
      "RANK",           "LOCAL_RANK",           "WORLD_SIZE",           "LOCAL_WORLD_SIZE",
      "GROUP_RANK",     "NODE_RANK",            "MASTER_ADDR",          "MASTER_PORT",
      "TANDEM_LAUNCHER", "TANDEM_RESTART_COUNT", "TANDEM_ERROR_FILE",   "TANDEM_HEARTBEAT_FILE",
      "CUDA_VISIBLE_DEVICES"};
  for (const char* k : kKeys)
    if (key == k) return true;
  return key.rfind("TORCHELASTIC_", 0) == 0;
}

// Variables of what the launcher itself does (watching heartbeats, forwarding a signal, binding
// cores): a job cannot have its own inside a shared launch.
inline bool acts_on_the_launcher(const std::string& key) {
  return key == "TANDEM_HEARTBEAT_INTERVAL_S" || key == "TANDEM_PREEMPTION_SIGNAL" ||
         key == "TANDEM_CPU_AFFINITY";
}

// The variables `tandem launch --dry_run` gives the ranks for these options, less the launch's
// own; a variable whose value differs between ranks is the launch's too. Asked once per command
// line and environment in a test process: the jobs of a launch mostly share their flags, and
// the answer depends on nothing else (each start of the launcher costs about 0.1 s of CPU under
// AddressSanitizer, and the suites ask about a thousand times).
inline std::map<std::string, std::string> launcher_env(int n, const std::string& program,
                                                       const LaunchOptions& options) {
  auto argv = launch_command(n, program, {}, options);
  argv.insert(argv.begin() + 2, "--dry_run");
  static std::map<std::pair<std::vector<std::string>, std::map<std::string, std::string>>,
                  std::map<std::string, std::string>>
      asked;
  const auto asked_key = std::make_pair(argv, options.env());
  if (auto it = asked.find(asked_key); it != asked.end()) return it->second;
  auto r = run_command(argv, options.env(), 60);
  if (r.exit_code != 0)
    throw std::runtime_error("tandem launch --dry_run refused a job's flags:\n" + r.output);
  std::vector<std::map<std::string, std::string>> ranks;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("rank ", 0) == 0 && line.find("(local ") != std::string::npos) {
      ranks.emplace_back();
      continue;
    }
    if (ranks.empty() || line.rfind("    ", 0) != 0) continue;
    const auto eq = line.find('=');
    if (eq != std::string::npos) ranks.back()[line.substr(4, eq - 4)] = line.substr(eq + 1);
  }
  if (static_cast<int>(ranks.size()) != n)
    throw std::runtime_error("tandem launch --dry_run did not describe " + std::to_string(n) +
                             " ranks:\n" + r.output);
  std::map<std::string, std::string> env;
  for (const auto& [key, value] : ranks[0]) {
    bool same = true;
    for (const auto& other : ranks) {
      auto it = other.find(key);
      same = same && it != other.end() && it->second == value;
    }
    if (same && !identifies_the_launch(key)) env[key] = value;
  }
  asked.emplace(asked_key, env);
  return env;
}

}  // namespace detail

/// Runs several jobs of `program` on the same `n` ranks in ONE launch: one set of rank processes
/// instead of one per job (starting LibTorch is most of a short job's time, several times that
/// under AddressSanitizer). Each job gets exactly the variables `tandem launch` would have given
/// its ranks for its flags (asked of `tandem launch --dry_run`) and its own environment; the
/// program runs the jobs one after another through `tandem::testing::main_with_jobs`
/// (tests/common/jobs_main.h), which sets them before each and prints where each job starts and
/// how it ended. Returns one result per job: its exit code (the worst over the ranks) and the
/// lines its ranks printed (with the launcher's own lines). A failed job ends the launch, as it
/// would have ended its own; the jobs it did not reach have exit code -1 and the launcher's lines.
/// Every job must have the same threads_per_process; the timeout is the jobs' sum.
inline std::vector<RunResult> launch_jobs(int n, const std::string& program,
                                          const std::vector<Job>& jobs) {
  std::vector<RunResult> results(jobs.size());
  if (jobs.empty()) return results;
  const LaunchOptions base = LaunchOptions().threads_per_process(jobs[0].options.threads_per_process());
  const auto base_env = detail::launcher_env(n, program, base);
  const std::string file = temp_path("jobs", std::to_string(reinterpret_cast<uintptr_t>(&jobs)));
  double timeout = 0;
  {
    std::ofstream out(file);
    for (const auto& job : jobs) {
      if (job.options.threads_per_process() != base.threads_per_process())
        throw std::invalid_argument("launch_jobs: every job needs the same threads_per_process");
      timeout += job.options.timeout_s();
      auto env = detail::launcher_env(n, program, job.options);
      for (const auto& [k, v] : env) {
        auto it = base_env.find(k);
        if (detail::acts_on_the_launcher(k) && (it == base_env.end() || it->second != v))
          throw std::invalid_argument("launch_jobs: " + k + "=" + v +
                                      " acts on the launcher itself; launch that job alone");
      }
      for (const auto& [k, v] : job.options.env()) env[k] = v;
      out << "job\n";
      for (const auto& [k, v] : base_env)
        if (!env.count(k)) out << "unset " << k << "\n";
      for (const auto& [k, v] : env) out << "env " << k << "=" << v << "\n";
      for (const auto& a : job.args) out << "arg " << a << "\n";
      if (job.may_fail) out << "may_fail\n";
    }
  }
  auto all = run_command(launch_command(n, program, {"--jobs", file}, base), {}, timeout);
  std::remove(file.c_str());
  // Each rank's lines go to the job it last announced ("[rank r] tandem-job i"); lines without a
  // rank (the launcher's) to every job from the current one on.
  std::vector<int> job_of(n, 0);
  std::vector<std::vector<int>> exits(jobs.size());
  std::istringstream lines(all.output);
  for (std::string line; std::getline(lines, line);) {
    int rank = -1, i = -1, code = 0;
    char tail = 0;
    if (std::sscanf(line.c_str(), "[rank %d] tandem-job %d%c", &rank, &i, &tail) == 2 &&
        rank >= 0 && rank < n && i >= 0 && i < static_cast<int>(jobs.size())) {
      job_of[rank] = i;
      continue;
    }
    if (std::sscanf(line.c_str(), "[rank %d] tandem-job-exit %d %d", &rank, &i, &code) == 3 &&
        rank >= 0 && rank < n && i >= 0 && i < static_cast<int>(jobs.size())) {
      exits[i].push_back(code);
      continue;
    }
    if (std::sscanf(line.c_str(), "[rank %d]", &rank) == 1 && rank >= 0 && rank < n) {
      results[job_of[rank]].output += line + "\n";
    } else {
      const int from = *std::min_element(job_of.begin(), job_of.end());
      for (size_t j = from; j < jobs.size(); ++j) results[j].output += line + "\n";
    }
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    auto& r = results[j];
    r.seconds = all.seconds;
    if (static_cast<int>(exits[j].size()) == n) {
      r.exit_code = *std::max_element(exits[j].begin(), exits[j].end());
    } else {
      // Not every rank ended this job: it failed with the launch (or was never reached).
      const bool earlier_failed =
          j > 0 && results[j - 1].exit_code != 0 && !jobs[j - 1].may_fail;
      r.exit_code = earlier_failed || all.exit_code == 0 ? -1 : all.exit_code;
      r.timed_out = all.timed_out;
    }
  }
  return results;
}

/// launch_jobs for jobs on several numbers of ranks: one launch per number (in increasing
/// order), each job's result under its name.
inline std::map<std::string, RunResult> launch_jobs_by_size(
    const std::string& program, const std::vector<std::tuple<std::string, int, Job>>& jobs) {
  std::map<int, std::vector<size_t>> by_size;
  for (size_t i = 0; i < jobs.size(); ++i) by_size[std::get<1>(jobs[i])].push_back(i);
  std::map<std::string, RunResult> results;
  for (const auto& [n, indices] : by_size) {
    std::vector<Job> group;
    for (size_t i : indices) group.push_back(std::get<2>(jobs[i]));
    auto done = launch_jobs(n, program, group);
    for (size_t k = 0; k < indices.size(); ++k)
      results[std::get<0>(jobs[indices[k]])] = std::move(done[k]);
  }
  return results;
}

}  // namespace tandem::testing
