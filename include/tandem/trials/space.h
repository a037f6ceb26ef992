// What a hyper-parameter search draws from: the search space, the trials drawn so far, and the
// samplers that pick the next trial's values (grid, random, and TPE as Optuna defines it).
// Pure functions over plain data: every sampler is deterministic given the study's seed, the
// trial number and the trials before it, which is what makes a study resumable.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace tandem::trials {

/// How a parameter is drawn.
enum class ParamType {
  kUniform,     ///< a real number, uniform in [low, high]
  kLogUniform,  ///< a real number > 0, uniform in log space
  kInt,         ///< an integer in [low, high], both included
  kCategorical  ///< one of `choices`
};

/// "uniform" (or "float"), "loguniform" (or "log_uniform", "log"), "int", "categorical".
/// Throws std::invalid_argument naming the accepted spellings.
ParamType parse_param_type(const std::string& text);
std::string to_string(ParamType type);

/// One dimension of the search space, as a study file's `space` entry gives it.
struct ParamSpec {
  std::string name;
  ParamType type = ParamType::kUniform;
  double low = 0, high = 0;
  /// Categorical values; for the other types, optional grid values (the grid sampler needs
  /// them for real-valued parameters).
  std::vector<std::string> choices;
  /// How the trial receives the value: a flag (`--lr 0.003`) or an environment variable. When
  /// neither is given the flag is `--<name>`.
  std::string flag, env;
};

/// Checks one spec: low < high (low > 0 for log-uniform), integers for kInt, choices present
/// for kCategorical and numeric for the others. Throws std::invalid_argument naming the
/// parameter, what is wrong and the fix.
void validate(const ParamSpec& spec);

/// A trial's values, as the text handed to the program ("0.00316", "128", "gelu").
using Params = std::map<std::string, std::string>;

/// The number a sampler models for a value: the value for numbers, log(value) for log-uniform,
/// the choice's index for categorical. Throws std::invalid_argument for a value the spec cannot
/// hold.
double internal_value(const ParamSpec& spec, const std::string& text);

enum class Direction { kMinimize, kMaximize };
/// "min"/"minimize" or "max"/"maximize".
Direction parse_direction(const std::string& text);

/// What a trial became.
enum class TrialState { kRunning, kComplete, kPruned, kFailed };
std::string to_string(TrialState state);
TrialState parse_trial_state(const std::string& text);

/// One trial of a study: its values, the objective it reported along the way and at the end.
struct TrialRecord {
  int number = 0;
  Params params;
  TrialState state = TrialState::kRunning;
  std::optional<double> value;  ///< the objective: the last value reported
  std::vector<std::pair<int64_t, double>> intermediate;  ///< (step, value), in report order
  double seconds = 0;
  std::string message;  ///< why it failed or was pruned
};

/// How the next trial is drawn.
struct SamplerOptions {
  std::string type = "tpe";  ///< "grid", "random" or "tpe"
  /// TPE: trials drawn at random before the model takes over (Optuna's n_startup_trials).
  int startup_trials = 10;
  /// TPE: candidates drawn from the good trials' density, of which the best ratio wins
  /// (Optuna's n_ei_candidates).
  int ei_candidates = 24;
};

/// The values of trial `number`, or nullopt when the grid has no point left. Grid: every
/// combination of the choices (integers: every value low..high), visited in an order shuffled
/// by the seed, skipping combinations any earlier trial holds. Random: independent draws.
/// TPE (Bergstra et al. 2011, as Optuna's TPESampler with its defaults): after startup_trials
/// finished trials, the complete trials are split into the best gamma(n) = min(ceil(n/10), 25)
/// and the rest (pruned trials join the rest); per parameter a Parzen estimator (truncated
/// Gaussians at the observations plus a prior over the range; categorical: smoothed counts) is
/// fitted to each group, ei_candidates values are drawn from the good one, and the one with the
/// largest log l(x) - log g(x) is taken. Running and failed trials are not modelled.
/// Throws std::invalid_argument for an unknown sampler or a grid over a real range without
/// choices.
std::optional<Params> sample(const SamplerOptions& options, const std::vector<ParamSpec>& space,
                             const std::vector<TrialRecord>& history, Direction direction,
                             uint64_t seed, int number);

/// How many points the grid has (0 when a parameter has no grid).
int64_t grid_size(const std::vector<ParamSpec>& space);

}  // namespace tandem::trials
