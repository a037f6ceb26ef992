// Writing a whole string to a file descriptor, for the launcher's and the ranks' reports on pipes
// and terminals (no LibTorch here).
#pragma once

#include <unistd.h>

#include <cerrno>
#include <string>

namespace tandem::detail {

/// Writes all of `s` to `fd`, again after an interrupted write; stops at any other failure (the
/// callers report on a pipe or a terminal that may be gone, and have nothing better to do).
inline void write_all(int fd, const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<std::size_t>(n);
  }
}

}  // namespace tandem::detail
