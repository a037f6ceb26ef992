// Asynchronous checkpoints (Note [Asynchronous checkpoints]): training steps of a model whose
// checkpoint takes several steps to write, with no save, with synchronous saves, with
// asynchronous ones, and a plain LibTorch loop that saves with torch::save. Per mode: the median
// step without a save, the time the training thread is blocked per save, the median step while
// a save is being written, how long a save takes to reach the disk, and the whole run. Blocked:
// the first save, and the median of the later ones (an asynchronous save copies into the host
// buffers of the one before).
//   async_save_bench MODE [--layers L] [--width W] [--batch B] [--steps S] [--every E] [--dir D]
//   MODE: none | sync | async | plain
// Prints "RESULT async_save <key>=<value>" lines.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <vector>

#include "tandem/tandem.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

uint64_t dir_bytes(const fs::path& d) {
  uint64_t n = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(d, ec))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"async_save_bench"};
  std::string mode = "async", dir = "/tmp/tandem-async-bench";
  int64_t layers = 12, width = 2048, batch = 16, steps = 40, every = 10;
  app.add_option("mode", mode)->check(CLI::IsMember({"none", "sync", "async", "plain"}));
  app.add_option("--layers", layers);
  app.add_option("--width", width);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--every", every);
  app.add_option("--dir", dir);
  CLI11_PARSE(app, argc, argv);
  fs::remove_all(dir);
  fs::create_directories(dir);
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int64_t i = 0; i < layers; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::ReLU());
  }
  std::unique_ptr<tandem::Accelerator> acc;
  if (mode != "plain") {
    acc = std::make_unique<tandem::Accelerator>(
        tandem::AcceleratorOptions().project_dir(dir).total_limit(2));
    net = acc->prepare(net);
  }
  auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-4));
  std::optional<tandem::AcceleratedOptimizer> prepared;
  if (acc) prepared.emplace(acc->prepare(adamw));
  auto x = torch::randn({batch, width});
  auto y = torch::randn({batch, width});
  std::vector<double> plain_steps, in_flight_steps, blocked, to_disk, waited;
  Clock::time_point save_began;
  bool writing = false;
  const auto run_start = Clock::now();
  for (int64_t s = 1; s <= steps; ++s) {
    const auto t = Clock::now();
    auto loss = torch::mse_loss(net->forward(x), y);
    if (acc) {
      acc->backward(loss);
      prepared->step();
      prepared->zero_grad();
    } else {
      loss.backward();
      adamw->step();
      adamw->zero_grad();
    }
    const double step_s = since(t);
    // A step that began with a save in flight (the write competes with it for the cores).
    (writing ? in_flight_steps : plain_steps).push_back(step_s);
    if (writing && acc && !acc->checkpoint_in_flight()) {
      to_disk.push_back(since(save_began));  // seen done at the end of this step
      writing = false;
    }
    if (mode == "none" || s % every != 0 || s == steps) continue;
    const auto b = Clock::now();
    if (mode == "plain") {
      const auto d = fs::path(dir) / ("checkpoint_" + std::to_string(s / every));
      fs::create_directories(d);
      torch::save(net, (d / "model.pt").string());
      torch::save(*adamw, (d / "optimizer.pt").string());
    } else if (mode == "sync") {
      acc->save_state();
    } else {
      if (writing) {  // the previous save still being written: save_state waits for it
        acc->wait_for_checkpoint();
        to_disk.push_back(since(save_began));
        waited.push_back(since(b));
      }
      save_began = Clock::now();
      acc->save_state(tandem::SaveOptions().async(true));
      writing = true;
    }
    blocked.push_back(since(b));
    if (mode != "async") to_disk.push_back(blocked.back());
  }
  if (acc && writing) {
    acc->wait_for_checkpoint();
    to_disk.push_back(since(save_began));
  }
  const double total = since(run_start);
  // One checkpoint's bytes: the latest.
  const uint64_t bytes =
      mode == "none" ? 0
      : acc          ? dir_bytes(acc->latest_checkpoint())
                     : dir_bytes(fs::path(dir) / ("checkpoint_" + std::to_string((steps - 1) / every)));
  std::cout << "RESULT async_save mode=" << mode << " step_s=" << median(plain_steps)
            << " step_in_flight_s=" << median(in_flight_steps)
            << " blocked_first_s=" << (blocked.empty() ? 0 : blocked.front())
            << " blocked_s=" << median(blocked.size() > 1 ? std::vector<double>(blocked.begin() + 1, blocked.end()) : blocked)
            << " to_disk_s=" << median(to_disk) << " saves=" << blocked.size()
            << " total_s=" << total << " checkpoint_mb=" << bytes / 1e6 << " blocked_each_s=";
  for (size_t i = 0; i < blocked.size(); ++i) std::cout << (i ? "," : "") << blocked[i];
  std::cout << " waited_each_s=";
  for (size_t i = 0; i < waited.size(); ++i) std::cout << (i ? "," : "") << waited[i];
  std::cout << std::endl;
  fs::remove_all(dir);
  return 0;
}
