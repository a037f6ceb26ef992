// DistributedSampler: which indices of a map-style data set each rank reads, in exactly the
// order of PyTorch's torch.utils.data.DistributedSampler.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace tandem::data {

/// Options of DistributedSampler; the fields of PyTorch's sampler.
struct SamplerOptions {
  TORCH_ARG(int64_t, num_replicas) = 1;
  TORCH_ARG(int64_t, rank) = 0;
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(bool, drop_last) = false;
  /// false: no padding, ranks may get different numbers of indices (Accelerate's
  /// even_batches=False); true: PyTorch's behaviour.
  TORCH_ARG(bool, pad) = true;
};

/// The indices rank `rank` reads in epoch `epoch`:
/// - shuffle: randperm(size) from a CPU generator seeded with seed + epoch; else 0..size-1;
/// - without drop_last, padded by repeating indices from the start up to a multiple of
///   num_replicas; with drop_last, cut down to a multiple;
/// - rank r takes positions r, r + num_replicas, r + 2 num_replicas, ...
/// Positions at or past `size` in the padded list are padding (see is_padding).
class DistributedSampler {
 public:
  DistributedSampler(int64_t size, SamplerOptions options);

  /// Changes the order of the next indices() (PyTorch's set_epoch).
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  /// This rank's indices for the current epoch.
  std::vector<int64_t> indices() const;
  /// For each of indices(): whether it is a repeat added by padding.
  std::vector<bool> padding_mask() const;
  /// Number of indices per rank (this rank's, when pad is false).
  int64_t num_samples() const;
  int64_t dataset_size() const { return size_; }
  const SamplerOptions& options() const { return options_; }
  /// The epoch's order of every sample, before it is split between ranks.
  std::vector<int64_t> global_order() const;

 private:
  int64_t size_;
  SamplerOptions options_;
  int64_t epoch_ = 0;
};

}  // namespace tandem::data
