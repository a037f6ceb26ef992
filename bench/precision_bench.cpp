// GPT training-step throughput by precision on the CPU, beside the plain LibTorch fp32 loop, in
// one run and one thread: GPT ctx 128, 4 layers, 4 heads, width 128, batch 8, AdamW.
//   precision_bench [--steps 20] [--warmup 3] [--modes plain,no,bf16,bf16-true]
// Prints "RESULT precision <mode> tokens_per_s=<x>" per mode (plain = LibTorch without tandem).
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <sstream>

#include "../examples/common/gpt.h"
#include "tandem/accelerator.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kBatch = 8;

double run(const std::string& mode, int64_t steps, int64_t warmup) {
  examples::GPTConfig c;  // ctx 128, 4 layers, 4 heads, width 128
  torch::manual_seed(0);
  auto gpt = examples::GPT(c);
  auto x = torch::randint(256, {kBatch, c.context});
  auto y = torch::randint(256, {kBatch, c.context});
  auto opt = std::make_shared<torch::optim::AdamW>(gpt->parameters(), torch::optim::AdamWOptions(3e-4));
  Clock::time_point start;
  if (mode == "plain") {
    for (int64_t i = 0; i < warmup + steps; ++i) {
      if (i == warmup) start = Clock::now();
      auto loss = gpt->loss_per_sample(x, y).mean();
      loss.backward();
      opt->step();
      opt->zero_grad();
    }
  } else {
    tandem::Accelerator acc(tandem::AcceleratorOptions().mixed_precision(mode).cpu(true));
    acc.prepare(gpt);
    auto aopt = acc.prepare(std::shared_ptr<torch::optim::Optimizer>(opt));
    for (int64_t i = 0; i < warmup + steps; ++i) {
      if (i == warmup) start = Clock::now();
      auto scope = acc.accumulate();
      auto loss = gpt->loss_per_sample(x, y).mean();
      acc.backward(loss);
      aopt.step();
      aopt.zero_grad();
    }
  }
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  return static_cast<double>(steps * kBatch * c.context) / secs;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"precision_bench: GPT step throughput by precision (CPU, 1 thread)"};
  int64_t steps = 20, warmup = 3;
  std::string modes = "plain,no,bf16,bf16-true";
  app.add_option("--steps", steps, "Timed steps per mode");
  app.add_option("--warmup", warmup, "Untimed steps first");
  app.add_option("--modes", modes, "Comma-separated: plain (LibTorch alone), no, bf16, bf16-true, ...");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  try {
    std::stringstream ss(modes);
    for (std::string mode; std::getline(ss, mode, ',');)
      std::cout << "RESULT precision " << (mode == "no" ? "fp32" : mode)
                << " tokens_per_s=" << static_cast<int64_t>(run(mode, steps, warmup)) << std::endl;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
