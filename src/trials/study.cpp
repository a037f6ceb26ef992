// Study files, the results file, the trials table and the in-process study.
#include "tandem/trials/study.h"
#include "../detail/read_file.h"
#include "tandem/error.h"

#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tandem/comm/collectives.h"

namespace tandem::trials {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string scalar(const YAML::Node& n, const std::string& key) {
  if (!n.IsScalar())
    throw ::tandem::Refused("study file: `" + key + "` must be a single value");
  return n.as<std::string>();
}

double number(const YAML::Node& n, const std::string& key) {
  const std::string t = scalar(n, key);
  try {
    size_t used = 0;
    double v = std::stod(t, &used);
    if (used == t.size()) return v;
  } catch (const std::exception&) {
  }
  throw ::tandem::Refused("study file: `" + key + "` must be a number, got '" + t + "'");
}

int64_t integer(const YAML::Node& n, const std::string& key) {
  const double v = number(n, key);
  if (v != std::floor(v))
    throw ::tandem::Refused("study file: `" + key + "` must be a whole number");
  return static_cast<int64_t>(v);
}

void only_keys(const YAML::Node& map, const std::string& where, const std::set<std::string>& keys) {
  if (!map.IsMap()) throw ::tandem::Refused("study file: `" + where + "` must be a mapping");
  for (const auto& kv : map) {
    const auto k = kv.first.as<std::string>();
    if (!keys.count(k)) {
      std::string list;
      for (const auto& a : keys) list += (list.empty() ? "" : ", ") + a;
      throw ::tandem::Refused("study file: unknown key `" + (where.empty() ? k : where + "." + k) +
                                  "`; the keys " + (where.empty() ? "" : "of `" + where + "` ") +
                                  "are: " + list);
    }
  }
}

std::string resolve_path(const std::string& p, const std::string& source) {
  if (p.empty() || source.empty() || fs::path(p).is_absolute()) return p;
  return (fs::path(source).parent_path() / p).lexically_normal().string();
}

json params_json(const Params& p) {
  json j = json::object();
  for (const auto& [k, v] : p) j[k] = v;
  return j;
}

// What must not change when a study is started again.
json identity(const StudyConfig& c) {
  json space = json::array();
  for (const auto& s : c.space)
    space.push_back({{"name", s.name}, {"type", to_string(s.type)}, {"low", s.low},
                     {"high", s.high}, {"choices", s.choices}});
  return {{"space", space},
          {"metric", c.metric},
          {"mode", c.direction == Direction::kMinimize ? "min" : "max"},
          {"sampler", c.sampler.type},
          {"seed", c.seed}};
}

}  // namespace

StudyConfig parse_study(const std::string& text, const std::string& source, bool needs_program) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ::tandem::Refused("study file " + source + ": not YAML: " + e.what());
  }
  if (!root.IsMap()) throw ::tandem::Refused("study file " + source + ": expected a mapping of keys");
  only_keys(root, "", {"program", "args", "launch", "space", "objective", "trials", "sampler",
                       "pruner", "seed", "study_dir", "parallel"});
  StudyConfig c;
  c.source = source;
  if (root["program"]) c.program = resolve_path(scalar(root["program"], "program"), source);
  if (auto a = root["args"]) {
    if (!a.IsSequence()) throw ::tandem::Refused("study file: `args` must be a list");
    for (const auto& x : a) c.args.push_back(scalar(x, "args"));
  }
  if (auto l = root["launch"]) {
    if (!l.IsMap()) throw ::tandem::Refused("study file: `launch` must be a mapping of tandem launch flags");
    for (const auto& kv : l) {
      const auto k = kv.first.as<std::string>();
      if (kv.second.IsSequence()) {
        std::string joined;
        for (const auto& x : kv.second) joined += (joined.empty() ? "" : ",") + scalar(x, "launch." + k);
        c.launch.emplace_back(k, joined);
      } else {
        c.launch.emplace_back(k, scalar(kv.second, "launch." + k));
      }
    }
  }
  if (auto s = root["space"]) {
    if (!s.IsMap()) throw ::tandem::Refused("study file: `space` must map parameter names to {type, ...}");
    for (const auto& kv : s) {
      ParamSpec p;
      p.name = kv.first.as<std::string>();
      const std::string where = "space." + p.name;
      only_keys(kv.second, where, {"type", "low", "high", "choices", "flag", "env"});
      if (!kv.second["type"]) throw ::tandem::Refused("study file: `" + where + ".type` is missing (uniform, loguniform, int or categorical)");
      p.type = parse_param_type(scalar(kv.second["type"], where + ".type"));
      if (kv.second["low"]) p.low = number(kv.second["low"], where + ".low");
      if (kv.second["high"]) p.high = number(kv.second["high"], where + ".high");
      if (p.type != ParamType::kCategorical && (!kv.second["low"] || !kv.second["high"]))
        throw ::tandem::Refused("study file: `" + where + "` needs low and high");
      if (auto ch = kv.second["choices"]) {
        if (!ch.IsSequence()) throw ::tandem::Refused("study file: `" + where + ".choices` must be a list");
        for (const auto& x : ch) p.choices.push_back(scalar(x, where + ".choices"));
      }
      if (kv.second["flag"]) p.flag = scalar(kv.second["flag"], where + ".flag");
      if (kv.second["env"]) p.env = scalar(kv.second["env"], where + ".env");
      c.space.push_back(p);
    }
  }
  if (auto o = root["objective"]) {
    only_keys(o, "objective", {"metric", "mode"});
    if (o["metric"]) c.metric = scalar(o["metric"], "objective.metric");
    if (o["mode"]) c.direction = parse_direction(scalar(o["mode"], "objective.mode"));
  }
  if (root["trials"]) c.trials = static_cast<int>(integer(root["trials"], "trials"));
  if (auto s = root["sampler"]) {
    if (s.IsScalar()) {
      c.sampler.type = s.as<std::string>();
    } else {
      only_keys(s, "sampler", {"type", "startup_trials", "ei_candidates"});
      if (s["type"]) c.sampler.type = scalar(s["type"], "sampler.type");
      if (s["startup_trials"]) c.sampler.startup_trials = static_cast<int>(integer(s["startup_trials"], "sampler.startup_trials"));
      if (s["ei_candidates"]) c.sampler.ei_candidates = static_cast<int>(integer(s["ei_candidates"], "sampler.ei_candidates"));
    }
  }
  if (auto p = root["pruner"]) {
    if (p.IsScalar()) {
      c.pruner.type = p.as<std::string>();
    } else {
      only_keys(p, "pruner", {"type", "startup_trials", "warmup_steps", "interval_steps",
                              "min_resource", "reduction_factor", "min_early_stopping_rate"});
      if (p["type"]) c.pruner.type = scalar(p["type"], "pruner.type");
      if (p["startup_trials"]) c.pruner.startup_trials = static_cast<int>(integer(p["startup_trials"], "pruner.startup_trials"));
      if (p["warmup_steps"]) c.pruner.warmup_steps = integer(p["warmup_steps"], "pruner.warmup_steps");
      if (p["interval_steps"]) c.pruner.interval_steps = integer(p["interval_steps"], "pruner.interval_steps");
      if (p["min_resource"]) c.pruner.min_resource = integer(p["min_resource"], "pruner.min_resource");
      if (p["reduction_factor"]) c.pruner.reduction_factor = static_cast<int>(integer(p["reduction_factor"], "pruner.reduction_factor"));
      if (p["min_early_stopping_rate"]) c.pruner.min_early_stopping_rate = static_cast<int>(integer(p["min_early_stopping_rate"], "pruner.min_early_stopping_rate"));
    }
  }
  if (root["seed"]) c.seed = static_cast<uint64_t>(integer(root["seed"], "seed"));
  if (root["study_dir"]) c.study_dir = scalar(root["study_dir"], "study_dir");
  c.study_dir = resolve_path(c.study_dir, source);
  if (root["parallel"]) c.parallel = static_cast<int>(integer(root["parallel"], "parallel"));
  validate(c, needs_program);
  return c;
}

StudyConfig load_study(const std::string& path, bool needs_program) {
  const auto text = ::tandem::detail::read_file(path);
  if (!text) throw ::tandem::Refused("study file " + path + ": cannot be read");
  return parse_study(*text, path, needs_program);
}

void validate(const StudyConfig& c, bool needs_program) {
  if (needs_program && c.program.empty())
    throw ::tandem::Refused("study file: `program` is missing (the trial's program, e.g. build/examples/train_gpt)");
  if (c.space.empty()) throw ::tandem::Refused("study file: `space` is empty: give at least one parameter");
  if (c.metric.empty())
    throw ::tandem::Refused("study file: `objective.metric` is missing (a key the trial logs, e.g. loss)");
  if (c.trials < 1) throw ::tandem::Refused("study file: `trials` must be >= 1");
  if (c.parallel < 1) throw ::tandem::Refused("study file: `parallel` must be >= 1");
  if (c.sampler.type != "grid" && c.sampler.type != "random" && c.sampler.type != "tpe")
    throw ::tandem::Refused("study file: sampler '" + c.sampler.type + "': expected grid, random or tpe");
  if (c.sampler.startup_trials < 0 || c.sampler.ei_candidates < 1)
    throw ::tandem::Refused("study file: sampler.startup_trials must be >= 0 and ei_candidates >= 1");
  validate(c.pruner);
  std::set<std::string> flags;
  for (const auto& s : c.space) {
    validate(s);
    const std::string to = s.env.empty() ? (s.flag.empty() ? "--" + s.name : s.flag) : "env " + s.env;
    if (!flags.insert(to).second)
      throw ::tandem::Refused("study file: two parameters go to " + to);
  }
  if (c.sampler.type == "grid") (void)sample(c.sampler, c.space, {}, c.direction, c.seed, 0);
  if (needs_program) {
    bool dir = false;
    for (const auto& a : c.args) dir |= a.find("{trial_dir}") != std::string::npos;
    if (!dir)
      throw ::tandem::Refused(
          "study file: `args` must hand the program its trial directory, where its trackers "
          "write metrics.jsonl: add e.g. --project_dir, \"{trial_dir}\", --log_with, jsonl");
  }
}

// ---- results -------------------------------------------------------------------------------

namespace {

json record_json(const TrialRecord& t) {
  json inter = json::array();
  for (const auto& [s, v] : t.intermediate) inter.push_back({s, std::isfinite(v) ? json(v) : json()});
  json j = {{"event", "end"},     {"trial", t.number}, {"params", params_json(t.params)},
            {"state", to_string(t.state)}, {"value", t.value && std::isfinite(*t.value) ? json(*t.value) : json()},
            {"intermediate", inter}, {"seconds", t.seconds}};
  if (!t.message.empty()) j["message"] = t.message;
  return j;
}

TrialRecord record_from(const json& j) {
  TrialRecord t;
  t.number = j.at("trial").get<int>();
  for (auto& [k, v] : j.at("params").items()) t.params[k] = v.get<std::string>();
  t.state = j.contains("state") ? parse_trial_state(j["state"].get<std::string>()) : TrialState::kRunning;
  if (j.contains("value") && !j["value"].is_null()) t.value = j["value"].get<double>();
  if (j.contains("intermediate"))
    for (auto& p : j["intermediate"])
      t.intermediate.emplace_back(p[0].get<int64_t>(), p[1].is_null() ? NAN : p[1].get<double>());
  if (j.contains("seconds")) t.seconds = j["seconds"].get<double>();
  if (j.contains("message")) t.message = j["message"].get<std::string>();
  return t;
}

}  // namespace

std::string trial_to_json(const TrialRecord& t) { return record_json(t).dump(); }

TrialRecord trial_from_json(const std::string& line) { return record_from(json::parse(line)); }

ResultsLog::ResultsLog(const StudyConfig& c) {
  fs::create_directories(c.study_dir);
  path_ = (fs::path(c.study_dir) / "trials.jsonl").string();
  const auto id_path = fs::path(c.study_dir) / "study.json";
  const json id = identity(c);
  if (fs::exists(id_path)) {
    std::ifstream in(id_path);
    json old;
    try {
      old = json::parse(in);
    } catch (const std::exception&) {
      throw std::runtime_error(id_path.string() + " is not JSON: move it away, or give another study_dir");
    }
    for (const auto& [k, v] : id.items())
      if (old.value(k, json()) != v)
        throw ::tandem::Refused("study_dir " + c.study_dir + " holds a study with another `" + k +
                                    "` (" + old.value(k, json()).dump() + ", now " + v.dump() +
                                    "): its trials would not belong to this one; give another "
                                    "study_dir, or restore the study file");
  } else {
    std::ofstream out(id_path);
    out << id.dump(2) << "\n";
  }
  std::map<int, TrialRecord> started;
  std::map<int, TrialRecord> ended;
  std::ifstream in(path_);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const std::exception&) {
      continue;  // a line cut short by a kill
    }
    auto t = record_from(j);
    next_ = std::max(next_, t.number + 1);
    if (j.value("event", "") == "start") started[t.number] = t;
    else ended[t.number] = t;
  }
  for (auto& [n, t] : ended) finished_.push_back(t);
  for (auto& [n, t] : started)
    if (!ended.count(n)) unfinished_.push_back(t);
}

void ResultsLog::record_start(const TrialRecord& t) {
  json j = {{"event", "start"}, {"trial", t.number}, {"params", params_json(t.params)}};
  std::ofstream out(path_, std::ios::app);
  out << j.dump() << "\n" << std::flush;
  next_ = std::max(next_, t.number + 1);
}

void ResultsLog::record_end(const TrialRecord& t) {
  std::ofstream out(path_, std::ios::app);
  out << trial_to_json(t) << "\n" << std::flush;
  if (!out) throw std::runtime_error("cannot append to " + path_);
  finished_.push_back(t);
  unfinished_.erase(std::remove_if(unfinished_.begin(), unfinished_.end(),
                                   [&](const TrialRecord& u) { return u.number == t.number; }),
                    unfinished_.end());
}

const TrialRecord* best_trial(const std::vector<TrialRecord>& trials, Direction d) {
  const TrialRecord* best = nullptr;
  for (const auto& t : trials) {
    if (t.state != TrialState::kComplete || !t.value || !std::isfinite(*t.value)) continue;
    if (!best || (d == Direction::kMinimize ? *t.value < *best->value : *t.value > *best->value))
      best = &t;
  }
  return best;
}

std::string format_trials_table(const std::vector<TrialRecord>& trials,
                                const std::vector<ParamSpec>& space, Direction d,
                                const std::string& metric) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> head{"trial", "state", metric, "steps", "seconds"};
  for (const auto& s : space) head.push_back(s.name);
  rows.push_back(head);
  const TrialRecord* best = best_trial(trials, d);
  auto sorted = trials;
  std::sort(sorted.begin(), sorted.end(), [](auto& a, auto& b) { return a.number < b.number; });
  for (const auto& t : sorted) {
    char v[32] = "-", sec[32];
    if (t.value) std::snprintf(v, sizeof v, "%.6g", *t.value);
    std::snprintf(sec, sizeof sec, "%.1f", t.seconds);
    std::vector<std::string> r{std::to_string(t.number) + (best && best->number == t.number ? " *" : ""),
                               to_string(t.state), v,
                               t.intermediate.empty() ? "-" : std::to_string(t.intermediate.back().first),
                               sec};
    for (const auto& s : space) r.push_back(t.params.count(s.name) ? t.params.at(s.name) : "");
    rows.push_back(r);
  }
  std::vector<size_t> w(head.size(), 0);
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
  std::string out;
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) {
      out += r[i] + std::string(w[i] - r[i].size(), ' ');
      out += i + 1 < r.size() ? "  " : "\n";
    }
  }
  return out;
}

// ---- in-process study ------------------------------------------------------------------------

namespace {
const ParamSpec& spec_of(const StudyConfig& c, const std::string& name) {
  for (const auto& s : c.space)
    if (s.name == name) return s;
  throw ::tandem::Refused("trial parameter '" + name + "' is not in the study's space");
}
}  // namespace

double Trial::real(const std::string& name) const {
  spec_of(study_->config(), name);
  return std::stod(record_.params.at(name));
}

int64_t Trial::integer(const std::string& name) const {
  const auto& s = spec_of(study_->config(), name);
  if (s.type == ParamType::kUniform || s.type == ParamType::kLogUniform)
    throw ::tandem::Refused("trial parameter '" + name + "' is real-valued: use real()");
  return std::stoll(record_.params.at(name));
}

const std::string& Trial::choice(const std::string& name) const {
  spec_of(study_->config(), name);
  return record_.params.at(name);
}

bool Trial::report(int64_t step, double value) { return study_->decide_prune(record_, step, value); }

Study::Study(StudyConfig config, ProcessGroup* group)
    : config_(std::move(config)), group_(group) {
  validate(config_, /*needs_program=*/false);
  const bool root = !group_ || group_->rank() == 0;
  std::string state;
  if (root) {
    log_ = std::make_unique<ResultsLog>(config_);
    json j = json::array();
    for (const auto& t : log_->finished()) j.push_back(record_json(t));
    json u = json::array();
    for (const auto& t : log_->unfinished()) u.push_back(record_json(t));
    state = json{{"finished", j}, {"unfinished", u}, {"next", log_->next_number()}}.dump();
  }
  if (group_ && group_->size() > 1) state = comm::broadcast_object(*group_, state);
  auto j = json::parse(state);
  for (auto& t : j["finished"]) finished_.push_back(record_from(t));
  for (auto& t : j["unfinished"]) retry_.push_back(record_from(t));
  next_ = j["next"].get<int>();
}

Study::~Study() = default;

std::optional<Trial> Study::ask() {
  const bool root = !group_ || group_->rank() == 0;
  std::string msg;
  if (root) {
    std::optional<TrialRecord> t;
    if (!retry_.empty()) {
      t = retry_.front();
      t->state = TrialState::kRunning;
      t->intermediate.clear();
    } else if (static_cast<int>(finished_.size()) < config_.trials) {
      auto p = sample(config_.sampler, config_.space, finished_, config_.direction, config_.seed, next_);
      if (p) {
        t = TrialRecord{};
        t->number = next_;
        t->params = *p;
      }
    }
    if (t) log_->record_start(*t);
    msg = t ? trial_to_json(*t) : "";
  }
  if (group_ && group_->size() > 1) msg = comm::broadcast_object(*group_, msg);
  if (msg.empty()) return std::nullopt;
  Trial trial;
  trial.record_ = trial_from_json(msg);
  trial.record_.state = TrialState::kRunning;
  trial.study_ = this;
  if (!retry_.empty() && retry_.front().number == trial.record_.number) retry_.erase(retry_.begin());
  next_ = std::max(next_, trial.record_.number + 1);
  ++asked_;
  return trial;
}

bool Study::decide_prune(TrialRecord& r, int64_t step, double value) {
  double mean = value;
  if (group_ && group_->size() > 1) {
    auto all = comm::gather_object(*group_, json(value).dump());
    mean = 0;
    for (const auto& v : all) {
      auto j = json::parse(v);
      mean += j.is_null() ? NAN : j.get<double>();
    }
    mean /= static_cast<double>(all.size());
  }
  r.intermediate.emplace_back(step, mean);
  std::string decision;
  if (!group_ || group_->rank() == 0)
    decision = should_prune(config_.pruner, config_.direction, r, finished_) ? "1" : "0";
  if (group_ && group_->size() > 1) decision = comm::broadcast_object(*group_, decision);
  if (decision == "1") {
    r.state = TrialState::kPruned;
    r.value = mean;
    r.message = "pruned at step " + std::to_string(step);
  }
  return decision == "1";
}

void Study::tell(Trial& trial, double value) {
  auto& r = trial.record_;
  if (r.state != TrialState::kPruned) {
    if (group_ && group_->size() > 1) {
      // Rank 0's value is the one recorded; every rank leaves with the same record.
      value = json::parse(comm::broadcast_object(*group_, json(value).dump())).get<double>();
    }
    r.state = TrialState::kComplete;
    r.value = value;
  }
  if (log_) log_->record_end(r);
  finished_.push_back(r);
}

void Study::tell_failed(Trial& trial, const std::string& message) {
  auto& r = trial.record_;
  if (group_ && group_->size() > 1) comm::wait_for_everyone(*group_);
  r.state = TrialState::kFailed;
  r.message = message;
  if (log_) log_->record_end(r);
  finished_.push_back(r);
}

std::vector<TrialRecord> Study::trials() const { return finished_; }

std::optional<TrialRecord> Study::best() const {
  auto* b = best_trial(finished_, config_.direction);
  return b ? std::optional<TrialRecord>(*b) : std::nullopt;
}

}  // namespace tandem::trials
