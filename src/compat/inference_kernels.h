// LibTorch's fused attention and weight-only quantized matmul kernels, across versions:
// scaled_dot_product_attention came with 2.0; _weight_int8pack_mm (int8 weights with one scale
// per output channel) with 2.4 on the CPU; _weight_int4pack_mm_for_cpu and
// _convert_weight_to_int4pack_for_cpu (int4 groups, scales and zero points) with 2.6; the CUDA
// int4 kernel takes nibble-packed uint8 weights from 2.5 on. Older builds have none of them:
// callers fall back to the manual form (attention) or dequantize-then-matmul.
#pragma once

#include <ATen/ATen.h>
#include "tandem/error.h"
#include <torch/version.h>

#define TANDEM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#define TANDEM_HAS_SDPA TANDEM_TORCH_AT_LEAST(2, 0)
#define TANDEM_HAS_INT8PACK_MM TANDEM_TORCH_AT_LEAST(2, 4)
#define TANDEM_HAS_INT4PACK_MM_CPU TANDEM_TORCH_AT_LEAST(2, 6)
#define TANDEM_HAS_INT4PACK_MM_CUDA TANDEM_TORCH_AT_LEAST(2, 5)

namespace tandem::compat {

/// softmax(q k^T * scale + mask) v through LibTorch's fused kernel (2.0 and later only).
inline at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& mask, bool is_causal) {
#if TANDEM_HAS_SDPA
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal);
#else
  (void)q, (void)k, (void)v, (void)mask, (void)is_causal;
  TANDEM_CHECK(false, "scaled_dot_product_attention needs LibTorch 2.0 or later");
#endif
}

/// x [m, k] @ (w [n, k] int8 * scales [n])^T (2.4 and later, CPU and CUDA).
inline at::Tensor int8pack_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
#if TANDEM_HAS_INT8PACK_MM
  return at::_weight_int8pack_mm(x, w, scales);
#else
  (void)x, (void)w, (void)scales;
  TANDEM_CHECK(false, "_weight_int8pack_mm needs LibTorch 2.4 or later");
#endif
}

/// The CPU int4 kernel's weight layout from int32 values 0..15 [n, k] (2.6 and later).
inline at::Tensor int4pack_cpu(const at::Tensor& values) {
#if TANDEM_HAS_INT4PACK_MM_CPU
  return at::_convert_weight_to_int4pack_for_cpu(values, 1);
#else
  (void)values;
  TANDEM_CHECK(false, "_convert_weight_to_int4pack_for_cpu needs LibTorch 2.6 or later");
#endif
}

/// x [m, k] @ dequant(packed)^T, groups of `group` along k; scales_zeros [k / group, n, 2]
/// (CPU, 2.6 and later).
inline at::Tensor int4pack_mm_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t group,
                                  const at::Tensor& scales_zeros) {
#if TANDEM_HAS_INT4PACK_MM_CPU
  return at::_weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros);
#else
  (void)x, (void)packed, (void)group, (void)scales_zeros;
  TANDEM_CHECK(false, "_weight_int4pack_mm_for_cpu needs LibTorch 2.6 or later");
#endif
}

/// The CUDA int4 kernel's tiled layout from nibble-packed uint8 [n, k / 2] (2.5 and later).
inline at::Tensor int4pack_cuda(const at::Tensor& nibbles) {
#if TANDEM_HAS_INT4PACK_MM_CUDA
  return at::_convert_weight_to_int4pack(nibbles, 8);
#else
  (void)nibbles;
  TANDEM_CHECK(false, "_convert_weight_to_int4pack needs LibTorch 2.5 or later");
#endif
}

/// x [m, k] (bf16) @ dequant(tiled)^T on CUDA (2.5 and later).
inline at::Tensor int4pack_mm_cuda(const at::Tensor& x, const at::Tensor& tiled, int64_t group,
                                   const at::Tensor& scales_zeros) {
#if TANDEM_HAS_INT4PACK_MM_CUDA
  return at::_weight_int4pack_mm(x, tiled, group, scales_zeros);
#else
  (void)x, (void)tiled, (void)group, (void)scales_zeros;
  TANDEM_CHECK(false, "_weight_int4pack_mm needs LibTorch 2.5 or later");
#endif
}

}  // namespace tandem::compat
