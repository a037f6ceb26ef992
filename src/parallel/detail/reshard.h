// A checkpoint seen as the dense tensors of the run that saved it, whatever its layout, read one
// tensor at a time (Note [Resharding a checkpoint] in reshard.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tandem::checkpoint {
class StateReader;
}
namespace torch::nn {
class Module;
}

namespace tandem::parallel::detail {

/// Where the pieces of every tensor of a checkpoint lie, by the tensor's dense name: model m's
/// tensors ("model" files, their tensor-parallel shards and pipeline stages) and optimizer o's
/// state per parameter (its moments, step counts and fp32 masters, whole or as ZeRO chunks).
class SavedTensors {
 public:
  SavedTensors(const checkpoint::StateReader& r, size_t models, size_t optimizers);
  ~SavedTensors();

  /// The dense tensor `name` of model m; undefined when the checkpoint lacks it.
  at::Tensor model_tensor(size_t m, const std::string& name) const;

  /// Optimizer o: its saved type and parameter groups' options ({"type", "param_groups":
  /// [{"options"}]}, as checkpoint::optimizer_state writes them).
  std::string optimizer_json(size_t o) const;
  /// The fields of parameter `name` (qualified as ZeRO names them: "model<m>." with several
  /// models) that optimizer o saved ("exp_avg", ...); empty: no state yet.
  std::vector<std::string> fields(size_t o, const std::string& name) const;
  /// Its dense field `field`; its step count.
  at::Tensor field(size_t o, const std::string& name, const std::string& field) const;
  std::optional<int64_t> step(size_t o, const std::string& name) const;
  /// Its fp32 master (a ZeRO shard copy or a mixed-precision master); undefined when none.
  at::Tensor master(size_t o, const std::string& name) const;
  bool has_master(size_t o, const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The parameters of `models` by the names checkpoints and ZeRO's units give them: the module's
/// dotted name, with "model<m>." before it when there are several models; a tensor registered
/// under several names (a tied weight) under its first.
std::map<const void*, std::string> qualified_parameter_names(
    const std::vector<std::shared_ptr<torch::nn::Module>>& models);

/// `dense` cut for tensor-parallel rank `rank` of `size` as `how` ("" whole, "cols", "rows/P").
at::Tensor cut_for_rank(const at::Tensor& dense, const std::string& how, int rank, int size);

}  // namespace tandem::parallel::detail
