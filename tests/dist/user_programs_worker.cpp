// Training programs in LibTorch's usual styles, adopted with the lines tandem's README asks for
// (marked `// tandem`), for tests/dist/user_programs_test.cpp:
//   mnist  the official MNIST example's convnet: typed members made by register_module, a
//          torch::data data set mapped through Normalize and Stack, NLL loss, SGD; gradients
//          cleared through the module before the forward (--zero_grad module), a loop over
//          `p.grad().zero_()` (grad_loop), or the prepared optimizer after (after) or before
//          (before) the step
//   lstm   a word-level LSTM language model returning its state, carried (detached) from batch
//          to batch, Adam
//   gan    LibTorch's DCGAN loop: a generator and a discriminator with BatchNorm, two Adam
//          optimizers, `zero_grad()` through each module, the generator's forward before the
//          discriminator's step and its backward after; each rank also trains a plain copy with
//          a hand-written allreduce-mean of the gradients on the same batches (the reference)
// Every mode writes the model's state (parameters, then buffers) as raw float32 to --out from
// the main process; gan writes the reference's state to --ref_out.
#include <torch/torch.h>

#include <tandem/tandem.h>

#include <CLI/CLI.hpp>

#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Args {
  std::string mode = "mnist";
  std::string zero_grad = "after";
  std::string out, ref_out;
  int64_t batch = 8;  // per rank
  int steps = 6;
};

void write_state(tandem::Accelerator& acc, torch::nn::Module& model, const std::string& path) {
  auto state = acc.get_state_dict(model);  // every rank: ZeRO-3 gathers
  if (!acc.is_main_process() || path.empty()) return;
  std::ofstream out(path, std::ios::binary);
  for (auto& [name, t] : state) {
    auto f = t.to(torch::kFloat).contiguous();
    out.write(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(float));
  }
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

int mnist(const Args& a) {
  tandem::Accelerator acc;  // tandem
  torch::manual_seed(1);
  auto model = std::make_shared<Net>();
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
  write_state(acc, *model, a.out);
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
  write_state(acc, *model, a.out);
  return 0;
}

// ---- gan ----------------------------------------------------------------------------------------

constexpr int64_t kNoise = 8;

struct GeneratorImpl : torch::nn::Module {
  GeneratorImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kNoise, 32))),
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
      : fc1(register_module("fc1", torch::nn::Linear(16, 24))),
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
      pg.allreduce(g);
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
  // Generator then discriminator, parameters and buffers (state dicts list both).
  auto both = [&](const std::string& path, torch::nn::Module& g, torch::nn::Module& d) {
    auto sg = acc.get_state_dict(g);
    auto sd = acc.get_state_dict(d);
    if (!acc.is_main_process() || path.empty()) return;
    std::ofstream out(path, std::ios::binary);
    for (auto* s : {&sg, &sd})
      for (auto& [name, t] : *s) {
        auto f = t.to(torch::kFloat).contiguous();
        out.write(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(float));
      }
  };
  both(a.out, *G, *D);
  if (acc.is_main_process() && !a.ref_out.empty()) {
    std::ofstream out(a.ref_out, std::ios::binary);
    for (torch::nn::Module* m : {static_cast<torch::nn::Module*>(G_ref.ptr().get()),
                                 static_cast<torch::nn::Module*>(D_ref.ptr().get())}) {
      for (auto& t : m->parameters()) {
        auto f = t.detach().to(torch::kFloat).contiguous();
        out.write(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(float));
      }
      for (auto& t : m->buffers()) {
        auto f = t.to(torch::kFloat).contiguous();
        out.write(static_cast<const char*>(f.data_ptr()), f.numel() * sizeof(float));
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("tandem user-program worker");
  Args a;
  app.add_option("mode", a.mode)->check(CLI::IsMember({"mnist", "lstm", "gan"}));
  app.add_option("--zero_grad", a.zero_grad)
      ->check(CLI::IsMember({"after", "before", "module", "grad_loop"}));
  app.add_option("--out", a.out);
  app.add_option("--ref_out", a.ref_out);
  app.add_option("--batch", a.batch);
  app.add_option("--steps", a.steps);
  CLI11_PARSE(app, argc, argv);
  try {
    if (a.mode == "mnist") return mnist(a);
    if (a.mode == "lstm") return lstm(a);
    return gan(a);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
