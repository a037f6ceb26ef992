// A run's profile for `tandem plan`: what the operating system and the counting allocator saw
// (resident memory before the model and at its peak, tensor bytes at their peak), the model's
// parameters on this rank and the optimizer steps' times, written as JSON when the run ends.
// Asked for with TANDEM_PROFILE=<prefix>: each rank writes <prefix>.rank<r>.json.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tandem::track {

class RunProfile {
 public:
  /// Installs the counting CPU allocator (so construct it before the model) and takes the
  /// resident memory now as the run's baseline.
  RunProfile(std::string prefix, int rank, int world_size);
  /// One optimizer step ended.
  void step();
  /// A parameter this rank holds: its name, elements and bytes (per prepared model).
  void add_parameter(const std::string& name, int64_t numel, int64_t bytes);
  /// Writes <prefix>.rank<r>.json: {"rank", "world_size", "baseline_rss", "peak_rss",
  /// "tensor_peak", "tensor_current", "parameters", "parameter_bytes", "steps",
  /// "step_seconds": [...]} (bytes; step_seconds between consecutive steps, the first from
  /// construction). Atomic (written beside, then renamed).
  void write() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int rank_, world_;
  int64_t baseline_rss_ = 0;
  std::map<std::string, int64_t> parameters_;
  int64_t parameter_bytes_ = 0;
  std::chrono::steady_clock::time_point last_;
  std::vector<double> step_seconds_;
};

}  // namespace tandem::track
