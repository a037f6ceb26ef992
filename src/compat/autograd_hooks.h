// Post-hooks on autograd nodes (gradient accumulators), across LibTorch versions.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <functional>
#include <memory>

namespace tandem::compat {

/// Adds `fn` as a post-hook of `node` (called after the node ran, e.g. after a gradient
/// accumulator wrote `.grad`). Returns a key for remove_post_hook.
inline uintptr_t add_post_hook(torch::autograd::Node& node, std::function<void()> fn) {
  auto hook = std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& /*inputs*/) {
        fn();
        return outputs;
      });
  return node.add_post_hook(std::move(hook));
}

inline void remove_post_hook(torch::autograd::Node& node, uintptr_t key) {
  node.del_post_hook(key);
}

}  // namespace tandem::compat
