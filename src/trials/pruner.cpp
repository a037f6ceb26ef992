// The median and successive-halving rules over reported (step, value) pairs.
#include "tandem/trials/pruner.h"
#include "tandem/error.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>

namespace tandem::trials {
namespace {

// Lower is better after this.
double oriented(Direction d, double v) { return d == Direction::kMinimize ? v : -v; }

std::optional<double> value_at(const TrialRecord& t, int64_t step) {
  for (const auto& [s, v] : t.intermediate)
    if (s == step) return v;
  return std::nullopt;
}

// The value a trial reported at its first step at or beyond `resource`.
std::optional<double> rung_value(const TrialRecord& t, int64_t resource) {
  for (const auto& [s, v] : t.intermediate)
    if (s >= resource) return v;
  return std::nullopt;
}

bool median_prunes(const PrunerOptions& o, Direction d, const TrialRecord& cur,
                   const std::vector<TrialRecord>& others) {
  const int64_t step = cur.intermediate.back().first;
  if (step < o.warmup_steps) return false;
  if (o.interval_steps > 1 && (step - o.warmup_steps) % o.interval_steps != 0) return false;
  int complete = 0;
  for (const auto& t : others) complete += t.state == TrialState::kComplete;
  if (complete < o.startup_trials) return false;
  std::vector<double> at;
  for (const auto& t : others) {
    if (t.number == cur.number) continue;
    if (t.state != TrialState::kComplete && t.state != TrialState::kPruned) continue;
    if (auto v = value_at(t, step); v && std::isfinite(*v)) at.push_back(oriented(d, *v));
  }
  if (at.empty()) return false;
  std::sort(at.begin(), at.end());
  const size_t n = at.size();
  const double median = n % 2 ? at[n / 2] : 0.5 * (at[n / 2 - 1] + at[n / 2]);
  double best = INFINITY;
  for (const auto& [s, v] : cur.intermediate)
    if (std::isfinite(v)) best = std::min(best, oriented(d, v));
  if (!std::isfinite(best)) return true;  // only NaN so far: Optuna prunes it too
  return best > median;
}

bool asha_prunes(const PrunerOptions& o, Direction d, const TrialRecord& cur,
                 const std::vector<TrialRecord>& others) {
  const int64_t step = cur.intermediate.back().first;
  const int64_t prev = cur.intermediate.size() >= 2
                           ? cur.intermediate[cur.intermediate.size() - 2].first
                           : INT64_MIN;
  // The rungs this report crossed for the first time (usually none or one); the highest decides.
  std::optional<int64_t> rung;
  double r = static_cast<double>(o.min_resource) *
             std::pow(static_cast<double>(o.reduction_factor), o.min_early_stopping_rate);
  for (int k = 0; k < 64 && r <= static_cast<double>(step); ++k) {
    if (static_cast<double>(prev) < r) rung = static_cast<int64_t>(r);
    r *= o.reduction_factor;
  }
  if (!rung) return false;
  const double mine = cur.intermediate.back().second;
  if (!std::isfinite(mine)) return true;
  std::vector<double> competing{oriented(d, mine)};
  for (const auto& t : others) {
    if (t.number == cur.number || t.state == TrialState::kFailed) continue;
    if (auto v = rung_value(t, *rung); v && std::isfinite(*v)) competing.push_back(oriented(d, *v));
  }
  std::sort(competing.begin(), competing.end());
  const size_t keep = std::max<size_t>(1, competing.size() / static_cast<size_t>(o.reduction_factor));
  return oriented(d, mine) > competing[keep - 1];
}

}  // namespace

void validate(const PrunerOptions& o) {
  if (o.type != "none" && o.type != "median" && o.type != "asha" && o.type != "successive_halving")
    throw ::tandem::Refused("pruner '" + o.type + "': expected none, median or asha");
  if (o.startup_trials < 0 || o.warmup_steps < 0 || o.interval_steps < 1)
    throw ::tandem::Refused(
        "pruner: startup_trials and warmup_steps must be >= 0, interval_steps >= 1");
  if (o.min_resource < 1 || o.reduction_factor < 2 || o.min_early_stopping_rate < 0)
    throw ::tandem::Refused(
        "pruner: min_resource must be >= 1, reduction_factor >= 2, min_early_stopping_rate >= 0");
}

bool should_prune(const PrunerOptions& o, Direction d, const TrialRecord& cur,
                  const std::vector<TrialRecord>& others) {
  if (cur.intermediate.empty() || o.type == "none") return false;
  if (o.type == "median") return median_prunes(o, d, cur, others);
  return asha_prunes(o, d, cur, others);
}

}  // namespace tandem::trials
