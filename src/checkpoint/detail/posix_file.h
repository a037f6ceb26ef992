// Small helpers the checkpoint files share: a file descriptor closed on scope exit, the text of
// errno, and a value quoted (shortened) for "is ..." in messages.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace tandem::checkpoint::detail {

/// The text of the current errno.
inline std::string errno_text() {
  return std::strerror(errno);
}

/// A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

/// A value as it appeared, quoted and shortened to 80 characters, for "is ..." in messages.
inline std::string shown(const std::string& value) {
  return "\"" + (value.size() > 80 ? value.substr(0, 77) + "..." : value) + "\"";
}

}  // namespace tandem::checkpoint::detail
