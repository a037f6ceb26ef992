// Helpers of the tests that check error messages.
#pragma once

#include <stdexcept>
#include <string>

namespace tandem::testing {

/// The message of the `Exception` that `f` throws ("" when it throws nothing); any other
/// exception propagates and fails the test.
template <typename Exception = std::invalid_argument, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  }
  return "";
}

/// Whether `hay` contains `needle`.
inline bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

}  // namespace tandem::testing
