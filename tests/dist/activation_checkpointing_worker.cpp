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

// Two blocks in a Sequential of their own (a Sequential cannot hold a Sequential directly).
struct PairImpl : torch::nn::Module {
  PairImpl() {
    inner->push_back(DropBlock());
    inner->push_back(DropBlock());
    register_module("inner", inner);
  }
  torch::Tensor forward(torch::Tensor x) { return inner->forward(x); }
  torch::nn::Sequential inner;
};
TORCH_MODULE(Pair);

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app("activation checkpointing worker");
  std::string out, wrap = "before", shape = "plain";
  int64_t steps = 4;
  bool find_unused = false;
  app.add_option("--out", out);
  app.add_option("--steps", steps);
  app.add_option("--wrap", wrap)->check(CLI::IsMember({"before", "after"}));
  // nested: the first two blocks in a Sequential of their own, checkpointed inside the outer
  // checkpoint of that Sequential (Note [Unused parameters in a recompute] with --find_unused).
  app.add_option("--shape", shape)->check(CLI::IsMember({"plain", "nested"}));
  app.add_flag("--find_unused", find_unused);
  CLI11_PARSE(app, argc, argv);
  const bool checkpointing = tandem::config::activation_checkpointing_from_env(tandem::current_environment());

  tandem::Accelerator acc(
      tandem::AcceleratorOptions().gradient_accumulation_steps(2).find_unused_parameters(
          find_unused));
  const int rank = acc.process_index(), world = acc.num_processes();
  torch::manual_seed(7);
  torch::nn::Sequential model;
  size_t wrapped = 0;
  if (shape == "nested") {
    Pair pair;
    if (checkpointing)
      wrapped += tandem::parallel::checkpoint_sequential_entries(*pair->inner).size();
    model->push_back(pair);
    for (int i = 0; i < 2; ++i) model->push_back(DropBlock());
  } else {
    for (int i = 0; i < 4; ++i) model->push_back(DropBlock());
  }
  model->push_back(torch::nn::Linear(kWidth, 1));
  if (checkpointing && wrap == "before")
    wrapped += tandem::parallel::checkpoint_sequential_entries(model).size();
  auto [m, opt] = acc.prepare(model, std::make_shared<torch::optim::SGD>(
                                         model->parameters(), torch::optim::SGDOptions(0.1)));
  if (checkpointing && wrap == "after")
    wrapped += tandem::parallel::checkpoint_sequential_entries(m).size();
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
