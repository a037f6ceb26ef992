// ZeRO's gradient reduction: the hook that reduce-scatters (or allreduces) each unit's bucket
// into this rank's shard, and the markers that let a model's own zero_grad reach the shards
// (Note [Hybrid sharding], Note [Clearing sharded gradients through the model]).
#pragma once

#include "units.h"

namespace tandem::parallel::detail::zero {

// Note [Hybrid sharding]: with dp_replicate above 1 (FSDP's HYBRID_SHARD and
// HYBRID_SHARD_ZERO2: one replica per machine), ZeRO's group is the ranks of one replica
// ("dp_shard"): its all-gathers and reduce-scatters stay inside a machine. Each gradient is
// divided by the whole data-parallel size on its way into its bucket, reduced over the replica,
// and this rank's reduced chunk is then allreduced over its replicas ("dp_replicate": the ranks
// of the other machines that hold the same chunk), so that every replica steps the same shards
// with the average of every rank's gradients, as data parallel does. What crosses machines per
// step is the shards' gradients (2 (R-1)/R of the shard per rank), never parameters. The
// unused-parameter map spans every data-parallel rank; the gradient norm sums over one replica
// (the others hold the same chunks); checkpoints hold the first replica's shards.
struct ShardedOptimizer;

// The reduction of one unit's gradient bucket. Stage 1, and stage 2 with kAllreduceSlice:
// the bucket's real elements are allreduced in place, exactly as data parallel's bucket (the
// same Gloo call on the same bytes, so the same sums), and this rank's chunk is taken. Stage 2
// with kAlltoall: the padded bucket is reduce-scattered. The reducer has already divided each
// gradient by the world size on its way in, so every path sums.
class ZeroHook : public CommHook {
 public:
  ZeroHook(ShardedOptimizer* owner, int stage, ProcessGroup::ReduceScatterAlgorithm algorithm)
      : owner_(owner), stage_(stage), algorithm_(algorithm) {}
  Work start(ProcessGroup& pg, GradBucket& b) override;
  void finish(GradBucket& b, Work& w) override;
  std::string name() const override { return "zero-" + std::to_string(stage_); }
  bool reducer_divides() const override { return true; }

 private:
  bool slices() const {
    return stage_ == 1 || algorithm_ == ProcessGroup::ReduceScatterAlgorithm::kAllreduceSlice;
  }
  ShardedOptimizer* owner_;
  int stage_;
  ProcessGroup::ReduceScatterAlgorithm algorithm_;
};

struct ShardedOptimizer;

// Note [Clearing sharded gradients through the model]: from stage 2 on, a parameter's gradient
// lives in its unit's shard (shard_param.grad()) once reduced, and the parameter's own .grad is
// released. LibTorch programs clear gradients through the model too (`model->zero_grad()`, a
// loop of `p.grad().zero_()`), which would never reach the shards: the next step would add the
// old gradient in. So each released .grad holds a marker instead, a meta tensor of the
// parameter's shape (no memory): `zero_grad()` through the module resets it (set_to_none) or
// replaces it with a zeroed detached copy, and `p.grad().zero_()` bumps its version. The next
// backward's first gradient hook (a tensor hook, which runs before autograd accumulates into
// .grad) reads every marker, zeroes the shard's slice of each parameter cleared through any of
// these routes (all of a unit's parameters cleared and none zeroed in place: the shard gradient
// is dropped, as set_to_none does), and removes the markers, so autograd accumulates into an
// empty .grad as before. A parameter whose marker is untouched keeps its shard gradient, which
// the backward adds to, as .grad accumulates under data parallel.
// Markers are planted when the backward's reduction is over (the last bucket's finish), never
// during it:
// a unit reduced early in a backward would otherwise have its markers taken by the check of a
// later parameter's hook in the same backward, and a later clearing would be missed.
struct MarkerCheck {
  ShardedOptimizer* owner = nullptr;
  std::mutex mu;
  bool planted = false;
  void check();
  void plant();  // every unit reduced since the last planting
  void drop();   // the strategy lets go: no marker stays in a parameter's .grad
};

struct ShardedOptimizer {
  torch::optim::Optimizer* optimizer = nullptr;
  std::shared_ptr<MarkerCheck> markers = std::make_shared<MarkerCheck>();
  std::unique_ptr<GradientReducer> reducer;
  std::vector<Unit> units;
  std::vector<size_t> unit_of_bucket;
  std::shared_ptr<ProcessGroup> pg;
  std::shared_ptr<ProcessGroup> replicas;  // Note [Hybrid sharding]; null without replicas
  std::unique_ptr<StateOnDisk> disk;       // Note [Optimizer state on disk]; null: in memory
  // Note [Expert parallel]: the experts this rank holds whole, stepped after the units of their
  // parameter group, in this order.
  struct Expert {
    std::string name;  // qualified, as the units name their parameters
    at::Tensor param;
    int group = 0;
  };
  std::vector<Expert> experts;
  ~ShardedOptimizer() { markers->drop(); }
};

// A unit's markers (MarkerCheck::mu held).
void plant_markers(ShardedOptimizer& s, Unit& u);

// Each unit's index among its parameter group's units: the index of its shard in the
// optimizer's group, which names its state in checkpoints (optimizer_param_key).
std::vector<size_t> index_in_group(const ShardedOptimizer& s);
/// The same for each of its experts, which follow the units of their group.
std::vector<size_t> expert_index_in_group(const ShardedOptimizer& s);

}  // namespace tandem::parallel::detail::zero
