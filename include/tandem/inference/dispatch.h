// Big-model inference, as Accelerate's big_modeling: build a model without memory for its
// weights (init_empty_weights), place its modules on devices, the CPU and disk by a device map
// (dispatch), and load a checkpoint straight into that placement (load_checkpoint_and_dispatch).
// A module on disk keeps its weights in the safetensors file; a forward hook (tandem/nn/module.h,
// order::kOffload) reads them just before the module's forward, reading the next disk module
// ahead while this one computes, and drops them after.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "tandem/inference/device_map.h"
#include "tandem/nn/module.h"

namespace torch::nn {
class Module;
}

namespace tandem::inference {

namespace detail {
/// Releases every hookable module's weights as soon as it is built (Note [Empty weights]).
class EmptyWeightsScope {
 public:
  EmptyWeightsScope();
  /// Releases what is still pending and every tensor of `model` that still has storage.
  void finish(torch::nn::Module& model);

 private:
  tandem::nn::detail::BuildScope scope_;
};
}  // namespace detail

/// Builds the model `build()` returns with no memory for its weights: parameters and buffers
/// keep their shapes and dtypes (so infer_device_map can size them and a checkpoint can be
/// checked against them) but hold no bytes. Accelerate's init_empty_weights.
///
/// Note [Empty weights]: each module declared with TANDEM_MODULE (and tandem::nn's layers) gives
/// its weights back as soon as its constructor has returned and the next module starts building,
/// so building never holds more than one layer. A constructor may initialise the weights of the
/// modules it builds only inside their own constructors (or reset()); writing into a member's
/// weights after building it writes into released memory. Reading or writing an empty weight is
/// not caught: load it first (load_checkpoint_and_dispatch).
///
/// Example:
///   auto model = tandem::inference::init_empty_weights([&] { return GPT2LMHeadModel(config); });
template <class Build>
auto init_empty_weights(Build&& build) {
  detail::EmptyWeightsScope scope;
  auto model = build();
  scope.finish(*model);
  return model;
}

/// Whether `t` has no bytes for its elements (empty weights, or an offloaded module's).
bool is_empty_weight(const at::Tensor& t);
/// Gives `model`'s parameters and buffers back (they keep their shapes and dtypes).
void release_weights(torch::nn::Module& model);

/// Options of dispatch and load_checkpoint_and_dispatch.
///
/// Example:
///   auto placed = tandem::inference::load_checkpoint_and_dispatch(*model, "gpt2/", map,
///       tandem::inference::DispatchOptions().offload_dir("/tmp/offload"));
struct DispatchOptions {
  /// Where the weights come from (a .safetensors file, an index, or a directory, as load_model
  /// reads them). A module on disk reads its weights from there at each forward (converted to
  /// the model's dtype); weights the checkpoint does not hold are written into offload_dir.
  TORCH_ARG(std::string, checkpoint) = "";
  /// Where weights of modules on disk are written when the checkpoint cannot be read in their
  /// place (weights the checkpoint does not hold). Needed only then; an error names it when it is.
  TORCH_ARG(std::string, offload_dir) = "";
  /// Where modules kept on the CPU or on disk compute: "" is the first CUDA device of the map,
  /// or the CPU when it has none.
  TORCH_ARG(std::string, main_device) = "";
  /// Read the next module on disk while one computes.
  TORCH_ARG(bool, prefetch) = true;
  /// load_checkpoint_and_dispatch: weights stored in another floating dtype than the model's
  /// (a bfloat16 checkpoint, a float32 model) are converted as they load (LoadOptions::
  /// allow_dtype_cast), and a module on disk converts them as it reads them at each forward.
  /// false: such a checkpoint is refused, naming the tensors.
  TORCH_ARG(bool, allow_dtype_cast) = false;
};

/// What the offload hooks did.
struct DispatchStats {
  int64_t loads = 0;             ///< modules read from disk
  int64_t loads_read_ahead = 0;  ///< of them, read ahead of their forward
  int64_t bytes_read = 0;
  double seconds_waited = 0;     ///< forward time spent waiting for a read
};

/// A dispatched model: its device map and the hooks that carry it out. Destroying it removes
/// the hooks (a module on disk keeps empty weights).
class DispatchedModel {
 public:
  DispatchedModel();
  ~DispatchedModel();
  DispatchedModel(const DispatchedModel&) = delete;
  DispatchedModel& operator=(const DispatchedModel&) = delete;
  const DeviceMap& device_map() const;
  /// The device inputs go to first (that of the model's first module).
  std::string main_device() const;
  /// Bytes of weights per place ("cpu", "cuda:0", "disk").
  std::map<std::string, uint64_t> bytes_by_place() const;
  /// The largest module on disk (what is in memory beyond the devices' share, twice with
  /// read-ahead).
  uint64_t largest_offloaded_bytes() const;
  /// "cpu 40.1 MB (wte, h.0-3), disk 80.2 MB (h.4-11: read from model.safetensors, one ahead)"
  std::string summary() const;
  DispatchStats stats() const;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Places `model`'s modules as `map` says (Note [Disk offload] in dispatch.cpp): a module on a
/// device has its weights moved there and its inputs moved to it; a module on "cpu" with a CUDA
/// main device keeps its weights in CPU memory and copies them in for each forward; a module on
/// "disk" gets empty weights, read from the checkpoint (or offload_dir) for each forward. Every
/// parameter and buffer must be under one placement; modules that need hooks (inputs on another
/// device, cpu offload, disk) must be hookable (TANDEM_MODULE). Throws std::invalid_argument
/// naming the module and the fix otherwise.
std::unique_ptr<DispatchedModel> dispatch(torch::nn::Module& model, const DeviceMap& map,
                                          const DispatchOptions& options = {});

/// Loads `checkpoint` into `model` (empty or not) as `map` places it, then dispatch(): weights of
/// modules on a device or the CPU are read into their place (one tensor at a time: nothing else
/// is resident), modules on disk are only checked (names, shapes, dtypes) and read at their
/// forward. Strict: a missing, unexpected or mismatched name throws before anything changes.
std::unique_ptr<DispatchedModel> load_checkpoint_and_dispatch(torch::nn::Module& model,
                                                              const std::string& checkpoint,
                                                              const DeviceMap& map,
                                                              DispatchOptions options = {});

}  // namespace tandem::inference
