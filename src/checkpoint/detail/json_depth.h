// The nesting depth of JSON text, measured before the text reaches nlohmann::json::parse.
//
// Note [JSON depth limit]: nlohmann-json recurses on nested arrays and objects (building the
// value, dumping it into an error message, comparing it), so a file of 140 KB holding
// "[[[[...]]]]" 70,000 deep overflows the stack of a debug build and 300,000 deep that of a
// release build: a crash, not an error. Every parse of text that comes from a file (safetensors
// headers and their metadata values, model.safetensors.index.json, a checkpoint's manifest.json,
// state.json and optimizer JSON) first measures the depth with the linear scan below, which
// never recurses, and refuses text nested deeper than kMaxJsonDepth, far beyond the few levels
// of what tandem and transformers write. Header-only: tests/fuzz compiles safetensors_header.cpp
// without the library.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tandem::checkpoint::detail {

/// The deepest nesting of arrays and objects accepted in a file's JSON.
inline constexpr std::size_t kMaxJsonDepth = 64;

/// How deeply `text` nests arrays and objects.
struct JsonDepth {
  std::size_t max = 0;       ///< the deepest nesting found
  std::size_t too_deep = 0;  ///< byte offset of the first '[' or '{' past the limit, if any
  bool exceeded = false;     ///< whether max > the limit given
};

/// Counts '[' and '{' outside strings (honouring backslash escapes), in one pass without
/// recursion. Malformed text (an unmatched ']', an unterminated string) is measured as far as it
/// goes and left to the parser to report.
inline JsonDepth json_depth(std::string_view text, std::size_t limit = kMaxJsonDepth) {
  JsonDepth out;
  std::size_t depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // the escaped character cannot end the string
      else if (c == '"')
        in_string = false;
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        ++depth;
        if (depth > out.max) out.max = depth;
        if (depth > limit && !out.exceeded) {
          out.exceeded = true;
          out.too_deep = i;
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return out;
}

/// "" when `text` nests at most `limit` deep; otherwise what was found against what is allowed
/// ("nests arrays and objects 70001 deep (...), more than the limit of 64"), for the caller to
/// prefix with the file and its part ("the header ") and to follow with the fix.
inline std::string json_depth_problem(std::string_view text, std::size_t limit = kMaxJsonDepth) {
  const JsonDepth d = json_depth(text, limit);
  if (!d.exceeded) return {};
  return "nests arrays and objects " + std::to_string(d.max) + " deep (level " +
         std::to_string(limit + 1) + " opens at byte " + std::to_string(d.too_deep) +
         " of the JSON), more than the limit of " + std::to_string(limit);
}

}  // namespace tandem::checkpoint::detail
