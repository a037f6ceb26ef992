// Reading TANDEM_* settings from the environment (shared by the Accelerator's source files).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace tandem::detail {

/// The variable's value, or nullopt when it is unset or empty.
inline std::optional<std::string> env(const char* key) {
  const char* v = std::getenv(key);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

/// "1", "true", "True" or "yes".
inline bool env_true(const std::string& v) {
  return v == "1" || v == "true" || v == "True" || v == "yes";
}

}  // namespace tandem::detail
