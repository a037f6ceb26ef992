// JsonlTracker: metrics.jsonl (one object per log call) and hparams.json.
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "tandem/track/trackers.h"
#include "track/detail/files.h"

namespace tandem::track {

struct JsonlTracker::File {
  FILE* f = nullptr;
  ~File() {
    if (f) std::fclose(f);
  }
};

namespace {

nlohmann::json to_json(const HparamValue& v) {
  if (auto* b = std::get_if<bool>(&v.value)) return *b;
  if (auto* i = std::get_if<int64_t>(&v.value)) return *i;
  if (auto* d = std::get_if<double>(&v.value)) return std::isfinite(*d) ? nlohmann::json(*d) : nullptr;
  return std::get<std::string>(v.value);
}

}  // namespace

JsonlTracker::JsonlTracker(const std::string& run_dir)
    : run_dir_(run_dir), path_((std::filesystem::path(run_dir) / "metrics.jsonl").string()) {
  detail::ensure_directory(run_dir_, "JsonlTracker");
  file_ = std::make_unique<File>();
  file_->f = std::fopen(path_.c_str(), "ab");
  if (!file_->f) {
    throw std::runtime_error("JsonlTracker: expected to open '" + path_ +
                             "' for appending, but could not; check the folder's permissions");
  }
}

JsonlTracker::~JsonlTracker() { finish(); }

void JsonlTracker::store_init_configuration(const Hparams& hparams) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : hparams) j[k] = to_json(v);
  detail::write_file_atomically((std::filesystem::path(run_dir_) / "hparams.json").string(),
                                j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", "JsonlTracker");
}

void JsonlTracker::log(const std::map<std::string, double>& values, int64_t step) {
  if (!file_) {
    throw std::logic_error("JsonlTracker::log: expected an open tracker, but finish() was called; "
                           "log before finish()");
  }
  nlohmann::json values_json = nlohmann::json::object();
  for (const auto& [k, v] : values) {
    values_json[k] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
  }
  nlohmann::json rec = {{"step", step}, {"wall_time", detail::unix_time_now()},
                        {"values", std::move(values_json)}};
  std::string line = rec.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_->f) != line.size() ||
      std::fflush(file_->f) != 0) {
    throw std::runtime_error("JsonlTracker: could not write to '" + path_ +
                             "' (disk full?); free space or choose another logging folder");
  }
}

void JsonlTracker::finish() { file_.reset(); }

}  // namespace tandem::track
