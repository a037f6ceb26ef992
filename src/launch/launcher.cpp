// tandem's local supervisor: fork/exec each rank, prefix its output, fail fast, forward signals.
#include "tandem/launch/launcher.h"
#include "../detail/read_file.h"
#include "../detail/write_all.h"
#include "fork_start.h"
#include "tandem/error.h"
#include "tandem/launch/machine_rendezvous.h"
#include "tandem/preemption.h"
#include "tandem/runtime.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <c10/core/thread_pool.h>

#include "tandem/comm/heartbeat.h"
#include "tandem/comm/process_group.h"
#include "tandem/config/run_env.h"

namespace tandem::launch {
namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

// The signal of --preemption_signal, or 0 (Note [Preemption]).
int preemption_signal_of(const LaunchOptions& o) {
  return o.preemption_signal().empty()
             ? 0
             : preemption::signal_from_name(o.preemption_signal(), "--preemption_signal");
}

extern "C" void on_signal(int sig) {
  unsigned char b = static_cast<unsigned char>(sig);
  if (g_signal_pipe[1] >= 0) {
    ssize_t rc = ::write(g_signal_pipe[1], &b, 1);
    (void)rc;
  }
}

using tandem::detail::write_all;

std::string number_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string signal_name(int sig) {
  const char* d = strsignal(sig);
  static const std::map<int, std::string> abbrev = {
      {SIGKILL, "SIGKILL"}, {SIGTERM, "SIGTERM"}, {SIGINT, "SIGINT"},   {SIGSEGV, "SIGSEGV"},
      {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},   {SIGHUP, "SIGHUP"},
      {SIGUSR1, "SIGUSR1"}, {SIGUSR2, "SIGUSR2"}, {SIGQUIT, "SIGQUIT"}, {SIGALRM, "SIGALRM"}};
  auto it = abbrev.find(sig);
  return std::to_string(sig) + " (" + (it != abbrev.end() ? it->second : std::string(d ? d : "?")) +
         ")";
}

// One output stream of one rank: complete lines are written with the prefix in one write(2),
// so lines of two ranks never interleave.
struct Stream {
  int fd = -1;
  int out_fd = 1;
  std::string buffer;
  std::string prefix;
  std::ofstream* log = nullptr;
  bool to_terminal = true;

  void emit(const std::string& line) {
    if (to_terminal) write_all(out_fd, prefix + line + "\n");
    if (log) {
      *log << line << "\n";
      log->flush();
    }
  }
  // Returns false at end of stream.
  bool read_some() {
    char buf[65536];
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (n <= 0) {
      if (!buffer.empty()) emit(buffer);
      buffer.clear();
      ::close(fd);
      fd = -1;
      return false;
    }
    buffer.append(buf, static_cast<size_t>(n));
    size_t start = 0, nl;
    while ((nl = buffer.find('\n', start)) != std::string::npos) {
      emit(buffer.substr(start, nl - start));
      start = nl + 1;
    }
    buffer.erase(0, start);
    return true;
  }
};

struct Child {
  RankPlan plan;
  // When both output pipes reached end of file: the moment the rank exited, as seen by the
  // launcher. It orders failures that are reaped together.
  Clock::time_point closed_at = Clock::time_point::max();
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
  Stream out, err;
  std::unique_ptr<std::ofstream> log;
};

std::vector<std::string> make_envp(const EnvMap& overrides) {
  EnvMap env = current_environment();
  for (const auto& [k, v] : overrides) env[k] = v;
  std::vector<std::string> out;
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// Opens the rank's log file and its two output pipes, whose read ends become c.out and c.err;
// returns the write ends (the rank's stdout and stderr).
std::pair<int, int> open_outputs(Child& c, const LaunchOptions& opts) {
  // The log file first: a folder that cannot be written is refused before the rank starts.
  std::unique_ptr<std::ofstream> log;
  if (!opts.log_dir().empty()) {
    std::string path = opts.log_dir() + "/rank" + std::to_string(c.plan.rank) + ".log";
    log = std::make_unique<std::ofstream>(path, std::ios::app);
    if (!*log)
      throw std::runtime_error("cannot write the log file " + path +
                               ": check that --log_dir exists and is writable");
  }
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("pipe() failed: ") + std::strerror(errno));
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    const int err = errno;
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    throw std::runtime_error(std::string("pipe() failed: ") + std::strerror(err));
  }
  const std::string prefix = "[rank " + std::to_string(c.plan.rank) + "] ";
  c.out = Stream{out_pipe[0], 1, "", prefix, nullptr, true};
  c.err = Stream{err_pipe[0], 2, "", prefix, nullptr, true};
  if (log) {
    c.log = std::move(log);
    c.out.log = c.err.log = c.log.get();
    c.out.to_terminal = c.err.to_terminal = opts.tee();
  }
  return {out_pipe[1], err_pipe[1]};
}

// Starts `argv` with exactly `envs` as its environment, stdout and stderr on `out` and `err`,
// bound to `cpus` (none: not bound), in a process group of its own that dies with the launcher.
// `keep`: descriptors the program inherits (every other one the launcher opened is close-on-exec).
pid_t start_process(const std::vector<std::string>& program, std::vector<std::string> envs, int out,
                    int err, const std::vector<int>& cpus, int rank, const std::vector<int>& keep,
                    const LaunchOptions& opts) {
  std::vector<char*> envp, argv;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  for (auto& a : program) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t parent = ::getpid();
  // Note [Signals between fork and exec]: until the child resets them, it runs the launcher's
  // handlers, which write into the launcher's signal pipe: a SIGTERM sent to stop a rank that
  // has not reached exec yet would read as a signal the launcher received. So the signals stay
  // blocked in the child until its handlers are the default ones.
  sigset_t stop_signals, before;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  const int preemption_signal = preemption_signal_of(opts);
  if (preemption_signal) sigaddset(&stop_signals, preemption_signal);
  ::sigprocmask(SIG_BLOCK, &stop_signals, &before);
  pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    ::sigprocmask(SIG_SETMASK, &before, nullptr);
    throw std::runtime_error(std::string("fork() failed: ") + std::strerror(e));
  }
  if (pid == 0) {
    // Child: own process group (so the whole tree can be signalled), die with the launcher.
    g_signal_pipe[1] = -1;
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGPIPE, SIG_DFL);
    if (preemption_signal) ::signal(preemption_signal, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int cpu : cpus) CPU_SET(cpu, &set);
      if (::sched_setaffinity(0, sizeof(set), &set) != 0) {
        std::string msg = "tandem launch: cannot bind rank " + std::to_string(rank) +
                          " to its cores: " + std::strerror(errno) + "\n";
        write_all(err, msg);
        ::_exit(126);
      }
    }
    for (int fd : keep) ::fcntl(fd, F_SETFD, 0);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execvpe(argv[0], argv.data(), envp.data());
    std::string msg =
        "tandem launch: cannot run '" + program[0] + "': " + std::strerror(errno) + "\n";
    write_all(2, msg);
    ::_exit(127);
  }
  ::sigprocmask(SIG_SETMASK, &before, nullptr);
  ::setpgid(pid, pid);
  return pid;
}

void spawn(Child& c, const LaunchOptions& opts) {
  const auto [out, err] = open_outputs(c, opts);
  pid_t pid = -1;
  try {
    pid = start_process(c.plan.argv, make_envp(c.plan.env), out, err, c.plan.cpus, c.plan.rank, {},
                        opts);
  } catch (...) {
    ::close(out);
    ::close(err);
    throw;
  }
  ::close(out);
  ::close(err);
  c.pid = pid;
  c.alive = true;
  c.closed_at = Clock::time_point::max();
  c.status = 0;
}

// Note [Fork start]: why `children` cannot start from one fork server, or "".
std::string fork_start_refusal(const std::vector<Child>& children) {
  auto path = current_environment();
  const auto& first = children.front().plan;
  std::string why = fork_start::unsupported_program(first.argv.front(), path["PATH"]);
  if (!why.empty()) return why;
  for (const auto& c : children) {
    if (c.plan.argv != first.argv)
      return "rank " + std::to_string(c.plan.rank) + " has another command line than rank " +
             std::to_string(first.rank) + ", and one process forks them all";
    for (const auto* m : {&c.plan.env, &first.env})
      for (const auto& [k, v] : *m) {
        const auto a = c.plan.env.find(k), b = first.env.find(k);
        const bool same = a != c.plan.env.end() && b != first.env.end() && a->second == b->second;
        if (!same && !fork_start::may_differ(k))
          return "rank " + std::to_string(c.plan.rank) + "'s environment differs from rank " +
                 std::to_string(first.rank) + "'s in " + k +
                 ", which the program's libraries may read before main(), once for every rank";
      }
  }
  return "";
}

// Note [Fork start]: starts the program once, as the fork server, which forks every child.
void spawn_forked(std::vector<Child>& children, const LaunchOptions& opts) {
  if (auto why = fork_start_refusal(children); !why.empty())
    throw ::tandem::Refused("--start_method fork: " + why +
                            ". Start the ranks with --start_method exec (the default)");
  // The ranks become the launcher's children when the server that forked them exits.
  static const bool subreaper = ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
  if (!subreaper)
    throw std::runtime_error(std::string("--start_method fork: prctl(PR_SET_CHILD_SUBREAPER) "
                                         "failed: ") +
                             std::strerror(errno));
  std::vector<int> keep;  // every descriptor the server inherits
  struct Fds {
    std::vector<int> fds;
    ~Fds() {
      for (int fd : fds) ::close(fd);
    }
  } opened;
  fork_start::Spec spec;
  spec.launcher_pid = static_cast<int>(::getpid());
  for (auto& c : children) {
    const auto [out, err] = open_outputs(c, opts);
    opened.fds.insert(opened.fds.end(), {out, err});
    spec.ranks.push_back({c.plan.rank, out, err, c.plan.cpus, make_envp(c.plan.env)});
  }
  keep = opened.fds;
  const int spec_fd = ::memfd_create("tandem-fork-start", MFD_CLOEXEC);
  int result[2] = {-1, -1};
  if (spec_fd < 0 || ::pipe2(result, O_CLOEXEC) != 0) {
    if (spec_fd >= 0) ::close(spec_fd);
    throw std::runtime_error(std::string("--start_method fork: ") + std::strerror(errno));
  }
  opened.fds.insert(opened.fds.end(), {spec_fd, result[1]});
  const std::string bytes = fork_start::encode(spec);
  if (::pwrite(spec_fd, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) {
    ::close(result[0]);
    throw std::runtime_error(std::string("--start_method fork: cannot write the ranks' spec: ") +
                             std::strerror(errno));
  }
  keep.insert(keep.end(), {spec_fd, result[1]});
  auto envs = spec.ranks.front().env;
  envs.push_back(std::string(fork_start::kServerVar) + "=" + std::to_string(spec_fd) + "," +
                 std::to_string(result[1]));
  pid_t server = -1;
  try {
    server = start_process(children.front().plan.argv, envs, spec.ranks.front().out_fd,
                           spec.ranks.front().err_fd, {}, children.front().plan.rank, keep, opts);
  } catch (...) {
    ::close(result[0]);
    throw;
  }
  for (int fd : opened.fds) ::close(fd);
  opened.fds.clear();
  // The server writes "pid <index> <pid>" for each rank it forked, or "error <why>", and exits.
  std::string text;
  char buf[4096];
  const auto deadline = Clock::now() + std::chrono::seconds(300);
  bool timed_out = false;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{result[0], POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    const ssize_t got = ::read(result[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    text.append(buf, static_cast<size_t>(got));
  }
  ::close(result[0]);
  if (timed_out) ::kill(-server, SIGKILL);
  int status = 0;
  while (::waitpid(server, &status, 0) < 0 && errno == EINTR) {
  }
  std::istringstream lines(text);
  std::string line, error;
  size_t started = 0;
  while (std::getline(lines, line)) {
    size_t index = 0;
    long pid = 0;
    if (line.rfind("error ", 0) == 0) {
      error = line.substr(6);
    } else if (std::sscanf(line.c_str(), "pid %zu %ld", &index, &pid) == 2 &&
               index < children.size()) {
      children[index].pid = static_cast<pid_t>(pid);
      children[index].alive = true;
      children[index].closed_at = Clock::time_point::max();
      children[index].status = 0;
      ++started;
    }
  }
  if (started == children.size() && error.empty() && WIFEXITED(status) &&
      WEXITSTATUS(status) == 0) {
    for (auto& c : children) ::setpgid(c.pid, c.pid);  // each rank also takes its own
    return;
  }
  // The ranks that did start are this launcher's children now; some may not have their own
  // process group yet.
  for (auto& c : children)
    if (c.alive) {
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, nullptr, 0);
      c.alive = false;
    }
  if (error.empty())
    error =
        timed_out
            ? "the program did not fork its ranks within 300 s"
            : "the program " +
                  std::string(WIFSIGNALED(status)
                                  ? "was killed by signal " + signal_name(WTERMSIG(status))
                                  : "exited with code " + std::to_string(exit_code_of(status))) +
                  " before it forked its ranks (is its libtandem older than this "
                  "launcher?)";
  throw ::tandem::Refused("--start_method fork: " + error +
                          ". Start the ranks with --start_method exec (the default)");
}

// The first word of what rank `c` wrote into TANDEM_ERROR_FILE ("" when nothing).
std::string error_word(const Child& c) {
  auto it = c.plan.env.find(config::var::kErrorFile);
  if (it == c.plan.env.end()) return "";
  std::ifstream f(it->second);
  std::string word;
  f >> word;
  return word;
}

// Note [Secondary failures]: tandem's collectives write "peer" into TANDEM_ERROR_FILE when they
// fail because another rank went away (comm/process_group.cpp); the launcher reads it here. A
// rank killed by SIGPIPE wrote to a socket whose peer had gone (a program that put SIGPIPE back
// to its default): a consequence too.
bool failed_because_of_peer(const Child& c) {
  if (WIFSIGNALED(c.status) && WTERMSIG(c.status) == SIGPIPE) return true;
  return error_word(c) == "peer";
}

// Note [Free ports]: rank 0 writes "port-taken" into TANDEM_ERROR_FILE when the port the
// launcher found free was taken before it listened on it (comm/process_group.cpp).
bool port_was_taken(const std::vector<Child>& children) {
  for (const auto& c : children)
    if (c.plan.rank == 0) return error_word(c) == "port-taken";
  return false;
}

std::string describe_exit(const Child& c) {
  std::string who = "rank " + std::to_string(c.plan.rank) + " (pid " + std::to_string(c.pid) + ")";
  if (WIFSIGNALED(c.status)) return who + " was killed by signal " + signal_name(WTERMSIG(c.status));
  return who + " exited with code " + std::to_string(exit_code_of(c.status));
}

// Note [Heartbeat]: seconds between two heartbeats of a rank, for a timeout of `timeout_s`.
double heartbeat_interval_s(double timeout_s) { return std::clamp(timeout_s / 5.0, 0.05, 2.0); }

std::string rank_list(const std::vector<const Child*>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i)
    s += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") +
         std::to_string(ranks[i]->plan.rank);
  return s;
}

std::string seconds_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

struct Hang {
  const Child* culprit = nullptr;  // the rank named first
  std::string message;
};

// Note [Heartbeat]: reads every live rank's heartbeat; a rank whose beat is older than the
// timeout no longer runs, and ranks that wait in a collective for longer than it, beginning or
// ending no other, hang. Says who, and where each rank is.
std::optional<Hang> find_hang(const std::vector<Child>& children, double timeout_s) {
  struct Seen {
    const Child* child;
    comm::HeartbeatReport beat;
    double age_s;  // of the beat
  };
  const double now = std::chrono::duration<double>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  std::vector<Seen> seen;
  std::vector<const Child*> silent;  // alive, no heartbeat yet (or no longer)
  for (const auto& c : children) {
    if (!c.alive) continue;
    auto it = c.plan.env.find(config::var::kHeartbeatFile);
    if (it == c.plan.env.end()) continue;
    std::optional<comm::HeartbeatReport> beat;
    if (auto text = ::tandem::detail::read_file(it->second)) beat = comm::parse_heartbeat(*text);
    if (beat)
      seen.push_back({&c, *beat, std::max(0.0, now - beat->wall_s)});
    else
      silent.push_back(&c);
  }
  std::vector<const Child*> stale, waiting, others;
  const Seen* first_waiting = nullptr;
  for (const auto& s : seen) {
    if (s.age_s > timeout_s) {
      stale.push_back(s.child);
    } else if (!s.beat.pending.empty() && s.beat.pending_age_s + s.age_s > timeout_s &&
               s.beat.activity_age_s + s.age_s > timeout_s) {
      waiting.push_back(s.child);
      if (!first_waiting) first_waiting = &s;
    } else {
      others.push_back(s.child);
    }
  }
  if (stale.empty() && waiting.empty()) return std::nullopt;
  auto seen_of = [&](const Child* c) -> const Seen& {
    return *std::find_if(seen.begin(), seen.end(), [c](const Seen& s) { return s.child == c; });
  };
  // Where a rank is; for a rank that stopped, where it was when it last beat (up to one
  // interval before it stopped).
  auto where = [&](const Child* c) {
    const auto& s = seen_of(c);
    const bool then = s.age_s > timeout_s;
    const auto& b = s.beat;
    if (!b.pending.empty())
      return (then ? "waited in " + b.pending + " (for " + seconds_text(b.pending_age_s)
                   : "waits in " + b.pending + " (for " + seconds_text(b.pending_age_s + s.age_s)) +
             " s)";
    if (!b.last.empty())
      return std::string(then ? "was" : "is") + " in no collective; its last: " + b.last;
    return std::string(then ? "had" : "has") + " issued no collective yet";
  };
  auto pid_of = [](const Child* c) { return " (pid " + std::to_string(c->pid) + ")"; };
  std::string flight_dir;
  for (const auto& s : seen)
    if (flight_dir.empty()) flight_dir = s.beat.flight_dir;
  Hang h;
  std::ostringstream out;
  if (!stale.empty()) {
    h.culprit = stale.front();
    for (const Child* c : stale)
      out << "rank " << c->plan.rank << pid_of(c) << " stopped running: its heartbeat is "
          << seconds_text(seen_of(c).age_s) << " s old (--heartbeat_timeout_s "
          << number_text(timeout_s) << "); when it last beat, it " << where(c) << ". ";
  } else {
    // Who is not in the collective the others wait in: named first.
    std::vector<const Child*> absent;
    for (const Child* c : others) absent.push_back(c);
    for (const auto& s : seen)
      if (std::find(waiting.begin(), waiting.end(), s.child) != waiting.end() &&
          s.beat.pending != first_waiting->beat.pending)
        absent.push_back(s.child);
    for (const Child* c : silent) absent.push_back(c);
    h.culprit = !absent.empty() ? absent.front() : waiting.front();
    out << rank_list(waiting) << " waited in a collective for longer than "
        << "--heartbeat_timeout_s " << number_text(timeout_s) << " s, beginning or ending no "
        << "other: a hang. ";
    for (const Child* c : absent)
      out << "rank " << c->plan.rank << pid_of(c) << " is not in "
          << first_waiting->beat.pending << ": "
          << (std::find(silent.begin(), silent.end(), c) != silent.end()
                  ? std::string("it has written no heartbeat (no Accelerator yet, or no longer)")
                  : "it " + where(c))
          << " (look at its stack: gdb -p " << c->pid << "). ";
  }
  for (const Child* c : waiting)
    if (std::find(stale.begin(), stale.end(), c) == stale.end())
      out << "Rank " << c->plan.rank << " " << where(c) << ". ";
  if (!stale.empty())
    for (const Child* c : others) out << "Rank " << c->plan.rank << " " << where(c) << ". ";
  out << "Every rank's flight recorder is asked for its dump (SIGUSR2)";
  if (!flight_dir.empty()) out << ": tandem doctor " << flight_dir;
  out << "; stopping the job";
  h.message = out.str();
  return h;
}

// Runs one attempt. Returns the exit code; sets `interrupted` when a signal stopped the job and
// lists in `lost` the ranks killed by SIGKILL before the launcher stopped any (Note [Elastic
// restarts]).
int run_once(std::vector<Child>& children, const LaunchOptions& opts, bool& interrupted,
             std::vector<const Child*>& lost) {
  try {
    if (opts.start_method() == "fork")
      spawn_forked(children, opts);
    else
      for (auto& c : children) spawn(c, opts);
  } catch (...) {
    // The ranks already started would wait for the missing one until their timeout.
    for (auto& c : children)
      if (c.alive) {
        ::kill(-c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
        c.alive = false;
      }
    throw;
  }
  const Child* failed = nullptr;
  int forwarded_signal = 0;
  // Note [Preemption]: SIGTERM and --preemption_signal give the ranks preemption_grace_s to save
  // and stop; a rank that did exits with preemption::kExitCode, which is not a failure.
  const int preemption_signal = preemption_signal_of(opts);
  bool preempted = false;
  bool stopping = false;
  Clock::time_point kill_at{};
  bool killed = false;
  std::vector<Child*> candidates;  // failed ranks, in the order they were found
  Clock::time_point settle_until = Clock::time_point::max();
  int drain_loops = 0;  // loops spent reading pipes that outlive their rank
  const double heartbeat_s = opts.heartbeat_timeout_s();
  Clock::time_point next_heartbeat_check = Clock::now();

  auto signal_all = [&](int sig) {
    for (auto& c : children)
      if (c.alive) ::kill(-c.pid, sig);
  };
  auto after = [](double seconds) {
    return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
  };
  auto begin_stop = [&](int sig, double grace_s) {
    if (stopping) return;
    stopping = true;
    signal_all(sig);
    kill_at = after(grace_s);
  };

  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    streams.push_back(nullptr);
    for (auto& c : children)
      for (Stream* s : {&c.out, &c.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
    int timeout_ms = std::max(10, static_cast<int>(opts.monitor_interval_s() * 1000));
    int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n > 0) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        if (i == 0) {
          unsigned char sig = 0;
          if (::read(g_signal_pipe[0], &sig, 1) == 1) {
            forwarded_signal = sig;
            interrupted = true;
            const bool preemption = sig == SIGTERM || sig == preemption_signal;
            if (!opts.quiet())
              write_all(2, "tandem launch: received signal " + signal_name(sig) +
                               ", forwarding it to every rank" +
                               (preemption && !stopping
                                    ? " (a rank that checkpoints on preemption saves and stops; "
                                      "SIGKILL in " + number_text(opts.preemption_grace_s()) +
                                      " s, or at a second signal)"
                                    : "") +
                               "\n");
            if (stopping) {
              signal_all(SIGKILL);
            } else {
              begin_stop(sig, preemption ? opts.preemption_grace_s() : opts.grace_period_s());
            }
          }
        } else if (!streams[i]->read_some()) {
          for (auto& c : children)
            if (c.out.fd < 0 && c.err.fd < 0 && c.closed_at == Clock::time_point::max())
              c.closed_at = Clock::now();
        }
      }
    }
    // Reap. When several ranks are found failed at once, the first to close its output failed
    // first; the others most likely failed because of it.
    std::vector<Child*> newly_failed;  // sorted below by when their output closed
    for (auto& c : children) {
      if (!c.alive) continue;
      int st = 0;
      pid_t r = ::waitpid(c.pid, &st, WNOHANG);
      if (r == c.pid) {
        c.alive = false;
        c.status = st;
        if (WIFEXITED(st) && WEXITSTATUS(st) == preemption::kExitCode) {
          // Saved and stopped; the others are at the same step boundary and follow.
          preempted = true;
          if (!stopping) {
            stopping = true;
            kill_at = after(opts.preemption_grace_s());
          }
        } else if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
          newly_failed.push_back(&c);
        }
        if (WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL && !stopping) lost.push_back(&c);
      }
    }
    std::stable_sort(newly_failed.begin(), newly_failed.end(),
                     [](Child* a, Child* b) { return a->closed_at < b->closed_at; });
    for (Child* c : newly_failed) candidates.push_back(c);
    if (!candidates.empty() && !failed && !stopping) {
      // A rank whose collective failed because a peer vanished is a consequence, not the cause:
      // give the cause a moment to be reaped too, then name the first primary failure.
      auto primary = std::find_if(candidates.begin(), candidates.end(),
                                  [](Child* c) { return !failed_because_of_peer(*c); });
      if (settle_until == Clock::time_point::max())
        settle_until = Clock::now() + std::chrono::milliseconds(1500);
      bool all_done = std::none_of(children.begin(), children.end(), [](auto& c) { return c.alive; });
      if (primary != candidates.end() || Clock::now() >= settle_until || all_done) {
        failed = primary != candidates.end() ? *primary : candidates.front();
        write_all(2, "tandem launch: " + describe_exit(*failed) + "; stopping the other ranks\n");
        begin_stop(SIGTERM, opts.grace_period_s());
      }
    }
    // Note [Heartbeat]: a hang ends the job as a failure of the rank named first (restarted
    // under --max_restarts); the ranks get a moment to write their flight records.
    if (heartbeat_s > 0 && !stopping && !failed && Clock::now() >= next_heartbeat_check) {
      next_heartbeat_check = after(heartbeat_interval_s(heartbeat_s) / 2);
      if (auto hang = find_hang(children, heartbeat_s)) {
        write_all(2, "tandem launch: " + hang->message + "\n");
        failed = hang->culprit;
        begin_stop(SIGUSR2, 2.0);  // then SIGKILL
      }
    }
    bool any_alive = std::any_of(children.begin(), children.end(), [](auto& c) { return c.alive; });
    if (stopping && any_alive && !killed && Clock::now() >= kill_at) {
      signal_all(SIGKILL);
      killed = true;
    }
    bool any_open = std::any_of(children.begin(), children.end(),
                                [](auto& c) { return c.out.fd >= 0 || c.err.fd >= 0; });
    if (!any_alive && !any_open) break;
    if (!any_alive && any_open) {
      // Grandchildren may keep a pipe open; give them a moment, then stop reading.
      if (++drain_loops > 20) {
        for (auto& c : children)
          for (Stream* s : {&c.out, &c.err})
            if (s->fd >= 0) {
              ::close(s->fd);
              s->fd = -1;
            }
      }
    }
  }
  if (failed) return exit_code_of(failed->status);
  // Exited 0, or saved and stopped for a preemption.
  auto stopped_cleanly = [](const Child& c) {
    return WIFEXITED(c.status) &&
           (WEXITSTATUS(c.status) == 0 || WEXITSTATUS(c.status) == preemption::kExitCode);
  };
  if (preempted && std::all_of(children.begin(), children.end(), stopped_cleanly)) {
    interrupted = true;  // not restarted: the job was asked to stop
    write_all(2, "tandem launch: the job was preempted: its ranks saved a checkpoint and stopped; "
                 "exit code " + std::to_string(preemption::kExitCode) +
                 " (run it again to continue from the checkpoint)\n");
    return preemption::kExitCode;
  }
  if (preempted) {  // a rank that did not stop within the grace period
    interrupted = true;  // the job was asked to stop: not restarted either
    for (const auto& c : children)
      if (!stopped_cleanly(c)) {
        write_all(2, "tandem launch: the job was preempted, and " + describe_exit(c) +
                         " instead of saving and stopping\n");
        return exit_code_of(c.status);
      }
  }
  if (forwarded_signal) return 128 + forwarded_signal;
  return 0;
}

}  // namespace

std::vector<RankPlan> make_plan(const LaunchOptions& o, const std::vector<std::string>& command,
                                const EnvMap& environment) {
  if (command.empty())
    throw ::tandem::Refused(
        "no program given: expected tandem launch [options] PROGRAM [ARGS...]");
  if (o.num_processes() < 1)
    throw ::tandem::Refused("--num_processes=" + std::to_string(o.num_processes()) +
                                " must be at least 1");
  if (o.num_machines() < 1)
    throw ::tandem::Refused("--num_machines=" + std::to_string(o.num_machines()) +
                                " must be at least 1");
  if (o.machine_rank() < 0 || o.machine_rank() >= o.num_machines())
    throw ::tandem::Refused("--machine_rank=" + std::to_string(o.machine_rank()) +
                                " must be in [0, " + std::to_string(o.num_machines()) + ")");
  if (o.max_restarts() < 0)
    throw ::tandem::Refused("--max_restarts=" + std::to_string(o.max_restarts()) +
                                " must be at least 0: how many times every rank is started again "
                                "after a failure (0: never)");
  if (o.min_processes() < 0 || o.min_processes() > o.num_processes())
    throw ::tandem::Refused("--min_processes=" + std::to_string(o.min_processes()) +
                                " must be in [0, --num_processes=" +
                                std::to_string(o.num_processes()) +
                                "]: the fewest processes an elastic restart may run on");
  if (o.min_processes() > 0 && o.max_restarts() == 0)
    throw ::tandem::Refused("--min_processes=" + std::to_string(o.min_processes()) +
                                " restarts the job on the ranks that remain after a loss, and "
                                "--max_restarts is 0: give --max_restarts K (how many restarts)");
  if (o.min_processes() > 0 && o.num_machines() > 1)
    throw ::tandem::Refused("--min_processes is elastic within one machine, and this job has "
                                "--num_machines=" + std::to_string(o.num_machines()) +
                                ": leave it out, or run one machine (--max_restarts restarts "
                                "every machine's ranks at the same size)");
  if (o.min_machines() < 0 || o.min_machines() > o.num_machines())
    throw ::tandem::Refused("--min_machines=" + std::to_string(o.min_machines()) +
                                " must be in [0, --num_machines=" +
                                std::to_string(o.num_machines()) +
                                "]: the fewest machines an attempt may run on");
  if (o.min_machines() > 0 && o.min_processes() > 0)
    throw ::tandem::Refused("--min_machines and --min_processes together are not supported: "
                                "across machines a job shrinks by whole machines; leave out "
                                "--min_processes");
  if (o.min_machines() > 0 && !(o.rdzv_timeout_s() > 0))
    throw ::tandem::Refused("--rdzv_timeout=" + number_text(o.rdzv_timeout_s()) +
                                " must be above 0: seconds machine 0 waits for the others");
  if (o.fault_tolerant_replicas()) {
    // Note [Replica recovery]
    if (o.num_machines() < 2)
      throw ::tandem::Refused(
          "--fault_tolerant_replicas makes every machine one replica, and "
          "this job has --num_machines=" +
          std::to_string(o.num_machines()) + ": run 2 or more machines, or leave the flag out");
    if (o.num_processes() != 1)
      throw ::tandem::Refused(
          "--fault_tolerant_replicas runs one process on each machine, and "
          "this job asks for " +
          std::to_string(o.num_processes()) +
          " per machine: give --num_processes equal to --num_machines");
    if (o.min_machines() > 0 || o.min_processes() > 0)
      throw ::tandem::Refused(
          "--fault_tolerant_replicas with --min_machines or --min_processes: "
          "replicas go on without a lost machine instead of restarting the "
          "job; leave out --min_machines/--min_processes");
    if (!(o.replica_timeout_s() > 0))
      throw ::tandem::Refused("--replica_timeout_s=" + number_text(o.replica_timeout_s()) +
                              " must be above 0: seconds a replica's gradient sum or vote may "
                              "take before the others go on without it");
  }
  if (o.start_method() != "exec" && o.start_method() != "fork")
    throw ::tandem::Refused("--start_method=" + o.start_method() +
                            ": expected exec (every rank starts the program) or fork (the "
                            "program starts once and forks its ranks)");
  preemption_signal_of(o);  // refuses a name that is not a signal
  if (!(o.preemption_grace_s() >= 0))
    throw ::tandem::Refused("--preemption_grace_s=" + number_text(o.preemption_grace_s()) +
                            " must be at least 0: seconds the ranks get to save a checkpoint "
                            "and stop after SIGTERM or --preemption_signal, before SIGKILL");
  if (!(o.heartbeat_timeout_s() >= 0))
    throw ::tandem::Refused("--heartbeat_timeout_s=" + number_text(o.heartbeat_timeout_s()) +
                            " must be at least 0: seconds a rank may stop running, or wait in "
                            "one collective, before the job is ended (0: no heartbeat)");
  if (!(o.grace_period_s() >= 0))
    throw ::tandem::Refused("--grace_period=" + number_text(o.grace_period_s()) +
                                " must be at least 0: seconds between SIGTERM and SIGKILL when "
                                "the other ranks are stopped");
  if (!(o.monitor_interval_s() > 0))
    throw ::tandem::Refused("--monitor_interval=" + number_text(o.monitor_interval_s()) +
                                " must be above 0: seconds between health checks (e.g. 0.1)");
  if (o.main_process_port() < 0 || o.main_process_port() > 65535)
    throw ::tandem::Refused("--main_process_port=" + std::to_string(o.main_process_port()) +
                                " is not a TCP port (1-65535, or 0 to pick a free one)");
  // c10d's store would retry a name that does not resolve every second until its timeout.
  if (auto why = host_resolution_error(o.main_process_ip()); !why.empty())
    throw ::tandem::Refused(
        "--main_process_ip " + o.main_process_ip() +
        " (MASTER_ADDR of every rank) does not resolve: " + why +
        ". Expected the IP address or host name of machine 0, where rank 0 listens: check the "
        "spelling, or pass its IP address (e.g. --main_process_ip 10.0.0.1; on one machine "
        "leave it out)");
  int port = o.main_process_port();
  if (port == 0) {
    if (o.num_machines() > 1)
      throw ::tandem::Refused("--main_process_port is required with --num_machines > 1: every "
                                  "machine must know where rank 0 listens");
    port = find_free_port(o.main_process_ip());
  }
  // Note [Threads per rank]: N ranks each running an OpenMP pool as large as the machine
  // oversubscribe the cores N times; torchrun and Intel's launcher give each rank its share.
  // The user's OMP_NUM_THREADS (--env, else the launcher's environment) is kept as it is.
  const std::vector<int> cpus = usable_cpus();
  int threads = o.num_cpu_threads_per_process();
  bool user_threads = false;
  if (threads <= 0) {
    std::string omp;
    for (const EnvMap* m : {&o.extra_env(), &environment})
      if (auto it = m->find("OMP_NUM_THREADS"); omp.empty() && it != m->end()) omp = it->second;
    int n = 0;
    try {
      size_t pos = 0;
      n = std::stoi(omp, &pos);
      if (pos != omp.size()) n = 0;
    } catch (const std::exception&) {
      n = 0;
    }
    if (n >= 1) {
      threads = n;
      user_threads = true;
    } else {
      threads = default_threads_per_process(static_cast<int>(cpus.size()), o.num_processes());
    }
  }
  if (o.cpu_affinity() && static_cast<int>(cpus.size()) < threads * o.num_processes())
    throw ::tandem::Refused(
        "--enable_cpu_affinity: " + std::to_string(o.num_processes()) + " processes of " +
        std::to_string(threads) + " thread(s) need " + std::to_string(threads * o.num_processes()) +
        " cores, and this launcher may use " + std::to_string(cpus.size()) +
        ": lower --num_cpu_threads_per_process (or OMP_NUM_THREADS), start fewer processes, or "
        "leave out --enable_cpu_affinity");
  const int world = o.num_processes() * o.num_machines();
  // Note [OpenBLAS kernels]: the ranks get the kernels this CPU runs, unless the user chose.
  std::string blas_core;
  if (!environment.count("OPENBLAS_CORETYPE")) blas_core = cpu_libraries().blas_core_better;
  std::vector<RankPlan> plan;
  for (int local = 0; local < o.num_processes(); ++local) {
    RankPlan p;
    p.local_rank = local;
    p.rank = o.machine_rank() * o.num_processes() + local;
    p.argv = command;
    p.env = o.extra_env();
    p.env[config::var::kLauncher] = "1";
    p.env["RANK"] = std::to_string(p.rank);
    p.env["WORLD_SIZE"] = std::to_string(world);
    p.env["LOCAL_RANK"] = std::to_string(local);
    p.env["LOCAL_WORLD_SIZE"] = std::to_string(o.num_processes());
    p.env["GROUP_RANK"] = std::to_string(o.machine_rank());
    p.env["NODE_RANK"] = std::to_string(o.machine_rank());
    p.env["MASTER_ADDR"] = o.main_process_ip();
    p.env["MASTER_PORT"] = std::to_string(port);
    if (!user_threads) p.env["OMP_NUM_THREADS"] = std::to_string(threads);
    p.env[config::var::kNumCpuThreads] = std::to_string(threads);
    if (!blas_core.empty() && !p.env.count("OPENBLAS_CORETYPE"))
      p.env["OPENBLAS_CORETYPE"] = blas_core;
    if (o.cpu_affinity()) {
      std::string list;
      for (int k = 0; k < threads; ++k) {
        p.cpus.push_back(cpus[static_cast<size_t>(local * threads + k)]);
        list += (k ? "," : "") + std::to_string(p.cpus.back());
      }
      p.env[config::var::kCpuAffinity] = list;
    }
    if (o.cpu()) p.env[config::var::kUseCpu] = "1";
    if (!o.preemption_signal().empty())
      p.env[config::var::kPreemptionSignal] = o.preemption_signal();
    if (!environment.count(config::var::kRestartCount)) p.env[config::var::kRestartCount] = "0";
    if (o.fault_tolerant_replicas()) {
      // Note [Replica recovery]: each machine's process is a world of its own, one replica of
      // the quorum that machine 0's launcher keeps.
      p.rank = 0;
      p.env["RANK"] = "0";
      p.env["WORLD_SIZE"] = "1";
      p.env["MASTER_ADDR"] = "127.0.0.1";
      p.env[config::var::kReplicaStore] = o.main_process_ip() + ":" + std::to_string(port + 1);
      p.env[config::var::kReplicas] = std::to_string(o.num_machines());
      p.env[config::var::kReplicaTimeoutS] = number_text(o.replica_timeout_s());
    }
    plan.push_back(std::move(p));
  }
  return plan;
}

// Note [Threads per rank]: a rank gets the cores of the launcher's affinity mask divided among
// the local ranks, and never more threads than LibTorch gives the same program started by hand
// (c10::TaskThreadPoolBase::defaultNumThreads(): hardware_concurrency() / 2 on x86-64 in
// LibTorch 1.13, which counts on two hardware threads per core; the physical cores in 2.x).
// On a 2-core machine without SMT a LibTorch 1.13 program started by hand runs 1 thread; the
// launcher used to give it 2 (cores / 1) and, with any other process running, it trained 10-50x
// slower than by hand: every parallel region (each op above the grain size, each OpenBLAS call
// of its OpenMP build) ends in a barrier that waits for the thread sharing its core with the
// other process, while libgomp's waiting threads spin (OMP_WAIT_POLICY unset: GOMP_SPINCOUNT
// 300000, a few ms) on the cores that thread and the rank's main thread need.
// OMP_WAIT_POLICY=PASSIVE removes most of the collapse but costs a third of the speed on an idle
// machine (every region wakes sleeping threads), and 2 threads stay slower than 1 beside another
// process either way, so the wait policy stays OpenMP's (or the user's) and the thread count is
// the one a program started by hand uses. Figures: bench/RESULTS.md, "One process on a busy
// machine" (bench/sections/60-busy-machine.sh).
int default_threads_per_process(int usable_cores, int local_processes) {
  const int share = std::max(1, usable_cores / std::max(1, local_processes));
  const int by_hand = static_cast<int>(c10::TaskThreadPoolBase::defaultNumThreads());
  return by_hand >= 1 ? std::min(share, by_hand) : share;
}

std::string describe_plan(const std::vector<RankPlan>& plan) {
  std::ostringstream os;
  for (const auto& p : plan) {
    os << "rank " << p.rank << " (local " << p.local_rank << "):";
    for (const auto& a : p.argv) os << " " << a;
    os << "\n";
    for (const auto& [k, v] : p.env) os << "    " << k << "=" << v << "\n";
  }
  return os.str();
}

int run(std::vector<RankPlan> plan, const LaunchOptions& opts) {
  // The machines' store first, before this process changes anything (bin/tandem hands such a
  // launch to the full command line: Note [A launcher without LibTorch]).
  std::unique_ptr<MachineRendezvous> machines;
  if (opts.min_machines() > 0) machines = std::make_unique<MachineRendezvous>(opts);
  // Note [Replica recovery]: machine 0's launcher holds the replicas' store for the whole job.
  std::unique_ptr<MachineRendezvous> replica_store;
  if (opts.fault_tolerant_replicas() && opts.machine_rank() == 0)
    replica_store = std::make_unique<MachineRendezvous>(opts);
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("pipe() failed: ") + std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {}, old_preemption {};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  // Note [Preemption]: the cluster's signal is forwarded as SIGTERM is.
  const int preemption_signal = preemption_signal_of(opts);
  if (preemption_signal) ::sigaction(preemption_signal, &sa, &old_preemption);
  ::signal(SIGPIPE, SIG_IGN);

  char tmpl[] = "/tmp/tandem-launch-XXXXXX";
  const char* tmp = ::mkdtemp(tmpl);
  std::string error_dir = tmp ? tmp : "";
  // Handlers, signal pipe and error files are put back however run() ends (RAII).
  struct Restore {
    const std::vector<RankPlan>& plan;
    const std::string& error_dir;
    struct sigaction old_int, old_term, old_preemption;
    int preemption_signal;
    ~Restore() {
      if (!error_dir.empty()) {
        for (const auto& p : plan)
          for (const char* ext : {".error", ".beat", ".beat.tmp"})
            ::unlink((error_dir + "/rank" + std::to_string(p.rank) + ext).c_str());
        ::rmdir(error_dir.c_str());
      }
      ::sigaction(SIGINT, &old_int, nullptr);
      ::sigaction(SIGTERM, &old_term, nullptr);
      if (preemption_signal) ::sigaction(preemption_signal, &old_preemption, nullptr);
      ::close(g_signal_pipe[0]);
      ::close(g_signal_pipe[1]);
      g_signal_pipe[0] = g_signal_pipe[1] = -1;
    }
  } restore{plan, error_dir, old_int, old_term, old_preemption, preemption_signal};
  int rc = 0;
  const std::vector<RankPlan> launched = plan;
  // The launcher chose the port (Note [Free ports]): it may choose another.
  const bool own_port = opts.main_process_port() == 0 && !machines && !plan.empty() &&
                        plan[0].env.count("MASTER_PORT");
  int port_retries = 0;
  for (int attempt = 0;; ++attempt) {
    if (machines) {
      // Note [Elastic machines]: this attempt's machines, and this one's rank among them.
      const auto members = machines->join(attempt);
      const auto it = std::find(members.begin(), members.end(), opts.machine_rank());
      if (it == members.end()) {
        write_all(2, "tandem launch: machine " + std::to_string(opts.machine_rank()) +
                         " came after attempt " + std::to_string(attempt) +
                         "'s machines were fixed without it; it stops here\n");
        return 1;
      }
      const int machine = static_cast<int>(it - members.begin());
      const int n = static_cast<int>(members.size());
      const int per = static_cast<int>(launched.size());
      if (n != opts.num_machines() || attempt > 0) {
        std::string list;
        for (int m : members) list += (list.empty() ? "" : ", ") + std::to_string(m);
        write_all(2, "tandem launch: attempt " + std::to_string(attempt) + " runs on " +
                         std::to_string(n) + " of " + std::to_string(opts.num_machines()) +
                         " machines (" + list + "); this one is machine " +
                         std::to_string(machine) + "\n");
      }
      plan = launched;
      for (auto& p : plan) {
        p.rank = machine * per + p.local_rank;
        p.env["RANK"] = std::to_string(p.rank);
        p.env["WORLD_SIZE"] = std::to_string(n * per);
        p.env["GROUP_RANK"] = p.env["NODE_RANK"] = std::to_string(machine);
        if (p.env.count(config::var::kNumMachines))
          p.env[config::var::kNumMachines] = std::to_string(n);
      }
    }
    std::vector<Child> children(plan.size());
    for (size_t i = 0; i < plan.size(); ++i) {
      children[i].plan = plan[i];
      children[i].plan.env[config::var::kRestartCount] = std::to_string(attempt);
      if (!error_dir.empty()) {
        std::string file = error_dir + "/rank" + std::to_string(plan[i].rank) + ".error";
        ::unlink(file.c_str());
        children[i].plan.env[config::var::kErrorFile] = file;
        if (opts.heartbeat_timeout_s() > 0) {
          const std::string beat = error_dir + "/rank" + std::to_string(plan[i].rank) + ".beat";
          ::unlink(beat.c_str());
          children[i].plan.env[config::var::kHeartbeatFile] = beat;
          children[i].plan.env[config::var::kHeartbeatIntervalS] =
              number_text(heartbeat_interval_s(opts.heartbeat_timeout_s()));
        }
      }
    }
    bool interrupted = false;
    std::vector<const Child*> lost;
    rc = run_once(children, opts, interrupted, lost);
    // Note [Free ports]: a port this launcher picked (no --main_process_port) and another
    // program took in the moment before rank 0 listened on it is the launcher's to replace: the
    // ranks start again on another, which is no restart of the job (up to 3 times).
    if (rc != 0 && !interrupted && own_port && port_retries < 3 && port_was_taken(children)) {
      ++port_retries;
      const std::string taken = plan[0].env["MASTER_PORT"];
      const std::string port = std::to_string(find_free_port(opts.main_process_ip()));
      for (auto& p : plan) p.env["MASTER_PORT"] = port;
      write_all(2, "tandem launch: port " + taken +
                       ", which was free when the launcher chose it, "
                       "was taken by another program before rank 0 listened on it; starting the "
                       "ranks again on port " +
                       port + "\n");
      --attempt;
      continue;
    }
    if (rc == 0 || interrupted || attempt >= opts.max_restarts()) break;
    const std::string restart =
        "restart " + std::to_string(attempt + 1) + " of " + std::to_string(opts.max_restarts());
    if (machines) {
      write_all(2, "tandem launch: restarting this machine's ranks with the machines that come "
                   "to the next meeting (" + restart + ")\n");
      continue;
    }
    if (opts.min_processes() == 0 || lost.empty()) {
      write_all(2, "tandem launch: restarting all ranks (" + restart + ")\n");
      continue;
    }
    // Note [Elastic restarts]: a rank killed by SIGKILL from outside (the out-of-memory killer,
    // kill -9, a lost container) is gone, and with --min_processes the job runs again on the
    // processes that remain, numbered 0..n-1 (every rank restarts: the program reloads its
    // latest checkpoint on the new world). A rank that fails by itself (an exit code, SIGSEGV,
    // SIGABRT) is a failed program: the restart keeps the size.
    const int remain = static_cast<int>(plan.size() - lost.size());
    std::string who;
    for (const Child* c : lost) who += (who.empty() ? "" : ", ") + describe_exit(*c);
    if (remain < opts.min_processes()) {
      write_all(2, "tandem launch: " + std::to_string(lost.size()) + " rank(s) lost (" + who +
                       "); " + std::to_string(remain) + " remain, fewer than --min_processes " +
                       std::to_string(opts.min_processes()) + ": not restarting\n");
      break;
    }
    plan.resize(static_cast<size_t>(remain));
    for (auto& p : plan) {
      p.env["WORLD_SIZE"] = std::to_string(remain);
      p.env["LOCAL_WORLD_SIZE"] = std::to_string(remain);
    }
    write_all(2, "tandem launch: " + std::to_string(lost.size()) + " rank(s) lost (" + who +
                     "); restarting on the " + std::to_string(remain) + " that remain (" +
                     restart + ")\n");
  }
  // The other replicas may still be in their last step: the store stays until they finish.
  const double linger_s = std::max(60.0, 2 * opts.replica_timeout_s());
  if (replica_store && rc == 0 && !replica_store->wait_for_replicas(linger_s))
    write_all(2, "tandem launch: the other replicas had not finished " + number_text(linger_s) +
                     " s after this machine's; closing the replicas' store\n");
  return rc;
}

}  // namespace tandem::launch
