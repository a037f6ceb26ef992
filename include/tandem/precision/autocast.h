// AutocastGuard: an RAII autocast region, as Python's `with torch.autocast(...)`.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace tandem::precision {

/// Enables (or, with enabled = false, disables) autocast for `device` with `dtype` until the
/// end of the scope, then restores the previous state: enabled flag, dtype and cast cache.
/// Leaving the outermost autocast region clears the cache of casted weights (as PyTorch does),
/// so that updated weights are cast afresh in the next forward. Regions nest; autocast state is
/// per thread.
///
/// Example:
///   {
///     tandem::precision::AutocastGuard on(c10::kCPU, c10::kBFloat16);
///     auto logits = model->forward(x);                  // linear/matmul in bf16
///     {
///       tandem::precision::AutocastGuard off(c10::kCPU, c10::kBFloat16, false);
///       auto sensitive = my_op(logits.to(torch::kFloat)); // fp32 here
///     }
///   }
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled = true);
  /// A guard that changes nothing (modes without autocast).
  AutocastGuard() = default;
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&& other) noexcept;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

  /// Whether autocast is on for `device` in this thread.
  static bool is_enabled(c10::DeviceType device);
  /// The lower-precision dtype autocast uses for `device` in this thread.
  static c10::ScalarType dtype(c10::DeviceType device);

 private:
  bool active_ = false;
  c10::DeviceType device_ = c10::kCPU;
  bool previous_enabled_ = false;
  c10::ScalarType previous_dtype_ = c10::kBFloat16;
};

}  // namespace tandem::precision
