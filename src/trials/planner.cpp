// `tandem plan` (planner.h): probes, predictions, timed candidates, the table and the config.
#include "tandem/trials/planner.h"
#include "tandem/error.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "detail/child.h"
#include "tandem/config/config.h"
#include "tandem/config/run_env.h"
#include "tandem/track/cpu_memory.h"
#include "tandem/track/memory_estimate.h"

namespace tandem::trials {

namespace fs = std::filesystem;

double PlannedLayout::tokens_per_s() const {
  if (!measured || !measured->ok || measured->step_seconds <= 0) return 0;
  return static_cast<double>(tokens_per_step) / measured->step_seconds;
}

double available_memory_per_process(int processes) {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  while (in >> key) {
    if (key == "MemAvailable:") {
      in >> kb;
      break;
    }
    std::getline(in, key);
  }
  return kb * 1024.0 / std::max(1, processes);
}

MeasuredRun read_run_profiles(const std::string& prefix, int world) {
  MeasuredRun m;
  m.ok = true;
  double worst_step = 0;
  for (int r = 0; r < world; ++r) {
    const std::string path = prefix + ".rank" + std::to_string(r) + ".json";
    std::ifstream in(path);
    if (!in)
      throw std::runtime_error("no profile " + path +
                               ": the program ended before its "
                               "Accelerator did, or never made one (TANDEM_PROFILE)");
    nlohmann::json j;
    try {
      in >> j;
    } catch (const std::exception& e) {
      throw std::runtime_error("profile " + path + " is not JSON: " + e.what());
    }
    const double rss = j.at("peak_rss").get<double>();
    if (r == 0 || rss > m.rss_peak) {
      m.rss_peak = rss;
      m.baseline_rss = j.at("baseline_rss").get<double>();
      m.tensor_peak = j.at("tensor_peak").get<double>();
      m.parameters = 0;
      for (const auto& [k, v] : j.at("parameters").items()) m.parameters += v.get<int64_t>();
    }
    auto steps = j.at("step_seconds").get<std::vector<double>>();
    if (steps.size() >= 2) {
      steps.erase(steps.begin());  // the first step pays for building and preparing
      std::sort(steps.begin(), steps.end());
      worst_step = std::max(worst_step, steps[steps.size() / 2]);
    }
  }
  m.step_seconds = worst_step;
  return m;
}

namespace {

bool has(const std::vector<std::string>& args, const std::string& key) {
  return std::any_of(args.begin(), args.end(),
                     [&](const std::string& a) { return a.find(key) != std::string::npos; });
}

std::string mb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f", bytes / 1e6);
  return buf;
}

std::string pct(double predicted, double measured) {
  if (measured <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.1f%%", 100.0 * (predicted - measured) / measured);
  return buf;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

// One run of the program under `layout`: tandem launch with the layout's flags, TANDEM_PROFILE
// into the work directory; the profiles read back.
MeasuredRun run_layout(const PlannerOptions& o, const Layout& layout, const PlanMachine& machine,
                       int64_t steps, const std::string& name) {
  const std::string prefix = (fs::path(o.work_dir) / name).string();
  const std::string log = prefix + ".log";
  std::vector<std::string> argv{o.tandem_exe, "launch"};
  for (const auto& f : launch_flags(layout, machine, o.search.offload_dir)) argv.push_back(f);
  argv.push_back(o.program);
  for (const auto& a : program_args(o.args, layout, steps)) argv.push_back(a);
  for (int r = 0; r < machine.num_processes; ++r)
    fs::remove(prefix + ".rank" + std::to_string(r) + ".json");
  { std::ofstream(prefix + ".cmd") << join(argv) << "\n"; }
  const pid_t pid = detail::spawn_logged(argv, {{config::var::kProfile, prefix}}, log);
  bool timed_out = false;
  const int rc = detail::wait_child(pid, o.run_timeout_s, 10.0, &timed_out);
  MeasuredRun m;
  m.log = log;
  if (rc != 0) {
    m.error = (timed_out ? "stopped after " + std::to_string(static_cast<int>(o.run_timeout_s)) +
                               " s (--run_timeout)"
                         : "exit code " + std::to_string(rc)) +
              "; last lines of " + log + ":\n" + detail::tail_lines(log, 6, "    ");
    return m;
  }
  try {
    m = read_run_profiles(prefix, machine.num_processes);
  } catch (const std::exception& e) {
    m.ok = false;
    m.error = e.what();
  }
  m.log = log;
  return m;
}

// The model states and buffers alone of a layout (no activations, workspace or process).
double states_of(const PlanModel& model, const Layout& l) {
  const auto p = predict_memory(model, l, ProbeFigures{});
  return p.model_states + p.buffers;
}

// The profiled step: the program at micro-batches 1 and 2 (activations per sequence, the rest),
// with activation checkpointing, and under tp 2 (the part of activations it splits). Each
// figure is what a run measured less what the formulas account for.
ProbeFigures probe_program(const PlannerOptions& o, const std::vector<Layout>& layouts,
                           std::vector<std::string>* notes) {
  std::ostream& out = *o.out;
  PlanMachine one = o.machine;
  one.num_processes = 1;
  one.num_machines = 1;
  Layout base;  // one process, dense
  // A model whose dense states alone do not fit one process is probed under ZeRO-3 across the
  // processes of one machine instead.
  PlanMachine probe_machine = one;
  if (16.0 * static_cast<double>(o.model.num_parameters()) > 0.6 * o.machine.memory_per_process &&
      o.machine.processes_per_machine() > 1) {
    probe_machine.num_processes = o.machine.processes_per_machine();
    base.dp = probe_machine.num_processes;
    base.zero_stage = 3;
    notes->push_back("probed under ZeRO-3 over " + std::to_string(base.dp) +
                     " processes: the dense model's states (16 bytes per parameter) do not fit "
                     "one process");
  }
  auto run = [&](Layout l, const PlanMachine& m, const std::string& name) {
    out << "probe " << name << ": " << l.name() << " on " << m.num_processes << " process"
        << (m.num_processes == 1 ? "" : "es") << "\n"
        << std::flush;
    auto r = run_layout(o, l, m, o.probe_steps, name);
    if (!r.ok)
      throw ::tandem::Refused("tandem plan: the probe run " + name + " (" + l.name() +
                                  ") failed: " + r.error +
                                  "the program must train under `tandem launch` with these "
                                  "flags; see its log");
    return r;
  };
  Layout l1 = base, l2 = base;
  l1.micro_batch = 1;
  l2.micro_batch = 2;
  const auto r1 = run(l1, probe_machine, "probe_mb1");
  const auto r2 = run(l2, probe_machine, "probe_mb2");
  ProbeFigures f;
  f.measured = true;
  f.baseline_rss = r1.baseline_rss;
  f.activations_per_sample = std::max(0.0, r2.tensor_peak - r1.tensor_peak);
  f.workspace = r1.tensor_peak - states_of(o.model, l1) - f.activations_per_sample;
  f.rss_overhead = r1.rss_peak - r1.baseline_rss - r1.tensor_peak;
  f.checkpointed_per_sample = f.activations_per_sample;
  const bool want_ckpt = std::any_of(layouts.begin(), layouts.end(),
                                     [](const Layout& l) { return l.activation_checkpointing; });
  if (want_ckpt) {
    Layout l3 = l2;
    l3.activation_checkpointing = true;
    const auto r3 = run(l3, probe_machine, "probe_mb2_ckpt");
    f.checkpointed_per_sample =
        std::max(0.0, (r3.tensor_peak - states_of(o.model, l3) - f.workspace) / 2.0);
  }
  const bool want_tp =
      std::any_of(layouts.begin(), layouts.end(), [](const Layout& l) { return l.tp > 1; });
  if (want_tp && f.activations_per_sample > 0) {
    Layout l4 = l2;
    l4.dp = 1;
    l4.zero_stage = 0;
    l4.tp = 2;
    PlanMachine two = one;
    two.num_processes = 2;
    const auto r4 = run(l4, two, "probe_mb2_tp2");
    const double act = r4.tensor_peak - states_of(o.model, l4) - f.workspace;
    const double factor = act / (2.0 * f.activations_per_sample);  // 1 - s + s / 2
    f.tp_split_fraction = std::clamp(2.0 * (1.0 - factor), 0.0, 1.0);
    f.rss_per_peer = std::max(0.0, r4.rss_peak - r4.baseline_rss - r4.tensor_peak - f.rss_overhead);
  } else if (o.machine.num_processes > 1) {
    notes->push_back(
        "tensor parallel is not among the layouts: its activation split was not "
        "probed");
  }
  // What each ZeRO stage holds beside its states after the activations (its buckets, reduced
  // shards, gathered units), for each tensor-parallel size among the layouts: a run of the stage
  // at the layouts' own data-parallel size (ZeRO has no pipeline, so dp = processes / tp), or
  // as many processes as one machine has.
  std::set<std::pair<int, int>> zero_tp;
  for (const auto& l : layouts)
    if (l.zero_stage > 0) zero_tp.insert({l.zero_stage, l.tp});
  for (const auto& [zero, tp] : zero_tp) {
    const int dp = std::min(o.machine.num_processes, o.machine.processes_per_machine()) / tp;
    if (dp < 2) continue;
    Layout l;
    l.dp = dp;
    l.tp = tp;
    l.zero_stage = zero;
    PlanMachine m = one;
    m.num_processes = dp * tp;
    const auto r = run(l, m, "probe_zero" + std::to_string(zero) + "_tp" + std::to_string(tp));
    const auto p = predict_memory(o.model, l, f);
    const double held = r.tensor_peak - f.workspace - p.model_states;
    const auto ranks = rank_parameters(o.model, l);
    const double per = static_cast<double>(zero == 3 ? ranks[0].largest_unit : ranks[0].parameters);
    // Only a peak past the forward's says what the stage holds after it.
    if (held > p.forward_buffers + p.activations && per > 0)
      f.zero_buffers[{zero, tp}] = held / per;
    // ZeRO-3 with accumulation: what the micro-steps between reductions keep, from a second
    // run with 2 accumulation steps.
    const bool accumulates =
        std::any_of(layouts.begin(), layouts.end(), [&, tp = tp](const Layout& x) {
          return x.zero_stage == 3 && x.tp == tp && x.accumulation > 1;
        });
    if (zero == 3 && accumulates) {
      Layout a = l;
      a.accumulation = 2;
      const auto ra = run(a, m, "probe_zero3_tp" + std::to_string(tp) + "_ga2");
      f.zero3_accumulation[tp] = std::max(0.0, ra.tensor_peak - r.tensor_peak) /
                                 (static_cast<double>(ranks[0].parameters) / dp);
    }
  }
  out << "probe: baseline " << mb(f.baseline_rss) << " MB resident, activations "
      << mb(f.activations_per_sample) << " MB per sequence (" << mb(f.checkpointed_per_sample)
      << " MB checkpointed), workspace " << mb(f.workspace) << " MB, tp splits "
      << static_cast<int>(std::lround(100 * f.tp_split_fraction)) << "% of activations\n"
      << std::flush;
  return f;
}

}  // namespace

PlanResult run_plan(const PlannerOptions& o_in) {
  PlannerOptions o = o_in;
  if (!o.out) o.out = &std::cout;
  std::ostream& out = *o.out;
  PlanResult res;
  if (o.seq_len <= 0) o.seq_len = o.model.context;
  if (o.seq_len > 0) o.model.context = o.seq_len;
  if (o.machine.memory_per_process <= 0)
    throw ::tandem::Refused(
        "tandem plan: memory per process must be positive "
        "(--memory_per_process)");
  const bool program = !o.program.empty();
  if (program) {
    if (!has(o.args, "{batch_size}"))
      throw ::tandem::Refused(
          "tandem plan: the program's arguments must take the layout's batch: put {batch_size} "
          "where the program reads its sequences per data-parallel rank per micro-step (e.g. "
          "`-- build/examples/train_gpt --batch-size {batch_size}`)");
    o.search.search_microbatches = has(o.args, "{microbatches}");
    if (!o.search.search_microbatches)
      res.notes.push_back(
          "pipelines run with as many micro-batches as stages: put "
          "{microbatches} in the program's arguments to search more");
    fs::create_directories(o.work_dir);
  }
  auto layouts = enumerate_layouts(o.model, o.machine, o.search, &res.excluded);
  if (layouts.empty()) {
    std::string why;
    for (const auto& e : res.excluded) why += "\n  " + e;
    throw ::tandem::Refused("tandem plan: no layout of " +
                                std::to_string(o.machine.num_processes) +
                                " processes fits the rules:" + why);
  }
  out << "tandem plan: " << o.model.source << ", " << o.model.num_parameters() << " parameters; "
      << o.machine.num_processes << " processes on " << o.machine.num_machines << " machine"
      << (o.machine.num_machines == 1 ? "" : "s") << ", "
      << track::format_bytes(o.machine.memory_per_process) << " each; global batch "
      << o.search.global_batch << " x " << o.seq_len << " tokens; " << layouts.size()
      << " layouts\n"
      << std::flush;

  if (program) {
    res.probe = probe_program(o, layouts, &res.notes);
  } else {
    if (o.model.hidden <= 0 || o.model.context <= 0)
      throw ::tandem::Refused(
          "tandem plan: without a program to probe, activations come from "
          "the GPT formula, which needs the hidden size and the sequence "
          "length (--hidden, --seq_len)");
    // This process has LibTorch and tandem loaded: what a rank holds before its model, roughly.
    res.probe = gpt_activation_formula(o.model, o.seq_len, track::resident_memory().current_bytes);
    res.notes.push_back(
        "predicted only: activations from the GPT formula, not measured (give the "
        "program after -- to probe and time it)");
  }

  for (const auto& l : layouts) {
    PlannedLayout p;
    p.layout = l;
    p.predicted = predict_memory(o.model, l, res.probe);
    p.fits = (o.machine.cuda ? p.predicted.tensor_peak : p.predicted.rss_peak) <=
             o.machine.memory_per_process;
    p.cost = layout_cost(l);
    p.tokens_per_step = o.search.global_batch * o.seq_len;
    res.layouts.push_back(p);
  }
  auto by_guess = [](const PlannedLayout& a, const PlannedLayout& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.cost != b.cost) return a.cost < b.cost;
    return a.predicted.rss_peak < b.predicted.rss_peak;
  };
  std::stable_sort(res.layouts.begin(), res.layouts.end(), by_guess);
  const auto fitting = static_cast<size_t>(
      std::count_if(res.layouts.begin(), res.layouts.end(), [](auto& p) { return p.fits; }));
  out << fitting << " of " << res.layouts.size() << " layouts fit "
      << track::format_bytes(o.machine.memory_per_process) << " per process (predicted)\n";

  if (program && o.machine.num_machines > 1) {
    res.notes.push_back("timed runs need all " + std::to_string(o.machine.num_machines) +
                        " machines; the ranking is by prediction only");
  } else if (program) {
    const size_t n = o.measure_all ? fitting : std::min<size_t>(fitting, std::max(0, o.candidates));
    for (size_t i = 0; i < n; ++i) {
      auto& p = res.layouts[i];
      out << "run " << i + 1 << "/" << n << ": " << p.layout.name() << "\n" << std::flush;
      p.measured = run_layout(o, p.layout, o.machine, o.timed_steps, "run" + std::to_string(i));
      if (!p.measured->ok)
        out << "  failed: " << p.measured->error << "\n";
      else if (!o.machine.cuda && p.measured->rss_peak > o.machine.memory_per_process)
        res.notes.push_back(p.layout.name() + " was predicted to fit and measured " +
                            mb(p.measured->rss_peak) + " MB: over the budget, not chosen");
      else
        out << "  peak resident " << mb(p.measured->rss_peak) << " MB (predicted "
            << mb(p.predicted.rss_peak) << "), tensors " << mb(p.measured->tensor_peak)
            << " MB (predicted " << mb(p.predicted.tensor_peak) << "), step "
            << p.measured->step_seconds << " s\n";
      out << std::flush;
    }
  }
  // Timed runs by their speed first (those that stayed within the memory), then the rest.
  auto rank = [&](const PlannedLayout& p) {
    if (p.measured && p.measured->ok && p.measured->step_seconds > 0 &&
        (o.machine.cuda || p.measured->rss_peak <= o.machine.memory_per_process))
      return 0;
    return p.fits ? (p.measured ? 2 : 1) : 3;
  };
  std::stable_sort(res.layouts.begin(), res.layouts.end(), [&](const auto& a, const auto& b) {
    const int ra = rank(a), rb = rank(b);
    if (ra != rb) return ra < rb;
    if (ra == 0) return a.measured->step_seconds < b.measured->step_seconds;
    return false;  // keep the predicted order
  });
  if (!res.layouts.empty() && rank(res.layouts[0]) <= 1) res.winner = 0;

  if (program) {
    std::ofstream(fs::path(o.work_dir) / "plan.json") << plan_to_json(res, o) << "\n";
  }
  if (res.winner && !o.output.empty()) {
    const auto& w = res.layouts[*res.winner];
    auto cfg = layout_config(w.layout, o.machine, o.search.offload_dir);
    config::validate(cfg);
    std::string text = "# Written by tandem plan: " + w.layout.name() + "\n";
    text += "# " + o.model.source + "; global batch " + std::to_string(o.search.global_batch) +
            " sequences per step\n";
    text += "# predicted peak per process: " + mb(w.predicted.rss_peak) + " MB resident, " +
            mb(w.predicted.tensor_peak) + " MB of tensors";
    if (w.measured && w.measured->ok)
      text += "; measured " + mb(w.measured->rss_peak) + " MB, " + mb(w.measured->tensor_peak) +
              " MB, " + std::to_string(w.measured->step_seconds) + " s per step";
    text += "\n";
    if (program) {
      text += "# run: tandem launch --config_file " + o.output + " " + o.program + " " +
              join(program_args(o.args, w.layout, /*steps=*/0)) + "\n";
    }
    text += "# the program takes " + std::to_string(w.layout.batch_per_rank()) +
            " sequences per data-parallel rank per micro-step";
    if (w.layout.pp > 1)
      text += " in " + std::to_string(w.layout.microbatches) + " pipeline micro-batches";
    text += "\n";
    config::write_config_file(o.output, text + config::to_yaml(cfg));
    res.config_path = o.output;
  }
  return res;
}

std::string format_plan(const PlanResult& res, const PlannerOptions& o) {
  std::ostringstream s;
  const size_t shown_unmeasured = 10;
  std::vector<std::vector<std::string>> rows{{"#", "layout", "fits", "pred RSS MB", "meas RSS MB",
                                              "err", "pred tensors MB", "meas tensors MB", "err",
                                              "step s", "tokens/s"}};
  size_t hidden = 0, unmeasured = 0;
  for (size_t i = 0; i < res.layouts.size(); ++i) {
    const auto& p = res.layouts[i];
    const bool ran = p.measured.has_value();
    if (!ran && unmeasured++ >= shown_unmeasured) {
      ++hidden;
      continue;
    }
    const bool ok = ran && p.measured->ok;
    char step[32] = "-", tps[32] = "-";
    if (ok && p.measured->step_seconds > 0) {
      std::snprintf(step, sizeof step, "%.3f", p.measured->step_seconds);
      std::snprintf(tps, sizeof tps, "%.0f", p.tokens_per_s());
    }
    rows.push_back({std::to_string(i + 1) + (res.winner && *res.winner == i ? "*" : ""),
                    p.layout.name(), p.fits ? "yes" : "no", mb(p.predicted.rss_peak),
                    ok ? mb(p.measured->rss_peak) : (ran ? "failed" : "-"),
                    ok ? pct(p.predicted.rss_peak, p.measured->rss_peak) : "-",
                    mb(p.predicted.tensor_peak), ok ? mb(p.measured->tensor_peak) : "-",
                    ok ? pct(p.predicted.tensor_peak, p.measured->tensor_peak) : "-", step, tps});
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  for (const auto& r : rows) {
    for (size_t c = 0; c < r.size(); ++c) {
      s << (c ? "  " : "") << r[c];
      if (c + 1 < r.size()) s << std::string(width[c] - r[c].size(), ' ');
    }
    s << "\n";
  }
  if (hidden)
    s << "(" << hidden << " more layouts not shown"
      << (o.program.empty()
              ? ""
              : ", not run; all are in " + (fs::path(o.work_dir) / "plan.json").string())
      << ")\n";
  for (const auto& e : res.excluded) s << "excluded: " << e << "\n";
  for (const auto& n : res.notes) s << "note: " << n << "\n";
  if (res.winner) {
    const auto& w = res.layouts[*res.winner];
    s << "best: " << w.layout.name();
    if (w.measured && w.measured->ok)
      s << " (" << static_cast<int64_t>(w.tokens_per_s()) << " tokens/s)";
    else
      s << " (predicted)";
    s << "\nlaunch flags: " << join(launch_flags(w.layout, o.machine, o.search.offload_dir));
    s << "\n";
    if (!res.config_path.empty()) s << "wrote " << res.config_path << "\n";
  } else {
    s << "no layout fits " << track::format_bytes(o.machine.memory_per_process)
      << " per process: more processes, activation checkpointing, a smaller batch, or "
         "--offload_dir\n";
  }
  return s.str();
}

std::string plan_to_json(const PlanResult& res, const PlannerOptions& o) {
  nlohmann::json j;
  j["model"] = {{"source", o.model.source}, {"parameters", o.model.num_parameters()}};
  j["machine"] = {{"num_processes", o.machine.num_processes},
                  {"num_machines", o.machine.num_machines},
                  {"memory_per_process", o.machine.memory_per_process}};
  j["global_batch"] = o.search.global_batch;
  j["seq_len"] = o.seq_len;
  const auto& f = res.probe;
  j["probe"] = {{"measured", f.measured},
                {"baseline_rss", f.baseline_rss},
                {"rss_overhead", f.rss_overhead},
                {"workspace", f.workspace},
                {"activations_per_sample", f.activations_per_sample},
                {"checkpointed_per_sample", f.checkpointed_per_sample},
                {"tp_split_fraction", f.tp_split_fraction},
                {"rss_per_peer", f.rss_per_peer}};
  for (const auto& [tp, v] : f.zero3_accumulation)
    j["probe"]["zero3_tp" + std::to_string(tp) + "_accumulation_per_shard_parameter"] = v;
  for (const auto& [key, v] : f.zero_buffers)
    j["probe"]["zero" + std::to_string(key.first) + "_tp" + std::to_string(key.second) +
               "_buffers_per_parameter"] = v;
  j["layouts"] = nlohmann::json::array();
  for (size_t i = 0; i < res.layouts.size(); ++i) {
    const auto& p = res.layouts[i];
    nlohmann::json l = {{"name", p.layout.name()},
                        {"dp", p.layout.dp},
                        {"tp", p.layout.tp},
                        {"pp", p.layout.pp},
                        {"zero_stage", p.layout.zero_stage},
                        {"activation_checkpointing", p.layout.activation_checkpointing},
                        {"micro_batch", p.layout.micro_batch},
                        {"accumulation", p.layout.accumulation},
                        {"microbatches", p.layout.microbatches},
                        {"virtual_stages", p.layout.virtual_stages},
                        {"cp", p.layout.cp},
                        {"ep", p.layout.ep},
                        {"offload", p.layout.offload},
                        {"fits", p.fits},
                        {"winner", res.winner && *res.winner == i},
                        {"predicted",
                         {{"rss_peak", p.predicted.rss_peak},
                          {"tensor_peak", p.predicted.tensor_peak},
                          {"model_states", p.predicted.model_states},
                          {"buffers", p.predicted.buffers},
                          {"activations", p.predicted.activations},
                          {"workspace", p.predicted.workspace},
                          {"parameters", p.predicted.parameters},
                          {"stage", p.predicted.stage}}}};
    if (p.measured) {
      const auto& m = *p.measured;
      l["measured"] = {{"ok", m.ok},
                       {"error", m.error},
                       {"rss_peak", m.rss_peak},
                       {"baseline_rss", m.baseline_rss},
                       {"tensor_peak", m.tensor_peak},
                       {"parameters", m.parameters},
                       {"step_seconds", m.step_seconds},
                       {"tokens_per_s", p.tokens_per_s()},
                       {"log", m.log}};
    }
    j["layouts"].push_back(l);
  }
  j["notes"] = res.notes;
  j["excluded"] = res.excluded;
  return j.dump(1);
}

}  // namespace tandem::trials
