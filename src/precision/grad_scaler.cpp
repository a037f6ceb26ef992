// GradScaler (see grad_scaler.h).
#include "tandem/precision/grad_scaler.h"
#include "tandem/error.h"

#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>

namespace tandem::precision {
namespace {

void check_options(const GradScalerOptions& o) {
  auto bad = [](const std::string& what) {
    throw ::tandem::Refused("GradScalerOptions: " + what);
  };
  if (!(o.init_scale() > 0) || !std::isfinite(o.init_scale()))
    bad("init_scale must be a positive finite number, found " + std::to_string(o.init_scale()));
  if (!(o.growth_factor() > 1))
    bad("growth_factor must be greater than 1, found " + std::to_string(o.growth_factor()));
  if (!(o.backoff_factor() > 0 && o.backoff_factor() < 1))
    bad("backoff_factor must lie in (0, 1), found " + std::to_string(o.backoff_factor()));
  if (o.growth_interval() < 1)
    bad("growth_interval must be at least 1, found " + std::to_string(o.growth_interval()));
  if (!(o.min_scale() > 0) || o.min_scale() > o.init_scale())
    bad("min_scale must lie in (0, init_scale], found " + std::to_string(o.min_scale()));
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), scale_(options.init_scale()) {
  check_options(options_);
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  return loss.to(at::kFloat) * scale_;
}

bool GradScaler::unscale_(const std::vector<at::Tensor>& grads) const {
  const double inv = 1.0 / scale_;
  at::Tensor found;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    g.mul_(inv);
    auto bad = at::logical_not(at::isfinite(g)).any();
    found = found.defined() ? at::logical_or(found, bad) : bad;
  }
  return found.defined() && found.item<bool>();  // one synchronisation for all gradients
}

void GradScaler::update(bool found_inf) {
  if (found_inf) {
    scale_ = std::max(scale_ * options_.backoff_factor(), options_.min_scale());
    growth_tracker_ = 0;
    return;
  }
  if (++growth_tracker_ >= options_.growth_interval()) {
    const double grown = scale_ * options_.growth_factor();
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
}

std::map<std::string, double> GradScaler::state_dict() const {
  return {{"scale", scale_},
          {"growth_tracker", static_cast<double>(growth_tracker_)},
          {"init_scale", options_.init_scale()},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"min_scale", options_.min_scale()}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  auto get = [&](const char* key) {
    auto it = state.find(key);
    if (it == state.end())
      throw ::tandem::Refused(std::string("GradScaler::load_state_dict: expected the key '") +
                                  key + "', found only " + std::to_string(state.size()) +
                                  " keys; pass a map written by GradScaler::state_dict()");
    return it->second;
  };
  GradScalerOptions o;
  o.init_scale(get("init_scale"))
      .growth_factor(get("growth_factor"))
      .backoff_factor(get("backoff_factor"))
      .growth_interval(static_cast<int64_t>(get("growth_interval")))
      .min_scale(get("min_scale"));
  check_options(o);
  const double s = get("scale");
  if (!(s > 0) || !std::isfinite(s))
    throw ::tandem::Refused("GradScaler::load_state_dict: scale must be positive and finite, "
                                "found " + std::to_string(s));
  options_ = o;
  scale_ = s;
  growth_tracker_ = static_cast<int64_t>(get("growth_tracker"));
}

}  // namespace tandem::precision
