// Activation checkpointing (torch.utils.checkpoint for LibTorch): a region's forward runs without
// keeping its activations, and runs again, with the same random numbers and autocast state,
// when its backward needs them.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/state.h"

namespace torch::nn {
class SequentialImpl;
class Sequential;
}  // namespace torch::nn

namespace tandem::parallel {

/// Options of checkpoint().
///
/// Example:
///   auto y = tandem::parallel::checkpoint(block_fn, x,
///                                         tandem::parallel::CheckpointOptions().preserve_rng_state(false));
struct CheckpointOptions {
  /// Restore the random number generators (the CPU one, and every CUDA device's when CUDA is
  /// available) to their state before the forward while the region runs again, so that dropout
  /// draws the same masks; false saves the copies but changes results of random regions.
  TORCH_ARG(bool, preserve_rng_state) = true;
};

/// A random stream a checkpointed region may draw from besides the default generators (a
/// TensorParallelRng is one): checkpoint() captures the state of every registered stream before
/// the region's first run, sets it again for the recompute, and puts back after the recompute
/// what the stream held, as it does for the default generators.
class RandomStream {
 public:
  virtual ~RandomStream() = default;
  virtual std::vector<at::Tensor> stream_state() const = 0;
  virtual void set_stream_state(const std::vector<at::Tensor>& state) = 0;
};

/// Registers `stream` with checkpoint() until unregister_random_stream(stream); its owner calls
/// both (TensorParallelRng in its constructor and destructor).
void register_random_stream(RandomStream* stream);
void unregister_random_stream(RandomStream* stream);

/// The function a checkpointed region computes.
using CheckpointFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs `fn(inputs)` without keeping the activations inside it: only `inputs` are saved, and
/// when the backward pass reaches the outputs, `fn` runs again (with gradients, on detached
/// copies of the inputs, with the random number state and the CPU/CUDA autocast state of the
/// first run) and its backward runs with the incoming gradients. The inputs' gradients are
/// returned to the outer backward; parameters used inside `fn` get theirs accumulated by the
/// nested backward (as PyTorch's reentrant checkpoint). After the second run the random number
/// state is put back, so the computation around the region is unaffected.
///
/// Under autocast the region runs without autocast's cache of low-precision weight copies (a copy
/// cast without gradients must not be reused), so a weight used twice under autocast (in the
/// region, or in it and after it) gets its gradient contributions summed after the cast instead
/// of before: equal to the plain run to the low-precision type's rounding, not bitwise.
///
/// With gradients disabled, or when neither an input nor the region needs gradients, this is
/// `fn(inputs)`. When no input requires gradients (the first block of a model), the outputs
/// still carry a backward (so that the parameters inside `fn` get gradients). Backward must be
/// called with `.backward()` (torch::autograd::backward), not torch::autograd::grad.
///
/// Example:
///   auto outs = tandem::parallel::checkpoint(
///       [&](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{block(in[0])}; },
///       {x});
std::vector<at::Tensor> checkpoint(CheckpointFunction fn, std::vector<at::Tensor> inputs,
                                   CheckpointOptions options = {});

/// One input, one output.
///
/// Example:
///   x = tandem::parallel::checkpoint([&](const torch::Tensor& t) { return block(t); }, x);
at::Tensor checkpoint(std::function<at::Tensor(const at::Tensor&)> fn, at::Tensor input,
                      CheckpointOptions options = {});

/// Queues `callback` to run once the backward pass that is running ends (the autograd engine's
/// final callback). Note [Callbacks in a recompute]: the backward of a checkpointed region runs
/// as a nested backward (its own graph task), and the engine's queue_callback attaches a
/// callback to the graph task running on this thread, so a callback queued from a hook that
/// fires inside the nested backward would run when the nested backward ends, before the outer
/// backward produced the other gradients. Inside a recompute this function holds the callback
/// back instead, and the checkpoint queues it on the outer graph task once its nested backward
/// returned (any depth of nesting). Outside a recompute it is the engine's queue_callback.
void queue_backward_callback(std::function<void()> callback);

/// Note [Unused parameters in a recompute]: called by a checkpointed module's recompute (a
/// TANDEM_MODULE block or a Checkpointed wrapper) after its forward ran again and before its
/// nested backward, with the recomputed outputs the backward starts from and the module's
/// parameters: those the recomputed graph does not reach get no gradient in this backward.
/// Accelerator::backward sets it for the duration of a backward whose reducers find unused
/// parameters; nullptr clears it. Returns the previous observer.
using RecomputeObserver = std::function<void(const std::vector<at::Tensor>& outputs,
                                             const std::vector<at::Tensor>& parameters)>;
RecomputeObserver set_recompute_observer(RecomputeObserver observer);

/// How many checkpoint recomputes (nested backward passes) are running on this thread.
int checkpoint_recompute_depth();
/// Whether this thread runs a checkpointed region's recompute: its forward again, or the nested
/// backward after it (a module that counts its forwards, as a router its tokens, skips these).
bool in_checkpoint_recompute();

/// A module whose forward is checkpointed. The inner module's children, parameters and buffers
/// are registered on the wrapper under their own names, so that parameter names (and
/// checkpoints) are the same with and without the wrapper: `Checkpointed(Linear(4, 3))`
/// registered as "fc" has "fc.weight" and "fc.bias". The inner module's forward takes one tensor
/// and returns one tensor.
///
/// Under ZeRO-3 both nestings work: `Sharded(Checkpointed(Block()))` (what the auto-wrap makes of
/// a Sequential of Checkpointed entries) gathers the unit around the first forward and before
/// the backward, which recomputes inside; `Checkpointed(Sharded(Block()))` gathers the unit again
/// for the recompute and frees it after.
///
/// Example:
///   struct NetImpl : torch::nn::Module {
///     NetImpl() { for (int i = 0; i < 8; ++i)
///                   blocks.push_back(register_module("h" + std::to_string(i),
///                                                    tandem::parallel::Checkpointed(Block()))); }
///     torch::Tensor forward(torch::Tensor x) { for (auto& b : blocks) x = b->forward(x); return x; }
///     std::vector<tandem::parallel::Checkpointed> blocks;
///   };
class CheckpointedImpl : public torch::nn::Module {
 public:
  /// Wraps a module holder (Linear(...), a TORCH_MODULE type) or an AnyModule.
  template <class M>
  explicit CheckpointedImpl(M module, CheckpointOptions options = {})
      : inner_(std::move(module)), options_(options) {
    adopt();
  }
  explicit CheckpointedImpl(torch::nn::AnyModule module, CheckpointOptions options = {})
      : inner_(std::move(module)), options_(options) {
    adopt();
  }

  torch::Tensor forward(torch::Tensor input);

  /// The wrapped module.
  std::shared_ptr<torch::nn::Module> inner() const { return inner_.ptr(); }
  const CheckpointOptions& options() const { return options_; }

 private:
  void adopt();
  torch::nn::AnyModule inner_;
  CheckpointOptions options_;
};
TORCH_MODULE(Checkpointed);

/// Which modules apply_activation_checkpointing wraps: the entry's qualified name in the model
/// ("layers.3") and the entry itself.
using CheckpointPredicate = std::function<bool(const std::string& name, torch::nn::Module& module)>;

/// Wraps every entry of `sequential` in a Checkpointed module, in place (entries already
/// Checkpointed stay as they are). Parameter names are unchanged. Returns the wrappers made.
std::vector<std::shared_ptr<CheckpointedImpl>> checkpoint_sequential_entries(
    torch::nn::SequentialImpl& sequential, CheckpointOptions options = {});
std::vector<std::shared_ptr<CheckpointedImpl>> checkpoint_sequential_entries(
    torch::nn::Sequential& sequential, CheckpointOptions options = {});

/// Wraps, in place, every entry of every Sequential inside `model` (the model itself included)
/// for which `predicate` is true in a Checkpointed module; entries that do not match are searched
/// further. Parameter names are unchanged. Returns the wrappers made.
///
/// A matching module that its parent calls through its own member (`blocks[i](x)` in a
/// hand-written forward) is checkpointed through a forward hook when it is hookable (declared
/// with TANDEM_MODULE, tandem/nn/module.h; it is not among the wrappers returned: describe_hooks
/// shows it); one that is not hookable cannot be reached from outside, and matching it is an
/// error that says so (wrap it where it is built: `register_module("h0", Checkpointed(Block()))`).
///
/// Example:
///   tandem::parallel::apply_activation_checkpointing(*model, [](const std::string&, torch::nn::Module& m) {
///     return dynamic_cast<BlockImpl*>(&m) != nullptr;
///   });
std::vector<std::shared_ptr<CheckpointedImpl>> apply_activation_checkpointing(
    torch::nn::Module& model, const CheckpointPredicate& predicate, CheckpointOptions options = {});

/// What activation checkpointing from the configuration checkpoints (fsdp_activation_checkpointing,
/// --activation_checkpointing): with `classes` (fsdp_transformer_layer_cls_to_wrap), every module
/// of those classes; without, every entry of a Sequential model, else the outermost Sequential
/// entries and modules declared with TANDEM_MODULE (not tandem::nn's standard layers), leaving out
/// a module that shares a parameter with the rest of the model (a head tied to the embedding:
/// Note [Tied weights are not blocks]). Sequential
/// entries are wrapped in Checkpointed, hookable modules get a forward hook. Throws
/// std::invalid_argument when a class names no module, a module of a named class cannot be
/// reached (a typed member not declared with TANDEM_MODULE), or nothing at all was reached.
/// Returns how many modules are checkpointed.
int checkpoint_model_blocks(torch::nn::Module& model, const std::vector<std::string>& classes = {},
                            CheckpointOptions options = {});

}  // namespace tandem::parallel
