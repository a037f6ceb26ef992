// Signals recorded for a checkpoint on preemption: Note [Preemption] in preemption.h.
#include "tandem/preemption.h"

#include <signal.h>

#include <atomic>
#include <cctype>
#include <cstring>
#include <map>

#include "tandem/error.h"

namespace tandem::preemption {
namespace {

volatile sig_atomic_t g_received = 0;
std::atomic<bool> g_watching{false};

// Only the first is kept: a cluster may signal the launcher and the ranks alike (SLURM signals
// every process of a step), so a rank sees the same preemption twice, directly and forwarded.
extern "C" void on_preemption_signal(int sig) {
  if (g_received == 0) g_received = sig;
}

const std::map<std::string, int>& catchable() {
  static const std::map<std::string, int> names{
      {"TERM", SIGTERM}, {"INT", SIGINT},   {"HUP", SIGHUP},  {"USR1", SIGUSR1},
      {"USR2", SIGUSR2}, {"QUIT", SIGQUIT}, {"ALRM", SIGALRM}, {"XCPU", SIGXCPU}};
  return names;
}

}  // namespace

int signal_from_name(const std::string& name, const std::string& what) {
  std::string upper;
  for (char c : name) upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (upper.rfind("SIG", 0) == 0) upper = upper.substr(3);
  const auto& names = catchable();
  if (auto it = names.find(upper); it != names.end()) return it->second;
  if (!upper.empty() && upper.find_first_not_of("0123456789") == std::string::npos &&
      upper.size() < 4) {
    const int n = std::stoi(upper);
    for (const auto& [k, v] : names)
      if (v == n) return v;
  }
  std::string accepted;
  for (const auto& [k, v] : names) accepted += (accepted.empty() ? "" : ", ") + k;
  throw ::tandem::Refused(what + "=" + name + ": expected a signal a process can catch: " +
                          accepted + " (with or without SIG, or its number)");
}

std::string signal_name(int sig) {
  for (const auto& [k, v] : catchable())
    if (v == sig) return "SIG" + k;
  return "signal " + std::to_string(sig);
}

Watch::Watch(std::vector<int> signals) {
  // A second Accelerator alive in the process shares the first one's handlers.
  if (g_watching.exchange(true)) return;
  g_received = 0;
  struct sigaction sa {};
  sa.sa_handler = on_preemption_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : signals) {
    if (s == 0) continue;
    bool seen = false;
    for (int t : signals_) seen = seen || t == s;
    if (seen) continue;
    std::vector<char> old(sizeof(struct sigaction));
    ::sigaction(s, &sa, reinterpret_cast<struct sigaction*>(old.data()));
    signals_.push_back(s);
    previous_.push_back(std::move(old));
  }
}

Watch::~Watch() {
  for (size_t i = 0; i < signals_.size(); ++i)
    ::sigaction(signals_[i], reinterpret_cast<const struct sigaction*>(previous_[i].data()),
                nullptr);
  if (!signals_.empty()) g_watching = false;
}

int Watch::received() { return g_received; }

}  // namespace tandem::preemption
