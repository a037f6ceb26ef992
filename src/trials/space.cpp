// Search-space parsing and the three samplers (Note [TPE as Optuna defines it]).
#include "tandem/trials/space.h"
#include "tandem/error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <stdexcept>

namespace tandem::trials {
namespace {

constexpr double kPi = 3.14159265358979323846;

double parse_number(const std::string& text, const std::string& what) {
  try {
    size_t used = 0;
    double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw ::tandem::Refused(what + ": '" + text + "' is not a number");
}

// The value as the program receives it: six significant digits for reals, so that the value a
// trial runs with, the one recorded and the one modelled are the same number.
std::string format_value(const ParamSpec& s, double internal) {
  char buf[64];
  switch (s.type) {
    case ParamType::kUniform:
    case ParamType::kLogUniform: {
      double v = s.type == ParamType::kLogUniform ? std::exp(internal) : internal;
      v = std::clamp(v, s.low, s.high);
      std::snprintf(buf, sizeof buf, "%.6g", v);
      double r = std::stod(buf);
      if (r < s.low || r > s.high) std::snprintf(buf, sizeof buf, "%.17g", v);
      return buf;
    }
    case ParamType::kInt: {
      auto v = static_cast<long long>(std::llround(internal));
      v = std::clamp(v, static_cast<long long>(s.low), static_cast<long long>(s.high));
      return std::to_string(v);
    }
    case ParamType::kCategorical: {
      auto i = static_cast<size_t>(std::clamp<double>(std::llround(internal), 0,
                                                      static_cast<double>(s.choices.size() - 1)));
      return s.choices[i];
    }
  }
  return "";
}

// The internal range a sampler draws in: log space for log-uniform, half a step beyond each
// end for integers (so that both ends are as likely as the values between).
std::pair<double, double> internal_range(const ParamSpec& s) {
  switch (s.type) {
    case ParamType::kLogUniform: return {std::log(s.low), std::log(s.high)};
    case ParamType::kInt: return {s.low - 0.5, s.high + 0.5};
    default: return {s.low, s.high};
  }
}

std::mt19937_64 trial_rng(uint64_t seed, int number, uint64_t salt = 0) {
  // splitmix64 of (seed, number, salt): independent streams per trial.
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(number) * 0xBF58476D1CE4E5B9ULL +
               salt * 0x94D049BB133111EBULL + 0x632BE59BD9B4E019ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return std::mt19937_64(z ^ (z >> 31));
}

std::string draw_random(const ParamSpec& s, std::mt19937_64& rng) {
  if (s.type == ParamType::kCategorical) {
    std::uniform_int_distribution<size_t> d(0, s.choices.size() - 1);
    return s.choices[d(rng)];
  }
  if (s.type == ParamType::kInt) {
    std::uniform_int_distribution<long long> d(static_cast<long long>(s.low),
                                               static_cast<long long>(s.high));
    return std::to_string(d(rng));
  }
  auto [lo, hi] = internal_range(s);
  std::uniform_real_distribution<double> d(lo, hi);
  return format_value(s, d(rng));
}

std::vector<std::string> grid_values(const ParamSpec& s) {
  if (!s.choices.empty()) return s.choices;
  if (s.type == ParamType::kInt) {
    if (s.high - s.low > 10000)
      throw ::tandem::Refused("grid sampler: parameter '" + s.name + "' spans " +
                                  std::to_string(static_cast<long long>(s.high - s.low + 1)) +
                                  " integers; give it `choices` (the grid values)");
    std::vector<std::string> v;
    for (auto i = static_cast<long long>(s.low); i <= static_cast<long long>(s.high); ++i)
      v.push_back(std::to_string(i));
    return v;
  }
  throw ::tandem::Refused("grid sampler: parameter '" + s.name + "' is " + to_string(s.type) +
                              " over a real range; give it `choices` (the grid values), or use "
                              "sampler: random or tpe");
}

// ---- TPE -------------------------------------------------------------------------------------
// Note [TPE as Optuna defines it]
// Optuna's TPESampler with its defaults (univariate, consider_prior, prior_weight 1,
// consider_magic_clip, consider_endpoints false, n_ei_candidates 24, gamma
// min(ceil(0.1 n), 25), default_weights): the finished trials are ranked by objective; the best
// gamma(n) form "below", the others (and every pruned trial, ranked after them) "above". Each
// group gets, per parameter, a mixture: one truncated Gaussian per observation plus a prior
// (mean mid-range, sigma the range), each observation's sigma the larger distance to its
// neighbours (the ends of the range around the outermost), clipped to [range/min(100, 1+k),
// range]; the weights ramp from 1/n up for all but the newest 25 trials. Categorical kernels
// put (prior_weight / C) on every choice plus 1 on the observed one. Candidates come from
// "below"; the candidate with the largest log l(x) - log g(x) wins.

std::vector<double> default_weights(size_t n) {
  std::vector<double> w(n, 1.0);
  if (n >= 25) {
    const size_t ramp = n - 25;
    for (size_t i = 0; i < ramp; ++i)
      w[i] = ramp == 1 ? 1.0 / n : 1.0 / n + (1.0 - 1.0 / n) * i / (ramp - 1);
  }
  return w;
}

struct Parzen {
  bool categorical = false;
  std::vector<double> weights;            // per kernel, normalised
  std::vector<double> mus, sigmas;        // numerical kernels
  std::vector<std::vector<double>> probs;  // categorical kernels: per choice
  double low = 0, high = 0;

  Parzen(const ParamSpec& s, const std::vector<double>& obs) {
    auto w = default_weights(obs.size());
    w.push_back(1.0);  // the prior
    const double total = std::accumulate(w.begin(), w.end(), 0.0);
    for (auto& x : w) x /= total;
    weights = w;
    if (s.type == ParamType::kCategorical) {
      categorical = true;
      const size_t c = s.choices.size();
      for (size_t k = 0; k <= obs.size(); ++k) {
        std::vector<double> p(c, 1.0 / static_cast<double>(c));
        if (k < obs.size()) p[static_cast<size_t>(obs[k])] += 1.0;
        const double sum = std::accumulate(p.begin(), p.end(), 0.0);
        for (auto& x : p) x /= sum;
        probs.push_back(p);
      }
      return;
    }
    std::tie(low, high) = internal_range(s);
    const double prior_mu = 0.5 * (low + high);
    std::vector<double> with_prior = obs;
    with_prior.push_back(prior_mu);
    std::vector<size_t> order(with_prior.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return with_prior[a] < with_prior[b]; });
    std::vector<double> ends{low};
    for (size_t i : order) ends.push_back(with_prior[i]);
    ends.push_back(high);
    const size_t m = order.size();
    std::vector<double> sorted_sigma(m);
    for (size_t i = 0; i < m; ++i)
      sorted_sigma[i] = std::max(ends[i + 1] - ends[i], ends[i + 2] - ends[i + 1]);
    if (m >= 2) {  // consider_endpoints = false
      sorted_sigma[0] = ends[2] - ends[1];
      sorted_sigma[m - 1] = ends[m] - ends[m - 1];
    }
    std::vector<double> sigma(m);
    for (size_t i = 0; i < m; ++i) sigma[order[i]] = sorted_sigma[i];
    const double range = high - low;
    const double min_sigma = range / std::min(100.0, 1.0 + static_cast<double>(m));
    mus = with_prior;
    sigmas.resize(m);
    for (size_t i = 0; i < m; ++i) sigmas[i] = std::clamp(sigma[i], min_sigma, range);
    sigmas[m - 1] = range;  // the prior's
  }

  static double phi(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

  double sample(std::mt19937_64& rng) const {
    std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
    const size_t k = pick(rng);
    if (categorical) {
      std::discrete_distribution<size_t> c(probs[k].begin(), probs[k].end());
      return static_cast<double>(c(rng));
    }
    std::normal_distribution<double> n(mus[k], sigmas[k]);
    for (int i = 0; i < 100; ++i) {
      double x = n(rng);
      if (x >= low && x <= high) return x;
    }
    return std::clamp(mus[k], low, high);
  }

  double log_pdf(double x) const {
    double p = 0;
    if (categorical) {
      for (size_t k = 0; k < weights.size(); ++k) p += weights[k] * probs[k][static_cast<size_t>(x)];
      return std::log(std::max(p, 1e-300));
    }
    for (size_t k = 0; k < weights.size(); ++k) {
      const double z = (x - mus[k]) / sigmas[k];
      const double mass = phi((high - mus[k]) / sigmas[k]) - phi((low - mus[k]) / sigmas[k]);
      p += weights[k] * std::exp(-0.5 * z * z) / (sigmas[k] * std::sqrt(2 * kPi)) /
           std::max(mass, 1e-300);
    }
    return std::log(std::max(p, 1e-300));
  }
};

std::optional<Params> sample_tpe(const SamplerOptions& o, const std::vector<ParamSpec>& space,
                                 const std::vector<TrialRecord>& history, Direction dir,
                                 uint64_t seed, int number) {
  std::vector<const TrialRecord*> complete, pruned;
  for (const auto& t : history) {
    if (t.state == TrialState::kComplete && t.value && std::isfinite(*t.value)) complete.push_back(&t);
    if (t.state == TrialState::kPruned) pruned.push_back(&t);
  }
  auto rng = trial_rng(seed, number, 1);
  if (complete.empty() || static_cast<int>(complete.size() + pruned.size()) < o.startup_trials) {
    Params p;
    for (const auto& s : space) p[s.name] = draw_random(s, rng);
    return p;
  }
  const double sign = dir == Direction::kMinimize ? 1.0 : -1.0;
  std::vector<const TrialRecord*> ranked = complete;
  std::stable_sort(ranked.begin(), ranked.end(), [&](auto* a, auto* b) {
    return sign * *a->value < sign * *b->value;
  });
  const size_t n_below =
      std::min<size_t>(static_cast<size_t>(std::ceil(0.1 * ranked.size())), 25);
  std::vector<const TrialRecord*> below(ranked.begin(), ranked.begin() + static_cast<long>(n_below));
  std::vector<const TrialRecord*> above(ranked.begin() + static_cast<long>(n_below), ranked.end());
  above.insert(above.end(), pruned.begin(), pruned.end());
  // The weights ramp by age: observations in trial order.
  auto by_number = [](auto* a, auto* b) { return a->number < b->number; };
  std::sort(below.begin(), below.end(), by_number);
  std::sort(above.begin(), above.end(), by_number);
  Params p;
  for (const auto& s : space) {
    std::vector<double> lo_obs, hi_obs;
    for (auto* t : below)
      if (t->params.count(s.name)) lo_obs.push_back(internal_value(s, t->params.at(s.name)));
    for (auto* t : above)
      if (t->params.count(s.name)) hi_obs.push_back(internal_value(s, t->params.at(s.name)));
    Parzen l(s, lo_obs), g(s, hi_obs);
    double best = 0, best_score = -INFINITY;
    for (int c = 0; c < std::max(1, o.ei_candidates); ++c) {
      double x = l.sample(rng);
      // Integers and choices are scored at the value the trial would run with.
      if (s.type == ParamType::kInt) x = std::clamp(std::round(x), s.low, s.high);
      double score = l.log_pdf(x) - g.log_pdf(x);
      if (score > best_score) best_score = score, best = x;
    }
    p[s.name] = format_value(s, best);
  }
  return p;
}

}  // namespace

ParamType parse_param_type(const std::string& t) {
  if (t == "uniform" || t == "float") return ParamType::kUniform;
  if (t == "loguniform" || t == "log_uniform" || t == "log") return ParamType::kLogUniform;
  if (t == "int" || t == "integer") return ParamType::kInt;
  if (t == "categorical" || t == "choice") return ParamType::kCategorical;
  throw ::tandem::Refused("parameter type '" + t +
                              "': expected uniform, loguniform, int or categorical");
}

std::string to_string(ParamType t) {
  switch (t) {
    case ParamType::kUniform: return "uniform";
    case ParamType::kLogUniform: return "loguniform";
    case ParamType::kInt: return "int";
    case ParamType::kCategorical: return "categorical";
  }
  return "?";
}

void validate(const ParamSpec& s) {
  const std::string where = "space." + s.name;
  if (s.name.empty()) throw ::tandem::Refused("space: a parameter without a name");
  if (!s.flag.empty() && !s.env.empty())
    throw ::tandem::Refused(where + ": give `flag` or `env`, not both");
  if (s.type == ParamType::kCategorical) {
    if (s.choices.empty())
      throw ::tandem::Refused(where + ": categorical needs `choices` (a list of values)");
    return;
  }
  if (!(s.low < s.high))
    throw ::tandem::Refused(where + ": needs low < high (got low " + std::to_string(s.low) +
                                ", high " + std::to_string(s.high) + ")");
  if (s.type == ParamType::kLogUniform && s.low <= 0)
    throw ::tandem::Refused(where + ": loguniform needs low > 0");
  if (s.type == ParamType::kInt && (s.low != std::floor(s.low) || s.high != std::floor(s.high)))
    throw ::tandem::Refused(where + ": int needs whole low and high");
  for (const auto& c : s.choices) {
    double v = parse_number(c, where + " choices");
    if (v < s.low || v > s.high)
      throw ::tandem::Refused(where + ": grid value " + c + " lies outside [low, high]");
  }
}

double internal_value(const ParamSpec& s, const std::string& text) {
  if (s.type == ParamType::kCategorical) {
    auto it = std::find(s.choices.begin(), s.choices.end(), text);
    if (it == s.choices.end())
      throw ::tandem::Refused("space." + s.name + ": '" + text + "' is not one of its choices");
    return static_cast<double>(it - s.choices.begin());
  }
  double v = parse_number(text, "space." + s.name);
  return s.type == ParamType::kLogUniform ? std::log(v) : v;
}

Direction parse_direction(const std::string& t) {
  if (t == "min" || t == "minimize") return Direction::kMinimize;
  if (t == "max" || t == "maximize") return Direction::kMaximize;
  throw ::tandem::Refused("objective.mode '" + t + "': expected min or max");
}

std::string to_string(TrialState s) {
  switch (s) {
    case TrialState::kRunning: return "running";
    case TrialState::kComplete: return "complete";
    case TrialState::kPruned: return "pruned";
    case TrialState::kFailed: return "failed";
  }
  return "?";
}

TrialState parse_trial_state(const std::string& t) {
  for (auto s : {TrialState::kRunning, TrialState::kComplete, TrialState::kPruned, TrialState::kFailed})
    if (to_string(s) == t) return s;
  throw ::tandem::Refused("trial state '" + t + "'");
}

int64_t grid_size(const std::vector<ParamSpec>& space) {
  int64_t n = 1;
  for (const auto& s : space) {
    try {
      n *= static_cast<int64_t>(grid_values(s).size());
    } catch (const std::invalid_argument&) {
      return 0;
    }
    if (n > 1'000'000) return n;
  }
  return n;
}

std::optional<Params> sample(const SamplerOptions& o, const std::vector<ParamSpec>& space,
                             const std::vector<TrialRecord>& history, Direction direction,
                             uint64_t seed, int number) {
  if (o.type == "random") {
    auto rng = trial_rng(seed, number);
    Params p;
    for (const auto& s : space) p[s.name] = draw_random(s, rng);
    return p;
  }
  if (o.type == "tpe") return sample_tpe(o, space, history, direction, seed, number);
  if (o.type != "grid")
    throw ::tandem::Refused("sampler '" + o.type + "': expected grid, random or tpe");
  std::vector<std::vector<std::string>> values;
  int64_t total = 1;
  for (const auto& s : space) {
    values.push_back(grid_values(s));
    total *= static_cast<int64_t>(values.back().size());
    if (total > 1'000'000)
      throw ::tandem::Refused("grid sampler: more than a million points; give fewer choices");
  }
  std::vector<int64_t> order(static_cast<size_t>(total));
  std::iota(order.begin(), order.end(), 0);
  auto rng = trial_rng(seed, 0, 2);  // one order for the whole study
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t id : order) {
    Params p;
    int64_t rest = id;
    for (size_t d = 0; d < space.size(); ++d) {
      const auto n = static_cast<int64_t>(values[d].size());
      p[space[d].name] = values[d][static_cast<size_t>(rest % n)];
      rest /= n;
    }
    bool taken = std::any_of(history.begin(), history.end(),
                             [&](const TrialRecord& t) { return t.params == p; });
    if (!taken) return p;
  }
  return std::nullopt;
}

}  // namespace tandem::trials
