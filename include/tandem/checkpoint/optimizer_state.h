// Optimizer state as safetensors + JSON: LibTorch's per-parameter state (momentum buffers, Adam
// moments, step counts) and each parameter group's hyper-parameters, without torch::save.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
class LRScheduler;
}  // namespace torch::optim

namespace tandem::checkpoint {

/// Tensors of an optimizer's state, named "g<group>.p<index>.<field>", and a JSON document with
/// the optimizer's type, every group's hyper-parameters and the scalar state (step counts).
struct OptimizerState {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::string json;
};

/// The key of parameter `index` of parameter group `group` in checkpoint files ("g<group>.p<index>"):
/// the optimizer state's tensors ("g0.p3.exp_avg") and the fp32 master weights ("g0.p3").
std::string optimizer_param_key(size_t group, size_t index);

/// Reads the state of SGD, Adam, AdamW, Adagrad or RMSprop. Other optimizers: an error that
/// suggests register_for_checkpointing.
OptimizerState optimizer_state(const torch::optim::Optimizer& optimizer);

/// Restores a state read by optimizer_state into an optimizer of the same type over parameters
/// of the same shapes (checked; an error names the first mismatch).
void load_optimizer_state(torch::optim::Optimizer& optimizer, const OptimizerState& state);

/// The state tensors of `param` in `optimizer` (SGD, Adam, AdamW, Adagrad, RMSprop), every
/// field of its type by name ("exp_avg", ...) with a pointer into the optimizer's state, defined
/// or not; empty while the parameter has no state (before its first step). Other optimizers:
/// the error of optimizer_state.
std::vector<std::pair<std::string, at::Tensor*>> optimizer_state_tensors(
    torch::optim::Optimizer& optimizer, const at::Tensor& param);

/// The step count of a LibTorch LR scheduler, and setting it back (the learning rates themselves
/// live in the optimizer's hyper-parameters).
unsigned scheduler_step_count(const torch::optim::LRScheduler& scheduler);
void set_scheduler_step_count(torch::optim::LRScheduler& scheduler, unsigned count);

}  // namespace tandem::checkpoint
