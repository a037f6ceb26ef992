// Model weights as safetensors, in transformers' layout: one model.safetensors, or shards
// model-0000i-of-0000N.safetensors with model.safetensors.index.json. Rank-agnostic: which
// process writes is the caller's concern (the Accelerator writes from the main process only).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace tandem::checkpoint {

/// File name of an unsharded checkpoint.
constexpr const char* kModelFileName = "model.safetensors";
/// File name of the index of a sharded checkpoint.
constexpr const char* kModelIndexFileName = "model.safetensors.index.json";

/// Bytes in a size string: an integer or decimal number, an optional space, an optional unit:
/// B, KB, MB, GB, TB (powers of 1000, as transformers) or KiB, MiB, GiB, TiB (powers of 1024);
/// unit letters are case-insensitive except the final B ("Gb" is rejected: transformers reads it
/// as gigabits). "1.5GB" = 1'500'000'000; fractions of a byte are rounded down. Throws
/// std::invalid_argument naming the text and the accepted forms.
uint64_t parse_size(const std::string& text);

/// Greedy sharding, as transformers: tensors in the given order fill the current shard; one that
/// would take it past `max_shard_size` starts a new shard, unless the current shard is empty (so
/// a tensor larger than the limit gets a shard of its own). Returns the shards as lists of
/// indices into `sizes`; no tensors, no shards.
std::vector<std::vector<std::size_t>> assign_shards(const std::vector<uint64_t>& sizes,
                                                    uint64_t max_shard_size);

/// "model-00002-of-00005.safetensors" for index 1 (0-based) of 5.
std::string shard_file_name(std::size_t index, std::size_t count);

/// The names save_model stores and load_model fills: `named_parameters()` then `named_buffers()`
/// (recursive, LibTorch's dotted names, undefined tensors skipped), in that order.
std::vector<std::string> model_tensor_names(const torch::nn::Module& module);

/// Writes `module`'s parameters and buffers (see model_tensor_names) into directory `dir`
/// (created when missing): model.safetensors when they fit in `max_shard_size` (parse_size
/// syntax), else shards in transformers' naming plus model.safetensors.index.json
/// ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). Every file carries the
/// metadata {"format": "pt"} as transformers writes it. Tensors shared under several names (tied
/// weights) are stored in full under each name: safetensors has no shared storage. Files of an
/// earlier save in `dir` that this save does not produce (the index, other shards) are removed.
/// Writes in place; for atomicity write into a temporary directory and rename it.
///
/// Example:
///   tandem::checkpoint::save_model(*net, "out/checkpoint-100", "2GB");
void save_model(const torch::nn::Module& module, const std::string& dir,
                const std::string& max_shard_size = "10GB");
/// save_model() of tensors given by name (e.g. a sharded model's gathered state).
void save_model_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                        const std::string& dir, const std::string& max_shard_size = "10GB");

/// Options of load_model.
///
/// Example:
///   auto report = tandem::checkpoint::load_model(*net, "out/checkpoint-100",
///       tandem::checkpoint::LoadOptions().strict(false));
struct LoadOptions {
  /// Throw when names are missing, unexpected or mismatched (and then change nothing). When
  /// false, load what matches and return the rest in the report.
  TORCH_ARG(bool, strict) = true;
  /// Convert a checkpoint tensor whose dtype differs from the module's (as Tensor::copy_ does).
  /// When false a dtype difference is a mismatch, like a shape difference: a silent cast could
  /// lose precision (F32 into F16) without anyone noticing.
  TORCH_ARG(bool, allow_dtype_cast) = false;
};

/// A name whose checkpoint tensor does not fit the module's.
struct LoadMismatch {
  std::string name;
  std::string file;  // the checkpoint file holding it
  std::vector<int64_t> checkpoint_shape;
  std::vector<int64_t> model_shape;
  std::string checkpoint_dtype;  // safetensors spelling, "F32"
  std::string model_dtype;       // safetensors spelling when it has one, else LibTorch's
};

/// What load_model did not load.
struct LoadReport {
  /// Module names absent from the checkpoint (left unchanged).
  std::vector<std::string> missing;
  /// Checkpoint names the module does not have (ignored).
  std::vector<std::string> unexpected;
  /// Names present on both sides whose shape or dtype differ (left unchanged).
  std::vector<LoadMismatch> mismatched;

  bool ok() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  /// One line per problem, as in load_model's strict error.
  std::string to_string() const;
};

/// Loads weights saved by save_model (or by transformers' save_pretrained with safetensors) into
/// `module`. `path` is a .safetensors file, an index .json, or a directory holding
/// model.safetensors (preferred, as transformers does) or model.safetensors.index.json. Every
/// header is read and checked first; then shard by shard, each tensor is copied into its
/// parameter or buffer under NoGradGuard (on the module's device, without an intermediate copy
/// for CPU tensors of the same dtype), and the shard is closed before the next one opens, so
/// memory stays near the model's size. A missing name whose tensor is the same tensor as a
/// loaded name (tied weights that the writer stored once) counts as loaded.
/// Strict: throws std::runtime_error listing every missing, unexpected and mismatched name
/// (shapes and dtypes of both sides) in one message, before changing anything.
/// Malformed files throw SafetensorsError; an inconsistent index throws std::runtime_error.
LoadReport load_model(torch::nn::Module& module, const std::string& path,
                      const LoadOptions& options = {});

/// Which file of the checkpoint at `path` (as load_model resolves it) holds each tensor: name ->
/// file path. Every header is read and checked against the index, as load_model does.
std::map<std::string, std::string> checkpoint_tensor_files(const std::string& path);

/// A part of a tensor that load_model reads instead of the whole: elements [begin, begin +
/// dst.numel()) of the checkpoint tensor, flattened in row-major order, into `dst`.
struct TensorSlice {
  int64_t begin = 0;
  at::Tensor dst;
};
/// For a module tensor, the slices to read in its place; nullopt: the tensor is read whole.
using SliceMap = std::function<std::optional<std::vector<TensorSlice>>(const at::Tensor& target)>;
/// load_model, where `slices` names the module tensors that are only partly here (a ZeRO-3
/// rank's shards: their storage is released, their shapes are the whole parameter's): their
/// names, shapes and dtypes are checked as any others', and only the slices' bytes are read
/// (SafetensorsFile::read_range_into).
LoadReport load_model(torch::nn::Module& module, const std::string& path,
                      const LoadOptions& options, const SliceMap& slices);

}  // namespace tandem::checkpoint
