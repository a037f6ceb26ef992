// Child processes of the trial tools (child.h).
#include "child.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace tandem::trials::detail {

namespace {

// In a forked child: replaces it with argv[0] (exit 127 when it cannot be started).
[[noreturn]] void exec_argv(const std::vector<std::string>& argv) {
  std::vector<char*> a;
  for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  ::execv(a[0], a.data());
  ::_exit(127);
}

}  // namespace

pid_t spawn_logged(const std::vector<std::string>& argv,
                   const std::vector<std::pair<std::string, std::string>>& env,
                   const std::string& log, const std::vector<int>& cpus) {
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed for " + argv.at(0));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // a killed parent stops its jobs
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int cpu : cpus) CPU_SET(cpu, &set);
      ::sched_setaffinity(0, sizeof set, &set);
    }
    exec_argv(argv);
  }
  ::setpgid(pid, pid);
  return pid;
}

std::pair<int, std::string> capture(const std::vector<std::string>& argv) {
  int p[2];
  if (::pipe(p) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(p[1], 1);
    ::dup2(p[1], 2);
    ::close(p[0]);
    ::close(p[1]);
    exec_argv(argv);
  }
  ::close(p[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(p[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

int wait_child(pid_t pid, double timeout_s, double grace_s, bool* timed_out) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto since = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  if (timed_out) *timed_out = false;
  int status = 0;
  bool termed = false;
  double term_at = 0;
  while (true) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return 128 + SIGKILL;
    const double t = since();
    if (timeout_s > 0 && !termed && t > timeout_s) {
      if (timed_out) *timed_out = true;
      ::kill(-pid, SIGTERM);
      termed = true;
      term_at = t;
    } else if (termed && t > term_at + grace_s) {
      ::kill(-pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string tail_lines(const std::string& path, int lines, const std::string& indent) {
  std::ifstream in(path);
  std::vector<std::string> all;
  std::string l;
  while (std::getline(in, l)) all.push_back(l);
  std::string out;
  for (size_t i = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0; i < all.size();
       ++i)
    out += indent + all[i] + "\n";
  return out;
}

}  // namespace tandem::trials::detail
