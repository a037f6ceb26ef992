// Data-parallel throughput: the same training loop in plain LibTorch and through tandem.
//   dp_bench plain  --model mlp|gpt      one process, no tandem at all
//   dp_bench tandem --model mlp|gpt      through the Accelerator (run it under tandem launch)
// Prints one line "RESULT <mode> <model> world=<n> samples_per_s=<x>" from rank 0.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <chrono>
#include <iostream>

#include "../examples/common/gpt.h"
#include "../examples/common/mlp.h"
#include "tandem/accelerator.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Setup {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss;
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  torch::Tensor inputs, targets;  // the data set, in memory
};

Setup make(const std::string& model, int64_t samples) {
  torch::manual_seed(0);
  Setup s;
  if (model == "gpt") {
    examples::GPTConfig c;  // ctx 128, 4 layers, 4 heads, width 128
    auto gpt = examples::GPT(c);
    s.module = gpt.ptr();
    s.loss = [gpt](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return gpt->loss_per_sample(x, y).mean();
    };
    s.optimizer = std::make_shared<torch::optim::AdamW>(gpt->parameters(), torch::optim::AdamWOptions(3e-4));
    s.inputs = torch::randint(256, {samples, c.context});
    s.targets = torch::randint(256, {samples, c.context});
  } else {
    auto mlp = examples::MLP(784, 512, 10);
    s.module = mlp.ptr();
    s.loss = [mlp](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return torch::cross_entropy_loss(mlp->forward(x), y);
    };
    s.optimizer = std::make_shared<torch::optim::SGD>(mlp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    s.inputs = torch::randn({samples, 784});
    s.targets = torch::randint(10, {samples});
  }
  return s;
}

struct InMemory : torch::data::datasets::Dataset<InMemory> {
  torch::Tensor x, y;
  torch::data::Example<> get(size_t i) override {
    return {x[static_cast<int64_t>(i)], y[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dp_bench"};
  std::string mode = "plain", model = "mlp";
  int64_t batch = 0, steps = 0, warmup = 5;
  app.add_option("mode", mode);
  app.add_option("--model", model);
  app.add_option("--batch", batch, "per process (default: 64 for the MLP, 8 for the GPT)");
  app.add_option("--steps", steps, "timed steps (default: 600 MLP, 60 GPT)");
  std::string hook = "none";
  bool bucket_view = false;
  app.add_option("--comm-hook", hook, "tandem: none, fp16 or bf16 gradient compression");
  app.add_flag("--bucket-view", bucket_view, "tandem: gradients as bucket views");
  app.add_option("--warmup", warmup);
  bool local = false;
  app.add_flag("--local", local, "tandem: skip gradient communication (the machine's ceiling)");
  CLI11_PARSE(app, argc, argv);
  if (!batch) batch = model == "gpt" ? 8 : 64;
  if (!steps) steps = model == "gpt" ? 60 : 600;
  // One intra-op thread unless the launcher says otherwise (TANDEM_NUM_CPU_THREADS).
  torch::set_num_threads(std::getenv("TANDEM_NUM_CPU_THREADS")
                             ? std::max(1, std::atoi(std::getenv("TANDEM_NUM_CPU_THREADS")))
                             : 1);
  const int64_t total = warmup + steps;
  auto s = make(model, batch * total * 2 + batch);

  if (mode == "plain") {
    // The loop a user writes without tandem: shuffled batches from memory, forward, backward, step.
    auto order = torch::randperm(s.inputs.size(0));
    Clock::time_point start;
    for (int64_t k = 0; k < total; ++k) {
      if (k == warmup) start = Clock::now();
      auto idx = order.slice(0, k * batch, (k + 1) * batch);
      auto x = s.inputs.index_select(0, idx), y = s.targets.index_select(0, idx);
      s.optimizer->zero_grad();
      s.loss(x, y).backward();
      s.optimizer->step();
    }
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    std::cout << "RESULT plain " << model << " world=1 samples_per_s=" << steps * batch / secs << std::endl;
    return 0;
  }

  tandem::Accelerator acc(
      tandem::AcceleratorOptions().cpu(true).comm_hook(hook).gradient_as_bucket_view(bucket_view));
  acc.prepare_model(s.module);
  auto opt = acc.prepare(s.optimizer);
  InMemory data;
  data.x = s.inputs;
  data.y = s.targets;
  auto loader = acc.prepare_data_loader(data, tandem::data::DataLoaderOptions().batch_size(batch).shuffle(true));
  Clock::time_point start;
  int64_t k = 0;
  for (auto& b : *loader) {
    if (k == warmup) {
      acc.wait_for_everyone();
      start = Clock::now();
    }
    auto scope = acc.accumulate();
    opt.zero_grad();
    if (local) {
      auto no_comm = acc.no_sync();
      acc.backward(s.loss(b.data, b.target));
    } else {
      acc.backward(s.loss(b.data, b.target));
    }
    opt.step();
    if (++k == total) break;
  }
  acc.wait_for_everyone();
  double secs = std::chrono::duration<double>(Clock::now() - start).count();
  if (acc.is_main_process())
    std::cout << "RESULT " << (local ? "local" : hook == "none" ? "tandem" : "tandem_" + hook)
              << (bucket_view ? "_view " : " ") << model << " world=" << acc.num_processes()
              << " samples_per_s=" << steps * batch * acc.num_processes() / secs << std::endl;
  return 0;
}
