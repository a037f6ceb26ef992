// A rank of the activation checkpointing tests (started by `tandem launch`; its flags choose the
// strategy, and --activation_checkpointing turns checkpointing on through the environment).
// Trains a Sequential of Linear-ReLU-Dropout blocks with the Accelerator for a few steps of two
// accumulated micro-steps; with checkpointing, the blocks are wrapped in Checkpointed before
// prepare (--wrap before: under ZeRO-3 the auto-wrap makes Sharded(Checkpointed(block))) or
// after it (--wrap after: Checkpointed(Sharded(block))). Every rank prints how many synchronised
// backward passes its reducers completed; rank 0 writes the final parameters (raw float32).
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <fstream>
#include <iostream>

#include "../common/drop_block.h"
#include "tandem/tandem.h"
#include "../common/jobs_main.h"

namespace {

constexpr int64_t kWidth = tandem::testing::kDropWidth;

using tandem::testing::DropBlock;

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app("activation checkpointing worker");
  std::string out, wrap = "before";
  int64_t steps = 4;
  app.add_option("--out", out);
  app.add_option("--steps", steps);
  app.add_option("--wrap", wrap)->check(CLI::IsMember({"before", "after"}));
  CLI11_PARSE(app, argc, argv);
  const bool checkpointing = tandem::config::activation_checkpointing_from_env(tandem::current_environment());

  tandem::Accelerator acc(tandem::AcceleratorOptions().gradient_accumulation_steps(2));
  const int rank = acc.process_index(), world = acc.num_processes();
  torch::manual_seed(7);
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) model->push_back(DropBlock());
  model->push_back(torch::nn::Linear(kWidth, 1));
  size_t wrapped = 0;
  if (checkpointing && wrap == "before")
    wrapped = tandem::parallel::checkpoint_sequential_entries(model).size();
  auto [m, opt] = acc.prepare(model, std::make_shared<torch::optim::SGD>(
                                         model->parameters(), torch::optim::SGDOptions(0.1)));
  if (checkpointing && wrap == "after")
    wrapped = tandem::parallel::checkpoint_sequential_entries(m).size();
  // Dropout draws from each rank's own generator: the masks differ across ranks, and must be
  // the same with and without checkpointing.
  torch::manual_seed(100 + static_cast<uint64_t>(rank));
  for (int64_t step = 0; step < steps; ++step) {
    for (int64_t micro = 0; micro < 2; ++micro) {
      auto scope = acc.accumulate();
      auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + micro + 1));
      auto x = torch::randn({8 * world, kWidth}, gen).narrow(0, 8 * rank, 8);
      auto y = torch::randn({8 * world, 1}, gen).narrow(0, 8 * rank, 8);
      auto loss = torch::mse_loss(m->forward(x), y);
      acc.backward(loss);
      opt.step();
      opt.zero_grad();
    }
  }
  int64_t reductions = 0;
  for (const auto* r : acc.reducers()) reductions += r->reductions();
  std::cout << "rank " << rank << " strategy " << acc.strategy().name() << " checkpointed "
            << wrapped << " reductions " << reductions << std::endl;
  auto state = acc.get_state_dict(*m);  // every rank: ZeRO-3 gathers
  if (acc.is_main_process() && !out.empty()) {
    std::ofstream f(out, std::ios::binary);
    for (auto& kv : m->named_parameters())
      for (auto& [name, t] : state)
        if (name == kv.key()) {
          auto v = t.to(torch::kFloat).contiguous();
          f.write(static_cast<const char*>(v.data_ptr()), v.numel() * sizeof(float));
        }
  }
  return 0;
}

int main(int argc, char** argv) { return tandem::testing::main_with_jobs(argc, argv, run_worker); }
