// A model written as LibTorch users write them (typed members, called directly, blocks kept in a
// std::vector), with the holders swapped for tandem's hookable ones, trained through the
// Accelerator under the layout `tandem launch` gives it, against the same model trained densely
// in this process on the whole batch.
//
//   hooks_worker tp        (--tp_size 2): the plan splits up/down of every block
//   hooks_worker train     (any strategy of the launcher: ZeRO-3 units, activation checkpointing)
//   hooks_worker plain     the same model with torch::nn holders (TORCH_MODULE): what is refused
//   hooks_worker metrics   gather / reduce / pad_across_processes of a training loop's metrics
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "../common/jobs_main.h"
#include "tandem/nn/module.h"
#include "tandem/parallel/tensor_parallel.h"
#include "tandem/tandem.h"

namespace {

constexpr int64_t kWidth = 16;

template <class LayerNorm, class Linear>
struct BlockOf : torch::nn::Module {
  BlockOf()
      : norm(register_module("norm", LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        up(register_module("up", Linear(kWidth, 4 * kWidth))),
        down(register_module("down", Linear(4 * kWidth, kWidth))) {}
  torch::Tensor forward(torch::Tensor x) { return x + down->forward(torch::gelu(up(norm(x)))); }
  LayerNorm norm;
  Linear up, down;
};

struct BlockImpl : BlockOf<tandem::nn::LayerNorm, tandem::nn::Linear> {};
TANDEM_MODULE(Block);  // the one-line change: TORCH_MODULE(Block) before
struct PlainBlockImpl : BlockOf<torch::nn::LayerNorm, torch::nn::Linear> {};
TORCH_MODULE(PlainBlock);

template <class BlockT, class Linear>
struct NetImpl : torch::nn::Module {
  NetImpl() {
    embed = register_module("embed", Linear(8, kWidth));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("h" + std::to_string(i), BlockT()));
    head = register_module("head", Linear(kWidth, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed(x);
    // Both ways users call their members.
    for (size_t i = 0; i < blocks.size(); ++i) x = i % 2 ? blocks[i]->forward(x) : blocks[i](x);
    return head(x);
  }
  Linear embed{nullptr}, head{nullptr};
  std::vector<BlockT> blocks;
};
using Net = NetImpl<Block, tandem::nn::Linear>;
using PlainNet = NetImpl<PlainBlock, torch::nn::Linear>;

template <class M>
std::shared_ptr<M> make() {
  torch::manual_seed(11);
  return std::make_shared<M>();
}

void print_hooks(tandem::Accelerator& acc, torch::nn::Module& model) {
  if (!acc.is_main_process()) return;
  for (const auto& [path, names] : tandem::nn::describe_hooks(model)) {
    std::string all;
    for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
    std::printf("hooks %s: %s\n", path.c_str(), all.c_str());
  }
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (item.key().find(".up") != std::string::npos || item.key().find(".down") != std::string::npos)
      std::printf("module %s %s\n", item.key().c_str(),
                  tandem::nn::module_type_name(*item.value()).c_str());
  std::fflush(stdout);
}

// The whole model, gathered (tensor-parallel shards joined, ZeRO-3 shards gathered), against
// the dense one; printed by the main process with the worst relative loss difference.
void report(tandem::Accelerator& acc, torch::nn::Module& prepared, torch::nn::Module& dense,
            double worst) {
  auto state = acc.get_state_dict(prepared);
  double worst_param = 0;
  size_t matched = 0;
  auto dense_params = dense.named_parameters();
  for (const auto& [name, t] : state) {
    auto* d = dense_params.find(name);
    if (!d || d->sizes() != t.sizes()) continue;
    ++matched;
    const double scale = std::max(1e-12, d->detach().abs().max().item<double>());
    worst_param =
        std::max(worst_param, (t.to(torch::kFloat) - d->detach()).abs().max().item<double>() / scale);
  }
  if (acc.is_main_process()) {
    std::printf("loss relative %.3g params %zu of %zu relative %.3g\n", worst, matched,
                dense_params.size(), worst_param);
    std::fflush(stdout);
  }
}

template <class M>
int train(const std::string& mode) {
  tandem::Accelerator acc;
  auto dense = make<M>(), model = make<M>();
  if (mode == "tp") {
    tandem::parallel::TensorParallelPlan plan;
    plan.colwise("h*.up").rowwise("h*.down");
    acc.parallelize(*model, plan);
  }
  std::shared_ptr<torch::nn::Module> prepared =
      acc.prepare(std::static_pointer_cast<torch::nn::Module>(model));
  auto adam = torch::optim::AdamWOptions(1e-2);
  torch::optim::AdamW dense_opt(dense->parameters(), adam);
  auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(model->parameters(), adam));
  print_hooks(acc, *model);
  // Data parallel ranks take their rows of the batch; tensor-parallel ranks the same rows.
  const int dp = acc.data_parallel_group().size(), dp_rank = acc.data_parallel_group().rank();
  const int64_t rows = 4 * dp;
  double worst = 0;
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({rows, 8}), y = torch::randn({rows, 4});
    dense_opt.zero_grad();
    at::Tensor dl = torch::mse_loss(dense->forward(x), y);
    dl.backward();
    dense_opt.step();
    auto mine = x.narrow(0, 4 * dp_rank, 4), target = y.narrow(0, 4 * dp_rank, 4);
    at::Tensor l = torch::mse_loss(model->forward(mine), target);
    acc.backward(l);
    opt.step();
    opt.zero_grad();
    at::Tensor mean = acc.reduce(l.detach(), tandem::ReduceOp::kMean);
    worst = std::max(worst, std::abs(mean.item<double>() - dl.item<double>()) /
                                std::max(1e-12, std::abs(dl.item<double>())));
  }
  report(acc, *prepared, *dense, worst);
  acc.wait_for_everyone();
  std::cout << "hooks trained rank " << acc.process_index() << std::endl;
  return 0;
}

// The metrics code of a training loop, run on any layout: the main process prints what the
// collectives gave (Note [Collectives on a mesh]). Each data-parallel rank holds rows of its own;
// the ranks of a tensor-parallel group hold the same.
int metrics() {
  tandem::Accelerator acc;
  const int r = acc.data_parallel_group().rank();
  auto mine = torch::arange(r + 1, torch::kFloat).add(10.0 * r).unsqueeze(1);  // r + 1 rows
  auto gathered = acc.gather(torch::full({2}, static_cast<float>(r)));
  auto sum = acc.reduce(torch::full({1}, static_cast<float>(r + 1)), tandem::ReduceOp::kSum);
  auto mean = acc.reduce(torch::full({1}, static_cast<float>(r + 1)), tandem::ReduceOp::kMean);
  auto padded = acc.gather(acc.pad_across_processes(mine, 0, -1.0).t());
  acc.wait_for_everyone();
  if (acc.is_main_process()) {
    auto line = [](const char* what, const torch::Tensor& t) {
      std::string v;
      auto flat = t.reshape({-1});
      for (int64_t i = 0; i < flat.numel(); ++i) v += " " + std::to_string(flat[i].item<float>());
      std::printf("metric %s%s\n", what, v.c_str());
    };
    line("gather", gathered);
    line("sum", sum);
    line("mean", mean);
    line("padded", padded);
    std::fflush(stdout);
  }
  return 0;
}

// Note [A topology always built]: every run has a topology; the main process prints its
// sizes, whether its data-parallel group is the world group itself, and the strategy's group.
int topology() {
  tandem::Accelerator acc;
  const auto& t = acc.topology();
  const bool dp_is_world = t.data_parallel().get() == t.world().get();
  acc.wait_for_everyone();
  if (acc.is_main_process()) {
    std::printf("topology %s; dp %d%s; shard %d; strategy %s; mesh %s\n", t.shape_string().c_str(),
                t.dp(), dp_is_world ? " (the world group)" : "", t.sharding()->size(),
                acc.strategy().name().c_str(), acc.mesh() ? "built" : "none");
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int run_worker(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "tp" || mode == "train") return train<Net>(mode);
    if (mode == "plain") return train<PlainNet>("train");
    if (mode == "metrics") return metrics();
    if (mode == "topology") return topology();
    if (mode == "plain-tp") return train<PlainNet>("tp");
    std::cerr << "usage: hooks_worker tp|train|plain|plain-tp|metrics|topology" << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "hooks_worker: " << e.what() << std::endl;
    return 1;
  }
}

int main(int argc, char** argv) {
  return tandem::testing::main_with_jobs(argc, argv, run_worker);
}
