// `tandem sweep`: a study whose trials are `tandem launch` jobs. Each trial runs the study's
// program with its values as flags or environment variables; the sweep follows the metric the
// trial logs (its metrics.jsonl), stops trials the pruner prunes, records every trial in the
// results file and ends with the table, the best trial and a picture (objective.png).
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "tandem/trials/study.h"

namespace tandem::trials {

struct SweepOptions {
  /// The `tandem` executable that launches each trial (tandem sweep passes itself).
  std::string tandem_exe;
  /// Progress lines and the final table go here.
  std::ostream* out = nullptr;
  double poll_interval_s = 0.2;
  /// Seconds between SIGTERM and SIGKILL for a pruned trial.
  double grace_period_s = 10.0;
};

struct SweepResult {
  std::vector<TrialRecord> trials;  ///< every finished trial of the study, earlier runs' included
  int ran = 0;                      ///< trials this call ran
  bool interrupted = false;         ///< stopped by SIGINT/SIGTERM (running trials left unfinished)
  std::string plot;                 ///< the picture's path ("" when no trial finished)
};

/// The command line of trial `trial` (for docs, tests and --dry_run): tandem launch, the
/// study's launch flags, the program, its args with {trial_dir} and {trial} replaced, the
/// parameters given as flags. Environment parameters come back in `env`.
std::vector<std::string> trial_command(const StudyConfig& config, const std::string& tandem_exe,
                                       const TrialRecord& trial, const std::string& trial_dir,
                                       std::vector<std::pair<std::string, std::string>>* env);

/// Runs the study to its `trials` (continuing a results file already in study_dir). Throws
/// std::invalid_argument when `tandem launch` refuses the study's launch settings (checked once
/// with --dry_run before any trial) or `parallel` cannot get disjoint cores or devices.
/// A trial that fails is recorded as failed and the sweep goes on.
SweepResult run_sweep(const StudyConfig& config, const SweepOptions& options);

}  // namespace tandem::trials
