// Runs a command with a time limit and captures its output: the multi-process tests' harness.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace tandem::testing {

struct RunResult {
  int exit_code = -1;     ///< 128 + signal when killed by a signal
  bool timed_out = false;
  std::string output;     ///< stdout and stderr together
  double seconds = 0;
};

inline RunResult run_command(const std::vector<std::string>& argv,
                             const std::map<std::string, std::string>& env = {},
                             double timeout_s = 120) {
  RunResult r;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return r;
  auto start = std::chrono::steady_clock::now();
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(p[1], 1);
    dup2(p[1], 2);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(p[1]);
  char buf[4096];
  for (;;) {
    double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > timeout_s && !r.timed_out) {
      r.timed_out = true;
      kill(-pid, SIGKILL);
    }
    pollfd fd{p[0], POLLIN, 0};
    int n = poll(&fd, 1, 100);
    if (n > 0) {
      ssize_t k = read(p[0], buf, sizeof(buf));
      if (k <= 0) break;
      r.output.append(buf, static_cast<size_t>(k));
    }
  }
  close(p[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
inline int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

/// Counts occurrences of `needle` in `hay`.
inline int count_of(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (size_t pos = hay.find(needle); pos != std::string::npos; pos = hay.find(needle, pos + 1)) ++n;
  return n;
}

/// The raw float32 values a worker wrote to `path` (empty when the file is missing).
inline std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  in.seekg(0, std::ios::end);
  std::vector<float> v(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  return v;
}

/// The largest |a - b| / max(1, |b|) over the elements (b: the reference); infinity when the
/// sizes differ.
inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::fabs(double(a[i]) - b[i]) / std::max(1.0, std::fabs(double(b[i]))));
  return m;
}

/// /tmp/tandem-<what>-<pid>-<name>: a path of this test process.
inline std::string temp_path(const std::string& what, const std::string& name) {
  return "/tmp/tandem-" + what + "-" + std::to_string(::getpid()) + "-" + name;
}

}  // namespace tandem::testing
