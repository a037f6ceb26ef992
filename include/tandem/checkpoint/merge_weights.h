// merge_weights: a checkpoint's model, in whatever shards it was written, to one safetensors
// file in transformers' layout (`tandem merge-weights`, Accelerate's `merge-weights`).
#pragma once

#include <cstdint>
#include <string>

namespace tandem::checkpoint {

/// What merge_weights wrote.
struct MergeReport {
  std::string output;       ///< the file written (<out_dir>/model.safetensors)
  std::size_t tensors = 0;  ///< tensors written
  uint64_t bytes = 0;       ///< bytes of tensor data
  std::size_t sources = 0;  ///< files read
};

/// Reads the model of `checkpoint` (a save_state() directory: its model.safetensors, or
/// model_<i>.safetensors with `model_index` i; a save_model() directory: model.safetensors, or
/// model.safetensors.index.json and its shards; or one .safetensors / .index.json file) and
/// writes every tensor into `<out_dir>/model.safetensors` (atomically: a temporary file, fsync,
/// rename), named as in the model. A model-parallel save_state() (model.mp<r>.safetensors files:
/// pipeline stages and tensor-parallel shards) is joined into the dense model: the stages'
/// tensors side by side, each split tensor's shards concatenated as their metadata says
/// (Note [Joining tensor-parallel shards]). Streaming: tensor bytes are copied file to file in chunks of
/// at most 64 MiB, never a whole model (nor a whole tensor) in memory. A save_state() checkpoint
/// (a manifest.json beside the files) is verified first, as load_state verifies it: every file
/// read is listed, with its size and xxh64. Throws std::runtime_error naming the file and what is
/// wrong (a damaged file, missing shard, a tensor in two shards, bad tensor-parallel metadata or
/// shards whose shapes do not join, unreadable file), before anything is written.
MergeReport merge_weights(const std::string& checkpoint, const std::string& out_dir,
                          std::size_t model_index = 0);

}  // namespace tandem::checkpoint
