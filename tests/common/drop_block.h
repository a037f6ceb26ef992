// A block of Linear(16, 16), ReLU and Dropout(0.5): the activation checkpointing tests' model
// unit (dropout makes the RNG restore matter).
#pragma once

#include <torch/torch.h>

namespace tandem::testing {

constexpr int64_t kDropWidth = 16;

struct DropBlockImpl : torch::nn::Module {
  DropBlockImpl()
      : fc(register_module("fc", torch::nn::Linear(kDropWidth, kDropWidth))),
        drop(register_module("drop", torch::nn::Dropout(0.5))) {}
  torch::Tensor forward(torch::Tensor x) { return drop(torch::relu(fc(x))); }
  torch::nn::Linear fc;
  torch::nn::Dropout drop;
};
TORCH_MODULE(DropBlock);

}  // namespace tandem::testing
