// Module holders that wrap another module (Sharded, Checkpointed) register the inner module's
// children, parameters and buffers under their own names, so that state dicts and optimizers see
// the same names and tensors as without the wrapper.
#pragma once

#include <torch/nn/module.h>

namespace tandem::parallel::detail {

inline void adopt_members(torch::nn::Module& holder, torch::nn::Module& inner) {
  for (const auto& kv : inner.named_children()) holder.register_module(kv.key(), kv.value());
  for (const auto& kv : inner.named_parameters(/*recurse=*/false))
    holder.register_parameter(kv.key(), kv.value(), kv.value().requires_grad());
  for (const auto& kv : inner.named_buffers(/*recurse=*/false))
    holder.register_buffer(kv.key(), kv.value());
}

}  // namespace tandem::parallel::detail
