// find_executable_batch_size: the largest batch size that fits, found by trying and shrinking on
// out-of-memory errors (Accelerate's find_executable_batch_size).
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>

namespace tandem::track {

/// How find_executable_batch_size shrinks the batch.
///
/// Example:
///   auto opts = tandem::track::BatchSizeFinderOptions().factor(0.5);  // halve, as old Accelerate
struct BatchSizeFinderOptions {
  /// Next try = floor(batch * factor), and at least one less than the batch that failed.
  /// 0.9 (recent Accelerate) finds a size close to the limit; 0.5 ("half") needs fewer tries.
  TORCH_ARG(double, factor) = 0.9;
  /// Called after each out-of-memory failure with the failed size, the next size and the
  /// error's first line (for a log line); unset: silent.
  TORCH_ARG(std::function<void(int64_t, int64_t, const std::string&)>, on_retry) = nullptr;
};

/// Whether an exception means "out of memory": c10::OutOfMemoryError, a c10::Error whose
/// message says "CUDA out of memory" or "DefaultCPUAllocator: can't allocate memory", or
/// std::bad_alloc. Call it with the exception being handled.
bool is_out_of_memory(const std::exception& error);

/// Releases memory that an out-of-memory failure left cached: empties the CUDA caching
/// allocator when LibTorch has CUDA and a GPU is visible; nothing on CPU, where tensors go back
/// to the system as soon as they are destroyed.
void release_cached_memory();

/// Runs fn(batch_size) starting at `starting_batch_size`. When fn throws an out-of-memory error
/// (see is_out_of_memory), the cached memory is released and fn runs again with a smaller batch,
/// until it returns; then that batch size is returned. Any other exception passes through
/// untouched. fn must free what it allocated when it throws: RAII (tensors that go out of scope)
/// does that. Throws std::runtime_error naming the starting size when even batch size 1 runs
/// out of memory, std::invalid_argument for a starting size below 1 or a factor outside (0, 1).
///
/// Example:
///   int64_t bs = tandem::track::find_executable_batch_size(
///       [&](int64_t batch_size) { train(model, batch_size); }, 128);
int64_t find_executable_batch_size(const std::function<void(int64_t)>& fn,
                                   int64_t starting_batch_size,
                                   const BatchSizeFinderOptions& options = {});

}  // namespace tandem::track
