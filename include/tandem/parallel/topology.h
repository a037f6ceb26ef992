// Topology: the parallel layout of a run, every degree in one object (pp, dp_replicate,
// dp_shard, tp; dp = dp_replicate x dp_shard), validated once, always built (sizes of 1 are
// dimensions like any other), and asked for the group each kind of work runs over; plus the
// arithmetic that spans its dimensions (the whole model's gradient norm, the whole model's
// state, the "mesh" part of a checkpoint).
//
// Note [A topology always built]: every run has a Topology, a plain data-parallel one too (pp 1 x
// dp_replicate W x dp_shard 1 x tp 1). Nothing asks whether a mesh exists; what differs between
// layouts is the sizes, and the code that spans dimensions reads them (a size-1 group's
// collectives return at once). A slice that holds every rank is the world group itself, so a
// plain job opens no second connection. The degrees come from config::RunConfig (resolved once);
// which strategy reads which group: data parallel and the metric collectives "dp", ZeRO
// "dp_shard" (and its gradients over "dp_replicate" too: Note [Hybrid sharding]), tensor parallel
// "tp", the pipeline "pp"; barriers the world.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tandem/checkpoint/training_state.h"
#include "tandem/comm/mesh.h"

namespace torch::nn {
class Module;
}

namespace tandem::parallel {

class Strategy;

/// The run's layout and its groups (torchtitan's ParallelDims with the mesh built).
///
/// Example:
///   tandem::parallel::Topology topo(pg, tandem::comm::MeshShape().tp_size(2).resolve(4), 4);
///   topo.tp();                  // 2
///   topo.group("tp")->size();   // 2
///   topo.replicas();            // what gradients are averaged over (dp, with cp: dp x cp)
class Topology {
 public:
  /// Builds the groups of `shape` (resolved: comm::MeshShape::resolve) over `world`. Collective:
  /// every rank of `world` builds the same topology. Throws std::invalid_argument naming the rank
  /// when the shape does not lay out the world.
  Topology(std::shared_ptr<ProcessGroup> world, const comm::MeshShape& shape,
           int local_world_size = 0);

  int pp() const { return shape_.pp; }
  int tp() const { return shape_.tp; }
  /// Context parallel: the ranks that split each sequence (Note [Context parallel]).
  int cp() const { return shape_.cp > 1 ? shape_.cp : 1; }
  int dp_replicate() const { return shape_.dp_replicate; }
  int dp_shard() const { return shape_.dp_shard; }
  int dp() const { return shape_.dp_replicate * shape_.dp_shard; }
  int world_size() const;
  /// tp or pp above 1: ranks hold different parameters (their shards, their stage).
  bool model_parallel() const { return pp() > 1 || tp() > 1; }
  /// Pipeline stages per rank of the prepared pipeline (prepare_pipeline sets it; 1 without
  /// interleaving): part of the layout a checkpoint records, since it decides which of the
  /// model's entries each pp rank holds.
  int pp_virtual_stages() const { return pp_virtual_stages_; }
  void set_pp_virtual_stages(int v) { pp_virtual_stages_ = v; }
  /// Expert parallel: the consecutive data-parallel ranks that split every mixture's experts
  /// (Note [Expert parallel]; the Accelerator sets it; 1 without). Part of the layout a
  /// checkpoint records: the ranks of the first ep group write the experts they hold.
  int ep() const { return ep_; }
  void set_ep(int ep) { ep_ = ep; }
  const comm::MeshShape& shape() const { return shape_; }

  /// The world group.
  const std::shared_ptr<ProcessGroup>& world() const { return mesh_.world(); }
  /// This rank's group along "pp", "dp_replicate", "dp_shard", "tp" or "dp" (a group of one
  /// rank when that size is 1). Throws naming the dimensions there are.
  std::shared_ptr<ProcessGroup> group(const std::string& dim) const { return mesh_[dim]; }
  /// This rank's coordinate along `dim`.
  int coordinate(const std::string& dim) const { return mesh_.coordinate(dim); }
  /// The group loaders are sharded over ("dp"): the ranks that hold different samples.
  std::shared_ptr<ProcessGroup> data_parallel() const { return group("dp"); }
  /// The group gradients are averaged over and the weights broadcast over: every rank holding
  /// the same parameters ("dp", and its context-parallel ranks with them: "dp_cp").
  std::shared_ptr<ProcessGroup> replicas() const { return group(cp() > 1 ? "dp_cp" : "dp"); }
  /// The group ZeRO shards the training state over ("dp_shard"; "dp_shard_cp" with cp).
  std::shared_ptr<ProcessGroup> sharding() const {
    return group(cp() > 1 ? "dp_shard_cp" : "dp_shard");
  }
  /// The context-parallel group ("cp"; this rank alone without cp).
  std::shared_ptr<ProcessGroup> context_parallel() const;
  /// Note [Collectives on a mesh]: gather, gather_for_metrics, reduce and pad_across_processes
  /// run over the data-parallel ranks ("dp"), which hold different samples; the ranks of one tp
  /// group hold the same values, so counting them would count each sample tp times.
  std::shared_ptr<ProcessGroup> metrics() const { return data_parallel(); }
  /// wait_for_everyone, the inf/NaN vote and checkpoints: every process.
  const std::shared_ptr<ProcessGroup>& barrier() const { return world(); }
  /// The groups themselves, for code that walks the dimensions.
  const comm::DeviceMesh& mesh() const { return mesh_; }

  /// "pp 1 x dp_replicate 2 x dp_shard 1 x tp 2 x dp 2": every dimension with its size (the
  /// flattened "dp" last).
  std::string shape_string() const;
  /// "pp 1 x dp 2 x tp 2" (" x cp 2" before tp with context parallel), for the layout line.
  std::string summary() const;

  /// Note [Clipping under model parallel]: the whole model's gradient norm from this rank's
  /// p-th powers (maxima for the infinity norm) in two parts, {tensor-parallel shards, the
  /// rest}: the shards' part summed over "tp", then every stage's over "pp".
  double total_norm(std::array<double, 2> parts, double norm_type) const;

  /// The whole model's tensors under their dense names on the main process from this rank's
  /// `local` ones (a strategy's model_state): tensor-parallel shards joined over "tp" and every
  /// stage's tensors over "pp" by the first data-parallel replica. Without model parallel,
  /// `local` as it is. Every rank calls it.
  std::vector<std::pair<std::string, at::Tensor>> gather_model_state(
      std::vector<std::pair<std::string, at::Tensor>> local, torch::nn::Module& model) const;

  /// Note [Tensor-parallel shards in checkpoints]: the safetensors metadata of this rank's
  /// model file under model parallel (the mesh, the stage, the tp rank and each tensor's cut),
  /// each tensor under `rename(its name)` when given (Note [Pipeline checkpoint names]).
  std::map<std::string, std::string> model_file_metadata(
      torch::nn::Module& model,
      const std::function<std::string(const std::string&)>& rename = nullptr) const;

  /// The checkpoint's "mesh" part: a model-parallel run writes its shape; on load, a checkpoint
  /// saved on another layout is said in one line (the strategy parts reshard it: Note
  /// [Resharding a checkpoint]), and one of an earlier tandem, which records no layout, resumes
  /// only on its own mesh. `strategy`: the running strategy's name, for that line.
  checkpoint::StatePart checkpoint_part(const std::string& strategy) const;

 private:
  comm::MeshShape shape_;
  comm::DeviceMesh mesh_;
  int pp_virtual_stages_ = 1;
  int ep_ = 1;
};

/// Note [Clipping under model parallel]: clips the gradients of `tensors` (the parameters whose
/// .grad() this rank steps: precision's grads_to_clip) and of the strategy's shards so that the
/// whole model's norm is at most `max_norm`; returns that norm before clipping. `models` are the
/// prepared models (their tensor-parallel cuts say which parameters are shards).
double clip_grad_norm(const Topology& topology, Strategy& strategy,
                      const std::vector<at::Tensor>& tensors,
                      const std::vector<std::shared_ptr<torch::nn::Module>>& models,
                      double max_norm, double norm_type);

}  // namespace tandem::parallel
