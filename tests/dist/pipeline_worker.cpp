// A rank of the pipeline tests (started by `tandem launch`). Modes:
//   reference  one process trains the whole model (8 Linear(16, 16) + Tanh pairs, MSE, SGD) for
//              3 steps on the global batch; writes its parameters and losses (raw float32).
//   train      --stages P --dp D on P x D ranks: rank = d * P + s (row-major (dp, pp): pipeline
//              groups {0..P-1}, {P..2P-1}, ..., data-parallel groups {s, P + s, ...}). Trains the
//              same model split into P stages with every configuration in turn (GPipe, 1F1B and
//              zero bubble, and interleaved 1F1B with 2 stages per rank over 2P stages; 1, 2, 4,
//              8 micro-batches), replica d on its 1/D of the global batch; writes each
//              configuration's parameters per model stage and replica (<config>-stage<g>-d<d>)
//              and its losses per rank. Configurations the schedule refuses (fewer micro-batches
//              than stages; interleaved: not a multiple of P) print the error they get.
//   accelerate --pp_size 2 on 4 ranks (with --activation_checkpointing): the Accelerator's mesh
//              (pp outermost: pipeline groups {0,2}, {1,3}, data-parallel groups {0,1}, {2,3}),
//              prepare_pipeline() (1F1B, 4 micro-batches) and a prepared SGD; writes
//              acc-d<replica>-s<stage>.bin and -loss.bin. With PIPELINE_SCHEDULE_FROM_RUN=1 the
//              schedule and virtual stages come from the launcher (--pp_schedule,
//              --pp_virtual_stages): a program asking for 1F1B is refused first, then the main
//              process writes the whole model (get_state_dict) in the model's order to
//              acc-full.bin.
//   gpt        --pp_size 2 --tp_size 2 on 4 ranks (and --pp_schedule, --pp_virtual_stages when
//              given; else 1F1B): the example GPT as a Sequential
//              (examples::gpt_sequential), each stage split over its tp pair by the GPT's plan
//              (prepare_pipeline with a plan; mesh pp outermost: pipeline groups {0,2}, {1,3},
//              tensor-parallel groups {0,1}, {2,3}), 1F1B with 2 micro-batches, the loss
//              vocab-parallel on the last stage, clip_grad_norm_ over the whole model and a
//              prepared SGD, next to the dense model trained in this process: prints "check
//              <name> <relative difference>" for each step's loss and gradient norm and for the
//              parameters, and the first and last losses.
//   die        4 stages, 1F1B, 4 micro-batches; the rank named by PIPELINE_DIE_RANK exits with
//              std::_Exit(3) in its 6th forward (step 1, micro-batch 1).
//   reshape    2 stages, 4 micro-batches: a step on 16 rows, then one on 8; stage 0 must refuse
//              to send activations of another shape than the first step's.
//   p2p        rank 0 and 1 exchange tensors with send/recv (tags out of order, lists, a
//              non-contiguous receiver) and check them.
//   p2p_dead   rank 1 exits (code 0) without sending; rank 0's recv from it must fail.
//   p2p_silent rank 1 sleeps past the timeout, then exits 0; rank 0's recv from it must fail.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include "../../examples/common/gpt.h"
#include "../common/compare_weights.h"
#include "../common/jobs_main.h"
#include "../common/small_gpt.h"
#include "tandem/accelerator.h"
#include "tandem/checkpoint/merge_weights.h"
#include "tandem/comm/process_group.h"
#include "tandem/parallel/activation_checkpoint.h"
#include "tandem/parallel/pipeline.h"
#include "tandem/state.h"

namespace tp = tandem::parallel;

namespace {

constexpr int64_t kWidth = 16, kPairs = 8, kBatch = 16, kSteps = 3;
constexpr double kLr = 0.1;

torch::nn::Sequential make_model() {
  torch::manual_seed(11);
  torch::nn::Sequential model;
  for (int64_t i = 0; i < kPairs; ++i) {
    model->push_back(torch::nn::Linear(kWidth, kWidth));
    model->push_back(torch::nn::Tanh());
  }
  return model;
}

// The global batch of `step`: the same on every rank and in the reference.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t step) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + step));
  auto x = torch::randn({kBatch, kWidth}, gen);
  auto y = torch::randn({kBatch, kWidth}, gen) * 0.5;
  return {x, y};
}

at::Tensor mse(const at::Tensor& y, const at::Tensor& t) { return torch::mse_loss(y, t); }

void write_floats(const std::string& path, const std::vector<torch::Tensor>& tensors) {
  std::ofstream out(path, std::ios::binary);
  for (const auto& t : tensors) {
    auto f = t.detach().to(torch::kFloat).contiguous();
    out.write(static_cast<const char*>(f.data_ptr()), static_cast<std::streamsize>(f.numel() * 4));
  }
}

std::shared_ptr<tandem::ProcessGroup> make_group() {
  auto state = tandem::ProcessState::from_environment();
  const char* t = std::getenv("PIPELINE_TIMEOUT_S");
  return tandem::ProcessGroup::create(
      state, tandem::ProcessGroupOptions().timeout(std::chrono::seconds(t ? std::atoi(t) : 20)));
}

int reference(const std::string& dir) {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
  std::vector<torch::Tensor> losses;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    auto loss = mse(model->forward(x), y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    losses.push_back(loss.detach());
  }
  write_floats(dir + "/reference.bin", model->parameters());
  write_floats(dir + "/reference-loss.bin", losses);
  std::cout << "reference trained" << std::endl;
  return 0;
}

int train(const std::string& dir, int stages, int dp_size) {
  auto world = make_group();
  const int rank = world->rank();
  if (world->size() != stages * dp_size)
    throw std::invalid_argument("train: launch " + std::to_string(stages * dp_size) + " ranks");
  const int d = rank / stages, s = rank % stages;
  // Every rank builds every group, in the same order (ProcessGroup::new_subgroup).
  std::shared_ptr<tandem::ProcessGroup> pp, dp;
  for (int r = 0; r < dp_size; ++r) {
    std::vector<int> ranks;
    for (int k = 0; k < stages; ++k) ranks.push_back(r * stages + k);
    if (auto g = world->new_subgroup(ranks)) pp = g;
  }
  if (dp_size > 1)
    for (int k = 0; k < stages; ++k) {
      std::vector<int> ranks;
      for (int r = 0; r < dp_size; ++r) ranks.push_back(r * stages + k);
      if (auto g = world->new_subgroup(ranks)) dp = g;
    }
  const int64_t rows = kBatch / dp_size;
  for (auto kind : {tp::ScheduleKind::kGPipe, tp::ScheduleKind::k1F1B, tp::ScheduleKind::kZeroBubble,
                    tp::ScheduleKind::kInterleaved1F1B}) {
    const int v = kind == tp::ScheduleKind::kInterleaved1F1B ? 2 : 1;
    for (int m : {1, 2, 4, 8}) {
      const std::string name = tp::to_string(kind) + "-m" + std::to_string(m);
      // This rank's stages s, s + P, ... of P v (looped placement), their modules and forwards.
      torch::nn::Sequential all;
      std::vector<torch::nn::Sequential> chunks;
      std::vector<std::shared_ptr<torch::nn::Module>> modules;
      std::vector<tp::Pipeline::Forward> forwards;
      auto model = make_model();
      for (int c = 0; c < v; ++c) {
        auto chunk = tp::split_sequential(model, stages * v, c * stages + s);
        const auto named = chunk->named_children();
        for (size_t i = 0; i < named.size(); ++i)
          all->push_back(named[i].key(), *(chunk->begin() + static_cast<std::ptrdiff_t>(i)));
        chunks.push_back(chunk);
        modules.push_back(chunk.ptr());
        forwards.push_back([chunk](const at::Tensor& x) mutable { return chunk->forward(x); });
      }
      std::unique_ptr<tp::Pipeline> pipe;
      try {
        pipe = std::make_unique<tp::Pipeline>(all.ptr(), modules, forwards, pp, mse,
                                              tp::PipelineOptions().schedule(kind).microbatches(m), dp);
      } catch (const std::invalid_argument& e) {
        std::cout << "config " << name << " refused: " << e.what() << std::endl;
        continue;
      }
      torch::optim::SGD opt(all->parameters(), torch::optim::SGDOptions(kLr));
      std::vector<torch::Tensor> losses;
      for (int64_t step = 0; step < kSteps; ++step) {
        auto [x, y] = batch(step);
        x = x.narrow(0, d * rows, rows);
        y = y.narrow(0, d * rows, rows);
        const double loss = pipe->step(s == 0 ? x : torch::Tensor(), s == stages - 1 ? y : torch::Tensor());
        opt.step();
        opt.zero_grad();
        losses.push_back(torch::full({1}, loss, torch::kDouble));
      }
      for (int c = 0; c < v; ++c)
        write_floats(dir + "/" + name + "-stage" + std::to_string(c * stages + s) + "-d" +
                         std::to_string(d) + ".bin",
                     chunks[c]->parameters());
      write_floats(dir + "/" + name + "-rank" + std::to_string(rank) + "-loss.bin", losses);
      std::cout << "config " << name << " trained rank " << rank << std::endl;
    }
  }
  return 0;
}

int accelerate(const std::string& dir) {
  tandem::Accelerator acc;
  auto& dpg = acc.data_parallel_group();
  const int d = dpg.rank(), dp_size = dpg.size();
  const bool from_run = std::getenv("PIPELINE_SCHEDULE_FROM_RUN") != nullptr;
  auto options = tp::PipelineOptions().microbatches(4);
  if (from_run) {
    try {  // the launcher's schedule and the program's disagree: refused, naming both
      acc.prepare_pipeline(make_model(), mse, tp::PipelineOptions(options).schedule(tp::ScheduleKind::k1F1B));
      std::cout << "a program's 1F1B against the launcher's schedule was accepted" << std::endl;
    } catch (const std::invalid_argument& e) {
      std::cout << "schedule refused: " << e.what() << std::endl;
    }
  } else {
    options.schedule(tp::ScheduleKind::k1F1B);
  }
  std::shared_ptr<tp::Pipeline> pipe;
  try {
    pipe = acc.prepare_pipeline(make_model(), mse, options);
  } catch (const std::invalid_argument& e) {
    std::cout << "pipeline refused: " << e.what() << std::endl;
    return 3;
  }
  const int s = pipe->stage(), stages = pipe->stages();
  int wrapped = 0;
  for (const auto& child : pipe->module()->children())
    wrapped += std::dynamic_pointer_cast<tp::CheckpointedImpl>(child) != nullptr;
  std::cout << "acc rank " << acc.process_index() << " stage " << s << " of " << stages
            << " replica " << d << " of " << dp_size << " checkpointed " << wrapped
            << " schedule " << tp::to_string(pipe->schedule()) << " virtual stages "
            << pipe->virtual_stages() << std::endl;
  auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(pipe->module()->parameters(),
                                                             torch::optim::SGDOptions(kLr)));
  const int64_t rows = kBatch / dp_size;
  std::vector<torch::Tensor> losses;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    x = x.narrow(0, d * rows, rows);
    y = y.narrow(0, d * rows, rows);
    const double loss = pipe->step(pipe->is_first() ? x : torch::Tensor(),
                                   pipe->is_last() ? y : torch::Tensor());
    opt.step();
    opt.zero_grad();
    losses.push_back(torch::full({1}, loss, torch::kDouble));
  }
  const std::string base = dir + "/acc-d" + std::to_string(d) + "-s" + std::to_string(s);
  write_floats(base + ".bin", pipe->module()->parameters());
  write_floats(base + "-loss.bin", losses);
  if (from_run) {  // the whole model by name, in the model's order
    auto full = acc.get_state_dict(*pipe->module());
    if (acc.is_main_process()) {
      std::map<std::string, torch::Tensor> by_name(full.begin(), full.end());
      std::vector<torch::Tensor> ordered;
      for (const auto& p : make_model()->named_parameters()) ordered.push_back(by_name.at(p.key()));
      write_floats(dir + "/acc-full.bin", ordered);
    }
  }
  std::cout << "acc trained rank " << acc.process_index() << std::endl;
  return 0;
}

int gpt(const std::string& dir) {
  tandem::Accelerator acc;
  const auto* mesh = acc.mesh();
  TORCH_CHECK(mesh && mesh->size("pp") == 2 && mesh->size("tp") == 2,
              "expected a pp 2 x tp 2 mesh (tandem launch --pp_size 2 --tp_size 2)");
  const auto tpg = (*mesh)["tp"];
  const int t = mesh->coordinate("tp"), n = mesh->size("tp");
  const auto c = tandem::testing::small_gpt();
  torch::manual_seed(21);
  auto dense = examples::gpt_sequential(c);
  auto loss_fn = [tpg](const at::Tensor& y, const at::Tensor& target) {
    return examples::gpt_sequential_loss(y, target, tpg);
  };
  {  // An entry that matches no stage's module is refused on every rank, naming it.
    auto plan = examples::gpt_sequential_tensor_parallel_plan();
    plan.rowwise("*.mlp.down");
    try {
      acc.prepare_pipeline(examples::gpt_sequential(c), loss_fn, tp::PipelineOptions(), plan);
      std::cout << "a plan entry matching nothing was accepted" << std::endl;
    } catch (const std::invalid_argument& e) {
      std::cout << "plan refused: " << e.what() << std::endl;
    }
  }
  torch::manual_seed(21);
  auto pipe = acc.prepare_pipeline(examples::gpt_sequential(c), loss_fn,
                                   tp::PipelineOptions().microbatches(2),
                                   examples::gpt_sequential_tensor_parallel_plan());
  int split = 0;
  for (const auto& m : pipe->module()->modules())
    split += std::dynamic_pointer_cast<tp::TensorParallelModule>(m) != nullptr;
  std::cout << "gpt rank " << acc.process_index() << " stage " << pipe->stage() << " tp " << t
            << " split layers " << split << " schedule " << tp::to_string(pipe->schedule())
            << " virtual stages " << pipe->virtual_stages() << std::endl;
  // SGD with momentum (as the tensor-parallel tests: Adam would amplify rounding near zero).
  auto sgd = torch::optim::SGDOptions(0.5).momentum(0.9).weight_decay(0.01);
  torch::optim::SGD dense_opt(dense->parameters(), sgd);
  auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(pipe->module()->parameters(), sgd));
  auto check = [](const std::string& name, double got, double expected) {
    std::printf("check %s %.3g\n", name.c_str(), std::abs(got - expected) / std::abs(expected));
  };
  // One batch, trained on for every step: the loss must fall.
  auto gen = at::detail::createCPUGenerator(7);
  auto ids = torch::randint(c.vocab, {4, c.context + 1}, gen, torch::kLong);
  auto x = ids.slice(1, 0, c.context).contiguous(), y = ids.slice(1, 1).contiguous();
  double first = 0, last = 0;
  for (int step = 0; step < 4; ++step) {
    dense_opt.zero_grad();
    auto dl = examples::gpt_sequential_loss(dense->forward(x), y);
    dl.backward();
    // Binding (the gradients' norm is about 1 here): both sides must agree on the whole norm.
    const double dense_norm = torch::nn::utils::clip_grad_norm_(dense->parameters(), 0.25);
    dense_opt.step();
    const double loss = pipe->step(pipe->is_first() ? x : at::Tensor(), pipe->is_last() ? y : at::Tensor());
    const double norm = acc.clip_grad_norm_(pipe->module()->parameters(), 0.25);
    opt.step();
    opt.zero_grad();
    check("gpt_loss_step" + std::to_string(step), loss, dl.item<double>());
    check("gpt_grad_norm_step" + std::to_string(step), norm, dense_norm);
    if (step == 0) first = loss;
    last = loss;
  }
  std::printf("gpt loss first %.6f last %.6f falling %d\n", first, last, last < first - 0.1);
  auto dense_params = dense->named_parameters();
  double worst = 0;
  for (const auto& p : pipe->module()->named_parameters()) {
    auto expected = tandem::testing::gpt_shard(p.key(), dense_params[p.key()].detach(), t, n);
    const double scale = expected.abs().max().item<double>();
    worst = std::max(worst, (p.value().detach() - expected).abs().max().item<double>() / scale);
  }
  std::printf("check gpt_params %.3g\n", worst);
  std::fflush(stdout);
  // The whole model on the main process (tp shards joined, both stages), under the dense names.
  auto full = acc.get_state_dict(*pipe->module());
  if (acc.is_main_process()) {
    double state_worst = 0;
    bool same = full.size() == dense_params.size();
    for (const auto& [name, t] : full) {
      auto* d = dense_params.find(name);
      if (!d || d->sizes() != t.sizes()) {
        same = false;
        continue;
      }
      state_worst = std::max(state_worst, (t - d->detach()).abs().max().item<double>() /
                                              d->detach().abs().max().item<double>());
    }
    std::printf("state_dict tensors %zu dense %zu names_and_shapes %d relative %.3g\n",
                full.size(), dense_params.size(), same ? 1 : 0, state_worst);
  } else {
    std::printf("state_dict on rank %d: %zu tensors\n", acc.process_index(), full.size());
  }
  std::fflush(stdout);
  // Every stage's tp shards in one checkpoint; merge_weights joins stages and shards into the
  // dense Sequential's weights (same names: stage modules keep their index in the Sequential).
  const std::string ckpt = dir + "/gpt-ckpt";
  acc.save_state(ckpt);
  if (acc.is_main_process()) {
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (const auto& p : dense->named_parameters()) named.emplace_back(p.key(), p.value().detach());
    tandem::checkpoint::save_safetensors(ckpt + ".dense.safetensors", named);
    auto report = tandem::checkpoint::merge_weights(ckpt, ckpt + ".merged");
    std::cout << "merged " << report.tensors << " tensors from " << report.sources << " files"
              << std::endl;
    tandem::testing::print_weight_checks(report.output, ckpt + ".dense.safetensors");
  }
  return 0;
}

int die() {
  auto pg = make_group();
  const int s = pg->rank();
  const char* who = std::getenv("PIPELINE_DIE_RANK");
  const int die_rank = who ? std::atoi(who) : -1;
  auto stage = tp::split_sequential(make_model(), pg->size(), s);
  int forwards = 0;
  tp::Pipeline pipe(
      stage.ptr(),
      [&](const at::Tensor& x) {
        if (s == die_rank && ++forwards == 6) {
          std::cout << "rank " << s << " exits in its forward" << std::endl;
          std::_Exit(3);
        }
        return stage->forward(x);
      },
      pg, mse, tp::PipelineOptions().schedule(tp::ScheduleKind::k1F1B).microbatches(4));
  for (int64_t step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    pipe.step(x, y);
    std::cout << "rank " << s << " finished step " << step << std::endl;
  }
  return 0;
}

int reshape() {
  auto pg = make_group();
  const int s = pg->rank();
  auto stage = tp::split_sequential(make_model(), pg->size(), s);
  tp::Pipeline pipe(stage, pg, mse, tp::PipelineOptions().microbatches(4));
  for (int64_t rows : {16, 8}) {
    auto [x, y] = batch(0);
    pipe.step(x.narrow(0, 0, rows), y.narrow(0, 0, rows));
    std::cout << "rank " << s << " finished a step of " << rows << " rows" << std::endl;
  }
  return 0;
}

int p2p(const std::string& mode) {
  auto pg = make_group();
  const int r = pg->rank();
  if (mode == "p2p") {
    auto a = torch::arange(6, torch::kFloat), b = torch::arange(4, torch::kLong) * 10;
    if (r == 0) {
      // Sent in tag order 0, 1; received in the other order below: tags keep them apart.
      auto w0 = pg->send_async({a}, 1, 0);
      auto w1 = pg->send_async({b, a * 2}, 1, 1);
      w0.wait();
      w1.wait();
      auto back = torch::empty({3, 2});
      pg->recv({back}, 1, 5);
      if (!back.equal(a.view({3, 2}) + 1)) throw std::runtime_error("p2p: wrong reply");
    } else {
      auto got_b = torch::empty({4}, torch::kLong), got_a2 = torch::empty({6});
      auto got_a = torch::empty({6, 2}).select(1, 0);  // not contiguous
      auto w1 = pg->recv_async({got_b, got_a2}, 0, 1);
      auto w0 = pg->recv_async({got_a}, 0, 0);
      w1.wait();
      w0.wait();
      if (!got_a.equal(a) || !got_b.equal(b) || !got_a2.equal(a * 2))
        throw std::runtime_error("p2p: wrong data");
      pg->send({a.view({3, 2}) + 1}, 0, 5);
    }
    std::cout << "rank " << r << " p2p ok" << std::endl;
    return 0;
  }
  if (r == 1) {
    if (mode == "p2p_silent") {
      std::this_thread::sleep_for(std::chrono::seconds(std::atoi(std::getenv("PIPELINE_TIMEOUT_S")) + 2));
    }
    std::cout << "rank 1 leaves without sending" << std::endl;
    std::_Exit(0);
  }
  auto t = torch::empty({8});
  try {
    pg->recv({t}, 1, 3, "recv of the test tensor");
  } catch (const std::exception& e) {
    std::cout << "rank 0 error: " << e.what() << std::endl;
    return 1;
  }
  std::cout << "rank 0 received" << std::endl;
  return 0;
}

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app("pipeline test worker");
  std::string mode = "train", dir = "/tmp";
  int stages = 2, dp = 1;
  app.add_option("mode", mode);
  app.add_option("--out", dir);
  app.add_option("--stages", stages);
  app.add_option("--dp", dp);
  CLI11_PARSE(app, argc, argv);
  if (mode == "reference") return reference(dir);
  if (mode == "train") return train(dir, stages, dp);
  if (mode == "die") return die();
  if (mode == "accelerate") return accelerate(dir);
  if (mode == "gpt") return gpt(dir);
  if (mode == "reshape") return reshape();
  return p2p(mode);
}

int main(int argc, char** argv) {
  return tandem::testing::main_with_jobs(argc, argv, run_worker);
}
