// Reading settings from text: the one vocabulary of booleans, and case folding (shared by the
// library's source files; Note [One vocabulary of booleans]). The environment itself is read by
// the config part only (Note [The environment is read in one place]).
#pragma once

#include <algorithm>
#include "tandem/error.h"
#include <cctype>
#include <stdexcept>
#include <string>

namespace tandem::detail {

inline std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

inline std::string upper(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return s;
}

// Note [One vocabulary of booleans]: every boolean tandem reads (TANDEM_* variables, config file
// keys, launch flags' values) takes the same words, in any case and with surrounding blanks:
// true/false, yes/no, on/off, y/n, 1/0. Anything else is an error naming where the value came
// from; before, TANDEM_USE_CPU=on read as false without a word, and TANDEM_ACTIVATION_CHECKPOINTING
// refused "on" that the config file took.
/// The boolean `value` of `what` (a variable, a key: it names it in the error).
inline bool parse_bool(const std::string& what, const std::string& value) {
  const auto b = value.find_first_not_of(" \t\r\n");
  const auto e = value.find_last_not_of(" \t\r\n");
  const std::string v = b == std::string::npos ? "" : lower(value.substr(b, e - b + 1));
  if (v == "true" || v == "yes" || v == "on" || v == "y" || v == "1") return true;
  if (v == "false" || v == "no" || v == "off" || v == "n" || v == "0") return false;
  throw ::tandem::Refused(what + ": got '" + value +
                              "', expected true or false (also yes/no, on/off, 1/0)");
}

}  // namespace tandem::detail
