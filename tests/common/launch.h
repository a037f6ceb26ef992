// Starts a program on N ranks through `tandem launch --num_processes N --cpu`: the one way the
// multi-process tests start their workers. The test target defines TANDEM_CLI, the path of the
// `tandem` binary (tandem_dist_tests in tests/CMakeLists.txt does).
#pragma once

#include <map>
#include <string>
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
  std::map<std::string, std::string> env_;
  double timeout_s_ = 120;
};

/// The command line `launch` runs: `tandem launch --num_processes n --cpu
/// [--num_cpu_threads_per_process t] FLAGS... program ARGS...` (for a test that starts it itself).
inline std::vector<std::string> launch_command(int n, const std::string& program,
                                               const std::vector<std::string>& args = {},
                                               const LaunchOptions& options = {}) {
  std::vector<std::string> argv{TANDEM_CLI, "launch", "--num_processes", std::to_string(n), "--cpu"};
  if (options.threads_per_process() > 0)
    argv.insert(argv.end(),
                {"--num_cpu_threads_per_process", std::to_string(options.threads_per_process())});
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

}  // namespace tandem::testing
