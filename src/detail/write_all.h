// Writing whole buffers to a file descriptor: the launcher's and the ranks' reports on pipes and
// terminals, and the files merge_weights writes (no LibTorch here).
#pragma once

#include <unistd.h>

#include <cerrno>
#include <string>

namespace tandem::detail {

/// Writes the `n` bytes at `p` to `fd`, again after an interrupted write; false at any other
/// failure (errno says which), or when the descriptor takes nothing.
inline bool write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

/// All of `s`, for a report on a pipe or a terminal that may be gone: a failure stops it, and the
/// caller has nothing better to do.
inline void write_all(int fd, const std::string& s) {
  write_all(fd, s.data(), s.size());
}

}  // namespace tandem::detail
