// Sharded data parallel: samples/s and per-rank peak memory of a 25.2M-parameter model (24
// Linear layers of 1024 x 1024 with ReLU) trained with AdamW, batch 16 per rank, 1 thread.
//   sharding_bench plain    the same loop in plain LibTorch, one process (the reference);
//   sharding_bench tandem   through the Accelerator, under `tandem launch` (whose flags choose
//                           data parallel or --use_deepspeed --zero_stage N).
// Prints "RESULT sharding <name> samples_per_s=<x> peak_bytes=<y> rss_peak_kb=<z>" (rank 0;
// peak_bytes from tandem's counting CPU allocator during the timed steps, after the warm-up
// steps created the optimizer state; the largest over the ranks. The RSS peak is the process's
// whole life, the full model built before prepare included).
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <iostream>

#include "tandem/checkpoint/model_io.h"
#include "tandem/host_allocator.h"
#include "tandem/tandem.h"
#include "timed_steps.h"

namespace {

constexpr int64_t kWidth = 1024, kLayers = 24, kRows = 16;

torch::nn::Sequential make_model() {
  torch::manual_seed(1);
  torch::nn::Sequential net;
  for (int64_t l = 0; l < kLayers; ++l) {
    net->push_back(torch::nn::Linear(kWidth, kWidth));
    net->push_back(torch::nn::ReLU());
  }
  return net;
}

int64_t rss_peak_kb() { return tandem::track::resident_memory().peak_bytes / 1024; }
int64_t rss_kb() { return tandem::track::resident_memory().current_bytes / 1024; }

// --phases: where the resident memory stands after each phase of the run (this process).
bool g_phases = false;
void phase(const char* what, int rank = 0) {
  if (!g_phases || rank != 0) return;
  const auto h = tandem::host_allocator_stats();
  std::cout << "PHASE " << what << " rss_kb=" << rss_kb() << " hwm_kb=" << rss_peak_kb()
            << " tensor_bytes=" << tandem::track::cpu_memory_stats().current_bytes
            << " host_mapped=" << h.mapped_bytes << " cached=" << h.cached_bytes
            << " maps=" << h.maps << " reuses=" << h.reuses << " unmaps=" << h.unmaps << std::endl;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("sharding_bench");
  std::string mode = "tandem";
  int steps = 10, warmup = 2;
  app.add_option("mode", mode)->check(CLI::IsMember({"plain", "tandem"}));
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  std::string save_dir;
  app.add_option("--save_model", save_dir, "plain: write the model here (for estimate-memory)");
  app.add_flag("--phases", g_phases, "print the resident memory after each phase (rank 0)");
  double host_cache_mb = -1;
  app.add_option("--host_cache_mb", host_cache_mb, "plain: install tandem's host allocator with this cache");
  CLI11_PARSE(app, argc, argv);
  tandem::track::install_counting_cpu_allocator();
  if (host_cache_mb >= 0) {
    tandem::HostAllocatorOptions o;
    o.cache_bytes = static_cast<size_t>(host_cache_mb * (1 << 20));
    tandem::install_host_allocator(o);
  }
  torch::set_num_threads(1);
  auto batch = [](int64_t i) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(i + 1));
    return torch::randn({kRows, kWidth}, gen);
  };
  if (mode == "plain") {
    auto net = make_model();
    if (!save_dir.empty()) tandem::checkpoint::save_model(*net, save_dir);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-4));
    const double s = bench::timed_steps(warmup, steps, [&](int i) {
      auto loss = net->forward(batch(i)).pow(2).mean();
      loss.backward();
      opt.step();
      opt.zero_grad();
    });
    std::cout << "RESULT sharding plain samples_per_s=" << kRows * steps / s
              << " peak_bytes=" << tandem::track::cpu_memory_stats().peak_bytes
              << " rss_peak_kb=" << rss_peak_kb() << std::endl;
    return 0;
  }
  tandem::Accelerator acc(tandem::AcceleratorOptions().bucket_cap_mb(8).first_bucket_cap_mb(8));
  const int rank = acc.process_index();
  phase("accelerator", rank);
  auto net = make_model();
  phase("model built", rank);
  auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::AdamW>(
                                           net->parameters(), torch::optim::AdamWOptions(1e-4)));
  phase("prepared", rank);
  const double s = bench::timed_steps(
      warmup, steps,
      [&, &model = model, &opt = opt](int i) {
        auto scope = acc.accumulate();
        acc.backward(
            model->forward(batch(i * acc.num_processes() + acc.process_index())).pow(2).mean());
        phase("backward", i == 0 ? rank : 1);
        opt.step();
        opt.zero_grad();
        phase(("step " + std::to_string(i)).c_str(), i < 3 ? rank : 1);
      },
      [&] { acc.wait_for_everyone(); });
  auto peak = torch::tensor({static_cast<double>(tandem::track::cpu_memory_stats().peak_bytes),
                             static_cast<double>(rss_peak_kb())},
                            torch::kDouble);
  peak = acc.reduce(peak, tandem::ReduceOp::kMax);
  if (acc.is_main_process())
    std::cout << "RESULT sharding " << acc.strategy().name() << " samples_per_s="
              << kRows * steps * acc.num_processes() / s
              << " peak_bytes=" << static_cast<int64_t>(peak[0].item<double>())
              << " rss_peak_kb=" << static_cast<int64_t>(peak[1].item<double>()) << std::endl;
  return 0;
}
