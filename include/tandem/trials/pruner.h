// Whether a running trial stops early: the median rule and asynchronous successive halving
// (ASHA), as Optuna's MedianPruner and SuccessiveHalvingPruner decide them, over the values the
// trials reported at their steps. Pure functions over plain data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/trials/space.h"

namespace tandem::trials {

struct PrunerOptions {
  std::string type = "none";  ///< "none", "median", "asha" (or "successive_halving")
  /// median: complete trials needed before any trial is pruned (n_startup_trials).
  int startup_trials = 5;
  /// median: steps of a trial never pruned (n_warmup_steps).
  int64_t warmup_steps = 0;
  /// median: prune only at every interval_steps-th step after the warm-up.
  int64_t interval_steps = 1;
  /// asha: the step of the first rung (min_resource).
  int64_t min_resource = 1;
  /// asha: rung k sits at min_resource * reduction_factor^(min_early_stopping_rate + k), and a
  /// trial goes on past a rung when it is in the best 1/reduction_factor of the trials that
  /// reached it.
  int reduction_factor = 4;
  int min_early_stopping_rate = 0;
};

/// Throws std::invalid_argument naming a bad type or value.
void validate(const PrunerOptions& options);

/// Whether `current`, whose last report is current.intermediate.back(), stops now.
/// median: after warmup_steps, at the interval, once startup_trials trials are complete, the
/// trial stops when its best value so far is worse than the median of the values the other
/// complete and pruned trials reported at the same step (none reported there: go on).
/// asha: at the first report at or beyond a rung's step, the trial's value there (and every
/// other trial's value at that rung, running ones included) decide: it goes on when it ranks
/// within the best max(1, n / reduction_factor) of the n values.
bool should_prune(const PrunerOptions& options, Direction direction, const TrialRecord& current,
                  const std::vector<TrialRecord>& others);

}  // namespace tandem::trials
