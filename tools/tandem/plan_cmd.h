// `tandem plan`: the subcommand's flags and handler (logic in tandem/trials/planner.h).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace tandem::cli {

/// The plan subcommand: registered on construction, split_program() before parsing (everything
/// after `--` is the program to probe), run() after.
class PlanCommand {
 public:
  explicit PlanCommand(CLI::App& app);
  /// Cuts `-- PROGRAM ARGS...` off a `tandem plan` command line; returns the argc to parse.
  int split_program(int argc, char** argv);
  bool chosen() const { return sub_->parsed(); }
  /// Plans; returns the process exit code (2 for bad input, 1 when no layout fits).
  int run(const std::string& tandem_exe) const;

 private:
  CLI::App* sub_ = nullptr;
  std::vector<std::string> command_;
  std::string model_, memory_, output_, work_dir_, offload_dir_;
  int64_t layers_ = 0, hidden_ = 0, heads_ = 0, vocab_ = 0, seq_len_ = 0;
  int num_processes_ = 1, num_machines_ = 1, candidates_ = 3;
  int64_t global_batch_ = 8, max_micro_batch_ = 0, probe_steps_ = 3, timed_steps_ = 6;
  double run_timeout_ = 600;
  bool measure_all_ = false, no_checkpointing_ = false, cpu_ = false;
  std::vector<int> virtual_stages_;  // --pp_virtual_stages 1,2
  std::vector<int> context_parallel_;  // --cp_size 1,2
  std::vector<int> expert_parallel_;   // --ep_size 1,2
};

}  // namespace tandem::cli
