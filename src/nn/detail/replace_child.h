// Putting a module in the place of another in its parent (tensor-parallel plans, quantization).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <memory>
#include <string>

namespace tandem::nn::detail {

/// Puts `replacement` in the place of `parent`'s child `name`: registered (replace_module), and
/// inside a Sequential's or a ModuleList's own list too, which their forward and iteration use.
inline void replace_child(torch::nn::Module& parent, const std::string& name,
                          const std::shared_ptr<torch::nn::Module>& replacement,
                          const torch::nn::AnyModule& any) {
  auto children = parent.named_children();
  int64_t index = -1;
  for (size_t i = 0; i < children.size(); ++i)
    if (children[i].key() == name) index = static_cast<int64_t>(i);
  parent.replace_module(name, replacement);
  if (index < 0) return;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
    *(seq->begin() + index) = any;
  } else if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(&parent)) {
    *(list->begin() + index) = replacement;
  }
}

}  // namespace tandem::nn::detail
