// Compares a merged checkpoint's weights with a dense model's (two safetensors files), printing
// "same names 0|1" and one "check merged <name> <max |diff| / max |dense|>" line per tensor of
// both, for the tests of tandem merge-weights on model-parallel checkpoints.
#pragma once

#include <torch/torch.h>

#include <iostream>
#include <string>

#include "tandem/checkpoint/safetensors.h"

namespace tandem::testing {

inline void print_weight_checks(const std::string& merged_path, const std::string& dense_path) {
  tandem::checkpoint::SafetensorsFile merged(merged_path), dense(dense_path);
  std::cout << "same names " << (merged.names() == dense.names()) << std::endl;
  for (const auto& name : merged.names()) {
    if (!dense.contains(name)) continue;
    auto got = merged.tensor(name), want = dense.tensor(name);
    const double rel = got.sizes() == want.sizes()
                           ? ((got - want).abs().max() / want.abs().max()).item<double>()
                           : 1.0;
    std::cout << "check merged " << name << " " << rel << std::endl;
  }
}

}  // namespace tandem::testing
