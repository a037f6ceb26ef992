// MixedPrecision: the precision component of a run. It owns the validated policy, the loss
// scaler, the fp32 master weights of the -true modes and the skip decision of a step whose
// gradients overflowed on some rank. The Accelerator owns one and calls it at fixed points
// (prepare, backward, before and after an optimizer step, zero_grad, clipping, metrics).
// See docs/mixed_precision.md.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tandem/precision/autocast.h"
#include "tandem/precision/fp8.h"
#include "tandem/precision/grad_scaler.h"
#include "tandem/precision/policy.h"

namespace tandem {
class ProcessGroup;
namespace checkpoint {
class SafetensorsFile;
}
}  // namespace tandem

namespace tandem::precision {

/// What a MixedPrecision is built from. Unset values take the defaults; the Accelerator fills
/// them from its config::RunConfig (TANDEM_MIXED_PRECISION, TANDEM_DOWNCAST_BF16, TANDEM_FP8_*
/// resolved there).
///
/// Example:
///   precision::MixedPrecision mp(precision::MixedPrecisionOptions().mode("bf16"), c10::kCPU,
///                                "[rank 0/1]");
struct MixedPrecisionOptions {
  /// no, bf16, fp16, bf16-true, fp16-true or fp8.
  TORCH_ARG(std::optional<std::string>, mode) = std::nullopt;
  /// -true modes: fp32 master copies (default: on for fp16-true, off for bf16-true).
  TORCH_ARG(std::optional<bool>, master_weights) = std::nullopt;
  /// bf16 modes: metric reductions hand fp32 results back as bf16.
  TORCH_ARG(std::optional<bool>, downcast_bf16) = std::nullopt;
  /// Dynamic loss scaling: unset: on for fp16 and fp16-true only.
  TORCH_ARG(std::optional<bool>, loss_scaling) = std::nullopt;
  TORCH_ARG(GradScalerOptions, grad_scaler) = {};
  /// The fp8 recipe (unset: the defaults).
  TORCH_ARG(std::optional<Fp8Options>, fp8) = std::nullopt;
};

/// The precision component. Not copyable; one per Accelerator.
class MixedPrecision {
 public:
  /// Validates the mode against this LibTorch and `device` (throws std::invalid_argument
  /// prefixed with `prefix`, naming the mode and the fix).
  MixedPrecision(MixedPrecisionOptions options, c10::DeviceType device, std::string prefix);
  MixedPrecision(const MixedPrecision&) = delete;
  MixedPrecision& operator=(const MixedPrecision&) = delete;

  const PrecisionPolicy& policy() const { return policy_; }
  /// The fp8 recipe in force (validated), when the mode is fp8.
  const std::optional<Fp8Options>& fp8() const { return fp8_; }
  /// The loss scaler (fp16 and fp16-true), nullptr otherwise.
  GradScaler* scaler() { return scaler_.get(); }

  /// An autocast region for this mode (nothing under no and the -true modes); enabled=false
  /// turns autocast off inside an enclosing region.
  AutocastGuard autocast(bool enabled = true) const;
  /// Casts a model to the weights' dtype of the mode (the -true modes).
  void cast_model(torch::nn::Module& model) const;
  /// The loss backward runs on: fp32 under mixed precision, divided by `accumulation_steps`,
  /// multiplied by the loss scale. Marks the boundary's gradients as not yet unscaled.
  at::Tensor loss_for_backward(const at::Tensor& loss, int accumulation_steps);

  /// Registers an optimizer. Under a -true mode with master weights its half parameters are
  /// replaced by fp32 masters it steps instead; `strategy_owns_masters`: a sharding strategy
  /// already made it step fp32 shards, so none are installed.
  void register_optimizer(torch::optim::Optimizer& optimizer, bool strategy_owns_masters);
  /// The fp32 master of a half parameter, or an undefined tensor.
  at::Tensor master_parameter(const at::Tensor& p) const;

  /// Copies the half gradients into the masters and unscales once per boundary; every rank of
  /// `pg` agrees whether some gradient overflowed. Again before the next backward: nothing.
  void unscale_gradients(ProcessGroup* pg);
  /// Before an optimizer step: false when the step must be skipped (inf/NaN on some rank).
  bool before_step(ProcessGroup* pg);
  /// After an optimizer step: masters copied over the half weights, autocast cache cleared.
  void after_step(torch::optim::Optimizer& optimizer);
  /// Zeroes the half parameters' gradients of an optimizer stepping masters.
  void zero_grad(torch::optim::Optimizer& optimizer);
  /// Whether the last step was skipped.
  bool step_was_skipped() const { return step_skipped_; }
  /// Whether an optimizer steps fp32 masters of half parameters (installed by this component).
  bool has_master_weights() const { return !master_of_.empty(); }
  /// The tensors whose gradients clipping acts on: masters where they exist, each tensor once.
  std::vector<at::Tensor> grads_to_clip(const std::vector<at::Tensor>& parameters) const;

  /// Metric reductions: a half tensor is reduced in fp32 ...
  at::Tensor metric_input(const at::Tensor& t) const;
  /// ... and handed back as bf16 with downcast_bf16.
  at::Tensor metric_result(const at::Tensor& t) const;

  // ---- checkpoint parts ----------------------------------------------------------------------
  /// The fp32 masters an optimizer steps, keyed "g<group>.p<index>" (empty without masters).
  std::vector<std::pair<std::string, at::Tensor>> master_weights_of(
      const torch::optim::Optimizer& optimizer) const;
  /// Restores the masters of `optimizer` from `file`, or rebuilds them from the (already
  /// loaded) half weights when the checkpoint has none (file == nullptr).
  /// Note [Masters on resume]. `announce`: this process reports what it did on stderr.
  void load_master_weights(torch::optim::Optimizer& optimizer,
                           const checkpoint::SafetensorsFile* file, const std::string& dir,
                           bool announce);
  /// The scaler's state and the skip flag, as JSON text.
  std::string state_dict() const;
  /// Restores state_dict(); a key missing from an older checkpoint keeps its current value.
  void load_state_dict(const std::string& state);

 private:
  struct MasterSet {  // one optimizer's half parameters and their fp32 masters
    torch::optim::Optimizer* optimizer = nullptr;
    std::vector<at::Tensor> params, masters;
  };
  std::string prefix_;
  c10::DeviceType device_;
  PrecisionPolicy policy_;
  std::optional<Fp8Options> fp8_;
  std::unique_ptr<GradScaler> scaler_;
  std::vector<MasterSet> masters_;               // every registered optimizer
  std::map<const void*, at::Tensor> master_of_;  // half parameter's TensorImpl -> fp32 master
  bool boundary_prepared_ = false;  // gradients unscaled/copied up since the last backward
  bool found_inf_ = false;          // on any rank, at the last unscale
  bool step_skipped_ = false;
};

}  // namespace tandem::precision
