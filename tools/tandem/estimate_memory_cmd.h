// `tandem estimate-memory`: the subcommand's flags and handler (logic in tandem/track/).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tandem/track/memory_estimate.h"

namespace tandem::cli {

/// The estimate-memory subcommand: registered on construction, run() after parsing.
class EstimateMemoryCommand {
 public:
  explicit EstimateMemoryCommand(CLI::App& app);
  /// Whether the command line chose this subcommand.
  bool chosen() const { return sub_->parsed(); }
  /// Prints the estimate; returns the process exit code (2 for bad input).
  int run() const;

 private:
  /// The rank that holds the most under --tp_size/--pp_size/--cp_size/--pp_virtual_stages.
  track::LayoutShare layout_share(const track::ModelSize& model) const;
  CLI::App* sub_ = nullptr;
  std::string model_;
  std::string params_;
  int64_t layers_ = 0, hidden_ = 0, vocab_ = 0, context_ = 0;
  int64_t num_processes_ = 1;
  int tp_ = 1, pp_ = 1, cp_ = 1, virtual_stages_ = 1, ep_ = 1;
  std::vector<std::string> dtypes_;
  bool json_ = false;
};

}  // namespace tandem::cli
