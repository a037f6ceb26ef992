// The exception tandem throws for a request it refuses.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tandem {

/// A request tandem refuses: an option, flag, config key, layout, call or input it cannot
/// honour. The message says what was asked, what was found and the fix, and starts with
/// "[rank r/w]" where the rank is known. It is a std::invalid_argument, so code that catches
/// those catches it. What fails in the world instead (a file that cannot be written or read
/// back, a peer that died, a timeout) is a std::runtime_error.
///
/// Example:
///   try { acc.prepare(model); } catch (const tandem::Refused& e) { std::cerr << e.what(); }
class Refused : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
template <class... Args>
std::string refusal_message(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace tandem

/// Throws tandem::Refused with the message `args...` (streamed, as TORCH_CHECK's) unless `cond`.
#define TANDEM_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) throw ::tandem::Refused(::tandem::detail::refusal_message(__VA_ARGS__)); \
  } while (0)
