// One training job of the resharding tests: the Sequential GPT with AdamW under whatever layout
// the launcher's flags give (data parallel, ZeRO 1-3, tensor, sequence and pipeline parallel),
// next to the dense GPT trained by plain LibTorch on the whole batch in the same process.
//
//   reshard_worker --steps N [--save_dir D --stop K] [--load_dir D]
//
// The data: one epoch of 60 token sequences through a prepared, shuffled loader, 12 per step
// over all data-parallel ranks. --save_dir: train steps 0..K-1 (K = --stop), then save_state(D)
// and stop, mid-epoch. --load_dir: load_state(D) first, then train steps K..N-1, where K is the
// optimizer steps load_state restored, from the loader's restored sample. The dense model
// always trains steps 0..N-1 from the same seed, so a job that was saved on one
// layout and resumed on another ends comparable with one uninterrupted dense run: the main
// process prints "check resumed_params <largest difference relative to the tensor's scale>"
// over the whole model (gathered under the dense names) and "check resumed_loss_step<s>".
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "../../examples/common/gpt.h"
#include "../common/jobs_main.h"
#include "../common/small_gpt.h"
#include "tandem/accelerator.h"
#include "tandem/data/sampler.h"
#include "tandem/parallel/pipeline.h"

namespace {

namespace tp = tandem::parallel;

struct Args {
  int steps = 4, stop = 2;
  std::string save_dir, load_dir;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
      return argv[++i];
    };
    if (k == "--steps") a.steps = std::stoi(next());
    else if (k == "--stop") a.stop = std::stoi(next());
    else if (k == "--save_dir") a.save_dir = next();
    else if (k == "--load_dir") a.load_dir = next();
    else throw std::invalid_argument("unknown argument " + k);
  }
  return a;
}

// The global batch: 1, 2, 3, 4 and 6 data-parallel ranks split it evenly (and in two
// micro-batches each on 1, 2 and 3); one epoch of 5 global batches.
constexpr int64_t kBatch = 12, kSamples = 5 * kBatch, kSeed = 3;

// Token sequences: input and next-token target of each.
struct Tokens : torch::data::datasets::Dataset<Tokens> {
  torch::Tensor ids;
  explicit Tokens(const examples::GPTConfig& c) {
    auto gen = at::detail::createCPUGenerator(7);
    ids = torch::randint(c.vocab, {kSamples, c.context + 1}, gen, torch::kLong);
  }
  torch::data::Example<> get(size_t i) override {
    auto row = ids[static_cast<int64_t>(i)];
    return {row.slice(0, 0, row.size(0) - 1), row.slice(0, 1)};
  }
  torch::optional<size_t> size() const override { return kSamples; }
};

int run(const Args& a) {
  tandem::Accelerator acc;
  const auto* mesh = acc.mesh();
  const int tp_size = mesh->size("tp"), pp_size = mesh->size("pp");
  const auto tpg = tp_size > 1 ? (*mesh)["tp"] : nullptr;
  auto& dp = acc.data_parallel_group();
  const auto c = tandem::testing::small_gpt();
  torch::manual_seed(21);
  auto dense = examples::gpt_sequential(c);
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  torch::optim::AdamW dense_opt(dense->parameters(), adamw);

  torch::manual_seed(21);
  auto net = examples::gpt_sequential(c);
  std::shared_ptr<tp::Pipeline> pipe;
  torch::nn::Module* module = nullptr;
  if (pp_size > 1) {
    auto loss_fn = [tpg](const at::Tensor& y, const at::Tensor& target) {
      return examples::gpt_sequential_loss(y, target, tpg);
    };
    // The schedule: 1F1B, or the launcher's (--pp_schedule, --pp_virtual_stages).
    const auto options = tp::PipelineOptions().microbatches(2);
    pipe = tp_size > 1 ? acc.prepare_pipeline(net, loss_fn, options,
                                              examples::gpt_sequential_tensor_parallel_plan())
                       : acc.prepare_pipeline(net, loss_fn, options);
    module = pipe->module().get();
  } else {
    if (tp_size > 1) acc.parallelize(*net, examples::gpt_sequential_tensor_parallel_plan());
    net = acc.prepare(net);
    module = net.ptr().get();
  }
  auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(module->parameters(), adamw));
  int first = 0;
  const int last = a.save_dir.empty() ? a.steps : a.stop;
  // The dense model's batches: the epoch's order as one process's sampler sees it, cut into
  // global batches (the ranks' samplers interleave the same positions).
  const Tokens data(c);
  const auto order = tandem::data::DistributedSampler(
                         kSamples, tandem::data::SamplerOptions().shuffle(true).seed(kSeed))
                         .indices();
  // One dense step on global batch s; returns its loss.
  auto dense_step = [&](int s) {
    auto rows = torch::tensor(std::vector<int64_t>(order.begin() + s * kBatch,
                                                   order.begin() + (s + 1) * kBatch));
    auto ids = data.ids.index_select(0, rows);
    dense_opt.zero_grad();
    auto loss =
        examples::gpt_sequential_loss(dense->forward(ids.slice(1, 0, c.context)), ids.slice(1, 1));
    loss.backward();
    dense_opt.step();
    return loss.detach();
  };
  auto loader = acc.prepare_data_loader(
      Tokens(c),
      tandem::data::DataLoaderOptions().batch_size(kBatch / dp.size()).shuffle(true).seed(kSeed));
  if (!a.load_dir.empty()) {
    const auto loaded = acc.load_state(a.load_dir);
    first = static_cast<int>(loaded.step);
    std::printf("resumed at step %d from %s resharded %d loaders %d\n", first,
                loaded.saved_layout.c_str(), loaded.resharded ? 1 : 0, loaded.loaders ? 1 : 0);
    for (int s = 0; s < first; ++s) {  // the dense model catches up
      dense_step(s);
    }
  }
  int s = first;
  for (auto& b : *loader) {
    const auto dl = dense_step(s);
    double loss = 0;
    if (pipe) {
      loss = pipe->step(pipe->is_first() ? b.data : at::Tensor(),
                        pipe->is_last() ? b.target : at::Tensor());
    } else {
      auto l = examples::gpt_sequential_loss(net->forward(b.data), b.target, tpg);
      acc.backward(l);
      loss = l.item<double>();
    }
    opt.step();
    opt.zero_grad();
    auto avg = torch::full({1}, loss, torch::kDouble);
    dp.allreduce(avg, tandem::ReduceOp::kMean);
    if (acc.is_main_process())
      std::printf("check resumed_loss_step%d %.3g\n", s,
                  std::abs(avg.item<double>() - dl.item<double>()) / std::abs(dl.item<double>()));
    if (++s >= last) break;  // before the next batch is taken: the loader's position is s
  }
  if (!a.save_dir.empty()) {
    acc.save_state(a.save_dir);
    std::printf("saved at step %d\n", last);
    return 0;
  }
  auto full = acc.get_state_dict(*module);
  if (acc.is_main_process()) {
    auto expected = dense->named_parameters();
    double worst = 0;
    size_t matched = 0;
    for (const auto& [name, t] : full) {
      auto* d = expected.find(name);
      if (!d || d->sizes() != t.sizes()) {
        std::printf("tensor %s is not the dense model's\n", name.c_str());
        continue;
      }
      ++matched;
      worst = std::max(worst, (t - d->detach()).abs().max().item<double>() /
                                  d->detach().abs().max().item<double>());
    }
    std::printf("state_dict tensors %zu matched %zu dense %zu\n", full.size(), matched,
                expected.size());
    std::printf("check resumed_params %.3g\n", worst);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int run_worker(int argc, char** argv) {
  torch::set_num_threads(1);
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "reshard_worker: " << e.what() << std::endl;
    return 1;
  }
}

int main(int argc, char** argv) {
  return tandem::testing::main_with_jobs(argc, argv, run_worker);
}
