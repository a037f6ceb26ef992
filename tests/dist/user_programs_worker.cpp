// Training programs in LibTorch's usual styles, adopted with the lines tandem's README asks for
// (marked `// tandem`), for tests/dist/user_programs_test.cpp:
//   mnist  the official MNIST example's convnet: typed members made by register_module, a
//          torch::data data set mapped through Normalize and Stack, NLL loss, SGD; gradients
//          cleared through the module before the forward (--zero_grad module), a loop over
//          `p.grad().zero_()` (grad_loop), or the prepared optimizer after (after) or before
//          (before) the step; --tandem_module: the Net declared with TANDEM_MODULE;
//          --small_buckets: 2 KB gradient buckets (several ZeRO-2 units)
//   lstm   a word-level LSTM language model returning its state, carried (detached) from batch
//          to batch, Adam
//   split  split_between_processes of 7 rows and of a list, plain and padded
//   gan    LibTorch's DCGAN loop: a generator and a discriminator with BatchNorm, two Adam
//          optimizers, `zero_grad()` through each module, the generator's forward before the
//          discriminator's step and its backward after; each rank also trains a plain copy with
//          a hand-written allreduce-mean of the gradients on the same batches (the reference)
//   mlp    a two-layer MLP with SGD on fixed rows split between the processes, and one of the
//          idioms (--idiom): freeze_after (fc1 frozen after prepare), unfreeze (fc1 frozen
//          before prepare, made to train after 2 steps), lbfgs (LBFGS stepped with a closure
//          through the prepared optimizer), steplr (a StepLR stepped on every micro-batch),
//          torch_load (after 2 steps each rank saves the model with torch::save and reads it back
//          into the prepared model with torch::load), clip_user (LibTorch's own
//          clip_grad_norm_ after each backward), none
// Every mode writes the model's state (parameters, then buffers) as raw float32 to --out from
// the main process; gan writes the reference's state to --ref_out.
#include <torch/torch.h>

#include <tandem/tandem.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "../common/jobs_main.h"

namespace {

struct Args {
  std::string mode = "mnist";
  std::string zero_grad = "after";
  std::string out, ref_out;
  int64_t batch = 8;  // per rank
  int steps = 6;
  bool tandem_module = false;  // mnist: the Net declared with TANDEM_MODULE
  bool small_buckets = false;  // mnist: 2 KB buckets (several ZeRO-2 units)
  std::string idiom;           // mlp
};

void write_floats(std::ofstream& out, const torch::Tensor& t) {
  auto f = t.detach().to(torch::kFloat).contiguous();
  out.write(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(float));
}

// The models' states (parameters, then buffers, as get_state_dict lists them) from the main
// process, one after the other.
void write_state(tandem::Accelerator& acc, const std::vector<torch::nn::Module*>& models,
                 const std::string& path) {
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> states;
  for (auto* m : models) states.push_back(acc.get_state_dict(*m));  // every rank: ZeRO-3 gathers
  if (!acc.is_main_process() || path.empty()) return;
  std::ofstream out(path, std::ios::binary);
  for (const auto& state : states)
    for (const auto& [name, t] : state) write_floats(out, t);
}

// ---- mnist --------------------------------------------------------------------------------------

// 12x12 "digits": fixed random images and labels, as a LibTorch Dataset of Examples.
struct Digits : torch::data::datasets::Dataset<Digits> {
  explicit Digits(int64_t n) {
    auto g = torch::make_generator<torch::CPUGeneratorImpl>(1);
    images = torch::rand({n, 1, 12, 12}, g);
    labels = torch::randint(10, {n}, g);
  }
  torch::data::Example<> get(size_t i) override {
    return {images[static_cast<int64_t>(i)], labels[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(images.size(0)); }
  torch::Tensor images, labels;
};

struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/3)),
        fc1(20, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2->forward(x), 2));
    x = x.view({-1, 20});
    x = torch::relu(fc1->forward(x));
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

// The same Net declared with TANDEM_MODULE (one changed line in a real program: the holder's
// declaration), which ZeRO-3 can gather and release as one unit.
struct HookedNetImpl : Net {};
TANDEM_MODULE(HookedNet);

template <class Model>
int mnist(const Args& a, Model model) {
  tandem::AcceleratorOptions options;
  if (a.small_buckets) options.bucket_cap_mb(0.002).first_bucket_cap_mb(0.002);  // 4 buckets
  tandem::Accelerator acc(options);  // tandem
  model = acc.prepare(model);  // tandem
  auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(),
                                                 torch::optim::SGDOptions(0.05).momentum(0.5));
  auto optimizer = acc.prepare(sgd);  // tandem
  auto dataset = Digits(a.batch * acc.num_processes() * a.steps * acc.gradient_accumulation_steps())
                     .map(torch::data::transforms::Normalize<>(0.1307, 0.3081))
                     .map(torch::data::transforms::Stack<>());
  auto loader = acc.prepare_data_loader(  // tandem
      std::move(dataset), tandem::data::DataLoaderOptions().batch_size(a.batch));
  model->train();
  for (auto& batch : *loader) {
    auto scope = acc.accumulate();  // tandem
    if (a.zero_grad == "module") model->zero_grad();
    if (a.zero_grad == "grad_loop")
      for (auto& p : model->parameters())
        if (p.grad().defined()) p.grad().zero_();
    if (a.zero_grad == "before") optimizer.zero_grad();
    auto output = model->forward(batch.data);
    auto loss = torch::nll_loss(output, batch.target);
    acc.backward(loss);  // tandem (was loss.backward())
    optimizer.step();
    if (a.zero_grad == "after") optimizer.zero_grad();
  }
  acc.print("mnist trained", acc.step(), "steps");
  write_state(acc, {model.get()}, a.out);
  return 0;
}

// ---- lstm ---------------------------------------------------------------------------------------

struct LanguageModelImpl : torch::nn::Module {
  LanguageModelImpl(int64_t vocab, int64_t width)
      : embed(register_module("embed", torch::nn::Embedding(vocab, width))),
        lstm(register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(width, width)
                                                         .num_layers(2)
                                                         .batch_first(true)))),
        decoder(register_module("decoder", torch::nn::Linear(width, vocab))) {}
  std::tuple<torch::Tensor, std::tuple<torch::Tensor, torch::Tensor>> forward(
      const torch::Tensor& tokens, torch::optional<std::tuple<torch::Tensor, torch::Tensor>> state) {
    auto [out, next] = lstm->forward(embed->forward(tokens), state);
    return {decoder->forward(out), next};
  }
  torch::nn::Embedding embed;
  torch::nn::LSTM lstm;
  torch::nn::Linear decoder;
};
TORCH_MODULE(LanguageModel);

int lstm(const Args& a) {
  tandem::Accelerator acc;  // tandem
  const int64_t vocab = 17, width = 12, seq = 6;
  torch::manual_seed(2);
  LanguageModel model(vocab, width);
  model = acc.prepare(model);  // tandem
  auto optimizer = acc.prepare(  // tandem
      std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2)));
  // The corpus as rows of tokens; each rank keeps its rows' state from batch to batch, so the
  // loader keeps its order (no shuffle) and every step reads the next seq tokens of each row.
  const int64_t rows = a.batch * acc.num_processes();
  auto g = torch::make_generator<torch::CPUGeneratorImpl>(3);
  auto corpus = torch::randint(vocab, {rows, a.steps * seq + 1}, g);
  auto mine = acc.split_between_processes(corpus);  // tandem: this rank's rows
  torch::optional<std::tuple<torch::Tensor, torch::Tensor>> state;
  for (int step = 0; step < a.steps; ++step) {
    auto input = mine.narrow(1, step * seq, seq);
    auto target = mine.narrow(1, step * seq + 1, seq);
    auto [logits, next] = model->forward(input, state);
    state = std::make_tuple(std::get<0>(next).detach(), std::get<1>(next).detach());
    auto loss = torch::cross_entropy_loss(logits.reshape({-1, vocab}), target.reshape({-1}));
    acc.backward(loss);  // tandem
    optimizer.step();
    optimizer.zero_grad();
  }
  acc.print("lstm trained", acc.step(), "steps");
  write_state(acc, {model.get()}, a.out);
  return 0;
}

// ---- gan ----------------------------------------------------------------------------------------

constexpr int64_t kNoise = 8;

// As in LibTorch's DCGAN, the layers before a BatchNorm have no bias (its gradient is zero in
// exact arithmetic, and Adam would turn rounding noise into steps).
struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl()
      : fc1(register_module("fc1", torch::nn::Linear(
                                       torch::nn::LinearOptions(kNoise, 32).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm1d(32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 16))) {}
  torch::Tensor forward(torch::Tensor x) {
    return torch::tanh(fc2->forward(torch::relu(bn1->forward(fc1->forward(x)))));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Generator);

struct DiscriminatorImpl : torch::nn::Module {
  DiscriminatorImpl()
      : fc1(register_module("fc1",
                            torch::nn::Linear(torch::nn::LinearOptions(16, 24).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm1d(24))),
        fc2(register_module("fc2", torch::nn::Linear(24, 1))) {}
  torch::Tensor forward(torch::Tensor x) {
    return torch::sigmoid(
        fc2->forward(torch::leaky_relu(bn1->forward(fc1->forward(x)), 0.2)));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Discriminator);

// One DCGAN iteration on (real, noise), in the order of LibTorch's example.
template <class Step, class Backward>
void gan_iteration(Generator& G, Discriminator& D, const torch::Tensor& real,
                   const torch::Tensor& noise, Backward backward, Step d_step, Step g_step) {
  const auto n = real.size(0);
  D->zero_grad();
  auto real_out = D->forward(real);
  auto d_loss_real = torch::binary_cross_entropy(real_out, torch::full({n, 1}, 0.9));
  backward(d_loss_real);
  auto fake = G->forward(noise);
  auto fake_out = D->forward(fake.detach());
  auto d_loss_fake = torch::binary_cross_entropy(fake_out, torch::zeros({n, 1}));
  backward(d_loss_fake);
  d_step();
  G->zero_grad();
  auto g_out = D->forward(fake);
  auto g_loss = torch::binary_cross_entropy(g_out, torch::ones({n, 1}));
  backward(g_loss);
  g_step();
}

int gan(const Args& a) {
  tandem::Accelerator acc;  // tandem
  auto& pg = acc.data_parallel_group();
  const int world = pg.size();
  torch::manual_seed(4);
  Generator G;
  Discriminator D;
  torch::manual_seed(4);
  Generator G_ref;  // the same weights: the hand-written reference
  Discriminator D_ref;
  G = acc.prepare(G);  // tandem
  D = acc.prepare(D);  // tandem
  auto adam = torch::optim::AdamOptions(2e-3).betas({0.5, 0.999});
  auto g_opt = acc.prepare(std::make_shared<torch::optim::Adam>(G->parameters(), adam));  // tandem
  auto d_opt = acc.prepare(std::make_shared<torch::optim::Adam>(D->parameters(), adam));  // tandem
  torch::optim::Adam g_ref_opt(G_ref->parameters(), adam), d_ref_opt(D_ref->parameters(), adam);
  // The reference's data parallel, by hand: each gradient averaged over the ranks after every
  // backward (what DDP does for the parameters a backward reached), rank 0's buffers after each
  // step.
  auto average = [&](torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters()) {
      if (!p.grad().defined()) continue;
      auto g = p.grad().clone();
      pg.allreduce(g, tandem::ReduceOp::kSum);
      p.mutable_grad().copy_(g / world);
    }
  };
  auto sync_buffers = [&](torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    for (auto& b : m.buffers()) pg.broadcast(b, 0);
  };
  for (int step = 0; step < a.steps; ++step) {
    torch::manual_seed(1000 + 10 * step + acc.process_index());  // each rank its own batch
    auto real = torch::tanh(torch::randn({a.batch, 16}) + 0.5);
    auto noise = torch::randn({a.batch, kNoise});
    gan_iteration(
        G, D, real, noise, [&](const torch::Tensor& l) { acc.backward(l); },  // tandem
        std::function<void()>([&] { d_opt.step(); }),
        std::function<void()>([&] { g_opt.step(); }));
    gan_iteration(
        G_ref, D_ref, real, noise,
        [&](const torch::Tensor& l) { l.backward(); },
        std::function<void()>([&] {
          average(*D_ref);
          d_ref_opt.step();
          sync_buffers(*G_ref);
          sync_buffers(*D_ref);
        }),
        std::function<void()>([&] {
          average(*G_ref);
          g_ref_opt.step();
          sync_buffers(*G_ref);
          sync_buffers(*D_ref);
        }));
  }
  acc.print("gan trained", acc.step(), "steps");
  // Generator then discriminator, parameters then buffers.
  write_state(acc, {G.ptr().get(), D.ptr().get()}, a.out);
  if (acc.is_main_process() && !a.ref_out.empty()) {
    std::ofstream out(a.ref_out, std::ios::binary);
    for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(G_ref.ptr().get()),
                                 static_cast<torch::nn::Module*>(D_ref.ptr().get())}) {
      for (auto& t : m->parameters()) write_floats(out, t);
      for (auto& t : m->buffers()) write_floats(out, t);
    }
  }
  return 0;
}

// ---- split ----------------------------------------------------------------------------------------

// split_between_processes on 7 rows (and a list of 7 names), with and without padding.
int split(const Args&) {
  tandem::Accelerator acc;
  auto rows = torch::arange(7);
  auto show = [&](const char* what, const torch::Tensor& t) {
    std::ostringstream os;
    os << "split " << what << " rank " << acc.process_index() << ":";
    for (int64_t i = 0; i < t.size(0); ++i) os << " " << t[i].item<int64_t>();
    std::cout << os.str() << std::endl;
  };
  show("plain", acc.split_between_processes(rows));
  show("padded", acc.split_between_processes(rows, /*apply_padding=*/true));
  std::vector<std::string> names{"a", "b", "c", "d", "e", "f", "g"};
  std::ostringstream os;
  os << "split list rank " << acc.process_index() << ":";
  for (const auto& n : acc.split_between_processes(names, true)) os << " " << n;
  std::cout << os.str() << std::endl;
  return 0;
}

// ---- mlp ------------------------------------------------------------------------------------------

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(4, 8))),
        fc2(register_module("fc2", torch::nn::Linear(8, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TANDEM_MODULE(Mlp);

int mlp(const Args& a) {
  tandem::Accelerator acc;
  torch::manual_seed(0);
  Mlp model;
  auto train_fc1 = [&](bool on) {
    model->fc1->weight.set_requires_grad(on);
    model->fc1->bias.set_requires_grad(on);
  };
  if (a.idiom == "unfreeze") train_fc1(false);
  model = acc.prepare(model);
  std::shared_ptr<torch::optim::Optimizer> raw;
  if (a.idiom == "lbfgs")
    // The strong Wolfe line search evaluates the loss as often as the loss says: a rank handed
    // its own loss would run another number of backwards than its peer.
    raw = std::make_shared<torch::optim::LBFGS>(
        model->parameters(),
        torch::optim::LBFGSOptions(0.1).max_iter(5).line_search_fn("strong_wolfe"));
  else
    raw = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  auto opt = acc.prepare(raw);
  std::shared_ptr<torch::optim::StepLR> sched;
  if (a.idiom == "steplr") {
    sched = std::make_shared<torch::optim::StepLR>(*raw, 2, 0.5);
    acc.prepare_scheduler(sched);
  }
  auto g = torch::make_generator<torch::CPUGeneratorImpl>(2);
  auto xs = torch::randn({8 * a.steps, 4}, g), ys = torch::randn({8 * a.steps, 1}, g);
  for (int step = 0; step < a.steps; ++step) {
    auto x = acc.split_between_processes(xs.narrow(0, 8 * step, 8));
    auto y = acc.split_between_processes(ys.narrow(0, 8 * step, 8));
    if (a.idiom == "freeze_after" && step == 0) train_fc1(false);
    if (a.idiom == "unfreeze" && step == 2) train_fc1(true);
    if (a.idiom == "lbfgs") {
      // This rank's loss: the prepared optimizer hands LBFGS the ranks' average.
      opt.step([&] {
        opt->zero_grad();
        auto loss = torch::mse_loss(model->forward(x), y);
        acc.backward(loss);
        return loss;
      });
      continue;
    }
    if (a.idiom == "torch_load" && step == 2) {
      const std::string path = a.out + ".rank" + std::to_string(acc.process_index()) + ".pt";
      torch::save(model, path);
      torch::load(model, path);
      std::remove(path.c_str());
    }
    auto scope = acc.accumulate();
    auto loss = torch::mse_loss(model->forward(x), y);
    acc.backward(loss);
    if (a.idiom == "clip_user") torch::nn::utils::clip_grad_norm_(model->parameters(), 0.05);
    opt.step();
    opt.zero_grad();
    if (sched) sched->step();
  }
  acc.print("mlp trained", acc.step(), "steps");
  write_state(acc, {model.ptr().get()}, a.out);
  return 0;
}

}  // namespace

int run_worker(int argc, char** argv) {
  CLI::App app("tandem user-program worker");
  Args a;
  app.add_option("mode", a.mode)->check(CLI::IsMember({"mnist", "lstm", "gan", "split", "mlp"}));
  app.add_option("--idiom", a.idiom)
      ->check(CLI::IsMember(
          {"freeze_after", "unfreeze", "lbfgs", "steplr", "torch_load", "clip_user", "none"}));
  app.add_option("--zero_grad", a.zero_grad)
      ->check(CLI::IsMember({"after", "before", "module", "grad_loop"}));
  app.add_option("--out", a.out);
  app.add_option("--ref_out", a.ref_out);
  app.add_option("--batch", a.batch);
  app.add_option("--steps", a.steps);
  app.add_flag("--tandem_module", a.tandem_module);
  app.add_flag("--small_buckets", a.small_buckets);
  CLI11_PARSE(app, argc, argv);
  try {
    if (a.mode == "mnist") {
      torch::manual_seed(1);
      if (a.tandem_module) return mnist(a, HookedNet());
      return mnist(a, std::make_shared<Net>());
    }
    if (a.mode == "lstm") return lstm(a);
    if (a.mode == "split") return split(a);
    if (a.mode == "mlp") return mlp(a);
    return gan(a);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}

int main(int argc, char** argv) { return tandem::testing::main_with_jobs(argc, argv, run_worker); }
