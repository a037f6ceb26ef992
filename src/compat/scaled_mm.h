// at::_scaled_mm across LibTorch versions (fp8 builds only: CUDA and LibTorch >= 2.1): until
// 2.3 it took (a, b, bias, out_dtype, scale_a, scale_b) and returned (out, amax); from 2.4 on it
// takes (a, b, scale_a, scale_b, bias, scale_result, out_dtype) and returns out.
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

#include "float8.h"

#if !TANDEM_HAS_FLOAT8
#error "scaled_mm.h needs a LibTorch with float8 types (>= 2.1)"
#endif

namespace tandem::compat {

/// (a * scale_a) @ (b * scale_b) for fp8 `a` (row-major) and `b` (column-major), where the
/// scales are the dequantisation factors (1 / the quantisation scale), float32 scalars.
inline at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                            const at::Tensor& scale_b, c10::ScalarType out_dtype) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::_scaled_mm(a, b, scale_a, scale_b, c10::nullopt, c10::nullopt, out_dtype);
#else
  return std::get<0>(at::_scaled_mm(a, b, c10::nullopt, out_dtype, scale_a, scale_b));
#endif
}

}  // namespace tandem::compat
