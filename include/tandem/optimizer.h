// AcceleratedOptimizer: the optimizer the Accelerator hands back from prepare(); its step() and
// zero_grad() act only on gradient-synchronisation boundaries.
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>

namespace tandem {

class Accelerator;

/// Wraps a LibTorch optimizer. Off the boundary of a gradient-accumulation cycle, step() and
/// zero_grad() do nothing (as Accelerate's AcceleratedOptimizer).
class AcceleratedOptimizer {
 public:
  AcceleratedOptimizer() = default;
  /// `owner` points at the Accelerator's liveness cell: the Accelerator while it lives, null
  /// after its destructor ran (Note [Accelerator lifetime]).
  AcceleratedOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                       std::shared_ptr<Accelerator* const> owner)
      : optimizer_(std::move(optimizer)), owner_(std::move(owner)) {}

  /// Steps on a synchronisation boundary (unless a mixed-precision scaler skips it).
  void step();
  /// The step of an optimizer that evaluates the loss itself (torch::optim::LBFGS): `closure`
  /// clears the gradients, runs the forward and acc.backward(loss), and returns the loss. As
  /// step() otherwise; returns what the optimizer's step returns (undefined when skipped).
  /// Refused under ZeRO, whose gradients are shards.
  at::Tensor step(const torch::optim::Optimizer::LossClosure& closure);
  /// Clears gradients on a synchronisation boundary.
  void zero_grad();
  /// Whether the last step() was skipped (fp16 overflow, or off the boundary).
  bool step_was_skipped() const { return skipped_; }

  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const std::shared_ptr<torch::optim::Optimizer>& ptr() const { return optimizer_; }
  torch::optim::Optimizer* operator->() { return optimizer_.get(); }

 private:
  // The Accelerator that prepared this optimizer, or null for a plain one; throws when that
  // Accelerator was destroyed.
  Accelerator* owner() const;

  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<Accelerator* const> owner_;
  bool skipped_ = false;
};

}  // namespace tandem
