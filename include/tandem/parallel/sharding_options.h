// The options a run's distribution is chosen by: Accelerate's distributed types and the
// sharding options (DeepSpeed's ZeRO stages, FSDP's strategies), with their names and checks.
// Plain data, below the strategies' machinery (strategy.h), so that the run configuration and
// AcceleratorOptions can hold them without it.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/comm/process_group.h"

namespace tandem::parallel {

/// Accelerate's distributed types (TANDEM_DISTRIBUTED_TYPE, the config key distributed_type).
enum class DistributedType { kNo, kMultiCpu, kMultiGpu, kFsdp, kDeepSpeed };

/// "NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED".
std::string to_string(DistributedType type);
/// The type named `name` (upper case, as above). Throws std::invalid_argument listing the names.
DistributedType distributed_type_from_name(const std::string& name);

/// How a sharded run splits the training state (DeepSpeed's ZeRO stages, FSDP's strategies).
///
/// Example:
///   tandem::Accelerator acc(tandem::AcceleratorOptions().sharding(
///       tandem::parallel::ShardingOptions().stage(2)));
struct ShardingOptions {
  /// 0: nothing sharded (data parallel); 1: optimizer state; 2: also gradients; 3: also
  /// parameters. FSDP's NO_SHARD is 0, SHARD_GRAD_OP 2, FULL_SHARD 3.
  TORCH_ARG(int, stage) = 0;
  /// How gradient buckets are reduce-scattered at stage 2: kAlltoall sends the optimal bytes;
  /// kAllreduceSlice reduces the whole bucket as data parallel does, so that a sharded run
  /// equals data parallel bit for bit (twice the bytes). Stage 1 always allreduces.
  TORCH_ARG(ProcessGroup::ReduceScatterAlgorithm, reduce_scatter) =
      ProcessGroup::ReduceScatterAlgorithm::kAlltoall;
  /// Optimizer shards and their step on the host (DeepSpeed's offload_optimizer_device: cpu,
  /// FSDP's offload_params). A CPU run already has them there: accepted, said once.
  TORCH_ARG(bool, offload_optimizer) = false;
  /// Non-empty (DeepSpeed's offload_optimizer_device: nvme with offload_optimizer_nvme_path):
  /// the optimizer's state lives in files under this directory and is streamed in and out
  /// around the step, one unit at a time, reading the next unit while one steps (Note
  /// [Optimizer state on disk]).
  TORCH_ARG(std::string, nvme_path) = "";
  /// Parameter shards on the host between uses (offload_param_device: cpu; stage 3 only).
  TORCH_ARG(bool, offload_params) = false;
  /// save_state() of sharded optimizer state: every rank writes its own shard
  /// ("SHARDED_STATE_DICT", the only layout: it reloads on any number of ranks), and
  /// save_model()/the model file of a checkpoint hold the full weights ("FULL_STATE_DICT").
  TORCH_ARG(std::string, state_dict_type) = "FULL_STATE_DICT";
  /// Stage 3: which Sequential entries become units ("TRANSFORMER_BASED_WRAP" and
  /// "SIZE_BASED_WRAP": every entry with at least min_num_params parameters; "NO_WRAP": only
  /// modules the user wrapped in parallel::Sharded).
  TORCH_ARG(std::string, auto_wrap_policy) = "TRANSFORMER_BASED_WRAP";
  TORCH_ARG(int64_t, min_num_params) = 1;
  /// Stage 3 with TRANSFORMER_BASED_WRAP (Accelerate's fsdp_transformer_layer_cls_to_wrap):
  /// the class names of the model's blocks, as declared (TANDEM_MODULE(Block): "Block"); every
  /// module of one of them is a unit (a hookable one through a forward hook, a Sequential entry
  /// through a Sharded wrapper). Empty: every Sequential entry and every outermost hookable
  /// module a user declared (Note [ZeRO-3 units on hooks]).
  TORCH_ARG(std::vector<std::string>, transformer_layer_cls_to_wrap);
  /// Stage 3 (Note [Prefetching units]): all-gather the next unit while the current one runs
  /// its forward (FSDP's forward_prefetch), from the second step on (the first records the
  /// order in which the units run).
  TORCH_ARG(bool, forward_prefetch) = false;
  /// Stage 3, in backward: "BACKWARD_PRE" all-gathers the unit that runs next in backward when
  /// the current one's backward starts, "BACKWARD_POST" once the current one's gradients are
  /// reduced, "NO_PREFETCH" gathers each unit when its backward needs it (FSDP's
  /// backward_prefetch; Accelerate's default is NO_PREFETCH).
  TORCH_ARG(std::string, backward_prefetch) = "NO_PREFETCH";
  /// Stage 3: false keeps a unit's gathered parameters from its forward until its backward is
  /// done (FSDP2's reshard_after_forward=False: fewer all-gathers, more memory); forwards
  /// without gradients (evaluation) free them anyway.
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// FSDP's HYBRID_SHARD and HYBRID_SHARD_ZERO2 (Note [Hybrid sharding]): the run's mesh gets
  /// dp_replicate = the number of machines (unless its sizes are given), so ZeRO shards over the
  /// ranks of one machine ("dp_shard") and the shards' gradients are averaged across machines
  /// ("dp_replicate"). Any run with dp_replicate above 1 under ZeRO is hybrid this way.
  TORCH_ARG(bool, hybrid) = false;
  /// Where the options came from, for messages ("deepspeed_config", "fsdp_config", ...).
  TORCH_ARG(std::string, origin) = "AcceleratorOptions::sharding";
};

/// Why `sharding` cannot run ("" when it can): a stage outside 0-3, parameter offload below stage 3.
std::string unsupported_sharding_message(const ShardingOptions& sharding);

/// One of FSDP's sharding strategies (fsdp_sharding_strategy): its name, the ZeRO stage it runs
/// and whether it is hybrid (Note [Hybrid sharding]).
struct FsdpShardingStrategy {
  std::string name;
  int stage;
  bool hybrid;
};
/// FULL_SHARD (3), SHARD_GRAD_OP (2), NO_SHARD (0), HYBRID_SHARD (3, hybrid),
/// HYBRID_SHARD_ZERO2 (2, hybrid), in the order of Accelerate's numbers 1-5.
const std::vector<FsdpShardingStrategy>& fsdp_sharding_strategies();
/// The strategy `value` names: a name in any case, or its number 1-5. Throws
/// std::invalid_argument listing them.
const FsdpShardingStrategy& fsdp_sharding_strategy(const std::string& value);

/// Why Accelerate's distributed type `name` cannot run in tandem ("" when it can, or is not one
/// that tandem knows to refuse): devices tandem does not drive (XLA, TPU, MULTI_XPU, ...) and
/// Megatron-LM's or SageMaker's model parallelism. The message says what runs instead.
std::string unavailable_distributed_type_message(const std::string& name);

}  // namespace tandem::parallel
