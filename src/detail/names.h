// The names a refusal lists: the first few, then how many there are in all.
#pragma once

#include <string>
#include <vector>

namespace tandem::detail {

/// "a, b, c" when there are at most `shown` names; else the first `shown`, then
/// ", ... (<n> in all)".
inline std::string first_names(const std::vector<std::string>& names, size_t shown) {
  std::string out;
  for (size_t k = 0; k < names.size() && k < shown; ++k) out += (k ? ", " : "") + names[k];
  if (names.size() > shown) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

}  // namespace tandem::detail
