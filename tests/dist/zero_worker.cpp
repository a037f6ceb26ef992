// A rank of the sharding tests (started by `tandem launch`, whose flags choose the strategy:
// --use_deepspeed --zero_stage N, or none for data parallel). Modes:
//   train     trains a small model of awkward shapes (a 7x15 layer, a bias of 3, a layer called
//             twice in one forward, a module no loss uses, a weight tied to another) with AdamW
//             in three parameter groups, gradient accumulation and clipping, on global batches
//             that depend only on the step (so any number of ranks sees the same data); saves
//             the training state after --save_at steps into --save_dir; resumes from --resume;
//             rank 0 writes the final parameters (raw float32) to --out.
//   mismatch  rank 1 builds its model with two layers swapped: every rank must fail at prepare
//             with an error naming both layouts.
//   memory    the memory-test model (~24M parameters) trained a few steps under a counting
//             allocator; prints "peak_bytes=<n> model_state_bytes=<n>" per rank.
//   build     the example GPT made by acc.build (--built) or directly, loaded (--resume), trained
//             3 steps, saved (--save_dir); the parameters after prepare and at the end to --out,
//             and each rank's resident memory growth over construction and prepare; with
//             --net, the bytes this machine's network interfaces (all but lo) sent during the
//             3 steps, printed by each machine's first rank.
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <iostream>

#include "../common/jobs_main.h"
#include "../../examples/common/gpt.h"
#include "tandem/checkpoint/model_io.h"
#include "tandem/tandem.h"
#include "tandem/track/memory_estimate.h"

namespace {

struct Args {
  std::string mode = "train", out, save_dir, resume, timeline_dir;
  int64_t steps = 10, accum = 2, save_at = -1;
  double clip = 0.05;
  bool one_group = false, master_weights = false, loss_scaling = false, built = false, net = false;
  int64_t global_batch = 12;
  int64_t gpt_layers = 16;  // build: the example GPT's blocks
};

// Every layer is a Sharded unit (a plain pass-through under the other strategies): at stage 3,
// b runs twice in one forward, `unused` never runs, and c's weight is tied to head_weight, so it
// belongs to the root unit while c's bias stays in c's unit.
struct NetImpl : torch::nn::Module {
  using Sharded = tandem::parallel::Sharded;
  explicit NetImpl(bool swapped = false) {
    if (swapped) {
      b = register_module("b", Sharded(torch::nn::Linear(7, 7)));
      a = register_module("a", Sharded(torch::nn::Linear(15, 7)));
    } else {
      a = register_module("a", Sharded(torch::nn::Linear(15, 7)));
      b = register_module("b", Sharded(torch::nn::Linear(7, 7)));
    }
    auto c_linear = torch::nn::Linear(7, 3);
    c = register_module("c", Sharded(c_linear));
    unused = register_module("unused", Sharded(torch::nn::Linear(3, 2)));
    // Tied: the same tensor under a second name (as a language model's head and embedding).
    head = register_parameter("head_weight", c_linear->weight);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(a->forward(x));
    h = torch::tanh(b->forward(h));
    h = b->forward(h);  // the same unit twice in one forward
    return c->forward(h) + 0.5 * torch::nn::functional::linear(h, head);
  }
  Sharded a{nullptr}, b{nullptr}, c{nullptr}, unused{nullptr};
  torch::Tensor head;
};
TORCH_MODULE(Net);

// The global batch of micro-step `micro` of step `step`, and this rank's rows of it.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int64_t micro, int64_t rows, int rank,
                                              int world) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + micro + 1));
  auto x = torch::randn({rows, 15}, gen);
  auto y = torch::randn({rows, 3}, gen);
  const int64_t per = rows / world;
  return {x.narrow(0, rank * per, per), y.narrow(0, rank * per, per)};
}

std::shared_ptr<torch::optim::AdamW> make_optimizer(Net& net, bool one_group) {
  if (one_group) {
    std::vector<torch::Tensor> all;
    for (auto& kv : net->named_parameters())
      if (kv.key() != "head_weight") all.push_back(kv.value());  // tied to c.weight: once
    return std::make_shared<torch::optim::AdamW>(all,
                                                 torch::optim::AdamWOptions(1e-2).weight_decay(0.0));
  }
  // Three groups: decayed weights, biases without decay, and the unused module alone (so that
  // no unit mixes it with used parameters).
  std::vector<torch::Tensor> weights, biases, unused;
  for (auto& kv : net->named_parameters()) {
    if (kv.key().rfind("unused.", 0) == 0)
      unused.push_back(kv.value());
    else if (kv.key().find("bias") != std::string::npos)
      biases.push_back(kv.value());
    else if (kv.key() != "head_weight")  // tied to c.weight: listed once
      weights.push_back(kv.value());
  }
  auto opts = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(opts));
  groups.emplace_back(biases,
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(1e-2).weight_decay(0.0)));
  groups.emplace_back(unused, std::make_unique<torch::optim::AdamWOptions>(opts));
  return std::make_shared<torch::optim::AdamW>(std::move(groups), opts);
}

tandem::AcceleratorOptions options(const Args& a) {
  // Small buckets: several units, some holding several parameters.
  return tandem::AcceleratorOptions()
      .timeline_dir(a.timeline_dir)
      .gradient_accumulation_steps(static_cast<int>(a.accum))
      .bucket_cap_mb(300.0 / (1 << 20))
      .first_bucket_cap_mb(100.0 / (1 << 20))
      .find_unused_parameters(true)
      .master_weights(a.master_weights ? std::optional<bool>(true) : std::nullopt)
      .loss_scaling(a.loss_scaling ? std::optional<bool>(true) : std::nullopt);
}

void write_parameters(torch::nn::Module& model, const std::string& path);

// Bytes sent by this network namespace's interfaces but the loopback.
int64_t interface_tx_bytes() {
  int64_t total = 0;
  for (const auto& dev : std::filesystem::directory_iterator("/sys/class/net")) {
    if (dev.path().filename() == "lo") continue;
    std::ifstream in(dev.path() / "statistics" / "tx_bytes");
    int64_t v = 0;
    if (in >> v) total += v;
  }
  return total;
}

int train(const Args& a) {
  tandem::Accelerator acc(options(a));
  torch::manual_seed(7);
  // --built: sharded while it is built (Note [Sharded construction]): the Sharded wrappers,
  // the tied weight and the three groups make prepare gather built units to cut its own.
  Net net = a.built ? acc.build([] { return Net(); }) : Net();
  auto [model, opt] = acc.prepare(net, make_optimizer(net, a.one_group));
  if (!a.resume.empty()) acc.load_state(a.resume);
  if (std::getenv("ZW_DEBUG") && acc.is_main_process())
    for (const auto* r : acc.reducers()) {
      for (const auto& b : r->buckets()) {
        std::cout << "bucket:";
        for (auto i : b) std::cout << " " << r->parameter_names()[i];
        std::cout << std::endl;
      }
    }
  const int rank = acc.process_index(), world = acc.num_processes();
  TORCH_CHECK(a.global_batch % world == 0, "the global batch must split evenly");
  for (int64_t step = acc.step(); step < a.steps; ++step) {
    for (int64_t m = 0; m < a.accum; ++m) {
      auto scope = acc.accumulate();
      auto [x, y] = batch(step, m, a.global_batch, rank, world);
      x = x.to(acc.precision_policy().param_dtype);  // the -true modes' half weights
      auto loss = torch::mse_loss(model->forward(x).to(torch::kFloat), y);
      acc.backward(loss);
      if (a.clip > 0) acc.clip_grad_norm_(model->parameters(), a.clip);
      opt.step();
      opt.zero_grad();
    }
    if (step + 1 == a.save_at) acc.save_state(a.save_dir);
  }
  std::cout << "rank " << rank << " strategy " << acc.strategy().name() << " trained to step "
            << acc.step() << std::endl;
  if (!a.timeline_dir.empty()) {
    // Note [Prefetching units]: the all-gathers this rank's timeline shows, those issued ahead
    // of use, and those of them that ran while a forward or backward computed.
    acc.end_training();
    std::ifstream f(a.timeline_dir + "/timeline_rank" + std::to_string(rank) + ".json");
    TORCH_CHECK(static_cast<bool>(f), "no timeline in ", a.timeline_dir);
    auto doc = nlohmann::json::parse(f);
    std::vector<std::pair<double, double>> compute;
    int64_t gathers = 0, prefetched = 0, overlapped = 0, waits = 0;
    double gather_us = 0, wait_us = 0;
    for (const auto& e : doc["traceEvents"])
      if (e.value("ph", "") == "X" && (e["name"] == "forward" || e["name"] == "backward"))
        compute.emplace_back(e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>());
    for (const auto& e : doc["traceEvents"]) {
      if (e.value("ph", "") != "X") continue;
      const std::string name = e["name"];
      if (name == "wait for all-gather") {
        ++waits;
        wait_us += e["dur"].get<double>();
      }
      if (name.rfind("all-gather unit", 0) != 0) continue;
      ++gathers;
      gather_us += e["dur"].get<double>();
      if (name.find("(prefetched)") == std::string::npos) continue;
      ++prefetched;
      const double start = e["ts"].get<double>();
      for (const auto& [b, end] : compute)
        if (start >= b && start < end) {
          ++overlapped;
          break;
        }
    }
    std::cout << "gathers rank=" << rank << " all=" << gathers << " prefetched=" << prefetched
              << " overlapped=" << overlapped << " waits=" << waits
              << " gather_ms=" << gather_us / 1000 << " wait_ms=" << wait_us / 1000 << std::endl;
  }
  auto state = acc.get_state_dict(*model);  // every rank: ZeRO-3 gathers
  if (acc.is_main_process() && !a.out.empty()) {
    std::ofstream out(a.out, std::ios::binary);
    for (auto& kv : model->named_parameters())
      for (auto& [name, t] : state)
        if (name == kv.key()) {
          auto f = t.to(torch::kFloat).contiguous();
          out.write(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(float));
        }
  }
  return 0;
}

// The memory test's model: 24 layers of 1024 x 1024 (25.2M parameters), AdamW, buckets of 8 MiB.
// Peak CPU tensor bytes over two steps after the first (Adam's state exists by then), beside the
// library's model of the strategy (Note [One memory model] in tandem/track/memory_estimate.h,
// docs/sharding.md): the states each stage keeps and its transients (buckets, receive buffers,
// gathered units).
int memory(const Args&) {
  tandem::track::install_counting_cpu_allocator();
  // ZW_WIDTH, ZW_LAYERS, ZW_BUCKET_MB: another shape of the same model, to measure by hand.
  auto knob = [](const char* name, double fallback) {
    const char* v = std::getenv(name);
    return v ? std::stod(v) : fallback;
  };
  const double bucket_mb = knob("ZW_BUCKET_MB", 8);
  tandem::Accelerator acc(tandem::AcceleratorOptions().bucket_cap_mb(bucket_mb).first_bucket_cap_mb(bucket_mb));
  // The library's baseline: the process's resident memory before any tensor (LibTorch, Gloo),
  // and of it the pages that map files (the libraries' code run so far).
  const auto baseline = tandem::track::resident_memory();
  const int64_t baseline_kb = baseline.current_bytes / 1024;
  torch::manual_seed(1);
  const int64_t width = static_cast<int64_t>(knob("ZW_WIDTH", 1024)),
                layers = static_cast<int64_t>(knob("ZW_LAYERS", 24)), rows = 16;
  torch::nn::Sequential net;
  for (int64_t l = 0; l < layers; ++l) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::ReLU());
  }
  auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::AdamW>(
                                           net->parameters(), torch::optim::AdamWOptions(1e-4)));
  int64_t n = 0, largest = 0;
  for (auto& p : model->parameters()) {
    n += p.numel();
    largest = std::max<int64_t>(largest, p.numel());
  }
  const int world = acc.num_processes();
  const bool debug = std::getenv("ZW_DEBUG") != nullptr;
  auto phase = [&](const char* what) {
    if (!debug || acc.process_index() != 0) return;
    auto st = tandem::track::cpu_memory_stats();
    std::cout << what << ": current " << st.current_bytes / 1e6 << " MB, peak " << st.peak_bytes / 1e6
              << " MB" << std::endl;
    tandem::track::reset_peak_cpu_memory();
  };
  auto step = [&, &model = model, &opt = opt](int64_t i) {
    auto scope = acc.accumulate();
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(i + 1));
    auto x = torch::randn({rows, width}, gen);
    auto loss = model->forward(x).pow(2).mean();
    phase("forward");
    acc.backward(loss);
    phase("backward");
    opt.step();
    phase("step");
    opt.zero_grad();
    phase("zero_grad");
  };
  step(0);
  tandem::track::reset_peak_cpu_memory();
  step(1);
  step(2);
  const auto stats = tandem::track::cpu_memory_stats();
  const std::string name = acc.strategy().name();
  // B: the largest bucket's bytes (a bucket closes at the first parameter that reaches the cap).
  int64_t bucket_bytes = 0;
  for (const auto* r : acc.reducers())
    for (size_t b = 0; b < r->buckets().size(); ++b)
      bucket_bytes = std::max<int64_t>(bucket_bytes, r->bucket_numel(b) * 4);
  // Note [One memory model]: the library's terms, with this run's P, W, B (the largest bucket),
  // G = U = the largest parameter (a Linear's weight; each Linear is a unit at stage 3).
  const int stage = name == "ddp" ? 0 : name.back() - '0';
  const int64_t formula = static_cast<int64_t>(
      tandem::track::strategy_memory(stage, static_cast<double>(n), world,
                                     static_cast<double>(bucket_bytes),
                                     static_cast<double>(largest), static_cast<double>(largest))
          .total());
  // Activations: each layer keeps its input and its ReLU output for backward.
  const int64_t activations = 2 * layers * rows * width * 4;
  // Resident memory over the whole run, the model's construction and prepare included (VmHWM),
  // above the baseline; the host allocator's cache of freed blocks is part of it. lib_pages_kb:
  // the libraries' pages first run after the baseline (RssFile's growth: the kernels of the
  // optimizer, Gloo's collectives), part of the library's baseline rather than of the strategy.
  const auto end = tandem::track::resident_memory();
  std::cout << "memory rank=" << acc.process_index() << " strategy=" << name << " world=" << world
            << " N=" << n << " peak_bytes=" << stats.peak_bytes << " formula_bytes=" << formula
            << " activation_bytes=" << activations << " rss_peak_kb=" << end.peak_bytes / 1024
            << " rss_baseline_kb=" << baseline_kb
            << " lib_pages_kb=" << (end.file_bytes - baseline.file_bytes) / 1024
            << " host_cache_bytes=" << (acc.run_config().host_allocator
                                            ? static_cast<int64_t>(acc.run_config().host_cache_mb * (1 << 20))
                                            : -1)
            << std::endl;
  return 0;
}

// The example GPT (--layers blocks of width 192; 16: 7.2M parameters), built by acc.build (--built) or
// directly, prepared with AdamW and trained 3 steps. Rank 0 writes the whole parameters
// (get_state_dict, raw float32 in name order) after prepare and after the steps to --out; with
// --resume a safetensors file to load (acc.load_model) before training. Every rank prints
// "build rank=r built=b dense_bytes=D rss_growth_kb=K": K, the peak resident memory after
// prepare above the resident memory before the model was made.
int build(const Args& a) {
  tandem::Accelerator acc;
  examples::GPTConfig c;
  c.vocab = 256;
  c.context = 16;
  c.layers = a.gpt_layers;
  c.heads = 4;
  c.width = 192;
  {
    // The library's baseline includes what Gloo keeps after its first large broadcast.
    auto warm = torch::zeros({1 << 20});
    acc.data_parallel_group().broadcast(warm, 0);
  }
  const int64_t before_kb = (tandem::track::resident_memory().current_bytes / 1024);
  torch::manual_seed(11);
  auto gpt = a.built ? acc.build([&] { return examples::GPT(c); }) : examples::GPT(c);
  gpt = acc.prepare(gpt);
  if (!a.resume.empty()) acc.load_model(*gpt, a.resume);
  auto opt = acc.prepare(std::make_shared<torch::optim::AdamW>(
      gpt->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01)));
  const int64_t growth_kb = (tandem::track::resident_memory().peak_bytes / 1024) - before_kb;
  std::ofstream out;
  if (acc.is_main_process() && !a.out.empty()) out.open(a.out, std::ios::binary);
  auto dump = [&] {
    auto state = acc.get_state_dict(*gpt);  // every rank: ZeRO-3 gathers
    for (auto& [name, t] : state) {
      auto f = t.to(torch::kFloat).contiguous();
      if (out) out.write(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(float));
    }
  };
  dump();
  acc.wait_for_everyone();
  const int64_t tx_before = a.net ? interface_tx_bytes() : 0;
  for (int64_t step = 0; step < 3; ++step) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 * step + acc.process_index() + 1));
    auto x = torch::randint(0, c.vocab, {2, c.context}, gen);
    auto y = torch::randint(0, c.vocab, {2, c.context}, gen);
    acc.backward(gpt->loss_per_sample(x, y).mean());
    opt.step();
    opt.zero_grad();
  }
  acc.wait_for_everyone();
  if (a.net && acc.local_process_index() == 0)
    std::cout << "net rank=" << acc.process_index() << " tx_bytes=" << interface_tx_bytes() - tx_before
              << " dense_bytes=" << examples::gpt_parameter_count(c, true) * 4 << std::endl;
  dump();
  if (!a.save_dir.empty()) acc.save_model(*gpt, a.save_dir);
  std::cout << "build rank=" << acc.process_index() << " built=" << a.built
            << " host_allocator=" << acc.run_config().host_allocator
            << " dense_bytes=" << examples::gpt_parameter_count(c, true) * 4
            << " rss_growth_kb=" << growth_kb << std::endl;
  return 0;
}

void write_parameters(torch::nn::Module& model, const std::string& path) {
  std::ofstream out(path, std::ios::binary);
  for (auto& kv : model.named_parameters()) {
    auto t = kv.value().detach().to(torch::kFloat).contiguous();
    out.write(static_cast<const char*>(t.data_ptr()), t.numel() * sizeof(float));
  }
}

// The dense model loaded from a merged file (--resume), its parameters written to --out.
int load(const Args& a) {
  Net net;
  tandem::checkpoint::load_model(*net, a.resume);
  write_parameters(*net, a.out);
  std::cout << "loaded " << a.resume << std::endl;
  return 0;
}

int mismatch(const Args& a) {
  tandem::Accelerator acc(options(a));
  torch::manual_seed(7);
  Net net(acc.process_index() == 1);
  auto [model, opt] = acc.prepare(net, make_optimizer(net, a.one_group));
  std::cout << "rank " << acc.process_index() << " prepared a mismatched model" << std::endl;
  return 0;
}

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app("zero_worker");
  Args a;
  app.add_option("mode", a.mode);
  app.add_option("--out", a.out);
  app.add_option("--steps", a.steps);
  app.add_option("--accumulate", a.accum);
  app.add_option("--clip", a.clip);
  app.add_option("--save_at", a.save_at);
  app.add_option("--save_dir", a.save_dir);
  app.add_option("--resume", a.resume);
  app.add_flag("--one_group", a.one_group);
  app.add_flag("--master_weights", a.master_weights);
  app.add_flag("--loss_scaling", a.loss_scaling);
  app.add_flag("--built", a.built);
  app.add_flag("--net", a.net);
  app.add_option("--layers", a.gpt_layers, "build: the example GPT's blocks");
  app.add_option("--timeline_dir", a.timeline_dir);
  CLI11_PARSE(app, argc, argv);
  try {
    if (a.mode == "train") return train(a);
    if (a.mode == "mismatch") return mismatch(a);
    if (a.mode == "memory") return memory(a);
    if (a.mode == "load") return load(a);
    if (a.mode == "build") return build(a);
    std::cerr << "unknown mode " << a.mode << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

int main(int argc, char** argv) { return tandem::testing::main_with_jobs(argc, argv, run_worker); }
