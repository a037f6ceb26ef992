// A rank of the data-parallel tests. Modes:
//   train      train the MLP or the GPT for --steps optimizer steps through the Accelerator and
//              write the final parameters (rank 0) to --out;
//   reference  the same training in ONE process on the same global batches that --ranks ranks
//              would see (their DistributedSampler shards side by side), written to --out;
//   unused     a model with a parameter the loss does not use (with and without
//              find_unused_parameters);
//   tied       the GPT's head stays tied to its embedding and equal on every rank;
//   buffers    BatchNorm buffers equal on every rank after a step;
//   overlap    the first bucket's allreduce starts before backward ends;
//   metrics    gather_for_metrics counts each sample of an uneven data set exactly once, for a
//              map-style loader and a stream loader;
//   compress   fp16 and bf16 compression hooks: the reduced gradient equals the allreduce of
//              every rank's rounded gradients, bit for bit (2 ranks);
//   bucketview gradient_as_bucket_view trains to the same parameters as copying, bit for bit, and
//              the gradients stay views into the buckets.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <fstream>

#include <nlohmann/json.hpp>
#include <iostream>
#include <set>

#include "../../examples/common/gpt.h"
#include "../../examples/common/mlp.h"
#include "../common/small_gpt.h"
#include "tandem/tandem.h"
#include "../common/jobs_main.h"

namespace {

struct Args {
  std::string mode = "train", model = "mlp", out;
  int64_t steps = 6, accum = 1, ranks = 1, samples = 203, batch = 8;
  bool shuffle = true;
};

int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "CHECK FAILED: " << what << std::endl;
    ++failures;
  }
}

// A model and its loss on a batch, identical in both modes.
struct Task {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss;
  // Each tensor once, as PyTorch's parameters() yields them (the GPT's tied head is listed
  // twice by LibTorch's; the Accelerator's prepare keeps it once too).
  std::vector<torch::Tensor> unique_parameters() const {
    std::vector<torch::Tensor> out;
    std::set<const void*> seen;
    for (const auto& p : module->parameters())
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
    return out;
  }
  std::shared_ptr<torch::optim::Optimizer> make_optimizer() const {
    if (dynamic_cast<examples::GPTImpl*>(module.get()))
      return std::make_shared<torch::optim::AdamW>(unique_parameters(),
                                                   torch::optim::AdamWOptions(1e-3));
    return std::make_shared<torch::optim::SGD>(unique_parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  }
};

using tandem::testing::small_gpt;

// The tests' small GPT over bytes, with 2 heads (of width 16): the model these runs were measured
// with.
const auto kByteGpt = tandem::testing::SmallGptOptions().vocab(256).heads(2);

Task make_task(const std::string& name) {
  torch::manual_seed(42);
  Task t;
  if (name == "gpt") {
    auto gpt = examples::GPT(small_gpt(kByteGpt));
    t.module = gpt.ptr();
    t.loss = [gpt](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return gpt->loss_per_sample(x, y).mean();
    };
  } else {
    auto mlp = examples::MLP(32, 64, 5);
    t.module = mlp.ptr();
    t.loss = [mlp](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return torch::cross_entropy_loss(mlp->forward(x), y);
    };
  }
  return t;
}

// The data set of each model: synthetic points for the MLP, this tree's text for the GPT.
struct AnyData : torch::data::datasets::Dataset<AnyData> {
  std::shared_ptr<examples::TeacherClassification> cls;
  std::shared_ptr<examples::ByteWindows> text;
  torch::data::Example<> get(size_t i) override { return cls ? cls->get(i) : text->get(i); }
  torch::optional<size_t> size() const override { return cls ? cls->size() : text->size(); }
};

AnyData make_data(const Args& a) {
  AnyData d;
  if (a.model == "gpt") {
    static std::string text = examples::project_text(TANDEM_SOURCE_DIR);
    const size_t bytes = static_cast<size_t>(a.samples * small_gpt(kByteGpt).context + 1);
    d.text = std::make_shared<examples::ByteWindows>(text, small_gpt(kByteGpt).context, 0,
                                                     std::min(text.size(), bytes));
  } else {
    d.cls = std::make_shared<examples::TeacherClassification>(a.samples, 32, 5, 3, 4);
  }
  return d;
}

void write_parameters(torch::nn::Module& m, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  for (auto& p : m.named_parameters()) {
    auto t = p.value().detach().to(torch::kFloat).contiguous();
    out.write(reinterpret_cast<const char*>(t.data_ptr<float>()),
              static_cast<std::streamsize>(t.numel() * sizeof(float)));
  }
}

int train(const Args& a) {
  tandem::Accelerator acc(tandem::AcceleratorOptions().gradient_accumulation_steps(
      static_cast<int>(a.accum)).bucket_cap_mb(0.05).first_bucket_cap_mb(0.01));
  auto task = make_task(a.model);
  acc.prepare_model(task.module);
  auto opt = acc.prepare(task.make_optimizer());
  auto loader = acc.prepare_data_loader(
      make_data(a), tandem::data::DataLoaderOptions().batch_size(a.batch).shuffle(a.shuffle).seed(11));
  int64_t steps = 0;
  for (int64_t epoch = 0; steps < a.steps; ++epoch) {
    loader->set_epoch(epoch);
    for (auto& b : *loader) {
      auto scope = acc.accumulate();
      acc.backward(task.loss(b.data, b.target));
      opt.step();
      opt.zero_grad();
      if (acc.sync_gradients() && ++steps >= a.steps) break;
    }
  }
  if (acc.is_main_process() && !a.out.empty()) write_parameters(*task.module, a.out);
  // Every rank ends with the same parameters.
  auto flat = torch::cat([&] {
    std::vector<torch::Tensor> v;
    for (auto& p : task.module->parameters()) v.push_back(p.detach().reshape({-1}));
    return v;
  }());
  auto all = acc.gather(flat.unsqueeze(0));
  for (int64_t r = 1; r < all.size(0); ++r) check(all[r].equal(all[0]), "rank parameters differ");
  std::cout << "trained " << steps << " steps on " << acc.num_processes() << " ranks" << std::endl;
  return failures ? 1 : 0;
}

// One process, the global batches of `ranks` ranks: rank r's k-th batch side by side; the loss
// of a micro-step is the mean over ranks of each rank's batch loss (what averaging gradients
// over ranks computes).
int reference(const Args& a) {
  auto task = make_task(a.model);
  auto opt = task.make_optimizer();
  auto data = make_data(a);
  std::vector<std::unique_ptr<tandem::data::DataLoader<AnyData>>> shards;
  for (int64_t r = 0; r < a.ranks; ++r) {
    tandem::data::detail::Placement p;
    p.rank = r;
    p.world = a.ranks;
    shards.push_back(std::make_unique<tandem::data::DataLoader<AnyData>>(
        data, tandem::data::DataLoaderOptions().batch_size(a.batch).shuffle(a.shuffle).seed(11).prefetch(0),
        p, std::make_shared<tandem::data::LoaderState>()));
  }
  int64_t steps = 0;
  for (int64_t epoch = 0; steps < a.steps; ++epoch) {
    std::vector<std::vector<torch::data::Example<>>> per_rank(static_cast<size_t>(a.ranks));
    for (int64_t r = 0; r < a.ranks; ++r) {
      shards[r]->set_epoch(epoch);
      for (auto& b : *shards[r]) per_rank[r].push_back(b);
    }
    const int64_t nb = static_cast<int64_t>(per_rank[0].size());
    int64_t micro = 0;
    for (int64_t k = 0; k < nb; ++k) {
      ++micro;
      bool sync = micro % a.accum == 0 || k == nb - 1;
      if (sync) micro = 0;
      torch::Tensor loss = torch::zeros({});
      for (int64_t r = 0; r < a.ranks; ++r)
        loss = loss + task.loss(per_rank[r][k].data, per_rank[r][k].target);
      loss = loss / static_cast<double>(a.ranks);
      if (a.accum > 1) loss = loss / static_cast<double>(a.accum);
      loss.backward();
      if (sync) {
        opt->step();
        opt->zero_grad();
        if (++steps >= a.steps) break;
      }
    }
  }
  write_parameters(*task.module, a.out);
  std::cout << "reference trained " << steps << " steps for " << a.ranks << " ranks" << std::endl;
  return 0;
}

struct WithUnused : torch::nn::Module {
  WithUnused() {
    used = register_module("used", torch::nn::Linear(4, 2));
    spare = register_module("spare", torch::nn::Linear(4, 2));
  }
  torch::nn::Linear used{nullptr}, spare{nullptr};
};

// One Accelerator (and process group) per process: `find` picks the configuration.
int unused(const Args&, bool find) {
  {
    tandem::Accelerator acc(tandem::AcceleratorOptions().find_unused_parameters(find));
    torch::manual_seed(1);
    auto m = std::make_shared<WithUnused>();
    acc.prepare_model(m);
    auto x = torch::randn({3, 4});
    std::string error;
    try {
      acc.backward(m->used->forward(x).sum());
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!find) {
      check(error.find("spare.weight") != std::string::npos &&
                error.find("spare.bias") != std::string::npos &&
                error.find("find_unused_parameters(true)") != std::string::npos &&
                error.find("used.weight") == std::string::npos,
            "unused-parameter error names the parameters and the option: " + error);
    } else {
      check(error.empty(), "find_unused_parameters: backward succeeds: " + error);
      check(!m->spare->weight.grad().defined(), "a parameter no rank used keeps no gradient");
      check(m->used->weight.grad().defined(), "used parameters get gradients");
      // The gradient is the average over ranks of x^T 1 with each rank's x.
      auto local = x.sum(0).unsqueeze(0).expand({2, 4});
      auto expected = acc.reduce(local, tandem::ReduceOp::kMean);
      check(torch::allclose(m->used->weight.grad(), expected, 1e-6, 1e-6), "used gradient averaged");
    }
  }
  std::cout << "unused OK" << std::endl;
  return failures ? 1 : 0;
}

int tied(const Args& a) {
  Args b = a;
  b.model = "gpt";
  tandem::Accelerator acc;
  auto task = make_task("gpt");
  auto* gpt = dynamic_cast<examples::GPTImpl*>(task.module.get());
  acc.prepare_model(task.module);
  check(acc.reducers().empty() || acc.reducers()[0]->parameter_names().size() ==
                                      task.module->parameters().size() - 1,
        "the tied weight is reduced once");
  auto opt = acc.prepare(task.make_optimizer());
  auto loader = acc.prepare_data_loader(make_data(b), tandem::data::DataLoaderOptions().batch_size(4).shuffle(true));
  int steps = 0;
  for (auto& batch : *loader) {
    acc.backward(task.loss(batch.data, batch.target));
    opt.step();
    opt.zero_grad();
    if (++steps == 4) break;
  }
  check(gpt->head->weight.unsafeGetTensorImpl() == gpt->wte->weight.unsafeGetTensorImpl(),
        "head and embedding are still one tensor");
  auto all = acc.gather(gpt->wte->weight.detach().reshape({1, -1}));
  for (int64_t r = 1; r < all.size(0); ++r) check(all[r].equal(all[0]), "tied weight equal on all ranks");
  std::cout << "tied OK" << std::endl;
  return failures ? 1 : 0;
}

int buffers(const Args&) {
  tandem::Accelerator acc;
  torch::manual_seed(3);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
  acc.prepare(net);
  auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
  torch::manual_seed(100 + acc.process_index());  // different data on every rank
  auto x = torch::randn({8, 4}) * (acc.process_index() + 1);
  acc.backward(net->forward(x).pow(2).mean());
  opt.step();
  for (auto& b : net->named_buffers()) {
    auto all = acc.gather(b.value().detach().reshape({1, -1}).to(torch::kDouble));
    for (int64_t r = 1; r < all.size(0); ++r)
      check(all[r].equal(all[0]), "buffer " + b.key() + " equal on all ranks");
  }
  std::cout << "buffers OK" << std::endl;
  return failures ? 1 : 0;
}

int overlap(const Args&) {
  tandem::Accelerator acc;
  torch::manual_seed(5);
  auto mlp = examples::MLP(784, 512, 10);
  acc.prepare(mlp);
  auto x = torch::randn({64, 784});
  auto y = torch::randint(10, {64});
  acc.backward(torch::cross_entropy_loss(mlp->forward(x), y));
  auto& r = *acc.reducers().at(0);
  auto t = r.last_timeline();
  check(r.buckets().size() >= 2, "the MLP's gradients span several buckets");
  check(t.bucket_started[0] < t.backward_ended, "first bucket's allreduce started before backward ended");
  check(t.bucket_started.back() <= t.backward_ended, "every bucket launched by the end of backward");
  std::cout << "overlap OK: " << r.buckets().size() << " buckets, first launched "
            << std::chrono::duration<double, std::micro>(t.backward_ended - t.bucket_started[0]).count()
            << " us before backward ended" << std::endl;
  return failures ? 1 : 0;
}

int metrics(const Args&) {
  struct Ids : torch::data::datasets::Dataset<Ids> {
    torch::data::Example<> get(size_t i) override {
      return {torch::tensor(static_cast<int64_t>(i)), torch::tensor(0)};
    }
    torch::optional<size_t> size() const override { return 23; }
  };
  tandem::Accelerator acc;
  auto loader = acc.prepare_data_loader(Ids(), tandem::data::DataLoaderOptions().batch_size(4).shuffle(true));
  std::vector<int64_t> seen;
  for (auto& b : *loader) {
    auto g = acc.gather_for_metrics(b.data);
    for (int64_t k = 0; k < g.size(0); ++k) seen.push_back(g[k].item<int64_t>());
  }
  std::multiset<int64_t> counts(seen.begin(), seen.end());
  check(seen.size() == 23, "23 samples gathered, got " + std::to_string(seen.size()));
  for (int64_t i = 0; i < 23; ++i) check(counts.count(i) == 1, "sample " + std::to_string(i) + " once");
  // Streams: 17 examples.
  auto make = [] {
    auto i = std::make_shared<int64_t>(0);
    return std::function<std::optional<torch::Tensor>()>([i]() -> std::optional<torch::Tensor> {
      if (*i >= 17) return std::nullopt;
      return torch::tensor((*i)++);
    });
  };
  auto stream = acc.prepare_stream_loader<torch::Tensor>(make, tandem::data::DataLoaderOptions().batch_size(3));
  std::multiset<int64_t> s;
  int batches = 0;
  for (auto& b : *stream) {
    ++batches;
    auto g = acc.gather_for_metrics(b);
    for (int64_t k = 0; k < g.size(0); ++k) s.insert(g[k].item<int64_t>());
  }
  check(s.size() == 17, "stream: 17 samples gathered, got " + std::to_string(s.size()));
  for (int64_t i = 0; i < 17; ++i) check(s.count(i) == 1, "stream sample " + std::to_string(i) + " once");
  auto all_batches = acc.gather(torch::tensor({static_cast<int64_t>(batches)}));
  check(all_batches.min().item<int64_t>() == all_batches.max().item<int64_t>(),
        "every rank read the same number of stream batches");
  std::cout << "metrics OK" << std::endl;
  return failures ? 1 : 0;
}

// The timeline shows every bucket's allreduce, and the first starts inside backward; the trackers
// write once, from the main process.
int tracking(const Args& a) {
  const std::string dir = a.out;
  {
    tandem::Accelerator acc(tandem::AcceleratorOptions().timeline_dir(dir + "/timeline").project_dir(dir));
    acc.init_trackers("run", {{"lr", 0.05}, {"model", std::string("mlp")}});
    torch::manual_seed(5);
    auto mlp = examples::MLP(784, 512, 10);
    acc.prepare(mlp);
    auto opt = acc.prepare(std::make_shared<torch::optim::SGD>(mlp->parameters(), 0.01));
    examples::TeacherClassification data(64);
    auto loader = acc.prepare_data_loader(data, tandem::data::DataLoaderOptions().batch_size(8));
    int64_t step = 0;
    for (auto& b : *loader) {
      auto loss = torch::cross_entropy_loss(mlp->forward(b.data), b.target);
      acc.backward(loss);
      opt.step();
      opt.zero_grad();
      acc.log({{"loss", acc.reduce(loss.detach()).item<double>()}}, ++step);
    }
    acc.end_training();
    acc.wait_for_everyone();
  }
  auto rank = tandem::ProcessState::from_environment().rank;
  std::ifstream f(dir + "/timeline/timeline_rank" + std::to_string(rank) + ".json");
  check(static_cast<bool>(f), "timeline file written");
  auto doc = nlohmann::json::parse(f);
  double first_allreduce = -1, backward_end = -1;
  int allreduces = 0, backwards = 0;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("ph", "") != "X") continue;
    std::string name = e["name"];
    if (name.rfind("allreduce bucket", 0) == 0) {
      ++allreduces;
      if (first_allreduce < 0) first_allreduce = e["ts"].get<double>();
    }
    if (name == "backward") {
      ++backwards;
      if (backward_end < 0) backward_end = e["ts"].get<double>() + e["dur"].get<double>();
    }
  }
  check(backwards >= 1 && allreduces >= 2 * backwards, "allreduce spans recorded for every backward");
  check(first_allreduce >= 0 && first_allreduce < backward_end, "first allreduce inside backward");
  if (rank == 0) {
    std::ifstream jl(dir + "/logs/run/metrics.jsonl");
    int lines = 0;
    for (std::string l; std::getline(jl, l);) ++lines;
    check(lines == 4, "one JSONL record per logged step (4 steps), got " + std::to_string(lines));
  }
  std::cout << "tracking OK" << std::endl;
  return failures ? 1 : 0;
}

// Note [Compression hooks]: with 2 ranks the reduction is one addition per element, so the
// expectation can be computed exactly: each rank's gradient divided by 2 and rounded to the
// compressed dtype, the two summed (in fp32, which holds the sum of two halves exactly) and, when
// the sum travels in the compressed dtype, rounded once more.
int compress(const Args&) {
  for (const std::string hook : {"fp16", "bf16"}) {
    tandem::Accelerator acc(tandem::AcceleratorOptions().comm_hook(hook));
    check(acc.num_processes() == 2, "compress runs on 2 ranks");
    torch::manual_seed(9);
    auto model = examples::MLP(32, 64, 5);
    auto local = examples::MLP(32, 64, 5);  // never reduced
    acc.prepare(model);
    {
      torch::NoGradGuard g;  // the same weights as the prepared model
      for (size_t i = 0; i < model->parameters().size(); ++i)
        local->parameters()[i].copy_(model->parameters()[i]);
    }
    torch::manual_seed(200 + acc.process_index());
    auto x = torch::randn({16, 32}) * 3;
    auto y = torch::randint(5, {16});
    acc.backward(torch::cross_entropy_loss(model->forward(x), y));
    torch::cross_entropy_loss(local->forward(x), y).backward();
    const auto dtype = hook == "fp16" ? torch::kHalf : torch::kBFloat16;
    const auto wire = tandem::parallel::compress_hook_wire_dtype(dtype, c10::DeviceType::CPU);
    auto params = model->parameters(), mine = local->parameters();
    bool rounded_somewhere = false;
    for (size_t i = 0; i < params.size(); ++i) {
      auto all = acc.gather(mine[i].grad().unsqueeze(0));  // [2, ...] every rank's local gradient
      auto a = (all[0] / 2.0).to(dtype).to(torch::kFloat), b = (all[1] / 2.0).to(dtype).to(torch::kFloat);
      auto expected = a + b;
      if (wire == dtype) expected = expected.to(dtype).to(torch::kFloat);
      check(params[i].grad().equal(expected),
            hook + ": parameter " + std::to_string(i) + " equals the sum of the rounded gradients");
      rounded_somewhere = rounded_somewhere || !expected.equal(all.mean(0));
    }
    check(rounded_somewhere, hook + ": compression changed the gradients (the hook ran)");
    check(acc.reducers().at(0)->comm_hook().name() == hook, hook + ": the reducer uses the hook");
    std::cout << hook << " compression travels as " << c10::toString(wire) << std::endl;
  }
  std::cout << "compress OK" << std::endl;
  return failures ? 1 : 0;
}

// Two copies of one model reduced over the same group, one with gradients as bucket views and one
// copying them in and out: the same steps give the same parameters, bit for bit, and the views'
// storage never moves.
int bucketview(const Args&) {
  auto state = tandem::ProcessState::from_environment();
  auto pg = tandem::ProcessGroup::create(state);
  torch::manual_seed(4);
  auto a = examples::MLP(32, 64, 5), b = examples::MLP(32, 64, 5);
  tandem::parallel::broadcast_module_state(*a, *pg, true, true);
  tandem::parallel::broadcast_module_state(*b, *pg, true, true);
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  tandem::parallel::GradientReducer ra(a->named_parameters().pairs(), pg,
                                       tandem::parallel::ReducerOptions()
                                           .bucket_cap_mb(0.01)
                                           .first_bucket_cap_mb(0.005)
                                           .gradient_as_bucket_view(true));
  tandem::parallel::GradientReducer rb(b->named_parameters().pairs(), pg,
                                       tandem::parallel::ReducerOptions()
                                           .bucket_cap_mb(0.01)
                                           .first_bucket_cap_mb(0.005));
  torch::optim::SGD oa(a->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ob(b->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<const void*> storage;
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(300 + 10 * step + pg->rank());
    auto x = torch::randn({8, 32});
    auto y = torch::randint(5, {8});
    torch::cross_entropy_loss(a->forward(x), y).backward();
    ra.after_backward();
    torch::cross_entropy_loss(b->forward(x), y).backward();
    rb.after_backward();
    std::vector<const void*> now;
    for (auto& p : a->parameters()) now.push_back(p.grad().data_ptr());
    if (step == 0) storage = now;
    check(now == storage, "step " + std::to_string(step) + ": gradients stay in the buckets");
    oa.step();
    ob.step();
    oa.zero_grad();
    ob.zero_grad();
  }
  for (size_t i = 0; i < a->parameters().size(); ++i) {
    check(ra.gradient_is_bucket_view(i), "parameter " + std::to_string(i) + " is a bucket view");
    check(a->parameters()[i].equal(b->parameters()[i]),
          "parameter " + std::to_string(i) + " equal with and without bucket views");
  }
  std::cout << "bucketview OK" << std::endl;
  return failures ? 1 : 0;
}

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app{"ddp_worker"};
  Args a;
  app.add_option("mode", a.mode);
  app.add_option("--model", a.model);
  app.add_option("--out", a.out);
  app.add_option("--steps", a.steps);
  app.add_option("--accumulate", a.accum);
  app.add_option("--ranks", a.ranks, "reference: ranks to imitate");
  app.add_option("--samples", a.samples);
  app.add_option("--batch", a.batch);
  app.add_option("--shuffle", a.shuffle);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  try {
    if (a.mode == "train") return train(a);
    if (a.mode == "reference") return reference(a);
    if (a.mode == "unused") return unused(a, false);
    if (a.mode == "unused-find") return unused(a, true);
    if (a.mode == "tied") return tied(a);
    if (a.mode == "buffers") return buffers(a);
    if (a.mode == "overlap") return overlap(a);
    if (a.mode == "metrics") return metrics(a);
    if (a.mode == "tracking") return tracking(a);
    if (a.mode == "compress") return compress(a);
    if (a.mode == "bucketview") return bucketview(a);
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << std::endl;
    return 1;
  }
  std::cerr << "unknown mode " << a.mode << std::endl;
  return 2;
}

int main(int argc, char** argv) { return tandem::testing::main_with_jobs(argc, argv, run_worker); }
