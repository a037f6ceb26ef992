// tandem::launch::launch: fork workers from the running program, run a function in each, and
// bring the first failure back to the parent through a pipe per worker.
#include "tandem/launch/fork_launcher.h"
#include "../detail/write_all.h"
#include "fork_start.h"
#include "tandem/error.h"
#include "tandem/launch/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include "tandem/comm/process_group.h"
#include "tandem/config/run_env.h"

namespace tandem::launch {
namespace {

using Clock = std::chrono::steady_clock;

using tandem::detail::write_all;

// Note [Secondary failures]: when a worker fails, its peers' collectives fail too, and while the
// first worker unwinds (its process group closing its sockets), a peer may report before it. A
// worker therefore tags its message: 'P' for a primary failure, 'S' when tandem's collectives
// recorded in TANDEM_ERROR_FILE that a peer went away (comm/process_group.cpp), and the parent
// gives a primary failure a moment to arrive before it names a secondary one.
struct Worker {
  int rank = 0;
  pid_t pid = -1;
  int fd = -1;          // read end of the worker's message pipe
  std::string message;  // the tag, then what() of the worker's exception
  bool alive = true;
  int status = 0;
  bool failed = false;
};

// The folder of the workers' error files, removed with its files when launch() returns.
struct ErrorDir {
  std::string path;
  int workers = 0;
  ~ErrorDir() {
    if (path.empty()) return;
    for (int r = 0; r < workers; ++r)
      ::unlink((path + "/rank" + std::to_string(r) + ".error").c_str());
    ::rmdir(path.c_str());
  }
};

bool secondary(const Worker& w) {
  return !w.message.empty() && w.message[0] == 'S';
}

std::string error_file(const std::string& dir, int rank) {
  return dir + "/rank" + std::to_string(rank) + ".error";
}

std::string describe_end(const Worker& w) {
  if (w.message.size() > 1) return w.message.substr(1);
  if (WIFSIGNALED(w.status)) {
    const char* name = strsignal(WTERMSIG(w.status));
    return "killed by signal " + std::to_string(WTERMSIG(w.status)) + " (" + (name ? name : "?") +
           ")";
  }
  if (WIFEXITED(w.status))
    return "exited with code " + std::to_string(WEXITSTATUS(w.status)) + " without an exception";
  return "ended abnormally";
}

[[noreturn]] void run_worker(const std::function<void()>& fn, int fd, int rank, int n, int port,
                             const ForkLaunchOptions& o, int threads, const std::string& errors) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  auto set = [](const std::string& k, const std::string& v) { ::setenv(k.c_str(), v.c_str(), 1); };
  set("RANK", std::to_string(rank));
  set("WORLD_SIZE", std::to_string(n));
  set("LOCAL_RANK", std::to_string(rank));
  set("LOCAL_WORLD_SIZE", std::to_string(n));
  set("GROUP_RANK", "0");
  set("NODE_RANK", "0");
  set("MASTER_ADDR", o.master_addr());
  set("MASTER_PORT", std::to_string(port));
  set(config::var::kLauncher, "1");
  set(config::var::kMixedPrecision, o.mixed_precision());
  set(config::var::kNumCpuThreads, std::to_string(threads));
  set("OMP_NUM_THREADS", std::to_string(threads));
  if (o.cpu()) set(config::var::kUseCpu, "1");
  if (!errors.empty()) set(config::var::kErrorFile, error_file(errors, rank));
  for (const auto& [k, v] : o.env()) set(k, v);
  at::set_num_threads(threads);
  auto tag = [&] {
    std::ifstream f(errors.empty() ? std::string() : error_file(errors, rank));
    std::string word;
    return (f >> word) && word == "peer" ? std::string("S") : std::string("P");
  };
  int code = 0;
  try {
    fn();
  } catch (const std::exception& e) {
    write_all(fd, tag() + e.what());
    code = 1;
  } catch (...) {
    write_all(fd, tag() + "an exception not derived from std::exception");
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);
}

}  // namespace

ForkSafety probe_fork_safety() {
  ForkSafety s;
  s.live_process_groups = live_process_groups();
  s.cuda_initialized = fork_start::cuda_loaded();
  s.threads = fork_start::process_threads();
  return s;
}

void check_fork_safety(const ForkSafety& s) {
  const std::string head = "tandem::launch forks its workers from this process, but ";
  if (s.live_process_groups > 0)
    throw std::runtime_error(
        head + "it holds " + std::to_string(s.live_process_groups) + " live tandem ProcessGroup" +
        (s.live_process_groups == 1 ? "" : "s") +
        " (forked copies would share its sockets). "
        "Create process groups and the Accelerator inside the launched function, or start the "
        "program with `tandem launch`.");
  if (s.cuda_initialized)
    throw std::runtime_error(
        head +
        "CUDA is already initialized here (the CUDA driver library is loaded), and a "
        "forked child cannot use CUDA after that. Do not touch CUDA (CUDA tensors, .cuda(), "
        "torch::cuda::*) before tandem::launch; do it inside the launched function.");
  if (s.threads > 1)
    throw std::runtime_error(
        head + "it runs " + std::to_string(s.threads) +
        " threads: fork copies only the calling "
        "thread, so a lock held by another thread would stay locked forever in the workers. Call "
        "tandem::launch before starting threads (thread pools, loaders; for LibTorch's own pool "
        "call at::set_num_threads(1) before any parallel operation), or use `tandem launch`.");
}

void launch(const std::function<void()>& fn, int num_processes, const ForkLaunchOptions& o) {
  if (num_processes < 1)
    throw ::tandem::Refused("tandem::launch: num_processes=" + std::to_string(num_processes) +
                                " must be at least 1");
  if (!fn) throw ::tandem::Refused("tandem::launch: the function to run is empty");
  check_fork_safety(probe_fork_safety());
  const int port = o.master_port() > 0 ? o.master_port() : find_free_port(o.master_addr());
  int threads = o.num_threads();
  if (threads <= 0)  // Note [Threads per rank]
    threads = default_threads_per_process(static_cast<int>(usable_cpus().size()), num_processes);
  char tmpl[] = "/tmp/tandem-fork-XXXXXX";
  const char* made = ::mkdtemp(tmpl);
  const ErrorDir error_dir{made ? made : "", num_processes};
  const std::string& errors = error_dir.path;
  // Whatever sits in the stdio buffers now would be printed once by every worker too.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);

  std::vector<Worker> workers;
  auto stop_all = [&](int sig) {
    for (auto& w : workers)
      if (w.alive) ::kill(w.pid, sig);
  };
  for (int r = 0; r < num_processes; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) {
      stop_all(SIGKILL);
      for (auto& w : workers) ::waitpid(w.pid, nullptr, 0), ::close(w.fd);
      throw std::runtime_error(std::string("tandem::launch: pipe() failed: ") +
                               std::strerror(errno));
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      int err = errno;
      ::close(p[0]);
      ::close(p[1]);
      stop_all(SIGKILL);
      for (auto& w : workers) ::waitpid(w.pid, nullptr, 0), ::close(w.fd);
      throw std::runtime_error(std::string("tandem::launch: fork() failed: ") + std::strerror(err));
    }
    if (pid == 0) {
      ::close(p[0]);
      for (auto& w : workers) ::close(w.fd);
      run_worker(fn, p[1], r, num_processes, port, o, threads, errors);
    }
    ::close(p[1]);
    ::fcntl(p[0], F_SETFL, O_NONBLOCK);
    Worker w;
    w.rank = r;
    w.pid = pid;
    w.fd = p[0];
    workers.push_back(std::move(w));
  }

  // Supervise. A worker fails when it reports an exception (a message arrives before its exit)
  // or ends badly; the first primary failure is the cause (Note [Secondary failures]), and the
  // others are stopped, since they would wait for it in vain.
  int first = -1;
  std::vector<int> failures;  // in the order they were seen
  Clock::time_point settle_until = Clock::time_point::max(), kill_at{};
  bool killed = false;
  auto drain = [&](Worker& w) {
    char buf[4096];
    for (;;) {
      ssize_t n = ::read(w.fd, buf, sizeof(buf));
      if (n > 0) {
        w.message.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 || errno != EAGAIN) {
        ::close(w.fd);
        w.fd = -1;
      }
      return;
    }
  };
  auto note_failure = [&](size_t i) {
    if (workers[i].failed) return;
    workers[i].failed = true;
    failures.push_back(static_cast<int>(i));
    if (settle_until == Clock::time_point::max())
      settle_until = Clock::now() + std::chrono::milliseconds(1500);
  };
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<size_t> owner;
    for (size_t i = 0; i < workers.size(); ++i)
      if (workers[i].fd >= 0) {
        fds.push_back({workers[i].fd, POLLIN, 0});
        owner.push_back(i);
      }
    if (!fds.empty())
      ::poll(fds.data(), fds.size(), 50);
    else
      ::usleep(20000);
    for (size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Worker& w = workers[owner[k]];
      drain(w);
      if (!w.message.empty()) note_failure(owner[k]);
    }
    for (size_t i = 0; i < workers.size(); ++i) {
      Worker& w = workers[i];
      if (!w.alive) continue;
      int st = 0;
      if (::waitpid(w.pid, &st, WNOHANG) == w.pid) {
        w.alive = false;
        w.status = st;
        if (w.fd >= 0) drain(w);  // its message, written before it exited
        if (!w.message.empty() || !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) note_failure(i);
      }
    }
    bool any_alive = std::any_of(workers.begin(), workers.end(), [](auto& w) { return w.alive; });
    if (first < 0 && !failures.empty()) {
      auto primary = std::find_if(failures.begin(), failures.end(), [&](int i) {
        return !secondary(workers[static_cast<size_t>(i)]);
      });
      if (primary != failures.end() || !any_alive || Clock::now() >= settle_until) {
        first = primary != failures.end() ? *primary : failures.front();
        stop_all(SIGTERM);
        kill_at = Clock::now() +
                  std::chrono::milliseconds(static_cast<int64_t>(o.grace_period_s() * 1000));
      }
    }
    bool any_open = std::any_of(workers.begin(), workers.end(), [](auto& w) { return w.fd >= 0; });
    if (!any_alive && !any_open) break;
    if (first >= 0 && any_alive && !killed && Clock::now() >= kill_at) {
      stop_all(SIGKILL);
      killed = true;
    }
  }
  if (first >= 0) {
    const Worker& w = workers[static_cast<size_t>(first)];
    std::string msg = describe_end(w);
    throw WorkerFailed(w.rank, msg,
                       "tandem::launch: rank " + std::to_string(w.rank) + " of " +
                           std::to_string(num_processes) + " failed: " + msg);
  }
}

}  // namespace tandem::launch
