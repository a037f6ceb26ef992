// A rank of the mixed-precision tests, started through `tandem launch`. Modes:
//   skip   loss scaling on; inf injected into ONE rank's gradient at step --inject_step: every
//          rank skips that step together, the scale halves on every rank, parameters stay equal;
//   train  trains the MLP or the small GPT for --steps steps in --mixed_precision and prints
//          "final loss <x>" (a fixed held-out batch, loss in fp32) and "first loss <x>".
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <limits>

#include "../../examples/common/gpt.h"
#include "../../examples/common/mlp.h"
#include "../common/jobs_main.h"
#include "../common/small_gpt.h"
#include "tandem/tandem.h"

namespace {

struct Args {
  std::string mode = "train", model = "mlp", precision = "no";
  int64_t steps = 20, accum = 1, inject_step = 2, inject_rank = 1;
  bool master_weights = false;
};

int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "CHECK FAILED: " << what << std::endl;
    ++failures;
  }
}

torch::Tensor flat_parameters(torch::nn::Module& m) {
  std::vector<torch::Tensor> v;
  for (auto& p : m.parameters()) v.push_back(p.detach().to(torch::kFloat).reshape({-1}));
  return torch::cat(v);
}

bool equal_on_all_ranks(tandem::Accelerator& acc, const torch::Tensor& t) {
  auto all = acc.gather(t.unsqueeze(0));
  for (int64_t r = 1; r < all.size(0); ++r)
    if (!all[r].equal(all[0])) return false;
  return true;
}

int skip(const Args& a) {
  tandem::Accelerator acc(tandem::AcceleratorOptions()
                              .loss_scaling(true)
                              .grad_scaler(tandem::precision::GradScalerOptions().init_scale(1024))
                              .gradient_accumulation_steps(static_cast<int>(a.accum)));
  check(acc.scaler() != nullptr, "a scaler exists");
  torch::manual_seed(5);
  auto mlp = acc.prepare(examples::MLP(8, 16, 3));
  auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(mlp->parameters(), 0.1));
  torch::manual_seed(100 + acc.process_index());
  int64_t step = 0;
  for (int64_t micro = 0; step < 4; ++micro) {
    auto scope = acc.accumulate();
    auto x = torch::randn({6, 8});
    auto y = torch::randint(3, {6});
    acc.backward(torch::cross_entropy_loss(mlp->forward(x), y));
    if (!acc.sync_gradients()) {
      opt.step();
      continue;
    }
    ++step;
    if (step == a.inject_step && acc.process_index() == a.inject_rank)
      mlp->fc2->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
    const double scale_before = acc.scaler()->get_scale();
    auto before = flat_parameters(*mlp.ptr());
    const double norm = acc.clip_grad_norm_(mlp->parameters(), 1e9);  // unscales first
    opt.step();
    opt.zero_grad();
    const bool injected = step == a.inject_step;
    check(acc.optimizer_step_was_skipped() == injected,
          "step " + std::to_string(step) + ": optimizer_step_was_skipped() is " +
              std::to_string(acc.optimizer_step_was_skipped()));
    check(opt.step_was_skipped() == injected, "step_was_skipped agrees");
    check(acc.scaler()->get_scale() == (injected ? scale_before / 2 : scale_before),
          "scale after step " + std::to_string(step) + " is " +
              std::to_string(acc.scaler()->get_scale()));
    if (injected) {
      check(flat_parameters(*mlp.ptr()).equal(before), "skipped step leaves parameters unchanged");
    } else {
      check(std::isfinite(norm) && norm < 100, "unscaled gradient norm is the true one: " +
                                                  std::to_string(norm));
      check(!flat_parameters(*mlp.ptr()).equal(before), "a finite step changes parameters");
    }
    check(equal_on_all_ranks(acc, flat_parameters(*mlp.ptr())), "parameters equal on all ranks");
    check(equal_on_all_ranks(acc, torch::tensor({acc.scaler()->get_scale()})),
          "scale equal on all ranks");
  }
  std::cout << "skip OK scale " << acc.scaler()->get_scale() << std::endl;
  return failures ? 1 : 0;
}

using tandem::testing::small_gpt;

// The tests' small GPT over bytes, with 2 heads (of width 16): the model these runs were measured
// with.
const auto kByteGpt = tandem::testing::SmallGptOptions().vocab(256).heads(2);

int train(const Args& a) {
  auto options = tandem::AcceleratorOptions().mixed_precision(a.precision);
  if (a.master_weights) options.master_weights(true);
  tandem::Accelerator acc(options);
  torch::manual_seed(42);
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_fn;
  torch::Tensor x_all, y_all, x_eval, y_eval;
  std::shared_ptr<torch::optim::Optimizer> opt_raw;
  if (a.model == "gpt") {
    auto gpt = examples::GPT(small_gpt(kByteGpt));
    module = gpt.ptr();
    loss_fn = [gpt](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return gpt->loss_per_sample(x, y).mean();
    };
    static std::string text = examples::project_text(TANDEM_SOURCE_DIR);
    examples::ByteWindows windows(text, small_gpt(kByteGpt).context, 0,
                                  std::min<size_t>(text.size(), 200000));
    std::vector<torch::Tensor> xs, ys;
    for (size_t i = 0; i < 160; ++i) {
      auto e = windows.get(i * 37);
      xs.push_back(e.data);
      ys.push_back(e.target);
    }
    x_all = torch::stack(xs);
    y_all = torch::stack(ys);
    opt_raw = std::make_shared<torch::optim::AdamW>(module->parameters(), torch::optim::AdamWOptions(3e-3));
  } else {
    auto mlp = examples::MLP(32, 64, 5);
    module = mlp.ptr();
    loss_fn = [mlp](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return torch::cross_entropy_loss(mlp->forward(x), y);
    };
    examples::TeacherClassification data(640, 32, 5, 3, 4);
    x_all = data.inputs();
    y_all = data.labels();
    opt_raw = std::make_shared<torch::optim::SGD>(module->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  // The last 32 rows are the held-out batch; rank r trains on its own rows of each batch.
  const int64_t n = x_all.size(0) - 32, batch = 16;
  x_eval = x_all.narrow(0, n, 32);
  y_eval = y_all.narrow(0, n, 32);
  acc.prepare_model(module);
  auto opt = acc.prepare(opt_raw);
  auto eval_loss = [&] {
    torch::NoGradGuard no_grad;
    auto ac = acc.autocast();
    auto x = x_eval.to(acc.device());
    if (x.is_floating_point()) x = x.to(acc.precision_policy().param_dtype);
    return acc.reduce(loss_fn(x, y_eval.to(acc.device())).detach()).item<double>();
  };
  const double first = eval_loss();
  const int64_t per_rank = batch / acc.num_processes();
  for (int64_t step = 0; step < a.steps; ++step) {
    const int64_t start = (step * batch) % (n - batch + 1) + acc.process_index() * per_rank;
    // -true modes: floating inputs in the weights' dtype (token ids stay integers).
    auto x = x_all.narrow(0, start, per_rank).to(acc.device());
    if (x.is_floating_point()) x = x.to(acc.precision_policy().param_dtype);
    auto y = y_all.narrow(0, start, per_rank).to(acc.device());
    auto scope = acc.accumulate();  // autocast on for the scope
    auto loss = loss_fn(x, y);
    check(loss.scalar_type() == torch::kFloat || a.precision == "bf16-true",
          "the loss of an autocast region is fp32");
    acc.backward(loss);
    acc.clip_grad_norm_(module->parameters(), 1.0);
    opt.step();
    opt.zero_grad();
  }
  const double last = eval_loss();
  for (auto& p : module->parameters())
    check(p.scalar_type() == (a.precision == "bf16-true" ? torch::kBFloat16 : torch::kFloat),
          "parameter dtype follows the mode");
  check(equal_on_all_ranks(acc, flat_parameters(*module)), "parameters equal on all ranks");
  acc.print(std::setprecision(8), "first loss", first);
  acc.print(std::setprecision(8), "final loss", last);
  std::cout << "train OK " << a.precision << std::endl;
  return failures ? 1 : 0;
}

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app{"precision_worker"};
  Args a;
  app.add_option("mode", a.mode);
  app.add_option("--model", a.model);
  app.add_option("--mixed_precision", a.precision);
  app.add_option("--steps", a.steps);
  app.add_option("--accumulate", a.accum);
  app.add_option("--inject_step", a.inject_step);
  app.add_option("--inject_rank", a.inject_rank);
  app.add_flag("--master_weights", a.master_weights);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  try {
    if (a.mode == "skip") return skip(a);
    if (a.mode == "train") return train(a);
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << std::endl;
    return 1;
  }
  std::cerr << "unknown mode " << a.mode << std::endl;
  return 2;
}

int main(int argc, char** argv) {
  return tandem::testing::main_with_jobs(argc, argv, run_worker);
}
