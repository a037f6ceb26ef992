// Tensors that alias a slot of a flat buffer (gradient buckets, ZeRO units).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace tandem::parallel::detail {

// Note [Gradients as bucket views]: a tensor that shares `flat`'s storage at `offset` with
// `sizes` (contiguous). It is made with set_, not view(): LibTorch's Optimizer::zero_grad calls
// detach_(), which autograd refuses on a view ("Can't detach views in-place"), and the alias
// needs no autograd view tracking anyway (gradients and flat parameters carry no history).
inline at::Tensor flat_alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, flat.options());
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * sizes[d + 1];
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, strides);
  return t;
}

}  // namespace tandem::parallel::detail
