// TrackerSet, the factory make_trackers, and HparamValue's text form.
#include "tandem/track/trackers.h"
#include "tandem/error.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <stdexcept>

#include "track/detail/files.h"

namespace tandem::track {

std::string HparamValue::to_string() const {
  struct Visitor {
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(int64_t v) const { return std::to_string(v); }
    std::string operator()(double v) const { return detail::format_double(v); }
    std::string operator()(const std::string& v) const { return v; }
  };
  return std::visit(Visitor{}, value);
}

TrackerSet& TrackerSet::operator=(TrackerSet&& other) {
  if (this != &other) {
    finish();
    trackers_ = std::move(other.trackers_);
    finished_ = other.finished_;
    other.trackers_.clear();
  }
  return *this;
}

TrackerSet::~TrackerSet() {
  try {
    finish();
  } catch (...) {
    // A destructor must not throw; finish() explicitly to see the error.
  }
}

void TrackerSet::add(std::unique_ptr<Tracker> tracker) {
  if (!tracker) throw ::tandem::Refused("TrackerSet::add: expected a tracker, got nullptr");
  trackers_.push_back(std::move(tracker));
  finished_ = false;
}

void TrackerSet::store_init_configuration(const Hparams& hparams) {
  for (auto& t : trackers_) t->store_init_configuration(hparams);
}

void TrackerSet::log(const std::map<std::string, double>& values, int64_t step) {
  for (auto& t : trackers_) t->log(values, step);
}

void TrackerSet::finish() {
  if (finished_) return;
  finished_ = true;
  for (auto& t : trackers_) t->finish();
}

Tracker* TrackerSet::get(const std::string& name) const {
  for (auto& t : trackers_) {
    if (t->name() == name) return t.get();
  }
  return nullptr;
}

std::vector<std::string> available_trackers() { return {"jsonl", "csv", "tensorboard"}; }

TrackerSet make_trackers(const std::vector<std::string>& names, const std::string& logging_dir,
                         const std::string& project_name, bool is_main_process) {
  auto known = available_trackers();
  std::vector<std::string> chosen;
  for (const auto& n : names) {
    std::string name = n;
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (name == "all") {
      chosen = known;
      break;
    }
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      std::string list;
      for (const auto& k : known) list += k + ", ";
      throw ::tandem::Refused("make_trackers: expected one of " + list + "or all, found '" + n +
                                  "'; fix the tracker name (log_with)");
    }
    if (std::find(chosen.begin(), chosen.end(), name) == chosen.end()) chosen.push_back(name);
  }
  TrackerSet set;
  if (!is_main_process || chosen.empty()) return set;
  if (logging_dir.empty()) {
    throw ::tandem::Refused(
        "make_trackers: expected a logging folder for the trackers (" + chosen.front() +
        (chosen.size() > 1 ? ", ..." : "") +
        "), found an empty logging_dir; pass one, e.g. \"runs\"");
  }
  std::string run_dir = project_name.empty()
                            ? logging_dir
                            : (std::filesystem::path(logging_dir) / project_name).string();
  detail::ensure_directory(run_dir, "make_trackers");
  for (const auto& name : chosen) {
    if (name == "jsonl") set.add(std::make_unique<JsonlTracker>(run_dir));
    if (name == "csv") set.add(std::make_unique<CsvTracker>(run_dir));
    if (name == "tensorboard") set.add(std::make_unique<TensorBoardTracker>(run_dir));
  }
  return set;
}

}  // namespace tandem::track
