// The sweep: trials as `tandem launch` jobs, followed through their metrics.jsonl.
#include "tandem/trials/sweep.h"
#include "../detail/read_file.h"
#include "tandem/error.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/cuda.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "tandem/runtime.h"
#include "tandem/trials/plot.h"
#include "detail/child.h"

namespace tandem::trials {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

using detail::capture;

namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = 0; (at = s.find(from, at)) != std::string::npos; at += to.size())
    s.replace(at, from.size(), to);
  return s;
}

std::vector<std::string> launch_flags(const StudyConfig& c) {
  std::vector<std::string> f;
  for (const auto& [k, v] : c.launch) {
    if (v == "true") f.push_back("--" + k);
    else if (v != "false") f.insert(f.end(), {"--" + k, v});
  }
  return f;
}

bool launch_is_cpu(const StudyConfig& c) {
  for (const auto& [k, v] : c.launch)
    if (k == "cpu" || k == "use_cpu") return v == "true";
  return false;
}

int launch_processes(const StudyConfig& c) {
  for (const auto& [k, v] : c.launch)
    if (k == "num_processes") return std::max(1, std::stoi(v));
  return 1;
}


std::string params_text(const Params& p) {
  std::string s;
  for (const auto& [k, v] : p) s += (s.empty() ? "" : " ") + k + "=" + v;
  return s;
}

struct Running {
  TrialRecord record;
  pid_t pid = -1;
  std::string dir, log, metrics;
  std::streamoff offset = 0;
  std::string partial;
  Clock::time_point start;
  bool pruning = false;
  Clock::time_point kill_at;
  int slot = 0;
};

// New (step, value) pairs of `metric` in the trial's metrics.jsonl, wherever under its
// directory the trackers put it.
void read_metrics(Running& r, const std::string& metric) {
  if (r.metrics.empty()) {
    std::error_code ec;
    for (fs::recursive_directory_iterator it(r.dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().filename() == "metrics.jsonl") {
        r.metrics = it->path().string();
        break;
      }
    if (r.metrics.empty()) return;
  }
  const std::string chunk = ::tandem::detail::read_file(r.metrics, r.offset).value_or("");
  r.offset += static_cast<std::streamoff>(chunk.size());
  r.partial += chunk;
  size_t nl;
  while ((nl = r.partial.find('\n')) != std::string::npos) {
    std::string line = r.partial.substr(0, nl);
    r.partial.erase(0, nl + 1);
    try {
      auto j = nlohmann::json::parse(line);
      const auto& values = j.at("values");
      if (!values.contains(metric)) continue;
      const auto& v = values[metric];
      r.record.intermediate.emplace_back(j.at("step").get<int64_t>(),
                                         v.is_null() ? NAN : v.get<double>());
    } catch (const std::exception&) {
    }
  }
}

}  // namespace

std::vector<std::string> trial_command(const StudyConfig& c, const std::string& exe,
                                       const TrialRecord& t, const std::string& dir,
                                       std::vector<std::pair<std::string, std::string>>* env) {
  std::vector<std::string> argv{exe, "launch"};
  for (auto& f : launch_flags(c)) argv.push_back(f);
  argv.push_back(c.program);
  for (const auto& a : c.args)
    argv.push_back(replace_all(replace_all(a, "{trial_dir}", dir), "{trial}", std::to_string(t.number)));
  for (const auto& s : c.space) {
    const auto& v = t.params.at(s.name);
    if (!s.env.empty()) {
      if (env) env->emplace_back(s.env, v);
    } else {
      argv.push_back(s.flag.empty() ? "--" + s.name : s.flag);
      argv.push_back(v);
    }
  }
  return argv;
}

SweepResult run_sweep(const StudyConfig& c, const SweepOptions& o) {
  validate(c, /*needs_program=*/true);
  std::ostream& out = o.out ? *o.out : std::cout;
  if (::access(c.program.c_str(), X_OK) != 0)
    throw ::tandem::Refused("study file: program " + c.program + " is not an executable file");

  // The launch settings, checked once by tandem launch itself.
  {
    TrialRecord probe;
    for (const auto& s : c.space) probe.params[s.name] = s.type == ParamType::kCategorical ? s.choices[0] : std::to_string(s.low);
    auto argv = trial_command(c, o.tandem_exe, probe, c.study_dir, nullptr);
    argv.insert(argv.begin() + 2, "--dry_run");
    auto [rc, text] = capture(argv);
    if (rc != 0)
      throw ::tandem::Refused("study file: `launch` settings refused by tandem launch:\n" + text);
  }

  // Slots: disjoint cores (CPU trials) or devices (GPU trials) per concurrent trial.
  std::vector<std::vector<int>> cpu_slots(static_cast<size_t>(c.parallel));
  std::vector<std::string> gpu_slots(static_cast<size_t>(c.parallel));
  if (c.parallel > 1) {
    const bool gpu = !launch_is_cpu(c) && torch::cuda::is_available();
    if (gpu) {
      const int per = launch_processes(c);
      const int have = static_cast<int>(torch::cuda::device_count());
      if (per * c.parallel > have)
        throw ::tandem::Refused("study file: parallel " + std::to_string(c.parallel) + " trials of " +
                                    std::to_string(per) + " process(es) need " + std::to_string(per * c.parallel) +
                                    " GPUs, and this machine has " + std::to_string(have) + ": lower `parallel`");
      for (int k = 0; k < c.parallel; ++k) {
        std::string ids;
        for (int g = 0; g < per; ++g) ids += (g ? "," : "") + std::to_string(k * per + g);
        gpu_slots[static_cast<size_t>(k)] = ids;
      }
    } else {
      auto cpus = usable_cpus();
      const size_t per = cpus.size() / static_cast<size_t>(c.parallel);
      if (per < 1)
        throw ::tandem::Refused("study file: parallel " + std::to_string(c.parallel) +
                                    " trials need a core each, and this process may use " +
                                    std::to_string(cpus.size()) + ": lower `parallel`");
      for (size_t k = 0; k < static_cast<size_t>(c.parallel); ++k)
        cpu_slots[k].assign(cpus.begin() + static_cast<long>(k * per), cpus.begin() + static_cast<long>((k + 1) * per));
    }
  }

  ResultsLog log(c);
  SweepResult result;
  std::vector<TrialRecord> retry = log.unfinished();
  if (!log.finished().empty() || !retry.empty())
    out << "study " << c.study_dir << ": " << log.finished().size() << " trial(s) on record"
        << (retry.empty() ? "" : ", " + std::to_string(retry.size()) + " unfinished to run again")
        << "\n";
  int next = log.next_number();
  std::vector<Running> running;
  std::vector<bool> slot_busy(static_cast<size_t>(c.parallel), false);
  bool exhausted = false;

  g_stop_signal = 0;
  struct sigaction sa {}, old_int{}, old_term{};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);

  auto start_trial = [&](TrialRecord rec) {
    size_t slot = 0;
    while (slot_busy[slot]) ++slot;
    Running r;
    r.record = std::move(rec);
    r.record.state = TrialState::kRunning;
    r.record.intermediate.clear();
    r.dir = (fs::path(c.study_dir) / ("trial_" + std::to_string(r.record.number))).string();
    fs::remove_all(r.dir);  // a trial run again starts clean (its trackers would append)
    fs::create_directories(r.dir);
    r.log = r.dir + "/output.log";
    std::vector<std::pair<std::string, std::string>> env;
    auto argv = trial_command(c, o.tandem_exe, r.record, r.dir, &env);
    if (!gpu_slots[slot].empty()) argv.insert(argv.begin() + 2, {"--gpu_ids", gpu_slots[slot]});
    log.record_start(r.record);
    r.start = Clock::now();
    r.slot = static_cast<int>(slot);
    const auto& cpus = cpu_slots[slot];
    const pid_t pid = detail::spawn_logged(argv, env, r.log, cpus);
    r.pid = pid;
    slot_busy[slot] = true;
    out << "trial " << r.record.number << " started: " << params_text(r.record.params) << "\n" << std::flush;
    running.push_back(std::move(r));
  };

  while (true) {
    if (g_stop_signal) break;
    while (!exhausted && static_cast<int>(running.size()) < c.parallel) {
      const int done = static_cast<int>(log.finished().size());
      if (!retry.empty()) {
        auto t = retry.front();
        retry.erase(retry.begin());
        start_trial(t);
        continue;
      }
      if (done + static_cast<int>(running.size()) >= c.trials) break;
      std::vector<TrialRecord> history = log.finished();
      for (const auto& r : running) history.push_back(r.record);
      auto p = sample(c.sampler, c.space, history, c.direction, c.seed, next);
      if (!p) {
        exhausted = true;
        out << "the grid has no point left: " << done + running.size() << " trial(s)\n";
        break;
      }
      TrialRecord t;
      t.number = next++;
      t.params = *p;
      start_trial(t);
    }
    if (running.empty()) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(o.poll_interval_s));
    for (size_t i = 0; i < running.size();) {
      auto& r = running[i];
      const size_t before = r.record.intermediate.size();
      if (r.pruning) {
        if (Clock::now() > r.kill_at) ::kill(-r.pid, SIGKILL);
      } else {
        read_metrics(r, c.metric);
      }
      if (!r.pruning && r.record.intermediate.size() > before) {
        // Each new report is a decision point, as a trial calling report() in-process; the
        // other trials are judged as they stand at this poll.
        std::vector<TrialRecord> others = log.finished();
        for (const auto& q : running)
          if (q.record.number != r.record.number) others.push_back(q.record);
        for (size_t k = before; k < r.record.intermediate.size(); ++k) {
          TrialRecord upto = r.record;
          upto.intermediate.resize(k + 1);
          if (should_prune(c.pruner, c.direction, upto, others)) {
            r.record.intermediate.resize(k + 1);
            r.pruning = true;
            r.record.message = "pruned at step " + std::to_string(upto.intermediate.back().first);
            r.kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(o.grace_period_s));
            ::kill(-r.pid, SIGTERM);
            break;
          }
        }
      }
      int status = 0;
      pid_t w = ::waitpid(r.pid, &status, WNOHANG);
      if (w != r.pid) {
        ++i;
        continue;
      }
      if (!r.pruning) read_metrics(r, c.metric);
      auto& t = r.record;
      t.seconds = std::chrono::duration<double>(Clock::now() - r.start).count();
      const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (r.pruning) {
        t.state = TrialState::kPruned;
        t.value = t.intermediate.back().second;
      } else if (rc == 0 && !t.intermediate.empty()) {
        t.state = TrialState::kComplete;
        t.value = t.intermediate.back().second;
      } else {
        t.state = TrialState::kFailed;
        t.message = rc != 0 ? "exit code " + std::to_string(rc)
                            : "exited 0 without logging `" + c.metric + "` (" +
                                  (r.metrics.empty() ? "no metrics.jsonl under " + r.dir
                                                     : "not among the values of " + r.metrics) +
                                  ")";
      }
      log.record_end(t);
      ++result.ran;
      char v[32] = "-";
      if (t.value) std::snprintf(v, sizeof v, "%.6g", *t.value);
      out << "trial " << t.number << " " << to_string(t.state) << ": " << c.metric << " " << v
          << " after " << (t.intermediate.empty() ? 0 : t.intermediate.back().first) << " steps, "
          << static_cast<int>(std::lround(t.seconds)) << " s"
          << (t.message.empty() ? "" : " (" + t.message + ")") << "\n";
      if (t.state == TrialState::kFailed) out << "  last lines of " << r.log << ":\n" << detail::tail_lines(r.log, 8, "    ");
      out << std::flush;
      slot_busy[static_cast<size_t>(r.slot)] = false;
      running.erase(running.begin() + static_cast<long>(i));
    }
  }

  if (g_stop_signal) {
    result.interrupted = true;
    for (auto& r : running) ::kill(-r.pid, SIGTERM);
    for (auto& r : running) ::waitpid(r.pid, nullptr, 0);
    out << "interrupted: " << running.size()
        << " running trial(s) left unfinished; run the sweep again to continue\n";
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);

  result.trials = log.finished();
  out << "\n" << format_trials_table(result.trials, c.space, c.direction, c.metric);
  if (!result.trials.empty()) {
    result.plot = (fs::path(c.study_dir) / "objective.png").string();
    write_study_plot(result.plot, result.trials, c.space, c.direction, c.metric);
    out << "picture: " << result.plot << "\n";
  }
  if (const auto* b = best_trial(result.trials, c.direction)) {
    char v[32];
    std::snprintf(v, sizeof v, "%.6g", *b->value);
    out << "best: " << v << "\n"
        << "best params: " << params_text(b->params) << " (trial " << b->number << ")\n";
  } else {
    out << "best: none (no trial completed)\n";
  }
  return result;
}

}  // namespace tandem::trials
