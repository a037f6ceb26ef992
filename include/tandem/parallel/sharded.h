// Sharded: a ZeRO-3 / FSDP FULL_SHARD unit. LibTorch modules have no forward hooks, so the
// module whose parameters are gathered before its forward and freed after it is wrapped in a
// Sharded holder that does exactly that (and regathers them before its backward). Under any other
// strategy a Sharded module is its inner module and nothing more.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <vector>

namespace tandem::parallel {

namespace detail {
/// What the ZeRO-3 strategy does around a Sharded module's forward and backward.
class ShardedHooks {
 public:
  virtual ~ShardedHooks() = default;
  virtual void before_forward() = 0;   ///< gather the unit's parameters
  virtual void after_forward() = 0;    ///< free them again
  virtual void before_backward() = 0;  ///< gather them for the unit's backward
};

/// Note [A ZeRO-3 unit's forward]: runs `forward` (the unit's own call) between
/// hooks->before_forward() and after_forward() (after_forward also when it throws); every output
/// that requires grad gathers the unit again (before_backward) when its gradient arrives, before
/// any of the unit's own backward runs. Both kinds of unit, Sharded wrappers and hooked modules
/// (Note [ZeRO-3 units on hooks]), run their forward through it.
std::vector<at::Tensor> run_unit(const std::shared_ptr<ShardedHooks>& hooks,
                                 const std::function<std::vector<at::Tensor>()>& forward);
}  // namespace detail

/// A module whose parameters form one ZeRO-3 unit. The inner module's children, parameters and
/// buffers are registered on the wrapper under their own names, so that parameter names (and
/// checkpoints) are the same with and without the wrapper: `Sharded(Linear(4, 3))` registered as
/// "fc" has "fc.weight" and "fc.bias". The inner module's forward takes one tensor and returns
/// one tensor.
///
/// Under ZeRO-3 the Accelerator wraps every entry of a Sequential that has parameters (the
/// auto-wrap policy); wrap blocks yourself where a model calls them from its own forward:
///   struct GPTImpl : torch::nn::Module {
///     GPTImpl() { for (int i = 0; i < 12; ++i)
///                   blocks.push_back(register_module("h" + std::to_string(i),
///                                                    tandem::parallel::Sharded(Block())); }
///     torch::Tensor forward(torch::Tensor x) { for (auto& b : blocks) x = b->forward(x); ... }
///     std::vector<tandem::parallel::Sharded> blocks;
///   };
class ShardedImpl : public torch::nn::Module {
 public:
  /// Wraps a module holder (Linear(...), a TORCH_MODULE type) or an AnyModule.
  template <class M>
  explicit ShardedImpl(M module) : inner_(std::move(module)) {
    adopt();
  }
  explicit ShardedImpl(torch::nn::AnyModule module) : inner_(std::move(module)) { adopt(); }

  torch::Tensor forward(torch::Tensor input);

  /// The wrapped module.
  std::shared_ptr<torch::nn::Module> inner() const { return inner_.ptr(); }
  /// Set by the ZeRO-3 strategy (nullptr: a plain pass-through).
  void set_hooks(std::shared_ptr<detail::ShardedHooks> hooks) { hooks_ = std::move(hooks); }
  bool has_hooks() const { return hooks_ != nullptr; }
  /// Refused while ZeRO-3 holds the parameters in shards (Note [Saving a sharded model]).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void adopt();
  torch::nn::AnyModule inner_;
  std::shared_ptr<detail::ShardedHooks> hooks_;
};
TORCH_MODULE(Sharded);

/// Which entries wrap_sequential_entries wraps (besides their size); empty: every one.
using UnitPredicate = std::function<bool(torch::nn::Module&)>;

/// Wraps every entry of every Sequential inside `model` (the model itself included) that has at
/// least `min_num_params` parameters (and for which `predicate` holds) in a Sharded module, in
/// place: the wrapper takes the entry's place in the Sequential and among its registered
/// children (named_modules() shows it), and parameter names are unchanged. Entries already
/// wrapped, and Sequentials inside a wrapped entry, are left alone; entries not wrapped are
/// searched further. Returns the wrappers made.
std::vector<std::shared_ptr<ShardedImpl>> wrap_sequential_entries(torch::nn::Module& model,
                                                                  int64_t min_num_params = 1,
                                                                  const UnitPredicate& predicate = {});

}  // namespace tandem::parallel
