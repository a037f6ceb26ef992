// GradScaler: dynamic loss scaling for float16 training, as PyTorch's torch.amp.GradScaler.
// The arithmetic (scale, growth, backoff) is a plain class; the Accelerator decides when to
// unscale and all-reduces the found-inf flag so that every rank skips a step together.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tandem::precision {

/// Options of GradScaler (PyTorch's defaults, plus a floor on the scale).
///
/// Example:
///   tandem::Accelerator acc(tandem::AcceleratorOptions()
///       .mixed_precision("fp16")
///       .grad_scaler(tandem::precision::GradScalerOptions().growth_interval(1000).min_scale(1)));
struct GradScalerOptions {
  /// The first scale: 2^16.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Scale multiplier after growth_interval consecutive steps with finite gradients.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Scale multiplier after a step with inf/NaN gradients (the step is skipped).
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// The scale never backs off below this (a run whose gradients overflow at scale 1 has a
  /// problem that scaling cannot fix).
  TORCH_ARG(double, min_scale) = 1.0;
};

/// Dynamic loss scaler.
///
/// Example:
///   tandem::precision::GradScaler scaler;
///   scaler.scale(loss).backward();
///   bool inf = scaler.unscale_(grads);   // grads *= 1/scale, true if any is inf/NaN
///   if (!inf) optimizer.step();
///   scaler.update(inf);
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// The current scale.
  double get_scale() const { return scale_; }
  /// The loss in fp32 times the scale (the loss is cast up first, so a half loss near its
  /// range limit does not overflow).
  at::Tensor scale(const at::Tensor& loss) const;
  /// Multiplies every defined gradient by 1/scale, in place; returns whether any gradient
  /// holds an inf or a NaN (this rank only).
  bool unscale_(const std::vector<at::Tensor>& grads) const;
  /// After a step: on overflow the scale backs off (never below min_scale) and the growth
  /// count restarts; otherwise the count grows and, at growth_interval, the scale grows.
  void update(bool found_inf);
  /// Consecutive finite steps since the last change of scale.
  int64_t growth_tracker() const { return growth_tracker_; }
  const GradScalerOptions& options() const { return options_; }

  /// scale, growth_tracker and the options, for checkpoints.
  std::map<std::string, double> state_dict() const;
  /// Restores state_dict(); throws std::invalid_argument naming a missing or invalid key.
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
};

}  // namespace tandem::precision
