// tandem's version and the environment report of `tandem env`.
#pragma once

#include <string>

namespace tandem {

/// tandem's version, "major.minor.patch".
extern const char* const kVersion;

/// LibTorch's version as built against ("1.13.0", "2.5.1", ...).
std::string torch_version();

/// What a bug report needs: tandem and LibTorch versions, CUDA and its devices, NCCL and Gloo,
/// CPU count, memory, OS, and the default launch config (path and contents, or "none"). One
/// "key: value" per line.
std::string environment_report();

}  // namespace tandem
