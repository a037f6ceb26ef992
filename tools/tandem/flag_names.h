// Flag spelling shared by the CLI's subcommands.
#pragma once

#include <algorithm>
#include <string>

namespace tandem::cli {

/// CLI11 names for a flag in Accelerate's underscore spelling and its dashed twin:
/// "num_processes" -> "--num_processes,--num-processes".
inline std::string both(const std::string& name) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return dashed == name ? "--" + name : "--" + name + ",--" + dashed;
}

}  // namespace tandem::cli
