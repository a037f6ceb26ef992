// The whole model from its model-parallel parts: tensor-parallel shards joined into the dense
// tensors, pipeline stages gathered, under the dense model's names (what save_model and
// get_state_dict hand the main process on a mesh).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tandem {
class ProcessGroup;
}

namespace tandem::parallel {

/// The dense tensor of `shards` (tp rank order) cut as `how` (parallel::tensor_parallel_splits):
/// "cols" joins along dimension 1; "rows/P" sees each shard as P blocks of rows (a fused q/k/v
/// weight: P = 3) and joins block j of every rank, block by block, along dimension 0. Throws
/// std::invalid_argument for another `how` or shards that do not fit together.
at::Tensor join_tensor_parallel_shards(const std::vector<at::Tensor>& shards,
                                       const std::string& how);

/// The inverse: tensor-parallel rank `rank`'s shard (of `size`) of the dense tensor `dense` cut
/// as `how` ("" or a size of 1: the tensor itself).
at::Tensor cut_tensor_parallel_shard(const at::Tensor& dense, const std::string& how, int rank,
                                     int size);

/// The whole model's named tensors on global rank 0 of a mesh, empty elsewhere. `local` is this
/// rank's part (its stage, its shards; empty on ranks that hold no copy, such as data-parallel
/// replicas other than the first), `splits` how each split tensor was cut. Over `tp` (null or
/// size 1: none) the shards are all-gathered and joined; over `pp` (null or size 1: none) every
/// stage's tensors reach pipeline rank 0, stage by stage. Every rank of a group must call it
/// together; `holds` says whether this rank's data-parallel replica takes part (the same on every
/// rank of its tp and pp groups).
std::vector<std::pair<std::string, at::Tensor>> gather_model_parallel_state(
    const std::vector<std::pair<std::string, at::Tensor>>& local,
    const std::map<std::string, std::string>& splits, ProcessGroup* tp, ProcessGroup* pp,
    bool holds);

}  // namespace tandem::parallel
