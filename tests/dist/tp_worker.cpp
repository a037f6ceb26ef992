// A rank of the tensor-parallel tests (started by `tandem launch --cpu`). Every rank also builds
// the dense model with the same seed, so each check compares this rank's tensor-parallel result
// with the matching part of the dense one, and prints "check <name> <max difference>". Modes:
//   layers  (2 ranks) each layer and region against its dense counterpart: outputs, input
//           gradients and this rank's shard of the weight gradients.
//   gpt     (2 ranks) the example GPT parallelized by its plan: loss, and every parameter's
//           gradient (the shard of the dense gradient for split parameters). With
//           --sequence_parallel, by the sequence-parallel plan; also ln_f's gradient before and
//           after the sum over tp.
//   dropout (2 ranks) residual dropout: per-rank masks from the per-rank stream under sequence
//           parallel (shared stream untouched, reproducible), the shared masks without.
//   train   (4 ranks, launched with --tp_size 2) a mesh from the launcher's TANDEM_* sizes,
//           tensor parallel within dp x tp: SGD steps (momentum, weight decay) with gradients
//           averaged over mesh["dp"] against one dense process training on the global batch.
//   accelerate (4 ranks, --tp_size 2) the same through the Accelerator: its mesh, parallelize(),
//           prepare() (data parallel over mesh["dp"]), backward() and the prepared optimizer;
//           --sequence_parallel: the GPT's sequence-parallel plan.
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <map>
#include <set>

#include "../../examples/common/gpt.h"
#include "../common/compare_weights.h"
#include "../common/small_gpt.h"
#include "tandem/accelerator.h"
#include "tandem/checkpoint/safetensors.h"
#include "tandem/comm/mesh.h"
#include "tandem/comm/process_group.h"
#include "tandem/config/run_config.h"
#include "tandem/parallel/tensor_parallel.h"
#include "../common/jobs_main.h"

namespace tp = tandem::parallel;

namespace {

using tandem::testing::gpt_shard;
using tandem::testing::shard;
using tandem::testing::small_gpt;

std::shared_ptr<tandem::ProcessGroup> g_world;

void check(const std::string& name, const at::Tensor& got, const at::Tensor& expected) {
  if (got.sizes() != expected.sizes()) {
    std::cout << "check " << name << " shape " << got.sizes() << " != " << expected.sizes()
              << std::endl;
    throw std::runtime_error("shape mismatch in " + name);
  }
  const double d = (got - expected).abs().max().item<double>();
  std::cout << "check " << name << " " << d << std::endl;
}

// A dense Linear and one backward through it: every rank draws the same from `seed`. x [3, 8,
// in] (8 positions, divisible by the group for the sequence-parallel checks) with its gradient,
// the output y and the upstream gradient grad_y.
struct DenseReference {
  torch::nn::Linear layer{nullptr};
  at::Tensor x, y, grad_y;
  // A fresh leaf with x's values (or a part of them), for the parallel layer.
  at::Tensor input(const at::Tensor& part = {}) const {
    return (part.defined() ? part : x).detach().clone().requires_grad_();
  }
};

DenseReference dense_reference(uint64_t seed, int64_t in, int64_t out) {
  torch::manual_seed(seed);
  DenseReference d;
  d.layer = torch::nn::Linear(in, out);
  d.x = torch::randn({3, 8, in}, torch::requires_grad());
  d.grad_y = torch::randn({3, 8, out});
  d.y = d.layer(d.x);
  (d.y * d.grad_y).sum().backward();
  return d;
}

void layers() {
  auto& pg = g_world;
  const int r = pg->rank(), n = pg->size();
  // Column-parallel, local output.
  {
    auto d = dense_reference(1, 8, 12);
    tp::ColumnParallelLinear col(tp::ColumnParallelLinearOptions(8, 12), pg);
    col->load_dense(d.layer->weight, d.layer->bias);
    auto xt = d.input();
    auto yt = col(xt);
    (yt * shard(d.grad_y, -1, r, n)).sum().backward();
    check("column_output", yt, shard(d.y, -1, r, n));
    check("column_input_grad", xt.grad(), d.x.grad());
    check("column_weight_grad", col->weight.grad(), shard(d.layer->weight.grad(), 0, r, n));
    check("column_bias_grad", col->bias.grad(), shard(d.layer->bias.grad(), 0, r, n));
  }
  // Column-parallel in 3 fused parts, gathered output.
  {
    auto d = dense_reference(2, 8, 12);
    tp::ColumnParallelLinear col(tp::ColumnParallelLinearOptions(8, 12).parts(3).gather_output(true), pg);
    col->load_dense(d.layer->weight, d.layer->bias);
    auto xt = d.input();
    auto yt = col(xt);
    (yt * d.grad_y).sum().backward();
    check("column_fused_gathered_output", yt, d.y);
    check("column_fused_input_grad", xt.grad(), d.x.grad());
    check("column_fused_weight_grad", col->weight.grad(),
          shard(d.layer->weight.grad(), 0, r, n, 3));
    check("column_fused_bias_grad", col->bias.grad(), shard(d.layer->bias.grad(), 0, r, n, 3));
  }
  // Column-parallel, sequence parallel: the input is this rank's positions, gathered forward;
  // the input gradient comes back reduce-scattered to them.
  {
    auto d = dense_reference(8, 8, 12);
    tp::ColumnParallelLinear col(tp::ColumnParallelLinearOptions(8, 12).sequence_parallel(true),
                                 pg);
    col->load_dense(d.layer->weight, d.layer->bias);
    auto xt = d.input(shard(d.x, 1, r, n));
    auto yt = col(xt);
    (yt * shard(d.grad_y, -1, r, n)).sum().backward();
    check("column_sequence_output", yt, shard(d.y, -1, r, n));
    check("column_sequence_input_grad", xt.grad(), shard(d.x.grad(), 1, r, n));
    check("column_sequence_weight_grad", col->weight.grad(),
          shard(d.layer->weight.grad(), 0, r, n));
    check("column_sequence_bias_grad", col->bias.grad(), shard(d.layer->bias.grad(), 0, r, n));
  }
  // Row-parallel, from the full input and from a split input.
  for (bool parallel_input : {false, true}) {
    auto d = dense_reference(3, 12, 8);
    tp::RowParallelLinear row(tp::RowParallelLinearOptions(12, 8).input_is_parallel(parallel_input), pg);
    row->load_dense(d.layer->weight, d.layer->bias);
    auto xt = d.input(parallel_input ? shard(d.x, -1, r, n) : at::Tensor());
    auto yt = row(xt);
    (yt * d.grad_y).sum().backward();
    const std::string name = parallel_input ? "row_split_input" : "row_full_input";
    check(name + "_output", yt, d.y);
    check(name + "_input_grad", xt.grad(),
          parallel_input ? shard(d.x.grad(), -1, r, n) : d.x.grad());
    check(name + "_weight_grad", row->weight.grad(), shard(d.layer->weight.grad(), 1, r, n));
    check(name + "_bias_grad", row->bias.grad(), d.layer->bias.grad());
  }
  // Row-parallel, sequence parallel: the output is this rank's positions (reduce-scattered);
  // the bias, added to them, still gets the whole dense gradient.
  {
    auto d = dense_reference(9, 12, 8);
    tp::RowParallelLinear row(tp::RowParallelLinearOptions(12, 8).sequence_parallel(true), pg);
    row->load_dense(d.layer->weight, d.layer->bias);
    auto xt = d.input(shard(d.x, -1, r, n));
    auto yt = row(xt);
    (yt * shard(d.grad_y, 1, r, n)).sum().backward();
    check("row_sequence_output", yt, shard(d.y, 1, r, n));
    check("row_sequence_input_grad", xt.grad(), shard(d.x.grad(), -1, r, n));
    check("row_sequence_weight_grad", row->weight.grad(), shard(d.layer->weight.grad(), 1, r, n));
    check("row_sequence_bias_grad", row->bias.grad(), d.layer->bias.grad());
  }
  // Vocab-parallel embedding.
  {
    torch::manual_seed(4);
    torch::nn::Embedding dense(16, 6);
    auto ids = torch::randint(0, 16, {3, 5});
    auto gy = torch::randn({3, 5, 6});
    auto y = dense(ids);
    (y * gy).sum().backward();
    tp::VocabParallelEmbedding emb(16, 6, pg);
    emb->load_dense(dense->weight);
    auto yt = emb(ids);
    (yt * gy).sum().backward();
    check("vocab_embedding_output", yt, y);
    check("vocab_embedding_weight_grad", emb->weight.grad(), shard(dense->weight.grad(), 0, r, n));
  }
  // Vocab-parallel cross entropy, with ignored targets.
  {
    torch::manual_seed(5);
    auto logits = (3 * torch::randn({3, 5, 16})).requires_grad_();
    auto target = torch::randint(0, 16, {3, 5});
    target.index_put_({1, 2}, -100);
    target.index_put_({2, 0}, -100);
    auto loss = torch::nn::functional::cross_entropy(logits.view({-1, 16}), target.view({-1}));
    loss.backward();
    auto local = shard(logits.detach(), -1, r, n).clone().requires_grad_();
    auto lt = tp::vocab_parallel_cross_entropy(local, target, pg);
    lt.backward();
    check("vocab_cross_entropy_loss", lt, loss);
    check("vocab_cross_entropy_logits_grad", local.grad(), shard(logits.grad(), -1, r, n));
  }
  // Sequence parallel: gather along the sequence, each rank with its own downstream use.
  {
    torch::manual_seed(6);
    auto x = torch::randn({2, 8, 4}, torch::requires_grad());
    auto gys = torch::randn({n, 2, 8, 4});
    (x * gys.sum(0)).sum().backward();
    auto xt = shard(x.detach(), 1, r, n).clone().requires_grad_();
    auto yt = tp::gather_from_sequence_region(xt, pg);
    (yt * gys[r]).sum().backward();
    check("sequence_gather_output", yt, x.detach());
    check("sequence_gather_input_grad", xt.grad(), shard(x.grad(), 1, r, n));
  }
  // Sequence parallel: reduce-scatter of every rank's partial sums.
  {
    torch::manual_seed(7);
    auto parts = torch::randn({n, 2, 8, 4});
    auto g = torch::randn({2, 8, 4});
    auto zt = parts[r].clone().requires_grad_();
    auto out = tp::reduce_scatter_to_sequence_region(zt, pg);
    (out * shard(g, 1, r, n)).sum().backward();
    check("sequence_reduce_scatter_output", out, shard(parts.sum(0), 1, r, n));
    check("sequence_reduce_scatter_input_grad", zt.grad(), g);
    std::string refused;
    try {
      tp::reduce_scatter_to_sequence_region(torch::randn({2, 3, 4}), pg);
    } catch (const std::invalid_argument& e) {
      refused = e.what();
    }
    std::cout << "sequence_refusal " << (refused.find("divisible by 2") != std::string::npos)
              << std::endl;
  }
  // Sequence parallel: scatter of replicated activations; each rank's gradient of its part
  // comes back all-gathered.
  {
    torch::manual_seed(10);
    auto x = torch::randn({2, 8, 4});
    auto g = torch::randn({2, 8, 4});
    auto xt = x.clone().requires_grad_();
    auto out = tp::scatter_to_sequence_region(xt, pg);
    (out * shard(g, 1, r, n)).sum().backward();
    check("sequence_scatter_output", out, shard(x, 1, r, n));
    check("sequence_scatter_input_grad", xt.grad(), g);
    std::string refused;
    try {
      tp::scatter_to_sequence_region(torch::randn({2, 3, 4}), pg);
    } catch (const std::invalid_argument& e) {
      refused = e.what();
    }
    std::cout << "sequence_scatter_refusal "
              << (refused.find("divisible by 2") != std::string::npos) << std::endl;
  }
}

// Every distinct parameter tensor of `m` once (the tied head and embedding are one).
std::vector<at::Tensor> unique_parameters(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  std::set<c10::TensorImpl*> seen;
  for (auto& p : m.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

// The batch of the GPT checks, from seed 12; the default stream is then where these draws leave
// it.
std::pair<at::Tensor, at::Tensor> gpt_batch() {
  torch::manual_seed(12);
  auto idx = torch::randint(0, 64, {2, 16});
  return {idx, torch::randint(0, 64, {2, 16})};
}

// Checks every parameter of `model` (this rank's shard) and its gradient against the dense
// GPT's; returns how many were compared.
int check_gpt_parameters(const std::string& prefix, examples::GPT& model, examples::GPT& dense,
                         int r, int n) {
  const auto local = model->named_parameters();  // find() points into it: keep it alive
  int count = 0;
  for (auto& p : dense->named_parameters()) {
    auto* mine = local.find(p.key());
    if (!mine) throw std::runtime_error("the parallel GPT has no parameter " + p.key());
    check(prefix + "_param " + p.key(), *mine, gpt_shard(p.key(), p.value().detach(), r, n));
    check(prefix + "_grad " + p.key(), mine->grad(), gpt_shard(p.key(), p.value().grad(), r, n));
    ++count;
  }
  return count;
}

// The example GPT by its plan (`sequence_parallel`: the sequence-parallel one) against the dense
// GPT: loss, parameters and gradients.
void gpt(bool sequence_parallel) {
  auto& pg = g_world;
  const int r = pg->rank(), n = pg->size();
  torch::manual_seed(11);
  examples::GPT dense(small_gpt());
  torch::manual_seed(11);
  examples::GPT model(small_gpt());
  // Registered before the plan's hooks, this one sees ln_f's gradient before the sum over tp.
  at::Tensor ln_local;
  model->ln_f->weight.register_hook([&ln_local](const at::Tensor& g) { ln_local = g.clone(); });
  tp::parallelize_module(*model, pg, examples::gpt_tensor_parallel_plan(sequence_parallel));
  auto [idx, targets] = gpt_batch();
  auto loss = dense->loss_per_sample(idx, targets).mean();
  loss.backward();
  auto lt = model->loss_per_sample(idx, targets).mean();
  lt.backward();
  check("gpt_loss", lt, loss);
  const int count = check_gpt_parameters("gpt", model, dense, r, n);
  std::cout << "gpt_parameters " << count << " of " << model->named_parameters().size()
            << std::endl;
  const auto named = model->named_parameters();  // find() points into it: keep it alive
  auto head = named.find("head.weight");
  auto wte = named.find("wte.weight");
  std::cout << "gpt_tied " << (head->unsafeGetTensorImpl() == wte->unsafeGetTensorImpl()) << " "
            << head->size(0) << std::endl;
  if (sequence_parallel) {
    // ln_f ran on this rank's 8 of 16 positions: its own gradient is a part of the dense one,
    // which only the sum over tp (the plan's hook) makes whole.
    std::cout << "gpt_sequence_parallel " << (model->sequence_parallel_head() != nullptr)
              << std::endl;
    const auto& dense_grad = dense->ln_f->weight.grad();
    std::printf("gpt_ln_local_difference %.9g\n",
                (ln_local - dense_grad).abs().max().item<double>());
    std::fflush(stdout);
    auto summed = ln_local.clone();
    pg->allreduce(summed, tandem::ReduceOp::kSum);
    check("gpt_ln_local_summed", summed, dense_grad);
  }
}

// Dropout with the sequence-parallel plan: masks of their own on each rank's positions, drawn
// from the per-rank stream, the shared stream untouched, the run reproducible from the seeds;
// and the plain tensor-parallel plan (replicated activations) drawing what the dense GPT draws.
void dropout() {
  auto& pg = g_world;
  const int r = pg->rank(), n = pg->size();
  auto config = small_gpt();
  config.dropout = 0.1;
  struct Step {
    at::Tensor loss;
    std::vector<at::Tensor> grads;
  };
  auto step = [&](uint64_t tp_seed) {
    torch::manual_seed(11);
    examples::GPT model(config);
    tp::parallelize_module(*model, pg, examples::gpt_tensor_parallel_plan(true));
    model->seed_tensor_parallel_rng(tp_seed);
    auto [idx, targets] = gpt_batch();
    Step s{model->loss_per_sample(idx, targets).mean(), {}};
    s.loss.backward();
    // The shared stream: where the same draws without the model leave it (dropout on sequence
    // shards draws from the per-rank stream only), and the same on every tp rank.
    auto after = torch::rand({16});
    gpt_batch();
    check("dropout_shared_stream_untouched", after, torch::rand({16}));
    auto both = pg->allgather(after);
    check("dropout_shared_stream_across_ranks", both[0], both[1]);
    for (auto& p : model->parameters()) s.grads.push_back(p.grad().clone());
    return s;
  };
  auto a = step(7), b = step(7), c = step(8);
  double grads = 0;
  for (size_t i = 0; i < a.grads.size(); ++i)
    grads = std::max(grads, (a.grads[i] - b.grads[i]).abs().max().item<double>());
  std::printf("dropout_repeat loss %.9g grads %.9g other_seed_loss %.9g\n",
              (a.loss - b.loss).abs().item<double>(), grads,
              (a.loss - c.loss).abs().item<double>());
  std::fflush(stdout);

  // The masks of the two ranks' positions: a model without blocks whose two sequence halves
  // are the same tokens (and no position embedding) gives the same logits for both halves
  // unless the ranks' dropout masks differ.
  {
    auto flat = config;
    flat.layers = 0;
    torch::manual_seed(13);
    examples::GPT model(flat);
    torch::NoGradGuard no_grad;
    model->wpe->weight.zero_();
    tp::TensorParallelPlan plan;
    plan.vocab("wte").sequence_parallel("ln_f").colwise_from_sequence("head");
    tp::parallelize_module(*model, pg, plan);
    model->seed_tensor_parallel_rng(7);
    auto half = torch::randint(0, 64, {2, 8});
    auto idx = torch::cat({half, half}, 1);
    auto halves = [&] {
      auto logits = model->forward(idx);
      return (logits.narrow(1, 0, 8) - logits.narrow(1, 8, 8)).abs().max().item<double>();
    };
    model->eval();
    const double eval = halves();
    model->train();
    std::printf("dropout_halves eval %.9g train %.9g\n", eval, halves());
    std::fflush(stdout);
  }

  // Without sequence parallel every dropout acts on replicated activations: the same masks as
  // the dense GPT's, from the shared stream.
  {
    torch::manual_seed(11);
    examples::GPT dense(config);
    torch::manual_seed(11);
    examples::GPT model(config);
    tp::parallelize_module(*model, pg, examples::gpt_tensor_parallel_plan());
    auto [idx, targets] = gpt_batch();
    auto loss = dense->loss_per_sample(idx, targets).mean();
    loss.backward();
    gpt_batch();  // the same stream for the parallel model's masks
    auto lt = model->loss_per_sample(idx, targets).mean();
    lt.backward();
    check("dropout_tp_loss", lt, loss);
    check_gpt_parameters("dropout_tp", model, dense, r, n);
    // The masks matter: without them the dense loss is another.
    torch::NoGradGuard no_grad;
    dense->eval();
    auto plain = dense->loss_per_sample(idx, targets).mean();
    std::printf("dropout_dense_effect %.9g\n", (loss - plain).abs().item<double>());
    std::fflush(stdout);
  }
}

// Largest relative difference of a parameter (this rank's shard) to the dense model's.
double worst_relative(torch::nn::Module& model, torch::nn::Module& dense, int t, int n) {
  auto local = model.named_parameters();
  double worst = 0;
  for (auto& p : dense.named_parameters()) {
    auto expected = gpt_shard(p.key(), p.value().detach(), t, n);
    auto got = *local.find(p.key());
    worst = std::max(worst, ((got - expected).abs() / expected.abs().clamp_min(1.0)).max().item<double>());
  }
  return worst;
}

void train() {
  auto& pg = g_world;
  const auto state = tandem::ProcessState::from_environment();
  auto mesh = tandem::comm::make_device_mesh(pg, tandem::config::mesh_shape_from_env(tandem::current_environment()),
                                             state.local_world_size);
  const int t = mesh.coordinate("tp"), n = mesh.size("tp"), d = mesh.coordinate("dp");
  const int dp = mesh.size("dp");
  auto tp_group = mesh["tp"], dp_group = mesh["dp"];
  std::cout << "mesh tp " << n << " dp " << dp << " rank " << pg->rank() << " tp_peers "
            << tp_group->global_rank(0) << "," << tp_group->global_rank(1) << " dp_peers "
            << dp_group->global_rank(0) << "," << dp_group->global_rank(1) << std::endl;

  torch::manual_seed(21);
  examples::GPT dense(small_gpt());
  torch::manual_seed(21);
  examples::GPT model(small_gpt());
  tp::parallelize_module(*model, tp_group, examples::gpt_tensor_parallel_plan());
  auto dense_params = unique_parameters(*dense), params = unique_parameters(*model);
  // SGD with momentum: Adam's normalised step turns the 1e-9 differences of gradients near zero
  // into differences of the order of the learning rate, which would test Adam, not the split.
  auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01);
  torch::optim::SGD dense_opt(dense_params, sgd);
  torch::optim::SGD opt(params, sgd);
  const int64_t global_batch = 4, per_dp = global_batch / dp;
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(100 + step);
    auto idx = torch::randint(0, 64, {global_batch, 16});
    auto targets = torch::randint(0, 64, {global_batch, 16});
    dense_opt.zero_grad();
    auto dl = dense->loss_per_sample(idx, targets).mean();
    dl.backward();
    dense_opt.step();
    opt.zero_grad();
    auto l = model->loss_per_sample(idx.narrow(0, d * per_dp, per_dp),
                                    targets.narrow(0, d * per_dp, per_dp)).mean();
    l.backward();
    for (auto& p : params) {
      auto g = p.mutable_grad();
      dp_group->allreduce(g, tandem::ReduceOp::kMean);
    }
    opt.step();
    auto avg = l.detach().clone();
    dp_group->allreduce(avg, tandem::ReduceOp::kMean);
    check("train_loss_step" + std::to_string(step), avg, dl.detach());
  }
  std::cout << "check train_params_relative " << worst_relative(*model, *dense, t, n) << std::endl;
}

// acc.get_state_dict of a parallelized model against the dense model: on the main process
// "state_dict tensors <n> dense <n> names_and_shapes <0|1> relative <worst>", elsewhere the
// number of tensors it got (none).
void print_state_dict_check(tandem::Accelerator& acc, torch::nn::Module& model,
                            torch::nn::Module& dense) {
  auto full = acc.get_state_dict(model);
  if (!acc.is_main_process()) {
    std::printf("state_dict on rank %d: %zu tensors\n", acc.process_index(), full.size());
    std::fflush(stdout);
    return;
  }
  auto expected = dense.named_parameters();
  size_t params = 0;
  double worst = 0;
  bool same = true;
  for (const auto& [name, t] : full) {
    auto* d = expected.find(name);
    if (!d) continue;  // a buffer
    ++params;
    if (d->sizes() != t.sizes()) {
      same = false;
      continue;
    }
    const double scale = std::max(1e-12, d->detach().abs().max().item<double>());
    worst = std::max(worst, (t - d->detach()).abs().max().item<double>() / scale);
  }
  same = same && params == expected.size();
  std::printf("state_dict tensors %zu dense %zu names_and_shapes %d relative %.3g\n", params,
              expected.size(), same ? 1 : 0, worst);
  std::fflush(stdout);
}

// Modules written as LibTorch users write them: typed members, registered, and called. `direct`
// calls them as members (`up(x)`), which a plan cannot reach: refused at parallelize; otherwise
// through the planned child (examples::call_child, the plan saying so with
// through_planned_child()), which trains as the dense model.
struct TypedMlpImpl : torch::nn::Module {
  explicit TypedMlpImpl(bool direct) : direct(direct) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    up = register_module("up", torch::nn::Linear(16, 32));
    down = register_module("down", torch::nn::Linear(32, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = norm(x);
    if (direct) return down(torch::gelu(up(h)));
    return examples::call_child(*this, "down", down,
                                torch::gelu(examples::call_child(*this, "up", up, h)));
  }
  bool direct;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(TypedMlp);

// (2 ranks, --tp_size 2) `variant`: "direct" / "planned" (TypedMlp), or "sequential" (a
// Sequential of Linear, GELU, Linear, whose entries the plan replaces in its own list too).
// Three AdamW steps through the Accelerator against the dense model on one process.
void typed(const std::string& variant) {
  tandem::Accelerator acc;
  auto make = [&]() -> std::shared_ptr<torch::nn::Module> {
    torch::manual_seed(5);
    if (variant == "sequential")
      return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::GELU(),
                                   torch::nn::Linear(32, 16))
          .ptr();
    return TypedMlp(variant == "direct").ptr();
  };
  auto dense = make(), model = make();
  auto call = [&](const std::shared_ptr<torch::nn::Module>& m, const torch::Tensor& x) {
    if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m)) return seq->forward(x);
    return std::dynamic_pointer_cast<TypedMlpImpl>(m)->forward(x);
  };
  tp::TensorParallelPlan plan;
  if (variant == "sequential")
    plan.colwise("0").rowwise("2");
  else
    plan.colwise("up").rowwise("down").through_planned_child(variant == "planned");
  acc.parallelize(*model, plan);
  model = acc.prepare(model);
  auto adam = torch::optim::AdamWOptions(1e-2);
  torch::optim::AdamW dense_opt(dense->parameters(), adam);
  auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(model->parameters(), adam));
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(50 + step);
    auto x = torch::randn({4, 16});
    dense_opt.zero_grad();
    auto dl = call(dense, x).pow(2).mean();
    dl.backward();
    dense_opt.step();
    auto l = call(model, x).pow(2).mean();
    acc.backward(l);
    opt.step();
    opt.zero_grad();
    check("typed_loss_step" + std::to_string(step), l.detach(), dl.detach());
  }
  print_state_dict_check(acc, *model, *dense);
  std::cout << "typed trained rank " << acc.process_index() << std::endl;
}

// The Accelerator's model-parallel path: the same training as train(), with data parallel
// (gradient buckets over mesh["dp"]) done by the Accelerator.
// `save_dir`: stop after step 2 and save_state there; `load_dir`: load_state from there first and
// train steps 2 and 3 only. Prints a digest of this rank's parameters at the end, so that a
// resumed run can be compared bitwise with an uninterrupted one.
void accelerate(const std::string& save_dir, const std::string& load_dir, bool sequence_parallel) {
  tandem::Accelerator acc;
  const auto* mesh = acc.mesh();
  if (mesh->size("tp") == 1)
    throw std::runtime_error("the Accelerator's topology has no tensor-parallel dimension");
  auto& dp_group = acc.data_parallel_group();
  const int t = mesh->coordinate("tp"), n = mesh->size("tp");
  const int d = dp_group.rank(), dp = dp_group.size();
  std::cout << "acc mesh tp " << n << " dp " << dp << " rank " << acc.process_index() << " dp_rank "
            << d << std::endl;
  torch::manual_seed(21);
  examples::GPT dense(small_gpt());
  torch::manual_seed(21);
  examples::GPT model(small_gpt());
  acc.parallelize(*model, examples::gpt_tensor_parallel_plan(sequence_parallel));
  model = acc.prepare(model);
  auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01);
  torch::optim::SGD dense_opt(unique_parameters(*dense), sgd);
  auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(unique_parameters(*model), sgd));
  const int64_t global_batch = 4, per_dp = global_batch / dp;
  const int first = load_dir.empty() ? 0 : 2, last = save_dir.empty() ? 4 : 2;
  if (!load_dir.empty()) acc.load_state(load_dir);
  for (int step = 0; step < last; ++step) {
    torch::manual_seed(100 + step);
    auto idx = torch::randint(0, 64, {global_batch, 16});
    auto targets = torch::randint(0, 64, {global_batch, 16});
    dense_opt.zero_grad();
    auto dl = dense->loss_per_sample(idx, targets).mean();
    dl.backward();
    // A norm that binds (the gradients' norm is about 1-3 here), so the dense model's norm is
    // what both sides must agree on.
    const double dense_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*dense), 0.5);
    dense_opt.step();
    if (step < first) continue;
    auto scope = acc.accumulate();
    auto l = model->loss_per_sample(idx.narrow(0, d * per_dp, per_dp),
                                    targets.narrow(0, d * per_dp, per_dp)).mean();
    acc.backward(l);
    const double norm = acc.clip_grad_norm_(unique_parameters(*model), 0.5);
    check("acc_grad_norm_step" + std::to_string(step), torch::full({1}, norm, torch::kDouble),
          torch::full({1}, dense_norm, torch::kDouble));
    std::cout << "grad_norm " << norm << " dense " << dense_norm << std::endl;
    opt.step();
    opt.zero_grad();
    auto avg = l.detach().clone();
    dp_group.allreduce(avg, tandem::ReduceOp::kMean);
    check("acc_loss_step" + std::to_string(step), avg, dl.detach());
  }
  if (!save_dir.empty()) {
    acc.save_state(save_dir);
    // The dense model at the same step, next to the checkpoint: merge-weights must give it back.
    if (acc.is_main_process()) {
      std::vector<std::pair<std::string, at::Tensor>> named;
      for (const auto& p : dense->named_parameters()) named.emplace_back(p.key(), p.value().detach());
      tandem::checkpoint::save_safetensors(save_dir + ".dense.safetensors", named);
    }
    std::cout << "saved at step " << last << std::endl;
    return;
  }
  print_state_dict_check(acc, *model, *dense);
  // ZeRO-3 units (the GPT's blocks) hold no storage between uses: read them in this scope.
  auto full = acc.summon_full_params();
  std::cout << "check acc_params_relative " << worst_relative(*model, *dense, t, n) << std::endl;
  double digest = 0;
  for (auto& p : model->parameters()) digest += p.detach().to(torch::kDouble).abs().sum().item<double>();
  std::printf("param_digest rank %d %.17g\n", acc.process_index(), digest);
  std::fflush(stdout);
}

}  // namespace

int run_worker(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  bool sequence_parallel = false;
  for (int i = 2; i < argc; ++i) sequence_parallel |= std::string(argv[i]) == "--sequence_parallel";
  torch::set_num_threads(1);
  try {
    if (mode == "compare" && argc == 4) {  // one process: merged checkpoint vs dense weights
      tandem::testing::print_weight_checks(argv[2], argv[3]);
      return 0;
    }
    if (mode == "typed" && argc == 3) {  // the Accelerator joins the job itself
      typed(argv[2]);
      return 0;
    }
    if (mode == "accelerate") {  // the Accelerator joins the job itself
      std::string save_dir, load_dir;
      for (int i = 2; i + 1 < argc; i += 2) {
        if (std::string(argv[i]) == "--save_dir") save_dir = argv[i + 1];
        if (std::string(argv[i]) == "--load_dir") load_dir = argv[i + 1];
      }
      accelerate(save_dir, load_dir, sequence_parallel);
      return 0;
    }
    g_world = tandem::ProcessGroup::create(tandem::ProcessState::from_environment());
    std::cout << "tp_worker " << mode << " rank " << g_world->rank() << std::endl;
    if (mode == "layers") {
      layers();
    } else if (mode == "gpt") {
      gpt(sequence_parallel);
    } else if (mode == "dropout") {
      dropout();
    } else if (mode == "train") {
      train();
    } else {
      std::cerr << "usage: tp_worker layers|gpt [--sequence_parallel]|dropout|train|accelerate "
                   "[--sequence_parallel] [--save_dir D] [--load_dir D]"
                << std::endl;
      return 2;
    }
    g_world->barrier();
  } catch (const std::exception& e) {
    std::cerr << "tp_worker failed: " << e.what() << std::endl;
    return 1;
  }
  std::cout << "tp_worker done" << std::endl;
  return 0;
}

int main(int argc, char** argv) { return tandem::testing::main_with_jobs(argc, argv, run_worker); }
