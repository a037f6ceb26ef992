// The key of a parameter in torch::optim::Optimizer::state(): LibTorch 1.13 keys it by the
// TensorImpl address as a string (c10::guts::to_string), 2.x by the TensorImpl pointer itself.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#include <string>

#if TORCH_VERSION_MAJOR < 2
#include <c10/util/string_utils.h>
#endif

namespace tandem::compat {

#if TORCH_VERSION_MAJOR >= 2
inline void* optimizer_state_key(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }
#else
inline std::string optimizer_state_key(const at::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}
#endif

}  // namespace tandem::compat
