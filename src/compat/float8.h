// The only place that knows which LibTorch has float8 scalar types: Float8_e4m3fn and
// Float8_e5m2 arrived in LibTorch 2.1; 1.13 has neither, so F8 safetensors tensors cannot be
// materialised there (their headers still parse).
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/version.h>

#include <optional>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define TANDEM_HAS_FLOAT8 1
#else
#define TANDEM_HAS_FLOAT8 0
#endif

namespace tandem::compat {

/// at::kFloat8_e4m3fn where LibTorch has it.
inline std::optional<c10::ScalarType> float8_e4m3fn() {
#if TANDEM_HAS_FLOAT8
  return c10::ScalarType::Float8_e4m3fn;
#else
  return std::nullopt;
#endif
}

/// at::kFloat8_e5m2 where LibTorch has it.
inline std::optional<c10::ScalarType> float8_e5m2() {
#if TANDEM_HAS_FLOAT8
  return c10::ScalarType::Float8_e5m2;
#else
  return std::nullopt;
#endif
}

}  // namespace tandem::compat
