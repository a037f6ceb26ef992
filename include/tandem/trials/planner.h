// `tandem plan`: the layouts the rules allow for a model on these machines, each one's
// predicted per-rank peak memory (plan.h), a short profiled step of the real program to measure
// what formulas cannot (activations, workspace, the process's own memory), timed steps of the
// best candidates that fit, a ranked table, and the winner as a config file for
// `tandem launch --config_file`.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "tandem/trials/plan.h"

namespace tandem::trials {

struct PlannerOptions {
  /// The `tandem` executable that launches each run (tandem plan passes itself).
  std::string tandem_exe;
  PlanModel model;
  PlanMachine machine;
  PlanSearch search;
  /// Tokens per sequence (for tokens/s and the formula without a program; 0: the model's
  /// context).
  int64_t seq_len = 0;
  /// The program to probe and time, with its arguments: {batch_size} (sequences per
  /// data-parallel rank per micro-step) is required; {microbatches}, {accumulation} and {steps}
  /// are optional. Empty: predict only.
  std::string program;
  std::vector<std::string> args;
  /// Layouts timed with the real program, best guesses first (layout_cost); all: every one
  /// that fits (what the predicted-versus-measured table needs).
  int candidates = 3;
  bool measure_all = false;
  /// {steps} in the probes and in the timed runs.
  int64_t probe_steps = 3;
  int64_t timed_steps = 6;
  /// Seconds a single run may take before it is stopped and recorded as failed.
  double run_timeout_s = 600;
  /// Where the runs' logs and profiles go.
  std::string work_dir = "plan_runs";
  /// The winning layout's config file ("": none written).
  std::string output;
  /// Progress lines and the table.
  std::ostream* out = nullptr;
};

/// A run's figures: the rank with the largest peak resident memory, and the step time.
struct MeasuredRun {
  bool ok = false;
  std::string error;        ///< why it failed (exit code and the log's last lines)
  std::string log;          ///< the run's log file
  double rss_peak = 0;      ///< VmHWM of the rank with the most (bytes)
  double baseline_rss = 0;  ///< that rank's resident memory before its model
  double tensor_peak = 0;   ///< the counting allocator's peak on that rank
  int64_t parameters = 0;   ///< parameters on that rank
  double step_seconds = 0;  ///< median optimizer step after the first (0: fewer than 2 steps)
};

struct PlannedLayout {
  Layout layout;
  MemoryPrediction predicted;
  bool fits = false;
  double cost = 0;  ///< layout_cost
  std::optional<MeasuredRun> measured;
  double tokens_per_s() const;
  int64_t tokens_per_step = 0;
};

struct PlanResult {
  ProbeFigures probe;
  std::vector<std::string> excluded;  ///< enumerate_layouts' reasons
  /// Every layout: timed ones by measured speed first, then the others by predicted cost.
  std::vector<PlannedLayout> layouts;
  std::optional<size_t> winner;  ///< index into layouts
  std::string config_path;       ///< the written config ("" when none)
  std::vector<std::string> notes;
};

/// Plans: enumerates, probes (when there is a program), predicts, times and writes the config.
/// Throws std::invalid_argument for a plan that cannot start (no {batch_size} in the args, no
/// layout at all, a probe that fails) naming the cause and the fix.
PlanResult run_plan(const PlannerOptions& options);

/// The ranked table (text) and the same as JSON.
std::string format_plan(const PlanResult& result, const PlannerOptions& options);
std::string plan_to_json(const PlanResult& result, const PlannerOptions& options);

/// Reads the per-rank profiles `<prefix>.rank<r>.json` of a run of `world` ranks
/// (TANDEM_PROFILE). Throws std::runtime_error naming a missing or unreadable one.
MeasuredRun read_run_profiles(const std::string& prefix, int world);

/// Bytes this machine offers one of `processes` processes: MemAvailable / processes.
double available_memory_per_process(int processes);

}  // namespace tandem::trials
