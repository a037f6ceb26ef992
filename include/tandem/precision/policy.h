// PrecisionPolicy: what a mixed-precision mode means (which dtype autocast uses, which dtype the
// weights are kept in, whether an fp32 master copy and a loss scaler are needed), parsed and
// validated against what this LibTorch and this device can do. Pure logic, no tensors.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <optional>
#include <string>
#include <vector>

namespace tandem::precision {

/// bf16 or fp16: the half dtypes of mixed precision.
inline bool is_half(c10::ScalarType t) { return t == c10::kBFloat16 || t == c10::kHalf; }

/// The mixed-precision modes (the names of Accelerate's `mixed_precision`, plus Lightning's
/// "-true" modes).
enum class Mode { kNo, kBf16, kFp16, kBf16True, kFp16True, kFp8 };

/// The accepted names, in the order error messages list them: no, bf16, fp16, bf16-true,
/// fp16-true, fp8.
const std::vector<std::string>& mode_names();
/// The name of a mode ("bf16-true", ...).
std::string mode_name(Mode mode);

/// What the running LibTorch and device offer; filled by Capabilities::detect() in the library,
/// by hand in tests.
struct Capabilities {
  /// Where the model runs (kCPU or kCUDA).
  c10::DeviceType device = c10::kCPU;
  /// CPU autocast accepts float16 as its lower-precision dtype (LibTorch >= 2.2).
  bool cpu_autocast_fp16 = false;
  /// CPU kernels for float16 matrix products exist (LibTorch 1.13 has none).
  bool cpu_half_matmul = false;
  /// The GPU computes in bfloat16 (compute capability >= 8.0).
  bool cuda_bf16 = false;
  /// This build of tandem has its fp8 kernels (CUDA and LibTorch >= 2.1).
  bool fp8_compiled = false;
  /// The GPU has fp8 arithmetic (compute capability >= 8.9).
  bool cuda_fp8 = false;
  /// A description of the LibTorch and device for error messages ("LibTorch 1.13.0, CPU").
  std::string description = "this LibTorch";

  /// The capabilities of this process's LibTorch on `device`.
  static Capabilities detect(c10::DeviceType device);
};

/// Options of a PrecisionPolicy.
///
/// Example:
///   auto policy = tandem::precision::PrecisionPolicy::create(
///       tandem::precision::PolicyOptions().mode("fp16-true").master_weights(true),
///       tandem::precision::Capabilities::detect(c10::kCUDA));
struct PolicyOptions {
  /// One of mode_names().
  TORCH_ARG(std::string, mode) = "no";
  /// Keep fp32 master weights in the optimizer (only for the "-true" modes; default: on for
  /// fp16-true, off for bf16-true).
  TORCH_ARG(std::optional<bool>, master_weights) = std::nullopt;
  /// Hand reductions and gathers of fp32 tensors back as bf16 (bf16 modes only): the intent of
  /// Accelerate's downcast_bf16.
  TORCH_ARG(bool, downcast_bf16) = false;
  /// Dynamic loss scaling: default on for fp16 and fp16-true, off otherwise; true turns it on
  /// in any mode (bf16-true runs whose tiny gradients underflow; testing the skip path on a CPU).
  TORCH_ARG(std::optional<bool>, loss_scaling) = std::nullopt;
  /// "[rank r/w]" for error messages.
  TORCH_ARG(std::string, prefix) = "";
};

/// A validated precision policy.
struct PrecisionPolicy {
  Mode mode = Mode::kNo;
  /// Autocast's lower-precision dtype, when the mode autocasts (bf16, fp16, fp8).
  std::optional<c10::ScalarType> autocast_dtype;
  /// The dtype of the model's floating-point parameters and buffers (fp32 unless "-true").
  c10::ScalarType param_dtype = c10::kFloat;
  /// The optimizer steps fp32 copies of half-precision parameters.
  bool master_weights = false;
  /// Dynamic loss scaling (fp16 and fp16-true: half's 5-bit exponent underflows small gradients).
  bool loss_scaling = false;
  /// fp8 Linear layers may be used (fp8 mode only).
  bool fp8 = false;
  bool downcast_bf16 = false;

  /// Parses and validates: throws std::invalid_argument naming the fix for an unknown mode or
  /// an impossible combination.
  static PrecisionPolicy create(const PolicyOptions& options, const Capabilities& caps);
  std::string name() const { return mode_name(mode); }
  bool is_half() const { return mode != Mode::kNo; }
};

}  // namespace tandem::precision
