// The run profile of tandem plan (run_profile.h).
#include "tandem/track/run_profile.h"

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "tandem/track/cpu_memory.h"

namespace tandem::track {

RunProfile::RunProfile(std::string prefix, int rank, int world_size)
    : path_(prefix + ".rank" + std::to_string(rank) + ".json"), rank_(rank), world_(world_size) {
  install_counting_cpu_allocator();
  baseline_rss_ = resident_memory().current_bytes;
  last_ = std::chrono::steady_clock::now();
}

void RunProfile::step() {
  const auto now = std::chrono::steady_clock::now();
  step_seconds_.push_back(std::chrono::duration<double>(now - last_).count());
  last_ = now;
}

void RunProfile::add_parameter(const std::string& name, int64_t numel, int64_t bytes) {
  parameters_[name] = numel;
  parameter_bytes_ += bytes;
}

void RunProfile::write() const {
  const auto rss = resident_memory();
  const auto tensors = cpu_memory_stats();
  nlohmann::json j = {{"rank", rank_},
                      {"world_size", world_},
                      {"baseline_rss", baseline_rss_},
                      {"peak_rss", rss.peak_bytes},
                      {"tensor_peak", tensors.peak_bytes},
                      {"tensor_current", tensors.current_bytes},
                      {"parameters", parameters_},
                      {"parameter_bytes", parameter_bytes_},
                      {"steps", step_seconds_.size()},
                      {"step_seconds", step_seconds_}};
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump() << "\n";
    if (!out) throw std::runtime_error("TANDEM_PROFILE: cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0)
    throw std::runtime_error("TANDEM_PROFILE: cannot write " + path_);
}

}  // namespace tandem::track
