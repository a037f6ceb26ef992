// Strategies: how a run distributes the model, its gradients and its optimizer state. The
// Accelerator picks one from the distributed type and calls it at fixed points of a step;
// nothing else in tandem asks which strategy runs.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tandem/checkpoint/model_io.h"
#include "tandem/checkpoint/optimizer_state.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/ddp.h"
#include "tandem/parallel/sharding_options.h"
#include "tandem/state.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace tandem::checkpoint {
struct StatePart;
}
namespace tandem::precision {
class MixedPrecision;
}

namespace tandem::parallel {

class Topology;

/// What only a strategy that shards the parameters (ZeRO-3) does: whole parameters on demand,
/// and units sharded while a model is built. Strategy::parameter_sharding() gives it.
class ParameterSharding {
 public:
  virtual ~ParameterSharding() = default;
  /// Gathers every unit's parameters until release_units (Accelerator::full_parameters).
  virtual void gather_units() = 0;
  virtual void release_units() = 0;
  /// Note [Sharded construction]: whether `module` (complete; `explicit_unit`: a Sharded
  /// wrapper), built under Accelerator::build, is a unit, and its sharding: it is on the run's
  /// device, cast, and holds rank 0's values.
  virtual bool unit_at_construction(torch::nn::Module& module, bool explicit_unit) = 0;
  virtual void shard_built(torch::nn::Module& module) = 0;
};

/// A collective a strategy ran outside the gradient reducer, for the timeline: an all-gather of
/// a ZeRO-3 unit from when it was issued to when it was seen complete (`prefetch`: issued ahead
/// of its use), or the time the computation waited for one (`wait`).
struct CommSpan {
  std::string name;
  std::chrono::steady_clock::time_point start, end;
  bool wait = false;
};

/// An optimizer's state in a checkpoint saved on another layout, by the dense names of its
/// parameters ("model<m>." before them with several models, as ZeRO names them), each tensor
/// cut for this rank's tensor-parallel coordinate (Note [Resharding a checkpoint]).
struct ResavedOptimizer {
  /// The saved optimizer's type and its parameter groups' options (checkpoint::optimizer_state's
  /// JSON).
  std::string json;
  /// The fields saved for a parameter ("exp_avg", ...); empty: it had not stepped.
  std::function<std::vector<std::string>(const std::string& name)> fields;
  std::function<at::Tensor(const std::string& name, const std::string& field)> field;
  std::function<std::optional<int64_t>(const std::string& name)> step;
  /// Whether the saving run kept an fp32 master of it, and the master.
  std::function<bool(const std::string& name)> has_master;
  std::function<at::Tensor(const std::string& name)> master;
};

/// What a strategy needs to know of the run: its group and the run's precision.
struct StrategyContext {
  /// The group data parallel runs over (the topology's "dp"; Note [A topology always built]).
  std::shared_ptr<ProcessGroup> pg;
  /// The group ZeRO shards over (the topology's "dp_shard"); unset: `pg`.
  std::shared_ptr<ProcessGroup> shard_pg;
  /// This rank's replicas under hybrid sharding (the topology's "dp_replicate"); unset or of
  /// size 1: none. The data-parallel group `pg` is dp_replicate x dp_shard.
  std::shared_ptr<ProcessGroup> replicate_pg;
  /// The whole data-parallel group ("dp"), kept when make_strategy points `pg` at `shard_pg`.
  std::shared_ptr<ProcessGroup> dp_pg;
  c10::Device device = c10::Device(c10::kCPU);
  /// The optimizer steps fp32 copies of half parameters (the -true modes with master weights).
  bool master_weights = false;
  /// The data-parallel reducer's settings (bucket sizes, hook, unused parameters, views).
  ReducerOptions reducer;
};

/// One run's way of distributing training. The Accelerator calls, in this order:
/// prepare_model for each model (on its device, cast, rank 0's state broadcast), then
/// prepare_optimizer for each optimizer over prepared models' parameters; per micro-step
/// set_sync and after_backward; on a boundary clip_grad_norm/clip_grad_value (when the user
/// clips), after_step once the optimizer stepped, and zero_grad after the optimizer's.
class Strategy {
 public:
  virtual ~Strategy() = default;
  /// "ddp", "zero-1", "zero-2", ...
  virtual std::string name() const = 0;
  virtual void prepare_model(const std::shared_ptr<torch::nn::Module>& model) = 0;
  /// true: the strategy made the optimizer step fp32 copies itself (the precision component
  /// then installs no master weights of its own).
  virtual bool prepare_optimizer(torch::optim::Optimizer& optimizer) = 0;
  /// false: backward keeps gradients local (accumulation micro-steps, no_sync).
  virtual void set_sync(bool sync) = 0;
  virtual void after_backward() = 0;
  /// The p-th powers of the gradients' norm over every rank's shards (p = norm_type; for the
  /// infinity norm, maxima), combined over the strategy's group, in two parts: {parameters
  /// `split` names (tensor-parallel shards, whose parts other tp ranks hold), the others}.
  /// `split` may be empty (no tensor parallel: everything in the second part). nullopt when
  /// nothing is sharded (the Accelerator then measures the parameters it was given). The
  /// Accelerator combines the parts over the mesh (Note [Clipping under model parallel]).
  virtual std::optional<std::array<double, 2>> grad_norm_parts(
      const std::function<bool(const at::Tensor&)>& /*split*/, double /*norm_type*/) {
    return std::nullopt;
  }
  /// Multiplies the gradients grad_norm_parts measured by `coef`.
  virtual void scale_gradients(double /*coef*/) {}
  /// Clamps the sharded gradients; false when nothing is sharded.
  virtual bool clip_grad_value(double /*clip_value*/) { return false; }
  /// Steps `optimizer` (its own step; ZeRO with its state on disk streams it in and out around
  /// a step per unit: Note [Optimizer state on disk]).
  virtual void step(torch::optim::Optimizer& optimizer);
  /// After `optimizer` stepped: brings every rank's parameters up to date.
  virtual void after_step(torch::optim::Optimizer& /*optimizer*/) {}
  /// After `optimizer.zero_grad()`: clears the gradients the optimizer does not see.
  virtual void zero_grad(torch::optim::Optimizer& /*optimizer*/) {}
  /// Whether `optimizer`'s state is sharded across the ranks (each rank checkpoints its part).
  virtual bool shards_optimizer(const torch::optim::Optimizer& /*optimizer*/) const {
    return false;
  }
  /// This rank's part of a sharded optimizer's state (shards_optimizer): the state of its
  /// shards as checkpoint::optimizer_state gives it, with the layout in the JSON ("zero").
  virtual checkpoint::OptimizerState optimizer_shard_state(
      const torch::optim::Optimizer& optimizer) const;
  /// Restores a sharded optimizer from the parts the ranks of the saving run's sharding group
  /// wrote (their number is in the parts' own layout, "zero"."world"): `json(r)` is part r's
  /// JSON, `tensor(r, name)` one of its tensors. The saving run may have had any number of ranks.
  virtual void load_optimizer_shards(
      torch::optim::Optimizer& optimizer,
      const std::function<std::string(int)>& json,
      const std::function<at::Tensor(int, const std::string&)>& tensor);
  /// Restores a sharded optimizer from a checkpoint saved on another layout (Note [Resharding a
  /// checkpoint]): `saved` gives each parameter's state by its dense name, already cut for this
  /// rank's tensor-parallel coordinate. The model is loaded first.
  virtual void load_optimizer_resharded(torch::optim::Optimizer& optimizer,
                                        const ResavedOptimizer& saved);
  /// Loads `model`'s parameters and buffers from `local(name)`: this rank's tensor-parallel
  /// part of each dense tensor of a checkpoint saved on another layout. Under ZeRO-3 each rank
  /// copies only its shards' elements.
  virtual void load_model_tensors(torch::nn::Module& model,
                                  const std::function<at::Tensor(const std::string&)>& local);
  /// `model`'s parameters and buffers by name (model_tensor_names order) on the main process,
  /// for a checkpoint. Every rank calls it: under ZeRO-3 the units are gathered one at a time and
  /// only the main process keeps copies (the other ranks get an empty list).
  virtual std::vector<std::pair<std::string, at::Tensor>> model_state(torch::nn::Module& model);
  /// Loads weights written from model_state, or any safetensors file or index with the model's
  /// names (checkpoint::load_model's `path` and `options`), into `model`. Under ZeRO-3 each rank
  /// reads only its shards' byte ranges (Note [Loading into shards]).
  virtual checkpoint::LoadReport load_model_state(torch::nn::Module& model,
                                                  const std::string& path,
                                                  const checkpoint::LoadOptions& options = {});
  /// The gradient reducers (for timelines and tests).
  virtual std::vector<const GradientReducer*> reducers() const = 0;
  /// Note [Unused parameters known before backward]: every reducer learns which parameters the
  /// coming backward cannot reach.
  void prepare_for_backward(const std::function<bool(const at::Tensor&)>& reached) {
    for (const auto* r : reducers()) const_cast<GradientReducer*>(r)->prepare_for_backward(reached);
  }
  /// Note [Unused parameters in a recompute]: the same for a checkpointed region's parameters.
  void prepare_region_for_backward(const std::vector<at::Tensor>& region,
                                   const std::function<bool(const at::Tensor&)>& reached) {
    for (const auto* r : reducers())
      const_cast<GradientReducer*>(r)->prepare_region_for_backward(region, reached);
  }
  /// What a strategy that shards the parameters (ZeRO-3) does besides; nullptr for the others,
  /// whose parameters are always whole.
  virtual ParameterSharding* parameter_sharding() { return nullptr; }
  /// The all-gathers (and waits for them) since the last call, for the timeline; none unless
  /// `record` was set (the Accelerator sets it when it writes a timeline).
  virtual std::vector<CommSpan> take_comm_spans() { return {}; }
  virtual void record_comm_spans(bool /*record*/) {}

  /// The checkpoint's "models" and "optimizers" parts for the models and optimizers this
  /// strategy runs, laid out for `topology` (Note [Model-parallel checkpoints]: which file each
  /// rank writes, which ranks' files it reads back, and reloading ZeRO shards on another world).
  /// The parts keep references to the arguments: use them before any of them changes.
  /// `names[i]`, where given, renames model i's tensors in the files (Note [Pipeline checkpoint
  /// names]); a model without one keeps its own names.
  std::vector<checkpoint::StatePart> checkpoint_parts(
      const Topology& topology, precision::MixedPrecision& precision,
      const std::vector<std::shared_ptr<torch::nn::Module>>& models,
      const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers,
      const std::vector<std::function<std::string(const std::string&)>>& names = {});
};

/// The strategy for `type` and `sharding` (nullopt: data parallel). Throws
/// std::invalid_argument for a combination tandem cannot run, naming it and the fix.
std::unique_ptr<Strategy> make_strategy(DistributedType type,
                                        const std::optional<ShardingOptions>& sharding,
                                        StrategyContext context);

}  // namespace tandem::parallel
